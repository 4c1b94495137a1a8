"""Convert MoE layers into the kernel layout and stream them out (:mod:`~fimoe_lab.checkpoints.fileformat`).

:func:`convert_layer` maps one layer with its plan (:mod:`~fimoe_lab.checkpoints.plan_choice`);
:func:`write_kernel_layout` writes a list of :data:`~fimoe_lab.checkpoints.rank_layout.LayerSource` as one file or a
sharded directory: :func:`layout_plan` gives the tensor specs and the metadata from shapes alone, then
:func:`stream_layers` reads a block of experts at a time, the next while this one is converted
(:func:`converted_chunks`; every map works expert by expert), while worker threads of
:mod:`~fimoe_lab.checkpoints.stream` hash and write earlier chunks at their offsets. Every file goes to a
temporary created exclusively beside it, fsynced and renamed only when complete
(:mod:`~fimoe_lab.checkpoints.safe_io`): an interrupted or failed conversion leaves no partial file (and,
sharded, no index until every shard is in place), and an existing output is replaced only with ``force`` and
only if this tool wrote it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Optional

import torch

from fimoe_lab import value_rules
from fimoe_lab.checkpoints import conventions, safe_io, stream, unchanged
from fimoe_lab.checkpoints import request as requests
from fimoe_lab.checkpoints.conventions import dtype_name
from fimoe_lab.checkpoints.fileformat import (
    FORMAT_VERSION,
    KEPT_SUFFIX,
    KERNEL_NAMES,
    extra_steps,
    kept_tensors,
    out_name,
    tensor_steps,
)
from fimoe_lab.checkpoints.plan_choice import build_plan, plan_args, suggest_alignment
from fimoe_lab.checkpoints.rank_layout import LayerLoader, LayerSource
from fimoe_lab.checkpoints.reader import CheckpointError, MoELayer
from fimoe_lab.choice import LayoutChoice
from fimoe_lab.errors import FimoeError
from fimoe_lab.layout import IndexMap
from fimoe_lab.plan import BIAS_ROWS, LayerPlan, apply_map

__all__ = [
    "convert_layer",
    "extra_map",
    "dry_run",
    "write_kernel_layout",
    "layout_plan",
    "stream_layers",
    "torch_device",
    "converted_chunks",
]


def convert_layer(layer: MoELayer, choice: LayoutChoice) -> tuple[dict[str, torch.Tensor], LayerPlan, dict]:
    """One layer into the kernel layout ``choice`` asks for: ``(tensors by kernel name, plan, plan spec)``.

    ``choice.engine``: the profile whose defaults and layouts apply (:mod:`fimoe_lab.engines`;
    None: the newest vLLM's, ``engines.DEFAULT_ENGINE``). Bytes move, and values change only where the
    profile holds a value rule (``plan.value_rule``: FP8 per-tensor W13 requantized to max(gate, up), DeepSeek
    FP8 block scales clamped to 1e-10; the record says so: :func:`_kernel_specs`; a rule's ``kept`` tensors are
    also returned in their checkpoint bytes, named ``<kernel name>_checkpoint``). Biases (gpt-oss) follow their
    weight's rows; other extras pass unchanged. The plan record: :func:`plan_args`. A checkpoint format
    with a :data:`~fimoe_lab.checkpoints.conventions.WEIGHT_XOR` byte (int4-group: ``q + 8`` ->
    two's complement) has its weight bytes XORed with it first (a copy; the layer is untouched).
    """
    spec = plan_args(layer, choice)
    plan = build_plan(spec)
    outs = plan.apply(
        _xor_weight(layer.w13.contiguous(), layer.fmt),
        _xor_weight(layer.w2.contiguous(), layer.fmt),
        None if layer.w13_scale is None else layer.w13_scale.contiguous(),
        None if layer.w2_scale is None else layer.w2_scale.contiguous(),
    )
    tensors = {KERNEL_NAMES[n]: t for n, t in zip(KERNEL_NAMES, outs) if t is not None}
    rule = plan.value_rule
    if rule is not None and value_rules.applies(rule, layer.tensors()):
        for n in rule.kept:  # the checkpoint's bytes beside the changed ones (fileformat.kept_tensors)
            source = layer.tensors()[n]
            if source is not None:
                tensors[KERNEL_NAMES[n] + KEPT_SUFFIX] = source.contiguous()
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


def extra_map(plan: LayerPlan, name: str, t: torch.Tensor) -> Optional[IndexMap]:
    """The map of an extra tensor: a bias follows its weight's rows; other extras (None) stay as they are."""
    return plan.bias_map(name, t.element_size()) if name in BIAS_ROWS else None


def _map_extra(plan: LayerPlan, name: str, t: torch.Tensor, inverse: bool) -> torch.Tensor:
    """An extra tensor in the kernel layout (or back, with ``inverse``)."""
    m = extra_map(plan, name, t)
    if m is None:
        return t
    return apply_map(m.inverse() if inverse else m, t.contiguous(), name)


def _dtype_shape(dtype: torch.dtype, shape: Sequence[int]) -> dict:
    return {"dtype": dtype_name(dtype), "shape": list(shape)}


def dry_run(layer: MoELayer, choice: LayoutChoice) -> tuple[dict, LayerPlan, dict]:
    """Kernel ``(dtype, shape)`` by kernel name of a layer (shapes only; meta tensors allowed), from
    a one-expert conversion; with the plan and its :func:`plan_args` record."""

    def one_expert(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else torch.zeros((1,) + tuple(t.shape[1:]), dtype=t.dtype)

    probe = layer.with_tensors(**{n: one_expert(t) for n, t in layer.tensors().items()})
    probe = replace(probe, extras={n: one_expert(t) for n, t in layer.extras.items()})
    tensors, plan, spec = convert_layer(probe, choice)
    return {n: (t.dtype, (layer.num_experts,) + tuple(t.shape[1:])) for n, t in tensors.items()}, plan, spec


def _kernel_specs(layer: MoELayer, choice: LayoutChoice) -> tuple[dict, dict]:
    """Kernel dtypes/shapes of a layer (:func:`dry_run`) and its metadata record (module docstring;
    ``checkpoint_format`` only where the layer's format is not the recipe's, int4-group for mxint4)."""
    kernel, plan, spec = dry_run(layer, choice)
    lossy = value_rules.applies(plan.value_rule, layer.tensors())
    record = {
        "plan": spec,
        **({"value_rule": plan.value_rule.record()} if lossy and plan.value_rule is not None else {}),
        **({"checkpoint_format": layer.fmt} if layer.fmt != spec["args"]["fmt"] else {}),
        "description": plan.description,
        "padded_intermediate": plan.padded_intermediate,
        "padded_hidden": plan.padded_hidden,
        "activation": layer.activation,
        "activation_params": layer.activation_params,
        "tensors": {
            n: {
                "name": KERNEL_NAMES[n],
                "steps": tensor_steps(plan, n),
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
                **extra_steps(plan, n),
            }
            for n, t in layer.extras.items()
        },
    }
    return kernel, record


def write_kernel_layout(
    out: str | os.PathLike,
    sources: Sequence[LayerSource],
    choice: LayoutChoice,
    *,
    prefix: str = "model.layers.",
    block: str = "mlp",
    info: Optional[dict] = None,
    progress: bool = False,
    force: bool = False,
    single_file: Optional[bool] = None,
    shard_size: Optional[int] = None,
    resume: bool = False,
    device: str = "cpu",
    request: Optional[dict] = None,
    kept: Optional[unchanged.Unchanged] = None,
) -> Path:
    """Convert and stream layers into the kernel layout ``choice`` asks for at ``out``: one safetensors file
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
    dev = torch_device(device)
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
        bar = stream.progress_bar(progress, specs, target, out)
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
            specs[out_name(prefix, block, idx, n)] = spec
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
    needs (:meth:`~fimoe_lab.checkpoints.stream.ShardedOutput.needed`), a block of experts at a time
    (:func:`_blocks`: the next block, of this layer or the next, read while this one is converted; on CUDA
    :func:`_chunks` keeps one chunk's GPU work queued ahead), then copy the ``kept`` unchanged tensors it still
    needs; ``meta``: from :func:`layout_plan`. Memory: the block being converted, the one being read, a chunk
    queued on the GPU, and the chunks in the workers' bounded queues (well under a layer)."""
    prefix, block = meta["prefix"], meta["block"]
    todo = []
    for idx, shape_layer, load in sources:
        rec = meta["layers"][str(idx)]
        names = {
            n: out_name(prefix, block, idx, n)
            for n in (*KERNEL_NAMES.values(), *rec["extras"], *kept_tensors(rec).values())
        }
        if any(target.needed(full) for full in names.values() if full in target.specs):
            todo.append((names, shape_layer, load))
    for names, tensors in _chunks(_blocks(todo, dev), choice, dev):
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


def torch_device(device: str) -> torch.device:
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


def converted_chunks(
    layer: MoELayer, choice: LayoutChoice, dev: torch.device, step: Optional[int] = None
) -> Iterator[dict[str, torch.Tensor]]:
    """The layer in the kernel layout, a chunk of ``step`` experts at a time (default :func:`_chunk_experts`;
    :func:`convert_layer` on ``[e0:e1]`` of every tensor; kernel tensors by name, on the CPU). With a CUDA
    ``dev``: staged through pinned host buffers."""
    for tensors, done in _queued_chunks(layer, choice, dev, step):
        if done is not None:
            done.synchronize()
        yield tensors


def _queued_chunks(
    layer: MoELayer, choice: LayoutChoice, dev: torch.device, step: Optional[int]
) -> Iterator[tuple[dict[str, torch.Tensor], Optional[torch.cuda.Event]]]:
    """:func:`converted_chunks` with, on CUDA, each chunk's work only queued: ``(its host tensors, the event
    after their copy from the GPU)``, the tensors to be read once the event is done (None on the CPU)."""
    parts = {n: t for n, t in layer.tensors().items() if t is not None}
    e_count = layer.num_experts
    step = step or _chunk_experts(layer)
    for e0 in range(0, e_count, step):
        cut = lambda t, e0=e0: _to_device(t[e0 : e0 + step].contiguous(), dev)  # noqa: E731
        sub = replace(
            layer.with_tensors(**{n: cut(t) for n, t in parts.items()}),
            extras={n: cut(t) for n, t in layer.extras.items()},
        )
        tensors, _, _ = convert_layer(sub, choice)
        if dev.type != "cuda":
            yield {n: t.contiguous() for n, t in tensors.items()}, None
            continue
        host = {n: _to_host(t) for n, t in tensors.items()}
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(dev))
        yield host, done


def _chunks(
    blocks: Iterator[tuple[dict, MoELayer, Optional[int]]], choice: LayoutChoice, dev: torch.device
) -> Iterator[tuple[dict, dict[str, torch.Tensor]]]:
    """``(names, kernel tensors on the host)`` for every chunk of every block of :func:`_blocks`. On CUDA a
    chunk's copy to the GPU, transform and copy back are queued before the previous chunk is handed on (after
    its event), so the GPU and the copies work while the caller hashes and writes."""
    held = None
    for names, layer, step in blocks:
        for tensors, done in _queued_chunks(layer, choice, dev, step):
            if held is not None:
                yield _ready(*held)
            held = (names, tensors, done)
        del layer
    if held is not None:
        yield _ready(*held)


def _ready(
    names: dict, tensors: dict[str, torch.Tensor], done: Optional[torch.cuda.Event]
) -> tuple[dict, dict[str, torch.Tensor]]:
    if done is not None:
        done.synchronize()
    return names, tensors


def _chunk_experts(layer: MoELayer) -> int:
    """Experts per chunk of ``layer`` (shapes suffice: meta tensors allowed), :func:`stream.experts_per_chunk`."""
    parts = [t for t in (*layer.tensors().values(), *layer.extras.values()) if t is not None]
    layer_bytes = sum(t.numel() * t.element_size() for t in parts)
    return stream.experts_per_chunk(layer_bytes // max(1, layer.num_experts), layer_bytes)


def _blocks(
    todo: Sequence[tuple[dict, MoELayer, Callable[..., MoELayer]]], dev: torch.device
) -> Iterator[tuple[dict, MoELayer, Optional[int]]]:
    """``(names, block, experts per chunk)`` for every block of every layer of ``todo`` (``(output names, shape
    layer, loader)``). From a checkpoint (a :class:`LayerLoader`): blocks of one chunk of experts
    (:func:`_chunk_experts`), read on a reader thread, block ``k+1`` (the next layer's first after a layer's last)
    while block ``k`` is converted and written, so reading overlaps the transform across layer boundaries too;
    for a CUDA ``dev`` read straight into page-locked memory (:func:`_pinned`). Any other loader: its whole
    layer, loaded when reached."""
    jobs: list[tuple[dict, Callable[[], MoELayer], Optional[int]]] = []  # step None: a whole layer, not read ahead
    for names, shape_layer, load in todo:
        if not isinstance(load, LayerLoader):
            jobs.append((names, load, None))
            continue
        step, e_count = _chunk_experts(shape_layer), shape_layer.num_experts
        for e0 in range(0, e_count, step):
            experts = (e0, min(e0 + step, e_count))
            read = partial(_pinned, load, experts) if dev.type == "cuda" else partial(load, experts)
            jobs.append((names, read, step))
    with ThreadPoolExecutor(1, thread_name_prefix="fimoe-lab-reader") as reader:
        pending = None
        for k, (names, read, step) in enumerate(jobs):
            layer = read() if pending is None else pending.result()
            after = jobs[k + 1] if k + 1 < len(jobs) else None
            pending = reader.submit(after[1]) if after is not None and after[2] is not None else None
            yield names, layer, step
            del layer


def _pinned(load: LayerLoader, experts: tuple[int, int]) -> MoELayer:
    """Experts ``experts`` of ``load``'s layer in page-locked host memory: read into it where the reader fills
    buffers of its own (``Checkpoint.read_layer(pin=True)``), any other tensor copied into it. Run on the reader
    thread, so this overlaps the previous block's GPU work, and the chunks cut from it go to the GPU without
    another copy."""
    layer = load(experts, pin=True)
    pin = lambda t: t if t.is_pinned() else t.pin_memory()  # noqa: E731
    pinned = {n: pin(t) for n, t in layer.tensors().items() if t is not None}
    return replace(layer.with_tensors(**pinned), extras={n: pin(t) for n, t in layer.extras.items()})


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
