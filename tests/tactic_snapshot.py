"""Test helpers for the tactic oracle: the recorded snapshot fixture and random query shapes.

``tests/fixtures/tactics/tactics-fi<version>-<kernel set>.json.gz`` holds FlashInfer's own
answers (``trtllm_get_valid_moe_configs`` through the built module, recorded by
``scripts/make_tactic_snapshot.py``): {query key: {tile_N: number of configs}} or
{query key: {"error": reason}}.
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

from fimoe_lab.specs import ACTIVATIONS, FORMATS, LAYOUTS, tuner_formats
from fimoe_lab.tune.oracle import TacticQuery

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "tactics"


def snapshot_files() -> list[Path]:
    return sorted(FIXTURES.glob("tactics-fi*.json.gz"))


def load_snapshot(path: Path) -> tuple[dict, dict]:
    """(meta, entries) of a recorded snapshot."""
    with gzip.open(path, "rt") as f:
        raw = json.load(f)
    return raw["meta"], raw["entries"]


def _size(rng: random.Random) -> int:
    """A GEMM dimension: odd/even, aligned to 16..256 or just off it, small to ~16k."""
    r = rng.random()
    if r < 0.25:
        return rng.randint(1, 8192)  # any, odd half the time
    if r < 0.55:
        return rng.randint(1, 64) * rng.choice((16, 32, 64, 128, 256))
    if r < 0.75:
        return max(1, rng.randint(1, 64) * rng.choice((64, 128, 256)) + rng.choice((-16, -8, -1, 1, 2, 8, 16, 32)))
    if r < 0.9:
        return rng.randint(1, 4096) * 2
    return rng.randint(1, 16) * 1024


def random_queries(n: int, rng: random.Random) -> list[TacticQuery]:
    """``n`` normalized queries: every tuner format in turn, every activation name, every
    layout, per-token on/off where the format has it, experts 1..512, top_k 1..min(E, 16),
    tokens 1..16384."""
    fmts, acts, layouts = tuner_formats(), sorted(ACTIVATIONS), sorted(LAYOUTS)
    out = []
    for i in range(n):
        fmt = fmts[i % len(fmts)]
        if rng.random() < 0.5:  # half in the region where kernels exist: both sizes 128-aligned
            hidden, inter = rng.randint(1, 56) * 128, rng.randint(1, 48) * 128
        else:
            hidden, inter = _size(rng), _size(rng)
        experts = rng.choice((1, 2, 8, 16, 32, 64, 128, 160, 256, 384, 512, rng.randint(1, 512)))
        tokens = rng.choice((1, 2, 8, 64, 512, 4096, 16384, rng.randint(1, 16384), rng.randint(1, 256)))
        tactics = FORMATS[fmt].tactics
        q = TacticQuery(
            fmt,
            "swiglu" if rng.random() < 0.5 else rng.choice(acts),
            hidden,
            inter,
            experts,
            rng.randint(1, min(experts, 16)),
            tokens,
            bool(tactics.per_token_ok and rng.random() < 0.5),  # type: ignore[union-attr]
            tactics.default_layout if rng.random() < 0.5 else rng.choice(layouts),  # type: ignore[union-attr]
        )
        out.append(q.normalized())
    return out
