"""The engines' value rules (fimoe_lab.value_rules) against independent element-by-element loops, through
``plan_layer(...).apply`` under each profile, and through convert and restore (which names what it cannot give
back byte for byte).

The loops follow the engines' arithmetic as read from their code (docs/engine-rules.md, "Value rules"), with numpy
scalars and a nearest-value E4M3 encoder of their own: vLLM 0.34 ``process_fp8_weight_tensor_strategy_moe``
(``vllm/model_executor/layers/quantization/utils/fp8_utils.py:1537``): per expert and half,
``per_tensor_dequantize`` (``.../utils/w8a8_utils.py:44``: ``w.to(float16) * scale``, the float32 scale read as
float16 by PyTorch's CUDA multiply) then ``scaled_fp8_quant`` (``static_scaled_fp8_quant``: ``x * (1.0f / scale)``,
``fminf(fmaxf(x, -448), 448)``, round to nearest even); SGLang 0.5.23 (``sglang/srt/layers/quantization/fp8.py:2709``,
``modelopt_quant.py:1209``; ``per_tensor_quant_fp8.cuh``: ``max(min(x, 448), -448)``). vLLM's clamp of DeepSeek FP8
block scales: ``vllm/model_executor/layers/quantization/utils/flashinfer_utils.py:663``. The engines' quantizers
are CUDA kernels (vLLM's ``_C`` extension, SGLang's JIT kernel): tests/test_kernels_gpu.py runs vLLM's own
function against this module where it is installed with CUDA.
"""

from __future__ import annotations

import bisect
import json
import math

import numpy as np
import pytest
import torch
from engine_envs import ENGINE_ENVS, run_oracle
from helpers import all_tensors, coords, random_bytes, same_tensor
from safetensors.torch import load_file

from fimoe_lab import engines, value_rules
from fimoe_lab.checkpoints import not_byte_exact, restore_checkpoint
from fimoe_lab.checkpoints.convert import write_kernel_layout
from fimoe_lab.checkpoints.reader import MoELayer
from fimoe_lab.checkpoints.restore import restore_layers, value_rule_notes
from fimoe_lab.checkpoints.writer import convert_checkpoint
from fimoe_lab.choice import LayoutChoice
from fimoe_lab.cli import main as cli_main
from fimoe_lab.recipes import plan_layer
from fimoe_lab.resources import sample_path

F8 = torch.float8_e4m3fn
CODES = torch.arange(256, dtype=torch.uint8)
VALUES = CODES.view(F8).to(torch.float64).tolist()  # decoding is exact
FINITE = sorted((v, c) for c, v in enumerate(VALUES) if not math.isnan(v) and not (v == 0 and c == 0x80))


def encode_e4m3(x: float) -> int:
    """The E4M3 code nearest ``x`` (finite, |x| <= 448), ties to the even code, zero signed as ``x``."""
    if x == 0:
        return 0x80 if math.copysign(1, x) < 0 else 0
    values = [v for v, _ in FINITE]
    i = bisect.bisect_left(values, x)
    near = [FINITE[j] for j in (i - 1, i) if 0 <= j < len(FINITE)]
    best = min(abs(v - x) for v, _ in near)
    ties = [c for v, c in near if abs(v - x) == best]
    code = next((c for c in ties if c % 2 == 0), ties[0])
    return 0x80 if code == 0 and x < 0 else code  # a negative value rounding to zero keeps its sign


def requantize_loop(w13: torch.Tensor, scales: torch.Tensor, nan_to: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The engines' per-expert requantization, one element at a time (module docstring)."""
    e_count, rows, cols = w13.shape
    half = rows // 2
    codes = w13.view(torch.uint8).tolist()
    out = torch.empty(e_count, rows, cols, dtype=torch.uint8)
    m_out = []
    with np.errstate(all="ignore"):
        for e in range(e_count):
            g, u = (float(v) for v in scales[e].tolist())
            m = math.nan if math.isnan(g) or math.isnan(u) else max(g, u)
            m_out.append(m)
            inv = np.float32(1.0) / np.float32(m)
            for k, s in enumerate((g, u)):
                s16 = float(np.float16(np.float32(s)))
                for r in range(k * half, (k + 1) * half):
                    for c in range(cols):
                        d = np.float16(VALUES[codes[e][r][c]] * s16)  # exact product rounded once to float16
                        x = float(np.float32(np.float32(d) * inv))
                        x = nan_to if math.isnan(x) else min(max(x, -448.0), 448.0)
                        out[e, r, c] = encode_e4m3(x)
    return out.view(F8), torch.tensor(m_out, dtype=torch.float32)


def scales_for(case: str, e_count: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if case == "differ":
        return torch.exp(torch.empty(e_count, 2).uniform_(-9, -2, generator=g))
    if case == "equal":
        return torch.exp(torch.empty(e_count, 1).uniform_(-9, -2, generator=g)).repeat(1, 2)
    special = [[0.0, 0.01], [math.nan, 0.5], [200.0, 300.0], [1e-7, 3e-7], [0.125, 0.125], [0.3, 0.2]]
    return torch.tensor(special[:e_count], dtype=torch.float32)


def weights(kind: str, e_count: int, rows: int, cols: int, seed: int) -> torch.Tensor:
    if kind == "structured":  # bytes that encode their place (NaN codes 0x7f / 0xff among them)
        return coords(e_count, rows, cols // 4).view(torch.uint8).view(F8).reshape(e_count, rows, cols)
    return random_bytes((e_count, rows, cols), F8, seed=seed)


@pytest.mark.parametrize("nan_to", [-448.0, 448.0])
@pytest.mark.parametrize("kind", ["random", "structured"])
@pytest.mark.parametrize("case", ["differ", "equal", "special"])
def test_requantize_matches_the_engines_loop(case, kind, nan_to):
    e_count, inter, hidden = 6, 4, 16
    w13 = weights(kind, e_count, 2 * inter, hidden, seed=7)
    s = scales_for(case, e_count, seed=3)
    want_w, want_m = requantize_loop(w13, s, nan_to)
    got_w, got_m = value_rules.requantize_fp8_max(w13, s, nan_to)
    bad = (got_w.view(torch.uint8) != want_w.view(torch.uint8)).nonzero()
    assert bad.numel() == 0, f"{len(bad)} bytes differ, first at {bad[0].tolist()}"
    assert torch.equal(got_m.isnan(), want_m.isnan())
    assert torch.equal(got_m.nan_to_num(), want_m.nan_to_num())
    if case == "differ":  # the rule does change values: the loop is not the identity
        assert not torch.equal(got_w.view(torch.uint8), w13.view(torch.uint8))


def test_equal_scales_that_float16_holds_keep_ordinary_values():
    """Equal power-of-two scales: every finite code comes back (float16 holds each product), NaN codes become
    the engine's clamp value."""
    w13 = CODES.view(F8).repeat(2, 2, 1)
    got, m = value_rules.requantize_fp8_max(w13, torch.tensor([[0.25, 0.25], [0.25, 0.25]]), -448.0)
    finite = ~w13.view(torch.uint8).bitwise_and(0x7F).eq(0x7F)
    assert torch.equal(got.view(torch.uint8)[finite], w13.view(torch.uint8)[finite])
    assert got.view(torch.uint8)[~finite].eq(0xFE).all() and torch.equal(m, torch.tensor([0.25, 0.25]))


@pytest.mark.parametrize("backend", ["trtllm", "cutlass"])
@pytest.mark.parametrize("engine", ["vllm-0.34", "sglang-0.5.23"])
def test_plan_applies_the_named_profiles_rule_before_its_layout(engine, backend):
    inter, hidden = 16, 32
    w13, w2 = weights("random", 4, 2 * inter, hidden, seed=11), weights("random", 4, hidden, inter, seed=12)
    s = scales_for("differ", 4, seed=5)
    plan = plan_layer("fp8", backend, inter, hidden, engine=engine)
    nan_to = -448.0 if engine.startswith("vllm") else 448.0
    assert plan.value_rule is not None and plan.value_rule.nan_to == nan_to and plan.value_rule.where == "all"
    got = plan.apply(w13, w2, s, torch.ones(4))
    want_w, want_m = requantize_loop(w13, s, nan_to)
    assert torch.equal(got[0].view(torch.uint8), plan.apply_tensor("w13", want_w).view(torch.uint8))  # rule, then maps
    assert torch.equal(got[2], want_m)


def test_default_profile_requantizes_only_experts_whose_scales_differ():
    """engine None: vllm-0.34's layout, the checkpoint's values wherever the kernel takes them."""
    inter, hidden = 16, 32
    w13, w2 = weights("structured", 4, 2 * inter, hidden, seed=0), weights("random", 4, hidden, inter, seed=1)
    s = torch.tensor([[0.01, 0.02], [0.3, 0.3], [1e-7, 1e-7], [0.5, 0.25]])
    plan = plan_layer("fp8", "trtllm", inter, hidden)
    assert plan.value_rule is not None and plan.value_rule.where == "differs"
    got = plan.inverse().apply(*plan.apply(w13, w2, s, torch.ones(4)))[0].view(torch.uint8)
    want, _ = requantize_loop(w13, s, -448.0)
    raw = w13.view(torch.uint8)
    for e, same in enumerate([False, True, True, False]):
        assert torch.equal(got[e], raw[e] if same else want[e].view(torch.uint8)), e
    assert plan_layer("fp8", "trtllm", inter, hidden, values="engine").value_rule.where == "all"
    assert plan_layer("fp8", "trtllm", inter, hidden, engine="flashinfer-0.7.4").value_rule is None


def test_one_scale_per_expert_is_left_alone():
    w13, w2 = weights("random", 2, 32, 32, seed=4), weights("random", 2, 32, 16, seed=5)
    plan = plan_layer("fp8", "cutlass", 16, 32, engine="vllm-0.34")
    back = plan.inverse().apply(*plan.apply(w13, w2, torch.tensor([0.1, 0.2]), torch.ones(2)))
    assert torch.equal(back[0].view(torch.uint8), w13.view(torch.uint8))


FLOOR = float(np.float32(1e-10))
BLOCK_VALUES = [1e-23, 0.0, -0.0, -1.0, FLOOR, float(np.nextafter(np.float32(FLOOR), np.float32(1))),
                float(np.nextafter(np.float32(FLOOR), np.float32(0))), math.nan, 0.5, 3.0e-3]  # fmt: skip


def clamp_loop(s: torch.Tensor) -> torch.Tensor:
    out = [v if math.isnan(v) or v >= FLOOR else FLOOR for v in s.reshape(-1).tolist()]
    return torch.tensor(out, dtype=torch.float32).reshape(s.shape)


@pytest.mark.parametrize("backend", ["trtllm", "cutlass"])
def test_vllm_clamps_deepseek_block_scales_to_1e_10(backend):
    inter, hidden = 128, 256
    w13, w2 = weights("random", 2, 2 * inter, hidden, seed=2), weights("random", 2, hidden, inter, seed=3)
    g = torch.Generator().manual_seed(9)
    pick = lambda *shape: torch.tensor(BLOCK_VALUES)[torch.randint(0, len(BLOCK_VALUES), shape, generator=g)]  # noqa: E731
    s13, s2 = pick(2, 2, 2), pick(2, 2, 1)
    vllm = plan_layer("fp8-block", backend, inter, hidden, engine="vllm-0.34")
    got = vllm.inverse().apply(*vllm.apply(w13, w2, s13, s2))
    for mine, want in ((got[2], clamp_loop(s13)), (got[3], clamp_loop(s2))):
        assert torch.equal(mine.isnan(), want.isnan()) and torch.equal(mine.nan_to_num(), want.nan_to_num())
        assert mine.view(torch.int32)[~mine.isnan()].ne(0x80000000).all()  # -0.0 raised too
    for engine in (None, "sglang-0.5.23", "flashinfer-0.7.4"):  # lossless default; SGLang does not clamp
        plan = plan_layer("fp8-block", backend, inter, hidden, engine=engine)
        back = plan.inverse().apply(*plan.apply(w13, w2, s13, s2))
        assert torch.equal(back[2].view(torch.int32), s13.view(torch.int32)), engine


def fp8_layer(s13: torch.Tensor) -> MoELayer:
    e_count, inter, hidden = s13.shape[0], 16, 32
    w13, w2 = weights("random", e_count, 2 * inter, hidden, seed=21), weights("random", e_count, hidden, inter, seed=22)
    return MoELayer("fp8", w13, w2, s13, torch.full((e_count,), 0.5), inter, hidden, convention="modelopt-fp8")


W13 = "model.layers.0.mlp.experts.w13_weight"


@pytest.mark.parametrize("engine", ["vllm-0.34", "sglang-0.5.23", None])
def test_convert_writes_the_engines_values_and_keeps_the_checkpoints_for_restore(tmp_path, engine):
    """The file's kernel W13 is the engine's requantized values in the kernel layout; beside it the checkpoint's
    W13 and scales (``*_checkpoint``), which restore gives back: every byte, nothing named as lossy."""
    s13 = torch.tensor([[0.01, 0.02], [0.25, 0.25], [0.5, 0.125]])
    layer = fp8_layer(s13)
    out = write_kernel_layout(
        tmp_path / "k.safetensors", [(0, layer, lambda: layer)], LayoutChoice("trtllm", engine=engine)
    )
    from fimoe_lab.checkpoints import read_kernel_metadata
    from fimoe_lab.checkpoints.plan_choice import build_plan

    rec = read_kernel_metadata(out)["layers"]["0"]
    assert rec["value_rule"]["kind"] == "fp8_requantize_max" and rec["value_rule"]["kept"] == ["w13", "w13_scale"]
    plan = build_plan(rec["plan"])
    want, m = requantize_loop(layer.w13, s13, 448.0 if engine == "sglang-0.5.23" else -448.0)
    if engine is None:  # expert 1 (equal scales) keeps its bytes
        want[1] = layer.w13[1]
    written = load_file(out)
    assert torch.equal(written[W13].view(torch.uint8), plan.apply_tensor("w13", want).view(torch.uint8))
    assert torch.equal(written[W13 + "_checkpoint"].view(torch.uint8), layer.w13.view(torch.uint8))
    assert torch.equal(written[W13 + "_scale_checkpoint"], s13)
    _, (back,) = restore_layers(out)
    assert all(same_tensor(a, b) for a, b in zip(back.tensors().values(), layer.tensors().values()))
    assert value_rule_notes(out) == []


@pytest.mark.parametrize("engine", ["vllm-0.34", None])
def test_a_layer_with_one_scale_per_expert_keeps_no_copy(tmp_path, engine):
    """W13 scales ``(E,)``: the rule has nothing to fuse, so the file holds no ``*_checkpoint`` copy."""
    layer = fp8_layer(torch.tensor([[0.01, 0.02], [0.25, 0.125]])).with_tensors(w13_scale=torch.tensor([0.02, 0.25]))
    out = write_kernel_layout(
        tmp_path / "k.safetensors", [(0, layer, lambda: layer)], LayoutChoice("cutlass", engine=engine)
    )
    assert not [n for n in load_file(out) if n.endswith("_checkpoint")]
    _, (back,) = restore_layers(out)
    assert all(same_tensor(a, b) for a, b in zip(back.tensors().values(), layer.tensors().values()))


def test_restore_of_a_flashinfer_profile_file_is_byte_exact(tmp_path):
    layer = fp8_layer(torch.tensor([[0.01, 0.02], [0.25, 0.25]]))
    out = write_kernel_layout(
        tmp_path / "k.safetensors", [(0, layer, lambda: layer)], LayoutChoice("trtllm", engine="flashinfer-0.7.4")
    )
    _, (back,) = restore_layers(out)
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(back.tensors().values(), layer.tensors().values())
    )
    assert value_rule_notes(out) == []


def test_edited_value_rule_record_is_refused(tmp_path):
    from fimoe_lab.checkpoints import CheckpointError
    from fimoe_lab.checkpoints.plan_choice import build_plan
    from fimoe_lab.checkpoints.restore import check_record

    layer = fp8_layer(torch.tensor([[0.01, 0.02]]))
    out = write_kernel_layout(
        tmp_path / "k.safetensors", [(0, layer, lambda: layer)], LayoutChoice("cutlass", engine="vllm-0.34")
    )
    from fimoe_lab.checkpoints import read_kernel_metadata

    rec = read_kernel_metadata(out)["layers"]["0"]
    plan = build_plan(rec["plan"])
    check_record(rec, plan, 2)
    with pytest.raises(CheckpointError, match="value rule"):
        check_record({**rec, "value_rule": {**rec["value_rule"], "nan_to": 448.0}}, plan, 2)


def test_deepseek_sample_dead_expert_under_vllm_restores_exactly(tmp_path, capsys):
    """The sample's expert 3 has block scales below 1e-10: vllm-0.34 writes them clamped (vLLM's bytes) and keeps
    their checkpoint bytes beside them (``*_checkpoint``), so restore gives every byte back and says nothing; the
    default profile does not clamp."""
    src = sample_path("deepseek-v3-fp8")
    named = convert_checkpoint(src, tmp_path / "v.safetensors", "cutlass", engine="vllm-0.34")
    default = convert_checkpoint(src, tmp_path / "d.safetensors", "cutlass")
    source, written, plain = all_tensors(src), load_file(named), load_file(default)
    kernel = [n for n in written if n.endswith(".w13_weight_scale")]
    assert kernel
    for n in kernel:
        assert torch.equal(written[n], clamp_loop(plain[n])), n  # the default file holds the source's scales
        assert torch.equal(written[n + "_checkpoint"].view(torch.int32), source_w13_scales(source, n).view(torch.int32))
    assert any((plain[n] < FLOOR).any() for n in kernel)  # the dead expert, kept by default
    assert not any((written[n] < FLOOR).any() for n in kernel)  # and clamped under vllm-0.34
    assert not_byte_exact(named) == [] and not_byte_exact(default) == []
    assert cli_main(["restore", str(named), str(tmp_path / "back"), "--json", "--no-progress"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["byte_exact"] is True and doc["not_byte_exact"] == []
    back = all_tensors(tmp_path / "back")
    assert sorted(back) == sorted(source) and all(same_tensor(back[k], source[k]) for k in source)


def test_an_edited_kept_checkpoint_copy_is_refused(tmp_path):
    """A byte of a kept ``*_checkpoint`` copy (the clamped scales' checkpoint bytes) changed after conversion:
    restore checks its recorded sha256 like any other tensor's, fails naming it and writes nothing."""
    from fimoe_lab.checkpoints import CheckpointError

    out = convert_checkpoint(sample_path("deepseek-v3-fp8"), tmp_path / "v.safetensors", "cutlass", engine="vllm-0.34")
    raw = bytearray(out.read_bytes())
    header = 8 + int.from_bytes(raw[:8], "little")
    entries = json.loads(raw[8:header])
    kept = sorted(n for n in entries if n.endswith("_checkpoint"))
    checksums = json.loads(entries["__metadata__"]["fimoe_lab"])["checksums"]
    assert kept and all(len(checksums[n]) == 64 for n in kept)  # each has its recorded sha256
    lo, _ = entries[kept[-1]]["data_offsets"]
    raw[header + lo] ^= 0x01
    out.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=f"{kept[-1]}: checksum mismatch"):
        restore_checkpoint(out, tmp_path / "back")
    assert not (tmp_path / "back").exists()


def source_w13_scales(source: dict, kernel_name: str) -> torch.Tensor:
    """W13's block scales of a DeepSeek layer as the checkpoint stores them, stacked ``[gate; up]`` per expert."""
    base = kernel_name[: -len("w13_weight_scale")]
    experts = sorted({int(k[len(base) :].split(".")[0]) for k in source if k.startswith(base) and k.endswith("_inv")})
    parts = [torch.cat([source[f"{base}{e}.{p}_proj.weight_scale_inv"] for p in ("gate", "up")]) for e in experts]
    return torch.stack(parts)


@pytest.mark.parametrize(
    "engine, backend, tp, ep",
    [
        ("vllm-0.34", "trtllm", 1, 1),
        ("sglang-0.5.23", "cutlass", 1, 1),
        (None, "trtllm", 2, 2),
        ("vllm-0.34", "cutlass", 2, 1),
    ],
)
def test_requantized_modelopt_fp8_checkpoint_restores_byte_exact(tmp_path, capsys, engine, backend, tp, ep):
    """ModelOpt FP8 with different gate and up scales (every family generated as its writer writes it): the
    engine's requantized bytes in the file, and restore of every rank gives back the whole checkpoint."""
    from test_whole_checkpoints import assert_whole

    from scripts import make_family_samples as gen

    src = gen.make("modelopt-fp8", tmp_path)
    rank = "all" if tp * ep > 1 else 0
    out = convert_checkpoint(src, tmp_path / "k", backend, tp, rank, engine=engine, ep_size=ep)
    assert not_byte_exact(out) == []
    assert cli_main(["restore", str(out), str(tmp_path / "back"), "--json", "--no-progress"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["byte_exact"] is True and doc["not_byte_exact"] == []
    assert_whole(src, tmp_path / "back")


def without_kept_copies(path) -> None:
    """Rewrite ``path`` as a file whose value rules keep nothing: no ``*_checkpoint`` tensors, none recorded."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys() if not k.endswith("_checkpoint")}
    meta = json.loads(metadata["fimoe_lab"])
    for rec in meta["layers"].values():
        if rec.get("value_rule"):
            rec["value_rule"]["kept"] = []
    meta["checksums"] = {k: v for k, v in meta["checksums"].items() if k in tensors}
    save_file(tensors, str(path), metadata={**metadata, "fimoe_lab": json.dumps(meta)})


def test_a_file_without_the_checkpoint_copy_restores_the_engines_values_and_names_them(tmp_path, capsys):
    """A converted file whose record keeps no copy of the requantized W13: restore writes the engine's values
    and says, per layer, which tensors are not the checkpoint's bytes (text and --json)."""
    from scripts import make_family_samples as gen

    src = gen.make("modelopt-fp8", tmp_path)
    out = convert_checkpoint(src, tmp_path / "k.safetensors", "trtllm", engine="vllm-0.34")
    without_kept_copies(out)
    notes = not_byte_exact(out)
    assert notes and all(n["rule"] == "fp8_requantize_max" for n in notes)
    assert all(n["tensors"][0].endswith("w13_weight") and "every expert" in n["why"] for n in notes)
    assert cli_main(["restore", str(out), str(tmp_path / "back"), "--json", "--no-progress"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["byte_exact"] is False and doc["not_byte_exact"] == notes
    source, back = all_tensors(src), all_tensors(tmp_path / "back")
    assert sorted(back) == sorted(source)
    assert any(not same_tensor(back[k], source[k]) for k in source if "experts" in k)  # requantized values
    assert cli_main(["restore", str(out), str(tmp_path / "back2"), "--no-progress"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("not byte-exact:")]
    assert len(lines) == len(notes) and all("w13_weight_scale" in ln for ln in lines)


def test_profiles_hold_value_rules_as_data():
    vllm, sglang = engines.get_engine("vllm-0.34"), engines.get_engine("sglang-0.5.23")
    for backend in ("trtllm", "cutlass"):
        assert vllm.value_rule("fp8", backend).kind == "fp8_requantize_max"
        assert vllm.value_rule("fp8-block", backend, "compressed-tensors").floor == 1e-10
        assert vllm.value_rule("fp8-block", backend, lossless=True) is None  # not needed by the kernel
        assert sglang.value_rule("fp8-block", backend) is None
    assert sglang.value_rule("fp8", "trtllm", "modelopt").nan_to == 448.0
    assert all(not p.value_rules for n, p in engines.ENGINES.items() if not n.startswith(("vllm", "sglang")))


@pytest.mark.parametrize("backend", ["trtllm", "cutlass"])
def test_clamped_scales_restore_whole_across_tp_and_ep_ranks(tmp_path, backend):
    """--tp 2 --ep 2 --rank all under vllm-0.34: every rank keeps its slice's checkpoint scales, restore joins them."""
    from test_whole_checkpoints import assert_whole

    src = sample_path("deepseek-v3-fp8")
    out = convert_checkpoint(src, tmp_path / "k", backend, 2, "all", engine="vllm-0.34", ep_size=2)
    assert not_byte_exact(out) == []
    assert_whole(src, restore_checkpoint(out, tmp_path / "back"))


@pytest.mark.parametrize("kind", ["random", "structured"])
@pytest.mark.slow
@pytest.mark.skipif(not ENGINE_ENVS["vllm"].python.exists(), reason="no vLLM 0.34 environment")
def test_vllms_own_requantization_loop_on_cpu(tmp_path, kind):
    """vLLM's ``process_fp8_weight_tensor_strategy_moe`` itself (its loop, max, ``per_tensor_dequantize``), its CUDA
    quantizer transcribed (tests/engine_oracles/vllm_034_requant.py), on scales that are float16 values (where the
    CPU multiply equals CUDA's): the same bytes and scales as value_rules."""
    from safetensors.torch import save_file

    w13 = weights(kind, 6, 32, 64, seed=13)
    g = torch.Generator().manual_seed(17)
    scales = torch.exp(torch.empty(6, 2).uniform_(-9, -2, generator=g)).half().float()
    scales[1, 1] = scales[1, 0]  # equal gate and up scales
    scales[2] = torch.tensor([0.0, 0.25])
    save_file({"w13": w13, "scales": scales}, str(tmp_path / "inputs.safetensors"))
    run_oracle("vllm", "vllm_034_requant.py", tmp_path)
    vllm = load_file(str(tmp_path / "outputs.safetensors"))
    mine, m = value_rules.requantize_fp8_max(w13, scales, -448.0)
    bad = (mine.view(torch.uint8) != vllm["w13"]).nonzero()
    assert bad.numel() == 0, f"{len(bad)} bytes differ, first at {bad[0].tolist()}"
    assert torch.equal(m, vllm["scale"])


def test_convert_shows_the_rule_as_a_step_and_names_the_kept_copies(tmp_path, capsys):
    """Text and --json: the requantization is the first step of W13 and its scale, and the kept copies are named."""
    from scripts import make_family_samples as gen

    src = gen.make("modelopt-fp8", tmp_path)
    assert cli_main(["convert", str(src), str(tmp_path / "j"), "--backend", "trtllm", "--json", "--no-progress"]) == 0
    doc = json.loads(capsys.readouterr().out)
    for layer in doc["layers"]:
        assert layer["value_rule"]["kind"] == "fp8_requantize_max" and layer["value_rule"]["kept"] == [
            "w13",
            "w13_scale",
        ]
        steps = {t["name"]: t["steps"] for t in layer["tensors"]}
        assert steps["w13_weight"][0] == steps["w13_weight_scale"][0] == "fp8_requantize_max"
        assert "fp8_requantize_max" not in steps["w2_weight"]
    assert cli_main(["convert", str(src), str(tmp_path / "t"), "--backend", "cutlass", "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    kept = [ln for ln in lines if "kept for restore" in ln]
    assert len(kept) == len(doc["layers"]) and all(
        "w13_weight_checkpoint, w13_weight_scale_checkpoint" in ln for ln in kept
    )
