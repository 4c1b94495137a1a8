"""FP8 E4M3 with one fp32 scale per 128x128 block: DeepSeek-V3 style ``weight_scale_inv``.

Kernel constraint served: FlashInfer's DeepSeek FP8 block-scale MoE reads E4M3 weights and
``(rows/128, cols/128)`` fp32 decode scales per expert (rounded up when a dim is not a
multiple of 128; the last block is then partial).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fimoe_lab.specs import FORMATS

from ._validate import require_float, require_format, require_matrix
from .codes import E4M3_MAX, e4m3_decode, e4m3_encode
from .result import QuantizedTensor

FMT = "fp8-block"
ROWS, BLOCK = FORMATS[FMT].scale_block_rows, FORMATS[FMT].scale_block
"""One scale per ``ROWS x BLOCK`` block (128 x 128), as ``specs.FORMATS["fp8-block"]`` says."""


def _blocked(x: torch.Tensor) -> torch.Tensor:
    """``(..., rows, cols)`` -> zero-padded ``(..., rows/128, 128, cols/128, 128)`` (rounded up)."""
    rows, cols = x.shape[-2:]
    pad_rows, pad_cols = -rows % ROWS, -cols % BLOCK
    xp = F.pad(x, (0, pad_cols, 0, pad_rows))
    return xp.reshape(*x.shape[:-2], (rows + pad_rows) // ROWS, ROWS, (cols + pad_cols) // BLOCK, BLOCK)


def quantize(x: torch.Tensor) -> QuantizedTensor:
    """Quantize ``(..., rows, cols)`` float to E4M3 with a decode scale per 128x128 block.

    ``scales`` fp32 ``(..., ceil(rows/128), ceil(cols/128))`` = block amax/448 (1.0 for an
    all-zero block); ``values`` float8_e4m3fn ``(..., rows, cols)`` = e4m3(x / scale).
    Error bound: ``|x - deq| <= max(|x| / 16, scale / 1024)`` with the element's block scale.
    """
    require_float(x, "fp8_block.quantize")
    require_matrix(x, "fp8_block.quantize")
    rows, cols = x.shape[-2:]
    blocks = _blocked(x.float())
    amax = blocks.abs().amax(dim=(-3, -1))
    # a tensor divisor: CUDA divides by a Python scalar as a multiply by its reciprocal (1 ulp off the CPU)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    q = e4m3_encode(blocks / scale[..., :, None, :, None])
    values = q.reshape(*q.shape[:-4], q.shape[-4] * ROWS, q.shape[-2] * BLOCK)[..., :rows, :cols]
    return QuantizedTensor(values.contiguous().view(torch.float8_e4m3fn), scale, None, FMT, BLOCK)


def expand_block_scales(scales: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """fp32 ``(..., ceil(rows/128), ceil(cols/128))`` -> ``(..., rows, cols)``: each element's scale."""
    full = scales.repeat_interleave(ROWS, dim=-2).repeat_interleave(BLOCK, dim=-1)
    return full[..., :rows, :cols]


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(..., rows, cols)`` = values * weight_scale_inv of the element's block, in ``dtype``."""
    require_format(q, FMT, "fp8_block.dequantize")
    rows, cols = q.values.shape[-2:]
    return (e4m3_decode(q.values) * expand_block_scales(q.scales, rows, cols)).to(dtype)
