"""NVFP4: E2M1 values packed two per byte, one E4M3 scale per 16 values, an fp32 global scale.

Convention (FlashInfer / ModelOpt weights): ``global_scale = 448*6 / amax`` is an *encode*
scale; block scale ``sf = e4m3(block_amax / 6 * global_scale)``; dequant
``x = e2m1 * sf / global_scale``. (Checkpoints store its inverse, ``weight_scale_2``.)

Kernel constraint served: FlashInfer's NVFP4 MoE (TRT-LLM and CUTLASS). :func:`encode_blocks`
is FlashInfer 0.6.13's ``cvt_warp_fp16_to_fp4`` (E4M3 scales, default fast-math build) in
``data/csrc/nv_internal/tensorrt_llm/kernels/quantization_utils.cuh``, operation for
operation; the per-token activation quantizer (:mod:`.nvfp4_per_token`) runs the same code
with one encode scale per row.
"""

from __future__ import annotations

import torch

from fimoe_lab.engines import get_engine
from fimoe_lab.errors import FormatError, LayoutError
from fimoe_lab.specs import FORMATS

from ._validate import require_float, require_format, require_last_dim_multiple, require_matrix
from .codes import (
    E2M1_MAX,
    E4M3_MAX,
    e2m1_decode,
    e2m1_encode,
    e2m1_pair_max_abs,
    e4m3_decode,
    e4m3_encode,
    ftz,
    pack_nibbles,
    rcp_approx_ftz,
    unpack_nibbles,
)
from .result import QuantizedTensor

FMT = "nvfp4"
BLOCK = FORMATS[FMT].scale_block


def encode_blocks(
    blocks: torch.Tensor, encode_scale: torch.Tensor, zero_scale_zero_codes: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """E2M1 codes and E4M3 scale bits of blocks of 16, exactly as FlashInfer's CUDA kernel.

    ``blocks``: float32 ``(..., n, 16)``, already flushed to zero (:func:`~.codes.ftz`);
    ``encode_scale``: float32 broadcastable to ``(..., n)`` (``SFScaleVal`` in the kernel).
    Returns uint8 codes ``(..., n, 16)`` and uint8 E4M3 bits ``(..., n)``. With
    ``rcp`` = ``rcp.approx.ftz.f32`` and every multiply flushed to zero::

        vecMax = max |block|
        sf     = e4m3_satfinite(encode_scale * (vecMax * rcp(6)))
        out    = vecMax != 0 ? rcp(float(sf) * rcp(encode_scale)) : 0
        code_i = e2m1_satfinite(x_i * out)

    Consequences kept on purpose: a block whose scale underflows to 0 while vecMax != 0
    gets ``out = inf`` and codes +-6 (0 * inf = NaN -> +6); a row of zeros under
    ``encode_scale = inf`` gets scale byte 0x7F (inf * 0 = NaN) and codes 0.
    ``zero_scale_zero_codes`` (FlashInfer 0.7.4's kernel): ``out = sf != 0 ? ... : 0``
    instead, so such a block gets codes 0.
    """
    vec_max = blocks.abs().amax(dim=-1)
    rcp6 = rcp_approx_ftz(torch.tensor(E2M1_MAX, device=blocks.device))
    sf_bits = e4m3_encode(ftz(encode_scale * ftz(vec_max * rcp6)))
    sf_back = ftz(e4m3_decode(sf_bits) * rcp_approx_ftz(encode_scale))
    live = (sf_bits != 0) if zero_scale_zero_codes else (vec_max != 0)
    out_scale = torch.where(live, rcp_approx_ftz(sf_back), torch.zeros_like(sf_back))
    codes = e2m1_encode(ftz(blocks * out_scale[..., None]))
    return codes, sf_bits


def quantize(
    x: torch.Tensor, global_scale: torch.Tensor | float | None = None, engine: str | None = None
) -> QuantizedTensor:
    """Quantize ``(..., rows, cols)`` float (cols % 16 == 0) to NVFP4, weights convention.

    ``engine``: the profile (:mod:`fimoe_lab.engines`; None: the default) whose FlashInfer
    kernel the arithmetic follows (``nvfp4_quantizer``: 0.7.4 zeroes the codes of a block
    whose scale underflows).

    ``global_scale``: fp32 encode scale broadcastable to ``x.shape[:-2]`` (one per matrix,
    e.g. per expert); default ``448*6 / amax`` of each matrix (1.0 for an all-zero one).
    Returns ``values`` uint8 ``(..., rows, cols/2)`` (low nibble first), ``scales``
    float8_e4m3fn ``(..., rows, cols/16)`` (linear layout) and ``global_scale`` fp32 ``(...)``.
    Error bound per element: ``s * {.25, .5, 1}`` for ``|x|/s`` in ``[0, 2), [2, 4), [4, inf)``
    with ``s = sf / global_scale``, or ``|x| - 6s`` where a subnormal E4M3 scale rounded down
    (values saturate at 6), or ``|x|`` where the block scale underflowed to 0.
    """
    require_float(x, "nvfp4.quantize")
    require_matrix(x, "nvfp4.quantize")
    require_last_dim_multiple(x, BLOCK, "nvfp4.quantize", "one E4M3 scale per 16 values")
    xf = ftz(x.float())
    if global_scale is None:
        amax = xf.abs().amax(dim=(-2, -1))
        global_scale = torch.where(amax > 0, (E4M3_MAX * E2M1_MAX) / amax, torch.ones_like(amax))
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
    try:
        gs = gs.expand(x.shape[:-2]).contiguous()
    except RuntimeError:
        raise LayoutError(
            f"nvfp4.quantize: global_scale of shape {tuple(gs.shape)} must broadcast to the leading "
            f"dims {tuple(x.shape[:-2])} of x {tuple(x.shape)} (one encode scale per matrix)",
            fix=f"pass a scalar or a tensor of shape {tuple(x.shape[:-2])}",
        ) from None
    blocks = xf.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    codes, sf_bits = encode_blocks(blocks, gs[..., None, None], get_engine(engine).nvfp4_quantizer == "0.7.4")
    return QuantizedTensor(pack_nibbles(codes.reshape(x.shape)), sf_bits.view(torch.float8_e4m3fn), gs, FMT, BLOCK)


def block_values(q: QuantizedTensor) -> torch.Tensor:
    """float32 ``(..., rows, cols/16, 16)``: the E2M1 values of an NVFP4 tensor, by block."""
    v = e2m1_decode(unpack_nibbles(q.values))
    return v.reshape(*v.shape[:-1], v.shape[-1] // BLOCK, BLOCK)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(..., rows, cols)`` = e2m1 * e4m3 scale / global_scale, in ``dtype``."""
    return _scaled(block_values(q), q).reshape(q.shape).to(dtype)


def max_abs_per_byte(q: QuantizedTensor) -> torch.Tensor:
    """float32 ``(..., rows, cols/2)``: per stored byte the larger ``|value|`` of its two, equal to
    ``dequantize(q).abs()`` reduced by max over each pair (``|x * s / g| = |x| * |s| / |g|`` exactly, monotone in ``|x|``, so the max commutes with it),
    without unpacking: one 256-entry lookup per byte (the lab's per-byte view of a real-size expert)."""
    m = e2m1_pair_max_abs(q.values)
    return _scaled(m.reshape(*m.shape[:-1], m.shape[-1] // (BLOCK // 2), BLOCK // 2), q).reshape(m.shape).abs()


def _scaled(blocks: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    """``blocks (..., rows, cols/16, k)`` of E2M1 values x their block's E4M3 scale / the global scale."""
    require_format(q, FMT, "nvfp4.dequantize")
    if q.global_scale is None:
        raise FormatError(
            "nvfp4.dequantize: the QuantizedTensor has no global_scale",
            fix="pass the encode scale the values were quantized with",
        )
    return blocks * e4m3_decode(q.scales)[..., None] / q.global_scale[..., None, None, None]
