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
permutation in place with a scratch of a few experts' bytes, along the map's cycles
(:mod:`.cycles`) where the backend has a cycle executor.
"""

from __future__ import annotations

import functools
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


def _cycle_runner(backend: str, em, cuda: bool, config: Optional[dict]):
    """The in-place executor along cycles for this backend and map (called as
    ``run(em, flat, scratch_experts)``, yielding experts done), or None: generic path."""
    if backend == "triton" and cuda:
        from fimoe_lab.kernels import triton_gather

        strategy = (config or {}).get("inplace", triton_gather.CONFIG["inplace"])
        if strategy == "auto":
            strategy = "bands" if em.swizzle is not None else "cycles"
        runs = {"cycles": triton_gather.inplace_cycles, "bands": triton_gather.inplace_swizzled_bands}
        if strategy not in runs:
            raise ValueError(f"unknown in-place strategy {strategy!r}; choose auto, cycles or bands")
        if strategy == "bands" and em.swizzle is None:
            raise ValueError("in-place strategy 'bands' needs a map of a row permutation then the 128x4 scale "
                             "swizzle (1-byte scales); this one is not (use auto or cycles)")
        return functools.partial(runs[strategy], config=config)
    if backend == "numba":
        from fimoe_lab.kernels.numba_gather import CYCLES_MIN_CELL, inplace_cycles_numba

        return inplace_cycles_numba if em.cell_bytes >= CYCLES_MIN_CELL else None
    return None


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
    """Apply the permutation ``m`` to ``x`` in place with a scratch of ``scratch_experts``
    experts' bytes (default :func:`default_scratch_experts`, at most 2% of ``x``).

    Triton (CUDA): along the map's cycles (:mod:`.cycles`): tiles that read only cells
    they overwrite themselves, plus the few cells where a tile cuts a cycle, saved
    first; every byte crosses memory once. Maps of the ``swizzle`` form (scales: a row
    permutation, then the 128x4 swizzle) need no scratch: one cooperative launch holds
    each expert in registers until all of it is read, then writes it
    (``triton_gather.inplace_swizzled_bands``). numba (CPU):
    the cycle plan for cells of at least ``numba_gather.CYCLES_MIN_CELL`` bytes. Else
    (torch, small CPU cells): each chunk of ``scratch_experts`` experts is copied to the
    scratch, then gathered back into place. Peak extra memory: the scratch plus the
    plan's int32 indices (measured in benchmarks/RESULTS.md).

    Guarantee on failure: ``m`` must be a permutation and ``x`` contiguous, checked
    before any byte moves. If an exception is raised midway (out of memory, an
    interrupt, a backend error raised in Python), the chunk in flight was never written
    (cycle plans: a chunk's tiles are launched only after its saves; the generic path
    copies its chunk back from the scratch), the chunks already done are undone with
    ``m.inverse()``, so ``x`` holds its input again; the exception is re-raised as
    :class:`InPlaceError` (``restored=True``, chained to the cause). If the undo itself
    fails, ``restored=False`` and ``done_experts`` says how many leading experts are in
    the output layout: ``m.inverse()`` on ``x[:done_experts]`` restores them. A device
    fault that kills the CUDA context leaves nothing restorable.
    """
    num_experts = x.shape[0]
    if num_experts == 0:
        return
    if not m.is_permutation:
        raise ValueError(f"{m.name}: {m.in_shape} -> {m.out_shape} bytes pads or drops bytes; only a permutation "
                         "runs in place (use apply() for a new tensor)")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous to be transformed in place")
    if x.numel() * x.element_size() != num_experts * m.in_bytes:
        raise ValueError(f"{m.name} moves {m.in_bytes} bytes per expert but x has "
                         f"{x.numel() * x.element_size() // num_experts}; pass x as (experts, ...) of the map's input")
    chunk = scratch_experts or default_scratch_experts(num_experts)
    if chunk < 1:
        raise ValueError(f"scratch_experts must be >= 1, got {chunk}")
    chunk = min(chunk, num_experts)
    flat, _ = byte_views(x, x)
    backend = backend or pick_backend(x.device, flat.numel())
    em = exec_form(m)
    run = _cycle_runner(backend, em, x.is_cuda, config)
    start = 0
    try:
        if run is not None:
            for start, _ in run(em, flat, chunk):
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
