"""Point and see: a click on any layout explorer's figure traces the element under it.

Each test clicks figure coordinates (what the browser's canvas reports, :func:`svg_point`)
and checks the traced element against an independent computation: the plan's map run
by the executors (``IndexMap.apply``) on bytes that encode their own offsets, read back
at the clicked place, and the reference loops of ``tests/test_viz.py``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("ipywidgets")
pytest.importorskip("matplotlib")

from fimoe_lab.viz import data, figures, sources, widgets  # noqa: E402
from tests.test_viz import ref_swizzle_offset, ref_w13_rows  # noqa: E402
from tests.test_viz_explorers import is_error, message, svg_point  # noqa: E402


def byte_sources(m) -> np.ndarray:
    """Per output byte of ``m`` (``m.out_shape``), the flat input byte it holds (-1: fill).

    Runs ``m.apply`` on four byte planes encoding each byte's offset + 1, and again on their
    complement: a moved byte differs by 0xFF in every plane, a fill byte is the same."""
    ids = np.arange(1, math.prod(m.in_shape) + 1, dtype=np.int64)
    got, flipped = 0, 0
    for k in range(4):
        plane = ((ids >> (8 * k)) & 255).astype(np.uint8).reshape(1, *m.in_shape)
        a = m.apply(torch.from_numpy(plane))[0].numpy().astype(np.int64)
        b = m.apply(torch.from_numpy(plane ^ 255))[0].numpy().astype(np.int64)
        got, flipped = got + (a << (8 * k)), flipped | (a ^ b)
    return np.where(flipped == 255, got - 1, -1)


def ref_source(m, itemsize: int, kernel_flat: int) -> tuple[int, int] | None:
    """Checkpoint ``(row, column)`` in elements of output element ``kernel_flat`` (flat), or None."""
    src = int(byte_sources(m).reshape(-1)[kernel_flat * itemsize])
    if src < 0:
        return None
    row, byte = divmod(src, m.in_shape[-1])
    return row, byte // itemsize


def ref_landing(m, itemsize: int, row: int, col: int) -> int:
    """Flat output element where checkpoint element ``(row, col)`` lands."""
    hit = np.flatnonzero(byte_sources(m).reshape(-1) == row * m.in_shape[-1] + col * itemsize)
    assert hit.size == 1
    return int(hit[0]) // itemsize


def out_cols(m, itemsize: int) -> int:
    return m.out_shape[-1] // itemsize


def test_row_explorer_click_on_values_lines_and_all_rows():
    w = widgets.RowExplorer()  # seeded MXFP8 w13, I 96 padded to 128: kernel row k <- ref[k]
    w.start.value = 64
    ref = ref_w13_rows(96, 128)
    lines, every, values = w.figure.axes[:3]
    t = w.click(*svg_point(values, 7.3, 5.2))  # values panel: grid row 5 = kernel row 69
    assert t.side == "kernel" and t.kernel == (69, 7) and t.checkpoint == (int(ref[69]), 7)
    assert t.checkpoint == ref_source(w.state["plan"].w13.row_steps(), 1, 69 * 256 + 7)
    assert "kernel (69, 7) <- checkpoint" in message(w) and "swap_w13_to_w31_rows" in message(w)
    assert w.trace_box.value.count("\n") == len(t.chain) - 1 and "shuffle_rows_for_epilogue" in w.trace_box.value
    assert w.view.value.count("<circle") >= 2 and w.svg.count("<circle") == 0  # markers on the shown copy only
    ckpt_rows = np.unique(ref[64:128][ref[64:128] >= 0])  # the window's checkpoint rows, in order
    pos, n = int(np.flatnonzero(ckpt_rows == int(ref[70]))[0]), len(ckpt_rows) - 1
    t = w.click(*svg_point(lines, 0, pos / n))  # a checkpoint row of the lines panel: where it lands
    assert t.side == "checkpoint" and t.checkpoint == (int(ref[70]), 0) and t.kernel == (70, 0)
    t = w.click(*svg_point(every, 200, 10))  # all rows: x is the kernel row
    assert t.kernel == (200, 0) and t.checkpoint == (None if ref[200] < 0 else (int(ref[200]), 0))
    hover = w._hover(*svg_point(values, 3, 0))
    assert hover.startswith("kernel row 64, column 3, value ") and f"checkpoint ({int(ref[64])}, 3)" in hover
    assert "moved by: " in hover and "interleave_rows_for_gated_act" in hover


def test_tile_explorer_click_on_the_swizzle_and_the_tiles():
    w = widgets.TileExplorer()  # seeded MXFP8 w13 scales
    m = w.state["plan"].w13_scale
    lin, buf, atom = w.figure.axes[0], w.figure.axes[2], w.figure.axes[4]
    t = w.click(*svg_point(buf, 5, 40))  # buffer line 40, offset 5: flat element 645
    assert t.side == "kernel" and t.checkpoint == ref_source(m, 1, 40 * 16 + 5)
    w.atom.value = 1
    t = w.click(*svg_point(w.figure.axes[4], 9, 3))  # atom 1 close-up: line 3, offset 9
    assert t.checkpoint == ref_source(m, 1, 512 + 16 * 3 + 9) and t.checkpoint is not None
    w.atom.value = 2
    t = w.click(*svg_point(w.figure.axes[4], 9, 3))  # atom 2: padding scales
    assert t.checkpoint == ref_source(m, 1, 512 * 2 + 16 * 3 + 9) is None and "padding" in t.moved_by
    t = w.click(*svg_point(lin, 2, 7))  # a checkpoint scale: where it lands in the buffer
    flat = ref_landing(m, 1, 7, 2)
    assert t.side == "checkpoint" and t.kernel == divmod(flat, out_cols(m, 1))
    last = m.steps[-1]  # the swizzle alone, by the reference formula, from the kernel-side row it lands in
    kr, kc = divmod(int(byte_sources(m.steps[0] if len(m.steps) == 1 else last).reshape(-1)[flat]), last.in_shape[-1])
    assert flat == ref_swizzle_offset(np.array([kr]), np.array([kc]), last.in_shape[-1])[0]
    assert w._hover(*svg_point(atom, 0, 0)).startswith("kernel buffer offset 1024, source column 0")
    w.source.value = "seeded:bf16"  # block-major-K tiles, 2-byte elements
    m = w.state["plan"].w13
    _, out = w.figure.axes[0], w.figure.axes[2]
    t = w.click(*svg_point(out, 11, 130))
    assert t.side == "kernel" and t.checkpoint == ref_source(m, 2, 130 * out_cols(m, 2) + 11)
    t = w.click(*svg_point(w.figure.axes[0], 100, 9))
    assert t.kernel == divmod(ref_landing(m, 2, 9, 100), out_cols(m, 2))


def test_compare_explorer_click_traces_through_the_clicked_plan():
    w = widgets.CompareExplorer()  # A: TRT-LLM, B: CUTLASS (no shuffle) on the seeded MXFP8 layer
    a, b = (w.state[k].w13.row_steps() for k in ("a", "b"))
    fig_a, fig_b = w.figure.parts
    t = w.click(*svg_point(fig_b.axes[1], 30, 0), 1)  # B's all-rows panel: kernel row 30 under plan B
    assert t.kernel == (30, 0) and t.checkpoint == ref_source(b, 1, 30 * out_cols(b, 1))
    t = w.click(*svg_point(fig_a.axes[1], 30, 0), 0)
    assert t.checkpoint == ref_source(a, 1, 30 * out_cols(a, 1)) == (int(ref_w13_rows(96, 128)[30]), 0)
    pieces = w.view.value.split("</svg>")
    assert "<circle" not in pieces[1] and w.svg.count("<svg") == 2
    assert w.click(*svg_point(fig_a.axes[1], 30, 0), 2) is None  # there is no third picture


def test_diagnose_figure_click_shows_where_a_checkpoint_byte_lands(tmp_path):
    checkpoints = pytest.importorskip("fimoe_lab.checkpoints")
    if "deepseek-r1-nvfp4" not in checkpoints.sample_names():
        pytest.skip("sample checkpoints are not in this checkout")
    layer = sources.load_layer("deepseek-r1-nvfp4")
    plan = layer.plan("trtllm")
    from safetensors.torch import save_file

    save_file(
        {"w13_weight_scale": plan.w13_scale.apply(layer.moe.w13_scale).contiguous()}, str(tmp_path / "d.safetensors")
    )
    w = widgets.DiagnoseExplorer("deepseek-r1-nvfp4", str(tmp_path / "d.safetensors"))
    assert w.figure is not None and not is_error(w)
    # the panels hold decoded scales (the core's decode of an expert's E4M3 bytes), not the byte codes
    from fimoe_lab.formats import QuantizedTensor
    from fimoe_lab.formats.health import decoded_scales

    shown = figures.cells_of(w.figure)[id(w.figure.axes[0])][0].values
    decoded = [decoded_scales(QuantizedTensor(None, s, None, "nvfp4", 0)).double().numpy() for s in layer.moe.w13_scale]
    assert any(np.array_equal(shown, d) for d in decoded) and "scale (decoded)" in w.svg
    codes = layer.moe.w13_scale.view(torch.uint8).double().numpy()
    assert not any(np.array_equal(shown, c) for c in codes)
    m = plan.w13_scale
    t = w.click(*svg_point(w.figure.axes[0], 3, 17))
    assert t.side == "checkpoint" and t.checkpoint == (17, 3)
    assert t.kernel == divmod(ref_landing(m, 1, 17, 3), out_cols(m, 1))


def test_a_click_never_leaves_an_explorer_stuck():
    bad = widgets.DiagnoseExplorer()  # nothing loaded: no figure
    assert bad.figure is None and bad.click(10, 10) is None and bad._hover(10, 10) == ""
    w = widgets.RowExplorer()
    assert w.click(1.0, 1.0) is None and w.click(-50, 1e6) is None and w.click(float("nan"), 3) is None
    assert w.click(10, 10, 5) is None and not is_error(w)
    w.start.value = 8  # the explorer redraws as before: the trace and markers go with the old picture
    assert w.trace_box.value == "" and "<circle" not in w.view.value
    if widgets.anywidget is not None:  # the browser's reports take the same path
        values = w.figure.axes[2]
        w.view.click = [*svg_point(values, 1, 1), 0, 1]
        assert w.state["trace"].kernel == (9, 1)
        w.view.hover = [*svg_point(values, 1, 1), 0, 2]
        assert w.view.tip.startswith("kernel row 9, column 1")
        w.view.hover = [1.0, 1.0, 0, 3]
        assert w.view.tip == ""
        w.view.click = ["x", None, 0, 4]  # a malformed report from the page: ignored
        w.view.click = [1.5]
        assert w.state["trace"].kernel == (9, 1) and not is_error(w)


def test_trace_cell_agrees_with_the_executor_on_random_cells():
    layer = sources.sample_layer("nvfp4", experts=2, intermediate=96, hidden=256)
    plan = layer.plan("trtllm")
    g = np.random.default_rng(0)
    for name in ("w13", "w2", "w13_scale"):
        m, size = plan.maps()[name], data.itemsize_of("nvfp4", name)
        src = byte_sources(m)
        rows, cols = math.prod(m.out_shape[:-1]), out_cols(m, size)
        cells = data.Cells("kernel", m, size, (rows, cols))
        for i, j in zip(g.integers(0, rows, 12), g.integers(0, cols, 12)):
            t = data.trace_cell(cells, int(i), int(j))
            s = int(src.reshape(-1)[(int(i) * cols + int(j)) * size])
            assert t.checkpoint == (None if s < 0 else (s // m.in_shape[-1], s % m.in_shape[-1] // size))
        back = data.Cells("checkpoint", m, size, (m.in_shape[0], m.in_shape[-1] // size))
        for i, j in zip(g.integers(0, m.in_shape[0], 12), g.integers(0, m.in_shape[-1] // size, 12)):
            t = data.trace_cell(back, int(i), int(j))
            assert t.kernel == divmod(ref_landing(m, size, int(i), int(j)), cols) and t.checkpoint == (i, j)


def test_a_large_swizzled_buffer_shows_the_chosen_atoms_page_a_line_per_scale_line():
    """A buffer of more than 2 * DETAIL_ATOMS atoms: the buffer panel shows the page of atoms holding the chosen
    one, one buffer line per row; its values, clicks and hover are the map's (executors on self-encoding bytes)."""
    layer = sources.sample_layer("mxfp8", experts=1, intermediate=1024, hidden=2048)  # w13 scales (2048, 64)
    w = widgets.TileExplorer(layer, tensor="w13_scale")
    m, view = w.state["plan"].w13_scale, w.state["view"]
    assert view.atoms == 256 > 2 * figures.DETAIL_ATOMS and w.state["colour_by"] == "scale value"
    src = byte_sources(m).reshape(-1)
    scales = layer.magnitude("w13_scale", 0)
    page_image = None
    for atom in (45, 46, 0, view.atoms - 1):
        w.atom.value = atom
        first = atom // figures.DETAIL_ATOMS * figures.DETAIL_ATOMS
        ax = w.figure.axes[2]
        assert not is_error(w) and f"atoms {first}..{first + figures.DETAIL_ATOMS - 1} of 256" in w.svg
        shown = np.ma.filled(ax.images[0].get_array(), np.nan)
        offsets = np.arange(first * 512, (first + figures.DETAIL_ATOMS) * 512).reshape(-1, 16)
        expect = np.where(src[offsets] >= 0, scales.reshape(-1)[np.maximum(src[offsets], 0)], np.nan)
        assert shown.shape == (figures.DETAIL_ATOMS * 32, 16) and np.array_equal(shown, expect, equal_nan=True)
        if atom == 46:  # the same page as atom 45: not drawn again
            assert ax.images[0] is page_image
        page_image = ax.images[0]
        line, j = (atom - first) * 32 + 5, 3  # line 5 of the chosen atom, scale 3 of it
        t = w.click(*svg_point(ax, j, line))
        offset = (atom * 32 + 5) * 16 + j
        assert t.kernel == divmod(offset, out_cols(m, 1)) and t.checkpoint == divmod(int(src[offset]), m.in_shape[-1])
        tip = w._hover(*svg_point(ax, j, line))
        assert tip.startswith(f"kernel buffer offset {offset}, value ") and f"kernel {t.kernel} <- checkpoint" in tip
    w.colour_by.value = "source row"  # index colouring: the page's source rows, padding grey
    shown = w.figure.axes[2].images[0].get_array()
    offsets = np.arange((view.atoms - 8) * 512, view.atoms * 512).reshape(-1, 16)
    assert np.array_equal(np.ma.filled(shown, -1), np.where(src[offsets] >= 0, src[offsets] // 64, -1))
