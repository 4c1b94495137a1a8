"""GPU executors (Triton and torch wide-word) are bit-exact with the map; skipped without CUDA.

Run on an H200 (benchmarks/RESULTS.md gives the command and the outcome).
"""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch
from reference_loops import byte_gather as reference

from fimoe_lab import kernels
from fimoe_lab.errors import LayoutError
from fimoe_lab.kernels import InPlaceError, available_backends, execute, execute_in_place, prebuilt
from fimoe_lab.prepare import plan_layer

pytestmark = pytest.mark.gpu

GPU_BACKENDS = ["torch"] + (["triton"] if importlib.util.find_spec("triton") else [])
if "triton" in GPU_BACKENDS and torch.cuda.is_available():
    kernels.load_executor("triton")  # default calls below run on Triton, not on its stand-in while it loads

PREBUILT = prebuilt.available("cuda") if torch.cuda.is_available() else False

STAND_IN_CHILD = """
import json, torch
from fimoe_lab import kernels
from fimoe_lab.prepare import plan_layer
m = plan_layer("fp8", "trtllm", 256, 2048).w13
x = torch.randint(0, 256, (4, m.in_bytes), dtype=torch.uint8, device="cuda")
first = kernels.get_executor(None, "cuda", 1 << 30).name
y = x.clone()
kernels.execute_in_place(m.compiled(), y)
want = x.clone()
kernels.execute_in_place(m.compiled(), want, backend="torch")
kernels.load_executor("triton")
after = kernels.get_executor(None, "cuda", 1 << 30).name
z = x.clone()
kernels.execute_in_place(m.compiled(), z)
tuned = kernels.get_executor(None, "cuda", 1 << 30, wait=True).name
print(json.dumps([first, after, tuned, torch.equal(y, want), torch.equal(z, want), not torch.equal(x, want)]))
"""


@pytest.mark.skipif("triton" not in GPU_BACKENDS, reason="needs triton")
@pytest.mark.parametrize("background", ["1", "0"])
def test_gpu_fresh_process_runs_on_torch_while_triton_loads(background):
    """A fresh process's first default CUDA call does not wait for Triton's import and cache key: torch
    stands in (same bytes) while Triton loads on a thread; after ``load_executor`` Triton runs. With
    ``FIMOE_BACKGROUND_LOAD=0`` the first call loads Triton itself."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    env = {**os.environ, "FIMOE_BACKGROUND_LOAD": background}
    env["PYTHONPATH"] = str(pathlib.Path(__file__).resolve().parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", STAND_IN_CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    first, after, tuned, same1, same2, moved = json.loads(done.stdout.strip().splitlines()[-1])
    assert first == ("torch" if background == "1" else "triton")
    assert after == tuned == "triton" and same1 and same2 and moved


NO_LOAD_CHILD = """
import json, sys, torch
from fimoe_lab import prepare
from fimoe_lab.kernels import registry
g = torch.Generator(device="cuda").manual_seed(0)
w13 = torch.randint(0, 256, (16, 512, 7168), dtype=torch.uint8, device="cuda", generator=g)
w2 = torch.randint(0, 256, (16, 7168, 256), dtype=torch.uint8, device="cuda", generator=g)
a, b = prepare.shuffle_deepseek_fp8_moe_weights(w13.view(torch.float8_e4m3fn), w2.view(torch.float8_e4m3fn))
prepare.rotate_weights_for_fi_trtllm_fp8_per_tensor_moe(w13, w2, True)
torch.cuda.synchronize()
print(json.dumps(["triton" not in sys.modules, dict(registry._LOADS.threads) == {}]))
"""


def test_gpu_fresh_process_prepares_strided_layers_without_triton():
    """The DeepSeek block shuffle and the FP8 rotate (in place) in a fresh process: strided copies, no
    Triton import, no background load."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    env = dict(os.environ)
    env["PYTHONPATH"] = str(pathlib.Path(__file__).resolve().parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", NO_LOAD_CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [True, True]


CASES = [
    ("fp8", 256, 512, {}),
    ("fp8", 232, 320, dict(is_act_and_mul=False, is_gated=False)),
    ("fp8", 200, 256, {}),
    ("fp8-block", 256, 512, {}),
    ("mxfp8", 256, 512, {}),
    ("mxfp8", 192, 320, {}),
    ("nvfp4", 256, 512, {}),
    ("bf16", 256, 256, {}),
    ("bf16", 96, 160, {}),
    ("mxfp4", 96, 320, {}),
    # production shapes, few experts
    ("fp8-block", 2048, 7168, {}),
    ("mxfp8", 2048, 7168, {}),
    ("nvfp4", 2048, 7168, {}),
    ("bf16", 1536, 4096, {}),
    ("fp8", 1856, 2688, dict(is_act_and_mul=False, is_gated=False)),
    ("mxfp4", 2880, 2880, {}),
]


def maps():
    for fmt, inter, hidden, kw in CASES:
        for name, m in plan_layer(fmt, "trtllm", inter, hidden, **kw).maps().items():
            yield pytest.param(m, id=f"{fmt}-{inter}x{hidden}-{len(kw)}-{name}")


def inputs(m, experts):
    words = m.in_bytes // 4
    codes = torch.arange(experts * words, dtype=torch.int32, device="cuda").add_(1).view(experts, words)
    structured = codes.view(torch.uint8)
    if m.in_bytes % 4:
        tail = torch.randint(0, 256, (experts, m.in_bytes % 4), dtype=torch.uint8, device="cuda")
        structured = torch.cat([structured, tail], 1).contiguous()
    rand = torch.randint(0, 256, (experts, m.in_bytes), dtype=torch.uint8, device="cuda")
    return structured, rand


@pytest.mark.parametrize("backend", GPU_BACKENDS + (["prebuilt"] if PREBUILT else []))
@pytest.mark.parametrize("m", list(maps()))
def test_gpu_bit_exact(m, backend):
    experts = 3 if m.in_bytes > (1 << 22) else 5
    for x in inputs(m, experts):
        out = torch.full((experts, m.out_bytes), 0xAB, dtype=torch.uint8, device="cuda")
        execute(m.compiled(), x, out, backend=backend)
        torch.cuda.synchronize()
        assert torch.equal(out, reference(m, x))


TILE_CONFIGS = [
    {"evict": True, "store_cs": True, "wide_below": 0},
    {"wide_below": 4096, "max_bw": 64},
    {"swizzle_wide_below": 64},
    {"swizzle_wide_below": 128, "swizzle_kw": 128},
    {"swizzle_wide_below": 8, "swizzle_kw": 8},
    {"tile_2d_max_cell": 0},
    {"tile_words": 4096, "tile_2d_words": 4096},
    {"tile_2d_max_cell": 1 << 20, "run_cells": 2, "tile_words": 256, "tile_2d_words": 256},
    {"swizzle_band_step": False},
    {"swizzle_split": 2, "swizzle_pair_rows": False},
    {"swizzle_split": 4, "swizzle_band_step": False},
    {"swizzle_split": 8, "swizzle_kw": 8, "swizzle_wide_below": 8},
]


@pytest.mark.parametrize("cfg", TILE_CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("m", list(maps()))
def test_gpu_tile_choices_bit_exact(m, cfg):
    """Every row / column chunking (masked overhangs) and cache hint moves the same bytes."""
    from fimoe_lab.kernels.triton_gather import gather_triton

    experts = 3 if m.in_bytes > (1 << 22) else 5
    for x in inputs(m, experts):
        if m.in_bytes % 4:
            continue
        out = torch.full((experts, m.out_bytes), 0xAB, dtype=torch.uint8, device="cuda")
        gather_triton(m.compiled(), x, out, cfg)
        torch.cuda.synchronize()
        assert torch.equal(out, reference(m, x))


@pytest.mark.parametrize("backend", GPU_BACKENDS + (["prebuilt"] if PREBUILT else []))
def test_gpu_unaligned_and_typed(backend):
    m = plan_layer("bf16", "trtllm", 256, 256).w13
    raw = torch.randint(0, 256, (2 * m.in_bytes + 1,), dtype=torch.uint8, device="cuda")
    x = raw[1:].view(2, m.in_bytes)
    out = torch.empty(2, m.out_bytes, dtype=torch.uint8, device="cuda")
    execute(m.compiled(), x, out, backend=backend)
    assert torch.equal(out, reference(m, x))
    xb = raw[: 2 * m.in_bytes].view(torch.bfloat16).view((2,) + m.in_shape[:-1] + (m.in_shape[-1] // 2,))
    assert torch.equal(m.apply(xb, backend=backend).reshape(2, -1).view(torch.uint8), reference(m, xb))


@pytest.mark.parametrize(
    "backend,strategy",
    [("torch", None), ("torch", "strided"), ("torch", "copy-then-gather")]
    + ([("triton", "auto"), ("triton", "cycles"), ("triton", "copy-then-gather")] if "triton" in GPU_BACKENDS else [])
    + ([("prebuilt", None), ("prebuilt", "cycles")] if PREBUILT else []),
)
@pytest.mark.parametrize("scratch", [1, 2, 3, None])
def test_gpu_in_place(backend, strategy, scratch):
    cfg = {"inplace": strategy} if strategy else None
    for m in (
        plan_layer("fp8", "trtllm", 2048, 7168).w13,
        plan_layer("nvfp4", "trtllm", 2048, 7168).w13_scale,
        plan_layer("bf16", "trtllm", 256, 256).w2,
        plan_layer("fp8-block", "trtllm", 256, 512).w13,
        plan_layer("mxfp8", "trtllm", 256, 512).w13_scale,
    ):
        for x in inputs(m, 5):
            want = reference(m, x)
            execute_in_place(m.compiled(), x, scratch, backend=backend, config=cfg)
            torch.cuda.synchronize()
            assert torch.equal(x, want)


@pytest.mark.skipif("triton" not in GPU_BACKENDS, reason="needs triton")
@pytest.mark.parametrize("cycle_slots,cycle_bw", [(64, 1), (32, 8), (32, 256), (256, 64)])
def test_gpu_in_place_cycles_tile_sizes(cycle_slots, cycle_bw):
    """Tiny tiles cut many cycles (most cells saved aside); big ones cut few."""
    for m in (plan_layer("fp8-block", "trtllm", 256, 512).w13, plan_layer("nvfp4", "trtllm", 256, 512).w13):
        for x in inputs(m, 4):
            want = reference(m, x)
            execute_in_place(
                m.compiled(), x, 1, config={"inplace": "cycles", "cycle_slots": cycle_slots, "cycle_bw": cycle_bw}
            )
            torch.cuda.synchronize()
            assert torch.equal(x, want)


@pytest.mark.skipif("triton" not in GPU_BACKENDS, reason="needs triton")
@pytest.mark.parametrize(
    "band_words,per_sm,warps,step",
    [(1, 1, 4, True), (4, 1, 8, False), (16, 2, 4, True), (64, 32, 8, True), (512, 32, 4, False), (64, 0, 8, True)],
)
def test_gpu_in_place_bands(band_words, per_sm, warps, step):
    """Scale maps without scratch: narrow items (a band's columns in chunks), wide ones
    (several bands an item, band counts not a multiple of it), few programs per SM (an
    expert's items spread over rounds of 40 experts), per_sm 0 (no room: the cycle plan
    runs instead), with each band's rows from the first band's 128 shifted or from the full
    table (``swizzle_band_step``). The words the launches share for their waits are consistent after each (no
    program still counted in, no flag ahead of the launch count: the next call relies on it),
    on the default stream and on a side stream, where a launch counts itself there only."""
    from fimoe_lab.kernels import triton_gather

    for fmt, name, inter, hidden, engine in (
        ("nvfp4", "w13_scale", 256, 512, None),
        ("nvfp4", "w2_scale", 256, 512, None),
        ("mxfp8", "w13_scale", 256, 512, None),
        ("mxfp8", "w2_scale", 256, 512, None),
        ("nvfp4", "w13_scale", 384, 512, None),
        ("nvfp4", "w2_scale", 256, 640, "flashinfer-0.6.13"),  # the newer profiles pad hidden 640 to 768
    ):
        m = getattr(plan_layer(fmt, "trtllm", inter, hidden, engine=engine), name)  # 4, 6 and 5 bands
        assert m.in_bytes == m.out_bytes, "in place needs a permutation"
        for x in inputs(m, 40):
            want = reference(m, x)
            execute_in_place(
                m.compiled(),
                x,
                1,
                config={
                    "inplace": "bands",
                    "band_words": band_words,
                    "band_per_sm": per_sm,
                    "band_warps": warps,
                    "swizzle_band_step": step,
                    "local_max_words": 0,  # W2 maps too: the cooperative launch (the local one: below)
                },
            )
            torch.cuda.synchronize()
            assert torch.equal(x, want)
            assert all(_sync_consistent(c) for c in triton_gather._SYNC.values())
        side = torch.cuda.Stream()
        x = inputs(m, 40)[0]
        want = reference(m, x)
        side.wait_stream(torch.cuda.current_stream())
        before = {k: int(c[0]) for k, c in triton_gather._SYNC.items()}
        with torch.cuda.stream(side):
            execute_in_place(
                m.compiled(), x, 1, config={"inplace": "bands", "band_words": band_words, "local_max_words": 0}
            )
        side.synchronize()
        assert torch.equal(x, want)
        mine = (str(x.device), side.cuda_stream)
        assert _sync_consistent(triton_gather._SYNC[mine]) and int(triton_gather._SYNC[mine][0]) >= 1
        assert all(int(c[0]) == before[k] for k, c in triton_gather._SYNC.items() if k != mine)


def _sync_consistent(words) -> bool:
    """The cooperative launch's words between launches: nobody counted in, no flag set by a launch not yet counted."""
    return int(words[1]) == 0 and bool((words[2:] <= words[0]).all())


@pytest.mark.skipif("triton" not in GPU_BACKENDS, reason="needs triton")
@pytest.mark.parametrize("band_words", [8, 64, 256])
def test_gpu_in_place_bands_any_row_permutation(band_words):
    """The cooperative scale launch on row permutations no engine uses (random, reversed): an
    item then waits for readers spread over the whole expert (up to every item of it), where the
    gate/up interleave has two. Rows of 4 to 448 bytes, 3 to 7 bands, two calls back to back on
    the same words (the second finds the first's flags), each checked byte for byte."""
    from fimoe_lab.kernels import triton_gather
    from fimoe_lab.steps import permute_rows, swizzle_scales_128x4

    for rows, cols, order in ((384, 4, "random"), (512, 32, "reversed"), (768, 56, "random"), (896, 448, "random")):
        g = torch.Generator().manual_seed(rows + cols)
        src = torch.randperm(rows, generator=g) if order == "random" else torch.arange(rows - 1, -1, -1)
        m = permute_rows(src, cols, order, {}) >> swizzle_scales_128x4(rows, cols)
        em = m.compiled()
        assert em.swizzle is not None and not em.bands_local()
        for x in inputs(m, 37):
            want = reference(m, reference(m, x))
            for _ in range(2):
                execute_in_place(em, x, 1, config={"inplace": "bands", "band_words": band_words})
            torch.cuda.synchronize()
            assert torch.equal(x, want), (rows, cols, order)
            assert all(_sync_consistent(c) for c in triton_gather._SYNC.values())


@pytest.mark.skipif("triton" not in GPU_BACKENDS, reason="needs triton")
@pytest.mark.parametrize(
    "local_words,warps,step", [(1, 4, True), (4096, 4, False), (8192, 8, True), (1 << 20, 4, True)]
)
def test_gpu_in_place_bands_local(monkeypatch, local_words, warps, step):
    """W2 scale maps (each band reads only its own rows): one plain launch of whole bands,
    one band a program up to all of an expert's (band counts not a power of two: masked),
    rows of 2 to 64 words (6 and 12: masked 8- and 16-word rows). The cooperative kernel is not launched."""
    from fimoe_lab.kernels import triton_gather

    monkeypatch.setattr(triton_gather, "_swizzled_bands_in_place", None)  # any use of it fails
    for fmt, inter, hidden in (
        ("nvfp4", 256, 512),
        ("mxfp8", 256, 512),
        ("mxfp8", 768, 1280),
        ("nvfp4", 512, 1280),
        ("mxfp8", 1536, 768),
        ("nvfp4", 4096, 256),
    ):
        m = plan_layer(fmt, "trtllm", inter, hidden).w2_scale
        assert m.in_bytes == m.out_bytes and m.compiled().bands_local()
        for x in inputs(m, 37):
            want = reference(m, x)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                execute_in_place(
                    m.compiled(),
                    x,
                    1,
                    config={
                        "inplace": "bands",
                        "local_words": local_words,
                        "band_warps": warps,
                        "swizzle_band_step": step,
                    },
                )
            torch.cuda.synchronize()
            assert torch.equal(x, want)


@pytest.mark.skipif("triton" not in GPU_BACKENDS, reason="needs triton")
def test_gpu_in_place_bands_grid_refused_runs_cycles(monkeypatch):
    """A grid larger than the device holds at once (6000 programs; at most 32 an SM) is
    refused by the driver before anything moves: a warning, then the cycle plan."""
    from fimoe_lab.kernels import triton_gather

    m = plan_layer("nvfp4", "trtllm", 256, 512).w13_scale  # one item an expert
    m.compiled()._dev.clear()
    monkeypatch.setattr(triton_gather, "_blocks_per_sm", lambda kernel, props: 10_000)
    x = inputs(m, 6000)[0]
    want = reference(m, x)
    with pytest.warns(RuntimeWarning, match="did not start"):
        execute_in_place(m.compiled(), x, 1, config={"band_per_sm": 10_000})
    torch.cuda.synchronize()
    m.compiled()._dev.clear()
    assert torch.equal(x, want)


@pytest.mark.skipif("triton" not in GPU_BACKENDS, reason="needs triton")
def test_gpu_in_place_bands_refuses_other_maps():
    m = plan_layer("fp8", "trtllm", 256, 512).w13
    x = torch.randint(0, 256, (2, m.in_bytes), dtype=torch.uint8, device="cuda")
    before = x.clone()
    with pytest.raises(LayoutError, match="128x4 scale swizzle"):
        execute_in_place(m.compiled(), x, 1, config={"inplace": "bands"})
    assert torch.equal(x, before)


@pytest.mark.skipif("triton" not in GPU_BACKENDS, reason="needs triton")
@pytest.mark.parametrize(
    "runner,fmt,tensor,scratch,config,fail_after",
    [
        # the whole (single) launch ran, then the caller fails once
        ("inplace_swizzled_bands", "mxfp8", "w13_scale", 2, None, 0),
        # two chunks launched (tiny tiles: one expert per chunk), then the caller fails once
        ("inplace_cycles", "fp8-block", "w13", 1, {"inplace": "cycles", "cycle_slots": 2, "cycle_bw": 1}, 1),
    ],
)
def test_gpu_in_place_error_midway_is_undone(monkeypatch, runner, fmt, tensor, scratch, config, fail_after):
    from fimoe_lab.kernels import triton_gather

    m = getattr(plan_layer(fmt, "trtllm", 256, 512), tensor)
    x = torch.randint(0, 256, (9, m.in_bytes), dtype=torch.uint8, device="cuda")
    before = x.clone()
    real, fired = getattr(triton_gather, runner), []

    def flaky(em, flat, chunk, config=None):
        for i, item in enumerate(real(em, flat, chunk, config)):
            yield item
            if i == fail_after and not fired:
                fired.append(1)
                raise RuntimeError("injected between launches")

    monkeypatch.setattr(triton_gather, runner, flaky)
    with pytest.raises(InPlaceError) as info:
        execute_in_place(m.compiled(), x, scratch, config=config)
    assert fired and info.value.restored and torch.equal(x, before)


def test_gpu_in_place_error_restores_torch_path(monkeypatch):
    from fimoe_lab.kernels import torch_gather

    m = plan_layer("fp8-block", "trtllm", 256, 512).w13
    x = torch.randint(0, 256, (6, m.in_bytes), dtype=torch.uint8, device="cuda")
    before = x.clone()
    real, calls = torch_gather.gather_torch, {"n": 0}

    def flaky(em, a, b):
        calls["n"] += 1
        if calls["n"] == 3:
            b.fill_(0x5A)
            raise RuntimeError("injected")
        return real(em, a, b)

    monkeypatch.setattr(torch_gather, "gather_torch", flaky)
    with pytest.raises(InPlaceError) as info:
        execute_in_place(m.compiled(), x, 1, backend="torch", config={"inplace": "copy-then-gather"})
    assert info.value.restored and torch.equal(x, before)


def test_gpu_dispatch_prefers_triton():
    want = "triton" if "triton" in GPU_BACKENDS else "torch"
    assert kernels.pick_backend("cuda", 1 << 30) == want
    assert available_backends("cuda") == GPU_BACKENDS[::-1] + (["prebuilt"] if PREBUILT else [])


def test_gpu_apply_refuses_overlap_and_forced_backends_agree():
    m = plan_layer("fp8", "trtllm", 256, 512).w13
    x = inputs(m, 3)[0].view((3,) + m.in_shape)
    with pytest.raises(LayoutError, match="apply_"):
        m.apply(x, out=x)
    outs = [m.apply(x, backend=b) for b in GPU_BACKENDS]
    assert all(torch.equal(o, outs[0]) for o in outs) and torch.equal(outs[0].reshape(3, -1), reference(m, x))


@pytest.mark.skipif("triton" not in GPU_BACKENDS, reason="needs triton")
def test_gpu_launch_reuses_a_compiled_kernel_only_for_the_same_key():
    """``triton_launch.launch`` asks Triton once per launch key and then starts the compiled
    kernel itself: a second call with the same key adds no runner; an address that is not a
    multiple of 16 bytes (4-byte aligned: still 4-byte words), another expert count (grid)
    or another map is a new key, and every call is exact against the per-expert loop."""
    from fimoe_lab.kernels import triton_launch

    m = plan_layer("fp8", "trtllm", 256, 512).w13  # 4-byte words
    em = m.compiled()
    triton_launch._RUNNERS.clear()
    for experts, offset in ((3, 0), (3, 0), (3, 4), (5, 0), (5, 4), (3, 0)):
        for x in inputs(m, experts):
            buf = torch.zeros((experts, m.in_bytes + 16), dtype=torch.uint8, device="cuda")
            xs = buf.view(-1)[offset : offset + experts * m.in_bytes].view(experts, m.in_bytes)
            xs.copy_(x)
            ob = torch.zeros(experts * m.out_bytes + 16, dtype=torch.uint8, device="cuda")
            out = ob[offset : offset + experts * m.out_bytes].view(experts, m.out_bytes)
            execute(em, xs, out, backend="triton")
            torch.cuda.synchronize()
            assert torch.equal(out, reference(m, x))
    assert len(triton_launch._RUNNERS) == 4  # (3, aligned) (3, offset 4) (5, aligned) (5, offset 4)


# the layers engines prepare, at model sizes (fewer experts): every map of the plan and of the drop-ins
MODEL_LAYERS = [("fp8", 256, 7168), ("fp8-block", 256, 7168), ("mxfp8", 256, 7168), ("bf16", 192, 4096)]
MODEL_LAYERS += [("nvfp4", 256, 7168), ("mxfp4", 2880, 2880)]


def engine_maps():
    from fimoe_lab.prepare import drop_in_maps

    for fmt, inter, hidden in MODEL_LAYERS:
        plan = plan_layer(fmt, "trtllm", inter, hidden)
        maps = {f"plan-{k}": m for k, m in plan.maps().items()}
        maps |= {k: m for k, (m, _) in drop_in_maps(fmt, plan.padded_intermediate, plan.padded_hidden).items()}
        for name, m in maps.items():
            yield pytest.param(m, id=f"{fmt}-{inter}x{hidden}-{name}")


@pytest.mark.parametrize("m", list(engine_maps()))
def test_gpu_strided_copies_bit_exact_at_model_sizes(m):
    """The strided copies (and two-stage strided copies) on the GPU against the byte loop."""
    em = m.compiled()
    assert em.strided is not None or em.stages is not None
    for x in inputs(m, 2):
        out = torch.full((2, m.out_bytes), 0xAB, dtype=torch.uint8, device="cuda")
        execute(em, x, out, backend="torch")
        torch.cuda.synchronize()
        assert torch.equal(out, reference(m, x))
        if em.is_permutation and em.strided is not None:
            y = x.clone()
            execute_in_place(em, y, 1, backend="torch")
            torch.cuda.synchronize()
            assert torch.equal(y, out)


# ----------------------------------------------------------------------------- the prebuilt cycle kernel
def in_place_maps():
    """Every permutation the drop-ins and the layer plans run in place, at test and production sizes."""
    from fimoe_lab.prepare import drop_in_maps

    for fmt, inter, hidden, kw in CASES:
        for name, m in plan_layer(fmt, "trtllm", inter, hidden, **kw).maps().items():
            if m.is_permutation:
                yield pytest.param(m, id=f"layer-{fmt}-{inter}x{hidden}-{len(kw)}-{name}")
    for fmt, inter, hidden in (("fp8", 256, 7168), ("bf16", 192, 4096), ("fp8", 96, 256), ("bf16", 64, 256)):
        for name, (m, in_place) in drop_in_maps(fmt, inter, hidden).items():
            if in_place:
                yield pytest.param(m, id=f"drop-in-{fmt}-{inter}x{hidden}-{name}")


@pytest.mark.skipif(not PREBUILT, reason="needs the prebuilt kernels to load here")
@pytest.mark.parametrize("scratch", [1, None])
@pytest.mark.parametrize("m", list(in_place_maps()))
def test_gpu_prebuilt_cycles_bit_exact(m, scratch):
    """The prebuilt cycle kernel against the byte-loop reference, on coordinate-coded and random bytes, in
    16-byte words and (the buffer one word off) in 4-byte and single-byte words."""
    experts = 3 if m.in_bytes > (1 << 22) else 5
    for x in inputs(m, experts):
        for shift in (0, 4, 1):
            raw = torch.empty((x.numel() + 16,), dtype=torch.uint8, device="cuda")
            y = raw[shift : shift + x.numel()].view(x.shape)
            y.copy_(x)
            want = reference(m, x)
            execute_in_place(m.compiled(), y, scratch, backend="prebuilt")
            torch.cuda.synchronize()
            assert torch.equal(y, want), (shift, scratch)


CLUSTERS = PREBUILT and torch.cuda.get_device_capability()[0] >= 9


def cluster_maps():
    """Engine maps in place whose expert a cluster holds (test sizes, and TP8 ranks of Qwen3-235B, DeepSeek-V3 and
    DeepSeek-R1)."""
    for param in in_place_maps():
        if prebuilt.clusters_fit(param.values[0].compiled()):
            yield param
    for fmt, inter, hidden, name in (
        ("bf16", 256, 4096, "w13"),
        ("bf16", 256, 4096, "w2"),
        ("fp8-block", 256, 7168, "w13"),
        ("nvfp4", 256, 7168, "w2"),
        ("fp8", 256, 7168, "w13"),
    ):
        yield pytest.param(getattr(plan_layer(fmt, "trtllm", inter, hidden), name), id=f"tp8-{fmt}-{name}")


@pytest.mark.skipif(not CLUSTERS, reason="needs the prebuilt kernels and an sm_90 or newer GPU")
@pytest.mark.parametrize("m", list(cluster_maps()))
def test_gpu_prebuilt_clusters_bit_exact(m):
    """The ``clusters`` strategy (asked for) against the byte-loop reference on coordinate-coded and random bytes;
    a buffer off 16 bytes is refused before anything moved (the cluster kernel moves 16-byte words)."""
    experts = 3 if m.in_bytes > (1 << 22) else 5
    config = {"inplace": "clusters"}
    for x in inputs(m, experts):
        y, want = x.clone(), reference(m, x)
        execute_in_place(m.compiled(), y, backend="prebuilt", config=config)
        torch.cuda.synchronize()
        assert torch.equal(y, want)
    raw = torch.empty((x.numel() + 16,), dtype=torch.uint8, device="cuda")
    y = raw[4 : 4 + x.numel()].view(x.shape)
    y.copy_(x)
    with pytest.raises(InPlaceError, match="failed after 0 of") as refused:
        execute_in_place(m.compiled(), y, backend="prebuilt", config=config)
    assert "16-byte aligned" in str(refused.value.__cause__) and torch.equal(y, x)


@pytest.mark.skipif(not CLUSTERS, reason="needs the prebuilt kernels and an sm_90 or newer GPU")
def test_gpu_prebuilt_clusters_after_a_map_that_stages_less():
    """A map that stages 128 KiB a block, then one that stages nothing, then the first again: each launch has the
    shared memory it asks for."""
    big = plan_layer("bf16", "trtllm", 256, 4096).w13
    small = next(iter(cluster_maps())).values[0]
    for m in (big, small, big):
        x = next(iter(inputs(m, 3)))
        want = reference(m, x)
        execute_in_place(m.compiled(), x, backend="prebuilt", config={"inplace": "clusters"})
        torch.cuda.synchronize()
        assert torch.equal(x, want)


@pytest.mark.skipif(not PREBUILT, reason="needs the prebuilt kernels to load here")
@pytest.mark.parametrize("cells,cell_bytes", [(1, 16), (7, 1), (4096, 4), (3000, 48), (517, 7168), (64, 1 << 16)])
def test_gpu_prebuilt_cycles_random_permutations(cells, cell_bytes):
    """Random permutations of cells of many widths (long cycles cut by every tile edge), 1-9 experts, every
    scratch from one expert up."""
    from fimoe_lab.layout import IndexMap

    g = torch.Generator().manual_seed(cells * 7 + cell_bytes)
    m = IndexMap(torch.randperm(cells, generator=g), cell_bytes, (cells * cell_bytes,), (cells * cell_bytes,))
    for experts in (1, 4, 9):
        for scratch in (1, 2, experts):
            x = torch.randint(0, 256, (experts, m.in_bytes), dtype=torch.uint8, device="cuda")
            want = reference(m, x)
            execute_in_place(m.compiled(), x, scratch, backend="prebuilt")
            torch.cuda.synchronize()
            assert torch.equal(x, want), (experts, scratch)


@pytest.mark.skipif(not PREBUILT, reason="needs the prebuilt kernels to load here")
def test_gpu_prebuilt_cycles_kept_launches_run_at_new_addresses(monkeypatch):
    """The cycle kernel's launches are made once per call kind (address modulo 16, experts, scratch) and run again at
    later calls' addresses: chunks of two experts and a last one of one, buffers at new addresses 16-byte aligned and
    4 and 1 bytes off, each call bit-exact against the byte-loop reference; no launch is made again for a kind seen."""
    from fimoe_lab.kernels import cuda_driver
    from fimoe_lab.kernels.cycles import CyclePlan
    from fimoe_lab.layout import IndexMap

    g = torch.Generator().manual_seed(11)
    m = IndexMap(torch.randperm(3000, generator=g), 48, (3000 * 48,), (3000 * 48,))
    em = m.compiled()
    monkeypatch.setattr(CyclePlan, "experts_per_chunk", lambda self, cell_bytes, scratch_bytes, experts: 2)
    made = []

    class Counted(cuda_driver.Bound):
        def __init__(self, *args, **kwargs):
            made.append(args[1])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(cuda_driver, "Bound", Counted)
    seen = set()
    for shift in (0, 16, 4, 1, 0, 4, 1):
        before = len(made)
        for x in inputs(m, 5):
            raw = torch.empty((x.numel() + 32,), dtype=torch.uint8, device="cuda")
            y = raw[shift : shift + x.numel()].view(x.shape)
            y.copy_(x)
            execute_in_place(em, y, 2, backend="prebuilt", config={"inplace": "cycles"})
            torch.cuda.synchronize()
            assert torch.equal(y, reference(m, x)), shift
        # a new kind: saves and tiles for the full chunks and for the last one; a kind seen (16 is 0 modulo 16): none
        assert len(made) - before == (0 if shift % 16 in seen else 4), shift
        seen.add(shift % 16)
    assert len(set(made)) == 3  # the three kinds move 16-, 4- and 1-byte words: a kernel each


@pytest.mark.skipif(not PREBUILT, reason="needs the prebuilt kernels to load here")
def test_gpu_prebuilt_error_midway_is_undone(monkeypatch):
    from fimoe_lab.kernels import prebuilt as module
    from fimoe_lab.kernels.cycles import CyclePlan

    m = plan_layer("fp8-block", "trtllm", 256, 512).w13
    x = torch.randint(0, 256, (9, m.in_bytes), dtype=torch.uint8, device="cuda")
    before = x.clone()
    real, fired = module.inplace_cycles, []
    # one expert per chunk (what a scratch smaller than two experts' saved cells gives), so launches follow the error
    monkeypatch.setattr(CyclePlan, "experts_per_chunk", lambda self, cell_bytes, scratch_bytes, experts: 1)

    def flaky(em, flat, chunk):
        for i, item in enumerate(real(em, flat, chunk)):
            yield item
            if i == 1 and not fired:
                fired.append(1)
                raise RuntimeError("injected between launches")

    monkeypatch.setattr(module, "inplace_cycles", flaky)
    with pytest.raises(InPlaceError) as info:  # the cycle kernel asked for: auto may take the clusters for this map
        execute_in_place(m.compiled(), x, 1, backend="prebuilt", config={"inplace": "cycles"})
    assert fired and info.value.restored and torch.equal(x, before)


STEADY_CHILD = """
import json, os, sys, torch
from reference_loops import byte_gather
from fimoe_lab import kernels
from fimoe_lab.kernels import prebuilt, registry
from fimoe_lab.prepare import drop_in_maps
fmt, inter, hidden, tensor = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
m = drop_in_maps(fmt, inter, hidden)[tensor][0]
em = m.compiled()
for _ in range(6):  # the first calls, until the planner has readied the map and a call kept auto's choice
    y = torch.randint(0, 256, (5, m.in_bytes), dtype=torch.uint8, device="cuda")
    kernels.execute_in_place(em, y)
    torch.cuda.synchronize()
    prebuilt.wait_for_plans()
loaded = registry.executor_ready(registry.pick_backend("cuda", 1))
kept = registry.kept_in_place(em, y.device, y.numel()) is not None
asked, real = [], kernels.get_executor
kernels.get_executor = lambda *a, **k: asked.append(1) or real(*a, **k)
codes = torch.arange(5 * (m.in_bytes // 4), dtype=torch.int32, device="cuda").add_(1).view(torch.uint8).view(5, -1)
exact = []
for x in (codes, torch.randint(0, 256, (5, m.in_bytes), dtype=torch.uint8, device="cuda")):
    y, want = x.clone(), byte_gather(m, x)
    kernels.execute_in_place(em, y)
    torch.cuda.synchronize()
    exact.append(torch.equal(y, want) and not torch.equal(x, want))
steady_asked = len(asked)
os.environ["FIMOE_PREBUILT_KERNELS"] = "0"
dropped = registry.kept_in_place(em, y.device, y.numel()) is None
y = x.clone()
kernels.execute_in_place(em, y)
torch.cuda.synchronize()
exact.append(torch.equal(y, want))
print(json.dumps([loaded, kept, exact, steady_asked, dropped, len(asked) > steady_asked]))
"""


@pytest.mark.skipif(not PREBUILT, reason="needs the prebuilt kernels to load here")
@pytest.mark.parametrize(
    "fmt,inter,hidden,tensor",
    [
        ("bf16", 256, 512, "trtllm_block_layout/w13"),
        ("bf16", 256, 4096, "trtllm_block_layout/w13"),  # no cluster holds an expert: the cycle kernel
        ("fp8", 128, 1024, "rotate/w13"),
        ("fp8", 128, 1024, "rotate/w2"),
    ],
)
def test_gpu_steady_in_place_calls_skip_the_choice_and_stay_exact(fmt, inter, hidden, tensor):
    """Default in-place calls of a drop-in map in a fresh process: once the map is ready for the prebuilt kernels, a
    call runs the strategy ``auto`` chose there without asking the registry (its calls counted), bit-exact on
    coordinate-coded and random bytes, on buffers at new addresses; with the prebuilt kernels turned off the next call
    asks again."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    here = pathlib.Path(__file__).resolve().parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(here.parent), str(here), env.get("PYTHONPATH", "")])
    args = [sys.executable, "-c", STEADY_CHILD, fmt, str(inter), str(hidden), tensor]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded, kept, exact, steady_asked, dropped, asked_again = json.loads(done.stdout.strip().splitlines()[-1])
    assert not loaded, "the default executor loaded in a fresh process: the prebuilt kernels no longer stand in"
    assert kept and exact == [True, True, True] and steady_asked == 0 and dropped and asked_again


RECORD_FATBIN_LOADS = """
import threading
from fimoe_lab.kernels import cuda_driver
loaded_by = []  # each fatbin and the thread that loads it
real_module = cuda_driver._module
def recording_module(source, device):
    if (source, device) not in cuda_driver._MODULES:
        loaded_by.append([source, threading.current_thread().name])
    return real_module(source, device)
cuda_driver._module = recording_module
"""
"""A child script's prologue: every fatbin the process loads, and the thread that loads it, into ``loaded_by``."""


READ_BACK_CYCLES_CHILD = (
    RECORD_FATBIN_LOADS
    + """
import json, sys, threading, torch
from reference_loops import bf16_block_layout
from fimoe_lab import prepare
from fimoe_lab.kernels import cuda_driver, prebuilt
launches = []
real_launches = prebuilt._cycle_launches
prebuilt._cycle_launches = lambda *a: launches.append(threading.current_thread().name) or real_launches(*a)
rows, hidden, inter = 512, 4096, 256
def layer(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randint(0, 256, (6, rows, 2 * hidden), dtype=torch.uint8, device="cuda", generator=g)
    w2 = torch.randint(0, 256, (6, hidden, 2 * inter), dtype=torch.uint8, device="cuda", generator=g)
    return w13.view(torch.bfloat16), w2.view(torch.bfloat16)
calls = int(sys.argv[1])
exact = []
for k in range(calls):
    w13, w2 = layer(k)
    want = bf16_block_layout(w13.clone(), w2.clone(), True)
    got = prepare.convert_moe_weights_to_flashinfer_trtllm_block_layout({}, w13, w2)
    torch.cuda.synchronize()
    exact.append(all(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)) for a, b in zip(got, want)))
    prebuilt.wait_for_plans()
print(json.dumps([exact, loaded_by, launches]))
"""
)


@pytest.mark.skipif(not PREBUILT, reason="needs the prebuilt kernels to load here")
def test_gpu_an_in_place_first_call_along_a_cycle_plan_read_back_loads_no_strided_kernel(tmp_path):
    """Two fresh processes sharing a plan store: the first runs the BF16 block layout drop-in (its maps permuted in
    place by the cycle kernel once the planner built their cycle plans, which its later calls write to the store); the
    second reads the plan with those cycle plans, and its first call runs the cycle kernel at once: the caller loads
    the cycle kernel's fatbin and not the strided kernel's (which stands in only until a cycle plan is built), and
    the bytes are the reference loop's."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    here = pathlib.Path(__file__).resolve().parent
    env = {k: v for k, v in os.environ.items() if k != "FIMOE_PREBUILT_KERNELS"}
    env.update(FIMOE_LAB_CACHE=str(tmp_path), FIMOE_LAB_PLAN_STORE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(here.parent), str(here), env.get("PYTHONPATH", "")])

    def run(calls: int) -> list:
        args = [sys.executable, "-c", READ_BACK_CYCLES_CHILD, str(calls)]
        done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    exact, first_loads, _ = run(4)
    assert exact == [True] * 4 and ["strided", "MainThread"] in first_loads  # no cycle plan yet: strided stands in
    exact, loads, launches = run(1)
    assert exact == [True]
    main = [source for source, thread in loads if thread == "MainThread"]
    assert "strided" not in main and "cycles" in main, loads
    assert launches[:2] == ["MainThread", "MainThread"], launches  # W13's and W2's launches, in the first call


LAYER_KEPT_CHILD = """
import json, os, torch
from reference_loops import byte_gather
from fimoe_lab import plan as plan_module
from fimoe_lab.kernels import prebuilt
from fimoe_lab.recipes import plan_layer
NAMES = ("w13", "w2", "w13_scale", "w2_scale")
rows = []
for fmt, inter, hidden in (("nvfp4", 256, 512), ("mxfp4", 96, 320), ("fp8-block", 256, 512), ("bf16", 96, 160)):
    plan = plan_layer(fmt, "trtllm", inter, hidden)
    maps = {n: m for n, m in plan.maps().items() if n not in plan.word_bits}

    def layer(seed, structured=False):
        g = torch.Generator(device="cuda").manual_seed(seed)
        t = {}
        for n, m in plan.maps().items():
            if structured and m.in_bytes % 4 == 0:
                codes = torch.arange(5 * m.in_bytes // 4, dtype=torch.int32, device="cuda").add_(seed)
                t[n] = codes.view(torch.uint8).view(5, *m.in_shape)
            else:
                t[n] = torch.randint(0, 256, (5, *m.in_shape), dtype=torch.uint8, device="cuda", generator=g)
        return t

    def run(t):
        out = dict(zip(NAMES, plan.apply(*(t.get(n) for n in NAMES))))
        torch.cuda.synchronize()
        return all(torch.equal(out[n].view(torch.uint8).reshape(5, -1), byte_gather(m, t[n].reshape(5, -1)))
                   for n, m in maps.items())

    for seed in range(6):  # the first layers, until the planner has readied the maps
        run(layer(seed))
        prebuilt.wait_for_plans()
    kept = sorted(n for n, m in maps.items()
                  if any(isinstance(k, tuple) and k[:1] == (prebuilt._KEPT_LAUNCHES,) for k in m.compiled()._dev))
    executed, real = [], plan_module.execute
    plan_module.execute = lambda em, x, out: executed.append(em) or real(em, x, out)
    exact = [run(layer(100)), run(layer(101, structured=True))]
    steady = len(executed)
    os.environ["FIMOE_PREBUILT_KERNELS"] = "0"
    exact.append(run(layer(102)))
    del os.environ["FIMOE_PREBUILT_KERNELS"]
    plan_module.execute = real
    rows.append([fmt, len(maps), kept, exact, steady, len(executed) - steady])
print(json.dumps(rows))
"""


@pytest.mark.skipif(not PREBUILT, reason="needs the prebuilt kernels to load here")
def test_gpu_steady_layers_run_kept_launches_and_stay_exact():
    """A layer plan's steady calls in a fresh process: each map whose launches the prebuilt kernels kept runs them
    without the executor's choice or checks (``kernels.execute`` is not called for it), the others (the small
    padded BF16 maps, which torch's strided copies run) go through ``execute``; every output bit-exact against the byte-loop reference on random and coordinate-coded layers;
    with the prebuilt kernels turned off every map goes through ``execute`` again."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    here = pathlib.Path(__file__).resolve().parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(here.parent), str(here), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", LAYER_KEPT_CHILD], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    for fmt, n_maps, kept, exact, steady, after in json.loads(done.stdout.strip().splitlines()[-1]):
        assert exact == [True, True, True], fmt
        assert kept or fmt == "bf16", f"{fmt}: no map kept its launches"  # bf16's small padded maps: torch's copies
        assert steady == 2 * (n_maps - len(kept)), (fmt, kept, steady)
        assert after == n_maps, (fmt, after)


PREBUILT_CHILD = (
    RECORD_FATBIN_LOADS
    + """
import json, sys, threading, torch
from fimoe_lab import prepare
from fimoe_lab.kernels import cuda_driver, prebuilt, registry
g = torch.Generator(device="cuda").manual_seed(0)
w13 = torch.randint(0, 256, (16, 512, 7168), dtype=torch.uint8, device="cuda", generator=g)
w2 = torch.randint(0, 256, (16, 7168, 256), dtype=torch.uint8, device="cuda", generator=g)
a13, a2 = w13.clone(), w2.clone()
plan = prepare.plan_rotate_fp8_per_tensor(512, 7168, 256, True)
em = plan.w13.compiled()
def chosen():
    return registry.get_executor(None, "cuda", w13.nbytes, em=em, in_place=True).name
from fimoe_lab.prepare import plan_layer
stages = plan_layer("mxfp4", "trtllm", 2880, 2880).w13_scale.compiled()  # two strided stages, then swizzled
swizzled = plan_layer("nvfp4", "trtllm", 256, 7168).w13_scale.compiled()  # one strided view, then swizzled
def gathers_of(*ems):
    return [registry.get_executor(None, "cuda", 1 << 30, em=e).name for e in ems]
gathers = gathers_of(em, stages, swizzled)  # before their sources and row forms
prebuilt.wait_for_plans()
gathers += gathers_of(em, stages, swizzled)
first = chosen()  # no cycle plan yet: the strided kernel now, the plan asked for in the background
prepare.rotate_weights_for_fi_trtllm_fp8_per_tensor_moe(w13, w2, True)  # the first layer
prebuilt.wait_for_plans()
after = chosen()
prepare.rotate_weights_for_fi_trtllm_fp8_per_tensor_moe(w13, w2, True)  # a later layer: the prebuilt kernel
torch.cuda.synchronize()
twice13 = plan.w13.apply(plan.w13.apply(a13, backend="torch"), backend="torch")
twice2 = plan.w2.apply(plan.w2.apply(a2, backend="torch"), backend="torch")
assert stages.stages is not None and em.strided is not None
print(json.dumps([gathers, first, after, "triton" not in sys.modules, torch.equal(w13, twice13), torch.equal(w2, twice2),
                  loaded_by]))
"""
)


@pytest.mark.parametrize("user", ["tables", "cycle plan"])
def test_gpu_tables_copied_without_waiting_are_read_in_order_from_another_stream(user):
    """A table copied to the device without waiting for its stream (queued behind 0.1 s of work on stream ``a``) and
    used next on stream ``b`` holds its values there: ``b`` waits for the copy; after it has landed, the same tensors
    come back with nothing left to wait for."""
    import numpy as np

    from fimoe_lab.kernels.cycles import plan_permutation
    from fimoe_lab.kernels.device_tables import DeviceTables

    dev = torch.device("cuda")
    p = np.random.default_rng(5).permutation(1 << 20).astype(np.int32)
    plan = plan_permutation(p, p.size, False, 64)
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(a):
        torch.cuda._sleep(2_000_000_000 // 10)  # about 0.1 s of device work at 2 GHz: the copies land after it
        made = DeviceTables((p,), dev, wait=False) if user == "tables" else None
        want = (p,) if user == "tables" else (plan.dst, plan.src, plan.saved)
        got = made.ready() if made is not None else plan.on(dev)
    with torch.cuda.stream(b):
        seen = [t.clone() for t in (made.ready() if made is not None else plan.on(dev))]
    torch.cuda.synchronize()
    for t, w in zip(seen, want):
        assert np.array_equal(t.cpu().numpy(), w)
    again = made.ready() if made is not None else plan.on(dev)
    assert all(x is y for x, y in zip(again, got))
    if made is not None:
        assert made._done is None  # landed: later uses wait for nothing


@pytest.mark.skipif(not PREBUILT, reason="needs the prebuilt kernels to load here")
@pytest.mark.parametrize("hidden,runs", [(512, False), (2880, True)], ids=["a-row-at-a-time", "runs-of-rows"])
def test_gpu_kept_swizzle_launches_wait_for_their_row_table_on_another_stream(hidden, runs):
    """A scale map's row table (and its tiles' runs of rows, for 90-byte rows) copied to the device without waiting,
    queued behind 0.1 s of work on stream ``a``; the map's first call on ``a`` runs the swizzle kernel and keeps its
    launches; the next call, on stream ``b``, runs the kept launches, which wait for the tables there: both outputs
    are the torch executor's bytes."""
    em = plan_layer("mxfp4", "trtllm", 384, hidden).w13_scale.compiled()
    em._dev.clear()  # no table on the device yet, no kept launches
    assert prebuilt.swizzles(em)
    form = em.swizzled_rows
    assert (prebuilt.swizzle_spans(form[0], form[1], form[2]) is not None) == runs
    x = torch.randint(0, 256, (8, em.in_bytes), dtype=torch.uint8, device="cuda")
    want = torch.empty((8, em.out_bytes), dtype=torch.uint8, device="cuda")
    execute(em, x, out=want, backend="torch")
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(a):
        torch.cuda._sleep(2_000_000_000 // 10)
        prebuilt.swizzle_rows_table(em, x.device)  # as a caller's first call copies it
        assert prebuilt.swizzle_ready(em, x.device)
        first = torch.full_like(want, 0x5A)
        prebuilt.gather(em, x, first)
    with torch.cuda.stream(b):
        second = torch.full_like(want, 0x5A)
        prebuilt.gather(em, x, second)
    torch.cuda.synchronize()
    assert torch.equal(first, want) and torch.equal(second, want)


@pytest.mark.skipif(not PREBUILT, reason="needs the prebuilt kernels to load here")
def test_gpu_plan_built_for_a_device_without_index_serves_calls_on_it():
    """``build_plan`` given ``"cuda"`` (no index) readies the map for the current device's calls: a scale map of the
    strided form then runs on the swizzle kernel for tensors on ``cuda:N`` (its table is ready there), not on two
    strided stages; the bytes are the torch executor's."""
    em = plan_layer("nvfp4", "trtllm", 256, 1024).w13_scale.compiled()
    em._dev.clear()
    assert prebuilt.runs_strided(em) and prebuilt.swizzles(em)
    prebuilt.build_plan(em, False, torch.device("cuda"))
    x = torch.randint(0, 256, (4, em.in_bytes), dtype=torch.uint8, device="cuda")
    assert x.device.index is not None and prebuilt.swizzle_ready(em, x.device)
    want = torch.empty((4, em.out_bytes), dtype=torch.uint8, device="cuda")
    execute(em, x, out=want, backend="torch")
    got = torch.full_like(want, 0x5A)
    prebuilt.gather(em, x, got)
    torch.cuda.synchronize()
    assert torch.equal(got, want)


@pytest.mark.skipif(not PREBUILT, reason="needs the prebuilt kernels to load here")
def test_gpu_fresh_process_prebuilt_stand_in():
    """By default a fresh process rotates FP8 weights in place on the strided kernel (each chunk copied aside and
    gathered back) while the map is planned in the background, then on the cluster kernel (sm_90 and newer: cells of
    7,168 bytes) or the cycle kernel; a gather of one strided view or of two strided stages runs on the strided
    kernel from its first call (its fatbin loaded by that call, in the caller's thread), and on the swizzle kernel
    once its row forms are found in the background; no Triton import; the bytes of torch's gather; the planner
    thread loads the swizzle and cycle kernels' fatbins, and the cluster kernels' where they run (no map here needs
    the gather kernel's)."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "FIMOE_PREBUILT_KERNELS"}
    env["PYTHONPATH"] = str(pathlib.Path(__file__).resolve().parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", PREBUILT_CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got, planner = json.loads(done.stdout.strip().splitlines()[-1]), "fimoe-lab-prebuilt-plans"
    assert got[:6] == [["prebuilt"] * 6, "prebuilt", "prebuilt", True, True, True]
    loads = [tuple(pair) for pair in got[6]]
    assert loads[0] == ("strided", "MainThread")
    # the cluster fatbin: by the rotate's first call or by the planner, whichever asks first (the recording wrapper
    # may see both ask before either has it; the driver module loads it once, under its lock)
    cluster = [thread for source, thread in loads[1:] if source == "cluster"]
    assert sorted(pair for pair in loads[1:] if pair[0] != "cluster") == [("cycles", planner), ("swizzle", planner)]
    assert bool(cluster) == CLUSTERS and set(cluster) <= {"MainThread", planner}
