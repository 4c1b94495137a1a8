"""Quantization formats for FlashInfer's fused-MoE kernels: fp8, fp8-block, mxfp8, nvfp4, mxfp4.

Every format has ``quantize(x) -> QuantizedTensor`` and ``dequantize(q) -> Tensor`` in plain
torch (CPU or CUDA, any leading dims such as experts, no FlashInfer import). Where FlashInfer
0.6.13 has a quantization kernel (mxfp8, nvfp4, mxfp4, nvfp4 per-token) the arithmetic follows
it operation for operation, its approximate reciprocals included (measured on an H200; the
kernels themselves run only on sm_100+). :mod:`.codes` holds the shared bit-level conversions;
:func:`check_quantized` the health check.

``formats.get(name)`` is the format's row of :data:`fimoe_lab.specs.FORMATS` (``.quantize``,
``.dequantize``, ``.block_size``, ``.packed``, ``.name``), for the formats with a quantizer
(:func:`names`, i.e. ``specs.codec_names()``); each quantizer module reads its block size
from that table.
"""

import torch

from fimoe_lab.errors import FormatError
from fimoe_lab.specs import FormatSpec, codec_names, get_format

from .codes import (
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    pack_nibbles,
    rcp_approx_ftz,
    ue8m0_decode,
    ue8m0_encode_ceil,
    unpack_nibbles,
)
from .health import check_quantized
from .nvfp4_per_token import NVFP4_PER_TOKEN_BASE_GLOBAL_SCALE, quantize_nvfp4_per_token_input
from .result import QuantizedTensor

__all__ = [
    "NVFP4_PER_TOKEN_BASE_GLOBAL_SCALE",
    "QuantizedTensor",
    "check_quantized",
    "dequantize",
    "e2m1_decode",
    "e2m1_encode",
    "e4m3_decode",
    "e4m3_encode",
    "get",
    "names",
    "pack_nibbles",
    "quantize_nvfp4_per_token_input",
    "rcp_approx_ftz",
    "ue8m0_decode",
    "ue8m0_encode_ceil",
    "unpack_nibbles",
]


def names() -> tuple[str, ...]:
    """Formats with a quantizer (``specs.codec_names()``), in table order."""
    return codec_names()


def get(name: str) -> FormatSpec:
    """The :class:`~fimoe_lab.specs.FormatSpec` of quantization format ``name``.

    :class:`~fimoe_lab.errors.FormatError` listing :func:`names` when ``name`` has no quantizer.
    """
    if str(name).strip().lower() not in codec_names():
        raise FormatError(f"unknown quantization format {name!r}", fix=f"choose one of {', '.join(codec_names())}")
    return get_format(name)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize ``q`` with the format it names: ``(..., rows, cols)`` in ``dtype``."""
    out: torch.Tensor = get(q.fmt).dequantize(q, dtype)
    return out
