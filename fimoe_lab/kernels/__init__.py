"""Executors: run an :class:`~fimoe_lab.layout.IndexMap` over all experts at once.

Executors only execute maps; they never derive a layout. :func:`execute` picks one by
device:

- CUDA: the Triton gather (:mod:`.triton_gather`) when Triton imports, else the torch
  wide-word ``index_select`` (:mod:`.torch_gather`);
- CPU: the parallel numba gather (:mod:`.numba_gather`) when numba imports and the
  output is at least :data:`NUMBA_MIN_BYTES` (below that, compiling costs more than it
  saves), else torch.

``FIMOE_EXECUTOR=torch|triton|numba`` (or ``backend=``) forces one. Every backend is
bit-exact with the map (tests/test_kernels.py). :func:`execute_in_place` runs a
permutation in place through a scratch buffer of a few experts.
"""

from __future__ import annotations

import importlib.util
import math
import os
from typing import Optional

import torch

from fimoe_lab.kernels.compiled import ExecMap, byte_views, exec_form
from fimoe_lab.kernels.torch_gather import gather_torch

__all__ = [
    "execute",
    "execute_in_place",
    "default_scratch_experts",
    "available_backends",
    "pick_backend",
    "exec_form",
    "ExecMap",
    "InPlaceError",
    "NUMBA_MIN_BYTES",
]

NUMBA_MIN_BYTES = 1 << 20
"""CPU outputs smaller than this run on torch (numba's first compile costs seconds)."""

_HAS_NUMBA = importlib.util.find_spec("numba") is not None
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def available_backends(device: torch.device | str) -> list[str]:
    """Backends that can run on ``device`` here, fastest first."""
    kind = torch.device(device).type
    if kind == "cuda":
        return (["triton"] if _HAS_TRITON else []) + ["torch"]
    return (["numba"] if _HAS_NUMBA else []) + ["torch"]


def pick_backend(device: torch.device | str, out_bytes: int) -> str:
    forced = os.environ.get("FIMOE_EXECUTOR")
    if forced:
        return forced
    kind = torch.device(device).type
    if kind == "cuda":
        return "triton" if _HAS_TRITON else "torch"
    if kind == "cpu" and _HAS_NUMBA and out_bytes >= NUMBA_MIN_BYTES:
        return "numba"
    return "torch"


def execute(m, x: torch.Tensor, out: torch.Tensor, backend: Optional[str] = None) -> None:
    """Write ``m`` applied to every expert of ``x`` into ``out`` (both contiguous, same dtype)."""
    if x.device != out.device:
        raise ValueError(f"input is on {x.device} but out is on {out.device}; move both to one device")
    if x.shape[0] != out.shape[0]:
        raise ValueError(f"input has {x.shape[0]} experts but out has {out.shape[0]}")
    if x.shape[0] == 0:
        return
    backend = backend or pick_backend(x.device, out.numel() * out.element_size())
    if backend == "torch":
        gather_torch(m, x, out)
    elif backend == "triton":
        from fimoe_lab.kernels.triton_gather import gather_triton

        gather_triton(exec_form(m), x, out)
    elif backend == "numba":
        from fimoe_lab.kernels.numba_gather import gather_numba

        gather_numba(exec_form(m), x, out)
    else:
        raise ValueError(f"unknown executor backend {backend!r}; choose torch, triton or numba")


def default_scratch_experts(num_experts: int) -> int:
    """Experts per in-place chunk: at most 2% of the tensor, at least one expert."""
    return max(1, math.floor(num_experts * 0.02))


class InPlaceError(RuntimeError):
    """An in-place transform failed; ``restored`` says whether ``x`` holds its input again."""

    def __init__(self, msg: str, restored: bool, done_experts: int):
        super().__init__(msg)
        self.restored = restored
        self.done_experts = done_experts


def execute_in_place(m, x: torch.Tensor, scratch_experts: Optional[int] = None,
                     backend: Optional[str] = None, _undo: bool = True, config: Optional[dict] = None) -> None:
    """Apply the permutation ``m`` to ``x`` in place, ``scratch_experts`` experts at a time.

    Generic path (torch, numba): each chunk is copied to the scratch, then gathered
    from the scratch back into its own place. CUDA with Triton (default strategy
    ``persistent``): one cooperative launch walks the chunks, copy and gather separated
    by grid barriers (``triton_gather.inplace_persistent``); strategy ``pipeline``: two
    slots of ``scratch_experts // 2`` experts, one launch per chunk. Either way every
    byte crosses memory twice, so this mode runs at most at half the copy bandwidth. Peak
    extra memory: at most ``scratch_experts`` experts plus the map's int32 index
    (measured in benchmarks/RESULTS.md).

    Guarantee on failure: ``m`` is checked (a size-preserving permutation, ``x``
    contiguous with the map's shape) before any byte moves. If an exception is raised
    midway (out of memory, an interrupt, a backend error raised in Python), the chunk
    in flight is copied back from the scratch (or was never written), the chunks
    already done are undone with ``m.inverse()`` the same way, so ``x`` holds its input
    again; the exception is re-raised as :class:`InPlaceError` (``restored=True``,
    chained to the cause). If the undo itself fails, ``restored=False`` and
    ``done_experts`` says how many leading experts are in the output layout:
    ``m.inverse()`` on ``x[:done_experts]`` restores them. A device fault that kills the
    CUDA context leaves nothing restorable.
    """
    num_experts = x.shape[0]
    if num_experts == 0:
        return
    if m.in_bytes != m.out_bytes:
        raise ValueError(f"{m.name}: {m.in_shape} -> {m.out_shape} bytes changes the size; it cannot run in place")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous to be transformed in place")
    chunk = scratch_experts or default_scratch_experts(num_experts)
    if chunk < 1:
        raise ValueError(f"scratch_experts must be >= 1, got {chunk}")
    chunk = min(chunk, num_experts)
    flat, _ = byte_views(x, x)
    backend = backend or pick_backend(x.device, flat.numel())
    start = 0
    try:
        if backend == "triton" and x.is_cuda:
            from fimoe_lab.kernels import triton_gather

            em = exec_form(m)
            strategy = (config or {}).get("inplace", triton_gather.CONFIG["inplace"])
            if strategy == "auto":
                strategy = "rows_swizzle" if em.swizzle is not None else "cycles"
            run = {"persistent": triton_gather.inplace_persistent, "pipeline": triton_gather.inplace_triton,
                   "cycles": triton_gather.inplace_cycles, "rows_swizzle": triton_gather.inplace_rows_swizzle}[strategy]
            for start, _ in run(em, flat, chunk, config):
                pass
        elif backend == "numba" and m.is_permutation:
            from fimoe_lab.kernels.numba_gather import inplace_cycles_numba

            for start, _ in inplace_cycles_numba(exec_form(m), flat, chunk):
                pass
        else:
            scratch = torch.empty((chunk, flat.shape[1]), dtype=torch.uint8, device=x.device)
            for start in range(0, num_experts, chunk):
                stop = min(start + chunk, num_experts)
                part = flat[start:stop]
                s = scratch[: stop - start]
                s.copy_(part)
                try:
                    execute(m, s, part, backend)
                except BaseException:
                    part.copy_(s)
                    raise
        start = num_experts
    except BaseException as exc:
        if not _undo:
            raise
        done = start
        restored = True
        if done:
            try:
                execute_in_place(m.inverse(), flat[:done], scratch_experts=chunk, backend=backend, _undo=False)
            except BaseException:
                restored = False
        if x.is_cuda:
            try:
                torch.cuda.synchronize(x.device)
            except BaseException:
                restored = False
        state = "x holds its input again" if restored else (
            f"the first {done} experts are in the output layout; m.inverse() on them restores x")
        raise InPlaceError(f"in-place {m.name} failed after {done} of {num_experts} experts; {state}",
                           restored, 0 if restored else done) from exc
