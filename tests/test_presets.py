"""Model presets: numbers as checked against the models' config.json (see fimoe_lab/presets.py)."""

import dataclasses

import pytest

from fimoe_lab.errors import FormatError
from fimoe_lab.presets import PRESETS, ModelPreset, get_preset
from fimoe_lab.specs import ACTIVATIONS, tuner_formats, weight_formats

# (hidden, moe_intermediate, experts, top_k, activation) from the config.json files cited
# in presets.py.
EXPECTED = {
    "deepseek-v3": (7168, 2048, 256, 8, "swiglu"),
    "kimi-k2": (7168, 2048, 384, 8, "swiglu"),
    "qwen3-30b-a3b": (2048, 768, 128, 8, "swiglu"),
    "qwen3-235b-a22b": (4096, 1536, 128, 8, "swiglu"),
    "gpt-oss-20b": (2880, 2880, 32, 4, "swiglu"),
    "gpt-oss-120b": (2880, 2880, 128, 4, "swiglu"),
    "mixtral-8x7b": (4096, 14336, 8, 2, "swiglu"),
    "llama4-scout": (5120, 8192, 16, 1, "swiglu"),
    "llama4-maverick": (5120, 8192, 128, 1, "swiglu"),
    "nemotron3-nano": (2688, 1856, 128, 6, "relu2"),
    "nemotron3-super": (1024, 2688, 512, 22, "relu2"),
    "glm-4.5": (5120, 1536, 160, 8, "swiglu"),
    "minimax-m2": (3072, 1536, 256, 8, "swiglu"),
    "gemma4-26b-a4b": (2816, 704, 128, 8, "geglu"),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_numbers(name):
    p = get_preset(name)
    assert (p.hidden, p.moe_intermediate, p.experts, p.top_k, p.activation) == EXPECTED[name]
    assert p.source, "every preset cites where its numbers come from"


def test_all_presets_checked():
    assert set(PRESETS) == set(EXPECTED)


@pytest.mark.parametrize("p", PRESETS.values(), ids=lambda p: p.name)
def test_preset_formats_and_activation_are_known(p):
    assert p.activation in ACTIVATIONS
    assert p.is_gated == (p.activation != "relu2")
    for f in p.serving_formats:
        assert f in tuner_formats(), f
    for f in p.checkpoint_formats:
        assert f in weight_formats(), f
    assert p.serving_formats


@pytest.mark.parametrize(
    "field, value, msg",
    [
        ("activation", "tanh", r"unknown activation 'tanh' \(fix: choose one of swiglu"),
        ("serving_formats", ("nvfp4", "int4"), r"unknown serving format\(s\) int4 \(fix: choose from bf16"),
        ("checkpoint_formats", ("mxfp4-mxfp8",), r"unknown checkpoint format\(s\) mxfp4-mxfp8"),
    ],
)
def test_a_preset_names_only_known_activations_and_formats(field, value, msg):
    with pytest.raises(FormatError, match=msg):
        dataclasses.replace(get_preset("qwen3-30b-a3b"), **{field: value})
    assert isinstance(dataclasses.replace(get_preset("qwen3-30b-a3b"), activation="silu"), ModelPreset)  # an alias


def test_frozen_and_tp():
    p = get_preset("Qwen3-30B-A3B")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.hidden = 1
    assert [p.local_intermediate(tp) for tp in (1, 2, 4, 8)] == [768, 384, 192, 96]
    with pytest.raises(
        ValueError,
        match=r"not divisible by tp=3 \(fix: choose a tensor-parallel size that divides it "
        r"\(1, 2, 4, 8, 16\)",
    ):
        get_preset("nemotron3-nano").local_intermediate(3)


def test_unknown_preset_lists_valid_ones():
    with pytest.raises(FormatError, match=r"unknown model preset 'llama-2' \(fix: choose one of .*deepseek-v3"):
        get_preset("llama-2")
