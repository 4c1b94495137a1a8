"""Probe: where a restore's time goes, stage by stage, with the reader's read-ahead on and off.

    PYTHONPATH=. python benchmarks/probe_restore.py [--dir DIR] [--layers 4] [--experts 16] [--repeat 2] [--cold]
        [--numba-threads N] [--copy-input] [--json OUT.json]

Generates the DeepSeek-V3-dims FP8 block checkpoint of ``benchmarks/convert_stream.py``, converts it (TRT-LLM,
1 GB shards), then restores it ``--repeat`` times with the reader thread's read-ahead
(``stream.populate``: the next chunk's memory-mapped pages read in) on and off in turn, in this process after
one untimed restore, each beside a ``cp`` + ``sync`` of the converted shards timed right before it. With
``--cold`` the converted shards are dropped from the page cache (``POSIX_FADV_DONTNEED`` after an ``fsync``)
before every restore and its ``cp``, so the restore reads the disk. Every stage is wrapped in a timer
(``probe_convert.timed``): the reader's fetches and its read-ahead, the main thread's placing of each chunk and
the map inside it, the writers' ``pwrite`` calls, the per-layer drain. Prints one row per restore: seconds,
its share of the paired ``cp`` + ``sync``, and each stage's busy seconds.

Diagnostics for the map's pace: ``--numba-threads N`` runs the maps on N of numba's threads (fewer than the
CPUs leaves cores to the writer and hashing threads); ``--copy-input`` hands the map a copy of each chunk in
anonymous memory (made on the reader thread) instead of the memory-mapped file's pages.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkout import on_path  # noqa: E402  (PYTHONPATH=TREE measures TREE)

on_path()
from convert_stream import generate, timed_cp  # noqa: E402
from probe_convert import BUSY, timed  # noqa: E402

STAGES = {
    "fetch": "fetch a chunk (reader)",
    "populate": "read-ahead (reader)",
    "place": "place a chunk (main)",
    "map": "map back (main)",
    "pwrite": "pwrite (writers)",
    "drain": "drain a layer (main)",
}
READ_AHEAD = [True]


def instrument(copy_input: bool) -> None:
    from fimoe_lab import plan
    from fimoe_lab.checkpoints import restore, stream

    populate = timed(STAGES["populate"], stream.populate)
    stream.populate = lambda t: populate(t) if READ_AHEAD[0] else t
    fetch = restore._Back.fetch
    if copy_input:
        restore._Back.fetch = lambda self, e0, e1: fetch(self, e0, e1).clone()
    restore._Back.fetch = timed(STAGES["fetch"], restore._Back.fetch)
    restore._Back.place = timed(STAGES["place"], restore._Back.place)
    plan.MapCall.run = timed(STAGES["map"], plan.MapCall.run)
    stream._pwrite_all = timed(STAGES["pwrite"], stream._pwrite_all)
    stream.Workers.drain = timed(STAGES["drain"], stream.Workers.drain)


def drop_cache(d: Path) -> None:
    for f in sorted(d.glob("*.safetensors")):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--cold", action="store_true", help="drop the converted shards from the page cache first")
    ap.add_argument("--json", default=None)
    ap.add_argument("--numba-threads", type=int, default=0, help="numba threads for the maps (0: numba's default)")
    ap.add_argument("--copy-input", action="store_true", help="map a copy of each chunk, not the mapped file")
    a = ap.parse_args()
    from fimoe_lab.checkpoints import convert_checkpoint, restore_checkpoint

    work = Path(tempfile.mkdtemp(prefix="probe-restore-", dir=a.dir))
    rows = []
    try:
        generate(work / "src", a.layers, a.experts)
        kernel = convert_checkpoint(work / "src", work / "k", "trtllm", shard_size=10**9)
        restore_checkpoint(kernel, work / "r")  # untimed: imports, numba loaded
        shutil.rmtree(work / "r")
        if a.numba_threads:
            import numba

            numba.set_num_threads(a.numba_threads)  # this thread's parallel regions: the maps
        instrument(a.copy_input)
        total = sum(f.stat().st_size for f in Path(kernel).glob("*.safetensors"))
        print(
            f"{total / 1e9:.2f} GB converted, {os.cpu_count()} CPUs, page cache {'dropped' if a.cold else 'warm'}, "
            f"numba threads {a.numba_threads or 'default'}, input {'copied' if a.copy_input else 'mapped'}"
        )
        print(f"{'read-ahead':<10} {'s':>6} {'cp+sync s':>9} {'x cp':>5}  " + "  ".join(STAGES))
        for rep in range(a.repeat):
            for ahead in (True, False):
                READ_AHEAD[0] = ahead
                if a.cold:
                    drop_cache(Path(kernel))
                cp = timed_cp(Path(kernel), work / "cp", fsync=True)
                shutil.rmtree(work / "cp")
                if a.cold:
                    drop_cache(Path(kernel))
                BUSY.clear()
                t = time.perf_counter()
                restore_checkpoint(kernel, work / "r")
                wall = time.perf_counter() - t
                shutil.rmtree(work / "r")
                busy = {k: round(sum(v[0] for (_, s), v in BUSY.items() if s == name), 3) for k, name in STAGES.items()}
                rows.append({"read_ahead": ahead, "rep": rep, "s": wall, "cp_sync_s": cp, "of_cp": cp / wall, **busy})
                cells = "  ".join(f"{busy[k]:>{len(k)}.2f}" for k in STAGES)
                print(f"{'on' if ahead else 'off':<10} {wall:6.2f} {cp:9.2f} {cp / wall:5.2f}  {cells}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        about = {"cpus": os.cpu_count(), "cold": a.cold, "numba_threads": a.numba_threads, "copy_input": a.copy_input}
        Path(a.json).write_text(json.dumps({**about, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
