"""Compile an :class:`~fimoe_lab.layout.IndexMap` into the form the executors run.

The kernels (:mod:`fimoe_lab.kernels`) know nothing of maps, steps or plans: they run a
:class:`~fimoe_lab.kernels.compiled.ExecMap`, which this module builds once per map
(:meth:`IndexMap.compiled` caches it). Compiling is

- coarsening: the map over its widest cells (:meth:`IndexMap.coarsened`), moved as the
  widest word ``w in (8, 4, 2, 1)`` with ``cell_bytes % w == 0``, sources as int32;
- recognising fast forms: from its sources, a strided view of the input with a padded box
  (:func:`strided_form`), which needs no compiled kernel, or two in a row
  (:func:`strided_stages`); from the map's steps, when an executor first asks, rows padded on
  the right followed by the 128x4 scale swizzle (:func:`swizzled_rows_form`; whole 4-byte words
  of whole rows: :func:`swizzle_form`) and a row gather whose rows are padded on the right
  (:func:`padded_rows_form`);
- the recipe for the inverse's executable form (in-place execution undoes with it).

Imported one way: :mod:`fimoe_lab.layout` calls this module (``IndexMap.compiled``) and this
module reads the map only through its public methods (``coarsened``, ``steps``, ``then``,
``inverse``), so it imports :class:`IndexMap` for type checking only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from fimoe_lab.errors import LayoutError
from fimoe_lab.kernels.compiled import ExecMap, Strided, row_form_fault
from fimoe_lab.kernels.cycles import CyclePlan, cycle_plans_of, preset_cycle_plan

if TYPE_CHECKING:
    from fimoe_lab.layout import IndexMap

__all__ = [
    "compile_map",
    "compiled_from",
    "form_record",
    "swizzle_form",
    "swizzled_rows_form",
    "padded_rows_form",
    "strided_form",
    "strided_stages",
    "swizzle_strided",
    "MAX_STRIDED_DIMS",
    "MAX_STRIDED_PIECES",
]

MAX_STRIDED_DIMS = 12
"""Most output digits a strided form may have (the frameworks' strided copies take up to 25 dims)."""
MAX_STRIDED_PIECES = 16
"""Most strided copies one form may take: digits with a negative stride (the W13 -> W31 swap is
one of extent 2) run one copy per value, since strided views take non-negative strides only."""
Reader = Callable[[np.ndarray], np.ndarray]
"""A map's sources at the given output cells."""
Whole = Callable[[], np.ndarray]
"""All of a map's sources."""


def compile_map(m: IndexMap) -> ExecMap:
    """The :class:`ExecMap` of ``m`` (uncached: call ``m.compiled()``).

    Its cells, sources and whether it permutes are found when an executor first reads them
    (:meth:`ExecMap.on_read`). A map whose index is still pending (:meth:`IndexMap.composed_on_read`,
    :meth:`IndexMap.rows_on_read`) is compiled from its steps where they tell its form: a padding followed by
    row steps from their row tables (:func:`padded_rows_strided`); one that is no strided view (decided from
    cells traced through its steps, :func:`_may_be_strided`) but runs as two strided stages from the stages.
    The torch executor reads only those forms, so the whole map over its finest cells (gpt-oss's padded
    weights; the padding, row steps and 128x4 swizzle of its scales: 2-byte cells) is not built on a plan's
    first call."""
    em = _found_on_read(m)
    em.ends_swizzled = m.steps[-1].kind == "swizzle_scales_128x4"
    known = swizzle_strided(m)
    if known is not None:
        em.strided, cells = known
        em.preset_cells(cells)
        return em
    if m.index_pending:
        rows = padded_rows_strided(m)
        if rows is not None:
            em.strided, cells = rows
            em.preset_cells(cells)
            return em
        if not _may_be_strided(m):
            em.stages = strided_stages(m)
            if em.stages is not None:
                return em
    em.strided = strided_form(em.src)
    if em.strided is None:
        em.stages = strided_stages(m)
    return em


def _found_on_read(m: IndexMap) -> ExecMap:
    """``m``'s executable form with every field found from ``m`` when first read (:meth:`ExecMap.on_read`): cells,
    sources, permutation flag, row forms and the inverse's form."""
    em = ExecMap.on_read(
        m.name,
        tuple(m.fills),
        m.in_bytes,
        m.out_bytes,
        lambda: _cells(m),
        lambda: m.coarsened().is_permutation,
        lambda: m.inverse().compiled(),
    )
    em.find_row_forms = lambda: _row_forms(m, em)
    return em


def form_record(em: ExecMap) -> dict[str, Any] | None:
    """What :func:`compiled_from` needs to rebuild ``em`` without its map's index, as JSON values and 1-D int32 tables
    (numpy arrays: :mod:`fimoe_lab.plan_store` writes them as raw bytes beside the JSON): its name, fills,
    sizes, whether it ends in the 128x4 swizzle, the cell fields and permutation flag known so far, its row forms
    where found (each ``[rows, *sizes]``; None before), the cycle plans built for it (in place), and its strided form
    or its two strided stages (each a record; ``split``: how many of the map's steps the first runs). None for a form
    that is neither (its first call reads the index anyway)."""
    record: dict[str, Any] = dict(
        name=em.name,
        fills=list(em.fills),
        in_bytes=em.in_bytes,
        out_bytes=em.out_bytes,
        ends_swizzled=em.ends_swizzled,
        cells=em.known_cells(),
        is_permutation=em.known_permutation(),
        row_forms=None if em.row_forms is None else [_row_form_record(f) for f in em.row_forms],
        cycles=[_cycles_record(plan) for plan in cycle_plans_of(em).values()],
        strided=None,
        stages=None,
    )
    if em.strided is not None:
        s = em.strided
        record["strided"] = dict(shape=s.shape, live=s.live, strides=s.strides, offset=s.offset, fill=s.fill)
        return record
    if em.stages is None:
        return None
    stages = [form_record(stage) for stage in em.stages]
    if stages[0] is None or stages[1] is None or stages[0]["strided"] is None or stages[1]["strided"] is None:
        return None
    record["stages"] = stages
    record["split"] = em.stages[0].name.count(" >> ") + 1
    return record


def _row_form_record(form: tuple[Any, ...] | None) -> list[Any] | None:
    """A row form (:class:`ExecMap`: an int32 row table, then sizes) as the table (1-D int32) and the sizes."""
    return (
        None if form is None else [np.ascontiguousarray(form[0], dtype=np.int32).ravel(), *(int(v) for v in form[1:])]
    )


def _int32_table(table: Any) -> np.ndarray:
    """A recorded table: a 1-D int32 array, else :class:`LayoutError` (a record that does not fit is not used)."""
    if not (isinstance(table, np.ndarray) and table.dtype == np.int32 and table.ndim == 1):
        raise LayoutError(f"internal: a recorded table is {type(table).__name__}, not a 1-D int32 array")
    return table


def _cycles_record(plan: CyclePlan) -> dict[str, Any]:
    """A cycle plan (:class:`~fimoe_lab.kernels.cycles.CyclePlan`) as JSON values and its three int32 tables."""
    return dict(tile_slots=plan.tile_slots, dst=plan.dst, src=plan.src, saved=plan.saved)


def _recorded_row_forms(forms: Any, m: IndexMap) -> tuple[Any, Any, Any]:
    """The row forms ``(swizzle, padrows, swizzled_rows)`` of a :func:`form_record` of ``m`` (:class:`ExecMap`), each
    a table and its sizes that cover ``m``'s output exactly and read rows of its input or fill codes only
    (:func:`~fimoe_lab.kernels.compiled.row_form_fault`: a kernel reads what its table says); else
    :class:`LayoutError`."""
    if not (isinstance(forms, list) and len(forms) == 3):
        raise LayoutError(f"internal: recorded row forms {forms!r} are not three")

    def form(kind: str, record: Any, sizes: int) -> tuple[Any, ...] | None:
        if record is None:
            return None
        if not (isinstance(record, list) and len(record) == 1 + sizes):
            raise LayoutError(f"internal: a recorded row form {record!r} is not a table and {sizes} sizes")
        found = (_int32_table(record[0]), *_ints(record[1:], "row form size"))
        fault = row_form_fault(kind, found, len(m.fills), m.in_bytes, m.out_bytes)
        if fault is not None:
            raise LayoutError(f"internal: a recorded row form of {m.name}: {fault}")
        return found

    swizzle, padrows, swizzled_rows = forms
    return form("swizzle", swizzle, 2), form("padrows", padrows, 3), form("swizzled_rows", swizzled_rows, 4)


def compiled_from(m: IndexMap, record: dict[str, Any]) -> ExecMap:
    """The :class:`ExecMap` of ``m`` from a :func:`form_record` of it, reading nothing of ``m``'s index: the forms
    recorded are given, everything else (sources, cells or row forms not recorded, the inverse) is found from ``m``
    when first read, as :func:`compile_map` leaves it. Raises :class:`LayoutError` when the record does not fit
    ``m`` (its name, sizes or fills, or its stages' split of ``m``'s steps)."""
    fills = tuple(int(f) for f in record["fills"])
    if (record["name"], fills, record["in_bytes"], record["out_bytes"]) != (m.name, m.fills, m.in_bytes, m.out_bytes):
        raise LayoutError(f"internal: a compiled form recorded for {record['name']} does not fit {m.name}")
    em = _found_on_read(m)
    em.ends_swizzled = bool(record["ends_swizzled"])
    if record.get("row_forms") is not None:
        em.row_forms = _recorded_row_forms(record["row_forms"], m)
    if record["cells"] is not None:
        em.preset_cells(_recorded_cells(record["cells"], m))
        for plan in record.get("cycles", ()):  # cycle plans over those cells (an in-place call's, found by the planner)
            dst, src, saved = (_int32_table(plan[k]) for k in ("dst", "src", "saved"))
            preset_cycle_plan(em, CyclePlan(int(plan["tile_slots"]), dst, src, saved), int(record["cells"]["n_in"]))
    if record["is_permutation"] is not None:
        em.is_permutation = bool(record["is_permutation"])
    if record["strided"] is not None:
        cells = record["cells"]
        em.strided = _recorded_strided(record["strided"], len(m.fills), None if cells is None else (em.n_in, em.n_out))
    else:
        k = int(record["split"])
        if not 0 < k < len(m.steps):
            raise LayoutError(f"internal: {m.name} has no split of its steps at {k}")
        first, second = (
            compiled_from(_chain(part), r) for part, r in zip((m.steps[:k], m.steps[k:]), record["stages"])
        )
        em.stages = (first, second)
    return em


def _ints(values: Any, what: str) -> tuple[int, ...]:
    """``values``, a list of JSON integers (not booleans), as a tuple; else :class:`LayoutError`."""
    if not (isinstance(values, list) and all(type(v) is int for v in values)):
        raise LayoutError(f"internal: a recorded {what} is {values!r}, not a list of integers")
    return tuple(values)


def _recorded_cells(cells: dict[str, Any], m: IndexMap) -> dict[str, Any]:
    """The cell fields of a :func:`form_record` of ``m``, checked: ``cell_bytes`` a multiple of ``m``'s declared cells,
    moved as its widest word (:func:`_widest_word`), ``n_in * cell_bytes == in_bytes`` and ``n_out * cell_bytes ==
    out_bytes``; else :class:`LayoutError`."""
    if set(cells) != {"cell_bytes", "word", "n_in", "n_out", "has_fill"} or type(cells["has_fill"]) is not bool:
        raise LayoutError(f"internal: recorded cell fields {sorted(cells)} are not a form's")
    cell_bytes, word, n_in, n_out = _ints([cells[k] for k in ("cell_bytes", "word", "n_in", "n_out")], "cell field")
    if cell_bytes <= 0 or cell_bytes % m.cell_bytes or word != _widest_word(cell_bytes):
        raise LayoutError(f"internal: recorded {cell_bytes}-byte cells moved as {word}-byte words for {m.name}")
    in_bytes, out_bytes = m.in_bytes, m.out_bytes
    if (n_in * cell_bytes, n_out * cell_bytes) != (in_bytes, out_bytes):
        raise LayoutError(f"internal: recorded cells ({n_in}, {n_out}) of {cell_bytes} bytes do not tile the map")
    return dict(cell_bytes=cell_bytes, word=word, n_in=n_in, n_out=n_out, has_fill=cells["has_fill"])


def _recorded_strided(s: dict[str, Any], fills: int, cells: tuple[int, int] | None) -> Strided:
    """The :class:`Strided` form of a :func:`form_record`, checked: a box ``0 < live[d] <= shape[d]`` whose complement
    has a fill code of the map's ``fills`` (``-fills <= fill <= -1``), and, where the cells ``(n_in, n_out)`` are
    known, ``prod(shape) == n_out`` and every cell of the box reads an input cell, ``0 <= offset + sum(digit[d] *
    strides[d]) < n_in``; else :class:`LayoutError` (the record is not used)."""
    shape, live, strides = (_ints(s[k], f"strided {k}") for k in ("shape", "live", "strides"))
    offset, fill = s["offset"], s["fill"]
    if type(offset) is not int or not (fill is None or type(fill) is int):
        raise LayoutError(f"internal: a recorded strided offset {offset!r} or fill {fill!r} is not an integer")
    if not len(shape) == len(live) == len(strides) > 0 or any(not 0 < n <= d for n, d in zip(live, shape)):
        raise LayoutError(f"internal: a recorded strided box {live} does not fit its shape {shape}")
    if (fill is None and live != shape) or (fill is not None and not -fills <= fill <= -1):
        raise LayoutError(f"internal: a recorded strided fill {fill!r} for a box {live} of {shape} and {fills} fills")
    if cells is not None:
        n_in, n_out = cells
        low = offset + sum((n - 1) * st for n, st in zip(live, strides) if st < 0)
        high = offset + sum((n - 1) * st for n, st in zip(live, strides) if st > 0)
        if math.prod(shape) != n_out or low < 0 or high >= n_in:
            raise LayoutError(f"internal: a recorded strided form reads cells {low}..{high} of {n_in}")
    return Strided(shape, live, strides, offset, fill)


def _row_forms(m: IndexMap, em: ExecMap) -> tuple[Any, Any, Any]:
    """``em``'s row forms ``(swizzle, padrows, swizzled_rows)`` (:class:`ExecMap`), found from ``m``'s steps."""
    swizzled = swizzled_rows_form(m, em)
    return swizzle_form(em, swizzled), padded_rows_form(m, em), swizzled


def padded_rows_strided(m: IndexMap) -> tuple[Strided, dict[str, Any]] | None:
    """``m`` as a strided view, and its widest cells, found from its steps' row tables without building its index,
    when every step writes whole input rows in order padded on the right (:meth:`IndexMap.right_padded_rows_of_steps`:
    a padding, then row swaps, interleaves and shuffles, as gpt-oss's weights) with one fill byte, the columns are
    padded (``C_out > C_in``), the first two output rows are live and the row table is itself a strided view
    ``S``. The widest cell is then ``g = gcd(C_in, C_out)`` and the form is ``S``'s digits over rows with strides times
    ``C_in / g``, and one inner digit of ``C_out / g`` cells, ``C_in / g`` of them live, stride 1: what
    :func:`strided_form` finds over the built index (the first digit ends where the second row starts)."""
    if len(m.in_shape) != 2 or len(m.out_shape) != 2 or m.out_shape[1] <= m.in_shape[1]:
        return None
    found = m.right_padded_rows_of_steps()
    if found is None:
        return None
    rows, byte = found
    if byte is None or rows.size < 2 or rows[0] < 0 or rows[1] < 0:
        return None
    if (rows < 0).any() and (rows[rows < 0] != -1 - byte).any():
        return None
    code = -1 - m.fills.index(byte)
    form = strided_form(np.where(rows >= 0, rows, code))
    if form is None:
        return None
    (r_in, c_in), (r_out, c_out) = m.in_shape, m.out_shape
    g = math.gcd(c_in, c_out)
    k_in, k_out = c_in // g, c_out // g
    full = Strided(
        form.shape + (k_out,),
        form.live + (k_in,),
        tuple(st * k_in for st in form.strides) + (1 if k_in > 1 else 0,),  # a digit of one live value: stride 0
        form.offset * k_in,
        code,
    )
    cells = dict(
        cell_bytes=g,
        word=_widest_word(g),
        n_in=r_in * k_in,
        n_out=r_out * k_out,
        has_fill=True,
    )
    return full, cells


def swizzle_strided(m: IndexMap) -> tuple[Strided, dict[str, Any]] | None:
    """The strided form of the 128x4 scale swizzle step alone, and its widest cells, from its parameters (no index
    read), where it pads nothing: ``[R, C]`` scales of ``s`` bytes with ``R % 128 == 0`` and ``C % 4 == 0``.

    Its cells are the ``cw = C / 4`` quads of ``4 s`` bytes a row. Output quad ``((band*cw + kk)*32 + p)*4 + q``
    holds quad ``kk`` of row ``band*128 + 32 q + p`` (:func:`fimoe_lab.steps.swizzle_scales_128x4`): digits
    ``(R / 128, cw, 32, 4)``, strides ``(128 cw, 1, cw, 32 cw)`` in input quads, less the digits of one value
    (no two others merge: a quad never reads its neighbour's successor). Else None (the finder decides)."""
    if m.parts or m.kind != "swizzle_scales_128x4" or m.in_shape != m.out_shape:
        return None
    rows, cols, size = m.params["rows"], m.params["cols"], m.params["itemsize"]
    if rows % 128 or cols % 4:
        return None
    cw = cols // 4
    kept = [(k, st) for k, st in zip((rows // 128, cw, 32, 4), (128 * cw, 1, cw, 32 * cw)) if k > 1]
    shape = tuple(k for k, _ in kept)
    form = Strided(shape, shape, tuple(st for _, st in kept), 0, None)
    cell = 4 * size
    cells = dict(cell_bytes=cell, word=_widest_word(cell), n_in=rows * cw, n_out=rows * cw, has_fill=False)
    return form, cells


def _widest_word(cell_bytes: int) -> int:
    """The widest machine word (8, 4, 2 or 1 bytes) dividing a cell."""
    return next(w for w in (8, 4, 2, 1) if cell_bytes % w == 0)


def _cells(m: IndexMap) -> dict[str, Any]:
    """The :class:`ExecMap` cell fields read off ``m`` over its widest cells: cell, word, cell counts, int32
    sources, whether any is fill."""
    c = m.coarsened()
    if c.n_in_cells >= 2**31 or c.n_out_cells >= 2**31:
        raise LayoutError(
            f"{m.name}: {c.n_in_cells} -> {c.n_out_cells} cells of {c.cell_bytes} B per expert; "
            "executors index cells with int32 (at most 2**31 - 1)",
            fix="split the expert matrix",
        )
    src = c.src.numpy().astype(np.int32)
    return dict(
        cell_bytes=c.cell_bytes,
        word=_widest_word(c.cell_bytes),
        n_in=c.n_in_cells,
        n_out=c.n_out_cells,
        src=src,
        has_fill=bool((src < 0).any()),
    )


def _may_be_strided(m: IndexMap) -> bool:
    """False when ``m`` is a strided view over no cell width, found from cells traced through its steps
    (:meth:`IndexMap.sources_at`) without building its index; True when it may be one (its digits are found
    and the probes agree: :func:`strided_form` then decides over its widest cells). A form over wider cells
    is one over ``m``'s cells with one more digit (the cell's bytes, stride 1), hence the one digit of slack."""
    return _strided(m.n_out_cells, m.sources_at, None, MAX_STRIDED_DIMS + 1) is not None


def _chain(steps: tuple[IndexMap, ...] | list[IndexMap]) -> IndexMap:
    """``steps`` composed, its index built when first read (:meth:`IndexMap.composed_on_read`): a stage that
    :func:`padded_rows_strided` recognises compiles without it."""
    return steps[0] if len(steps) == 1 else type(steps[0]).composed_on_read(tuple(steps))


def strided_stages(m: IndexMap) -> tuple[ExecMap, ExecMap] | None:
    """``m`` as two maps of the strided form, applied one after the other (the last split of its
    steps that gives two), or None. Padding that is no box in the output (scale columns padded to
    whole 4-byte words, then swizzled) is one in the middle."""
    parts = m.steps
    for k in range(len(parts) - 1, 0, -1):
        first, second = _chain(parts[:k]).compiled(), _chain(parts[k:]).compiled()
        if first.strided is not None and second.strided is not None:
            return first, second
    return None


SwizzledRows = tuple[np.ndarray, int, int, int, int]
"""The ``swizzled_rows`` form: ``(rows, C_in, cw, R, column fill code)`` (:func:`swizzled_rows_form`)."""


def swizzled_rows_form(m: IndexMap, em: ExecMap) -> SwizzledRows | None:
    """Recognise ``rows >> swizzle_scales_128x4``: rows of 1-byte scales, each one input row padded on the right
    (or all fill), then the 128x4 swizzle (no swizzle padding), e.g. gpt-oss's MXFP4 scales (90 scales a row
    padded to 96, row steps, swizzled) and the NVFP4 ones (whole rows).

    The swizzle's input is ``R`` rows (``R % 128 == 0``) of ``C = 4 cw`` bytes; its row ``r`` is input row
    ``rows[r]``'s ``C_in <= C`` bytes then the column fill, or all fill (``rows[r] < 0``: that fill code).
    Output word ``o = (band*cw + kk)*128 + 4*p + q`` is bytes ``4kk .. 4kk+3`` of row ``band*128 + 32*q + p``.
    Returns ``(rows int32 in em's fill codes, C_in, cw, R, column fill code or -1)`` after checking that this
    reproduces every output byte of ``em.src``; else None."""
    last = m.steps[-1]
    if last.kind != "swizzle_scales_128x4" or last.cell_bytes != 1 or len(last.in_shape) != 2:
        return None
    if last.in_shape != last.out_shape or last.in_shape[0] % 128 or last.in_shape[1] % 4:
        return None
    rows_n, cols = last.in_shape
    if len(m.steps) == 1:
        rows, column, c_in = np.arange(rows_n, dtype=np.int64), None, cols
    else:
        pre = _chain(m.steps[:-1])
        found = pre.right_padded_rows() if pre.out_shape == last.in_shape else None
        if found is None:
            return None
        (rows, column), c_in = found, pre.in_shape[1]
    coded = _in_fill_codes(em, rows, column)
    if coded is None:
        return None
    rows, column_code = coded
    dtype = np.int32 if em.in_bytes < 2**31 else np.int64  # byte indices: half the memory of int64 where they fit
    step = em.cell_bytes if 4 % em.cell_bytes == 0 and c_in % em.cell_bytes == 0 else 1
    implied = _swizzled_rows_bytes(rows, c_in, cols // 4, rows_n, column_code, dtype, step)
    if implied.size * step != em.out_bytes or not np.array_equal(implied, _byte_sources(em, dtype, step)):
        return None
    return rows.astype(np.int32), c_in, cols // 4, rows_n, column_code


def _swizzled_rows_bytes(
    rows: np.ndarray, c_in: int, cw: int, rows_n: int, column_code: int, dtype: type, step: int = 1
) -> np.ndarray:
    """The source byte (or fill code) of every ``step``-th output byte under :func:`swizzled_rows_form`'s
    definition: the rows' bytes in row order, then the output as ``(band, kk, p, q, byte)``, row
    ``band*128 + 32*q + p``, column ``4*kk + byte`` (``dtype`` holds every input byte index; ``step`` divides 4).

    With ``step`` dividing ``C_in`` too, the ``step`` bytes from each of those are one input run or all one fill
    (a column run never crosses ``C_in``), so comparing these bytes with the first byte of each cell of
    ``step`` bytes (:func:`_byte_sources`) compares every byte."""
    src_row: np.ndarray = rows.astype(dtype)[:, None]
    col: np.ndarray = np.arange(0, cw * 4, step, dtype=dtype)
    by_row = np.where(col < c_in, src_row * c_in + col, column_code)  # (R, C / step), row r's bytes in order
    by_row = np.where(src_row < 0, src_row, by_row)
    return by_row.reshape(rows_n // 128, 4, 32, cw, 4 // step).transpose(0, 3, 2, 1, 4).reshape(-1)


def _byte_sources(em: ExecMap, dtype: type, step: int = 1) -> np.ndarray:
    """``em.src`` over every ``step``-th byte (``step`` divides the cell): byte ``j`` of output cell ``i`` reads
    input byte ``src[i] * cell + j``, or is fill (``dtype`` holds every input byte index)."""
    src: np.ndarray = em.src.astype(dtype)[:, None]
    within: np.ndarray = np.arange(0, em.cell_bytes, step, dtype=dtype)
    return np.where(src >= 0, src * em.cell_bytes + within, src).reshape(-1)


def swizzle_form(em: ExecMap, found: SwizzledRows | None) -> tuple[np.ndarray, int, int] | None:
    """``(rows int32, cw, R)``: :func:`swizzled_rows_form`'s ``found`` for a map of 4-byte cells whose rows are
    whole (no column padding: ``C_in = 4 cw``), which the Triton and numba executors move as whole words:
    output word ``o = (band*cw + kk)*128 + 4*p + q`` is word ``kk`` of row ``rows[band*128 + 32*q + p]``."""
    if found is None or em.cell_bytes != 4:
        return None
    rows, c_in, cw, rows_n, _ = found
    return (rows, cw, rows_n) if c_in == 4 * cw else None


def padded_rows_form(m: IndexMap, em: ExecMap) -> tuple[np.ndarray, int, int, int] | None:
    """Recognise a row gather whose rows are padded on the right (``[R_in, C_in] ->
    [R_out, C_out]``, ``C_out > C_in``): each output row is one input row followed by
    fill, or all fill (:meth:`IndexMap.right_padded_rows`). Returns ``(source row or fill code
    per output row, C_in, C_out, column fill code)`` in ``em``'s fill codes, or None. Such maps
    coarsen to small cells (gcd of the widths); this form lets the executor move whole rows instead.
    """
    if not em.has_fill or len(m.in_shape) != 2 or len(m.out_shape) != 2:
        return None
    (r_in, c_in), (_, c_out) = m.in_shape, m.out_shape
    c = em.cell_bytes
    if c_out <= c_in or c_in % c or c_out % c:
        return None
    found = m.right_padded_rows()
    if found is None:
        return None
    coded = _in_fill_codes(em, *found)
    if coded is None:
        return None
    rows, column_code = coded
    if rows.max(initial=-1) >= r_in:
        return None
    return rows.astype(np.int32), c_in, c_out, column_code


def _in_fill_codes(em: ExecMap, rows: np.ndarray, column: int | None) -> tuple[np.ndarray, int] | None:
    """:meth:`IndexMap.right_padded_rows`' rows (a fill row as ``-1 - byte``) and column fill byte in ``em``'s fill
    codes (a byte's first code; the column -1 where None), or None when a byte is none of ``em``'s fills."""
    codes: dict[int, int] = {}
    for k, byte in enumerate(em.fills):
        codes.setdefault(byte, -1 - k)
    needed = {-1 - v for v in set(rows[rows < 0].tolist())} | ({column} if column is not None else set())
    if not needed <= codes.keys():
        return None
    if (rows < 0).any():
        table = np.zeros(256, dtype=np.int64)
        table[list(codes)] = list(codes.values())
        rows = np.where(rows >= 0, rows, table[np.maximum(-1 - rows, 0)])
    return rows, codes[column] if column is not None else -1


def strided_form(src: np.ndarray) -> Strided | None:
    """Recognise ``src`` (one expert's source cell per output cell, fill codes < 0) as a
    strided view with a padded box (:class:`~fimoe_lab.kernels.compiled.Strided`), or None.

    The output digits are found from the inside out: at block size ``B`` (the product of the
    digits found so far) the sources of the block starts ``src[k*B]`` run arithmetically for
    ``live`` blocks (stride ``s``), then are fill for the rest of the digit's extent ``N``
    (up to the next live block). The digits and strides found are then checked against
    every entry of ``src`` (one fill code outside the box), so a map that only looks strided
    at the block starts is refused: what is returned reproduces ``src`` exactly. Strides may
    be negative (the W13 -> W31 swap), on digits of at most :data:`MAX_STRIDED_PIECES`
    values together.
    """
    src = np.asarray(src)
    if src.dtype not in (np.int32, np.int64):
        src = src.astype(np.int64)
    return _strided(src.size, src.__getitem__, lambda: src, MAX_STRIDED_DIMS)


def _strided(n: int, read: Reader, whole: Optional[Whole], max_dims: int) -> Strided | None:
    """:func:`strided_form` of the ``n`` sources that ``read(positions)`` gives; ``whole()`` gives all of them,
    called only for the last check (and for fill codes in a box that reaches below 0). Without ``whole``, the
    form the digits and probes agree with, unchecked against the rest (a form only if that check passes)."""
    if n == 0:
        return None
    offset = int(read(np.zeros(1, dtype=np.int64))[0])
    if offset < 0:
        return None
    dims: list[tuple[int, int, int, int]] = []  # (extent, live, stride, block), innermost first
    block = 1
    while block < n:
        extent, live, stride = _digit(read, block, -(-n // block))
        if (n // block) % extent or len(dims) == max_dims:
            return None
        dims.append((extent, live if live > 1 else 1, stride if live > 1 else 0, block))
        block *= extent
    dims.reverse()
    shape = tuple(d[0] for d in dims)
    lives = tuple(d[1] for d in dims)
    strides = tuple(d[2] for d in dims)
    if math.prod(k for k, s in zip(lives, strides) if s < 0) > MAX_STRIDED_PIECES:
        return None
    if offset + sum(min(0, (k - 1) * s) for k, s in zip(lives, strides)) < 0:
        # a source in the box below 0 (a fill code): the fill is the first code, if there is one alone
        if whole is None:
            return Strided(shape, lives, strides, offset, None)
        src = whole()
        codes = src[src < 0]
        if codes.size and codes.min() != codes.max():
            return None
        fill = int(codes[0]) if codes.size else None
    else:
        # every code is the fill if the form reproduces ``src``: the first entry outside the box
        out = [live * block for extent, live, _, block in dims if live < extent]
        fill = int(read(np.array([min(out)], dtype=np.int64))[0]) if out else None
        if fill is not None and fill >= 0:
            return None
    if (fill is None) != (shape == lives):
        return None
    if not _reproduces(n, read, whole, shape, lives, strides, offset, fill):
        return None
    return Strided(shape, lives, strides, offset, fill)


def _digit(read: Reader, block: int, size: int) -> tuple[int, int, int]:
    """``(extent, live, stride)`` of the digit whose values are the ``size`` block starts ``read(k * block)`` (at
    the digits found so far): the sources run arithmetically (``stride``) for ``live`` starts, then are fill up to
    the next live one or the end. Read over a prefix grown until both ends are found (a digit's extent, not the
    whole map)."""
    w = 256
    while True:
        part = read(np.arange(min(w, size), dtype=np.int64) * block).astype(np.int64)
        whole = w >= size
        live_start = part >= 0
        if part.size > 1 and live_start[1]:
            stride = int(part[1] - part[0])
            run = live_start[1:] & (np.diff(part) == stride)
            live = 1 + (int(np.argmin(run)) if not run.all() else run.size)
        else:
            stride, live = 0, 1
        rest = live_start[live:]
        if rest.any():
            return live + int(np.argmax(rest)), live, stride
        if whole:
            return live + rest.size, live, stride
        w *= 8


_CHUNK = 1 << 16
"""Entries :func:`_reproduces` builds at a time (a few hundred kB, reused: no fresh pages per map)."""
_PROBES = 1024
"""Entries :func:`_reproduces` compares first (a few microseconds), so that a map whose block starts only look
strided is refused before the pass over all of it."""


def _reproduces(
    n: int,
    read: Reader,
    whole: Optional[Whole],
    shape: tuple[int, ...],
    live: tuple[int, ...],
    strides: tuple[int, ...],
    offset: int,
    fill: int | None,
) -> bool:
    """``np.array_equal(_strided_sources(shape, live, strides, offset, fill), src)`` for the ``n`` sources
    ``src = whole()``, without building the form's: first at :data:`_PROBES` entries spread over them
    (``read``), then the live box of ``src.reshape(shape)`` against the broadcast sum
    ``offset + sum_d digit_d * stride_d`` and each slab outside the box against ``fill`` (one read of ``src``)."""
    if n <= _PROBES or math.prod(shape) != n:
        got = read(np.arange(n, dtype=np.int64)) if whole is None else whole()
        return bool(np.array_equal(_strided_sources(shape, live, strides, offset, fill), got))
    at = np.linspace(0, n - 1, num=_PROBES, dtype=np.int64)
    digits = np.unravel_index(at, shape)
    inside = np.logical_and.reduce([d < k for d, k in zip(digits, live)])
    want = offset + sum((d * s for d, s in zip(digits, strides)), np.zeros_like(at))
    if not np.array_equal(np.where(inside, want, fill if fill is not None else 0), read(at)):
        return False
    if whole is None:
        return True
    grid = whole().reshape(shape)
    box = grid[tuple(slice(0, k) for k in live)]
    inner = np.zeros((), dtype=np.int64)  # the box's sources at outer digit 0, compared a few values at a time
    for k, stride in zip(live[1:], strides[1:]):
        inner = np.add.outer(inner, np.arange(k, dtype=np.int64) * stride)
    per = max(1, _CHUNK // max(inner.size, 1))
    for d in range(0, live[0], per):
        outer = offset + np.arange(d, min(d + per, live[0]), dtype=np.int64) * strides[0]
        if not np.array_equal(box[d : d + per], np.add.outer(outer, inner)):
            return False
    for d in range(len(shape)):  # the complement of the box as slabs: digits before d live, digit d not
        slab = grid[tuple(slice(0, live[j]) for j in range(d)) + (slice(live[d], None),)]
        if slab.size and not (slab == fill).all():
            return False
    return True


def _strided_sources(
    shape: tuple[int, ...], live: tuple[int, ...], strides: tuple[int, ...], offset: int, fill: int | None
) -> np.ndarray:
    """The source array a :class:`Strided` form stands for (the check of :func:`strided_form`)."""
    idx = np.full((), offset, dtype=np.int64)
    inside = np.ones((), dtype=bool)
    for extent, n_live, stride in zip(shape, live, strides):
        digit = np.arange(extent, dtype=np.int64)
        idx = np.add.outer(idx, digit * stride)
        inside = np.logical_and.outer(inside, digit < n_live)
    return np.where(inside, idx, fill if fill is not None else 0).reshape(-1)
