"""The caches of built maps share one byte budget, evict least recently used first, and clear."""

import gc
import weakref

import pytest

from fimoe_lab import caches, recipes, steps
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
