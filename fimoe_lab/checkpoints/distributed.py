"""Convert a whole checkpoint across processes with ``torch.distributed`` (torchrun, Slurm, ...).

Launched by any launcher that sets the torch.distributed environment (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``: ``torchrun --nproc-per-node N``, ``torchrun
--nnodes``), every process calls :func:`convert_distributed` with the same arguments:

1. **Plan** (every process, no communication but a check): the single-process convert's plan of
   every TP rank written (:func:`~fimoe_lab.checkpoints.convert.layout_plan`: tensor specs and
   metadata; :func:`~fimoe_lab.checkpoints.stream.plan_shards`: the shards). Process 0's view of
   the source (file sizes and header digests: :func:`~fimoe_lab.checkpoints.request.header_identity`) and the
   request it records are broadcast, so the metadata is the same everywhere; a sha256 of each process's plan is
   gathered and must agree.
2. **Split** (:func:`assign`): the work units are ``(TP rank, shard)`` in order (TP rank major,
   then shards, i.e. a contiguous layer range), with their bytes; process ``p`` of ``W`` gets the
   units whose byte midpoint lies in ``[p/W, (p+1)/W)`` of the total: a contiguous run of layer
   ranges x TP ranks, balanced by bytes to within one shard.
3. **Write**: each process streams the layers its shards hold (one layer in memory, converted a
   chunk of experts at a time: :func:`~fimoe_lab.checkpoints.convert.stream_layers`) and commits
   only its own shards; a layer cut by a shard boundary is read by both owners. With
   ``resume`` a process keeps its shards that :func:`~fimoe_lab.checkpoints.stream.verify_shard`
   passes.
4. **Finish**: every process reports ``ok`` or its error (``all_gather_object``); only if all
   succeeded does process 0 write each index (and remove stale shards). A failed process fails
   every process with its error; a killed one fails the collective (or the launcher stops the
   others), so no index ever claims a shard that is missing. Before anything is read,
   process 0 checks OUT and takes its lock; after planning (before any shard is written) it refuses
   to ``resume`` an output of another request (:func:`~fimoe_lab.checkpoints.request.check_resume`)
   and removes any old index.

The files are the single-process convert's, byte for byte: the same plan, the same shard names
and the same metadata, each shard written whole by one process. OUT must be one directory all
processes see (a shared file system across hosts); a single ``.safetensors`` output is refused.
Timeouts (:func:`timeouts`): the group must form, and peers answer each control message, within
``$FIMOE_DIST_TIMEOUT`` seconds (default 300): a process that never starts fails every other with
one clear error; waiting for the slowest process to write its part has its own limit,
``$FIMOE_DIST_DATA_TIMEOUT`` (default 12 hours).
Backend: ``gloo`` on CPU; with ``device="cuda"`` each process converts on ``cuda:LOCAL_RANK`` and
the group is ``cpu:gloo,cuda:nccl`` (the control messages are small CPU objects).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch

from fimoe_lab import env
from fimoe_lab.checkpoints import convert, rank_layout, safe_io, stream, unchanged
from fimoe_lab.checkpoints import request as requests
from fimoe_lab.checkpoints.plan_choice import given_choice
from fimoe_lab.checkpoints.reader import Checkpoint
from fimoe_lab.choice import LayoutChoice
from fimoe_lab.errors import CheckpointError

__all__ = [
    "ENV",
    "PEER_TIMEOUT_S",
    "DATA_TIMEOUT_S",
    "timeouts",
    "Unit",
    "assign",
    "convert_distributed",
    "DistributedError",
]

ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What a launcher sets for ``init_process_group(init_method="env://")``."""
PEER_TIMEOUT_S = 300
"""Default seconds to wait for every process to join the group and for a peer to answer a control message
(``$FIMOE_DIST_TIMEOUT``): a process that never starts fails the run after this, not hours later."""
DATA_TIMEOUT_S = 12 * 3600
"""Default seconds the processes wait for the slowest one to write its part (``$FIMOE_DIST_DATA_TIMEOUT``)."""


def timeouts() -> tuple[timedelta, timedelta]:
    """``(peer timeout, data-phase timeout)`` from the environment (:data:`fimoe_lab.env.VARIABLES`) or the
    defaults :data:`PEER_TIMEOUT_S` and :data:`DATA_TIMEOUT_S`."""
    peer = env.value("FIMOE_DIST_TIMEOUT", PEER_TIMEOUT_S)
    data = env.value("FIMOE_DIST_DATA_TIMEOUT", DATA_TIMEOUT_S)
    return timedelta(seconds=peer), timedelta(seconds=data)


class DistributedError(CheckpointError):
    """Another process of a distributed convert failed (its rank and error in the message)."""


@dataclass(frozen=True)
class Unit:
    """One shard of one TP rank's output: ``tp_rank``, shard index ``shard`` (from 0), its data ``bytes``."""

    tp_rank: int
    shard: int
    bytes: int


def assign(sizes: Sequence[int], world: int) -> list[int]:
    """The process of each unit, in order: unit ``i`` of bytes ``s_i`` with ``c_i = s_0 + ... + s_(i-1)``
    goes to ``min(world - 1, floor((c_i + s_i / 2) * world / total))`` (all zero: ``floor(i * world / n)``).

    Non-decreasing (each process gets a contiguous run), deterministic, and each process's bytes
    are within one unit of ``total / world``.
    """
    if world < 1:
        raise CheckpointError(f"world size {world} is not >= 1", fix="launch at least one process")
    total, n = sum(sizes), len(sizes)
    if total == 0:
        return [i * world // n for i in range(n)]
    owners, before = [], 0
    for s in sizes:
        owners.append(min(world - 1, (2 * before + s) * world // (2 * total)))
        before += s
    return owners


# ============================================================================ the process group
@contextmanager
def process_group(device: str) -> Iterator[tuple[int, int, str, Any]]:
    """``(rank, world size, device, data group)`` of this process in the launcher's group (created here unless
    the caller already did, with the peer timeout of :func:`timeouts`: a process that never joins fails the
    run with one DistributedError; destroyed on exit if created here). The data group (the same processes,
    the data-phase timeout) is what waits for the slowest writer. ``device`` ``cuda`` becomes
    ``cuda:LOCAL_RANK``."""
    import torch.distributed as dist

    peer, data = timeouts()
    created = False
    cuda = torch.device(device).type == "cuda"
    if not dist.is_initialized():
        missing = [k for k in ENV if k not in os.environ]
        if missing:
            raise CheckpointError(
                f"--distributed needs a launcher: {', '.join(missing)} not set",
                fix="run it as torchrun --nproc-per-node N -m fimoe_lab convert SRC OUT --distributed ...",
            )
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if cuda and torch.cuda.is_available():
            torch.cuda.set_device(local % torch.cuda.device_count())
        backend = "cpu:gloo,cuda:nccl" if cuda and torch.cuda.is_available() else "gloo"
        try:
            with _native_log_kept_on_success():
                dist.init_process_group(backend, timeout=peer)
        except (RuntimeError, ValueError, TimeoutError) as exc:
            raise DistributedError(
                f"the {os.environ.get('WORLD_SIZE')} processes did not all join the group at "
                f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} within {peer.total_seconds():.0f} s "
                f"({safe_io.one_line(exc)})",
                fix="start every process of the launch (torchrun --nproc-per-node N starts them all; with --nnodes, "
                "each node's torchrun), check MASTER_ADDR/MASTER_PORT, or raise FIMOE_DIST_TIMEOUT (seconds)",
            ) from None
        created = True
    if cuda and torch.device(device).index is None and torch.cuda.is_available():
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0')) % torch.cuda.device_count()}"
    try:
        with _peers("forming the data group"):
            group = dist.new_group(timeout=data)
        yield dist.get_rank(), dist.get_world_size(), device, group
    finally:
        if created:
            dist.destroy_process_group()


@contextmanager
def _native_log_kept_on_success() -> Iterator[None]:
    """Hold what native code writes to stderr (file descriptor 2) meanwhile: written out on success, dropped
    on a failure (c10d logs a C++ stack trace per failed connection; the error line says it all)."""
    import tempfile

    with tempfile.TemporaryFile() as held:
        saved = os.dup(2)
        os.dup2(held.fileno(), 2)
        ok = False
        try:
            yield
            ok = True
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            if ok:
                held.seek(0)
                os.write(2, held.read())


@contextmanager
def _peers(what: str) -> Iterator[None]:
    """A collective that fails (a peer died, or did not answer within its group's timeout) is one
    DistributedError naming the step."""
    try:
        yield
    except (RuntimeError, TimeoutError) as exc:
        raise DistributedError(
            f"{what}: another process stopped answering ({safe_io.one_line(exc)})",
            fix="see the other processes' errors; run again with --resume (shards that verify are kept), raising "
            "FIMOE_DIST_TIMEOUT or FIMOE_DIST_DATA_TIMEOUT (seconds) if a process is only slow",
        ) from None


def _gather(obj: Any, group: Any = None, what: str = "exchanging results") -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    with _peers(what):
        dist.all_gather_object(out, obj, group=group)
    return out


def _broadcast(obj: Any) -> Any:
    import torch.distributed as dist

    box = [obj]
    with _peers("planning"):
        dist.broadcast_object_list(box, src=0)
    return box[0]


class _Step:
    """Run a step on every process and agree on its outcome: after the ``with`` block every process
    has the list of errors (``(rank, type, message)``); any error is raised on every process."""

    def __init__(self, rank: int, what: str, group: Any = None):
        self.rank, self.what, self.group = rank, what, group

    def __enter__(self) -> _Step:
        return self

    def __exit__(self, kind: Any, exc: Optional[BaseException], tb: Any) -> None:
        if exc is not None and not isinstance(exc, Exception):
            return  # KeyboardInterrupt / SIGTERM: leave at once (the launcher stops the others)
        mine = None if exc is None else (self.rank, type(exc).__name__, safe_io.one_line(exc))
        errors = [e for e in _gather(mine, self.group, self.what) if e is not None]
        if not errors or exc is not None:
            return  # all succeeded, or this process raises its own error
        r, kind_name, text = errors[0]
        raise DistributedError(
            f"{self.what}: process {r} failed ({kind_name}: {text})"
            + (f"; {len(errors) - 1} more failed" if len(errors) > 1 else ""),
            fix="fix the cause and run again with --resume: shards that verify are kept",
        )


# ============================================================================ the convert
def convert_distributed(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    backend: Optional[str] = None,
    tp_size: int = 1,
    tp_rank: int | str = 0,
    layers: Optional[Iterable[int]] = None,
    intermediate_alignment: Optional[int] = None,
    hidden_alignment: Optional[int] = None,
    force: bool = False,
    engine: Optional[str] = None,
    shard_size: Optional[int] = None,
    resume: bool = False,
    device: str = "cpu",
    single_file: Optional[bool] = None,
    ep_size: int = 1,
    per_token: bool = False,
    activation_dtype: Optional[str] = None,
    progress: Any = False,
    choice: Optional[LayoutChoice] = None,
) -> dict[str, Any]:
    """:func:`~fimoe_lab.checkpoints.writer.convert_checkpoint` (sharded output) split across the processes
    of the launcher's group (module docstring); every process calls it with the same arguments.

    ``choice`` (the layout options as one value) or ``backend`` and the keyword options, ``per_token``:
    per-token NVFP4 activations, ``activation_dtype``: the kernel's activations (MXFP4 on CUTLASS: ``bf16`` for
    the SM90 layout), as in ``convert_checkpoint`` (recorded in every plan).
    ``tp_rank``: one rank (default 0) or ``all``: every TP rank, rank ``r`` into ``out/rank-<r>``, as
    :func:`~fimoe_lab.checkpoints.writer.convert_checkpoint` does (``ep_size`` too). ``device`` ``cuda``:
    ``cuda:LOCAL_RANK``. ``progress``: as ``convert_checkpoint``'s, shown by process 0 alone (its own shards).
    Returns, on every process, ``{"rank": this process, "processes": [one record per process]}``, a
    record holding ``rank``, ``units`` (shards it owns), ``written``/``kept`` shards, ``bytes`` written
    and ``seconds``.
    """
    choice = given_choice(
        choice, backend, intermediate_alignment, hidden_alignment, engine, per_token, activation_dtype
    )
    out = Path(out)
    if safe_io.single_output(out, single_file):
        raise CheckpointError(
            f"a distributed convert writes a sharded directory, not one file ({out})",
            fix="give OUT as a directory (without .safetensors)",
        )
    ranks = rank_layout.rank_list(tp_size, tp_rank, False)
    rank_layout.moe_tp_size(tp_size, ep_size)
    dirs = {r: out / f"rank-{r}" if tp_rank == "all" else out for r in ranks}
    convert.torch_device(device)
    with ExitStack() as stack:
        rank, world, device, data_group = stack.enter_context(process_group(device))
        dev = convert.torch_device(device)
        stack.enter_context(safe_io.signals_raise())
        with _Step(rank, "checking OUT"):
            if rank == 0:
                _prepare(stack, Path(src), out, dirs, force, resume)
        with _Step(rank, "planning"):
            ck = stack.enter_context(Checkpoint(src))
            wanted = rank_layout.wanted_layers(ck, src, layers)
            about = _broadcast(rank_layout.source_info(ck, src) if rank == 0 else None)
            asked = _broadcast(
                rank_layout.request_of(ck, choice, tp_size, ep_size, tp_rank, wanted, False, shard_size)
                if rank == 0
                else None
            )
            if rank == 0:
                if resume and not force:
                    requests.check_resume(out, asked)
                _open_dirs(out, dirs)
            parts = {r: rank_layout.rank_part(ck, wanted, about, tp_size, ep_size, r, False) for r in ranks}
            sources = {r: parts[r][0] for r in ranks}
            kept = {r: unchanged.for_rank(ck, r) for r in ranks}
            plans = {
                r: convert.layout_plan(
                    sources[r], choice, prefix=ck.prefix, block=ck.convention.block, info=parts[r][1], kept=kept[r]
                )
                for r in ranks
            }
            digest = hashlib.sha256(json.dumps([[str(p[0]), p[1]] for p in plans.values()], default=str).encode())
        if len(set(_gather(digest.hexdigest()))) != 1:
            raise DistributedError(
                "the processes planned different outputs (a different SRC, fimoe_lab or torch on some host)",
                fix="give every host the same SRC files and the same software",
            )
        shard_bytes = shard_size or stream.SHARD_BYTES
        groups = {r: stream.plan_shards(plans[r][0], shard_bytes) for r in ranks}
        units = [
            Unit(r, k, sum(stream.spec_nbytes(*plans[r][0][n]) for n in g))
            for r in ranks
            for k, g in enumerate(groups[r])
        ]
        owners = assign([u.bytes for u in units], world)
        mine = [u for u, p in zip(units, owners) if p == rank]
        start = time.perf_counter()
        report: dict[str, Any] = {"rank": rank, "units": len(mine), "written": 0, "kept": 0, "bytes": 0}
        targets = {}
        with _Step(rank, "converting", data_group):  # waits for the slowest writer: the data-phase timeout
            bar = None
            for r in ranks:
                own = {u.shard for u in mine if u.tp_rank == r}
                specs, meta = plans[r]
                target = targets[r] = stream.ShardedOutput(
                    dirs[r],
                    specs,
                    requests.request_metadata({"fimoe_lab": meta}, asked),
                    single=False,
                    shard_bytes=shard_bytes,
                    checksum_key="fimoe_lab",
                    resume=resume,
                    owned=own,
                )
                todo = own - target.done
                report["kept"] += len(own) - len(todo)
                report["written"] += len(todo)
                report["bytes"] += sum(u.bytes for u in mine if u.tp_rank == r and u.shard in todo)
            if rank == 0 and progress:  # one bar over the bytes this process still writes, every TP rank
                bar = stream.progress_bar(progress, {}, targets[ranks[0]], out, total=report["bytes"])
            try:
                for r in ranks:
                    with stream.workers_for(targets[r], hashing=True) as workers:
                        convert.stream_layers(
                            targets[r], workers, sources[r], plans[r][1], choice, dev=dev, bar=bar, kept=kept[r]
                        )
                        targets[r].commit_rest(workers)
            finally:
                if bar is not None:
                    bar.close()
        report["seconds"] = time.perf_counter() - start
        with _Step(rank, "writing the index"):
            if rank == 0:
                for r in ranks:
                    targets[r].write_index()
                if dirs[ranks[0]] != out:
                    safe_io.remove_own(out, {d.name for d in dirs.values()})
        return {"rank": rank, "processes": _gather(report)}
    raise AssertionError("unreachable")  # pragma: no cover


def _prepare(stack: ExitStack, src: Path, out: Path, dirs: dict[int, Path], force: bool, resume: bool) -> None:
    """Process 0, before anything is read: vet OUT and its rank directories
    (:func:`~fimoe_lab.checkpoints.safe_io.check_output`) and take OUT's lock for the whole run."""
    safe_io.check_output(out, [src], force, "shards", resume)
    for d in dirs.values():
        if d != out and os.path.isdir(out):  # a new OUT holds no rank directory yet
            safe_io.check_output(d, [src], force, "shards", resume)
    stack.enter_context(safe_io.OutputLock(out))


def _open_dirs(out: Path, dirs: dict[int, Path]) -> None:
    """Process 0, once the request may write OUT: create the directories and remove any old index
    (no index may claim shards while they are rewritten)."""
    os.makedirs(out, exist_ok=True)
    for d in dirs.values():
        os.makedirs(d, exist_ok=True)
        index = d / safe_io.INDEX
        if os.path.lexists(index):
            os.unlink(index)
