"""``fimoe-lab diagnose CHECKPOINT KERNEL_TENSORS``: which preparation produced these kernel tensors.

The parser reads only torch-free tables; :mod:`fimoe_lab.diagnose` (torch) is imported by
the handler. Nothing is written unless ``--figure`` names a file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fimoe_lab.cli._common import (
    EXIT_FAILED,
    EXIT_OK,
    add_json_option,
    add_option,
    add_rank_option,
    add_tp_option,
    checkpoint_path,
    int_list,
    print_json,
)

DIAGNOSE_JSON = (
    '{"source", "tensors": {ROLE: {"dumped_name", "experts", "explained", "best": the variant that explains it, "equally": every other variant that explains it as well, '
    '"planned", "ranked": [{"variant", "match": per expert}] (the best 10)}}, "ignored": dumped names not compared}'
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "diagnose",
        help="find which plan variant (swap or not, interleave, swizzle, epilogue tile, padding, engine) "
        "explains tensors dumped from an engine",
        description=(
            "Read one MoE layer of CHECKPOINT and the kernel tensors an engine used (KERNEL_TENSORS: a .safetensors "
            "file, or one .npy array named by its file (no pickle: a .pt is refused); names with w13/gemm1 and w2/gemm2, scales with 'scale', "
            "experts first). Every plan of every backend and engine profile, each with one step left out, another "
            "epilogue_tile_m or another intermediate padding, is applied to the checkpoint and compared byte by byte "
            "(fill bytes excluded) with the dump, per expert. Prints, per tensor, the variant that explains the bytes, "
            "every other variant that explains them equally (an engine profile's own plan named before a plan with a "
            "step left out) and how much the planned one matches. Exit 0 when every tensor is explained exactly, 1 otherwise."
        ),
        epilog="example: fimoe-lab diagnose deepseek-r1-nvfp4 dumped_layer3.safetensors --layer 3 --figure diag.png",
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint directory (or its config.json) or sample name")
    p.add_argument("kernel_tensors", type=Path, metavar="KERNEL_TENSORS", help=".safetensors or .npy of dumped tensors")
    p.add_argument("--layer", type=int, default=None, metavar="N", help="only layer N (default: the first MoE layer)")
    add_tp_option(p, "the size the engine ran")
    add_rank_option(p, "the dump comes from (default 0)")
    add_option(
        p,
        "--expert-ids",
        "--experts",
        type=int_list("--expert-ids", "0,1,2", minimum=0),
        default=None,
        metavar="E,E,..",
        help="the experts to compare, by index (default: the first 8)",
    )
    p.add_argument("--figure", type=Path, default=None, help="write the comparison figure of the first tensor (PNG)")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace the --figure file if it exists and fimoe-lab wrote it (never any other file)",
    )
    add_json_option(p, DIAGNOSE_JSON)
    p.set_defaults(handler=run_diagnose)


def run_diagnose(args: argparse.Namespace) -> int:
    from fimoe_lab.checkpoints import open_checkpoint
    from fimoe_lab.diagnose import diagnose, figure, load_dump
    from fimoe_lab.owned_files import check_file_output, write_file_output
    from fimoe_lab.untrusted import printable

    where = checkpoint_path(args.checkpoint)  # the model first: a missing one is named before the dump
    if args.figure is not None:  # before any work: an existing file or a link is refused now
        check_file_output(args.figure, "png", args.force, [where, args.kernel_tensors])
    dumped = load_dump(args.kernel_tensors)
    ckpt = open_checkpoint(where)
    layer = ckpt.moe_layers[0] if args.layer is None else args.layer
    moe = ckpt.read_layer(layer, args.tp, args.rank)
    source = f"{args.checkpoint} layer {layer} (TP rank {args.rank} of {args.tp}) vs {args.kernel_tensors}"
    result = diagnose(moe, dumped, args.expert_ids, source)
    if args.figure is not None:
        first = next(iter(result.tensors.values()))
        from fimoe_lab.viz.figures import to_png

        png = to_png(figure(first, moe, dumped[first.dumped_name]))
        write_file_output(args.figure, png, "png", args.force, [args.checkpoint, args.kernel_tensors])
        print(printable(f"figure: {args.figure}"), file=sys.stderr)
    if args.json:
        print_json(result.to_json())
    else:
        print(result.summary())
    return EXIT_OK if all(t.explained() for t in result.tensors.values()) else EXIT_FAILED
