"""Calibrate the tuner's time model against measured MoE GEMMs on the GPU at hand (the H200).

For several presets and each candidate padding (the tuner's alignment grid on the CUTLASS
backend, what Hopper runs), time one rank's two expert GEMMs
(:func:`fimoe_lab.tune.timing.moe_gemm_us`: ``torch._grouped_mm`` bf16, and FP8 rowwise
through ``torch._scaled_grouped_mm`` where torch has it) at token counts giving
1..8192 tokens per expert, next to the cost model's ``layer_time_us`` for ``--gpu``.
Reports the relative error per case, the median absolute error, how often the padding the
model predicts fastest is (within 5%) the measured fastest, and the calibration constants
of :class:`fimoe_lab.tune.cost.GpuSpec` (``bw_eff``, ``flops_eff``, ``overhead_us``) fitted
by least squares on the log ratio; writes JSON and prints a markdown table.

``torch._grouped_mm`` is a proxy of a fused MoE kernel (no routing, activation or
quantisation of activations inside), not FlashInfer's CUTLASS MoE, which this script does
not need (FlashInfer is not installed on the device).

    PYTHONPATH=. python3 benchmarks/tune_calibrate.py                 # on the GPU (< 4 min on an H200)
    PYTHONPATH=. python3 benchmarks/tune_calibrate.py --dry-run       # anywhere: the cases and predictions only

Needs torch with CUDA for measurements; nothing else beyond the standard library
(no pandas, numba or FlashInfer).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from fimoe_lab.presets import get_preset
from fimoe_lab.specs import get_activation
from fimoe_lab.tune.cost import GpuSpec, get_gpu, layer_time_us
from fimoe_lab.tune.sweep import INTER_ALIGNS, paddings

CASES = (  # (preset, tuner format, TP)
    ("qwen3-30b-a3b", "bf16", 8),
    ("qwen3-30b-a3b", "fp8", 8),
    ("deepseek-v3", "bf16", 8),
    ("deepseek-v3", "fp8", 8),
    ("gpt-oss-120b", "bf16", 1),
    ("gpt-oss-120b", "bf16", 8),
    ("mixtral-8x7b", "bf16", 8),
    ("mixtral-8x7b", "fp8", 8),
    ("nemotron3-nano", "bf16", 4),
)
PER_EXPERT = (1, 4, 16, 64, 256, 1024, 8192)
"""Tokens per expert of the profile; T = per_expert * E / k tokens (every expert touched from 1 up)."""
MAX_ROWS = 1 << 18
"""At most this many routed rows (T * k) per case: the activations of larger ones do not fit the time budget."""


def tokens_for(per_expert: int, experts: int, top_k: int) -> int:
    """Tokens ``T`` whose ``T * k`` rows give ``per_expert`` rows to each of ``E`` experts (at least 1 token)."""
    return max(1, per_expert * experts // top_k)


def predicted(gpu: GpuSpec, fmt: str, act: str, inter: int, hidden: int, experts: int, top_k: int, t: int) -> float:
    """The model's microseconds for one rank on CUTLASS (no tile term), as the tuner predicts."""
    us = layer_time_us(gpu, fmt, act, inter, hidden, experts, top_k, t, None)
    assert us is not None
    return us


def shapes_of(preset: str, fmt: str, tp: int) -> list[tuple[int, int]]:
    """The distinct padded (I', H') of the grid on CUTLASS, unpadded first, at most 3 (time budget)."""
    p = get_preset(preset)
    out: list[tuple[int, int]] = []
    for pad in paddings(p, tp, INTER_ALIGNS, (1,), fmt, backend="cutlass"):
        shape = (pad.padded_intermediate, pad.padded_hidden)
        if shape not in out:
            out.append(shape)
    return out[:3]


def fit(rows: list[dict], gpu: GpuSpec) -> dict:
    """``bw_eff``, ``flops_eff``, ``overhead_us`` minimising the squared log error (a grid search)."""
    best = (math.inf, 1.0, 1.0, 0.0)
    for bw in [x / 20 for x in range(2, 21)]:
        for fl in [x / 20 for x in range(1, 21)]:
            for ov in (0.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0):
                g = replace(gpu, bw_eff=bw, flops_eff=fl, overhead_us=ov)
                err = sum(
                    math.log(
                        predicted(g, r["format"], r["act"], r["I"], r["H"], r["E"], r["k"], r["T"]) / r["measured_us"]
                    )
                    ** 2
                    for r in rows
                )
                best = min(best, (err, bw, fl, ov))
    return {"bw_eff": best[1], "flops_eff": best[2], "overhead_us": best[3]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", default="h200", help="row of the cost model's GPU table to compare with (default h200)")
    ap.add_argument("--dry-run", action="store_true", help="list the cases and predictions, measure nothing")
    ap.add_argument("--repeats", type=int, default=20, help="timed repeats per GEMM pair (median; default 20)")
    ap.add_argument("--budget-s", type=float, default=200.0, help="stop measuring after this many seconds")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/tune_calibration_h200.json"))
    args = ap.parse_args(argv)
    gpu = get_gpu(args.gpu)
    device, note = None, "dry run: nothing measured"
    if not args.dry_run:
        import torch

        from fimoe_lab.tune.timing import gemm_dtype, moe_gemm_us, require_cuda

        device = require_cuda()
        note = f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    start = time.perf_counter()
    rows: list[dict] = []
    for preset, fmt, tp in CASES:
        p = get_preset(preset)
        act = get_activation(p.activation)
        for inter, hidden in shapes_of(preset, fmt, tp):
            for per_expert in PER_EXPERT:
                t = tokens_for(per_expert, p.experts, p.top_k)
                if t * p.top_k > MAX_ROWS:
                    continue
                row = {
                    "preset": preset,
                    "format": fmt,
                    "tp": tp,
                    "act": p.activation,
                    "I": inter,
                    "H": hidden,
                    "E": p.experts,
                    "k": p.top_k,
                    "T": t,
                    "per_expert": per_expert,
                    "predicted_us": predicted(gpu, fmt, p.activation, inter, hidden, p.experts, p.top_k, t),
                    "measured_us": None,
                }
                if device is not None and time.perf_counter() - start < args.budget_s:
                    try:
                        row["measured_us"] = moe_gemm_us(
                            p.experts, p.top_k, t, inter, hidden, act.projections, gemm_dtype(fmt), args.repeats, device
                        )
                    except (RuntimeError, ValueError) as exc:  # a shape or dtype the GEMM refuses
                        row["error"] = str(exc).splitlines()[0][:200]
                rows.append(row)
    timed = [r for r in rows if r["measured_us"]]
    groups: dict[tuple, list[dict]] = {}
    for r in timed:
        groups.setdefault((r["preset"], r["format"], r["tp"], r["per_expert"]), []).append(r)
    ranked = [g for g in groups.values() if len(g) > 1]
    agree = [
        min(g, key=lambda r: r["predicted_us"])["measured_us"] <= 1.05 * min(r["measured_us"] for r in g)
        for g in ranked
    ]
    for r in timed:
        r["rel_error"] = r["predicted_us"] / r["measured_us"] - 1
    fitted = fit(timed, gpu) if timed else {}
    if fitted:
        g = replace(gpu, **fitted)
        for r in timed:
            us = predicted(g, r["format"], r["act"], r["I"], r["H"], r["E"], r["k"], r["T"])
            r["rel_error_fitted"] = us / r["measured_us"] - 1
    summary = {
        "gpu_row": gpu.name,
        "device": note,
        "cases": len(rows),
        "measured": len(timed),
        "median_abs_rel_error": statistics.median(abs(r["rel_error"]) for r in timed) if timed else None,
        "median_abs_rel_error_fitted": statistics.median(abs(r["rel_error_fitted"]) for r in timed) if timed else None,
        "fitted_constants": fitted,
        "padding_choice_agreement": f"{sum(agree)} of {len(agree)}" if agree else None,
        "seconds": round(time.perf_counter() - start, 1),
        "note": "predicted_us: fimoe_lab.tune.cost (datasheet roofline, CUTLASS: no tile term); measured_us: "
        "torch grouped GEMMs (GEMM1 + GEMM2) of one rank, uniform routing over the model's touched experts; "
        "FP4/MXFP4 are not timed",
    }
    if not args.dry_run:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    print(f"# tuner time model vs measured GEMMs ({note}; model row {gpu.name})\n")
    print("| preset | fmt | TP | I' | H' | tok/expert | T | predicted us | measured us | error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        m = f"{r['measured_us']:.1f}" if r["measured_us"] else r.get("error", "-")
        e = f"{100 * r['rel_error']:+.0f}%" if "rel_error" in r else "-"
        print(
            f"| {r['preset']} | {r['format']} | {r['tp']} | {r['I']} | {r['H']} | {r['per_expert']} | {r['T']} | "
            f"{r['predicted_us']:.1f} | {m} | {e} |"
        )
    print("\n" + json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
