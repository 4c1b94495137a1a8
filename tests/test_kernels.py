"""Executors are bit-exact with the map they run (CPU: numba and torch paths).

The reference is a per-expert loop written here: for each expert, every output byte
is the input byte the map names (or the fill byte). Inputs are structured (each 4-byte
word encodes (expert, row, col)) and random; outputs are poisoned before each run.
No timing here: benchmarks/bench_transforms.py measures speed.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from conftest import coords, random_bytes
from fimoe_lab import kernels
from fimoe_lab.kernels import InPlaceError, exec_form, execute, execute_in_place
from fimoe_lab.prepare import MoELayerSpec, plan_fp8_moe_layer, plan_layer, plan_fp4_trtllm_weights

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
            out.append(pytest.param(m, id=f"{fmt}-{inter}x{hidden}-{'-'.join(f'{k}{v}' for k, v in kw.items())}-{name}"))
    return out


def reference(m, x: torch.Tensor) -> torch.Tensor:
    """Per-expert loop: out[e].flat[i] = x[e].flat[source_bytes[i]] or the fill byte."""
    sb = m.source_bytes().reshape(-1)
    one = m.refined(1)
    fills = torch.tensor(m.fills or (0,), dtype=torch.uint8)
    fill_bytes = fills[(-1 - one.src).clamp(min=0)]
    xb = x.reshape(x.shape[0], -1).view(torch.uint8).cpu()
    outs = []
    for e in range(xb.shape[0]):
        outs.append(torch.where(sb >= 0, xb[e][sb.clamp(min=0)], fill_bytes))
    return torch.stack(outs)


def structured(m, experts: int) -> torch.Tensor:
    """uint8 ``(E, in_bytes)`` whose 4-byte words encode (expert, position) (random tail)."""
    words, rest = divmod(m.in_bytes, 4)
    body = coords(experts, 1, words).reshape(experts, -1).view(torch.uint8)
    if rest:
        body = torch.cat([body, random_bytes((experts, rest), torch.uint8, seed=7)], dim=1)
    return body.contiguous()


def run(m, x, backend):
    out = torch.full((x.shape[0], m.out_bytes), 0xAB, dtype=torch.uint8, device=x.device)
    execute(m, x, out, backend=backend)
    return out


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("m", all_maps())
def test_bit_exact_structured_and_random(m, backend):
    for x in (structured(m, 3), random_bytes((2, m.in_bytes), torch.uint8, seed=m.in_bytes % 1000)):
        assert torch.equal(run(m, x, backend), reference(m, x))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.int32])
def test_dtypes_and_apply(backend, dtype, monkeypatch):
    """``IndexMap.apply`` on typed tensors goes through the chosen backend bit-exactly."""
    monkeypatch.setenv("FIMOE_EXECUTOR", backend)
    m = plan_layer("bf16", "trtllm", 256, 256).w13
    size = torch.empty((), dtype=dtype).element_size()
    x = random_bytes((2,) + m.in_shape[:-1] + (m.in_shape[-1] // size,), dtype, seed=3)
    y = m.apply(x)
    assert y.dtype == dtype
    assert torch.equal(y.reshape(2, -1).view(torch.uint8), reference(m, x))


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
    for m in (plan_layer("fp8", "trtllm", 256, 512).w13, plan_layer("fp8", "trtllm", 256, 2048).w13,
              plan_layer("nvfp4", "trtllm", 256, 512).w13_scale, plan_layer("bf16", "trtllm", 256, 256).w2):
        for x in (random_bytes((experts, m.in_bytes), torch.uint8, seed=experts), structured(m, experts)):
            want = reference(m, x)
            execute_in_place(m, x, scratch, backend=backend)
            assert torch.equal(x, want)


def test_in_place_error_midway_restores_input(monkeypatch):
    m = plan_layer("fp8-block", "trtllm", 256, 512).w13
    x = random_bytes((6, m.in_bytes), torch.uint8, seed=11)
    before = x.clone()
    real = kernels.execute
    calls = {"n": 0}

    def flaky(mm, a, b, backend=None):
        calls["n"] += 1
        if calls["n"] == 3:  # third chunk: after two chunks are already in the output layout
            b.view(torch.uint8).fill_(0x5A)  # half-written chunk
            raise MemoryError("injected")
        return real(mm, a, b, backend)

    monkeypatch.setattr(kernels, "execute", flaky)
    with pytest.raises(InPlaceError) as info:
        execute_in_place(m, x, 1)
    assert info.value.restored and isinstance(info.value.__cause__, MemoryError)
    assert torch.equal(x, before)


def test_in_place_rejects_size_change():
    m = plan_layer("fp8", "trtllm", 232, 320, is_act_and_mul=False, is_gated=False).w13
    with pytest.raises(ValueError):
        execute_in_place(m, torch.zeros(2, m.in_bytes, dtype=torch.uint8), 1)


def test_dispatch(monkeypatch):
    monkeypatch.delenv("FIMOE_EXECUTOR", raising=False)
    assert kernels.pick_backend("cpu", 1 << 30) == ("numba" if HAS_NUMBA else "torch")
    assert kernels.pick_backend("cpu", 10) == "torch"
    monkeypatch.setenv("FIMOE_EXECUTOR", "torch")
    assert kernels.pick_backend("cpu", 1 << 30) == "torch"
    with pytest.raises(ValueError):
        execute(plan_layer("bf16", "trtllm", 256, 256).w2, torch.zeros(1, 1), torch.zeros(1, 1), backend="nope")


def test_maps_are_cached_not_rebuilt():
    """Same shapes and parameters -> the same map objects (and their executable forms)."""
    assert plan_layer("mxfp8", "trtllm", 256, 512) is plan_layer("mxfp8", "trtllm", 256, 512)
    assert plan_fp4_trtllm_weights(256, 512) is plan_fp4_trtllm_weights(256, 512)
    meta = dict(device="meta")
    w13, w2 = torch.empty(4, 512, 512, dtype=torch.float8_e4m3fn, **meta), torch.empty(4, 512, 256, dtype=torch.float8_e4m3fn, **meta)
    s = torch.empty(4, dtype=torch.float32, **meta)
    spec = MoELayerSpec(256, 512)
    a = plan_fp8_moe_layer(spec, w13, w2, s, s, is_trtllm=True)
    b = plan_fp8_moe_layer(MoELayerSpec(256, 512), w13, w2, s, s, is_trtllm=True)
    assert a.w13 is b.w13 and a.w2 is b.w2
    assert exec_form(a.w13) is exec_form(b.w13)


def test_exec_form_is_widest():
    assert exec_form(plan_layer("fp8", "trtllm", 256, 512).w13).cell_bytes == 512  # whole rows
    assert exec_form(plan_layer("fp8-block", "trtllm", 256, 512).w13).cell_bytes == 128  # K blocks
    assert exec_form(plan_layer("nvfp4", "trtllm", 256, 512).w13_scale).cell_bytes == 4  # 4 scales of a row


def test_fast_forms_are_recognised():
    """Padded row gathers and row-gather + swizzle maps get their dedicated kernels."""
    w2 = plan_layer("fp8", "trtllm", 232, 320, is_act_and_mul=False, is_gated=False).w2
    em = exec_form(w2)
    assert em.padrows is not None and em.padrows[1:3] == (232, 256)
    s = exec_form(plan_layer("nvfp4", "trtllm", 256, 512).w13_scale)
    assert s.swizzle is not None and s.swizzle[1:] == (8, 512)
    assert exec_form(plan_layer("fp8", "trtllm", 256, 512).w13).padrows is None
