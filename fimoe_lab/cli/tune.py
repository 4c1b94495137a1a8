"""``fimoe-lab tune | tactics``: TRTLLM-Gen tactic counts per padding, and for one shape.

    fimoe-lab tune --model qwen3-30b-a3b --format nvfp4 --tp 8
    fimoe-lab tactics --format nvfp4 --act swiglu --per-token --hidden 3072 --inter 1920 \\
        --experts 128 --top-k 6 --tokens 1,8,64 --json

Parsers read the torch-free tables (:mod:`fimoe_lab.specs`, :mod:`fimoe_lab.presets`);
the oracle is imported inside the handlers; ``tune`` needs neither torch nor pandas
(``--measure`` imports torch, ``--plot`` pandas and matplotlib). An answer the source does
not know (a kernel set that is not shipped) exits 3.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

from fimoe_lab import specs
from fimoe_lab.cli._common import (
    EXIT_NO_ANSWER,
    EXIT_OK,
    add_backend_option,
    add_engine_option,
    add_format_option,
    add_json_option,
    add_option,
    add_per_token_option,
    add_size_options,
    add_tp_option,
    int_list,
    lower_choice,
    model_source,
    one_line,
    positive_int,
    print_json,
    show_progress,
)
from fimoe_lab.errors import FormatError, OracleError
from fimoe_lab.owned_files import check_file_output, write_file_output
from fimoe_lab.presets import PRESETS, get_preset

SOURCES = ("auto", "live", "native", "model", "snapshot")  # TacticOracle.MODES (checked by a test)
SOURCE_HELP = (
    "where tactic answers come from: auto (default): native on a Blackwell GPU, else the model when the installed "
    "FlashInfer's kernel table is shipped, else live, else the model; native: FlashInfer's own "
    "trtllm_get_valid_moe_configs on this Blackwell (SM10x) GPU (refused without one); live: that op from the "
    "module built by 'python -m fimoe_lab.tune.build', on any machine (an SM100 shim); model: the shipped "
    "re-implementation of the op over FlashInfer's kernel table, exact for any shape, no GPU; snapshot: the same "
    "as model (its former name)"
)
GPU_NAMES = ("b200", "gb200", "b300", "h200", "h100")  # the rows of fimoe_lab.tune.cost.GPUS (checked by a test)
TOKENS_TYPE = int_list("--tokens", "1,8,64")


def _activation(text: str) -> str:
    """argparse ``type``: an activation name or alias from the table, as its canonical name."""
    try:
        return specs.get_activation(text).name
    except FormatError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(sub: argparse._SubParsersAction) -> None:
    _register_tune(sub)
    _register_tactics(sub)


def token_profile(text: str) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """argparse ``type``: ``1,8,64`` (equal weights) or ``1:6,512:3,4096:1`` (token count:weight)."""
    try:
        pairs = [v.split(":") if ":" in v else (v, "1") for v in text.split(",") if v.strip()]
        tokens, weights = tuple(int(t) for t, _ in pairs), tuple(float(w) for _, w in pairs)
    except ValueError:
        tokens, weights = (), ()
    if not tokens or min(tokens) < 1 or min(weights) < 0 or sum(weights) <= 0:
        raise argparse.ArgumentTypeError(
            f"--tokens takes token counts >= 1, each optionally weighted (T:weight), like 1:6,512:3,4096:1; got {text!r}"
        )
    return tokens, weights


TUNE_JSON = (
    '{"attrs": the inputs of the sweep and its recommendation, "rows": [the rows of the table, each with '
    "predicted_us (and measured_us with --measure)]}"
)
TACTICS_JSON = (
    '[{"tokens", "count": valid tactics or null, "per_tile": {tile_N: count}, "source", "reason" (when known), '
    '"configs" (with --configs)} per token count]'
)


def _register_tune(sub: argparse._SubParsersAction) -> None:
    presets, formats = sorted(PRESETS), specs.tuner_formats()
    t = sub.add_parser(
        "tune",
        help="padding sweep for a model: tactics per padding, predicted time, recommendation",
        description="For a model (a preset, a checkpoint directory, a config.json or explicit sizes), a "
        "format and a tensor-parallel size: shard the intermediate size per rank as the checkpoint reader "
        "does (equal shards, or whole MXFP4 blocks for gpt-oss), pad each rank's intermediate and the hidden "
        "size to each alignment, count the TRTLLM-Gen MoE tactics FlashInfer offers per token count "
        "(Blackwell; on Hopper the CUTLASS backend has no tactic list), predict the layer's time on the "
        "target GPU over the token profile (an estimate: weight bytes / bandwidth, padded FLOPs / peak / "
        "tile efficiency), and recommend the fastest padding that has a tactic at every token count and "
        "that 'fimoe-lab convert' applies to every rank (the padding rule of its layer plan). The default "
        "padding ('convert' without alignment options) is REF. Per-tactic timing needs a Blackwell GPU; "
        "--measure times the padded GEMMs live on any CUDA GPU. Exits 3 when a count is unknown to the "
        "source.",
        epilog="presets: " + ", ".join(presets) + "\nformats: " + ", ".join(formats),
    )
    t.add_argument(
        "checkpoint",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model: a preset, a shipped sample name, a checkpoint directory or a config.json (sizes, and a "
        "checkpoint's format, read from it)",
    )
    t.add_argument("--model", metavar="MODEL", help="the model, as MODEL (a preset: " + ", ".join(presets) + ")")
    t.add_argument("--config", help="a Hugging Face config.json (sizes read with the checkpoint reader's keys)")
    add_size_options(
        t,
        "MoE intermediate size per expert at TP 1; overrides the model's",
        "hidden size (K of GEMM1); overrides the model's",
    )
    t.add_argument("--experts", type=int, help="routed experts (e.g. experts per rank under EP); overrides the model's")
    t.add_argument("--top-k", type=int, help="experts per token; overrides the model's")
    t.add_argument("--act", type=_activation, default=None, help="activation (default: the model's, else swiglu)")
    add_format_option(
        t,
        "weight/activation format (" + ", ".join(formats) + "; default: the checkpoint's, or the preset's when it "
        "has one)",
        formats,
    )
    add_tp_option(t, "splits the intermediate size")
    add_per_token_option(t, "the tactics and paddings of per-token activation scales")
    t.add_argument(
        "--tokens",
        type=token_profile,
        default=None,
        help="token profile: counts, optionally weighted T:w (default 1,8,64,512,4096,16384, equal weights)",
    )
    t.add_argument("--gpu", choices=GPU_NAMES, default="b200", help="target GPU of the time model (default b200)")
    add_backend_option(
        t,
        "FlashInfer MoE backend (default: what --gpu runs: trtllm on Blackwell, cutlass on Hopper; "
        "cutlass has no TRTLLM-Gen tactics, its rows are every padding convert applies)",
    )
    t.add_argument(
        "--measure",
        action="store_true",
        help="also time each padded shape live on this CUDA GPU (torch._grouped_mm of the two expert GEMMs "
        "per token count; bf16, fp8 rowwise where torch has it): adds measured_us beside predicted_us",
    )
    add_engine_option(t)
    t.add_argument("--source", choices=SOURCES, default="auto", help=SOURCE_HELP)
    add_json_option(t, TUNE_JSON)
    t.add_argument("--csv", help="also write the table to this CSV file")
    t.add_argument("--json-out", help="also write the table (rows with predicted_us) and recommendation to JSON")
    t.add_argument("--plot", help="save the heatmap and waste-vs-tactics figures to this PNG prefix")
    t.add_argument(
        "--force",
        action="store_true",
        help="replace the --csv/--json-out/--plot files if they exist and tune wrote them (never any other file)",
    )
    t.set_defaults(handler=run_tune)


def _register_tactics(sub: argparse._SubParsersAction) -> None:
    formats = specs.tuner_formats()
    acts = ", ".join(
        "/".join((a.name,) + a.aliases) + f" ({'gated' if a.gated else 'non-gated'})"
        for a in specs.ACTIVATIONS.values()
    )
    q = sub.add_parser(
        "tactics",
        help="valid TRTLLM-Gen MoE tactics ([tile_N, config]) for one shape",
        description="Ask FlashInfer's trtllm_get_valid_moe_configs (live, or from the recorded snapshot) "
        "which tactics exist for one per-rank, already-padded MoE shape. A count of 0 is the "
        "'No valid config found' failure; the reason says why. Exits 3 when the source does "
        "not know a count (e.g. a shape outside the snapshot).",
        epilog="formats:\n" + "\n".join(f"{n}: {specs.FORMATS[n].description}" for n in formats),
    )
    add_format_option(q, "one of " + ", ".join(formats), formats, required=True)
    q.add_argument("--act", default="swiglu", type=_activation, help=f"activation: {acts} (default swiglu)")
    add_per_token_option(q, "the tactics of per-token activation scales")
    q.add_argument(
        "--layout",
        type=lower_choice(specs.LAYOUTS),
        default=None,
        help=f"weight layout (default per format: {_default_layouts(formats)})",
    )
    add_size_options(q, "intermediate size per expert and projection, per rank (padded)", required=True)
    add_option(
        q,
        "--local-experts",
        "--experts",
        type=positive_int("--local-experts"),
        required=True,
        metavar="E",
        help="experts on one rank (routed experts / EP size)",
    )
    q.add_argument("--top-k", type=int, required=True, help="experts per token")
    q.add_argument(
        "--tokens", type=TOKENS_TYPE, default=(1, 8, 64), help="comma-separated token counts (default 1,8,64)"
    )
    q.add_argument("--source", choices=SOURCES, default="auto", help=SOURCE_HELP)
    add_json_option(q, TACTICS_JSON, "list")
    q.add_argument("--configs", action="store_true", help="include the full [tile_N, config] list (live only)")
    q.set_defaults(handler=run_tactics)


def _default_layouts(formats: tuple[str, ...]) -> str:
    """``"major-k for fp8, ...; block-major-k for bf16, ..."``: each layout and the formats defaulting to it."""
    by_layout: dict[str, list[str]] = {layout: [] for layout in specs.LAYOUTS}
    for name in formats:
        enums = specs.FORMATS[name].tactics
        if enums is not None:
            by_layout[enums.default_layout].append(name)
    return "; ".join(f"{layout} for {', '.join(names)}" for layout, names in by_layout.items() if names)


def _no_answer(unknown: int, total: int, reasons: list) -> int:
    """Say on one stderr line that ``unknown`` of ``total`` counts have no answer here; exit status 3."""
    reason = next((r for r in reasons if isinstance(r, str) and r), "no reason given")
    print(
        one_line(f"no answer: {unknown} of {total} tactic counts are unknown to this source ({reason})"),
        file=sys.stderr,
    )
    return EXIT_NO_ANSWER


def run_tactics(a: argparse.Namespace) -> int:
    from fimoe_lab.tune.oracle import TacticOracle, TacticQuery

    oracle = TacticOracle(mode=a.source)
    try:
        answers = [
            oracle.ask(
                TacticQuery(
                    a.format, a.act, a.hidden, a.intermediate, a.local_experts, a.top_k, t, a.per_token, a.layout
                )
            )
            for t in a.tokens
        ]
    finally:
        oracle.close()
    out = []
    for ans in answers:
        d = ans.to_json()
        if a.configs and ans.configs is not None:
            d["configs"] = [list(c) for c in ans.configs]
        out.append(d)
    if a.json:
        print_json(out)
    else:
        for d in out:
            tiles = " ".join(f"{k}:{v}" for k, v in d["per_tile"].items())
            cnt = "unknown" if d["count"] is None else d["count"]
            print(
                f"T={d['tokens']:>6}  tactics={cnt:>5}  per tile_N {{{tiles}}}"
                + (f"  ({d['reason']})" if d.get("reason") else "")
            )
        s = out[0]["source"] if out else {}
        print(f"source: {s.get('kind')} (FlashInfer {s.get('flashinfer')}, kernel set {s.get('kernel_set')})")
    unknown = [d for d in out if d["count"] is None]
    if unknown:
        return _no_answer(len(unknown), len(out), [d.get("reason") for d in unknown])
    return EXIT_OK


def _model(a: argparse.Namespace):
    """The model to tune: a preset, a checkpoint, a config.json or explicit sizes (explicit ones override)."""
    from fimoe_lab.tune.models import model_from_checkpoint, model_from_config, model_from_sizes

    given = [x for x in (a.model, a.checkpoint, a.config) if x]
    if len(given) > 1:
        raise OracleError(
            "give one model: a preset, a sample, a checkpoint directory or a config.json (MODEL, --model or --config)",
            fix="drop the others",
        )
    sizes = {"hidden": a.hidden, "intermediate": a.intermediate, "experts": a.experts, "top_k": a.top_k}
    kind, where = model_source(given[0], PRESETS) if given else ("", "")
    if kind == "preset":
        base = get_preset(str(where))
    elif kind == "checkpoint":
        base = model_from_checkpoint(where, a.act)
    elif kind == "config":
        base = model_from_config(where, a.act)
    else:
        missing = [k for k, v in sizes.items() if v is None]
        if missing:
            raise OracleError(
                "no model: give --model PRESET, a checkpoint directory, --config config.json, or all of "
                f"--hidden --intermediate --experts --top-k (missing {', '.join('--' + m.replace('_', '-') for m in missing)})",
                fix="add the model",
            )
        return model_from_sizes(a.hidden, a.intermediate, a.experts, a.top_k, a.act or "swiglu")
    over = {k: v for k, v in sizes.items() if v is not None}
    if not over and not a.act:
        return base
    return model_from_sizes(
        over.get("hidden", base.hidden),
        over.get("intermediate", base.moe_intermediate),
        over.get("experts", base.experts),
        over.get("top_k", base.top_k),
        a.act or base.activation,
        base.name,
        base.checkpoint_formats,
    )


def _model_format(model) -> str:
    """The format to tune when ``--format`` is not given: the one tuner format among the model's checkpoint formats
    (a checkpoint's own; int4-group is laid out as mxint4), else one error asking for ``--format``."""
    from fimoe_lab.checkpoints.plan_choice import layout_format

    found = sorted({layout_format(f) for f in model.checkpoint_formats} & set(specs.tuner_formats()))
    if len(found) != 1:
        held = (
            f"its checkpoints hold {', '.join(model.checkpoint_formats)}"
            if model.checkpoint_formats
            else "no format known"
        )
        raise OracleError(
            f"no --format: {model.name}: {held}", fix=f"pass --format, one of {', '.join(specs.tuner_formats())}"
        )
    return found[0]


def run_tune(a: argparse.Namespace) -> int:
    from fimoe_lab.tune.oracle import TacticOracle
    from fimoe_lab.tune.sweep import TOKENS, export, run, summary, table

    p = _model(a)
    a.format = a.format or _model_format(p)
    files = _output_files(a)
    for path, kind in files:  # before any work: an existing file or a link is refused now
        check_file_output(path, kind, a.force)
    if a.measure:  # before any work: no GPU, one clear error and nothing estimated in its place
        from fimoe_lab.tune.timing import require_cuda

        require_cuda()
    if a.tp < 1:
        raise OracleError(f"--tp {a.tp} is not a tensor-parallel size", fix="pass --tp >= 1")
    tokens, weights = a.tokens or (TOKENS, None)
    oracle = None
    try:
        if a.backend != "cutlass" and (a.backend == "trtllm" or _gpu_runs_trtllm(a.gpu)):
            oracle = TacticOracle(mode=a.source)
        s = run(
            p,
            a.format,
            a.tp,
            oracle,
            per_token=a.per_token,
            tokens=tokens,
            weights=weights,
            gpu=a.gpu,
            progress=show_progress(),
            engine=a.engine,
            backend=a.backend,
        )
    finally:
        if oracle is not None:
            oracle.close()
    if a.measure:
        from fimoe_lab.tune.timing import measure_sweep

        measure_sweep(s, p)
    if a.json:
        print_json({"attrs": s.attrs, "rows": s.rows})
    else:
        if s.rows:
            print(table(s))
            print()
        print(summary(s))
    for path in (a.csv, a.json_out):
        if path:
            export(s, path, a.force)
    if a.plot:
        _save_plots(s, a.plot, a.force)
    unknown = [r.get("reason") for r in s.rows for c in s.tcols if r[c] is None]
    if unknown:
        return _no_answer(len(unknown), len(s.rows) * len(s.tcols), unknown)
    return EXIT_OK


def _gpu_runs_trtllm(gpu: str) -> bool:
    from fimoe_lab.tune.cost import get_gpu

    return get_gpu(gpu).trtllm_gen


PLOT_SUFFIXES = ("_heatmap.png", "_waste.png")
"""The files ``tune --plot PREFIX`` writes: PREFIX + each."""


def _output_files(a: argparse.Namespace) -> list[tuple[Path, str]]:
    """The files this run of ``tune`` writes, each with its kind (:data:`fimoe_lab.owned_files.KINDS`)."""
    files = []
    for path in (a.csv, a.json_out):
        if path:
            kind = next((k for k in ("csv", "json") if path.endswith("." + k)), None)
            if kind is None:
                raise OracleError(
                    f"export path {path!r} has neither a .csv nor a .json suffix", fix="name the file *.csv or *.json"
                )
            files.append((Path(path), kind))
    return files + [(Path(a.plot + suffix), "png") for suffix in PLOT_SUFFIXES if a.plot]


def _save_plots(s, prefix: str, force: bool) -> None:
    """``<prefix>_heatmap.png`` (tactics per padding and token count) and ``<prefix>_waste.png`` (needs pandas)."""
    try:
        from fimoe_lab.tune.sweep import to_frame
        from fimoe_lab.viz.figures import sweep_tactics_figure, sweep_waste_figure

        df = to_frame(s)
    except ImportError as e:
        raise OracleError(
            f"`tune --plot` needs pandas and matplotlib ({e})", fix="pip install 'fimoe_lab[tune]'"
        ) from None

    for draw, suffix in zip((sweep_tactics_figure, sweep_waste_figure), PLOT_SUFFIXES):
        buf = io.BytesIO()
        draw(df).savefig(buf, format="png", dpi=120, bbox_inches="tight")
        write_file_output(Path(prefix + suffix), buf.getvalue(), "png", force)
