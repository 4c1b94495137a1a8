"""The lab's figures are legible and honest at any size: fonts, units, theme, markers, windows.

Expected values are written out here (numpy, DESIGN §3 formulas, planted NaN/Inf/dead
scales), not read from the code under test.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

pytest.importorskip("matplotlib")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from fimoe_lab import prepare, steps  # noqa: E402
from fimoe_lab.formats.health import TINY_SCALE  # noqa: E402
from fimoe_lab.viz import data, figures, sources  # noqa: E402
from tests.test_viz import ref_swizzle_offset, ref_w13_rows  # noqa: E402


def all_figures():
    plan = prepare.plan_layer("mxfp8", "trtllm", 96, 256)
    layer = sources.sample_layer("mxfp8", experts=2, intermediate=96, hidden=256)
    v = layer.magnitude("w13", 1)
    s = layer.magnitude("w13_scale", 1)
    return {
        "rows": figures.row_permutation_figure(plan.w13, values=v, dead=layer.dead("w13", 1)),
        "swizzle": figures.swizzle_figure(plan.w13_scale, atom=1),
        "tiles": figures.tile_figure(steps.block_major_k(64, 256, 128), 2),
        "padding": figures.padding_figure(data.padding_report("nvfp4", "trtllm", 768, 2048, tp=8, experts=4)),
        "provenance": figures.provenance_figure(plan.w13, (5, 17), v),
        "compare": figures.compare_figure(plan.w13_scale, s, data.gather_values(plan.w13_scale, s)),
    }


def test_no_text_below_the_minimum_and_every_heatmap_has_a_labelled_colourbar():
    for name, fig in all_figures().items():
        texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
        small = sorted({(t.get_fontsize(), t.get_text()[:30]) for t in texts if t.get_fontsize() < figures.MIN_FONT})
        assert not small, f"{name}: text below {figures.MIN_FONT} pt: {small[:3]}"
        bars = [ax for ax in fig.axes if hasattr(ax, "_colorbar")]
        heatmaps = [ax for ax in fig.axes if ax.images and not hasattr(ax, "_colorbar")]
        if name != "padding":  # masks: a data/padding legend instead
            assert len(bars) >= len(heatmaps), name
        for bar in bars:
            label = bar.get_ylabel() or bar.get_xlabel()
            assert re.search(r"\(.+\)", label), f"{name}: colourbar {label!r} has no unit"


def test_svg_is_vector_theme_aware_with_hover_text():
    fig = all_figures()["rows"]
    svg = figures.to_svg(fig)
    assert svg.startswith("<svg") and "#000000" not in svg and 'fill="currentColor"' in svg
    assert re.search(r'width="[\d.]+pt"', svg) and "<text" in svg  # natural size; text stays text
    titles = re.findall(r"<title>([^<]*)</title>", svg)
    flow = data.row_flow(prepare.plan_layer("mxfp8", "trtllm", 96, 256).w13)
    assert f"checkpoint row {flow.src_rows[0]} (up) -&gt; kernel row 0" in titles[0]
    assert len(titles) == 64
    png = figures.to_png(fig)
    width = int.from_bytes(png[16:20], "big")
    assert png[:4] == b"\x89PNG" and width == round(fig.get_size_inches()[0] * 200)


def test_value_views_mark_padding_nan_inf_and_dead_scales():
    plan = prepare.plan_layer("mxfp8", "trtllm", 96, 256)
    layer = sources.sample_layer("mxfp8", experts=2, intermediate=96, hidden=256)
    v = layer.magnitude("w13", 0).copy()
    v[3, 7], v[100, 9] = np.nan, np.inf
    dead = np.zeros(v.shape, bool)
    dead[10, :32] = True  # one dead 32-wide block
    fig = figures.provenance_figure(plan.w13, (0, 0), v, dead=dead)
    overlay = fig.axes[0].images[1].get_array()
    assert tuple(overlay[3, 7]) == to_rgba(figures.FLAG_COLOURS["NaN"])
    assert tuple(overlay[100, 9]) == to_rgba(figures.FLAG_COLOURS["Inf"])
    assert all(tuple(overlay[10, c]) == to_rgba(figures.FLAG_COLOURS["dead scale"]) for c in range(32))
    assert (overlay[:, :, 3] > 0).sum() == 34
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["dead scale: 32", "Inf: 1", "NaN: 1"]
    kernel_legend = [t.get_text() for t in fig.axes[2].get_legend().get_texts()]
    assert kernel_legend == [f"padding: {2 * 32 * 256:,}", "dead scale: 32", "Inf: 1", "NaN: 1"]


def test_dead_scales_are_read_off_the_layer():
    layer = sources.sample_layer("nvfp4", experts=2, intermediate=64, hidden=128)
    layer.moe.w13_scale[1, 5, 2] = 0  # E4M3 zero: a dead block of 16 values = 8 packed bytes
    dead = layer.dead("w13", 1)
    assert dead.shape == layer.magnitude("w13", 1).shape
    assert dead[5, 16:24].all() and dead.sum() == 8 and not layer.dead("w13", 0).any()
    assert layer.dead("w13_scale", 1).sum() == 1 and layer.magnitude("w13_scale", 1)[5, 2] < TINY_SCALE


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 1300), cols=st.integers(1, 1300), side=st.sampled_from([8, 64, 512]), seed=st.integers(0, 9))
def test_downsample_keeps_the_largest_value_and_the_worst_flag(rows, cols, side, seed):
    rng = np.random.default_rng(seed)
    v = rng.random((rows, cols)) + np.arange(rows)[:, None] * 1e-3  # bytes encode their row
    flags = np.zeros((rows, cols), np.uint8)
    r, c = rng.integers(rows), rng.integers(cols)
    v[r, c], flags[r, c] = np.nan, data.FLAG_NAMES.index("NaN")
    small = data.downsample(v, flags, side)
    fr, fc = -(-rows // side), -(-cols // side)
    assert small.block == (fr, fc) and small.values.shape == (-(-rows // fr), -(-cols // fc))
    assert max(small.values.shape) <= side
    i, j = rng.integers(small.values.shape[0]), rng.integers(small.values.shape[1])
    block = v[i * fr : (i + 1) * fr, j * fc : (j + 1) * fc]
    expect = np.nanmax(block) if np.isfinite(block).any() else np.nan
    assert np.array_equal(small.values[i, j], expect, equal_nan=True)
    assert small.flags[r // fr, c // fc] == data.FLAG_NAMES.index("NaN") and small.flags.sum() == small.flags.max()


def test_row_window_keeps_both_sides_visible_after_a_swap_offset():
    plan = prepare.plan_layer("nvfp4", "trtllm", 256, 256)  # swap by 256 rows, shuffle blocks of 32
    flow = data.row_flow(plan.w13)
    ref = ref_w13_rows(256, 256)
    win = data.row_window(flow, 0, 32, "kernel")
    assert [tuple(p) for p in win.pairs] == [(int(ref[k]), k) for k in range(32)]
    assert len(win.ckpt_rows) == 32 and win.ckpt_rows.max() - win.ckpt_rows.min() > 200  # gate and up rows
    cpos, kpos = win.positions()
    assert sorted(cpos) == list(range(32)) and list(kpos) == list(range(32))
    assert list(data.RowWindow.gaps(win.ckpt_rows)) == [16]  # one jump: gate rows 0..15, then up rows 256..
    back = data.row_window(flow, 256, 272, "checkpoint")  # up rows 0..15 -> where they land
    assert sorted(tuple(p) for p in back.pairs) == sorted(
        (int(ref[k]), k) for k in np.flatnonzero((ref >= 256) & (ref < 272))
    )
    fig = figures.row_permutation_figure(plan.w13, window=(256, 272), side="checkpoint")
    ys = [l.get_ydata() for l in fig.axes[0].lines if len(l.get_xdata()) == 2 and l.get_linestyle() == "-"]
    assert len(ys) == 16 and all(0 <= y <= 1 for pair in ys for y in pair)
    with pytest.raises(data.LayoutError, match="'kernel' or 'checkpoint'"):
        data.row_window(flow, 0, 8, "middle")


def test_swizzle_view_names_the_kernel_row_of_every_buffer_scale():
    m = compose_rows_then_swizzle = prepare.plan_layer("mxfp8", "trtllm", 96, 256).w13_scale
    view = data.swizzle_view(compose_rows_then_swizzle)
    rows, cols = m.steps[-1].in_shape[0], m.steps[-1].in_shape[1]
    offsets = ref_swizzle_offset(view.kernel_row.reshape(-1), view.kernel_col.reshape(-1), cols)
    assert np.array_equal(offsets, np.arange(view.kernel_row.size))  # buffer offset of (kernel row, col)
    assert view.kernel_row.max() == rows - 1


def test_real_size_views_are_reduced_with_axes_in_elements():
    plan = prepare.plan_layer("nvfp4", "trtllm", 2048, 7168)  # DeepSeek-R1 shapes per expert
    g = torch.Generator().manual_seed(0)
    v = torch.rand((4096, 3584), generator=g).double().numpy()
    fig = figures.row_permutation_figure(plan.w13, window=(2048, 2112), values=v)
    every = fig.axes[1]
    assert every.images and every.images[0].get_array().shape[:2] == (512, 512)
    moved = fig.axes[2].images[0]
    assert moved.get_array().shape == (64, 512) and tuple(moved.get_extent()) == (-0.5, 3583.5, 63.5, -0.5)
    src = data.row_flow(plan.w13).src_rows[2048:2112]
    expect = v[src].reshape(64, 512, 7).max(axis=2)
    assert np.allclose(np.ma.filled(moved.get_array(), np.nan), expect)
