"""Live answers (built module + shim, or a Blackwell GPU) equal the recorded snapshot.

Skipped unless `python -m fimoe_lab.tune.build` has been run (or a Blackwell GPU is
present); run with `pytest -m tactics_live`.
"""

import random

import pytest

from fimoe_lab.tune import build
from fimoe_lab.tune.oracle import OracleError, Snapshot, TacticOracle, TacticQuery, snapshot_dir

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
def snap():
    s = Snapshot.find()
    if s is None:
        pytest.skip(f"no snapshot in {snapshot_dir()}")
    return s


def test_live_source_matches_snapshot_version(live, snap):
    src = live.source()
    assert src["kind"] == "live" and src["flashinfer"]
    if src["flashinfer"] != snap.meta["flashinfer"] or src["kernel_set"] != snap.meta["kernel_set"]:
        pytest.skip(
            f"snapshot is for {snap.meta['flashinfer']}/{snap.meta['kernel_set']}, live is "
            f"{src['flashinfer']}/{src['kernel_set']}"
        )


def test_live_equals_snapshot_on_a_sample(live, snap):
    keys = sorted(snap.entries)
    rng = random.Random(0)
    for k in rng.sample(keys, min(150, len(keys))):
        q = TacticQuery.from_key(k)
        a, b = live.ask(q), snap.answer(q)
        assert a.count == b.count, (k, a.reason, b.reason)
        assert a.per_tile == b.per_tile, k


def test_live_full_configs_are_tile_config_pairs(live):
    a = live.query("nvfp4", "swiglu", 3072, 1920, 128, 6, 8, per_token=True)
    assert a.configs and all(len(c) == 2 for c in a.configs)
    assert sum(a.per_tile.values()) == a.count == len(a.configs)
    assert a.source["kind"] == "live" and a.source["kernel_set"]


def test_live_rejection_has_reason(live):
    a = live.query("fp8", "relu2", 2048, 1024, 128, 8, 8)  # per-tensor FP8 is gated-only
    assert a.count == 0 and "FlashInfer rejected" in a.reason


def test_manifest(live):
    m = build.find_module()
    if m is None:
        pytest.skip("native mode")
    assert m.so_bytes > 1_000_000 and m.kernel_set != "unknown"
