"""Transforms called back to back, as a conversion of many tensors runs them: what the device does.

For each transform of ``probe_tiles.maps()`` matching ``--only``, ``--calls`` out-of-place calls in a
row (and, for permutations, in-place calls: ``execute_in_place``, the saves then the tiles) and as many
``copy_`` calls of the same input bytes, each under the torch profiler: kernel time a call, the median
gap between consecutive kernels, and the ratio of the copy's to ours
(kernel alone, and kernel plus gap), next to ``bench_transforms.timeit``'s ratio (events around
samples of about 2 ms, so the first call's host path counts once a sample) and the same with samples
of about ``--long-ms``.

``--backend`` names the executor (default ``triton``; ``prebuilt``: the kernels built ahead of time that stand in
for Triton, run as a model's steady layers run them: the map's plan and row forms built first).

    PYTHONPATH=. python3 benchmarks/in_stream.py --only mxfp8/w2_scale --out results.json
    PYTHONPATH=. python3 benchmarks/in_stream.py --backend prebuilt --out results.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkout import on_path  # noqa: E402  (PYTHONPATH=TREE measures TREE)

on_path()

import torch  # noqa: E402
from bench_transforms import ratio_to_copy, save_results  # noqa: E402
from probe_tiles import maps  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from fimoe_lab.kernels import default_scratch_experts, execute, execute_in_place, prebuilt  # noqa: E402


def stream(fn, calls: int) -> dict:
    """Kernel time and gaps (us) a call, over ``calls`` back-to-back calls of ``fn`` (a call may
    launch several kernels: the in-place saves, then the tiles)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    ks = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    durs = [e.time_range.end - e.time_range.start for e in ks]
    gaps = [b.time_range.start - a.time_range.end for a, b in zip(ks, ks[1:])]
    per_call = len(ks) // calls  # every call launches the same kernels
    calls_us = [sum(durs[i : i + per_call]) for i in range(0, per_call * calls, per_call)]
    return {
        "kernels_a_call": per_call,
        "kernel_us": statistics.median(calls_us),  # a call's kernels, the median call
        "gap_us": statistics.median(gaps) * per_call,
    }


def compare(ours, copy, scale: float, args, dev) -> dict:
    """``ours`` against ``copy`` in the stream and by events (samples of ~2 ms and of ``--long-ms``)."""
    a, c = stream(ours, args.calls), stream(copy, args.calls)
    inner = max(1, round(args.long_ms * 1e3 / c["kernel_us"]))
    return {
        "ours": a,
        "copy": c,
        "kernel_ratio": scale * c["kernel_us"] / a["kernel_us"],
        "kernel_and_gap_ratio": scale * (c["kernel_us"] + c["gap_us"]) / (a["kernel_us"] + a["gap_us"]),
        "timeit_ratio": scale * ratio_to_copy(ours, copy, dev, args.rounds),
        "timeit_long_ratio": scale * ratio_to_copy(ours, copy, dev, args.rounds, inner=inner),
    }


def show(label: str, r: dict, long_ms: float) -> None:
    a, c = r["ours"], r["copy"]
    print(
        f"{label:<44} kernels {a['kernel_us']:.1f} us a call (copy {c['kernel_us']:.1f}), gaps {a['gap_us']:.2f} "
        f"({c['gap_us']:.2f}): kernel {r['kernel_ratio']:.3f}, kernel+gap {r['kernel_and_gap_ratio']:.3f}, "
        f"timeit {r['timeit_ratio']:.3f}, timeit {long_ms:g} ms samples {r['timeit_long_ratio']:.3f}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", default=None, help="substrings of the transforms to run")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--long-ms", type=float, default=20.0, help="sample length of the second timeit column")
    ap.add_argument("--no-in-place", action="store_true", help="skip the in-place runs of the permutations")
    ap.add_argument("--backend", choices=("triton", "prebuilt"), default="triton", help="the executor measured")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = torch.device("cuda")
    records = []
    for label, m, experts in maps():
        if args.only and not any(s in label for s in args.only):
            continue
        em = m.compiled()
        if args.backend == "prebuilt":  # as the planner thread has them by a model's steady layers
            prebuilt.build_plan(em, False, dev)
            if m.is_permutation and not args.no_in_place:
                prebuilt.build_plan(em, True)
        x = torch.randint(0, 256, (experts, m.in_bytes), dtype=torch.uint8, device=dev)
        out = torch.empty((experts, m.out_bytes), dtype=torch.uint8, device=dev)
        dst = torch.empty_like(x)

        def ours():
            execute(em, x, out, args.backend)

        def copy():
            dst.copy_(x)

        for _ in range(3):
            ours(), copy()
        torch.cuda.synchronize()
        rec = {"transform": label, "in_place": False, "backend": args.backend}
        rec |= compare(ours, copy, (x.numel() + out.numel()) / (2 * x.numel()), args, dev)
        records.append(rec)
        show(label, rec, args.long_ms)
        if m.is_permutation and not args.no_in_place:
            y, sc = x.clone(), default_scratch_experts(experts)

            def ours_in_place(y=y, sc=sc):
                execute_in_place(em, y, sc, args.backend)

            ours_in_place()
            rec = {"transform": label, "in_place": True, "backend": args.backend} | compare(
                ours_in_place, copy, 1.0, args, dev
            )
            records.append(rec)
            show(label + " in place", rec, args.long_ms)
            del y
        del x, out, dst
        torch.cuda.empty_cache()
    if args.out:
        save_results(args.out, records=records)


if __name__ == "__main__":
    main()
