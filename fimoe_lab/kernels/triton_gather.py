"""The GPU executor: one Triton launch gathers every expert's cells.

Grid: (output-cell blocks, experts). Cells of 16 bytes or more run the 2-D kernel: a
tile of ``BM`` output cells by ``BW`` 4-byte words, where each row of the tile is one
contiguous run of its source cell, so loads and stores are 16-byte vectors. Smaller
cells (the 128x4 scale swizzle moves 4-byte cells) run the 1-D kernel over output
words. Fill cells (``src < 0``) take their fill word from a tiny table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fimoe_lab.kernels.compiled import ExecMap, aligned_word, byte_views, word_dtype

# Tile sizes, chosen on the H200 (benchmarks/RESULTS.md); override for sweeps.
CONFIG = {"tile_words": 4096, "num_warps": 8, "block_1d": 2048, "warps_1d": 4, "max_bw": 1024}


@triton.jit
def _gather_rows(x_ptr, out_ptr, src_ptr, fill_ptr, n_in, n_out,
                 W: tl.constexpr, BM: tl.constexpr, BW: tl.constexpr, HAS_FILL: tl.constexpr):
    pid = tl.program_id(0)
    e = tl.program_id(1).to(tl.int64)
    rows = pid * BM + tl.arange(0, BM)
    rmask = rows < n_out
    s = tl.load(src_ptr + rows, mask=rmask, other=0)
    xb = x_ptr + e * n_in * W
    ob = out_ptr + e * n_out * W
    if HAS_FILL:
        valid = s >= 0
        fw = tl.load(fill_ptr + tl.maximum(-1 - s, 0), mask=rmask, other=0)
        s = tl.maximum(s, 0)
    in_row = s.to(tl.int64) * W
    out_row = rows.to(tl.int64) * W
    for w0 in range(0, W, BW):
        cols = w0 + tl.arange(0, BW)
        m = rmask[:, None]
        if HAS_FILL:
            v = tl.load(xb + in_row[:, None] + cols[None, :], mask=m & valid[:, None])
            v = tl.where(valid[:, None], v, fw[:, None])
        else:
            v = tl.load(xb + in_row[:, None] + cols[None, :], mask=m)
        tl.store(ob + out_row[:, None] + cols[None, :], v, mask=m)


@triton.jit
def _gather_words(x_ptr, out_ptr, src_ptr, fill_ptr, n_in, n_out,
                  W: tl.constexpr, B: tl.constexpr, HAS_FILL: tl.constexpr):
    pid = tl.program_id(0)
    e = tl.program_id(1).to(tl.int64)
    j = pid * B + tl.arange(0, B)
    m = j < n_out * W
    cell = j // W
    s = tl.load(src_ptr + cell, mask=m, other=0)
    if HAS_FILL:
        valid = s >= 0
        fw = tl.load(fill_ptr + tl.maximum(-1 - s, 0), mask=m, other=0)
        s = tl.maximum(s, 0)
        v = tl.load(x_ptr + e * n_in * W + s * W + j % W, mask=m & valid)
        v = tl.where(valid, v, fw)
    else:
        v = tl.load(x_ptr + e * n_in * W + s * W + j % W, mask=m)
    tl.store(out_ptr + e * n_out * W + j, v, mask=m)


def _pow2_divisor(n: int, cap: int) -> int:
    p = 1
    while p * 2 <= cap and n % (p * 2) == 0:
        p *= 2
    return p


def gather_triton(em: ExecMap, x: torch.Tensor, out: torch.Tensor, config: dict | None = None) -> None:
    """``out[e, i] = x[e, src[i]]`` (or fill) for every expert, one launch."""
    cfg = dict(CONFIG, **(config or {}))
    experts = x.shape[0]
    if experts == 0 or em.out_bytes == 0:
        return
    if experts > 65535:
        for s in range(0, experts, 65535):
            gather_triton(em, x[s:s + 65535], out[s:s + 65535], config)
        return
    xb, ob = byte_views(x, out)
    # 4-byte words: four to a 16-byte vector; 2/1-byte words for odd cells.
    word = aligned_word(min(em.word, 4), xb, ob)
    xw, ow = xb.view(word_dtype(word)), ob.view(word_dtype(word))
    wpc = em.cell_bytes // word
    src = em.src_on(x.device)
    fills = em.fills_on(x.device, word)
    if em.cell_bytes >= 16 and wpc >= 4:
        bw = _pow2_divisor(wpc, cfg["max_bw"])
        bm = max(1, min(cfg["tile_words"] // bw, triton.next_power_of_2(em.n_out)))
        grid = (triton.cdiv(em.n_out, bm), experts)
        _gather_rows[grid](xw, ow, src, fills, em.n_in, em.n_out, W=wpc, BM=bm, BW=bw,
                           HAS_FILL=em.has_fill, num_warps=cfg["num_warps"])
    else:
        b = min(cfg["block_1d"], triton.next_power_of_2(em.n_out * wpc))
        grid = (triton.cdiv(em.n_out * wpc, b), experts)
        _gather_words[grid](xw, ow, src, fills, em.n_in, em.n_out, W=wpc, B=b,
                            HAS_FILL=em.has_fill, num_warps=cfg["warps_1d"])
