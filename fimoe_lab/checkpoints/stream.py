"""Streaming safetensors output: chunks written by offset from worker threads, shards, resume.

- :class:`Workers`: :func:`write_lanes` writer threads (``os.pwrite``, then :func:`start_writeback` of
  the bytes written; chunks dealt to them in turn: each chunk is written at its own offset, so
  their order does not matter) and, for checksums, :data:`HASH_LANES` hashing threads
  (``hashlib.sha256``; a tensor's chunks always go to the same one, in order) behind the caller,
  fed through queues of about :data:`DEPTH` jobs in all per kind; both release the GIL, so the
  caller transforms the next chunk while this one is hashed and written. The bounded queues are
  what keeps memory near one layer: the caller waits when they are full. A shard is committed on
  a commit thread of its own once every job queued before its last chunk has run
  (:meth:`Workers.after`), while the caller goes on with the next shard.
- :class:`ShardFile`: one safetensors file whose tensor names, dtypes and shapes are known up
  front. The header is written first, with checksum placeholders of the same length; each
  tensor arrives as chunks along its leading (expert) dim, in order per tensor, any order
  across tensors, written at ``data start + tensor offset + chunk offset``; :meth:`ShardFile.finish`
  rewrites the header with the sha256 of every tensor, fsyncs (most pages are on disk by then:
  each write started its own writeback) and renames the temporary onto the shard
  (:class:`~fimoe_lab.checkpoints.safe_io.AtomicFile`).
- :class:`ShardedOutput`: one file, or the Hugging Face layout ``model-0000k-of-0000n.safetensors``
  + ``model.safetensors.index.json`` (:func:`plan_shards`: tensors in order, a new shard when
  the next tensor would pass the shard size). Shards are committed one by one as they
  complete and the index last, after any old index was removed: a crash leaves finished
  shards and no index. With ``resume``, a shard already at its name is kept only if
  :func:`verify_shard` passes (same header and metadata as this run would write, every
  tensor's bytes matching its recorded sha256), its lock and temporaries left by a writer killed
  after the rename swept (a live writer's lock fails the run); the others are written again.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
import queue
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import torch

from fimoe_lab import env, libc, untrusted
from fimoe_lab.checkpoints import safe_io
from fimoe_lab.checkpoints.conventions import dtype_name
from fimoe_lab.errors import CheckpointError

__all__ = [
    "DEPTH",
    "SHARD_BYTES",
    "Workers",
    "write_lanes",
    "ShardFile",
    "ShardedOutput",
    "workers_for",
    "plan_shards",
    "verify_shard",
    "experts_per_chunk",
    "byte_view",
    "spec_nbytes",
    "progress_bar",
    "start_writeback",
    "populate",
]

HASH_LANES = 2
"""Hashing threads: sha256 runs at 1-2 GB/s on one core, so the layer's tensors are hashed two at a time."""
DEPTH = 8
"""Jobs each worker queue holds (a chunk is one job per tensor, four to six): a few chunks in flight."""
SHARD_BYTES = 5 * 10**9
"""Default shard size (the Hugging Face ``max_shard_size="5GB"``)."""
CHUNK_MIN, CHUNK_MAX, CHUNKS_PER_LAYER = 1 << 20, 64 << 20, 16
"""A chunk is ``layer bytes / CHUNKS_PER_LAYER`` clamped to ``[CHUNK_MIN, CHUNK_MAX]``, whole experts."""
PLACEHOLDER = "0" * 64
"""A checksum not yet computed (the length of a sha256 hex digest)."""
READ_BYTES = 16 << 20
"""Bytes read at a time when a shard is verified."""
LANES_ENV = "FIMOE_WRITE_LANES"
"""Environment variable overriding the number of writer threads (:func:`write_lanes`)."""


def write_lanes() -> int:
    """Writer threads: ``$FIMOE_WRITE_LANES`` when set (an integer in [1, 256]: :data:`fimoe_lab.env.VARIABLES`), else
    ``clamp(cpu_count // 4, 1, 4)`` (one thread copies into the page cache at a few GB/s; a host
    with many cores and a fast disk needs several, a small one has no core to spare for them)."""
    return int(env.value(LANES_ENV, min(4, max(1, (os.cpu_count() or 1) // 4))))


def experts_per_chunk(expert_bytes: int, layer_bytes: int) -> int:
    """Experts per chunk: about ``clamp(layer_bytes / 16, 1 MiB, 64 MiB)`` bytes, at least one expert."""
    target = min(CHUNK_MAX, max(CHUNK_MIN, layer_bytes // CHUNKS_PER_LAYER))
    return max(1, target // max(1, expert_bytes))


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def spec_nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of ``dtype`` and ``shape``: ``numel(shape) * itemsize(dtype)``."""
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()


def plan_shards(specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], shard_bytes: Optional[int]) -> list[list[str]]:
    """Tensor names per shard, in order: a new shard starts when the next tensor would pass ``shard_bytes``
    (a larger tensor gets a shard of its own; None: one shard)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, (dtype, shape) in specs.items():
        n = spec_nbytes(dtype, shape)
        if shard_bytes is not None and groups[-1] and size + n > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    return groups


# ============================================================================ worker threads
class Workers:
    """``lanes`` writer threads (default :func:`write_lanes`), (``hashing``) :data:`HASH_LANES`
    hashing threads and one commit thread, each running its jobs in order.

    Writes are dealt to the writer threads in turn, digests to hashing thread ``lane %
    HASH_LANES``, commits (:meth:`after`) to the commit thread. :meth:`submit` blocks while a
    queue is full (each writer queue holds ``max(2, DEPTH // lanes)`` jobs, so about ``DEPTH``
    chunks are in flight whatever the lanes); the first error of a job is raised by the next
    :meth:`submit`, :meth:`after` or :meth:`drain`, and the jobs after it are skipped.
    """

    def __init__(self, hashing: bool, lanes: Optional[int] = None):
        self._error: Optional[BaseException] = None
        self._abort = False
        self.lanes = write_lanes() if lanes is None else lanes
        if self.lanes < 1:
            raise CheckpointError(f"internal: {self.lanes} writer lanes")
        self._next = 0
        depth = max(2, DEPTH // self.lanes)
        self._queues: list[queue.Queue] = [queue.Queue(depth) for _ in range(self.lanes)]
        self._queues += [queue.Queue(DEPTH) for _ in range(HASH_LANES * hashing)]
        self._queues.append(queue.Queue())  # the commit thread's, last: drain joins it after the others
        self._threads = [
            threading.Thread(target=self._run, args=(q,), name=f"fimoe-lab-worker-{i}", daemon=True)
            for i, q in enumerate(self._queues)
        ]
        for t in self._threads:
            t.start()

    def _run(self, q: queue.Queue) -> None:
        while True:
            job = q.get()
            try:
                if job is None:
                    return
                if not self._abort:
                    job()
            except BaseException as exc:  # handed to the caller's thread
                if self._error is None:
                    self._error = exc
                self._abort = True
            finally:
                q.task_done()

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    def submit(self, write: Callable[[], None], digest: Optional[Callable[[], None]] = None, lane: int = 0) -> None:
        """Queue ``write`` on the next writer thread and (hashing) ``digest`` on hashing thread ``lane % HASH_LANES``."""
        self.check()
        self._queues[self._next].put(write)
        self._next = (self._next + 1) % self.lanes
        if digest is not None:
            self._queues[self.lanes + lane % HASH_LANES].put(digest)

    def after(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the commit thread once every write and digest submitted so far has run, and return
        at once: a marker goes into each writer and hashing queue behind those jobs, and the last marker to
        run queues ``job`` (skipped, like every job, after an error)."""
        self.check()
        lanes = self._queues[:-1]
        left, lock = [len(lanes)], threading.Lock()

        def marker() -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self._queues[-1].put(job)

        for q in lanes:
            q.put(marker)

    def drain(self) -> None:
        """Wait until every job submitted so far has run, commits included; raise the first error."""
        for q in self._queues:
            q.join()
        self.check()

    def close(self, abort: bool) -> None:
        """Stop the threads (``abort``: skip the jobs still queued)."""
        if abort:
            self._abort = True
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join()


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data.nbytes:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


SYNC_FILE_RANGE_WRITE = 2
"""Linux ``sync_file_range`` flag: start writeback of the dirty pages of a range, without waiting for it."""


_SYNC_FILE_RANGE = libc.function("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing bytes ``[offset, offset + nbytes)`` of ``fd`` to disk now, without waiting (Linux
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``; nothing where libc has no such call or the file system
    refuses it). A shard's writeback then runs while later chunks are transformed, instead of all at its
    ``fsync``; durability still comes from that ``fsync``."""
    if _SYNC_FILE_RANGE is not None and nbytes > 0:
        _SYNC_FILE_RANGE(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)


MADV_POPULATE_READ = 22
"""Linux ``madvise`` advice (5.14 and later): read a range's pages in and map them now, as read faults would."""


_MADVISE = libc.function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], linux_only=True)


def populate(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a CPU tensor, typically a memory-mapped file's slice) with its pages read in and mapped now, on the
    calling thread (``madvise(MADV_POPULATE_READ)`` over its page-aligned bytes; nothing where the system has no
    such call or refuses it): a reader thread that populates the next chunk reads it from disk when it is not
    cached, and the thread that then reads the tensor takes no page faults."""
    if _MADVISE is not None and t.device.type == "cpu" and t.nbytes:
        page = mmap.PAGESIZE
        start = t.data_ptr() & -page
        _MADVISE(start, t.data_ptr() + t.nbytes - start, MADV_POPULATE_READ)
    return t


# ============================================================================ one file
class ShardFile:
    """A safetensors file being written chunk by chunk (see the module docstring).

    ``metadata``: the ``__metadata__`` strings; with ``checksum_key``, the JSON under that key
    gets ``"checksums": {tensor name: sha256 hex}`` for the tensors of this file.
    """

    def __init__(
        self,
        path: Path,
        specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
        metadata: dict,
        checksum_key: Optional[str],
    ):
        self.entries, self.size = header_entries(specs)
        self.metadata, self.checksum_key = metadata, checksum_key
        self.sums = {name: PLACEHOLDER for name in specs}
        self.hashes = {name: hashlib.sha256() for name in specs} if checksum_key else {}
        self.written = dict.fromkeys(specs, 0)
        self.lanes = {name: i for i, name in enumerate(specs)}  # consecutive tensors (w13, w2) on two lanes
        self.left = self.size
        raw = self._header()
        self.header_len, self.start = len(raw), 8 + len(raw)
        self.file = safe_io.AtomicFile(path)
        self.fd = self.file.handle.fileno()
        try:
            _pwrite_all(self.fd, memoryview(struct.pack("<Q", len(raw)) + raw), 0)
        except BaseException:
            self.file.discard()
            raise

    def _header(self) -> bytes:
        meta = dict(self.metadata)
        if self.checksum_key is not None:
            meta[self.checksum_key] = json.dumps({**self.metadata[self.checksum_key], "checksums": self.sums})
        return header_bytes(meta, self.entries)

    def put(self, workers: Workers, name: str, chunk: torch.Tensor) -> None:
        """Queue the next ``chunk`` of tensor ``name`` (its leading rows after those already put)."""
        entry = self.entries[name]
        lo, hi = entry["data_offsets"]
        data = byte_view(chunk)
        at = self.written[name]
        if dtype_name(chunk.dtype) != entry["dtype"] or at + data.nbytes > hi - lo:
            raise CheckpointError(
                f"internal: {name}: a {dtype_name(chunk.dtype)} chunk of {data.nbytes} bytes at {at} does not fit "
                f"{entry['dtype']} {entry['shape']}"
            )
        self.written[name] = at + data.nbytes
        self.left -= data.nbytes
        fd, offset = self.fd, self.start + lo + at

        def write() -> None:
            _pwrite_all(fd, data, offset)
            start_writeback(fd, offset, data.nbytes)

        digest = None
        if self.checksum_key is not None:
            h = self.hashes[name]

            def digest() -> None:
                h.update(data)

        workers.submit(write, digest, self.lanes[name])

    def finish(self) -> None:
        """Rewrite the header with the checksums and commit (every write and digest of this file has run: the
        caller drained the workers, or this runs through :meth:`Workers.after`)."""
        short = [n for n, e in self.entries.items() if self.written[n] != e["data_offsets"][1] - e["data_offsets"][0]]
        if short:
            raise CheckpointError(f"internal: tensors {short[:3]} were not written in full")
        self.sums.update({n: h.hexdigest() for n, h in self.hashes.items()})
        raw = self._header()
        if len(raw) != self.header_len:
            raise CheckpointError(f"internal: header length changed from {self.header_len} to {len(raw)}")
        _pwrite_all(self.fd, memoryview(raw), 8)
        os.ftruncate(self.fd, self.start + self.size)
        self.file.commit()

    def discard(self) -> None:
        self.file.discard()


def header_entries(specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> tuple[dict, int]:
    """safetensors header entries of tensors laid out in order, and their data bytes."""
    entries, offset = {}, 0
    for name, (dtype, shape) in specs.items():
        n = spec_nbytes(dtype, shape)
        entries[name] = {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    return entries, offset


def header_bytes(metadata: dict, entries: dict) -> bytes:
    raw = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def verify_shard(path: Path, entries: dict, metadata: dict, checksum_key: str) -> bool:
    """Whether the file at ``path`` is the complete shard this run would write: the same tensor entries and
    metadata (checksums aside), its full size, and every tensor's bytes matching its recorded sha256."""
    try:
        st = safe_io.regular_file(path, "shard")
    except (OSError, CheckpointError):
        return False
    got = safe_io.safetensors_header(path)
    if got is None:
        return False
    header, start = got
    meta = header.pop("__metadata__", None)
    if header != entries or not isinstance(meta, dict) or set(meta) != set(metadata):
        return False
    size = max((e["data_offsets"][1] for e in entries.values()), default=0)
    if st.st_size != start + size:
        return False
    try:
        recorded = untrusted.parse_json(meta[checksum_key], str(path), "")
        sums = recorded.pop("checksums")
    except (ValueError, KeyError, TypeError, AttributeError):  # FimoeError is a ValueError
        return False
    if recorded != json.loads(json.dumps(metadata[checksum_key])) or set(sums) != set(entries):
        return False
    if any(meta[k] != metadata[k] for k in metadata if k != checksum_key):
        return False
    with open(path, "rb") as f:
        for name, e in entries.items():
            lo, hi = e["data_offsets"]
            h = hashlib.sha256()
            pos = start + lo
            while pos < start + hi:
                block = os.pread(f.fileno(), min(READ_BYTES, start + hi - pos), pos)
                if not block:
                    return False
                h.update(block)
                pos += len(block)
            if h.hexdigest() != sums[name]:
                return False
    return True


# ============================================================================ one output
class ShardedOutput:
    """Where convert (or restore) streams its tensors: one file at ``out`` (``single``), or shards and an
    index in the directory ``out`` (module docstring). Every tensor of ``specs`` is put in full, in
    chunks, through :meth:`put`; :meth:`finish` commits what is left and writes the index.

    ``owned``: the shards (indices into :func:`plan_shards`'s groups) this process writes, the others
    being another process's (:mod:`fimoe_lab.checkpoints.distributed`): only those are verified by
    ``resume`` and written, the old index is left to the caller to remove, and :meth:`commit_rest`
    then :meth:`write_index` (once every process committed its shards) replace :meth:`finish`."""

    def __init__(
        self,
        out: Path,
        specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
        metadata: dict,
        *,
        single: bool,
        shard_bytes: Optional[int] = SHARD_BYTES,
        checksum_key: Optional[str] = None,
        resume: bool = False,
        owned: Optional[set[int]] = None,
    ):
        self.out, self.specs, self.metadata, self.single = out, specs, metadata, single
        self.checksum_key = checksum_key
        self.groups = plan_shards(specs, None if single else shard_bytes)
        n = len(self.groups)
        self.paths = [out] if single else [out / safe_io.shard_name(k + 1, n) for k in range(n)]
        self.shard_of = {name: k for k, group in enumerate(self.groups) for name in group}
        self.open: dict[int, ShardFile] = {}
        self.committing: list[ShardFile] = []  # every byte queued, commit queued (discard: a no-op once committed)
        self.owned = set(range(n)) if owned is None else set(owned)
        self.done: set[int] = set(range(n)) - self.owned  # another process writes those
        if not single and owned is None:
            index = out / safe_io.INDEX
            if os.path.lexists(index):
                os.unlink(index)  # no index may claim shards while they are (re)written
        if resume and checksum_key is not None:
            for k in sorted(self.owned):
                if verify_shard(self.paths[k], self._entries(k), metadata, checksum_key):
                    self.done.add(k)
                    with safe_io.OutputLock(self.paths[k]):  # a writer killed after its rename left lock/temporaries
                        safe_io.sweep_stale(self.paths[k])

    def _entries(self, k: int) -> dict:
        return header_entries({n: self.specs[n] for n in self.groups[k]})[0]

    def needed(self, name: str) -> bool:
        """Whether tensor ``name`` must still be written (its shard was not kept by ``resume``)."""
        return self.shard_of[name] not in self.done

    @property
    def kept(self) -> int:
        """Shards kept from an earlier run (``resume``)."""
        return len(self.done)

    def put(self, workers: Workers, name: str, chunk: torch.Tensor) -> None:
        """Queue the next chunk of ``name``; a shard whose last byte this was is committed."""
        k = self.shard_of[name]
        if k in self.done:
            return
        shard = self.open.get(k)
        if shard is None:
            specs = {n: self.specs[n] for n in self.groups[k]}
            shard = self.open[k] = ShardFile(self.paths[k], specs, self.metadata, self.checksum_key)
        shard.put(workers, name, chunk)
        if shard.left == 0:  # committed on the commit thread once its bytes are out; the caller goes on
            del self.open[k]
            self.committing.append(shard)
            self.done.add(k)
            workers.after(shard.finish)

    def finish(self, workers: Workers) -> None:
        """Commit the shards still open (empty tensors) and write the index (sharded output)."""
        self.commit_rest(workers)
        if not self.single:
            self.write_index()

    def commit_rest(self, workers: Workers) -> None:
        """Commit the owned shards still open (empty tensors)."""
        workers.drain()
        self.committing.clear()
        for k in sorted(self.owned - self.done):
            self.put_empty(workers, k)

    def write_index(self) -> None:
        """Write the index of every shard (each committed by now, by this or another process) and remove
        the shards of an earlier run with another shard count."""
        total = sum(spec_nbytes(*spec) for spec in self.specs.values())
        weight_map = {name: self.paths[k].name for name, k in sorted(self.shard_of.items())}
        index = safe_io.AtomicFile(self.out / safe_io.INDEX)
        try:
            body = {"metadata": {"total_size": total}, "weight_map": weight_map}
            index.handle.write((json.dumps(body, indent=2) + "\n").encode())
        except BaseException:
            index.discard()
            raise
        index.commit()
        safe_io.remove_own(self.out, {p.name for p in self.paths} | {safe_io.INDEX})

    def put_empty(self, workers: Workers, k: int) -> None:
        shard = self.open.pop(k, None) or ShardFile(
            self.paths[k], {n: self.specs[n] for n in self.groups[k]}, self.metadata, self.checksum_key
        )
        shard.finish()
        self.done.add(k)

    def discard(self) -> None:
        """Remove the temporaries of the shards not committed (committed shards stay for ``resume``); called
        after the workers have stopped."""
        for shard in [*self.open.values(), *self.committing]:
            shard.discard()
        self.open.clear()
        self.committing.clear()


@contextmanager
def workers_for(target: ShardedOutput, hashing: bool) -> Iterator[Workers]:
    """:class:`Workers` for writing ``target`` inside a ``with`` block (finish or commit inside it):
    closed at the end; on an exception, aborted first and ``target``'s temporaries discarded."""
    workers = Workers(hashing=hashing)
    ok = False
    try:
        yield workers
        ok = True
    finally:
        workers.close(abort=not ok)
        if not ok:
            target.discard()


def progress_bar(
    progress: Any, specs: dict, target: ShardedOutput, out: Path, what: str = "convert", total: int = 0
) -> Any:
    """None (``progress`` false), a tqdm bar (True), or ``progress(total=, unit=, unit_scale=, desc=)`` when it is a
    bar class of that interface (the CLI's plain lines for logs and pipes, ``cli._common.PlainProgress``); its
    total: ``total`` plus the bytes of the tensors of ``specs`` that ``target`` still needs."""
    if not progress:
        return None
    from tqdm.auto import tqdm

    total += sum(spec_nbytes(d, s) for n, (d, s) in specs.items() if target.needed(n))
    bar = progress if callable(progress) else tqdm
    return bar(total=total, unit="B", unit_scale=True, desc=untrusted.printable(f"{what} -> {out.name}"))
