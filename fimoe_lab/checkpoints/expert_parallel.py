"""Restore a checkpoint converted for several ranks: reassemble every rank's experts and intermediate slices.

``convert --tp T --ep N --rank all`` (:func:`~fimoe_lab.checkpoints.rank_layout.rank_part`; ``N = 1`` without
``--ep``) writes ``OUT/rank-<r>`` for ``r = ep_rank * m + tp_rank``, ``m = T / N`` the moe-TP size
(:func:`~fimoe_lab.checkpoints.rank_layout.moe_tp_size`). Each records ``tp_size = m`` and ``tp_rank`` (its
intermediate rows ``[r0, r1)`` of the reader's :meth:`~fimoe_lab.checkpoints.reader.Checkpoint.shard_bounds`)
and, with ``N > 1``, ``ep_size = N``, ``ep_rank``, ``experts`` ``[e0, e1)``
(:func:`~fimoe_lab.checkpoints.rank_layout.expert_range`) and ``num_experts``: its experts ``e0 .. e1-1`` under local
indices ``0 .. e1-e0-1``, sliced along the intermediate dim. :func:`restore_ranks` checks that the
directories are all ``T`` ranks of one run (a missing one is named), then per layer restores every rank,
joins the ``m`` intermediate slices of each EP rank (:func:`join_tp`) and concatenates the EP ranks along
the expert dim (:func:`cat_experts`), and writes the full layer in the source's naming, byte-identical to the
source, one layer in memory (plus its parts). The joins, with ``P`` = 2 stacked projections ``[gate; up]``
(1 non-gated) and ``il_t`` rank ``t``'s intermediate rows:

* ``w13 (E, P*I, H)`` and its row-sliced companions (block or row scales ``(E, P*I/br, .)``, the bias
  ``w13_bias (E, P*I)``): projection ``k`` = ``cat_t part_k(x_t)`` along dim 1, then the ``P`` projections;
* ``w2 (E, H, I)`` and its block scales ``(E, H, I/b)``: ``cat_t x_t`` along the last dim;
* what every rank holds whole (tensor scales, row scales of ``w2``, scalar extras): rank 0's, checked equal
  on every rank; ``w2_bias``: rank 0's (vLLM adds the down bias on rank 0 only, the others hold zeros).

The tensors convert carried through unchanged are in ``rank-0`` alone (:mod:`~fimoe_lab.checkpoints.unchanged`)
and are copied back after the layers, so the result is the whole source checkpoint.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Optional

import torch

from fimoe_lab.checkpoints import conventions, fileformat, rank_layout, restore, safe_io, stream, unchanged
from fimoe_lab.checkpoints.reader import MoELayer
from fimoe_lab.errors import CheckpointError

__all__ = ["EP_FIELDS", "RANK_FIELDS", "rank_dirs", "join_tp", "cat_experts", "restore_ranks"]

EP_FIELDS = ("ep_rank", "experts", "checksums")
"""Metadata that differs between the EP ranks of one moe-TP rank (everything else must be equal)."""

RANK_FIELDS = ("tp_rank", *EP_FIELDS)
"""Metadata that differs between any two ranks of one run (with the layer records of other ``tp_rank``)."""


def rank_dirs(path: Path) -> list[Path]:
    """The ``rank-<r>`` directories of ``path`` in rank order (``convert --rank all``), [] if none."""
    if not path.is_dir() or os.path.lexists(path / safe_io.INDEX):
        return []
    found = [p for p in path.iterdir() if safe_io.RANK_RE.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def cat_experts(parts: list[MoELayer]) -> MoELayer:
    """One layer holding the experts of ``parts`` in order (every tensor and extra concatenated along dim 0)."""

    def cat(ts: list[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
        return None if ts[0] is None else torch.cat([t for t in ts if t is not None])

    first = parts[0]
    tensors = {n: cat([p.tensors()[n] for p in parts]) for n in first.tensors()}
    extras = {n: torch.cat([p.extras[n] for p in parts]) for n in first.extras}
    return replace(first.with_tensors(**tensors), extras=extras)


def _rows(ts: list[torch.Tensor], p: int) -> torch.Tensor:
    """``[x_0 .. x_{m-1}]`` each ``(E, P*r_t, ...)`` -> ``(E, P*sum r_t, ...)``: projection by projection."""
    parts = [t.split(t.shape[1] // p, dim=1) for t in ts]
    return torch.cat([torch.cat([q[k] for q in parts], dim=1) for k in range(p)], dim=1)


def _whole(ts: list[torch.Tensor], what: str) -> torch.Tensor:
    """What every rank holds whole: rank 0's, after checking the others hold the same bytes."""
    for t, other in enumerate(ts[1:], 1):
        if not other.is_meta and (other.shape != ts[0].shape or not torch.equal(other, ts[0])):
            raise CheckpointError(
                f"{what} of TP rank {t} differs from rank 0's (every rank holds it whole)", fix=fileformat.EDITED
            )
    return ts[0]


def join_tp(parts: list[MoELayer], scales: str) -> MoELayer:
    """The layer whose TP ranks ``0 .. m-1`` of one intermediate split are ``parts`` (module docstring's joins;
    ``scales`` the convention's kind: ``block``, ``row`` or ``tensor``); one part is returned as it is."""
    first = parts[0]
    if len(parts) == 1:
        return first
    p = 2 if first.is_act_and_mul else 1
    got = [q.tensors() for q in parts]
    ts = lambda n: [g[n] for g in got]  # noqa: E731
    out: dict[str, Optional[torch.Tensor]] = {"w13": _rows(ts("w13"), p), "w2": torch.cat(ts("w2"), dim=-1)}
    s13, s2 = ts("w13_scale"), ts("w2_scale")
    out["w13_scale"] = None if s13[0] is None else _rows(s13, p) if s13[0].ndim == 3 else _whole(s13, "w13_scale")
    sliced2 = s2[0] is not None and s2[0].ndim == 3 and scales != "row"
    out["w2_scale"] = None if s2[0] is None else torch.cat(s2, dim=-1) if sliced2 else _whole(s2, "w2_scale")
    extras = {}
    for n in first.extras:
        xs = [q.extras[n] for q in parts]
        extras[n] = _rows(xs, p) if n == "w13_bias" else xs[0] if n == "w2_bias" else _whole(xs, n)
    inter = sum(q.intermediate for q in parts)
    return replace(first.with_tensors(**out), extras=extras, intermediate=inter, tp_size=1, tp_rank=0)


def _common(meta: dict[str, Any], layers: bool) -> dict[str, Any]:
    """What ranks of one run share: the metadata without :data:`RANK_FIELDS`; with ``layers``, the layer records
    with every recorded tensor shape without its leading (expert) dim (ranks of one ``tp_rank``), else none."""

    def per_expert(x: object) -> object:
        if isinstance(x, dict):
            return {
                k: v[1:] if k in ("shape", "kernel_shape") and isinstance(v, list) else per_expert(v)
                for k, v in x.items()
            }
        return [per_expert(v) for v in x] if isinstance(x, list) else x

    out = {k: per_expert(v) if k == "layers" else v for k, v in meta.items() if k not in RANK_FIELDS}
    if not layers:
        out["layers"] = sorted(meta.get("layers") or {})
    return out


def _sizes(path: Path, meta: dict[str, Any], ranks: int) -> tuple[int, int]:
    """``(m, N)``: the moe-TP and EP sizes of the run (``T = m * N`` ranks), refused as ``convert`` refuses
    them (:func:`~fimoe_lab.checkpoints.rank_layout.moe_tp_size`; an ``N`` that is no size: with ``T = ranks``, the
    directories found)."""
    m, n = meta.get("tp_size", 1), meta.get("ep_size", 1)
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise CheckpointError(f"{path}: tp_size {m!r} in the metadata is not a positive integer", fix=fileformat.EDITED)
    size = isinstance(n, int) and not isinstance(n, bool) and n >= 1
    rank_layout.moe_tp_size(m * n if size else ranks, n)
    return m, n


def _check_ranks(path: Path, dirs: list[Path], metas: list[dict[str, Any]]) -> list[list[int]]:
    """``grid[ep_rank][tp_rank]``: the index in ``metas`` of each rank, after checking they are every rank of one
    run (module docstring); a missing rank is named."""
    m, n = _sizes(path, metas[0], len(dirs))
    names = ", ".join(d.name for d in dirs)
    where: dict[int, int] = {}
    for i, (d, meta) in enumerate(zip(dirs, metas)):
        r = meta.get("ep_rank", 0) * m + meta.get("tp_rank", 0)
        if not isinstance(r, int) or d.name != f"rank-{r}" or not 0 <= r < m * n:
            raise CheckpointError(f"{d}: its metadata is rank {r!r} of --tp {m * n} --ep {n}", fix=fileformat.EDITED)
        where[r] = i
    missing = [r for r in range(m * n) if r not in where]
    if missing:
        raise CheckpointError(
            f"{path}: rank-{missing[0]} is missing (--tp {m * n} --ep {n} writes rank-0 .. rank-{m * n - 1}; "
            f"found {names})",
            fix=f"finish the convert into {path} ('fimoe-lab convert ... --tp {m * n} --ep {n} --rank all --resume')",
        )
    for d, meta in zip(dirs, metas):
        if _common(meta, False) != _common(metas[0], False):
            raise CheckpointError(f"{d}: its metadata differs from {dirs[0]}'s beyond the rank", fix=fileformat.EDITED)
    grid = [[where[e * m + t] for t in range(m)] for e in range(n)]
    for t in range(m):
        first = _common(metas[grid[0][t]], True)
        if any(_common(metas[grid[e][t]], True) != first for e in range(n)):
            raise CheckpointError(f"{path}: the EP ranks of TP rank {t} record different layers", fix=fileformat.EDITED)
    total = metas[0].get("num_experts")
    for e in range(n if n > 1 else 0):
        for i in grid[e]:
            if not isinstance(total, int) or metas[i].get("experts") != list(rank_layout.expert_range(total, n, e)):
                raise CheckpointError(
                    f"{dirs[i]}: experts {metas[i].get('experts')} are not EP rank {e}'s of {total} experts over {n}",
                    fix=fileformat.EDITED,
                )
    return grid


def _rank_layer(kf: Any, idx: str, shapes_only: bool, buffers: Optional[restore.LayerBuffers] = None) -> MoELayer:
    """Rank ``kf``'s layer ``idx`` in the checkpoint layout: restored (into ``buffers``' tensors, None: new ones),
    or of meta tensors (``shapes_only``)."""
    rec = kf.meta["layers"][idx]
    if shapes_only:
        return replace(restore.shape_layer(rec), **fileformat.layer_where(kf.meta, int(idx), rec))
    return restore.restore_layer(kf, kf.meta, int(idx), rec, buffers=buffers)


def _full_layer(
    grid: list[list[Any]],
    scales: str,
    idx: str,
    shapes_only: bool = False,
    buffers: Optional[restore.LayerBuffers] = None,
) -> MoELayer:
    """The whole layer ``idx`` from every rank: each EP rank's TP slices joined, then the experts (the ranks'
    layers restored into ``buffers``' tensors; the joined layer may hold them: one part is kept as it is)."""
    return cat_experts([join_tp([_rank_layer(kf, idx, shapes_only, buffers) for kf in row], scales) for row in grid])


def restore_ranks(
    path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    force: bool = False,
    shard_size: Optional[int] = None,
    progress: Any = False,
) -> Path:
    """Reassemble the ranks ``path/rank-<r>`` of one ``convert --tp T [--ep N] --rank all`` into one checkpoint
    directory at ``out_dir``, byte-identical to the source's expert tensors, config.json the source's (module
    docstring); written like :func:`~fimoe_lab.checkpoints.writer.restore_checkpoint` (atomically, ``force``
    only over restore's own; ``progress`` as its, bytes written of the total)."""
    path, out = Path(path), Path(out_dir)
    safe_io.check_output(out, [path], force, "dir")
    dirs = rank_dirs(path)
    if not dirs:
        raise CheckpointError(f"{path} has no rank-<r> directories", fix="pass the OUT of 'convert --rank all'")
    with safe_io.signals_raise(), safe_io.OutputLock(out), ExitStack() as stack:
        kfs = [stack.enter_context(fileformat.KernelFiles(d)) for d in dirs]
        grid = [[kfs[i] for i in row] for row in _check_ranks(path, dirs, [kf.meta for kf in kfs])]
        meta = kfs[0].meta
        if not meta.get("convention"):
            raise CheckpointError(f"{path}: no source convention recorded", fix="use restore_layers() on each rank")
        conv = conventions.get(meta["convention"])
        specs: dict[str, Any] = {}
        for idx in meta["layers"]:
            with fileformat.layer_errors(path, idx):
                full = _full_layer(grid, conv.scales, idx, shapes_only=True)
                for k, v in conv.to_tensors(meta["prefix"], int(idx), full, fileformat.layer_path(meta, idx)).items():
                    specs[k] = (v.dtype, tuple(v.shape))
        kept = _kept(path, dirs, kfs)
        specs = restore.with_kept(
            path, specs, {n: s for kf, names in kept for n, s in unchanged.specs_in(kf, names).items()}
        )
        with safe_io.atomic_dir(out) as tmp:
            _write(path, tmp, grid, conv, specs, shard_size, (progress, out), kept)
            safe_io.write_json(tmp / "config.json", restore.restored_config({**meta, "tp_size": 1}))
            safe_io.write_json(tmp / safe_io.MARKER, restore.RESTORED_MARK)
    return out


def _kept(path: Path, dirs: list[Path], kfs: list[Any]) -> list[tuple[Any, list[str]]]:
    """``(rank's files, its unchanged tensors)`` of every rank (:func:`~fimoe_lab.checkpoints.restore.kept_names`:
    rank 0 holds them, :mod:`~fimoe_lab.checkpoints.unchanged`); a tensor held by two ranks is refused."""
    kept: list[tuple[Any, list[str]]] = []
    seen: dict[str, str] = {}
    for d, kf in zip(dirs, kfs):
        names = restore.kept_names(kf)
        for n in names:
            if n in seen:
                raise CheckpointError(f"{path}: {n} is held by both {seen[n]} and {d.name}", fix=fileformat.EDITED)
            seen[n] = d.name
        kept.append((kf, names))
    return kept


def _write(
    path: Path,
    tmp: Path,
    grid: list[list[Any]],
    conv: Any,
    specs: dict[str, Any],
    shard_size: Optional[int],
    progress: tuple[Any, Path],
    kept: list[tuple[Any, list[str]]],
) -> None:
    """Every layer restored from every rank, joined and written into ``tmp`` (one layer in memory at a time),
    then the ``kept`` unchanged tensors (:func:`_kept`); ``progress``: ``(restore_ranks's progress, the output
    named on the bar)``."""
    meta = grid[0][0].meta
    target = stream.ShardedOutput(
        tmp, specs, {"format": "pt"}, single=False, shard_bytes=shard_size or stream.SHARD_BYTES
    )
    bar = stream.progress_bar(progress[0], specs, target, progress[1], "restore")
    buffers = restore.LayerBuffers()
    with stream.workers_for(target, hashing=False) as workers, ExitStack() as closing:
        if bar is not None:
            closing.callback(bar.close)
        for idx in meta["layers"]:
            with fileformat.layer_errors(path, idx):
                full = _full_layer(grid, conv.scales, idx, buffers=buffers)
            tensors = conv.to_tensors(meta["prefix"], int(idx), full, fileformat.layer_path(meta, idx))
            del full
            for k in list(tensors):
                if k not in specs:
                    raise CheckpointError(
                        f"{path}: {k} is not among the tensors its records give", fix=fileformat.EDITED
                    )
                t = tensors.pop(k).contiguous()
                target.put(workers, k, t)
                if bar is not None:
                    bar.update(t.nbytes)
            workers.drain()  # this layer is out before the next is read, the ranks' parts into its buffers
            buffers.release()
        for kf, names in kept:
            unchanged.put_back(kf, names, target, workers, partial(fileformat.check_digest, kf.meta), bar)
        target.finish(workers)
