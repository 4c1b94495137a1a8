"""Cold wall time of ``fimoe-lab tune --model <preset>``: a fresh interpreter per run, no built module.

    python benchmarks/tune_cold.py                  # median of 5 fresh processes per case
    python benchmarks/tune_cold.py --runs 3 --source model

Each run is ``python -m fimoe_lab tune --model P --format F --tp N --source S`` in a new
process (``--source model``: the shipped validity model, never the built module), timed
from spawn to exit; it also reports whether torch or pandas got imported (they must not).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

CASES = (
    ("qwen3-30b-a3b", "bf16", 8),
    ("nemotron3-nano", "nvfp4", 4),
    ("gpt-oss-120b", "mxfp4", 8),
    ("deepseek-v3", "fp8-block", 8),
    ("kimi-k2", "nvfp4", 8),
)
PROBE = (
    "import runpy, sys; sys.argv = ['fimoe-lab'] + sys.argv[1:]\n"
    "try:\n    runpy.run_module('fimoe_lab', run_name='__main__')\n"
    "except SystemExit:\n    pass\n"
    "print('HEAVY', sorted(m for m in ('torch', 'pandas', 'numpy') if m in sys.modules), file=sys.stderr)"
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--source", default="model", help="--source of the tune command (default model)")
    args = ap.parse_args()
    print("| preset | format | TP | median s | max s | heavy imports |\n|---|---|---|---|---|---|")
    for preset, fmt, tp in CASES:
        argv = ["tune", "--model", preset, "--format", fmt, "--tp", str(tp), "--source", args.source]
        times, heavy = [], ""
        for _ in range(args.runs):
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True)
            times.append(time.perf_counter() - t0)
            heavy = next((ln.split(" ", 1)[1] for ln in r.stderr.splitlines() if ln.startswith("HEAVY")), "?")
        print(f"| {preset} | {fmt} | {tp} | {statistics.median(times):.2f} | {max(times):.2f} | {heavy} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
