"""The engines' ``prepare_static_weights_for_trtllm_fp4_moe`` (vLLM 0.34, SGLang 0.5.23), batched.

Both engines loop over experts with FlashInfer's cached permute indices and
``nvfp4_block_scale_interleave``; this runs :func:`fimoe_lab.builders.plan_fp4_trtllm_weights`
once per tensor instead. Its W31 swap is left out (``is_act_and_mul=False`` on the
``R = P*I`` rows of W13): the engines swap before they call this. :func:`replacement` is the
patch both engine integrations install.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from fimoe_lab import builders, recipes
from fimoe_lab.errors import LayoutError
from fimoe_lab.integrations import guarded
from fimoe_lab.plan import apply_map, check_same_device

__all__ = ["prepare_static_weights_for_trtllm_fp4_moe", "replacement"]


def prepare_static_weights_for_trtllm_fp4_moe(
    gemm1_weights: torch.Tensor,
    gemm2_weights: torch.Tensor,
    gemm1_scales_linear_fp4_bytes: torch.Tensor,
    gemm2_scales_linear_fp4_bytes: torch.Tensor,
    hidden_size: int,
    intermediate_size: int,
    num_experts: int,
    is_gated: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 weights and E4M3 block scales into the TRT-LLM layout (the engines' signature).

    ``R = (2 if is_gated else 1) * I``. Inputs are read as ``gemm1 (E, R, H/2)``,
    ``scales1 (E, R, H/16)``, ``gemm2 (E, H, I/2)``, ``scales2 (E, H, I/16)`` (1-byte
    elements, any 1-byte dtype). W13 rows: gated interleave (if gated) then the epilogue
    shuffle (tile 128); W2 rows: the shuffle; each scale tensor: its weight's rows, then the
    128x4 swizzle in place of the shape (needs rows % 128 == 0 and scale columns % 4 == 0).
    Returns ``(gemm1 uint8, scales1 float8_e4m3fn, gemm2 uint8, scales2 float8_e4m3fn)``
    in those shapes, new tensors.
    """
    check_same_device(
        g1=gemm1_weights, g2=gemm2_weights, s1=gemm1_scales_linear_fp4_bytes, s2=gemm2_scales_linear_fp4_bytes
    )
    rows = recipes.projections(is_gated) * intermediate_size
    shapes = {
        "gemm1_weights": (gemm1_weights, (num_experts, rows, hidden_size // 2)),
        "gemm1_scales": (gemm1_scales_linear_fp4_bytes, (num_experts, rows, hidden_size // 16)),
        "gemm2_weights": (gemm2_weights, (num_experts, hidden_size, intermediate_size // 2)),
        "gemm2_scales": (gemm2_scales_linear_fp4_bytes, (num_experts, hidden_size, intermediate_size // 16)),
    }
    flat = {}
    for name, (t, shape) in shapes.items():
        if t.element_size() != 1 or t.numel() != shape[0] * shape[1] * shape[2]:
            raise LayoutError(f"{name} {tuple(t.shape)} {t.dtype} is not {shape} of 1-byte elements")
        flat[name] = t.view(torch.uint8).reshape(shape)
    for name in ("gemm1_scales", "gemm2_scales"):
        if flat[name].shape[2] % 4:
            raise LayoutError(
                f"{name} has {flat[name].shape[2]} columns: the 128x4 swizzle keeps the shape only for multiples of 4"
            )
    w13_plan = builders.plan_fp4_trtllm_weights(rows, hidden_size, False, is_gated)
    w2_plan = builders.plan_fp4_trtllm_weights(intermediate_size, hidden_size, is_gated, is_gated)
    out = (
        apply_map(builders.present(w13_plan.w13), flat["gemm1_weights"], "gemm1_weights"),
        apply_map(builders.present(w13_plan.w13_scale), flat["gemm1_scales"], "gemm1_scales"),
        apply_map(builders.present(w2_plan.w2), flat["gemm2_weights"], "gemm2_weights"),
        apply_map(builders.present(w2_plan.w2_scale), flat["gemm2_scales"], "gemm2_scales"),
    )
    w1, s1, w2, s2 = (o.reshape(shapes[n][1]) for o, n in zip(out, shapes))
    return w1.view(torch.uint8), s1.view(torch.float8_e4m3fn), w2.view(torch.uint8), s2.view(torch.float8_e4m3fn)


def replacement(original: Callable[..., Any], where: str) -> Callable[..., Any]:
    """The engine's ``prepare_static_weights_for_trtllm_fp4_moe`` (``original``, at ``where``) replaced by
    :func:`prepare_static_weights_for_trtllm_fp4_moe`: a call's arguments are bound to the engine's own
    signature (its names and defaults: vLLM's ``is_gated_activation``, SGLang's ``is_gated=True``) and passed
    by position; guarded (:func:`~fimoe_lab.integrations.guarded`)."""
    signature = inspect.signature(original)

    def ours(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return prepare_static_weights_for_trtllm_fp4_moe(*bound.args)

    return guarded(ours, original, where)
