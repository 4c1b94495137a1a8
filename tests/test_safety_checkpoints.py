"""Inconsistent or hostile checkpoints are refused before anything is planned or allocated.

Generated variants: a tensor duplicated into another shard (with and without an index), an index
entry whose shard lacks the tensor, experts and layers past what config.json declares, a config
claiming 2^24 experts beside a sparse 1 TB filler shard (refused in seconds, well under 1 GB), a
memory limit below what a read needs, JSON nested deeper than any real file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_bad_inputs import BACKEND, copy_sample, expect_error, read_header, run, write_header

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = "qwen3-moe-bf16"  # two shards, an index, two MoE layers of 6 experts


def _shards(ck: Path) -> list[Path]:
    return sorted(ck.glob("*.safetensors"))


def _index(ck: Path) -> dict:
    return json.loads((ck / "model.safetensors.index.json").read_text())


def _copy_tensor(ck: Path, name: str, new_name: str, into: Path) -> None:
    """Append the bytes of ``name`` (wherever it is) to shard ``into`` as ``new_name``."""
    src = next(s for s in _shards(ck) if name in read_header(s)[0])
    header, data = read_header(src)
    lo, hi = header[name]["data_offsets"]
    blob = data[lo:hi]
    h2, d2 = read_header(into)
    h2[new_name] = {**header[name], "data_offsets": [len(d2), len(d2) + len(blob)]}
    write_header(into, h2, d2 + blob)


def _expert_name(ck: Path) -> str:
    return next(n for n in sorted(_index(ck)["weight_map"]) if ".experts.0." in n)


def _duplicate_in_other_shard(ck: Path, keep_index: bool) -> None:
    name = _expert_name(ck)
    home = _index(ck)["weight_map"][name]
    other = next(s for s in _shards(ck) if s.name != home)
    _copy_tensor(ck, name, name, other)
    if not keep_index:
        (ck / "model.safetensors.index.json").unlink()


def _index_names_a_missing_tensor(ck: Path) -> None:
    idx = _index(ck)
    name = _expert_name(ck)
    idx["weight_map"][name.replace("experts.0.", "experts.0.extra_")] = idx["weight_map"][name]
    (ck / "model.safetensors.index.json").write_text(json.dumps(idx))


def _add_names(ck: Path, rename) -> None:
    """Copy every tensor of expert 0 of layer 0 under ``rename(name)`` (into the same shard), in the index too."""
    idx = _index(ck)
    for name in [n for n in sorted(idx["weight_map"]) if ".layers.0." in n and ".experts.0." in n]:
        shard = ck / idx["weight_map"][name]
        _copy_tensor(ck, name, rename(name), shard)
        idx["weight_map"][rename(name)] = shard.name
    (ck / "model.safetensors.index.json").write_text(json.dumps(idx))


def _expert_beyond(e: int):
    return lambda ck: _add_names(ck, lambda n: n.replace(".experts.0.", f".experts.{e}."))


def _layer_beyond(layer: int):
    return lambda ck: _add_names(ck, lambda n: n.replace(".layers.0.", f".layers.{layer}."))


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _deep_config(ck: Path) -> None:
    config = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps(config)[:-1] + ', "x": ' + _nested(100_000) + "}")


def _deep_index(ck: Path) -> None:
    (ck / "model.safetensors.index.json").write_text('{"weight_map": ' + _nested(100_000) + "}")


def _deep_header(ck: Path) -> None:
    shard = _shards(ck)[0]
    raw = ('{"__metadata__": {"x": ' + _nested(100_000) + "}}").encode()
    shard.write_bytes(len(raw).to_bytes(8, "little") + raw)


CASES = {
    "duplicate-with-index": (lambda ck: _duplicate_in_other_shard(ck, True), "is in both"),
    "duplicate-without-index": (lambda ck: _duplicate_in_other_shard(ck, False), "is in both"),
    "index-names-missing-tensor": (_index_names_a_missing_tensor, "whose header has no such tensor"),
    "expert-next": (_expert_beyond(6), "has tensors of experts [6], past the 6 experts"),
    "expert-1000": (_expert_beyond(1000), "has tensors of experts [1000], past the 6 experts"),
    "layer-past-config": (_layer_beyond(5), "past the 2 layers"),
    "layer-far-past-config": (_layer_beyond(4000), "past the 2 layers"),
    "config-nested-deep": (_deep_config, "nests deeper than"),
    "index-nested-deep": (_deep_index, "nests deeper than"),
    "header-nested-deep": (_deep_header, "not a readable safetensors file"),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("command", ["convert", "inspect"])
def test_an_inconsistent_checkpoint_is_refused(case, command, tmp_path, capsys):
    ck = copy_sample(SAMPLE, tmp_path)
    edit, match = CASES[case]
    edit(ck)
    out = tmp_path / "k.safetensors"
    argv = ["convert", ck, out, "--backend", BACKEND, "--no-progress"] if command == "convert" else ["inspect", ck]
    expect_error(argv, capsys, out, [ck], match)


def _sparse_filler(ck: Path, experts: int) -> None:
    """config.json claims ``experts``; a 1 TB sparse shard whose header declares one 1 TB tensor sits beside."""
    config = json.loads((ck / "config.json").read_text())
    config["num_experts"] = experts
    (ck / "config.json").write_text(json.dumps(config))
    size = 1 << 40
    header = json.dumps({"filler": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}}).encode()
    header += b" " * (-len(header) % 8)
    filler = ck / "model-00003-of-00003.safetensors"
    with open(filler, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(8 + len(header) + size)  # sparse: no block is written
    idx = _index(ck)
    idx["weight_map"]["filler"] = filler.name
    (ck / "model.safetensors.index.json").write_text(json.dumps(idx))


# Runs argv[3:] under an address-space limit of argv[1] bytes and writes its peak RSS (KiB) to argv[2]. The
# command is forked from this small interpreter, not from the test process: a child forked from a large
# process counts that process's resident pages in its own peak until it execs.
MEASURED = (
    "import resource, subprocess, sys\n"
    "limit = int(sys.argv[1])\n"
    "resource.setrlimit(resource.RLIMIT_AS, (limit, limit))\n"
    "rc = subprocess.run(sys.argv[3:]).returncode\n"
    "open(sys.argv[2], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))\n"
    "sys.exit(rc)\n"
)


@pytest.mark.parametrize("experts", [1 << 24, 1 << 20, 9])
def test_a_hostile_expert_count_beside_a_sparse_filler_is_refused_fast_and_small(experts, tmp_path):
    ck = copy_sample(SAMPLE, tmp_path)
    _sparse_filler(ck, experts)
    out = tmp_path / "k.safetensors"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "fimoe_lab", "convert", str(ck), str(out), "--backend", BACKEND, "--no-progress"]
    peak = tmp_path / "peak-kib"
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", MEASURED, str(6 << 30), str(peak), *cmd], env=env, stderr=subprocess.PIPE, text=True
    )
    err = proc.stderr
    assert proc.returncode == 2, err
    rss = int(peak.read_text())
    assert time.monotonic() - start < 60 and rss < (1 << 20), rss  # KiB: under 1 GiB
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and f"declares {experts} experts" in lines[0], err
    assert not out.exists()


@pytest.mark.parametrize("limit", ["1000", "8K", "16k"])
def test_a_read_over_the_memory_limit_is_refused_naming_the_variable(limit, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FIMOE_LAB_MAX_MEMORY", limit)
    ck = copy_sample(SAMPLE, tmp_path)
    out = tmp_path / "k.safetensors"
    rc, _, err = run(["convert", ck, out, "--backend", BACKEND, "--no-progress"], capsys)
    assert rc == 2 and "over the limit" in err and "FIMOE_LAB_MAX_MEMORY" in err, err
    assert not out.exists()
    monkeypatch.setenv("FIMOE_LAB_MAX_MEMORY", "1G")
    rc, _, err = run(["convert", ck, out, "--backend", BACKEND, "--no-progress"], capsys)
    assert rc == 0, err
