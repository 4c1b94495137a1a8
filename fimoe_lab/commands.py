"""Core subcommands: ``demo`` (the main job on the shipped samples), ``plan`` (a layer's layout steps),
``goldens`` (replay FlashInfer's recorded outputs)."""

from __future__ import annotations

import argparse
import time

import torch

from fimoe_lab import goldens, prepare
from fimoe_lab.plan import LayerPlan


def register(sub: argparse._SubParsersAction) -> None:
    register_demo(sub)
    p = sub.add_parser(
        "plan",
        help="show the layout steps a format/backend applies to one MoE layer, and check they invert",
        description=(
            "Build the index maps for w13, w2 and their scales, apply them to random bytes on all experts, "
            "invert, and report each tensor's step chain, padding and round trip. --where ROW,COL traces one "
            "output element of w13 back through every step."
        ),
    )
    p.add_argument("--format", default="all", choices=("all",) + prepare.weight_formats(), help="checkpoint format (default: all)")
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
    formats = prepare.weight_formats() if args.format == "all" else (args.format,)
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
                chain = " >> ".join(s.kind for s in m.steps)
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


def register_demo(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser(
        "demo",
        help="the main job on the shipped samples: read, inspect, convert for both backends, restore, verify",
        description=(
            "For every sample checkpoint in data/checkpoints (or the paths given): read each MoE layer, report its "
            "format and scale health, convert it to the TRT-LLM and CUTLASS kernel layouts at the chosen "
            "tensor-parallel size, write the kernel-layout safetensors under --out, restore them, and check the "
            "bytes and a reference MoE forward against the original."
        ),
    )
    d.add_argument("paths", nargs="*", help="checkpoint directories or sample names (default: every shipped sample)")
    d.add_argument("--tp", type=int, default=2, help="tensor-parallel size to shard to (rank 0; default 2)")
    d.add_argument("--out", default="fimoe-demo-out", help="where the kernel-layout files go (default ./fimoe-demo-out)")
    d.set_defaults(handler=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fimoe_lab import checkpoints as ck

    names = args.paths or ck.sample_names()
    if not names:
        raise FileNotFoundError("no sample checkpoints found (run python scripts/make_sample_checkpoints.py) and no paths given")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    header = f"{'checkpoint':<20} {'layer':>5} {'format':<10} {'backend':<8} {'I/tp':>5} {'padded I':>8} {'bytes':>8} {'ms':>7}  check"
    print(header)
    print("-" * len(header))
    failures = 0
    for name in names:
        path = Path(name) if Path(name).is_dir() else ck.sample_path(name)
        for report in ck.inspect_checkpoint(path):
            for warning in report.health:
                if not warning.startswith(("ok", "unquantized")):
                    print(f"{path.name:<20} {report.layer:>5} scale health: {warning}")
        with ck.open_checkpoint(path) as ckpt:
            top_k = ckpt.top_k
            for layer_idx in ckpt.moe_layers:
                layer = ckpt.read_layer(layer_idx, args.tp, 0)
                x = torch.randn(16, layer.hidden, generator=torch.Generator().manual_seed(layer_idx))
                ids, weights = ck.random_routing(16, layer.num_experts, min(top_k, layer.num_experts), seed=layer_idx)
                reference = ck.layer_forward(layer, x, ids, weights)
                for backend in prepare.BACKENDS:
                    target = out_dir / f"{path.name}-L{layer_idx}-{backend}-tp{args.tp}.safetensors"
                    start = time.perf_counter()
                    try:
                        ck.convert_checkpoint(path, target, backend, args.tp, 0, layers=[layer_idx])
                    except ValueError as exc:
                        print(f"{path.name:<20} {layer_idx:>5} {layer.fmt:<10} {backend:<8} cannot convert: {exc}")
                        continue
                    ms = (time.perf_counter() - start) * 1e3
                    meta, (restored,) = ck.restore_layers(target)
                    same = all(
                        (a is None and b is None) or torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                        for a, b in zip(layer.tensors().values(), restored.tensors().values())
                    )
                    forward_same = torch.equal(ck.layer_forward(restored, x, ids, weights), reference)
                    padded = meta["layers"][str(layer_idx)]["plan"]
                    plan = prepare.plan_layer(**padded["args"])
                    ok = same and forward_same
                    failures += not ok
                    print(f"{path.name:<20} {layer_idx:>5} {layer.fmt:<10} {backend:<8} {layer.intermediate:>5} "
                          f"{plan.padded_intermediate:>8} {target.stat().st_size:>8} {ms:7.1f}  "
                          f"{'bytes + forward exact' if ok else 'MISMATCH'}")
    print(f"\nkernel-layout files in {out_dir}/ ; "
          + ("every round trip exact" if not failures else f"{failures} round trips FAILED"))
    return 1 if failures else 0
