"""Constructors for the primitive layout steps (DESIGN §3), each an :class:`IndexMap`.

Shapes are one expert's matrix; row counts are rows, column sizes are **bytes**
(``cols * itemsize``; packed FP4 holds two values per byte). Every constructor is
cached by its arguments, so a model with 58 identical MoE layers builds each map once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fimoe_lab.caches import cached
from fimoe_lab.errors import LayoutError
from fimoe_lab.layout import IndexMap
from fimoe_lab.shapes import round_up

__all__ = [
    "round_up",
    "pad_projections",
    "permute_rows",
    "swap_w13_to_w31_rows",
    "interleave_rows_for_gated_act",
    "interleave_row_groups",
    "shuffle_block_size",
    "shuffle_rows_for_epilogue",
    "block_major_k",
    "swizzle_scales_128x4",
    "swizzle_scales_8x4",
    "fold_scales_sm90_mixed",
    "STEPS",
    "build",
]


@cached
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
    src = np.full((num_projections, padded_rows, cout), -1, dtype=np.int64)
    p = np.arange(num_projections, dtype=np.int64)[:, None, None]
    r = np.arange(rows, dtype=np.int64)[None, :, None]
    c = np.arange(cin, dtype=np.int64)[None, None, :]
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
        torch.from_numpy(src.reshape(-1)),
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


@cached
def swap_w13_to_w31_rows(rows: int, cols_bytes: int) -> IndexMap:
    """Swap the two row halves: checkpoints store ``[gate; up]``, FlashInfer wants ``[up; gate]``.

    ``[2I, H] -> [2I, H]``, ``src[i] = (i + I) % 2I``. A wrong or missing swap is
    invisible on random weights; it computes ``silu(up) * gate``.
    """
    _check_even(rows, "swap_w13_to_w31")
    src = (torch.arange(rows) + rows // 2) % rows
    return permute_rows(src, cols_bytes, "swap_w13_to_w31_rows", dict(rows=rows, cols_bytes=cols_bytes))


@cached
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


@cached
def interleave_row_groups(rows: int, cols_bytes: int, group: int) -> IndexMap:
    """Interleave the two row halves in groups of ``group`` rows (CuTe-DSL gated FC1).

    ``[M, K] -> [M, K]`` with ``G = M / (2 * group)`` groups per half: output group ``2j + h``
    is group ``j`` of half ``h``, ``src[(2j + h) * group + r] = (h * G + j) * group + r``.
    FlashInfer 0.7.x's ``interleave_cute_dsl_moe_weights`` uses group 64 (16 with swap_ab on
    SM100/103); its ``deinterleave_gated_rows(x, group)`` is the inverse; group 1 is
    :func:`interleave_rows_for_gated_act`. Needs ``M % (2 * group) == 0``.
    """
    if group < 1 or rows % (2 * group):
        raise LayoutError(
            f"interleave_row_groups: {rows} rows is not a multiple of 2 x {group} (each half a whole number "
            f"of {group}-row groups)",
            fix=f"pad the intermediate size to a multiple of {group} first",
        )
    g = rows // (2 * group)
    h = torch.arange(2)[None, :, None]
    j = torch.arange(g)[:, None, None]
    r = torch.arange(group)[None, None, :]
    src = ((h * g + j) * group + r).reshape(-1)
    return permute_rows(src, cols_bytes, "interleave_row_groups", dict(rows=rows, cols_bytes=cols_bytes, group=group))


def shuffle_block_size(epilogue_tile_m: int) -> int:
    """Rows per shuffle block: 32 when ``epilogue_tile_m % 128 == 0``, else 16."""
    return 32 if epilogue_tile_m % 128 == 0 else 16


@cached
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


@cached
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
    src = (np.arange(rows, dtype=np.int64)[None, :] * kb + np.arange(kb, dtype=np.int64)[:, None]).reshape(-1)
    return IndexMap(
        torch.from_numpy(src),
        block_bytes,
        (rows, cols_bytes),
        (kb, rows, block_bytes),
        (),
        "block_major_k",
        dict(rows=rows, cols_bytes=cols_bytes, block_bytes=block_bytes),
    )


@cached
def swizzle_scales_128x4(rows: int, cols: int, itemsize: int = 1) -> IndexMap:
    """FlashInfer's ``block_scale_interleave``: the 128x4 swizzle of a block-scale matrix.

    ``[R, C]`` scales -> ``[Rp, Cp]`` with ``Rp = ceil128(R)``, ``Cp = ceil4(C)``, padding
    0, stored so that scale ``(r, c)`` sits at flat element
    ``(r//128)*(Cp/4)*512 + (c//4)*512 + (r%32)*16 + ((r%128)//32)*4 + c%4``: the
    tensor-core's 128-row x 4-column scale atom laid out as 32 x 16 elements.
    """
    return _swizzle_scale_atoms(
        rows, cols, itemsize, 128, lambda r, c: (r % 32) * 16 + (r // 32) * 4 + c, "swizzle_scales_128x4"
    )


def _swizzle_scale_atoms(
    rows: int,
    cols: int,
    itemsize: int,
    atom_rows: int,
    within: Callable[[np.ndarray, np.ndarray], np.ndarray],
    kind: str,
) -> IndexMap:
    """A block-scale swizzle in ``atom_rows`` x 4 atoms: ``[R, C] -> [Rp, Cp]`` (``Rp = ceil(R)`` to
    ``atom_rows``, ``Cp = ceil4(C)``, padding 0), scale ``(r, c)`` at flat element
    ``(r//A)*(Cp/4)*4A + (c//4)*4A + within(r % A, c % 4)`` with ``A = atom_rows``: atoms ordered
    K-tile fastest, ``within`` the order inside one atom."""
    if rows < 1 or cols < 1:
        raise LayoutError(f"{kind}: empty scale matrix [{rows}, {cols}]")
    rp, cp = round_up(rows, atom_rows), round_up(cols, 4)
    atom = 4 * atom_rows
    # built in output order (one pass, numpy): output (tile ``rb``, K tile ``kb``, slot ``w``)
    # holds scale (rb*A + ar[w], kb*4 + ac[w]), (ar, ac) the atom slot's inverse of ``within``
    slots = within(np.arange(atom_rows, dtype=np.int64)[:, None], np.arange(4, dtype=np.int64)[None, :])
    ar, ac = np.empty(atom, dtype=np.int64), np.empty(atom, dtype=np.int64)
    ar[slots.reshape(-1)] = np.repeat(np.arange(atom_rows, dtype=np.int64), 4)
    ac[slots.reshape(-1)] = np.tile(np.arange(4, dtype=np.int64), atom_rows)
    r0 = (np.arange(rp // atom_rows, dtype=np.int64) * atom_rows)[:, None, None]
    c0 = (np.arange(cp // 4, dtype=np.int64) * 4)[None, :, None]
    src = (r0 * cols + c0) + (ar * cols + ac)
    if rp != rows or cp != cols:
        src = np.where((r0 + ar < rows) & (c0 + ac < cols), src, -1)
    return IndexMap(
        torch.from_numpy(src.reshape(-1)),
        itemsize,
        (rows, cols * itemsize),
        (rp, cp * itemsize),
        (0,),
        kind,
        dict(rows=rows, cols=cols, itemsize=itemsize),
    )


@cached
def swizzle_scales_8x4(rows: int, cols: int, itemsize: int = 1) -> IndexMap:
    """The 8x4 swizzled block-scale layout (FlashInfer's ``SfLayout.layout_8x4``, ``SWIZZLED_8x4``).

    ``[R, C]`` scales -> ``[Rp, Cp]`` with ``Rp = ceil8(R)``, ``Cp = ceil4(C)``, padding 0,
    scale ``(r, c)`` at flat element ``(r//8)*(Cp/4)*32 + (c//4)*32 + (r%8)*4 + c%4``: 8-row x
    4-column atoms stored row-major, atoms ordered K-tile fastest (``get_sf_out_offset_8x4`` in
    FlashInfer's quantization kernels; the activation quantizer's small-M layout).
    """
    return _swizzle_scale_atoms(rows, cols, itemsize, 8, lambda r, c: r * 4 + c, "swizzle_scales_8x4")


@cached
def fold_scales_sm90_mixed(rows: int, cols: int, itemsize: int = 1, group_size: int = 32) -> IndexMap:
    """SM90 mixed-input MoE GEMM scale folding (FlashInfer >= 0.6.15,
    ``interleave_moe_scales_for_sm90_mixed_gemm``).

    ``[R, C]`` scales (``C = K / group_size``, ``itemsize`` bytes each: 1 for UE8M0 MXFP4 with
    group 32, 2 for bf16 W4A8 with group 128) -> ``[R/64, K/128, F, P]`` with ``P = 16 /
    itemsize`` scales (16 B), ``S = 128 / group_size`` scale groups per K128 block,
    ``Ms = P / S`` M slices and ``F = 64 / Ms`` folded rows: scale ``(a*64 + s*F + f, k*S + g)``
    lands at ``[a, k, f, s*S + g]``. Needs ``R % 64 == 0`` and ``C % S == 0``.
    """
    if group_size < 1 or 128 % group_size or itemsize not in (1, 2, 4, 8, 16):
        raise LayoutError(f"fold_scales_sm90_mixed: group_size {group_size} must divide 128, itemsize {itemsize}")
    per_16b, per_k128 = 16 // itemsize, 128 // group_size
    if per_16b % per_k128 or 64 % (per_16b // per_k128):
        raise LayoutError(
            f"fold_scales_sm90_mixed: {itemsize}-byte scales with group {group_size} do not fold into 64-row blocks"
        )
    slices = per_16b // per_k128
    folded = 64 // slices
    if rows < 1 or rows % 64 or cols < 1 or cols % per_k128:
        raise LayoutError(
            f"fold_scales_sm90_mixed: [{rows}, {cols}] scales need rows % 64 == 0 and columns % {per_k128} == 0",
            fix="pad the rows to a multiple of 64 and K to a multiple of 128 first",
        )
    k128 = cols // per_k128
    a = np.arange(rows // 64, dtype=np.int64)[:, None, None, None, None]
    sl = np.arange(slices, dtype=np.int64)[None, :, None, None, None]
    f = np.arange(folded, dtype=np.int64)[None, None, :, None, None]
    k = np.arange(k128, dtype=np.int64)[None, None, None, :, None]
    g = np.arange(per_k128, dtype=np.int64)[None, None, None, None, :]
    src_in = (a * 64 + sl * folded + f) * cols + k * per_k128 + g  # indexed (a, s, f, k, g)
    src = src_in.transpose(0, 3, 2, 1, 4).reshape(-1)  # output order (a, k, f, s, g)
    return IndexMap(
        torch.from_numpy(src),
        itemsize,
        (rows, cols * itemsize),
        (rows // 64, k128, folded, 16),
        (),
        "fold_scales_sm90_mixed",
        dict(rows=rows, cols=cols, itemsize=itemsize, group_size=group_size),
    )


STEPS = {
    f.__name__: f
    for f in (
        pad_projections,
        swap_w13_to_w31_rows,
        interleave_rows_for_gated_act,
        interleave_row_groups,
        shuffle_rows_for_epilogue,
        block_major_k,
        swizzle_scales_128x4,
        swizzle_scales_8x4,
        fold_scales_sm90_mixed,
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
