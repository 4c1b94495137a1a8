"""``fimoe-lab inspect | convert | restore``: real checkpoints in and out of FlashInfer's kernel layout.

Parsers read only the torch-free tables; :mod:`fimoe_lab.checkpoints` (torch, safetensors)
is imported inside the handlers.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

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
            "inverse (padding dropped) and write OUT_DIR: config.json, index and shards with the expert tensors in the "
            "source's naming convention, byte-identical to the source (for a TP shard: the rank's slice). Streamed: one "
            "layer in memory, read a chunk of experts at a time."
        ),
        epilog="example: fimoe-lab restore /tmp/r1.kernel.safetensors /tmp/r1-restored",
    )
    r.add_argument(
        "kernel_file",
        metavar="KERNEL",
        help="what 'fimoe-lab convert' wrote: a .safetensors file or a sharded directory (for --rank all: one rank-<r>; "
        "for --ep N --tp N --rank all: OUT itself, whose ranks' experts are reassembled)",
    )
    r.add_argument("out_dir", metavar="OUT_DIR", help="output checkpoint directory")
    r.add_argument(
        "--force",
        action="store_true",
        help="replace OUT_DIR if it exists and was written by restore (never any other directory)",
    )
    _add_shard_size(r)
    r.set_defaults(handler=run_restore)


SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}
"""Shard size units, as Hugging Face's ``max_shard_size`` reads them ("5GB" = 5e9 bytes, "5GiB" = 5 * 2**30)."""


def byte_size(text: str) -> int:
    """argparse ``type``: a size like ``5GB``, ``500MB``, ``2GiB`` or a number of bytes (>= 1)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = m[2].upper() if m else ""
    if m is None or unit not in SIZE_UNITS or int(float(m[1]) * SIZE_UNITS[unit]) < 1:
        raise argparse.ArgumentTypeError(
            f"--shard-size takes a size like 5GB, 500MB or 2GiB, got {text!r} (units: {', '.join(u for u in SIZE_UNITS if u)})"
        )
    return int(float(m[1]) * SIZE_UNITS[unit])


def tp_rank(text: str) -> int | str:
    """argparse ``type``: a rank >= 0, or ``all``."""
    if text == "all":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"--rank takes a rank >= 0 or 'all', got {text!r}")
    return int(text)


def _add_shard_size(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shard-size",
        type=byte_size,
        metavar="SIZE",
        help="largest shard of a sharded output (default 5GB; units B, KB, MB, GB, KiB, MiB, GiB)",
    )


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
        help="write a checkpoint's MoE layers in FlashInfer's kernel layout (sharded directory or one file)",
        description=(
            "Read each MoE layer (rank --rank of --tp, sliced along the intermediate dim as serving engines shard), apply "
            "the layout plan of its format for --backend, and write w13_weight, w2_weight, w13_weight_scale, "
            "w2_weight_scale per layer, plus extras unchanged. The metadata records the plan arguments and every step, so "
            "'fimoe-lab restore' can map the file back.\n\n"
            "OUT is a directory of shards in the Hugging Face convention (model-0000k-of-0000n.safetensors and "
            "model.safetensors.index.json, each shard with the metadata), or one file when OUT ends in .safetensors or "
            "with --single-file. Streamed: one layer in memory, converted a chunk of experts at a time while earlier "
            "chunks are hashed and written. Every file is written to a temporary name and renamed when complete: a "
            "failed or interrupted run leaves no partial file, and no index until every shard is written; --resume "
            "keeps the shards that verify against their checksums and writes the rest.\n\n" + note
        ),
        epilog="examples: fimoe-lab convert deepseek-r1-nvfp4 /tmp/r1.kernel.safetensors --backend trtllm --tp 2 "
        "--intermediate-alignment 64\n"
        "          fimoe-lab convert /models/DeepSeek-V3 /tmp/dsv3-kernel --backend trtllm --tp 8 --rank all "
        "--shard-size 5GB",
    )
    c.add_argument("path", metavar="PATH", help="checkpoint directory or sample name")
    c.add_argument("out", metavar="OUT", help="output directory (sharded), or a .safetensors file")
    c.add_argument("--backend", required=True, choices=specs.BACKENDS, help="FlashInfer MoE backend")
    c.add_argument("--tp", type=positive_int("--tp"), default=1, metavar="N", help="tensor-parallel size (default 1)")
    c.add_argument(
        "--ep",
        type=positive_int("--ep"),
        default=1,
        metavar="N",
        help="expert-parallel size dividing --tp (default 1): rank r holds the contiguous experts of EP rank "
        "r // (TP/N) (vLLM/SGLang's placement), sliced as moe-TP rank r %% (TP/N); restore of OUT reassembles them",
    )
    c.add_argument(
        "--rank",
        type=tp_rank,
        default=0,
        metavar="R",
        help="tensor-parallel rank to write (default 0), or 'all': every rank, rank r in OUT/rank-<r>",
    )
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
    c.add_argument("--single-file", action="store_true", help="write one .safetensors file at OUT, not shards")
    _add_shard_size(c)
    c.add_argument(
        "--resume",
        action="store_true",
        help="finish an interrupted convert into OUT: shards that verify against their checksums are kept",
    )
    c.add_argument(
        "--device",
        default="cpu",
        metavar="DEV",
        help="where the layout transforms run: cpu (default) or cuda[:N] (pinned host buffers; needs a GPU)",
    )
    c.add_argument(
        "--distributed",
        action="store_true",
        help="one of the processes of a torch.distributed launch (torchrun --nproc-per-node N -m fimoe_lab convert "
        "... --distributed): the shards of every --rank are split across the processes, each writes its own, process "
        "0 writes the index when all succeeded; the files are those of one process (cuda: each on cuda:LOCAL_RANK)",
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
    from fimoe_lab.checkpoints import convert_checkpoint

    if args.distributed:
        return _run_distributed(args)
    positional, options = _convert_args(args)
    out = convert_checkpoint(*positional, progress=show_progress(args.no_progress), **options)
    _print_written(args, Path(out))
    return EXIT_OK


def _convert_args(args: argparse.Namespace) -> tuple[tuple, dict[str, Any]]:
    """The arguments ``convert`` passes to the one-process and the distributed convert alike."""
    positional = (
        checkpoint_path(args.path),
        args.out,
        args.backend,
        args.tp,
        args.rank,
        args.layer,
        args.intermediate_alignment,
        args.hidden_alignment,
    )
    options = {
        "force": args.force,
        "engine": args.engine,
        "single_file": True if args.single_file else None,
        "shard_size": args.shard_size,
        "resume": args.resume,
        "device": args.device,
        "ep_size": args.ep,
    }
    return positional, options


def _run_distributed(args: argparse.Namespace) -> int:
    from fimoe_lab.checkpoints.distributed import convert_distributed

    positional, options = _convert_args(args)
    done = convert_distributed(*positional, **options)
    if done["rank"] != 0:
        return EXIT_OK  # process 0 reports for all
    _print_written(args, Path(args.out))
    reports = done["processes"]
    for r in reports:
        rate = r["bytes"] / max(r["seconds"], 1e-9) / 1e6
        print(
            f"process {r['rank']}: wrote {r['written']} shards ({r['bytes'] / 1e6:.2f} MB in {r['seconds']:.2f} s, "
            f"{rate:.1f} MB/s), kept {r['kept']}"
        )
    kept, total = sum(r["kept"] for r in reports), sum(r["kept"] + r["written"] for r in reports)
    print(f"{len(reports)} processes: kept {kept} of {total} shards, wrote the rest")
    return EXIT_OK


def _print_written(args: argparse.Namespace, out: Path) -> None:
    from fimoe_lab.checkpoints import read_kernel_metadata

    ranks = range(args.tp) if args.rank == "all" else [args.rank]
    outputs = [out / f"rank-{r}" for r in ranks] if args.rank == "all" else [out]
    meta = read_kernel_metadata(outputs[0])
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
    for rank, o in zip(ranks, outputs):
        files = sorted(o.glob("*.safetensors")) if o.is_dir() else [o]
        size = sum(f.stat().st_size for f in files) / 1e6
        shards = f", {len(files)} shard{'s' * (len(files) > 1)}" if o.is_dir() else ""
        print(f"wrote {o} ({size:.2f} MB{shards}, tp rank {rank} of {args.tp}, {args.backend})")


def run_restore(args: argparse.Namespace) -> int:
    from fimoe_lab.checkpoints import restore_checkpoint

    out = restore_checkpoint(args.kernel_file, args.out_dir, force=args.force, shard_size=args.shard_size)
    shards = len(list(out.glob("*.safetensors")))
    print(f"wrote {out} (config.json, model.safetensors.index.json, {shards} shard{'s' * (shards > 1)})")
    return EXIT_OK
