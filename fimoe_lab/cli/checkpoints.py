"""``fimoe-lab inspect | convert | restore``: real checkpoints in and out of FlashInfer's kernel layout.

Parsers read only the torch-free tables; :mod:`fimoe_lab.checkpoints` (torch, safetensors)
is imported inside the handlers.
"""

from __future__ import annotations

import argparse

from fimoe_lab import specs
from fimoe_lab.cli._common import EXIT_OK, add_engine_option, checkpoint_path, int_list, positive_int, show_progress
from fimoe_lab.resources import sample_names


def _samples_note() -> str:
    names = sample_names()
    return (
        "PATH is a checkpoint directory (config.json + *.safetensors, index optional) or the name of a shipped "
        f"sample: {', '.join(names) or 'none in this build'}."
    )


def register(sub: argparse._SubParsersAction) -> None:
    note = _samples_note()
    _register_inspect(sub, note)
    _register_convert(sub, note)
    r = sub.add_parser(
        "restore",
        help="map a converted kernel-layout file back to a checkpoint in its original naming convention",
        description=(
            "Rebuild each layer's plan from the recorded arguments, check its steps against the recorded ones and each "
            "tensor against the SHA-256 convert recorded (a corrupt or edited file is refused), apply the "
            "inverse (padding dropped) and write OUT_DIR: config.json, index and one shard with the expert tensors in the "
            "source's naming convention, byte-identical to the source (for a TP shard: the rank's slice)."
        ),
        epilog="example: fimoe-lab restore /tmp/r1.kernel.safetensors /tmp/r1-restored",
    )
    r.add_argument("kernel_file", metavar="KERNEL_FILE", help="file written by 'fimoe-lab convert'")
    r.add_argument("out_dir", metavar="OUT_DIR", help="output checkpoint directory")
    r.add_argument(
        "--force",
        action="store_true",
        help="replace OUT_DIR if it exists and was written by restore (never any other directory)",
    )
    r.set_defaults(handler=run_restore)


def _register_inspect(sub: argparse._SubParsersAction, note: str) -> None:
    p = sub.add_parser(
        "inspect",
        help="summarize a checkpoint's MoE layers: format, shapes, padding per backend and TP, scale health",
        description=(
            "For each MoE layer: naming convention and format (detected from tensor names and dtypes), stacked shapes, "
            "gate/up order, what the TRT-LLM and CUTLASS backends need (padding, or why it fails and the alignment that "
            "fixes it) at each TP size, and scale health (NaN/Inf, all-zero experts, dead ~1e-23 block scales). Reads "
            "headers and scales only.\n\n" + note
        ),
        epilog="example: fimoe-lab inspect deepseek-v3-fp8 --tp 1,2,4,8",
    )
    p.add_argument("path", metavar="PATH", help="checkpoint directory or sample name")
    p.add_argument(
        "--layer", type=int, action="append", metavar="N", help="only layer N (repeatable; default: all MoE layers)"
    )
    p.add_argument(
        "--tp",
        type=int_list("--tp", "1,2,4,8"),
        default=(1, 2, 4, 8),
        metavar="T,T,..",
        help="TP sizes to check (default 1,2,4,8)",
    )
    add_engine_option(p)
    p.set_defaults(handler=run_inspect)


def _register_convert(sub: argparse._SubParsersAction, note: str) -> None:
    c = sub.add_parser(
        "convert",
        help="write a checkpoint's MoE layers in FlashInfer's kernel layout (one safetensors file)",
        description=(
            "Read each MoE layer (rank --rank of --tp, sliced along the intermediate dim as serving engines shard), apply "
            "the layout plan of its format for --backend, and write w13_weight, w2_weight, w13_weight_scale, "
            "w2_weight_scale per layer, plus extras unchanged. The metadata records the plan arguments and every step, so "
            "'fimoe-lab restore' can map the file back. Written to a temporary name and renamed when complete: a failed "
            "or interrupted run leaves nothing at OUT.\n\n" + note
        ),
        epilog="example: fimoe-lab convert deepseek-r1-nvfp4 /tmp/r1.kernel.safetensors --backend trtllm --tp 2 "
        "--intermediate-alignment 64",
    )
    c.add_argument("path", metavar="PATH", help="checkpoint directory or sample name")
    c.add_argument("out", metavar="OUT", help="output .safetensors file")
    c.add_argument("--backend", required=True, choices=specs.BACKENDS, help="FlashInfer MoE backend")
    c.add_argument("--tp", type=positive_int("--tp"), default=1, metavar="N", help="tensor-parallel size (default 1)")
    c.add_argument("--rank", type=int, default=0, metavar="R", help="tensor-parallel rank to write (default 0)")
    c.add_argument("--layer", type=int, action="append", metavar="N", help="only layer N (repeatable; default: all)")
    c.add_argument(
        "--intermediate-alignment",
        type=positive_int("--intermediate-alignment"),
        metavar="A",
        help="pad the intermediate size to a multiple of A "
        "(default: the backend's rule; 'inspect' says when the default fails)",
    )
    c.add_argument(
        "--hidden-alignment",
        type=positive_int("--hidden-alignment"),
        metavar="A",
        help="pad the hidden size to a multiple of A",
    )
    c.add_argument(
        "--no-progress", action="store_true", help="no progress bar (there is none when stderr is not a terminal)"
    )
    c.add_argument(
        "--force",
        action="store_true",
        help="replace OUT if it exists and was written by convert (never any other file)",
    )
    add_engine_option(c)
    c.set_defaults(handler=run_convert)


def run_inspect(args: argparse.Namespace) -> int:
    from fimoe_lab.checkpoints import format_report, inspect_checkpoint

    path = checkpoint_path(args.path)
    print(f"{path}\n")
    print(format_report(inspect_checkpoint(path, args.layer, args.tp, args.engine)))
    return EXIT_OK


def run_convert(args: argparse.Namespace) -> int:
    from fimoe_lab.checkpoints import convert_checkpoint, read_kernel_metadata

    out = convert_checkpoint(
        checkpoint_path(args.path),
        args.out,
        args.backend,
        args.tp,
        args.rank,
        args.layer,
        args.intermediate_alignment,
        args.hidden_alignment,
        progress=show_progress(args.no_progress),
        force=args.force,
        engine=args.engine,
    )
    meta = read_kernel_metadata(out)
    for idx, rec in meta["layers"].items():
        print(
            f"layer {idx}: {rec['description']}, intermediate {rec['plan']['args']['intermediate']}->"
            f"{rec['padded_intermediate']}, hidden {rec['plan']['args']['hidden']}->{rec['padded_hidden']}"
        )
        for t in rec["tensors"].values():
            print(
                f"  {t['name']:<18} {t['checkpoint']['shape']} -> {t['kernel']['shape']} {t['kernel']['dtype']}: "
                f"{' >> '.join(step['kind'] for step in t['steps']) or 'unchanged'}"
            )
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB, tp rank {args.rank} of {args.tp}, {args.backend})")
    return EXIT_OK


def run_restore(args: argparse.Namespace) -> int:
    from fimoe_lab.checkpoints import restore_checkpoint

    out = restore_checkpoint(args.kernel_file, args.out_dir, force=args.force)
    print(f"wrote {out} ({', '.join(sorted(p.name for p in out.iterdir()))})")
    return EXIT_OK
