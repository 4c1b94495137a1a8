"""Convert -> restore: byte-exact round trips, the reference MoE forward, atomic writes, CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import all_tensors, same_tensor

from fimoe_lab import formats, prepare
from fimoe_lab.checkpoints import (
    CheckpointError,
    LayoutChoice,
    MoELayer,
    convert,
    convert_checkpoint,
    layer_forward,
    moe_forward,
    open_checkpoint,
    random_routing,
    read_kernel_metadata,
    restore_checkpoint,
    restore_layers,
    sample_path,
    write_kernel_layout,
)
from fimoe_lab.cli import main as cli_main
from scripts import make_sample_checkpoints as gen

SAMPLES = list(gen.SAMPLES)


# ---------------------------------------------------------------------------- round trips on the samples
CASES = [(s, b, tp) for s in SAMPLES for b in ("trtllm", "cutlass") for tp in (1, 2)]


@pytest.mark.parametrize("sample,backend,tp", CASES)
def test_convert_restore_is_byte_exact(tmp_path, sample, backend, tp):
    src = sample_path(sample)
    kernel = tmp_path / "k.safetensors"
    align = 64 if (sample == "deepseek-r1-nvfp4" and backend == "trtllm" and tp == 2) else None
    convert_checkpoint(src, kernel, backend, tp, tp - 1, intermediate_alignment=align)
    meta = read_kernel_metadata(kernel)
    assert meta["convention"] == gen.SAMPLES[sample]["convention"] and meta["tp_size"] == tp
    restored = restore_checkpoint(kernel, tmp_path / "restored")
    with open_checkpoint(src) as a, open_checkpoint(restored) as b:
        assert b.convention.name == a.convention.name and b.moe_layers == a.moe_layers
        for layer in a.moe_layers:
            x, y = a.read_layer(layer, tp, tp - 1), b.read_layer(layer)
            for name in ("w13", "w2", "w13_scale", "w2_scale"):
                assert same_tensor(getattr(x, name), getattr(y, name)), (layer, name)
            for name in x.extras:
                assert same_tensor(x.extras[name], y.extras[name]), (layer, name)
    original, back = all_tensors(src), all_tensors(restored)
    if tp == 1:  # every tensor of the source under its own name, byte for byte, and nothing else
        assert sorted(back) == sorted(original) and all(same_tensor(original[k], v) for k, v in back.items())
    else:  # the last rank: its expert slices only (the other tensors are in rank 0's output)
        assert sorted(back) == sorted(k for k in original if ".experts." in k and "shared_experts" not in k)


def test_conversion_moves_bytes_like_the_drop_ins(tmp_path):
    """The kernel file equals the core's drop-in functions on the same stacked tensors."""
    src = sample_path("deepseek-v3-fp8")
    for d in ("t", "c"):
        (tmp_path / d).mkdir()
    convert_checkpoint(src, tmp_path / "t" / "k.safetensors", "trtllm")
    convert_checkpoint(src, tmp_path / "c" / "k.safetensors", "cutlass")
    with open_checkpoint(src) as ck:
        layer = ck.read_layer(1)
    t, c = all_tensors(tmp_path / "t"), all_tensors(tmp_path / "c")
    pre = "model.layers.1.mlp.experts."
    spec = prepare.MoELayerSpec(layer.intermediate, layer.hidden, weight_block_size=[128, 128])
    w13, w2, s13, s2 = prepare.prepare_fp8_moe_layer_for_fi(
        spec, layer.w13, layer.w2, layer.w13_scale, None, layer.w2_scale, None, is_trtllm=True
    )
    assert same_tensor(t[pre + "w13_weight"], w13) and same_tensor(t[pre + "w2_weight"], w2)
    assert same_tensor(c[pre + "w13_weight"], prepare.swap_w13_to_w31(layer.w13))
    # convert moves bytes only: the dead expert's scales stay as they are (prepare clamps them)
    assert same_tensor(t[pre + "w13_weight_scale"], prepare.swap_w13_to_w31(layer.w13_scale))
    assert s13.min() >= prepare.FI_CUTLASS_MIN_BLOCK_SCALE > t[pre + "w13_weight_scale"].min()
    assert not same_tensor(t[pre + "w13_weight"], layer.w13)


# ---------------------------------------------------------------------------- every format, in memory
def quantized_layer(fmt: str, experts: int, inter: int, hidden: int, seed: int) -> MoELayer:
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.05
    w13[:, :inter] += torch.linspace(-0.1, 0.1, hidden)  # structured: gate and up differ systematically
    w2 = torch.randn(experts, hidden, inter, generator=g) * 0.05
    if fmt == "bf16":
        return MoELayer(fmt, w13.to(torch.bfloat16), w2.to(torch.bfloat16), None, None, inter, hidden)
    if fmt == "fp8-block":
        qs = [formats.get(fmt).quantize(t) for t in (w13[:, :inter], w13[:, inter:], w2)]
        return MoELayer(
            fmt,
            torch.cat([qs[0].values, qs[1].values], 1),
            qs[2].values,
            torch.cat([qs[0].scales, qs[1].scales], 1),
            qs[2].scales,
            inter,
            hidden,
        )
    if fmt == "nvfp4":
        q13, q2 = formats.get(fmt).quantize(w13), formats.get(fmt).quantize(w2)
        extras = {
            "w13_weight_scale_2": (1 / q13.global_scale)[:, None].expand(-1, 2).contiguous(),
            "w2_weight_scale_2": 1 / q2.global_scale,
        }
        return MoELayer(fmt, q13.values, q2.values, q13.scales, q2.scales, inter, hidden, extras)
    q13, q2 = formats.get(fmt).quantize(w13), formats.get(fmt).quantize(w2)
    return MoELayer(fmt, q13.values, q2.values, q13.scales, q2.scales, inter, hidden)


FORMAT_SHAPES = [
    (f, b, i, h)
    for f in ("bf16", "fp8", "fp8-block", "mxfp8", "nvfp4", "mxfp4")
    for b in ("trtllm", "cutlass")
    for i, h in ((128, 256), (96, 160))
    if not (f == "fp8-block" and i % 128) and not (f == "nvfp4" and b == "trtllm" and i % 64)
]


@pytest.mark.parametrize("fmt,backend,inter,hidden", FORMAT_SHAPES)
def test_every_format_round_trips_and_forward_is_identical(tmp_path, fmt, backend, inter, hidden):
    layers = [quantized_layer(fmt, 3, inter, hidden, seed) for seed in (1, 2)]
    sources = [(i, layer, (lambda layer=layer: layer)) for i, layer in enumerate(layers)]
    out = write_kernel_layout(tmp_path / "k.safetensors", sources, LayoutChoice(backend))
    meta, back = restore_layers(out)
    assert [r["plan"]["args"]["fmt"] for r in meta["layers"].values()] == [fmt, fmt]
    x = torch.randn(7, hidden, generator=torch.Generator().manual_seed(3))
    ids, weights = random_routing(7, 3, 2, seed=4)
    for a, b in zip(layers, back):
        for name in ("w13", "w2", "w13_scale", "w2_scale"):
            assert same_tensor(getattr(a, name), getattr(b, name)), name
        assert torch.equal(layer_forward(a, x, ids, weights), layer_forward(b, x, ids, weights))


# ---------------------------------------------------------------------------- the reference forward
@pytest.mark.parametrize("sample", SAMPLES)
def test_reference_forward_identical_after_convert_and_restore(tmp_path, sample):
    src = sample_path(sample)
    spec = gen.SAMPLES[sample]
    x = torch.randn(9, spec["hidden"], generator=torch.Generator().manual_seed(5))
    ids, weights = random_routing(9, spec["experts"], 2, seed=6)
    for backend in ("trtllm", "cutlass"):
        convert_checkpoint(src, tmp_path / f"{backend}.safetensors", backend)
        _, back = restore_layers(tmp_path / f"{backend}.safetensors")
        with open_checkpoint(src) as ck:
            for restored in back:
                original = ck.read_layer(restored.layer)
                assert torch.equal(layer_forward(original, x, ids, weights), layer_forward(restored, x, ids, weights))


@pytest.mark.parametrize(
    "sample,tp",
    [
        ("deepseek-v3-fp8", 2),
        ("qwen3-moe-bf16", 8),
        ("mixtral-bf16", 4),
        ("deepseek-r1-nvfp4", 4),
        ("gpt-oss-mxfp4", 4),
    ],
)
def test_tp_shards_sum_to_the_full_layer(sample, tp):
    """Row-parallel MoE: the ranks' partial outputs add up to the unsharded layer's output."""
    with open_checkpoint(sample_path(sample)) as ck:
        layer = ck.moe_layers[0]
        full = ck.read_layer(layer)
        x = torch.randn(6, full.hidden, generator=torch.Generator().manual_seed(11))
        ids, weights = random_routing(6, full.num_experts, 2, seed=12)
        want = layer_forward(full, x, ids, weights)
        got = sum(layer_forward(ck.read_layer(layer, tp, r), x, ids, weights) for r in range(tp))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_reference_forward_tracks_the_float_weights_and_sees_a_gate_up_swap():
    sample, layer = "qwen3-moe-bf16", 1
    orig = gen.original_weights(sample, layer)
    with open_checkpoint(sample_path(sample)) as ck:
        moe = ck.read_layer(layer)
    x = torch.randn(16, moe.hidden, generator=torch.Generator().manual_seed(8))
    ids, weights = random_routing(16, moe.num_experts, 2, seed=9)
    want = moe_forward(x, torch.cat([orig["gate"], orig["up"]], 1), orig["down"], ids, weights)
    got = layer_forward(moe, x, ids, weights)
    assert ((got - want).norm() / want.norm()) < 0.02
    i = moe.intermediate
    swapped = moe.with_tensors(w13=torch.cat([moe.w13[:, i:], moe.w13[:, :i]], 1))
    assert ((layer_forward(swapped, x, ids, weights) - want).norm() / want.norm()) > 0.5


def test_gpt_oss_activation_uses_config_limit_and_biases():
    with open_checkpoint(sample_path("gpt-oss-mxfp4")) as ck:
        moe = ck.read_layer(0)
    assert moe.activation == "swiglu_oai" and moe.activation_params == {"alpha": 1.702, "limit": 7.0}
    x = torch.randn(4, moe.hidden, generator=torch.Generator().manual_seed(1))
    ids, weights = random_routing(4, moe.num_experts, 4, seed=2)
    no_bias = moe.with_tensors()
    no_bias.extras = {}
    assert not torch.equal(layer_forward(moe, x, ids, weights), layer_forward(no_bias, x, ids, weights))


def _loop_forward(x, w13, w2, ids, weights, act) -> torch.Tensor:
    """Token by token, slot by slot: ``sum_k w[t, k] * act(w13[e] @ x[t]) @ w2[e].T``, in float64."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            out[t] += weights[t, k].double() * (w2[e].double() @ act(w13[e].double() @ x[t].double()))
    return out


ACTS = {  # activation name -> (projections in w13, the activation on one token's w13 output, written out here)
    "silu": (2, lambda h: h[: h.shape[0] // 2] / (1 + torch.exp(-h[: h.shape[0] // 2])) * h[h.shape[0] // 2 :]),
    "swiglu": (2, lambda h: h[: h.shape[0] // 2] / (1 + torch.exp(-h[: h.shape[0] // 2])) * h[h.shape[0] // 2 :]),
    "relu2": (1, lambda h: torch.clamp(h, min=0) ** 2),
    "geglu": (
        2,
        lambda h: 0.5 * h[: h.shape[0] // 2] * (1 + torch.erf(h[: h.shape[0] // 2] / 2**0.5)) * h[h.shape[0] // 2 :],
    ),
}


@pytest.mark.parametrize("activation", ACTS)
def test_reference_forward_activations_follow_the_table(activation):
    """Names and aliases resolve through specs.ACTIVATIONS; gated ones split w13 into [gate; up], relu2 does not."""
    p, act = ACTS[activation]
    g = torch.Generator().manual_seed(21)
    e, i, h = 4, 24, 32
    w13, w2 = torch.randn(e, p * i, h, generator=g) * 0.2, torch.randn(e, h, i, generator=g) * 0.2
    w13[:, :i] += torch.linspace(-0.5, 0.5, h)  # structured: gate rows differ from up rows systematically
    x = torch.randn(5, h, generator=g)
    ids, weights = random_routing(5, e, 2, seed=22)
    got = moe_forward(x, w13, w2, ids, weights, activation)
    want = _loop_forward(x, w13, w2, ids, weights, act)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_reference_forward_refuses_an_unknown_activation():
    x, w13, w2 = torch.ones(1, 4), torch.ones(1, 8, 4), torch.ones(1, 4, 4)
    ids, weights = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1)
    with pytest.raises(ValueError, match="unknown activation 'gelu_tanh'") as info:
        moe_forward(x, w13, w2, ids, weights, "gelu_tanh")
    assert "swiglu" in info.value.fix and "relu2" in info.value.fix


# ---------------------------------------------------------------------------- atomic output
def _no_leftovers(directory: Path, name: str) -> None:
    assert not (directory / name).exists()
    assert not [p for p in directory.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize("error", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_failed_convert_leaves_no_output(tmp_path, monkeypatch, error):
    calls = {"n": 0}
    real = convert.convert_layer

    def flaky(layer, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:  # after the dry runs of both layers and the first real layer
            raise error
        return real(layer, *args, **kwargs)

    monkeypatch.setattr(convert, "convert_layer", flaky)
    with pytest.raises(type(error)):
        convert_checkpoint(sample_path("qwen3-moe-bf16"), tmp_path / "out.safetensors", "trtllm")
    assert calls["n"] == 4
    _no_leftovers(tmp_path, "out.safetensors")


def test_failed_convert_keeps_an_existing_output(tmp_path):
    out = tmp_path / "out.safetensors"
    convert_checkpoint(sample_path("qwen3-moe-bf16"), out, "cutlass")
    before = out.read_bytes()
    with pytest.raises(CheckpointError, match="cannot be laid out for trtllm"):
        convert_checkpoint(
            sample_path("deepseek-r1-nvfp4"), out, "trtllm", 2, 0, intermediate_alignment=16, force=True
        )  # 2*160 scale rows % 128
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.safetensors"]  # no temporary, no lock


def test_force_replaces_only_what_convert_wrote(tmp_path):
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"previous")
    for force in (False, True):
        with pytest.raises(CheckpointError, match="exists"):
            convert_checkpoint(sample_path("qwen3-moe-bf16"), out, "cutlass", force=force)
    assert out.read_bytes() == b"previous"


# ---------------------------------------------------------------------------- CLI
def test_cli_inspect_flags_dead_expert_and_tp_needs(capsys):
    assert cli_main(["inspect", "deepseek-v3-fp8"]) == 0
    out = capsys.readouterr().out
    assert "expert 3: 12/12 block scales below 1e-10" in out
    assert "cannot shard: tp=4" in out and "[gate_proj; up_proj]" in out
    assert cli_main(["inspect", "deepseek-r1-nvfp4", "--tp", "2"]) == 0
    assert "pad I 160->192" in capsys.readouterr().out  # NVFP4 TRT-LLM default: the 128-row scale shuffle needs I % 64
    assert cli_main(["inspect", "mixtral-bf16", "--tp", "4"]) == 0
    assert "I%16!=0" in capsys.readouterr().out


def test_cli_convert_restore_and_errors(tmp_path, capsys):
    kernel, back = str(tmp_path / "k.safetensors"), str(tmp_path / "back")
    assert (
        cli_main(
            ["convert", "gpt-oss-mxfp4", kernel, "--backend", "trtllm", "--tp", "2", "--rank", "1", "--no-progress"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "swizzle_scales_128x4" in out and "tp rank 1 of 2" in out
    assert cli_main(["restore", kernel, back]) == 0
    with open_checkpoint(back) as ck:
        assert ck.intermediate == 160
    assert cli_main(["convert", "gpt-oss-mxfp4", kernel, "--backend", "trtllm", "--no-progress"]) == 2  # bad input
    assert "exists (fix: pass --force" in capsys.readouterr().err
    assert cli_main(["convert", "no-such-model", str(tmp_path / "x.safetensors"), "--backend", "cutlass"]) == 2
    assert "does not exist (not a checkpoint directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["convert", "--help"])
    assert "temporary name" in capsys.readouterr().out
