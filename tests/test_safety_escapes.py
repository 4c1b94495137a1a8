"""Untrusted text is printed safely: control characters (terminal escape sequences, C1 controls, bidi
overrides) in tensor names, paths and config values never reach stdout or stderr raw.

Generated variants: each hostile string placed in an expert tensor's name, in the checkpoint's
directory name, in OUT's name and in a config value, through ``inspect``, ``convert`` and ``restore``.
"""

from __future__ import annotations

import json
import shutil

import pytest
from test_bad_inputs import BACKEND, largest_shard, read_header, run, write_header

from fimoe_lab.resources import sample_path
from fimoe_lab.untrusted import printable

HOSTILE = {
    "set-title": "\x1b]0;pwned\x07",
    "clear-screen": "\x1b[2J\x1b[H",
    "c1-csi": "\x9b31m",
    "bidi-override": "\u202egnp.exe",
    "backspaces": "ok\x08\x08\x08\x7f",
    "newline-cr": "a\r\nb",
}


def _raw_controls(text: str) -> list[str]:
    """Characters a terminal would act on (newlines between lines aside)."""
    return [c for c in text if c != "\n" and printable(c) != c]


@pytest.mark.parametrize(
    "s,want", [("\x1b[2J", "\\x1b[2J"), ("a\u202eb", "a\\u202eb"), ("\x9b", "\\x9b"), ("é ok", "é ok")]
)
def test_printable_escapes_controls_and_keeps_text(s, want):
    assert printable(s) == want
    assert printable("a\nb", keep="\n") == "a\nb" and printable("a\nb") == "a\\x0ab"


def _checkpoint(tmp_path, where: str, hostile: str):
    name = "ck" + (hostile if where == "dir" else "")
    ck = tmp_path / name
    shutil.copytree(sample_path("mixtral-bf16"), ck)
    if where == "tensor":
        shard = largest_shard(ck)
        header, data = read_header(shard)
        victim = next(n for n in sorted(header) if ".experts." in n)
        header[victim.replace(".experts.", f".experts{hostile}.")] = header.pop(victim)
        write_header(shard, header, data)
    if where == "config":
        config = json.loads((ck / "config.json").read_text())
        config["num_local_experts"] = hostile
        (ck / "config.json").write_text(json.dumps(config))
    return ck


@pytest.mark.parametrize("hostile", sorted(HOSTILE))
@pytest.mark.parametrize("where", ["tensor", "dir", "config", "out"])
@pytest.mark.parametrize("command", ["inspect", "convert"])
def test_no_control_character_reaches_the_terminal(hostile, where, command, tmp_path, capsys):
    text = HOSTILE[hostile]
    ck = _checkpoint(tmp_path, where, text)
    out = tmp_path / (f"out{text}.safetensors" if where == "out" else "out.safetensors")
    argv = ["inspect", ck] if command == "inspect" else ["convert", ck, out, "--backend", BACKEND]
    if command == "convert" and where in ("dir", "out"):
        (tmp_path / "file").write_text("x")
        argv = ["convert", ck, tmp_path / "file" / out.name, "--backend", BACKEND]  # fails, naming the paths
    rc, stdout, stderr = run([*argv, "--no-progress"] if command == "convert" else argv, capsys)
    assert "Traceback" not in stderr and "internal error" not in stderr, stderr
    assert _raw_controls(stdout) == [] and _raw_controls(stderr) == [], (stdout[-500:], stderr[-500:])
    if rc != 0:
        assert stderr.strip().splitlines()[-1].startswith("error: "), stderr


def test_restore_of_a_file_with_a_hostile_name_prints_it_escaped(tmp_path, capsys):
    k = tmp_path / "k\x1b[2J.safetensors"
    rc, _, err = run(["convert", sample_path("mixtral-bf16"), k, "--backend", BACKEND, "--no-progress"], capsys)
    assert rc == 0, err
    rc, stdout, stderr = run(["restore", k, tmp_path / "r\x1b]0;t\x07", "--no-progress"], capsys)
    assert _raw_controls(stdout) == [] and _raw_controls(stderr) == []
    assert "\\x1b" in stdout + stderr
