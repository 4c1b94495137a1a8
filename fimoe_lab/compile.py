"""Compile an :class:`~fimoe_lab.layout.IndexMap` into the form the executors run.

The kernels (:mod:`fimoe_lab.kernels`) know nothing of maps, steps or plans: they run a
:class:`~fimoe_lab.kernels.compiled.ExecMap`, which this module builds once per map
(:meth:`IndexMap.compiled` caches it). Compiling is

- coarsening: the map over its widest cells (:meth:`IndexMap.coarsened`), moved as the
  widest word ``w in (8, 4, 2, 1)`` with ``cell_bytes % w == 0``, sources as int32;
- recognising two fast forms from the map's steps: a row gather followed by the 128x4
  scale swizzle (:func:`swizzle_form`), and a row gather whose rows are padded on the
  right (:func:`padded_rows_form`);
- the recipe for the inverse's executable form (in-place execution undoes with it).

Imported one way: :mod:`fimoe_lab.layout` calls this module (``IndexMap.compiled``) and this
module reads the map only through its public methods (``coarsened``, ``steps``, ``then``,
``inverse``), so it imports :class:`IndexMap` for type checking only.
"""

from __future__ import annotations

from functools import reduce
from typing import TYPE_CHECKING

import numpy as np

from fimoe_lab.errors import LayoutError
from fimoe_lab.kernels.compiled import ExecMap

if TYPE_CHECKING:
    from fimoe_lab.layout import IndexMap

__all__ = ["compile_map", "swizzle_form", "padded_rows_form"]


def compile_map(m: IndexMap) -> ExecMap:
    """The :class:`ExecMap` of ``m`` (uncached: call ``m.compiled()``)."""
    c = m.coarsened()
    word = next(w for w in (8, 4, 2, 1) if c.cell_bytes % w == 0)
    if c.n_in_cells >= 2**31 or c.n_out_cells >= 2**31:
        raise LayoutError(
            f"{m.name}: {c.n_in_cells} -> {c.n_out_cells} cells of {c.cell_bytes} B per expert; "
            "executors index cells with int32 (at most 2**31 - 1)",
            fix="split the expert matrix",
        )
    src = c.src.numpy().astype(np.int32)
    em = ExecMap(
        m.name,
        c.cell_bytes,
        word,
        c.n_in_cells,
        c.n_out_cells,
        src,
        tuple(c.fills),
        bool((src < 0).any()),
        m.in_bytes,
        m.out_bytes,
        c.is_permutation,
        compile_inverse=lambda: m.inverse().compiled(),
    )
    em.swizzle = swizzle_form(m, em)
    em.padrows = padded_rows_form(m, em)
    return em


def _row_sources(m: IndexMap, em: ExecMap, cols: int) -> np.ndarray | None:
    """int64 source row of every output row of the ``[rows, cols]`` byte matrix that the steps
    before ``m``'s last one produce (fill codes renumbered to ``em.fills``), or None when
    those steps do not move whole rows."""
    steps = m.steps
    if len(steps) == 1:
        return np.arange(steps[-1].in_shape[0], dtype=np.int64)
    pre = reduce(lambda a, b: a.then(b), steps[:-1])
    if pre.out_shape != steps[-1].in_shape or len(pre.in_shape) != 2 or pre.in_shape[1] != cols:
        return None
    pc = pre.coarsened()
    if pc.cell_bytes % cols:
        return None
    rows = pc.refined(cols).src.numpy()
    if (rows < 0).any():
        remap = np.array([-1 - em.fills.index(b) for b in pre.fills], dtype=np.int64)
        rows = np.where(rows >= 0, rows, remap[np.maximum(-1 - rows, 0)])
    return rows


def swizzle_form(m: IndexMap, em: ExecMap) -> tuple[np.ndarray, int, int] | None:
    """Recognise ``rows >> swizzle_scales_128x4`` (1-byte scales, no swizzle padding).

    For ``R`` rows of ``C`` bytes (``R % 128 == 0``, ``C % 4 == 0``, ``cw = C / 4`` words)
    output word ``o = (band*cw + kk)*128 + 4*p + q`` is word ``kk`` of row
    ``rows[band*128 + 32*q + p]``. Returns ``(rows int32, cw, R)`` after checking that this
    reproduces ``em.src`` exactly; else None (the generic path runs).
    """
    last = m.steps[-1]
    if em.cell_bytes != 4 or last.kind != "swizzle_scales_128x4" or last.cell_bytes != 1:
        return None
    if len(last.in_shape) != 2 or last.in_shape != last.out_shape:
        return None
    rows_n, cols = last.in_shape
    if rows_n % 128 or cols % 4:
        return None
    rows = _row_sources(m, em, cols)
    if rows is None:
        return None
    cw = cols // 4
    o = np.arange(rows_n * cw, dtype=np.int64)
    band, rem = np.divmod(o, 128 * cw)
    kk, pq = np.divmod(rem, 128)
    r = band * 128 + (pq % 4) * 32 + pq // 4
    s = rows[r]
    implied = np.where(s >= 0, s * cw + kk, s)
    if implied.shape != em.src.shape or not np.array_equal(implied, em.src):
        return None
    return rows.astype(np.int32), cw, rows_n


def padded_rows_form(m: IndexMap, em: ExecMap) -> tuple[np.ndarray, int, int, int] | None:
    """Recognise a row gather whose rows are padded on the right (``[R_in, C_in] ->
    [R_out, C_out]``, ``C_out > C_in``): each output row is one input row followed by
    fill, or all fill. Returns ``(source row or fill code per output row, C_in, C_out,
    column fill code)`` or None. Such maps coarsen to small cells (gcd of the widths);
    this form lets the executor move whole rows instead.
    """
    if not em.has_fill or len(m.in_shape) != 2 or len(m.out_shape) != 2:
        return None
    (r_in, c_in), (r_out, c_out) = m.in_shape, m.out_shape
    c = em.cell_bytes
    if c_out <= c_in or c_in % c or c_out % c:
        return None
    k_in, k_out = c_in // c, c_out // c
    grid = em.src.astype(np.int64).reshape(r_out, k_out)
    head, tail = grid[:, :k_in], grid[:, k_in:]
    fill_row = head[:, 0] < 0
    code = tail[~fill_row]
    if code.size and (code.min() != code.max() or code.max() >= 0):
        return None
    col_code = int(code.flat[0]) if code.size else -1
    if (grid[fill_row] != grid[fill_row, :1]).any():
        return None
    live = head[~fill_row]
    if live.size and ((live[:, :1] % k_in).any() or (live != live[:, :1] + np.arange(k_in)).any()):
        return None
    rows = np.where(fill_row, head[:, 0], head[:, 0] // k_in)
    if rows.max(initial=-1) >= r_in:
        return None
    return rows.astype(np.int32), c_in, c_out, col_code
