"""NVFP4 with one fp32 decode scale per row (token): FlashInfer's per-token activation quant.

:func:`quantize_nvfp4_per_token_input` is a drop-in for vLLM's function of that name, which
calls ``flashinfer.nvfp4_quantize(x, 1/(448*6), sfLayout=SfLayout.layout_linear,
per_token_activation=True)``; it runs on CPU or CUDA tensors, with no FlashInfer and no
Blackwell GPU (FlashInfer's kernel needs sm_100: on Hopper it returns zeros).

Exact formula (FlashInfer 0.6.13, ``backend="cuda"``: ``nvfp4QuantAndPerTokenScaleKernel`` in
``data/csrc/nv_internal/tensorrt_llm/kernels/quantization.cuh``, default fast-math branch,
no 4over6, then ``cvt_warp_fp16_to_fp4`` = :func:`.nvfp4.encode_blocks`), with
``rcp`` = ``rcp.approx.ftz.f32`` and every float32 multiply flushing subnormals to zero::

    row_amax        = max |x| over the row
    per_token_scale = row_amax * float32(1/(6*448))          # returned, fp32
    encode          = rcp(per_token_scale)                    # inf for an all-zero row
    per block of 16: sf = e4m3_satfinite(encode * (block_amax * rcp(6)))
                     out = block_amax != 0 ? rcp(float(sf) * rcp(encode)) : 0
                     codes = e2m1_satfinite(x * out), two per byte, low nibble first

Dequant: ``x ~= e2m1 * float(sf) * per_token_scale``. An all-zero row gives
``per_token_scale = 0``; FlashInfer 0.6.13 encodes it with ``rcp(0) = inf`` (scale bytes 0x7F,
inf * 0 = NaN), FlashInfer >= 0.7.2 with ``encode = per_token_scale != 0 ? rcp(..) : 0``
(scale bytes 0x00, as its cute-dsl backend always did); codes are 0 either way. Which one
applies is the engine profile's ``nvfp4_quantizer`` (:mod:`fimoe_lab.engines`; default
``vllm-0.34``: 0x00). FlashInfer 0.7.4 also zeroes the codes of a block whose scale rounds
to 0 (:func:`.nvfp4.encode_blocks`).
"""

from __future__ import annotations

from typing import Optional

import torch

from fimoe_lab.engines import get_engine
from fimoe_lab.errors import FormatError

from ._validate import require_float, require_format, require_last_dim_multiple, require_matrix
from .codes import e4m3_decode, ftz, pack_nibbles, rcp_approx_ftz
from .nvfp4 import BLOCK, block_values, encode_blocks
from .result import QuantizedTensor

FMT = "nvfp4-per-token"
NVFP4_PER_TOKEN_BASE_GLOBAL_SCALE = 1.0 / (448.0 * 6.0)
"""vLLM's constant; FlashInfer reads it as a float32 ``globalScaleInv``."""


def _quantize_rows(
    x: torch.Tensor, where: str, engine: Optional[str]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float ``(..., k)`` -> packed uint8 ``(..., k/2)``, E4M3 bits uint8 ``(..., k/16)``, fp32 ``(...)``."""
    require_float(x, where)
    require_last_dim_multiple(x, BLOCK, where, "one E4M3 scale per 16 values; FlashInfer checks n % 16 == 0")
    kernel = get_engine(engine).nvfp4_quantizer
    xf = ftz(x.float())
    base = torch.tensor(NVFP4_PER_TOKEN_BASE_GLOBAL_SCALE, dtype=torch.float32, device=x.device)
    per_token_scale = ftz(xf.abs().amax(dim=-1) * base)
    encode = rcp_approx_ftz(per_token_scale)
    if kernel != "0.6.13":
        encode = torch.where(per_token_scale != 0, encode, torch.zeros_like(encode))
    blocks = xf.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    codes, sf_bits = encode_blocks(blocks, encode[..., None], kernel == "0.7.4")
    return pack_nibbles(codes.reshape(x.shape)), sf_bits, per_token_scale


def quantize_nvfp4_per_token_input(
    hidden_states: torch.Tensor, engine: Optional[str] = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drop-in for vLLM's ``quantize_nvfp4_per_token_input``, bit-exact with FlashInfer's kernel.

    ``engine``: the profile whose FlashInfer kernel to follow (None: the default, vLLM 0.34);
    it only changes all-zero rows (0x00 or 0x7F scale bytes, see the module docstring).

    ``hidden_states``: bf16/fp16 (FlashInfer's kernel accepts only these; fp32 also runs here
    with the same arithmetic) ``(m, k)`` or ``(..., k)``, k % 16 == 0, any device.
    Returns, as ``flashinfer.nvfp4_quantize(..., per_token_activation=True)`` does with the
    linear scale layout, on the input's device:

    - ``x_fp4``: uint8 ``(m, k/2)``, two E2M1 codes per byte, element 2j in the low nibble;
    - ``x_sf``: uint8 ``(m, k/16)``, E4M3 bits of each block's scale (linear layout);
    - ``per_token_scale``: float32 ``(m,)``, the decode scale ``row_amax * float32(1/2688)``.
    """
    return _quantize_rows(hidden_states, "quantize_nvfp4_per_token_input", engine)


def quantize(x: torch.Tensor, engine: Optional[str] = None) -> QuantizedTensor:
    """Quantize ``(..., rows, cols)`` float (cols % 16 == 0) to NVFP4 with a scale per row.

    Same arithmetic as :func:`quantize_nvfp4_per_token_input`; returns ``values`` uint8
    ``(..., rows, cols/2)``, ``scales`` float8_e4m3fn ``(..., rows, cols/16)`` and
    ``token_scale`` fp32 ``(..., rows)`` (decode scale). Error bound as NVFP4 with
    ``s = sf * token_scale``.
    """
    require_float(x, "nvfp4_per_token.quantize")
    require_matrix(x, "nvfp4_per_token.quantize")
    values, sf_bits, token_scale = _quantize_rows(x, "nvfp4_per_token.quantize", engine)
    return QuantizedTensor(values, sf_bits.view(torch.float8_e4m3fn), None, FMT, BLOCK, token_scale)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(..., rows, cols)`` = e2m1 * e4m3 scale * token_scale (per row), in ``dtype``."""
    require_format(q, FMT, "nvfp4_per_token.dequantize")
    if q.token_scale is None:
        raise FormatError(
            "nvfp4_per_token.dequantize: the QuantizedTensor has no token_scale",
            fix="pass the per-token decode scales the values were quantized with",
        )
    sf = e4m3_decode(q.scales) * q.token_scale[..., None]
    return (block_values(q) * sf[..., None]).reshape(q.shape).to(dtype)
