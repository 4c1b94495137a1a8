"""Writing outputs without ever losing data, and reading inputs without trusting them.

Outputs (``convert``'s file, ``restore``'s directory):

- :func:`check_output` runs before anything is read: OUT must not be ``.``/``..``, the input,
  inside the input, or a parent of it; an existing OUT is replaced only with ``force`` and
  only when this tool wrote it (a file whose safetensors metadata has the ``fimoe_lab``
  key; a directory holding :data:`MARKER` and nothing but what ``restore`` writes).
- :class:`OutputLock`: ``.<name>.lock`` beside OUT, appearing whole (a hard link of a written
  temporary) with its holder's host, boot id, pid namespace, pid and start time; a second writer of
  the same OUT fails at once; a lock whose process is provably gone is taken over, any other holder
  counts as alive; a FIFO, device or link at the lock path is refused, never opened.
- :func:`atomic_file` / :func:`atomic_dir`: a temporary created exclusively in OUT's
  directory (``O_EXCL | O_NOFOLLOW``, or an exclusive ``mkdir``), fsynced, then ``os.replace``\\ d;
  removed on any error, on SIGINT and on SIGTERM (:func:`signals_raise`, installed only
  while writing); those of a writer killed by SIGKILL are swept by the next writer (:func:`sweep_stale`). Files get ``0o666 & ~umask`` (0644 under the usual umask).

Inputs: :func:`regular_file` refuses FIFOs, devices and sockets (opening one may block
forever); :func:`read_json` bounds the bytes read; :func:`inside` keeps index paths in
the checkpoint directory.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, Optional

from fimoe_lab import untrusted
from fimoe_lab.errors import CheckpointError
from fimoe_lab.owned_files import fsync_dir

__all__ = [
    "MARKER",
    "RESTORE_FILES",
    "INDEX",
    "SHARD_RE",
    "shard_name",
    "AtomicFile",
    "single_output",
    "check_output",
    "OutputLock",
    "atomic_file",
    "atomic_dir",
    "signals_raise",
    "regular_file",
    "read_json",
    "inside",
    "safetensors_header",
    "safetensors_metadata",
]

MARKER = ".fimoe-lab-restored"
"""File inside a directory written by ``restore``: what lets ``--force`` replace it."""
INDEX = "model.safetensors.index.json"
"""The Hugging Face index of a sharded safetensors checkpoint (``weight_map``: tensor name -> shard file)."""
RESTORE_FILES = frozenset({MARKER, "config.json", INDEX})
"""The fixed names ``restore`` writes, besides its shards (:data:`SHARD_RE`); a directory with anything
else is never replaced."""
SHARD_RE = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")
"""A shard in the Hugging Face convention: ``model-0000k-of-0000n.safetensors`` (``1 <= k <= n``)."""
RANK_RE = re.compile(r"^rank-(\d+)$")
"""The directory of one tensor-parallel rank in ``convert --rank all`` output."""
MAX_JSON_BYTES = untrusted.MAX_JSON_BYTES
"""config.json, the index and a safetensors header above this size are refused (real ones are < 10 MB)."""


# ============================================================================ inputs
def regular_file(path: Path, what: str) -> os.stat_result:
    """``os.stat(path)`` if it is a regular file (symlinks followed); else CheckpointError / FileNotFoundError."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(2, f"no such {what}", str(path)) from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO, device or socket"
        raise CheckpointError(f"{path} ({what}) is {kind}, not a regular file", fix=f"pass the path of a real {what}")
    return st


def read_json(path: Path, what: str) -> Any:
    """Parse a JSON file of at most :data:`MAX_JSON_BYTES` and :data:`~fimoe_lab.untrusted.MAX_JSON_DEPTH` levels
    (a regular file) with one clear error."""
    st = regular_file(path, what)
    if st.st_size > MAX_JSON_BYTES:
        raise CheckpointError(
            f"{path} ({what}) is {st.st_size} bytes, over the {MAX_JSON_BYTES >> 20} MB limit",
            fix="check that it is the right file",
        )
    return untrusted.parse_json(path.read_bytes(), f"{path} ({what})", f"restore the original {what}", CheckpointError)


def inside(root: Path, name: object, what: str) -> Path:
    """``root / name`` for a relative ``name`` without ``..`` whose real path stays in ``root``.

    A Hugging Face cache snapshot (``<repo>/snapshots/<rev>``) links its files into
    ``<repo>/blobs``: those links are followed too.
    """
    bad = not isinstance(name, str) or not name or os.path.isabs(name) or ".." in Path(name).parts or "\0" in name
    if bad:
        raise CheckpointError(
            f"{what} names {name!r}: not a plain relative path inside {root}",
            fix="the index was edited; restore model.safetensors.index.json from the model's original files",
        )
    path = root / str(name)
    real, base = os.path.realpath(path), os.path.realpath(root)
    allowed = [base]
    if Path(base).parent.name == "snapshots":
        allowed.append(os.path.join(os.path.dirname(os.path.dirname(base)), "blobs"))
    if not any(real == a or real.startswith(a + os.sep) for a in allowed):
        raise CheckpointError(
            f"{what} {name!r} resolves to {real}, outside the checkpoint directory {base}",
            fix="copy the shard into the checkpoint directory instead of linking out of it",
        )
    return path


def safetensors_header(path: Path) -> Optional[tuple[dict, int]]:
    """``(header, data offset)`` of a safetensors file: the 8-byte length ``n`` then ``n`` bytes of JSON
    (at most ``MAX_JSON_BYTES``), data from ``8 + n``; None if it is not one or cannot be read."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return None
            (n,) = struct.unpack("<Q", head)
            if n > MAX_JSON_BYTES:
                return None
            header = untrusted.parse_json(f.read(n), str(path), "")
        return (header, 8 + n) if isinstance(header, dict) else None
    except (OSError, ValueError):  # FimoeError is a ValueError
        return None


def safetensors_metadata(path: Path) -> Optional[dict]:
    """The ``__metadata__`` of a safetensors file, from its bounded header only (None if it is not one)."""
    got = safetensors_header(path)
    meta = got[0].get("__metadata__") if got else None
    return meta if isinstance(meta, dict) else None


# ============================================================================ where OUT may go
def _real(p: Path) -> Path:
    return Path(os.path.realpath(p))


def _refuse(out: Path, why: str, fix: str) -> None:
    raise CheckpointError(f"output {out} {why}", fix=fix)


def shard_name(k: int, n: int) -> str:
    """Shard ``k`` (from 1) of ``n``: ``model-0000k-of-0000n.safetensors``."""
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def check_output(out: Path, inputs: list[Path], force: bool, kind: str, resume: bool = False) -> None:
    """Refuse an OUT that could destroy data, before anything is read.

    ``kind``: ``file`` (convert's single file), ``dir`` (restore's directory) or ``shards``
    (convert's sharded directory: an existing one is resumed with ``resume`` or rewritten with
    ``force``, and only when everything in it is what convert writes, :func:`foreign_entry`;
    an empty directory is used as it is).
    """
    if out.name in ("", ".", "..") or str(out) in (".", "..", os.sep):
        _refuse(out, "is a directory name, not a new output", "name a new file or directory, e.g. ./out")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        _refuse(out, f"cannot be written: its directory {parent} does not exist", f"create {parent} first")
    r_out = _real(out)
    for src in inputs:
        r_src = _real(src)
        if r_out == r_src or r_src in r_out.parents:
            _refuse(out, f"is {'' if r_out == r_src else 'inside '}the input {src}", "write the output elsewhere")
        if r_out in r_src.parents:
            _refuse(out, f"is a parent of the input {src}", "write the output elsewhere")
    if not os.path.lexists(out):
        return
    st = os.lstat(out)
    if stat.S_ISLNK(st.st_mode) and (force or resume):
        _refuse(out, "is a symbolic link; it is never replaced", "remove the link or choose another output")
    if kind == "shards":
        _check_shards_dir(out, force, resume)
        return
    if not force:
        _refuse(out, "exists", "pass --force to overwrite it (only an output this tool wrote is replaced)")
    if kind == "file":
        if not stat.S_ISREG(st.st_mode) or "fimoe_lab" not in (safetensors_metadata(out) or {}):
            _refuse(out, "exists and was not written by 'fimoe-lab convert'", "choose another output or remove it")
    else:
        names = set(os.listdir(out)) if stat.S_ISDIR(st.st_mode) else set()
        if MARKER not in names or not all(n in RESTORE_FILES or SHARD_RE.match(n) for n in names):
            _refuse(
                out,
                "exists and is not a directory written by 'fimoe-lab restore' (only those are replaced)",
                "choose another output directory or remove it",
            )


def _check_shards_dir(out: Path, force: bool, resume: bool) -> None:
    if not stat.S_ISDIR(os.lstat(out).st_mode):
        _refuse(out, "exists and is not a directory", "name a new directory, or a .safetensors file for one file")
    if not os.listdir(out):
        return
    if not (force or resume):
        _refuse(
            out,
            "exists",
            "pass --resume to finish an interrupted convert, or --force to rewrite it (only an output convert wrote)",
        )
    bad = foreign_entry(out)
    if bad is not None:
        _refuse(
            out,
            f"holds {bad}, not written by 'fimoe-lab convert' (only its own directories are resumed or replaced)",
            "choose another output directory or remove it",
        )


def single_output(out: Path, single_file: Optional[bool]) -> bool:
    """Whether convert writes one file at ``out``: ``single_file``, or (None) ``out`` ends in ``.safetensors``
    or is an existing file (not a directory); else a directory of shards."""
    if single_file is not None:
        return single_file
    return out.suffix == ".safetensors" or (os.path.lexists(out) and not os.path.isdir(out))


_OWN_HIDDEN_RE = re.compile(r"^\.(?P<base>.+?)(?:\.lock|\.(?:tmp|old)-\d+-[0-9a-f]+)$")
"""A lock or temporary beside an output (:class:`OutputLock`, :func:`_temp_name`)."""


def foreign_entry(d: Path) -> Optional[str]:
    """The first entry of ``d`` that convert's sharded output does not hold (None: all are its own).

    Its own: the index, shards (regular files with ``fimoe_lab`` metadata), their locks and
    temporaries, and ``rank-<r>`` directories of the same kind (``--rank all``).
    """
    for name in sorted(os.listdir(d)):
        p = d / name
        st = os.lstat(p)
        if name == INDEX and stat.S_ISREG(st.st_mode):
            continue
        if SHARD_RE.match(name) and stat.S_ISREG(st.st_mode) and "fimoe_lab" in (safetensors_metadata(p) or {}):
            continue
        hidden = _OWN_HIDDEN_RE.match(name)
        if hidden and (hidden["base"] == INDEX or SHARD_RE.match(hidden["base"])):
            continue
        if RANK_RE.match(name) and stat.S_ISDIR(st.st_mode):
            inner = foreign_entry(p)
            if inner is None:
                continue
            return f"{name}/{inner}"
        return name
    return None


def remove_own(d: Path, keep: set[str]) -> None:
    """Remove the shards, index and rank directories convert wrote in ``d`` except the names in ``keep``
    (only after :func:`foreign_entry` said every entry is convert's own)."""
    for name in os.listdir(d):
        p = d / name
        if name in keep or name.startswith("."):
            continue
        if RANK_RE.match(name) and p.is_dir() and not p.is_symlink():
            if foreign_entry(p) is None:
                remove_own(p, set())
                with contextlib.suppress(OSError):
                    os.rmdir(p)
        elif (name == INDEX or SHARD_RE.match(name)) and p.is_file() and not p.is_symlink():
            os.unlink(p)


LOCK_SETTLE_S = 2.0
"""How long an empty lock file is taken for one being written before it counts as stale."""

_HELD: dict[Path, int] = {}
"""Locks this process holds, with their nesting depth (a writer may take its output's lock
early, before reading its input, and again where it writes)."""


class OutputLock:
    """``.<name>.lock`` beside ``out``, holding :func:`holder_record` (host, boot id, pid namespace, pid and
    process start time); removed on the outermost exit.

    Re-entrant within one process; any other process that wants the same output fails at once. The
    lock file appears whole (its record is written to a temporary that is hard-linked onto the lock's
    name, which fails if it exists), so a full disk or a kill never leaves an empty lock. A lock path
    that is not a regular file (a FIFO, device, socket, link or directory planted there) is never
    opened and refused. A holder is taken for gone only when it provably is: the same host, boot and
    pid namespace as ours and its pid gone or running another process (another start time); any other
    holder (another host, boot or pid namespace, an unreadable record) counts as alive and the error
    says how to clear its lock.
    """

    def __init__(self, out: Path):
        self.path = out.parent / f".{out.name}.lock"
        self.out = out

    def __enter__(self) -> OutputLock:
        if self.path in _HELD:
            _HELD[self.path] += 1
            return self
        self._acquire()
        _HELD[self.path] = 1
        return self

    def _acquire(self) -> None:
        for _ in range(2):
            if self._create():
                return
            record = self._settled_holder()
            why = _holder_alive(record)
            if why is not None:
                raise CheckpointError(
                    f"another fimoe-lab ({why}) is writing {self.out} (lock {self.path})",
                    fix=f"wait for it to finish, or write to another output; if no fimoe-lab writes it, remove {self.path}",
                ) from None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)  # stale: its process is gone
        raise CheckpointError(f"could not take the lock {self.path}", fix="remove it if no fimoe-lab is running")

    def _create(self) -> bool:
        """Create the lock whole; False if a regular file is there already (a special file is refused)."""
        self._refuse_special()
        body = json.dumps(holder_record()).encode()
        tmp = _temp_name(self.out)
        try:
            with create_new(tmp) as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, self.path, follow_symlinks=False)
            except FileExistsError:
                return False
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                    raise
                return self._create_in_place(body)  # a file system without hard links
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def _create_in_place(self, body: bytes) -> bool:
        try:
            f = create_new(self.path)
        except FileExistsError:
            return False
        try:
            with f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)  # never an empty or partial lock
            raise
        return True

    def _refuse_special(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(
                f"the lock path {self.path} of {self.out} is {_kind(st)}, not a lock fimoe-lab made",
                fix=f"remove {self.path} (something else put it there), then run again",
            )

    def _settled_holder(self) -> Optional[dict]:
        """The holder's record. A lock of an older fimoe-lab (or one on a file system without hard links) is
        created empty and gets its record a moment later: an empty one is a lock being taken, so it is read
        again for up to :data:`LOCK_SETTLE_S` before it counts as stale (its writer died between the two
        steps). Reading it as stale at once let a second writer remove a live lock and write the same output."""
        deadline = time.monotonic() + LOCK_SETTLE_S
        while True:
            raw = self._read()
            if raw != b"" or time.monotonic() >= deadline:
                return _parse_record(raw)
            time.sleep(0.005)

    def _read(self) -> Optional[bytes]:
        """The lock's bytes (None: gone); a special file is refused, never opened for reading."""
        self._refuse_special()
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return None
        except OSError:
            return b"?"  # there but unreadable: an unknown holder
        try:
            return os.read(fd, 4096)
        finally:
            os.close(fd)

    def __exit__(self, *exc: object) -> None:
        _HELD[self.path] -= 1
        if _HELD[self.path]:
            return
        del _HELD[self.path]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _kind(st: os.stat_result) -> str:
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if stat.S_ISDIR(st.st_mode):
        return "a directory"
    return "a FIFO, device or socket"


def _read_small(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            return f.read(4096).decode(errors="replace").strip()
    except OSError:
        return None


def _start_time(pid: int) -> Optional[str]:
    """Process ``pid``'s start time (clock ticks since boot, field 22 of ``/proc/<pid>/stat``); None if
    unknown. With the pid it names one process: a reused pid has another start time."""
    stat_line = _read_small(f"/proc/{pid}/stat")
    if not stat_line or ")" not in stat_line:
        return None
    fields = stat_line.rsplit(")", 1)[1].split()
    return fields[19] if len(fields) > 19 else None


def _pid_namespace() -> Optional[str]:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def holder_record(pid: Optional[int] = None) -> dict[str, Any]:
    """What a lock holds about its writer (this process by default): ``host``, ``boot_id``
    (``/proc/sys/kernel/random/boot_id``), ``pid_ns`` (the pid namespace), ``pid`` and ``start``
    (:func:`_start_time`)."""
    pid = os.getpid() if pid is None else pid
    return {
        "host": socket.gethostname(),
        "boot_id": _read_small("/proc/sys/kernel/random/boot_id"),
        "pid_ns": _pid_namespace(),
        "pid": pid,
        "start": _start_time(pid),
    }


def _parse_record(raw: Optional[bytes]) -> Optional[dict]:
    """A lock's record; None if the lock is gone or empty; a bare pid (an older fimoe-lab) as ``{"pid": n}``;
    ``{}`` for anything unreadable (an unknown holder)."""
    if not raw:
        return None
    text = raw.decode(errors="replace").strip()
    if text.isdigit():
        return {"pid": int(text)}
    try:
        record = json.loads(text)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _holder_alive(record: Optional[dict]) -> Optional[str]:
    """None if the holder is provably gone (no record; or our host, boot and pid namespace with its pid
    gone or reused), else how to name it in an error."""
    if record is None:
        return None
    pid = record.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return "an unknown writer: the lock holds no record fimoe-lab can read"
    if set(record) == {"pid"}:  # an older fimoe-lab's lock: the pid alone
        return f"pid {pid}" if _alive(pid) else None
    here = holder_record()
    for key, what in (("host", "on host"), ("boot_id", "from another boot of"), ("pid_ns", "in pid namespace")):
        if record.get(key) != here[key]:
            where = record.get("host") if key != "pid_ns" else record.get(key)
            return f"pid {pid} {what} {where}, which cannot be checked from here"
    if not _alive(pid):
        return None
    start = _start_time(pid)
    if start is not None and record.get("start") is not None and start != record["start"]:
        return None  # the pid now names another process
    return f"pid {pid}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ============================================================================ atomic writes
class Terminated(KeyboardInterrupt):
    """Raised in the main thread by SIGTERM while an output is written (so the temporary is removed)."""

    def __init__(self, signum: int):
        super().__init__(f"terminated by signal {signum}")
        self.signum = signum


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """While writing: SIGINT raises KeyboardInterrupt, SIGTERM :class:`Terminated`; previous handlers restored.

    A signal's exception raised inside a C extension can come back out of it as another error (torch turns an
    exception in a sequence's ``__getitem__`` into ``ValueError: could not determine the shape ...``): an error
    that leaves this block after a signal arrived is re-raised as that signal's exception, chained to it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []

    def signal_error(signum: int) -> BaseException:
        return Terminated(signum) if signum == signal.SIGTERM else KeyboardInterrupt()

    def raise_signal(signum: int, frame: object) -> None:
        arrived.append(signum)
        raise signal_error(signum)

    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in previous:
        signal.signal(s, raise_signal)
    try:
        yield
    except Exception as exc:
        if arrived:
            raise signal_error(arrived[0]) from exc
        raise
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


def create_new(path: Path) -> BinaryIO:
    """Open a new file for writing: ``O_EXCL | O_NOFOLLOW``, mode ``0o666 & ~umask``."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    return os.fdopen(os.open(path, flags, 0o666), "wb")


def _temp_name(out: Path, kind: str = "tmp") -> Path:
    return out.parent / f".{out.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def sweep_stale(out: Path) -> list[Path]:
    """Remove the temporaries of ``out`` left by writers that were killed (SIGKILL): their pid is gone.

    Called while holding :class:`OutputLock`, so no live writer of ``out`` owns them.
    """
    removed = []
    for kind in ("tmp", "old"):
        for p in out.parent.glob(f".{glob_escape(out.name)}.{kind}-*-*"):
            pid = p.name[len(f".{out.name}.{kind}-") :].split("-")[0]
            if pid.isdigit() and not _alive(int(pid)):
                if kind == "old" and not os.path.lexists(out):
                    os.rename(p, out)  # killed between moving the old output aside and putting the new one in
                elif p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(p)
                removed.append(p)
    return removed


def glob_escape(name: str) -> str:
    """``name`` with glob's special characters escaped."""
    return "".join(f"[{c}]" if c in "*?[]" else c for c in name)


class AtomicFile:
    """A new temporary beside ``out`` (:func:`create_new`, holding ``out``'s :class:`OutputLock`) that
    becomes ``out`` on :meth:`commit` (fsync, ``os.replace``) and is removed on :meth:`discard`.

    Several may be open at once and finish in any order (the shards of one convert);
    :func:`atomic_file` is the one-file context-manager form.
    """

    def __init__(self, out: Path):
        self.out, self.tmp, self.open = out, _temp_name(out), True
        self._lock = OutputLock(out)
        self._lock.__enter__()
        try:
            sweep_stale(out)
            self.handle = create_new(self.tmp)
        except BaseException:
            self._lock.__exit__()
            raise

    def commit(self) -> None:
        """fsync the temporary and put it at ``out`` (removed instead if that fails)."""
        try:
            self.handle.flush()
            os.fsync(self.handle.fileno())
            self.handle.close()
            os.replace(self.tmp, self.out)
            fsync_dir(self.out.parent)
        except BaseException:
            self.discard()
            raise
        self.open = False
        self._lock.__exit__()

    def discard(self) -> None:
        """Remove the temporary (nothing happens after :meth:`commit` or a first discard)."""
        if not self.open:
            return
        self.open = False
        try:
            self.handle.close()
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.tmp)
            self._lock.__exit__()


@contextlib.contextmanager
def atomic_file(out: Path) -> Iterator[BinaryIO]:
    """Yield a new temporary file beside ``out``; on success fsync it and ``os.replace`` it onto ``out``."""
    with signals_raise():
        f = AtomicFile(out)
        try:
            yield f.handle
        except BaseException:
            f.discard()
            raise
        f.commit()


@contextlib.contextmanager
def atomic_dir(out: Path) -> Iterator[Path]:
    """Yield a new temporary directory beside ``out`` (``mkdir``, exclusive); on success put it at ``out``.

    An existing ``out`` (already vetted by :func:`check_output`) is moved aside first and
    removed only after the new one is in place (moved back if that fails).
    """
    with signals_raise(), OutputLock(out):
        sweep_stale(out)
        tmp = _temp_name(out)
        os.mkdir(tmp, 0o777)  # exclusive, mode 0o777 & ~umask
        old: Optional[Path] = None
        try:
            yield tmp
            for p in tmp.iterdir():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
            if os.path.lexists(out):
                old = _temp_name(out, "old")
                os.rename(out, old)
            try:
                os.rename(tmp, out)
            except BaseException:
                if old is not None:
                    os.rename(old, out)
                    old = None
                raise
            fsync_dir(out.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)


def write_json(path: Path, obj: object) -> None:
    """A new JSON file (:func:`create_new`)."""
    with create_new(path) as f:
        f.write((json.dumps(obj, indent=2) + "\n").encode())


def open_safetensors(path: Path, what: str = "safetensors file") -> Any:
    """``safe_open(path)`` of a regular file; a corrupt or truncated one raises one CheckpointError."""
    from safetensors import SafetensorError, safe_open

    regular_file(Path(path), what)
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path} is not a readable safetensors file ({one_line(exc)})",
            fix="it is truncated or corrupt: copy or download it again",
        ) from None


def one_line(exc: BaseException) -> str:
    """An exception's text on one line, at most 300 characters (header parse errors can be long)."""
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."
