"""Rank and expert-parallel layout of a convert: which layers, experts and intermediate rows each rank writes.

A convert reads :data:`LayerSource` values (a layer's shapes now, its tensors when loaded by a
:class:`LayerLoader`). :func:`rank_part` gives rank ``r``'s: with ``ep_size`` EP ranks in ``tp_size`` ranks,
moe-TP rank ``r % m`` of ``m = tp_size / ep_size`` (:func:`moe_tp_size`) and the experts
:func:`expert_range` of EP rank ``r // m``; :func:`rank_info` is what every shard of the rank records
about its source (:func:`source_info`: nothing of the machine) and :func:`request_of` what the convert was
asked (compared by ``resume``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Optional

from fimoe_lab.checkpoints import request as requests
from fimoe_lab.checkpoints import stream
from fimoe_lab.checkpoints.reader import Checkpoint, CheckpointError, MoELayer
from fimoe_lab.choice import LayoutChoice

__all__ = [
    "LayerSource",
    "request_of",
    "wanted_layers",
    "source_info",
    "LayerLoader",
    "rank_info",
    "moe_tp_size",
    "expert_range",
    "rank_part",
    "layer_sources",
    "rank_list",
]


LayerSource = tuple[int, MoELayer, Callable[[], MoELayer]]
"""(layer index, layer with shapes only (meta tensors allowed), loader of the real layer)."""


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
        choice,
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
    layer, ``load((e0, e1))`` experts ``e0 .. e1-1`` (:meth:`Checkpoint.read_layer`'s ``experts``; ``pin``: into
    page-locked memory)."""

    def __init__(self, ck: Checkpoint, layer: int, tp_size: int, rank: int, progress: bool):
        self.ck, self.layer, self.tp_size, self.rank, self.progress = ck, layer, tp_size, rank, progress

    def __call__(self, experts: Optional[tuple[int, int]] = None, pin: bool = False) -> MoELayer:
        return self.ck.read_layer(self.layer, self.tp_size, self.rank, progress=self.progress, experts=experts, pin=pin)


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


def rank_list(tp_size: int, tp_rank: int | str, single: bool) -> list[int]:
    """The TP ranks a convert writes: ``[tp_rank]``, or every rank for ``"all"`` (a sharded directory each,
    so never with one output file: ``single``)."""
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
