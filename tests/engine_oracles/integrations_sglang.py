"""SGLang 0.5.23's own NVFP4 TRT-LLM preparation, run twice on the same inputs: as shipped,
then after ``fimoe_lab.integrations.sglang.install()``; reports whether every byte agrees.

Usage (inside ``.venv-sglang``: torch, FlashInfer 0.7.2, SGLang 0.5.23 installed
``--no-deps``; ``PYTHONPATH`` = the repository)::

    python tests/engine_oracles/integrations_sglang.py CASES.json   # prints a JSON report

SGLang is loaded without its heavy dependencies: ``_isolate`` loads
``srt/layers/quantization/utils.py`` and ``srt/layers/moe/moe_runner/flashinfer_trtllm.py``
(which imports the replaced function inside the caller, at call time) from the wheel's own files and stubs every other ``sglang.*`` module. FlashInfer is
the real package; two CPU substitutions hold for both runs: FlashInfer's CUDA-only
``nvfp4_block_scale_interleave`` is the 128x4 swizzle written as SGLang's/vLLM's
reshape-permute (pad rows to 128 and columns to 4, ``(M/128, 4, 32, K/4, 4) -> (M/128, K/4, 32, 4, 4)``,
flattened), and the stubbed ``copy_or_rebind_param`` is a plain ``setattr``.

Cases: ``layer`` runs ``align_fp4_moe_weights_for_flashinfer_trtllm(layer, hidden_alignment)``
(SGLang's padding, the replaced loop, the scale ``g1_scale_c``) and compares every attribute it
sets; ``static`` calls ``prepare_static_weights_for_trtllm_fp4_moe`` directly; ``fp8`` and
``mxfp8`` run ``align_fp8_moe_weights_for_flashinfer_trtllm`` / ``align_mxfp8_moe_weights_for_flashinfer_trtllm``
on a layer namespace (weights, scales, ``format_ue8m0``); ``bf16`` runs
``UnquantizedFusedMoEMethod._apply_trtllm_bf16_block_layout`` on both weights (``unquant.py``
loaded alone too; the method's ``self`` is a namespace with its cache and its bound
``_trtllm_bf16_row_permutation``) and compares the parameters and the cache.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _isolate import isolate  # noqa: E402

QU = "sglang.srt.layers.quantization.utils"
FT = "sglang.srt.layers.moe.moe_runner.flashinfer_trtllm"
UQ = "sglang.srt.layers.quantization.unquant"
isolate("sglang", [QU, FT, UQ])

import flashinfer  # noqa: E402
import flashinfer.fp4_quantization as fi_fp4  # noqa: E402
import flashinfer.quantization.fp4_quantization as fi_q  # noqa: E402
from integrations_common import differences, fill, fingerprint  # noqa: E402

from fimoe_lab import integrations  # noqa: E402
from fimoe_lab.integrations import sglang as fs  # noqa: E402

qu = importlib.import_module(QU)
ft = importlib.import_module(FT)
uq = importlib.import_module(UQ)


def _interleave_on_cpu(sf: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    mats = sf if sf.ndim == 3 else sf.reshape(1, *sf.shape[-2:])
    out = []
    for m in mats:
        rows, cols = m.shape
        pr, pc = -(-rows // 128) * 128, -(-cols // 4) * 4
        padded = torch.zeros((pr, pc), dtype=m.dtype)
        padded[:rows, :cols] = m
        out.append(padded.reshape(pr // 128, 4, 32, pc // 4, 4).permute(0, 3, 2, 1, 4).reshape(-1))
    return torch.cat(out)


for _mod in (fi_fp4, fi_q, flashinfer):
    _mod.block_scale_interleave = _interleave_on_cpu
    _mod.nvfp4_block_scale_interleave = _interleave_on_cpu
ft.copy_or_rebind_param = lambda layer, name, t: setattr(layer, name, t)

LAYER_ATTRS = ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale", "g1_scale_c")


def inputs(c: dict) -> dict[str, torch.Tensor]:
    e, i, h, p, k, s = c["experts"], c["inter"], c["hidden"], 2 if c["gated"] else 1, c["fill"], c.get("seed", 0)
    if c["op"] in ("fp8", "mxfp8"):
        t = {
            "w13": fill((e, p * i, h), torch.float8_e4m3fn, k, s),
            "w2": fill((e, h, i), torch.float8_e4m3fn, k, s + 1),
        }
        if c["op"] == "mxfp8":
            t["s13"], t["s2"] = (
                fill((e, p * i, h // 32), torch.uint8, k, s + 2),
                fill((e, h, i // 32), torch.uint8, k, s + 3),
            )
        return t
    if c["op"] == "bf16":
        return {"w13": fill((e, p * i, h), torch.bfloat16, k, s), "w2": fill((e, h, i), torch.bfloat16, k, s + 1)}
    return {
        "w13": fill((e, p * i, h // 2), torch.uint8, k, s),
        "s13": fill((e, p * i, h // 16), torch.float8_e4m3fn, k, s + 1),
        "w2": fill((e, h, i // 2), torch.uint8, k, s + 2),
        "s2": fill((e, h, i // 16), torch.float8_e4m3fn, k, s + 3),
    }


def run(c: dict, t: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict]:
    e = t["w13"].shape[0]
    cfg = SimpleNamespace(is_gated=c["gated"], activation="silu" if c["gated"] else "relu2")
    if c["op"] == "fp8":
        layer = SimpleNamespace(
            w13_weight=t["w13"],
            w2_weight=t["w2"],
            moe_runner_config=cfg,
            w13_input_scale=torch.tensor(0.75),
            w2_input_scale=torch.tensor(0.3),
            w13_weight_scale=torch.linspace(0.5, 1.5, e),
            w2_weight_scale=torch.linspace(0.2, 0.9, e),
        )
        ft.align_fp8_moe_weights_for_flashinfer_trtllm(layer, swap_w13_halves=c.get("swap", False))
        names = (
            "w13_weight",
            "w2_weight",
            "output1_scales_scalar",
            "output1_scales_gate_scalar",
            "output2_scales_scalar",
        )
        return {n: getattr(layer, n) for n in names}, {}
    if c["op"] == "mxfp8":
        layer = SimpleNamespace(
            w13_weight=t["w13"],
            w2_weight=t["w2"],
            w13_weight_scale_inv=t["s13"],
            w2_weight_scale_inv=t["s2"],
            moe_runner_config=cfg,
        )
        ft.align_mxfp8_moe_weights_for_flashinfer_trtllm(layer)
        names = ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv")
        flags = {n: getattr(layer, n).format_ue8m0 for n in names[2:]}
        return {n: getattr(layer, n) for n in names}, flags
    if c["op"] == "bf16":
        method = SimpleNamespace(_cache_permute_indices={})
        method._trtllm_bf16_row_permutation = types.MethodType(
            uq.UnquantizedFusedMoEMethod._trtllm_bf16_row_permutation, method
        )
        layer = SimpleNamespace(num_local_experts=e, moe_runner_config=cfg)
        params = {
            n: torch.nn.Parameter(t[k], requires_grad=False) for n, k in (("w13_weight", "w13"), ("w2_weight", "w2"))
        }
        for name, param in params.items():
            uq.UnquantizedFusedMoEMethod._apply_trtllm_bf16_block_layout(method, layer, param, name)
        cache = {repr(k): v for k, v in method._cache_permute_indices.items()}
        return {n: p.data for n, p in params.items()}, {"cache": cache}
    if c["op"] == "static":
        r = qu.prepare_static_weights_for_trtllm_fp4_moe(
            t["w13"], t["w2"], t["s13"], t["s2"], c["hidden"], c["inter"], e, is_gated=c["gated"]
        )
        return dict(zip(("w13", "s13", "w2", "s2"), r)), {}
    layer = SimpleNamespace(
        w13_weight=t["w13"],
        w2_weight=t["w2"],
        w13_weight_scale=t["s13"],
        w2_weight_scale=t["s2"],
        w2_input_scale_quant=torch.full((e,), 0.5),
        g1_alphas=torch.linspace(0.25, 2.0, e),
        moe_runner_config=SimpleNamespace(is_gated=c["gated"], activation="silu" if c["gated"] else "relu2"),
    )
    align = ft.trtllm_nvfp4_hidden_alignment(c.get("per_token", False), c["gated"])
    ft.align_fp4_moe_weights_for_flashinfer_trtllm(layer, hidden_alignment=align)
    sizes = {"inter": layer.intermediate_size_per_partition, "hidden": layer.trtllm_padded_hidden_size}
    return {n: getattr(layer, n) for n in LAYER_ATTRS}, sizes


def compare(c: dict) -> dict:
    t = inputs(c)
    ref_in, mine_in = {k: v.clone() for k, v in t.items()}, {k: v.clone() for k, v in t.items()}
    try:
        out, sizes = run(c, ref_in)
        ref = {"fp": fingerprint(out, ref_in), "sizes": sizes}
    except Exception as exc:
        ref = {"error": type(exc).__name__}
    before = dict(integrations.FALLBACKS)
    with fs.installed():
        try:
            out, sizes = run(c, mine_in)
            mine = {"fp": fingerprint(out, mine_in), "sizes": sizes}
        except Exception as exc:
            mine = {"error": type(exc).__name__}
    fell_back = {k: v - before.get(k, 0) for k, v in integrations.FALLBACKS.items() if v != before.get(k, 0)}
    return {"case": c, "diffs": differences(ref, mine)[:5], "fallbacks": fell_back, "engine_error": ref.get("error")}


def install_checks() -> dict[str, Any]:
    r: dict[str, Any] = {}
    original = qu.prepare_static_weights_for_trtllm_fp4_moe
    fs.install()
    fs.install()
    r["replaced"] = qu.prepare_static_weights_for_trtllm_fp4_moe is not original
    targets = (
        qu.prepare_static_weights_for_trtllm_fp4_moe,
        ft.align_fp8_moe_weights_for_flashinfer_trtllm,
        ft.align_mxfp8_moe_weights_for_flashinfer_trtllm,
        uq.UnquantizedFusedMoEMethod._apply_trtllm_bf16_block_layout,
    )
    r["patched"] = sum(hasattr(f, "__fimoe_original__") for f in targets)
    fs.uninstall()
    fs.uninstall()
    r["restored"] = qu.prepare_static_weights_for_trtllm_fp4_moe is original and not any(
        hasattr(f, "__fimoe_original__")
        for f in (
            ft.align_fp8_moe_weights_for_flashinfer_trtllm,
            ft.align_mxfp8_moe_weights_for_flashinfer_trtllm,
            uq.UnquantizedFusedMoEMethod._apply_trtllm_bf16_block_layout,
        )
    )
    strict = dataclasses.replace(fs.INTEGRATION, profile="vllm-0.34", _applied=[])  # another engine's versions
    try:
        strict.install()
        r["refusal"] = None
    except integrations.EngineVersionError as exc:
        r["refusal"] = str(exc)
    r["refusal_changed_nothing"] = qu.prepare_static_weights_for_trtllm_fp4_moe is original
    return r


def main(cases_path: str) -> None:
    cases = json.loads(Path(cases_path).read_text())
    print(
        json.dumps(
            {"flashinfer": flashinfer.__version__, "install": install_checks(), "results": [compare(c) for c in cases]}
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
