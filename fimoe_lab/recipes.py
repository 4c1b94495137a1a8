"""Recipes: the steps each (format, backend) applies to an MoE layer, from sizes alone.

A recipe turns per-rank sizes into a :class:`~fimoe_lab.plan.LayerPlan` (the index maps of
``w13``, ``w2`` and their scales). ``convert``, ``plan``, the tuner's reference column,
the lab and the vLLM drop-ins in :mod:`fimoe_lab.prepare` all build plans here, and all
take their default paddings from :func:`default_alignments`, so they cannot disagree.

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

from dataclasses import dataclass, replace
from typing import Optional

from fimoe_lab import steps
from fimoe_lab.caches import cached
from fimoe_lab.choice import LayerShape, LayoutChoice
from fimoe_lab.engines import check_quant_method, get_engine
from fimoe_lab.errors import LayoutError
from fimoe_lab.layout import IndexMap, compose
from fimoe_lab.plan import LayerPlan
from fimoe_lab.shapes import (
    FI_MOE_INTERMEDIATE_MULTIPLE,
    choice_alignments,
    default_alignments,
    layer_shape,
    mxint4_shape,
    projections,
)
from fimoe_lab.specs import FORMATS, get_format

__all__ = [
    "TRTLLM_EPILOGUE_TILE_M",
    "DEEPSEEK_EPILOGUE_TILE_M",
    "BLOCK_MAJOR_K_BYTES",
    "SCALE_SWIZZLE_ROWS",
    "FI_MOE_INTERMEDIATE_MULTIPLE",
    "RECIPES",
    "Recipe",
    "recipe_id",
    "default_alignments",
    "projections",
    "scale_fill",
    "trtllm_nvfp4_hidden_alignment",
    "plan_layer",
    "plan_for",
    "plan_align",
    "plan_align_fp4",
    "plan_align_mxfp8",
    "plan_pad_trtllm_moe_weights",
    "TRTLLM_OUTPUT_HIDDEN_ALIGNMENT",
    "plan_fp8_per_tensor",
    "plan_fp8_block",
    "plan_mxfp8",
    "plan_rotate_fp8_per_tensor",
    "plan_shuffle_deepseek_fp8",
    "plan_shuffle_mxfp8",
    "plan_fp4_trtllm_weights",
    "plan_trtllm_bf16_block_layout",
    "plan_trtllm_mxint4",
    "plan_mxint4",
    "MXINT4_SCALE_BLOCK",
    "SM90_MIXED_ALIGNMENT",
    "ACTIVATION_DTYPES",
    "activation_layout",
    "plan_cutlass_mxfp4_bf16",
    "chain",
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


def scale_fill(fmt: str, backend: str, engine: Optional[str] = None) -> int:
    """The byte padded block scales get: the profile's ``scale_fill`` or the format's."""
    fmt = get_format(fmt).plan_format
    return get_engine(engine).scale_fill.get(recipe_id(fmt, backend), FORMATS[fmt].scale_fill)


# ----------------------------------------------------------------------------- padding
@cached
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
    ``hidden_alignment``; with ``scale_block``, their vector scales too.

    ``itemsize`` bytes per stored element, ``values_per_byte`` 2 for packed FP4.
    Scales (one per ``scale_block`` values along the last dim, ``w13_scale_cols`` /
    ``w2_scale_cols`` columns in the checkpoint) are padded with ``scale_fill``.
    """
    p = projections(is_act_and_mul)
    ip = steps.round_up(intermediate, min_alignment)
    hp = steps.round_up(hidden, hidden_alignment)
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


@cached
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
    """Pad MXFP8 weights (1 byte) and their UE8M0 scales, one per ``hidden / w13_scale_cols``
    values; padded scales ``scale_fill`` (127 = UE8M0 1.0, so padded lanes add nothing)."""
    if w13_scale_cols < 1 or hidden % w13_scale_cols:
        raise LayoutError(
            f"hidden {hidden} is not a whole number of scale blocks for {w13_scale_cols} scale columns "
            f"(MXFP8 has one UE8M0 scale per 32 values)"
        )
    return plan_align(
        intermediate,
        hidden,
        1,
        is_act_and_mul,
        min_alignment,
        hidden_alignment,
        scale_block=hidden // w13_scale_cols,
        scale_fill=scale_fill,
        w13_scale_cols=w13_scale_cols,
        w2_scale_cols=w2_scale_cols,
        description="align_mxfp8_moe_weights_for_fi_trtllm",
    )


@cached
def plan_align_fp4(
    intermediate: int,
    hidden: int,
    is_act_and_mul: bool,
    min_alignment: int = FI_MOE_INTERMEDIATE_MULTIPLE,
    hidden_alignment: int = 1,
    scale_block: int = 16,
    scale_fill: int = 0,
) -> LayerPlan:
    """Pad packed FP4 (two values per byte) and its scales (one byte per ``scale_block``
    values: 16 NVFP4 E4M3, 32 MXFP4 UE8M0); padded weights are 0, padded scales
    ``scale_fill`` (0; FlashInfer 0.7.x's ``pad_trtllm_moe_weights``: 0x38 NVFP4, 127 MXFP4)."""
    return plan_align(
        intermediate,
        hidden,
        1,
        is_act_and_mul,
        min_alignment,
        hidden_alignment,
        scale_block=scale_block,
        scale_fill=scale_fill,
        w13_scale_cols=hidden // scale_block,
        w2_scale_cols=intermediate // scale_block,
        values_per_byte=2,
        description="align_fp4_moe_weights_for_fi",
    )


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
    ip, hp = steps.round_up(intermediate, intermediate_alignment), steps.round_up(hidden, hidden_alignment)
    h2 = steps.round_up(hidden, TRTLLM_OUTPUT_HIDDEN_ALIGNMENT)

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
def plan_rotate_fp8_per_tensor(w13_rows: int, hidden: int, intermediate: int, is_gated: bool) -> LayerPlan:
    """Gated interleave (if gated) and epilogue shuffle (tile 128) of both FP8 weights."""
    etm = TRTLLM_EPILOGUE_TILE_M
    first = steps.interleave_rows_for_gated_act(w13_rows, hidden) if is_gated else None
    w13 = chain(first, steps.shuffle_rows_for_epilogue(w13_rows, hidden, etm))
    w2 = steps.shuffle_rows_for_epilogue(hidden, intermediate, etm)
    return LayerPlan(w13, w2, None, None, intermediate, hidden, intermediate, hidden, "FP8 per-tensor TRT-LLM rotate")


@cached
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


MXINT4_SCALE_BLOCK = 32
"""Values per bf16 scale of MxInt4 (int4 weights, two per byte, group-quantised along K)."""


@cached
def plan_trtllm_mxint4(intermediate: int, hidden: int, is_gated: bool = True, swap_w31: bool = True) -> LayerPlan:
    """MxInt4 (packed int4 weights, one bf16 scale per 32 values) into TRT-LLM's layout
    (FlashInfer 0.7.x ``prepare_trtllm_mxint4_weights``, from already quantised tensors).

    W13 ``[P*I, H/2]`` bytes: W31 swap (``swap_w31``, a ``[gate; up]`` checkpoint; FlashInfer's
    own helper starts from ``[up; gate]``), gated interleave (if gated), epilogue shuffle
    (tile 128), BlockMajorK 128 B -> ``[H/256, P*I, 128]``; its scales ``[P*I, H/32]`` bf16: the
    same rows, then the 128x4 swizzle of 2-byte elements. W2 ``[H, I/2]``: shuffle +
    BlockMajorK; its scales ``[H, I/32]``: shuffle + swizzle. Needs H and I multiples of 256.
    """
    for size, name in ((intermediate, "intermediate"), (hidden, "hidden")):
        if size < 1 or size % 256:
            raise LayoutError(
                f"MxInt4: {name} {size} is not a multiple of 256 (TRT-LLM MxInt4)", fix="pad it to a multiple of 256"
            )
    p = 2 if is_gated else 1
    etm, bk, sb = TRTLLM_EPILOGUE_TILE_M, BLOCK_MAJOR_K_BYTES, MXINT4_SCALE_BLOCK

    def rows(m: int, cols_bytes: int, fused: bool) -> Optional[IndexMap]:
        gated = fused and is_gated
        return chain(
            steps.swap_w13_to_w31_rows(m, cols_bytes) if gated and swap_w31 else None,
            steps.interleave_rows_for_gated_act(m, cols_bytes) if gated else None,
            steps.shuffle_rows_for_epilogue(m, cols_bytes, etm),
        )

    def weight(m: int, k: int, fused: bool) -> IndexMap:
        return present(chain(rows(m, k // 2, fused), steps.block_major_k(m, k // 2, bk)))

    def scale(m: int, k: int, fused: bool) -> IndexMap:
        return present(chain(rows(m, 2 * (k // sb), fused), steps.swizzle_scales_128x4(m, k // sb, 2)))

    return LayerPlan(
        weight(p * intermediate, hidden, True),
        weight(hidden, intermediate, False),
        scale(p * intermediate, hidden, True),
        scale(hidden, intermediate, False),
        intermediate,
        hidden,
        intermediate,
        hidden,
        "MxInt4 TRT-LLM",
    )


def plan_mxint4(layer: LayerShape, choice: LayoutChoice) -> LayerPlan:
    """``plan_layer`` for MxInt4: :func:`plan_trtllm_mxint4` of a ``[gate; up]`` checkpoint, which is what
    vLLM 0.34's ``prepare_static_weights_for_trtllm_mxint4_moe`` hands the kernel (W31 swapped, as FlashInfer
    0.7.x's helper takes ``[up; gate]``); a profile that keeps ``[gate; up]`` (``gate_up_kept``: SGLang 0.5.23's
    compressed-tensors MxInt4 scheme loads gate first and does not reorder) skips the swap.

    Constraints: backend ``trtllm`` (no CUTLASS MxInt4 MoE), SwiGLU (gated, act-and-mul; the
    TRTLLM-Gen MxInt4 runner takes only Swiglu), no per-token activations (BF16 activations), and no
    padding: vLLM pads nothing, so ``I`` and ``H`` must already be multiples of 256 and alignments
    given must not pad them. Shapes: W13 ``[2I, H/2] -> [H/256, 2I, 128]`` bytes, scales
    ``[2I, H/32]`` bf16 -> 128x4-swizzled, the same for W2 ``[H, I/2]`` and ``[H, I/32]``.
    """
    profile = get_engine(choice.engine)  # an unknown profile is refused here as everywhere
    mxint4_shape(layer, choice)  # the one MxInt4 size rule (the tuner's): refuses with its message, never pads
    swap = not profile.keeps_gate_up("mxint4", choice.backend, layer.quant_method)
    return plan_trtllm_mxint4(layer.intermediate, layer.hidden, True, swap)


# ----------------------------------------------------------------------------- FP8 layers
def _swap(rows: int, cols_bytes: int, is_act_and_mul: bool) -> Optional[IndexMap]:
    return steps.swap_w13_to_w31_rows(rows, cols_bytes) if is_act_and_mul else None


@cached
def plan_fp8_per_tensor(
    intermediate: int,
    hidden: int,
    is_act_and_mul: bool,
    is_gated: bool,
    trtllm: bool,
    swap: bool = True,
    min_alignment: Optional[int] = None,
) -> LayerPlan:
    """FP8 per-tensor: pad I to ``min_alignment`` (None: FlashInfer's 16 gated, 128 non-gated; 1: no
    padding), swap (``swap``; a profile's ``gate_up_kept`` turns it off); TRT-LLM adds the gated
    interleave and the epilogue shuffle (tile 128)."""
    p = projections(is_act_and_mul)
    if min_alignment is None:
        min_alignment = default_alignments("fp8", "trtllm" if trtllm else "cutlass", is_act_and_mul, is_gated)[0]
    pad = plan_align(intermediate, hidden, 1, is_act_and_mul, min_alignment)
    ip = pad.padded_intermediate
    rotate = plan_rotate_fp8_per_tensor(p * ip, hidden, ip, is_gated) if trtllm else None
    return LayerPlan(
        chain(pad.w13, _swap(p * ip, hidden, is_act_and_mul and swap), rotate.w13 if rotate else None),
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
        chain(_swap(p * intermediate, hidden, is_act_and_mul), shuffle.w13 if shuffle else None),
        shuffle.w2 if shuffle else None,
        _swap(scale_rows, scale_cols_bytes, is_act_and_mul),
        None,
        intermediate,
        hidden,
        intermediate,
        hidden,
        "DeepSeek FP8 TRT-LLM" if trtllm else "DeepSeek FP8 CUTLASS",
    )


@cached
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
    """MXFP8 (UE8M0 scale per 32 values, scales follow their rows).

    TRT-LLM: pad (I 128, H 256; padded scales ``scale_fill``, default 127 = UE8M0 1.0;
    SGLang 0.5.23 writes 0), swap (``swap``; SGLang 0.5.23 keeps ``[gate; up]``), gated
    interleave, shuffle (tile 128); scales also 128x4-swizzled. CUTLASS: pad (only to the
    alignments given: ``plan_layer`` passes the profile's, 128 and 128 for FlashInfer 0.7.x,
    whose CUTLASS MXFP8 binding needs them; vLLM's ``prepare_fp8_moe_layer_for_fi`` pads
    nothing), swap weights and scales; with ``cutlass_swizzled`` the scales ``[R, C]`` then
    go through the 128x4 swizzle to ``[ceil128(R), ceil4(C)]`` (FlashInfer 0.7.x).
    """
    p = projections(is_act_and_mul)
    da, dh = default_alignments("mxfp8", "trtllm", is_act_and_mul, is_gated) if trtllm else (1, 1)
    pad = plan_align_mxfp8(
        intermediate,
        hidden,
        is_act_and_mul,
        w13_scale_cols,
        w2_scale_cols,
        intermediate_alignment or da,
        hidden_alignment or dh,
        FORMATS["mxfp8"].scale_fill if scale_fill is None else scale_fill,
    )
    ip, hp = pad.padded_intermediate, pad.padded_hidden
    block = hidden // w13_scale_cols  # checked to divide by plan_align_mxfp8
    if not trtllm:
        c13, c2 = hp // block, ip // block
        return LayerPlan(
            chain(pad.w13, _swap(p * ip, hp, is_act_and_mul)),
            pad.w2,
            chain(
                pad.w13_scale,
                _swap(p * ip, c13, is_act_and_mul),
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
        chain(pad.w13, _swap(p * ip, hp, is_act_and_mul and swap), shuffle.w13),
        chain(pad.w2, shuffle.w2),
        chain(pad.w13_scale, _swap(p * ip, hp // block, is_act_and_mul and swap), shuffle.w13_scale),
        chain(pad.w2_scale, shuffle.w2_scale),
        intermediate,
        hidden,
        ip,
        hp,
        "MXFP8 TRT-LLM",
    )


# ----------------------------------------------------------------------------- by format and backend
@dataclass(frozen=True)
class Recipe:
    """What one (format, backend) does to a layer; ``id`` is what converted files record."""

    fmt: str
    backend: str
    description: str

    @property
    def id(self) -> str:
        return recipe_id(self.fmt, self.backend)


def recipe_id(fmt: str, backend: str) -> str:
    return f"{fmt}/{backend}"


RECIPES: dict[str, Recipe] = {
    r.id: r
    for r in (
        Recipe("bf16", "trtllm", "W31 swap, gated interleave, epilogue shuffle 128, BlockMajorK 128 B"),
        Recipe("bf16", "cutlass", "W31 swap"),
        Recipe("fp8", "trtllm", "pad I, W31 swap, gated interleave, epilogue shuffle 128"),
        Recipe("fp8", "cutlass", "pad I, W31 swap"),
        Recipe("fp8-block", "trtllm", "W31 swap (weights and block scales), epilogue shuffle 64, BlockMajorK 128 B"),
        Recipe("fp8-block", "cutlass", "W31 swap (weights and block scales)"),
        Recipe("mxfp8", "trtllm", "pad I/H (scales 127), W31 swap, gated interleave, shuffle 128, scales 128x4"),
        Recipe("mxfp8", "cutlass", "W31 swap (weights and scales), scales 128x4 (0.7.x profiles)"),
        Recipe("nvfp4", "trtllm", "pad, W31 swap, gated interleave, shuffle 128, scales 128x4"),
        Recipe("nvfp4", "cutlass", "pad, W31 swap (weights and scales)"),
        Recipe("mxfp4", "trtllm", "pad, W31 swap, gated interleave, shuffle 128, scales 128x4"),
        Recipe("mxfp4", "cutlass", "pad, W31 swap (weights and scales)"),
        Recipe("mxint4", "trtllm", "W31 swap, gated interleave, shuffle 128, BlockMajorK 128 B, bf16 scales 128x4"),
    )
}


ACTIVATION_DTYPES: dict[str, tuple[str, ...]] = {"mxfp4/cutlass": ("mxfp8", "bf16")}
"""Recipes with a kernel layout per activation dtype, the default first. MXFP4 on CUTLASS: ``mxfp8`` is
the MXFP4 x MXFP8 layout (W31 swap, 128x4 scales; FlashInfer's SM100 kernel), ``bf16`` the Hopper (SM90)
mixed-input GEMM's (vLLM 0.34 ``FLASHINFER_CUTLASS_MXFP4_BF16``, SGLang 0.5.23 ``cutlass_sm90``:
:func:`plan_cutlass_mxfp4_bf16`). Every other recipe has one layout."""


def activation_layout(fmt: str, backend: str, activation_dtype: Optional[str]) -> Optional[str]:
    """``activation_dtype`` when it selects a layout other than the recipe's default, else None.

    Raises :class:`LayoutError` for a dtype the recipe ``fmt/backend`` has no layout for
    (:data:`ACTIVATION_DTYPES`)."""
    if activation_dtype is None:
        return None
    choices = ACTIVATION_DTYPES.get(recipe_id(fmt, backend), ())
    if activation_dtype not in choices:
        pairs = ", ".join(f"{r} ({'/'.join(c)})" for r, c in ACTIVATION_DTYPES.items())
        raise LayoutError(
            f"{fmt} on {backend} has no layout chosen by activation dtype {activation_dtype!r}",
            fix=f"activation_dtype applies to {pairs} only; leave it None otherwise",
        )
    return None if activation_dtype == choices[0] else activation_dtype


def plan_layer(
    fmt: str,
    backend: str,
    intermediate: int,
    hidden: int,
    is_act_and_mul: bool = True,
    is_gated: bool = True,
    intermediate_alignment: Optional[int] = None,
    hidden_alignment: Optional[int] = None,
    engine: Optional[str] = None,
    per_token_activation: bool = False,
    activation_dtype: Optional[str] = None,
    quant_method: Optional[str] = None,
) -> LayerPlan:
    """The layer plan for a checkpoint format and FlashInfer backend, from sizes alone: :func:`plan_for` of
    the arguments as values (:class:`~fimoe_lab.choice.LayerShape`, :class:`~fimoe_lab.choice.LayoutChoice`).

    ``intermediate``/``hidden`` are the per-rank checkpoint sizes (values). Alignments
    default to :func:`default_alignments` of ``engine`` (a profile in
    :mod:`fimoe_lab.engines`; None: the default engine), as do the padded scale bytes and
    the CUTLASS FP4 scale layout; pass other alignments to try what the tuner recommends.
    ``per_token_activation``: NVFP4 activations quantised per token (the profile's
    per-token hidden alignment applies, e.g. vLLM's 512 for a non-gated layer on TRT-LLM).
    ``activation_dtype``: the activations the kernel takes, where a recipe has a layout for more than
    one (:data:`ACTIVATION_DTYPES`; None: the recipe's default): ``"bf16"`` for MXFP4 on CUTLASS is the
    Hopper (SM90) mixed-input layout, :func:`plan_cutlass_mxfp4_bf16` (alignments default to 128).
    ``quant_method``: the checkpoint's quantization method (:data:`fimoe_lab.engines.QUANT_METHODS`, what its
    convention's writer records; None: unknown), for the profile rules keyed on it (SGLang 0.5.23 swaps W13's
    halves of ModelOpt FP8 per-tensor layers on TRT-LLM, not of other FP8 ones); it never changes the sizes.
    """
    layer = LayerShape(fmt, intermediate, hidden, is_act_and_mul, is_gated, quant_method)
    choice = LayoutChoice(
        backend, intermediate_alignment, hidden_alignment, engine, per_token_activation, activation_dtype
    )
    return plan_for(layer, choice)


@cached
def plan_for(layer: LayerShape, choice: LayoutChoice) -> LayerPlan:
    """:func:`plan_layer` of the two values: the plan of ``choice``'s recipe for ``layer.fmt``, its padded sizes
    checked against ``shapes.layer_shape`` (the one rule the tuner also reads)."""
    fmt, backend = layer.fmt, choice.backend
    check_quant_method(layer.quant_method)
    get_engine(choice.engine).check_prepared(fmt, backend, layer.quant_method)
    if activation_layout(fmt, backend, choice.activation_dtype) == "bf16":
        return _plan_sm90_mixed(layer, choice)
    if fmt == "mxint4":  # its own rule (no padding, TRT-LLM only): plan_mxint4
        return plan_mxint4(layer, choice)
    return _padded_as(layer_shape(layer, choice), _build_layer_plan(layer, choice), f"{fmt}/{backend}")


def _padded_as(want: tuple[int, int], plan: LayerPlan, what: str) -> LayerPlan:
    """``plan``, whose padded sizes must be ``want`` (``shapes.layer_shape``'s): an internal error otherwise."""
    if (plan.padded_intermediate, plan.padded_hidden) != want:
        raise LayoutError(
            f"internal: the {what} plan pads ({plan.intermediate}, {plan.hidden}) to "
            f"({plan.padded_intermediate}, {plan.padded_hidden}), shapes.padded_shape says {want}"
        )
    return plan


def _plan_sm90_mixed(layer: LayerShape, choice: LayoutChoice) -> LayerPlan:
    """:func:`plan_cutlass_mxfp4_bf16` with ``plan_layer``'s arguments, its sizes checked against
    ``shapes.layer_shape`` (the one padding rule) with the same alignments (default 128)."""
    ia = choice.intermediate_alignment or SM90_MIXED_ALIGNMENT
    ha = choice.hidden_alignment or SM90_MIXED_ALIGNMENT
    aligned = LayoutChoice("cutlass", ia, ha, choice.engine)
    want = layer_shape(replace(layer, fmt="mxfp4", quant_method=None), aligned)
    plan = plan_cutlass_mxfp4_bf16(layer.intermediate, layer.hidden, layer.is_act_and_mul, choice.engine, ia, ha)
    return _padded_as(want, plan, "SM90 MXFP4 x BF16")


def _build_layer_plan(layer: LayerShape, choice: LayoutChoice) -> LayerPlan:
    fmt, backend, intermediate, hidden = layer.fmt, choice.backend, layer.intermediate, layer.hidden
    is_act_and_mul, is_gated = layer.is_act_and_mul, layer.is_gated
    intermediate_alignment, hidden_alignment = choice.intermediate_alignment, choice.hidden_alignment
    profile = get_engine(choice.engine)
    trt = backend == "trtllm"
    swap = not profile.keeps_gate_up(fmt, backend, layer.quant_method)
    if trt and recipe_id(fmt, backend) in profile.trtllm_plain:  # unshuffled MajorK (use_shuffled_weight=False)
        if not swap:
            desc = f"{fmt} TRT-LLM in the checkpoint layout (use_shuffled_weight=False)"
            return LayerPlan(None, None, None, None, intermediate, hidden, intermediate, hidden, desc)
        inner = _fp8_inner(fmt, False, intermediate, hidden, is_act_and_mul, is_gated, 0, True)
        return replace(inner, description=f"{fmt} TRT-LLM MajorK unshuffled (W31 swap only)")
    resolved = replace(choice, engine=profile.name)
    if fmt == "mxfp8" and (trt or not (intermediate_alignment or hidden_alignment)):
        da, dh = choice_alignments(layer, replace(resolved, per_token_activation=False))
        block = FORMATS["mxfp8"].scale_block
        return plan_mxfp8(
            intermediate,
            hidden,
            is_act_and_mul,
            is_gated,
            trt,
            hidden // block,
            intermediate // block,
            intermediate_alignment or da,
            hidden_alignment or dh,
            scale_fill(fmt, backend, profile.name),
            swap,
            profile.cutlass_mxfp8_scales == "128x4",
        )
    if fmt in ("fp8", "fp8-block", "mxfp8"):
        rule = profile.alignment(fmt, backend, layer.quant_method)
        if not (intermediate_alignment or hidden_alignment) and (rule.intermediate or rule.hidden):
            intermediate_alignment, hidden_alignment = rule.intermediate, rule.hidden
        return _plan_fp8_family(
            fmt,
            trt,
            intermediate,
            hidden,
            is_act_and_mul,
            is_gated,
            intermediate_alignment,
            hidden_alignment,
            scale_fill(fmt, backend, profile.name),
            swap,
        )
    da, dh = choice_alignments(layer, resolved)
    ia, ha = intermediate_alignment or da, hidden_alignment or dh
    if fmt == "bf16":
        return _plan_bf16(trt, intermediate, hidden, is_act_and_mul, is_gated, ia, ha, swap)
    return _plan_fp4(fmt, backend, profile.name, intermediate, hidden, is_act_and_mul, is_gated, ia, ha)


def _plan_bf16(
    trt: bool, intermediate: int, hidden: int, is_act_and_mul: bool, is_gated: bool, ia: int, ha: int, swap: bool
) -> LayerPlan:
    """BF16: pad (each projection on its own), then TRT-LLM's block layout or CUTLASS's W31 swap."""
    p = projections(is_act_and_mul)
    pad = plan_align(intermediate, hidden, 2, is_act_and_mul, ia, ha)
    ip, hp = pad.padded_intermediate, pad.padded_hidden
    if trt:
        inner = plan_trtllm_bf16_block_layout(p * ip, hp, ip, is_gated, swap=swap)
        w13, w2 = inner.w13, inner.w2
    else:
        w13, w2 = _swap(p * ip, 2 * hp, is_act_and_mul), None
    return LayerPlan(
        chain(pad.w13, w13),
        chain(pad.w2, w2),
        None,
        None,
        intermediate,
        hidden,
        ip,
        hp,
        f"BF16 {'TRT-LLM block layout' if trt else 'CUTLASS'}",
    )


def _plan_fp4(
    fmt: str,
    backend: str,
    engine: str,
    intermediate: int,
    hidden: int,
    is_act_and_mul: bool,
    is_gated: bool,
    ia: int,
    ha: int,
) -> LayerPlan:
    """NVFP4 / MXFP4: pad (scales with the profile's byte), then TRT-LLM's steps or CUTLASS's
    W31 swap and (in every profile but the legacy one) 128x4-swizzled scales."""
    p, trt = projections(is_act_and_mul), backend == "trtllm"
    block = FORMATS[fmt].scale_block
    pad = plan_align_fp4(intermediate, hidden, is_act_and_mul, ia, ha, block, scale_fill(fmt, backend, engine))
    ip, hp = pad.padded_intermediate, pad.padded_hidden
    name = f"{fmt.upper()} {'TRT-LLM' if trt else 'CUTLASS'}"
    if not trt:
        swizzled = get_engine(engine).cutlass_fp4_scales == "128x4"
        w13s = _cutlass_fp4_scales(
            pad.w13_scale, _swap(p * ip, hp // block, is_act_and_mul), p * ip, hp // block, swizzled
        )
        w2s = _cutlass_fp4_scales(pad.w2_scale, None, hp, ip // block, swizzled)
        w13 = chain(pad.w13, _swap(p * ip, hp // 2, is_act_and_mul))
        return LayerPlan(w13, pad.w2, w13s, w2s, intermediate, hidden, ip, hp, name)
    inner = plan_fp4_trtllm_weights(ip, hp, is_act_and_mul, is_gated, block)
    return LayerPlan(
        chain(pad.w13, inner.w13),
        chain(pad.w2, inner.w2),
        chain(pad.w13_scale, inner.w13_scale),
        chain(pad.w2_scale, inner.w2_scale),
        intermediate,
        hidden,
        ip,
        hp,
        name,
    )


def _cutlass_fp4_scales(
    pad: Optional[IndexMap], swap: Optional[IndexMap], rows: int, cols: int, swizzled: bool
) -> Optional[IndexMap]:
    """CUTLASS FP4 block scales ``[rows, cols]`` (after padding): pad, W31 swap, then the 128x4
    swizzle to ``[ceil128(rows), ceil4(cols)]``.

    The CUTLASS kernel reads NVFP4 / MXFP4 (also with MXFP8 activations) block scales in
    the 128x4-swizzled layout: vLLM swizzles them (``swizzle_blockscale``) and SGLang likewise
    after padding and the W31 swap; FlashInfer 0.7.4's ``prepare_cutlass_nvfp4_weights``
    quantises with ``is_sf_swizzled_layout=True`` and ``prepare_cutlass_mxfp8_mxfp4_weights``
    with ``mxfp4_quantize``'s default ``SfLayout.layout_128x4`` (fused_moe/prepare.py), per
    expert, which is the byte layout matched here. ``swizzled`` False: the legacy linear layout.
    """
    if not swizzled:
        return chain(pad, swap)
    return present(chain(pad, swap, steps.swizzle_scales_128x4(rows, cols)))


def _fp8_inner(
    fmt: str,
    trt: bool,
    intermediate: int,
    hidden: int,
    is_act_and_mul: bool,
    is_gated: bool,
    fill: int,
    swap: bool,
    fp8_min_alignment: Optional[int] = None,
) -> LayerPlan:
    p = projections(is_act_and_mul)
    if fmt == "fp8":
        return plan_fp8_per_tensor(intermediate, hidden, is_act_and_mul, is_gated, trt, swap, fp8_min_alignment)
    if fmt == "mxfp8":
        block = FORMATS["mxfp8"].scale_block
        return plan_mxfp8(
            intermediate, hidden, is_act_and_mul, is_gated, trt, hidden // block, intermediate // block, scale_fill=fill
        )
    rows = FORMATS["fp8-block"].scale_block_rows
    cols = FORMATS["fp8-block"].scale_block
    scale_bytes = FORMATS["fp8-block"].scale_itemsize
    return plan_fp8_block(
        intermediate, hidden, is_act_and_mul, trt, -(-p * intermediate // rows), -(-hidden // cols) * scale_bytes, rows
    )


def _plan_fp8_family(
    fmt: str,
    trt: bool,
    intermediate: int,
    hidden: int,
    is_act_and_mul: bool,
    is_gated: bool,
    intermediate_alignment: Optional[int],
    hidden_alignment: Optional[int],
    fill: int,
    swap: bool = True,
) -> LayerPlan:
    """FP8 per-tensor, DeepSeek FP8 block and MXFP8, with optional extra padding of the weights
    first; ``fill``: the byte of padded MXFP8 scales; ``swap``: FP8 per-tensor's W31 swap."""
    if not (intermediate_alignment or hidden_alignment):
        return _fp8_inner(fmt, trt, intermediate, hidden, is_act_and_mul, is_gated, fill, swap)
    padded = plan_align(intermediate, hidden, 1, is_act_and_mul, intermediate_alignment or 1, hidden_alignment or 1)
    if padded.w13 is not None and fmt != "fp8":
        raise LayoutError(f"custom alignments for {fmt} scales are not supported yet", fix="use the default rules")
    ip, hp = padded.padded_intermediate, padded.padded_hidden
    # an intermediate alignment given replaces FP8 per-tensor's own minimum (1: no padding)
    inner = _fp8_inner(fmt, trt, ip, hp, is_act_and_mul, is_gated, fill, swap, 1 if intermediate_alignment else None)
    return LayerPlan(
        chain(padded.w13, inner.w13),
        chain(padded.w2, inner.w2),
        inner.w13_scale,
        inner.w2_scale,
        intermediate,
        hidden,
        inner.padded_intermediate,
        inner.padded_hidden,
        inner.description,
    )


# ----------------------------------------------------------------------------- SM90 MXFP4 x BF16
SM90_MIXED_ALIGNMENT = 128
"""I and H multiple of the SM90 MXFP4 x BF16 CUTLASS MoE: vLLM 0.34 (``FLASHINFER_CUTLASS_MXFP4_BF16``) and SGLang
0.5.23 (``cutlass_sm90``) both pad to 128 (the scale folding needs rows % 64 and K % 128)."""


@cached
def plan_cutlass_mxfp4_bf16(
    intermediate: int,
    hidden: int,
    is_act_and_mul: bool = True,
    engine: Optional[str] = None,
    intermediate_alignment: int = SM90_MIXED_ALIGNMENT,
    hidden_alignment: int = SM90_MIXED_ALIGNMENT,
) -> LayerPlan:
    """MXFP4 weights with BF16 activations on the Hopper (SM90) CUTLASS MoE, as the engines prepare them.

    vLLM 0.34 (``oracle/mxfp4.py``, ``FLASHINFER_CUTLASS_MXFP4_BF16``) and SGLang 0.5.23
    (``_process_weights_for_sm90_cutlass``): pad ``I``/``H`` to their alignments (weights and scales 0,
    each projection on its own), W31 swap of W13 and its scales, then on both weights FlashInfer's
    ``interleave_moe_weights_for_sm90_mixed_gemm(w, "fp4")`` (:func:`steps.sm90_mixed_weight_map`,
    layout ``profile.sm90_mixed_layout``) and on both scales ``interleave_moe_scales_for_sm90_mixed_gemm``
    (0.6.16 layout: :func:`steps.fold_scales_sm90_mixed` ``[R, K/32] -> [R/64, K/128, 16, 16]``; 0.6.10
    layout: :func:`steps.block_major_k` with 4-byte blocks, ``[R, K/32] -> [K/128, R, 4]``). Shapes:
    W13 ``[P*I, H/2]``, W2 ``[H, I/2]`` bytes, scales ``[P*I, H/32]``, ``[H, I/32]``.

    A :class:`LayerPlan` whose weights end in the byte step :func:`steps.interleave_sm90_mixed_weights`
    and carry the word bit step :func:`steps.sm90_mixed_word_bits` (``word_bits``, run after the byte
    maps, undone first by the inverse); a per-row bias follows the pad and W31 swap only, as in vLLM.
    """
    profile = get_engine(engine)
    p, block = projections(is_act_and_mul), FORMATS["mxfp4"].scale_block
    pad = plan_align_fp4(intermediate, hidden, is_act_and_mul, intermediate_alignment, hidden_alignment, block, 0)
    ip, hp = pad.padded_intermediate, pad.padded_hidden
    layout = profile.sm90_mixed_layout

    def weights(rows: int, cols_bytes: int) -> IndexMap:
        return steps.interleave_sm90_mixed_weights(rows, cols_bytes, "fp4")

    def scales(rows: int, cols: int) -> IndexMap:
        if layout == "0.6.10":
            return steps.block_major_k(rows, cols, 128 // block)
        return steps.fold_scales_sm90_mixed(rows, cols, 1, block)

    w13 = present(chain(pad.w13, _swap(p * ip, hp // 2, is_act_and_mul), weights(p * ip, hp // 2)))
    w2 = present(chain(pad.w2, weights(hp, ip // 2)))
    s13 = chain(pad.w13_scale, _swap(p * ip, hp // block, is_act_and_mul), scales(p * ip, hp // block))
    s2 = chain(pad.w2_scale, scales(hp, ip // block))
    desc = f"MXFP4 x BF16 SM90 CUTLASS ({profile.name}, FlashInfer {layout} interleave)"
    bits = steps.sm90_mixed_word_bits("fp4", layout)
    return LayerPlan(w13, w2, s13, s2, intermediate, hidden, ip, hp, desc, word_bits={"w13": bits, "w2": bits})
