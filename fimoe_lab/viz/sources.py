"""Where the lab's real tensors and tactic counts come from: small adapters.

- :func:`sample_layer`: seeded, *structured* expert weights (gate rows ramp down the
  rows, up rows ramp across the columns, W2 has diagonal bands), quantized with
  :mod:`fimoe_lab.formats`, so a wrong permutation shows as a broken pattern.
- :func:`load_layer`: one MoE layer of a checkpoint (a shipped sample name or a path),
  through :mod:`fimoe_lab.checkpoints`.
- :func:`tactic_sweep`: the tuner's table for (preset, format, TP), through
  :mod:`fimoe_lab.tune`.
The explorers only see :class:`ExpertTensors` and the tuner's DataFrame.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from fimoe_lab.layout import LayoutError

__all__ = ["ExpertTensors", "LabUnavailable", "sample_layer", "load_layer", "sample_names", "preset_names", "tactic_sweep"]

PLAN_FORMATS = ("bf16", "fp8", "fp8-block", "mxfp8", "nvfp4")
TUNER_FORMATS = ("bf16", "fp8", "fp8-block", "mxfp8", "nvfp4", "mxfp4")


class LabUnavailable(RuntimeError):
    """A part of the toolkit the lab needs is not installed in this build."""


def _require(module: str, what: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and module.startswith(exc.name):
            raise LabUnavailable(f"{what} needs {module}, which is not in this build of fimoe_lab; "
                                 f"install the full toolkit (pip install 'fimoe_lab[all]')") from None
        raise


@dataclass
class ExpertTensors:
    """One MoE layer's expert tensors in the checkpoint layout.

    ``tensors``: ``w13`` ``(E, P*I, H)`` (``H/2`` bytes for packed fp4), ``w2`` ``(E, H, I)``,
    and for block-scaled formats ``w13_scale``/``w2_scale`` in their linear layout
    ``(E, rows, cols/block)`` (fp8-block: ``(E, ceil(rows/128), ceil(cols/128))``).
    ``quantized``: the :class:`~fimoe_lab.formats.QuantizedTensor` of ``w13``/``w2``
    (absent for bf16), used for magnitudes. ``fmt`` is a ``plan_layer`` format name.
    """

    fmt: str
    intermediate: int
    hidden: int
    tensors: dict
    quantized: dict = field(default_factory=dict)
    gated: bool = True
    source: str = ""

    @property
    def experts(self) -> int:
        return int(self.tensors["w13"].shape[0])

    def magnitude(self, name: str, expert: int = 0) -> np.ndarray:
        """float64 ``(rows, elements)`` of one expert: |dequantized weight| per stored element
        (per byte for packed fp4: the larger of its two values), or the decoded scales."""
        if not 0 <= expert < self.experts:
            raise LayoutError(f"expert {expert} is outside 0..{self.experts - 1} of this layer")
        from fimoe_lab import formats
        from fimoe_lab.formats.health import decoded_scales

        if name.endswith("_scale"):
            weight = name[: -len("_scale")]
            if weight in self.quantized:
                return decoded_scales(self.quantized[weight])[expert].double().numpy()
            return self.tensors[name][expert].double().numpy()
        q = self.quantized.get(name)
        if q is None:
            return self.tensors[name][expert].abs().double().numpy()
        one = type(q)(q.values[expert], q.scales[expert],
                      None if q.global_scale is None else q.global_scale[expert], q.fmt, q.block_size,
                      None if q.token_scale is None else q.token_scale[expert])
        values = formats.dequantize(one).abs()
        if q.values.dtype == torch.uint8 and q.fmt.endswith("fp4"):
            values = values.reshape(values.shape[0], -1, 2).amax(dim=-1)
        return values.double().numpy()


def _structured(experts: int, intermediate: int, hidden: int, gated: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 W13 ``(E, P*I, H)`` and W2 ``(E, H, I)`` with patterns a permutation breaks visibly."""
    g = torch.Generator().manual_seed(seed)
    e = torch.arange(1, experts + 1, dtype=torch.float32)[:, None, None]

    def noisy(amp: torch.Tensor) -> torch.Tensor:
        sign = torch.randint(0, 2, amp.shape, generator=g) * 2 - 1
        return amp * (1 + 0.1 * torch.rand(amp.shape, generator=g)) * sign

    r = torch.arange(intermediate, dtype=torch.float32)[:, None] / intermediate
    c = torch.arange(hidden, dtype=torch.float32)[None, :] / hidden
    gate = (0.1 + r + 0 * c) * e
    up = (0.1 + 0 * r + 0.5 * c) * e
    w13 = noisy(torch.cat([gate, up], dim=1) if gated else gate)
    rh = torch.arange(hidden)[:, None] // 16
    ci = torch.arange(intermediate)[None, :] // 16
    w2 = noisy((0.2 + ((rh + ci) % 4).float() / 3) * e)
    return w13, w2


def sample_layer(fmt: str = "mxfp8", experts: int = 4, intermediate: int = 128, hidden: int = 256,
                 gated: bool = True, seed: int = 0) -> ExpertTensors:
    """A seeded layer of structured expert weights, quantized to ``fmt`` (a ``plan_layer`` format).

    W13 ``(E, 2I, H)``: gate rows grow down the rows, up rows grow across the columns, and
    expert ``e`` is ``e + 1`` times larger; W2 ``(E, H, I)`` has diagonal bands. Sizes must
    meet the format's blocks (hidden and intermediate multiples of 32; of 128 for fp8-block).
    """
    if fmt not in PLAN_FORMATS:
        raise LayoutError(f"unknown format {fmt!r}; sample layers exist for {', '.join(PLAN_FORMATS)}")
    w13, w2 = _structured(experts, intermediate, hidden, gated, seed)
    source = f"sample_layer({fmt!r}, experts={experts}, intermediate={intermediate}, hidden={hidden}, seed={seed})"
    if fmt == "bf16":
        return ExpertTensors(fmt, intermediate, hidden, {"w13": w13.bfloat16(), "w2": w2.bfloat16()},
                             gated=gated, source=source)
    from fimoe_lab import formats

    quant = formats.get(fmt)
    q13, q2 = quant.quantize(w13), quant.quantize(w2)
    tensors = {"w13": q13.values, "w2": q2.values}
    if fmt != "fp8":
        tensors.update(w13_scale=q13.scales, w2_scale=q2.scales)
    return ExpertTensors(fmt, intermediate, hidden, tensors, {"w13": q13, "w2": q2}, gated, source)


def sample_names(root: Optional[Path] = None) -> list[str]:
    """The shipped sample checkpoints (``data/checkpoints/<convention>/<name>``), as names for :func:`load_layer`."""
    root = root or Path(__file__).resolve().parents[2] / "data" / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(str(p.relative_to(root)) for p in root.glob("*/*") if p.is_dir())


def load_layer(source: str, layer: int = 0) -> ExpertTensors:
    """MoE ``layer`` of a checkpoint: a shipped sample name (see :func:`sample_names`) or a path.

    Reads through :mod:`fimoe_lab.checkpoints` (expert stacking, gate/up convention,
    quantization format); raises :class:`LabUnavailable` when that part is not installed.
    """
    checkpoints = _require("fimoe_lab.checkpoints", "reading a checkpoint")
    return checkpoints.lab_layer(source, layer)


def preset_names() -> list[str]:
    """Model preset names known to :mod:`fimoe_lab.presets` (empty when it is not installed)."""
    try:
        presets = _require("fimoe_lab.presets", "model presets")
    except LabUnavailable:
        return []
    return sorted(presets.PRESETS)


def tactic_sweep(preset: str, fmt: str, tp: int):
    """The tuner's table for ``preset`` in ``fmt`` at tensor-parallel size ``tp``.

    A pandas DataFrame, one row per (``inter_align``, ``hidden_align``), with tactic counts
    ``t<T>`` per token count, ``extra_bytes_pct``, ``reference``, ``recommended``; see
    :func:`fimoe_lab.tune.sweep.sweep`.
    """
    sweep = _require("fimoe_lab.tune.sweep", "the tuner view")
    return sweep.sweep(preset, fmt, tp)
