"""The CPU executor: parallel numba loops, no Python loop per expert or row.

``prange`` runs over (expert, block of about ``TASK_BYTES`` output cells) tasks, visiting
cells in the order of their sources (:func:`visit_order`: every task reads its input
front to back, and reads each cell's source from :func:`visit_sources` beside it rather
than through the visit index); a cell of 16 bytes or more moves with one ``memcpy`` (fill: ``memset``),
a smaller one as a run of 8-, 4-, 2- or 1-byte words. A row gather followed by the 128x4
scale swizzle has its own loop (:func:`_swizzle`: one task per 128-row band, 4x4 word
transposes in vector registers, the source rows of a later band prefetched); rows of any
width padded on the right, then swizzled (gpt-oss's 90-byte MXFP4 scale rows), have another
(:func:`_swizzled_rows`: 4-byte moves, one task per band). Outputs of
at least ``STREAM_MIN_BYTES`` are written with non-temporal (streaming) stores, which skip
the read of each destination line that a plain store costs: 64-byte aligned cells of
whole lines, and the swizzle's whole-line stores; an output whose pages are not mapped yet
(a new tensor this large is usually a fresh ``mmap``) takes plain stores (:func:`pages_mapped`).
Compiled on first use and cached on disk next to this module (``NUMBA_CACHE_DIR``
elsewhere); :mod:`fimoe_lab.warmup` compiles ahead.
"""

from __future__ import annotations

import ctypes
import mmap

import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from fimoe_lab import libc
from fimoe_lab.errors import LayoutError
from fimoe_lab.kernels.compiled import ExecMap, aligned_word, row_form_fault, word_dtype

__all__ = [
    "preload",
    "check_map",
    "gather_numba",
    "inplace_cycles_numba",
    "pages_mapped",
    "parallel_copy",
    "visit_order",
    "visit_sources",
    "TASK_BYTES",
]

TASK_BYTES = 1 << 16
"""Output bytes per parallel task of the cell gather (measured on the 2-core CI machine)."""


@njit(parallel=True, cache=True, nogil=True)
def _gather(x, out, src, fills, visit, block):  # pragma: no cover - compiled
    """x (E, n_in, w), out (E, n_out, w) words: output cell ``visit[j]`` is input cell
    ``src[j]`` (in visit order, :func:`visit_sources`) or fill word ``fills[-1 - src[j]]``."""
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
            s = src[j]
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


@intrinsic
def _stream_bytes(typingctx, dst, src, n):
    """Copy ``n`` bytes (``n % 64 == 0``, ``dst % 64 == 0``) with 64-byte non-temporal stores.

    Streaming stores skip the read-for-ownership of the destination line, so a large output
    costs one read and one write per byte (a plain store costs two reads and a write).
    """
    sig = types.void(types.intp, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        d, s, k = args
        i8p = ir.IntType(8).as_pointer()
        vp = ir.VectorType(ir.IntType(64), 8).as_pointer()
        dp, sp = builder.inttoptr(d, i8p), builder.inttoptr(s, i8p)
        nt = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        with cgutils.for_range(builder, builder.lshr(k, ir.Constant(k.type, 6))) as loop:
            off = builder.shl(loop.index, ir.Constant(k.type, 6))
            v = builder.load(builder.bitcast(builder.gep(sp, [off]), vp), align=1)
            builder.store(v, builder.bitcast(builder.gep(dp, [off]), vp), align=64).set_metadata("nontemporal", nt)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _store_fence(typingctx):
    """A full fence (x86: ``mfence``): this thread's streaming stores are visible before its
    later stores, e.g. the end of its task (streaming stores are weakly ordered)."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _prefetch(typingctx, addr):
    """Software prefetch of the line at ``addr`` into L2 (``prefetcht1``; never faults)."""
    sig = types.void(types.intp)

    def codegen(context, builder, signature, args):
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0i8"
        )
        builder.call(fn, [builder.inttoptr(args[0], i8p), i32(0), i32(2), i32(1)])
        return context.get_dummy_value()

    return sig, codegen


def _transpose4_codegen(streaming: bool):
    def codegen(context, builder, signature, args):
        d, stride, a0, a1, a2, a3 = args
        i8p = ir.IntType(8).as_pointer()
        vt = ir.VectorType(ir.IntType(32), 4)
        v = [builder.load(builder.inttoptr(a, vt.as_pointer()), align=4) for a in (a0, a1, a2, a3)]

        def mix(p, q, lanes):
            return builder.shuffle_vector(p, q, ir.Constant(ir.VectorType(ir.IntType(32), 4), lanes))

        lo01, hi01 = mix(v[0], v[1], [0, 4, 1, 5]), mix(v[0], v[1], [2, 6, 3, 7])
        lo23, hi23 = mix(v[2], v[3], [0, 4, 1, 5]), mix(v[2], v[3], [2, 6, 3, 7])
        outs = (
            mix(lo01, lo23, [0, 1, 4, 5]),
            mix(lo01, lo23, [2, 3, 6, 7]),
            mix(hi01, hi23, [0, 1, 4, 5]),
            mix(hi01, hi23, [2, 3, 6, 7]),
        )
        base = builder.inttoptr(d, i8p)
        nt = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        for j, o in enumerate(outs):
            off = builder.mul(stride, ir.Constant(stride.type, j))
            st = builder.store(o, builder.bitcast(builder.gep(base, [off]), vt.as_pointer()), align=16)
            if streaming:
                st.set_metadata("nontemporal", nt)
        return context.get_dummy_value()

    return codegen


@intrinsic
def _transpose4(typingctx, dst, stride, a0, a1, a2, a3):
    """Four 4-byte words from each of ``a0..a3`` -> word ``j`` of every source at ``dst + j*stride``
    (16-byte aligned), in source order: a 4x4 transpose of 32-bit words, as vector shuffles."""
    return types.void(*([types.intp] * 6)), _transpose4_codegen(False)


def _lines16_codegen(context, builder, signature, args):
    """Four :func:`_transpose4` side by side (sources ``a[4p + q]``, ``p, q < 4``), stored as
    whole 64-byte lines: line ``j`` at ``dst + j*stride`` holds word ``j`` of the 16 sources,
    written with one non-temporal 64-byte store (``dst`` and ``stride`` multiples of 64)."""
    d, stride = args[0], args[1]
    srcs = [builder.extract_value(args[2], k) for k in range(16)]
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    vt = ir.VectorType(i32, 4)

    def mix(p, q, lanes):
        return builder.shuffle_vector(p, q, ir.Constant(ir.VectorType(i32, len(lanes)), lanes))

    cols = []  # cols[p][j]: word j of sources 4p..4p+3
    for p in range(4):
        v = [builder.load(builder.inttoptr(a, vt.as_pointer()), align=4) for a in srcs[4 * p : 4 * p + 4]]
        lo01, hi01 = mix(v[0], v[1], [0, 4, 1, 5]), mix(v[0], v[1], [2, 6, 3, 7])
        lo23, hi23 = mix(v[2], v[3], [0, 4, 1, 5]), mix(v[2], v[3], [2, 6, 3, 7])
        cols.append(
            (
                mix(lo01, lo23, [0, 1, 4, 5]),
                mix(lo01, lo23, [2, 3, 6, 7]),
                mix(hi01, hi23, [0, 1, 4, 5]),
                mix(hi01, hi23, [2, 3, 6, 7]),
            )
        )
    base = builder.inttoptr(d, i8p)
    nt = builder.module.add_metadata([ir.Constant(i32, 1)])
    line_t = ir.VectorType(i32, 16)
    for j in range(4):
        lo = mix(cols[0][j], cols[1][j], list(range(8)))
        hi = mix(cols[2][j], cols[3][j], list(range(8)))
        line = mix(lo, hi, list(range(16)))
        off = builder.mul(stride, ir.Constant(stride.type, j))
        st = builder.store(line, builder.bitcast(builder.gep(base, [off]), line_t.as_pointer()), align=64)
        st.set_metadata("nontemporal", nt)
    return context.get_dummy_value()


@intrinsic
def _transpose16_lines(typingctx, dst, stride, addrs):
    """Four 4x4 word transposes (:func:`_transpose4`) written as four whole 64-byte lines with
    non-temporal stores (:func:`_lines16_codegen`): a line is filled by one store, so the write
    combining never flushes part of a line."""
    return types.void(types.intp, types.intp, types.UniTuple(types.intp, 16)), _lines16_codegen


STREAM_MIN_BYTES = 1 << 22
"""Outputs of at least this many bytes (more than a core's share of the last-level cache) are
written with non-temporal stores where the kernel has them (64-byte aligned cells, the 128x4
swizzle) if their pages are mapped (:func:`pages_mapped`); smaller ones stay in cache for whoever
reads them next."""


_MINCORE = libc.function("mincore", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p])


def pages_mapped(t: torch.Tensor) -> bool:
    """Whether the memory pages at a quarter, half and three quarters of ``t``'s bytes are mapped
    (``mincore``; True where that cannot be asked).

    A large new CPU tensor is usually a fresh ``mmap`` (the C library may also serve it from freed heap
    memory, already mapped), whose pages are mapped by their first write; streaming
    stores into such pages cost more than plain ones (DeepSeek-V3's 940 MB W13 rows on a 2-core CPU:
    223 ms against 204, on pages already written 37-41 against 63; ``benchmarks/fresh_pages.py``)."""
    if _MINCORE is None or t.nbytes == 0:
        return True
    page, base, vec = mmap.PAGESIZE, t.data_ptr(), ctypes.c_ubyte()
    for k in (1, 2, 3):
        addr = (base + t.nbytes * k // 4) & -page
        if _MINCORE(addr, page, ctypes.byref(vec)) != 0:
            return True
        if not vec.value & 1:
            return False
    return True


CYCLES_TILE_BYTES = 1 << 20
"""Bytes per cycle-plan tile on the CPU (a tile's sources are staged in a private buffer)."""

MEMCPY_MIN_CELL = 16
"""Cells of at least this many bytes move with one memcpy each (vector copies)."""


@njit(parallel=True, cache=True, nogil=True)
def _gather_memcpy(xa, oa, experts, src, fill_bytes, visit, cell, in_bytes, n_out, block, stream):  # pragma: no cover
    """xa, oa: addresses of ``experts`` experts' input (``in_bytes`` each) and output
    (``n_out * cell``); one memcpy (or memset) per output cell: output cell ``visit[j]``
    from input cell ``src[j]`` (``src`` in visit order, :func:`visit_sources`: the loop
    reads both front to back, no dependent load). ``stream``: cells are whole 64-byte lines
    of a 64-byte aligned output, written with non-temporal stores (:func:`_stream_bytes`).
    Addresses, not arrays: the launch then costs no array conversion (a small tensor's
    transform is a few tens of microseconds)."""
    nb = (n_out + block - 1) // block
    for t in prange(experts * nb):
        e = t // nb
        lo = (t - e * nb) * block
        hi = min(lo + block, n_out)
        xb = xa + e * in_bytes
        ob = oa + e * n_out * cell
        for j in range(lo, hi):
            i = visit[j]
            s = src[j]
            if s < 0:
                _fill_bytes(ob + i * cell, fill_bytes[-1 - s], cell)
            elif stream:
                _stream_bytes(ob + i * cell, xb + s * cell, cell)
            else:
                _copy_bytes(ob + i * cell, xb + s * cell, cell)
        if stream:
            _store_fence()


@njit(parallel=True, cache=True, nogil=True)
def _pad_rows(x, out, rows, visit, fill_bytes, c_in, c_out, col_code, block, stream):  # pragma: no cover - compiled
    """x, out: flat uint8; output row ``i`` (``c_out`` bytes) is input row ``rows[i]`` (``c_in``
    bytes) then ``c_out - c_in`` bytes of fill ``col_code``, or all fill ``rows[i]`` when negative;
    rows in ``visit`` order. ``stream``: rows of whole 64-byte lines in a 64-byte aligned output
    (:func:`_stream_bytes`)."""
    xa = x.ctypes.data
    oa = out.ctypes.data
    n_rows = rows.size
    experts = out.size // (n_rows * c_out)
    n_in = x.size // max(1, experts)
    nb = (n_rows + block - 1) // block
    tail = fill_bytes[-1 - col_code]
    for t in prange(experts * nb):
        e = t // nb
        lo = (t - e * nb) * block
        hi = min(lo + block, n_rows)
        xb = xa + e * n_in
        ob = oa + e * n_rows * c_out
        for j in range(lo, hi):
            i = visit[j]
            s = rows[i]
            d = ob + i * c_out
            if s < 0:
                _fill_bytes(d, fill_bytes[-1 - s], c_out)
                continue
            if stream:
                _stream_bytes(d, xb + s * c_in, c_in)
            else:
                _copy_bytes(d, xb + s * c_in, c_in)
            _fill_bytes(d + c_in, tail, c_out - c_in)
        if stream:
            _store_fence()


@njit(parallel=True, cache=True, nogil=True)
def _swizzled_rows(xa, oa, experts, rows, fill_bytes, c_in, cw, col_code, in_bytes):  # pragma: no cover - compiled
    """xa, oa: addresses of ``experts`` experts' input (``in_bytes`` each) and output (``4 cw R`` bytes, ``R =
    rows.size``); the ``swizzled_rows`` form: row ``r = 128 b + 32 q + p`` is input row ``rows[r]`` (``c_in``
    bytes, then fill ``col_code`` up to ``4 cw``) or all fill ``rows[r]`` when negative, and its bytes ``4k ..
    4k+3`` go to output bytes ``512 (b cw + k) + 16 p + 4 q``. One task per (expert, band of 128 rows), whose
    output is one contiguous run of ``512 cw`` bytes; 4-byte moves at any alignment."""
    n_rows = rows.size
    bands = n_rows // 128
    full = c_in // 4
    rem = c_in - 4 * full
    tail = fill_bytes[-1 - col_code]
    for t in prange(experts * bands):
        e = t // bands
        b = t - e * bands
        xb = xa + e * in_bytes
        ob = oa + e * n_rows * 4 * cw + b * cw * 512
        for rr in range(128):
            s = rows[b * 128 + rr]
            d = ob + 16 * (rr % 32) + 4 * (rr // 32)
            if s < 0:
                v = fill_bytes[-1 - s]
                for k in range(cw):
                    _fill_bytes(d + 512 * k, v, 4)
                continue
            src = xb + s * c_in
            for k in range(full):
                _copy_bytes(d + 512 * k, src + 4 * k, 4)
            k = full
            if rem:
                _copy_bytes(d + 512 * k, src + 4 * k, rem)
                _fill_bytes(d + 512 * k + rem, tail, 4 - rem)
                k += 1
            for kk in range(k, cw):
                _fill_bytes(d + 512 * kk, tail, 4)


SWIZZLE_PREFETCH_BANDS = 2
"""The 128x4 swizzle prefetches the source rows of the band this many bands ahead, all at the
band's start, when its rows are short (under :data:`SWIZZLE_SPREAD_MIN_ROW_BYTES`); its rows
are scattered by the row permutation, so the hardware prefetcher does not see them."""

SWIZZLE_SPREAD_MIN_ROW_BYTES = 128
"""Rows of at least this many bytes: the next band's lines are prefetched a few at a time, spread
over the current band's column steps (a band's start issuing all 896 lines of an NVFP4 W13 band
at once overflowed the core's outstanding misses: the spread schedule is 1.8-2.2x faster on a
2-core EPYC)."""


@njit(cache=True, nogil=True)
def _prefetch_rows(xe, rows, lo, hi, row_b):  # pragma: no cover - compiled
    """Prefetch every line of source rows ``rows[lo:hi]`` (``row_b`` bytes each, fill rows
    skipped) of the expert at address ``xe``; returns ``hi``."""
    for j in range(lo, hi):
        if rows[j] >= 0:
            for b in range(0, row_b, 64):
                _prefetch(xe + rows[j] * row_b + b)
    return hi


@njit(parallel=True, cache=True, nogil=True)
def _swizzle(x, out, rows, fills, cw, stream):  # pragma: no cover - compiled
    """x (E, n_in_rows*cw) int32 words, out (E, n_rows*cw), 16-byte aligned (``stream``: out
    64-byte aligned): row gather then the 128x4 swizzle,
    ``out[e, (band*cw + kk)*128 + 4*p + q] = x[e, rows[band*128 + 32*q + p]*cw + kk]``.

    One task per (expert, 128-row band); the band's output is written front to back, 16
    bytes at a time (words ``kk..kk+3`` of four source rows, transposed in registers:
    :func:`_transpose4`), or with ``stream`` 64 bytes at a time (four transposes side by
    side make four whole lines, each one non-temporal store: :func:`_transpose16_lines`),
    while the source rows of a band ahead are prefetched (the next one spread over the column
    steps for rows of :data:`SWIZZLE_SPREAD_MIN_ROW_BYTES` or more, else ``SWIZZLE_PREFETCH_BANDS``
    ahead at the band's start).
    Bands holding fill rows, and the last ``cw % 4`` words, take a word loop.
    """
    experts = x.shape[0]
    n_bands = out.shape[1] // (128 * cw)
    xa = x.ctypes.data
    oa = out.ctypes.data
    in_b = x.shape[1] * 4
    out_b = out.shape[1] * 4
    row_b = cw * 4
    kv = cw - cw % 4
    for t in prange(experts * n_bands):
        e = t // n_bands
        band = t - e * n_bands
        r = rows[band * 128 : band * 128 + 128]
        xe = xa + e * in_b
        ob = oa + e * out_b + band * 128 * row_b
        spread = row_b >= SWIZZLE_SPREAD_MIN_ROW_BYTES
        ahead = band + (1 if spread else SWIZZLE_PREFETCH_BANDS)
        pf = ahead * 128  # the next source row of band ``ahead`` to prefetch
        end = pf + 128 if ahead < n_bands else pf
        per_step = (128 * 4 + kv - 1) // max(kv, 1) if spread else 0
        pf = _prefetch_rows(xe, rows, pf, pf if spread else end, row_b)
        first = 0
        if r.min() >= 0:
            first = kv
            for kk in range(0, kv, 4):
                o = ob + kk * 512
                c = kk * 4
                pf = _prefetch_rows(xe, rows, pf, min(pf + per_step, end), row_b)
                if stream:
                    for p in range(0, 32, 4):
                        _transpose16_lines(
                            o + p * 16,
                            512,
                            (
                                xe + r[p] * row_b + c,
                                xe + r[32 + p] * row_b + c,
                                xe + r[64 + p] * row_b + c,
                                xe + r[96 + p] * row_b + c,
                                xe + r[p + 1] * row_b + c,
                                xe + r[33 + p] * row_b + c,
                                xe + r[65 + p] * row_b + c,
                                xe + r[97 + p] * row_b + c,
                                xe + r[p + 2] * row_b + c,
                                xe + r[34 + p] * row_b + c,
                                xe + r[66 + p] * row_b + c,
                                xe + r[98 + p] * row_b + c,
                                xe + r[p + 3] * row_b + c,
                                xe + r[35 + p] * row_b + c,
                                xe + r[67 + p] * row_b + c,
                                xe + r[99 + p] * row_b + c,
                            ),
                        )
                    continue
                for p in range(32):
                    a0 = xe + r[p] * row_b + c
                    a1 = xe + r[32 + p] * row_b + c
                    a2 = xe + r[64 + p] * row_b + c
                    a3 = xe + r[96 + p] * row_b + c
                    _transpose4(o + p * 16, 512, a0, a1, a2, a3)
        xw = x[e]
        ow = out[e]
        wb = band * 128 * cw
        for kk in range(first, cw):
            for p in range(32):
                for q in range(4):
                    s = r[q * 32 + p]
                    ow[wb + kk * 128 + p * 4 + q] = xw[s * cw + kk] if s >= 0 else fills[-1 - s]
        if stream:
            _store_fence()


@njit(parallel=True, cache=True, nogil=True)
def parallel_copy(x, out, stream):  # pragma: no cover - compiled
    """``out[:] = x`` over 1-D uint8 arrays with every thread, 64 KB a task: the memcpy ceiling
    of the benchmark. ``stream``: non-temporal stores (``out`` 64-byte aligned), as a
    large ``memcpy`` does."""
    n = x.size
    chunk = 1 << 16
    xa = x.ctypes.data
    oa = out.ctypes.data
    for c in prange((n + chunk - 1) // chunk):
        lo = c * chunk
        hi = min(lo + chunk, n)
        if stream:
            body = (hi - lo) & ~63
            _stream_bytes(oa + lo, xa + lo, body)
            _copy_bytes(oa + lo + body, xa + lo + body, hi - lo - body)
            _store_fence()
        else:
            _copy_bytes(oa + lo, xa + lo, hi - lo)


def check_map(em: ExecMap) -> None:
    """Refuse (LayoutError) a map whose indices would make the loops read or write out of bounds.

    Must hold: ``src`` int32 ``(n_out,)`` with ``-max(1, len(fills)) <= src[i] < n_in``;
    ``n_in * cell_bytes <= in_bytes`` and ``n_out * cell_bytes == out_bytes``; the swizzle, padded-rows
    and swizzled-rows forms as :func:`~fimoe_lab.kernels.compiled.row_form_fault` states (their rows cover
    the output exactly and read rows of the input or fill codes). Checked once per map (cached on it).
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
    for kind, form in (("swizzle", em.swizzle), ("padrows", em.padrows), ("swizzled_rows", em.swizzled_rows)):
        fault = None if form is None else row_form_fault(kind, form, len(em.fills), em.in_bytes, em.out_bytes)
        if fault is not None:
            raise bad(fault)
    em._dev["bounds_ok"] = True


def _check_buffers(em: ExecMap, x: torch.Tensor, out: torch.Tensor) -> None:
    """Raise :class:`LayoutError` unless ``x`` and ``out`` are contiguous ``(E, ...)`` CPU tensors of
    ``em.in_bytes`` and ``em.out_bytes`` per expert."""
    e = x.shape[0] if x.ndim else -1
    if (
        out.ndim
        and out.shape[0] == e
        and x.nbytes == e * em.in_bytes
        and out.nbytes == e * em.out_bytes
        and x.is_contiguous()
        and out.is_contiguous()
        and x.is_cpu
        and out.is_cpu
    ):
        return
    raise LayoutError(
        f"{em.name}: buffers of {tuple(x.shape)} {x.dtype} and {tuple(out.shape)} {out.dtype} "
        f"(contiguous CPU tensors needed), map needs (E, {em.in_bytes}) -> (E, {em.out_bytes}) bytes",
        fix="pass the contiguous CPU tensors the map was compiled for",
    )


def _flat(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a 1-D uint8 array (no copy)."""
    return t.view(torch.uint8).numpy().reshape(-1)


def _alignment(address: int) -> int:
    """The largest power of two <= 64 dividing ``address`` (64 for 0)."""
    return min(64, address & -address) if address else 64


def gather_numba(em: ExecMap, x: torch.Tensor, out: torch.Tensor) -> None:
    """``out[e, i] = x[e, src[i]]`` (or fill) for every expert of CPU tensors (bounds checked: :func:`check_map`).

    The loop and its constant arguments are chosen once per map and alignment class
    (:func:`_runner`, cached on the map), so a call costs the checks and one kernel launch.
    """
    experts = x.shape[0] if x.ndim else 0
    if experts == 0 or em.out_bytes == 0:
        return
    check_map(em)
    _check_buffers(em, x, out)
    xp, op = x.data_ptr(), out.data_ptr()
    key = ("numba_run", _alignment(xp | op), _alignment(op), out.nbytes >= STREAM_MIN_BYTES and pages_mapped(out))
    run = em._dev.get(key)
    if run is None:
        run = em._dev[key] = _runner(em, *key[1:])
    run(x, out, experts)


def _runner(em: ExecMap, both: int, out_align: int, big: bool):
    """``run(x, out, experts)`` over the checked tensors, for buffers whose addresses are both
    multiples of ``both`` and the output's of ``out_align`` (powers of two <= 64); ``big``:
    streaming stores where the loop has them (:data:`STREAM_MIN_BYTES`, :func:`pages_mapped`)."""
    word = min(em.word, both)
    if em.swizzle is not None and word == 4 and both >= 16:
        rows, cw, _ = em.swizzle
        fills4 = em.fill_words(4)
        lines = big and out_align == 64  # whole-line streaming stores need 64-byte aligned lines

        def swizzle(x, out, experts):
            x, out = _flat(x), _flat(out)
            _swizzle(
                x.view(np.int32).reshape(experts, -1), out.view(np.int32).reshape(experts, -1), rows, fills4, cw, lines
            )

        return swizzle
    fill_bytes = np.array(em.fills or (0,), dtype=np.int32)
    if em.swizzled_rows is not None and em.swizzled_rows[3] % 128 == 0:  # whole bands of 128 rows
        rows, c_in, cw, _, col_code = em.swizzled_rows
        in_bytes = em.in_bytes

        def swizzled_rows(x, out, experts):
            _swizzled_rows(x.data_ptr(), out.data_ptr(), experts, rows, fill_bytes, c_in, cw, col_code, in_bytes)

        return swizzled_rows
    if em.padrows is not None:
        rows, c_in, c_out, col_code = em.padrows
        visit = _source_order(em, "visit_rows", rows, c_in)
        block = max(1, TASK_BYTES // c_out)
        lined = big and c_in % 64 == 0 and c_out % 64 == 0 and out_align == 64

        def pad_rows(x, out, experts):
            x, out = _flat(x), _flat(out)
            _pad_rows(x, out, rows, visit, fill_bytes, c_in, c_out, col_code, block, lined)

        return pad_rows
    if em.cell_bytes >= MEMCPY_MIN_CELL:
        cell, in_bytes, n_out, src, visit = em.cell_bytes, em.in_bytes, em.n_out, visit_sources(em), visit_order(em)
        block = max(1, TASK_BYTES // cell)
        stream = big and cell % 64 == 0 and out_align == 64

        def cells(x, out, experts):
            _gather_memcpy(
                x.data_ptr(), out.data_ptr(), experts, src, fill_bytes, visit, cell, in_bytes, n_out, block, stream
            )

        return cells
    return _word_runner(em, word, both)


def _word_runner(em: ExecMap, word: int, both: int):
    """The cell loop :func:`_gather` over ``word``-byte words (16 when cells and buffers allow:
    plain SSE moves, no arithmetic touches the bits)."""
    fills = em.fill_words(word)
    np_word = {8: np.int64, 4: np.int32, 2: np.int16, 1: np.uint8}[word]
    if word == 8 and em.cell_bytes % 16 == 0 and both >= 16:
        word, np_word, fills = 16, np.complex128, fills.repeat(2).view(np.complex128)
    wpc = em.cell_bytes // word
    n_in, n_out, src, visit = em.n_in, em.n_out, visit_sources(em), visit_order(em)
    block = max(1, TASK_BYTES // em.cell_bytes)

    def words(x, out, experts):
        x, out = _flat(x), _flat(out)
        xa, oa = x.view(np_word).reshape(experts, n_in, wpc), out.view(np_word).reshape(experts, n_out, wpc)
        _gather(xa, oa, src, fills, visit, block)

    return words


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


def preload() -> None:
    """Load the kernels most transforms run (numba's set-up, the threading layer, then the
    parallel copy, the cell copy, the 128x4 swizzle of whole words and of rows of any width, and the
    in-place cycle tiles of 8-byte words from the on-disk cache, compiling them when absent), each
    run once on a few bytes (or none) with the argument types of the real calls."""
    a = np.arange(256, dtype=np.uint8)
    b = np.empty_like(a)
    parallel_copy(a, b, False)
    one = np.zeros(1, dtype=np.int32)
    fill = np.zeros(1, dtype=np.int32)
    _gather_memcpy(a.ctypes.data, b.ctypes.data, 1, one, fill, one, 64, 64, 1, 1, False)
    words = a.view(np.int32).reshape(1, -1)  # one band of 128 rows of 1 word is 512 bytes: none here
    _swizzle(words[:, :0], b.view(np.int32).reshape(1, -1)[:, :0], np.zeros(128, dtype=np.int32), fill, 1, False)
    _swizzled_rows(a.ctypes.data, b.ctypes.data, 0, np.zeros(128, dtype=np.int32), fill, 1, 1, -1, 1)
    rows = a.view(np.int64).reshape(1, -1, 1)  # in place along cycles, rows of 8-byte words (row permutations)
    saved = np.empty((1, 1, 1), dtype=np.int64)
    _save_cells(rows, saved, one)
    _cycle_tiles(rows, saved, one, one, 1)


def visit_order(em: ExecMap) -> np.ndarray:
    """Output cells in the order of their source cells (fills last), cached on the map.

    Cells are copied in this order, so every task reads one run of its experts' input
    front to back (the hardware prefetcher follows it) and writes whole cells wherever
    they go: with streaming stores a scattered write of whole 64-byte lines costs no more
    than a sequential one. For block-major-K this turns 128-byte reads at a row's stride
    into one sequential read.
    """
    return _source_order(em, "visit", em.src, em.cell_bytes)


def visit_sources(em: ExecMap) -> np.ndarray:
    """``em.src[visit_order(em)]``: the source (or fill code) of each cell in visit order,
    int32, cached on the map. Reading it front to back beside the visit order spares the
    cell loop a dependent load (``src[visit[j]]``: a random access per cell), which was
    the limit of small-cell gathers such as block-major-K."""
    if "visit_src" not in em._dev:
        em._dev["visit_src"] = np.ascontiguousarray(em.src[visit_order(em)])
    return em._dev["visit_src"]


def _source_order(em: ExecMap, key: str, src: np.ndarray, cell: int) -> np.ndarray:
    """Indices of ``src`` sorted by source (fill codes last), cached on the map under ``key``."""
    if key not in em._dev:
        s = src.astype(np.int64)
        em._dev[key] = np.argsort(np.where(s >= 0, s, em.in_bytes // cell), kind="stable").astype(np.int32)
    return em._dev[key]
