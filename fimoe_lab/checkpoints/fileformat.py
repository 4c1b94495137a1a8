"""The kernel-layout file format: what a converted file holds and records, read back and validated.

A converted file holds, per MoE layer, ``w13_weight``, ``w2_weight``, ``w13_weight_scale``,
``w2_weight_scale`` (:data:`KERNEL_NAMES`, vLLM's parameter names) in FlashInfer's kernel layout,
named :func:`out_name` (``<prefix><layer>.<block>.experts.<name>``), then every other tensor of the
source unchanged (:mod:`~fimoe_lab.checkpoints.unchanged`): a directory of shards in the Hugging Face
convention (``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``), or one file.

The metadata key ``fimoe_lab`` holds JSON (file format version :data:`FORMAT_VERSION`; every shard holds
the same, with the checksums of its own tensors), per layer:

- ``plan``: ``{"recipe": "<fmt>/<backend>", "args": {...}}``, the :data:`fimoe_lab.recipes.RECIPES`
  id and the :func:`fimoe_lab.recipes.plan_layer` arguments (format, backend, sizes, gating,
  alignments) that rebuild the plan (plans are deterministic:
  :func:`~fimoe_lab.checkpoints.plan_choice.build_plan`);
- ``tensors``: per tensor its kernel name, its steps as ``[{"kind", "params"}, ...]``
  (:func:`tensor_steps`: :meth:`IndexMap.spec`, each step rebuilt by ``steps.build(kind, params)``; a word
  bit step, ``sm90_mixed_word_bits`` of the SM90 MXFP4 x BF16 layout, comes after the byte steps and runs on
  every 32-bit word of the tensor: :attr:`LayerPlan.word_bits`) and its checkpoint and kernel dtype/shape;
  ``extras``: dtype/shape, and for a per-row bias the weight whose rows it follows (``rows_of``) with those
  row steps (:func:`extra_steps`).
- ``value_rule`` (where the engine profile changes values: :mod:`fimoe_lab.value_rules`): the rule's record
  (kind, the tensors it changes, its parameters, ``kept``: the tensors also written in their checkpoint bytes as
  ``<kernel name>_checkpoint``, :func:`kept_tensors`, which restore reads instead of the changed ones).
- ``checksums``: ``{tensor name: sha256 hex of its bytes}``, computed while streaming; restore verifies
  each tensor it reads (:func:`check_digest`).

Version-1 files (a ``builder`` module path, :data:`V1_BUILDER`, and display names of the steps) still
restore (:data:`READ_VERSIONS`; :func:`~fimoe_lab.checkpoints.restore.check_record`). Reading is
:class:`KernelFiles` (one file or a sharded directory, every shard's metadata checked equal, its fields
typed: :func:`read_kernel_metadata`); before anything is built from a record, :func:`check_sizes` bounds
every size it gives by the file's own bytes. A record that fails any check is an edited file
(:data:`EDITED`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import torch

from fimoe_lab import untrusted
from fimoe_lab.checkpoints import conventions, safe_io
from fimoe_lab.checkpoints.reader import CheckpointError
from fimoe_lab.errors import FimoeError
from fimoe_lab.plan import BIAS_ROWS, LayerPlan
from fimoe_lab.specs import FORMATS

__all__ = [
    "FORMAT_VERSION",
    "READ_VERSIONS",
    "V1_BUILDER",
    "KERNEL_NAMES",
    "KEPT_SUFFIX",
    "kept_tensors",
    "out_name",
    "tensor_steps",
    "extra_steps",
    "read_kernel_metadata",
    "KernelFiles",
    "EDITED",
    "check_digest",
    "MAX_SIZE",
    "check_sizes",
    "layer_where",
    "layer_errors",
    "layer_path",
]


EDITED = "the file was modified after conversion; convert the checkpoint again"
"""The fix of every error that finds a converted file not as convert wrote it (an edited file)."""


FORMAT_VERSION = 2
"""Version written: plans by recipe id, steps as kind/params."""


READ_VERSIONS = (1, 2)


V1_BUILDER = "fimoe_lab.prepare.plan_layer"
"""What version-1 files recorded as their plan ``builder`` (read only: version 2 records a recipe id)."""


KERNEL_NAMES = {"w13": "w13_weight", "w2": "w2_weight", "w13_scale": "w13_weight_scale", "w2_scale": "w2_weight_scale"}
"""Tensor names in a kernel-layout file (vLLM's FusedMoE parameter names)."""


KEPT_SUFFIX = "_checkpoint"
"""A tensor a value rule changed, kept in the checkpoint's layout and bytes beside its kernel one (``ValueRule.kept``:
the clamped block scales), is named ``<kernel name><KEPT_SUFFIX>`` (``w13_weight_scale_checkpoint``)."""


def kept_tensors(rec: dict) -> dict[str, str]:
    """The tensors a layer record keeps in checkpoint bytes beside the kernel ones: ``{plan name: name in the
    file (without the layer's prefix)}`` (empty without a value rule that keeps any)."""
    rule = rec.get("value_rule") or {}
    return {n: KERNEL_NAMES[n] + KEPT_SUFFIX for n in rule.get("kept", ()) if n in rec["tensors"]}


def tensor_steps(plan: LayerPlan, name: str) -> list[dict]:
    """What a file records as the steps of tensor ``name``: ``[{"kind", "params"}, ...]`` ([] when unmoved)."""
    return plan.tensor_steps(name)


def extra_steps(plan: LayerPlan, name: str) -> dict:
    """What a file records for an extra: ``{"rows_of": weight or None, "steps": that weight's row steps}``.

    A per-row bias moves as the leading row-keeping steps of its weight (:meth:`IndexMap.row_steps`);
    other extras stay as they are.
    """
    weight = BIAS_ROWS.get(name)
    m = getattr(plan, weight) if weight else None
    return {"rows_of": weight, "steps": m.row_steps().spec() if m is not None else []}


def out_name(prefix: str, block: str, layer: int, name: str) -> str:
    """The name of a layer's tensor in a converted file: ``<prefix><layer>.<block>.experts.<name>``."""
    return f"{prefix}{layer}.{block}.experts.{name}"


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
    meta = untrusted.parse_json(raw, f"{path}: its 'fimoe_lab' metadata", EDITED, CheckpointError)
    if not isinstance(meta, dict) or meta.get("version") not in READ_VERSIONS:
        version = meta.get("version") if isinstance(meta, dict) else None
        raise CheckpointError(
            f"{path}: metadata version {version}; this fimoe_lab reads versions {', '.join(map(str, READ_VERSIONS))}",
            fix="restore it with the fimoe_lab version that wrote it",
        )
    if not isinstance(meta.get("layers"), dict) or not isinstance(meta.get("checksums", {}), dict):
        raise CheckpointError(f"{path}: its metadata has no table of layers", fix=EDITED)
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
                raise CheckpointError(f"{root / f}: its metadata differs from {root / files[0]}'s", fix=EDITED)
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
            raise CheckpointError(f"{index} has no 'weight_map' of tensor names to shard files", fix=EDITED)
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
            raise CheckpointError(f"{path}: metadata field {key!r} is {meta[key]!r}, not {form}", fix=EDITED)
    for key in ("prefix", "block"):
        if key not in meta:
            raise CheckpointError(f"{path}: metadata has no {key!r}", fix=EDITED)


def check_digest(meta: dict, name: str, got: str) -> None:
    """Refuse tensor ``name`` if ``got``, the sha256 of its bytes, differs from the one ``convert`` recorded."""
    want = meta.get("checksums", {}).get(name)
    if want is None:
        if "checksums" in meta:
            raise CheckpointError(f"{name}: no checksum recorded for it", fix=EDITED)
        return  # written before checksums were recorded
    if got != want:
        raise CheckpointError(
            f"{name}: checksum mismatch (sha256 {got[:16]}..., recorded {str(want)[:16]}...): the tensor's bytes are "
            f"corrupt or were modified",
            fix="convert the source checkpoint again (or copy the file again)",
        )


MAX_SIZE = 1 << 24
"""Largest intermediate/hidden size a record may claim (real models: < 65536)."""


def check_sizes(f, rec: dict, name: Callable[[str], str]) -> None:
    """Bound what a record makes restore build: sizes are ints in ``[1, MAX_SIZE]`` and one expert's
    ``I x H`` values fit in its ``w13`` kernel tensor as the file holds it (bytes times the recorded format's
    values per byte: a non-gated packed FP4 W13 holds ``I x H / 2`` bytes), so a plan is never larger than
    twice the file's own bytes."""
    args = rec["plan"]["args"]
    sizes = {k: args.get(k) for k in ("intermediate", "hidden")}
    for k, v in sizes.items():
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_SIZE:
            raise CheckpointError(f"recorded {k} size {v!r} is not an integer in [1, {MAX_SIZE}]", fix=EDITED)
    w13 = name(rec["tensors"]["w13"]["name"])
    if w13 not in f.keys():
        raise CheckpointError(f"{w13} is recorded in the metadata but not in the file", fix=EDITED)
    sl = f.get_slice(w13)
    shape = list(sl.get_shape())
    dtype = conventions.SAFETENSORS_DTYPES.get(sl.get_dtype())
    per_expert = (math.prod(shape[1:]) if shape else 0) * (torch.empty((), dtype=dtype).element_size() if dtype else 1)
    packed = getattr(FORMATS.get(str(args.get("fmt"))), "values_per_byte", 1)  # a non-gated FP4 W13: I*H/2 bytes
    if sizes["intermediate"] * sizes["hidden"] > per_expert * packed:
        raise CheckpointError(
            f"recorded sizes intermediate {sizes['intermediate']} x hidden {sizes['hidden']} do not fit {w13} "
            f"({sl.get_dtype()} {shape})",
            fix=EDITED,
        )
    _check_shapes(rec, per_expert * max(1, shape[0] if shape else 1))


def _check_shapes(rec: dict, limit: int) -> None:
    """Every shape a record gives (checkpoint, kernel, extras) is a list of ints >= 0 whose element
    count is at most ``limit`` (the bytes of the file's own w13 tensor, the largest one)."""
    shapes = [(n, t[k]["shape"]) for n, t in rec["tensors"].items() for k in ("checkpoint", "kernel")]
    shapes += [(n, x[k]) for n, x in rec["extras"].items() for k in ("shape", "kernel_shape")]
    for n, sh in shapes:
        if not isinstance(sh, list) or not all(_is_int(d, 0) for d in sh) or math.prod(sh) > limit:
            raise CheckpointError(f"{n}: recorded shape {sh!r} is not one the file's tensors can hold", fix=EDITED)


def layer_where(meta: dict, idx: int, rec: dict) -> dict:
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
def layer_errors(path: str | os.PathLike, idx: str) -> Iterator[None]:
    """Any error while restoring layer ``idx`` as one CheckpointError naming the file and the layer."""
    try:
        yield
    except FimoeError as exc:
        raise exc.within(f"{path}: layer {idx}") from None
    except (KeyError, TypeError, AttributeError, IndexError, ValueError, RuntimeError) as exc:
        raise CheckpointError(
            f"{path}: layer {idx}: the metadata does not have the form convert writes "
            f"({type(exc).__name__}: {safe_io.one_line(exc)})",
            fix=EDITED,
        ) from None


def layer_path(meta: dict, idx: str) -> Optional[str]:
    """The source path of layer ``idx`` (``mtp.layers.0``) as convert recorded it; None: ``{prefix}{idx}``."""
    return (meta.get("layer_names") or {}).get(idx)
