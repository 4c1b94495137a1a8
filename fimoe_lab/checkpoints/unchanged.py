"""The tensors ``convert`` carries through unchanged, so that a converted directory is a whole checkpoint.

Unchanged: every tensor of the source that no MoE layer's routed experts hold (the names the convention writes
back for the MoE layers, :meth:`~fimoe_lab.checkpoints.conventions.Convention.to_tensors`): dense layers, routers
and their biases (the score-correction bias), shared experts, norms, embeddings, heads, MTP layers' own tensors.
Each is written under its source name with its dtype, shape and bytes, after the converted layers, checksummed
like them; ``restore`` copies each back (its sha256 checked), so convert then restore of every MoE layer gives
every tensor of the source and nothing else. ``--layer`` converts a part: the routed experts of the layers left
out are not written (they would be the bulk of the model), the other tensors are.

Ranks (``--tp T [--ep N]``): a rank's output holds its part of the converted layers; the unchanged tensors
are written once, into the output of rank :data:`HOLDER_RANK` only (``ep_rank * T/N + tp_rank == 0``;
``--rank R`` for ``R > 0`` writes none). Restoring the OUT of ``--rank all`` gives the whole checkpoint,
each tensor stored once; restoring rank 0 alone gives its slice of the MoE layers and every unchanged tensor;
another rank alone, its slice only.

Restore finds them without a list: the tensors of a converted file that its layer records do not name
(:func:`names_in`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch

from fimoe_lab.checkpoints import conventions, stream
from fimoe_lab.checkpoints.reader import Checkpoint
from fimoe_lab.errors import CheckpointError

__all__ = [
    "HOLDER_RANK",
    "CHUNK_BYTES",
    "Unchanged",
    "held_by_layers",
    "for_rank",
    "names_in",
    "copy_back",
    "specs_in",
    "put_back",
]

HOLDER_RANK = 0
"""The rank (``ep_rank * moe_tp + tp_rank``) whose output holds the unchanged tensors."""
CHUNK_BYTES = 64 << 20
"""Bytes of an unchanged tensor copied at a time (whole rows of its leading dim)."""

Spec = tuple[torch.dtype, tuple[int, ...]]


def held_by_layers(ck: Checkpoint, layers: Iterable[int]) -> set[str]:
    """Names of the source tensors that MoE layers ``layers`` hold: what the convention writes back for each
    (from shapes alone: the layer read as meta tensors)."""
    held: set[str] = set()
    for idx in layers:
        shape = ck.read_layer(idx, load="none")
        held.update(ck.convention.to_tensors(ck.prefix, idx, shape, ck.layer_names[idx]))
    return held


def _torch_dtype(name: str, dtype: Any) -> torch.dtype:
    """``dtype`` (a source tensor's, as the reader maps it) if it is a torch dtype; else one CheckpointError
    naming tensor ``name``, before anything is written (the header and checksum need a torch dtype)."""
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(
            f"{name} is stored as {dtype!r}, a safetensors dtype torch cannot hold",
            fix=f"use a torch with that dtype; the dtypes copied are {', '.join(conventions.SAFETENSORS_DTYPES)}",
        )
    return dtype


def _slice_dtype(name: str, sl: Any) -> torch.dtype:
    """The torch dtype of safetensors slice ``sl`` of tensor ``name`` (refused if torch has none)."""
    return _torch_dtype(name, conventions.SAFETENSORS_DTYPES.get(sl.get_dtype(), sl.get_dtype()))


@dataclass(frozen=True)
class Unchanged:
    """The unchanged tensors one output holds: ``names`` of checkpoint ``ck``, in order (module docstring)."""

    ck: Checkpoint
    names: tuple[str, ...]

    def specs(self) -> dict[str, Spec]:
        """``{name: (dtype, shape)}`` from the source's headers (nothing read)."""
        out = {}
        for n in self.names:
            dtype, shape = self.ck.header(n)
            out[n] = (_torch_dtype(n, dtype), tuple(shape))
        return out

    def chunks(self, name: str) -> Iterator[torch.Tensor]:
        """Tensor ``name`` as the source holds it, whole rows of its leading dim at a time (about
        :data:`CHUNK_BYTES`; a 0-d tensor whole)."""
        sl = self.ck._handle(name).get_slice(name)
        yield from _row_chunks(sl, list(sl.get_shape()), _slice_dtype(name, sl))

    def put(self, target: stream.ShardedOutput, workers: stream.Workers, bar: Any = None) -> None:
        """Copy every tensor ``target`` still needs into it (:meth:`~stream.ShardedOutput.needed`)."""
        for n in self.names:
            if not target.needed(n):
                continue
            for chunk in self.chunks(n):
                target.put(workers, n, chunk)
                if bar is not None:
                    bar.update(chunk.nbytes)


def _row_chunks(sl: Any, shape: list[int], dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """Slice ``sl`` (a safetensors slice of ``shape``) in whole rows of about :data:`CHUNK_BYTES`, contiguous."""
    if not shape or 0 in shape:
        yield sl[...].contiguous() if shape else sl[...].reshape(()).contiguous()
        return
    row = math.prod(shape[1:]) * torch.empty((), dtype=dtype).element_size()
    step = max(1, CHUNK_BYTES // max(1, row))
    for r0 in range(0, shape[0], step):
        yield sl[r0 : r0 + step].contiguous()


def for_rank(ck: Checkpoint, rank: int) -> Optional[Unchanged]:
    """What the output of global rank ``rank`` holds unchanged: every source tensor no MoE layer's routed experts
    hold (:func:`held_by_layers`), in name order, on :data:`HOLDER_RANK`; None on the other ranks."""
    if rank != HOLDER_RANK:
        return None
    held = held_by_layers(ck, ck.moe_layers)
    return Unchanged(ck, tuple(sorted(n for n in ck.weight_map if n not in held)))


def names_in(keys: Iterable[str], layer_tensors: Iterable[str]) -> list[str]:
    """The unchanged tensors of a converted file: its tensor names ``keys`` that its layer records do not name
    (``layer_tensors``), in name order."""
    named = set(layer_tensors)
    return sorted(k for k in keys if k not in named)


def copy_back(kf: Any, name: str, check: Any) -> Iterator[torch.Tensor]:
    """Unchanged tensor ``name`` read back from a converted file ``kf`` (``KernelFiles``) in row chunks, hashed
    as it goes; once the last chunk is out, ``check(name, sha256 hex)`` refuses bytes that differ from the
    recorded ones (the caller's output is written atomically, so a refusal leaves nothing)."""
    sl = kf.get_slice(name)
    digest = hashlib.sha256()
    for chunk in _row_chunks(sl, list(sl.get_shape()), _slice_dtype(name, sl)):
        digest.update(stream.byte_view(chunk))
        yield chunk
    check(name, digest.hexdigest())


def specs_in(kf: Any, names: Iterable[str]) -> dict[str, Spec]:
    """``{name: (dtype, shape)}`` of unchanged tensors ``names`` of a converted file ``kf`` (its headers)."""
    out = {}
    for n in names:
        sl = kf.get_slice(n)
        out[n] = (_slice_dtype(n, sl), tuple(sl.get_shape()))
    return out


def put_back(
    kf: Any, names: Iterable[str], target: stream.ShardedOutput, workers: stream.Workers, check: Any, bar: Any = None
) -> None:
    """Copy unchanged tensors ``names`` of a converted file ``kf`` into ``target`` (:func:`copy_back`)."""
    for n in names:
        for chunk in copy_back(kf, n, check):
            target.put(workers, n, chunk)
            if bar is not None:
                bar.update(chunk.nbytes)
