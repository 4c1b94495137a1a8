"""The CPU executor: a parallel numba loop over (expert, output cell), moving words.

One ``prange`` covers every cell of every expert (no Python loop per expert or row);
each cell moves as a run of 8-, 4-, 2- or 1-byte words, which LLVM turns into vector
copies. Compiled on first use (cached on disk next to this module).
"""

from __future__ import annotations

import torch
from numba import njit, prange

from fimoe_lab.kernels.compiled import ExecMap, aligned_word, byte_views, word_dtype


@njit(parallel=True, cache=True, nogil=True)
def _gather(x, out, src, fills):  # pragma: no cover - compiled
    experts, n_out, w = out.shape
    total = experts * n_out
    for t in prange(total):
        e = t // n_out
        i = t - e * n_out
        s = src[i]
        if s >= 0:
            for k in range(w):
                out[e, i, k] = x[e, s, k]
        else:
            f = fills[-1 - s]
            for k in range(w):
                out[e, i, k] = f


@njit(parallel=True, cache=True, nogil=True)
def parallel_copy(x, out):  # pragma: no cover - compiled
    """``out[:] = x`` over 1-D arrays with every thread: the memcpy ceiling of the benchmark."""
    n = x.size
    chunk = 1 << 16
    for c in prange((n + chunk - 1) // chunk):
        lo = c * chunk
        hi = min(lo + chunk, n)
        out[lo:hi] = x[lo:hi]


def gather_numba(em: ExecMap, x: torch.Tensor, out: torch.Tensor) -> None:
    """``out[e, i] = x[e, src[i]]`` (or fill) for every expert of CPU tensors."""
    experts = x.shape[0]
    if experts == 0 or em.out_bytes == 0:
        return
    xb, ob = byte_views(x, out)
    word = aligned_word(em.word, xb, ob)
    wpc = em.cell_bytes // word
    dt = word_dtype(word)
    xa = xb.view(dt).numpy().reshape(experts, em.n_in, wpc)
    oa = ob.view(dt).numpy().reshape(experts, em.n_out, wpc)
    _gather(xa, oa, em.src, em.fill_words(word))


def numba_threads() -> int:
    import numba

    return numba.get_num_threads()

