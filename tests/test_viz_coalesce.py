"""Redraws coalesce: control changes that arrive while an explorer draws cost one redraw, of the
newest control state; nothing of a superseded setting is shown (figure, error or trace)."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("matplotlib")

from fimoe_lab.viz import widgets  # noqa: E402
from tests.test_viz import drawn_pairs  # noqa: E402
from tests.test_viz_explorers import is_error, svg_texts  # noqa: E402


def held_first_draw(w):
    """Instrument ``w``'s real ``_draw``: it records the controls each draw reads, and the first one waits
    for ``release`` (after setting ``entered``), so changes can be made while it runs."""
    entered, release, seen = threading.Event(), threading.Event(), []
    draw = w._draw

    def gated():
        seen.append((w.start.value, w.expert.value, w.side.value, w.shape.value))
        if len(seen) == 1:
            entered.set()
            assert release.wait(120)
        return draw()

    w._draw = gated
    return entered, release, seen


def test_changes_during_a_redraw_are_drawn_once_as_the_newest_setting():
    w = widgets.RowExplorer(source="seeded:nvfp4", background=True)  # a seeded layer: the shape box counts
    assert w.wait(120) and not is_error(w) and w.state["window"] == (0, 64)
    shown: list = []
    w.view.observe(lambda change: shown.append(change["new"]), names="value")
    entered, release, seen = held_first_draw(w)
    w.start.value = 8  # returns at once: the redraw runs on the explorer's drawing thread
    assert entered.wait(120)
    starts = list(range(16, 16 + 8 * 20, 8))
    for start in starts:  # each change returns while the first redraw is held: no queue builds up
        w.start.value = start
    w.expert.value = 1
    w.shape.value = "not a shape"  # an error of a superseded setting is never shown either
    w.side.value = "checkpoint"
    w.shape.value = ""
    w.POINT_WAIT = 0.05  # a click or hover waits this long for the redraw (held here), then finds no cell
    assert w._hover(100.0, 100.0) == "" and w.click(100.0, 100.0) is None
    assert len(seen) == 1 and shown == []
    release.set()
    assert w.wait(120)
    last = starts[-1]
    assert seen == [(8, 0, "kernel", ""), (last, 1, "checkpoint", "")]  # the held one, then only the newest
    assert len(shown) == 1 and shown[0] == w.svg and not is_error(w)  # the superseded redraw showed nothing
    assert w.state["window"] == (last, last + 64) and w.state["side"] == "checkpoint" and w.state["expert"] == 1
    # the figure is the one the final controls draw from scratch
    fresh = widgets.RowExplorer(source="seeded:nvfp4")
    assert not fresh.background  # outside a kernel a change redraws before it returns
    fresh.expert.value, fresh.side.value, fresh.start.value = 1, "checkpoint", last
    assert fresh.state["window"] == w.state["window"]
    assert svg_texts(w.svg) == svg_texts(fresh.svg) and drawn_pairs(w.figure) == drawn_pairs(fresh.figure)
    assert len(drawn_pairs(w.figure)) > 0


def test_a_change_after_the_newest_is_shown_redraws_again():
    w = widgets.RowExplorer(background=True)
    for start in (24, 48, 72):
        w.start.value = start
        assert w.wait(120) and w.state["window"] == (start, start + 64) and not is_error(w)
    w.shape.value = "bad"
    assert w.wait(120) and is_error(w) and w.figure is None  # the newest setting's error is shown
    w.shape.value = ""
    assert w.wait(120) and not is_error(w) and w.state["window"] == (72, 136)


def test_explorers_drawing_at_once_each_show_their_newest_setting():
    """Several explorers redrawing on their own threads at the same time (one notebook): each ends on the figure of
    its last control state, with no error from the other's drawing."""
    rows = widgets.RowExplorer(background=True)
    tiles = widgets.TileExplorer(background=True)
    for k in range(1, 6):
        rows.start.value = 8 * k
        tiles.atom.value = k % 4
        rows.colour_by.value = ("origin", "shuffle block")[k % 2]
    assert rows.wait(120) and tiles.wait(120)
    assert not is_error(rows) and not is_error(tiles)
    assert rows.state["window"] == (40, 104) and rows.state["colour_by"] == "shuffle block"
    assert tiles.state["atom"] == 1
    fresh = widgets.RowExplorer()
    fresh.start.value, fresh.colour_by.value = 40, "shuffle block"
    assert svg_texts(rows.svg) == svg_texts(fresh.svg)
