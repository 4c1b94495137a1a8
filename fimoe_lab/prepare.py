"""Drop-in replacements for vLLM's ``flashinfer_utils`` MoE preparation functions.

Every function keeps the reference's name, arguments and results, and runs on CPU
and CUDA with or without FlashInfer. Each one is a thin shell around a ``plan_*``
function that returns the :class:`~fimoe_lab.plan.LayerPlan` (the index maps): the
plan is what the executors run, the lab draws, and what ``plan.inverse()`` undoes.

Shapes: ``w13`` ``(E, P*I, H)`` with P = 2 for fused gate/up (``is_act_and_mul``), else
1; ``w2`` ``(E, H, I)``. FP8 weights are 1 byte, BF16 2 bytes, packed FP4 holds two
values per byte (``(E, P*I, H/2)``, ``(E, H, I/2)``).

About 800 lines on purpose: the module mirrors the reference module function for function, so that
each drop-in sits where vLLM's users look for it; every function is a short shell around a plan builder.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, TypeVar

import torch

from fimoe_lab import builders, engines, plan_store, recipes, steps, value_rules
from fimoe_lab import compile as _compile  # noqa: F401 - loaded with the drop-ins, not on their first call
from fimoe_lab.builders import (
    plan_fp4_trtllm_weights,
    plan_rotate_fp8_per_tensor,
    plan_shuffle_deepseek_fp8,
    plan_shuffle_mxfp8,
    plan_trtllm_bf16_block_layout,
    trtllm_nvfp4_hidden_alignment,
)
from fimoe_lab.caches import cached
from fimoe_lab.errors import FimoeError, LayoutError
from fimoe_lab.formats.nvfp4_per_token import NVFP4_PER_TOKEN_BASE_GLOBAL_SCALE, quantize_nvfp4_per_token_input
from fimoe_lab.kernels import copy_then_gather as _copy_then_gather  # noqa: F401 - likewise (~1 ms)
from fimoe_lab.kernels import execute_in_place, plans_after_the_call
from fimoe_lab.kernels import prebuilt as _prebuilt  # noqa: F401 - likewise (its imports cost a first call ~5 ms)
from fimoe_lab.kernels import torch_gather as _torch_gather  # noqa: F401 - likewise
from fimoe_lab.layout import IndexMap
from fimoe_lab.plan import LayerPlan, apply_map, check_same_device
from fimoe_lab.recipes import plan_layer
from fimoe_lab.specs import BACKENDS, FORMATS, weight_formats  # noqa: F401 (re-exported for callers)

__all__ = [
    "MoELayerSpec",
    "NVFP4_PER_TOKEN_BASE_GLOBAL_SCALE",
    "FI_CUTLASS_MIN_BLOCK_SCALE",
    "align_fp4_moe_weights_for_fi",
    "align_fp4_moe_hidden_dim_for_fi",
    "pad_trtllm_moe_weights",
    "interleave_cute_dsl_moe_weights",
    "deinterleave_gated_rows",
    "interleave_moe_scales_for_sm90_mixed_gemm",
    "interleave_moe_weights_for_sm90_mixed_gemm",
    "TrtllmMoePaddedWeights",
    "align_moe_weights_for_fi",
    "align_mxfp8_moe_weights_for_fi_trtllm",
    "convert_moe_weights_to_flashinfer_trtllm_block_layout",
    "drop_in_maps",
    "permute_cache_keys",
    "permute_in_place",
    "prepare_fp8_moe_layer_for_fi",
    "quantize_nvfp4_per_token_input",
    "rotate_weights_for_fi_trtllm_fp8_per_tensor_moe",
    "shuffle_deepseek_fp8_moe_weights",
    "shuffle_mxfp8_moe_weights",
    "swap_w13_to_w31",
    "trtllm_nvfp4_hidden_alignment",
    "plan_align_moe_weights",
    "plan_align_fp4_moe_weights",
    "plan_align_mxfp8_moe_weights",
    "plan_fp8_moe_layer",
    "plan_trtllm_bf16_block_layout",
    "plan_rotate_fp8_per_tensor",
    "plan_shuffle_deepseek_fp8",
    "plan_shuffle_mxfp8",
    "plan_fp4_trtllm_weights",
    "plan_layer",
    "BACKENDS",
]

FI_CUTLASS_MIN_BLOCK_SCALE = engines.VLLM_MIN_BLOCK_SCALE
"""Floor for FP8 block scales: dead experts with ~1e-23 scales made the Hopper CUTLASS MoE emit NaN."""

MXFP8_INTERMEDIATE_ALIGNMENT, MXFP8_HIDDEN_ALIGNMENT = recipes.default_alignments("mxfp8", "trtllm")


# --------------------------------------------------------------------------- layers
@dataclass
class MoELayerSpec:
    """The few facts about an MoE layer the preparation needs (our typed layer).

    ``is_act_and_mul``: W13 stacks gate and up (``2I`` rows). ``is_gated``: the
    activation is gated (SwiGLU; ReLU^2 is not). ``weight_block_size``: ``None`` for
    per-tensor FP8, ``[128, 128]`` for DeepSeek FP8, ``[1, 32]`` for MXFP8.
    Preparation updates ``intermediate_size_per_partition``/``hidden_dim`` in place.
    """

    intermediate_size_per_partition: int
    hidden_dim: int
    is_act_and_mul: bool = True
    is_gated: bool = True
    weight_block_size: Optional[list[int]] = None


class _LayerAccess:
    """Reads and writes the same facts on a :class:`MoELayerSpec` or a vLLM-like layer."""

    def __init__(self, layer: Any):
        self.layer = layer
        if isinstance(layer, MoELayerSpec):
            self.is_act_and_mul = layer.is_act_and_mul
            self.is_gated = layer.is_gated
            self.block_size = layer.weight_block_size
            return
        config = getattr(layer, "moe_config", None)
        if config is None or not hasattr(config, "is_act_and_mul"):
            raise LayoutError(
                f"{type(layer).__name__} has no moe_config.is_act_and_mul; pass a vLLM FusedMoE layer "
                f"or a fimoe_lab.prepare.MoELayerSpec"
            )
        activation = getattr(layer, "activation", None)
        if activation is None or not hasattr(activation, "is_gated"):
            raise LayoutError(f"{type(layer).__name__} has no activation.is_gated; cannot tell gated from non-gated")
        self.is_act_and_mul = bool(config.is_act_and_mul)
        self.is_gated = bool(activation.is_gated)
        self.block_size = getattr(layer, "weight_block_size", None)

    def set_sizes(self, intermediate: int, hidden: Optional[int] = None) -> None:
        target = self.layer if isinstance(self.layer, MoELayerSpec) else self.layer.moe_config
        target.intermediate_size_per_partition = intermediate
        if hidden is not None:
            target.hidden_dim = hidden


# --------------------------------------------------------------------------- checks
_projections = recipes.projections
F = TypeVar("F", bound=Callable[..., Any])


def _boundary(fn: F) -> F:
    """Public drop-in: a :class:`FimoeError` raised anywhere below gets this function's name as context; the
    background planner is asked for the maps' plans after the call (:data:`~fimoe_lab.kernels.plans_after_the_call`)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with plans_after_the_call:  # the planner starts once the whole layer's launches are queued
                return fn(*args, **kwargs)
        except FimoeError as exc:
            raise exc.within(fn.__name__) from None

    return wrapper  # type: ignore[return-value]


def _check_w13_w2(
    w13: torch.Tensor, w2: torch.Tensor, is_act_and_mul: bool, packed_fp4: bool = False
) -> tuple[int, int, int]:
    """Return ``(E, intermediate, hidden)`` in values (not bytes); raise on mismatched shapes."""
    check_same_device(w13=w13, w2=w2)
    if w13.ndim != 3 or w2.ndim != 3:
        raise LayoutError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} must both be 3-D (experts, rows, cols)")
    per_byte = 2 if packed_fp4 else 1
    num_experts, hidden, intermediate = w2.shape[0], w2.shape[1], w2.shape[2] * per_byte
    p = _projections(is_act_and_mul)
    expected = (num_experts, p * intermediate, hidden // per_byte)
    if tuple(w13.shape) != expected:
        layout = "[gate; up] stacked" if is_act_and_mul else "a single projection"
        raise LayoutError(
            f"w13 has shape {tuple(w13.shape)} but w2 {tuple(w2.shape)} implies {expected} "
            f"(is_act_and_mul={is_act_and_mul}: {layout}, intermediate={intermediate}, hidden={hidden}"
            f"{', two FP4 values per byte' if packed_fp4 else ''})"
        )
    return num_experts, intermediate, hidden


def _check_nvfp4_scales(
    w13_scale: torch.Tensor, w2_scale: torch.Tensor, experts: int, p: int, intermediate: int, hidden: int
) -> None:
    """NVFP4 block scales, one per 16 values: ``w13_scale (E, P*I, H/16)``, ``w2_scale (E, H, I/16)``."""
    for name, t, shape in (
        ("w13_scale", w13_scale, (experts, p * intermediate, hidden // 16)),
        ("w2_scale", w2_scale, (experts, hidden, intermediate // 16)),
    ):
        if tuple(t.shape) != shape:
            raise LayoutError(f"{name} has shape {tuple(t.shape)}, expected {shape} (one scale per 16 FP4 values)")


def _check_fp8_weights(**weights: torch.Tensor) -> None:
    """Same device, 3-D ``(experts, rows, cols)``, 1-byte elements."""
    check_same_device(**weights)
    for name, t in weights.items():
        if t.ndim != 3:
            raise LayoutError(f"{name} must be (experts, rows, cols), got {tuple(t.shape)}")
        if t.element_size() != 1:
            raise LayoutError(f"{name} must be FP8 E4M3 (1-byte elements), got {t.dtype}")


def _scale_cols(scale: torch.Tensor, rows: int, name: str) -> int:
    """Columns of a block-scale matrix given 3-D ``(E, rows, cols)`` or flattened ``(E, rows*cols)``."""
    if scale.ndim not in (2, 3):
        raise LayoutError(
            f"{name} has shape {tuple(scale.shape)}; expected (E, rows, cols) or flattened (E, rows*cols)"
        )
    if scale.ndim == 3 and scale.shape[1] != rows:
        raise LayoutError(f"{name} has {scale.shape[1]} rows ({tuple(scale.shape)}), but its weight has {rows} rows")
    per_expert = scale[0].numel() if scale.shape[0] else 0
    if per_expert == 0 or per_expert % rows:
        raise LayoutError(
            f"{name} has shape {tuple(scale.shape)}: {per_expert} scales per expert is not a multiple of "
            f"the weight's {rows} rows"
        )
    return per_expert // rows


# --------------------------------------------------------------------------- alignment
plan_align_moe_weights = builders.plan_align


@_boundary
def align_moe_weights_for_fi(
    w13: torch.Tensor, w2: torch.Tensor, is_act_and_mul: bool, min_alignment: int = recipes.FI_MOE_INTERMEDIATE_MULTIPLE
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Pad the intermediate size to a multiple of ``min_alignment`` (gate and up separately).

    FlashInfer MoE kernels need the per-partition intermediate size divisible by 16
    (gated) or 128 (non-gated); tensor parallelism often breaks that (e.g. 1856 / 8).
    Returns ``(w13 (E, P*Ip, H), w2 (E, H, Ip), Ip)``; the inputs when already aligned.
    """
    _, intermediate, hidden = _check_w13_w2(w13, w2, is_act_and_mul)
    plan = plan_align_moe_weights(
        intermediate, hidden, w13.element_size(), is_act_and_mul, min_alignment, description="align_moe_weights_for_fi"
    )
    out13, out2, _, _ = plan.apply(w13, w2)
    return out13, out2, plan.padded_intermediate


plan_align_fp4_moe_weights = builders.plan_align_fp4


@_boundary
def align_fp4_moe_weights_for_fi(
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    is_act_and_mul: bool,
    min_alignment: int = recipes.FI_MOE_INTERMEDIATE_MULTIPLE,
):
    """Pad packed-FP4 weights and their per-16 block scales along the intermediate dim.

    ``w13 (E, P*I, H/2)``, ``w13_scale (E, P*I, H/16)``, ``w2 (E, H, I/2)``,
    ``w2_scale (E, H, I/16)``; padded weights and scales are 0. Returns
    ``(w13, w13_scale, w2, w2_scale, Ip)``.
    """
    _, intermediate, hidden = _check_w13_w2(w13, w2, is_act_and_mul, packed_fp4=True)
    check_same_device(w13=w13, w2=w2, w13_scale=w13_scale, w2_scale=w2_scale)
    _check_nvfp4_scales(w13_scale, w2_scale, w2.shape[0], _projections(is_act_and_mul), intermediate, hidden)
    plan = plan_align_fp4_moe_weights(intermediate, hidden, is_act_and_mul, min_alignment)
    o13, o2, o13s, o2s = plan.apply(w13, w2, w13_scale, w2_scale)
    return o13, o13s, o2, o2s, plan.padded_intermediate


@_boundary
def align_fp4_moe_hidden_dim_for_fi(
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    min_alignment: int = 256,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """vLLM 0.34's NVFP4 hidden padding: ``H -> Hp = ceil(H, min_alignment)`` with zeros.

    ``w13 (E, R, H/2)`` and ``w13_scale (E, R, H/16)`` grow columns (R = I or 2I rows, left
    as they are); ``w2 (E, H, I/2)`` and ``w2_scale (E, H, I/16)`` grow rows. Returns
    ``(w13, w13_scale, w2, w2_scale, Hp)``; the inputs when already aligned.
    """
    check_same_device(w13=w13, w2=w2, w13_scale=w13_scale, w2_scale=w2_scale)
    if w13.ndim != 3 or w2.ndim != 3:
        raise LayoutError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} must both be 3-D (experts, rows, cols)")
    intermediate, hidden = w2.shape[2] * 2, w13.shape[2] * 2
    is_act_and_mul = w13.shape[1] == 2 * intermediate
    _check_w13_w2(w13, w2, is_act_and_mul, packed_fp4=True)
    _check_nvfp4_scales(w13_scale, w2_scale, w2.shape[0], _projections(is_act_and_mul), intermediate, hidden)
    plan = plan_align_fp4_moe_weights(intermediate, hidden, is_act_and_mul, 1, min_alignment)
    if plan.padded_hidden == hidden:
        return w13, w13_scale, w2, w2_scale, hidden
    o13, o2, o13s, o2s = plan.apply(w13, w2, w13_scale, w2_scale)
    return o13, o13s, o2, o2s, plan.padded_hidden


class TrtllmMoePaddedWeights(NamedTuple):
    """What :func:`pad_trtllm_moe_weights` returns (FlashInfer 0.7.x's fields): the padded tensors,
    the padded sizes, and the valid (original) sizes to pass as ``valid_hidden_size`` /
    ``valid_intermediate_size``."""

    gemm1_weights: torch.Tensor
    gemm1_weights_scale: torch.Tensor
    gemm2_weights: torch.Tensor
    gemm2_weights_scale: torch.Tensor
    hidden_size: int
    intermediate_size: int
    valid_hidden_size: int
    valid_intermediate_size: int


@_boundary
def pad_trtllm_moe_weights(
    gemm1_weights: torch.Tensor,
    gemm1_weights_scale: torch.Tensor,
    gemm2_weights: torch.Tensor,
    gemm2_weights_scale: torch.Tensor,
    hidden_size: int,
    intermediate_size: int,
    *,
    is_gated_act: bool = True,
    hidden_alignment: int = 512,
    intermediate_alignment: int = 128,
) -> TrtllmMoePaddedWeights:
    """FlashInfer 0.7.x's padding of block-scaled TRT-LLM MoE weights (drop-in, same signature).

    Linear (unshuffled) 1-byte tensors: ``gemm1 (E, F*I, H/epb)``, its scales ``(E, F*I, H/sf)``,
    ``gemm2 (E, H, I/epb)``, its scales ``(E, H, I/sf)``; F = 2 if ``is_gated_act``; epb 1 or 2
    values per byte, sf 16 (NVFP4) or 32 (MX). The padding is
    :func:`fimoe_lab.builders.plan_pad_trtllm_moe_weights` (gate and up each on its own, W2 rows
    to ``ceil(H, 128)``, scales padded with 1.0: 0x38 / 127).
    """
    check_same_device(
        gemm1_weights=gemm1_weights, gemm2_weights=gemm2_weights, s1=gemm1_weights_scale, s2=gemm2_weights_scale
    )
    for name, t in (("gemm1_weights", gemm1_weights), ("gemm1_weights_scale", gemm1_weights_scale)):
        if t.ndim != 3 or t.element_size() != 1:
            raise LayoutError(f"{name} must be 3-D with one byte per element, got {tuple(t.shape)} {t.dtype}")
    cols1, sf_cols1 = gemm1_weights.shape[2], gemm1_weights_scale.shape[2]
    if hidden_size % cols1 or hidden_size // cols1 not in (1, 2):
        raise LayoutError(f"gemm1_weights has {cols1} columns for hidden_size {hidden_size}: expected 1 or 2 per byte")
    if hidden_size % sf_cols1 or hidden_size // sf_cols1 not in (16, 32):
        raise LayoutError(
            f"gemm1_weights_scale has {sf_cols1} columns for hidden_size {hidden_size}: expected 16 or 32 per scale"
        )
    plan = builders.plan_pad_trtllm_moe_weights(
        intermediate_size,
        hidden_size,
        is_gated_act,
        hidden_alignment,
        intermediate_alignment,
        hidden_size // cols1,
        hidden_size // sf_cols1,
    )
    o1, o2, s1, s2 = plan.apply(gemm1_weights, gemm2_weights, gemm1_weights_scale, gemm2_weights_scale)
    assert o1 is not None and o2 is not None and s1 is not None and s2 is not None
    return TrtllmMoePaddedWeights(
        o1, s1, o2, s2, plan.padded_hidden, plan.padded_intermediate, hidden_size, intermediate_size
    )


CUTE_DSL_GROUP_ROWS, CUTE_DSL_SWAP_AB_GROUP_ROWS = 64, 16
"""Row groups of the CuTe-DSL gated FC1 interleave: 64, or 16 with swap_ab (SM100/103)."""


def _row_bytes(x: torch.Tensor, rows_dim: int = 1) -> int:
    return math.prod(x.shape[rows_dim + 1 :]) * x.element_size()


@_boundary
def interleave_cute_dsl_moe_weights(
    weight: torch.Tensor, block_scales: torch.Tensor, swap_ab: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer 0.7.x's CuTe-DSL gated FC1 interleave (drop-in, same signature).

    ``weight (E, 2I, K_bytes)`` and its row-major ``block_scales (E, 2I, K/sf)``, halves
    ``[up; gate]``, get :func:`fimoe_lab.steps.interleave_row_groups` with groups of 64 rows
    (16 with ``swap_ab``): same shapes and dtypes, rows permuted. Needs ``I % group == 0``.
    """
    if weight.ndim != 3 or block_scales.ndim != 3:
        raise LayoutError(
            f"weight {tuple(weight.shape)} and block_scales {tuple(block_scales.shape)} must be 3-D (experts, rows, cols)"
        )
    if weight.shape[:2] != block_scales.shape[:2]:
        raise LayoutError(
            f"weight {tuple(weight.shape)} and block_scales {tuple(block_scales.shape)} differ in experts or rows"
        )
    check_same_device(weight=weight, block_scales=block_scales)
    if not isinstance(swap_ab, bool):
        raise LayoutError(f"swap_ab must be a bool, got {swap_ab!r}")
    group = CUTE_DSL_SWAP_AB_GROUP_ROWS if swap_ab else CUTE_DSL_GROUP_ROWS
    rows = weight.shape[1]
    w = apply_map(steps.interleave_row_groups(rows, _row_bytes(weight), group), weight, "weight")
    s = apply_map(steps.interleave_row_groups(rows, _row_bytes(block_scales), group), block_scales, "block_scales")
    return w.view(weight.shape), s.view(block_scales.shape)


@_boundary
def deinterleave_gated_rows(x: torch.Tensor, block: int) -> torch.Tensor:
    """FlashInfer 0.7.x's ``deinterleave_gated_rows``: undo a ``block``-row interleave of two halves.

    ``x [M, ...]`` (one expert; rows ``[A0, B0, A1, B1, ...]`` in ``block``-row chunks) ->
    ``[A; B]``: the inverse of :func:`fimoe_lab.steps.interleave_row_groups` (``block`` 1: of
    the gated-activation interleave). Needs ``M % (2 * block) == 0``.
    """
    if x.ndim < 1:
        raise LayoutError("deinterleave_gated_rows needs a tensor with a row dimension")
    m = steps.interleave_row_groups(x.shape[0], _row_bytes(x, 0), block).inverse()
    return apply_map(m, x[None], "x").view(x.shape)


@_boundary
def interleave_moe_scales_for_sm90_mixed_gemm(scales: torch.Tensor, group_size: int = 32) -> torch.Tensor:
    """FlashInfer 0.7.x's scale folding for the SM90 mixed-input MoE GEMM (drop-in, same signature).

    ``scales (E, R, K/group_size)`` (uint8 UE8M0 with group 32 for MXFP4, bf16 with group 128
    for W4A8) -> ``(E, R/64, K/128, F, P)`` in the same dtype, by
    :func:`fimoe_lab.steps.fold_scales_sm90_mixed` (its docstring has the equation).
    """
    if scales.ndim != 3:
        raise LayoutError(f"scales must be 3-D (experts, rows, K/group_size), got {tuple(scales.shape)}")
    m = steps.fold_scales_sm90_mixed(scales.shape[1], scales.shape[2], scales.element_size(), group_size)
    out = apply_map(m, scales.contiguous(), "scales")
    return out.view(torch.uint8).view(scales.dtype).reshape((scales.shape[0],) + m.out_shape[:-1] + (-1,))


@_boundary
def interleave_moe_weights_for_sm90_mixed_gemm(weight: torch.Tensor, quant_type: str = "fp4") -> torch.Tensor:
    """FlashInfer's 4-bit weight interleave for the SM90 mixed-input MoE GEMM (drop-in, same signature).

    ``weight (E, N, K/2)`` uint8 (two 4-bit values per byte) -> a new uint8 tensor of the same shape,
    by :func:`fimoe_lab.steps.sm90_mixed_weight_map` (layout 0.6.16, FlashInfer >= 0.6.16 and every
    0.7.x): byte moves inside 16-row x 64-value blocks, then (``"fp4"``, ``"fp4_fp8"``) a fixed bit
    permutation of every 32-bit word (the step docstrings have the equations). ``quant_type``:
    ``"fp4"`` MXFP4 x BF16 (what vLLM 0.34 and SGLang 0.5.23 call), ``"fp4_fp8"`` MXFP4 x FP8,
    ``"int4"`` INT4 x FP8. Needs ``N % 16 == 0`` and ``K % 64 == 0``. CPU and CUDA (FlashInfer's
    runs on CUDA only); the input is not modified.
    """
    if weight.ndim != 3:
        raise LayoutError(f"weight must be 3-D (num_experts, n, k/2), got shape {tuple(weight.shape)}")
    if weight.dtype != torch.uint8:
        raise LayoutError(
            f"weight must be uint8 (packed 4-bit), got {weight.dtype}", fix="pass the packed weights viewed as uint8"
        )
    if quant_type not in steps.SM90_MIXED_QUANT_TYPES:
        raise LayoutError(
            f"quant_type must be one of {list(steps.SM90_MIXED_QUANT_TYPES)}, got {quant_type!r}",
            fix="'fp4' for MXFP4 weights with BF16 activations",
        )
    m = steps.sm90_mixed_weight_map(weight.shape[1], weight.shape[2], quant_type)
    return m.apply(weight.contiguous())


@cached
def plan_align_mxfp8_moe_weights(
    intermediate: int,
    hidden: int,
    is_act_and_mul: bool,
    w13_scale_cols: int,
    w2_scale_cols: int,
    min_alignment: int = MXFP8_INTERMEDIATE_ALIGNMENT,
    hidden_alignment: int = MXFP8_HIDDEN_ALIGNMENT,
) -> LayerPlan:
    """Plan of :func:`align_mxfp8_moe_weights_for_fi_trtllm`: :func:`builders.plan_align_mxfp8`, pad scales 127."""
    return builders.plan_align_mxfp8(
        intermediate,
        hidden,
        is_act_and_mul,
        w13_scale_cols,
        w2_scale_cols,
        min_alignment,
        hidden_alignment,
        FORMATS["mxfp8"].scale_fill,
    )


def _mxfp8_scale_cols(
    w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor, is_act_and_mul: bool
) -> tuple[int, int]:
    p = _projections(is_act_and_mul)
    for name, t in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        if t.dtype != torch.uint8:
            raise LayoutError(f"{name} must be UE8M0 exponent bytes (torch.uint8), got {t.dtype}")
        if t.shape[0] != w13.shape[0]:
            raise LayoutError(f"{name} has {t.shape[0]} experts, weights have {w13.shape[0]}")
    return (_scale_cols(w13_scale, p * w2.shape[2], "w13_scale"), _scale_cols(w2_scale, w2.shape[1], "w2_scale"))


@_boundary
def align_mxfp8_moe_weights_for_fi_trtllm(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    is_act_and_mul: bool,
    min_alignment: int,
    hidden_alignment: int,
):
    """Pad MXFP8 weights and UE8M0 scales for the TRT-LLM MoE kernel (intermediate and hidden).

    Padded weights are 0 and padded scales 127 (UE8M0 1.0), so padded lanes add
    nothing. Scales 3-D ``(E, rows, cols)`` or flattened ``(E, rows*cols)`` keep their
    layout. Returns ``(w13, w2, w13_scale, w2_scale, Ip, Hp)``.
    """
    _, intermediate, hidden = _check_w13_w2(w13, w2, is_act_and_mul)
    check_same_device(w13=w13, w2=w2, w13_scale=w13_scale, w2_scale=w2_scale)
    c13, c2 = _mxfp8_scale_cols(w13, w2, w13_scale, w2_scale, is_act_and_mul)
    plan = plan_align_mxfp8_moe_weights(intermediate, hidden, is_act_and_mul, c13, c2, min_alignment, hidden_alignment)
    o13, o2, o13s, o2s = plan.apply(w13, w2, w13_scale, w2_scale)
    return o13, o2, o13s, o2s, plan.padded_intermediate, plan.padded_hidden


# --------------------------------------------------------------------------- swaps and shuffles
@_boundary
def swap_w13_to_w31(x: torch.Tensor) -> torch.Tensor:
    """``[gate; up] -> [up; gate]`` along the second-to-last dim (any leading dims), new tensor.

    FlashInfer's gated kernels read W31; checkpoints store W13.
    """
    if x.ndim < 2:
        raise LayoutError(f"needs (..., 2*I, cols), got shape {tuple(x.shape)}")
    rows, cols = x.shape[-2], x.shape[-1]
    m = steps.swap_w13_to_w31_rows(rows, cols * x.element_size())
    return apply_map(m, x.reshape(-1, rows, cols) if x.is_contiguous() else x, "swap_w13_to_w31 input").reshape(x.shape)


@_boundary
def shuffle_deepseek_fp8_moe_weights(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek FP8 block-scale weights into TRT-LLM's shuffled BlockMajorK layout.

    ``(E, M, K) -> (E, K/128, M, 128)`` FP8 for each of w13 and w2 (rows shuffled for
    epilogue tile 64, then 128-byte K blocks). Needs M % 16 == 0 and K % 128 == 0.
    """
    _check_fp8_weights(w13=w13, w2=w2)
    plan = plan_shuffle_deepseek_fp8(w13.shape[1], w2.shape[1], w2.shape[2])
    o13, o2, _, _ = plan.apply(w13, w2)
    return o13.view(torch.float8_e4m3fn), o2.view(torch.float8_e4m3fn)


@_boundary
def shuffle_mxfp8_moe_weights(
    w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor, is_gated: bool
):
    """MXFP8 weights and UE8M0 scales into the TRT-LLM layout (no padding, no swap).

    Weights: gated interleave (if ``is_gated``) + epilogue shuffle (tile 128). Scales:
    the same rows, then the 128x4 swizzle, returned in the input's shape (3-D or
    flattened; the reference mis-indexes flattened scales, this does not).
    """
    _check_fp8_weights(w13=w13, w2=w2)
    check_same_device(w13=w13, w2=w2, w13_scale=w13_scale, w2_scale=w2_scale)
    c13 = _scale_cols(w13_scale, w13.shape[1], "w13_scale")
    c2 = _scale_cols(w2_scale, w2.shape[1], "w2_scale")
    plan = plan_shuffle_mxfp8(w13.shape[1], w2.shape[1], w2.shape[2], is_gated, c13, c2)
    o13, o2, o13s, o2s = plan.apply(w13, w2, w13_scale, w2_scale)
    return o13.view(torch.float8_e4m3fn), o2.view(torch.float8_e4m3fn), o13s, o2s


_shuffle_deepseek_fp8_moe_weights = shuffle_deepseek_fp8_moe_weights
_shuffle_mxfp8_moe_weights = shuffle_mxfp8_moe_weights


# --------------------------------------------------------------------------- in-place converters
def permute_in_place(
    pairs: list[tuple[IndexMap, torch.Tensor, str]], scratch_experts: Optional[int] = None
) -> list[torch.Tensor]:
    """Permute each tensor ``(E, ...)`` of ``pairs`` ``(map, tensor, name)`` in place by its map (a permutation of
    the expert's bytes: ``t[e]`` becomes ``map(t[e])``), all or nothing; returns each as a view in its map's output
    shape. ``scratch_experts``: as the in-place drop-ins'.

    Every tensor is checked before any byte moves (and two that share memory are refused).
    If a later tensor fails midway, its own transform undoes itself
    (:func:`fimoe_lab.kernels.execute_in_place`) and the tensors already done are put back
    with their inverse maps, so the caller gets every input as it was, and the error.
    """
    for m, t, name in pairs:
        m.check_input(t, name)
        if not m.is_permutation:
            raise LayoutError(f"{name}: {m.name} pads or drops bytes, so it cannot run in place")
    for i, (_, a, na) in enumerate(pairs):
        for _, b, nb in pairs[i + 1 :]:
            if a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr():
                raise LayoutError(f"{na} and {nb} share memory", fix="pass separate tensors")
    done: list[tuple[IndexMap, torch.Tensor]] = []
    with torch.no_grad():
        try:
            for m, t, _ in pairs:  # checked above: straight to the executor (IndexMap.apply_ would check again)
                execute_in_place(m.compiled(), t, scratch_experts)
                done.append((m, t))
        except BaseException:
            for m, t in reversed(done):  # in the output layout: back to the input's
                m.inverse().apply_(
                    t.view(t.shape[0], -1).view(torch.uint8).view((t.shape[0],) + m.out_shape), scratch_experts
                )
            raise
    return [t.view(t.shape[0], -1).view((t.shape[0],) + m.out_elements(t.element_size())) for m, t, _ in pairs]


@_boundary
def rotate_weights_for_fi_trtllm_fp8_per_tensor_moe(
    gemm1_weights: torch.Tensor,
    gemm2_weights: torch.Tensor,
    is_gated_activation: bool,
    scratch_experts: Optional[int] = None,
) -> None:
    """Shuffle FP8 per-tensor weights for the TRT-LLM kernel, in place (returns None).

    ``gemm1 (E, M1, H)`` gets the gated interleave (if gated) and the epilogue-tile-128
    row shuffle, ``gemm2 (E, H, I)`` the shuffle; needs M1 % 32 == 0 and H % 32 == 0.
    Extra memory: ``scratch_experts`` experts (default 2% of E or 64 MiB, whichever is more). Both tensors are
    checked before either is touched.
    """
    _check_fp8_weights(gemm1_weights=gemm1_weights, gemm2_weights=gemm2_weights)
    plan = plan_rotate_fp8_per_tensor(
        gemm1_weights.shape[1], gemm1_weights.shape[2], gemm2_weights.shape[2], is_gated_activation
    )
    permute_in_place(
        [(plan.w13, gemm1_weights, "gemm1_weights"), (plan.w2, gemm2_weights, "gemm2_weights")], scratch_experts
    )
    plan_store.applied(plan)


def permute_cache_keys(
    w13_shape: tuple[int, int],
    w2_shape: tuple[int, int],
    is_gated_act_gemm: bool = True,
    epilogue_tile_m: int = builders.TRTLLM_EPILOGUE_TILE_M,
    num_elts_per_sf: Optional[int] = None,
    engine: Optional[str] = None,
) -> tuple[tuple, tuple]:
    """The keys FlashInfer's ``_maybe_get_cached_w3_w1_permute_indices`` and
    ``get_w2_permute_indices_with_cache`` cache W13's and W2's row indices under.

    Shapes are one expert's uint8 ``(rows, cols_bytes)``. Before FlashInfer 0.6.17:
    ``("w3_w1", shape)`` and ``("w2", shape)``; from 0.6.17 on (``engine``'s profile has
    ``permute_cache_key_parts`` 5): ``("w3_w1", shape, epilogue_tile_m, num_elts_per_sf,
    is_gated_act_gemm)`` and ``("w2", shape, epilogue_tile_m, num_elts_per_sf, None)``, as
    vLLM calls them (W2 without the gating argument).
    """
    s13, s2 = torch.Size(w13_shape), torch.Size(w2_shape)
    if engines.get_engine(engine).permute_cache_key_parts == 2:
        return ("w3_w1", s13), ("w2", s2)
    return ("w3_w1", s13, epilogue_tile_m, num_elts_per_sf, is_gated_act_gemm), (
        "w2",
        s2,
        epilogue_tile_m,
        num_elts_per_sf,
        None,
    )


@_boundary
def convert_moe_weights_to_flashinfer_trtllm_block_layout(
    cache_permute_indices: dict,
    w13_weight: torch.Tensor,
    w2_weight: torch.Tensor,
    is_gated_act_gemm: bool = True,
    scratch_experts: Optional[int] = None,
    engine: Optional[str] = None,
):
    """BF16 expert weights into TRT-LLM's shuffled BlockMajorK layout, in place.

    ``w13 (E, M, H) -> (E, H/64, M, 64)``, ``w2 (E, H, I) -> (E, I/64, H, 64)``: views
    of the same storage. Scratch: ``scratch_experts`` experts (default 2% of E or 64 MiB, whichever is more).
    ``cache_permute_indices`` receives what FlashInfer's own helpers would cache there
    (gated interleave + shuffle for W13, shuffle for W2), so a caller sharing the dict with
    FlashInfer stays consistent; our maps are cached by shape anyway. Every dict gets the same read-only device
    tensor for one map and device (found and copied once, kept on the map: :meth:`IndexMap.row_sources_on`). The keys follow the
    FlashInfer of ``engine`` (:mod:`fimoe_lab.engines`; None: the default engine):
    ``("w3_w1" | "w2", uint8 shape)`` before 0.6.17, five parts from 0.6.17 on (see
    :func:`permute_cache_keys`).
    """
    if w13_weight.dtype != torch.bfloat16 or w2_weight.dtype != torch.bfloat16:
        raise LayoutError(
            f"the unquantized TRT-LLM MoE backend needs bfloat16 weights, got w13 {w13_weight.dtype} and "
            f"w2 {w2_weight.dtype}; cast with .to(torch.bfloat16) first"
        )
    check_same_device(w13_weight=w13_weight, w2_weight=w2_weight)
    if w13_weight.ndim != 3 or w2_weight.ndim != 3:
        raise LayoutError(
            f"weights must be (experts, rows, cols), got {tuple(w13_weight.shape)} and {tuple(w2_weight.shape)}"
        )
    plan = plan_trtllm_bf16_block_layout(
        w13_weight.shape[1], w13_weight.shape[2], w2_weight.shape[2], is_gated_act_gemm
    )
    m13, k13 = w13_weight.shape[1], w13_weight.shape[2] * 2
    key13, key2 = permute_cache_keys(
        (m13, k13), (w2_weight.shape[1], w2_weight.shape[2] * 2), is_gated_act_gemm, engine=engine
    )
    o13, o2 = permute_in_place(
        [(plan.w13, w13_weight, "w13_weight"), (plan.w2, w2_weight, "w2_weight")], scratch_experts
    )
    # the dict after the launches: a steady layer's kernels do not wait for it (an engine passes a new dict a layer)
    if key13 not in cache_permute_indices:
        flashinfer_w13_rows = builders.chain(
            steps.interleave_rows_for_gated_act(m13, k13) if is_gated_act_gemm else None,
            steps.shuffle_rows_for_epilogue(m13, k13, builders.TRTLLM_EPILOGUE_TILE_M),
        )  # no W31 swap
        cache_permute_indices[key13] = flashinfer_w13_rows.row_sources_on(w13_weight.device)
    if key2 not in cache_permute_indices:
        cache_permute_indices[key2] = plan.w2.row_steps().row_sources_on(w13_weight.device)
    plan_store.applied(plan)
    return o13, o2


# --------------------------------------------------------------------------- what the drop-ins build
def drop_in_maps(
    fmt: str, intermediate: int, hidden: int, is_act_and_mul: bool = True, is_gated: bool = True
) -> dict[str, tuple[IndexMap, bool]]:
    """The maps the TRT-LLM drop-ins of weight format ``fmt`` build for one layer, by
    ``"drop-in/tensor"``, each with whether the drop-in runs it in place.

    Sizes are what an engine passes the drop-ins: per rank and already aligned
    (``plan_layer(...).padded_*``). These are the drop-ins' own plans (the engines swap and
    pad in separate calls, so they are not ``plan_layer``'s composed maps), built through
    the same cached functions, so :func:`fimoe_lab.warmup.warmup` compiles and runs the very
    objects the first call will use. Formats without such drop-ins: ``{}``.
    """
    rows = _projections(is_act_and_mul) * intermediate
    maps: dict[str, tuple[IndexMap, bool]] = {}
    plans: list[tuple[str, LayerPlan, bool]] = []  # (drop-in, its plan, whether it runs in place)
    if fmt == "fp8":
        if is_act_and_mul:
            maps["swap_w13_to_w31/w13"] = (steps.swap_w13_to_w31_rows(rows, hidden), False)
        plans.append(("rotate", plan_rotate_fp8_per_tensor(rows, hidden, intermediate, is_gated), True))
    elif fmt == "fp8-block":
        plans.append(("shuffle_deepseek_fp8", plan_shuffle_deepseek_fp8(rows, hidden, intermediate), False))
    elif fmt == "mxfp8":
        block = FORMATS["mxfp8"].scale_block
        scale_cols = (hidden // block, intermediate // block)
        plans.append(("shuffle_mxfp8", plan_shuffle_mxfp8(rows, hidden, intermediate, is_gated, *scale_cols), False))
    elif fmt == "bf16":
        plans.append(("trtllm_block_layout", plan_trtllm_bf16_block_layout(rows, hidden, intermediate, is_gated), True))
    for label, plan, in_place in plans:
        for tensor, m in plan.maps().items():
            maps[f"{label}/{tensor}"] = (m, in_place)
    return maps


# --------------------------------------------------------------------------- the layer entry point
@_boundary
def plan_fp8_moe_layer(
    spec: MoELayerSpec | Any,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    is_trtllm: bool = False,
) -> LayerPlan:
    """The plan :func:`prepare_fp8_moe_layer_for_fi` runs, chosen from the layer and the scales' dtype.

    - MXFP8 + TRT-LLM: pad (I 128, H 256; scales 127), swap, gated interleave,
      shuffle (tile 128); scales also 128x4-swizzled.
    - DeepSeek FP8 block: swap (weights and scales); TRT-LLM adds shuffle (tile 64)
      and BlockMajorK 128 B.
    - FP8 per-tensor: pad I (16 gated, 128 non-gated), swap; TRT-LLM adds the gated
      interleave and shuffle (tile 128).
    """
    layer = spec if isinstance(spec, _LayerAccess) else _LayerAccess(spec)
    _check_fp8_weights(w13=w13, w2=w2)
    _, intermediate, hidden = _check_w13_w2(w13, w2, layer.is_act_and_mul)
    act_and_mul, gated = layer.is_act_and_mul, layer.is_gated
    if layer.block_size is None:
        return builders.plan_fp8_per_tensor(intermediate, hidden, act_and_mul, gated, is_trtllm)
    if w13_scale.dtype == torch.uint8:  # MXFP8: UE8M0 exponent bytes
        c13, c2 = _mxfp8_scale_cols(w13, w2, w13_scale, w2_scale, act_and_mul)
        return builders.plan_mxfp8(intermediate, hidden, act_and_mul, gated, is_trtllm, c13, c2)
    if w13_scale.ndim != 3:
        raise LayoutError(
            f"block scales must be 3-D (E, rows/block, cols/block), got w13_scale {tuple(w13_scale.shape)}"
        )
    return builders.plan_fp8_block(
        intermediate,
        hidden,
        act_and_mul,
        is_trtllm,
        w13_scale.shape[1],
        w13_scale.shape[2] * w13_scale.element_size(),
        layer.block_size[0],
    )


@_boundary
def prepare_fp8_moe_layer_for_fi(
    layer: Any,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w13_input_scale: Optional[torch.Tensor],
    w2_scale: torch.Tensor,
    w2_input_scale: Optional[torch.Tensor],
    is_trtllm: bool = False,
):
    """Convert an FP8 MoE layer's weights and scales to the FlashInfer kernel layout.

    ``layer`` is a vLLM FusedMoE-like object (``moe_config.is_act_and_mul``,
    ``activation.is_gated``, ``weight_block_size``) or a :class:`MoELayerSpec`; its
    intermediate (and for MXFP8 TRT-LLM hidden) size is updated when padded. FP8
    block scales come back clamped to >= 1e-10 (new tensors; the inputs are not
    modified). Returns ``(w13, w2, w13_scale, w2_scale)``; see :func:`plan_fp8_moe_layer`.
    """
    access = _LayerAccess(layer)
    block_quant = access.block_size is not None
    if is_trtllm and not block_quant and (w13_input_scale is None or w2_input_scale is None):
        raise LayoutError("the FP8 per-tensor TRT-LLM path needs w13_input_scale and w2_input_scale")
    plan = plan_fp8_moe_layer.__wrapped__(access, w13, w2, w13_scale, w2_scale, is_trtllm)
    o13, o2, o13s, o2s = plan.apply(w13, w2, w13_scale, w2_scale)
    if plan.description == "MXFP8 TRT-LLM":
        access.set_sizes(plan.padded_intermediate, plan.padded_hidden)
        return o13.view(torch.float8_e4m3fn), o2.view(torch.float8_e4m3fn), o13s, o2s
    if not block_quant:
        access.set_sizes(plan.padded_intermediate)
    if block_quant:  # vLLM's clamp: the vllm-0.34 profile's value rule (new tensors)
        rule = engines.get_engine("vllm-0.34").value_rule("fp8-block", "trtllm" if is_trtllm else "cutlass")
        clamped = value_rules.apply(rule, {"w13_scale": o13s, "w2_scale": o2s})
        o13s, o2s = clamped["w13_scale"], clamped["w2_scale"]
    return o13, o2, o13s, o2s
