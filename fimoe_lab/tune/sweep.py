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

from ..errors import FimoeError
from ..presets import ModelPreset, get_preset
from ..recipes import default_alignments
from ..specs import FORMATS, get_activation
from ..steps import round_up
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


def reference_alignments(preset: ModelPreset, fmt: str) -> tuple[int, int]:
    """``(intermediate, hidden)`` alignments ``fimoe-lab convert`` pads ``preset`` to in ``fmt`` on TRT-LLM.

    ``recipes.default_alignments(plan_format, "trtllm", is_act_and_mul, is_gated)`` with
    the format's layout recipe (``mxfp4-mxfp8`` -> ``mxfp4``) and the preset's activation.
    """
    tactic_format(fmt)
    act = get_activation(preset.activation)
    return default_alignments(FORMATS[fmt.strip().lower()].plan_format, "trtllm", act.is_act_and_mul, act.gated)


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
) -> list[Padding]:
    """Every (intermediate alignment, hidden alignment) choice for ``preset`` at ``tp``.

    With ``fmt``, :func:`reference_alignments` is one of them (appended when the grid
    lacks it, e.g. bf16's hidden alignment 64).
    """
    inter = preset.local_intermediate(tp)
    pairs = [(ia, ha) for ia in inter_aligns for ha in hidden_aligns]
    reference = reference_alignments(preset, fmt) if fmt is not None else None
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
) -> list[TacticQuery]:
    """The oracle queries a sweep of (preset, fmt, tp) needs (deduplicated, normalized)."""
    seen, out = set(), []
    for p in paddings(preset, tp, inter_aligns, hidden_aligns, fmt):
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


def _judge(df, tokens: Sequence[int]) -> dict:
    """Add ``min_tactics``, ``full``, ``recommended`` and ``flag``; return the recommendation.

    Recommended: the full space (the best count of all rows at every T) at least waste;
    if no row is full, the most tactics summed over T, then least waste; ties go to the
    smaller alignments.
    """
    tcols = [f"t{t}" for t in tokens]
    df[tcols] = df[tcols].astype("Int64")
    df["min_tactics"] = df[tcols].min(axis=1)
    df["full"] = (df[tcols] == df[tcols].max()).all(axis=1).fillna(False).astype(bool)
    order = df.assign(_sum=df[tcols].sum(axis=1)).sort_values(
        ["full", "_sum", "extra_bytes_pct", "inter_align", "hidden_align"], ascending=[False, False, True, True, True]
    )
    df["recommended"] = df.index == order.index[0]
    df["flag"] = [_flag(r, tcols, tokens) for _, r in df.iterrows()]
    rec = df.loc[order.index[0]]
    return {
        "inter_align": int(rec.inter_align),
        "hidden_align": int(rec.hidden_align),
        "intermediate": int(rec.intermediate),
        "hidden": int(rec.hidden),
        "full": bool(rec.full),
        "extra_bytes_pct": float(rec.extra_bytes_pct),
    }


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
):
    """Tactic counts and padding waste for every alignment choice of (preset, fmt, tp).

    Returns a pandas DataFrame, one row per (inter_align, hidden_align) of
    :func:`paddings`, with columns ``inter_align, hidden_align, intermediate, hidden``
    (padded, per rank), ``t<T>`` (tactic count at T tokens; NA when unknown),
    ``min_tactics``, ``full`` (count equals the best of all rows at every T),
    ``extra_bytes_pct``, ``extra_flops_pct``, ``extra_mbytes`` (per layer, all local
    experts), ``reference`` (the one row ``fimoe-lab convert`` pads to,
    :func:`reference_alignments`), ``recommended`` (the full space at least waste;
    ``attrs["minimal"]`` is the cheapest padding with a tactic at every T), ``flag`` (why
    the reference row loses tactics, if it does), ``reason`` (first reason for a
    0/unknown), ``source``. ``df.attrs`` holds preset, format, tp, the recommendation,
    the reference and the source.
    """
    import pandas as pd

    p = get_preset(preset) if isinstance(preset, str) else preset
    fmt = fmt.strip().lower()
    tactic_format(fmt)
    oracle = oracle or TacticOracle()
    qs = queries_for(p, fmt, tp, per_token, layout, tokens, inter_aligns, hidden_aligns)
    answers = {q.key(): a for q, a in zip(qs, oracle.ask_many(qs, progress=progress))}
    ref = reference_alignments(p, fmt)
    matrices = get_activation(p.activation).projections + 1  # W13 (P x I x H) + W2 (H x I)
    mbytes_per_element = p.experts * matrices * FORMATS[fmt].bits_per_weight / 8 / 1e6
    rows = []
    for pad in paddings(p, tp, inter_aligns, hidden_aligns, fmt):
        got = [answers[_query(p, fmt, pad, t, per_token, layout).key()] for t in tokens]
        reason = next((a.reason for a in got if a.reason), None)
        source = next((a.source for a in got if a.source), None)
        rows.append(_row(pad, [a.count for a in got], reason, source, tokens, mbytes_per_element, ref))
    df = pd.DataFrame(rows)
    recommendation = _judge(df, tokens)
    df.attrs.update(
        preset=p.name,
        format=fmt,
        tp=tp,
        per_token=per_token,
        tokens=list(tokens),
        recommendation=recommendation,
        minimal=_minimal(df, [f"t{t}" for t in tokens]),
        reference={"inter_align": ref[0], "hidden_align": ref[1]},
        source=oracle.source(),
    )
    return df


def summary(df) -> str:
    """A short text recommendation for a :func:`sweep` result."""
    a = df.attrs
    rec, ref, minimal = a["recommendation"], a["reference"], a.get("minimal")
    refrow = df[df["reference"]].iloc[0]
    lines = [
        f"{a['preset']} {a['format']}{' per-token' if a['per_token'] else ''} TP={a['tp']}: "
        f"per-rank intermediate {int(df.loc[df.inter_align == 1, 'intermediate'].iloc[0])}, "
        f"hidden {int(df.loc[df.hidden_align == 1, 'hidden'].iloc[0])}",
        f"recommended: intermediate -> {rec['intermediate']} (align {rec['inter_align']}), "
        f"hidden -> {rec['hidden']} (align {rec['hidden_align']}), +{rec['extra_bytes_pct']:.2f}% weights"
        + ("" if rec["full"] else "  [no padding reaches every tactic at every T]"),
        (
            "cheapest padding with a tactic at every T: "
            + (
                f"intermediate -> {minimal['intermediate']}, hidden -> {minimal['hidden']}, "
                f"+{minimal['extra_bytes_pct']:.2f}% weights, min {minimal['min_tactics']} tactics"
                if minimal
                else "none (no padding in the grid has a tactic at every T)"
            )
        ),
        f"convert's default padding (I%{ref['inter_align']}, H%{ref['hidden_align']}): intermediate "
        f"{int(refrow.intermediate)}, hidden {int(refrow.hidden)}, min tactics {refrow.min_tactics}"
        + (f"  <-- {refrow.flag}" if refrow.flag else "  (full tactic space)"),
    ]
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
