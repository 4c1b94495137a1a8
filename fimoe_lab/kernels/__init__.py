"""Executors: run an :class:`~fimoe_lab.layout.IndexMap` over all experts at once.

Executors only execute maps; they never derive a layout. :func:`execute` picks one by
device; :func:`execute_in_place` runs a permutation in place through a scratch buffer
of a few experts.
"""

from __future__ import annotations

import math

import torch

from fimoe_lab.kernels.torch_gather import gather_torch

__all__ = ["execute", "execute_in_place", "default_scratch_experts"]


def execute(m, x: torch.Tensor, out: torch.Tensor) -> None:
    """Write ``m`` applied to every expert of ``x`` into ``out`` (both contiguous, same dtype)."""
    if x.device != out.device:
        raise ValueError(f"input is on {x.device} but out is on {out.device}; move both to one device")
    gather_torch(m, x, out)


def default_scratch_experts(num_experts: int) -> int:
    """Experts per in-place chunk: at most 2% of the tensor, at least one expert."""
    return max(1, math.floor(num_experts * 0.02))


def execute_in_place(m, x: torch.Tensor, scratch_experts: int | None = None) -> None:
    """Apply the permutation ``m`` to ``x`` in place, ``scratch_experts`` experts at a time.

    Peak extra memory: ``scratch_experts`` experts. Guarantee on failure: the chunk
    being processed is gathered into the scratch before any byte of ``x`` is written,
    so an error raised while gathering leaves that chunk untouched; chunks before it
    are already in the output layout and are restored by ``m.inverse().apply_`` on
    those experts.
    """
    num_experts = x.shape[0]
    chunk = scratch_experts or default_scratch_experts(num_experts)
    if chunk < 1:
        raise ValueError(f"scratch_experts must be >= 1, got {chunk}")
    chunk = min(chunk, num_experts)
    scratch = torch.empty((chunk,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    for start in range(0, num_experts, chunk):
        stop = min(start + chunk, num_experts)
        part = scratch[: stop - start]
        execute(m, x[start:stop], part)
        x[start:stop].copy_(part)
