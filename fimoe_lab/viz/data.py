"""What the explorers draw, read off index maps (numpy only: no plotting here).

Every function takes an :class:`~fimoe_lab.layout.IndexMap` (or a layer plan) and
returns plain arrays; the figures only draw them, so a test can check a figure's data
against the map it came from. Shapes are one expert's matrix; ``itemsize`` is the
bytes per stored element of the tensor the map moves, read off ``specs.FORMATS``
(:func:`itemsize_of`: 2 for bf16, 1 for fp8, UE8M0, E4M3 and packed fp4 bytes, 4 for
fp32 scales). Steps are told apart by ``kind``/``params``, never by display name.

Why one module of this size: it is the single place where the lab turns maps into arrays, one short
function per view (rows, tiles, swizzle, padding, provenance, word bits) sharing a few element-coordinate
helpers and one bounded cache (:func:`memo`). Each view's function is independent of the others; a split
per view would mostly move those shared helpers into a module of their own and add imports, not separate
jobs.
"""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from typing import Any, Optional, TypeVar

import numpy as np
import torch

from fimoe_lab.errors import LayoutError
from fimoe_lab.layout import IndexMap, compose
from fimoe_lab.plan import TENSOR_NAMES, LayerPlan
from fimoe_lab.recipes import plan_layer
from fimoe_lab.specs import get_format
from fimoe_lab.steps import shuffle_block_size

__all__ = [
    "TENSOR_NAMES",
    "itemsize_of",
    "element_sources",
    "display_2d",
    "gather_values",
    "Gathered",
    "RowFlow",
    "row_flow",
    "observed_row_sources",
    "CellGrid",
    "TileView",
    "tile_view",
    "SwizzleView",
    "swizzle_view",
    "TensorPadding",
    "PaddingReport",
    "padding_report",
    "provenance_rows",
    "FLAG_NAMES",
    "value_flags",
    "Downsampled",
    "downsample",
    "sample_grid",
    "all_finite",
    "reduce_mask",
    "reduce_view",
    "RowWindow",
    "row_window",
    "memo",
    "lru_get",
    "BoundedCache",
    "nbytes",
    "row_element_sources",
    "fill_mask",
    "has_fill",
    "gather_mask",
    "chain_diff",
    "landing",
    "Cells",
    "Trace",
    "trace_cell",
]

T = TypeVar("T")
MEMO_ENTRIES = 16
"""Results :func:`memo` keeps at most."""
MEMO_BYTES = 128 << 20
"""Bytes the results :func:`memo` keeps hold at most (:func:`nbytes`; the newest is kept whatever its size): the
largest at R1 size are a swizzle view (w13 scales: ~45 MB of int32) and a fill mask (one byte per element:
~15 MB); element maps are not built."""


def memo(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, kept for the last :data:`MEMO_ENTRIES` distinct calls.

    Arrays, tensors and index maps are keyed by identity and referenced weakly: an entry goes when one of
    them is freed (so an id is never reused while its entry lives, and an entry never keeps an expert's
    values alive after the bounded caches of :mod:`.sources` dropped them); other arguments by value. The
    lab's inputs are cached, read-only objects (a layer's plans and per-expert values), so a redraw at
    DeepSeek size recomputes only what its control changed.
    """
    held = [isinstance(a, (np.ndarray, torch.Tensor, IndexMap)) for a in args]
    key = (getattr(fn, "__qualname__", repr(fn)),) + tuple(("id", id(a)) if h else a for a, h in zip(args, held))

    cache = _MEMO  # (held by the callbacks: module globals are gone when the interpreter exits)

    def make() -> tuple:
        result = fn(*args)
        return [weakref.ref(a, lambda _: cache.drop(key)) for a, h in zip(args, held) if h], result

    return cache.get(key, make)[1]  # type: ignore[no-any-return]


def lru_get(cache: OrderedDict, key: Hashable, make: Callable[[], Any], limit: int) -> Any:
    """``cache[key]``, from ``make()`` when absent; past ``limit`` entries the least recently used are dropped."""
    if key in cache:
        cache.move_to_end(key)
    else:
        cache[key] = make()
        while len(cache) > limit:
            cache.popitem(last=False)
    return cache[key]


def nbytes(value: Any, _seen: Optional[set] = None) -> int:
    """Bytes an array, a tensor, or a dataclass / dict / sequence of them holds, each object counted once (a
    structure that refers to itself ends there; a broadcast view: none; a meta tensor: none). Fields built when
    first read (an index map's pending index, an executable form's cells) count once built: counting builds
    nothing."""
    seen = set() if _seen is None else _seen
    if id(value) in seen:
        return 0
    seen.add(id(value))
    if isinstance(value, np.ndarray):
        return 0 if 0 in value.strides and value.size > 1 else int(value.nbytes)
    if isinstance(value, torch.Tensor):
        return 0 if value.is_meta else value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(nbytes(v, seen) for v in list(value.values()))
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v, seen) for v in value)
    fields = getattr(value, "__dataclass_fields__", None)
    if not fields:
        return 0
    held = getattr(value, "__dict__", None)
    if held is None:
        return sum(nbytes(getattr(value, f), seen) for f in fields)
    return sum(nbytes(held[f], seen) for f in fields if f in held)


class BoundedCache:
    """A least-recently-used cache bounded by the bytes its values hold (:func:`nbytes`) and, given ``count``, by
    their number: past either bound the oldest entries are dropped (the newest is always kept, whatever its size)."""

    def __init__(self, limit: int, count: Optional[int] = None):
        self.limit = limit
        self.count = count  # entries kept at most (None: any number)
        self.entries: OrderedDict = OrderedDict()  # key -> (value, bytes)
        self.bytes = 0

    def get(self, key: Hashable, make: Callable[[], T]) -> T:
        """``make()`` kept under ``key``."""
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key][0]  # type: ignore[no-any-return]
        value = make()
        size = nbytes(value)
        self.entries[key] = (value, size)
        self.bytes += size
        while len(self.entries) > 1 and (
            self.bytes > self.limit or len(self.entries) > (self.count or len(self.entries))
        ):
            _, (_, dropped) = self.entries.popitem(last=False)
            self.bytes -= dropped
        return value

    def drop(self, key: Hashable) -> None:
        """Forget ``key`` (nothing where it is not kept)."""
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry[1]

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0


_MEMO = BoundedCache(MEMO_BYTES, MEMO_ENTRIES)


def itemsize_of(fmt: str, tensor: str) -> int:
    """Bytes per stored element of ``tensor`` ("w13", "w2", "w13_scale", "w2_scale") in ``fmt``.

    Weights: ``spec.itemsize`` (packed fp4 is drawn per byte, two values each); scales:
    ``spec.scale_itemsize`` (4 for fp8-block's float32 block scales).
    """
    spec = get_format(fmt)
    return spec.scale_itemsize if tensor.endswith("_scale") else spec.itemsize


def _check_itemsize(m: IndexMap, itemsize: int) -> None:
    if m.in_shape[-1] % itemsize or m.out_shape[-1] % itemsize or m.cell_bytes % itemsize:
        raise LayoutError(
            f"{m.name} moves {m.cell_bytes}-byte cells of rows {m.in_shape[-1]} -> {m.out_shape[-1]} bytes, "
            f"which do not split into whole {itemsize}-byte elements",
            fix="pass the itemsize of the tensor it moves (itemsize_of(fmt, tensor))",
        )


def element_sources(m: IndexMap, itemsize: int = 1, narrow: bool = False) -> np.ndarray:
    """int64 array of ``m.out_shape`` in elements: the flat input element of each output element.

    ``-1`` marks fill. The last dim of ``out_shape`` is divided by ``itemsize``. ``narrow``: int32 where the
    input's elements fit (a scale map's always do): half the memory, and fresh memory is what a real-size
    view pays for.
    """
    _check_itemsize(m, itemsize)
    src = m.refined(itemsize).src.numpy()
    shape = m.out_shape[:-1] + (m.out_shape[-1] // itemsize,)
    out = src.astype(np.int32 if narrow and m.in_bytes // itemsize < 2**31 else np.int64)
    np.maximum(out, -1, out=out)  # every fill code (negative) as -1
    return out.reshape(shape)


def _cell_elements(m: IndexMap, itemsize: int) -> int:
    """Elements of ``itemsize`` bytes per cell of ``m`` (a cell moves whole elements: checked)."""
    _check_itemsize(m, itemsize)
    return m.cell_bytes // itemsize


def has_fill(m: IndexMap) -> bool:
    """True when some output cell of ``m`` is fill (read off its cells)."""
    return bool(m.src.numel()) and int(m.src.min()) < 0


def fill_mask(m: IndexMap, itemsize: int = 1) -> np.ndarray:
    """bool of :func:`display_2d` (``m``'s output in elements): True where the element is fill.

    Read off ``m``'s cells (each covers ``cell_bytes / itemsize`` elements), never an element map."""
    k = _cell_elements(m, itemsize)
    return display_2d(np.repeat(m.src.numpy() < 0, k).reshape(_out_elements(m, itemsize)))


def row_element_sources(m: IndexMap, rows: np.ndarray, itemsize: int = 1) -> np.ndarray:
    """:func:`element_sources` of output rows ``rows`` of a 2-D map only: int64 ``(len(rows), out elements)``.

    Reads just those rows of ``m.src``, so a window of a real-size map costs the window.
    """
    if len(m.out_shape) != 2:
        raise LayoutError(f"{m.name} has output {m.out_shape}; a row window needs a 2-D map", fix="use element_sources")
    _check_itemsize(m, itemsize)
    cell, (out_rows, out_cols) = m.cell_bytes, m.out_shape
    cells = m.src.view(out_rows, out_cols // cell)[torch.as_tensor(rows, dtype=torch.int64)].numpy()
    byte_src = np.where(cells[..., None] >= 0, cells[..., None] * cell + np.arange(cell), -1).reshape(len(rows), -1)
    elem = byte_src[:, ::itemsize]
    return np.where(elem >= 0, elem // itemsize, -1)


def display_2d(a: np.ndarray) -> np.ndarray:
    """A 3-D kernel layout ``(K/bk, M, bk)`` shown as ``(K/bk * M, bk)``; 2-D unchanged."""
    return a.reshape(-1, a.shape[-1]) if a.ndim > 2 else a


def _gather_cells(m: IndexMap, a: np.ndarray, itemsize: int) -> tuple[np.ndarray, np.ndarray]:
    """``a`` (``m.in_shape`` in elements, any dtype) moved through ``m`` a whole cell at a time (one
    row gather of ``cell_bytes / itemsize`` elements per output cell: no element map, which is ~120 MB
    of int64 for one R1 expert). Returns ``(out, fill)``: ``out`` with ``m.out_shape`` in elements (a fill
    cell holds input cell 0), ``fill`` bool per output cell."""
    k = _cell_elements(m, itemsize)
    in_shape = m.in_shape[:-1] + (m.in_shape[-1] // itemsize,)
    if a.size != math.prod(in_shape):
        raise LayoutError(
            f"values of shape {a.shape} do not match {m.name}'s input {in_shape} elements of {itemsize} B",
            fix="pass one expert's values in the map's input layout",
        )
    src = m.src.numpy()
    out = np.take(a.reshape(-1, k), src, axis=0, mode="clip")  # fill (negative) reads cell 0
    return out, src < 0


def gather_values(m: IndexMap, values: np.ndarray | torch.Tensor, itemsize: int = 1) -> np.ndarray:
    """Move one expert's per-element ``values`` ``(rows, cols)`` through ``m``: float, NaN = fill.

    ``values`` has ``m.in_shape`` in elements (e.g. dequantized magnitudes of the stored
    elements); the result has ``m.out_shape`` in elements, drawn with :func:`display_2d`.
    """
    v = _floats(values.numpy() if isinstance(values, torch.Tensor) else values)
    out, fill = _gather_cells(m, v, itemsize)
    out[fill] = np.nan
    return out.reshape(_out_elements(m, itemsize))


def gather_mask(m: IndexMap, mask: np.ndarray, itemsize: int = 1) -> np.ndarray:
    """A bool ``mask`` in ``m``'s input elements moved through ``m`` (fill: False), :func:`display_2d` shape."""
    out, fill = _gather_cells(m, np.asarray(mask, dtype=bool), itemsize)
    out[fill] = False
    return display_2d(out.reshape(_out_elements(m, itemsize)))


@dataclass(frozen=True, eq=False)
class Gathered:
    """``display_2d(gather_values(m, values, itemsize))`` left unbuilt (one R1 expert: 60 MB): ``[i, j]``
    reads one element through ``m``'s cells (hover), :func:`reduce_view` reduces it for a heatmap
    straight from ``values``. Keyed by identity (:func:`memo`)."""

    m: IndexMap
    values: np.ndarray
    itemsize: int = 1

    @property
    def shape(self) -> tuple[int, int]:
        out = _out_elements(self.m, self.itemsize)
        return math.prod(out[:-1]), out[-1]

    def __getitem__(self, ij: tuple[int, int]) -> float:
        rows, cols = self.shape
        i, j = (int(v) for v in ij)
        if not (0 <= i < rows and 0 <= j < cols):
            raise IndexError(f"element ({i}, {j}) is outside {self.shape}")
        byte = (i * cols + j) * self.itemsize
        cell = int(self.m.src[byte // self.m.cell_bytes])
        if cell < 0:
            return math.nan
        return float(self.values.reshape(-1)[(cell * self.m.cell_bytes + byte % self.m.cell_bytes) // self.itemsize])

    def full(self) -> np.ndarray:
        """The gathered values, built (:func:`gather_values`, :func:`display_2d`)."""
        return display_2d(gather_values(self.m, self.values, self.itemsize))


def _gathered_top(g: Gathered, fr: int, fc: int) -> np.ndarray:
    """The largest value per ``fr x fc`` block of ``g``'s display: ``_block_reduce(g.full(), fr, fc, -inf,
    np.fmax)`` where a block has a finite value (else NaN or -inf, as there: both mean none). Rows first:
    for each offset ``j < fr`` rows ``j, j + fr, ...`` are gathered into one buffer of ``1/fr`` of the
    display (a whole cell at a time: pieces of a cell that never straddle a display row) and folded
    in with ``fmax``; no full-size array is built."""
    rows, cols = g.shape
    m, v = g.m, _floats(g.values)
    k = m.cell_bytes // g.itemsize
    piece = math.gcd(k, cols)
    src = m.src.numpy()
    if k > piece:  # cells span display rows: split each into k / piece pieces
        f = k // piece
        src = np.where(src[:, None] >= 0, src[:, None] * f + np.arange(f), -1).reshape(-1)
    grid = src.reshape(rows, cols // piece)
    pieces = v.reshape(-1, piece)
    acc = np.full((-(-rows // fr), cols), np.nan, dtype=v.dtype)
    buf = np.empty((acc.shape[0], cols // piece, piece), dtype=v.dtype)
    for j in range(fr):
        sub = grid[j::fr]
        n = len(sub)
        np.take(pieces, sub, axis=0, mode="clip", out=buf[:n])  # fill (negative) reads piece 0
        buf[:n][sub < 0] = np.nan
        np.fmax(acc[:n], buf[:n].reshape(n, cols), out=acc[:n])
    return _block_reduce(acc, 1, fc, -np.inf, np.fmax)


# ----------------------------------------------------------------------------- rows
def _epilogue_tile_m(m: IndexMap) -> Optional[int]:
    """``epilogue_tile_m`` of the shuffle step in ``m``'s chain, or None."""
    return next((int(s.params["epilogue_tile_m"]) for s in m.steps if s.kind == "shuffle_rows_for_epilogue"), None)


@dataclass(frozen=True)
class RowFlow:
    """Which checkpoint row lands in each kernel row (``out[i] = in[src_rows[i]]``).

    ``src_rows`` int64 ``(out_rows,)``, ``-1`` = a padding row; ``projections`` 2 for a
    fused ``[gate; up]`` W13 of ``2 * intermediate`` input rows, 1 otherwise; ``steps``
    the ``kind`` of each row step, in order.
    ``shuffle_block``/``epilogue_tile`` come from the chain's epilogue shuffle step.
    """

    src_rows: np.ndarray
    in_rows: int
    projections: int
    steps: tuple[str, ...]
    shuffle_block: Optional[int]
    epilogue_tile: Optional[int]

    @property
    def out_rows(self) -> int:
        return int(self.src_rows.size)

    def colour_modes(self) -> tuple[str, ...]:
        """The colourings this flow supports, for a widget's dropdown."""
        modes = ["origin"]
        if self.shuffle_block:
            modes += ["shuffle block", "epilogue tile"]
        return tuple(modes)

    def groups(self, colour_by: str = "origin") -> tuple[np.ndarray, tuple[str, ...]]:
        """Per output row, a group code and the group labels; padding is always the last label.

        ``origin``: gate / up (or rows) / padding, by source row; ``shuffle block``: the
        output block of ``shuffle_block`` rows; ``epilogue tile``: the output tile of
        ``epilogue_tile`` rows.
        """
        pad = self.src_rows < 0
        if colour_by == "origin":
            half = self.in_rows // self.projections
            names = ("gate", "up") if self.projections == 2 else ("row",)
            code = np.minimum(np.maximum(self.src_rows, 0) // max(half, 1), len(names) - 1)
        elif colour_by in ("shuffle block", "epilogue tile") and self.shuffle_block:
            size = self.shuffle_block if colour_by == "shuffle block" else self.epilogue_tile
            code = np.arange(self.out_rows) // size
            names = tuple(f"{colour_by} {k}" for k in range(int(code.max()) + 1))
        else:
            raise LayoutError(
                f"cannot colour rows by {colour_by!r}", fix=f"this chain offers {', '.join(self.colour_modes())}"
            )
        return np.where(pad, len(names), code), names + ("padding",)


def row_flow(m: IndexMap, projections: int = 2) -> RowFlow:
    """The row permutation of ``m`` (its leading 2-D steps: pad, swap, interleave, shuffle).

    ``m`` acts on ``[P*I, K]`` bytes; every kernel row must come from one input row
    (true of every row step in :mod:`fimoe_lab.steps`). Later steps that re-tile or
    swizzle are left out: see :func:`tile_view` and :func:`swizzle_view`.
    """
    rows_map = m.row_steps()
    in_rows = rows_map.in_shape[0]
    first = rows_map.row_sources().numpy()
    etm = _epilogue_tile_m(rows_map)
    block = shuffle_block_size(etm) if etm else None
    return RowFlow(first.astype(np.int64), in_rows, projections, tuple(s.kind for s in rows_map.steps), block, etm)


@dataclass(frozen=True)
class RowWindow:
    """A window of a :class:`RowFlow`, kept on both sides at once.

    ``side`` "kernel": kernel rows ``lo..hi-1`` and the checkpoint rows they come from;
    "checkpoint": checkpoint rows ``lo..hi-1`` and the kernel rows they land in.
    ``pairs`` int64 ``(n, 2)`` of ``(checkpoint row, kernel row)`` (checkpoint -1: a padding
    kernel row). ``ckpt_rows``/``kernel_rows``: the sorted distinct rows on each side; a row's
    position on its side is its index there, so a swap offset (gate rows ``0..`` next to
    up rows ``I..``) keeps every 16/32-row shuffle visible instead of stretching the axis.
    """

    side: str
    lo: int
    hi: int
    pairs: np.ndarray
    ckpt_rows: np.ndarray
    kernel_rows: np.ndarray

    def positions(self) -> tuple[np.ndarray, np.ndarray]:
        """Per pair, the position of its checkpoint row (-1: padding) and of its kernel row."""
        c, k = self.pairs[:, 0], self.pairs[:, 1]
        cpos = np.where(c >= 0, np.searchsorted(self.ckpt_rows, c), -1)
        return cpos, np.searchsorted(self.kernel_rows, k)

    @staticmethod
    def gaps(rows: np.ndarray) -> np.ndarray:
        """Positions ``p`` where ``rows[p] - rows[p-1] > 1``: a jump the axis does not draw."""
        return np.flatnonzero(np.diff(rows) > 1) + 1


def row_window(flow: RowFlow, lo: int, hi: int, side: str = "kernel") -> RowWindow:
    """The rows of ``flow`` in ``lo..hi-1`` on ``side`` ("kernel" or "checkpoint"), with their partners.

    A checkpoint row lands in exactly one kernel row (row steps move whole rows and only
    add padding), so both sides of the window hold the same number of real rows.
    """
    rows = flow.out_rows if side == "kernel" else flow.in_rows
    if side not in ("kernel", "checkpoint"):
        raise LayoutError(f"a row window is on the 'kernel' or 'checkpoint' side, not {side!r}", fix="pick one")
    lo, hi = max(0, lo), min(rows, hi)
    if lo >= hi:
        raise LayoutError(f"row window {lo}..{hi - 1} is empty", fix=f"{side} rows are 0..{rows - 1}")
    if side == "kernel":
        k = np.arange(lo, hi)
        c = flow.src_rows[lo:hi]
    else:
        dest = np.full(flow.in_rows, -1, dtype=np.int64)
        real = flow.src_rows >= 0
        dest[flow.src_rows[real]] = np.flatnonzero(real)
        c = np.arange(lo, hi)
        k = dest[lo:hi]
        c, k = c[k >= 0], k[k >= 0]
    pairs = np.stack([c, k], axis=1).astype(np.int64)
    return RowWindow(side, lo, hi, pairs, np.unique(c[c >= 0]), np.unique(k))


def observed_row_sources(checkpoint: torch.Tensor, kernel: torch.Tensor) -> np.ndarray:
    """For each row of ``kernel`` ``(R', K)``, the row of ``checkpoint`` ``(R, K)`` with the same bytes.

    ``-1`` where no checkpoint row matches (padding rows are all zero; rows that were
    changed match nothing). Compare with :func:`row_flow` to see what a suspect
    preparation actually did. Columns past the checkpoint's width are ignored.
    """
    ck = checkpoint.contiguous().view(torch.uint8).reshape(checkpoint.shape[0], -1).numpy()
    kn = kernel.contiguous().view(torch.uint8).reshape(kernel.shape[0], -1).numpy()[:, : ck.shape[1]]
    index = {row.tobytes(): i for i, row in enumerate(ck)}
    return np.array([index.get(row.tobytes(), -1) for row in kn], dtype=np.int64)


# ----------------------------------------------------------------------------- tiles
@dataclass(frozen=True)
class CellGrid:
    """An int32 grid ``(R, C)`` of indices read off one value per cell, never built whole (a DeepSeek-V3 w13
    expert has 29M elements: 117 MB as int32): element ``(i, j)``, flat ``e = i * C + j``, lies in cell
    ``e // k`` and holds ``first[e // k] + step * (e % k)``, or -1 where ``first`` is negative (fill).

    ``grid[i, j]`` (ints) reads one element (hover); ``grid[rows, cols]`` with a slice builds that part (a
    sampled picture, :func:`sample_grid`); ``np.asarray(grid)`` builds it all."""

    first: np.ndarray
    k: int
    step: int
    shape: tuple[int, int]

    def __getitem__(self, key: tuple) -> Any:
        i, j = key
        rows = np.arange(self.shape[0])[i]
        cols = np.arange(self.shape[1])[j]
        e = np.atleast_1d(rows).astype(np.int64)[:, None] * self.shape[1] + np.atleast_1d(cols)[None, :]
        first = self.first[e // self.k]
        out = np.where(first >= 0, first + self.step * (e % self.k), -1).astype(np.int32)
        if np.ndim(rows) == 0:
            out = out[0]
        if np.ndim(cols) == 0:
            out = out[..., 0]
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self[:, :]
        return whole if dtype is None else whole.astype(dtype)


@dataclass(frozen=True)
class TileView:
    """Block-major-K: ``[M, K] -> [K/bk, M, bk]``, element sources drawn as ``(K/bk * M, bk)``.

    ``src_row``/``src_col`` ``(K/bk * M, bk)`` in the map's input elements (-1 fill);
    ``block_of_input`` ``(in_rows, in_cols)``: the K block each input element lands in. Each a
    :class:`CellGrid` of the map's cells (``k`` elements each), built only where a picture samples it.
    """

    src_row: CellGrid
    src_col: CellGrid
    block_of_input: CellGrid
    blocks: int
    rows: int
    block_cols: int
    name: str


def tile_view(m: IndexMap, itemsize: int = 1) -> TileView:
    """Where every element of a block-major-K output ``(K/bk, M, bk)`` comes from."""
    if len(m.out_shape) != 3:
        raise LayoutError(
            f"{m.name} has output {m.out_shape} bytes; a block-major-K tile view needs (K/bk, M, bk)",
            fix="pick a map that ends with block_major_k",
        )
    # read off the map's cells (each moves ``k`` consecutive elements of one input row: ``in_cols`` is a
    # multiple of ``k``), never its element map
    k = _cell_elements(m, itemsize)
    in_cols = m.in_shape[-1] // itemsize
    kb, rows, bk = _out_elements(m, itemsize)
    cells = m.src.numpy().reshape(-1).astype(np.int64)
    start = np.where(cells >= 0, cells * k, -1)  # first input element of each cell
    cell_row = np.where(start >= 0, start // max(in_cols, 1), -1)
    cell_col = np.where(start >= 0, start % max(in_cols, 1), -1)
    block_of_input = np.full(m.in_shape[0] * in_cols // k, -1, dtype=np.int64)
    taken = cells >= 0
    block_of_input[cells[taken]] = (np.arange(cells.size) // (cells.size // kb))[taken]  # output cells in order
    out_shape = (kb * rows, bk)
    return TileView(
        CellGrid(cell_row, k, 0, out_shape),
        CellGrid(cell_col, k, 1, out_shape),
        CellGrid(block_of_input, k, 0, (m.in_shape[0], in_cols)),
        kb,
        rows,
        bk,
        m.name,
    )


# ----------------------------------------------------------------------------- values at any size
FLAG_NAMES = ("data", "padding", "dead scale", "Inf", "NaN")
"""Per-element flags of a value view, by code; a coarse pixel shows the highest code it covers."""


def _floats(values: np.ndarray) -> np.ndarray:
    """``values`` as a float array: float32 / float64 as given (no real-size copy), others as float64."""
    v = np.asarray(values)
    return v if v.dtype in (np.float32, np.float64) else v.astype(np.float64)


def value_flags(values: np.ndarray, pad: Optional[np.ndarray] = None, dead: Optional[np.ndarray] = None) -> np.ndarray:
    """uint8 flag code per element of ``values`` (any shape), indexing :data:`FLAG_NAMES`.

    ``pad`` (bool, same shape): fill elements; ``dead`` (bool): elements whose block scale
    is below :data:`fimoe_lab.formats.health.TINY_SCALE`; NaN/Inf are read off ``values``
    (a padding element's NaN is padding, not NaN).
    """
    v = _floats(values)
    flags = np.zeros(v.shape, dtype=np.uint8)
    if dead is not None:
        flags[np.broadcast_to(dead, v.shape)] = FLAG_NAMES.index("dead scale")
    if not np.isfinite(v).all():  # one pass when every value is finite (the usual case at real size)
        flags[np.isinf(v)] = FLAG_NAMES.index("Inf")
        flags[np.isnan(v)] = FLAG_NAMES.index("NaN")
    if pad is not None:
        flags[np.broadcast_to(pad, v.shape)] = FLAG_NAMES.index("padding")
    return flags


@dataclass(frozen=True)
class Downsampled:
    """A 2-D value view reduced to at most ``max_side`` pixels per side.

    ``values`` ``(ceil(R/fr), ceil(C/fc))``: the largest finite value of each ``fr x fc``
    block of elements (NaN when the block has none); ``flags``: the highest flag code in
    the block (so one NaN among 10^4 elements stays visible); ``block = (fr, fc)``;
    ``shape = (R, C)`` the element shape, for axes in elements.
    """

    values: np.ndarray
    flags: np.ndarray
    block: tuple[int, int]
    shape: tuple[int, int]

    def counts(self, flags: np.ndarray) -> dict[str, int]:
        """Element count per flag name of the full-size ``flags`` (names with a count only)."""
        n = np.bincount(flags[flags != 0], minlength=len(FLAG_NAMES))  # flagged elements are few
        return {name: int(c) for name, c in zip(FLAG_NAMES, n) if c and name != "data"}


def _blocks(a: np.ndarray, fr: int, fc: int, fill) -> np.ndarray:
    r, c = a.shape
    padded = a if r % fr == c % fc == 0 else np.pad(a, ((0, -r % fr), (0, -c % fc)), constant_values=fill)
    return padded.reshape(padded.shape[0] // fr, fr, padded.shape[1] // fc, fc)


def _block_reduce(a: np.ndarray, fr: int, fc: int, fill, ufunc=np.maximum) -> np.ndarray:
    """``ufunc`` over each ``fr x fc`` block of ``a`` (padded with ``fill``): ``(ceil(R/fr), ceil(C/fc))``.
    Rows first, over whole contiguous rows (several times faster than one reduce over both block axes),
    then each block's columns folded in one strided slice at a time (a reduce over a short inner axis
    is ~10x slower: 12 ms against 1.3 ms for 512 x 3584 float32 in blocks of 7)."""
    b = _blocks(a, fr, fc, fill)
    rows = b.reshape(b.shape[0], fr, -1)
    rows = rows[:, 0] if fr == 1 else ufunc.reduce(rows, axis=1)
    cols = rows.reshape(b.shape[0], b.shape[2], fc)
    out = cols[..., 0].copy()
    for k in range(1, fc):
        ufunc(out, cols[..., k], out=out)
    return out


def reduction(shape: tuple[int, ...], max_side: int = 512) -> tuple[int, int]:
    """The block ``(fr, fc) = (ceil(R / max_side), ceil(C / max_side))`` that brings ``shape``
    ``(R, C)`` to at most ``max_side`` pixels per side (:func:`downsample`, :func:`sample_grid`)."""
    return -(-shape[0] // max_side), -(-shape[1] // max_side)


def downsample(values: np.ndarray, flags: np.ndarray, max_side: int = 512) -> Downsampled:
    """``values`` ``(R, C)`` (float) and its ``flags`` reduced to at most ``max_side`` per side.

    Block ``fr = ceil(R / max_side)``, ``fc = ceil(C / max_side)``; value = max over the
    block's finite elements, flag = max code (:class:`Downsampled`).
    """
    v = _floats(values)
    fr, fc = reduction(v.shape, max_side)
    if fr == fc == 1:
        return Downsampled(np.where(np.isfinite(v), v, np.nan), flags, (1, 1), v.shape)
    top = _block_reduce(v, fr, fc, -np.inf, np.fmax)  # NaN skipped; a block with +Inf is redone below
    if np.count_nonzero(top == np.inf) > 256:  # many: one pass without the Inf instead
        top = _block_reduce(np.where(np.isfinite(v), v, -np.inf), fr, fc, -np.inf)
    for i, j in zip(*np.nonzero(top == np.inf)):
        block = v[i * fr : (i + 1) * fr, j * fc : (j + 1) * fc]
        finite = block[np.isfinite(block)]
        top[i, j] = finite.max() if finite.size else np.nan
    return Downsampled(np.where(np.isfinite(top), top, np.nan), _block_reduce(flags, fr, fc, 0), (fr, fc), v.shape)


def reduce_mask(mask: np.ndarray, max_side: int = 512) -> tuple[np.ndarray, tuple[int, int]]:
    """bool ``mask`` ``(R, C)`` reduced to at most ``max_side`` per side (blocks of :func:`reduction`): a
    pixel is True when any element of its block is. Returns the mask and the block ``(fr, fc)``."""
    fr, fc = reduction(mask.shape, max_side)
    return _block_reduce(np.asarray(mask, dtype=bool), fr, fc, False), (fr, fc)


def all_finite(values: np.ndarray) -> bool:
    """True when every element of ``values`` is finite: two reductions (max, min: NaN and +-Inf
    reach them), no full-size temporary."""
    v = np.asarray(values)
    if v.dtype.kind != "f" or not v.size:
        return True
    return bool(np.isfinite(v.max()) and np.isfinite(v.min()))


def reduce_view(
    values: np.ndarray | Gathered,
    pad: Optional[np.ndarray] = None,
    dead: Optional[np.ndarray] = None,
    max_side: int = 512,
    finite: bool = False,
) -> tuple[Downsampled, dict[str, int]]:
    """``downsample(values, value_flags(values, pad, dead), max_side)`` and its flag counts.

    ``finite``: the caller knows every value outside ``pad`` is finite (gathered from finite
    values). Then, with no dead element, the only flag is padding and nothing per element is
    flagged or counted: the flags are ``pad`` reduced (a real-size expert: no 15 MB flag array,
    no NaN/Inf passes), and :class:`Gathered` values are reduced without being built.
    Otherwise the per-element flags are built; the result is the same.
    """
    if finite and (dead is None or not np.any(dead)):
        fr, fc = reduction(values.shape, max_side)
        if isinstance(values, Gathered):
            top = _gathered_top(values, fr, fc)
        else:  # finite but padding (NaN, skipped)
            top = _block_reduce(_floats(values), fr, fc, -np.inf, np.fmax)
        if pad is None:
            flags, counts = np.zeros(top.shape, np.uint8), {}
        else:
            flags = _block_reduce(np.asarray(pad), fr, fc, False).astype(np.uint8) * FLAG_NAMES.index("padding")
            n = int(np.count_nonzero(pad))
            counts = {"padding": n} if n else {}
        return Downsampled(np.where(np.isfinite(top), top, np.nan), flags, (fr, fc), tuple(values.shape)), counts
    v = values.full() if isinstance(values, Gathered) else _floats(values)
    flags = value_flags(v, pad, dead)
    small = downsample(v, flags, max_side)
    return small, small.counts(flags)


def sample_grid(a: np.ndarray, max_side: int = 512) -> tuple[np.ndarray, tuple[int, int]]:
    """Every ``(fr, fc)``-th element of an index array ``a`` ``(R, C)`` (at most ``max_side`` per side).

    Index maps (source rows, columns) do not average: the view shows the first element of
    each block, and the caller says so. Returns the sample and ``(fr, fc)``.
    """
    fr, fc = reduction(a.shape, max_side)
    return a[::fr, ::fc], (fr, fc)


@dataclass(frozen=True)
class SwizzleView:
    """A 128x4-swizzled scale buffer, atom by atom.

    The buffer ``Rp*Cp`` is drawn as ``(atoms*32, 16)``: atom ``a`` (512 scales, one
    128-row x 4-column block of the linear matrix) is rows ``32a .. 32a+31``.
    ``src_row``/``src_col``: input coordinates of each buffer scale (-1 fill);
    ``dest_atom``/``dest_offset`` ``(in_rows, in_cols)``: where each linear scale lands.
    ``atom_origin`` ``(atoms, 2)``: the (row block, column block) of the swizzled
    ``[Rp, Cp]`` matrix each atom holds. ``kernel_row``/``kernel_col`` ``(atoms*32, 16)``:
    the row and column of the swizzle step's own input (the kernel-side, row-permuted
    ``[Rp, Cp]`` matrix) each buffer scale comes from.
    """

    src_row: np.ndarray
    src_col: np.ndarray
    kernel_row: np.ndarray
    kernel_col: np.ndarray
    dest_atom: np.ndarray
    dest_offset: np.ndarray
    atom_origin: np.ndarray
    name: str

    @property
    def atoms(self) -> int:
        return self.src_row.shape[0] // 32


ATOM = 512


def _row_col(flat: np.ndarray, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """``(row, column)`` of flat indices ``flat`` into a ``(-1, cols)`` matrix; -1 for both where ``flat`` is -1."""
    row, col = np.divmod(flat, cols)  # np.divmod: numpy's % alone is several times slower at R1 size
    col[flat < 0] = -1  # row: -1 // cols is already -1
    return row, col


def _taken_at(src: np.ndarray, size: int, fill: bool) -> np.ndarray:
    """Where each of ``size`` inputs is taken in ``src`` (``out[i] = in[src[i]]``; negative: fill, only
    when ``fill``): its position, -1 where none takes it. int32 (int64 past 2**31 positions): half the
    fresh memory of an R1 scale map's inverse, which a click or a new tensor pays for."""
    dtype = np.int64 if src.size >= 2**31 else np.int32
    dest = np.full(size, -1, dtype=dtype)
    if fill:
        taken = src >= 0
        dest[src[taken]] = np.flatnonzero(taken)
    else:
        dest[src] = np.arange(src.size, dtype=dtype)
    return dest


def swizzle_view(m: IndexMap, itemsize: int = 1) -> SwizzleView:
    """Where each scale of the linear ``[rows, cols]`` input lands in the swizzled buffer.

    ``m`` is a chain that ends with ``swizzle_scales_128x4`` (e.g. a plan's
    ``w13_scale``: pad, row permutation, swizzle); sources are the chain's input.
    Indices are int32 (int64 only past 2**31 elements).
    """
    if m.steps[-1].kind != "swizzle_scales_128x4":
        raise LayoutError(
            f"{m.name} does not end with swizzle_scales_128x4; there is no swizzled buffer to draw",
            fix="pick a TRT-LLM scale map (w13_scale or w2_scale of mxfp8, nvfp4 or mxfp4)",
        )
    src = element_sources(m, itemsize, narrow=True).reshape(-1)
    if src.size % ATOM:
        raise LayoutError(
            f"{m.name}: buffer of {src.size} scales is not whole 512-scale atoms",
            fix="pad the scales to 128 rows and 4 columns first",
        )
    in_rows, in_cols = m.in_shape[0], m.in_shape[-1] // itemsize
    dest = _taken_at(src, in_rows * in_cols, has_fill(m)).reshape(in_rows, in_cols)
    cp_atoms = m.out_shape[-1] // itemsize // 4
    atoms = np.arange(src.size // ATOM)
    last = m.steps[-1]
    rows, cols = _row_col(src, in_cols)
    k_src = element_sources(last, itemsize, narrow=True).reshape(-1)
    k_rows, k_cols_of = _row_col(k_src, last.in_shape[-1] // itemsize)
    return SwizzleView(
        rows.reshape(-1, 16),
        cols.reshape(-1, 16),
        k_rows.reshape(-1, 16),
        k_cols_of.reshape(-1, 16),
        dest // ATOM,  # -1 (dropped) stays -1
        dest,
        np.stack([atoms // cp_atoms, atoms % cp_atoms], axis=1),
        m.name,
    )


# ----------------------------------------------------------------------------- padding
@dataclass(frozen=True)
class TensorPadding:
    """Padding of one tensor of a plan (``m``: its index map, ``itemsize``: bytes per element)."""

    name: str
    m: IndexMap
    itemsize: int

    @property
    def fill_bytes(self) -> int:
        """Padding bytes per expert."""
        return int((self.m.src < 0).sum()) * self.m.cell_bytes

    @property
    def out_bytes(self) -> int:
        return self.m.out_bytes

    @property
    def padded_mask(self) -> np.ndarray:
        """bool ``(rows, elements)`` over the padded matrix before any permutation (True = padding)."""
        return fill_mask(_padded_stage(self.m), self.itemsize)

    @property
    def kernel_mask(self) -> np.ndarray:
        """bool over the kernel layout as stored (:func:`display_2d`), True = padding."""
        return fill_mask(self.m, self.itemsize)


@dataclass(frozen=True)
class PaddingReport:
    """Padding of every tensor of one layer's plan, per TP shard, with the waste in bytes."""

    fmt: str
    backend: str
    tp: int
    intermediate: int
    local_intermediate: int
    hidden: int
    plan: LayerPlan
    experts: int
    tensors: dict

    @property
    def fill_bytes(self) -> int:
        """Padding bytes over all experts and tensors of one TP shard."""
        return self.experts * sum(t.fill_bytes for t in self.tensors.values())

    @property
    def out_bytes(self) -> int:
        return self.experts * sum(t.out_bytes for t in self.tensors.values())

    @property
    def waste_pct(self) -> float:
        return 100.0 * self.fill_bytes / self.out_bytes if self.out_bytes else 0.0

    def summary(self) -> str:
        p = self.plan
        return (
            f"{p.description}, TP {self.tp}: intermediate {self.intermediate} -> {self.local_intermediate} per shard "
            f"-> padded {p.padded_intermediate}; hidden {self.hidden} -> {p.padded_hidden}; "
            f"waste {self.fill_bytes:,} B of {self.out_bytes:,} B ({self.waste_pct:.2f}%) for {self.experts} experts"
        )


def _padded_stage(m: IndexMap) -> IndexMap:
    """The prefix of ``m``'s steps up to its last ``pad_projections`` step (or its first step)."""
    last = max((i for i, s in enumerate(m.steps) if s.kind == "pad_projections"), default=-1)
    return compose(*m.steps[: last + 1]) if last >= 0 else m.steps[0]


def padding_report(
    fmt: str,
    backend: str,
    intermediate: int,
    hidden: int,
    tp: int = 1,
    experts: int = 1,
    intermediate_alignment: Optional[int] = None,
    hidden_alignment: Optional[int] = None,
    is_act_and_mul: bool = True,
    is_gated: bool = True,
) -> PaddingReport:
    """Which rows/columns of w13, w2 and their scales are padding, for one TP shard.

    ``intermediate`` is the model's (global) size; each TP shard holds ``intermediate / tp``
    before padding. Alignments default to :func:`fimoe_lab.recipes.default_alignments`
    (what ``fimoe-lab convert`` pads to); the plan is :func:`fimoe_lab.recipes.plan_layer`.
    """
    if tp < 1 or intermediate % tp:
        raise LayoutError(
            f"intermediate {intermediate} does not split into {tp} tensor-parallel shards",
            fix=f"choose a TP size that divides it ({', '.join(str(t) for t in (1, 2, 4, 8) if intermediate % t == 0)})",
        )
    local = intermediate // tp
    plan = plan_layer(fmt, backend, local, hidden, is_act_and_mul, is_gated, intermediate_alignment, hidden_alignment)
    tensors = {name: TensorPadding(name, m, itemsize_of(fmt, name)) for name, m in plan.maps().items()}
    return PaddingReport(fmt, backend, tp, intermediate, local, hidden, plan, experts, tensors)


# ----------------------------------------------------------------------------- provenance
def provenance_rows(
    m: IndexMap, coords: tuple[int, ...], itemsize: int = 1
) -> list[tuple[str, tuple, Optional[tuple]]]:
    """The chain for output element ``coords`` (in elements): ``[(stage, shape, coords | None)]``.

    First row is the output, last the checkpoint position (None when the element is padding).
    """
    byte_coords = tuple(coords[:-1]) + (coords[-1] * itemsize,)
    chain = m.provenance(byte_coords).in_elements(itemsize)
    return [(s.step, s.shape, s.coords) for s in chain.stages]


# ----------------------------------------------------------------------------- A/B
def chain_diff(a: IndexMap, b: IndexMap) -> list[tuple[str, Optional[str], Optional[str]]]:
    """The step chains of two maps side by side: ``[(op, step of a, step of b)]``.

    ``op`` is "same" (equal kind and parameters), "changed" (same kind, other parameters),
    "only A" or "only B"; steps are written ``kind(param=value, ...)``. The alignment is
    difflib's over the step kinds.
    """
    import difflib

    def text(step: IndexMap) -> str:
        return f"{step.kind}({', '.join(f'{k}={v}' for k, v in step.params.items())})"

    ka, kb = [s.kind for s in a.steps], [s.kind for s in b.steps]
    out: list[tuple[str, Optional[str], Optional[str]]] = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=ka, b=kb, autojunk=False).get_opcodes():
        if op == "equal":
            for sa, sb in zip(a.steps[i1:i2], b.steps[j1:j2]):
                out.append(("same" if sa.params == sb.params else "changed", text(sa), text(sb)))
        else:
            out += [("only A", text(s), None) for s in a.steps[i1:i2]]
            out += [("only B", None, text(s)) for s in b.steps[j1:j2]]
    return out


# ----------------------------------------------------------------------------- point and trace
def landing(m: IndexMap, coords: tuple[int, ...], itemsize: int = 1) -> Optional[tuple[int, ...]]:
    """Where input element ``coords`` (in ``m.in_shape`` elements) lands: its coordinates in
    ``m.out_shape`` elements, or None when ``m`` drops it. ``out[landing(x)] = in[x]``."""
    in_shape = m.in_shape[:-1] + (m.in_shape[-1] // itemsize,)
    if len(coords) != len(in_shape) or any(not 0 <= c < d for c, d in zip(coords, in_shape)):
        raise LayoutError(f"element {tuple(coords)} is outside {m.name}'s input {in_shape} elements")
    byte = int(np.ravel_multi_index(tuple(coords), in_shape)) * itemsize
    cell = int(memo(_destinations, m)[byte // m.cell_bytes])
    if cell < 0:
        return None
    out_byte = cell * m.cell_bytes + byte % m.cell_bytes
    out_shape = m.out_shape[:-1] + (m.out_shape[-1] // itemsize,)
    return tuple(int(v) for v in np.unravel_index(out_byte // itemsize, out_shape))


def _destinations(m: IndexMap) -> np.ndarray:
    """``(input cells,)``: the output cell each input cell of ``m`` is copied to (-1: dropped)."""
    return _taken_at(m.src.numpy(), m.n_in_cells, has_fill(m))


@dataclass(frozen=True)
class Cells:
    """What a point on one axes of a figure means (for clicks and hover, :func:`trace_cell`).

    ``side``: "kernel" (the axes shows ``m``'s output as :func:`display_2d` rows) or
    "checkpoint" (``m``'s input); ``itemsize``: bytes per element of the tensor ``m`` moves;
    ``shape``: the drawn grid ``(grid rows, grid columns)``; ``rows``: the row on ``side`` of
    each grid row (None: the same); ``values``: what each grid cell shows (None: nothing to
    read); ``scale``: grid cells per data unit ``(y, x)`` (a lines panel puts row p at
    ``y = p / n``); ``transpose``: data x is the grid row (an all-rows scatter: x = kernel
    row); ``x_range``: the data x this entry covers (several entries can share an axes);
    ``x_at``: the data x of a one-column grid (where its marker goes). A one-column grid is
    a row view: its column is 0. ``width``: on the kernel side, the grid's row length in
    elements when it is not the output's (a swizzled buffer drawn 16 wide): grid cell
    ``(i, j)`` is output element ``rows[i] * width + j`` in flat order.
    """

    side: str
    m: IndexMap
    itemsize: int
    shape: tuple[int, int]
    rows: Optional[np.ndarray] = None
    values: Optional[np.ndarray | Gathered] = None
    scale: tuple[float, float] = (1.0, 1.0)
    transpose: bool = False
    x_range: Optional[tuple[float, float]] = None
    x_at: Optional[float] = None
    width: Optional[int] = None
    meaning: str = "value"
    """What ``values`` are, as hover text names them: "value" only for decoded values (magnitudes, scales);
    an index panel names its index ("source row", "destination atom", ...)."""

    def locate(self, x: float, y: float) -> Optional[tuple[int, int, int, int]]:
        """``(grid row, grid column, row on side, column on side)`` at data ``(x, y)``, or None."""
        if self.x_range is not None and not self.x_range[0] <= x < self.x_range[1]:
            return None
        if not (np.isfinite(x) and np.isfinite(y)):
            return None
        gy, gx = (x, y) if self.transpose else (y, x)
        i = int(round(gy * self.scale[0]))
        j = 0 if self.shape[1] == 1 else int(round(gx * self.scale[1]))
        if not (0 <= i < self.shape[0] and 0 <= j < self.shape[1]):
            return None
        return i, j, (int(self.rows[i]) if self.rows is not None else i), j

    def place(self, trace: Trace) -> Optional[tuple[float, float]]:
        """Data ``(x, y)`` of ``trace``'s element on this grid's side, or None when it is not drawn here."""
        where = trace.kernel if self.side == "kernel" else trace.checkpoint
        if self.transpose or where is None:
            return None
        row, col = where
        if self.side == "kernel" and self.width:
            row, col = divmod(row * _out_elements(self.m, self.itemsize)[-1] + col, self.width)
        if self.rows is None:
            i = row
        else:
            hit = np.flatnonzero(self.rows == row)
            if not hit.size:
                return None
            i = int(hit[0])
        j = 0 if self.shape[1] == 1 else col
        if not (0 <= i < self.shape[0] and 0 <= j < self.shape[1]):
            return None
        x = self.x_at if self.shape[1] == 1 and self.x_at is not None else j / self.scale[1]
        return float(x), i / self.scale[0]

    def value(self, i: int, j: int) -> Optional[float]:
        """What grid cell ``(i, j)`` shows (None: nothing)."""
        return None if self.values is None else float(self.values[i, j])


@dataclass(frozen=True)
class Trace:
    """One element followed through a map: ``kernel`` (display-2-D ``(row, col)`` of the
    output, None when the input element is dropped), ``checkpoint`` (``(row, col)`` of the
    input, None for padding), ``chain`` (:func:`provenance_rows`: output first), ``side``
    (the side that was pointed at) and ``value`` (what the pointed cell shows)."""

    side: str
    kernel: Optional[tuple[int, int]]
    checkpoint: Optional[tuple[int, int]]
    chain: list
    value: Optional[float] = None
    meaning: str = "value"
    """What ``value`` is (:attr:`Cells.meaning`)."""
    width: Optional[int] = None
    """For a swizzled buffer (a :attr:`Cells.width` grid): the row length of ``kernel``, so that hover names the
    buffer offset ``kernel[0] * width + kernel[1]``, not a row of the kernel layout."""
    bits: Optional[list] = None
    """For a kernel byte whose plan has a word bit step after its byte map: the source of each of its
    8 bits after that step (:func:`word_bit_sources`), else None."""

    @property
    def moved_by(self) -> str:
        """The steps that moved this element (its position before and after differs), kernel side
        first; "padding (<step>)" when a step wrote it as fill."""
        moved = []
        for (_, _, after), (stage, _, before) in zip(self.chain, self.chain[1:]):
            name = stage.split(" of ", 1)[-1]
            if stage.startswith("fill of "):
                moved.append(f"padding ({name})")
            elif before != after:
                moved.append(name)
        return ", ".join(moved) or "no step (it stays in place)"

    def summary(self) -> str:
        """``kernel (r, c) <- checkpoint (r, c)`` (or ``padding``), one line."""
        k = "dropped" if self.kernel is None else f"kernel {self.kernel}"
        c = "padding" if self.checkpoint is None else f"checkpoint {self.checkpoint}"
        bits = "" if self.bits is None else f"; {bits_text(self.bits)}"
        return (f"{k} <- {c}" if self.side == "kernel" else f"{c} -> {k}") + bits

    def hover(self) -> str:
        """Row, column, value, source element and the steps that moved it (hover text)."""
        here = self.kernel if self.side == "kernel" else self.checkpoint
        if here is None:
            return self.summary()
        if self.value is None:
            value = ""
        elif self.meaning != "value":  # an index: a whole number, -1 for fill
            value = f", {self.meaning} {'fill' if self.value < 0 else int(self.value)}"
        else:
            value = ", value NaN" if np.isnan(self.value) else f", value {self.value:.4g}"
        at = f"{self.side} row {here[0]}, column {here[1]}"
        if self.side == "kernel" and self.width:
            at = f"kernel buffer offset {here[0] * self.width + here[1]}"
        return f"{at}{value}\n{self.summary()}\nmoved by: {self.moved_by}"


def _out_elements(m: IndexMap, itemsize: int) -> tuple[int, ...]:
    return m.out_shape[:-1] + (m.out_shape[-1] // itemsize,)


def trace_cell(cells: Cells, i: int, j: int) -> Trace:
    """Follow grid cell ``(i, j)`` of ``cells`` through its map: a kernel cell back to its
    checkpoint element (every step), a checkpoint cell to where it lands."""
    m, size = cells.m, cells.itemsize
    row = int(cells.rows[i]) if cells.rows is not None else i
    out_shape = _out_elements(m, size)
    cols = out_shape[-1]
    if cells.side == "kernel":
        coords = tuple(int(v) for v in np.unravel_index(row * (cells.width or cols) + j, out_shape))
    else:
        landed = landing(m, (row, j), size)
        if landed is None:
            return Trace("checkpoint", None, (row, j), [], cells.value(i, j), cells.meaning)
        coords = landed
    chain = provenance_rows(m, coords, size)
    flat = int(np.ravel_multi_index(coords, out_shape))
    src = chain[-1][2]
    ckpt = None if src is None else (int(src[0]), int(src[-1]))
    buffer_row = cols if cells.width else None  # a swizzled buffer: hover gives the flat offset
    return Trace(cells.side, divmod(flat, cols), ckpt, chain, cells.value(i, j), cells.meaning, buffer_row)


def word_bit_sources(m: IndexMap, bits: IndexMap, flat: int) -> list[tuple[Optional[tuple[int, int]], int]]:
    """Where each bit of kernel byte ``flat`` comes from when the word bit step ``bits`` (a ``(32,) ->
    (32,)`` map on one little-endian word) runs after the byte map ``m`` (1-byte elements).

    Bit ``b`` (0: least significant) of byte ``flat`` is bit ``t = 8 * (flat % 4) + b`` of word
    ``flat // 4``; it comes from bit ``s = bits.src[t]`` of that word, i.e. bit ``s % 8`` of byte
    ``g = 4 * (flat // 4) + s // 8`` of ``m``'s output, which ``m`` took from checkpoint byte
    :func:`provenance_rows` ``(m, g)`` (``steps.WordBitMap.source_bits`` for one byte). Returns 8
    ``((checkpoint row, column) or None for fill, bit)``, bit 0 first."""
    table = np.asarray(bits.src).reshape(-1)
    out_shape = _out_elements(m, 1)
    found: dict[int, Optional[tuple[int, int]]] = {}
    sources = []
    for b in range(8):
        s = int(table[8 * (flat % 4) + b])
        if s < 0:
            sources.append((None, -1))
            continue
        g = 4 * (flat // 4) + s // 8
        if g not in found:
            src = provenance_rows(m, tuple(int(v) for v in np.unravel_index(g, out_shape)), 1)[-1][2]
            found[g] = None if src is None else (int(src[0]), int(src[-1]))
        sources.append((found[g], s % 8))
    return sources


def with_word_bits(trace: Trace, m: IndexMap, bits: IndexMap) -> Trace:
    """``trace`` of a kernel byte of ``m`` with the source of each of its bits after ``bits``
    (:func:`word_bit_sources`)."""
    if trace.kernel is None:
        return trace
    cols = _out_elements(m, 1)[-1]
    return replace(trace, bits=word_bit_sources(m, bits, trace.kernel[0] * cols + trace.kernel[1]))


def bits_text(sources: list) -> str:
    """One line: per nibble of a kernel byte (low: bits 0-3, high: bits 4-7) the checkpoint byte and
    bit of each of its bits, from :func:`word_bit_sources`."""
    parts = []
    for name, lo in (("low nibble", 0), ("high nibble", 4)):
        bits = ", ".join("fill" if where is None else f"{where} bit {bit}" for where, bit in sources[lo : lo + 4])
        parts.append(f"{name} (bits {lo}-{lo + 3}) <- checkpoint {bits}")
    return "after the word bit step: " + "; ".join(parts)
