"""The explorers as instruments: your own checkpoint, typed shapes, recovery from errors,
export, the tuner's controls and frontier, and cached redraws."""

from __future__ import annotations

import gc
import html
import importlib.util
import re

import numpy as np
import pytest
import torch

pytest.importorskip("ipywidgets")
pytest.importorskip("matplotlib")

from fimoe_lab import prepare, resources  # noqa: E402
from fimoe_lab.errors import FimoeError, LayoutError  # noqa: E402
from fimoe_lab.viz import data, figures, sources, widgets  # noqa: E402
from tests.test_viz import drawn_pairs, ref_w13_rows  # noqa: E402


def is_error(w) -> bool:
    return "#d33" in w.message.value


def message(w) -> str:
    return html.unescape(w.message.value)


def test_an_unavailable_colour_mode_says_so_and_the_explorer_keeps_working():
    w = widgets.RowExplorer(backend="cutlass")  # CUTLASS: no epilogue shuffle
    assert "shuffle_rows_for_epilogue" not in w.state["flow"].steps
    w.colour_by.value = "shuffle block"
    assert not is_error(w) and "shown by origin" in w.message.value and w.state["colour_by"] == "origin"
    w.backend.value = "trtllm"  # the mode exists again: used, no note
    assert w.state["colour_by"] == "shuffle block" and "shown by origin" not in w.message.value
    w.start.value = 64
    assert w.state["window"][0] == 64 and not is_error(w)


def test_a_bad_value_shows_its_error_and_the_next_change_redraws():
    w = widgets.ProvenanceExplorer()
    shown = w.svg
    w.row.value = 10_000  # clamped to the layout, and said so
    assert not is_error(w) and "row 10000 is outside 0..255: shown 255" in message(w) and w.state["coords"] == (255, 0)
    w.row.value = 7
    assert not is_error(w) and w.state["coords"] == (7, 0) and w.svg != shown
    w.shape.value = "96 by 256"
    assert is_error(w) and "is not 'I x H'" in message(w)
    w.shape.value = "64x128"  # typed shape: a seeded layer of that size
    assert not is_error(w) and w.state["layer"].intermediate == 64 and w.state["layer"].hidden == 128


def test_provenance_from_the_checkpoint_side_lands_where_the_map_says():
    w = widgets.ProvenanceExplorer()
    w.pick.value = "checkpoint"
    w.row.value, w.col.value = 1, 5  # gate row 1 -> padded 1 -> swapped 129 -> interleaved 3 -> shuffled
    ref = ref_w13_rows(96, 128)
    assert w.state["coords"] == (int(np.flatnonzero(ref == 1)[0]), 5)
    assert w.state["chain"][-1][2] == (1, 5)


def svg_point(ax, x: float, y: float) -> tuple[float, float]:
    """Where data point ``(x, y)`` of ``ax`` is in the explorer's SVG (the centre of the circle
    :func:`figures.marker_svg` draws there): what a click on that cell reports."""
    circle = figures.marker_svg(ax, x, y)
    return float(re.search(r'cx="([\d.]+)"', circle).group(1)), float(re.search(r'cy="([\d.]+)"', circle).group(1))


def test_clicking_a_kernel_cell_traces_it_and_a_checkpoint_cell_shows_where_it_lands():
    w = widgets.ProvenanceExplorer()
    ref = ref_w13_rows(96, 128)  # the seeded MXFP8 w13: kernel row -> checkpoint row
    checkpoint_ax, kernel_ax = w.figure.axes[0], w.figure.axes[2]
    w.click(*svg_point(kernel_ax, 7.2, 40.3))  # a click lands anywhere in the cell
    assert w.pick.value == "kernel" and w.state["coords"] == (40, 7)
    assert w.state["chain"][-1][2] == (int(ref[40]), 7) and message(w).startswith("kernel (40, 7) <- expert 0, row ")
    target = int(np.flatnonzero(ref == 3)[0])
    w.click(*svg_point(checkpoint_ax, 11, 3))
    assert w.pick.value == "checkpoint" and (w.row.value, w.col.value) == (3, 11)
    assert w.state["coords"] == (target, 11) and w.state["chain"][-1][2] == (3, 11)
    w.click(1.0, 1.0)  # the figure's corner: no heatmap there, nothing changes
    assert w.state["coords"] == (target, 11) and not is_error(w)
    if widgets.anywidget is not None:  # the browser's report goes the same way
        w.view.click = [*svg_point(kernel_ax, 2, 9), 0, 1]  # x, y, SVG part, time
        assert w.pick.value == "kernel" and w.state["coords"] == (9, 2)


def test_without_anywidget_the_figure_is_html_and_typing_still_traces(monkeypatch):
    monkeypatch.setattr(widgets, "anywidget", None)  # what an install without anywidget imports
    w = widgets.ProvenanceExplorer()
    assert type(w.view) is widgets.W.HTML and w.view.value == w.svg
    w.row.value = 40
    assert w.state["chain"][-1][2] == (int(ref_w13_rows(96, 128)[40]), 0)


def test_path_box_loads_a_checkpoint_at_a_layer_and_tp_rank():
    checkpoints = pytest.importorskip("fimoe_lab.checkpoints")
    if "mixtral-bf16" not in checkpoints.sample_names():
        pytest.skip("sample checkpoints are not in this checkout")
    w = widgets.RowExplorer()
    path = resources.sample_path("mixtral-bf16")
    w.tp_size.value, w.tp_rank.value = 2, 1
    w.load(str(path))
    layer = w.state["layer"]
    full = sources.load_layer(str(path))
    assert (layer.moe.tp_size, layer.moe.tp_rank, layer.intermediate) == (2, 1, full.intermediate // 2)
    assert "TP rank 1 of 2" in w.source.label and w.source.value.startswith("path:first:2:1:")
    half = full.intermediate // 2  # rank 1 holds the second half of gate and of up
    assert torch.equal(layer.moe.w13[0, :half], full.moe.w13[0, half : 2 * half])
    w.tp_rank.value = 5
    w.load(str(path))
    assert is_error(w) and "TP rank 5 is outside 0..1" in w.message.value and w.state["layer"] is layer
    w.tp_rank.value = 0
    w.load(str(path / "missing"))
    assert is_error(w) and "layer not changed" in w.message.value and w.state["layer"] is layer
    pad = widgets.PaddingExplorer()
    pad.load("mixtral-bf16")
    assert (pad.fmt.value, pad.intermediate.value, pad.hidden.value) == ("bf16", full.intermediate, full.hidden)


def test_export_writes_png_and_svg_and_the_code_draws_the_same_figure(tmp_path):
    w = widgets.RowExplorer()
    w.start.value = 32
    png = w.save("png", str(tmp_path / "rows"))
    svg = w.save("svg", str(tmp_path / "rows"))
    assert png.read_bytes()[:4] == b"\x89PNG" and int.from_bytes(png.read_bytes()[16:20], "big") == round(
        w.figure.get_size_inches()[0] * 200
    )
    assert svg.read_text() == "<!-- generator: fimoe-lab -->\n" + w.svg  # marked: a later save may replace it
    scope: dict = {}
    exec(w.code(), scope)
    assert drawn_pairs(scope["fig"]) == drawn_pairs(w.figure)
    assert np.array_equal(scope["fig"].axes[2].images[0].get_array(), w.figure.axes[2].images[0].get_array())
    pad = widgets.PaddingExplorer(intermediate=384, hidden=512, experts=4, fmt="fp8", tp=2)
    scope = {}
    exec(pad.code(), scope)
    assert scope["report"].summary() == pad.state["report"].summary()


def test_a_window_or_side_change_redraws_only_the_window_layer():
    layer = sources.sample_layer("nvfp4", experts=2, intermediate=128, hidden=256)
    w = widgets.RowExplorer(layer)
    w.expert.value = 1
    tag = f'<g class="{figures.LAYER}">'
    fig, base = w.figure, tag.join(w.svg.split(tag)[:3])  # the static part, the colouring and the colour scale
    w.start.value = 72
    w.side.value = "checkpoint"
    assert w.figure is fig and w.svg.startswith(base)  # lines, shading and values only were drawn again
    s = w.state
    fresh = figures.row_permutation_figure(
        s["plan"].w13,
        2,
        s["window"],
        s["colour_by"],
        layer.magnitude("w13", 1),
        data.itemsize_of("nvfp4", "w13"),
        side="checkpoint",
        dead=layer.dead("w13", 1),
    )
    assert svg_texts(w.svg) == svg_texts(figures.to_svg(fresh))  # what a full drawing says, no more, no less
    assert drawn_pairs(w.figure) == drawn_pairs(fresh) and len(drawn_pairs(fresh)) == 64
    shown, expect = (np.ma.filled(f.axes[2].images[0].get_array(), np.nan) for f in (w.figure, fresh))
    assert np.array_equal(shown, expect, equal_nan=True) and np.isfinite(shown).any()
    w.colour_by.value = "shuffle block"  # recoloured in place: the all-rows panel and the lines
    fresh = figures.row_permutation_figure(
        s["plan"].w13, 2, s["window"], "shuffle block", layer.magnitude("w13", 1), 1, side="checkpoint"
    )
    assert w.figure is fig and svg_texts(w.svg) == svg_texts(figures.to_svg(fresh))
    legend = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
    assert legend == [t.get_text() for t in fresh.axes[1].get_legend().get_texts()] and "shuffle block 0" in legend
    assert w.svg.count(figures.LAYER) == len(figures.row_layers(fig)) == 4 and w.svg.count("<svg") == 1
    w.colour_by.value = "origin"
    w.side.value = "kernel"
    w.start.value = 0
    assert w.figure is fig and w.state["window"] == (0, 64)
    assert drawn_pairs(w.figure) == [(int(c), k) for k, c in enumerate(s["flow"].src_rows[:64]) if c >= 0]
    layers = w.svg.split(tag)
    w.expert.value = 0  # another expert: its colour scale and values only (the rows layer as it was)
    now = w.svg.split(tag)
    assert w.figure is fig and now[:2] + now[3:4] == layers[:2] + layers[3:4] and now[4] != layers[4]
    fresh = figures.row_permutation_figure(
        s["plan"].w13, 2, (0, 64), "origin", layer.magnitude("w13", 0), 1, dead=layer.dead("w13", 0)
    )
    assert svg_texts(w.svg) == svg_texts(figures.to_svg(fresh))
    shown, expect = (np.ma.filled(f.axes[2].images[0].get_array(), np.nan) for f in (w.figure, fresh))
    assert np.array_equal(shown, expect, equal_nan=True) and np.isfinite(shown).any()


def svg_texts(svg: str) -> list[str]:
    """Every ``<text>`` and ``<title>`` string of an SVG, sorted (what a reader sees and hovers)."""
    return sorted(re.findall(r"<(?:text|title)\b[^>]*>([^<]*)</", svg))


def test_an_atom_change_redraws_only_the_atom_layer(tmp_path):
    w = widgets.TileExplorer()  # seeded MXFP8 w13 scales: 4 atoms
    fig, base = w.figure, w.svg[: w.svg.rindex(f'<g class="{figures.LAYER}">')]
    w.atom.value = 3
    assert w.figure is fig and w.svg.startswith(base)  # the grid, buffer and axes were not drawn again
    assert w.svg.count("<svg") == 1 and w.svg.count(figures.LAYER) == 1 and w.svg.endswith("</g></svg>")
    # the layered SVG says exactly what a fresh full drawing of atom 3 says (labels, title, hover texts)
    size, scales = data.itemsize_of("mxfp8", "w13_scale"), w.layer.magnitude("w13_scale", 0)
    fresh = figures.swizzle_figure(w.state["plan"].w13_scale, size, 3, "scale value", scales)
    assert svg_texts(w.svg) == svg_texts(figures.to_svg(fresh))
    assert "atom 3: kernel rows" in w.svg
    titles = re.findall(r"<title>buffer offsets (\d+)\.\.", w.svg)
    assert [int(t) for t in titles] == [512 * 3 + 4 * i for i in range(128)]
    # the figure object moved too: a PNG export shows atom 3
    assert [t.get_text() for t in w.figure.axes[4].texts] == [t.get_text() for t in fresh.axes[4].texts]
    assert w.save("png", str(tmp_path / "atom")).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.skipif(importlib.util.find_spec("fimoe_lab.tune") is None, reason="the tuner is not installed")
def test_tuner_controls_reach_the_sweep_and_the_frontier_is_drawn():
    pytest.importorskip("pandas")
    w = widgets.TunerExplorer("gpt-oss-120b", "fp8", 8)
    sweep = w.state["sweep"]
    front = sweep[sweep["pareto"]].sort_values("extra_bytes_pct")
    line = next(l for l in w.figure.axes[0].lines if l.get_label() == "frontier")
    assert np.allclose(line.get_xdata(), front["extra_bytes_pct"]) and np.allclose(
        line.get_ydata(), front["predicted_us"]
    )
    w.tokens.value = "1, 64"
    assert w.state["sweep"].attrs["tokens"] == [1, 64]
    w.gpu.value = next(g for g in w.gpu.options if g != "b200")
    assert w.state["sweep"].attrs["gpu"] != sweep.attrs["gpu"]
    w.engine.value = w.engine.options[1]
    assert w.state["sweep"].attrs["engine"] == w.engine.options[1]
    w.tokens.value = "1, lots"
    assert is_error(w) and "not positive integers" in w.message.value
    w.tokens.value = ""
    assert not is_error(w) and w.state["sweep"].attrs["tokens"] == list(sweep.attrs["tokens"])
    assert "tokens=" not in w.code()


def test_figures_and_data_agree_for_the_drawn_layer():
    layer = sources.sample_layer("nvfp4", experts=2, intermediate=128, hidden=256)
    w = widgets.RowExplorer(layer, backend="trtllm")
    plan = prepare.plan_layer("nvfp4", "trtllm", 128, 256)
    assert np.array_equal(w.state["flow"].src_rows, data.row_flow(plan.w13).src_rows)
    assert "<title>" in w.svg and figures.hover_texts(w.figure)


def test_ab_compare_diffs_the_step_chains_and_draws_both_plans():
    a = prepare.plan_layer("mxfp8", "trtllm", 96, 256).w13
    b = prepare.plan_layer("mxfp8", "cutlass", 96, 256).w13
    diff = data.chain_diff(a, b)
    assert [op for op, _, _ in diff] == ["same", "same", "only A", "only A"]
    assert diff[3][1].startswith("shuffle_rows_for_epilogue(") and "epilogue_tile_m=128" in diff[3][1]
    w = widgets.CompareExplorer()
    assert w.state["diff"] == diff and "only A: interleave_rows_for_gated_act" in message(w)
    fig_a, fig_b = w.figure.parts
    assert drawn_pairs(fig_a) == [(int(s), k) for k, s in enumerate(data.row_flow(a).src_rows[:64])]
    assert w.svg.count("<svg") == 2 and "fimoe-pair" in w.svg and "<table class='fimoe-diff'" in w.svg
    for part in (fig_a, fig_b):  # both sides draw the chosen expert's values, the layer's own
        assert part._fimoe_rows["values"] is w.layer.magnitude("w13", 0)
    scope: dict = {}
    exec(w.code(), scope)
    assert drawn_pairs(scope["fig"].parts[1]) == drawn_pairs(fig_b)
    assert np.array_equal(scope["fig"].parts[0].axes[2].images[0].get_array(), fig_a.axes[2].images[0].get_array())
    shown = w.svg
    w.expert.value = 1
    assert w.figure.parts[0]._fimoe_rows["values"] is w.layer.magnitude("w13", 1) and w.svg != shown
    shown = w.svg
    w.engine_b.value = w.engine_b.options[-1]
    assert f"engine {w.engine_b.options[-1]}" in w.svg and w.svg != shown
    w.tp_b.value = 2  # 96 / 2 = 48 rows: not whole 32-value scale blocks, said and recovered from
    assert is_error(w) and "not a multiple of 32" in message(w)
    w.shape.value, w.backend_b.value = "128x256", "trtllm"  # same backend, 64 rows per shard: B pads to 128
    assert not is_error(w) and [op for op, _, _ in w.state["diff"]] == ["only B", "same", "same", "same"]
    assert w.state["diff"][0][2].startswith("pad_projections(num_projections=2, rows=64, padded_rows=128")


def test_a_new_provenance_element_moves_the_markers_without_redrawing():
    w = widgets.ProvenanceExplorer()
    heatmaps = w.figure
    w.row.value, w.col.value = 40, 200
    assert w.figure is heatmaps  # same heatmaps: the markers moved
    ax = w.figure.axes[2]
    x, y = ax.transData.transform((200, 40)) * 72 / w.figure.dpi
    top = w.figure.get_size_inches()[1] * 72
    circles = re.findall(r'<circle cx="([\d.]+)" cy="([\d.]+)"', w.svg)
    assert len(circles) == 2 and abs(float(circles[1][0]) - x) < 0.01 and abs(float(circles[1][1]) - (top - y)) < 0.01
    assert figures.chain_text(w.state["chain"]) in html.unescape(w.svg)
    # the figure itself (save PNG / SVG) shows the same element
    assert (ax.lines[0].get_xdata()[0], ax.lines[0].get_ydata()[0]) == (200, 40)
    assert figures.chain_text(w.state["chain"]) == w.figure.texts[-1].get_text()


def test_a_redraw_pauses_the_garbage_collector_and_leaves_it_as_it_was():
    w = widgets.RowExplorer()
    seen = []
    draw = w._draw

    def spy():
        seen.append(gc.isenabled())
        return draw()

    w._draw = spy
    was = gc.isenabled()
    try:
        gc.enable()
        w.start.value = 8
        assert seen == [False] and gc.isenabled() and not is_error(w)
        w.shape.value = "not a shape"  # an error inside the redraw
        assert is_error(w) and len(seen) == 2 and gc.isenabled()
        gc.disable()
        w.shape.value = ""
        assert len(seen) == 3 and not gc.isenabled() and not is_error(w)
    finally:
        (gc.enable if was else gc.disable)()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_the_swizzled_buffer_shows_each_experts_scales_where_the_core_puts_them(fmt):
    """Coloured by scale value, the buffer panel holds the chosen expert's decoded scales at the offsets the
    core's map writes them to (the map applied to the checkpoint bytes, decoded), fill where it pads; the
    expert control changes it, and the index colourings show the source rows and columns."""
    from fimoe_lab.formats import QuantizedTensor
    from fimoe_lab.formats.health import decoded_scales

    layer = sources.sample_layer(fmt, experts=3, intermediate=96 if fmt == "mxfp8" else 128, hidden=256)
    w = widgets.TileExplorer(layer, backend="trtllm")
    assert w.colour_by.value == "scale value" and not w.expert.disabled and not w.atom.disabled
    m = w.state["plan"].w13_scale
    for e in (2, 1):
        w.expert.value = e
        kernel = m.apply(layer.moe.w13_scale[e : e + 1])[0].reshape(-1)  # the bytes the kernel reads
        want = decoded_scales(QuantizedTensor(None, kernel, None, fmt, 0)).float().numpy()
        buffer = figures.cells_of(w.figure)[id(w.figure.axes[2])][0].values.reshape(-1)
        fill = w.state["view"].src_row.reshape(-1) < 0
        assert np.array_equal(buffer[~fill], want[~fill]) and np.isnan(buffer[fill]).all()
    shown = w.svg
    w.colour_by.value = "source row"
    assert w.svg != shown and w.expert.disabled  # indices: the expert does not change them
    assert np.array_equal(figures.cells_of(w.figure)[id(w.figure.axes[2])][0].values, w.state["view"].src_row)
    w = widgets.TileExplorer(sources.sample_layer("bf16", experts=2), tensor="w13")  # 3-D tiles: indices only
    assert w.atom.disabled and w.expert.disabled and list(w.colour_by.options) == ["source column", "source row"]


def test_exports_fail_loudly_and_the_code_box_reproduces_the_view(tmp_path):
    """A save into a missing folder says so (nothing written, no "saved"); the code box's Python draws the view
    shown (the same texts and hover texts) and ends with the figure, so a notebook cell displays it."""
    w = widgets.TileExplorer(sources.sample_layer("nvfp4", experts=3, intermediate=128, hidden=256))
    w.expert.value, w.atom.value = 2, 1
    w.save_name.value = str(tmp_path / "missing" / "tiles")
    w._save_clicked("png")
    assert "does not exist" in message(w) and "(not saved)" in message(w) and "saved /" not in message(w)
    with pytest.raises(LayoutError, match="does not exist"):
        w.save("svg")
    assert not (tmp_path / "missing").exists() and w.figure is not None
    w._show_code()
    code = w.code_box.value
    assert code.rstrip().splitlines()[-1] == "fig" and w.code_box.layout.display is None
    scope: dict = {}
    exec(code, scope)
    assert svg_texts(figures.to_svg(scope["fig"])) == svg_texts(w.svg)


@pytest.mark.skipif(widgets.anywidget is None, reason="the copy button is an anywidget")
def test_the_copy_button_holds_the_code_of_the_figure_shown_and_says_what_the_browser_answered():
    w = widgets.RowExplorer()
    first = w.copy_button.code
    w.start.value, w.colour_by.value = 40, "shuffle block"
    assert w.copy_button.code == w._code_text() != first  # ready before a click: the browser writes it at once
    assert "(40, 104), 'shuffle block'" in w.copy_button.code
    assert w.code_box.layout.display == "none" and w.code_status.value == ""
    w.copy_button.clicked = ["copied", 1]  # what the page reports after navigator.clipboard.writeText
    assert w.code_box.layout.display is None and w.code_box.value == w.copy_button.code
    assert w.code_status.value.startswith("copied to the clipboard")
    w.copy_button.clicked = ["Write permission denied.", 2]  # refused: the code is still there to copy by hand
    assert "not copied: Write permission denied." in w.code_status.value and w.code_box.value == w.copy_button.code
    scope: dict = {}
    exec(w.copy_button.code, scope)
    assert svg_texts(figures.to_svg(scope["fig"])) == svg_texts(w.svg)
    w.shape.value = "bad"  # an error: no figure, nothing to copy
    assert is_error(w) and w.figure is None and w.copy_button.code == ""


@pytest.mark.parametrize("sample", ["deepseek-r1-nvfp4", "deepseek-v3-fp8", "gpt-oss-mxfp4", "mixtral-bf16"])
def test_a_tp_shard_of_an_expert_is_what_the_checkpoint_reader_gives_that_rank(sample):
    full = sources.load_layer(sample)
    checked = 0
    for tp in (2, 4):
        for rank in (0, tp - 1):
            try:
                reader = sources.load_layer(sample, None, tp, rank)
            except FimoeError:  # the reader refuses a shard that cuts a scale block: so does tp_shard
                with pytest.raises(LayoutError, match="cuts its stored elements or scale blocks"):
                    for name in full.tensors:
                        full.tp_shard(name, 1, tp, rank)
                continue
            if reader.intermediate * tp != full.intermediate:  # unequal shards (gpt-oss): not a plan's TP
                continue
            for name in full.tensors:
                shard, dead = full.tp_shard(name, 1, tp, rank)
                assert np.array_equal(shard, reader.magnitude(name, 1)), (tp, rank, name)
                assert np.array_equal(dead, reader.dead(name, 1)) and np.isfinite(shard).any()
                checked += 1
    assert checked >= 2 * len(full.tensors)


def test_the_ab_b_side_at_tp_2_draws_rank_0s_values():
    layer = sources.load_layer("deepseek-r1-nvfp4")
    w = widgets.CompareExplorer(layer)
    w.expert.value = 3
    shown_a = w.svg.split("</svg>")[0]
    w.tp_b.value = 2
    assert not is_error(w) and w.state["values_b"] and "TP rank 0 of 2" in w.svg
    fig_a, fig_b = w.figure.parts
    reader = sources.load_layer("deepseek-r1-nvfp4", None, 2, 0)  # what rank 0 of 2 reads from the checkpoint
    assert np.array_equal(fig_b._fimoe_rows["values"], reader.magnitude("w13", 3))
    assert fig_a._fimoe_rows["values"] is layer.magnitude("w13", 3)
    assert w.svg.split("</svg>")[0] == shown_a  # A's picture as it was: only B was drawn again
    scope: dict = {}
    exec(w.code(), scope)
    for drawn, mine in zip(scope["fig"].parts, (fig_a, fig_b)):
        assert drawn_pairs(drawn) == drawn_pairs(mine)
        assert np.array_equal(drawn.axes[2].images[0].get_array(), mine.axes[2].images[0].get_array())
