"""The GPU executor: one Triton launch gathers every expert's cells.

Three tile shapes, chosen from the map's executable form:

- ``rows``: cells of 16 bytes or more. A program moves one ``BM x BW`` tile of 4-byte
  words: ``BM`` output cells, ``BW`` consecutive words of each, so every row of the tile
  is a contiguous run of its source cell and loads/stores are 16-byte vectors.
- ``swizzle``: a row permutation (any chain of row steps, fill rows allowed) followed
  by the 128x4 scale swizzle. A program loads a 128-row band x ``KW`` words of its
  source rows (coalesced), transposes the (4, 32) row grid in registers, and stores one
  contiguous run of the output.
- ``words``: anything else (cells under 16 bytes): one program per block of output
  words, each word fetched on its own.

Grid: (tiles per expert, experts). Fill cells (``src < 0``) take their fill word from a
tiny table; a row gather whose rows are padded on the right uses the ``rows`` kernel
over whole output rows.

In place (permutations only, :mod:`.cycles`): :func:`inplace_cycles` runs the map's
cycle plan, tiles that only read cells they overwrite themselves, so each byte
crosses memory once; :func:`inplace_rows_swizzle` does scale maps (a row permutation,
then the 128x4 swizzle) in one cooperative launch, each band swizzled right after its
rows moved.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fimoe_lab.kernels.compiled import ExecMap, aligned_word, byte_views, swizzle_rows, word_dtype

# Tile sizes, chosen on the H200 (benchmarks/RESULTS.md); override for sweeps.
CONFIG = {"tile_words": 4096, "num_warps": 4, "evict": False, "block_1d": 8192, "warps_1d": 8, "max_bw": 1024,
          "swizzle_kw": 32, "swizzle_warps": 4, "use_swizzle": True,
          # in place: "auto" = rows_swizzle for the swizzle form, else cycles
          "inplace": "auto", "cycle_bw": 64, "swizzle_lag": 8, "swizzle_row_words": 16384, "swizzle_per_sm": 2}


@triton.jit
def _rows_tile(xb, ob, src_ptr, fill_ptr, n_out, t,
               W: tl.constexpr, BM: tl.constexpr, BW: tl.constexpr, NC: tl.constexpr,
               HAS_FILL: tl.constexpr, EVICT: tl.constexpr, WI: tl.constexpr, CF: tl.constexpr):
    # output rows of W words from input rows of WI words (WI < W: columns >= WI are fill CF)
    rb = t // NC
    cc = t % NC
    rows = rb * BM + tl.arange(0, BM)
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
    if WI < W:
        cin = cols < WI
        lm = m[:, None] & cin[None, :]
    else:
        lm = m[:, None]
    if EVICT:
        v = tl.load(src, mask=lm, eviction_policy="evict_first")
    else:
        v = tl.load(src, mask=lm)
    if WI < W:
        v = tl.where(cin[None, :], v, tl.load(fill_ptr + CF))
    if HAS_FILL:
        v = tl.where(valid[:, None], v, fw[:, None])
    tl.store(ob + rows.to(tl.int64)[:, None] * W + cols[None, :], v, mask=rmask[:, None])


@triton.jit
def _words_block(xb, ob, src_ptr, fill_ptr, n_out, t, W: tl.constexpr, B: tl.constexpr, HAS_FILL: tl.constexpr):
    j = t * B + tl.arange(0, B)
    m = j < n_out * W
    cell = j // W
    s = tl.load(src_ptr + cell, mask=m, other=0)
    if HAS_FILL:
        valid = s >= 0
        fw = tl.load(fill_ptr + tl.maximum(-1 - s, 0), mask=m, other=0)
        s = tl.maximum(s, 0)
        v = tl.load(xb + s.to(tl.int64) * W + j % W, mask=m & valid)
        v = tl.where(valid, v, fw)
    else:
        v = tl.load(xb + s.to(tl.int64) * W + j % W, mask=m)
    tl.store(ob + j, v, mask=m)


@triton.jit
def _swizzle_tile(xb, ob, rows_ptr, fill_ptr, t, CW: tl.constexpr, KW: tl.constexpr, NK: tl.constexpr,
                  HAS_FILL: tl.constexpr):
    band = t // NK
    kc = t % NK
    r = band * 128 + tl.arange(0, 128)
    s = tl.load(rows_ptr + r)
    if HAS_FILL:
        valid = s >= 0
        fw = tl.load(fill_ptr + tl.maximum(-1 - s, 0))
        s = tl.maximum(s, 0)
    k = kc * KW + tl.arange(0, KW)
    v = tl.load(xb + s.to(tl.int64)[:, None] * CW + k[None, :])
    if HAS_FILL:
        v = tl.where(valid[:, None], v, fw[:, None])
    # row r = 32*q + p of the band, word kk -> output word kk*128 + p*4 + q of the band
    v = tl.reshape(tl.permute(tl.reshape(v, (4, 32, KW)), (2, 1, 0)), (KW * 128,))
    base = band.to(tl.int64) * 128 * CW + kc * (KW * 128)
    tl.store(ob + base + tl.arange(0, KW * 128), v)


@triton.jit
def _gather_kernel(x_ptr, out_ptr, src_ptr, fill_ptr, in_words, out_words, n_out,
                   KIND: tl.constexpr, W: tl.constexpr, BM: tl.constexpr, BW: tl.constexpr, NC: tl.constexpr,
                   B: tl.constexpr, KW: tl.constexpr, NK: tl.constexpr, HAS_FILL: tl.constexpr,
                   EVICT: tl.constexpr, WI: tl.constexpr, CF: tl.constexpr):
    t = tl.program_id(0)
    e = tl.program_id(1).to(tl.int64)
    xb = x_ptr + e * in_words
    ob = out_ptr + e * out_words
    if KIND == 0:
        _rows_tile(xb, ob, src_ptr, fill_ptr, n_out, t, W, BM, BW, NC, HAS_FILL, EVICT, WI, CF)
    elif KIND == 1:
        _words_block(xb, ob, src_ptr, fill_ptr, n_out, t, W, B, HAS_FILL)
    else:
        _swizzle_tile(xb, ob, src_ptr, fill_ptr, t, W, KW, NK, HAS_FILL)


def _pow2_divisor(n: int, cap: int) -> int:
    p = 1
    while p * 2 <= cap and n % (p * 2) == 0:
        p *= 2
    return p


def launch_plan(em: ExecMap, word: int, cfg: dict) -> tuple[dict, int, object]:
    """Kernel constants for ``em`` moved as ``word``-byte words, the tile count per expert,
    and (swizzle / padded rows) the source-row table used instead of ``em.src``."""
    wpc = em.cell_bytes // word
    pr = em.padrows if (cfg.get("use_padrows", True) and word == 4) else None
    if pr is not None and pr[1] % 4 == 0 and pr[2] % 4 == 0:
        rows_src, c_in, c_out, col_code = pr
        w, wi = c_out // 4, c_in // 4
        bw = _pow2_divisor(w, cfg["max_bw"])
        n_rows = rows_src.size
        bm = max(1, min(cfg["tile_words"] // bw, triton.next_power_of_2(n_rows)))
        nc = w // bw
        meta = dict(KIND=0, W=w, BM=bm, BW=bw, NC=nc, B=1, KW=1, NK=1, WI=wi, CF=-1 - col_code,
                    num_warps=cfg["num_warps"])
        return meta, triton.cdiv(n_rows, bm) * nc, (rows_src, n_rows)
    swz = swizzle_rows(em) if (cfg["use_swizzle"] and word == 4) else None
    if swz is not None:
        rows_src, cw, rows_out = swz
        kw = _pow2_divisor(cw, cfg["swizzle_kw"])
        if kw >= 4:
            nk = cw // kw
            meta = dict(KIND=2, W=cw, BM=1, BW=1, NC=1, B=1, KW=kw, NK=nk, WI=cw, CF=0,
                        num_warps=cfg["swizzle_warps"])
            return meta, (rows_out // 128) * nk, (rows_src, rows_out)
    if em.cell_bytes >= 16 and wpc >= 4:
        bw = _pow2_divisor(wpc, cfg["max_bw"])
        bm = max(1, min(cfg["tile_words"] // bw, triton.next_power_of_2(em.n_out)))
        nc = wpc // bw
        meta = dict(KIND=0, W=wpc, BM=bm, BW=bw, NC=nc, B=1, KW=1, NK=1, WI=wpc, CF=0, num_warps=cfg["num_warps"])
        return meta, triton.cdiv(em.n_out, bm) * nc, None
    b = min(cfg["block_1d"], triton.next_power_of_2(em.n_out * wpc))
    meta = dict(KIND=1, W=wpc, BM=1, BW=1, NC=1, B=b, KW=1, NK=1, WI=wpc, CF=0, num_warps=cfg["warps_1d"])
    return meta, triton.cdiv(em.n_out * wpc, b), None


def _prepare(em: ExecMap, xb: torch.Tensor, ob: torch.Tensor, cfg: dict):
    word = aligned_word(min(em.word, 4), xb, ob)
    meta, tiles, rows = launch_plan(em, word, cfg)
    n_out = em.n_out
    if rows is not None:
        rows_src, n_out = rows
        key = ("rows", str(xb.device), meta["KIND"])
        if key not in em._dev:
            em._dev[key] = torch.from_numpy(rows_src).to(xb.device)
        src = em._dev[key]
    else:
        src = em.src_on(xb.device)
    return word, meta, tiles, src, em.fills_on(xb.device, word), n_out


def gather_triton(em: ExecMap, x: torch.Tensor, out: torch.Tensor, config: dict | None = None) -> None:
    """``out[e, i] = x[e, src[i]]`` (or fill) for every expert, one launch."""
    cfg = dict(CONFIG, **(config or {}))
    experts = x.shape[0]
    if experts == 0 or em.out_bytes == 0:
        return
    if experts > 65535:
        for s in range(0, experts, 65535):
            gather_triton(em, x[s:s + 65535], out[s:s + 65535], config)
        return
    xb, ob = byte_views(x, out)
    word, meta, tiles, src, fills, n_out = _prepare(em, xb, ob, cfg)
    xw, ow = xb.view(word_dtype(word)), ob.view(word_dtype(word))
    _gather_kernel[(tiles, experts)](xw, ow, src, fills, em.in_bytes // word, em.out_bytes // word, n_out,
                                     HAS_FILL=em.has_fill, EVICT=cfg["evict"], **meta)


@triton.jit
def _cycle_kernel(x_ptr, b_ptr, dst_ptr, src_ptr, n_slots, expert_words, saved_words,
                  SAVE: tl.constexpr, W: tl.constexpr, BM: tl.constexpr, BW: tl.constexpr, NC: tl.constexpr):
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
        v = tl.load(xb + tl.maximum(s, 0)[:, None] * W + cols[None, :], mask=(m & here)[:, None])
        vb = tl.load(bb + tl.maximum(-1 - s, 0)[:, None] * W + cols[None, :], mask=(m & ~here)[:, None])
        v = tl.where(here[:, None], v, vb)
        tl.debug_barrier()  # every load of the tile is done before any store overwrites a source
        tl.store(xb + d[:, None] * W + cols[None, :], v, mask=m[:, None])


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
    bw = _pow2_divisor(wpc, cfg["cycle_bw"])
    bm = triton.next_power_of_2(max(1, cfg["tile_words"] // bw))
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
    meta = dict(W=wpc, BM=bm, BW=bw, NC=nc, num_warps=cfg["num_warps"])
    for s0 in range(0, experts, per):
        cnt = min(per, experts - s0)
        part = xw[s0:s0 + cnt]
        if n_saved:
            _cycle_kernel[(triton.cdiv(n_saved, bm) * nc, cnt)](part, scratch, saved, saved, n_saved, ew,
                                                                 n_saved * wpc, SAVE=True, **meta)
        _cycle_kernel[(plan.n_tiles * nc, cnt)](part, scratch, dst, src, plan.moved, ew, n_saved * wpc,
                                                SAVE=False, **meta)
        yield s0 + cnt, scratch


@triton.jit
def _wait_for(counter_ptr, target):
    """Spin until ``*counter_ptr >= target`` (acquire), then line the program up."""
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _signal(counter_ptr):
    """Publish this program's stores, then count one finished item (release)."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _save_rows_item(xb, bb, saved_ptr, n_saved, k, CW: tl.constexpr, BM: tl.constexpr, KB: tl.constexpr):
    slots = k * BM + tl.arange(0, BM)
    cols = tl.arange(0, KB)
    m = (slots < n_saved)[:, None] & (cols < CW)[None, :]
    s = tl.load(saved_ptr + slots, mask=slots < n_saved, other=0).to(tl.int64)
    v = tl.load(xb + s[:, None] * CW + cols[None, :], mask=m)
    tl.store(bb + slots.to(tl.int64)[:, None] * CW + cols[None, :], v, mask=m)


@triton.jit
def _row_tile_item(xb, bb, dst_ptr, src_ptr, moved, r, CW: tl.constexpr, BM: tl.constexpr, KB: tl.constexpr):
    slots = r * BM + tl.arange(0, BM)
    live = slots < moved
    cols = tl.arange(0, KB)
    m = live[:, None] & (cols < CW)[None, :]
    d = tl.load(dst_ptr + slots, mask=live, other=0).to(tl.int64)
    s = tl.load(src_ptr + slots, mask=live, other=0).to(tl.int64)
    here = (s >= 0)[:, None]
    v = tl.load(xb + tl.maximum(s, 0)[:, None] * CW + cols[None, :], mask=m & here)
    vb = tl.load(bb + tl.maximum(-1 - s, 0)[:, None] * CW + cols[None, :], mask=m & ~here,
                 cache_modifier=".cg")  # saved by another program of this launch
    v = tl.where(here, v, vb)
    tl.debug_barrier()
    tl.store(xb + d[:, None] * CW + cols[None, :], v, mask=m)


@triton.jit
def _band_swizzle_item(xb, item, n_bands, CW: tl.constexpr, KB: tl.constexpr, NB: tl.constexpr):
    """Swizzle bands ``item * NB ...`` (each closed: it only moves words within itself)."""
    first = item.to(tl.int64) * NB
    base = first * 128 * CW
    r = tl.arange(0, NB * 128)
    kk = tl.arange(0, KB)
    live = (first + r // 128) < n_bands
    v = tl.load(xb + base + r[:, None] * CW + kk[None, :], mask=live[:, None] & (kk < CW)[None, :],
                cache_modifier=".cg")  # rows another program just wrote
    # band b, row 32*q + p, word kk -> word kk*128 + p*4 + q of band b
    v = tl.reshape(tl.permute(tl.reshape(v, (NB, 4, 32, KB)), (0, 3, 2, 1)), (NB * KB * 128,))
    j = tl.arange(0, NB * KB * 128)
    band, rem = j // (KB * 128), j % (KB * 128)
    tl.debug_barrier()
    tl.store(xb + base + band * (128 * CW) + rem, v, mask=(rem < CW * 128) & (first + band < n_bands))


@triton.jit
def _rows_swizzle_in_place(x_ptr, b_ptr, dst_ptr, src_ptr, saved_ptr, cnt_ptr, experts, n_saved, moved,
                           expert_words, slot_words, n_slots, s_items, r_items, b_items, lag,
                           n_bands, CW: tl.constexpr, BM: tl.constexpr, KB: tl.constexpr, NB: tl.constexpr):
    """Row permutation then 128x4 swizzle, in place, one cooperative launch.

    Work items go step by step, program ``p`` taking items ``p, p + G, ...``; step ``j``
    holds expert ``j``'s save items and row tiles (its cycle plan over whole rows) and
    one item per ``NB`` 128-row bands of expert ``j - lag``. A row tile waits for its expert's
    saved rows, a band for its expert's row tiles (``lag`` steps earlier, so usually
    done), a save for the row tiles of the expert that used its scratch slot before.
    Every wait is on smaller items and every program is resident (cooperative launch),
    so the launch always finishes. Bands are swizzled while their rows are still in L2."""
    per = s_items + r_items + b_items
    total = (experts + lag) * per
    saved_done = cnt_ptr
    rows_done = cnt_ptr + experts
    for t in range(tl.program_id(0), total, tl.num_programs(0)):
        j = t // per
        k = t % per
        if k < s_items + r_items:
            e = j
        else:
            e = j - lag
        if (e >= 0) & (e < experts):
            xb = x_ptr + e.to(tl.int64) * expert_words
            bb = b_ptr + (e % n_slots).to(tl.int64) * slot_words
            if k < s_items:
                if e >= n_slots:
                    _wait_for(rows_done + e - n_slots, r_items)
                _save_rows_item(xb, bb, saved_ptr, n_saved, k, CW, BM, KB)
                _signal(saved_done + e)
            elif k < s_items + r_items:
                _wait_for(saved_done + e, s_items)
                _row_tile_item(xb, bb, dst_ptr, src_ptr, moved, k - s_items, CW, BM, KB)
                _signal(rows_done + e)
            else:
                _wait_for(rows_done + e, r_items)
                _band_swizzle_item(xb, k - s_items - r_items, n_bands, CW, KB, NB)


def inplace_rows_swizzle(em: ExecMap, flat: torch.Tensor, scratch_experts: int, config: dict | None = None):
    """In place for maps of the ``swizzle`` form (a row permutation, then the 128x4
    scale swizzle; 4-byte words): the row permutation along its cycles (rows of the
    scale matrix are the cells), then each 128-row band swizzled on its own, expert by
    expert in one cooperative launch (:func:`_rows_swizzle_in_place`). Scratch: the
    saved rows of as many experts at once as fit in ``scratch_experts`` experts' bytes.
    Yields once, with every expert done after a synchronize; if the driver refuses the
    cooperative launch (nothing has moved then) it runs :func:`inplace_cycles` instead."""
    from fimoe_lab.kernels.cycles import cycle_plan

    cfg = dict(CONFIG, **(config or {}))
    experts, nbytes = flat.shape
    _, cw, n_rows = em.swizzle
    kb = triton.next_power_of_2(cw)
    bm = triton.next_power_of_2(max(1, cfg["swizzle_row_words"] // kb))
    plan = cycle_plan(em, bm, rows=True)
    dst, src, saved = plan.on(flat.device)
    n_saved = plan.saved.size
    slot_words = max(1, n_saved * cw)
    n_slots = plan.experts_per_chunk(4 * cw, scratch_experts * nbytes, experts)
    scratch = torch.empty((n_slots * slot_words,), dtype=torch.int32, device=flat.device)
    counters = torch.zeros(2 * experts, dtype=torch.int32, device=flat.device)
    n_bands = n_rows // 128
    nb = min(triton.next_power_of_2(n_bands), max(1, cfg["swizzle_row_words"] // (128 * kb)))
    s_items, r_items, b_items = triton.cdiv(n_saved, bm), plan.n_tiles, triton.cdiv(n_bands, nb)
    sms = torch.cuda.get_device_properties(flat.device).multi_processor_count
    grid = (max(1, min(sms * cfg["swizzle_per_sm"], experts * (s_items + r_items + b_items))),)
    try:
        _rows_swizzle_in_place[grid](flat.view(torch.int32), scratch, dst, src, saved, counters, experts, n_saved,
                                     plan.moved, nbytes // 4, slot_words, n_slots, s_items, r_items, b_items,
                                     cfg["swizzle_lag"], n_bands, CW=cw, BM=bm, KB=kb, NB=nb,
                                     num_warps=cfg["swizzle_warps"],
                                     launch_cooperative_grid=True)
    except Exception:  # noqa: BLE001 - refused before anything moved
        del scratch
        yield from inplace_cycles(em, flat, scratch_experts, config)
        return
    yield experts, scratch
