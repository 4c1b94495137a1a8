"""``fimoe-lab warmup``: compile ahead what a model's transforms need (plans, maps, kernels).

    fimoe-lab warmup --model deepseek-v3 --format fp8-block --device cuda
    fimoe-lab warmup --hidden 7168 --inter 2048 --experts 256 --format mxfp8 --json

The parser reads only the torch-free tables (:mod:`fimoe_lab.specs`, :mod:`fimoe_lab.presets`);
torch and the executors are imported by the handler (:func:`fimoe_lab.warmup.warmup`).
"""

from __future__ import annotations

import argparse
import time

from fimoe_lab import specs
from fimoe_lab.cli._common import (
    EXIT_OK,
    add_backend_option,
    add_format_option,
    add_json_option,
    add_size_options,
    add_tp_option,
    model_source,
    positive_int,
    print_json,
)
from fimoe_lab.presets import PRESETS

WARMUP_JSON = (
    '{"seconds": in all, "runs": [{"fmt", "backend", "tensor", "device", "executor", "in_place", "seconds"}] one per '
    "map run}"
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    w = sub.add_parser(
        "warmup",
        help="compile ahead the plans, maps and kernels a model's transforms need",
        description="Build the layer plans of a model (a preset or explicit sizes) for each format and backend, "
        "compile their index maps (for trtllm also the maps the engines' drop-ins build, e.g. rotate/w13), "
        "and run each map once, out of place and in place, through the executor a "
        "full layer picks on each device, on a few experts of random bytes. Kernels compile or load from the "
        "on-disk caches (numba: next to fimoe_lab/kernels or NUMBA_CACHE_DIR; Triton: TRITON_CACHE_DIR), so "
        "the first real transform of a later process, or of this one, does not wait for them.",
        epilog="presets: " + ", ".join(sorted(PRESETS)) + "\nformats: " + ", ".join(specs.weight_formats()),
    )
    w.add_argument(
        "--model",
        metavar="MODEL",
        help="the model: a preset, a shipped sample name, a checkpoint directory or a config.json (sizes, and the "
        "formats of a preset or checkpoint)",
    )
    add_format_option(w, "a weight format (repeatable; default: the preset's checkpoint formats)", repeat=True)
    add_backend_option(w, "a FlashInfer MoE backend (repeatable; default trtllm)", repeat=True)
    w.add_argument(
        "--device", dest="devices", action="append", help="a torch device, e.g. cpu or cuda (repeatable; default cpu)"
    )
    add_tp_option(w)
    add_size_options(w, "per-rank intermediate size (overrides the preset's)", "hidden size (overrides the preset's)")
    w.add_argument("--experts", type=positive_int("--experts"), help="experts per layer (overrides the preset's)")
    w.add_argument("--no-in-place", action="store_true", help="skip the in-place kernels")
    add_json_option(w, WARMUP_JSON)
    w.set_defaults(handler=run_warmup)


def _model_args(args: argparse.Namespace) -> dict:
    """``warmup``'s model arguments: a preset by name; a checkpoint (or sample) or config.json read for its sizes
    (per rank: intermediate / --tp), activation and, a checkpoint's, format; the size and format options override."""
    given = dict(formats=args.formats, hidden=args.hidden, intermediate=args.intermediate, experts=args.experts)
    if args.model is None:
        return given
    kind, where = model_source(args.model, PRESETS)
    if kind == "preset":
        return {**given, "model": where}
    from fimoe_lab.checkpoints.plan_choice import layout_format
    from fimoe_lab.specs import get_activation
    from fimoe_lab.tune.models import model_from_checkpoint, model_from_config

    m = model_from_checkpoint(where) if kind == "checkpoint" else model_from_config(where)
    return dict(
        formats=args.formats or [layout_format(f) for f in m.checkpoint_formats],
        hidden=args.hidden or m.hidden,
        intermediate=args.intermediate or m.moe_intermediate // args.tp,
        experts=args.experts or m.experts,
        gated=get_activation(m.activation).gated,
    )


def run_warmup(args: argparse.Namespace) -> int:
    from fimoe_lab.warmup import warmup

    t = time.perf_counter()
    done = warmup(
        **_model_args(args),
        backends=tuple(args.backends or ("trtllm",)),
        devices=tuple(args.devices or ("cpu",)),
        tp=args.tp,
        in_place=not args.no_in_place,
    )
    total = time.perf_counter() - t
    if args.json:
        print_json({"seconds": round(total, 3), "runs": [vars(r) | {"seconds": round(r.seconds, 4)} for r in done]})
        return EXIT_OK
    for r in done:
        mode = "in place" if r.in_place else "out of place"
        print(f"{r.fmt}/{r.backend}/{r.tensor} on {r.device}: {r.executor}, {mode}, {r.seconds:.3f} s")
    print(f"warmed {len(done)} runs in {total:.2f} s")
    return EXIT_OK
