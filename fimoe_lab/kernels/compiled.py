"""The executable form of an index map: widest cells, word size, int32 sources, fill words.

Every executor (torch, Triton, numba) runs the same few numbers, computed once per map
and kept in the map's cache: the map coarsened to its widest cells (a whole row for a
row permutation, 128 bytes for block-major-K, 4 bytes for a 128x4 scale swizzle), the
widest machine word (8, 4, 2 or 1 bytes) dividing a cell, the per-cell source index as
int32 with fill codes ``-1 - k`` kept, and each fill byte repeated over one word.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["ExecMap", "exec_form", "word_dtype", "fill_word", "byte_views"]

_TORCH_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def word_dtype(word: int) -> torch.dtype:
    return _TORCH_WORDS[word]


def fill_word(byte: int, word: int) -> int:
    """The signed integer whose ``word`` bytes all equal ``byte`` (uint8 for one byte)."""
    if word == 1:
        return byte
    return int.from_bytes(bytes([byte]) * word, "little", signed=True)


@dataclass(eq=False)
class ExecMap:
    """What an executor needs to run one map (per expert; identical for every expert)."""

    cell_bytes: int
    word: int  # widest word dividing cell_bytes (<= 8)
    n_in: int  # input cells per expert
    n_out: int  # output cells per expert
    src: np.ndarray  # int32 (n_out,), -1-k = fill k
    fills: tuple[int, ...]
    has_fill: bool
    in_bytes: int
    out_bytes: int
    swizzle: tuple | None = None  # (source row per output row int32, words per row, rows) or None
    padrows: tuple | None = None  # (source row per output row int32, in row bytes, out row bytes, col fill code)
    _dev: dict = field(default_factory=dict, repr=False)

    def fill_words(self, word: int) -> np.ndarray:
        dt = {8: np.int64, 4: np.int32, 2: np.int16, 1: np.uint8}[word]
        vals = [fill_word(b, word) for b in self.fills] or [0]
        return np.array(vals, dtype=dt)

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


def exec_form(m) -> ExecMap:
    """The :class:`ExecMap` of ``m`` (cached on the map)."""
    cached = m._cache.get("exec")
    if cached is not None:
        return cached
    c = m.coarsened()
    word = next(w for w in (8, 4, 2, 1) if c.cell_bytes % w == 0)
    if c.n_in_cells >= 2**31 or c.n_out_cells >= 2**31:
        raise ValueError(f"{m.name}: more than 2**31 cells per expert")
    src = c.src.numpy().astype(np.int32)
    e = ExecMap(c.cell_bytes, word, c.n_in_cells, c.n_out_cells, src, tuple(c.fills), bool((src < 0).any()),
                m.in_bytes, m.out_bytes)
    e.swizzle = _swizzle_form(m, e)
    e.padrows = _padded_rows_form(m, e)
    m._cache["exec"] = e
    return e


def byte_views(x: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` and ``out`` as ``(E, bytes per expert)`` uint8 views (no copy)."""
    e = x.shape[0]
    return x.reshape(e, -1).view(torch.uint8), out.reshape(e, -1).view(torch.uint8)


def aligned_word(word: int, *tensors: torch.Tensor) -> int:
    """Largest word <= ``word`` (power of two) that divides every buffer's address."""
    while word > 1 and any(t.data_ptr() % word for t in tensors):
        word //= 2
    return word


def swizzle_rows(em: ExecMap):
    """``(rows, words_per_row, n_rows)`` when ``em`` is a row gather then the 128x4 swizzle."""
    return em.swizzle


def _swizzle_form(m, em: ExecMap):
    """Recognise ``rows >> swizzle_scales_128x4`` (1-byte scales, no swizzle padding).

    Returns the source row of every output row (fill codes of ``em.fills``), the
    4-byte words per row and the row count, after checking that this form reproduces
    the map's cells exactly; else None (the generic path runs).
    """
    from fimoe_lab.layout import compose

    steps = m.steps
    last = steps[-1]
    if em.cell_bytes != 4 or last.kind != "swizzle_scales_128x4" or last.cell_bytes != 1:
        return None
    if len(last.in_shape) != 2 or last.in_shape != last.out_shape:
        return None
    rows_n, cols = last.in_shape
    if rows_n % 128 or cols % 4:
        return None
    if len(steps) == 1:
        rows = np.arange(rows_n, dtype=np.int64)
        pre_fills: tuple = ()
    else:
        pre = compose(*steps[:-1])
        if pre.out_shape != (rows_n, cols) or len(pre.in_shape) != 2 or pre.in_shape[1] != cols:
            return None
        pc = pre.coarsened()
        if pc.cell_bytes % cols:
            return None
        rows = pc.refined(cols).src.numpy()
        pre_fills = pre.fills
    # fill codes of the row map -> codes of em.fills
    if (rows < 0).any():
        remap = np.array([-1 - em.fills.index(b) for b in pre_fills], dtype=np.int64)
        rows = np.where(rows >= 0, rows, remap[np.maximum(-1 - rows, 0)])
    cw = cols // 4
    o = np.arange(rows_n * cw, dtype=np.int64)
    band, rem = np.divmod(o, 128 * cw)
    kk, pq = np.divmod(rem, 128)
    r = band * 128 + (pq % 4) * 32 + pq // 4
    s = rows[r]
    implied = np.where(s >= 0, s * cw + kk, s)
    if implied.shape != em.src.shape or not np.array_equal(implied, em.src):
        return None
    return rows.astype(np.int32), cw, rows_n


def _padded_rows_form(m, em: ExecMap):
    """Recognise a row gather whose rows are padded on the right (``[R_in, C_in] ->
    [R_out, C_out]``, ``C_out > C_in``): each output row is one input row followed by
    fill, or all fill. Returns ``(source row or fill code per output row, C_in, C_out,
    column fill code)`` or None. Such maps coarsen to small cells (gcd of the widths);
    this form lets the executor move whole rows instead.
    """
    if not em.has_fill or len(m.in_shape) != 2 or len(m.out_shape) != 2:
        return None
    (r_in, c_in), (r_out, c_out) = m.in_shape, m.out_shape
    c = em.cell_bytes
    if c_out <= c_in or c_in % c or c_out % c:
        return None
    k_in, k_out = c_in // c, c_out // c
    grid = em.src.astype(np.int64).reshape(r_out, k_out)
    head, tail = grid[:, :k_in], grid[:, k_in:]
    fill_row = head[:, 0] < 0
    code = tail[~fill_row]
    if code.size and (code.min() != code.max() or code.max() >= 0):
        return None
    col_code = int(code.flat[0]) if code.size else -1
    if (grid[fill_row] != grid[fill_row, :1]).any():
        return None
    live = head[~fill_row]
    if live.size and ((live[:, :1] % k_in).any() or (live != live[:, :1] + np.arange(k_in)).any()):
        return None
    rows = np.where(fill_row, head[:, 0], head[:, 0] // k_in)
    if rows.max(initial=-1) >= r_in:
        return None
    return rows.astype(np.int32), c_in, c_out, col_code
