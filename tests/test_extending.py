"""Adding a format and a checkpoint convention, as docs/design.md's walkthroughs say: one row in each table.

A toy format ``toy8`` (one byte per value, one uint8 scale per 32 values, CUTLASS only: pad, then the W31
swap of weights and scales) and a toy convention ``toy-moe`` (``model.layers.{L}.moe.experts.{e}.{wg,wu,wd}``
``.weight`` / ``.scale``) are registered at run time into the four tables a new format and convention touch:

1. ``specs.FORMATS`` (the format's row),
2. ``shapes.BASE_ALIGNMENTS`` (its default padding; its padded sizes follow ``shapes.layer_shape``'s rule for
   vector-scaled formats, which every plan is checked against),
3. ``recipes.RECIPES`` (its steps and the function that composes the builders),
4. ``checkpoints.conventions.CONVENTIONS`` (its tensor names).

Then the normal entry points (``plan_layer``, ``shapes.padded_shape``, ``convert_checkpoint``,
``restore_checkpoint``) plan, convert and restore a small toy checkpoint: the converted tensors are checked
against a per-expert loop written here (pad each projection, then put up before gate), and the restored
checkpoint equals the source byte for byte.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from fimoe_lab import builders, recipes, shapes, specs
from fimoe_lab.caches import clear_caches
from fimoe_lab.checkpoints import MoELayer, conventions, convert_checkpoint, restore_checkpoint
from fimoe_lab.choice import LayerShape, LayoutChoice
from fimoe_lab.plan import LayerPlan

TOY = specs.FormatSpec(
    "toy8",
    "toy: one byte per value, a uint8 scale per 32 values",
    "uint8",
    scale_dtype="uint8",
    scale_block=32,
    vector_scaled=True,
    bits_per_weight=8.25,
    backends=("cutlass",),
    scale_fill=7,
)
TOY_CONVENTION = conventions.Convention(
    "toy-moe", "toy MoE (wg/wu/wd, uint8 values and scales)", "toy8", "moe.experts", ("wg", "wu", "wd"), "scale"
)
E, I, H = 3, 96, 64  # whole scale blocks; I pads to IP (the toy's default intermediate multiple 64), H stays
IP = 128


def toy_layer(layer: LayerShape, choice: LayoutChoice, swap: bool, padded: tuple[int, int]) -> LayerPlan:
    """The toy recipe from the existing builders: pad to ``padded`` (``shapes.layer_shape``'s sizes; scales with
    the format's byte), then the W31 swap."""
    ip, hp = padded
    pad = builders.plan_pad(
        layer.intermediate, layer.hidden, ip, hp, 1, layer.is_act_and_mul, scale_block=32, scale_fill=TOY.scale_fill
    )
    w13 = builders.chain(pad.w13, builders.swap_rows(2 * ip, hp, swap))
    s13 = builders.chain(pad.w13_scale, builders.swap_rows(2 * ip, hp // 32, swap))
    return LayerPlan(w13, pad.w2, s13, pad.w2_scale, layer.intermediate, layer.hidden, ip, hp, "toy8 CUTLASS")


@pytest.fixture
def registered(monkeypatch):
    """The four rows, registered for one test and removed after it."""
    monkeypatch.setitem(specs.FORMATS, "toy8", TOY)
    monkeypatch.setitem(shapes.BASE_ALIGNMENTS, "toy8", lambda trt, p, gated: (64, 32))
    steps = ("pad_projections", "swap_w13_to_w31_rows")
    monkeypatch.setitem(
        recipes.RECIPES, "toy8/cutlass", recipes.Recipe("toy8", "cutlass", steps, steps, "I 64", toy_layer)
    )
    monkeypatch.setattr(conventions, "CONVENTIONS", (*conventions.CONVENTIONS, TOY_CONVENTION))
    yield
    clear_caches()  # plans are cached by their arguments: none of the toy's outlives its rows


def coded(shape: tuple[int, ...], salt: int) -> torch.Tensor:
    """Bytes that encode their own coordinates (mixed, so that any misplaced byte shows)."""
    idx = torch.arange(torch.Size(shape).numel(), dtype=torch.int64).reshape(shape)
    return ((idx * 131 + salt * 17 + idx // 251) % 251 + 1).to(torch.uint8)


def write_toy_checkpoint(root, layer: MoELayer):
    root.mkdir()
    tensors = TOY_CONVENTION.to_tensors("model.layers.", 0, layer)
    tensors["model.layers.0.moe.gate.weight"] = torch.randn(E, H, generator=torch.Generator().manual_seed(3))
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(root / "model.safetensors"))
    config = dict(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=2, num_hidden_layers=1)
    (root / "config.json").write_text(json.dumps(config))


def expected_w13(w13: torch.Tensor, rows: int, cols: int, fill: int) -> torch.Tensor:
    """Per expert: pad gate and up each to ``rows`` x ``cols`` with ``fill``, then stack ``[up; gate]``."""
    out = []
    for x in w13:
        gate, up = x[: x.shape[0] // 2], x[x.shape[0] // 2 :]
        padded = []
        for half in (up, gate):
            p = torch.full((rows, cols), fill, dtype=torch.uint8)
            p[: half.shape[0], : half.shape[1]] = half
            padded.append(p)
        out.append(torch.cat(padded))
    return torch.stack(out)


def test_the_toy_format_and_convention_plan_convert_and_restore(registered, tmp_path):
    assert shapes.padded_shape("toy8", "cutlass", I, H) == (IP, H)
    plan = recipes.plan_layer("toy8", "cutlass", I, H)
    assert (plan.padded_intermediate, plan.padded_hidden) == (IP, H)
    assert [s["kind"] for s in plan.tensor_steps("w13")] == ["pad_projections", "swap_w13_to_w31_rows"]

    layer = MoELayer(
        "toy8",
        coded((E, 2 * I, H), 1),
        coded((E, H, I), 2),
        coded((E, 2 * I, H // 32), 3),
        coded((E, H, I // 32), 4),
        I,
        H,
        convention="toy-moe",
    )
    src = tmp_path / "toy"
    write_toy_checkpoint(src, layer)
    out = convert_checkpoint(src, tmp_path / "toy-kernel", "cutlass")
    kernel = {}
    for f in out.glob("*.safetensors") if out.is_dir() else [out]:
        kernel.update(load_file(f))
    by_shape = {tuple(t.shape): t for t in kernel.values() if t.dim() == 3}
    assert torch.equal(by_shape[(E, 2 * IP, H)], expected_w13(layer.w13, IP, H, 0))
    assert torch.equal(by_shape[(E, 2 * IP, H // 32)], expected_w13(layer.w13_scale, IP, H // 32, TOY.scale_fill))

    back = restore_checkpoint(out, tmp_path / "toy-back")
    source = load_file(src / "model.safetensors")
    restored = {}
    for f in back.glob("*.safetensors") if back.is_dir() else [back]:
        restored.update(load_file(f))
    assert sorted(restored) == sorted(source)
    for name, t in source.items():
        assert restored[name].dtype == t.dtype and torch.equal(restored[name].view(torch.uint8), t.view(torch.uint8))


def test_without_the_rows_the_toy_format_is_refused(tmp_path):
    """Before registration (or after it is undone) nothing knows the toy: the rows are what make it work."""
    clear_caches()
    with pytest.raises(ValueError, match="toy8"):
        recipes.plan_layer("toy8", "cutlass", I, H)
    assert "toy-moe" not in {c.name for c in conventions.CONVENTIONS}
    assert "toy8" not in specs.FORMATS and "toy8" not in shapes.BASE_ALIGNMENTS
