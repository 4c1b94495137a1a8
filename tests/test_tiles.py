"""The GPU executor's tiling (:mod:`fimoe_lab.kernels.tiles`) without a GPU: for every kernel
shape it picks, the tiles' stores, with their masks, cover every output word exactly once.
The kernels' index formulas are re-derived here from their docstrings; the bytes they move
are checked on the device (``tests/test_kernels_gpu.py``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fimoe_lab.errors import LayoutError
from fimoe_lab.kernels import tiles
from fimoe_lab.prepare import plan_layer

DEFAULTS = tiles.CONFIG  # the Triton executor's own table (kernels/tiles.py: no Triton needed)
CONFIGS = [
    {},
    {"tile_2d_max_cell": 0},
    {"tile_words": 4096, "tile_2d_words": 4096},
    {"wide_below": 0, "swizzle_kw": 32, "swizzle_wide_below": 0},
    {"wide_below": 4096, "max_bw": 64},
    {"run_cells": 2, "tile_words": 256, "tile_2d_words": 256, "tile_2d_max_cell": 1 << 20},
    {"swizzle_wide_below": 8, "swizzle_kw": 8},
    {"use_swizzle": False, "use_padrows": False},
    {"swizzle_split": 2},
    {"swizzle_split": 8, "swizzle_kw": 8, "swizzle_wide_below": 8},
]


def store_counts(em, word: int, cfg: dict) -> tuple[dict, np.ndarray]:
    """How many times each output word is stored by the tiles of ``launch_plan``."""
    meta, n_tiles, rows = tiles.launch_plan(em, word, cfg)
    t = np.arange(n_tiles, dtype=np.int64)
    kind, w = meta["KIND"], meta["W"]
    if kind == 0:  # rows: cell rows (1-D or 2-D tiles) x masked word columns
        n = rows[1] if rows is not None else em.n_out
        bm, bw, nc, s2, r2 = meta["BM"], meta["BW"], meta["NC"], meta["S2"], meta["R2"]
        rb, cc, j = t // nc, t % nc, np.arange(bm)
        if s2:
            runs = s2 // r2
            cells = ((rb // runs)[:, None] * (bm // r2) + j // r2) * s2 + (rb % runs)[:, None] * r2 + j % r2
        else:
            cells = rb[:, None] * bm + j
        cols = cc[:, None] * bw + np.arange(bw)
        where = (cells < n)[:, :, None] & (cols < w)[:, None, :]
        flat = cells[:, :, None] * w + cols[:, None, :]
        return meta, np.bincount(flat[where], minlength=n * w)
    if kind == 2:  # swizzle: band x column chunk x part of the p values: a (masked) run of 128 / SP a word
        n_rows, kw, nk, sp = rows[1], meta["KW"], meta["NK"], meta["SP"]
        band, kc, part = t // (nk * sp), (t // sp) % nk, t % sp
        k = kc[:, None] * kw + np.arange(kw)  # (tiles, kw) words of the row
        j = np.arange(128 // sp)  # 4 p + q within the part
        pos = band[:, None, None] * 128 * w + k[:, :, None] * 128 + part[:, None, None] * (128 // sp) + j
        where = np.broadcast_to((k < w)[:, :, None], pos.shape)
        return meta, np.bincount(pos[where], minlength=n_rows * w)
    j = t[:, None] * meta["B"] + np.arange(meta["B"])  # words: blocks of output words
    return meta, np.bincount(j[j < em.n_out * w], minlength=em.n_out * w)


def check(m, cfg):
    em = m.compiled()
    seen = set()
    for word in (w for w in (1, 2, 4) if w <= min(em.word, 4)):
        meta, counts = store_counts(em, word, dict(DEFAULTS, **cfg))
        assert (counts == 1).all(), (m.name, word, cfg, meta)
        seen.add((meta["KIND"], meta["S2"] > 0, meta["BW"] * meta["NC"] > meta["W"]))
    return seen


MAPS = [  # production hidden sizes with few rows: every kernel shape, small arrays
    ("fp8-block", 512, 2048, {}),
    ("bf16", 384, 1024, {}),
    ("fp8-block", 384, 1024, {}),
    ("fp8", 256, 7168, {}),
    ("nvfp4", 512, 7168, {}),
    ("mxfp8", 512, 7168, {}),
    ("mxfp8", 256, 768, {}),
    ("mxfp8", 192, 4096, {}),
    ("fp8", 1856, 2688, dict(is_act_and_mul=False, is_gated=False)),
    ("fp8", 232, 320, dict(is_act_and_mul=False, is_gated=False)),
    ("bf16", 96, 160, {}),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "defaults")
def test_tiles_store_every_output_word_once(cfg):
    kinds = set()
    for fmt, inter, hidden, kw in MAPS:
        for m in plan_layer(fmt, "trtllm", inter, hidden, **kw).maps().values():
            kinds |= check(m, cfg)
    if not cfg:  # the defaults reach every kernel shape: rows 1-D and 2-D, masked chunks, swizzle, words
        assert {k for k, *_ in kinds} == {0, 1, 2}
        assert (0, True, False) in kinds and any(k == 0 and over for k, _, over in kinds)


def test_transposing_maps_take_2d_tiles_and_others_do_not():
    """Block-major-K and the BF16 block layout (output cell (kb, n) <- input cell (n, kb)) get
    lines of N cells; a row permutation (cells of kilobytes) keeps 1-D tiles."""
    blk = plan_layer("fp8-block", "trtllm", 2048, 7168)
    assert tiles.transposed_tiles(blk.w13.compiled(), 128, 16) == (2 * 2048, 16)
    assert tiles.transposed_tiles(blk.w2.compiled(), 128, 16) == (7168, 16)
    assert tiles.transposed_tiles(plan_layer("bf16", "trtllm", 1536, 4096).w2.compiled(), 128, 16) == (4096, 16)
    rotate = plan_layer("fp8", "trtllm", 2048, 7168).w13.compiled()  # rows of 7168 B
    assert tiles.launch_plan(rotate, 4, DEFAULTS)[0]["S2"] == 0
    assert tiles.launch_plan(blk.w13.compiled(), 4, DEFAULTS)[0]["S2"] == 2 * 2048
    assert tiles.launch_plan(blk.w13.compiled(), 4, dict(DEFAULTS, tile_2d_max_cell=0))[0]["S2"] == 0


@settings(max_examples=25, deadline=None)
@given(
    fmt=st.sampled_from(["fp8-block", "bf16", "mxfp8", "nvfp4", "fp8"]),
    inter=st.integers(1, 24).map(lambda k: 64 * k),
    hidden=st.integers(2, 24).map(lambda k: 128 * k),
    cfg=st.sampled_from(CONFIGS),
)
def test_tiles_cover_random_shapes(fmt, inter, hidden, cfg):
    try:
        plan = plan_layer(fmt, "trtllm", inter, hidden)
    except LayoutError:
        assume(False)
    for m in plan.maps().values():
        check(m, cfg)


def _readers_by_loop(rows: np.ndarray, cw: int, kw: int, nk: int, nb: int) -> list[set[int]]:
    """Item by item, word by word: who reads each word, then who reads what each item writes
    (the in-place launch's item shapes, from ``_load_bands`` / ``_store_bands``)."""
    n_bands = rows.size // 128
    per = -(-n_bands // nb) * nk
    read_by = {}
    for t in range(per):
        kc = t % nk
        for b in range((t // nk) * nb, min((t // nk) * nb + nb, n_bands)):
            for r in range(b * 128, b * 128 + 128):
                for k in range(kc * kw, min(cw, kc * kw + kw)):
                    read_by[int(rows[r]) * cw + k] = t
    out = []
    for t in range(per):
        kc, got = t % nk, set()
        for b in range((t // nk) * nb, min((t // nk) * nb + nb, n_bands)):
            start = b * 128 * cw + kc * kw * 128
            got |= {read_by[w] for w in range(start, start + min(kw, cw - kc * kw) * 128)}
        out.append(got)
    return out


@settings(max_examples=40, deadline=None)
@given(
    bands=st.integers(1, 6),
    cw=st.integers(1, 9),
    item_words=st.sampled_from([1, 2, 4, 8, 16]),
    order=st.sampled_from(["random", "identity", "gate_up_8", "reversed"]),
    seed=st.integers(0, 2**16),
)
def test_band_item_readers_name_every_item_that_reads_what_an_item_overwrites(bands, cw, item_words, order, seed):
    """The in-place scale launch stores an item only after the items in its row of this table
    flagged their loads: the table must hold every reader (a missing one is a silent
    overwrite before a read), checked against a word-by-word loop, on random row permutations
    and the TRT-LLM gate/up interleave; its padding is the item itself, its width a power of two."""
    n = bands * 128
    rows = {
        "random": np.random.default_rng(seed).permutation(n),
        "identity": np.arange(n),
        "gate_up_8": np.stack([np.arange(n // 2).reshape(-1, 8), np.arange(n // 2, n).reshape(-1, 8)], 1).ravel(),
        "reversed": np.arange(n)[::-1],
    }[order]
    kw = min(tiles.next_pow2(cw), item_words)
    nk = tiles.cdiv(cw, kw)
    nb = tiles.cells_per_tile(item_words, kw, bands) if nk == 1 else 1
    table = tiles.band_item_readers(rows, cw, kw, nk, nb)
    want = _readers_by_loop(rows, cw, kw, nk, nb)
    assert table.shape[0] == len(want) and table.shape[1] == tiles.next_pow2(table.shape[1])
    for t, row in enumerate(table):
        assert set(row.tolist()) - {t} == want[t] - {t}
    if order == "gate_up_8" and bands % 2 == 0:  # 64 rows of gate or up: at most 2 output bands read them
        assert table.shape[1] <= tiles.next_pow2(2 * nk * (nb + 1))


@settings(max_examples=60, deadline=None)
@given(bands=st.integers(1, 6), step=st.integers(1, 300), seed=st.integers(0, 2**16), poke=st.booleans())
def test_band_step_finds_bands_that_read_the_first_bands_rows_shifted(bands, step, seed, poke):
    """``ExecMap.band_step`` against its definition, on rows made that way (then one entry moved
    off it): ``step`` for two bands or more, 0 for one band, for a moved entry and for fill rows."""
    from fimoe_lab.kernels.compiled import ExecMap

    rng = np.random.default_rng(seed)
    rows = (rng.permutation(128)[None, :] + step * np.arange(bands)[:, None]).ravel()
    want = step if bands > 1 else 0
    if poke:
        i = int(rng.integers(128, rows.size)) if bands > 1 else 0
        rows[i] = -1 if seed % 2 else rows[i] + 1 + int(rng.integers(0, 5))
        want = 0
    n = rows.size
    em = ExecMap(
        "rows", 4, 4, n, n, np.zeros(n, np.int32), (), False, 4 * n, 4 * n, True, row_forms=((rows, 1, n), None, None)
    )
    assert em.band_step() == want


@settings(max_examples=60, deadline=None)
@given(
    sp=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 2**16), kind=st.sampled_from(["shuffle", "random", "bits"])
)
def test_pair_bit_names_a_bit_whose_rows_read_consecutive_sources(sp, seed, kind):
    """``pair_bit`` against its definition, every part and q of a band: TRT-LLM's W2 row shuffle
    (pairs 8 rows apart while a part holds 16 p values or more), random orders (none), and random
    bit permutations of the row index (a pair exactly when source bit 0 is a bit of ``pp``)."""
    rng = np.random.default_rng(seed)
    r = np.arange(128)
    if kind == "shuffle":
        rows = 32 * (r // 32) + 4 * (r % 8) + (r % 32) // 8
    elif kind == "random":
        rows = rng.permutation(128)
    else:
        perm = rng.permutation(7)  # source bit perm[k] = row bit k
        rows = sum(((r >> k) & 1) << int(perm[k]) for k in range(7))
    pb = tiles.pair_bit(rows, sp)
    pr = 32 // sp
    holds = [b for b in (1, 2, 4, 8, 16) if b < pr and all(rows[j + b] == rows[j] + 1 for j in r if (j % pr) & b == 0)]
    assert pb == (holds[0] if holds else 0)
    if kind == "shuffle":
        assert pb == (8 if sp <= 2 else 0)
    if kind == "bits":
        k0 = int(np.flatnonzero(perm == 0)[0])  # the row bit that is source bit 0
        assert pb == ((1 << k0) if (1 << k0) < pr else 0)
