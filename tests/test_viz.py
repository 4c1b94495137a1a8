"""The lab's data views and figures: what is drawn is what the index maps say.

Expected values come from the DESIGN §3 formulas written out here in numpy, not from
the code under test; figures are checked through the arrays their artists hold.
"""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("matplotlib")

import matplotlib  # noqa: E402

matplotlib.use("Agg")

from fimoe_lab import prepare, steps  # noqa: E402
from fimoe_lab.layout import IndexMap, LayoutError, compose  # noqa: E402
from fimoe_lab.viz import data, figures, render, sources  # noqa: E402


# ----------------------------------------------------------------------------- references (DESIGN §3)
def ref_w13_rows(inter: int, padded: int, etm: int = 128, swap: bool = True) -> np.ndarray:
    """Checkpoint row of each kernel row for pad -> swap -> interleave -> shuffle (-1 = padding)."""
    padded_rows = np.full(2 * padded, -1)
    padded_rows[:inter] = np.arange(inter)
    padded_rows[padded : padded + inter] = inter + np.arange(inter)
    m = 2 * padded
    swapped = padded_rows[(np.arange(m) + padded) % m] if swap else padded_rows
    inter_src = np.stack([np.arange(m // 2), np.arange(m // 2) + m // 2], axis=1).reshape(-1)
    interleaved = swapped[inter_src]
    b = 32 if etm % 128 == 0 else 16
    k = b // 8
    p = np.arange(m)
    shuffle_src = (p // b) * b + (p % b % 8) * k + (p % b) // 8
    return interleaved[shuffle_src]


def ref_swizzle_offset(r: np.ndarray, c: np.ndarray, cols: int) -> np.ndarray:
    cp = -(-cols // 4) * 4
    return (r // 128) * (cp // 4) * 512 + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def drawn_pairs(fig) -> list[tuple[int, int]]:
    """(checkpoint row, kernel row) of every line of a row figure, read off its hover texts."""
    pairs = [re.match(r"checkpoint row (\d+) .*-> kernel row (\d+)", t) for t in figures.hover_texts(fig).values()]
    return [(int(p.group(1)), int(p.group(2))) for p in pairs if p]


def artist_array(ax, kind: str = "image", index: int = 0) -> np.ndarray:
    if kind == "image":
        return np.ma.filled(ax.images[index].get_array().astype(float), np.nan)
    return np.asarray(ax.collections[index].get_offsets())


# ----------------------------------------------------------------------------- core stays light
def test_core_and_cli_import_without_lab_dependencies():
    code = (
        "import sys; import fimoe_lab, fimoe_lab.layout, fimoe_lab.prepare, fimoe_lab.viz;"
        "from fimoe_lab.cli import build_parser; build_parser();"
        "heavy = [m for m in ('matplotlib', 'ipywidgets', 'IPython', 'jupyterlab') if m in sys.modules];"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(__import__("pathlib").Path(__file__).parents[1]))


# ----------------------------------------------------------------------------- rows
@pytest.mark.parametrize("inter,fmt", [(96, "mxfp8"), (128, "mxfp8"), (120, "fp8"), (112, "nvfp4")])
def test_row_flow_matches_design_formulas(inter, fmt):
    plan = prepare.plan_layer(fmt, "trtllm", inter, 256)
    flow = data.row_flow(plan.w13)
    assert np.array_equal(flow.src_rows, ref_w13_rows(inter, plan.padded_intermediate))
    assert (flow.shuffle_block, flow.epilogue_tile) == (32, 128)
    codes, labels = flow.groups("origin")
    assert labels == ("gate", "up", "padding")
    assert np.bincount(codes, minlength=3).tolist() == [inter, inter, 2 * (plan.padded_intermediate - inter)]
    codes, labels = flow.groups("epilogue tile")
    assert codes[flow.src_rows >= 0].max() == 2 * plan.padded_intermediate // 128 - 1


def test_row_flow_of_scale_chain_stops_before_swizzle():
    plan = prepare.plan_layer("mxfp8", "trtllm", 96, 256)
    flow = data.row_flow(plan.w13_scale)
    assert "swizzle_scales_128x4" not in flow.steps
    assert flow.steps == (
        "pad_projections",
        "swap_w13_to_w31_rows",
        "interleave_rows_for_gated_act",
        "shuffle_rows_for_epilogue",
    )  # kinds, as the figure's title joins them
    assert np.array_equal(flow.src_rows, ref_w13_rows(96, 128))
    title = figures.row_permutation_figure(plan.w13_scale)._suptitle.get_text()
    assert title == " >> ".join(flow.steps)


def test_itemsizes_come_from_the_format_table():
    # bf16 2 B; fp8 and packed fp4 drawn per byte; fp8-block scales float32, vector scales 1 B
    assert [data.itemsize_of(f, "w13") for f in ("bf16", "fp8", "fp8-block", "mxfp8", "nvfp4", "mxfp4")] == [
        2,
        1,
        1,
        1,
        1,
        1,
    ]
    assert [data.itemsize_of(f, "w2_scale") for f in ("fp8-block", "mxfp8", "nvfp4", "mxfp4")] == [4, 1, 1, 1]
    with pytest.raises(ValueError, match="unknown format 'int4'"):
        data.itemsize_of("int4", "w13")
    assert sources.PLAN_FORMATS == ("bf16", "fp8", "fp8-block", "mxfp8", "nvfp4", "mxfp4")
    with pytest.raises(ValueError, match=r"no sample layer for format 'mxfp4-mxfp8' \(fix: choose one of bf16"):
        sources.sample_layer("mxfp4-mxfp8")


def test_row_flow_rejects_a_map_that_mixes_rows():
    with pytest.raises(LayoutError, match="not a row map"):
        data.row_flow(IndexMap(torch.tensor([0, 2, 1, 3]), 2, (2, 4), (2, 4), (), "mix halves"))


def test_row_figure_draws_the_flow_and_the_values():
    plan = prepare.plan_layer("mxfp8", "trtllm", 96, 256)
    layer = sources.sample_layer("mxfp8", experts=2, intermediate=96, hidden=256)
    values = layer.magnitude("w13", 1)
    fig = figures.row_permutation_figure(plan.w13, window=(16, 48), values=values)
    lines, every, moved = fig.axes[:3]
    flow = data.row_flow(plan.w13)
    assert drawn_pairs(fig) == [(int(flow.src_rows[d]), d) for d in range(16, 48)]
    scatter = artist_array(every, "points")
    real = flow.src_rows >= 0
    assert np.array_equal(scatter[real, 1], flow.src_rows[real])
    expect = values[np.maximum(flow.src_rows[16:48], 0)]
    expect[flow.src_rows[16:48] < 0] = np.nan
    assert np.allclose(artist_array(moved), expect, equal_nan=True)
    assert np.nanstd(artist_array(moved)) > 0


def test_observed_rows_find_a_planted_swap():
    layer = sources.sample_layer("fp8", experts=2, intermediate=128, hidden=256)
    plan = prepare.plan_layer("fp8", "trtllm", 128, 256)
    no_swap = compose(*[s for s in plan.w13.steps if s.kind != "swap_w13_to_w31_rows"])
    w13 = layer.tensors["w13"]
    good = data.observed_row_sources(w13[1], plan.w13.apply(w13)[1])
    bad = data.observed_row_sources(w13[1], no_swap.apply(w13)[1])
    assert np.array_equal(good, data.row_flow(plan.w13).src_rows)
    assert np.array_equal(bad, ref_w13_rows(128, 128, swap=False))
    assert (bad != good).all()
    fig = figures.row_permutation_figure(plan.w13, observed=bad)
    crosses = fig.axes[1].lines[0]
    assert len(crosses.get_xdata()) == 256 and crosses.get_label() == "observed != planned (256 rows)"


# ----------------------------------------------------------------------------- tiles and swizzle
def test_tile_view_is_block_major_k():
    m = steps.block_major_k(64, 256, 128)  # bf16: [64, 128 elements] -> [2, 64, 64]
    view = data.tile_view(m, itemsize=2)
    kb, row, j = np.meshgrid(np.arange(2), np.arange(64), np.arange(64), indexing="ij")
    assert np.array_equal(view.src_row, row.reshape(-1, 64))
    assert np.array_equal(view.src_col, (kb * 64 + j).reshape(-1, 64))
    assert np.array_equal(view.block_of_input, np.repeat(np.arange(2), 64)[None, :].repeat(64, 0))
    fig = figures.tile_figure(m, 2, "source column")
    assert np.array_equal(artist_array(fig.axes[0]), view.block_of_input)
    assert np.array_equal(artist_array(fig.axes[2]), view.src_col)


@pytest.mark.parametrize("seed", range(6))
def test_cell_grid_reads_what_the_built_grid_holds(seed):
    """Any element, row, column or strided part of a CellGrid equals the grid built by repeating each cell's
    value k times (+ the offset within the cell where step is 1; -1 cells stay -1)."""
    g = np.random.default_rng(seed)
    k, step = int(g.integers(1, 9)), int(g.integers(0, 2))
    rows, cols = int(g.integers(1, 12)), k * int(g.integers(1, 6))
    first = g.integers(-1, 50, size=rows * cols // k) * 10  # some fill cells (-10 < 0)
    built = np.where(np.repeat(first, k) >= 0, np.repeat(first, k) + step * np.tile(np.arange(k), first.size), -1)
    built = built.reshape(rows, cols)
    grid = data.CellGrid(first, k, step, (rows, cols))
    assert np.array_equal(np.asarray(grid), built) and np.asarray(grid).dtype == np.int32
    for _ in range(20):
        i, j = int(g.integers(-rows, rows)), int(g.integers(-cols, cols))
        a, b = int(g.integers(1, 4)), int(g.integers(1, 4))
        assert grid[i, j] == built[i, j]
        assert np.array_equal(grid[i, ::b], built[i, ::b]) and np.array_equal(grid[::a, j], built[::a, j])
        assert np.array_equal(grid[::a, ::b], built[::a, ::b]) and np.array_equal(grid[i:, :j], built[i:, :j])
    with pytest.raises(IndexError):
        grid[rows, 0]


def test_a_real_size_tile_view_holds_only_its_cells():
    """DeepSeek-V3 FP8-block w13 (4096 x 7168 elements a expert): the view keeps one value per cell, and the
    tile figure samples it without building the 29M-element grids."""
    m = prepare.plan_layer("fp8-block", "trtllm", 2048, 7168).w13
    view = data.tile_view(m, 1)
    assert view.src_row.shape == (56 * 4096, 128) and view.block_of_input.shape == (4096, 7168)
    assert data.nbytes(view) < 8 << 20
    assert view.src_col[4096 + 5, 7] == 128 + 7 and view.src_row[4096 + 5, 7] == m.provenance((1, 5, 7)).source[0]


@pytest.mark.parametrize(("fmt", "inter"), [("bf16", 96), ("fp8-block", 128), ("fp8-block", 384)])
def test_tile_view_of_a_padded_plan_equals_its_element_map(fmt, inter):
    """The tile view read off the map's cells equals the one read off its element map (every output element's
    source element: the core's ``refined`` map), padding included."""
    plan = prepare.plan_layer(fmt, "trtllm", inter, 256)
    for m in (plan.w13, plan.w2):
        size = data.itemsize_of(fmt, "w13")
        view = data.tile_view(m, size)
        src = data.display_2d(data.element_sources(m, size))
        cols = m.in_shape[-1] // size
        assert np.array_equal(view.src_row, np.where(src >= 0, src // cols, -1))
        assert np.array_equal(view.src_col, np.where(src >= 0, src % cols, -1))
        block = np.full(m.in_shape[0] * cols, -1)
        out = data.element_sources(m, size)
        for k in range(out.shape[0]):
            block[out[k][out[k] >= 0]] = k
        assert np.array_equal(view.block_of_input, block.reshape(m.in_shape[0], cols))


@pytest.mark.parametrize("rows,cols", [(128, 4), (256, 8), (200, 6), (130, 3)])
def test_swizzle_view_matches_the_design_offset(rows, cols):
    view = data.swizzle_view(steps.swizzle_scales_128x4(rows, cols))
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    assert np.array_equal(view.dest_offset, ref_swizzle_offset(r, c, cols))
    assert np.array_equal(view.dest_atom, ref_swizzle_offset(r, c, cols) // 512)
    flat_rows = view.src_row.reshape(-1)
    assert np.array_equal(flat_rows[view.dest_offset.reshape(-1)], r.reshape(-1))
    assert (flat_rows == -1).sum() == (-(-rows // 128) * 128) * (-(-cols // 4) * 4) - rows * cols


def test_swizzle_figure_shows_the_chosen_atom():
    plan = prepare.plan_layer("nvfp4", "trtllm", 128, 512)
    view = data.swizzle_view(plan.w13_scale)
    assert view.atoms == 2 * 128 // 128 * (512 // 16 // 4)
    fig = figures.swizzle_figure(plan.w13_scale, atom=3)
    assert np.array_equal(artist_array(fig.axes[0]), view.dest_atom)
    assert np.array_equal(artist_array(fig.axes[2]), view.src_row)
    zoom = view.src_col[96:128]  # colour: source column mod 10 (tab10), grey fill
    assert np.array_equal(artist_array(fig.axes[4]), np.where(zoom >= 0, zoom % 10, np.nan), equal_nan=True)
    # the zoom labels each group (one kernel row) with its kernel row and its checkpoint row
    *labels, title = [t.get_text() for t in fig.axes[4].texts]
    assert len(labels) == 128 and title.startswith("atom 3: kernel rows 0..127, cols 12..15")
    for line in range(32):
        for g in range(4):
            k, c = view.kernel_row[96 + line, 4 * g], view.src_row[96 + line, 4 * g]
            assert labels[4 * line + g] == f"k{k} <- " + (f"c{c}" if c >= 0 else "pad")
    assert np.array_equal(fig.axes[0].images[1].get_array()[..., 3] > 0, view.dest_atom == 3)  # the veil
    with pytest.raises(LayoutError, match="atom 99 is outside 0..15"):
        figures.swizzle_figure(plan.w13_scale, atom=99)


def test_swizzle_veil_of_a_reduced_panel_covers_every_pixel_holding_the_atom():
    m = prepare.plan_layer("nvfp4", "trtllm", 2048, 1024).w13_scale  # 4096 scale rows: drawn 8 rows a pixel
    view = data.swizzle_view(m)
    fig = figures.swizzle_figure(m, atom=0)
    for atom in (0, 37, view.atoms - 1):
        figures.show_atom(fig, atom)
        want = data.downsample((view.dest_atom == atom).astype(float), np.zeros(view.dest_atom.shape, np.uint8))
        assert np.array_equal(fig.axes[0].images[1].get_array()[..., 3] > 0, want.values > 0)
        first = atom // figures.DETAIL_ATOMS * figures.DETAIL_ATOMS  # a large buffer: the atom's page is shown
        assert fig.axes[2].patches[0].get_y() == (atom - first) * 32 - 0.5  # the shaded buffer lines


# ----------------------------------------------------------------------------- padding
def test_padding_report_counts_bytes_and_marks_rows():
    inter, hidden, experts, tp = 200, 256, 8, 2  # 100 per shard -> 112 (alignment 16)
    report = data.padding_report("fp8", "trtllm", inter, hidden, tp=tp, experts=experts)
    ip = 112
    assert report.local_intermediate == 100 and report.plan.padded_intermediate == ip
    w13 = report.tensors["w13"].padded_mask
    assert w13.shape == (2 * ip, hidden)
    assert w13[100:ip].all() and w13[ip + 100 :].all() and not w13[:100].any() and not w13[ip : ip + 100].any()
    assert report.tensors["w2"].padded_mask[:, 100:].all() and not report.tensors["w2"].padded_mask[:, :100].any()
    kernel_rows = report.tensors["w13"].kernel_mask.all(axis=1)
    assert np.array_equal(kernel_rows, ref_w13_rows(100, ip) < 0)
    fill = experts * (2 * (ip - 100) * hidden + hidden * (ip - 100))
    assert report.fill_bytes == fill
    assert report.waste_pct == pytest.approx(100 * fill / (experts * 3 * ip * hidden))
    fig = figures.padding_figure(report)
    assert np.array_equal(artist_array(fig.axes[0]), w13)


def test_padding_report_scales_and_errors():
    report = data.padding_report("mxfp8", "trtllm", 192, 256, tp=2, experts=1)  # 96 -> 128
    s = report.tensors["w13_scale"]
    assert s.padded_mask.shape == (256, 8) and s.padded_mask[96:128].all() and not s.padded_mask[:96].any()
    assert s.fill_bytes == 2 * 32 * 8
    with pytest.raises(LayoutError, match="does not split into 3 tensor-parallel shards"):
        data.padding_report("fp8", "trtllm", 200, 256, tp=3)
    nvfp4 = data.padding_report("nvfp4", "trtllm", 128, 2688, hidden_alignment=512)
    assert nvfp4.plan.padded_hidden == 3072
    w13 = nvfp4.tensors["w13"].padded_mask  # (2*64, 3072/2 bytes): hidden columns 1344..1535 are padding
    assert w13[:, 1344:].all() and not w13[:64, :1344].any()


def test_coarse_mask_keeps_thin_padding_visible():
    mask = np.zeros((2000, 700), bool)
    mask[1999] = True
    shown, block = figures.coarse_mask(mask)
    assert block == (4, 2) and shown.shape == (500, 350) and shown[-1].all() and not shown[:-1].any()


@pytest.mark.parametrize("shape,side", [((37, 1000), 16), ((1025, 3), 512), ((9, 9), 4)])
def test_reduced_mask_is_true_where_its_block_holds_a_true(shape, side):
    mask = np.random.default_rng(3).random(shape) < 0.01
    small, (fr, fc) = data.reduce_mask(mask, side)
    want = [[mask[i : i + fr, j : j + fc].any() for j in range(0, shape[1], fc)] for i in range(0, shape[0], fr)]
    assert (fr, fc) == data.reduction(shape, side) and np.array_equal(small, np.array(want))


# ----------------------------------------------------------------------------- provenance and values
def test_gather_values_round_trips_and_provenance_agrees():
    plan = prepare.plan_layer("bf16", "trtllm", 96, 256)
    layer = sources.sample_layer("bf16", experts=2, intermediate=96, hidden=256)
    values = layer.magnitude("w13", 0)
    moved = data.gather_values(plan.w13, values, itemsize=2)
    assert moved.shape == (256 * 2 // 128, 256, 64)
    back = data.gather_values(plan.w13.inverse(), moved, itemsize=2)
    assert np.array_equal(back, values)
    for coords in [(0, 0, 0), (1, 5, 17), (3, 255, 63)]:
        chain = data.provenance_rows(plan.w13, coords, itemsize=2)
        src = chain[-1][2]
        if src is None:
            assert np.isnan(moved[coords])
        else:
            assert moved[coords] == values[src]


CELL_MAPS = [  # (format, backend, intermediate, tensor, coarsened): fill, 3-D tiles, 4-byte scales, cells over rows
    ("mxfp8", "trtllm", 96, "w13", False),
    ("mxfp8", "trtllm", 96, "w2", False),
    ("nvfp4", "trtllm", 96, "w13_scale", False),
    ("bf16", "trtllm", 96, "w13", False),
    ("bf16", "trtllm", 96, "w2", False),
    ("fp8-block", "trtllm", 128, "w13_scale", False),
    ("nvfp4", "cutlass", 96, "w13", True),
]


def cell_map(fmt: str, backend: str, inter: int, name: str, coarse: bool) -> tuple[IndexMap, int]:
    m = prepare.plan_layer(fmt, backend, inter, 256).maps()[name]
    return (m.coarsened() if coarse else m), data.itemsize_of(fmt, name)


@pytest.mark.parametrize("case", CELL_MAPS)
def test_gathers_a_cell_at_a_time_equal_the_element_map(case):
    m, size = cell_map(*case)
    src = data.element_sources(m, size)  # the per-element map (oracle)
    rng = np.random.default_rng(0)
    values = rng.random(m.in_shape[:-1] + (m.in_shape[-1] // size,)).astype(np.float32)
    want = np.where(src >= 0, values.reshape(-1)[np.maximum(src, 0)], np.nan)
    assert np.array_equal(data.gather_values(m, values, size), want, equal_nan=True)
    mask = rng.random(values.shape) < 0.3
    assert np.array_equal(
        data.gather_mask(m, mask, size), data.display_2d(mask.reshape(-1)[np.maximum(src, 0)] & (src >= 0))
    )
    assert np.array_equal(data.fill_mask(m, size), data.display_2d(src < 0))
    assert data.has_fill(m) == bool((src < 0).any())


@pytest.mark.parametrize("side", [5, 16, 512])
@pytest.mark.parametrize("case", CELL_MAPS)
def test_gathered_values_read_and_reduce_like_the_built_layout(case, side):
    m, size = cell_map(*case)
    rng = np.random.default_rng(1)
    values = rng.random(m.in_shape[:-1] + (m.in_shape[-1] // size,)).astype(np.float32)
    full = data.display_2d(data.gather_values(m, values, size))
    g = data.Gathered(m, values, size)
    assert g.shape == full.shape and np.array_equal(g.full(), full, equal_nan=True)
    for i, j in zip(rng.integers(full.shape[0], size=20), rng.integers(full.shape[1], size=20)):
        assert np.array_equal(g[i, j], full[i, j], equal_nan=True)
    pad = data.fill_mask(m, size) if data.has_fill(m) else None
    flags = data.value_flags(full, pad)
    want = data.downsample(full, flags, side)
    for shown in (g, full):  # reduced straight from the checkpoint values, and from the built layout
        small, counts = data.reduce_view(shown, pad, None, side, finite=True)
        assert small.block == want.block and small.shape == want.shape
        assert np.array_equal(small.values, want.values, equal_nan=True)
        assert np.array_equal(small.flags, want.flags) and counts == want.counts(flags)


def test_reduce_view_builds_the_flags_when_values_are_not_all_finite():
    v = np.random.default_rng(2).random((40, 30))
    v[3, 4], v[20, 7] = np.nan, np.inf
    dead = np.zeros(v.shape, bool)
    dead[30:, :5] = True
    assert not data.all_finite(v) and data.all_finite(np.nan_to_num(v, posinf=1.0))
    flags = data.value_flags(v, None, dead)
    small, counts = data.reduce_view(v, None, dead, 8)
    want = data.downsample(v, flags, 8)
    assert np.array_equal(small.values, want.values, equal_nan=True) and np.array_equal(small.flags, want.flags)
    assert counts == {"dead scale": 50, "Inf": 1, "NaN": 1}


def test_magnitude_is_read_in_row_bands(monkeypatch):
    """A band of a few rows at a time gives the whole tensor's magnitudes (packed fp4: per byte
    the larger of its two values; mxfp8, fp8-block: |value|; fp8-block's bands are whole 128-row blocks, the
    last one partial here), from the dequantized layer (oracle)."""
    monkeypatch.setattr(sources, "BAND_BYTES", 100)  # bands of 1-3 rows
    for fmt, inter, hidden in (("nvfp4", 64, 128), ("mxfp8", 64, 128), ("fp8-block", 200, 328), ("fp8", 40, 96)):
        layer = sources.sample_layer(fmt, experts=2, intermediate=inter, hidden=hidden)
        w13, w2 = (t[1].abs() for t in layer.moe.dequantized())
        if fmt == "nvfp4":
            w13, w2 = (t.reshape(t.shape[0], -1, 2).amax(dim=-1) for t in (w13, w2))
        assert np.array_equal(layer.magnitude("w13", 1), w13.float().numpy())
        assert np.array_equal(layer.magnitude("w2", 1), w2.float().numpy())


def test_no_dead_scale_costs_no_mask_memory():
    layer = sources.sample_layer("nvfp4", experts=2, intermediate=64, hidden=128)
    dead = layer.dead("w13", 1)
    assert dead.shape == layer.magnitude("w13", 1).shape and not dead.any() and dead.strides == (0, 0)


def test_provenance_figure_marks_source_and_kernel_element():
    plan = prepare.plan_layer("mxfp8", "trtllm", 96, 256)
    layer = sources.sample_layer("mxfp8", experts=2, intermediate=96, hidden=256)
    before = layer.magnitude("w13", 1)
    fig = figures.provenance_figure(plan.w13, (5, 17), before)
    ax_b, ax_a = fig.axes[0], fig.axes[2]
    src = plan.w13.provenance((5, 17)).source
    assert tuple(int(v[0]) for v in reversed(ax_b.lines[0].get_data())) == src
    assert tuple(int(v[0]) for v in reversed(ax_a.lines[0].get_data())) == (5, 17)
    assert np.allclose(artist_array(ax_a), data.gather_values(plan.w13, before), equal_nan=True)


def test_compare_figure_shows_zero_difference_only_for_the_right_preparation():
    plan = prepare.plan_layer("mxfp8", "trtllm", 96, 256)
    layer = sources.sample_layer("mxfp8", experts=2, intermediate=96, hidden=256)
    scales = layer.magnitude("w13_scale", 1)
    good = data.gather_values(plan.w13_scale, scales)
    unswizzled = data.gather_values(compose(*plan.w13_scale.steps[:-1]), scales)
    ok = figures.compare_figure(plan.w13_scale, scales, good)
    bad = figures.compare_figure(plan.w13_scale, scales, unswizzled)
    assert np.nanmax(artist_array(ok.axes[4])) == 0
    assert np.nanmax(artist_array(bad.axes[4])) > 0


def test_sample_layer_is_structured():
    layer = sources.sample_layer("nvfp4", experts=3, intermediate=64, hidden=128)
    gate = layer.magnitude("w13", 2)[:64]
    up = layer.magnitude("w13", 2)[64:]
    assert gate.mean(axis=1)[-8:].mean() > 4 * gate.mean(axis=1)[:8].mean()  # gate grows down the rows
    assert up.mean(axis=0)[-8:].mean() > 2 * up.mean(axis=0)[:8].mean()  # up grows across the columns
    assert layer.magnitude("w13", 2).mean() > layer.magnitude("w13", 0).mean()
    with pytest.raises(LayoutError, match="expert 3 is outside 0..2"):
        layer.magnitude("w13", 3)


# ----------------------------------------------------------------------------- tuner, render, cli
def test_tuner_figure_draws_the_sweep():
    pd = pytest.importorskip("pandas")
    sweep = pd.DataFrame(
        dict(
            inter_align=[16, 16, 64, 64],
            hidden_align=[256, 512, 256, 512],
            t1=[0, 10, 20, 30],
            min_tactics=[0, 5, 20, 25],
            extra_bytes_pct=[0.0, 1.0, 2.0, 3.0],
            reference=[True, False, False, False],
            recommended=[False, False, True, False],
        )
    )
    fig = figures.tuner_figure(sweep)
    assert np.array_equal(artist_array(fig.axes[0]), [[0, 5], [20, 25]])
    assert np.array_equal(artist_array(figures.tuner_figure(sweep, tokens=1).axes[0]), [[0, 10], [20, 30]])
    boxes = [(p.get_xy(), p.get_edgecolor()) for p in fig.axes[0].patches]
    assert [xy for xy, _ in boxes] == [(-0.5, 0.5), (-0.5, -0.5)]
    with pytest.raises(LayoutError, match="token counts: 1"):
        figures.tuner_figure(sweep, tokens=4096)


def test_html_rendering_lists_steps_and_draws_thumbnail():
    plan = prepare.plan_layer("nvfp4", "trtllm", 112, 256)
    html = render.plan_html(plan)
    for name in ("w13", "w2_scale", "swizzle_scales_128x4", "swap_w13_to_w31", "NVFP4 TRT-LLM"):
        assert name in html
    assert html.count("<img") == 4
    assert "fill byte 0x00" in render.provenance_html(plan.w13.provenance((255, 0)))


def test_load_ext_makes_ipython_render_plans_as_html():
    interactiveshell = pytest.importorskip("IPython.core.interactiveshell")
    import fimoe_lab.viz

    ip = interactiveshell.InteractiveShell.instance()
    fimoe_lab.viz.load_ipython_extension(ip)
    plan = prepare.plan_layer("mxfp8", "trtllm", 96, 256)
    shown, _ = ip.display_formatter.format(plan)
    assert "LayerPlan" in shown["text/html"] and "pad_projections" in shown["text/html"]
    shown, _ = ip.display_formatter.format(plan.w13.provenance((0, 0)))
    assert "input of swap_w13_to_w31" in shown["text/html"]


def test_lab_command_is_offline_and_local(tmp_path):
    from fimoe_lab.cli import build_parser
    from fimoe_lab.cli.lab import jupyterlab_command

    argv, env = jupyterlab_command(tmp_path / "nb", 8899, tmp_path / "state", open_browser=False)
    joined = " ".join(argv)
    for flag in (
        "--ServerApp.ip=127.0.0.1",
        "--ServerApp.port=8899",
        "--LabApp.news_url=None",
        "--LabApp.extension_manager=readonly",
        "NeverCheckForUpdate",
        "--ServerApp.open_browser=False",
    ):
        assert flag in joined
    assert str(tmp_path / "state" / "config") in env["JUPYTER_CONFIG_PATH"]
    assert "announcements" in (tmp_path / "state" / "config" / "labconfig" / "page_config.json").read_text()
    args = build_parser().parse_args(["lab", "--no-browser", "--port", "9000"])
    assert args.no_browser and args.port == 9000


def test_decoded_values_are_kept_within_their_byte_bound(monkeypatch):
    """The decoded arrays kept stay within the cache's bytes (the least recently used dropped); one dropped and
    asked again is decoded again to the same values, and each equals a dequantize-then-abs of its expert."""
    layer = sources.sample_layer("nvfp4", experts=7, intermediate=64, hidden=128)
    one = 128 * 32 * 4  # one expert's w2 magnitudes: (hidden, intermediate / 2) float32
    cache = data.BoundedCache(4 * one)
    monkeypatch.setattr(sources, "_VALUES", cache)
    first = [layer.magnitude("w2", e).copy() for e in range(layer.experts)]
    assert len(cache.entries) == 4 and cache.bytes == 4 * one
    assert (layer.key, "magnitude", "w2", 0) not in cache.entries
    again = layer.magnitude("w2", 0)
    assert np.array_equal(again, first[0]) and not again.flags.writeable
    w2 = dict(zip(("w13", "w2"), layer.moe.dequantized()))["w2"]
    for e in (0, layer.experts - 1):
        want = w2[e].abs().reshape(w2.shape[1], -1, 2).amax(-1).float().numpy()
        assert np.array_equal(first[e], want)
