"""Cycle plans (in place in one pass): every tile reads only cells it overwrites itself
or cells saved before any tile runs, so tiles in any order give the permuted tensor."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fimoe_lab.kernels.cycles import cycle_order, plan_permutation
from fimoe_lab.prepare import plan_layer


def run_plan(plan, x, tile_order):
    """Execute ``plan`` on the 1-D array ``x`` (one value per cell), tiles in ``tile_order``,
    each tile loading all of its sources before storing."""
    x = x.copy()
    saved = x[plan.saved].copy()
    for t in tile_order:
        sl = slice(t * plan.tile_slots, (t + 1) * plan.tile_slots)
        d, s = plan.dst[sl], plan.src[sl]
        loaded = [x[c] if c >= 0 else saved[-1 - c] for c in s]
        x[d] = loaded
    return x


def check(p, tile_slots, seed):
    plan = plan_permutation(p.astype(np.int32), p.size, False, tile_slots)
    x = np.arange(p.size, dtype=np.int64) * 7 + 3  # every cell its own value
    order = np.random.default_rng(seed).permutation(plan.n_tiles)
    assert np.array_equal(run_plan(plan, x, order), x[p])
    # fixed points are not touched; a tile cuts at most two cycles' worth of sources
    assert plan.moved == int((p != np.arange(p.size)).sum())
    assert plan.saved.size <= 2 * plan.n_tiles
    # a tile's in-place sources are cells this same tile writes
    for t in range(plan.n_tiles):
        sl = slice(t * plan.tile_slots, (t + 1) * plan.tile_slots)
        inside = plan.src[sl][plan.src[sl] >= 0]
        assert set(inside.tolist()) <= set(plan.dst[sl].tolist())
    return plan


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 300), tile=st.integers(1, 40), seed=st.integers(0, 2**31 - 1))
def test_random_permutations(n, tile, seed):
    p = np.random.default_rng(seed).permutation(n)
    check(p, tile, seed)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 40), tile=st.integers(1, 64))
def test_transposes(rows, cols, tile):
    """In-place transposes: few long cycles, the hard case for tiles."""
    p = np.arange(rows * cols).reshape(rows, cols).T.reshape(-1)
    check(p, tile, rows * cols)


def test_identity_moves_nothing():
    plan = check(np.arange(50), 8, 0)
    assert plan.moved == 0 and plan.saved.size == 0


@pytest.mark.parametrize(
    "fmt,name",
    [
        ("fp8", "w13"),
        ("fp8-block", "w13"),
        ("fp8-block", "w2"),
        ("nvfp4", "w13_scale"),
        ("mxfp8", "w2_scale"),
        ("bf16", "w13"),
    ],
)
@pytest.mark.parametrize("tile", [1, 5, 128])
def test_layer_maps(fmt, name, tile):
    em = plan_layer(fmt, "trtllm", 256, 512).maps()[name].compiled()
    check(em.src.astype(np.int64), tile, 1)


def test_cycle_order_lists_each_cycle_source_after_cell():
    p = np.array([3, 0, 2, 4, 1, 6, 5])  # cycles (0 3 4 1), (2), (5 6)
    order, leader = cycle_order(p)
    assert order.tolist() == [0, 3, 4, 1, 2, 5, 6]
    assert leader.tolist() == [0, 0, 2, 0, 0, 5, 5]


@pytest.mark.parametrize(
    "src,n_in,fill", [([0, 0, 1], 3, False), ([0, 1], 3, False), ([1, 0], 2, True), ([1, -1], 2, False)]
)
def test_not_a_permutation_is_refused(src, n_in, fill):
    with pytest.raises(ValueError, match="not a permutation"):
        plan_permutation(np.array(src, dtype=np.int32), n_in, fill, 4)


@pytest.mark.parametrize("wait", [False, True])
def test_a_plan_on_a_device_is_its_arrays_kept(wait):
    """``CyclePlan.on`` copies ``(dst, src, saved)`` once and returns the same tensors after (here on the CPU; the
    copy queued without waiting, read from another stream, is tested on a GPU in test_kernels_gpu.py)."""
    import torch

    p = np.random.default_rng(3).permutation(500).astype(np.int32)
    plan = plan_permutation(p, p.size, False, 16)
    got = plan.on(torch.device("cpu"), wait=wait)
    assert plan.is_on(torch.device("cpu"))
    for t, a in zip(got, (plan.dst, plan.src, plan.saved)):
        assert t.dtype == torch.int32 and np.array_equal(t.numpy(), a)
    assert all(a is b for a, b in zip(plan.on(torch.device("cpu")), got))
