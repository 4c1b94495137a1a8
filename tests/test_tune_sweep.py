"""Alignment sweeps against the snapshot: convert's default padding vs the recommendation."""

import json

import numpy as np
import pytest

pd = pytest.importorskip("pandas")

from fimoe_lab.errors import FimoeError  # noqa: E402
from fimoe_lab.presets import PRESETS, get_preset  # noqa: E402
from fimoe_lab.recipes import default_alignments, plan_layer  # noqa: E402
from fimoe_lab.specs import FORMATS, get_activation, tuner_formats  # noqa: E402
from fimoe_lab.tune.oracle import TacticOracle  # noqa: E402
from fimoe_lab.tune.sweep import (  # noqa: E402
    HIDDEN_ALIGNS,
    INTER_ALIGNS,
    TPS,
    export,
    multiples,
    paddings,
    queries_for,
    reference_alignments,
    run,
    summary,
    sweep,
    table,
)
from fimoe_lab.tune.timing import measure_transform, timing_status  # noqa: E402


@pytest.fixture(scope="module")
def o():
    return TacticOracle(mode="snapshot")


def ref_row(df):
    return df[df.reference].iloc[0]


@pytest.mark.parametrize(
    "preset, fmt, expected",
    [
        ("qwen3-30b-a3b", "bf16", (64, 64)),  # whole 128-byte K blocks of BlockMajorK
        ("qwen3-30b-a3b", "nvfp4", (64, 1)),  # 2 x 64 rows: the 128-row scale shuffle
        ("nemotron3-nano", "nvfp4", (128, 1)),  # non-gated: one projection of 128 rows
        ("qwen3-30b-a3b", "fp8", (16, 1)),
        ("nemotron3-nano", "fp8", (128, 1)),
        ("deepseek-v3", "fp8-block", (1, 1)),
        ("deepseek-v3", "mxfp8", (128, 256)),
        ("gpt-oss-120b", "mxfp4", (256, 256)),
        ("gpt-oss-120b", "mxfp4-mxfp8", (256, 256)),  # mxfp4's layout recipe
    ],
)
def test_reference_is_what_convert_pads_to(o, preset, fmt, expected):
    p = get_preset(preset)
    act = get_activation(p.activation)
    # the default belongs to the recipes (engine profiles): one shared function, not a copy
    expected = default_alignments(FORMATS[fmt].plan_format, "trtllm", act.is_act_and_mul, act.gated)
    assert reference_alignments(p, fmt) == expected
    df = sweep(preset, fmt, 1, o, tokens=(1,))
    ref = df[df.reference]
    assert len(ref) == 1 and (ref.inter_align.iloc[0], ref.hidden_align.iloc[0]) == expected
    assert df.attrs["reference"] == {"inter_align": expected[0], "hidden_align": expected[1]}
    act = get_activation(p.activation)
    default = plan_layer(
        FORMATS[fmt].plan_format, "trtllm", p.moe_intermediate, p.hidden, act.is_act_and_mul, act.gated
    )  # the plan convert builds without alignment options
    assert (ref.intermediate.iloc[0], ref.hidden.iloc[0]) == (default.padded_intermediate, default.padded_hidden)


def test_the_default_pair_joins_the_grid_once():
    p = get_preset("qwen3-30b-a3b")
    grid = len(INTER_ALIGNS) * len(HIDDEN_ALIGNS)
    ref = reference_alignments(p, "bf16")
    assert ref[1] not in HIDDEN_ALIGNS  # bf16's hidden alignment (64) is off the grid
    assert ref not in {(ia, ha) for ia in INTER_ALIGNS for ha in HIDDEN_ALIGNS}
    bf16 = [(a.inter_align, a.hidden_align) for a in paddings(p, 8, fmt="bf16")]
    assert len(bf16) == grid + 1 and bf16[-1] == ref and bf16.count(ref) == 1


def test_the_model_answers_every_sweep_query(o):
    """Every row of every preset's sweep (TP 1 and 8), the default pair and every rank shape included, gets a count."""
    unknown = []
    for p in PRESETS.values():
        for fmt in tuner_formats():
            for tp in (TPS[0], TPS[-1]):
                try:
                    qs = queries_for(p, fmt, tp)
                except FimoeError:  # the reader cannot shard it: the sweep has no rows to ask about
                    continue
                unknown += [q.key() for q in qs if o.ask(q).count is None]
    assert unknown == []


def test_paddings_are_per_projection_and_per_rank():
    ps = paddings(get_preset("qwen3-30b-a3b"), 8)
    assert {p.intermediate for p in ps} == {96}
    assert {(p.inter_align, p.padded_intermediate) for p in ps} >= {(16, 96), (64, 128), (256, 256)}


@pytest.mark.parametrize("fmt, flag", [("bf16", "fewer"), ("fp8-block", "ZERO"), ("nvfp4", ""), ("mxfp8", "fewer")])
def test_qwen3_30b_tp8_default_padding(o, fmt, flag):
    df = sweep("qwen3-30b-a3b", fmt, 8, o)
    if fmt == "fp8-block":  # 96 splits the 128-row scale block: the reader refuses the shard, no rows
        assert len(df) == 0 and df.attrs["recommendation"] is None
        assert "convert refuses this TP shard" in df.attrs["no_recommendation"]
        assert any("--tp" in alt for alt in df.attrs["alternatives"])
        return
    # local intermediate 96: 16-aligned has no tactic at all; convert's default keeps some
    # (bf16 128, mxfp8 128), none (fp8-block: no padding) or all of them (nvfp4 128)
    assert df[(df.inter_align == 16) & (df.hidden_align == 256)].min_tactics.iloc[0] == 0
    ref = ref_row(df)
    assert ref.flag.startswith(flag) and bool(ref.flag) == bool(flag)
    assert (ref.min_tactics == 0) == (flag == "ZERO") and ref.full == (flag == "")
    rec = df.attrs["recommendation"]
    if fmt == "fp8-block":  # 96 splits the 128-row scale block: no padding convert applies
        assert rec is None and "convert refuses this TP shard" in df.attrs["no_recommendation"]
        assert any("--tp" in alt for alt in df.attrs["alternatives"])
    else:
        assert rec["intermediate"] >= 128 and df[df.recommended].min_tactics.iloc[0] > 0


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_gpt_oss_16_aligned_gives_zero_and_the_default_keeps_all(o, tp):
    df = sweep("gpt-oss-120b", "mxfp4", tp, o)
    assert df[(df.inter_align == 16) & (df.hidden_align == 256)].min_tactics.iloc[0] == 0
    assert ref_row(df).full and ref_row(df).flag == ""
    rec = df.attrs["recommendation"]  # whole-block shards (736/672, 384/192): every TP has one
    assert rec["intermediate"] % 64 == 0 and df[df.recommended].min_tactics.iloc[0] > 0


def test_recommendation_is_the_fastest_candidate(o):
    df = sweep("nemotron3-nano", "nvfp4", 1, o)
    rec = df[df.recommended].iloc[0]
    assert rec.min_tactics > 0 and rec.convert == "ok"
    assert rec.predicted_us == df[df.candidate].predicted_us.min()
    assert rec.extra_bytes_pct == df[df.candidate & (df.predicted_us == rec.predicted_us)].extra_bytes_pct.min()


def test_export_and_summary(o, tmp_path):
    df = sweep("deepseek-v3", "fp8-block", 8, o)
    text = summary(df)
    assert "recommended:" in text and "convert's default padding (no padding)" in text and "source: model" in text
    export(df, str(tmp_path / "s.csv"))
    export(df, str(tmp_path / "s.json"))
    d = json.loads((tmp_path / "s.json").read_text())
    assert d["attrs"]["preset"] == "deepseek-v3" and len(d["rows"]) == len(df)
    assert all("predicted_us" in r for r in d["rows"])
    assert pd.read_csv(tmp_path / "s.csv").shape[0] == len(df)


def test_sweep_figures_draw_the_table(o, tmp_path):
    pytest.importorskip("matplotlib")
    from fimoe_lab.viz import figures

    df = sweep("qwen3-30b-a3b", "bf16", 8, o, tokens=(1, 512))
    fig = figures.sweep_tactics_figure(df)
    drawn = np.ma.filled(fig.axes[0].images[0].get_array().astype(float), np.nan)
    assert np.array_equal(drawn, df[["t1", "t512"]].astype(float).to_numpy(), equal_nan=True)
    assert np.nanstd(drawn) > 0
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert [i for i, label in enumerate(labels) if "REF" in label] == list(np.flatnonzero(df.reference))
    ia, ha = reference_alignments(get_preset("qwen3-30b-a3b"), "bf16")
    assert labels[-1].startswith(f"I%{ia} H%{ha} (128x2048) REF")
    fig.savefig(tmp_path / "h.png")
    assert (tmp_path / "h.png").stat().st_size > 1000
    waste = figures.sweep_waste_figure(df)
    points = waste.axes[0].collections[0].get_offsets()
    assert np.allclose(points[:, 0], df.extra_bytes_pct) and np.allclose(points[:, 1], df.min_tactics.astype(float))
    same = bool(df[df.recommended].reference.iloc[0])  # ties in predicted time go to convert's default
    assert sorted(t.get_text() for t in waste.axes[0].texts) == (["REF"] if same else ["REC", "REF"])
    grid = figures.tuner_figure(df)  # hidden alignments 1, 64 (only convert's (64, 64)), 256, 512, 1024
    expect = df.pivot(index="inter_align", columns="hidden_align", values="min_tactics")
    assert list(expect.columns) == [1, 64, 256, 512, 1024]
    drawn = np.ma.filled(grid.axes[0].images[0].get_array().astype(float), np.nan)
    assert np.array_equal(drawn, expect.to_numpy(dtype=float, na_value=np.nan), equal_nan=True)
    assert len(grid.axes[0].texts) == len(df)  # a waste label per row, none on the empty cells


def test_timing_hook_says_not_measured_without_gpu(o):
    import torch

    from fimoe_lab.tune.timing import measure_grouped_mm

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    assert timing_status().startswith("not measured on this device")
    with pytest.raises(FimoeError, match="not measured on this device"):
        measure_grouped_mm(sweep("qwen3-30b-a3b", "bf16", 8, o, tokens=(1,)))


def test_cli_tune_prints_table(capsys):
    from fimoe_lab.cli import main

    assert main(["tune", "--model", "qwen3-30b-a3b", "--format", "nvfp4", "--tp", "8", "--source", "snapshot"]) == 0
    out = capsys.readouterr().out
    assert "recommended: intermediate -> 128" in out and "ZERO tactics" not in out
    ia, ha = reference_alignments(get_preset("qwen3-30b-a3b"), "nvfp4")
    assert f"convert's default padding ({multiples(ia, ha)}): intermediate 128, hidden 2048" in out
    assert "% 1 " not in out and "%1," not in out  # an alignment of 1 is no constraint: never printed as one
    assert "(full tactic space)" in out and "predicted_us" in out
    assert main(["tune", "--model", "minimax-m2", "--format", "fp8-block", "--tp", "8", "--source", "snapshot"]) == 0
    out = capsys.readouterr().out
    assert "recommended: none -- convert refuses this TP shard: tp=8 gives intermediate 192" in out


def test_cli_tactics_json(capsys):
    from fimoe_lab.cli import main

    assert (
        main(
            [
                "tactics",
                "--format",
                "nvfp4",
                "--act",
                "swiglu",
                "--per-token",
                "--hidden",
                "3072",
                "--inter",
                "1920",
                "--experts",
                "128",
                "--top-k",
                "6",
                "--tokens",
                "1,8,64",
                "--json",
                "--source",
                "snapshot",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert [d["count"] for d in out] == [528, 528, 528]
    assert out[0]["per_tile"] == {"8": 144, "16": 192, "32": 192}
    assert out[0]["source"]["kind"] == "model"
    assert (
        main(
            [
                "tactics",
                "--format",
                "nvfp4",
                "--act",
                "swiglu",
                "--hidden",
                "3072",
                "--inter",
                "1872",
                "--experts",
                "128",
                "--top-k",
                "6",
                "--tokens",
                "8",
                "--json",
                "--source",
                "snapshot",
            ]
        )
        == 0
    )
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


@pytest.mark.parametrize(
    "model,fmt,tp", [("qwen3-30b-a3b", "bf16", 8), ("deepseek-v3", "fp8-block", 4), ("gpt-oss-120b", "mxfp4", 2)]
)
def test_the_table_shows_each_padded_shape_once_with_the_alignments_that_give_it(o, model, fmt, tp):
    s = run(model, fmt, tp, o, tokens=(1, 64))
    lines = table(s).splitlines()
    head, body = lines[0].split(), [line.split() for line in lines[1:]]
    col = {c: i for i, c in enumerate(head)}
    shapes = [(r[col["intermediate"]], r[col["hidden"]]) for r in body]
    assert len(shapes) == len(set(shapes)) == len({(r["intermediate"], r["hidden"]) for r in s.rows}) < len(s.rows)
    for r in s.rows:  # every (alignment pair) is on the line of its padded shape
        (line,) = [
            b for b in body if (b[col["intermediate"]], b[col["hidden"]]) == (str(r["intermediate"]), str(r["hidden"]))
        ]
        assert str(r["inter_align"]) in line[col["inter_align"]].split(",")
        assert str(r["hidden_align"]) in line[col["hidden_align"]].split(",")
    ranks = s.attrs["rank_intermediates"]
    hidden = s.attrs["hidden"]
    for b in body:  # every pair of a line's alignments pads to its shape (I and H pad independently)
        for ia in map(int, b[col["inter_align"]].split(",")):
            for ha in map(int, b[col["hidden_align"]].split(",")):
                assert str(-(-ranks[0] // ia) * ia) == b[col["intermediate"]], (b, ia)
                assert str(-(-hidden // ha) * ha) == b[col["hidden"]], (b, ha)


def test_alignments_read_as_multiples_and_one_is_no_constraint():
    assert multiples(1, 1) == "no padding"
    assert multiples(128, 1) == "intermediate to a multiple of 128"
    assert multiples(1, 256) == "hidden to a multiple of 256"
    assert multiples(64, 512) == "intermediate to a multiple of 64, hidden to a multiple of 512"
