"""What the integration oracles share: structured / random inputs and the byte comparison."""

from __future__ import annotations

from typing import Any

import torch


def fill(shape: tuple[int, ...], dtype: torch.dtype, kind: str, seed: int) -> torch.Tensor:
    """``structured``: each 4-byte word holds its own flat index + 1 (never 0); ``random``: bytes 1..255."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = 1
    for s in shape:
        n *= s
    nbytes = n * itemsize
    if kind == "structured":
        words = torch.arange(1, (nbytes + 3) // 4 + 1, dtype=torch.int32)
        raw = words.view(torch.uint8)[:nbytes]
    else:
        g = torch.Generator().manual_seed(seed)
        raw = torch.randint(1, 256, (nbytes,), generator=g, dtype=torch.uint8)
    return raw.clone().view(dtype).reshape(shape)


def fingerprint(out: dict[str, Any], t: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Everything observable: bytes, shape, dtype of outputs and inputs-after, and output-input aliasing."""

    def one(x: torch.Tensor) -> tuple:
        return (list(x.shape), str(x.dtype), x.contiguous().view(torch.uint8).reshape(-1).clone())

    ptrs = {k: v.untyped_storage().data_ptr() for k, v in t.items()}
    return {
        "out": {k: one(v) for k, v in out.items()},
        "inputs_after": {k: one(v) for k, v in t.items()},
        "aliases": {
            k: sorted(n for n, p in ptrs.items() if v.untyped_storage().data_ptr() == p) for k, v in out.items()
        },
    }


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(a)} vs {sorted(b)}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return [f"{path}: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"]
        if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            first = int((a.view(torch.uint8) != b.view(torch.uint8)).reshape(-1).nonzero()[0])
            return [f"{path}: bytes differ (first at {first})"]
        return []
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]
