"""Constructors for the primitive layout steps (DESIGN §3), each an :class:`IndexMap`.

Shapes are one expert's matrix; row counts are rows, column sizes are **bytes**
(``cols * itemsize``; packed FP4 holds two values per byte). Every constructor is
cached by its arguments, so a model with 58 identical MoE layers builds each map once.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import torch

from fimoe_lab.errors import LayoutError
from fimoe_lab.layout import IndexMap

__all__ = [
    "round_up",
    "pad_projections",
    "permute_rows",
    "swap_w13_to_w31_rows",
    "interleave_rows_for_gated_act",
    "shuffle_block_size",
    "shuffle_rows_for_epilogue",
    "block_major_k",
    "swizzle_scales_128x4",
    "STEPS",
    "build",
]


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``value``."""
    if multiple < 1:
        raise LayoutError(f"alignment must be a positive integer, got {multiple}")
    return -(-value // multiple) * multiple


@cache
def pad_projections(
    num_projections: int,
    rows: int,
    padded_rows: int,
    cols_bytes: int,
    padded_cols_bytes: int,
    fill: int = 0,
) -> IndexMap:
    """Pad each of ``num_projections`` stacked ``[rows, cols]`` blocks on its own.

    ``[P*rows, cols] -> [P*padded_rows, padded_cols]``: block ``p`` lands at row
    ``p*padded_rows``, the rest is ``fill``. Gate and up of a fused W13 are two blocks:
    padding them as one would move the start of ``up`` into gate's padding, and the
    kernel would read gate's tail as up. Serves FlashInfer's intermediate alignment
    (16 gated / 128 non-gated / 128 for MXFP8) and the TRT-LLM hidden alignment
    (256, 512 for per-token NVFP4 non-gated).
    """
    if num_projections < 1 or rows < 0 or cols_bytes < 1:
        raise LayoutError(f"pad_projections: bad shape {num_projections}x[{rows}, {cols_bytes} B]")
    if padded_rows < rows or padded_cols_bytes < cols_bytes:
        raise LayoutError(
            f"pad_projections: target [{padded_rows}, {padded_cols_bytes} B] is smaller than the "
            f"source [{rows}, {cols_bytes} B]; padding only grows a matrix"
        )
    if not 0 <= fill <= 255:
        raise LayoutError(f"fill must be a byte value 0..255, got {fill}")
    cell = math.gcd(cols_bytes, padded_cols_bytes)
    cin, cout = cols_bytes // cell, padded_cols_bytes // cell
    src = torch.full((num_projections, padded_rows, cout), -1, dtype=torch.int64)
    p = torch.arange(num_projections)[:, None, None]
    r = torch.arange(rows)[None, :, None]
    c = torch.arange(cin)[None, None, :]
    src[:, :rows, :cin] = (p * rows + r) * cin + c
    params = dict(
        num_projections=num_projections,
        rows=rows,
        padded_rows=padded_rows,
        cols_bytes=cols_bytes,
        padded_cols_bytes=padded_cols_bytes,
        fill=fill,
    )
    return IndexMap(
        src.reshape(-1),
        cell,
        (num_projections * rows, cols_bytes),
        (num_projections * padded_rows, padded_cols_bytes),
        (fill,),
        "pad_projections",
        params,
    )


def permute_rows(src_rows: torch.Tensor, cols_bytes: int, kind: str, params: dict[str, Any]) -> IndexMap:
    """A row permutation ``out[i, :] = in[src_rows[i], :]`` of an ``[M, cols]`` matrix."""
    rows = src_rows.numel()
    return IndexMap(src_rows.to(torch.int64), cols_bytes, (rows, cols_bytes), (rows, cols_bytes), (), kind, params)


def _check_even(rows: int, what: str) -> None:
    if rows % 2:
        raise LayoutError(
            f"{what}: W13 has {rows} rows, which is odd; a fused gate/up matrix has 2 * intermediate "
            f"rows (pass is_act_and_mul=False for a non-gated W1)"
        )


@cache
def swap_w13_to_w31_rows(rows: int, cols_bytes: int) -> IndexMap:
    """Swap the two row halves: checkpoints store ``[gate; up]``, FlashInfer wants ``[up; gate]``.

    ``[2I, H] -> [2I, H]``, ``src[i] = (i + I) % 2I``. A wrong or missing swap is
    invisible on random weights; it computes ``silu(up) * gate``.
    """
    _check_even(rows, "swap_w13_to_w31")
    src = (torch.arange(rows) + rows // 2) % rows
    return permute_rows(src, cols_bytes, "swap_w13_to_w31_rows", dict(rows=rows, cols_bytes=cols_bytes))


@cache
def interleave_rows_for_gated_act(rows: int, cols_bytes: int) -> IndexMap:
    """Interleave the two halves row by row: ``src[2j] = j``, ``src[2j+1] = M/2 + j``.

    ``[M, K] -> [M, K]``; the TRT-LLM gated-activation GEMM produces adjacent
    (first-half, second-half) output pairs so its epilogue can apply the activation
    without a second pass. M=8 gives [0, 4, 1, 5, 2, 6, 3, 7].
    """
    _check_even(rows, "interleave_rows_for_gated_act")
    half = rows // 2
    src = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)
    return permute_rows(src, cols_bytes, "interleave_rows_for_gated_act", dict(rows=rows, cols_bytes=cols_bytes))


def shuffle_block_size(epilogue_tile_m: int) -> int:
    """Rows per shuffle block: 32 when ``epilogue_tile_m % 128 == 0``, else 16."""
    return 32 if epilogue_tile_m % 128 == 0 else 16


@cache
def shuffle_rows_for_epilogue(rows: int, cols_bytes: int, epilogue_tile_m: int) -> IndexMap:
    """Row shuffle of ``shuffle_matrix_a`` for TRT-LLM's transposed-MMA epilogue tiles.

    ``[M, K] -> [M, K]``; blocks of B rows (B = 32 for epilogue_tile_m 128, 16 for
    64) with ``k = B / 8``: ``src[b*B + p] = b*B + (p % 8) * k + p // 8``.
    Needs ``M % B == 0``.
    """
    block = shuffle_block_size(epilogue_tile_m)
    if rows % block:
        raise LayoutError(
            f"shuffle_rows_for_epilogue: {rows} rows is not a multiple of {block} (the shuffle block "
            f"for epilogue_tile_m={epilogue_tile_m}); pad the matrix to {round_up(rows, block)} rows first "
            f"(pad_projections, or align_moe_weights_for_fi for a whole layer)"
        )
    k = block // 8
    p = torch.arange(block)
    within = (p % 8) * k + p // 8
    src = (torch.arange(rows // block)[:, None] * block + within[None, :]).reshape(-1)
    return permute_rows(
        src,
        cols_bytes,
        "shuffle_rows_for_epilogue",
        dict(rows=rows, cols_bytes=cols_bytes, epilogue_tile_m=epilogue_tile_m),
    )


@cache
def block_major_k(rows: int, cols_bytes: int, block_bytes: int = 128) -> IndexMap:
    """Re-tile ``[M, K]`` into ``[K / bk, M, bk]``: ``out[kb, m, j] = in[m, kb*bk + j]``.

    The TRT-LLM BlockMajorK weight layout; vLLM uses bk = 128 bytes (64 bf16, 128 fp8
    values). Needs ``K % bk == 0`` (in bytes).
    """
    if cols_bytes % block_bytes:
        raise LayoutError(
            f"block_major_k: K of {cols_bytes} bytes is not a multiple of the {block_bytes}-byte block; "
            f"pad the hidden/intermediate dim so that K*itemsize is a multiple of {block_bytes}"
        )
    kb = cols_bytes // block_bytes
    src = (torch.arange(rows)[None, :] * kb + torch.arange(kb)[:, None]).reshape(-1)
    return IndexMap(
        src,
        block_bytes,
        (rows, cols_bytes),
        (kb, rows, block_bytes),
        (),
        "block_major_k",
        dict(rows=rows, cols_bytes=cols_bytes, block_bytes=block_bytes),
    )


@cache
def swizzle_scales_128x4(rows: int, cols: int, itemsize: int = 1) -> IndexMap:
    """FlashInfer's ``block_scale_interleave``: the 128x4 swizzle of a block-scale matrix.

    ``[R, C]`` scales -> ``[Rp, Cp]`` with ``Rp = ceil128(R)``, ``Cp = ceil4(C)``, padding
    0, stored so that scale ``(r, c)`` sits at flat element
    ``(r//128)*(Cp/4)*512 + (c//4)*512 + (r%32)*16 + ((r%128)//32)*4 + c%4``: the
    tensor-core's 128-row x 4-column scale atom laid out as 32 x 16 elements.
    """
    if rows < 1 or cols < 1:
        raise LayoutError(f"swizzle_scales_128x4: empty scale matrix [{rows}, {cols}]")
    rp, cp = round_up(rows, 128), round_up(cols, 4)
    r = torch.arange(rp)[:, None]
    c = torch.arange(cp)[None, :]
    offset = (r // 128) * (cp // 4) * 512 + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    inside = (r < rows) & (c < cols)
    src = torch.empty(rp * cp, dtype=torch.int64)
    src[offset.reshape(-1)] = torch.where(inside, r * cols + c, -1).reshape(-1)
    return IndexMap(
        src,
        itemsize,
        (rows, cols * itemsize),
        (rp, cp * itemsize),
        (0,),
        "swizzle_scales_128x4",
        dict(rows=rows, cols=cols, itemsize=itemsize),
    )


STEPS = {
    f.__name__: f
    for f in (
        pad_projections,
        swap_w13_to_w31_rows,
        interleave_rows_for_gated_act,
        shuffle_rows_for_epilogue,
        block_major_k,
        swizzle_scales_128x4,
    )
}
"""Every primitive step by kind: ``STEPS[m.kind](**m.params)`` rebuilds ``m``."""


def build(kind: str, params: dict[str, Any]) -> IndexMap:
    """Rebuild the primitive step ``kind`` from its ``params`` (as recorded by :meth:`IndexMap.spec`)."""
    if kind not in STEPS:
        raise LayoutError(f"unknown step kind {kind!r}", fix=f"use one of {', '.join(STEPS)}")
    try:
        return STEPS[kind](**params)
    except TypeError as exc:
        raise LayoutError(f"step {kind} cannot be built from parameters {params}: {exc}") from None
