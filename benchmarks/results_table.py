"""Render a bench_transforms.py JSON file as the markdown table of RESULTS.md.

python benchmarks/results_table.py benchmarks/results/cpu_2core.json
"""

from __future__ import annotations

import json
import sys


def fmt(v, spec=".0f"):
    return "-" if v is None else format(v, spec)


def table(path: str) -> str:
    with open(path) as f:
        data = json.load(f)
    rows = [
        "| transform | cell B | GB in | ours GB/s | copy GB/s | **ratio** | other backend GB/s | in-place ratio: default scratch (experts) / 2 / 1 | in-place peak extra MB | uint8 gather GB/s | per-expert loop GB/s | FlashInfer GB/s | out-of-place peak extra GB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["records"]:
        alt = r.get("torch_gbps") or r.get("numba_gbps")
        if "inplace_ratio" in r:
            ip = f"{r['inplace_ratio']:.3f} ({r['inplace_scratch_experts']})"
            ip += f" / {fmt(r.get('inplace2_ratio'), '.3f')} / {fmt(r.get('inplace1_ratio'), '.3f')}"
            ipk = f"{r['inplace_peak_extra_bytes'] / 1e6:.0f}"
        else:
            ip, ipk = "n/a (pads: not a permutation)", "-"
        rows.append(
            f"| {r['transform']} | {r['cell_bytes']} | {r['bytes_in'] / 1e9:.3f} | {r['ours_gbps']:.0f} | "
            f"{r['copy_gbps']:.0f} | **{r['ratio']:.3f}** | {fmt(alt)} | {ip} | {ipk} | "
            f"{fmt(r.get('uint8_gather_gbps'), '.1f')} | {fmt(r.get('per_expert_loop_gbps'), '.2f')} | "
            f"{fmt(r.get('flashinfer_gbps'), '.2f')} | {r['peak_extra_bytes'] / 1e9:.3f} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(table(p))
