"""--engine reaches convert, inspect, plan and tune, and converted files record the profile."""

import json

import pytest
from helpers import all_tensors, same_tensor
from safetensors import safe_open

from fimoe_lab import engines
from fimoe_lab.cli import main
from fimoe_lab.resources import sample_path


def _meta(path):
    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["fimoe_lab"])


@pytest.mark.parametrize(("engine", "padded"), [("vllm-0.34", 128), ("flashinfer-0.6.13", 64)])
def test_convert_records_the_engine_and_pads_as_it_says(tmp_path, engine, padded, capsys):
    # Mixtral sample: intermediate 464, so a TP-8 shard holds 58 rows per projection; vLLM 0.34
    # pads BF16 TRT-LLM intermediates to 128, FlashInfer 0.6.13's helpers to 64.
    out = tmp_path / "k.safetensors"
    args = ["convert", "mixtral-bf16", str(out), "--backend", "trtllm", "--tp", "8", "--engine", engine]
    assert main(args) == 0
    layer = next(iter(_meta(out)["layers"].values()))
    assert layer["plan"]["args"]["engine"] == engine
    assert layer["padded_intermediate"] == padded
    restored = tmp_path / "r"
    assert main(["restore", str(out), str(restored)]) == 0
    src, back = all_tensors(sample_path("mixtral-bf16")), all_tensors(restored)
    # the restored expert tensors are rank 0's slice of the source, byte for byte
    for name, t in back.items():
        full = src[name]
        rows = full.shape[0] // 8 if name.endswith(("w1.weight", "w3.weight")) else full.shape[0]
        cols = full.shape[1] // 8 if name.endswith("w2.weight") else full.shape[1]
        assert same_tensor(t, full[:rows, :cols].contiguous()), name


def test_default_engine_is_the_newest_vllm(tmp_path):
    out = tmp_path / "k.safetensors"
    assert main(["convert", "mixtral-bf16", str(out), "--backend", "trtllm", "--tp", "8"]) == 0
    layer = next(iter(_meta(out)["layers"].values()))
    assert layer["plan"]["args"]["engine"] == engines.DEFAULT_ENGINE == "vllm-0.34"


def test_inspect_and_plan_follow_the_engine(capsys):
    assert main(["inspect", "mixtral-bf16", "--tp", "8", "--engine", "flashinfer-0.6.13"]) == 0
    old = capsys.readouterr().out
    assert main(["inspect", "mixtral-bf16", "--tp", "8", "--engine", "vllm-0.34"]) == 0
    new = capsys.readouterr().out
    assert "I 58->64" in old and "I 58->128" in new
    assert (
        main(["plan", "--format", "bf16", "--backend", "trtllm", "--intermediate", "58", "--engine", "vllm-0.34"]) == 0
    )
    wide = capsys.readouterr().out
    assert (
        main(
            ["plan", "--format", "bf16", "--backend", "trtllm", "--intermediate", "58", "--engine", "flashinfer-0.6.13"]
        )
        == 0
    )
    narrow = capsys.readouterr().out
    assert wide != narrow


def test_unknown_engine_is_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit) as info:
        main(["plan", "--engine", "vllm-9"])
    assert info.value.code == 2
    assert "vllm-0.34" in capsys.readouterr().err


def test_tune_reference_row_is_the_engines_convert_default():
    pytest.importorskip("pandas")
    from fimoe_lab.tune.oracle import TacticOracle
    from fimoe_lab.tune.sweep import sweep

    refs = {}
    for engine in ("vllm-0.34", "flashinfer-0.6.13"):
        df = sweep("qwen3-30b-a3b", "bf16", 8, oracle=TacticOracle("snapshot"), engine=engine)
        row = df[df["reference"]].iloc[0]
        refs[engine] = (int(row.inter_align), int(row.intermediate))
        assert df.attrs["engine"] == engine
    assert refs == {"vllm-0.34": (128, 128), "flashinfer-0.6.13": (64, 128)}


def test_plan_per_token_pads_a_non_gated_nvfp4_hidden_to_512(capsys):
    args = ["plan", "--format", "nvfp4", "--backend", "trtllm", "--intermediate", "640", "--hidden", "2688"]
    assert main([*args, "--non-gated", "--per-token", "--experts", "1"]) == 0
    out = capsys.readouterr().out
    assert "per-token NVFP4 activations" in out and "(3072, 320)" in out  # vLLM: 2688 -> 3072
    assert main([*args, "--non-gated", "--experts", "1"]) == 0
    assert "(2816, 320)" in capsys.readouterr().out  # 256 without per-token


@pytest.mark.parametrize("engine", ["vllm-0.34", "flashinfer-0.6.13"])
def test_plan_checks_cutlass_scales_against_the_engine_layout(engine, capsys):
    args = ["plan", "--backend", "cutlass", "--intermediate", "96", "--hidden", "160", "--experts", "2"]
    assert main([*args, "--format", "mxfp8", "--engine", engine]) == 0
    assert f"vs the engine layout ({engine}, independent formula): exact" in capsys.readouterr().out


def test_demo_checks_written_cutlass_scales_against_the_engine_layout(tmp_path, capsys):
    assert main(["demo", "deepseek-r1-nvfp4", "--out", str(tmp_path)]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if " cutlass " in r]
    assert rows and all("scales = engine layout" in r for r in rows)
