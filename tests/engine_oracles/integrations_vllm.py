"""vLLM 0.34.0's own preparation, run twice on the same inputs: as shipped, then after
``fimoe_lab.integrations.vllm.install()``; reports whether every byte agrees.

Usage (inside ``.venv-vllm``: torch, FlashInfer, vLLM 0.34.0 installed ``--no-deps``;
``PYTHONPATH`` = the repository)::

    python tests/engine_oracles/integrations_vllm.py CASES.json   # prints a JSON report

vLLM is loaded without its heavy dependencies: ``_isolate`` loads ``flashinfer_utils``,
``flashinfer_fp4_moe``, ``nvfp4_utils``, ``quant_utils``, ``oracle/nvfp4``, ``oracle/mxfp4``
and ``utils/b12x_moe`` (after install, to check a late ``from ... import``) from the wheel's
own files and stubs every other ``vllm.*`` module. FlashInfer is the real package; its
CUDA-only ``block_scale_interleave`` is served on CPU by vLLM's own pure-torch 128x4 swizzle
``swizzle_blockscale`` (flattened per matrix, as FlashInfer returns it), and
``Tensor.cuda`` is the identity (``swizzle_blockscale`` moves its result to the GPU).
The same substitutions hold for both runs, so they cannot make the runs agree by themselves.

Each case is run through an entry point vLLM calls: ``prepare_fp8_moe_layer_for_fi`` (FP8
per-tensor, DeepSeek FP8 block, MXFP8; TRT-LLM and CUTLASS), ``prepare_nvfp4_moe_layer_for_fi_or_cutlass``
(NVFP4 TRT-LLM and CUTLASS), ``convert_gpt_oss_weight_to_mxfp4_moe_kernel_format`` (gpt-oss MXFP4
on both FlashInfer TRT-LLM backends, biases and the permute-index cache included), ``align_moe_weights_for_fi`` + ``convert_moe_weights_to_flashinfer_trtllm_block_layout``
(BF16 TRT-LLM as ``oracle/unquantized`` calls them), and the replaced functions one by one.
Compared: every returned tensor and every input afterwards (bytes, shape, dtype, and whether
an output aliases an input), the layer's sizes, the permute-index cache; and that no
replacement fell back to vLLM's code.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _isolate import isolate  # noqa: E402
from integrations_common import differences, fill, fingerprint  # noqa: E402

L = "vllm.model_executor.layers."
FU, FP4 = L + "quantization.utils.flashinfer_utils", L + "quantization.utils.flashinfer_fp4_moe"
LATE = L + "quantization.utils.b12x_moe"
isolate(
    "vllm",
    [
        "vllm.utils.math_utils",
        FU,
        FP4,
        LATE,
        L + "quantization.utils.nvfp4_utils",
        L + "quantization.utils.quant_utils",
        L + "fused_moe.oracle.nvfp4",
        L + "fused_moe.oracle.mxfp4",
    ],
)

import flashinfer  # noqa: E402
import flashinfer.fp4_quantization as fi_fp4  # noqa: E402
import flashinfer.quantization.fp4_quantization as fi_q  # noqa: E402
from vllm.model_executor.layers.fused_moe.oracle import mxfp4 as vmx  # noqa: E402
from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import NvFp4MoeBackend  # noqa: E402
from vllm.model_executor.layers.quantization.utils import flashinfer_fp4_moe as fp4  # noqa: E402
from vllm.model_executor.layers.quantization.utils import flashinfer_utils as fu  # noqa: E402
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import swizzle_blockscale  # noqa: E402

from fimoe_lab import integrations  # noqa: E402
from fimoe_lab.integrations import vllm as fv  # noqa: E402

torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]


def _interleave_on_cpu(sf: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    mats = sf if sf.ndim == 3 else sf.reshape(1, *sf.shape[-2:])
    return torch.cat([swizzle_blockscale(m.view(torch.float8_e4m3fn)).view(sf.dtype).reshape(-1) for m in mats])


for _mod in (fi_fp4, fi_q, flashinfer):
    _mod.block_scale_interleave = _interleave_on_cpu
    _mod.nvfp4_block_scale_interleave = _interleave_on_cpu


# ----------------------------------------------------------------------------- inputs


def positive_scales(shape: tuple[int, ...], kind: str, seed: int) -> torch.Tensor:
    """float32 scales > 0 (DeepSeek FP8 block / per-tensor), some below vLLM's 1e-10 clamp."""
    g = torch.Generator().manual_seed(seed)
    x = (
        torch.rand(shape, generator=g) + 0.5
        if kind == "random"
        else torch.arange(1, 1 + torch.Size(shape).numel()).reshape(shape).float()
    )
    x.view(-1)[::7] = 1e-23
    return x


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


def inputs(c: dict) -> dict[str, torch.Tensor]:
    e, i, h, p, k = c["experts"], c["inter"], c["hidden"], 2 if c["act_and_mul"] else 1, c["fill"]
    op, s = c["op"], c.get("seed", 0)
    if op in ("fp8", "swap", "align", "rotate", "deepseek_shuffle"):
        t = {
            "w13": fill((e, p * i, h), torch.float8_e4m3fn, k, s),
            "w2": fill((e, h, i), torch.float8_e4m3fn, k, s + 1),
        }
        if op == "fp8" and c.get("block") == [128, 128]:
            t["s13"] = positive_scales((e, p * -(-i // 128), -(-h // 128)), k, s)
            t["s2"] = positive_scales((e, -(-h // 128), -(-i // 128)), k, s + 1)
        elif op == "fp8" and c.get("block") == [1, 32]:
            t["s13"] = fill((e, p * i, h // 32), torch.uint8, k, s + 2)
            t["s2"] = fill((e, h, i // 32), torch.uint8, k, s + 3)
            if c.get("flat_scales"):
                t["s13"], t["s2"] = t["s13"].reshape(e, -1), t["s2"].reshape(e, -1)
        elif op == "fp8":
            t["s13"], t["s2"] = positive_scales((e,), k, s), positive_scales((e,), k, s + 1)
        return t
    if op == "bf16":
        return {"w13": fill((e, p * i, h), torch.bfloat16, k, s), "w2": fill((e, h, i), torch.bfloat16, k, s + 1)}
    if op == "mxfp4_gptoss":
        return {
            "w13": fill((e, 2 * i, h // 2), torch.uint8, k, s),
            "s13": fill((e, 2 * i, h // 32), torch.uint8, k, s + 1),
            "w2": fill((e, h, i // 2), torch.uint8, k, s + 2),
            "s2": fill((e, h, i // 32), torch.uint8, k, s + 3),
            "b13": fill((e, 2 * i), torch.bfloat16, k, s + 4),
            "b2": fill((e, h), torch.bfloat16, k, s + 5),
        }
    if op == "nvfp4":
        return {
            "w13": fill((e, p * i, h // 2), torch.uint8, k, s),
            "s13": fill((e, p * i, h // 16), torch.float8_e4m3fn, k, s + 1),
            "w2": fill((e, h, i // 2), torch.uint8, k, s + 2),
            "s2": fill((e, h, i // 16), torch.float8_e4m3fn, k, s + 3),
        }
    raise SystemExit(f"unknown op {op}")


# ----------------------------------------------------------------------------- runs
def run(c: dict, t: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict]:
    """Call vLLM's entry point for ``c`` (module lookup at call time: the installed state counts)."""
    op, lay = c["op"], layer(c)
    extra: dict = {}
    if op == "fp8":
        e = t["w13"].shape[0]
        a13, a2 = torch.full((e,), 0.5), torch.full((e,), 0.25)
        r = fu.prepare_fp8_moe_layer_for_fi(lay, t["w13"], t["w2"], t["s13"], a13, t["s2"], a2, is_trtllm=c["trtllm"])
        out = dict(zip(("w13", "w2", "s13", "s2"), r))
    elif op == "nvfp4":
        e = t["w13"].shape[0]
        backend = NvFp4MoeBackend.FLASHINFER_TRTLLM if c["trtllm"] else NvFp4MoeBackend.FLASHINFER_CUTLASS
        r = fp4.prepare_nvfp4_moe_layer_for_fi_or_cutlass(
            backend=backend,
            layer=lay,
            w13=t["w13"],
            w13_scale=t["s13"],
            w13_scale_2=torch.ones(e),
            a13_scale=torch.ones(e),
            w2=t["w2"],
            w2_scale=t["s2"],
            w2_scale_2=torch.ones(e),
            a2_scale=torch.ones(e),
            is_act_and_mul=c["act_and_mul"],
            trtllm_hidden_alignment=fu.trtllm_nvfp4_hidden_alignment(c.get("per_token", False), c["act_and_mul"]),
        )
        out = {"w13": r[0], "s13": r[1], "w2": r[4], "s2": r[5]}
    elif op == "bf16":
        w13, w2, ip = fu.align_moe_weights_for_fi(t["w13"], t["w2"], c["act_and_mul"], min_alignment=128)
        cache: dict = {}
        alias, before = w13.view(torch.uint8), w13.clone()  # another tensor on w13's storage
        o13, o2 = fu.convert_moe_weights_to_flashinfer_trtllm_block_layout(cache, w13, w2, c["act_and_mul"])
        out = {"w13": o13, "w2": o2, "padded_w13": w13, "padded_w2": w2}
        same_storage = o13.untyped_storage().data_ptr() == alias.untyped_storage().data_ptr()
        written = not torch.equal(alias.view(w13.dtype), before) or torch.equal(o13.reshape(w13.shape), before)
        extra = {"ip": ip, "cache": {repr(k): v for k, v in cache.items()}, "in_place": same_storage and written}
    elif op == "mxfp4_gptoss":
        cache: dict = {}
        r = vmx.convert_gpt_oss_weight_to_mxfp4_moe_kernel_format(
            vmx.Mxfp4MoeBackend[c["backend"]],
            lay,
            t["w13"],
            t["w2"],
            t["s13"],
            t["s2"],
            t["b13"],
            t["b2"],
            _cache_permute_indices=cache,
        )
        out = dict(zip(("w13", "w2", "s13", "s2", "b13", "b2"), r))
        extra = {"cache": {repr(k): v for k, v in cache.items()}}
    elif op == "swap":
        out = {"w13": fu.swap_w13_to_w31(t["w13"])}
    elif op == "align":
        r = fu.align_moe_weights_for_fi(t["w13"], t["w2"], c["act_and_mul"], c["align"])
        out, extra = {"w13": r[0], "w2": r[1]}, {"ip": r[2]}
    elif op == "rotate":
        alias = t["w13"].view(torch.uint8)  # another tensor on w13's storage: sees the result if it is written in place
        before = alias.clone()
        fu.rotate_weights_for_fi_trtllm_fp8_per_tensor_moe(t["w13"], t["w2"], c["gated"])
        out, extra = {}, {"alias_unchanged": bool(torch.equal(alias, before))}
    elif op == "deepseek_shuffle":
        out = dict(zip(("w13", "w2"), fu._shuffle_deepseek_fp8_moe_weights(t["w13"], t["w2"])))
    else:
        raise SystemExit(f"unknown op {op}")
    sizes = {
        "inter": lay.moe_config.intermediate_size_per_partition,
        "hidden": lay.moe_config.hidden_dim,
        "hidden_unpadded": lay.moe_config.hidden_dim_unpadded,
        **extra,
    }
    return out, sizes


def compare(c: dict) -> dict:
    t = inputs(c)
    ref_in = {k: v.clone() for k, v in t.items()}
    mine_in = {k: v.clone() for k, v in t.items()}
    try:
        ref_out, ref_sizes = run(c, ref_in)
        ref = {"fp": fingerprint(ref_out, ref_in), "sizes": ref_sizes}
    except Exception as exc:  # the engine refuses: the installed one must refuse too
        ref = {"error": type(exc).__name__}
    before = dict(integrations.FALLBACKS)
    with fv.installed():
        try:
            mine_out, mine_sizes = run(c, mine_in)
            mine = {"fp": fingerprint(mine_out, mine_in), "sizes": mine_sizes}
        except Exception as exc:
            mine = {"error": type(exc).__name__}
    fell_back = {k: v - before.get(k, 0) for k, v in integrations.FALLBACKS.items() if v != before.get(k, 0)}
    diffs = differences(ref, mine)
    return {"case": c, "diffs": diffs[:5], "fallbacks": fell_back, "engine_error": ref.get("error")}


# ----------------------------------------------------------------------------- install checks
def attrs() -> dict[tuple[str, str], int]:
    return {
        (n, a): id(v)
        for n, m in list(sys.modules.items())
        if m is not None and n.startswith("vllm.")
        for a, v in list(getattr(m, "__dict__", {}).items())
        if callable(v)
    }


def install_checks() -> dict[str, Any]:
    r: dict[str, Any] = {}
    before = attrs()
    originals = {p.name: getattr(importlib.import_module(p.module), p.name) for p in fv.INTEGRATION.patches}
    fv.install()
    fv.install()  # idempotent
    after = attrs()
    changed = sorted(f"{m}.{a}" for (m, a), i in after.items() if before.get((m, a)) != i)
    r["changed"] = changed
    r["mxfp4_swap_replaced"] = (
        vmx.swap_w13_to_w31 is fu.swap_w13_to_w31 and fu.swap_w13_to_w31 is not originals["swap_w13_to_w31"]
    )
    late = importlib.import_module(LATE)  # imported after install: binds the replacement
    r["late_import_replaced"] = late.swap_w13_to_w31 is fu.swap_w13_to_w31
    fv.uninstall()
    fv.uninstall()  # idempotent
    restored = attrs()
    r["restored"] = all(restored.get(k) == v for k, v in before.items())
    r["late_import_restored"] = late.swap_w13_to_w31 is originals["swap_w13_to_w31"]
    before = attrs()  # now with the late module
    os.environ[integrations.ENV_VAR] = "1"
    fv.register()  # the vllm.general_plugins entry point
    r["plugin_installed"] = fv.INTEGRATION.is_installed
    fv.uninstall()
    del os.environ[integrations.ENV_VAR]
    strict = dataclasses.replace(fv.INTEGRATION, also_tested_flashinfer=(), _applied=[])
    try:
        strict.install()
        r["refusal"] = None
    except integrations.EngineVersionError as exc:
        r["refusal"] = str(exc)
    r["refusal_changed_nothing"] = attrs() == before
    strict.install(force=True)
    r["forced_changes"] = len(strict._applied)
    strict.uninstall()
    r["forced_restored"] = attrs() == before
    return r


def main(cases_path: str) -> None:
    cases = json.loads(Path(cases_path).read_text())
    report = {
        "flashinfer": flashinfer.__version__,
        "install": install_checks(),
        "results": [compare(c) for c in cases],
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
