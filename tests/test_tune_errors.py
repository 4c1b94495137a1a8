"""Bad input and missing pieces give clear messages, not tracebacks (no module or GPU needed)."""
import json
import subprocess
import sys

import pytest

from fimoe_lab.tune import build
from fimoe_lab.tune.oracle import OracleError, TacticOracle, TacticQuery, WorkerDied, _Worker


@pytest.fixture(scope="module")
def snap():
    return TacticOracle(mode="snapshot")


def test_unknown_format_lists_valid(snap):
    with pytest.raises(OracleError, match="unknown format 'int4'; valid: bf16, fp8, fp8-block, mxfp8, nvfp4, mxfp4"):
        snap.query("int4", "swiglu", 2048, 768, 128, 8, 1)


def test_unknown_activation_and_layout(snap):
    with pytest.raises(OracleError, match="unknown activation 'gelu'"):
        snap.query("bf16", "gelu", 2048, 768, 128, 8, 1)
    with pytest.raises(OracleError, match="unknown weight layout 'major-mn'"):
        snap.query("bf16", "swiglu", 2048, 768, 128, 8, 1, layout="major-mn")


@pytest.mark.parametrize("kw, msg", [
    (dict(hidden=0), "hidden must be a positive integer"),
    (dict(tokens=-1), "tokens must be a positive integer"),
    (dict(top_k=200), "top_k=200 exceeds experts=128"),
])
def test_impossible_shapes(snap, kw, msg):
    args = dict(format="bf16", activation="swiglu", hidden=2048, intermediate=768, experts=128, top_k=8, tokens=1)
    args.update(kw)
    with pytest.raises(OracleError, match=msg):
        snap.ask(TacticQuery(**args))


def test_per_token_only_for_nvfp4(snap):
    with pytest.raises(OracleError, match="per-token .* only for nvfp4"):
        snap.query("mxfp8", "swiglu", 2048, 768, 128, 8, 1, per_token=True)


def test_outside_snapshot_is_unknown_not_guessed(snap):
    a = snap.query("bf16", "swiglu", 2048 + 7, 777, 128, 8, 3)
    assert a.count is None and not a.known
    assert "not in the snapshot" in a.reason
    assert a.source["kind"] == "snapshot"


def test_live_without_module_says_how_to_build(tmp_path, monkeypatch):
    monkeypatch.setenv("FIMOE_LAB_CACHE", str(tmp_path))
    monkeypatch.setattr("fimoe_lab.tune.oracle._blackwell_gpu", lambda: False)
    with pytest.raises(OracleError, match=r"python -m fimoe_lab.tune.build"):
        TacticOracle(mode="live")


def test_no_snapshot_no_module(tmp_path, monkeypatch):
    monkeypatch.setenv("FIMOE_LAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FIMOE_LAB_TACTICS_DIR", str(tmp_path / "none"))
    monkeypatch.setattr("fimoe_lab.tune.oracle._blackwell_gpu", lambda: False)
    with pytest.raises(OracleError, match="no tactic snapshot"):
        TacticOracle(mode="auto")


def test_build_reports_missing_prereqs(monkeypatch):
    pre = build.Prereqs(flashinfer_version="0.6.13", cubin_version="0.6.12", nvcc=None, cuda_home=None,
                        ninja="/usr/bin/ninja", cc="/usr/bin/cc")
    probs = " | ".join(pre.problems())
    assert "flashinfer-cubin 0.6.12 does not match flashinfer-python 0.6.13" in probs
    assert "nvcc not found" in probs
    pre = build.Prereqs("0.6.13", None, "/x/nvcc", "/x", "ninja", "cc")
    assert "flashinfer-cubin is not installed" in pre.problems()[0]
    monkeypatch.setattr(build, "find_module", lambda: None)
    monkeypatch.setattr(build, "check_prereqs",
                        lambda: build.Prereqs("0.6.13", None, None, None, None, "cc"))
    with pytest.raises(build.BuildError, match="cannot build"):
        build.build_module(progress=False)


def test_worker_exit_is_reported_and_restarted():
    # A stand-in worker that behaves like FlashInfer's runner calling exit(1) mid-query.
    code = ("import sys, json; print(json.dumps({'ready': True}), flush=True); "
            "sys.stdin.readline(); sys.stderr.write('[TensorRT-LLM][ERROR] no driver\\n'); sys.exit(1)")
    w = _Worker([sys.executable, "-c", code], env=None)
    with pytest.raises(WorkerDied, match=r"FlashInfer exited with status 1 during this query.*no driver"):
        w.ask({"x": 1})
    with pytest.raises(WorkerDied):   # restarted, dies again: each death is reported
        w.ask({"x": 2})
    assert w.restarts == 1


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "fimoe_lab", *args], capture_output=True, text=True,
                          env={**__import__("os").environ, "FIMOE_LAB_CACHE": "/nonexistent-fimoe"})


def test_cli_unknown_format_and_preset():
    r = _cli("tactics", "--format", "int4", "--hidden", "1", "--inter", "1", "--experts", "1", "--top-k", "1")
    assert r.returncode == 2 and "is not one of: bf16, fp8, fp8-block, mxfp8, nvfp4, mxfp4" in r.stderr
    assert "Traceback" not in r.stderr
    r = _cli("tune", "--model", "llama-2", "--format", "bf16")
    assert r.returncode == 2 and "deepseek-v3" in r.stderr and "Traceback" not in r.stderr


def test_cli_tactics_json_outside_snapshot():
    r = _cli("tactics", "--format", "bf16", "--hidden", "2055", "--inter", "777", "--experts", "128",
             "--top-k", "8", "--tokens", "1,8", "--json", "--source", "snapshot")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [d["tokens"] for d in out] == [1, 8]
    assert all(d["count"] is None and "not in the snapshot" in d["reason"] for d in out)
