"""What README.md promises a new user, checked as they would try it: every ```python block runs as written
in a fresh interpreter from the checkout, the version is one everywhere, and every ``fimoe-lab`` command
line the README offers parses against the real command."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import fimoe_lab
from fimoe_lab.cli import build_parser
from fimoe_lab.resources import sample_names, sample_path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PYTHON_BLOCKS = re.findall(r"^```python\n(.*?)^```", README, flags=re.S | re.M)


def test_the_readme_has_python_blocks():
    assert PYTHON_BLOCKS, "README.md shows no Python example"


@pytest.mark.parametrize("i", range(len(PYTHON_BLOCKS)))
def test_each_python_block_runs_in_a_fresh_interpreter(i, tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", PYTHON_BLOCKS[i]],
        cwd=tmp_path,  # not the checkout: the block must not rely on files beside it
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"README python block {i} failed:\n{PYTHON_BLOCKS[i]}\n{done.stderr[-3000:]}"


def test_one_version_in_the_package_the_command_and_the_changelog(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"fimoe-lab {fimoe_lab.__version__}"
    changelog = (ROOT / "CHANGELOG.md").read_text()
    latest = re.search(r"^## (\S+)", changelog, flags=re.M)
    assert latest and latest.group(1) == fimoe_lab.__version__, "CHANGELOG's latest section is not this version"
    assert "unreleased" not in changelog.lower()


def _readme_commands() -> list[list[str]]:
    """Every ``fimoe-lab ...`` command line in the README's inline code and shell blocks."""
    found = re.findall(r"`(fimoe-lab [^`]+)`", README) + re.findall(r"^\.venv/bin/(fimoe-lab [^\n&]+)", README, re.M)
    return [shlex.split(c.replace("...", "").strip()) for c in found]


@pytest.mark.parametrize("argv", _readme_commands(), ids=" ".join)
def test_every_command_the_readme_offers_parses(argv):
    args = argv[1:]
    if args in (["--version"], ["--help"]):
        return
    # placeholders in capitals (SRC, OUT, ...) stand for paths; /models/... for a checkpoint: a shipped sample
    sample = str(sample_path(sample_names()[0]))
    build_parser().parse_args([sample if a.startswith("/models/") else a.lower() if a.isupper() else a for a in args])


# What users read speaks of the project and what was measured, never of how it was built.
HISTORY = re.compile(
    r"\bsessions? \d|\bsession's\b|\bleases?\b|\bissues? #?\d+|\bwork period|\bmachine load|_s\d+[a-z]?\b(?=[._])",
    flags=re.I,
)
USER_READ = ("README.md", "CHANGELOG.md", "SECURITY.md", "docs", "notebooks", "fimoe_lab", "benchmarks", "scripts")
TEXT = {".md", ".py", ".ipynb", ".txt", ".json", ".jsonl", ".csv", ".log", ".toml", ".sh"}


def _user_read_files() -> list[Path]:
    found = []
    for name in USER_READ:
        path = ROOT / name
        found += (
            [path]
            if path.is_file()
            else sorted(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
        )
    return found


def test_nothing_users_read_tells_how_it_was_built():
    hits = []
    for f in _user_read_files():
        rel = f.relative_to(ROOT).as_posix()
        if HISTORY.search(f.name):
            hits.append(f"{rel}: its name")
        if f.suffix in TEXT and f.stat().st_size < 2_000_000:
            for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
                if HISTORY.search(line):
                    hits.append(f"{rel}:{n}: {line.strip()[:120]}")
    assert not hits, "development history in what users read:\n" + "\n".join(hits[:40])
