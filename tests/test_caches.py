"""The caches of built maps share one byte budget, evict least recently used first, and clear."""

import gc
import weakref

import pytest

from fimoe_lab import builders, caches, recipes, steps
from fimoe_lab.errors import FimoeError


@pytest.fixture
def budget():
    entries, held, before = caches.cache_bytes()
    yield
    caches.set_cache_budget(before)


def test_clear_caches_really_frees_the_maps(budget):
    caches.clear_caches()
    m = steps.swap_w13_to_w31_rows(4096, 7168)
    assert steps.swap_w13_to_w31_rows(4096, 7168) is m  # cached
    entries, held, _ = caches.cache_bytes()
    assert entries >= 1 and held >= m.src.nbytes
    ref = weakref.ref(m)
    del m
    freed = caches.clear_caches()
    gc.collect()
    assert freed >= 4096 * 8 and ref() is None  # nothing else kept the map alive
    assert caches.cache_bytes()[:2] == (0, 0)


def test_budget_evicts_least_recently_used_first(budget):
    caches.clear_caches()
    one = steps.swap_w13_to_w31_rows(1024, 64).src.nbytes  # 8 KiB of int64 sources
    caches.set_cache_budget(3 * one)
    a = steps.swap_w13_to_w31_rows(1024, 64)
    b = steps.swap_w13_to_w31_rows(1024, 128)
    steps.swap_w13_to_w31_rows(1024, 64)  # a is now the most recent
    c = steps.swap_w13_to_w31_rows(1024, 256)
    d = steps.swap_w13_to_w31_rows(1024, 512)  # over budget: b goes first
    entries, held, limit = caches.cache_bytes()
    assert held <= limit
    assert steps.swap_w13_to_w31_rows(1024, 64) is a and steps.swap_w13_to_w31_rows(1024, 512) is d
    assert steps.swap_w13_to_w31_rows(1024, 128) is not b  # rebuilt, equal in effect
    assert steps.swap_w13_to_w31_rows(1024, 128) == b
    del c


def test_a_plan_larger_than_the_budget_is_built_but_not_kept(budget):
    caches.clear_caches()
    caches.set_cache_budget(1024)
    p1 = recipes.plan_layer("fp8", "trtllm", 2048, 7168)
    assert recipes.plan_layer("fp8", "trtllm", 2048, 7168) is not p1
    assert caches.cache_bytes()[1] <= 1024


def test_negative_budget_is_refused(budget):
    with pytest.raises(FimoeError, match="bytes >= 0"):
        caches.set_cache_budget(-1)


def test_one_entry_however_the_call_is_spelled(budget):
    """Positional, keyword and defaulted arguments name one entry: the BF16 block plan of the
    drop-in (four positional arguments) is the one ``plan_layer`` and the warm-up build
    (``swap=`` by keyword), so its maps are compiled and planned once."""
    caches.clear_caches()
    a = builders.plan_trtllm_bf16_block_layout(256, 64, 128, True)
    assert builders.plan_trtllm_bf16_block_layout(256, 64, 128, True, swap=True) is a
    assert builders.plan_trtllm_bf16_block_layout(256, 64, 128, is_gated_act_gemm=True, itemsize=2) is a
    assert builders.plan_trtllm_bf16_block_layout(w13_rows=256, hidden=64, intermediate=128) is a
    assert builders.plan_trtllm_bf16_block_layout(256, 64, 128, True, swap=False) is not a
    layer = recipes.plan_layer("bf16", "trtllm", 128, 64)
    assert layer.w13 is a.w13 and layer.w2 is a.w2
    assert caches.cache_bytes()[0] >= 2


def test_a_plan_asked_by_values_or_by_sizes_is_one_entry(budget):
    """``plan_layer``'s spellings and ``plan_for`` of the two values (frozen dataclasses, remembered as written)
    give one plan; another value, or the same number of another type, is its own call."""
    from fimoe_lab.choice import LayerShape, LayoutChoice

    caches.clear_caches()
    plan = recipes.plan_layer("nvfp4", "trtllm", 256, 512)
    assert recipes.plan_layer("nvfp4", "trtllm", 256, 512) is plan
    assert recipes.plan_layer("nvfp4", "trtllm", intermediate=256, hidden=512, is_gated=True) is plan
    assert recipes.plan_for(LayerShape("nvfp4", 256, 512), LayoutChoice("trtllm")) is plan
    assert recipes.plan_for(LayerShape("nvfp4", 256, 512), LayoutChoice("trtllm")) is plan
    other = recipes.plan_layer("nvfp4", "trtllm", 256, 512, hidden_alignment=1024)
    assert other is not plan and other.padded_hidden == 1024
    assert recipes.plan_layer("nvfp4", "trtllm", 256, 512, is_act_and_mul=False) is not plan
    caches.clear_caches()
    assert recipes.plan_layer("nvfp4", "trtllm", 256, 512) is not plan  # the values are kept, the plans not


def test_warm_up_builds_what_each_drop_in_then_uses(budget, monkeypatch):
    """After ``warmup`` for a drop-in's format and sizes, the drop-in's first call compiles and
    plans no map: the warm-up's maps are the drop-in's own objects. (What it may still do: fill
    FlashInfer's permute-index dict, which the engine hands it empty, from row-level steps.)"""
    import torch
    from helpers import random_bytes, spy_calls
    from test_prepare import WARM_DROP_INS

    from fimoe_lab import compile as compile_mod
    from fimoe_lab import prepare
    from fimoe_lab.kernels import cycles
    from fimoe_lab.warmup import warmup

    builders = [(compile_mod, "compile_map"), (cycles, "plan_permutation"), (cycles, "cycle_order")]
    fp8 = torch.float8_e4m3fn
    calls = dict(WARM_DROP_INS)
    calls["rotate, not gated"] = lambda: prepare.rotate_weights_for_fi_trtllm_fp8_per_tensor_moe(
        random_bytes((2, 128, 64), fp8, seed=11), random_bytes((2, 64, 128), fp8, seed=12), False
    )  # a non-gated FP8 TRT-LLM layer's intermediate is aligned to 128
    sizes = {  # drop-in -> (format, hidden, intermediate, gated) of its shapes
        "rotate": ("fp8", 64, 64, True),
        "rotate, not gated": ("fp8", 64, 128, False),
        "deepseek": ("fp8-block", 128, 128, True),
        "mxfp8": ("mxfp8", 256, 256, True),
        "bf16_block": ("bf16", 64, 128, True),
    }
    for name, (fmt, hidden, inter, gated) in sizes.items():
        caches.clear_caches()
        warmup(formats=[fmt], devices=["cpu"], hidden=hidden, intermediate=inter, experts=2, gated=gated)
        with monkeypatch.context() as mp:
            seen = spy_calls(mp, builders)
            calls[name]()
        assert seen == [], f"{name} after warm-up of {fmt}: {sorted(set(seen))}"
