"""quantize_nvfp4_per_token_input: hand-computed cases of FlashInfer's per-token kernel arithmetic.

Row amax 2688 makes the per-token scale exactly 1.0 (2688 * float32(1/2688) rounds to 1), so
the encode scale is 1. A block reaching 1536 then gets scale e4m3(1536 * rcp(6)) = 256 and
``out = rcp(256) = 2**-8`` exactly: x = 256 * {.25, .75, 1.25, 1.75, 2.5, 3.5, 5} lands exactly
on every E2M1 midpoint, so the ties are really ties. A block reaching 2688 gets scale 448 and
``out = rcp(448)`` = 1/448 * (1 + 4.5e-8): there 0.25, 1.25, 2.5, 5 are still exact ties but
0.75, 1.75, 3.5 land one float32 ulp above (same codes, by the kernel's arithmetic).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fimoe_lab import formats
from fimoe_lab.formats import codes, nvfp4_per_token
from fimoe_lab.formats.nvfp4_per_token import quantize_nvfp4_per_token_input

HAS_CUDA = torch.cuda.is_available()
BASE = np.float32(1.0 / 2688.0)


def expected_per_token_scale(row_amax: float) -> float:
    """``row_amax * float32(1/(6*448))`` in float32 arithmetic (numpy, not torch)."""
    return float(np.float32(row_amax) * BASE)


def pad16(values: list[float]) -> list[float]:
    return values + [0.0] * (16 - len(values))


POW2_TIE_BLOCK = [1536, 64, 192, 320, 448, 640, 896, 1280, -64, -192, -320, -448, -640, -896, -1280, 0]
POW2_TIE_CODES = [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 0]
TIE_BLOCK = [2688, 112, 336, 560, 784, 1120, 1568, 2240, -112, -336, -560, -784, -1120, -1568, -2240, 0]
TIE_CODES = [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 0]
NEAR_TIE_BLOCK = [2688, 112.5, 111.5, 334, 564, 556, 780, 1112, 1128, 1560, 1576, 2232, 2256, -112.5, -2256, 0]
NEAR_TIE_CODES = [7, 1, 0, 1, 3, 2, 3, 4, 5, 5, 6, 6, 7, 9, 15, 0]
SIGNED_ZERO_BLOCK = pad16([0.0, -0.0, -0.0])
SIGNED_ZERO_CODES = pad16([0, 8, 8])
SMALL_BLOCK = pad16([1, -1, 0.5, 0.25, 0.125])  # scale e4m3(1/6) = 0.171875 (0x23), out ~ 5.818
SMALL_CODES = pad16([7, 15, 5, 3, 1])


def quantize_row(values: list[float], dtype=torch.bfloat16, engine=None):
    x = torch.tensor([values], dtype=torch.float32).to(dtype)
    packed, sf, scale = quantize_nvfp4_per_token_input(x, engine=engine)
    return codes.unpack_nibbles(packed)[0].tolist(), sf[0].tolist(), scale[0].item()


def test_return_tuple_matches_flashinfer_order_shapes_and_dtypes():
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    out = quantize_nvfp4_per_token_input(x)
    assert isinstance(out, tuple) and len(out) == 3
    x_fp4, x_sf, per_token = out
    assert (x_fp4.shape, x_fp4.dtype) == ((5, 32), torch.uint8)
    assert (x_sf.shape, x_sf.dtype) == ((5, 4), torch.uint8)
    assert (per_token.shape, per_token.dtype) == ((5,), torch.float32)
    assert all(t.device == x.device and t.is_contiguous() for t in out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_ties_round_to_even_on_the_kernel_path(dtype):
    row = TIE_BLOCK + POW2_TIE_BLOCK + NEAR_TIE_BLOCK + SIGNED_ZERO_BLOCK + SMALL_BLOCK
    got_codes, got_sf, got_scale = quantize_row(row, dtype)
    assert got_scale == expected_per_token_scale(2688) == 1.0
    assert got_sf == [0x7E, 0x78, 0x7E, 0x00, 0x23]
    assert got_codes == TIE_CODES + POW2_TIE_CODES + NEAR_TIE_CODES + SIGNED_ZERO_CODES + SMALL_CODES


def test_every_e2m1_value_comes_back_in_order_with_row_amax_6():
    row = list(codes.E2M1_VALUES)
    got_codes, got_sf, got_scale = quantize_row(row)
    assert got_codes == list(range(16))
    assert got_sf == [0x7E]
    assert got_scale == expected_per_token_scale(6.0)
    packed, _, _ = quantize_nvfp4_per_token_input(torch.tensor([row], dtype=torch.bfloat16))
    assert packed[0].tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]


def test_an_all_zero_row_gets_nan_scale_bytes_in_flashinfer_0_6_13():
    got_codes, got_sf, got_scale = quantize_row([0.0] * 16 + [-0.0] * 16, engine="flashinfer-0.6.13")
    assert got_scale == 0.0
    assert got_sf == [0x7F, 0x7F]  # rcp(0) = inf; inf * 0 = NaN; e4m3(NaN) = 0x7F
    assert got_codes == [0] * 16 + [8] * 16


@pytest.mark.parametrize("engine", [None, "vllm-0.34", "sglang-0.5.23", "flashinfer-0.7.4"])
def test_an_all_zero_row_gets_zero_scale_bytes_in_flashinfer_0_7(engine):
    """FlashInfer >= 0.7.2: ``globalEncodeScale = perTokenScale != 0 ? rcp(perTokenScale) : 0``."""
    got_codes, got_sf, got_scale = quantize_row([0.0] * 16 + [-0.0] * 16, engine=engine)
    assert (got_scale, got_sf) == (0.0, [0x00, 0x00])  # 0 * (0 * rcp(6)) = 0; e4m3(0) = 0x00
    assert got_codes == [0] * 16 + [8] * 16  # block amax 0: output scale 0, -0.0 keeps its sign bit


@pytest.mark.parametrize("engine", ["flashinfer-0.6.13", None])
def test_a_block_whose_scale_underflows_saturates_its_codes(engine):
    row = pad16([2.0**100]) + pad16([1.0, -1.0])  # block 2 scale ~ 448 * 2**-100 -> e4m3 0 -> out = inf
    got_codes, got_sf, got_scale = quantize_row(row, engine=engine)
    assert got_scale == expected_per_token_scale(2.0**100)
    assert got_sf == [0x7E, 0x00]
    assert got_codes == pad16([7]) + [7, 15] + [7] * 14  # x * inf = +-inf -> +-6; 0 * inf = NaN -> +6


def test_a_block_whose_scale_underflows_gets_zero_codes_in_flashinfer_0_7_4():
    """0.7.4: ``outputScale = fp8SFVal != 0 ? rcp(..) : 0`` (a zero E4M3 scale zeroes the block)."""
    row = pad16([2.0**100]) + pad16([1.0, -1.0])
    got_codes, got_sf, _ = quantize_row(row, engine="flashinfer-0.7.4")
    assert got_sf == [0x7E, 0x00]
    assert got_codes == pad16([7]) + [0, 8] + [0] * 14


def test_a_row_whose_per_token_scale_flushes_to_zero():
    row = pad16([2.0**-120, 0.0, -(2.0**-121)]) + [0.0] * 16  # 2**-120 / 2688 is subnormal: FTZ -> 0
    got_codes, got_sf, got_scale = quantize_row(row, engine="flashinfer-0.6.13")
    assert got_scale == 0.0
    assert got_sf == [0x7E, 0x7F]  # inf * amax -> 448; inf * 0 -> NaN
    assert got_codes == [7, 7, 15] + [7] * 13 + [0] * 16  # zeros * inf = NaN -> +6 in the live block
    # 0.7.2: encode 0 -> scale 0 for every block; the live block's output scale rcp(0 * rcp(0)) = NaN,
    # and every value times NaN is NaN -> +6
    got_codes, got_sf, _ = quantize_row(row, engine="sglang-0.5.23")
    assert got_sf == [0x00, 0x00]
    assert got_codes == [7] * 16 + [0] * 16
    got_codes, got_sf, _ = quantize_row(row, engine="flashinfer-0.7.4")  # zero scale: codes 0
    assert (got_sf, got_codes) == ([0x00, 0x00], [0, 0, 8] + [0] * 29)


def test_per_token_scale_is_row_amax_times_float32_base_bit_for_bit():
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(64, 256, generator=g) * torch.logspace(-4, 4, 64)[:, None]).bfloat16()
    _, sf, scale = quantize_nvfp4_per_token_input(x)
    amax = x.float().abs().amax(dim=-1).numpy()
    assert np.array_equal(scale.numpy(), amax.astype(np.float32) * BASE)
    block_amax = x.float().abs().reshape(64, 16, 16).amax(-1)
    holds_row_amax = block_amax == block_amax.amax(dim=-1, keepdim=True)
    assert (sf[holds_row_amax] == 0x7E).all()  # the block holding the row amax gets scale 448
    assert (sf <= 0x7E).all()


def test_round_trip_error_within_the_nvfp4_bound():
    g = torch.Generator().manual_seed(12)
    x = torch.randn(8, 4, 128, generator=g) * torch.exp(torch.randn(8, 4, 1, generator=g) * 3)
    q = nvfp4_per_token.quantize(x)
    s = (codes.e4m3_decode(q.scales) * q.token_scale[..., None]).repeat_interleave(16, dim=-1)
    scaled = x.abs() / s
    half_step = torch.where(scaled < 2, 0.25, torch.where(scaled < 4, 0.5, 1.0))
    err = (formats.dequantize(q) - x).abs()
    assert (err <= torch.maximum(half_step, scaled - 6) * s * (1 + 1e-6)).all()
    assert (q.values != 0).float().mean() > 0.5


def test_leading_dims_quantize_like_the_flattened_rows():
    x = torch.randn(2, 3, 5, 32).bfloat16()
    flat = quantize_nvfp4_per_token_input(x.reshape(-1, 32))
    nested = quantize_nvfp4_per_token_input(x)
    for a, b in zip(flat, nested):
        assert torch.equal(a, b.reshape(a.shape))
    q = nvfp4_per_token.quantize(x)
    assert torch.equal(q.values.reshape(-1, 16), flat[0])
    assert torch.equal(q.token_scale.reshape(-1), flat[2])


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match=r"multiple of 16 .*got shape \(4, 40\).*pad the last dim to 48"):
        quantize_nvfp4_per_token_input(torch.randn(4, 40))
    with pytest.raises(ValueError, match="expected float32, float16 or bfloat16 input, got torch.uint8"):
        quantize_nvfp4_per_token_input(torch.zeros(4, 32, dtype=torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_input_gives_the_same_bytes_on_the_same_device():
    g = torch.Generator().manual_seed(13)
    x = (torch.randn(256, 1024, generator=g) * torch.logspace(-6, 6, 256)[:, None]).bfloat16()
    cpu = quantize_nvfp4_per_token_input(x)
    gpu = quantize_nvfp4_per_token_input(x.cuda())
    assert all(t.is_cuda for t in gpu)
    for a, b in zip(cpu, gpu):
        assert torch.equal(a, b.cpu())


@pytest.mark.gpu
@pytest.mark.flashinfer
@pytest.mark.skipif(
    not HAS_CUDA or torch.cuda.get_device_capability()[0] < 10, reason="FlashInfer's kernel needs sm_100+"
)
def test_matches_flashinfer_nvfp4_quantize_per_token_on_blackwell():
    flashinfer = pytest.importorskip("flashinfer")
    g = torch.Generator().manual_seed(14)
    x = (torch.randn(300, 2048, generator=g) * torch.logspace(-3, 3, 300)[:, None]).bfloat16().cuda()
    x[7] = 0  # all-zero row: 0x7F scale bytes in 0.6.13, 0x00 from 0.7.2
    version = tuple(int(v) for v in flashinfer.__version__.split(".")[:2])
    ours = quantize_nvfp4_per_token_input(x, engine="flashinfer-0.6.13" if version < (0, 7) else "sglang-0.5.23")
    theirs = flashinfer.nvfp4_quantize(
        x,
        nvfp4_per_token.NVFP4_PER_TOKEN_BASE_GLOBAL_SCALE,
        sfLayout=flashinfer.SfLayout.layout_linear,
        per_token_activation=True,
    )
    for a, b in zip(ours, theirs):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
