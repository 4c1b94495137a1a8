"""Every format: documented error bounds on random and structured inputs, shapes, errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fimoe_lab import formats
from fimoe_lab.formats import codes, fp8_block, nvfp4
from fimoe_lab.formats.health import decoded_scales

ALL = formats.names()
HAS_CUDA = torch.cuda.is_available()


def element_scales(q: formats.QuantizedTensor) -> torch.Tensor:
    """float32 ``(..., rows, cols)``: the decode scale that applies to each element."""
    rows, cols = q.shape[-2:]
    if q.fmt == "fp8":
        return q.scales[..., None, None].expand(q.shape)
    if q.fmt == "fp8-block":
        return fp8_block.expand_block_scales(q.scales, rows, cols)
    scale = decoded_scales(q)
    if q.fmt == "nvfp4":
        scale = scale / q.global_scale[..., None, None]
    if q.fmt == "nvfp4-per-token":
        scale = scale * q.token_scale[..., None]
    return scale.repeat_interleave(q.block_size, dim=-1)


def error_bound(q: formats.QuantizedTensor, x: torch.Tensor) -> torch.Tensor:
    """The per-element bound each module documents."""
    s = element_scales(q)
    a = x.float().abs()
    if not formats.get(q.fmt).packed:  # E4M3: half an ulp (3 mantissa bits), or the subnormal step
        return torch.maximum(a / 16, s / 1024) * (1 + 1e-6)
    scaled = a / s
    half_step = torch.where(scaled < 2, 0.25, torch.where(scaled < 4, 0.5, 1.0))
    saturation = scaled - 6  # where a subnormal E4M3 block scale rounded down
    bound = torch.maximum(half_step, saturation) * s * (1 + 1e-6)
    return torch.where(s > 0, bound, a)  # a block scale that underflowed to 0 loses the block


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


def assert_within_bound(fmt: str, x: torch.Tensor) -> formats.QuantizedTensor:
    q = formats.get(fmt).quantize(x)
    deq = formats.dequantize(q)
    err = (deq - x.float()).abs()
    bound = error_bound(q, x)
    worst = (err - bound).max()
    assert worst <= 0, f"{fmt}: error exceeds bound by {worst.item():.3g} for shape {tuple(x.shape)}"
    return q


def structured_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ramp = torch.linspace(-3, 5, 4 * 64 * 256).reshape(4, 64, 256)
    magnitudes = torch.randn(2, 64, 256, generator=g) * torch.logspace(-3, 3, 64)[None, :, None]
    outliers = torch.randn(2, 32, 256, generator=g) * 0.01
    outliers[:, ::5, 7] = 300.0
    heavy = torch.randn(2, 32, 256, generator=g) * torch.exp(torch.randn(2, 32, 256, generator=g) * 2)
    grid = codes.e2m1_decode(torch.randint(0, 16, (2, 32, 256), generator=g, dtype=torch.uint8)) * 0.125
    with_zero_rows = torch.randn(2, 32, 256, generator=g)
    with_zero_rows[:, 3] = 0
    return {
        "ramp": ramp,
        "row_magnitudes_1e-3_to_1e3": magnitudes,
        "outliers": outliers,
        "heavy_tailed": heavy,
        "e2m1_grid": grid,
        "random_bf16": torch.randn(3, 64, 256, generator=g).bfloat16(),
        "random_fp16": (torch.randn(3, 64, 256, generator=g) * 5).half(),
        "zero_rows": with_zero_rows,
    }


STRUCTURED = structured_inputs()


@pytest.mark.parametrize("name", list(STRUCTURED))
@pytest.mark.parametrize("fmt", ALL)
def test_round_trip_error_is_within_the_documented_bound(fmt, name):
    x = STRUCTURED[name]  # per-token all-zero rows: scale bytes 0x00 under the default (FlashInfer 0.7.x) profile
    assert_within_bound(fmt, x)


@pytest.mark.parametrize("fmt", ALL)
def test_quantized_values_are_not_trivial(fmt):
    """Guards against a quantizer that passes bounds by returning zeros for small inputs."""
    q = formats.get(fmt).quantize(STRUCTURED["random_bf16"])
    assert (q.values.view(torch.uint8) != 0).float().mean() > 0.5
    assert (decoded_scales(q) > 0).all()


def test_values_on_the_grid_round_trip_exactly():
    g = torch.Generator().manual_seed(3)
    e4m3 = codes.e4m3_decode(torch.randint(0, 126, (2, 128, 256), generator=g, dtype=torch.uint8))
    e4m3[..., ::32] = 448.0  # every block of 32 (and every matrix) reaches the E4M3 maximum
    for fmt in ("fp8", "fp8-block", "mxfp8"):
        x = e4m3 * 2.0**-5
        assert torch.equal(formats.dequantize(formats.get(fmt).quantize(x)), x), fmt
    e2m1 = codes.e2m1_decode(torch.randint(0, 16, (2, 8, 64), generator=g, dtype=torch.uint8))
    e2m1[..., ::32] = 6.0
    x = e2m1 * 2.0**3
    q = formats.get("mxfp4").quantize(x)
    assert torch.equal(formats.dequantize(q), x)
    assert q.scales.unique().tolist() == [127 + 3]


def test_nvfp4_weights_convention_global_and_block_scales():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 32, 64, generator=g) * torch.tensor([1.0, 10.0, 0.01])[:, None, None]
    q = nvfp4.quantize(x)
    amax = x.abs().amax(dim=(-2, -1))
    assert torch.equal(q.global_scale, (448.0 * 6.0) / amax)
    block_amax = x.reshape(3, 32, 4, 16).abs().amax(-1)
    expected_sf = (block_amax / 6 * q.global_scale[:, None, None]).clamp(max=448).to(torch.float8_e4m3fn)
    differs = q.scales.view(torch.uint8).int() - expected_sf.view(torch.uint8).int()
    assert differs.abs().max() <= 1  # the kernel's approximate reciprocals move at most a rounding boundary
    assert (differs == 0).float().mean() > 0.99
    assert (q.scales.float().amax(dim=(-2, -1)) == 448).all()  # the block holding amax gets the E4M3 max


def test_nvfp4_accepts_an_explicit_global_scale_per_expert():
    x = torch.randn(2, 16, 32)
    q = nvfp4.quantize(x, global_scale=torch.tensor([100.0, 200.0]))
    assert q.global_scale.tolist() == [100.0, 200.0]
    with pytest.raises(ValueError, match=r"global_scale of shape \(3,\) must broadcast to the leading dims \(2,\)"):
        nvfp4.quantize(x, global_scale=torch.ones(3))


@pytest.mark.parametrize("fmt", ALL)
def test_experts_quantize_as_if_one_at_a_time(fmt):
    x = STRUCTURED["row_magnitudes_1e-3_to_1e3"]
    q = formats.get(fmt).quantize(x)
    for e in range(x.shape[0]):
        qe = formats.get(fmt).quantize(x[e])
        assert torch.equal(as_bytes(q.values[e]), as_bytes(qe.values))
        assert torch.equal(as_bytes(q.scales[e]), as_bytes(qe.scales))


@settings(max_examples=25, deadline=None)
@given(
    fmt=st.sampled_from(ALL),
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    rows=st.integers(1, 5),
    blocks=st.integers(1, 3),
    log_scale=st.floats(-20, 20),
    seed=st.integers(0, 2**16),
)
def test_any_shape_quantizes_to_the_documented_shapes_within_bound(fmt, lead, rows, blocks, log_scale, seed):
    cols = blocks * 32
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, rows, cols, generator=g) * 2.0**log_scale
    q = assert_within_bound(fmt, x)
    packed = formats.get(fmt).packed
    assert q.values.shape == (*lead, rows, cols // 2 if packed else cols)
    assert q.shape == x.shape
    assert q.values.dtype == (torch.uint8 if packed else torch.float8_e4m3fn)
    if fmt == "fp8":
        expected_scales = tuple(lead)
    elif fmt == "fp8-block":
        expected_scales = (*lead, -(-rows // 128), -(-cols // 128))
    else:
        expected_scales = (*lead, rows, cols // q.block_size)
    assert tuple(q.scales.shape) == expected_scales


@pytest.mark.parametrize("fmt, multiple", [("mxfp8", 32), ("mxfp4", 32), ("nvfp4", 16), ("nvfp4-per-token", 16)])
def test_wrong_last_dim_says_the_constraint_the_shape_and_the_fix(fmt, multiple):
    x = torch.randn(4, multiple + 8)
    with pytest.raises(ValueError) as err:
        formats.get(fmt).quantize(x)
    msg = str(err.value)
    assert (
        f"multiple of {multiple}" in msg
        and f"(4, {multiple + 8})" in msg
        and f"pad the last dim to {2 * multiple}" in msg
    )


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn, torch.float64])
def test_wrong_dtype_names_the_accepted_dtypes(fmt, dtype):
    x = torch.zeros(2, 64).to(dtype)
    with pytest.raises(ValueError, match=r"expected float32, float16 or bfloat16 input, got .* with shape \(2, 64\)"):
        formats.get(fmt).quantize(x)


@pytest.mark.parametrize("fmt", ["fp8", "fp8-block", "nvfp4", "nvfp4-per-token"])
def test_matrix_formats_reject_a_vector(fmt):
    with pytest.raises(ValueError, match=r"at least 2 dims, got shape \(64,\)"):
        formats.get(fmt).quantize(torch.randn(64))


def test_registry_names_and_errors():
    assert sorted(ALL) == sorted(("fp8", "fp8-block", "mxfp8", "nvfp4", "nvfp4-per-token", "mxfp4"))
    assert len(set(ALL)) == len(ALL)
    with pytest.raises(ValueError, match=r"unknown quantization format 'fp6' \(fix: choose one of fp8, fp8-block"):
        formats.get("fp6")
    with pytest.raises(ValueError, match="unknown quantization format 'bf16'"):  # a format, but no quantizer
        formats.get("bf16")
    for name in ALL:  # the table row, whose block size the quantizer writes
        q = formats.get(name).quantize(torch.randn(2, 128, 256))
        assert formats.get(name).name == q.fmt == name and q.block_size == formats.get(name).block_size
        assert formats.get(name).packed == (q.values.shape[-1] == 128)
    q = formats.get("fp8").quantize(torch.randn(2, 32))
    with pytest.raises(ValueError, match="format 'fp8', expected 'mxfp8'"):
        formats.get("mxfp8").dequantize(q)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ALL)
def test_cuda_and_cpu_give_the_same_bytes(fmt):
    for name in ("heavy_tailed", "random_bf16", "outliers"):
        x = STRUCTURED[name]
        q_cpu = formats.get(fmt).quantize(x)
        q_gpu = formats.get(fmt).quantize(x.cuda()).to("cpu")
        assert torch.equal(as_bytes(q_cpu.values), as_bytes(q_gpu.values)), (fmt, name)
        assert torch.equal(as_bytes(q_cpu.scales), as_bytes(q_gpu.scales)), (fmt, name)
