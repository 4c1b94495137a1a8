"""Parity with FlashInfer 0.6.13 where its quantizers run: the device kernels need sm_100+."""

from __future__ import annotations

import pytest
import torch

from fimoe_lab import formats

HAS_CUDA = torch.cuda.is_available()
BLACKWELL = HAS_CUDA and torch.cuda.get_device_capability()[0] >= 10


def activations(rows: int = 256, cols: int = 1024, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) * torch.logspace(-4, 4, rows)[:, None]).bfloat16()


@pytest.mark.gpu
@pytest.mark.flashinfer
@pytest.mark.skipif(not BLACKWELL, reason="FlashInfer's mxfp8 kernel is compiled for sm_100+ only (zeros on Hopper)")
def test_mxfp8_matches_flashinfer_mxfp8_quantize_bit_for_bit():
    flashinfer = pytest.importorskip("flashinfer")
    x = activations().cuda()
    values, sf = flashinfer.mxfp8_quantize(x, is_sf_swizzled_layout=False)
    q = formats.get("mxfp8").quantize(x)
    assert torch.equal(q.values.view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(q.scales.reshape(-1), sf.view(torch.uint8).reshape(-1))


@pytest.mark.gpu
@pytest.mark.flashinfer
@pytest.mark.skipif(not BLACKWELL, reason="FlashInfer's fp4 kernels are compiled for sm_100+ only")
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_matches_flashinfer_fp4_quantize_bit_for_bit(fmt):
    flashinfer = pytest.importorskip("flashinfer")
    x = activations().cuda()
    if fmt == "nvfp4":
        q = formats.get("nvfp4").quantize(x)
        values, sf = flashinfer.fp4_quantize(x, q.global_scale.reshape(1), 16, False, False)
    else:
        q = formats.get("mxfp4").quantize(x)
        values, sf = flashinfer.fp4_quantize(x, torch.ones(1, device=x.device), 32, True, False)
    assert torch.equal(q.values, values.view(torch.uint8))
    assert torch.equal(q.scales.view(torch.uint8).reshape(-1), sf.view(torch.uint8).reshape(-1))


@pytest.mark.flashinfer
def test_fp8_per_tensor_agrees_with_flashinfers_reference_quantizer():
    """FlashInfer has no per-tensor FP8 kernel; its tests quantize with ``to_float8``
    (``x * (448/amax)``), we with ``x / (amax/448)``: equal up to a rounding at rare near-ties."""
    helpers = pytest.importorskip("flashinfer.trace.templates._init_helpers")
    x = activations().float()
    theirs, inv_scale = helpers.per_tensor_fp8_quantize(x)
    q = formats.get("fp8").quantize(x)
    assert torch.allclose(q.scales, inv_scale, rtol=2**-23, atol=0)
    diff = q.values.view(torch.uint8).int() - theirs.view(torch.uint8).int()
    assert diff.abs().max() <= 1 and (diff == 0).float().mean() > 0.999
