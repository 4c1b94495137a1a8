"""The GPU executor: one Triton launch gathers every expert's cells.

Three tile shapes, chosen from the map's executable form:

- ``rows``: cells of 16 bytes or more. A program moves one ``BM x BW`` tile of 4-byte
  words: ``BM`` output cells, ``BW`` consecutive words of each, so every row of the tile
  is a contiguous run of its source cell and loads/stores are 16-byte vectors. ``BW`` is
  the cell's largest power-of-two divisor in words, or (under ``wide_below``) one
  power-of-two chunk as wide as the cell with its overhang masked. Small cells of a
  map that transposes them (block-major-K) take 2-D tiles: runs of consecutive output
  cells in consecutive lines, so reads and writes both come in runs.
- ``swizzle``: a row permutation (any chain of row steps, fill rows allowed) followed
  by the 128x4 scale swizzle. A program loads a 128-row band x ``KW`` words of its
  source rows (coalesced), transposes the (4, 32) row grid in registers, and stores one
  contiguous run of the output.
- ``words``: anything else (cells under 16 bytes): one program per block of output
  words, each word fetched on its own.

``evict`` / ``store_cs`` make loads evict-first and stores streaming (off: no gain
measured on the H200, benchmarks/RESULTS.md). Grid: (tiles per expert, experts). Fill
cells (``src < 0``) take their fill word from a tiny table; a row gather whose rows are
padded on the right uses the ``rows`` kernel over whole output rows.

In place (permutations only, :mod:`.cycles`): :func:`inplace_cycles` runs the map's
cycle plan, tiles that only read cells they overwrite themselves, so each byte
crosses memory once; :func:`inplace_swizzled_bands` does scale maps (a row permutation,
then the 128x4 swizzle) in one launch with no scratch: a program per group of whole
bands when each band reads only its own rows (W2 scales), else a cooperative launch in
which each expert's bytes are held in registers by the programs that write it.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from fimoe_lab.kernels.compiled import ExecMap, aligned_word, word_dtype
from fimoe_lab.kernels.tiles import (
    CONFIG,
    band_item_readers,
    cdiv,
    cells_per_tile,
    launch_plan,
    next_pow2,
    pow2_divisor,
    swizzle_row_table,
)
from fimoe_lab.kernels.triton_launch import INTERPRETED, Pointer, launch


@triton.jit
def _load(ptr, mask, EVICT: tl.constexpr):
    """EVICT: each source byte is read once, so its lines leave L2 first."""
    if EVICT:
        return tl.load(ptr, mask=mask, eviction_policy="evict_first")
    return tl.load(ptr, mask=mask)


@triton.jit
def _store(ptr, v, mask, STCS: tl.constexpr):
    """STCS: streaming stores (``st.global.cs``), the output is not read again by this launch."""
    if STCS:
        tl.store(ptr, v, mask=mask, cache_modifier=".cs")
    else:
        tl.store(ptr, v, mask=mask)


@triton.jit
def _rows_tile(
    xb,
    ob,
    src_ptr,
    fill_ptr,
    n_out,
    t,
    W: tl.constexpr,
    BM: tl.constexpr,
    BW: tl.constexpr,
    NC: tl.constexpr,
    HAS_FILL: tl.constexpr,
    EVICT: tl.constexpr,
    WI: tl.constexpr,
    CF: tl.constexpr,
    CM: tl.constexpr,
    STCS: tl.constexpr,
    S2: tl.constexpr,
    R2: tl.constexpr,
):
    # output rows of W words from input rows of WI words (WI < W: columns >= WI are fill CF);
    # CM: the NC chunks of BW words overhang the row (BW * NC > W), columns >= W are masked.
    # S2 > 0: the output cells are lines of S2 and tile rb is BM // R2 lines x R2 cells of them
    rb = t // NC
    cc = t % NC
    j = tl.arange(0, BM)
    if S2 > 0:
        runs = S2 // R2
        rows = ((rb // runs) * (BM // R2) + j // R2) * S2 + (rb % runs) * R2 + j % R2
    else:
        rows = rb * BM + j
    rmask = rows < n_out
    s = tl.load(src_ptr + rows, mask=rmask, other=0)
    if HAS_FILL:
        valid = s >= 0
        fw = tl.load(fill_ptr + tl.maximum(-1 - s, 0), mask=rmask, other=0)
        s = tl.maximum(s, 0)
        m = rmask & valid
    else:
        m = rmask
    cols = cc * BW + tl.arange(0, BW)
    src = xb + s.to(tl.int64)[:, None] * WI + cols[None, :]
    sm = rmask[:, None]
    if CM:
        sm = sm & (cols < W)[None, :]
    if WI < W:
        cin = cols < WI
        lm = m[:, None] & cin[None, :]
    else:
        lm = m[:, None]
    if CM:
        lm = lm & (cols < W)[None, :]
    v = _load(src, lm, EVICT)
    if WI < W:
        v = tl.where(cin[None, :], v, tl.load(fill_ptr + CF))
    if HAS_FILL:
        v = tl.where(valid[:, None], v, fw[:, None])
    _store(ob + rows.to(tl.int64)[:, None] * W + cols[None, :], v, sm, STCS)


@triton.jit
def _words_block(
    xb,
    ob,
    src_ptr,
    fill_ptr,
    n_out,
    t,
    W: tl.constexpr,
    B: tl.constexpr,
    HAS_FILL: tl.constexpr,
    EVICT: tl.constexpr,
    STCS: tl.constexpr,
):
    j = t * B + tl.arange(0, B)
    m = j < n_out * W
    cell = j // W
    s = tl.load(src_ptr + cell, mask=m, other=0)
    if HAS_FILL:
        valid = s >= 0
        fw = tl.load(fill_ptr + tl.maximum(-1 - s, 0), mask=m, other=0)
        s = tl.maximum(s, 0)
        v = _load(xb + s.to(tl.int64) * W + j % W, m & valid, EVICT)
        v = tl.where(valid, v, fw)
    else:
        v = _load(xb + s.to(tl.int64) * W + j % W, m, EVICT)
    _store(ob + j, v, m, STCS)


@triton.jit
def _swizzle_128x4(v, NB: tl.constexpr, PR: tl.constexpr, KW: tl.constexpr, PB: tl.constexpr):
    """The 128x4 scale order (the block-scale GEMMs read a band's 4-byte words column by column,
    rows interleaved by 32): band ``b``, row ``32*q + p``, word ``k`` -> position
    ``(b*KW + k)*128 + p*4 + q``, for ``NB`` bands of which ``v`` holds ``PR`` of the 32 ``p``
    values (the rows ``(b, q, u)`` x ``KW`` words). Row ``u`` is ``p = u``, or with ``PB > 0``
    (:func:`~fimoe_lab.kernels.tiles.pair_bit`) ``u = (hi * PB + lo) * 2 + bit`` is
    ``p = hi * 2 PB + bit * PB + lo``. Returns ``(NB * KW, 4 * PR)``: ``[b, k, p * 4 + q]``."""
    if PB > 0:  # [b, q, hi, lo, bit, k] -> [b, k, hi, bit, lo, q]
        w = tl.permute(tl.reshape(v, (NB, 4, PR // (2 * PB), PB, 2, KW)), (0, 5, 2, 4, 3, 1))
    else:  # [b, q, p, k] -> [b, k, p, q]
        w = tl.permute(tl.reshape(v, (NB, 4, PR, KW)), (0, 3, 2, 1))
    return tl.reshape(w, (NB * KW, 4 * PR))


@triton.jit
def _band_rows(rows_ptr, r, mask, BS: tl.constexpr):
    """Source rows of output rows ``r`` (whole bands of 128): ``rows_ptr[r]``, or with
    ``BS > 0`` (:meth:`ExecMap.band_step`) ``rows_ptr[r % 128] + (r // 128) * BS`` from the
    first band's 128 entries, which every program reads (so from L1). Masked rows: any value."""
    if BS > 0:
        return tl.load(rows_ptr + r % 128, mask=mask) + (r // 128) * BS
    return tl.load(rows_ptr + r, mask=mask)


@triton.jit
def _swizzle_tile(
    xb,
    ob,
    rows_ptr,
    fill_ptr,
    t,
    CW: tl.constexpr,
    KW: tl.constexpr,
    NK: tl.constexpr,
    SP: tl.constexpr,
    HAS_FILL: tl.constexpr,
    EVICT: tl.constexpr,
    STCS: tl.constexpr,
    BS: tl.constexpr,
    PB: tl.constexpr,
):
    """Tile ``t``: band ``t // (NK * SP)``, words ``[kc * KW, + KW)`` of its rows (``kc = t // SP %
    NK``), and of its 128 rows ``32 q + p`` those with ``p`` in part ``t % SP`` of ``32 / SP``
    (all four ``q``). In the 128x4 order (:func:`_swizzle_128x4`) row ``32 q + p``, word ``k``
    of band ``b`` lands on ``(b * CW + k) * 128 + 4 p + q``, so the tile reads ``4`` runs of
    ``32 / SP`` whole rows and writes, per word, one run of ``128 / SP`` words: full sectors
    both ways for ``SP <= 8``, however the band is split.

    ``PB > 0`` (:func:`~fimoe_lab.kernels.tiles.pair_bit`): rows ``pp`` and ``pp + PB`` (bit
    ``PB`` of ``pp`` clear) come from consecutive source rows, and the tile loads them next to
    each other (``pp`` with that bit moved lowest), so rows narrower than a line are read in
    pairs; the permute back to ``pp`` order is folded into the swizzle's."""
    PR: tl.constexpr = 32 // SP  # the part's p values
    part = t % SP
    kc = (t // SP) % NK
    band = t // (SP * NK)
    i = tl.arange(0, 4 * PR)  # loaded row q * PR + u of the tile: band row 32 q + part * PR + pp(u)
    u = i % PR
    if PB > 0:  # u = (hi * PB + lo) * 2 + bit -> pp = hi * 2 PB + bit * PB + lo
        pp = (u // (2 * PB)) * (2 * PB) + (u % 2) * PB + (u // 2) % PB
    else:
        pp = u
    s = _band_rows(rows_ptr, band * 128 + (i // PR) * 32 + part * PR + pp, None, BS)
    if HAS_FILL:
        valid = s >= 0
        fw = tl.load(fill_ptr + tl.maximum(-1 - s, 0))
        s = tl.maximum(s, 0)
    k = kc * KW + tl.arange(0, KW)
    if KW * NK > CW:  # the last chunk overhangs the row: words >= CW are masked
        v = _load(xb + s.to(tl.int64)[:, None] * CW + k[None, :], (k < CW)[None, :], EVICT)
        om = (k < CW)[:, None]
    else:
        v = _load(xb + s.to(tl.int64)[:, None] * CW + k[None, :], None, EVICT)
        om = None
    if HAS_FILL:
        v = tl.where(valid[:, None], v, fw[:, None])
    v = _swizzle_128x4(v, 1, PR, KW, PB)  # [k, pp * 4 + q]
    o = band.to(tl.int64) * 128 * CW + k[:, None] * 128 + part * (4 * PR) + tl.arange(0, 4 * PR)[None, :]
    _store(ob + o, v, om, STCS)


@triton.jit
def _gather_kernel(
    x_ptr,
    out_ptr,
    src_ptr,
    fill_ptr,
    in_words,
    out_words,
    n_out,
    KIND: tl.constexpr,
    W: tl.constexpr,
    BM: tl.constexpr,
    BW: tl.constexpr,
    NC: tl.constexpr,
    B: tl.constexpr,
    KW: tl.constexpr,
    NK: tl.constexpr,
    HAS_FILL: tl.constexpr,
    EVICT: tl.constexpr,
    WI: tl.constexpr,
    CF: tl.constexpr,
    CM: tl.constexpr,
    STCS: tl.constexpr,
    S2: tl.constexpr,
    R2: tl.constexpr,
    BS: tl.constexpr,
    SP: tl.constexpr,
    PB: tl.constexpr,
):
    t = tl.program_id(0)
    e = tl.program_id(1).to(tl.int64)
    xb = x_ptr + e * in_words
    ob = out_ptr + e * out_words
    if KIND == 0:
        _rows_tile(xb, ob, src_ptr, fill_ptr, n_out, t, W, BM, BW, NC, HAS_FILL, EVICT, WI, CF, CM, STCS, S2, R2)
    elif KIND == 1:
        _words_block(xb, ob, src_ptr, fill_ptr, n_out, t, W, B, HAS_FILL, EVICT, STCS)
    else:
        _swizzle_tile(xb, ob, src_ptr, fill_ptr, t, W, KW, NK, SP, HAS_FILL, EVICT, STCS, BS, PB)


def _rows_on(em: ExecMap, rows_src, device, kind: int) -> torch.Tensor:
    """The source-row table of kernel ``kind`` (0 padded rows, 2 swizzle) on ``device``, cached on ``em``
    by its length (a swizzle's first band alone, :meth:`ExecMap.band_step`, is its own entry)."""
    key = ("rows", str(device), kind, len(rows_src))
    if key not in em._dev:
        em._dev[key] = torch.from_numpy(rows_src).to(device)
    return em._dev[key]


def _prepare(em: ExecMap, word: int, device: torch.device, config: dict | None):
    """Kernel constants, tiles an expert, source table, fill table and output cells of a
    gather launch in ``word``-byte words: cached on ``em`` per word size, device and
    config (each call of a serving loop finds them there)."""
    cfg = dict(CONFIG, **(config or {}))
    key = ("launch", word, device, tuple(cfg.items()))
    got = em._dev.get(key)
    if got is None:
        meta, tiles, rows = launch_plan(em, word, cfg)
        n_out = em.n_out
        if rows is not None:
            rows_src, n_out = rows
            src = _rows_on(em, rows_src, device, meta["KIND"])
        else:
            src = em.src_on(device)
        meta = dict(meta, HAS_FILL=em.has_fill, EVICT=cfg["evict"], STCS=cfg["store_cs"])
        got = em._dev[key] = (meta, tiles, src, em.fills_on(device, word), n_out)
    return got


def gather_triton(em: ExecMap, x: torch.Tensor, out: torch.Tensor, config: dict | None = None) -> None:
    """``out[e, i] = x[e, src[i]]`` (or fill) for every expert, one launch. ``x`` and
    ``out`` contiguous (the caller checks), moved in the widest word (up to 4 bytes) that
    divides the cell and both addresses."""
    experts = x.shape[0]
    if experts == 0 or em.out_bytes == 0:
        return
    if experts > 65535:
        for s in range(0, experts, 65535):
            gather_triton(em, x[s : s + 65535], out[s : s + 65535], config)
        return
    word = aligned_word(min(em.word, 4), x, out)
    meta, tiles, src, fills, n_out = _prepare(em, word, x.device, config)
    dt = word_dtype(word)
    if INTERPRETED:  # the interpreter reads tensors, not addresses
        xw, ow = x.reshape(-1).view(dt), out.reshape(-1).view(dt)
    else:
        xw, ow = Pointer(x.data_ptr(), dt), Pointer(out.data_ptr(), dt)
    launch(
        _gather_kernel,
        (tiles, experts),
        xw,
        ow,
        src,
        fills,
        em.in_bytes // word,
        em.out_bytes // word,
        n_out,
        **meta,
    )


@triton.jit
def _cycle_kernel(
    x_ptr,
    b_ptr,
    dst_ptr,
    src_ptr,
    n_slots,
    expert_words,
    saved_words,
    SAVE: tl.constexpr,
    W: tl.constexpr,
    BM: tl.constexpr,
    BW: tl.constexpr,
    NC: tl.constexpr,
    EVICT: tl.constexpr,
    STCS: tl.constexpr,
):
    """One tile of a cycle plan for expert ``program_id(1)``: ``BM`` slots x ``BW`` words.

    SAVE: copy the saved cells aside (``dst_ptr`` holds their positions). Else: load
    every source of the tile (a cell this tile writes, or a saved one), wait for the
    whole program, then store; no other program touches these cells."""
    t = tl.program_id(0)
    e = tl.program_id(1).to(tl.int64)
    xb = x_ptr + e * expert_words
    bb = b_ptr + e * saved_words
    slots = (t // NC) * BM + tl.arange(0, BM)
    m = slots < n_slots
    cols = (t % NC) * BW + tl.arange(0, BW)
    if SAVE:
        s = tl.load(dst_ptr + slots, mask=m, other=0).to(tl.int64)
        v = tl.load(xb + s[:, None] * W + cols[None, :], mask=m[:, None])
        tl.store(bb + slots.to(tl.int64)[:, None] * W + cols[None, :], v, mask=m[:, None])
    else:
        d = tl.load(dst_ptr + slots, mask=m, other=0).to(tl.int64)
        s = tl.load(src_ptr + slots, mask=m, other=0).to(tl.int64)
        here = s >= 0
        v = _load(xb + tl.maximum(s, 0)[:, None] * W + cols[None, :], (m & here)[:, None], EVICT)
        vb = tl.load(bb + tl.maximum(-1 - s, 0)[:, None] * W + cols[None, :], mask=(m & ~here)[:, None])
        v = tl.where(here[:, None], v, vb)
        tl.debug_barrier()  # every load of the tile is done before any store overwrites a source
        _store(xb + d[:, None] * W + cols[None, :], v, m[:, None], STCS)


def inplace_cycles(em: ExecMap, flat: torch.Tensor, scratch_experts: int, config: dict | None = None):
    """Permute every expert of ``flat`` ``(E, bytes)`` in place along the map's cycles
    (:mod:`.cycles`): per chunk of experts, one launch copies the saved cells into the
    scratch, one runs all tiles. Each cell crosses memory once (plus the saved ones,
    about ``2 / tile_slots`` of them), fixed points not at all. The scratch holds the
    saved cells of as many experts as fit in ``scratch_experts`` experts' bytes.

    Yields the number of leading experts whose tiles have been launched; the stream
    orders the launches, so after a synchronize those experts are done and the rest of
    ``flat`` still holds its input.
    """
    from fimoe_lab.kernels.cycles import cycle_plan

    cfg = dict(CONFIG, **(config or {}))
    experts, nbytes = flat.shape
    word = aligned_word(min(em.word, 4), flat)
    wpc = em.cell_bytes // word
    bw = pow2_divisor(wpc, cfg["cycle_bw"])
    bm = next_pow2(max(1, cfg["cycle_slots"]))
    nc = wpc // bw
    plan = cycle_plan(em, bm)
    if plan.moved == 0:
        yield experts, None
        return
    dst, src, saved = plan.on(flat.device)
    n_saved = plan.saved.size
    per = min(plan.experts_per_chunk(em.cell_bytes, scratch_experts * nbytes, experts), 65535)
    dt = word_dtype(word)
    scratch = torch.empty((per * n_saved * wpc,), dtype=dt, device=flat.device)
    xw = flat.view(dt)
    ew = nbytes // word
    meta = dict(W=wpc, BM=bm, BW=bw, NC=nc, EVICT=cfg["evict"], STCS=cfg["store_cs"], num_warps=cfg["cycle_warps"])
    for s0 in range(0, experts, per):
        cnt = min(per, experts - s0)
        part = xw[s0 : s0 + cnt]
        if n_saved:
            launch(
                _cycle_kernel,
                (cdiv(n_saved, bm) * nc, cnt),
                part,
                scratch,
                saved,
                saved,
                n_saved,
                ew,
                n_saved * wpc,
                SAVE=True,
                **meta,
            )
        launch(
            _cycle_kernel,
            (plan.n_tiles * nc, cnt),
            part,
            scratch,
            dst,
            src,
            plan.moved,
            ew,
            n_saved * wpc,
            SAVE=False,
            **meta,
        )
        yield s0 + cnt, scratch


@triton.jit
def _flag(flag_ptr, gen):
    """Order every load and store of the program before setting one item's flag to this
    launch's number ``gen`` (release)."""
    tl.debug_barrier()
    tl.atomic_xchg(flag_ptr, gen, sem="release", scope="gpu")


@triton.jit
def _wait_for_items(flags_ptr, readers_ptr, gen, ND: tl.constexpr):
    """Spin until each of the ``ND`` items listed at ``readers_ptr`` (indices into its
    expert's flags at ``flags_ptr``) has set its flag to ``gen`` (acquire); flags of earlier
    launches hold smaller numbers. Then line the program up."""
    p = flags_ptr + tl.load(readers_ptr + tl.arange(0, ND))
    zero = tl.zeros([ND], dtype=tl.int64)
    seen = tl.min(tl.atomic_add(p, zero, sem="acquire", scope="gpu"), 0)
    while seen < gen:
        seen = tl.min(tl.atomic_add(p, zero, sem="acquire", scope="gpu"), 0)
    tl.debug_barrier()


@triton.jit
def _load_bands(
    x_ptr,
    rows_ptr,
    t,
    live,
    per,
    n_bands,
    expert_words,
    CW: tl.constexpr,
    KW: tl.constexpr,
    NK: tl.constexpr,
    NB: tl.constexpr,
    EVICT: tl.constexpr,
    BS: tl.constexpr,
):
    """Item ``t``'s source rows (``NB`` bands of 128) x ``KW`` words; nothing when not ``live``."""
    e = t // per
    r = ((t % per) // NK) * (NB * 128) + tl.arange(0, NB * 128)
    rm = live & (r < n_bands * 128)
    s = _band_rows(rows_ptr, r, rm, BS).to(tl.int64)
    k = (t % NK) * KW + tl.arange(0, KW)
    return _load(
        x_ptr + e.to(tl.int64) * expert_words + s[:, None] * CW + k[None, :], rm[:, None] & (k < CW)[None, :], EVICT
    )


@triton.jit
def _store_bands(
    x_ptr,
    v,
    t,
    per,
    n_bands,
    expert_words,
    CW: tl.constexpr,
    KW: tl.constexpr,
    NK: tl.constexpr,
    NB: tl.constexpr,
    STCS: tl.constexpr,
):
    """Store the rows ``v`` that :func:`_load_bands` read for item ``t``, in the 128x4 order
    (:func:`_swizzle_128x4`), at its ``NB`` output bands, column chunk ``t % NK``."""
    w = tl.reshape(_swizzle_128x4(v, NB, 32, KW, 0), (NB * KW * 128,))
    j = tl.arange(0, NB * KW * 128)
    band = ((t % per) // NK) * NB + j // (KW * 128)
    rem = j % (KW * 128)
    kc = t % NK
    _store(
        x_ptr + (t // per).to(tl.int64) * expert_words + band.to(tl.int64) * (128 * CW) + kc * (KW * 128) + rem,
        w,
        (rem < (CW - kc * KW) * 128) & (band < n_bands),
        STCS,
    )


@triton.jit
def _swizzled_bands_in_place(
    x_ptr,
    rows_ptr,
    readers_ptr,
    sync_ptr,
    experts,
    expert_words,
    n_bands,
    per,
    CW: tl.constexpr,
    KW: tl.constexpr,
    NK: tl.constexpr,
    NB: tl.constexpr,
    ND: tl.constexpr,
    EVICT: tl.constexpr,
    STCS: tl.constexpr,
    BS: tl.constexpr,
):
    """Row permutation then 128x4 swizzle, in place, one cooperative launch, no scratch.

    An item is ``NB`` 128-row output bands x ``KW`` words (``per`` items an expert): it
    loads its source rows (anywhere in its expert) into registers and flags itself read;
    before storing, it waits for the flags of the items that read the words it overwrites
    (``readers_ptr``: ``(per, ND)``, :func:`~fimoe_lab.kernels.tiles.band_item_readers`; 2
    bands' items for the gate/up interleave, not the whole expert). Program ``p`` takes items
    ``p, p + G, ...`` with ``G`` a multiple of ``per``, so an expert's items are on distinct
    resident programs (cooperative launch) in the same round: every wait ends. The next item
    is loaded (and flagged) before waiting on this one: it belongs to another expert, which
    nobody writes before its readers flagged their loads. Each byte is read and written once.

    ``sync_ptr``: int64 ``[launches, programs out, item flags...]``. A launch numbers itself
    ``launches + 1``, its flags count as set when they hold that number (no reset between
    launches, so a replayed CUDA graph works too; 64 bits never wrap), and its last program
    out counts it."""
    total = experts * per
    g = tl.num_programs(0)
    t = tl.program_id(0)
    gen = tl.atomic_add(sync_ptr, 0, sem="relaxed", scope="gpu") + 1
    flags_ptr = sync_ptr + 2
    v = _load_bands(x_ptr, rows_ptr, t, t < total, per, n_bands, expert_words, CW, KW, NK, NB, EVICT, BS)
    if t < total:
        _flag(flags_ptr + t, gen)
    while t < total:
        vn = _load_bands(x_ptr, rows_ptr, t + g, t + g < total, per, n_bands, expert_words, CW, KW, NK, NB, EVICT, BS)
        if t + g < total:
            _flag(flags_ptr + t + g, gen)
        first = (t // per) * per
        _wait_for_items(flags_ptr + first, readers_ptr + (t - first) * ND, gen, ND)
        _store_bands(x_ptr, v, t, per, n_bands, expert_words, CW, KW, NK, NB, STCS)
        t += g
        v = vn
    tl.debug_barrier()
    if tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu") == g - 1:
        tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")


@triton.jit
def _swizzled_bands_local(
    x_ptr,
    rows_ptr,
    expert_words,
    n_bands,
    per,
    CW: tl.constexpr,
    KW: tl.constexpr,
    NB: tl.constexpr,
    EVICT: tl.constexpr,
    STCS: tl.constexpr,
    BS: tl.constexpr,
):
    """Row permutation then 128x4 swizzle, in place, for maps whose output bands read only
    their own rows (:meth:`ExecMap.bands_local`): program ``t`` loads ``NB`` whole bands
    (``KW >= CW`` words a row) of expert ``t // per``, waits until all its threads have
    loaded, and stores them swizzled over the same bytes. No other program touches them."""
    t = tl.program_id(0)
    v = _load_bands(x_ptr, rows_ptr, t, True, per, n_bands, expert_words, CW, KW, 1, NB, EVICT, BS)
    tl.debug_barrier()
    _store_bands(x_ptr, v, t, per, n_bands, expert_words, CW, KW, 1, NB, STCS)


def _blocks_per_sm(kernel, props) -> int:
    """How many programs of a compiled Triton ``kernel`` one SM holds at once (registers,
    shared memory, threads; Hopper allocation granularities)."""
    kernel._init_handles()
    warps = kernel.metadata.num_warps
    regs_per_warp = -(-max(kernel.n_regs, 1) * 32 // 256) * 256
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (regs_per_warp * warps)
    smem = getattr(props, "shared_memory_per_multiprocessor", 233472)
    by_smem = smem // (kernel.metadata.shared + 1024)
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps)
    return max(0, min(by_regs, by_smem, by_threads, 32))


_SYNC: dict = {}
_SYNC_OUTGROWN: list = []


def _sync_words(device: torch.device, n: int) -> torch.Tensor:
    """``n`` int64 words for the cooperative launch on ``device``'s current stream
    (:func:`_swizzled_bands_in_place`: launch count, programs out, item flags), zero when
    made and left consistent by every launch: made once, and again larger when a launch
    needs more. An outgrown one is kept, not freed: a captured CUDA graph may still use it.
    One set a stream, so concurrent launches on two streams do not share them."""
    key = (str(device), torch.cuda.current_stream(device).cuda_stream)
    have = _SYNC.get(key)
    if have is None or have.numel() < n:
        if have is not None:
            _SYNC_OUTGROWN.append(have)
        have = _SYNC[key] = torch.zeros(max(n, 1024), dtype=torch.int64, device=device)
    return have


def inplace_swizzled_bands(em: ExecMap, flat: torch.Tensor, scratch_experts: int, config: dict | None = None):
    """In place for maps of the ``swizzle`` form (a row permutation, then the 128x4
    scale swizzle; 4-byte words) with no scratch. A map whose bands read only their own
    rows (:meth:`ExecMap.bands_local`, bands up to ``local_max_words``) takes
    :func:`_swizzled_bands_local`, one plain launch of whole bands. Any other:
    :func:`_swizzled_bands_in_place`
    holds each expert's bytes in registers across the programs working on it, in items
    of about ``band_words`` words a row (narrow rows: several bands an item; wide
    ones: a band's columns in chunks). Needs the items of one expert resident at
    once; if they are more than the device holds, it runs :func:`inplace_cycles`
    instead, and if the launch does not start (compile error, the driver refusing the
    cooperative grid: nothing has moved then) it warns and does the same. Yields once."""
    cfg = dict(CONFIG, **(config or {}))
    experts, nbytes = flat.shape
    rows, cw, n_rows = em.swizzle
    n_bands = n_rows // 128
    kw = next_pow2(cw)
    table, step = swizzle_row_table(em, cfg)
    rows_dev = _rows_on(em, table, flat.device, 2)
    if em.bands_local() and kw * 128 <= cfg["local_max_words"]:
        nb = cells_per_tile(cfg["local_words"], kw * 128, n_bands)
        per = cdiv(n_bands, nb)
        launch(
            _swizzled_bands_local,
            (experts * per,),
            flat.view(torch.int32),
            rows_dev,
            nbytes // 4,
            n_bands,
            per,
            CW=cw,
            KW=kw,
            NB=nb,
            EVICT=cfg["evict"],
            STCS=cfg["store_cs"],
            BS=step,
            num_warps=cfg["band_warps"],
        )
        yield experts, None
        return
    item_words = next_pow2(cfg["band_words"])
    kw = min(kw, item_words)
    nk = cdiv(cw, kw)
    nb = cells_per_tile(item_words, kw, n_bands) if nk == 1 else 1
    per = cdiv(n_bands, nb) * nk
    rkey = ("band readers", str(flat.device), kw, nk, nb)
    if rkey not in em._dev:
        em._dev[rkey] = torch.from_numpy(band_item_readers(rows, cw, kw, nk, nb)).to(flat.device)
    readers = em._dev[rkey]
    sync = _sync_words(flat.device, 2 + experts * per)
    args = (flat.view(torch.int32), rows_dev, readers, sync, experts, nbytes // 4, n_bands, per)
    meta = dict(
        CW=cw,
        KW=kw,
        NK=nk,
        NB=nb,
        ND=readers.shape[1],
        EVICT=cfg["evict"],
        STCS=cfg["store_cs"],
        BS=step,
        num_warps=cfg["band_warps"],
    )
    try:
        props = torch.cuda.get_device_properties(flat.device)
        occ = ("blocks per SM", str(flat.device), tuple(meta.items()))
        if occ not in em._dev:
            em._dev[occ] = _blocks_per_sm(_swizzled_bands_in_place.warmup(*args, grid=(1,), **meta), props)
        per_sm = min(em._dev[occ], cfg["band_per_sm"])
        grid = min(props.multi_processor_count * per_sm, experts * per) // per * per
        if grid:
            launch(_swizzled_bands_in_place, (grid,), *args, **meta, launch_cooperative_grid=True)
    except Exception as exc:  # noqa: BLE001 - raised before anything moved
        warnings.warn(
            f"in-place scale launch did not start ({exc}); running the cycle plan instead", RuntimeWarning, stacklevel=2
        )
        grid = 0
    if grid:
        yield experts, None
    else:
        yield from inplace_cycles(em, flat, scratch_experts, config)


def preload() -> None:
    """What a fresh process pays before its first launch, paid ahead (the registry runs it on a background
    thread while the first calls go to torch): importing Triton (this module) and Triton's compiler cache
    key, a hash of Triton's own sources and library (~0.35 s of a ~0.7 s first call on the H200 host, once
    per process); the kernels then load from the on-disk cache at their first launch."""
    try:
        from triton.runtime.cache import triton_key  # Triton's internal API (3.x); older ones hash elsewhere
    except ImportError:
        return
    triton_key()
