"""FlashInfer 0.7.4's own CPU-runnable functions as the oracle of the 0.7.x profiles.

FlashInfer 0.7.4 lives in a second environment (``.venv-fi074``, created by ``.ci/run``;
the main one pins 0.6.13), so each test writes its inputs as raw bytes, runs one worker in
that environment (a subprocess), and compares the worker's outputs byte for byte with ours.
On CPU 0.7.4 runs: the permute-index helpers (five-part cache keys), ``pad_trtllm_moe_weights``,
``convert_to_block_layout``; its ``prepare_cutlass_*`` and ``block_scale_interleave`` need CUDA.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import coords, random_bytes

from fimoe_lab import prepare, steps
from fimoe_lab.layout import compose

FI074 = Path(__file__).resolve().parents[1] / ".venv-fi074" / "bin" / "python"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not FI074.exists(),
        reason="no FlashInfer 0.7.4 environment: python3 -m venv .venv-fi074 && "
        ".venv-fi074/bin/pip install torch==2.13.0 flashinfer-python==0.7.4 (.ci/run creates it)",
    ),
]

WORKER = r"""
import json, sys
import numpy as np, torch, flashinfer
from flashinfer.fused_moe import core

d = sys.argv[1]
cases = json.load(open(d + "/cases.json"))
def load(name, shape):
    return torch.from_numpy(np.fromfile(d + "/" + name + ".in", dtype=np.uint8).reshape(shape))
def save(name, t):
    t.contiguous().numpy().tofile(d + "/" + name + ".out")
def key(k):
    return [k[0], list(k[1])] + list(k[2:])
result = {"version": flashinfer.__version__, "keys": {}, "shapes": {}}
for c in cases:
    n = c["name"]
    if c["op"] == "pad":
        t = [load(n + "_" + s, c[s]) for s in ("g1", "s1", "g2", "s2")]
        r = core.pad_trtllm_moe_weights(*t, c["hidden"], c["inter"], is_gated_act=c["gated"],
                                        hidden_alignment=c["ha"], intermediate_alignment=c["ia"])
        for s, x in zip(("g1", "s1", "g2", "s2"), r[:4]):
            save(n + "_" + s, x.view(torch.uint8))
            result["shapes"][n + "_" + s] = list(x.shape)
        result["shapes"][n + "_sizes"] = list(r[4:])
    elif c["op"] == "permute":
        x = load(n, c["shape"])
        cache = {}
        save(n + "_w13", core._maybe_get_cached_w3_w1_permute_indices(
            cache, x, c["etm"], c["sf"], is_gated_act_gemm=c["gated"]).to(torch.int64))
        save(n + "_w2", core.get_w2_permute_indices_with_cache(cache, x, c["etm"], c["sf"]).to(torch.int64))
        result["keys"][n] = [key(k) for k in cache]
    elif c["op"] == "bf16":  # vLLM 0.34's recipe on FlashInfer 0.7.4's helpers, expert by expert
        w13, w2 = load(n + "_w13", c["w13"]), load(n + "_w2", c["w2"])
        cache, o13, o2 = {}, [], []
        for e in range(w13.shape[0]):
            x = w13[e]
            idx = core._maybe_get_cached_w3_w1_permute_indices(cache, x, 128, is_gated_act_gemm=c["gated"])
            if c["gated"]:
                idx = (idx + x.shape[0] // 2) % x.shape[0]
            o13.append(core.convert_to_block_layout(x[idx].contiguous(), 128))
            y = w2[e]
            o2.append(core.convert_to_block_layout(y[core.get_w2_permute_indices_with_cache(cache, y, 128)].contiguous(), 128))
        save(n + "_w13", torch.stack(o13))
        save(n + "_w2", torch.stack(o2))
        result["keys"][n] = sorted((key(k) for k in cache), key=str)
    elif c["op"] == "cute":
        from flashinfer.fused_moe.prepare import interleave_cute_dsl_moe_weights
        w, s = load(n + "_w", c["w"]), load(n + "_s", c["s"])
        ow, os_ = interleave_cute_dsl_moe_weights(w, s, swap_ab=c["swap_ab"])
        save(n + "_w", ow)
        save(n + "_s", os_)
        save(n + "_back", core.deinterleave_gated_rows(ow[0], c["block"]))
    elif c["op"] == "fold":
        from flashinfer.fused_moe.prepare import interleave_moe_scales_for_sm90_mixed_gemm
        x = load(n, c["shape"]).view(getattr(torch, c["dtype"]))
        save(n, interleave_moe_scales_for_sm90_mixed_gemm(x, c["group"]).view(torch.uint8))
    elif c["op"] == "mxint4":  # prepare_trtllm_mxint4_weights's layout steps, minus the CUDA-only swizzle
        t = {k: load(n + "_" + k, c[k]) for k in ("w1", "s1", "w2", "s2")}
        cache, out = {}, {k: [] for k in t}
        for e in range(t["w1"].shape[0]):
            w1, s1 = t["w1"][e], t["s1"][e].view(torch.bfloat16)
            w2, s2 = t["w2"][e], t["s2"][e].view(torch.bfloat16)
            p1 = core._maybe_get_cached_w3_w1_permute_indices(cache, w1, 128, is_gated_act_gemm=c["gated"])
            q1 = core._maybe_get_cached_w3_w1_permute_indices(cache, s1, 128, num_elts_per_sf=32, is_gated_act_gemm=c["gated"])
            p2 = core.get_w2_permute_indices_with_cache(cache, w2, 128, is_gated_act_gemm=c["gated"])
            q2 = core.get_w2_permute_indices_with_cache(cache, s2, 128, num_elts_per_sf=16, is_gated_act_gemm=c["gated"])
            out["w1"].append(core.convert_to_block_layout(w1[p1].contiguous(), 128))
            out["s1"].append(s1[q1].contiguous().view(torch.uint8))
            out["w2"].append(core.convert_to_block_layout(w2[p2].contiguous(), 128))
            out["s2"].append(s2[q2].contiguous().view(torch.uint8))
        for k, v in out.items():
            save(n + "_" + k, torch.stack(v))
    elif c["op"] == "helper":  # FlashInfer's own prepare_trtllm_* on BF16 [up; gate] weights, and its quantizer
        from flashinfer.fused_moe import api, prepare
        w1 = load(n + "_w1", c["w1"]).view(torch.bfloat16)
        w2 = load(n + "_w2", c["w2"]).view(torch.bfloat16)
        kw = dict(num_local_experts=w1.shape[0], hidden_size=c["hidden"], intermediate_size=c["inter"],
                  activation=api.SwiGLU() if c["gated"] else api.ReLU2())
        try:
            if c["fmt"] == "bf16":
                q1, q2, r = w1, w2, prepare.prepare_trtllm_bf16_weights(w1, w2, **kw)
            elif c["fmt"] == "fp8":
                r = prepare.prepare_trtllm_fp8_per_tensor_weights(
                    w1, w2, hidden_states_scale_global=1.0, intermediate_scale_global=1.0, **kw)
                (q1, _), (q2, _) = prepare._quantize_fp8_per_expert(w1), prepare._quantize_fp8_per_expert(w2)
            else:  # DeepSeek FP8 128x128 blocks
                quant = api.QuantConfig(weight=api.QuantFormat.DeepSeekFp8, activation=api.QuantFormat.DeepSeekFp8)
                r = prepare.prepare_trtllm_fp8_block_weights(w1, w2, quant=quant, **kw)
                (q1, s1), (q2, s2) = (prepare._deepseek_fp8_quantize_weights(w) for w in (w1, w2))
                save(n + "_q_s1", s1.contiguous().view(torch.uint8))
                save(n + "_q_s2", s2.contiguous().view(torch.uint8))
                save(n + "_s1", r["gemm1_weights_scale"].contiguous().view(torch.uint8))
                save(n + "_s2", r["gemm2_weights_scale"].contiguous().view(torch.uint8))
        except (ValueError, AssertionError) as exc:  # the helper's refusal is the answer
            result["shapes"][n] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        save(n + "_q1", q1.contiguous().view(torch.uint8))
        save(n + "_q2", q2.contiguous().view(torch.uint8))
        save(n + "_g1", r["gemm1_weights"].contiguous().view(torch.uint8))
        save(n + "_g2", r["gemm2_weights"].contiguous().view(torch.uint8))
        result["shapes"][n] = {k: list(r[k].shape) for k in ("gemm1_weights", "gemm2_weights")}
json.dump(result, open(d + "/result.json", "w"))
"""


def run_worker(tmp_path: Path, cases: list[dict], inputs: dict[str, torch.Tensor]) -> dict:
    for name, t in inputs.items():
        t.contiguous().view(torch.uint8).numpy().tofile(tmp_path / f"{name}.in")
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    (tmp_path / "worker.py").write_text(WORKER)
    done = subprocess.run(
        [str(FI074), str(tmp_path / "worker.py"), str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["version"] == "0.7.4"
    return result


def read_out(tmp_path: Path, name: str, dtype=np.uint8) -> torch.Tensor:
    return torch.from_numpy(np.fromfile(tmp_path / f"{name}.out", dtype=dtype))


PAD_CASES = [  # (intermediate, hidden, gated, values per byte, scale block, hidden / intermediate alignment)
    (1856 // 2, 2688, True, 2, 16, 512, 128),  # Nemotron Nano TP2, NVFP4
    (1856 // 4, 2688, False, 2, 16, 256, 128),
    (2880 // 2, 2880, True, 2, 32, 512, 128),  # gpt-oss TP2, MXFP4
    (96, 160, True, 1, 32, 256, 256),  # MXFP8
    (128, 512, True, 2, 16, 512, 128),  # already aligned
]


def test_pad_trtllm_moe_weights_equals_flashinfer_074(tmp_path):
    cases, inputs, ours = [], {}, {}
    for i, (inter, hidden, gated, epb, sf, ha, ia) in enumerate(PAD_CASES):
        p, n = 2 if gated else 1, f"pad{i}"
        shapes = {
            "g1": (2, p * inter, hidden // epb),
            "s1": (2, p * inter, hidden // sf),
            "g2": (2, hidden, inter // epb),
            "s2": (2, hidden, inter // sf),
        }
        t = {s: random_bytes(shape, torch.uint8, seed=10 * i + j) for j, (s, shape) in enumerate(shapes.items())}
        inputs.update({f"{n}_{s}": x for s, x in t.items()})
        cases.append(dict(op="pad", name=n, inter=inter, hidden=hidden, gated=gated, ha=ha, ia=ia, **shapes))
        ours[n] = prepare.pad_trtllm_moe_weights(
            t["g1"], t["s1"], t["g2"], t["s2"], hidden, inter, is_gated_act=gated, hidden_alignment=ha,
            intermediate_alignment=ia,
        )  # fmt: skip
    result = run_worker(tmp_path, cases, inputs)
    for n, got in ours.items():
        assert list(got[4:]) == result["shapes"][f"{n}_sizes"]
        for s, x in zip(("g1", "s1", "g2", "s2"), got[:4]):
            assert list(x.shape) == result["shapes"][f"{n}_{s}"], (n, s)
            assert torch.equal(x.contiguous().view(torch.uint8).reshape(-1), read_out(tmp_path, f"{n}_{s}")), (n, s)


PERMUTE_CASES = [  # (rows, cols bytes, epilogue_tile_m, num_elts_per_sf, gated)
    (256, 64, 128, None, True),
    (256, 64, 128, None, False),
    (192, 96, 64, None, True),
    (384, 32, 128, 16, True),
    (512, 8, 128, 32, False),
    (128, 16, 64, 16, True),
]


def test_permute_indices_and_their_five_part_keys_equal_flashinfer_074(tmp_path):
    cases, inputs = [], {}
    for i, (rows, cols, etm, sf, gated) in enumerate(PERMUTE_CASES):
        inputs[f"perm{i}"] = random_bytes((rows, cols), torch.uint8, seed=i)
        cases.append(dict(op="permute", name=f"perm{i}", shape=[rows, cols], etm=etm, sf=sf, gated=gated))
    result = run_worker(tmp_path, cases, inputs)
    for i, (rows, cols, etm, sf, gated) in enumerate(PERMUTE_CASES):
        shuffle = steps.shuffle_rows_for_epilogue(rows, cols, etm)
        w13 = compose(steps.interleave_rows_for_gated_act(rows, cols), shuffle) if gated else shuffle
        assert torch.equal(read_out(tmp_path, f"perm{i}_w13", np.int64), w13.src)
        assert torch.equal(read_out(tmp_path, f"perm{i}_w2", np.int64), shuffle.src)
        k13, k2 = prepare.permute_cache_keys((rows, cols), (rows, cols), gated, etm, sf, engine="flashinfer-0.7.4")
        want = [[k[0], list(k[1]), *k[2:]] for k in (k13, k2)]
        assert result["keys"][f"perm{i}"] == want


@pytest.mark.parametrize("engine", ["flashinfer-0.7.4", "vllm-0.34"])
def test_bf16_block_layout_and_cache_equal_vllm_on_flashinfer_074(tmp_path, engine):
    cases, inputs, ours = [], {}, {}
    for i, (inter, hidden, gated) in enumerate([(128, 128, True), (192, 256, False), (64, 192, True)]):
        p, n = 2 if gated else 1, f"bf{i}"
        w13 = random_bytes((2, p * inter, hidden), torch.bfloat16, seed=i)
        w2 = random_bytes((2, hidden, inter), torch.bfloat16, seed=i + 7)
        inputs[f"{n}_w13"], inputs[f"{n}_w2"] = w13, w2
        cases.append(dict(op="bf16", name=n, gated=gated, w13=[2, p * inter, 2 * hidden], w2=[2, hidden, 2 * inter]))
        cache: dict = {}
        o13, o2 = prepare.convert_moe_weights_to_flashinfer_trtllm_block_layout(
            cache, w13.clone(), w2.clone(), gated, engine=engine
        )
        ours[n] = (o13, o2, sorted(([k[0], list(k[1]), *k[2:]] for k in cache), key=str))
    result = run_worker(tmp_path, cases, inputs)
    for n, (o13, o2, keys) in ours.items():
        assert torch.equal(o13.contiguous().view(torch.uint8).reshape(-1), read_out(tmp_path, f"{n}_w13"))
        assert torch.equal(o2.contiguous().view(torch.uint8).reshape(-1), read_out(tmp_path, f"{n}_w2"))
        assert keys == result["keys"][n]


def test_cute_dsl_interleave_equals_flashinfer_074(tmp_path):
    cases, inputs, ours = [], {}, {}
    shapes = [(256, 64, 8, False), (384, 40, 5, False), (128, 16, 1, True), (96, 24, 3, True)]
    for i, (rows, cols, scols, swap_ab) in enumerate(shapes):
        n = f"cute{i}"
        w = random_bytes((2, rows, cols), torch.uint8, seed=i)
        s = random_bytes((2, rows, scols), torch.uint8, seed=i + 5)
        inputs[f"{n}_w"], inputs[f"{n}_s"] = w, s
        group = 16 if swap_ab else 64
        cases.append(dict(op="cute", name=n, w=[2, rows, cols], s=[2, rows, scols], swap_ab=swap_ab, block=group))
        ours[n] = (*prepare.interleave_cute_dsl_moe_weights(w, s, swap_ab), w[0])
    run_worker(tmp_path, cases, inputs)
    for n, (ow, os_, w0) in ours.items():
        assert torch.equal(ow.reshape(-1), read_out(tmp_path, f"{n}_w"))
        assert torch.equal(os_.reshape(-1), read_out(tmp_path, f"{n}_s"))
        assert torch.equal(w0.reshape(-1), read_out(tmp_path, f"{n}_back"))


def test_sm90_mixed_scale_folding_equals_flashinfer_074(tmp_path):
    shapes = [(64, 4, "uint8", 32), (192, 12, "uint8", 32), (128, 6, "bfloat16", 128), (256, 8, "uint8", 32)]
    cases, inputs, ours = [], {}, {}
    for i, (rows, cols, dtype, group) in enumerate(shapes):
        x = random_bytes((2, rows, cols), getattr(torch, dtype), seed=i)
        n = f"fold{i}"
        inputs[n] = x
        esize = x.element_size()
        cases.append(dict(op="fold", name=n, shape=[2, rows, cols * esize], dtype=dtype, group=group))
        ours[n] = prepare.interleave_moe_scales_for_sm90_mixed_gemm(x, group)
    run_worker(tmp_path, cases, inputs)
    for n, got in ours.items():
        assert torch.equal(got.contiguous().view(torch.uint8).reshape(-1), read_out(tmp_path, n))


def test_mxint4_layout_equals_flashinfer_074_steps(tmp_path):
    """Weights byte for byte; scales: FlashInfer's row permutation, then the engines' 128x4 swizzle of
    2-byte elements (``block_scale_interleave`` needs CUDA; the swizzle itself is checked in test_engines)."""
    from test_engines import vllm_swizzle_blockscale

    from fimoe_lab.special_plans import plan_trtllm_mxint4

    cases, inputs, ours = [], {}, {}
    for i, (inter, hidden, gated) in enumerate([(256, 512, True), (512, 256, False), (256, 256, True)]):
        p, n, e = 2 if gated else 1, f"mxint4_{i}", 2
        t = {
            "w1": random_bytes((e, p * inter, hidden // 2), torch.uint8, seed=i),
            "s1": random_bytes((e, p * inter, hidden // 32), torch.bfloat16, seed=i + 1),
            "w2": random_bytes((e, hidden, inter // 2), torch.uint8, seed=i + 2),
            "s2": random_bytes((e, hidden, inter // 32), torch.bfloat16, seed=i + 3),
        }
        inputs.update({f"{n}_{k}": v for k, v in t.items()})
        shapes = {k: [e, v.shape[1], v.shape[2] * v.element_size()] for k, v in t.items()}
        cases.append(dict(op="mxint4", name=n, gated=gated, **shapes))
        plan = plan_trtllm_mxint4(inter, hidden, gated, swap_w31=False)
        ours[n] = (plan.apply(t["w1"], t["w2"], t["s1"], t["s2"]), shapes)
    run_worker(tmp_path, cases, inputs)
    for n, ((o1, o2, os1, os2), shapes) in ours.items():
        assert torch.equal(o1.reshape(-1), read_out(tmp_path, f"{n}_w1"))
        assert torch.equal(o2.reshape(-1), read_out(tmp_path, f"{n}_w2"))
        for got, k in ((os1, "s1"), (os2, "s2")):
            rows_permuted = read_out(tmp_path, f"{n}_{k}").view(torch.bfloat16).reshape(2, shapes[k][1], -1)
            want = vllm_swizzle_blockscale(rows_permuted)
            assert torch.equal(got.contiguous().view(torch.uint8).reshape(-1), want.view(torch.uint8).reshape(-1))


def test_this_environment_is_not_the_oracle():
    """The main environment must not be 0.7.4 itself (else these tests compare a thing with itself)."""
    assert sys.executable != str(FI074)


BLOCK_SCALE_INTERLEAVE_SOURCE = (
    ("cpp/kernels/quantization.cu", "__global__ void block_scale_interleave_kernel("),
    ("tensorrt_llm/kernels/quantization_utils.cuh", "int64_t get_sf_out_offset_128x4(int batchIdx,"),
    ("tensorrt_llm/thop/fp4Op.cpp", "void BlockScaleInterleave(TensorView"),
)
"""FlashInfer's ``block_scale_interleave`` op: its kernel, the offset it writes to, and its binding (file under
``flashinfer/data/csrc/nv_internal``, the start of the function)."""


def _function_text(site: Path, path: str, start: str) -> str:
    """The text of a C++ function in FlashInfer's sources under ``site``: from ``start`` to the first lone ``}``."""
    src = (site / "flashinfer/data/csrc/nv_internal" / path).read_text()
    i = src.index(start)
    return src[i : src.index("\n}\n", i)]


def test_block_scale_interleave_source_is_the_0613_one():
    """FlashInfer's CUDA-only ``block_scale_interleave`` has no CPU path to compare with; its H200 goldens
    (``shared/goldens``) were recorded with 0.6.13. Its kernel, offset function and binding are the same text
    in 0.7.4, so those goldens hold for the 0.7.x profiles too."""
    sites = [next((Path(p).parents[1] / "lib").glob("python3*/site-packages")) for p in (sys.executable, FI074)]
    for path, start in BLOCK_SCALE_INTERLEAVE_SOURCE:
        old, new = (_function_text(site, path, start) for site in sites)
        assert len(old) > 300 and old == new, path


HELPER_CASES = [  # (format, intermediate, hidden, gated): accepted sizes, then sizes the helpers refuse
    ("bf16", 128, 192, True),
    ("bf16", 192, 320, False),
    ("bf16", 448, 704, True),
    ("fp8", 96, 160, True),
    ("fp8", 224, 288, False),
    ("fp8", 400, 96, True),
    ("fp8-block", 256, 384, True),
    ("fp8-block", 384, 640, False),
    ("bf16", 96, 192, True),  # BlockMajorK needs 128-byte K blocks: I 96 is 192 bytes
    ("fp8", 200, 96, False),  # the epilogue shuffle needs rows % 32
    ("fp8-block", 256, 192, True),  # DeepSeek FP8: H % 128
]
HELPER_REFUSED = 3


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    """``[up; gate]`` <-> ``[gate; up]`` rows of each expert."""
    e, rows = x.shape[0], x.shape[1]
    return x.reshape(e, 2, rows // 2, *x.shape[2:]).flip(1).reshape(x.shape)


def test_flashinfer_074_profile_is_flashinfer_074s_own_prepare_helpers(tmp_path):
    """``prepare_trtllm_bf16_weights``, ``prepare_trtllm_fp8_per_tensor_weights`` and
    ``prepare_trtllm_fp8_block_weights`` (DeepSeek FP8) run in FlashInfer 0.7.4 on random BF16 weights in their
    ``[up; gate]`` order; the checkpoint is FlashInfer's own quantization of them in ``[gate; up]`` order, laid
    out by ``plan_layer(engine="flashinfer-0.7.4")``: the same bytes, and a refusal where the helper refuses."""
    from fimoe_lab.errors import LayoutError
    from fimoe_lab.recipes import plan_layer

    cases, inputs = [], {}
    for i, (fmt, inter, hidden, gated) in enumerate(HELPER_CASES):
        p, n, e = 2 if gated else 1, f"helper{i}", 2
        if fmt == "bf16" and i % 2 == 0:  # structured: each pair of bf16 values encodes its (expert, row, column)
            w1 = coords(e, p * inter, hidden // 2).view(torch.bfloat16).reshape(e, p * inter, hidden)
            w2 = coords(e, hidden, inter // 2).view(torch.bfloat16).reshape(e, hidden, inter)
        else:  # random values of both signs (FlashInfer quantizes them)
            w1 = (random_bytes((e, p * inter, hidden), torch.float32, seed=i).nan_to_num() % 6 - 3).to(torch.bfloat16)
            w2 = (random_bytes((e, hidden, inter), torch.float32, seed=i + 50).nan_to_num() % 6 - 3).to(torch.bfloat16)
        inputs[f"{n}_w1"], inputs[f"{n}_w2"] = w1, w2
        shapes = {"w1": [e, p * inter, 2 * hidden], "w2": [e, hidden, 2 * inter]}
        cases.append(dict(op="helper", name=n, fmt=fmt, inter=inter, hidden=hidden, gated=gated, **shapes))
    result = run_worker(tmp_path, cases, inputs)
    refused = ["error" in result["shapes"][f"helper{i}"] for i in range(len(HELPER_CASES))]
    assert refused == [False] * (len(HELPER_CASES) - HELPER_REFUSED) + [True] * HELPER_REFUSED, result["shapes"]
    for i, (fmt, inter, hidden, gated) in enumerate(HELPER_CASES):
        n, answer = f"helper{i}", result["shapes"][f"helper{i}"]
        if "error" in answer:
            with pytest.raises(LayoutError):
                plan_layer(fmt, "trtllm", inter, hidden, gated, gated, engine="flashinfer-0.7.4")
            continue
        plan = plan_layer(fmt, "trtllm", inter, hidden, gated, gated, engine="flashinfer-0.7.4")
        assert (plan.padded_intermediate, plan.padded_hidden) == (inter, hidden)  # it pads nothing
        dt = torch.bfloat16 if fmt == "bf16" else torch.float8_e4m3fn
        q1 = read_out(tmp_path, f"{n}_q1").view(dt).reshape(2, -1, hidden)
        q2 = read_out(tmp_path, f"{n}_q2").view(dt).reshape(2, hidden, inter)
        w13 = _swap_halves(q1) if gated else q1
        s13 = s2 = None
        if fmt == "fp8-block":
            s13 = read_out(tmp_path, f"{n}_q_s1").view(torch.float32).reshape(2, -1, hidden // 128)
            s13 = _swap_halves(s13) if gated else s13
            s2 = read_out(tmp_path, f"{n}_q_s2").view(torch.float32).reshape(2, hidden // 128, inter // 128)
        got = plan.apply(w13, q2, s13, s2)
        want = [read_out(tmp_path, f"{n}_{k}") for k in ("g1", "g2")]
        if fmt == "fp8-block":
            want += [read_out(tmp_path, f"{n}_{k}") for k in ("s1", "s2")]
        for mine, theirs in zip(got, want):
            assert torch.equal(mine.contiguous().view(torch.uint8).reshape(-1), theirs), (fmt, inter, hidden, gated)
