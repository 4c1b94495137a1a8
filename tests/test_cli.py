"""The command line: main job, plan tracing, goldens, help without heavy imports, errors and exit codes."""

import gzip
import io
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fimoe_lab.cli import main
from fimoe_lab.cli._common import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_NO_ANSWER, report_error
from fimoe_lab.cli.lab import working_copy
from fimoe_lab.errors import CheckpointError, LayoutError
from fimoe_lab.resources import notebooks_dir
from fimoe_lab.tune.validity import find_table

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("demo", "plan", "goldens", "inspect", "convert", "restore", "tune", "tactics", "lab", "warmup", "diagnose")
HEAVY = ("torch", "numpy", "pandas", "matplotlib", "safetensors")


def _run(*args, **kw):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=str(ROOT), **kw)


def _stderr_line(capsys) -> str:
    """stderr of the last call, which must be exactly one line."""
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    return lines[0]


# ----------------------------------------------------------------------------- the jobs
def test_demo_main_job_round_trips_every_sample(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "every round trip exact" in out and "MISMATCH" not in out
    for sample in ("deepseek-v3-fp8", "deepseek-r1-nvfp4", "gpt-oss-mxfp4", "mixtral-bf16", "qwen3-moe-bf16"):
        assert f"{sample:<20}" in out
    assert "dead expert" in out
    assert len(list(tmp_path.glob("*.safetensors"))) >= 10


def test_plan_traces_a_byte_and_checks_every_format(capsys):
    assert (
        main(
            [
                "plan",
                "--format",
                "mxfp8",
                "--backend",
                "trtllm",
                "--intermediate",
                "96",
                "--hidden",
                "160",
                "--where",
                "5,3",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "input of swap_w13_to_w31" in out and "pad_projections" in out
    assert main(["plan"]) == 0
    assert "all round trips exact" in capsys.readouterr().out


def test_plan_that_cannot_run_says_why_and_exits_2(capsys):
    assert main(["plan", "--format", "fp8-block", "--intermediate", "100", "--backend", "trtllm"]) == EXIT_BAD_INPUT
    captured = capsys.readouterr()
    assert "cannot run: " in captured.out and "not a multiple of the 128-row scale block" in captured.out
    (line,) = captured.err.splitlines()
    assert line.startswith("error: plan: fp8-block trtllm cannot lay out intermediate 100") and "(fix: " in line


def test_module_entry_point_and_help():
    out = _run("-m", "fimoe_lab", "--help", check=True).stdout
    for command in COMMANDS:
        assert command in out
    assert "exit status" in out


# ----------------------------------------------------------------------------- help is light and wrapped
def test_help_imports_no_heavy_module_and_wraps_at_80_columns():
    code = (
        "import argparse, contextlib, io, json, sys\n"
        "from fimoe_lab.cli import build_parser, main\n"
        "sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))\n"
        "texts = {}\n"
        "for argv in [['--help']] + [[c, '--help'] for c in sub.choices]:\n"
        "    buf = io.StringIO()\n"
        "    with contextlib.redirect_stdout(buf):\n"
        "        try:\n"
        "            main(argv)\n"
        "        except SystemExit as e:\n"
        "            assert e.code == 0, (argv, e.code)\n"
        "    texts[' '.join(argv)] = buf.getvalue()\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "print(json.dumps({'commands': list(sub.choices), 'heavy': heavy, 'texts': texts}))\n"
    )
    r = _run("-c", code, env={**__import__("os").environ, "COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["heavy"] == [] and sorted(got["commands"]) == sorted(COMMANDS)
    for argv, text in got["texts"].items():
        assert "usage: fimoe-lab" in text, argv
        too_long = [line for line in text.splitlines() if len(line) > 80]
        assert not too_long, (argv, too_long)


def test_help_is_fast_and_importtime_shows_no_torch():
    times = []
    for _ in range(5):
        start = time.perf_counter()
        _run("-m", "fimoe_lab", "--help", check=True)
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    print(f"python -m fimoe_lab --help: median {median * 1e3:.0f} ms over {len(times)} runs")
    assert median < 1.5, times  # well under 0.5 s on an idle machine; generous for a loaded CI
    report = _run("-X", "importtime", "-m", "fimoe_lab", "--help").stderr
    imported = [line.split("|")[-1].strip() for line in report.splitlines()]
    assert "fimoe_lab.cli" in imported and not [m for m in imported if m.split(".")[0] in HEAVY]


# ----------------------------------------------------------------------------- exit codes, one line each
def test_unknown_sample_path_is_bad_input(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope")]) == EXIT_BAD_INPUT
    line = _stderr_line(capsys)
    assert (
        line.startswith("error: inspect: ")
        and "does not exist (not a checkpoint directory, its config.json or a sample; samples: " in line
    )


def test_bad_where_is_a_usage_error_or_bad_input(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--format", "mxfp8", "--backend", "trtllm", "--where", "5,x"])
    assert exit_.value.code == 2
    assert "--where takes comma-separated integers >= 0 like 5,3, got '5,x'" in capsys.readouterr().err
    assert (
        main(
            [
                "plan",
                "--format",
                "mxfp8",
                "--backend",
                "trtllm",
                "--intermediate",
                "96",
                "--hidden",
                "160",
                "--where",
                "500,3",
            ]
        )
        == EXIT_BAD_INPUT
    )
    line = _stderr_line(capsys)
    assert line == (
        "error: plan --where on mxfp8 trtllm w13: coordinate (500, 3) is outside the output shape (256, 256) (bytes)"
    )


def test_impossible_alignment_is_bad_input(tmp_path, capsys):
    out = tmp_path / "k.safetensors"
    assert (
        main(
            [
                "convert",
                "deepseek-r1-nvfp4",
                str(out),
                "--backend",
                "trtllm",
                "--intermediate-alignment",
                "24",
                "--no-progress",
            ]
        )
        == EXIT_BAD_INPUT
    )
    line = _stderr_line(capsys)
    assert line.startswith("error: convert: layer 0 (nvfp4") and "cannot be laid out for trtllm" in line
    assert not out.exists()


def test_goldens_with_nothing_to_replay_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FIMOE_GOLDENS", str(tmp_path))  # an empty folder
    assert main(["goldens"]) == EXIT_BAD_INPUT
    assert _stderr_line(capsys).startswith("error: goldens: ")
    assert main(["goldens", str(tmp_path / "missing.json")]) == EXIT_BAD_INPUT
    line = _stderr_line(capsys)
    assert line.startswith("error: goldens: ") and "missing.json" in line


@pytest.mark.flashinfer  # the installed FlashInfer's version decides the answer
def test_tune_with_counts_the_source_does_not_know_exits_3(tmp_path, monkeypatch, capsys):
    pytest.importorskip("pandas")
    # only a kernel table of another FlashInfer is shipped: the installed one's answers are unknown
    with gzip.open(find_table().path, "rt") as f:
        raw = json.load(f)
    raw["meta"].update(flashinfer="0.0.1", kernel_set="batched_gemm-0-0@0000000000000000")
    with gzip.open(tmp_path / "kernels-fi0.0.1-000000000000.json.gz", "wt") as f:
        json.dump(raw, f)
    monkeypatch.setenv("FIMOE_LAB_TACTICS_DIR", str(tmp_path))
    argv = ["tune", "--model", "deepseek-v3", "--format", "bf16", "--tp", "8", "--source", "model", "--tokens", "1,8"]
    assert main(argv) == EXIT_NO_ANSWER
    (line,) = capsys.readouterr().err.splitlines()
    unknown = re.match(r"no answer: (\d+) of (\d+) tactic counts are unknown to this source \(the installed", line)
    assert unknown and unknown[1] == unknown[2], line
    assert "kernel set is not shipped (shipped: FlashInfer 0.0.1" in line


def test_tune_at_a_million_tokens_is_answered(capsys):
    pytest.importorskip("pandas")
    argv = [
        "tune",
        "--model",
        "deepseek-v3",
        "--format",
        "bf16",
        "--tp",
        "8",
        "--source",
        "model",
        "--tokens",
        "1,1000000",
    ]
    assert main(argv) == 0
    assert "no answer" not in capsys.readouterr().err


def test_debug_prints_the_traceback_before_or_after_the_command(tmp_path, capsys):
    for argv in (["--debug", "inspect", str(tmp_path / "nope")], ["inspect", str(tmp_path / "nope"), "--debug"]):
        assert main(argv) == EXIT_BAD_INPUT
        err = capsys.readouterr().err
        assert err.startswith("Traceback (most recent call last):") and "FileNotFoundError" in err
        assert err.splitlines()[-1].startswith("error: inspect: ")


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == EXIT_BAD_INPUT
    assert "usage: fimoe-lab" in capsys.readouterr().out


# ----------------------------------------------------------------------------- the error printer
def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:  # noqa: B036 - the point is to carry a real traceback
        return caught


def _report(exc: BaseException, command="plan", debug=False) -> tuple[int, str]:
    stream = io.StringIO()
    return report_error(_raised(exc), command, debug, stream), stream.getvalue()


def test_internal_error_is_one_line_exit_1_and_debug_shows_the_traceback():
    code, text = _report(RuntimeError("boom\n  on two lines"))
    assert code == EXIT_FAILED
    assert text == "internal error: RuntimeError: boom on two lines (run with --debug for the traceback)\n"
    code, text = _report(RuntimeError("boom"), debug=True)
    assert code == EXIT_FAILED
    lines = text.splitlines()
    assert lines[0] == "Traceback (most recent call last):" and "_raised" in text
    assert lines[-1] == "internal error: RuntimeError: boom"


def test_bad_input_errors_name_their_context_once():
    assert _report(LayoutError("I 100 is not a multiple of 128", fix="pad it")) == (
        EXIT_BAD_INPUT,
        "error: plan: I 100 is not a multiple of 128 (fix: pad it)\n",
    )
    assert _report(CheckpointError("bad file", fix="rewrite it").within("restore x.safetensors")) == (
        EXIT_BAD_INPUT,
        "error: restore x.safetensors: bad file (fix: rewrite it)\n",
    )
    missing = _raised(FileNotFoundError(2, "No such file or directory", "/no/such/file"))
    assert _report(missing, "goldens") == (
        EXIT_BAD_INPUT,
        "error: goldens: No such file or directory: /no/such/file (fix: check the path)\n",
    )
    assert _report(KeyboardInterrupt()) == (EXIT_INTERRUPTED, "interrupted\n")


# ----------------------------------------------------------------------------- the lab's working copy
def test_lab_working_copy_fills_missing_notebooks_and_keeps_edits(tmp_path):
    shipped = sorted(notebooks_dir().glob("*.ipynb"))
    assert len(shipped) >= 3
    target = tmp_path / "nb"
    target.mkdir()
    (target / shipped[0].name).write_text('{"edited": true}')
    assert working_copy(target) == target
    assert (target / shipped[0].name).read_text() == '{"edited": true}'
    for notebook in shipped[1:]:
        assert (target / notebook.name).read_bytes() == notebook.read_bytes()


@pytest.mark.parametrize(
    "argv, codes", [(["inspect", "deepseek-v3-fp8", "--json"], {141}), (["plan", "--help"], {0, 141})]
)
def test_a_closed_stdout_pipe_ends_quietly_with_141(argv, codes):
    """``fimoe-lab ... | head``: the reader went away before the output was written. Exit 141 (128 + SIGPIPE;
    argparse's help swallows the failed write itself: 0), nothing on stderr (no traceback from the write, nor
    from the flush at interpreter exit)."""
    code = (
        "import os, sys\n"
        "r, w = os.pipe(); os.close(r); os.dup2(w, 1)\n"  # stdout: a pipe nobody reads any more
        "from fimoe_lab.cli import main\n"
        f"sys.exit(main({argv!r}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode in codes and done.stderr == ""


def test_shared_options_read_the_same_in_every_command():
    """An option several commands take is defined once (cli._common) and so described alike everywhere:
    ``--json`` says what it prints and its fields, ``--per-token`` the format it applies to, ``--tp N`` its
    default, ``--no-progress``/``--progress`` the progress rule (convert and restore, word for word)."""
    import argparse

    from fimoe_lab.cli import build_parser
    from fimoe_lab.cli._common import PROGRESS_HELP

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    helps: dict[str, dict[str, str]] = {}
    for command, parser in sub.items():
        for action in parser._actions:
            for flag in action.option_strings:
                helps.setdefault(flag, {})[command] = action.help or ""
    assert set(helps["--json"]) >= {"inspect", "plan", "demo", "convert", "restore", "goldens", "tune", "tactics"}
    for command, text in helps["--json"].items():
        assert text.startswith("print the result as one JSON ") and ", nothing else: " in text, (command, text)
        assert text.split(": ", 1)[1][0] in "{[", (command, text)  # the fields follow
    assert len(helps["--per-token"]) >= 5
    for command, text in helps["--per-token"].items():
        assert text.startswith("NVFP4 activations quantised per token (NVFP4 only): "), (command, text)
    for command in ("convert", "warmup", "tune"):
        assert helps["--tp"][command].startswith("tensor-parallel size") and "(default 1)" in helps["--tp"][command]
    assert set(helps["--no-progress"]) >= {"convert", "restore"}
    assert len(set(helps["--no-progress"].values())) == 1 and PROGRESS_HELP in helps["--no-progress"]["convert"]
    assert len({helps["--progress"][c] for c in helps["--no-progress"]}) == 1
    assert not [t for f in helps.values() for t in f.values() if t.rstrip().endswith("overrides")]  # what?
