"""Device probe: the public drop-ins on full layers with the Triton executor's tile table as
shipped and with other tile settings, alternated in rounds with a same-run copy (the figure
is the median over rounds of each round's ratio to the copy; ratio as bench_dropins.py).

    python3 benchmarks/pair_dropins.py [--rounds 9] [--cases deepseek mxfp8] [--out pair.json]

``--against`` names the other settings as JSON (default: 4096-word tiles for rows and 2-D runs, the tile size before 2 KB tiles).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkout import on_path  # noqa: E402  (PYTHONPATH=TREE measures TREE)

on_path()

import torch  # noqa: E402
from bench_dropins import CASES, make_case, time_call  # noqa: E402
from bench_transforms import save_results  # noqa: E402

from fimoe_lab import kernels  # noqa: E402
from fimoe_lab.kernels import tiles  # noqa: E402

TILES_4096W = {"tile_words": 4096, "tile_2d_words": 4096}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--against", type=json.loads, default=TILES_4096W)
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = torch.device("cuda")
    shipped = dict(tiles.CONFIG)
    other = dict(shipped, **args.against)
    kernels.load_executor("triton")
    records = []
    for name in args.cases:
        g = torch.Generator(device=dev).manual_seed(17)
        ins, call, _, in_place = make_case(name, None, dev, g)
        n_in = sum(t.nbytes for t in ins)
        n_out = n_in if in_place else sum(t.nbytes for t in call(*ins))
        src = torch.cat([t.reshape(-1).view(torch.uint8) for t in ins])
        dst = torch.empty_like(src)
        ratios = {"shipped": [], "against": []}
        for r in range(args.rounds):
            order = [("shipped", shipped), ("against", other)][:: 1 if r % 2 else -1]
            copy = statistics.median(time_call(lambda: dst.copy_(src), dev) for _ in range(3))
            for key, cfg in order:
                tiles.CONFIG.clear()
                tiles.CONFIG.update(cfg)
                call(*ins)  # compile / warm under these settings
                t = statistics.median(time_call(lambda: call(*ins), dev) for _ in range(3))
                ratios[key].append((n_in + n_out) / t / (2 * n_in / copy))
        tiles.CONFIG.clear()
        tiles.CONFIG.update(shipped)
        rec = {"dropin": name, "in_place": in_place, **{k: statistics.median(v) for k, v in ratios.items()}}
        records.append(rec)
        print(
            f"{name:<12} in place {in_place!s:<5} shipped {rec['shipped']:.3f} against {rec['against']:.3f}", flush=True
        )
        del ins, src, dst
        torch.cuda.empty_cache()
    if args.out:
        save_results(args.out, against=args.against, records=records)


if __name__ == "__main__":
    main()
