"""``fimoe-lab tune`` and ``fimoe-lab tactics``: argparse subcommands (wired by fimoe_lab.cli).

    fimoe-lab tune --model qwen3-30b-a3b --format nvfp4 --tp 8
    fimoe-lab tactics --format nvfp4 --act swiglu --per-token --hidden 3072 --inter 1920 \\
        --experts 128 --top-k 6 --tokens 1,8,64 --json
"""
from __future__ import annotations

import argparse
import json
import sys

from ..presets import PRESETS, get_preset
from .oracle import ACTIVATIONS, FORMATS, LAYOUTS, OracleError, TacticOracle, TacticQuery

_MODES = ("auto", "live", "native", "snapshot")


def _tokens(s: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens takes a comma-separated list of integers, got {s!r}")
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"--tokens needs positive integers, got {s!r}")
    return vals


def _lower_choice(valid):
    def parse(s: str) -> str:
        v = s.strip().lower()
        if v not in valid:
            raise argparse.ArgumentTypeError(f"{s!r} is not one of: {', '.join(valid)}")
        return v
    return parse


def register(subparsers) -> None:
    """Add the ``tune`` and ``tactics`` subcommands to an argparse subparsers object."""
    fmt_help = "; ".join(f"{k}: {v.description}" for k, v in FORMATS.items())

    t = subparsers.add_parser(
        "tune", help="alignment sweep for a model preset: tactics per padding, waste, recommendation",
        description="For a model preset, format and tensor-parallel size: pad the per-rank intermediate "
                    "and hidden sizes to each alignment, count the TRTLLM-Gen MoE tactics FlashInfer "
                    "offers per token count, show the padding waste, recommend the cheapest padding "
                    "with the full tactic space, and compare the reference's fixed rules.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="presets: " + ", ".join(sorted(PRESETS)) + "\nformats: " + ", ".join(FORMATS))
    t.add_argument("--model", required=True, type=_lower_choice(sorted(PRESETS)), metavar="PRESET",
                   help="model preset (" + ", ".join(sorted(PRESETS)) + ")")
    t.add_argument("--format", required=True, type=_lower_choice(list(FORMATS)), metavar="FMT",
                   help="weight/activation format (" + ", ".join(FORMATS) + ")")
    t.add_argument("--tp", type=int, default=1, help="tensor-parallel size (splits the intermediate size)")
    t.add_argument("--per-token", action="store_true", help="NVFP4 with per-token activation scales")
    t.add_argument("--tokens", type=_tokens, default=None, help="token counts (default 1,8,64,512,4096,16384)")
    t.add_argument("--source", choices=_MODES, default="auto",
                   help="where answers come from (auto: GPU, else built module, else snapshot)")
    t.add_argument("--csv", help="also write the table to this CSV file")
    t.add_argument("--json-out", help="also write the table and recommendation to this JSON file")
    t.add_argument("--plot", help="save the heatmap and waste-vs-tactics figures to this PNG prefix")
    t.set_defaults(handler=_run_tune)

    q = subparsers.add_parser(
        "tactics", help="valid TRTLLM-Gen MoE tactics ([tile_N, config]) for one shape",
        description="Ask FlashInfer's trtllm_get_valid_moe_configs (live, or from the recorded snapshot) "
                    "which tactics exist for one per-rank, already-padded MoE shape. A count of 0 is the "
                    "'No valid config found' failure; the reason says why.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog="formats: " + fmt_help)
    q.add_argument("--format", required=True, type=_lower_choice(list(FORMATS)), metavar="FMT",
                   help="one of " + ", ".join(FORMATS))
    q.add_argument("--act", default="swiglu", type=_lower_choice(list(ACTIVATIONS)),
                   help="activation: swiglu/geglu (gated) or relu2 (non-gated)")
    q.add_argument("--per-token", action="store_true", help="NVFP4 per-token activation scaling")
    q.add_argument("--layout", type=_lower_choice(list(LAYOUTS)), default=None,
                   help="weight layout (default per format: block-major-k for bf16/fp8-block, else major-k)")
    q.add_argument("--hidden", type=int, required=True, help="hidden size (K of GEMM1)")
    q.add_argument("--inter", type=int, required=True, help="intermediate size per expert and projection, per rank")
    q.add_argument("--experts", type=int, required=True, help="local experts")
    q.add_argument("--top-k", type=int, required=True, help="experts per token")
    q.add_argument("--tokens", type=_tokens, default=[1, 8, 64], help="comma-separated token counts (default 1,8,64)")
    q.add_argument("--source", choices=_MODES, default="auto", help="where answers come from")
    q.add_argument("--json", action="store_true", help="print a JSON list, one object per token count")
    q.add_argument("--configs", action="store_true", help="include the full [tile_N, config] list (live only)")
    q.set_defaults(handler=_run_tactics)


def _run_tactics(a) -> int:
    oracle = TacticOracle(mode=a.source)
    out = []
    for t in a.tokens:
        ans = oracle.ask(TacticQuery(a.format, a.act, a.hidden, a.inter, a.experts, a.top_k, t,
                                     a.per_token, a.layout))
        d = ans.to_json()
        if a.configs and ans.configs is not None:
            d["configs"] = [list(c) for c in ans.configs]
        out.append(d)
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        for d in out:
            tiles = " ".join(f"{k}:{v}" for k, v in d["per_tile"].items())
            cnt = "unknown" if d["count"] is None else d["count"]
            print(f"T={d['tokens']:>6}  tactics={cnt:>5}  per tile_N {{{tiles}}}"
                  + (f"  ({d['reason']})" if d.get("reason") else ""))
        s = out[0]["source"] if out else {}
        print(f"source: {s.get('kind')} (FlashInfer {s.get('flashinfer')}, kernel set {s.get('kernel_set')})")
    oracle.close()
    return 0


def _run_tune(a) -> int:
    try:
        from .sweep import TOKENS, export, plot_heatmap, plot_waste_vs_tactics, summary, sweep
    except ImportError as e:
        raise OracleError(f"`tune` needs pandas ({e}); pip install 'fimoe_lab[tune]'")
    p = get_preset(a.model)
    if p.moe_intermediate % a.tp:
        raise OracleError(f"{p.name}: moe_intermediate {p.moe_intermediate} is not divisible by --tp {a.tp}")
    oracle = TacticOracle(mode=a.source)
    df = sweep(p, a.format, a.tp, oracle, per_token=a.per_token, tokens=a.tokens or TOKENS,
               progress=sys.stderr.isatty())
    import pandas as pd
    cols = ["inter_align", "hidden_align", "intermediate", "hidden"] + [c for c in df.columns if c[:1] == "t" and c[1:].isdigit()] \
        + ["extra_bytes_pct", "reference", "recommended", "flag"]
    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.max_rows", 200):
        view = df[cols].copy()
        view["extra_bytes_pct"] = view["extra_bytes_pct"].round(2)
        view["reference"] = view["reference"].map({True: "REF", False: ""})
        view["recommended"] = view["recommended"].map({True: "<==", False: ""})
        print(view.to_string(index=False))
    print()
    print(summary(df))
    if a.csv:
        export(df, a.csv)
    if a.json_out:
        export(df, a.json_out)
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        ax = plot_heatmap(df)
        ax.figure.savefig(a.plot + "_heatmap.png", dpi=120, bbox_inches="tight")
        ax = plot_waste_vs_tactics(df)
        ax.figure.savefig(a.plot + "_waste.png", dpi=120, bbox_inches="tight")
    oracle.close()
    return 0
