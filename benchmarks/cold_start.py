"""Cold start of the public drop-ins: the first call of a fresh process, against the same call warm.

Each measurement is a fresh Python process (``--child``) that imports torch and
``fimoe_lab.prepare``, builds one layer's random weights, then calls a drop-in twice on
fresh copies of the same tensors: ``first`` pays imports of the executors, kernel
compilation or loading from the on-disk cache, plan building; ``warm`` is the transform
itself. ``overhead = first - warm`` is what a cold process adds (the aim: <= 0.3 s with a
warm kernel cache, < 3 s with an empty one).

Modes, each ``--runs`` fresh processes:

- ``warm-cache``: the on-disk kernel caches as they are (one priming process first);
- ``empty-cache``: ``NUMBA_CACHE_DIR`` and ``TRITON_CACHE_DIR`` point at new empty
  directories, so every kernel compiles;
- ``warmed-up``: ``fimoe_lab.warmup.warmup`` for the drop-in's format ran in the
  process before the first call (what ``fimoe-lab warmup`` buys a serving engine);
- ``warm-cache-sync``: as ``warm-cache`` with ``FIMOE_BACKGROUND_LOAD=0``: the first call
  loads numba in its own thread instead of running on torch while numba loads in the
  background (:mod:`fimoe_lab.kernels.registry`).

Modes are run in turn (``--runs`` rounds of every mode), so a shared machine's load drifts
over all of them alike.

    python benchmarks/cold_start.py --device cpu --experts 8
    PYTHONPATH=. python3 benchmarks/cold_start.py --device cuda --experts 256 --out cold.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from checkout import ROOT, child_env  # noqa: E402  (a child runs the PYTHONPATH given, then this checkout)

# drop-in -> (weight format the warm-up is told, description)
DROPINS = {
    "rotate": ("fp8", "rotate_weights_for_fi_trtllm_fp8_per_tensor_moe (FP8 per tensor, in place)"),
    "deepseek": ("fp8-block", "shuffle_deepseek_fp8_moe_weights (FP8 block scale, new tensors)"),
    "mxfp8": ("mxfp8", "shuffle_mxfp8_moe_weights (MXFP8 weights and scales, new tensors)"),
    "bf16_block": ("bf16", "convert_moe_weights_to_flashinfer_trtllm_block_layout (BF16, in place)"),
}


def child(args: argparse.Namespace) -> dict:
    """Run in the fresh process: time imports, the first call and a second (warm) call."""
    t_start = time.perf_counter()
    import torch

    t_torch = time.perf_counter()
    from fimoe_lab import prepare

    t_import = time.perf_counter()
    dev = torch.device(args.device)
    e, h, i = args.experts, args.hidden, args.inter
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randint(1, 255, shape, dtype=torch.uint8, device=dev, generator=g)

    if args.dropin == "bf16_block":  # two bytes a value
        w13, w2 = rnd(e, 2 * i, 2 * h).view(torch.bfloat16), rnd(e, h, 2 * i).view(torch.bfloat16)
    else:
        w13, w2 = rnd(e, 2 * i, h).view(torch.float8_e4m3fn), rnd(e, h, i).view(torch.float8_e4m3fn)
    s13, s2 = rnd(e, 2 * i, h // 32), rnd(e, h, i // 32)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def call() -> float:
        a, b = w13.clone(), w2.clone()
        sync()
        t = time.perf_counter()
        if args.dropin == "rotate":
            prepare.rotate_weights_for_fi_trtllm_fp8_per_tensor_moe(a, b, True)
        elif args.dropin == "bf16_block":
            prepare.convert_moe_weights_to_flashinfer_trtllm_block_layout({}, a, b)
        elif args.dropin == "deepseek":
            prepare.shuffle_deepseek_fp8_moe_weights(a, b)
        else:
            prepare.shuffle_mxfp8_moe_weights(a, b, s13, s2, True)
        sync()
        return time.perf_counter() - t

    sync()
    t_warmup = 0.0
    if args.mode == "warmed-up":
        from fimoe_lab.warmup import warmup

        t = time.perf_counter()
        warmup(formats=[DROPINS[args.dropin][0]], devices=[args.device], hidden=h, intermediate=i, experts=e)
        t_warmup = time.perf_counter() - t
    first = call()
    warm = min(call() for _ in range(3))
    return {
        "import_torch_s": t_torch - t_start,
        "import_fimoe_lab_s": t_import - t_torch,
        "warmup_s": t_warmup,
        "first_call_s": first,
        "warm_call_s": warm,
        "overhead_s": first - warm,
    }


def run_child(args: argparse.Namespace, mode: str, env: dict) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--mode", mode, "--device", args.device]
    cmd += ["--dropin", args.dropin, "--experts", str(args.experts), "--hidden", str(args.hidden)]
    cmd += ["--inter", str(args.inter)]
    t = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t
    if p.returncode:
        raise SystemExit(f"child failed ({mode}):\n{p.stderr[-3000:]}")
    rec = json.loads(p.stdout.strip().splitlines()[-1])
    rec["process_wall_s"] = wall
    return rec


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--mode", default="warm-cache", choices=("warm-cache", "warm-cache-sync", "empty-cache", "warmed-up")
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dropin", default="rotate", choices=sorted(DROPINS))
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--modes", nargs="*", default=["warm-cache", "empty-cache", "warmed-up"])
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    env = child_env()
    run_child(args, "warm-cache", env)  # prime the on-disk caches
    results = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "dropin": args.dropin, "modes": {}}
    all_runs: dict[str, list[dict]] = {mode: [] for mode in args.modes}
    for _ in range(args.runs):
        for mode in args.modes:
            e = dict(env)
            if mode == "empty-cache":
                tmp = tempfile.mkdtemp(prefix="fimoe_cold_")
                e["NUMBA_CACHE_DIR"] = os.path.join(tmp, "numba")
                e["TRITON_CACHE_DIR"] = os.path.join(tmp, "triton")
            if mode == "warm-cache-sync":
                e["FIMOE_BACKGROUND_LOAD"] = "0"
            all_runs[mode].append(run_child(args, mode, e))
    for mode, runs in all_runs.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        results["modes"][mode] = {"runs": runs, "median": med}
        print(
            f"{args.dropin} {args.device} E={args.experts} {mode:<12} first {med['first_call_s']:.3f} s, "
            f"warm {med['warm_call_s']:.3f} s, overhead {med['overhead_s']:.3f} s "
            f"(warm-up {med['warmup_s']:.3f} s, import fimoe_lab {med['import_fimoe_lab_s']:.3f} s, "
            f"torch {med['import_torch_s']:.3f} s); overhead per run "
            + ", ".join(f"{r['overhead_s']:.3f}" for r in runs),
            flush=True,
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
