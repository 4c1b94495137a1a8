"""The lab in JupyterLab + headless Chromium (device scale factor 2) on a real-size checkpoint: load time,
time from each control change to the repainted figure, kernel memory.

A notebook with the row, tile, provenance and A/B explorers runs in JupyterLab (the ``fimoe-lab lab``
launch); each explorer loads the checkpoint through its path box (timed from the click to the first
figure of the loaded layer), then every enabled menu and slider of every explorer is changed
``--rounds`` times (alternating between two values; timed from the change to the figure's new HTML
in the page). ``--think S`` waits S seconds before every change (as a user looks at the figure before
the next change; the explorers prepare likely next views meanwhile), 0 fires each change as soon as the
previous figure is shown. The kernel's resident memory (``VmRSS``) is read after the cells ran, after the
loads and after every change, the 1-minute load average after each explorer. Write the layer first
(``benchmarks/real_size_layer.py``)::

    python benchmarks/real_size_layer.py /tmp/r1-layer
    python benchmarks/bench_lab_browser.py /tmp/r1-layer --think 1.0            # table
    python benchmarks/bench_lab_browser.py /tmp/r1-layer --think 1.0 --json out.json

``tests/test_browser.py`` runs the same checks (every control answers, tooltips, text size) on the
notebooks' small layers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from checkout import on_path  # noqa: E402  (PYTHONPATH=TREE measures TREE)

on_path()

from scripts import lab_screenshots as shots  # noqa: E402

EXPLORERS = ("RowExplorer", "TileExplorer", "ProvenanceExplorer", "CompareExplorer")
BUDGET_S = 0.5


def _notebook(path: Path) -> None:
    """One cell that prints the kernel's pid, one per explorer (seeded until the path box loads)."""
    cells = ["%load_ext fimoe_lab.viz\nimport os\nfrom fimoe_lab.viz import widgets\nprint('kernel pid', os.getpid())"]
    cells += [f"widgets.{name}()" for name in EXPLORERS]
    nb = {
        "cells": [
            {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": c} for c in cells
        ],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path.write_text(json.dumps(nb))


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _wait_changed(page, handles, old, deadline) -> float:
    """Milliseconds until the figure's HTML differs from ``old`` (polled every 10 ms)."""
    started = time.monotonic()
    page.wait_for_function("([f, old]) => f.innerHTML !== old", arg=[handles, old], timeout=deadline.ms(), polling=10)
    return (time.monotonic() - started) * 1000


def _load(page, explorer, checkpoint: str, deadline) -> float:
    """Type the checkpoint into the explorer's path box, click load; ms until its figure shows the layer."""
    explorer.locator(".widget-text:has(label:text-is('checkpoint')) input").first.fill(checkpoint, timeout=30_000)
    figure = explorer.locator(".fimoe-figure").first
    old = figure.inner_html()
    started = time.monotonic()
    explorer.locator("button:text-is('load')").first.click(timeout=deadline.ms())
    page.wait_for_function(
        "([f, p, old]) => f.innerHTML !== old && p.textContent.includes('opened')",
        arg=[figure.element_handle(), explorer.locator(".fimoe-progress").first.element_handle(), old],
        timeout=min(deadline.ms(), 120_000),
        polling=10,
    )
    return (time.monotonic() - started) * 1000


def _changes(page, explorer, rounds: int, deadline, think: float = 0.0) -> list[dict]:
    """Every enabled menu (next option) and slider (a third of its range) of ``explorer``, ``rounds`` changes
    each, alternating between two values, each after ``think`` seconds: ms from each change to the new figure
    HTML."""
    rows = []
    figure = explorer.locator(".fimoe-figure").first
    for label in explorer.evaluate(shots.CONTROL_JS):
        if label == "layer":  # the loaded checkpoint stays shown
            continue
        select = explorer.locator(f".widget-dropdown:has(label:text-is('{label}')) select").first
        values = select.evaluate("s => [...s.options].map(o => o.value)")
        first = select.input_value()
        second = values[(values.index(first) + 1) % len(values)]
        times = []
        for k in range(rounds):
            if select.is_disabled():
                break
            page.wait_for_timeout(think * 1000)
            old = figure.inner_html()
            try:
                select.select_option(value=second if k % 2 == 0 else first, timeout=5000)
                times.append(_wait_changed(page, figure.element_handle(), old, deadline))
            except Exception:  # noqa: BLE001 - recorded as never repainted
                times.append(float("inf"))
        if select.input_value() != first and not select.is_disabled():
            select.select_option(value=first, timeout=5000)
            page.wait_for_timeout(300)
        rows.append(dict(control=label, kind="menu", ms=times))
        shots.log(f"  {label}: {[round(t) for t in times if t != float('inf')]} ms")
    sliders = explorer.locator(".widget-slider:not(.widget-vslider)")
    for k in range(sliders.count()):
        slider = sliders.nth(k)
        label = slider.locator("label").first.text_content()
        readout = slider.locator(".widget-readout").first
        if slider.locator(".noUi-target[disabled]").count():
            continue
        top = int(float(slider.locator(".noUi-handle").first.get_attribute("aria-valuemax", timeout=5000) or 1))
        first = int(float(readout.text_content(timeout=5000) or 0))
        second = min(top, first + max(1, top // 3))
        if second == first:
            continue
        times = []
        for r in range(rounds):
            page.wait_for_timeout(think * 1000)
            old = figure.inner_html()
            try:
                readout.click(timeout=5000)
                readout.evaluate("(el, v) => { el.textContent = v; }", str(second if r % 2 == 0 else first))
                readout.press("Enter", timeout=5000)
                times.append(_wait_changed(page, figure.element_handle(), old, deadline))
            except Exception:  # noqa: BLE001
                times.append(float("inf"))
        rows.append(dict(control=label, kind="slider", ms=times))
        shots.log(f"  {label}: {[round(t) for t in times if t != float('inf')]} ms")
    return rows


def run(checkpoint: str, rounds: int = 5, budget_s: float = 1500, think: float = 0.0) -> dict:
    from playwright.sync_api import sync_playwright

    binary = shots.chromium()
    if binary is None:
        raise RuntimeError("no chromium binary on PATH (.ci/install-browser.sh installs one)")
    deadline = shots.Deadline(budget_s)
    out: dict = {"checkpoint": checkpoint, "rounds": rounds, "think_s": think, "explorers": {}}
    with tempfile.TemporaryDirectory(prefix="fimoe-lab-bench-") as tmp:
        work = Path(tmp) / "notebooks"
        work.mkdir()
        _notebook(work / "bench.ipynb")
        with shots.lab_server(work, Path(tmp) / "state", "light", deadline) as (port, token), sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=binary, args=shots.CHROMIUM_FLAGS)
            try:
                page = browser.new_context(viewport=shots.VIEWPORT, device_scale_factor=shots.SCALE).new_page()
                page.goto(f"http://127.0.0.1:{port}/lab/tree/bench.ipynb?token={token}", timeout=deadline.ms())
                page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=deadline.ms())
                page.locator(".jp-NotebookPanel .jp-Cell").first.click(timeout=deadline.ms())
                shots.run_all(page, deadline)
                page.wait_for_function(  # every explorer drew its first (seeded) figure
                    "n => document.querySelectorAll('.widget-vbox > .fimoe-figure svg').length >= n",
                    arg=len(EXPLORERS),
                    timeout=min(deadline.ms(), 300_000),
                    polling=500,
                )
                text = page.locator(".jp-OutputArea-output", has_text="kernel pid").first.text_content()
                pid = int(text.split("kernel pid")[1].split()[0])
                shots.log(f"cells ran (kernel {pid})")
                page.wait_for_timeout(1000)
                out["rss_after_cells_mb"] = _rss_mb(pid)
                explorers = page.locator(".widget-vbox:has(> .fimoe-figure)")
                for k, name in enumerate(EXPLORERS):
                    explorer = explorers.nth(k)
                    explorer.scroll_into_view_if_needed()
                    one: dict = {"load_ms": _load(page, explorer, checkpoint, deadline)}
                    shots.log(f"{name}: loaded in {one['load_ms']:.0f} ms")
                    one["rss_after_load_mb"] = _rss_mb(pid)
                    one["changes"] = _changes(page, explorer, rounds, deadline, think)
                    one["rss_after_mb"] = _rss_mb(pid)
                    one["load_average"] = os.getloadavg()[0]
                    out["explorers"][name] = one
                    shots.log(f"{name}: {json.dumps(one)[:300]}")
            finally:
                browser.close()
    out["rss_above_fresh_mb"] = max(e["rss_after_mb"] for e in out["explorers"].values()) - out["rss_after_cells_mb"]
    return out


def report(out: dict) -> None:
    print(
        f"checkpoint {out['checkpoint']}; {out.get('think_s', 0):g} s before each change; "
        f"kernel RSS after the cells ran {out['rss_after_cells_mb']:.0f} MB"
    )
    for name, one in out["explorers"].items():
        load = f"; load average {one['load_average']:.1f}" if "load_average" in one else ""
        print(f"{name}: load + first figure {one['load_ms']:.0f} ms; RSS {one['rss_after_mb']:.0f} MB{load}")
        for row in one["changes"]:
            ms = row["ms"]
            finite = [t for t in ms if t != float("inf")]
            med = statistics.median(finite) if finite else float("inf")
            flag = "" if ms and max(ms) <= BUDGET_S * 1000 else "  (over 0.5 s)" if finite else "  (never repainted)"
            print(f"  {row['control']:<16} median {med:7.0f} ms  worst {max(ms, default=0):7.0f} ms{flag}")
    print(f"kernel RSS above the fresh kernel after every explorer: {out['rss_above_fresh_mb']:.0f} MB")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint", help="a checkpoint directory (benchmarks/real_size_layer.py writes one)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument(
        "--think",
        type=float,
        default=0.0,
        help="seconds to wait before each change, as a user looks at the figure first (default 0: at once)",
    )
    args = ap.parse_args()
    if not (Path(args.checkpoint) / "config.json").exists():
        print(f"error: {args.checkpoint} has no config.json (fix: write one with benchmarks/real_size_layer.py)")
        return 2
    if args.think < 0:
        print(f"error: --think {args.think} is negative (fix: give seconds >= 0)")
        return 2
    out = run(os.path.realpath(args.checkpoint), args.rounds, think=args.think)
    report(out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
