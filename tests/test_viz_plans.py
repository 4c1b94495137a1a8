"""Every layout the CLI can write, in the lab: the activation dtype (MXFP4 x BF16, the SM90 mixed
layout with its word bit step) and the NVFP4 per-token switch on every layer explorer and both
sides of the A/B compare; and a figure that does not depend on the path taken to its state."""

from __future__ import annotations

import html
import re

import numpy as np
import pytest
import torch

pytest.importorskip("ipywidgets")
pytest.importorskip("matplotlib")

from fimoe_lab import prepare, recipes  # noqa: E402
from fimoe_lab.checkpoints import MoELayer  # noqa: E402
from fimoe_lab.viz import data, sources, widgets  # noqa: E402
from tests.test_viz_explorers import is_error, svg_point  # noqa: E402


@pytest.fixture(scope="module")
def mxfp4():
    return sources.sample_layer("mxfp4", experts=2, intermediate=128, hidden=256)


def test_the_activation_dtype_is_offered_from_the_table_and_reaches_the_plan(mxfp4):
    w = widgets.RowExplorer(mxfp4, backend="trtllm")
    assert w.activation.disabled and w.activation.options == ("default",)  # one layout on TRT-LLM
    w.backend.value = "cutlass"
    assert tuple(w.activation.options) == recipes.ACTIVATION_DTYPES["mxfp4/cutlass"] and not w.activation.disabled
    assert w.state["plan"].word_bits == {} and "bit permutation" not in w.message.value
    w.activation.value = "bf16"
    want = prepare.plan_layer("mxfp4", "cutlass", 128, 256, activation_dtype="bf16")
    plan = w.state["plan"]
    assert not is_error(w) and plan.tensor_steps("w13") == want.tensor_steps("w13")
    assert "w13" in plan.word_bits and "bit permutation on every 32-bit word" in w.message.value
    assert np.array_equal(w.state["flow"].src_rows, data.row_flow(want.w13).src_rows)  # the byte map's rows drawn
    assert "activation_dtype" not in w.code() and "'bf16'" in w.code()
    w.backend.value = "trtllm"  # a backend without the choice: the default layout, the control disabled
    assert not is_error(w) and w.activation.disabled and w.state["activation_dtype"] is None


def test_a_click_on_a_kernel_byte_gives_the_checkpoint_bit_of_each_of_its_bits(mxfp4):
    """Oracle: the plan run by the executors (byte map then word bits) on random bytes; every bit
    of the clicked kernel byte must equal the checkpoint bit the trace names."""
    w = widgets.ProvenanceExplorer(mxfp4, backend="cutlass")
    w.activation.value = "bf16"
    plan = w.state["plan"]
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 256, (1, *plan.w13.in_shape), generator=g, dtype=torch.uint8)
    y = plan.apply_tensor("w13", x)[0].reshape(plan.w13.out_shape).numpy()
    kernel_ax = w.figure.axes[2]
    for row, col in ((5, 3), (130, 77), (255, 127)):
        trace = w.click(*svg_point(kernel_ax, col, row))
        assert trace is not None and trace.kernel == (row, col) and trace.bits is not None
        for b, (where, bit) in enumerate(trace.bits):
            assert where is not None and (int(y[row, col]) >> b) & 1 == (int(x[0][where]) >> bit) & 1
        assert "high nibble (bits 4-7) <- checkpoint" in html.unescape(w.message.value)
    # one byte equals steps.WordBitMap.source_bits (the plan's own bit tracer)
    from fimoe_lab.steps import WordBitMap

    src = WordBitMap(plan.w13, plan.word_bits["w13"]).source_bits()
    cols = plan.w13.in_shape[-1]
    flat = 130 * plan.w13.out_shape[-1] + 77
    want = [(divmod(int(s) // 8, cols), int(s) % 8) for s in src[flat * 8 : flat * 8 + 8]]
    assert data.word_bit_sources(plan.w13, plan.word_bits["w13"], flat) == want


def nvfp4_not_gated() -> sources.ExpertTensors:
    """A non-gated NVFP4 layer (where per-token activations change TRT-LLM's hidden padding)."""
    g = torch.Generator().manual_seed(5)
    w13 = torch.randint(0, 256, (2, 128, 128), generator=g, dtype=torch.uint8)
    w2 = torch.randint(0, 256, (2, 256, 64), generator=g, dtype=torch.uint8)

    def scales(rows: int, cols: int) -> torch.Tensor:
        return torch.randint(0x20, 0x48, (2, rows, cols // 16), generator=g, dtype=torch.uint8).view(
            torch.float8_e4m3fn
        )

    extras = {"w13_weight_scale_2": torch.full((2, 2), 1e-3), "w2_weight_scale_2": torch.full((2,), 1e-3)}
    moe = MoELayer("nvfp4", w13, w2, scales(128, 256), scales(256, 128), 128, 256, extras=extras, is_act_and_mul=False)
    return sources.ExpertTensors(moe, "random non-gated nvfp4")


def test_the_per_token_switch_reaches_the_plan_where_the_format_allows_it(mxfp4):
    layer = nvfp4_not_gated()
    w = widgets.RowExplorer(layer, backend="trtllm", tensor="w2")
    assert not w.per_token.disabled and w.state["plan"].padded_hidden == 256
    w.per_token.value = True
    want = prepare.plan_layer("nvfp4", "trtllm", 128, 256, False, False, per_token_activation=True)
    assert not is_error(w) and w.state["per_token"] and w.state["plan"].padded_hidden == want.padded_hidden == 512
    assert w.state["plan"].tensor_steps("w2") == want.tensor_steps("w2")
    assert w.state["flow"].out_rows == 512  # the padded rows are drawn
    assert widgets.RowExplorer(mxfp4).per_token.disabled  # MXFP4 has no per-token activations


def test_both_sides_of_the_ab_compare_take_the_activation_dtype(mxfp4):
    w = widgets.CompareExplorer(mxfp4, backend="cutlass")
    assert tuple(w.activation_b.options) == recipes.ACTIVATION_DTYPES["mxfp4/cutlass"]
    w.activation_b.value = "bf16"
    a, b = w.state["a"], w.state["b"]
    assert not is_error(w) and a.word_bits == {} and "w13" in b.word_bits
    assert "interleave_sm90_mixed_weights" in w.message.value and "B then sm90_mixed_word_bits" in w.message.value
    w.activation.value = "bf16"
    assert "A then sm90_mixed_word_bits" in w.message.value and "same steps" not in w.message.value


def normal(svg: str) -> str:
    """An SVG without its ids (clip paths, hover groups): what two drawings of one state share."""
    svg = re.sub(r'\s(?:id|clip-path|xlink:href|href)="[^"]*"', "", svg)
    return re.sub(r"url\(#[^)]*\)", "url()", svg)


@pytest.mark.parametrize("kind", ["rows", "tiles", "provenance"])
def test_the_figure_of_a_state_does_not_depend_on_the_path_taken_to_it(kind):
    layer = sources.sample_layer("nvfp4", experts=4, intermediate=128, hidden=256)
    make = {
        "rows": lambda: widgets.RowExplorer(layer),
        "tiles": lambda: widgets.TileExplorer(layer),
        "provenance": lambda: widgets.ProvenanceExplorer(layer),
    }[kind]
    tensors = {"rows": ("w13", "w2"), "tiles": ("w13_scale", "w2_scale"), "provenance": ("w13", "w2_scale")}[kind]
    direct = make()
    direct.expert.value = 2
    if kind == "rows":
        direct.start.value = 64
    walked = make()
    walked.tensor.value = tensors[1]
    for e in (1, 3, 2):
        walked.expert.value = e
    if kind == "rows":
        walked.start.value = 64
        walked.colour_by.value = "shuffle block"
        walked.side.value = "checkpoint"
    walked.tensor.value = tensors[0]
    walked.expert.value = 0
    walked.expert.value = 2
    if kind == "rows":
        walked.colour_by.value = "origin"
        walked.side.value = "kernel"
    assert walked.state["expert"] == direct.state["expert"] == 2 and not is_error(walked)
    assert normal(walked.svg) == normal(direct.svg)
    walked.expert.value = 0  # back to an expert whose layer is kept: the kept layer is the same drawing
    walked.expert.value = 2
    assert normal(walked.svg) == normal(direct.svg)
    fresh = make()  # the state drawn first by a figure that never showed another one
    fresh._busy = True
    fresh.expert.value = 2
    if kind == "rows":
        fresh.start.value = 64
    fresh._busy = False
    for kept in (fresh._drawn, fresh._layers, getattr(fresh, "_static", {})):
        kept.clear()
    fresh.refresh()
    assert fresh.state["expert"] == 2 and normal(fresh.svg) == normal(direct.svg)


def test_per_token_activations_say_when_the_weight_layout_stays():
    """Where per-token NVFP4 activations plan the same weight steps as per-tensor ones, the figure cannot change:
    the message says so (and says nothing when the box is off)."""
    w = widgets.RowExplorer(sources.sample_layer("nvfp4", experts=2, intermediate=128, hidden=256))
    assert "per-token activations" not in w.message.value
    w.per_token.value = True
    plan, per_tensor = w.state["plan"], w.layer.plan("trtllm", None, False)
    same = all(
        [(s.kind, s.params) for s in plan.maps()[n].steps] == [(s.kind, s.params) for s in m.steps]
        for n, m in per_tensor.maps().items()
    )
    assert same == ("the same weight layout as per-tensor on trtllm" in w.message.value)
