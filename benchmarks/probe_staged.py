"""Probe: an in-place BlockMajorK W13 staged through the L2, one expert at a time.

The in-place cycle tiles of a 128-byte-cell transpose scatter their reads and writes over the
whole expert (25-29 MB), which the H200's memory serves at ~0.87-0.89 of a copy. Staging instead
copies expert ``e`` into a one-expert scratch, then gathers it back into place out of place: twice
the traffic, unless the scratch is still in L2 when the gather reads it. This times, against
``copy_`` of the whole tensor in the same run:

- ``shipped``: ``execute_in_place`` (the cycle plan);
- ``staged``: per expert ``S.copy_(x[e])`` then the gather ``S -> x[e]``;
- ``staged-hints``: the copy-in a Triton kernel that reads ``x`` evict-first and stores ``S``
  evict-last, the gather with evict-first loads;
- ``oop-loop``: the gather ``x[e] -> y[e]`` per expert (same launches, no staging: the launch cost);
- each also from a CUDA graph (``graph``), which removes the host's launch cost.

    PYTHONPATH=. python3 benchmarks/probe_staged.py
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
import triton.language as tl  # noqa: E402
from bench_transforms import ratio_to_copy, save_results  # noqa: E402

from fimoe_lab import builders  # noqa: E402
from fimoe_lab.kernels import default_scratch_experts, execute_in_place  # noqa: E402
from fimoe_lab.kernels import triton_gather as tg  # noqa: E402


@triton.jit
def _copy_hinted(x_ptr, s_ptr, n, B: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
    m = i < n
    v = tl.load(x_ptr + i, mask=m, eviction_policy="evict_first")
    tl.store(s_ptr + i, v, mask=m, eviction_policy="evict_last")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = torch.device("cuda")
    cases = {
        "qwen3-235b bf16_block w13": (builders.plan_trtllm_bf16_block_layout(3072, 4096, 1536).w13, 128),
        "deepseek-v3 deepseek_block w13": (builders.plan_shuffle_deepseek_fp8(4096, 7168, 2048).w13, 256),
        "deepseek-v3 deepseek_block w2": (builders.plan_shuffle_deepseek_fp8(4096, 7168, 2048).w2, 256),
    }
    out: dict[str, dict[str, float]] = {}
    for label, (m, experts) in cases.items():
        if args.only and not any(s in label for s in args.only):
            continue
        em = m.compiled()
        x = torch.randint(-(2**31), 2**31 - 1, (experts, m.in_bytes // 4), dtype=torch.int32, device=dev)
        ref = x.clone()
        y = torch.empty_like(x)
        s = torch.empty_like(x[0])
        xb, yb, sb = x.view(torch.uint8), y.view(torch.uint8), s.view(torch.uint8)[None]
        n = s.numel()
        cfg_evict = {"evict": True}

        def shipped():
            execute_in_place(em, xb, default_scratch_experts(experts))

        def staged():
            for e in range(experts):
                s.copy_(x[e])
                tg.gather_triton(em, sb, xb[e : e + 1])

        def staged_hints():
            for e in range(experts):
                _copy_hinted[(triton.cdiv(n, 512),)](x[e], s, n, B=512, num_warps=4)
                tg.gather_triton(em, sb, xb[e : e + 1], cfg_evict)

        def oop_loop():
            for e in range(experts):
                tg.gather_triton(em, xb[e : e + 1], yb[e : e + 1])

        def copy():
            y.copy_(x)

        # bit-exactness of the staged path against the out-of-place gather
        want = torch.empty_like(xb)
        tg.gather_triton(em, xb, want)
        staged()
        assert torch.equal(xb, want), label
        x.copy_(ref)
        staged_hints()
        assert torch.equal(xb, want), label
        del want
        row: dict[str, float] = {}
        for name, fn in (
            ("shipped", shipped),
            ("staged", staged),
            ("staged-hints", staged_hints),
            ("oop-loop", oop_loop),
        ):
            row[name] = ratio_to_copy(fn, copy, dev, args.rounds, min_sample=20e-3)
            print(f"{label:<34} {name:<14} {row[name]:.3f}", flush=True)
        for name, fn in (("staged", staged), ("staged-hints", staged_hints), ("oop-loop", oop_loop)):
            g = torch.cuda.CUDAGraph()
            st = torch.cuda.Stream()
            st.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(st):
                fn()
            torch.cuda.current_stream().wait_stream(st)
            with torch.cuda.graph(g):
                fn()
            row[name + " graph"] = ratio_to_copy(g.replay, copy, dev, args.rounds, min_sample=20e-3)
            print(f"{label:<34} {name + ' graph':<14} {row[name + ' graph']:.3f}", flush=True)
            del g
        out[label] = row
        del x, ref, y, s, xb, yb, sb
        torch.cuda.empty_cache()
    if args.out:
        save_results(args.out, ratio_to_copy=out)


if __name__ == "__main__":
    main()
