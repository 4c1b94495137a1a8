"""Device probe: every map of the whole-model benchmark out of place, on each executor, at model size.

For each model of ``whole_model.MODELS`` (its per-rank sizes and experts), every map of its ``layer`` plan
(``plan_layer(fmt, "trtllm", ...)``) and of its drop-ins (:func:`fimoe_lab.prepare.drop_in_maps`): the
time of ``execute(em, x, out, backend=...)`` as a ratio to a same-run device copy of the same bytes
(median of 5, CUDA events; bytes moved = input + output), the executable form (``strided``, ``stages`` or
``index``), the cell width, and the first call's wall time in this process (index uploads, plans, kernel
loads). Every backend's output is compared with the first backend's. ``--back-to-back N`` times ``N`` calls in a
row between the events (per call: the host's work overlaps the device's, as a layer's maps do; 1, the default,
times one call from an idle device, host included); ``--maps`` keeps the maps whose name has that text.

    PYTHONPATH=. python3 benchmarks/probe_gather.py [--backends torch,prebuilt,triton] [--out FILE]
    PYTHONPATH=. python3 benchmarks/probe_gather.py --backends torch,prebuilt --maps scale --back-to-back 10
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from checkout import on_path  # noqa: E402  (PYTHONPATH=TREE measures TREE)

on_path()

import torch  # noqa: E402
from probe_strided_copies import event_ms  # noqa: E402  (the same event timing)
from whole_model import MODELS  # noqa: E402  (the models' sizes, one table)

from fimoe_lab.kernels import execute  # noqa: E402
from fimoe_lab.prepare import drop_in_maps, plan_layer  # noqa: E402


def model_maps(fmt: str, hidden: int, inter: int, paths) -> dict:
    plan = plan_layer(fmt, "trtllm", inter, hidden)
    maps = {f"layer/{k}": m for k, m in plan.maps().items()}
    if "drop-in" in paths:
        drop = drop_in_maps(fmt, plan.padded_intermediate, plan.padded_hidden)
        maps |= {f"drop-in/{k}": m for k, (m, _) in drop.items()}
    return maps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", default="torch,prebuilt,triton")
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--maps", default="", help="only the maps whose name contains this")
    ap.add_argument("--back-to-back", type=int, default=1, help="calls timed in a row (per call: their mean)")
    args = ap.parse_args()
    n = args.back_to_back

    def calls(fn):
        def run():
            for _ in range(n):
                fn()

        return run

    backends = args.backends.split(",")
    rows = []
    for model, (fmt, experts, hidden, inter, _, paths) in MODELS.items():
        for name, m in model_maps(fmt, hidden, inter, paths).items():
            if args.maps not in name:
                continue
            em = m.compiled()
            x = torch.randint(0, 256, (experts, em.in_bytes), dtype=torch.uint8, device="cuda")
            out = torch.empty((experts, em.out_bytes), dtype=torch.uint8, device="cuda")
            y = torch.empty_like(x)
            copy_ms = event_ms(calls(lambda: y.copy_(x))) / n * (em.in_bytes + em.out_bytes) / (2 * em.in_bytes)
            form = "strided" if em.strided is not None else ("stages" if em.stages is not None else "index")
            row = {"model": model, "map": name, "MB": round(x.numel() / 1e6, 1), "cell": em.cell_bytes, "form": form}
            want = None
            for b in backends:
                start = time.perf_counter()
                execute(em, x, out, backend=b)
                torch.cuda.synchronize()
                row[f"{b}_first_ms"] = round((time.perf_counter() - start) * 1e3, 2)
                want = out.clone() if want is None else want
                if not torch.equal(out, want):
                    row[b] = "DIFFERENT"
                    continue
                row[b] = round(copy_ms * n / event_ms(calls(lambda b=b: execute(em, x, out, backend=b))), 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
            del x, out, y, want
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            env = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
            json.dump({"command": " ".join(sys.argv), "env": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
