"""pytest hooks and what the environment offers (devices, optional oracles); helpers live in helpers.py."""

from __future__ import annotations

import importlib.util
import os
from collections import defaultdict

import pytest
import torch

# Plans are built afresh in every test (and every process a test starts): the plan store's own tests turn it on in
# folders of their own.
os.environ["FIMOE_LAB_PLAN_STORE"] = "0"

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
HAS_CUDA = torch.cuda.is_available()

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])

# The slow suites (marked ``slow``) run in CI (``CI`` set, as ``.ci/run`` does) or with FIMOE_FULL_TESTS=1;
# a plain ``pytest`` on a developer's machine leaves them out and says how many.
FULL_SUITE = any(
    os.environ.get(name, "").lower() not in ("", "0", "false", "no", "off") for name in ("CI", "FIMOE_FULL_TESTS")
)


FAST_CASES = 6
"""Of a parametrised test with more cases, the fast run keeps this many, spread evenly over its grid (the
first and the last included); the full suite runs every case."""


def pytest_report_header(config):
    return (
        "suite: full (CI or FIMOE_FULL_TESTS)"
        if FULL_SUITE
        else f"suite: fast (slow tests left out, at most {FAST_CASES} cases of a parametrised test; CI=true runs all)"
    )


def _spread(items: list) -> list:
    """The items a fast run keeps: every unparametrised test, and of each parametrised one at most
    ``FAST_CASES`` cases at evenly spaced positions of its collection order."""
    cases = defaultdict(list)
    for item in items:
        cases[(item.path, item.originalname)].append(item)
    keep = set()
    for group in cases.values():
        step = max(1.0, (len(group) - 1) / (FAST_CASES - 1))
        keep.update(id(group[min(len(group) - 1, round(i * step))]) for i in range(min(len(group), FAST_CASES)))
    return [item for item in items if id(item) in keep]


def pytest_collection_modifyitems(config, items):
    chosen = config.getoption("markexpr") or config.getoption("keyword") or any("::" in a for a in config.args)
    if not FULL_SUITE and not chosen:  # a plain run: the fast suite; a selection runs as asked
        kept = _spread([item for item in items if "slow" not in item.keywords])
        kept_ids = {id(item) for item in kept}
        dropped = [item for item in items if id(item) not in kept_ids]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "flashinfer" in item.keywords and not HAS_FLASHINFER:
            if os.environ.get("CI"):
                item.add_marker(pytest.mark.xfail(reason="CI must have flashinfer installed", strict=True, run=False))
            else:
                item.add_marker(pytest.mark.skip(reason="flashinfer-python not installed"))
