"""FP8 E4M3 with one fp32 scale per matrix: vLLM's per-tensor FP8 MoE weights.

Kernel constraint served: the TRT-LLM / CUTLASS per-tensor FP8 MoE path reads E4M3 weights
and one decode scale per expert matrix (``w13_weight_scale`` / ``w2_weight_scale``).
"""

from __future__ import annotations

import torch

from fimoe_lab.specs import FORMATS

from ._validate import require_float, require_format, require_matrix
from .codes import E4M3_MAX, e4m3_decode, e4m3_encode
from .result import QuantizedTensor

FMT = "fp8"
BLOCK = FORMATS[FMT].scale_block
"""0: one scale per matrix (``specs.FORMATS["fp8"]``)."""


def quantize(x: torch.Tensor) -> QuantizedTensor:
    """Quantize ``(..., rows, cols)`` float to E4M3 with one scale per matrix.

    ``scales`` (fp32 ``(...)``) = amax/448 of each ``(rows, cols)`` matrix (1.0 for an
    all-zero one); ``values`` (float8_e4m3fn ``(..., rows, cols)``) = e4m3(x / scale),
    round to nearest even, saturating. Error bound: ``|x - deq| <= max(|x| / 16, scale / 1024)``.
    """
    require_float(x, "fp8.quantize")
    require_matrix(x, "fp8.quantize")
    xf = x.float()
    amax = xf.abs().amax(dim=(-2, -1))
    # a tensor divisor: CUDA divides by a Python scalar as a multiply by its reciprocal (1 ulp off the CPU)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    values = e4m3_encode(xf / scale[..., None, None]).view(torch.float8_e4m3fn)
    return QuantizedTensor(values, scale, None, FMT, BLOCK)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(..., rows, cols)`` = values * scale (per matrix), in ``dtype``."""
    require_format(q, FMT, "fp8.dequantize")
    return (e4m3_decode(q.values) * q.scales[..., None, None]).to(dtype)
