"""``--json`` on ``plan``, ``demo`` and ``goldens``: one JSON object on stdout and nothing else,
the fields the ``--help`` text names, the same facts as the table, and the same exit codes."""

from __future__ import annotations

import json
import math
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fimoe_lab.cli import build_parser, main
from fimoe_lab.cli._common import EXIT_BAD_INPUT
from fimoe_lab.cli.core import DEMO_JSON, GOLDENS_JSON, PLAN_JSON
from tests.test_viz import ref_w13_rows


def run_json(capsys, argv: list[str]) -> tuple[int, dict, str]:
    """``(exit status, the parsed stdout, stderr)`` of ``fimoe-lab ARGV --json``; stdout must be exactly one JSON."""
    code = main(argv + ["--json"])
    out = capsys.readouterr()
    return code, json.loads(out.out), out.err


def keys_of(schema: str) -> set[str]:
    """The quoted field names of a ``--help`` schema."""
    return set(re.findall(r'"(\w+)"', schema))


def test_help_of_each_command_gives_its_json_fields():
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    for command, schema in (("plan", PLAN_JSON), ("demo", DEMO_JSON), ("goldens", GOLDENS_JSON)):
        text = " ".join(sub[command].format_help().split())
        assert "--json" in text and " ".join(schema.split()) in text


def test_plan_json_has_the_table_facts_and_traces_a_byte(capsys):
    argv = ["plan", "--format", "mxfp8", "--backend", "trtllm", "--intermediate", "96", "--hidden", "160"]
    code, doc, err = run_json(capsys, argv + ["--where", "5,3"])
    assert code == 0 and err == ""
    assert set(doc) | set(doc["layer"]) | {k for p in doc["plans"] for k in p} <= keys_of(PLAN_JSON)
    assert doc["layer"] == dict(intermediate=96, hidden=160, experts=4, gated=True, per_token=False)
    (plan,) = doc["plans"]
    assert plan["cannot"] is None and doc["failures"] == 0
    assert all(t["round_trip"] for t in plan["tensors"])
    w13 = plan["tensors"][0]
    assert w13["name"] == "w13" and w13["in_shape"] == [2 * 96, 160]  # one byte per MXFP8 element
    # the trace: kernel byte (5, 3) of w13 comes from checkpoint row ref_w13_rows(96, 128)[5], column 3
    padded = w13["out_shape"][0] // 2
    assert plan["where"][0]["coords"] == [5, 3]
    assert plan["where"][-1]["coords"] == [int(ref_w13_rows(96, padded)[5]), 3]
    # the table says the same
    assert main(argv) == 0
    table = capsys.readouterr().out
    for t in plan["tensors"]:
        row = (
            f"{t['name']:<10} {str(tuple(t['in_shape'])):<14} {str(tuple(t['out_shape'])):<18} {t['pad_percent']:6.1f}"
        )
        assert row in table and " >> ".join(t["steps"]) in table


def test_plan_json_that_cannot_run_still_prints_json_and_exits_2(capsys):
    argv = ["plan", "--format", "fp8-block", "--intermediate", "100", "--backend", "trtllm"]
    code, doc, err = run_json(capsys, argv)
    assert code == EXIT_BAD_INPUT
    (plan,) = doc["plans"]
    assert plan["tensors"] == [] and "not a multiple of the 128-row scale block" in plan["cannot"]
    (line,) = err.splitlines()
    assert line.startswith("error: plan: fp8-block trtllm cannot lay out intermediate 100") and "'cannot'" in line


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(inter=st.integers(1, 300), hidden=st.integers(1, 40).map(lambda h: 16 * h), experts=st.integers(1, 3))
def test_plan_json_shapes_for_any_size(capsys, inter, hidden, experts):
    argv = ["plan", "--format", "fp8", "--backend", "cutlass", "--intermediate", str(inter), "--hidden", str(hidden)]
    code, doc, _ = run_json(capsys, argv + ["--experts", str(experts)])
    (plan,) = doc["plans"]
    if plan["cannot"] is not None:
        assert code == EXIT_BAD_INPUT and plan["tensors"] == []
        return
    assert code == 0 and doc["failures"] == 0 and doc["layer"]["experts"] == experts
    shapes = {t["name"]: t for t in plan["tensors"]}
    assert shapes["w13"]["in_shape"] == [2 * inter, hidden] and shapes["w2"]["in_shape"] == [hidden, inter]
    for t in plan["tensors"]:
        want = 100.0 * (1 - math.prod(t["in_shape"]) / math.prod(t["out_shape"]))
        assert abs(t["pad_percent"] - want) < 1e-3 and t["round_trip"]


def test_demo_json_lists_every_layer_and_backend(tmp_path, capsys):
    code, doc, err = run_json(capsys, ["demo", "deepseek-v3-fp8", "--out", str(tmp_path)])
    assert code == 0 and doc["failures"] == 0 and doc["tp"] == 2 and doc["out"] == str(tmp_path)
    assert set(doc) | {k for r in doc["layers"] + doc["health"] for k in r} <= keys_of(DEMO_JSON)
    assert any("dead expert" in h["warning"] for h in doc["health"])  # the sample has one, planted
    backends = {(r["layer"], r["backend"]) for r in doc["layers"]}
    assert {b for _, b in backends} == {"trtllm", "cutlass"} and len(backends) == len(doc["layers"])
    for r in doc["layers"]:
        path = tmp_path / f"deepseek-v3-fp8-L{r['layer']}-{r['backend']}-tp2.safetensors"
        assert r["cannot"] is None and r["exact"] and r["bytes"] == path.stat().st_size
        assert r["padded_intermediate"] >= r["intermediate"]


def test_goldens_json(capsys, tmp_path, monkeypatch):
    from fimoe_lab import goldens

    paths = goldens.default_golden_paths()
    if paths:
        code, doc, _ = run_json(capsys, ["goldens"])
        assert code == 0 and doc["total"] == len(doc["cases"]) == doc["reproduced"] > 0
        assert all(c["ok"] and c["file"] in map(str, paths) for c in doc["cases"])
        assert set(doc) | {k for c in doc["cases"] for k in c} <= keys_of(GOLDENS_JSON)
    # nothing to replay: exit 2, one error line, nothing on stdout
    monkeypatch.setenv("FIMOE_GOLDENS", str(tmp_path))
    assert main(["goldens", "--json"]) == EXIT_BAD_INPUT
    out = capsys.readouterr()
    assert out.out == "" and len(out.err.splitlines()) == 1 and out.err.startswith("error: goldens: ")
    if not paths:
        pytest.skip("no golden files found (set FIMOE_GOLDENS or place shared/goldens beside the checkout)")
