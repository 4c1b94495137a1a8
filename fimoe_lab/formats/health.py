"""Warnings for quantized tensors that a kernel would turn into garbage or NaN."""

from __future__ import annotations

import torch

from fimoe_lab.engines import VLLM_MIN_BLOCK_SCALE
from fimoe_lab.specs import FORMATS

from .codes import e4m3_decode, ue8m0_decode
from .result import QuantizedTensor

TINY_SCALE = VLLM_MIN_BLOCK_SCALE
"""Block scales below this (seen: ~1e-23 in dead experts of real FP8 checkpoints) made
FlashInfer's Hopper CUTLASS FP8 MoE kernel emit NaN; vLLM clamps them to >= 1e-10 (its profile's value rule)."""

HOPPER_ZEROS = "looks like FlashInfer nvfp4_quantize on a pre-Blackwell GPU returned zeros"


def decoded_scales(q: QuantizedTensor) -> torch.Tensor:
    """The block/matrix scales of ``q`` as float32 (E4M3 and UE8M0 bytes decoded), same shape."""
    scale_dtype = FORMATS[q.fmt].scale_dtype
    if scale_dtype == "float8_e4m3fn":
        return e4m3_decode(q.scales)
    if scale_dtype == "uint8":  # UE8M0 exponent bytes
        return ue8m0_decode(q.scales)
    return q.scales.float()


def _where(mask: torch.Tensor, limit: int = 5) -> str:
    """'at [i, j, ...], ...' for the first ``limit`` True positions of ``mask``."""
    idx = mask.nonzero()[:limit].tolist()
    more = f" (+{int(mask.sum()) - len(idx)} more)" if int(mask.sum()) > len(idx) else ""
    return f"at {idx}{more}"


def check_quantized(q: QuantizedTensor, original: torch.Tensor | None = None) -> list[str]:
    """Warnings (empty list: none) about ``q``, optionally against the tensor it came from.

    Flags: NaN/inf scales (incl. global and per-token scales); all-zero scales (or scale bytes:
    UE8M0 byte 0 is 2**-127) or values for a non-zero input (the Hopper trap: FlashInfer 0.6.13's ``nvfp4_quantize`` needs sm_100 and
    returns zeros on an H100/H200 without an error); block scales in (0, 1e-10) (dead experts
    that made the Hopper CUTLASS kernel emit NaN); a shape that does not match ``original``.
    Positions are indices into the scale tensor ``(..., rows, blocks)``.
    """
    warnings: list[str] = []
    scales = decoded_scales(q)
    bad = ~torch.isfinite(scales)
    if bad.any():
        note = ""
        if q.fmt == "nvfp4-per-token" and q.token_scale is not None:
            zero_rows = (q.token_scale == 0)[..., None].expand_as(bad) & bad
            if zero_rows.any():
                note = (
                    f"; {int(zero_rows.sum())} of them in all-zero rows, where FlashInfer's CUDA per-token "
                    f"kernel writes 0x7F (NaN) because rcp(0) * 0 = inf * 0"
                )
        warnings.append(f"{q.fmt}: {int(bad.sum())} of {bad.numel()} block scales are NaN/inf {_where(bad)}{note}.")
    for name, extra in (("global_scale", q.global_scale), ("token_scale", q.token_scale)):
        if extra is not None and not torch.isfinite(extra).all():
            warnings.append(f"{q.fmt}: {name} has NaN/inf {_where(~torch.isfinite(extra))}.")
    if q.global_scale is not None and (q.global_scale == 0).any():
        warnings.append(f"{q.fmt}: global_scale is 0 {_where(q.global_scale == 0)}: dequant divides by it.")

    input_nonzero = original is not None and bool((original != 0).any())
    values_zero = not bool((q.values.reshape(-1).contiguous().view(torch.uint8) != 0).any())
    scale_bytes_zero = not bool((q.scales.reshape(-1).contiguous().view(torch.uint8) != 0).any())
    scales_zero = scale_bytes_zero or not bool((scales != 0).any())
    if (input_nonzero or not values_zero) and scales_zero:
        hint = f": {HOPPER_ZEROS}" if q.fmt.startswith("nvfp4") else ""
        warnings.append(f"{q.fmt}: every block scale is 0 (all scale bytes zero) for a non-zero input{hint}.")
        return warnings
    if input_nonzero and values_zero:
        hint = f" ({HOPPER_ZEROS})" if q.fmt.startswith("nvfp4") else ""
        warnings.append(f"{q.fmt}: every quantized value is 0 for a non-zero input{hint}.")

    tiny = (scales.abs() > 0) & (scales.abs() < TINY_SCALE)
    if tiny.any():
        warnings.append(
            f"{q.fmt}: {int(tiny.sum())} block scales are below {TINY_SCALE:g} (min "
            f"{scales.abs()[tiny].min().item():.3g}) {_where(tiny)}: dead experts like these made FlashInfer's "
            f"Hopper CUTLASS kernel emit NaN; clamp them to >= {TINY_SCALE:g}."
        )
    if original is not None and tuple(original.shape) != tuple(q.shape):
        warnings.append(f"{q.fmt}: shape {tuple(q.shape)} does not match the original {tuple(original.shape)}.")
    return warnings
