"""In place by thread-block clusters that hold whole experts on chip, against a copy and the cycle kernel.

The kernels (``benchmarks/cuda/cluster_inplace.cu``) permute each expert's cells in place with one barrier an expert:
a cluster of C blocks loads the whole expert (into registers and shared memory), meets, and stores it. For each map
below (model sizes, TP8 ranks unless named) and each configuration (C, gather or scatter, threads, a persistent grid
or a cluster per expert, streaming stores), the probe checks the result bit-exact against torch's gather and times
it (CUDA events, median of 15 calls behind a device sleep) against ``copy_`` of the same bytes and the prebuilt
executor's in-place kernels on the same map (its cycle kernel, the map's plan built, and its ``clusters`` strategy:
``kernels/cuda/cluster.cu``, two of these designs; ``--shipped``: those alone). Needs an sm_90 GPU and the probe's
kernels built first::

    nvcc -fatbin -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -o /tmp/cluster_inplace.fatbin \\
        benchmarks/cuda/cluster_inplace.cu
    PYTHONPATH=. python3 benchmarks/probe_cluster_inplace.py --fatbin /tmp/cluster_inplace.fatbin --out OUT.json
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import pathlib
import statistics

import numpy as np
import torch

from fimoe_lab import kernels
from fimoe_lab.kernels import prebuilt
from fimoe_lab.prepare import drop_in_maps, plan_layer

CASES = [  # label, format, intermediate, hidden, experts, tensor (a layer plan's, or "drop-in/tensor")
    ("qwen3-235b-tp8 bf16 block drop-in W2", "bf16", 192, 4096, 128, "trtllm_block_layout/w2"),
    ("qwen3-235b-tp8 bf16 block drop-in W13", "bf16", 192, 4096, 128, "trtllm_block_layout/w13"),
    ("qwen3-235b-tp8 bf16 block drop-in W2, padded 256", "bf16", 256, 4096, 128, "trtllm_block_layout/w2"),
    ("qwen3-235b-tp8 bf16 block drop-in W13, padded 256", "bf16", 256, 4096, 128, "trtllm_block_layout/w13"),
    ("deepseek-v3-tp8 fp8 block W13", "fp8-block", 256, 7168, 256, "w13"),
    ("deepseek-v3-tp8 fp8 block W2", "fp8-block", 256, 7168, 256, "w2"),
    ("deepseek-r1-tp8 nvfp4 W13", "nvfp4", 256, 7168, 256, "w13"),
    ("deepseek-r1-tp8 nvfp4 W2", "nvfp4", 256, 7168, 256, "w2"),
    ("deepseek-v3-tp8 fp8 rotate W13", "fp8", 256, 7168, 256, "w13"),
    ("deepseek-v3-tp8 fp8 rotate W2", "fp8", 256, 7168, 256, "w2"),
    ("deepseek-v3 mxfp8 W13 scales", "mxfp8", 2048, 7168, 256, "w13_scale"),
    ("deepseek-v3 mxfp8 W2 scales", "mxfp8", 2048, 7168, 256, "w2_scale"),
    ("deepseek-r1 nvfp4 W13 scales", "nvfp4", 2048, 7168, 256, "w13_scale"),
    ("deepseek-r1 nvfp4 W2 scales", "nvfp4", 2048, 7168, 256, "w2_scale"),
    ("deepseek-r1-tp8 nvfp4 W13 scales", "nvfp4", 256, 7168, 256, "w13_scale"),
]
SHARED_MAX = prebuilt.CLUSTER_SHARED_MAX  # an sm_90 block's dynamic shared memory at most (227 KiB)
HELD_WORDS = 16  # 16-byte words a thread holds in registers (the _r16 kernels, 512 threads)
NAMES = [f"clu_{mode}_{kind}" for mode in ("gather", "scatter") for kind in ("any", "c8", "any_r16", "c8_r16", "w4")]
NAMES += ["clu_pipe_any", "clu_pipe_c8", "clu_spill_any", "clu_spill_c8"]
TWO_A_MULTIPROCESSOR = prebuilt._TWO_A_MULTIPROCESSOR  # the most shared memory a block may take for two to share one


@functools.cache
def lib() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


_IMAGES: list = []


def check(result: int, what: str) -> None:
    if result:
        name = ctypes.c_char_p()
        lib().cuGetErrorName(result, ctypes.byref(name))
        raise RuntimeError(f"{what}: {name.value} ({result})")


class Attr(ctypes.Structure):  # CUlaunchAttribute holding a cluster dimension
    _fields_ = [
        ("id", ctypes.c_uint),
        ("pad", ctypes.c_uint),
        ("dims", ctypes.c_uint * 3),
        ("rest", ctypes.c_char * 52),
    ]


class Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(Attr)),
        ("num_attrs", ctypes.c_uint),
    ]


def functions(fatbin: str) -> dict[str, int]:
    torch.zeros(1, device="cuda")  # torch's primary context, current
    image = pathlib.Path(fatbin).read_bytes()
    kept = ctypes.create_string_buffer(image, len(image))
    _IMAGES.append(kept)  # the module's image, kept for the process's life
    module = ctypes.c_void_p()
    check(lib().cuModuleLoadData(ctypes.byref(module), kept), "cuModuleLoadData")
    found = {}
    for name in NAMES:
        fn = ctypes.c_void_p()
        check(lib().cuModuleGetFunction(ctypes.byref(fn), module, name.encode()), name)
        check(lib().cuFuncSetAttribute(fn, 8, SHARED_MAX), "max dynamic shared memory")
        check(lib().cuFuncSetAttribute(fn, 14, 1), "non-portable cluster size")
        found[name] = fn
    return found


def config(cluster: int, threads: int, shared: int, grid: int) -> tuple[Config, ctypes.Array]:
    attrs = (Attr * 1)()
    attrs[0].id, attrs[0].dims[:] = 4, (cluster, 1, 1)
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    made = Config((grid, 1, 1), (threads, 1, 1), shared, stream, attrs, 1)
    return made, attrs


def max_clusters(fn, cluster: int, threads: int, shared: int) -> int:
    made, _attrs = config(cluster, threads, shared, cluster)
    count = ctypes.c_int()
    result = lib().cuOccupancyMaxActiveClusters(ctypes.byref(count), fn, ctypes.byref(made))
    return count.value if result == 0 else -result


def launch(fn, cluster: int, threads: int, shared: int, grid: int, args: tuple) -> None:
    """``args``: the kernels' eight arguments, then the spilling kernels' scratch pointer and words in shared memory."""
    made, _attrs = config(cluster, threads, shared, grid)
    kinds = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_longlong)
    kinds += (ctypes.c_int,) * 3 + (ctypes.c_void_p, ctypes.c_int)
    values = [k(v) for k, v in zip(kinds, args)]
    params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
    check(lib().cuLaunchKernelEx(ctypes.byref(made), fn, params, None), "cuLaunchKernelEx")


def timed(fn, reps: int = 15) -> float:
    """Median us a call of ``fn`` over ``reps`` calls back to back behind a device sleep."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(20_000_000)
    events[0].record()
    for i in range(reps):
        fn()
        events[i + 1].record()
    torch.cuda.synchronize()
    return statistics.median(events[i].elapsed_time(events[i + 1]) for i in range(reps)) * 1e3


def probe(case: tuple, fns: dict[str, int], variants: bool = True, pipelined: bool = False) -> dict:
    label, fmt, inter, hidden, experts, tensor = case
    if "/" in tensor:  # a drop-in's map
        em = drop_in_maps(fmt, inter, hidden)[tensor][0].compiled()
    else:
        em = getattr(plan_layer(fmt, "trtllm", inter, hidden), tensor).compiled()
    record: dict = {"case": label, "expert_bytes": em.in_bytes, "cell_bytes": em.cell_bytes, "configs": []}
    if not em.is_permutation or em.cell_bytes % 4:
        print(f"{label}: not a permutation of 4-byte words, skipped", flush=True)
        return record
    cells, cb = em.n_out, em.cell_bytes
    wb = 16 if cb % 16 == 0 else 4
    cw = cb // wb
    src = em.src.astype(np.int32)
    inverse = np.empty_like(src)
    inverse[src] = np.arange(src.size, dtype=np.int32)
    tables = {"gather": torch.from_numpy(src).cuda(), "scatter": torch.from_numpy(inverse).cuda()}
    x = torch.randint(0, 256, (experts, em.in_bytes), dtype=torch.uint8, device="cuda")
    want = x.view(experts, cells, cb)[:, torch.from_numpy(src.astype(np.int64)).cuda()].reshape(experts, -1)
    y, z = x.clone(), torch.empty_like(x)
    copy_us = timed(lambda: z.copy_(y))
    record["copy_us"] = copy_us
    shipped = {}
    prebuilt.build_plan(em, True, y.device)  # the cycle plan, as a steady layer has it
    for strategy in ("cycles", "clusters"):  # the prebuilt executor's in-place kernels
        config = {"inplace": strategy}
        try:
            y.copy_(x)
            kernels.execute_in_place(em, y, backend="prebuilt", config=config)
            torch.cuda.synchronize()
            record[f"{strategy}_ok"] = torch.equal(y, want)
            record[f"{strategy}_us"] = timed(lambda: kernels.execute_in_place(em, y, backend="prebuilt", config=config))
            shipped[strategy] = f"{copy_us / record[f'{strategy}_us']:.3f} ok={record[f'{strategy}_ok']}"
        except Exception as err:  # a map the strategy does not take
            record[f"{strategy}_error"] = str(err.__cause__ or err)[:200]
            shipped[strategy] = "refused"
    print(
        f"{label}: expert {em.in_bytes / 1e6:.2f} MB, {cells} cells of {cb} B; copy {copy_us:.0f} us; the cycle "
        f"kernel {shipped['cycles']}, the cluster kernel {shipped['clusters']}",
        flush=True,
    )
    configs = []  # (C, words held in registers, mode, function, threads, shared memory)
    words = "c8" if cw == 8 else "any"  # the kernels' form for these cells (8 words a cell, or any)
    for cluster in (2, 4, 8, 16):
        slice_cells = -(-cells // cluster)
        if pipelined and wb == 16 and slice_cells * cb <= SHARED_MAX:
            configs.append((cluster, 0, "pipelined", f"clu_pipe_{words}", 1024, slice_cells * cb))
        for limit in (SHARED_MAX, TWO_A_MULTIPROCESSOR) if pipelined and wb == 16 else ():
            # the spilling kernel: what shared memory does not hold goes to an L2-sized scratch, at most as much again
            if limit < slice_cells * cb <= 2 * limit:
                configs.append((cluster, 0, "spill", f"clu_spill_{words}", 1024, limit // 16 * 16))
        for held in ((0, HELD_WORDS) if wb == 16 else (0,)) if variants else ():
            shared = slice_cells * cb - (held * 512 * wb)
            if shared > SHARED_MAX or (held and (shared <= 0 or slice_cells * cb <= SHARED_MAX)):
                continue
            for mode in ("gather", "scatter"):
                kind = "w4" if wb == 4 else words + ("_r16" if held else "")
                for threads in (512,) if held else (512, 1024):
                    configs.append((cluster, held, mode, f"clu_{mode}_{kind}", threads, shared))
    for cluster, held, mode, name, threads, shared in configs:
        fn, slice_cells = fns[name], -(-cells // cluster)
        table = tables["gather" if mode == "gather" else "scatter"]
        active = max_clusters(fn, cluster, threads, shared)
        for grid in ("persistent",) if mode == "spill" else ("persistent", "per expert"):
            clusters = experts if grid == "per expert" else max(1, min(experts, active))
            spilled = slice_cells * cw - shared // wb if mode == "spill" else 0  # words a block keeps in the scratch
            scratch = torch.empty((max(clusters * cluster * spilled, 1), wb), dtype=torch.uint8, device="cuda")
            for streaming in (0, 1):
                args = (y.data_ptr(), table.data_ptr(), cells, cw, em.in_bytes // wb, slice_cells, experts, streaming)
                args += (scratch.data_ptr(), shared // wb)
                y.copy_(x)
                torch.cuda.synchronize()
                launch(fn, cluster, threads, shared, clusters * cluster, args)
                torch.cuda.synchronize()
                ok = torch.equal(y, want)
                us = timed(lambda: launch(fn, cluster, threads, shared, clusters * cluster, args))
                row = dict(cluster=cluster, held=held, mode=mode, threads=threads, grid=grid)
                row.update(clusters=clusters, active=active, shared=shared, spilled=spilled * wb, streaming=streaming)
                row.update(us=us, ratio=copy_us / us, ok=ok)
                record["configs"].append(row)
                print(
                    f"   C={cluster:2d} held={held:2d} {mode:9s} {threads:4d} threads {grid:10s} "
                    f"{clusters:3d}/{active:3d} clusters shared {shared // 1024:3d} KiB spilled {spilled * wb // 1024:3d} KiB "
                    f"streaming={streaming} {us:8.1f} us {copy_us / us:.3f} ok={ok}",
                    flush=True,
                )
    best = max((r for r in record["configs"] if r["ok"]), key=lambda r: r["ratio"], default=None)
    if best:
        print(f"   best {best['ratio']:.3f}: {best}", flush=True)
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fatbin", required=True, help="benchmarks/cuda/cluster_inplace.cu built for sm_90")
    ap.add_argument("--cases", nargs="*", help="labels to run (default: all)")
    ap.add_argument("--out", help="write the records here as JSON")
    ap.add_argument("--shipped", action="store_true", help="time the prebuilt executor's kernels alone")
    ap.add_argument(
        "--pipelined",
        action="store_true",
        help="with --shipped: also the pipelined scattering kernel (clu_pipe_*) and its form that spills what shared "
        "memory does not hold to an L2-sized scratch (clu_spill_*)",
    )
    args = ap.parse_args()
    fns = functions(args.fatbin)
    chosen = [case for case in CASES if not args.cases or case[0] in args.cases]
    records = [probe(case, fns, not args.shipped, args.pipelined) for case in chosen]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "records": records}, f)


if __name__ == "__main__":
    main()
