"""check_quantized: silent on good tensors, loud on the traps seen with FlashInfer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fimoe_lab import formats
from fimoe_lab.formats import check_quantized, nvfp4_per_token
from fimoe_lab.formats.health import HOPPER_ZEROS

HAS_CUDA = torch.cuda.is_available()


def sample(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 128, 256, generator=g).bfloat16()


@pytest.mark.parametrize("fmt", formats.names())
def test_a_good_quantization_has_no_warnings(fmt):
    x = sample()
    assert check_quantized(formats.get(fmt).quantize(x), x) == []


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4-per-token"])
def test_all_zero_output_for_a_non_zero_input_names_the_hopper_trap(fmt):
    x = sample()
    good = formats.get(fmt).quantize(x)
    hopper = dataclasses.replace(good, values=torch.zeros_like(good.values), scales=torch.zeros_like(good.scales))
    warnings = check_quantized(hopper, x)
    assert len(warnings) == 1 and HOPPER_ZEROS in warnings[0] and "every block scale is 0" in warnings[0]
    zero_values_only = dataclasses.replace(good, values=torch.zeros_like(good.values))
    assert any(HOPPER_ZEROS in w and "every quantized value is 0" in w for w in check_quantized(zero_values_only, x))


def test_all_zero_scale_bytes_are_flagged_even_without_the_original():
    good = formats.get("mxfp8").quantize(sample())
    broken = dataclasses.replace(good, scales=torch.zeros_like(good.scales))  # UE8M0 byte 0 = 2**-127
    assert check_quantized(broken) == ["mxfp8: every block scale is 0 (all scale bytes zero) for a non-zero input."]


def test_an_all_zero_input_is_not_an_error():
    x = torch.zeros(2, 16, 64)
    for fmt in ("fp8", "fp8-block", "nvfp4"):
        assert check_quantized(formats.get(fmt).quantize(x), x) == []


def test_dead_expert_scales_below_1e_10_are_flagged_with_their_position():
    x = sample().float()
    x[2] *= 1e-20  # a dead expert, like the ~1e-23 scales of real FP8 checkpoints
    warnings = check_quantized(formats.get("fp8-block").quantize(x), x)
    assert len(warnings) == 1
    assert "2 block scales are below 1e-10" in warnings[0] and "[[2, 0, 0], [2, 0, 1]]" in warnings[0]
    assert "clamp them to >= 1e-10" in warnings[0]


def test_nan_scales_of_all_zero_rows_are_explained():
    # FlashInfer 0.6.13's per-token kernel gives an all-zero row scale byte 0x7F (NaN): flagged, explained
    x = sample()
    x[1, 5] = 0
    warnings = check_quantized(nvfp4_per_token.quantize(x, engine="flashinfer-0.6.13"), x)
    assert len(warnings) == 1
    assert "16 of 8192 block scales are NaN/inf at [[1, 5, 0]" in warnings[0] and "all-zero rows" in warnings[0]


def test_all_zero_rows_under_the_0_7_kernel_have_zero_scales_and_no_warning():
    # FlashInfer 0.7.x (the default vllm-0.34 profile) writes scale byte 0x00 for an all-zero row
    x = sample()
    x[1, 5] = 0
    q = nvfp4_per_token.quantize(x)
    assert check_quantized(q, x) == []
    assert not q.scales.view(torch.uint8)[1, 5].any()


def test_nan_global_scale_and_shape_mismatch():
    x = sample()
    q = formats.get("nvfp4").quantize(x)
    bad = dataclasses.replace(q, global_scale=torch.tensor([1.0, float("nan"), 1.0, 1.0]))
    assert any("global_scale has NaN/inf at [[1]]" in w for w in check_quantized(bad))
    assert any("does not match the original (4, 128, 512)" in w for w in check_quantized(q, torch.zeros(4, 128, 512)))


@pytest.mark.gpu
@pytest.mark.flashinfer
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability()[0] >= 10, reason="needs a pre-Blackwell GPU")
def test_flags_flashinfer_nvfp4_quantize_zeros_on_a_pre_blackwell_gpu():
    flashinfer = pytest.importorskip("flashinfer")
    x = sample().reshape(-1, 256).cuda()
    x_fp4, x_sf, per_token = flashinfer.nvfp4_quantize(
        x, 1.0 / (448 * 6), sfLayout=flashinfer.SfLayout.layout_linear, per_token_activation=True
    )
    q = formats.QuantizedTensor(
        x_fp4.view(torch.uint8), x_sf.view(torch.float8_e4m3fn), None, "nvfp4-per-token", 16, per_token
    )
    warnings = check_quantized(q, x)
    assert any(HOPPER_ZEROS in w for w in warnings), warnings
