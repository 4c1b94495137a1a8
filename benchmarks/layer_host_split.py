"""Where a steady-state layer's host time goes: allocating each output against running its map, beside a copy.

In a whole model (``benchmarks/whole_model.py``) a layer can wait on the host: its calls return close to the
layer's end. This splits one layer's host time per tensor of ``plan_layer(fmt, "trtllm", I, H)`` (the ``layer``
path of ``whole_model.py``'s ``MODELS``), after ``--warm`` layers and the background planner are done:

- ``alloc``: ``torch.empty`` of the map's output;
- ``map_into``: ``IndexMap.apply(x, out=...)`` into that output (the map's calls: checks, views, launches);
- ``apply_map``: both in one call, as a layer plan runs them;
- ``copy_alloc`` / ``copy``: ``torch.empty_like(x)`` / ``.copy_(x)`` of the same input (the baseline's calls).

Times are host wall times until the calls return (the device synchronised before each), medians over
``--layers`` layers; every output is kept, as a loading engine keeps them, so each allocation is a new one.
The whole ``plan.apply`` of a layer is timed too. ``--timeline`` then profiles one more layer (``torch.profiler``,
CUDA activity; ``--timeline drop-in`` runs the format's drop-in instead, as ``whole_model.py`` does) and prints
each device kernel's start and duration: where the device waits between kernels, it waits for the host.
``--launches`` times the same calls without a profiler (whose own cost moves every start): the host's time of each
kernel launch from the call's start, and the device's end of each launch (an event recorded after it, against one
recorded right before the call on the idle device), beside a copy of the tensors the call returned (``empty_like`` +
``copy_``). ``--host-profile`` runs calls under cProfile and prints the functions of most time a call.

    PYTHONPATH=. python3 benchmarks/layer_host_split.py --model deepseek-r1-tp8-nvfp4 --layers 12
    PYTHONPATH=. python3 benchmarks/layer_host_split.py --model gpt-oss-120b-mxfp4 --layers 6  # ~45 GB kept
    PYTHONPATH=. python3 benchmarks/layer_host_split.py --model qwen3-235b-tp8-bf16 --layers 4 --timeline drop-in
    PYTHONPATH=. python3 benchmarks/layer_host_split.py --model qwen3-235b-tp8-bf16 --layers 2 --timeline drop-in \
        --launches 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from whole_model import MODELS, drop_in_shapes, run_drop_in  # noqa: E402  (the models and drop-ins, one table)

STEPS = ("alloc", "map_into", "apply_map", "copy_alloc", "copy")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="deepseek-r1-tp8-nvfp4")
    ap.add_argument("--layers", type=int, default=12, help="steady-state layers timed (outputs kept)")
    ap.add_argument("--warm", type=int, default=3, help="layers run first, untimed")
    ap.add_argument("--experts", type=int, default=0, help="experts (default: the model's)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--timeline", choices=("layer", "drop-in"), help="then profile one layer's device kernels")
    ap.add_argument(
        "--launches",
        type=int,
        default=0,
        help="then time this many calls' launches, host and device, unprofiled (calls of --timeline's kind, else layers)",
    )
    ap.add_argument(
        "--host-profile",
        type=int,
        default=0,
        help="then run this many calls under cProfile: where their host time goes (of --timeline's kind, else layers)",
    )
    args = ap.parse_args(argv)

    import torch

    from fimoe_lab.kernels import prebuilt
    from fimoe_lab.plan import apply_map
    from fimoe_lab.recipes import plan_layer

    fmt, experts, hidden, inter, _, _ = MODELS[args.model]
    experts = args.experts or experts
    dev = torch.device(args.device)
    gen = torch.Generator(device=dev).manual_seed(0)
    plan = plan_layer(fmt, "trtllm", inter, hidden)
    maps = plan.maps()

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def make() -> dict[str, torch.Tensor]:
        return {
            k: torch.randint(0, 256, (experts, *m.in_shape), dtype=torch.uint8, device=dev, generator=gen)
            for k, m in maps.items()
        }

    def run_plan(t: dict[str, torch.Tensor]):
        return plan.apply(t["w13"], t["w2"], t.get("w13_scale"), t.get("w2_scale"))

    def call_of(kind: str | None):
        """A call of ``kind`` (``--timeline``'s; None: the layer's) on a layer of its own, made now."""
        if kind == "drop-in":
            return drop_in_call(fmt, hidden, inter, experts, dev, gen)
        layer = make()
        return lambda: run_plan(layer)

    kept: list = []
    for _ in range(args.warm):
        t = make()
        sync()
        kept.append(run_plan(t))
        sync()
    prebuilt.wait_for_plans()
    rows: dict[str, dict[str, list[float]]] = {k: {s: [] for s in STEPS} for k in maps}
    whole = []
    for _ in range(args.layers):
        t = make()
        sync()
        for k, m in maps.items():
            x, got = t[k], rows[k]
            a = time.perf_counter()
            out = torch.empty((experts, *m.out_shape), dtype=torch.uint8, device=dev)
            b = time.perf_counter()
            m.apply(x, out=out)
            c = time.perf_counter()
            sync()
            got["alloc"].append(b - a)
            got["map_into"].append(c - b)
            a = time.perf_counter()
            mapped = apply_map(m, x, k)
            got["apply_map"].append(time.perf_counter() - a)
            sync()
            kept += [out, mapped]
            a = time.perf_counter()
            y = torch.empty_like(x)
            b = time.perf_counter()
            y.copy_(x)
            c = time.perf_counter()
            sync()
            got["copy_alloc"].append(b - a)
            got["copy"].append(c - b)
            kept.append(y)
        a = time.perf_counter()
        kept.append(run_plan(t))
        whole.append(time.perf_counter() - a)
        sync()
    print(
        f"== {args.model}: host ms, median of {args.layers} steady layers "
        f"(whole plan.apply host {statistics.median(whole) * 1e3:.3f})"
    )
    for k, got in rows.items():
        cells = "  ".join(f"{s} {statistics.median(got[s]) * 1e3:.3f}" for s in STEPS)
        print(f"  {k:10s} {cells}   out MB {experts * maps[k].out_bytes / 1e6:.0f}")
    if args.timeline == "drop-in":
        for _ in range(args.warm):  # the drop-in's own maps planned, as in a steady layer of whole_model.py
            kept.append(drop_in_call(fmt, hidden, inter, experts, dev, gen)())
        sync()
        prebuilt.wait_for_plans()
    profiled = [call_of(args.timeline) for _ in range(args.host_profile)]
    timed = [call_of(args.timeline) for _ in range(args.launches)]
    for _ in range((2 if args.timeline == "drop-in" else 1) if args.timeline else 0):
        timeline(call_of(args.timeline), sync, kept)
    if timed:
        launch_offsets(timed, sync, kept, dev)
    if profiled:
        host_profile(profiled, sync, kept)


def drop_in_call(fmt: str, hidden: int, inter: int, experts: int, dev, gen):
    """The format's drop-in on a fresh layer of the sizes an engine passes it (``whole_model.py``'s drop-in path)."""
    import torch

    w13, w2 = (
        torch.randint(0, 256, shape, dtype=torch.uint8, device=dev, generator=gen)
        for shape in drop_in_shapes(fmt, experts, hidden, inter).values()
    )
    return lambda: run_drop_in(fmt, w13, w2)


def timeline(run, sync, kept: list) -> None:
    """``run()`` under ``torch.profiler``: each device kernel's start and duration, ms from the call's start
    (``record_function`` around it; the host's return is printed too), and the device's idle time from the call's
    start to its last kernel's end."""
    from torch.profiler import ProfilerActivity, profile, record_function

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("timed_call"):
            kept.append(run())
        sync()
    on_device = (e for e in prof.events() if e.device_type.name == "CUDA" and e.name != "timed_call")  # no annotation
    events = sorted(on_device, key=lambda e: e.time_range.start)
    if not events:
        print("  no device kernels recorded")
        return
    call = next(e for e in prof.events() if e.name == "timed_call" and e.device_type.name == "CPU")
    t0 = call.time_range.start
    busy = sum(e.time_range.end - e.time_range.start for e in events)
    end = events[-1].time_range.end
    print(
        f"  device: {len(events)} kernels, busy {busy / 1e3:.3f} ms, idle {(end - t0 - busy) / 1e3:.3f} ms; first "
        f"starts {(events[0].time_range.start - t0) / 1e3:.3f}, last ends {(end - t0) / 1e3:.3f}, host returns "
        f"{(call.time_range.end - t0) / 1e3:.3f} ms after the call"
    )
    for e in events:
        start, took = (e.time_range.start - t0) / 1e3, (e.time_range.end - e.time_range.start) / 1e3
        print(f"    {e.name[:60]:60s} start {start:7.3f} dur {took:6.3f}")


def host_profile(calls: list, sync, kept: list) -> None:
    """``calls`` under ``cProfile`` (the device synchronised between them, not profiled): the functions of most
    own time and of most time with what they call, per call (cProfile's own cost included: compare the rows)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    for call in calls:
        sync()
        profiler.enable()
        kept.append(call())
        profiler.disable()
    sync()
    stats = pstats.Stats(profiler)
    print(f"  host profile of {len(calls)} calls (us a call):")
    rows = [(key, value) for key, value in stats.stats.items()]  # type: ignore[attr-defined]
    for label, index in (("own", 2), ("with callees", 3)):
        print(f"   by time {label}:")
        for (path, line, name), value in sorted(rows, key=lambda r: -r[1][index])[:22]:
            where = f"{os.path.basename(path)}:{line}" if line else path
            print(f"     {value[index] / len(calls) * 1e6:8.1f}  {value[1] / len(calls):5.1f} calls  {name} ({where})")


def launch_offsets(calls: list, sync, kept: list, dev) -> None:
    """Each of ``calls`` unprofiled: the host's time of each kernel launch from the call's start and the device's
    end of each (an event recorded right after the launch; a first one right before the call, on the idle device),
    then a copy of the tensors the last call returned, the same way (each ``copy_`` a launch); medians over the
    calls, ms."""
    import torch

    from fimoe_lab.kernels import cuda_driver

    if dev.type != "cuda":
        print("  --launches: no kernel launches on a CPU device")
        return
    fire = cuda_driver._Launch.fire
    seen: list[tuple[float, torch.cuda.Event]] = []

    def stamp() -> None:  # a launch just queued: the host's time now, and an event after it on the device
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        seen.append((time.perf_counter(), event))

    def timed_fire(self, index: int, name: str) -> None:
        fire(self, index, name)
        stamp()

    def copies(tensors: list) -> list:
        outs = []
        for x in tensors:
            y = torch.empty_like(x)
            y.copy_(x)
            stamp()
            outs.append(y)
        return outs

    def one(run) -> tuple[list[float], list[float], float, float]:
        seen.clear()
        sync()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        a = time.perf_counter()
        kept.append(run())
        back = time.perf_counter() - a
        sync()
        host = [(t - a) * 1e3 for t, _ in seen]
        ends = [start.elapsed_time(e) for _, e in seen]
        return host, ends, back * 1e3, max(ends, default=0.0)

    cuda_driver._Launch.fire = timed_fire
    try:
        ours = [one(call) for call in calls]
    finally:
        cuda_driver._Launch.fire = fire
    last = kept[-1] if isinstance(kept[-1], (list, tuple)) else []
    returned = [t for t in last if isinstance(t, torch.Tensor)]
    theirs = [one(lambda: copies(returned)) for _ in calls] if returned else []
    for label, runs in (("ours", ours), ("copy", theirs)):
        if not runs:
            continue
        n = min(len(r[0]) for r in runs)
        med = statistics.median
        host = "  ".join(f"{med(r[0][i] for r in runs):6.3f}" for i in range(n))
        ends = "  ".join(f"{med(r[1][i] for r in runs):6.3f}" for i in range(n))
        print(
            f"  {label}: {n} launches; host launches at {host} ms; device ends at {ends} ms; host returns "
            f"{med(r[2] for r in runs):.3f} ms, device done {med(r[3] for r in runs):.3f} ms after the call "
            f"(medians of {len(runs)} calls)"
        )


if __name__ == "__main__":
    main()
