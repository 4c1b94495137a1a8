"""Predicted time of one MoE layer per padding on a target GPU (an estimate, never a measurement).

A roofline per token count ``T`` for one rank's experts, padded to ``(I', H')``:

* weight bytes per expert ``B_e = (P + 1) * I' * H' * bits / 8`` (``P`` = 2 gated, 1 not;
  W13 is ``P*I' x H'``, W2 is ``H' x I'``; ``bits`` = :attr:`FormatSpec.bits_per_weight`,
  block scales included);
* experts a batch touches (uniform routing): ``E_T = E * (1 - (1 - k/E)^T)``, each with
  ``m = T*k / E_T`` tokens;
* memory time ``t_mem = E_T * B_e / (BW * bw_eff)`` (decode is bound by it);
* compute time ``t_cmp = 2 * T * k * (P + 1) * I' * H' / (peak * flops_eff * eff)`` with
  ``peak`` the dense tensor FLOP/s of the format's activation dtype and ``eff = max over
  the valid tactics' tile_N of m / (ceil(m / tile_N) * tile_N)`` (the token tile the
  kernel pads to; 1 on CUTLASS, which has no tactic list here);
* ``t(T) = overhead + max(t_mem, t_cmp)``; the profile's time is ``sum_T w_T * t(T) / sum_T w_T``.

``bw_eff``, ``flops_eff`` and ``overhead`` are the GPU row's calibration constants (1, 1,
0 = the datasheet roofline until ``benchmarks/tune_calibrate.py`` measures them on that
GPU); everything else is a datasheet number.

The one-time transform (convert reads and writes every weight byte of the rank once)
is ``2 * E * B_e / BW``, reported beside it and not in the per-step time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from ..errors import OracleError
from ..specs import FORMATS, get_activation

__all__ = ["GpuSpec", "GPUS", "get_gpu", "compute_dtype", "layer_time_us", "profile_time_us", "transform_us"]


@dataclass(frozen=True)
class GpuSpec:
    """Published peak numbers of one GPU (dense tensor-core FLOP/s, no sparsity).

    sm: compute capability x 10 (90 Hopper, 100/103 Blackwell); TRTLLM-Gen MoE kernels run
    only on the SM100 family (:attr:`trtllm_gen`), Hopper runs CUTLASS.
    bandwidth: HBM bytes/s.  flops: {compute dtype: FLOP/s}; a dtype the GPU lacks
    (FP4 on Hopper) runs at the next wider one it has (``fp4 -> fp8 -> bf16``).
    bw_eff, flops_eff: achieved fraction of ``bandwidth`` / ``flops``; overhead_us: fixed
    time per layer call (the calibration constants; see the module docstring).
    """

    name: str
    sm: int
    bandwidth: float
    flops: Mapping[str, float]
    source: str
    bw_eff: float = 1.0
    flops_eff: float = 1.0
    overhead_us: float = 0.0

    @property
    def trtllm_gen(self) -> bool:
        """True on the SM100 family, where FlashInfer's TRTLLM-Gen MoE kernels run."""
        return self.sm // 10 == 10

    def peak(self, dtype: str) -> float:
        for d in {"fp4": ("fp4", "fp8", "bf16"), "fp8": ("fp8", "bf16"), "bf16": ("bf16",)}[dtype]:
            if d in self.flops:
                return self.flops[d]
        raise OracleError(f"{self.name} has no {dtype} peak in the GPU table", fix="add it to fimoe_lab.tune.cost.GPUS")


GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("b200", 100, 8.0e12, {"bf16": 2.25e15, "fp8": 4.5e15, "fp4": 9.0e15}, "NVIDIA DGX/HGX B200 datasheet"),
        GpuSpec("gb200", 100, 8.0e12, {"bf16": 2.5e15, "fp8": 5.0e15, "fp4": 10.0e15}, "NVIDIA GB200 NVL72 datasheet"),
        GpuSpec("b300", 103, 8.0e12, {"bf16": 2.25e15, "fp8": 4.5e15, "fp4": 13.5e15}, "NVIDIA HGX B300 datasheet"),
        GpuSpec("h200", 90, 4.8e12, {"bf16": 0.989e15, "fp8": 1.979e15}, "NVIDIA H200 SXM datasheet"),
        GpuSpec("h100", 90, 3.35e12, {"bf16": 0.989e15, "fp8": 1.979e15}, "NVIDIA H100 SXM datasheet"),
    )
}


def get_gpu(name: str) -> GpuSpec:
    """The row of :data:`GPUS` named ``name`` (case-insensitive); :class:`OracleError` otherwise."""
    key = str(name).strip().lower()
    if key not in GPUS:
        raise OracleError(f"unknown GPU {name!r}", fix=f"choose one of {', '.join(GPUS)}")
    return GPUS[key]


def compute_dtype(fmt: str) -> str:
    """The tensor-core input dtype of tuner format ``fmt``: its activation dtype (``bf16``, ``fp8``, ``fp4``)."""
    enums = FORMATS[fmt].tactics
    if enums is None:
        raise OracleError(f"{fmt!r} is not a tuner format", fix="choose a format with tactic enums")
    act = enums.dtype_act.lower()
    return "fp4" if "e2m1" in act else "fp8" if "e4m3" in act else "bf16"


def _expert_bytes(fmt: str, activation: str, intermediate: int, hidden: int) -> float:
    p = get_activation(activation).projections
    return (p + 1) * intermediate * hidden * FORMATS[fmt].bits_per_weight / 8


def layer_time_us(
    gpu: GpuSpec,
    fmt: str,
    activation: str,
    intermediate: int,
    hidden: int,
    experts: int,
    top_k: int,
    tokens: int,
    tiles: Optional[Sequence[int]],
) -> Optional[float]:
    """Predicted microseconds of one rank's MoE layer at ``tokens``; None without a valid tile.

    ``intermediate``/``hidden``: padded per-rank sizes; ``tiles``: the tile_N of the valid
    tactics at ``tokens`` (TRT-LLM; empty: none, so None), or None for no tile term
    (CUTLASS). See the module docstring for the equations.
    """
    if tiles is not None and not tiles:
        return None
    touched = experts * (1.0 - (1.0 - top_k / experts) ** tokens)
    m = tokens * top_k / touched
    eff = max(m / (math.ceil(m / t) * t) for t in tiles) if tiles is not None else 1.0
    p = get_activation(activation).projections
    t_mem = touched * _expert_bytes(fmt, activation, intermediate, hidden) / (gpu.bandwidth * gpu.bw_eff)
    flops = gpu.peak(compute_dtype(fmt)) * gpu.flops_eff * eff
    t_cmp = 2.0 * tokens * top_k * (p + 1) * intermediate * hidden / flops
    return gpu.overhead_us + 1e6 * max(t_mem, t_cmp)


def profile_time_us(times: Sequence[Optional[float]], weights: Sequence[float]) -> Optional[float]:
    """``sum w_T t_T / sum w_T``; None if any ``t_T`` is None (no tactic at that token count)."""
    if any(t is None for t in times):
        return None
    return sum(w * t for w, t in zip(weights, times)) / sum(weights)  # type: ignore[operator]


def transform_us(gpu: GpuSpec, fmt: str, activation: str, intermediate: int, hidden: int, experts: int) -> float:
    """One-time conversion estimate: every padded weight byte of the rank written once and read once."""
    return 1e6 * 2 * experts * _expert_bytes(fmt, activation, intermediate, hidden) / gpu.bandwidth
