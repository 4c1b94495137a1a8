"""Recommendations: tactics at every T, accepted by convert's plan, no extra bytes unless predicted faster."""

import json
import math
import random

import pytest

pd = pytest.importorskip("pandas")

from fimoe_lab.errors import FimoeError  # noqa: E402
from fimoe_lab.presets import PRESETS, get_preset  # noqa: E402
from fimoe_lab.recipes import plan_layer  # noqa: E402
from fimoe_lab.specs import FORMATS, get_activation  # noqa: E402
from fimoe_lab.tune.cost import GPUS, get_gpu, layer_time_us  # noqa: E402
from fimoe_lab.tune.models import model_from_checkpoint, model_from_config, model_from_sizes  # noqa: E402
from fimoe_lab.tune.oracle import TacticOracle  # noqa: E402
from fimoe_lab.tune.sweep import rank_sizes, run, sweep  # noqa: E402

ISSUE = {("qwen3-30b-a3b", "bf16", 8), ("nemotron3-nano", "nvfp4", 4), ("qwen3-235b-a22b", "fp8-block", 8)}


@pytest.fixture(scope="module")
def o():
    return TacticOracle(mode="model")


def _combos(n: int, seed: int = 14) -> list:
    """Random (preset, serving format, TP, GPU) combinations the issue does not list (TP 3 and 6 too), each
    GPU where it runs a backend of the format (Hopper CUTLASS: not MxInt4)."""
    allc = [
        (p.name, f, tp, gpu)
        for p in PRESETS.values()
        for f in p.serving_formats
        for tp in (1, 2, 3, 4, 6, 8)
        for gpu in ("b200", "h200")
        if (p.name, f, tp) not in ISSUE and ("trtllm" if get_gpu(gpu).trtllm_gen else "cutlass") in FORMATS[f].backends
    ]
    return random.Random(seed).sample(allc, n)


def _convert_pads(p, fmt, tp, ia, ha, is_ref, backend="trtllm", per_token=False):
    """The real plan_layer's padded ``(I', H')`` of every rank of ``tp`` (torch; what convert builds)."""
    act = get_activation(p.activation)
    out = set()
    for inter in rank_sizes(p, fmt, tp):
        plan = plan_layer(
            FORMATS[fmt].plan_format,
            backend,
            inter,
            p.hidden,
            act.is_act_and_mul,
            act.gated,
            None if is_ref else ia,
            None if is_ref else ha,
            None,
            per_token,
        )
        out.add((plan.padded_intermediate, plan.padded_hidden))
    return out


@pytest.mark.parametrize("preset, fmt, tp, gpu", _combos(20))
def test_recommendation_holds_on_unlisted_combinations(o, preset, fmt, tp, gpu):
    df = sweep(preset, fmt, tp, o, gpu=gpu)
    tcols = [f"t{t}" for t in df.attrs["tokens"]] if df.attrs["backend"] == "trtllm" else []
    rec = df.attrs["recommendation"]
    if rec is None:  # a reason, never a zero-tactic shape
        assert df.attrs["no_recommendation"] and (not len(df) or not df.recommended.any())
        return
    row = df[df.recommended].iloc[0]
    assert (row[tcols].astype(int) > 0).all()
    p = get_preset(preset)
    want = {(rec["intermediate"], rec["hidden"]), (rec["intermediate_last"], rec["hidden"])}
    is_ref = bool(row.reference)
    assert _convert_pads(p, fmt, tp, rec["inter_align"], rec["hidden_align"], is_ref, df.attrs["backend"]) == want
    cheaper = df[
        df.candidate & (df.extra_bytes_pct < rec["extra_bytes_pct"]) & (df.convert != "") & (df.convert != "ok")
    ]
    slower_or_refused = df[df.candidate & (df.extra_bytes_pct < rec["extra_bytes_pct"])]
    assert (slower_or_refused.predicted_us >= rec["predicted_us"]).all() or len(cheaper) == len(slower_or_refused)


def test_qwen3_bf16_tp8_takes_128_not_256(o):
    df = sweep("qwen3-30b-a3b", "bf16", 8, o)
    rec = df.attrs["recommendation"]
    assert rec["intermediate"] == 128 and rec["extra_bytes_pct"] == pytest.approx(100 / 3)
    r256 = df[df.intermediate == 256].iloc[0]
    assert r256.min_tactics > rec["min_tactics"] and r256.predicted_us > 1.9 * rec["predicted_us"]
    assert "predicts" in df.attrs["why"] and df[df.recommended].pareto.iloc[0]


def test_nemotron_nvfp4_per_token_tp4_is_null_with_reason(o):
    df = sweep("nemotron3-nano", "nvfp4", 4, o, per_token=True)
    assert df.attrs["recommendation"] is None and not df.recommended.any()
    assert "no padding in the grid has a tactic at every token count" in df.attrs["no_recommendation"]


def test_no_trtllm_tactics_offers_cutlass_that_convert_accepts(o):
    s = run("nemotron3-nano", "fp8", 1, o)  # FP8 per-tensor on TRT-LLM is gated-only: no tactic for ReLU^2
    assert s.attrs["recommendation"] is None and all(r["min_tactics"] == 0 for r in s.rows)
    assert s.attrs["alternatives"] == [
        "--backend cutlass (no TRTLLM-Gen tactics needed; convert pads intermediate to a multiple of 128)"
    ]
    rec = run("nemotron3-nano", "fp8", 1, o, backend="cutlass").attrs["recommendation"]
    assert rec["intermediate"] == 1920 and rec["hidden"] == 2688


@pytest.mark.parametrize("preset, tp", [("qwen3-235b-a22b", 8), ("minimax-m2", 8), ("glm-4.5", 8)])
def test_split_scale_block_gets_alternatives_that_convert_accepts(o, preset, tp):
    df = sweep(preset, "fp8-block", tp, o)
    assert df.attrs["recommendation"] is None
    assert "not a multiple of the 128" in df.attrs["no_recommendation"]
    alts = df.attrs["alternatives"]
    assert alts and alts[0].startswith("--tp ") and any("expert parallelism" in a for a in alts)
    p = get_preset(preset)
    for t in map(int, alts[0].split()[1].split(" or ")[0:1]):
        assert (p.moe_intermediate // t) % 128 == 0
        _convert_pads(p, "fp8-block", t, 1, 1, True)  # does not raise


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp4-mxfp8"])
@pytest.mark.parametrize("tp, ranks", [(4, [736, 736, 736, 672]), (8, [384] * 7 + [192])])
def test_gpt_oss_mxfp4_uneven_whole_block_shards_get_a_recommendation(o, fmt, tp, ranks):
    s = run("gpt-oss-120b", fmt, tp, o)
    rec = s.attrs["recommendation"]
    assert s.attrs["rank_intermediates"] == ranks and rec is not None, s.attrs["no_recommendation"]
    row = next(r for r in s.rows if r["recommended"])
    assert all(row[c] > 0 for c in s.tcols)
    # every rank's shape has tactics: the row's count is the least over ranks, each asked
    for inter in {rec["intermediate"], rec["intermediate_last"]}:
        for t in s.attrs["tokens"]:
            assert o.query(fmt, "swiglu", rec["hidden"], inter, 128, 4, t).count >= row[f"t{t}"] > 0
    want = {(rec["intermediate"], rec["hidden"]), (rec["intermediate_last"], rec["hidden"])}
    assert (
        _convert_pads(get_preset("gpt-oss-120b"), fmt, tp, rec["inter_align"], rec["hidden_align"], row["reference"])
        == want
    )


def test_hopper_runs_cutlass_and_reports_its_alignments(o):
    s = run("nemotron3-nano", "fp8", 4, o, gpu="h200")
    assert s.attrs["backend"] == "cutlass" and s.tcols == [] and s.attrs["source"]["kind"] == "none"
    assert s.attrs["cutlass_alignments"] == {"inter_align": 128, "hidden_align": 1}  # non-gated FP8
    rec = s.attrs["recommendation"]
    assert rec["intermediate"] % 128 == 0 and rec["min_tactics"] is None
    assert _convert_pads(
        get_preset("nemotron3-nano"), "fp8", 4, rec["inter_align"], rec["hidden_align"], True, "cutlass"
    )
    with pytest.raises(FimoeError, match="only on SM100-family"):
        run("nemotron3-nano", "fp8", 4, o, gpu="h200", backend="trtllm")


def test_cost_model_against_a_hand_computation():
    g = get_gpu("b200")
    # decode (T=1, top-8 of 128): 8 experts read, 3 * 128 * 2048 bf16 values each
    t1 = layer_time_us(g, "bf16", "swiglu", 128, 2048, 128, 8, 1, [8, 16])
    touched = 128 * (1 - (1 - 8 / 128) ** 1)
    assert t1 == pytest.approx(1e6 * touched * 3 * 128 * 2048 * 2 / 8.0e12)
    # prefill: 16384 tokens, m = 1024 tokens per expert, tile 256 fits exactly; compute-bound
    t = layer_time_us(g, "bf16", "swiglu", 128, 2048, 128, 8, 16384, [96, 256])
    flops = 2 * 16384 * 8 * 3 * 128 * 2048
    touched = 128 * (1 - (1 - 8 / 128) ** 16384)
    m = 16384 * 8 / touched
    eff = max(m / (math.ceil(m / x) * x) for x in (96, 256))
    assert t == pytest.approx(max(1e6 * flops / (2.25e15 * eff), 1e6 * touched * 3 * 128 * 2048 * 2 / 8e12))
    assert layer_time_us(g, "bf16", "swiglu", 128, 2048, 128, 8, 8, []) is None
    assert get_gpu("h200").peak("fp4") == GPUS["h200"].flops["fp8"]  # no FP4 on Hopper


def test_byo_model_matches_the_preset(o):
    p = get_preset("qwen3-30b-a3b")
    cfg = {
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "hidden_act": "silu",
    }
    m = model_from_config(cfg)
    assert (m.hidden, m.moe_intermediate, m.experts, m.top_k, m.activation) == (2048, 768, 128, 8, "swiglu")
    nested = model_from_config({"text_config": {**cfg, "hidden_act": "gelu_pytorch_tanh"}})
    assert nested.activation == "geglu" and nested.experts == 128
    a = sweep(p, "nvfp4", 8, o).attrs["recommendation"]
    b = sweep(model_from_sizes(2048, 768, 128, 8, "swiglu"), "nvfp4", 8, o).attrs["recommendation"]
    assert a == b


def test_byo_checkpoint_and_config_file(tmp_path):
    from fimoe_lab.checkpoints import open_checkpoint
    from fimoe_lab.resources import sample_path

    path = sample_path("mixtral-bf16")
    ck = open_checkpoint(path)
    m = model_from_checkpoint(path)
    assert (m.hidden, m.moe_intermediate, m.experts, m.top_k) == (ck.hidden, ck.intermediate, ck.num_experts, ck.top_k)
    ck.close()
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    c = model_from_config(tmp_path / "config.json")
    assert (c.hidden, c.moe_intermediate, c.experts, c.top_k) == (m.hidden, m.moe_intermediate, m.experts, m.top_k)


def test_cli_tune_weighted_profile_gpu_and_json(capsys, tmp_path):
    from fimoe_lab.cli import main

    out = tmp_path / "t.json"
    argv = [
        "tune",
        "--hidden",
        "2048",
        "--intermediate",
        "768",
        "--experts",
        "128",
        "--top-k",
        "8",
        "--format",
        "bf16",
        "--tp",
        "8",
        "--tokens",
        "1:6,512:3,4096:1",
        "--gpu",
        "h200",
        "--source",
        "model",
        "--json-out",
        str(out),
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "recommended: intermediate -> 96" in text and "H200" in text and "not measurements" in text
    assert "CUTLASS" in text and "--measure" in text
    d = json.loads(out.read_text())
    assert d["attrs"]["weights"] == [6.0, 3.0, 1.0] and all("predicted_us" in r for r in d["rows"])
    assert not any("measured_us" in r for r in d["rows"]) and "not measurements" in d["attrs"]["estimate"]
    assert "Blackwell" in d["attrs"]["sm100_timing"]
    assert main(["tune", "--format", "bf16", "--source", "snapshot"]) == 2
    assert "--hidden" in capsys.readouterr().err


def test_cli_gpu_choices_are_the_cost_table():
    from fimoe_lab.cli.tune import GPU_NAMES

    assert set(GPU_NAMES) == set(GPUS)


def test_cost_model_without_tiles_and_with_calibration_constants():
    from dataclasses import replace

    g = get_gpu("h200")
    assert not g.trtllm_gen and get_gpu("b300").trtllm_gen  # SM90 runs CUTLASS, the SM100 family TRTLLM-Gen
    # CUTLASS (tiles None): no tile term; decode reads the 8 touched experts' bf16 weights
    t1 = layer_time_us(g, "bf16", "swiglu", 128, 2048, 128, 8, 1, None)
    assert t1 == pytest.approx(1e6 * 8 * 3 * 128 * 2048 * 2 / 4.8e12)
    slow = replace(g, bw_eff=0.5, flops_eff=0.25, overhead_us=10.0)
    assert layer_time_us(slow, "bf16", "swiglu", 128, 2048, 128, 8, 1, None) == pytest.approx(10.0 + 2 * t1)
    t = layer_time_us(g, "bf16", "swiglu", 128, 2048, 128, 8, 16384, None)
    assert layer_time_us(slow, "bf16", "swiglu", 128, 2048, 128, 8, 16384, None) == pytest.approx(10.0 + 4 * t)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_kimi_k2_thinking_mxint4_recommends_its_unpadded_shards(o, tp):
    """MxInt4 pads nothing: each TP's recommendation is the shard itself, with the recorded-FlashInfer counts
    (test_tune_validity) at every T, and convert's real plan lays it out at that size."""
    s = run("kimi-k2", "mxint4", tp, o)
    rec, inter = s.attrs["recommendation"], 2048 // tp
    assert s.attrs["backend"] == "trtllm" and s.attrs["source"]["kind"] == "model"
    assert s.attrs["reference"] == {"inter_align": 1, "hidden_align": 1} and s.attrs["cutlass_alignments"] == {}
    assert (rec["intermediate"], rec["intermediate_last"], rec["hidden"]) == (inter, inter, 7168)
    assert rec["extra_bytes_pct"] == 0 and rec["full"] and all(r["intermediate"] == inter for r in s.rows)
    row = next(r for r in s.rows if r["recommended"])
    want = [o.query("mxint4", "swiglu", 7168, inter, 384, 8, t).count for t in s.attrs["tokens"]]
    assert [row[c] for c in s.tcols] == want and min(want) >= 48  # 72/48 at I 256, 144/80 above
    assert _convert_pads(get_preset("kimi-k2"), "mxint4", tp, rec["inter_align"], rec["hidden_align"], True) == {
        (inter, 7168)
    }


def test_kimi_k2_thinking_mxint4_refuses_what_convert_refuses(o):
    s = run("kimi-k2", "mxint4", 16, o)  # 128 per rank: kernels exist, convert (vLLM) pads nothing
    assert s.attrs["recommendation"] is None and all(r["min_tactics"] > 0 for r in s.rows)
    assert "intermediate 128 is not a multiple of 256" in s.attrs["no_recommendation"]
    assert s.attrs["alternatives"][0] == "--tp 1 or 2 or 4 or 8 (shards convert accepts)"
    with pytest.raises(FimoeError, match="not a multiple of 256"):
        _convert_pads(get_preset("kimi-k2"), "mxint4", 16, 1, 1, True)
    relu2 = run("nemotron3-nano", "mxint4", 1, o)  # ReLU^2: the op answers (as SwiGLU), convert refuses
    assert relu2.attrs["recommendation"] is None and "SwiGLU (gated) layers only" in relu2.attrs["no_recommendation"]
    assert any(r["min_tactics"] for r in relu2.rows) and not any(r["recommended"] for r in relu2.rows)
    with pytest.raises(FimoeError, match="mxint4 runs on TRT-LLM only .*h200 \\(SM90\\) runs CUTLASS"):
        run("kimi-k2", "mxint4", 8, o, gpu="h200")
    with pytest.raises(FimoeError, match="mxint4 has no cutlass layout"):
        run("kimi-k2", "mxint4", 8, o, backend="cutlass")


def test_cli_tune_kimi_k2_mxint4_json_and_hopper_refusal(capsys):
    from fimoe_lab.cli import main

    assert main(["tune", "--model", "kimi-k2", "--format", "mxint4", "--tp", "8", "--json", "--source", "model"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["attrs"]["source"]["kind"] == "model" and d["attrs"]["format"] == "mxint4"
    assert all(isinstance(r[f"t{t}"], int) for r in d["rows"] for t in d["attrs"]["tokens"])
    assert [d["rows"][0][f"t{t}"] for t in (1, 4096)] == [72, 48]
    assert d["attrs"]["recommendation"]["intermediate"] == 256 and d["attrs"]["recommendation"]["hidden"] == 7168
    assert main(["tune", "--model", "kimi-k2", "--format", "mxint4", "--gpu", "h100", "--source", "model"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "mxint4 runs on TRT-LLM only" in err[0] and "(fix: pick a Blackwell --gpu" in err[0]


@pytest.mark.parametrize(
    ("quantization_config", "method", "intermediate"),
    [
        ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}, "compressed-tensors", 128),
        ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "modelopt", 64),
        ({"quant_method": "gptq"}, None, 64),
        (None, None, 64),
    ],
)
def test_config_quantization_method_reaches_the_engine_rules(quantization_config, method, intermediate):
    """tune --config reads quantization_config.quant_method (conventions.config_quant_method, top level or
    text_config) and pads as the engine pads that method's layers: SGLang 0.5.23 pads compressed-tensors NVFP4 to
    I 128 on TRT-LLM, ModelOpt NVFP4 to 64."""
    from fimoe_lab.shapes import default_alignments
    from fimoe_lab.tune.sweep import reference_alignments

    cfg = {"hidden_size": 2048, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8}
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    for config in (cfg, {"text_config": cfg}):
        m = model_from_config(config)
        assert m.quant_method == method
        got = reference_alignments(m, "nvfp4", engine="sglang-0.5.23")
        assert got == default_alignments("nvfp4", "trtllm", engine="sglang-0.5.23", quant_method=method)
        assert got[0] == intermediate


def test_checkpoint_quantization_method_comes_from_its_convention():
    from fimoe_lab.resources import sample_path

    assert model_from_checkpoint(sample_path("deepseek-r1-nvfp4")).quant_method == "modelopt"
    assert model_from_checkpoint(sample_path("deepseek-v3-fp8")).quant_method == "fp8"
    assert model_from_checkpoint(sample_path("mixtral-bf16")).quant_method is None
