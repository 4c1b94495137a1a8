"""MXFP4: E2M1 values packed two per byte, one UE8M0 scale per 32 values (gpt-oss weights).

Kernel constraint served: FlashInfer's MXFP4 MoE (gpt-oss). The arithmetic follows
FlashInfer 0.6.13's ``mxfp4_quantize`` (``fp4_quantize`` with ``sf_use_ue8m0=True``, i.e.
``cvt_warp_fp16_to_fp4<..., UE8M0_SF=true>`` in ``quantization_utils.cuh``):
``m = vecMax * rcp.approx(6)``; scale byte e = UE8M0 rounded *up* (``cvt.rp.satfinite``);
``out = e2m1(x * 2**(127-e))`` (``* 1`` when e == 0, ``* 0`` for an all-zero block).
Rounding the scale up means no value saturates.
"""

from __future__ import annotations

import torch

from fimoe_lab.specs import FORMATS

from ._validate import require_float, require_format, require_last_dim_multiple
from .codes import (
    E2M1_MAX,
    e2m1_decode,
    e2m1_encode,
    e2m1_pair_max_abs,
    ftz,
    pack_nibbles,
    rcp_approx_ftz,
    ue8m0_decode,
    ue8m0_encode_ceil,
    unpack_nibbles,
)
from .result import QuantizedTensor

FMT = "mxfp4"
BLOCK = FORMATS[FMT].scale_block


def quantize(x: torch.Tensor) -> QuantizedTensor:
    """Quantize ``(..., cols)`` float (cols % 32 == 0) to MXFP4.

    Returns ``values`` uint8 ``(..., cols/2)`` (two E2M1 codes per byte, low nibble first)
    and ``scales`` uint8 UE8M0 ``(..., cols/32)`` (linear layout).
    Error bound: half an E2M1 step of the scaled value: ``<= 2**(e-127) * {.25, .5, 1}``
    for scaled magnitudes in ``[0, 2), [2, 4), [4, 6]``.
    """
    require_float(x, "mxfp4.quantize")
    require_last_dim_multiple(x, BLOCK, "mxfp4.quantize", "one UE8M0 scale per 32 values")
    xf = ftz(x.float())
    blocks = xf.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    m = ftz(blocks.abs().amax(dim=-1) * rcp_approx_ftz(torch.tensor(E2M1_MAX, device=x.device)))
    e = ue8m0_encode_ceil(m)
    power = ftz(ue8m0_decode(254 - e))  # 2**(127 - e), exact; e == 254 gives 2**-127 -> flushed
    out_scale = torch.where(m == 0, torch.zeros_like(m), torch.where(e == 0, torch.ones_like(m), power))
    codes = e2m1_encode(ftz(blocks * out_scale[..., None])).reshape(x.shape)
    return QuantizedTensor(pack_nibbles(codes), e, None, FMT, BLOCK)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(..., cols)`` = e2m1 * 2**(scale - 127) per block of 32, in ``dtype``."""
    require_format(q, FMT, "mxfp4.dequantize")
    v = e2m1_decode(unpack_nibbles(q.values))
    return _scaled(v.reshape(*v.shape[:-1], v.shape[-1] // BLOCK, BLOCK), q).reshape(v.shape).to(dtype)


def max_abs_per_byte(q: QuantizedTensor) -> torch.Tensor:
    """float32 ``(..., cols/2)``: per stored byte the larger ``|value|`` of its two, equal to
    ``dequantize(q).abs()`` reduced by max over each pair, without unpacking (one 256-entry lookup per byte)."""
    require_format(q, FMT, "mxfp4.max_abs_per_byte")
    m = e2m1_pair_max_abs(q.values)
    return _scaled(m.reshape(*m.shape[:-1], m.shape[-1] // (BLOCK // 2), BLOCK // 2), q).reshape(m.shape).abs()


def _scaled(blocks: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    """``blocks (..., cols/32, k)`` of E2M1 values x their block's UE8M0 scale ``2**(e - 127)``."""
    return blocks * ue8m0_decode(q.scales)[..., None]
