"""Time `convert_checkpoint` on one checkpoint, optionally with another fimoe_lab tree first on the path.

    python benchmarks/convert_ab.py CHECKPOINT [TREE] [--out-dir /dev/shm] [--runs 7]

Prints the median and minimum of the warm runs (the first run is dropped). Writing to a tmpfs
(/dev/shm) keeps the page cache's writeback out of the figure; the file is deleted after each
run. Used for the 0.1.0 vs 0.2.0 comparison in RESULTS.md (TREE = `git archive 53eb766` copy).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

ap = argparse.ArgumentParser()
ap.add_argument("checkpoint")
ap.add_argument("tree", nargs="?", default=None)
ap.add_argument("--out-dir", default="/dev/shm")
ap.add_argument("--runs", type=int, default=7)
ap.add_argument("--backend", default="trtllm")
a = ap.parse_args()
if a.tree:
    sys.path.insert(0, a.tree)
from fimoe_lab.checkpoints import convert_checkpoint  # noqa: E402

times = []
with tempfile.TemporaryDirectory(dir=a.out_dir) as d:
    for r in range(a.runs):
        out = os.path.join(d, f"k{r}.safetensors")
        t = time.perf_counter()
        convert_checkpoint(a.checkpoint, out, a.backend)
        times.append(time.perf_counter() - t)
        os.unlink(out)
warm = times[1:]
print(
    f"{a.tree or 'this tree'}: median {statistics.median(warm):.3f} s, min {min(warm):.3f} s over {len(warm)} warm runs"
)
