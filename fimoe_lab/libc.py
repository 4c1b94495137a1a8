"""The C library's functions that fimoe_lab calls through ``ctypes`` (Linux memory and file hints), each looked up
once: :func:`function` gives the process's own symbol, or None where the C library has no such function."""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from typing import Any, Optional

__all__ = ["function"]


def function(name: str, argtypes: list[Any], linux_only: bool = False) -> Optional[Callable[..., int]]:
    """libc's ``name`` (the process's own symbols) taking ``argtypes`` and returning a C ``int``, or None where
    there is none (or, with ``linux_only``, off Linux: where a call's constants differ between systems)."""
    if linux_only and not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn
