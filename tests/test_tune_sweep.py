"""Alignment sweeps against the snapshot: fixed rules vs the recommendation."""
import json

import pytest

pd = pytest.importorskip("pandas")

from fimoe_lab.tune.oracle import TacticOracle  # noqa: E402
from fimoe_lab.tune.sweep import paddings, reference_rule, summary, sweep, export  # noqa: E402
from fimoe_lab.tune.timing import measure_transform, timing_status  # noqa: E402
from fimoe_lab.presets import get_preset  # noqa: E402


@pytest.fixture(scope="module")
def o():
    return TacticOracle(mode="snapshot")


def ref_row(df):
    return df[df.reference].iloc[0]


def test_reference_rules():
    assert reference_rule("swiglu", "bf16") == (16, 256)
    assert reference_rule("relu2", "nvfp4") == (128, 256)
    assert reference_rule("relu2", "nvfp4", per_token=True) == (128, 512)
    assert reference_rule("swiglu", "nvfp4", per_token=True) == (16, 256)
    assert reference_rule("swiglu", "mxfp8") == (128, 256)


def test_paddings_are_per_projection_and_per_rank():
    ps = paddings(get_preset("qwen3-30b-a3b"), 8)
    assert {p.intermediate for p in ps} == {96}
    assert {(p.inter_align, p.padded_intermediate) for p in ps} >= {(16, 96), (64, 128), (256, 256)}


@pytest.mark.parametrize("fmt", ["bf16", "fp8-block", "nvfp4", "mxfp8"])
def test_qwen3_30b_tp8_fixed_rule_gives_zero(o, fmt):
    df = sweep("qwen3-30b-a3b", fmt, 8, o)
    # local intermediate 96; MXFP8's rule (128) keeps some tactics but not all
    assert ref_row(df).flag.startswith("fewer" if fmt == "mxfp8" else "ZERO")
    rec = df.attrs["recommendation"]
    assert rec["full"] and rec["intermediate"] >= 128 and df[df.recommended].min_tactics.iloc[0] > 0


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_gpt_oss_16_aligned_gives_zero(o, tp):
    df = sweep("gpt-oss-120b", "mxfp4", tp, o)
    assert ref_row(df).min_tactics == 0
    assert df.attrs["recommendation"]["intermediate"] % 64 == 0


def test_recommendation_is_full_at_least_waste(o):
    df = sweep("nemotron3-nano", "nvfp4", 1, o)
    rec = df[df.recommended].iloc[0]
    assert rec.full
    assert rec.extra_bytes_pct == df[df.full].extra_bytes_pct.min()
    tcols = [c for c in df.columns if c[:1] == "t" and c[1:].isdigit()]
    assert (df[tcols].max() == df.loc[df.recommended, tcols].iloc[0]).all()


def test_export_and_summary(o, tmp_path):
    df = sweep("minimax-m2", "fp8-block", 8, o)
    text = summary(df)
    assert "recommended:" in text and "reference rule" in text and "snapshot" in text
    export(df, str(tmp_path / "s.csv"))
    export(df, str(tmp_path / "s.json"))
    d = json.loads((tmp_path / "s.json").read_text())
    assert d["attrs"]["preset"] == "minimax-m2" and len(d["rows"]) == len(df)
    assert pd.read_csv(tmp_path / "s.csv").shape[0] == len(df)


def test_plots_lazy_matplotlib(o, tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    from fimoe_lab.tune.sweep import plot_heatmap, plot_waste_vs_tactics
    df = sweep("deepseek-v3", "nvfp4", 8, o, tokens=(1, 512))
    plot_heatmap(df).figure.savefig(tmp_path / "h.png")
    plot_waste_vs_tactics(df).figure.savefig(tmp_path / "w.png")
    assert (tmp_path / "h.png").stat().st_size > 1000


def test_timing_hook_says_not_measured_without_gpu(o):
    import torch
    from fimoe_lab.tune.timing import measure_grouped_mm
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    assert timing_status().startswith("not measured on this device")
    with pytest.raises(RuntimeError, match="not measured on this device"):
        measure_grouped_mm(sweep("qwen3-30b-a3b", "bf16", 8, o, tokens=(1,)))


def test_cli_tune_prints_table(capsys):
    from fimoe_lab.cli import main
    assert main(["tune", "--model", "qwen3-30b-a3b", "--format", "nvfp4", "--tp", "8", "--source", "snapshot"]) == 0
    out = capsys.readouterr().out
    assert "ZERO tactics" in out and "recommended: intermediate -> 128" in out


def test_cli_tactics_json(capsys):
    from fimoe_lab.cli import main
    assert main(["tactics", "--format", "nvfp4", "--act", "swiglu", "--per-token", "--hidden", "3072",
                 "--inter", "1920", "--experts", "128", "--top-k", "6", "--tokens", "1,8,64", "--json",
                 "--source", "snapshot"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [d["count"] for d in out] == [528, 528, 528]
    assert out[0]["per_tile"] == {"8": 144, "16": 192, "32": 192}
    assert out[0]["source"]["kind"] == "snapshot"
    assert main(["tactics", "--format", "nvfp4", "--act", "swiglu", "--hidden", "3072", "--inter", "1872",
                 "--experts", "128", "--top-k", "6", "--tokens", "8", "--json", "--source", "snapshot"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out[0]["count"] == 0 and out[0]["reason"]


def test_transform_cost_is_measured_per_padding_on_the_cpu():
    o = TacticOracle(mode="snapshot")
    df = sweep("qwen3-30b-a3b", "bf16", 8, o, tokens=(1,))
    timed = measure_transform(df, experts=2, repeats=2)
    padded = timed[(timed.inter_align == 128) & (timed.hidden_align == 1)].iloc[0]
    assert padded.transform_ms > 0 and padded.transform_note == ""
    assert timed.attrs["transform_experts"] == 2 and timed.attrs["transform_device"] == "cpu"
    nvfp4 = measure_transform(sweep("qwen3-30b-a3b", "nvfp4", 8, o, tokens=(1,)), experts=2, repeats=1)
    unaligned = nvfp4[(nvfp4.inter_align == 16) & (nvfp4.hidden_align == 1)].iloc[0]  # 2*96 scale rows
    assert "not a multiple of 128" in unaligned.transform_note and unaligned.transform_ms != unaligned.transform_ms
