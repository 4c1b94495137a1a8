"""Shared test helpers: structured tensors, devices, and the optional oracles."""

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


def coords(experts: int, rows: int, cols: int, device="cpu") -> torch.Tensor:
    """int32 ``(E, rows, cols)`` whose every element encodes its own (expert, row, col), from 1.

    Viewed as 1-byte or 2-byte dtypes it stands for a ``(E, rows, 4*cols)`` or
    ``(E, rows, 2*cols)`` matrix; any map that moves 4-byte words keeps the codes intact.
    """
    e = torch.arange(experts, dtype=torch.int32)[:, None, None]
    r = torch.arange(rows, dtype=torch.int32)[None, :, None]
    c = torch.arange(cols, dtype=torch.int32)[None, None, :]
    return ((e * rows + r) * cols + c + 1).to(device)


def decode(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`coords`: int64 ``(..., 3)`` of (expert, row, col); -1s for a 0 (fill)."""
    v = t.view(torch.int32).to(torch.int64) - 1
    out = torch.stack([v // (rows * cols), (v // cols) % rows, v % cols], dim=-1)
    return torch.where((v >= 0)[..., None], out, -1)


def random_bytes(shape, dtype, seed=0, device="cpu") -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (NaN patterns included: compare bytes, not values)."""
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = int(torch.tensor(shape).prod()) * itemsize
    raw = torch.randint(1, 256, (n,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape).to(device)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
