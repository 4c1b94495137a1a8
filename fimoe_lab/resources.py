"""Where the data shipped inside the fimoe_lab package lives.

One place for every packaged path, so an installed wheel and a source checkout find the
same files: all of them sit under the package directory (setuptools package-data, see
``pyproject.toml``), never beside it. Layout::

    fimoe_lab/data/samples/<name>/        sample checkpoints (scripts/make_sample_checkpoints.py)
    fimoe_lab/data/tactics/*.json.gz      TRTLLM-Gen tactic snapshots (scripts/make_tactic_snapshot.py)
    fimoe_lab/data/rcp_approx_delta.bin   the measured rcp.approx.ftz.f32 table (scripts/make_rcp_table.py)
    fimoe_lab/notebooks/*.ipynb           the lab's notebooks

``fimoe_lab/data/README.md`` says what each holds and how it was made. Imports nothing
heavy (the CLI's ``--help`` may call it).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["package_root", "data_dir", "samples_dir", "tactics_dir", "rcp_table_path", "notebooks_dir"]


def package_root() -> Path:
    """The ``fimoe_lab`` package directory (in a checkout or where the wheel was installed)."""
    return Path(__file__).resolve().parent


def data_dir() -> Path:
    """The package's data folder, ``fimoe_lab/data``."""
    return package_root() / "data"


def samples_dir() -> Path:
    """Sample checkpoints (one folder per sample name, e.g. ``deepseek-v3-fp8``)."""
    return data_dir() / "samples"


def tactics_dir() -> Path:
    """Recorded TRTLLM-Gen tactic snapshots (``tactics-fi<version>-<kernel set>.json.gz``)."""
    return data_dir() / "tactics"


def rcp_table_path() -> Path:
    """The measured ``rcp.approx.ftz.f32`` corrections (zlib of 2-bit codes; see ``formats/codes.py``)."""
    return data_dir() / "rcp_approx_delta.bin"


def notebooks_dir() -> Path:
    """The lab's notebooks (``fimoe-lab lab`` opens a copy of them)."""
    return package_root() / "notebooks"
