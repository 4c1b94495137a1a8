"""Checkpoint reader: sample conventions against the seeded generator, TP slicing, bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import same_tensor
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from fimoe_lab import resources
from fimoe_lab.checkpoints import CheckpointError, open_checkpoint, sample_path
from scripts import make_sample_checkpoints as gen

SAMPLES = list(gen.SAMPLES)
EXPECTED = {  # sample -> (convention, format, w13 dtype, scale dtype)
    "deepseek-v3-fp8": ("deepseek-fp8", "fp8-block", torch.float8_e4m3fn, torch.float32),
    "qwen3-moe-bf16": ("qwen3-moe-bf16", "bf16", torch.bfloat16, None),
    "mixtral-bf16": ("mixtral-bf16", "bf16", torch.bfloat16, None),
    "deepseek-r1-nvfp4": ("modelopt-nvfp4", "nvfp4", torch.uint8, torch.float8_e4m3fn),
    "gpt-oss-mxfp4": ("gpt-oss-mxfp4", "mxfp4", torch.uint8, torch.uint8),
}
REL_ERR = {"bf16": 0.01, "fp8-block": 0.05, "nvfp4": 0.15, "mxfp4": 0.2}


# ---------------------------------------------------------------------------- samples
@pytest.mark.parametrize("sample", SAMPLES)
def test_sample_reads_as_generated(sample):
    spec = gen.SAMPLES[sample]
    conv, fmt, wdtype, sdtype = EXPECTED[sample]
    e, i, h = spec["experts"], spec["intermediate"], spec["hidden"]
    v = 2 if fmt in ("nvfp4", "mxfp4") else 1
    with open_checkpoint(sample_path(sample)) as ck:
        assert (ck.convention.name, ck.fmt) == (conv, fmt)
        assert ck.moe_layers == list(spec["moe_layers"])  # dense layer and shared expert are not experts
        for layer in ck.moe_layers:
            got = ck.read_layer(layer)
            assert got.w13.shape == (e, 2 * i, h // v) and got.w13.dtype == wdtype
            assert got.w2.shape == (e, h, i // v) and got.w2.dtype == wdtype
            assert (got.w13_scale is None) == (sdtype is None)
            if sdtype is not None:
                assert got.w13_scale.dtype == sdtype and got.w2_scale.dtype == sdtype
            want = gen.sample_layer(sample, layer)
            for name, t in want.tensors().items():
                assert same_tensor(getattr(got, name), t), name
            assert set(got.extras) == set(want.extras)
            for name, t in want.extras.items():
                assert same_tensor(got.extras[name], t.contiguous()), name
            # values: the dequantized stack is the seeded original, gate rows first
            orig = gen.original_weights(sample, layer)
            w13, w2 = got.dequantized()
            gate, up = w13[:, :i], w13[:, i:]
            for deq, ref, other in (
                (gate, orig["gate"], orig["up"]),
                (up, orig["up"], orig["gate"]),
                (w2, orig["down"], None),
            ):
                err = ((deq - ref).norm() / ref.norm()).item()
                assert err < REL_ERR[fmt], (sample, err)
                if other is not None:  # a swapped gate/up would be far off
                    assert ((deq - other).norm() / other.norm()).item() > 0.9


def test_sample_data_is_small_and_regenerates_identically(tmp_path):
    shipped = resources.samples_dir()
    total = sum(f.stat().st_size for f in shipped.rglob("*") if f.is_file())
    assert 1e6 < total < 8e6, total
    gen.main([str(tmp_path)])
    for sample in SAMPLES:
        for f in (shipped / sample).iterdir():
            assert f.read_bytes() == (tmp_path / sample / f.name).read_bytes(), (
                f"{sample}/{f.name} is stale: rerun the script"
            )


def test_dead_expert_has_tiny_scales():
    with open_checkpoint(sample_path("deepseek-v3-fp8")) as ck:
        layer = ck.read_layer(1, load="scales")
    dead = gen.SAMPLES["deepseek-v3-fp8"]["dead_expert"]
    assert layer.w13_scale[dead].max() < 1e-20 and layer.w2_scale[dead].max() < 1e-20
    others = torch.cat([layer.w13_scale[:dead], layer.w13_scale[dead + 1 :]])
    assert others.min() > 1e-6
    assert layer.w13.device.type == "meta"  # load="scales" never reads weights


# ---------------------------------------------------------------------------- tensor parallelism
def rank_rows(sample: str, tp: int, rank: int) -> list[int]:
    """Intermediate rows of a rank: equal shards, or whole 32-value blocks, ceil per rank, for gpt-oss."""
    i = gen.SAMPLES[sample]["intermediate"]
    if EXPECTED[sample][1] == "mxfp4":
        per = -(-(i // 32) // tp) * 32
        return list(range(rank * per, min((rank + 1) * per, i)))
    return list(range(rank * i // tp, (rank + 1) * i // tp))


def slow_rank_slice(sample: str, full, tp: int, rank: int):
    """Per-rank slice built row by row from the full (TP 1) layer, independently of the reader."""
    fmt, i = full.fmt, full.intermediate
    rows = rank_rows(sample, tp, rank)
    v = 2 if fmt in ("nvfp4", "mxfp4") else 1
    w13 = torch.stack(
        [
            torch.stack([full.w13[e, r] for r in rows] + [full.w13[e, i + r] for r in rows])
            for e in range(full.num_experts)
        ]
    )
    cols = sorted({r // v for r in rows})
    out = {"w13": w13, "w2": full.w2[:, :, cols]}
    if fmt == "fp8-block":
        n = full.w13_scale.shape[1] // 2
        blocks = sorted({r // 128 for r in rows})
        out["w13_scale"] = torch.cat([full.w13_scale[:, blocks], full.w13_scale[:, [n + b for b in blocks]]], 1)
        out["w2_scale"] = full.w2_scale[:, :, blocks]
    elif fmt in ("nvfp4", "mxfp4"):
        block = 16 if fmt == "nvfp4" else 32
        out["w13_scale"] = torch.cat([full.w13_scale[:, rows], full.w13_scale[:, [i + r for r in rows]]], 1)
        out["w2_scale"] = full.w2_scale[:, :, sorted({r // block for r in rows})]
    if "w13_bias" in full.extras:
        out["w13_bias"] = torch.cat(
            [full.extras["w13_bias"][:, rows], full.extras["w13_bias"][:, [i + r for r in rows]]], 1
        )
        out["w2_bias"] = full.extras["w2_bias"] if rank == 0 else torch.zeros_like(full.extras["w2_bias"])
    return out


def shardable(sample: str, tp: int) -> bool:
    i, fmt = gen.SAMPLES[sample]["intermediate"], EXPECTED[sample][1]
    if fmt == "mxfp4":
        return len(rank_rows(sample, tp, tp - 1)) > 0
    return i % tp == 0 and (i // tp) % {"fp8-block": 128, "nvfp4": 16}.get(fmt, 1) == 0


SHARDABLE = [(s, tp) for s in SAMPLES for tp in (2, 4, 8) if shardable(s, tp)]


@pytest.mark.parametrize("sample,tp", SHARDABLE)
def test_tp_slice_matches_slow_reference(sample, tp):
    with open_checkpoint(sample_path(sample)) as ck:
        layer = ck.moe_layers[-1]
        full = ck.read_layer(layer)
        for rank in range(tp):
            got = ck.read_layer(layer, tp, rank)
            want = slow_rank_slice(sample, full, tp, rank)
            assert got.intermediate == len(rank_rows(sample, tp, rank))
            for name, t in want.items():
                mine = got.extras[name] if name in got.extras else getattr(got, name)
                assert same_tensor(mine, t), (name, rank)
            for name in ("w13_weight_scale_2", "w13_input_scale", "w2_weight_scale_2", "w2_input_scale"):
                if name in full.extras:  # per-tensor scalars are not sharded
                    assert same_tensor(got.extras[name], full.extras[name])


def test_tp_shards_tile_the_full_layer():
    with open_checkpoint(sample_path("mixtral-bf16")) as ck:
        full = ck.read_layer(0)
        parts = [ck.read_layer(0, 4, r) for r in range(4)]
    i = full.intermediate
    gate = torch.cat([p.w13[:, : p.intermediate] for p in parts], 1)
    up = torch.cat([p.w13[:, p.intermediate :] for p in parts], 1)
    assert torch.equal(torch.cat([gate, up], 1), full.w13) and gate.shape[1] == i
    assert torch.equal(torch.cat([p.w2 for p in parts], 2), full.w2)


@pytest.mark.parametrize(
    "sample,tp,rank,words",
    [
        ("mixtral-bf16", 3, 0, ["tp=3 does not divide the intermediate size 464"]),
        ("deepseek-v3-fp8", 4, 0, ["intermediate 64 per rank", "128", "(fix: tp in [1, 2]"]),
        ("deepseek-r1-nvfp4", 8, 0, ["intermediate 40 per rank", "16-value NVFP4"]),
        ("gpt-oss-mxfp4", 8, 5, ["ranks from 5 on get no intermediate rows", "10 MXFP4 blocks"]),
        ("qwen3-moe-bf16", 2, 2, ["rank 2 of 2 is not valid"]),
    ],
)
def test_tp_misalignment_is_a_clear_error(sample, tp, rank, words):
    with open_checkpoint(sample_path(sample)) as ck, pytest.raises(CheckpointError) as info:
        ck.read_layer(ck.moe_layers[0], tp, rank)
    for w in words:
        assert w in str(info.value)
    assert info.value.fix  # every refusal says how to fix it


# ---------------------------------------------------------------------------- bad input
def copy_checkpoint(sample: str, dst: Path, mutate=None, config=None) -> Path:
    """A single-file copy of a sample (no index), with ``mutate(tensors)`` applied."""
    src = sample_path(sample)
    tensors = {}
    for f in src.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            tensors.update({k: h.get_tensor(k) for k in h.keys()})
    if mutate:
        mutate(tensors)
    dst.mkdir(parents=True)
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config(cfg) if config else cfg))
    return dst


def test_single_file_checkpoint_without_index(tmp_path):
    path = copy_checkpoint("qwen3-moe-bf16", tmp_path / "c")
    with open_checkpoint(path) as ck, open_checkpoint(sample_path("qwen3-moe-bf16")) as ref:
        assert same_tensor(ck.read_layer(1).w13, ref.read_layer(1).w13)


def test_kimi_k2_config_reads_as_deepseek_convention(tmp_path):
    def kimi(cfg):
        return {**cfg, "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}

    path = copy_checkpoint("deepseek-v3-fp8", tmp_path / "k", config=kimi)
    with open_checkpoint(path) as ck:
        assert ck.convention.name == "deepseek-fp8" and ck.read_layer(1).num_experts == 6


def _raises(path, *words, layer=None, exc=CheckpointError):
    with pytest.raises(exc) as info, open_checkpoint(path) as ck:
        ck.read_layer(ck.moe_layers[0] if layer is None else layer)
    for w in words:
        assert w in str(info.value), str(info.value)
    return str(info.value)


def test_missing_tensor_names_it(tmp_path):
    name = "model.layers.1.mlp.experts.4.up_proj.weight_scale_inv"
    path = copy_checkpoint("deepseek-v3-fp8", tmp_path / "c", lambda t: t.pop(name))
    _raises(path, "missing tensor " + name, "F32 [2, 2]")


def test_wrong_shape_names_tensor_expected_and_found(tmp_path):
    name = "model.layers.0.block_sparse_moe.experts.2.w3.weight"
    path = copy_checkpoint("mixtral-bf16", tmp_path / "c", lambda t: t.__setitem__(name, t[name][:460].clone()))
    _raises(path, name, "expected BF16 [464, 64]", "found BF16 [460, 64]")


def test_wrong_dtype_names_tensor_expected_and_found(tmp_path):
    name = "model.layers.0.mlp.experts.5.down_proj.weight_scale_2"
    path = copy_checkpoint(
        "deepseek-r1-nvfp4", tmp_path / "c", lambda t: t.__setitem__(name, t[name].to(torch.bfloat16))
    )
    _raises(path, name, "expected F32", "found BF16")


def test_wrong_dtype_of_scale_in_fused_convention(tmp_path):
    name = "model.layers.0.mlp.experts.down_proj_scales"
    path = copy_checkpoint("gpt-oss-mxfp4", tmp_path / "c", lambda t: t.__setitem__(name, t[name].to(torch.float32)))
    _raises(path, name, "expected U8 [8, 256, 10]", "found F32 [8, 256, 10]")


def test_unknown_naming_convention(tmp_path):
    def rename(t):
        for k in [k for k in t if ".experts." in k]:
            t[k.replace("gate_proj", "w_in")] = t.pop(k)

    path = copy_checkpoint("qwen3-moe-bf16", tmp_path / "c", rename)
    msg = _raises(
        path, "follow no known naming convention", "experts.0.w_in.weight", "conventions.py", exc=CheckpointError
    )
    assert "gpt-oss-mxfp4" in msg


def test_no_experts_at_all(tmp_path):
    path = copy_checkpoint(
        "qwen3-moe-bf16", tmp_path / "c", lambda t: [t.pop(k) for k in [k for k in t if ".experts." in k]]
    )
    with pytest.raises(CheckpointError, match="no MoE expert tensors"):
        open_checkpoint(path)


def test_missing_config_key_and_file(tmp_path):
    path = copy_checkpoint(
        "qwen3-moe-bf16",
        tmp_path / "c",
        config=lambda c: {k: v for k, v in c.items() if k not in ("moe_intermediate_size", "intermediate_size")},
    )
    _raises(path, "moe_intermediate_size or intermediate_size", "config.json")
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        open_checkpoint(path)


def test_config_that_does_not_match_the_weights(tmp_path):
    path = copy_checkpoint("qwen3-moe-bf16", tmp_path / "c", config=lambda c: {**c, "num_experts": 7})
    _raises(path, "missing tensor model.layers.0.mlp.experts.6.gate_proj.weight")


def test_index_pointing_to_missing_shard(tmp_path):
    dst = tmp_path / "c"
    shutil.copytree(sample_path("qwen3-moe-bf16"), dst)
    (dst / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"), open_checkpoint(dst) as ck:
        ck.read_layer(1)


# ---------------------------------------------------------------------------- expert ranges
@pytest.fixture(scope="module")
def family_root(tmp_path_factory) -> Path:
    from scripts import make_family_samples as fam_gen

    out = tmp_path_factory.mktemp("families")
    for family in fam_gen.FAMILIES:
        fam_gen.make(family, out)
    return out


def _family_names(convertible: bool = False) -> list:
    """The synthetic families of ``scripts/make_family_samples.py`` (``convertible``: those with a kernel layout)."""
    from fimoe_lab.checkpoints import conventions
    from scripts import make_family_samples as fam_gen

    return [
        f
        for f, fam in fam_gen.FAMILIES.items()
        if not (convertible and fam.convention and conventions.get(fam.convention).missing_layout)
    ]


def _assert_range_is_the_slice(ck, layer: int, tp: int, rank: int, e0: int, e1: int, full=None) -> None:
    """``read_layer(experts=(e0, e1))`` holds exactly ``[e0:e1]`` of every tensor and extra of the whole read."""
    full = full or ck.read_layer(layer, tp, rank)
    part = ck.read_layer(layer, tp, rank, experts=(e0, e1))
    assert part.num_experts == e1 - e0
    assert (part.intermediate, part.hidden, part.fmt, part.layer) == (full.intermediate, full.hidden, full.fmt, layer)
    for name, t in full.tensors().items():
        assert same_tensor(getattr(part, name), None if t is None else t[e0:e1]), (layer, tp, rank, e0, e1, name)
    assert set(part.extras) == set(full.extras)
    for name, t in full.extras.items():
        assert same_tensor(part.extras[name], t[e0:e1]), (layer, tp, rank, e0, e1, name)


def _random_ranges(e_count: int, seed: int) -> list[tuple[int, int]]:
    """The whole range, each end alone, and random ranges (seeded)."""
    g = torch.Generator().manual_seed(seed)
    ranges = [(0, e_count), (0, 1), (e_count - 1, e_count)]
    for _ in range(3):
        a, b = sorted(torch.randint(0, e_count + 1, (2,), generator=g).tolist())
        ranges.append((a, max(b, a + 1)) if a < e_count else (e_count - 1, e_count))
    return ranges


@pytest.mark.parametrize("sample", SAMPLES)
def test_expert_range_reads_the_slice_of_the_whole_layer(sample):
    with open_checkpoint(sample_path(sample)) as ck:
        for layer in ck.moe_layers:
            for tp, rank in ((1, 0), (2, 1)):
                full = ck.read_layer(layer, tp, rank)
                for e0, e1 in _random_ranges(full.num_experts, layer * 7 + rank):
                    _assert_range_is_the_slice(ck, layer, tp, rank, e0, e1, full)


@pytest.mark.parametrize("family", _family_names())
def test_expert_range_reads_the_slice_for_every_family(family_root, family):
    with open_checkpoint(family_root / family) as ck:
        for layer in ck.moe_layers:
            for tp, rank in ((1, 0), (2, 1)):
                full = ck.read_layer(layer, tp, rank)
                for e0, e1 in _random_ranges(full.num_experts, layer * 7 + rank):
                    _assert_range_is_the_slice(ck, layer, tp, rank, e0, e1, full)


@settings(max_examples=25, deadline=None)
@given(sample=st.sampled_from(SAMPLES), data=st.data())
def test_expert_range_shapes_property(sample, data):
    with open_checkpoint(sample_path(sample)) as ck:
        layer = data.draw(st.sampled_from(ck.moe_layers))
        e_count = ck.config_size("experts", layer)
        e0 = data.draw(st.integers(0, e_count - 1))
        e1 = data.draw(st.integers(e0 + 1, e_count))
        load = data.draw(st.sampled_from(["all", "scales", "none"]))
        whole = ck.read_layer(layer, load="none")
        part = ck.read_layer(layer, load=load, experts=(e0, e1))
        for name, t in whole.tensors().items():
            got = getattr(part, name)
            assert (got is None) == (t is None)
            if t is not None:
                assert (got.shape, got.dtype) == ((e1 - e0, *t.shape[1:]), t.dtype), name
        for name, t in whole.extras.items():
            assert part.extras[name].shape == (e1 - e0, *t.shape[1:]), name
        if load == "all":
            _assert_range_is_the_slice(ck, layer, 1, 0, e0, e1)


@pytest.mark.parametrize("experts", [(0, 0), (3, 2), (-1, 2), (0, 7), (0.0, 2), (True, 2), (0, "2")])
def test_bad_expert_range_is_one_clear_error(experts):
    with open_checkpoint(sample_path("qwen3-moe-bf16")) as ck, pytest.raises(CheckpointError) as info:
        ck.read_layer(ck.moe_layers[0], experts=experts)
    msg = str(info.value)
    assert "0 <= e0 < e1 <= 6" in msg and "\n" not in msg, msg


def _block_convert_is_whole_layer_convert(src: Path, tmp_path: Path, backend: str, tp: int, rank: int) -> None:
    """``convert_checkpoint`` (blocks of experts read on a thread while the previous block is converted)
    writes the same tensors, byte for byte, as converting whole layers loaded in one read."""
    from safetensors.torch import load_file

    from fimoe_lab.checkpoints import LayoutChoice, convert_checkpoint, unchanged, write_kernel_layout

    blocks = convert_checkpoint(src, tmp_path / f"blocks-{backend}-{tp}-{rank}.safetensors", backend, tp, rank)
    with open_checkpoint(src) as ck:
        assert all(ck.config_size("experts", l) > 1 for l in ck.moe_layers)  # so there is more than one block
        sources = [
            (l, ck.read_layer(l, tp, rank, load="none"), (lambda l=l: ck.read_layer(l, tp, rank)))
            for l in ck.moe_layers
        ]
        whole = write_kernel_layout(
            tmp_path / f"whole-{backend}-{tp}-{rank}.safetensors",
            sources,
            LayoutChoice(backend),
            prefix=ck.prefix,
            block=ck.convention.block,
            kept=unchanged.for_rank(ck, rank),  # rank 0: the source's other tensors
        )
    got, want = load_file(blocks), load_file(whole)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert same_tensor(got[name], t), name


@pytest.fixture
def one_expert_blocks(monkeypatch):
    """The smallest blocks and chunks: one expert each."""
    from fimoe_lab.checkpoints import stream

    monkeypatch.setattr(stream, "CHUNK_MIN", 1)
    monkeypatch.setattr(stream, "CHUNK_MAX", 1)


@pytest.mark.parametrize("sample", SAMPLES)
def test_convert_reading_expert_blocks_gives_the_whole_layer_bytes(sample, tmp_path, one_expert_blocks):
    for i, (tp, rank) in enumerate(((1, 0), (2, 1))):
        backend = ("trtllm", "cutlass")[i]
        if sample == "deepseek-r1-nvfp4" and backend == "trtllm":
            backend = "cutlass"  # its intermediate needs an alignment on trtllm
        _block_convert_is_whole_layer_convert(sample_path(sample), tmp_path, backend, tp, rank)


@pytest.mark.parametrize("family", _family_names(convertible=True))
def test_convert_reading_expert_blocks_gives_the_whole_layer_bytes_for_every_family(
    family_root, family, tmp_path, one_expert_blocks
):
    for backend, (tp, rank) in (("trtllm", (2, 1)), ("cutlass", (1, 0))):
        _block_convert_is_whole_layer_convert(family_root / family, tmp_path, backend, tp, rank)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "mxfp4", "fp8-block"])
def test_a_non_gated_layer_dequantizes_its_one_projection(fmt):
    """Non-gated (ReLU^2) layers: W13 holds I rows of one projection and a per-projection global scale of shape
    (E, 1) (ModelOpt NVFP4) must not be read as [gate, up]. Oracle: each expert quantized on its own, in the test."""
    from fimoe_lab.formats import get as get_codec
    from fimoe_lab.viz.sources import sample_layer

    layer = sample_layer(fmt, experts=3, intermediate=128, hidden=256, gated=False).moe
    w13, w2 = layer.dequantized()
    assert w13.shape == (3, 128, 256) and w2.shape == (3, 256, 128)
    from fimoe_lab.viz.sources import _structured

    src13, src2 = _structured(3, 128, 256, False, 0)
    spec = get_codec(fmt)
    for e in range(3):  # the per-expert oracle: quantize that expert alone, dequantize it
        for got, src in ((w13[e], src13[e]), (w2[e], src2[e])):
            want = spec.dequantize(spec.quantize(src[None]))[0]
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
            assert (got != 0).any()
