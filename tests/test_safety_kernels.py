"""The numba executor checks every map it runs: indices out of range are refused, never followed.

Each executable map below is a real compiled map (a TRT-LLM plan's) with one field corrupted, run
on structured bytes in a guarded buffer: the executor must raise LayoutError and leave the output
untouched (a read or write out of bounds would crash, or change bytes, instead). The intact map's
result is checked against a per-expert loop written here.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from helpers import random_bytes

from fimoe_lab.errors import LayoutError
from fimoe_lab.kernels import numba_gather
from fimoe_lab.prepare import plan_layer

EXPERTS = 3


def maps():
    """Three real maps: a row/column gather (bf16 weights), a row gather + 128x4 scale swizzle
    (nvfp4 scales) and a row gather with right-padded rows (non-gated fp8 w2, 232 -> 256)."""
    bf16 = plan_layer("bf16", "trtllm", 256, 256).w13.compiled()
    nvfp4 = plan_layer("nvfp4", "trtllm", 256, 256).w13_scale.compiled()
    padded = plan_layer("fp8", "trtllm", 232, 320, is_act_and_mul=False, is_gated=False).w2.compiled()
    assert nvfp4.swizzle is not None and padded.padrows is not None  # the fast loops are covered too
    return {"gather": bf16, "swizzle": nvfp4, "padrows": padded}


def loop_oracle(em, x: torch.Tensor) -> torch.Tensor:
    """``out[e, cell i] = x[e, cell src[i]]`` or the fill byte, one expert and cell at a time."""
    c = em.cell_bytes
    out = torch.empty((x.shape[0], em.out_bytes), dtype=torch.uint8)
    for e in range(x.shape[0]):
        for i, s in enumerate(em.src.tolist()):
            out[e, i * c : (i + 1) * c] = x[e, s * c : (s + 1) * c] if s >= 0 else em.fills[-1 - s]
    return out


def corrupt(em, how: str):
    """A copy of ``em`` (own cache) with one field made to point outside its buffers."""
    src = em.src.copy()
    if how == "src-past-end":
        src[len(src) // 2] = em.n_in
    elif how == "src-far":
        src[0] = 2**30
    elif how == "fill-code-out-of-range":
        src[-1] = -2 - max(1, len(em.fills))
    elif how == "src-int64":
        src = src.astype(np.int64)
    elif how == "src-short":
        src = src[:-1]
    elif how == "n-in-too-big":
        return dataclasses.replace(em, n_in=em.n_in + 1, _dev={})
    elif how == "out-bytes-wrong":
        return dataclasses.replace(em, out_bytes=em.out_bytes + em.cell_bytes, _dev={})
    swizzle = em.swizzle
    if swizzle is not None and how.startswith("src"):
        rows = swizzle[0].copy()
        rows[0] = em.in_bytes  # a row far past the input
        swizzle = (rows, *swizzle[1:])
    padrows = em.padrows
    if padrows is not None and how.startswith("src"):
        rows = padrows[0].copy()
        rows[-1] = em.in_bytes  # a row far past the input
        padrows = (rows, *padrows[1:])
    return dataclasses.replace(em, src=src, row_forms=(swizzle, padrows, em.swizzled_rows), _dev={})


HOWS = [
    "src-past-end",
    "src-far",
    "fill-code-out-of-range",
    "src-int64",
    "src-short",
    "n-in-too-big",
    "out-bytes-wrong",
]


@pytest.mark.parametrize("kind", ["gather", "swizzle", "padrows"])
@pytest.mark.parametrize("how", HOWS)
def test_a_corrupted_map_is_refused_before_any_byte_moves(kind, how):
    em = corrupt(maps()[kind], how)
    x = random_bytes((EXPERTS, em.in_bytes), torch.uint8, seed=3)
    out = torch.full((EXPERTS, max(em.out_bytes, 1)), 0xAB, dtype=torch.uint8)
    with pytest.raises(LayoutError) as info:
        numba_gather.gather_numba(em, x, out)
    assert em.name in str(info.value) and info.value.fix
    assert bool((out == 0xAB).all())


@pytest.mark.parametrize("kind", ["gather", "swizzle", "padrows"])
def test_buffers_that_do_not_fit_the_map_are_refused(kind):
    em = maps()[kind]
    x = random_bytes((EXPERTS, em.in_bytes - 4), torch.uint8, seed=4)
    out = torch.full((EXPERTS, em.out_bytes), 0xAB, dtype=torch.uint8)
    with pytest.raises(LayoutError, match="buffers of"):
        numba_gather.gather_numba(em, x, out)


@pytest.mark.parametrize("kind", ["gather", "swizzle", "padrows"])
def test_an_intact_map_still_runs_and_matches_the_loop(kind):
    em = maps()[kind]
    x = random_bytes((EXPERTS, em.in_bytes), torch.uint8, seed=5)
    out = torch.full((EXPERTS, em.out_bytes), 0xAB, dtype=torch.uint8)
    numba_gather.gather_numba(em, x, out)
    assert em._dev.get("bounds_ok") is True  # checked once, then cached on the map
    assert torch.equal(out, loop_oracle(em, x))  # src defines the map whatever fast loop runs it


@pytest.mark.parametrize("field", ["row", "fill-code", "widths"])
def test_corrupted_padded_rows_alone_are_refused(field):
    """The padded-rows form is checked on its own (its loop does not read ``src``)."""
    em = maps()["padrows"]
    rows, c_in, c_out, code = em.padrows
    rows = rows.copy()
    if field == "row":
        rows[len(rows) // 2] = em.in_bytes // c_in
    elif field == "fill-code":
        code = -2 - max(1, len(em.fills))
    else:
        c_in = c_out + 1
    bad = dataclasses.replace(em, row_forms=(em.swizzle, (rows, c_in, c_out, code), em.swizzled_rows), _dev={})
    x = random_bytes((EXPERTS, em.in_bytes), torch.uint8, seed=7)
    out = torch.full((EXPERTS, em.out_bytes), 0xAB, dtype=torch.uint8)
    with pytest.raises(LayoutError, match="padded rows"):
        numba_gather.gather_numba(bad, x, out)
    assert bool((out == 0xAB).all())


def test_in_place_run_refuses_a_corrupted_permutation():
    em = plan_layer("bf16", "trtllm", 256, 256).w13.compiled()
    bad = corrupt(em, "src-past-end")
    flat = random_bytes((EXPERTS, em.in_bytes), torch.uint8, seed=6)
    before = flat.clone()
    with pytest.raises(LayoutError):
        list(numba_gather.inplace_cycles_numba(bad, flat, 1))
    assert torch.equal(flat, before)
