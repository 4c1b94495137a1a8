"""Device probe: Triton tile choices for every full-size transform of the benchmark, each
timed in alternation with a same-run device copy (paired rounds, configs in a shuffled
order each round; the ratio is the median of the per-round ratios), every
output checked bit-exact against the default config's.

    python3 benchmarks/probe_tiles.py [--rounds 7] [--out probe.json]

Out of place: the defaults against the previous ones (``PREVIOUS``) and each change
alone undone: ``wide_below`` (a row whose power-of-two chunk is narrower moves as one
masked chunk), ``swizzle_kw`` / ``swizzle_wide_below`` (the same for the 128x4 scale
swizzle's columns; ``swz_kw4`` / ``8`` / ``16``: narrower swizzle tiles), ``evict`` /
``store_cs`` (evict-first loads, streaming stores), ``swz_table`` / ``ip_table`` (a
swizzle's full row table where its bands read the first band's rows shifted). In place (permutations): the in-place
ceiling (a Triton kernel storing each block where it read it: the same bytes read and
written at the same addresses, no permutation) and the default strategy, with the hints, with the previous 64-slot cycle tiles, and for the W2
scales (bands-local maps) the cooperative launch and other band counts a program.
``tiles_4096w``: 4096-word tiles for rows and 2-D runs (the tile size before 2 KB tiles); ``tw*`` / ``2d_*``: other tile sizes and run shapes;
``ip_s*`` / ``ip_bw*`` / ``ip_w8``: other cycle tiles; ``ip_band*``: other cooperative items.
``--copies GB`` first times copy kernels (Triton tile sizes, cache hints, a persistent
grid; ATen's elementwise ``neg``) against torch ``copy_``, the driver's memcpy. Ratio =
(bytes read + written) / time, over the copy's 2 x input / time
(benchmarks/bench_transforms.py's rule).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkout import on_path  # noqa: E402  (PYTHONPATH=TREE measures TREE)

on_path()

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from bench_transforms import PRESETS, save_results, timeit  # noqa: E402

from fimoe_lab.kernels import default_scratch_experts, execute_in_place  # noqa: E402
from fimoe_lab.kernels import triton_gather as tg  # noqa: E402
from fimoe_lab.prepare import plan_layer  # noqa: E402

CUDA = torch.device("cuda")
PREVIOUS = {"wide_below": 0, "swizzle_kw": 32, "swizzle_wide_below": 0, "tile_2d_max_cell": 0}
OUT_OF_PLACE = {
    "default": {},
    "previous": PREVIOUS,
    "tiles_4096w": {"tile_words": 4096, "tile_2d_words": 4096},  # 16 KB tiles
    "hints": {"evict": True, "store_cs": True},
    "narrow": {"wide_below": 0},
    "swz_kw32": {"swizzle_kw": 32, "swizzle_wide_below": 0},
    "swz_kw64": {"swizzle_kw": 64},
    "swz_kw4": {"swizzle_kw": 4, "swizzle_wide_below": 0},  # 2 KB tiles (128 rows x 4 words), as the copy's
    "swz_kw4_w2": {"swizzle_kw": 4, "swizzle_wide_below": 0, "swizzle_warps": 2},
    "swz_kw8": {"swizzle_kw": 8, "swizzle_wide_below": 0},
    "swz_kw16": {"swizzle_kw": 16, "swizzle_wide_below": 0},
    "swz_w2": {"swizzle_warps": 2},
    "swz_w8": {"swizzle_warps": 8},
    # a whole 128-row band a tile, 4 warps, a row-table entry an output row
    "swz_whole_band": {"swizzle_split": 1, "swizzle_warps": 4, "swizzle_band_step": False},
    "swz_table": {"swizzle_band_step": False},  # one row-table entry an output row
    "swz_tb16": {"swizzle_thread_bytes": 16},  # twice the threads a tile (up to 16 warps)
    "swz_tb64": {"swizzle_thread_bytes": 64},
    "swz_sp1": {"swizzle_split": 1},
    "swz_nopair": {"swizzle_pair_rows": False},  # rows read in p order, not in source pairs
    "swz_sp2": {"swizzle_split": 2},  # a band in 2 / 4 / 8 tiles by its p values (runs of 64 / 32 / 16 words)
    "swz_sp4": {"swizzle_split": 4},
    "swz_sp8": {"swizzle_split": 8},
    "swz_sp4_w2": {"swizzle_split": 4, "swizzle_warps": 2},
    "swz_sp2_w8": {"swizzle_split": 2, "swizzle_warps": 8},
    "swz_sp4_w8": {"swizzle_split": 4, "swizzle_warps": 8},
    "swz_sp8_w8": {"swizzle_split": 8, "swizzle_warps": 8},
    "swz_sp2_w16": {"swizzle_split": 2, "swizzle_warps": 16},
    "1d": {"tile_2d_max_cell": 0},
    "2d_run8": {"run_cells": 8},
    "2d_run32": {"run_cells": 32},
    "2d_run4": {"run_cells": 4},
    "2d_run8_tw2048": {"run_cells": 8, "tile_2d_words": 2048},
    "2d_tw2048": {"tile_2d_words": 2048},
    "2d_tw512": {"tile_2d_words": 512},
    "tw256": {"tile_words": 256},
    "tw1024": {"tile_words": 1024},
    "tw512_w2": {"num_warps": 2},
    "tw256_w2": {"tile_words": 256, "num_warps": 2},
    "wide_below64": {"wide_below": 64},
    "max_bw512": {"max_bw": 512},
}
IN_PLACE = {
    "ip_default": {},
    "ip_hints": {"evict": True, "store_cs": True},
    "ip_slots64": {"inplace": "cycles", "cycle_slots": 64},
    "ip_s32": {"cycle_slots": 32},
    "ip_s64_bw32": {"cycle_slots": 64, "cycle_bw": 32},
    "ip_w8": {"cycle_warps": 8},
    "ip_table": {"swizzle_band_step": False},
    "ip_s256": {"cycle_slots": 256},
    "ip_bw128": {"cycle_bw": 128},
    "ip_s256_w8": {"cycle_slots": 256, "cycle_warps": 8},
    "ip_bw128_w8": {"cycle_bw": 128, "cycle_warps": 8},
    "ip_coop": {"local_max_words": 0},  # W2 scales: the cooperative launch instead of the bands-local one
    "ip_local4k": {"local_words": 4096},
    "ip_band32": {"band_words": 32},
    "ip_band128": {"band_words": 128},
    "ip_ctg": {"inplace": "copy-then-gather"},  # the scratch (2%) might stay in L2 between the two launches
    "ip_bandw8": {"band_warps": 8},
    "ip_bandw2": {"band_warps": 2},
    "ip_band_sm2": {"band_per_sm": 2},
    "ip_band_sm4": {"band_per_sm": 4},
    "ip_band_w1_bw16": {"band_warps": 1, "band_words": 16},
    "ip_band_w1_bw32": {"band_warps": 1, "band_words": 32},
    "ip_band_w2_bw32": {"band_warps": 2, "band_words": 32},
    "ip_evict": {"evict": True},
    "ip_cs": {"store_cs": True},
}


@triton.jit
def _same_place(x_ptr, n, B: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
    m = i < n
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=m), mask=m)


@triton.jit
def _copy(x_ptr, y_ptr, n, B: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
    m = i < n
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=m), mask=m)


@triton.jit
def _copy_hinted(x_ptr, y_ptr, n, B: tl.constexpr, EVICT: tl.constexpr, CS: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
    m = i < n
    if EVICT:
        v = tl.load(x_ptr + i, mask=m, eviction_policy="evict_first")
    else:
        v = tl.load(x_ptr + i, mask=m)
    if CS:
        tl.store(y_ptr + i, v, mask=m, cache_modifier=".cs")
    else:
        tl.store(y_ptr + i, v, mask=m)


@triton.jit
def _copy_persistent(x_ptr, y_ptr, n, B: tl.constexpr):
    g = tl.num_programs(0)
    blk = tl.program_id(0)
    nb = tl.cdiv(n, B)
    i = blk.to(tl.int64) * B + tl.arange(0, B)
    v = tl.load(x_ptr + i, mask=i < n)
    while blk < nb:
        j = (blk + g).to(tl.int64) * B + tl.arange(0, B)
        vn = tl.load(x_ptr + j, mask=j < n)
        tl.store(y_ptr + i, v, mask=i < n)
        v, i, blk = vn, j, blk + g


def copies(rounds: int, gb: float) -> dict:
    """Copy kernels against torch ``copy_`` (a contiguous same-dtype copy: the driver's memcpy)."""
    n = int(gb * 1e9) // 4
    x = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device=CUDA)
    y = torch.empty_like(x)
    sms = torch.cuda.get_device_properties(CUDA).multi_processor_count
    fns = {"torch_neg (ATen elementwise)": lambda: torch.neg(x, out=y)}
    for b, w in ((512, 1), (512, 4), (1024, 2), (1024, 4), (2048, 4), (4096, 8), (16384, 16)):
        fns[f"triton B={b} w={w}"] = lambda b=b, w=w: _copy[(triton.cdiv(n, b),)](x, y, n, B=b, num_warps=w)
    for ev, cs in ((True, False), (False, True), (True, True)):
        fns[f"triton 4096/8 evict={ev} cs={cs}"] = lambda ev=ev, cs=cs: _copy_hinted[(triton.cdiv(n, 4096),)](
            x, y, n, B=4096, EVICT=ev, CS=cs, num_warps=8
        )
    for per_sm in (2, 4, 8):
        fns[f"persistent 4096/8 x{per_sm}/SM"] = lambda k=per_sm: _copy_persistent[(sms * k,)](
            x, y, n, B=4096, num_warps=8
        )
    ratios = {k: [] for k in fns}
    for _ in range(rounds):
        tc = timeit(lambda: y.copy_(x), CUDA, 3, warmup=1)
        for k, f in fns.items():
            ratios[k].append(tc / timeit(f, CUDA, 3, warmup=1))
    out = {k: statistics.median(v) for k, v in ratios.items()}
    print(f"copies of {gb} GB, torch copy_ {2 * n * 4 / tc / 1e9:.0f} GB/s:", flush=True)
    for k, v in out.items():
        print(f"  {k:<40} {v:.3f} (spread {max(ratios[k]) - min(ratios[k]):.3f})", flush=True)
    return out


def maps():
    for preset, (experts, hidden, inter, fmts) in PRESETS.items():
        for fmt, label, kw in fmts:
            for tensor, m in plan_layer(fmt, "trtllm", inter, hidden, **kw).maps().items():
                if experts * m.in_bytes >= (64 << 20):
                    yield f"{preset}/{label}/{tensor}", m, experts


def applies(name: str, em) -> bool:
    if name.startswith(("swz", "ip_table")):
        return em.swizzle is not None
    if name.startswith(("narrow", "tw", "tiles_4096w", "wide", "max_bw")):
        return em.swizzle is None
    if name.startswith(("1d", "2d")):
        return em.cell_bytes <= 256 and em.swizzle is None and em.transpose_lines() is not None
    if name.startswith(("ip_coop", "ip_local")):
        return em.bands_local()
    if name.startswith("ip_band"):
        return em.swizzle is not None and not em.bands_local()
    if name.startswith(("ip_s", "ip_w")):
        return em.swizzle is None
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--only", nargs="*", default=None, help="substrings of the transforms to run")
    ap.add_argument("--out")
    ap.add_argument("--copies", type=float, default=0, help="first, copy kernels on this many GB against torch copy_")
    ap.add_argument("--configs", nargs="*", default=None, help="only these configs (names above)")
    args = ap.parse_args()
    records = []
    copy_ratios = copies(args.rounds, args.copies) if args.copies else None
    for label, m, experts in maps():
        if args.only and not any(s in label for s in args.only):
            continue
        em = m.compiled()
        g = torch.Generator(device=CUDA).manual_seed(7)
        x = torch.randint(0, 256, (experts, m.in_bytes), dtype=torch.uint8, device=CUDA, generator=g)
        out = torch.empty((experts, m.out_bytes), dtype=torch.uint8, device=CUDA)
        want = torch.empty_like(out)
        tg.gather_triton(em, x, want)
        dst = torch.empty_like(x)
        xw, dw = x.view(torch.int32).view(-1), dst.view(torch.int32).view(-1)
        n = xw.numel()
        fns = {"triton_copy": lambda: _copy[(triton.cdiv(n, 512),)](xw, dw, n, B=512, num_warps=4)}
        exact = {}
        for name, cfg in OUT_OF_PLACE.items():
            if not applies(name, em) or (args.configs is not None and name not in args.configs):
                continue
            out.fill_(0xAB)
            tg.gather_triton(em, x, out, cfg)
            exact[name] = bool(torch.equal(out, want))
            fns[name] = lambda cfg=cfg: tg.gather_triton(em, x, out, cfg)
        y = None
        if m.is_permutation:
            y = x.clone()
            yw = y.view(torch.int32).view(-1)
            sc = default_scratch_experts(experts)
            fns["ip_ceiling"] = lambda: _same_place[(triton.cdiv(n, 512),)](yw, n, B=512, num_warps=4)
            for name, cfg in IN_PLACE.items():
                if not applies(name, em) or (args.configs is not None and name not in args.configs):
                    continue
                z = x.clone()
                execute_in_place(em, z, 1, config=cfg)
                exact[name] = bool(torch.equal(z, want))
                fns[name] = lambda cfg=cfg: execute_in_place(em, y, sc, config=cfg)
        moved = {k: (x.numel() + (out.numel() if not k.startswith(("ip_", "triton")) else x.numel())) for k in fns}
        ratios = {k: [] for k in fns}
        for r in range(args.rounds):
            keys = list(fns)
            random.Random(r).shuffle(keys)  # no config always runs first or last in a round
            tc = timeit(lambda: dst.copy_(x), CUDA, 3, warmup=1)
            for k in keys:
                ratios[k].append(moved[k] / timeit(fns[k], CUDA, 3, warmup=1) / (2 * x.numel() / tc))
        rec = {
            "transform": label,
            "cell_bytes": em.cell_bytes,
            "gb_in": x.numel() / 1e9,
            "copy_gbps": 2 * x.numel() / tc / 1e9,
            "ratio": {k: statistics.median(v) for k, v in ratios.items()},
            "spread": {k: max(v) - min(v) for k, v in ratios.items()},
            "bit_exact": exact,
        }
        records.append(rec)
        cells = " ".join(f"{k}={v:.3f}" for k, v in rec["ratio"].items())
        bad = [k for k, v in exact.items() if not v]
        print(f"{label:<44} {rec['gb_in']:6.2f} GB {cells}" + (f" NOT EXACT: {bad}" if bad else ""), flush=True)
        del x, out, want, dst, y
        torch.cuda.empty_cache()
    if args.out:
        save_results(args.out, copies=copy_ratios, records=records)


if __name__ == "__main__":
    main()
