"""Byte parity with SGLang 0.5.23's own preparation code under the ``sglang-0.5.23`` profile.

The oracle is SGLang's code run in its own environment (``.venv-sglang``: torch 2.13 CPU,
FlashInfer 0.7.2, SGLang 0.5.23 ``--no-deps``) by ``tests/engine_oracles/sglang_0523.py`` on
inputs saved here as safetensors; ours is ``plan_layer(..., engine="sglang-0.5.23")``. SGLang
pads the intermediate size when it allocates the weights (``FusedMoE.__init__``: 128 for the
TRT-LLM backend; NVFP4 in ``create_weights``: 64 gated / 128 non-gated) and its ModelOpt NVFP4
loader writes a gated W13 up-first (``load_up_proj_weight_first``); the test hands the oracle
those loader results: the padded sizes, each projection at its half's start, ``[up; gate]`` for
NVFP4. SGLang allocates with ``torch.empty``, so its padded bytes are whatever the allocator
held; the test (and fimoe_lab) write zeros there.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from engine_envs import oracle_marks, run_oracle
from safetensors.torch import load_file, save_file
from test_engine_parity_vllm import checkpoint, gate_up_interleaved

from fimoe_lab.recipes import plan_layer

pytestmark = oracle_marks("sglang")

SHAPES: list[tuple[Any, ...]] = []
for gated in (True, False):
    SHAPES += [
        ("nvfp4", "nvfp4", gated, False, 80, 256),
        ("nvfp4", "nvfp4", gated, True, 80, 384),
        ("nvfp4", "nvfp4", gated, False, 128, 512),
        ("fp8", "fp8", gated, False, 200, 96),
        ("mxfp8", "mxfp8", gated, False, 96, 256),
        ("mxfp8", "mxfp8", gated, False, 256, 384),
        ("bf16", "bf16", gated, False, 96, 128),
    ]
for gated in (True, False):  # ModelOpt FP8 per-tensor: its own call swaps W13's halves
    SHAPES += [("fp8", "fp8_modelopt", gated, False, 200, 96), ("fp8", "fp8_modelopt", gated, False, 384, 256)]
SHAPES += [  # compressed-tensors schemes (their own process_weights_after_loading, FlashInfer TRT-LLM)
    ("fp8-block", "fp8_block_ct", True, False, 256, 384),
    ("fp8-block", "fp8_block_ct", True, False, 384, 640),
    ("nvfp4", "nvfp4_ct", True, False, 80, 256),
    ("nvfp4", "nvfp4_ct", True, False, 192, 512),
    ("mxint4", "mxint4_ct", True, False, 256, 512),
    ("mxint4", "mxint4_ct", True, False, 512, 768),
]
SHAPES += [
    ("mxfp4", "mxfp4", True, False, 704, 2880),  # gpt-oss-like shard, gpt-oss interleaved W13
    ("mxfp4", "mxfp4_stacked", True, False, 320, 512),  # gate_up_interleaved=False: [gate; up]
    ("nvfp4", "nvfp4_cutlass", True, False, 64, 272),
    ("nvfp4", "nvfp4_cutlass", True, False, 192, 128),
    ("nvfp4", "nvfp4_cutlass", False, False, 128, 272),
]
METHODS = {"fp8_modelopt": "modelopt", "fp8_block_ct": "compressed-tensors", "nvfp4_ct": "compressed-tensors"}
METHODS["mxint4_ct"] = "compressed-tensors"
"""The checkpoint quantization method of each op that runs one method's own code (``plan_layer``'s ``quant_method``)."""
CASES = [
    dict(
        name=f"c{i}",
        fmt=f,
        op=op,
        method=METHODS.get(op),
        backend="cutlass" if op.endswith("cutlass") else "trtllm",
        gated=g,
        per_token=pt,
        inter=i_,
        hidden=h,
        structured=structured,
    )
    for i, (structured, (f, op, g, pt, i_, h)) in enumerate((s, x) for s in (False, True) for x in SHAPES)
]


def ours(c: dict) -> tuple[dict[str, torch.Tensor], Any]:
    p = 2 if c["gated"] else 1
    t = checkpoint(c["fmt"], p, c["inter"], c["hidden"], c["structured"], seed=int(c["name"][1:]))
    plan = plan_layer(
        c["fmt"],
        c["backend"],
        c["inter"],
        c["hidden"],
        c["gated"],
        c["gated"],
        engine="sglang-0.5.23",
        per_token_activation=c["per_token"],
        quant_method=c["method"],
    )
    return t, plan


def as_loaded(c: dict, t: dict[str, torch.Tensor], padded_inter: int, padded_hidden: int) -> dict[str, torch.Tensor]:
    """What SGLang's weight loader leaves: zeros of the padded sizes, each projection at its half's start
    (``[up; gate]`` for ModelOpt NVFP4), gpt-oss MXFP4 rows interleaved ``[g0, u0, ...]``."""
    p, inter, hidden = (2 if c["gated"] else 1), c["inter"], c["hidden"]
    order = (
        (1, 0) if c["op"] in ("nvfp4", "nvfp4_cutlass") and c["gated"] else (0, 1)[:p]
    )  # compressed-tensors: gate first
    if (padded_inter, padded_hidden) == (inter, hidden) and order == (0, 1)[:p] and c["op"] != "mxfp4":
        return t
    out = {}
    for k, x in t.items():
        if x.ndim < 3:
            out[k] = x
        elif k in ("w13", "s13"):
            y = x.new_zeros(x.shape[0], p * padded_inter, padded_hidden * x.shape[2] // hidden)
            for dst, src in enumerate(order):
                y[:, dst * padded_inter : dst * padded_inter + inter, : x.shape[2]] = x[
                    :, src * inter : (src + 1) * inter
                ]
            out[k] = gate_up_interleaved(y) if c["op"] == "mxfp4" else y
        else:
            y = x.new_zeros(x.shape[0], padded_hidden, padded_inter * x.shape[2] // inter)
            y[:, :hidden, : x.shape[2]] = x
            out[k] = y
    return out


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("sglang0523")
    inputs, cases = {}, []
    for c in CASES:
        t, plan = ours(c)
        t = as_loaded(c, t, plan.padded_intermediate, plan.padded_hidden)
        if c["op"] == "mxint4_ct":  # the file's int32 words of q + 8 nibbles (conventions.WEIGHT_XOR)
            t = {k: (v ^ 0x88).view(torch.int32) if k in ("w13", "w2") else v for k, v in t.items()}
        inputs.update({f"{c['name']}.{k}": v.contiguous() for k, v in t.items()})
        cases.append({k: c[k] for k in ("name", "op", "gated", "per_token")})
    (d / "cases.json").write_text(json.dumps(cases))
    save_file(inputs, str(d / "inputs.safetensors"))
    run_oracle("sglang", "sglang_0523.py", d)
    return {"out": load_file(str(d / "outputs.safetensors")), "meta": json.loads((d / "outputs.json").read_text())}


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=lambda c: (
        f"{c['name']}-{c['op']}-{c['backend']}-{'g' if c['gated'] else 'ng'}{'-pt' if c['per_token'] else ''}-{c['inter']}x{c['hidden']}"
    ),
)
def test_same_bytes_as_sglang(oracle: dict[str, Any], case: dict) -> None:
    t, plan = ours(case)
    got = dict(zip(("w13", "w2", "s13", "s2"), plan.apply(t["w13"], t["w2"], t.get("s13"), t.get("s2"))))
    answer = oracle["meta"][case["name"]]
    assert "error" not in answer, f"SGLang's own code refused the case: {answer.get('error')}"
    assert (plan.padded_intermediate, plan.padded_hidden) == (answer["sizes"]["inter"], answer["sizes"]["hidden"])
    for k in ("w13", "w2", "s13", "s2"):
        want = oracle["out"].get(f"{case['name']}.{k}")
        if want is None:
            continue
        mine = got[k].contiguous().view(torch.uint8).reshape(-1)
        assert mine.numel() == want.numel(), f"{k}: {mine.numel()} bytes, SGLang {want.numel()}"
        bad = (mine != want).nonzero()
        assert bad.numel() == 0, f"{k}: {bad.numel()} of {want.numel()} bytes differ, first at {bad[0].item()}"
