"""Tile shapes of the GPU executor (:mod:`.triton_gather`), as plain arithmetic on the
executable map: which kernel (``KIND`` 0 ``rows``, 1 ``words``, 2 ``swizzle``), its
constants and the tile count. Kept apart from Triton so the tiling itself is tested on any
machine (every output word covered by exactly one tile: ``tests/test_tiles.py``).
"""

from __future__ import annotations

import numpy as np

from fimoe_lab.kernels.compiled import ExecMap

__all__ = [
    "CONFIG",
    "band_item_readers",
    "cdiv",
    "cells_per_tile",
    "launch_plan",
    "next_pow2",
    "pair_bit",
    "pow2_divisor",
    "row_chunks",
    "swizzle_row_table",
    "swizzle_warps",
    "transposed_tiles",
]

# The Triton executor's tile sizes, chosen on the H200 (benchmarks/RESULTS.md); override for sweeps.
CONFIG = {
    "tile_words": 512,  # 1-D rows tiles: 2 KB a program of 128 threads, as ATen's elementwise kernels
    "tile_2d_words": 1024,  # 2-D tiles (runs of small transposed cells)
    "num_warps": 4,
    "evict": False,
    "store_cs": False,
    "block_1d": 8192,
    "warps_1d": 8,
    "max_bw": 1024,
    "wide_below": 128,
    "tile_2d_max_cell": 256,  # bytes; 0: 1-D tiles only
    "run_cells": 16,
    "swizzle_kw": 128,
    "swizzle_wide_below": 128,
    "swizzle_warps": 0,  # 0: one thread per swizzle_thread_bytes of the tile, 4 to 16 warps
    "swizzle_thread_bytes": 32,
    "use_swizzle": True,
    "swizzle_split": 2,  # a band's 32 p values in this many parts, each its own tile
    "swizzle_band_step": True,  # bands that read the first band's rows shifted take a 128-row table
    "swizzle_pair_rows": True,  # rows under 128 bytes from consecutive source rows: loaded side by side
    # in place (the strategy itself is chosen by the registry: config["inplace"])
    "cycle_bw": 64,
    "cycle_slots": 128,
    "cycle_warps": 4,
    "band_words": 64,
    "band_per_sm": 32,
    "band_warps": 4,
    "local_words": 2048,  # in place, bands-local scale maps: words a program moves (whole bands)
    "local_max_words": 16384,  # ... and the widest band taken that way (wider: the cooperative launch)
}


# Every constexpr of the gather kernel at its neutral value; each tile shape sets its own.
_KERNEL_CONSTANTS = dict(W=1, BM=1, BW=1, NC=1, B=1, KW=1, NK=1, WI=1, CF=0, CM=False, S2=0, R2=1, BS=0, SP=1, PB=0)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, int(n) - 1).bit_length()


def pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two that divides ``n`` and is at most ``cap`` (1 if none is)."""
    p = 1
    while p * 2 <= cap and n % (p * 2) == 0:
        p *= 2
    return p


def row_chunks(w: int, cap: int, wide_below: int) -> tuple[int, int]:
    """Words per tile row ``bw`` (a power of two: Triton's ``arange``) and chunks per row
    ``cdiv(w, bw)`` for rows of ``w`` words: the largest power-of-two divisor of ``w`` up to
    ``cap``; if that is under ``wide_below``, one power-of-two chunk as wide as the row up to
    ``cap`` instead, its overhang masked (a row split into narrow chunks spreads over as many
    programs, and DRAM pages are opened once per chunk)."""
    bw = pow2_divisor(w, cap)
    if bw < wide_below:
        bw = min(next_pow2(w), cap)
    return bw, cdiv(w, bw)


def cells_per_tile(words: int, bw: int, n: int) -> int:
    """Cells (rows) a tile of about ``words`` words takes in chunks of ``bw`` words: at least
    one, at most the power of two covering all ``n``."""
    return max(1, min(words // bw, next_pow2(n)))


def launch_plan(em: ExecMap, word: int, cfg: dict) -> tuple[dict, int, object]:
    """Kernel constants for ``em`` moved as ``word``-byte words, the tile count per expert,
    and (swizzle / padded rows) the source-row table used instead of ``em.src`` with the
    output rows: for a swizzle with ``BS > 0`` (:meth:`ExecMap.band_step`) only the first
    band's 128 entries, band ``b`` reading them plus ``b * BS``."""
    wpc = em.cell_bytes // word
    pr = em.padrows if (cfg.get("use_padrows", True) and word == 4) else None
    if pr is not None and pr[1] % 4 == 0 and pr[2] % 4 == 0:
        rows_src, c_in, c_out, col_code = pr
        w, wi = c_out // 4, c_in // 4
        bw, nc = row_chunks(w, cfg["max_bw"], cfg["wide_below"])
        n_rows = rows_src.size
        bm = cells_per_tile(cfg["tile_words"], bw, n_rows)
        meta = dict(_KERNEL_CONSTANTS, KIND=0, W=w, BM=bm, BW=bw, NC=nc, WI=wi, CF=-1 - col_code, CM=bw * nc > w)
        return dict(meta, num_warps=cfg["num_warps"]), cdiv(n_rows, bm) * nc, (rows_src, n_rows)
    swz = em.swizzle if (cfg["use_swizzle"] and word == 4) else None
    if swz is not None:
        _, cw, rows_out = swz
        kw, nk = row_chunks(cw, cfg["swizzle_kw"], cfg["swizzle_wide_below"])
        if kw >= 4:
            table, step = swizzle_row_table(em, cfg)
            sp = min(cfg["swizzle_split"], max(1, kw // 4))  # tiles of 2 KB or more: a 16-byte vector a thread
            pb = pair_bit(table, sp) if step and cfg["swizzle_pair_rows"] and cw * 4 < 128 else 0
            meta = dict(_KERNEL_CONSTANTS, KIND=2, W=cw, KW=kw, NK=nk, WI=cw, BS=step, SP=sp, PB=pb)
            warps = cfg["swizzle_warps"] or swizzle_warps(kw * 128 // sp * 4, cfg["swizzle_thread_bytes"])
            return dict(meta, num_warps=warps), (rows_out // 128) * nk * sp, (table, rows_out)
    if em.cell_bytes >= 16 and wpc >= 4:
        bw, nc = row_chunks(wpc, cfg["max_bw"], cfg["wide_below"])
        bm = cells_per_tile(cfg["tile_words"], bw, em.n_out)
        s2, r2 = 0, 1
        if nc == 1 and em.cell_bytes <= cfg["tile_2d_max_cell"]:
            bm2 = cells_per_tile(cfg["tile_2d_words"], bw, em.n_out)
            found = transposed_tiles(em, bm2, cfg["run_cells"])
            if found:
                (s2, r2), bm = found, bm2
        meta = dict(_KERNEL_CONSTANTS, KIND=0, W=wpc, BM=bm, BW=bw, NC=nc, WI=wpc, CM=bw * nc > wpc, S2=s2, R2=r2)
        return dict(meta, num_warps=cfg["num_warps"]), cdiv(em.n_out, bm) * nc, None
    b = min(cfg["block_1d"], next_pow2(em.n_out * wpc))
    meta = dict(_KERNEL_CONSTANTS, KIND=1, W=wpc, B=b, WI=wpc)
    return dict(meta, num_warps=cfg["warps_1d"]), cdiv(em.n_out * wpc, b), None


def swizzle_row_table(em: ExecMap, cfg: dict) -> tuple[np.ndarray, int]:
    """The source-row table a 128x4 swizzle launch (out of place or in place) reads, and its
    band step ``BS``: the first band's 128 entries with ``em.band_step()`` where that is not 0
    and ``swizzle_band_step`` is on (band ``b`` reads them plus ``b * BS``), else one entry an
    output row and 0."""
    rows = em.swizzle[0]
    step = em.band_step() if cfg["swizzle_band_step"] else 0
    return (rows[:128] if step else rows), step


def swizzle_warps(tile_bytes: int, thread_bytes: int) -> int:
    """Warps for a 128x4 swizzle tile of ``tile_bytes``: one thread per ``thread_bytes`` (a
    power of two from 4 to 16 warps). Measured on the H200: more threads a tile help (the tile
    goes through shared memory between its loads and stores) until a thread holds less than
    one 16-byte vector of each, where the ratio to a copy drops by 0.2 or more."""
    return max(4, min(16, next_pow2(tile_bytes // (32 * thread_bytes))))


def pair_bit(band_rows: np.ndarray, sp: int) -> int:
    """The bit ``PB`` of ``pp`` (a power of two below ``32 / sp``) such that in every part of
    every swizzle tile (:func:`~fimoe_lab.kernels.triton_gather._swizzle_tile`: band rows
    ``32 q + part * 32 / sp + pp``) the row with that bit set reads the source row after the
    one with it clear: ``band_rows[r + PB] == band_rows[r] + 1``; the lowest such bit, 0 if
    none (TRT-LLM's W2 shuffle: 8 for ``sp <= 2``). Loaded side by side, two such rows of
    under 128 bytes share their lines in one request."""
    rows = np.asarray(band_rows, dtype=np.int64)
    if rows.size != 128:
        return 0
    pr = 32 // sp
    r = np.arange(128)
    for pb in (1 << k for k in range(max(0, pr.bit_length() - 1))):
        low = r[(r % pr) & pb == 0]
        if np.array_equal(rows[low + pb], rows[low] + 1):
            return pb
    return 0


def transposed_tiles(em: ExecMap, bm: int, run_cells: int) -> tuple[int, int] | None:
    """``(S, R)`` for ``rows`` tiles of ``R`` consecutive output cells in each of ``bm // R``
    consecutive lines of ``S`` cells of a map that transposes its cells
    (:meth:`~fimoe_lab.kernels.compiled.ExecMap.transpose_lines`): such a tile reads runs
    of ``bm // R`` input cells and writes runs of ``R`` output cells, where a 1-D tile reads
    ``bm`` scattered cells. Any tiling moves the same bytes; None: 1-D tiles (no such ``S``,
    or it does not divide into ``R x bm // R`` tiles with ``R`` and ``bm // R`` at least 2)."""
    s2 = em.transpose_lines()
    if s2 is None:
        return None
    r2 = pow2_divisor(s2, min(run_cells, bm // 2))
    if r2 < 2 or (em.n_out // s2) % (bm // r2):
        return None
    return s2, r2


def band_item_readers(rows: np.ndarray, cw: int, kw: int, nk: int, nb: int) -> np.ndarray:
    """Who must have read before an item of the in-place swizzle launch may store
    (:func:`~fimoe_lab.kernels.triton_gather.inplace_swizzled_bands`): ``(per, nd)`` int32,
    row ``t`` the items of the same expert whose loads read a word that item ``t`` overwrites,
    padded with ``t`` itself (its own load precedes its store anyway) to ``nd`` a power of two
    (Triton's ``arange``).

    The expert is ``R = rows.size`` rows of ``cw`` 4-byte words (``R`` a multiple of 128,
    ``rows`` a permutation); item ``t`` (``per = cdiv(R / 128, nb) * nk`` of them) reads rows
    ``rows[r]`` for ``r`` in output bands ``(t // nk) * nb ...`` (+``nb``), word columns
    ``[(t % nk) * kw, + kw)``, and writes, in each of those bands ``b``, the words
    ``[b * 128 * cw + (t % nk) * kw * 128, + min(kw, cw - (t % nk) * kw) * 128)``. Then
    ``reader[rows[r] * cw + k] = (r // 128 // nb) * nk + k // kw`` and
    ``writer[w] = (w // (128 * cw) // nb) * nk + (w % (128 * cw)) // (kw * 128)``; item ``t``
    waits for ``{reader[w] : writer[w] = t}``. For the TRT-LLM gate/up interleave that is 2
    bands x ``nk`` chunks, where waiting for the whole expert is all ``per`` items."""
    n_rows = rows.size
    per = cdiv(n_rows // 128, nb) * nk
    reader = np.empty((n_rows, cw), dtype=np.int64)
    item_of_row = (np.arange(n_rows) // 128 // nb) * nk
    reader[np.asarray(rows, dtype=np.int64)] = item_of_row[:, None] + (np.arange(cw) // kw)[None, :]
    w = np.arange(n_rows * cw, dtype=np.int64)
    writer = (w // (128 * cw) // nb) * nk + (w % (128 * cw)) // (kw * 128)
    pairs = np.unique(writer * per + reader.ravel())
    t, dep = pairs // per, pairs % per
    counts = np.bincount(t, minlength=per)
    table = np.repeat(np.arange(per, dtype=np.int32)[:, None], next_pow2(int(counts.max())), axis=1)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    table[t, np.arange(pairs.size) - starts[t]] = dep
    return table
