"""The explorers respond: changing a control changes the plotted data, as the maps say."""

from __future__ import annotations

import html
import importlib.util

import numpy as np
import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("matplotlib")

from fimoe_lab import prepare, recipes  # noqa: E402
from fimoe_lab.viz import data, sources, widgets  # noqa: E402
from tests.test_viz import drawn_pairs  # noqa: E402


def image(fig, axis: int) -> np.ndarray:
    return np.ma.filled(fig.axes[axis].images[0].get_array().astype(float), np.nan)


def same(drawn: np.ndarray, sources_: np.ndarray) -> bool:
    """A drawn source array (fill masked -> NaN) equals a data array (fill = -1; a lazy grid built whole)."""
    a = np.asarray(sources_)
    return bool(np.array_equal(drawn, np.where(a < 0, np.nan, a), equal_nan=True))


def test_row_explorer_window_colour_and_expert():
    w = widgets.RowExplorer()
    assert w.svg.startswith("<svg") and w.view.value == w.svg
    flow = w.state["flow"]
    assert np.array_equal(flow.src_rows, data.row_flow(prepare.plan_layer("mxfp8", "trtllm", 96, 256).w13).src_rows)

    first = w.svg
    w.colour_by.value = "shuffle block"
    assert w.svg != first
    legend = [t.get_text() for t in w.figure.axes[1].get_legend().get_texts()]
    assert legend[:2] == ["shuffle block 0", "shuffle block 1"]

    w.start.value = 64
    assert w.state["window"] == (64, 128)
    assert drawn_pairs(w.figure) == [(int(flow.src_rows[d]), d) for d in range(64, 128) if flow.src_rows[d] >= 0]

    before = image(w.figure, 2)
    w.expert.value = 3
    after = image(w.figure, 2)
    layer = sources.sample_layer("mxfp8", experts=4, intermediate=96, hidden=256)
    expect = data.gather_values(w.state["plan"].w13.row_steps(), layer.magnitude("w13", 3))[64:128]
    assert np.allclose(after, expect, equal_nan=True)
    assert np.nanmean(after) > 1.5 * np.nanmean(before)  # expert 3 is 4x expert 0


def test_row_explorer_on_a_given_layer():
    layer = sources.sample_layer("nvfp4", experts=2, intermediate=128, hidden=256)
    w = widgets.RowExplorer(layer)
    assert w.source.disabled and w.expert.max == 1
    assert "NVFP4 TRT-LLM" in w.message.value
    w.tensor.value = "w2"
    assert w.state["flow"].projections == 1 and w.state["flow"].out_rows == 256


def test_tile_explorer_atoms_and_tiles():
    w = widgets.TileExplorer()
    view = w.state["view"]
    assert list(w.tensor.options) == ["w13_scale", "w2_scale"] and w.atom.max == view.atoms - 1
    w.atom.value = 2
    zoom = view.src_col[64:96]
    assert same(image(w.figure, 4), np.where(zoom >= 0, zoom % 10, -1))
    w.source.value = "seeded:bf16"
    assert list(w.tensor.options) == ["w13", "w2"]
    assert w.state["tensor"] == "w13"
    tiles = data.tile_view(w.state["plan"].w13, 2)
    assert same(image(w.figure, 2), tiles.src_col)
    w.colour_by.value = "source row"
    assert same(image(w.figure, 2), tiles.src_row)


def test_every_weight_format_has_a_seeded_layer():
    from fimoe_lab import specs

    assert [k for _, k in widgets.layer_choices() if k.startswith("seeded:")] == [
        f"seeded:{f}" for f in specs.weight_formats()
    ]
    w = widgets.TileExplorer()
    assert list(w.backend.options) == list(specs.BACKENDS)
    w.source.value = "seeded:mxfp4"
    # MXFP4 TRT-LLM: intermediate 96 -> round_up(96, default alignment); w13 scales 2*I' rows x 256/32 columns
    align = recipes.default_alignments("mxfp4", "trtllm")[0]
    atoms = 2 * (-(-96 // align) * align) // 128 * (256 // 32 // 4)
    assert w.state["fmt"] == "mxfp4" and w.state["view"].atoms == atoms and w.atom.max == atoms - 1
    w.colour_by.value = "source row"
    assert same(image(w.figure, 2), w.state["view"].src_row)
    assert np.nanmax(image(w.figure, 2)) == 2 * 96 - 1  # every checkpoint scale row lands somewhere


def test_padding_explorer_tp_and_errors():
    w = widgets.PaddingExplorer(intermediate=384, hidden=512, experts=4, fmt="fp8", tp=1)
    assert w.state["report"].local_intermediate == 384
    first = w.svg
    w.tp.value = 8
    report = w.state["report"]
    assert report.local_intermediate == 48 and report.plan.padded_intermediate == 48
    assert w.svg != first
    w.inter_align.value = 128
    assert w.state["report"].plan.padded_intermediate == 128 and w.state["report"].fill_bytes > 0
    shown = w.figure
    w.intermediate.value = 390
    assert "does not split into 8 tensor-parallel shards" in w.message.value
    assert w.figure is None and "fimoe-error" in w.view.value  # no figure of another setting stays on screen
    w.intermediate.value = 384
    assert w.figure is shown
    for box in (w.experts, w.intermediate, w.hidden):
        box.value, kept = 0, box.value
        assert w.figure is None and f"{box.description} 0" in w.message.value
        box.value = kept


def test_provenance_explorer_follows_the_chosen_element():
    w = widgets.ProvenanceExplorer()
    w.row.value, w.col.value = 40, 200
    m = w.state["plan"].w13
    assert w.state["coords"] == (40, 200)
    assert w.state["chain"][-1][2] == m.provenance((40, 200)).source
    ax = w.figure.axes[2]
    assert (ax.lines[0].get_xdata()[0], ax.lines[0].get_ydata()[0]) == (200, 40)
    w.tensor.value = "w13_scale"
    assert w.state["coords"][0] < 256 and w.state["coords"][1] < 8


@pytest.mark.skipif(importlib.util.find_spec("fimoe_lab.tune") is not None, reason="the tuner is installed")
def test_tuner_explorer_explains_a_missing_tuner():
    w = widgets.TunerExplorer()
    assert "fimoe_lab.tune" in w.message.value and w.figure is None


@pytest.mark.skipif(importlib.util.find_spec("fimoe_lab.tune") is None, reason="the tuner is not installed")
def test_tuner_explorer_draws_the_snapshot_sweep():
    pytest.importorskip("pandas")
    w = widgets.TunerExplorer("gpt-oss-120b", "fp8", 8)
    w.view_kind.value = "tactics heatmap"
    sweep = w.state["sweep"]
    grid = sweep.pivot(index="inter_align", columns="hidden_align", values="min_tactics").to_numpy(dtype=float)
    assert np.array_equal(image(w.figure, 0), grid)
    rec = sweep[sweep["recommended"]].iloc[0]
    assert f"intermediate {int(rec.intermediate)} (align {int(rec.inter_align)})" in w.message.value
    first = w.svg
    w.tp.value = 2
    assert w.state["sweep"].attrs["tp"] == 2 and w.svg != first


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8-block"])
def test_tuner_explorer_explains_a_shard_convert_refuses_in_place_of_the_figure(fmt):
    """gpt-oss-120b at TP 8: 360 rows per rank cut a scale block; the tuner sweeps nothing and says why, as the
    CLI does, and no figure of another setting stays on screen."""
    pytest.importorskip("pandas")
    w = widgets.TunerExplorer("gpt-oss-120b", fmt, 4)
    w.tp.value = 8
    assert w.state["sweep"].empty and w.figure is None and "fimoe-error" in w.view.value
    assert "nothing to tune" in w.message.value
    assert html.escape(w.state["sweep"].attrs["no_recommendation"]) in w.message.value
    assert "predicted_us" not in w.message.value
    w.tp.value = 1
    assert w.figure is not None


def test_explorers_on_a_shipped_sample_checkpoint():
    checkpoints = pytest.importorskip("fimoe_lab.checkpoints")
    if "deepseek-r1-nvfp4" not in checkpoints.sample_names():
        pytest.skip("sample checkpoints are not in this checkout")
    w = widgets.RowExplorer()
    w.source.value = "sample:deepseek-r1-nvfp4"
    layer = w.state["layer"]
    assert layer.fmt == "nvfp4" and w.expert.max == layer.experts - 1
    kernel, plan, _ = checkpoints.convert_layer(layer.moe, checkpoints.LayoutChoice("trtllm"))
    assert plan.w13 == w.state["plan"].w13  # the lab draws the plan the converter applies
    observed = data.observed_row_sources(
        layer.moe.w13[2], next(t for n, t in kernel.items() if "w13" in n and "scale" not in n)[2]
    )
    assert np.array_equal(observed, w.state["flow"].src_rows)
    pad = widgets.PaddingExplorer.from_layer(layer, tp=2)  # 320 / 2 = 160 -> 192, the NVFP4 TRT-LLM default (64)
    assert "padded 192" in pad.message.value and pad.figure is not None
    pad.inter_align.value = 16  # 2*160 scale rows: not whole 128-row atoms
    assert "not a multiple of 128" in pad.message.value and "figure cleared" in pad.message.value
    assert pad.figure is None and "fimoe-error" in pad.view.value
    pad.inter_align.value = 64
    report = pad.state["report"]
    assert (report.local_intermediate, report.plan.padded_intermediate, report.experts) == (160, 192, layer.experts)
    w.expert.value = 2
    magnitude = layer.magnitude("w13", 2)
    assert magnitude.shape == tuple(layer.moe.w13.shape[1:]) and magnitude.max() > 0
