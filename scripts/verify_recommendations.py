"""Check every tuner recommendation against what consumes it: tactics, convert's padding, predicted time.

For every preset x tuner format x TP 1/2/4/8 x GPU (b200: TRT-LLM, h200: CUTLASS; each where the
format has that backend, so MxInt4 on b200 only) x per-token (where the format has it): the recommendation, when there is one, has tactics at every token count; for every
distinct rank size (as the reader shards) ``recipes.plan_layer`` with the recommended alignments
pads exactly to the recommended sizes; no padding with fewer extra bytes that convert accepts is
predicted at least as fast. A run without a recommendation must give a reason. Prints each
violation and a summary line; exit status 1 when any.

    python scripts/verify_recommendations.py        # ~150 s on 2 cores
"""

from __future__ import annotations

import sys
import time

from fimoe_lab.errors import FimoeError
from fimoe_lab.presets import PRESETS
from fimoe_lab.recipes import plan_layer
from fimoe_lab.specs import FORMATS, get_activation, tuner_formats
from fimoe_lab.tune.cost import get_gpu
from fimoe_lab.tune.oracle import TacticOracle
from fimoe_lab.tune.sweep import convert_check, rank_sizes, run


def check_plan(p, fmt, tp, s, rec) -> list[str]:
    """Violations of: plan_layer pads every rank to the recommended sizes."""
    out = []
    act = get_activation(p.activation)
    ref = s.attrs["reference"]
    default = (rec["inter_align"], rec["hidden_align"]) == (ref["inter_align"], ref["hidden_align"])
    for i in dict.fromkeys(rank_sizes(p, fmt, tp)):
        try:
            pl = plan_layer(
                FORMATS[fmt].plan_format,
                s.attrs["backend"],
                i,
                p.hidden,
                act.is_act_and_mul,
                act.gated,
                None if default else rec["inter_align"],
                None if default else rec["hidden_align"],
            )
        except FimoeError as e:
            out.append(f"PLAN REFUSED rank intermediate {i}: {e}")
            continue
        want = (-(-i // rec["inter_align"]) * rec["inter_align"], rec["hidden"])
        if (pl.padded_intermediate, pl.padded_hidden) != want:
            out.append(f"PLAN MISMATCH rank intermediate {i}: {(pl.padded_intermediate, pl.padded_hidden)} != {want}")
    return out


def check(p, fmt, tp, s) -> list[str]:
    """Violations of one sweep's recommendation."""
    rec = s.attrs["recommendation"]
    if rec is None:
        return [] if s.attrs["no_recommendation"] else ["no recommendation and no reason"]
    row = next(r for r in s.rows if r["recommended"])
    out = ["a token count without tactics"] if any(not row[c] for c in s.tcols) else []
    out += check_plan(p, fmt, tp, s, rec)
    rivals = [
        o
        for o in s.rows
        if o["candidate"] and o["extra_bytes_pct"] < rec["extra_bytes_pct"] and o["predicted_us"] <= rec["predicted_us"]
    ]
    for o in rivals:
        if convert_check(p, fmt, tp, o["inter_align"], o["hidden_align"], None, s.attrs["backend"]) is None:
            out.append(f"CHEAPER AND AS FAST: {o['inter_align']}, {o['hidden_align']}")
    return out


def main() -> int:
    oracle = TacticOracle("model")
    runs = none = bad = 0
    t0 = time.time()
    for name, p in PRESETS.items():
        for fmt in tuner_formats():
            per_token = (False, True) if FORMATS[fmt].tactics.per_token_ok else (False,)
            gpus = [
                g
                for g in ("b200", "h200")
                if ("trtllm" if get_gpu(g).trtllm_gen else "cutlass") in FORMATS[fmt].backends
            ]
            for tp in (1, 2, 4, 8):
                for gpu in gpus:
                    for pt in per_token:
                        s = run(p, fmt, tp, oracle, per_token=pt, gpu=gpu)
                        runs += 1
                        none += s.attrs["recommendation"] is None
                        for v in check(p, fmt, tp, s):
                            print(f"{name} {fmt} tp={tp} {gpu} per_token={pt}: {v}")
                            bad += 1
    print(f"runs {runs}, without a recommendation {none}, violations {bad}, {time.time() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
