"""Constructors for the primitive layout steps (DESIGN §3), each an :class:`IndexMap`.

Shapes are one expert's matrix; row counts are rows, column sizes are **bytes**
(``cols * itemsize``; packed FP4 holds two values per byte). Every constructor is
cached by its arguments, so a model with 58 identical MoE layers builds each map once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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
    "SM90_MIXED_QUANT_TYPES",
    "SM90_MIXED_LAYOUTS",
    "interleave_sm90_mixed_weights",
    "sm90_mixed_word_bits",
    "sm90_mixed_weight_map",
    "word_bit_shifts",
    "word_bit_table",
    "apply_word_bits",
    "WordBitMap",
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
    table = np.full((num_projections, padded_rows), -1, dtype=np.int64)  # output row -> input row (-1: fill)
    table[:, :rows] = np.arange(num_projections * rows, dtype=np.int64).reshape(num_projections, rows)
    params = dict(
        num_projections=num_projections,
        rows=rows,
        padded_rows=padded_rows,
        cols_bytes=cols_bytes,
        padded_cols_bytes=padded_cols_bytes,
        fill=fill,
    )
    return IndexMap.rows_on_read(
        table.reshape(-1), num_projections * rows, cols_bytes, padded_cols_bytes, fill, "pad_projections", params
    )


def permute_rows(src_rows: torch.Tensor | np.ndarray, cols_bytes: int, kind: str, params: dict[str, Any]) -> IndexMap:
    """A row permutation ``out[i, :] = in[src_rows[i], :]`` of an ``[M, cols]`` matrix (``src_rows`` a torch or
    numpy vector; the row steps build theirs with numpy: a process's first plan pays no torch CPU start-up)."""
    src = torch.as_tensor(src_rows).to(torch.int64)
    rows = src.numel()
    return IndexMap(src, cols_bytes, (rows, cols_bytes), (rows, cols_bytes), (), kind, params)


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
    src = (np.arange(rows, dtype=np.int64) + rows // 2) % rows
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
    src = np.stack([np.arange(half, dtype=np.int64), np.arange(half, dtype=np.int64) + half], axis=1).reshape(-1)
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
    h = np.arange(2, dtype=np.int64)[None, :, None]
    j = np.arange(g, dtype=np.int64)[:, None, None]
    r = np.arange(group, dtype=np.int64)[None, None, :]
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
    p = np.arange(block, dtype=np.int64)
    within = (p % 8) * k + p // 8
    src = (np.arange(rows // block, dtype=np.int64)[:, None] * block + within[None, :]).reshape(-1)
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
    shapes = ((rows, cols * itemsize), (rp, cp * itemsize))
    params = dict(rows=rows, cols=cols, itemsize=itemsize)
    if cp == cols and (slots[:, 0] % 4 == 0).all() and (slots == slots[:, :1] + np.arange(4)).all():
        # each atom row's 4 scales are 4 adjacent slots: the map over cells of 4 scales (a quarter of the
        # index); over single scales when that index is read (IndexMap.refined_on_read)
        r = r0 + ar[::4]
        quads = r * (cols // 4) + c0 // 4
        if rp != rows:
            quads = np.where(r < rows, quads, -1)
        wide = IndexMap(torch.from_numpy(quads.reshape(-1)), 4 * itemsize, *shapes, (0,), kind, params)
        return IndexMap.refined_on_read(wide, itemsize)
    src = (r0 * cols + c0) + (ar * cols + ac)
    if rp != rows or cp != cols:
        src = np.where((r0 + ar < rows) & (c0 + ac < cols), src, -1)
    return IndexMap(torch.from_numpy(src.reshape(-1)), itemsize, *shapes, (0,), kind, params)


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


# ----------------------------------------------------------------- SM90 mixed-input weights
SM90_MIXED_QUANT_TYPES = ("fp4", "fp4_fp8", "int4")
"""``quant_type`` of FlashInfer's ``interleave_moe_weights_for_sm90_mixed_gemm`` (its CUDA binding's 1, 2, 0)."""

SM90_MIXED_LAYOUTS = ("0.6.16", "0.6.10")
"""The FlashInfer release that introduced each SM90 mixed-input weight layout: ``"0.6.16"`` (PR #3738; every
0.6.16+ and 0.7.x release) and ``"0.6.10"`` (PR #3084; 0.6.10 to 0.6.15.post1, so FlashInfer 0.6.13)."""


def _check_sm90_mixed(rows: int, cols_bytes: int, quant_type: str, layout: str) -> None:
    if quant_type not in SM90_MIXED_QUANT_TYPES:
        raise LayoutError(f"unknown SM90 mixed-GEMM quant_type {quant_type!r}", fix="use 'fp4', 'fp4_fp8' or 'int4'")
    if layout not in SM90_MIXED_LAYOUTS:
        raise LayoutError(f"unknown SM90 mixed-GEMM weight layout {layout!r}", fix="use '0.6.16' or '0.6.10'")
    if quant_type == "fp4_fp8" and layout != "0.6.16":
        raise LayoutError("quant_type 'fp4_fp8' exists from FlashInfer 0.6.16 on", fix="use layout '0.6.16'")
    if rows < 1 or rows % 16 or cols_bytes < 1 or cols_bytes % 32:
        raise LayoutError(
            f"SM90 mixed-GEMM interleave: packed 4-bit weights [{rows}, {cols_bytes} B] need rows % 16 == 0 and "
            f"K % 64 == 0 (K = {2 * cols_bytes} values, 2 per byte)",
            fix="pad the intermediate and hidden sizes to multiples of 64 (vLLM and SGLang pad both to 128)",
        )


@cached
def interleave_sm90_mixed_weights(rows: int, cols_bytes: int, quant_type: str = "fp4") -> IndexMap:
    """The byte moves of FlashInfer's SM90 mixed-input weight interleave (``interleave_moe_weights_for_sm90_mixed_gemm``).

    ``[N, K/2]`` packed 4-bit weights -> the same shape; with ``W[r, c]`` the input bytes, for every
    16-row band (first rows ``r = 16b + i``, ``i < 8``, paired with ``r + 8``) and 32-byte column
    partition ``p`` (64 values), and FlashInfer's lane ``l``:

    - ``fp4`` (``l < 16``, ``m = l // 4``, ``q = l % 4``, ``c = 32p + 8m + q``): output
      32-bit word at row ``r + 8 (m % 2)``, bytes ``32p + 16 (m // 2) + 4q .. +3`` gathers
      ``[W[r, c], W[r+8, c], W[r, c+4], W[r+8, c+4]]`` (its bits are then permuted by
      :func:`sm90_mixed_word_bits`);
    - ``int4`` and ``fp4_fp8``, 2-byte cells (``l < 16``, column ``16p + l`` in 2-byte
      units): cells ``W2[r, 16p + l]`` and ``W2[r+8, 16p + l]`` land side by side at row
      ``r + 8 ((l % 8) // 4)``, 2-byte column ``16p + 8 (l // 8) + 2 (l % 4)``.

    The byte moves are the same in both layouts (``SM90_MIXED_LAYOUTS``): FlashInfer 0.6.10-0.6.15's fp4
    kernel (``l < 32``) puts bytes ``W[r, 32p + l]``, ``W[r+8, 32p + l]`` side by side at row
    ``r + 8 ((l // 8) % 2)``, byte ``32p + 16 (l // 16) + 4 (l % 4) + 2 ((l % 8) // 4)``, which with
    ``l = 8m + 4 (j // 2) + q`` is the move above; the layouts differ only in :func:`sm90_mixed_word_bits`.

    Every output 32-bit word is aligned, so the bit step acts word by word. Needs ``N % 16 == 0`` and
    ``K % 64 == 0`` (FlashInfer 0.7.4 checks both). Fact reference: ``moe_gemm_mixed_utils.cu``
    (``interleave_{fp4,fp4_fp8,int4}_weights_for_sm90_mixed_gemm_kernel``) under
    ``csrc/nv_internal/tensorrt_llm/kernels/cutlass_kernels/moe_gemm/`` of FlashInfer 0.7.4 and 0.6.13.
    """
    _check_sm90_mixed(rows, cols_bytes, quant_type, "0.6.16")
    i64 = np.int64
    first = (np.arange(rows // 16, dtype=i64)[:, None] * 16 + np.arange(8, dtype=i64)[None, :]).reshape(-1, 1, 1, 1)
    if quant_type == "fp4":
        cell, width = 1, cols_bytes
        p = np.arange(cols_bytes // 32, dtype=i64)[None, :, None, None] * 32
        lane = np.arange(16, dtype=i64)[None, None, :, None]
        j = np.arange(4, dtype=i64)[None, None, None, :]
        m, q = lane // 4, lane % 4
        dst = (first + 8 * (m % 2)) * width + p + 16 * (m // 2) + 4 * q + j
        src = (first + 8 * (j % 2)) * width + p + 8 * m + q + 4 * (j // 2)
    else:
        cell, width = 2, cols_bytes // 2
        p = np.arange(cols_bytes // 32, dtype=i64)[None, :, None, None] * 16
        lane = np.arange(16, dtype=i64)[None, None, :, None]
        h = np.arange(2, dtype=i64)[None, None, None, :]
        dst = (first + 8 * ((lane % 8) // 4)) * width + p + 8 * (lane // 8) + 2 * (lane % 4) + h
        src = (first + 8 * h) * width + p + lane
    dst, src = np.broadcast_arrays(dst, src)
    out = np.empty(rows * width, dtype=i64)
    out[dst.reshape(-1)] = src.reshape(-1)
    params = dict(rows=rows, cols_bytes=cols_bytes, quant_type=quant_type)
    shape = (rows, cols_bytes)
    return IndexMap(torch.from_numpy(out), cell, shape, shape, (), "interleave_sm90_mixed_weights", params)


_FP4_HALF_WORD: tuple[tuple[int, int], ...] = (
    (4, 0), (4, 1), (4, 2), (2, 0), (2, 1), (2, 2), (0, 0), (0, 1),
    (0, 2), (4, 3), (6, 1), (6, 2), (2, 3), (6, 0), (6, 3), (0, 3),
)  # fmt: skip
"""Bits 0..15 of each 16-bit half ``h`` of an fp4 0.6.16 output word: ``(n, b)`` is bit ``b`` of nibble
``n + h`` of the gathered word (bit 3 of a nibble is the E2M1 sign)."""


def _sm90_word_bit_sources(quant_type: str, layout: str) -> np.ndarray:
    """Source bit (0..31) of every bit of an output word, the word read little-endian."""
    if quant_type == "int4":
        return np.arange(32, dtype=np.int64)
    if layout == "0.6.10":  # each 16-bit half: nibbles [lo a, hi a, lo b, hi b] -> [lo a, lo b, hi a, hi b]
        nib = np.array([0, 2, 1, 3, 4, 6, 5, 7], dtype=np.int64)
        return (nib[:, None] * 4 + np.arange(4, dtype=np.int64)[None, :]).reshape(-1)
    if quant_type == "fp4_fp8":  # magnitudes stay; the sign of nibble t moves to nibble 2t+1 (t < 4) or 2(t-4)
        src = np.arange(32, dtype=np.int64)
        for t in range(8):
            src[4 * (2 * t + 1 if t < 4 else 2 * (t - 4)) + 3] = 4 * t + 3
        return src
    return np.array([4 * (n + h) + b for h in (0, 1) for n, b in _FP4_HALF_WORD], dtype=np.int64)


@cached
def sm90_mixed_word_bits(quant_type: str = "fp4", layout: str = "0.6.16") -> IndexMap:
    """The bit moves inside each 32-bit word of FlashInfer's SM90 mixed-input weight interleave.

    A map on the **bit view** of one little-endian 32-bit word: ``(32,) -> (32,)`` one-byte cells, cell
    ``d`` = bit ``d`` (``apply_word_bits`` runs it on every aligned word of a tensor; as an index map
    it composes, inverts and traces like any other). ``out_bit[d] = in_bit[src[d]]``; nibble ``t`` of a
    word is bits ``4t..4t+3`` (bit 3 the E2M1 sign), values ``2k, 2k+1`` of byte ``k``. For ``fp4``,
    layout 0.6.16, half ``h`` (bits ``16h..16h+15``) takes nibbles ``h, 2+h, 4+h, 6+h``: bits 0-2 the
    magnitude (E2M1 bits 0-2) of nibble ``4+h``, 3-5 of ``2+h``, 6-8 of ``h``, 9 the sign of ``4+h``,
    10, 11, 13 bits 1, 2, 0 of nibble ``6+h``, 12 the sign of ``2+h``, 14 of ``6+h``, 15 of ``h``.
    ``fp4_fp8``: bits stay but for the signs, sign of nibble ``t`` -> nibble ``2t+1`` (``t < 4``) or
    ``2(t-4)``. ``fp4`` layout 0.6.10: in each 16-bit half nibbles 1 and 2 swap. ``int4``: identity.
    Fact reference: the mask/shift lists of ``interleave_fp4_weights_for_sm90_mixed_gemm_kernel`` and
    ``preprocess_fp4x8_signs_for_fp8`` (``moe_gemm_mixed_utils.cu``, FlashInfer 0.7.4 / 0.6.13).
    """
    _check_sm90_mixed(16, 32, quant_type, layout)
    src = torch.from_numpy(_sm90_word_bit_sources(quant_type, layout))
    params = dict(quant_type=quant_type, layout=layout)
    return IndexMap(src, 1, (32,), (32,), (), "sm90_mixed_word_bits", params)


def word_bit_shifts(bits: IndexMap) -> tuple[tuple[int, int], ...]:
    """``bits`` (a permutation of the 32 bits of a word, :func:`sm90_mixed_word_bits` or its inverse) as
    ``(shift, mask)`` pairs: ``out = OR over pairs of (w & mask) << shift`` (``>> -shift`` when negative)."""
    if bits.in_shape != (32,) or bits.out_shape != (32,) or bits.cell_bytes != 1 or not bits.is_permutation:
        raise LayoutError(f"{bits.name} is not a permutation of the 32 bits of a word (a (32,) -> (32,) bit map)")
    groups: dict[int, int] = {}
    for d, s in enumerate(bits.src.tolist()):
        groups[d - s] = groups.get(d - s, 0) | (1 << s)
    return tuple(sorted(groups.items()))


def word_bit_table(bits: IndexMap) -> np.ndarray:
    """``bits`` as a lookup table: int32 ``(4, 256)``, row ``j`` the output word bits that byte ``j`` of a
    word with value ``v`` sets; ``out = T[0][b0] | T[1][b1] | T[2][b2] | T[3][b3]`` (same as the pairs of
    :func:`word_bit_shifts`, which also validates ``bits``)."""
    word_bit_shifts(bits)
    table = np.zeros((4, 256), dtype=np.int64)
    values = np.arange(256, dtype=np.int64)
    for d, s in enumerate(bits.src.tolist()):
        table[s // 8] |= ((values >> (s % 8)) & 1) << d
    return np.where(table >= 1 << 31, table - (1 << 32), table).astype(np.int32)


def apply_word_bits(bits: IndexMap, x: torch.Tensor, chunk_words: int = 1 << 20) -> torch.Tensor:
    """Apply the word bit map ``bits`` to every aligned little-endian 32-bit word of ``x`` (a new tensor).

    ``x``: contiguous ``uint8`` of any shape with ``numel % 4 == 0`` (CPU or CUDA); the result has its
    shape. Four table lookups per word (:func:`word_bit_table`), ``chunk_words`` words at a time.
    """
    if x.dtype != torch.uint8 or not x.is_contiguous() or x.numel() % 4:
        raise LayoutError(
            f"word bit maps run on contiguous uint8 tensors of whole 32-bit words, got {x.dtype} "
            f"{tuple(x.shape)} ({'' if x.is_contiguous() else 'not '}contiguous)",
            fix="pass the packed weights as a contiguous uint8 tensor",
        )
    table = word_bit_table(bits)
    src = x.reshape(-1, 4)
    out = torch.empty(src.shape[0], dtype=torch.int32, device=x.device)
    on_cpu = x.device.type == "cpu"
    lut = torch.from_numpy(table).to(x.device)
    for start in range(0, src.shape[0], chunk_words):
        part = src[start : start + chunk_words]
        if on_cpu:  # numpy indexes with the bytes themselves (no int64 index tensor)
            b, acc = part.numpy(), out[start : start + chunk_words].numpy()
            np.bitwise_or(table[0][b[:, 0]], table[1][b[:, 1]], out=acc)
            acc |= table[2][b[:, 2]]
            acc |= table[3][b[:, 3]]
        else:
            acc_t = lut[0][part[:, 0].long()] | lut[1][part[:, 1].long()]
            out[start : start + chunk_words] = acc_t | lut[2][part[:, 2].long()] | lut[3][part[:, 3].long()]
    return out.view(torch.uint8).view(x.shape)


@dataclass(frozen=True)
class WordBitMap:
    """A byte map, then a bit map on every aligned 32-bit word of its output: ``out = bits(gather(in))``.

    Index maps move whole bytes; FlashInfer's SM90 mixed-input fp4 interleave also moves bits between
    bytes, so it is this pair of primitive steps: ``gather`` (an :class:`IndexMap`, e.g.
    :func:`interleave_sm90_mixed_weights`, composable with the padding and W31 swap before it) and
    ``bits`` (a ``(32,) -> (32,)`` map on the bit view of one word, :func:`sm90_mixed_word_bits`).
    ``spec()`` lists both; :meth:`undo` inverts (``bits`` first); :meth:`source_bits` traces every bit.
    """

    gather: IndexMap
    bits: IndexMap

    def __post_init__(self) -> None:
        word_bit_shifts(self.bits)  # refuses anything but a permutation of a word's 32 bits
        if self.gather.out_bytes % 4:
            raise LayoutError(f"{self.gather.name}: {self.gather.out_bytes} output bytes are not whole 32-bit words")

    @property
    def name(self) -> str:
        return f"{self.gather.name} >> {self.bits.name} (every 32-bit word)"

    def spec(self) -> list[dict[str, Any]]:
        """The primitive steps, byte steps first (what a converted file would record)."""
        return self.gather.spec() + self.bits.spec()

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``(E, *in_shape)`` uint8 -> ``(E, *out_shape)`` uint8 (a new tensor)."""
        return apply_word_bits(self.bits, self.gather.apply(x))

    def undo(self, y: torch.Tensor) -> torch.Tensor:
        """The inverse: ``(E, *out_shape)`` uint8 back to ``(E, *in_shape)`` (padding dropped)."""
        return self.gather.inverse().apply(apply_word_bits(self.bits.inverse(), y.contiguous()))

    def source_bits(self) -> torch.Tensor:
        """int64 ``(out_bytes * 8,)``: the input bit offset (``8 * byte + bit``, bit 0 the least
        significant) of every output bit of one expert, ``-1`` for fill."""
        table = self.bits.src
        byte_src = self.gather.source_bytes().reshape(-1)
        o = torch.arange(self.gather.out_bytes * 8)
        s = table[o % 32]
        gathered = byte_src[(o // 32) * 4 + s // 8]
        return torch.where(gathered >= 0, gathered * 8 + s % 8, -1)


def sm90_mixed_weight_map(rows: int, cols_bytes: int, quant_type: str = "fp4", layout: str = "0.6.16") -> WordBitMap:
    """FlashInfer's ``interleave_moe_weights_for_sm90_mixed_gemm`` on one expert ``[N, K/2]`` as a
    :class:`WordBitMap`: :func:`interleave_sm90_mixed_weights` then :func:`sm90_mixed_word_bits`."""
    return WordBitMap(
        interleave_sm90_mixed_weights(rows, cols_bytes, quant_type), sm90_mixed_word_bits(quant_type, layout)
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
        interleave_sm90_mixed_weights,
        sm90_mixed_word_bits,
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
