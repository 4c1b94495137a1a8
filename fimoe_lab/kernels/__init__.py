"""Executors: run an executable map (:class:`ExecMap`) over all experts at once.

Executors only execute; they never derive a layout, and nothing here imports the
layout side: :meth:`fimoe_lab.layout.IndexMap.compiled` turns a map into the
:class:`ExecMap` they run. :func:`execute` gathers into a new buffer and
:func:`execute_in_place` permutes in place; both take the executor from the registry
(:mod:`.registry`), by name (``backend=``) or by default for the device and size:

- CUDA: the Triton gather (:mod:`.triton_gather`) when Triton imports, else the torch
  wide-word ``index_select`` (:mod:`.torch_gather`);
- CPU: the parallel numba gather (:mod:`.numba_gather`) when numba imports and the
  output is at least :data:`NUMBA_MIN_BYTES` (below that, compiling costs more than it
  saves), else torch. In a fresh process numba loads on a background thread and torch
  stands in until it is ready (:func:`load_executor` loads it now).

Every backend is bit-exact with the map (tests/test_kernels.py). In place, the map's
cycles (:mod:`.cycles`) are followed where the executor has a cycle strategy.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from fimoe_lab.errors import LayoutError
from fimoe_lab.kernels.compiled import ExecMap, byte_view
from fimoe_lab.kernels.registry import (
    CYCLES_MIN_CELL,
    EXECUTORS,
    NUMBA_MIN_BYTES,
    available_backends,
    execute_kept,
    executor_ready,
    get_executor,
    keep_in_place,
    kept_in_place,
    load_executor,
    pick_backend,
    plans_after_the_call,
)

__all__ = [
    "execute",
    "execute_kept",
    "plans_after_the_call",
    "execute_in_place",
    "default_scratch_experts",
    "SCRATCH_MIN_BYTES",
    "available_backends",
    "pick_backend",
    "load_executor",
    "executor_ready",
    "ExecMap",
    "EXECUTORS",
    "InPlaceError",
    "NUMBA_MIN_BYTES",
    "CYCLES_MIN_CELL",
]


def _check_exec_map(em) -> None:
    if not isinstance(em, ExecMap):
        raise LayoutError(
            f"executors run an ExecMap, got {type(em).__name__}",
            fix="pass m.compiled() (or call m.apply / m.apply_ on the IndexMap)",
        )


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share any byte of memory."""
    if a.device != b.device or not a.numel() or not b.numel():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes


def _check_gather(em: ExecMap, x: torch.Tensor, out: torch.Tensor) -> None:
    """Raise :class:`LayoutError` unless ``out = em(x)`` is a well-formed gather (checked on every call,
    so the common case costs a few attribute reads; the messages are built only on failure)."""
    e = x.shape[0] if x.ndim else -1
    if (
        x.device != out.device
        or not out.ndim
        or out.shape[0] != e
        or not (x.is_contiguous() and out.is_contiguous())
        or x.nbytes != e * em.in_bytes
        or out.nbytes != e * em.out_bytes
    ):
        _explain_bad_gather(em, x, out)
    if e and _overlap(x, out):
        raise LayoutError(
            "out overlaps the input's memory; a gather cannot write over what it still reads",
            fix="pass a separate out, or transform in place with IndexMap.apply_ (execute_in_place)",
        )


def _explain_bad_gather(em: ExecMap, x: torch.Tensor, out: torch.Tensor) -> None:
    if x.device != out.device:
        raise LayoutError(f"input is on {x.device} but out is on {out.device}", fix="move both to one device")
    if x.ndim == 0 or out.ndim == 0 or x.shape[0] != out.shape[0]:
        raise LayoutError(
            f"input {tuple(x.shape)} and out {tuple(out.shape)} must both be (experts, ...) "
            "with the same number of experts"
        )
    if not x.is_contiguous() or not out.is_contiguous():
        raise LayoutError("input and out must be contiguous", fix="call .contiguous() first")
    e = max(x.shape[0], 1)
    raise LayoutError(
        f"{em.name} maps {em.in_bytes} -> {em.out_bytes} bytes per expert, "
        f"but input and out hold {x.nbytes // e} and {out.nbytes // e}"
    )


def execute(em: ExecMap, x: torch.Tensor, out: torch.Tensor, backend: Optional[str] = None) -> None:
    """Write ``em`` applied to every expert of ``x`` into ``out``.

    ``x`` ``(E, ...)`` holds ``em.in_bytes`` per expert, ``out`` ``(E, ...)``
    ``em.out_bytes``; both contiguous, on one device, not overlapping. ``backend`` names
    an executor of :data:`EXECUTORS` (default: :func:`pick_backend`).
    """
    _check_exec_map(em)
    with plans_after_the_call:
        ex = get_executor(backend, x.device, out.nbytes, em=em)
        _check_gather(em, x, out)
        if x.shape[0] == 0:
            return
        ex.gather(em, x, out)


SCRATCH_MIN_BYTES = 1 << 26
"""The scratch of an in-place transform may hold this many bytes even where that is over 2% of the
tensor: fewer, larger chunks (a 256-expert DeepSeek-V3 rank's W13 in 15 chunks, not 52), so the
host's calls stay ahead of the device (measured on the H200, benchmarks/whole_model.py)."""


def default_scratch_experts(num_experts: int, expert_bytes: int = 0) -> int:
    """Experts per in-place chunk: 2% of the tensor or :data:`SCRATCH_MIN_BYTES` of ``expert_bytes``
    experts, whichever is more; at least one expert, at most all."""
    by_bytes = SCRATCH_MIN_BYTES // expert_bytes if expert_bytes else 0
    return min(max(1, math.floor(num_experts * 0.02), by_bytes), max(num_experts, 1))


class InPlaceError(RuntimeError):
    """An in-place transform failed; ``restored`` says whether ``x`` holds its input again."""

    def __init__(self, msg: str, restored: bool, done_experts: int):
        super().__init__(msg)
        self.restored = restored
        self.done_experts = done_experts


def _check_in_place(em: ExecMap, x: torch.Tensor, scratch_experts: Optional[int]) -> int:
    """Raise :class:`LayoutError` unless ``em`` can permute ``x`` in place; return the chunk size."""
    num_experts = x.shape[0]
    if not em.is_permutation:
        raise LayoutError(
            f"{em.name}: {em.in_bytes} -> {em.out_bytes} bytes per expert pads or drops bytes; "
            "only a permutation runs in place",
            fix="use apply() for a new tensor",
        )
    if not x.is_contiguous():
        raise LayoutError("x must be contiguous to be transformed in place", fix="call .contiguous() first")
    if x.numel() * x.element_size() != num_experts * em.in_bytes:
        raise LayoutError(
            f"{em.name} moves {em.in_bytes} bytes per expert but x has {x.numel() * x.element_size() // num_experts}",
            fix="pass x as (experts, ...) of the map's input",
        )
    chunk = scratch_experts or default_scratch_experts(num_experts, em.in_bytes)
    if chunk < 1:
        raise LayoutError(f"scratch_experts must be >= 1, got {chunk}")
    return min(chunk, num_experts)


def execute_in_place(
    em: ExecMap,
    x: torch.Tensor,
    scratch_experts: Optional[int] = None,
    backend: Optional[str] = None,
    _undo: bool = True,
    config: Optional[dict] = None,
) -> None:
    """Apply the permutation ``em`` to ``x`` in place with a scratch of ``scratch_experts``
    experts' bytes (default :func:`default_scratch_experts`: 2% of ``x`` or 64 MiB, whichever is more).

    Triton (CUDA): along the map's cycles (:mod:`.cycles`): tiles that read only cells
    they overwrite themselves, plus the few cells where a tile cuts a cycle, saved
    first; every byte crosses memory once. Maps of the ``swizzle`` form (scales: a row
    permutation, then the 128x4 swizzle) need no scratch: one cooperative launch holds
    each expert in registers until all of it is read, then writes it
    (``triton_gather.inplace_swizzled_bands``). numba (CPU):
    the cycle plan for cells of at least :data:`CYCLES_MIN_CELL` bytes. Else
    (torch, small CPU cells): each chunk of ``scratch_experts`` experts is copied to the
    scratch, then gathered back into place. Peak extra memory: the scratch plus the
    plan's int32 indices (measured in benchmarks/RESULTS.md). ``config["inplace"]``
    forces a strategy of the executor (``auto``, ``bands``, ``cycles``,
    ``copy-then-gather``: :mod:`.registry`); the other keys tune Triton's tiles.

    Guarantee on failure: ``em`` must be a permutation and ``x`` contiguous, checked
    before any byte moves. If an exception is raised midway (out of memory, an
    interrupt, a backend error raised in Python), the chunk in flight was never written
    (cycle plans: a chunk's tiles are launched only after its saves; the generic path
    copies its chunk back from the scratch), the chunks already done are undone with
    ``em.inverse()``, so ``x`` holds its input again; the exception is re-raised as
    :class:`InPlaceError` (``restored=True``, chained to the cause). If the undo itself
    fails, ``restored=False`` and ``done_experts`` says how many leading experts are in
    the output layout: the map's inverse on ``x[:done_experts]`` restores them. A device
    fault that kills the CUDA context leaves nothing restorable.
    """
    _check_exec_map(em)
    num_experts = x.shape[0]
    if num_experts == 0:
        return
    chunk = _check_in_place(em, x, scratch_experts)
    flat = byte_view(x)
    default = backend is None and not config
    with plans_after_the_call:
        strategy = kept_in_place(em, x.device, flat.numel()) if default else None
        name = "prebuilt"
        if strategy is None:
            ex = get_executor(backend, x.device, flat.numel(), wait=bool(config), em=em, in_place=True)  # tuned: own
            strategy, name = ex.strategy(em, (config or {}).get("inplace", "auto")), ex.name
            if default:
                keep_in_place(em, x.device, ex, strategy)
        start = 0
        try:
            for start, _ in strategy.run(em, flat, chunk, config):  # noqa: B007 - start is read after a failure
                pass
            start = num_experts
        except BaseException as exc:
            if not _undo:
                raise
            _undo_and_raise(em, x, flat, start, chunk, name, exc)


def _undo_and_raise(
    em: ExecMap, x: torch.Tensor, flat: torch.Tensor, done: int, chunk: int, backend: str, exc: BaseException
) -> None:
    """Put the first ``done`` experts back with ``em.inverse()``, then raise :class:`InPlaceError`."""
    restored = True
    if done:
        try:
            execute_in_place(em.inverse(), flat[:done], scratch_experts=chunk, backend=backend, _undo=False)
        except BaseException:
            restored = False
    if x.is_cuda:
        try:
            torch.cuda.synchronize(x.device)
        except BaseException:
            restored = False
    state = (
        "x holds its input again"
        if restored
        else (f"the first {done} experts are in the output layout; m.inverse() on them restores x")
    )
    raise InPlaceError(
        f"in-place {em.name} failed after {done} of {len(x)} experts; {state}", restored, 0 if restored else done
    ) from exc
