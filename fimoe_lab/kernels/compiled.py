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
    _dev: dict = field(default_factory=dict, repr=False)

    @property
    def words_per_cell(self) -> int:
        return self.cell_bytes // self.word

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
