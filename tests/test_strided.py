"""The strided form: maps recognised as strided views run as strided copies, bit-exact, with no compiler.

The reference is the per-expert byte loop (``reference_loops.byte_gather``) and the torch
``index_select`` path of the same map; inputs are structured (4-byte words encode their own
coordinates) and random.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import coords, random_bytes
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_loops import byte_gather as reference

from fimoe_lab import steps
from fimoe_lab.compile import MAX_STRIDED_PIECES, strided_form
from fimoe_lab.errors import LayoutError
from fimoe_lab.kernels import EXECUTORS, InPlaceError, execute, execute_in_place
from fimoe_lab.kernels.compiled import Strided
from fimoe_lab.prepare import drop_in_maps, plan_layer

ROOT = pathlib.Path(__file__).resolve().parent.parent

# (format, intermediate per rank, hidden): the layers the engines prepare at model sizes
MODEL_LAYERS = [
    ("fp8", 256, 7168),  # DeepSeek-V3 TP8, per-tensor FP8
    ("fp8-block", 256, 7168),  # DeepSeek-V3 TP8, FP8 block scales
    ("mxfp8", 256, 7168),
    ("bf16", 192, 4096),  # Qwen3-235B TP8
    ("nvfp4", 256, 7168),
    ("mxfp4", 384, 2880),  # gpt-oss-120b TP8 (2880 / 8 = 360 rounds to whole 32-blocks; 384 a padded rank)
]


def engine_maps(fmt: str, inter: int, hidden: int) -> dict:
    """``plan_layer``'s maps (the integration path) and the drop-ins' maps, by name."""
    plan = plan_layer(fmt, "trtllm", inter, hidden)
    maps = {f"plan/{k}": m for k, m in plan.maps().items()}
    return maps | {k: m for k, (m, _) in drop_in_maps(fmt, plan.padded_intermediate, plan.padded_hidden).items()}


@pytest.mark.parametrize("fmt,inter,hidden", MODEL_LAYERS)
def test_every_map_an_engine_prepares_at_model_size_is_strided(fmt, inter, hidden):
    for name, m in engine_maps(fmt, inter, hidden).items():
        em = m.compiled()
        assert em.strided is not None or em.stages is not None, name


def test_the_primitive_layouts_are_the_strided_views_they_are():
    # BlockMajorK [M, K] -> [K/128, M, 128]: a permute of the (M, K/128) blocks
    assert steps.block_major_k(4, 256).compiled().strided == Strided((2, 4), (2, 4), (1, 2), 0, None)
    # the W13 -> W31 swap: two halves, the second first (a negative stride, two pieces)
    assert steps.swap_w13_to_w31_rows(8, 64).compiled().strided == Strided((2,), (2,), (-1,), 1, None)
    # the gated interleave: out (j, h) reads row h * M/2 + j
    assert steps.interleave_rows_for_gated_act(8, 64).compiled().strided == Strided((4, 2), (4, 2), (1, 4), 0, None)


def test_strided_form_refuses_what_it_cannot_reproduce():
    rng = np.random.default_rng(3)
    assert strided_form(rng.permutation(64)) is None
    assert strided_form(np.array([0, 1, -1, 2, 3, -2])) is None  # two fill codes
    assert strided_form(np.array([-1, 0, 1, 2])) is None  # starts in fill
    # block starts look strided, the cells inside do not
    assert strided_form(np.array([0, 1, 2, 3, 4, 6, 5, 7])) is None
    # padding that is no box: fp8 gated I = 232 pads each half to 240, then rows interleave and shuffle
    assert plan_layer("fp8", "trtllm", 232, 320).w13.compiled().strided is None
    # more negative-stride pieces than allowed
    many = np.arange(2 * MAX_STRIDED_PIECES)[::-1].copy()
    assert strided_form(many) is None


@st.composite
def affine_maps(draw):
    """Sources of a random strided view: digit extents, a permutation of the input's digits, a box."""
    dims = draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
    order = draw(st.permutations(range(len(dims))))
    n_in = int(np.prod(dims))
    src = np.arange(n_in).reshape(dims).transpose(order)
    live = [draw(st.integers(1, d)) for d in src.shape]
    pad = [draw(st.integers(0, 2)) for _ in src.shape]
    out = np.full([d + p for d, p in zip(src.shape, pad)], -1, dtype=np.int64)
    box = tuple(slice(0, n) for n in live)
    out[box] = src[box]
    return out.reshape(-1)


@settings(max_examples=200, deadline=None)
@given(affine_maps())
def test_strided_form_recovers_any_padded_permute_of_a_view(src):
    from fimoe_lab.compile import _strided_sources

    form = strided_form(src)
    assert form is not None
    assert np.array_equal(_strided_sources(form.shape, form.live, form.strides, form.offset, form.fill), src)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(-2, 40), min_size=1, max_size=48))
def test_strided_form_is_exact_or_none(src):
    from fimoe_lab.compile import _strided_sources

    src = np.array(src, dtype=np.int64)
    form = strided_form(src)
    if form is not None:
        assert np.array_equal(_strided_sources(form.shape, form.live, form.strides, form.offset, form.fill), src)


def without_strided(em):
    """The same executable map with its strided form removed: the torch executor's index_select path."""
    plain = copy.copy(em)
    plain.strided, plain._dev = None, {}
    return plain


def structured(m, experts: int) -> torch.Tensor:
    return coords(experts, 1, m.in_bytes // 4).reshape(experts, -1).view(torch.uint8).contiguous()


@pytest.mark.parametrize(
    "fmt,inter,hidden,kw",
    [
        ("fp8", 256, 512, {}),
        ("fp8-block", 256, 512, {}),
        ("mxfp8", 256, 512, {}),
        ("mxfp8", 192, 320, {}),  # padded: fill outside the box
        ("nvfp4", 256, 512, {}),
        ("mxfp4", 256, 512, {}),
        ("bf16", 96, 160, {}),  # padded
        ("fp8", 232, 320, dict(is_act_and_mul=False, is_gated=False)),  # padded rows
    ],
)
def test_strided_copies_equal_index_select_and_the_loop(fmt, inter, hidden, kw):
    plan = plan_layer(fmt, "trtllm", inter, hidden, **kw)
    drop = drop_in_maps(fmt, plan.padded_intermediate, plan.padded_hidden) if not kw else {}
    maps = list(plan.maps().values()) + [m for m, _ in drop.values()]
    seen = 0
    for m in maps:
        em = m.compiled()
        if em.strided is None:
            continue
        seen += 1
        for x in (structured(m, 3), random_bytes((2, m.in_bytes), torch.uint8, seed=m.in_bytes % 997)):
            want = reference(m, x)
            for e in (em, without_strided(em)):
                out = torch.full((x.shape[0], m.out_bytes), 0xAB, dtype=torch.uint8)
                execute(e, x, out, backend="torch")
                assert torch.equal(out, want), m.name
    assert seen


def test_strided_copies_on_unaligned_buffers_use_narrow_words():
    m = plan_layer("fp8-block", "trtllm", 256, 512).w13
    raw = random_bytes((2 * m.in_bytes + 1,), torch.uint8, seed=5)
    x = raw[1:].view(2, m.in_bytes)
    assert x.data_ptr() % 2 == 1 and m.compiled().strided is not None
    out = torch.full((2, m.out_bytes), 0xAB, dtype=torch.uint8)
    execute(m.compiled(), x, out, backend="torch")
    assert torch.equal(out, reference(m, x))


@pytest.mark.parametrize("experts,scratch", [(5, 1), (7, 3), (3, None)])
def test_strided_in_place_matches_the_loop(experts, scratch):
    for m in (
        plan_layer("fp8", "trtllm", 256, 512).w13,
        plan_layer("bf16", "trtllm", 256, 256).w13,
        plan_layer("mxfp8", "trtllm", 256, 512).w13_scale,
    ):
        em = m.compiled()
        assert EXECUTORS["torch"].strategy(em).name == "strided"
        for x in (random_bytes((experts, m.in_bytes), torch.uint8, seed=experts), structured(m, experts)):
            want = reference(m, x)
            execute_in_place(em, x, scratch, backend="torch")
            assert torch.equal(x, want)


def test_strided_in_place_error_midway_restores_input(monkeypatch):
    from fimoe_lab.kernels import torch_gather

    m = plan_layer("fp8-block", "trtllm", 256, 512).w13
    x = random_bytes((6, m.in_bytes), torch.uint8, seed=11)
    before = x.clone()
    real, calls = torch_gather._strided_copy, {"n": 0}

    def flaky(out, src):
        calls["n"] += 1
        if calls["n"] == 3:  # third chunk, after two are in the output layout
            out.fill_(0)  # half-written
            raise MemoryError("injected")
        return real(out, src)

    monkeypatch.setattr(torch_gather, "_strided_copy", flaky)
    with pytest.raises(InPlaceError) as info:
        execute_in_place(m.compiled(), x, 1, backend="torch")
    assert info.value.restored and isinstance(info.value.__cause__, MemoryError)
    assert calls["n"] > 3 and torch.equal(x, before)  # the undo ran in place too (the inverse is strided)


def test_strided_in_place_refuses_other_maps():
    em = plan_layer("fp8", "trtllm", 232, 320, is_act_and_mul=False, is_gated=False).w13.compiled()
    assert em.strided is None
    with pytest.raises(LayoutError, match="strided form"):
        EXECUTORS["torch"].strategy(em, "strided")


NO_LOAD_CHILD = """
import json, sys, torch
from fimoe_lab.kernels import EXECUTORS, registry
from fimoe_lab.prepare import plan_layer
em = plan_layer("fp8-block", "trtllm", 256, 512).w13.compiled()
cuda = registry._loaded_or_stand_in(EXECUTORS["triton"], em, "cuda").name  # nothing imported, no thread
quiet = [cuda, dict(registry._LOADS.threads) == {}, "triton" not in sys.modules]
cpu = registry._loaded_or_stand_in(EXECUTORS["numba"], em, "cpu").name  # torch stands in while numba loads
print(json.dumps(quiet + [cpu, "numba" in registry._LOADS.threads]))
"""


@pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="needs numba")
def test_a_strided_map_on_cuda_starts_no_load_and_on_the_cpu_numba_still_loads():
    """On CUDA torch's strided copies are as fast as Triton's gathers: no Triton import, no thread. On
    the CPU they stand in while numba (twice as fast there) loads in the background."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", NO_LOAD_CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    cuda, no_thread, no_triton, cpu, numba_loads = json.loads(done.stdout.strip().splitlines()[-1])
    assert (cuda, no_thread, no_triton) == ("torch", True, True)
    assert (cpu, numba_loads) == ("torch", True)
