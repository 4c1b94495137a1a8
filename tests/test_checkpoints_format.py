"""The converted-file format: version 2 records recipe ids and kind/params steps; version-1 files
(committed fixtures written by the old code) still restore byte for byte; tampered records are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import all_tensors, rewrite_metadata, same_tensor
from safetensors.torch import save_file

from fimoe_lab import recipes, steps
from fimoe_lab.checkpoints import (
    CheckpointError,
    convert_checkpoint,
    open_checkpoint,
    read_kernel_metadata,
    restore_checkpoint,
    restore_layers,
    sample_path,
)
from fimoe_lab.layout import compose
from fimoe_lab.plan import apply_map

FIXTURES = Path(__file__).parent / "fixtures"

# fixture, sample, backend, tp, rank, the rank's intermediate rows [lo, hi) (worked out by hand from config.json:
# mixtral I=464 -> 58 per rank; R1 NVFP4 I=320 -> 80; gpt-oss I=320 = 10 blocks of 32 -> 2 blocks per rank),
# values per byte of the down weight's columns
V1 = [
    ("v1-mixtral-bf16-trtllm-tp8-rank3", "mixtral-bf16", "trtllm", 8, 3, 174, 232, 1),
    ("v1-deepseek-r1-nvfp4-trtllm-tp4-rank1", "deepseek-r1-nvfp4", "trtllm", 4, 1, 80, 160, 2),
    ("v1-gpt-oss-mxfp4-cutlass-tp5-rank0", "gpt-oss-mxfp4", "cutlass", 5, 0, 0, 64, 2),
]
IDS = [row[0] for row in V1]


def rank_slice(name: str, t: torch.Tensor, lo: int, hi: int, v: int) -> torch.Tensor:
    """What TP rank rows ``[lo, hi)`` of the intermediate dim hold of source tensor ``name`` (as engines shard)."""
    leaf = name.split(".experts.", 1)[1]
    if leaf.startswith("gate_up_proj_"):  # gpt-oss: all experts, gate/up rows interleaved g0, u0, g1, u1, ...
        return t[:, 2 * lo : 2 * hi]
    if leaf in ("down_proj_blocks", "down_proj_scales"):  # whole 32-value blocks along the input dim
        return t[:, :, lo // 32 : hi // 32]
    if leaf == "down_proj_bias":  # only rank 0 adds the down bias
        return t if lo == 0 else torch.zeros_like(t)
    _, proj, suffix = leaf.split(".", 2)  # "<expert>.<projection>.<suffix>"
    if suffix in ("weight_scale_2", "input_scale"):  # per-tensor scalars are not sharded
        return t
    if proj in ("w1", "w3", "gate_proj", "up_proj"):  # rows, for weights and their per-row scales alike
        return t[lo:hi]
    per_column = {"weight": v, "weight_scale": 16}[suffix]  # down: columns (packed bytes, or per-16 scales)
    return t[:, lo // per_column : hi // per_column]


# ---------------------------------------------------------------------------- version 1 still restores
def test_fixtures_are_version_1_and_small():
    files = sorted(FIXTURES.glob("v1-*.safetensors"))
    assert [f.stem for f in files] == sorted(IDS)
    assert sum(f.stat().st_size for f in files) < 1_000_000
    for f in files:
        meta = read_kernel_metadata(f)
        rec = meta["layers"]["0"]
        assert meta["version"] == 1 and rec["plan"]["builder"] == "fimoe_lab.prepare.plan_layer"
        assert all(isinstance(s, str) for t in rec["tensors"].values() for s in t["steps"])  # display names


@pytest.mark.parametrize("fixture,sample,backend,tp,rank,lo,hi,v", V1, ids=IDS)
def test_v1_fixture_restores_to_the_source_bytes(tmp_path, fixture, sample, backend, tp, rank, lo, hi, v):
    """Restored with today's code, compared with the source read by safetensors directly (not our reader)."""
    out = restore_checkpoint(FIXTURES / f"{fixture}.safetensors", tmp_path / "restored")
    src = sample_path(sample)
    source = {
        k: t
        for k, t in all_tensors(*sorted(src.glob("*.safetensors"))).items()
        if ".experts." in k and "shared_experts" not in k
    }
    restored = all_tensors(*sorted(out.glob("*.safetensors")))
    assert set(restored) == set(source)
    for name, t in source.items():
        assert same_tensor(restored[name], rank_slice(name, t, lo, hi, v).contiguous()), name
    config = json.loads((out / "config.json").read_text())
    assert hi - lo in config.values()  # the shard's intermediate size


@pytest.mark.parametrize("fixture,sample,backend,tp,rank,lo,hi,v", V1, ids=IDS)
def test_v2_convert_writes_the_kernel_bytes_v1_wrote(tmp_path, fixture, sample, backend, tp, rank, lo, hi, v):
    # version 1 predates engine profiles: its layout is the legacy profile's
    out = convert_checkpoint(sample_path(sample), tmp_path / "k.safetensors", backend, tp, rank, engine="fimoe-legacy")
    old, new = all_tensors(FIXTURES / f"{fixture}.safetensors"), all_tensors(out)
    source = all_tensors(sample_path(sample))
    unchanged = {n for n in source if ".experts." not in n}  # the routers; version 1 wrote experts alone
    assert set(new) == set(old) | (unchanged if rank == 0 else set())  # rank 0 holds them
    for name in old:
        assert same_tensor(new[name], old[name]), name
    for name in set(new) - set(old):
        assert same_tensor(new[name], source[name]), name


def test_v1_record_whose_arguments_no_longer_give_its_shapes_is_refused(tmp_path):
    def realign(meta):
        meta["layers"]["0"]["plan"]["args"]["intermediate_alignment"] = 128

    bad = rewrite_metadata(FIXTURES / f"{V1[0][0]}.safetensors", tmp_path / "bad.safetensors", realign)
    with pytest.raises(CheckpointError, match="the version-1 file recorded kernel BF16 .4, 1, 128, 64.") as info:
        restore_layers(bad)
    assert "layer 0" in str(info.value) and info.value.fix

    def builder(meta):
        meta["layers"]["0"]["plan"]["builder"] = "os.system"

    with pytest.raises(CheckpointError, match="unknown plan builder 'os.system'"):
        restore_layers(rewrite_metadata(FIXTURES / f"{V1[0][0]}.safetensors", tmp_path / "b.safetensors", builder))


# ---------------------------------------------------------------------------- version 2 records kind/params
def _json_scalar(x) -> bool:
    return x is None or isinstance(x, (bool, int, float)) or (isinstance(x, str) and "(" not in x and ">>" not in x)


@pytest.mark.parametrize("fixture,sample,backend,tp,rank,lo,hi,v", V1, ids=IDS)
def test_v2_steps_alone_rebuild_the_file(tmp_path, fixture, sample, backend, tp, rank, lo, hi, v):
    """The recorded kind/params, rebuilt with steps.build alone (no recipe), map the source layer
    onto the file's tensors; the plan is named by its recipe id, no module path, no display name."""
    out = convert_checkpoint(sample_path(sample), tmp_path / "k.safetensors", backend, tp, rank)
    meta = read_kernel_metadata(out)
    assert meta["version"] == 2 and "fimoe_lab.prepare" not in json.dumps(meta)
    rec = meta["layers"]["0"]
    args = rec["plan"]["args"]
    assert (
        rec["plan"] == {"recipe": f"{args['fmt']}/{backend}", "args": args} and rec["plan"]["recipe"] in recipes.RECIPES
    )
    kernel = all_tensors(out)
    with open_checkpoint(sample_path(sample)) as ck:
        layer = ck.read_layer(0, tp, rank)
    prefix = f"model.layers.0.{ck.convention.block}.experts."
    moved = 0
    for n, trec in rec["tensors"].items():
        assert all(set(s) == {"kind", "params"} and s["kind"] in steps.STEPS for s in trec["steps"])
        assert all(_json_scalar(p) for s in trec["steps"] for p in s["params"].values())
        x = getattr(layer, n)
        if trec["steps"]:
            m = compose(*(steps.build(s["kind"], s["params"]) for s in trec["steps"]))
            x, moved = apply_map(m, x.contiguous(), n), moved + 1
        assert same_tensor(kernel[prefix + trec["name"]].reshape(x.shape), x), n
    assert moved >= 2
    for n, xrec in rec["extras"].items():
        x = layer.extras[n]
        if xrec["steps"]:
            rows = compose(*(steps.build(s["kind"], s["params"]) for s in xrec["steps"]))
            x = apply_map(rows.for_row_vectors(x.element_size()), x.contiguous(), n)
        assert same_tensor(kernel[prefix + n], x), n
    if "w13_bias" in rec["extras"]:
        assert rec["extras"]["w13_bias"]["rows_of"] == "w13" and rec["extras"]["w13_bias"]["steps"]


# ---------------------------------------------------------------------------- tampered or foreign files
@pytest.fixture(scope="module")
def v2_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("v2")
    return {
        "mixtral": convert_checkpoint(sample_path("mixtral-bf16"), root / "m.safetensors", "trtllm"),
        "gpt-oss": convert_checkpoint(sample_path("gpt-oss-mxfp4"), root / "g.safetensors", "cutlass"),
    }


def _param(meta, name="w13", step=3, key="epilogue_tile_m", value=64):
    meta["layers"]["0"]["tensors"][name]["steps"][step]["params"][key] = value


TAMPERED = [
    ("one parameter", "mixtral", _param, "step 4 is .*epilogue_tile_m': 64"),
    (
        "a step dropped",
        "mixtral",
        lambda m: m["layers"]["0"]["tensors"]["w2"]["steps"].pop(0),
        "w2 was written with steps",
    ),
    (
        "display names",
        "mixtral",
        lambda m: m["layers"]["0"]["tensors"]["w13"].update(steps=["swap_w13_to_w31"]),
        "was written with steps",
    ),
    (
        "another recipe",
        "mixtral",
        lambda m: m["layers"]["0"]["plan"].update(recipe="bf16/cutlass"),
        "recipe 'bf16/cutlass' does not match its arguments",
    ),
    (
        "unknown recipe",
        "mixtral",
        lambda m: m["layers"]["0"]["plan"].update(recipe="int4/trtllm"),
        "unknown layout recipe 'int4/trtllm'",
    ),
    (
        "bias rows",
        "gpt-oss",
        lambda m: m["layers"]["0"]["extras"]["w13_bias"].update(rows_of="w2"),
        "w13_bias was written with steps",
    ),
    ("newer version", "mixtral", lambda m: m.update(version=3), "metadata version 3"),
]


@pytest.mark.parametrize("what,which,edit,message", TAMPERED, ids=[t[0] for t in TAMPERED])
def test_tampered_record_is_refused(tmp_path, v2_files, what, which, edit, message):
    restore_layers(v2_files[which])  # the untouched file restores
    bad = rewrite_metadata(v2_files[which], tmp_path / "bad.safetensors", edit)
    with pytest.raises(CheckpointError, match=message) as info:
        restore_layers(bad)
    assert info.value.fix


def test_file_without_metadata_or_with_a_modified_tensor_is_refused(tmp_path, v2_files):
    save_file({"x": torch.ones(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(CheckpointError, match="no 'fimoe_lab' metadata"):
        restore_layers(tmp_path / "plain.safetensors")

    def shape(meta):
        meta["layers"]["0"]["tensors"]["w2"]["kernel"]["shape"][0] += 1

    with pytest.raises(CheckpointError, match="w2_weight is BF16 .*, metadata says BF16") as info:
        restore_layers(rewrite_metadata(v2_files["mixtral"], tmp_path / "bad.safetensors", shape))
    assert "modified after conversion" in info.value.fix
