"""Restore a kernel-layout file or directory: every layer back in the source's layout and naming.

:func:`restore_layers` rebuilds each layer's plan from recipe and arguments
(:func:`~fimoe_lab.checkpoints.plan_choice.build_plan`), checks that the recorded steps equal the rebuilt ones
(:func:`check_record`; version-1 records by their shapes) and applies ``plan.inverse()`` (word bits undone
first). :func:`restore_directory` writes one converted output back as a checkpoint directory in its
convention: it reads each tensor a chunk of experts at a time (safetensors slices), verifies its checksum,
and writes the layer (:mod:`~fimoe_lab.checkpoints.stream`) before reading the next, then the tensors
convert carried through unchanged (:func:`kept_names`). The OUT of ``convert --rank all`` is reassembled
from these parts by :mod:`~fimoe_lab.checkpoints.expert_parallel`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Optional

import torch

from fimoe_lab import engines, value_rules
from fimoe_lab.checkpoints import conventions, safe_io, stream, unchanged
from fimoe_lab.checkpoints.conventions import dtype_name
from fimoe_lab.checkpoints.convert import dry_run, extra_map
from fimoe_lab.checkpoints.fileformat import (
    EDITED,
    KERNEL_NAMES,
    KernelFiles,
    check_digest,
    check_sizes,
    extra_steps,
    kept_tensors,
    layer_errors,
    layer_path,
    layer_where,
    out_name,
    tensor_steps,
)
from fimoe_lab.checkpoints.plan_choice import build_plan, layout_format
from fimoe_lab.checkpoints.reader import CheckpointError, MoELayer
from fimoe_lab.choice import LayoutChoice
from fimoe_lab.engines import ValueRule
from fimoe_lab.plan import LayerPlan, apply_map, copy_bytes

__all__ = [
    "shape_layer",
    "check_record",
    "restore_layer",
    "LayerBuffers",
    "restore_layers",
    "value_rule_notes",
    "RESTORED_MARK",
    "kept_names",
    "with_kept",
    "restored_config",
    "restore_directory",
]


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


def shape_layer(rec: dict) -> MoELayer:
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
        raise CheckpointError(f"checkpoint format {stored!r} is not laid out as {fmt!r}", fix=EDITED)
    return stored


def _check_v1_shapes(rec: dict) -> None:
    args = rec["plan"]["args"]
    choice = LayoutChoice(
        args["backend"], args["intermediate_alignment"], args["hidden_alignment"], engines.LEGACY_ENGINE
    )
    kernel, _, _ = dry_run(shape_layer(rec), choice)
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
    ``rows_of``/row steps must equal the plan's, and a recorded ``value_rule`` the plan's
    (:attr:`~fimoe_lab.plan.LayerPlan.value_rule`, its ``kept`` list aside: that says what the file holds,
    read from the record itself by :func:`kept_tensors`; a file converted before value rules records none and
    was not changed by one). Version 1 recorded display names of the
    steps; they are not compared (a display name is not data, and its spelling may change):
    instead the plan, dry-run on one expert with the recorded checkpoint dtypes and shapes,
    must give the recorded kernel dtype and shape of every tensor and extra.
    """
    if version == 1:
        _check_v1_shapes(rec)
        return
    recipe = rec["plan"]["recipe"]
    written = rec.get("value_rule")
    if written is not None and (plan.value_rule is None or _rule_of(written) != _rule_of(plan.value_rule.record())):
        rebuilt = plan.value_rule.record() if plan.value_rule is not None else None
        raise CheckpointError(f"value rule {written} in the file, {rebuilt} rebuilt by recipe {recipe}", fix=EDITED)
    for n, trec in rec["tensors"].items():
        _same_steps(n, trec["steps"], tensor_steps(plan, n), recipe)
    for n, xrec in rec["extras"].items():
        _same_steps(n, {"rows_of": xrec.get("rows_of"), "steps": xrec.get("steps")}, extra_steps(plan, n), recipe)


def _rule_of(record: dict) -> dict:
    """A value rule's record without ``kept`` (what the rule does, not what a file keeps of it)."""
    return {k: v for k, v in record.items() if k != "kept"}


class _Back:
    """One kernel tensor being read back: ``name`` (kernel ``kspec``) into a tensor ``out`` in the checkpoint
    layout ``cspec`` (from ``buffers``), a chunk of experts at a time (safetensors slices), each
    chunk mapped back by ``m`` (``m(x, out=...)`` writes the chunk ``x`` mapped back into ``out``'s bytes; None:
    copied unchanged) and hashed (its sha256 checked by :meth:`check` once every chunk is in); ``xor``: a byte
    every byte is XORed with after the map (:data:`~fimoe_lab.checkpoints.conventions.WEIGHT_XOR`; 0: none)."""

    def __init__(
        self,
        kf: KernelFiles,
        name: str,
        kspec: dict,
        cspec: dict,
        m: Optional[Callable[..., torch.Tensor]],
        buffers: LayerBuffers,
        xor: int = 0,
    ):
        self.xor = xor
        if name not in kf.keys():
            raise CheckpointError(f"{name} is recorded in the metadata but not in the file", fix=EDITED)
        self.sl, self.name, self.cspec, self.m = kf.get_slice(name), name, cspec, m
        shape = list(self.sl.get_shape())
        if (self.sl.get_dtype(), shape) != (kspec["dtype"], kspec["shape"]):
            raise CheckpointError(
                f"{name} is {self.sl.get_dtype()} {shape}, metadata says {kspec['dtype']} {kspec['shape']}", fix=EDITED
            )
        if not shape or shape[:1] != cspec["shape"][:1]:
            raise CheckpointError(
                f"{name}: kernel shape {shape} and checkpoint shape {cspec['shape']} do not start with one expert count",
                fix=EDITED,
            )
        self.experts = shape[0]
        self.expert_bytes = math.prod(shape[1:]) * conventions.SAFETENSORS_DTYPES[kspec["dtype"]].itemsize
        self.out = buffers.empty(cspec["shape"], conventions.SAFETENSORS_DTYPES[cspec["dtype"]])
        self.digest = hashlib.sha256()

    def fetch(self, e0: int, e1: int) -> torch.Tensor:
        """Experts ``[e0, e1)`` as the file holds them (nothing mapped), their pages read in on the calling thread
        (:func:`~fimoe_lab.checkpoints.stream.populate`: the file is memory-mapped)."""
        return stream.populate(self.sl[e0:e1].contiguous())

    def place(self, e0: int, e1: int, x: torch.Tensor, hasher: ThreadPoolExecutor) -> Future:
        """Experts ``[e0, e1)`` (``x``, from :meth:`fetch`): hashed on ``hasher`` (in order) while they are mapped
        back straight into ``out`` (no temporary: the map's last step writes ``out[e0:e1]``)."""
        hashed = hasher.submit(self.digest.update, stream.byte_view(x))
        dst = self.out[e0:e1]
        if self.m is None:
            copy_bytes(dst, x)
        else:
            self.m(x, out=dst)
        if self.xor:
            dst.view(-1).view(torch.uint8).bitwise_xor_(self.xor)
        return hashed

    def check(self, meta: dict) -> None:
        check_digest(meta, self.name, self.digest.hexdigest())


class LayerBuffers:
    """The output tensors of one restored layer handed to the next: a layer asks for tensors of the shapes and
    dtypes the one before it did (a model's MoE layers) and gets that layer's memory, whose pages are mapped
    already, instead of new memory that each page's first write maps (a page fault per page). :meth:`release`
    says the last layer's tensors are written out and free; until then nothing is handed out twice. Only the last
    layer's buffers are kept, and a request that finds none of its shape drops them all (this layer differs from
    the last), so memory stays one layer."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._used: list[tuple[tuple, torch.Tensor]] = []

    def empty(self, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` (contents undefined), the last layer's where it had one."""
        key = (tuple(shape), dtype)
        free = self._free.get(key)
        if not free:
            self._free = {}
        t = free.pop() if free else torch.empty(key[0], dtype=dtype)
        self._used.append((key, t))
        return t

    def release(self) -> None:
        """Every tensor handed out since the last release is free again (the rest are dropped)."""
        self._free = {}
        for key, t in self._used:
            self._free.setdefault(key, []).append(t)
        self._used = []


def restore_layer(
    kf: KernelFiles,
    meta: dict,
    idx: int,
    rec: dict,
    ready: Optional[Callable[[MoELayer, int], None]] = None,
    buffers: Optional[LayerBuffers] = None,
) -> MoELayer:
    """Layer ``idx`` back in the checkpoint layout, read and mapped back a chunk of experts at a time, every
    tensor's sha256 checked at the end. ``ready(layer, e)`` is called when experts ``[0, e)`` of every tensor
    are in place (their checksums not checked yet): restore writes them out while it reads the next chunk.
    ``buffers``: where the layer's tensors come from (None: new ones, the caller's to keep)."""
    name = lambda n: out_name(meta["prefix"], meta["block"], idx, n)  # noqa: E731
    check_sizes(kf, rec, name)
    plan = build_plan(rec["plan"], meta["version"])
    check_record(rec, plan, meta["version"])
    inverse = plan.inverse()
    missing = [n for n in inverse.moved() if n not in rec["tensors"]]
    if missing:
        raise CheckpointError(f"{plan.description}: {missing[0]} is required by the plan but not recorded", fix=EDITED)
    backs: dict[str, _Back] = {}
    pool = buffers if buffers is not None else LayerBuffers()  # never released: new tensors, the caller's
    rule_tensors = plan.value_rule.tensors if "value_rule" in rec and plan.value_rule is not None else ()
    kept = kept_tensors(rec)
    for n, trec in rec["tensors"].items():
        if n not in KERNEL_NAMES:
            raise CheckpointError(f"layer {idx} records a tensor {n!r}, not one of {list(KERNEL_NAMES)}", fix=EDITED)
        xor = conventions.WEIGHT_XOR.get(_checkpoint_format(rec), 0) if n in ("w13", "w2") else 0
        back = partial(inverse.apply_tensor, n) if n in inverse.moved() else None  # word bits undone first
        if n in kept:  # the checkpoint's bytes, kept beside the ones a value rule changed
            backs[n] = _Back(kf, name(kept[n]), trec["checkpoint"], trec["checkpoint"], None, pool)
            continue
        if n in rule_tensors:  # a value rule's shape undone (its values stay: value_rules.undo)
            back = partial(_undo_rule, plan.value_rule, n, tuple(trec["checkpoint"]["shape"]), back)
        backs[n] = _Back(kf, name(trec["name"]), trec["kernel"], trec["checkpoint"], back, pool, xor)
    extras = {}
    for n, x in rec["extras"].items():
        dtype = conventions.SAFETENSORS_DTYPES[x["dtype"]]
        m = extra_map(plan, n, torch.empty((), dtype=dtype))
        kspec, cspec = {"dtype": x["dtype"], "shape": x["kernel_shape"]}, {"dtype": x["dtype"], "shape": x["shape"]}
        undo = None if m is None else partial(apply_map, m.inverse(), what=name(n))
        extras[n] = _Back(kf, name(n), kspec, cspec, undo, pool)
    every = [*backs.values(), *extras.values()]
    counts = {b.experts for b in every}
    if len(counts) > 1:
        raise CheckpointError(f"layer {idx}: its tensors hold different expert counts {sorted(counts)}", fix=EDITED)
    e_count = counts.pop() if counts else 0
    layer = _layer_from_record(
        rec,
        {n: backs[n].out if n in backs else None for n in KERNEL_NAMES},
        {n: b.out for n, b in extras.items()},
        **layer_where(meta, idx, rec),
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


def _undo_rule(
    rule: ValueRule,
    name: str,
    checkpoint_shape: tuple[int, ...],
    back: Optional[Callable[[torch.Tensor], torch.Tensor]],
    x: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """A chunk of tensor ``name`` mapped back (``back``), then in the checkpoint's shape after ``rule``, into
    ``out``."""
    y = back(x) if back is not None else x
    return copy_bytes(out, value_rules.undo(rule, name, y, (y.shape[0], *checkpoint_shape[1:])))


def value_rule_notes(path: str | os.PathLike) -> list[dict]:
    """The tensors that ``restore`` of ``path`` (one converted file or directory) does not give back byte for byte,
    because the engine profile it was converted with changed values (``value_rule`` in a layer's record:
    :mod:`fimoe_lab.value_rules`) and the file keeps no copy of their checkpoint bytes (``kept`` in the record:
    convert keeps every changed tensor; a file whose record keeps none restores the engine's values):
    ``[{"layer", "tensors": their names in the file, "rule", "why"}]``, empty when every byte comes back."""
    notes = []
    with KernelFiles(path) as kf:
        meta = kf.meta
        for idx, rec in meta["layers"].items():
            if rec.get("value_rule") is None:
                continue
            with layer_errors(path, idx):
                plan = build_plan(rec["plan"], meta["version"])
                check_record(rec, plan, meta["version"])
                rule = plan.value_rule
                assert rule is not None  # check_record refuses a recorded rule the plan lacks
                kept = kept_tensors(rec)
                changed = [n for n in rule.tensors if n in rec["tensors"] and n not in kept]
                if not changed:
                    continue
                notes.append(
                    {
                        "layer": int(idx),
                        "tensors": [
                            out_name(meta["prefix"], meta["block"], int(idx), KERNEL_NAMES[n]) for n in changed
                        ],
                        "rule": rule.kind,
                        "why": _why(rule, rec["plan"]["args"].get("engine")),
                    }
                )
    return notes


def _why(rule: ValueRule, engine: Optional[str]) -> str:
    """Why the tensors ``rule`` changed (and the file keeps no copy of) are not the checkpoint's bytes."""
    if rule.kind == "fp8_requantize_max":
        which = "every expert's W13" if rule.where == "all" else "the W13 of experts whose gate and up scales differed"
        return (
            f"the {engine} profile requantized {which} to one scale, max(gate, up) ({rule.source}): restored as "
            f"those values with scales [max, max] (the checkpoint's gate and up scales are not recorded)"
        )
    return f"the {engine} profile changed their values ({rule.kind}, {rule.source})"


def _iter_layers(path: str | os.PathLike, kf: KernelFiles) -> Iterator[MoELayer]:
    for idx, rec in kf.meta["layers"].items():
        with layer_errors(path, idx):
            layer = restore_layer(kf, kf.meta, int(idx), rec)
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


RESTORED_MARK = {"written_by": "fimoe-lab restore"}
"""What the marker file of a restored directory holds (nothing of the machine: no path, no time)."""


def _restored_specs(path: str | os.PathLike, kf: KernelFiles, conv: conventions.Convention) -> dict:
    """Names, dtypes and shapes of every tensor restore writes: the layers', from the records alone (meta
    tensors), then the unchanged tensors' (:func:`kept_names`)."""
    meta, specs = kf.meta, {}
    for idx, rec in meta["layers"].items():
        with layer_errors(path, idx):
            name = lambda n, idx=idx: out_name(meta["prefix"], meta["block"], int(idx), n)  # noqa: E731
            check_sizes(kf, rec, name)
            layer = replace(shape_layer(rec), **layer_where(meta, int(idx), rec))
            for k, v in conv.to_tensors(meta["prefix"], int(idx), layer, layer_path(meta, idx)).items():
                specs[k] = (v.dtype, tuple(v.shape))
    return with_kept(path, specs, unchanged.specs_in(kf, kept_names(kf)))


def kept_names(kf: KernelFiles) -> list[str]:
    """The tensors of a converted file carried through unchanged: those its layer records do not name
    (:func:`~fimoe_lab.checkpoints.unchanged.names_in`)."""
    meta = kf.meta
    named = set()
    for idx, rec in meta["layers"].items():
        with layer_errors(kf.path, idx):
            name = lambda n, idx=idx: out_name(meta["prefix"], meta["block"], int(idx), n)  # noqa: E731
            named.update([name(t["name"]) for t in rec["tensors"].values()], map(name, rec["extras"]))
            named.update(map(name, kept_tensors(rec).values()))
    return unchanged.names_in(kf.keys(), named)


def with_kept(path: str | os.PathLike, specs: dict, kept: dict) -> dict:
    """``specs`` (the restored layers' tensors) followed by the unchanged tensors ``kept``; a name in both
    (an edited file) is refused."""
    clash = sorted(set(specs) & set(kept))
    if clash:
        raise CheckpointError(f"{path}: {clash[0]} is both a restored expert tensor and an unchanged one", fix=EDITED)
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
            raise CheckpointError(f"{self.path}: {k} is not among the tensors its records give", fix=EDITED)
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


def restored_config(meta: dict) -> dict:
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
    buffers = LayerBuffers()
    with stream.workers_for(target, hashing=False) as workers:
        for idx, rec in meta["layers"].items():
            emit = _Emit(path, conv, meta["prefix"], specs, target, workers, layer_path(meta, idx))
            emit.bar = bar
            with layer_errors(path, idx):
                layer = restore_layer(kf, meta, int(idx), rec, emit.ready, buffers)
                emit.rest(layer)
            del layer, emit
            workers.drain()  # this layer is out before the next is read, into its buffers
            buffers.release()
        unchanged.put_back(kf, kept_names(kf), target, workers, partial(check_digest, meta), bar)
        target.finish(workers)


def restore_directory(path: str | os.PathLike, out: Path, shard_bytes: int, progress: Any = False) -> Path:
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
        config = restored_config(meta)
        with safe_io.atomic_dir(out) as tmp:
            target = stream.ShardedOutput(tmp, specs, {"format": "pt"}, single=False, shard_bytes=shard_bytes)
            bar = stream.progress_bar(progress, specs, target, out, "restore")
            try:
                _restore_layers_into(path, kf, conv, specs, target, bar)
            finally:
                if bar is not None:
                    bar.close()
            safe_io.write_json(tmp / "config.json", config)
            safe_io.write_json(tmp / safe_io.MARKER, RESTORED_MARK)
    return out
