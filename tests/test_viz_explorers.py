"""The explorers as instruments: your own checkpoint, typed shapes, recovery from errors,
export, the tuner's controls and frontier, and cached redraws."""

from __future__ import annotations

import html
import importlib.util
import re

import numpy as np
import pytest
import torch

pytest.importorskip("ipywidgets")
pytest.importorskip("matplotlib")

from fimoe_lab import prepare, resources  # noqa: E402
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
    assert svg.read_text() == w.svg
    scope: dict = {}
    exec(w.code(), scope)
    assert drawn_pairs(scope["fig"]) == drawn_pairs(w.figure)
    assert np.array_equal(scope["fig"].axes[2].images[0].get_array(), w.figure.axes[2].images[0].get_array())
    pad = widgets.PaddingExplorer(intermediate=384, hidden=512, experts=4, fmt="fp8", tp=2)
    scope = {}
    exec(pad.code(), scope)
    assert scope["report"].summary() == pad.state["report"].summary()


def test_redraws_are_cached_per_setting():
    w = widgets.TileExplorer()
    first = w.figure
    w.atom.value = 2
    assert w.figure is not first
    w.atom.value = 0
    assert w.figure is first and w.state["atom"] == 0


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
    assert w.svg.count("<svg") == 2
    scope: dict = {}
    exec(w.code(), scope)
    assert drawn_pairs(scope["fig"].parts[1]) == drawn_pairs(fig_b)
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
