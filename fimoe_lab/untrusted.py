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
import re
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


_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
"""C0 controls, DEL, C1 controls and the Unicode bidirectional controls (they reorder what a terminal shows:
a name that reads as another)."""


def _escape(m: re.Match[str]) -> str:
    o = ord(m[0])
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}"


def printable(text: object, keep: str = "") -> str:
    """``str(text)`` with every control character outside ``keep`` written as an escape (module docstring)."""
    s = str(text)
    if keep:
        return _UNSAFE.sub(lambda m: m[0] if m[0] in keep else _escape(m), s)
    return _UNSAFE.sub(_escape, s)
