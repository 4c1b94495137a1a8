"""``fimoe-lab demo | plan | goldens``: the main job on the shipped samples, one layer's layout
steps, and the replay of FlashInfer's recorded outputs.

Parsers read only the torch-free tables (:mod:`fimoe_lab.specs`); torch and the plans are
imported inside the handlers. Each handler builds one record per row; ``--json`` prints them
as one JSON object on stdout (the fields are in each command's ``--help``), else the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from fimoe_lab import specs
from fimoe_lab.choice import LayoutChoice
from fimoe_lab.cli._common import (
    EXIT_FAILED,
    EXIT_OK,
    add_backend_option,
    add_engine_option,
    add_format_option,
    add_json_option,
    add_per_token_option,
    add_progress_option,
    add_size_options,
    add_tp_option,
    checkpoint_path,
    int_list,
    layout_choice,
    positive_int,
    print_json,
    progress_bar,
)
from fimoe_lab.errors import CheckpointError, FimoeError, LayoutError


def register(sub: argparse._SubParsersAction) -> None:
    _register_demo(sub)
    _register_plan(sub)
    g = sub.add_parser(
        "goldens",
        help="replay the FlashInfer golden cases and compare byte for byte",
        description="Replay reference outputs recorded from FlashInfer on a GPU (default: the sets shipped with fimoe_lab, "
        "and shared/goldens beside a source checkout). "
        "Exits 1 when a case differs, 2 when there is nothing to replay.",
    )
    g.add_argument(
        "paths",
        nargs="*",
        help="golden sets, NAME.json beside NAME.safetensors (default: $FIMOE_GOLDENS, else the shipped sets and shared/goldens beside a source checkout)",
    )
    add_progress_option(g)
    add_json_option(g, GOLDENS_JSON)
    g.set_defaults(handler=run_goldens)


GOLDENS_JSON = (
    '{"cases": [{"file": golden set, "name", "ok": reproduced byte for byte, "detail"}], "reproduced": int, '
    '"total": int}'
)
PLAN_JSON = (
    '{"layer": {"intermediate", "tp", "hidden", "experts", "gated", "per_token", "mxfp4_activation"}, "engine": the '
    "engine profile, "
    '"plans": [{"format", "backend", "intermediate": rank 0\'s (null: the split fails), "cannot": null or why this pair '
    'cannot lay out the sizes, "tensors": '
    '[{"name", "in_shape", "out_shape" (bytes per expert), "pad_percent", "ms", "round_trip": exact, "steps": '
    '[step kinds]}], "engine_scales": null (not checked), true or false, "engine_weights": the same for the '
    'weights (the SM90 MXFP4 x BF16 layout), "where": null or [{"step", "shape", '
    '"coords" (bytes; null: fill), "fill"}] from the output back to the input}], "failures": round trips that '
    "differ}"
)
DEMO_JSON = (
    '{"tp", "out": folder, "health": [{"checkpoint", "layer", "warning"}], "layers": [{"checkpoint", "layer", '
    '"format", "backend", "mxfp4_activation": null or the layout\'s activation dtype, "intermediate" (per rank), '
    '"padded_intermediate", "bytes" (file size), "ms", "exact": '
    'bytes and reference forward, "engine_scales": null (not checked), true or false, "engine_weights": the '
    'same for the weights (the SM90 MXFP4 x BF16 layout), "cannot": null or why it '
    'cannot convert}], "failures": round trips that differ}'
)


def add_mxfp4_activation_option(p: argparse.ArgumentParser, what: str) -> None:
    """``--mxfp4-activation DTYPE``: the activations the MXFP4 CUTLASS kernel takes, which choose its weight
    layout (``recipes.ACTIVATION_DTYPES``, checked where the plan is built: no torch at parse time)."""
    p.add_argument(
        "--mxfp4-activation",
        metavar="DTYPE",
        help=f"{what}: the activations the MXFP4 CUTLASS kernel takes, which fix its layout: bf16 = the Hopper "
        "(SM90) mixed-input GEMM (vLLM FLASHINFER_CUTLASS_MXFP4_BF16, SGLang cutlass_sm90: weights interleaved "
        "and their bits permuted, scales folded); default mxfp8 = the MXFP4 x MXFP8 layout. MXFP4 on CUTLASS only",
    )


def _shower(args: argparse.Namespace, text: Callable[[dict[str, Any]], str]) -> Callable[[dict[str, Any]], None]:
    """``show(record)``: print the record's table row, or nothing with ``--json`` (the JSON comes at the end)."""
    return (lambda rec: None) if args.json else (lambda rec: print(text(rec)))


def _register_demo(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser(
        "demo",
        help="the main job on the shipped samples: read, inspect, convert for both backends, restore, verify",
        description=(
            "For every sample checkpoint shipped with fimoe_lab (or the paths given): read each MoE layer, report its "
            "format and scale health, convert it to the TRT-LLM and CUTLASS kernel layouts at the chosen "
            "tensor-parallel size, write the kernel-layout safetensors under --out, restore them, and check the "
            "bytes and a reference MoE forward against the original."
        ),
    )
    d.add_argument("paths", nargs="*", help="checkpoint directories or sample names (default: every shipped sample)")
    add_tp_option(d, "the size to shard to, rank 0 written", default=2)
    d.add_argument(
        "--out", default="fimoe-demo-out", help="where the kernel-layout files go (default ./fimoe-demo-out)"
    )
    add_mxfp4_activation_option(d, "the CUTLASS layout of MXFP4 layers")
    add_json_option(d, DEMO_JSON)
    d.set_defaults(handler=run_demo)


def _register_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="show the layout steps a format/backend applies to one MoE layer, and check they invert",
        description=(
            "Build the index maps for w13, w2 and their scales, apply them to random bytes on all experts, "
            "invert, and report each tensor's step chain, padding and round trip. --where ROW,COL traces one "
            "output element of w13 back through every step. Exits 1 when a round trip differs, 2 when a "
            "format/backend cannot lay out these sizes."
        ),
    )
    add_format_option(p, "checkpoint format (default: all)", every=True, default="all")
    add_backend_option(p, "FlashInfer backend (default: both)", every=True, default="all")
    add_size_options(
        p,
        "intermediate size (default 256): at TP 1, split with --tp as convert splits it",
        "hidden size (default 512)",
        defaults=(256, 512),
    )
    add_tp_option(p, "plan rank 0's slice of --intermediate (equal shards, whole scale blocks)")
    p.add_argument(
        "--experts", type=positive_int("--experts"), default=4, metavar="E", help="experts in the layer (default 4)"
    )
    p.add_argument("--non-gated", action="store_true", help="non-gated activation (ReLU^2): W1 has I rows, no gate/up")
    add_per_token_option(
        p, "the engine profile's per-token paddings (vLLM: hidden 512 for a non-gated layer on TRT-LLM)"
    )
    p.add_argument(
        "--where",
        metavar="I,J[,K]",
        type=int_list("--where", "5,3", minimum=0),
        help="trace this w13 output byte (coordinates in the output shape) to its source",
    )
    add_mxfp4_activation_option(p, "the MXFP4 CUTLASS plan")
    add_engine_option(p)
    add_json_option(p, PLAN_JSON)
    p.set_defaults(handler=run_plan)


# ----------------------------------------------------------------------------- plan
_PLAN_HEADER = (
    f"{'format':<10} {'backend':<8} {'tensor':<10} {'in (bytes)':<14} {'out (bytes)':<18} {'pad %':>6} "
    f"{'ms':>7}  round-trip  steps"
)


def _plan_rows(plan, experts: int) -> list[dict[str, Any]]:
    """Apply each tensor's steps of ``plan`` (byte map, then any word bit step) to random bytes (1..255) on
    ``experts`` experts and invert them: one record per tensor (shapes in bytes, padding %, ms, whether the
    round trip is exact, steps)."""
    import torch

    g = torch.Generator().manual_seed(0)
    rows, inverse = [], plan.inverse()
    for name, m in plan.maps().items():
        x = torch.randint(1, 256, (experts,) + m.in_shape, generator=g, dtype=torch.uint8)
        start = time.perf_counter()
        out = plan.apply_tensor(name, x)
        ms = (time.perf_counter() - start) * 1e3
        rows.append(
            dict(
                name=name,
                in_shape=list(m.in_shape),
                out_shape=list(m.out_shape),
                pad_percent=round(100.0 * (1 - m.in_bytes / m.out_bytes), 3),
                ms=round(ms, 3),
                round_trip=torch.equal(inverse.apply_tensor(name, out).reshape(x.shape), x),
                steps=[s["kind"] for s in plan.tensor_steps(name)],
            )
        )
    return rows


def _plan_text(fmt: str, backend: str, t: dict[str, Any]) -> str:
    return (
        f"{fmt:<10} {backend:<8} {t['name']:<10} {str(tuple(t['in_shape'])):<14} {str(tuple(t['out_shape'])):<18} "
        f"{t['pad_percent']:6.1f} {t['ms']:7.2f}  {'ok' if t['round_trip'] else 'MISMATCH':<10}  "
        + " >> ".join(t["steps"])
    )


def _plan_engine_check(
    fmt: str, plan, gated: bool, experts: int, choice: LayoutChoice
) -> tuple[bool | None, bool | None]:
    """``(scales, weights)``: the plan's CUTLASS layout under ``choice`` against the engines' written independently
    (:mod:`fimoe_lab.engine_check`): block scales (128x4 or linear), or, for the SM90 MXFP4 x BF16 layout
    (``choice.activation_dtype`` selects it), scales and weights (bytes and word bits); None where a check does
    not apply."""
    from fimoe_lab.engine_check import CUTLASS_CHECKED, SM90_CHECKED, check_plan_scales, check_plan_sm90_mixed
    from fimoe_lab.recipes import activation_layout

    backend, engine, act = choice.backend, choice.engine, choice.activation_dtype
    if backend != "cutlass":
        return None, None
    if activation_layout(fmt, backend, act) is not None:
        if fmt not in SM90_CHECKED:
            return None, None
        got = check_plan_sm90_mixed(plan, gated, experts, engine)
        return got["scales"], got["weights"]
    if fmt not in CUTLASS_CHECKED or plan.word_bits:
        return None, None
    return bool(check_plan_scales(fmt, plan, gated, experts, engine)), None


def _activation_for(pairs: list[tuple[str, str]], dtype: str | None) -> dict[tuple[str, str], str | None]:
    """``dtype`` (``--mxfp4-activation``) for each (format, backend) whose recipe has a layout per activation
    dtype, None for the others; refused when none of ``pairs`` has one (one line and the fix)."""
    from fimoe_lab.recipes import ACTIVATION_DTYPES, activation_layout, recipe_id

    takes = {pair: recipe_id(*pair) in ACTIVATION_DTYPES for pair in pairs}
    if dtype is not None and not any(takes.values()):
        raise LayoutError(
            f"--mxfp4-activation {dtype} does not apply to {', '.join(f'{f} {b}' for f, b in pairs)}: only "
            f"{', '.join(ACTIVATION_DTYPES)} has a kernel layout per activation dtype",
            fix="drop --mxfp4-activation, or ask for --format mxfp4 --backend cutlass",
        )
    for pair in (p for p, took in takes.items() if took):
        activation_layout(*pair, dtype)  # a dtype the recipe has no layout for: refused before any plan
    return {pair: dtype if took else None for pair, took in takes.items()}


def run_plan(args: argparse.Namespace) -> int:
    from fimoe_lab.choice import LayerShape
    from fimoe_lab.engines import get_engine
    from fimoe_lab.recipes import plan_for
    from fimoe_lab.shapes import rank_intermediates

    formats = specs.weight_formats() if args.format == "all" else (args.format,)
    backends = specs.BACKENDS if args.backend == "all" else (args.backend,)
    acts = _activation_for([(fmt, backend) for fmt in formats for backend in backends], args.mxfp4_activation)
    choices = {backend: layout_choice(args, backend) for backend in backends}
    gated = not args.non_gated
    say = _shower(args, str)
    say(
        f"layer: intermediate {args.intermediate}{f' at TP {args.tp} (rank 0)' if args.tp > 1 else ''}, "
        f"hidden {args.hidden}, {args.experts} experts, "
        f"{'gated' if gated else 'non-gated'}{', per-token NVFP4 activations' if args.per_token else ''}\n"
    )
    say(_PLAN_HEADER)
    say("-" * len(_PLAN_HEADER))
    failures, cannot, plans = 0, [], []
    pairs = [(fmt, backend) for fmt in formats for backend in backends]
    for fmt, backend in pairs:
        rec: dict[str, Any] = dict(
            format=fmt,
            backend=backend,
            intermediate=None,
            cannot=None,
            tensors=[],
            engine_scales=None,
            engine_weights=None,
            where=None,
        )
        plans.append(rec)
        choice = dataclasses.replace(choices[backend], activation_dtype=acts[fmt, backend])
        try:
            rec["intermediate"] = rank_intermediates(args.intermediate, args.tp, fmt)[0]
            plan = plan_for(LayerShape(fmt, rec["intermediate"], args.hidden, gated, gated), choice)
        except FimoeError as exc:
            rec["cannot"] = str(exc)
            say(f"{fmt:<10} {backend:<8} cannot run: {exc}")
            cannot.append(f"{fmt} {backend}")
            continue
        rec["tensors"] = _plan_rows(plan, args.experts)
        for t in rec["tensors"]:
            say(_plan_text(fmt, backend, t))
        failures += sum(not t["round_trip"] for t in rec["tensors"])
        checked = _plan_engine_check(fmt, plan, gated, args.experts, choice)
        rec["engine_scales"], rec["engine_weights"] = checked
        for what, ok in zip(("scales", "weights"), checked):
            if ok is not None:
                failures += not ok
                say(
                    f"{fmt:<10} {backend:<8} {what:<10} vs the engine layout ({get_engine(choice.engine).name}, "
                    f"independent formula): {'exact' if ok else 'MISMATCH'}"
                )
        if args.where and plan.w13 is not None:
            try:
                trace = plan.w13.provenance(args.where)
            except FimoeError as exc:
                raise exc.within(f"plan --where on {fmt} {backend} w13") from None
            rec["where"] = [dataclasses.asdict(stage) for stage in trace.stages]
            say(f"\n{fmt} {backend}: w13 output byte {args.where} comes from\n{trace}\n")
    if args.json:
        layer = dict(
            intermediate=args.intermediate,
            tp=args.tp,
            hidden=args.hidden,
            experts=args.experts,
            gated=gated,
            per_token=args.per_token,
            mxfp4_activation=args.mxfp4_activation,
        )
        print_json(dict(layer=layer, engine=get_engine(args.engine).name, plans=plans, failures=failures))
    if failures:
        say(f"\n{failures} round trips FAILED")
        return EXIT_FAILED
    if len(cannot) < len(pairs):
        say("\nall round trips exact")
    if cannot:
        raise LayoutError(
            f"{', '.join(cannot)} cannot lay out intermediate {args.intermediate}, hidden {args.hidden}",
            fix="the 'cannot run' rows above name the constraint; change the sizes or the format"
            if not args.json
            else "the plans' 'cannot' fields name the constraint; change the sizes or the format",
        )
    return EXIT_OK


# ----------------------------------------------------------------------------- goldens
def run_goldens(args: argparse.Namespace) -> int:
    from fimoe_lab import goldens

    paths = args.paths or goldens.default_golden_paths()
    if not paths:
        raise FileNotFoundError("no golden files: pass paths or set FIMOE_GOLDENS")
    show = _shower(args, lambda r: f"{'ok ' if r['ok'] else 'BAD'} {r['name']:<44} {r['detail']}")
    todo = [(path, case) for path in paths for case in goldens.load_cases(path)]  # every file checked first
    cases = []
    bar = progress_bar(args.no_progress, len(todo), "goldens", "cases") if todo else None
    try:
        for path, case in todo:
            result = goldens.run_case(case)
            cases.append(dict(file=str(path), name=result.name, ok=bool(result.ok), detail=result.detail))
            show(cases[-1])
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    if not cases:
        raise FimoeError(
            f"no golden cases in {', '.join(map(str, paths))}: nothing was replayed",
            fix="pass golden files that hold cases, or set FIMOE_GOLDENS",
        )
    good = sum(c["ok"] for c in cases)
    if args.json:
        print_json(dict(cases=cases, reproduced=good, total=len(cases)))
    else:
        print(f"\n{good}/{len(cases)} golden cases reproduced")
    return EXIT_OK if good == len(cases) else EXIT_FAILED


# ----------------------------------------------------------------------------- demo
_DEMO_HEADER = (
    f"{'checkpoint':<20} {'layer':>5} {'format':<10} {'backend':<8} {'I/tp':>5} {'padded I':>8} {'bytes':>8} "
    f"{'ms':>7}  check"
)


def _health(path, ck) -> list[dict[str, Any]]:
    """The scale-health warnings of every MoE layer of the checkpoint at ``path`` (not "ok" / "unquantized")."""
    return [
        dict(checkpoint=path.name, layer=report.layer, warning=warning)
        for report in ck.inspect_checkpoint(path)
        for warning in report.health
        if not warning.startswith(("ok", "unquantized"))
    ]


def _demo_text(r: dict[str, Any]) -> str:
    head = f"{r['checkpoint']:<20} {r['layer']:>5} {r['format']:<10} {r['backend']:<8}"
    if r["cannot"] is not None:
        return f"{head} cannot convert: {r['cannot']}"
    check = "bytes + forward exact" if r["exact"] else "MISMATCH"
    if r.get("mxfp4_activation"):
        check += f" ({r['mxfp4_activation']}-activation layout)"
    if r["engine_scales"] is not None:
        check += ", scales = engine layout" if r["engine_scales"] else ", scales differ from the engine layout"
    if r.get("engine_weights") is not None:
        check += ", weights = engine layout" if r["engine_weights"] else ", weights differ from the engine layout"
    return f"{head} {r['intermediate']:>5} {r['padded_intermediate']:>8} {r['bytes']:>8} {r['ms']:7.1f}  {check}"


def _demo_layer(
    ck, path, layer_idx: int, layer, top_k: int, tp: int, out_dir, choice: LayoutChoice
) -> list[dict[str, Any]]:
    """Convert one layer for every backend (``choice``, its backend replaced by each), restore it, compare bytes
    and the reference forward.

    One record per backend (:data:`DEMO_JSON`'s ``layers``); ``cannot`` says why a backend cannot convert it.
    ``choice.activation_dtype``: ``--mxfp4-activation``, for the backends whose recipe of the layer's format lays
    out by it.
    """
    import torch

    from fimoe_lab.checkpoints.plan_choice import layout_format
    from fimoe_lab.recipes import ACTIVATION_DTYPES, activation_layout, recipe_id

    x = torch.randn(16, layer.hidden, generator=torch.Generator().manual_seed(layer_idx))
    ids, weights = ck.random_routing(16, layer.num_experts, min(top_k, layer.num_experts), seed=layer_idx)
    reference = ck.layer_forward(layer, x, ids, weights)
    records = []
    for backend in specs.BACKENDS:
        target = out_dir / f"{path.name}-L{layer_idx}-{backend}-tp{tp}.safetensors"
        fmt = layout_format(layer.fmt)
        a = choice.activation_dtype if recipe_id(fmt, backend) in ACTIVATION_DTYPES else None
        rec: dict[str, Any] = dict(
            checkpoint=path.name, layer=layer_idx, format=layer.fmt, backend=backend, mxfp4_activation=a
        )
        records.append(rec)
        start = time.perf_counter()
        try:  # its own files only
            asked = dataclasses.replace(choice, backend=backend, activation_dtype=a)
            ck.convert_checkpoint(path, target, tp_size=tp, tp_rank=0, layers=[layer_idx], force=True, choice=asked)
        except FimoeError as exc:
            rec.update(
                intermediate=layer.intermediate,
                padded_intermediate=None,
                bytes=None,
                ms=None,
                exact=None,
                engine_scales=None,
                engine_weights=None,
                cannot=str(exc),
            )
            continue
        ms = (time.perf_counter() - start) * 1e3
        meta, (restored,) = ck.restore_layers(target)
        same = all(
            (a is None and b is None) or torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            for a, b in zip(layer.tensors().values(), restored.tensors().values(), strict=True)
        )
        rec.update(
            intermediate=layer.intermediate,
            padded_intermediate=meta["layers"][str(layer_idx)]["padded_intermediate"],
            bytes=target.stat().st_size,
            ms=round(ms, 3),
            exact=bool(same and torch.equal(ck.layer_forward(restored, x, ids, weights), reference)),
            engine_scales=(
                _demo_engine_scales(target, meta, layer_idx, layer)
                if backend == "cutlass" and activation_layout(fmt, backend, a) is None  # not the SM90 layout
                else None
            ),
            engine_weights=None,
            cannot=None,
        )
        if backend == "cutlass" and activation_layout(fmt, backend, a) is not None:  # the SM90 MXFP4 x BF16 layout
            rec["engine_scales"], rec["engine_weights"] = _demo_engine_sm90(target, meta, layer_idx, layer)
    return records


def _demo_engine_sm90(target, meta: dict, layer_idx: int, layer) -> tuple[bool | None, bool | None]:
    """``(scales, weights)``: the written SM90 MXFP4 x BF16 tensors against the engines' layout computed
    independently from the checkpoint's bytes (:func:`fimoe_lab.engine_check.sm90_engine_layer`)."""
    import torch

    from fimoe_lab.checkpoints.fileformat import KernelFiles, out_name
    from fimoe_lab.engine_check import SM90_CHECKED, sm90_engine_layer
    from fimoe_lab.engines import get_engine

    rec = meta["layers"][str(layer_idx)]
    given = {n: t for n, t in layer.tensors().items() if t is not None}
    if layer.fmt not in SM90_CHECKED or len(given) != 4:
        return None, None
    layout = get_engine(rec["plan"]["args"].get("engine")).sm90_mixed_layout
    want = sm90_engine_layer(given, layer.is_act_and_mul, rec["padded_intermediate"], rec["padded_hidden"], layout)
    same = {}
    with KernelFiles(target) as kf:
        for name, expected in want.items():
            key = out_name(meta["prefix"], meta["block"], layer_idx, rec["tensors"][name]["name"])
            got = kf.get_slice(key)[:].contiguous()
            same[name] = torch.equal(got.view(torch.uint8).reshape(-1), expected.reshape(-1))
    return same["w13_scale"] and same["w2_scale"], same["w13"] and same["w2"]


def _demo_engine_scales(target, meta: dict, layer_idx: int, layer):
    """The written CUTLASS block scales against the engines' layout computed independently from the
    checkpoint's scales (:func:`fimoe_lab.engine_check.engine_scales`); None where there are none."""
    import torch

    from fimoe_lab.checkpoints.fileformat import KernelFiles, out_name
    from fimoe_lab.engine_check import CUTLASS_CHECKED, engine_scales

    rec = meta["layers"][str(layer_idx)]
    if layer.fmt not in CUTLASS_CHECKED or layer.w13_scale is None or layer.w2_scale is None:
        return None
    want = engine_scales(
        layer.fmt,
        layer.w13_scale,
        layer.w2_scale,
        layer.is_act_and_mul,
        rec["padded_intermediate"],
        rec["padded_hidden"],
        rec["plan"]["args"].get("engine"),
    )
    with KernelFiles(target) as kf:
        for name, expected in zip(("w13_scale", "w2_scale"), want):
            key = out_name(meta["prefix"], meta["block"], layer_idx, rec["tensors"][name]["name"])
            got = kf.get_slice(key)[:].contiguous()
            if not torch.equal(got.view(torch.uint8).reshape(-1), expected.reshape(-1)):
                return False
    return True


def _check_demo_activation(dtype: str | None) -> None:
    """Refuse a ``--mxfp4-activation`` that no recipe lays out by (one line and the fix), before any work."""
    from fimoe_lab.recipes import ACTIVATION_DTYPES

    offered = sorted({d for choices in ACTIVATION_DTYPES.values() for d in choices})
    if dtype is not None and dtype not in offered:
        layouts = ", ".join(f"{r}: {' or '.join(c)}" for r, c in ACTIVATION_DTYPES.items())
        raise LayoutError(
            f"--mxfp4-activation {dtype}: no recipe has a layout for {dtype} activations ({layouts})",
            fix=f"pass one of {', '.join(offered)}",
        )


def run_demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fimoe_lab import checkpoints as ck

    names = args.paths or ck.sample_names()
    if not names:
        raise FileNotFoundError(
            "no sample checkpoints found (run python scripts/make_sample_checkpoints.py) and no paths given"
        )
    paths = [checkpoint_path(name) for name in names]
    _check_demo_activation(args.mxfp4_activation)
    choice = layout_choice(args, specs.BACKENDS[0])  # each backend in turn (_demo_layer)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    say = _shower(args, str)
    say(_DEMO_HEADER)
    say("-" * len(_DEMO_HEADER))
    health, layers = [], []
    for path in paths:
        found = _health(path, ck)
        health += found
        for h in found:
            say(f"{h['checkpoint']:<20} {h['layer']:>5} scale health: {h['warning']}")
        with ck.open_checkpoint(path) as ckpt:
            for layer_idx in ckpt.moe_layers:
                layer = ckpt.read_layer(layer_idx, args.tp, 0)
                for rec in _demo_layer(ck, path, layer_idx, layer, ckpt.top_k, args.tp, out_dir, choice):
                    layers.append(rec)
                    say(_demo_text(rec))
    failures = sum(
        r["cannot"] is None and (not r["exact"] or r["engine_scales"] is False or r.get("engine_weights") is False)
        for r in layers
    )
    cannot = [f"{r['checkpoint']} L{r['layer']} {r['backend']}" for r in layers if r["cannot"] is not None]
    if args.json:
        print_json(dict(tp=args.tp, out=str(out_dir), health=health, layers=layers, failures=failures))
    say(
        f"\nkernel-layout files in {out_dir}/ ; "
        + ("every round trip exact" if not failures else f"{failures} round trips FAILED")
    )
    if failures:
        return EXIT_FAILED
    if cannot:
        raise CheckpointError(
            f"{', '.join(cannot)} cannot be converted at tp {args.tp}",
            fix="the 'cannot convert' rows above name the constraint; try another --tp",
        )
    return EXIT_OK
