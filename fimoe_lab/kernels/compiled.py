"""The executable form of an index map: widest cells, word size, int32 sources, fill words.

Every executor (torch, Triton, numba) runs the same few numbers, computed once per map
by the layout side (:meth:`fimoe_lab.layout.IndexMap.compiled`) and kept in the map's
cache: the map coarsened to its widest cells (a whole row for a row permutation, 128
bytes for block-major-K, 4 bytes for a 128x4 scale swizzle), the widest machine word
(8, 4, 2 or 1 bytes) dividing a cell, the per-cell source index as int32 with fill
codes ``-1 - k`` kept, and the fast forms the compiler recognised. Executors read only
this form, never the map it came from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from fimoe_lab.errors import LayoutError

__all__ = [
    "ExecMap",
    "Strided",
    "word_dtype",
    "fill_word",
    "byte_view",
    "aligned_word",
    "through_stages",
    "row_form_fault",
]

_TORCH_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def word_dtype(word: int) -> torch.dtype:
    return _TORCH_WORDS[word]


def fill_word(byte: int, word: int) -> int:
    """The signed integer whose ``word`` bytes all equal ``byte`` (uint8 for one byte)."""
    if word == 1:
        return byte
    return int.from_bytes(bytes([byte]) * word, "little", signed=True)


_CELL_FIELDS = frozenset(("cell_bytes", "word", "n_in", "n_out", "src", "has_fill"))


@dataclass(frozen=True)
class Strided:
    """A map whose sources are an affine function of the output's mixed-radix digits: a strided view.

    Output cells of one expert form an array of shape ``shape`` (outermost first, row-major);
    in the box ``digit[d] < live[d]`` for every ``d``, cell ``(digit...)`` reads input cell
    ``offset + sum(digit[d] * strides[d])``; every other cell is fill code ``fill``. So the
    gather is ``out[:live] = as_strided(x, live, strides, offset)`` and a fill of the box's
    complement: strided copies any framework runs at bandwidth with nothing to compile
    (BlockMajorK is a permute of a view, the gated interleave and the epilogue row shuffle
    are permutes of row digits, the 128x4 scale swizzle is one too, padding is the box).
    """

    shape: tuple[int, ...]
    live: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    fill: int | None  # the fill code (-1 - k) of every cell outside the box; None when there is none


@dataclass(eq=False)
class ExecMap:
    """What an executor needs to run one map (per expert; identical for every expert).

    Per expert: ``out_cell[i] = in_cell[src[i]]`` for ``src[i] >= 0``, else every byte of
    output cell ``i`` is ``fills[-1 - src[i]]`` (0 where ``fills`` is empty: :attr:`fill_bytes`); cells are
    ``cell_bytes`` wide, ``n_in`` of them in the ``in_bytes`` of an expert's input, ``n_out`` in its ``out_bytes``
    of output (``n_out * cell_bytes == out_bytes``).

    ``swizzled_rows``: ``(source row or fill code per row int32, input row bytes C_in, 4-byte words per row
    cw, rows R, column fill code or -1)`` when the map is rows of 1-byte scales padded on the right (``C_in <=
    4 cw``), then the 128x4 scale swizzle: output word ``(band*cw + kk)*128 + 4*p + q`` is bytes ``4kk ..
    4kk+3`` of row ``band*128 + 32*q + p``; else None (``ends_swizzled``: the map's last step is that swizzle,
    known without looking). ``swizzle``: ``(rows, cw, R)`` of a ``swizzled_rows`` map of 4-byte cells and whole
    rows (``C_in = 4 cw``), moved as whole words. ``padrows``: ``(source row or fill code per output row
    int32, input row bytes, output row bytes, column fill code)`` when every output row is one input row
    padded on the right (or all fill), else None. The three are ``row_forms``, given or found by
    ``find_row_forms`` when an executor first reads one (the torch executor's strided copies read none, so
    a plan's first call does not look for them). ``strided``: the map as a strided view (:class:`Strided`)
    when it is one, else None. ``compile_inverse`` builds the executable form of the
    map's inverse (what in-place execution undoes a failure with); :meth:`inverse` calls
    it once.
    """

    name: str  # the map, for messages
    cell_bytes: int
    word: int  # widest word dividing cell_bytes (<= 8)
    n_in: int  # input cells per expert
    n_out: int  # output cells per expert
    src: np.ndarray  # int32 (n_out,), -1-k = fill k
    fills: tuple[int, ...]
    has_fill: bool
    in_bytes: int
    out_bytes: int
    is_permutation: bool  # every byte moves exactly once (no fill, same size)
    compile_inverse: Optional[Callable[[], ExecMap]] = field(default=None, repr=False)
    row_forms: tuple[tuple | None, tuple | None, tuple | None] | None = None  # (swizzle, padrows, swizzled_rows)
    find_row_forms: Optional[Callable[[], tuple[tuple | None, tuple | None, tuple | None]]] = field(
        default=None, repr=False
    )
    ends_swizzled: bool = False
    strided: Strided | None = None
    stages: tuple[ExecMap, ExecMap] | None = None
    _dev: dict = field(default_factory=dict, repr=False)

    @classmethod
    def on_read(
        cls,
        name: str,
        fills: tuple[int, ...],
        in_bytes: int,
        out_bytes: int,
        cells: Callable[[], dict],
        permutation: Callable[[], bool],
        compile_inverse: Optional[Callable[[], ExecMap]] = None,
    ) -> ExecMap:
        """An executable form whose cell fields (``cell_bytes``, ``word``, ``n_in``, ``n_out``, ``src``,
        ``has_fill``: ``cells()``) and ``is_permutation`` (``permutation()``) are found when one is first read:
        a map run as two strided stages never needs its own cells, a gather never asks whether it permutes."""
        em = cls.__new__(cls)
        em.__dict__.update(
            name=name,
            fills=fills,
            in_bytes=in_bytes,
            out_bytes=out_bytes,
            compile_inverse=compile_inverse,
            row_forms=None,
            find_row_forms=None,
            ends_swizzled=False,
            strided=None,
            stages=None,
            _dev={},
            _cells=cells,
            _permutation=permutation,
        )
        return em

    if not TYPE_CHECKING:  # at run time only: type checkers keep every other attribute checked

        def __getattr__(self, name: str):
            """A field of an :meth:`on_read` form, found on this first read (threads reading it at once each
            find the same values; the first stored stays). Fields given ahead (:meth:`preset_cells`) must be
            what the map's cells give."""
            held = self.__dict__
            if name == "is_permutation" and "_permutation" in held:
                found = held["_permutation"]()
                held.setdefault(name, found)
            elif name in _CELL_FIELDS and "_cells" in held:
                for key, value in held["_cells"]().items():
                    if key in held and key != "src" and held[key] != value:
                        raise LayoutError(f"internal: {self.name}: {key} {held[key]} was given, its cells give {value}")
                    held.setdefault(key, value)
            if name not in held:
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            return held[name]

    def sources_found(self) -> bool:
        """Whether ``src`` is known (given, or found by an earlier read): reading it then costs nothing."""
        return "src" in self.__dict__

    def known_cells(self) -> dict | None:
        """The cell fields but ``src`` when all are known (given ahead or found), else None; reads nothing."""
        held = self.__dict__
        keys = _CELL_FIELDS - {"src"}
        return {k: held[k] for k in sorted(keys)} if keys <= held.keys() else None

    def known_permutation(self) -> bool | None:
        """``is_permutation`` when known (given or found), else None; reads nothing."""
        return self.__dict__.get("is_permutation")

    def preset_cells(self, cells: dict) -> None:
        """Cell fields known without the map's index (not ``src``): read as given, checked when the index is."""
        if "src" in cells or not set(cells) <= _CELL_FIELDS:
            raise LayoutError(f"internal: {sorted(cells)} are not cell fields known ahead")
        self.__dict__.update(cells)

    def _row_forms(self) -> tuple[tuple | None, tuple | None, tuple | None]:
        if self.row_forms is None:
            self.row_forms = self.find_row_forms() if self.find_row_forms is not None else (None, None, None)
        return self.row_forms

    def row_forms_found(self) -> bool:
        """Whether the row forms have been looked for: reading one then costs nothing."""
        return self.row_forms is not None

    @property
    def swizzle(self) -> tuple | None:
        """The ``swizzle`` form (class docstring), found on first read."""
        return self._row_forms()[0]

    @property
    def padrows(self) -> tuple | None:
        """The ``padrows`` form (class docstring), found on first read."""
        return self._row_forms()[1]

    @property
    def swizzled_rows(self) -> tuple | None:
        """The ``swizzled_rows`` form (class docstring), found on first read."""
        return self._row_forms()[2]

    def inverse(self) -> ExecMap:
        """The executable form of the inverse map (compiled on first use, then cached here)."""
        if "inverse" not in self._dev:
            if self.compile_inverse is None:
                raise LayoutError(
                    f"{self.name}: this executable form carries no inverse", fix="compile it with IndexMap.compiled()"
                )
            self._dev["inverse"] = self.compile_inverse()
        return self._dev["inverse"]

    def transpose_lines(self) -> int | None:
        """``S`` when the map transposes its cells (block-major-K: output cell ``(kb, n)``, in
        lines of ``S = N`` cells, reads input cell ``(n, kb)``), found as: consecutive output
        cells 0 and 1 come from input cells apart, the input cell after output cell 0's is
        ``S`` output cells on, and ``S`` divides the output. Executors tile such maps in 2-D
        (runs of output cells in consecutive lines read runs of input cells). None
        otherwise; cached."""
        if "transpose lines" not in self._dev:
            src, n, found = self.src, self.n_out, None
            if n >= 4 and src[0] >= 0 and src[1] != src[0] + 1:
                hits = np.flatnonzero(src == src[0] + 1)
                if hits.size and n % int(hits[0]) == 0:
                    found = int(hits[0])
            self._dev["transpose lines"] = found
        return self._dev["transpose lines"]

    def bands_local(self) -> bool:
        """True for a ``swizzle`` map whose every output band of 128 rows reads only source
        rows of that band (``src_row[r] // 128 == r // 128``, no fill rows: the TRT-LLM row
        shuffle of W2 scales, 128 rows an epilogue tile). In place, a band is then read and
        written by one program with no exchange between bands; cached."""
        if "bands local" not in self._dev:
            local = False
            if self.swizzle is not None and self.is_permutation:
                rows = np.asarray(self.swizzle[0])
                local = bool(rows.size and (rows >= 0).all() and (rows // 128 == np.arange(rows.size) // 128).all())
            self._dev["bands local"] = local
        return self._dev["bands local"]

    def band_step(self) -> int:
        """``d > 0`` for a ``swizzle`` map whose output bands of 128 rows all read the first
        band's source rows shifted: ``src_row[128 * b + j] == src_row[j] + b * d`` for every
        band ``b`` (no fill rows; the TRT-LLM gate/up interleave: ``d = 64``, the W2 row
        shuffle: ``d = 128``). An executor then reads a 128-entry table, the same for every
        band (it stays in L1), instead of one entry an output row. 0 otherwise; cached."""
        if "band step" not in self._dev:
            step = 0
            if self.swizzle is not None:
                rows = np.asarray(self.swizzle[0], dtype=np.int64)
                if rows.size > 128 and rows.size % 128 == 0 and (rows >= 0).all():
                    d = int(rows[128] - rows[0])
                    bands = rows.reshape(-1, 128)
                    shift = np.arange(bands.shape[0], dtype=np.int64)[:, None] * d
                    if d > 0 and np.array_equal(bands, bands[0] + shift):
                        step = d
            self._dev["band step"] = step
        return self._dev["band step"]

    @property
    def fill_bytes(self) -> tuple[int, ...]:
        """The byte of each fill code ``-1 - k``: ``fills``, or ``(0,)`` for a map that lists none (its fill cells
        are zeros)."""
        return self.fills or (0,)

    def fill_byte(self, code: int) -> int:
        """The byte of fill code ``code`` (``-1 - k``: :attr:`fill_bytes` ``[k]``)."""
        return self.fill_bytes[-1 - code]

    def fill_words(self, word: int) -> np.ndarray:
        """One ``word``-byte word per fill code (its byte repeated); a 16-byte word as its 16 bytes."""
        if word == 16:
            return np.repeat(np.array(self.fill_bytes, dtype=np.uint8), 16)
        dt = {8: np.int64, 4: np.int32, 2: np.int16, 1: np.uint8}[word]
        return np.array([fill_word(b, word) for b in self.fill_bytes], dtype=dt)

    def src_on(self, device: torch.device) -> torch.Tensor:
        key = ("src", str(device))
        if key not in self._dev:
            self._dev[key] = torch.from_numpy(self.src).to(device)
        return self._dev[key]

    def fills_on(self, device: torch.device, word: int) -> torch.Tensor:
        key = ("fills", str(device), word)
        if key not in self._dev:
            self._dev[key] = torch.from_numpy(self.fill_words(word)).to(device)
        return self._dev[key]


_ROW_FORMS = {"swizzle": "swizzle rows", "padrows": "padded rows", "swizzled_rows": "swizzled rows"}
"""The row forms of :class:`ExecMap` and what their messages call them."""


def row_form_fault(kind: str, form: tuple, fills: int, in_bytes: int, out_bytes: int) -> Optional[str]:
    """Why the row form ``kind`` (:class:`ExecMap`) of a map with ``fills`` fill bytes, ``in_bytes -> out_bytes`` an
    expert, would have a kernel read or write outside its buffers, or None where its int32 ``rows`` cover the output
    exactly and each is a row of the input or a fill code ``-max(1, fills) <= rows[r] < 0``:

    - ``swizzle`` ``(rows, cw, R)``: ``cw >= 1``, ``R`` rows, ``4 cw R == out_bytes``, input rows of ``4 cw`` bytes;
    - ``padrows`` ``(rows, C_in, C_out, column fill code)``: ``0 < C_in <= C_out``, ``rows * C_out == out_bytes``,
      input rows of ``C_in`` bytes, the column fill code a fill code;
    - ``swizzled_rows`` ``(rows, C_in, cw, R, column fill code)``: ``0 < C_in <= 4 cw``, ``R`` rows, ``4 cw R ==
      out_bytes``, input rows of ``C_in`` bytes, the column fill code a fill code."""
    label, rows, sizes, fill = _ROW_FORMS[kind], np.asarray(form[0]), tuple(form[1:]), -max(1, fills)
    if rows.dtype != np.int32 or rows.ndim != 1:
        return f"{label} {rows.dtype} {rows.shape} are not one int32 row each"
    n = rows.size
    if kind == "swizzle":
        cw, r = sizes
        covers, row_bytes = cw > 0 and n == r and 4 * cw * r == out_bytes, 4 * cw
    elif kind == "padrows":
        c_in, c_out, code = sizes
        covers, row_bytes = 0 < c_in <= c_out and n * c_out == out_bytes and fill <= code < 0, c_in
    else:
        c_in, cw, r, code = sizes
        covers, row_bytes = 0 < c_in <= 4 * cw and n == r and 4 * cw * r == out_bytes and fill <= code < 0, c_in
    if not covers:
        return f"{label} {rows.dtype} {rows.shape} of {sizes} do not cover the output"
    if n and (int(rows.min()) < fill or int(rows.max()) >= in_bytes // row_bytes):
        return f"{label} span [{int(rows.min())}, {int(rows.max())}], outside [{fill}, {in_bytes // row_bytes})"
    return None


def byte_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``(E, ...)`` as an ``(E, bytes per expert)`` uint8 view (no copy)."""
    return x.reshape(x.shape[0], -1).view(torch.uint8)


def aligned_word(word: int, *tensors: torch.Tensor) -> int:
    """Largest word <= ``word`` (power of two) that divides every buffer's address."""
    while word > 1 and any(t.data_ptr() % word for t in tensors):
        word //= 2
    return word


def through_stages(
    em: ExecMap,
    x: torch.Tensor,
    out: torch.Tensor,
    run: Callable[[ExecMap, torch.Tensor, torch.Tensor], None],
    stage_bytes: int,
) -> None:
    """A map of two stages (``em.stages``) over ``(E, bytes)`` uint8 ``x`` and ``out``: ``mid = first(x)``, ``out =
    second(mid)``, each stage by ``run(stage, src, dst)``, per chunk of whole experts whose intermediate holds at most
    ``stage_bytes`` (at least one expert; the intermediate a new buffer, reused by every chunk)."""
    assert em.stages is not None
    first, second = em.stages
    per = max(1, stage_bytes // max(first.out_bytes, 1))
    mid = torch.empty((min(per, x.shape[0]), first.out_bytes), dtype=torch.uint8, device=x.device)
    for start in range(0, x.shape[0], per):
        stop = min(start + per, x.shape[0])
        run(first, x[start:stop], mid[: stop - start])
        run(second, mid[: stop - start], out[start:stop])
