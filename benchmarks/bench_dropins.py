"""What users run: the public drop-ins of ``fimoe_lab.prepare`` on full layers, against a same-run copy.

For each drop-in, on one full layer of random bytes (DeepSeek-V3: 256 experts, hidden
7168, intermediate 2048; the BF16 block layout on Qwen3-235B: 128 experts, 4096, 1536):

- ``first``: the first call of this drop-in in the process (plans, maps, kernel loads;
  ``benchmarks/cold_start.py`` measures fresh processes);
- ``warm``: median of ``--repeats`` calls, each timed alone (events around one call, host
  time included), the allocator's cache kept between calls;
- ``fresh``: the same with ``torch.cuda.empty_cache()`` before each call (untimed), so
  outputs and scratch come from ``cudaMalloc``;
- ``seed``: vLLM's per-expert reference code, re-created below (warm; ``seed_*`` below);
- ``copy``: a device ``copy_`` of the same input bytes, timed the same way in the same run;
  ``ratio = (bytes in + bytes out) / time / (2 * bytes in / copy time)``;
- ``peak extra``: device bytes allocated at the peak of a warm call above what was
  allocated before it (outputs included for the out-of-place drop-ins), and that over the
  input's size.

    PYTHONPATH=. python3 benchmarks/bench_dropins.py --out benchmarks/results/dropins_h200.json

CPU (smaller layers, ``--experts``) runs too, without the allocator columns.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkout import on_path  # noqa: E402  (PYTHONPATH=TREE measures TREE)

on_path()

import torch  # noqa: E402

from fimoe_lab import builders, kernels, prepare  # noqa: E402

FP8 = torch.float8_e4m3fn


# ------------------------------------------------------------------ the reference implementations
# vLLM's flashinfer_utils (the per-expert code the drop-ins replace)
# loops over experts for the FP8 per-tensor rotate and the BF16 block layout, and gathers
# all experts at once (one row index per matrix) for the DeepSeek and MXFP8 shuffles. Its
# row indices come from FlashInfer helpers, which need not be installed where this runs; the same
# indices are taken here from our plan's steps (each step is a fixed row/block/scale
# permutation), so what is timed is the reference's loop and gather structure.
def _steps(m):
    return [(st.src, st.cell_bytes, st.fills) for st in m.steps]


def _gather_cells(t, src, cell, fills):
    """``t`` (E, bytes) uint8 -> cells gathered by ``src`` (fills written), all experts at once."""
    e = t.shape[0]
    idx = src.to(t.device)
    o = t.view(e, -1, cell)[:, idx.clamp(min=0)]
    for k, byte in enumerate(fills):
        o[:, idx == -1 - k] = byte
    return o.reshape(e, -1)


def seed_per_expert(m, x):
    """Per expert, per step: gather the expert's cells, then ``torch.stack`` (the reference's rotate loop)."""
    st = [(src.to(x.device), cell, fills) for src, cell, fills in _steps(m)]
    outs = []
    for e in range(x.shape[0]):
        t = x[e].reshape(1, -1).view(torch.uint8)
        for src, cell, fills in st:
            t = _gather_cells(t, src, cell, fills)
        outs.append(t[0])
    return torch.stack(outs)


def seed_per_expert_in_place(m, x):
    """The reference's BF16 block layout: per expert, gather into one expert of scratch, copy back."""
    flat = x.reshape(x.shape[0], -1).view(torch.uint8)
    st = [(src.to(x.device), cell, fills) for src, cell, fills in _steps(m)]
    for e in range(flat.shape[0]):
        t = flat[e : e + 1]
        for src, cell, fills in st:
            t = _gather_cells(t, src, cell, fills)
        flat[e].copy_(t[0])
    return x


def seed_batched(m, x):
    """One gather per step over all experts (the reference's DeepSeek / MXFP8 shuffles)."""
    t = x.reshape(x.shape[0], -1).view(torch.uint8)
    for src, cell, fills in _steps(m):
        t = _gather_cells(t, src, cell, fills)
    return t


# ------------------------------------------------------------------ cases
def make_case(name, experts, dev, g):
    """(inputs, drop-in call, seed call, bytes in, bytes out) for one drop-in."""

    def rnd(*shape):
        return torch.randint(1, 255, shape, dtype=torch.uint8, device=dev, generator=g)

    if name == "rotate":
        e, h, i = experts or 256, 7168, 2048
        w13, w2 = rnd(e, 2 * i, h).view(FP8), rnd(e, h, i).view(FP8)
        plan = builders.plan_rotate_fp8_per_tensor(2 * i, h, i, True)
        ins = [w13, w2]

        def call(a, b):
            prepare.rotate_weights_for_fi_trtllm_fp8_per_tensor_moe(a, b, True)

        def seed(a, b):
            seed_per_expert(plan.w13, a)
            seed_per_expert(plan.w2, b)

        return ins, call, seed, True
    if name == "deepseek":
        e, h, i = experts or 256, 7168, 2048
        ins = [rnd(e, 2 * i, h).view(FP8), rnd(e, h, i).view(FP8)]
        plan = builders.plan_shuffle_deepseek_fp8(2 * i, h, i)

        def call(a, b):
            return prepare.shuffle_deepseek_fp8_moe_weights(a, b)

        def seed(a, b):
            return seed_batched(plan.w13, a), seed_batched(plan.w2, b)

        return ins, call, seed, False
    if name == "mxfp8":
        e, h, i = experts or 256, 7168, 2048
        ins = [rnd(e, 2 * i, h).view(FP8), rnd(e, h, i).view(FP8), rnd(e, 2 * i, h // 32), rnd(e, h, i // 32)]
        plan = builders.plan_shuffle_mxfp8(2 * i, h, i, True, h // 32, i // 32)

        def call(a, b, c, d):
            return prepare.shuffle_mxfp8_moe_weights(a, b, c, d, True)

        def seed(a, b, c, d):
            return tuple(
                seed_batched(m, t) for m, t in zip((plan.w13, plan.w2, plan.w13_scale, plan.w2_scale), (a, b, c, d))
            )

        return ins, call, seed, False
    if name == "bf16_block":
        e, h, i = experts or 128, 4096, 1536
        ins = [rnd(e, 2 * i, 2 * h).view(torch.bfloat16), rnd(e, h, 2 * i).view(torch.bfloat16)]
        plan = builders.plan_trtllm_bf16_block_layout(2 * i, h, i, True)

        cache: dict = {}  # one dict for every call, as an engine passes its own across layers

        def call(a, b):
            return prepare.convert_moe_weights_to_flashinfer_trtllm_block_layout(cache, a, b)

        def seed(a, b):
            seed_per_expert_in_place(plan.w13, a)
            seed_per_expert_in_place(plan.w2, b)

        return ins, call, seed, True
    raise SystemExit(f"unknown case {name}")


CASES = ("rotate", "deepseek", "mxfp8", "bf16_block")


# ------------------------------------------------------------------ timing
def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_call(fn, dev, before=None):
    """Seconds of one call (host time included: events around it on CUDA); ``before`` runs untimed."""
    if before is not None:
        before()
    sync(dev)
    if dev.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def peak_extra(fn, dev):
    if dev.type != "cuda":
        return None
    sync(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    r = fn()
    sync(dev)
    extra = torch.cuda.max_memory_allocated(dev) - base
    del r
    return extra


def bench_case(name, dev, args):
    g = torch.Generator(device=dev).manual_seed(17)
    ins, call, seed, in_place = make_case(name, args.experts, dev, g)
    n_in = sum(t.nbytes for t in ins)
    rec = {"dropin": name, "bytes_in": n_in, "in_place": in_place, "experts": ins[0].shape[0]}
    rec["first_s"] = time_call(lambda: call(*ins), dev)
    # the first calls of a fresh process may run on a stand-in while the executor loads in
    # the background; "warm" is the loaded executor's
    kernels.load_executor(kernels.pick_backend(dev, max(t.nbytes for t in ins)))
    outs = call(*ins)
    n_out = n_in if in_place else sum(t.nbytes for t in outs)
    rec["bytes_out"] = n_out
    del outs
    src = torch.cat([t.reshape(-1).view(torch.uint8) for t in ins])
    dst = torch.empty_like(src)
    reps = args.repeats
    copy = [time_call(lambda: dst.copy_(src), dev) for _ in range(reps)]
    warm = [time_call(lambda: call(*ins), dev) for _ in range(reps)]
    copy += [time_call(lambda: dst.copy_(src), dev) for _ in range(reps)]
    del src, dst
    rec["copy_ms"] = statistics.median(copy) * 1e3
    rec["warm_ms"] = statistics.median(warm) * 1e3
    rec["warm_ratio"] = (n_in + n_out) / rec["warm_ms"] / (2 * n_in / rec["copy_ms"])
    if dev.type == "cuda":
        fresh = [time_call(lambda: call(*ins), dev, before=torch.cuda.empty_cache) for _ in range(reps)]
        rec["fresh_ms"] = statistics.median(fresh) * 1e3
        rec["fresh_ratio"] = (n_in + n_out) / rec["fresh_ms"] / (2 * n_in / rec["copy_ms"])
        pk = peak_extra(lambda: call(*ins), dev)
        rec["peak_extra_bytes"] = pk
        rec["peak_extra_over_input"] = pk / n_in
    if not args.no_seed:
        seed(*ins)  # warm
        s = [time_call(lambda: seed(*ins), dev) for _ in range(max(1, reps // 3))]
        rec["seed_ms"] = statistics.median(s) * 1e3
        rec["seed_ratio"] = (n_in + n_out) / rec["seed_ms"] / (2 * n_in / rec["copy_ms"])
        rec["seed_peak_extra_bytes"] = peak_extra(lambda: seed(*ins), dev)
    del ins
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rec


def _row(r):
    def f(k, spec=".3f"):
        v = r.get(k)
        return "-" if v is None else format(v, spec)

    return (
        f"| {r['dropin']} | {r['experts']} | {r['bytes_in'] / 1e9:.2f} | {'yes' if r['in_place'] else 'no'} | "
        f"{r['first_s']:.3f} | {r['copy_ms']:.2f} | {r['warm_ms']:.2f} | **{r['warm_ratio']:.3f}** | "
        f"{f('fresh_ms', '.2f')} | {f('fresh_ratio')} | {f('seed_ms', '.1f')} | {f('seed_ratio')} | "
        f"{'-' if r.get('peak_extra_bytes') is None else format(r['peak_extra_bytes'] / 1e9, '.3f')} | "
        f"{f('peak_extra_over_input', '.4f')} |"
    )


HEAD = (
    "| drop-in | experts | GB in | in place | first call s | copy ms | warm ms | **warm ratio** | "
    "fresh ms | fresh ratio | seed ms | seed ratio | peak extra GB | peak / input |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=CASES)
    ap.add_argument("--experts", type=int, default=None, help="experts per layer (default: the full model's)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--no-seed", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    env = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:
        pass
    print(HEAD, flush=True)
    records = []
    for name in args.cases:
        records.append(bench_case(name, dev, args))
        print(_row(records[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env, "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
