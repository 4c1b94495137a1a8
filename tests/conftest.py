"""pytest hooks and what the environment offers (devices, optional oracles); helpers live in helpers.py."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
HAS_CUDA = torch.cuda.is_available()

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "flashinfer" in item.keywords and not HAS_FLASHINFER:
            if os.environ.get("CI"):
                item.add_marker(pytest.mark.xfail(reason="CI must have flashinfer installed", strict=True, run=False))
            else:
                item.add_marker(pytest.mark.skip(reason="flashinfer-python not installed"))
