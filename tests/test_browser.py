"""Real browser test: JupyterLab on 127.0.0.1, the layout tour run in headless Chromium.

Checks that the widgets render (a figure image appears) and respond (changing the row
explorer's colouring changes its figure). Screenshots go to ``$FIMOE_ARTIFACTS`` (default
``test-artifacts/``). Bounded: the whole test gives up after ``BUDGET_S`` seconds, and
JupyterLab and Chromium are shut down in every case.

Needs Playwright's Python package and a Chromium binary (Debian's ``chromium``; Playwright's
own browser download is not used). Without them the test is skipped, or fails under CI.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from fimoe_lab import resources

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = "01_layout_tour.ipynb"
BUDGET_S = 110
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


def _chromium() -> str | None:
    for name in (os.environ.get("FIMOE_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _need(ok: bool, why: str) -> None:
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser test: {why} (.ci/install-browser.sh installs it)")
        pytest.skip(why)


class Deadline:
    """Seconds left of the test's budget, for every wait."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left_ms(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"browser test ran past its {BUDGET_S} s budget")
        return left * 1000


def _wait_for_server(url: str, server: subprocess.Popen, log: Path, deadline: Deadline) -> None:
    while True:
        if server.poll() is not None:
            tail = log.read_text()[-2000:]
            raise RuntimeError(f"JupyterLab exited with code {server.returncode} before serving {url}:\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        deadline.left_ms()
        time.sleep(0.5)


def _accept_kernel_dialog(page) -> None:
    """Accept JupyterLab's "Select Kernel" dialog (python3 preselected) when it shows up."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    with contextlib.suppress(PlaywrightTimeout):  # no dialog this time
        page.locator(".jp-Dialog .jp-mod-accept").click(timeout=3000)


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)


def test_tour_widgets_render_and_respond(tmp_path):
    _need(importlib.util.find_spec("playwright") is not None, "playwright is not installed")
    _need(importlib.util.find_spec("jupyterlab") is not None, "jupyterlab is not installed")
    chromium = _chromium()
    _need(chromium is not None, "no chromium binary on PATH")
    from playwright.sync_api import sync_playwright

    from fimoe_lab.cli.lab import free_port, jupyterlab_command

    artifacts = Path(os.environ.get("FIMOE_ARTIFACTS", ROOT / "test-artifacts"))
    artifacts.mkdir(parents=True, exist_ok=True)
    work = tmp_path / "notebooks"
    shutil.copytree(resources.notebooks_dir(), work)  # JupyterLab saves into its copy, never the repo's
    port = free_port()
    argv, env = jupyterlab_command(work, port, tmp_path / "state", open_browser=False)
    token = env["JUPYTER_TOKEN"]  # authentication stays on; the browser logs in with the token
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"  # the kernel's tensors are tiny; extra torch threads only fight on a shared CPU
    deadline = Deadline(BUDGET_S)
    log_path = tmp_path / "jupyterlab.log"
    log = open(log_path, "w")  # noqa: SIM115 - the server writes to it until the finally below closes it
    server = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for_server(f"http://127.0.0.1:{port}/api/status?token={token}", server, log_path, deadline)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS, timeout=deadline.left_ms())
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(f"http://127.0.0.1:{port}/lab/tree/{NOTEBOOK}?token={token}", timeout=deadline.left_ms())
                page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=deadline.left_ms())
                page.wait_for_selector(
                    ".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=deadline.left_ms()
                )
                _accept_kernel_dialog(page)
                page.locator(".lm-MenuBar-item", has_text="Run").first.click(timeout=deadline.left_ms())
                page.locator(".lm-Menu-item", has_text="Run All Cells").first.click(timeout=deadline.left_ms())
                _accept_kernel_dialog(page)

                colour = page.locator("select:has(option[value='shuffle block'])").first
                colour.wait_for(timeout=deadline.left_ms())
                explorer = page.locator(".widget-vbox", has=colour).first
                figure = explorer.locator("img.widget-image").first
                page.wait_for_function(
                    "img => img && img.complete && img.naturalWidth > 100",
                    arg=figure.element_handle(timeout=deadline.left_ms()),
                    timeout=deadline.left_ms(),
                )
                figure.scroll_into_view_if_needed(timeout=deadline.left_ms())
                before_src = figure.get_attribute("src")
                before_png = figure.screenshot(timeout=deadline.left_ms())
                page.screenshot(path=str(artifacts / "browser_rows_before.png"))
                (artifacts / "browser_rows_before_figure.png").write_bytes(before_png)

                colour.select_option(label="shuffle block", timeout=deadline.left_ms())
                page.wait_for_function(
                    "([img, old]) => img.src !== old && img.complete && img.naturalWidth > 100",
                    arg=[figure.element_handle(), before_src],
                    timeout=deadline.left_ms(),
                )
                after_png = figure.screenshot(timeout=deadline.left_ms())
                page.screenshot(path=str(artifacts / "browser_rows_after.png"))
                (artifacts / "browser_rows_after_figure.png").write_bytes(after_png)
                assert after_png != before_png, "the figure did not change after the colouring changed"
                page.wait_for_function(
                    "() => document.querySelectorAll('img.widget-image').length >= 4", timeout=deadline.left_ms()
                )
                page.screenshot(path=str(artifacts / "browser_tour.png"), full_page=True)
                assert (
                    not page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
                    .filter(has_text="Traceback")
                    .count()
                )
            except Exception:
                page.screenshot(path=str(artifacts / "browser_failure.png"))
                raise
            finally:
                browser.close()
    finally:
        _stop(server)
        log.close()
