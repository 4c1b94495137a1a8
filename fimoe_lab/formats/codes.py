"""Bit-level primitives shared by every format: E2M1, E4M3, UE8M0, FTZ and the GPU reciprocal.

Each function mirrors one hardware conversion that FlashInfer's quantization kernels use, so
the formats built on them agree with the kernels bit for bit. The rules, as read from the
CUDA 13 headers (``cuda_fp4.hpp``, ``cuda_fp8.hpp``: the host emulation of the PTX ``cvt``
instructions) and checked on an H200 where the instruction exists there:

* E2M1 (``cvt.rn.satfinite.e2m1x2.f32``): round to nearest, ties to even, onto
  {0, .5, 1, 1.5, 2, 3, 4, 6}; |x| > 6 and +-inf saturate to +-6; the sign bit is kept, also
  for results that round to zero (-0.1 -> code 0x8); NaN -> +6 (code 0x7). Two codes per
  byte, the first element in the low nibble (the instruction puts operand ``a`` high, and
  TRT-LLM passes element 1 as ``a``).
* E4M3 (``cvt.rn.satfinite.e4m3x2.f32``): round to nearest even incl. subnormals, |x| > 448
  saturates to +-448, NaN of either sign -> 0x7F. On an H200 this matched
  ``x.clamp(-448, 448).to(torch.float8_e4m3fn)`` for all 2**32 float32 inputs except
  negative NaNs (torch gives 0xFF, the hardware 0x7F). The clamp is explicit because
  torch's own overflow rule changed between releases (older ones turned >= 464 into NaN).
* UE8M0 (``cvt.rp.satfinite.ue8m0x2.f32``, used by MXFP8/MXFP4 scales in FlashInfer):
  round *up* to a power of two, i.e. the byte is ``clamp(ceil(log2|x|) + 127, 0, 254)``;
  0 -> 0, NaN -> 255, inf -> 254. Value of a byte e: ``2**(e - 127)``.
* FTZ: FlashInfer builds its kernels with ``-use_fast_math``, so every float32 multiply flushes
  subnormal inputs and results to a zero of the same sign.
* ``rcp.approx.ftz.f32``: see :mod:`fimoe_lab.formats._rcp_approx_table`.
"""

from __future__ import annotations

import base64
import zlib
from functools import lru_cache

import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0
FLOAT32_MIN_NORMAL = 2.0**-126

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""Value of each 4-bit E2M1 code 0..15 (bit 3 is the sign)."""

_E2M1_ROUND_UP_AT = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
"""Magnitude thresholds between neighbouring codes; True: a tie goes up (the upper code is even)."""


def ftz(x: torch.Tensor) -> torch.Tensor:
    """Flush float32 subnormals to a zero of the same sign (the GPU's ``.ftz`` behaviour).

    Shapes and dtype are kept; NaN and inf pass through.
    """
    return torch.where(x.abs() < FLOAT32_MIN_NORMAL, x * 0.0, x)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float32 ``(...)`` -> uint8 E2M1 codes ``(...)`` in 0..15, as ``cvt.rn.satfinite.e2m1x2.f32``.

    Round to nearest even on the E2M1 grid, saturate at +-6, keep the sign of zeros,
    NaN -> 0x7. Serves every FP4 (NVFP4, MXFP4) value in FlashInfer's kernels.
    """
    a = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for threshold, tie_goes_up in _E2M1_ROUND_UP_AT:
        code += (a >= threshold if tie_goes_up else a > threshold).to(torch.uint8)
    code |= torch.signbit(x).to(torch.uint8) << 3
    return torch.where(torch.isnan(x), torch.full_like(code, 0x7), code)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes ``(...)`` (0..15) -> float32 values ``(...)``."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.long() & 0xF]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``(..., 2n)`` -> packed uint8 ``(..., n)``, element ``2j`` in the low nibble.

    This is the byte layout of FlashInfer's ``FLOAT4_E2M1X2`` tensors.
    """
    if codes.shape[-1] % 2:
        raise ValueError(
            f"pack_nibbles: the last dim holds 2 codes per byte, so it must be even; got shape "
            f"{tuple(codes.shape)}. Fix: pad the last dim by one code."
        )
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] & 0xF) | ((pairs[..., 1] & 0xF) << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Packed uint8 ``(..., n)`` -> uint8 codes ``(..., 2n)``; inverse of :func:`pack_nibbles`."""
    if packed.dtype != torch.uint8:
        raise ValueError(
            f"unpack_nibbles: packed FP4 must be uint8 (2 codes per byte), got {packed.dtype}. "
            f"Fix: pass tensor.view(torch.uint8)."
        )
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """float32 ``(...)`` -> uint8 E4M3 bits ``(...)``, as ``cvt.rn.satfinite.e4m3x2.f32``.

    Saturates to +-448 whatever torch's own cast does on overflow; NaN -> 0x7F.
    """
    bits = x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(torch.isnan(x), torch.full_like(bits, 0x7F), bits)


def e4m3_decode(bits: torch.Tensor) -> torch.Tensor:
    """uint8 (or float8_e4m3fn) E4M3 ``(...)`` -> float32 ``(...)``; 0x7F/0xFF decode to NaN."""
    return bits.view(torch.float8_e4m3fn).float()


def ue8m0_encode_ceil(x: torch.Tensor) -> torch.Tensor:
    """float32 ``(...)`` -> uint8 UE8M0 ``(...)``: the smallest power of two >= |x|.

    As ``cvt.rp.satfinite.ue8m0x2.f32`` (FlashInfer's MXFP8 and MXFP4 scales): byte
    ``clamp(ceil(log2|x|) + 127, 0, 254)``, 0 -> 0, NaN -> 255, inf -> 254.
    """
    bits = x.float().abs().contiguous().view(torch.int32)
    exponent = bits >> 23
    mantissa = bits & 0x7FFFFF
    normal = exponent + ((mantissa != 0) & (exponent < 254)).to(torch.int32)
    subnormal = (mantissa > 0x400000).to(torch.int32)
    e = torch.where(exponent == 0, subnormal, normal)
    e = torch.where(exponent == 255, torch.where(mantissa != 0, 255, 254), e)
    return e.to(torch.uint8)


def ue8m0_decode(e: torch.Tensor) -> torch.Tensor:
    """uint8 UE8M0 ``(...)`` -> float32 ``2**(e - 127)`` ``(...)``; 255 -> NaN.

    Built from bits (no ``exp2``), so it is exact on every device; byte 0 is the subnormal 2**-127.
    """
    e = e.to(torch.int32)
    bits = torch.where(e == 0, 0x00400000, e << 23)
    return torch.where(e == 255, 0x7FC00000, bits).to(torch.int32).view(torch.float32)


@lru_cache(maxsize=None)
def _rcp_delta(device: torch.device) -> torch.Tensor:
    """int8 ``(2**23,)`` on ``device``: hardware minus correctly rounded 1/m, in ulps, per mantissa."""
    from ._rcp_approx_table import RCP_APPROX_DELTA_B85

    packed = torch.frombuffer(bytearray(zlib.decompress(base64.b85decode(RCP_APPROX_DELTA_B85))), dtype=torch.uint8)
    codes = torch.stack([(packed >> s) & 3 for s in (0, 2, 4, 6)], dim=-1).reshape(-1).to(torch.int32)
    return torch.where(codes == 2, -1, codes).to(torch.int8).to(device)


def rcp_approx_ftz(x: torch.Tensor) -> torch.Tensor:
    """float32 ``(...)`` -> float32 ``(...)``: the GPU's ``rcp.approx.ftz.f32``, bit for bit.

    Subnormal or zero inputs give +-inf, +-inf gives +-0, results below 2**-126 flush to +-0,
    NaN stays NaN. Otherwise the correctly rounded 1/x corrected by the measured table
    (within 1 ulp). FlashInfer's FP4/MXFP8 quantizers take every reciprocal this way.
    """
    x = x.float()
    bits = x.contiguous().view(torch.int32)
    sign = bits & torch.iinfo(torch.int32).min
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    m_rcp = (1.0 / (mantissa | 0x3F800000).view(torch.float32)).view(torch.int32)
    m_rcp = m_rcp + _rcp_delta(x.device)[mantissa.long()]
    result_exponent = (m_rcp >> 23) - (exponent - 127)
    magnitude = torch.where(result_exponent >= 1, (result_exponent << 23) | (m_rcp & 0x7FFFFF), 0)
    magnitude = torch.where(exponent == 0, 0x7F800000, magnitude)
    magnitude = torch.where(exponent == 255, torch.where(mantissa != 0, 0x7FC00000, 0), magnitude)
    return (magnitude | sign).to(torch.int32).view(torch.float32)
