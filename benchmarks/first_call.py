"""The host work of a model's first MoE layer: building its plan and compiling each map, in a fresh process.

An engine prepares its first MoE layer in a process that has built no plan: :func:`~fimoe_lab.recipes.plan_layer`
composes the maps (index arrays of up to a few hundred thousand cells per expert) and each map's first
``compiled()`` coarsens it and finds its fast forms (:mod:`fimoe_lab.compile`). Nothing here touches a device:
this is the part of ``benchmarks/whole_model.py``'s first-layer overhead that runs on the host before the first
copy. For each model of its ``MODELS`` (``--path layer``: ``plan_layer(fmt, "trtllm", I, H)``; ``--path drop-in``:
the drop-ins' maps at the sizes an engine passes them, ``prepare.drop_in_maps``), ``--repeats`` fresh processes (``--child``) import
torch and fimoe_lab (untimed), then time the plan and each map's compile; the minimum and median over the processes
are printed (wall ms; the host is shared, the minimum is the cost).

``--store off`` (the default) builds every plan (``FIMOE_LAB_PLAN_STORE=0``); ``--store filled`` reads it from a plan
store (:mod:`fimoe_lab.plan_store`) that one process filled first, as a restarted engine's first layer does: that
process applies the plan to a few experts on the CPU, waits for the executor loading in the background (numba,
whose calls find the weights' row forms too), does what the background planner does on a GPU
(:func:`fimoe_lab.kernels.prebuilt.build_plan`: sources, row forms, in place the cycle plans) and applies it again:
the record holds what a CPU process leaves and a GPU process's cycle plans (on sm_90 and newer the maps the cluster
kernel runs keep none, and a GPU's record has no row forms of the weights); the record's size is printed. Each process also times, apart, the planner's
work for the maps the prebuilt kernels gather on a GPU (none left to do where the store held it).

    PYTHONPATH=. python3 benchmarks/first_call.py [--models gpt-oss-120b-mxfp4 deepseek-r1-tp8-nvfp4] [--repeats 7]
    PYTHONPATH=. python3 benchmarks/first_call.py --models qwen3-235b-tp8-bf16 --path drop-in --store filled
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from checkout import child_env  # noqa: E402  (a child runs the PYTHONPATH given, then this checkout)
from whole_model import MODELS, drop_in_shapes, run_drop_in  # noqa: E402  (the models' sizes, one table)


def maps_of(model: str, path: str) -> dict:
    """The maps ``model``'s first layer builds on ``path``, each with whether it runs in place: ``plan_layer``'s
    (``layer``), or the drop-ins' own at the sizes an engine passes them (``drop-in``:
    :func:`fimoe_lab.prepare.drop_in_maps`); read from the plan store where it holds their plan."""
    from fimoe_lab import prepare
    from fimoe_lab.recipes import plan_layer
    from fimoe_lab.shapes import padded_shape

    fmt, _, hidden, inter, _, _ = MODELS[model]
    if path == "layer":
        return {name: (m, False) for name, m in plan_layer(fmt, "trtllm", inter, hidden).maps().items()}
    return prepare.drop_in_maps(fmt, *padded_shape(fmt, "trtllm", inter, hidden))


def fill(model: str, path: str) -> None:
    """Apply ``model``'s maps on ``path`` to two experts on the CPU (the layer plan, or the drop-in), wait for the
    executor loading in the background, do the background planner's work for each map and apply them again: the plan
    store (``FIMOE_LAB_CACHE``) then holds the record the module docstring describes."""
    import torch

    from fimoe_lab import plan_store
    from fimoe_lab.kernels import prebuilt, registry
    from fimoe_lab.recipes import plan_layer

    fmt, _, hidden, inter, _, _ = MODELS[model]
    maps = maps_of(model, path)
    if path == "layer":
        plan = plan_layer(fmt, "trtllm", inter, hidden)
        t = [torch.randint(0, 256, (2, *m.in_shape), dtype=torch.uint8) for m in plan.maps().values()]

        def apply() -> None:
            plan.apply(*t)
    else:
        shapes = drop_in_shapes(fmt, 2, hidden, inter)

        def apply() -> None:
            run_drop_in(fmt, *(torch.randint(0, 256, shapes[k], dtype=torch.uint8) for k in ("w13", "w2")))

    apply()
    for thread in list(registry._LOADS.threads.values()):  # the executor torch stood in for (numba), loaded: what it
        thread.join()  # finds on its calls (row forms) goes into the record as in a process that ran long enough
    for m, in_place in maps.values():
        prebuilt.build_plan(m.compiled(), in_place)
    for _ in range(plan_store.PLANNER_WAIT):
        apply()


def child(model: str, path: str) -> dict:
    import torch  # noqa: F401  (imported before the clock, as an engine has it)

    from fimoe_lab import prepare  # noqa: F401  (imports the compiler and the executors, as whole_model does)
    from fimoe_lab.kernels import prebuilt, registry

    start = time.perf_counter()
    maps = {name: m for name, (m, _) in maps_of(model, path).items()}
    planned = time.perf_counter()
    compiled = {}
    for name, m in maps.items():
        t = time.perf_counter()
        m.compiled()
        compiled[name] = (time.perf_counter() - t) * 1e3
    total = (time.perf_counter() - start) * 1e3
    ready = {}
    for name, m in maps.items():
        em = m.compiled()
        if registry.kernel_gathers(em):
            t = time.perf_counter()
            prebuilt.build_plan(em, in_place=False)
            ready[name] = (time.perf_counter() - t) * 1e3
    return {"plan_ms": (planned - start) * 1e3, "compile_ms": compiled, "total_ms": total, "planner_ms": ready}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--fill", help=argparse.SUPPRESS)
    ap.add_argument("--models", nargs="*", default=["gpt-oss-120b-mxfp4", "deepseek-r1-tp8-nvfp4"])
    ap.add_argument("--path", choices=("layer", "drop-in"), default="layer")
    ap.add_argument("--store", choices=("off", "filled"), default="off")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.path)))
        return
    if args.fill:
        fill(args.fill, args.path)
        return
    env = child_env()
    for model in args.models:
        if args.path not in MODELS[model][5]:
            ap.error(f"{model} has no {args.path} path (it has {', '.join(MODELS[model][5])})")
        with tempfile.TemporaryDirectory(prefix="fimoe_first_call_") as cache:
            env.update(FIMOE_LAB_CACHE=cache, FIMOE_LAB_PLAN_STORE="1" if args.store == "filled" else "0")
            command = [sys.executable, __file__, "--path", args.path]
            kept = ""
            if args.store == "filled":
                subprocess.run(command + ["--fill", model], env=env, capture_output=True, text=True, check=True)
                records = list(Path(cache, "plans").glob("*"))
                kept = f"; record {sum(r.stat().st_size for r in records) / 1e3:.0f} kB"
            runs = []
            for _ in range(args.repeats):
                out = subprocess.run(command + ["--child", model], env=env, capture_output=True, text=True, check=True)
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        best = min(runs, key=lambda r: r["total_ms"])
        plan = min(r["plan_ms"] for r in runs)
        total = [r["total_ms"] for r in runs]
        maps = ", ".join(f"{k} {v:.1f}" for k, v in best["compile_ms"].items())
        ready = [sum(r["planner_ms"].values()) for r in runs]
        each = ", ".join(f"{k} {min(r['planner_ms'][k] for r in runs):.1f}" for k in best["planner_ms"])
        print(
            f"{model:26s} {args.path} store {args.store}: plan + compile {min(total):6.2f} ms (median "
            f"{statistics.median(total):6.2f}); plan {plan:.2f} ms; compile, fastest run: {maps}; "
            f"planner {min(ready):.1f} ms (median {statistics.median(ready):.1f}; fastest per map: {each or 'none'})"
            f"{kept}"
        )


if __name__ == "__main__":
    main()
