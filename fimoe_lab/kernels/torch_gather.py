"""The portable executor: one ``index_select`` over the widest word the map allows.

A batched gather on bytes reaches about a tenth of copy bandwidth on an H200; the
same gather on 8-byte words of rows that move whole reaches most of it (DESIGN §7).
So the map is first coarsened to its widest cells, then viewed as words of 8, 4, 2 or
1 bytes, whichever divides the cell and the buffers' alignment.
"""

from __future__ import annotations

import math

import torch

from fimoe_lab.kernels.compiled import aligned_word, fill_word, word_dtype


def cell_views(m, x: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as ``(E, n_in_cells, words)`` and ``out`` as ``(E, n_out_cells, words)``."""
    w = aligned_word(math.gcd(m.cell_bytes, 8), x, out)
    e = x.shape[0]
    xin = x.view(torch.uint8).reshape(e, m.n_in_cells, m.cell_bytes).view(word_dtype(w))
    xout = out.view(torch.uint8).reshape(e, m.n_out_cells, m.cell_bytes).view(word_dtype(w))
    return xin, xout


def gather_torch(m, x: torch.Tensor, out: torch.Tensor) -> None:
    """``out[e, i] = x[e, src[i]]`` for all experts, then the fill cells."""
    m = m.coarsened()
    xin, xout = cell_views(m, x, out)
    key = ("gather_idx", str(x.device))
    if key not in m._cache:
        m._cache[key] = m.src.clamp(min=0).to(x.device)
    torch.index_select(xin, 1, m._cache[key], out=xout)
    for k, byte in enumerate(m.fills):
        key = ("fill_idx", k, str(x.device))
        if key not in m._cache:
            m._cache[key] = torch.nonzero(m.src == -1 - k).flatten().to(x.device)
        idx = m._cache[key]
        if idx.numel():
            xout.index_fill_(1, idx, fill_word(byte, xout.element_size()))
