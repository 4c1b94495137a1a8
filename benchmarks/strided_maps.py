"""Every map an engine prepares at model size, run as torch strided copies, against a same-run copy.

For each layer of ``whole_model.MODELS`` (all experts), each map of ``plan_layer(fmt, "trtllm")``
and of the drop-ins (``prepare.drop_in_maps``): the torch executor's strided copies out of place
(``ratio = (bytes in + bytes out) / time / (2 * bytes in / copy time)``, the copy a contiguous
``copy_`` of the input into a preallocated buffer), and for permutations the in-place strided
strategy with the default scratch (two passes: its ceiling is 0.5). Median of ``--repeats``
calls timed with events around one call each, host time included. No compiler runs: the maps
that have a strided form (or two strided stages) need none.

    PYTHONPATH=. python3 benchmarks/strided_maps.py --out benchmarks/results/strided_maps_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkout import on_path  # noqa: E402  (PYTHONPATH=TREE measures TREE)

on_path()

import torch  # noqa: E402
from whole_model import MODELS  # noqa: E402

from fimoe_lab.kernels import execute, execute_in_place  # noqa: E402
from fimoe_lab.prepare import drop_in_maps, plan_layer  # noqa: E402


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of ``fn()`` (events on CUDA, host clock on the CPU)."""
    import time

    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--experts", type=int, default=0, help="experts (default: the model's)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = torch.device(args.device)
    rows = []
    for model, (fmt, experts, hidden, inter, _, _) in MODELS.items():
        e = args.experts or experts
        plan = plan_layer(fmt, "trtllm", inter, hidden)
        maps = {f"layer/{k}": m for k, m in plan.maps().items()}
        maps |= {k: m for k, (m, _) in drop_in_maps(fmt, plan.padded_intermediate, plan.padded_hidden).items()}
        for name, m in maps.items():
            em = m.compiled()
            x = torch.randint(0, 256, (e, m.in_bytes), dtype=torch.uint8, device=dev)
            out = torch.empty((e, m.out_bytes), dtype=torch.uint8, device=dev)
            dst = torch.empty_like(x)
            copy = timed(lambda: dst.copy_(x), args.repeats, dev)
            gather = timed(lambda: execute(em, x, out, backend="torch"), args.repeats, dev)
            ratio = (m.in_bytes + m.out_bytes) / gather / (2 * m.in_bytes / copy)
            row = dict(
                model=model,
                map=name,
                form="strided" if em.strided is not None else ("stages" if em.stages is not None else "gather"),
                negative_stride_digits=0 if em.strided is None else sum(1 for s in em.strided.strides if s < 0),
                mb=e * m.in_bytes / 1e6,
                copy_ms=copy * 1e3,
                torch_ms=gather * 1e3,
                ratio=ratio,
            )
            if em.is_permutation:
                row["in_place_ms"] = timed(lambda: execute_in_place(em, x, backend="torch"), args.repeats, dev) * 1e3
                row["in_place_ratio"] = copy * 1e3 / row["in_place_ms"]
            rows.append(row)
            print(
                f"{model:28s} {name:36s} {row['form']:7s} {row['mb']:8.1f} MB copy {row['copy_ms']:.3f} ms "
                f"torch {row['torch_ms']:.3f} ms ratio {ratio:.2f}"
                + (
                    f" in place {row['in_place_ms']:.3f} ms ({row['in_place_ratio']:.2f})"
                    if "in_place_ms" in row
                    else ""
                ),
                flush=True,
            )
            del x, out, dst
    if args.out:
        env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"}
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "env": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
