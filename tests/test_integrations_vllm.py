"""``fimoe_lab.integrations.vllm``: installing it changes no byte of vLLM 0.34's preparation.

The oracle is vLLM's own code, run in its own environment (``.venv-vllm``: torch 2.13 CPU,
FlashInfer 0.7.4 (vLLM's pin 0.7.3 is not on the index), vLLM 0.34.0 installed ``--no-deps``,
fimoe_lab on ``PYTHONPATH``). ``tests/engine_oracles/integrations_vllm.py`` loads vLLM's
preparation modules from the wheel's files alone (``_isolate``: vLLM's package ``__init__``
needs CUDA extensions; every other ``vllm.*`` module is a stub), runs each case through the
entry point vLLM calls (FP8 per-tensor, DeepSeek FP8 block and MXFP8 through
``prepare_fp8_moe_layer_for_fi``, NVFP4 through ``prepare_nvfp4_moe_layer_for_fi_or_cutlass``,
BF16 as ``oracle/unquantized`` calls it, gpt-oss MXFP4 through
``convert_gpt_oss_weight_to_mxfp4_moe_kernel_format``; TRT-LLM and CUTLASS) as shipped and then under
``installed()``, and compares every output and every input afterwards byte for byte, with
shapes, dtypes, aliasing, the layer's sizes and the permute-index cache. Inputs are random
bytes and structured ones (each 4-byte word its own index); shapes are odd sizes and TP
shards (fixed list) plus shapes hypothesis draws per run. One subprocess runs them all.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from engine_envs import ROOT, drawn, oracle_marks, run_oracle
from hypothesis import strategies as st

pytestmark = oracle_marks("vllm")


def fixed_cases() -> list[dict]:
    """Odd sizes and TP shards through every path; fills alternate random / structured."""
    c: list[dict] = []
    for trt in (True, False):
        for i, h, am in ((232, 256, True), (256, 384, True), (96, 256, False), (200, 128, False), (128, 256, False)):
            c.append(dict(op="fp8", inter=i, hidden=h, act_and_mul=am, gated=am, trtllm=trt))
        for i, h in ((256, 512), (384, 256), (2048 // 16, 7168 // 28)):
            c.append(dict(op="fp8", inter=i, hidden=h, act_and_mul=True, gated=True, trtllm=trt, block=[128, 128]))
        for i, h, am, pt in ((256, 2688, False, True), (128, 256, False, False), (128, 512, True, False)):
            c.append(dict(op="nvfp4", inter=i, hidden=h, act_and_mul=am, gated=am, trtllm=trt, per_token=pt))
    for i, h, flat in ((200, 320, False), (256, 256, True), (96, 512, False), (2048 // 8, 7168 // 14, False)):
        c.append(
            dict(
                op="fp8", inter=i, hidden=h, act_and_mul=True, gated=True, trtllm=True, block=[1, 32], flat_scales=flat
            )
        )
    for i, h in ((176, 320), (464, 256), (1856 // 8, 256)):  # NVFP4 TRT-LLM pads I to 64 and H to 256
        c.append(dict(op="nvfp4", inter=i, hidden=h, act_and_mul=True, gated=True, trtllm=True, per_token=False))
    for i, h, am in ((200, 256, True), (256, 384, False), (1856 // 8, 128, True)):
        c.append(dict(op="bf16", inter=i, hidden=h, act_and_mul=am, gated=am))
    for i, h, backend in ((256, 384, "BF16"), (384, 256, "MXFP8"), (128, 512, "BF16")):  # padded as vLLM pads gpt-oss
        c.append(
            dict(
                op="mxfp4_gptoss",
                inter=i,
                hidden=h,
                act_and_mul=True,
                gated=True,
                backend=f"FLASHINFER_TRTLLM_MXFP4_{backend}",
            )
        )
    c += [
        dict(op="swap", inter=232, hidden=256, act_and_mul=True, gated=True),
        dict(op="align", inter=232, hidden=256, act_and_mul=True, gated=True, align=16),
        dict(op="align", inter=100, hidden=128, act_and_mul=False, gated=False, align=128),
        dict(op="rotate", inter=256, hidden=256, act_and_mul=True, gated=True),
        dict(op="rotate", inter=128, hidden=384, act_and_mul=False, gated=False),
        dict(op="deepseek_shuffle", inter=256, hidden=384, act_and_mul=True, gated=True),
    ]
    return [dict(case, experts=3, fill=("random", "structured")[n % 2], seed=n) for n, case in enumerate(c)]


@st.composite
def drawn_case(draw) -> dict:
    op = draw(st.sampled_from(["fp8", "fp8-block", "mxfp8", "nvfp4", "bf16"]))
    trt, e, fill = draw(st.booleans()), draw(st.integers(1, 4)), draw(st.sampled_from(["random", "structured"]))
    base = dict(experts=e, fill=fill, seed=draw(st.integers(0, 99)), trtllm=trt)
    if op == "fp8":
        am = draw(st.booleans())
        return dict(
            base,
            op="fp8",
            inter=16 * draw(st.integers(1, 24)),
            hidden=32 * draw(st.integers(1, 12)),
            act_and_mul=am,
            gated=am,
        )
    if op == "fp8-block":
        return dict(
            base,
            op="fp8",
            inter=128 * draw(st.integers(1, 3)),
            hidden=128 * draw(st.integers(1, 4)),
            act_and_mul=True,
            gated=True,
            block=[128, 128],
        )
    if op == "mxfp8":
        return dict(
            base,
            op="fp8",
            inter=32 * draw(st.integers(1, 12)),
            hidden=32 * draw(st.integers(1, 16)),
            act_and_mul=True,
            gated=True,
            block=[1, 32],
            flat_scales=draw(st.booleans()),
        )
    if op == "nvfp4":
        am = draw(st.booleans())
        return dict(
            base,
            op="nvfp4",
            inter=16 * draw(st.integers(1, 24)),
            hidden=64 * draw(st.integers(1, 12)),
            act_and_mul=am,
            gated=am,
            per_token=draw(st.booleans()),
        )
    am = draw(st.booleans())
    return dict(
        base,
        op="bf16",
        inter=8 * draw(st.integers(1, 40)),
        hidden=64 * draw(st.integers(1, 6)),
        act_and_mul=am,
        gated=am,
    )


def drawn_cases(n: int = 8) -> list[dict]:
    return drawn(drawn_case(), n)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    cases = fixed_cases() + drawn_cases()
    path = tmp_path_factory.mktemp("integrations_vllm") / "cases.json"
    path.write_text(json.dumps(cases))
    return json.loads(run_oracle("vllm", "integrations_vllm.py", path, with_fimoe_lab=True))


def test_installed_changes_no_byte(report):
    bad = [r for r in report["results"] if r["diffs"]]
    assert not bad, json.dumps(bad[:3], indent=1)


def test_no_case_fell_back_to_vllm(report):
    """Every input vLLM takes, fimoe_lab takes too (a fallback would hide a missing shape)."""
    fell = [r for r in report["results"] if r["fallbacks"] and r["engine_error"] is None]
    assert not fell, json.dumps(fell[:3], indent=1)
    refused = [r["case"] for r in report["results"][: len(fixed_cases())] if r["engine_error"]]
    assert [c.get("flat_scales") for c in refused] == [True], refused  # vLLM's own MXFP8 bug, kept


def test_install_replaces_every_lookup_and_uninstall_restores(report):
    r = report["install"]
    fu, fp4 = (
        "vllm.model_executor.layers.quantization.utils.flashinfer_utils",
        "vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe",
    )
    assert f"{fu}.prepare_fp8_moe_layer_for_fi" in r["changed"]  # its TRT-LLM FP8 paths: one map a tensor
    assert {
        f"{fp4}.align_fp4_moe_weights_for_fi",
        f"{fp4}.prepare_static_weights_for_trtllm_fp4_moe",
        f"{fp4}.reorder_w1w3_to_w3w1",
    } <= set(r["changed"])
    assert r["mxfp4_swap_replaced"] and r["late_import_replaced"]
    assert r["restored"] and r["late_import_restored"] and r["plugin_installed"]
    assert r["forced_changes"] >= 12 and r["forced_restored"]


def test_untested_flashinfer_is_refused_changing_nothing(report):
    r = report["install"]
    assert r["refusal"] and "\n" not in r["refusal"] and "flashinfer-python 0.7.4" in r["refusal"]
    assert "(fix: " in r["refusal"] and r["refusal_changed_nothing"]


def test_import_loads_no_engine_and_refuses_without_vllm():
    """Here (no vLLM in this environment): import is free, install refuses in one line, the plugin only logs."""
    code = (
        "import sys, fimoe_lab.integrations.vllm as v\n"
        "assert 'vllm' not in sys.modules and 'sglang' not in sys.modules and 'torch' not in sys.modules\n"
        "try:\n    v.install()\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
        "assert not v.INTEGRATION.is_installed and 'vllm' not in sys.modules\n"
        "import os; os.environ['FIMOE_LAB_INSTALL'] = '1'; v.register()\n"
        "assert not v.INTEGRATION.is_installed\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("EngineVersionError ") and "installed: vllm (none)" in done.stdout
    assert "not installed into vllm" in done.stderr
