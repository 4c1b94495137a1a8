"""Alignment sweep: which padding gives the whole tactic space at the least waste.

For a (preset, format, TP) the sweep pads the per-rank intermediate size and the
hidden size to each candidate alignment, asks the :class:`~fimoe_lab.tune.oracle.TacticOracle`
how many tactics each padded shape has per token count, computes what the padding
costs (extra weight bytes and FLOPs), and recommends the cheapest padding that keeps
every tactic available.  The reference's fixed rules (vLLM's ``flashinfer_utils``:
intermediate to 16 gated / 128 non-gated, hidden to 256, or 512 for NVFP4 per-token
non-gated; MXFP8: 128 / 256) are shown side by side and flagged where they lose tactics.

pandas is needed for :func:`sweep`; matplotlib only inside the plotting functions.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from ..presets import ModelPreset, get_preset
from ..steps import round_up
from .oracle import FORMATS, GATED, TacticOracle, TacticQuery, OracleError

INTER_ALIGNS: tuple[int, ...] = (1, 16, 32, 64, 128, 256)   # 1 = unpadded
HIDDEN_ALIGNS: tuple[int, ...] = (1, 256, 512, 1024)
TOKENS: tuple[int, ...] = (1, 8, 64, 512, 4096, 16384)
TPS: tuple[int, ...] = (1, 2, 4, 8)



def reference_rule(activation: str, fmt: str, per_token: bool = False) -> tuple[int, int]:
    """(intermediate alignment, hidden alignment) the reference (vLLM flashinfer_utils) uses.

    Intermediate: 16 for gated activations, 128 for non-gated; 128 for MXFP8 TRT-LLM.
    Hidden: 256; 512 for NVFP4 with per-token activation scaling and a non-gated activation.
    """
    gated = GATED[activation]
    if fmt == "mxfp8":
        return 128, 256
    inter = 16 if gated else 128
    hidden = 512 if (fmt == "nvfp4" and per_token and not gated) else 256
    return inter, hidden


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


def paddings(preset: ModelPreset, tp: int, inter_aligns: Sequence[int] = INTER_ALIGNS,
             hidden_aligns: Sequence[int] = HIDDEN_ALIGNS) -> list[Padding]:
    """Every (intermediate alignment, hidden alignment) choice for ``preset`` at ``tp``."""
    inter = preset.local_intermediate(tp)
    return [Padding(ia, ha, inter, preset.hidden, round_up(inter, ia), round_up(preset.hidden, ha))
            for ia in inter_aligns for ha in hidden_aligns]


def queries_for(preset: ModelPreset, fmt: str, tp: int, per_token: bool = False,
                layout: Optional[str] = None, tokens: Sequence[int] = TOKENS,
                inter_aligns: Sequence[int] = INTER_ALIGNS,
                hidden_aligns: Sequence[int] = HIDDEN_ALIGNS) -> list[TacticQuery]:
    """The oracle queries a sweep of (preset, fmt, tp) needs (deduplicated, normalized)."""
    seen, out = set(), []
    for p in paddings(preset, tp, inter_aligns, hidden_aligns):
        for t in tokens:
            q = TacticQuery(fmt, preset.activation, p.padded_hidden, p.padded_intermediate,
                            preset.experts, preset.top_k, t, per_token, layout).normalized()
            if q.key() not in seen:
                seen.add(q.key())
                out.append(q)
    return out


def sweep(preset: str | ModelPreset, fmt: str, tp: int, oracle: Optional[TacticOracle] = None,
          per_token: bool = False, layout: Optional[str] = None, tokens: Sequence[int] = TOKENS,
          inter_aligns: Sequence[int] = INTER_ALIGNS, hidden_aligns: Sequence[int] = HIDDEN_ALIGNS,
          progress: bool = False):
    """Tactic counts and padding waste for every alignment choice of (preset, fmt, tp).

    Returns a pandas DataFrame, one row per (inter_align, hidden_align), with columns
    ``inter_align, hidden_align, intermediate, hidden`` (padded, per rank),
    ``t<T>`` (tactic count at T tokens; NaN when unknown), ``min_tactics``,
    ``full`` (count equals the best of all rows at every T), ``extra_bytes_pct``,
    ``extra_flops_pct``, ``extra_mbytes`` (per layer, all local experts),
    ``reference`` (the fixed rule's row), ``recommended`` (the full space at least
    waste; ``attrs["minimal"]`` is the cheapest padding with a tactic at every T), ``flag`` (why the
    reference row loses tactics, if it does), ``reason`` (first reason for a 0/unknown),
    ``source``.  ``df.attrs`` holds preset, format, tp, the recommendation and the source.
    """
    import pandas as pd

    p = get_preset(preset) if isinstance(preset, str) else preset
    fmt = fmt.strip().lower()
    if fmt not in FORMATS:
        raise OracleError(f"unknown format {fmt!r}; valid: {', '.join(FORMATS)}")
    oracle = oracle or TacticOracle()
    pads = paddings(p, tp, inter_aligns, hidden_aligns)
    qs = queries_for(p, fmt, tp, per_token, layout, tokens, inter_aligns, hidden_aligns)
    answers = {q.key(): a for q, a in zip(qs, oracle.ask_many(qs, progress=progress))}
    gated = p.is_gated
    n_mats = 3 if gated else 2                     # W13 (2 x I x H) + W2 (H x I), or W1 + W2
    bits = FORMATS[fmt].weight_bits
    ref = reference_rule(p.activation, fmt, per_token)
    rows = []
    for pad in pads:
        row = {"inter_align": pad.inter_align, "hidden_align": pad.hidden_align,
               "intermediate": pad.padded_intermediate, "hidden": pad.padded_hidden}
        reason, source = None, None
        for t in tokens:
            q = TacticQuery(fmt, p.activation, pad.padded_hidden, pad.padded_intermediate, p.experts,
                            p.top_k, t, per_token, layout).normalized()
            a = answers[q.key()]
            row[f"t{t}"] = a.count
            reason = reason or a.reason
            source = source or a.source
        extra_el = pad.padded_intermediate * pad.padded_hidden - pad.intermediate * pad.hidden
        row["extra_bytes_pct"] = 100.0 * (pad.element_ratio - 1.0)
        row["extra_flops_pct"] = 100.0 * (pad.element_ratio - 1.0)
        row["extra_mbytes"] = p.experts * n_mats * extra_el * bits / 8 / 1e6
        row["reference"] = (pad.inter_align, pad.hidden_align) == ref
        row["reason"] = reason
        row["source"] = (source or {}).get("kind")
        rows.append(row)
    df = pd.DataFrame(rows)
    tcols = [f"t{t}" for t in tokens]
    df[tcols] = df[tcols].astype("Int64")
    best = df[tcols].max()
    df["min_tactics"] = df[tcols].min(axis=1)
    df["full"] = (df[tcols] == best).all(axis=1).fillna(False).astype(bool)
    # Recommendation: the full space at least waste; if no row is full at every T, the
    # most tactics summed over T, then least waste.  Ties -> smaller alignments.
    order = df.assign(_sum=df[tcols].sum(axis=1)).sort_values(
        ["full", "_sum", "extra_bytes_pct", "inter_align", "hidden_align"],
        ascending=[False, False, True, True, True])
    rec_idx = order.index[0]
    df["recommended"] = df.index == rec_idx
    flags = []
    for i, r in df.iterrows():
        f = ""
        if r["reference"]:
            if (r[tcols].fillna(-1) == 0).any():
                zero_t = [t for t in tokens if r[f"t{t}"] == 0]
                f = f"ZERO tactics at T={zero_t}"
            elif not r["full"]:
                f = "fewer tactics than the best padding"
        flags.append(f)
    df["flag"] = flags
    rec = df.loc[rec_idx]
    # The cheapest padding that still has at least one tactic at every T (may be < full).
    ok = df[(df[tcols].fillna(0) > 0).all(axis=1)].sort_values(
        ["extra_bytes_pct", "min_tactics", "inter_align", "hidden_align"], ascending=[True, False, True, True])
    minimal = None
    if len(ok):
        m = ok.iloc[0]
        minimal = {"inter_align": int(m.inter_align), "hidden_align": int(m.hidden_align),
                   "intermediate": int(m.intermediate), "hidden": int(m.hidden),
                   "min_tactics": int(m.min_tactics), "extra_bytes_pct": float(m.extra_bytes_pct)}
    df.attrs.update(preset=p.name, format=fmt, tp=tp, per_token=per_token, tokens=list(tokens),
                    recommendation={"inter_align": int(rec.inter_align), "hidden_align": int(rec.hidden_align),
                                    "intermediate": int(rec.intermediate), "hidden": int(rec.hidden),
                                    "full": bool(rec.full), "extra_bytes_pct": float(rec.extra_bytes_pct)},
                    minimal=minimal,
                    reference={"inter_align": ref[0], "hidden_align": ref[1]},
                    source=oracle.source())
    return df


def summary(df) -> str:
    """A short text recommendation for a :func:`sweep` result."""
    a = df.attrs
    rec, ref = a["recommendation"], a["reference"]
    refrow = df[df["reference"]].iloc[0]
    lines = [f"{a['preset']} {a['format']}{' per-token' if a['per_token'] else ''} TP={a['tp']}: "
             f"per-rank intermediate {int(df.loc[df.inter_align == 1, 'intermediate'].iloc[0])}, "
             f"hidden {int(df.loc[df.hidden_align == 1, 'hidden'].iloc[0])}",
             f"recommended: intermediate -> {rec['intermediate']} (align {rec['inter_align']}), "
             f"hidden -> {rec['hidden']} (align {rec['hidden_align']}), +{rec['extra_bytes_pct']:.2f}% weights"
             + ("" if rec["full"] else "  [no padding reaches every tactic at every T]"),
             ("cheapest padding with a tactic at every T: " + (
                 f"intermediate -> {a['minimal']['intermediate']}, hidden -> {a['minimal']['hidden']}, "
                 f"+{a['minimal']['extra_bytes_pct']:.2f}% weights, min {a['minimal']['min_tactics']} tactics"
                 if a.get("minimal") else "none (no padding in the grid has a tactic at every T)")),
             f"reference rule (I%{ref['inter_align']}, H%{ref['hidden_align']}): intermediate {int(refrow.intermediate)}, "
             f"hidden {int(refrow.hidden)}, min tactics {refrow.min_tactics}"
             + (f"  <-- {refrow.flag}" if refrow.flag else "  (full tactic space)")]
    src = a.get("source") or {}
    lines.append(f"source: {src.get('kind')} (FlashInfer {src.get('flashinfer')}, kernel set {src.get('kernel_set')})")
    return "\n".join(lines)


def export(df, path: str) -> None:
    """Write a sweep to ``.csv`` or ``.json`` (records plus the attrs)."""
    if path.endswith(".csv"):
        df.to_csv(path, index=False)
    elif path.endswith(".json"):
        with open(path, "w") as f:
            json.dump({"attrs": df.attrs, "rows": json.loads(df.to_json(orient="records"))}, f, indent=1,
                      default=str)
    else:
        raise ValueError(f"export path must end in .csv or .json, got {path!r}")


# --------------------------------------------------------------------------- plots
def plot_heatmap(df, ax=None):
    """Heatmap of tactic counts: rows = (I align, H align), columns = token count."""
    import matplotlib.pyplot as plt
    import numpy as np

    tcols = [c for c in df.columns if c.startswith("t") and c[1:].isdigit()]
    data = df[tcols].astype(float).to_numpy()
    if ax is None:
        _, ax = plt.subplots(figsize=(1.0 + 0.8 * len(tcols), 0.3 * len(df) + 1.5))
    im = ax.imshow(np.where(np.isnan(data), -1, data), aspect="auto", cmap="viridis")
    ax.set_xticks(range(len(tcols)), [c[1:] for c in tcols])
    labels = [f"I%{r.inter_align} H%{r.hidden_align} ({r.intermediate}x{r.hidden})"
              + (" REF" if r.reference else "") + (" *" if r.recommended else "") for r in df.itertuples()]
    ax.set_yticks(range(len(df)), labels, fontsize=7)
    ax.set_xlabel("tokens")
    a = df.attrs
    ax.set_title(f"{a.get('preset')} {a.get('format')} TP{a.get('tp')}: tactics", fontsize=9)
    for (i, j), v in np.ndenumerate(data):
        ax.text(j, i, "?" if np.isnan(v) else int(v), ha="center", va="center", fontsize=6,
                color="white" if (not np.isnan(v) and v < np.nanmax(data) / 2) else "black")
    ax.figure.colorbar(im, ax=ax)
    return ax


def plot_waste_vs_tactics(df, ax=None):
    """Scatter: extra weight bytes (%) vs minimum tactic count over token counts."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(5, 3.5))
    ax.scatter(df.extra_bytes_pct, df.min_tactics.astype(float), c=df.full.map({True: "tab:green", False: "tab:red"}))
    for r in df.itertuples():
        if r.reference or r.recommended:
            ax.annotate("REF" if r.reference else "REC", (r.extra_bytes_pct, float(r.min_tactics)), fontsize=8)
    ax.set_xlabel("extra weight bytes / FLOPs (%)")
    ax.set_ylabel("min tactics over token counts")
    a = df.attrs
    ax.set_title(f"{a.get('preset')} {a.get('format')} TP{a.get('tp')}", fontsize=9)
    return ax


# --------------------------------------------------------------------------- timings
