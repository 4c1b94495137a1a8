"""Alignment sweep: which padding gives the whole tactic space at the least waste.

For a (preset, format, TP) the sweep pads the per-rank intermediate size ``I`` and the
hidden size ``H`` to each candidate alignment pair ``(a_I, a_H)`` (``INTER_ALIGNS x
HIDDEN_ALIGNS``, plus the reference pair when the grid lacks it): ``I' = round_up(I, a_I)``,
``H' = round_up(H, a_H)``. It asks the :class:`~fimoe_lab.tune.oracle.TacticOracle` how
many tactics each padded shape ``(H', I')`` has per token count, computes what the padding
costs (``I'H' / IH - 1`` extra weight bytes and FLOPs), and recommends the cheapest padding
that keeps every tactic available.

The reference row is the padding ``fimoe-lab convert`` applies: exactly
:func:`fimoe_lab.recipes.default_alignments` of the format's layout recipe on TRT-LLM,
for the preset's activation. It is shown side by side and flagged where it loses tactics.

pandas is needed for :func:`sweep`; :mod:`fimoe_lab.viz.figures` draws its result
(``tuner_figure``, ``sweep_tactics_figure``, ``sweep_waste_figure``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from ..engines import DEFAULT_ENGINE
from ..errors import FimoeError
from ..presets import ModelPreset, get_preset
from ..recipes import default_alignments, plan_layer
from ..specs import FORMATS, get_activation
from ..steps import round_up
from .cost import GpuSpec, get_gpu, layer_time_us, profile_time_us, transform_us
from .oracle import TacticOracle, TacticQuery, tactic_format

__all__ = [
    "INTER_ALIGNS",
    "HIDDEN_ALIGNS",
    "TOKENS",
    "TPS",
    "Padding",
    "reference_alignments",
    "paddings",
    "queries_for",
    "sweep",
    "summary",
    "export",
]

INTER_ALIGNS: tuple[int, ...] = (1, 16, 32, 64, 128, 256)  # 1 = unpadded
HIDDEN_ALIGNS: tuple[int, ...] = (1, 256, 512, 1024)
TOKENS: tuple[int, ...] = (1, 8, 64, 512, 4096, 16384)
TPS: tuple[int, ...] = (1, 2, 4, 8)


def reference_alignments(
    preset: ModelPreset, fmt: str, per_token: bool = False, engine: Optional[str] = None
) -> tuple[int, int]:
    """``(intermediate, hidden)`` alignments ``fimoe-lab convert`` pads ``preset`` to in ``fmt`` on TRT-LLM.

    ``recipes.default_alignments(plan_format, "trtllm", is_act_and_mul, is_gated)`` with
    the format's layout recipe (``mxfp4-mxfp8`` -> ``mxfp4``) and the preset's activation.
    """
    tactic_format(fmt)
    act = get_activation(preset.activation)
    plan_fmt = FORMATS[fmt.strip().lower()].plan_format
    return default_alignments(
        plan_fmt, "trtllm", act.is_act_and_mul, act.gated, per_token_activation=per_token, engine=engine
    )


@dataclass(frozen=True)
class Padding:
    """One padding choice for one (preset, TP): per-rank shapes before and after."""

    inter_align: int
    hidden_align: int
    intermediate: int
    hidden: int
    padded_intermediate: int
    padded_hidden: int

    @property
    def element_ratio(self) -> float:
        """Padded / unpadded weight elements (the same for W13 and W2)."""
        return (self.padded_intermediate * self.padded_hidden) / (self.intermediate * self.hidden)


def paddings(
    preset: ModelPreset,
    tp: int,
    inter_aligns: Sequence[int] = INTER_ALIGNS,
    hidden_aligns: Sequence[int] = HIDDEN_ALIGNS,
    fmt: Optional[str] = None,
    per_token: bool = False,
    engine: Optional[str] = None,
) -> list[Padding]:
    """Every (intermediate alignment, hidden alignment) choice for ``preset`` at ``tp``.

    With ``fmt``, :func:`reference_alignments` is one of them (appended when the grid
    lacks it, e.g. bf16's hidden alignment 64).
    """
    inter = preset.local_intermediate(tp)
    pairs = [(ia, ha) for ia in inter_aligns for ha in hidden_aligns]
    reference = reference_alignments(preset, fmt, per_token, engine) if fmt is not None else None
    if reference is not None and reference not in pairs:
        pairs.append(reference)
    return [Padding(ia, ha, inter, preset.hidden, round_up(inter, ia), round_up(preset.hidden, ha)) for ia, ha in pairs]


def _query(
    preset: ModelPreset, fmt: str, pad: Padding, tokens: int, per_token: bool, layout: Optional[str]
) -> TacticQuery:
    return TacticQuery(
        fmt,
        preset.activation,
        pad.padded_hidden,
        pad.padded_intermediate,
        preset.experts,
        preset.top_k,
        tokens,
        per_token,
        layout,
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
    """The oracle queries a sweep of (preset, fmt, tp) needs (deduplicated, normalized)."""
    seen, out = set(), []
    for p in paddings(preset, tp, inter_aligns, hidden_aligns, fmt, per_token, engine):
        for t in tokens:
            q = _query(preset, fmt, p, t, per_token, layout)
            if q.key() not in seen:
                seen.add(q.key())
                out.append(q)
    return out


def _row(
    pad: Padding,
    counts: list,
    reason: Optional[str],
    source: Optional[dict],
    tokens: Sequence[int],
    mbytes_per_element: float,
    reference: tuple[int, int],
) -> dict:
    """One table row: padded sizes, tactic count per token count, waste, reference mark."""
    row = {
        "inter_align": pad.inter_align,
        "hidden_align": pad.hidden_align,
        "intermediate": pad.padded_intermediate,
        "hidden": pad.padded_hidden,
    }
    row.update({f"t{t}": c for t, c in zip(tokens, counts)})
    extra_el = pad.padded_intermediate * pad.padded_hidden - pad.intermediate * pad.hidden
    row["extra_bytes_pct"] = row["extra_flops_pct"] = 100.0 * (pad.element_ratio - 1.0)
    row["extra_mbytes"] = extra_el * mbytes_per_element
    row["reference"] = (pad.inter_align, pad.hidden_align) == reference
    row["reason"] = reason
    row["source"] = (source or {}).get("kind")
    return row


def _flag(r, tcols: list[str], tokens: Sequence[int]) -> str:
    """Why the reference row loses tactics ('' when it does not, or for other rows)."""
    if not r["reference"]:
        return ""
    if (r[tcols].fillna(-1) == 0).any():
        return f"ZERO tactics at T={[t for t, c in zip(tokens, r[tcols].fillna(-1)) if c == 0]}"
    return "" if r["full"] else "fewer tactics than the best padding"


def _minimal(df, tcols: list[str]) -> Optional[dict]:
    """The cheapest padding that still has at least one tactic at every T (may be < full)."""
    ok = df[(df[tcols].fillna(0) > 0).all(axis=1)].sort_values(
        ["extra_bytes_pct", "min_tactics", "inter_align", "hidden_align"], ascending=[True, False, True, True]
    )
    if not len(ok):
        return None
    m = ok.iloc[0]
    return {
        "inter_align": int(m.inter_align),
        "hidden_align": int(m.hidden_align),
        "intermediate": int(m.intermediate),
        "hidden": int(m.hidden),
        "min_tactics": int(m.min_tactics),
        "extra_bytes_pct": float(m.extra_bytes_pct),
    }


def convert_check(
    preset: ModelPreset, fmt: str, tp: int, inter_align: int, hidden_align: int, engine: Optional[str] = None
) -> Optional[str]:
    """None when ``convert`` applies this padding on TRT-LLM at ``tp``, else why not.

    Builds the layer plan with :func:`fimoe_lab.recipes.plan_layer` (the format's layout
    recipe, the preset's activation, the per-rank intermediate) and checks that the plan
    pads to ``round_up(I, inter_align) x round_up(H, hidden_align)``. The default pair is
    built without alignment options (what ``convert`` does when given none); ties in
    predicted time prefer it.
    """
    act = get_activation(preset.activation)
    inter = preset.local_intermediate(tp)
    is_default = (inter_align, hidden_align) == reference_alignments(preset, fmt, engine=engine)
    try:
        plan = plan_layer(
            FORMATS[fmt].plan_format,
            "trtllm",
            inter,
            preset.hidden,
            act.is_act_and_mul,
            act.gated,
            None if is_default else inter_align,  # convert without alignment options
            None if is_default else hidden_align,
            engine=engine,
        )
    except FimoeError as exc:
        return exc.message
    want = (round_up(inter, inter_align), round_up(preset.hidden, hidden_align))
    got = (plan.padded_intermediate, plan.padded_hidden)
    return None if got == want else f"convert pads to intermediate x hidden {got}, not {want}"


def tp_alternatives(
    preset: ModelPreset, fmt: str, tp: int, per_token: bool = False, engine: Optional[str] = None
) -> list[str]:
    """What works instead of a TP size whose shard ``convert`` refuses: other TP sizes, expert parallelism."""
    ref = reference_alignments(preset, fmt, per_token, engine)
    ok_tps = [
        t
        for t in (1, 2, 4, 8, 16)
        if t != tp and preset.moe_intermediate % t == 0 and convert_check(preset, fmt, t, *ref, engine) is None
    ]
    out = [f"--tp {' or '.join(map(str, ok_tps))} (whole scale blocks per rank)"] if ok_tps else []
    if preset.experts % tp == 0 and convert_check(preset, fmt, 1, *ref, engine) is None:
        out.append(
            f"expert parallelism over {tp} ranks ({preset.experts // tp} whole experts each, intermediate "
            f"{preset.moe_intermediate} unsplit: tune with --tp 1 and {preset.experts // tp} experts)"
        )
    return out


def _pareto(df) -> list[bool]:
    """Rows on the (extra bytes, predicted time, tactic count) frontier, one row per padded shape."""
    cand = df[df.candidate].sort_values(
        ["predicted_us", "recommended", "reference", "inter_align", "hidden_align"],
        ascending=[True, False, False, True, True],
    )
    cand = cand.drop_duplicates(["intermediate", "hidden"])
    keep = set()
    for i, r in cand.iterrows():
        dominated = any(
            o.extra_bytes_pct <= r.extra_bytes_pct
            and o.predicted_us <= r.predicted_us
            and o.min_tactics >= r.min_tactics
            and (o.extra_bytes_pct, o.predicted_us, -o.min_tactics)
            != (r.extra_bytes_pct, r.predicted_us, -r.min_tactics)
            for _, o in cand.iterrows()
        )
        if not dominated:
            keep.add(i)
    return [i in keep for i in df.index]


def _judge(df, tokens: Sequence[int], check) -> Optional[dict]:
    """Add ``min_tactics, full, candidate, convert, recommended, pareto, flag``; return the recommendation.

    Candidates have a tactic at every T (so a predicted time). Recommended: the candidate
    with the least ``predicted_us`` that ``check(inter_align, hidden_align)`` (convert's
    plan) accepts; ties go to fewer extra bytes, more tactics, smaller alignments. None
    when no candidate is accepted.
    """
    tcols = [f"t{t}" for t in tokens]
    df[tcols] = df[tcols].astype("Int64")
    df["min_tactics"] = df[tcols].min(axis=1)
    df["full"] = (df[tcols] == df[tcols].max()).all(axis=1).fillna(False).astype(bool)
    df["candidate"] = (df[tcols].fillna(0) > 0).all(axis=1) & df["predicted_us"].notna()
    df["convert"] = ""
    order = df[df.candidate].sort_values(
        ["predicted_us", "extra_bytes_pct", "min_tactics", "reference", "inter_align", "hidden_align"],
        ascending=[True, True, False, False, True, True],
    )
    rec_idx = None
    for idx, r in order.iterrows():
        why = check(int(r.inter_align), int(r.hidden_align))
        df.at[idx, "convert"] = "ok" if why is None else why
        if why is None:
            rec_idx = idx
            break
    df["recommended"] = df.index == rec_idx
    df["pareto"] = _pareto(df)
    df["flag"] = [_flag(r, tcols, tokens) for _, r in df.iterrows()]
    if rec_idx is None:
        return None
    rec = df.loc[rec_idx]
    return {
        "inter_align": int(rec.inter_align),
        "hidden_align": int(rec.hidden_align),
        "intermediate": int(rec.intermediate),
        "hidden": int(rec.hidden),
        "full": bool(rec.full),
        "min_tactics": int(rec.min_tactics),
        "extra_bytes_pct": float(rec.extra_bytes_pct),
        "predicted_us": float(rec.predicted_us),
    }


def _no_recommendation(df, tokens: Sequence[int], split: Optional[str]) -> str:
    """Why there is no recommendation (the shard splits a scale block, no padding has tactics, ...)."""
    if split:
        return f"convert refuses this TP shard: {split}"
    tcols = [f"t{t}" for t in tokens]
    if df[tcols].isna().any(axis=None) and not df.candidate.any():
        return "tactic counts are unknown to this source for some token counts (see reason)"
    if not df.candidate.any():
        zero = [t for t, c in zip(tokens, tcols) if (df[c].fillna(0) == 0).all()]
        return f"no padding in the grid has a tactic at every token count (none at all at T={zero})"
    refused = df[(df.convert != "") & (df.convert != "ok")]
    return "convert refuses every padding with tactics at every T" + (
        f" ({refused.convert.iloc[0]})" if len(refused) else ""
    )


def _why(df, rec: Optional[dict]) -> str:
    """One line: why the winner wins (its predicted time vs convert's default and vs the most tactics)."""
    if rec is None:
        return ""
    win = df[df.recommended].iloc[0]
    parts = [f"least predicted time over the token profile ({win.predicted_us:.1f} us)"]
    for label, rows in (
        ("convert's default", df[df.reference]),
        ("the most tactics", df[df.candidate].sort_values(["min_tactics", "predicted_us"], ascending=[False, True])),
    ):
        if len(rows) and rows.iloc[0].name != win.name:
            r = rows.iloc[0]
            if r.predicted_us != r.predicted_us:  # NaN: no tactic at some T
                parts.append(f"{label} (I {int(r.intermediate)}, H {int(r.hidden)}) lacks a tactic at some T")
            elif (int(r.intermediate), int(r.hidden)) != (int(win.intermediate), int(win.hidden)):
                parts.append(
                    f"{label} (I {int(r.intermediate)}, H {int(r.hidden)}, {int(r.min_tactics)} tactics, "
                    f"+{r.extra_bytes_pct:.1f}% bytes) predicts {r.predicted_us:.1f} us "
                    f"({100 * (r.predicted_us / win.predicted_us - 1):+.0f}%)"
                )
    return "; ".join(parts)


def _times(
    p: ModelPreset, fmt: str, pad: Padding, got: list, tokens: Sequence[int], weights: Sequence[float], gpu: GpuSpec
) -> tuple[Optional[float], float]:
    """``(predicted_us over the profile, transform_us)`` of one padding (:mod:`fimoe_lab.tune.cost`)."""
    ip, hp = pad.padded_intermediate, pad.padded_hidden
    times = [
        layer_time_us(gpu, fmt, p.activation, ip, hp, p.experts, p.top_k, t, [k for k, c in a.per_tile.items() if c])
        for t, a in zip(tokens, got)
    ]
    return profile_time_us(times, weights), transform_us(gpu, fmt, p.activation, ip, hp, p.experts)


def sweep(
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
):
    """Tactic counts, predicted time and padding waste for every alignment choice of (preset, fmt, tp).

    Returns a pandas DataFrame, one row per (inter_align, hidden_align) of
    :func:`paddings`, with columns ``inter_align, hidden_align, intermediate, hidden``
    (padded, per rank), ``t<T>`` (tactic count at T tokens; NA when unknown),
    ``min_tactics``, ``full`` (count equals the best of all rows at every T),
    ``extra_bytes_pct``, ``extra_flops_pct``, ``extra_mbytes`` (per layer, all local
    experts), ``predicted_us`` (estimated time over the token profile ``tokens`` weighted
    by ``weights`` on ``gpu``, :mod:`fimoe_lab.tune.cost`; NaN without a tactic at some T),
    ``transform_us`` (one-time conversion estimate), ``candidate`` (a tactic at every T),
    ``convert`` ("ok", why convert refuses it, or "" when not checked), ``pareto``,
    ``reference`` (the padding ``fimoe-lab convert`` applies, :func:`reference_alignments`),
    ``recommended`` (the fastest candidate convert accepts; none when the shard splits a
    scale block or no padding has a tactic at every T: ``attrs["no_recommendation"]`` says
    why and ``attrs["alternatives"]`` what works), ``flag``, ``reason``, ``source``.
    """
    import pandas as pd

    p = get_preset(preset) if isinstance(preset, str) else preset
    fmt = fmt.strip().lower()
    tactic_format(fmt)
    g = get_gpu(gpu)
    weights = list(weights) if weights is not None else [1.0] * len(tokens)
    if len(weights) != len(tokens) or min(weights) < 0 or sum(weights) <= 0:
        raise FimoeError(
            f"token weights {weights} do not fit tokens {list(tokens)}", fix="one weight >= 0 per token count"
        )
    oracle = oracle or TacticOracle()
    qs = queries_for(p, fmt, tp, per_token, layout, tokens, inter_aligns, hidden_aligns, engine)
    answers = {q.key(): a for q, a in zip(qs, oracle.ask_many(qs, progress=progress))}
    ref = reference_alignments(p, fmt, per_token, engine)
    matrices = get_activation(p.activation).projections + 1  # W13 (P x I x H) + W2 (H x I)
    mbytes_per_element = p.experts * matrices * FORMATS[fmt].bits_per_weight / 8 / 1e6
    rows = []
    for pad in paddings(p, tp, inter_aligns, hidden_aligns, fmt, per_token, engine):
        got = [answers[_query(p, fmt, pad, t, per_token, layout).key()] for t in tokens]
        reason = next((a.reason for a in got if a.reason), None)
        source = next((a.source for a in got if a.source), None)
        rows.append(_row(pad, [a.count for a in got], reason, source, tokens, mbytes_per_element, ref))
        rows[-1]["predicted_us"], rows[-1]["transform_us"] = _times(p, fmt, pad, got, tokens, weights, g)
    df = pd.DataFrame(rows)
    df["predicted_us"] = df["predicted_us"].astype(float)
    split = convert_check(p, fmt, tp, *ref, engine)
    recommendation = None if split else _judge(df, tokens, lambda ia, ha: convert_check(p, fmt, tp, ia, ha, engine))
    if split:
        _judge(df, tokens, lambda ia, ha: split)
    df.attrs.update(
        preset=p.name,
        format=fmt,
        tp=tp,
        per_token=per_token,
        tokens=list(tokens),
        weights=weights,
        gpu=g.name,
        recommendation=recommendation,
        no_recommendation=None if recommendation else _no_recommendation(df, tokens, split),
        alternatives=tp_alternatives(p, fmt, tp, per_token, engine) if split else [],
        engine=engine or DEFAULT_ENGINE,
        why=_why(df, recommendation),
        minimal=_minimal(df, [f"t{t}" for t in tokens]),
        reference={"inter_align": ref[0], "hidden_align": ref[1]},
        source=oracle.source(),
        estimate="predicted_us and transform_us are model estimates (fimoe_lab.tune.cost), not measurements",
    )
    return df


def summary(df) -> str:
    """A short text recommendation for a :func:`sweep` result."""
    a = df.attrs
    rec, ref, minimal = a["recommendation"], a["reference"], a.get("minimal")
    refrow = df[df["reference"]].iloc[0]
    profile = ", ".join(
        f"T={t}" + (f" x{w:g}" if len(set(a["weights"])) > 1 else "") for t, w in zip(a["tokens"], a["weights"])
    )
    lines = [
        f"{a['preset']} {a['format']}{' per-token' if a['per_token'] else ''} TP={a['tp']}: "
        f"per-rank intermediate {int(df.loc[df.inter_align == 1, 'intermediate'].iloc[0])}, "
        f"hidden {int(df.loc[df.hidden_align == 1, 'hidden'].iloc[0])}; predicted for {a['gpu'].upper()} "
        f"over {profile} (estimates, not measurements)",
    ]
    if rec is None:
        lines.append(f"recommended: none -- {a['no_recommendation']}")
        lines += [f"  alternative: {alt}" for alt in a.get("alternatives") or []]
    else:
        lines.append(
            f"recommended: intermediate -> {rec['intermediate']} (align {rec['inter_align']}), "
            f"hidden -> {rec['hidden']} (align {rec['hidden_align']}), +{rec['extra_bytes_pct']:.2f}% weights, "
            f"min {rec['min_tactics']} tactics, predicted {rec['predicted_us']:.1f} us"
        )
        lines.append(f"why: {a['why']}")
    front = df[df.pareto].sort_values("extra_bytes_pct")
    if len(front):
        lines.append(
            "Pareto frontier (extra bytes, predicted us, min tactics): "
            + "; ".join(
                f"I {int(r.intermediate)} H {int(r.hidden)}: +{r.extra_bytes_pct:.1f}%, {r.predicted_us:.1f} us, "
                f"{int(r.min_tactics)}"
                for _, r in front.iterrows()
            )
        )
    lines.append(
        "cheapest padding with a tactic at every T: "
        + (
            f"intermediate -> {minimal['intermediate']}, hidden -> {minimal['hidden']}, "
            f"+{minimal['extra_bytes_pct']:.2f}% weights, min {minimal['min_tactics']} tactics"
            if minimal
            else "none (no padding in the grid has a tactic at every T)"
        )
    )
    lines.append(
        f"convert's default padding (I%{ref['inter_align']}, H%{ref['hidden_align']}): intermediate "
        f"{int(refrow.intermediate)}, hidden {int(refrow.hidden)}, min tactics {refrow.min_tactics}"
        + (f"  <-- {refrow.flag}" if refrow.flag else "  (full tactic space)")
    )
    src = a.get("source") or {}
    lines.append(f"source: {src.get('kind')} (FlashInfer {src.get('flashinfer')}, kernel set {src.get('kernel_set')})")
    return "\n".join(lines)


def export(df, path: str) -> None:
    """Write a sweep to ``.csv`` or ``.json`` (records plus the attrs)."""
    if path.endswith(".csv"):
        df.to_csv(path, index=False)
    elif path.endswith(".json"):
        with open(path, "w") as f:
            json.dump({"attrs": df.attrs, "rows": json.loads(df.to_json(orient="records"))}, f, indent=1, default=str)
    else:
        raise FimoeError(
            f"export path {path!r} has neither a .csv nor a .json suffix", fix="name the file *.csv or *.json"
        )
