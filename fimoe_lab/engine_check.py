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

The SM90 MXFP4 x BF16 layout (``--mxfp4-activation bf16``; vLLM 0.34's ``FLASHINFER_CUTLASS_MXFP4_BF16``,
SGLang 0.5.23's ``_process_weights_for_sm90_cutlass``) is written the same way, weights included, by
:func:`sm90_engine_layer`: steps 1-2 with zero fill, then FlashInfer's SM90 mixed-input weight interleave
(:func:`sm90_mixed_weights`: a reshape/permute of the bytes, then the bits of every 32-bit word,
:func:`sm90_word_bit_sources`) and scale layout (:func:`sm90_mixed_scales`), in the profile's
``sm90_mixed_layout`` (FlashInfer >= 0.6.16 or 0.6.10-0.6.15). Facts from FlashInfer's
``moe_gemm_mixed_utils.cu`` (the fp4 kernel's masks and shifts) and ``interleave_moe_scales_for_sm90_mixed_gemm``
of 0.7.4 and 0.6.13; :func:`check_plan_sm90_mixed` compares a plan's output (byte maps and word bits) with it.
"""

from __future__ import annotations

from typing import Optional

import torch

from fimoe_lab import recipes
from fimoe_lab.engines import get_engine
from fimoe_lab.plan import LayerPlan, apply_map
from fimoe_lab.specs import FORMATS, get_format

__all__ = [
    "CUTLASS_CHECKED",
    "cutlass_scale_layout",
    "engine_scales",
    "check_plan_scales",
    "SM90_CHECKED",
    "sm90_word_bit_sources",
    "sm90_mixed_weights",
    "sm90_mixed_scales",
    "sm90_engine_layer",
    "check_plan_sm90_mixed",
]

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


# ----------------------------------------------------------------------------- SM90 MXFP4 x BF16
SM90_CHECKED = ("mxfp4",)
"""Formats whose SM90 mixed-input (BF16 activation) layout :func:`check_plan_sm90_mixed` covers."""


def sm90_word_bit_sources() -> list[int]:
    """``src[o]``: the bit of the little-endian 32-bit input word that output bit ``o`` takes, in FlashInfer
    >= 0.6.16's fp4 SM90 mixed-input weight layout (nibble ``t`` = bits ``4t .. 4t+3``, E2M1 magnitude bits
    0-2 and sign bit 3). Half ``h`` (output bits ``16h .. 16h+15``) holds nibbles ``h, 2+h, 4+h, 6+h``:
    bits 0-2 the magnitude of ``4+h``, 3-5 of ``2+h``, 6-8 of ``h``; 9 the sign of ``4+h``; 10, 11, 13 bits
    1, 2, 0 of ``6+h``; 12 the sign of ``2+h``; 14 the sign of ``6+h``; 15 the sign of ``h``."""
    src = [0] * 32
    for h in (0, 1):
        o, a, b, c, d = 16 * h, 4 * h, 4 * (2 + h), 4 * (4 + h), 4 * (6 + h)
        for bit in range(3):
            src[o + bit], src[o + 3 + bit], src[o + 6 + bit] = c + bit, b + bit, a + bit
        src[o + 9], src[o + 10], src[o + 11], src[o + 12] = c + 3, d + 1, d + 2, b + 3
        src[o + 13], src[o + 14], src[o + 15] = d, d + 3, a + 3
    return src


def sm90_mixed_weights(w: torch.Tensor, layout: str) -> torch.Tensor:
    """FlashInfer's ``interleave_moe_weights_for_sm90_mixed_gemm(w, "fp4")`` of ``w`` uint8 ``[E, N, K/2]``
    (``N % 16 == 0``, ``K/2 % 32 == 0``), same shape, as FlashInfer ``layout`` (``"0.6.16"`` or ``"0.6.10"``)
    lays it out.

    Bytes: in every 16-row band, row ``r < 8`` pairs with ``r + 8``; in every 32-byte partition ``p``, the
    word at row ``r + 8 (m % 2)``, bytes ``32p + 16 (m // 2) + 4q + j`` (``m, q < 4``) is
    ``[W[r, c], W[r+8, c], W[r, c+4], W[r+8, c+4]][j]``, ``c = 32p + 8m + q``. Bits: 0.6.16 permutes the 32 bits
    of every word (:func:`sm90_word_bit_sources`); 0.6.10 turns every 16-bit half ``[a, b]`` into
    ``[lo a | lo b << 4, hi a | hi b << 4]``.
    """
    e, n, kb = w.shape
    # [E, band, h (r or r+8), r, p, m//2, m%2, s (c or c+4), q] -> [E, band, m%2, r, p, m//2, q, s, h]
    x = w.reshape(e, n // 16, 2, 8, kb // 32, 2, 2, 2, 4).permute(0, 1, 6, 3, 4, 5, 8, 7, 2)
    words = x.reshape(-1, 4).to(torch.int64)
    if layout == "0.6.10":
        lo, hi = words[:, 0::2], words[:, 1::2]  # a, b of each 16-bit half
        out = torch.stack([(lo & 0xF) | ((hi & 0xF) << 4), (lo >> 4) | (hi & 0xF0)], dim=-1)
        return out.to(torch.uint8).reshape(e, n, kb)
    raw, bits = torch.zeros_like(words[:, 0]), torch.zeros_like(words[:, 0])
    for j in range(4):  # little-endian 32-bit words
        raw |= words[:, j] << (8 * j)
    for o, s in enumerate(sm90_word_bit_sources()):
        bits |= ((raw >> s) & 1) << o
    out = torch.stack([(bits >> (8 * j)) & 0xFF for j in range(4)], dim=-1)
    return out.to(torch.uint8).reshape(e, n, kb)


def sm90_mixed_scales(s: torch.Tensor, layout: str) -> torch.Tensor:
    """FlashInfer's SM90 mixed-input MXFP4 scale layout of ``s`` uint8 ``[E, R, C]`` (one scale per 32
    values), flat per expert: 0.6.16 (``interleave_moe_scales_for_sm90_mixed_gemm``, ``R % 64 == 0``,
    ``C % 4 == 0``) puts scale ``(r, c)`` at ``((r//64) (C/4) + c//4) 256 + (r%16) 16 + ((r%64)//16) 4 + c%4``
    (``[E, R/64, C/4, 16, 16]``); 0.6.10 at ``(c//4) 4R + 4r + c%4`` (``[E, C/4, 4R]``)."""
    e, r, c = s.shape
    rr, cc = torch.arange(r)[:, None], torch.arange(c)[None, :]
    if layout == "0.6.10":
        pos = (cc // 4) * (4 * r) + rr * 4 + cc % 4
    else:
        pos = ((rr // 64) * (c // 4) + cc // 4) * 256 + (rr % 16) * 16 + ((rr % 64) // 16) * 4 + cc % 4
    out = torch.zeros(e, r * c, dtype=torch.uint8)
    out[:, pos.reshape(-1)] = s.contiguous().view(torch.uint8).reshape(e, -1)
    return out


def sm90_engine_layer(
    tensors: dict[str, torch.Tensor], is_act_and_mul: bool, padded_intermediate: int, padded_hidden: int, layout: str
) -> dict[str, torch.Tensor]:
    """What vLLM 0.34 / SGLang 0.5.23 hand the SM90 CUTLASS MXFP4 x BF16 MoE, from checkpoint bytes
    ``w13 [E, P*I, H/2]``, ``w2 [E, H, I/2]``, ``w13_scale [E, P*I, H/32]``, ``w2_scale [E, H, I/32]``: each
    projection padded with zeros to ``(I', H')``, ``[gate; up] -> [up; gate]``, then
    :func:`sm90_mixed_weights` on both weights and :func:`sm90_mixed_scales` on both scales."""
    parts = 2 if is_act_and_mul else 1
    ip, hp = padded_intermediate, padded_hidden
    rows = {"w13": (parts, ip, hp // 2), "w2": (1, hp, ip // 2), "w13_scale": (parts, ip, hp // 32)}
    rows["w2_scale"] = (1, hp, ip // 32)
    out = {}
    for name, (p, r, c) in rows.items():
        x = cutlass_scale_layout(tensors[name].contiguous().view(torch.uint8), p, r, c, 0, False)
        out[name] = sm90_mixed_weights(x, layout) if name in ("w13", "w2") else sm90_mixed_scales(x, layout)
    return out


def check_plan_sm90_mixed(
    plan: LayerPlan,
    is_act_and_mul: bool,
    experts: int,
    engine: Optional[str] = None,
    seed: int = 0,
    tensors: Optional[dict[str, torch.Tensor]] = None,
) -> dict[str, bool]:
    """``{"weights": ..., "scales": ...}``: whether ``plan`` (byte maps and word bits) turns checkpoint bytes
    into :func:`sm90_engine_layer`'s (the profile's ``sm90_mixed_layout``) for both weights, both scales.
    ``tensors``: the checkpoint bytes by name (default random bytes, scales 1..255, ``experts`` experts)."""
    if tensors is None:
        tensors = _random_layer(plan, is_act_and_mul, experts, seed)
    layout = get_engine(engine).sm90_mixed_layout
    want = sm90_engine_layer(tensors, is_act_and_mul, plan.padded_intermediate, plan.padded_hidden, layout)
    same = {n: _same(plan.apply_tensor(n, tensors[n]), want[n]) for n in want}
    return {"weights": same["w13"] and same["w2"], "scales": same["w13_scale"] and same["w2_scale"]}


def _random_layer(plan: LayerPlan, is_act_and_mul: bool, experts: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p, i, h = (2 if is_act_and_mul else 1), plan.intermediate, plan.hidden
    shapes = {"w13": (p * i, h // 2), "w2": (h, i // 2), "w13_scale": (p * i, h // 32), "w2_scale": (h, i // 32)}
    return {
        n: torch.randint(1 if "scale" in n else 0, 256, (experts, *s), generator=g, dtype=torch.uint8)
        for n, s in shapes.items()
    }
