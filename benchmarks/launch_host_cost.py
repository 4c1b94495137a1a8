"""Where one steady call's host time goes: a map already run on its prebuilt kernel, called again, layer by layer.

A model's steady layers call each map with new buffers of the same shapes. This times, on one map (DeepSeek-R1
NVFP4 ``w2`` by default: one strided launch), each layer of that call's host path, the innermost alone:

- ``IndexMap.apply(x, out=...)``: the public call (checks, executor choice, the gather);
- ``execute(em, x, out)``: the executor's entry (:func:`fimoe_lab.kernels.execute`);
- ``get_executor`` and ``_check_gather``: its two steps before the gather;
- the registry's prebuilt gather (the map's kept launches, run at the call's addresses);
- ``cuda_driver.run`` of that launch, ``cuda_driver.launch`` of the same kernel and arguments, and the bare
  ``cuLaunchKernelEx`` ctypes call;
- ``copy_`` and ``empty_like`` of the input: a copy's whole host path.

Each is timed back to back (``--calls``, then synchronised) and, 200 times, alone after a synchronise (the device
idle, as a model's first call of a layer finds it); medians of the latter. ``--experts 1`` keeps the device's time
under the host's, so back-to-back figures are the host's.

    PYTHONPATH=. python3 benchmarks/launch_host_cost.py
    PYTHONPATH=. python3 benchmarks/launch_host_cost.py --experts 256  # device-bound: back to back is the kernel
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=1)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args(argv)

    import torch

    from fimoe_lab import kernels
    from fimoe_lab.kernels import cuda_driver, prebuilt, registry
    from fimoe_lab.recipes import plan_layer

    if not torch.cuda.is_available():
        raise SystemExit("launch_host_cost.py times CUDA launches: run it on a machine with a CUDA device")
    dev = torch.device("cuda")
    m = plan_layer("nvfp4", "trtllm", 256, 7168).w2
    em = m.compiled()
    x = torch.randint(0, 256, (args.experts, *m.in_shape), dtype=torch.uint8, device=dev)
    out = m.apply(x)
    prebuilt.wait_for_plans()
    m.apply(x, out=out)
    torch.cuda.synchronize()
    kept = [v for k, v in em._dev.items() if k[0] == prebuilt._KEPT_LAUNCHES]
    if len(kept) != 1 or len(kept[0]) != 1:
        raise SystemExit(f"expected one kept launch of {em.name}, found {kept}")
    bound, _, _ = kept[0][0]
    addresses = (out.data_ptr(), x.data_ptr())
    args_now = [(kind, a) for (kind, _), a in zip(bound.args, addresses)] + bound.args[2:]
    built = bound._launch
    lib = cuda_driver._lib()
    gather = registry.EXECUTORS["prebuilt"].gather
    y = torch.empty_like(x)

    def raw() -> None:
        built.config.stream = cuda_driver._current_stream(bound.index)
        lib.cuLaunchKernelEx(built.config_ref, built.fn, built.params, None)

    steps = {
        "IndexMap.apply(x, out=out)": lambda: m.apply(x, out=out),
        "execute(em, x, out)": lambda: kernels.execute(em, x, out),
        "get_executor": lambda: kernels.get_executor(None, x.device, out.nbytes, em=em),
        "_check_gather": lambda: kernels._check_gather(em, x, out),
        "registry prebuilt gather": lambda: gather(em, x, out),
        "cuda_driver.run (kept launch)": lambda: cuda_driver.run(bound, *addresses),
        "cuda_driver.launch (same launch)": lambda: cuda_driver.launch(
            bound.source, bound.name, dev, bound.grid, bound.block, args_now
        ),
        "cuLaunchKernelEx (ctypes)": raw,
        "torch copy_": lambda: y.copy_(x),
        "torch empty_like": lambda: torch.empty_like(x),
    }
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}; {em.name}, {args.experts} experts")
    for label, fn in steps.items():
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.calls):
            fn()
        back_to_back = (time.perf_counter() - start) / args.calls
        torch.cuda.synchronize()
        alone = []
        for _ in range(200):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            alone.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        print(
            f"{label:34s} back to back {back_to_back * 1e6:7.2f} us, alone: median {statistics.median(alone) * 1e6:7.2f} "
            f"us, p90 {sorted(alone)[179] * 1e6:7.2f}"
        )


if __name__ == "__main__":
    main()
