"""vLLM 0.34.0's own FlashInfer MoE weight preparation, run on saved inputs (the oracle of ``vllm-0.34``).

Usage (inside ``.venv-vllm``: torch, FlashInfer and vLLM 0.34.0 installed with ``--no-deps``)::

    python tests/engine_oracles/vllm_034.py DIR

``DIR/cases.json`` lists cases ``{"name", "op", ...}``; ``DIR/inputs.safetensors`` holds their
tensors as ``<name>.<tensor>``. Writes every prepared tensor as raw bytes (uint8, flat) to
``DIR/outputs.safetensors`` and the sizes the functions return to ``DIR/outputs.json``.

What runs is vLLM's code, unchanged: ``prepare_fp8_moe_layer_for_fi`` (FP8 per-tensor, DeepSeek
FP8 block, MXFP8; TRT-LLM and CUTLASS), ``prepare_nvfp4_moe_layer_for_fi_or_cutlass`` (NVFP4 on
FLASHINFER_TRTLLM / FLASHINFER_CUTLASS, hidden alignment from ``trtllm_nvfp4_hidden_alignment``),
``convert_moe_weights_to_flashinfer_trtllm_block_layout`` after ``align_moe_weights_for_fi(128)``
(BF16 TRT-LLM, as ``oracle/unquantized.py`` calls them), ``convert_weight_to_mxfp4_moe_kernel_format``
(MXFP4 TRT-LLM), ``convert_gpt_oss_weight_to_mxfp4_moe_kernel_format`` (gpt-oss MXFP4 on
TRT-LLM and FLASHINFER_CUTLASS_MXFP4_MXFP8) and ``prepare_static_weights_for_trtllm_mxint4_moe``
(MxInt4 TRT-LLM, from packed signed int4 and bf16 scales). Their modules are loaded alone (``_isolate``: vLLM's
package ``__init__`` needs CUDA extensions); the layer is a namespace with the attributes the code
reads. Two CPU substitutions, both for calls that only run on CUDA: ``Tensor.cuda`` is the
identity (``swizzle_blockscale`` copies its result to the GPU), and FlashInfer's CUDA-only
``block_scale_interleave`` / ``nvfp4_block_scale_interleave`` are served by vLLM's own pure-torch
128x4 swizzle ``swizzle_blockscale`` (flattened per matrix, as FlashInfer returns it; bf16 scales
by the same reshape/permute on 2-byte elements).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _isolate import isolate  # noqa: E402

L = "vllm.model_executor.layers."
isolate(
    "vllm",
    [
        "vllm.utils.math_utils",
        L + "quantization.utils.flashinfer_utils",
        L + "quantization.utils.flashinfer_fp4_moe",
        L + "quantization.utils.flashinfer_mxint4_moe",
        L + "quantization.utils.nvfp4_utils",
        L + "quantization.utils.quant_utils",
        L + "fused_moe.oracle.nvfp4",
        L + "fused_moe.oracle.mxfp4",
    ],
)

import flashinfer  # noqa: E402
import flashinfer.fp4_quantization as fi_fp4  # noqa: E402
import flashinfer.quantization.fp4_quantization as fi_qfp4  # noqa: E402
from vllm.model_executor.layers.fused_moe.oracle import mxfp4 as vmx  # noqa: E402
from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import NvFp4MoeBackend  # noqa: E402
from vllm.model_executor.layers.quantization.utils import flashinfer_mxint4_moe as mxint4  # noqa: E402
from vllm.model_executor.layers.quantization.utils import flashinfer_utils as fu  # noqa: E402
from vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe import (  # noqa: E402
    prepare_nvfp4_moe_layer_for_fi_or_cutlass,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import swizzle_blockscale  # noqa: E402

torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]


def _interleave_on_cpu(sf: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    """FlashInfer's block_scale_interleave on CPU, per matrix, flat: vLLM's swizzle_blockscale for
    1-byte scales; for bf16 scales (MxInt4; swizzle_blockscale takes only E4M3) the same 128x4
    reshape/permute on 2-byte elements."""
    mats = sf if sf.ndim == 3 else sf.reshape(1, *sf.shape[-2:])
    if sf.element_size() == 1:
        return torch.cat([swizzle_blockscale(m.view(torch.float8_e4m3fn)).view(sf.dtype).reshape(-1) for m in mats])
    out = []
    for m in mats:
        rows, cols = m.shape
        rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
        padded = torch.zeros((rp, cp), dtype=m.dtype)
        padded[:rows, :cols] = m
        out.append(padded.reshape(rp // 128, 4, 32, cp // 4, 4).permute(0, 3, 2, 1, 4).reshape(-1))
    return torch.cat(out)


for _module in (flashinfer, fi_fp4, fi_qfp4):
    _module.block_scale_interleave = _interleave_on_cpu
    _module.nvfp4_block_scale_interleave = _interleave_on_cpu


def layer(c: dict) -> SimpleNamespace:
    cfg = SimpleNamespace(
        is_act_and_mul=c["act_and_mul"],
        intermediate_size_per_partition=c["inter"],
        hidden_dim=c["hidden"],
        hidden_dim_unpadded=None,
        moe_parallel_config=SimpleNamespace(enable_eplb=False),
    )
    return SimpleNamespace(
        moe_config=cfg, activation=SimpleNamespace(is_gated=c["gated"]), weight_block_size=c.get("block")
    )


def run(c: dict, t: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    op, lay = c["op"], layer(c)
    if op == "fp8":
        one = torch.ones(t["w13"].shape[0])
        w13, w2, s13, s2 = fu.prepare_fp8_moe_layer_for_fi(
            lay, t["w13"], t["w2"], t["s13"], one, t["s2"], one, is_trtllm=c["trtllm"]
        )
        out = {"w13": w13, "w2": w2, "s13": s13, "s2": s2}
    elif op == "nvfp4":
        e = t["w13"].shape[0]
        backend = NvFp4MoeBackend.FLASHINFER_TRTLLM if c["trtllm"] else NvFp4MoeBackend.FLASHINFER_CUTLASS
        r = prepare_nvfp4_moe_layer_for_fi_or_cutlass(
            backend=backend,
            layer=lay,
            w13=t["w13"].clone(),
            w13_scale=t["s13"].clone(),
            w13_scale_2=torch.ones(e),
            a13_scale=torch.ones(e),
            w2=t["w2"],
            w2_scale=t["s2"],
            w2_scale_2=torch.ones(e),
            a2_scale=torch.ones(e),
            is_act_and_mul=c["act_and_mul"],
            trtllm_hidden_alignment=fu.trtllm_nvfp4_hidden_alignment(c["per_token"], c["act_and_mul"]),
        )
        out = {"w13": r[0], "s13": r[1], "w2": r[4], "s2": r[5]}
    elif op == "bf16":
        w13, w2, padded = fu.align_moe_weights_for_fi(t["w13"], t["w2"], c["act_and_mul"], min_alignment=128)
        lay.moe_config.intermediate_size_per_partition = padded
        w13, w2 = fu.convert_moe_weights_to_flashinfer_trtllm_block_layout({}, w13, w2, c["act_and_mul"])
        out = {"w13": w13, "w2": w2}
    elif op in ("mxfp4", "mxfp4_gptoss"):
        backend = vmx.Mxfp4MoeBackend[c["vbackend"]]
        # the inputs come allocated at vLLM's rounded-up sizes (create_weights)
        lay.moe_config.intermediate_size_per_partition = t["w13"].shape[1] // 2
        lay.moe_config.hidden_dim = t["w2"].shape[1]
        b13 = torch.zeros(t["w13"].shape[:2], dtype=torch.bfloat16)
        b2 = torch.zeros(t["w2"].shape[:2], dtype=torch.bfloat16)
        fn = (
            vmx.convert_weight_to_mxfp4_moe_kernel_format
            if op == "mxfp4"
            else (vmx.convert_gpt_oss_weight_to_mxfp4_moe_kernel_format)
        )
        r = fn(backend, lay, t["w13"], t["w2"], t["s13"], t["s2"], b13, b2, _cache_permute_indices={})
        out = {"w13": r[0], "w2": r[1], "s13": r[2], "s2": r[3]}
    elif op == "mxint4":
        r = mxint4.prepare_static_weights_for_trtllm_mxint4_moe(t["w13"].clone(), t["s13"].clone(), t["w2"], t["s2"])
        out = {"w13": r["gemm1_weights"], "w2": r["gemm2_weights"], "s13": r["gemm1_scales"], "s2": r["gemm2_scales"]}
    else:
        raise SystemExit(f"unknown op {op}")
    sizes = {"inter": lay.moe_config.intermediate_size_per_partition, "hidden": lay.moe_config.hidden_dim}
    return out, sizes


def main(d: Path) -> None:
    cases = json.loads((d / "cases.json").read_text())
    tensors = load_file(str(d / "inputs.safetensors"))
    outputs, meta = {}, {"flashinfer": flashinfer.__version__}
    for c in cases:
        prefix = c["name"] + "."
        mine = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        try:
            out, sizes = run(c, mine)
        except Exception as exc:  # one case's failure is that case's answer, not the run's
            meta[c["name"]] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        for k, v in out.items():
            outputs[prefix + k] = v.contiguous().view(torch.uint8).reshape(-1).clone()
        meta[c["name"]] = {"sizes": sizes, "shapes": {k: list(v.shape) for k, v in out.items()}}
    save_file(outputs, str(d / "outputs.safetensors"))
    (d / "outputs.json").write_text(json.dumps(meta))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
