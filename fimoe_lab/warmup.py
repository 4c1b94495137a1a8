"""Compile ahead what a model's transforms will need: plans, executable maps and kernels.

A fresh process pays, on its first transform, for building the layer's plans and index
maps, importing the executor (numba or Triton) and compiling its kernels or loading them
from the on-disk cache (on the CPU numba loads on a background thread while torch stands
in: :mod:`fimoe_lab.kernels.registry`) (numba ``cache=True`` next to :mod:`fimoe_lab.kernels`,
``NUMBA_CACHE_DIR``; Triton's ``TRITON_CACHE_DIR``). :func:`warmup` does all of that for
the given model, formats, backends and devices, so a serving engine can pay it at start-up
(or a build step can fill the on-disk caches once): it builds each layer plan (cached by
its sizes in :mod:`fimoe_lab.caches`), compiles every map (:meth:`IndexMap.compiled`) and
runs each map (and, for TRT-LLM, the maps the engines' drop-ins build on the aligned sizes:
:func:`fimoe_lab.prepare.drop_in_maps`), out of place and, for permutations, in place, through the executor the
real call will pick (:func:`fimoe_lab.kernels.pick_backend` on the full layer's size), on
a few experts of random bytes. Kernels are specialised on dtypes and on a few size
properties, not on the expert count, so the real call then finds them compiled.

    from fimoe_lab.warmup import warmup
    warmup(model="deepseek-v3", formats=["fp8-block"], devices=["cuda"])
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from fimoe_lab.errors import FormatError
from fimoe_lab.kernels import ExecMap, execute, execute_in_place, load_executor, pick_backend
from fimoe_lab.prepare import drop_in_maps
from fimoe_lab.presets import get_preset
from fimoe_lab.recipes import plan_layer
from fimoe_lab.specs import BACKENDS, get_activation, weight_formats

__all__ = ["WarmedMap", "warmup", "warm_experts"]


@dataclass(frozen=True)
class WarmedMap:
    """One map run ahead: which tensor of which plan, on which device, by which executor."""

    fmt: str
    backend: str
    tensor: str
    device: str
    executor: str
    in_place: bool
    seconds: float


def warm_experts(experts: int, device: torch.device) -> int:
    """Experts to run a warm-up on, standing in for ``experts``.

    CPU kernels do not depend on the count: 1. Triton specialises integer arguments equal
    to 1 and those divisible by 16, so on CUDA the stand-in has the same two properties
    as ``experts`` and is at most 17: ``experts`` itself up to 16, else 16 when
    ``experts % 16 == 0``, else ``experts % 16`` (17 when that is 1).
    """
    if device.type != "cuda" or experts <= 16:
        return 1 if device.type != "cuda" else experts
    r = experts % 16
    return 16 if r == 0 else (17 if r == 1 else r)


def warmup(
    model: Optional[str] = None,
    formats: Optional[Sequence[str]] = None,
    backends: Sequence[str] = ("trtllm",),
    devices: Sequence[str] = ("cpu",),
    tp: int = 1,
    hidden: Optional[int] = None,
    intermediate: Optional[int] = None,
    experts: Optional[int] = None,
    gated: Optional[bool] = None,
    in_place: bool = True,
) -> list[WarmedMap]:
    """Build, compile and run once every map of the layer plans a model will use.

    Sizes come from the preset ``model`` (:mod:`fimoe_lab.presets`; per rank:
    ``intermediate = moe_intermediate / tp``) or from ``hidden``, ``intermediate`` and
    ``experts`` (which override the preset's). ``formats``: weight formats
    (:func:`fimoe_lab.specs.weight_formats`; default the preset's checkpoint formats),
    ``backends``: FlashInfer backends (:data:`fimoe_lab.specs.BACKENDS`), ``devices``:
    torch devices. ``gated``: the activation's (default the preset's, else gated).
    ``in_place``: also run the permutations in place (the in-place drop-ins' kernels).
    Memory: at most 17 experts of the largest map (CPU: 1), freed on return.
    Returns one :class:`WarmedMap` per map, device and mode run.
    """
    preset = get_preset(model) if model is not None else None
    if preset is None and (hidden is None or intermediate is None):
        raise FormatError(
            "warm-up needs a model preset or both hidden and intermediate sizes",
            fix="name a preset (model=, --model) or give hidden and intermediate (--hidden, --inter)",
        )
    if tp < 1:
        raise FormatError(f"tp is a positive integer, got {tp}", fix="pass tp >= 1")
    h = hidden if hidden is not None else preset.hidden  # type: ignore[union-attr]
    inter = intermediate if intermediate is not None else preset.moe_intermediate // tp  # type: ignore[union-attr]
    n_exp = experts if experts is not None else (preset.experts if preset is not None else 1)
    if gated is None:
        gated = get_activation(preset.activation).gated if preset is not None else True
    fmts = list(formats) if formats else list(preset.checkpoint_formats if preset is not None else ())
    if not fmts:
        raise FormatError("warm-up needs at least one format", fix=f"choose from {', '.join(weight_formats())}")
    for b in backends:
        if b not in BACKENDS:
            raise FormatError(f"unknown backend {b!r}", fix=f"choose one of {', '.join(BACKENDS)}")
    devs = [torch.device(d) for d in devices]
    done: list[WarmedMap] = []
    for fmt in fmts:
        if fmt not in weight_formats():
            raise FormatError(f"unknown format {fmt!r}", fix=f"choose one of {', '.join(weight_formats())}")
        for backend in backends:
            plan = plan_layer(fmt, backend, inter, h, is_act_and_mul=gated, is_gated=gated)
            maps = {t: (m, True) for t, m in plan.maps().items()}
            if backend == "trtllm":  # what an engine's drop-ins build on the aligned sizes
                maps |= drop_in_maps(fmt, plan.padded_intermediate, plan.padded_hidden, gated, gated)
            seen: set[int] = set()
            for tensor, (m, may_run_in_place) in maps.items():
                if id(m) in seen:  # a drop-in's map that is plan_layer's own (nothing to pad or swap)
                    continue
                seen.add(id(m))
                em = m.compiled()
                for dev in devs:
                    done += _run_map(
                        fmt, backend, tensor, em, n_exp, dev, in_place and may_run_in_place and m.is_permutation
                    )
    return done


def _run_map(
    fmt: str, backend: str, tensor: str, em: ExecMap, experts: int, dev: torch.device, in_place: bool
) -> list[WarmedMap]:
    """Run ``em`` through the executor a call on ``experts`` experts picks, out of place and in place."""
    n = warm_experts(experts, dev)
    out_name = pick_backend(dev, experts * em.out_bytes)
    in_name = pick_backend(dev, experts * em.in_bytes)
    for name in {out_name, in_name}:
        load_executor(name)  # now, not on a background thread: later calls run on it at once
    g = torch.Generator(device=dev).manual_seed(experts)
    x = torch.randint(0, 256, (n, em.in_bytes), dtype=torch.uint8, device=dev, generator=g)
    runs = []
    t = time.perf_counter()
    execute(em, x, torch.empty((n, em.out_bytes), dtype=torch.uint8, device=dev), backend=out_name)
    _sync(dev)
    runs.append(WarmedMap(fmt, backend, tensor, str(dev), out_name, False, time.perf_counter() - t))
    if in_place:
        t = time.perf_counter()
        execute_in_place(em, x, backend=in_name)
        _sync(dev)
        runs.append(WarmedMap(fmt, backend, tensor, str(dev), in_name, True, time.perf_counter() - t))
    return runs


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
