"""What ``convert`` does to a layer's sizes, from sizes alone and without torch.

Two rules, each one function, so that the tuner (which must answer in well under two
seconds, before torch could even load) and ``convert`` cannot disagree:

* :func:`rank_intermediates`: the intermediate size of each tensor-parallel rank, as the
  checkpoint reader shards (:meth:`fimoe_lab.checkpoints.reader.Checkpoint.shard_bounds`):
  equal shards ``I / tp`` that keep whole scale blocks, or, for checkpoints whose loader
  hands out whole blocks (gpt-oss MXFP4, vLLM's loader), ``ceil(I / b / tp) * b`` per
  rank with the last ranks smaller (``b`` the block).
* :func:`padded_shape`: ``(I', H')`` that :func:`fimoe_lab.recipes.plan_layer` pads one
  rank's ``(I, H)`` to for a (format, backend, activation, alignments, engine), or the
  :class:`~fimoe_lab.errors.LayoutError` it refuses the shape with. It restates, on sizes
  only, every size condition the plan's steps check (whole scale blocks, ``round_up``
  padding, the default alignments, the epilogue-shuffle row blocks of 32 (16 for DeepSeek
  FP8), 128-byte BlockMajorK columns, 128-row scale shuffles, even W13 rows for the W31
  swap; MxInt4's own rule: TRT-LLM SwiGLU only, no padding, multiples of 256);
  ``tests/test_tune_shapes.py`` checks it against ``plan_layer`` on random and structured
  shapes of every format (MxInt4 included), backend and activation kind.

:func:`default_alignments` is the one default padding every command uses
(``recipes.default_alignments`` re-exports it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Optional

from fimoe_lab.choice import LayerShape, LayoutChoice
from fimoe_lab.engines import get_engine
from fimoe_lab.errors import LayoutError
from fimoe_lab.specs import (
    ACTIVATIONS,
    BACKENDS,
    FORMATS,
    FormatSpec,
    check_backend,
    get_activation,
    get_format,
    weight_formats,
)

__all__ = [
    "FI_MOE_INTERMEDIATE_MULTIPLE",
    "round_up",
    "projections",
    "BASE_ALIGNMENTS",
    "default_alignments",
    "rank_intermediates",
    "padded_shape",
    "layer_shape",
    "choice_alignments",
    "fp8_alignments",
    "check_kernel_activation",
    "mxint4_shape",
]

FI_MOE_INTERMEDIATE_MULTIPLE = 16
"""Per-rank intermediate multiple FlashInfer's gated MoE kernels need (vLLM pads to it with
``align_moe_weights_for_fi``); 128 for non-gated FP8."""

_SHUFFLE_ROWS = {"trtllm": 32, "deepseek": 16}
"""Rows of one epilogue-shuffle block: epilogue tile M 128 (64 for DeepSeek FP8) / 4."""
_BLOCK_MAJOR_K_BYTES = 128
_SCALE_SWIZZLE_ROWS = 128


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``value``."""
    if multiple < 1:
        raise LayoutError(f"alignment must be a positive integer, got {multiple}")
    return -(-value // multiple) * multiple


def projections(is_act_and_mul: bool) -> int:
    """Stacked projections in W13: 2 (gate and up) or 1."""
    return 2 if is_act_and_mul else 1


BASE_ALIGNMENTS: dict[str, Callable[[bool, int, bool], tuple[int, int]]] = {
    "bf16": lambda trt, p, gated: (64, 64) if trt else (1, 1),
    "fp8": lambda trt, p, gated: (FI_MOE_INTERMEDIATE_MULTIPLE if gated else 128, 1),
    "fp8-block": lambda trt, p, gated: (1, 1),
    "mxfp8": lambda trt, p, gated: (128, 256) if trt else (1, 1),
    "nvfp4": lambda trt, p, gated: (128 // p, 1) if trt else (16, 1),
    "mxfp4": lambda trt, p, gated: (256, 256) if trt else (32, 32),
    "mxint4": lambda trt, p, gated: (1, 1),
}
"""Per format, ``(trtllm, P, gated) -> (intermediate, hidden)`` multiples before the engine profile's overrides
(the table of :func:`default_alignments`); one row a format."""


def default_alignments(
    fmt: str,
    backend: str,
    is_act_and_mul: bool = True,
    is_gated: bool = True,
    engine: Optional[str] = None,
    per_token_activation: bool = False,
    quant_method: Optional[str] = None,
) -> tuple[int, int]:
    """``(intermediate, hidden)`` multiples a plan pads to when none is given.

    The one default every command uses: the base table below (FlashInfer 0.6.13's era),
    overridden by the engine profile's ``alignments`` (:mod:`fimoe_lab.engines`; None: the
    default engine). Base, per format and backend (1 = no padding):

    ============  =========================  ==================
    format        TRT-LLM                    CUTLASS
    ============  =========================  ==================
    bf16          64, 64 (whole 128 B K      1, 1
                  blocks of BlockMajorK)
    fp8           16 gated / 128 non-gated   same
    fp8-block     1, 1 (no padding)          1, 1
    mxfp8         128, 256                   1, 1
    nvfp4         128/P, 1 (128-row scale    16, 1
                  shuffle)
    mxfp4         256, 256 (what vLLM        32, 32
                  allocates)
    mxint4        1, 1 (no padding, every    refused (no CUTLASS
                  profile: vLLM pads none)   MxInt4 MoE)
    ============  =========================  ==================

    A backend that is not in the format's ``backends`` (:data:`fimoe_lab.specs.FORMATS`) is
    refused with a :class:`~fimoe_lab.errors.LayoutError`.

    ``per_token_activation``: NVFP4 activations quantised per token, where a profile's
    ``per_token_non_gated_hidden`` applies to a layer without fused gate/up (vLLM's
    ``trtllm_nvfp4_hidden_alignment(per_token_activation, is_act_and_mul)``); a profile's
    ``non_gated_intermediate`` to a non-gated activation. ``quant_method``: the checkpoint's
    quantization method, for a profile rule keyed on it (``engines.QUANT_METHODS``).
    """
    fmt = get_format(fmt).plan_format
    check_backend(backend)
    _need(
        backend in FORMATS[fmt].backends,
        f"{fmt} has no {backend} layout (backends: {', '.join(FORMATS[fmt].backends)})",
        fix=f"use --backend {' or '.join(FORMATS[fmt].backends)}",
    )
    ia, ha = BASE_ALIGNMENTS[fmt](backend == "trtllm", projections(is_act_and_mul), is_gated)
    rule = get_engine(engine).alignment(fmt, backend, quant_method)
    ia = (rule.non_gated_intermediate if not is_gated else None) or rule.intermediate or ia
    if rule.per_token_non_gated_hidden and per_token_activation and not is_act_and_mul:
        return ia, rule.per_token_non_gated_hidden
    return ia, rule.hidden or ha


def rank_intermediates(
    intermediate: int, tp: int, fmt: str | FormatSpec, whole_block_shards: bool = False, block: Optional[int] = None
) -> tuple[int, ...]:
    """The intermediate size of each of ``tp`` ranks, as the checkpoint reader shards ``fmt`` (a name in
    :data:`fimoe_lab.specs.FORMATS`, or the spec of a checkpoint-only format).

    ``b`` = ``block`` or the format's scale block along the intermediate dim (1 without one);
    ``block`` lets a reader ask for a larger unit (values packed in an int32 word).
    Equal shards (per-expert checkpoints, vLLM's FusedMoE loader): ``I % tp == 0`` and,
    for ``tp > 1``, ``(I / tp) % b == 0`` (a shard must not cut a scale block).
    ``whole_block_shards`` (gpt-oss's fused MXFP4 tensors, vLLM's gpt-oss loader):
    ``I % b == 0``, rank ``r`` gets ``[r * s, min((r + 1) * s, I))`` with
    ``s = ceil(I / b / tp) * b``, and every rank must get at least one block.
    Raises :class:`LayoutError` saying which condition fails.
    """
    spec = fmt if isinstance(fmt, FormatSpec) else get_format(fmt)
    block = block or spec.scale_block or 1
    if tp < 1 or intermediate < 1:
        raise LayoutError(f"tp {tp} and intermediate {intermediate} must be positive", fix="pass tp >= 1")
    if whole_block_shards:
        if intermediate % block:
            raise LayoutError(
                f"intermediate size {intermediate} is not a multiple of the {block}-value {spec.name.upper()} block",
                fix="check the model's sizes",
            )
        per_rank = -(-(intermediate // block) // tp) * block
        sizes = tuple(min((r + 1) * per_rank, intermediate) - r * per_rank for r in range(tp))
        if min(sizes) <= 0:
            raise LayoutError(
                f"tp={tp}: ranks from {-(-intermediate // per_rank)} on get no intermediate rows ({intermediate} "
                f"values = {intermediate // block} {spec.name.upper()} blocks, {per_rank // block} per rank)",
                fix=f"tp <= {intermediate // block}",
            )
        return sizes
    if intermediate % tp:
        raise LayoutError(
            f"tp={tp} does not divide the intermediate size {intermediate}: rank shards would differ in size",
            fix=f"pick tp from {[t for t in range(1, 9) if intermediate % t == 0]}",
        )
    local = intermediate // tp
    if tp > 1 and local % block:
        shape = f"{spec.scale_block_rows}x{block}" if spec.scale_block_rows > 1 else f"{block}-value"
        raise LayoutError(
            f"tp={tp} gives intermediate {local} per rank, not a multiple of the {block} values of one {shape} "
            f"{spec.name.upper()} scale block, so a rank's slice would cut a block (vLLM refuses this too)",
            fix=f"tp in {[t for t in range(1, 9) if intermediate % t == 0 and (intermediate // t) % block == 0]}, "
            f"or pad the intermediate size before sharding",
        )
    return (local,) * tp


def check_kernel_activation(fmt: str, backend: str, activation: str) -> None:
    """Refuse ``activation`` (a name of ``specs.ACTIVATIONS`` or an alias) where the ``fmt`` kernels on
    ``backend`` run another one: its FlashInfer ``ActivationType`` must be in
    ``specs.FORMATS[fmt].kernel_activations`` (empty: any). One :class:`LayoutError` naming both and the fix."""
    spec = FORMATS.get(fmt)
    runs = spec.kernel_activations if spec is not None else ()
    act = get_activation(activation)
    names = " or ".join(a.name for a in ACTIVATIONS.values() if a.flashinfer in runs)
    _need(
        not runs or act.flashinfer in runs,
        f"{fmt} on {backend}: the kernel always runs {names}, not {act.name} (the layer's activation)",
        fix=f"convert {act.name} layers to another format (bf16, fp8 or mxfp4), or only {names} layers to {fmt}",
    )


def _need(ok: bool, message: str, fix: Optional[str] = None) -> None:
    if not ok:
        raise LayoutError(message, fix=fix)


def _rows_and_cols(
    w13_rows: int,
    w2_rows: int,
    w13_cols_bytes: int,
    w2_cols_bytes: int,
    swap: bool,
    interleave: bool,
    shuffle_rows: int,
    block_major: bool,
) -> None:
    """The row and column conditions of a W31 swap, gated interleave, epilogue shuffle and BlockMajorK."""
    if swap or interleave:
        _need(w13_rows % 2 == 0, f"W13 has {w13_rows} rows, which is odd; a fused gate/up matrix has 2 * I rows")
    for rows, what in ((w13_rows, "W13"), (w2_rows, "W2")):
        _need(
            rows % shuffle_rows == 0,
            f"{what}: {rows} rows is not a multiple of {shuffle_rows} (the epilogue shuffle block)",
            fix=f"pad to a multiple of {shuffle_rows} rows",
        )
    if block_major:
        for cols, what in ((w13_cols_bytes, "W13"), (w2_cols_bytes, "W2")):
            _need(
                cols % _BLOCK_MAJOR_K_BYTES == 0,
                f"{what}: K of {cols} bytes is not a multiple of the {_BLOCK_MAJOR_K_BYTES}-byte BlockMajorK block",
                fix="pad the hidden/intermediate dim",
            )


def _pad_blocks(intermediate: int, hidden: int, ia: int, ha: int, block: int, values_per_byte: int) -> tuple[int, int]:
    """``plan_align`` of block-scaled weights: ``round_up`` both; a size that changes must fill
    whole bytes and whole scale blocks."""
    i, h = round_up(intermediate, ia), round_up(hidden, ha)
    if (i, h) != (intermediate, hidden):
        for size, what in ((h, "hidden"), (i, "intermediate")):
            _need(
                size % values_per_byte == 0,
                f"a padded size of {size} values does not fill whole bytes ({values_per_byte} values per byte)",
                fix=f"choose an alignment that is a multiple of {values_per_byte}",
            )
            _need(
                size % block == 0,
                f"padded {what} {size} is not a multiple of the scale block {block}",
                fix=f"choose an alignment that is a multiple of {block}",
            )
    return i, h


def mxint4_shape(layer: LayerShape, choice: LayoutChoice) -> tuple[int, int]:
    """MxInt4 (``special_plans.plan_mxint4``, then ``special_plans.plan_trtllm_mxint4``): no padding, ``(I', H') = (I, H)``.

    Constraints, in the plan's order: backend ``trtllm``; gated act-and-mul (which gated activation is
    :func:`check_kernel_activation`'s, where the caller knows it: the TRTLLM-Gen MxInt4 runner always runs SwiGLU); no per-token
    activations (BF16 activations); an alignment given must not pad (``round_up(I, a_I) == I``,
    ``round_up(H, a_H) == H``: vLLM pads nothing); ``I`` and ``H`` positive multiples of 256.
    """
    intermediate, hidden = layer.intermediate, layer.hidden
    _need(choice.backend == "trtllm", f"MxInt4 has no {choice.backend} layout", fix="use --backend trtllm")
    _need(
        layer.is_act_and_mul and layer.is_gated,
        "MxInt4 TRT-LLM takes SwiGLU (gated) layers only",
        fix="a gated activation",
    )
    _need(
        not choice.per_token_activation,
        "MxInt4 has BF16 activations, not per-token NVFP4",
        fix="drop per_token_activation",
    )
    given = ((intermediate, choice.intermediate_alignment, "intermediate"), (hidden, choice.hidden_alignment, "hidden"))
    for size, a, what in given:
        padded = round_up(size, a or 1)
        _need(padded == size, f"MxInt4: {what} {size} padded to {padded}: vLLM pads nothing", fix="no alignment")
    for size, what in ((intermediate, "intermediate"), (hidden, "hidden")):
        _need(
            size >= 1 and size % _MXINT4_MULTIPLE == 0,
            f"MxInt4: {what} {size} is not a multiple of {_MXINT4_MULTIPLE} (TRT-LLM MxInt4)",
            fix=f"pad it to a multiple of {_MXINT4_MULTIPLE}",
        )
    return intermediate, hidden


_MXINT4_MULTIPLE = 256
"""MxInt4 TRT-LLM: ``I`` and ``H`` multiples of 256: a 128-byte BlockMajorK block holds 256 packed int4
values along K (W13's K is ``H``, W2's is ``I``)."""

_OWN_RULES = {"mxint4": mxint4_shape}
"""Formats ``plan_layer`` lays out by their own rule, not from checkpoint weights of that name
(``specs.FormatSpec.weights`` False): MxInt4, laid out from int4-group checkpoints."""


def padded_shape(
    fmt: str,
    backend: str,
    intermediate: int,
    hidden: int,
    is_act_and_mul: bool = True,
    is_gated: bool = True,
    activation: Optional[str] = None,
    quant_method: Optional[str] = None,
    **options: Any,
) -> tuple[int, int]:
    """``(I', H')`` that ``plan_layer`` with the same arguments pads a rank's ``(I, H)`` to: :func:`layer_shape`
    of the layer and of the :class:`~fimoe_lab.choice.LayoutChoice` the keyword ``options`` make (its fields:
    the alignments, ``engine``, ``per_token_activation``, ``activation_dtype``).

    ``activation`` (a name of ``specs.ACTIVATIONS``; None: not checked): refused, as ``convert`` refuses
    it, where the format's kernel runs another (:func:`check_kernel_activation`: MxInt4 runs SwiGLU only).
    """
    layer = LayerShape(fmt, intermediate, hidden, is_act_and_mul, is_gated, quant_method)
    return layer_shape(layer, LayoutChoice(backend, **options), activation)


def layer_shape(layer: LayerShape, choice: LayoutChoice, activation: Optional[str] = None) -> tuple[int, int]:
    """``(I', H')`` that ``recipes.plan_for(layer, choice)`` pads the layer to.

    Raises the :class:`LayoutError` that the plan raises for these sizes. The
    padding: ``I' = round_up(I, a_I)``, ``H' = round_up(H, a_H)`` with the alignments given
    or :func:`default_alignments` (FP8 per-tensor then to 16 gated / 128 non-gated; FP8-block,
    and MXFP8 on CUTLASS, refuse given alignments that pad). The conditions (``P`` =
    :func:`projections`): vector-scaled formats ``I, H`` whole blocks, and padded sizes whole
    blocks (and bytes); TRT-LLM ``P*I'`` and ``H'`` multiples of 32 (DeepSeek FP8: 16), BF16
    and DeepSeek FP8 K bytes multiples of 128, FP4 ``P*I'`` and ``H'`` and MXFP8 ``P*I'``,
    ``I'``, ``H'`` multiples of 128 (scale shuffle, 128x4 swizzle); DeepSeek FP8 gated
    ``I % 128 == 0``. MxInt4 (its own rule, :func:`mxint4_shape`): TRT-LLM, gated, no per-token, no
    padding, ``I`` and ``H`` multiples of 256. ``activation``: :func:`padded_shape`'s.
    """
    fmt, backend = layer.fmt, choice.backend
    known = (*weight_formats(), *_OWN_RULES)
    if fmt not in known:
        raise LayoutError(f"unknown format {fmt!r}", fix=f"choose one of {', '.join(known)}")
    if backend not in BACKENDS:
        raise LayoutError(f"unknown backend {backend!r}", fix=f"choose one of {', '.join(BACKENDS)}")
    profile = get_engine(choice.engine)
    if fmt in _OWN_RULES:  # its own refusals (gatedness among them) first, then the activation
        shape = _OWN_RULES[fmt](layer, choice)
        if activation is not None:
            check_kernel_activation(fmt, backend, activation)
        return shape
    if activation is not None:
        check_kernel_activation(fmt, backend, activation)
    i, h = _recipe_shape(layer, replace(choice, engine=profile.name))
    rule = profile.kernel_sizes.get(f"{fmt}/{backend}")
    if rule is not None:  # what the profile's preparation helper refuses rather than pads
        p = projections(layer.is_act_and_mul)
        inter = (rule.non_gated_intermediate if not layer.is_gated else None) or rule.intermediate
        for size, multiple, what in (
            (i, inter, "intermediate"),
            (h, rule.hidden, "hidden"),
            (p * i, rule.gemm1_rows, "GEMM1 rows (P x intermediate)"),
        ):
            _need(
                size % multiple == 0,
                f"{profile.name}: {fmt} on {backend}: {what} {size} is not a multiple of {multiple}: {rule.why}",
                fix=f"pad to a multiple of {multiple} (--intermediate-alignment / --hidden-alignment), or give none",
            )
    return i, h


def choice_alignments(layer: LayerShape, choice: LayoutChoice) -> tuple[int, int]:
    """:func:`default_alignments` of ``layer`` under ``choice``'s backend, engine and per-token activations."""
    return default_alignments(
        layer.fmt,
        choice.backend,
        layer.is_act_and_mul,
        layer.is_gated,
        choice.engine,
        choice.per_token_activation,
        layer.quant_method,
    )


def fp8_alignments(layer: LayerShape, choice: LayoutChoice) -> tuple[Optional[int], Optional[int]]:
    """The FP8 family's (FP8 per-tensor, DeepSeek FP8, MXFP8 on CUTLASS with alignments given) ``(a_I, a_H)``
    padded to before the format's own rule: those given, else the profile's ``alignment`` rule when it names
    one (None: no such padding)."""
    ia, ha = choice.intermediate_alignment, choice.hidden_alignment
    rule = get_engine(choice.engine).alignment(layer.fmt, choice.backend, layer.quant_method)
    if not (ia or ha) and (rule.intermediate or rule.hidden):
        return rule.intermediate, rule.hidden
    return ia, ha


def _recipe_shape(layer: LayerShape, choice: LayoutChoice) -> tuple[int, int]:
    """:func:`layer_shape` of a format laid out from checkpoint weights of its name, before the profile's
    ``kernel_sizes``."""
    fmt, backend, intermediate, hidden = layer.fmt, choice.backend, layer.intermediate, layer.hidden
    is_act_and_mul, is_gated = layer.is_act_and_mul, layer.is_gated
    spec, profile = FORMATS[fmt], get_engine(choice.engine)
    if spec.vector_scaled:
        for size, what in ((intermediate, "intermediate"), (hidden, "hidden")):
            _need(
                size % spec.scale_block == 0,
                f"{fmt}: {what} {size} is not a multiple of {spec.scale_block} (one block scale per "
                f"{spec.scale_block} values), so no {fmt} checkpoint holds it",
                fix="a tensor-parallel shard must keep whole scale blocks; choose another TP size",
            )
    trt = backend == "trtllm"
    p = projections(is_act_and_mul)
    ia, ha = choice.intermediate_alignment, choice.hidden_alignment
    if trt and f"{fmt}/{backend}" in profile.trtllm_plain:  # the checkpoint layout as it is: no step, no padding
        return intermediate, hidden
    if fmt == "mxfp8" and (trt or not (ia or ha)):
        da, dh = choice_alignments(layer, replace(choice, per_token_activation=False))
        i, h = _pad_blocks(intermediate, hidden, ia or da, ha or dh, spec.scale_block, 1)
        if trt:  # epilogue shuffle of the weights, then the 128x4 swizzle of their scales
            for rows, cols in ((p * i, h // spec.scale_block), (h, i // spec.scale_block)):
                _need(
                    rows % _SCALE_SWIZZLE_ROWS == 0 and cols % 4 == 0,
                    f"MXFP8 scales [{rows}, {cols}] cannot keep their shape through the 128x4 swizzle: rows must be "
                    f"a multiple of 128 and cols of 4",
                    fix="pad with align_mxfp8_moe_weights_for_fi_trtllm (intermediate 128, hidden 256) first",
                )
        return i, h
    if fmt in ("fp8", "fp8-block", "mxfp8"):
        ia, ha = fp8_alignments(layer, choice)
        i, h = intermediate, hidden
        if ia or ha:
            i, h = round_up(intermediate, ia or 1), round_up(hidden, ha or 1)
            _need(
                (i, h) == (intermediate, hidden) or fmt == "fp8",
                f"custom alignments for {fmt} scales are not supported yet",
                fix="use the default rules",
            )
        if fmt == "fp8":
            if not ia:  # FlashInfer's gated 16 / non-gated 128, unless an intermediate alignment replaces it
                i = round_up(i, default_alignments("fp8", backend, is_act_and_mul, is_gated)[0])
            if trt:
                _rows_and_cols(p * i, h, h, i, is_act_and_mul, is_gated, _SHUFFLE_ROWS["trtllm"], False)
            return i, h
        if fmt == "mxfp8":  # CUTLASS with alignments given that do not pad: no further padding
            return i, h
        rows = FORMATS["fp8-block"].scale_block_rows
        _need(
            not is_act_and_mul or i % rows == 0,
            f"intermediate {i} is not a multiple of the {rows}-row scale block, so gate and up would share a "
            f"scale row and cannot be swapped apart",
            fix=f"choose a tensor-parallel size whose shard keeps intermediate % {rows} == 0",
        )
        if trt:
            _rows_and_cols(p * i, h, h, i, False, False, _SHUFFLE_ROWS["deepseek"], True)
        return i, h
    da, dh = choice_alignments(layer, choice)
    if fmt == "bf16":
        i, h = round_up(intermediate, ia or da), round_up(hidden, ha or dh)
        if trt:
            _rows_and_cols(p * i, h, 2 * h, 2 * i, is_gated, is_gated, _SHUFFLE_ROWS["trtllm"], True)
        return i, h
    i, h = _pad_blocks(intermediate, hidden, ia or da, ha or dh, spec.scale_block, spec.values_per_byte)
    if trt:
        _rows_and_cols(p * i, h, h // 2, i // 2, is_act_and_mul, is_gated, _SHUFFLE_ROWS["trtllm"], False)
        for rows, fix in (
            (p * i, f"pad the intermediate size to a multiple of {128 // p} first (intermediate_alignment={128 // p})"),
            (h, "pad the hidden size to a multiple of 128 first (hidden_alignment=128)"),
        ):
            _need(
                rows % _SCALE_SWIZZLE_ROWS == 0,
                f"FP4 scales have {rows} rows, not a multiple of 128 (the TRT-LLM scale shuffle)",
                fix=fix,
            )
    return i, h
