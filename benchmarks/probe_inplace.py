"""Device probe: in-place strategies (pipeline vs persistent) for correctness and speed.

    python3 benchmarks/probe_inplace.py
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from fimoe_lab.kernels import execute, execute_in_place  # noqa: E402
from fimoe_lab.prepare import plan_layer  # noqa: E402


def t_events(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


cases = [("deepseek-v3 fp8 w13", plan_layer("fp8", "trtllm", 2048, 7168).w13, 256),
         ("deepseek-v3 block w13", plan_layer("fp8-block", "trtllm", 2048, 7168).w13, 256),
         ("r1 nvfp4 w13", plan_layer("nvfp4", "trtllm", 2048, 7168).w13, 256),
         ("r1 nvfp4 w2", plan_layer("nvfp4", "trtllm", 2048, 7168).w2, 256),
         ("qwen3-235b bf16 w13", plan_layer("bf16", "trtllm", 1536, 4096).w13, 128),
         ("r1 nvfp4 w13_scale", plan_layer("nvfp4", "trtllm", 2048, 7168).w13_scale, 256)]
for name, m, experts in cases:
    # correctness first, on a few experts
    x = torch.randint(0, 256, (7, m.in_bytes), dtype=torch.uint8, device="cuda")
    want = torch.empty_like(x)
    execute(m, x, want)
    for sc in (1, 2, 3):
        y = x.clone()
        execute_in_place(m, y, sc, config={"inplace": "persistent"})
        torch.cuda.synchronize()
        assert torch.equal(y, want), (name, sc)
    x = torch.randint(0, 256, (experts, m.in_bytes), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(x)
    copy = 2 * x.numel() / t_events(lambda: dst.copy_(x), 10)
    del dst
    line = [f"{name:<24} copy {copy / 1e9:7.0f} GB/s"]
    for strat in ("pipeline", "persistent"):
        for sc in (1, 2, 5):
            cfg = {"inplace": strat}
            t = t_events(lambda: execute_in_place(m, x, sc, config=cfg))
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            execute_in_place(m, x, sc, config=cfg)
            torch.cuda.synchronize()
            pk = torch.cuda.max_memory_allocated() - base
            line.append(f"{strat[:4]}{sc}={2 * x.numel() / t / copy:.3f} ({pk / 1e6:.0f}MB)")
    print(" ".join(line), flush=True)
    del x
    torch.cuda.empty_cache()
