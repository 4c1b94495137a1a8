"""The two whole-checkpoint entry points: :func:`convert_checkpoint` and :func:`restore_checkpoint`.

Each vets its output, takes its lock and hands over to the module of the job: the rank layout
(:mod:`~fimoe_lab.checkpoints.rank_layout`) and the layer conversion (:mod:`~fimoe_lab.checkpoints.convert`) for a
convert; one converted output (:mod:`~fimoe_lab.checkpoints.restore`) or every rank of ``convert --rank all``
(:mod:`~fimoe_lab.checkpoints.expert_parallel`) for a restore. The file format they write and read is
:mod:`~fimoe_lab.checkpoints.fileformat`. The modules import one way:
``fileformat <- plan_choice <- rank_layout <- convert <- restore <- expert_parallel <- writer``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

from fimoe_lab.checkpoints import expert_parallel, safe_io, stream, unchanged
from fimoe_lab.checkpoints import request as requests
from fimoe_lab.checkpoints.convert import torch_device, write_kernel_layout
from fimoe_lab.checkpoints.plan_choice import given_choice
from fimoe_lab.checkpoints.rank_layout import moe_tp_size, rank_list, rank_part, request_of, source_info, wanted_layers
from fimoe_lab.checkpoints.reader import Checkpoint
from fimoe_lab.checkpoints.restore import restore_directory, value_rule_notes
from fimoe_lab.choice import LayoutChoice

__all__ = [
    "convert_checkpoint",
    "restore_checkpoint",
    "not_byte_exact",
]


def convert_checkpoint(
    src: str | os.PathLike,
    out: str | os.PathLike,
    backend: Optional[str] = None,
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
    choice: Optional[LayoutChoice] = None,
) -> Path:
    """Read ``src`` (rank ``tp_rank`` of ``tp_size``), convert its MoE layers for ``backend``, write ``out``: a
    whole checkpoint, the converted layers in the kernel layout and every other tensor of ``src`` unchanged
    (in the output of rank 0 only: :mod:`~fimoe_lab.checkpoints.unchanged`; the routed experts of MoE layers
    left out of ``layers`` are not written).

    ``choice``: what every layer's plan is asked (:class:`~fimoe_lab.choice.LayoutChoice`: backend, alignments,
    engine, per-token and activation dtype) as one value; or else ``backend`` and the keyword options
    (:func:`~fimoe_lab.checkpoints.plan_choice.given_choice`: not both).

    ``per_token``: NVFP4 activations quantised per token: the engine profile's per-token paddings apply
    (``recipes.plan_layer(..., per_token_activation=True)``), recorded in every layer's plan arguments;
    refused (before anything is written) for a format without per-token activations. ``activation_dtype``:
    the kernel's activations where the recipe has a layout per activation dtype (``"bf16"``: MXFP4 on the
    Hopper SM90 CUTLASS kernel, :func:`fimoe_lab.special_plans.plan_cutlass_mxfp4_bf16`), recorded likewise.

    ``ep_size``: expert parallelism within the ``tp_size`` ranks (:func:`rank_part`): rank ``r`` holds the
    contiguous experts :func:`expert_range` of EP rank ``r // (tp_size / ep_size)``, sliced along the
    intermediate dim as rank ``r % (tp_size / ep_size)`` of ``tp_size / ep_size`` (SGLang's moe-TP).

    ``engine``: the profile (``vllm-0.34`` by default; :mod:`fimoe_lab.engines`), recorded in the file.
    Output, streaming, ``resume`` and ``device``: :func:`write_kernel_layout`. ``tp_rank="all"``
    writes every rank, rank ``r`` into the sharded directory ``out/rank-<r>``.

    ``out`` is vetted before anything is read (never the input, inside it or a parent of it;
    an existing one only with ``force`` or ``resume`` and only if this tool wrote it).
    """
    choice = given_choice(
        choice, backend, intermediate_alignment, hidden_alignment, engine, per_token, activation_dtype
    )
    out = Path(out)
    single = safe_io.single_output(out, single_file)
    ranks = rank_list(tp_size, tp_rank, single)
    moe_tp_size(tp_size, ep_size)
    safe_io.check_output(out, [Path(src)], force or (resume and single), "file" if single else "shards", resume)
    torch_device(device)
    # a second writer of OUT fails before reading; SIGTERM from here on removes the lock (and any temporary)
    with safe_io.signals_raise(), safe_io.OutputLock(out), Checkpoint(src) as ck:
        wanted = wanted_layers(ck, src, layers)
        about = source_info(ck, src)
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
                choice,
                prefix=ck.prefix,
                block=ck.convention.block,
                info=info,
                progress=progress,
                force=force,
                single_file=single,
                shard_size=shard_size,
                resume=resume,
                device=device,
                request=asked,
                kept=unchanged.for_rank(ck, rank),
            )
        if tp_rank == "all":
            safe_io.remove_own(out, {f"rank-{r}" for r in ranks})
    return out


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
    converted layers, byte-identical to the source's except where the engine profile's value rule changed values
    and the file keeps no copy of them (convert keeps one of every tensor a rule changes; :func:`not_byte_exact`
    lists any it lacks, and why)
    (for a TP shard: the rank's slice,
    with config.json's intermediate size set to the shard's; for the OUT of ``convert --rank all``, every
    rank's experts and intermediate slices joined: :func:`expert_parallel.restore_ranks`), and every tensor
    convert carried through unchanged (:mod:`~fimoe_lab.checkpoints.unchanged`): from a whole convert, every
    tensor of the source with its name, dtype, shape and bytes, and nothing else. Streamed: one layer in memory,
    read and mapped back a chunk of experts at a time, written before the next layer is read.
    Written atomically; an existing ``out_dir`` is replaced only with ``force`` and only if
    ``restore`` wrote it. ``progress``: as :func:`~fimoe_lab.checkpoints.convert.write_kernel_layout`'s (bytes restored of the total).
    """
    if expert_parallel.rank_dirs(Path(path)):  # convert --rank all: every rank's experts and slices reassembled
        return expert_parallel.restore_ranks(path, out_dir, force, shard_size, progress)
    out = Path(out_dir)
    safe_io.check_output(out, [Path(path)], force, "dir")
    with safe_io.signals_raise(), safe_io.OutputLock(out):  # a second writer of OUT fails before reading
        return restore_directory(path, out, shard_size or stream.SHARD_BYTES, progress)


def not_byte_exact(path: str | os.PathLike) -> list[dict]:
    """What :func:`restore_checkpoint` of ``path`` does not give back byte for byte, and why: the tensors an engine
    profile's value rule changed (:func:`~fimoe_lab.checkpoints.restore.value_rule_notes`; for the OUT of
    ``convert --rank all``, every rank's). Empty: the restore is byte-exact."""
    ranks = expert_parallel.rank_dirs(Path(path))
    return [note for p in (ranks or [Path(path)]) for note in value_rule_notes(p)]
