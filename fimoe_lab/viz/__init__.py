"""The lab: explorers that draw the index maps on real expert tensors.

Plain functions (figures and their data) live in :mod:`.figures` and :mod:`.data`,
ipywidgets explorers in :mod:`.widgets`, real tensors in :mod:`.sources`, notebook
rendering of the core's values in :mod:`.render` (``%load_ext fimoe_lab.viz``).
Importing this package imports none of them (nor matplotlib or ipywidgets): names are
resolved on first use, so ``fimoe_lab`` and its CLI stay light.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "RowExplorer": "widgets",
    "TileExplorer": "widgets",
    "PaddingExplorer": "widgets",
    "ProvenanceExplorer": "widgets",
    "TunerExplorer": "widgets",
    "DiagnoseExplorer": "widgets",
    "CompareExplorer": "widgets",
    "row_permutation_figure": "figures",
    "tile_figure": "figures",
    "swizzle_figure": "figures",
    "padding_figure": "figures",
    "provenance_figure": "figures",
    "compare_figure": "figures",
    "tuner_figure": "figures",
    "frontier_figure": "figures",
    "side_by_side": "figures",
    "to_svg": "figures",
    "to_png": "figures",
    "sweep_tactics_figure": "figures",
    "sweep_waste_figure": "figures",
    "padding_report": "data",
    "row_flow": "data",
    "observed_row_sources": "data",
    "chain_diff": "data",
    "row_window": "data",
    "sample_layer": "sources",
    "load_layer": "sources",
    "sample_names": "sources",
    "tactic_sweep": "sources",
}

__all__ = sorted(_LAZY) + ["load_ipython_extension"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_ipython_extension(ip) -> None:
    """``%load_ext fimoe_lab.viz``: render index maps, plans and provenance chains as HTML."""
    from fimoe_lab.viz.render import register

    register(ip)
