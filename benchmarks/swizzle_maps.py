"""The prebuilt swizzle kernels on the scale maps of gpt-oss (90-byte rows: not 4-byte aligned), DeepSeek-R1 (448
and 16 bytes) and DeepSeek-V3 MXFP8 (64 bytes), all experts, against a copy of the input's bytes; bit-exact against
the torch executor. Where the map takes the kernel that loads runs of rows (``spans``), the kernel that loads a row
at a time (``rows``) runs the same map beside it, rounds alternating.

Per map: a random and a coordinate-coded input (``(7 e + 13 i) % 251 + 1``), the kernel's bytes compared with
``m.apply(x, backend="torch")`` (also for 3 experts read from 2, 1 and 14 bytes past a 16-byte boundary: an expert's
first and last chunks read bytewise); then the kernel time of the median of 30 back-to-back calls
(``in_stream.stream``) of the kernel (readied first, as the planner has it for a steady layer) and of ``copy_`` of the
input, printed as the kernel's bytes read and written a second over the copy's. Needs CUDA.

    PYTHONPATH=. python3 benchmarks/swizzle_maps.py
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from in_stream import stream  # noqa: E402  (the kernel-time measure every kernel figure uses)

from fimoe_lab.kernels import prebuilt  # noqa: E402
from fimoe_lab.recipes import plan_layer  # noqa: E402

CALLS = 30
"""Back-to-back calls a figure's median kernel time is taken over."""

CASES = [  # (label, format, intermediate, hidden, map, experts)
    ("gpt-oss w13_scale", "mxfp4", 2880, 2880, "w13_scale", 128),
    ("gpt-oss w2_scale", "mxfp4", 2880, 2880, "w2_scale", 128),
    ("DeepSeek-R1 w13_scale", "nvfp4", 256, 7168, "w13_scale", 256),
    ("DeepSeek-R1 w2_scale", "nvfp4", 256, 7168, "w2_scale", 256),
    ("DeepSeek-V3 mxfp8 w2_scale", "mxfp8", 2048, 7168, "w2_scale", 256),
]
ROUNDS = 3
"""Rounds of every kernel's timing; the figure is the median round's."""


def coded(experts: int, shape: tuple[int, ...], dev: torch.device) -> torch.Tensor:
    e = torch.arange(experts, device=dev, dtype=torch.int32)[:, None]
    i = torch.arange(math.prod(shape), device=dev, dtype=torch.int32)[None, :]
    return ((e * 7 + i * 13) % 251 + 1).to(torch.uint8).view((experts, *shape))


def main() -> int:
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    failures = []
    for label, fmt, inter, hidden, name, experts in CASES:
        m = plan_layer(fmt, "trtllm", inter, hidden).maps()[name]
        prebuilt.build_plan(m.compiled(), False, dev)  # as the planner has it by a steady layer: row table placed
        x = torch.randint(0, 256, (experts, *m.in_shape), dtype=torch.uint8, device=dev, generator=gen)
        for kind, given in (("random", x), ("coded", coded(experts, m.in_shape, dev))):
            if not torch.equal(m.apply(given, backend="prebuilt"), m.apply(given, backend="torch")):
                failures.append(f"{label} {kind}")
        for offset in (2, 1, 14):
            n = 3 * m.in_bytes
            buf = torch.randint(0, 256, (n + 64,), dtype=torch.uint8, device=dev, generator=gen)
            start = (-buf.data_ptr()) % 16 + offset
            few = buf[start : start + n].view((3, *m.in_shape))
            if not torch.equal(m.apply(few, backend="prebuilt"), m.apply(few, backend="torch")):
                failures.append(f"{label} 3 experts at {offset} bytes past 16")
        out = torch.empty((experts, *m.out_shape), dtype=torch.uint8, device=dev)
        copy = torch.empty_like(x)
        em = m.compiled()
        tables = prebuilt.swizzle_rows_table(em, dev, wait=True).ready()
        adopted = "spans" if len(tables) == 2 else "rows"
        kernels = {adopted: lambda: m.apply(x, out=out, backend="prebuilt")}  # noqa: B023 - called here
        if adopted == "spans":  # the map takes the spans kernel: the rows kernel on the same map beside it
            rows_launches = prebuilt._swizzle(em, x, tables[0])
            kernels["rows"] = lambda: prebuilt._run(rows_launches, x, out)  # noqa: B023
            out.fill_(0x5A)
            kernels["rows"]()
            if not torch.equal(out.view(experts, -1), m.apply(x, backend="torch").view(experts, -1)):
                failures.append(f"{label} rows kernel")
        times: dict[str, list[float]] = {k: [] for k in ("copy", *kernels)}
        for _ in range(ROUNDS):
            times["copy"].append(stream(lambda: copy.copy_(x), CALLS)["kernel_us"])  # noqa: B023
            for k, fn in kernels.items():
                times[k].append(stream(fn, CALLS)["kernel_us"])
        in_b, out_b = x.numel(), out.numel()
        t_copy = statistics.median(times["copy"])
        for k in kernels:
            t = statistics.median(times[k])
            share = ((in_b + out_b) / t) / (2 * in_b / t_copy)
            name = f"{label} ({k})"
            print(f"{name:46s} {share:.3f} of a copy ({t:.1f} us; copy {t_copy:.1f} us)", flush=True)
    print("bit-exact" if not failures else f"MISMATCH: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    code = main()
    print(f"({time.perf_counter() - t0:.1f} s)")
    sys.exit(code)
