"""The portable executor: one ``index_select`` over the widest word the map allows.

A batched gather on bytes reaches about a tenth of copy bandwidth on an H200; the
same gather on 8-byte words of rows that move whole reaches most of it (DESIGN §7).
So the executable form's widest cells are viewed as words of 8, 4, 2 or 1 bytes,
whichever divides the cell and the buffers' alignment.
"""

from __future__ import annotations

import numpy as np
import torch

from fimoe_lab.kernels.compiled import ExecMap, aligned_word, fill_word, word_dtype


def cell_views(em: ExecMap, x: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as ``(E, n_in, words)`` and ``out`` as ``(E, n_out, words)``."""
    w = aligned_word(em.word, x, out)
    e = x.shape[0]
    xin = x.view(torch.uint8).reshape(e, em.n_in, em.cell_bytes).view(word_dtype(w))
    xout = out.view(torch.uint8).reshape(e, em.n_out, em.cell_bytes).view(word_dtype(w))
    return xin, xout


def _index(em: ExecMap, key: tuple, make, device: torch.device) -> torch.Tensor:
    """An int64 index built by ``make()`` from ``em.src``, on ``device`` (cached on ``em``)."""
    key = key + (str(device),)
    if key not in em._dev:
        em._dev[key] = torch.from_numpy(make().astype(np.int64)).to(device)
    return em._dev[key]


def gather_torch(em: ExecMap, x: torch.Tensor, out: torch.Tensor) -> None:
    """``out[e, i] = x[e, src[i]]`` for all experts, then the fill cells."""
    xin, xout = cell_views(em, x, out)
    src = _index(em, ("gather_idx",), lambda: np.maximum(em.src, 0), x.device)
    torch.index_select(xin, 1, src, out=xout)
    for k, byte in enumerate(em.fills):
        idx = _index(em, ("fill_idx", k), lambda k=k: np.flatnonzero(em.src == -1 - k), x.device)
        if idx.numel():
            xout.index_fill_(1, idx, fill_word(byte, xout.element_size()))
