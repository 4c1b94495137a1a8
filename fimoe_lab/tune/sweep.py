"""Alignment sweep: which padding is fastest, has tactics at every token count, and is one convert applies.

For a (model, format, TP) the sweep pads each rank's intermediate size ``I_r`` and the
hidden size ``H`` to each candidate alignment pair ``(a_I, a_H)`` (``INTER_ALIGNS x
HIDDEN_ALIGNS``, plus convert's default pair): ``I_r' = round_up(I_r, a_I)``,
``H' = round_up(H, a_H)``. The ranks' sizes are the checkpoint reader's shards
(:func:`fimoe_lab.shapes.rank_intermediates`: equal, or whole 32-value blocks with the
last ranks smaller for gpt-oss MXFP4). Per padding it asks the
:class:`~fimoe_lab.tune.oracle.TacticOracle` how many TRTLLM-Gen tactics each padded rank
shape has per token count (the padding's count is the least over its ranks), predicts
the layer's time on the target GPU (:mod:`fimoe_lab.tune.cost`; the slowest rank) and
checks with :func:`fimoe_lab.shapes.padded_shape` (the sizes ``plan_layer`` pads to) that
``convert`` applies it to every rank.

The recommendation is the candidate (a tactic at every token count) with the least
predicted time that convert accepts; ties go to fewer bytes. On the CUTLASS backend (what
Hopper runs; TRTLLM-Gen kernels are SM100-only) there are no tactic counts: every padding
convert accepts is a candidate, and the alignments CUTLASS needs are convert's CUTLASS
defaults (:func:`fimoe_lab.shapes.default_alignments`). A format without a CUTLASS layout
(``specs.FORMATS[f].backends``: MxInt4, Kimi-K2-Thinking's INT4 experts) is TRT-LLM only:
refused on Hopper; convert never pads it, so only rows at the shard's own size can be recommended.

:func:`run` needs neither torch nor pandas (the CLI answers in well under two seconds);
:func:`sweep` returns the same table as a pandas DataFrame (``attrs`` = the run's facts),
which :mod:`fimoe_lab.viz.figures` draws.

Why one module of this size: a sweep is one table (a row per padding) that is built, judged,
recommended from and rendered (text, DataFrame, CSV/JSON export) by the same column names; splitting the
judging from the rendering would put the column vocabulary in two places. The building blocks it needs
from elsewhere (shapes, the oracle, the cost model) already live in their own modules.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..engines import DEFAULT_ENGINE
from ..errors import FimoeError, OracleError
from ..presets import ModelPreset, get_preset
from ..shapes import default_alignments, padded_shape, rank_intermediates, round_up
from ..specs import FORMATS, get_activation
from .cost import GPUS, GpuSpec, get_gpu, layer_time_us, profile_time_us, transform_us
from .models import whole_block_shards
from .oracle import TacticAnswer, TacticOracle, TacticQuery, tactic_format

__all__ = [
    "INTER_ALIGNS",
    "HIDDEN_ALIGNS",
    "TOKENS",
    "TPS",
    "Padding",
    "Sweep",
    "reference_alignments",
    "rank_sizes",
    "paddings",
    "queries_for",
    "convert_check",
    "run",
    "sweep",
    "summary",
    "table",
    "export",
]

INTER_ALIGNS: tuple[int, ...] = (1, 16, 32, 64, 128, 256)  # 1 = unpadded
HIDDEN_ALIGNS: tuple[int, ...] = (1, 256, 512, 1024)
TOKENS: tuple[int, ...] = (1, 8, 64, 512, 4096, 16384)
TPS: tuple[int, ...] = (1, 2, 4, 8)
SM100_TIMING = "per-tactic TRTLLM-Gen timing needs a Blackwell (SM100-family) GPU; predicted_us is a model estimate"


def _plan_format(fmt: str) -> str:
    return FORMATS[fmt].plan_format


def reference_alignments(
    preset: ModelPreset,
    fmt: str,
    per_token: bool = False,
    engine: Optional[str] = None,
    backend: str = "trtllm",
) -> tuple[int, int]:
    """``(intermediate, hidden)`` alignments ``fimoe-lab convert`` pads ``preset`` to in ``fmt``.

    :func:`fimoe_lab.shapes.default_alignments` (the function ``plan_layer`` uses) of the
    format's layout recipe (``mxfp4-mxfp8`` -> ``mxfp4``) on ``backend`` for the preset's
    activation and quantization method (``preset.quant_method``: engine rules keyed on it).
    """
    tactic_format(fmt)
    act = get_activation(preset.activation)
    return default_alignments(
        _plan_format(fmt),
        backend,
        act.is_act_and_mul,
        act.gated,
        engine=engine,
        per_token_activation=per_token,
        quant_method=preset.quant_method,
    )


def rank_sizes(preset: ModelPreset, fmt: str, tp: int) -> tuple[int, ...]:
    """Each rank's unpadded intermediate size: :func:`fimoe_lab.shapes.rank_intermediates` of
    the preset in ``fmt``'s weight format, whole-block shards where its checkpoint loader
    shards so (:func:`fimoe_lab.tune.models.whole_block_shards`)."""
    fmt = _plan_format(fmt)
    return rank_intermediates(preset.moe_intermediate, tp, fmt, whole_block_shards(preset, fmt))


@dataclass(frozen=True)
class Padding:
    """One padding choice for one (model, TP): per-rank sizes before and after.

    ``intermediates``/``padded_intermediates``: the distinct rank sizes (rank 0 first;
    two when whole-block shards leave the last ranks smaller); ``ranks``: how many ranks
    have each.
    """

    inter_align: int
    hidden_align: int
    intermediates: tuple[int, ...]
    ranks: tuple[int, ...]
    hidden: int
    padded_intermediates: tuple[int, ...]
    padded_hidden: int

    @property
    def intermediate(self) -> int:
        return self.intermediates[0]

    @property
    def padded_intermediate(self) -> int:
        return self.padded_intermediates[0]

    @property
    def element_ratio(self) -> float:
        """Padded / unpadded weight elements over all ranks (the same for W13 and W2)."""
        before = sum(n * i for n, i in zip(self.ranks, self.intermediates)) * self.hidden
        after = sum(n * i for n, i in zip(self.ranks, self.padded_intermediates)) * self.padded_hidden
        return after / before


def paddings(
    preset: ModelPreset,
    tp: int,
    inter_aligns: Sequence[int] = INTER_ALIGNS,
    hidden_aligns: Sequence[int] = HIDDEN_ALIGNS,
    fmt: str = "bf16",
    per_token: bool = False,
    engine: Optional[str] = None,
    backend: str = "trtllm",
) -> list[Padding]:
    """Every (intermediate alignment, hidden alignment) choice for ``preset`` at ``tp``.

    :func:`reference_alignments` is one of them (appended when the grid lacks it, e.g.
    bf16's hidden alignment 64). Raises :class:`FimoeError` when ``tp`` cannot shard it.
    """
    sizes = rank_sizes(preset, fmt, tp)
    distinct = tuple(dict.fromkeys(sizes))
    ranks = tuple(sizes.count(i) for i in distinct)
    pairs = [(ia, ha) for ia in inter_aligns for ha in hidden_aligns]
    reference = reference_alignments(preset, fmt, per_token, engine, backend)
    if reference not in pairs:
        pairs.append(reference)
    return [
        Padding(
            ia,
            ha,
            distinct,
            ranks,
            preset.hidden,
            tuple(round_up(i, ia) for i in distinct),
            round_up(preset.hidden, ha),
        )
        for ia, ha in pairs
    ]


def _query(
    preset: ModelPreset, fmt: str, inter: int, hidden: int, tokens: int, per_token: bool, layout: Optional[str]
) -> TacticQuery:
    return TacticQuery(
        fmt, preset.activation, hidden, inter, preset.experts, preset.top_k, tokens, per_token, layout
    ).normalized()


def queries_for(
    preset: ModelPreset,
    fmt: str,
    tp: int,
    per_token: bool = False,
    layout: Optional[str] = None,
    tokens: Sequence[int] = TOKENS,
    inter_aligns: Sequence[int] = INTER_ALIGNS,
    hidden_aligns: Sequence[int] = HIDDEN_ALIGNS,
    engine: Optional[str] = None,
) -> list[TacticQuery]:
    """The oracle queries a sweep of (preset, fmt, tp) needs (every rank shape; deduplicated, normalized)."""
    seen, out = set(), []
    for p in paddings(preset, tp, inter_aligns, hidden_aligns, fmt, per_token, engine):
        for inter in p.padded_intermediates:
            for t in tokens:
                q = _query(preset, fmt, inter, p.padded_hidden, t, per_token, layout)
                if q.key() not in seen:
                    seen.add(q.key())
                    out.append(q)
    return out


def convert_check(
    preset: ModelPreset,
    fmt: str,
    tp: int,
    inter_align: int,
    hidden_align: int,
    engine: Optional[str] = None,
    backend: str = "trtllm",
    per_token: bool = False,
) -> Optional[str]:
    """None when ``convert`` applies this padding to every rank of ``tp``, else why not.

    The rank shards of :func:`rank_sizes` and, per distinct rank size, the sizes
    :func:`fimoe_lab.shapes.padded_shape` (``plan_layer``'s rule) pads to must be
    ``round_up(I_r, inter_align) x round_up(H, hidden_align)``. Convert's default pair is
    checked without alignment options (what ``convert`` does when given none).
    """
    act = get_activation(preset.activation)
    try:
        sizes = dict.fromkeys(rank_sizes(preset, fmt, tp))
    except FimoeError as exc:
        return exc.message
    is_default = (inter_align, hidden_align) == reference_alignments(preset, fmt, per_token, engine, backend)
    for inter in sizes:
        try:
            got = padded_shape(
                _plan_format(fmt),
                backend,
                inter,
                preset.hidden,
                act.is_act_and_mul,
                act.gated,
                activation=act.name,
                quant_method=preset.quant_method,
                intermediate_alignment=None if is_default else inter_align,  # convert without alignment options
                hidden_alignment=None if is_default else hidden_align,
                engine=engine,
                per_token_activation=per_token,
            )
        except FimoeError as exc:
            return exc.message
        want = (round_up(inter, inter_align), round_up(preset.hidden, hidden_align))
        if got != want:
            return f"convert pads intermediate x hidden {inter} x {preset.hidden} to {got}, not {want}"
    return None


def tp_alternatives(
    preset: ModelPreset,
    fmt: str,
    tp: int,
    per_token: bool = False,
    engine: Optional[str] = None,
    backend: str = "trtllm",
) -> list[str]:
    """What works instead of a TP size whose shard ``convert`` refuses: other TP sizes, expert parallelism."""
    ref = reference_alignments(preset, fmt, per_token, engine, backend)
    ok_tps = [
        t
        for t in (1, 2, 4, 8, 16)
        if t != tp and convert_check(preset, fmt, t, *ref, engine, backend, per_token) is None
    ]
    out = [f"--tp {' or '.join(map(str, ok_tps))} (shards convert accepts)"] if ok_tps else []
    if preset.experts % tp == 0 and convert_check(preset, fmt, 1, *ref, engine, backend, per_token) is None:
        out.append(
            f"expert parallelism over {tp} ranks ({preset.experts // tp} whole experts each, intermediate "
            f"{preset.moe_intermediate} unsplit: tune with --tp 1 --experts {preset.experts // tp})"
        )
    return out


@dataclass
class Sweep:
    """A sweep's table: ``rows`` (one dict per padding, the columns of :func:`sweep`) and ``attrs``."""

    rows: list[dict[str, Any]]
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def tcols(self) -> list[str]:
        return [f"t{t}" for t in self.attrs["tokens"]] if self.attrs.get("backend") == "trtllm" else []


def _counts(answers: Sequence[Sequence[TacticAnswer]]) -> list[Optional[int]]:
    """Per token count, the least tactic count over the ranks (None when any is unknown)."""
    out: list[Optional[int]] = []
    for per_rank in zip(*answers):
        known = [a.count for a in per_rank if a.count is not None]
        out.append(min(known) if len(known) == len(per_rank) else None)
    return out


def _row(
    pad: Padding,
    model: ModelPreset,
    fmt: str,
    tokens: Sequence[int],
    weights: Sequence[float],
    gpu: GpuSpec,
    answers: Optional[list[list[TacticAnswer]]],
    reference: tuple[int, int],
) -> dict[str, Any]:
    """One table row: padded sizes, tactic counts per T (TRT-LLM), waste, predicted time (slowest rank)."""
    row: dict[str, Any] = {
        "inter_align": pad.inter_align,
        "hidden_align": pad.hidden_align,
        "intermediate": pad.padded_intermediate,
        "intermediate_last": pad.padded_intermediates[-1],
        "hidden": pad.padded_hidden,
    }
    times, transform = [], []
    for r, inter in enumerate(pad.padded_intermediates):
        tiles = (
            [[k for k, c in a.per_tile.items() if c] for a in answers[r]]
            if answers is not None
            else [None] * len(tokens)
        )
        per_t = [
            layer_time_us(gpu, fmt, model.activation, inter, pad.padded_hidden, model.experts, model.top_k, t, tl)
            for t, tl in zip(tokens, tiles)
        ]
        times.append(profile_time_us(per_t, weights))
        transform.append(transform_us(gpu, fmt, model.activation, inter, pad.padded_hidden, model.experts))
    if answers is not None:
        row.update({f"t{t}": c for t, c in zip(tokens, _counts(answers))})
        got = [a for per_rank in answers for a in per_rank]
        row["reason"] = next((a.reason for a in got if a.reason), None)
        row["source"] = next(((a.source or {}).get("kind") for a in got if a.source), None)
    else:
        row["reason"], row["source"] = None, None
    matrices = get_activation(model.activation).projections + 1  # W13 (P x I x H) + W2 (H x I)
    per_element = model.experts * matrices * FORMATS[fmt].bits_per_weight / 8 / 1e6
    row["extra_bytes_pct"] = row["extra_flops_pct"] = 100.0 * (pad.element_ratio - 1.0)
    row["extra_mbytes"] = (pad.padded_intermediate * pad.padded_hidden - pad.intermediate * pad.hidden) * per_element
    row["predicted_us"] = None if any(t is None for t in times) else max(times)  # type: ignore[type-var]
    row["transform_us"] = max(transform)
    row["reference"] = (pad.inter_align, pad.hidden_align) == reference
    return row


def _min_tactics(row: dict[str, Any], tcols: Sequence[str]) -> Optional[int]:
    counts = [row[c] for c in tcols]
    return None if not counts or any(c is None for c in counts) else min(counts)


def _judge(rows: list[dict[str, Any]], tcols: Sequence[str], check: Callable[[int, int], Optional[str]]) -> None:
    """Add ``min_tactics, full, candidate, convert, recommended, pareto``.

    Candidates have a tactic at every T (TRT-LLM; every padding on CUTLASS) and so a
    predicted time. Recommended: the candidate with the least ``predicted_us`` that
    ``check(inter_align, hidden_align)`` accepts; ties go to fewer extra bytes, more
    tactics, convert's default, smaller alignments. None when no candidate is accepted.
    """
    best = {c: max((r[c] for r in rows if r[c] is not None), default=None) for c in tcols}
    for r in rows:
        r["min_tactics"] = _min_tactics(r, tcols)
        r["full"] = bool(tcols) and all(r[c] is not None and r[c] == best[c] for c in tcols)
        r["candidate"] = r["predicted_us"] is not None and all(r[c] is not None and r[c] > 0 for c in tcols)
        r["convert"] = ""
        r["recommended"] = False
    order = sorted(
        (r for r in rows if r["candidate"]),
        key=lambda r: (
            r["predicted_us"],
            r["extra_bytes_pct"],
            -(r["min_tactics"] or 0),
            not r["reference"],
            r["inter_align"],
            r["hidden_align"],
        ),
    )
    for r in order:
        why = check(r["inter_align"], r["hidden_align"])
        r["convert"] = "ok" if why is None else why
        if why is None:
            r["recommended"] = True
            break
    _pareto(rows)


def _pareto(rows: list[dict[str, Any]]) -> None:
    """``pareto``: on the (extra bytes, predicted time, tactic count) frontier, one row per padded shape."""
    cand = sorted(
        (r for r in rows if r["candidate"]),
        key=lambda r: (
            r["predicted_us"],
            not r["recommended"],
            not r["reference"],
            r["inter_align"],
            r["hidden_align"],
        ),
    )
    shapes, unique = set(), []
    for r in cand:
        key = (r["intermediate"], r["intermediate_last"], r["hidden"])
        if key not in shapes:
            shapes.add(key)
            unique.append(r)

    def score(r: dict[str, Any]) -> tuple[float, float, int]:
        return r["extra_bytes_pct"], r["predicted_us"], -(r["min_tactics"] or 0)

    for r in rows:
        r["pareto"] = False
    for r in unique:
        s = score(r)
        r["pareto"] = not any(all(a <= b for a, b in zip(score(o), s)) and score(o) != s for o in unique)


def _flag(r: dict[str, Any], tcols: Sequence[str], tokens: Sequence[int]) -> str:
    """Why the reference row loses tactics ('' when it does not, or for other rows)."""
    if not r["reference"] or not tcols:
        return ""
    zero = [t for t, c in zip(tokens, tcols) if r[c] == 0]
    if zero:
        return f"ZERO tactics at T={zero}"
    return "" if r["full"] else "fewer tactics than the best padding"


def _recommendation(r: dict[str, Any]) -> dict[str, Any]:
    keys = ("inter_align", "hidden_align", "intermediate", "intermediate_last", "hidden", "full", "min_tactics")
    return {**{k: r[k] for k in keys}, "extra_bytes_pct": r["extra_bytes_pct"], "predicted_us": r["predicted_us"]}


def _minimal(rows: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The cheapest padding that still has at least one tactic at every T (may be < full)."""
    ok = sorted(
        (r for r in rows if r["candidate"]),
        key=lambda r: (r["extra_bytes_pct"], -(r["min_tactics"] or 0), r["inter_align"], r["hidden_align"]),
    )
    if not ok:
        return None
    m = ok[0]
    return {
        k: m[k] for k in ("inter_align", "hidden_align", "intermediate", "hidden", "min_tactics", "extra_bytes_pct")
    }


def _no_recommendation(
    rows: list[dict[str, Any]], tcols: Sequence[str], tokens: Sequence[int], split: Optional[str]
) -> str:
    """Why there is no recommendation (the shard splits a scale block, no padding has tactics, ...)."""
    if split:
        return f"convert refuses this TP shard: {split}"
    any_candidate = any(r["candidate"] for r in rows)
    if not any_candidate and any(r[c] is None for r in rows for c in tcols):
        return "tactic counts are unknown to this source for some token counts (see reason)"
    if not any_candidate:
        zero = [t for t, c in zip(tokens, tcols) if all((r[c] or 0) == 0 for r in rows)]
        return f"no padding in the grid has a tactic at every token count (none at all at T={zero})"
    refused = [r["convert"] for r in rows if r["convert"] not in ("", "ok")]
    return "convert refuses every padding with tactics at every T" + (f" ({refused[0]})" if refused else "")


def _why(rows: list[dict[str, Any]]) -> str:
    """One line: why the winner wins (its predicted time vs convert's default and vs the most tactics)."""
    win = next((r for r in rows if r["recommended"]), None)
    if win is None:
        return ""
    parts = [f"least predicted time over the token profile ({win['predicted_us']:.1f} us)"]
    most = sorted(
        (r for r in rows if r["candidate"] and r["min_tactics"] is not None),
        key=lambda r: (-r["min_tactics"], r["predicted_us"]),
    )
    for label, others in (("convert's default", [r for r in rows if r["reference"]]), ("the most tactics", most)):
        if not others or others[0] is win:
            continue
        r = others[0]
        if r["predicted_us"] is None:
            parts.append(f"{label} (I {r['intermediate']}, H {r['hidden']}) lacks a tactic at some T")
        elif (r["intermediate"], r["hidden"]) != (win["intermediate"], win["hidden"]):
            tactics = f", {r['min_tactics']} tactics" if r["min_tactics"] is not None else ""
            parts.append(
                f"{label} (I {r['intermediate']}, H {r['hidden']}{tactics}, +{r['extra_bytes_pct']:.1f}% bytes) "
                f"predicts {r['predicted_us']:.1f} us ({100 * (r['predicted_us'] / win['predicted_us'] - 1):+.0f}%)"
            )
    return "; ".join(parts)


def _backend(gpu: GpuSpec, backend: Optional[str], fmt: str) -> str:
    """``backend``, or the one ``gpu`` runs (TRT-LLM on SM100-family GPUs, else CUTLASS); refused where
    ``fmt`` has no layout for it (``specs.FORMATS[fmt].backends``: MxInt4 is TRT-LLM only)."""
    blackwell = ", ".join(n for n, g in GPUS.items() if g.trtllm_gen)
    if backend is None:
        backend = "trtllm" if gpu.trtllm_gen else "cutlass"
        if backend not in FORMATS[fmt].backends:
            raise OracleError(
                f"{fmt} runs on TRT-LLM only (TRTLLM-Gen kernels, SM100 family); {gpu.name} (SM{gpu.sm}) runs CUTLASS",
                fix=f"pick a Blackwell --gpu ({blackwell})",
            )
    if backend == "trtllm" and not gpu.trtllm_gen:
        raise OracleError(
            f"TRTLLM-Gen MoE kernels run only on SM100-family GPUs, not on {gpu.name} (SM{gpu.sm})",
            fix="use --backend cutlass (what Hopper runs) or a Blackwell --gpu",
        )
    if backend not in ("trtllm", "cutlass"):
        raise OracleError(f"unknown backend {backend!r}", fix="choose trtllm or cutlass")
    if backend not in FORMATS[fmt].backends:
        raise OracleError(
            f"{fmt} has no {backend} layout (backends: {', '.join(FORMATS[fmt].backends)})",
            fix=f"use --backend {' or '.join(FORMATS[fmt].backends)}",
        )
    return backend


def run(
    preset: str | ModelPreset,
    fmt: str,
    tp: int,
    oracle: Optional[TacticOracle] = None,
    per_token: bool = False,
    layout: Optional[str] = None,
    tokens: Sequence[int] = TOKENS,
    inter_aligns: Sequence[int] = INTER_ALIGNS,
    hidden_aligns: Sequence[int] = HIDDEN_ALIGNS,
    progress: bool = False,
    weights: Optional[Sequence[float]] = None,
    gpu: str = "b200",
    engine: Optional[str] = None,
    backend: Optional[str] = None,
) -> Sweep:
    """The sweep without torch or pandas: a :class:`Sweep` (rows and attrs as :func:`sweep` documents).

    ``backend``: None picks what ``gpu`` runs (TRT-LLM on Blackwell, CUTLASS on Hopper), refused
    (:class:`OracleError`) where ``fmt`` has no layout for it (MxInt4 is TRT-LLM only);
    the oracle is asked only on TRT-LLM (an oracle is made when none is given).
    """
    p = get_preset(preset) if isinstance(preset, str) else preset
    fmt = fmt.strip().lower()
    tactic_format(fmt)
    g = get_gpu(gpu)
    be = _backend(g, backend, fmt)
    weights = list(weights) if weights is not None else [1.0] * len(tokens)
    if len(weights) != len(tokens) or min(weights) < 0 or sum(weights) <= 0:
        raise FimoeError(
            f"token weights {weights} do not fit tokens {list(tokens)}", fix="one weight >= 0 per token count"
        )
    ref = reference_alignments(p, fmt, per_token, engine, be)
    pads: list[Padding] = []
    try:
        pads = paddings(p, tp, inter_aligns, hidden_aligns, fmt, per_token, engine, be)
    except FimoeError as exc:  # the reader cannot shard it: no rank shapes to tabulate
        split: Optional[str] = exc.message
    else:
        split = convert_check(p, fmt, tp, *ref, engine, be, per_token)
    source: dict[str, Any] = {"kind": "none", "note": "CUTLASS has no TRTLLM-Gen tactics"}
    answers: dict[str, TacticAnswer] = {}
    if be == "trtllm" and pads:
        oracle = oracle or TacticOracle()
        qs = queries_for(p, fmt, tp, per_token, layout, tokens, inter_aligns, hidden_aligns, engine)
        answers = {q.key(): a for q, a in zip(qs, oracle.ask_many(qs, progress=progress))}
        source = oracle.source()
    rows = []
    for pad in pads:
        got = (
            [
                [answers[_query(p, fmt, i, pad.padded_hidden, t, per_token, layout).key()] for t in tokens]
                for i in pad.padded_intermediates
            ]
            if be == "trtllm"
            else None
        )
        rows.append(_row(pad, p, fmt, tokens, weights, g, got, ref))
    out = Sweep(rows, {"tokens": list(tokens), "backend": be})
    tcols = out.tcols
    _judge(
        rows,
        tcols,
        (lambda ia, ha: split) if split else (lambda ia, ha: convert_check(p, fmt, tp, ia, ha, engine, be, per_token)),
    )
    for r in rows:
        r["flag"] = _flag(r, tcols, tokens)
    rec = next((r for r in rows if r["recommended"]), None)
    sizes = pads[0].intermediates if pads else ()
    out.attrs.update(
        preset=p.name,
        format=fmt,
        tp=tp,
        per_token=per_token,
        weights=weights,
        gpu=g.name,
        rank_intermediates=list(rank_sizes(p, fmt, tp)) if pads else [],
        intermediate=sizes[0] if sizes else p.moe_intermediate,
        hidden=p.hidden,
        recommendation=_recommendation(rec) if rec else None,
        no_recommendation=None if rec else _no_recommendation(rows, tcols, tokens, split),
        alternatives=tp_alternatives(p, fmt, tp, per_token, engine, be)
        if split
        else _cutlass_alternative(p, fmt, tp, per_token, engine)
        if be == "trtllm" and not per_token and not any(r["candidate"] for r in rows)
        else [],
        engine=engine or DEFAULT_ENGINE,
        why=_why(rows),
        minimal=_minimal(rows),
        reference={"inter_align": ref[0], "hidden_align": ref[1]},
        cutlass_alignments=_cutlass_needs(p, fmt, per_token, engine),
        source=source,
        estimate="predicted_us and transform_us are model estimates (fimoe_lab.tune.cost), not measurements",
        sm100_timing=SM100_TIMING,
    )
    return out


def _cutlass_alternative(p: ModelPreset, fmt: str, tp: int, per_token: bool, engine: Optional[str]) -> list[str]:
    """The CUTLASS backend, when no padding has TRTLLM-Gen tactics at every T and convert lays it out for
    CUTLASS (not offered for per-token NVFP4 activations, a TRTLLM-Gen mode, nor for a TRT-LLM-only format)."""
    if "cutlass" not in FORMATS[fmt].backends:
        return []
    ia, ha = reference_alignments(p, fmt, per_token, engine, "cutlass")
    if convert_check(p, fmt, tp, ia, ha, engine, "cutlass", per_token) is not None:
        return []
    return [f"--backend cutlass (no TRTLLM-Gen tactics needed; convert pads {multiples(ia, ha)})"]


def multiples(inter_align: int, hidden_align: int) -> str:
    """The alignments as words: ``intermediate to a multiple of 128, hidden to 256``; an alignment of 1 (no
    constraint) left out; ``no padding`` when both are 1."""
    parts = [
        f"{what} to a multiple of {a}" for what, a in (("intermediate", inter_align), ("hidden", hidden_align)) if a > 1
    ]
    return ", ".join(parts) or "no padding"


def _cutlass_needs(p: ModelPreset, fmt: str, per_token: bool, engine: Optional[str]) -> dict[str, int]:
    """The intermediate and hidden multiples CUTLASS needs: convert's CUTLASS default (one table); empty
    for a format without a CUTLASS layout (MxInt4)."""
    if "cutlass" not in FORMATS[fmt].backends:
        return {}
    ia, ha = reference_alignments(p, fmt, per_token, engine, "cutlass")
    return {"inter_align": ia, "hidden_align": ha}


def sweep(*args: Any, **kwargs: Any) -> Any:  # a pandas DataFrame (pandas is optional)
    """Tactic counts, predicted time and padding waste for every alignment choice of (preset, fmt, tp).

    The arguments of :func:`run`. Returns a pandas DataFrame, one row per
    (inter_align, hidden_align) of :func:`paddings`, with columns ``inter_align,
    hidden_align, intermediate, intermediate_last, hidden`` (padded, per rank: rank 0's
    and the last rank's intermediate), ``t<T>`` (TRT-LLM: the least tactic count over
    the ranks at T tokens; NA when unknown), ``min_tactics``, ``full`` (count equals the
    best of all rows at every T), ``extra_bytes_pct``, ``extra_flops_pct`` (all ranks),
    ``extra_mbytes`` (rank 0's layer, all local experts), ``predicted_us`` (estimated
    time over the token profile ``tokens`` weighted by ``weights`` on ``gpu``, the slowest
    rank, :mod:`fimoe_lab.tune.cost`; NaN without a tactic at some T), ``transform_us``
    (one-time conversion estimate), ``candidate``, ``convert`` ("ok", why convert refuses
    it, or "" when not checked), ``pareto``, ``reference`` (the padding ``convert``
    applies, :func:`reference_alignments`), ``recommended`` (the fastest candidate convert
    accepts; none when the shard splits a scale block or no padding has a tactic at every
    T: ``attrs["no_recommendation"]`` says why and ``attrs["alternatives"]`` what works),
    ``flag``, ``reason``, ``source``.
    """
    return to_frame(run(*args, **kwargs))


def to_frame(s: Sweep) -> Any:  # a pandas DataFrame
    """The :class:`Sweep` as a pandas DataFrame (tactic columns nullable ``Int64``, ``attrs`` copied)."""
    import pandas as pd

    df = pd.DataFrame(s.rows)
    for c in s.tcols + ["min_tactics"]:
        if c in df:
            df[c] = df[c].astype("Int64")
    for c in ("predicted_us", "transform_us"):
        if c in df:
            df[c] = df[c].astype(float)
    df.attrs.update(s.attrs)
    return df


def _as_sweep(s: Any) -> Sweep:
    """A :class:`Sweep` from itself or from a DataFrame :func:`sweep` made."""
    if isinstance(s, Sweep):
        return s
    rows = [
        {k: (None if v is None or v != v else v) for k, v in r.items()} for r in s.astype(object).to_dict("records")
    ]
    return Sweep(rows, dict(s.attrs))


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def shape_groups(rows: Sequence[dict]) -> list[list[dict]]:
    """``rows`` grouped by padded shape (``intermediate``, ``intermediate_last``, ``hidden``), in order of first
    appearance. A padded I depends on the intermediate alignment alone and H on the hidden one, so a group is every
    pair of its intermediate alignments and its hidden alignments, with the same tactics and time."""
    groups: dict[tuple[Any, ...], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["intermediate"], r["intermediate_last"], r["hidden"]), []).append(r)
    return list(groups.values())


def _merged(group: list[dict]) -> dict:
    """One table row for a :func:`shape_groups` group: its first row, the alignments that give it listed
    (``1,16,32``), each mark set when any pair has it, the distinct flags joined."""
    row = dict(group[0])
    for k in ("inter_align", "hidden_align"):
        row[k] = ",".join(str(v) for v in sorted({r[k] for r in group}))
    for k in ("pareto", "reference", "recommended"):
        row[k] = any(r[k] for r in group)
    row["flag"] = "; ".join(dict.fromkeys(r["flag"] for r in group if r["flag"]))
    return row


def table(s: Any) -> str:
    """The sweep's rows as fixed-width text, one line per distinct padded shape with the alignments that give it
    (:func:`shape_groups`; ``P`` Pareto, ``REF`` convert's default, ``<==`` recommended)."""
    s = _as_sweep(s)
    s = Sweep([_merged(g) for g in shape_groups(s.rows)], s.attrs)
    cols = ["inter_align", "hidden_align", "intermediate"]
    if any(r["intermediate_last"] != r["intermediate"] for r in s.rows):
        cols.append("intermediate_last")
    measured = ["measured_us"] if s.attrs.get("measured") else []
    cols += ["hidden"] + s.tcols + ["extra_bytes_pct", "predicted_us"] + measured
    cols += ["pareto", "reference", "recommended", "flag"]
    marks = {"pareto": "P", "reference": "REF", "recommended": "<=="}
    cells = [
        [
            marks[c] if c in marks and r[c] else "" if c in marks else _fmt(r[c], 2 if c == "extra_bytes_pct" else 1)
            for c in cols
        ]
        for r in s.rows
    ]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths)).rstrip()]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)


def summary(s: Any) -> str:
    """A short text recommendation for a :func:`run` or :func:`sweep` result."""
    s = _as_sweep(s)
    a, rows = s.attrs, s.rows
    rec, ref, minimal = a["recommendation"], a["reference"], a.get("minimal")
    ranks = a.get("rank_intermediates") or []
    shard = (
        f"per-rank intermediate {ranks[0]}" + (f" (last ranks {ranks[-1]})" if ranks and ranks[-1] != ranks[0] else "")
        if ranks
        else f"intermediate {a['intermediate']}"
    )
    profile = ", ".join(
        f"T={t}" + (f" x{w:g}" if len(set(a["weights"])) > 1 else "") for t, w in zip(a["tokens"], a["weights"])
    )
    if a.get("measured"):
        timed = [r for r in rows if r.get("measured_us") is not None]
        best = min(timed, key=lambda r: r["measured_us"]) if timed else None
        measured = f"measured: {a['measured']}" + (
            f"; fastest measured I {best['intermediate']} H {best['hidden']} ({best['measured_us']:.1f} us)"
            if best
            else ""
        )
    lines = [
        f"{a['preset']} {a['format']}{' per-token' if a['per_token'] else ''} TP={a['tp']} on "
        f"{'TRT-LLM' if a['backend'] == 'trtllm' else 'CUTLASS'}: {shard}, hidden {a['hidden']}; predicted for "
        f"{a['gpu'].upper()} over {profile} (estimates, not measurements)",
    ]
    if rec is None:
        lines.append(f"recommended: none -- {a['no_recommendation']}")
        lines += [f"  alternative: {alt}" for alt in a.get("alternatives") or []]
    else:
        last = f" (last ranks {rec['intermediate_last']})" if rec["intermediate_last"] != rec["intermediate"] else ""
        tactics = f", min {rec['min_tactics']} tactics" if rec["min_tactics"] is not None else ""
        lines.append(
            f"recommended: intermediate -> {rec['intermediate']}{last} (align {rec['inter_align']}), "
            f"hidden -> {rec['hidden']} (align {rec['hidden_align']}), +{rec['extra_bytes_pct']:.2f}% weights"
            f"{tactics}, predicted {rec['predicted_us']:.1f} us"
        )
        lines.append(f"why: {a['why']}")
    front = sorted((r for r in rows if r["pareto"]), key=lambda r: r["extra_bytes_pct"])
    if front:
        lines.append(
            "Pareto frontier (extra bytes, predicted us, min tactics): "
            + "; ".join(
                f"I {r['intermediate']} H {r['hidden']}: +{r['extra_bytes_pct']:.1f}%, {r['predicted_us']:.1f} us, "
                f"{_fmt(r['min_tactics'])}"
                for r in front
            )
        )
    if a["backend"] == "trtllm" and rows:
        lines.append(
            "cheapest padding with a tactic at every T: "
            + (
                f"intermediate -> {minimal['intermediate']}, hidden -> {minimal['hidden']}, "
                f"+{minimal['extra_bytes_pct']:.2f}% weights, min {minimal['min_tactics']} tactics"
                if minimal
                else "none (no padding in the grid has a tactic at every T)"
            )
        )
    refrow = next((r for r in rows if r["reference"]), None)
    if refrow is not None:
        lines.append(
            f"convert's default padding ({multiples(ref['inter_align'], ref['hidden_align'])}): intermediate "
            f"{refrow['intermediate']}, hidden {refrow['hidden']}"
            + (f", min tactics {_fmt(refrow['min_tactics'])}" if a["backend"] == "trtllm" else "")
            + (f"  <-- {refrow['flag']}" if refrow["flag"] else "  (full tactic space)" if refrow["full"] else "")
        )
    cut = a.get("cutlass_alignments")
    if cut:
        need = multiples(cut["inter_align"], cut["hidden_align"])
        lines.append(
            f"CUTLASS (Hopper SM90 and Blackwell) needs {need} (convert's CUTLASS padding); "
            f"--measure times the paddings live on a CUDA GPU"
        )
    if a.get("measured"):
        lines.append(measured)
    src = a.get("source") or {}
    if a["backend"] == "trtllm" and rows:
        lines.append(
            f"source: {src.get('kind')} (FlashInfer {src.get('flashinfer')}, kernel set {src.get('kernel_set')}); "
            f"{a['sm100_timing']}"
        )
    return "\n".join(lines)


def export(s: Any, path: str, force: bool = False) -> None:
    """Write a sweep (:func:`run` or :func:`sweep`) to ``.csv`` or ``.json`` (rows with ``predicted_us``, plus
    attrs; the JSON's first key ``generator``). Through :func:`fimoe_lab.owned_files.write_file_output`: an
    existing file is replaced only with ``force`` and only if ``tune`` wrote it; never through a link."""
    from fimoe_lab.owned_files import write_file_output

    sw = _as_sweep(s)
    if path.endswith(".csv"):
        keys = list(sw.rows[0]) if sw.rows else ["inter_align", "hidden_align"]
        text = io.StringIO(newline="")
        w = csv.DictWriter(text, fieldnames=keys)
        w.writeheader()
        w.writerows(sw.rows)
        write_file_output(Path(path), text.getvalue().encode(), "csv", force)
    elif path.endswith(".json"):
        doc = {"generator": "fimoe-lab tune", "attrs": sw.attrs, "rows": sw.rows}
        write_file_output(Path(path), json.dumps(doc, indent=1, default=str).encode(), "json", force)
    else:
        raise FimoeError(
            f"export path {path!r} has neither a .csv nor a .json suffix", fix="name the file *.csv or *.json"
        )
