"""Plan choice: what a convert asks of every layer (:class:`fimoe_lab.choice.LayoutChoice`), turned into a
layer's plan.

:func:`given_choice` is the :class:`~fimoe_lab.choice.LayoutChoice` an entry point is asked with (the value, or
its keyword options), :func:`plan_args` picks the :func:`fimoe_lab.recipes.plan_layer` arguments for one layer (its format as
the kernel takes it: :func:`layout_format`; the engine profile's alignments; per-token and activation dtype
checked against the recipe), :func:`build_plan` rebuilds the plan from the arguments a file records
(either file format version), and :func:`suggest_alignment` names the smallest alignment that plans a
layer the engine profile's alignment cannot.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from fimoe_lab import engines, recipes
from fimoe_lab.checkpoints import conventions
from fimoe_lab.checkpoints.fileformat import EDITED, FORMAT_VERSION, V1_BUILDER
from fimoe_lab.checkpoints.reader import CheckpointError, MoELayer
from fimoe_lab.choice import LayoutChoice
from fimoe_lab.errors import FimoeError
from fimoe_lab.plan import LayerPlan
from fimoe_lab.shapes import check_kernel_activation
from fimoe_lab.specs import FORMATS, weight_formats

__all__ = [
    "given_choice",
    "plan_args",
    "layout_format",
    "build_plan",
    "TRY_ALIGNMENTS",
    "suggest_alignment",
]


def given_choice(
    choice: Optional[LayoutChoice],
    backend: Optional[str] = None,
    intermediate_alignment: Optional[int] = None,
    hidden_alignment: Optional[int] = None,
    engine: Optional[str] = None,
    per_token: bool = False,
    activation_dtype: Optional[str] = None,
) -> LayoutChoice:
    """What ``convert_checkpoint``, ``convert_distributed`` and ``inspect_checkpoint`` are asked: ``choice``, the
    options as one value, or else the :class:`LayoutChoice` their keyword options make (built here, the one place).

    One or the other: a keyword option off its default next to ``choice`` is refused (``backend`` may repeat
    ``choice.backend``), as is neither ``choice`` nor ``backend``.
    """
    options = (intermediate_alignment, hidden_alignment, engine, per_token, activation_dtype)
    if choice is None:
        if backend is None:
            raise FimoeError("no backend asked for", fix="pass backend (trtllm or cutlass) or choice=LayoutChoice(...)")
        return LayoutChoice(backend, *options)
    if backend not in (None, choice.backend) or options != (None, None, None, False, None):
        raise FimoeError(
            "layout options given twice: as choice= and as keyword options",
            fix="pass them in choice= alone (dataclasses.replace(choice, ...) changes one)",
        )
    return choice


def plan_args(layer: MoELayer, choice: LayoutChoice) -> dict:
    """The record that rebuilds this layer's plan under ``choice``: ``{"recipe": id, "args": plan_layer keyword
    arguments}``.

    ``choice.per_token_activation``: NVFP4 activations quantised per token (the profile's per-token paddings
    apply), recorded as ``args["per_token_activation"]``; files written without it rebuild with False
    (``plan_layer``'s default). Refused for a format without per-token activations
    (``specs.FORMATS[fmt].tactics.per_token_ok``). ``choice.activation_dtype``: the activations the kernel takes where
    the recipe has a layout per activation dtype (``recipes.ACTIVATION_DTYPES``: ``"bf16"`` for MXFP4 on CUTLASS is
    the Hopper SM90 mixed-input layout), recorded as ``args["activation_dtype"]`` when given; refused for
    any other recipe. The layer's convention's quantization method (``Convention.quant_method``: some engine
    rules are keyed on it) is recorded as ``args["quant_method"]`` when it has one. A checkpoint format whose ``layout_format`` names a
    format of ``specs.FORMATS`` (int4-group -> mxint4) is planned as that format.

    ``choice.engine``: the profile (:mod:`fimoe_lab.engines`; None: ``engines.DEFAULT_ENGINE``),
    recorded by its resolved name so that ``restore`` rebuilds with the same defaults. Where the profile has a
    value rule for the recipe, ``args["values"]`` records which form applies (``recipes.plan_layer``'s ``values``:
    ``choice.value_form``, ``"engine"`` when an engine is named (the engine's bytes), ``"lossless"`` for the default
    (the checkpoint's values wherever the kernel takes them)). Files
    that record none were written before profiles and rebuild with ``engines.LEGACY_ENGINE``
    (:func:`build_plan`). A checkpoint-only format (``conventions.MISSING_LAYOUT``) is refused naming the
    layout ``backend`` lacks.
    """
    backend, activation_dtype = choice.backend, choice.activation_dtype
    missing = conventions.MISSING_LAYOUT.get(layer.fmt, {}).get(backend)
    if missing:
        raise CheckpointError(
            f"{layer.fmt} has no {backend} layout: {missing}",
            fix="inspect and restore work on it; convert needs that layout",
        )
    fmt = layout_format(layer.fmt)
    if recipes.recipe_id(fmt, backend) not in recipes.RECIPES:
        raise CheckpointError(
            f"no layout plan for format {layer.fmt!r}",
            fix=f"convert one of the weight formats {', '.join(weight_formats())}",
        )
    tactics = FORMATS[fmt].tactics
    if choice.per_token_activation and not (tactics is not None and tactics.per_token_ok):
        raise CheckpointError(
            f"--per-token (per-token NVFP4 activations) does not apply to {layer.fmt} weights",
            fix="drop --per-token (it is for NVFP4 checkpoints)",
        )
    _check_activation_dtype(layer.fmt, fmt, backend, activation_dtype)
    method = conventions.quant_method(layer.convention)
    try:  # the kernel runs the layer's activation (specs.FormatSpec.kernel_activations: MxInt4 SwiGLU only)
        check_kernel_activation(fmt, backend, layer.activation)
    except FimoeError as exc:
        raise CheckpointError(f"layer {layer.layer}: {exc.message}", fix=exc.fix) from None
    profile = engines.get_engine(choice.engine or engines.DEFAULT_ENGINE)
    ruled = profile.value_rule(fmt, backend, method) is not None
    return {
        "recipe": recipes.recipe_id(fmt, backend),
        "args": {
            "fmt": fmt,
            "backend": backend,
            "intermediate": layer.intermediate,
            "hidden": layer.hidden,
            "is_act_and_mul": layer.is_act_and_mul,
            "is_gated": layer.is_gated,
            "intermediate_alignment": choice.intermediate_alignment,
            "hidden_alignment": choice.hidden_alignment,
            "engine": profile.name,
            "per_token_activation": bool(choice.per_token_activation),
            **({} if activation_dtype is None else {"activation_dtype": activation_dtype}),
            **({} if method is None else {"quant_method": method}),
            **({"values": choice.value_form} if ruled else {}),
        },
    }


def _check_activation_dtype(checkpoint_fmt: str, fmt: str, backend: str, activation_dtype: Optional[str]) -> None:
    """Refuse an ``activation_dtype`` that the recipe ``fmt/backend`` has no layout for (one line and the fix)."""
    choices = recipes.ACTIVATION_DTYPES.get(recipes.recipe_id(fmt, backend), ())
    if activation_dtype is None or activation_dtype in choices:
        return
    if choices:
        raise CheckpointError(
            f"--mxfp4-activation {activation_dtype}: {fmt} on {backend} has layouts for {' or '.join(choices)} "
            "activations only",
            fix=f"pass --mxfp4-activation {' or '.join(choices)} (default {choices[0]})",
        )
    where = ", ".join(f"{r} ({' or '.join(c)})" for r, c in recipes.ACTIVATION_DTYPES.items())
    raise CheckpointError(
        f"--mxfp4-activation {activation_dtype} does not apply to {checkpoint_fmt} weights on {backend}: only "
        f"{where} has a kernel layout per activation dtype",
        fix="drop --mxfp4-activation, or convert an MXFP4 checkpoint with --backend cutlass",
    )


def layout_format(fmt: str) -> str:
    """The ``specs.FORMATS`` format whose recipe lays out checkpoint format ``fmt`` (itself, or its
    ``layout_format``: int4-group -> mxint4)."""
    try:
        return conventions.stored_format(fmt).plan_format
    except ValueError:
        return fmt


def build_plan(record: dict, version: int = FORMAT_VERSION) -> LayerPlan:
    """Rebuild a :class:`LayerPlan` with :func:`fimoe_lab.recipes.plan_layer` from a :func:`plan_args` record.

    Version 2 names the recipe (``"<fmt>/<backend>"``, which must be the arguments'); version 1
    named the builder function :data:`V1_BUILDER` instead. A record without ``engine`` (written
    before engine profiles) rebuilds with ``fimoe_lab.engines.LEGACY_ENGINE``, the defaults
    it was written with.
    """

    args = dict(record.get("args") or {})
    args.setdefault("engine", engines.LEGACY_ENGINE)
    if not isinstance(args.get("per_token_activation", False), bool):
        raise CheckpointError(
            f"per_token_activation {args['per_token_activation']!r} in the plan record is not true or false",
            fix=EDITED,
        )
    if not isinstance(args.get("quant_method"), (str, type(None))):
        raise CheckpointError(
            f"quant_method {args['quant_method']!r} in the plan record is not a method name", fix=EDITED
        )
    if not isinstance(args.get("activation_dtype"), (str, type(None))):
        raise CheckpointError(
            f"activation_dtype {args['activation_dtype']!r} in the plan record is not a dtype name", fix=EDITED
        )
    if args["engine"] not in engines.ENGINES:
        raise CheckpointError(
            f"unknown engine profile {args['engine']!r} in the plan record",
            fix="convert the checkpoint again with a known --engine, or upgrade fimoe_lab",
        )
    if version == 1:
        if record.get("builder") != V1_BUILDER:
            raise CheckpointError(
                f"unknown plan builder {record.get('builder')!r} in a version-1 file",
                fix=f"only {V1_BUILDER} was ever written; the metadata was edited",
            )
    else:
        rid = record.get("recipe")
        if rid not in recipes.RECIPES:
            raise CheckpointError(f"unknown layout recipe {rid!r}", fix=f"known recipes: {', '.join(recipes.RECIPES)}")
        if rid != recipes.recipe_id(args.get("fmt"), args.get("backend")):
            raise CheckpointError(
                f"recipe {rid!r} does not match its arguments (fmt {args.get('fmt')!r}, backend "
                f"{args.get('backend')!r})",
                fix="the metadata was edited; convert the checkpoint again",
            )
    try:
        return recipes.plan_layer(**args)
    except TypeError as exc:
        raise CheckpointError(
            f"plan arguments {args} do not fit recipes.plan_layer ({exc})", fix="convert the checkpoint again"
        ) from None


TRY_ALIGNMENTS = (16, 32, 64, 128, 256)


def suggest_alignment(layer: MoELayer, choice: LayoutChoice) -> Optional[int]:
    """The smallest intermediate alignment in :data:`TRY_ALIGNMENTS` whose plan builds for this layer (the rest of
    ``choice`` kept, the hidden alignment the profile's), or None."""
    for a in TRY_ALIGNMENTS:
        try:
            build_plan(plan_args(layer, replace(choice, intermediate_alignment=a, hidden_alignment=None)))
            return a
        except ValueError:
            continue
    return None
