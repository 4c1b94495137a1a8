"""Time building every layer plan of a whole model from cold caches.

A model's MoE layers share their shapes, so building all ``--layers`` of them is one cold
:func:`~fimoe_lab.recipes.plan_layer` call (index maps built) and ``layers - 1`` cache
hits. For each (format, backend) of :data:`~fimoe_lab.recipes.RECIPES` this clears every
cache (:func:`fimoe_lab.caches.clear_caches`), then times the calls for the preset's
per-rank sizes (``--compile``: also each map's executable form, ``IndexMap.compiled()``).
Torch threads stay as the process has them (``--threads`` to set them).

    python benchmarks/plan_build.py [--model deepseek-v3] [--tp 1] [--compile] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fimoe_lab.caches import clear_caches
from fimoe_lab.errors import FimoeError
from fimoe_lab.presets import get_preset
from fimoe_lab.recipes import RECIPES, plan_layer


def build_model(
    fmt: str, backend: str, inter: int, hidden: int, layers: int, compile_maps: bool
) -> tuple[float, float]:
    """(wall, CPU) seconds to plan ``layers`` identical layers from cold caches."""
    clear_caches()
    w, c = time.perf_counter(), time.process_time()
    for _ in range(layers):
        plan = plan_layer(fmt, backend, inter, hidden)
        if compile_maps:
            for m in plan.maps().values():
                m.compiled()
    return time.perf_counter() - w, time.process_time() - c


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--layers", type=int, default=58)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also build each map's executable form")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: as is)")
    ap.add_argument("--recipes", nargs="*", default=None, help="e.g. mxfp8/trtllm (default: all)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    p = get_preset(args.model)
    inter, hidden = p.moe_intermediate // args.tp, p.hidden
    print(
        f"{args.model} tp={args.tp} (I={inter}, H={hidden}), {args.layers} layers, torch threads {torch.get_num_threads()}"
    )
    print("| recipe | wall s (median) | CPU s (median) | runs |")
    print("|---|---|---|---|")
    for rid, r in RECIPES.items():
        if args.recipes and rid not in args.recipes:
            continue
        try:
            runs = [
                build_model(r.fmt, r.backend, inter, hidden, args.layers, args.compile) for _ in range(args.repeats)
            ]
        except FimoeError as e:
            print(f"| {rid} | - | - | {e} |")
            continue
        wall = statistics.median(t[0] for t in runs)
        cpu = statistics.median(t[1] for t in runs)
        print(f"| {rid} | {wall:.3f} | {cpu:.3f} | {' '.join(f'{t[0]:.3f}' for t in runs)} |")


if __name__ == "__main__":
    main()
