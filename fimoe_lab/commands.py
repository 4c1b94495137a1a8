"""Core subcommands: ``plan`` (show a layer's layout steps), ``goldens`` (replay FlashInfer's outputs)."""

from __future__ import annotations

import argparse
import time

import torch

from fimoe_lab import goldens, prepare
from fimoe_lab.plan import LayerPlan


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="show the layout steps a format/backend applies to one MoE layer, and check they invert",
        description=(
            "Build the index maps for w13, w2 and their scales, apply them to random bytes on all experts, "
            "invert, and report each tensor's step chain, padding and round trip. --where ROW,COL traces one "
            "output element of w13 back through every step."
        ),
    )
    p.add_argument("--format", default="all", choices=("all",) + prepare.FORMATS, help="checkpoint format (default: all)")
    p.add_argument("--backend", default="all", choices=("all",) + prepare.BACKENDS, help="FlashInfer backend (default: both)")
    p.add_argument("--intermediate", type=int, default=256, help="per-partition intermediate size (default 256)")
    p.add_argument("--hidden", type=int, default=512, help="hidden size (default 512)")
    p.add_argument("--experts", type=int, default=4, help="experts to run on (default 4)")
    p.add_argument("--non-gated", action="store_true", help="non-gated activation (ReLU^2): W1 has I rows, no gate/up")
    p.add_argument("--where", metavar="I,J[,K]", help="trace this w13 output byte (coordinates in the output shape) to its source")
    p.set_defaults(handler=run_plan)

    g = sub.add_parser("goldens", help="replay the FlashInfer golden cases and compare byte for byte",
                       description="Replay reference outputs recorded from FlashInfer on a GPU (default: ../shared/goldens).")
    g.add_argument("paths", nargs="*", help="golden .pt files (default: $FIMOE_GOLDENS or shared/goldens beside the checkout)")
    g.set_defaults(handler=run_goldens)


def _random_inputs(plan: LayerPlan, experts: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        name: torch.randint(1, 256, (experts,) + m.in_shape, generator=g, dtype=torch.uint8)
        for name, m in plan.maps().items()
    }


def run_plan(args: argparse.Namespace) -> int:
    formats = prepare.FORMATS if args.format == "all" else (args.format,)
    backends = prepare.BACKENDS if args.backend == "all" else (args.backend,)
    gated = not args.non_gated
    header = f"{'format':<10} {'backend':<8} {'tensor':<10} {'in (bytes)':<14} {'out (bytes)':<18} {'pad %':>6} {'ms':>7}  round-trip  steps"
    print(f"layer: intermediate {args.intermediate}, hidden {args.hidden}, {args.experts} experts, "
          f"{'gated' if gated else 'non-gated'}\n")
    print(header)
    print("-" * len(header))
    failures = 0
    for fmt in formats:
        for backend in backends:
            try:
                plan = prepare.plan_layer(fmt, backend, args.intermediate, args.hidden, gated, gated)
            except ValueError as exc:
                print(f"{fmt:<10} {backend:<8} cannot run: {exc}")
                continue
            inputs = _random_inputs(plan, args.experts)
            for name, m in plan.maps().items():
                start = time.perf_counter()
                out = m.apply(inputs[name])
                ms = (time.perf_counter() - start) * 1e3
                ok = torch.equal(m.inverse().apply(out), inputs[name])
                failures += not ok
                pad = 100.0 * (1 - m.in_bytes / m.out_bytes)
                chain = " >> ".join(s.name.split("(")[0] for s in m.steps)
                print(f"{fmt:<10} {backend:<8} {name:<10} {str(m.in_shape):<14} {str(m.out_shape):<18} {pad:6.1f} "
                      f"{ms:7.2f}  {'ok' if ok else 'MISMATCH':<10}  {chain}")
            if args.where and plan.w13 is not None:
                where = tuple(int(v) for v in args.where.split(","))
                print(f"\n{fmt} {backend}: w13 output byte {where} comes from\n{plan.w13.provenance(where)}\n")
    print("\nall round trips exact" if not failures else f"\n{failures} round trips FAILED")
    return 1 if failures else 0


def run_goldens(args: argparse.Namespace) -> int:
    paths = args.paths or goldens.default_golden_paths()
    if not paths:
        raise FileNotFoundError("no golden files: pass paths or set FIMOE_GOLDENS")
    bad = 0
    total = 0
    for path in paths:
        for case in goldens.load_cases(path):
            result = goldens.run_case(case)
            total += 1
            bad += not result.ok
            print(f"{'ok ' if result.ok else 'BAD'} {result.name:<44} {result.detail}")
    print(f"\n{total - bad}/{total} golden cases reproduced")
    return 1 if bad else 0
