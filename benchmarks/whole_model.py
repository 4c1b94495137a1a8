"""A whole model's MoE layers prepared in a fresh process, against allocating and copying the same bytes.

Each measurement is a fresh Python process (``--child``) that imports torch and ``fimoe_lab``,
then for every MoE layer of the model: makes the layer's random input bytes on the device
(untimed), synchronises, runs the preparation, synchronises; the layer's time is between the
two synchronisations. Outputs are kept, as a loading engine keeps them (inputs of the
out-of-place paths are dropped after their layer). The baseline runs the same way in a fresh
process of its own: ``torch.empty_like`` + ``copy_`` of the same input bytes, layer by layer.
No warm-up anywhere: the first layer pays plan building, map compiling, executor choice and
every first kernel launch.

Paths (per model):

- ``drop-in``: the public drop-in the engines call on each layer (sizes already aligned, as an
  engine passes them): FP8 per-tensor ``rotate_weights_for_fi_trtllm_fp8_per_tensor_moe`` (in
  place), DeepSeek FP8 block ``shuffle_deepseek_fp8_moe_weights`` (new tensors), BF16
  ``convert_moe_weights_to_flashinfer_trtllm_block_layout`` (in place);
- ``layer``: the layer entry point the integrations route an engine's preparation to
  (``plan_layer(fmt, "trtllm", ...)`` applied to the layer's weights and scales: padding, swap,
  interleave, shuffle, block layout and scale swizzle composed; new tensors);
- ``install``: vLLM 0.34's own load-time entry point for the format (the one its MoE method calls:
  ``prepare_fp8_moe_layer_for_fi``, ``prepare_nvfp4_moe_layer_for_fi_or_cutlass``,
  ``convert_gpt_oss_weight_to_mxfp4_moe_kernel_format``, BF16's ``align_moe_weights_for_fi`` +
  ``convert_moe_weights_to_flashinfer_trtllm_block_layout``) after ``fimoe_lab.integrations.vllm.install()``,
  on the layer's typed weights and scales at the sizes vLLM allocates for them (:func:`engine_sizes`); ``vllm``:
  the same entry point as vLLM ships it (not run unless named: vLLM's own per-expert loops take 0.1-0.2 s a
  layer on a GPU). Both run vLLM's staged files (``benchmarks/integration_bench.py --stage VENV``, carried as
  ``build/engine_src``); without them the default run leaves ``install`` out and says so.

Cache modes: ``empty`` points ``TRITON_CACHE_DIR``, ``NUMBA_CACHE_DIR`` and ``FIMOE_LAB_CACHE`` (the
layer plans kept on disk, :mod:`fimoe_lab.plan_store`) at new empty directories; ``warm`` reuses the
directories a previous process of the same model and path filled (where none has, ``--modes warm`` alone, one
untimed process fills them first). Per model and path: all layers,
the baseline's all layers, their ratio (share of copy), the first layer, the median layer (and the
baseline's), the first-layer overhead (first minus median), and the median host time of a layer on
each side (until the calls return, before the second synchronisation: where it nears the layer's
time, the device waits for the host).

Each side gets its own process because a side that runs after another side's memory was freed in the same
process (``empty_cache``) runs its first layers slower, its copies too (benchmarks/RESULTS.md, "The baseline
speeds up over a run"). ``--order`` runs both in one process instead (the baseline after the preparation,
before it, or both), and the medians of each side's first and last quarter of layers are printed to show it.
``--busy-ms`` keeps the device copying for that long before anything is timed (a loading engine keeps it busy);
``--clock-log`` samples the device's clocks meanwhile.

    PYTHONPATH=. python3 benchmarks/whole_model.py --out benchmarks/results/whole_model_h200.json
    PYTHONPATH=. python3 benchmarks/whole_model.py --torch-stand-in ...  # every path also without the prebuilt kernels
    PYTHONPATH=. python3 benchmarks/whole_model.py --order copy-ours-copy ...  # the baseline before and after
    PYTHONPATH=. python3 benchmarks/whole_model.py --clock-log clocks.csv ...  # each side's clocks (nvidia-smi)
    PYTHONPATH=. python3 benchmarks/whole_model.py --repeat 3 ...  # each figure's median and range over 3 runs
    PYTHONPATH=. python3 benchmarks/whole_model.py --device cpu --layers 3 --experts 8   # CPU smoke run
    FIMOE_INPLACE_CLUSTERS=1 PYTHONPATH=. python3 benchmarks/whole_model.py ...  # in place on the cluster kernel
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from checkout import ROOT, child_env  # noqa: E402  (a child runs the PYTHONPATH given, then this checkout)

# model -> (weight format, experts, hidden, intermediate per rank, MoE layers, paths)
MODELS = {
    "deepseek-v3-tp8-fp8": ("fp8", 256, 7168, 256, 58, ("drop-in", "layer")),
    "deepseek-v3-tp8-fp8-block": ("fp8-block", 256, 7168, 256, 58, ("drop-in", "layer")),
    "qwen3-235b-tp8-bf16": ("bf16", 128, 4096, 192, 94, ("drop-in", "layer")),
    "deepseek-r1-tp8-nvfp4": ("nvfp4", 256, 7168, 256, 58, ("layer",)),
    "gpt-oss-120b-mxfp4": ("mxfp4", 128, 2880, 2880, 36, ("layer",)),
}
ENGINE_PATHS = ("install", "vllm")
"""Paths every model has besides its own: vLLM's entry point for its format (``install``: with fimoe_lab installed
into it)."""
PATHS = ("drop-in", "layer", *ENGINE_PATHS)
ENGINE_FORMATS = {
    "fp8": "fp8-tensor",
    "fp8-block": "fp8-block",
    "bf16": "bf16",
    "nvfp4": "nvfp4",
    "mxfp4": "mxfp4-gptoss",
}
"""A model's weight format -> its format in ``integration_bench`` (inputs and vLLM entry point)."""
DROP_INS = {
    "fp8": "rotate_weights_for_fi_trtllm_fp8_per_tensor_moe (in place)",
    "fp8-block": "shuffle_deepseek_fp8_moe_weights",
    "bf16": "convert_moe_weights_to_flashinfer_trtllm_block_layout (in place)",
}


ENGINE_MISSING = (
    "vLLM's files are not staged in build/engine_src/vllm: run python benchmarks/integration_bench.py --stage VENV "
    "(a venv with vLLM 0.34 and FlashInfer, as tests/engine_envs.py makes it), and carry build/engine_src to the device"
)


def engine_sizes(fmt: str, hidden: int, inter: int) -> tuple[int, int]:
    """``(hidden, intermediate)`` of the parameters vLLM creates for ``fmt``'s layer on its FlashInfer TRT-LLM
    backend, what its entry point is handed: MXFP4 rounds the intermediate up to 128 and the hidden size to 256
    (``mxfp4_round_up_hidden_size_and_intermediate_size``; gpt-oss 2880 x 2880 -> 3072 x 2944), BF16 the
    intermediate to 128 (``unquantized_round_up_hidden_size_and_intermediate_size``; Qwen3-235B TP8 192 -> 256,
    so its entry point's alignment has nothing left to pad); the other formats keep the model's sizes."""
    if fmt == "mxfp4":
        return -(-hidden // 256) * 256, -(-inter // 128) * 128
    if fmt == "bf16":
        return hidden, -(-inter // 128) * 128
    return hidden, inter


def engine_staged() -> bool:
    """Whether vLLM's preparation files are staged for the ``install`` and ``vllm`` paths."""
    return os.path.exists(os.path.join(ROOT, "build", "engine_src", "vllm", "versions.json"))


def copy_layer(t: dict) -> list:
    """The baseline of one layer: each tensor allocated like its input (``empty_like``) and copied (``copy_``)."""
    import torch  # (the parent process runs without torch: imported where a child first copies)

    outs = []
    for x in t.values():
        y = torch.empty_like(x)
        y.copy_(x)
        outs.append(y)
    return outs


def child(args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    import torch

    from fimoe_lab import prepare  # noqa: F401 - imported untimed, as an engine has it before its first layer
    from fimoe_lab.recipes import plan_layer

    t_import = time.perf_counter() - t0
    dev = torch.device(args.device)
    fmt, experts, hidden, inter, layers, _ = MODELS[args.model]
    experts = args.experts or experts
    layers = args.layers or layers
    gen = torch.Generator(device=dev).manual_seed(0)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def rnd(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=dev, generator=gen)

    # shapes from the plans' maps (bytes), without building any plan in this process's timed part
    shapes = drop_in_shapes(fmt, experts, hidden, inter) if args.path == "drop-in" else None
    engine_fmt = ENGINE_FORMATS[fmt] if args.path in ENGINE_PATHS else None
    engine: dict = {}
    engine_hidden, engine_inter = engine_sizes(fmt, hidden, inter)
    if engine_fmt is not None:  # vLLM's files loaded and (install) fimoe_lab installed, untimed: an engine's start
        import integration_bench

        engine = integration_bench.load_engine("vllm")
        if args.path == "install":
            from fimoe_lab.integrations import vllm as integration

            integration.install(force=True)

    def make_layer() -> dict[str, torch.Tensor]:
        if engine_fmt is not None:  # typed weights and scales at the sizes vLLM allocates, as its loader has them
            return integration_bench.make_inputs(engine_fmt, experts, engine_hidden, engine_inter, dev)
        if shapes is not None:
            return {k: rnd(s) for k, s in shapes.items()}
        return {k: rnd((experts, *s)) for k, s in layer_shapes.items()}

    def run_ours(t: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        if engine_fmt is not None:
            return integration_bench.prepare("vllm", engine_fmt, engine, t, engine_hidden, engine_inter)
        if args.path == "layer":
            plan = plan_layer(fmt, "trtllm", inter, hidden)
            return [o for o in plan.apply(t["w13"], t["w2"], t.get("w13_scale"), t.get("w2_scale")) if o is not None]
        return run_drop_in(fmt, t["w13"], t["w2"])

    if shapes is None and engine_fmt is None:  # the layer path's input shapes: the plan's maps (built here
        # untimed would warm it: read them from a plan built in a throwaway process instead)
        layer_shapes = json.loads(args.shapes)

    starts: dict[str, list[float]] = {}  # each phase's layers' wall-clock starts (lined up with a clock log)

    def measure(fn, name: str) -> tuple[list[float], list[float], int]:
        kept, times, host, moved = [], [], [], 0
        stamps = starts.setdefault(name, [])
        for _ in range(layers):
            t = make_layer()
            moved += sum(x.numel() * x.element_size() for x in t.values())
            sync()
            stamps.append(time.time())
            a = time.perf_counter()
            kept.append(fn(t))
            host.append(time.perf_counter() - a)  # the calls returned: launches queued, the device may still run
            sync()
            times.append(time.perf_counter() - a)
            del t
        del kept
        return times, host, moved

    if args.busy_ms and dev.type == "cuda":  # the device busy first, as a loading engine keeps it (untimed)
        a, b = torch.empty(1 << 30, dtype=torch.uint8, device=dev), torch.empty(1 << 30, dtype=torch.uint8, device=dev)
        until = time.perf_counter() + args.busy_ms / 1e3
        while time.perf_counter() < until:
            for _ in range(8):
                b.copy_(a)
            sync()
        del a, b
        torch.cuda.empty_cache()
    # a loading engine has run strided copies before its first MoE layer (checkpoint shards narrowed to
    # a rank and copied): the first one in a process loads torch's copy kernels (~30 ms on the H200)
    calibration = host_calibration_ms()
    prime = time.perf_counter()
    small = rnd((64, 64)).view(torch.int64)
    small.t().contiguous()
    sync()
    prime = time.perf_counter() - prime
    if os.environ.get("WHOLE_MODEL_PROFILE"):  # where the first layer's host time goes
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        first = make_layer()
        sync()
        profiler.enable()
        keep = run_ours(first)
        sync()
        profiler.disable()
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumtime").print_stats(30)
        del keep, first
    sync()

    def phase(fn, name: str) -> tuple[list[float], list[float], int]:
        out = measure(fn, name)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        return out

    copies, ours, ours_host, moved = [], None, None, 0
    for side in PHASES[args.order]:
        if side == "ours":
            ours, ours_host, moved = phase(run_ours, "ours")
        else:
            copies.append(phase(copy_layer, "copy_after" if copies else "copy"))
            moved = copies[-1][2]
    base, base_host = (copies[0][0], copies[0][1]) if copies else (None, None)
    from fimoe_lab.integrations import FALLBACKS
    from fimoe_lab.kernels import registry

    return {
        "import_s": t_import,
        "host_calibration_ms": calibration,
        "first_strided_copy_s": prime,
        "layers": layers,
        "experts": experts,
        "input_bytes": moved,
        "ours_s": ours,
        "copy_s": base,
        "ours_host_s": ours_host,
        "copy_host_s": base_host,
        "order": args.order,
        "layer_start_unix": starts,
        "copy_after_s": copies[1][0] if len(copies) > 1 else None,
        "loaded_executors": sorted(registry._LOADS.ready),
        "started_loads": sorted(registry._LOADS.threads),
        "numba_imported": "numba" in sys.modules,
        "inplace_clusters": os.environ.get("FIMOE_INPLACE_CLUSTERS"),  # in place on the cluster kernel where set
        "triton_imported": "triton" in sys.modules,
        "engine_versions": engine.get("versions"),
        "fallbacks": dict(FALLBACKS),  # installed replacements that ran vLLM's own code instead (install: none)
    }


def drop_in_shapes(fmt: str, experts: int, hidden: int, inter: int) -> dict[str, tuple[int, int, int]]:
    """The ``(experts, rows, bytes)`` of the ``w13`` and ``w2`` an engine passes ``fmt``'s drop-in: the plan's padded
    sizes (Qwen3 TP8: 192 -> 256), from the torch-free table."""
    from fimoe_lab.shapes import padded_shape

    inter_p, hidden_p = padded_shape(fmt, "trtllm", inter, hidden)
    item = 2 if fmt == "bf16" else 1
    return {"w13": (experts, 2 * inter_p, hidden_p * item), "w2": (experts, hidden_p, inter_p * item)}


def run_drop_in(fmt: str, w13, w2) -> list:
    """``fmt``'s drop-in (:data:`DROP_INS`) on the uint8 bytes ``w13`` and ``w2`` (:func:`drop_in_shapes`): the tensors
    it returns, or the ones it permuted in place."""
    import torch

    from fimoe_lab import prepare

    if fmt == "fp8":
        w13, w2 = w13.view(torch.float8_e4m3fn), w2.view(torch.float8_e4m3fn)
        prepare.rotate_weights_for_fi_trtllm_fp8_per_tensor_moe(w13, w2, True)
        return [w13, w2]
    if fmt == "fp8-block":
        return list(
            prepare.shuffle_deepseek_fp8_moe_weights(w13.view(torch.float8_e4m3fn), w2.view(torch.float8_e4m3fn))
        )
    w13, w2 = w13.view(torch.bfloat16), w2.view(torch.bfloat16)
    return list(prepare.convert_moe_weights_to_flashinfer_trtllm_block_layout({}, w13, w2))


def host_calibration_ms() -> float:
    """The fastest of five runs of a fixed pure-Python loop, in ms: how fast this process's host thread runs (host
    times of layers compare across processes only where this agrees)."""
    best = float("inf")
    for _ in range(5):
        a = time.perf_counter()
        total = 0
        for i in range(100_000):
            total += i & 7
        best = min(best, time.perf_counter() - a)
    return best * 1e3


PHASES = {
    "ours": ("ours",),
    "copy": ("copy",),
    "ours-first": ("ours", "copy"),
    "copy-first": ("copy", "ours"),
    "copy-ours-copy": ("copy", "ours", "copy"),
}
"""``--order``: the sides a child runs, in order. After a side's memory is freed, the next side in that process
runs its first layers slower (RESULTS.md, "The baseline speeds up over a run"): ``separate`` gives each side a
fresh process of its own."""


def layer_shapes_of(fmt: str, hidden: int, inter: int) -> dict[str, list[int]]:
    """Per-expert input shapes (bytes) of ``plan_layer``'s maps, in a throwaway process."""
    code = (
        "import json; from fimoe_lab.recipes import plan_layer; "
        f"p = plan_layer({fmt!r}, 'trtllm', {inter}, {hidden}); "
        "print(json.dumps({k: list(m.in_shape) for k, m in p.maps().items()}))"
    )
    env = child_env()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarise(rec: dict) -> dict:
    """The figures of one child's record; with the baseline run before and after (``copy-ours-copy``), the
    baseline's are the mean of its two runs."""
    ours, base = rec["ours_s"], rec["copy_s"]
    after = rec.get("copy_after_s")
    if after:
        base = [(a + b) / 2 for a, b in zip(base, after)]
    med = statistics.median(ours[1:] or ours)
    quarter = max(1, (len(ours) - 1) // 4)
    return {
        "all_layers_s": sum(ours),
        "copy_all_layers_s": sum(base),
        "share_of_copy": sum(base) / sum(ours),
        "first_quarter_ms": statistics.median(ours[1 : 1 + quarter] or ours) * 1e3,
        "last_quarter_ms": statistics.median(ours[-quarter:]) * 1e3,
        "copy_first_quarter_ms": statistics.median(base[1 : 1 + quarter] or base) * 1e3,
        "copy_last_quarter_ms": statistics.median(base[-quarter:]) * 1e3,
        "first_layer_ms": ours[0] * 1e3,
        "median_layer_ms": med * 1e3,
        "copy_median_layer_ms": statistics.median(base[1:] or base) * 1e3,
        "first_layer_overhead_ms": (ours[0] - med) * 1e3,
        "median_host_ms": statistics.median(rec["ours_host_s"][1:] or rec["ours_host_s"]) * 1e3,
        "copy_median_host_ms": statistics.median(rec["copy_host_s"][1:] or rec["copy_host_s"]) * 1e3,
        "gb_per_layer": rec["input_bytes"] / rec["layers"] / 1e9,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shapes", help=argparse.SUPPRESS)
    ap.add_argument("--model", choices=sorted(MODELS), help=argparse.SUPPRESS)  # a child's model and path
    ap.add_argument("--path", choices=PATHS, help=argparse.SUPPRESS)
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=sorted(MODELS), metavar="MODEL")
    ap.add_argument(
        "--paths",
        nargs="*",
        choices=PATHS,
        help="paths to run, of those a model has (default: drop-in, layer and, where vLLM's files are staged, install)",
    )
    ap.add_argument("--modes", nargs="*", default=["empty", "warm"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=0, help="MoE layers (default: the model's)")
    ap.add_argument("--experts", type=int, default=0, help="experts (default: the model's)")
    ap.add_argument("--out", help="write the JSON here")
    ap.add_argument(
        "--busy-ms",
        type=int,
        default=0,
        help="keep the device copying for this long before anything is timed (fimoe_lab untouched), as a loading "
        "engine keeps it busy; default 0: the device idle until the first layer",
    )
    ap.add_argument(
        "--order",
        choices=["separate", *PHASES],
        default="separate",
        help="where the baseline runs: in a fresh process of its own (separate, the default), or in the "
        "preparation's process after it, before it, or both (the figures against their mean; ours and copy: one "
        "side alone); a side that runs after another's memory was freed starts slower (benchmarks/RESULTS.md)",
    )
    ap.add_argument(
        "--clock-log",
        metavar="CSV",
        help="sample the device's SM and memory clocks every 20 ms with nvidia-smi into CSV while the children run, and "
        "give each side's median clocks over its first and last quarter of layers",
    )
    ap.add_argument(
        "--slow-host-retries",
        type=int,
        default=2,
        help="run a child again, up to this many times, when its host thread ran slowly (a fixed Python loop over "
        f"{SLOW_HOST}x the fastest seen): host times compare only between equally fast processes (default 2)",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="measure each model, path and cache mode this many times (fresh processes each time; an empty cache "
        "empty again) and print each figure's median and range over them: one run's share moves by about 0.1 "
        "between processes (benchmarks/RESULTS.md)",
    )
    ap.add_argument(
        "--torch-stand-in",
        action="store_true",
        help="also run every path with FIMOE_PREBUILT_KERNELS=0 (paths 'drop-in torch', 'layer torch')",
    )
    ap.add_argument(
        "--pair",
        nargs=2,
        metavar=("OURS_JSON", "COPY_JSON"),
        help="no run: the table of each side taken where it ran first in its process, the preparation from the "
        "records of OURS_JSON (run with --order ours-first or separate) and the baseline from those of COPY_JSON "
        "(--order copy-first, copy-ours-copy or separate)",
    )
    args = ap.parse_args(argv)
    if args.pair:
        print(table(paired(*args.pair)))
        return
    if args.child:
        if args.order not in PHASES:
            raise SystemExit(f"a child runs one of the orders {', '.join(PHASES)}, not {args.order!r}")
        print(json.dumps(child(args)))
        return
    if args.paths is None:
        args.paths = ["drop-in", "layer", "install"]
        if not engine_staged():
            args.paths.remove("install")
            print(f"install path not run: {ENGINE_MISSING}", flush=True)
    elif set(args.paths) & set(ENGINE_PATHS) and not engine_staged():
        raise SystemExit(f"--paths {' '.join(sorted(set(args.paths) & set(ENGINE_PATHS)))}: {ENGINE_MISSING}")
    env = child_env()
    sampler = None
    if args.clock_log:
        query = "timestamp,clocks.sm,clocks.mem,power.draw"
        sampler = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-lms", "20", "-f", args.clock_log]
        )
    try:
        records = run_children(args, env)
    finally:  # the sampler stopped, whatever happened to the children
        if sampler is not None:
            sampler.terminate()
            sampler.wait()
    if args.clock_log:
        samples = read_clock_log(args.clock_log)
        for rec in records:
            rec["clocks_mhz"] = phase_clocks(rec, samples)
            print(
                f"{rec['model']:28s} {rec['path']:8s} {rec['mode']:5s} SM/memory MHz, first -> last quarter: "
                + "; ".join(f"{k} {a} -> {b}" for k, (a, b) in rec["clocks_mhz"].items())
            )
    import torch

    env_info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
    }
    try:
        import triton

        env_info["triton"] = triton.__version__
    except ImportError:
        pass
    print(table(records))
    if args.repeat > 1:
        print(repeats_table(records))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "env": env_info, "records": records}, f, indent=1)


SLOW_HOST = 1.25
"""A child whose host loop (:func:`host_calibration_ms`) ran this many times slower than the fastest seen ran on a
slowed host thread (on a shared host the loop's time moved 3.5x between processes), and runs again, up to
``--slow-host-retries`` times."""


def use_caches(env: dict[str, str], caches: str) -> None:
    """Point a child's Triton and numba kernel caches and fimoe_lab's plan store (``env``) into the folder
    ``caches``."""
    env["TRITON_CACHE_DIR"] = os.path.join(caches, "triton")
    env["NUMBA_CACHE_DIR"] = os.path.join(caches, "numba")
    env["FIMOE_LAB_CACHE"] = os.path.join(caches, "fimoe_lab")


def run_children(args: argparse.Namespace, env: dict[str, str]) -> list[dict]:
    """Every model, path and cache mode of ``args`` measured in fresh child processes; one record each."""
    records = []
    fastest = host_calibration_ms()  # the parent's own loop seeds the fastest seen
    for model in args.models:
        fmt, experts, hidden, inter, layers, paths = MODELS[model]
        shapes = json.dumps(layer_shapes_of(fmt, hidden, inter))
        runs = [(path, path, {}) for path in (*paths, *ENGINE_PATHS) if path in args.paths]
        if args.torch_stand_in:
            runs += [(f"{path} torch", path, {"FIMOE_PREBUILT_KERNELS": "0"}) for path in paths]
        for label, path, extra in runs:
            caches, filled = tempfile.mkdtemp(prefix="fimoe_whole_"), False
            for repeat, mode in [(r, m) for m in args.modes for r in range(args.repeat)]:
                e = dict(env, **extra)
                if mode == "empty":
                    caches = tempfile.mkdtemp(prefix="fimoe_whole_")
                use_caches(e, caches)
                cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", model, "--path", path]
                cmd += ["--device", args.device, "--layers", str(args.layers), "--experts", str(args.experts)]
                cmd += ["--shapes", shapes, "--busy-ms", str(args.busy_ms)]
                if mode == "warm" and not filled:  # no run has filled these caches yet: one untimed run does
                    p = subprocess.run(cmd + ["--order", "ours"], env=e, capture_output=True, text=True, cwd=ROOT)
                    if p.returncode:
                        raise SystemExit(f"child failed ({model} {label}, filling the caches):\n{p.stderr[-3000:]}")
                filled = True
                t = time.perf_counter()
                parts = []
                for order in ("ours", "copy") if args.order == "separate" else (args.order,):
                    for attempt in range(1 + args.slow_host_retries):
                        if attempt and mode == "empty":  # a run again starts from empty caches again
                            use_caches(e, tempfile.mkdtemp(prefix="fimoe_whole_"))
                        p = subprocess.run(cmd + ["--order", order], env=e, capture_output=True, text=True, cwd=ROOT)
                        if p.returncode:
                            raise SystemExit(f"child failed ({model} {label} {mode}):\n{p.stderr[-3000:]}")
                        if os.environ.get("WHOLE_MODEL_PROFILE") and order != "copy":
                            sys.stderr.write(f"--- first layer of {model} {label} {mode}\n{p.stderr}")
                        part = json.loads(p.stdout.strip().splitlines()[-1])
                        loop = part["host_calibration_ms"]
                        fastest = min(fastest, loop)
                        if loop <= SLOW_HOST * fastest:
                            break
                        print(
                            f"{model} {label} {mode} ({order}): host loop {loop:.2f} ms, {loop / fastest:.1f}x "
                            f"the fastest seen{'; run again' if attempt < args.slow_host_retries else ''}",
                            flush=True,
                        )
                    part["attempts"] = attempt + 1
                    parts.append(part)
                rec = parts[0]
                if len(parts) > 1:  # the baseline's process: its figures beside the preparation's
                    base = parts[1]
                    rec.update(order="separate", copy_s=base["copy_s"], copy_host_s=base["copy_host_s"])
                    rec["layer_start_unix"]["copy"] = base["layer_start_unix"]["copy"]
                    rec["copy_first_strided_copy_s"] = base["first_strided_copy_s"]
                    rec["copy_host_calibration_ms"] = base["host_calibration_ms"]
                    rec["copy_attempts"] = base["attempts"]
                rec.update(model=model, fmt=fmt, path=label, mode=mode, repeat=repeat)
                rec["process_wall_s"] = time.perf_counter() - t
                rec["summary"] = summarise(rec)
                records.append(rec)
                if rec.get("fallbacks"):
                    print(f"{model} {label} {mode}: vLLM's own code ran for {rec['fallbacks']}", flush=True)
                s = rec["summary"]
                print(
                    f"{model:28s} {label:8s} {mode:5s} all {s['all_layers_s']:.3f} s copy {s['copy_all_layers_s']:.3f} s "
                    f"share {s['share_of_copy']:.2f} first {s['first_layer_ms']:.1f} ms median "
                    f"{s['median_layer_ms']:.2f} ms (copy {s['copy_median_layer_ms']:.2f}; host {s['median_host_ms']:.2f} / "
                    f"{s['copy_median_host_ms']:.2f}; quarters {s['first_quarter_ms']:.2f} -> {s['last_quarter_ms']:.2f}, "
                    f"copy {s['copy_first_quarter_ms']:.2f} -> {s['copy_last_quarter_ms']:.2f}) overhead "
                    f"{s['first_layer_overhead_ms']:.1f} ms loads {rec['started_loads']} host loop "
                    f"{rec['host_calibration_ms']:.2f} / {rec.get('copy_host_calibration_ms', float('nan')):.2f} ms",
                    flush=True,
                )
    return records


def read_clock_log(path: str) -> list[tuple[float, float, float]]:
    """``(unix time, SM MHz, memory MHz)`` rows of an ``nvidia-smi`` CSV log (its timestamps are local time)."""
    rows = []
    with open(path) as f:
        for line in f:
            parts = [p.strip() for p in line.split(",")]
            try:
                stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                rows.append((stamp, float(parts[1]), float(parts[2])))
            except (ValueError, IndexError):
                continue  # a torn last line, or a field the device does not report
    return rows


def phase_clocks(rec: dict, samples: list[tuple[float, float, float]]) -> dict[str, list[str]]:
    """Per phase of ``rec``: the median SM/memory clocks sampled over its first quarter of layers (layer 1 on) and
    over its last quarter, as ``"SM/mem"`` strings (a window shorter than the sampling period takes the sample
    nearest its middle, ``"-"`` where none is within 50 ms)."""
    out = {}
    for phase, starts in rec["layer_start_unix"].items():
        layer_s = rec[f"{phase}_s"]  # the phase's layer times: ours_s, copy_s, copy_after_s
        quarter = max(1, (len(layer_s) - 1) // 4)

        def window(first: int, last: int) -> str:
            a, b = starts[first], starts[last] + layer_s[last]
            inside = [s for s in samples if a <= s[0] <= b]
            if not inside:  # a window shorter than the sampling period: the nearest sample, if one is close
                near = min(samples, key=lambda s: abs(s[0] - (a + b) / 2), default=None)
                if near is None or abs(near[0] - (a + b) / 2) > 0.05:
                    return "-"
                inside = [near]
            return f"{statistics.median(s[1] for s in inside):.0f}/{statistics.median(s[2] for s in inside):.0f}"

        out[phase] = [window(1, quarter), window(len(layer_s) - quarter, len(layer_s) - 1)]
    return out


def paired(ours_json: str, copy_json: str) -> list[dict]:
    """Records with the preparation's layers from ``ours_json`` and the baseline's first run from ``copy_json``
    (same model, path and cache mode), each from a process where that side ran first."""
    first = {"ours": ("separate", "ours-first"), "copy": ("separate", "copy-first", "copy-ours-copy")}
    with open(ours_json) as f:
        ours = json.load(f)["records"]
    with open(copy_json) as f:
        copies = {(r["model"], r["path"], r["mode"]): r for r in json.load(f)["records"]}
    out = []
    for rec in ours:
        base = copies.get((rec["model"], rec["path"], rec["mode"]))
        if base is None or rec["order"] not in first["ours"] or base["order"] not in first["copy"]:
            continue
        rec = dict(rec, copy_s=base["copy_s"], copy_host_s=base["copy_host_s"], copy_after_s=None)
        rec["copy_host_calibration_ms"] = base.get("host_calibration_ms")
        rec["summary"] = summarise(rec)
        out.append(rec)
    return out


def _loops(rec: dict) -> str:
    """The host loops of a record's processes (records made before they were measured: ``-``)."""
    ours, base = rec.get("host_calibration_ms"), rec.get("copy_host_calibration_ms")
    return "-" if ours is None else f"{ours:.1f}" + ("" if base is None else f" ({base:.1f})")


def table(records: list[dict]) -> str:
    lines = [
        "| model | path | cache | all layers s | alloc+copy s | share of copy | first layer ms | overhead ms "
        "| median layer ms (copy) | host loop ms (copy) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in records:
        s = r["summary"]
        lines.append(
            f"| {r['model']} | {r['path']} | {r['mode']} | {s['all_layers_s']:.3f} | {s['copy_all_layers_s']:.3f} | "
            f"{s['share_of_copy']:.2f} | {s['first_layer_ms']:.1f} | {s['first_layer_overhead_ms']:.1f} | "
            f"{s['median_layer_ms']:.2f} ({s['copy_median_layer_ms']:.2f}) | {_loops(r)} |"
        )
    return "\n".join(lines)


def repeats_table(records: list[dict]) -> str:
    """Per model, path and cache mode: the median and range over its repeats of the share of copy, the first layer
    and the median layer (``--repeat``)."""
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for r in records:
        groups.setdefault((r["model"], r["path"], r["mode"]), []).append(r["summary"])
    lines = [
        "| model | path | cache | runs | share of copy | first layer ms | median layer ms (copy) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]

    def spread(runs: list[dict], key: str, digits: int) -> str:
        values = [s[key] for s in runs]
        return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"

    for (model, path, mode), runs in groups.items():
        lines.append(
            f"| {model} | {path} | {mode} | {len(runs)} | {spread(runs, 'share_of_copy', 2)} | "
            f"{spread(runs, 'first_layer_ms', 1)} | {spread(runs, 'median_layer_ms', 2)} "
            f"({spread(runs, 'copy_median_layer_ms', 2)}) |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
