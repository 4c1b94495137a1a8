"""The first call's fast paths against their slow definitions.

A plan's maps are composed over the widest cells their steps are known by, coarsened after a probe of a
thousand cell pairs, and their strided form is found from prefixes of the block starts and checked against
``src`` without building the source array. Each is compared here with the definition it replaces, spelled
out the slow way: the composition as byte gathers step by step, the widest cell by trying every divisor,
the strided form by scanning every block start and materialising the sources (``_strided_sources``), the
swizzle and padded-row forms by their index formulas. Plans of every recipe at random sizes, and random
source arrays (strided views, padded boxes, negative strides, broken copies of them, longer than the
probes), int64 and int32.
"""

from __future__ import annotations

import contextlib
import copy
import math
from functools import reduce

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fimoe_lab import layout, steps
from fimoe_lab.caches import clear_caches
from fimoe_lab.compile import (
    MAX_STRIDED_DIMS,
    MAX_STRIDED_PIECES,
    _may_be_strided,
    _strided_sources,
    compile_map,
    strided_form,
    swizzle_strided,
    swizzled_rows_form,
)
from fimoe_lab.errors import LayoutError
from fimoe_lab.kernels.compiled import Strided
from fimoe_lab.layout import IndexMap
from fimoe_lab.recipes import RECIPES, plan_layer


# ----------------------------------------------------------------------------- the slow definitions
def byte_table(m: IndexMap) -> np.ndarray:
    """Source byte of every output byte of ``m`` (fill byte ``v`` as ``-1 - v``), from its own index."""
    fine = m.refined(1)
    s = fine.src.numpy()
    fills = np.array(fine.fills or (0,), dtype=np.int64)
    return np.where(s >= 0, s, -1 - fills[np.maximum(-1 - s, 0)])


def composed_byte_table(m: IndexMap) -> np.ndarray:
    """The same, gathering one step after another over single bytes (no composition of indices)."""
    table = np.arange(m.in_bytes, dtype=np.int64)
    for step in m.steps:  # fill entries (< 0) travel as they are
        s = byte_table(step)
        table = np.where(s >= 0, table[np.maximum(s, 0)], s)
    return table


def widest_cell(m: IndexMap) -> tuple[int, np.ndarray]:
    """The widest cell of ``m`` in bytes and its index there: the largest ``f`` dividing both byte counts
    for which every group of ``f`` output bytes copies ``f`` consecutive ``f``-aligned input bytes or is one
    fill byte, tried divisor by divisor."""
    fine = m.refined(1)
    s = fine.src.numpy()
    g = math.gcd(m.out_bytes, m.in_bytes)
    for f in sorted((d for d in range(1, g + 1) if g % d == 0), reverse=True):
        groups = s.reshape(-1, f)
        live = groups[:, 0] >= 0
        runs = groups[live]
        if not (runs == runs[:, :1] + np.arange(f)).all() or (runs[:, 0] % f).any():
            continue
        if not (groups[~live] == groups[~live, :1]).all():
            continue
        return f, np.where(live, groups[:, 0] // f, groups[:, 0])
    raise AssertionError("f = 1 always groups")


def strided_form_by_full_scan(src: np.ndarray) -> Strided | None:
    """The strided form found from every block start of ``src`` and checked against the sources it stands for,
    materialised (``_strided_sources``)."""
    src = np.asarray(src, dtype=np.int64)
    n = src.size
    if n == 0 or src[0] < 0:
        return None
    codes = src[src < 0]
    if codes.size and codes.min() != codes.max():
        return None
    dims: list[tuple[int, int, int]] = []
    block = 1
    while block < n:
        starts = src[::block]
        live_start = starts >= 0
        if starts.size > 1 and live_start[1]:
            stride = int(starts[1] - starts[0])
            run = live_start[1:] & (np.diff(starts) == stride)
            live = 1 + (int(np.argmin(run)) if not run.all() else run.size)
        else:
            stride, live = 0, 1
        rest = live_start[live:]
        extent = live + (int(np.argmax(rest)) if rest.any() else rest.size)
        if starts.size % extent or len(dims) == MAX_STRIDED_DIMS:
            return None
        dims.append((extent, live, stride if live > 1 else 0))
        block *= extent
    dims.reverse()
    shape, lives, strides = (tuple(d[k] for d in dims) for k in range(3))
    fill = int(codes[0]) if codes.size else None
    if math.prod(k for k, s in zip(lives, strides) if s < 0) > MAX_STRIDED_PIECES:
        return None
    if (fill is None) != (shape == lives):
        return None
    if not np.array_equal(_strided_sources(shape, lives, strides, int(src[0]), fill), src):
        return None
    return Strided(shape, lives, strides, int(src[0]), fill)


def swizzled_rows_by_formula(m: IndexMap, em) -> tuple[np.ndarray, int, int, int, int] | None:
    """The swizzled-rows form read off ``m``'s byte table: a map whose last step is the 128x4 swizzle of ``R x C``
    1-byte scales (no swizzle padding), undone by its index formula (scale ``(r, c)`` at flat byte
    ``(r//128)*C*128 + (c//4)*512 + (r%32)*16 + ((r%128)//32)*4 + c%4``), leaves ``R`` rows each one input row's
    ``C_in`` bytes then one fill byte, or all one fill byte; checked row by row."""
    last = m.steps[-1]
    if last.kind != "swizzle_scales_128x4" or last.cell_bytes != 1 or last.in_shape != last.out_shape:
        return None
    (rows_n, cols), c_in = last.in_shape, m.in_shape[1]
    if rows_n % 128 or cols % 4 or len(m.in_shape) != 2 or c_in > cols:
        return None
    r, c = np.divmod(np.arange(rows_n * cols, dtype=np.int64), cols)
    at = (r // 128) * cols * 128 + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    grid = byte_table(m)[at].reshape(rows_n, cols)  # the rows before the swizzle
    code = {}
    for k, byte in enumerate(em.fills):
        code.setdefault(byte, -1 - k)
    rows, columns = [], set()
    for row in grid:
        if row[0] < 0:
            if (row != row[0]).any():
                return None
            rows.append(code[-1 - int(row[0])])
            continue
        if row[0] % c_in or (row[:c_in] != row[0] + np.arange(c_in)).any():
            return None
        if (row[c_in:] >= 0).any() or len(set(row[c_in:].tolist())) > 1:
            return None
        columns.update(row[c_in:].tolist())
        rows.append(int(row[0]) // c_in)
    if len(columns) > 1:
        return None
    column = code[-1 - columns.pop()] if columns else -1
    return np.array(rows, dtype=np.int32), c_in, cols // 4, rows_n, column


def swizzle_by_formula(m: IndexMap, em) -> tuple[np.ndarray, int, int] | None:
    """The whole-word swizzle form: a swizzled-rows map of 4-byte cells and whole rows (``C_in = C``)."""
    found = swizzled_rows_by_formula(m, em)
    if found is None or em.cell_bytes != 4 or found[1] != 4 * found[2]:
        return None
    return found[0], found[2], found[3]


def padded_rows_by_rows(m: IndexMap, em) -> tuple[np.ndarray, int, int, int] | None:
    """The padded-row form: every output row one input row then one fill code, or all one fill code,
    checked row by row over the whole index."""
    if not em.has_fill or len(m.in_shape) != 2 or len(m.out_shape) != 2:
        return None
    (r_in, c_in), (r_out, c_out) = m.in_shape, m.out_shape
    c = em.cell_bytes
    if c_out <= c_in or c_in % c or c_out % c:
        return None
    k_in = c_in // c
    grid = em.src.astype(np.int64).reshape(r_out, -1)
    rows, codes = [], set()
    for row in grid:
        if row[0] < 0:
            if (row != row[0]).any():
                return None
            rows.append(int(row[0]))
            continue
        if row[0] % k_in or (row[:k_in] != row[0] + np.arange(k_in)).any() or row[0] // k_in >= r_in:
            return None
        codes.update(row[k_in:].tolist())
        rows.append(int(row[0]) // k_in)
    if len(codes) > 1 or any(v >= 0 for v in codes):
        return None
    return np.array(rows, dtype=np.int32), c_in, c_out, codes.pop() if codes else -1


def same_form(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(a, b, strict=True))


def check_compiled(m: IndexMap) -> None:
    em = m.compiled()
    cell, coarse = widest_cell(m)
    assert em.cell_bytes == cell and np.array_equal(em.src, coarse)
    assert m.coarsened().cell_bytes == cell and np.array_equal(m.coarsened().src.numpy(), coarse)
    assert em.strided == strided_form_by_full_scan(em.src)
    assert strided_form(em.src.astype(np.int64)) == em.strided
    assert same_form(em.swizzle, swizzle_by_formula(m, em))
    assert same_form(em.swizzled_rows, swizzled_rows_by_formula(m, em))
    assert same_form(em.padrows, padded_rows_by_rows(m, em))
    for stage in em.stages or ():
        assert stage.strided is not None and stage.strided == strided_form_by_full_scan(stage.src)


# ----------------------------------------------------------------------------- plans of every recipe
RECIPE_IDS = [r for r in RECIPES if not r.startswith("mxint4")] + ["mxint4/trtllm"]


PLAN_SHAPES = dict(
    recipe=st.sampled_from(RECIPE_IDS),
    inter=st.integers(1, 24).map(lambda k: 16 * k),
    hidden=st.integers(1, 12).map(lambda k: 32 * k),
    gated=st.booleans(),
)
"""A layer of any recipe, small enough to check byte by byte."""


def plan_of(recipe: str, inter: int, hidden: int, gated: bool):
    """The plan of one :data:`PLAN_SHAPES` draw (MxInt4 at its 256 multiples), or None where the shape is refused."""
    fmt, backend = recipe.split("/")
    if fmt == "mxint4":
        inter, hidden = 256 * (1 + inter % 2), 256 * (1 + hidden % 2)
    try:
        return plan_layer(fmt, backend, inter, hidden, is_act_and_mul=gated, is_gated=gated)
    except LayoutError:
        return None


@settings(max_examples=60, deadline=None)
@given(**PLAN_SHAPES)
def test_plans_compose_and_compile_as_their_definitions(recipe, inter, hidden, gated):
    plan = plan_of(recipe, inter, hidden, gated)
    assume(plan is not None)
    for m in plan.maps().values():
        assert np.array_equal(byte_table(m), composed_byte_table(m)), m.name
        check_compiled(m)


@pytest.mark.parametrize("fmt,inter,hidden", [("mxfp4", 2880, 2880), ("nvfp4", 256, 7168)])
def test_the_model_layers_compile_as_their_definitions(fmt, inter, hidden):
    """gpt-oss-120b MXFP4 and DeepSeek-R1 NVFP4 TP8 (the whole-model benchmark's), at their widest cells."""
    for m in plan_layer(fmt, "trtllm", inter, hidden).maps().values():
        em = m.compiled()
        assert em.strided == strided_form_by_full_scan(em.src)
        assert same_form(em.swizzle, swizzle_by_formula(m, em))
        assert same_form(em.swizzled_rows, swizzled_rows_by_formula(m, em))
        assert same_form(em.padrows, padded_rows_by_rows(m, em))
        for stage in em.stages or ():
            assert stage.strided == strided_form_by_full_scan(stage.src)


@pytest.mark.parametrize("recipe", RECIPE_IDS)
def test_every_recipes_swizzled_scales_have_the_forms_their_bytes_define(recipe):
    """Each scale map that ends in the 128x4 swizzle, at a small shape and at gpt-oss's (2880: a W13 swap of
    halves whose widest cells are many rows long), has the swizzled-rows and whole-word swizzle forms its byte
    table defines."""
    for inter, hidden in ((96, 320), (2880, 2880)):
        plan = plan_of(recipe, inter, hidden, True)
        if plan is None:
            continue
        for m in plan.maps().values():
            if m.steps[-1].kind == "swizzle_scales_128x4":
                em = m.compiled()
                assert same_form(em.swizzled_rows, swizzled_rows_by_formula(m, em)), (m.name, inter, hidden)
                assert same_form(em.swizzle, swizzle_by_formula(m, em)), (m.name, inter, hidden)


@pytest.mark.parametrize("fmt,inter,hidden", [("mxfp4", 2880, 2880), ("nvfp4", 256, 7168), ("mxfp4", 96, 320)])
def test_the_swizzled_rows_check_sees_one_wrong_cell(fmt, inter, hidden):
    """The swizzled-rows form is accepted only where it reproduces every cell of the map: the check compares one
    byte per cell (2-byte cells for gpt-oss, 4-byte ones for DeepSeek-R1, 1-byte ones at a small shape), and a single cell whose source is
    moved to the next cell's, or a live cell made fill, makes it None."""
    rng = np.random.default_rng(7)
    for m in plan_layer(fmt, "trtllm", inter, hidden).maps().values():
        if m.steps[-1].kind != "swizzle_scales_128x4":
            continue
        em = m.compiled()
        assert swizzled_rows_form(m, em) is not None
        live = np.flatnonzero(em.src >= 0)
        for cell in rng.choice(live, 4, replace=False):
            for wrong in (em.src[cell] + 1, -1):
                bad = copy.copy(em)
                bad.__dict__["src"] = em.src.copy()
                bad.src[cell] = wrong
                assert swizzled_rows_form(m, bad) is None, (m.name, int(cell), int(wrong))


def test_a_plans_first_call_never_builds_the_swizzles_finer_index():
    """The gpt-oss scale swizzles are built over 4-scale cells; plan and compile read only those."""
    plan = plan_layer("mxfp4", "trtllm", 2880, 2880)
    for m in plan.maps().values():
        m.compiled()
    swizzles = [s for m in plan.maps().values() for s in m.steps if s.kind == "swizzle_scales_128x4"]
    assert len(swizzles) == 2 and all("src" not in vars(s) and s._widest_known().cell_bytes == 4 for s in swizzles)


def test_row_forms_are_looked_for_when_first_read():
    """Compiling finds the strided forms only; the row forms of the other executors wait for their first read,
    then are the definitions' (and are found once)."""
    clear_caches()  # maps another test compiled and read
    for m in plan_layer("mxfp4", "trtllm", 2880, 2880).maps().values():
        em = m.compiled()
        assert em.row_forms is None
        assert same_form(em.swizzle, swizzle_by_formula(m, em)) and same_form(em.padrows, padded_rows_by_rows(m, em))
        assert same_form(em.swizzled_rows, swizzled_rows_by_formula(m, em))
        found = em.row_forms
        assert em.swizzle is found[0] and em.padrows is found[1] and em.swizzled_rows is found[2]
        assert em.row_forms is found


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 300), cols=st.integers(1, 13), itemsize=st.sampled_from([1, 2, 4]))
def test_a_swizzle_known_wider_is_the_same_map(rows, cols, itemsize):
    for fn in (steps.swizzle_scales_128x4, steps.swizzle_scales_8x4):
        m = fn(rows, cols, itemsize)
        m.compiled()  # as an earlier plan may have (the builders are cached): compiling reads no finer index
        copied = copy.copy(m)  # before its finer index is read, if it is built when read
        assert np.array_equal(copied.src.numpy(), m.src.numpy()) and copied.cell_bytes == m.cell_bytes
        wide = m._widest_known()
        assert wide.cell_bytes % m.cell_bytes == 0 and wide.fills == m.fills
        assert np.array_equal(wide.refined(m.cell_bytes).src.numpy(), m.src.numpy())
        plain = IndexMap(m.src.clone(), m.cell_bytes, m.in_shape, m.out_shape, m.fills)  # no wider form known
        assert m.coarsened().cell_bytes == plain.coarsened().cell_bytes
        assert np.array_equal(m.coarsened().src.numpy(), plain.coarsened().src.numpy())


@settings(max_examples=60, deadline=None)
@given(bands=st.integers(1, 6), quads=st.integers(1, 40), itemsize=st.sampled_from([1, 2, 4]))
def test_the_swizzle_steps_form_from_its_parameters_is_its_index(bands, quads, itemsize):
    m = steps.swizzle_scales_128x4(128 * bands, 4 * quads, itemsize)
    form, cells = swizzle_strided(m)
    wide = m.coarsened()  # the index, built
    src = wide.src.numpy()
    assert form == strided_form(src)
    assert np.array_equal(_strided_sources(form.shape, form.live, form.strides, form.offset, form.fill), src)
    assert cells == dict(
        cell_bytes=wide.cell_bytes,
        word=math.gcd(wide.cell_bytes, 8),
        n_in=wide.n_in_cells,
        n_out=wide.n_out_cells,
        has_fill=False,
    )
    em = compile_map(m)
    assert em.strided == form and np.array_equal(em.src, src.astype(np.int32))  # the preset cells hold when read


@pytest.mark.parametrize("rows, cols", [(100, 8), (128, 6), (130, 4), (256, 90)])
def test_a_swizzle_that_pads_is_left_to_the_finder(rows, cols):
    m = steps.swizzle_scales_128x4(rows, cols)
    assert swizzle_strided(m) is None
    assert compile_map(m).strided == strided_form(m.coarsened().src.numpy())


# ----------------------------------------------------------------------------- random source arrays
@st.composite
def sources(draw):
    """A padded permute of a strided view (digits up to 40, so longer than the probes), possibly with a digit
    reversed, a second fill code or one entry moved: what the strided form must find or refuse."""
    dims = draw(st.lists(st.integers(1, 40), min_size=1, max_size=4))
    order = draw(st.permutations(range(len(dims))))
    src = np.arange(int(np.prod(dims)), dtype=np.int64).reshape(dims).transpose(order)
    if draw(st.booleans()):
        src = np.flip(src, axis=draw(st.integers(0, len(dims) - 1)))
    live = [draw(st.integers(1, d)) for d in src.shape]
    pad = [draw(st.integers(0, 3)) for _ in src.shape]
    out = np.full([d + p for d, p in zip(src.shape, pad)], -1, dtype=np.int64)
    box = tuple(slice(0, k) for k in live)
    out[box] = src[box]
    out = out.reshape(-1)
    change = draw(st.sampled_from(["none", "none", "entry", "code", "swap"]))
    at = draw(st.integers(0, out.size - 1))
    if change == "entry":
        out[at] = draw(st.integers(-2, int(out.max()) + 1))
    elif change == "code" and (out < 0).any():
        out[np.flatnonzero(out < 0)[-1]] = -2
    elif change == "swap" and out.size > 1:
        out[[at, (at + 1) % out.size]] = out[[(at + 1) % out.size, at]]
    return out


@settings(max_examples=300, deadline=None)
@given(sources(), st.sampled_from([np.int64, np.int32]))
def test_strided_form_is_the_full_scan(src, dtype):
    assert strided_form(src.astype(dtype)) == strided_form_by_full_scan(src)


@settings(max_examples=200, deadline=None)
@given(
    runs=st.lists(
        st.tuples(st.integers(1, 400), st.integers(-3, 60)), min_size=1, max_size=12
    ),  # (length, start; < 0: a fill code)
    scale=st.sampled_from([1, 2, 3, 4, 8]),
    cell=st.sampled_from([1, 2, 6]),
)
def test_coarsened_is_the_widest_cell(runs, scale, cell):
    """Runs of consecutive sources and of fill, each ``scale`` times longer than drawn (so maps coarsen),
    over ``cell``-byte cells: the widest cell is the one the divisors give."""
    parts = [np.full(k * scale, v) if v < 0 else np.arange(v * scale, (v + k) * scale) for k, v in runs]
    src = np.concatenate(parts).astype(np.int64)
    n_in = max(int(src.max()) + 1, 1)
    n_in = -(-n_in // scale) * scale
    m = IndexMap(torch.from_numpy(src), cell, (n_in * cell,), (src.size * cell,), (0, 127, 255))
    f, coarse = widest_cell(m)
    assert m.coarsened().cell_bytes == f
    assert np.array_equal(m.coarsened().src.numpy(), coarse)


def test_a_composition_refuses_sources_past_the_earlier_output():
    first = IndexMap(torch.arange(4), 2, (8,), (8,))
    past = IndexMap(torch.tensor([0, 4, 1, 2]), 2, (8,), (8,))
    with pytest.raises(LayoutError, match="reads past the 4 cells"):
        first.then(past)
    fill_only = IndexMap(torch.full((4,), -1), 2, (0,), (8,), (7,))
    assert byte_table(IndexMap(torch.zeros(0, dtype=torch.int64), 2, (0,), (0,)).then(fill_only)).tolist() == [-8] * 8


# ----------------------------------------------------------------------------- compositions built when read
@contextlib.contextmanager
def every_composition_on_read():
    """Every composition of two maps or more builds its index when first read (not only large ones), with the
    plan caches emptied on both sides."""
    saved = layout.COMPOSED_ON_READ_CELLS
    layout.COMPOSED_ON_READ_CELLS = 0
    clear_caches()
    try:
        yield
    finally:
        layout.COMPOSED_ON_READ_CELLS = saved
        clear_caches()


@settings(max_examples=60, deadline=None)
@given(**PLAN_SHAPES)
def test_plans_composed_on_read_compile_as_their_definitions(recipe, inter, hidden, gated):
    """The plans of every recipe with every composition pending until read: compiling finds the same forms
    (a map run as two stages is no strided view at its widest cells, by the full scan), builds no index of a
    map it runs as stages unless its traced cells looked strided, and every index built on read is the
    composition's own."""
    with every_composition_on_read():
        plan = plan_of(recipe, inter, hidden, gated)
    assume(plan is not None)
    for m in plan.maps().values():
        pending = m.index_pending
        em = m.compiled()
        if pending and em.stages is not None:  # built only where the traced cells looked like a strided view
            assert "src" not in vars(m) or _may_be_strided(m), m.name
        check_compiled(m)  # reads em.src and m.src: both built now
        assert np.array_equal(byte_table(m), composed_byte_table(m)), m.name


@st.composite
def chains(draw):
    """2-4 steps over one byte matrix: paddings (two fill bytes), row steps, swizzles and block-major-K,
    some chains themselves composed on read."""
    rows, cols = 128 * draw(st.integers(1, 2)), 4 * draw(st.integers(1, 8))
    maps = []
    if draw(st.booleans()):
        pad = steps.pad_projections(1, rows - 8 * draw(st.integers(0, 3)), rows, cols - draw(st.integers(0, 3)), cols)
        maps.append(pad)
        if draw(st.booleans()):  # a second fill byte
            fill = steps.pad_projections(1, rows, rows, cols, cols + 4, fill=draw(st.integers(1, 255)))
            crop = IndexMap(
                torch.arange(rows * (cols + 4)).view(rows, cols + 4)[:, :cols].reshape(-1),
                1,
                fill.out_shape,
                (rows, cols),
            )
            maps += [fill, crop]
    choices = [
        lambda: steps.swap_w13_to_w31_rows(rows, cols),
        lambda: steps.shuffle_rows_for_epilogue(rows, cols, 64),
        lambda: steps.interleave_rows_for_gated_act(rows, cols),
        lambda: steps.swizzle_scales_128x4(rows, cols),
        lambda: steps.block_major_k(rows, cols, 4),
    ]
    for k in draw(st.lists(st.integers(0, len(choices) - 1), min_size=1, max_size=3)):
        maps.append(choices[k]())
    if len(maps) > 2 and draw(st.booleans()):  # a pending composition as an operand
        maps = [IndexMap.composed_on_read(maps[:2])] + maps[2:]
    return maps


@settings(max_examples=80, deadline=None)
@given(maps=chains(), probe_first=st.booleans())
def test_a_composition_built_on_read_is_the_eager_one(maps, probe_first):
    """``composed_on_read`` declares the eager composition's cell and fills, traces any cells to the eager
    sources without building its index, and builds the eager index when read."""
    assume(len(maps) > 1)
    eager = reduce(IndexMap.then, maps)
    lazy = IndexMap.composed_on_read(maps)
    assert lazy.index_pending and lazy.cell_bytes == eager.cell_bytes and lazy.fills == eager.fills
    assert lazy.in_shape == eager.in_shape and lazy.out_shape == eager.out_shape and lazy.steps == eager.steps
    if probe_first:
        cells = np.arange(lazy.n_out_cells, dtype=np.int64)
        assert np.array_equal(lazy.sources_at(cells), eager.src.numpy())
        assert lazy.index_pending
    assert np.array_equal(lazy.src.numpy(), eager.src.numpy()) and not lazy.index_pending
    assert lazy._has_fill == eager._has_fill


def test_a_composition_built_on_read_refuses_what_then_refuses():
    a = steps.swap_w13_to_w31_rows(4, 8)
    with pytest.raises(LayoutError, match="byte counts"):
        IndexMap.composed_on_read([a, steps.swap_w13_to_w31_rows(4, 16)])
    past = IndexMap(torch.tensor([0, 4, 1, 2]), 8, (4, 8), (4, 8))
    with pytest.raises(LayoutError, match="reads past the 4 cells"):
        IndexMap.composed_on_read([a, past])


def test_gpt_oss_scales_compile_without_their_composition():
    """gpt-oss-120b's scale maps (padding over 6- and 2-byte cells, row steps, the 128x4 swizzle): the plan and
    its compile build only the two stages; the whole map's index, its cells and whether it permutes are
    found when read, equal to an eager composition's."""
    clear_caches()
    plan = plan_layer("mxfp4", "trtllm", 2880, 2880)
    for name in ("w13_scale", "w2_scale"):
        m = getattr(plan, name)
        em = m.compiled()
        assert em.stages is not None and em.strided is None and m.index_pending
        assert {"src", "cell_bytes", "is_permutation"}.isdisjoint(vars(em))
        eager = reduce(IndexMap.then, m._cache["operands"])
        want = compile_map(eager)
        assert (em.cell_bytes, em.word, em.n_in, em.n_out, em.has_fill, em.is_permutation) == (
            want.cell_bytes,
            want.word,
            want.n_in,
            want.n_out,
            want.has_fill,
            want.is_permutation,
        )
        assert np.array_equal(em.src, want.src) and want.strided is None
        assert [s.strided for s in em.stages] == [s.strided for s in want.stages]


def test_threads_reading_a_form_built_on_read_at_once_all_get_it():
    """Eight threads read the pending composition's index and the executable form's cells at the same moment:
    each gets the values an eager composition gives."""
    import threading

    clear_caches()
    m = plan_layer("mxfp4", "trtllm", 2880, 2880).w13_scale
    em = m.compiled()
    want = compile_map(reduce(IndexMap.then, m._cache["operands"]))
    start, seen, errors = threading.Barrier(8), [], []

    def read() -> None:
        try:
            start.wait()
            seen.append((m.src.numpy().copy(), em.src.copy(), em.cell_bytes, em.is_permutation))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=read) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(seen) == 8
    eager = reduce(IndexMap.then, m._cache["operands"]).src.numpy()
    for index, cells, cell_bytes, permutes in seen:
        assert np.array_equal(index, eager) and np.array_equal(cells, want.src)
        assert (cell_bytes, permutes) == (want.cell_bytes, want.is_permutation)


def test_gpt_oss_weights_compile_from_their_row_tables():
    """gpt-oss-120b's weights (padding to 96- and 32-byte cells, then row steps): the strided form and the
    widest cells come from the steps' row tables; the whole index is not built, and when it is read later
    it gives the same cells and form."""
    clear_caches()
    plan = plan_layer("mxfp4", "trtllm", 2880, 2880)
    for name in ("w13", "w2"):
        m = getattr(plan, name)
        em = m.compiled()
        assert em.strided is not None and m.index_pending and "src" not in vars(em)
        assert em.cell_bytes == math.gcd(*m.in_shape[1:], *m.out_shape[1:])
        assert strided_form_by_full_scan(em.src) == em.strided  # reads the index: the cells agree
        cell, coarse = widest_cell(m)
        assert em.cell_bytes == cell and np.array_equal(em.src, coarse)


def right_padded_rows_by_bytes(m: IndexMap):
    """``IndexMap.right_padded_rows`` from the byte table: each output row one input row's bytes in order, then
    one fill byte shared by every such row, or one fill byte only (a byte of its own)."""
    if len(m.in_shape) != 2 or len(m.out_shape) != 2 or m.out_shape[1] < m.in_shape[1]:
        return None
    (_, c_in), (r_out, c_out) = m.in_shape, m.out_shape
    table = byte_table(m).reshape(r_out, c_out)
    rows, pad = [], set()
    for row in table:
        if row[0] < 0:
            if (row != row[0]).any():
                return None
            rows.append(int(row[0]))
            continue
        if row[0] % c_in or not np.array_equal(row[:c_in], row[0] + np.arange(c_in)):
            return None
        pad.update(int(-1 - v) for v in row[c_in:])
        rows.append(int(row[0]) // c_in)
    if len(pad) > 1 or any(v < 0 for v in pad):
        return None
    return np.array(rows, dtype=np.int64), (pad.pop() if pad else None)


@settings(max_examples=80, deadline=None)
@given(maps=chains())
def test_right_padded_rows_is_the_byte_definition(maps):
    m = reduce(IndexMap.then, maps)
    got, want = m.right_padded_rows(), right_padded_rows_by_bytes(m)
    assert (got is None) == (want is None)
    if got is not None:
        assert np.array_equal(got[0], want[0]) and got[1] == want[1]


@st.composite
def row_chains(draw):
    """2-4 paddings (fill byte 0 or 7, rows and columns growing or not) and row steps in any order."""
    rows, cols = 128 * draw(st.integers(1, 2)), draw(st.integers(1, 12))
    maps = []
    for _ in range(draw(st.integers(2, 4))):
        kind = draw(st.sampled_from(["pad", "swap", "shuffle", "interleave"]))
        if kind == "pad":
            more_rows, more_cols = 128 * draw(st.integers(0, 1)), draw(st.integers(0, 5))
            fill = draw(st.sampled_from([0, 7]))
            maps.append(steps.pad_projections(1, rows, rows + more_rows, cols, cols + more_cols, fill))
            rows, cols = rows + more_rows, cols + more_cols
        elif kind == "swap":
            maps.append(steps.swap_w13_to_w31_rows(rows, cols))
        elif kind == "shuffle":
            maps.append(steps.shuffle_rows_for_epilogue(rows, cols, 64))
        else:
            maps.append(steps.interleave_rows_for_gated_act(rows, cols))
    return maps


@settings(max_examples=120, deadline=None)
@given(maps=st.one_of(chains(), row_chains()))
def test_right_padded_rows_from_the_steps_tables_is_the_byte_definition(maps):
    """The row table a composition reads off its steps' tables, where they say one, is the byte definition's; a
    composition built on read answers from them without building its index, and from its index where they do
    not say."""
    assume(len(maps) > 1)
    clear_caches()
    want = right_padded_rows_by_bytes(reduce(IndexMap.then, maps))
    lazy = IndexMap.composed_on_read(maps)
    of_steps = lazy.right_padded_rows_of_steps()
    if of_steps is not None:
        assert want is not None and np.array_equal(of_steps[0], want[0]) and of_steps[1] == want[1]
    got = lazy.right_padded_rows()
    assert (got is None) == (want is None)
    if got is not None:
        assert np.array_equal(got[0], want[0]) and got[1] == want[1]
    assert lazy.index_pending == (of_steps is not None or "src" not in vars(lazy))


@pytest.mark.parametrize(
    "first,second",
    [((128, 0, 0), (0, 3, 7)), ((128, 0, 7), (0, 3, 7)), ((0, 2, 0), (0, 3, 7)), ((0, 2, 7), (128, 3, 7))],
    ids=["fill rows then other padding", "fill rows then same padding", "two column paddings", "same byte"],
)
def test_right_padded_rows_of_two_paddings(first, second):
    """Two paddings around a row shuffle (more rows, more columns, fill byte each): a row read from a fill row
    and padded with another byte, or two column paddings of two bytes, is no padded row; the same byte is."""
    rows, cols, maps = 128, 5, []
    for more_rows, more_cols, fill in (first, second):
        maps.append(steps.pad_projections(1, rows, rows + more_rows, cols, cols + more_cols, fill))
        rows, cols = rows + more_rows, cols + more_cols
        maps.append(steps.shuffle_rows_for_epilogue(rows, cols, 64))
    want = right_padded_rows_by_bytes(reduce(IndexMap.then, maps))
    got = IndexMap.composed_on_read(maps).right_padded_rows_of_steps()
    assert (got is None) == (want is None)
    if got is not None:
        assert np.array_equal(got[0], want[0]) and got[1] == want[1]


@settings(max_examples=80, deadline=None)
@given(
    projections=st.integers(1, 3),
    rows=st.integers(0, 40),
    extra_rows=st.integers(0, 9),
    cols=st.integers(1, 40),
    extra_cols=st.integers(0, 13),
    fill=st.integers(0, 255),
)
def test_a_padding_built_on_read_is_its_index(projections, rows, extra_rows, cols, extra_cols, fill):
    """A padding declares its row table and builds its index when first read: the table, the traced sources
    and the built index are what a plain map over that index gives, and tracing builds nothing."""
    clear_caches()
    m = steps.pad_projections(projections, rows, rows + extra_rows, cols, cols + extra_cols, fill)
    assume(m.n_out_cells > 0)
    assert m.index_pending
    cells = np.arange(m.n_out_cells, dtype=np.int64)
    traced, declared = m.sources_at(cells), m.right_padded_rows()
    assert m.index_pending  # tracing and the table built nothing
    plain = IndexMap(m.src.clone(), m.cell_bytes, m.in_shape, m.out_shape, m.fills)
    assert np.array_equal(traced, plain.src.numpy())
    want = plain.right_padded_rows()
    assert (declared is None) == (want is None)
    if want is not None:
        assert np.array_equal(declared[0], want[0]) and declared[1] == want[1]
    assert np.array_equal(byte_table(m), byte_table(plain)) and m._has_fill == plain._has_fill
