"""fimoe_lab: FlashInfer fused-MoE weight layouts as values you can apply, invert and draw.

The curated surface (loaded on first use, so ``import fimoe_lab`` stays light):

- :class:`IndexMap`, :func:`compose`: one expert's layout transform as a value;
- :func:`plan_layer`, :class:`LayerPlan`: the maps of a whole MoE layer, from sizes;
- :class:`FimoeError` and its kinds :class:`LayoutError`, :class:`FormatError`,
  :class:`CheckpointError`, :class:`OracleError`.

Everything else lives in its module: ``fimoe_lab.steps``, ``fimoe_lab.recipes``,
``fimoe_lab.prepare`` (vLLM drop-ins), ``fimoe_lab.specs`` (the tables),
``fimoe_lab.formats``, ``fimoe_lab.checkpoints``, ``fimoe_lab.tune``, ``fimoe_lab.viz``.
"""

from __future__ import annotations

import importlib
from typing import Any

from fimoe_lab.errors import CheckpointError, FimoeError, FormatError, LayoutError, OracleError

__version__ = "0.3.23"

_LAZY = {
    "IndexMap": "fimoe_lab.layout",
    "compose": "fimoe_lab.layout",
    "LayerPlan": "fimoe_lab.plan",
    "plan_layer": "fimoe_lab.recipes",
}

__all__ = [
    "IndexMap",
    "compose",
    "LayerPlan",
    "plan_layer",
    "FimoeError",
    "LayoutError",
    "FormatError",
    "CheckpointError",
    "OracleError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fimoe_lab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
