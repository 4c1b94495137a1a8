"""Kernel-layout files: convert checkpoint layers with a LayerPlan, write them atomically, restore.

``convert`` writes one safetensors file with, per MoE layer, ``w13_weight``, ``w2_weight``,
``w13_weight_scale``, ``w2_weight_scale`` in FlashInfer's kernel layout (vLLM's parameter
names), gpt-oss biases moved with their weight's rows, and the other extras unchanged (NVFP4
``weight_scale_2``/``input_scale``).

The metadata key ``fimoe_lab`` holds JSON (file format version 2), per layer:

- ``plan``: ``{"recipe": "<fmt>/<backend>", "args": {...}}``, the :data:`fimoe_lab.recipes.RECIPES`
  id and the :func:`fimoe_lab.recipes.plan_layer` arguments (format, backend, sizes, gating,
  alignments) that rebuild the plan (plans are deterministic);
- ``tensors``: per tensor its kernel name, its steps as ``[{"kind", "params"}, ...]``
  (:meth:`IndexMap.spec`, each step rebuilt by ``steps.build(kind, params)``) and its
  checkpoint and kernel dtype/shape; ``extras``: dtype/shape, and for a per-row bias the
  weight whose rows it follows (``rows_of``) with those row steps.

:func:`restore_layers` rebuilds the plan from recipe and arguments, checks that the recorded
steps equal the rebuilt ones, and applies ``plan.inverse()``. Version-1 files (a ``builder``
module path and display names of the steps) still restore: see :func:`check_record`.

- ``checksums``: ``{tensor name: sha256 hex of its bytes}``, computed while streaming;
  :func:`restore_layers` verifies each tensor it reads (:func:`verify_checksum`).

The file is streamed (header first, one layer in memory at a time) to a temporary created
exclusively beside the output, fsynced and renamed only when complete
(:mod:`fimoe_lab.checkpoints.safe_io`): an interrupted or failed conversion leaves no output
file behind, and an existing output is replaced only with ``force`` and only if this tool
wrote it. Restore bounds every size a record gives by the file's own bytes before it builds
anything (:func:`_check_sizes`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch

from fimoe_lab import engines, recipes
from fimoe_lab.checkpoints import conventions, safe_io
from fimoe_lab.checkpoints.conventions import dtype_name
from fimoe_lab.checkpoints.reader import Checkpoint, CheckpointError, MoELayer
from fimoe_lab.errors import FimoeError
from fimoe_lab.layout import IndexMap
from fimoe_lab.plan import BIAS_ROWS, LayerPlan, apply_map
from fimoe_lab.specs import weight_formats

__all__ = [
    "FORMAT_VERSION",
    "READ_VERSIONS",
    "KERNEL_NAMES",
    "plan_args",
    "build_plan",
    "suggest_alignment",
    "convert_layer",
    "write_kernel_layout",
    "convert_checkpoint",
    "read_kernel_metadata",
    "check_record",
    "restore_layers",
    "restore_checkpoint",
    "verify_checksum",
]

FORMAT_VERSION = 2
"""Version written: plans by recipe id, steps as kind/params."""
READ_VERSIONS = (1, 2)
V1_BUILDER = "fimoe_lab.prepare.plan_layer"
"""What version-1 files recorded as their plan ``builder`` (read only: version 2 records a recipe id)."""


KERNEL_NAMES = {"w13": "w13_weight", "w2": "w2_weight", "w13_scale": "w13_weight_scale", "w2_scale": "w2_weight_scale"}
"""Tensor names in a kernel-layout file (vLLM's FusedMoE parameter names)."""


# ============================================================================ plans
def plan_args(
    layer: MoELayer,
    backend: str,
    intermediate_alignment: Optional[int] = None,
    hidden_alignment: Optional[int] = None,
    engine: Optional[str] = None,
) -> dict:
    """The record that rebuilds this layer's plan: ``{"recipe": id, "args": plan_layer keyword arguments}``.

    ``engine``: the profile (:mod:`fimoe_lab.engines`; None: ``engines.DEFAULT_ENGINE``),
    recorded by its resolved name so that ``restore`` rebuilds with the same defaults. Files
    that record none were written before profiles and rebuild with ``engines.LEGACY_ENGINE``
    (:func:`build_plan`).
    """

    if layer.fmt not in weight_formats():
        raise CheckpointError(
            f"no layout plan for format {layer.fmt!r}",
            fix=f"convert one of the weight formats {', '.join(weight_formats())}",
        )
    return {
        "recipe": recipes.recipe_id(layer.fmt, backend),
        "args": {
            "fmt": layer.fmt,
            "backend": backend,
            "intermediate": layer.intermediate,
            "hidden": layer.hidden,
            "is_act_and_mul": layer.is_act_and_mul,
            "is_gated": layer.is_gated,
            "intermediate_alignment": intermediate_alignment,
            "hidden_alignment": hidden_alignment,
            "engine": engines.get_engine(engine or engines.DEFAULT_ENGINE).name,
        },
    }


def build_plan(record: dict, version: int = FORMAT_VERSION) -> LayerPlan:
    """Rebuild a :class:`LayerPlan` with :func:`fimoe_lab.recipes.plan_layer` from a :func:`plan_args` record.

    Version 2 names the recipe (``"<fmt>/<backend>"``, which must be the arguments'); version 1
    named the builder function :data:`V1_BUILDER` instead. A record without ``engine`` (written
    before engine profiles) rebuilds with ``fimoe_lab.engines.LEGACY_ENGINE``, the defaults
    it was written with.
    """

    args = dict(record.get("args") or {})
    args.setdefault("engine", engines.LEGACY_ENGINE)
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


def suggest_alignment(layer: MoELayer, backend: str, engine: Optional[str] = None) -> Optional[int]:
    """The smallest intermediate alignment in :data:`TRY_ALIGNMENTS` whose plan builds for this layer, or None."""
    for a in TRY_ALIGNMENTS:
        try:
            build_plan(plan_args(layer, backend, a, engine=engine))
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
) -> tuple[dict[str, torch.Tensor], LayerPlan, dict]:
    """One layer into the kernel layout: ``(tensors by kernel name, plan, plan spec)``.

    ``engine``: the profile whose defaults and layouts apply (:mod:`fimoe_lab.engines`;
    None: the newest vLLM's, ``engines.DEFAULT_ENGINE``). Only bytes move (block scales are
    not clamped; see ``inspect`` for dead scales). Biases (gpt-oss) follow their weight's
    rows; other extras pass unchanged.
    """
    spec = plan_args(layer, backend, intermediate_alignment, hidden_alignment, engine=engine)
    plan = build_plan(spec)
    outs = plan.apply(
        layer.w13.contiguous(),
        layer.w2.contiguous(),
        None if layer.w13_scale is None else layer.w13_scale.contiguous(),
        None if layer.w2_scale is None else layer.w2_scale.contiguous(),
    )
    tensors = {KERNEL_NAMES[n]: t for n, t in zip(KERNEL_NAMES, outs) if t is not None}
    for name, t in layer.extras.items():
        tensors[name] = _map_extra(plan, name, t, inverse=False)
    return tensors, plan, spec


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
    m = plan.maps().get(name)
    return m.spec() if m is not None else []


def _extra_steps(plan: LayerPlan, name: str) -> dict:
    """What a file records for an extra: ``{"rows_of": weight or None, "steps": that weight's row steps}``.

    A per-row bias moves as the leading row-keeping steps of its weight (:meth:`IndexMap.row_steps`);
    other extras stay as they are.
    """
    weight = BIAS_ROWS.get(name)
    m = getattr(plan, weight) if weight else None
    return {"rows_of": weight, "steps": m.row_steps().spec() if m is not None else []}


# ============================================================================ streaming safetensors
class _StreamWriter:
    """Writes a safetensors file whose tensor names, dtypes and shapes are known up front.

    With ``checksum_key``, the JSON metadata under that key gets ``"checksums": {tensor name:
    sha256 hex of its bytes}``, computed while the bytes stream out: the header is written
    first with placeholders of the same length, and :meth:`finish` rewrites it in place.
    """

    def __init__(
        self,
        handle,
        specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
        metadata: dict,
        checksum_key: Optional[str] = None,
    ):
        offset = 0
        self.expected = {}
        self.entries: dict = {}
        for name, (dtype, shape) in specs.items():
            size = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            self.entries[name] = {
                "dtype": dtype_name(dtype),
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            self.expected[name] = (dtype, tuple(shape), offset)
            offset += size
        self.metadata, self.checksum_key = metadata, checksum_key
        self.sums = {name: PLACEHOLDER for name in specs}
        self._pending: Optional[tuple[str, threading.Thread, dict]] = None  # the checksum still running
        raw = self._header()
        self.handle, self.start, self.pos, self.header_len = handle, 8 + len(raw), 0, len(raw)
        handle.write(struct.pack("<Q", len(raw)))
        handle.write(raw)

    def _header(self) -> bytes:
        meta = dict(self.metadata)
        if self.checksum_key is not None:
            meta[self.checksum_key] = json.dumps({**self.metadata[self.checksum_key], "checksums": self.sums})
        raw = json.dumps({"__metadata__": meta, **self.entries}, separators=(",", ":")).encode()
        return raw + b" " * (-len(raw) % 8)

    def write(self, name: str, t: torch.Tensor) -> None:
        dtype, shape, offset = self.expected[name]
        if t.dtype != dtype or tuple(t.shape) != shape or offset != self.pos:
            raise CheckpointError(
                f"internal: {name} is {t.dtype} {tuple(t.shape)} at {self.pos}, header says {dtype} {shape} at {offset}"
            )
        data = memoryview(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
        if self.checksum_key is None or data.nbytes < HASH_THREAD_MIN:
            if self.checksum_key is not None:
                self.sums[name] = hashlib.sha256(data).hexdigest()
            self.handle.write(data)
        else:  # hash on a second thread while this one writes and transforms the next tensor
            self._join_hash()
            digest: dict = {}
            worker = threading.Thread(target=lambda: digest.setdefault("h", hashlib.sha256(data).hexdigest()))
            worker.start()
            self._pending = (name, worker, digest)
            try:
                self.handle.write(data)
            except BaseException:
                self._join_hash()
                raise
        self.pos += data.nbytes

    def _join_hash(self) -> None:
        """Wait for the checksum still being computed (at most one: it holds its tensor's bytes)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            name, worker, digest = pending
            worker.join()
            self.sums[name] = digest["h"]

    def finish(self) -> None:
        """Rewrite the header with the checksums (same length: every digest is 64 hex digits)."""
        self._join_hash()
        if self.checksum_key is None:
            return
        raw = self._header()
        if len(raw) != self.header_len:
            raise CheckpointError(f"internal: header length changed from {self.header_len} to {len(raw)}")
        self.handle.flush()
        self.handle.seek(8)
        self.handle.write(raw)
        self.handle.seek(0, os.SEEK_END)


HASH_THREAD_MIN = 1 << 20
"""Tensors of at least this many bytes are hashed on a second thread, overlapping the write."""
PLACEHOLDER = "0" * 64
"""A checksum not yet computed (the length of a sha256 hex digest)."""


# ============================================================================ writing
LayerSource = tuple[int, MoELayer, Callable[[], MoELayer]]
"""(layer index, layer with shapes only (meta tensors allowed), loader of the real layer)."""


def _out_name(prefix: str, block: str, layer: int, name: str) -> str:
    return f"{prefix}{layer}.{block}.experts.{name}"


def _dtype_shape(dtype: torch.dtype, shape: Sequence[int]) -> dict:
    return {"dtype": dtype_name(dtype), "shape": list(shape)}


def _dry_run(
    layer: MoELayer, backend: str, ia: Optional[int], ha: Optional[int], engine: Optional[str] = None
) -> tuple[dict, LayerPlan, dict]:
    """Kernel ``(dtype, shape)`` by kernel name of a layer (shapes only; meta tensors allowed), from
    a one-expert conversion; with the plan and its :func:`plan_args` record."""

    def one_expert(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else torch.zeros((1,) + tuple(t.shape[1:]), dtype=t.dtype)

    probe = layer.with_tensors(**{n: one_expert(t) for n, t in layer.tensors().items()})
    probe = replace(probe, extras={n: one_expert(t) for n, t in layer.extras.items()})
    tensors, plan, spec = convert_layer(probe, backend, ia, ha, engine)
    return {n: (t.dtype, (layer.num_experts,) + tuple(t.shape[1:])) for n, t in tensors.items()}, plan, spec


def _kernel_specs(
    layer: MoELayer, backend: str, ia: Optional[int], ha: Optional[int], engine: Optional[str] = None
) -> tuple[dict, dict]:
    """Kernel dtypes/shapes of a layer (:func:`_dry_run`) and its metadata record (module docstring)."""
    kernel, plan, spec = _dry_run(layer, backend, ia, ha, engine)
    record = {
        "plan": spec,
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
) -> Path:
    """Convert and stream layers into one kernel-layout safetensors file at ``out`` (atomically).

    ``sources``: ``(layer index, shape-only layer, loader)``; every plan is built and
    checked (so a layer that cannot be laid out fails before anything is written), then
    the layers are loaded, converted and written one at a time. ``info`` goes into the
    metadata (source path, convention, config, TP rank), with a sha256 per tensor.
    An existing ``out`` is replaced only with ``force`` and only if this tool wrote it
    (:func:`fimoe_lab.checkpoints.safe_io.check_output`).
    """
    out = Path(out)
    safe_io.check_output(out, [], force, "file")
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    records = {}
    for idx, shape_layer, _ in sources:
        try:
            kernel, record = _kernel_specs(shape_layer, backend, intermediate_alignment, hidden_alignment, engine)
        except ValueError as exc:
            a = suggest_alignment(shape_layer, backend, engine) if intermediate_alignment is None else None
            fix = (
                f"intermediate alignment {a} works (CLI: --intermediate-alignment {a})"
                if a
                else getattr(exc, "fix", None)
            )
            raise CheckpointError(
                f"layer {idx} ({shape_layer.fmt}, intermediate {shape_layer.intermediate}, hidden "
                f"{shape_layer.hidden}) cannot be laid out for {backend}: "
                f"{exc.message if isinstance(exc, FimoeError) else exc}",
                fix=fix,
            ) from exc
        for n, spec in kernel.items():
            specs[_out_name(prefix, block, idx, n)] = spec
        records[str(idx)] = record
    meta = {
        "version": FORMAT_VERSION,
        "backend": backend,
        "prefix": prefix,
        "block": block,
        **(info or {}),
        "layers": records,
    }
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(
            total=sum(int(torch.Size(s).numel()) * torch.empty((), dtype=d).element_size() for d, s in specs.values()),
            unit="B",
            unit_scale=True,
            desc=f"convert -> {Path(out).name}",
        )
    with safe_io.atomic_file(out) as handle:
        writer = _StreamWriter(handle, specs, {"fimoe_lab": meta}, checksum_key="fimoe_lab")
        for idx, _, load in sources:
            layer = load()
            tensors, _, _ = convert_layer(layer, backend, intermediate_alignment, hidden_alignment, engine)
            for name in (n for n in specs if n.startswith(_out_name(prefix, block, idx, ""))):
                t = tensors[name.rsplit(".", 1)[-1]]
                writer.write(name, t)
                if bar is not None:
                    bar.update(t.numel() * t.element_size())
        writer.finish()
    if bar is not None:
        bar.close()
    return Path(out)


def convert_checkpoint(
    src: str | os.PathLike,
    out: str | os.PathLike,
    backend: str,
    tp_size: int = 1,
    tp_rank: int = 0,
    layers: Optional[Iterable[int]] = None,
    intermediate_alignment: Optional[int] = None,
    hidden_alignment: Optional[int] = None,
    progress: bool = False,
    force: bool = False,
    engine: Optional[str] = None,
) -> Path:
    """Read ``src`` (rank ``tp_rank`` of ``tp_size``), convert its MoE layers for ``backend``, write ``out``.

    ``engine``: the profile (``vllm-0.34`` by default; :mod:`fimoe_lab.engines`), recorded in the file.

    ``out`` is vetted before anything is read (never the input, inside it or a parent of it;
    an existing one only with ``force`` and only if this tool wrote it).
    """
    safe_io.check_output(Path(out), [Path(src)], force, "file")
    with safe_io.OutputLock(Path(out)), Checkpoint(src) as ck:  # a second writer of OUT fails before reading
        wanted = ck.moe_layers if layers is None else list(layers)
        missing = [l for l in wanted if l not in ck.moe_layers]
        if missing:
            raise CheckpointError(
                f"{src}: layers {missing} have no routed experts", fix=f"choose from the MoE layers {ck.moe_layers}"
            )
        sources = [
            (
                l,
                ck.read_layer(l, tp_size, tp_rank, load="none"),
                (lambda l=l: ck.read_layer(l, tp_size, tp_rank, progress=progress)),
            )
            for l in wanted
        ]
        info = {
            "source": str(Path(src).resolve()),
            "convention": ck.convention.name,
            "config": ck.config,
            "tp_size": tp_size,
            "tp_rank": tp_rank,
        }
        return write_kernel_layout(
            out,
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
        )


# ============================================================================ restoring
def read_kernel_metadata(path: str | os.PathLike) -> dict:
    """The ``fimoe_lab`` metadata of a kernel-layout file (``CheckpointError`` if it has none or a newer version)."""
    with safe_io.open_safetensors(Path(path), "kernel-layout file") as f:
        raw = (f.metadata() or {}).get("fimoe_lab")
    if raw is None:
        raise CheckpointError(
            f"{path} has no 'fimoe_lab' metadata: it was not written by 'fimoe-lab convert', so the "
            f"steps that produced its layout are unknown",
            fix="convert the source checkpoint with 'fimoe-lab convert'",
        )
    try:
        meta = json.loads(raw)
    except ValueError as exc:
        raise CheckpointError(f"{path}: its 'fimoe_lab' metadata is not JSON ({exc})", fix=_EDITED) from None
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


def _is_int(v: object, lo: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


_FIELDS: dict[str, tuple[Callable[[object], bool], str]] = {
    "prefix": (lambda v: isinstance(v, str), "a string"),
    "block": (lambda v: isinstance(v, str), "a string"),
    "convention": (lambda v: v is None or isinstance(v, str), "a convention name"),
    "config": (lambda v: v is None or isinstance(v, dict), "a JSON object"),
    "tp_size": (lambda v: _is_int(v, 1), "an integer >= 1"),
    "tp_rank": (lambda v: _is_int(v, 0), "an integer >= 0"),
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


def verify_checksum(meta: dict, name: str, t: torch.Tensor) -> None:
    """Refuse tensor ``name`` if its bytes' sha256 differs from the one ``convert`` recorded."""
    want = meta.get("checksums", {}).get(name)
    if want is None:
        if "checksums" in meta:
            raise CheckpointError(f"{name}: no checksum recorded for it", fix=_EDITED)
        return  # written before checksums were recorded
    got = hashlib.sha256(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())).hexdigest()
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
    """The :class:`MoELayer` a layer record describes, holding tensors ``t`` (by plan name) and ``extras``."""
    args = rec["plan"]["args"]
    return MoELayer(
        args["fmt"],
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


def _check_v1_shapes(rec: dict) -> None:
    args = rec["plan"]["args"]
    kernel, _, _ = _dry_run(
        _shape_layer(rec),
        args["backend"],
        args["intermediate_alignment"],
        args["hidden_alignment"],
        engines.LEGACY_ENGINE,
    )
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


def _read_kernel(f, meta: dict, name: str, spec: dict) -> torch.Tensor:
    if name not in f.keys():
        raise CheckpointError(f"{name} is recorded in the metadata but not in the file", fix=_EDITED)
    t = f.get_tensor(name)
    if (dtype_name(t.dtype), list(t.shape)) != (spec["dtype"], spec["shape"]):
        raise CheckpointError(
            f"{name} is {dtype_name(t.dtype)} {list(t.shape)}, metadata says {spec['dtype']} {spec['shape']}",
            fix=_EDITED,
        )
    verify_checksum(meta, name, t)
    return t


MAX_SIZE = 1 << 24
"""Largest intermediate/hidden size a record may claim (real models: < 65536)."""


def _check_sizes(f, rec: dict, name: Callable[[str], str]) -> None:
    """Bound what a record makes restore build: sizes are ints in ``[1, MAX_SIZE]`` and one expert's
    ``I x H`` values fit in its ``w13`` kernel tensor as the file holds it (so a plan is never larger
    than the file's own bytes)."""
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
    if sizes["intermediate"] * sizes["hidden"] > per_expert:
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


def _restore_layer(f, meta: dict, idx: int, rec: dict) -> MoELayer:
    name = lambda n: _out_name(meta["prefix"], meta["block"], idx, n)  # noqa: E731
    _check_sizes(f, rec, name)
    plan = build_plan(rec["plan"], meta["version"])
    check_record(rec, plan, meta["version"])
    kernel = {n: _read_kernel(f, meta, name(trec["name"]), trec["kernel"]) for n, trec in rec["tensors"].items()}
    back = plan.inverse().apply(*(kernel.get(n) for n in KERNEL_NAMES))
    t = {
        n: (_as_checkpoint(x, rec["tensors"][n]["checkpoint"]) if n in rec["tensors"] else None)
        for n, x in zip(KERNEL_NAMES, back)
    }
    extras = {}
    for n, x in rec["extras"].items():
        raw = _read_kernel(f, meta, name(n), {"dtype": x["dtype"], "shape": x["kernel_shape"]})
        extras[n] = _map_extra(plan, n, raw, inverse=True)
    return _layer_from_record(
        rec,
        t,
        extras,
        layer=idx,
        convention=meta.get("convention"),
        tp_size=meta.get("tp_size", 1),
        tp_rank=meta.get("tp_rank", 0),
        activation=rec["activation"],
        activation_params=rec["activation_params"],
    )


def restore_layers(path: str | os.PathLike) -> tuple[dict, list[MoELayer]]:
    """Map a kernel-layout file (version 1 or 2) back to the checkpoint layout: ``(metadata, layers)``.

    Rebuilds each layer's plan from the recorded recipe and arguments, checks it against the
    record (:func:`check_record`), verifies each tensor's recorded sha256 and applies the
    inverse plan (padding dropped). Metadata that does not have the shape ``convert`` writes
    is refused with one CheckpointError.
    """
    meta = read_kernel_metadata(path)
    layers = []
    with safe_io.open_safetensors(Path(path), "kernel-layout file") as f:
        for idx, rec in meta["layers"].items():
            try:
                layers.append(_restore_layer(f, meta, int(idx), rec))
            except FimoeError as exc:
                raise exc.within(f"{path}: layer {idx}") from None
            except (KeyError, TypeError, AttributeError, IndexError, ValueError, RuntimeError) as exc:
                raise CheckpointError(
                    f"{path}: layer {idx}: the metadata does not have the form convert writes "
                    f"({type(exc).__name__}: {safe_io.one_line(exc)})",
                    fix=_EDITED,
                ) from None
    return meta, layers


def restore_checkpoint(path: str | os.PathLike, out_dir: str | os.PathLike, force: bool = False) -> Path:
    """Write a kernel-layout file back as a checkpoint directory in its original naming convention.

    The result (``config.json``, index, one shard, and the marker
    :data:`~fimoe_lab.checkpoints.safe_io.MARKER`) holds the MoE expert tensors of the
    converted layers, byte-identical to the source's (for a TP shard: the rank's slice,
    with config.json's intermediate size set to the shard's). Written atomically; an
    existing ``out_dir`` is replaced only with ``force`` and only if ``restore`` wrote it.
    """
    out = Path(out_dir)
    safe_io.check_output(out, [Path(path)], force, "dir")
    with safe_io.OutputLock(out):  # a second writer of OUT fails before reading
        return _restore_into(path, out)


def _restore_into(path: str | os.PathLike, out: Path) -> Path:
    """The body of :func:`restore_checkpoint`, under its output's lock."""
    meta, layers = restore_layers(path)
    if not meta.get("convention"):
        raise CheckpointError(
            f"{path}: no source convention recorded (written from in-memory layers)", fix="use restore_layers()"
        )
    conv = conventions.get(meta["convention"])
    tensors: dict[str, torch.Tensor] = {}
    for layer in layers:
        tensors.update(conv.to_tensors(meta["prefix"], layer.layer, layer))
    config = dict(meta.get("config") or {})
    if layers and meta.get("tp_size", 1) > 1:
        config[next((k for k in conv.intermediate_keys if k in config), conv.intermediate_keys[0])] = layers[
            0
        ].intermediate
    shard = "model-00001-of-00001.safetensors"
    with safe_io.atomic_dir(out) as tmp:
        with safe_io.create_new(tmp / shard) as handle:
            writer = _StreamWriter(handle, {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}, {"format": "pt"})
            for k, v in tensors.items():
                writer.write(k, v)
        total = sum(v.numel() * v.element_size() for v in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": {k: shard for k in sorted(tensors)}}
        safe_io.write_json(tmp / "model.safetensors.index.json", index)
        safe_io.write_json(tmp / "config.json", config)
        safe_io.write_json(tmp / safe_io.MARKER, {"restored_from": str(Path(path).resolve())})
    return out
