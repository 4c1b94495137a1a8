"""Text from files we do not trust: JSON parsed within bounds, and any of it printed safely.

- :func:`parse_json`: at most :data:`MAX_JSON_BYTES` and :data:`MAX_JSON_DEPTH` levels of nesting
  (a hostile file nested a million levels deep is one :class:`~fimoe_lab.errors.FimoeError`, never a
  ``RecursionError``); the depth is measured without recursion.
- :func:`printable`: control characters (C0, DEL, C1: escape sequences that retitle a terminal or
  clear it) and Unicode bidirectional overrides in names, paths and values from files become visible
  escapes (``\\x1b``, ``\\u202e``) before they reach stdout, stderr or a log; ``keep`` names the
  characters left as they are (a newline in a multi-line report).

Standard library only (``tune`` and the CLI's error line use it without importing torch).
"""

from __future__ import annotations

import json
from typing import Any

from fimoe_lab.errors import FimoeError

__all__ = ["MAX_JSON_BYTES", "MAX_JSON_DEPTH", "parse_json", "json_depth", "printable"]

MAX_JSON_BYTES = 64 << 20
"""config.json, an index, a safetensors header, metadata or a golden set above this size is refused."""
MAX_JSON_DEPTH = 64
"""Deepest nesting accepted (real configs and indexes nest fewer than 8 levels)."""


def json_depth(obj: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), counted without recursion; stops past ``limit``."""
    deepest, stack = 0, [(obj, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            depth += 1
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            stack.extend((v, depth) for v in (node.values() if isinstance(node, dict) else node))
    return deepest


def parse_json(raw: bytes | str, what: str, fix: str, error: type[FimoeError] = FimoeError) -> Any:
    """``raw`` parsed, or one ``error`` naming ``what`` (too large, too deep, or not JSON) with ``fix``."""
    if len(raw) > MAX_JSON_BYTES:
        raise error(f"{what} is {len(raw)} bytes, over the {MAX_JSON_BYTES >> 20} MB limit", fix=fix)
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise error(f"{what} nests deeper than {MAX_JSON_DEPTH} levels", fix=fix) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise error(f"{what} is not valid JSON ({printable(str(exc))})", fix=fix) from None
    if json_depth(obj) > MAX_JSON_DEPTH:
        raise error(f"{what} nests deeper than {MAX_JSON_DEPTH} levels", fix=fix)
    return obj


_BIDI = {0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)}
"""Unicode bidirectional controls: they reorder what a terminal shows (a name that reads as another)."""


def _unsafe(c: str) -> bool:
    o = ord(c)
    return o < 0x20 or 0x7F <= o < 0xA0 or o in _BIDI


def printable(text: object, keep: str = "") -> str:
    """``str(text)`` with every control character outside ``keep`` written as an escape (module docstring)."""
    s = str(text)
    if not any(_unsafe(c) and c not in keep for c in s):
        return s
    return "".join(
        c if not _unsafe(c) or c in keep else (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}") for c in s
    )
