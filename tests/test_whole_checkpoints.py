"""Whole checkpoints and reproducible bytes: convert carries every tensor that is not a converted MoE layer
through unchanged (on rank 0 of a TP/EP run), restore gives back every tensor of the source with its name,
dtype, shape and bytes, config.json and an index; the same source converted anywhere gives the same files."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import all_tensors, coords, random_bytes, same_tensor
from safetensors.torch import save_file

from fimoe_lab.checkpoints import (
    CheckpointError,
    convert_checkpoint,
    read_kernel_metadata,
    restore_checkpoint,
    safe_io,
    unchanged,
)
from fimoe_lab.checkpoints.request import header_identity
from fimoe_lab.cli import main as cli_main
from fimoe_lab.resources import sample_names, sample_path

MODES = {
    "tp1-file": dict(out="k.safetensors", backend="trtllm"),
    "tp2-all": dict(out="k", backend="cutlass", tp_size=2, tp_rank="all"),
    "tp2-ep2-all": dict(out="k", backend="trtllm", tp_size=2, tp_rank="all", ep_size=2),
    "tp4-ep2-all": dict(out="k", backend="cutlass", tp_size=4, tp_rank="all", ep_size=2),
}


def convert(src: Path, tmp: Path, out: str, backend: str, **kw) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    return convert_checkpoint(src, tmp / out, backend, **kw)


def assert_whole(src: Path, back: Path) -> None:
    """``back`` (a restored directory) holds every tensor of ``src``, byte for byte with dtype and shape, and
    nothing else; its config.json is the source's and its index names every tensor in the shard holding it."""
    original, got = all_tensors(src), all_tensors(back)
    assert sorted(got) == sorted(original)
    bad = [k for k in original if not same_tensor(original[k], got[k])]
    assert not bad, bad[:5]
    assert json.loads((back / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    index = json.loads((back / safe_io.INDEX).read_text())
    assert sorted(index["weight_map"]) == sorted(original)
    for name, file in index["weight_map"].items():
        assert name in all_tensors(back / file)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in original.values())


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("sample", sample_names())
def test_every_sample_converts_and_restores_whole(tmp_path, sample, mode):
    src = sample_path(sample)
    kw = dict(MODES[mode])
    if mode == "tp4-ep2-all" and sample == "deepseek-v3-fp8":
        kw.update(tp_size=2)  # its 128-value scale blocks allow 2-way intermediate slices at most
    out = convert(src, tmp_path, **kw)
    assert_whole(src, restore_checkpoint(out, tmp_path / "back"))


def test_gpt_oss_tp2_keeps_router_on_rank_0_only(tmp_path):
    """gpt-oss at --tp 2 --rank all: the router (weight and bias) is in rank-0 alone, under its own name and bytes;
    rank-1 holds its expert slices only; the two restore into the whole source."""
    src = sample_path("gpt-oss-mxfp4")
    out = convert_checkpoint(src, tmp_path / "k", "cutlass", 2, "all")
    source = all_tensors(src)
    router = {k for k in source if ".router." in k}
    assert router == {"model.layers.0.mlp.router.weight", "model.layers.0.mlp.router.bias"}
    r0, r1 = all_tensors(out / "rank-0"), all_tensors(out / "rank-1")
    assert router <= set(r0) and not router & set(r1)
    assert all(same_tensor(r0[k], source[k]) for k in router)
    assert set(r0) - router == set(r1)  # the same kernel tensors, each rank's slice
    assert_whole(src, restore_checkpoint(out, tmp_path / "back"))


def test_one_rank_alone(tmp_path):
    """--rank 0 of --tp 2 holds its expert slice and every unchanged tensor; --rank 1, its slice only."""
    src = sample_path("deepseek-v3-fp8")
    source = all_tensors(src)
    kept = {k for k in source if ".experts." not in k or "shared_experts" in k}
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in kept and "model.layers.0.mlp.up_proj.weight" in kept
    for rank in (0, 1):
        out = convert_checkpoint(src, tmp_path / f"r{rank}.safetensors", "cutlass", 2, rank)
        got = all_tensors(restore_checkpoint(out, tmp_path / f"back{rank}"))
        assert (set(got) & kept) == (kept if rank == 0 else set())
        assert all(same_tensor(got[k], source[k]) for k in set(got) & kept)
        assert {k for k in got if k not in kept} == set(source) - kept  # the expert tensors, sliced


# ---------------------------------------------------------------------------- generated checkpoints
def whole_model(tmp: Path, base: str = "qwen3-moe-bf16") -> Path:
    """A copy of sample ``base`` with what a real model has besides its MoE layers, in a shard of its own:
    embeddings, final norm, head, an MTP layer's projections and norms (with a router of its own), a 0-d
    scalar, integer and 8-bit tensors and an empty one; structured bytes, the index updated."""
    src = tmp / "model"
    shutil.copytree(sample_path(base), src)
    extra = {
        "model.embed_tokens.weight": coords(1, 37, 32)[0].view(torch.bfloat16),
        "model.norm.weight": random_bytes((64,), torch.float32, seed=1),
        "lm_head.weight": random_bytes((37, 64), torch.bfloat16, seed=2),
        "model.layers.2.eh_proj.weight": random_bytes((64, 128), torch.bfloat16, seed=3),
        "model.layers.2.enorm.weight": random_bytes((64,), torch.bfloat16, seed=4),
        "model.layers.2.mlp.gate.weight": random_bytes((6, 64), torch.bfloat16, seed=5),
        "model.layers.0.self_attn.k_proj.weight_scale": random_bytes((), torch.float32, seed=6),
        "model.layers.0.self_attn.q_proj.weight": random_bytes((64, 64), torch.float8_e4m3fn, seed=7),
        "model.rotary.inv_freq_ids": torch.arange(5, dtype=torch.int64) * 7 + 3,
        "model.empty": torch.empty((0, 4), dtype=torch.int8),
    }
    save_file(extra, str(src / "model-extra.safetensors"))
    index = json.loads((src / safe_io.INDEX).read_text())
    index["weight_map"].update(dict.fromkeys(extra, "model-extra.safetensors"))
    (src / safe_io.INDEX).write_text(json.dumps(index))
    return src


@pytest.mark.parametrize("chunk", [unchanged.CHUNK_BYTES, 40])
def test_a_whole_model_round_trips_in_chunks_and_ranks(tmp_path, monkeypatch, chunk):
    """Every tensor kind besides the MoE layers comes back byte for byte, copied whole or in chunks of a few
    rows (``chunk`` bytes), from one file, every TP rank and every EP x TP rank."""
    monkeypatch.setattr(unchanged, "CHUNK_BYTES", chunk)
    src = whole_model(tmp_path)
    for name, kw in MODES.items():
        out = convert(src, tmp_path / name, **kw)
        assert_whole(src, restore_checkpoint(out, tmp_path / name / "back"))


def test_a_part_converted_keeps_every_other_tensor_but_the_left_out_experts(tmp_path):
    """--layer 1: layer 1 converted, layer 0's routed experts not written (not the bulk of a model copied), every
    other tensor (layer 0's router included) on rank 0; restore gives the source less layer 0's experts."""
    src = whole_model(tmp_path)
    source = all_tensors(src)
    out = convert_checkpoint(src, tmp_path / "k", "trtllm", 2, "all", layers=[1])
    r0, r1 = all_tensors(out / "rank-0"), all_tensors(out / "rank-1")
    layer0 = {k for k in source if k.startswith("model.layers.0.mlp.experts.")}
    assert len(layer0) == 18 and not layer0 & (set(r0) | set(r1))
    assert "model.layers.0.mlp.gate.weight" in r0 and "lm_head.weight" in r0
    assert set(r1) == {k for k in r0 if k.startswith("model.layers.1.mlp.experts.")}
    back = all_tensors(restore_checkpoint(out, tmp_path / "back"))
    assert sorted(back) == sorted(set(source) - layer0)
    assert all(same_tensor(back[k], source[k]) for k in back)


def test_an_edited_unchanged_tensor_is_refused(tmp_path):
    """A byte of a carried tensor changed after conversion: restore fails on its checksum and writes nothing."""
    src = whole_model(tmp_path)
    out = convert_checkpoint(src, tmp_path / "k.safetensors", "cutlass")
    raw = bytearray(out.read_bytes())
    header = 8 + int.from_bytes(raw[:8], "little")
    lo, _ = json.loads(raw[8:header])["lm_head.weight"]["data_offsets"]
    raw[header + lo] ^= 0xFF
    out.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="lm_head.weight: checksum mismatch"):
        restore_checkpoint(out, tmp_path / "back")
    assert not (tmp_path / "back").exists()


def test_a_dtype_torch_cannot_hold_is_refused_before_writing(tmp_path):
    src = whole_model(tmp_path)
    save_file({"model.f64": torch.arange(3, dtype=torch.float64)}, str(src / "model-extra.safetensors"))
    index = json.loads((src / safe_io.INDEX).read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != "model-extra.safetensors"}
    index["weight_map"]["model.f64"] = "model-extra.safetensors"
    (src / safe_io.INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model.f64 is stored as 'F64'"):
        convert_checkpoint(src, tmp_path / "k", "cutlass")
    assert not (tmp_path / "k").exists() or not any((tmp_path / "k").iterdir())


# ---------------------------------------------------------------------------- reproducible bytes
def files_of(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("sample", ["deepseek-v3-fp8", "gpt-oss-mxfp4"])
def test_the_same_source_anywhere_gives_the_same_bytes(tmp_path, sample):
    """Two copies of a sample (other directories, other mtimes) convert into byte-identical files, directory and
    single file, one rank or every rank; the files name neither directory; restore likewise."""
    copies = []
    for k, where in enumerate(("a/deep/copy", "b")):
        d = tmp_path / where / sample
        shutil.copytree(sample_path(sample), d)
        for f in d.iterdir():
            os.utime(f, ns=(10**18 + k * 10**15, 10**18 + k * 10**15))
        copies.append(d)
    runs = [
        dict(out="k.safetensors", backend="trtllm"),
        dict(out="k", backend="cutlass", tp_size=2, tp_rank="all"),
        dict(out="k", backend="cutlass", shard_size=200_000),
    ]
    for i, kw in enumerate(runs):
        outs = [convert(c, tmp_path / f"out{i}-{k}", **kw) for k, c in enumerate(copies)]
        got = [files_of(o) if o.is_dir() else {o.name: o.read_bytes()} for o in outs]
        assert got[0] == got[1], kw
        for data in got[0].values():
            assert str(tmp_path).encode() not in data and b"/work/" not in data
        backs = [files_of(restore_checkpoint(o, o.parent / "back")) for o in outs]
        assert backs[0] == backs[1]
        assert all(str(tmp_path).encode() not in data for data in backs[0].values())


def test_source_identity_is_content_not_place_or_time(tmp_path):
    """The source record is sizes and header digests: a copy elsewhere with another mtime records the same; a
    changed tensor header records another (what resume compares)."""
    src = sample_path("mixtral-bf16")
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    shard = copy / "model-00001-of-00001.safetensors"
    os.utime(shard, ns=(1, 1))
    one = header_identity(src / shard.name)
    assert one == header_identity(shard) and set(one) == {"bytes", "header_sha256"}
    assert one["bytes"] == shard.stat().st_size
    tensors = all_tensors(shard)
    tensors["model.layers.0.block_sparse_moe.gate.weight"] = tensors["model.layers.0.block_sparse_moe.gate.weight"][:1]
    save_file(tensors, str(shard))
    assert header_identity(shard)["header_sha256"] != one["header_sha256"]
    meta = read_kernel_metadata(convert_checkpoint(src, tmp_path / "k.safetensors", "cutlass"))
    assert "source" not in meta and meta["source_files"] == {shard.name: one}


def test_resume_keeps_the_shards_of_the_same_source_from_another_place(tmp_path, capsys):
    """resume identifies the source by content: a copy of it elsewhere (another mtime) keeps every shard."""
    src = sample_path("qwen3-moe-bf16")
    out = tmp_path / "k"
    convert_checkpoint(src, out, "cutlass", shard_size=200_000)
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    for f in copy.iterdir():
        os.utime(f, ns=(1, 1))
    before = files_of(out)
    code = cli_main(
        ["convert", str(copy), str(out), "--backend", "cutlass", "--shard-size", "200000", "--resume", "--json"]
    )
    assert code == 0
    (rank,) = json.loads(capsys.readouterr().out)["ranks"]
    shards = [f for f in before if f.endswith(".safetensors")]
    assert len(shards) > 1 and rank["kept"] == len(shards) and rank["written"] == 0
    assert files_of(out) == before


def test_the_cli_says_what_is_carried_and_restored(tmp_path, capsys):
    """convert --json counts the unchanged tensors per rank (rank 0 holds them), the text line names them;
    restore reports every tensor of the source."""
    src = sample_path("deepseek-v3-fp8")
    source = all_tensors(src)
    experts = {k for k in source if ".experts." in k and "shared_experts" not in k}
    argv = ["convert", "deepseek-v3-fp8", str(tmp_path / "k"), "--backend", "trtllm", "--tp", "2", "--rank", "all"]
    assert cli_main([*argv, "--json", "--no-progress"]) == 0
    ranks = json.loads(capsys.readouterr().out)["ranks"]
    assert [r["unchanged"] for r in ranks] == [len(source) - len(experts), 0] == [14, 0]
    assert cli_main(["restore", str(tmp_path / "k"), str(tmp_path / "back"), "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["tensors"] == len(source) == 50
    argv[2] = str(tmp_path / "k2")
    assert cli_main([*argv, "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any("rank-0" in line and "14 other tensors unchanged" in line for line in lines)
    assert not any("rank-1" in line and "unchanged" in line for line in lines)
