"""Device probe for Nsight Compute: one warm call of each chosen transform and tile config, and a
Triton copy of the same bytes, inside ``cudaProfilerStart/Stop``, so that only those kernels are
profiled:

    ncu --profile-from-start off --clock-control none --csv \\
        --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,... \\
        python3 benchmarks/ncu_kernels.py --only mxfp8/w2_scale --configs default swz_whole_band [--experts 256]

``--configs`` takes the names of ``benchmarks/probe_tiles.py`` (out of place, and ``ip_*`` in place,
which runs the map on a copy of the input each time). Each kernel is profiled ``--repeats`` times, in
the order copy, then the configs; the kernel names in ncu's report are ``_copy``, ``_gather_kernel``,
``_cycle_kernel`` and the scale launches'.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkout import on_path  # noqa: E402  (PYTHONPATH=TREE measures TREE)

on_path()

import torch  # noqa: E402
import triton  # noqa: E402
from probe_tiles import IN_PLACE, OUT_OF_PLACE, _copy, maps  # noqa: E402

from fimoe_lab.kernels import execute_in_place  # noqa: E402
from fimoe_lab.kernels import triton_gather as tg  # noqa: E402


def calls(only: list[str], configs: list[str], experts: int | None) -> list:
    """``(label, fn)`` for every map matching ``only``: its copy, then each config that exists."""
    out = []
    for label, m, n in maps():
        if not any(s in label for s in only):
            continue
        em = m.compiled()
        n = experts or n
        x = torch.randint(0, 256, (n, m.in_bytes), dtype=torch.uint8, device="cuda")
        out_t = torch.empty((n, m.out_bytes), dtype=torch.uint8, device="cuda")
        xw, dw = x.view(torch.int32).view(-1), torch.empty_like(x).view(torch.int32).view(-1)
        words = xw.numel()
        out.append((f"{label} copy", lambda xw=xw, dw=dw, k=words: _copy[(triton.cdiv(k, 512),)](xw, dw, k, B=512)))
        for name in configs:
            if name in OUT_OF_PLACE:
                cfg = OUT_OF_PLACE[name]
                out.append((f"{label} {name}", lambda em=em, x=x, o=out_t, c=cfg: tg.gather_triton(em, x, o, c)))
            elif name in IN_PLACE and m.is_permutation:
                cfg, y = IN_PLACE[name], x.clone()
                out.append((f"{label} {name}", lambda em=em, y=y, c=cfg: execute_in_place(em, y, 1, config=c)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="+", required=True, help="substrings of the transforms (probe_tiles names)")
    ap.add_argument("--configs", nargs="+", default=["default"])
    ap.add_argument("--experts", type=int, default=None, help="experts (default: the full layer)")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    todo = calls(args.only, args.configs, args.experts)
    if not todo:
        ap.error("no transform matches --only")
    for _, fn in todo:  # compile and warm every launch first
        fn()
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for _ in range(args.repeats):
        for _, fn in todo:
            fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("\n".join(label for label, _ in todo))


if __name__ == "__main__":
    main()
