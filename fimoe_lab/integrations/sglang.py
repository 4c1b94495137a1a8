"""fimoe_lab inside SGLang 0.5.23: ``install()`` makes its FlashInfer TRT-LLM MoE weight preparation fast.

Replaced (profile ``sglang-0.5.23``), where SGLang looks each up (see :mod:`fimoe_lab.integrations`).
SGLang's own helpers around the per-expert loops keep running: its padding
(``_align_fp8_moe_weights``, ``_align_mxfp8_moe_weights``, ``_align_fp4_moe_weights``: W13 padded
as one block, MXFP8 scales padded with 0), ``_is_gated``, ``copy_or_rebind_param``, the
permute-index cache of the BF16 method.

- ``quantization/utils.prepare_static_weights_for_trtllm_fp4_moe`` (NVFP4, under
  ``flashinfer_trtllm.align_fp4_moe_weights_for_flashinfer_trtllm`` and the compressed-tensors
  and Muse Spark NVFP4 MoEs): :func:`fimoe_lab.integrations.fp4.prepare_static_weights_for_trtllm_fp4_moe`.
- ``moe_runner/flashinfer_trtllm.align_fp8_moe_weights_for_flashinfer_trtllm`` (FP8 per-tensor):
  optional half swap, SGLang's padding, then :func:`fimoe_lab.builders.plan_rotate_fp8_per_tensor`
  out of place (new parameters, as SGLang), and SGLang's output scales:
  ``output1 = w13_scale * a13 / a2`` (gated; ``1 / a2`` otherwise), ``output1_gate = w13_scale * a13``,
  ``output2 = a2 * w2_scale``, all float32.
- ``moe_runner/flashinfer_trtllm.align_mxfp8_moe_weights_for_flashinfer_trtllm`` (MXFP8): non-gated
  W13 cut to its ``I`` rows, SGLang's padding, then :func:`fimoe_lab.prepare.shuffle_mxfp8_moe_weights`
  (the module's GPU-resident index cache is not filled: nothing reads it).
- ``quantization/unquant.UnquantizedFusedMoEMethod._apply_trtllm_bf16_block_layout`` (BF16): the
  gated interleave (W13 of a gated layer; SGLang swapped W31 before), the epilogue shuffle and
  BlockMajorK, in place, after filling the method's permute-index cache as SGLang does.

SGLang has no plugin entry point group: call :func:`install` (or :func:`register`, which reads
``FIMOE_LAB_INSTALL``) before the model loads.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from fimoe_lab.integrations import Integration, Patch, guarded

__all__ = ["INTEGRATION", "PROFILE", "install", "uninstall", "installed", "register"]

PROFILE = "sglang-0.5.23"
QUANT_UTILS = "sglang.srt.layers.quantization.utils"
FLASHINFER_TRTLLM = "sglang.srt.layers.moe.moe_runner.flashinfer_trtllm"
UNQUANT = "sglang.srt.layers.quantization.unquant"


def _fp4_trtllm(original: Callable[..., Any]) -> Callable[..., Any]:
    from fimoe_lab.integrations import fp4

    return fp4.replacement(original, f"{QUANT_UTILS}.prepare_static_weights_for_trtllm_fp4_moe")


def _fp8_per_tensor(original: Callable[..., Any]) -> Callable[..., Any]:
    import torch
    from torch.nn import Parameter

    from fimoe_lab import builders, prepare

    ft = importlib.import_module(FLASHINFER_TRTLLM)

    def ours(layer: Any, swap_w13_halves: bool = False) -> None:
        is_gated = ft._is_gated(layer)
        w13, w2 = layer.w13_weight, layer.w2_weight
        if swap_w13_halves and is_gated:
            w13 = prepare.swap_w13_to_w31(w13)
        w13, w2, _ = ft._align_fp8_moe_weights(w13, w2, is_gated, 16 if is_gated else 128)
        plan = builders.plan_rotate_fp8_per_tensor(w13.shape[1], w13.shape[2], w2.shape[2], is_gated)
        o13, o2, _, _ = plan.apply(w13, w2)
        assert o13 is not None and o2 is not None
        layer.w13_weight = Parameter(o13.view(torch.uint8).view(torch.float8_e4m3fn), requires_grad=False)
        layer.w2_weight = Parameter(o2.view(torch.uint8).view(torch.float8_e4m3fn), requires_grad=False)
        for name in ("w13_input_scale", "w2_input_scale", "w13_weight_scale", "w2_weight_scale"):
            if getattr(layer, name, None) is None:
                raise AssertionError(f"{name} is missing")  # where SGLang's own asserts stop
        a13 = layer.w13_input_scale.to(torch.float32)
        a2 = layer.w2_input_scale.to(torch.float32)
        s13 = layer.w13_weight_scale.to(torch.float32)
        s2 = layer.w2_weight_scale.to(torch.float32)
        out1 = s13 * a13 * (1.0 / a2) if is_gated else torch.ones_like(s13) * (1.0 / a2)
        layer.output1_scales_scalar = Parameter(out1, requires_grad=False)
        layer.output1_scales_gate_scalar = Parameter(s13 * a13, requires_grad=False)
        layer.output2_scales_scalar = Parameter(a2 * s2, requires_grad=False)

    return guarded(ours, original, f"{FLASHINFER_TRTLLM}.align_fp8_moe_weights_for_flashinfer_trtllm")


def _mxfp8(original: Callable[..., Any]) -> Callable[..., Any]:
    import torch

    from fimoe_lab import prepare

    ft = importlib.import_module(FLASHINFER_TRTLLM)

    def ours(layer: Any) -> None:
        is_gated = ft._is_gated(layer)
        w13, w2 = layer.w13_weight.contiguous(), layer.w2_weight.contiguous()
        s13, s2 = layer.w13_weight_scale_inv.contiguous(), layer.w2_weight_scale_inv.contiguous()
        if s13.dtype != torch.uint8 or s2.dtype != torch.uint8:
            raise AssertionError("MXFP8 scales must be uint8")  # SGLang's own asserts
        if not is_gated:
            inter = w2.shape[2]
            w13, s13 = w13[:, :inter, :].contiguous(), s13[:, :inter, :].contiguous()
        w13, s13, w2, s2, _ = ft._align_mxfp8_moe_weights(w13, s13, w2, s2, is_gated, 16 if is_gated else 128)
        o13, o2, o13s, o2s = prepare.shuffle_mxfp8_moe_weights(w13, w2, s13, s2, is_gated)
        ft.copy_or_rebind_param(layer, "w13_weight", o13)
        ft.copy_or_rebind_param(layer, "w2_weight", o2)
        ft.copy_or_rebind_param(layer, "w13_weight_scale_inv", o13s.contiguous())
        ft.copy_or_rebind_param(layer, "w2_weight_scale_inv", o2s.contiguous())
        layer.w13_weight_scale_inv.format_ue8m0 = True
        layer.w2_weight_scale_inv.format_ue8m0 = True

    return guarded(ours, original, f"{FLASHINFER_TRTLLM}.align_mxfp8_moe_weights_for_flashinfer_trtllm")


def _bf16_block_layout(original: Callable[..., Any]) -> Callable[..., Any]:
    import torch

    from fimoe_lab import builders, steps
    from fimoe_lab.errors import LayoutError

    def ours(self: Any, layer: Any, param: Any, param_name: str) -> None:
        experts = layer.num_local_experts
        data = param.data
        if experts < 1 or experts != data.shape[0]:
            raise LayoutError(f"{param_name}: {experts} local experts for a tensor of {data.shape[0]}")
        rows, cols = data[0].view(torch.uint8).shape
        self._trtllm_bf16_row_permutation(layer, param_name, data[0].view(torch.uint8))  # SGLang's cache entry
        gated = param_name == "w13_weight" and layer.moe_runner_config.is_gated
        m = builders.chain(
            steps.interleave_rows_for_gated_act(rows, cols) if gated else None,
            steps.shuffle_rows_for_epilogue(rows, cols, builders.TRTLLM_EPILOGUE_TILE_M),
            steps.block_major_k(rows, cols, builders.BLOCK_MAJOR_K_BYTES),
        )
        assert m is not None
        with torch.no_grad():
            out = m.apply_(data)
        param.data = out.view(torch.uint8).view(torch.bfloat16).reshape((experts,) + m.out_elements(2))

    return guarded(ours, original, f"{UNQUANT}.UnquantizedFusedMoEMethod._apply_trtllm_bf16_block_layout")


INTEGRATION = Integration(
    profile=PROFILE,
    distribution="sglang",
    package="sglang",
    patches=(
        Patch(QUANT_UTILS, "prepare_static_weights_for_trtllm_fp4_moe", _fp4_trtllm),
        Patch(FLASHINFER_TRTLLM, "align_fp8_moe_weights_for_flashinfer_trtllm", _fp8_per_tensor),
        Patch(FLASHINFER_TRTLLM, "align_mxfp8_moe_weights_for_flashinfer_trtllm", _mxfp8),
        Patch(UNQUANT, "UnquantizedFusedMoEMethod._apply_trtllm_bf16_block_layout", _bf16_block_layout),
    ),
)
"""SGLang 0.5.23's patches (the engine's version and FlashInfer pin come from the ``sglang-0.5.23`` profile)."""


# The engine module's four functions are the integration's own (:class:`~fimoe_lab.integrations.Integration`):
# ``install(force=False)``, ``uninstall()``, ``installed(force=False)`` (a context manager) and ``register()``
# (installs as ``FIMOE_LAB_INSTALL`` says; for a launcher script or sitecustomize).
install = INTEGRATION.install
uninstall = INTEGRATION.uninstall
installed = INTEGRATION.installed
register = INTEGRATION.install_from_env
