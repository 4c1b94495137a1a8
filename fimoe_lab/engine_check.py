"""An independent check of CUTLASS block scales against the engines' layout (used by ``demo`` and ``plan``).

The round trip of a plan (``inverse(plan(x)) == x``) cannot tell a wrong layout from a right
one: a plan that left CUTLASS FP4 scales linear restored exactly and the kernel read them
wrongly. This module writes the layout the engines hand FlashInfer's CUTLASS MoE kernel
directly, with no :mod:`fimoe_lab.steps` map, from the engines' own formulation (vLLM 0.34's and
SGLang 0.5.23's ``swizzle_blockscale``; FlashInfer's ``block_scale_interleave`` is the same
128x4 order):

1. pad each projection on its own: ``[P*R, C] -> [P*Rp, Cp]``, projection ``p`` at row
   ``p*Rp``, the rest the profile's fill byte;
2. ``[gate; up] -> [up; gate]`` when gate and up are stacked (``P = 2``);
3. the 128x4 swizzle: pad to ``[M, K] = [ceil128(P*Rp), ceil4(Cp)]`` with 0, view as
   ``[M/128, 4, 32, K/4, 4]`` and permute to ``[M/128, K/4, 32, 4, 4]``, so that scale
   ``(r, c)`` lands at ``(r//128)*(K/4)*512 + (c//4)*512 + (r%32)*16 + ((r%128)//32)*4 + c%4``.

Profiles whose CUTLASS scales stay linear (:attr:`EngineProfile.cutlass_fp4_scales` /
``cutlass_mxfp8_scales``) skip step 3. Shapes are per expert; every tensor is ``[E, rows, cols]``
bytes.
"""

from __future__ import annotations

from typing import Optional

import torch

from fimoe_lab import recipes
from fimoe_lab.engines import get_engine
from fimoe_lab.plan import LayerPlan, apply_map
from fimoe_lab.specs import FORMATS, get_format

__all__ = ["CUTLASS_CHECKED", "cutlass_scale_layout", "engine_scales", "check_plan_scales"]

CUTLASS_CHECKED = ("nvfp4", "mxfp4", "mxfp8")
"""Formats whose CUTLASS block scales the check covers (vector-scaled formats)."""


def _swizzled(fmt: str, engine: Optional[str]) -> bool:
    profile = get_engine(engine)
    layout = profile.cutlass_mxfp8_scales if fmt == "mxfp8" else profile.cutlass_fp4_scales
    return layout == "128x4"


def cutlass_scale_layout(
    scale: torch.Tensor, parts: int, padded_rows: int, padded_cols: int, fill: int, swizzle: bool
) -> torch.Tensor:
    """``scale`` uint8 ``[E, P*R, C]`` -> the engines' CUTLASS layout ``[E, M, K]`` (module docstring).

    ``parts``: P (2 = gate and up stacked, swapped to ``[up; gate]``); ``padded_rows``: Rp per
    projection; ``padded_cols``: Cp; ``fill``: byte of padded scales; ``swizzle``: step 3.
    """
    e, rows, cols = scale.shape
    r = rows // parts
    out = torch.full((e, parts * padded_rows, padded_cols), fill, dtype=torch.uint8)
    for p in range(parts):
        out[:, p * padded_rows : p * padded_rows + r, :cols] = scale[:, p * r : (p + 1) * r]
    if parts == 2:
        out = torch.cat([out[:, padded_rows:], out[:, :padded_rows]], dim=1)
    if not swizzle:
        return out
    m, k = -(-out.shape[1] // 128) * 128, -(-padded_cols // 4) * 4
    padded = torch.zeros((e, m, k), dtype=torch.uint8)
    padded[:, : out.shape[1], :padded_cols] = out
    return padded.reshape(e, m // 128, 4, 32, k // 4, 4).permute(0, 1, 4, 3, 2, 5).reshape(e, m, k)


def engine_scales(
    fmt: str,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    is_act_and_mul: bool,
    padded_intermediate: int,
    padded_hidden: int,
    engine: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CUTLASS ``(w13_scale, w2_scale)`` the engines hand the kernel, from checkpoint scales.

    ``w13_scale`` ``[E, P*I, H/b]`` and ``w2_scale`` ``[E, H, I/b]`` (any 1-byte dtype; ``b`` the
    format's scale block), padded to ``(padded_intermediate, padded_hidden)`` with the profile's
    fill byte (:func:`fimoe_lab.recipes.scale_fill`).
    """
    block = FORMATS[get_format(fmt).plan_format].scale_block
    fill = recipes.scale_fill(fmt, "cutlass", engine)
    swizzle = _swizzled(get_format(fmt).plan_format, engine)
    parts = 2 if is_act_and_mul else 1
    u13, u2 = w13_scale.contiguous().view(torch.uint8), w2_scale.contiguous().view(torch.uint8)
    return (
        cutlass_scale_layout(u13, parts, padded_intermediate, padded_hidden // block, fill, swizzle),
        cutlass_scale_layout(u2, 1, padded_hidden, padded_intermediate // block, fill, swizzle),
    )


def check_plan_scales(
    fmt: str, plan: LayerPlan, is_act_and_mul: bool, experts: int, engine: Optional[str] = None, seed: int = 0
) -> bool:
    """Random scale bytes (1..255) through ``plan``'s CUTLASS scale maps equal :func:`engine_scales` of them."""
    block = FORMATS[get_format(fmt).plan_format].scale_block
    parts = 2 if is_act_and_mul else 1
    g = torch.Generator().manual_seed(seed)
    i, h = plan.intermediate, plan.hidden
    s13 = torch.randint(1, 256, (experts, parts * i, h // block), generator=g, dtype=torch.uint8)
    s2 = torch.randint(1, 256, (experts, h, i // block), generator=g, dtype=torch.uint8)
    got13, got2 = _scales(plan, s13, s2)
    want13, want2 = engine_scales(fmt, s13, s2, is_act_and_mul, plan.padded_intermediate, plan.padded_hidden, engine)
    return _same(got13, want13) and _same(got2, want2)


def _scales(plan: LayerPlan, s13: torch.Tensor, s2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    maps = plan.maps()
    out13 = apply_map(maps["w13_scale"], s13, "w13_scale") if "w13_scale" in maps else s13
    out2 = apply_map(maps["w2_scale"], s2, "w2_scale") if "w2_scale" in maps else s2
    return out13, out2


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() == b.numel() and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1))
