"""Byte parity with vLLM 0.34.0's own preparation code under the ``vllm-0.34`` profile.

The oracle is vLLM's code run in its own environment (``.venv-vllm``: torch 2.13 CPU,
FlashInfer, vLLM 0.34.0 ``--no-deps``): ``tests/engine_oracles/vllm_034.py`` loads vLLM's
preparation modules alone (their package ``__init__`` needs CUDA extensions; every other vLLM
import is a stub that the preparation code never executes) and runs them on inputs this test
saves to a temporary folder as safetensors; our side is ``plan_layer(..., engine="vllm-0.34")``
applied to the same checkpoint tensors (MxInt4, a layout with no checkpoint format of its own:
``special_plans.plan_trtllm_mxint4``). Inputs are random bytes and structured bytes (each
4-byte word encodes its (expert, row, column)), over gated and non-gated layers and sizes that
need padding (tensor-parallel shards such as 2880 / 4 = 720) or none. Where vLLM allocates
padded weights before loading (MXFP4: ``torch.zeros`` of the rounded-up sizes, each projection
at its half's start) the test pads the oracle's input the same way. FlashInfer's
``block_scale_interleave`` needs CUDA; on CPU the runner serves it with vLLM's own pure-torch
``swizzle_blockscale`` (see the runner's docstring).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from engine_envs import oracle_marks, run_oracle
from helpers import coords, random_bytes
from safetensors.torch import load_file, save_file

from fimoe_lab import special_plans
from fimoe_lab.recipes import plan_layer

pytestmark = oracle_marks("vllm")
E = 2


def checkpoint(fmt: str, p: int, inter: int, hidden: int, structured: bool, seed: int) -> dict[str, torch.Tensor]:
    """Checkpoint tensors ``w13 [E, p*I, .]``, ``w2 [E, H, .]`` and their scales, as the format stores them."""

    def make(rows: int, cols_bytes: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
        item = torch.empty((), dtype=dtype).element_size()
        if structured and cols_bytes % 4 == 0:
            raw = coords(E, rows, cols_bytes // 4) + salt * (1 << 24)
            return raw.view(torch.uint8).view(dtype).reshape(E, rows, cols_bytes // item)
        return random_bytes((E, rows, cols_bytes // item), dtype, seed=seed + salt)

    def block_scales(rows: int, cols: int, salt: int) -> torch.Tensor:
        base = make(rows, 4 * cols, torch.int32, salt).to(torch.int64) % 1000
        value = (base.to(torch.float32) + 1) * 1e-3  # positive block scales, values encode their place
        # a dead expert's scales below vLLM's 1e-10 floor (it clamps them, SGLang does not), and the floor itself
        value = torch.where(base % 7 == 0, (base.to(torch.float32) + 1) * 1e-23, value)
        return torch.where(base % 7 == 1, torch.tensor(1e-10), value)

    t: dict[str, torch.Tensor] = {}
    if fmt == "bf16":
        t["w13"], t["w2"] = make(p * inter, 2 * hidden, torch.bfloat16, 1), make(hidden, 2 * inter, torch.bfloat16, 2)
    elif fmt in ("fp8", "fp8-block", "mxfp8"):
        f8 = torch.float8_e4m3fn
        t["w13"], t["w2"] = make(p * inter, hidden, f8, 1), make(hidden, inter, f8, 2)
        if fmt == "fp8":
            t["s13"], t["s2"] = torch.rand(E, generator=torch.Generator().manual_seed(seed)) + 0.5, torch.ones(E)
        elif fmt == "fp8-block":
            t["s13"] = block_scales(-(-p * inter // 128), -(-hidden // 128), 3)
            t["s2"] = block_scales(-(-hidden // 128), -(-inter // 128), 4)
        else:
            t["s13"], t["s2"] = make(p * inter, hidden // 32, torch.uint8, 3), make(hidden, inter // 32, torch.uint8, 4)
    elif fmt == "mxint4":  # packed signed int4, one bf16 scale per 32 values
        block = special_plans.MXINT4_SCALE_BLOCK
        t["w13"], t["w2"] = make(p * inter, hidden // 2, torch.uint8, 1), make(hidden, inter // 2, torch.uint8, 2)
        t["s13"] = make(p * inter, 2 * (hidden // block), torch.bfloat16, 3)
        t["s2"] = make(hidden, 2 * (inter // block), torch.bfloat16, 4)
    else:
        block, sdt = (16, torch.float8_e4m3fn) if fmt == "nvfp4" else (32, torch.uint8)
        t["w13"], t["w2"] = make(p * inter, hidden // 2, torch.uint8, 1), make(hidden, inter // 2, torch.uint8, 2)
        t["s13"], t["s2"] = make(p * inter, hidden // block, sdt, 3), make(hidden, inter // block, sdt, 4)
    return t


def pad_like_vllm_allocation(t: dict[str, torch.Tensor], p: int, inter: int, hidden: int, ip: int, hp: int) -> dict:
    """vLLM's MXFP4 ``create_weights``: zeros of the rounded-up sizes, each projection at its half's start."""

    def pad(x: torch.Tensor, rows: int, prows: int, parts: int, cols: int) -> torch.Tensor:
        out = x.new_zeros(x.shape[0], parts * prows, cols)
        for i in range(parts):
            out[:, i * prows : i * prows + rows, : x.shape[2]] = x[:, i * rows : (i + 1) * rows]
        return out

    return {
        "w13": pad(t["w13"], inter, ip, p, hp // 2),
        "w2": pad(t["w2"], hidden, hp, 1, ip // 2),
        "s13": pad(t["s13"], inter, ip, p, hp // 32),
        "s2": pad(t["s2"], hidden, hp, 1, ip // 32),
    }


def gate_up_interleaved(x: torch.Tensor) -> torch.Tensor:
    """gpt-oss stores W13 rows interleaved ``[g0, u0, g1, u1, ...]``; ours are ``[gate; up]``."""
    e, rows, cols = x.shape
    return x.view(e, 2, rows // 2, cols).transpose(1, 2).reshape(e, rows, cols)


# (name, format, backend, op, act_and_mul, gated, per_token, I, H, extra)
SHAPES: list[tuple[Any, ...]] = []
for gated in (True, False):
    SHAPES += [
        ("fp8", "trtllm", "fp8", gated, False, 200, 96, {}),
        ("fp8", "cutlass", "fp8", gated, False, 720, 160, {}),
        ("bf16", "trtllm", "bf16", gated, False, 96, 128, {}),
        ("bf16", "trtllm", "bf16", gated, False, 256, 192, {}),
        ("mxfp8", "trtllm", "fp8", gated, False, 96, 160, {"block": [1, 32]}),
        ("mxfp8", "trtllm", "fp8", gated, False, 256, 512, {"block": [1, 32]}),
        ("nvfp4", "trtllm", "nvfp4", gated, False, 80, 272, {}),
        ("nvfp4", "trtllm", "nvfp4", gated, True, 80, 272, {}),
        ("nvfp4", "trtllm", "nvfp4", gated, False, 128, 512, {}),
    ]
SHAPES += [
    ("fp8-block", "trtllm", "fp8", True, False, 128, 256, {"block": [128, 128]}),
    ("fp8-block", "cutlass", "fp8", True, False, 256, 384, {"block": [128, 128]}),
    ("nvfp4", "cutlass", "nvfp4", True, False, 64, 272, {}),
    ("nvfp4", "cutlass", "nvfp4", True, False, 192, 128, {}),
    ("nvfp4", "cutlass", "nvfp4", False, False, 80, 272, {}),
    ("mxfp4", "trtllm", "mxfp4", True, False, 704, 2880, {"vbackend": "FLASHINFER_TRTLLM_MXFP4_BF16"}),
    ("mxfp4", "trtllm", "mxfp4", True, False, 320, 512, {"vbackend": "FLASHINFER_TRTLLM_MXFP4_BF16"}),
    ("mxfp4", "trtllm", "mxfp4_gptoss", True, False, 192, 256, {"vbackend": "FLASHINFER_TRTLLM_MXFP4_BF16"}),
    ("mxfp4", "cutlass", "mxfp4_gptoss", True, False, 192, 320, {"vbackend": "FLASHINFER_CUTLASS_MXFP4_MXFP8"}),
    ("mxint4", "trtllm", "mxint4", True, False, 256, 512, {}),
    ("mxint4", "trtllm", "mxint4", True, False, 512, 256, {}),
    # larger shards: Qwen3-235B FP8 TP4 (I 384), DeepSeek-like block FP8, Nemotron-like NVFP4, MXFP8 TP2
    ("fp8", "trtllm", "fp8", True, False, 384, 1024, {}),
    ("fp8-block", "trtllm", "fp8", True, False, 512, 1024, {"block": [128, 128]}),
    ("nvfp4", "trtllm", "nvfp4", True, False, 352, 1024, {}),
    ("mxfp8", "trtllm", "fp8", True, False, 352, 768, {"block": [1, 32]}),
]
CASES = [
    dict(
        name=f"c{i}",
        fmt=f,
        backend=b,
        op=op,
        act_and_mul=g,
        gated=g,
        per_token=pt,
        inter=i_,
        hidden=h,
        structured=structured,
        **x,
    )
    for i, (structured, (f, b, op, g, pt, i_, h, x)) in enumerate((s, y) for s in (False, True) for y in SHAPES)
]


def ours(c: dict) -> tuple[dict[str, torch.Tensor], Any]:
    p = 2 if c["act_and_mul"] else 1
    t = checkpoint(c["fmt"], p, c["inter"], c["hidden"], c["structured"], seed=int(c["name"][1:]))
    if c["fmt"] == "mxint4":  # a layout without a checkpoint format of its own: its recipe step directly
        return t, special_plans.plan_trtllm_mxint4(c["inter"], c["hidden"], c["gated"])
    plan = plan_layer(
        c["fmt"],
        c["backend"],
        c["inter"],
        c["hidden"],
        c["act_and_mul"],
        c["gated"],
        engine="vllm-0.34",
        per_token_activation=c["per_token"],
    )
    return t, plan


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("vllm034")
    inputs, cases = {}, []
    for c in CASES:
        t, plan = ours(c)
        if c["op"] in ("mxfp4", "mxfp4_gptoss"):
            t = pad_like_vllm_allocation(t, 2, c["inter"], c["hidden"], plan.padded_intermediate, plan.padded_hidden)
            if c["op"] == "mxfp4_gptoss":
                t = {k: gate_up_interleaved(v) if k in ("w13", "s13") else v for k, v in t.items()}
        inputs.update({f"{c['name']}.{k}": v.contiguous() for k, v in t.items()})
        cases.append(
            {k: v for k, v in c.items() if k not in ("fmt", "backend", "structured")}
            | {"trtllm": c["backend"] == "trtllm"}
        )
    (d / "cases.json").write_text(json.dumps(cases))
    save_file(inputs, str(d / "inputs.safetensors"))
    run_oracle("vllm", "vllm_034.py", d)
    return {"out": load_file(str(d / "outputs.safetensors")), "meta": json.loads((d / "outputs.json").read_text())}


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=lambda c: (
        f"{c['name']}-{c['fmt']}-{c['backend']}-{'g' if c['gated'] else 'ng'}{'-pt' if c['per_token'] else ''}-{c['inter']}x{c['hidden']}"
    ),
)
def test_same_bytes_as_vllm(oracle: dict[str, Any], case: dict) -> None:
    t, plan = ours(case)
    got = dict(zip(("w13", "w2", "s13", "s2"), plan.apply(t["w13"], t["w2"], t.get("s13"), t.get("s2"))))
    answer = oracle["meta"][case["name"]]
    assert "error" not in answer, f"vLLM's own code refused the case: {answer.get('error')}"
    sizes = answer["sizes"]
    if not (case["op"] == "nvfp4" and case["backend"] == "cutlass"):  # vLLM pads those tensors only
        assert (plan.padded_intermediate, plan.padded_hidden) == (sizes["inter"], sizes["hidden"]), plan.description
    for k in ("w13", "w2", "s13", "s2"):
        want = oracle["out"].get(f"{case['name']}.{k}")
        if want is None or case["fmt"] == "fp8" and k in ("s13", "s2"):
            continue
        mine = got[k].contiguous().view(torch.uint8).reshape(-1)
        assert mine.numel() == want.numel(), f"{k}: {mine.numel()} bytes, vLLM {want.numel()}"
        bad = (mine != want).nonzero()
        assert bad.numel() == 0, f"{k}: {bad.numel()} of {want.numel()} bytes differ, first at {bad[0].item()}"
