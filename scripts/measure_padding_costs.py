"""Measure what each padding costs, next to its tactic counts: our layout transform and the
expert GEMMs (bf16 torch._grouped_mm, padded vs unpadded). Run on a GPU for the GEMM part.

    python scripts/measure_padding_costs.py --out results/      # writes CSV + a markdown table
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from fimoe_lab.tune.oracle import TacticOracle
from fimoe_lab.tune.sweep import sweep
from fimoe_lab.tune.timing import measure_grouped_mm, measure_transform, timing_status

CASES = (
    ("qwen3-30b-a3b", "bf16", 8),
    ("nemotron3-nano", "bf16", 4),
    ("gpt-oss-120b", "mxfp4", 4),
    ("deepseek-v3", "fp8", 8),
)
COLUMNS = [
    "inter_align",
    "hidden_align",
    "intermediate",
    "hidden",
    "t1",
    "t4096",
    "extra_bytes_pct",
    "transform_ms",
    "gemm_ms",
    "gemm_vs_unpadded",
    "reference",
    "recommended",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for CSV and markdown")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens for the GEMM timing (default 4096)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    oracle = TacticOracle(mode="snapshot")
    lines = [
        f"device: {torch.cuda.get_device_name(0) if device == 'cuda' else 'cpu'}; torch {torch.__version__}; "
        f"{timing_status()}; GEMM tokens {args.tokens}; tactic counts from the snapshot",
        "",
    ]
    for preset, fmt, tp in CASES:
        df = sweep(preset, fmt, tp, oracle, tokens=(1, 4096))
        df = measure_transform(df, device=device, experts=None if device == "cuda" else 4)
        if device == "cuda":
            df = measure_grouped_mm(df, tokens=args.tokens)
        df.to_csv(args.out / f"padding_costs_{preset}_{fmt}_tp{tp}.csv", index=False)
        cols = [c for c in COLUMNS if c in df.columns]
        lines += [
            f"### {preset} {fmt} TP={tp} (transform: {df.attrs['transform_experts']} experts on "
            f"{df.attrs['transform_device']})",
            "",
            df[cols].to_markdown(index=False, floatfmt=".3f"),
            "",
        ]
        print(lines[-3], flush=True)
    (args.out / "padding_costs.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
