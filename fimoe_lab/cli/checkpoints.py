"""``fimoe-lab inspect | convert | restore``: real checkpoints in and out of FlashInfer's kernel layout.

Parsers read only the torch-free tables; :mod:`fimoe_lab.checkpoints` (torch, safetensors)
is imported inside the handlers.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path
from typing import Any

from fimoe_lab.choice import LayoutChoice
from fimoe_lab.cli._common import (
    EXIT_OK,
    add_backend_option,
    add_engine_option,
    add_json_option,
    add_option,
    add_per_token_option,
    add_progress_option,
    add_rank_option,
    add_tp_option,
    checkpoint_path,
    int_list,
    layout_choice,
    positive_int,
    print_json,
    progress_for,
)
from fimoe_lab.cli.core import add_mxfp4_activation_option
from fimoe_lab.resources import sample_names
from fimoe_lab.specs import BACKENDS


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
            "source's naming convention, byte-identical to the source (for a TP shard: the rank's slice), and every "
            "tensor convert carried through unchanged: from a whole convert (one rank, or OUT of --rank all), every "
            "tensor of the source with its name, dtype, shape and bytes, and nothing else. Streamed: one "
            "layer in memory, read a chunk of experts at a time."
        ),
        epilog="example: fimoe-lab restore /tmp/r1.kernel.safetensors /tmp/r1-restored",
    )
    r.add_argument(
        "kernel_file",
        metavar="KERNEL",
        help="what 'fimoe-lab convert' wrote: a .safetensors file or a sharded directory (for --rank all: OUT itself, "
        "every rank's experts and intermediate slices reassembled, or one rank-<r> of a run without --ep)",
    )
    r.add_argument("out_dir", metavar="OUT_DIR", help="output checkpoint directory")
    r.add_argument(
        "--force",
        action="store_true",
        help="replace OUT_DIR if it exists and was written by restore (never any other directory)",
    )
    _add_shard_size(r)
    add_progress_option(r)
    add_json_option(r, RESTORE_JSON)
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
    add_option(
        p,
        "--tp",
        "--tp-size",
        type=int_list("--tp", "1,2,4,8"),
        default=(1, 2, 4, 8),
        metavar="T,T,..",
        help="tensor-parallel sizes to check, one or several (default 1,2,4,8)",
    )
    add_per_token_option(p, "the paddings convert --per-token writes")
    add_mxfp4_activation_option(p, "the CUTLASS plans as convert --mxfp4-activation writes them")
    add_engine_option(p)
    add_json_option(p, INSPECT_JSON)
    p.add_argument(
        "--html",
        metavar="REPORT",
        help="also write a self-contained HTML report (summary, layers, step chains with their padding cost, "
        "warnings, layout pictures; inline CSS and SVG, light and dark) to REPORT",
    )
    p.add_argument("--force", action="store_true", help="replace REPORT if it exists and was written by inspect --html")
    p.set_defaults(handler=run_inspect)


INSPECT_JSON = (
    '{"path", "engine": the resolved profile, "per_token", "tp": [TP sizes], "layers": [{"layer", "name", "mtp", '
    '"convention", "models", "format", "experts", "top_k", "hidden", "intermediate", "gate_up_order", "activation", '
    '"tensors": '
    '[{"name", "dtype", "shape"}], "tp": [{"tp", "sizes": [intermediate per rank] or null, "cannot": null or why it '
    'does not shard, "backends": {BACKEND: {"backend", "engine", "status": ok, aligned, cannot or no-layout, "reason", "alignment": the '
    '--intermediate-alignment that works, "intermediate", "hidden" (rank 0), "padded_intermediate", "padded_hidden", '
    '"checkpoint_bytes", "kernel_bytes", "pad_bytes" (per expert), "tensors": [{"name", "in_shape", "out_shape", '
    '"pad_bytes", "steps"}], "warnings", "plan": what convert records, "tactics": null or {tokens: valid '
    'TRTLLM-Gen tactics of the padded shape, exact}, "text": the printed line}}}], "health": '
    '[scale health lines]}], "html": null or the report written}'
)


def _register_convert(sub: argparse._SubParsersAction, note: str) -> None:
    c = sub.add_parser(
        "convert",
        help="write a checkpoint's MoE layers in FlashInfer's kernel layout (sharded directory or one file)",
        description=(
            "Read each MoE layer (rank --rank of --tp, sliced along the intermediate dim as serving engines shard), apply "
            "the layout plan of its format for --backend, and write w13_weight, w2_weight, w13_weight_scale, "
            "w2_weight_scale per layer, plus extras unchanged. Every other tensor of the checkpoint (dense layers, "
            "routers and their biases, shared experts, norms, embeddings, heads, MTP layers) is written unchanged under "
            "its own name, into rank 0's output only, so OUT is a whole checkpoint and each tensor is stored once "
            "(with --layer, the routed experts of the layers left out are not written). The metadata records the plan arguments and every step, and the source files by "
            "size and header digest (no path, no time: the same source converted anywhere gives the same bytes), so "
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
    add_backend_option(c, "FlashInfer MoE backend (required)", required=True)
    add_tp_option(c)
    c.add_argument(
        "--ep",
        type=positive_int("--ep"),
        default=1,
        metavar="N",
        help="expert-parallel size dividing --tp (default 1): rank r holds the contiguous experts of EP rank "
        "r // (TP/N) (vLLM/SGLang's placement), sliced as moe-TP rank r %% (TP/N); restore of OUT reassembles them",
    )
    add_rank_option(c, "to write (default 0), or 'all': every rank, rank r in OUT/rank-<r>", tp_rank)
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
    add_progress_option(c)
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
        help="finish an interrupted convert into OUT: only the same request (the same source by content and the "
        "same options, recorded in every file convert writes; anything else is refused, naming the difference); "
        "shards that verify against their checksums are kept",
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
    add_per_token_option(
        c,
        "the engine profile's per-token paddings (vLLM: hidden 512 for a non-gated layer on TRT-LLM), recorded in the file",
    )
    add_mxfp4_activation_option(c, "recorded in the file")
    add_engine_option(c, values=True)
    add_json_option(c, CONVERT_JSON)
    c.set_defaults(handler=run_convert)


def as_typed(text: str, path: Path, typed: str, escape: bool = False) -> str:
    """``text`` with the checkpoint's resolved location ``path`` (a sample's is inside the installed package)
    written as the user typed it, ``typed`` (``escape``: both as HTML text)."""
    import html

    where, shown = (html.escape(str(path)), html.escape(typed)) if escape else (str(path), typed)
    return text if str(path) == typed else text.replace(where, shown)


def run_inspect(args: argparse.Namespace) -> int:
    from fimoe_lab.checkpoints import format_report, inspect_checkpoint
    from fimoe_lab.engines import get_engine

    path = checkpoint_path(args.path)
    html = Path(args.html) if args.html else None
    if html is not None:
        from fimoe_lab.viz.report import check_report_output

        check_report_output(html, [path], args.force)  # before anything is read
    reports = inspect_checkpoint(path, args.layer, args.tp, choice=layout_choice(args, BACKENDS[0]))
    add_tactics(reports, args.per_token)
    engine = get_engine(args.engine).name
    if html is not None:
        from fimoe_lab.viz.report import report_html, write_report

        shown = Path(args.path)  # as the user typed it (a sample by its name, not where it is installed)
        page = report_html(shown, reports, engine, args.tp, per_token=args.per_token)
        write_report(html, as_typed(page, path, args.path, escape=True), args.force)
    if args.json:
        layers = [r.to_json() for r in reports]
        doc = dict(path=str(path), engine=engine, per_token=args.per_token, tp=list(args.tp), layers=layers)
        print_json({**doc, "html": None if html is None else str(html)})
        return EXIT_OK
    print(f"{args.path}\n")
    print(as_typed(format_report(reports), path, args.path))
    if html is not None:
        print(f"wrote {html}")
    return EXIT_OK


TACTIC_TOKENS = (1, 64, 1024, 8192)
"""Token counts at which ``inspect`` counts the TRTLLM-Gen tactics of each TRT-LLM plan's padded shape."""


def add_tactics(reports: list, per_token: bool = False) -> None:
    """Fill ``tactics`` of every TRT-LLM plan in ``reports``: the valid TRTLLM-Gen tactics of its padded shape
    (local experts, the layer's top-k, per token count of :data:`TACTIC_TOKENS`), from the tuner's exact
    validity model of the shipped kernel set (:class:`fimoe_lab.tune.oracle.TacticOracle`, ``model``); a
    count of 0 adds a warning to the plan (and to its printed line). Formats the tuner does not know stay None."""
    from fimoe_lab.errors import OracleError
    from fimoe_lab.specs import tuner_formats
    from fimoe_lab.tune.oracle import TacticOracle, TacticQuery

    oracle = TacticOracle(mode="model")
    try:
        for r in reports:
            for tp, needs in r.plans.items():
                need = needs.get("trtllm")
                if r.fmt not in tuner_formats() or need is None or need.padded_intermediate is None:
                    continue
                sizes = (need.padded_hidden, need.padded_intermediate, r.num_experts, r.top_k or 1)
                try:
                    counts = {
                        t: oracle.ask(TacticQuery(r.fmt, r.activation, *sizes, t, per_token)).count
                        for t in TACTIC_TOKENS
                    }
                except OracleError:
                    continue
                need.tactics = {str(t): c for t, c in counts.items()}
                none = [t for t, c in counts.items() if c == 0]
                if none:
                    need.warnings.append(f"no TRT-LLM tactic at {', '.join(map(str, none))} tokens")
                    r.tp[tp]["trtllm"] = need.text()
    finally:
        oracle.close()


def run_convert(args: argparse.Namespace) -> int:
    from fimoe_lab.checkpoints import convert_checkpoint

    if args.distributed:
        return _run_distributed(args)
    positional, options = _convert_args(args)
    before, start = _file_ids(Path(args.out)) if args.resume else {}, time.time()
    out = convert_checkpoint(*positional, progress=progress_for(args.no_progress), **options)
    doc = _written(args, options["choice"], Path(out), before, start)
    if args.json:
        print_json(doc)
    else:
        _print_written(doc)
    return EXIT_OK


CONVERT_JSON = (
    '{"source", "out", "backend", "engine", "tp", "ep", "rank": R or "all", "per_token", "intermediate_alignment", '
    '"hidden_alignment": as given (null: the profile default), "layers": [{"layer", "description", "intermediate", '
    '"padded_intermediate", "hidden", "padded_hidden", "tensors": [{"name", "checkpoint_shape", "kernel_shape", '
    '"dtype", "steps": an engine value rule first where it changes the tensor}], "value_rule": null or {"kind", '
    '"tensors", "floor", "nan_to", "where", "kept": tensors whose checkpoint bytes the file keeps beside, for '
    'restore}}] (rank 0), "ranks": [{"rank", "out", "sharded", "experts": [first, end) with --ep, else null, '
    '"unchanged": source tensors carried through unchanged (rank 0 holds them all), '
    '"files": [{"name", "bytes", "kept": kept from an earlier run by --resume}], "bytes", "written", "kept", "seconds": from the start or the previous rank to its last file '
    'written}], "bytes": all files, "written_bytes", "seconds", "mb_per_s": written bytes per second, "processes": '
    'null or, with --distributed, [{"rank", "units", "written", "kept", "bytes", "seconds", "mb_per_s"}]}'
)
RESTORE_JSON = (
    '{"source", "out", "files": [{"name", "bytes"}], "shards", "tensors": restored tensors (index), "bytes", '
    '"seconds", "mb_per_s", "byte_exact": true unless the file lacks the checkpoint bytes of values an engine value rule changed, "not_byte_exact": '
    '[{"layer", "tensors", "rule", "why"}]}'
)


def _convert_args(args: argparse.Namespace) -> tuple[tuple, dict[str, Any]]:
    """The arguments ``convert`` passes to the one-process and the distributed convert alike (the layout options
    as one value, :func:`layout_choice`)."""
    positional = (checkpoint_path(args.path), args.out)
    options = {
        "tp_size": args.tp,
        "tp_rank": args.rank,
        "layers": args.layer,
        "choice": layout_choice(args),
        "force": args.force,
        "single_file": True if args.single_file else None,
        "shard_size": args.shard_size,
        "resume": args.resume,
        "device": args.device,
        "ep_size": args.ep,
    }
    return positional, options


def _file_ids(out: Path) -> dict[Path, tuple[int, int, int]]:
    """``{file: (inode, size, mtime_ns)}`` of the safetensors files at ``out`` (itself, in it, or in its rank
    directories): a file with the same identity after a ``--resume`` run was kept, not written."""
    if out.is_file():
        files = [out]
    else:
        files = sorted(out.glob("*.safetensors")) + sorted(out.glob("rank-*/*.safetensors")) if out.is_dir() else []
    return {f: (st.st_ino, st.st_size, st.st_mtime_ns) for f in files for st in [f.stat()]}


def _written_layers(meta: dict) -> list[dict[str, Any]]:
    """The layer records of convert's metadata as ``convert --json`` lists them (a value rule is the first step of
    each tensor it changes: it runs before the byte maps)."""

    def ruled(n: str, rec: dict) -> list[str]:
        rule = rec.get("value_rule")
        return [rule["kind"]] if rule is not None and n in rule["tensors"] else []

    return [
        dict(
            layer=int(idx),
            description=rec["description"],
            intermediate=rec["plan"]["args"]["intermediate"],
            padded_intermediate=rec["padded_intermediate"],
            hidden=rec["plan"]["args"]["hidden"],
            padded_hidden=rec["padded_hidden"],
            tensors=[
                dict(
                    name=t["name"],
                    checkpoint_shape=t["checkpoint"]["shape"],
                    kernel_shape=t["kernel"]["shape"],
                    dtype=t["kernel"]["dtype"],
                    steps=ruled(n, rec) + [step["kind"] for step in t["steps"]],
                )
                for n, t in rec["tensors"].items()
            ],
            value_rule=rec.get("value_rule"),
        )
        for idx, rec in meta["layers"].items()
    ]


def _written_ranks(args: argparse.Namespace, out: Path, before: dict, start: float) -> list[dict[str, Any]]:
    """Per TP rank: its output, experts (``--ep``: the metadata's range), the source tensors it carries unchanged
    (rank 0's), files (bytes, kept by ``--resume``), and seconds to its last file written."""
    from fimoe_lab.checkpoints.fileformat import KernelFiles
    from fimoe_lab.checkpoints.restore import kept_names

    ranks = list(range(args.tp)) if args.rank == "all" else [args.rank]
    outputs = [out / f"rank-{r}" for r in ranks] if args.rank == "all" else [out]
    done, last = [], start
    for rank, o in zip(ranks, outputs):
        ids = _file_ids(o)
        files = [dict(name=f.name, bytes=i[1], kept=before.get(f) == i) for f, i in ids.items()]
        new = [i[2] / 1e9 for f, i in ids.items() if before.get(f) != i]
        end = max([last, *new])
        size = sum(f["bytes"] for f in files)
        kept = sum(f["kept"] for f in files)
        with KernelFiles(o) as kf:
            experts = kf.meta.get("experts")  # [e0, e1) of an EP rank; None: every expert
            unchanged = len(kept_names(kf))
        rec = dict(rank=rank, out=str(o), sharded=o.is_dir(), experts=experts, unchanged=unchanged)
        rec.update(files=files, bytes=size)
        rec["written"] = len(files) - kept
        done.append({**rec, "kept": kept, "seconds": round(end - last, 3)})
        last = end
    return done


def _written(args: argparse.Namespace, choice: LayoutChoice, out: Path, before: dict, start: float) -> dict[str, Any]:
    """What ``convert`` wrote (:data:`CONVERT_JSON`) under ``choice``, read back from the files and their
    metadata."""
    from fimoe_lab.checkpoints import read_kernel_metadata
    from fimoe_lab.engines import get_engine

    seconds = time.time() - start
    ranks = _written_ranks(args, out, before, start)
    meta = read_kernel_metadata(Path(ranks[0]["out"]))
    written = sum(f["bytes"] for r in ranks for f in r["files"] if not f["kept"])
    return dict(
        source=str(checkpoint_path(args.path)),
        out=str(out),
        backend=choice.backend,
        engine=get_engine(choice.engine).name,
        tp=args.tp,
        ep=args.ep,
        rank=args.rank,
        per_token=choice.per_token_activation,
        intermediate_alignment=choice.intermediate_alignment,
        hidden_alignment=choice.hidden_alignment,
        layers=_written_layers(meta),
        ranks=ranks,
        bytes=sum(r["bytes"] for r in ranks),
        written_bytes=written,
        seconds=round(seconds, 3),
        mb_per_s=round(written / max(seconds, 1e-9) / 1e6, 3),
        processes=None,
    )


def _run_distributed(args: argparse.Namespace) -> int:
    from fimoe_lab.checkpoints.distributed import convert_distributed

    positional, options = _convert_args(args)
    before, start = _file_ids(Path(args.out)) if args.resume else {}, time.time()
    done = convert_distributed(*positional, progress=progress_for(args.no_progress), **options)  # process 0 shows it
    if done["rank"] != 0:
        return EXIT_OK  # process 0 reports for all
    doc = _written(args, options["choice"], Path(args.out), before, start)
    reports = done["processes"]
    doc["processes"] = [
        {**r, "seconds": round(r["seconds"], 3), "mb_per_s": round(r["bytes"] / max(r["seconds"], 1e-9) / 1e6, 3)}
        for r in reports
    ]
    if args.json:
        print_json(doc)
        return EXIT_OK
    _print_written(doc)
    for r in doc["processes"]:
        print(
            f"process {r['rank']}: wrote {r['written']} shards ({r['bytes'] / 1e6:.2f} MB in {r['seconds']:.2f} s, "
            f"{r['mb_per_s']:.1f} MB/s), kept {r['kept']}"
        )
    kept, total = sum(r["kept"] for r in reports), sum(r["kept"] + r["written"] for r in reports)
    print(f"{len(reports)} processes: kept {kept} of {total} shards, wrote the rest")
    return EXIT_OK


def _print_written(doc: dict[str, Any]) -> None:
    """The text form of :func:`_written`'s record."""
    from fimoe_lab.checkpoints.fileformat import KEPT_SUFFIX, KERNEL_NAMES

    for layer in doc["layers"]:
        print(
            f"layer {layer['layer']}: {layer['description']}, intermediate {layer['intermediate']}->"
            f"{layer['padded_intermediate']}, hidden {layer['hidden']}->{layer['padded_hidden']}"
        )
        for t in layer["tensors"]:
            print(
                f"  {t['name']:<18} {t['checkpoint_shape']} -> {t['kernel_shape']} {t['dtype']}: "
                f"{' >> '.join(t['steps']) or 'unchanged'}"
            )
        rule = layer["value_rule"]
        if rule is not None and rule["kept"]:
            names = ", ".join(f"{KERNEL_NAMES[n]}{KEPT_SUFFIX}" for n in rule["kept"])
            print(f"  + {names}: the checkpoint's bytes, kept for restore ({rule['kind']} changed them)")
    for r in doc["ranks"]:
        n = len(r["files"])
        shards = f", {n} shard{'s' * (n > 1)}" if r["sharded"] else ""
        kept = f", {r['unchanged']} other tensors unchanged" if r["unchanged"] else ""
        print(
            f"wrote {r['out']} ({r['bytes'] / 1e6:.2f} MB{shards}, tp rank {r['rank']} of {doc['tp']}, {doc['backend']}{kept})"
        )


def run_restore(args: argparse.Namespace) -> int:
    from fimoe_lab.checkpoints import not_byte_exact, restore_checkpoint
    from fimoe_lab.checkpoints.safe_io import INDEX, read_json

    start = time.time()
    out = restore_checkpoint(
        args.kernel_file,
        args.out_dir,
        force=args.force,
        shard_size=args.shard_size,
        progress=progress_for(args.no_progress),
    )
    seconds = time.time() - start
    lossy = not_byte_exact(args.kernel_file)
    shards = sorted(out.glob("*.safetensors"))
    tensors = len(read_json(out / INDEX, "index")["weight_map"])
    if not args.json:
        n = len(shards)
        print(f"wrote {out} (config.json, model.safetensors.index.json, {n} shard{'s' * (n > 1)}, {tensors} tensors)")
        for note in lossy:
            print(f"not byte-exact: layer {note['layer']} {', '.join(note['tensors'])}: {note['why']}")
        return EXIT_OK
    files = [dict(name=f.name, bytes=f.stat().st_size) for f in sorted(p for p in out.iterdir() if p.is_file())]
    size = sum(f["bytes"] for f in files)
    print_json(
        dict(
            source=str(args.kernel_file),
            out=str(out),
            files=files,
            shards=len(shards),
            tensors=tensors,
            bytes=size,
            seconds=round(seconds, 3),
            mb_per_s=round(size / max(seconds, 1e-9) / 1e6, 3),
            byte_exact=not lossy,
            not_byte_exact=lossy,
        )
    )
    return EXIT_OK
