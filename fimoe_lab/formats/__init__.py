"""Quantization formats for FlashInfer's fused-MoE kernels: fp8, fp8-block, mxfp8, nvfp4, mxfp4.

Every format has ``quantize(x) -> QuantizedTensor`` and ``dequantize(q) -> Tensor`` in plain
torch (CPU or CUDA, any leading dims such as experts, no FlashInfer import). Where FlashInfer
0.6.13 has a quantization kernel (mxfp8, nvfp4, mxfp4, nvfp4 per-token) the arithmetic follows
it operation for operation, its approximate reciprocals included (measured on an H200; the
kernels themselves run only on sm_100+). :mod:`.codes` holds the shared bit-level conversions;
``formats.get(name)`` the registry; :func:`check_quantized` the health check.
"""

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
from .registry import Format, dequantize, get, names
from .result import QuantizedTensor

__all__ = [
    "Format",
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
