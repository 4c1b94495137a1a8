"""The host time of a model's steady MoE layers on the layer path, against allocate+copy, with a profile of the calls.

As ``benchmarks/whole_model.py``'s child does: for every layer fresh random inputs on the device, a synchronisation,
the calls (timed until they return: what the host spends queueing the layer), a synchronisation; outputs kept. Sides
(one process, in this order): ``ours`` (``plan_layer(...).apply``), ``ours_pre`` (the layer's outputs allocated
first, then each map's ``IndexMap.apply(x, out=...)``), ``ours_first`` (the first map's output allocated and launched,
then the others allocated, then launched), ``ours_stamped`` (plan, check, then per map ``torch.empty`` and
``kernels.execute``, each stage timed: their medians are printed), ``copy`` (``empty_like`` + ``copy_`` per tensor)
and ``copy_pre`` (every ``empty_like`` first). Prints each side's median over the odd layers from the fifth on, and a
cProfile of the even ones of ``ours_pre`` (top functions by own time). Needs a CUDA device.

    PYTHONPATH=. python3 benchmarks/steady_layer_host.py deepseek-r1-tp8-nvfp4 qwen3-235b-tp8-bf16
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import whole_model  # noqa: E402  (the models' sizes and input shapes, one table)

from fimoe_lab import prepare  # noqa: E402, F401  (imported before the clock, as an engine has it)
from fimoe_lab.kernels import execute  # noqa: E402
from fimoe_lab.recipes import plan_layer  # noqa: E402


def sides(fmt: str, experts: int, hidden: int, inter: int, dev: torch.device) -> dict:
    def new_out(m) -> torch.Tensor:
        return torch.empty((experts, *m.out_shape), dtype=torch.uint8, device=dev)

    def ours(t: dict) -> list:
        plan = plan_layer(fmt, "trtllm", inter, hidden)
        return [o for o in plan.apply(t["w13"], t["w2"], t.get("w13_scale"), t.get("w2_scale")) if o is not None]

    def ours_pre(t: dict) -> list:
        maps = plan_layer(fmt, "trtllm", inter, hidden).maps()
        outs = {n: new_out(m) for n, m in maps.items()}
        for n, m in maps.items():
            m.apply(t[n], out=outs[n])
        return list(outs.values())

    def ours_first(t: dict) -> list:
        maps = plan_layer(fmt, "trtllm", inter, hidden).maps()
        names = list(maps)
        outs = {names[0]: new_out(maps[names[0]])}
        maps[names[0]].apply(t[names[0]], out=outs[names[0]])
        outs.update({n: new_out(maps[n]) for n in names[1:]})
        for n in names[1:]:
            maps[n].apply(t[n], out=outs[n])
        return list(outs.values())

    def ours_stamped(t: dict) -> list:
        stamp = [time.perf_counter()]
        plan = plan_layer(fmt, "trtllm", inter, hidden)
        stamp.append(time.perf_counter())
        plan.check(**t)
        stamp.append(time.perf_counter())
        outs = []
        for n, m in plan.maps().items():
            out = new_out(m)
            stamp.append(time.perf_counter())
            execute(m.compiled(), t[n], out)
            stamp.append(time.perf_counter())
            outs.append(out)
        STAMPS.append([1e6 * (b - a) for a, b in zip(stamp, stamp[1:])])
        return outs

    def copy_pre(t: dict) -> list:
        outs = [torch.empty_like(x) for x in t.values()]
        for x, y in zip(t.values(), outs):
            y.copy_(x)
        return outs

    return {
        "ours": ours,
        "ours_pre": ours_pre,
        "ours_first": ours_first,
        "ours_stamped": ours_stamped,
        "copy": whole_model.copy_layer,
        "copy_pre": copy_pre,
    }


STAMPS: list[list[float]] = []
"""``ours_stamped``'s stage times (us) per layer: plan_layer, check, then per map torch.empty and execute."""


def main(models: list[str]) -> None:
    dev = torch.device("cuda")
    for model in models:
        fmt, experts, hidden, inter, layers, _ = whole_model.MODELS[model]
        shapes = whole_model.layer_shapes_of(fmt, hidden, inter)
        gen = torch.Generator(device=dev).manual_seed(0)
        for name, fn in sides(fmt, experts, hidden, inter, dev).items():
            kept, host, prof = [], [], cProfile.Profile()
            for i in range(layers):
                t = {
                    k: torch.randint(0, 256, (experts, *s), dtype=torch.uint8, device=dev, generator=gen)
                    for k, s in shapes.items()
                }
                torch.cuda.synchronize()
                profiled = i >= 5 and i % 2 == 0
                a = time.perf_counter()
                if profiled:
                    prof.enable()
                kept.append(fn(t))
                if profiled:
                    prof.disable()
                host.append(time.perf_counter() - a)
                torch.cuda.synchronize()
                del t
            plain = sorted(h for i, h in enumerate(host) if i >= 5 and i % 2 == 1)
            print(f"{model} {name}: host median (unprofiled) {1e3 * plain[len(plain) // 2]:.3f} ms", flush=True)
            if name == "ours_stamped":
                steady = [row for i, row in enumerate(STAMPS) if i >= 5]
                medians = [sorted(col)[len(col) // 2] for col in zip(*steady)]
                labels = ["plan_layer", "check"] + [f"{n} {part}" for n in shapes for part in ("empty", "execute")]
                print("  stages (us): " + ", ".join(f"{k} {v:.1f}" for k, v in zip(labels, medians)), flush=True)
                STAMPS.clear()
            if name == "ours_pre":
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
                print(out.getvalue()[:4000])
            del kept
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:] or ["deepseek-r1-tp8-nvfp4"])
