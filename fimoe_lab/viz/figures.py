"""Plain plotting functions: each returns a matplotlib ``Figure`` drawn from :mod:`.data`.

No pyplot state: figures are ``matplotlib.figure.Figure`` objects (Agg), drawn in the
lab's style (:data:`STYLE`: no text below :data:`MIN_FONT` points, legends outside the
data, a colourbar with its unit on every heatmap). :func:`to_svg` renders one for a
notebook (vector, shown at its natural size, black drawn as ``currentColor`` so it reads
in JupyterLab's light and dark themes, with hover text); :func:`to_png` at 2x for files.
Value views mark padding (grey), NaN, Inf and dead scales (:data:`FLAG_COLOURS`) and
reduce anything larger than :data:`MAX_SIDE` per side (:func:`data.downsample`); axes
are always in elements. The arrays each panel draws are the :mod:`.data` arrays (tests
compare them).

Why one module of this size: every figure shares one style (:data:`STYLE`, fonts, colourbars,
flag colours) and one SVG path (:func:`to_svg`, hover text, ``currentColor``), and the pointable
figures share the cell markers (:func:`cells_of`, :func:`trace_markers`). Each figure function is short
and independent; splitting them by view would spread one visual vocabulary over several modules.
"""

from __future__ import annotations

import functools
import io
import math
import re
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Optional, TypeVar

import numpy as np
from matplotlib import colormaps, rc_context, rcParams
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.cm import ScalarMappable
from matplotlib.colors import ListedColormap, Normalize, to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from matplotlib.text import Text

from fimoe_lab.errors import LayoutError
from fimoe_lab.layout import IndexMap
from fimoe_lab.viz import data

__all__ = [
    "MIN_FONT",
    "STYLE",
    "to_svg",
    "to_png",
    "hover_texts",
    "row_permutation_figure",
    "tile_figure",
    "swizzle_figure",
    "padding_figure",
    "provenance_figure",
    "compare_figure",
    "tuner_figure",
    "frontier_figure",
    "side_by_side",
    "marker_svg",
    "cells_of",
    "cell_at",
    "trace_markers",
    "chain_text",
    "sweep_tactics_figure",
    "sweep_waste_figure",
]

MIN_FONT = 8.0
"""No text of a lab figure is smaller than this (points)."""
STYLE = {
    "font.size": 9,
    "axes.titlesize": 9,
    "axes.labelsize": 9,
    "xtick.labelsize": MIN_FONT,
    "ytick.labelsize": MIN_FONT,
    "legend.fontsize": MIN_FONT,
    "legend.title_fontsize": MIN_FONT,
    "figure.titlesize": 10,
    "legend.frameon": False,
    "image.interpolation": "none",
    "svg.fonttype": "none",
    "svg.hashsalt": "fimoe-lab",
}
"""rcParams every figure is drawn under (``svg.fonttype`` none: text stays text, sharp at any zoom)."""

PAD_COLOUR = (0.62, 0.62, 0.62, 1.0)
FLAG_COLOURS = {"padding": PAD_COLOUR, "dead scale": "#00e5ff", "Inf": "#ff2a00", "NaN": "#ff00ff"}
"""Marker colour of each :data:`data.FLAG_NAMES` flag but data (drawn over the value heatmap)."""
MAGNITUDE_CMAP = "viridis"
MAX_SIDE = 512
"""Heatmaps larger than this per side are reduced (:func:`data.downsample`, :func:`data.sample_grid`)."""
MAX_INDEX_SIDE = 1024
"""Index views (source rows, columns, atoms) larger than this per side show every k-th element."""
MAX_POINTS = 2048
"""Row views with more rows draw "all rows" as an image of at most :data:`MAX_SIDE` per side."""
SVG_DPI = 144
"""Resolution of the rasters inside an SVG (heatmap pixels are data; this only sets large scatters)."""

F = TypeVar("F", bound=Callable[..., Any])


def styled(fn: F) -> F:
    """Draw ``fn``'s figure under :data:`STYLE`."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with rc_context(STYLE):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def hover(artist: Artist, text: str) -> None:
    """Give ``artist`` hover text: :func:`to_svg` writes it as the SVG ``<title>`` of the artist's group."""
    fig = artist.get_figure(root=True) if hasattr(artist, "get_figure") else artist.figure
    texts = hover_texts(fig)
    gid = f"fimoe-hover-{len(texts)}"
    artist.set_gid(gid)
    texts[gid] = text


def hover_texts(fig: Figure) -> dict[str, str]:
    """``{gid: text}`` of every artist of ``fig`` with hover text (see :func:`hover`)."""
    if not hasattr(fig, "_fimoe_hover"):
        fig._fimoe_hover = {}  # type: ignore[attr-defined]
    return fig._fimoe_hover  # type: ignore[attr-defined,no-any-return]


POINTABLE = "fimoe-cells"
"""SVG id prefix of the frame of each axes whose cells a click traces (:func:`cells_of`)."""


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def to_svg(fig: Figure) -> str:
    """``fig`` as an SVG string for inline HTML: transparent, black drawn as ``currentColor``.

    In a notebook the text and axes then take the page's text colour (light on JupyterLab's
    dark theme, dark on the light one); sizes are the figure's own (``width``/``height`` in
    points: shown at natural size, never scaled down, so no text falls under :data:`MIN_FONT`; a
    narrower page scrolls the figure sideways); hover texts become ``<title>`` elements.
    """
    buf = io.StringIO()
    pointable = cells_of(fig)
    for k, ax in enumerate(fig.axes):  # the axes a click traces: their frame is findable in the page
        if id(ax) in pointable:
            ax.patch.set_gid(f"{POINTABLE}-{k}")
    with rc_context(STYLE):
        fig.savefig(buf, format="svg", transparent=True, dpi=SVG_DPI, metadata={"Date": None})
    svg = buf.getvalue()
    svg = svg[svg.index("<svg") :]
    svg = svg.replace("#000000", "currentColor").replace(
        "<svg ", '<svg fill="currentColor" style="max-width:none;height:auto" ', 1
    )
    texts = hover_texts(fig)
    return re.sub(
        r'(<g id="(fimoe-hover-\d+)"[^>]*>)',
        lambda m: m.group(1) + (f"<title>{_escape(texts[m.group(2)])}</title>" if m.group(2) in texts else ""),
        svg,
    )


def to_png(fig: Figure, scale: float = 2.0, facecolor: str = "white") -> bytes:
    """PNG bytes of ``fig`` at ``scale`` x 100 dpi (2x: sharp on hi-DPI screens), on ``facecolor``."""
    buf = io.BytesIO()
    with rc_context(STYLE):
        fig.savefig(buf, format="png", dpi=100 * scale, facecolor=facecolor)
    return buf.getvalue()


def _group_colours(n_groups: int) -> list:
    """Colours for ``n_groups`` groups, the last one (padding) grey."""
    cmap = colormaps["tab10" if n_groups <= 11 else "tab20"]
    return [cmap(k % cmap.N) for k in range(n_groups - 1)] + [PAD_COLOUR]


def _categorical(n: int) -> ListedColormap:
    """``n`` distinct colours for integer codes ``0..n-1`` (grey for masked)."""
    return ListedColormap(_group_colours(n + 1)[:-1]).with_extremes(bad=PAD_COLOUR)


def _masked(a: np.ndarray) -> np.ma.MaskedArray:
    """``a`` with fill (-1 or NaN) masked, so it draws in the 'bad' colour."""
    bad = np.isnan(a) if np.issubdtype(a.dtype, np.floating) else a < 0
    return np.ma.masked_array(a, mask=bad)


def _cmap(name: str):
    return colormaps[name].with_extremes(bad=PAD_COLOUR)


def panel_row(
    panels: Sequence[tuple[float, float, float, bool]], height: float, top: float = 0.65, bottom: float = 0.75
) -> tuple[Figure, list[tuple[Axes, Optional[Axes]]]]:
    """A figure of panels left to right at fixed sizes in inches (no layout engine: a redraw
    of a real-size view must not spend its budget on layout).

    ``panels``: ``(left margin, axes width, right margin, colourbar)`` per panel; the
    colourbar (0.12 in, 0.08 in from its axes) sits inside the right margin. ``top`` and
    ``bottom`` margins hold titles, the suptitle, x labels and the legends below the axes.
    Returns the figure and ``(axes, colourbar axes or None)`` per panel.
    """
    width = sum(left + w + right for left, w, right, _ in panels)
    fig = Figure(figsize=(width, height))
    x, out = 0.0, []
    y, h = bottom / height, (height - top - bottom) / height
    for left, w, right, bar in panels:
        ax = fig.add_axes(((x + left) / width, y, w / width, h))
        cax = fig.add_axes(((x + left + w + 0.08) / width, y, 0.12 / width, h)) if bar else None
        for a in (ax, cax) if cax is not None else (ax,):  # titles at y = 1: no tick-label bboxes per render
            a.set_title("", y=1.0)  # (where matplotlib's automatic placement puts them: no axes has top labels)
        out.append((ax, cax))
        x += left + w + right
    return fig, out


def _extent(shape: tuple[int, int]) -> tuple[float, float, float, float]:
    """imshow extent putting element ``(r, c)`` of a ``shape`` array at axes ``(c, r)``."""
    return (-0.5, shape[1] - 0.5, shape[0] - 0.5, -0.5)


def _index_image(fig: Figure, ax: Axes, cax: Optional[Axes], a: np.ndarray, label: str, cmap: str = "viridis"):
    """An index array (-1: fill, grey) at most :data:`MAX_INDEX_SIDE` per side, axes in elements, colourbar
    ``label``. Returns the sampling step ``(rows, cols)`` (every k-th element shown), for the title."""
    shown, block = data.sample_grid(a, MAX_INDEX_SIDE)
    im = ax.imshow(_masked(shown), aspect="auto", cmap=_cmap(cmap), extent=_extent(a.shape))
    _colourbar(fig, im, ax, cax, label)
    return block


def _colourbar(fig: Figure, mappable, ax: Axes, cax: Optional[Axes], label: str, **kw):
    """A colourbar with its unit in ``label``: in ``cax`` when the layout gives one, else beside ``ax``."""
    if cax is not None:
        return fig.colorbar(mappable, cax=cax, label=label, **kw)
    return fig.colorbar(mappable, ax=ax, label=label, pad=0.01, **kw)


def value_image(
    fig: Figure,
    ax: Axes,
    cax: Optional[Axes],
    values: np.ndarray,
    label: str,
    pad: Optional[np.ndarray] = None,
    dead: Optional[np.ndarray] = None,
    vmax: Optional[float] = None,
    cmap: str = MAGNITUDE_CMAP,
) -> data.Downsampled:
    """Draw a value view: the values (largest per pixel; padding grey), a colourbar and a flag legend.

    ``values`` ``(R, C)`` float; ``pad``/``dead`` bool masks of the same shape. Pixels holding
    NaN, Inf or a dead scale are painted in :data:`FLAG_COLOURS` by a second image, drawn
    only when there is one. Returns what was drawn (the first image holds ``.values`` with
    every flagged pixel masked).
    """
    small, drawn, _ = value_layer(ax, values, pad, dead, vmax, cmap)
    _colourbar(fig, drawn[0], ax, cax, label)
    return small


def value_layer(
    ax: Axes,
    values: np.ndarray,
    pad: Optional[np.ndarray] = None,
    dead: Optional[np.ndarray] = None,
    vmax: Optional[float] = None,
    cmap: str = MAGNITUDE_CMAP,
    finite: bool = False,
) -> tuple[data.Downsampled, list[Artist], Text]:
    """:func:`value_image` without its colourbar: the image, the flag overlay, the flag legend and
    the reduction note (right title). Returns what was drawn, the artists it added (image first)
    and the note (the axes' own right title, set). ``finite``: every value outside ``pad`` is
    known to be finite (:func:`data.reduce_view` then skips the per-element flags)."""
    small, counts = data.memo(data.reduce_view, values, pad, dead, MAX_SIDE, finite)
    top = vmax if vmax is not None else (float(np.nanmax(small.values)) if np.isfinite(small.values).any() else 1.0)
    ext = _extent(small.shape)
    shown = np.ma.masked_array(small.values, mask=small.flags > 0)  # padding: the colour map's grey
    artists: list[Artist] = [ax.imshow(shown, aspect="auto", cmap=_cmap(cmap), vmin=0, vmax=top or 1.0, extent=ext)]
    marked = small.flags > data.FLAG_NAMES.index("padding")
    if marked.any():  # NaN / Inf / dead scale: an overlay (drawn only when there is one: it costs an image)
        overlay = np.zeros(small.flags.shape + (4,))
        for name, colour in FLAG_COLOURS.items():
            overlay[small.flags == data.FLAG_NAMES.index(name)] = to_rgba(colour)
        artists.append(ax.imshow(overlay, aspect="auto", extent=ext))
    if counts:
        handles = [Patch(color=FLAG_COLOURS[n], label=f"{n}: {c:,}") for n, c in counts.items()]
        artists.append(
            ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0, -0.12), ncols=min(4, len(handles)))
        )
    elif ax.get_legend() is not None:
        ax.get_legend().remove()
    note = f"pixel = {small.block[0]}x{small.block[1]} elements (max)" if small.block != (1, 1) else ""
    return small, artists, ax.set_title(note, loc="right", fontsize=MIN_FONT)


def _finite_max(values: np.ndarray) -> float:
    """The largest finite value of ``values`` (1.0 when there is none): a colour scale that stays put."""
    v = np.asarray(values)
    v = v if v.dtype.kind == "f" else v.astype(np.float64)
    with warnings.catch_warnings():  # an all-NaN expert: nanmax warns and says NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        top = float(np.nanmax(v)) if v.size else np.nan  # one pass; the masked pass only when there is Inf
    if not np.isfinite(top):
        finite = v[np.isfinite(v)]
        top = float(finite.max()) if finite.size else 1.0
    return top if top > 0 else 1.0


def title_text(ax: Axes, text: str = " ") -> Text:
    """A plain text at ``ax``'s title place (an Axes title is placed from the tick labels, which a
    layer drawn alone by :func:`svg_only` omits)."""
    return ax.annotate(
        text,
        (0, 1),
        xycoords="axes fraction",
        xytext=(0, rcParams["axes.titlepad"]),
        textcoords="offset points",
        va="baseline",
        fontsize=rcParams["axes.titlesize"],
    )


@styled
def row_permutation_figure(
    m: IndexMap,
    projections: int = 2,
    window: tuple[int, int] = (0, 64),
    colour_by: str = "origin",
    values: Optional[np.ndarray] = None,
    itemsize: int = 1,
    observed: Optional[np.ndarray] = None,
    side: str = "kernel",
    dead: Optional[np.ndarray] = None,
) -> Figure:
    """Source row -> kernel row for ``m``'s row steps (pad, swap, interleave, epilogue shuffle).

    Panels: (1) the window ``(lo, hi)`` of rows on ``side`` ("kernel" or "checkpoint",
    :func:`data.row_window`) with a line from each checkpoint row to its kernel row; each
    side has its own axis listing only the rows in the window (a dashed line marks a
    jump), so a swap offset does not squash the shuffle; (2) every kernel row's source row,
    the window shaded; (3, when ``values`` ``(rows, elements)`` of one expert is given)
    those values moved through the row steps, for the window's kernel rows, with NaN/Inf
    and ``dead`` (bool, like ``values``) scales marked; its colour scale is the expert's
    (the same for every window). ``observed`` ``(out_rows,)``: rows a suspect tensor
    really holds (:func:`data.observed_row_sources`); mismatches are marked with red x.
    Colours: ``colour_by`` in ``RowFlow.colour_modes()``. Every line has hover text
    (checkpoint row, kernel row, group, steps). The window-dependent artists are
    :func:`row_artists`; :func:`show_rows` moves them to another window or side without
    drawing the rest again.
    """
    flow = data.memo(data.row_flow, m, projections)
    flow.groups(colour_by)  # an unknown colouring fails before anything is drawn
    layout = [(0.5, 3.0, 0.1, False), (0.9, 3.2, 1.5, False)]
    fig, axes = panel_row(layout + ([(0.6, 3.4, 0.9, True)] if values is not None else []), 5.2, bottom=0.95)
    (ax_lines, _), (ax_all, _) = axes[:2]
    ax_lines.set_xticks([0, 1], ["checkpoint row", "kernel row"])
    ax_lines.set_yticks([])
    ax_lines.set_xlim(-0.35, 1.35)
    ax_lines.set_ylim(1.03, -0.03)
    for spine in ("left", "right", "top"):
        ax_lines.spines[spine].set_visible(False)
    if flow.out_rows > MAX_POINTS:  # the all-rows image: checkpoint row 0 at the bottom, as in the scatter
        ax_all.set_xlim(-0.5, flow.out_rows - 0.5)
        ax_all.set_ylim(-0.5, flow.in_rows - 0.5)
    else:  # fixed limits: the window's shading (drawn later, moved) must not widen them (path-independent)
        ax_all.set_xlim(-0.5 - 0.05 * flow.out_rows, flow.out_rows - 0.5 + 0.05 * flow.out_rows)
        ax_all.set_ylim(-0.06 * flow.in_rows, flow.in_rows - 0.5 + 0.05 * flow.in_rows)
    ax_all.set_xlabel("kernel row")
    ax_all.set_ylabel("checkpoint row (grey squares: padding)")
    ax_all.set_title(f"all rows (shaded: the window; {int((flow.src_rows < 0).sum())} padding rows)")
    state = dict(m=m, flow=flow, moving=[], drop=[], gids=[], observed=observed, colour_by=None, colour_layer=[])
    state.update(at=None, values_at=None, value_moving=[], value_drop=[], cells={})
    state.update(ax_lines=ax_lines, ax_all=ax_all, title=title_text(ax_lines), values=None, itemsize=itemsize)
    state.update(row_map=data.memo(IndexMap.row_steps, m))
    if values is not None:
        ax_v, cax = axes[2]
        scale = ScalarMappable(Normalize(0, 1), _cmap(MAGNITUDE_CMAP))
        fig.colorbar(scale, cax=cax, label="|value| (dequantized)")
        ax_v.set_ylabel("kernel row")
        ax_v.set_xlabel("element")
        ax_v.set_title("values in the kernel rows", loc="left")
        state.update(ax_v=ax_v, cax=cax, scale=scale, values=None)
    fig._fimoe_rows = state  # type: ignore[attr-defined]
    if values is not None:
        show_values(fig, values, dead)
    show_rows(fig, window, side, colour_by)
    fig.suptitle(" >> ".join(flow.steps))
    return fig


def show_values(fig: Figure, values: np.ndarray, dead: Optional[np.ndarray] = None) -> None:
    """Give a :func:`row_permutation_figure` drawn with values another expert's ``values`` (same
    shape) and ``dead`` in place: the colour scale becomes the expert's (:func:`row_layers`' scale
    layer); the values panel follows at the next :func:`show_rows`. Nothing else is drawn again."""
    s = fig._fimoe_rows  # type: ignore[attr-defined]
    v = np.asarray(values)
    v = v if v.dtype.kind == "f" else v.astype(np.float64)  # the lab's float32 magnitudes: no copy
    top = data.memo(_finite_max, values)
    s["scale"].set_clim(0, top)
    s.update(values=v, dead=None if dead is None else np.asarray(dead), top=top)


def _colour_rows(fig: Figure, colour_by: str) -> None:
    """Colour a :func:`row_permutation_figure` by ``colour_by``: the all-rows panel and its legend
    are drawn anew (:func:`row_layers`' colour layer); the lines follow at the next :func:`show_rows`."""
    s = fig._fimoe_rows  # type: ignore[attr-defined]
    codes, labels = s["flow"].groups(colour_by)
    for artist in s["colour_layer"]:
        artist.remove()
    colours = _group_colours(len(labels))
    s["colour_layer"] = _all_rows_panel(s["ax_all"], s["flow"], codes, labels, colours, colour_by, s["observed"])
    s.update(codes=codes, labels=labels, colours=colours, colour_by=colour_by)


def _all_rows_panel(ax_all: Axes, flow: data.RowFlow, codes, labels, colours, colour_by: str, observed) -> list[Artist]:
    """Panel (2) of :func:`row_permutation_figure`: every kernel row's source row, coloured by group.
    Returns the artists drawn (the colour layer)."""
    out = np.arange(flow.out_rows)
    drawn: list[Artist] = []
    if flow.out_rows <= MAX_POINTS:
        src = np.where(flow.src_rows >= 0, flow.src_rows, np.nan)
        drawn.append(ax_all.scatter(out, src, c=[colours[k] for k in codes], s=6))
        pads = out[flow.src_rows < 0]
        drawn.append(ax_all.scatter(pads, np.full(pads.size, -0.02 * flow.in_rows), c=[PAD_COLOUR], s=6, marker="s"))
    else:  # DeepSeek size: one pixel per (kernel rows, checkpoint rows) block, coloured by the group
        fx, fy = -(-flow.out_rows // MAX_SIDE), -(-flow.in_rows // MAX_SIDE)
        grid = np.zeros((-(-flow.in_rows // fy), -(-flow.out_rows // fx), 4))
        real = flow.src_rows >= 0
        grid[flow.src_rows[real] // fy, out[real] // fx] = np.asarray([to_rgba(c) for c in colours])[codes[real]]
        extent = (-0.5, flow.out_rows - 0.5, -0.5, flow.in_rows - 0.5)  # row 0 at the bottom
        drawn.append(ax_all.imshow(grid, aspect="auto", extent=extent, origin="lower"))
        if (~real).any():
            drawn += ax_all.plot(out[~real][[0, -1]], [-0.02 * flow.in_rows] * 2, "-", color=PAD_COLOUR, lw=4)
    handles = [Patch(color=colours[k], label=labels[k]) for k in sorted(set(codes.tolist()))][:12]
    if observed is not None:
        wrong = np.flatnonzero(observed != flow.src_rows)
        (crosses,) = ax_all.plot(
            wrong,
            np.where(observed[wrong] >= 0, observed[wrong], -0.04 * flow.in_rows),
            "x",
            color="red",
            ms=4,
            label=f"observed != planned ({wrong.size} rows)",
        )
        handles.append(crosses)
        drawn.append(crosses)
    drawn.append(ax_all.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), title=colour_by))
    return drawn


def row_artists(fig: Figure) -> list[Artist]:
    """The artists of a :func:`row_permutation_figure` that depend on the window and side (lines
    and row numbers, the shading, the values and their row ticks), bottom to top."""
    s = fig._fimoe_rows  # type: ignore[attr-defined]
    return list(s["moving"]) + list(s["value_moving"])


def row_layers(fig: Figure) -> list[tuple[object, list[Artist]]]:
    """The moving layers of a :func:`row_permutation_figure`, bottom to top, each with what it
    shows (equal: the same drawing): the colouring (the all-rows panel and its legend), the colour
    scale (the values' colourbar, per expert: :func:`show_values`), the window's rows (lines, row
    numbers, shading: per window, side and colouring) and the window's values (per window and expert)."""
    s = fig._fimoe_rows  # type: ignore[attr-defined]
    layers: list[tuple[object, list[Artist]]] = [(("colour", s["colour_by"]), list(s["colour_layer"]))]
    if s["values"] is not None:
        layers.append((("scale", s["top"]), [s["cax"]]))
    layers.append((("rows", s["at"]), list(s["moving"])))
    if s["values"] is not None:
        layers.append((("values", s["values_at"]), list(s["value_moving"])))
    return layers


@styled
def show_rows(
    fig: Figure, window: tuple[int, int], side: str = "kernel", colour_by: Optional[str] = None
) -> data.RowWindow:
    """Move a :func:`row_permutation_figure` to rows ``window`` ``(lo, hi)`` on ``side`` in place
    (and recolour it by ``colour_by`` when given and new): the lines panel and the shading of the
    all-rows panel are drawn anew when the window, side or colouring changed, the values panel when
    the window, side or values (:func:`show_values`) changed (:func:`row_layers`); the rest stays
    as drawn. Returns the window shown."""
    s = fig._fimoe_rows  # type: ignore[attr-defined]
    flow: data.RowFlow = s["flow"]
    if colour_by is not None and colour_by != s["colour_by"]:
        _colour_rows(fig, colour_by)
    at = (int(window[0]), int(window[1]), side, s["colour_by"])
    cells = s["cells"]
    if at != s["at"]:
        win = data.row_window(flow, window[0], window[1], side)
        texts = hover_texts(fig)
        for artist in s["drop"]:
            artist.remove()
        for gid in s["gids"]:
            texts.pop(gid, None)
        before, row_map = len(texts), s["row_map"]
        drop = _window_lines(s["ax_lines"], win, s["codes"], s["labels"], s["colours"], " >> ".join(flow.steps))
        s["gids"] = list(texts)[before:]
        s["title"].set_text(f"{side} rows {win.lo}..{win.hi - 1} (dashed: rows skipped)")
        ax_all = s["ax_all"]
        span = ax_all.axvspan if side == "kernel" else ax_all.axhspan
        drop.append(span(win.lo - 0.5, win.hi - 0.5, color="gold", alpha=0.3))
        cells[id(ax_all)] = [data.Cells("kernel", row_map, 1, (flow.out_rows, 1), transpose=True)]
        nc, nk = max(len(win.ckpt_rows) - 1, 1), max(len(win.kernel_rows) - 1, 1)
        cells[id(s["ax_lines"])] = [
            data.Cells(
                "checkpoint",
                row_map,
                1,
                (len(win.ckpt_rows), 1),
                win.ckpt_rows,
                None,
                (nc, 1),
                x_range=(-1, 0.5),
                x_at=0,
            ),
            data.Cells(
                "kernel",
                row_map,
                1,
                (len(win.kernel_rows), 1),
                win.kernel_rows,
                None,
                (nk, 1),
                x_range=(0.5, 2),
                x_at=1,
            ),
        ]
        s.update(moving=[s["title"], *drop], drop=drop, window=win, at=at)
    win = s["window"]
    values_at = (id(s["values"]), at[:3])
    if s["values"] is not None and values_at != s["values_at"]:
        ax_v, row_map = s["ax_v"], s["row_map"]
        for artist in s["value_drop"]:
            artist.remove()
        src = data.row_element_sources(row_map, win.kernel_rows, s["itemsize"])
        pad = src < 0
        moved = np.where(pad, np.nan, s["values"].reshape(-1)[np.maximum(src, 0)])
        bad = None if s["dead"] is None else s["dead"].reshape(-1)[np.maximum(src, 0)] & ~pad
        _, drawn, note = value_layer(ax_v, moved, pad, bad, s["top"])
        ax_v.set_yticks(*_row_ticks(win.kernel_rows))
        cells[id(ax_v)] = [data.Cells("kernel", row_map, s["itemsize"], moved.shape, win.kernel_rows, moved)]
        s.update(value_moving=[*drawn, note, *ax_v.yaxis.findobj()], value_drop=drawn, values_at=values_at)
    fig._fimoe_cells = cells  # type: ignore[attr-defined]
    return win  # type: ignore[no-any-return]


def _window_lines(ax: Axes, win: data.RowWindow, codes, labels, colours, chain: str) -> list[Artist]:
    """The lines panel of a row window: a line per (checkpoint row, kernel row), row numbers, jumps."""
    drawn: list[Artist] = []
    cpos, kpos = win.positions()
    nc, nk = max(len(win.ckpt_rows) - 1, 1), max(len(win.kernel_rows) - 1, 1)
    for (c, k), cp, kp in zip(win.pairs, cpos, kpos):
        group = labels[codes[k]]
        if c >= 0:
            (line,) = ax.plot([0, 1], [cp / nc, kp / nk], color=colours[codes[k]], lw=1.2)
            hover(line, f"checkpoint row {c} ({group}) -> kernel row {k}\nsteps: {chain}")
        else:
            (line,) = ax.plot([1], [kp / nk], marker="s", color=PAD_COLOUR, ms=4)
            hover(line, f"kernel row {k}: padding\nsteps: {chain}")
        drawn.append(line)
    for x, rows, n, ha in ((0, win.ckpt_rows, nc, "right"), (1, win.kernel_rows, nk, "left")):
        step = max(1, -(-len(rows) // 24))
        for p in range(0, len(rows), step):
            drawn.append(
                ax.text(x + (-0.04 if x == 0 else 0.04), p / n, str(rows[p]), ha=ha, va="center", fontsize=MIN_FONT)
            )
        for g in data.RowWindow.gaps(rows):
            drawn += ax.plot([x - 0.06, x + 0.06], [(g - 0.5) / n] * 2, ls="--", color="0.5", lw=1)
    return drawn


def _chain(m: IndexMap) -> str:
    """``m``'s step kinds joined by ``>>`` (its full name, with every parameter, is in the message line)."""
    return " >> ".join(s.kind for s in m.steps)


def _row_ticks(rows: np.ndarray) -> tuple[list[int], list[str]]:
    """Tick positions (image rows) and labels (their row numbers), at most 16."""
    step = max(1, -(-len(rows) // 16))
    pos = list(range(0, len(rows), step))
    return pos, [str(rows[p]) for p in pos]


@styled
def tile_figure(m: IndexMap, itemsize: int = 1, colour_by: str = "source column") -> Figure:
    """Block-major-K re-tiling: each input element's K block, and each tile element's source.

    Left: the input ``[M, K]`` coloured by the K block (of ``bk`` bytes) it lands in.
    Right: the output ``(K/bk, M, bk)`` drawn as ``(K/bk * M, bk)``, coloured by source
    ``colour_by`` ("source column" or "source row"); lines separate the K blocks.
    """
    view = data.memo(data.tile_view, m, itemsize)
    shown = {"source column": view.src_col, "source row": view.src_row}
    if colour_by not in shown:
        raise LayoutError(f"cannot colour tiles by {colour_by!r}", fix=f"choose one of {', '.join(shown)}")
    fig, ((ax_in, cax_in), (ax_out, cax_out)) = panel_row([(0.8, 3.8, 0.9, True), (0.8, 3.8, 1.0, True)], 5.2)
    sample, _ = data.sample_grid(view.block_of_input, MAX_INDEX_SIDE)
    im = ax_in.imshow(
        _masked(sample),
        aspect="auto",
        cmap=_categorical(view.blocks),
        vmin=-0.5,
        vmax=view.blocks - 0.5,
        extent=_extent(view.block_of_input.shape),
    )
    ticks = range(0, view.blocks, max(1, view.blocks // 16))
    _colourbar(fig, im, ax_in, cax_in, "K block in the output (index)", ticks=ticks)
    ax_in.set_title(f"input [{view.block_of_input.shape[0]}, {view.block_of_input.shape[1]}] elements")
    ax_in.set_xlabel("column (element)")
    ax_in.set_ylabel("row")
    step = _index_image(fig, ax_out, cax_out, shown[colour_by], f"{colour_by} (element index)")
    if view.blocks <= 64:
        for b in range(1, view.blocks):
            ax_out.axhline(b * view.rows - 0.5, color="white", lw=1)
    ax_out.set_title(
        f"output ({view.blocks}, {view.rows}, {view.block_cols}) as ({view.blocks}x{view.rows}, {view.block_cols})"
        + (f", every {step[0]}th row" if step[0] > 1 else ""),
        loc="left",
    )
    ax_out.set_xlabel("element in block")
    ax_out.set_ylabel("K block x row")
    fig.suptitle(_chain(m))
    fig._fimoe_cells = {  # type: ignore[attr-defined]
        id(ax_in): [
            data.Cells(
                "checkpoint", m, itemsize, view.block_of_input.shape, values=view.block_of_input, meaning="K block"
            )
        ],
        id(ax_out): [
            data.Cells("kernel", m, itemsize, shown[colour_by].shape, values=shown[colour_by], meaning=colour_by)
        ],
    }
    return fig


SWIZZLE_COLOURS = ("scale value", "source row", "source column")
"""What the swizzled buffer of :func:`swizzle_figure` can be coloured by (``values`` needed for the first)."""

DETAIL_ATOMS = 8
"""Atoms of a large swizzled buffer (more than twice this) that :func:`swizzle_figure` shows at once, one
buffer line per scale line: the page holding the chosen atom (a real-size buffer, R1's 3584 atoms, drawn
whole would put hundreds of lines in a pixel; where every atom lands is the linear panel's picture)."""


@styled
def swizzle_figure(
    m: IndexMap, itemsize: int = 1, atom: int = 0, colour_by: str = "source row", values: Optional[np.ndarray] = None
) -> Figure:
    """The 128x4 scale swizzle, atom by atom.

    Left: the linear scale matrix ``[rows, cols]`` coloured by the atom each scale lands
    in, the scales of atom ``atom`` veiled white. Middle: the swizzled buffer as
    ``(atoms*32, 16)`` coloured by ``colour_by`` (:data:`SWIZZLE_COLOURS`: "scale value" draws
    ``values``, one expert's decoded scales ``[rows, cols]`` in the checkpoint layout, moved into
    the buffer, largest per pixel; else the source row or column index; grey: padding), the atom shaded;
    a buffer of more than ``2 * DETAIL_ATOMS`` atoms shows the page of :data:`DETAIL_ATOMS` atoms that
    holds atom ``atom``, a line per scale line (the whole buffer at that size is hundreds of lines a pixel). Right:
    atom ``atom`` close up: 32 lines of 4 groups of 4 scales; each group is one kernel row
    (a row of the swizzle's input) and is labelled ``k<kernel row> <- c<checkpoint row>``;
    colour: source column. Each group has hover text (kernel and checkpoint row and columns).
    The atom-dependent artists are :func:`atom_artists`; :func:`show_atom` moves them to
    another atom without drawing the figure again.
    """
    view = data.memo(data.swizzle_view, m, itemsize)
    _check_atom(view, atom)
    fig, ((ax_lin, cax_lin), (ax_buf, cax_buf), (ax_atom, cax_atom)) = panel_row(
        [(0.8, 3.0, 1.0, True), (0.8, 3.0, 1.0, True), (0.7, 5.4, 1.0, True)], 6.6, bottom=0.6
    )
    sample, _ = data.sample_grid(view.dest_atom, MAX_INDEX_SIDE)
    im = ax_lin.imshow(
        _masked(sample),
        aspect="auto",
        cmap=_categorical(min(view.atoms, 20)) if view.atoms <= 20 else _cmap("viridis"),
        vmin=-0.5,
        vmax=view.atoms - 0.5,
        extent=_extent(view.dest_atom.shape),
    )
    veil = ax_lin.imshow(np.zeros((1, 1, 4)), aspect="auto", extent=_extent(view.dest_atom.shape))
    _colourbar(fig, im, ax_lin, cax_lin, "destination atom (index; veiled: the chosen one)")
    ax_lin.set_title(f"linear scales [{view.dest_atom.shape[0]}, {view.dest_atom.shape[1]}]")
    ax_lin.set_xlabel("scale column")
    ax_lin.set_ylabel("checkpoint row")
    if colour_by not in SWIZZLE_COLOURS or (colour_by == "scale value" and values is None):
        raise LayoutError(
            f"the swizzled buffer cannot be coloured by {colour_by!r}"
            + (" without the expert's scales" if colour_by == "scale value" else ""),
            fix=f"colour by one of {', '.join(SWIZZLE_COLOURS)} (scale value: pass values)",
        )
    paged = view.atoms > 2 * DETAIL_ATOMS
    if colour_by == "scale value":
        assert values is not None
        buffer = np.where(view.src_row >= 0, values[np.maximum(view.src_row, 0), np.maximum(view.src_col, 0)], np.nan)
        if paged:  # the colour scale is the whole buffer's, every page drawn against it
            top = data.memo(_finite_max, values)
            _colourbar(
                fig, ScalarMappable(Normalize(0, top), _cmap(MAGNITUDE_CMAP)), ax_buf, cax_buf, "scale (decoded)"
            )
        else:
            step = value_image(fig, ax_buf, cax_buf, buffer, "scale (decoded)", pad=view.src_row < 0).block
        buffer_meaning = "value"
    else:
        buffer = view.src_row if colour_by == "source row" else view.src_col
        top = float(max(buffer.max(), 0))
        if paged:
            label = f"{colour_by} (checkpoint index)"
            _colourbar(fig, ScalarMappable(Normalize(0, top), _cmap("viridis")), ax_buf, cax_buf, label)
        else:
            step = _index_image(fig, ax_buf, cax_buf, buffer, f"{colour_by} (checkpoint index)")
        buffer_meaning = colour_by
    span = ax_buf.axhspan(-0.5, 31.5, color="red", alpha=0.3)
    buffer_title = ax_buf.set_title(
        f"swizzled buffer: {view.atoms} atoms x 512"
        + (
            ""
            if paged or step[0] == 1
            else f" (largest of {step[0]} lines per pixel)"
            if colour_by == "scale value"
            else f" (every {step[0]}th line)"
        ),
        loc="left",
    )
    ax_buf.set_xlabel("offset % 16")
    ax_buf.set_ylabel("offset // 16")
    zoom = ax_atom.imshow(np.zeros((32, 16)), aspect="auto", cmap=_cmap("tab10"), vmin=-0.5, vmax=9.5)
    _colourbar(fig, zoom, ax_atom, cax_atom, "source column (scale index, mod 10 colours)")
    rules = [ax_atom.axvline(x, color="white", lw=1.5) for x in (3.5, 7.5, 11.5)]
    labels = [
        ax_atom.text(4 * g + 1.5, line, "", ha="center", va="center", fontsize=MIN_FONT, color="#111111")
        for line in range(32)
        for g in range(4)
    ]
    for label in labels:
        hover(label, "")
    ax_atom.set_xticks([1.5, 5.5, 9.5, 13.5], ["group 0", "group 1", "group 2", "group 3"])
    ax_atom.set_yticks(range(0, 32, 4))
    ax_atom.set_ylabel("line (16 scales)")
    title = title_text(ax_atom)
    fig.suptitle(_chain(m))
    fig._fimoe_cells = {  # type: ignore[attr-defined]
        id(ax_lin): [
            data.Cells(
                "checkpoint", m, itemsize, view.dest_atom.shape, values=view.dest_atom, meaning="destination atom"
            )
        ],
        id(ax_buf): [
            data.Cells("kernel", m, itemsize, view.src_row.shape, values=buffer, width=16, meaning=buffer_meaning)
        ],
    }
    moving = dict(veil=veil, span=span, zoom=zoom, rules=rules + list(ax_atom.spines.values()), labels=labels)
    fig._fimoe_atom = dict(ax=ax_atom, m=m, itemsize=itemsize, view=view, title=title, **moving)  # type: ignore[attr-defined]
    if paged:  # the buffer panel shows a page of atoms: it moves with the atom (show_atom)
        fig._fimoe_atom.update(  # type: ignore[attr-defined]
            page=None, page_drop=[], page_moving=[], ax_buf=ax_buf, buffer=buffer, top=top, meaning=buffer_meaning
        )
        fig._fimoe_atom["buffer_title"] = buffer_title  # type: ignore[attr-defined]
    show_atom(fig, atom)
    return fig


def _show_page(fig: Figure, atom: int) -> int:
    """Draw the page of :data:`DETAIL_ATOMS` atoms holding ``atom`` on the buffer panel of a paged
    :func:`swizzle_figure` (one buffer line per scale line, row ticks in buffer lines; values with their
    NaN / Inf flags and padding grey, against the whole buffer's colour scale), unless it is shown.
    Returns the page's first atom."""
    a = fig._fimoe_atom  # type: ignore[attr-defined]
    view: data.SwizzleView = a["view"]
    first = atom // DETAIL_ATOMS * DETAIL_ATOMS
    if a["page"] == first:
        return first
    ax: Axes = a["ax_buf"]
    for artist in a["page_drop"]:
        artist.remove()
    lines = slice(first * 32, min(view.atoms, first + DETAIL_ATOMS) * 32)
    window = a["buffer"][lines]
    pad = view.src_row[lines] < 0
    if a["meaning"] == "value":
        _, drawn, note = value_layer(ax, window, pad, None, a["top"])
        extra: list[Artist] = [note]
    else:
        shown = np.ma.masked_array(window, mask=pad)
        drawn = [
            ax.imshow(
                shown, aspect="auto", cmap=_cmap("viridis"), vmin=0, vmax=a["top"] or 1.0, extent=_extent(window.shape)
            )
        ]
        extra = []
    ax.set_ylim(window.shape[0] - 0.5, -0.5)
    ticks = list(range(0, window.shape[0], 32))
    ax.set_yticks(ticks, [str(lines.start + t) for t in ticks])
    last = lines.stop // 32 - 1
    a["buffer_title"].set_text(f"swizzled buffer: atoms {first}..{last} of {view.atoms} (x 512)")
    rows = np.arange(lines.start, lines.stop)
    cells_of(fig)[id(ax)] = [
        data.Cells("kernel", a["m"], a["itemsize"], window.shape, rows, window, width=16, meaning=a["meaning"])
    ]
    a.update(page=first, page_drop=drawn, page_moving=[*drawn, *extra, a["buffer_title"], *ax.yaxis.findobj()])
    return first


def _check_atom(view: data.SwizzleView, atom: int) -> None:
    if not 0 <= atom < view.atoms:
        raise LayoutError(
            f"atom {atom} is outside 0..{view.atoms - 1} of {view.name}", fix=f"pick an atom in 0..{view.atoms - 1}"
        )


def atom_artists(fig: Figure) -> list[Artist]:
    """The artists of a :func:`swizzle_figure` that depend on the atom shown (veil, buffer band,
    close-up image with its group rules and frame, its 128 labels and its title), bottom to top."""
    a = fig._fimoe_atom  # type: ignore[attr-defined]
    return [a["veil"], *a.get("page_moving", []), a["span"], a["zoom"], *a["rules"], a["title"], *a["labels"]]


def show_atom(fig: Figure, atom: int) -> None:
    """Move a :func:`swizzle_figure` to atom ``atom`` in place: shade buffer lines
    ``32*atom .. 32*atom+31`` (of a large buffer: on the page of atoms holding it, :func:`_show_page`), veil their sources (the scales with ``dest_atom == atom``) on
    the linear panel (a reduced pixel is veiled when it holds one), and redraw the close-up
    (``src_col % 10`` of those lines, grey fill) with its labels, hover texts and title; the
    grid, axes and colourbars stay as drawn."""
    a = fig._fimoe_atom  # type: ignore[attr-defined]
    view: data.SwizzleView = a["view"]
    _check_atom(view, atom)
    lines = slice(atom * 32, (atom + 1) * 32)
    zoom_col, zoom_row, zoom_k = view.src_col[lines], view.src_row[lines], view.kernel_row[lines]
    # the veil: a pixel of the reduced linear panel is white when it holds a scale of the atom
    fr, fc = data.reduction(view.dest_atom.shape, MAX_SIDE)
    overlay = np.zeros((-(-view.dest_atom.shape[0] // fr), -(-view.dest_atom.shape[1] // fc), 4))
    real = zoom_row >= 0
    overlay[zoom_row[real] // fr, zoom_col[real] // fc] = to_rgba("white", 0.7)
    a["veil"].set_data(overlay)
    first = _show_page(fig, atom) if "page" in a else 0
    a["span"].set_y((atom - first) * 32 - 0.5)
    zoom_kc = view.kernel_col[lines]
    a["zoom"].set_data(np.ma.masked_array(zoom_col % 10, mask=zoom_col < 0))
    texts = hover_texts(fig)
    for i, label in enumerate(a["labels"]):
        line, g = divmod(i, 4)
        k, c = int(zoom_k[line, 4 * g]), int(zoom_row[line, 4 * g])
        label.set_text(f"k{k} <- " + (f"c{c}" if c >= 0 else "pad"))
        cols = zoom_col[line, 4 * g : 4 * g + 4]
        texts[label.get_gid()] = (
            f"buffer offsets {512 * atom + 16 * line + 4 * g}..{512 * atom + 16 * line + 4 * g + 3}\n"
            f"kernel row {k}, columns {int(zoom_kc[line, 4 * g])}..{int(zoom_kc[line, 4 * g + 3])}\n"
            + (f"checkpoint row {c}, columns {cols.min()}..{cols.max()}" if c >= 0 else "padding")
            + "\nstep: swizzle_scales_128x4"
        )
    rb, cb = view.atom_origin[atom]
    zoom_rows = np.arange(32 * atom, 32 * atom + 32)
    cells_of(fig)[id(a["ax"])] = [
        data.Cells(
            "kernel", a["m"], a["itemsize"], (32, 16), zoom_rows, view.src_col[lines], width=16, meaning="source column"
        )
    ]
    a["title"].set_text(
        f"atom {atom}: kernel rows {128 * rb}..{128 * rb + 127}, cols {4 * cb}..{4 * cb + 3} "
        "(k: kernel row, c: checkpoint row)"
    )


def svg_without(fig: Figure, moving: Sequence[Artist]) -> str:
    """:func:`to_svg` of ``fig`` with ``moving`` hidden: the layer a view draws once when later
    changes touch only ``moving`` (see :func:`svg_only`, :func:`stack_svg`)."""
    shown = [x.get_visible() for x in moving]
    try:
        for x in moving:
            x.set_visible(False)
        return to_svg(fig)
    finally:
        for x, v in zip(moving, shown):
            x.set_visible(v)


def svg_only(fig: Figure, moving: Sequence[Artist]) -> str:
    """The SVG content (no ``<svg>`` element) of ``moving`` alone, in :func:`to_svg`'s coordinates:
    no figure or axes background, ticks, spines or other artists are drawn, so it costs only
    ``moving``. Put it over :func:`svg_without` with :func:`stack_svg`."""
    keep = {id(c) for x in moving for c in x.findobj()}  # an artist with its parts (a legend's texts)
    path = {id(fig)} | {id(x.axes) for x in moving if x.axes is not None}  # drawn only to reach ``moving``
    hidden: list[Artist] = []

    def hide(parent: Artist) -> None:  # hiding an artist skips its parts: only the top of each hidden branch is set
        for x in parent.get_children():
            if id(x) in keep:
                continue
            if id(x) in path:
                hide(x)
            elif x.get_visible():
                x.set_visible(False)
                hidden.append(x)

    try:
        hide(fig)
        top = to_svg(fig)
    finally:
        for x in hidden:
            x.set_visible(True)
    return top[top.index(">", top.index("<svg")) + 1 : top.rindex("</svg>")]


LAYER = "fimoe-layer"
"""The class of the group :func:`stack_svg` draws a moving layer in."""


def stack_svg(base: str, *tops: str) -> str:
    """The SVG ``base`` with the layers ``tops`` (:func:`svg_only`) drawn over it in order, as one valid SVG."""
    return base[: base.rindex("</svg>")] + "".join(f'<g class="{LAYER}">{top}</g>' for top in tops) + "</svg>"


MAX_MASK_SIDE = MAX_SIDE


def coarse_mask(mask: np.ndarray, max_side: int = MAX_MASK_SIDE) -> tuple[np.ndarray, tuple[int, int]]:
    """``mask`` reduced to at most ``max_side`` per side: a pixel is True when any element in its
    block is (so thin padding stays visible). Returns the mask and the block ``(rows, cols)``."""
    return data.reduce_mask(mask, max_side)


@styled
def padding_figure(report: data.PaddingReport) -> Figure:
    """Padding of every tensor of a layer: the padded matrix (top) and the kernel layout (bottom).

    Padding is drawn dark, data light (legend below); each title gives the tensor's padding
    bytes per expert. Axes are in elements; masks wider than 512 are drawn with
    :func:`coarse_mask` (the title gives the block).
    """
    names = list(report.tensors)
    if not names:
        raise LayoutError(
            f"{report.plan.description} pads nothing and moves nothing: no tensor to draw",
            fix="pick another backend, format or alignment",
        )
    fig = Figure(figsize=(3.4 * len(names), 6.8), layout="constrained")
    colours = [(0.93, 0.93, 0.85), (0.55, 0.1, 0.1)]
    cmap = ListedColormap(colours)
    for k, name in enumerate(names):
        t = report.tensors[name]
        for row, (mask, where) in enumerate(((t.padded_mask, "padded"), (t.kernel_mask, "kernel layout"))):
            ax = fig.add_subplot(2, len(names), row * len(names) + k + 1)
            shown, block = coarse_mask(mask)
            ax.imshow(shown, aspect="auto", cmap=cmap, vmin=0, vmax=1, extent=_extent(mask.shape))
            note = f"\n{t.fill_bytes:,} B of {t.out_bytes:,} B pad" if row == 0 else ""
            note += f"\n(pixel = {block[0]}x{block[1]} elements)" if block != (1, 1) else ""
            ax.set_title(f"{name} {where} {mask.shape}{note}")
            ax.set_xlabel("element")
            if k == 0:
                ax.set_ylabel("row")
    fig.legend(
        handles=[Patch(color=colours[0], label="data"), Patch(color=colours[1], label="padding")],
        loc="outside lower center",
        ncols=2,
    )
    fig.suptitle(report.summary(), wrap=True)
    return fig


@styled
def provenance_figure(
    m: IndexMap,
    coords: Sequence[int],
    before: np.ndarray,
    itemsize: int = 1,
    dead: Optional[np.ndarray] = None,
    values_per_byte: int = 1,
) -> Figure:
    """Where one kernel element comes from, on real values.

    ``values_per_byte``: 2 for packed FP4 weights (each drawn element is a byte of two values, its
    larger magnitude shown; titles say bytes), else 1 (titles say elements).

    Left: ``before``, one expert's checkpoint-layout values ``(rows, elements)`` (e.g.
    dequantized magnitudes) with the source marked; right: the same values moved
    through ``m`` (the kernel layout, :func:`data.display_2d`) with the chosen element ``coords`` (in ``m.out_shape`` elements) marked.
    NaN/Inf and ``dead`` scales (bool like ``before``) are marked on both. The step chain
    is printed below. The expert's part (:func:`provenance_layer`) is drawn by
    :func:`show_provenance_values`, the element's by :func:`show_provenance_element`: an
    explorer moves both in place.
    """
    fig = _provenance_base(m, tuple(before.shape), itemsize, values_per_byte)
    show_provenance_values(fig, before, dead)
    show_provenance_element(fig, coords)
    return fig


def _provenance_base(m: IndexMap, before_shape: tuple[int, ...], itemsize: int, values_per_byte: int = 1) -> Figure:
    """The part of :func:`provenance_figure` that depends only on ``m`` and the shapes: axes,
    titles, colourbars (their scale set per expert), the markers and the chain text."""
    out = m.out_shape[:-1] + (m.out_shape[-1] // itemsize,)
    after_shape = (math.prod(out[:-1]), out[-1])
    fig, ((ax_b, cax_b), (ax_a, cax_a)) = panel_row(
        [(0.8, 4.4, 1.0, True), (0.8, 4.4, 1.0, True)], 6.8, top=0.4, bottom=2.1
    )
    scale = ScalarMappable(Normalize(0, 1), _cmap(MAGNITUDE_CMAP))
    for ax, cax, what, shape in ((ax_b, cax_b, "checkpoint", before_shape), (ax_a, cax_a, "kernel", after_shape)):
        fig.colorbar(scale, cax=cax, label="|value| (dequantized)")
        ax.set_xlim(-0.5, shape[1] - 0.5)
        ax.set_ylim(shape[0] - 0.5, -0.5)
        unit = "elements" if values_per_byte == 1 else f"bytes ({values_per_byte} values each)"
        ax.set_title(f"{what} layout {tuple(shape)} {unit}", loc="left")
    markers = [ax_b.plot(np.nan, np.nan, **MARKER)[0], ax_a.plot(np.nan, np.nan, **MARKER)[0]]
    chain = fig.text(0.01, 1.35 / 6.8, " ", family="monospace", fontsize=MIN_FONT, va="top")
    fig._fimoe_prov = dict(  # type: ignore[attr-defined]
        m=m,
        itemsize=itemsize,
        axes=(ax_b, ax_a),
        caxes=(cax_b, cax_a),
        scale=scale,
        markers=markers,
        chain=chain,
        drawn=[],
        notes=[],
        values=None,
        after=None,
        out=out,
        gathered=OrderedDict(),
    )
    return fig


GATHERED_KEPT = 2
"""Experts whose kernel-layout values a :func:`provenance_figure` keeps (built only when some value is
NaN/Inf or some scale dead: one R1 w13 expert ~60 MB; else a :class:`data.Gathered`, a few bytes)."""


@styled
def show_provenance_values(fig: Figure, before: np.ndarray, dead: Optional[np.ndarray] = None) -> None:
    """Give a :func:`provenance_figure` another expert's ``before`` values (same shape) and ``dead``
    in place: both heatmaps, their flag legends and notes, and the colour scale (the expert's)."""
    s = fig._fimoe_prov  # type: ignore[attr-defined]
    m, itemsize = s["m"], s["itemsize"]
    for artist in s["drawn"]:
        artist.remove()
    finite = data.memo(data.all_finite, before)  # then so is every kernel value but padding
    kept = s["gathered"]  # the last experts' kernel-layout values: going back to one gathers nothing
    key = (id(before), id(dead))
    if key not in kept:
        live = dead if dead is not None and bool(np.any(dead)) else None  # usually no dead scale: nothing to flag
        if finite and live is None:  # only padding to flag: reduced without building the kernel layout
            after: np.ndarray | data.Gathered = data.Gathered(m, before, itemsize)
        else:
            after = data.display_2d(data.gather_values(m, before, itemsize))
        kept[key] = (before, dead, after, None if live is None else data.gather_mask(m, live, itemsize))
        while len(kept) > GATHERED_KEPT:
            kept.popitem(last=False)
    kept.move_to_end(key)
    after2, dead_after = kept[key][2:]
    dead = dead if dead_after is not None else None
    vmax = data.memo(_finite_max, before)
    s["scale"].set_clim(0, vmax)
    pad = data.memo(data.fill_mask, m, itemsize) if data.has_fill(m) else None
    ax_b, ax_a = s["axes"]
    drawn, notes = [], []
    for ax, v, p, d in ((ax_b, before, None, dead), (ax_a, after2, pad, dead_after)):
        _, artists, note = value_layer(ax, v, p, d, vmax, finite=finite)
        drawn += artists
        notes.append(note)
    s.update(drawn=drawn, notes=notes, values=before, after=after2)
    fig._fimoe_cells = {  # type: ignore[attr-defined]
        id(ax_b): [data.Cells("checkpoint", m, itemsize, before.shape, values=before)],
        id(ax_a): [data.Cells("kernel", m, itemsize, after2.shape, values=after2)],
    }


def provenance_layer(fig: Figure) -> list[Artist]:
    """The artists of a :func:`provenance_figure` that :func:`show_provenance_values` changes
    (images, flag legends, notes, colourbars): an explorer renders them per expert."""
    s = fig._fimoe_prov  # type: ignore[attr-defined]
    return [*s["drawn"], *s["notes"], *s["caxes"]]


def provenance_element(fig: Figure) -> list[Artist]:
    """The artists of a :func:`provenance_figure` that :func:`show_provenance_element` moves (markers, chain)."""
    s = fig._fimoe_prov  # type: ignore[attr-defined]
    return [*s["markers"], s["chain"]]


def show_provenance_element(fig: Figure, coords: Sequence[int]) -> list:
    """Mark kernel element ``coords`` (in ``m.out_shape`` elements) and its source on a
    :func:`provenance_figure` and print its chain of steps; returns the chain
    (:func:`data.provenance_rows`)."""
    s = fig._fimoe_prov  # type: ignore[attr-defined]
    chain = data.provenance_rows(s["m"], tuple(coords), s["itemsize"])
    flat = int(np.ravel_multi_index(tuple(coords), s["out"]))
    ar, ac = divmod(flat, s["after"].shape[1])
    source = chain[-1][2]
    points = [(source[-1], source[0]) if source is not None else (np.nan, np.nan), (ac, ar)]
    for line, (x, y) in zip(s["markers"], points):
        line.set_data([x], [y])
    s["chain"].set_text(chain_text(chain))
    s["points"] = points
    return chain


def chain_text(chain: list) -> str:
    """A provenance chain (:func:`data.provenance_rows`) as lines ``coords in shape stage``."""
    return "\n".join(
        f"{('padding' if c is None else str(c)):<16} in {str(shape):<16} {stage}" for stage, shape, c in chain
    )


MARKER = dict(marker="o", ms=12, mfc="none", mec="red", mew=2)
"""The chosen element's marker on a value view."""


def marker_svg(ax: Axes, x: float, y: float) -> str:
    """An SVG circle drawn like :data:`MARKER` at data ``(x, y)`` of ``ax``, in :func:`to_svg`'s coordinates
    (points from the top left), for moving a marker without rendering the figure again."""
    if not (np.isfinite(x) and np.isfinite(y)):
        return ""
    fig = ax.get_figure(root=True)
    px, py = ax.transData.transform((x, y))
    scale = 72.0 / fig.dpi
    height = fig.get_size_inches()[1] * 72.0
    r = MARKER["ms"] / 2
    return (
        f'<circle cx="{px * scale:.2f}" cy="{height - py * scale:.2f}" r="{r}" fill="none" '
        f'stroke="red" stroke-width="{MARKER["mew"]}"/>'
    )


def cells_of(fig: Figure) -> dict[int, list[data.Cells]]:
    """``{id(axes): [data.Cells]}``: what a point on each pointable axes of ``fig`` means (a
    click traces it, :func:`data.trace_cell`); empty for figures without cells."""
    if not hasattr(fig, "_fimoe_cells"):
        fig._fimoe_cells = {}  # type: ignore[attr-defined]
    return fig._fimoe_cells  # type: ignore[attr-defined,no-any-return]


def cell_at(fig: Figure, x: float, y: float) -> Optional[tuple[Axes, data.Cells, int, int]]:
    """The cell under point ``(x, y)`` of :func:`to_svg`'s coordinates: ``(axes, cells, grid row,
    grid column)``, or None where no pointable axes has a cell (:func:`cells_of`)."""
    hit = at_svg_point(fig, x, y)
    if hit is None:
        return None
    ax, dx, dy = hit
    for cells in cells_of(fig).get(id(ax), []):
        found = cells.locate(dx, dy)
        if found is not None:
            return ax, cells, found[0], found[1]
    return None


def trace_markers(fig: Figure, trace: data.Trace) -> str:
    """SVG circles (:func:`marker_svg`) on every pointable axes of ``fig`` that draws ``trace``'s
    element, kernel or checkpoint side."""
    out = []
    for ax in fig.axes:
        for cells in cells_of(fig).get(id(ax), []):
            at = cells.place(trace)
            if at is not None:
                out.append(marker_svg(ax, *at))
    return "".join(out)


def at_svg_point(fig: Figure, x: float, y: float) -> Optional[tuple[Axes, float, float]]:
    """The axes under point ``(x, y)`` of :func:`to_svg`'s coordinates (points from the top left,
    what a click on the SVG reports) and the data coordinates there (the inverse of
    :func:`marker_svg`); None outside every axes."""
    scale = fig.dpi / 72.0
    px, py = x * scale, (fig.get_size_inches()[1] * 72.0 - y) * scale
    for ax in fig.axes:
        if ax.bbox.contains(px, py):
            dx, dy = ax.transData.inverted().transform((px, py))
            return ax, float(dx), float(dy)
    return None


@styled
def compare_figure(
    m: IndexMap,
    checkpoint: np.ndarray,
    kernel: np.ndarray,
    itemsize: int = 1,
    title: str = "",
    unit: str = "value (as given)",
) -> Figure:
    """Debugging view: a kernel-layout tensor taken back through ``m.inverse()``, next to the checkpoint.

    ``unit``: what the arrays hold, as the colourbars name it (``"<what> (<unit>)"``: e.g. "scale (decoded)",
    or "stored byte (code)" for raw bytes, which hover text then calls a stored byte, not a value).

    ``checkpoint``: one expert's values ``(rows, elements)`` in the checkpoint layout;
    ``kernel``: the same expert's values as some preparation left them (``m.out_shape``
    in elements). A correct preparation gives back the checkpoint exactly (difference 0);
    a missing or extra step shows as a broken pattern and a non-zero difference. NaN and
    Inf are marked on every panel.
    """
    recovered = data.gather_values(m.inverse(), kernel, itemsize)
    diff = np.abs(recovered - checkpoint)
    fig, axes = panel_row([(0.7, 3.2, 1.0, True)] * 3, 5.0, bottom=0.95)
    finite = np.isfinite(checkpoint)
    vmax = float(np.abs(checkpoint[finite]).max()) if finite.any() else 1.0
    diff_max = float(np.nanmax(np.where(np.isfinite(diff), diff, np.nan))) if np.isfinite(diff).any() else 0.0
    for k, (img, name) in enumerate(
        (
            (checkpoint, "checkpoint"),
            (recovered, "kernel tensor, un-done by the plan"),
            (diff, f"|difference|: max {diff_max:.3g}"),
        )
    ):
        ax, cax = axes[k]
        value_image(
            fig,
            ax,
            cax,
            img,
            f"|difference| ({unit.split(' (')[0]} units)" if k == 2 else unit,
            None,
            None,
            vmax,
            "magma" if k == 2 else MAGNITUDE_CMAP,
        )
        ax.set_title(name, loc="left")
        ax.set_xlabel("element")
        meaning = "stored byte" if unit.startswith("stored byte") else "value"
        cells_of(fig)[id(ax)] = [data.Cells("checkpoint", m, itemsize, img.shape, values=img, meaning=meaning)]
    fig.suptitle(title or _chain(m))
    return fig


def _token_columns(sweep) -> list[str]:
    """The sweep's tactic-count columns ``t<T>``, in order."""
    return [c for c in sweep.columns if c.startswith("t") and c[1:].isdigit()]


@styled
def tuner_figure(sweep, tokens: Optional[int] = None) -> Figure:
    """The tuner's tactic heatmap: tactics per (intermediate alignment, hidden alignment).

    ``sweep``: the DataFrame of :func:`fimoe_lab.tune.sweep.sweep` (columns
    ``inter_align``, ``hidden_align``, ``t<T>``, ``extra_bytes_pct``, ``reference``,
    ``recommended``). Colour: tactic count at ``tokens`` (default: the minimum over
    token counts); text: extra weight bytes % (none where the grid has no row); boxes:
    green = recommended, red = the reference (what ``fimoe-lab convert`` pads to).
    """
    column = f"t{tokens}" if tokens is not None else "min_tactics"
    if column not in sweep.columns:
        raise LayoutError(
            f"the sweep has no column {column!r}",
            fix=f"token counts: {', '.join(c[1:] for c in _token_columns(sweep))}",
        )
    ia = sorted(sweep["inter_align"].unique())
    ha = sorted(sweep["hidden_align"].unique())
    grid = np.full((len(ia), len(ha)), np.nan)
    waste = np.full_like(grid, np.nan)
    for _, r in sweep.iterrows():
        i, j = ia.index(r["inter_align"]), ha.index(r["hidden_align"])
        grid[i, j] = np.nan if r[column] is None or r[column] != r[column] else float(r[column])
        waste[i, j] = float(r["extra_bytes_pct"])
    fig = Figure(figsize=(1.1 * len(ha) + 3, 0.55 * len(ia) + 2), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(_masked(grid), cmap=_cmap("viridis"), aspect="auto")
    _colourbar(fig, im, ax, None, f"valid tactics ({column}, count)")
    for (i, j), w in np.ndenumerate(waste):
        if w == w:
            bright = np.nanmax(grid) > 0 and grid[i, j] > 0.6 * np.nanmax(grid)
            ax.text(
                j, i, f"+{w:.1f}%", ha="center", va="center", fontsize=MIN_FONT, color="#111111" if bright else "white"
            )
    for flag, colour in (("recommended", "lime"), ("reference", "red")):
        for _, r in sweep[sweep[flag]].iterrows():
            i, j = ia.index(r["inter_align"]), ha.index(r["hidden_align"])
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, ec=colour, lw=2.5))
    ax.set_xticks(range(len(ha)), [str(v) for v in ha])
    ax.set_yticks(range(len(ia)), [str(v) for v in ia])
    ax.set_xlabel("hidden alignment")
    ax.set_ylabel("intermediate alignment")
    ax.set_title(_sweep_title(sweep, "green = recommended, red = convert's default"), fontsize=MIN_FONT + 1)
    return fig


def _sweep_title(sweep, what: str) -> str:
    attrs = getattr(sweep, "attrs", {})
    return f"{attrs.get('preset', '')} {attrs.get('format', '')} TP {attrs.get('tp', '')}: {what}"


@styled
def sweep_tactics_figure(sweep) -> Figure:
    """Tactic counts of every padding of a sweep at every token count.

    Rows: the sweep's rows, labelled ``I%a_I H%a_H (I' x H')`` (``REF``: convert's
    default padding, ``*``: recommended); columns: token counts; colour and text: the
    count (grey ``?``: unknown). The drawn array is ``sweep[t<T> columns]`` as float.
    """
    tcols = _token_columns(sweep)
    counts = sweep[tcols].astype(float).to_numpy()
    fig = Figure(figsize=(1.0 + 0.8 * len(tcols) + 3, 0.32 * len(sweep) + 1.5), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(_masked(counts), aspect="auto", cmap=_cmap("viridis"), interpolation="nearest")
    ax.set_xticks(range(len(tcols)), [c[1:] for c in tcols])
    labels = [
        f"I%{r.inter_align} H%{r.hidden_align} ({r.intermediate}x{r.hidden})"
        + (" REF" if r.reference else "")
        + (" *" if r.recommended else "")
        for r in sweep.itertuples()
    ]
    ax.set_yticks(range(len(sweep)), labels, fontsize=MIN_FONT)
    ax.set_xlabel("tokens")
    top = np.nanmax(counts) if np.isfinite(counts).any() else 0.0
    for (i, j), v in np.ndenumerate(counts):
        ax.text(
            j,
            i,
            "?" if v != v else int(v),
            ha="center",
            va="center",
            fontsize=MIN_FONT,
            color="white" if (v == v and v < top / 2) else "#111111",
        )
    _colourbar(fig, im, ax, None, "valid tactics (count)")
    ax.set_title(_sweep_title(sweep, "tactics (REF = convert's default, * = recommended)"), fontsize=MIN_FONT + 1)
    return fig


@styled
def sweep_waste_figure(sweep) -> Figure:
    """Extra weight bytes (%) against the minimum tactic count over token counts, one point per padding.

    Green: the full tactic space at every T, red: not; ``REF`` marks convert's default
    padding, ``REC`` the recommendation.
    """
    fig = Figure(figsize=(5, 3.5), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    least = sweep["min_tactics"].astype(float).to_numpy()
    ax.scatter(sweep["extra_bytes_pct"], least, c=["tab:green" if f else "tab:red" for f in sweep["full"]])
    for r, y in zip(sweep.itertuples(), least):
        if r.reference or r.recommended:
            ax.annotate("REF" if r.reference else "REC", (r.extra_bytes_pct, y), fontsize=MIN_FONT)
    ax.set_xlabel("extra weight bytes / FLOPs (%)")
    ax.set_ylabel("min tactics over token counts")
    ax.set_title(_sweep_title(sweep, "waste vs tactics"), fontsize=MIN_FONT + 1)
    return fig


@styled
def frontier_figure(sweep) -> Figure:
    """The tuner's frontier: predicted time against extra weight bytes, one point per padding.

    ``sweep``: :func:`fimoe_lab.tune.sweep.sweep`'s DataFrame (``extra_bytes_pct``,
    ``predicted_us``, ``min_tactics``, ``pareto``, ``recommended``, ``reference``). Colour:
    the least tactic count over token counts; the ``pareto`` rows joined by a line; boxes:
    green = recommended, red = convert's default. Paddings without a predicted time (no
    tactic at some token count) sit on the bottom edge as grey x.
    """
    fig = Figure(figsize=(6.4, 4.2), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    t = sweep["predicted_us"].astype(float).to_numpy()
    x = sweep["extra_bytes_pct"].astype(float).to_numpy()
    tactics = sweep["min_tactics"].astype(float).to_numpy()
    ok = np.isfinite(t)
    dots = ax.scatter(x[ok], t[ok], c=tactics[ok], cmap="viridis", s=28, zorder=3)
    _colourbar(fig, dots, ax, None, "min tactics over token counts (count)")
    floor = float(np.nanmin(t)) if ok.any() else 0.0
    ax.plot(x[~ok], np.full((~ok).sum(), floor), "x", color=PAD_COLOUR, label="no tactic at some T")
    front = sweep[sweep["pareto"]].sort_values("extra_bytes_pct")
    ax.plot(front["extra_bytes_pct"], front["predicted_us"], "-", color="tab:blue", lw=1, label="frontier")
    for flag, colour in (("recommended", "lime"), ("reference", "red")):
        rows = sweep[sweep[flag]]
        ax.plot(rows["extra_bytes_pct"], rows["predicted_us"], "s", mfc="none", mec=colour, ms=11, mew=2, label=flag)
    ax.set_xlabel("extra weight bytes (%)")
    ax.set_ylabel("predicted time over the token profile (us, estimate)")
    fig.legend(loc="outside lower center", ncols=4)
    ax.set_title(_sweep_title(sweep, f"frontier on {sweep.attrs.get('gpu', '')}"), fontsize=MIN_FONT + 1)
    return fig


def side_by_side(a: Figure, b: Figure, label_a: str = "A", label_b: str = "B") -> Figure:
    """Two figures as one (A above B), each drawn at its own size and labelled: for A/B views.

    The panels are the two figures rendered at 2x (:func:`to_png`) and shown as images, so
    the arrays stay in ``a`` and ``b`` (kept as ``fig.parts``) for tests and scripts.
    """
    from PIL import Image

    parts = [np.asarray(Image.open(io.BytesIO(to_png(f)))) for f in (a, b)]
    width = max(f.get_size_inches()[0] for f in (a, b))
    heights = [f.get_size_inches()[1] for f in (a, b)]
    with rc_context(STYLE):
        fig = Figure(figsize=(width, sum(heights) + 0.6))
        top = 1.0
        for img, f, label in zip(parts, (a, b), (label_a, label_b)):
            h = (f.get_size_inches()[1] + 0.3) / fig.get_size_inches()[1]
            ax = fig.add_axes((0, top - h, f.get_size_inches()[0] / width, h - 0.3 / fig.get_size_inches()[1]))
            ax.imshow(img, interpolation="antialiased")
            ax.axis("off")
            fig.text(0.005, top - 0.01, label, fontsize=12, fontweight="bold", va="top")
            top -= h
    fig.parts = (a, b)  # type: ignore[attr-defined]
    return fig
