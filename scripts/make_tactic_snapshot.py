#!/usr/bin/env python
"""Record a tactic snapshot from the live oracle into tests/fixtures/tactics/.

The snapshot is FlashInfer's own answers on a grid of shapes; the tests check the validity
model (``fimoe_lab/tune/validity.py``, what the package answers from) against it.

Covers every preset x every tuner format (``specs.tuner_formats()``; nvfp4 with and
without per-token scaling) x TP 1/2/4/8 x the sweep's alignment grid (intermediate
none/16/32/64/128/256 x hidden none/256/512/1024, plus ``fimoe-lab convert``'s default
pair, :func:`fimoe_lab.tune.sweep.paddings`) x tokens 1/8/64/512/4096/16384, plus the
DESIGN §5 reference points.
Stores, per distinct query shape, the number of configs per tile_N (not the config
lists), or the error FlashInfer raised.  The file is named after the FlashInfer version
and the kernel-set hash: tactics-fi<version>-<kernel set hash>.json.gz.

    python scripts/make_tactic_snapshot.py            # needs `python -m fimoe_lab.tune.build` first
    python scripts/make_tactic_snapshot.py --out /tmp/x.json.gz
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gzip
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fimoe_lab.presets import PRESETS  # noqa: E402
from fimoe_lab.specs import FORMATS, tuner_formats  # noqa: E402
from fimoe_lab.tune.oracle import TacticOracle, TacticQuery  # noqa: E402
from fimoe_lab.tune.sweep import HIDDEN_ALIGNS, INTER_ALIGNS, TOKENS, TPS, queries_for  # noqa: E402


def design_points() -> list[TacticQuery]:
    """DESIGN §5's measured points (top_k 6, 128 experts) so tests can check them."""
    out = []
    for fmt, act, pts in [
        ("nvfp4", "swiglu", (True, False)),
        ("nvfp4", "relu2", (True, False)),
        ("mxfp8", "swiglu", (False,)),
        ("mxfp8", "relu2", (False,)),
        ("bf16", "swiglu", (False,)),
        ("fp8", "swiglu", (False,)),
    ]:
        for pt in pts:
            for h in (2560, 2688, 2816, 3072):
                for i in (1792, 1856, 1872, 1920, 2048):
                    for t in TOKENS:
                        out.append(TacticQuery(fmt, act, h, i, 128, 6, t, pt).normalized())
    # bf16 at 384 vs 512 intermediate (DESIGN: a multiple of 128 is not always best)
    for i in (320, 384, 448, 512):
        for t in TOKENS:
            out.append(TacticQuery("bf16", "swiglu", 2048, i, 128, 8, t).normalized())
    return out


def all_queries() -> list[TacticQuery]:
    seen, out = set(), []

    def add(qs):
        for q in qs:
            if q.key() not in seen:
                seen.add(q.key())
                out.append(q)

    for p in PRESETS.values():
        for fmt in tuner_formats():  # every format, not only the serving ones
            tactics = FORMATS[fmt].tactics
            layouts = (None, "major-k") if tactics.default_layout == "block-major-k" else (None,)
            for pt in (False, True) if tactics.per_token_ok else (False,):
                for layout in layouts:
                    for tp in TPS:
                        if p.moe_intermediate % tp:
                            continue
                        add(queries_for(p, fmt, tp, pt, layout, TOKENS, INTER_ALIGNS, HIDDEN_ALIGNS))
    add(design_points())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="output file (default: tests/fixtures/tactics/tactics-fi<ver>-<kset>.json.gz)")
    a = ap.parse_args(argv)
    oracle = TacticOracle(mode="live")
    src = oracle.source()
    if src.get("error"):
        print(f"error: {src['error']}", file=sys.stderr)
        return 2
    qs = all_queries()
    print(f"{len(qs)} distinct query shapes; source {src}", flush=True)
    t0 = time.time()
    answers = oracle.ask_many(qs, progress=True)
    secs = time.time() - t0
    entries, unknown, errors = {}, 0, collections.Counter()
    for q, ans in zip(qs, answers):
        if not ans.known:
            unknown += 1
            continue
        if ans.count == 0 and ans.reason and ans.reason.startswith("FlashInfer rejected"):
            entries[q.key()] = {"error": ans.reason}
            errors[ans.reason[:80]] += 1
        else:
            entries[q.key()] = {str(t): n for t, n in sorted(ans.per_tile.items())}
    kset = src.get("kernel_set") or "unknown"
    khash = kset.split("@")[-1][:12]
    meta = {
        "flashinfer": src.get("flashinfer"),
        "kernel_set": kset,
        "mode": src.get("mode"),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "query_seconds": round(secs, 1),
        "shapes": len(entries),
        "unknown": unknown,
        "key": "format|activation|per_token|layout|hidden|intermediate|experts|top_k|tokens",
        "grid": {
            "presets": sorted(PRESETS),
            "tp": list(TPS),
            "inter_aligns": list(INTER_ALIGNS),
            "hidden_aligns": list(HIDDEN_ALIGNS),
            "tokens": list(TOKENS),
        },
        "value": "{tile_N: number of configs} or {'error': reason}",
    }
    fixtures = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "tactics"
    out = Path(a.out) if a.out else fixtures / f"tactics-fi{meta['flashinfer']}-{khash}.json.gz"
    out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(out, "wt", compresslevel=9) as f:
        json.dump({"meta": meta, "entries": entries}, f, separators=(",", ":"), sort_keys=True)
    print(
        f"wrote {out} ({out.stat().st_size / 1e3:.0f} kB): {len(entries)} shapes in {secs:.0f}s, "
        f"{unknown} unknown, errors: {dict(errors)}"
    )
    oracle.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
