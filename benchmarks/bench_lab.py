"""Time the lab's explorers on a real-size DeepSeek-R1 NVFP4 MoE layer: first draw and redraws.

The layer has R1's per-expert shapes (``presets.get_preset("deepseek-v3")``: hidden 7168,
intermediate 2048, TP 1: w13 ``(2*2048, 7168/2)`` packed bytes, E4M3 scales per 16 values)
with random bytes, so nothing is read from disk; ``--experts`` (default 2) sets how many
are stacked (a redraw shows one expert; R1's 256 would only cost memory). Each case times
one control change, end to end: data, figure and SVG (what the notebook receives). A
redraw of a setting already shown is a cache hit and is reported separately.

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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

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


def cases(layer: sources.ExpertTensors):
    """(name, explorer factory, [(label, change)]) for every layer explorer."""

    def setter(w, **values):
        def change():
            for name, value in values.items():
                getattr(w, name).value = value

        return change

    return [
        (
            "rows",
            lambda: widgets.RowExplorer(layer),
            lambda w: [
                ("window", setter(w, start=2048)),
                ("colour", setter(w, colour_by="shuffle block")),
                ("side", setter(w, side="checkpoint")),
                ("tensor w2", setter(w, tensor="w2")),
                ("expert", setter(w, expert=1)),
            ],
        ),
        (
            "tiles",
            lambda: widgets.TileExplorer(layer),
            lambda w: [("atom", setter(w, atom=700)), ("tensor w2_scale", setter(w, tensor="w2_scale"))],
        ),
        (
            "provenance",
            lambda: widgets.ProvenanceExplorer(layer),
            lambda w: [("element", setter(w, row=3000, col=1000)), ("checkpoint side", setter(w, pick="checkpoint"))],
        ),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="JSON to stdout, table to stderr")
    args = ap.parse_args()
    layer = r1_layer(args.experts)
    rows = []
    for name, make, changes in cases(layer):
        box: list = []
        seconds, cpu = timed(lambda: box.append(make()))
        w = box[0]
        rows.append(dict(explorer=name, change="first draw (dequantize, plan, maps)", seconds=seconds, cpu_s=cpu))
        first = {c: c.value for c in w.controls}
        for label, change in changes(w):
            seconds, cpu = timed(change)
            ok = "#d33" not in w.message.value  # the explorer's error colour
            rows.append(dict(explorer=name, change=label, seconds=seconds, cpu_s=cpu, ok=ok))
        w._busy = True
        for c, v in first.items():
            c.value = v
        w._busy = False
        seconds, cpu = timed(w.refresh)
        rows.append(dict(explorer=name, change="back to the first setting (cached)", seconds=seconds, cpu_s=cpu))
    redraws = [r for r in rows if not r["change"].startswith(("first", "back", "expert"))]
    summary = dict(
        max_redraw_s=max(r["seconds"] for r in redraws),
        median_redraw_s=statistics.median(r["seconds"] for r in redraws),
        max_redraw_cpu_s=max(r["cpu_s"] for r in redraws),
        median_redraw_cpu_s=statistics.median(r["cpu_s"] for r in redraws),
        all_ok=all(r.get("ok", True) for r in rows),
        budget_s=BUDGET_S,
        load_average=os.getloadavg()[0],
        cases=rows,
    )
    out = sys.stderr if args.json else sys.stdout
    for r in rows:
        flag = "" if r.get("ok", True) else "  (error shown)"
        print(
            f"{r['explorer']:<11} {r['change']:<40} {r['seconds'] * 1000:7.0f} ms wall {r['cpu_s'] * 1000:7.0f} ms CPU"
            + flag,
            file=out,
        )
    print(
        f"redraw (control change, same expert): wall max {summary['max_redraw_s'] * 1000:.0f} ms, median "
        f"{summary['median_redraw_s'] * 1000:.0f} ms; CPU max {summary['max_redraw_cpu_s'] * 1000:.0f} ms, median "
        f"{summary['median_redraw_cpu_s'] * 1000:.0f} ms (budget {BUDGET_S * 1000:.0f} ms; load average "
        f"{summary['load_average']:.1f})",
        file=out,
    )
    if args.json:
        print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
