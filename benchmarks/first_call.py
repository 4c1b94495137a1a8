"""The host work of a model's first MoE layer: building its plan and compiling each map, in a fresh process.

An engine prepares its first MoE layer in a process that has built no plan: :func:`~fimoe_lab.recipes.plan_layer`
composes the maps (index arrays of up to a few hundred thousand cells per expert) and each map's first
``compiled()`` coarsens it and finds its fast forms (:mod:`fimoe_lab.compile`). Nothing here touches a device:
this is the part of ``benchmarks/whole_model.py``'s first-layer overhead that runs on the host before the first
copy. For each model of its ``MODELS`` (the ``layer`` path's ``plan_layer(fmt, "trtllm", I, H)``), ``--repeats``
fresh processes (``--child``) import torch and fimoe_lab (untimed), then time the plan and each map's compile;
the minimum and median over the processes are printed (wall ms; the host is shared, the minimum is the cost).
Each process also times, apart, the work the background planner does for the maps the prebuilt kernels gather
on a GPU (:func:`fimoe_lab.kernels.prebuilt.build_plan`: sources, the swizzled-rows form). In a model it runs
beside the first layers, which use torch's copies until it is done.

    PYTHONPATH=. python3 benchmarks/first_call.py [--models gpt-oss-120b-mxfp4 deepseek-r1-tp8-nvfp4] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from whole_model import MODELS, ROOT  # noqa: E402  (the models' sizes, one table)


def child(model: str) -> dict:
    import torch  # noqa: F401  (imported before the clock, as an engine has it)

    from fimoe_lab import prepare  # noqa: F401  (imports the compiler and the executors, as whole_model does)
    from fimoe_lab.kernels import prebuilt, registry
    from fimoe_lab.recipes import plan_layer

    fmt, _, hidden, inter, _, _ = MODELS[model]
    start = time.perf_counter()
    plan = plan_layer(fmt, "trtllm", inter, hidden)
    planned = time.perf_counter()
    maps = {}
    for name, m in plan.maps().items():
        t = time.perf_counter()
        m.compiled()
        maps[name] = (time.perf_counter() - t) * 1e3
    total = (time.perf_counter() - start) * 1e3
    ready = {}
    for name, m in plan.maps().items():
        em = m.compiled()
        if registry.kernel_gathers(em):
            t = time.perf_counter()
            prebuilt.build_plan(em, in_place=False)
            ready[name] = (time.perf_counter() - t) * 1e3
    return {"plan_ms": (planned - start) * 1e3, "compile_ms": maps, "total_ms": total, "planner_ms": ready}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--models", nargs="*", default=["gpt-oss-120b-mxfp4", "deepseek-r1-tp8-nvfp4"])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child)))
        return
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for model in args.models:
        runs = []
        for _ in range(args.repeats):
            out = subprocess.run(
                [sys.executable, __file__, "--child", model], env=env, capture_output=True, text=True, check=True
            )
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        best = min(runs, key=lambda r: r["total_ms"])
        plan = min(r["plan_ms"] for r in runs)
        total = [r["total_ms"] for r in runs]
        maps = ", ".join(f"{k} {v:.1f}" for k, v in best["compile_ms"].items())
        ready = [sum(r["planner_ms"].values()) for r in runs]
        each = ", ".join(f"{k} {min(r['planner_ms'][k] for r in runs):.1f}" for k in best["planner_ms"])
        print(
            f"{model:26s} plan + compile {min(total):6.1f} ms (median {statistics.median(total):6.1f}); "
            f"plan {plan:.1f} ms; compile, fastest run: {maps}; "
            f"planner {min(ready):.1f} ms (median {statistics.median(ready):.1f}; fastest per map: {each or 'none'})"
        )


if __name__ == "__main__":
    main()
