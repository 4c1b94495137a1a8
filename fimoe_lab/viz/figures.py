"""Plain plotting functions: each returns a matplotlib ``Figure`` drawn from :mod:`.data`.

No pyplot state: figures are ``matplotlib.figure.Figure`` objects (Agg), shown in a
notebook with ``display(fig)`` and saved with ``fig.savefig``. The arrays each panel
draws are exactly the :mod:`.data` arrays (tests compare them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from fimoe_lab.errors import LayoutError
from fimoe_lab.layout import IndexMap
from fimoe_lab.viz import data

__all__ = [
    "row_permutation_figure",
    "tile_figure",
    "swizzle_figure",
    "padding_figure",
    "provenance_figure",
    "compare_figure",
    "tuner_figure",
    "sweep_tactics_figure",
    "sweep_waste_figure",
]

PAD_COLOUR = (0.75, 0.75, 0.75, 1.0)
MAGNITUDE_CMAP = "viridis"


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


def row_permutation_figure(
    m: IndexMap,
    projections: int = 2,
    window: tuple[int, int] = (0, 64),
    colour_by: str = "origin",
    values: Optional[np.ndarray] = None,
    itemsize: int = 1,
    observed: Optional[np.ndarray] = None,
) -> Figure:
    """Source row -> kernel row for ``m``'s row steps (pad, swap, interleave, epilogue shuffle).

    Panels: (1) the kernel rows ``window = (lo, hi)`` with a line from each one's source
    row; (2) every kernel row's source row, the window shaded; (3, when ``values``
    ``(rows, elements)`` of one expert is given) those values moved through the row
    steps for the window's rows. ``observed`` ``(out_rows,)``: rows a suspect tensor
    really holds (:func:`data.observed_row_sources`); mismatches are marked with red x.
    Colours: ``colour_by`` in ``RowFlow.colour_modes()``.
    """
    flow = data.row_flow(m, projections)
    lo, hi = max(0, window[0]), min(flow.out_rows, window[1])
    if lo >= hi:
        raise LayoutError(f"row window {window} is empty", fix=f"kernel rows are 0..{flow.out_rows - 1}")
    codes, labels = flow.groups(colour_by)
    colours = _group_colours(len(labels))
    panels = 3 if values is not None else 2
    fig = Figure(figsize=(4.2 * panels, 4.6), layout="constrained")
    ax_lines, ax_all = fig.add_subplot(1, panels, 1), fig.add_subplot(1, panels, 2)

    dst = np.arange(lo, hi)
    src = flow.src_rows[lo:hi]
    for d, s, k in zip(dst, src, codes[lo:hi]):
        if s >= 0:
            ax_lines.plot([0, 1], [s, d], color=colours[k], lw=1.2)
        else:
            ax_lines.plot([1], [d], marker="s", color=PAD_COLOUR, ms=4)
    real = src[src >= 0]
    ax_lines.set_xticks([0, 1], ["checkpoint row", "kernel row"])
    ax_lines.set_xlim(-0.15, 1.15)
    top = min(lo, int(real.min()) if real.size else lo)
    bottom = max(hi - 1, int(real.max()) if real.size else hi - 1)
    ax_lines.set_ylim(bottom + 0.5, top - 0.5)
    ax_lines.set_ylabel("row")
    ax_lines.set_title(f"kernel rows {lo}..{hi - 1}")

    out = np.arange(flow.out_rows)
    ax_all.scatter(out, np.where(flow.src_rows >= 0, flow.src_rows, np.nan), c=[colours[k] for k in codes], s=6)
    pads = out[flow.src_rows < 0]
    ax_all.scatter(pads, np.full(pads.size, -0.02 * flow.in_rows), c=[PAD_COLOUR], s=6, marker="s")
    if observed is not None:
        wrong = np.flatnonzero(observed != flow.src_rows)
        ax_all.scatter(
            wrong,
            np.where(observed[wrong] >= 0, observed[wrong], -0.04 * flow.in_rows),
            marker="x",
            c="red",
            s=14,
            label=f"observed != planned ({wrong.size} rows)",
        )
        ax_all.legend(loc="upper left", fontsize=7)
    ax_all.axvspan(lo - 0.5, hi - 0.5, color="gold", alpha=0.25)
    ax_all.set_xlabel("kernel row")
    ax_all.set_ylabel("checkpoint row (grey squares: padding)")
    ax_all.set_title("all rows")
    handles = [Rectangle((0, 0), 1, 1, color=colours[k]) for k in sorted(set(codes.tolist()))][:12]
    names = [labels[k] for k in sorted(set(codes.tolist()))][:12]
    ax_all.legend(handles, names, loc="lower right", fontsize=7, title=colour_by, title_fontsize=7)
    if observed is not None:
        ax_all.add_artist(ax_all.legend_)

    if values is not None:
        rows_map = m.row_steps()
        moved = data.gather_values(rows_map, values, itemsize)
        ax_v = fig.add_subplot(1, panels, 3)
        ax_v.imshow(
            _masked(moved[lo:hi]),
            aspect="auto",
            cmap=_cmap(MAGNITUDE_CMAP),
            interpolation="nearest",
            extent=(-0.5, moved.shape[1] - 0.5, hi - 0.5, lo - 0.5),
        )
        ax_v.set_title("values in kernel rows (grey: padding)")
        ax_v.set_xlabel("element")
    fig.suptitle(" >> ".join(flow.steps), fontsize=9)
    return fig


def tile_figure(m: IndexMap, itemsize: int = 1, colour_by: str = "source column") -> Figure:
    """Block-major-K re-tiling: each input element's K block, and each tile element's source.

    Left: the input ``[M, K]`` coloured by the K block (of ``bk`` bytes) it lands in.
    Right: the output ``(K/bk, M, bk)`` drawn as ``(K/bk * M, bk)``, coloured by source
    ``colour_by`` ("source column" or "source row"); white lines separate the K blocks.
    """
    view = data.tile_view(m, itemsize)
    shown = {"source column": view.src_col, "source row": view.src_row}
    if colour_by not in shown:
        raise LayoutError(f"cannot colour tiles by {colour_by!r}", fix=f"choose one of {', '.join(shown)}")
    fig = Figure(figsize=(10, 4.6), layout="constrained")
    ax_in, ax_out = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    im = ax_in.imshow(
        _masked(view.block_of_input),
        aspect="auto",
        cmap=_categorical(view.blocks),
        vmin=-0.5,
        vmax=view.blocks - 0.5,
        interpolation="nearest",
    )
    fig.colorbar(im, ax=ax_in, label="K block in the output", ticks=range(view.blocks))
    ax_in.set_title(f"input [{view.block_of_input.shape[0]}, {view.block_of_input.shape[1]}] elements")
    ax_in.set_xlabel("column")
    ax_in.set_ylabel("row")
    im = ax_out.imshow(_masked(shown[colour_by]), aspect="auto", cmap=_cmap("viridis"), interpolation="nearest")
    for b in range(1, view.blocks):
        ax_out.axhline(b * view.rows - 0.5, color="white", lw=1)
    fig.colorbar(im, ax=ax_out, label=colour_by)
    ax_out.set_title(
        f"output ({view.blocks}, {view.rows}, {view.block_cols}) as ({view.blocks}x{view.rows}, {view.block_cols})"
    )
    ax_out.set_xlabel("element in block")
    ax_out.set_ylabel("K block x row")
    fig.suptitle(view.name, fontsize=9)
    return fig


def swizzle_figure(m: IndexMap, itemsize: int = 1, atom: int = 0) -> Figure:
    """The 128x4 scale swizzle, atom by atom.

    Left: the linear scale matrix ``[rows, cols]`` coloured by the atom each scale lands
    in, the scales of atom ``atom`` outlined in red. Middle: the swizzled buffer as
    ``(atoms*32, 16)`` coloured by source row (grey: padding), the atom shaded. Right:
    atom ``atom`` close up, coloured by source column, its source row written on each
    line of 16.
    """
    view = data.swizzle_view(m, itemsize)
    if not 0 <= atom < view.atoms:
        raise LayoutError(
            f"atom {atom} is outside 0..{view.atoms - 1} of {view.name}", fix=f"pick an atom in 0..{view.atoms - 1}"
        )
    fig = Figure(figsize=(13, 4.8), layout="constrained")
    ax_lin, ax_buf, ax_atom = (fig.add_subplot(1, 3, k) for k in (1, 2, 3))
    im = ax_lin.imshow(
        _masked(view.dest_atom),
        aspect="auto",
        cmap=_categorical(view.atoms),
        vmin=-0.5,
        vmax=view.atoms - 0.5,
        interpolation="nearest",
    )
    chosen = np.pad(view.dest_atom == atom, 1).astype(float)
    ax_lin.contour(
        np.arange(-1, chosen.shape[1] - 1),
        np.arange(-1, chosen.shape[0] - 1),
        chosen,
        levels=[0.5],
        colors="black",
        linewidths=2,
    )
    fig.colorbar(im, ax=ax_lin, label="destination atom (outlined: the chosen one)", ticks=range(view.atoms))
    ax_lin.set_title(f"linear scales [{view.dest_atom.shape[0]}, {view.dest_atom.shape[1]}]")
    ax_lin.set_xlabel("scale column")
    ax_lin.set_ylabel("row")
    im = ax_buf.imshow(_masked(view.src_row), aspect="auto", cmap=_cmap("viridis"), interpolation="nearest")
    ax_buf.axhspan(atom * 32 - 0.5, atom * 32 + 31.5, color="red", alpha=0.2)
    fig.colorbar(im, ax=ax_buf, label="source row")
    ax_buf.set_title(f"swizzled buffer: {view.atoms} atoms x 512")
    ax_buf.set_xlabel("offset % 16")
    ax_buf.set_ylabel("offset // 16")
    zoom_col = view.src_col[atom * 32 : (atom + 1) * 32]
    zoom_row = view.src_row[atom * 32 : (atom + 1) * 32]
    ax_atom.imshow(_masked(zoom_col), aspect="auto", cmap=_cmap("tab10"), interpolation="nearest")
    for line in range(32):
        firsts = zoom_row[line]
        label = " ".join(str(int(v)) if v >= 0 else "-" for v in firsts[::4])
        ax_atom.text(15.6, line, label, fontsize=5, va="center")
    ax_atom.set_xlim(-0.5, 24)
    rb, cb = view.atom_origin[atom]
    ax_atom.set_title(
        f"atom {atom}: swizzled rows {128 * rb}..{128 * rb + 127}, cols {4 * cb}..{4 * cb + 3}", fontsize=9
    )
    ax_atom.set_xlabel("colour: source column; text: source rows")
    fig.suptitle(view.name, fontsize=9)
    return fig


MAX_MASK_SIDE = 512


def coarse_mask(mask: np.ndarray, max_side: int = MAX_MASK_SIDE) -> tuple[np.ndarray, tuple[int, int]]:
    """``mask`` reduced to at most ``max_side`` per side: a pixel is True when any element in its
    block is (so thin padding stays visible). Returns the mask and the block ``(rows, cols)``."""
    fr, fc = -(-mask.shape[0] // max_side), -(-mask.shape[1] // max_side)
    if fr == fc == 1:
        return mask, (1, 1)
    padded = np.pad(mask, ((0, -mask.shape[0] % fr), (0, -mask.shape[1] % fc)))
    return padded.reshape(padded.shape[0] // fr, fr, padded.shape[1] // fc, fc).any(axis=(1, 3)), (fr, fc)


def padding_figure(report: data.PaddingReport) -> Figure:
    """Padding of every tensor of a layer: the padded matrix (top) and the kernel layout (bottom).

    Padding is drawn dark, data light; each title gives the tensor's padding bytes per expert.
    Masks wider than 512 are drawn with :func:`coarse_mask` (the title gives the block).
    """
    names = list(report.tensors)
    if not names:
        raise LayoutError(
            f"{report.plan.description} pads nothing and moves nothing: no tensor to draw",
            fix="pick another backend, format or alignment",
        )
    fig = Figure(figsize=(3.3 * len(names), 6.2), layout="constrained")
    cmap = ListedColormap([(0.93, 0.93, 0.85), (0.55, 0.1, 0.1)])
    for k, name in enumerate(names):
        t = report.tensors[name]
        for row, (mask, where) in enumerate(((t.padded_mask, "padded"), (t.kernel_mask, "kernel layout"))):
            ax = fig.add_subplot(2, len(names), row * len(names) + k + 1)
            shown, block = coarse_mask(mask)
            ax.imshow(shown, aspect="auto", cmap=cmap, vmin=0, vmax=1, interpolation="nearest")
            note = f"\n{t.fill_bytes:,} B of {t.out_bytes:,} B pad" if row == 0 else ""
            note += f"\n(pixel = {block[0]}x{block[1]} elements)" if block != (1, 1) else ""
            ax.set_title(f"{name} {where} {mask.shape}{note}", fontsize=8)
            ax.tick_params(labelsize=7)
    fig.suptitle(report.summary(), fontsize=8, wrap=True)
    return fig


def provenance_figure(m: IndexMap, coords: Sequence[int], before: np.ndarray, itemsize: int = 1) -> Figure:
    """Where one kernel element comes from, on real values.

    Left: ``before``, one expert's checkpoint-layout values ``(rows, elements)`` (e.g.
    dequantized magnitudes) with the source marked; right: the same values moved
    through ``m`` (the kernel layout, :func:`data.display_2d`) with the chosen element
    ``coords`` (in ``m.out_shape`` elements) marked. The step chain is printed below.
    """
    chain = data.provenance_rows(m, tuple(coords), itemsize)
    after = data.display_2d(data.gather_values(m, before, itemsize))
    out_shape = m.out_shape[:-1] + (m.out_shape[-1] // itemsize,)
    flat = int(np.ravel_multi_index(tuple(coords), out_shape))
    ar, ac = divmod(flat, after.shape[1])
    fig = Figure(figsize=(11, 5.6), layout="constrained")
    grid = fig.add_gridspec(2, 2, height_ratios=[4, 1.3])
    ax_b, ax_a = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    vmax = float(np.nanmax(before))
    ax_b.imshow(before, aspect="auto", cmap=_cmap(MAGNITUDE_CMAP), vmin=0, vmax=vmax, interpolation="nearest")
    ax_b.set_title(f"checkpoint layout {before.shape}")
    source = chain[-1][2]
    if source is not None:
        ax_b.plot(source[-1], source[0], marker="o", ms=10, mfc="none", mec="red", mew=2)
    ax_a.imshow(_masked(after), aspect="auto", cmap=_cmap(MAGNITUDE_CMAP), vmin=0, vmax=vmax, interpolation="nearest")
    ax_a.plot(ac, ar, marker="o", ms=10, mfc="none", mec="red", mew=2)
    ax_a.set_title(f"kernel layout {after.shape} (grey: padding)")
    ax_t = fig.add_subplot(grid[1, :])
    ax_t.axis("off")
    lines = [f"{('padding' if c is None else str(c)):<14} in {str(shape):<14} {stage}" for stage, shape, c in chain]
    ax_t.text(0, 1, "\n".join(lines), family="monospace", fontsize=7, va="top")
    return fig


def compare_figure(
    m: IndexMap, checkpoint: np.ndarray, kernel: np.ndarray, itemsize: int = 1, title: str = ""
) -> Figure:
    """Debugging view: a kernel-layout tensor taken back through ``m.inverse()``, next to the checkpoint.

    ``checkpoint``: one expert's values ``(rows, elements)`` in the checkpoint layout;
    ``kernel``: the same expert's values as some preparation left them (``m.out_shape``
    in elements). A correct preparation gives back the checkpoint exactly (difference 0);
    a missing or extra step shows as a broken pattern and a non-zero difference.
    """
    recovered = data.gather_values(m.inverse(), kernel, itemsize)
    diff = np.abs(recovered - checkpoint)
    fig = Figure(figsize=(12, 4.4), layout="constrained")
    vmax = float(np.nanmax(checkpoint))
    for k, (img, name) in enumerate(
        (
            (checkpoint, "checkpoint"),
            (recovered, "kernel tensor, un-done by the plan"),
            (diff, f"|difference|: max {np.nanmax(diff):.3g}"),
        )
    ):
        ax = fig.add_subplot(1, 3, k + 1)
        ax.imshow(
            _masked(img),
            aspect="auto",
            cmap=_cmap("magma" if k == 2 else MAGNITUDE_CMAP),
            vmin=0,
            vmax=vmax,
            interpolation="nearest",
        )
        ax.set_title(name, fontsize=9)
    fig.suptitle(title or m.name, fontsize=9)
    return fig


def _token_columns(sweep) -> list[str]:
    """The sweep's tactic-count columns ``t<T>``, in order."""
    return [c for c in sweep.columns if c.startswith("t") and c[1:].isdigit()]


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
    fig.colorbar(im, ax=ax, label=f"valid tactics ({column})")
    for (i, j), w in np.ndenumerate(waste):
        if w == w:
            bright = np.nanmax(grid) > 0 and grid[i, j] > 0.6 * np.nanmax(grid)
            ax.text(j, i, f"+{w:.1f}%", ha="center", va="center", fontsize=7, color="black" if bright else "white")
    for flag, colour in (("recommended", "lime"), ("reference", "red")):
        for _, r in sweep[sweep[flag]].iterrows():
            i, j = ia.index(r["inter_align"]), ha.index(r["hidden_align"])
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, ec=colour, lw=2.5))
    ax.set_xticks(range(len(ha)), [str(v) for v in ha])
    ax.set_yticks(range(len(ia)), [str(v) for v in ia])
    ax.set_xlabel("hidden alignment")
    ax.set_ylabel("intermediate alignment")
    ax.set_title(_sweep_title(sweep, "green = recommended, red = convert's default"), fontsize=9)
    return fig


def _sweep_title(sweep, what: str) -> str:
    attrs = getattr(sweep, "attrs", {})
    return f"{attrs.get('preset', '')} {attrs.get('format', '')} TP {attrs.get('tp', '')}: {what}"


def sweep_tactics_figure(sweep) -> Figure:
    """Tactic counts of every padding of a sweep at every token count.

    Rows: the sweep's rows, labelled ``I%a_I H%a_H (I' x H')`` (``REF``: convert's
    default padding, ``*``: recommended); columns: token counts; colour and text: the
    count (grey ``?``: unknown). The drawn array is ``sweep[t<T> columns]`` as float.
    """
    tcols = _token_columns(sweep)
    counts = sweep[tcols].astype(float).to_numpy()
    fig = Figure(figsize=(1.0 + 0.8 * len(tcols) + 3, 0.3 * len(sweep) + 1.5), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(_masked(counts), aspect="auto", cmap=_cmap("viridis"), interpolation="nearest")
    ax.set_xticks(range(len(tcols)), [c[1:] for c in tcols])
    labels = [
        f"I%{r.inter_align} H%{r.hidden_align} ({r.intermediate}x{r.hidden})"
        + (" REF" if r.reference else "")
        + (" *" if r.recommended else "")
        for r in sweep.itertuples()
    ]
    ax.set_yticks(range(len(sweep)), labels, fontsize=7)
    ax.set_xlabel("tokens")
    top = np.nanmax(counts) if np.isfinite(counts).any() else 0.0
    for (i, j), v in np.ndenumerate(counts):
        ax.text(
            j,
            i,
            "?" if v != v else int(v),
            ha="center",
            va="center",
            fontsize=6,
            color="white" if (v == v and v < top / 2) else "black",
        )
    fig.colorbar(im, ax=ax, label="valid tactics")
    ax.set_title(_sweep_title(sweep, "tactics (REF = convert's default, * = recommended)"), fontsize=9)
    return fig


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
            ax.annotate("REF" if r.reference else "REC", (r.extra_bytes_pct, y), fontsize=8)
    ax.set_xlabel("extra weight bytes / FLOPs (%)")
    ax.set_ylabel("min tactics over token counts")
    ax.set_title(_sweep_title(sweep, "waste vs tactics"), fontsize=9)
    return fig
