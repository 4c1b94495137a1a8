"""pytest hooks and what the environment offers (devices, optional oracles); helpers live in helpers.py."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
HAS_CUDA = torch.cuda.is_available()

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])

# The slow suites (marked ``slow``) run in CI (``CI`` set, as ``.ci/run`` does) or with FIMOE_FULL_TESTS=1;
# a plain ``pytest`` on a developer's machine leaves them out and says how many.
FULL_SUITE = any(
    os.environ.get(name, "").lower() not in ("", "0", "false", "no", "off") for name in ("CI", "FIMOE_FULL_TESTS")
)


def pytest_report_header(config):
    return (
        "suite: full (CI or FIMOE_FULL_TESTS)" if FULL_SUITE else "suite: fast (slow tests left out; CI=true runs them)"
    )


def pytest_collection_modifyitems(config, items):
    if not FULL_SUITE and not config.getoption("markexpr"):
        slow = [item for item in items if "slow" in item.keywords]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if "slow" not in item.keywords]
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "flashinfer" in item.keywords and not HAS_FLASHINFER:
            if os.environ.get("CI"):
                item.add_marker(pytest.mark.xfail(reason="CI must have flashinfer installed", strict=True, run=False))
            else:
                item.add_marker(pytest.mark.skip(reason="flashinfer-python not installed"))
