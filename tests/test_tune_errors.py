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
    with pytest.raises(
        OracleError,
        match=r"unknown format 'int4' \(fix: choose one of bf16, fp8, fp8-block, mxfp8, "
        r"nvfp4, mxfp4, mxfp4-mxfp8, mxint4\)",
    ):
        snap.query("int4", "swiglu", 2048, 768, 128, 8, 1)
    with pytest.raises(OracleError, match="unknown format 'nvfp4-per-token'"):  # a quantizer, not a tuner format
        snap.query("nvfp4-per-token", "swiglu", 2048, 768, 128, 8, 1)


def test_unknown_activation_and_layout(snap):
    with pytest.raises(OracleError, match=r"unknown activation 'tanh' \(fix: choose one of swiglu, swiglu_oai, geglu"):
        snap.query("bf16", "tanh", 2048, 768, 128, 8, 1)
    with pytest.raises(
        OracleError, match=r"unknown weight layout 'major-mn' \(fix: choose one of major-k, block-major-k"
    ):
        snap.query("bf16", "swiglu", 2048, 768, 128, 8, 1, layout="major-mn")


@pytest.mark.parametrize(
    "name, key",
    [("silu", "swiglu"), ("swiglu_oai", "swiglu"), ("gelu", "geglu"), ("GeGLU", "geglu"), ("relu2", "relu2")],
)
def test_activation_names_key_the_kernel_activation(snap, name, key):
    shape = (2816, 768, 128, 8, 8) if key == "geglu" else (3072, 1920, 128, 6, 8)  # recorded shapes
    q = TacticQuery("nvfp4", name, *shape).normalized()
    assert q.activation == key and q.key().split("|")[1] == key
    assert q.request()["activation"] == {"swiglu": "Swiglu", "geglu": "Geglu", "relu2": "Relu2"}[key]
    answer = snap.ask(q)
    assert answer.known and answer.count > 0
    assert answer.count == snap.query("nvfp4", key, *shape).count


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(hidden=0), "hidden must be a positive integer"),
        (dict(tokens=-1), "tokens must be a positive integer"),
        (dict(top_k=200), "top_k=200 exceeds experts=128"),
    ],
)
def test_impossible_shapes(snap, kw, msg):
    args = dict(format="bf16", activation="swiglu", hidden=2048, intermediate=768, experts=128, top_k=8, tokens=1)
    args.update(kw)
    with pytest.raises(OracleError, match=msg):
        snap.ask(TacticQuery(**args))


def test_per_token_only_for_nvfp4(snap):
    with pytest.raises(OracleError, match="per-token .* only for nvfp4"):
        snap.query("mxfp8", "swiglu", 2048, 768, 128, 8, 1, per_token=True)


def test_shape_outside_the_old_snapshot_is_answered_by_the_model(snap):
    a = snap.query("bf16", "swiglu", 2048 + 7, 777, 128, 8, 3)
    assert a.known and a.count == 0 and a.reason  # odd K: no BlockMajorK kernel takes it
    assert a.source["kind"] == "model"


def test_live_without_module_says_how_to_build(tmp_path, monkeypatch):
    monkeypatch.setenv("FIMOE_LAB_CACHE", str(tmp_path))
    monkeypatch.setattr("fimoe_lab.tune.oracle._blackwell_gpu", lambda: False)
    with pytest.raises(OracleError, match=r"python -m fimoe_lab.tune.build"):
        TacticOracle(mode="live")


def test_no_snapshot_no_module(tmp_path, monkeypatch):
    monkeypatch.setenv("FIMOE_LAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FIMOE_LAB_TACTICS_DIR", str(tmp_path / "none"))
    monkeypatch.setattr("fimoe_lab.tune.oracle._blackwell_gpu", lambda: False)
    with pytest.raises(OracleError, match="no TRTLLM-Gen kernel table found"):
        TacticOracle(mode="auto")


def test_build_reports_missing_prereqs(monkeypatch):
    pre = build.Prereqs(
        flashinfer_version="0.6.13",
        cubin_version="0.6.12",
        nvcc=None,
        cuda_home=None,
        ninja="/usr/bin/ninja",
        cc="/usr/bin/cc",
    )
    probs = " | ".join(pre.problems())
    assert "flashinfer-cubin 0.6.12 does not match flashinfer-python 0.6.13" in probs
    assert "nvcc not found" in probs
    pre = build.Prereqs("0.6.13", None, "/x/nvcc", "/x", "ninja", "cc")
    assert "flashinfer-cubin is not installed" in pre.problems()[0]
    monkeypatch.setattr(build, "find_module", lambda: None)
    monkeypatch.setattr(build, "check_prereqs", lambda: build.Prereqs("0.6.13", None, None, None, None, "cc"))
    with pytest.raises(build.BuildError, match="cannot build"):
        build.build_module(progress=False)


def test_worker_exit_is_reported_and_restarted():
    # A stand-in worker that behaves like FlashInfer's runner calling exit(1) mid-query.
    code = (
        "import sys, json; print(json.dumps({'ready': True}), flush=True); "
        "sys.stdin.readline(); sys.stderr.write('[TensorRT-LLM][ERROR] no driver\\n'); sys.exit(1)"
    )
    w = _Worker([sys.executable, "-c", code], env=None)
    with pytest.raises(WorkerDied, match=r"FlashInfer exited with status 1 during this query.*no driver"):
        w.ask({"x": 1})
    with pytest.raises(WorkerDied):  # restarted, dies again: each death is reported
        w.ask({"x": 2})
    assert w.restarts == 1


def test_worker_that_hangs_is_stopped_after_the_timeout_and_restarted():
    code = (
        "import sys, json, time; print(json.dumps({'ready': True}), flush=True); sys.stdin.readline(); time.sleep(60)"
    )
    w = _Worker([sys.executable, "-c", code], env=None, timeout=1.0)
    with pytest.raises(WorkerDied, match=r"no answer within 1 s to this query; it was stopped"):
        w.ask({"x": 1})
    assert w.proc is None  # killed, not left running
    with pytest.raises(WorkerDied, match="no answer"):  # the next query starts a fresh worker
        w.ask({"x": 2})
    assert w.restarts == 1


def test_worker_that_never_says_ready_is_stopped():
    w = _Worker([sys.executable, "-c", "import time; time.sleep(60)"], env=None, timeout=1.0)
    with pytest.raises(WorkerDied, match="while starting"):
        w.ask({"x": 1})


@pytest.mark.parametrize("answer", ["{'id': 999, 'ok': True, 'configs': []}", "'not json at all'", "[1, 2]"])
def test_worker_answer_out_of_turn_is_refused(answer):
    code = (
        "import sys, json; print(json.dumps({'ready': True}), flush=True); "
        f"sys.stdin.readline(); print(json.dumps({answer}) if not isinstance({answer}, str) else {answer}, flush=True); "
        "sys.stdin.readline()"
    )
    w = _Worker([sys.executable, "-c", code], env=None, timeout=10.0)
    with pytest.raises(WorkerDied, match="out of turn .expected id 1."):
        w.ask({"x": 1})
    assert w.proc is None


def test_worker_answer_with_its_id_is_returned():
    code = (
        "import sys, json; print(json.dumps({'ready': True}), flush=True)\n"
        "for line in sys.stdin:\n"
        "    req = json.loads(line); print(json.dumps({'id': req['id'], 'ok': True, 'echo': req['x']}), flush=True)"
    )
    w = _Worker([sys.executable, "-c", code], env=None, timeout=10.0)
    assert w.ask({"x": 7}) == {"id": 1, "ok": True, "echo": 7}
    assert w.ask({"x": 8})["echo"] == 8
    w.close()


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "fimoe_lab", *args],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "FIMOE_LAB_CACHE": "/nonexistent-fimoe"},
    )


def test_cli_unknown_format_and_preset():
    r = _cli("tactics", "--format", "int4", "--hidden", "1", "--inter", "1", "--experts", "1", "--top-k", "1")
    assert r.returncode == 2 and "is not one of: bf16, fp8, fp8-block, mxfp8, nvfp4, mxfp4" in r.stderr
    assert "Traceback" not in r.stderr
    r = _cli("tune", "--model", "llama-2", "--format", "bf16")
    assert r.returncode == 2 and "deepseek-v3" in r.stderr and "Traceback" not in r.stderr


def test_cli_tactics_json_outside_the_old_snapshot_is_answered():
    r = _cli(
        "tactics",
        "--format",
        "bf16",
        "--hidden",
        "2055",
        "--inter",
        "777",
        "--experts",
        "128",
        "--top-k",
        "8",
        "--tokens",
        "1,8",
        "--json",
        "--source",
        "model",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [d["tokens"] for d in out] == [1, 8]
    assert all(d["count"] == 0 and d["reason"] for d in out)
