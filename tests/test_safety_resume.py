"""``convert --resume`` continues exactly one request: the request recorded in every file convert wrote
(source by content, backend, engine, TP/EP sizes, rank set, layers, alignments, shard size) must be
the one asked, else the run is refused naming the difference, and nothing in OUT changes.

Generated variants: each option changed on its own from a finished ``--tp 2 --rank all`` output, the
source changed by content (another checkpoint, an edited config, an edited shard header), a file
without a recorded request; the same request resumes and keeps every shard.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from test_bad_inputs import error_after_progress, run, tree_hash

from fimoe_lab.checkpoints import request as requests
from fimoe_lab.checkpoints import safe_io
from fimoe_lab.cli import main
from fimoe_lab.resources import sample_path

SAMPLE = "qwen3-moe-bf16"
SHARD = "40000"
BASE = ["--backend", "cutlass", "--tp", "2", "--rank", "all", "--shard-size", SHARD, "--no-progress"]


def _set(args: list[str], flag: str, value: str | None) -> list[str]:
    """``args`` with ``flag`` given ``value`` (None: a switch), replacing the flag's old value."""
    out = list(args)
    if flag in out:
        i = out.index(flag)
        del out[i : i + 2]
    return out + ([flag] if value is None else [flag, value])


VARIANTS = {
    "rank-1": (_set(BASE, "--rank", "1"), "--rank ('all' recorded, 1 asked)"),
    "rank-0": (_set(BASE, "--rank", "0"), "--rank ('all' recorded, 0 asked)"),
    "backend": (_set(BASE, "--backend", "trtllm"), "--backend ('cutlass' recorded, 'trtllm' asked)"),
    "tp": (_set(BASE, "--tp", "4"), "--tp (2 recorded, 4 asked)"),
    "ep": (_set(BASE, "--ep", "2"), "--ep (1 recorded, 2 asked)"),
    "layer": (_set(BASE, "--layer", "1"), "--layer ([0, 1] recorded, [1] asked)"),
    "alignment": (_set(BASE, "--intermediate-alignment", "256"), "--intermediate-alignment (None recorded, 256"),
    "hidden": (_set(BASE, "--hidden-alignment", "256"), "--hidden-alignment (None recorded, 256"),
    "engine": (_set(BASE, "--engine", "sglang-0.5.23"), "--engine ('vllm-0.34' recorded, 'sglang-0.5.23' asked)"),
    "shard-size": (_set(BASE, "--shard-size", "80000"), "--shard-size (40000 recorded, 80000 asked)"),
}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished ``--tp 2 --rank all`` convert of a copy of the sample."""
    tmp = tmp_path_factory.mktemp("resume")
    src = tmp / "src"
    shutil.copytree(sample_path(SAMPLE), src)
    out = tmp / "out"
    assert main([str(a) for a in ["convert", src, out, *BASE]]) == 0
    assert (out / "rank-0" / safe_io.INDEX).is_file() and (out / "rank-1" / safe_io.INDEX).is_file()
    return out


def _copy(finished: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the finished output beside a copy of its source (so each case may change either)."""
    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(finished.parent / "src", src)
    shutil.copytree(finished, out)
    return src, out


def _refused(argv: list, capsys, out: Path, src: Path, match: str) -> None:
    before, source = tree_hash(out), tree_hash(src)
    rc, _, err = run(argv, capsys)
    assert rc == 2, err
    line = error_after_progress(err, during=False)[0]
    assert "Traceback" not in err and "another convert" in line and match in line, line
    assert tree_hash(out) == before and tree_hash(src) == source  # rank-0/ and rank-1/ as they were
    assert sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")) == []  # no lock left


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_resume_of_another_request_is_refused_naming_the_difference(variant, finished, tmp_path, capsys):
    src, out = _copy(finished, tmp_path)
    args, match = VARIANTS[variant]
    _refused(["convert", src, out, *args, "--resume"], capsys, out, src, match)


def _edit_config(src: Path) -> None:
    config = json.loads((src / "config.json").read_text())
    config["architectures"] = ["Edited"]
    (src / "config.json").write_text(json.dumps(config))


def _edit_shard_header(src: Path) -> None:
    shard = sorted(src.glob("*.safetensors"))[-1]
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header["__metadata__"] = {**header.get("__metadata__", {}), "edited": "yes"}
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    shard.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n :])


def _other_checkpoint(src: Path) -> None:
    shutil.rmtree(src)
    shutil.copytree(sample_path("deepseek-v3-fp8"), src)


SOURCE_EDITS = {
    "config": (_edit_config, "the source's config.json"),
    "shard-header": (_edit_shard_header, "the source files model-00002-of-00002.safetensors"),
    "other-checkpoint": (_other_checkpoint, "the source"),
}


@pytest.mark.parametrize("edit", sorted(SOURCE_EDITS))
def test_resume_from_another_source_is_refused(edit, finished, tmp_path, capsys):
    src, out = _copy(finished, tmp_path)
    fn, match = SOURCE_EDITS[edit]
    fn(src)
    _refused(["convert", src, out, *BASE, "--resume"], capsys, out, src, match)


def test_a_file_without_a_recorded_request_is_not_resumed(finished, tmp_path, capsys):
    src, out = _copy(finished, tmp_path)
    shard = sorted((out / "rank-1").glob("model-*.safetensors"))[0]
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    del header["__metadata__"][requests.REQUEST_KEY]
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    shard.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n :])
    before = tree_hash(out)
    rc, _, err = run(["convert", src, out, *BASE, "--resume"], capsys)
    assert rc == 2 and "records no convert request" in err and "--force" in err, err
    assert tree_hash(out) == before


def test_the_same_request_resumes_keeping_every_shard_and_force_replaces(finished, tmp_path, capsys):
    src, out = finished.parent / "src", tmp_path / "out"
    assert main([str(a) for a in ["convert", src, out, *BASE]]) == 0
    (out / "rank-1" / safe_io.INDEX).unlink()  # as if interrupted before the last index
    files = {p: p.stat().st_mtime_ns for p in out.rglob("model-*.safetensors")}
    rc, _, err = run(["convert", src, out, *BASE, "--resume"], capsys)
    assert rc == 0, err
    assert {p: p.stat().st_mtime_ns for p in out.rglob("model-*.safetensors")} == files  # all kept
    assert tree_hash(out) == tree_hash(finished)  # the index written again, byte for byte
    rc, _, err = run(["convert", src, out, *_set(BASE, "--rank", "1"), "--force"], capsys)  # asked to replace it
    assert rc == 0, err
    assert not (out / "rank-0").exists() and (out / safe_io.INDEX).is_file()


def test_a_single_file_is_resumed_only_by_its_own_request(finished, tmp_path, capsys):
    src = finished.parent / "src"
    out = tmp_path / "one.safetensors"
    rc, _, err = run(["convert", src, out, "--backend", "cutlass", "--no-progress"], capsys)
    assert rc == 0, err
    before = out.read_bytes()
    _refused(
        ["convert", src, out, "--backend", "trtllm", "--no-progress", "--resume"],
        capsys,
        out,
        src,
        "--backend ('cutlass' recorded, 'trtllm' asked)",
    )
    assert out.read_bytes() == before
    rc, _, err = run(["convert", src, out, "--backend", "cutlass", "--no-progress", "--resume"], capsys)
    assert rc == 0 and out.read_bytes() == before, err
