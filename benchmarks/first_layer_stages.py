"""Where a fresh process's first layers spend their host time, stage by stage.

One fresh process per run (this one): imports torch and ``fimoe_lab``, then prepares ``--layers`` MoE layers of
a model (``whole_model.py``'s ``MODELS``, its ``layer`` or ``drop-in`` path) on random bytes, synchronising before
and after each. The main thread's time in each stage (plan building, reading or writing the plan store, compiling a
map, picking the executor, loading a fatbin, a form table, an allocation, a launch, torch's stand-in...; the table
``STAGES``) is summed per layer by wrapping those functions
(calls from other threads, the background planner's, are not counted); a stage's time includes the stages it
calls. Printed per layer: its host time (until the calls return), its wall time (until the device is done) and the
stages over 20 us, longest first, as ``stage=ms/calls``; the garbage collector's pauses (any thread: every
thread waits for them) as ``gc.genN``.

Each layer's line ends with the background planner's builds that overlapped it (``planner: map=ms``, the part
inside the layer's wall time; its thread's, beside the main thread's stages).

``--switch-interval S`` sets Python's thread switch interval for the whole process first (the default is Python's
5 ms; the background planner sets 0.2 ms while it has work): an A/B of what the caller waits for the GIL.

    PYTHONPATH=. python3 benchmarks/first_layer_stages.py --model gpt-oss-120b-mxfp4
    PYTHONPATH=. python3 benchmarks/first_layer_stages.py --model qwen3-235b-tp8-bf16 --path drop-in --switch-interval 0.0002
    PYTHONPATH=. python3 benchmarks/first_layer_stages.py --model deepseek-r1-tp8-nvfp4 --device cpu --experts 4  # CPU smoke run
"""

from __future__ import annotations

import argparse
import collections
import gc
import importlib
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from whole_model import MODELS, drop_in_shapes, layer_shapes_of, run_drop_in  # noqa: E402  (one table of models)

STAGES = {  # module -> functions whose main-thread time is summed
    "fimoe_lab.recipes": ("plan_layer",),
    "fimoe_lab.compile": ("compile_map",),
    "fimoe_lab.plan": ("apply_map",),
    "fimoe_lab.prepare": (
        "permute_in_place",
        "permute_cache_keys",
        "plan_trtllm_bf16_block_layout",
        "plan_shuffle_deepseek_fp8",
        "plan_rotate_fp8_per_tensor",
    ),
    "fimoe_lab.plan_store": ("read", "applied"),
    "fimoe_lab.kernels": ("execute", "execute_in_place"),
    "fimoe_lab.kernels.registry": ("get_executor", "_loaded_or_stand_in", "kept_in_place"),
    "fimoe_lab.kernels.prebuilt": (
        "strided_now",
        "gather",
        "_launches",
        "strided_form_table",
        "plan_in_background",
        "inplace_cycles",
        "_cycle_launches",
        "inplace_clusters",
    ),
    "fimoe_lab.kernels.cuda_driver": ("available", "_module", "launch"),
    "fimoe_lab.kernels.torch_gather": ("gather_torch", "inplace_strided"),
    "fimoe_lab.kernels.copy_then_gather": ("copy_then_gather",),
    "torch": ("empty",),  # allocations (a new block of the caching allocator: the driver's)
}
METHODS = {  # (module, class) -> methods whose main-thread time is summed
    ("fimoe_lab.layout", "IndexMap"): ("compiled", "apply", "apply_", "row_sources_on"),
    ("fimoe_lab.plan", "MapCall"): ("run",),
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt-oss-120b-mxfp4")
    ap.add_argument("--path", choices=("layer", "drop-in"), default="layer")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=0, help="experts (default: the model's)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--switch-interval", type=float, default=0.0, help="seconds (default: Python's)")
    args = ap.parse_args(argv)
    fmt, experts, hidden, inter, _, paths = MODELS[args.model]
    if args.path not in paths:
        ap.error(f"{args.model} has no {args.path} path (it has {', '.join(paths)})")
    experts = args.experts or experts
    shapes = (
        drop_in_shapes(fmt, experts, hidden, inter)
        if args.path == "drop-in"
        else {k: (experts, *s) for k, s in layer_shapes_of(fmt, hidden, inter).items()}
    )  # from a throwaway process: no plan is built here before the first layer
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    import torch

    from fimoe_lab import prepare  # noqa: F401 - imported untimed, as an engine has it before its first layer

    spent: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter[str] = collections.Counter()
    main_thread = threading.main_thread()

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            if threading.current_thread() is not main_thread:
                return fn(*a, **k)
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - start
                calls[name] += 1

        return wrapper

    for module_name, names in STAGES.items():
        module = importlib.import_module(module_name)
        for name in names:
            fn = getattr(module, name)
            wrapped = timed(f"{module_name.rsplit('.', 1)[-1]}.{name}", fn)
            if not module_name.startswith("fimoe_lab"):  # read as an attribute of its module
                setattr(module, name, wrapped)
            for other in list(sys.modules.values()):  # every module that imported it by name
                if getattr(other, "__name__", "").startswith("fimoe_lab") and getattr(other, name, None) is fn:
                    setattr(other, name, wrapped)
    for (module_name, class_name), names in METHODS.items():
        cls = getattr(importlib.import_module(module_name), class_name)
        for name in names:
            setattr(cls, name, timed(f"{class_name}.{name}", getattr(cls, name)))
    collecting: dict[str, float] = {}

    def garbage(phase: str, info: dict[str, int]) -> None:  # the collector's pauses, in whichever thread
        if phase == "start":
            collecting["since"] = time.perf_counter()
        elif "since" in collecting:
            name = f"gc.gen{info['generation']}"
            spent[name] += time.perf_counter() - collecting.pop("since")
            calls[name] += 1

    gc.callbacks.append(garbage)
    prebuilt = importlib.import_module("fimoe_lab.kernels.prebuilt")
    builds: list[tuple[float, float, str]] = []  # the planner thread's builds: start, end, map (and mode)
    build = prebuilt._PLANNER._build

    def build_logged(em: Any, in_place: bool, device: Any) -> None:
        start = time.perf_counter()
        try:
            build(em, in_place, device)
        finally:
            builds.append((start, time.perf_counter(), em.name + (" in place" if in_place else "")))

    prebuilt._PLANNER._build = build_logged
    plan_layer = importlib.import_module("fimoe_lab.recipes").plan_layer

    dev = torch.device(args.device)
    gen = torch.Generator(device=dev).manual_seed(0)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def run(t: dict[str, torch.Tensor]) -> Any:
        if args.path == "layer":
            plan = plan_layer(fmt, "trtllm", inter, hidden)
            return plan.apply(t["w13"], t["w2"], t.get("w13_scale"), t.get("w2_scale"))
        return run_drop_in(fmt, t["w13"], t["w2"])

    small = torch.randint(0, 256, (64, 64), dtype=torch.uint8, device=dev).view(torch.int64)
    small.t().contiguous()  # torch's first strided copy, as whole_model.py primes it
    sync()
    print(f"== {args.model} {args.path} on {dev}: switch interval {sys.getswitchinterval() * 1e3:.1f} ms")
    kept = []
    for layer in range(args.layers):
        t = {k: torch.randint(0, 256, s, dtype=torch.uint8, device=dev, generator=gen) for k, s in shapes.items()}
        sync()
        spent.clear()
        calls.clear()
        start = time.perf_counter()
        kept.append(run(t))
        host = time.perf_counter() - start
        sync()
        wall = time.perf_counter() - start
        stages = " ".join(
            f"{k}={v * 1e3:.2f}/{calls[k]}" for k, v in sorted(spent.items(), key=lambda kv: -kv[1]) if v > 2e-5
        )
        overlaps = [(name, min(b, start + wall) - max(a, start)) for a, b, name in list(builds)]
        planner = " ".join(f"{name}={ms * 1e3:.2f}" for name, ms in overlaps if ms > 0)
        print(
            f"  layer {layer}: host {host * 1e3:.2f} ms, wall {wall * 1e3:.2f} ms | {stages}"
            + (f" | planner: {planner}" if planner else "")
        )
        del t


if __name__ == "__main__":
    main()
