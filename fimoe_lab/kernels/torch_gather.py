"""The portable executor: strided copies where the map is a strided view, else ``index_select``.

A map of the strided form (:class:`~fimoe_lab.kernels.compiled.Strided`: BlockMajorK, the
gated interleave, the epilogue row shuffle, the W13 -> W31 swap, the 128x4 scale swizzle and
their compositions, padded in a box), or of two such stages (``ExecMap.stages``, through an
intermediate of at most :data:`STAGE_BYTES`), runs as strided copies of 16-byte words (``complex128``:
torch moves them as they are, bit for bit), about 0.95 of a copy's bandwidth on an H200 from
the first call, with nothing to compile (benchmarks/RESULTS.md). Any other map runs as one
``index_select`` over the widest word the map allows: a batched gather on bytes reaches about
a tenth of copy bandwidth on an H200; on 8-byte words of rows that move whole, most of it
(DESIGN §7).

In place (:func:`inplace_strided`): a chunk of experts is copied aside, then strided-copied back
into place; every byte crosses memory twice.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import torch

from fimoe_lab.kernels.compiled import ExecMap, Strided, aligned_word, byte_view, fill_word, through_stages, word_dtype

__all__ = ["gather_torch", "cell_views", "inplace_strided", "strided_word"]

_STRIDED_WORDS = {16: torch.complex128, 8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
"""Word types of the strided copies: 16-byte words move as ``complex128`` (copied, never computed on)."""


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


STAGE_BYTES = 1 << 25
"""Most bytes of the intermediate a map run as two strided stages holds (whole experts, at least one)."""


def gather_torch(em: ExecMap, x: torch.Tensor, out: torch.Tensor) -> None:
    """``out[e, i] = x[e, src[i]]`` for all experts, then the fill cells."""
    if em.strided is not None:
        _gather_strided(em, x, out)
        return
    if em.stages is not None:
        through_stages(em, byte_view(x), byte_view(out), _gather_strided, STAGE_BYTES)
        return
    xin, xout = cell_views(em, x, out)
    src = _index(em, ("gather_idx",), lambda: np.maximum(em.src, 0), x.device)
    torch.index_select(xin, 1, src, out=xout)
    for k, byte in enumerate(em.fill_bytes if em.has_fill else ()):
        idx = _index(em, ("fill_idx", k), lambda k=k: np.flatnonzero(em.src == -1 - k), x.device)
        if idx.numel():
            xout.index_fill_(1, idx, fill_word(byte, xout.element_size()))


# ============================================================================ strided form
def strided_word(em: ExecMap, *tensors: torch.Tensor) -> int:
    """The widest word (up to 16 bytes) dividing the cell, every buffer's address and its offset in
    its storage (a view as wider words needs both)."""
    word = 16 if em.cell_bytes % 16 == 0 else em.word
    for t in tensors:
        where = t.data_ptr() | t.storage_offset() * t.element_size()
        while where % word:
            word //= 2
    return word


def _words(t: torch.Tensor, word: int) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat tensor of ``word``-byte words (no copy)."""
    flat = t.view(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    dtype = _STRIDED_WORDS[word]
    return flat if dtype == torch.uint8 else flat.view(dtype)


class _Pieces:
    """The strided copies of a :class:`Strided` form in ``word``-byte words, per expert: per piece the
    source view's and the output view's offsets (an output digit of negative stride is fixed to each of its
    values, one piece each), their common sizes and each side's strides (words); and the box's complement
    as slabs, each ``(sizes, strides, offset)`` of the output (slab ``d``: digits before ``d`` live, digit
    ``d`` past its live range, the rest whole)."""

    def __init__(self, st: Strided, cell_words: int):
        neg = [d for d, s in enumerate(st.strides) if s < 0]
        keep = [d for d in range(len(st.shape)) if d not in neg]
        out_strides = [cell_words] * len(st.shape)
        for d in range(len(st.shape) - 2, -1, -1):
            out_strides[d] = out_strides[d + 1] * st.shape[d + 1]
        self.sizes = tuple(st.live[d] for d in keep) + (cell_words,)
        self.strides = tuple(st.strides[d] * cell_words for d in keep) + (1,)
        self.out_strides = tuple(out_strides[d] for d in keep) + (1,)
        self.pieces: list[tuple[int, int]] = []  # (source offset, output offset), words
        for values in itertools.product(*(range(st.live[d]) for d in neg)):
            fixed = dict(zip(neg, values))
            offset = st.offset + sum(v * st.strides[d] for d, v in fixed.items())
            self.pieces.append((offset * cell_words, sum(v * out_strides[d] for d, v in fixed.items())))
        self.slabs = [
            (
                tuple(st.live[:d]) + (st.shape[d] - st.live[d],) + tuple(st.shape[d + 1 :]) + (cell_words,),
                tuple(out_strides) + (1,),
                st.live[d] * out_strides[d],
            )
            for d in range(len(st.shape))
            if st.live[d] < st.shape[d]
        ]
        self._views: dict[tuple[int, int, int], tuple[tuple[int, ...], ...]] = {}

    def views(self, experts: int, in_words: int, out_words: int) -> tuple[tuple[int, ...], ...]:
        """``(size, source strides, output strides)`` of every piece over ``experts`` experts of ``in_words`` and
        ``out_words`` words each (kept: a model's layers ask the same)."""
        key = (experts, in_words, out_words)
        if key not in self._views:
            self._views[key] = (
                (experts,) + self.sizes,
                (in_words,) + self.strides,
                (out_words,) + self.out_strides,
            )
        return self._views[key]


def _pieces(em: ExecMap, word: int) -> _Pieces:
    key = ("strided pieces", word)
    if key not in em._dev:
        assert em.strided is not None
        em._dev[key] = _Pieces(em.strided, em.cell_bytes // word)
    return em._dev[key]


def _box_copy(p: _Pieces, xw: torch.Tensor, experts: int, ow: torch.Tensor) -> None:
    """The live box: the flat output words ``ow`` of ``experts`` experts from their flat input words ``xw``, one
    ``as_strided`` pair and one copy per piece."""
    size, in_strides, out_strides = p.views(experts, xw.numel() // max(experts, 1), ow.numel() // max(experts, 1))
    x0, o0 = xw.storage_offset(), ow.storage_offset()
    for src, dst in p.pieces:
        ow.as_strided(size, out_strides, o0 + dst).copy_(xw.as_strided(size, in_strides, x0 + src))


def _fill_box_complement(em: ExecMap, out: torch.Tensor, word: int) -> None:
    st = em.strided
    assert st is not None and st.fill is not None
    fw = min(word, 8)
    p = _pieces(em, fw)
    ow = _words(out, fw)
    experts = out.shape[0]
    per, base = ow.numel() // max(experts, 1), ow.storage_offset()
    # copied from one word expanded over each slab (stride 0), not ``Tensor.fill_``: on CUDA the first
    # ``fill_`` of a process loads another kernel module (about 10-15 ms on an H200), while this runs the
    # copy kernel the strided copies have loaded; the word reaches the device by a host copy, not a fill
    key = ("fill word", fw, str(out.device))
    if key not in em._dev:
        word_t = torch.tensor([fill_word(em.fill_byte(st.fill), fw)], dtype=ow.dtype)
        em._dev[key] = word_t.to(out.device)
    one = em._dev[key]
    for sizes, strides, offset in p.slabs:
        shape = (experts,) + sizes
        ow.as_strided(shape, (per,) + strides, base + offset).copy_(one.expand(shape))


def _gather_strided(em: ExecMap, x: torch.Tensor, out: torch.Tensor) -> None:
    word = strided_word(em, x, out)
    p = _pieces(em, word)
    _box_copy(p, _words(x, word), x.shape[0], _words(out, word))
    if p.slabs:
        _fill_box_complement(em, out, word)


def inplace_strided(em: ExecMap, flat: torch.Tensor, scratch_experts: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Permute every expert of ``flat`` ``(E, bytes)`` in place, ``scratch_experts`` at a time: copy the
    chunk to the scratch (a contiguous copy), then strided-copy it back into place. Yields the leading
    experts done after each chunk; if a copy raises, the chunk in flight is copied back from the
    scratch first (as :func:`~fimoe_lab.kernels.copy_then_gather.copy_then_gather`). The views of a
    chunk are made once (a few calls a chunk: the host keeps ahead of the device)."""
    experts, nbytes = flat.shape
    scratch = torch.empty((scratch_experts, nbytes), dtype=torch.uint8, device=flat.device)
    word = strided_word(em, flat, scratch)
    p = _pieces(em, word)
    words = nbytes // word
    xw = _words(flat, word).view(experts, words)
    sw = _words(scratch, word).view(scratch_experts, words)
    views: dict[int, list[tuple[torch.Tensor, tuple, tuple, int]]] = {}
    for start in range(0, experts, scratch_experts):
        n = min(scratch_experts, experts - start)
        if n not in views:  # (source piece on the scratch, output piece's size, stride, offset at start 0)
            views[n] = [
                (
                    sw.as_strided((n,) + p.sizes, (words,) + p.strides, sw.storage_offset() + src),
                    (n,) + p.sizes,
                    (words,) + p.out_strides,
                    xw.storage_offset() + dst,
                )
                for src, dst in p.pieces
            ]
        part = xw[start : start + n]
        sw[:n].copy_(part)
        try:
            _pieces_back(xw, views[n], start * words, _strided_copy)
        except BaseException:
            part.copy_(sw[:n])
            raise
        yield start + n, scratch


def _pieces_back(xw: torch.Tensor, views: list, shift: int, copy) -> None:
    """Each source piece into its output piece shifted ``shift`` words into ``xw``."""
    for src, size, stride, offset in views:
        copy(xw.as_strided(size, stride, offset + shift), src)


def _strided_copy(out: torch.Tensor, src: torch.Tensor) -> None:
    out.copy_(src)
