"""Formats by name, so other code can say ``formats.get("nvfp4").quantize(x)``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import fp8, fp8_block, mxfp4, mxfp8, nvfp4, nvfp4_per_token
from .result import QuantizedTensor


@dataclass(frozen=True)
class Format:
    """One quantization format: its name, scale granularity and (de)quantizers.

    ``quantize(x) -> QuantizedTensor`` and ``dequantize(q, dtype=torch.float32) -> Tensor``;
    ``block_size`` values along the last dim share a scale (0: one per matrix; 128 for
    fp8-block means 128x128); ``packed``: two values per byte.
    """

    name: str
    quantize: Callable[[torch.Tensor], QuantizedTensor]
    dequantize: Callable[..., torch.Tensor]
    block_size: int
    packed: bool


_FORMATS = {
    f.name: f
    for f in (
        Format(fp8.FMT, fp8.quantize, fp8.dequantize, 0, False),
        Format(fp8_block.FMT, fp8_block.quantize, fp8_block.dequantize, fp8_block.BLOCK, False),
        Format(mxfp8.FMT, mxfp8.quantize, mxfp8.dequantize, mxfp8.BLOCK, False),
        Format(nvfp4.FMT, nvfp4.quantize, nvfp4.dequantize, nvfp4.BLOCK, True),
        Format(nvfp4_per_token.FMT, nvfp4_per_token.quantize, nvfp4_per_token.dequantize, nvfp4.BLOCK, True),
        Format(mxfp4.FMT, mxfp4.quantize, mxfp4.dequantize, mxfp4.BLOCK, True),
    )
}


def names() -> tuple[str, ...]:
    """Registered format names: fp8, fp8-block, mxfp8, nvfp4, nvfp4-per-token, mxfp4."""
    return tuple(_FORMATS)


def get(name: str) -> Format:
    """The :class:`Format` called ``name``; ``ValueError`` listing the known names otherwise."""
    try:
        return _FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown quantization format {name!r}; known: {', '.join(_FORMATS)}.") from None


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize ``q`` with the format it names: ``(..., rows, cols)`` in ``dtype``."""
    return get(q.fmt).dequantize(q, dtype)
