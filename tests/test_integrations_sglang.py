"""``fimoe_lab.integrations.sglang``: installing it changes no byte of SGLang 0.5.23's FlashInfer TRT-LLM preparation.

The oracle is SGLang's own code, run in its own environment (``.venv-sglang``: torch 2.13 CPU,
FlashInfer 0.7.2, SGLang 0.5.23 installed ``--no-deps``, fimoe_lab on ``PYTHONPATH``).
``tests/engine_oracles/integrations_sglang.py`` loads ``srt/layers/quantization/utils.py`` and
``srt/layers/moe/moe_runner/flashinfer_trtllm.py`` and ``srt/layers/quantization/unquant.py``
from the wheel's files alone (``_isolate``: every other ``sglang.*`` module is a stub), runs
SGLang's NVFP4 (``align_fp4_moe_weights_for_flashinfer_trtllm`` and the replaced
``prepare_static_weights_for_trtllm_fp4_moe``), FP8 per-tensor, MXFP8 and BF16 TRT-LLM
preparation as shipped and then under ``installed()``, and compares every tensor byte for
byte (shapes, dtypes, aliasing, the layer's sizes, scales, ``format_ue8m0``, the BF16 cache). Random and structured inputs; odd sizes, TP shards,
gated and non-gated, per-token hidden alignment; plus shapes hypothesis draws per run.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from engine_envs import ROOT, drawn, oracle_marks, run_oracle
from hypothesis import strategies as st

pytestmark = oracle_marks("sglang")


def fixed_cases() -> list[dict]:
    shapes = [
        ("layer", 192, 320, True, False),  # H 320: SGLang's own 128x4 copy refuses; so must the installed one
        ("layer", 256, 512, True, False),
        ("layer", 2048 // 8, 7168 // 28, True, False),  # a DeepSeek-like TP-8 shard, narrow hidden
        ("layer", 200, 256, False, False),  # non-gated: SGLang pads I to 256
        ("layer", 256, 2688, False, True),  # Nemotron hidden, per-token non-gated: H 512-aligned
        ("layer", 128, 384, False, False),
        ("static", 128, 256, True, False),
        ("static", 256, 384, False, False),
        ("fp8", 232, 256, True, False),  # SGLang pads gated I 232 -> 240 (W13 as one block)
        ("fp8", 200, 384, False, False),
        ("fp8", 2048 // 16, 7168 // 28, True, False),
        ("mxfp8", 256, 512, True, False),
        ("mxfp8", 160, 256, False, False),  # non-gated: cut to I rows, padded to 256
        ("bf16", 256, 256, True, False),
        ("bf16", 128, 384, False, False),
        ("bf16", 1536 // 8, 4096 // 32, True, False),  # a Qwen3-235B TP-8 shard, narrow hidden
    ]
    return [
        dict(op=op, inter=i, hidden=h, gated=g, per_token=pt, experts=3, fill=("random", "structured")[n % 2], seed=n)
        for n, (op, i, h, g, pt) in enumerate(shapes)
    ]


@st.composite
def drawn_case(draw) -> dict:
    gated, op = draw(st.booleans()), draw(st.sampled_from(["layer", "fp8", "mxfp8", "bf16"]))
    return dict(
        op=op,
        inter=(16 if op in ("layer", "fp8") else 32 if op == "mxfp8" else 8) * draw(st.integers(1, 16)),
        hidden=64 * draw(st.integers(1, 12)),
        gated=gated,
        per_token=draw(st.booleans()),
        experts=draw(st.integers(1, 4)),
        fill=draw(st.sampled_from(["random", "structured"])),
        seed=draw(st.integers(0, 99)),
    )


def drawn_cases(n: int = 6) -> list[dict]:
    return drawn(drawn_case(), n)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("integrations_sglang") / "cases.json"
    path.write_text(json.dumps(fixed_cases() + drawn_cases()))
    return json.loads(run_oracle("sglang", "integrations_sglang.py", path, with_fimoe_lab=True))


def test_installed_changes_no_byte(report):
    bad = [r for r in report["results"] if r["diffs"]]
    assert not bad, json.dumps(bad[:3], indent=1)


def test_no_case_fell_back_to_sglang(report):
    fell = [r for r in report["results"] if r["fallbacks"] and r["engine_error"] is None]
    assert not fell, json.dumps(fell[:3], indent=1)
    refused = [r["case"] for r in report["results"][: len(fixed_cases())] if r["engine_error"]]
    assert all(c["hidden"] == 320 for c in refused), refused  # only the case SGLang itself refuses


def test_install_uninstall_and_refusal(report):
    r = report["install"]
    assert r["replaced"] and r["patched"] == 4 and r["restored"]
    assert r["refusal"] and "\n" not in r["refusal"] and "installed: sglang 0.5.23" in r["refusal"]
    assert r["refusal_changed_nothing"]


def test_import_loads_no_engine():
    code = "import sys, fimoe_lab.integrations.sglang\nassert not {'vllm', 'sglang', 'torch'} & set(sys.modules)\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
