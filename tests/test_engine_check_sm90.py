"""``engine_check``'s independent SM90 MXFP4 x BF16 layout and the ``plan``/``demo`` check built on it.

The check writes what vLLM 0.34 / SGLang 0.5.23 hand FlashInfer's SM90 mixed-input CUTLASS MoE with plain
reshape/permute/bit arithmetic (no steps.py map), so it must (1) equal the kernel-loop oracle of
``tests/test_sm90_mixed.py`` (FlashInfer's CUDA kernels transcribed as per-thread loops) and FlashInfer's own
scale functions (0.6.13 in this venv, 0.7.4 in ``.venv-fi074``), (2) accept the real plan under every profile
on random and structured bytes, and (3) reject plans that are wrong: the 0.6.13 bit layout under a 0.7.x
profile and the reverse, the word bits dropped, rows not paired as the kernel pairs them, no W31 swap.
"""

from __future__ import annotations

import ast
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_sm90_mixed import nibble_coordinates, oracle

from fimoe_lab import builders, engine_check, engines, recipes, special_plans, steps
from fimoe_lab.caches import clear_caches
from fimoe_lab.cli import main

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ("vllm-0.34", "sglang-0.5.23", "flashinfer-0.7.4", "flashinfer-0.6.13")
SHAPES = [(64, 128, True), (96, 160, True), (128, 256, False), (256, 64, True)]


def _structured(plan, gated: bool, experts: int) -> dict[str, torch.Tensor]:
    """Bytes encoding their coordinates, ``(101 e + 37 row + 11 col) % 255 + 1`` (rows up to 255 apart differ
    in every column; never zero)."""
    p, i, h = (2 if gated else 1), plan.intermediate, plan.hidden

    def coded(rows: int, cols: int) -> torch.Tensor:
        e, r, c = torch.arange(experts)[:, None, None], torch.arange(rows)[None, :, None], torch.arange(cols)
        return ((101 * e + 37 * r + 11 * c) % 255 + 1).to(torch.uint8)

    return {
        "w13": coded(p * i, h // 2),
        "w2": coded(h, i // 2),
        "w13_scale": coded(p * i, h // 32),
        "w2_scale": coded(h, i // 32),
    }


# ----------------------------------------------------------------------------- against the oracles
@pytest.mark.parametrize("layout", ["0.6.16", "0.6.10"])
@pytest.mark.parametrize("rows,cols_bytes", [(16, 32), (48, 96), (32, 160)])
def test_weights_equal_the_kernel_loop(layout, rows, cols_bytes):
    g = torch.Generator().manual_seed(rows + cols_bytes)
    for w in (torch.randint(0, 256, (2, rows, cols_bytes), generator=g, dtype=torch.uint8),
              nibble_coordinates(2, rows, cols_bytes)):  # fmt: skip
        assert torch.equal(engine_check.sm90_mixed_weights(w, layout), oracle(w, "fp4", layout))


def test_word_bit_sources_are_a_permutation_and_the_steps_table():
    """32 distinct sources; equal to the project's step (its ``src`` on one word), written independently."""
    src = engine_check.sm90_word_bit_sources()
    assert sorted(src) == list(range(32))
    bits = steps.sm90_mixed_word_bits("fp4", "0.6.16")
    assert [int(s) for s in bits.src.reshape(-1)] == src


@pytest.mark.flashinfer  # the installed FlashInfer's version decides the answer
def test_scales_equal_flashinfer_0613s_own_function():
    from flashinfer.fused_moe.core import interleave_moe_scales_for_sm90_mixed_gemm as fi

    g = torch.Generator().manual_seed(3)
    s = torch.randint(1, 256, (3, 96, 20), generator=g, dtype=torch.uint8)
    assert torch.equal(engine_check.sm90_mixed_scales(s, "0.6.10"), fi(s).reshape(3, -1))


def _flashinfer_074_scales():
    """FlashInfer 0.7.4's own ``interleave_moe_scales_for_sm90_mixed_gemm`` (pure torch), its source read from
    the wheel in ``.venv-fi074`` and run here without its decorator (importing FlashInfer there takes ~15 s)."""
    found = sorted(ROOT.glob(".venv-fi074/lib/python*/site-packages/flashinfer/fused_moe/prepare.py"))
    if not found:
        pytest.skip("needs .venv-fi074 (FlashInfer 0.7.4; made by .ci/run)")
    tree = ast.parse(found[0].read_text())
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == NAME_074]
    fn.decorator_list = []
    scope: dict = {"torch": torch}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(found[0]), "exec"), scope)
    return scope[NAME_074]


NAME_074 = "interleave_moe_scales_for_sm90_mixed_gemm"


def test_scales_equal_flashinfer_074s_own_function():
    fi = _flashinfer_074_scales()
    g = torch.Generator().manual_seed(4)
    cases = [torch.randint(1, 256, (2, 128, 8), generator=g, dtype=torch.uint8)]
    cases.append(((torch.arange(3 * 192 * 16) % 251) + 1).to(torch.uint8).reshape(3, 192, 16))
    for s in cases:
        assert torch.equal(engine_check.sm90_mixed_scales(s, "0.6.16"), fi(s).reshape(s.shape[0], -1))


# ----------------------------------------------------------------------------- the plan check
@pytest.mark.parametrize("engine", PROFILES)
@pytest.mark.parametrize("inter,hidden,gated", SHAPES)
def test_the_real_plan_passes(engine, inter, hidden, gated):
    plan = special_plans.plan_cutlass_mxfp4_bf16(inter, hidden, gated, engine)
    assert engine_check.check_plan_sm90_mixed(plan, gated, 2, engine) == {"weights": True, "scales": True}
    given = _structured(plan, gated, 3)
    assert engine_check.check_plan_sm90_mixed(plan, gated, 3, engine, tensors=given) == {
        "weights": True,
        "scales": True,
    }


@pytest.mark.parametrize("inter,hidden,gated", SHAPES)
@pytest.mark.parametrize("structured", [False, True])
def test_wrong_plans_fail(inter, hidden, gated, structured):
    new, old = "vllm-0.34", "flashinfer-0.6.13"
    assert engines.get_engine(new).sm90_mixed_layout != engines.get_engine(old).sm90_mixed_layout
    plan = special_plans.plan_cutlass_mxfp4_bf16(inter, hidden, gated, new)
    given = _structured(plan, gated, 2) if structured else None

    def check(p, engine=new):
        return engine_check.check_plan_sm90_mixed(p, gated, 2, engine, seed=5, tensors=given)

    legacy = special_plans.plan_cutlass_mxfp4_bf16(inter, hidden, gated, old)
    assert check(legacy) == {"weights": False, "scales": False}  # 0.6.13's bits and scales under 0.7.x
    assert check(plan, old) == {"weights": False, "scales": False}
    assert check(replace(plan, word_bits={})) == {"weights": False, "scales": True}
    ip, hp = plan.padded_intermediate, plan.padded_hidden
    p = 2 if gated else 1
    pad = builders.plan_align_fp4(inter, hidden, gated, 128, 128, 32, 0)
    gather = steps.interleave_sm90_mixed_weights(hp, ip // 2, "fp4")
    unpaired = builders.chain(pad.w2, steps.interleave_rows_for_gated_act(hp, ip // 2), gather)  # r not with r+8
    assert check(replace(plan, w2=unpaired)) == {"weights": False, "scales": True}
    two_byte = builders.chain(pad.w2, steps.interleave_sm90_mixed_weights(hp, ip // 2, "int4"))
    assert check(replace(plan, w2=two_byte)) == {"weights": False, "scales": True}
    if gated:  # no [gate; up] -> [up; gate]
        unswapped = builders.chain(pad.w13, steps.interleave_sm90_mixed_weights(p * ip, hp // 2, "fp4"))
        assert check(replace(plan, w13=unswapped)) == {"weights": False, "scales": True}


# ----------------------------------------------------------------------------- plan and demo
def test_cli_plan_reports_scales_and_weights(capsys):
    argv = ["plan", "--format", "mxfp4", "--backend", "cutlass", "--intermediate", "96", "--hidden", "160"]
    for engine in ("vllm-0.34", "flashinfer-0.6.13"):
        assert main([*argv, "--mxfp4-activation", "bf16", "--engine", engine, "--json"]) == 0
        (plan,) = json.loads(capsys.readouterr().out)["plans"]
        assert plan["engine_scales"] is True and plan["engine_weights"] is True
    assert main([*argv, "--mxfp4-activation", "bf16"]) == 0
    text = capsys.readouterr().out
    assert "scales     vs the engine layout" in text and "weights    vs the engine layout" in text
    assert main([*argv, "--json"]) == 0  # the MXFP8-activation layout: scales checked, weights not
    (plan,) = json.loads(capsys.readouterr().out)["plans"]
    assert plan["engine_scales"] is True and plan["engine_weights"] is None


def test_cli_plan_fails_a_wrong_plan(capsys, monkeypatch):
    """A plan with the 0.6.13 layout under vllm-0.34 is a MISMATCH and exit 1."""
    real = special_plans.plan_cutlass_mxfp4_bf16_padded

    def legacy(inter, hidden, padded_inter, padded_hidden, gated=True, engine=None):
        return real(inter, hidden, padded_inter, padded_hidden, gated, "flashinfer-0.6.13")

    monkeypatch.setattr(recipes, "plan_cutlass_mxfp4_bf16_padded", legacy)
    clear_caches()
    try:
        argv = ["plan", "--format", "mxfp4", "--backend", "cutlass", "--intermediate", "64", "--hidden", "128"]
        assert main([*argv, "--mxfp4-activation", "bf16", "--engine", "vllm-0.34", "--json"]) == 1
        (plan,) = json.loads(capsys.readouterr().out)["plans"]
        assert plan["engine_scales"] is False and plan["engine_weights"] is False
    finally:
        clear_caches()


def test_cli_demo_reports_scales_and_weights(tmp_path, capsys):
    assert main(["demo", "gpt-oss-mxfp4", "--out", str(tmp_path), "--mxfp4-activation", "bf16", "--json"]) == 0
    layers = json.loads(capsys.readouterr().out)["layers"]
    cutlass = [r for r in layers if r["backend"] == "cutlass"]
    assert cutlass and all(r["engine_scales"] is True and r["engine_weights"] is True for r in cutlass)
    assert all(r["engine_weights"] is None for r in layers if r["backend"] == "trtllm")
