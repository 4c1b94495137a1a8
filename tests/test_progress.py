"""Progress of the long-running commands (convert, restore) on stderr, as a real user's shell sees it.

Off a terminal (a pipe, a log, nohup, CI): plain lines, no carriage return, at most one per tenth (or per 30 s),
the last at 100%, each matching :data:`fimoe_lab.cli._common.PROGRESS_LINE`. On a terminal (a pseudo-terminal
here, Python's ``pty``): tqdm's live bar, redrawn with carriage returns. ``--no-progress``: nothing. ``--json``:
stdout holds the one JSON document whatever stderr shows. Each case runs the real CLI in a subprocess.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from fimoe_lab.cli._common import PROGRESS_LINE

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = "qwen3-moe-bf16"


def cli(*argv: object) -> list[str]:
    return [sys.executable, "-m", "fimoe_lab", *map(str, argv)]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "100"}


def piped(*argv: object) -> subprocess.CompletedProcess:
    """The CLI with stdout and stderr both pipes (no terminal anywhere)."""
    return subprocess.run(cli(*argv), capture_output=True, text=True, env=env(), timeout=180, cwd=ROOT)


def progress_lines(err: str, desc: str) -> list[tuple[int, float, float]]:
    """``(percent, done MB, total MB)`` of each line of ``err``, every one a plain progress line of ``desc``."""
    assert "\r" not in err and "\x1b" not in err, err
    got = []
    for line in err.splitlines():
        m = PROGRESS_LINE.fullmatch(line)
        assert m and m["desc"] == desc, line
        got.append((int(m["percent"]), float(m["done"]), float(m["total"])))
    return got


def check_rising_to_100(lines: list[tuple[int, float, float]], total_bytes: int) -> None:
    """Percentages rise, at most ~10 lines + one per 30 s (the runs here take seconds), the last at 100% of
    ``total_bytes``; each line's percent is floor(100 * done / total)."""
    assert 1 <= len(lines) <= 11, lines
    percents = [p for p, _, _ in lines]
    assert percents == sorted(set(percents)) and percents[-1] == 100, lines
    assert all(t == round(total_bytes / 1e6, 2) for _, _, t in lines), (lines, total_bytes)
    assert lines[-1][1] == lines[-1][2]
    for p, done, total in lines:  # the two-decimal MB values bound the exact percentage
        assert abs(p - 100 * done / total) <= 10 + 100 * 0.01 / total, (p, done, total)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("progress") / "k.safetensors"
    return out, piped("convert", SAMPLE, out, "--backend", "trtllm", "--json")


def test_convert_into_a_pipe_prints_plain_lines_up_to_100_and_json_on_stdout(converted):
    out, done = converted
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)  # stdout: the JSON document alone
    kernel_bytes = sum(_nbytes(t["kernel_shape"], t["dtype"]) for layer in doc["layers"] for t in layer["tensors"])
    lines = progress_lines(done.stderr, f"convert -> {out.name}")
    # the total is every tensor written: the kernel tensors plus the extras convert copies unchanged
    assert lines[-1][2] >= round(kernel_bytes / 1e6, 2) and out.stat().st_size > lines[-1][2] * 1e6
    check_rising_to_100(lines, _payload(out))


def test_restore_into_a_pipe_prints_plain_lines_up_to_100(converted, tmp_path):
    kernel, _ = converted
    back = tmp_path / "back"
    done = piped("restore", kernel, back, "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    shards = sorted(back.glob("*.safetensors"))
    assert doc["shards"] == len(shards)
    check_rising_to_100(progress_lines(done.stderr, f"restore -> {back.name}"), sum(map(_payload, shards)))


def test_restore_of_every_rank_into_a_pipe_prints_plain_lines_up_to_100(tmp_path):
    """``restore`` of a ``--tp 2 --rank all`` directory (ranks joined: ``expert_parallel.restore_ranks``)."""
    ranks, back = tmp_path / "ranks", tmp_path / "back"
    made = piped("convert", SAMPLE, ranks, "--backend", "cutlass", "--tp", "2", "--rank", "all", "--no-progress")
    assert made.returncode == 0 and made.stderr == "", made.stderr
    done = piped("restore", ranks, back)
    assert done.returncode == 0, done.stderr
    shards = sorted(back.glob("*.safetensors"))
    check_rising_to_100(progress_lines(done.stderr, f"restore -> {back.name}"), sum(map(_payload, shards)))


def test_no_progress_prints_nothing_and_the_old_progress_flag_is_accepted(converted, tmp_path, capsys):
    from fimoe_lab.cli import main

    kernel, _ = converted  # in this process: stderr is pytest's capture, no terminal
    assert main(["restore", str(kernel), str(tmp_path / "loud"), "--progress"]) == 0
    assert progress_lines(capsys.readouterr().err, "restore -> loud")
    assert main(["restore", str(kernel), str(tmp_path / "quiet"), "--no-progress", "--progress"]) == 0
    got = capsys.readouterr()
    assert got.err == "" and "wrote" in got.out


def test_a_refusal_before_any_work_is_one_line_without_progress(converted, capsys):
    from fimoe_lab.cli import main

    out, _ = converted  # OUT exists: refused before anything is read
    assert main(["convert", SAMPLE, str(out), "--backend", "trtllm"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: convert: ") and "(fix: " in err


def test_convert_on_a_terminal_draws_a_live_bar_with_carriage_returns(tmp_path):
    """stderr a pseudo-terminal: tqdm's bar (carriage returns, ``B/s``), never a plain line; stdout stays clean."""
    out = tmp_path / "k.safetensors"
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 24 x 100: room for the bar
    proc = subprocess.Popen(
        cli("convert", SAMPLE, out, "--backend", "trtllm", "--json"),
        stdout=subprocess.PIPE,
        stderr=follower,
        env=env(),
        cwd=ROOT,
    )
    os.close(follower)
    seen = b""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the child closed the terminal (EIO)
                break
            if not chunk:
                break
            seen += chunk
        elif proc.poll() is not None:
            break
    stdout = proc.communicate(timeout=60)[0]
    os.close(leader)
    text = seen.decode(errors="replace")
    assert proc.returncode == 0, text
    assert "\r" in text and "100%" in text and "B/s" in text and f"convert -> {out.name}" in text, text
    assert not any(PROGRESS_LINE.fullmatch(line.strip()) for line in text.replace("\r", "\n").splitlines())
    assert json.loads(stdout)["out"] == str(out)


ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "U8": 1, "I8": 1, "I32": 4, "F64": 8, "I64": 8}


def _nbytes(shape: list[int], dtype: str) -> int:
    n = ITEMSIZE[dtype]
    for s in shape:
        n *= s
    return n


def _payload(path: Path) -> int:
    """The tensor bytes of a safetensors file: its size less the 8-byte length and the JSON header."""
    with open(path, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
    return path.stat().st_size - 8 - header


def test_goldens_counts_cases_in_plain_lines_and_keeps_stdout_json(capsys):
    from fimoe_lab import goldens
    from fimoe_lab.cli import main

    if not goldens.default_golden_paths():
        pytest.skip("no golden files found (set FIMOE_GOLDENS or place shared/goldens beside the checkout)")
    assert main(["goldens", "--json"]) == 0  # in this process: stderr is pytest's capture, no terminal
    got = capsys.readouterr()
    doc = json.loads(got.out)
    lines = [PROGRESS_LINE.fullmatch(line) for line in got.err.splitlines()]
    assert lines and all(m and m["desc"] == "goldens" and m["unit"] == "cases" for m in lines), got.err
    percents = [int(m["percent"]) for m in lines if m]
    assert percents == sorted(set(percents)) and len(lines) <= 11 and percents[-1] == 100
    assert all(
        int(m["total"]) == doc["total"] and int(m["percent"]) == 100 * int(m["done"]) // doc["total"]
        for m in lines
        if m
    )
