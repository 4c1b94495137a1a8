"""``fimoe-lab inspect | convert | restore``: real checkpoints in and out of FlashInfer's kernel layout."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

_SAMPLES_NOTE = ("PATH is a checkpoint directory (config.json + *.safetensors, index optional) or the name of a shipped "
                 "sample: deepseek-v3-fp8, qwen3-moe-bf16, mixtral-bf16, deepseek-r1-nvfp4, gpt-oss-mxfp4.")


def _path(value: str) -> Path:
    """A checkpoint directory, or a sample name."""
    p = Path(value)
    if p.exists():
        return p
    from fimoe_lab.checkpoints import sample_names, sample_path

    if value in sample_names():
        return sample_path(value)
    raise FileNotFoundError(f"{value}: no such checkpoint directory or sample; samples: {', '.join(sample_names())}")


def _tps(value: str) -> tuple[int, ...]:
    try:
        tps = tuple(int(v) for v in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tp takes comma-separated sizes like 1,2,4,8, got {value!r}") from None
    if any(t < 1 for t in tps):
        raise argparse.ArgumentTypeError(f"TP sizes must be >= 1, got {value!r}")
    return tps


def register(sub: argparse._SubParsersAction) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "inspect", formatter_class=fmt,
        help="summarize a checkpoint's MoE layers: format, shapes, padding per backend and TP, scale health",
        description=(
            "For each MoE layer: naming convention and format (detected from tensor names and dtypes), stacked shapes, "
            "gate/up order, what the TRT-LLM and CUTLASS backends need (padding, or why it fails and the alignment that "
            "fixes it) at each TP size, and scale health (NaN/Inf, all-zero experts, dead ~1e-23 block scales). Reads "
            "headers and scales only.\n\n" + _SAMPLES_NOTE),
        epilog="example: fimoe-lab inspect deepseek-v3-fp8 --tp 1,2,4,8")
    p.add_argument("path", metavar="PATH", help="checkpoint directory or sample name")
    p.add_argument("--layer", type=int, action="append", metavar="N", help="only layer N (repeatable; default: all MoE layers)")
    p.add_argument("--tp", type=_tps, default=(1, 2, 4, 8), metavar="T,T,..", help="TP sizes to check (default 1,2,4,8)")
    p.set_defaults(handler=run_inspect)

    c = sub.add_parser(
        "convert", formatter_class=fmt,
        help="write a checkpoint's MoE layers in FlashInfer's kernel layout (one safetensors file)",
        description=(
            "Read each MoE layer (rank --rank of --tp, sliced along the intermediate dim as serving engines shard), apply "
            "the layout plan of its format for --backend, and write w13_weight, w2_weight, w13_weight_scale, "
            "w2_weight_scale per layer, plus extras unchanged. The metadata records the plan arguments and every step, so "
            "'fimoe-lab restore' can map the file back. Written to a temporary name and renamed when complete: a failed "
            "or interrupted run leaves nothing at OUT.\n\n" + _SAMPLES_NOTE),
        epilog="example: fimoe-lab convert deepseek-r1-nvfp4 /tmp/r1.kernel.safetensors --backend trtllm --tp 2 "
               "--intermediate-alignment 64")
    c.add_argument("path", metavar="PATH", help="checkpoint directory or sample name")
    c.add_argument("out", metavar="OUT", help="output .safetensors file")
    c.add_argument("--backend", required=True, choices=("trtllm", "cutlass"), help="FlashInfer MoE backend")
    c.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel size (default 1)")
    c.add_argument("--rank", type=int, default=0, metavar="R", help="tensor-parallel rank to write (default 0)")
    c.add_argument("--layer", type=int, action="append", metavar="N", help="only layer N (repeatable; default: all)")
    c.add_argument("--intermediate-alignment", type=int, metavar="A", help="pad the intermediate size to a multiple of A "
                   "(default: the backend's rule; 'inspect' says when the default fails)")
    c.add_argument("--hidden-alignment", type=int, metavar="A", help="pad the hidden size to a multiple of A")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    c.set_defaults(handler=run_convert)

    r = sub.add_parser(
        "restore", formatter_class=fmt,
        help="map a converted kernel-layout file back to a checkpoint in its original naming convention",
        description=(
            "Rebuild each layer's plan from the recorded arguments, check its steps against the recorded ones, apply the "
            "inverse (padding dropped) and write OUT_DIR: config.json, index and one shard with the expert tensors in the "
            "source's naming convention, byte-identical to the source (for a TP shard: the rank's slice)."),
        epilog="example: fimoe-lab restore /tmp/r1.kernel.safetensors /tmp/r1-restored")
    r.add_argument("kernel_file", metavar="KERNEL_FILE", help="file written by 'fimoe-lab convert'")
    r.add_argument("out_dir", metavar="OUT_DIR", help="output checkpoint directory")
    r.add_argument("--force", action="store_true", help="overwrite OUT_DIR if it exists")
    r.set_defaults(handler=run_restore)


def run_inspect(args: argparse.Namespace) -> int:
    from fimoe_lab.checkpoints import format_report, inspect_checkpoint

    path = _path(args.path)
    print(f"{path}\n")
    print(format_report(inspect_checkpoint(path, args.layer, args.tp)))
    return 0


def _refuse_existing(out: str, force: bool) -> None:
    from fimoe_lab.checkpoints import CheckpointError

    if os.path.exists(out) and not force:
        raise CheckpointError(f"{out} exists; pass --force to overwrite it")


def run_convert(args: argparse.Namespace) -> int:
    from fimoe_lab.checkpoints import convert_checkpoint, read_kernel_metadata

    _refuse_existing(args.out, args.force)
    out = convert_checkpoint(_path(args.path), args.out, args.backend, args.tp, args.rank, args.layer,
                             args.intermediate_alignment, args.hidden_alignment, progress=not args.no_progress)
    meta = read_kernel_metadata(out)
    for idx, rec in meta["layers"].items():
        print(f"layer {idx}: {rec['description']}, intermediate {rec['plan']['args']['intermediate']}->"
              f"{rec['padded_intermediate']}, hidden {rec['plan']['args']['hidden']}->{rec['padded_hidden']}")
        for n, t in rec["tensors"].items():
            print(f"  {t['name']:<18} {t['checkpoint']['shape']} -> {t['kernel']['shape']} {t['kernel']['dtype']}: "
                  f"{' >> '.join(s.split('(')[0] for s in t['steps']) or 'unchanged'}")
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB, tp rank {args.rank} of {args.tp}, {args.backend})")
    return 0


def run_restore(args: argparse.Namespace) -> int:
    from fimoe_lab.checkpoints import restore_checkpoint

    _refuse_existing(args.out_dir, args.force)
    out = restore_checkpoint(args.kernel_file, args.out_dir)
    print(f"wrote {out} ({', '.join(sorted(p.name for p in out.iterdir()))})")
    return 0
