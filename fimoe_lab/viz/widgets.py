"""ipywidgets explorers: controls + the figure of :mod:`.figures`, redrawn on every change.

Each explorer is a ``VBox`` of controls, the current figure as inline SVG
(:func:`figures.to_svg`: vector, natural size, follows JupyterLab's light or dark theme,
hover text on lines and cells), a message line (the summary, or the error that explains a
bad choice: the error replaces the figure, so nothing on screen disagrees with the controls, and
any later change redraws) and an export row (save PNG at 2x / SVG, show the code that draws the
figure; a save that cannot be written says why in the message). After each redraw
``explorer.figure`` holds the matplotlib Figure, ``explorer.svg`` its SVG and
``explorer.state`` the inputs it was drawn from, so scripts and tests can read what is
shown. Redraws are cached per control state (:attr:`_Explorer.CACHE`), data per layer.

Point and see: every explorer whose figure draws a layout (rows, tiles and the 128x4
swizzle, provenance, A/B, diagnose) traces the cell under a click (:meth:`_Explorer.click`,
one mechanism: the figure says what each pointable axes shows, :func:`figures.cells_of`):
a kernel cell back through every step, a checkpoint cell to where it lands; the chain of
step names and coordinates is shown under the figure and both ends are circled. Hovering
shows the cell's row, column, value, source element and the steps that moved it (the
anywidget canvas asks :meth:`_Explorer._hover`). A click outside any cell, before a
figure exists or on an element that cannot be followed changes nothing but the message.

Layer explorers take a layer (:class:`~fimoe_lab.viz.sources.ExpertTensors`) or offer a
menu: seeded layers per format (shape typed in the ``I x H`` box), the shipped sample
checkpoints, and any checkpoint loaded through the path box with its layer, TP size and
TP rank (:func:`sources.load_layer`). Their plans are the ones ``fimoe-lab convert``
applies; the backends and formats on offer are the rows of :mod:`fimoe_lab.specs`.

Why one module of this size: the explorers are one class family (:class:`_Explorer` and its
subclasses) that share the controls, the redraw cache, the message line, the export row and the click
and hover tracing; each subclass only names its controls and its figure. Splitting the subclasses out
would make them import the base's private helpers across modules, which the import rules forbid.
"""

from __future__ import annotations

import gc
import html
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

import ipywidgets as W
import numpy as np
from matplotlib.figure import Figure

from fimoe_lab import libc, owned_files
from fimoe_lab.choice import LayerShape, LayoutChoice
from fimoe_lab.errors import FimoeError, LayoutError
from fimoe_lab.specs import BACKENDS, get_format
from fimoe_lab.viz import data, figures, sources

try:  # clicks on a figure need anywidget (the lab extra); without it the figure is plain HTML
    import anywidget
    import traitlets
except ImportError:  # pragma: no cover - exercised where anywidget is absent
    anywidget = None

__all__ = [
    "RowExplorer",
    "TileExplorer",
    "PaddingExplorer",
    "ProvenanceExplorer",
    "TunerExplorer",
    "DiagnoseExplorer",
    "CompareExplorer",
]

STYLE = {"description_width": "90px"}
SEEDED_SIZES = {"fp8-block": 128, "nvfp4": 128}  # seeded intermediate: 96 shows padding where the format allows
TP_SIZES = (1, 2, 4, 8, 16)


def figure_png(fig: Figure) -> bytes:
    """PNG bytes of ``fig`` at 2x (:func:`figures.to_png`)."""
    return figures.to_png(fig)


def parse_shape(text: str) -> tuple[int, int]:
    """``"I x H"`` (e.g. ``"96x256"``) -> ``(I, H)``; a :class:`LayoutError` otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX*, ]\s*(\d+)\s*", text)
    if not m or not all(int(v) > 0 for v in m.groups()):
        raise LayoutError(f"shape {text!r} is not 'I x H'", fix="type the intermediate and hidden size, e.g. 96x256")
    return int(m.group(1)), int(m.group(2))


_PAUSES = {"depth": 0, "was": False}
_PAUSES_LOCK = threading.Lock()


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for one redraw, as it was after. A new figure allocates
    ~10^5 objects (matplotlib artists), enough to start a full collection, which walks every object of
    the kernel (~3.4 * 10^5 after the three layer explorers on an R1 layer: 0.15-0.3 s on a 2-core VM,
    a third to half of a new tensor's redraw in benchmarks/bench_lab.py, where none runs now). Paused,
    the redraw's objects are collected after it, as young objects (a few ms), and full collections
    become rare; no memory is held longer than one redraw's garbage (freed at the next collection).
    Pauses nest (from any thread): the last one out restores it."""
    with _PAUSES_LOCK:
        if _PAUSES["depth"] == 0:
            _PAUSES["was"] = gc.isenabled()
            gc.disable()
        _PAUSES["depth"] += 1
    try:
        yield
    finally:
        with _PAUSES_LOCK:
            _PAUSES["depth"] -= 1
            if _PAUSES["depth"] == 0 and _PAUSES["was"]:
                gc.enable()


@lru_cache(maxsize=1)
def _malloc_trim() -> Optional[Any]:
    """glibc's ``malloc_trim``, None where the C library has none."""
    import ctypes

    return libc.function("malloc_trim", [ctypes.c_size_t])


_DROPPED = {"figures": 0}
"""Figures dropped by a figure cache or replaced on screen since memory was last given back
(:func:`_give_back_memory`)."""

PREPARE_AFTER = 0.25
"""Seconds a drawing thread waits after showing a figure before it prepares (no one answers a new figure sooner:
a change that comes at once, as a script's, then never waits for a unit of preparation under way)."""

GIVE_BACK_QUIET = 2.0
"""Seconds without any control change a drawing thread waits, its work done, before it gives memory back: the
collection holds the interpreter for 0.1-0.3 s, which a change arriving meanwhile waits for, so it runs at the
first pause of a user who is looking rather than changing controls (a change every second or so never meets it;
at 0.3 s the browser benchmark's changes 1 s apart met it, 0.41-0.48 s)."""


def _give_back_memory() -> None:
    """Free what the explorers dropped and return it to the system: one full collection (a figure dropped from
    a figure cache is a web of reference cycles holding its images and an expert's values, and redraws pause
    the collector, :func:`_collector_paused`), then ``malloc_trim(0)`` (freed memory otherwise stays in the
    drawing threads' malloc arenas as holes the kernel's resident size counts; nothing without glibc). After
    the explorers' benchmark on an R1 layer (benchmarks/bench_lab_browser.py) both together held ~0.6 GB.
    Run when a drawing thread has nothing left to do (0.1-0.3 s on a 2-core VM)."""
    _DROPPED["figures"] = 0
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _in_kernel() -> bool:
    """True inside a running Jupyter kernel (where control changes arrive as messages the kernel's main thread
    handles one by one, so a redraw there would hold back every later change)."""
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython comes with ipywidgets
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


_DRAWING = threading.RLock()
"""Held while any explorer draws or traces a point: one at a time in the process (matplotlib's settings, the
shared caches of :mod:`.data` and :mod:`.sources` are not made for two threads; the GIL runs one anyway)."""


class _Superseded(Exception):
    """A redraw stopped because a newer control change asked for another figure."""


class _NoRoom(Exception):
    """A view idle preparation skips: its data would not fit the caches' room left (:meth:`_LayerExplorer._afford`)."""


_REQUESTS = {"count": 0}
_REQUESTS_LOCK = threading.Lock()


def _request() -> int:
    """Count one control change of any explorer (idle preparation stops at the next unit when the count moved);
    returns the new count."""
    with _REQUESTS_LOCK:
        _REQUESTS["count"] += 1
        return _REQUESTS["count"]


_POINTERS = {"waiting": 0}
"""Clicks and hovers waiting for the figure: idle preparation waits for them before its next unit (a thread
that takes the lock again at once would otherwise keep them out)."""
_POINTERS_LOCK = threading.Lock()


def _requests() -> int:
    """Control changes asked of every explorer so far."""
    return _REQUESTS["count"]


def _around(control: W.Dropdown) -> list:
    """The values a user is likely to pick next in a menu: the option after the chosen one, then the one before."""
    values = list(control._options_values)
    at = values.index(control.value) if control.value in values else -1
    return [values[k] for k in (at + 1, at - 1) if at >= 0 and 0 <= k < len(values)]


def _run(steps: Iterator[None]) -> Any:
    """Run a generator of steps (:meth:`_Explorer._layered`) to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


@lru_cache(maxsize=16)
def _layer(key: str) -> sources.ExpertTensors:
    """``seeded:<format>[:I:H]`` (a seeded sample layer), ``sample:<name>`` (a shipped sample
    checkpoint) or ``path:<layer>:<tp size>:<tp rank>:<path>`` (a checkpoint directory)."""
    kind, rest = key.split(":", 1)
    if kind == "seeded":
        fmt, *shape = rest.split(":")
        inter, hidden = (int(shape[0]), int(shape[1])) if shape else (SEEDED_SIZES.get(fmt, 96), 256)
        return sources.sample_layer(fmt, experts=4, intermediate=inter, hidden=hidden)
    if kind == "path":
        layer, tp, rank, path = rest.split(":", 3)
        return sources.load_layer(path, None if layer == "first" else int(layer), int(tp), int(rank))
    return sources.load_layer(rest)


def _checkpoint_key(where: str) -> str:
    """The checkpoint a path box names, one spelling per directory: a shipped sample's name as typed,
    any other path as its real directory (a shard file names its directory)."""
    if where in _sample_names():
        return where
    real = os.path.realpath(os.path.expanduser(where))
    return os.path.dirname(real) if os.path.isfile(real) else real


def _sample_names() -> list[str]:
    try:
        return sources.sample_names()
    except sources.LabUnavailable:
        return []


def _shards_text(where: str) -> str:
    """``"<GB> in <n> shard(s)"`` of the checkpoint directory ``where`` (what a full read would cost)."""
    from fimoe_lab import resources

    folder = Path(resources.sample_path(where)) if where in _sample_names() else Path(where)
    shards = list(folder.glob("*.safetensors"))
    return f"{sum(f.stat().st_size for f in shards) / 1e9:.2f} GB in {len(shards)} shard(s)"


def _last_read(explorer: Any) -> Optional[tuple]:
    """The last expert read of the explorer's layer (``(expert, bytes, seconds)``), None before any or on error."""
    try:
        return explorer.layer.last_read  # type: ignore[no-any-return]
    except (FimoeError, sources.LabUnavailable, ValueError, OSError):
        return None


def layer_choices() -> list[tuple[str, str]]:
    """(label, key) for every layer an explorer can show without a user's checkpoint."""
    seeded = [(f"seeded {f}", f"seeded:{f}") for f in sources.PLAN_FORMATS]
    try:
        shipped = [(f"{n} (sample checkpoint)", f"sample:{n}") for n in sources.sample_names()]
    except sources.LabUnavailable:
        shipped = []
    return seeded + shipped


def _dropdown(description: str, options, value=None, width: str = "230px") -> W.Dropdown:
    options = list(options)
    return W.Dropdown(
        options=options,
        value=value if value is not None else options[0],
        description=description,
        layout=W.Layout(width=width),
        style=STYLE,
    )


def _int_box(description: str, value: int, width: str = "230px") -> W.IntText:
    return W.IntText(value, description=description, style=STYLE, layout=W.Layout(width=width))


def _slider(description: str, value: int, top: int, step: int = 1) -> W.IntSlider:
    return W.IntSlider(value, 0, top, step=step, description=description, style=STYLE, continuous_update=False)


_CANVAS_JS = """
function render({ model, el }) {
  const figure = document.createElement("div");
  // the tooltip lives on the page's body: a notebook cell's CSS (transforms, containment) would make a
  // fixed position inside the cell relative to the cell, not to the viewport
  const tip = document.createElement("div");
  tip.className = "fimoe-tip";
  tip.style.cssText = "position:fixed;display:none;pointer-events:none;z-index:10000;white-space:pre;" +
    "font:11px monospace;padding:3px 5px;border-radius:3px;background:rgba(30,30,30,0.92);color:#fff;" +
    "max-width:60vw;overflow:hidden";
  document.body.append(tip);
  el.append(figure);
  const draw = () => { figure.innerHTML = model.get("value"); };
  draw();
  model.on("change:value", draw);
  // (x, y) in the user units of the SVG under the pointer and its index among the figure's SVGs (A/B parts)
  const locate = (event) => {
    const svg = event.target.closest && event.target.closest("svg");
    if (!svg || !figure.contains(svg)) return null;
    const parts = [...figure.querySelectorAll("svg")].filter((s) => !s.parentElement.closest("svg"));
    const point = svg.createSVGPoint();
    point.x = event.clientX;
    point.y = event.clientY;
    const p = point.matrixTransform(svg.getScreenCTM().inverse());
    return [p.x, p.y, Math.max(0, parts.indexOf(svg))];
  };
  figure.addEventListener("click", (event) => {
    const at = locate(event);
    if (!at) return;
    model.set("click", [...at, Date.now()]);
    model.save_changes();
  });
  // inside: the pointer is over one of the figure's SVGs now; a hover answer that arrives once it has
  // left (a busy kernel) is not shown, or it would stay at a place the pointer no longer is
  let timer = null, last = [0, 0], inside = false;
  // 12 px below right of the pointer, flipped to its other side where the viewport ends
  const place = () => {
    const gap = 12, edge = 4, w = tip.offsetWidth, h = tip.offsetHeight;
    let x = last[0] + gap, y = last[1] + gap;
    if (x + w > window.innerWidth - edge) x = Math.max(edge, last[0] - gap - w);
    if (y + h > window.innerHeight - edge) y = Math.max(edge, last[1] - gap - h);
    tip.style.left = `${x}px`;
    tip.style.top = `${y}px`;
  };
  figure.addEventListener("mousemove", (event) => {
    last = [event.clientX, event.clientY];
    clearTimeout(timer);
    const at = locate(event);
    inside = at !== null;
    if (!inside) { tip.style.display = "none"; return; }
    if (tip.style.display !== "none") place();
    timer = setTimeout(() => { model.set("hover", [...at, Date.now()]); model.save_changes(); }, 120);
  });
  figure.addEventListener("mouseleave", () => { inside = false; clearTimeout(timer); tip.style.display = "none"; });
  // one tooltip on the page: showing this one hides any other figure's
  model.on("change:tip", () => {
    const text = model.get("tip");
    tip.textContent = text;
    const show = Boolean(text) && inside;
    if (show) for (const other of document.querySelectorAll(".fimoe-tip")) if (other !== tip) other.style.display = "none";
    tip.style.display = show ? "block" : "none";
    if (show) place();
  });
  return () => tip.remove();
}
export default { render };
"""

_COPY_JS = """
function render({ model, el }) {
  const button = document.createElement("button");
  button.className = "lm-Widget jupyter-widgets jupyter-button widget-button";
  button.textContent = "copy as code";
  button.title = "copy Python that draws this figure to the clipboard (also shown below)";
  // the write happens inside the click (a user gesture, as browsers require) with the code the
  // kernel sent after the last redraw; the kernel is then told what the browser answered
  button.addEventListener("click", async () => {
    const code = model.get("code");
    let answer = "";
    if (!code) answer = "nothing to copy";
    else if (!navigator.clipboard || !window.isSecureContext) answer = "this page has no clipboard access";
    else {
      try { await navigator.clipboard.writeText(code); answer = "copied"; }
      catch (error) { answer = String((error && error.message) || error); }
    }
    model.set("clicked", [answer, Date.now()]);
    model.save_changes();
  });
  el.append(button);
}
export default { render };
"""

if anywidget is not None:

    class CopyButton(anywidget.AnyWidget):
        """The "copy as code" button: a click writes ``code`` (the current figure's code, kept up to date by
        the explorer) to the browser's clipboard and reports ``clicked = [answer, time]``: "copied", or why
        the browser refused (the explorer then still shows the code as text)."""

        _esm = _COPY_JS
        code = traitlets.Unicode("").tag(sync=True)
        clicked = traitlets.List([]).tag(sync=True)

    class SvgCanvas(anywidget.AnyWidget):
        """The figure as inline SVG (``value``, like ``W.HTML``) that reports where it is pointed
        at: ``click`` and ``hover`` are ``[x, y, part, time]``, ``(x, y)`` in the SVG's user units
        (points from the top left, see :func:`figures.at_svg_point`) and ``part`` the index of
        the SVG (an A/B figure shows two); ``tip`` is the hover text shown at the pointer."""

        _esm = _CANVAS_JS
        value = traitlets.Unicode("").tag(sync=True)
        click = traitlets.List([]).tag(sync=True)
        hover = traitlets.List([]).tag(sync=True)
        tip = traitlets.Unicode("").tag(sync=True)


def _activation_controls(prefix: str) -> tuple[W.Dropdown, W.Checkbox]:
    """The plan's activation controls: the activation dtype (its options are the recipe's row of
    ``recipes.ACTIVATION_DTYPES``, set per layer and backend by :func:`_activation_args`) and the
    NVFP4 per-token switch (enabled where the format's tactics allow it)."""
    dtype = _dropdown(f"{prefix}activation", ("default",), "default", "200px")
    per_token = W.Checkbox(False, description=f"{prefix}per-token acts", indent=False, layout=W.Layout(width="160px"))
    return dtype, per_token


def _activation_offer(fmt: str, backend: str, dtype: str, per_token: bool) -> tuple[tuple, bool, Optional[str], bool]:
    """What the tables offer for ``fmt`` on ``backend`` and what the controls' values ``dtype``, ``per_token``
    become there: ``(dtype options, per-token allowed, activation_dtype, per_token)``. The options are the
    dtypes of ``recipes.ACTIVATION_DTYPES`` (one "default" entry where the recipe has one layout; a dtype not
    offered becomes the first), per-token only where ``specs.FORMATS[fmt].tactics.per_token_ok``. A choice the
    tables do not offer is None / False."""
    from fimoe_lab.checkpoints.plan_choice import layout_format
    from fimoe_lab.recipes import ACTIVATION_DTYPES, recipe_id
    from fimoe_lab.specs import FORMATS

    planned = layout_format(fmt)
    choices = ACTIVATION_DTYPES.get(recipe_id(planned, backend), ())
    options = tuple(choices) or ("default",)
    tactics = FORMATS[planned].tactics if planned in FORMATS else None
    allowed = tactics is not None and tactics.per_token_ok
    chosen = (dtype if dtype in options else options[0]) if choices else None
    return options, allowed, chosen, bool(per_token) and allowed


def _activation_args(fmt: str, backend: str, dtype: W.Dropdown, per_token: W.Checkbox) -> tuple[Optional[str], bool]:
    """``(activation_dtype, per_token)`` for ``plan_layer`` from the two controls, after giving them
    what the tables offer for ``fmt`` on ``backend`` (:func:`_activation_offer`; the dtype menu disabled
    where the recipe has one layout)."""
    options, allowed, chosen, token = _activation_offer(fmt, backend, dtype.value, per_token.value)
    if tuple(dtype.options) != options:
        keep = dtype.value if dtype.value in options else options[0]
        dtype.options = options
        dtype.value = keep
    dtype.disabled = chosen is None
    per_token.disabled = not allowed
    return chosen, token


def _figure_view() -> W.DOMWidget:
    """Where an explorer shows its figure: a :class:`SvgCanvas` with anywidget, else ``W.HTML``."""
    layout = W.Layout(overflow="auto", max_width="100%")
    return SvgCanvas(layout=layout) if anywidget is not None else W.HTML(layout=layout)


class _Explorer(W.VBox):
    """Controls, figure, message and export row; subclasses define ``_draw`` (and ``code``).

    Redraws coalesce: in a kernel (``background``, default :func:`_in_kernel`) a control change only
    asks for a figure and returns; one drawing thread per explorer draws the newest request. A change
    that arrives while a redraw runs supersedes it: the older redraw stops at its next stage (before
    rendering SVG) and nothing of it is shown, then the newest control state is drawn; any number of
    changes in between cost one redraw, never a queue of stale ones. Outside a kernel (scripts,
    tests) each change redraws before returning. The first figure is drawn before the explorer is
    returned; :meth:`wait` blocks until the newest request is shown (a cell that sets a control and
    then reads ``state`` waits first)."""

    CACHE = 12
    """Figures kept per explorer, by control state: going back to a setting is instant."""

    POINT_WAIT = 2.0
    """Seconds a click or hover waits for a redraw under way (then it answers for the new figure), else finds no cell."""

    background: bool
    """Redraw on the explorer's drawing thread (True in a kernel) or before a change returns."""

    prepare: bool
    """With ``background``: once the newest request is shown and none is pending, the drawing thread prepares
    what the user is likely to ask next (:meth:`_prepare`) in small units, stopping at once (before the next
    unit) when any explorer is asked for a figure, so a change waits for at most one unit. Default
    ``$FIMOE_LAB_PREPARE`` (on)."""

    def __init__(self, controls: list, background: Optional[bool] = None, prepare: Optional[bool] = None):
        from fimoe_lab import env

        self._local = threading.local()  # per thread: whether its control changes are the explorer's own
        self.background = _in_kernel() if background is None else background
        self.prepare = env.value("FIMOE_LAB_PREPARE", True) if prepare is None else prepare
        self._asked = 0  # requests made (control changes), the newest's number
        self._drawing = 0  # the request the running (or last) redraw draws
        self._shown = 0  # the request the last finished redraw drew
        self._worker: Optional[threading.Thread] = None
        self._worker_lock = threading.Lock()
        self._settled = threading.Condition(self._worker_lock)  # a redraw finished, or the drawing thread ended
        self.view = _figure_view()
        self.view.add_class("fimoe-figure")
        self.message = W.HTML()
        self.message.add_class("fimoe-message")
        self.trace_box = W.HTML()
        self.trace_box.add_class("fimoe-trace")
        self.figure: Optional[Figure] = None
        self.svg = ""
        self.state: dict = {}
        self._drawn: OrderedDict = OrderedDict()
        self._layers: OrderedDict = OrderedDict()  # static key -> (figure, SVG without its moving layer)
        # the figure keys of the two latest views that differ (older, newer) and of the running redraw
        self._shown_keys: tuple[set, set, set] = (set(), set(), set())
        self.save_name = W.Text(placeholder="file name (default: fimoe-<explorer>)", layout=W.Layout(width="260px"))
        save_png, save_svg = W.Button(description="save PNG"), W.Button(description="save SVG")
        save_png.on_click(lambda _: self._save_clicked("png"))
        save_svg.on_click(lambda _: self._save_clicked("svg"))
        show_code: W.DOMWidget
        if anywidget is not None:
            show_code = self.copy_button = CopyButton()
            show_code.observe(lambda change: self._show_code(str((change["new"] or [""])[0])), names="clicked")
        else:
            show_code = W.Button(description="copy as code")
            show_code.on_click(lambda _: self._show_code())
        self.code_box = W.Textarea(layout=W.Layout(width="100%", height="90px", display="none"))
        self.controls = controls
        rows = [W.HBox(controls[i : i + 4]) for i in range(0, len(controls), 4)]
        self.code_status = W.HTML()  # what the browser answered the copy button
        self.code_status.add_class("fimoe-copied")
        export = W.HBox([self.save_name, save_png, save_svg, show_code, self.code_status])
        super().__init__(rows + [self.message, self.view, self.trace_box, export, self.code_box])
        for c in controls:
            c.observe(self.refresh, names="value")
        if anywidget is not None:
            self.view.observe(lambda change: self._from_page(self.click, change["new"]), names="click")
            self.view.observe(lambda change: self._from_page(self._hover, change["new"]), names="hover")
        self._asked += 1
        self._draw_newest()  # the first figure before the explorer is returned: a notebook cell may read its state

    def _draw(self) -> tuple[Figure, str]:
        raise NotImplementedError

    LAYERED = 4
    """Figures kept by :meth:`_layered` (by what their static part shows)."""

    def _layered(self, key: tuple, build, move, layers, top_moves: bool = True, prepare: bool = False):
        """A figure drawn once per ``key`` whose later changes touch only its moving layers:
        ``build()`` draws it (the static part is rendered once, :func:`figures.svg_without`),
        ``move(fig)`` updates it in place, ``layers(fig)`` lists the moving layers bottom to top
        as ``(what it shows, artists)``. Only the top layer (unless not ``top_moves``: its "what it
        shows" then says all it shows) and any layer whose "what it shows" changed are rendered
        again (:func:`figures.svg_only`). A generator (one step per build or rendering, :func:`_run` runs
        it) returning the figure and its SVG; with ``prepare`` it only adds a figure not kept yet, as the
        least recently used but one (the shown figure stays the newest), its layers rendered as built."""
        if not prepare:
            self._shown_keys[2].add(key)
        if key in self._layers:
            if prepare:
                return None
            move(self._layers[key][0])
        else:
            fig = build()
            yield
            every = [a for _, artists in layers(fig) for a in artists]
            self._keep(self._layers, key, (fig, figures.svg_without(fig, every), {}), prepare)
            yield
        if not prepare:
            self._layers.move_to_end(key)
            self._check()  # what follows renders SVG: not for a superseded setting
        fig, base, rendered = self._layers.get(key, (None, "", {}))
        if fig is None:  # prepared, then dropped by the ones prepared after it
            return None
        shown = layers(fig)
        for k, (what, artists) in enumerate(shown):
            if (top_moves and k == len(shown) - 1 and not prepare) or k not in rendered or rendered[k][0] != what:
                rendered[k] = (what, figures.svg_only(fig, artists))
                yield
        return fig, figures.stack_svg(base, *(rendered[k][1] for k in range(len(shown))))

    def _keep(self, kept: OrderedDict, key: tuple, entry: tuple, prepare: bool) -> None:
        """Put a new figure's ``entry`` in the figure cache ``kept`` under ``key``: a prepared one as the least
        recently used but one (the shown figure stays the newest). Then drop the least recently used figures past
        :attr:`LAYERED`, never one of the two latest different views or the running redraw (going back to the
        view shown before stays instant): where only those are left, a prepared newcomer goes itself (a shown
        one drops the oldest)."""
        newest = next(reversed(kept), None)
        kept[key] = entry
        if prepare and newest is not None:
            kept.move_to_end(newest)
        keep = set().union(*self._shown_keys)
        while len(kept) > self.LAYERED:
            victim = next((k for k in kept if k not in keep), None)
            kept.pop(victim if victim is not None else key if prepare else next(iter(kept)))
            _DROPPED["figures"] += 1

    def _key(self) -> tuple:
        """The control state a figure is drawn from (the cache key)."""
        return tuple(repr(c.value) for c in self.controls)

    def code(self) -> str:
        """Python that draws the current figure without the explorer."""
        raise NotImplementedError

    @property
    def _busy(self) -> bool:
        """True while this thread changes controls itself (a menu the redraw refills, a loaded layer):
        those changes ask for no redraw. Per thread: a user's change during a background redraw still does."""
        return bool(getattr(self._local, "busy", False))

    @_busy.setter
    def _busy(self, value: bool) -> None:
        self._local.busy = value

    def refresh(self, *_) -> None:
        """Redraw from the controls' values; a bad combination shows its error instead.

        An error replaces the figure (:meth:`show_error`) and says why; the next change redraws.
        The garbage collector is paused meanwhile (:func:`_collector_paused`). With ``background``
        this only asks for the redraw (the class docstring: the newest request is drawn).
        """
        if self._busy:
            return
        _request()
        self._asked += 1
        if not self.background:
            self._draw_newest()
            return
        with self._worker_lock:
            if self._worker is None:
                self._worker = threading.Thread(target=self._drain, name="fimoe-redraw", daemon=True)
                self._worker.start()

    def _drain(self) -> None:
        """The drawing thread: draw the newest request until none is newer than the one shown, then (with
        :attr:`prepare`, :data:`PREPARE_AFTER` seconds later) prepare, one unit at a time while no explorer is
        asked for a figure."""
        units: Optional[Iterator[None]] = None
        since, start = 0, 0.0
        while True:
            with self._worker_lock:
                newer = self._drawing != self._asked
                if not newer and (units is None or not self.prepare):
                    self._worker = None
                    self._settled.notify_all()
                    break
            if newer:
                self._draw_newest()
                if self.prepare:
                    units, since = self._preparing(), _requests()
                    start = time.monotonic() + PREPARE_AFTER
                continue
            assert units is not None
            if time.monotonic() < start:  # the figure just shown first (:data:`PREPARE_AFTER`)
                time.sleep(0.005)
                continue
            while _POINTERS["waiting"]:  # a click or hover first: it reads the shown figure
                time.sleep(0.002)
            with _DRAWING, _collector_paused():
                try:
                    more = _requests() == since and next(units, False) is None
                except Exception:  # noqa: BLE001 - preparing is optional: a failure only ends this pass
                    more = False
            if not more:
                units.close()
                units = None
        if not (self.prepare and _DROPPED["figures"]):
            return
        quiet = time.monotonic() + GIVE_BACK_QUIET
        while _requests() == since and time.monotonic() < quiet:
            time.sleep(0.02)
        with _DRAWING:
            if _requests() == since and _DROPPED["figures"]:  # (a change meanwhile: a later burst gives it back)
                _give_back_memory()

    def _preparing(self) -> Iterator[None]:
        """:meth:`_prepare`'s views one after the other, one step per ``next``; a view that cannot be drawn or
        finds no room (:class:`_NoRoom`) is skipped."""
        for view in self._prepare():
            try:
                yield from view
            except (_NoRoom, FimoeError, sources.LabUnavailable, ValueError, KeyError, OSError):
                continue

    def _prepare(self) -> Iterator[Iterator[None]]:
        """What the user is likely to ask next, as generators (each ``next`` one small unit of work) that put it
        in the caches a redraw reads (figures, derived data, expert values); nothing by default."""
        return iter(())

    def _draw_newest(self) -> None:
        """One redraw of the newest request (skipped, unshown, where a newer one arrives meanwhile)."""
        with _DRAWING, _collector_paused():
            self._drawing = self._asked
            older, newer, last = self._shown_keys
            self._shown_keys = (newer, last, set()) if last and last != newer else (older, newer, set())
            self._redraw()
        with self._worker_lock:
            self._shown = self._drawing
            self._settled.notify_all()

    def _check(self) -> None:
        """Stop the running redraw (:class:`_Superseded`) when a newer control change asked for another."""
        if self._drawing != self._asked:
            raise _Superseded

    def wait(self, timeout: float = 60.0, prepared: bool = False) -> bool:
        """Block until the newest request is drawn and shown (at once without ``background``), and with
        ``prepared`` until idle preparation ended too; False on timeout."""
        with self._settled:
            return self._settled.wait_for(
                lambda: self._worker is None or (not prepared and self._shown == self._asked), timeout
            )

    def _redraw(self) -> None:
        """:meth:`refresh`'s work."""
        self._busy = True
        try:
            key = self._key()
            if key in self._drawn:
                self._drawn.move_to_end(key)
                fig, svg, note, state = self._drawn[key]
                self.state = dict(state)
            else:
                fig, note, *given = self._draw()
                if fig is not self.figure:  # the one shown before may be garbage now (:func:`_give_back_memory`)
                    _DROPPED["figures"] += 1
                self._check()
                parts = getattr(fig, "parts", None)  # an A/B figure: each part as its own vector SVG
                if given:  # the explorer rendered it (a marker moved on a figure already drawn)
                    svg = given[0]
                elif parts:
                    svg = "".join(f"<div><b>{label}</b></div>{figures.to_svg(p)}" for label, p in zip("AB", parts))
                else:
                    svg = figures.to_svg(fig)
                key = self._key()
                self._check()
                self._drawn[key] = (fig, svg, note, dict(self.state))
                while len(self._drawn) > self.CACHE:
                    self._drawn.popitem(last=False)
        except _Superseded:
            return
        except (FimoeError, sources.LabUnavailable, ValueError, KeyError, OSError) as exc:
            if self._drawing == self._asked:  # an error of a superseded setting is not shown either
                self.show_error(exc)
            return
        finally:
            self._busy = False
        self.figure, self.svg = fig, svg
        self.view.value = svg
        self.message.value = html.escape(note)
        self.trace_box.value = ""
        if anywidget is not None:  # what the copy button writes, ready before the click (the browser's rule)
            try:
                self.copy_button.code = self._code_text()
            except (KeyError, FimoeError):
                self.copy_button.code = ""

    def show_error(self, exc: BaseException, what: str = "figure cleared") -> None:
        """Say why the controls' setting cannot be drawn, in place of the figure: the figure of an earlier
        setting is no longer shown (nor saved), so nothing on screen disagrees with the controls."""
        text = html.escape(str(exc) or type(exc).__name__)
        self.figure, self.svg = None, ""
        if anywidget is not None:
            self.copy_button.code = ""  # no figure: nothing to copy
        self.view.value = f"<div class='fimoe-error' style='color:#d33;padding:12px 4px'>{text}</div>"
        self.message.value = f"<span style='color:#d33'>{text} ({what})</span>"
        self.trace_box.value = ""

    def _part(self, part: int) -> Optional[Figure]:
        """The figure drawn as SVG number ``part`` of the view (an A/B figure shows its two parts)."""
        parts = getattr(self.figure, "parts", None)
        if parts:
            return parts[part] if 0 <= part < len(parts) else None  # type: ignore[no-any-return]
        return self.figure if part == 0 else None

    def point(self, x: float, y: float, part: int = 0) -> Optional[data.Trace]:
        """The element under point ``(x, y)`` of SVG ``part`` (points from its top left, what the
        figure reports) followed through its map (:func:`data.trace_cell`), or None where no
        cell is drawn (or before anything is drawn, or while a redraw outlasts :attr:`POINT_WAIT`). Idle
        preparation lets a waiting pointer in before its next unit (:data:`_POINTERS`)."""
        with _POINTERS_LOCK:
            _POINTERS["waiting"] += 1
        try:
            got = _DRAWING.acquire(timeout=self.POINT_WAIT)
        finally:
            with _POINTERS_LOCK:
                _POINTERS["waiting"] -= 1
        if not got:
            return None  # a redraw is still under way: nothing settled to point at
        try:
            fig = self._part(int(part))
            if fig is None:
                return None
            hit = figures.cell_at(fig, float(x), float(y))
            if hit is None:
                return None
            _, cells, i, j = hit
            return self._traced(cells, data.trace_cell(cells, i, j))
        finally:
            _DRAWING.release()

    def _traced(self, cells: data.Cells, trace: data.Trace) -> data.Trace:
        """What :meth:`point` returns for ``trace`` of a cell of ``cells`` (layer explorers add bits)."""
        return trace

    @staticmethod
    def _from_page(handler, report) -> None:
        """Pass a click or hover report ``[x, y, part, time]`` from the page to ``handler``; a
        malformed one (not numbers) is ignored."""
        numbers = isinstance(report, (list, tuple)) and len(report) >= 3
        if numbers and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in report[:3]):
            handler(float(report[0]), float(report[1]), int(report[2]))

    def click(self, x: float, y: float, part: int = 0) -> Optional[data.Trace]:
        """Follow the cell under point ``(x, y)`` of SVG ``part``: a kernel cell is traced back
        through every step, a checkpoint cell shows where it lands; the chain of step names and
        coordinates is shown under the figure, both ends are circled. Elsewhere nothing
        changes; an element that cannot be followed only sets the message."""
        try:
            trace = self.point(x, y, part)
        except (FimoeError, ValueError, IndexError) as exc:
            self.message.value = f"<span style='color:#d33'>{html.escape(str(exc))} (nothing traced)</span>"
            return None
        if trace is not None:
            self._show_trace(trace, int(part))
        return trace

    def _show_trace(self, trace: data.Trace, part: int) -> None:
        """Show a followed element: message, chain under the figure, markers on the shown SVG."""
        self.state["trace"] = trace
        self.message.value = html.escape(f"{trace.summary()}; moved by: {trace.moved_by}")
        self.trace_box.value = (
            f"<pre style='font-size:11px;margin:0'>{html.escape(figures.chain_text(trace.chain))}</pre>"
        )
        pieces = self.svg.split("</svg>")
        fig = self._part(part)
        if fig is not None and part < len(pieces) - 1:
            pieces[part] += figures.trace_markers(fig, trace)
        self.view.value = "</svg>".join(pieces)

    def _hover(self, x: float, y: float, part: int = 0) -> str:
        """The hover text of the cell under ``(x, y)`` (row, column, value, source element, the steps
        that moved it), also sent to the figure's tooltip; empty where there is no cell."""
        try:
            trace = self.point(x, y, part)
            text = "" if trace is None else trace.hover()
        except (FimoeError, ValueError, IndexError) as exc:
            text = str(exc)
        if anywidget is not None and isinstance(self.view, SvgCanvas):
            self.view.tip = ""  # a change even when the text repeats: the page shows it at the new place
            self.view.tip = text
        return text

    def _save_clicked(self, fmt: str) -> None:
        """A save button: :meth:`save`, a refusal shown in the message line."""
        try:
            self.save(fmt)
        except (FimoeError, OSError) as exc:
            self.message.value = html.escape(f"not saved: {exc}")

    def save(self, fmt: str, path: Optional[str] = None) -> Path:
        """Write the shown figure as ``fmt`` ("png": 2x on white, "svg": vector) to ``path``
        (default: the name box, or ``fimoe-<explorer>``); returns the file written. Through
        :func:`fimoe_lab.owned_files.write_file_output`: an existing file of that name is replaced only
        if fimoe-lab wrote it (a link or another file is refused), atomically."""
        if self.figure is None:
            raise LayoutError("there is no figure to save yet", fix="pick a setting that draws one")
        name = path or self.save_name.value.strip() or f"fimoe-{type(self).__name__.lower()}"
        out = Path(name).expanduser().with_suffix(f".{fmt}")
        if not out.parent.is_dir():
            raise LayoutError(f"folder {out.parent} does not exist", fix="create it or type another file name")
        parts = getattr(self.figure, "parts", None)
        if fmt == "png":
            payload = figures.to_png(figures.side_by_side(*parts) if parts else self.figure)
        else:
            payload = self.svg.encode()
        owned_files.write_file_output(out, payload, fmt, force=True)
        self.message.value = html.escape(f"saved {out.resolve()}")
        return out

    def _save_clicked(self, fmt: str) -> None:
        """The save buttons: the file written, or one red line saying why nothing was (the figure stays)."""
        try:
            self.save(fmt)
        except (FimoeError, OSError, ValueError) as exc:
            self.message.value = f"<span style='color:#d33'>{html.escape(str(exc))} (not saved)</span>"

    def _code_text(self) -> str:
        """Python that draws the shown figure and displays it (the last line is the figure)."""
        code = self.code()
        return code + ("fig\n" if "\nfig = " in "\n" + code else "")

    def _show_code(self, clipboard: str = "") -> None:
        """The code box, shown: :meth:`_code_text`; ``clipboard`` is the browser's answer to the copy button
        ("copied", or why not), said next to the button (the code box is there either way)."""
        try:
            code = self._code_text()
        except (KeyError, FimoeError) as exc:  # nothing drawn yet
            self.message.value = f"<span style='color:#d33'>no code for this view: {html.escape(str(exc))}</span>"
            return
        self.code_box.value = code
        self.code_box.layout.display = None
        if clipboard == "copied":
            self.code_status.value = "copied to the clipboard (and shown below)"
        elif clipboard:
            self.code_status.value = html.escape(f"not copied: {clipboard} (the code is below)")


class _LayerExplorer(_Explorer):
    """An explorer over one layer's plan: layer menu (seeded shape, path box, layer, TP size
    and rank), backend, tensor, expert."""

    tensor_filter = staticmethod(lambda m: True)

    def __init__(
        self,
        layer: Optional[sources.ExpertTensors],
        extra: list,
        source: str = "seeded:mxfp8",
        backend: str = "trtllm",
        tensor: str = "w13",
        background: Optional[bool] = None,
        prepare: Optional[bool] = None,
    ):
        self.layer_given = layer
        choices = [(layer.source, "given")] if layer is not None else layer_choices()
        self.source = W.Dropdown(
            options=choices,
            value="given" if layer is not None else source,
            description="layer",
            layout=W.Layout(width="360px"),
            style=STYLE,
        )
        self.source.disabled = layer is not None
        self.shape = W.Text(
            "",
            placeholder="I x H",
            description="seeded I x H",
            style=STYLE,
            layout=W.Layout(width="230px"),
            continuous_update=False,
        )
        self.backend = _dropdown("backend", BACKENDS, backend)
        self.activation, self.per_token = _activation_controls("")
        self.tensor = _dropdown("tensor", data.TENSOR_NAMES, tensor)
        self.expert = _slider("expert", 0, 3)
        self.path = W.Text(
            placeholder="checkpoint directory or sample name",
            description="checkpoint",
            style=STYLE,
            layout=W.Layout(width="360px"),
        )
        self.layer_index = W.Text("first", description="MoE layer", style=STYLE, layout=W.Layout(width="160px"))
        self.tp_size = _dropdown("TP size", TP_SIZES, 1, "160px")
        self.tp_rank = W.BoundedIntText(
            0, min=0, max=max(TP_SIZES) - 1, description="TP rank", style=STYLE, layout=W.Layout(width="160px")
        )
        load = W.Button(description="load", button_style="primary")
        load.on_click(lambda _: self.load())
        self.loader = W.HBox([self.path, self.layer_index, self.tp_size, self.tp_rank, load])
        self.loader.add_class("fimoe-loader")  # what the next "load" opens: these change nothing until then
        self.progress = W.HTML()
        self.progress.add_class("fimoe-progress")
        self._opened = ""  # what the last load opened (the progress line keeps it)
        plan_controls = [self.source, self.shape, self.backend, self.activation, self.per_token]
        super().__init__(plan_controls + [self.tensor, self.expert] + extra, background, prepare)
        self.children = (self.loader, self.progress) + tuple(self.children)

    def load(self, path: Optional[str] = None) -> None:
        """Open the checkpoint in the path box (or ``path``) at the chosen layer, TP size and
        rank, add it to the layer menu and show it; an unreadable one only sets the message.

        Opening checks the tensor headers and reads no weights (:func:`sources.load_layer`); while it
        runs the controls are disabled and the progress line says what is read. Any spelling of the same
        directory gives the same menu entry (its real path)."""
        where = (path or self.path.value).strip()
        layer = self.layer_index.value.strip() or "first"
        started = time.perf_counter()
        try:
            if not where:
                raise LayoutError("the checkpoint box is empty", fix="type a checkpoint directory or a sample name")
            if layer != "first" and not layer.isdigit():
                raise LayoutError(f"MoE layer {layer!r} is not a number", fix="type a layer index or 'first'")
            if not 0 <= self.tp_rank.value < self.tp_size.value:
                raise LayoutError(
                    f"TP rank {self.tp_rank.value} is outside 0..{self.tp_size.value - 1}",
                    fix=f"pick a rank in 0..{self.tp_size.value - 1}",
                )
            where = _checkpoint_key(where)
            key = f"path:{layer}:{self.tp_size.value}:{self.tp_rank.value}:{where}"
            with self._loading(f"opening {where} (layer {layer}): checking its tensor headers, reading no weights"):
                loaded = _layer(key)
        except (FimoeError, sources.LabUnavailable, ValueError, OSError) as exc:
            self.message.value = f"<span style='color:#d33'>{html.escape(str(exc))} (layer not changed)</span>"
            return
        self._busy = True  # one redraw, of the loaded layer (no intermediate menu state drawn)
        try:
            if self.layer_given is not None:
                self.layer_given = loaded
                self.source.options = [(loaded.source, "given")]
            else:
                self.source.options = [o for o in self.source.options if o[1] != key] + [(loaded.source, key)]
                self.source.value = key
        finally:
            self._busy = False
        self._opened = f"opened {loaded.source} in {time.perf_counter() - started:.2f} s ({_shards_text(where)}" + (
            "; each view reads one expert)" if loaded.lazy else ")"
        )
        self.progress.value = html.escape(self._opened)
        self.refresh()

    @contextmanager
    def _loading(self, text: str) -> Iterator[None]:
        """While a load runs: the progress line says what is read, every control is disabled (as it was after)."""
        widgets = [c for c in self.controls if hasattr(c, "disabled")] + list(self.loader.children)
        was = [w.disabled for w in widgets]
        self.progress.value = html.escape(text)
        for w in widgets:
            w.disabled = True
        try:
            yield
        finally:
            for w, d in zip(widgets, was):
                w.disabled = d

    def _redraw(self) -> None:
        """The layer explorers' redraw also puts the expert reads it made on the progress line (bytes, time, rate),
        and says when per-token activations leave the weight layout as it is (the figure cannot change)."""
        reads = _last_read(self)
        super()._redraw()
        if self._drawing != self._asked:  # superseded: the newest request says what is shown
            return
        if self.figure is not None and self.state.get("per_token") and self._same_without_per_token():
            self.message.value += html.escape(
                f" (per-token activations: the same weight layout as per-tensor on {self.backend.value})"
            )
        now = _last_read(self)
        if now is not None and now is not reads:
            expert, size, seconds = now
            self.progress.value = html.escape(
                (f"{self._opened} | " if self._opened else "")
                + f"read expert {expert} of {self.layer.source}: {size / 1e6:.1f} MB in {seconds:.2f} s "
                f"({size / 1e6 / max(seconds, 1e-6):.0f} MB/s)"
            )

    def _same_without_per_token(self) -> bool:
        """True when the shown plan's maps take the same steps as the plan with per-tensor activations."""
        plan, per_tensor = self.state["plan"], self.layer.plan(self.backend.value, self.state["activation_dtype"])

        def steps(p) -> dict:
            return {n: [(s.kind, s.params) for s in m.steps] for n, m in p.maps().items()}

        return steps(plan) == steps(per_tensor)

    @property
    def layer(self) -> sources.ExpertTensors:
        if self.layer_given is not None:
            return self.layer_given
        key = self.source.value
        if key.startswith("seeded:") and self.shape.value.strip():
            inter, hidden = parse_shape(self.shape.value)
            key = f"{key}:{inter}:{hidden}"
        return _layer(key)

    def _key(self) -> tuple:
        return super()._key() + (id(self.layer_given),)

    def current_map(self):
        """The index map of the chosen tensor in the chosen backend's plan for this layer."""
        layer = self.layer
        self.expert.max = layer.experts - 1
        activation, per_token = _activation_args(layer.fmt, self.backend.value, self.activation, self.per_token)
        plan = layer.plan(self.backend.value, activation, per_token)
        maps = plan.maps()
        usable = self._usable(plan)
        if list(self.tensor.options) != usable:
            keep = self.tensor.value if self.tensor.value in usable else usable[0]
            self.tensor.options = usable
            self.tensor.value = keep
        self.state = dict(
            fmt=layer.fmt,
            backend=self.backend.value,
            activation_dtype=activation,
            per_token=per_token,
            tensor=self.tensor.value,
            expert=min(self.expert.value, layer.experts - 1),
            plan=plan,
            layer=layer,
            word_bits=plan.word_bits.get(self.tensor.value),
        )
        return maps[self.tensor.value]

    def _usable(self, plan) -> list[str]:
        """The tensors of ``plan`` this view draws (:attr:`tensor_filter`); a :class:`LayoutError` when none."""
        usable = [n for n, m in plan.maps().items() if self.tensor_filter(m)]
        if not usable:
            raise LayoutError(
                f"{plan.description} has no tensor with the steps this view draws", fix="try another layer or backend"
            )
        return usable

    def _map_for(self, backend: str, tensor: str) -> tuple[Any, Any, str]:
        """``(plan, map, tensor)`` the controls would show on ``backend`` with ``tensor`` chosen (the first one
        drawn where the plan has no such tensor), read from the controls without changing any (what
        :meth:`current_map` draws after such a change)."""
        layer = self.layer
        _, _, activation, per_token = _activation_offer(layer.fmt, backend, self.activation.value, self.per_token.value)
        plan = layer.plan(backend, activation, per_token)
        usable = self._usable(plan)
        name = tensor if tensor in usable else usable[0]
        return plan, plan.maps()[name], name

    def _prepare(self) -> Iterator[Iterator[None]]:
        """While idle (:attr:`_Explorer.prepare`): the shown tensor on each other backend next to the chosen one,
        the tensors next to the shown one (:func:`_around`), what :meth:`_prepare_more` adds, then the experts
        next to the shown one (read and decoded, where the expert control is in use). Data only where it fits
        the room the shared caches have free (:meth:`_afford`)."""
        s = self.state
        if self.figure is None or "plan" not in s:
            return
        layer, name, expert = s["layer"], s["tensor"], s["expert"]
        self._room = list(sources.free_room())
        for backend in _around(self.backend):
            yield self._prepare_view(backend, name, expert)
        for tensor in _around(self.tensor):
            yield self._prepare_view(s["backend"], tensor, expert)
        yield from self._prepare_more()
        if not self.expert.disabled:
            for e in (expert + 1, expert - 1):
                if 0 <= e < layer.experts:
                    yield self._prepare_expert(layer, name, e)

    def _prepare_more(self) -> Iterator[Iterator[None]]:
        """The explorer's own likely next views (colourings, the other side's controls): none by default."""
        return iter(())

    def _afford(self, layer: sources.ExpertTensors, name: str, expert: int) -> None:
        """Take from this idle pass's room what showing ``name`` of ``expert`` adds to the shared caches
        (:meth:`sources.ExpertTensors.added_bytes`), or :class:`_NoRoom`: prepared data only fills the caches'
        free room, never makes them drop what the user was shown (going back to it stays instant)."""
        self._take(*layer.added_bytes(name, expert))

    def _take(self, raw: int, values: int) -> None:
        """Take ``raw`` expert bytes and ``values`` value bytes from this idle pass's room, or :class:`_NoRoom`."""
        if raw > self._room[0] or values > self._room[1]:
            raise _NoRoom
        self._room[0] -= raw
        self._room[1] -= values

    def _prepare_view(self, backend: str, tensor: str, expert: int, **more) -> Iterator[None]:
        """The figure of ``backend`` and ``tensor`` at ``expert`` (the other controls as they are), by
        :meth:`_view` with ``prepare``."""
        _, m, name = self._map_for(backend, tensor)
        self._afford(self.layer, name, expert)
        yield
        yield from self._view(m, backend, name, expert, prepare=True, **more)

    def _prepare_expert(self, layer: sources.ExpertTensors, name: str, expert: int) -> Iterator[None]:
        """Expert ``expert`` read, and ``name``'s values of it decoded (:meth:`sources.ExpertTensors.magnitude`,
        :meth:`~sources.ExpertTensors.dead`)."""
        self._afford(layer, name, expert)
        layer.expert(expert)
        yield
        layer.magnitude(name, expert)
        yield
        layer.dead(name, expert)
        yield

    def _view(self, m, backend: str, name: str, expert: int, prepare: bool = False, **more) -> Iterator[None]:
        """The explorer's figure of map ``m`` (``backend``'s, of tensor ``name``) at ``expert``, the other
        controls as they are, as steps (:meth:`_Explorer._layered`); with ``prepare`` only kept for later."""
        raise NotImplementedError

    def _map_note(self, m) -> str:
        """One line for the shown map: its steps and its shapes in bytes per expert (and, for packed FP4
        weights, in values: an R1 w13 is (4096, 3584) bytes = (4096, 7168) values)."""
        steps = " > ".join(s.kind for s in m.steps)
        note = f"{steps}: {m.in_shape} -> {m.out_shape} bytes per expert"
        per = get_format(self.layer.fmt).values_per_byte if not self.tensor.value.endswith("_scale") else 1
        if per > 1:
            values = lambda shape: shape[:-1] + (shape[-1] * per,)  # noqa: E731
            note += f" = {values(m.in_shape)} -> {values(m.out_shape)} values ({per} per byte)"
        return note

    def _bits_note(self) -> str:
        """What the message adds for a tensor whose plan has a word bit step (the views draw its byte map)."""
        bits = self.state.get("word_bits")
        if bits is None:
            return ""
        return (
            f"; then a bit permutation on every 32-bit word follows ({bits.name}): the bytes drawn are the byte "
            "map's, a click on a kernel byte also gives the checkpoint bit of each of its bits"
        )

    def _traced(self, cells: data.Cells, trace: data.Trace) -> data.Trace:
        """A kernel byte of the plan's full byte map, when a word bit step follows it: with the
        source bit of each of its 8 bits (:func:`data.with_word_bits`)."""
        bits, m = self.state.get("word_bits"), self.state.get("plan")
        full = m is not None and cells.m is m.maps().get(self.state.get("tensor", ""))
        if bits is None or not full or trace.kernel is None or cells.itemsize != 1:
            return trace
        return data.with_word_bits(trace, cells.m, bits)

    def _layer_code(self) -> str:
        """Python for the shown layer and map (``layer``, ``m``, ``size``)."""
        key = self.source.value
        layer = self.layer
        if key.startswith("path:"):
            idx, tp, rank, path = key.split(":", 4)[1:]
            load = f"layer = sources.load_layer({path!r}, {None if idx == 'first' else int(idx)}, {tp}, {rank})"
        elif key.startswith("sample:"):
            load = f"layer = sources.load_layer({key.split(':', 1)[1]!r})"
        elif self.layer_given is not None and layer.lazy:  # a checkpoint's layer: its real path, layer and TP slice
            path, _, idx, tp, rank = layer.key
            load = f"layer = sources.load_layer({path!r}, {idx}, {tp}, {rank})"
        elif self.layer_given is not None and layer.source.startswith("sample_layer("):  # the call that made it
            load = f"layer = sources.{layer.source}"
        elif self.layer_given is not None:
            raise LayoutError(
                f"the layer given to this explorer ({layer.source}) was made in memory: no code reads it again",
                fix="pass the ExpertTensors you gave the explorer as `layer`",
            )
        else:
            load = (
                f"layer = sources.sample_layer({layer.fmt!r}, experts={layer.experts}, "
                f"intermediate={layer.intermediate}, hidden={layer.hidden})"
            )
        return (
            "from fimoe_lab.viz import data, figures, sources\n"
            f"{load}\n"
            f"m = layer.plan({self.backend.value!r}, {self.state.get('activation_dtype')!r}, "
            f"{self.state.get('per_token', False)!r}).maps()[{self.tensor.value!r}]\n"
            f"size = data.itemsize_of(layer.fmt, {self.tensor.value!r})\n"
        )


class RowExplorer(_LayerExplorer):
    """Row permutations: checkpoint row -> kernel row for pad, W13/W31 swap, gated interleave
    and the epilogue-tile shuffle (any composed chain), coloured by origin, shuffle block or
    epilogue tile (the modes the chain has), with a row window on the kernel or the
    checkpoint side and the expert's values (NaN/Inf/dead scales marked) in the window."""

    tensor_filter = staticmethod(lambda m: len(m.steps[0].out_shape) == 2 and m.steps[0].kind != "swizzle_scales_128x4")

    CACHE = 0  # the figure is shared between windows and sides (its window layer moves): nothing to keep per setting

    def __init__(self, layer: Optional[sources.ExpertTensors] = None, **kwargs):
        self.colour_by = _dropdown("colour by", ("origin", "shuffle block", "epilogue tile"))
        self.side = _dropdown("window on", ("kernel", "checkpoint"))
        self.start = _slider("first row", 0, 1024, 8)
        self.size = _dropdown("rows", (16, 32, 64, 128, 256), 64)
        super().__init__(layer, [self.colour_by, self.side, self.start, self.size], **kwargs)

    def _draw(self):
        m = self.current_map()
        name, expert = self.tensor.value, self.state["expert"]
        (fig, svg), flow, window, colour, top = _run(self._view(m, self.backend.value, name, expert))
        self.start.max = top
        note = ""
        if colour != self.colour_by.value:
            note = f" (colouring by {self.colour_by.value!r} needs an epilogue shuffle: shown by origin)"
        self.state.update(flow=flow, window=window, colour_by=colour, side=self.side.value)
        return fig, f"{self.state['plan'].description}: {self._map_note(m)}{note}{self._bits_note()}", svg

    def _view(self, m, backend: str, name: str, expert: int, prepare: bool = False, **more) -> Iterator[None]:
        """Steps returning ``((figure, SVG), flow, window, colouring, last first row)``."""
        layer = self.layer
        flow = data.memo(data.row_flow, m, 2 if name.startswith("w13") and layer.gated else 1)
        modes = flow.colour_modes()
        colour = self.colour_by.value if self.colour_by.value in modes else "origin"
        side = self.side.value
        top = max(0, (flow.out_rows if side == "kernel" else flow.in_rows) - 8)
        window = (min(self.start.value, top), min(self.start.value, top) + self.size.value)
        values = layer.magnitude(name, expert)
        dead = layer.dead(name, expert)
        size = data.itemsize_of(layer.fmt, name)
        if prepare:
            yield

        # the static part is drawn once per (layer, plan, tensor); an expert change redraws the colour
        # scale and the values layers, a window or side change the rows and values layers (figures.row_layers)
        def move(f):
            if f._fimoe_rows["values"] is not values:
                figures.show_values(f, values, dead)
            figures.show_rows(f, window, side, colour)

        drawn = yield from self._layered(
            (id(layer), id(m), backend, name),
            lambda: figures.row_permutation_figure(
                m, flow.projections, window, colour, values, size, side=side, dead=dead
            ),
            move,
            figures.row_layers,
            top_moves=False,
            prepare=prepare,
        )
        return drawn, flow, window, colour, top

    def code(self) -> str:
        s = self.state
        return self._layer_code() + (
            f"flow = data.row_flow(m, {s['flow'].projections})\n"
            f"fig = figures.row_permutation_figure(m, {s['flow'].projections}, {s['window']}, {s['colour_by']!r}, "
            f"layer.magnitude({s['tensor']!r}, {s['expert']}), size, side={s['side']!r}, "
            f"dead=layer.dead({s['tensor']!r}, {s['expert']}))\n"
        )


class TileExplorer(_LayerExplorer):
    """Block-major-K tiles (bf16 / fp8-block TRT-LLM weights) and the 128x4 scale swizzle
    (mxfp8 / nvfp4 / mxfp4 TRT-LLM scales), atom by atom, each group of the atom labelled
    with its kernel row and checkpoint row."""

    tensor_filter = staticmethod(lambda m: len(m.out_shape) == 3 or m.steps[-1].kind == "swizzle_scales_128x4")

    CACHE = 0  # the swizzle figure is shared between atoms (its atom layer moves): nothing to keep per setting

    TILE_COLOURS = ("source column", "source row")

    def __init__(self, layer: Optional[sources.ExpertTensors] = None, **kwargs):
        self.atom = _slider("atom", 0, 64)
        self.colour_by = _dropdown("colour by", figures.SWIZZLE_COLOURS)
        kwargs.setdefault("tensor", "w13_scale")
        super().__init__(layer, [self.atom, self.colour_by], **kwargs)

    def _offer(self, options: tuple, kind: str) -> None:
        """Give the controls what the view ``kind`` ("tiles" or "swizzle") uses: the colourings it has; the
        atom slider only for the swizzle; the expert only where the expert's values are drawn."""
        if tuple(self.colour_by.options) != options:
            keep = self.colour_by.value if self.colour_by.value in options else options[0]
            self.colour_by.options = options
            self.colour_by.value = keep
        self.atom.disabled = kind != "swizzle"
        self.expert.disabled = not (kind == "swizzle" and self.colour_by.value == "scale value")

    def _draw(self):
        m = self.current_map()
        if len(m.out_shape) == 3:
            self._offer(self.TILE_COLOURS, "tiles")
            self.state.update(kind="tiles", colour_by=self.colour_by.value)
            fig, svg = _run(self._view(m, self.backend.value, self.tensor.value, self.state["expert"]))
            note = f"block-major-K: {self._map_note(m)}{self._bits_note()} (tiles are indices: no expert, no atom)"
            return fig, note, svg
        self._offer(figures.SWIZZLE_COLOURS, "swizzle")
        colour, expert = self.colour_by.value, self.state["expert"]
        (fig, svg), view, atom = _run(self._view(m, self.backend.value, self.tensor.value, expert))
        self.atom.max = view.atoms - 1
        self.state.update(view=view, kind="swizzle", atom=atom, colour_by=colour)
        which = f"expert {expert}'s scales" if colour == "scale value" else f"{colour} indices"
        return fig, f"{view.atoms} atoms, buffer coloured by {which}: {self._map_note(m)}{self._bits_note()}", svg

    def _prepare_more(self) -> Iterator[Iterator[None]]:
        """The colourings next to the chosen one."""
        for colour in _around(self.colour_by):
            yield self._prepare_view(self.state["backend"], self.state["tensor"], self.state["expert"], colour=colour)

    def _view(self, m, backend: str, name: str, expert: int, prepare: bool = False, **more) -> Iterator[None]:
        """Steps returning ``((figure, SVG), swizzle view, atom)`` of a swizzled map ``m``, or ``(figure, SVG)`` of
        block-major-K tiles (no moving part: kept whole, :attr:`LAYERED` of them), coloured by ``more["colour"]``
        (default the control's; one the view lacks: its first, as :meth:`_offer` chooses)."""
        colour = more.get("colour", self.colour_by.value)
        if len(m.out_shape) == 3:
            colour = colour if colour in self.TILE_COLOURS else self.TILE_COLOURS[0]
            return (
                yield from self._layered(
                    (id(self.layer), id(m), backend, name, colour),
                    lambda: figures.tile_figure(m, data.itemsize_of(self.layer.fmt, name), colour),
                    lambda f: None,
                    lambda f: [],
                    prepare=prepare,
                )
            )
        colour = colour if colour in figures.SWIZZLE_COLOURS else figures.SWIZZLE_COLOURS[0]
        size = data.itemsize_of(self.layer.fmt, name)
        view = data.memo(data.swizzle_view, m, size)
        atom = min(self.atom.value, view.atoms - 1)
        values = self.layer.magnitude(name, expert) if colour == "scale value" else None
        if prepare:
            yield
        # the grid, buffer and axes are drawn once per (tensor, colouring[, expert]); an atom change redraws
        # only the atom layer
        drawn = yield from self._layered(
            (id(self.layer), id(m), backend, name, colour, values is not None and expert),
            lambda: figures.swizzle_figure(m, size, atom, colour, values),
            lambda f: figures.show_atom(f, atom),
            lambda f: [(atom, figures.atom_artists(f))],
            prepare=prepare,
        )
        return drawn, view, atom

    def code(self) -> str:
        s = self.state
        if s["kind"] == "tiles":
            call = f"figures.tile_figure(m, size, {s['colour_by']!r})"
        else:
            values = f"layer.magnitude({s['tensor']!r}, {s['expert']})" if s["colour_by"] == "scale value" else "None"
            call = f"figures.swizzle_figure(m, size, atom={s['atom']}, colour_by={s['colour_by']!r}, values={values})"
        return self._layer_code() + f"fig = {call}\n"


class ProvenanceExplorer(_LayerExplorer):
    """Type or click an element (:meth:`click`: a cell of either heatmap): on the kernel side (row, column of the drawn kernel layout) its source
    (expert, row, column) and the chain of steps; on the checkpoint side where it lands.
    Before/after heatmaps of the expert's values, NaN/Inf/dead scales marked. The heatmaps
    are drawn once per (layer, backend, tensor) and their values layer once per expert; a new element only moves the two
    markers (:func:`figures.marker_svg`) and rewrites the chain, so it costs no rendering."""

    CACHE = 0  # the figure is shared between elements (its markers move): nothing to keep per setting

    def __init__(self, layer: Optional[sources.ExpertTensors] = None, **kwargs):
        self.pick = _dropdown("element of", ("kernel", "checkpoint"))
        self.row = _int_box("row", 0, "160px")
        self.col = _int_box("column", 0, "160px")
        self._static: OrderedDict = OrderedDict()  # static key -> (figure, base SVG, {expert: layer SVG}), LAYERED kept
        super().__init__(layer, [self.pick, self.row, self.col], **kwargs)

    def _show_trace(self, trace: data.Trace, part: int) -> None:
        """A clicked cell becomes the chosen element (the side and row, column boxes follow)."""
        where = trace.kernel if trace.side == "kernel" else trace.checkpoint
        if where is None:
            return
        self._busy = True
        try:
            self.pick.value = trace.side
            self.row.value, self.col.value = where
        finally:
            self._busy = False
        self.refresh()

    def _draw(self):
        m = self.current_map()
        name, expert = self.tensor.value, self.state["expert"]
        size = data.itemsize_of(self.layer.fmt, name)
        out = m.out_shape[:-1] + (m.out_shape[-1] // size,)
        rows, cols = (out[0] * out[1], out[2]) if len(out) == 3 else out
        before = self.layer.magnitude(name, expert)
        bounds = (rows, cols) if self.pick.value == "kernel" else before.shape
        r, c = self.row.value, self.col.value
        clamped = [
            f"{what} {v} is outside 0..{top - 1}: shown {min(max(v, 0), top - 1)}"
            for what, v, top in (("row", r, bounds[0]), ("column", c, bounds[1]))
            if not 0 <= v < top
        ]
        r, c = min(max(r, 0), bounds[0] - 1), min(max(c, 0), bounds[1] - 1)
        if self.pick.value == "kernel":
            flat = r * cols + c
        else:
            landed = data.landing(m, (r, c), size)
            if landed is None:
                raise LayoutError(f"checkpoint element ({r}, {c}) does not reach the kernel layout", fix="pick another")
            flat = int(np.ravel_multi_index(landed, out))
        coords = tuple(int(v) for v in np.unravel_index(flat, out))
        fig, svg = _run(self._view(m, self.backend.value, name, expert))
        chain = figures.show_provenance_element(fig, coords)
        self.state.update(coords=coords, chain=chain, pick=self.pick.value)
        src = chain[-1][2]
        where = "padding" if src is None else f"expert {expert}, row {src[0]}, column {src[-1]}"
        markers = figures.provenance_element(fig)[:2]
        points = fig._fimoe_prov["points"]
        circles = "".join(figures.marker_svg(line.axes, x, y) for line, (x, y) in zip(markers, points))
        chain_html = f"<pre style='font-size:11px;margin:0'>{html.escape(figures.chain_text(chain))}</pre>"
        note = f"kernel {coords} <- {where}" + "".join(f"; {n}" for n in clamped)
        bits = self.state.get("word_bits")
        if bits is not None and size == 1:  # the kernel byte after the word bit step: where each bit comes from
            note += "; " + data.bits_text(data.word_bit_sources(m, bits, flat)) + self._bits_note()
        return fig, note, svg.replace("</svg>", circles + "</svg>") + chain_html

    EXPERTS_KEPT = 8
    """Expert layers kept per heatmap figure (going back to an expert costs no rendering)."""

    def _view(self, m, backend: str, name: str, expert: int, prepare: bool = False, **more) -> Iterator[None]:
        """Steps returning the heatmap figure of ``(layer, plan, tensor)`` showing ``expert`` and its SVG (markers
        and chain hidden: they are drawn over it). The axes and titles are rendered once per
        tensor (:func:`figures.svg_without`); an expert change renders only the expert's layer
        (:func:`figures.provenance_layer`, :func:`figures.svg_only`), kept per expert. With ``prepare`` only a
        figure not kept yet is drawn (as the least recently used but one)."""
        layer = self.layer
        before, dead = layer.magnitude(name, expert), layer.dead(name, expert)
        static = (id(layer), id(m), backend, name)
        if not prepare:
            self._shown_keys[2].add(static)
        if static in self._static and prepare:
            return None
        if static not in self._static:
            if prepare:
                yield
            per = get_format(layer.fmt).values_per_byte if not name.endswith("_scale") else 1
            size = data.itemsize_of(layer.fmt, name)
            fig = figures.provenance_figure(m, (0,) * len(m.out_shape), before, size, dead, per)
            yield
            every = figures.provenance_layer(fig) + figures.provenance_element(fig)
            self._keep(self._static, static, (fig, figures.svg_without(fig, every), OrderedDict()), prepare)
            yield
        if not prepare:
            self._static.move_to_end(static)
        fig, base, layers = self._static.get(static, (None, "", {}))
        if fig is None:  # prepared, then dropped by the ones prepared after it
            return None
        if fig._fimoe_prov["values"] is not before:
            figures.show_provenance_values(fig, before, dead)
        if not prepare:
            self._check()
        if expert not in layers:  # svg_only draws the expert's layer alone (no markers, no chain)
            layers[expert] = figures.svg_only(fig, figures.provenance_layer(fig))
            while len(layers) > self.EXPERTS_KEPT:
                layers.popitem(last=False)
        if not prepare:
            layers.move_to_end(expert)
        return fig, figures.stack_svg(base, layers[expert])

    def code(self) -> str:
        s = self.state
        return self._layer_code() + (
            f"fig = figures.provenance_figure(m, {s['coords']}, layer.magnitude({s['tensor']!r}, {s['expert']}), "
            f"size, dead=layer.dead({s['tensor']!r}, {s['expert']}), "
            f"values_per_byte={1 if s['tensor'].endswith('_scale') else get_format(s['fmt']).values_per_byte})\n"
        )


class PaddingExplorer(_Explorer):
    """Padding masks of w13, w2 and their scales for a format, backend, TP size and
    alignment, with the waste in bytes and %; sizes typed in or read from a checkpoint
    (path box: its first MoE layer at TP 1)."""

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
        self.fmt = _dropdown("format", sources.PLAN_FORMATS, fmt)
        self.backend = _dropdown("backend", BACKENDS, backend)
        self.tp = _dropdown("TP", TP_SIZES, tp)
        self.intermediate = _int_box("intermediate", intermediate)
        self.hidden = _int_box("hidden", hidden)
        self.experts = _int_box("experts", experts)
        self.inter_align = _dropdown("I align", ("default", 16, 32, 64, 128, 256), inter_align)
        self.hidden_align = _dropdown("H align", ("default", 128, 256, 512, 1024), hidden_align)
        self.path = W.Text(
            placeholder="checkpoint directory or sample name",
            description="checkpoint",
            style=STYLE,
            layout=W.Layout(width="360px"),
        )
        load = W.Button(description="load sizes", button_style="primary")
        load.on_click(lambda _: self.load())
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
        self.children = (W.HBox([self.path, load]),) + tuple(self.children)

    def load(self, path: Optional[str] = None) -> None:
        """Set format and sizes from a checkpoint's first MoE layer (the path box, or ``path``)."""
        where = (path or self.path.value).strip()
        try:
            if not where:
                raise LayoutError("the checkpoint box is empty", fix="type a checkpoint directory or a sample name")
            layer = _layer(f"path:first:1:0:{where}")
            if layer.fmt not in sources.PLAN_FORMATS:
                raise LayoutError(
                    f"no padding view for format {layer.fmt!r}",
                    fix=f"padding views exist for {', '.join(sources.PLAN_FORMATS)}",
                )
        except (FimoeError, sources.LabUnavailable, ValueError, OSError) as exc:
            self.message.value = f"<span style='color:#d33'>{html.escape(str(exc))} (sizes not changed)</span>"
            return
        self._busy = True
        try:
            self.fmt.value, self.intermediate.value = layer.fmt, layer.intermediate
            self.hidden.value, self.experts.value = layer.hidden, layer.experts
        finally:
            self._busy = False
        self.refresh()

    @classmethod
    def from_layer(cls, layer: sources.ExpertTensors, **kwargs) -> PaddingExplorer:
        """The explorer on a layer's sizes (read it at TP 1: the TP menu then splits it)."""
        if layer.fmt not in sources.PLAN_FORMATS:
            raise LayoutError(
                f"no padding view for format {layer.fmt!r}",
                fix=f"padding views exist for {', '.join(sources.PLAN_FORMATS)}",
            )
        return cls(layer.intermediate, layer.hidden, layer.experts, layer.fmt, **kwargs)

    def _args(self) -> tuple:
        def align(w):
            return None if w.value == "default" else int(w.value)

        return (
            self.fmt.value,
            self.backend.value,
            self.intermediate.value,
            self.hidden.value,
            self.tp.value,
            self.experts.value,
            align(self.inter_align),
            align(self.hidden_align),
        )

    def _draw(self):
        for box in (self.experts, self.intermediate, self.hidden):
            if box.value < 1:
                raise LayoutError(f"{box.description} {box.value} is not a positive size", fix="type a size >= 1")
        report = data.padding_report(*self._args())
        self.state = dict(report=report)
        return figures.padding_figure(report), report.summary()

    def code(self) -> str:
        return (
            "from fimoe_lab.viz import data, figures\n"
            f"report = data.padding_report{self._args()!r}\n"
            "fig = figures.padding_figure(report)\n"
        )


class TunerExplorer(_Explorer):
    """The tuner for a preset, format and TP: tactic heatmap, frontier (predicted time against
    extra bytes) and recommendation, over a typed token profile (``tokens``), per-token
    activation scales, a GPU and an engine profile (:func:`fimoe_lab.tune.sweep.sweep`;
    ``mode``: the tactic oracle's, ``snapshot`` by default: recorded answers, offline)."""

    def __init__(
        self,
        preset: str = "qwen3-30b-a3b",
        fmt: str = "nvfp4",
        tp: int = 1,
        mode: str = "snapshot",
        tokens: str = "",
        gpu: str = "b200",
        engine: str = "default",
    ):
        self.mode = mode
        presets = sources.preset_names()
        self.preset = _dropdown(
            "preset", presets or [preset], preset if preset in presets or not presets else presets[0]
        )
        self.fmt = _dropdown("format", sources.TUNER_FORMATS, fmt)
        self.tp = _dropdown("TP", TP_SIZES[:4], tp)
        self.tokens = W.Text(
            tokens,
            placeholder="tokens, e.g. 1,64,4096 (default: the tuner's)",
            description="tokens",
            style=STYLE,
            layout=W.Layout(width="360px"),
            continuous_update=False,
        )
        self.per_token = W.Checkbox(False, description="per-token scales", style=STYLE)
        gpus, engines = sources.tuner_choices()
        self.gpu = _dropdown("GPU", gpus or [gpu], gpu if gpu in gpus or not gpus else gpus[0])
        self.engine = _dropdown("engine", ["default"] + engines, engine)
        self.view_kind = _dropdown("show", ("frontier", "tactics heatmap"))
        super().__init__(
            [self.preset, self.fmt, self.tp, self.view_kind, self.tokens, self.per_token, self.gpu, self.engine]
        )

    def _kwargs(self) -> dict[str, Any]:
        text = self.tokens.value.strip()
        kw: dict[str, Any] = dict(per_token=self.per_token.value, gpu=self.gpu.value)
        if text:
            parts = [p for p in re.split(r"[,\s]+", text) if p]
            if not all(p.isdigit() and int(p) > 0 for p in parts):
                raise LayoutError(f"tokens {text!r} are not positive integers", fix="type e.g. 1,64,4096")
            kw["tokens"] = tuple(int(p) for p in parts)
        if self.engine.value != "default":
            kw["engine"] = self.engine.value
        return kw

    def _draw(self):
        kw = self._kwargs()
        sweep = sources.tactic_sweep(self.preset.value, self.fmt.value, self.tp.value, self.mode, **kw)
        self.state = dict(sweep=sweep, kwargs=kw)
        if sweep.empty:  # nothing to sweep (a TP shard convert refuses): the tuner's own explanation, as the CLI's
            why = sweep.attrs.get("no_recommendation") or "no alignment to sweep"
            alternatives = sweep.attrs.get("alternatives") or ["another TP size or format"]
            raise LayoutError(f"nothing to tune: {why}", fix="try " + "; or ".join(alternatives))
        rec = sweep.attrs.get("recommendation")
        note = (
            f"recommended: intermediate {rec['intermediate']} (align {rec['inter_align']}), hidden "
            f"{rec['hidden']} (align {rec['hidden_align']}), +{rec['extra_bytes_pct']:.2f}% weights, "
            f"predicted {rec['predicted_us']:.1f} us (estimate)"
            if rec
            else f"no recommendation: {sweep.attrs.get('no_recommendation')}"
        )
        fig = figures.frontier_figure(sweep) if self.view_kind.value == "frontier" else figures.tuner_figure(sweep)
        return fig, note

    def code(self) -> str:
        call = "frontier_figure" if self.view_kind.value == "frontier" else "tuner_figure"
        kw = "".join(f", {k}={v!r}" for k, v in self.state.get("kwargs", {}).items())
        return (
            "from fimoe_lab.viz import figures, sources\n"
            f"sweep = sources.tactic_sweep({self.preset.value!r}, {self.fmt.value!r}, {self.tp.value}, "
            f"{self.mode!r}{kw})\n"
            f"fig = figures.{call}(sweep)\n"
        )


class DiagnoseExplorer(_Explorer):
    """``fimoe-lab diagnose`` as an explorer: a checkpoint (path box, MoE layer, TP size and
    rank) and a file of dumped kernel tensors; the message ranks the plan variants per
    tensor (:func:`fimoe_lab.diagnose.diagnose`), the figure takes the chosen tensor's
    dump back through the planned map next to the checkpoint. Only the experts the diagnosis
    compares are read (:func:`sources.diagnosis_inputs`), once per checkpoint and dump."""

    def __init__(self, checkpoint: str = "", dump: str = "", layer: str = "first", tp_size: int = 1, tp_rank: int = 0):
        self.checkpoint = W.Text(
            checkpoint,
            placeholder="checkpoint directory or sample name",
            description="checkpoint",
            style=STYLE,
            layout=W.Layout(width="360px"),
            continuous_update=False,
        )
        self.dump = W.Text(
            dump,
            placeholder="dumped kernel tensors (.safetensors / .npy)",
            description="kernel dump",
            style=STYLE,
            layout=W.Layout(width="360px"),
            continuous_update=False,
        )
        self.layer_index = W.Text(
            layer, description="MoE layer", style=STYLE, layout=W.Layout(width="160px"), continuous_update=False
        )
        self.tp_size = _dropdown("TP size", TP_SIZES, tp_size, "160px")
        self.tp_rank = _int_box("TP rank", tp_rank, "160px")
        self.tensor = _dropdown("tensor", data.TENSOR_NAMES)
        self._inputs: tuple = (None, None, None)  # (checkpoint and dump, diagnosis_inputs, diagnosis) last read
        super().__init__([self.checkpoint, self.dump, self.layer_index, self.tp_size, self.tp_rank, self.tensor])

    def _draw(self):
        from fimoe_lab import diagnose

        if not self.checkpoint.value.strip() or not self.dump.value.strip():
            raise LayoutError("type a checkpoint and a file of dumped kernel tensors", fix="fill both boxes")
        layer = self.layer_index.value.strip()
        if layer != "first" and not layer.isdigit():
            raise LayoutError(f"MoE layer {layer!r} is not a number", fix="type a layer index or 'first'")
        key = f"path:{layer}:{self.tp_size.value}:{self.tp_rank.value}:{_checkpoint_key(self.checkpoint.value.strip())}"
        dump = Path(self.dump.value.strip()).expanduser()
        stamp = (key, str(dump), dump.stat().st_mtime_ns if dump.is_file() else None)
        if self._inputs[0] != stamp:  # read once per checkpoint and dump: a tensor change redraws from them
            inputs = sources.diagnosis_inputs(_layer(key), dump, diagnose.DEFAULT_EXPERTS)
            result = diagnose.diagnose(*inputs, source=self.checkpoint.value.strip())
            self._inputs = (stamp, inputs, result)
        _, (moe, dumped), result = self._inputs
        roles = list(result.tensors)
        if self.tensor.value not in roles:
            self._busy = True
            try:
                self.tensor.options, self.tensor.value = roles, roles[0]
            finally:
                self._busy = False
        chosen = result.tensors[self.tensor.value]
        self.state = dict(diagnosis=result, tensor=self.tensor.value)
        fig = diagnose.figure(chosen, moe, dumped[chosen.dumped_name])
        return fig, " | ".join(t.summary() for t in result.tensors.values())

    def code(self) -> str:
        layer = self.layer_index.value.strip()
        return (
            "from fimoe_lab import diagnose\nfrom fimoe_lab.viz import sources\n"
            f"layer = sources.load_layer({self.checkpoint.value.strip()!r}, {None if layer == 'first' else int(layer)}, "
            f"{self.tp_size.value}, {self.tp_rank.value})\n"
            f"moe, dumped = sources.diagnosis_inputs(layer, {self.dump.value.strip()!r}, diagnose.DEFAULT_EXPERTS)\n"
            "result = diagnose.diagnose(moe, dumped)\nprint(result.summary())\n"
            f"fig = diagnose.figure(result.tensors[{self.tensor.value!r}], moe, "
            f"dumped[result.tensors[{self.tensor.value!r}].dumped_name])\n"
        )


class CompareExplorer(_LayerExplorer):
    """A/B: the chosen tensor of one layer under two plans (backend, engine profile, TP size,
    intermediate alignment each): both row pictures side by side with the chosen expert's values
    (B at TP > 1: TP rank 0's shard of them, :meth:`sources.ExpertTensors.tp_shard`), each headed by
    what its controls asked for, and the two step chains as a table under them; the message names
    the steps that differ (B's controls are the ones marked B). Each side's picture is drawn once per
    map (:meth:`_layered`): an expert change renders its colour scale and values only, a change of one
    side's controls leaves the other side's SVG as it was."""

    tensor_filter = staticmethod(RowExplorer.tensor_filter)

    CACHE = 0  # the side pictures are shared between experts (their values move): nothing to keep per setting
    LAYERED = 6

    def __init__(self, layer: Optional[sources.ExpertTensors] = None, **kwargs):
        engines = ["default"] + sources.tuner_choices()[1]
        self.engine_a = _dropdown("A engine", engines)
        self.align_a = _dropdown("A I align", ("default", 16, 32, 64, 128, 256))
        self.backend_b = _dropdown("B backend", BACKENDS, "cutlass" if "cutlass" in BACKENDS else None)
        self.engine_b = _dropdown("B engine", engines)
        self.align_b = _dropdown("B I align", ("default", 16, 32, 64, 128, 256))
        self.tp_b = _dropdown("B TP", TP_SIZES)
        self.activation_b, self.per_token_b = _activation_controls("B ")
        extra = [self.engine_a, self.align_a, self.backend_b, self.engine_b, self.align_b, self.tp_b]
        extra += [self.activation_b, self.per_token_b]
        super().__init__(layer, extra, **kwargs)

    def _plan_args(self, backend: str, engine: str, align, tp: int, acts: tuple = (None, False)) -> tuple:
        """``(LayerShape, LayoutChoice)`` of one side (``recipes.plan_for``'s two values): the layer's format and
        sizes at TP ``tp``, the side's controls, ``acts`` = ``(activation_dtype, per_token)``
        (:func:`_activation_args`)."""
        layer = self.layer
        if layer.intermediate % tp:
            raise LayoutError(
                f"intermediate {layer.intermediate} does not split into {tp} shards",
                fix="pick a TP size that divides it",
            )
        shape = LayerShape(layer.fmt, layer.intermediate // tp, layer.hidden, layer.gated, layer.layout.is_gated)
        choice = LayoutChoice(
            backend,
            intermediate_alignment=None if align == "default" else int(align),
            engine=None if engine == "default" else engine,
            per_token_activation=acts[1],
            activation_dtype=acts[0],
        )
        return shape, choice

    def _draw(self):
        self.current_map()
        name, expert = self.tensor.value, self.state["expert"]
        _activation_args(self.layer.fmt, self.backend_b.value, self.activation_b, self.per_token_b)  # B's menus
        a, b, args_a, args_b, diff, projections, sides = _run(self._view(None, self.backend.value, name, expert))
        tp_b = self.tp_b.value
        (fig_a, svg_a, *_), (fig_b, svg_b, *_) = sides
        self.state.update(
            a=a, b=b, args=(args_a, args_b), diff=diff, projections=projections, values_b=sides[1][-1], tp_b=tp_b
        )
        changed = [f"{op}: {(sa or sb).split('(')[0]}" for op, sa, sb in diff if op != "same"]  # kinds; the table
        bits = [(side, p.word_bits.get(name)) for side, p in (("A", a), ("B", b))]
        extra = [f"{side} then {w.name} on every 32-bit word" for side, w in bits if w is not None]
        note = f"A {a.description} vs B {b.description} (TP {self.tp_b.value}): " + (
            "; ".join(changed + extra) if changed or extra else "same steps"
        )
        note += " (the steps' parameters: the table below)" if changed else ""
        pair = Figure()
        pair.parts = (fig_a, fig_b)  # type: ignore[attr-defined]
        heads = []
        for label, plan, (_, _, asked, tp, own) in zip("AB", (a, b), sides):
            shown = f"expert {expert}'s values" + (f" (TP rank 0 of {tp}: its shard)" if tp > 1 else "")
            shown = shown if own else "no values (the map does not take this layer's tensor)"
            heads.append(f"<b>{label}</b>: {html.escape(plan.description)}; {html.escape(asked)}; {shown}")
        panes = "".join(
            f"<div style='flex:0 0 auto'><div class='fimoe-side'>{head}</div>{svg}</div>"
            for head, svg in zip(heads, (svg_a, svg_b))
        )
        view = (
            "<div class='fimoe-pair' style='display:flex;gap:12px;align-items:flex-start;overflow-x:auto'>"
            f"{panes}</div>{self._diff_table(diff)}"
        )
        return pair, note, view

    @staticmethod
    def _diff_table(diff: list) -> str:
        """The two step chains as a table, one row per step: kept steps plain, changed ones amber, a step only
        one plan has green on its side (empty cell on the other)."""
        colour = {"same": "", "changed": "background:rgba(255,170,0,0.25)", "only A": "", "only B": ""}
        rows = []
        for op, sa, sb in diff:
            cell_a = "background:rgba(60,180,75,0.25)" if op == "only A" else colour[op]
            cell_b = "background:rgba(60,180,75,0.25)" if op == "only B" else colour[op]
            rows.append(
                f"<tr><td>{op}</td><td style='{cell_a}'>{html.escape(sa or '')}</td>"
                f"<td style='{cell_b}'>{html.escape(sb or '')}</td></tr>"
            )
        return (
            "<table class='fimoe-diff' style='font:12px monospace;border-collapse:collapse;margin-top:6px'>"
            "<tr><th align='left'>step</th><th align='left'>A</th><th align='left'>B</th></tr>"
            + "".join(rows)
            + "</table>"
        )

    def _prepare_more(self) -> Iterator[Iterator[None]]:
        """B's TP sizes, then B's backends, next to the chosen ones."""
        s = self.state
        for tp in _around(self.tp_b):
            yield self._prepare_view(s["backend"], s["tensor"], s["expert"], tp_b=tp)
        for backend in _around(self.backend_b):
            yield self._prepare_view(s["backend"], s["tensor"], s["expert"], backend_b=backend)

    def _view(self, m, backend: str, name: str, expert: int, prepare: bool = False, **more) -> Iterator[None]:
        """Steps returning ``(plan A, plan B, their plan_for arguments, chain_diff, projections, sides)`` for A on
        ``backend`` and B's controls (``more``: ``backend_b``, ``tp_b`` in place of the controls'), each side
        ``(figure, SVG, what was asked, TP, whether the values are drawn)``; A's map ``m`` is unused (A is planned
        with its engine and alignment)."""
        from fimoe_lab.recipes import plan_for

        layer, fmt = self.layer, self.layer.fmt
        acts_a = _activation_offer(fmt, backend, self.activation.value, self.per_token.value)[2:]
        backend_b, tp_b = more.get("backend_b", self.backend_b.value), more.get("tp_b", self.tp_b.value)
        acts_b = _activation_offer(fmt, backend_b, self.activation_b.value, self.per_token_b.value)[2:]
        args_a = self._plan_args(backend, self.engine_a.value, self.align_a.value, 1, acts_a)
        args_b = self._plan_args(backend_b, self.engine_b.value, self.align_b.value, tp_b, acts_b)
        a, b = plan_for(*args_a), plan_for(*args_b)
        ma, mb = a.maps().get(name), b.maps().get(name)
        if ma is None or mb is None:
            raise LayoutError(f"plan {'A' if ma is None else 'B'} does not move {name}", fix="pick another tensor")
        diff = data.chain_diff(ma, mb)
        projections = 2 if name.startswith("w13") and layer.gated else 1
        values, dead = layer.magnitude(name, expert), layer.dead(name, expert)
        shard = (values, dead) if tp_b == 1 else None
        if prepare:
            if shard is None:  # the shard's copy of the values (counted even where kept)
                try:
                    self._take(0, layer.sizes(name)[1] // tp_b)
                except _NoRoom:  # B's picture drawn on a stand-in of the shard's shape (no memory): the change
                    # itself then only cuts the values and draws them (the picture's static part is what costs)
                    shape = layer.tp_shard_shape(name, values.shape, tp_b)
                    shard = (np.broadcast_to(np.float32(0), shape), np.broadcast_to(np.False_, shape))
            yield
        shard = shard or layer.tp_shard(name, expert, tp_b, 0)
        size = data.itemsize_of(fmt, name)
        sides = []
        for m, plan, engine, align, tp, (v, d) in (
            (ma, a, self.engine_a.value, self.align_a.value, 1, (values, dead)),
            (mb, b, self.engine_b.value, self.align_b.value, tp_b, shard),
        ):
            if not prepare:
                self._check()
            own = m.in_shape == tuple(v.shape[:-1]) + (v.shape[-1] * size,)  # the values the map moves
            drawn = yield from self._side(m, projections, v if own else None, d if own else None, size, prepare)
            # what the side's controls asked for and what the plan made of it (an alignment the size already
            # meets pads nothing: the same picture, said here)
            asked = f"engine {engine}, TP {tp}, I align {align} -> intermediate {plan.padded_intermediate}"
            sides.append((drawn or (None, "")) + (asked, tp, own))
        return a, b, args_a, args_b, diff, projections, sides

    def _side(self, m, projections: int, values, dead, size: int, prepare: bool = False) -> Iterator[None]:
        """Steps returning ``(figure, SVG)`` of one side's row picture (with ``values``, one expert's, when given): drawn
        once per map, an expert change moves its values (:func:`figures.show_values`) and renders its colour
        scale and values layers; nothing is rendered when neither changed."""

        def move(f) -> None:
            if values is not None and f._fimoe_rows["values"] is not values:
                figures.show_values(f, values, dead)
                figures.show_rows(f, (0, 64), "kernel", "origin")

        def layers(f) -> list:  # the colouring and the rows stay (rows 0..63 by origin): drawn with the static part
            return [(what, artists) for what, artists in figures.row_layers(f) if what[0] in ("scale", "values")]

        return self._layered(  # B with A's map and values (e.g. the same backend, TP 1) shares A's picture
            (id(self.layer), id(m), projections, values is not None),
            lambda: figures.row_permutation_figure(m, projections, (0, 64), "origin", values, size, dead=dead),
            move,
            layers,
            top_moves=False,
            prepare=prepare,
        )

    def code(self) -> str:
        s = self.state
        t, p, e = s["tensor"], s["projections"], s["expert"]
        tp_b = s["tp_b"]
        b_values = "values_b, size, dead=dead_b" if s["values_b"] else "size=size"
        shard = f"layer.tp_shard({t!r}, {e}, {tp_b}, 0)" if tp_b > 1 else "values, dead"
        return self._layer_code() + (
            "from fimoe_lab.choice import LayerShape, LayoutChoice\n"
            "from fimoe_lab.recipes import plan_for\n"
            f"values, dead = layer.magnitude({t!r}, {e}), layer.dead({t!r}, {e})\n"
            f"values_b, dead_b = {shard}\n"
            f"a = plan_for{s['args'][0]!r}.maps()[{t!r}]\n"
            f"b = plan_for{s['args'][1]!r}.maps()[{t!r}]\n"
            "for row in data.chain_diff(a, b):\n    print(*row, sep=' | ')\n"
            f"fig = figures.side_by_side(figures.row_permutation_figure(a, {p}, (0, 64), 'origin', values, size, "
            f"dead=dead), figures.row_permutation_figure(b, {p}, (0, 64), 'origin', {b_values}))\n"
        )
