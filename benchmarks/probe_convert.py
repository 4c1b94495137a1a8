"""Probe: where a streaming convert's time goes, stage by stage, on each thread.

    PYTHONPATH=. python benchmarks/probe_convert.py [--dir DIR] [--layers 4] [--experts 16] [--device cpu]
        [--shard-size BYTES]

Generates the DeepSeek-V3-dims FP8 block checkpoint of ``benchmarks/convert_stream.py``, times ``cp`` + ``sync`` of
its shards, then converts it in this process with every stage wrapped in a timer: the reader's block loads, the
transform of a chunk (``convert_layer``), the main thread's waits (for the reader, on a full worker queue, on a
drain), the writer threads' ``pwrite`` calls, the hashing threads' digests, and a shard's commit (header rewrite,
``fsync``, rename). Prints each stage's busy seconds, calls and share of the convert's wall time, per thread kind.
A stage whose busy time is close to the wall time is the one that sets the pace.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkout import on_path  # noqa: E402  (PYTHONPATH=TREE measures TREE)

on_path()
from convert_stream import generate, timed_cp  # noqa: E402

BUSY: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0])
LOCK = threading.Lock()


def _kind(name: str) -> str:
    return name.rstrip("0123456789_-") or name


def timed(stage: str, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            dt = time.perf_counter() - t
            with LOCK:
                rec = BUSY[(_kind(threading.current_thread().name), stage)]
                rec[0] += dt
                rec[1] += 1

    return wrapper


class TimedHash:
    def __init__(self, h):
        self.h = h
        self.update = timed("sha256", h.update)

    def hexdigest(self):
        return self.h.hexdigest()


def instrument() -> None:
    from fimoe_lab.checkpoints import convert, rank_layout, stream

    stream._pwrite_all = timed("pwrite", stream._pwrite_all)
    rank_layout.LayerLoader.__call__ = timed("read block", rank_layout.LayerLoader.__call__)
    convert.convert_layer = timed("transform", convert.convert_layer)
    convert._pinned = timed("pin block", convert._pinned)
    stream.Workers.submit = timed("submit (queue full waits)", stream.Workers.submit)
    stream.Workers.drain = timed("drain", stream.Workers.drain)
    stream.ShardFile.finish = timed("commit shard (fsync)", stream.ShardFile.finish)
    init = stream.ShardFile.__init__

    def shard_init(self, *a, **k):
        init(self, *a, **k)
        self.hashes = {n: TimedHash(h) for n, h in self.hashes.items()}

    stream.ShardFile.__init__ = shard_init


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="trtllm")
    ap.add_argument("--shard-size", type=int, default=5 * 10**9)
    a = ap.parse_args()
    from fimoe_lab.checkpoints import convert_checkpoint
    from fimoe_lab.warmup import warmup

    work = Path(tempfile.mkdtemp(prefix="probe-convert-", dir=a.dir))
    try:
        src = work / "src"
        generate(src, a.layers, a.experts)
        total = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        cp = timed_cp(src, work / "cp", fsync=True)
        shutil.rmtree(work / "cp")
        warmup(
            formats=["fp8-block"], backends=[a.backend], devices=[a.device], hidden=7168, intermediate=2048, experts=1
        )
        instrument()
        cp2 = timed_cp(src, work / "cp", fsync=True)
        shutil.rmtree(work / "cp")
        t = time.perf_counter()
        convert_checkpoint(src, work / "out", a.backend, shard_size=a.shard_size, device=a.device, single_file=False)
        wall = time.perf_counter() - t
        print(f"{total / 1e9:.2f} GB, {os.cpu_count()} CPUs, device {a.device}")
        print(f"cp + sync {cp:.2f} s / {cp2:.2f} s; convert {wall:.2f} s ({min(cp, cp2) / wall:.2f} of cp + sync)")
        print(f"{'thread':<22} {'stage':<28} {'busy s':>7} {'calls':>6} {'of wall':>7}")
        for (kind, stage), (busy, calls) in sorted(BUSY.items()):
            print(f"{kind:<22} {stage:<28} {busy:7.2f} {calls:6d} {busy / wall:7.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
