"""Device probe: what a transform pays for its launch (host time between the start event and the kernel).

    python3 benchmarks/launch_gap.py [--only w13_scale ...] [--rounds 7] [--out gap.json]

For every full-size map of the benchmark (``--only``: substrings of its name), timed with CUDA events:

- ``lone`` / ``x8``: one call (the device idle before it: a probe's sample of a large map, a conversion's
  first tensor) and eight back to back, per call, for: a torch ``copy_`` of the input (``copy``), the
  executor's ``gather_triton`` (``plain``), Triton's own ``kernel[grid](...)`` with the executor's cached
  plan (``triton``), the compiled kernel started by its runner with everything bound ahead (``bound``),
  and a CUDA graph replay of the call (``graph``: no host time in the way);
- ``host_*``: host time of one such call, nothing queued;
- ``host_1e_*``: host time a call of ``gather_triton``, ``execute`` and ``execute_in_place`` on one
  expert (launch-bound);
- ``ratio_*``: ``plain`` and ``graph`` against a same-run copy in paired, shuffled rounds (the probe's
  rule: bytes read + written over the copy's 2 x input a second; median over rounds).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkout import on_path  # noqa: E402  (PYTHONPATH=TREE measures TREE)

on_path()

import torch  # noqa: E402
from bench_transforms import timeit  # noqa: E402
from probe_tiles import maps  # noqa: E402

from fimoe_lab.kernels import execute, execute_in_place  # noqa: E402
from fimoe_lab.kernels import triton_gather as tg  # noqa: E402

CUDA = torch.device("cuda")


def event_us(fn, calls: int, reps: int = 9) -> float:
    """Median microseconds a call over ``reps`` samples of ``calls`` back-to-back calls between events."""
    return timeit(fn, CUDA, reps, warmup=1, inner=calls) * 1e6


def host_us(fn, calls: int = 1, reps: int = 9) -> float:
    """Median host microseconds a call (``calls`` back to back, the device synchronized around them)."""
    fn()
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


def launchers(em, x, out):
    """The four ways of starting the same gather on ``x`` -> ``out`` (4-byte words), all bit-exact."""
    experts = x.shape[0]
    meta, tiles, src, fills, n_out = tg._prepare(em, 4, x.device, None)
    args = (x.view(torch.int32), out.view(torch.int32), src, fills, em.in_bytes // 4, em.out_bytes // 4, n_out)
    compiled = tg._gather_kernel.warmup(*args, grid=(tiles, experts), **meta)
    names = list(inspect.signature(tg._gather_kernel.fn).parameters)
    values = dict(zip(names, args), **{k: v for k, v in meta.items() if k != "num_warps"})
    runner = compiled[(tiles, experts, 1)]
    bound_args = [values[n] for n in names]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        tg.gather_triton(em, x, out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tg.gather_triton(em, x, out)
    return {
        "plain": lambda: tg.gather_triton(em, x, out),
        "triton": lambda: tg._gather_kernel[(tiles, experts)](*args, **meta),
        "bound": lambda: runner(*bound_args),
        "graph": graph.replay,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", default=None, help="substrings of the transforms to run")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    for label, m, experts in maps():
        if args.only and not any(s in label for s in args.only):
            continue
        em = m.compiled()
        row = {"map": label, "gb_in": experts * m.in_bytes / 1e9}
        x1 = torch.randint(0, 256, (1, m.in_bytes), dtype=torch.uint8, device=CUDA)
        o1 = torch.empty((1, m.out_bytes), dtype=torch.uint8, device=CUDA)
        row["host_1e_gather_triton"] = host_us(lambda: tg.gather_triton(em, x1, o1), 300)
        row["host_1e_execute"] = host_us(lambda: execute(em, x1, o1), 300)
        if m.is_permutation:
            row["host_1e_in_place"] = host_us(lambda: execute_in_place(em, x1, 1), 300)
        x = torch.randint(0, 256, (experts, m.in_bytes), dtype=torch.uint8, device=CUDA)
        out = torch.empty((experts, m.out_bytes), dtype=torch.uint8, device=CUDA)
        dst = torch.empty_like(x)
        want = torch.empty_like(out)
        tg.gather_triton(em, x, want)
        fns = {"copy": lambda: dst.copy_(x), **launchers(em, x, out)}
        exact = {}
        for name, fn in fns.items():
            if name != "copy":
                out.fill_(0xAB)
                fn()
                exact[name] = bool(torch.equal(out, want))
        row["exact"] = exact
        for _ in range(3):
            for name, fn in fns.items():
                for calls, tag in ((1, "lone"), (8, "x8")):
                    row.setdefault(f"{tag}_{name}_us", []).append(event_us(fn, calls))
        for key in [k for k in row if k.startswith(("lone_", "x8_"))]:
            row[key] = statistics.median(row[key])
        for name, fn in fns.items():
            row[f"host_{name}_us"] = host_us(fn)
        ratios = {"plain": [], "graph": []}
        moved = x.numel() + out.numel()
        for r in range(args.rounds):
            keys = list(ratios)
            random.Random(r).shuffle(keys)
            tc = timeit(fns["copy"], CUDA, 3, warmup=1)
            for k in keys:
                ratios[k].append(moved / timeit(fns[k], CUDA, 3, warmup=1) / (2 * x.numel() / tc))
        row.update({f"ratio_{k}": statistics.median(v) for k, v in ratios.items()})
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        del x, out, dst, want, fns
        torch.cuda.empty_cache()
    if args.out:
        import triton

        env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
        with open(args.out, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
