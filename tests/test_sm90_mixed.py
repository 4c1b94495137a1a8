"""The SM90 (Hopper) mixed-input MoE weight interleave (FlashInfer's ``interleave_moe_weights_for_sm90_mixed_gemm``).

The oracle here is written from the CUDA kernels' semantics (``moe_gemm_mixed_utils.cu`` of FlashInfer 0.7.4 and
0.6.13), one GPU thread at a time: which bytes a thread reads, the 32-bit word it builds, the masked shifts it
applies and where it writes. It shares nothing with ``fimoe_lab.steps`` (which builds index arrays and a
per-half bit table). FlashInfer's op runs on CUDA only: the GPU golden (``scripts/golden_sm90_mixed.py``) is
checked at the end when present.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import all_tensors, random_bytes
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from fimoe_lab import engines, goldens, prepare, special_plans, steps
from fimoe_lab.checkpoints import convert_checkpoint, fileformat, open_checkpoint, read_kernel_metadata, sample_path
from fimoe_lab.errors import FimoeError, LayoutError

ROOT = Path(__file__).resolve().parents[1]

# (mask, shift) pairs of the fp4 kernel of FlashInfer >= 0.6.16: out |= (raw & mask) << shift (>> -shift)
FP4_MASK_SHIFTS = [
    (0x00000080, 24), (0x00000070, 18), (0x00000008, 12), (0x00000007, 6),
    (0x00008000, 13), (0x00007000, 7), (0x00000800, 1), (0x00000700, -5),
    (0x00800000, 2), (0x00700000, -4), (0x00080000, -10), (0x00070000, -16),
    (0x80000000, -1), (0x10000000, 1), (0x60000000, -3), (0x08000000, -13),
    (0x01000000, -11), (0x06000000, -15),
]  # fmt: skip
# preprocess_fp4x8_signs_for_fp8: magnitudes (0x77777777) kept, each sign bit moved
FP8_SIGN_SHIFTS = [(0x8, 4), (0x80, 8), (0x800, 12), (0x8000, 16), (0x80000, -16), (0x800000, -12)]
FP8_SIGN_SHIFTS += [(0x8000000, -8), (0x80000000, -4)]


def _shifted(raw: int, pairs) -> int:
    out = 0
    for mask, shift in pairs:
        out |= (raw & mask) << shift if shift >= 0 else (raw & mask) >> -shift
    return out


def oracle_one(w: np.ndarray, quant_type: str, layout: str) -> np.ndarray:
    """One expert ``[n, k/2]`` uint8, the kernel's threads run one after another."""
    rows, kb = w.shape
    cols = 2 * kb
    out = np.full_like(w, 0)
    for block in range(rows // 2):
        row = block // 8 * 16 + block % 8
        for part in range(cols // 64):
            if quant_type == "fp4" and layout == "0.6.16":
                for lane in range(16):
                    mma = lane // 4
                    col = part * 32 + mma * 8 + lane % 4
                    raw = int(w[row, col]) | int(w[row + 8, col]) << 8
                    raw |= int(w[row, col + 4]) << 16 | int(w[row + 8, col + 4]) << 24
                    word = _shifted(raw, FP4_MASK_SHIFTS)
                    dst = part * 32 + lane // 8 * 16 + (lane % 4) * 4
                    out[row + (mma % 2) * 8, dst : dst + 4] = [(word >> (8 * j)) & 0xFF for j in range(4)]
            elif quant_type == "fp4":  # 0.6.10: nibble swap across a byte pair
                for lane in range(32):
                    a, b = int(w[row, part * 32 + lane]), int(w[row + 8, part * 32 + lane])
                    a2, b2 = (a & 0x0F) | ((b & 0x0F) << 4), (b & 0xF0) | ((a & 0xF0) >> 4)
                    dst = part * 32 + lane // 16 * 16 + (lane % 4) * 4 + (lane % 8) // 4 * 2
                    out[row + (lane // 8 % 2) * 8, dst : dst + 2] = [a2, b2]
            else:  # int4, fp4_fp8: uint16 units
                for lane in range(16):
                    col = (part * 16 + lane) * 2
                    a = int(w[row, col]) | int(w[row, col + 1]) << 8
                    b = int(w[row + 8, col]) | int(w[row + 8, col + 1]) << 8
                    word = a | b << 16
                    if quant_type == "fp4_fp8":
                        word = (word & 0x77777777) | _shifted(word, FP8_SIGN_SHIFTS)
                    dst = (part * 16 + lane // 8 * 8 + lane % 4 * 2) * 2
                    out[row + (lane % 8) // 4 * 8, dst : dst + 4] = [(word >> (8 * j)) & 0xFF for j in range(4)]
    return out


def oracle(w: torch.Tensor, quant_type: str = "fp4", layout: str = "0.6.16") -> torch.Tensor:
    return torch.from_numpy(np.stack([oracle_one(e, quant_type, layout) for e in w.numpy()]))


VARIANTS = [("fp4", "0.6.16"), ("fp4_fp8", "0.6.16"), ("int4", "0.6.16"), ("fp4", "0.6.10"), ("int4", "0.6.10")]


def _golden_script():
    """``scripts/golden_sm90_mixed.py`` as a module (it records the H200 golden; its inputs serve here too)."""
    spec = importlib.util.spec_from_file_location("golden_sm90_mixed", ROOT / "scripts" / "golden_sm90_mixed.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SCRIPT = _golden_script()
nibble_coordinates = SCRIPT.nibble_coordinates
"""Structured input ``(experts, rows, bytes)``: the 4-bit value at (expert, row, value v) is ``(3 e + 5 row + v)
% 16``, never all zero (the golden script's, so the recorded inputs and these are one rule)."""


def bit_sources(fn, rows: int, cols_bytes: int) -> torch.Tensor:
    """The input bit offset of every output bit of ``fn`` (one expert), from inputs whose bits encode
    their own coordinates: in input ``k`` bit ``i`` is bit ``k`` of ``i``."""
    n = rows * cols_bytes * 8
    idx = torch.arange(n)
    src = torch.zeros(n, dtype=torch.int64)
    for k in range(max(1, (n - 1).bit_length())):
        bits = ((idx >> k) & 1).reshape(-1, 8)
        x = (bits << torch.arange(8)).sum(1).to(torch.uint8).reshape(1, rows, cols_bytes)
        y = fn(x).reshape(-1)
        src |= ((y[:, None] >> torch.arange(8)) & 1).reshape(-1).to(torch.int64) << k
    return src


# ----------------------------------------------------------------------------- the step against the oracle
@pytest.mark.parametrize("quant_type,layout", VARIANTS)
@pytest.mark.parametrize("rows,cols_bytes", [(16, 32), (48, 96), (32, 64)])
def test_step_equals_the_kernel_loop_on_random_and_structured_bytes(quant_type, layout, rows, cols_bytes):
    m = steps.sm90_mixed_weight_map(rows, cols_bytes, quant_type, layout)
    for x in (
        random_bytes((3, rows, cols_bytes), torch.uint8, seed=rows + cols_bytes),
        nibble_coordinates(3, rows, cols_bytes),
    ):
        got = m.apply(x)
        assert got.dtype == torch.uint8 and got.shape == x.shape
        assert torch.equal(got, oracle(x, quant_type, layout))
        assert torch.equal(m.undo(got), x)


@pytest.mark.parametrize("quant_type,layout", VARIANTS)
def test_every_bit_traces_to_its_source(quant_type, layout):
    """Bits that encode their own coordinates: the oracle's bit permutation equals ``source_bits`` (the
    provenance of the byte step composed with the word bit step)."""
    rows, cols_bytes = 32, 64
    m = steps.sm90_mixed_weight_map(rows, cols_bytes, quant_type, layout)
    want = bit_sources(lambda x: oracle(x, quant_type, layout), rows, cols_bytes)
    assert torch.equal(torch.sort(want).values, torch.arange(want.numel()))  # a permutation of the bits
    assert torch.equal(m.source_bits(), want)
    assert torch.equal(bit_sources(m.apply, rows, cols_bytes), want)


def test_nibbles_stay_whole_only_where_the_kernel_keeps_them():
    """int4 and fp4 0.6.10 move whole nibbles; fp4 0.6.16 separates signs from magnitudes (so no byte or
    nibble map can express it: hence the word bit step)."""
    for quant_type, layout, whole in [("int4", "0.6.16", True), ("fp4", "0.6.10", True), ("fp4", "0.6.16", False)]:
        src = steps.sm90_mixed_weight_map(16, 32, quant_type, layout).source_bits().reshape(-1, 4)
        keeps = bool(((src[:, 1:] - src[:, :1]) == torch.arange(1, 4)).all() and (src[:, 0] % 4 == 0).all())
        assert keeps == whole, (quant_type, layout)


@settings(max_examples=30, deadline=None)
@given(
    bands=st.integers(1, 4),
    parts=st.integers(1, 4),
    experts=st.integers(1, 3),
    variant=st.sampled_from(VARIANTS),
    seed=st.integers(0, 2**16),
)
def test_property_any_shape(bands, parts, experts, variant, seed):
    rows, cols_bytes = 16 * bands, 32 * parts
    m = steps.sm90_mixed_weight_map(rows, cols_bytes, *variant)
    x = random_bytes((experts, rows, cols_bytes), torch.uint8, seed=seed)
    got = m.apply(x)
    assert torch.equal(got, oracle(x, *variant))
    assert torch.equal(m.undo(got), x)
    assert m.gather.is_permutation and m.bits.is_permutation
    assert steps.build(m.gather.kind, dict(m.gather.params)) == m.gather
    assert steps.build(m.bits.kind, dict(m.bits.params)) == m.bits
    assert (m.bits >> m.bits.inverse()) == steps.sm90_mixed_word_bits("int4")  # the identity


def test_word_bits_executor_equals_unpack_gather_pack():
    """The masked-shift executor against the index map run for real on the unpacked bit view."""
    x = random_bytes((4, 64, 96), torch.uint8, seed=7)
    for variant in VARIANTS:
        bits = steps.sm90_mixed_word_bits(*variant)
        for b in (bits, bits.inverse()):
            unpacked = ((x.reshape(-1, 4)[:, :, None] >> torch.arange(8)) & 1).reshape(-1, 32).to(torch.uint8)
            moved = b.apply(unpacked).reshape(-1, 4, 8).to(torch.int32)
            want = (moved << torch.arange(8)).sum(-1).to(torch.uint8).reshape(x.shape)
            assert torch.equal(steps.apply_word_bits(b, x, chunk_words=100), want)
    assert steps.sm90_mixed_word_bits("fp4").provenance(15).source == (3,)  # sign of nibble 0 -> bit 15


def test_step_refusals():
    with pytest.raises(LayoutError, match="rows % 16 == 0 and K % 64 == 0"):
        steps.interleave_sm90_mixed_weights(24, 64)
    with pytest.raises(LayoutError, match="K % 64 == 0"):
        steps.interleave_sm90_mixed_weights(32, 48)
    with pytest.raises(LayoutError, match="fp4_fp8"):
        steps.sm90_mixed_word_bits("fp4_fp8", "0.6.10")
    with pytest.raises(LayoutError, match="not a permutation of the 32 bits"):
        steps.apply_word_bits(steps.interleave_sm90_mixed_weights(16, 32), torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(LayoutError, match="contiguous uint8"):
        steps.apply_word_bits(steps.sm90_mixed_word_bits(), torch.ones(6, dtype=torch.uint8))


# ----------------------------------------------------------------------------- the drop-in
SGLANG = ROOT / ".venv-sglang" / "bin" / "python"
SGLANG_WORKER = """
import json, sys
from pathlib import Path
from types import SimpleNamespace
import numpy as np, torch
from safetensors.torch import load_file, save_file
sys.path.insert(0, sys.argv[2])
import sglang_0523 as runner  # SGLang 0.5.23's modules loaded alone
import flashinfer.fused_moe as fm
mx = runner.mx
{oracle}
def interleave(weight, quant_type="fp4"):  # the kernel loop stands in for FlashInfer's CUDA op
    return torch.from_numpy(np.stack([oracle_one(e, quant_type, "0.6.16") for e in weight.numpy()]))
mx.interleave_moe_weights_for_sm90_mixed_gemm = interleave
mx.interleave_moe_scales_for_sm90_mixed_gemm = fm.interleave_moe_scales_for_sm90_mixed_gemm  # FlashInfer's, CPU
d = Path(sys.argv[1])
tensors, out = load_file(str(d / "inputs.safetensors")), {{}}
for c in json.loads((d / "cases.json").read_text()):
    t = {{k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith(c["name"] + ".")}}
    layer = torch.nn.Module()
    for k, n in (("w13", "w13_weight"), ("w2", "w2_weight"), ("s13", "w13_weight_scale"), ("s2", "w2_weight_scale")):
        setattr(layer, n, torch.nn.Parameter(t[k], requires_grad=False))
    e, rows = t["w13"].shape[:2]
    layer.num_local_experts = e
    layer.w13_weight_bias = torch.nn.Parameter(torch.zeros(e, rows, dtype=torch.bfloat16), requires_grad=False)
    layer.w2_weight_bias = torch.nn.Parameter(torch.zeros(e, t["w2"].shape[1], dtype=torch.bfloat16), requires_grad=False)
    layer.moe_runner_config = SimpleNamespace(gate_up_interleaved=c["interleaved"], gemm1_alpha=None, gemm1_clamp_limit=None)
    method = SimpleNamespace(_padded_intermediate=c["ip"], _padded_hidden=c["hp"], _use_sm90_humming=False)
    mx.Mxfp4MoEMethod._process_weights_for_sm90_cutlass(method, layer)
    for k, n in (("w13", "w13_weight"), ("w2", "w2_weight"), ("s13", "w13_weight_scale"), ("s2", "w2_weight_scale")):
        out[c["name"] + "." + k] = getattr(layer, n).data.contiguous().view(torch.uint8).reshape(-1).clone()
save_file(out, str(d / "outputs.safetensors"))
"""


@pytest.mark.skipif(not SGLANG.exists(), reason="no SGLang 0.5.23 environment (.venv-sglang, made by .ci/run)")
def test_sglang_0523_own_code_with_the_kernel_loop(tmp_path):
    """SGLang 0.5.23's ``Mxfp4MoEMethod._process_weights_for_sm90_cutlass`` (its padding to 128, ``[up; gate]``,
    which tensors get which op), FlashInfer 0.7.2's own scale folding and the kernel loop for the CUDA-only
    weight op, against :func:`special_plans.plan_cutlass_mxfp4_bf16` (``sglang-0.5.23``)."""
    cases, inputs, ours = [], {}, {}
    for n, (interleaved, inter, hidden, structured) in enumerate([(True, 96, 160, False), (False, 128, 256, True)]):
        plan = special_plans.plan_cutlass_mxfp4_bf16(inter, hidden, engine="sglang-0.5.23")
        shapes = {"w13": (2 * inter, hidden // 2), "w2": (hidden, inter // 2)}
        shapes |= {"s13": (2 * inter, hidden // 32), "s2": (hidden, inter // 32)}
        t = {k: random_bytes((2, *v), torch.uint8, seed=20 * n + i) for i, (k, v) in enumerate(shapes.items())}
        if structured:
            t["w13"], t["w2"] = nibble_coordinates(2, *shapes["w13"]), nibble_coordinates(2, *shapes["w2"]) ^ 0xA5
        ours[f"c{n}"] = plan.apply(t["w13"], t["w2"], t["s13"], t["s2"])
        if interleaved:  # gpt-oss stores W13 rows [g0, u0, g1, u1, ...]
            t = {
                k: v.view(2, 2, inter, -1).transpose(1, 2).reshape(v.shape) if k in ("w13", "s13") else v
                for k, v in t.items()
            }
        inputs |= {f"c{n}.{k}": v.contiguous() for k, v in t.items()}
        ip, hp = plan.padded_intermediate, plan.padded_hidden
        cases.append(dict(name=f"c{n}", interleaved=interleaved, ip=ip, hp=hp))
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    save_file(inputs, str(tmp_path / "inputs.safetensors"))
    source = "\n".join(inspect.getsource(f) for f in (_shifted, oracle_one))
    consts = f"FP4_MASK_SHIFTS = {FP4_MASK_SHIFTS!r}\nFP8_SIGN_SHIFTS = {FP8_SIGN_SHIFTS!r}\n"
    worker = SGLANG_WORKER.format(oracle=consts + source)
    oracles = str(ROOT / "tests" / "engine_oracles")
    run = subprocess.run(
        [str(SGLANG), "-c", worker, str(tmp_path), oracles], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = load_file(str(tmp_path / "outputs.safetensors"))
    for name, got in ours.items():
        for k, mine in zip(("w13", "w2", "s13", "s2"), got):
            assert torch.equal(mine.contiguous().view(torch.uint8).reshape(-1), out[f"{name}.{k}"]), (name, k)


def flashinfer_signature(site_packages: Path) -> list[list[str]]:
    """``[name, repr(default)]`` of FlashInfer's ``interleave_moe_weights_for_sm90_mixed_gemm``, read from its
    source (``fused_moe/prepare.py`` in 0.7.x, ``core.py`` in 0.6.x) without importing it."""
    for name in ("prepare.py", "core.py"):
        path = site_packages / "flashinfer" / "fused_moe" / name
        if not path.is_file():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == "interleave_moe_weights_for_sm90_mixed_gemm":
                args = node.args.args
                defaults = [None] * (len(args) - len(node.args.defaults)) + node.args.defaults
                return [[a.arg, "<empty>" if d is None else repr(ast.literal_eval(d))] for a, d in zip(args, defaults)]
    pytest.skip(f"no interleave_moe_weights_for_sm90_mixed_gemm under {site_packages}")


@pytest.mark.parametrize("venv", [".venv", ".venv-fi074"])
def test_drop_in_signature_matches_flashinfer(venv):
    """Against FlashInfer 0.6.13 (``.venv``) and 0.7.4 (``.venv-fi074``, made by ``.ci/run``)."""
    site = ROOT / venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    if not (site / "flashinfer").is_dir():
        pytest.skip(f"no FlashInfer in {venv}")
    ours = inspect.signature(prepare.interleave_moe_weights_for_sm90_mixed_gemm).parameters
    mine = [[k, "<empty>" if v.default is inspect.Parameter.empty else repr(v.default)] for k, v in ours.items()]
    assert flashinfer_signature(site) == mine == [["weight", "<empty>"], ["quant_type", "'fp4'"]]


@pytest.mark.parametrize("quant_type", ["fp4", "fp4_fp8", "int4"])
def test_drop_in_equals_the_oracle_and_leaves_its_input(quant_type):
    x = random_bytes((2, 48, 64), torch.uint8, seed=3)
    before = x.clone()
    got = prepare.interleave_moe_weights_for_sm90_mixed_gemm(x, quant_type)
    assert torch.equal(x, before) and got.data_ptr() != x.data_ptr()
    assert torch.equal(got, oracle(x, quant_type))
    strided = torch.cat([x, x], dim=2)[:, :, :64]  # not contiguous: taken as FlashInfer does (.contiguous())
    assert torch.equal(prepare.interleave_moe_weights_for_sm90_mixed_gemm(strided, quant_type), got)


@pytest.mark.parametrize(
    "weight,quant_type,message",
    [
        (torch.ones(48, 64, dtype=torch.uint8), "fp4", r"3-D \(num_experts, n, k/2\)"),
        (torch.ones(2, 48, 32, dtype=torch.bfloat16), "fp4", "must be uint8"),
        (torch.ones(2, 48, 64, dtype=torch.uint8), "nvfp4", r"quant_type must be one of \['fp4', 'fp4_fp8', 'int4'\]"),
        (torch.ones(2, 40, 64, dtype=torch.uint8), "fp4", "rows % 16 == 0"),
        (torch.ones(2, 48, 80, dtype=torch.uint8), "int4", "K % 64 == 0"),
    ],
)
def test_drop_in_refusals(weight, quant_type, message):
    before = weight.clone()
    with pytest.raises(FimoeError, match=message) as err:
        prepare.interleave_moe_weights_for_sm90_mixed_gemm(weight, quant_type)
    assert str(err.value).startswith("interleave_moe_weights_for_sm90_mixed_gemm: ")
    assert isinstance(err.value, ValueError) and torch.equal(weight, before)


# ----------------------------------------------------------------------------- the recipe
def engine_reference(w13, w2, s13, s2, inter, hidden, layout):
    """vLLM 0.34's FLASHINFER_CUTLASS_MXFP4_BF16 preparation of a [gate; up] checkpoint, written here: pad I/H
    to 128 (zeros), [up; gate], the kernel loop on both weights, FlashInfer's scale layout on both scales."""
    ip, hp = -(-inter // 128) * 128, -(-hidden // 128) * 128
    e = w13.shape[0]
    pw13 = torch.zeros(e, 2 * ip, hp // 2, dtype=torch.uint8)
    ps13 = torch.zeros(e, 2 * ip, hp // 32, dtype=torch.uint8)
    for half, dst in ((1, 0), (0, ip)):  # up first
        pw13[:, dst : dst + inter, : hidden // 2] = w13[:, half * inter : (half + 1) * inter]
        ps13[:, dst : dst + inter, : hidden // 32] = s13[:, half * inter : (half + 1) * inter]
    pw2 = torch.zeros(e, hp, ip // 2, dtype=torch.uint8)
    ps2 = torch.zeros(e, hp, ip // 32, dtype=torch.uint8)
    pw2[:, :hidden, : inter // 2], ps2[:, :hidden, : inter // 32] = w2, s2

    def scales(s):
        if layout == "0.6.10":  # FlashInfer 0.6.13: [E, K/128, rows * 4]
            return s.reshape(e, s.shape[1], -1, 4).permute(0, 2, 1, 3).contiguous().reshape(e, -1, s.shape[1] * 4)
        return prepare.interleave_moe_scales_for_sm90_mixed_gemm(s)

    return oracle(pw13, "fp4", layout), oracle(pw2, "fp4", layout), scales(ps13), scales(ps2)


@pytest.mark.parametrize("engine", ["vllm-0.34", "sglang-0.5.23", "flashinfer-0.7.4", "flashinfer-0.6.13"])
@pytest.mark.parametrize("inter,hidden", [(64, 128), (96, 160)])
def test_recipe_equals_the_engine_steps(engine, inter, hidden):
    layout = engines.get_engine(engine).sm90_mixed_layout
    assert layout == ("0.6.10" if engine == "flashinfer-0.6.13" else "0.6.16")
    plan = special_plans.plan_cutlass_mxfp4_bf16(inter, hidden, engine=engine)
    ins = [
        random_bytes((2, 2 * inter, hidden // 2), torch.uint8, seed=1),
        random_bytes((2, hidden, inter // 2), torch.uint8, seed=2),
        random_bytes((2, 2 * inter, hidden // 32), torch.uint8, seed=3),
        random_bytes((2, hidden, inter // 32), torch.uint8, seed=4),
    ]
    got = plan.apply(*ins)
    want = engine_reference(*ins, inter, hidden, layout)
    for g, w in zip(got, want):
        assert torch.equal(g.reshape(-1), w.reshape(-1).view(torch.uint8))
    for back, x in zip(plan.inverse().apply(*got), ins):
        assert torch.equal(back.reshape(x.shape), x)
    assert plan.bias_map("w13_bias", 2) == steps.pad_projections(2, inter, plan.padded_intermediate, 2, 2) >> (
        steps.swap_w13_to_w31_rows(2 * plan.padded_intermediate, 2)
    )  # a bias follows pad and swap only, as vLLM's w13_bias_swapped
    kinds = [s["kind"] for s in plan.tensor_steps("w13")]
    assert kinds == ["pad_projections", "swap_w13_to_w31_rows", "interleave_sm90_mixed_weights", "sm90_mixed_word_bits"]


VLLM = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_WORKER = """
import sys
from pathlib import Path
import numpy as np, torch
sys.path.insert(0, sys.argv[2])
import vllm_034 as runner  # vLLM 0.34's modules loaded alone, CPU stand-ins for CUDA-only helpers
import flashinfer.fused_moe as fm
{oracle}
def interleave(weight, quant_type="fp4"):  # the kernel loop stands in for FlashInfer's CUDA op
    return torch.from_numpy(np.stack([oracle_one(e, quant_type, "0.6.16") for e in weight.numpy()]))
fm.interleave_moe_weights_for_sm90_mixed_gemm = interleave
runner.main(Path(sys.argv[1]))
"""


def _vllm_allocation(x: torch.Tensor, parts: int, rows: int, prows: int, cols: int) -> torch.Tensor:
    """vLLM's MXFP4 ``create_weights``: zeros of the rounded-up sizes, each projection at its block's start."""
    out = x.new_zeros(x.shape[0], parts * prows, cols)
    for i in range(parts):
        out[:, i * prows : i * prows + rows, : x.shape[2]] = x[:, i * rows : (i + 1) * rows]
    return out


def vllm_case(name: str, op: str, t: dict[str, torch.Tensor], inter: int, hidden: int, ip: int, hp: int):
    """One case of :func:`run_vllm_034`: ``t`` (``w13``, ``w2``, ``s13``, ``s2``: checkpoint ``[gate; up]``
    uint8) allocated as vLLM's ``create_weights`` does at the padded sizes ``ip``/``hp``, W13 rows interleaved
    ``[g0, u0, g1, u1, ...]`` for ``op`` ``mxfp4_gptoss``: ``(case, inputs by name)``."""
    e = t["w13"].shape[0]
    alloc = {
        "w13": _vllm_allocation(t["w13"], 2, inter, ip, hp // 2),
        "w2": _vllm_allocation(t["w2"], 1, hidden, hp, ip // 2),
        "s13": _vllm_allocation(t["s13"], 2, inter, ip, hp // 32),
        "s2": _vllm_allocation(t["s2"], 1, hidden, hp, ip // 32),
    }
    if op == "mxfp4_gptoss":  # gpt-oss stores W13 rows [g0, u0, g1, u1, ...]
        for k in ("w13", "s13"):
            x = alloc[k]
            alloc[k] = x.view(e, 2, x.shape[1] // 2, -1).transpose(1, 2).reshape(x.shape)
    common = dict(act_and_mul=True, gated=True, inter=inter, hidden=hidden)
    case = dict(name=name, op=op, vbackend="FLASHINFER_CUTLASS_MXFP4_BF16", **common)
    return case, {f"{name}.{k}": v.contiguous() for k, v in alloc.items()}


def run_vllm_034(tmp_path: Path, cases: list[dict], inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """vLLM 0.34's ``convert_weight_to_mxfp4_moe_kernel_format`` / ``convert_gpt_oss_weight_...`` on
    ``FLASHINFER_CUTLASS_MXFP4_BF16`` (.venv-vllm; FlashInfer 0.7.4's own scale folding, the kernel loop above
    for the CUDA-only weight op) on :func:`vllm_case` cases: ``{"<case>.<w13|w2|s13|s2>": uint8 bytes}``."""
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    save_file(inputs, str(tmp_path / "inputs.safetensors"))
    source = "\n".join(inspect.getsource(f) for f in (_shifted, oracle_one))
    consts = f"FP4_MASK_SHIFTS = {FP4_MASK_SHIFTS!r}\nFP8_SIGN_SHIFTS = {FP8_SIGN_SHIFTS!r}\n"
    worker = VLLM_WORKER.format(oracle=consts + source)
    oracles = str(ROOT / "tests" / "engine_oracles")
    run = subprocess.run([str(VLLM), "-c", worker, str(tmp_path), oracles], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    meta = json.loads((tmp_path / "outputs.json").read_text())
    for c in cases:
        assert "error" not in meta[c["name"]], meta[c["name"]]
    return load_file(str(tmp_path / "outputs.safetensors"))


KERNEL_TENSORS = ("w13", "w2", "w13_scale", "w2_scale")


def kernel_file_tensors(kernel: Path, meta: dict, idx: str) -> dict[str, torch.Tensor]:
    """Layer ``idx`` of a kernel-layout file: its tensors by plan name (``w13``, ...), as the file holds them."""
    files, rec = all_tensors(kernel), meta["layers"][idx]
    return {
        n: files[fileformat.out_name(meta["prefix"], meta["block"], int(idx), rec["tensors"][n]["name"])]
        for n in KERNEL_TENSORS
    }


def converted_sample_cases(tmp_path: Path) -> tuple[list[dict], dict, dict]:
    """``convert --mxfp4-activation bf16`` of the gpt-oss MXFP4 sample at TP 1 and 2 (last rank), each layer as a
    :func:`vllm_case` (``mxfp4_gptoss``: allocated and interleaved as vLLM loads gpt-oss): ``(cases, inputs,
    {case: the file's tensors as :func:`recipes.plan_layer` ``apply`` orders them})``."""
    cases, inputs, files = [], {}, {}
    with open_checkpoint(sample_path("gpt-oss-mxfp4")) as ck:
        for tp in (1, 2):
            kernel = tmp_path / f"sample-tp{tp}.safetensors"
            convert_checkpoint(ck.path, kernel, "cutlass", tp, tp - 1, activation_dtype="bf16")
            meta = read_kernel_metadata(kernel)
            for idx, rec in meta["layers"].items():
                layer = ck.read_layer(int(idx), tp, tp - 1)
                t = {k: getattr(layer, n).view(torch.uint8) for k, n in zip(("w13", "w2", "s13", "s2"), KERNEL_TENSORS)}
                ip, hp = rec["padded_intermediate"], rec["padded_hidden"]
                case, more = vllm_case(f"tp{tp}l{idx}", "mxfp4_gptoss", t, layer.intermediate, layer.hidden, ip, hp)
                cases.append(case)
                inputs |= more
                files[case["name"]] = tuple(kernel_file_tensors(kernel, meta, idx).values())
    return cases, inputs, files


@pytest.mark.skipif(not VLLM.exists(), reason="no vLLM 0.34 environment (.venv-vllm, made by .ci/run)")
def test_vllm_034_own_code_with_the_kernel_loop(tmp_path):
    """vLLM 0.34's ``convert_weight_to_mxfp4_moe_kernel_format`` and ``convert_gpt_oss_weight_...`` on
    ``FLASHINFER_CUTLASS_MXFP4_BF16`` (their swaps, which tensors get which FlashInfer op, in which order),
    FlashInfer 0.7.4's own scale folding, and the kernel loop above for the CUDA-only weight op, against
    :func:`special_plans.plan_cutlass_mxfp4_bf16` on random and structured bytes, padded and unpadded sizes; and
    against what ``convert --mxfp4-activation bf16`` writes from the gpt-oss sample at TP 1 and 2 (one vLLM
    run for both: :func:`converted_sample_cases`)."""
    cases, inputs, ours = converted_sample_cases(tmp_path)
    assert len(cases) >= 2
    for n, (op, inter, hidden, structured) in enumerate(
        [("mxfp4", 96, 160, False), ("mxfp4_gptoss", 192, 256, True), ("mxfp4", 128, 128, True)]
    ):
        plan = special_plans.plan_cutlass_mxfp4_bf16(inter, hidden, engine="vllm-0.34")
        shapes = {"w13": (2 * inter, hidden // 2), "w2": (hidden, inter // 2)}
        shapes |= {"s13": (2 * inter, hidden // 32), "s2": (hidden, inter // 32)}
        t = {k: random_bytes((2, *v), torch.uint8, seed=10 * n + i) for i, (k, v) in enumerate(shapes.items())}
        if structured:
            t["w13"], t["w2"] = nibble_coordinates(2, *shapes["w13"]), nibble_coordinates(2, *shapes["w2"]) ^ 0x5A
        ours[f"c{n}"] = plan.apply(t["w13"], t["w2"], t["s13"], t["s2"])
        case, case_inputs = vllm_case(f"c{n}", op, t, inter, hidden, plan.padded_intermediate, plan.padded_hidden)
        cases.append(case)
        inputs |= case_inputs
    out = run_vllm_034(tmp_path, cases, inputs)
    assert len(ours) == len(cases)
    for name, got in ours.items():
        for k, mine in zip(("w13", "w2", "s13", "s2"), got):
            assert torch.equal(mine.contiguous().view(torch.uint8).reshape(-1), out[f"{name}.{k}"]), (name, k)


def test_profiles_name_the_transforms():
    for name in ("vllm-0.34", "sglang-0.5.23", "flashinfer-0.7.4", "flashinfer-0.6.13"):
        assert "interleave_moe_weights_for_sm90_mixed_gemm" in engines.get_engine(name).transforms
        assert hasattr(prepare, "interleave_moe_weights_for_sm90_mixed_gemm")


# ----------------------------------------------------------------------------- the H200 golden
def _golden_cases() -> list[dict]:
    cases = []
    for path in goldens.default_golden_paths():
        cases += [c for c in goldens.load_cases(path) if c["fn"] == "interleave_moe_weights_for_sm90_mixed_gemm"]
    return cases


def check_golden_cases(cases: list[dict]) -> None:
    """Each recorded output equals the step (every case), the kernel loop (cases up to 64 KiB) and the
    generic replay of ``fimoe_lab.goldens`` (the drop-ins)."""
    for case in cases:
        if case["fn"] == "interleave_moe_weights_for_sm90_mixed_gemm":
            x, quant_type = goldens.decode(case["inputs"]["weight"]), case["inputs"]["quant_type"]
            want = goldens.decode(case["outputs"][0])
            m = steps.sm90_mixed_weight_map(x.shape[1], x.shape[2], quant_type, case["meta"]["layout"])
            assert torch.equal(m.apply(x), want), case["name"]
            if x.numel() <= 1 << 16:
                assert torch.equal(oracle(x, quant_type, case["meta"]["layout"]), want), case["name"]
        result = goldens.run_case(case)
        assert result.ok and result.detail == "byte-exact", f"{case['name']}: {result.detail}"


def test_against_flashinfer_cuda_golden():
    """FlashInfer's CUDA kernel on an H200 (``scripts/golden_sm90_mixed.py --kernel-source`` -> ``goldens/sm90_mixed.*``,
    committed; or a set made with FlashInfer itself in ``shared/goldens``)."""
    cases = [c for p in goldens.default_golden_paths() for c in goldens.load_cases(p) if "sm90_mixed" in c["name"]]
    if not cases and os.environ.get("FIMOE_GOLDENS"):
        pytest.skip(
            "no SM90 mixed-GEMM golden (FlashInfer's op runs on CUDA only): run "
            "`python scripts/golden_sm90_mixed.py` on a GPU with FlashInfer >= 0.6.16 (or with --kernel-source) "
            "and put sm90_mixed.json + sm90_mixed.safetensors in goldens/ (or set FIMOE_GOLDENS)"
        )
    assert cases, "goldens/sm90_mixed.* (committed) is missing"
    assert all(c["meta"]["reference"] == "flashinfer" for c in cases), "a dry-run set is not a golden"
    assert {c["inputs"].get("quant_type") for c in cases} >= {"fp4", "int4"}
    check_golden_cases(cases)


def test_golden_script_format_by_dry_run(tmp_path):
    """The script's files load with ``goldens.load_cases`` and pass the checks above (its ``--dry-run``
    records fimoe_lab's own bytes: this checks the format and the kernel loop, not FlashInfer)."""
    script = SCRIPT
    assert script.main(["--dry-run", "--small", "--out", str(tmp_path)]) == 0
    cases = goldens.load_cases(tmp_path / "sm90_mixed.json")
    assert len(cases) == 3 * (2 * 3 + 12) + 2 and len({c["name"] for c in cases}) == len(cases)
    check_golden_cases(cases)
    with pytest.raises(SystemExit, match="not a golden"):
        script.main(["--dry-run"])
    assert script.version_tuple("0.6.16rc1") == (0, 6, 16) < script.version_tuple("0.7.4") == (0, 7, 4)
