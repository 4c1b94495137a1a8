#!/usr/bin/env python
"""Speed of the tactic-validity model (:mod:`fimoe_lab.tune.validity`) per query.

Random shapes over every tuner format, activation, layout and per-token setting (the
distribution of ``tests/test_tune_validity.py``), answered by ``validity.answer``:

* cold: every cache emptied before each query (the runner's kernel filter per GEMM and the
  per-tile answers), i.e. the cost of a query no earlier query helped;
* process-warm: the kernel filters cached (a long-lived process), per-tile answers not;
* and through ``TacticOracle(mode="model").ask_many`` (query checks, names, the answer
  object), caches as they come.

Per-query times are CPU time of this thread (``time.thread_time``), so that a busy machine's
waits for a core do not count (the ``ask_many`` mean too); the table load is wall time.

    python benchmarks/validity_speed.py            # 5000 shapes
    python benchmarks/validity_speed.py --shapes 20000 --seed 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from tactic_snapshot import random_queries  # noqa: E402

from fimoe_lab.tune import validity  # noqa: E402
from fimoe_lab.tune.oracle import TacticOracle, model_answer  # noqa: E402


def _pct(xs: list, p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    qs = random_queries(a.shapes, random.Random(a.seed))
    path = validity.find_table()
    assert path is not None, "no shipped kernel table"
    t0 = time.perf_counter()
    table = validity.KernelTable(path.path)
    load = time.perf_counter() - t0

    def one(q, r) -> float:
        t0 = time.thread_time()
        model_answer(table, q, request=r)
        return time.thread_time() - t0

    reqs = [(q, q.request()) for q in qs]
    cold, warm = [], []
    for q, r in reqs:
        table._passing.clear()
        validity._tile_answer.cache_clear()
        cold.append(one(q, r))
    for q, r in reqs:
        validity._tile_answer.cache_clear()
        warm.append(one(q, r))
    validity._tile_answer.cache_clear()
    o = TacticOracle(mode="model")
    t0 = time.thread_time()
    answers = o.ask_many(qs)
    via_oracle = (time.thread_time() - t0) / len(qs)
    counts = [x.count for x in answers]
    print(
        f"{len(qs)} random shapes (seed {a.seed}); {table.path.name}: {table.size} kernels, loaded in {load * 1e3:.0f} ms"
    )
    for name, xs in (("cold (no caches)", cold), ("process-warm (filters cached)", warm)):
        print(
            f"validity.answer, {name:30s}: p50 {_pct(xs, 0.5):6.1f} us  p90 {_pct(xs, 0.9):6.1f}  "
            f"p99 {_pct(xs, 0.99):6.1f}  max {max(xs) * 1e6:6.0f}  mean {statistics.mean(xs) * 1e6:6.1f}"
        )
    print(f"TacticOracle(mode='model').ask_many: mean {via_oracle * 1e6:.1f} us/query")
    print(
        f"answers: {sum(c == 0 for c in counts)} with no tactic, max count {max(counts)}, mean {statistics.mean(counts):.0f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
