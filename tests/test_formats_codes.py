"""Bit-level codes: every E2M1 code and E4M3 byte, tie rounding, saturation, UE8M0, rcp.approx."""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import pytest
import torch

from fimoe_lab.formats import codes

E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def f32(v: float) -> float:
    """Round a Python float to float32 and back."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def bits_f32(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def from_bits(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b))[0]


def next_up(v: float) -> float:
    """The next float32 above the positive float32 ``v``."""
    return from_bits(bits_f32(v) + 1)


def next_down(v: float) -> float:
    """The next float32 below the positive float32 ``v``."""
    return from_bits(bits_f32(v) - 1)


def nearest_even(value: Fraction, grid: list[Fraction]) -> int:
    """Index into sorted ``grid`` of the nearest point to ``value``, ties to the even index."""
    return min(range(len(grid)), key=lambda i: (abs(grid[i] - value), i % 2))


# ---------------------------------------------------------------- E2M1


def test_every_e2m1_code_decodes_and_reencodes_to_itself():
    all_codes = torch.arange(16, dtype=torch.uint8)
    values = codes.e2m1_decode(all_codes)
    assert values.tolist() == E2M1_GRID + [-v for v in E2M1_GRID]
    assert torch.equal(codes.e2m1_encode(values), all_codes)  # -0.0 keeps code 8


@pytest.mark.parametrize(
    "x, code",
    [
        (0.25, 0),
        (next_up(0.25), 1),
        (0.5, 1),
        (next_down(0.75), 1),
        (0.75, 2),
        (1.25, 2),
        (next_up(1.25), 3),
        (next_down(1.75), 3),
        (1.75, 4),
        (2.5, 4),
        (next_up(2.5), 5),
        (3.5, 6),
        (next_down(3.5), 5),
        (5.0, 6),
        (next_up(5.0), 7),
        (6.0, 7),
        (6.5, 7),
        (1e30, 7),
        (math.inf, 7),
        (-0.25, 8),
        (-0.75, 10),
        (-5.0, 14),
        (-math.inf, 15),
        (-0.1, 8),
        (-0.0, 8),
        (0.0, 0),
        (1e-40, 0),
        (-1e-40, 8),
        (math.nan, 7),
    ],
)
def test_e2m1_ties_to_even_saturation_signed_zero_and_nan(x, code):
    assert codes.e2m1_encode(torch.tensor([x], dtype=torch.float32)).item() == code


def test_e2m1_matches_exact_nearest_even_on_a_dense_grid_and_around_every_midpoint():
    grid = [Fraction(v) for v in E2M1_GRID]
    midpoints = [(a + b) / 2 for a, b in zip(grid, grid[1:])]
    xs = [i / 256 for i in range(0, 8 * 256)]
    for m in midpoints:
        xs += [float(m), next_up(float(m)), next_down(float(m))]
    xs = [f32(v) for v in xs]
    expected = [nearest_even(min(Fraction(v), Fraction(6)), grid) for v in xs]
    got = codes.e2m1_encode(torch.tensor(xs, dtype=torch.float32))
    assert got.tolist() == expected
    neg = codes.e2m1_encode(-torch.tensor(xs, dtype=torch.float32))
    assert neg.tolist() == [e | 8 for e in expected]


def test_pack_puts_the_first_element_in_the_low_nibble_and_unpack_inverts():
    assert codes.pack_nibbles(torch.tensor([1, 2, 0xF, 0x7], dtype=torch.uint8)).tolist() == [0x21, 0x7F]
    g = torch.Generator().manual_seed(1)
    c = torch.randint(0, 16, (3, 5, 32), generator=g, dtype=torch.uint8)
    assert torch.equal(codes.unpack_nibbles(codes.pack_nibbles(c)), c)


def test_pack_rejects_an_odd_last_dim_and_unpack_a_non_byte_tensor():
    with pytest.raises(ValueError, match=r"must be even; got shape \(2, 3\)"):
        codes.pack_nibbles(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="must be uint8"):
        codes.unpack_nibbles(torch.zeros(2, 3, dtype=torch.int32))


# ---------------------------------------------------------------- E4M3


def e4m3_grid() -> list[Fraction]:
    """The 127 non-negative finite E4M3 values, by code 0..126, computed from the format."""
    out = []
    for code in range(127):
        e, m = code >> 3, code & 7
        out.append(Fraction(m, 8) * Fraction(2) ** -6 if e == 0 else (1 + Fraction(m, 8)) * Fraction(2) ** (e - 7))
    return out


def test_every_e4m3_byte_round_trips_except_nan_which_becomes_0x7f():
    all_bytes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    again = codes.e4m3_encode(codes.e4m3_decode(all_bytes))
    expected = all_bytes.clone()
    expected[0x7F] = 0x7F
    expected[0xFF] = 0x7F
    assert torch.equal(again, expected)
    assert [float(v) for v in e4m3_grid()] == codes.e4m3_decode(all_bytes[:127]).tolist()


def test_e4m3_rounds_to_nearest_even_at_every_midpoint_incl_subnormals():
    grid = e4m3_grid()
    xs = []
    for a, b in zip(grid, grid[1:]):
        mid = float((a + b) / 2)
        xs += [mid, next_up(mid), next_down(mid), float(a)]
    expected = [nearest_even(Fraction(v), grid) for v in xs]
    got = codes.e4m3_encode(torch.tensor(xs, dtype=torch.float32))
    assert got.tolist() == expected
    assert codes.e4m3_encode(-torch.tensor(xs, dtype=torch.float32)).tolist() == [e | 0x80 for e in expected]


@pytest.mark.parametrize(
    "x, byte",
    [
        (448.0, 0x7E),
        (463.9, 0x7E),
        (464.0, 0x7E),
        (465.0, 0x7E),
        (1e30, 0x7E),
        (math.inf, 0x7E),
        (-500.0, 0xFE),
        (-math.inf, 0xFE),
        (math.nan, 0x7F),
        (-math.nan, 0x7F),
        (2.0**-10, 0x00),
        (next_up(2.0**-10), 0x01),
        (-1e-5, 0x80),
    ],
)
def test_e4m3_saturates_like_satfinite_and_nan_is_0x7f(x, byte):
    assert codes.e4m3_encode(torch.tensor([x])).item() == byte


# ---------------------------------------------------------------- UE8M0 and FTZ


def test_ue8m0_rounds_up_to_a_power_of_two_and_saturates():
    for k in range(-126, 128):
        assert codes.ue8m0_encode_ceil(torch.tensor([2.0**k])).item() == k + 127
        if k < 127:
            assert codes.ue8m0_encode_ceil(torch.tensor([next_up(2.0**k)])).item() == k + 128
        assert codes.ue8m0_decode(torch.tensor([k + 127], dtype=torch.uint8)).item() == 2.0**k
    special = torch.tensor([0.0, 2.0**-127, next_up(2.0**-127), 3e38, math.inf, math.nan, -0.75])
    assert codes.ue8m0_encode_ceil(special).tolist() == [0, 0, 1, 254, 254, 255, 127]
    assert math.isnan(codes.ue8m0_decode(torch.tensor([255], dtype=torch.uint8)).item())
    assert codes.ue8m0_decode(torch.tensor([0], dtype=torch.uint8)).item() == 2.0**-127


def test_ftz_flushes_subnormals_to_signed_zero_only():
    x = torch.tensor([1e-39, -1e-39, 2.0**-126, -(2.0**-126), 0.0, math.inf])
    out = codes.ftz(x)
    assert out.tolist() == [0.0, 0.0, 2.0**-126, -(2.0**-126), 0.0, math.inf]
    assert torch.signbit(out).tolist() == [False, True, False, True, False, False]


# ---------------------------------------------------------------- rcp.approx.ftz.f32


@pytest.mark.parametrize(
    "x_bits, hw_bits",
    [  # measured on an H200 with rcp.approx.ftz.f32
        (0x3F80E832, 0x3F7E32E1),
        (0x3F8146CF, 0x3F7D78D7),
        (0x3FF904DD, 0x3F03969F),  # RN + 1 ulp
        (0x3F8005A9, 0x3F7FF4AE),
        (0x3FDDF2D5, 0x3F13A347),  # RN - 1 ulp
        (0x3F800001, 0x3F7FFFFE),
        (0x3FC74496, 0x3F247122),  # RN
        (0x40C00000, 0x3E2AAAAB),
        (0x43E00000, 0x3B124925),
        (0x39C30C31, 0x45280000),  # 6, 448, f32(1/2688)
        (0x00000000, 0x7F800000),
        (0x80000000, 0xFF800000),
        (0x000116C2, 0x7F800000),  # 0, -0, subnormal
        (0x7E800000, 0x00800000),
        (0x7EC00000, 0x00000000),
        (0x7F800000, 0x00000000),  # 2^126, 1.5*2^126, inf
        (0xC0C00000, 0xBE2AAAAB),
        (0x00800000, 0x7E800000),
    ],
)
def test_rcp_approx_reproduces_measured_hardware_results(x_bits, hw_bits):
    x = torch.tensor([x_bits], dtype=torch.int64).to(torch.int32).view(torch.float32)
    got = codes.rcp_approx_ftz(x).view(torch.int32).item() & 0xFFFFFFFF
    assert got == hw_bits


def test_rcp_approx_is_within_one_ulp_of_the_true_reciprocal_across_exponents():
    g = torch.Generator().manual_seed(0)
    x = torch.exp2(torch.empty(100_000).uniform_(-120, 120, generator=g)) * torch.where(
        torch.rand(100_000, generator=g) < 0.5, -1.0, 1.0
    )
    got = codes.rcp_approx_ftz(x).view(torch.int32).long()
    rn = (1.0 / x).view(torch.int32).long()
    assert (got - rn).abs().max().item() == 1
    assert ((got - rn) != 0).float().mean().item() > 0.05  # the table is really used


def test_rcp_approx_nan_stays_nan():
    assert math.isnan(codes.rcp_approx_ftz(torch.tensor([math.nan])).item())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_max_abs_per_byte_is_the_pairwise_max_of_the_dequantized_values(fmt):
    """The lab's per-byte magnitude from the bytes (a 256-entry table) equals dequantize().abs() max-reduced over
    each byte's two values, bit for bit: on every byte value with random scales (negative and dead ones too)."""
    from fimoe_lab import formats

    spec = formats.get(fmt)
    torch.manual_seed(7)
    q = spec.quantize(torch.randn(3, 32, 256) * torch.logspace(-4, 3, 32)[None, :, None])
    every = torch.arange(256, dtype=torch.uint8).repeat(3, 32, 1)[..., : q.values.shape[-1]]
    scales = q.scales.view(torch.uint8).clone()
    scales[0, 0] = torch.arange(scales.shape[-1], dtype=torch.uint8) * 17  # sign bits, zero, NaN patterns
    for values in (q.values, every):
        probe = formats.QuantizedTensor(values, scales.view(q.scales.dtype), q.global_scale, q.fmt, q.block_size)
        want = formats.dequantize(probe).abs()
        want = want.reshape(*want.shape[:-1], -1, 2).amax(dim=-1)
        got = spec.max_abs_per_byte(probe)
        assert got.shape == want.shape and torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
