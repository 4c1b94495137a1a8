"""Triton launches at the cost of the launch alone.

``kernel[grid](*args, **meta)`` binds the arguments, builds Triton's specialisation key and
looks the compiled kernel up on every call: on the H200's host that, with our own plan
lookup, put 40-65 us of host time in front of each launch, and a call that finds the device
idle (one large transform, timed alone) waits for all of it (``benchmarks/RESULTS.md``).
:func:`launch` asks Triton once per *launch key* and then starts the compiled kernel
directly (its ``CompiledKernel[grid]`` runner, ~15 us).

The launch key holds everything Triton specialises a compiled kernel on, and more: the
kernel, the grid, every constexpr and option, each integer argument's exact value, and
each tensor (or :class:`Pointer`) argument's dtype and whether its address is a multiple
of 16 bytes, and the current device. Tensors go to the launch as their addresses.
Two calls with the same key get the same compiled kernel from Triton, so reusing it is
exact; a call with any other value is a new key and goes through Triton first.
"""

from __future__ import annotations

import inspect
import os

import torch

__all__ = ["INTERPRETED", "OWN_PATH", "Pointer", "first_launch", "launch"]

_RUNNERS: dict = {}
_PARAMS: dict = {}
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Triton's interpreter (``TRITON_INTERPRET=1``, read when Triton wraps the kernels): kernels run
on the CPU from tensors, through ``kernel[grid]``; nothing is compiled or bound."""


class Pointer:
    """A device address of ``dtype`` elements: what a kernel's pointer parameter takes,
    without building a tensor view to carry the element type."""

    __slots__ = ("address", "dtype")

    def __init__(self, address: int, dtype: torch.dtype):
        self.address = address
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self.address


def _param_names(kernel) -> tuple:
    names = _PARAMS.get(kernel)
    if names is None:
        names = _PARAMS[kernel] = tuple(inspect.signature(kernel.fn).parameters)
    return names


def launch(kernel, grid: tuple, *args, **meta) -> None:
    """``kernel[grid](*args, **meta)`` on the current device and stream: positional
    ``args`` are the kernel's leading runtime parameters (tensors, :class:`Pointer`,
    integers), ``meta`` its constexprs (by name) and launch options (``num_warps``,
    ``launch_cooperative_grid``)."""
    if INTERPRETED:
        kernel[grid](*args, **meta)
        return
    parts = [torch.cuda.current_device(), kernel, grid, tuple(meta.items())]
    values = []
    for a in args:
        if isinstance(a, (torch.Tensor, Pointer)):
            p = a.data_ptr()
            parts.append((a.dtype, p % 16 == 0))
            values.append(p)
        else:
            parts.append((type(a), a))
            values.append(a)
    key = tuple(parts)
    run = _RUNNERS.get(key)
    if run is None:
        if len(_RUNNERS) >= 4096:  # shapes come and go (tests, sweeps): start over rather than grow
            _RUNNERS.clear()
        _RUNNERS[key] = first_launch(kernel, grid, args, meta, values)
    elif run is OWN_PATH:
        kernel[grid](*args, **meta)
    else:
        runner, tail = run
        runner(*values, *tail)


OWN_PATH = "own path"
"""What :func:`first_launch` returns when the compiled kernel's runner does not take the call:
later calls with that key go through ``kernel[grid]`` as before."""


def first_launch(kernel, grid: tuple, args: tuple, meta: dict, values: list):
    """Launch once and say how to launch the same key again: ``(runner, tail)``, the
    compiled kernel's ``CompiledKernel[grid]`` runner and the constexpr values it takes
    after ``values`` (the runtime arguments as addresses and integers), or
    :data:`OWN_PATH`. Triton versions differ in what the runner takes (3.3 on: every
    parameter, constexprs included; before: the runtime ones), so both are tried: the
    launcher parses its arguments before it starts anything, so a call refused with a
    ``TypeError`` has moved nothing; if neither is taken, ``kernel[grid]`` launches. Any
    other error (the driver refusing the grid) is raised as it is, nothing launched."""
    compiled = kernel.warmup(*args, grid=grid, **meta)
    if hasattr(compiled, "result"):
        compiled = compiled.result()
    if hasattr(compiled, "__getitem__"):
        runner = compiled[tuple(grid) + (1,) * (3 - len(grid))]
        names = _param_names(kernel)
        for tail in (tuple(meta[n] for n in names[len(args) :]), ()):
            try:
                runner(*values, *tail)
            except TypeError:  # its arguments refused before anything started: the next convention
                continue
            return runner, tail
    kernel[grid](*args, **meta)
    return OWN_PATH
