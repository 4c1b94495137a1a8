"""Property-based fuzzing of what a checkpoint's author controls: config.json values, the index, the
shard headers, and golden sets' JSON. Whatever hypothesis puts there, a command ends with exit 0 (a
harmless edit) or one ``error: ... (fix: ...)`` line and exit 2 (exit 1 for goldens that differ),
never a traceback or ``internal error``, and never changes the input.

Bounded (a few dozen derandomized examples per property) so it runs in the normal suite.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from test_bad_inputs import error_after_progress, read_header, run, tree_hash, write_header

from fimoe_lab.resources import sample_path

SAMPLE = "mixtral-bf16"
FUZZ = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


def json_values(max_leaves: int = 8):
    return st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**64), 2**64)
        | st.floats()
        | st.text(max_size=12)
        | st.sampled_from(["\x1b[2J", "../x", "/etc/passwd", "model-00001-of-00001.safetensors"]),
        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
        max_leaves=max_leaves,
    )


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def _fresh(base: Path) -> Path:
    ck = base / f"ck-{os.urandom(4).hex()}"
    shutil.copytree(sample_path(SAMPLE), ck)
    return ck


def _check(argv: list, ck: Path, capsys) -> None:
    before = tree_hash(ck)
    rc, out, err = run([*argv], capsys)
    assert "Traceback" not in err and "internal error" not in err, err
    assert tree_hash(ck) == before
    if rc != 0:
        assert rc == 2, err
        error_after_progress(err)
    shutil.rmtree(ck)


def _inspect_and_convert(ck: Path, capsys) -> None:
    out = ck.parent / f"{ck.name}.safetensors"
    before = tree_hash(ck)
    rc, _, err = run(["convert", ck, out, "--backend", "trtllm", "--no-progress"], capsys)
    assert "Traceback" not in err and "internal error" not in err, err
    assert tree_hash(ck) == before
    if rc != 0:
        assert rc == 2 and not out.exists(), err
        error_after_progress(err)
    elif out.exists():
        out.unlink()
    _check(["inspect", ck], ck, capsys)


@FUZZ
@given(data=st.data())
def test_fuzzed_config_values(base, capsys, data):
    ck = _fresh(base)
    config = json.loads((ck / "config.json").read_text())
    key = data.draw(st.sampled_from(sorted(config) + ["num_hidden_layers", "num_nextn_predict_layers"]))
    if data.draw(st.booleans()):
        config[key] = data.draw(json_values())
    else:
        config.pop(key, None)
    (ck / "config.json").write_text(json.dumps(config))
    _inspect_and_convert(ck, capsys)


@FUZZ
@given(data=st.data())
def test_fuzzed_index(base, capsys, data):
    ck = _fresh(base)
    path = ck / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    wm = index["weight_map"]
    how = data.draw(st.sampled_from(["value", "key", "drop", "whole", "map"]))
    name = data.draw(st.sampled_from(sorted(wm)))
    if how == "value":
        wm[name] = data.draw(json_values(4))
    elif how == "key":
        wm[data.draw(st.text(max_size=40))] = wm.pop(name)
    elif how == "drop":
        del wm[name]
    elif how == "map":
        index["weight_map"] = data.draw(json_values())
    else:
        index = data.draw(json_values())
    path.write_text(json.dumps(index))
    _inspect_and_convert(ck, capsys)


@FUZZ
@given(data=st.data())
def test_fuzzed_shard_header(base, capsys, data):
    ck = _fresh(base)
    shard = next(ck.glob("*.safetensors"))
    header, blob = read_header(shard)
    name = data.draw(st.sampled_from(sorted(header)))
    field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", None]))
    if field is None or not isinstance(header[name], dict):
        header[name] = data.draw(json_values())
    else:
        header[name][field] = data.draw(
            json_values(4) | st.lists(st.integers(-(2**63), 2**64), max_size=4) | st.sampled_from(["U8", "F64", "I4"])
        )
    write_header(shard, header, blob)
    _inspect_and_convert(ck, capsys)


@FUZZ
@given(cases=json_values(12))
def test_fuzzed_golden_set_json(base, capsys, cases):
    d = base / f"g-{os.urandom(4).hex()}"
    d.mkdir()
    save_file({"a": torch.arange(16, dtype=torch.int32)}, str(d / "g.safetensors"))
    (d / "g.json").write_text(json.dumps(cases))
    before = tree_hash(d)
    rc, _, err = run(["goldens", d / "g.json", "--no-progress"], capsys)
    assert "Traceback" not in err and "internal error" not in err, err
    assert tree_hash(d) == before and rc in (0, 1, 2), err
    if rc == 2:
        error_after_progress(err)
    shutil.rmtree(d)
