"""Executors are bit-exact with the map they run (CPU: numba and torch paths).

The reference is a per-expert loop written here: for each expert, every output byte
is the input byte the map names (or the fill byte). Inputs are structured (each 4-byte
word encodes (expert, row, col)) and random; outputs are poisoned before each run.
No timing here: benchmarks/bench_transforms.py measures speed.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import coords, random_bytes
from reference_loops import byte_gather as reference

from fimoe_lab import kernels
from fimoe_lab.errors import FormatError, LayoutError
from fimoe_lab.kernels import EXECUTORS, InPlaceError, available_backends, execute, execute_in_place
from fimoe_lab.plan import apply_map
from fimoe_lab.prepare import MoELayerSpec, plan_fp4_trtllm_weights, plan_fp8_moe_layer, plan_layer

HAS_NUMBA = importlib.util.find_spec("numba") is not None
CPU_BACKENDS = ["torch"] + (["numba"] if HAS_NUMBA else [])

# (format, intermediate, hidden, plan_layer kwargs): every core weight/scale transform,
# with padding (non-gated FP8 pads I to 128, MXFP8 pads I 128 / H 256) and swap composed in.
CASES = [
    ("fp8", 256, 512, {}),
    ("fp8", 232, 320, dict(is_act_and_mul=False, is_gated=False)),  # pads 232 -> 256
    ("fp8", 200, 256, {}),  # gated, pads 200 -> 208
    ("fp8-block", 256, 512, {}),
    ("mxfp8", 256, 512, {}),
    ("mxfp8", 192, 320, {}),  # pads I 192 -> 256, H 320 -> 512, scales with 127
    ("nvfp4", 256, 512, {}),
    ("bf16", 256, 256, {}),
    ("bf16", 96, 160, {}),  # pads to 64-multiples
]


def all_maps():
    out = []
    for fmt, inter, hidden, kw in CASES:
        plan = plan_layer(fmt, "trtllm", inter, hidden, **kw)
        for name, m in plan.maps().items():
            out.append(
                pytest.param(m, id=f"{fmt}-{inter}x{hidden}-{'-'.join(f'{k}{v}' for k, v in kw.items())}-{name}")
            )
    return out


def structured(m, experts: int) -> torch.Tensor:
    """uint8 ``(E, in_bytes)`` whose 4-byte words encode (expert, position) (random tail)."""
    words, rest = divmod(m.in_bytes, 4)
    body = coords(experts, 1, words).reshape(experts, -1).view(torch.uint8)
    if rest:
        body = torch.cat([body, random_bytes((experts, rest), torch.uint8, seed=7)], dim=1)
    return body.contiguous()


def run(m, x, backend):
    out = torch.full((x.shape[0], m.out_bytes), 0xAB, dtype=torch.uint8, device=x.device)
    execute(m.compiled(), x, out, backend=backend)
    return out


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("m", all_maps())
def test_bit_exact_structured_and_random(m, backend):
    for x in (structured(m, 3), random_bytes((2, m.in_bytes), torch.uint8, seed=m.in_bytes % 1000)):
        assert torch.equal(run(m, x, backend), reference(m, x))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.int32])
def test_dtypes_and_apply(backend, dtype):
    """``IndexMap.apply`` on typed tensors goes through the chosen backend bit-exactly."""
    m = plan_layer("bf16", "trtllm", 256, 256).w13
    size = torch.empty((), dtype=dtype).element_size()
    x = random_bytes((2,) + m.in_shape[:-1] + (m.in_shape[-1] // size,), dtype, seed=3)
    y = m.apply(x, backend=backend)
    assert y.dtype == dtype
    assert torch.equal(y.reshape(2, -1).view(torch.uint8), reference(m, x))


@pytest.mark.parametrize("m", all_maps())
def test_apply_map_writes_into_a_given_out_of_any_dtype(m):
    """``apply_map(..., out=buf)`` writes the result's bytes into ``buf`` (its own dtype and shape) and returns a
    view of it; a ``buf`` of another size, device or a strided one is refused and left as it was."""
    for x in (structured(m, 3), random_bytes((2, m.in_bytes), torch.uint8, seed=m.in_bytes % 997)):
        want = reference(m, x)
        e = x.shape[0]
        buf = torch.full((e * m.out_bytes // 2,), -21555, dtype=torch.int16) if m.out_bytes % 2 == 0 else None
        buf = torch.full((e, m.out_bytes), 0xAB, dtype=torch.uint8) if buf is None else buf
        y = apply_map(m, x, "x", out=buf)
        assert y.data_ptr() == buf.data_ptr()
        assert torch.equal(buf.view(torch.uint8).reshape(e, -1), want)
        assert torch.equal(y.reshape(e, -1).view(torch.uint8), want)
    for bad in (
        torch.full((e, m.out_bytes + 1), 7, dtype=torch.uint8),
        torch.full((e, 2 * m.out_bytes), 7, dtype=torch.uint8)[:, ::2],
    ):
        before = bad.clone()
        with pytest.raises(LayoutError, match="the map writes"):
            apply_map(m, x, "x", out=bad)
        assert torch.equal(bad, before)
    if m.out_bytes == m.in_bytes:  # the input as its own output: a gather cannot write over what it reads
        before = x.clone()
        with pytest.raises(LayoutError, match="overlaps"):
            apply_map(m, x, "x", out=x)
        assert torch.equal(x, before)


def test_apply_tensor_writes_into_out_whichever_step_comes_last():
    """A plan with a word bit step after its byte map (forward) and before it (inverse) gives the same bytes into
    ``out`` as without one, for every tensor."""
    from fimoe_lab import recipes

    plan = recipes.plan_layer("mxfp4", "cutlass", 96, 160, activation_dtype="bf16")
    xs = [random_bytes((2, *s), torch.uint8, seed=i) for i, s in enumerate([(192, 80), (160, 48), (192, 5), (160, 3)])]
    xs[0] = coords(2, 192, 20).view(torch.uint8)
    for p, ins in ((plan, xs), (plan.inverse(), plan.apply(*xs))):
        for n, x in zip(("w13", "w2", "w13_scale", "w2_scale"), ins):
            want = p.apply_tensor(n, x)
            buf = torch.full((want.nbytes,), 0x5A, dtype=torch.uint8)
            got = p.apply_tensor(n, x, out=buf)
            assert got.data_ptr() == buf.data_ptr() and got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(buf, want.contiguous().reshape(-1).view(torch.uint8)), n
            short = torch.full((want.nbytes - 4,), 0x5A, dtype=torch.uint8)
            with pytest.raises(LayoutError, match="cannot hold|the map writes"):
                p.apply_tensor(n, x, out=short)
            assert bool((short == 0x5A).all())


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_unaligned_buffers_fall_back_to_narrow_words(backend):
    m = plan_layer("fp8", "trtllm", 256, 512).w13
    raw = random_bytes((2 * m.in_bytes + 1,), torch.uint8, seed=5)
    x = raw[1:].view(2, m.in_bytes)  # odd address: only 1-byte words are legal
    assert x.data_ptr() % 2 == 1
    assert torch.equal(run(m, x, backend), reference(m, x))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("experts,scratch", [(5, 1), (7, 3), (3, None)])
def test_in_place_matches_out_of_place(backend, experts, scratch):
    # rows of 512 and 2048 bytes (numba: generic path and cycle plan), scales, 128-byte blocks
    for m in (
        plan_layer("fp8", "trtllm", 256, 512).w13,
        plan_layer("fp8", "trtllm", 256, 2048).w13,
        plan_layer("nvfp4", "trtllm", 256, 512).w13_scale,
        plan_layer("bf16", "trtllm", 256, 256).w2,
    ):
        for x in (random_bytes((experts, m.in_bytes), torch.uint8, seed=experts), structured(m, experts)):
            want = reference(m, x)
            execute_in_place(m.compiled(), x, scratch, backend=backend)
            assert torch.equal(x, want)


GATHERS = {"torch": ("torch_gather", "gather_torch"), "numba": ("numba_gather", "gather_numba")}


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_in_place_error_midway_restores_input(monkeypatch, backend):
    """copy-then-gather: the third chunk's gather half-writes its experts, then fails."""
    module = importlib.import_module(f"fimoe_lab.kernels.{GATHERS[backend][0]}")
    real = getattr(module, GATHERS[backend][1])
    m = plan_layer("fp8-block", "trtllm", 256, 512).w13
    x = random_bytes((6, m.in_bytes), torch.uint8, seed=11)
    before = x.clone()
    calls = {"n": 0}

    def flaky(em, a, b):
        calls["n"] += 1
        if calls["n"] == 3:  # third chunk: after two chunks are already in the output layout
            b.view(torch.uint8).fill_(0x5A)  # half-written chunk
            raise MemoryError("injected")
        return real(em, a, b)

    monkeypatch.setattr(module, GATHERS[backend][1], flaky)
    with pytest.raises(InPlaceError) as info:
        execute_in_place(m.compiled(), x, 1, backend=backend, config={"inplace": "copy-then-gather"})
    assert info.value.restored and isinstance(info.value.__cause__, MemoryError)
    assert calls["n"] >= 3 and torch.equal(x, before)  # two chunks done, then undone through the inverse map


@pytest.mark.skipif(not HAS_NUMBA, reason="needs numba")
def test_in_place_cycles_error_midway_restores_input(monkeypatch):
    """numba cycle plan: a failure after the first chunk of experts is undone."""
    from fimoe_lab.kernels import numba_gather

    m = plan_layer("fp8", "trtllm", 256, 2048).w13  # rows of 2048 bytes: the cycle plan runs
    assert EXECUTORS["numba"].strategy(m.compiled()).name == "cycles"
    x = structured(m, 5)
    before = x.clone()
    real, fired = numba_gather.inplace_cycles_numba, []

    def flaky(em, flat, chunk):
        for item in real(em, flat, chunk):
            yield item
            if not fired:
                fired.append(item[0])
                raise RuntimeError("injected between chunks")

    monkeypatch.setattr(numba_gather, "inplace_cycles_numba", flaky)
    with pytest.raises(InPlaceError) as info:
        execute_in_place(m.compiled(), x, 1, backend="numba")
    assert fired and fired[0] > 0 and info.value.restored
    assert torch.equal(x, before)


def test_in_place_rejects_size_change():
    m = plan_layer("fp8", "trtllm", 232, 320, is_act_and_mul=False, is_gated=False).w13
    with pytest.raises(LayoutError, match="only a permutation"):
        execute_in_place(m.compiled(), random_bytes((2, m.in_bytes), torch.uint8, seed=2), 1)


def test_dispatch():
    assert kernels.pick_backend("cpu", 1 << 30) == ("numba" if HAS_NUMBA else "torch")
    assert kernels.pick_backend("cpu", 10) == "torch"
    assert kernels.pick_backend("meta", 1 << 30) == "torch"


def test_registry_availability_on_cpu():
    assert available_backends("cpu") == (["numba"] if HAS_NUMBA else []) + ["torch"]
    assert available_backends("meta") == ["torch"]
    assert "numba" not in available_backends("cuda") and "torch" in available_backends("cuda")
    assert not EXECUTORS["triton"].available("cpu")
    for name in available_backends("cpu"):
        assert EXECUTORS[name].available(torch.device("cpu"))


def test_unknown_or_unavailable_backend_names_the_registered_ones():
    m = plan_layer("bf16", "trtllm", 256, 256).w2
    x = random_bytes((1, m.in_bytes), torch.uint8, seed=4)
    out = torch.empty(1, m.out_bytes, dtype=torch.uint8)
    with pytest.raises(FormatError, match="unknown executor backend 'nope'") as info:
        execute(m.compiled(), x, out, backend="nope")
    assert all(name in str(info.value) for name in EXECUTORS)
    with pytest.raises(FormatError, match="cannot run on cpu"):
        execute(m.compiled(), x, out, backend="triton")
    with pytest.raises(FormatError, match="unknown in-place strategy 'bands' for the torch executor"):
        execute_in_place(m.compiled(), x, 1, backend="torch", config={"inplace": "bands"})
    with pytest.raises(FormatError, match="unknown executor backend"):
        m.apply(x.view((1,) + m.in_shape), backend="nope")


@pytest.mark.parametrize("m", all_maps())
def test_forced_backend_equals_default_byte_for_byte(m):
    x = structured(m, 3)
    default = run(m, x, None)
    assert torch.equal(default, reference(m, x))
    for backend in available_backends("cpu"):
        assert torch.equal(run(m, x, backend), default), backend


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_every_in_place_strategy_equals_out_of_place(backend):
    for m in (plan_layer("fp8", "trtllm", 256, 2048).w13, plan_layer("nvfp4", "trtllm", 256, 512).w13_scale):
        em = m.compiled()
        want = reference(m, structured(m, 4))
        for strategy in ["auto"] + [s.name for s in EXECUTORS[backend].in_place]:
            x = structured(m, 4)
            execute_in_place(em, x, 1, backend=backend, config={"inplace": strategy})
            assert torch.equal(x, want), strategy


def test_auto_in_place_strategy_follows_the_preference_rules():
    rows = plan_layer("fp8", "trtllm", 256, 2048).w13.compiled()  # 2048-byte cells
    blocks = plan_layer("fp8-block", "trtllm", 256, 512).w13.compiled()  # 128-byte cells
    scales = plan_layer("nvfp4", "trtllm", 256, 512).w13_scale.compiled()  # swizzle form
    assert [EXECUTORS["numba"].strategy(em).name for em in (rows, blocks)] == ["cycles", "copy-then-gather"]
    assert [EXECUTORS["triton"].strategy(em).name for em in (rows, scales)] == ["cycles", "bands"]
    assert EXECUTORS["torch"].strategy(rows).name == "strided"  # a strided form: copied aside, strided back
    padded = plan_layer("fp8", "trtllm", 232, 320).w13.compiled()  # padding that is no box: no strided form
    assert EXECUTORS["torch"].strategy(padded).name == "copy-then-gather"
    with pytest.raises(LayoutError, match="128x4 scale swizzle"):
        EXECUTORS["triton"].strategy(rows, "bands")


def test_apply_refuses_an_out_that_overlaps_the_input():
    m = plan_layer("fp8", "trtllm", 256, 512).w13  # a permutation: out has the input's shape
    x = random_bytes((2,) + m.in_shape, torch.uint8, seed=8)
    before = x.clone()
    with pytest.raises(LayoutError, match="overlaps") as info:
        m.apply(x, out=x)
    assert "apply_" in str(info.value)
    buf = random_bytes((3 * x.numel(),), torch.uint8, seed=9)
    a, b = buf[: x.numel()].view(x.shape), buf[x.numel() // 2 : x.numel() // 2 + x.numel()].view(x.shape)
    with pytest.raises(LayoutError, match="overlaps"):
        m.apply(a, out=b)
    assert torch.equal(x, before)
    c = buf[x.numel() : 2 * x.numel()].view(x.shape)  # adjacent, not overlapping: fine
    assert torch.equal(m.apply(a, out=c).reshape(2, -1), reference(m, a))


def test_executors_refuse_an_index_map_and_wrong_sizes():
    m = plan_layer("bf16", "trtllm", 256, 256).w2
    x = random_bytes((1, m.in_bytes), torch.uint8, seed=6)
    with pytest.raises(LayoutError, match="run an ExecMap"):
        execute(m, x, torch.empty(1, m.out_bytes, dtype=torch.uint8))
    with pytest.raises(LayoutError, match="bytes per expert"):
        execute(m.compiled(), x, torch.empty(1, m.out_bytes + 4, dtype=torch.uint8))


def test_kernels_do_not_import_the_layout_side():
    """The seam is one way: kernels run ExecMaps and never import maps, steps or plans."""
    banned = (
        "fimoe_lab.layout",
        "fimoe_lab.steps",
        "fimoe_lab.plan",
        "fimoe_lab.compile",
        "fimoe_lab.recipes",
        "fimoe_lab.prepare",
    )
    root = pathlib.Path(kernels.__file__).parent
    files = sorted(root.glob("*.py"))
    assert len(files) >= 6
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                package = "fimoe_lab.kernels".rsplit(".", node.level - 1)[0] if node.level else ""
                base = ".".join(p for p in (package, node.module) if p)
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value]  # importlib.import_module("fimoe_lab....")
            else:
                continue
            bad = [n for n in names if n.startswith(banned)]
            assert not bad, f"{path.name}:{node.lineno} imports {bad}"
    code = (
        "import sys, torch, fimoe_lab.kernels as k; import fimoe_lab.kernels.registry, fimoe_lab.kernels.cycles; "
        "em = k.ExecMap('p', 4, 4, 2, 2, __import__('numpy').array([1, 0], 'int32'), (), False, 8, 8, True); "
        "x = torch.arange(4, dtype=torch.int32).view(2, 2); o = torch.empty_like(x); k.execute(em, x, o, 'torch'); "
        "assert o.tolist() == [[1, 0], [3, 2]], o; "
        "print(sorted(m for m in sys.modules if m.startswith("
        f"{banned!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_compiled_form_carries_its_inverse():
    m = plan_layer("fp8-block", "trtllm", 256, 512).w13
    em = m.compiled()
    inv = em.inverse()
    assert inv is em.inverse() and inv.in_bytes == em.out_bytes and inv.is_permutation
    x = structured(m, 2)
    y = run(m, x, "torch")
    back = torch.empty_like(x)
    execute(inv, y, back, "torch")
    assert torch.equal(back, x)


def test_maps_are_cached_not_rebuilt():
    """Same shapes and parameters -> the same map objects (and their executable forms)."""
    assert plan_layer("mxfp8", "trtllm", 256, 512) is plan_layer("mxfp8", "trtllm", 256, 512)
    assert plan_fp4_trtllm_weights(256, 512) is plan_fp4_trtllm_weights(256, 512)
    meta = dict(device="meta")
    w13, w2 = (
        torch.empty(4, 512, 512, dtype=torch.float8_e4m3fn, **meta),
        torch.empty(4, 512, 256, dtype=torch.float8_e4m3fn, **meta),
    )
    s = torch.empty(4, dtype=torch.float32, **meta)
    spec = MoELayerSpec(256, 512)
    a = plan_fp8_moe_layer(spec, w13, w2, s, s, is_trtllm=True)
    b = plan_fp8_moe_layer(MoELayerSpec(256, 512), w13, w2, s, s, is_trtllm=True)
    assert a.w13 is b.w13 and a.w2 is b.w2
    assert a.w13.compiled() is b.w13.compiled()


def test_compiled_form_is_widest():
    assert plan_layer("fp8", "trtllm", 256, 512).w13.compiled().cell_bytes == 512  # whole rows
    assert plan_layer("fp8-block", "trtllm", 256, 512).w13.compiled().cell_bytes == 128  # K blocks
    assert plan_layer("nvfp4", "trtllm", 256, 512).w13_scale.compiled().cell_bytes == 4  # 4 scales of a row


def test_fast_forms_are_recognised():
    """Padded row gathers and row-gather + swizzle maps get their dedicated kernels."""
    w2 = plan_layer("fp8", "trtllm", 232, 320, is_act_and_mul=False, is_gated=False).w2
    em = w2.compiled()
    assert em.padrows is not None and em.padrows[1:3] == (232, 256)
    s = plan_layer("nvfp4", "trtllm", 256, 512).w13_scale.compiled()
    assert s.swizzle is not None and s.swizzle[1:] == (8, 512)
    assert plan_layer("fp8", "trtllm", 256, 512).w13.compiled().padrows is None


@pytest.mark.parametrize("m", all_maps())
def test_bands_local_says_whether_each_output_band_reads_only_its_own_rows(m, request):
    """Oracle: every source row's bytes hold its band number (row // 128); after the map, a
    local map's output band ``b`` (its 128 x row-bytes region) holds only ``b``."""
    em = m.compiled()
    if em.swizzle is None:
        assert not em.bands_local()
        return
    rows, cw, n_rows = em.swizzle
    band_bytes = 128 * cw * 4
    assert m.in_bytes == n_rows * cw * 4 == m.out_bytes
    x = (torch.arange(n_rows) // 128 + 1).repeat_interleave(cw * 4).to(torch.uint8)[None]
    out = reference(m, x)[0].view(-1, band_bytes)
    own = (out == (torch.arange(out.shape[0]) + 1).to(torch.uint8)[:, None]).all().item()
    assert em.bands_local() == own
    w2 = request.node.callspec.id.endswith("w2_scale")
    assert em.bands_local() == w2  # W2: the TRT-LLM shuffle alone (128-row epilogue tiles); W13 interleaves gate/up


@pytest.mark.parametrize("m", all_maps())
def test_band_step_says_whether_every_band_reads_the_first_bands_rows_shifted(m, request):
    """Oracle: every source row's words hold its row number + 1; the reference gather puts them in
    the 128x4 order (band ``b``, word ``k``, row ``32 q + p`` at word ``(b * cw + k) * 128 + 4 p + q``),
    which gives the source row of every output row, independent of the executable form."""
    em = m.compiled()
    if em.swizzle is None:
        assert em.band_step() == 0
        return
    _, cw, n_rows = em.swizzle
    x = (torch.arange(n_rows, dtype=torch.int32) + 1).repeat_interleave(cw).view(torch.uint8)[None]
    words = reference(m, x)[0].view(torch.int32).view(n_rows // 128, cw, 32, 4)
    assert (words == words[:, :1]).all()  # every word of an output row from one source row
    src_row = (words[:, 0].transpose(1, 2).reshape(-1) - 1).numpy()  # output row 128 b + 32 q + p
    bands = src_row.reshape(-1, 128)
    d = int(bands[1, 0] - bands[0, 0]) if bands.shape[0] > 1 else 0
    shifted = d > 0 and (bands == bands[0] + d * np.arange(bands.shape[0])[:, None]).all()
    assert em.band_step() == (d if shifted else 0)
    tensor = request.node.callspec.id.rsplit("-", 1)[-1]
    if bands.shape[0] > 1:  # the TRT-LLM orders: gate/up halves of 64 rows a band (W13), the 128-row shuffle (W2)
        assert em.band_step() == {"w13_scale": 64, "w2_scale": 128}[tensor]


STREAM_CASES = CASES + [("mxfp8", 256, 768, {})]  # 24-byte scale rows: 6 words, a 4-word vector part and a tail


@pytest.mark.skipif(not HAS_NUMBA, reason="numba is not installed")
@pytest.mark.parametrize("offset", [0, 16])
@pytest.mark.parametrize("fmt,inter,hidden,kw", STREAM_CASES)
def test_numba_streaming_paths_bit_exact(monkeypatch, fmt, inter, hidden, kw, offset):
    """The numba kernels' streaming-store paths (taken for outputs >= STREAM_MIN_BYTES, here
    forced for every size) are bit-exact on every map, with an output 64-byte aligned
    (streaming cells) or only 16-byte aligned (plain memcpy cells, vector swizzle)."""
    from fimoe_lab.kernels import numba_gather

    monkeypatch.setattr(numba_gather, "STREAM_MIN_BYTES", 0)
    for m in plan_layer(fmt, "trtllm", inter, hidden, **kw).maps().values():
        for x in (structured(m, 3), random_bytes((3, m.in_bytes), torch.uint8, seed=m.out_bytes % 997)):
            raw = torch.full((3 * m.out_bytes + 64,), 0xAB, dtype=torch.uint8)
            out = raw[offset : offset + 3 * m.out_bytes].view(3, m.out_bytes)
            numba_gather.gather_numba(m.compiled(), x, out)
            assert torch.equal(out, reference(m, x)), m.name
            assert (raw[:offset] == 0xAB).all() and (raw[offset + 3 * m.out_bytes :] == 0xAB).all()


@pytest.mark.skipif(not HAS_NUMBA, reason="numba is not installed")
@pytest.mark.parametrize("spread_min", [0, 1 << 30])
@pytest.mark.parametrize(
    "fmt,inter,hidden",
    [("nvfp4", 2048, 7168), ("mxfp8", 2048, 7168), ("mxfp8", 192, 4096), ("nvfp4", 256, 512), ("mxfp8", 256, 768)],
)
def test_numba_swizzle_prefetch_paths_bit_exact(monkeypatch, spread_min, fmt, inter, hidden):
    """The 128x4 swizzle's two prefetch schedules (the next band spread over the column steps,
    or bands ahead at once) leave the output of every scale map the map's: rows of 16-448
    bytes, fill rows (padded MXFP8), several bands and experts, streaming and plain stores."""
    from fimoe_lab.kernels import numba_gather

    monkeypatch.setattr(numba_gather, "SWIZZLE_SPREAD_MIN_ROW_BYTES", spread_min)
    plan = plan_layer(fmt, "trtllm", inter, hidden)
    swizzled = [m for m in (plan.w13_scale, plan.w2_scale) if m.compiled().swizzle is not None]
    assert swizzled
    for m in swizzled:
        for stream in (0, 1 << 62):
            monkeypatch.setattr(numba_gather, "STREAM_MIN_BYTES", stream)
            for x in (coords_bytes(3, m.in_bytes), random_bytes((3, m.in_bytes), torch.uint8, seed=inter)):
                raw = torch.full((3 * m.out_bytes + 64,), 0xAB, dtype=torch.uint8)
                off = (-raw.data_ptr()) % 64
                out = raw[off : off + 3 * m.out_bytes].view(3, m.out_bytes)
                numba_gather.gather_numba(m.compiled(), x, out)
                assert torch.equal(out, reference(m, x)), (m.name, stream)


@pytest.mark.skipif(not HAS_NUMBA, reason="numba is not installed")
@pytest.mark.parametrize("offset", [0, 1, 3, 16])
@pytest.mark.parametrize(
    "fmt,inter,hidden",
    [("mxfp4", 2880, 2880), ("mxfp4", 256, 1440), ("mxfp4", 192, 2880), ("mxfp4", 1440, 352), ("nvfp4", 256, 512)],
)
def test_numba_swizzled_rows_of_any_width_bit_exact(fmt, inter, hidden, offset):
    """Scale maps of the ``swizzled_rows`` form (rows of 6-90 bytes, 1-3 past a whole word or whole words, fill rows
    from the padding) run on their own loop wherever the vector swizzle does not take them (rows not whole words,
    or buffers not 16-byte aligned), at any output alignment: the output is the map's on structured and random bytes,
    and no byte beside it is written."""
    from fimoe_lab.kernels import numba_gather

    plan = plan_layer(fmt, "trtllm", inter, hidden)
    for m in (plan.w13_scale, plan.w2_scale):
        em = m.compiled()
        assert em.swizzled_rows is not None
        em._dev.clear()
        for x in (coords_bytes(3, m.in_bytes), random_bytes((3, m.in_bytes), torch.uint8, seed=inter + hidden)):
            raw = torch.full((3 * m.out_bytes + 64,), 0xAB, dtype=torch.uint8)
            start = offset + (-raw.data_ptr()) % 16
            out = raw[start : start + 3 * m.out_bytes].view(3, m.out_bytes)
            numba_gather.gather_numba(em, x, out)
            assert torch.equal(out, reference(m, x)), (m.name, offset)
            assert (raw[:start] == 0xAB).all() and (raw[start + 3 * m.out_bytes :] == 0xAB).all()
        vector = em.swizzle is not None and offset % 16 == 0
        assert em._dev[numba_run_key(em)].__name__ == ("swizzle" if vector else "swizzled_rows"), (m.name, offset)


@pytest.mark.skipif(not HAS_NUMBA, reason="numba is not installed")
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("cell", [4, 8, 16, 64, 128])
def test_numba_cell_gathers_follow_sources_in_visit_order(monkeypatch, cell, stream):
    """The cell loops read each cell's source beside the visit order (``visit_sources``,
    no dependent load); on a random gather with repeated sources and two fill codes the
    output is still the map's, whichever kernel the cell size picks (word loop, memcpy,
    streaming stores)."""
    from fimoe_lab.kernels import numba_gather
    from fimoe_lab.layout import IndexMap

    monkeypatch.setattr(numba_gather, "STREAM_MIN_BYTES", 0 if stream else 1 << 62)
    g = torch.Generator().manual_seed(cell)
    n_in, n_out = 300, 517
    src = torch.randint(0, n_in, (n_out,), generator=g)
    src[torch.rand(n_out, generator=g) < 0.2] = -1
    src[torch.rand(n_out, generator=g) < 0.1] = -2
    m = IndexMap(src, cell, (n_in * cell,), (n_out * cell,), (0x5A, 0xC3))
    em = m.compiled()
    order = numba_gather.visit_order(em)
    assert numba_gather.visit_sources(em).tolist() == em.src[order].tolist()
    for x in (random_bytes((3, m.in_bytes), torch.uint8, seed=cell), coords_bytes(3, m.in_bytes)):
        raw = torch.full((3 * m.out_bytes + 64,), 0xAB, dtype=torch.uint8)
        off = (-raw.data_ptr()) % 64
        out = raw[off : off + 3 * m.out_bytes].view(3, m.out_bytes)
        numba_gather.gather_numba(em, x, out)
        assert torch.equal(out, reference(m, x))
        assert (raw[:off] == 0xAB).all() and (raw[off + 3 * m.out_bytes :] == 0xAB).all()


@pytest.mark.skipif(not HAS_NUMBA, reason="numba is not installed")
@pytest.mark.skipif(sys.platform != "linux", reason="mincore reports unwritten anonymous pages on Linux")
def test_numba_streams_only_into_pages_already_mapped(monkeypatch):
    """A 64 MB output in a fresh anonymous ``mmap`` (no page mapped until written) takes the plain-store kernel and
    one written before (every page mapped) the streaming one; pages written in the first quarter only still count as
    new. The output is the map's either way, on structured and random bytes. (``torch.empty`` of this size is
    usually a fresh mapping too, but the C library may serve it from freed heap memory, whose pages are mapped.)"""
    import mmap

    from fimoe_lab.kernels import numba_gather

    monkeypatch.setattr(numba_gather, "STREAM_MIN_BYTES", 1 << 20)
    m = plan_layer("fp8", "trtllm", 256, 2048).w13  # rows of 2048 bytes: 64-byte aligned memcpy cells
    em = m.compiled()
    experts = (64 << 20) // m.out_bytes + 1
    for x in (coords_bytes(experts, m.in_bytes), random_bytes((experts, m.in_bytes), torch.uint8, seed=7)):
        want = reference(m, x)
        for written in (0.0, 0.25, 1.0):
            flat = torch.frombuffer(mmap.mmap(-1, experts * m.out_bytes), dtype=torch.uint8)
            out = flat.view(experts, m.out_bytes)
            flat[: int(flat.numel() * written)].fill_(0xAB)
            assert numba_gather.pages_mapped(out) == (written == 1.0)
            em._dev.clear()
            numba_gather.gather_numba(em, x, out)
            key = numba_run_key(em)
            assert key[-1] == (written == 1.0), (written, key)
            assert torch.equal(out, want), written


def numba_run_key(em) -> tuple:
    """The one numba runner ``em`` has made (its key: alignments and whether it streams), after a single call."""
    (key,) = [k for k in em._dev if isinstance(k, tuple) and k[0] == "numba_run"]
    return key


def coords_bytes(experts: int, nbytes: int) -> torch.Tensor:
    """Bytes that encode their position: 4-byte words (expert << 24 | word index)."""
    words = torch.arange(nbytes // 4, dtype=torch.int32)[None, :] + (
        torch.arange(experts, dtype=torch.int32)[:, None] << 24
    )
    return words.view(torch.uint8).reshape(experts, nbytes)


STAND_IN_CHILD = """
import json, os, sys, torch
from fimoe_lab import kernels
from fimoe_lab.prepare import plan_layer
m = plan_layer("fp8", "trtllm", 256, 2048).w13
em = m.compiled()
g = torch.Generator().manual_seed(7)
x = torch.randint(0, 256, (4, m.in_bytes), dtype=torch.uint8, generator=g)
first = kernels.get_executor(None, "cpu", 1 << 30).name
out = torch.empty((4, m.out_bytes), dtype=torch.uint8)
kernels.execute(em, x, out)
want = torch.empty_like(out)
kernels.execute(em, x, want, backend="torch")
kernels.load_executor("numba")
after = kernels.get_executor(None, "cpu", 1 << 30).name
out2 = torch.empty_like(out)
kernels.execute(em, x, out2)
print(json.dumps([first, after, kernels.executor_ready("numba"), torch.equal(out, want), torch.equal(out2, want)]))
"""


@pytest.mark.skipif(not HAS_NUMBA, reason="needs numba")
@pytest.mark.parametrize("background", ["1", "0"])
def test_a_fresh_process_runs_on_torch_while_numba_loads(background):
    """In a fresh process the first default CPU call does not wait for numba: torch stands in
    (same bytes) while numba loads on a thread; after ``load_executor`` numba runs. With
    ``FIMOE_BACKGROUND_LOAD=0`` the first call loads numba itself and runs on it."""
    import json
    import os

    env = {**os.environ, "FIMOE_BACKGROUND_LOAD": background}
    env["PYTHONPATH"] = str(pathlib.Path(__file__).resolve().parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", STAND_IN_CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    first, after, ready, same1, same2 = json.loads(done.stdout.strip().splitlines()[-1])
    assert first == ("torch" if background == "1" else "numba")
    assert after == "numba" and ready and same1 and same2


@pytest.mark.skipif(not HAS_NUMBA, reason="needs numba")
def test_numba_gather_refuses_a_strided_output_and_leaves_it_untouched():
    """The numba loops write through the tensor's own memory: a non-contiguous ``out`` (which a
    reshape would silently copy) is refused before any byte moves."""
    from fimoe_lab.kernels import numba_gather

    m = plan_layer("fp8", "trtllm", 256, 512).w13
    x = random_bytes((2, m.in_bytes), torch.uint8, seed=11)
    wide = torch.full((2, 2 * m.out_bytes), 0xAB, dtype=torch.uint8)
    out = wide[:, ::2]
    with pytest.raises(LayoutError, match="contiguous"):
        numba_gather.gather_numba(m.compiled(), x, out)
    assert bool((wide == 0xAB).all())


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("cells,cell_bytes", [(2, 4), (6, 16), (33, 1), (5, 3)])
def test_a_map_that_lists_no_fill_bytes_fills_with_zero_on_every_executor(backend, cells, cell_bytes):
    """``IndexMap(src, ...)`` with fill cells (``src < 0``) and no ``fills``: those cells are zeros on every executor
    and in every form the map compiles to (a strided box with a fill, a gather), as the byte-loop reference has them;
    the first cell of the output reads the last input cell, the second is a fill (so the form has a fill)."""
    from fimoe_lab.layout import IndexMap

    g = torch.Generator().manual_seed(cells)
    src = torch.randint(-1, cells, (cells,), generator=g)
    src[0], src[1] = cells - 1, -1
    m = IndexMap(src, cell_bytes, (cells * cell_bytes,), (cells * cell_bytes,))
    x = random_bytes((3, m.in_bytes), torch.uint8, seed=cells)
    out = torch.full((3, m.out_bytes), 0x5A, dtype=torch.uint8)
    execute(m.compiled(), x, out, backend)
    assert torch.equal(out, reference(m, x).reshape(3, -1))
