"""The tactic-validity model (:mod:`fimoe_lab.tune.validity`) answers what FlashInfer's op does.

* Against FlashInfer's own recorded answers (``tests/fixtures/tactics``, every shape of the
  snapshot: count, per-tile counts, rejections); needs no module.
* Against the live module (``TacticOracle(mode="live")``) on ``FIMOE_VALIDITY_SHAPES``
  (default 10000) random shapes over every format, activation, layout and per-token setting:
  count and the exact ``(tile_N, config)`` list.  Skipped where the module is not built.
* The kernel table: versioned, small, and what ``scripts/extract_trtllm_kernels.py`` writes
  from the kernel set's headers; the tile-candidate rule against exact arithmetic; answer
  invariants (hypothesis); the oracle's model mode, including "unknown" for kernel sets
  that are not shipped.
"""

from __future__ import annotations

import collections
import fractions
import gzip
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tactic_snapshot import load_snapshot, random_queries, snapshot_files

from fimoe_lab.cli import main
from fimoe_lab.errors import OracleError
from fimoe_lab.specs import FORMATS, tuner_formats
from fimoe_lab.tune import build, validity
from fimoe_lab.tune.oracle import MAX_GEMM_DIM, TacticOracle, TacticQuery, model_answer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def table() -> validity.KernelTable:
    t = validity.find_table()
    assert t is not None, f"no kernel table shipped in {validity.kernels_dir()}"
    return t


# --------------------------------------------------------------------------- (a) snapshot
def test_model_equals_the_recorded_snapshot_on_every_shape(table):
    files = snapshot_files()
    assert files, "the recorded snapshot fixture is missing"
    checked = 0
    for path in files:
        meta, entries = load_snapshot(path)
        if (meta["flashinfer"], meta["kernel_set"]) != (table.flashinfer, table.kernel_set):
            continue
        wrong = []
        for key, rec in entries.items():
            m = model_answer(table, TacticQuery.from_key(key))
            if "error" in rec:
                ok = m.error is not None and not m.configs
            else:
                ok = m.error is None and {str(t): n for t, n in m.per_tile.items()} == rec
            if not ok:
                wrong.append((key, rec, m.per_tile, m.error))
        assert not wrong, f"{len(wrong)} of {len(entries)} recorded shapes differ, e.g. {wrong[:3]}"
        checked += len(entries)
    assert checked > 5000, f"no snapshot of {table.flashinfer}/{table.kernel_set} in the fixtures"


def test_recorded_rejections_are_rejections_with_the_same_cause(table):
    meta, entries = load_snapshot(snapshot_files()[-1])
    causes = collections.Counter()
    for key, rec in entries.items():
        if "error" not in rec:
            continue
        m = model_answer(table, TacticQuery.from_key(key))
        for cause in ("no kernel in this kernel set", "gated activations only", "only supports ActivationType::Swiglu"):
            if cause in rec["error"]:
                assert cause in m.error, (key, rec["error"], m.error)
                causes[cause] += 1
    assert len(causes) == 3 and min(causes.values()) > 50


# --------------------------------------------------------------------------- (b) live
@pytest.fixture(scope="module")
def live():
    try:
        o = TacticOracle(mode="live")
    except OracleError as e:
        pytest.skip(f"no built TRTLLM-Gen MoE module (python -m fimoe_lab.tune.build): {e}")
    yield o
    o.close()


@pytest.mark.tactics_live
def test_model_equals_the_live_module_on_random_shapes(live, table):
    src = live.source()
    if (src.get("flashinfer"), src.get("kernel_set")) != (table.flashinfer, table.kernel_set):
        pytest.skip(f"live module is {src}, the shipped table is {table.flashinfer}/{table.kernel_set}")
    n = int(os.environ.get("FIMOE_VALIDITY_SHAPES", "10000"))
    qs = random_queries(n, random.Random(20261203))
    model = TacticOracle(mode="model")
    truth, got = live.ask_many(qs), model.ask_many(qs)
    wrong, seen = [], collections.Counter()
    for q, a, m in zip(qs, truth, got):
        assert a.known, (q.key(), a.reason)
        rejected = a.reason is not None and a.reason.startswith("FlashInfer rejected")
        if rejected != (m.reason is not None and m.reason.startswith("FlashInfer rejects")):
            wrong.append((q.key(), a.reason, m.reason))
        elif a.count != m.count or a.configs != m.configs:
            wrong.append((q.key(), a.count, a.per_tile, m.count, m.per_tile))
        seen[(q.format, "rejected" if rejected else "some" if a.count else "none")] += 1
    assert not wrong, f"{len(wrong)} of {n} shapes differ from the live module, e.g. {wrong[:5]}"
    if n >= 1000:  # the sample reaches every format's kernels, empty lists and rejections
        for fmt in tuner_formats():
            assert seen[(fmt, "some")] > n // 200 and seen[(fmt, "none")] > 0, (fmt, seen)
        assert sum(v for (f, kind), v in seen.items() if kind == "rejected") > n // 20


@pytest.mark.tactics_live
def test_sm103_takes_its_own_patched_mxfp4_kernels_as_the_live_module_does(live, table):
    if build.find_module() is None:
        pytest.skip("native mode: the GPU answers for its own SM")
    qs = [q for q in random_queries(2100, random.Random(103)) if q.format == "mxfp4"]
    model = {sm: TacticOracle(mode="model", sm=sm).ask_many(qs) for sm in (100, 103)}
    lv = TacticOracle(mode="live", sm=103)  # the shim presents an SM103 device
    try:
        for q, a, m in zip(qs, lv.ask_many(qs), model[103]):
            assert (a.count, a.configs) == (m.count, m.configs), (q.key(), a.reason, m.reason)
    finally:
        lv.close()
    # SM100 (the default live oracle, checked on every format above) keeps other kernels
    assert sum(a.configs != b.configs for a, b in zip(model[100], model[103])) > 0


def test_an_unknown_sm_is_refused():
    with pytest.raises(OracleError, match="unknown Blackwell SM version 90"):
        TacticOracle(mode="model", sm=90)


# --------------------------------------------------------------------------- the table
def test_kernel_table_is_versioned_small_and_named_by_its_source(table):
    assert table.path.name == f"kernels-fi{table.flashinfer}-{table.kernel_set.split('@')[-1][:12]}.json.gz"
    assert table.path.stat().st_size < 200_000
    assert table.flashinfer == "0.6.13" and table.kernel_set.startswith("batched_gemm-91e0ba0-896b90b@")
    assert table.size == table.meta["kernels"] > 1000
    assert table.source() == {
        "kind": "model",
        "file": table.path.name,
        "flashinfer": "0.6.13",
        "kernel_set": table.kernel_set,
    }


def test_extraction_from_the_kernel_list_reproduces_the_shipped_table(table, tmp_path):
    fi = build._dist_version("flashinfer-python")
    roots = sorted((build._version_dir(fi or "") / "kernel_list").glob("*/batched_gemm-*/include"))
    if fi != table.flashinfer or not roots:
        pytest.skip("no cached kernel list for the shipped table (python -m fimoe_lab.tune.build --fetch-kernel-list)")
    out = tmp_path / "k.json.gz"
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts/extract_trtllm_kernels.py"), "--include", str(roots[-1])]
        + ["--flashinfer", table.flashinfer, "--kernel-set", table.kernel_set, "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == table.path.read_bytes()


def test_every_shipped_kernel_passes_the_shape_free_checks_and_a_broken_one_does_not(table):
    assert [table.static_reason(i) for i in range(table.size)] == [None] * table.size
    k = table.kernel(0)
    for field, value, reason in [
        ("mDtypeB", "Void", "unset"),
        ("mUseTmaStore", 0, "TMA store"),
        ("mNumEpilogueWarps", 6, "epilogue warps"),
        ("mMmaKind", "Auto", "MMA kind"),
        ("mRouteSfsImpl", None, "RouteSfsImpl"),
    ]:
        broken = validity._Kernel(k.index, {f: getattr(k, f) for f in validity.KERNEL_FIELDS} | {field: value})
        assert reason in (validity._static_check(broken) or ""), field


# --------------------------------------------------------------------------- tile rule
def _centre_exact(ladder: tuple, tokens: int, top_k: int, experts: int) -> int:
    avg = fractions.Fraction(tokens * top_k, experts)
    p = 1
    while p < avg:
        p *= 2
    return min(max(p, ladder[0]), ladder[-1])


@settings(max_examples=300, deadline=None)
@given(
    ladder=st.sampled_from([(8, 16, 32, 64, 128), (8, 16, 32, 64), (8, 16, 32, 64, 128, 256)]),
    tokens=st.integers(1, 16384),
    experts=st.integers(1, 512),
    top_k=st.integers(1, 16),
)
def test_tile_candidates_are_the_centre_two_above_and_one_below(ladder, tokens, experts, top_k):
    got = validity.tile_candidates(ladder, tokens, top_k, experts)
    c = ladder.index(_centre_exact(ladder, tokens, top_k, experts))
    assert got == ladder[max(0, c - 1) : c + 3]


@pytest.mark.parametrize(
    "tokens, top_k, experts, want",
    [
        (1, 1, 512, (8, 16, 32)),  # avg < 1: the smallest tile and the two above
        (8, 8, 64, (8, 16, 32)),  # avg exactly 1
        (128, 8, 128, (8, 16, 32)),  # avg exactly 8: centre 8
        (129, 8, 128, (8, 16, 32, 64)),  # avg 8.06: centre 16
        (1000, 6, 128, (32, 64, 128)),  # avg 46.9: centre 64, nothing two above
        (16384, 8, 8, (64, 128)),  # far above the ladder: the top tile and the one below
    ],
)
def test_tile_candidates_structured(tokens, top_k, experts, want):
    assert validity.tile_candidates((8, 16, 32, 64, 128), tokens, top_k, experts) == want


# --------------------------------------------------------------------------- invariants
_dims = st.one_of(st.integers(1, 9000), st.integers(1, 70).map(lambda x: 128 * x))


@settings(max_examples=150, deadline=None)
@given(
    fmt=st.sampled_from(tuner_formats()),
    act=st.sampled_from(["swiglu", "geglu", "relu2"]),
    hidden=_dims,
    inter=_dims,
    experts=st.integers(1, 512),
    tokens=st.integers(1, 16384),
    per_token=st.booleans(),
)
def test_answers_are_ordered_per_tile_and_independent_of_tokens_within_a_tile(
    table, fmt, act, hidden, inter, experts, tokens, per_token
):
    per_token = per_token and FORMATS[fmt].tactics.per_token_ok  # type: ignore[union-attr]
    q = TacticQuery(fmt, act, hidden, inter, experts, min(8, experts), tokens, per_token).normalized()
    m = model_answer(table, q)
    assert m.count == len(m.configs) == sum(m.per_tile.values())
    assert list(m.configs) == sorted(m.configs) and len(set(m.configs)) == m.count
    if m.error:
        assert not m.configs
        return
    launch = validity.launch(
        *[q.request()[k] for k in ("dtype_act", "dtype_weights", "fp8_quantization_type")],
        q.request()["activation"],
        q.request()["weight_layout"],
        True,
        per_token,
    )
    assert (
        set(m.per_tile)
        == {t for t, _ in m.configs}
        <= set(validity.tile_candidates(launch.ladder, tokens, q.top_k, experts))
    )
    # the same tile at another token count gives the same configs (shapes enter through M and K)
    other = model_answer(
        table, TacticQuery(fmt, act, hidden, inter, experts, min(8, experts), 1, per_token).normalized()
    )
    if other.error is None:
        for t in set(m.per_tile) & set(other.per_tile):
            assert [c for c in m.configs if c[0] == t] == [c for c in other.configs if c[0] == t]


# --------------------------------------------------------------------------- oracle
def test_oracle_model_mode_answers_any_shape_with_configs():
    o = TacticOracle(mode="model")
    assert TacticOracle(mode="snapshot").source() == o.source()
    a = o.query("bf16", "swiglu", 2048 + 7, 777, 128, 8, 3)  # outside any recorded grid
    assert a.known and a.count == 0 and a.configs == () and "no valid config" in a.reason
    a = o.query("nvfp4", "swiglu", 3072, 1920, 128, 6, 8, per_token=True)
    assert a.count == len(a.configs) == sum(a.per_tile.values()) > 0
    assert a.source["kind"] == "model" and a.source["flashinfer"] == "0.6.13" and a.source["kernel_set"]


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(hidden=MAX_GEMM_DIM + 1), "hidden=67108864 overflows the 32-bit"),
        (dict(intermediate=2**40), "intermediate=1099511627776 overflows"),
        (dict(tokens=2**28, top_k=8), "tokens \\* top_k = 2147483648 overflows"),
    ],
)
def test_sizes_beyond_the_ops_32_bit_arithmetic_are_refused(kw, msg):
    args = dict(format="bf16", activation="swiglu", hidden=2048, intermediate=768, experts=128, top_k=8, tokens=1)
    with pytest.raises(OracleError, match=msg):
        TacticQuery(**(args | kw)).normalized()
    assert TacticQuery(**(args | dict(hidden=MAX_GEMM_DIM))).normalized().hidden == MAX_GEMM_DIM


def test_cli_tactics_json_gives_a_count_for_every_format_at_odd_shapes(capsys):
    # without the module ("snapshot": the offline source, now the model), at a shape no grid has
    for fmt in tuner_formats():
        args = ["tactics", "--format", fmt, "--hidden", "2055", "--inter", "777", "--experts", "97"]
        assert main(args + ["--top-k", "5", "--tokens", "1,333,16384", "--json", "--source", "snapshot"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert [d["tokens"] for d in out] == [1, 333, 16384]
        assert all(isinstance(d["count"], int) and d["source"]["kind"] == "model" for d in out), out


@pytest.mark.flashinfer  # the installed FlashInfer's version decides the answer
def test_a_kernel_set_that_is_not_shipped_is_unknown_and_names_the_shipped(tmp_path, monkeypatch, table):
    other = tmp_path / "tables"
    other.mkdir()
    with gzip.open(table.path, "rt") as f:
        raw = json.load(f)
    raw["meta"].update(flashinfer="0.0.1", kernel_set="batched_gemm-0-0@0000000000000000")
    with gzip.open(other / "kernels-fi0.0.1-000000000000.json.gz", "wt") as f:
        json.dump(raw, f)
    monkeypatch.setenv("FIMOE_LAB_TACTICS_DIR", str(other))
    a = TacticOracle(mode="model").query("bf16", "swiglu", 2048, 768, 128, 8, 8)
    assert a.count is None and not a.known and a.configs is None
    assert "0.6.13's kernel set is not shipped" in a.reason
    assert "shipped: FlashInfer 0.0.1 (batched_gemm-0-0@0000000000000000)" in a.reason
    assert "python -m fimoe_lab.tune.build" in a.reason


def test_without_the_built_module_auto_answers_from_the_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FIMOE_LAB_CACHE", str(tmp_path / "no-module"))
    monkeypatch.setattr("fimoe_lab.tune.oracle._blackwell_gpu", lambda: False)
    assert TacticOracle(mode="auto").mode == "model"
    args = ["tactics", "--format", "nvfp4", "--act", "relu2", "--hidden", "4097", "--inter", "1000", "--experts", "3"]
    assert main(args + ["--top-k", "2", "--tokens", "7", "--json"]) == 0
    (d,) = json.loads(capsys.readouterr().out)
    assert d["count"] == 0 and d["source"]["kind"] == "model" and d["reason"]


def test_without_flashinfer_the_newest_shipped_table_answers_and_says_so(monkeypatch, table):
    monkeypatch.setattr("fimoe_lab.tune.oracle._installed", lambda dist: None)
    o = TacticOracle(mode="model")
    a = o.query("nvfp4", "swiglu", 3072, 1920, 128, 6, 8, per_token=True)
    assert a.count > 0 and a.source["kernel_set"] == table.kernel_set
    assert a.source["note"] == "FlashInfer is not installed; answers are for FlashInfer 0.6.13"


def test_no_kernel_table_and_no_module_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("FIMOE_LAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FIMOE_LAB_TACTICS_DIR", str(tmp_path / "none"))
    monkeypatch.setattr("fimoe_lab.tune.oracle._blackwell_gpu", lambda: False)
    with pytest.raises(OracleError, match="no TRTLLM-Gen kernel table"):
        TacticOracle(mode="auto")


# --------------------------------------------------------------------------- MxInt4
# FlashInfer 0.6.13's own answers (trtllm_get_valid_moe_configs of the built module through the SM100
# shim, kernel set batched_gemm-91e0ba0-896b90b@ffc4f52df6ff9010), recorded 2026-12-03: the snapshot
# fixture predates MxInt4 as a tuner format and holds no MxInt4 shape. Kimi-K2-Thinking (H 7168, 384
# experts, top-8) per-rank I of TP 1..16 (convert refuses 128: not a multiple of 256), an EP rank (48
# experts), I and H off the 128 grid (empty), ReLU^2/GeGLU and MajorK (the op runs MxInt4 as SwiGLU,
# BlockMajorK whatever is asked). Key: intermediate, hidden, experts, activation, layout, tokens.
_MXINT4_LIVE = {
    **{(i, 7168, 384, "swiglu", None, t): {8: 16, 16: 64, 32: 64} for i in (2048, 1024, 512) for t in (1, 64)},
    **{(i, 7168, 384, "swiglu", None, t): {64: 64, 128: 16} for i in (2048, 1024, 512) for t in (4096, 16384)},
    **{(i, 7168, 384, "swiglu", None, t): {8: 8, 16: 32, 32: 32} for i in (256, 128) for t in (1, 64)},
    **{(256, 7168, 384, "swiglu", None, t): {64: 32, 128: 16} for t in (4096, 16384)},
    **{(128, 7168, 384, "swiglu", None, t): {64: 32, 128: 8} for t in (4096, 16384)},
    (256, 7168, 48, "swiglu", None, 64): {8: 8, 16: 32, 32: 32, 64: 32},
    (384, 7168, 384, "swiglu", None, 64): {8: 16, 16: 64, 32: 64},
    (300, 7168, 384, "swiglu", None, 64): {},
    (256, 7200, 384, "swiglu", None, 64): {},
    (256, 7168, 384, "relu2", None, 64): {8: 8, 16: 32, 32: 32},
    (512, 7168, 384, "geglu", None, 1): {8: 16, 16: 64, 32: 64},
    (256, 7168, 384, "swiglu", "major-k", 64): {8: 8, 16: 32, 32: 32},
}


def test_model_answers_mxint4_as_flashinfer_recorded(table):
    o = TacticOracle(mode="model")
    for (inter, hidden, experts, act, layout, tokens), want in _MXINT4_LIVE.items():
        a = o.ask(TacticQuery("mxint4", act, hidden, inter, experts, 8, tokens, False, layout))
        assert a.known and a.source["kind"] == "model"
        assert (a.per_tile, a.count) == (want, sum(want.values())), (inter, hidden, experts, act, layout, tokens)
        assert (a.reason is None) == bool(want), a.reason  # an empty list says so
    with pytest.raises(OracleError, match="per-token activation scaling exists only for nvfp4"):
        TacticQuery("mxint4", "swiglu", 7168, 256, 384, 8, 1, per_token=True).normalized()


def test_cli_tactics_mxint4_json_gives_the_recorded_counts_from_the_model(capsys):
    args = ["tactics", "--format", "MxInt4", "--hidden", "7168", "--inter", "256", "--experts", "384", "--top-k", "8"]
    assert main(args + ["--tokens", "1,64,4096,16384", "--json", "--source", "model"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [d["count"] for d in out] == [72, 72, 48, 48] and all(isinstance(d["count"], int) for d in out)
    assert [d["per_tile"] for d in out] == [{"8": 8, "16": 32, "32": 32}] * 2 + [{"64": 32, "128": 16}] * 2
    assert {d["source"]["kind"] for d in out} == {"model"} and out[0]["source"]["flashinfer"] == "0.6.13"
