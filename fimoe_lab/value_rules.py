"""The engines' value rules (:class:`fimoe_lab.engines.ValueRule`): the values they change while preparing weights.

Applied in the checkpoint layout, before a plan's byte maps (:meth:`fimoe_lab.plan.LayerPlan.apply`), as the
engines apply them before their layout steps.

``fp8_requantize_max`` (vLLM 0.34, SGLang 0.5.23, FP8 per-tensor): a gated W13 ``(E, 2I, H)`` float8_e4m3fn
with one scale per projection ``s (E, 2)`` float32 becomes one scale per expert ``m = max(s[:, 0], s[:, 1])``
``(E,)`` and, for each expert ``e`` and half ``k`` (rows ``[kI, (k+1)I)``), as the engines run it on CUDA::

    d = float16(float32(w) * float32(float16(s[e, k])))   # per_tensor_dequantize: w.to(float16) * s; PyTorch's
                                                          # CUDA multiply reads the float32 scale as float16
    x = float32(d) * (1.0f / m[e])                        # static per-tensor quant: the inverted scale, float32
    w' = e4m3fn(clamp(x, -448, 448))                      # round to nearest even; NaN -> rule.nan_to

(an overflow to +-inf in float16 clamps to +-448). A W13 with one scale per expert (non-gated, or given
``(E,)``) is left as it is: the engines have nothing to fuse. With ``rule.where == "differs"`` (the lossless form)
only experts whose two scales differ are requantized; the others keep their bytes, ``m`` their scale.

``clamp_block_scales`` (vLLM 0.34, DeepSeek FP8 block): ``s = s.clamp(min=floor)`` on both block-scale tensors, in
their dtype (NaN stays NaN).

The way back (:func:`undo`) restores shapes, not values: the requantized W13 keeps the engine's values and its
scale becomes ``[m, m]`` per expert. A converted file keeps the checkpoint bytes of every tensor a rule changes
(``ValueRule.kept``, :func:`fimoe_lab.checkpoints.fileformat.kept_tensors`), which restore reads instead, so
both rules come back exactly; :func:`undo` serves files whose record keeps none.
"""

from __future__ import annotations

from typing import Optional

import torch

from fimoe_lab.engines import ValueRule
from fimoe_lab.errors import LayoutError

__all__ = ["FP8_MAX", "requantize_fp8_max", "applies", "apply", "undo"]

FP8_MAX = 448.0
"""The largest finite float8_e4m3fn value, the engines' clamp."""


def requantize_fp8_max(w13: torch.Tensor, scale: torch.Tensor, nan_to: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w13', m)``: W13 ``(E, 2I, H)`` float8_e4m3fn with per-projection scales ``(E, 2)`` requantized to
    ``m = max(gate, up)`` ``(E,)`` in the scales' dtype (module docstring). New tensors; any device."""
    if w13.dtype != torch.float8_e4m3fn or scale.dim() != 2 or scale.shape[1] != 2 or w13.shape[1] % 2:
        raise LayoutError(
            f"fp8_requantize_max takes W13 float8_e4m3fn (E, 2I, H) and scales (E, 2); got {w13.dtype} "
            f"{tuple(w13.shape)} and {tuple(scale.shape)}"
        )
    m = scale.max(dim=1).values  # one of the two: exact in the scale's dtype (the engines hold it as float32)
    s = scale.to(torch.float32)
    half = w13.shape[1] // 2
    parts = w13.view(w13.shape[0], 2, half, *w13.shape[2:])
    shape = (-1, 2) + (1,) * (parts.dim() - 2)
    d = (parts.to(torch.float32) * s.to(torch.float16).to(torch.float32).view(shape)).to(torch.float16)
    x = d.to(torch.float32) * torch.reciprocal(m.to(torch.float32)).view(-1, *(1,) * (parts.dim() - 1))
    x = x.clamp(-FP8_MAX, FP8_MAX).nan_to_num(nan=nan_to)
    return x.to(torch.float8_e4m3fn).reshape(w13.shape), m


def applies(rule: Optional[ValueRule], tensors: dict[str, Optional[torch.Tensor]]) -> bool:
    """Whether ``rule`` changes anything of ``tensors`` (shapes suffice: meta tensors allowed):
    ``fp8_requantize_max`` needs W13 and per-projection scales ``(E, 2)``; ``clamp_block_scales`` a scale."""
    if rule is None:
        return False
    if rule.kind == "fp8_requantize_max":
        s13 = tensors.get("w13_scale")
        return tensors.get("w13") is not None and s13 is not None and s13.dim() == 2 and s13.shape[1] == 2
    return any(tensors.get(name) is not None for name in rule.tensors)


def apply(
    rule: Optional[ValueRule], tensors: dict[str, Optional[torch.Tensor]], in_place: bool = False
) -> dict[str, Optional[torch.Tensor]]:
    """``tensors`` (``w13``, ``w2``, ``w13_scale``, ``w2_scale``, checkpoint layout) with ``rule`` applied (new
    tensors where it changes them; the dict itself when ``rule`` is None or finds nothing to change: a W13 with
    one scale per expert already). ``in_place``: the clamp writes the given tensors, as vLLM's ``clamp_`` does
    (``fp8_requantize_max`` has no in-place form)."""
    if rule is None or not applies(rule, tensors):
        return tensors
    out = dict(tensors)
    if in_place and rule.kind != "clamp_block_scales":
        raise LayoutError(f"value rule {rule.kind!r} has no in-place form")
    if rule.kind == "fp8_requantize_max":
        w13, s13 = tensors["w13"], tensors["w13_scale"]
        assert w13 is not None and s13 is not None  # applies() checked
        w, m = requantize_fp8_max(w13, s13, rule.nan_to)
        if rule.where == "differs":  # experts whose gate and up scales are equal keep their bytes
            same = s13[:, 0] == s13[:, 1]
            keep = same.view(-1, *(1,) * (w13.dim() - 1))
            w = torch.where(keep, w13.view(torch.uint8), w.view(torch.uint8)).view(w13.dtype)
        out["w13"], out["w13_scale"] = w, m
        return out
    if rule.kind == "clamp_block_scales":
        for name in rule.tensors:
            t = tensors.get(name)
            if t is not None and t.is_floating_point():  # exponent bytes (UE8M0) have no values below the floor
                out[name] = t.clamp_(min=rule.floor) if in_place else t.clamp(min=rule.floor)
        return out
    raise LayoutError(f"unknown value rule {rule.kind!r}")


def undo(rule: Optional[ValueRule], name: str, x: torch.Tensor, checkpoint_shape: tuple[int, ...]) -> torch.Tensor:
    """Tensor ``name`` of a chunk of experts back in the checkpoint's shape after ``rule`` (values kept: the rule
    is lossy): a requantized W13 scale ``(e,)`` becomes ``[m, m]`` ``(e, 2)`` where the checkpoint held one per
    projection; anything else is ``x``."""
    per_projection = len(checkpoint_shape) == 2 and checkpoint_shape[1] == 2
    if (
        rule is not None
        and rule.kind == "fp8_requantize_max"
        and name == "w13_scale"
        and x.dim() == 1
        and per_projection
    ):
        return torch.stack((x, x), dim=1)
    return x
