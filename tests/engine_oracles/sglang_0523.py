"""SGLang 0.5.23's own FlashInfer TRT-LLM MoE weight preparation, run on saved inputs (the oracle of ``sglang-0.5.23``).

Usage (inside ``.venv-sglang``: torch, FlashInfer 0.7.2 and SGLang 0.5.23 installed with ``--no-deps``)::

    python tests/engine_oracles/sglang_0523.py DIR

Same protocol as ``vllm_034.py`` (``cases.json``, ``inputs.safetensors`` in; ``outputs.safetensors``
raw bytes and ``outputs.json`` out). What runs is SGLang's code, unchanged, from
``layers/moe/moe_runner/flashinfer_trtllm.py``: ``align_fp4_moe_weights_for_flashinfer_trtllm``
(NVFP4, hidden alignment from its ``trtllm_nvfp4_hidden_alignment``; it calls
``quantization/utils.py``'s ``prepare_static_weights_for_trtllm_fp4_moe``) and
``align_fp8_moe_weights_for_flashinfer_trtllm`` (FP8 per-tensor, as ``fp8.py`` calls it),
``align_mxfp8_moe_weights_for_flashinfer_trtllm`` (MXFP8), ``UnquantizedFusedMoEMethod``'s
``_apply_trtllm_bf16_block_layout`` (BF16, on a bare instance holding its permute cache), and
``quantization/utils.py``'s ``swizzle_blockscale`` (NVFP4 CUTLASS scales, the branch of
``ModelOptNvFp4FusedMoEMethod.process_weights_after_loading`` that needs no padding) and
``Mxfp4MoEMethod.process_weights_after_loading`` (MXFP4, its FlashInfer TRT-LLM branch, on a
namespace holding the flags that select it: gpt-oss interleaved W13 and the stacked
``gate_up_interleaved=False`` layout). Per quantization method: ``ModelOptFp8MoEMethod``'s call
``align_fp8_moe_weights_for_flashinfer_trtllm(layer, swap_w13_halves=True)`` (op ``fp8_modelopt``), and the
compressed-tensors schemes' own ``process_weights_after_loading`` for FlashInfer TRT-LLM on a bare scheme:
``CompressedTensorsW8A8Fp8MoE`` (BLOCK strategy), ``CompressedTensorsW4A4Nvfp4MoE`` and
``CompressedTensorsMxInt4MoE`` (``compressed_tensors``, not installed there, is a module holding the
strategy names the schemes compare with). ``mxfp4.py`` binds ``nvfp4_block_scale_interleave`` and
``get_w2_permute_indices_with_cache`` under ``if is_flashinfer_available():`` at import; the
runner binds them as that branch would (FlashInfer's own index helper, the CPU swizzle);
``Tensor.cuda`` is the identity (that branch copies its per-expert constants to the GPU). The
layer is a ``torch.nn.Module`` with the attributes the code reads; its inputs are what SGLang's
loader leaves (the test writes them: intermediate padded at weight creation, NVFP4 gate/up loaded
up-first). Modules load alone (``_isolate``); ``sglang.srt.layers.utils.common`` is real (its
``copy_or_rebind_param`` runs; the runner re-exports it from ``sglang.srt.layers.utils`` as that
package's ``__init__`` does). FlashInfer's CUDA-only ``nvfp4_block_scale_interleave`` is served
on CPU by vLLM-independent pure torch below: the 128x4 swizzle written out from FlashInfer's
``get_sf_out_offset_128x4`` (pad rows to 128 and columns to 4, then order
``(row//128, col//4, row%32, (row%128)//32, col%4)``), flat.
"""

from __future__ import annotations

import enum
import json
import sys
import types
from pathlib import Path
from types import MethodType, SimpleNamespace

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _isolate import isolate  # noqa: E402

CT = "sglang.srt.layers.quantization.compressed_tensors.schemes."


class QuantizationStrategy(enum.Enum):
    """compressed-tensors' strategy names, which the schemes compare by identity (the package is not installed)."""

    TENSOR = "tensor"
    CHANNEL = "channel"
    GROUP = "group"
    BLOCK = "block"
    TOKEN = "token"


_ct = types.ModuleType("compressed_tensors")
_ct.CompressionFormat = enum.Enum("CompressionFormat", "pack_quantized")  # type: ignore[attr-defined]
_ct_quant = types.ModuleType("compressed_tensors.quantization")
_ct_quant.QuantizationStrategy = QuantizationStrategy  # type: ignore[attr-defined]
_ct.quantization = _ct_quant  # type: ignore[attr-defined]
sys.modules.update({"compressed_tensors": _ct, "compressed_tensors.quantization": _ct_quant})
isolate(
    "sglang",
    [
        "sglang.srt.layers.moe.moe_runner.flashinfer_trtllm",
        "sglang.srt.layers.quantization.utils",
        "sglang.srt.layers.utils.common",
        "sglang.srt.layers.quantization.unquant",
        "sglang.srt.layers.quantization.mxfp4",
        CT + "compressed_tensors_w8a8_fp8_moe",
        CT + "compressed_tensors_w4a4_nvfp4_moe",
        CT + "compressed_tensors_w4a4_mxint4_moe",
    ],
)

from sglang.srt.layers.utils import common  # noqa: E402

# the schemes' base class, from the package ``__init__`` that does not run here
sys.modules[CT[:-1]].CompressedTensorsMoEScheme = type("CompressedTensorsMoEScheme", (), {})  # type: ignore[attr-defined]

sys.modules["sglang.srt.layers.utils"].copy_or_rebind_param = common.copy_or_rebind_param  # its __init__'s re-export

import flashinfer  # noqa: E402
import flashinfer.fp4_quantization as fi_fp4  # noqa: E402
import flashinfer.quantization.fp4_quantization as fi_qfp4  # noqa: E402
from flashinfer.fused_moe import core as fi_core  # noqa: E402
from sglang.srt.layers.moe.moe_runner import flashinfer_trtllm as ft  # noqa: E402
from sglang.srt.layers.quantization import mxfp4 as mx  # noqa: E402
from sglang.srt.layers.quantization.compressed_tensors.schemes import (  # noqa: E402
    compressed_tensors_w4a4_mxint4_moe as ct_mxint4,
)
from sglang.srt.layers.quantization.compressed_tensors.schemes import (  # noqa: E402
    compressed_tensors_w4a4_nvfp4_moe as ct_nvfp4,
)
from sglang.srt.layers.quantization.compressed_tensors.schemes import (  # noqa: E402
    compressed_tensors_w8a8_fp8_moe as ct_fp8,
)
from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod as Unquant  # noqa: E402
from sglang.srt.layers.quantization.utils import swizzle_blockscale  # noqa: E402


def _interleave_on_cpu(sf: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    mats = sf if sf.ndim == 3 else sf.reshape(1, *sf.shape[-2:])
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
torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]  # CPU: mxfp4.py's .cuda() copies
# mxfp4.py binds these under ``if is_flashinfer_available():`` at import (a stub reads false here)
mx.nvfp4_block_scale_interleave = _interleave_on_cpu
mx.get_w2_permute_indices_with_cache = fi_core.get_w2_permute_indices_with_cache
# the compressed-tensors MxInt4 scheme binds these under ``if is_flashinfer_available():`` too
ct_mxint4.block_scale_interleave = _interleave_on_cpu
ct_mxint4._maybe_get_cached_w3_w1_permute_indices = fi_core._maybe_get_cached_w3_w1_permute_indices
ct_mxint4.get_w2_permute_indices_with_cache = fi_core.get_w2_permute_indices_with_cache
ct_mxint4.convert_to_block_layout = fi_core.convert_to_block_layout


def _compressed_tensors(c: dict, layer: torch.nn.Module, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The compressed-tensors schemes' own ``process_weights_after_loading`` (FlashInfer TRT-LLM branches), on a
    bare scheme holding the flags that select them."""
    e = t["w13"].shape[0]
    if c["op"] == "fp8_block_ct":  # CompressedTensorsW8A8Fp8MoE, BLOCK strategy
        scheme = SimpleNamespace(
            static_input_scales=False,
            weight_quant=SimpleNamespace(strategy=QuantizationStrategy.BLOCK),
            use_flashinfer_trtllm=True,
        )
        ct_fp8.CompressedTensorsW8A8Fp8MoE.process_weights_after_loading(scheme, layer)
        names = ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale")
    elif c["op"] == "nvfp4_ct":  # CompressedTensorsW4A4Nvfp4MoE (gate loaded first: load_up_proj_weight_first off)
        layer.w13_weight_packed, layer.w2_weight_packed = layer.w13_weight, layer.w2_weight
        del layer.w13_weight, layer.w2_weight
        for name, shape in (("w13_weight_global_scale", (e, 2)), ("w2_weight_global_scale", (e,))):
            setattr(layer, name, torch.nn.Parameter(torch.ones(shape), requires_grad=False))
        for name, shape in (("w13_input_global_scale", (e, 2)), ("w2_input_global_scale", (e,))):
            setattr(layer, name, torch.nn.Parameter(torch.ones(shape), requires_grad=False))
        layer.num_local_experts = e
        scheme = SimpleNamespace(use_flashinfer_trtllm=True)
        ct_nvfp4.CompressedTensorsW4A4Nvfp4MoE.process_weights_after_loading(scheme, layer)
        names = ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale")
    else:  # CompressedTensorsMxInt4MoE: int32 words of q + 8 nibbles, bf16 group scales
        scheme = SimpleNamespace(_cache_permute_indices={})
        scheme.prepare_static_weights_for_kernel = MethodType(
            ct_mxint4.CompressedTensorsMxInt4MoE.prepare_static_weights_for_kernel, scheme
        )
        layer.w13_weight_packed, layer.w2_weight_packed = layer.w13_weight, layer.w2_weight
        ct_mxint4.CompressedTensorsMxInt4MoE.process_weights_after_loading(scheme, layer)
        names = ("w13_weight_packed", "w2_weight_packed", "w13_weight_scale", "w2_weight_scale")
    return {k: getattr(layer, n).data for k, n in zip(("w13", "w2", "s13", "s2"), names)}


def run(c: dict, t: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    layer = torch.nn.Module()
    layer.moe_runner_config = type("Cfg", (), {"is_gated": c["gated"], "activation": "silu"})()
    e = t["w13"].shape[0]
    for k, v in t.items():
        setattr(
            layer,
            {"w13": "w13_weight", "w2": "w2_weight", "s13": "w13_weight_scale", "s2": "w2_weight_scale"}[k],
            torch.nn.Parameter(v, requires_grad=False),
        )
    if c["op"] == "nvfp4":
        layer.w2_input_scale_quant = torch.ones(e)
        layer.g1_alphas = torch.ones(e)
        ft.align_fp4_moe_weights_for_flashinfer_trtllm(
            layer, hidden_alignment=ft.trtllm_nvfp4_hidden_alignment(c["per_token"], c["gated"])
        )
        out = {
            k: getattr(layer, n).data
            for k, n in (
                ("w13", "w13_weight"),
                ("w2", "w2_weight"),
                ("s13", "w13_weight_scale"),
                ("s2", "w2_weight_scale"),
            )
        }
        hidden = layer.trtllm_padded_hidden_size or t["w2"].shape[1]
    elif c["op"] == "nvfp4_cutlass":  # ModelOptNvFp4FusedMoEMethod's CUTLASS branch when no padding is needed
        out = {"w13": t["w13"], "w2": t["w2"], "s13": swizzle_blockscale(t["s13"]), "s2": swizzle_blockscale(t["s2"])}
        assert out["s13"].shape[1] == t["w13"].shape[1], "this branch pads the intermediate size (see vLLM's test)"
        hidden = t["w2"].shape[1]
    elif c["op"] in ("mxfp4", "mxfp4_stacked"):  # Mxfp4MoEMethod.process_weights_after_loading, FlashInfer TRT-LLM
        ip, hp = t["w13"].shape[1] // 2, t["w2"].shape[1]
        method = SimpleNamespace(
            use_marlin=False,
            use_mega_moe=False,
            use_deep_gemm=False,
            _fi_kernel=None,
            use_flashinfer=True,
            intermediate_size_per_partition=ip,
            hidden_size=hp,
        )
        layer.num_local_experts = e
        layer.moe_runner_config.gate_up_interleaved = c["op"] == "mxfp4"
        layer.moe_runner_config.gemm1_alpha = layer.moe_runner_config.gemm1_clamp_limit = None
        layer.w13_weight_bias = torch.nn.Parameter(torch.zeros(e, 2 * ip, dtype=torch.bfloat16), requires_grad=False)
        layer.w2_weight_bias = torch.nn.Parameter(torch.zeros(e, hp, dtype=torch.bfloat16), requires_grad=False)
        mx.Mxfp4MoEMethod.process_weights_after_loading(method, layer)
        out = {
            k: getattr(layer, n).data
            for k, n in (
                ("w13", "w13_weight"),
                ("w2", "w2_weight"),
                ("s13", "w13_weight_scale"),
                ("s2", "w2_weight_scale"),
            )
        }
        hidden = hp
    elif c["op"] == "mxfp8":
        layer.w13_weight_scale_inv = layer.w13_weight_scale
        layer.w2_weight_scale_inv = layer.w2_weight_scale
        ft.align_mxfp8_moe_weights_for_flashinfer_trtllm(layer)
        out = {
            "w13": layer.w13_weight.data,
            "w2": layer.w2_weight.data,
            "s13": layer.w13_weight_scale_inv.data,
            "s2": layer.w2_weight_scale_inv.data,
        }
        hidden = t["w2"].shape[1]
    elif c["op"] == "bf16":  # UnquantizedFusedMoEMethod's block layout, its methods on a bare instance
        method = SimpleNamespace(_cache_permute_indices={})
        method._trtllm_bf16_row_permutation = MethodType(Unquant._trtllm_bf16_row_permutation, method)
        layer.num_local_experts = e
        for name in ("w13_weight", "w2_weight"):
            Unquant._apply_trtllm_bf16_block_layout(method, layer, getattr(layer, name), name)
        out = {"w13": layer.w13_weight.data, "w2": layer.w2_weight.data}
        hidden = t["w2"].shape[1]
    elif c["op"] in ("fp8", "fp8_modelopt"):  # Fp8MoEMethod's call; ModelOptFp8MoEMethod's swaps W13's halves
        layer.w13_input_scale = torch.nn.Parameter(torch.ones(e), requires_grad=False)
        layer.w2_input_scale = torch.nn.Parameter(torch.ones(e), requires_grad=False)
        ft.align_fp8_moe_weights_for_flashinfer_trtllm(layer, swap_w13_halves=c["op"] == "fp8_modelopt")
        out = {"w13": layer.w13_weight.data, "w2": layer.w2_weight.data}
        hidden = t["w2"].shape[1]
    elif c["op"] in ("fp8_block_ct", "nvfp4_ct", "mxint4_ct"):
        out = _compressed_tensors(c, layer, t)
        hidden = t["w2"].shape[1]
    else:
        raise SystemExit(f"unknown op {c['op']}")
    inter = {
        "nvfp4": getattr(layer, "intermediate_size_per_partition", 0),
        "nvfp4_cutlass": 2 * t["w2"].shape[-1],
        "mxfp4": 2 * t["w2"].shape[-1],
        "mxfp4_stacked": 2 * t["w2"].shape[-1],
        "nvfp4_ct": 2 * t["w2"].shape[-1],
        "mxint4_ct": 8 * t["w2"].shape[-1],
    }
    inter = inter.get(c["op"], t["w2"].shape[-1])
    return out, {"inter": inter, "hidden": hidden}


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
        meta[c["name"]] = {"sizes": sizes}
    save_file(outputs, str(d / "outputs.safetensors"))
    (d / "outputs.json").write_text(json.dumps(meta))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
