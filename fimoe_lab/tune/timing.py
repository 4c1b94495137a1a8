"""Measured costs of a padding choice, next to the tactic counts of a sweep.

(a) :func:`measure_transform`: what our executors take to lay out w13 and w2 for each
padding (runs anywhere: CPU via numba/torch, CUDA via Triton/torch).
(b) :func:`measure_grouped_mm`: the expert GEMMs padded vs unpadded on the GPU at hand,
through bf16 ``torch._grouped_mm`` (TRTLLM-Gen kernels run only on Blackwell; on Hopper
this is the practical timing path, DESIGN §6). Without a CUDA GPU it raises
``RuntimeError("not measured on this device: ...")``: nothing is estimated.

Both return a copy of the sweep's DataFrame with extra columns, one measurement per
distinct padded shape (rows that share a shape share the number).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Optional

import torch

from ..errors import FimoeError
from ..presets import get_preset
from ..recipes import plan_layer
from ..specs import FORMATS, get_activation

__all__ = ["measure_grouped_mm", "measure_transform", "timing_status"]


def timing_status() -> str:
    """Says plainly whether padded-vs-unpadded GEMM timings can be measured here."""
    if torch.cuda.is_available():
        return f"timings measurable on {torch.cuda.get_device_name(0)} (torch._grouped_mm, bf16)"
    return "not measured on this device: no CUDA GPU"


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int = 10, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` in ms: CUDA events on a GPU, ``perf_counter`` on the CPU."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize(device)
            samples.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _shapes(df) -> dict[tuple[int, int], list[int]]:
    shapes: dict[tuple[int, int], list[int]] = {}
    for i, row in enumerate(df.itertuples()):
        shapes.setdefault((int(row.intermediate), int(row.hidden)), []).append(i)
    return shapes


def measure_grouped_mm(df, tokens: int = 4096, repeats: int = 20, device: Optional[str] = None):
    """bf16 ``torch._grouped_mm`` for both expert GEMMs, per padded shape of ``df``.

    ``tokens`` tokens routed top-k, spread evenly over the preset's experts. Adds
    ``gemm_ms`` (GEMM1 ``[T*k, H] x [H, P*I]`` + GEMM2 ``[T*k, I] x [I, H]``, median of
    ``repeats``) and ``gemm_vs_unpadded`` (ratio to the unpadded shape).
    """
    if device is None and not torch.cuda.is_available():
        raise RuntimeError("not measured on this device: no CUDA GPU (torch._grouped_mm timings need one)")
    dev = torch.device(device or "cuda")
    if dev.type != "cuda":
        raise RuntimeError(f"not measured on this device: {dev} is not a CUDA device")
    p = get_preset(df.attrs["preset"])
    per_expert = max(1, tokens * p.top_k // p.experts)
    rows = per_expert * p.experts
    offs = torch.arange(per_expert, rows + 1, per_expert, device=dev, dtype=torch.int32)
    projections = get_activation(p.activation).projections

    def time_shape(inter: int, hidden: int) -> float:
        g = torch.Generator(device=dev).manual_seed(inter * 7919 + hidden)
        a = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16, generator=g)
        w13 = torch.randn(p.experts, projections * inter, hidden, device=dev, dtype=torch.bfloat16, generator=g)
        h = torch.randn(rows, inter, device=dev, dtype=torch.bfloat16, generator=g)
        w2 = torch.randn(p.experts, hidden, inter, device=dev, dtype=torch.bfloat16, generator=g)

        def both() -> None:
            torch._grouped_mm(a, w13.transpose(-2, -1), offs=offs)
            torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)

        return median_ms(both, dev, repeats)

    out = df.copy()
    ms = [0.0] * len(df)
    for (inter, hidden), idx in _shapes(df).items():
        t = time_shape(inter, hidden)
        for i in idx:
            ms[i] = t
    out["gemm_ms"] = ms
    base = out.loc[(out.inter_align == 1) & (out.hidden_align == 1), "gemm_ms"].iloc[0]
    out["gemm_vs_unpadded"] = out["gemm_ms"] / base
    out.attrs.update(df.attrs, gemm_device=torch.cuda.get_device_name(dev), gemm_tokens=tokens)
    return out


def measure_transform(
    df, backend: str = "trtllm", experts: Optional[int] = None, device: str = "cpu", repeats: int = 5
):
    """Our executors laying out w13 and w2 (random bytes) for each padded shape of ``df``.

    ``experts``: how many experts to lay out (default: all of the preset's; fewer keeps
    a CPU run short; the time scales with the count). The plan is
    :func:`fimoe_lab.recipes.plan_layer` of the format's layout recipe
    (``specs.FORMATS[f].plan_format``) padded to each row's alignments. Adds
    ``transform_ms`` (median, both tensors) and ``transform_note`` (why a shape has no
    plan, if so).
    """
    p = get_preset(df.attrs["preset"])
    act = get_activation(p.activation)
    fmt = FORMATS[df.attrs["format"]].plan_format
    n = experts or p.experts
    dev = torch.device(device)
    unpadded = df.loc[(df.inter_align == 1) & (df.hidden_align == 1)].iloc[0]
    out = df.copy()
    ms: list[float] = [float("nan")] * len(df)
    notes = [""] * len(df)
    for (inter, hidden), idx in _shapes(df).items():
        row = df.iloc[idx[0]]
        try:  # the plan pads the checkpoint's (unpadded) sizes to this row's alignments
            plan = plan_layer(
                fmt,
                backend,
                int(unpadded.intermediate),
                int(unpadded.hidden),
                act.is_act_and_mul,
                act.gated,
                int(row.inter_align),
                int(row.hidden_align),
            )
        except FimoeError as exc:
            for i in idx:
                notes[i] = exc.message
            continue
        g = torch.Generator().manual_seed(inter + hidden)
        inputs = {
            name: torch.randint(1, 256, (n,) + m.in_shape, generator=g, dtype=torch.uint8).to(dev)
            for name, m in plan.maps().items()
            if name in ("w13", "w2")
        }
        outputs = {
            name: torch.empty((n,) + plan.maps()[name].out_shape, dtype=torch.uint8, device=dev) for name in inputs
        }

        maps = plan.maps()

        def both(inputs: dict = inputs, outputs: dict = outputs, maps: dict = maps) -> None:
            for name, x in inputs.items():
                maps[name].apply(x, out=outputs[name])

        t = median_ms(both, dev, repeats)
        for i in idx:
            ms[i] = t
    out["transform_ms"] = ms
    out["transform_note"] = notes
    out.attrs.update(df.attrs, transform_device=str(dev), transform_experts=n, transform_backend=backend)
    return out
