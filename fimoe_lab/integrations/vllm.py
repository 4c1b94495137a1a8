"""fimoe_lab inside vLLM 0.34: ``install()`` makes its FlashInfer MoE weight preparation fast.

Replaced (profile ``vllm-0.34``), each where vLLM looks it up (see :mod:`fimoe_lab.integrations`):

- ``quantization/utils/flashinfer_utils``: ``swap_w13_to_w31``,
  ``rotate_weights_for_fi_trtllm_fp8_per_tensor_moe`` (in place, as vLLM's),
  ``convert_moe_weights_to_flashinfer_trtllm_block_layout`` (BF16 TRT-LLM, in place; fills the
  caller's permute-index cache under FlashInfer 0.7.x's five-part keys),
  ``align_moe_weights_for_fi``, ``align_fp4_moe_weights_for_fi``,
  ``align_fp4_moe_hidden_dim_for_fi``, ``align_mxfp8_moe_weights_for_fi_trtllm``,
  ``_shuffle_deepseek_fp8_moe_weights``, ``_shuffle_mxfp8_moe_weights`` (3-D scales; flattened
  ones stay with vLLM's code, which mis-indexes them: replacing it would change the result),
  and ``prepare_fp8_moe_layer_for_fi`` on its TRT-LLM FP8 per-tensor and DeepSeek FP8 block
  paths: each tensor's padding, swap and shuffles as one map (vLLM copies the tensor once a
  step), with vLLM's in-place effects kept (the per-tensor rotate of the caller's W2, the
  block scales' clamp) and the layer's sizes set as vLLM sets them. Its MXFP8 and CUTLASS
  paths stay vLLM's, calling the replaced steps by module lookup.
- ``quantization/utils/flashinfer_fp4_moe``: ``reorder_w1w3_to_w3w1`` (3-D, in place, one pass a tensor),
  ``prepare_static_weights_for_trtllm_fp4_moe``
  (NVFP4 TRT-LLM: W13 gated interleave + epilogue shuffle, W2 shuffle, scales the same rows
  then the 128x4 swizzle: :func:`fimoe_lab.builders.plan_fp4_trtllm_weights` without the W31
  swap, which vLLM's ``reorder_w1w3_to_w3w1`` did before), and the two ``align_fp4_*`` names
  it imported.
- ``fused_moe/oracle/mxfp4``: ``convert_gpt_oss_weight_to_mxfp4_moe_kernel_format`` for the
  FlashInfer TRT-LLM backends (gpt-oss MXFP4: weights, scales and biases; every other backend
  runs vLLM's code).
- Modules that imported them by name: ``fused_moe/oracle/unquantized`` (BF16),
  ``oracle/mxfp4`` and ``utils/b12x_moe`` (``swap_w13_to_w31``).

Not replaced: the already batched non-gpt-oss MXFP4 TRT-LLM path.

vLLM plugin (``vllm.general_plugins`` entry point :func:`register`): set
``FIMOE_LAB_INSTALL=1`` in the serving environment.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Optional

from fimoe_lab.caches import cached
from fimoe_lab.integrations import Integration, Patch, guarded

__all__ = ["INTEGRATION", "PROFILE", "install", "uninstall", "installed", "register"]

PROFILE = "vllm-0.34"
FLASHINFER_UTILS = "vllm.model_executor.layers.quantization.utils.flashinfer_utils"
FLASHINFER_FP4_MOE = "vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe"
ORACLE_MXFP4 = "vllm.model_executor.layers.fused_moe.oracle.mxfp4"


def _drop_in(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Replacement factory: ``fimoe_lab.prepare.<name>`` (same signature as vLLM's)."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        from fimoe_lab import prepare

        return guarded(getattr(prepare, name), original, f"{original.__module__}.{name}")

    return make


def _rotate(original: Callable[..., Any]) -> Callable[..., Any]:
    from fimoe_lab import prepare

    def ours(gemm1_weights: Any, gemm2_weights: Any, is_gated_activation: bool) -> None:
        prepare.rotate_weights_for_fi_trtllm_fp8_per_tensor_moe(gemm1_weights, gemm2_weights, is_gated_activation)

    return guarded(ours, original, f"{FLASHINFER_UTILS}.rotate_weights_for_fi_trtllm_fp8_per_tensor_moe")


def _fp8_layer(original: Callable[..., Any]) -> Callable[..., Any]:
    """``prepare_fp8_moe_layer_for_fi`` on its TRT-LLM FP8 per-tensor and DeepSeek FP8 block paths: each tensor's
    steps (padding, the W13/W31 swap, then the gated interleave and shuffle, or the shuffle and BlockMajorK) run as
    one map of :func:`fimoe_lab.prepare.plan_fp8_moe_layer`, where vLLM's calls copy the tensor once a step.

    What the caller sees is vLLM's: a tensor vLLM permutes in place stays the caller's and is permuted in place
    (the per-tensor W2, and W13 without the swap, when nothing is padded), one it replaces is new, the block
    scales are clamped in place where vLLM clamps them (after the swap, W13's copy; W2's own), and the layer's
    intermediate size is set as vLLM sets it. MXFP8 and the CUTLASS paths run vLLM's code, whose steps are
    replaced one by one.
    """
    import torch

    from fimoe_lab import builders, engines, prepare, value_rules

    def ours(
        layer: Any,
        w13: Any,
        w2: Any,
        w13_scale: Any,
        w13_input_scale: Any,
        w2_scale: Any,
        w2_input_scale: Any,
        is_trtllm: bool = False,
    ) -> Any:
        args = (layer, w13, w2, w13_scale, w13_input_scale, w2_scale, w2_input_scale, is_trtllm)
        block = getattr(layer, "weight_block_size", None) is not None
        if not is_trtllm or (block and w13_scale.dtype == torch.uint8):
            return original(*args)  # MXFP8, CUTLASS: vLLM's steps, each replaced
        if not block and (w13_input_scale is None or w2_input_scale is None):
            return original(*args)  # vLLM's own assertion
        plan = prepare.plan_fp8_moe_layer(layer, w13, w2, w13_scale, w2_scale, is_trtllm=True)
        if block:
            o13, o2, o13s, o2s = plan.apply(w13, w2, w13_scale, w2_scale)  # no map on a scale: the caller's tensor
            assert o13 is not None and o2 is not None
            rule = engines.get_engine(PROFILE).value_rule("fp8-block", "trtllm")
            value_rules.apply(rule, {"w13_scale": o13s, "w2_scale": o2s}, in_place=True)
            return o13.view(w13.dtype), o2.view(w2.dtype), o13s, o2s
        if plan.padded_intermediate != plan.intermediate:  # vLLM's alignment made new tensors of both
            p13, p2, _, _ = plan.apply(w13, w2)
            assert p13 is not None and p2 is not None
            o13, o2 = p13.view(w13.dtype), p2.view(w2.dtype)
        else:
            in_place, o13, o2 = [(builders.present(plan.w2), w2, "w2")], w13, w2
            if layer.moe_config.is_act_and_mul:  # vLLM's swap made W13 new
                o13 = plan.apply_tensor("w13", w13).view(w13.dtype)
            else:
                in_place.insert(0, (builders.present(plan.w13), w13, "w13"))
            prepare.permute_in_place(in_place)
        layer.moe_config.intermediate_size_per_partition = plan.padded_intermediate
        return o13, o2, w13_scale, w2_scale

    return guarded(ours, original, f"{FLASHINFER_UTILS}.prepare_fp8_moe_layer_for_fi")


def _bf16_block_layout(original: Callable[..., Any]) -> Callable[..., Any]:
    from fimoe_lab import prepare

    def ours(
        cache_permute_indices: dict[Any, Any], w13_weight: Any, w2_weight: Any, is_gated_act_gemm: bool = True
    ) -> Any:
        return prepare.convert_moe_weights_to_flashinfer_trtllm_block_layout(
            cache_permute_indices, w13_weight, w2_weight, is_gated_act_gemm, engine=PROFILE
        )

    return guarded(ours, original, f"{FLASHINFER_UTILS}.convert_moe_weights_to_flashinfer_trtllm_block_layout")


def _shuffle_mxfp8(original: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's own code for flattened ``(E, rows*cols)`` scales: it indexes their columns as rows
    (garbage or an IndexError); ours would return the right layout, which is a change."""
    from fimoe_lab import prepare

    def ours(w13: Any, w2: Any, w13_scale: Any, w2_scale: Any, is_gated: bool) -> Any:
        if w13_scale.ndim != 3 or w2_scale.ndim != 3:
            return original(w13, w2, w13_scale, w2_scale, is_gated)
        return prepare.shuffle_mxfp8_moe_weights(w13, w2, w13_scale, w2_scale, is_gated)

    return guarded(ours, original, f"{FLASHINFER_UTILS}._shuffle_mxfp8_moe_weights")


def _gpt_oss_mxfp4(original: Callable[..., Any]) -> Callable[..., Any]:
    """The TRT-LLM branch of ``convert_gpt_oss_weight_to_mxfp4_moe_kernel_format``; other backends stay vLLM's.

    gpt-oss W13 rows arrive interleaved ``g0, u0, g1, u1, ...``; vLLM swaps each pair and
    shuffles (tile 128) weights, UE8M0 scales (then the 128x4 swizzle) and float32 biases.
    Here: the inverse gated interleave (back to ``[gate; up]``) composed with
    :func:`fimoe_lab.builders.plan_fp4_trtllm_weights` (``scale_block`` 32: swap, interleave,
    shuffle); W2 and its scale and bias the plan's shuffle. vLLM's permute-index cache gets
    the entries its loop would add (FlashInfer's own helper, one expert per tensor), computed for
    a model's first layer of a shape and given to the later ones (vLLM's cache lives one layer:
    each layer's helper calls recompute them on the host and copy them to the device, about
    1 ms a gpt-oss layer on an H100 host).
    """
    import torch

    from fimoe_lab import builders
    from fimoe_lab.errors import LayoutError

    oracle = importlib.import_module(ORACLE_MXFP4)
    indices: dict[tuple[Any, ...], dict[Any, Any]] = {}  # the helper's entries for a layer's shapes and device

    def ours(
        mxfp4_backend: Any,
        layer: Any,
        w13_weight: Any,
        w2_weight: Any,
        w13_weight_scale: Any,
        w2_weight_scale: Any,
        w13_bias: Any = None,
        w2_bias: Any = None,
        w13_input_scale: Any = None,
        w2_input_scale: Any = None,
        _cache_permute_indices: Optional[dict[Any, Any]] = None,
    ) -> Any:
        args = (mxfp4_backend, layer, w13_weight, w2_weight, w13_weight_scale, w2_weight_scale, w13_bias, w2_bias)
        kwargs = dict(
            w13_input_scale=w13_input_scale,
            w2_input_scale=w2_input_scale,
            _cache_permute_indices=_cache_permute_indices,
        )
        if (
            mxfp4_backend not in oracle.TRTLLM_BACKENDS
            or _cache_permute_indices is None
            or w13_bias is None
            or w2_bias is None
        ):
            return original(*args, **kwargs)
        from flashinfer.fused_moe.core import get_w2_permute_indices_with_cache

        w13, w2 = w13_weight.data.view(torch.uint8), w2_weight.data.view(torch.uint8)
        s13, s2 = w13_weight_scale.data.view(torch.uint8), w2_weight_scale.data.view(torch.uint8)
        b13, b2 = w13_bias.data.to(torch.float32), w2_bias.data.to(torch.float32)
        experts, rows, hidden = w13.shape[0], w13.shape[1], w13.shape[2] * 2
        inter = rows // 2
        if s13.shape[-1] % 4 or s2.shape[-1] % 4:
            raise LayoutError(
                f"MXFP4 scales {tuple(s13.shape)}, {tuple(s2.shape)}: the 128x4 swizzle keeps the shape only for columns % 4 == 0"
            )
        key = (w13.shape[1:], s13.shape[1:], w2.shape[1:], s2.shape[1:], str(w13.device))
        entries = indices.get(key)
        if entries is None:  # the first layer of a shape: FlashInfer's helper, as vLLM's loop calls it
            entries = {}
            for t, sf in ((w13, None), (s13, 16), (b13, None), (w2, None), (s2, 16), (b2, None)):
                one = t[0].reshape(-1, 1) if t.ndim == 2 else t[0]  # a bias: (rows, 1), as vLLM passes it
                get_w2_permute_indices_with_cache(entries, one, builders.TRTLLM_EPILOGUE_TILE_M, num_elts_per_sf=sf)
            indices[key] = entries
        for k, v in entries.items():  # what the helper would add; an entry the caller has stays the caller's
            _cache_permute_indices.setdefault(k, v)
        m13, m13s, m2, m2s, mb13, mb2 = _gpt_oss_trtllm_maps(inter, hidden)
        maps = (
            (m13, w13),
            (m13s, s13),
            (m2, w2),
            (m2s, s2),
            (mb13, b13.reshape(experts, rows, 1).contiguous()),
            (mb2, b2.reshape(experts, -1, 1).contiguous()),
        )
        o13, o13s, o2, o2s, ob13, ob2 = (m.apply(x.contiguous()) for m, x in maps)
        return (
            o13,
            o2,
            o13s.reshape(experts, rows, hidden // 32).view(torch.float8_e4m3fn),
            o2s.reshape(experts, hidden, inter // 32).view(torch.float8_e4m3fn),
            ob13.reshape(experts, -1),
            ob2.reshape(experts, -1),
        )

    return guarded(ours, original, f"{ORACLE_MXFP4}.convert_gpt_oss_weight_to_mxfp4_moe_kernel_format")


@cached
def _gpt_oss_trtllm_maps(intermediate: int, hidden: int) -> tuple[Any, ...]:
    """The maps of a gpt-oss MXFP4 layer ``(E, 2I, H/2)`` weights, ``(E, 2I, H/32)`` UE8M0 scales, float32 biases
    (one 4-byte cell a row) into vLLM's TRT-LLM layout, built once per shape (a model's layers share them, and with
    them their executable forms and device tables): W13, its scales and bias take the inverse gated interleave
    (``g0, u0, g1, u1, ...`` back to ``[gate; up]``) then :func:`fimoe_lab.builders.plan_fp4_trtllm_weights`'
    W13 maps (``scale_block`` 32: swap, interleave, shuffle); W2, its scales and bias that plan's W2 maps."""
    from fimoe_lab import builders, steps

    plan = builders.plan_fp4_trtllm_weights(intermediate, hidden, True, True, scale_block=32)
    rows = 2 * intermediate

    def pairs(cols_bytes: int) -> Any:
        return steps.interleave_rows_for_gated_act(rows, cols_bytes).inverse()

    w13 = pairs(hidden // 2) >> builders.present(plan.w13)
    w2 = builders.present(plan.w2)
    w13_scale = pairs(hidden // 32) >> builders.present(plan.w13_scale)
    return w13, w13_scale, w2, builders.present(plan.w2_scale), w13.for_row_vectors(4), w2.for_row_vectors(4)


def _reorder_w1w3(original: Callable[..., Any]) -> Callable[..., Any]:
    """``reorder_w1w3_to_w3w1(weight, scale, dim=-2)``: each expert's two halves of rows swapped in place, one pass
    of each 3-D tensor (vLLM copies each chunk of a half aside and back: three copies of half the bytes). Other
    ``dim``s and shapes run vLLM's code."""
    from fimoe_lab import prepare, steps

    def ours(weight: Any, scale: Any, dim: int = -2) -> Any:
        if weight.dim() != 3 or scale.dim() != 3 or dim % 3 != 1:
            return original(weight, scale, dim)
        prepare.permute_in_place(
            [
                (steps.swap_w13_to_w31_rows(t.shape[1], t.shape[2] * t.element_size()), t, name)
                for t, name in ((weight, "weight"), (scale, "scale"))
            ]
        )
        return weight, scale

    return guarded(ours, original, f"{FLASHINFER_FP4_MOE}.reorder_w1w3_to_w3w1")


def _fp4_trtllm(original: Callable[..., Any]) -> Callable[..., Any]:
    from fimoe_lab.integrations import fp4

    return fp4.replacement(original, f"{FLASHINFER_FP4_MOE}.prepare_static_weights_for_trtllm_fp4_moe")


_FU_DROP_INS = (
    "swap_w13_to_w31",
    "align_moe_weights_for_fi",
    "align_fp4_moe_weights_for_fi",
    "align_fp4_moe_hidden_dim_for_fi",
    "align_mxfp8_moe_weights_for_fi_trtllm",
    "_shuffle_deepseek_fp8_moe_weights",
)

INTEGRATION = Integration(
    profile=PROFILE,
    distribution="vllm",
    package="vllm",
    patches=(
        *(Patch(FLASHINFER_UTILS, name, _drop_in(name)) for name in _FU_DROP_INS),
        Patch(FLASHINFER_UTILS, "_shuffle_mxfp8_moe_weights", _shuffle_mxfp8),
        Patch(FLASHINFER_UTILS, "rotate_weights_for_fi_trtllm_fp8_per_tensor_moe", _rotate),
        Patch(FLASHINFER_UTILS, "prepare_fp8_moe_layer_for_fi", _fp8_layer),
        Patch(FLASHINFER_UTILS, "convert_moe_weights_to_flashinfer_trtllm_block_layout", _bf16_block_layout),
        Patch(FLASHINFER_FP4_MOE, "prepare_static_weights_for_trtllm_fp4_moe", _fp4_trtllm),
        Patch(FLASHINFER_FP4_MOE, "reorder_w1w3_to_w3w1", _reorder_w1w3),
        Patch(ORACLE_MXFP4, "convert_gpt_oss_weight_to_mxfp4_moe_kernel_format", _gpt_oss_mxfp4),
    ),
    # The pin 0.7.3 is not on the package index: the tests ran with 0.7.4. FlashInfer's index
    # helpers vLLM's code calls are the same in 0.7.2 and 0.7.4 (assertion messages aside).
    also_tested_flashinfer=("0.7.4",),
)
"""vLLM 0.34's patches (the engine's version and FlashInfer pin come from the ``vllm-0.34`` profile)."""


# The engine module's four functions are the integration's own (:class:`~fimoe_lab.integrations.Integration`):
# ``install(force=False)``, ``uninstall()``, ``installed(force=False)`` (a context manager) and ``register()``
# (installs as ``FIMOE_LAB_INSTALL`` says; the ``vllm.general_plugins`` entry point).
install = INTEGRATION.install
uninstall = INTEGRATION.uninstall
installed = INTEGRATION.installed
register = INTEGRATION.install_from_env
