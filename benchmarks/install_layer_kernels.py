"""One steady layer of vLLM's own preparation entry point after ``fimoe_lab.integrations.vllm.install()``: its
kernels on the device, in order, with their start and duration, and the host's torch calls (the torch profiler).

Each format runs ``--layers`` untimed layers first (the background planner finishes before the profiled one), then
one layer under the profiler; inputs are ``integration_bench.make_inputs`` at a TP8 rank's sizes (vLLM's files staged:
``python benchmarks/integration_bench.py --stage VENV``, carried as ``build/engine_src``)::

    PYTHONPATH=. python3 benchmarks/install_layer_kernels.py [--formats nvfp4 mxfp4-gptoss] > OUT.txt
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import integration_bench  # noqa: E402  (puts this checkout on the path)
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

SIZES = {  # format -> (experts, hidden, intermediate) of the TP8 rank (gpt-oss: the sizes vLLM allocates)
    "fp8-tensor": (256, 7168, 256),
    "fp8-block": (256, 7168, 256),
    "bf16": (128, 4096, 256),
    "nvfp4": (256, 7168, 256),
    "mxfp4-gptoss": (128, 3072, 2944),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", nargs="*", default=["nvfp4", "mxfp4-gptoss"], choices=sorted(SIZES))
    ap.add_argument("--layers", type=int, default=6, help="untimed layers before the profiled one")
    args = ap.parse_args()
    mods = integration_bench.load_engine("vllm")
    from fimoe_lab.integrations import FALLBACKS
    from fimoe_lab.integrations import vllm as integration
    from fimoe_lab.kernels import prebuilt

    integration.install(force=True)
    dev = torch.device("cuda")
    for fmt in args.formats:
        e, h, i = SIZES[fmt]
        keep = []
        for k in range(args.layers):
            t = integration_bench.make_inputs(fmt, e, h, i, dev)
            torch.cuda.synchronize()
            a = time.perf_counter()
            keep.append(integration_bench.prepare("vllm", fmt, mods, t, h, i))
            torch.cuda.synchronize()
            print(f"{fmt} layer {k}: {(time.perf_counter() - a) * 1e3:.2f} ms", flush=True)
        prebuilt.wait_for_plans()
        t = integration_bench.make_inputs(fmt, e, h, i, dev)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            keep.append(integration_bench.prepare("vllm", fmt, mods, t, h, i))
            torch.cuda.synchronize()
        kernels = sorted(
            (ev for ev in prof.events() if ev.device_type.name == "CUDA"), key=lambda ev: ev.time_range.start
        )
        t0 = kernels[0].time_range.start if kernels else 0
        print(f"{fmt}: the profiled layer's kernels (start ms, duration ms, name)")
        for ev in kernels:
            start, took = (ev.time_range.start - t0) / 1e3, (ev.time_range.end - ev.time_range.start) / 1e3
            print(f"  {start:8.3f} {took:7.3f} {ev.name[:90]}")
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
        del keep, t
        torch.cuda.empty_cache()
    print("replacements that ran vLLM's code:", dict(FALLBACKS) or "none")


if __name__ == "__main__":
    main()
