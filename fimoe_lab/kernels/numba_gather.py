"""The CPU executor: parallel numba loops, no Python loop per expert or row.

``prange`` runs over (expert, block of output cells) tasks of about 16 KB, visiting
cells band by band of their sources; a cell of 16 bytes or more moves with one LLVM
``memcpy`` (fill: ``memset``), a smaller one as a run of 8-, 4-, 2- or 1-byte words. A row gather followed by the 128x4
scale swizzle has its own loop (one task per 128-row band: the band's source rows
stay in cache while its output is written in order). Compiled on first use and
cached on disk next to this module.
"""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from fimoe_lab.errors import LayoutError
from fimoe_lab.kernels.compiled import ExecMap, aligned_word, byte_views, word_dtype

__all__ = ["check_map", "gather_numba", "inplace_cycles_numba", "parallel_copy", "TASK_BYTES"]

TASK_BYTES = 16384
"""Output bytes per parallel task (measured best on the 2-core CI machine)."""
BAND_BYTES = 1 << 17
"""Input bytes per source band of the visit order."""


@njit(parallel=True, cache=True, nogil=True)
def _gather(x, out, src, fills, visit, block):  # pragma: no cover - compiled
    experts, n_out, w = out.shape
    nb = (n_out + block - 1) // block
    for t in prange(experts * nb):
        e = t // nb
        lo = (t - e * nb) * block
        hi = min(lo + block, n_out)
        xe = x[e]
        oe = out[e]
        for j in range(lo, hi):
            i = visit[j]
            s = src[i]
            if s >= 0:
                for k in range(w):
                    oe[i, k] = xe[s, k]
            else:
                f = fills[-1 - s]
                for k in range(w):
                    oe[i, k] = f


@intrinsic
def _copy_bytes(typingctx, dst, src, n):
    """``memcpy(dst, src, n)`` on integer addresses, as LLVM's memcpy (vector moves)."""
    sig = types.void(types.intp, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        d, s, k = args
        i8p = ir.IntType(8).as_pointer()
        cgutils.raw_memcpy(builder, builder.inttoptr(d, i8p), builder.inttoptr(s, i8p), k, 1)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _fill_bytes(typingctx, dst, value, n):
    """``memset(dst, value, n)`` on an integer address."""
    sig = types.void(types.intp, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        d, v, k = args
        cgutils.memset(builder, builder.inttoptr(d, ir.IntType(8).as_pointer()), k, builder.trunc(v, ir.IntType(8)))
        return context.get_dummy_value()

    return sig, codegen


CYCLES_TILE_BYTES = 1 << 20
"""Bytes per cycle-plan tile on the CPU (a tile's sources are staged in a private buffer)."""

MEMCPY_MIN_CELL = 16
"""Cells of at least this many bytes move with one memcpy each (vector copies)."""


@njit(parallel=True, cache=True, nogil=True)
def _gather_memcpy(x, out, src, fill_bytes, visit, cell, n_in, n_out, block):  # pragma: no cover
    """x, out: flat uint8; one memcpy (or memset) per output cell, banded visit order."""
    xa = x.ctypes.data
    oa = out.ctypes.data
    experts = out.size // (n_out * cell)
    nb = (n_out + block - 1) // block
    for t in prange(experts * nb):
        e = t // nb
        lo = (t - e * nb) * block
        hi = min(lo + block, n_out)
        xb = xa + e * n_in * cell
        ob = oa + e * n_out * cell
        for j in range(lo, hi):
            i = visit[j]
            s = src[i]
            if s >= 0:
                _copy_bytes(ob + i * cell, xb + s * cell, cell)
            else:
                _fill_bytes(ob + i * cell, fill_bytes[-1 - s], cell)


@njit(parallel=True, cache=True, nogil=True)
def _swizzle(x, out, rows, fills, cw):  # pragma: no cover - compiled
    """x (E, n_in_rows*cw) words, out (E, n_rows*cw): row gather then the 128x4 swizzle."""
    experts = x.shape[0]
    n_bands = out.shape[1] // (128 * cw)
    for t in prange(experts * n_bands):
        e = t // n_bands
        band = t - e * n_bands
        base = band * 128 * cw
        xe = x[e]
        oe = out[e]
        for kk in range(cw):
            o = base + kk * 128
            for p in range(32):
                for q in range(4):
                    s = rows[band * 128 + q * 32 + p]
                    if s >= 0:
                        oe[o + p * 4 + q] = xe[s * cw + kk]
                    else:
                        oe[o + p * 4 + q] = fills[-1 - s]


@njit(parallel=True, cache=True, nogil=True)
def parallel_copy(x, out):  # pragma: no cover - compiled
    """``out[:] = x`` over 1-D arrays with every thread: a memcpy ceiling for the benchmark."""
    n = x.size
    chunk = 1 << 16
    for c in prange((n + chunk - 1) // chunk):
        lo = c * chunk
        hi = min(lo + chunk, n)
        out[lo:hi] = x[lo:hi]


def check_map(em: ExecMap) -> None:
    """Refuse (LayoutError) a map whose indices would make the loops read or write out of bounds.

    Must hold: ``src`` int32 ``(n_out,)`` with ``-max(1, len(fills)) <= src[i] < n_in``;
    ``n_in * cell_bytes <= in_bytes`` and ``n_out * cell_bytes == out_bytes``; for the
    swizzle, ``rows`` int32 of at least ``out_bytes / (4 * cw)`` entries, each
    ``-max(1, len(fills)) <= rows[r] < in_bytes / (4 * cw)``. Checked once per map (cached on it).
    """
    if em._dev.get("bounds_ok"):
        return
    n_fill = max(1, len(em.fills))

    def bad(what: str) -> LayoutError:
        return LayoutError(f"{em.name}: executable map {what}", fix="compile the map with IndexMap.compiled()")

    src = np.asarray(em.src)
    if em.cell_bytes < 1 or em.n_out * em.cell_bytes != em.out_bytes or em.n_in * em.cell_bytes > em.in_bytes:
        raise bad(
            f"sizes disagree (cell {em.cell_bytes} B, {em.n_in} -> {em.n_out} cells, {em.in_bytes} -> {em.out_bytes} B)"
        )
    if src.dtype != np.int32 or src.shape != (em.n_out,) or not src.flags.c_contiguous:
        raise bad(f"src is {src.dtype} {src.shape}, expected int32 ({em.n_out},)")
    if src.size and (int(src.min()) < -n_fill or int(src.max()) >= em.n_in):
        raise bad(f"src spans [{int(src.min())}, {int(src.max())}], outside [-{n_fill}, {em.n_in})")
    if em.swizzle is not None:
        rows, cw, _ = em.swizzle
        rows = np.asarray(rows)
        n_rows_in = em.in_bytes // (4 * cw) if cw > 0 else 0
        if cw < 1 or rows.dtype != np.int32 or rows.ndim != 1 or rows.size * 4 * cw < em.out_bytes:
            raise bad(f"swizzle rows {rows.dtype} {rows.shape} with {cw} words per row do not cover the output")
        if rows.size and (int(rows.min()) < -n_fill or int(rows.max()) >= n_rows_in):
            raise bad(f"swizzle rows span [{int(rows.min())}, {int(rows.max())}], outside [-{n_fill}, {n_rows_in})")
    em._dev["bounds_ok"] = True


def _check_buffers(em: ExecMap, xb: torch.Tensor, ob: torch.Tensor) -> None:
    if xb.shape[1] != em.in_bytes or ob.shape[1] != em.out_bytes or ob.shape[0] != xb.shape[0]:
        raise LayoutError(
            f"{em.name}: buffers of {tuple(xb.shape)} and {tuple(ob.shape)} bytes, map needs (E, {em.in_bytes}) "
            f"-> (E, {em.out_bytes})",
            fix="pass the tensors the map was compiled for",
        )


def gather_numba(em: ExecMap, x: torch.Tensor, out: torch.Tensor) -> None:
    """``out[e, i] = x[e, src[i]]`` (or fill) for every expert of CPU tensors (bounds checked: :func:`check_map`)."""
    experts = x.shape[0]
    if experts == 0 or em.out_bytes == 0:
        return
    check_map(em)
    xb, ob = byte_views(x, out)
    _check_buffers(em, xb, ob)
    word = aligned_word(em.word, xb, ob)
    dt = word_dtype(word)
    if em.swizzle is not None and word == 4:
        rows, cw, _ = em.swizzle
        _swizzle(xb.view(dt).numpy(), ob.view(dt).numpy(), rows, em.fill_words(4), cw)
        return
    if em.cell_bytes >= MEMCPY_MIN_CELL:
        fill_bytes = np.array(em.fills or (0,), dtype=np.int32)
        _gather_memcpy(
            xb.numpy().reshape(-1),
            ob.numpy().reshape(-1),
            em.src,
            fill_bytes,
            visit_order(em),
            em.cell_bytes,
            em.n_in,
            em.n_out,
            max(1, TASK_BYTES // em.cell_bytes),
        )
        return
    fills = em.fill_words(word)
    xa, oa = xb.view(dt).numpy(), ob.view(dt).numpy()
    if word == 8 and em.cell_bytes % 16 == 0 and xb.data_ptr() % 16 == 0 and ob.data_ptr() % 16 == 0:
        # 16-byte moves (plain SSE loads/stores; no arithmetic touches the bits)
        word, xa, oa = 16, xa.view(np.complex128), oa.view(np.complex128)
        fills = fills.repeat(2).view(np.complex128)
    wpc = em.cell_bytes // word
    xa = xa.reshape(experts, em.n_in, wpc)
    oa = oa.reshape(experts, em.n_out, wpc)
    _gather(xa, oa, em.src, fills, visit_order(em), max(1, TASK_BYTES // em.cell_bytes))


@njit(parallel=True, cache=True, nogil=True)
def _save_cells(x, buf, saved):  # pragma: no cover - compiled
    """x (E, n_cells, w), buf (E, n_saved, w): set aside the cells a cycle plan saves."""
    experts, n_saved, w = buf.shape
    for t in prange(experts):
        for k in range(n_saved):
            s = saved[k]
            for j in range(w):
                buf[t, k, j] = x[t, s, j]


@njit(parallel=True, cache=True, nogil=True)
def _cycle_tiles(x, buf, dst, src, tile):  # pragma: no cover - compiled
    """Run every tile of a cycle plan: load the tile's sources into a private buffer,
    then store them (no other task reads or writes these cells)."""
    experts, _, w = x.shape
    moved = dst.size
    nt = (moved + tile - 1) // tile
    for t in prange(experts * nt):
        e = t // nt
        lo = (t - e * nt) * tile
        hi = min(lo + tile, moved)
        tmp = np.empty((hi - lo, w), dtype=x.dtype)
        xe = x[e]
        be = buf[e]
        for k in range(lo, hi):
            s = src[k]
            if s >= 0:
                for j in range(w):
                    tmp[k - lo, j] = xe[s, j]
            else:
                for j in range(w):
                    tmp[k - lo, j] = be[-1 - s, j]
        for k in range(lo, hi):
            d = dst[k]
            for j in range(w):
                xe[d, j] = tmp[k - lo, j]


def inplace_cycles_numba(em: ExecMap, flat: torch.Tensor, scratch_experts: int):
    """Permute every expert of the CPU tensor ``flat`` ``(E, bytes)`` in place along the
    map's cycles (:mod:`.cycles`), ``CYCLES_TILE_BYTES`` of cells per tile; one pass over
    the bytes. Yields the number of leading experts done after each chunk (a chunk is as
    many experts as the scratch of ``scratch_experts`` experts holds saved cells of)."""
    from fimoe_lab.kernels.cycles import cycle_plan

    experts, nbytes = flat.shape
    check_map(em)
    if nbytes != em.in_bytes or em.in_bytes != em.out_bytes:
        raise LayoutError(
            f"{em.name}: in-place run on {nbytes} bytes per expert, map is {em.in_bytes} -> {em.out_bytes}",
            fix="run in place only a permutation of the tensor's own bytes",
        )
    word = aligned_word(em.word, flat)
    wpc = em.cell_bytes // word
    plan = cycle_plan(em, max(1, CYCLES_TILE_BYTES // em.cell_bytes))
    n_saved = plan.saved.size
    per = plan.experts_per_chunk(em.cell_bytes, scratch_experts * nbytes, experts)
    x = flat.view(word_dtype(word)).numpy().reshape(experts, em.n_in, wpc)
    buf = np.empty((per, n_saved, wpc), dtype=x.dtype)
    for s0 in range(0, experts, per):
        part = x[s0 : s0 + per]
        b = buf[: part.shape[0]]
        if plan.moved:
            _save_cells(part, b, plan.saved)
            _cycle_tiles(part, b, plan.dst, plan.src, plan.tile_slots)
        yield s0 + part.shape[0], buf


def visit_order(em: ExecMap) -> np.ndarray:
    """Output cells ordered by source band (about BAND_BYTES of input), then by position.

    Cells are copied in this order: a band of source rows stays in cache (and in the
    TLB) while all the output cells it feeds are written, in runs. For block-major-K
    this turns 128-byte reads at a 7 KB stride into reads of a cached band.
    """
    key = "visit"
    if key not in em._dev:
        band = max(1, BAND_BYTES // em.cell_bytes)
        src = em.src.astype(np.int64)
        em._dev[key] = np.lexsort((np.arange(src.size), np.where(src >= 0, src // band, -1))).astype(np.int32)
    return em._dev[key]
