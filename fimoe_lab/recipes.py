"""Recipes: which steps each (format, backend) applies to an MoE layer, as one table, and the plan it builds.

:data:`RECIPES` holds one :class:`Recipe` per (format, backend): what FlashInfer's kernel takes, as the
steps in order and the paddings. :func:`plan_layer` (and :func:`plan_for`, its form over the two values of
:mod:`fimoe_lab.choice`) builds that plan for one layer from the builders of :mod:`fimoe_lab.builders`
(and :mod:`fimoe_lab.special_plans` for MxInt4 and the SM90 mixed-input layout), with the engine
profile's defaults, to the padded sizes :func:`fimoe_lab.shapes.layer_shape` computes once per layer, the one
padding rule the tuner also reads. ``convert``, ``plan``, the tuner's reference column, the lab and the
vLLM drop-ins in :mod:`fimoe_lab.prepare` all build plans here or from the same builders, and take their
default paddings from :func:`default_alignments` (re-exported from :mod:`fimoe_lab.shapes`), so they
cannot disagree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Optional

from fimoe_lab import steps
from fimoe_lab.builders import (
    chain,
    plan_fp4_trtllm_weights,
    plan_fp8_block,
    plan_fp8_per_tensor_padded,
    plan_mxfp8_padded,
    plan_pad,
    plan_pad_fp4,
    plan_trtllm_bf16_block_layout,
    present,
    swap_rows,
)
from fimoe_lab.caches import cached
from fimoe_lab.choice import LayerShape, LayoutChoice
from fimoe_lab.engines import VALUES, check_quant_method, get_engine
from fimoe_lab.errors import LayoutError
from fimoe_lab.layout import IndexMap
from fimoe_lab.plan import LayerPlan, kept_plan
from fimoe_lab.shapes import (
    FI_MOE_INTERMEDIATE_MULTIPLE,
    default_alignments,
    fp8_alignments,
    layer_shape,
    projections,
)
from fimoe_lab.special_plans import SM90_MIXED_ALIGNMENT, plan_cutlass_mxfp4_bf16_padded, plan_mxint4
from fimoe_lab.specs import FORMATS, get_format

__all__ = [
    "FI_MOE_INTERMEDIATE_MULTIPLE",
    "RECIPES",
    "Recipe",
    "recipe_id",
    "default_alignments",
    "projections",
    "scale_fill",
    "ACTIVATION_DTYPES",
    "activation_layout",
    "plan_layer",
    "plan_for",
]


def scale_fill(fmt: str, backend: str, engine: Optional[str] = None) -> int:
    """The byte padded block scales get: the profile's ``scale_fill`` or the format's."""
    fmt = get_format(fmt).plan_format
    return get_engine(engine).scale_fill.get(recipe_id(fmt, backend), FORMATS[fmt].scale_fill)


# ----------------------------------------------------------------------------- by format and backend
@dataclass(frozen=True)
class Recipe:
    """What FlashInfer's kernel for one (format, backend) takes, as the steps that get a checkpoint layer there.

    ``weights`` / ``scales``: the step kinds (:data:`fimoe_lab.steps.STEPS`) a plan of this recipe may apply to
    the weights and to their scales, in order (a profile may leave some out: the W31 swap where it keeps
    ``[gate; up]``, the shuffles where it hands the kernel the checkpoint layout); ``paddings``: what is padded
    and with what; ``build``: the function that composes the builders into the plan, given the layer, the choice
    (its engine resolved), whether W13 is swapped and the padded sizes ``(I', H')`` that
    :func:`fimoe_lab.shapes.layer_shape` computes once for it (None: the format's own rule,
    :func:`fimoe_lab.special_plans.plan_mxint4`). ``id`` is what converted files record.
    """

    fmt: str
    backend: str
    weights: tuple[str, ...]
    scales: tuple[str, ...]
    paddings: str
    build: Optional[Callable[[LayerShape, LayoutChoice, bool, tuple[int, int]], LayerPlan]]

    @property
    def id(self) -> str:
        return recipe_id(self.fmt, self.backend)


def recipe_id(fmt: str, backend: str) -> str:
    return f"{fmt}/{backend}"


def _bf16_layer(layer: LayerShape, choice: LayoutChoice, swap: bool, padded: tuple[int, int]) -> LayerPlan:
    """BF16: pad (each projection on its own), then TRT-LLM's block layout or CUTLASS's W31 swap."""
    ip, hp = padded
    trt, p = choice.backend == "trtllm", projections(layer.is_act_and_mul)
    pad = plan_pad(layer.intermediate, layer.hidden, ip, hp, 2, layer.is_act_and_mul)
    if trt:
        inner = plan_trtllm_bf16_block_layout(p * ip, hp, ip, layer.is_gated, swap=swap)
        w13, w2 = inner.w13, inner.w2
    else:
        w13, w2 = swap_rows(p * ip, 2 * hp, layer.is_act_and_mul), None
    desc = f"BF16 {'TRT-LLM block layout' if trt else 'CUTLASS'}"
    return LayerPlan(chain(pad.w13, w13), chain(pad.w2, w2), None, None, layer.intermediate, layer.hidden, ip, hp, desc)


def _fp4_layer(layer: LayerShape, choice: LayoutChoice, swap: bool, padded: tuple[int, int]) -> LayerPlan:
    """NVFP4 / MXFP4: pad (scales with the profile's byte), then TRT-LLM's steps or CUTLASS's
    W31 swap and (in every profile but the legacy one) 128x4-swizzled scales."""
    ip, hp = padded
    fmt, backend, am = layer.fmt, choice.backend, layer.is_act_and_mul
    p, trt, block = projections(am), backend == "trtllm", FORMATS[fmt].scale_block
    fill = scale_fill(fmt, backend, choice.engine)
    pad = plan_pad_fp4(layer.intermediate, layer.hidden, ip, hp, am, block, fill)
    sizes = (layer.intermediate, layer.hidden, ip, hp, f"{fmt.upper()} {'TRT-LLM' if trt else 'CUTLASS'}")
    if not trt:
        swizzled = get_engine(choice.engine).cutlass_fp4_scales == "128x4"
        w13s = _cutlass_fp4_scales(pad.w13_scale, swap_rows(p * ip, hp // block, am), p * ip, hp // block, swizzled)
        w2s = _cutlass_fp4_scales(pad.w2_scale, None, hp, ip // block, swizzled)
        return LayerPlan(chain(pad.w13, swap_rows(p * ip, hp // 2, am)), pad.w2, w13s, w2s, *sizes)
    inner = plan_fp4_trtllm_weights(ip, hp, am, layer.is_gated, block)
    w13, w2 = chain(pad.w13, inner.w13), chain(pad.w2, inner.w2)
    return LayerPlan(w13, w2, chain(pad.w13_scale, inner.w13_scale), chain(pad.w2_scale, inner.w2_scale), *sizes)


def _mxfp8_layer(layer: LayerShape, choice: LayoutChoice, swap: bool, padded: tuple[int, int]) -> LayerPlan:
    """MXFP8: :func:`~fimoe_lab.builders.plan_mxfp8_padded` with the profile's scale byte and CUTLASS scale layout;
    on CUTLASS with alignments given, the FP8 family's builder."""
    trt, given = choice.backend == "trtllm", choice.intermediate_alignment or choice.hidden_alignment
    if not (trt or not given):
        return _fp8_layer(layer, choice, swap, padded)
    profile = get_engine(choice.engine)
    block = FORMATS["mxfp8"].scale_block
    return plan_mxfp8_padded(
        layer.intermediate,
        layer.hidden,
        *padded,
        layer.is_act_and_mul,
        layer.is_gated,
        trt,
        layer.hidden // block,
        layer.intermediate // block,
        scale_fill(layer.fmt, choice.backend, profile.name),
        swap,
        profile.cutlass_mxfp8_scales == "128x4",
    )


def _fp8_layer(layer: LayerShape, choice: LayoutChoice, swap: bool, padded: tuple[int, int]) -> LayerPlan:
    """FP8 per-tensor, DeepSeek FP8 block and MXFP8 (CUTLASS, alignments given): the padding to the alignments
    (:func:`~fimoe_lab.shapes.fp8_alignments`: given, else the profile's rule) first, where an intermediate one
    is given to ``I'`` and else the hidden size only, then the format's builder (FP8 per-tensor pads the rest of
    ``I'``: FlashInfer's 16 gated / 128 non-gated); ``swap``: FP8 per-tensor's W31 swap."""
    ip, hp = padded
    ia, _ = fp8_alignments(layer, choice)
    first = plan_pad(layer.intermediate, layer.hidden, ip if ia else layer.intermediate, hp, 1, layer.is_act_and_mul)
    sized = replace(layer, intermediate=first.padded_intermediate, hidden=hp)
    fill = scale_fill(layer.fmt, choice.backend, choice.engine)
    inner = _fp8_inner(sized, choice.backend == "trtllm", fill, swap, ip)
    return LayerPlan(
        chain(first.w13, inner.w13),
        chain(first.w2, inner.w2),
        inner.w13_scale,
        inner.w2_scale,
        layer.intermediate,
        layer.hidden,
        ip,
        hp,
        inner.description,
    )


def _fp8_inner(layer: LayerShape, trt: bool, fill: int, swap: bool, padded_intermediate: int) -> LayerPlan:
    """The FP8 family's own builder for ``layer``'s sizes (FP8 per-tensor: ``I`` padded to
    ``padded_intermediate``; the others pad nothing here)."""
    i, h, am = layer.intermediate, layer.hidden, layer.is_act_and_mul
    if layer.fmt == "fp8":
        return plan_fp8_per_tensor_padded(i, h, padded_intermediate, am, layer.is_gated, trt, swap)
    if layer.fmt == "mxfp8":
        block = FORMATS["mxfp8"].scale_block
        return plan_mxfp8_padded(i, h, i, h, am, layer.is_gated, trt, h // block, i // block, fill)
    spec = FORMATS["fp8-block"]
    rows = spec.scale_block_rows
    scale_rows, scale_cols = -(-projections(am) * i // rows), -(-h // spec.scale_block) * spec.scale_itemsize
    return plan_fp8_block(i, h, am, trt, scale_rows, scale_cols, rows)


_PAD, _SWAP, _GATED = "pad_projections", "swap_w13_to_w31_rows", "interleave_rows_for_gated_act"
_SHUFFLE, _BLOCK_K, _SWIZZLE = "shuffle_rows_for_epilogue", "block_major_k", "swizzle_scales_128x4"
_TRT = (_PAD, _SWAP, _GATED, _SHUFFLE)  # TRT-LLM rows: pad, W31 swap, gated interleave, epilogue shuffle
_CUT = (_PAD, _SWAP)  # CUTLASS rows: pad, W31 swap
_TRT_SF, _CUT_SF = (*_TRT, _SWIZZLE), (*_CUT, _SWIZZLE)  # vector scales: their rows' steps, then 128x4
_INT4, _INT4_SF = (_SWAP, _GATED, _SHUFFLE, _BLOCK_K), (_SWAP, _GATED, _SHUFFLE, _SWIZZLE)

RECIPES: dict[str, Recipe] = {
    r.id: r
    for r in (
        # Recipe(format, backend, weight steps, scale steps, paddings before the profile's overrides, build)
        Recipe("bf16", "trtllm", (*_TRT, _BLOCK_K), (), "I 64, H 64 (whole 128 B K blocks)", _bf16_layer),
        Recipe("bf16", "cutlass", _CUT, (), "none", _bf16_layer),
        Recipe("fp8", "trtllm", _TRT, (), "I 16 gated / 128 non-gated", _fp8_layer),
        Recipe("fp8", "cutlass", _CUT, (), "I 16 gated / 128 non-gated", _fp8_layer),
        Recipe("fp8-block", "trtllm", (_SWAP, _SHUFFLE, _BLOCK_K), (_SWAP,), "none (shuffle tile 64)", _fp8_layer),
        Recipe("fp8-block", "cutlass", (_SWAP,), (_SWAP,), "none", _fp8_layer),
        Recipe("mxfp8", "trtllm", _TRT, _TRT_SF, "I 128, H 256; scales the profile's byte", _mxfp8_layer),
        Recipe("mxfp8", "cutlass", _CUT, _CUT_SF, "none (FlashInfer 0.7.x: I 128, H 128)", _mxfp8_layer),
        Recipe("nvfp4", "trtllm", _TRT, _TRT_SF, "I 128/P (vLLM: H 256)", _fp4_layer),
        Recipe("nvfp4", "cutlass", _CUT, _CUT_SF, "I 16", _fp4_layer),
        Recipe("mxfp4", "trtllm", _TRT, _TRT_SF, "I 256, H 256", _fp4_layer),
        Recipe("mxfp4", "cutlass", _CUT, _CUT_SF, "I 32, H 32", _fp4_layer),
        Recipe("mxint4", "trtllm", _INT4, _INT4_SF, "none (I, H multiples of 256)", None),
    )
}
"""One row per (format, backend): the kernel's contract as steps and paddings, and the function that builds it.
MXFP4 on CUTLASS with BF16 activations (SM90) is :data:`ACTIVATION_DTYPES`'s other layout."""


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
    values: Optional[str] = None,
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
    The plan carries the profile's value rule for the recipe (``LayerPlan.value_rule``: vLLM 0.34 and SGLang
    0.5.23 requantize FP8 per-tensor W13 to max(gate, up), vLLM 0.34 clamps DeepSeek FP8 block scales to 1e-10),
    applied by ``plan.apply`` before the byte maps. ``values`` (:data:`fimoe_lab.engines.VALUES`): ``"engine"``,
    the profile's rules as the engine applies them (its bytes); ``"lossless"``, only a rule the kernel needs, only
    where needed (FP8 per-tensor experts whose gate and up scales differ); None: ``"engine"`` when ``engine`` is
    named, ``"lossless"`` for the default profile.
    """
    args: tuple[object, ...] = (fmt, backend, intermediate, hidden, is_act_and_mul, is_gated, intermediate_alignment)
    args += (hidden_alignment, engine, per_token_activation, activation_dtype, quant_method, values)
    written = (args, tuple(map(type, args)))  # 256 and 256.0, True and 1: spellings of their own
    asked = _ASKED.get(written)
    if asked is None:  # an engine asks once a layer: the two values are made once a spelling
        layer = LayerShape(fmt, intermediate, hidden, is_act_and_mul, is_gated, quant_method)
        choice = LayoutChoice(
            backend, intermediate_alignment, hidden_alignment, engine, per_token_activation, activation_dtype, values
        )
        asked = (layer, choice)
        if len(_ASKED) < _ASKED_MOST:
            _ASKED[written] = asked
    return plan_for(*asked)


_ASKED: dict[tuple[tuple[object, ...], tuple[type, ...]], tuple[LayerShape, LayoutChoice]] = {}
""":func:`plan_layer`'s arguments as written -> its two values (a few hundred bytes each)."""
_ASKED_MOST = 4096


@cached
def plan_for(layer: LayerShape, choice: LayoutChoice) -> LayerPlan:
    """:func:`plan_layer` of the two values: the plan of ``choice``'s recipe for ``layer.fmt``, built to the padded
    sizes ``shapes.layer_shape`` gives (the one rule the tuner also reads; it refuses a shape first)."""
    fmt, backend = layer.fmt, choice.backend
    check_quant_method(layer.quant_method)
    if choice.values not in (None, *VALUES):
        raise LayoutError(f"values {choice.values!r} is not one of {', '.join(VALUES)}", fix="pass engine or lossless")
    get_engine(choice.engine).check_prepared(fmt, backend, layer.quant_method)
    if activation_layout(fmt, backend, choice.activation_dtype) == "bf16":
        return _plan_sm90_mixed(layer, choice)
    if fmt == "mxint4":  # its own rule (no padding, TRT-LLM only): plan_mxint4
        return plan_mxint4(layer, choice)
    rule = get_engine(choice.engine).value_rule(fmt, backend, layer.quant_method, choice.value_form == "lossless")
    return kept_plan(
        {"plan_for": {"layer": asdict(layer), "choice": asdict(choice)}},
        lambda: _build_layer_plan(layer, choice, layer_shape(layer, choice)),
        lambda plan: plan if rule is None else replace(plan, value_rule=rule),
    )


def _plan_sm90_mixed(layer: LayerShape, choice: LayoutChoice) -> LayerPlan:
    """:func:`plan_cutlass_mxfp4_bf16_padded` of ``plan_layer``'s arguments, padded to ``shapes.layer_shape``'s
    sizes of MXFP4 on CUTLASS with the alignments given, else 128 (:data:`SM90_MIXED_ALIGNMENT`)."""
    ia = choice.intermediate_alignment or SM90_MIXED_ALIGNMENT
    ha = choice.hidden_alignment or SM90_MIXED_ALIGNMENT
    aligned = LayoutChoice("cutlass", ia, ha, choice.engine)
    padded = layer_shape(replace(layer, fmt="mxfp4", quant_method=None), aligned)
    return plan_cutlass_mxfp4_bf16_padded(
        layer.intermediate, layer.hidden, *padded, layer.is_act_and_mul, choice.engine
    )


def _build_layer_plan(layer: LayerShape, choice: LayoutChoice, padded: tuple[int, int]) -> LayerPlan:
    """The plan of ``RECIPES[fmt/backend].build`` to the padded sizes ``padded`` under the profile's swap rule, or
    the checkpoint layout as it is where the profile hands the TRT-LLM kernel unshuffled weights
    (``trtllm_plain``)."""
    fmt, backend, intermediate, hidden = layer.fmt, choice.backend, layer.intermediate, layer.hidden
    profile = get_engine(choice.engine)
    swap = not profile.keeps_gate_up(fmt, backend, layer.quant_method)
    if backend == "trtllm" and recipe_id(fmt, backend) in profile.trtllm_plain:  # use_shuffled_weight=False
        if not swap:
            desc = f"{fmt} TRT-LLM in the checkpoint layout (use_shuffled_weight=False)"
            return LayerPlan(None, None, None, None, intermediate, hidden, intermediate, hidden, desc)
        inner = _fp8_inner(layer, False, 0, True, intermediate)
        return replace(inner, description=f"{fmt} TRT-LLM MajorK unshuffled (W31 swap only)")
    build = RECIPES[recipe_id(fmt, backend)].build
    if build is None:
        raise LayoutError(f"internal: {fmt}/{backend} is laid out by its own rule, not by the recipe table")
    return build(layer, replace(choice, engine=profile.name), swap, padded)


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
