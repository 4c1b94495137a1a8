"""Notebook rendering of the core's values, kept apart from them (treescope-style).

``%load_ext fimoe_lab.viz`` (or :func:`register`) makes every :class:`IndexMap`,
:class:`LayerPlan` and :class:`Provenance` display as an HTML table of its steps, with
a thumbnail of where each output byte comes from, and every matplotlib ``Figure`` as the
lab's inline SVG (:func:`fimoe_lab.viz.figures.to_svg`: vector, natural size, readable
in JupyterLab's light and dark themes); the core classes are untouched.
"""

from __future__ import annotations

import base64
import html
import io

import numpy as np
from matplotlib.figure import Figure

from fimoe_lab.layout import IndexMap, Provenance
from fimoe_lab.plan import LayerPlan

__all__ = ["map_html", "plan_html", "provenance_html", "figure_html", "register"]

THUMBNAIL_MAX_BYTES = 1 << 22  # maps larger than this (bytes per expert) render without a thumbnail
TABLE = "<table style='font-family:monospace;font-size:12px;border-collapse:collapse'>"


def _thumbnail(m: IndexMap) -> str:
    """An <img> of ``m.source_bytes()`` (input offset per output byte; grey = fill), or ''."""
    if m.out_bytes > THUMBNAIL_MAX_BYTES:
        return ""
    src = m.source_bytes().numpy()
    src = src.reshape(-1, src.shape[-1]).astype(float)
    src[src < 0] = np.nan
    fig = Figure(figsize=(2.4, 2.0))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.imshow(src, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_facecolor((0.75, 0.75, 0.75))
    ax.axis("off")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=60)
    data = base64.b64encode(buf.getvalue()).decode()
    return (
        f"<img title='input byte offset of each output byte (grey: fill)' "
        f"src='data:image/png;base64,{data}' style='float:right;margin-left:8px'/>"
    )


def map_html(m: IndexMap) -> str:
    """HTML for an index map: its steps with shapes (bytes), cell size and fill bytes."""
    rows = []
    for s in m.steps:
        fill = int((s.src < 0).sum()) * s.cell_bytes
        rows.append(
            f"<tr><td>{html.escape(s.name)}</td><td>{s.in_shape}</td><td>&rarr; {s.out_shape}</td>"
            f"<td>{s.cell_bytes} B</td><td>{fill:,} B fill</td></tr>"
        )
    total = int((m.src < 0).sum()) * m.cell_bytes
    head = (
        f"<b>IndexMap</b> {m.in_shape} &rarr; {m.out_shape} bytes per expert, {len(m.steps)} step(s), "
        f"{total:,} B fill ({100 * total / max(m.out_bytes, 1):.1f}%)"
    )
    return f"<div>{_thumbnail(m)}{head}<br>{TABLE}{''.join(rows)}</table></div>"


def plan_html(plan: LayerPlan) -> str:
    """HTML for a layer plan: sizes, then each tensor's map."""
    head = (
        f"<b>LayerPlan</b> {html.escape(plan.description)}: intermediate {plan.intermediate} &rarr; "
        f"{plan.padded_intermediate}, hidden {plan.hidden} &rarr; {plan.padded_hidden}"
    )
    parts = [
        f"<div style='clear:both;margin-top:6px'><b>{name}</b>: {map_html(m)}</div>" for name, m in plan.maps().items()
    ]
    return f"<div>{head}{''.join(parts) or '<br>(no tensor moves)'}</div>"


def provenance_html(p: Provenance) -> str:
    """HTML for a provenance chain: one row per stage, output first."""
    rows = "".join(
        f"<tr><td>{html.escape(s.step)}</td><td>{s.shape}</td>"
        f"<td>{f'fill byte {s.fill:#04x}' if s.fill is not None else s.coords}</td></tr>"
        for s in p.stages
    )
    return f"{TABLE}{rows}</table>"


def figure_html(fig: Figure) -> str:
    """HTML for a figure: its theme-aware SVG (:func:`fimoe_lab.viz.figures.to_svg`) in a ``fimoe-figure`` div."""
    from fimoe_lab.viz.figures import to_svg

    return f"<div class='fimoe-figure' style='max-width:100%;overflow-x:auto'>{to_svg(fig)}</div>"


def register(ip=None) -> None:
    """Make IPython render the core's values and figures as HTML (``%load_ext fimoe_lab.viz`` calls this).

    Figures then carry only the SVG (the inline backend's PNG, a fixed-DPI raster on a
    white slab, is switched off for them).
    """
    if ip is None:
        from IPython import get_ipython

        ip = get_ipython()
    formatter = ip.display_formatter.formatters["text/html"]
    formatter.for_type(IndexMap, map_html)
    formatter.for_type(LayerPlan, plan_html)
    formatter.for_type(Provenance, provenance_html)
    formatter.for_type(Figure, figure_html)
    ip.display_formatter.formatters["image/png"].for_type(Figure, lambda fig: None)
