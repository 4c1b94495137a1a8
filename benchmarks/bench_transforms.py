"""Benchmark the layout transforms: ours vs the per-expert loop vs a batched uint8 gather
vs FlashInfer's own functions (when importable) vs the copy ceiling, all in one run.

Bandwidth convention (DESIGN §7): bytes read + bytes written, over the median time of
``--repeats`` runs after warm-up. The copy ceiling copies the transform's input byte
count device-to-device (CPU: the best of torch ``copy_`` and a parallel numba copy with plain
or streaming stores, i.e. the machine's own memcpy), so ``ratio = ours_gbps / copy_gbps``.

    python benchmarks/bench_transforms.py --device cpu --quick --json
    python benchmarks/bench_transforms.py --device cuda --out results.json

With ``--json`` the JSON list goes to stdout and the table to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkout import on_path  # noqa: E402  (PYTHONPATH=TREE measures TREE)

on_path()

import torch  # noqa: E402

from fimoe_lab import kernels  # noqa: E402
from fimoe_lab.kernels import execute, execute_in_place  # noqa: E402
from fimoe_lab.prepare import plan_layer  # noqa: E402

# name: (experts, hidden, intermediate, [(fmt, label, plan_layer kwargs)])
PRESETS = {
    "deepseek-v3": (
        256,
        7168,
        2048,
        [("fp8", "fp8_rotate", {}), ("fp8-block", "deepseek_block", {}), ("mxfp8", "mxfp8", {})],
    ),
    "deepseek-r1-nvfp4": (256, 7168, 2048, [("nvfp4", "nvfp4", {})]),
    "qwen3-235b-bf16": (128, 4096, 1536, [("bf16", "bf16_block", {})]),
    "nemotron-nano-fp8": (128, 2688, 1856, [("fp8", "fp8_rotate_pad", dict(is_act_and_mul=False, is_gated=False))]),
}
# CPU full run: the weight transforms with fewer experts (w13 of deepseek-v3 stays >= 2 GB);
# a map whose full layer holds at most CPU_FULL_BYTES of input (the scales) runs at full size.
CPU_EXPERTS = {"deepseek-v3": 72, "deepseek-r1-nvfp4": 72, "qwen3-235b-bf16": 24, "nemotron-nano-fp8": 32}
CPU_FULL_BYTES = 1 << 30
QUICK = {
    "deepseek-v3": (8, 1024, 512),
    "deepseek-r1-nvfp4": (8, 1024, 512),
    "qwen3-235b-bf16": (8, 1024, 512),
    "nemotron-nano-fp8": (8, 640, 464),
}


# ------------------------------------------------------------------ timing
def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def save_results(path, **fields):
    """Write ``fields`` to ``path`` as JSON after the device and versions they were measured on."""
    env = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    with open(path, "w") as f:
        json.dump(env | fields, f, indent=1)


def timeit(fn, dev, repeats, warmup=1, min_sample=2e-3, inner=None):
    """Median seconds per call over ``repeats`` samples after ``warmup`` calls.

    On CUDA each sample is timed with events around ``inner`` back-to-back calls, with
    ``inner`` (unless given) chosen so a sample lasts at least ``min_sample`` seconds: the
    host's launch overhead then overlaps the device work, as it does in a real conversion
    of many tensors (the same rule is applied to the copy ceiling).
    """
    for _ in range(warmup):
        fn()
    sync(dev)
    if inner is None:
        inner = 1
        if dev.type == "cuda" and min_sample:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            one = a.elapsed_time(b) / 1e3
            inner = max(1, min(50, int(min_sample / max(one, 1e-6))))
    times = []
    for _ in range(repeats):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(inner):
                fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3 / inner)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def ratio_to_copy(fn, copy, dev, rounds, repeats=3, **timing):
    """Median over ``rounds`` of ``timeit(copy) / timeit(fn)``, each timed in turn with ``repeats``
    samples and the same ``timing`` keywords of :func:`timeit` (``inner``, ``min_sample``)."""
    return statistics.median(
        timeit(copy, dev, repeats, **timing) / timeit(fn, dev, repeats, **timing) for _ in range(rounds)
    )


def _cpu_sample(fn, inner):
    """Seconds per call of ``fn`` over ``inner`` back-to-back calls."""
    t = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t) / inner


def cpu_copies(x, dst):
    """The CPU copy ceilings of ``dst[:] = x``: torch ``copy_`` and, when numba imports, a
    parallel copy with plain and with streaming (non-temporal) stores, as a large ``memcpy``
    does; the benchmark takes the fastest of them in each pair."""
    copies = [lambda: dst.copy_(x)]
    if kernels.EXECUTORS["numba"].available(x.device):
        from fimoe_lab.kernels.numba_gather import parallel_copy

        xa, da = x.view(-1).numpy(), dst.view(-1).numpy()
        copies += [lambda: parallel_copy(xa, da, False)]
        if da.ctypes.data % 64 == 0:
            copies += [lambda: parallel_copy(xa, da, True)]
    return copies


def peak_extra(fn, dev):
    """Peak device bytes allocated by ``fn`` above what was allocated before (CUDA only)."""
    if dev.type != "cuda":
        return None
    sync(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    fn()
    sync(dev)
    return torch.cuda.max_memory_allocated(dev) - base


# ------------------------------------------------------------------ baselines
def per_expert_loop(m, x):
    """The reference's approach: for each expert, for each step, move the step's index to
    the device and gather that expert's cells (rows, 128-B blocks, scale bytes), then
    stack the experts. No composition, no batching, indices re-sent per expert."""
    outs = []
    for e in range(x.shape[0]):
        t = x[e].reshape(-1).view(torch.uint8)
        for st in m.steps:
            idx = st.src.to(x.device)
            o = t.view(-1, st.cell_bytes)[idx.clamp(min=0)]
            for k, byte in enumerate(st.fills):
                o[idx == -1 - k] = byte
            t = o.reshape(-1)
        outs.append(t)
    return torch.stack(outs)


class Uint8Gather:
    """``x.view(uint8)[:, idx]``: one batched gather of every byte (allocates the output)."""

    def __init__(self, m, dev):
        sb = m.source_bytes().reshape(-1)
        one = m.refined(1)
        fills = torch.tensor(m.fills or (0,), dtype=torch.uint8)
        self.idx = sb.clamp(min=0).to(dev)
        self.mask = (sb < 0).to(dev)
        self.fillv = fills[(-1 - one.src).clamp(min=0)].to(dev)
        self.any_fill = bool((sb < 0).any())

    def __call__(self, x):
        o = x.reshape(x.shape[0], -1).view(torch.uint8)[:, self.idx]
        if self.any_fill:
            o = torch.where(self.mask, self.fillv, o)
        return o


def flashinfer_fn(label, tensor, m):
    """FlashInfer's own per-expert functions for the transforms it has one for, else None."""
    try:
        import flashinfer  # noqa: F401
        from flashinfer import block_scale_interleave, shuffle_matrix_a
    except Exception:
        return None
    rows_only = all(len(st.in_shape) == 2 and st.cell_bytes == st.in_shape[-1] for st in m.steps)
    if label.startswith("fp8_rotate") and rows_only and not m.fills:
        # shuffle_matrix_a per expert after the row reorders (what vLLM runs)
        pre = [st for st in m.steps[:-1]]

        def fn(x):
            out = []
            for e in range(x.shape[0]):
                t = x[e].view(torch.uint8)
                for st in pre:
                    t = t[st.src.to(x.device)]
                out.append(shuffle_matrix_a(t, 128))
            return torch.stack(out)

        return fn
    if tensor.endswith("scale") and label == "nvfp4":

        def fn(x):
            return block_scale_interleave(x.view(torch.uint8))

        return fn
    return None


# ------------------------------------------------------------------ one transform
def bench_one(preset, label, tensor, m, experts, dev, args):
    em = m.compiled()
    g = torch.Generator(device=dev).manual_seed(1234)
    x = torch.randint(0, 256, (experts, m.in_bytes), dtype=torch.uint8, device=dev, generator=g)
    out = torch.empty((experts, m.out_bytes), dtype=torch.uint8, device=dev)
    nin, nout = x.numel(), out.numel()
    moved = nin + nout
    rec = {
        "transform": f"{preset}/{label}/{tensor}",
        "preset": preset,
        "tensor": tensor,
        "map": m.name,
        "experts": experts,
        "in_shape": list(m.in_shape),
        "out_shape": list(m.out_shape),
        "cell_bytes": em.cell_bytes,
        "bytes_in": nin,
        "bytes_out": nout,
    }

    # copy ceiling: same input byte count, device to device (best of before and after ours)
    dst = torch.empty_like(x)

    def measure_copy():
        return 2 * nin / timeit(lambda: dst.copy_(x), dev, args.repeats, warmup=2)

    backend = kernels.pick_backend(dev, nout)
    rec["backend"] = backend
    ref = Uint8Gather(m, dev)
    if dev.type == "cuda":
        copy = measure_copy()
        t = timeit(lambda: execute(em, x, out), dev, args.repeats, warmup=2)
        copy_after = measure_copy()
        rec["copy_gbps"] = max(copy, copy_after) / 1e9
        rec["copy_spread"] = abs(copy - copy_after) / max(copy, copy_after)
        rec["ours_gbps"] = moved / t / 1e9
        rec["ratio"] = rec["ours_gbps"] / rec["copy_gbps"]
    else:
        # a shared CPU's load drifts: time copy and ours in alternation, ratio = median of pairs
        copies = cpu_copies(x, dst)
        # a small transform (the 1.8 MB block-scale swap: ~50 us) is timed over ``inner`` back-to-back
        # calls per sample (a sample of >= 2 ms, copies alike), as a convert of many tensors runs it
        for f in copies + [lambda: execute(em, x, out)]:
            f()
        one = min(_cpu_sample(lambda: execute(em, x, out), 1) for _ in range(3))  # after the first calls
        inner = max(1, min(200, int(2e-3 / max(one, 1e-7))))
        rec["cpu_calls_per_sample"] = inner
        tc, to = [], []
        for _ in range(args.repeats):
            tc.append(min(_cpu_sample(f, inner) for f in copies))
            to.append(_cpu_sample(lambda: execute(em, x, out), inner))
        t = statistics.median(to)
        rec["copy_gbps"] = 2 * nin / statistics.median(tc) / 1e9
        rec["ours_gbps"] = moved / t / 1e9
        rec["ratio"] = statistics.median([moved * c / (2 * nin * o) for c, o in zip(tc, to)])
    del dst
    rec["ours_ms"] = t * 1e3
    rec["peak_extra_bytes"] = peak_extra(lambda: execute(em, x, torch.empty_like(out)), dev)
    if rec["peak_extra_bytes"] is None:
        rec["peak_extra_bytes"] = nout + em.src.nbytes  # the output and the int32 index
    rec["bit_exact_vs_uint8_gather"] = bool(torch.equal(out, ref(x)))
    for other in kernels.available_backends(dev):
        if other != backend:
            t2 = timeit(lambda: execute(em, x, out, backend=other), dev, args.repeats, warmup=1)
            rec[f"{other}_gbps"] = moved / t2 / 1e9
            rec[f"{other}_ratio"] = rec[f"{other}_gbps"] / rec["copy_gbps"]

    # bounded-memory in-place mode (permutations only)
    if m.is_permutation and not args.no_inplace:
        dflt = kernels.default_scratch_experts(experts)
        y = x.clone()
        execute_in_place(em, y, dflt)
        rec["inplace_bit_exact"] = bool(torch.equal(y, out))
        for sc, key in ((dflt, "inplace"), (2, "inplace2"), (1, "inplace1")):
            if key != "inplace" and (sc >= dflt or dev.type == "cpu"):
                continue
            t = timeit(lambda: execute_in_place(em, y, sc), dev, max(3, args.repeats // 2), warmup=1)
            rec[f"{key}_scratch_experts"] = sc
            rec[f"{key}_gbps"] = moved / t / 1e9
            rec[f"{key}_ratio"] = rec[f"{key}_gbps"] / rec["copy_gbps"]
            em._dev.clear()  # the plan's indices are allocated again: counted in the peak
            pk = peak_extra(lambda: execute_in_place(em, y, sc), dev)
            rec[f"{key}_peak_extra_bytes"] = pk if pk is not None else sc * m.in_bytes + em.src.nbytes
        del y

    # baselines
    if not args.no_baselines:
        t = timeit(lambda: ref(x), dev, max(3, args.repeats // 3) if dev.type == "cuda" else 2, warmup=1, min_sample=0)
        rec["uint8_gather_gbps"] = moved / t / 1e9
        rec["uint8_gather_peak_extra_bytes"] = peak_extra(lambda: ref(x), dev)
        loop_out = per_expert_loop(m, x)
        rec["per_expert_loop_bit_exact"] = bool(torch.equal(loop_out.view(experts, -1), out))
        del loop_out
        t = timeit(lambda: per_expert_loop(m, x), dev, args.loop_repeats, warmup=0, min_sample=0)
        rec["per_expert_loop_gbps"] = moved / t / 1e9
        rec["per_expert_loop_ms"] = t * 1e3
        fi = flashinfer_fn(label, tensor, m)
        if fi is not None:
            try:
                xin = x.view((experts,) + tuple(m.in_shape))
                t = timeit(lambda: fi(xin), dev, max(3, args.repeats // 3), warmup=1)
                rec["flashinfer_gbps"] = moved / t / 1e9
            except Exception as exc:  # noqa: BLE001
                rec["flashinfer_note"] = f"failed: {type(exc).__name__}: {exc}"[:200]
        else:
            rec["flashinfer_note"] = (
                "not importable" if not _has_flashinfer() else "no FlashInfer function for this map"
            )
    del x, out, ref
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rec


def _has_flashinfer():
    try:
        import flashinfer  # noqa: F401

        return True
    except Exception:
        return False


def sweep(presets, dev, args):
    """Time Triton tile configs on each map; keep, per kernel (rows / words), the config
    with the best worst-case ratio to the copy."""
    from fimoe_lab.kernels import triton_gather as tg

    rows_cfgs = [dict(tile_words=tw, num_warps=nw) for tw, nw in [(512, 4), (1024, 4), (2048, 4), (4096, 8)]]
    words_cfgs = [dict(block_1d=b, warps_1d=w, use_swizzle=False) for b, w in [(1024, 4), (2048, 4), (8192, 8)]]
    words_cfgs += [
        dict(swizzle_kw=k, swizzle_warps=w, use_swizzle=True) for k, w in [(16, 4), (32, 4), (32, 8), (64, 8)]
    ]
    scores = {"rows": {i: [] for i in range(len(rows_cfgs))}, "words": {i: [] for i in range(len(words_cfgs))}}
    for preset, experts, hidden, inter, fmts in presets:
        for fmt, label, kw in fmts:
            if args.labels is not None and label not in args.labels:
                continue
            plan = plan_layer(fmt, "trtllm", inter, hidden, **kw)
            for tensor, m in plan.maps().items():
                em = m.compiled()
                if experts * m.in_bytes < (64 << 20):  # too small to time reliably; not scored
                    continue
                kind = "rows" if em.cell_bytes >= 16 else "words"
                cfgs = rows_cfgs if kind == "rows" else words_cfgs
                x = torch.randint(0, 256, (experts, m.in_bytes), dtype=torch.uint8, device=dev)
                out = torch.empty((experts, m.out_bytes), dtype=torch.uint8, device=dev)
                dst = torch.empty_like(x)
                copy = 2 * x.numel() / timeit(lambda: dst.copy_(x), dev, 8, 2)
                line = []
                for i, c in enumerate(cfgs):
                    t = timeit(lambda: tg.gather_triton(em, x, out, c), dev, 8, 2)
                    r = (x.numel() + out.numel()) / t / copy
                    scores[kind][i].append(r)
                    line.append(f"{r:.3f}")
                print(
                    f"sweep {preset}/{label}/{tensor} cell={em.cell_bytes} {kind}: " + " ".join(line),
                    file=sys.stderr,
                    flush=True,
                )
                del x, out, dst
                torch.cuda.empty_cache()
    best, table = {}, []
    for kind, cfgs in (("rows", rows_cfgs), ("words", words_cfgs)):
        sc = {i: v for i, v in scores[kind].items() if v}
        for i, v in sc.items():
            table.append(dict(kernel=kind, config=cfgs[i], min=min(v), mean=statistics.mean(v)))
        if sc:
            b = max(sc, key=lambda i: (min(sc[i]), statistics.mean(sc[i])))
            best.update(cfgs[b])
            print(
                f"sweep best {kind} config {cfgs[b]}: min {min(sc[b]):.3f} mean {statistics.mean(sc[b]):.3f}",
                file=sys.stderr,
            )
    return best, table


def map_build_times(layers=58, experts=256, hidden=7168, inter=2048):
    """Seconds to build every layer's maps and executable forms for a DeepSeek-V3-sized
    model from cold caches (all step and plan caches cleared first), per format."""
    import fimoe_lab.prepare as prep
    import fimoe_lab.steps as st
    from fimoe_lab.caches import clear_caches
    from fimoe_lab.prepare import MoELayerSpec, plan_fp8_moe_layer

    def clear():
        clear_caches()
        for mod in (st, prep):
            for v in vars(mod).values():
                if hasattr(v, "cache_clear"):
                    v.cache_clear()

    out = {}
    meta = dict(device="meta")
    w13 = torch.empty(experts, 2 * inter, hidden, dtype=torch.float8_e4m3fn, **meta)
    w2 = torch.empty(experts, hidden, inter, dtype=torch.float8_e4m3fn, **meta)
    scales = {
        "fp8": (torch.empty(experts, **meta), torch.empty(experts, **meta), None),
        "fp8-block": (
            torch.empty(experts, 2 * inter // 128, hidden // 128, **meta),
            torch.empty(experts, hidden // 128, inter // 128, **meta),
            [128, 128],
        ),
        "mxfp8": (
            torch.empty(experts, 2 * inter, hidden // 32, dtype=torch.uint8, **meta),
            torch.empty(experts, hidden, inter // 32, dtype=torch.uint8, **meta),
            [1, 32],
        ),
    }
    for fmt, (s13, s2, block) in scales.items():
        clear()
        t = time.perf_counter()
        for _ in range(layers):  # each layer calls the entry point with its own tensors
            plan = plan_fp8_moe_layer(
                MoELayerSpec(inter, hidden, weight_block_size=block), w13, w2, s13, s2, is_trtllm=True
            )
            for m in plan.maps().values():
                m.compiled()
        out[f"deepseek-v3/{fmt}"] = time.perf_counter() - t
    for fmt in ("nvfp4", "bf16"):
        clear()
        t = time.perf_counter()
        for _ in range(layers):
            for m in plan_layer(fmt, "trtllm", inter, hidden).maps().values():
                m.compiled()
        out[f"deepseek-v3-shape/{fmt}"] = time.perf_counter() - t
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="small sizes (CI, a minute on 2 cores)")
    ap.add_argument("--json", action="store_true", help="print the JSON list on stdout, the table on stderr")
    ap.add_argument("--out", help="write the full JSON (records + environment) here")
    ap.add_argument("--presets", nargs="*", default=list(PRESETS))
    ap.add_argument("--labels", nargs="*", default=None, help="only these formats, e.g. deepseek_block bf16_block")
    ap.add_argument("--tensors", nargs="*", default=None, help="only these tensors, e.g. w13_scale w2_scale")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--loop-repeats", type=int, default=None)
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--no-inplace", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="(cuda) pick Triton tile sizes first")
    ap.add_argument("--map-build", action="store_true", help="time building all 58 layers' maps (cold caches)")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but no CUDA device is visible")
    args.repeats = args.repeats or (5 if args.quick else (20 if dev.type == "cuda" else 5))
    args.loop_repeats = args.loop_repeats or (3 if args.quick or dev.type == "cuda" else 1)

    presets = []
    for name in args.presets:
        e, h, i, fmts = PRESETS[name]
        if args.quick:
            e, h, i = QUICK[name]
        presets.append((name, e, h, i, fmts))

    env = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "quick": args.quick,
        "repeats": args.repeats,
        "loop_repeats": args.loop_repeats,
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:
        pass
    try:
        import numba

        env["numba"] = numba.__version__
        env["numba_threads"] = numba.get_num_threads()
    except Exception:
        pass
    env["flashinfer"] = "installed" if _has_flashinfer() else "not importable (its columns are skipped)"

    # timed calls run on the loaded executor, not on the stand-in of a fresh process's first calls
    kernels.load_executor(kernels.pick_backend(dev, 1 << 30))
    if args.sweep and dev.type == "cuda":
        from fimoe_lab.kernels import triton_gather as tg

        best, table = sweep(presets, dev, args)
        tg.CONFIG.update(best)
        env["sweep"] = table
    if dev.type == "cuda":
        from fimoe_lab.kernels import triton_gather as tg

        env["triton_config"] = dict(tg.CONFIG)

    if args.map_build:
        env["map_build_seconds_58_layers"] = map_build_times()
        print(f"map build, 58 layers, cold caches: {env['map_build_seconds_58_layers']}", file=sys.stderr)
    for name in kernels.available_backends(dev):
        kernels.load_executor(name)  # no stand-in while numba loads in the background
    t0 = time.time()
    records = []
    for preset, experts, hidden, inter, fmts in presets:
        for fmt, label, kw in fmts:
            if args.labels is not None and label not in args.labels:
                continue
            plan = plan_layer(fmt, "trtllm", inter, hidden, **kw)
            for tensor, m in plan.maps().items():
                if args.tensors is not None and tensor not in args.tensors:
                    continue
                n = experts
                if dev.type == "cpu" and not args.quick and experts * m.in_bytes > CPU_FULL_BYTES:
                    n = CPU_EXPERTS[preset]
                rec = bench_one(preset, label, tensor, m, n, dev, args)
                records.append(rec)
                print(_row(rec), file=sys.stderr, flush=True)
    env["seconds"] = time.time() - t0

    print(_table(records, env), file=sys.stderr if args.json else sys.stdout)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env, "records": records}, f, indent=1)
    if args.json:
        print(json.dumps(records))


def _fmt(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def _row(r):
    return (
        f"{r['transform']:<42} {r['backend']:<6} {r['cell_bytes']:>6} {r['bytes_in'] / 1e9:>7.3f} "
        f"{r['ours_gbps']:>8.1f} {r['copy_gbps']:>8.1f} {r['ratio']:>6.3f} "
        f"{_fmt(r.get('torch_gbps') or r.get('numba_gbps'))!s:>8} "
        f"{_fmt(r.get('inplace_ratio'), '.3f'):>7} {_fmt(r.get('inplace1_ratio'), '.3f'):>7} "
        f"{_fmt(r.get('uint8_gather_gbps')):>8} {_fmt(r.get('per_expert_loop_gbps'), '.2f'):>8} "
        f"{_fmt(r.get('flashinfer_gbps')):>8} {r['peak_extra_bytes'] / 1e9:>7.3f} "
        f"{_fmt((r.get('inplace_peak_extra_bytes') or 0) / 1e9, '.3f'):>7}"
    )


def _table(records, env):
    head = (
        f"{'transform':<42} {'exec':<6} {'cell':>6} {'GB in':>7} {'ours':>8} {'copy':>8} {'ratio':>6} "
        f"{'alt':>8} {'inpl':>7} {'inpl1':>7} {'u8gath':>8} {'loop':>8} {'fi':>8} {'peakGB':>7} {'ipeakGB':>7}"
    )
    lines = [
        f"# {env['device']}, torch {env['torch']}, GB/s = (read+write)/median time; ratio = ours/copy; "
        f"alt = the other backend; inpl/inpl1 = in-place ratio with default/1-expert scratch",
        head,
    ]
    lines += [_row(r) for r in records]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
