"""The one writer of every file fimoe-lab writes besides convert's and restore's outputs: reports
(``inspect --html``), tables (``tune --csv/--json-out``), figures (``tune --plot``, ``diagnose --figure``,
the lab's save buttons).

Rules, for every kind (:data:`KINDS`, one row per kind of file):

- :func:`check_file_output` runs before any work: the target must not be ``.``/``..``, a directory,
  inside an input, a link (never followed, never replaced) or anything but a regular file; its
  directory must exist and be writable (a probe file of our own, created and removed); an existing
  file is replaced only with ``force`` and only if fimoe-lab wrote it: its first
  :data:`MARKER_WINDOW` bytes hold the kind's mark (:attr:`FileKind.mark`, which every file of the
  kind carries: :func:`marked` puts it there).
- :func:`write_file_output` checks again (the target may have changed meanwhile), then writes a
  temporary beside the target (``O_EXCL | O_NOFOLLOW``, mode ``0o666 & ~umask``), fsyncs it and
  renames it onto the target: never a partial file; the temporary is removed on any error and on
  SIGINT (convert's and restore's outputs follow the same rules: :mod:`fimoe_lab.checkpoints.safe_io`).

Standard library only: ``tune`` writes its tables without importing torch.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fimoe_lab.errors import FimoeError

__all__ = ["FileKind", "KINDS", "MARKER_WINDOW", "marked", "check_file_output", "write_file_output", "fsync_dir"]

MARKER_WINDOW = 4096
"""Bytes at the head of an existing file searched for its kind's mark."""


@dataclass(frozen=True)
class FileKind:
    """One kind of file: what it is (``what``), the command that writes it (``writer``), and ``mark``: bytes
    every such file holds in its first :data:`MARKER_WINDOW` bytes (at its very start when ``prefix``)."""

    what: str
    writer: str
    mark: bytes
    prefix: bool = False


PNG_TEXT = b"Software\x00fimoe-lab"
"""The PNG ``tEXt`` chunk's data that marks a figure fimoe-lab wrote."""
SVG_COMMENT = b"<!-- generator: fimoe-lab -->"
"""The comment that marks an SVG fimoe-lab wrote (after the XML declaration)."""

KINDS: dict[str, FileKind] = {
    "html": FileKind(
        "report", "'fimoe-lab inspect --html'", b'<meta name="generator" content="fimoe-lab inspect --html">'
    ),
    "png": FileKind("figure", "fimoe-lab (tune --plot, diagnose --figure, the lab)", b"tEXt" + PNG_TEXT),
    "svg": FileKind("figure", "the fimoe-lab lab", SVG_COMMENT),
    "csv": FileKind("table", "'fimoe-lab tune --csv'", b"inter_align,hidden_align,", prefix=True),
    "json": FileKind("table", "'fimoe-lab tune --json-out'", b'{\n "generator": "fimoe-lab', prefix=True),
}
"""Every kind of file :func:`write_file_output` writes, by name (the file's usual suffix)."""


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    """A PNG chunk: length (big-endian), type, data, CRC-32 of type and data."""
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def marked(data: bytes, kind: str) -> bytes:
    """``data`` carrying ``kind``'s mark: a PNG gets a ``tEXt`` chunk right after its 33-byte signature and
    ``IHDR``; an SVG the comment after its XML declaration (first, without one); the other kinds carry it already (their
    writers put it in: the report's ``<meta>``, the CSV's header row, the JSON's first key)."""
    k = KINDS[kind]
    if k.mark in data[:MARKER_WINDOW]:
        return data
    if kind == "png" and data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR":
        return data[:33] + _png_chunk(b"tEXt", PNG_TEXT) + data[33:]
    if kind == "svg" and data.startswith(b"<?xml"):
        end = data.find(b"?>") + 2
        return data[:end] + b"\n" + SVG_COMMENT + data[end:]
    if kind == "svg":
        return SVG_COMMENT + b"\n" + data
    raise FimoeError(f"a {k.what} does not carry fimoe-lab's mark", fix="report this as a bug")  # pragma: no cover


def _refuse(out: Path, kind: FileKind, why: str, fix: str) -> None:
    raise FimoeError(f"{kind.what} {out} {why}", fix=fix)


def _probe(out: Path, parent: Path, kind: FileKind) -> None:
    """Create and remove a file of our own in ``parent``: an unwritable directory fails now, before any work."""
    probe = parent / f".{out.name}.probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    except PermissionError as exc:
        raise PermissionError(exc.errno, exc.strerror, str(parent)) from None
    except OSError as exc:
        _refuse(out, kind, f"cannot be written: {exc.strerror}", "write it to another directory")
    os.unlink(probe)


def check_file_output(out: Path, kind: str, force: bool, inputs: Sequence[Path] = ()) -> None:
    """Refuse a target that could destroy data (module docstring), before any work."""
    k = KINDS[kind]
    out = Path(out)
    if out.name in ("", ".", "..") or (out.is_dir() and not out.is_symlink()):
        _refuse(out, k, "is a directory, not a file", f"name a new .{kind} file")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        _refuse(out, k, f"cannot be written: its directory {parent} does not exist", f"create {parent} first")
    _probe(out, parent, k)
    real = Path(os.path.realpath(out))
    for src in inputs:
        r_src = Path(os.path.realpath(src))
        if real == r_src or r_src in real.parents:
            _refuse(out, k, f"is inside the input {src}", "write it elsewhere")
    if not os.path.lexists(out):
        return
    st = os.lstat(out)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        _refuse(
            out, k, "exists and is not a regular file (a link is never followed or replaced)", "choose another path"
        )
    if not force:
        _refuse(out, k, "exists", f"pass --force to overwrite it (only a {k.what} {k.writer} wrote is replaced)")
    fd = os.open(out, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        head = os.read(fd, MARKER_WINDOW)
    finally:
        os.close(fd)
    if not (head.startswith(k.mark) if k.prefix else k.mark in head):
        _refuse(out, k, f"exists and was not written by {k.writer}", "choose another path, or remove it yourself")


def write_file_output(out: Path, data: bytes, kind: str, force: bool, inputs: Sequence[Path] = ()) -> Path:
    """Write ``data`` (given its kind's mark by :func:`marked`) at ``out`` by the rules of the module
    docstring; returns ``out``."""
    out = Path(out)
    check_file_output(out, kind, force, inputs)
    data = marked(data, kind)
    parent = out.parent if str(out.parent) else Path(".")
    tmp = parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(parent)
    return out


def fsync_dir(folder: Path) -> None:
    """Make a rename or a new entry in ``folder`` durable (best effort: a file system that cannot sync a
    folder is left as it is)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
