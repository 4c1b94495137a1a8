"""Distributed convert: throughput per process with 1 and 2 (or more) processes, against `cp`.

    PYTHONPATH=. python benchmarks/convert_distributed.py [--dir DIR] [--layers 4] [--experts 16]
        [--procs 1,2] [--device cpu[,cuda]] [--backend trtllm] [--shard-size 500000000] [--json OUT.json]

Generates the DeepSeek-V3-dimension checkpoint of ``benchmarks/convert_stream.py`` (its
``generate``: FP8 block-128, hidden 7168, MoE intermediate 2048, one source shard per layer),
times ``cp --reflink=never`` + ``sync`` of it (the disk's figure: convert fsyncs what it
writes), then for each ``--device`` and each process count N launches
``python -m torch.distributed.run --standalone --nproc-per-node N`` on this file as the worker
(:func:`fimoe_lab.checkpoints.distributed.convert_distributed`, sharded output of
``--shard-size`` so that there are shards to split). Per launch: the wall time of the launch
(process start and imports included), and per process its shards, bytes and seconds inside
the convert; the aggregate rate is the bytes over the slowest process's seconds. Every output
must be byte-identical to the first one (``cmp``). Prints a table and the JSON (also to ``--json``).
On one GPU with ``--device cuda`` every process converts on ``cuda:0``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkout import child_env  # noqa: E402  (PYTHONPATH=TREE measures TREE)
from convert_stream import HIDDEN, INTERMEDIATE, _same_files, generate, timed_cp  # noqa: E402


def worker(a: argparse.Namespace) -> None:
    """One process of a launch; process 0 writes the reports to ``--report``."""
    from fimoe_lab.checkpoints.distributed import convert_distributed

    start = time.perf_counter()
    done = convert_distributed(a.src, a.dst, a.backend, shard_size=a.shard_size, device=a.device)
    if done["rank"] == 0:
        Path(a.report).write_text(json.dumps({"processes": done["processes"], "call_s": time.perf_counter() - start}))


def launch(n: int, src: Path, dst: Path, report: Path, a: argparse.Namespace, device: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), __file__]
    cmd += ["--worker", "--src", str(src), "--dst", str(dst), "--report", str(report), "--device", device]
    cmd += ["--backend", a.backend, "--shard-size", str(a.shard_size)]
    env = child_env()
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    r = json.loads(report.read_text())
    procs = r["processes"]
    for p in procs:
        p["mb_per_s"] = p["bytes"] / max(p["seconds"], 1e-9) / 1e6
    slowest = max(p["seconds"] for p in procs)
    total = sum(p["bytes"] for p in procs)
    return {"procs": n, "wall_s": wall, "call_s": r["call_s"], "slowest_s": slowest, "bytes": total,
            "aggregate_mb_per_s": total / slowest / 1e6, "per_process": procs}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="working directory on the disk to measure (default: a temporary one)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--procs", default="1,2", help="process counts, comma separated")
    ap.add_argument("--backend", default="trtllm")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or both (cpu,cuda)")
    ap.add_argument("--shard-size", type=int, default=5 * 10**8)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--src", "--dst", "--report"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return 0
    work = Path(tempfile.mkdtemp(prefix="convert-dist-", dir=a.dir))
    try:
        src = work / "src"
        layer_bytes = generate(src, a.layers, a.experts)
        total = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        cp_s = timed_cp(src, work / "cp", fsync=True)
        shutil.rmtree(work / "cp")
        results: dict = {
            "checkpoint": {
                "layers": a.layers,
                "experts": a.experts,
                "hidden": HIDDEN,
                "moe_intermediate": INTERMEDIATE,
                "bytes": total,
                "layer_bytes": layer_bytes,
            },  # fmt: skip
            "backend": a.backend,
            "shard_size": a.shard_size,
            "cpus": os.cpu_count(),
            "cp_sync_s": cp_s,
            "cp_sync_mb_per_s": total / cp_s / 1e6,
            "runs": [],
        }
        first = None
        identical = True
        for dev in a.device.split(","):
            for n in map(int, a.procs.split(",")):
                dst = work / f"out-{dev}-{n}"
                run = launch(n, src, dst, work / f"report-{dev}-{n}.json", a, dev)
                run["device"] = dev
                results["runs"].append(run)
                if first is None:
                    first = dst
                else:
                    identical = identical and _same_files(first, dst)
                    shutil.rmtree(dst)
        results["outputs_identical"] = identical
        print(table(results))
        print(json.dumps(results, indent=2))
        if a.json:
            Path(a.json).write_text(json.dumps(results, indent=2) + "\n")
        return 0 if identical else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


def table(r: dict) -> str:
    c = r["checkpoint"]
    lines = [
        f"checkpoint: {c['layers']} layers x {c['experts']} experts, DeepSeek-V3 dims, {c['bytes'] / 1e9:.2f} GB "
        f"({c['layer_bytes'] / 1e9:.2f} GB a layer); {r['backend']}, shards of {r['shard_size'] / 1e9:.2f} GB, "
        f"{r['cpus']} CPUs; cp+sync {r['cp_sync_s']:.2f} s = {r['cp_sync_mb_per_s']:.0f} MB/s",
        "| device | procs | launch wall s | slowest process s | aggregate MB/s | per process: shards, MB/s |",
        "|---|---|---|---|---|---|",
    ]
    for run in r["runs"]:
        per = "; ".join(f"p{p['rank']}: {p['written']}, {p['mb_per_s']:.0f}" for p in run["per_process"])
        lines.append(
            f"| {run['device']} | {run['procs']} | {run['wall_s']:.1f} | {run['slowest_s']:.1f} | "
            f"{run['aggregate_mb_per_s']:.0f} | {per} |"
        )
    lines.append(f"outputs byte-identical across runs: {r['outputs_identical']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
