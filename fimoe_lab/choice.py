"""The two values every plan is built from: what is asked (:class:`LayoutChoice`) of which layer (:class:`LayerShape`).

A plan is ``recipes.plan_for(layer, choice)``; its padded sizes ``shapes.layer_shape(layer, choice)``. The
options are built into a :class:`LayoutChoice` once, where they enter the package (the CLI's parsed
arguments, the drop-ins, a converted file's recorded arguments, the lab's controls), and passed whole; the
functions users call with keyword options (``recipes.plan_layer``, ``shapes.padded_shape``; and, unless given
the value as ``choice=``, ``checkpoints.convert_checkpoint``, ``convert_distributed``, ``inspect_checkpoint``)
build it from them on entry. Adding an option touches this module,
those keyword lists, and the code that reads the field.

Torch-free and free of package imports: every layer may read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["LayoutChoice", "LayerShape"]


@dataclass(frozen=True)
class LayoutChoice:
    """What is asked of every layer's plan, whatever the layer.

    ``backend``: the FlashInfer kernel family (``specs.BACKENDS``); ``intermediate_alignment`` /
    ``hidden_alignment``: the multiples to pad to (None: the engine profile's default,
    ``shapes.default_alignments``); ``engine``: the profile (``engines.ENGINES``; None:
    ``engines.DEFAULT_ENGINE``); ``per_token_activation``: NVFP4 activations quantised per token (the
    profile's per-token paddings apply); ``activation_dtype``: the kernel's activations where a recipe has a
    layout per activation dtype (``recipes.ACTIVATION_DTYPES``; None: the recipe's default); ``values``: which
    form of the profile's value rules applies (``engines.VALUES``: ``"engine"``, the engine's bytes;
    ``"lossless"``, only what the kernel needs; None: ``"engine"`` when ``engine`` is named, else
    ``"lossless"``). The format is
    the layer's (:class:`LayerShape`: a checkpoint may mix formats); TP/EP slicing is the rank layout's
    (``checkpoints.rank_layout``), which hands each rank's sizes to :class:`LayerShape`.
    """

    backend: str
    intermediate_alignment: Optional[int] = None
    hidden_alignment: Optional[int] = None
    engine: Optional[str] = None
    per_token_activation: bool = False
    activation_dtype: Optional[str] = None
    values: Optional[str] = None

    @property
    def value_form(self) -> str:
        """``values`` resolved: as given, else ``"engine"`` when ``engine`` is named, else ``"lossless"``."""
        if self.values is not None:
            return self.values
        return "engine" if self.engine else "lossless"


@dataclass(frozen=True)
class LayerShape:
    """One (per-rank) layer as a plan sees it: ``fmt`` as the kernel takes it (``specs.FORMATS``),
    ``intermediate`` ``I`` and ``hidden`` ``H`` in values (W13 ``[P*I, H]``, W2 ``[H, I]``, ``P`` = 2 when
    ``is_act_and_mul``), ``is_gated``, and the checkpoint's ``quant_method`` (``engines.QUANT_METHODS``; None:
    unknown), which some engine rules are keyed on and which never changes the sizes."""

    fmt: str
    intermediate: int
    hidden: int
    is_act_and_mul: bool = True
    is_gated: bool = True
    quant_method: Optional[str] = None
