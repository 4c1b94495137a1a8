"""Test helpers shared by every test module: structured tensors, byte comparison, file reading."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open


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


def spy_calls(monkeypatch, targets) -> list[str]:
    """Wrap each ``(owner, attribute)`` function so its calls still run and their names are
    recorded, in order, in the returned list (``monkeypatch`` undoes the wrapping)."""
    seen: list[str] = []
    for owner, attr in targets:
        real = getattr(owner, attr)

        def spy(*a, _real=real, _name=attr, **k):
            seen.append(_name)
            return _real(*a, **k)

        monkeypatch.setattr(owner, attr, spy)
    return seen


def same_bytes(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Same shape and bytes (dtypes may differ, e.g. uint8 against float8); two Nones are the same."""
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def same_tensor(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """:func:`same_bytes` and the same dtype."""
    return same_bytes(a, b) and (a is None or a.dtype == b.dtype)


def all_tensors(*paths: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the given safetensors files, or of every ``*.safetensors`` in the given folders."""
    files = [f for p in map(Path, paths) for f in (sorted(p.glob("*.safetensors")) if p.is_dir() else [p])]
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def kernel_and_unchanged(kernel: dict[str, torch.Tensor], source: dict[str, torch.Tensor]) -> tuple[set, set]:
    """``(kernel-layout tensor names, names carried through unchanged)`` of a converted file's tensors ``kernel``
    (:func:`all_tensors`) against its source's: the unchanged ones keep their source name, dtype and shape."""
    kept = {k for k, t in kernel.items() if k in source and (t.dtype, t.shape) == (source[k].dtype, source[k].shape)}
    return set(kernel) - kept, kept


def plus_unchanged(path: Path, experts: Iterable[str], want: dict, rank: int) -> dict:
    """What restore of rank ``rank``'s conversion of the checkpoint at ``path`` gives: ``want`` (its expert
    tensors) and, on rank 0, every tensor of the checkpoint not among the routed ``experts`` (all ranks' names),
    unchanged."""
    if rank != 0:
        return want
    routed = set(experts)
    kept = {k: v for k, v in all_tensors(path).items() if k not in routed}
    assert kept, path  # every generated checkpoint has a router at least
    return {**want, **kept}


def rewrite_metadata(src: Path, dst: Path, edit) -> Path:
    """A copy of kernel file ``src`` at ``dst`` whose ``fimoe_lab`` metadata JSON went through ``edit(meta)``."""
    raw = src.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    meta = json.loads(header["__metadata__"]["fimoe_lab"])
    edit(meta)
    header["__metadata__"]["fimoe_lab"] = json.dumps(meta)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    dst.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])
    return dst


def json_paths(node, at=()):
    """Every node of a JSON value (dicts and lists walked in order) with its path of keys and indices, the root
    first: ``(path, node)``."""
    yield at, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from json_paths(v, at + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from json_paths(v, at + (i,))
