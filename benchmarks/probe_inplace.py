"""Device probe: in-place strategies side by side (auto, cycles, and the prebuilt cycle kernel
where it loads), checked bit-exact; with
``--sweep``, only the scale maps, over the bands settings.

    python3 benchmarks/probe_inplace.py [--sweep]

Prints, per case, each strategy's time as a ratio to a same-run device copy of the
tensor (read + write counted, like benchmarks/bench_transforms.py) and its peak extra
device memory (``torch.cuda.max_memory_allocated`` above the tensor, plan indices
included: caches are cleared before the measured call).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkout import on_path  # noqa: E402  (PYTHONPATH=TREE measures TREE)

on_path()

import torch  # noqa: E402
from bench_transforms import peak_extra, timeit  # noqa: E402  (same timing rule as the benchmark)

from fimoe_lab.kernels import default_scratch_experts, execute, execute_in_place, prebuilt  # noqa: E402
from fimoe_lab.prepare import plan_layer  # noqa: E402

CUDA = torch.device("cuda")


def cases():
    ds, r1 = plan_layer("fp8", "trtllm", 2048, 7168), plan_layer("nvfp4", "trtllm", 2048, 7168)
    blk, mx = plan_layer("fp8-block", "trtllm", 2048, 7168), plan_layer("mxfp8", "trtllm", 2048, 7168)
    qw = plan_layer("bf16", "trtllm", 1536, 4096)
    return [
        ("deepseek-v3 fp8 w13", ds.w13, 256),
        ("deepseek-v3 fp8 w2", ds.w2, 256),
        ("deepseek-v3 block w13", blk.w13, 256),
        ("deepseek-v3 block w2", blk.w2, 256),
        ("deepseek-v3 mxfp8 w13", mx.w13, 256),
        ("deepseek-v3 mxfp8 w13_scale", mx.w13_scale, 256),
        ("deepseek-v3 mxfp8 w2_scale", mx.w2_scale, 256),
        ("r1 nvfp4 w13", r1.w13, 256),
        ("r1 nvfp4 w2", r1.w2, 256),
        ("r1 nvfp4 w13_scale", r1.w13_scale, 256),
        ("r1 nvfp4 w2_scale", r1.w2_scale, 256),
        ("qwen3-235b bf16 w13", qw.w13, 128),
        ("qwen3-235b bf16 w2", qw.w2, 128),
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="only the scale maps, sweeping the bands strategy's item width, programs per SM, warps",
    )
    args = ap.parse_args()
    strategies = [("auto", {"config": {"inplace": "auto"}}), ("cycles", {"config": {"inplace": "cycles"}})]
    if prebuilt.available("cuda"):
        strategies.append(("prebuilt", {"backend": "prebuilt"}))
    sweep = (
        [
            (
                f"b{bw}/{ps}/{nw}",
                {"config": {"inplace": "bands", "band_words": bw, "band_per_sm": ps, "band_warps": nw}},
            )
            for bw, ps, nw in itertools.product((32, 64, 128, 256), (8, 32), (4, 8))
        ]
        if args.sweep
        else []
    )
    for name, m, experts in cases():
        em = m.compiled()
        if args.sweep and em.swizzle is None:
            continue
        x = torch.randint(0, 256, (7, m.in_bytes), dtype=torch.uint8, device="cuda")
        want = torch.empty_like(x)
        execute(em, x, want)
        swz = em.swizzle is not None
        for (sname, kw), sc in itertools.product(strategies + (sweep if swz else []), (1, 2, 3)):
            y = x.clone()
            execute_in_place(em, y, sc, **kw)
            torch.cuda.synchronize()
            assert torch.equal(y, want), (name, sname, sc)
        x = torch.randint(0, 256, (experts, m.in_bytes), dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(x)
        copy = 2 * x.numel() / timeit(lambda: dst.copy_(x), CUDA, 10)
        del dst
        sc = default_scratch_experts(experts)
        out = [f"{name:<28} {x.numel() / 1e9:6.2f} GB copy {copy / 1e9:5.0f} GB/s"]
        for sname, kw in strategies + (sweep if swz else []):
            t = timeit(lambda: execute_in_place(em, x, sc, **kw), CUDA, 7)
            em._dev.clear()
            pk = peak_extra(lambda: execute_in_place(em, x, sc, **kw), CUDA)
            out.append(f"{sname}={2 * x.numel() / t / copy:.3f}({pk / 1e6:.0f}MB)")
        print(" ".join(out), flush=True)
        del x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
