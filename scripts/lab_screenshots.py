"""Run the lab notebooks in JupyterLab + headless Chromium, use the explorers, take screenshots.

The command users type (``fimoe-lab lab``, through :func:`fimoe_lab.cli.lab.jupyterlab_command`)
starts JupyterLab on a copy of the notebooks; Chromium (Debian's, through Playwright) opens
each notebook at device scale factor 2, runs every cell, then:

- on the layout tour (``interact=True``): changes the row explorer's colouring (its SVG
  must change), checks the hover texts (``<title>``), types a provenance element (the
  message must name it), loads a checkpoint through the path box, and uses "copy as code"
  and "save PNG";
- on every notebook (``interact=True``, :data:`CHECKS`): points at a figure (the hover tip
  names row, column, value and source), clicks a cell (the trace and its chain appear),
  loads a checkpoint through an explorer's path box, changes an A/B comparison's plan B and
  exports (save SVG, copy as code);
- takes a screenshot of the first explorer in the light theme, switches JupyterLab to its
  dark theme (Settings > Theme) and takes another.

:func:`capture` returns what it saw (the test checks it); run as a script it writes the
README's screenshots::

    python scripts/lab_screenshots.py                # -> docs/screenshots/<notebook>_<theme>.png
    python scripts/lab_screenshots.py --out /tmp/s --notebooks 01_layout_tour.ipynb
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fimoe_lab import resources  # noqa: E402
from fimoe_lab.cli.lab import free_port, jupyterlab_command  # noqa: E402
from fimoe_lab.viz.figures import POINTABLE  # noqa: E402

NOTEBOOKS = ("01_layout_tour.ipynb", "02_checkpoint_debugging.ipynb", "03_alignment_tuning.ipynb")
VIEWPORT = {"width": 1500, "height": 1000}
SCALE = 2  # device pixels per CSS pixel: text is rasterized at this resolution
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]


CHECKS = {
    "01_layout_tour.ipynb": dict(
        point=[("B backend", 1)], load=("B backend", "qwen3-moe-bf16", "A BF16"), ab="B backend"
    ),
    "02_checkpoint_debugging.ipynb": dict(
        point=[("column", 2), ("B backend", 1)], load=("B backend", "deepseek-r1-nvfp4", "A NVFP4"), ab="B backend"
    ),
    "03_alignment_tuning.ipynb": dict(
        point=[("B backend", 1)], load=("B backend", "qwen3-moe-bf16", "A BF16"), ab="B backend"
    ),
}
"""What each notebook's run does with its explorers (each explorer is found by a control label it
has): ``point``: (explorer, axes index) to hover and click; ``load``: (explorer, checkpoint, text
the message must then hold) for the path box; ``ab``: the A/B explorer whose plan B changes (TP 2)
and that is exported."""


def chromium() -> str | None:
    """A Chromium binary: ``$FIMOE_CHROMIUM``, else ``chromium``/``chromium-browser``/``google-chrome`` on PATH."""
    for name in (os.environ.get("FIMOE_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


class Deadline:
    """Milliseconds left of a budget, for every wait."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def ms(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the browser run went past its {self.seconds:.0f} s budget")
        return left * 1000


def log(message: str) -> None:
    """One progress line on stderr (time since the start of the run)."""
    print(f"[{time.monotonic() - START:6.1f} s] {message}", file=sys.stderr, flush=True)


START = time.monotonic()


def _wait_for_server(url: str, server: subprocess.Popen, log: Path, deadline: Deadline) -> None:
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with code {server.returncode}:\n{log.read_text()[-2000:]}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as r:
            if r.status == 200:
                return
        deadline.ms()
        time.sleep(0.5)


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)


@contextlib.contextmanager
def lab_server(work: Path, state: Path, theme: str, deadline: Deadline, **env: str) -> Iterator[tuple[int, str]]:
    """JupyterLab on the notebooks in ``work`` (its settings under ``state``, its log beside it), started as
    ``fimoe-lab lab`` starts it (:func:`fimoe_lab.cli.lab.jupyterlab_command`) with every cell rendered (no
    windowing: outputs exist to be checked), this checkout importable and ``env`` added, in a session of its
    own; yields ``(port, token)`` once it answers and stops the whole session on exit."""
    port = free_port()
    argv, server_env = jupyterlab_command(work, port, state, open_browser=False, theme=theme)
    tracker = state / "settings" / "@jupyterlab" / "notebook-extension"
    tracker.mkdir(parents=True, exist_ok=True)
    (tracker / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    server_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), server_env.get("PYTHONPATH")]))
    server_env.update(env)
    log_path = state.parent / "jupyterlab.log"
    with open(log_path, "w") as server_log:
        server = subprocess.Popen(
            argv, env=server_env, stdout=server_log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            token = server_env["JUPYTER_TOKEN"]
            _wait_for_server(f"http://127.0.0.1:{port}/api/status?token={token}", server, log_path, deadline)
            yield port, token
        finally:
            _stop(server)


def _accept_kernel_dialog(page) -> None:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    with contextlib.suppress(PlaywrightTimeout):
        page.locator(".jp-Dialog .jp-mod-accept").click(timeout=3000)


def _menu(page, top: str, *items: str, deadline: Deadline) -> None:
    page.locator(".lm-MenuBar-item", has_text=top).first.click(timeout=deadline.ms())
    for item in items:
        page.locator(".lm-Menu-item:visible", has_text=item).first.click(timeout=deadline.ms())


def run_all(page, deadline: Deadline) -> None:
    """Run every cell and wait until each code cell has its execution count."""
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=deadline.ms())
    _accept_kernel_dialog(page)
    _menu(page, "Run", "Run All Cells", deadline=deadline)
    _accept_kernel_dialog(page)
    log("running all cells")
    page.wait_for_function(
        """() => {
            const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')];
            return prompts.length > 0 && prompts.every(p => /\\[\\d+\\]/.test(p.textContent));
        }""",
        timeout=deadline.ms(),
        polling=500,
    )


def _figure_key(explorer) -> str:
    return explorer.locator(".fimoe-figure").first.inner_html()


def _interact(page, deadline: Deadline) -> dict:
    """Use the layout tour's explorers; return what each action changed."""
    seen: dict = {}
    colour = page.locator("select:has(option[value='shuffle block'])").first
    rows = page.locator(".widget-vbox", has=colour).first
    rows.locator(".fimoe-figure svg").first.wait_for(timeout=deadline.ms())
    log("row explorer drawn")
    before = _figure_key(rows)
    colour.select_option(label="shuffle block", timeout=deadline.ms())
    page.wait_for_function(
        "([el, old]) => el.innerHTML !== old",
        arg=[rows.locator(".fimoe-figure").first.element_handle(timeout=deadline.ms()), before],
        timeout=deadline.ms(),
    )
    seen["colour_changed_figure"] = True
    log("colour changed the figure")
    titles = rows.locator(".fimoe-figure svg title")
    seen["hover_titles"] = titles.count()
    seen["hover_example"] = titles.first.text_content(timeout=deadline.ms())

    path = rows.locator(".widget-text:has(label:text-is('checkpoint')) input").first
    path.fill("deepseek-v3-fp8", timeout=deadline.ms())
    rows.locator("button:text-is('load')").first.click(timeout=deadline.ms())
    message = rows.locator(".fimoe-message").first
    page.wait_for_function(
        "el => el.textContent.includes('DeepSeek FP8')", arg=message.element_handle(), timeout=deadline.ms()
    )
    seen["path_box_message"] = message.text_content().strip()
    log("path box loaded a checkpoint")

    rows.locator("button:text-is('copy as code')").first.click(timeout=deadline.ms())
    code = rows.locator("textarea").first
    code.wait_for(state="visible", timeout=deadline.ms())
    seen["code"] = code.input_value(timeout=deadline.ms())
    copied = rows.locator(".fimoe-copied").first  # the browser's answer to the clipboard write
    page.wait_for_function("el => el.textContent.length > 0", arg=copied.element_handle(), timeout=deadline.ms())
    seen["copied"] = copied.text_content().strip()
    seen["clipboard"] = page.evaluate("navigator.clipboard.readText()")
    rows.locator("button:text-is('save PNG')").first.click(timeout=deadline.ms())
    page.wait_for_function(
        "el => el.textContent.includes('saved ')", arg=message.element_handle(), timeout=deadline.ms()
    )
    seen["saved"] = message.text_content().strip()
    log("copy as code, save PNG")

    pick = page.locator("select:has(option[value='checkpoint']):has(option[value='kernel'])")
    prov = page.locator(".widget-vbox", has=page.locator(".widget-inline-hbox:has(label:text-is('column'))")).first
    row_box = prov.locator(".widget-inline-hbox:has(label:text-is('row')) input").first
    row_box.fill("40", timeout=deadline.ms())
    row_box.press("Enter", timeout=deadline.ms())
    prov_message = prov.locator(".fimoe-message").first
    page.wait_for_function(
        "el => el.textContent.includes('kernel (40,')", arg=prov_message.element_handle(), timeout=deadline.ms()
    )
    seen["provenance"] = prov_message.text_content().strip()
    log("provenance element typed")
    seen["pick_menus"] = pick.count()
    seen.update(_click_to_trace(page, prov, prov_message, deadline))
    return seen


def _click_to_trace(page, prov, prov_message, deadline: Deadline) -> dict:
    """Click the kernel heatmap 30 px below the traced element's marker, then the checkpoint
    heatmap on the marker of the clicked element's source; return the messages and the side."""
    circles = prov.locator(".fimoe-figure svg circle")
    circles.nth(1).wait_for(timeout=deadline.ms())
    circles.nth(1).scroll_into_view_if_needed(timeout=deadline.ms())
    box = circles.nth(1).bounding_box(timeout=deadline.ms())
    before = prov_message.text_content()
    page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2 + 30)
    page.wait_for_function(
        "([el, old]) => el.textContent !== old && el.textContent.startsWith('kernel (')",
        arg=[prov_message.element_handle(), before],
        timeout=deadline.ms(),
    )
    seen = {"clicked_kernel": prov_message.text_content().strip()}
    log("kernel cell clicked")
    circles.nth(0).scroll_into_view_if_needed(timeout=deadline.ms())
    box = circles.nth(0).bounding_box(timeout=deadline.ms())
    page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    side = prov.locator("select:has(option[value='checkpoint'])").first
    page.wait_for_function(
        "el => el.selectedOptions[0].textContent === 'checkpoint'", arg=side.element_handle(), timeout=deadline.ms()
    )
    page.wait_for_function(
        "el => el.textContent.startsWith('kernel (')", arg=prov_message.element_handle(), timeout=deadline.ms()
    )
    seen["clicked_checkpoint"] = prov_message.text_content().strip()
    log("checkpoint cell clicked")
    return seen


def _explorer(page, label: str):
    """The explorer (a widget VBox) with a control labelled ``label``; the last one on the page."""
    return page.locator(".widget-vbox", has=page.locator(f"label:text-is('{label}')")).last


def _changed(page, el, old: str, deadline: Deadline, needle: str = "") -> str:
    """Wait until ``el``'s text differs from ``old`` (and holds ``needle``); return it."""
    page.wait_for_function(
        "([el, old, needle]) => el.textContent !== old && el.textContent.includes(needle)",
        arg=[el.element_handle(timeout=deadline.ms()), old, needle],
        timeout=deadline.ms(),
    )
    return el.text_content().strip()


def _point_and_click(page, explorer, axes: int, deadline: Deadline) -> dict:
    """Hover over the middle of pointable axes ``axes`` of the explorer's first picture (the tip
    must appear), then click there (the message must name the traced kernel element)."""
    frame = explorer.locator(f".fimoe-figure svg [id='{POINTABLE}-{axes}']").first
    frame.scroll_into_view_if_needed(timeout=deadline.ms())
    box = frame.bounding_box(timeout=deadline.ms())
    x, y = box["x"] + box["width"] * 0.37, box["y"] + box["height"] * 0.41
    middle = _hover_tip(page, x, y, deadline)
    # towards the right edge of what the eye sees of the cells (the page or JupyterLab's side bar may cover
    # the rest), the first point with a cell under it: there the tip must flip to the pointer's left and
    # stay on screen
    right = page.evaluate(VISIBLE_RIGHT_JS, [min(box["x"] + box["width"] * 0.97, VIEWPORT["width"] - 3), x, y])
    edge = None
    for k in range(12):
        px = right - k * (right - x) / 12
        edge = _hover_tip(page, px, y, deadline, answer_s=1.5)
        if edge is not None:
            break
    seen = {"hover": middle["text"], "tips": [middle, edge]}
    message = explorer.locator(".fimoe-message").first
    old = message.text_content()
    page.mouse.click(x, y)
    seen["clicked"] = _changed(page, message, old, deadline, "kernel (")
    seen["chain"] = explorer.locator(".fimoe-trace").first.text_content() or explorer.locator(
        ".fimoe-figure pre"
    ).first.text_content(timeout=deadline.ms())
    return seen


TIP_JS = """() => {
    const shown = [...document.querySelectorAll('.fimoe-tip')].filter(t => t.style.display === 'block');
    const tip = shown[0];
    if (!tip || !tip.textContent) return null;
    const r = tip.getBoundingClientRect();
    return {text: tip.textContent, left: r.left, top: r.top, right: r.right, bottom: r.bottom,
            width: window.innerWidth, height: window.innerHeight, shown: shown.length};
}"""
"""The first lab tooltip shown on the page: its text, its box, the viewport and ``shown``, how many are shown."""


VISIBLE_RIGHT_JS = """([x, left, y]) => {
    for (let px = x; px > left; px -= 2) {
        const el = document.elementFromPoint(px, y);
        if (el && el.closest('.fimoe-figure svg')) return px;
    }
    return left;
}"""
"""The rightmost x (CSS px, from ``x`` down to ``left``) on row ``y`` where the pointer is over a lab figure."""


def _hover_tip(page, x: float, y: float, deadline: Deadline, answer_s: float | None = None) -> dict | None:
    """Point at ``(x, y)`` (CSS px of the viewport) and wait for the figure's tooltip; return its text, its box,
    the viewport and the pointer, and ``gap``: the distance from the pointer to the nearest point of the box.

    The tooltip of an earlier point may still be shown when the pointer arrives: the answer is the tooltip
    whose text differs from the one shown before the move, read once its box has stopped moving. With
    ``answer_s``, None when no such tooltip shows within that time (no cell under the pointer); without it,
    after 5 s any tooltip is the answer (a point whose text equals the earlier one)."""
    before = (page.evaluate(TIP_JS) or {}).get("text")
    page.mouse.move(x - 7, y - 7)
    page.mouse.move(x, y, steps=3)
    answered = "t !== null && (t.text.includes('row ') || t.text.includes('offset'))"
    try:
        page.wait_for_function(
            f"(before) => {{ const t = ({TIP_JS})(); return {answered} && t.text !== before; }}",
            arg=before,
            timeout=min(deadline.ms(), (answer_s or 5) * 1000),
        )
    except Exception:  # noqa: BLE001 - no new tooltip in the time given
        if answer_s is not None:
            return None
        page.wait_for_function(f"() => {{ const t = ({TIP_JS})(); return {answered}; }}", timeout=deadline.ms())
    tip, settled = page.evaluate(TIP_JS), None
    while tip != settled:  # the box placed for the final pointer position and the final text
        page.wait_for_timeout(min(50, deadline.ms()))
        settled, tip = tip, page.evaluate(TIP_JS)
    dx = max(tip["left"] - x, 0, x - tip["right"])
    dy = max(tip["top"] - y, 0, y - tip["bottom"])
    return dict(tip, x=x, y=y, gap=(dx * dx + dy * dy) ** 0.5)


MIN_FONT_JS = """() => {
    const sizes = [];
    for (const svg of document.querySelectorAll('.fimoe-figure svg')) {
        if (svg.parentElement.closest('svg')) continue;
        for (const t of svg.querySelectorAll('text')) {
            const box = t.getBoundingClientRect();
            if (!box.width || !t.textContent.trim()) continue;
            const ctm = t.getScreenCTM();
            const px = parseFloat(getComputedStyle(t).fontSize) * Math.hypot(ctm.a, ctm.b);
            sizes.push([px * 0.75, t.textContent.slice(0, 40)]);
        }
    }
    sizes.sort((a, b) => a[0] - b[0]);
    return {count: sizes.length, smallest: sizes.slice(0, 5)};
}"""
"""The rendered size in points (CSS px x 0.75) of the smallest texts of every lab figure on the page."""


def _text_sizes(page) -> dict:
    """:data:`MIN_FONT_JS` on the page as it is laid out now."""
    return page.evaluate(MIN_FONT_JS)


CONTROL_JS = """(vbox) => [...vbox.querySelectorAll('.widget-dropdown select')]
    .filter(s => !s.disabled && s.options.length > 1 && s.closest('.widget-vbox') === vbox
        && !s.closest('.fimoe-loader'))
    .map(s => s.closest('.widget-dropdown').querySelector('label').textContent)"""


def _every_control(page, deadline: Deadline, per_change_s: float = 10) -> list[dict]:
    """Each enabled menu of each explorer on the page set to its next option: whether the figure or the message
    changed, and how long the page took to show it (ms from the change to the new HTML)."""
    seen = []
    explorers = page.locator(".widget-vbox:has(> .fimoe-figure)")
    for k in range(explorers.count()):
        explorer = explorers.nth(k)
        labels = explorer.evaluate(CONTROL_JS)
        for label in labels:
            select = explorer.locator(f".widget-dropdown:has(label:text-is('{label}')) select").first
            if select.is_disabled() or not select.is_visible():
                continue
            values = select.evaluate("s => [...s.options].map(o => o.value)")
            if len(values) < 2:  # an earlier change left one choice (e.g. the tensors a new backend moves)
                continue
            now = select.input_value()
            pick = values[(values.index(now) + 1) % len(values)]
            figure, message = explorer.locator(".fimoe-figure").first, explorer.locator(".fimoe-message").first
            handles = [figure.element_handle(timeout=deadline.ms()), message.element_handle(timeout=deadline.ms())]
            old = [figure.inner_html(), message.inner_html()]
            started = time.monotonic()
            select.select_option(value=pick, timeout=min(deadline.ms(), per_change_s * 1000), force=True)
            changed = True
            try:
                page.wait_for_function(
                    "([f, m, old]) => f.innerHTML !== old[0] || m.innerHTML !== old[1]",
                    arg=[*handles, old],
                    timeout=min(deadline.ms(), per_change_s * 1000),
                    polling=20,
                )
            except Exception:  # noqa: BLE001 - a control that never answers is what this records
                changed = False
            seen.append(
                dict(
                    explorer=k,
                    control=label,
                    value=pick,
                    changed=changed,
                    figure_changed=figure.inner_html() != old[0],
                    error_before="fimoe-error" in old[0],  # an invalid setting another control caused stays so
                    ms=(time.monotonic() - started) * 1000,
                )
            )
            log(f"explorer {k}: {label} -> {pick}: {'changed' if changed else 'NOTHING CHANGED'}")
    return seen


def _load(page, explorer, where: str, expect: str, deadline: Deadline) -> str:
    """Load checkpoint ``where`` through the explorer's path box; the message must then hold ``expect``."""
    explorer.locator(".widget-text:has(label:text-is('checkpoint')) input").first.fill(where, timeout=deadline.ms())
    message = explorer.locator(".fimoe-message").first
    old = message.text_content()
    explorer.locator("button:text-is('load')").first.click(timeout=deadline.ms())
    return _changed(page, message, old, deadline, expect)


def _ab_and_export(page, explorer, deadline: Deadline) -> dict:
    """Set the A/B explorer's plan B to TP 2 (message and pictures change), then save SVG and copy as code."""
    message = explorer.locator(".fimoe-message").first
    old, figure = message.text_content(), _figure_key(explorer)
    explorer.locator(".widget-dropdown:has(label:text-is('B TP')) select").first.select_option(
        label="2", timeout=deadline.ms()
    )
    seen = {"ab": _changed(page, message, old, deadline, "(TP 2)")}
    seen["ab_figure_changed"] = _figure_key(explorer) != figure
    seen["ab_pictures"] = explorer.locator(".fimoe-figure svg").count()
    old = message.text_content()
    explorer.locator("button:text-is('save SVG')").first.click(timeout=deadline.ms())
    seen["saved"] = _changed(page, message, old, deadline, "saved ")
    explorer.locator("button:text-is('copy as code')").first.click(timeout=deadline.ms())
    code = explorer.locator("textarea").first
    code.wait_for(state="visible", timeout=deadline.ms())
    seen["code"] = code.input_value(timeout=deadline.ms())
    return seen


def _instrument(page, name: str, deadline: Deadline) -> dict:
    """:data:`CHECKS` of notebook ``name``: point and click, path box, A/B and export."""
    check = CHECKS[name]
    seen: dict = {"points": []}
    for label, axes in check["point"]:
        seen["points"].append(_point_and_click(page, _explorer(page, label), axes, deadline))
        log(f"{name}: pointed at and clicked the explorer with {label!r}")
    label, where, expect = check["load"]
    seen["loaded"] = _load(page, _explorer(page, label), where, expect, deadline)
    log(f"{name}: path box loaded {where}")
    seen.update(_ab_and_export(page, _explorer(page, check["ab"]), deadline))
    log(f"{name}: A/B changed, exported")
    return seen


def _screenshot(page, path: Path, deadline: Deadline) -> None:
    first = page.locator(".fimoe-figure svg").first
    first.scroll_into_view_if_needed(timeout=deadline.ms())
    page.wait_for_timeout(300)
    page.screenshot(path=str(path))


def capture(
    out: Path, notebooks=NOTEBOOKS, themes=("light", "dark"), interact: bool = True, budget_s: float = 600
) -> dict:
    """Run ``notebooks`` in JupyterLab + Chromium, use the tour's explorers, screenshot each theme.

    One JupyterLab server and browser per notebook (a second notebook in the same session
    was seen never to start "Run All"). Returns ``{"screenshots": [paths], "interactions":
    {...}, "tracebacks": {notebook: n}, "figures": {notebook: n}}``; raises when Chromium
    or a wait fails. ``budget_s`` bounds the whole run.
    """
    deadline = Deadline(budget_s)
    keys = ("interactions", "instruments", "tracebacks", "figures", "text_sizes", "file_browser_open", "controls")
    result: dict = {"screenshots": [], **{key: {} for key in keys}}
    for name in notebooks:
        one = _capture(out, name, themes, interact, deadline)
        result["screenshots"] += one["screenshots"]
        for key in keys:
            result[key].update(one.get(key, {}))
    return result


def _capture(out: Path, notebook: str, themes, interact: bool, deadline: Deadline) -> dict:
    """:func:`capture` of one notebook on its own server."""
    notebooks = [notebook]
    from playwright.sync_api import sync_playwright

    binary = chromium()
    if binary is None:
        raise RuntimeError("no chromium binary on PATH (.ci/install-browser.sh installs one)")
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"screenshots": [], "interactions": {}, "instruments": {}, "tracebacks": {}, "figures": {}}
    with tempfile.TemporaryDirectory(prefix="fimoe-lab-shots-") as tmp:
        work = Path(tmp) / "notebooks"
        shutil.copytree(resources.notebooks_dir(), work)  # JupyterLab saves into its copy, never the package
        with lab_server(work, Path(tmp) / "state", themes[0], deadline, OMP_NUM_THREADS="1") as (port, token):
            log("JupyterLab is up")
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=binary, args=CHROMIUM_FLAGS, timeout=deadline.ms())
                try:
                    context = browser.new_context(
                        viewport=VIEWPORT, device_scale_factor=SCALE, permissions=["clipboard-read", "clipboard-write"]
                    )
                    for name in notebooks:
                        page = context.new_page()
                        try:
                            page.goto(f"http://127.0.0.1:{port}/lab/tree/{name}?token={token}", timeout=deadline.ms())
                            page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=deadline.ms())
                            log(f"{name}: opened")
                            page.locator(".jp-NotebookPanel .jp-Cell").first.click(timeout=deadline.ms())
                            run_all(page, deadline)
                            log(f"{name}: every cell ran")
                            page.wait_for_timeout(500)
                            # JupyterLab's default layout (the file browser open): what size is the text?
                            result["text_sizes"] = {name: _text_sizes(page)}
                            result["file_browser_open"] = {name: page.locator("#filebrowser").is_visible()}
                            if page.locator("#filebrowser").is_visible():  # the notebook gets the width
                                _menu(page, "View", "File Browser", deadline=deadline)
                                page.wait_for_timeout(300)

                            if interact and name == NOTEBOOKS[0]:
                                result["interactions"] = _interact(page, deadline)
                                log(f"{name}: explorers used")
                            if interact and name in CHECKS:
                                result["instruments"][name] = _instrument(page, name, deadline)
                            result["figures"][name] = page.locator(".fimoe-figure svg").count()
                            result["tracebacks"][name] = (
                                page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
                                .filter(has_text="Traceback")
                                .count()
                            )
                            if interact and name == NOTEBOOKS[0]:  # last: it leaves settings changed
                                result["controls"] = {name: _every_control(page, deadline)}
                                log(f"{name}: every menu of every explorer changed")
                            for k, theme in enumerate(themes):
                                if k:
                                    _menu(page, "Settings", "Theme", f"JupyterLab {theme.title()}", deadline=deadline)
                                    page.wait_for_function(
                                        "t => document.body.dataset.jpThemeName === t",
                                        arg=f"JupyterLab {theme.title()}",
                                        timeout=deadline.ms(),
                                    )
                                shot = out / f"{Path(name).stem}_{theme}.png"
                                _screenshot(page, shot, deadline)
                                result["screenshots"].append(shot)
                                log(f"{name}: {shot}")
                            if len(themes) > 1:  # back to the first theme for the next notebook
                                _menu(page, "Settings", "Theme", f"JupyterLab {themes[0].title()}", deadline=deadline)
                        except Exception:
                            page.screenshot(path=str(out / f"failure_{Path(name).stem}.png"))
                            raise
                        finally:
                            page.close()
                finally:
                    browser.close()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    ap.add_argument("--notebooks", nargs="*", default=list(NOTEBOOKS))
    ap.add_argument("--budget", type=float, default=900, help="seconds for the whole run")
    args = ap.parse_args()
    result = capture(args.out, args.notebooks, budget_s=args.budget)
    for shot in result["screenshots"]:
        print(shot)
    print(json.dumps({k: v for k, v in result.items() if k != "screenshots"}, indent=1, default=str))
    return 1 if any(result["tracebacks"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
