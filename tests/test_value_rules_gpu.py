"""The engines' FP8 per-tensor requantization run by their own code on CUDA, against fimoe_lab.value_rules;
skipped without CUDA (and each engine's test without that engine importable here with CUDA).

Their quantizers are CUDA kernels (vLLM's ``_C.static_scaled_fp8_quant``, SGLang's JIT ``per_tensor_quant_fp8``),
so the CPU tests (tests/test_value_rules.py) compare with a loop written from the engines' code instead; these run
the engines' functions themselves, and check the one PyTorch fact that loop rests on.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import coords, random_bytes

from fimoe_lab import value_rules

pytestmark = pytest.mark.gpu

F8 = torch.float8_e4m3fn


def cases() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(name, w13 (E, 2I, H) float8_e4m3fn, scales (E, 2))``: random and structured bytes (NaN codes
    included), scales that differ, are equal, are 0, NaN, overflow float16 and are float16 subnormals."""
    e, rows, cols = 6, 64, 128
    scales = torch.tensor([[0.011, 0.023], [0.3, 0.3], [0.0, 0.01], [200.0, 300.0], [1e-7, 3e-7], [0.125, 0.125]])
    structured = coords(e, rows, cols // 4).view(torch.uint8).view(F8).reshape(e, rows, cols)
    return [("random", random_bytes((e, rows, cols), F8, seed=1), scales), ("structured", structured, scales)]


def test_cuda_multiply_reads_a_float32_scale_as_float16():
    """``per_tensor_dequantize``'s ``w.to(float16) * scale`` with a 0-d float32 CUDA scale: PyTorch's CUDA kernel
    casts the scale to the result dtype, float16, before the float32 product (the CPU kernel keeps it float32)."""
    w = torch.arange(256, dtype=torch.uint8).view(F8).cuda()
    w = w[~w.float().isnan()]
    for s in (0.0123456789, 3.3e-5, 1.7e-3, 1e-7):
        scale = torch.tensor([s, 1.0], device="cuda")[0]
        got = w.to(torch.float16) * scale
        want = (w.float() * scale.half().float()).half()
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), s


@pytest.mark.parametrize("nan_to", [-448.0, 448.0])
@pytest.mark.parametrize("name", ["random", "structured"])
def test_requantize_on_cuda_is_the_engines_loop(name, nan_to):
    """``requantize_fp8_max`` run on CUDA tensors gives the element-by-element loop's bytes (the engines'
    arithmetic, tests/test_value_rules.py) and the same bytes as on the CPU: the rule is device-independent."""
    from test_value_rules import requantize_loop

    _, w13, s = next(c for c in cases() if c[0] == name)
    w13, s = w13[:, :8, :16].contiguous(), s  # the loop is per element: a corner of each expert
    want, want_m = requantize_loop(w13, s, nan_to)
    got, got_m = value_rules.requantize_fp8_max(w13.cuda(), s.cuda(), nan_to)
    cpu, _ = value_rules.requantize_fp8_max(w13, s, nan_to)
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(got.cpu().view(torch.uint8), cpu.view(torch.uint8))
    assert torch.equal(got_m.cpu().nan_to_num(), want_m.nan_to_num())


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM 0.34 installed with CUDA")
@pytest.mark.parametrize("name", ["random", "structured"])
def test_vllm_process_fp8_weight_tensor_strategy_moe(name):
    from vllm.model_executor.layers.quantization.utils.fp8_utils import process_fp8_weight_tensor_strategy_moe

    _, w13, s = next(c for c in cases() if c[0] == name)
    w, m = process_fp8_weight_tensor_strategy_moe(w13.cuda().clone(), s.cuda(), w13.shape[1] // 2, w13.shape[0])
    mine, mine_m = value_rules.requantize_fp8_max(w13.cuda(), s.cuda(), -448.0)
    assert torch.equal(w.view(torch.uint8), mine.view(torch.uint8))
    assert torch.equal(m.isnan(), mine_m.isnan()) and torch.equal(m.nan_to_num(), mine_m.nan_to_num())


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs SGLang 0.5.23 installed with CUDA")
@pytest.mark.parametrize("name", ["random", "structured"])
def test_sglang_requantize_loop(name):
    """SGLang's loop (``Fp8MoEMethod.process_weights_after_loading``, ``sglang/srt/layers/quantization/fp8.py:2709``)
    over its own ``per_tensor_dequantize`` and ``scaled_fp8_quant``."""
    from sglang.kernels.ops.quantization.fp8_kernel import scaled_fp8_quant
    from sglang.srt.layers.quantization.utils import per_tensor_dequantize

    _, w13, s = next(c for c in cases() if c[0] == name)
    w, sc = w13.cuda().clone(), s.cuda()
    m = sc.max(dim=1).values
    half = w.shape[1] // 2
    for e in range(w.shape[0]):
        for k in range(2):
            rows = slice(k * half, (k + 1) * half)
            w[e][rows, :], _ = scaled_fp8_quant(per_tensor_dequantize(w[e][rows, :], sc[e][k]), m[e])
    mine, _ = value_rules.requantize_fp8_max(w13.cuda(), sc, 448.0)
    assert torch.equal(w.view(torch.uint8), mine.view(torch.uint8))
