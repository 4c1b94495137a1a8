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
over whole output rows. :func:`inplace_triton` runs a permutation in place through a
two-slot scratch, one launch per chunk (the gather of one slot and the copy of the next
fused).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fimoe_lab.kernels.compiled import ExecMap, aligned_word, byte_views, swizzle_rows, word_dtype

# Tile sizes, chosen on the H200 (benchmarks/RESULTS.md); override for sweeps.
CONFIG = {"tile_words": 4096, "num_warps": 4, "evict": False, "block_1d": 8192, "warps_1d": 8, "max_bw": 1024,
          "swizzle_kw": 32, "swizzle_warps": 4, "use_swizzle": True, "copy_block": 4096,
          "slot_bytes": 0, "hints": False, "persistent_per_sm": 2, "persistent_slot_bytes": 30 << 20, "inplace": "auto",
          "cycle_bw": 64}


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
    if EVICT == 2:  # data another program wrote in this launch: read through L2, not L1
        v = tl.load(src, mask=lm, cache_modifier=".cg")
    elif EVICT == 1:
        v = tl.load(src, mask=lm, eviction_policy="evict_first")
    else:
        v = tl.load(src, mask=lm)
    if WI < W:
        v = tl.where(cin[None, :], v, tl.load(fill_ptr + CF))
    if HAS_FILL:
        v = tl.where(valid[:, None], v, fw[:, None])
    tl.store(ob + rows.to(tl.int64)[:, None] * W + cols[None, :], v, mask=rmask[:, None])


@triton.jit
def _words_block(xb, ob, src_ptr, fill_ptr, n_out, t, W: tl.constexpr, B: tl.constexpr, HAS_FILL: tl.constexpr,
                 CG: tl.constexpr = False):
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
    elif CG:
        v = tl.load(xb + s.to(tl.int64) * W + j % W, mask=m, cache_modifier=".cg")
    else:
        v = tl.load(xb + s.to(tl.int64) * W + j % W, mask=m)
    tl.store(ob + j, v, mask=m)


@triton.jit
def _swizzle_tile(xb, ob, rows_ptr, fill_ptr, t, CW: tl.constexpr, KW: tl.constexpr, NK: tl.constexpr,
                  HAS_FILL: tl.constexpr, CG: tl.constexpr = False):
    band = t // NK
    kc = t % NK
    r = band * 128 + tl.arange(0, 128)
    s = tl.load(rows_ptr + r)
    if HAS_FILL:
        valid = s >= 0
        fw = tl.load(fill_ptr + tl.maximum(-1 - s, 0))
        s = tl.maximum(s, 0)
    k = kc * KW + tl.arange(0, KW)
    if CG:
        v = tl.load(xb + s.to(tl.int64)[:, None] * CW + k[None, :], cache_modifier=".cg")
    else:
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


@triton.jit
def _inplace_step(x_ptr, s_ptr, src_ptr, fill_ptr, g_src, g_dst, g_tiles, tiles_per_expert,
                  c_src, c_dst, c_words, expert_words, n_out,
                  KIND: tl.constexpr, W: tl.constexpr, BM: tl.constexpr, BW: tl.constexpr, NC: tl.constexpr,
                  B: tl.constexpr, KW: tl.constexpr, NK: tl.constexpr, HAS_FILL: tl.constexpr,
                  CB: tl.constexpr, HINTS: tl.constexpr):
    """Programs [0, g_tiles) gather a slot of the scratch back into x; the rest copy the
    next chunk of x into the other slot (disjoint buffers, so one launch does both)."""
    pid = tl.program_id(0)
    if pid < g_tiles:
        e = (pid // tiles_per_expert).to(tl.int64)
        t = pid % tiles_per_expert
        xb = s_ptr + g_src + e * expert_words
        ob = x_ptr + g_dst + e * expert_words
        if KIND == 0:
            _rows_tile(xb, ob, src_ptr, fill_ptr, n_out, t, W, BM, BW, NC, HAS_FILL, HINTS, W, 0)
        elif KIND == 1:
            _words_block(xb, ob, src_ptr, fill_ptr, n_out, t, W, B, HAS_FILL)
        else:
            _swizzle_tile(xb, ob, src_ptr, fill_ptr, t, W, KW, NK, HAS_FILL)
    else:
        j = (pid - g_tiles).to(tl.int64) * CB + tl.arange(0, CB)
        m = j < c_words
        if HINTS:  # x is read once; keep the slot in L2 for the gather that reads it next
            v = tl.load(x_ptr + c_src + j, mask=m, eviction_policy="evict_first")
            tl.store(s_ptr + c_dst + j, v, mask=m, eviction_policy="evict_last")
        else:
            v = tl.load(x_ptr + c_src + j, mask=m)
            tl.store(s_ptr + c_dst + j, v, mask=m)


@triton.jit
def _grid_barrier(bar_ptr, target):
    """Every program of the (co-resident) grid arrives; returns once all have."""
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _inplace_persistent(x_ptr, s_ptr, src_ptr, fill_ptr, bar_ptr, experts, per, tiles_per_expert, expert_words,
                        n_out, KIND: tl.constexpr, W: tl.constexpr, BM: tl.constexpr, BW: tl.constexpr,
                        NC: tl.constexpr, B: tl.constexpr, KW: tl.constexpr, NK: tl.constexpr,
                        HAS_FILL: tl.constexpr, CB: tl.constexpr):
    """One launch for the whole tensor: for each chunk of ``per`` experts, all programs
    copy it into the scratch (kept in L2: ``evict_last``), meet at a grid barrier,
    gather it back into place (reading the scratch through L2), and meet again."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    n_chunks = tl.cdiv(experts, per)
    phase = 0
    for k in range(0, n_chunks):
        first = k * per
        cnt = tl.minimum(per, experts - first)
        c_words = cnt.to(tl.int64) * expert_words
        base = first.to(tl.int64) * expert_words
        n_blocks = tl.cdiv(c_words, CB).to(tl.int32)
        for b in range(pid, n_blocks, G):
            j = b.to(tl.int64) * CB + tl.arange(0, CB)
            m = j < c_words
            v = tl.load(x_ptr + base + j, mask=m, eviction_policy="evict_first")
            tl.store(s_ptr + j, v, mask=m, eviction_policy="evict_last")
        phase += 1
        _grid_barrier(bar_ptr, phase * G)
        for t in range(pid, cnt * tiles_per_expert, G):
            e = (t // tiles_per_expert).to(tl.int64)
            tt = t % tiles_per_expert
            xb = s_ptr + e * expert_words
            ob = x_ptr + base + e * expert_words
            if KIND == 0:
                _rows_tile(xb, ob, src_ptr, fill_ptr, n_out, tt, W, BM, BW, NC, HAS_FILL, 2, W, 0)
            elif KIND == 1:
                _words_block(xb, ob, src_ptr, fill_ptr, n_out, tt, W, B, HAS_FILL, True)
            else:
                _swizzle_tile(xb, ob, src_ptr, fill_ptr, tt, W, KW, NK, HAS_FILL, True)
        phase += 1
        _grid_barrier(bar_ptr, phase * G)


def inplace_persistent(em: ExecMap, flat: torch.Tensor, scratch_experts: int, config: dict | None = None):
    """Like :func:`inplace_triton` but one cooperative launch for the whole tensor: for
    each chunk (at most ``scratch_experts`` experts and ``persistent_slot_bytes``), the
    grid copies it to the scratch, meets at a grid barrier, gathers it back, meets
    again. No launch per chunk, so small experts and scales are no longer bound by
    launch overhead. Every byte still crosses memory twice (RESULTS.md). Yields once;
    falls back to :func:`inplace_triton` if the cooperative launch is refused."""
    cfg = dict(CONFIG, **(config or {}))
    experts, nbytes = flat.shape
    word, meta, tiles, src, fills, n_out = _prepare(em, flat, flat, cfg)
    meta = {k: v for k, v in meta.items() if k not in ("WI", "CF")}
    ew = nbytes // word
    per = max(1, min(scratch_experts, experts, cfg["persistent_slot_bytes"] // max(nbytes, 1)))
    scratch = torch.empty((per, nbytes), dtype=torch.uint8, device=flat.device)
    bar = torch.zeros(1, dtype=torch.int32, device=flat.device)
    sms = torch.cuda.get_device_properties(flat.device).multi_processor_count
    grid = (sms * cfg["persistent_per_sm"],)
    try:
        # cooperative launch: the driver refuses (instead of deadlocking) if the grid
        # cannot be resident at once; nothing has moved then, so fall back.
        _inplace_persistent[grid](flat.view(word_dtype(word)), scratch.view(word_dtype(word)), src, fills, bar,
                                  experts, per, tiles, ew, n_out, HAS_FILL=em.has_fill, CB=cfg["copy_block"],
                                  launch_cooperative_grid=True, **meta)
    except Exception:  # noqa: BLE001
        del scratch
        yield from inplace_triton(em, flat, scratch_experts, config)
        return
    yield experts, scratch


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


def inplace_triton(em: ExecMap, flat: torch.Tensor, scratch_experts: int, config: dict | None = None):
    """Permute every expert of ``flat`` ``(E, bytes)`` in place; yields after each launch.

    With ``scratch_experts >= 2`` the scratch is two slots of ``scratch_experts // 2``
    experts (``slot_bytes``, when set, caps a slot): launch k gathers slot k%2 back into
    chunk k and copies chunk k+1 into the other slot. With one expert of scratch, copy
    and gather alternate on one slot. Every byte crosses DRAM twice (copy, then
    gather), so this mode is bounded by half the copy bandwidth (RESULTS.md). Yields
    the number of leading experts whose gather has been launched; the stream orders
    the launches, so after a synchronize those experts are done and the rest of ``x``
    still holds its input.
    """
    cfg = dict(CONFIG, **(config or {}))
    experts, nbytes = flat.shape
    word, meta, tiles, src, fills, n_out = _prepare(em, flat, flat, cfg)
    if nbytes % word or em.in_bytes != em.out_bytes:
        raise ValueError("in-place needs a size-preserving map")
    ew = nbytes // word
    if scratch_experts >= 2:
        per = max(1, min(scratch_experts // 2, cfg["slot_bytes"] // max(nbytes, 1)) if cfg["slot_bytes"] else scratch_experts // 2)
        slots = 2
    else:
        per, slots = 1, 1
    scratch = torch.empty((slots * per, nbytes), dtype=torch.uint8, device=flat.device)
    xw, sw = flat.view(word_dtype(word)), scratch.view(word_dtype(word))
    cb = cfg["copy_block"]
    chunks = [(s, min(s + per, experts)) for s in range(0, experts, per)]
    meta = {k: v for k, v in meta.items() if k not in ("WI", "CF")}
    common = dict(HAS_FILL=em.has_fill, CB=cb, HINTS=cfg["hints"], **meta)

    def step(g, c, g_slot, c_slot):
        g_tiles = 0 if g is None else (g[1] - g[0]) * tiles
        c_words = 0 if c is None else (c[1] - c[0]) * ew
        grid = (g_tiles + triton.cdiv(c_words, cb),)
        _inplace_step[grid](xw, sw, src, fills,
                            g_slot * per * ew, 0 if g is None else g[0] * ew, g_tiles, tiles,
                            0 if c is None else c[0] * ew, c_slot * per * ew, c_words, ew, n_out, **common)

    if slots == 2:
        step(None, chunks[0], 0, 0)
        for k, g in enumerate(chunks):
            nxt = chunks[k + 1] if k + 1 < len(chunks) else None
            step(g, nxt, k % 2, (k + 1) % 2)
            yield g[1], scratch
    else:
        for g in chunks:
            step(None, g, 0, 0)
            step(g, None, 0, 0)
            yield g[1], scratch


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
    key = ("cycles", bm, str(flat.device))
    if key not in em._dev:
        em._dev[key] = tuple(torch.from_numpy(a).to(flat.device) for a in (plan.dst, plan.src, plan.saved))
    dst, src, saved = em._dev[key]
    n_saved = plan.saved.size
    per = experts if n_saved == 0 else max(1, min(experts, scratch_experts * nbytes // (n_saved * em.cell_bytes)))
    per = min(per, 65535)
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
def _rows_swizzle_in_place(x_ptr, b_ptr, dst_ptr, src_ptr, saved_ptr, cnt_ptr, experts, n_saved, moved,
                           expert_words, slot_words, n_slots, s_items, r_items, b_items,
                           CW: tl.constexpr, BM: tl.constexpr, BW: tl.constexpr, NC: tl.constexpr,
                           KB: tl.constexpr):
    """Row permutation then 128x4 swizzle, in place, one persistent launch.

    Work items, numbered per expert (save items, row tiles of the cycle plan, one item
    per 128-row band) and claimed in order from a ticket counter. A row tile waits for
    its expert's saved rows, a band for its expert's row tiles, a save for the row tiles
    of the expert that used its scratch slot before; every wait is on smaller tickets,
    which running programs hold, so the launch always finishes. The band reads rows a
    moment after they were written, from L2: the bytes cross DRAM about once."""
    per = s_items + r_items + b_items
    total = experts * per
    saved_done = cnt_ptr + 1
    rows_done = cnt_ptr + 1 + experts
    t = tl.atomic_add(cnt_ptr, 1)
    while t < total:
        e = t // per
        k = t % per
        xb = x_ptr + e.to(tl.int64) * expert_words
        bb = b_ptr + (e % n_slots).to(tl.int64) * slot_words
        if k < s_items:
            if e >= n_slots:
                _wait_for(rows_done + e - n_slots, r_items)
            slots = (k // NC) * BM + tl.arange(0, BM)
            m = slots < n_saved
            cols = (k % NC) * BW + tl.arange(0, BW)
            s = tl.load(saved_ptr + slots, mask=m, other=0).to(tl.int64)
            v = tl.load(xb + s[:, None] * CW + cols[None, :], mask=m[:, None])
            tl.store(bb + slots.to(tl.int64)[:, None] * CW + cols[None, :], v, mask=m[:, None])
            _signal(saved_done + e)
        elif k < s_items + r_items:
            _wait_for(saved_done + e, s_items)
            r = k - s_items
            slots = (r // NC) * BM + tl.arange(0, BM)
            m = slots < moved
            cols = (r % NC) * BW + tl.arange(0, BW)
            d = tl.load(dst_ptr + slots, mask=m, other=0).to(tl.int64)
            s = tl.load(src_ptr + slots, mask=m, other=0).to(tl.int64)
            here = s >= 0
            v = tl.load(xb + tl.maximum(s, 0)[:, None] * CW + cols[None, :], mask=(m & here)[:, None])
            vb = tl.load(bb + tl.maximum(-1 - s, 0)[:, None] * CW + cols[None, :], mask=(m & ~here)[:, None],
                         cache_modifier=".cg")
            v = tl.where(here[:, None], v, vb)
            tl.debug_barrier()
            tl.store(xb + d[:, None] * CW + cols[None, :], v, mask=m[:, None])
            _signal(rows_done + e)
        else:
            _wait_for(rows_done + e, r_items)
            base = (k - s_items - r_items).to(tl.int64) * 128 * CW
            kk = tl.arange(0, KB)
            v = tl.load(xb + base + tl.arange(0, 128)[:, None] * CW + kk[None, :], mask=(kk < CW)[None, :],
                        cache_modifier=".cg")
            # row r = 32*q + p of the band, word kk -> word kk*128 + p*4 + q of the band
            v = tl.reshape(tl.permute(tl.reshape(v, (4, 32, KB)), (2, 1, 0)), (KB * 128,))
            j = tl.arange(0, KB * 128)
            tl.debug_barrier()
            tl.store(xb + base + j, v, mask=j < CW * 128)
        t = tl.atomic_add(cnt_ptr, 1)


def inplace_rows_swizzle(em: ExecMap, flat: torch.Tensor, scratch_experts: int, config: dict | None = None):
    """In place for maps of the ``swizzle`` form (a row permutation, then the 128x4
    scale swizzle; 4-byte words): the row permutation along its cycles (rows of the
    scale matrix are the cells), then each 128-row band swizzled on its own, expert by
    expert in one persistent launch (:func:`_rows_swizzle_in_place`). Scratch: the
    saved rows of as many experts at once as fit in ``scratch_experts`` experts' bytes.
    Yields once, with every expert launched."""
    from fimoe_lab.kernels.cycles import cycle_plan

    cfg = dict(CONFIG, **(config or {}))
    experts, nbytes = flat.shape
    _, cw, n_rows = em.swizzle
    bw = _pow2_divisor(cw, cfg["cycle_bw"])
    bm = triton.next_power_of_2(max(1, cfg["tile_words"] // bw))
    nc = cw // bw
    plan = cycle_plan(em, bm, rows=True)
    key = ("rows_cycles", bm, str(flat.device))
    if key not in em._dev:
        em._dev[key] = tuple(torch.from_numpy(a).to(flat.device) for a in (plan.dst, plan.src, plan.saved))
    dst, src, saved = em._dev[key]
    n_saved = plan.saved.size
    slot_words = max(1, n_saved * cw)
    n_slots = max(1, min(experts, scratch_experts * nbytes // (4 * slot_words)))
    scratch = torch.empty((n_slots * slot_words,), dtype=torch.int32, device=flat.device)
    counters = torch.zeros(1 + 2 * experts, dtype=torch.int32, device=flat.device)
    s_items = triton.cdiv(n_saved, bm) * nc
    r_items = plan.n_tiles * nc
    b_items = n_rows // 128
    sms = torch.cuda.get_device_properties(flat.device).multi_processor_count if flat.is_cuda else 1
    grid = (max(1, min(sms * cfg["persistent_per_sm"], experts * (s_items + r_items + b_items))),)
    _rows_swizzle_in_place[grid](flat.view(torch.int32), scratch, dst, src, saved, counters, experts, n_saved,
                                 plan.moved, nbytes // 4, slot_words, n_slots, s_items, r_items, b_items,
                                 CW=cw, BM=bm, BW=bw, NC=nc, KB=triton.next_power_of_2(cw),
                                 num_warps=cfg["swizzle_warps"])
    yield experts, scratch
