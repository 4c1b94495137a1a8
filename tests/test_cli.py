"""The command line: main job, plan tracing, goldens, help."""

import subprocess
import sys

from fimoe_lab.cli import main


def test_demo_main_job_round_trips_every_sample(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "every round trip exact" in out and "MISMATCH" not in out
    for sample in ("deepseek-v3-fp8", "deepseek-r1-nvfp4", "gpt-oss-mxfp4", "mixtral-bf16", "qwen3-moe-bf16"):
        assert f"{sample:<20}" in out
    assert "dead expert" in out
    assert len(list(tmp_path.glob("*.safetensors"))) >= 10


def test_plan_traces_a_byte_and_checks_every_format(capsys):
    assert main(["plan", "--format", "mxfp8", "--backend", "trtllm", "--intermediate", "96", "--hidden", "160",
                 "--where", "5,3"]) == 0
    out = capsys.readouterr().out
    assert "input of swap_w13_to_w31" in out and "pad_projections" in out
    assert main(["plan"]) == 0
    assert "all round trips exact" in capsys.readouterr().out


def test_bad_arguments_print_a_clear_error(capsys):
    assert main(["plan", "--format", "fp8-block", "--intermediate", "100", "--backend", "trtllm"]) == 0
    assert "not a multiple of the 128-row scale block" in capsys.readouterr().out


def test_module_entry_point_and_help():
    out = subprocess.run([sys.executable, "-m", "fimoe_lab", "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("demo", "plan", "goldens", "inspect", "convert", "restore"):
        assert command in out
