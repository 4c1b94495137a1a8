"""The value every quantizer returns: packed values plus the scales needed to read them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantizedTensor:
    """A quantized tensor of logical shape ``(..., rows, cols)`` in one of the registered formats.

    Fields by ``fmt`` (leading dims ``...`` are e.g. experts; scales "decode" = multiply):

    - ``fp8``: values float8_e4m3fn ``(..., rows, cols)``; scales fp32 ``(...)``, amax/448
      per matrix (decode).
    - ``fp8-block``: values float8_e4m3fn ``(..., rows, cols)``; scales fp32
      ``(..., ceil(rows/128), ceil(cols/128))``, DeepSeek's ``weight_scale_inv`` (decode).
    - ``mxfp8``: values float8_e4m3fn ``(..., rows, cols)``; scales uint8 UE8M0
      ``(..., rows, cols/32)``.
    - ``nvfp4``: values uint8 E2M1x2 ``(..., rows, cols/2)``; scales float8_e4m3fn
      ``(..., rows, cols/16)``; ``global_scale`` fp32 ``(...)``, the *encode* scale
      448*6/amax (dequant divides by it).
    - ``nvfp4-per-token``: as nvfp4, but ``global_scale`` is None and ``token_scale`` fp32
      ``(..., rows)`` is a *decode* scale per row (dequant multiplies by it).
    - ``mxfp4``: values uint8 E2M1x2 ``(..., rows, cols/2)``; scales uint8 UE8M0
      ``(..., rows, cols/32)``.

    ``block_size`` is the number of values along the last dim that share one scale
    (0 for one scale per matrix, 128 for the 128x128 blocks of fp8-block).
    """

    values: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor | None
    fmt: str
    block_size: int
    token_scale: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical (unpacked) shape ``(..., rows, cols)`` of the quantized tensor."""
        *lead, cols = self.values.shape
        packed = self.values.dtype == torch.uint8
        return (*lead, cols * 2 if packed else cols)

    def to(self, device: torch.device | str) -> QuantizedTensor:
        """The same quantized tensor with every tensor moved to ``device``."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return QuantizedTensor(
            self.values.to(device),
            self.scales.to(device),
            move(self.global_scale),
            self.fmt,
            self.block_size,
            move(self.token_scale),
        )
