"""Real browser test: JupyterLab on 127.0.0.1 (the ``fimoe-lab lab`` launch), every lab notebook run
in headless Chromium at device scale factor 2, its explorers used the way a person does.

Through :func:`scripts.lab_screenshots.capture`: the figures render (inline SVG), change when
a control changes, carry hover text, a checkpoint loads through the path box, "copy as code"
and "save PNG" work, a typed provenance element is followed; in every notebook
(``lab_screenshots.CHECKS``) pointing at a figure shows the element's row, column, value,
source and steps, a click traces it (chain under the figure), a checkpoint loads through a
path box, an A/B comparison changes plan B, and the figure is saved and copied as code; the
hover tip sits within 20 px of the pointer and inside the viewport (also at a figure's right edge), the
only one shown;
at JupyterLab's default layout (file browser open) no figure text is under 8 pt; every menu of
every explorer of the tour changes its figure or message;
screenshots in the light and the dark theme are taken at 2x and checked for size and
content. ``FIMOE_BROWSER_NOTEBOOKS=1`` runs the first notebook only (a quicker local check).
Screenshots go to ``$FIMOE_ARTIFACTS`` (default ``test-artifacts/``). Bounded by ``BUDGET_S``
per notebook; JupyterLab and Chromium are shut down in every case.

Needs Playwright's Python package and a Chromium binary (Debian's ``chromium``; Playwright's
own browser download is not used). Without them the test is skipped, or fails under CI.

A second test renders the canvas widget's module alone in Chromium and plays the kernel's hover answers by
hand, in the orders a busy kernel gives them (late, after the pointer has left, from another figure).
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # CI (and FIMOE_FULL_TESTS=1) runs it; a plain pytest leaves it out

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
    notebooks = shots.NOTEBOOKS[: int(os.environ.get("FIMOE_BROWSER_NOTEBOOKS", len(shots.NOTEBOOKS)))]
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
    assert seen["copied"].startswith("copied to the clipboard") and seen["clipboard"] == seen["code"]  # as shown
    assert seen["saved"].startswith("saved ") and seen["saved"].endswith(".png")
    assert seen["provenance"].startswith("kernel (40, ")
    # click-to-trace: a kernel cell below row 40 is traced back; its source, clicked on the checkpoint
    # side, lands on the same kernel element
    clicked = seen["clicked_kernel"].split(" <- ")
    assert clicked[0] != "kernel (40, 0)" and clicked[1].startswith("expert 0, row ")
    assert seen["clicked_checkpoint"].split(" <- ")[0] == clicked[0]

    for name in notebooks:  # what the eye sees at JupyterLab's default layout (file browser open): >= 8 pt text
        sizes = result["text_sizes"][name]
        assert result["file_browser_open"][name] and sizes["count"] > 0
        assert sizes["smallest"][0][0] >= 7.95, f"{name}: text under 8 pt: {sizes['smallest']}"
    controls = result["controls"][shots.NOTEBOOKS[0]]  # every menu of every explorer answers on screen
    assert len(controls) >= 20 and {c["explorer"] for c in controls} == set(range(5))
    silent = [c for c in controls if not (c["changed"] or c["error_before"])]
    assert not silent, f"controls that changed nothing on screen: {silent}"

    for name in notebooks:  # point and see, path box, A/B and export in each notebook
        got, check = result["instruments"][name], shots.CHECKS[name]
        assert len(got["points"]) == len(check["point"])
        for point in got["points"]:
            for tip in point["tips"]:  # at the pointer (within 20 px) and inside the viewport
                assert tip is not None, "no tooltip towards the right edge of the cells"
                assert tip["shown"] == 1 and tip["gap"] <= 20 and tip["left"] >= 0 and tip["top"] >= 0, tip
                assert tip["right"] <= tip["width"] and tip["bottom"] <= tip["height"], tip
            assert re.match(r"(kernel|checkpoint) row \d+, column \d+", point["hover"]), point["hover"]
            assert " <- " in point["hover"] and "moved by: " in point["hover"]
            assert "kernel (" in point["clicked"] and re.search(r"(input|fill) of \w+", point["chain"]), point
        assert check["load"][2] in got["loaded"]
        assert "(TP 2)" in got["ab"] and got["ab_figure_changed"] and got["ab_pictures"] == 2
        assert got["saved"].startswith("saved ") and got["saved"].endswith(".svg")
        assert "figures.side_by_side(" in got["code"]

    luminance = {}
    for shot in result["screenshots"]:
        img = np.asarray(Image.open(shot).convert("RGB")).astype(float)
        assert img.shape[:2] == (shots.VIEWPORT["height"] * shots.SCALE, shots.VIEWPORT["width"] * shots.SCALE), shot
        assert len(np.unique(img.reshape(-1, 3)[::97], axis=0)) > 64, f"{shot} looks blank"
        luminance[shot.stem.rsplit("_", 1)[1]] = img.mean()
    assert luminance["dark"] < 0.6 * luminance["light"]  # the dark theme is dark: no white slabs


MOUNT_JS = """async ([src, n]) => {
    const mod = await import(URL.createObjectURL(new Blob([src], {type: "text/javascript"})));
    window.models = [];
    window.views = [];
    for (let k = 0; k < n; k++) {
        const state = {value: '<svg width="200" height="200"><rect width="200" height="200" fill="#68a"/></svg>',
                       tip: "", hover: [], click: []};
        const handlers = {};
        const model = {
            get: (key) => state[key],
            set: (key, v) => { state[key] = v; for (const f of handlers["change:" + key] || []) f(); },
            on: (event, f) => { (handlers[event] = handlers[event] || []).push(f); },
            save_changes: () => {},
        };
        const el = document.createElement("div");
        el.style.cssText = "margin:0 0 40px 0;width:200px";
        document.body.append(el);
        mod.default.render({model, el});
        window.models.push(model);
        window.views.push(el);
    }
}"""
"""The canvas widget's module rendered ``n`` times, one above the other (200 x 200 px figures 40 px
apart), each with a stand-in of anywidget's model (get, set, on, save_changes): ``window.models``."""

SHOWN_JS = """() => [...document.querySelectorAll('.fimoe-tip')].filter(t => t.style.display === 'block')
    .map(t => { const r = t.getBoundingClientRect(); return [t.textContent, r.left, r.top]; })"""


def test_a_hover_tip_shows_only_where_the_pointer_is():
    """The canvas widget's tooltip, in Chromium with the kernel's answers played by hand: an answer that
    arrives at the pointer is shown 12 px below right of it; one that arrives after the pointer has left
    the figure (a busy kernel) is not shown; and one figure's tooltip hides any other's, also that of a
    figure taken off the page under the pointer (no leave event comes then)."""
    _need(importlib.util.find_spec("playwright") is not None, "playwright is not installed")
    from scripts import lab_screenshots as shots

    _need(shots.chromium() is not None, "no chromium binary on PATH")
    from playwright.sync_api import sync_playwright

    from fimoe_lab.viz.widgets import _CANVAS_JS

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=shots.chromium(), args=shots.CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 600, "height": 700})
            page.set_content("<body style='margin:0'></body>")
            page.evaluate(MOUNT_JS, [_CANVAS_JS, 2])

            def point(k: int, x: float, y: float) -> None:  # the pointer on figure k; its hover goes out
                page.evaluate(f"window.models[{k}].set('hover', [])")
                page.mouse.move(x, y)
                page.wait_for_function(f"window.models[{k}].get('hover').length === 4", timeout=5000)

            def answer(k: int, text: str) -> None:
                page.evaluate(f"window.models[{k}].set('tip', {text!r})")

            point(0, 100, 100)
            answer(0, "row 1")
            assert page.evaluate(SHOWN_JS) == [["row 1", 112, 112]]
            page.mouse.move(100, 220)  # between the figures: the tip goes, and a late answer stays away
            assert page.evaluate(SHOWN_JS) == []
            answer(0, "row 2")
            assert page.evaluate(SHOWN_JS) == []
            point(1, 100, 300)
            answer(0, "row 3")  # figure 0's answer while the pointer is on figure 1
            assert page.evaluate(SHOWN_JS) == []
            answer(1, "row 4")
            assert page.evaluate(SHOWN_JS) == [["row 4", 112, 312]]
            page.evaluate("window.views[1].remove()")  # off the page under the pointer, its tip still up
            point(0, 50, 150)
            answer(0, "row 5")
            assert page.evaluate(SHOWN_JS) == [["row 5", 62, 162]]
        finally:
            browser.close()
