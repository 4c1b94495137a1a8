"""CPU probe: what a large output's fresh pages cost a layer's maps, against ``copy_``.

For each map of a model's ``layer`` plan (``plan_layer(fmt, "trtllm", ...)``, the sizes of
``whole_model.MODELS``), on the CPU executor (numba): the map into an output already written once
(``touched``) and into a new one (``fresh``: ``torch.empty`` + the map), beside ``copy_`` of the input's
bytes both ways and a first write of the new output alone (``fill``: ``fill_``). Tensors this large are
usually fresh ``mmap``\\ s, so a new output's first write also maps its pages; ``fresh - touched`` is what that
costs each side. Median of ``--repeats`` calls after one untimed call; the output of the map is compared
with its touched run's. Set ``THP_MEM_ALLOC_ENABLE=1`` to give torch's large CPU tensors huge pages.

    nice .venv/bin/python benchmarks/fresh_pages.py --model deepseek-v3-tp8-fp8 [--experts N] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from checkout import on_path  # noqa: E402  (PYTHONPATH=TREE measures TREE)

on_path()

import torch  # noqa: E402
from whole_model import MODELS  # noqa: E402  (the models' sizes, one table)

from fimoe_lab.kernels import execute  # noqa: E402
from fimoe_lab.recipes import plan_layer  # noqa: E402


def ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="deepseek-v3-tp8-fp8")
    ap.add_argument("--experts", type=int, default=None, help="experts (default: the model's)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    fmt, experts, hidden, inter, _, _ = MODELS[args.model]
    experts = args.experts or experts
    plan = plan_layer(fmt, "trtllm", inter, hidden)
    gen = torch.Generator().manual_seed(0)
    print(f"{args.model}, {experts} experts, THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}")
    for name, m in plan.maps().items():
        em = m.compiled()
        x = torch.randint(0, 256, (experts, em.in_bytes), dtype=torch.uint8, generator=gen)
        touched = torch.empty((experts, em.out_bytes), dtype=torch.uint8)
        copied = torch.empty_like(x)
        execute(em, x, touched, backend="numba")  # loads (or compiles) the kernel; writes every page once
        copied.copy_(x)
        want = touched.clone()
        times: dict[str, list[float]] = {
            k: [] for k in ("map touched", "map fresh", "copy_ touched", "copy_ fresh", "fill")
        }
        for _ in range(args.repeats):
            times["map touched"].append(ms(lambda: execute(em, x, touched, backend="numba")))
            fresh = torch.empty_like(touched)
            times["map fresh"].append(ms(lambda: execute(em, x, fresh, backend="numba")))
            assert torch.equal(fresh, want), name
            del fresh
            times["copy_ touched"].append(ms(lambda: copied.copy_(x)))
            times["copy_ fresh"].append(ms(lambda: torch.empty_like(x).copy_(x)))
            times["fill"].append(ms(lambda: torch.empty_like(touched).fill_(1)))
        assert torch.equal(touched, want), name
        med = {k: statistics.median(v) for k, v in times.items()}
        print(
            f"  {name:10s} in {x.nbytes / 1e6:7.1f} MB out {touched.nbytes / 1e6:7.1f} MB: "
            + ", ".join(f"{k} {v:6.1f} ms" for k, v in med.items())
        )


if __name__ == "__main__":
    main()
