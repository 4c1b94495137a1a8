"""Restore a checkpoint converted with expert parallelism: reassemble every EP rank's experts.

``convert --tp T --ep N`` (:func:`~fimoe_lab.checkpoints.writer.rank_part`) gives rank ``r`` the
contiguous experts :func:`~fimoe_lab.checkpoints.writer.expert_range` of EP rank ``r // (T/N)``,
recording ``ep_size``, ``ep_rank``, ``experts`` ``[e0, e1)`` and ``num_experts`` in its metadata.
One rank's file holds experts ``e0 .. e1-1`` under local indices ``0 .. e1-e0-1``, so it is not
restored alone. :func:`restore_ranks` reads ``OUT/rank-<r>`` of every rank of a run with
``T == N`` (no intermediate slicing), checks the ranks agree (same metadata apart from the EP
fields and checksums) and their ranges tile ``[0, num_experts)`` in EP-rank order, then per layer
restores each rank's experts, concatenates them along the expert dim (``w13 (E, 2I, H)`` =
``cat_r w13_r (E_r, 2I, H)``, likewise every tensor and extra) and writes the full layer in the
source's naming, one layer in memory (plus its parts). With ``T > N`` the intermediate slices of
the moe-TP ranks would also have to be joined: refused.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import torch

from fimoe_lab.checkpoints import conventions, safe_io, stream, writer
from fimoe_lab.checkpoints.reader import MoELayer
from fimoe_lab.errors import CheckpointError

__all__ = ["EP_FIELDS", "rank_dirs", "restore_ranks"]

EP_FIELDS = ("ep_rank", "experts", "checksums")
"""Metadata that differs between the EP ranks of one run (everything else must be equal)."""


def rank_dirs(path: Path) -> list[Path]:
    """The ``rank-<r>`` directories of ``path`` in rank order (``convert --rank all``), [] if none."""
    if not path.is_dir() or os.path.lexists(path / safe_io.INDEX):
        return []
    found = [p for p in path.iterdir() if safe_io.RANK_RE.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def _cat(parts: list[MoELayer]) -> MoELayer:
    """One layer holding the experts of ``parts`` in order (every tensor and extra concatenated along dim 0)."""

    def cat(ts: list[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
        return None if ts[0] is None else torch.cat([t for t in ts if t is not None])

    first = parts[0]
    tensors = {n: cat([p.tensors()[n] for p in parts]) for n in first.tensors()}
    extras = {n: torch.cat([p.extras[n] for p in parts]) for n in first.extras}
    return replace(first.with_tensors(**tensors), extras=extras)


def _common(meta: dict[str, Any]) -> dict[str, Any]:
    """What the EP ranks of one run share: the metadata without :data:`EP_FIELDS`, every recorded tensor
    shape without its leading (expert) dim."""

    def per_expert(x: object) -> object:
        if isinstance(x, dict):
            return {
                k: v[1:] if k in ("shape", "kernel_shape") and isinstance(v, list) else per_expert(v)
                for k, v in x.items()
            }
        return [per_expert(v) for v in x] if isinstance(x, list) else x

    return {k: per_expert(v) if k == "layers" else v for k, v in meta.items() if k not in EP_FIELDS}


def _check_ranks(path: Path, dirs: list[Path], metas: list[dict[str, Any]]) -> list[int]:
    """The order of ``metas`` by EP rank, after checking they are the EP ranks of one run (module docstring)."""
    names = ", ".join(d.name for d in dirs)
    if not all(m.get("ep_size", 1) > 1 for m in metas):
        raise CheckpointError(
            f"{path} holds one converted directory per rank ({names})",
            fix=f"restore one of them, e.g. {dirs[0]} (expert-parallel ranks are reassembled, TP slices are not)",
        )
    if any(m.get("tp_size", 1) != 1 for m in metas):
        raise CheckpointError(
            f"{path}: the ranks also slice the intermediate dim (--tp larger than --ep); only experts are reassembled",
            fix="joining intermediate slices is not supported: convert with --tp equal to --ep to restore the experts",
        )
    n, total = metas[0]["ep_size"], metas[0].get("num_experts")
    order = sorted(range(len(metas)), key=lambda i: metas[i].get("ep_rank", -1))
    if len(metas) != n or [metas[i].get("ep_rank") for i in order] != list(range(n)):
        raise CheckpointError(f"{path}: {names} are not the {n} EP ranks of one convert", fix=writer._EDITED)
    common = _common(metas[0])
    for d, m in zip(dirs, metas):
        if _common(m) != common:
            raise CheckpointError(f"{d}: its metadata differs from {dirs[0]}'s beyond the EP rank", fix=writer._EDITED)
    for r, i in enumerate(order):
        if not isinstance(total, int) or metas[i].get("experts") != list(writer.expert_range(total, n, r)):
            raise CheckpointError(
                f"{dirs[i]}: experts {metas[i].get('experts')} are not EP rank {r}'s of {total} experts over {n}",
                fix=writer._EDITED,
            )
    return order


def restore_ranks(
    path: str | os.PathLike[str], out_dir: str | os.PathLike[str], force: bool = False, shard_size: Optional[int] = None
) -> Path:
    """Reassemble the EP ranks ``path/rank-<r>`` of one ``convert --tp N --ep N --rank all`` into one checkpoint
    directory at ``out_dir``, byte-identical to the source's expert tensors (module docstring); written like
    :func:`~fimoe_lab.checkpoints.writer.restore_checkpoint` (atomically, ``force`` only over restore's own)."""
    path, out = Path(path), Path(out_dir)
    safe_io.check_output(out, [path], force, "dir")
    dirs = rank_dirs(path)
    if not dirs:
        raise CheckpointError(f"{path} has no rank-<r> directories", fix="pass the OUT of 'convert --rank all'")
    with safe_io.signals_raise(), safe_io.OutputLock(out), ExitStack() as stack:
        kfs = [stack.enter_context(writer.KernelFiles(d)) for d in dirs]
        order = _check_ranks(path, dirs, [kf.meta for kf in kfs])
        kfs = [kfs[i] for i in order]
        meta = kfs[0].meta
        if not meta.get("convention"):
            raise CheckpointError(f"{path}: no source convention recorded", fix="use restore_layers() on each rank")
        conv = conventions.get(meta["convention"])
        specs: dict[str, Any] = {}
        for idx, rec in meta["layers"].items():
            with writer._layer_errors(path, idx):
                shapes = [
                    replace(writer._shape_layer(kf.meta["layers"][idx]), **writer._where(kf.meta, int(idx), rec))
                    for kf in kfs
                ]
                full = _cat(shapes)
                for k, v in conv.to_tensors(meta["prefix"], int(idx), full, writer._layer_path(meta, idx)).items():
                    specs[k] = (v.dtype, tuple(v.shape))
        with safe_io.atomic_dir(out) as tmp:
            target = stream.ShardedOutput(
                tmp, specs, {"format": "pt"}, single=False, shard_bytes=shard_size or stream.SHARD_BYTES
            )
            with stream.workers_for(target, hashing=False) as workers:
                for idx in meta["layers"]:
                    with writer._layer_errors(path, idx):
                        full = _cat(
                            [writer._restore_layer(kf, kf.meta, int(idx), kf.meta["layers"][idx]) for kf in kfs]
                        )
                    tensors = conv.to_tensors(meta["prefix"], int(idx), full, writer._layer_path(meta, idx))
                    del full
                    for k in list(tensors):
                        if k not in specs:
                            raise CheckpointError(
                                f"{path}: {k} is not among the tensors its records give", fix=writer._EDITED
                            )
                        target.put(workers, k, tensors.pop(k).contiguous())
                    workers.drain()  # this layer is out (and freed) before the next is read
                target.finish(workers)
            safe_io.write_json(tmp / "config.json", writer._restored_config(meta))
            safe_io.write_json(tmp / safe_io.MARKER, {"restored_from": str(path.resolve())})
    return out
