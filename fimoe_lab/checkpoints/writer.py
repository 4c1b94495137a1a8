"""Kernel-layout files: convert checkpoint layers with a LayerPlan, stream them out, restore.

``convert`` writes, per MoE layer, ``w13_weight``, ``w2_weight``, ``w13_weight_scale``,
``w2_weight_scale`` in FlashInfer's kernel layout (vLLM's parameter names), gpt-oss biases
moved with their weight's rows, and the other extras unchanged (NVFP4
``weight_scale_2``/``input_scale``), then every other tensor of the source unchanged under its own name
(:mod:`~fimoe_lab.checkpoints.unchanged`; rank 0's output only): into a directory of shards in the Hugging
Face convention (``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``), or one file.
The metadata records nothing of the machine (no path, no time: :func:`source_info`).

The metadata key ``fimoe_lab`` holds JSON (file format version 2; every shard holds the same,
with the checksums of its own tensors), per layer:

- ``plan``: ``{"recipe": "<fmt>/<backend>", "args": {...}}``, the :data:`fimoe_lab.recipes.RECIPES`
  id and the :func:`fimoe_lab.recipes.plan_layer` arguments (format, backend, sizes, gating,
  alignments) that rebuild the plan (plans are deterministic);
- ``tensors``: per tensor its kernel name, its steps as ``[{"kind", "params"}, ...]``
  (:meth:`IndexMap.spec`, each step rebuilt by ``steps.build(kind, params)``; a word bit step,
  ``sm90_mixed_word_bits`` of the SM90 MXFP4 x BF16 layout, comes after the byte steps and runs on
  every 32-bit word of the tensor: :attr:`LayerPlan.word_bits`) and its checkpoint and kernel dtype/shape; ``extras``: dtype/shape, and for a per-row bias the
  weight whose rows it follows (``rows_of``) with those row steps.

:func:`restore_layers` rebuilds the plan from recipe and arguments, checks that the recorded
steps equal the rebuilt ones, and applies ``plan.inverse()`` (word bits undone first). Version-1 files (a ``builder``
module path and display names of the steps) still restore: see :func:`check_record`.

- ``checksums``: ``{tensor name: sha256 hex of its bytes}``, computed while streaming;
  restore verifies each tensor it reads (:func:`check_digest`).

Streaming (:mod:`fimoe_lab.checkpoints.stream`): one layer is read at a time and converted a
chunk of experts at a time (every map works expert by expert), while worker threads hash
and write earlier chunks at their offsets; restore reads each tensor a chunk of experts at
a time (safetensors slices) and writes the layer before reading the next. Every file goes to
a temporary created exclusively beside it, fsynced and renamed only when complete
(:mod:`fimoe_lab.checkpoints.safe_io`): an interrupted or failed conversion leaves no partial
file (and, sharded, no index until every shard is in place), and an existing output is
replaced only with ``force`` and only if this tool wrote it. Restore bounds every size a
record gives by the file's own bytes before it builds anything (:func:`_check_sizes`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Optional

import torch

from fimoe_lab import engines, recipes, untrusted
from fimoe_lab.checkpoints import conventions, safe_io, stream, unchanged
from fimoe_lab.checkpoints import request as requests
from fimoe_lab.checkpoints.conventions import dtype_name
from fimoe_lab.checkpoints.reader import Checkpoint, CheckpointError, MoELayer
from fimoe_lab.errors import FimoeError
from fimoe_lab.layout import IndexMap
from fimoe_lab.plan import BIAS_ROWS, LayerPlan, apply_map
from fimoe_lab.shapes import check_kernel_activation
from fimoe_lab.specs import FORMATS, weight_formats

__all__ = [
    "FORMAT_VERSION",
    "READ_VERSIONS",
    "KERNEL_NAMES",
    "LayoutChoice",
    "plan_args",
    "build_plan",
    "suggest_alignment",
    "convert_layer",
    "write_kernel_layout",
    "layout_plan",
    "stream_layers",
    "expert_range",
    "LayerLoader",
    "convert_checkpoint",
    "read_kernel_metadata",
    "check_record",
    "restore_layers",
    "restore_checkpoint",
    "check_digest",
    "KernelFiles",
]

FORMAT_VERSION = 2
"""Version written: plans by recipe id, steps as kind/params."""
READ_VERSIONS = (1, 2)
V1_BUILDER = "fimoe_lab.prepare.plan_layer"
"""What version-1 files recorded as their plan ``builder`` (read only: version 2 records a recipe id)."""


KERNEL_NAMES = {"w13": "w13_weight", "w2": "w2_weight", "w13_scale": "w13_weight_scale", "w2_scale": "w2_weight_scale"}
"""Tensor names in a kernel-layout file (vLLM's FusedMoE parameter names)."""


# ============================================================================ plans
@dataclass(frozen=True)
class LayoutChoice:
    """What a convert asks of every layer's plan, whatever the layer: the kernel ``backend``, the alignments
    (None: the engine profile's), the ``engine`` profile (None: ``engines.DEFAULT_ENGINE``), ``per_token`` NVFP4
    activations and the ``activation_dtype`` where a recipe has a layout per dtype. The fields are
    :func:`plan_args`'s and :func:`convert_layer`'s keyword arguments (``**choice.kwargs()``)."""

    backend: str
    intermediate_alignment: Optional[int] = None
    hidden_alignment: Optional[int] = None
    engine: Optional[str] = None
    per_token: bool = False
    activation_dtype: Optional[str] = None

    def kwargs(self) -> dict:
        return asdict(self)


def plan_args(
    layer: MoELayer,
    backend: str,
    intermediate_alignment: Optional[int] = None,
    hidden_alignment: Optional[int] = None,
    engine: Optional[str] = None,
    per_token: bool = False,
    activation_dtype: Optional[str] = None,
) -> dict:
    """The record that rebuilds this layer's plan: ``{"recipe": id, "args": plan_layer keyword arguments}``.

    ``per_token``: NVFP4 activations quantised per token (``plan_layer``'s ``per_token_activation``: the
    profile's per-token paddings apply), recorded as ``args["per_token_activation"]``; files written without
    it rebuild with False (``plan_layer``'s default). Refused for a format without per-token activations
    (``specs.FORMATS[fmt].tactics.per_token_ok``). ``activation_dtype``: the activations the kernel takes where
    the recipe has a layout per activation dtype (``recipes.ACTIVATION_DTYPES``: ``"bf16"`` for MXFP4 on CUTLASS is
    the Hopper SM90 mixed-input layout), recorded as ``args["activation_dtype"]`` when given; refused for
    any other recipe. The layer's convention's quantization method (``Convention.quant_method``: some engine
    rules are keyed on it) is recorded as ``args["quant_method"]`` when it has one. A checkpoint format whose ``layout_format`` names a
    format of ``specs.FORMATS`` (int4-group -> mxint4) is planned as that format.

    ``engine``: the profile (:mod:`fimoe_lab.engines`; None: ``engines.DEFAULT_ENGINE``),
    recorded by its resolved name so that ``restore`` rebuilds with the same defaults. Files
    that record none were written before profiles and rebuild with ``engines.LEGACY_ENGINE``
    (:func:`build_plan`). A checkpoint-only format (``conventions.MISSING_LAYOUT``) is refused naming the
    layout ``backend`` lacks.
    """
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
    if per_token and not (tactics is not None and tactics.per_token_ok):
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
    return {
        "recipe": recipes.recipe_id(fmt, backend),
        "args": {
            "fmt": fmt,
            "backend": backend,
            "intermediate": layer.intermediate,
            "hidden": layer.hidden,
            "is_act_and_mul": layer.is_act_and_mul,
            "is_gated": layer.is_gated,
            "intermediate_alignment": intermediate_alignment,
            "hidden_alignment": hidden_alignment,
            "engine": engines.get_engine(engine or engines.DEFAULT_ENGINE).name,
            "per_token_activation": bool(per_token),
            **({} if activation_dtype is None else {"activation_dtype": activation_dtype}),
            **({} if method is None else {"quant_method": method}),
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
            fix=_EDITED,
        )
    if not isinstance(args.get("quant_method"), (str, type(None))):
        raise CheckpointError(
            f"quant_method {args['quant_method']!r} in the plan record is not a method name", fix=_EDITED
        )
    if not isinstance(args.get("activation_dtype"), (str, type(None))):
        raise CheckpointError(
            f"activation_dtype {args['activation_dtype']!r} in the plan record is not a dtype name", fix=_EDITED
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
            build_plan(plan_args(layer, **replace(choice, intermediate_alignment=a, hidden_alignment=None).kwargs()))
            return a
        except ValueError:
            continue
    return None


def convert_layer(
    layer: MoELayer,
    backend: str,
    intermediate_alignment: Optional[int] = None,
    hidden_alignment: Optional[int] = None,
    engine: Optional[str] = None,
    per_token: bool = False,
    activation_dtype: Optional[str] = None,
) -> tuple[dict[str, torch.Tensor], LayerPlan, dict]:
    """One layer into the kernel layout: ``(tensors by kernel name, plan, plan spec)``.

    ``engine``: the profile whose defaults and layouts apply (:mod:`fimoe_lab.engines`;
    None: the newest vLLM's, ``engines.DEFAULT_ENGINE``). Only bytes move (block scales are
    not clamped; see ``inspect`` for dead scales). Biases (gpt-oss) follow their weight's
    rows; other extras pass unchanged. ``per_token``, ``activation_dtype``: :func:`plan_args`. A checkpoint format
    with a :data:`~fimoe_lab.checkpoints.conventions.WEIGHT_XOR` byte (int4-group: ``q + 8`` ->
    two's complement) has its weight bytes XORed with it first (a copy; the layer is untouched).
    """
    spec = plan_args(layer, backend, intermediate_alignment, hidden_alignment, engine, per_token, activation_dtype)
    plan = build_plan(spec)
    outs = plan.apply(
        _xor_weight(layer.w13.contiguous(), layer.fmt),
        _xor_weight(layer.w2.contiguous(), layer.fmt),
        None if layer.w13_scale is None else layer.w13_scale.contiguous(),
        None if layer.w2_scale is None else layer.w2_scale.contiguous(),
    )
    tensors = {KERNEL_NAMES[n]: t for n, t in zip(KERNEL_NAMES, outs) if t is not None}
    for name, t in layer.extras.items():
        tensors[name] = _map_extra(plan, name, t, inverse=False)
    return tensors, plan, spec


def _xor_weight(t: torch.Tensor, checkpoint_fmt: str) -> torch.Tensor:
    """``t`` (a weight in checkpoint format ``checkpoint_fmt``) with every byte XORed with the format's
    :data:`~fimoe_lab.checkpoints.conventions.WEIGHT_XOR` byte (a new tensor), or ``t`` itself without one.
    Its own inverse: convert applies it before the layout steps, restore after their inverse."""
    xor = conventions.WEIGHT_XOR.get(checkpoint_fmt, 0)
    if not xor:
        return t
    return (t.contiguous().view(torch.uint8) ^ xor).view(t.dtype)


def _extra_map(plan: LayerPlan, name: str, t: torch.Tensor) -> Optional[IndexMap]:
    """The map of an extra tensor: a bias follows its weight's rows; other extras (None) stay as they are."""
    return plan.bias_map(name, t.element_size()) if name in BIAS_ROWS else None


def _map_extra(plan: LayerPlan, name: str, t: torch.Tensor, inverse: bool) -> torch.Tensor:
    """An extra tensor in the kernel layout (or back, with ``inverse``)."""
    m = _extra_map(plan, name, t)
    if m is None:
        return t
    return apply_map(m.inverse() if inverse else m, t.contiguous(), name)


def _tensor_steps(plan: LayerPlan, name: str) -> list[dict]:
    """What a file records as the steps of tensor ``name``: ``[{"kind", "params"}, ...]`` ([] when unmoved)."""
    return plan.tensor_steps(name)


def _extra_steps(plan: LayerPlan, name: str) -> dict:
    """What a file records for an extra: ``{"rows_of": weight or None, "steps": that weight's row steps}``.

    A per-row bias moves as the leading row-keeping steps of its weight (:meth:`IndexMap.row_steps`);
    other extras stay as they are.
    """
    weight = BIAS_ROWS.get(name)
    m = getattr(plan, weight) if weight else None
    return {"rows_of": weight, "steps": m.row_steps().spec() if m is not None else []}


# ============================================================================ writing
LayerSource = tuple[int, MoELayer, Callable[[], MoELayer]]
"""(layer index, layer with shapes only (meta tensors allowed), loader of the real layer)."""


def _out_name(prefix: str, block: str, layer: int, name: str) -> str:
    return f"{prefix}{layer}.{block}.experts.{name}"


def _dtype_shape(dtype: torch.dtype, shape: Sequence[int]) -> dict:
    return {"dtype": dtype_name(dtype), "shape": list(shape)}


def _dry_run(layer: MoELayer, choice: LayoutChoice) -> tuple[dict, LayerPlan, dict]:
    """Kernel ``(dtype, shape)`` by kernel name of a layer (shapes only; meta tensors allowed), from
    a one-expert conversion; with the plan and its :func:`plan_args` record."""

    def one_expert(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else torch.zeros((1,) + tuple(t.shape[1:]), dtype=t.dtype)

    probe = layer.with_tensors(**{n: one_expert(t) for n, t in layer.tensors().items()})
    probe = replace(probe, extras={n: one_expert(t) for n, t in layer.extras.items()})
    tensors, plan, spec = convert_layer(probe, **choice.kwargs())
    return {n: (t.dtype, (layer.num_experts,) + tuple(t.shape[1:])) for n, t in tensors.items()}, plan, spec


def _kernel_specs(layer: MoELayer, choice: LayoutChoice) -> tuple[dict, dict]:
    """Kernel dtypes/shapes of a layer (:func:`_dry_run`) and its metadata record (module docstring;
    ``checkpoint_format`` only where the layer's format is not the recipe's, int4-group for mxint4)."""
    kernel, plan, spec = _dry_run(layer, choice)
    record = {
        "plan": spec,
        **({"checkpoint_format": layer.fmt} if layer.fmt != spec["args"]["fmt"] else {}),
        "description": plan.description,
        "padded_intermediate": plan.padded_intermediate,
        "padded_hidden": plan.padded_hidden,
        "activation": layer.activation,
        "activation_params": layer.activation_params,
        "tensors": {
            n: {
                "name": KERNEL_NAMES[n],
                "steps": _tensor_steps(plan, n),
                "checkpoint": _dtype_shape(t.dtype, t.shape),
                "kernel": _dtype_shape(*kernel[KERNEL_NAMES[n]]),
            }
            for n, t in layer.tensors().items()
            if t is not None
        },
        "extras": {
            n: {
                "dtype": dtype_name(t.dtype),
                "shape": list(t.shape),
                "kernel_shape": list(kernel[n][1]),
                **_extra_steps(plan, n),
            }
            for n, t in layer.extras.items()
        },
    }
    return kernel, record


def write_kernel_layout(
    out: str | os.PathLike,
    sources: Sequence[LayerSource],
    backend: str,
    *,
    intermediate_alignment: Optional[int] = None,
    hidden_alignment: Optional[int] = None,
    prefix: str = "model.layers.",
    block: str = "mlp",
    info: Optional[dict] = None,
    progress: bool = False,
    force: bool = False,
    engine: Optional[str] = None,
    single_file: Optional[bool] = None,
    shard_size: Optional[int] = None,
    resume: bool = False,
    device: str = "cpu",
    per_token: bool = False,
    activation_dtype: Optional[str] = None,
    request: Optional[dict] = None,
    kept: Optional[unchanged.Unchanged] = None,
) -> Path:
    """Convert and stream layers into the kernel layout at ``out``: one safetensors file
    (:func:`~fimoe_lab.checkpoints.safe_io.single_output`: ``single_file``, or ``out`` ends in
    ``.safetensors`` or is a file), else a directory of shards of at most ``shard_size`` bytes
    (default :data:`~fimoe_lab.checkpoints.stream.SHARD_BYTES`) with a Hugging Face index.

    ``sources``: ``(layer index, shape-only layer, loader)``; every plan is built and checked
    first (a layer that cannot be laid out fails before anything is written), then each layer
    is loaded and converted in chunks of experts (:func:`convert_layer` on
    ``experts[e0:e1]``; every map works expert by expert), each chunk hashed and written at its
    offset by worker threads while the next is converted (:mod:`fimoe_lab.checkpoints.stream`).
    Memory: the loaded layer and a few chunks. ``device`` ``cuda`` converts on the GPU,
    through pinned host buffers. ``info`` goes into the metadata, with a sha256 per tensor. ``kept``: the
    source tensors written unchanged after the layers (:mod:`~fimoe_lab.checkpoints.unchanged`; None: none).

    A single file is written to a temporary and renamed when complete; shards are renamed one by
    one and the index written last, so an interrupted run leaves finished shards and no index,
    and ``resume`` keeps the shards that verify (:func:`~fimoe_lab.checkpoints.stream.verify_shard`).
    An existing ``out`` is replaced only with ``force`` (or resumed) and only if this tool wrote it.
    ``request``: what was asked (:func:`fimoe_lab.checkpoints.request.convert_request`), recorded in
    every file written (what ``resume`` compares).
    """
    out = Path(out)
    single = safe_io.single_output(out, single_file)
    safe_io.check_output(out, [], force or (resume and single), "file" if single else "shards", resume)
    dev = _device(device)
    choice = LayoutChoice(backend, intermediate_alignment, hidden_alignment, engine, per_token, activation_dtype)
    specs, meta = layout_plan(sources, choice, prefix=prefix, block=block, info=info, kept=kept)
    if not single:
        os.makedirs(out, exist_ok=True)
    with safe_io.signals_raise(), safe_io.OutputLock(out):
        target = stream.ShardedOutput(
            out,
            specs,
            requests.request_metadata({"fimoe_lab": meta}, request),
            single=single,
            shard_bytes=shard_size or stream.SHARD_BYTES,
            checksum_key="fimoe_lab",
            resume=resume,
        )
        bar = _progress_bar(progress, specs, target, out)
        try:
            with stream.workers_for(target, hashing=True) as workers:
                stream_layers(target, workers, sources, meta, choice, dev=dev, bar=bar, kept=kept)
                target.finish(workers)
        finally:
            if bar is not None:
                bar.close()
    return out


def layout_plan(
    sources: Sequence[LayerSource],
    choice: LayoutChoice,
    *,
    prefix: str,
    block: str,
    info: Optional[dict],
    kept: Optional[unchanged.Unchanged] = None,
) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], dict]:
    """What :func:`write_kernel_layout` writes, from shapes alone: ``(kernel dtype and shape by output tensor
    name, in order, then the ``kept`` unchanged tensors; the ``fimoe_lab`` metadata)``. Deterministic (a
    distributed convert builds it on every process); a layer that cannot be laid out is one CheckpointError
    naming an alignment that works."""
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    records = {}
    for idx, shape_layer, _ in sources:
        try:
            kernel, record = _kernel_specs(shape_layer, choice)
        except ValueError as exc:
            a = suggest_alignment(shape_layer, choice) if choice.intermediate_alignment is None else None
            fix = (
                f"intermediate alignment {a} works (CLI: --intermediate-alignment {a})"
                if a
                else getattr(exc, "fix", None)
            )
            raise CheckpointError(
                f"layer {idx} ({shape_layer.fmt}, intermediate {shape_layer.intermediate}, hidden "
                f"{shape_layer.hidden}) cannot be laid out for {choice.backend}: "
                f"{exc.message if isinstance(exc, FimoeError) else exc}",
                fix=fix,
            ) from exc
        for n, spec in kernel.items():
            specs[_out_name(prefix, block, idx, n)] = spec
        records[str(idx)] = record
    clash = sorted(set(specs) & set(kept.names)) if kept is not None else []
    if clash:
        raise CheckpointError(
            f"{clash[0]} is both a converted tensor name and a source tensor carried through unchanged",
            fix="the source holds a tensor under a kernel-layout name: was it converted already?",
        )
    specs.update(kept.specs() if kept is not None else {})
    meta = {
        "version": FORMAT_VERSION,
        "backend": choice.backend,
        "prefix": prefix,
        "block": block,
        **(info or {}),
        "layers": records,
    }
    return specs, meta


def stream_layers(
    target: stream.ShardedOutput,
    workers: stream.Workers,
    sources: Sequence[LayerSource],
    meta: dict,
    choice: LayoutChoice,
    *,
    dev: torch.device,
    bar: Any = None,
    kept: Optional[unchanged.Unchanged] = None,
) -> None:
    """Load, convert and put into ``target`` every layer of ``sources`` that holds a tensor ``target`` still
    needs (:meth:`~fimoe_lab.checkpoints.stream.ShardedOutput.needed`), one layer in memory, a chunk of
    experts at a time (:func:`_layer_chunks`), then copy the ``kept`` unchanged tensors it still needs;
    ``meta``: from :func:`layout_plan`."""
    prefix, block = meta["prefix"], meta["block"]
    for idx, shape_layer, load in sources:
        names = {
            n: _out_name(prefix, block, idx, n) for n in (*KERNEL_NAMES.values(), *meta["layers"][str(idx)]["extras"])
        }
        if not any(target.needed(full) for full in names.values() if full in target.specs):
            continue
        workers.drain()  # the previous layer's chunks are out: one layer in memory
        chunks = _layer_chunks(shape_layer, load, choice, dev)
        for tensors in chunks:  # each block is freed with the generator once its last chunk is out
            for n in list(tensors):
                t = tensors.pop(n)
                counted = bar is not None and target.needed(names[n])  # before put: a finished shard is done
                target.put(workers, names[n], t)
                if counted:
                    bar.update(t.numel() * t.element_size())
                del t
    if kept is not None:
        workers.drain()
        kept.put(target, workers, bar)


def _progress_bar(
    progress: Any, specs: dict, target: stream.ShardedOutput, out: Path, what: str = "convert", total: int = 0
) -> Any:
    """None (``progress`` false), a tqdm bar (True), or ``progress(total=, unit=, unit_scale=, desc=)`` when it is a
    bar class of that interface (the CLI's plain lines for logs and pipes, ``cli._common.PlainProgress``); its
    total: ``total`` plus the bytes of the tensors of ``specs`` that ``target`` still needs."""
    if not progress:
        return None
    from tqdm.auto import tqdm

    total += sum(
        int(torch.Size(s).numel()) * torch.empty((), dtype=d).element_size()
        for n, (d, s) in specs.items()
        if target.needed(n)
    )
    bar = progress if callable(progress) else tqdm
    return bar(total=total, unit="B", unit_scale=True, desc=untrusted.printable(f"{what} -> {out.name}"))


def _device(device: str) -> torch.device:
    """``cpu`` or a CUDA device torch can use (else one CheckpointError)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise CheckpointError(f"device {device!r} is not 'cpu' or 'cuda[:N]'", fix="pass --device cpu or --device cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CheckpointError(
            f"--device {device}: torch sees no CUDA GPU on this machine (torch.cuda.is_available() is False)",
            fix="run on a GPU host with a CUDA build of torch, or convert with --device cpu",
        )
    return dev


def _converted_chunks(
    layer: MoELayer, choice: LayoutChoice, dev: torch.device, step: Optional[int] = None
) -> Iterator[dict[str, torch.Tensor]]:
    """The layer in the kernel layout, a chunk of ``step`` experts at a time (default :func:`_chunk_experts`;
    :func:`convert_layer` on ``[e0:e1]`` of every tensor; kernel tensors by name, on the CPU). With a CUDA
    ``dev``: staged through pinned host buffers."""
    parts = {n: t for n, t in layer.tensors().items() if t is not None}
    e_count = layer.num_experts
    step = step or _chunk_experts(layer)
    for e0 in range(0, e_count, step):
        cut = lambda t, e0=e0: _to_device(t[e0 : e0 + step].contiguous(), dev)  # noqa: E731
        sub = replace(
            layer.with_tensors(**{n: cut(t) for n, t in parts.items()}),
            extras={n: cut(t) for n, t in layer.extras.items()},
        )
        tensors, _, _ = convert_layer(sub, **choice.kwargs())
        if dev.type == "cuda":
            tensors = {n: _to_host(t) for n, t in tensors.items()}
            torch.cuda.current_stream(dev).synchronize()
        yield {n: t.contiguous() for n, t in tensors.items()}


def _chunk_experts(layer: MoELayer) -> int:
    """Experts per chunk of ``layer`` (shapes suffice: meta tensors allowed), :func:`stream.experts_per_chunk`."""
    parts = [t for t in (*layer.tensors().values(), *layer.extras.values()) if t is not None]
    layer_bytes = sum(t.numel() * t.element_size() for t in parts)
    return stream.experts_per_chunk(layer_bytes // max(1, layer.num_experts), layer_bytes)


def _layer_chunks(
    shape_layer: MoELayer, load: Callable[[], MoELayer], choice: LayoutChoice, dev: torch.device
) -> Iterator[dict[str, torch.Tensor]]:
    """:func:`_converted_chunks` of one layer. From a checkpoint (a :class:`LayerLoader`): read a block of
    experts (one chunk, :func:`_chunk_experts`) at a time on a reader thread, block ``k+1`` while block ``k``
    is converted and handed to the writers, so reading overlaps the transform and about two blocks are
    resident; for a CUDA ``dev`` the reader also stages each block in pinned memory (:func:`_pinned`). Any other
    loader: the whole layer, chunked."""
    if not isinstance(load, LayerLoader):
        yield from _converted_chunks(load(), choice, dev)
        return
    step, e_count = _chunk_experts(shape_layer), shape_layer.num_experts
    blocks = [(e0, min(e0 + step, e_count)) for e0 in range(0, e_count, step)]
    read = (lambda b: _pinned(load(b))) if dev.type == "cuda" else load
    with ThreadPoolExecutor(1, thread_name_prefix="fimoe-lab-reader") as reader:
        pending = reader.submit(read, blocks[0])
        for after in [*blocks[1:], None]:
            block = pending.result()
            if after is not None:
                pending = reader.submit(read, after)
            yield from _converted_chunks(block, choice, dev, step)
            del block


def _pinned(layer: MoELayer) -> MoELayer:
    """``layer`` with every tensor copied into page-locked host memory. Run on the reader thread, so that this
    copy overlaps the previous block's GPU work, and the chunks cut from it go to the GPU without another."""
    pinned = {n: t.pin_memory() for n, t in layer.tensors().items() if t is not None}
    return replace(layer.with_tensors(**pinned), extras={n: t.pin_memory() for n, t in layer.extras.items()})


def _to_device(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    if dev.type == "cpu":
        return t
    if t.is_pinned():  # a chunk of a block staged by _pinned
        return t.to(dev, non_blocking=True)
    pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    pinned.copy_(t)
    return pinned.to(dev, non_blocking=True)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    pinned.copy_(t, non_blocking=True)
    return pinned


def convert_checkpoint(
    src: str | os.PathLike,
    out: str | os.PathLike,
    backend: str,
    tp_size: int = 1,
    tp_rank: int | str = 0,
    layers: Optional[Iterable[int]] = None,
    intermediate_alignment: Optional[int] = None,
    hidden_alignment: Optional[int] = None,
    progress: bool = False,
    force: bool = False,
    engine: Optional[str] = None,
    single_file: Optional[bool] = None,
    shard_size: Optional[int] = None,
    resume: bool = False,
    device: str = "cpu",
    ep_size: int = 1,
    per_token: bool = False,
    activation_dtype: Optional[str] = None,
) -> Path:
    """Read ``src`` (rank ``tp_rank`` of ``tp_size``), convert its MoE layers for ``backend``, write ``out``: a
    whole checkpoint, the converted layers in the kernel layout and every other tensor of ``src`` unchanged
    (in the output of rank 0 only: :mod:`~fimoe_lab.checkpoints.unchanged`; the routed experts of MoE layers
    left out of ``layers`` are not written).

    ``per_token``: NVFP4 activations quantised per token: the engine profile's per-token paddings apply
    (``recipes.plan_layer(..., per_token_activation=True)``), recorded in every layer's plan arguments;
    refused (before anything is written) for a format without per-token activations. ``activation_dtype``:
    the kernel's activations where the recipe has a layout per activation dtype (``"bf16"``: MXFP4 on the
    Hopper SM90 CUTLASS kernel, :func:`fimoe_lab.recipes.plan_cutlass_mxfp4_bf16`), recorded likewise.

    ``ep_size``: expert parallelism within the ``tp_size`` ranks (:func:`rank_part`): rank ``r`` holds the
    contiguous experts :func:`expert_range` of EP rank ``r // (tp_size / ep_size)``, sliced along the
    intermediate dim as rank ``r % (tp_size / ep_size)`` of ``tp_size / ep_size`` (SGLang's moe-TP).

    ``engine``: the profile (``vllm-0.34`` by default; :mod:`fimoe_lab.engines`), recorded in the file.
    Output, streaming, ``resume`` and ``device``: :func:`write_kernel_layout`. ``tp_rank="all"``
    writes every rank, rank ``r`` into the sharded directory ``out/rank-<r>``.

    ``out`` is vetted before anything is read (never the input, inside it or a parent of it;
    an existing one only with ``force`` or ``resume`` and only if this tool wrote it).
    """
    out = Path(out)
    single = safe_io.single_output(out, single_file)
    ranks = _ranks(tp_size, tp_rank, single)
    moe_tp_size(tp_size, ep_size)
    safe_io.check_output(out, [Path(src)], force or (resume and single), "file" if single else "shards", resume)
    _device(device)
    # a second writer of OUT fails before reading; SIGTERM from here on removes the lock (and any temporary)
    with safe_io.signals_raise(), safe_io.OutputLock(out), Checkpoint(src) as ck:
        wanted = wanted_layers(ck, src, layers)
        about = source_info(ck, src)
        choice = LayoutChoice(backend, intermediate_alignment, hidden_alignment, engine, per_token, activation_dtype)
        asked = request_of(ck, choice, tp_size, ep_size, tp_rank, wanted, single, shard_size)
        if resume and not force:
            requests.check_resume(out, asked)
        if tp_rank == "all":
            os.makedirs(out, exist_ok=True)
        for rank in ranks:
            sources, info = rank_part(ck, wanted, about, tp_size, ep_size, rank, progress)
            write_kernel_layout(
                out / f"rank-{rank}" if tp_rank == "all" else out,
                sources,
                backend,
                intermediate_alignment=intermediate_alignment,
                hidden_alignment=hidden_alignment,
                prefix=ck.prefix,
                block=ck.convention.block,
                info=info,
                progress=progress,
                force=force,
                engine=engine,
                single_file=single,
                shard_size=shard_size,
                resume=resume,
                device=device,
                per_token=per_token,
                activation_dtype=activation_dtype,
                request=asked,
                kept=unchanged.for_rank(ck, rank),
            )
        if tp_rank == "all":
            safe_io.remove_own(out, {f"rank-{r}" for r in ranks})
    return out


def request_of(
    ck: Checkpoint,
    choice: LayoutChoice,
    tp_size: int,
    ep_size: int,
    tp_rank: int | str,
    wanted: list[int],
    single: bool,
    shard_size: Optional[int],
) -> dict:
    """What this convert was asked (:func:`fimoe_lab.checkpoints.request.convert_request`), recorded in every
    file it writes and compared by ``resume``."""
    return requests.convert_request(
        ck.path,
        ck.config,
        list(ck.weight_map.values()),
        choice.kwargs(),
        tp_size=tp_size,
        ep_size=ep_size,
        tp_rank=tp_rank,
        layers=wanted,
        single=single,
        shard_size=shard_size or stream.SHARD_BYTES,
    )


def wanted_layers(ck: Checkpoint, src: str | os.PathLike, layers: Optional[Iterable[int]]) -> list[int]:
    """``layers`` (None: every MoE layer of ``ck``); a layer without routed experts is one CheckpointError."""
    wanted = ck.moe_layers if layers is None else list(layers)
    missing = [l for l in wanted if l not in ck.moe_layers]
    if missing:
        raise CheckpointError(
            f"{src}: layers {missing} have no routed experts", fix=f"choose from the MoE layers {ck.moe_layers}"
        )
    return wanted


def source_info(ck: Checkpoint, src: str | os.PathLike) -> dict:
    """The metadata about the source, nothing of the machine (no path, no time): ``source_files``
    ``{file name: its content identity}`` (:func:`~fimoe_lab.checkpoints.request.header_identity`), convention and
    config. The same source anywhere gives the same record, so the same files."""
    files = sorted(set(ck.weight_map.values()))
    return {
        "source_files": {f: requests.header_identity(ck.path / f) for f in files},
        "convention": ck.convention.name,
        "config": ck.config,
    }


class LayerLoader:
    """Loader of layer ``layer`` of rank ``rank`` of ``tp_size`` of a checkpoint: ``load()`` reads the whole
    layer, ``load((e0, e1))`` experts ``e0 .. e1-1`` (:meth:`Checkpoint.read_layer`'s ``experts``)."""

    def __init__(self, ck: Checkpoint, layer: int, tp_size: int, rank: int, progress: bool):
        self.ck, self.layer, self.tp_size, self.rank, self.progress = ck, layer, tp_size, rank, progress

    def __call__(self, experts: Optional[tuple[int, int]] = None) -> MoELayer:
        return self.ck.read_layer(self.layer, self.tp_size, self.rank, progress=self.progress, experts=experts)


def rank_info(about: dict, ck: Checkpoint, wanted: list[int], tp_size: int, rank: int) -> dict:
    """What every shard of TP rank ``rank`` records besides the plan: ``about`` (:func:`source_info`), the TP
    size and rank, and each wanted layer's name in the checkpoint (``layer_names``)."""
    return {
        **about,
        "tp_size": tp_size,
        "tp_rank": rank,
        "layer_names": {str(l): ck.layer_names[l] for l in wanted},
    }


def moe_tp_size(tp_size: int, ep_size: int) -> int:
    """The moe-TP size ``tp_size / ep_size`` (``ep_size`` must divide ``tp_size``, as SGLang requires)."""
    if not isinstance(ep_size, int) or isinstance(ep_size, bool) or ep_size < 1 or tp_size % ep_size:
        raise CheckpointError(
            f"expert-parallel size {ep_size!r} does not divide the tensor-parallel size {tp_size}",
            fix="pass --ep N with N dividing --tp (--tp 8 --ep 8: experts split 8 ways, no intermediate slicing)",
        )
    return tp_size // ep_size


def expert_range(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """Experts ``[e0, e1)`` of EP rank ``ep_rank`` of ``ep_size``: contiguous, ``E // n`` each and one more for
    the first ``E % n`` ranks, ``e0 = rank * (E // n) + min(rank, E % n)`` (vLLM's linear placement; SGLang's
    ``E / n`` per rank when ``n`` divides ``E``)."""
    base, rem = divmod(num_experts, ep_size)
    e0 = ep_rank * base + min(ep_rank, rem)
    return e0, e0 + base + (1 if ep_rank < rem else 0)


def _experts(layer: MoELayer, e0: int, e1: int) -> MoELayer:
    """Experts ``[e0, e1)`` of ``layer`` (every tensor and extra sliced along its leading expert dim)."""
    return replace(
        layer.with_tensors(**{n: None if t is None else t[e0:e1] for n, t in layer.tensors().items()}),
        extras={n: t[e0:e1] for n, t in layer.extras.items()},
    )


def rank_part(
    ck: Checkpoint, wanted: list[int], about: dict, tp_size: int, ep_size: int, rank: int, progress: bool
) -> tuple[list[LayerSource], dict]:
    """Rank ``rank``'s :data:`LayerSource` list and metadata info (:func:`rank_info`). With ``ep_size > 1``:
    moe-TP rank ``rank % m`` of ``m = tp_size / ep_size`` (:func:`moe_tp_size`), experts
    :func:`expert_range` of EP rank ``rank // m`` only (read as such), and the info records ``ep_size``,
    ``ep_rank``, ``experts`` ``[e0, e1)`` and ``num_experts`` (every layer must have the same count)."""
    if ep_size == 1:  # the reader checks the rank
        return layer_sources(ck, wanted, tp_size, rank, progress), rank_info(about, ck, wanted, tp_size, rank)
    if not 0 <= rank < tp_size:
        raise CheckpointError(
            f"tensor-parallel rank {rank} is not valid for --tp {tp_size}", fix=f"pass --rank 0..{tp_size - 1} or all"
        )
    mtp = moe_tp_size(tp_size, ep_size)
    ep_rank, tp_rank = divmod(rank, mtp)
    sources = layer_sources(ck, wanted, mtp, tp_rank, progress)
    info = rank_info(about, ck, wanted, mtp, tp_rank)
    counts = sorted({shape.num_experts for _, shape, _ in sources})
    if len(counts) != 1 or counts[0] < ep_size:
        raise CheckpointError(
            f"--ep {ep_size} needs layers of one expert count of at least {ep_size}; these have {counts}",
            fix="convert the layers of each expert count separately (--layer), with --ep at most that count",
        )
    e0, e1 = expert_range(counts[0], ep_size, ep_rank)
    info.update(ep_size=ep_size, ep_rank=ep_rank, experts=[e0, e1], num_experts=counts[0])
    part: list[LayerSource] = [
        (l, _experts(shape, e0, e1), (lambda load=load: load((e0, e1)))) for l, shape, load in sources
    ]
    return part, info


def layer_sources(ck: Checkpoint, wanted: list[int], tp_size: int, rank: int, progress: bool) -> list[LayerSource]:
    """:data:`LayerSource` of each wanted layer of TP rank ``rank``: shapes now, tensors when loaded
    (a :class:`LayerLoader`, read a block of experts at a time by :func:`stream_layers`)."""
    return [
        (l, ck.read_layer(l, tp_size, rank, load="none"), LayerLoader(ck, l, tp_size, rank, progress)) for l in wanted
    ]


def _ranks(tp_size: int, tp_rank: int | str, single: bool) -> list[int]:
    if tp_rank == "all":
        if single:
            raise CheckpointError(
                "--rank all writes one sharded directory per rank (OUT/rank-<r>), not one file",
                fix="give OUT as a directory (without .safetensors), or one --rank",
            )
        return list(range(tp_size))
    if not isinstance(tp_rank, int) or isinstance(tp_rank, bool):
        raise CheckpointError(
            f"tensor-parallel rank {tp_rank!r} is not an integer or 'all'", fix="pass --rank R or --rank all"
        )
    return [tp_rank]


# ============================================================================ restoring
def read_kernel_metadata(path: str | os.PathLike) -> dict:
    """The ``fimoe_lab`` metadata of what convert wrote: a file, or a sharded directory (its shards'
    metadata, which must agree, with their checksums merged). ``CheckpointError`` if it has none or a
    newer version."""
    with KernelFiles(path) as kf:
        return kf.meta


def _parse_meta(path: Path, raw: Optional[str]) -> dict:
    if raw is None:
        raise CheckpointError(
            f"{path} has no 'fimoe_lab' metadata: it was not written by 'fimoe-lab convert', so the "
            f"steps that produced its layout are unknown",
            fix="convert the source checkpoint with 'fimoe-lab convert'",
        )
    meta = untrusted.parse_json(raw, f"{path}: its 'fimoe_lab' metadata", _EDITED, CheckpointError)
    if not isinstance(meta, dict) or meta.get("version") not in READ_VERSIONS:
        version = meta.get("version") if isinstance(meta, dict) else None
        raise CheckpointError(
            f"{path}: metadata version {version}; this fimoe_lab reads versions {', '.join(map(str, READ_VERSIONS))}",
            fix="restore it with the fimoe_lab version that wrote it",
        )
    if not isinstance(meta.get("layers"), dict) or not isinstance(meta.get("checksums", {}), dict):
        raise CheckpointError(f"{path}: its metadata has no table of layers", fix=_EDITED)
    _check_fields(path, meta)
    return meta


class KernelFiles:
    """What convert wrote, opened for reading tensor by tensor (safetensors slices, memory-mapped): one
    file, or a directory with ``model.safetensors.index.json`` and its shards (each kept inside the
    directory). ``meta``: see :func:`read_kernel_metadata`."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if self.path.is_dir():
            self.where = self._index()
            root = self.path
        else:
            root = self.path.parent
            self.where = {}
        files = sorted(set(self.where.values())) or [self.path.name]
        self._handles = {f: safe_io.open_safetensors(root / f, "kernel-layout file") for f in files}
        metas = {f: _parse_meta(root / f, (h.metadata() or {}).get("fimoe_lab")) for f, h in self._handles.items()}
        self._keys = {f: set(h.keys()) for f, h in self._handles.items()}
        if not self.where:
            self.where = dict.fromkeys(self._keys[files[0]], files[0])
        first = metas[files[0]]
        common = {k: v for k, v in first.items() if k != "checksums"}
        for f, m in metas.items():
            if {k: v for k, v in m.items() if k != "checksums"} != common:
                raise CheckpointError(f"{root / f}: its metadata differs from {root / files[0]}'s", fix=_EDITED)
        self.meta = dict(first)
        if "checksums" in first:
            self.meta["checksums"] = {n: h for m in metas.values() for n, h in m.get("checksums", {}).items()}

    def _index(self) -> dict[str, str]:
        index = self.path / safe_io.INDEX
        if not os.path.lexists(index):
            ranks = sorted(p.name for p in self.path.iterdir() if safe_io.RANK_RE.match(p.name))
            if ranks:
                raise CheckpointError(
                    f"{self.path} holds one converted directory per rank ({', '.join(ranks)})",
                    fix=f"restore one of them, e.g. {self.path / ranks[0]}",
                )
            raise CheckpointError(
                f"{self.path} is a directory without {safe_io.INDEX}: not a finished 'fimoe-lab convert' output",
                fix="pass a file or directory convert wrote; finish an interrupted one with 'fimoe-lab convert --resume'",
            )
        data = safe_io.read_json(index, "safetensors index")
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if (
            not isinstance(wm, dict)
            or not wm
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items())
        ):
            raise CheckpointError(f"{index} has no 'weight_map' of tensor names to shard files", fix=_EDITED)
        for file in set(wm.values()):
            safe_io.inside(self.path, file, "the index's shard")
        return dict(wm)

    def keys(self) -> set[str]:
        """Names of the tensors the files hold (where the index puts them)."""
        return {n for n, f in self.where.items() if n in self._keys[f]}

    def get_slice(self, name: str) -> Any:
        return self._handles[self.where[name]].get_slice(name)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> KernelFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_int(v: object, lo: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


_FIELDS: dict[str, tuple[Callable[[object], bool], str]] = {
    "prefix": (lambda v: isinstance(v, str), "a string"),
    "block": (lambda v: isinstance(v, str), "a string"),
    "convention": (lambda v: v is None or isinstance(v, str), "a convention name"),
    "config": (lambda v: v is None or isinstance(v, dict), "a JSON object"),
    "tp_size": (lambda v: _is_int(v, 1), "an integer >= 1"),
    "tp_rank": (lambda v: _is_int(v, 0), "an integer >= 0"),
    "layer_names": (
        lambda v: v is None or (isinstance(v, dict) and all(isinstance(x, str) for kv in v.items() for x in kv)),
        "a table of layer paths",
    ),
}
"""Top-level metadata fields that restore uses, and the form ``convert`` writes them in."""


def _check_fields(path: str | os.PathLike, meta: dict) -> None:
    for key, (ok, form) in _FIELDS.items():
        if key in meta and not ok(meta[key]):
            raise CheckpointError(f"{path}: metadata field {key!r} is {meta[key]!r}, not {form}", fix=_EDITED)
    for key in ("prefix", "block"):
        if key not in meta:
            raise CheckpointError(f"{path}: metadata has no {key!r}", fix=_EDITED)


_EDITED = "the file was modified after conversion; convert the checkpoint again"


def check_digest(meta: dict, name: str, got: str) -> None:
    """Refuse tensor ``name`` if ``got``, the sha256 of its bytes, differs from the one ``convert`` recorded."""
    want = meta.get("checksums", {}).get(name)
    if want is None:
        if "checksums" in meta:
            raise CheckpointError(f"{name}: no checksum recorded for it", fix=_EDITED)
        return  # written before checksums were recorded
    if got != want:
        raise CheckpointError(
            f"{name}: checksum mismatch (sha256 {got[:16]}..., recorded {str(want)[:16]}...): the tensor's bytes are "
            f"corrupt or were modified",
            fix="convert the source checkpoint again (or copy the file again)",
        )


def _first_difference(written: list, rebuilt: list) -> str:
    for i, (w, r) in enumerate(zip(written, rebuilt)):
        if w != r:
            return f"step {i + 1} is {w} in the file, {r} rebuilt"
    return f"{len(written)} steps in the file, {len(rebuilt)} rebuilt"


def _same_steps(what: str, written: object, rebuilt: object, recipe: str) -> None:
    if written != rebuilt:
        both_lists = isinstance(written, list) and isinstance(rebuilt, list)
        diff = _first_difference(written, rebuilt) if both_lists else f"{written} in the file, {rebuilt} rebuilt"
        raise CheckpointError(
            f"{what} was written with steps that recipe {recipe} does not build from the same arguments ({diff})",
            fix="restore it with the fimoe_lab version that wrote it",
        )


def _shape_layer(rec: dict) -> MoELayer:
    """A layer of meta tensors with a record's checkpoint dtypes and shapes (for a dry run)."""

    def meta(spec: dict) -> torch.Tensor:
        return torch.empty(spec["shape"], dtype=conventions.SAFETENSORS_DTYPES[spec["dtype"]], device="meta")

    trecs = rec["tensors"]
    t = {n: meta(trecs[n]["checkpoint"]) if n in trecs else None for n in KERNEL_NAMES}
    return _layer_from_record(rec, t, {n: meta(x) for n, x in rec["extras"].items()})


def _layer_from_record(rec: dict, t: dict, extras: dict, **where: object) -> MoELayer:
    """The :class:`MoELayer` a layer record describes, holding tensors ``t`` (by plan name) and ``extras``;
    its format the recorded ``checkpoint_format`` (int4-group) or else the recipe's."""
    args = rec["plan"]["args"]
    return MoELayer(
        _checkpoint_format(rec),
        t["w13"],
        t["w2"],
        t["w13_scale"],
        t["w2_scale"],
        args["intermediate"],
        args["hidden"],
        extras,
        is_act_and_mul=args["is_act_and_mul"],
        is_gated=args["is_gated"],
        **where,
    )


def _checkpoint_format(rec: dict) -> str:
    """The checkpoint format of a layer record: ``checkpoint_format`` where convert recorded one (a format
    laid out as another: int4-group as mxint4), else the recipe's ``fmt``; refused unless it lays out as that."""
    fmt = rec["plan"]["args"]["fmt"]
    stored = rec.get("checkpoint_format", fmt)
    if not isinstance(stored, str) or layout_format(stored) != fmt:
        raise CheckpointError(f"checkpoint format {stored!r} is not laid out as {fmt!r}", fix=_EDITED)
    return stored


def _check_v1_shapes(rec: dict) -> None:
    args = rec["plan"]["args"]
    choice = LayoutChoice(
        args["backend"], args["intermediate_alignment"], args["hidden_alignment"], engines.LEGACY_ENGINE
    )
    kernel, _, _ = _dry_run(_shape_layer(rec), choice)
    recorded = {trec["name"]: (trec["kernel"]["dtype"], trec["kernel"]["shape"]) for trec in rec["tensors"].values()}
    recorded.update({n: (x["dtype"], x["kernel_shape"]) for n, x in rec["extras"].items()})
    for name, want in recorded.items():
        got = f"{dtype_name(kernel[name][0])} {list(kernel[name][1])}" if name in kernel else "no such tensor"
        if got != f"{want[0]} {list(want[1])}":
            raise CheckpointError(
                f"{name}: the version-1 file recorded kernel {want[0]} {list(want[1])}, the rebuilt plan gives {got}",
                fix="restore it with the fimoe_lab version that wrote it",
            )


def check_record(rec: dict, plan: LayerPlan, version: int) -> None:
    """Refuse a layer record that the rebuilt ``plan`` does not reproduce.

    Version 2: each tensor's recorded ``[{"kind", "params"}, ...]`` chain and each extra's
    ``rows_of``/row steps must equal the plan's. Version 1 recorded display names of the
    steps; they are not compared (a display name is not data, and its spelling may change):
    instead the plan, dry-run on one expert with the recorded checkpoint dtypes and shapes,
    must give the recorded kernel dtype and shape of every tensor and extra.
    """
    if version == 1:
        _check_v1_shapes(rec)
        return
    recipe = rec["plan"]["recipe"]
    for n, trec in rec["tensors"].items():
        _same_steps(n, trec["steps"], _tensor_steps(plan, n), recipe)
    for n, xrec in rec["extras"].items():
        _same_steps(n, {"rows_of": xrec.get("rows_of"), "steps": xrec.get("steps")}, _extra_steps(plan, n), recipe)


def _as_checkpoint(t: torch.Tensor, spec: dict) -> torch.Tensor:
    dtype = conventions.SAFETENSORS_DTYPES[spec["dtype"]]
    shape = tuple(spec["shape"])
    return t.contiguous().view(torch.uint8).reshape(shape[0], -1).view(dtype).reshape(shape)


class _Back:
    """One kernel tensor being read back: ``name`` (kernel ``kspec``) into a new tensor ``out`` in the checkpoint
    layout ``cspec``, a chunk of experts at a time (safetensors slices), each chunk mapped back by ``m`` (a
    function of the chunk; None: unchanged) and hashed (its sha256 checked by :meth:`check` once every chunk is in); ``xor``: a byte every
    byte is XORed with after the map (:data:`~fimoe_lab.checkpoints.conventions.WEIGHT_XOR`; 0: none)."""

    def __init__(
        self,
        kf: KernelFiles,
        name: str,
        kspec: dict,
        cspec: dict,
        m: Optional[Callable[[torch.Tensor], torch.Tensor]],
        xor: int = 0,
    ):
        self.xor = xor
        if name not in kf.keys():
            raise CheckpointError(f"{name} is recorded in the metadata but not in the file", fix=_EDITED)
        self.sl, self.name, self.cspec, self.m = kf.get_slice(name), name, cspec, m
        shape = list(self.sl.get_shape())
        if (self.sl.get_dtype(), shape) != (kspec["dtype"], kspec["shape"]):
            raise CheckpointError(
                f"{name} is {self.sl.get_dtype()} {shape}, metadata says {kspec['dtype']} {kspec['shape']}", fix=_EDITED
            )
        if not shape or shape[:1] != cspec["shape"][:1]:
            raise CheckpointError(
                f"{name}: kernel shape {shape} and checkpoint shape {cspec['shape']} do not start with one expert count",
                fix=_EDITED,
            )
        self.experts = shape[0]
        self.expert_bytes = math.prod(shape[1:]) * conventions.SAFETENSORS_DTYPES[kspec["dtype"]].itemsize
        self.out = torch.empty(cspec["shape"], dtype=conventions.SAFETENSORS_DTYPES[cspec["dtype"]])
        self.digest = hashlib.sha256()

    def fetch(self, e0: int, e1: int) -> torch.Tensor:
        """Experts ``[e0, e1)`` as the file holds them (read from the file, nothing mapped)."""
        return self.sl[e0:e1].contiguous()

    def place(self, e0: int, e1: int, x: torch.Tensor, hasher: ThreadPoolExecutor) -> Future:
        """Experts ``[e0, e1)`` (``x``, from :meth:`fetch`): hashed on ``hasher`` (in order) while they are mapped
        back into ``out``."""
        hashed = hasher.submit(self.digest.update, stream.byte_view(x))
        back = x if self.m is None else self.m(x)
        if self.xor:
            back = back.contiguous().view(torch.uint8) ^ self.xor
        self.out[e0:e1] = _as_checkpoint(back, {**self.cspec, "shape": [e1 - e0, *self.cspec["shape"][1:]]})
        return hashed

    def check(self, meta: dict) -> None:
        check_digest(meta, self.name, self.digest.hexdigest())


MAX_SIZE = 1 << 24
"""Largest intermediate/hidden size a record may claim (real models: < 65536)."""


def _check_sizes(f, rec: dict, name: Callable[[str], str]) -> None:
    """Bound what a record makes restore build: sizes are ints in ``[1, MAX_SIZE]`` and one expert's
    ``I x H`` values fit in its ``w13`` kernel tensor as the file holds it (bytes times the recorded format's
    values per byte: a non-gated packed FP4 W13 holds ``I x H / 2`` bytes), so a plan is never larger than
    twice the file's own bytes."""
    args = rec["plan"]["args"]
    sizes = {k: args.get(k) for k in ("intermediate", "hidden")}
    for k, v in sizes.items():
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_SIZE:
            raise CheckpointError(f"recorded {k} size {v!r} is not an integer in [1, {MAX_SIZE}]", fix=_EDITED)
    w13 = name(rec["tensors"]["w13"]["name"])
    if w13 not in f.keys():
        raise CheckpointError(f"{w13} is recorded in the metadata but not in the file", fix=_EDITED)
    sl = f.get_slice(w13)
    shape = list(sl.get_shape())
    dtype = conventions.SAFETENSORS_DTYPES.get(sl.get_dtype())
    per_expert = (math.prod(shape[1:]) if shape else 0) * (torch.empty((), dtype=dtype).element_size() if dtype else 1)
    packed = getattr(FORMATS.get(str(args.get("fmt"))), "values_per_byte", 1)  # a non-gated FP4 W13: I*H/2 bytes
    if sizes["intermediate"] * sizes["hidden"] > per_expert * packed:
        raise CheckpointError(
            f"recorded sizes intermediate {sizes['intermediate']} x hidden {sizes['hidden']} do not fit {w13} "
            f"({sl.get_dtype()} {shape})",
            fix=_EDITED,
        )
    _check_shapes(rec, per_expert * max(1, shape[0] if shape else 1))


def _check_shapes(rec: dict, limit: int) -> None:
    """Every shape a record gives (checkpoint, kernel, extras) is a list of ints >= 0 whose element
    count is at most ``limit`` (the bytes of the file's own w13 tensor, the largest one)."""
    shapes = [(n, t[k]["shape"]) for n, t in rec["tensors"].items() for k in ("checkpoint", "kernel")]
    shapes += [(n, x[k]) for n, x in rec["extras"].items() for k in ("shape", "kernel_shape")]
    for n, sh in shapes:
        if not isinstance(sh, list) or not all(_is_int(d, 0) for d in sh) or math.prod(sh) > limit:
            raise CheckpointError(f"{n}: recorded shape {sh!r} is not one the file's tensors can hold", fix=_EDITED)


def _restore_layer(
    kf: KernelFiles, meta: dict, idx: int, rec: dict, ready: Optional[Callable[[MoELayer, int], None]] = None
) -> MoELayer:
    """Layer ``idx`` back in the checkpoint layout, read and mapped back a chunk of experts at a time, every
    tensor's sha256 checked at the end. ``ready(layer, e)`` is called when experts ``[0, e)`` of every tensor
    are in place (their checksums not checked yet): restore writes them out while it reads the next chunk."""
    name = lambda n: _out_name(meta["prefix"], meta["block"], idx, n)  # noqa: E731
    _check_sizes(kf, rec, name)
    plan = build_plan(rec["plan"], meta["version"])
    check_record(rec, plan, meta["version"])
    inverse = plan.inverse()
    missing = [n for n in inverse.moved() if n not in rec["tensors"]]
    if missing:
        raise CheckpointError(f"{plan.description}: {missing[0]} is required by the plan but not recorded", fix=_EDITED)
    backs: dict[str, _Back] = {}
    for n, trec in rec["tensors"].items():
        if n not in KERNEL_NAMES:
            raise CheckpointError(f"layer {idx} records a tensor {n!r}, not one of {list(KERNEL_NAMES)}", fix=_EDITED)
        xor = conventions.WEIGHT_XOR.get(_checkpoint_format(rec), 0) if n in ("w13", "w2") else 0
        back = partial(inverse.apply_tensor, n) if n in inverse.moved() else None  # word bits undone first
        backs[n] = _Back(kf, name(trec["name"]), trec["kernel"], trec["checkpoint"], back, xor)
    extras = {}
    for n, x in rec["extras"].items():
        dtype = conventions.SAFETENSORS_DTYPES[x["dtype"]]
        m = _extra_map(plan, n, torch.empty((), dtype=dtype))
        kspec, cspec = {"dtype": x["dtype"], "shape": x["kernel_shape"]}, {"dtype": x["dtype"], "shape": x["shape"]}
        undo = None if m is None else partial(apply_map, m.inverse(), what=name(n))
        extras[n] = _Back(kf, name(n), kspec, cspec, undo)
    every = [*backs.values(), *extras.values()]
    counts = {b.experts for b in every}
    if len(counts) > 1:
        raise CheckpointError(f"layer {idx}: its tensors hold different expert counts {sorted(counts)}", fix=_EDITED)
    e_count = counts.pop() if counts else 0
    layer = _layer_from_record(
        rec,
        {n: backs[n].out if n in backs else None for n in KERNEL_NAMES},
        {n: b.out for n, b in extras.items()},
        **_where(meta, idx, rec),
    )
    per_expert = sum(b.expert_bytes for b in every)
    step = stream.experts_per_chunk(per_expert, per_expert * e_count)
    chunks = [(e0, min(e0 + step, e_count)) for e0 in range(0, e_count, step)]
    fetch = lambda e0, e1: [b.fetch(e0, e1) for b in every]  # noqa: E731
    # chunk k+1 is read on `reader` while chunk k is mapped back here and hashed, tensor i on hasher i % lanes
    with ExitStack() as stack:
        reader = stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="fimoe-lab-reader"))
        hashers = [stack.enter_context(ThreadPoolExecutor(1)) for _ in range(stream.HASH_LANES)]
        pending = [reader.submit(fetch, *c) for c in chunks[:1]]
        previous: list[Future] = []
        for k, (e0, e1) in enumerate(chunks):
            xs = pending.pop().result()
            pending += [reader.submit(fetch, *c) for c in chunks[k + 1 : k + 2]]
            hashed = [b.place(e0, e1, x, hashers[i % len(hashers)]) for i, (b, x) in enumerate(zip(every, xs))]
            del xs
            for h in previous:
                h.result()
            previous = hashed
            if ready is not None:
                ready(layer, e1)
        for h in previous:
            h.result()
    for b in every:
        b.check(meta)
    return layer


def _where(meta: dict, idx: int, rec: dict) -> dict:
    """The :class:`MoELayer` fields a restored layer takes from the file's metadata."""
    return {
        "layer": idx,
        "convention": meta.get("convention"),
        "tp_size": meta.get("tp_size", 1),
        "tp_rank": meta.get("tp_rank", 0),
        "activation": rec["activation"],
        "activation_params": rec["activation_params"],
    }


@contextmanager
def _layer_errors(path: str | os.PathLike, idx: str) -> Iterator[None]:
    """Any error while restoring layer ``idx`` as one CheckpointError naming the file and the layer."""
    try:
        yield
    except FimoeError as exc:
        raise exc.within(f"{path}: layer {idx}") from None
    except (KeyError, TypeError, AttributeError, IndexError, ValueError, RuntimeError) as exc:
        raise CheckpointError(
            f"{path}: layer {idx}: the metadata does not have the form convert writes "
            f"({type(exc).__name__}: {safe_io.one_line(exc)})",
            fix=_EDITED,
        ) from None


def _iter_layers(path: str | os.PathLike, kf: KernelFiles) -> Iterator[MoELayer]:
    for idx, rec in kf.meta["layers"].items():
        with _layer_errors(path, idx):
            layer = _restore_layer(kf, kf.meta, int(idx), rec)
        yield layer
        del layer  # not held while the next layer is read


def restore_layers(path: str | os.PathLike) -> tuple[dict, list[MoELayer]]:
    """Map a kernel-layout file or sharded directory (version 1 or 2) back to the checkpoint layout, all layers
    in memory: ``(metadata, layers)`` (``restore_checkpoint`` streams them instead).

    Rebuilds each layer's plan from the recorded recipe and arguments, checks it against the
    record (:func:`check_record`), verifies each tensor's recorded sha256 and applies the
    inverse (padding dropped). Metadata that does not have the shape ``convert`` writes
    is refused with one CheckpointError.
    """
    with KernelFiles(path) as kf:
        return kf.meta, list(_iter_layers(path, kf))


def restore_checkpoint(
    path: str | os.PathLike,
    out_dir: str | os.PathLike,
    force: bool = False,
    shard_size: Optional[int] = None,
    progress: Any = False,
) -> Path:
    """Write a kernel-layout file or sharded directory back as a checkpoint directory in its original naming
    convention.

    The result (``config.json``, shards of at most ``shard_size`` bytes (default
    :data:`~fimoe_lab.checkpoints.stream.SHARD_BYTES`) with their index, and the marker
    :data:`~fimoe_lab.checkpoints.safe_io.MARKER`) holds the MoE expert tensors of the
    converted layers, byte-identical to the source's (for a TP shard: the rank's slice,
    with config.json's intermediate size set to the shard's; for the OUT of ``convert --rank all``, every
    rank's experts and intermediate slices joined: :func:`expert_parallel.restore_ranks`), and every tensor
    convert carried through unchanged (:mod:`~fimoe_lab.checkpoints.unchanged`): from a whole convert, every
    tensor of the source with its name, dtype, shape and bytes, and nothing else. Streamed: one layer in memory,
    read and mapped back a chunk of experts at a time, written before the next layer is read.
    Written atomically; an existing ``out_dir`` is replaced only with ``force`` and only if
    ``restore`` wrote it. ``progress``: as :func:`write_kernel_layout`'s (bytes restored of the total).
    """
    from fimoe_lab.checkpoints import expert_parallel

    if expert_parallel.rank_dirs(Path(path)):  # convert --rank all: every rank's experts and slices reassembled
        return expert_parallel.restore_ranks(path, out_dir, force, shard_size, progress)
    out = Path(out_dir)
    safe_io.check_output(out, [Path(path)], force, "dir")
    with safe_io.signals_raise(), safe_io.OutputLock(out):  # a second writer of OUT fails before reading
        return _restore_into(path, out, shard_size or stream.SHARD_BYTES, progress)


RESTORED_MARK = {"written_by": "fimoe-lab restore"}
"""What the marker file of a restored directory holds (nothing of the machine: no path, no time)."""


def _restored_specs(path: str | os.PathLike, kf: KernelFiles, conv: conventions.Convention) -> dict:
    """Names, dtypes and shapes of every tensor restore writes: the layers', from the records alone (meta
    tensors), then the unchanged tensors' (:func:`kept_names`)."""
    meta, specs = kf.meta, {}
    for idx, rec in meta["layers"].items():
        with _layer_errors(path, idx):
            name = lambda n, idx=idx: _out_name(meta["prefix"], meta["block"], int(idx), n)  # noqa: E731
            _check_sizes(kf, rec, name)
            layer = replace(_shape_layer(rec), **_where(meta, int(idx), rec))
            for k, v in conv.to_tensors(meta["prefix"], int(idx), layer, _layer_path(meta, idx)).items():
                specs[k] = (v.dtype, tuple(v.shape))
    return with_kept(path, specs, unchanged.specs_in(kf, kept_names(kf)))


def kept_names(kf: KernelFiles) -> list[str]:
    """The tensors of a converted file carried through unchanged: those its layer records do not name
    (:func:`~fimoe_lab.checkpoints.unchanged.names_in`)."""
    meta = kf.meta
    named = set()
    for idx, rec in meta["layers"].items():
        with _layer_errors(kf.path, idx):
            name = lambda n, idx=idx: _out_name(meta["prefix"], meta["block"], int(idx), n)  # noqa: E731
            named.update([name(t["name"]) for t in rec["tensors"].values()], map(name, rec["extras"]))
    return unchanged.names_in(kf.keys(), named)


def with_kept(path: str | os.PathLike, specs: dict, kept: dict) -> dict:
    """``specs`` (the restored layers' tensors) followed by the unchanged tensors ``kept``; a name in both
    (an edited file) is refused."""
    clash = sorted(set(specs) & set(kept))
    if clash:
        raise CheckpointError(f"{path}: {clash[0]} is both a restored expert tensor and an unchanged one", fix=_EDITED)
    return {**specs, **kept}


class _Emit:
    """Queues a restored layer's output tensors (``Convention.to_tensors``) for writing as soon as the experts
    they hold are in place: the views into the layer's buffers chunk by chunk (:meth:`ready`), the tensors
    ``to_tensors`` copies (fused experts, scalar extras) once the whole layer is in and verified (:meth:`rest`)."""

    def __init__(
        self,
        path: str | os.PathLike,
        conv: conventions.Convention,
        prefix: str,
        specs: dict,
        target: stream.ShardedOutput,
        workers: stream.Workers,
        base: Optional[str],
    ):
        self.path, self.conv, self.prefix, self.specs, self.target, self.workers = (
            path,
            conv,
            prefix,
            specs,
            target,
            workers,
        )
        self.base = base
        self.waiting: Optional[list[tuple[int, str, torch.Tensor]]] = None
        self.sent: set[str] = set()
        self.bar: Any = None  # progress (restore_checkpoint's), updated with the bytes of each tensor queued

    def ready(self, layer: MoELayer, done: int) -> None:
        """Experts ``[0, done)`` of every buffer of ``layer`` are in place."""
        if self.waiting is None:
            buffers = [t for t in (*layer.tensors().values(), *layer.extras.values()) if t is not None and t.numel()]
            self.waiting = []
            for k, t in self.conv.to_tensors(self.prefix, layer.layer, layer, self.base).items():
                last = _last_expert(t, buffers)
                if last is not None:
                    self.waiting.append((last, k, t))
        later = []
        for last, k, t in self.waiting:
            if last < done:
                self._put(k, t)
            else:
                later.append((last, k, t))
        self.waiting = later

    def rest(self, layer: MoELayer) -> None:
        """Queue every output tensor not queued yet (the layer is complete and its checksums verified)."""
        for k, t in self.conv.to_tensors(self.prefix, layer.layer, layer, self.base).items():
            if k not in self.sent:
                self._put(k, t)

    def _put(self, k: str, t: torch.Tensor) -> None:
        if k not in self.specs:
            raise CheckpointError(f"{self.path}: {k} is not among the tensors its records give", fix=_EDITED)
        self.sent.add(k)
        self.target.put(self.workers, k, t.contiguous())
        if self.bar is not None:
            self.bar.update(t.nbytes)


def _last_expert(t: torch.Tensor, buffers: list[torch.Tensor]) -> Optional[int]:
    """The last expert of the buffer that ``t`` is a view of (None: ``t`` is a copy, of no buffer)."""
    if not t.numel():
        return 0
    for b in buffers:
        if t.untyped_storage().data_ptr() == b.untyped_storage().data_ptr():
            return (t.data_ptr() + t.nbytes - 1 - b.data_ptr()) // (b.nbytes // b.shape[0])
    return None


def _layer_path(meta: dict, idx: str) -> Optional[str]:
    """The source path of layer ``idx`` (``mtp.layers.0``) as convert recorded it; None: ``{prefix}{idx}``."""
    return (meta.get("layer_names") or {}).get(idx)


def _restored_config(meta: dict) -> dict:
    """The source's config.json, for a TP shard (``tp_size > 1``) with the intermediate size set to the rank's:
    under the key :func:`conventions.config_value` reads it from (top level or ``text_config``; a dotted key
    nested), a per-layer list entry by entry for the converted layers (the others kept)."""
    config = json.loads(json.dumps(meta.get("config") or {}))
    sizes = {int(i): rec["plan"]["args"]["intermediate"] for i, rec in meta["layers"].items()}
    if not sizes or meta.get("tp_size", 1) == 1:
        return config
    key, value = conventions.config_value(config, "intermediate")
    *parents, leaf = (key or conventions.CONFIG_KEYS["intermediate"][0]).split(".")
    node = config
    for level in (config, config.get("text_config")):
        for part in parents:
            level = level.get(part) if isinstance(level, dict) else None
        if isinstance(level, dict) and level.get(leaf) is not None:
            node = level
            break
    if isinstance(value, list):
        node[leaf] = [sizes.get(i, v) for i, v in enumerate(value)]
    else:
        node[leaf] = sizes[min(sizes)]
    return config


def _restore_layers_into(
    path: str | os.PathLike,
    kf: KernelFiles,
    conv: conventions.Convention,
    specs: dict,
    target: stream.ShardedOutput,
    bar: Any,
) -> None:
    """Restore every layer of ``kf`` into ``target``, one layer in memory; ``bar`` counts the bytes queued."""
    meta = kf.meta
    with stream.workers_for(target, hashing=False) as workers:
        for idx, rec in meta["layers"].items():
            emit = _Emit(path, conv, meta["prefix"], specs, target, workers, _layer_path(meta, idx))
            emit.bar = bar
            with _layer_errors(path, idx):
                layer = _restore_layer(kf, meta, int(idx), rec, emit.ready)
                emit.rest(layer)
            del layer, emit
            workers.drain()  # this layer is out (and freed) before the next is read
        unchanged.put_back(kf, kept_names(kf), target, workers, partial(check_digest, meta), bar)
        target.finish(workers)


def _restore_into(path: str | os.PathLike, out: Path, shard_bytes: int, progress: Any = False) -> Path:
    """The body of :func:`restore_checkpoint`, under its output's lock."""
    with KernelFiles(path) as kf:
        meta = kf.meta
        if not meta.get("convention"):
            raise CheckpointError(
                f"{path}: no source convention recorded (written from in-memory layers)", fix="use restore_layers()"
            )
        if meta.get("ep_size", 1) > 1:
            raise CheckpointError(
                f"{path} holds experts [e0, e1) = {meta.get('experts')} of {meta.get('num_experts')} (EP rank "
                f"{meta.get('ep_rank')} of {meta['ep_size']}) under local indices",
                fix=f"restore the directory of every rank, {Path(path).parent}, to reassemble the experts",
            )
        conv = conventions.get(meta["convention"])
        specs = _restored_specs(path, kf, conv)
        config = _restored_config(meta)
        with safe_io.atomic_dir(out) as tmp:
            target = stream.ShardedOutput(tmp, specs, {"format": "pt"}, single=False, shard_bytes=shard_bytes)
            bar = _progress_bar(progress, specs, target, out, "restore")
            try:
                _restore_layers_into(path, kf, conv, specs, target, bar)
            finally:
                if bar is not None:
                    bar.close()
            safe_io.write_json(tmp / "config.json", config)
            safe_io.write_json(tmp / safe_io.MARKER, RESTORED_MARK)
    return out
