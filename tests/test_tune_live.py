"""Live answers (built module + shim, or a Blackwell GPU) equal FlashInfer's recorded answers.

The recorded snapshot (``tests/fixtures/tactics``) is what the validity model is checked
against offline (test_tune_validity); here it is checked to still be the live truth.
Skipped unless `python -m fimoe_lab.tune.build` has been run (or a Blackwell GPU is
present); run with `pytest -m tactics_live`.
"""

import random

import pytest
from tactic_snapshot import load_snapshot, snapshot_files

from fimoe_lab.tune import build
from fimoe_lab.tune.oracle import OracleError, TacticOracle, TacticQuery

pytestmark = pytest.mark.tactics_live


@pytest.fixture(scope="module")
def live():
    try:
        o = TacticOracle(mode="live")
    except OracleError as e:
        pytest.skip(f"no live tactic source: {e}")
    yield o
    o.close()


@pytest.fixture(scope="module")
def snap(live):
    src = live.source()
    assert src["kind"] == "live" and src["flashinfer"]
    for path in snapshot_files():
        meta, entries = load_snapshot(path)
        if (meta["flashinfer"], meta["kernel_set"]) == (src["flashinfer"], src["kernel_set"]):
            return entries
    pytest.skip(f"no recorded snapshot for the live {src['flashinfer']}/{src['kernel_set']}")


def test_live_equals_the_recorded_snapshot_on_a_sample(live, snap):
    rng = random.Random(0)
    for k in rng.sample(sorted(snap), min(150, len(snap))):
        a, rec = live.ask(TacticQuery.from_key(k)), snap[k]
        if "error" in rec:
            assert a.count == 0 and a.reason.startswith("FlashInfer rejected"), (k, a.reason)
        else:
            assert {str(t): n for t, n in a.per_tile.items()} == rec, k


def test_live_full_configs_are_tile_config_pairs(live):
    a = live.query("nvfp4", "swiglu", 3072, 1920, 128, 6, 8, per_token=True)
    assert a.configs and all(len(c) == 2 for c in a.configs)
    assert sum(a.per_tile.values()) == a.count == len(a.configs)
    assert a.source["kind"] == "live" and a.source["kernel_set"]


def test_live_rejection_has_reason(live):
    a = live.query("fp8", "relu2", 2048, 1024, 128, 8, 8)  # per-tensor FP8 is gated-only
    assert a.count == 0 and a.configs == () and "FlashInfer rejected" in a.reason


def test_manifest(live):
    m = build.find_module()
    if m is None:
        pytest.skip("native mode")
    assert m.so_bytes > 1_000_000 and m.kernel_set != "unknown"
