"""A slow, per-expert re-creation of the reference module, written for the tests only.

Index formulas are spelled out as Python loops (not our steps); each composite walks
the reference's code path expert by expert. The tests compare the batched index-map
implementation with this.
"""

from __future__ import annotations

import torch


def shuffle_idx(m: int, epilogue_tile_m: int) -> list[int]:
    block = 32 if epilogue_tile_m % 128 == 0 else 16
    k = block // 8
    return [(i // block) * block + (i % block % 8) * k + (i % block) // 8 for i in range(m)]


def interleave_idx(m: int) -> list[int]:
    return [j // 2 + (m // 2 if j % 2 else 0) for j in range(m)]


def rows(x: torch.Tensor, idx: list[int]) -> torch.Tensor:
    return torch.stack([x[i] for i in idx])


def swap(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-2] // 2
    return torch.cat([x[..., half:, :], x[..., :half, :]], dim=-2)


def swizzle(s: torch.Tensor) -> torch.Tensor:
    """One expert's (R, C) scales -> flat 128x4-swizzled buffer, element by element."""
    r_n, c_n = s.shape
    rp, cp = -(-r_n // 128) * 128, -(-c_n // 4) * 4
    out = torch.zeros(rp * cp, dtype=s.dtype)
    for r in range(r_n):
        for c in range(c_n):
            off = (r // 128) * (cp // 4) * 512 + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
            out[off] = s[r, c]
    return out


def pad(x: torch.Tensor, projections: int, rows_out: int, cols_out: int, fill: int = 0) -> torch.Tensor:
    """Per expert: each of ``projections`` row blocks padded on its own."""
    e, r, c = x.shape
    block = r // projections
    out = torch.full((e, projections * rows_out, cols_out), fill, dtype=torch.uint8)
    xb = x.view(torch.uint8)
    for i in range(e):
        for p in range(projections):
            out[i, p * rows_out : p * rows_out + block, : c * x.element_size()] = xb[i, p * block : (p + 1) * block]
    return out.view(x.dtype)


def block_layout(x: torch.Tensor, block_bytes: int = 128) -> torch.Tensor:
    m, k = x.shape
    return x.reshape(m, k // block_bytes, block_bytes).permute(1, 0, 2).contiguous()


def per_expert(x: torch.Tensor, fn) -> torch.Tensor:
    return torch.stack([fn(x[i].view(torch.uint8)) for i in range(x.shape[0])])


def rotate_fp8(w13, w2, gated):
    def g1(x):
        x = rows(x, interleave_idx(x.shape[0])) if gated else x
        return rows(x, shuffle_idx(x.shape[0], 128))

    return per_expert(w13, g1).view(w13.dtype), per_expert(w2, lambda x: rows(x, shuffle_idx(x.shape[0], 128))).view(
        w2.dtype
    )


def bf16_block_layout(w13, w2, gated):
    def g1(x):
        if gated:
            x = rows(swap(x), interleave_idx(x.shape[0]))
        return block_layout(rows(x, shuffle_idx(x.shape[0], 128)))

    def g2(x):
        return block_layout(rows(x, shuffle_idx(x.shape[0], 128)))

    return per_expert(w13, g1).view(torch.bfloat16), per_expert(w2, g2).view(torch.bfloat16)


def deepseek_shuffle(w13, w2):
    def f(x):
        return block_layout(rows(x, shuffle_idx(x.shape[0], 64)))

    return per_expert(w13, f), per_expert(w2, f)


def mxfp8_shuffle(w13, w2, s13, s2, gated):
    def weight(x, inter):
        x = rows(x, interleave_idx(x.shape[0])) if inter else x
        return rows(x, shuffle_idx(x.shape[0], 128))

    def scale(s, inter):
        return swizzle(weight(s, inter)).reshape(s.shape)

    return (
        per_expert(w13, lambda x: weight(x, gated)),
        per_expert(w2, lambda x: weight(x, False)),
        torch.stack([scale(s13[i], gated) for i in range(s13.shape[0])]),
        torch.stack([scale(s2[i], False) for i in range(s2.shape[0])]),
    )


def nvfp4_trtllm(w13, w2, s13, s2, gated):
    """Packed FP4 bytes and E4M3 scale bytes: swap, interleave, shuffle, swizzle."""

    def weight(x, fused):
        if fused:
            x = rows(swap(x), interleave_idx(x.shape[0])) if gated else x
        return rows(x, shuffle_idx(x.shape[0], 128))

    def scale(s, fused):
        return swizzle(weight(s, fused)).reshape(s.shape)

    return (
        per_expert(w13, lambda x: weight(x, True)),
        per_expert(w2, lambda x: weight(x, False)),
        torch.stack([scale(s13[i].view(torch.uint8), True) for i in range(s13.shape[0])]),
        torch.stack([scale(s2[i].view(torch.uint8), False) for i in range(s2.shape[0])]),
    )


def byte_gather(m, x: torch.Tensor) -> torch.Tensor:
    """An IndexMap applied by a per-expert loop over its byte sources, on ``x``'s device:
    ``out[e].flat[i] = x[e].flat[source_bytes[i]]``, or the fill byte where the source is a fill.
    The oracle of every executor test (compiled GPU kernels, Triton's interpreter, CPU executors)."""
    sb = m.source_bytes().reshape(-1).to(x.device)
    fills = torch.tensor(m.fills or (0,), dtype=torch.uint8)
    fill_bytes = fills[(-1 - m.refined(1).src).clamp(min=0)].to(x.device)
    xb = x.reshape(x.shape[0], -1).view(torch.uint8)
    return torch.stack([torch.where(sb >= 0, xb[e][sb.clamp(min=0)], fill_bytes) for e in range(xb.shape[0])])
