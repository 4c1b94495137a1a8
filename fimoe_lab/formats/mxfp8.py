"""MXFP8: E4M3 values with one UE8M0 (power-of-two) scale per 32 values along the last dim.

Kernel constraint served: FlashInfer's MXFP8 TRT-LLM MoE (weights and activations); the
arithmetic follows ``cvt_warp_fp16_to_mxfp8`` in FlashInfer 0.6.13
(``data/csrc/nv_internal/tensorrt_llm/kernels/quantization_utils.cuh``):
``sf = vecMax * rcp.approx(448)``, scale byte = UE8M0 rounded *up* (``cvt.rp.satfinite``),
``out = e4m3(x * rcp.approx(2**(e-127)))`` (0 when the scale underflows to 2**-127).
Rounding the scale up means no value saturates. Note: FlashInfer's own Python reference
(``trace/templates/quantize.py``) floors instead; the kernel ceils.
"""

from __future__ import annotations

import torch

from fimoe_lab.specs import FORMATS

from ._validate import require_float, require_format, require_last_dim_multiple
from .codes import E4M3_MAX, e4m3_decode, e4m3_encode, ftz, rcp_approx_ftz, ue8m0_decode, ue8m0_encode_ceil
from .result import QuantizedTensor

FMT = "mxfp8"
BLOCK = FORMATS[FMT].scale_block


def quantize(x: torch.Tensor) -> QuantizedTensor:
    """Quantize ``(..., cols)`` float (cols % 32 == 0) to MXFP8.

    Returns ``values`` float8_e4m3fn ``(..., cols)`` and ``scales`` uint8 UE8M0
    ``(..., cols/32)`` (linear layout; an all-zero block gets byte 0, as the kernel writes).
    Error bound: ``|x - deq| <= max(|x| / 16, 2**(e-127) / 1024)``.
    """
    require_float(x, "mxfp8.quantize")
    require_last_dim_multiple(x, BLOCK, "mxfp8.quantize", "one UE8M0 scale per 32 values")
    xf = ftz(x.float())
    blocks = xf.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    sf = ftz(blocks.abs().amax(dim=-1) * rcp_approx_ftz(torch.tensor(E4M3_MAX, device=x.device)))
    e = ue8m0_encode_ceil(sf)
    sf_value = ftz(ue8m0_decode(e))
    out_scale = torch.where(sf_value != 0, rcp_approx_ftz(sf_value), torch.zeros_like(sf_value))
    values = e4m3_encode(ftz(blocks * out_scale[..., None])).reshape(x.shape)
    return QuantizedTensor(values.view(torch.float8_e4m3fn), e, None, FMT, BLOCK)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(..., cols)`` = values * 2**(scale - 127) per block of 32, in ``dtype``."""
    require_format(q, FMT, "mxfp8.dequantize")
    v = e4m3_decode(q.values)
    blocks = v.reshape(*v.shape[:-1], v.shape[-1] // BLOCK, BLOCK) * ue8m0_decode(q.scales)[..., None]
    return blocks.reshape(v.shape).to(dtype)
