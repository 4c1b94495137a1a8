"""Real browser test: JupyterLab on 127.0.0.1 (the ``fimoe-lab lab`` launch), the layout tour run in
headless Chromium at device scale factor 2, its explorers used the way a person does.

Through :func:`scripts.lab_screenshots.capture`: the figures render (inline SVG), change when
a control changes, carry hover text, a checkpoint loads through the path box, "copy as code"
and "save PNG" work, a typed provenance element is followed; screenshots in the light and
the dark theme are taken at 2x and checked for size and content. ``FIMOE_BROWSER_ALL=1``
runs every notebook (what ``scripts/lab_screenshots.py`` does for the README). Screenshots
go to ``$FIMOE_ARTIFACTS`` (default ``test-artifacts/``). Bounded by ``BUDGET_S``;
JupyterLab and Chromium are shut down in every case.

Needs Playwright's Python package and a Chromium binary (Debian's ``chromium``; Playwright's
own browser download is not used). Without them the test is skipped, or fails under CI.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 240


def _need(ok: bool, why: str) -> None:
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser test: {why} (.ci/install-browser.sh installs it)")
        pytest.skip(why)


def test_the_lab_in_a_real_browser():
    _need(importlib.util.find_spec("playwright") is not None, "playwright is not installed")
    _need(importlib.util.find_spec("jupyterlab") is not None, "jupyterlab is not installed")
    from scripts import lab_screenshots as shots

    _need(shots.chromium() is not None, "no chromium binary on PATH")
    from PIL import Image

    artifacts = Path(os.environ.get("FIMOE_ARTIFACTS", ROOT / "test-artifacts"))
    notebooks = shots.NOTEBOOKS if os.environ.get("FIMOE_BROWSER_ALL") else shots.NOTEBOOKS[:1]
    result = shots.capture(artifacts, notebooks, budget_s=BUDGET_S * len(notebooks))

    assert not any(result["tracebacks"].values()), result["tracebacks"]
    assert result["figures"][shots.NOTEBOOKS[0]] >= 4  # rows, tiles, padding, provenance
    seen = result["interactions"]
    assert seen["colour_changed_figure"]
    assert seen["hover_titles"] >= 16 and seen["hover_example"].startswith("checkpoint row ")
    assert seen["path_box_message"].startswith("DeepSeek FP8 TRT-LLM: ")  # the loaded sample's plan
    assert (
        "figures.row_permutation_figure(" in seen["code"]
        and "sources.load_layer('deepseek-v3-fp8', None, 1, 0)" in seen["code"]
    )
    assert seen["saved"].startswith("saved ") and seen["saved"].endswith(".png")
    assert seen["provenance"].startswith("kernel (40, ")
    # click-to-trace: a kernel cell below row 40 is traced back; its source, clicked on the checkpoint
    # side, lands on the same kernel element
    clicked = seen["clicked_kernel"].split(" <- ")
    assert clicked[0] != "kernel (40, 0)" and clicked[1].startswith("expert 0, row ")
    assert seen["clicked_checkpoint"].split(" <- ")[0] == clicked[0]

    luminance = {}
    for shot in result["screenshots"]:
        img = np.asarray(Image.open(shot).convert("RGB")).astype(float)
        assert img.shape[:2] == (shots.VIEWPORT["height"] * shots.SCALE, shots.VIEWPORT["width"] * shots.SCALE), shot
        assert len(np.unique(img.reshape(-1, 3)[::97], axis=0)) > 64, f"{shot} looks blank"
        luminance[shot.stem.rsplit("_", 1)[1]] = img.mean()
    assert luminance["dark"] < 0.6 * luminance["light"]  # the dark theme is dark: no white slabs
