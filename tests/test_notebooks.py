"""The notebooks run top to bottom headless (nbclient) and say what they should.

Each notebook runs in a fresh kernel from a copy in a temporary folder (so nothing is
written into the repository); the checks read the cells' outputs. The notebooks are
stored without outputs.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from fimoe_lab import resources

pytestmark = pytest.mark.slow  # CI (and FIMOE_FULL_TESTS=1) runs it; a plain pytest leaves it out

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = resources.notebooks_dir()
CELL_TIMEOUT_S = 120


def run(name: str, tmp_path: Path, monkeypatch) -> tuple[list[str], list[dict], float]:
    """Execute notebook ``name``; return its stream texts, rich outputs, and run time."""
    shutil.copy(NOTEBOOKS / name, tmp_path / name)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # tiny tensors: extra torch threads only fight on a shared CPU
    nb = nbformat.read(tmp_path / name, as_version=4)
    start = time.monotonic()
    nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    elapsed = time.monotonic() - start
    streams, rich = [], []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            assert out.output_type != "error", f"{name}: {out.ename}: {out.evalue}"
            if out.output_type == "stream":
                streams.append(out.text)
            else:
                rich.append(out.data)
    return streams, rich, elapsed


def count(rich: list[dict], mime: str) -> int:
    return sum(mime in d for d in rich)


def figures_shown(rich: list[dict]) -> int:
    """Figures displayed as the lab's inline SVG (``%load_ext fimoe_lab.viz``), none as a PNG."""
    assert count(rich, "image/png") == 0, "a figure was shown as a fixed-DPI PNG"
    return sum("fimoe-figure" in d.get("text/html", "") and "<svg" in d["text/html"] for d in rich)


def test_notebooks_are_stored_without_outputs():
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{path.name} has stored outputs"


def test_layout_tour(tmp_path, monkeypatch):
    from fimoe_lab import prepare

    streams, rich, elapsed = run("01_layout_tour.ipynb", tmp_path, monkeypatch)
    text = "".join(streams)
    assert "src = [0, 4, 1, 5, 2, 6, 3, 7]" in text
    flow_line = re.search(r"first 16 kernel rows come from checkpoint rows \[([\d, ]+)\]", text)
    # pad 96 -> 128, swap, interleave, shuffle (block 32, k 4): rows 0..7 are up rows 96, 98, ..
    assert [int(v) for v in flow_line.group(1).split(",")] == [96 + 2 * j for j in range(8)] + [2 * j for j in range(8)]
    offsets = re.search(
        r"(\d+) atoms; linear scale \(0, 0\) lands at buffer offset (\d+), scale \(1, 0\) at (\d+), "
        r"scale \(32, 0\) at (\d+)",
        text,
    )
    plan = prepare.plan_layer("mxfp8", "trtllm", 96, 256)
    # scale row r (gate) -> padded r -> swapped 128 + r -> interleaved 2r + 1 -> shuffled (block 32, k 4);
    # offset = (row % 32) * 16 + (row // 32 % 4) * 4 (DESIGN §3): rows 0, 1, 32 -> kernel rows 8, 24, 72
    assert int(offsets.group(1)) == 4
    assert [int(offsets.group(k)) for k in (2, 3, 4)] == [8 * 16, 24 * 16, 8 * 16 + 2 * 4]
    assert plan.w13_scale.provenance(8 * 16).source == (0, 0)
    assert count(rich, "application/vnd.jupyter.widget-view+json") == 5  # rows, tiles, padding, provenance, A/B
    html = [d["text/html"] for d in rich if "text/html" in d]
    assert any("LayerPlan" in h and "swizzle_scales_128x4" in h for h in html)
    assert any("fill byte" in h or "input of pad_projections" in h for h in html)
    assert elapsed < 60, f"the tour took {elapsed:.0f} s headless"


def test_checkpoint_debugging_finds_the_planted_bugs(tmp_path, monkeypatch):
    streams, rich, elapsed = run("02_checkpoint_debugging.ipynb", tmp_path, monkeypatch)
    text = "".join(streams)
    assert "deepseek-v3-fp8 layer 1 (deepseek-fp8, fp8-block, 6 experts)" in text
    assert "health (gate): fp8-block: 4 block scales are below 1e-10" in text
    assert "dead experts: [3]" in text
    assert "rows as planned: True" in text
    differ = re.search(r"suspect A: (\d+) of (\d+) kernel rows differ", text)
    assert int(differ.group(2)) == 256 and int(differ.group(1)) == 2 * 96  # every real row moved; padding stays
    assert "suspect A rows match the plan without swap_w13_to_w31: True" in text
    wrong = re.search(r"suspect B: (\d+)% of scales come back wrong", text)
    assert 30 <= int(wrong.group(1)) <= 100
    assert "suspect B equals the plan without swizzle_scales_128x4: True" in text
    assert figures_shown(rich) == 4
    assert count(rich, "application/vnd.jupyter.widget-view+json") == 3  # provenance, A/B, diagnose
    assert any("DeepSeek FP8 TRT-LLM" in d.get("text/html", "") for d in rich)
    assert "without swizzle_scales_128x4" in text  # the diagnose explorer names the step the dump lacks
    assert elapsed < 60


def test_alignment_tuning_reports_the_waste(tmp_path, monkeypatch):
    streams, rich, elapsed = run("03_alignment_tuning.ipynb", tmp_path, monkeypatch)
    text = "".join(streams)
    table = text.split("padding waste %")[1]
    rows = [[float(v) for v in re.findall(r"\d+\.\d+", line)] for line in table.splitlines()]
    rows = [r for r in rows if len(r) == 3][:12]

    def waste(tp: int, align: int, hidden_align: int) -> float:
        local = 2880 // tp
        ip, hp = -(-local // align) * align, -(-2880 // hidden_align) * hidden_align
        return round(100 * (1 - local * 2880 / (ip * hp)), 2)

    expected = [[waste(tp, ia, ha) for ha in (256, 512, 1024)] for tp in (1, 2, 4, 8) for ia in (16, 64, 128)]
    assert np.allclose(rows, expected)
    assert "TP 8: intermediate 2880 -> 360 per shard -> padded 384" in text
    assert figures_shown(rich) == 2
    assert count(rich, "application/vnd.jupyter.widget-view+json") == 3  # padding, A/B, tuner
    tune = pytest.importorskip("fimoe_lab.tune.sweep")
    from fimoe_lab.tune.oracle import TacticOracle

    sweep = tune.sweep("gpt-oss-120b", "fp8", 8, oracle=TacticOracle("snapshot"))
    assert tune.summary(sweep) in text
    assert (
        "convert's default padding (intermediate to a multiple of 16): intermediate 368" in text
        and "ZERO tactics" in text
    )
    assert elapsed < 60
