"""The wheel carries everything the toolkit reads: built, installed away from the checkout, run.

Builds the wheel from a copy of what setuptools reads (``pyproject.toml``, the readme, the
package, and the root ``data/`` and ``notebooks/`` that the wheel carries inside the package), installs it with ``pip --target`` into a temporary site folder and runs the
commands with ``PYTHONPATH`` set to that folder only, from an unrelated temporary
directory, so the installed copy (not this checkout) is imported and its packaged data
(sample checkpoints, TRTLLM-Gen kernel table, rcp table, notebooks) is what gets read.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import fimoe_lab
from fimoe_lab import resources

pytestmark = pytest.mark.slow  # CI (and FIMOE_FULL_TESTS=1) runs it; a plain pytest leaves it out

ROOT = Path(__file__).resolve().parents[1]
BUILD_INPUTS = ("pyproject.toml", "README.md", "fimoe_lab", "data", "notebooks")
MAX_WHEEL_BYTES = 12_000_000  # ~6 MB today, nearly all sample checkpoints
PROBE = """
import json, torch, fimoe_lab
from fimoe_lab import resources
from fimoe_lab.checkpoints import sample_names
from fimoe_lab.formats import rcp_approx_ftz
from fimoe_lab.tune.validity import find_table
x = torch.tensor([0x3F80E832], dtype=torch.int32).view(torch.float32)
print(json.dumps({
    "package": fimoe_lab.__file__,
    "dirs": [str(d) for d in (resources.samples_dir(), resources.tactics_dir(), resources.notebooks_dir())],
    "samples": sample_names(),
    "kernels": str(find_table().path),
    "notebooks": sorted(p.name for p in resources.notebooks_dir().glob("*.ipynb")),
    "rcp_bits": rcp_approx_ftz(x).view(torch.int32).item(),
}))
"""


def packaged_files() -> dict[str, bytes]:
    """Every shipped file of this checkout (``data/``, ``notebooks/``, the prebuilt CUDA kernels and their
    sources), by its path inside the wheel."""
    found = {}
    for folder, inside in (
        (resources.data_dir(), "fimoe_lab/data"),
        (resources.notebooks_dir(), "fimoe_lab/notebooks"),
        (Path(__file__).resolve().parents[1] / "fimoe_lab" / "kernels" / "cuda", "fimoe_lab/kernels/cuda"),
    ):
        for f in folder.rglob("*"):
            if f.is_file() and "__pycache__" not in f.parts:
                found[f"{inside}/{f.relative_to(folder).as_posix()}"] = f.read_bytes()
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in BUILD_INPUTS:  # a copy: the build writes build/ and *.egg-info next to its sources
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(path, src / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(out),
            str(src),
        ],
        check=True,
    )
    (whl,) = out.glob("fimoe_lab-*.whl")
    print(f"\nwheel {whl.name}: {whl.stat().st_size / 1e6:.2f} MB")
    return whl


@pytest.fixture(scope="module")
def site(wheel, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("site").resolve()  # the installed package reports resolved paths
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--no-compile",
            "-q",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
    )
    return target


def run_installed(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    env.pop("FIMOE_LAB_TACTICS_DIR", None)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_wheel_holds_every_data_file_and_is_small(wheel):
    with zipfile.ZipFile(wheel) as z:
        inside = {
            name: z.read(name)
            for name in z.namelist()
            if name.startswith(("fimoe_lab/data/", "fimoe_lab/notebooks/", "fimoe_lab/kernels/cuda/"))
        }
    shipped = packaged_files()
    assert sorted(inside) == sorted(shipped)
    assert all(inside[name] == data for name, data in shipped.items())
    assert wheel.stat().st_size < MAX_WHEEL_BYTES, wheel.stat().st_size


def test_installed_copy_finds_its_own_data(site, tmp_path):
    done = run_installed(site, tmp_path, "-c", PROBE)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert Path(got["package"]).is_relative_to(site)
    assert all(Path(d).is_relative_to(site) and Path(d).is_dir() for d in got["dirs"])
    assert got["samples"] == sorted(p.name for p in resources.samples_dir().iterdir() if p.is_dir()) and got["samples"]
    assert Path(got["kernels"]).is_relative_to(site)
    assert got["notebooks"] == sorted(p.name for p in resources.notebooks_dir().glob("*.ipynb")) and got["notebooks"]
    assert got["rcp_bits"] == 0x3F7E32E1  # measured on an H200: 1 ulp above the correctly rounded 1/x


def test_installed_demo_converts_every_sample(site, tmp_path):
    done = run_installed(site, tmp_path, "-m", "fimoe_lab", "demo")
    assert done.returncode == 0, done.stdout + done.stderr
    for sample in sorted(p.name for p in resources.samples_dir().iterdir() if p.is_dir()):
        assert f"{sample} " in done.stdout, sample
    assert "every round trip exact" in done.stdout
    assert any((tmp_path / "fimoe-demo-out").rglob("*.safetensors"))


def test_installed_lab_help(site, tmp_path):
    done = run_installed(site, tmp_path, "-m", "fimoe_lab", "lab", "--help")
    assert done.returncode == 0, done.stderr
    assert "usage: fimoe-lab lab" in done.stdout


def test_user_extras_resolve_beside_an_engines_flashinfer_and_torch(wheel, tmp_path):
    """``fimoe_lab[fast,tune,lab]`` with FlashInfer 0.7.4 (vLLM 0.34's line) and torch 2.13.0 in one pip
    resolution: no conflict, and neither of the two pinned packages moved (asks the package index)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "-q",
            "--report",
            str(tmp_path / "report.json"),
            f"fimoe_lab[fast,tune,lab] @ {wheel.as_uri()}",
            "flashinfer-python==0.7.4",
            "torch==2.13.0",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    chosen = {
        item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"]
        for item in json.loads((tmp_path / "report.json").read_text())["install"]
    }
    assert chosen["flashinfer-python"] == "0.7.4"
    assert chosen["torch"].split("+")[0] == "2.13.0"
    assert chosen["fimoe-lab"] == fimoe_lab.__version__


def test_installed_goldens_replays_the_shipped_sets(site, tmp_path):
    env_free = {k: v for k, v in os.environ.items() if k != "FIMOE_GOLDENS"}
    done = subprocess.run(
        [sys.executable, "-m", "fimoe_lab", "goldens", "--json", "--no-progress"],
        cwd=tmp_path,
        env={**env_free, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["total"] >= 61 and report["reproduced"] == report["total"], report["total"]
    assert all(Path(case["file"]).is_relative_to(site) for case in report["cases"])
