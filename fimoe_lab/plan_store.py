"""Layer plans kept on disk in their compiled forms, so a later process's first layer neither composes nor compiles.

A process's first MoE layer pays for building its plan (composing each map's steps) and compiling every map
(:mod:`fimoe_lab.compile`) before the first byte moves: milliseconds of Python per layer shape, where a model's
other layers take about one. After a plan's first :meth:`~fimoe_lab.plan.LayerPlan.apply` its maps' compiled forms
are known; this module writes them as one file under ``$FIMOE_LAB_CACHE/plans`` (:func:`dumps`: a checksum, a line
of JSON, then the raw bytes of the int32 tables it names; no pickle), named by a digest of the plan's arguments
(:func:`fimoe_lab.plan.kept_plan`: ``recipes.plan_for``'s, and the drop-ins' builders'), and a later process asking
for the same plan reads it back: each map as
:meth:`~fimoe_lab.layout.IndexMap.built_on_read` (its fields declared, its index built again from its steps' kinds
and parameters only if something reads it) with its compiled form given (:func:`fimoe_lab.compile.compiled_from`).
The executors read those forms (strided views, two strided stages, the row table the swizzle kernel reads for a
scale map and the cycle plan an in-place map runs along, each kept once the background planner found it), so such a
first layer launches at once, and the planner has nothing to build but copies; what needs the index (an inverse, a
row form or cycle plan not kept) builds it as before.

A record is used only when it and its folder are this user's and writable by no one else (not links), its checksum
matches its bytes, and its format, its key (the plan's arguments) and the fingerprint of the code that built it (the
package version and the size and modification time of every module that defines maps, plans or their compiled forms)
all match; else, or when it does not read, the plan is built as if it were absent, and written again after its first
apply. Only plans whose every map runs from a strided form are written (their first call needs no index). Writing is
one temporary file renamed into place; a folder that cannot be written is left alone for the rest of the process.
``FIMOE_LAB_PLAN_STORE=0`` turns reading and writing off.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import tempfile
import threading
import weakref
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import numpy as np

from fimoe_lab import env
from fimoe_lab.compile import compiled_from, form_record
from fimoe_lab.errors import FimoeError
from fimoe_lab.kernels.cycles import cycle_plans_of
from fimoe_lab.layout import IndexMap, compose
from fimoe_lab.steps import STEPS, build

__all__ = [
    "FORMAT",
    "PlanRecord",
    "enabled",
    "place",
    "read",
    "remember",
    "applied",
    "record_path",
    "fingerprint",
    "dumps",
    "loads",
]

FORMAT = 3
"""The record layout; a record of another format is not read."""

SUFFIX = ".plan"
"""A record's file name: the digest of its key, then this."""

PLANNER_WAIT = 8
"""Applies of a plan after its first that write its record again where the background planner has found more
(:func:`applied`): a later process then runs its scale maps on the swizzle kernel and its in-place maps along their
cycle plans from its first call."""

_FINGERPRINTED = ("", "kernels")
"""Folders of the package (relative to it) whose modules' stats make the code fingerprint: every module that
builds maps, plans or compiled forms lives in one of them."""

_lock = threading.Lock()
_pending: dict[int, tuple[weakref.ref, str, Path, dict[str, Any], dict[str, Any], int, Any]] = {}  # id(plan) -> what
# to write, how many more applies may write it again, and what the planner had found when it was last written
_state: dict[str, Any] = {}  # "fingerprint": the code fingerprint, once computed
_unwritable: set[Path] = set()  # folders a write failed in

PlanRecord = dict[str, Any]
"""What :func:`read` gives: the plan's fields (sizes, description) and its maps by tensor name."""


def enabled() -> bool:
    """Whether plans are read from and written to disk (``FIMOE_LAB_PLAN_STORE``, default on)."""
    return bool(env.value("FIMOE_LAB_PLAN_STORE", True))


def fingerprint() -> str:
    """The code fingerprint records carry: the package version and, per module of :data:`_FINGERPRINTED`, its name,
    size and modification time (computed once a process)."""
    found = _state.get("fingerprint")
    if found is None:
        from fimoe_lab import __version__

        root = os.path.dirname(os.path.abspath(__file__))
        h = hashlib.sha256(__version__.encode())
        for folder in _FINGERPRINTED:
            with os.scandir(os.path.join(root, folder)) as entries:
                modules = sorted((e.name, e.stat()) for e in entries if e.name.endswith(".py"))
            for name, st in modules:
                h.update(f"{folder}/{name}:{st.st_size}:{st.st_mtime_ns};".encode())
        found = _state["fingerprint"] = h.hexdigest()
    return str(found)


def record_path(key: dict[str, Any]) -> Optional[Path]:
    """The file of the plan with arguments ``key`` (JSON values); None where there is no cache folder (no
    ``FIMOE_LAB_CACHE`` and no home directory)."""
    try:
        folder = env.cache_dir() / "plans"
    except RuntimeError:  # Path.home() of a user without one
        return None
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:40]
    return folder / f"{digest}{SUFFIX}"


def place(key: dict[str, Any]) -> Optional[Path]:
    """Where the plan of arguments ``key`` is read from and written to (:func:`record_path`); None when the store is
    off (:func:`enabled`) or there is no cache folder."""
    return record_path(key) if enabled() else None


def read(key: dict[str, Any], path: Optional[Path]) -> Optional[PlanRecord]:
    """The stored plan of arguments ``key`` at ``path`` (:func:`place`): ``{"fields": {...}, "maps": {tensor:
    IndexMap}}``, or None when there is none that fits (no path, absent, unreadable, of another format, key or code
    fingerprint)."""
    try:
        if path is None or not (_private(path.parent, stat.S_ISDIR) and _private(path, stat.S_ISREG)):
            return None
        with open(path, "rb") as f:
            data = bytearray(os.fstat(f.fileno()).st_size)  # read once, the tables views of it
            if f.readinto(data) != len(data):
                return None
            record = loads(data)
        if record.get("format") != FORMAT or record.get("key") != key or record.get("fingerprint") != fingerprint():
            return None
        maps = {name: _map_from(entry) for name, entry in record["maps"].items()}
        return {"fields": dict(record["fields"]), "maps": maps}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError, FimoeError):
        return None


def dumps(record: dict[str, Any]) -> bytes:
    """``record`` (JSON values and 1-D int32 numpy tables, :func:`fimoe_lab.compile.form_record`'s) as bytes: a line
    with the CRC-32 of the rest (8 hex digits), one line of JSON in which each table is ``{"int32": [offset, count]}``
    (in 4-byte words), then the tables' little-endian bytes, 8-byte aligned in the file. A table reads back at memory
    speed, where text (base64 in JSON) decoded at about 0.5 GB/s and was most of a stored cycle plan's read; the
    checksum (about 6 GB/s) keeps a damaged file from being used."""
    tables: list[bytes] = []
    words = 0

    def table(value: Any) -> dict[str, list[int]]:
        nonlocal words
        if not (isinstance(value, np.ndarray) and value.dtype == np.int32 and value.ndim == 1):
            raise TypeError(f"a record holds {type(value).__name__}, neither a JSON value nor a 1-D int32 table")
        tables.append(value.astype("<i4", copy=False).tobytes())
        words += value.size
        return {"int32": [words - value.size, int(value.size)]}

    header = json.dumps(record, separators=(",", ":"), default=table)  # the C encoder (json.dump streams in Python)
    header += " " * (-(_CHECKSUM_LINE + len(header) + 1) % 8)
    body = header.encode("ascii") + b"\n" + b"".join(tables)
    return _checksum_line(body) + body


def _checksum_line(body: bytes | memoryview) -> bytes:
    """A record's first line: the CRC-32 of the rest as 8 lowercase hex digits, then a newline."""
    return b"%08x\n" % zlib.crc32(body)


_CHECKSUM_LINE = len(_checksum_line(b""))
"""Bytes of a record's first line."""


def loads(data: bytes | bytearray) -> dict[str, Any]:
    """The record of :func:`dumps`, its tables as writable 1-D int32 arrays (views of ``data`` where it is a
    ``bytearray`` and they are aligned); :class:`ValueError` where ``data`` is not one (its checksum does not match, no
    line of JSON, not JSON, a table outside the bytes that follow)."""
    view = memoryview(data)
    if bytes(view[:_CHECKSUM_LINE]) != _checksum_line(view[_CHECKSUM_LINE:]):  # byte for byte, as dumps wrote it
        raise ValueError("a record's checksum does not match its bytes: a damaged or foreign file")
    cut = data.index(b"\n", _CHECKSUM_LINE)
    body = view[cut + 1 :]
    if len(body) % 4:
        raise ValueError("a record's tables are not whole 4-byte words")
    words = len(body) // 4

    def table(fields: dict[str, Any]) -> Any:
        span = fields.get("int32") if len(fields) == 1 else None
        if span is None:
            return fields
        if not (isinstance(span, list) and len(span) == 2 and all(type(v) is int and v >= 0 for v in span)):
            raise ValueError(f"a record's table is named by {span!r}, not [offset, count]")
        offset, count = span
        if offset + count > words:
            raise ValueError(f"a record's table of {count} words at {offset} ends past its {words} words")
        found = np.frombuffer(body, dtype="<i4", count=count, offset=4 * offset).astype(np.int32, copy=False)
        return found if found.flags.writeable and found.flags.aligned else found.copy()

    record = json.loads(bytes(view[_CHECKSUM_LINE:cut]), object_hook=table)
    if not isinstance(record, dict):
        raise ValueError("a record is not a JSON object")
    return record


def _private(path: Path, kind: Callable[[int], bool]) -> bool:
    """Whether ``path`` itself (not a link) is of ``kind``, owned by this user and writable by no one else: a record
    anyone else could have written is not read."""
    st = os.lstat(path)
    return kind(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def remember(plan: Any, key: dict[str, Any], fields: dict[str, Any], path: Optional[Path]) -> None:
    """Write ``plan`` (an object with ``maps()``) under ``key`` to ``path`` (:func:`place`; None: nowhere) after its
    first apply (:func:`applied`), with ``fields`` (JSON values: what rebuilds it besides its maps)."""
    if path is not None and path.parent not in _unwritable:
        at = id(plan)
        with _lock:  # a plan freed unapplied leaves nothing behind
            ref = weakref.ref(plan, lambda _: _pending.pop(at, None))
            _pending[at] = (ref, fingerprint(), path, key, fields, PLANNER_WAIT, None)


def applied(plan: Any) -> None:
    """Called after each apply of a plan: the first of a plan :func:`remember` holds writes its record, when every
    map's compiled form is known and runs from a strided form; the next :data:`PLANNER_WAIT` applies write it again
    where the background planner has found more since (a swizzled map's row forms, an in-place map's cycle plan)."""
    if not _pending:
        return
    with _lock:
        held = _pending.pop(id(plan), None)
    if held is None or held[0]() is not plan:
        return
    ref, fp, path, key, fields, left, written = held
    maps = plan.maps()
    found = tuple(_found_by_planner(m) for m in maps.values())
    if found != written:
        entries = {name: _map_record(m) for name, m in maps.items()}
        if any(entry is None for entry in entries.values()):
            return
        _write(path, {"format": FORMAT, "fingerprint": fp, "key": key, "fields": fields, "maps": entries})
    if left > 0:
        with _lock:
            _pending[id(plan)] = (ref, fp, path, key, fields, left - 1, found)


def _found_by_planner(m: IndexMap) -> tuple[bool, tuple[int, ...]] | None:
    """What the background planner has found for ``m``'s compiled form so far: whether its row forms, and the tile
    sizes of its cycle plans (None: not compiled)."""
    em = m.known_compiled()
    return None if em is None else (em.row_forms_found(), tuple(sorted(cycle_plans_of(em))))


def _map_record(m: IndexMap) -> Optional[dict[str, Any]]:
    """A map's declared fields, its steps' and its compiled form (None: not compiled, not of a strided form, or of a
    step that cannot be built from its parameters)."""
    em = m.known_compiled()
    if em is None or any(s.kind not in STEPS for s in m.steps):
        return None
    form = form_record(em)
    if form is None:
        return None
    entry = _declared(m)
    entry["parts"] = [_declared(p) for p in m.parts]
    entry["exec"] = form
    return entry


def _declared(m: IndexMap) -> dict[str, Any]:
    return dict(
        kind=m.kind,
        params=dict(m.params),
        cell_bytes=m.cell_bytes,
        in_shape=list(m.in_shape),
        out_shape=list(m.out_shape),
        fills=list(m.fills),
    )


def _map_from(entry: dict[str, Any]) -> IndexMap:
    """The map of a record entry, its index built again from its steps when first read, its compiled form given."""
    parts = tuple(_declared_map(p, (lambda p=p: build(p["kind"], p["params"]))) for p in entry["parts"])
    form = entry["exec"]
    if parts:
        specs = [(p["kind"], p["params"]) for p in entry["parts"]]
        return _declared_map(entry, lambda: compose(*(build(k, params) for k, params in specs)), parts, form)
    return _declared_map(entry, lambda: build(entry["kind"], entry["params"]), (), form)


def _declared_map(
    entry: dict[str, Any],
    again: Callable[[], IndexMap],
    parts: tuple[IndexMap, ...] = (),
    form: Optional[dict[str, Any]] = None,
) -> IndexMap:
    """One map of a record (its kind a step's, or a chain of ``parts``), built again by ``again()`` when read."""
    if entry["kind"] not in STEPS and not parts:
        raise KeyError(entry["kind"])
    if type(entry["cell_bytes"]) is not int or entry["cell_bytes"] <= 0:
        raise ValueError(f"a map's cells of {entry['cell_bytes']!r} bytes")
    return IndexMap.built_on_read(
        again,
        entry["cell_bytes"],
        tuple(int(d) for d in entry["in_shape"]),
        tuple(int(d) for d in entry["out_shape"]),
        tuple(int(f) for f in entry["fills"]),
        str(entry["kind"]),
        dict(entry["params"]),
        parts,
        None if form is None else (lambda m: compiled_from(m, form)),
    )


def _write(path: Path, record: dict[str, Any]) -> None:
    """``record`` to ``path`` through a temporary file of ours renamed into place; on any failure nothing is left
    and no later write to that folder is tried."""
    tmp: Optional[str] = None
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".plan-", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(dumps(record))
        os.replace(tmp, path)
        tmp = None
    except (OSError, TypeError, ValueError):
        _unwritable.add(path.parent)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
