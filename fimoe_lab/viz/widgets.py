"""ipywidgets explorers: controls + the figure of :mod:`.figures`, redrawn on every change.

Each explorer is a ``VBox`` of controls, a PNG ``Image`` of the current figure and an
``HTML`` line (the summary, or the error that explains a bad choice). After each
redraw ``explorer.figure`` holds the matplotlib Figure and ``explorer.state`` the
inputs it was drawn from, so scripts and tests can read what is shown.

Explorers take a layer (:class:`~fimoe_lab.viz.sources.ExpertTensors`: a shipped
sample, a checkpoint through ``sources.load_layer``, or ``sources.sample_layer``);
without one they offer a layer menu: a seeded layer per format and the shipped sample
checkpoints. Their plans are the ones ``fimoe-lab convert`` applies; the backends and
formats on offer are the rows of :mod:`fimoe_lab.specs`.
"""

from __future__ import annotations

import html
import io
from functools import lru_cache
from typing import Optional

import ipywidgets as W
import numpy as np
from matplotlib.figure import Figure

from fimoe_lab.errors import FimoeError, LayoutError
from fimoe_lab.specs import BACKENDS
from fimoe_lab.viz import data, figures, sources

__all__ = ["RowExplorer", "TileExplorer", "PaddingExplorer", "ProvenanceExplorer", "TunerExplorer"]

DPI = 72


def figure_png(fig: Figure, dpi: int = DPI) -> bytes:
    """PNG bytes of ``fig``."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


SEEDED_SIZES = {"fp8-block": 128, "nvfp4": 128}  # seeded intermediate: 96 shows padding where the format allows


@lru_cache(maxsize=16)
def _layer(key: str) -> sources.ExpertTensors:
    """``seeded:<format>`` (a seeded sample layer) or ``sample:<name>`` (a shipped sample checkpoint)."""
    kind, name = key.split(":", 1)
    if kind == "seeded":
        return sources.sample_layer(name, experts=4, intermediate=SEEDED_SIZES.get(name, 96), hidden=256)
    return sources.load_layer(name)


def layer_choices() -> list[tuple[str, str]]:
    """(label, key) for every layer an explorer can show without a user's checkpoint."""
    seeded = [(f"seeded {f}", f"seeded:{f}") for f in sources.PLAN_FORMATS]
    try:
        shipped = [(f"{n} (sample checkpoint)", f"sample:{n}") for n in sources.sample_names()]
    except sources.LabUnavailable:
        shipped = []
    return seeded + shipped


def _dropdown(description: str, options, value=None) -> W.Dropdown:
    options = list(options)
    return W.Dropdown(
        options=options,
        value=value if value is not None else options[0],
        description=description,
        layout=W.Layout(width="220px"),
        style={"description_width": "80px"},
    )


class _Explorer(W.VBox):
    """Controls, figure and message; subclasses define ``_controls`` and ``_draw``."""

    def __init__(self, controls: list):
        self.image = W.Image(format="png", layout=W.Layout(max_width="100%", display="none"))  # shown once drawn
        self.message = W.HTML()
        self.figure: Optional[Figure] = None
        self.state: dict = {}
        self._busy = False
        rows = [W.HBox(controls[i : i + 4]) for i in range(0, len(controls), 4)]
        super().__init__(rows + [self.message, self.image])
        for c in controls:
            c.observe(self.refresh, names="value")
        self.refresh()

    def _draw(self) -> tuple[Figure, str]:
        raise NotImplementedError

    def refresh(self, *_) -> None:
        """Redraw from the controls' values; a bad combination shows its error instead."""
        if self._busy:
            return
        self._busy = True
        try:
            fig, note = self._draw()
        except (FimoeError, sources.LabUnavailable) as exc:
            shown = "figure not updated" if self.figure is not None else "no figure"
            self.message.value = f"<span style='color:#a00'>{html.escape(str(exc))} ({shown})</span>"
            return
        finally:
            self._busy = False
        self.figure = fig
        self.image.value = figure_png(fig)
        self.image.layout.display = None
        self.message.value = html.escape(note)


class _LayerExplorer(_Explorer):
    """An explorer over one layer's plan: format (sample layers only), backend, tensor, expert."""

    tensor_filter = staticmethod(lambda m: True)

    def __init__(
        self,
        layer: Optional[sources.ExpertTensors],
        extra: list,
        source: str = "seeded:mxfp8",
        backend: str = "trtllm",
        tensor: str = "w13",
    ):
        self.layer_given = layer
        choices = [(layer.source, "given")] if layer is not None else layer_choices()
        self.source = W.Dropdown(
            options=choices,
            value="given" if layer is not None else source,
            description="layer",
            layout=W.Layout(width="330px"),
            style={"description_width": "80px"},
        )
        self.source.disabled = layer is not None
        self.backend = _dropdown("backend", BACKENDS, backend)
        self.tensor = _dropdown("tensor", data.TENSOR_NAMES, tensor)
        self.expert = W.IntSlider(0, 0, 3, description="expert", style={"description_width": "80px"})
        super().__init__([self.source, self.backend, self.tensor, self.expert] + extra)

    @property
    def layer(self) -> sources.ExpertTensors:
        return self.layer_given or _layer(self.source.value)

    def current_map(self):
        """The index map of the chosen tensor in the chosen backend's plan for this layer."""
        layer = self.layer
        self.expert.max = layer.experts - 1
        plan = layer.plan(self.backend.value)
        maps = plan.maps()
        usable = [n for n, m in maps.items() if self.tensor_filter(m)]
        if not usable:
            raise LayoutError(
                f"{plan.description} has no tensor with the steps this view draws", fix="try another layer or backend"
            )
        if list(self.tensor.options) != usable:
            keep = self.tensor.value if self.tensor.value in usable else usable[0]
            self.tensor.options = usable
            self.tensor.value = keep
        self.state = dict(
            fmt=layer.fmt,
            backend=self.backend.value,
            tensor=self.tensor.value,
            expert=self.expert.value,
            plan=plan,
            layer=layer,
        )
        return maps[self.tensor.value]


class RowExplorer(_LayerExplorer):
    """Row permutations: source -> kernel row for pad, W13/W31 swap, gated interleave and the
    epilogue-tile shuffle (any composed chain), coloured by origin, shuffle block or
    epilogue tile, with a row-window zoom and the expert's values in the window."""

    tensor_filter = staticmethod(lambda m: len(m.steps[0].out_shape) == 2 and m.steps[0].kind != "swizzle_scales_128x4")

    def __init__(self, layer: Optional[sources.ExpertTensors] = None, **kwargs):
        self.colour_by = _dropdown("colour by", ("origin", "shuffle block", "epilogue tile"))
        self.start = W.IntSlider(0, 0, 1024, step=8, description="first row", style={"description_width": "80px"})
        self.size = _dropdown("rows", (16, 32, 64, 128, 256), 64)
        super().__init__(layer, [self.colour_by, self.start, self.size], **kwargs)

    def _draw(self):
        m = self.current_map()
        flow = data.row_flow(m, 2 if self.tensor.value.startswith("w13") and self.layer.gated else 1)
        self.start.max = max(0, flow.out_rows - 8)
        window = (self.start.value, self.start.value + self.size.value)
        values = self.layer.magnitude(self.tensor.value, self.expert.value)
        size = data.itemsize_of(self.layer.fmt, self.tensor.value)
        fig = figures.row_permutation_figure(m, flow.projections, window, self.colour_by.value, values, size)
        self.state.update(flow=flow, window=window)
        return fig, f"{self.state['plan'].description}: {m}"


class TileExplorer(_LayerExplorer):
    """Block-major-K tiles (bf16 / fp8-block TRT-LLM weights) and the 128x4 scale swizzle
    (mxfp8 / nvfp4 TRT-LLM scales), atom by atom."""

    tensor_filter = staticmethod(lambda m: len(m.out_shape) == 3 or m.steps[-1].kind == "swizzle_scales_128x4")

    def __init__(self, layer: Optional[sources.ExpertTensors] = None, **kwargs):
        self.atom = W.IntSlider(0, 0, 64, description="atom", style={"description_width": "80px"})
        self.colour_by = _dropdown("colour by", ("source column", "source row"))
        kwargs.setdefault("tensor", "w13_scale")
        super().__init__(layer, [self.atom, self.colour_by], **kwargs)

    def _draw(self):
        m = self.current_map()
        size = data.itemsize_of(self.layer.fmt, self.tensor.value)
        if len(m.out_shape) == 3:
            return figures.tile_figure(m, size, self.colour_by.value), f"block-major-K: {m}"
        view = data.swizzle_view(m, size)
        self.atom.max = view.atoms - 1
        self.state.update(view=view)
        return figures.swizzle_figure(m, size, min(self.atom.value, view.atoms - 1)), f"{view.atoms} atoms: {m}"


class ProvenanceExplorer(_LayerExplorer):
    """Pick a kernel-layout element (row, column of the drawn layout): its source (expert,
    row, column), the chain of steps, and before/after heatmaps of the expert's values."""

    def __init__(self, layer: Optional[sources.ExpertTensors] = None, **kwargs):
        self.row = W.IntSlider(0, 0, 4096, description="kernel row", style={"description_width": "80px"})
        self.col = W.IntSlider(0, 0, 4096, description="kernel col", style={"description_width": "80px"})
        super().__init__(layer, [self.row, self.col], **kwargs)

    def _draw(self):
        m = self.current_map()
        size = data.itemsize_of(self.layer.fmt, self.tensor.value)
        out = m.out_shape[:-1] + (m.out_shape[-1] // size,)
        rows, cols = (out[0] * out[1], out[2]) if len(out) == 3 else out
        self.row.max, self.col.max = rows - 1, cols - 1
        flat = min(self.row.value, rows - 1) * cols + min(self.col.value, cols - 1)
        coords = tuple(int(v) for v in np.unravel_index(flat, out))
        before = self.layer.magnitude(self.tensor.value, self.expert.value)
        chain = data.provenance_rows(m, coords, size)
        self.state.update(coords=coords, chain=chain)
        src = chain[-1][2]
        where = "padding" if src is None else f"expert {self.expert.value}, row {src[0]}, column {src[-1]}"
        return figures.provenance_figure(m, coords, before, size), f"kernel {coords} <- {where}"


class PaddingExplorer(_Explorer):
    """Padding masks of w13, w2 and their scales for a format, backend, TP size and
    alignment, with the waste in bytes and %."""

    def __init__(
        self,
        intermediate: int = 768,
        hidden: int = 2048,
        experts: int = 128,
        fmt: str = "nvfp4",
        backend: str = "trtllm",
        tp: int = 1,
        inter_align="default",
        hidden_align="default",
    ):
        style = {"description_width": "80px"}
        self.fmt = _dropdown("format", sources.PLAN_FORMATS, fmt)
        self.backend = _dropdown("backend", BACKENDS, backend)
        self.tp = _dropdown("TP", (1, 2, 4, 8), tp)
        self.intermediate = W.IntText(
            intermediate, description="intermediate", style=style, layout=W.Layout(width="220px")
        )
        self.hidden = W.IntText(hidden, description="hidden", style=style, layout=W.Layout(width="220px"))
        self.experts = W.IntText(experts, description="experts", style=style, layout=W.Layout(width="220px"))
        self.inter_align = _dropdown("I align", ("default", 16, 64, 128), inter_align)
        self.hidden_align = _dropdown("H align", ("default", 256, 512, 1024), hidden_align)
        super().__init__(
            [
                self.fmt,
                self.backend,
                self.tp,
                self.experts,
                self.intermediate,
                self.hidden,
                self.inter_align,
                self.hidden_align,
            ]
        )

    @classmethod
    def from_layer(cls, layer: sources.ExpertTensors, **kwargs) -> PaddingExplorer:
        """The explorer on a layer's sizes (read it at TP 1: the TP menu then splits it)."""
        if layer.fmt not in sources.PLAN_FORMATS:
            raise LayoutError(
                f"no padding view for format {layer.fmt!r}",
                fix=f"padding views exist for {', '.join(sources.PLAN_FORMATS)}",
            )
        return cls(layer.intermediate, layer.hidden, layer.experts, layer.fmt, **kwargs)

    def _draw(self):
        def align(w):
            return None if w.value == "default" else int(w.value)

        report = data.padding_report(
            self.fmt.value,
            self.backend.value,
            self.intermediate.value,
            self.hidden.value,
            self.tp.value,
            self.experts.value,
            align(self.inter_align),
            align(self.hidden_align),
        )
        self.state = dict(report=report)
        return figures.padding_figure(report), report.summary()


class TunerExplorer(_Explorer):
    """The tuner's tactic heatmap, waste and recommendation for a preset, format and TP
    (``mode``: the tactic oracle's, ``snapshot`` by default: recorded answers, offline)."""

    def __init__(self, preset: str = "qwen3-30b-a3b", fmt: str = "nvfp4", tp: int = 1, mode: str = "snapshot"):
        self.mode = mode
        presets = sources.preset_names()
        self.preset = _dropdown(
            "preset", presets or [preset], preset if preset in presets or not presets else presets[0]
        )
        self.fmt = _dropdown("format", sources.TUNER_FORMATS, fmt)
        self.tp = _dropdown("TP", (1, 2, 4, 8), tp)
        super().__init__([self.preset, self.fmt, self.tp])

    def _draw(self):
        sweep = sources.tactic_sweep(self.preset.value, self.fmt.value, self.tp.value, self.mode)
        self.state = dict(sweep=sweep)
        rec = sweep.attrs.get("recommendation")
        note = (
            f"recommended: intermediate {rec['intermediate']} (align {rec['inter_align']}), hidden "
            f"{rec['hidden']} (align {rec['hidden_align']}), +{rec['extra_bytes_pct']:.2f}% weights, "
            f"predicted {rec['predicted_us']:.1f} us (estimate)"
            if rec
            else f"no recommendation: {sweep.attrs.get('no_recommendation')}"
        )
        return figures.tuner_figure(sweep), note
