"""Idle preparation: once an explorer's newest figure is shown, its drawing thread prepares the likely next views
(the other backend and the neighbouring tensors, colourings and B's TP sizes drawn, the neighbouring experts read
and decoded) in small units; any control change stops it before the next unit, what it prepared draws exactly what
a fresh explorer draws, and it never takes more of the shared caches than the room the shown view leaves."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("matplotlib")

from fimoe_lab import resources  # noqa: E402
from fimoe_lab.errors import FimoeError  # noqa: E402
from fimoe_lab.viz import data, figures, sources, widgets  # noqa: E402
from tests.helpers import spy_calls  # noqa: E402
from tests.test_viz_explorers import is_error  # noqa: E402

pytestmark = pytest.mark.skipif(not resources.sample_names(), reason="sample checkpoints are not in this checkout")

SAMPLE = "sample:deepseek-r1-nvfp4"  # a lazy layer: 8 experts, each read from the checkpoint on demand


@pytest.fixture
def caches(monkeypatch):
    """Fresh shared caches (as a new kernel has), bounded as the lab bounds them."""
    experts, values = data.BoundedCache(sources.EXPERT_BYTES_KEPT), data.BoundedCache(sources.VALUE_BYTES_KEPT)
    monkeypatch.setattr(sources, "_EXPERTS", experts)
    monkeypatch.setattr(sources, "_VALUES", values)
    return experts, values


def test_idle_preparation_reads_the_neighbouring_experts_and_draws_the_other_values(caches, monkeypatch):
    experts, values = caches
    w = widgets.RowExplorer(source=SAMPLE, background=True, prepare=True)
    layer = w.layer
    w.expert.value = 3
    assert w.wait(120, prepared=True) and not is_error(w)
    for e in (2, 4):  # read from disk and decoded before anyone asked
        assert (layer.key, e) in experts.entries and (layer.key, "magnitude", "w13", e) in values.entries
    assert (layer.key, 5) not in experts.entries  # only the neighbours
    kept = {(k[2], k[3]) for k in w._layers}
    assert {("trtllm", "w13"), ("cutlass", "w13"), ("trtllm", "w2")} <= kept
    shown = next(reversed(w._layers))
    assert (shown[2], shown[3]) == ("trtllm", "w13")  # the shown figure stays the most recently used
    reads = spy_calls(monkeypatch, [(figures, "svg_without"), (sources.ExpertTensors, "_timed_read")])
    w.backend.value = "cutlass"  # prepared: no figure built, nothing read
    assert w.wait(120) and w.state["backend"] == "cutlass" and not is_error(w)
    w.backend.value, w.expert.value = "trtllm", 4
    assert w.wait(120) and w.state["expert"] == 4
    assert reads == []
    assert w.wait(120, prepared=True)  # (its preparation of experts 3 and 5 ends here)


def test_switched_off_nothing_is_prepared(caches, monkeypatch):
    experts, _ = caches
    monkeypatch.setenv("FIMOE_LAB_PREPARE", "off")
    w = widgets.RowExplorer(source=SAMPLE, background=True)
    assert not w.prepare
    w.expert.value = 3
    assert w.wait(120, prepared=True)
    assert list(experts.entries) == [(w.layer.key, 0), (w.layer.key, 3)] and len(w._layers) == 1
    monkeypatch.setenv("FIMOE_LAB_PREPARE", "sometimes")
    with pytest.raises(FimoeError, match="FIMOE_LAB_PREPARE"):
        widgets.RowExplorer(source=SAMPLE)


def slow_pass(units_of_first: int, seconds: float, busy: bool = False):
    """A ``_prepare`` whose first pass is ``units_of_first`` units of ``seconds`` each (later passes: none);
    returns it, the event set when its first unit runs, the units run and whether the pass was closed."""
    started, ran, closed, passes = threading.Event(), [], [], []

    def prepare():
        passes.append(1)
        if len(passes) > 1:
            return

        def work():
            try:
                for k in range(units_of_first):
                    started.set()
                    end = time.monotonic() + seconds
                    while busy and time.monotonic() < end:  # Python work: holds the interpreter, as drawing does
                        pass
                    time.sleep(0 if busy else seconds)
                    ran.append(k)
                    yield
            finally:
                closed.append(True)

        yield work()

    return prepare, started, ran, closed


def test_a_change_during_idle_work_is_drawn_after_at_most_one_unit(caches):
    """10 s of idle work in 50 ms units: a change of the same explorer, or of another one, is shown long before it
    would end, and the work is dropped (never resumed)."""
    w = widgets.RowExplorer(source="seeded:nvfp4", background=True, prepare=True)
    other = widgets.TileExplorer(source="seeded:nvfp4", background=True, prepare=False)
    w._prepare, started, ran, closed = slow_pass(200, 0.05)
    w.start.value = 8
    assert w.wait(120) and started.wait(120)
    asked = time.monotonic()
    other.atom.value = 1  # another explorer: waits for the unit under way at most
    assert other.wait(120) and other.state["atom"] == 1
    took = time.monotonic() - asked
    assert w.wait(120, prepared=True) and closed == [True] and len(ran) < 200
    assert took < 5.0, took
    w._prepare, started, ran, closed = slow_pass(200, 0.05)
    w.start.value = 16
    assert w.wait(120) and started.wait(120)
    asked = time.monotonic()
    w.start.value = 24  # its own explorer
    assert w.wait(120) and w.state["window"] == (24, 88) and not is_error(w)
    took = time.monotonic() - asked
    assert w.wait(120, prepared=True) and closed == [True] and len(ran) < 200
    assert took < 5.0, took


def test_a_change_right_after_a_figure_never_waits_for_preparation(caches):
    """Preparation starts PREPARE_AFTER seconds after a figure is shown: a change that comes sooner (as a script's,
    or a benchmark's) is drawn before any unit of preparation ran; once the pause has passed, the units run."""
    w = widgets.RowExplorer(source="seeded:nvfp4", background=True, prepare=True)
    w._prepare, started, ran, closed = slow_pass(3, 0.3, busy=True)
    w.start.value = 8
    assert w.wait(120)
    shown = time.monotonic()
    w.start.value = 16
    assert w.wait(120) and w.state["window"] == (16, 80)
    if time.monotonic() - shown < widgets.PREPARE_AFTER:  # (on a loaded machine the pause may have passed)
        assert not started.is_set() and ran == []
    assert w.wait(120, prepared=True) and ran == [0, 1, 2] and closed == [True]


def test_a_pointer_during_idle_work_is_answered_after_at_most_one_unit(caches):
    """10 s of idle work in 50 ms units: a hover or click on the shown figure answers for its cell long before the
    work would end (the drawing thread lets it in before its next unit), and the work goes on."""
    w = widgets.RowExplorer(source="seeded:nvfp4", background=True, prepare=True)
    w.start.value = 8
    assert w.wait(120, prepared=True)
    fig = w._part(0)
    cell = next((x, y) for x in range(0, 400, 7) for y in range(0, 400, 7) if figures.cell_at(fig, x, y))
    for ask in (w._hover, w.click):
        w._prepare, started, ran, closed = slow_pass(200, 0.05, busy=True)
        w.start.value += 8
        assert w.wait(120) and started.wait(120)
        fig = w._part(0)
        asked = time.monotonic()
        answer = ask(*cell)
        took = time.monotonic() - asked
        assert answer and took < 1.0, (answer, took)
        assert not closed and len(ran) < 200  # the pass is still under way
        w._prepare = lambda: iter(())
        w.start.value += 8  # a change drops it
        assert w.wait(120, prepared=True) and closed == [True] and len(ran) < 200


CHANGES = [  # (explorer, layer, control, value a change picks: one preparation draws)
    ("RowExplorer", SAMPLE, "backend", "cutlass"),
    ("RowExplorer", SAMPLE, "tensor", "w2"),
    ("TileExplorer", SAMPLE, "colour_by", None),
    ("TileExplorer", "sample:deepseek-v3-fp8", "tensor", "w2"),  # block-major-K tiles
    ("ProvenanceExplorer", SAMPLE, "backend", "cutlass"),
    ("CompareExplorer", SAMPLE, "tp_b", 2),
    ("CompareExplorer", SAMPLE, "backend_b", "trtllm"),
]


@pytest.mark.parametrize(("name", "source", "control", "value"), CHANGES)
def test_a_prepared_view_is_the_figure_a_fresh_explorer_draws(caches, monkeypatch, name, source, control, value):
    """After preparation the change renders no static part (it was prepared) and shows the very SVG, state and
    figure data an explorer that never prepared draws for the same controls."""
    w = getattr(widgets, name)(source=source, background=True, prepare=True, tensor="w13")
    w.expert.value = 1
    assert w.wait(120, prepared=True) and not is_error(w)
    picked = value if value is not None else widgets._around(getattr(w, control))[0]
    built = spy_calls(monkeypatch, [(figures, "svg_without")])
    getattr(w, control).value = picked
    assert w.wait(120) and not is_error(w)
    assert built == []
    monkeypatch.undo()
    fresh = getattr(widgets, name)(source=source, background=False, prepare=False, tensor="w13")
    fresh.expert.value = 1
    getattr(fresh, control).value = picked
    assert w.wait(120, prepared=True)
    assert not is_error(fresh) and w.svg == fresh.svg and w.message.value == fresh.message.value
    assert w.code() == fresh.code()
    if name != "CompareExplorer":
        assert np.array_equal(w.layer.magnitude(w.state["tensor"], 1), fresh.layer.magnitude(w.state["tensor"], 1))


def test_without_room_for_bs_tp_shard_its_picture_is_prepared_on_a_stand_in(caches, monkeypatch):
    """The decoded-value cache is full: preparation still draws B's picture at the next TP size (on a stand-in of
    the shard's shape, no memory), so the change renders no static part, only cuts and draws the values, and
    shows exactly what an explorer that never prepared draws; the cache keeps what the user saw."""
    _, values = caches
    w = widgets.CompareExplorer(source=SAMPLE, background=True, prepare=False, tensor="w13")
    w.expert.value = 1
    assert w.wait(120, prepared=True) and not is_error(w)
    seen = set(values.entries)
    monkeypatch.setattr(values, "limit", values.bytes)
    w.prepare = True
    w.refresh()  # a redraw of the same view, then a preparation pass
    assert w.wait(120, prepared=True) and set(values.entries) == seen  # nothing prepared into the cache
    built = spy_calls(monkeypatch, [(figures, "svg_without")])
    w.tp_b.value = 2
    assert w.wait(120) and not is_error(w)
    assert built == []
    monkeypatch.undo()
    fresh = widgets.CompareExplorer(source=SAMPLE, background=False, prepare=False, tensor="w13")
    fresh.expert.value, fresh.tp_b.value = 1, 2
    assert w.wait(120, prepared=True)
    assert not is_error(fresh) and w.svg == fresh.svg and w.message.value == fresh.message.value


@pytest.mark.parametrize(
    ("name", "control", "values"), [("TileExplorer", "expert", (1, 5)), ("RowExplorer", "tensor", ("w13", "w2"))]
)
def test_preparation_never_drops_the_figure_the_user_just_left(caches, monkeypatch, name, control, values):
    """Going back to the view shown before stays instant: idle preparation fills the figure cache around the
    shown view, but never past the figures of the previous redraw (each going back builds no figure)."""
    w = getattr(widgets, name)(
        source=SAMPLE, background=True, prepare=True, tensor="w13_scale" if name == "TileExplorer" else "w13"
    )
    if name == "TileExplorer":
        w.colour_by.value = "scale value"  # one figure per expert
    for v in values:
        getattr(w, control).value = v
        assert w.wait(120, prepared=True) and not is_error(w)
    built = spy_calls(monkeypatch, [(figures, "svg_without")])
    for v in values * 3:  # back and forth, idle preparation between (off while the change draws: it builds too)
        w.prepare = False
        built.clear()
        getattr(w, control).value = v
        assert w.wait(120) and not is_error(w)
        assert built == [], v
        w.prepare = True
        w.refresh()  # the same view again, then a preparation pass around it
        assert w.wait(120, prepared=True)
    assert len(w._layers) <= w.LAYERED


@pytest.mark.parametrize("room_for_neighbours", [True, False])
def test_preparation_only_fills_the_free_room_of_the_caches(caches, monkeypatch, room_for_neighbours):
    """The decoded-value cache has free room for w2 of the shown expert and (or not) the neighbouring experts' w13:
    preparation takes what fits, in order, skips the rest, and never makes the cache drop what the user saw."""
    _, values = caches
    w = widgets.RowExplorer(source=SAMPLE, background=True, prepare=False)  # trtllm: w13, w2 and their scales
    layer = w.layer
    w.expert.value = 3
    assert w.wait(120, prepared=True)
    seen = set(values.entries)  # experts 0 and 3 (w13 and its scales)
    w13, w2 = layer.sizes("w13")[1], layer.sizes("w2")[1]
    monkeypatch.setattr(values, "limit", values.bytes + w2 + (2 * w13 if room_for_neighbours else w13 // 2))
    w.prepare = True
    w.start.value = 8  # a redraw of the same values, then a preparation pass
    assert w.wait(120, prepared=True) and w.state["expert"] == 3
    kept = set(values.entries)
    assert seen <= kept and (layer.key, "magnitude", "w2", 3) in kept  # nothing dropped; prepared
    neighbours = {(layer.key, "magnitude", "w13", e) for e in (2, 4)}
    assert neighbours & kept == (neighbours if room_for_neighbours else set())
    assert values.bytes <= values.limit


def test_memo_lets_go_of_an_array_once_it_is_freed():
    """A memoised result keyed by an array holds it weakly: when the caches drop an expert's values, nothing else
    keeps them (the entry goes with them); while the array lives, a second call is the kept result."""
    values = np.arange(64, dtype=np.float32).reshape(8, 8) - 7.5
    first = data.memo(data.all_finite, values)
    key = ("all_finite", ("id", id(values)))
    assert key in data._MEMO.entries and data.memo(data.all_finite, values) is first
    del values
    assert key not in data._MEMO.entries


def test_memory_is_given_back_at_the_first_quiet_pause_only(caches, monkeypatch):
    """Figures replaced on screen are collected and trimmed once no change came for GIVE_BACK_QUIET seconds, not
    while changes keep coming (the collection would hold the next one up), and once per pause."""
    monkeypatch.setattr(widgets, "GIVE_BACK_QUIET", 0.6)
    given = spy_calls(monkeypatch, [(widgets, "_give_back_memory")])
    w = widgets.RowExplorer(source="seeded:nvfp4", background=True, prepare=True)
    for tensor in ("w2", "w13", "w2", "w13"):  # each a figure replaced on screen
        w.tensor.value = tensor
        assert w.wait(120) and not is_error(w)
        time.sleep(0.2)
        assert given == []
    assert w.wait(120, prepared=True)
    time.sleep(1.5)
    assert given == ["_give_back_memory"] and widgets._DROPPED["figures"] == 0
