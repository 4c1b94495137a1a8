"""Every ``FIMOE_*`` environment variable fimoe-lab reads, parsed by one set of functions.

Booleans have one spelling set everywhere (case and surrounding blanks ignored): true is
:data:`TRUE` (``1 true yes on``), false is :data:`FALSE` (``0 false no off`` or empty); any other
value is one :class:`~fimoe_lab.errors.FimoeError` naming the variable and the spellings (so
``FIMOE_LAB_INSTALL=off`` never installs and ``FIMOE_BACKGROUND_LOAD=nope`` is an error, not a
guess). Integers are whole decimal numbers within their bounds; paths are non-empty.

:data:`VARIABLES` lists them, with their kind and what each does; :func:`value` reads one,
:func:`check_all` (run by the CLI before any command) validates every one that is set.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from fimoe_lab.errors import FimoeError

__all__ = [
    "TRUE",
    "FALSE",
    "HELP",
    "VARIABLES",
    "Variable",
    "value",
    "check_all",
    "env_bool",
    "env_int",
    "env_path",
    "env_switch",
    "cache_dir",
]

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off", "")
BOOLEAN = f"a boolean ({'/'.join(TRUE)} or {'/'.join(f for f in FALSE if f)})"
"""How an error names the accepted spellings."""


def _bad(name: str, raw: str, want: str) -> FimoeError:
    return FimoeError(f"environment variable {name}={raw!r} is not {want}", fix=f"unset {name} or set it to {want}")


def env_bool(name: str, default: bool) -> bool:
    """``$name`` as a boolean (module docstring); ``default`` when unset."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise _bad(name, raw, BOOLEAN)


def env_switch(name: str, extra: str) -> str | bool:
    """``$name`` as a boolean or the one extra word ``extra`` (``FIMOE_LAB_INSTALL=force``); False when unset."""
    raw = os.environ.get(name)
    if raw is not None and raw.strip().lower() == extra:
        return extra
    try:
        return env_bool(name, False)
    except FimoeError:
        raise _bad(name, str(raw), f"{BOOLEAN} or {extra!r}") from None


UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
"""Suffixes :func:`parse_int` accepts with ``units=True`` (powers of 1024, case ignored, an optional ``b``/``ib``)."""
NO_MAXIMUM = 1 << 62
"""The bound of a number without one of its own (no real size or count comes near it)."""
_NUMBER = re.compile(r"^(\d{1,30})\s*(?:([kmgt])i?)?b?$")


def parse_int(name: str, raw: str, minimum: int, maximum: int, units: bool = False) -> int:
    """``raw`` (the value of ``name``) as a whole number in ``[minimum, maximum]``; with ``units`` a
    K/M/G/T suffix (powers of 1024: ``64G``, ``64GiB``) is allowed."""
    bounds = f"in [{minimum}, {maximum}]" if maximum < NO_MAXIMUM else f">= {minimum}"
    want = f"a whole number {bounds}" + (" (K/M/G/T suffixes allowed, e.g. 64G)" if units else "")
    text = raw.strip().lower()
    m = _NUMBER.match(text) if units else re.match(r"^(\d{1,30})()$", text)
    if m is None:
        raise _bad(name, raw, want)
    value = int(m[1]) * UNITS[m[2] or ""]
    if not minimum <= value <= maximum:
        raise _bad(name, raw, want)
    return value


def env_int(name: str, default: int, minimum: int = 0, maximum: int = NO_MAXIMUM, units: bool = False) -> int:
    """``$name`` as an integer (:func:`parse_int`); ``default`` when unset (an empty value is an error)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    return parse_int(name, raw, minimum, maximum, units)


def env_path(name: str) -> Optional[Path]:
    """``$name`` as a path (``~`` expanded); None when unset or empty."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    return Path(raw).expanduser()


@dataclass(frozen=True)
class Variable:
    """One variable: its ``kind`` (``bool``, ``switch``: a boolean or the word ``extra``, ``int``, ``size``: an
    integer with K/M/G/T allowed, ``path``), bounds for numbers, and what it does."""

    name: str
    kind: str
    doc: str
    minimum: int = 0
    maximum: int = NO_MAXIMUM
    extra: str = ""

    def read(self, default: Any) -> Any:
        """The value (``default`` when unset), or one FimoeError."""
        if self.kind == "bool":
            return env_bool(self.name, default)
        if self.kind == "switch":
            return env_switch(self.name, self.extra) if self.name in os.environ else default
        if self.kind in ("int", "size"):
            return env_int(self.name, default, self.minimum, self.maximum, units=self.kind == "size")
        return env_path(self.name) or default


VARIABLES = {
    v.name: v
    for v in (
        Variable(
            "FIMOE_LAB_INSTALL",
            "switch",
            "engine plugins: a true value installs fimoe_lab into vLLM/SGLang, 'force' on any version",
            extra="force",
        ),
        Variable("FIMOE_BACKGROUND_LOAD", "bool", "a false value loads kernel executors in the calling thread"),
        Variable(
            "FIMOE_PREBUILT_KERNELS",
            "bool",
            "a false value keeps CUDA transforms on torch while Triton is not loaded (default on: the kernels built "
            "ahead of time stand in, in place, where they move each byte once and torch twice, and out of place: a "
            "strided map (or one of two strided stages) on the strided kernel from its first call, in place too until "
            "its cycle plan is built on a thread, any other map once its plan is built, on torch until then)",
        ),
        Variable(
            "FIMOE_INPLACE_CLUSTERS",
            "bool",
            "true: the prebuilt executor permutes every in-place map a cluster of thread blocks holds whole on chip "
            "with the cluster kernels, false: none (the cycle kernel), unset: where two blocks of the scattering kernel "
            "share a multiprocessor, or cells have at least 256 bytes (where the GPU is sm_90 or newer and the buffer "
            "16-byte aligned; else as without them)",
        ),
        Variable("FIMOE_WRITE_LANES", "int", "convert's writer threads (default from the CPU count)", 1, 256),
        Variable("FIMOE_LAB_CACHE_BYTES", "size", "the in-memory plan cache budget (default 2 GiB)"),
        Variable(
            "FIMOE_LAB_PREPARE",
            "bool",
            "a false value stops the lab's explorers preparing likely next views while idle (default on: from "
            "0.25 s after a figure is shown, in units any change stops, only in the room the caches have free)",
        ),
        Variable(
            "FIMOE_LAB_MAX_MEMORY",
            "size",
            "the memory one read of a checkpoint layer may allocate (K/M/G/T allowed; default the smaller of 64G "
            "and 3/4 of the host's memory)",
        ),
        Variable(
            "FIMOE_LAB_CACHE",
            "path",
            "where fimoe-lab caches what it builds: layer plans' compiled forms (plans/) and TRTLLM-Gen modules "
            "(default ~/.cache/fimoe_lab)",
        ),
        Variable(
            "FIMOE_LAB_PLAN_STORE",
            "bool",
            "a false value keeps layer plans in memory only (default on: a plan's compiled forms are written under "
            "$FIMOE_LAB_CACHE/plans after its first apply, and a later process's first layer of that shape reads "
            "them instead of building and compiling the plan)",
        ),
        Variable("FIMOE_LAB_TACTICS_DIR", "path", "where the tactic tables are read from (default: the shipped ones)"),
        Variable("FIMOE_GOLDENS", "path", "golden sets to check (a file or a folder)"),
        Variable("FIMOE_DIST_TIMEOUT", "int", "convert --distributed: seconds to wait for a peer (default 300)", 1),
        Variable("FIMOE_DIST_DATA_TIMEOUT", "int", "convert --distributed: seconds for writing (default 43200)", 1),
    )
}
"""Every variable fimoe-lab reads: what :func:`value` parses and :func:`check_all` validates."""

HELP = "environment (booleans: 1/true/yes/on or 0/false/no/off):\n" + "\n".join(
    f"{v.name}: {v.doc}" for v in VARIABLES.values()
)
"""The ``fimoe-lab --help`` section on the environment, from :data:`VARIABLES`."""


def cache_dir() -> Path:
    """Root of everything fimoe-lab caches on disk: ``$FIMOE_LAB_CACHE`` or ``~/.cache/fimoe_lab``."""
    found: Optional[Path] = value("FIMOE_LAB_CACHE", None)
    return found or Path.home() / ".cache" / "fimoe_lab"


def value(name: str, default: Any) -> Any:
    """``$name`` parsed as :data:`VARIABLES` says (``default`` when unset)."""
    return VARIABLES[name].read(default)


def check_all() -> None:
    """Parse every variable of :data:`VARIABLES` that is set: a bad one is one FimoeError before any work
    (the CLI calls this first)."""
    for v in VARIABLES.values():
        if v.name in os.environ:
            v.read(None)
