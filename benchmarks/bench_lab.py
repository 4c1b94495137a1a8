"""Time the lab's explorers on a real-size DeepSeek-R1 NVFP4 MoE layer: first draw and redraws.

The layer has R1's per-expert shapes (``presets.get_preset("deepseek-v3")``: hidden 7168,
intermediate 2048, TP 1: w13 ``(2*2048, 7168/2)`` packed bytes, E4M3 scales per 16 values)
with random bytes, so nothing is read from disk; ``--experts`` (default 2) sets how many
are stacked (a redraw shows one expert; R1's 256 would only cost memory). Each case times
one control change, end to end: data, figure and SVG (what the notebook receives), or one
click / hover on the figure (trace, chain and markers). Kinds: ``redraw`` (a control
change on data already read: the 0.5 s budget), ``point`` (click or hover), ``new data``
(another tensor or expert: it dequantizes one expert first), ``first`` and ``back`` (a
setting already shown).

    python benchmarks/bench_lab.py            # table
    python benchmarks/bench_lab.py --json     # JSON to stdout
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkout import on_path  # noqa: E402  (PYTHONPATH=TREE measures TREE)

on_path()

import matplotlib  # noqa: E402

matplotlib.use("Agg")

import torch  # noqa: E402

from fimoe_lab.checkpoints import MoELayer  # noqa: E402
from fimoe_lab.presets import get_preset  # noqa: E402
from fimoe_lab.specs import get_format  # noqa: E402
from fimoe_lab.viz import sources, widgets  # noqa: E402

BUDGET_S = 0.5


def r1_layer(experts: int, seed: int = 0) -> sources.ExpertTensors:
    """Random bytes in R1's NVFP4 shapes (E4M3 scales drawn from normal-range codes)."""
    p = get_preset("deepseek-v3")
    spec = get_format("nvfp4")
    inter, hidden = p.moe_intermediate, p.hidden
    g = torch.Generator().manual_seed(seed)

    def scales(rows: int, cols: int) -> torch.Tensor:
        return torch.randint(
            0x20, 0x48, (experts, rows, cols // spec.scale_block), generator=g, dtype=torch.uint8
        ).view(torch.float8_e4m3fn)

    w13 = torch.randint(0, 256, (experts, 2 * inter, hidden // 2), generator=g, dtype=torch.uint8)
    w2 = torch.randint(0, 256, (experts, hidden, inter // 2), generator=g, dtype=torch.uint8)
    extras = {
        "w13_weight_scale_2": torch.full((experts, 2), 1e-3),
        "w2_weight_scale_2": torch.full((experts,), 1e-3),
    }
    moe = MoELayer("nvfp4", w13, w2, scales(2 * inter, hidden), scales(hidden, inter), inter, hidden, extras=extras)
    return sources.ExpertTensors(moe, f"random bytes in DeepSeek-R1 NVFP4 shapes ({experts} experts)")


def timed(fn) -> tuple[float, float]:
    """``(wall seconds, CPU seconds of this process)`` of ``fn()`` (CPU time: what a shared machine's load hides)."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def svg_xy(ax, x: float, y: float) -> tuple[float, float]:
    """Where data point ``(x, y)`` of ``ax`` is in the explorer's SVG (what a click there reports)."""
    fig = ax.get_figure(root=True)
    px, py = ax.transData.transform((x, y))
    return px * 72.0 / fig.dpi, fig.get_size_inches()[1] * 72.0 - py * 72.0 / fig.dpi


def cases(layer: sources.ExpertTensors):
    """(name, explorer factory, [(label, change)]) for every layer explorer."""

    def setter(w, **values):
        def change():
            for name, value in values.items():
                getattr(w, name).value = value

        return change

    def click(w, axes: int, x: float, y: float, hover: bool = False):
        def change():
            at = svg_xy(w.figure.axes[axes], x, y)
            if not (w._hover(*at) if hover else w.click(*at)):
                raise RuntimeError(f"nothing under {at} of axes {axes}")

        return change

    return [
        (
            "rows",
            lambda: widgets.RowExplorer(layer),
            lambda w: [
                ("window", setter(w, start=2048)),
                ("colour", setter(w, colour_by="shuffle block")),
                ("side", setter(w, side="checkpoint")),
                ("click a value cell (kernel side)", click(w, 2, 1000, 20)),
                ("hover a value cell", click(w, 2, 1200, 30, hover=True)),
                ("click a checkpoint row (lines panel)", click(w, 0, 0, 0.5)),
                ("tensor w2", setter(w, tensor="w2")),
                ("expert", setter(w, expert=1)),
            ],
        ),
        (
            "tiles",
            lambda: widgets.TileExplorer(layer),
            lambda w: [
                ("atom", setter(w, atom=700)),
                ("colour (source row indices)", setter(w, colour_by="source row")),
                ("colour (scale values)", setter(w, colour_by="scale value")),
                ("click the atom close-up", click(w, 4, 5, 7)),
                ("click a checkpoint scale", click(w, 0, 300, 3000)),
                ("tensor w2_scale", setter(w, tensor="w2_scale")),
                ("expert", setter(w, expert=1)),
            ],
        ),
        (
            "compare",
            lambda: widgets.CompareExplorer(layer),
            lambda w: [
                ("B backend", setter(w, backend_b="trtllm")),
                ("B TP", setter(w, tp_b=2)),
                ("B engine", setter(w, engine_b=w.engine_b.options[-1])),
                ("expert", setter(w, expert=1)),
                ("tensor w13_scale", setter(w, tensor="w13_scale")),
            ],
        ),
        (
            "provenance",
            lambda: widgets.ProvenanceExplorer(layer),
            lambda w: [
                ("element", setter(w, row=3000, col=1000)),
                ("checkpoint side", setter(w, pick="checkpoint")),
                ("click a kernel cell", click(w, 2, 2000, 1500)),
                ("hover a checkpoint cell", click(w, 0, 100, 100, hover=True)),
                ("expert", setter(w, expert=1)),
                ("tensor w2", setter(w, tensor="w2")),
            ],
        ),
    ]


def report(summary: dict, out) -> None:
    """The table and the summary lines of :func:`main`'s ``summary`` on ``out``."""
    rows = summary["cases"]
    for r in rows:
        flag = "" if r.get("ok", True) else "  (error shown)"
        print(
            f"{r['explorer']:<11} {r['change']:<40} {r['seconds'] * 1000:7.0f} ms wall {r['cpu_s'] * 1000:7.0f} ms CPU"
            + flag,
            file=out,
        )
    print(
        f"click / hover: wall max {summary['max_point_s'] * 1000:.0f} ms; new tensor or expert (dequantizes): wall "
        f"max {summary['max_new_data_s'] * 1000:.0f} ms",
        file=out,
    )
    print(
        f"redraw (control change on data already read, or back to a setting): wall max {summary['max_redraw_s'] * 1000:.0f} ms, median "
        f"{summary['median_redraw_s'] * 1000:.0f} ms; CPU max {summary['max_redraw_cpu_s'] * 1000:.0f} ms, median "
        f"{summary['median_redraw_cpu_s'] * 1000:.0f} ms (budget {BUDGET_S * 1000:.0f} ms; load average "
        f"{summary['load_average']:.1f})",
        file=out,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=2)
    ap.add_argument(
        "--checkpoint",
        help="a checkpoint directory to read lazily instead (benchmarks/real_size_layer.py writes an R1 or V3 one)",
    )
    ap.add_argument("--json", action="store_true", help="JSON to stdout, table to stderr")
    args = ap.parse_args()
    if args.checkpoint:
        seconds, _ = timed(lambda: sources.load_layer(args.checkpoint))
        print(f"opened {args.checkpoint} in {seconds:.2f} s (headers only)", file=sys.stderr)
    layer = sources.load_layer(args.checkpoint) if args.checkpoint else r1_layer(args.experts)
    rows = []
    for name, make, changes in cases(layer):
        box: list = []
        seconds, cpu = timed(lambda: box.append(make()))
        w = box[0]
        first_row = dict(explorer=name, change="first draw (dequantize, plan, maps)", seconds=seconds, cpu_s=cpu)
        rows.append(dict(first_row, kind="first"))
        first = {c: c.value for c in w.controls}
        for label, change in changes(w):
            seconds, cpu = timed(change)
            ok = "#d33" not in w.message.value  # the explorer's error colour
            kind = (
                "new data"
                if label.startswith(("tensor", "expert", "colour (scale"))
                else "point"
                if "click" in label or "hover" in label
                else "redraw"
            )
            rows.append(dict(explorer=name, change=label, seconds=seconds, cpu_s=cpu, ok=ok, kind=kind))
        w._busy = True
        for c, v in first.items():
            c.value = v
        w._busy = False
        seconds, cpu = timed(w.refresh)
        rows.append(dict(explorer=name, change="back to the first setting", seconds=seconds, cpu_s=cpu, kind="back"))
    redraws = [r for r in rows if r["kind"] in ("redraw", "back")]
    points = [r for r in rows if r["kind"] == "point"]
    summary = dict(
        max_redraw_s=max(r["seconds"] for r in redraws),
        median_redraw_s=statistics.median(r["seconds"] for r in redraws),
        max_redraw_cpu_s=max(r["cpu_s"] for r in redraws),
        median_redraw_cpu_s=statistics.median(r["cpu_s"] for r in redraws),
        max_point_s=max(r["seconds"] for r in points),
        max_new_data_s=max(r["seconds"] for r in rows if r["kind"] == "new data"),
        all_ok=all(r.get("ok", True) for r in rows),
        budget_s=BUDGET_S,
        load_average=os.getloadavg()[0],
        cases=rows,
    )
    report(summary, sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
