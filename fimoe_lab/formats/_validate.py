"""Input checks of the quantizers: each error says what failed, on which shape, and the fix."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fimoe_lab.errors import FormatError, LayoutError
from fimoe_lab.steps import round_up

if TYPE_CHECKING:
    from fimoe_lab.formats.result import QuantizedTensor

FLOAT_INPUTS = (torch.float32, torch.float16, torch.bfloat16)


def require_float(x: torch.Tensor, where: str) -> None:
    """Raise :class:`FormatError` unless ``x`` is a float32/float16/bfloat16 tensor of at least 1 dim."""
    if not isinstance(x, torch.Tensor):
        raise FormatError(f"{where}: expected a torch.Tensor, got {type(x).__name__}", fix="torch.as_tensor(x)")
    if x.dtype not in FLOAT_INPUTS:
        raise FormatError(
            f"{where}: expected float32, float16 or bfloat16 input, got {x.dtype} with shape {tuple(x.shape)}",
            fix="dequantize first, or cast with x.float()",
        )
    if x.dim() < 1:
        raise LayoutError(f"{where}: expected at least 1 dim (..., cols), got a 0-dim tensor", fix="x.reshape(1, -1)")


def require_matrix(x: torch.Tensor, where: str) -> None:
    """Raise :class:`LayoutError` unless ``x`` has at least 2 dims ``(..., rows, cols)``."""
    if x.dim() < 2:
        raise LayoutError(
            f"{where}: expected (..., rows, cols) with at least 2 dims, got shape {tuple(x.shape)}",
            fix="x.reshape(1, -1) for a single row",
        )


def require_last_dim_multiple(x: torch.Tensor, multiple: int, where: str, reason: str) -> None:
    """Raise :class:`LayoutError` unless ``x.shape[-1] % multiple == 0``, naming the padded size."""
    cols = x.shape[-1]
    if cols % multiple:
        padded = round_up(cols, multiple)
        raise LayoutError(
            f"{where}: the last dim must be a multiple of {multiple} ({reason}); got shape {tuple(x.shape)} "
            f"with last dim {cols}",
            fix=f"pad the last dim to {padded}, e.g. torch.nn.functional.pad(x, (0, {padded - cols}))",
        )


def require_format(q: QuantizedTensor, fmt: str, where: str) -> None:
    """Raise :class:`FormatError` unless the QuantizedTensor ``q`` is in format ``fmt``."""
    if q.fmt != fmt:
        raise FormatError(
            f"{where}: got a QuantizedTensor in format {q.fmt!r}, expected {fmt!r}",
            fix=f"fimoe_lab.formats.get({q.fmt!r}).dequantize(q)",
        )
