"""Our maps vs FlashInfer's own CPU-capable index functions, over many shapes (hypothesis)."""

import pytest
import torch
from conftest import HAS_FLASHINFER
from helpers import random_bytes, same_bytes
from hypothesis import given, settings
from hypothesis import strategies as st

from fimoe_lab import prepare, steps
from fimoe_lab.layout import compose

pytestmark = pytest.mark.flashinfer

if HAS_FLASHINFER:
    import flashinfer
    from flashinfer import utils as fi_utils
    from flashinfer.fused_moe import core as fi_core


def installed_engine() -> str:
    """The profile of the installed FlashInfer: its permute-index cache keys changed in 0.6.17."""
    version = tuple(int(p) for p in flashinfer.__version__.split("+")[0].split(".")[:3])
    return "flashinfer-0.6.13" if version < (0, 6, 17) else "flashinfer-0.7.4"


ROWS = st.integers(1, 24).map(lambda k: 32 * k)
SF_ROWS = st.integers(1, 6).map(lambda k: 128 * k)
COLS = st.integers(1, 12).map(lambda k: 16 * k)
ETM = st.sampled_from([64, 128])


@settings(max_examples=40, deadline=None)
@given(rows=ROWS, cols=COLS, etm=ETM)
def test_epilogue_shuffle_rows(rows, cols, etm):
    x = random_bytes((rows, cols), torch.uint8, seed=rows)
    assert torch.equal(
        fi_utils.get_shuffle_matrix_a_row_indices(x, etm), steps.shuffle_rows_for_epilogue(rows, cols, etm).src
    )
    ours = steps.shuffle_rows_for_epilogue(rows, cols, etm).apply(x[None])[0]
    assert torch.equal(flashinfer.shuffle_matrix_a(x, etm), ours)


@settings(max_examples=20, deadline=None)
@given(rows=SF_ROWS, cols=st.integers(1, 8).map(lambda k: 4 * k), etm=ETM, sf=st.sampled_from([16, 32]))
def test_scale_shuffle_rows(rows, cols, etm, sf):
    x = random_bytes((rows, cols), torch.uint8, seed=cols)
    ref = fi_utils.get_shuffle_matrix_sf_a_row_indices(x, etm, sf)
    assert torch.equal(ref, steps.shuffle_rows_for_epilogue(rows, cols, etm).src)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 64).map(lambda k: 2 * k), cols=COLS)
def test_gated_interleave(rows, cols):
    x = random_bytes((rows, cols), torch.uint8, seed=rows + cols)
    assert torch.equal(
        fi_core.get_reorder_rows_for_gated_act_gemm_row_indices(x), steps.interleave_rows_for_gated_act(rows, cols).src
    )
    assert torch.equal(
        fi_core.reorder_rows_for_gated_act_gemm(x), steps.interleave_rows_for_gated_act(rows, cols).apply(x[None])[0]
    )


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), kblocks=st.integers(1, 6), block=st.sampled_from([32, 64, 128]))
def test_block_major_k(rows, kblocks, block):
    x = random_bytes((rows, kblocks * block), torch.uint8, seed=rows)
    assert torch.equal(
        fi_core.convert_to_block_layout(x, block), steps.block_major_k(rows, kblocks * block, block).apply(x[None])[0]
    )


@settings(max_examples=30, deadline=None)
@given(rows=ROWS.filter(lambda r: r % 64 == 0), cols=COLS, etm=ETM, gated=st.booleans())
def test_w3_w1_and_w2_permute_indices(rows, cols, etm, gated):
    x = random_bytes((rows, cols), torch.uint8, seed=rows)
    ref = fi_core._maybe_get_cached_w3_w1_permute_indices({}, x, etm, is_gated_act_gemm=gated)
    ours = compose(
        *([steps.interleave_rows_for_gated_act(rows, cols)] if gated else []),
        steps.shuffle_rows_for_epilogue(rows, cols, etm),
    )
    assert torch.equal(ref, ours.src)
    assert torch.equal(
        fi_core.get_w2_permute_indices_with_cache({}, x, etm), steps.shuffle_rows_for_epilogue(rows, cols, etm).src
    )


@settings(max_examples=15, deadline=None)
@given(rows=SF_ROWS, cols=st.integers(1, 8).map(lambda k: 4 * k))
def test_nvfp4_scale_permute_indices_match_our_plan(rows, cols):
    """FlashInfer's per-16 scale permutation (the rows of shuffle_matrix_sf_a) equals our plan's rows."""
    x = random_bytes((rows, cols), torch.uint8, seed=rows)
    ref = fi_core._maybe_get_cached_w3_w1_permute_indices({}, x, 128, num_elts_per_sf=16)
    ours = steps.interleave_rows_for_gated_act(rows, cols) >> steps.shuffle_rows_for_epilogue(rows, cols, 128)
    assert torch.equal(ref, ours.src)


@settings(max_examples=10, deadline=None)
@given(intermediate=st.sampled_from([64, 128, 192]), hidden=st.sampled_from([128, 256]), gated=st.booleans())
def test_bf16_block_layout_vs_flashinfer_per_expert_loop(intermediate, hidden, gated):
    """The reference's own recipe, expert by expert, on FlashInfer's index functions."""
    p = 2 if gated else 1
    w13 = random_bytes((3, p * intermediate, hidden), torch.bfloat16, seed=intermediate)
    w2 = random_bytes((3, hidden, intermediate), torch.bfloat16, seed=hidden)
    expected13, expected2 = [], []
    for e in range(3):
        x = w13[e].view(torch.uint8)
        idx = fi_core._maybe_get_cached_w3_w1_permute_indices({}, x, 128, is_gated_act_gemm=gated)
        if gated:
            idx = (idx + x.shape[0] // 2) % x.shape[0]
        expected13.append(fi_core.convert_to_block_layout(x[idx].contiguous(), 128))
        y = w2[e].view(torch.uint8)
        expected2.append(
            fi_core.convert_to_block_layout(y[fi_core.get_w2_permute_indices_with_cache({}, y, 128)].contiguous(), 128)
        )
    o13, o2 = prepare.convert_moe_weights_to_flashinfer_trtllm_block_layout({}, w13, w2, gated)
    assert same_bytes(o13.view(torch.uint8), torch.stack(expected13))
    assert same_bytes(o2.view(torch.uint8), torch.stack(expected2))


@pytest.mark.parametrize("gated", [True, False])
def test_block_layout_fills_the_callers_cache_as_flashinfer_would(gated):
    """vLLM passes one cache dict to FlashInfer's helpers too: what we leave there must be what they compute."""
    rows13 = 256 if gated else 128
    w13 = random_bytes((2, rows13, 128), torch.bfloat16, seed=1)
    w2 = random_bytes((2, 128, 128), torch.bfloat16, seed=2)
    cache: dict = {}
    prepare.convert_moe_weights_to_flashinfer_trtllm_block_layout(
        cache, w13.clone(), w2.clone(), gated, engine=installed_engine()
    )
    fresh: dict = {}
    x13, x2 = w13[0].view(torch.uint8), w2[0].view(torch.uint8)
    assert torch.equal(
        fi_core._maybe_get_cached_w3_w1_permute_indices(cache, x13, 128, is_gated_act_gemm=gated),
        fi_core._maybe_get_cached_w3_w1_permute_indices(fresh, x13, 128, is_gated_act_gemm=gated),
    )
    assert torch.equal(
        fi_core.get_w2_permute_indices_with_cache(cache, x2, 128),
        fi_core.get_w2_permute_indices_with_cache(fresh, x2, 128),
    )
    assert set(cache) == set(fresh)


@pytest.mark.parametrize("gated", [True, False])
def test_block_layout_cache_keys_per_engine(gated):
    """0.6.17+ (every profile but flashinfer-0.6.13) keys by five parts, as vLLM 0.34 calls the helpers."""
    w13 = random_bytes((2, 256, 64), torch.bfloat16, seed=3)
    w2 = random_bytes((2, 64, 128), torch.bfloat16, seed=4)
    keys = {}
    for engine in ("vllm-0.34", "flashinfer-0.6.13"):
        cache: dict = {}
        prepare.convert_moe_weights_to_flashinfer_trtllm_block_layout(
            cache, w13.clone(), w2.clone(), gated, engine=engine
        )
        keys[engine] = cache
    s13, s2 = torch.Size((256, 128)), torch.Size((64, 256))
    assert set(keys["vllm-0.34"]) == {("w3_w1", s13, 128, None, gated), ("w2", s2, 128, None, None)}
    assert set(keys["flashinfer-0.6.13"]) == {("w3_w1", s13), ("w2", s2)}
    for k5, k2 in zip(sorted(keys["vllm-0.34"], key=str), sorted(keys["flashinfer-0.6.13"], key=str)):
        assert torch.equal(keys["vllm-0.34"][k5], keys["flashinfer-0.6.13"][k2])
