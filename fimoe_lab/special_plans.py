"""The two layouts with a rule of their own: MxInt4 on TRT-LLM and MXFP4 with BF16 activations on SM90 CUTLASS.

MxInt4 is laid out from int4-group checkpoints (no checkpoint format of its name, no padding: its sizes
are :func:`fimoe_lab.shapes.mxint4_shape`'s); the SM90 mixed-input layout is chosen by the activation
dtype (:data:`fimoe_lab.recipes.ACTIVATION_DTYPES`) and ends in a word bit step. Both compose the steps
of :mod:`fimoe_lab.steps` with the padding builders of :mod:`fimoe_lab.builders`.
"""

from __future__ import annotations

from typing import Optional

from fimoe_lab import steps
from fimoe_lab.builders import (
    BLOCK_MAJOR_K_BYTES,
    TRTLLM_EPILOGUE_TILE_M,
    chain,
    plan_pad_fp4,
    present,
    swap_rows,
)
from fimoe_lab.caches import cached
from fimoe_lab.choice import LayerShape, LayoutChoice
from fimoe_lab.engines import get_engine
from fimoe_lab.errors import LayoutError
from fimoe_lab.layout import IndexMap
from fimoe_lab.plan import LayerPlan
from fimoe_lab.shapes import mxint4_shape, projections, round_up
from fimoe_lab.specs import FORMATS

__all__ = [
    "MXINT4_SCALE_BLOCK",
    "plan_trtllm_mxint4",
    "plan_mxint4",
    "SM90_MIXED_ALIGNMENT",
    "plan_cutlass_mxfp4_bf16",
    "plan_cutlass_mxfp4_bf16_padded",
]

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


# ----------------------------------------------------------------------------- SM90 MXFP4 x BF16
SM90_MIXED_ALIGNMENT = 128
"""I and H multiple of the SM90 MXFP4 x BF16 CUTLASS MoE: vLLM 0.34 (``FLASHINFER_CUTLASS_MXFP4_BF16``) and SGLang
0.5.23 (``cutlass_sm90``) both pad to 128 (the scale folding needs rows % 64 and K % 128)."""


def plan_cutlass_mxfp4_bf16(
    intermediate: int,
    hidden: int,
    is_act_and_mul: bool = True,
    engine: Optional[str] = None,
    intermediate_alignment: int = SM90_MIXED_ALIGNMENT,
    hidden_alignment: int = SM90_MIXED_ALIGNMENT,
) -> LayerPlan:
    """:func:`plan_cutlass_mxfp4_bf16_padded` with ``(I, H)`` padded to the alignments (both engines: 128)."""
    padded = round_up(intermediate, intermediate_alignment), round_up(hidden, hidden_alignment)
    return plan_cutlass_mxfp4_bf16_padded(intermediate, hidden, *padded, is_act_and_mul, engine)


@cached
def plan_cutlass_mxfp4_bf16_padded(
    intermediate: int,
    hidden: int,
    padded_intermediate: int,
    padded_hidden: int,
    is_act_and_mul: bool = True,
    engine: Optional[str] = None,
) -> LayerPlan:
    """MXFP4 weights with BF16 activations on the Hopper (SM90) CUTLASS MoE, as the engines prepare them.

    vLLM 0.34 (``oracle/mxfp4.py``, ``FLASHINFER_CUTLASS_MXFP4_BF16``) and SGLang 0.5.23
    (``_process_weights_for_sm90_cutlass``): pad ``(I, H)`` to ``(I', H')`` (weights and scales 0,
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
    pad = plan_pad_fp4(intermediate, hidden, padded_intermediate, padded_hidden, is_act_and_mul, block, 0)
    ip, hp = pad.padded_intermediate, pad.padded_hidden
    layout = profile.sm90_mixed_layout

    def weights(rows: int, cols_bytes: int) -> IndexMap:
        return steps.interleave_sm90_mixed_weights(rows, cols_bytes, "fp4")

    def scales(rows: int, cols: int) -> IndexMap:
        if layout == "0.6.10":
            return steps.block_major_k(rows, cols, 128 // block)
        return steps.fold_scales_sm90_mixed(rows, cols, 1, block)

    w13 = present(chain(pad.w13, swap_rows(p * ip, hp // 2, is_act_and_mul), weights(p * ip, hp // 2)))
    w2 = present(chain(pad.w2, weights(hp, ip // 2)))
    s13 = chain(pad.w13_scale, swap_rows(p * ip, hp // block, is_act_and_mul), scales(p * ip, hp // block))
    s2 = chain(pad.w2_scale, scales(hp, ip // block))
    desc = f"MXFP4 x BF16 SM90 CUTLASS ({profile.name}, FlashInfer {layout} interleave)"
    bits = steps.sm90_mixed_word_bits("fp4", layout)
    return LayerPlan(w13, w2, s13, s2, intermediate, hidden, ip, hp, desc, word_bits={"w13": bits, "w2": bits})
