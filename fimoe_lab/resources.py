"""Where the data shipped with fimoe_lab lives: sample checkpoints, tactic snapshots, notebooks.

One place for every packaged path, so an installed wheel and a checkout find the same
files. Imports nothing heavy (the CLI's ``--help`` may call it).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["package_root", "samples_dir", "tactics_dir", "notebooks_dir"]


def package_root() -> Path:
    """The installed ``fimoe_lab`` package directory."""
    return Path(__file__).resolve().parent


def samples_dir() -> Path:
    """Sample checkpoints (one folder per sample name, e.g. ``deepseek-v3-fp8``)."""
    return package_root().parent / "data" / "checkpoints"


def tactics_dir() -> Path:
    """Recorded TRTLLM-Gen tactic snapshots (``tactics-fi<version>-<kernel set>.json.gz``)."""
    return package_root().parent / "data" / "tactics"


def notebooks_dir() -> Path:
    """The lab's notebooks (``fimoe-lab lab`` opens a copy of them)."""
    return package_root().parent / "notebooks"
