"""One byte budget for every cache of built maps and plans, and one way to empty them.

Steps, recipes and plans are cached by their arguments, so a model with 58 identical MoE
layers builds each map once. Their index tensors (and the compiled forms and device copies
cached on each map) are large for real shapes, so the caches share one budget in bytes:
when an insert would pass it, the least recently used entries of all caches go first.
:func:`clear_caches` empties every one of them, so the maps they held (and whatever the
maps cached on themselves) can be freed.

The budget is ``FIMOE_LAB_CACHE_BYTES`` (default 2 GiB), or :func:`set_cache_budget`.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Optional, TypeVar, cast

from fimoe_lab import env
from fimoe_lab.errors import FimoeError

__all__ = ["cached", "clear_caches", "set_cache_budget", "cache_bytes"]

F = TypeVar("F", bound=Callable[..., Any])

_lock = threading.RLock()
_entries: OrderedDict[tuple[Hashable, ...], tuple[Any, int]] = OrderedDict()  # (function, args) -> (value, bytes)
_total = 0
_budget: Optional[int] = None  # read from the environment on first use (:func:`_limit`)
_SCALARS = (int, bool, float, str, type(None))
_spellings: list[dict[tuple[Hashable, ...], tuple[Hashable, ...]]] = []  # one per cached function


def value_bytes(value: Any) -> int:
    """Bytes a cached value holds: the index tensors of every map in it (maps, plans, tuples)."""
    cells = getattr(value, "n_out_cells", None)  # an index map: int64 sources (counted unread: some are built
    if isinstance(cells, int):  # when first read)
        parts = getattr(value, "parts", ())
        return 8 * cells + sum(value_bytes(p) for p in parts)
    maps = getattr(value, "maps", None)
    if callable(maps):
        return sum(value_bytes(m) for m in maps().values())
    if isinstance(value, (tuple, list)):
        return sum(value_bytes(v) for v in value)
    return 0


def _plain(arg: Any) -> bool:
    """Whether a call may be remembered by ``arg`` as written: a scalar, or a frozen dataclass of scalars (the
    :class:`~fimoe_lab.choice.LayerShape` and :class:`~fimoe_lab.choice.LayoutChoice` a plan is asked with)."""
    kind = type(arg)
    if kind in _SCALARS:
        return True
    params = getattr(kind, "__dataclass_params__", None)
    return params is not None and params.frozen and all(type(v) in _SCALARS for v in vars(arg).values())


def _evict_for(size: int) -> None:
    global _total
    while _entries and _total + size > _limit():
        _, (_, freed) = _entries.popitem(last=False)
        _total -= freed


def cached(fn: F) -> F:
    """Cache ``fn`` by its (hashable) arguments within the shared byte budget.

    The key is the call bound to ``fn``'s signature with its defaults filled in, so
    ``f(1, 2)``, ``f(1, b=2)`` and ``f(1)`` (``b=2`` by default) are one entry and return
    one object: maps built once are compiled and planned once, whichever way a caller
    (a drop-in, ``plan_layer``, the warm-up) spells the call.
    """
    signature = inspect.signature(fn)
    spelled: dict[tuple[Hashable, ...], tuple[Hashable, ...]] = {}  # a call of plain values as written -> its key
    _spellings.append(spelled)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        global _total
        written = (args, tuple(kwargs.items()))
        plain = all(_plain(a) for a in args) and all(_plain(v) for v in kwargs.values())
        key = spelled.get(written) if plain else None
        if key is None:  # binding costs a few us; calls of scalars and such values remember it
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            key = (fn.__module__, fn.__qualname__, tuple(bound.arguments.items()))
            if plain:
                spelled[written] = key
        with _lock:
            hit = _entries.get(key)
            if hit is not None:
                _entries.move_to_end(key)
                return hit[0]
        value = fn(*args, **kwargs)
        size = value_bytes(value)
        with _lock:
            if key not in _entries and size <= _limit():
                _evict_for(size)
                _entries[key] = (value, size)
                _total += size
        return value

    return cast(F, wrapper)


def clear_caches() -> int:
    """Empty every cache of maps and plans; returns the bytes they held."""
    global _total
    with _lock:
        freed = _total
        _entries.clear()
        for spelled in _spellings:
            spelled.clear()
        _total = 0
    return freed


def _limit() -> int:
    """The budget: :func:`set_cache_budget`'s, else ``$FIMOE_LAB_CACHE_BYTES`` (bytes, K/M/G/T allowed;
    :data:`fimoe_lab.env.VARIABLES`), else 2 GiB."""
    global _budget
    if _budget is None:
        _budget = int(env.value("FIMOE_LAB_CACHE_BYTES", 2 << 30))
    return _budget


def set_cache_budget(nbytes: int) -> None:
    """Set the shared budget (bytes), evicting least recently used entries now if it shrank."""
    global _budget
    if nbytes < 0:
        raise FimoeError(f"a cache budget is a number of bytes >= 0, got {nbytes}", fix="pass 0 or more")
    with _lock:
        _budget = int(nbytes)
        _evict_for(0)


def cache_bytes() -> tuple[int, int, int]:
    """``(entries, bytes held, budget)`` of the shared cache."""
    with _lock:
        return len(_entries), _total, _limit()
