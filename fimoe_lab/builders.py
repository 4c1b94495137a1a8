"""Plan builders: FlashInfer's and the engines' weight-preparation helpers as layer plans, from sizes alone.

Each ``plan_*`` is one helper (or one fixed sequence of them) as a :class:`~fimoe_lab.plan.LayerPlan` of
the index maps of ``w13``, ``w2`` and their scales, cached (:func:`fimoe_lab.caches.cached`) so that the
drop-ins of :mod:`fimoe_lab.prepare`, :func:`fimoe_lab.recipes.plan_layer` and the warm-up share one map
per shape. Which builders a (format, backend) composes is :mod:`fimoe_lab.recipes`'s table. A builder that
pads takes the padded sizes ``(I', H')`` (``plan_pad*``, ``*_padded``): the recipes hand it
:func:`fimoe_lab.shapes.layer_shape`'s, the one padding rule; the forms named after FlashInfer's helpers
(``plan_align*``, ``plan_fp8_per_tensor``, ``plan_mxfp8``) take alignments, as those helpers do, and pad to
their ``round_up``.

Shapes (one expert): ``w13`` is ``[P*I, H]`` (P = 2 when gate and up are stacked, i.e.
act-and-mul), ``w2`` is ``[H, I]``, in bytes along the last dim (packed FP4: two values
per byte). Vector scales (MXFP8, NVFP4, MXFP4) are ``[rows, cols/block]`` and follow
their weight's rows; DeepSeek FP8 block scales are ``[ceil(rows/128), ceil(cols/128)]``.

Kernel constants (FlashInfer 0.6.13-0.7.4, DESIGN §3):

- TRT-LLM epilogue tile M: 128 (64 for DeepSeek FP8), so rows shuffle in blocks of 32
  (16 for tile 64);
- BlockMajorK: 128-byte K blocks (bf16 and DeepSeek FP8 on TRT-LLM);
- vector scales on TRT-LLM: rows a multiple of 128 and columns of 4 for the 128x4 swizzle.
"""

from __future__ import annotations

from typing import Optional

from fimoe_lab import steps
from fimoe_lab.caches import cached
from fimoe_lab.errors import LayoutError
from fimoe_lab.layout import IndexMap, compose
from fimoe_lab.plan import LayerPlan, kept_on_disk
from fimoe_lab.shapes import FI_MOE_INTERMEDIATE_MULTIPLE, default_alignments, projections, round_up
from fimoe_lab.specs import FORMATS

__all__ = [
    "TRTLLM_EPILOGUE_TILE_M",
    "DEEPSEEK_EPILOGUE_TILE_M",
    "BLOCK_MAJOR_K_BYTES",
    "SCALE_SWIZZLE_ROWS",
    "TRTLLM_OUTPUT_HIDDEN_ALIGNMENT",
    "chain",
    "present",
    "swap_rows",
    "trtllm_nvfp4_hidden_alignment",
    "plan_pad",
    "plan_align",
    "plan_pad_fp4",
    "plan_align_fp4",
    "plan_pad_mxfp8",
    "plan_align_mxfp8",
    "plan_pad_trtllm_moe_weights",
    "plan_rotate_fp8_per_tensor",
    "plan_shuffle_deepseek_fp8",
    "plan_shuffle_mxfp8",
    "plan_fp4_trtllm_weights",
    "plan_trtllm_bf16_block_layout",
    "plan_fp8_per_tensor",
    "plan_fp8_per_tensor_padded",
    "plan_fp8_block",
    "plan_mxfp8",
    "plan_mxfp8_padded",
]

TRTLLM_EPILOGUE_TILE_M = 128
DEEPSEEK_EPILOGUE_TILE_M = 64
BLOCK_MAJOR_K_BYTES = 128
SCALE_SWIZZLE_ROWS = 128
"""Rows of the 128x4 scale atom; also the row block of TRT-LLM's scale shuffle."""


@cached
def chain(*maps: Optional[IndexMap]) -> Optional[IndexMap]:
    """Compose the maps that are not None (None when none is left)."""
    present = [m for m in maps if m is not None]
    return compose(*present) if present else None


def present(m: Optional[IndexMap]) -> IndexMap:
    """``m``, which a chain ending in a step cannot leave out."""
    if m is None:
        raise LayoutError("internal: a chain that ends in a step came out empty")
    return m


# ----------------------------------------------------------------------------- default paddings
def trtllm_nvfp4_hidden_alignment(per_token_activation: bool, is_act_and_mul: bool) -> int:
    """Hidden alignment vLLM uses for TRTLLM-Gen NVFP4: 512 for per-token non-gated
    (256-aligned shapes left the default tactic without a config, e.g. Nemotron hidden
    2688 -> 2816), else 256."""
    return 512 if per_token_activation and not is_act_and_mul else 256


# ----------------------------------------------------------------------------- padding
@cached
def plan_pad(
    intermediate: int,
    hidden: int,
    padded_intermediate: int,
    padded_hidden: int,
    itemsize: int,
    is_act_and_mul: bool,
    scale_block: Optional[int] = None,
    scale_fill: int = 0,
    w13_scale_cols: Optional[int] = None,
    w2_scale_cols: Optional[int] = None,
    values_per_byte: int = 1,
    description: str = "align",
) -> LayerPlan:
    """Pad ``(I, H)`` to ``(I', H')`` = (``padded_intermediate``, ``padded_hidden``), each projection of W13 on
    its own; with ``scale_block``, their vector scales too. The recipes pass :func:`fimoe_lab.shapes.layer_shape`'s
    sizes; :func:`plan_align` the ``round_up`` of its alignments.

    W13 ``[P*I, H] -> [P*I', H']``, W2 ``[H, I] -> [H', I']`` (values; ``itemsize`` bytes per stored element,
    ``values_per_byte`` 2 for packed FP4: a padded size must fill whole bytes). Scales (one per ``scale_block``
    values along the last dim, ``w13_scale_cols`` / ``w2_scale_cols`` columns in the checkpoint) are padded with
    ``scale_fill`` to ``[P*I', H'/block]`` and ``[H', I'/block]``; padded sizes must be whole blocks.
    """
    p = projections(is_act_and_mul)
    ip, hp = padded_intermediate, padded_hidden
    if ip == intermediate and hp == hidden:
        return LayerPlan(None, None, None, None, intermediate, hidden, ip, hp, description)

    def cols(values: int) -> int:
        if (values * itemsize) % values_per_byte:
            raise LayoutError(
                f"a padded size of {values} values does not fill whole bytes ({values_per_byte} values per byte)",
                fix=f"choose an alignment that is a multiple of {values_per_byte}",
            )
        return values * itemsize // values_per_byte

    w13 = steps.pad_projections(p, intermediate, ip, cols(hidden), cols(hp))
    w2 = steps.pad_projections(1, hidden, hp, cols(intermediate), cols(ip))
    w13_s = w2_s = None
    if scale_block is not None:
        for size, name in ((hp, "hidden"), (ip, "intermediate")):
            if size % scale_block:
                raise LayoutError(
                    f"padded {name} {size} is not a multiple of the scale block {scale_block}",
                    fix=f"choose an alignment that is a multiple of {scale_block}",
                )
        c13 = hidden // scale_block if w13_scale_cols is None else w13_scale_cols  # one scale per block
        c2 = intermediate // scale_block if w2_scale_cols is None else w2_scale_cols
        w13_s = steps.pad_projections(p, intermediate, ip, c13, hp // scale_block, scale_fill)
        w2_s = steps.pad_projections(1, hidden, hp, c2, ip // scale_block, scale_fill)
    return LayerPlan(w13, w2, w13_s, w2_s, intermediate, hidden, ip, hp, description)


def plan_align(
    intermediate: int,
    hidden: int,
    itemsize: int,
    is_act_and_mul: bool,
    min_alignment: int = FI_MOE_INTERMEDIATE_MULTIPLE,
    hidden_alignment: int = 1,
    scale_block: Optional[int] = None,
    scale_fill: int = 0,
    w13_scale_cols: Optional[int] = None,
    w2_scale_cols: Optional[int] = None,
    values_per_byte: int = 1,
    description: str = "align",
) -> LayerPlan:
    """Pad intermediate (each projection on its own) to ``min_alignment`` and hidden to
    ``hidden_alignment``: :func:`plan_pad` to ``(round_up(I, min_alignment), round_up(H, hidden_alignment))``
    (FlashInfer's ``align_moe_weights_for_fi``); with ``scale_block``, their vector scales too."""
    padded = round_up(intermediate, min_alignment), round_up(hidden, hidden_alignment)
    return plan_pad(
        intermediate,
        hidden,
        *padded,
        itemsize,
        is_act_and_mul,
        scale_block,
        scale_fill,
        w13_scale_cols,
        w2_scale_cols,
        values_per_byte,
        description,
    )


@cached
def plan_pad_mxfp8(
    intermediate: int,
    hidden: int,
    padded_intermediate: int,
    padded_hidden: int,
    is_act_and_mul: bool,
    w13_scale_cols: int,
    w2_scale_cols: int,
    scale_fill: int,
) -> LayerPlan:
    """Pad MXFP8 weights (1 byte) to ``(I', H')`` and their UE8M0 scales, one per ``hidden / w13_scale_cols``
    values; padded scales ``scale_fill`` (127 = UE8M0 1.0, so padded lanes add nothing)."""
    if w13_scale_cols < 1 or hidden % w13_scale_cols:
        raise LayoutError(
            f"hidden {hidden} is not a whole number of scale blocks for {w13_scale_cols} scale columns "
            f"(MXFP8 has one UE8M0 scale per 32 values)"
        )
    return plan_pad(
        intermediate,
        hidden,
        padded_intermediate,
        padded_hidden,
        1,
        is_act_and_mul,
        scale_block=hidden // w13_scale_cols,
        scale_fill=scale_fill,
        w13_scale_cols=w13_scale_cols,
        w2_scale_cols=w2_scale_cols,
        description="align_mxfp8_moe_weights_for_fi_trtllm",
    )


def plan_align_mxfp8(
    intermediate: int,
    hidden: int,
    is_act_and_mul: bool,
    w13_scale_cols: int,
    w2_scale_cols: int,
    min_alignment: int,
    hidden_alignment: int,
    scale_fill: int,
) -> LayerPlan:
    """:func:`plan_pad_mxfp8` to ``(round_up(I, min_alignment), round_up(H, hidden_alignment))``."""
    padded = round_up(intermediate, min_alignment), round_up(hidden, hidden_alignment)
    return plan_pad_mxfp8(intermediate, hidden, *padded, is_act_and_mul, w13_scale_cols, w2_scale_cols, scale_fill)


@cached
def plan_pad_fp4(
    intermediate: int,
    hidden: int,
    padded_intermediate: int,
    padded_hidden: int,
    is_act_and_mul: bool,
    scale_block: int = 16,
    scale_fill: int = 0,
) -> LayerPlan:
    """Pad packed FP4 (two values per byte) to ``(I', H')`` and its scales (one byte per ``scale_block``
    values: 16 NVFP4 E4M3, 32 MXFP4 UE8M0); padded weights are 0, padded scales
    ``scale_fill`` (0; FlashInfer 0.7.x's ``pad_trtllm_moe_weights``: 0x38 NVFP4, 127 MXFP4)."""
    return plan_pad(
        intermediate,
        hidden,
        padded_intermediate,
        padded_hidden,
        1,
        is_act_and_mul,
        scale_block=scale_block,
        scale_fill=scale_fill,
        w13_scale_cols=hidden // scale_block,
        w2_scale_cols=intermediate // scale_block,
        values_per_byte=2,
        description="align_fp4_moe_weights_for_fi",
    )


def plan_align_fp4(
    intermediate: int,
    hidden: int,
    is_act_and_mul: bool,
    min_alignment: int = FI_MOE_INTERMEDIATE_MULTIPLE,
    hidden_alignment: int = 1,
    scale_block: int = 16,
    scale_fill: int = 0,
) -> LayerPlan:
    """:func:`plan_pad_fp4` to ``(round_up(I, min_alignment), round_up(H, hidden_alignment))``
    (FlashInfer's ``align_fp4_moe_weights_for_fi``)."""
    padded = round_up(intermediate, min_alignment), round_up(hidden, hidden_alignment)
    return plan_pad_fp4(intermediate, hidden, *padded, is_act_and_mul, scale_block, scale_fill)


TRTLLM_OUTPUT_HIDDEN_ALIGNMENT = 128
"""GEMM2's N of the TRT-LLM MoE ops given ``valid_hidden_size``: W2 rows pad only to this (FlashInfer 0.7.x)."""


@cached
def plan_pad_trtllm_moe_weights(
    intermediate: int,
    hidden: int,
    is_gated_act: bool = True,
    hidden_alignment: int = 512,
    intermediate_alignment: int = 128,
    elems_per_byte: int = 2,
    sf_vec_size: int = 16,
) -> LayerPlan:
    """FlashInfer 0.7.x's ``pad_trtllm_moe_weights`` as a plan (block-scaled TRT-LLM weights).

    ``Ip = ceil(I, intermediate_alignment)``, ``Hp = ceil(H, hidden_alignment)``,
    ``H2 = ceil(H, 128)``; P = 2 if ``is_gated_act`` (gate and up padded each on its own):
    W1 ``[P*I, H/epb] -> [P*Ip, Hp/epb]`` and its scales ``[P*I, H/sf] -> [P*Ip, Hp/sf]``;
    W2 ``[H, I/epb] -> [H2, Ip/epb]`` and its scales ``[H, I/sf] -> [H2, Ip/sf]`` (W2's rows
    only to GEMM2's N, not to ``Hp``). Weights pad with 0, scales with the neutral 1.0 of
    their format: 127 (UE8M0, ``sf_vec_size`` 32) or 0x38 (E4M3, 16). Alignments must be
    multiples of 128; ``H`` and ``I`` multiples of ``sf_vec_size``.
    """
    if hidden_alignment % 128 or intermediate_alignment % 128 or hidden_alignment < 1 or intermediate_alignment < 1:
        raise LayoutError(
            f"hidden_alignment {hidden_alignment} and intermediate_alignment {intermediate_alignment} must be "
            f"positive multiples of 128",
            fix="use 512 and 128 (FlashInfer's defaults) or other multiples of 128",
        )
    if sf_vec_size not in (16, 32) or elems_per_byte not in (1, 2):
        raise LayoutError(f"sf_vec_size {sf_vec_size} / elems_per_byte {elems_per_byte}: expected 16 or 32 / 1 or 2")
    for size, name in ((intermediate, "intermediate"), (hidden, "hidden")):
        if size < 1 or size % sf_vec_size:
            raise LayoutError(
                f"{name} {size} is not a positive multiple of the scale block {sf_vec_size}", fix="pass the real sizes"
            )
    p = projections(is_gated_act)
    fill = 127 if sf_vec_size == 32 else 0x38
    ip, hp = round_up(intermediate, intermediate_alignment), round_up(hidden, hidden_alignment)
    h2 = round_up(hidden, TRTLLM_OUTPUT_HIDDEN_ALIGNMENT)

    def pad(parts: int, rows: int, prows: int, cols: int, pcols: int, f: int = 0) -> Optional[IndexMap]:
        return None if (rows, cols) == (prows, pcols) else steps.pad_projections(parts, rows, prows, cols, pcols, f)

    e, sf = elems_per_byte, sf_vec_size
    return LayerPlan(
        pad(p, intermediate, ip, hidden // e, hp // e),
        pad(1, hidden, h2, intermediate // e, ip // e),
        pad(p, intermediate, ip, hidden // sf, hp // sf, fill),
        pad(1, hidden, h2, intermediate // sf, ip // sf, fill),
        intermediate,
        hidden,
        ip,
        hp,
        "pad_trtllm_moe_weights",
    )


# ----------------------------------------------------------------------------- row shuffles
@cached
@kept_on_disk  # a drop-in's plan: a restarted engine's first layer reads it
def plan_rotate_fp8_per_tensor(w13_rows: int, hidden: int, intermediate: int, is_gated: bool) -> LayerPlan:
    """Gated interleave (if gated) and epilogue shuffle (tile 128) of both FP8 weights."""
    etm = TRTLLM_EPILOGUE_TILE_M
    first = steps.interleave_rows_for_gated_act(w13_rows, hidden) if is_gated else None
    w13 = chain(first, steps.shuffle_rows_for_epilogue(w13_rows, hidden, etm))
    w2 = steps.shuffle_rows_for_epilogue(hidden, intermediate, etm)
    return LayerPlan(w13, w2, None, None, intermediate, hidden, intermediate, hidden, "FP8 per-tensor TRT-LLM rotate")


@cached
@kept_on_disk  # a drop-in's plan: a restarted engine's first layer reads it
def plan_shuffle_deepseek_fp8(w13_rows: int, hidden: int, intermediate: int) -> LayerPlan:
    """Epilogue shuffle (tile 64) then BlockMajorK (128 B) for both FP8 weights, no swap."""

    def to_block_major(rows: int, cols: int) -> IndexMap:
        return steps.shuffle_rows_for_epilogue(rows, cols, DEEPSEEK_EPILOGUE_TILE_M) >> steps.block_major_k(
            rows, cols, BLOCK_MAJOR_K_BYTES
        )

    return LayerPlan(
        to_block_major(w13_rows, hidden),
        to_block_major(hidden, intermediate),
        None,
        None,
        intermediate,
        hidden,
        intermediate,
        hidden,
        "DeepSeek FP8 TRT-LLM shuffle",
    )


@cached
def plan_shuffle_mxfp8(
    w13_rows: int, hidden: int, intermediate: int, is_gated: bool, w13_scale_cols: int, w2_scale_cols: int
) -> LayerPlan:
    """Gated interleave (if gated), epilogue shuffle (tile 128), and for scales the 128x4 swizzle."""
    etm = TRTLLM_EPILOGUE_TILE_M

    def weight(rows: int, cols: int, interleave: bool) -> IndexMap:
        first = steps.interleave_rows_for_gated_act(rows, cols) if interleave else None
        return present(chain(first, steps.shuffle_rows_for_epilogue(rows, cols, etm)))

    def scale(rows: int, cols: int, interleave: bool) -> IndexMap:
        if rows % SCALE_SWIZZLE_ROWS or cols % 4:
            raise LayoutError(
                f"MXFP8 scales [{rows}, {cols}] cannot keep their shape through the 128x4 swizzle: rows must be a "
                f"multiple of 128 and cols of 4",
                fix="pad with align_mxfp8_moe_weights_for_fi_trtllm (intermediate 128, hidden 256) first",
            )
        return present(chain(weight(rows, cols, interleave), steps.swizzle_scales_128x4(rows, cols)))

    return LayerPlan(
        weight(w13_rows, hidden, is_gated),
        weight(hidden, intermediate, False),
        scale(w13_rows, w13_scale_cols, is_gated),
        scale(hidden, w2_scale_cols, False),
        intermediate,
        hidden,
        intermediate,
        hidden,
        "MXFP8 TRT-LLM shuffle",
    )


@cached
def plan_fp4_trtllm_weights(
    intermediate: int, hidden: int, is_act_and_mul: bool = True, is_gated: bool = True, scale_block: int = 16
) -> LayerPlan:
    """Packed FP4 weights and their block scales into the TRT-LLM layout.

    ``scale_block`` 16: NVFP4 (E4M3 scales), 32: MXFP4 (UE8M0, gpt-oss). W13
    ``(P*I, H/2)`` bytes: W31 swap (if fused), gated interleave (if gated), epilogue
    shuffle (tile 128); its scales ``(P*I, H/block)`` the same rows, then the 128x4
    swizzle. W2 ``(H, I/2)``: shuffle; its scales ``(H, I/block)``: shuffle + swizzle.
    Needs rows % 128 == 0 for the scale shuffle (FlashInfer's shuffle_matrix_sf_a).
    """
    p = projections(is_act_and_mul)
    etm = TRTLLM_EPILOGUE_TILE_M
    for size, name in ((intermediate, "intermediate"), (hidden, "hidden")):
        if size % scale_block:
            raise LayoutError(
                f"FP4: {name} {size} is not a multiple of {scale_block} (one scale per {scale_block} values)",
                fix="pad it first",
            )

    def rows_chain(rows: int, cols: int, fused: bool) -> Optional[IndexMap]:
        swap = steps.swap_w13_to_w31_rows(rows, cols) if fused and is_act_and_mul else None
        inter = steps.interleave_rows_for_gated_act(rows, cols) if fused and is_gated else None
        return chain(swap, inter, steps.shuffle_rows_for_epilogue(rows, cols, etm))

    def scales(rows: int, cols: int, fused: bool) -> IndexMap:
        if rows % SCALE_SWIZZLE_ROWS:
            raise LayoutError(
                f"FP4 scales have {rows} rows, not a multiple of 128 (the TRT-LLM scale shuffle)",
                fix=f"pad the intermediate size to a multiple of {128 // p} first (intermediate_alignment={128 // p})",
            )
        return present(chain(rows_chain(rows, cols, fused), steps.swizzle_scales_128x4(rows, cols)))

    return LayerPlan(
        rows_chain(p * intermediate, hidden // 2, True),
        rows_chain(hidden, intermediate // 2, False),
        scales(p * intermediate, hidden // scale_block, True),
        scales(hidden, intermediate // scale_block, False),
        intermediate,
        hidden,
        intermediate,
        hidden,
        f"{'NVFP4' if scale_block == 16 else 'MXFP4'} TRT-LLM",
    )


@cached
@kept_on_disk  # a drop-in's plan: a restarted engine's first layer reads it
def plan_trtllm_bf16_block_layout(
    w13_rows: int,
    hidden: int,
    intermediate: int,
    is_gated_act_gemm: bool = True,
    itemsize: int = 2,
    swap: bool = True,
) -> LayerPlan:
    """W31 swap (``swap``) + gated interleave (if gated), epilogue shuffle 128, BlockMajorK 128 B."""
    etm, bk = TRTLLM_EPILOGUE_TILE_M, BLOCK_MAJOR_K_BYTES
    c13, c2 = hidden * itemsize, intermediate * itemsize
    gated: tuple[IndexMap, ...] = ()
    if is_gated_act_gemm:
        first = (steps.swap_w13_to_w31_rows(w13_rows, c13),) if swap else ()
        gated = (*first, steps.interleave_rows_for_gated_act(w13_rows, c13))
    w13 = compose(*gated, steps.shuffle_rows_for_epilogue(w13_rows, c13, etm), steps.block_major_k(w13_rows, c13, bk))
    w2 = steps.shuffle_rows_for_epilogue(hidden, c2, etm) >> steps.block_major_k(hidden, c2, bk)
    return LayerPlan(w13, w2, None, None, intermediate, hidden, intermediate, hidden, "BF16 TRT-LLM block layout")


# ----------------------------------------------------------------------------- FP8 layers
def swap_rows(rows: int, cols_bytes: int, is_act_and_mul: bool) -> Optional[IndexMap]:
    """The W31 swap of a ``[rows, cols_bytes]`` W13 (or its scales) when gate and up are stacked, else None."""
    return steps.swap_w13_to_w31_rows(rows, cols_bytes) if is_act_and_mul else None


def plan_fp8_per_tensor(
    intermediate: int,
    hidden: int,
    is_act_and_mul: bool,
    is_gated: bool,
    trtllm: bool,
    swap: bool = True,
    min_alignment: Optional[int] = None,
) -> LayerPlan:
    """FP8 per-tensor: :func:`plan_fp8_per_tensor_padded` with I padded to ``min_alignment`` (None: FlashInfer's
    16 gated, 128 non-gated; 1: no padding)."""
    if min_alignment is None:
        min_alignment = default_alignments("fp8", "trtllm" if trtllm else "cutlass", is_act_and_mul, is_gated)[0]
    padded = round_up(intermediate, min_alignment)
    return plan_fp8_per_tensor_padded(intermediate, hidden, padded, is_act_and_mul, is_gated, trtllm, swap)


@cached
def plan_fp8_per_tensor_padded(
    intermediate: int,
    hidden: int,
    padded_intermediate: int,
    is_act_and_mul: bool,
    is_gated: bool,
    trtllm: bool,
    swap: bool = True,
) -> LayerPlan:
    """FP8 per-tensor: pad I to ``padded_intermediate`` (W13 ``[P*I, H] -> [P*I', H]``, W2 ``[H, I] -> [H, I']``),
    swap (``swap``; a profile's ``gate_up_kept`` turns it off); TRT-LLM adds the gated interleave and the
    epilogue shuffle (tile 128)."""
    p = projections(is_act_and_mul)
    pad = plan_pad(intermediate, hidden, padded_intermediate, hidden, 1, is_act_and_mul)
    ip = pad.padded_intermediate
    rotate = plan_rotate_fp8_per_tensor(p * ip, hidden, ip, is_gated) if trtllm else None
    return LayerPlan(
        chain(pad.w13, swap_rows(p * ip, hidden, is_act_and_mul and swap), rotate.w13 if rotate else None),
        chain(pad.w2, rotate.w2 if rotate else None),
        None,
        None,
        intermediate,
        hidden,
        ip,
        hidden,
        "FP8 per-tensor TRT-LLM" if trtllm else "FP8 per-tensor CUTLASS",
    )


@cached
def plan_fp8_block(
    intermediate: int,
    hidden: int,
    is_act_and_mul: bool,
    trtllm: bool,
    scale_rows: int,
    scale_cols_bytes: int,
    block_rows: int = 128,
) -> LayerPlan:
    """DeepSeek FP8 block: swap weights and their ``[scale_rows, scale_cols]`` block scales;
    TRT-LLM adds the epilogue shuffle (tile 64) and BlockMajorK 128 B.

    With gate and up stacked, ``intermediate % block_rows == 0`` so that gate and up
    never share a scale row (a TP shard that splits a block cannot be swapped apart).
    """
    if is_act_and_mul and intermediate % block_rows:
        raise LayoutError(
            f"intermediate {intermediate} is not a multiple of the {block_rows}-row scale block, so gate "
            f"and up would share a scale row and cannot be swapped apart",
            fix=f"choose a tensor-parallel size whose shard keeps intermediate % {block_rows} == 0",
        )
    p = projections(is_act_and_mul)
    shuffle = plan_shuffle_deepseek_fp8(p * intermediate, hidden, intermediate) if trtllm else None
    return LayerPlan(
        chain(swap_rows(p * intermediate, hidden, is_act_and_mul), shuffle.w13 if shuffle else None),
        shuffle.w2 if shuffle else None,
        swap_rows(scale_rows, scale_cols_bytes, is_act_and_mul),
        None,
        intermediate,
        hidden,
        intermediate,
        hidden,
        "DeepSeek FP8 TRT-LLM" if trtllm else "DeepSeek FP8 CUTLASS",
    )


def plan_mxfp8(
    intermediate: int,
    hidden: int,
    is_act_and_mul: bool,
    is_gated: bool,
    trtllm: bool,
    w13_scale_cols: int,
    w2_scale_cols: int,
    intermediate_alignment: Optional[int] = None,
    hidden_alignment: Optional[int] = None,
    scale_fill: Optional[int] = None,
    swap: bool = True,
    cutlass_swizzled: bool = False,
) -> LayerPlan:
    """MXFP8: :func:`plan_mxfp8_padded` with ``(I, H)`` padded to the alignments given, else on TRT-LLM to
    FlashInfer's I 128, H 256 (CUTLASS: none; ``plan_layer`` passes the profile's, 128 and 128 for FlashInfer
    0.7.x, whose CUTLASS MXFP8 binding needs them; vLLM's ``prepare_fp8_moe_layer_for_fi`` pads nothing).
    ``scale_fill`` None: the format's byte, 127 (UE8M0 1.0)."""
    da, dh = default_alignments("mxfp8", "trtllm", is_act_and_mul, is_gated) if trtllm else (1, 1)
    padded = round_up(intermediate, intermediate_alignment or da), round_up(hidden, hidden_alignment or dh)
    fill = FORMATS["mxfp8"].scale_fill if scale_fill is None else scale_fill
    return plan_mxfp8_padded(
        intermediate,
        hidden,
        *padded,
        is_act_and_mul,
        is_gated,
        trtllm,
        w13_scale_cols,
        w2_scale_cols,
        fill,
        swap,
        cutlass_swizzled,
    )


@cached
def plan_mxfp8_padded(
    intermediate: int,
    hidden: int,
    padded_intermediate: int,
    padded_hidden: int,
    is_act_and_mul: bool,
    is_gated: bool,
    trtllm: bool,
    w13_scale_cols: int,
    w2_scale_cols: int,
    scale_fill: int,
    swap: bool = True,
    cutlass_swizzled: bool = False,
) -> LayerPlan:
    """MXFP8 (UE8M0 scale per 32 values, scales follow their rows), padded to ``(I', H')``.

    TRT-LLM: pad (padded scales ``scale_fill``: 127 = UE8M0 1.0; SGLang 0.5.23 writes 0), swap (``swap``;
    SGLang 0.5.23 keeps ``[gate; up]``), gated interleave, shuffle (tile 128); scales also 128x4-swizzled.
    CUTLASS: pad, swap weights and scales; with ``cutlass_swizzled`` the scales ``[R, C]`` then go through the
    128x4 swizzle to ``[ceil128(R), ceil4(C)]`` (FlashInfer 0.7.x).
    """
    p = projections(is_act_and_mul)
    pad = plan_pad_mxfp8(
        intermediate,
        hidden,
        padded_intermediate,
        padded_hidden,
        is_act_and_mul,
        w13_scale_cols,
        w2_scale_cols,
        scale_fill,
    )
    ip, hp = pad.padded_intermediate, pad.padded_hidden
    block = hidden // w13_scale_cols  # checked to divide by plan_pad_mxfp8
    if not trtllm:
        c13, c2 = hp // block, ip // block
        return LayerPlan(
            chain(pad.w13, swap_rows(p * ip, hp, is_act_and_mul)),
            pad.w2,
            chain(
                pad.w13_scale,
                swap_rows(p * ip, c13, is_act_and_mul),
                steps.swizzle_scales_128x4(p * ip, c13) if cutlass_swizzled else None,
            ),
            chain(pad.w2_scale, steps.swizzle_scales_128x4(hp, c2) if cutlass_swizzled else None),
            intermediate,
            hidden,
            ip,
            hp,
            "MXFP8 CUTLASS",
        )
    shuffle = plan_shuffle_mxfp8(p * ip, hp, ip, is_gated, hp // block, ip // block)
    return LayerPlan(
        chain(pad.w13, swap_rows(p * ip, hp, is_act_and_mul and swap), shuffle.w13),
        chain(pad.w2, shuffle.w2),
        chain(pad.w13_scale, swap_rows(p * ip, hp // block, is_act_and_mul and swap), shuffle.w13_scale),
        chain(pad.w2_scale, shuffle.w2_scale),
        intermediate,
        hidden,
        ip,
        hp,
        "MXFP8 TRT-LLM",
    )
