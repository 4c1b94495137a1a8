"""Device probe (prototype, not an executor yet): the W13 scale maps in place through a small ring of
the 2% scratch instead of the cooperative launch's register-held rounds.

    python3 benchmarks/probe_ring.py [--rounds 7] [--out ring.json]

Why: the shipped in-place launch for maps whose output bands read rows from all over the expert
(the W13 scales: gate and up interleaved) holds whole experts in registers, so its programs move in
lock-step rounds with a wait between loading and storing (0.69-0.84 of a copy on the H200,
``benchmarks/RESULTS.md``). Here one cooperative launch pipelines *batches* of ``B`` experts with a lag
``D``: at step ``s`` every program copies its share of batch ``s`` (contiguous words, any program)
into ring slot ``s % R`` (``R = D + 1`` batches), then gathers its items of batch ``s - D`` from the
ring back into place (row permutation + 128x4 swizzle, the executor's own band items). Waits:
copying batch ``s`` needs every program done gathering batch ``s - R`` (its slot); gathering batch
``g`` needs every program done copying it. Both refer to earlier steps, so with every program
resident (cooperative launch) all waits end. The ring (``R * B`` experts, at most 2% of the tensor)
is written and read back within a step or two, so it should stay in L2: HBM then sees the input
read once and the output written once, like a copy.

Ring loads bypass L1 (``.cg``): a slot is rewritten by other SMs between its uses. The counters are
two per batch (copied, gathered), zeroed a call (a prototype). Each configuration is checked
bit-exact against the out-of-place executor on the same input, then timed in paired, shuffled
rounds against a same-run copy and the shipped in-place strategy.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from bench_transforms import timeit  # noqa: E402
from probe_tiles import maps  # noqa: E402

from fimoe_lab.kernels import default_scratch_experts, execute_in_place  # noqa: E402
from fimoe_lab.kernels import triton_gather as tg  # noqa: E402

CUDA = torch.device("cuda")


@triton.jit
def _ring_kernel(
    x_ptr,
    ring_ptr,
    rows_ptr,
    cnt_ptr,
    experts,
    expert_words,
    n_bands,
    per,
    steps,
    CW: tl.constexpr,
    KW: tl.constexpr,
    NK: tl.constexpr,
    NB: tl.constexpr,
    B: tl.constexpr,
    D: tl.constexpr,
    CHUNK: tl.constexpr,
):
    p = tl.program_id(0)
    g_all = tl.num_programs(0)
    r_slots = D + 1
    ew = expert_words.to(tl.int64)
    batch_words = B * ew
    for s in tl.range(0, steps + D):
        if s < steps:  # copy my share of batch s into slot s % R
            if s >= r_slots:
                tg._wait_for(cnt_ptr + 2 * (s - r_slots) + 1, g_all)
            n_here = tl.minimum(B, experts - s * B) * expert_words
            src = x_ptr + s * batch_words
            dst = ring_ptr + (s % r_slots) * batch_words
            for off in tl.range(p * CHUNK, n_here, g_all * CHUNK):
                w = off + tl.arange(0, CHUNK)
                m = w < n_here
                tl.store(dst + w, tl.load(src + w, mask=m), mask=m)
            tg._signal(cnt_ptr + 2 * s)
        g = s - D
        if g >= 0:  # gather my items of batch g from its slot into place
            tg._wait_for(cnt_ptr + 2 * g, g_all)
            items = tl.minimum(B, experts - g * B) * per
            first = (p + g_all - (g * B * per) % g_all) % g_all
            slot = ring_ptr + (g % r_slots) * batch_words
            for i in tl.range(first, items, g_all):
                e = i // per
                t = i % per
                r = (t // NK) * (NB * 128) + tl.arange(0, NB * 128)
                rm = r < n_bands * 128
                sr = tl.load(rows_ptr + r, mask=rm, other=0).to(tl.int64)
                k = (t % NK) * KW + tl.arange(0, KW)
                v = tl.load(
                    slot + e * ew + sr[:, None] * CW + k[None, :],
                    mask=rm[:, None] & (k < CW)[None, :],
                    cache_modifier=".cg",
                )
                tg._store_bands(
                    x_ptr + g * batch_words,
                    tg._swizzle_128x4(v, NB, KW),
                    i,
                    per,
                    n_bands,
                    expert_words,
                    CW,
                    KW,
                    NK,
                    NB,
                )
            tg._signal(cnt_ptr + 2 * g + 1)


def ring_in_place(em, flat, b, d, band_words=64, chunk=512, warps=4, per_sm=None):
    """``flat`` ``(E, bytes)`` permuted in place by the swizzle-form map ``em`` (see the module docstring)."""
    experts, nbytes = flat.shape
    rows, cw, n_rows = em.swizzle
    n_bands = n_rows // 128
    kw = min(triton.next_power_of_2(cw), triton.next_power_of_2(band_words))
    nk = triton.cdiv(cw, kw)
    nb = tg.cells_per_tile(band_words, kw, n_bands) if nk == 1 else 1
    per = triton.cdiv(n_bands, nb) * nk
    steps = triton.cdiv(experts, b)
    ring = torch.empty(((d + 1) * b, nbytes // 4), dtype=torch.int32, device=flat.device)
    cnt = torch.zeros(2 * steps, dtype=torch.int32, device=flat.device)
    args = (flat.view(torch.int32), ring, tg._rows_on(em, rows, flat.device, 2), cnt, experts, nbytes // 4, n_bands)
    args = args + (per, steps)
    meta = dict(CW=cw, KW=kw, NK=nk, NB=nb, B=b, D=d, CHUNK=chunk, num_warps=warps)
    props = torch.cuda.get_device_properties(flat.device)
    fit = tg._blocks_per_sm(_ring_kernel.warmup(*args, grid=(1,), **meta), props)
    grid = props.multi_processor_count * min(fit, per_sm or fit)
    _ring_kernel[(grid,)](*args, launch_cooperative_grid=True, **meta)
    return ring.numel() * 4 / flat.numel()


CONFIGS = {  # (experts a batch, lag in batches, band words, copy chunk words)
    "ring_b1_d1": (1, 1, 64, 512),
    "ring_b1_d3": (1, 3, 64, 512),
    "ring_b2_d1": (2, 1, 64, 512),
    "ring_b1_d1_c2k": (1, 1, 64, 2048),
    "ring_b1_d1_bw32": (1, 1, 32, 512),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--only", nargs="*", default=["w13_scale"])
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS))
    ap.add_argument("--out")
    args = ap.parse_args()
    records = []
    for label, m, experts in maps():
        if not any(s in label for s in args.only) or not m.is_permutation or m.compiled().swizzle is None:
            continue
        em = m.compiled()
        x = torch.randint(0, 256, (experts, m.in_bytes), dtype=torch.uint8, device=CUDA)
        want = torch.empty_like(x)
        tg.gather_triton(em, x, want)
        dst = torch.empty_like(x)
        y = x.clone()
        sc = default_scratch_experts(experts)
        fns = {"ip_default": lambda: execute_in_place(em, y, sc)}
        rec = {"transform": label, "gb_in": x.numel() / 1e9, "exact": {}, "ring_over_input": {}}
        for name in args.configs:
            b, d, bw, chunk = CONFIGS[name]
            if (d + 1) * b > max(sc, 1):  # the ring must fit the 2% scratch
                continue
            z = x.clone()
            rec["ring_over_input"][name] = ring_in_place(em, z, b, d, bw, chunk)
            rec["exact"][name] = bool(torch.equal(z, want))
            fns[name] = lambda b=b, d=d, bw=bw, chunk=chunk: ring_in_place(em, y, b, d, bw, chunk)
        ratios = {k: [] for k in fns}
        for r in range(args.rounds):
            keys = list(fns)
            random.Random(r).shuffle(keys)
            tc = timeit(lambda: dst.copy_(x), CUDA, 3, warmup=1)
            for k in keys:
                ratios[k].append(2 * x.numel() / timeit(fns[k], CUDA, 3, warmup=1) / (2 * x.numel() / tc))
        rec["ratio"] = {k: statistics.median(v) for k, v in ratios.items()}
        records.append(rec)
        print(json.dumps(rec), flush=True)
        del x, want, dst, y
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "triton": triton.__version__, "records": records}, f)


if __name__ == "__main__":
    main()
