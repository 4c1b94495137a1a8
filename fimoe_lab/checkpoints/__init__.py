"""Real expert tensors: read MoE layers from safetensors checkpoints, inspect, convert, restore.

- :func:`open_checkpoint` / :class:`Checkpoint`: lazy reader; ``read_layer(L, tp_size, tp_rank)``
  stacks one layer's experts into a :class:`MoELayer` (``w13 (E, 2I, H)``, ``w2 (E, H, I)``, scales).
- :func:`inspect_checkpoint` / :func:`format_report`: per-layer summary and scale health.
- :func:`convert_checkpoint`, :func:`restore_checkpoint`, :func:`restore_layers`: kernel layout and back;
  :func:`convert_layer` one layer, under a :class:`LayoutChoice` (backend, alignments, engine, activations).
- :func:`layer_forward` / :func:`moe_forward`: the reference MoE forward.
- :func:`sample_path`: the small sample checkpoints shipped in the package (:func:`fimoe_lab.resources.samples_dir`).
"""

from __future__ import annotations

from fimoe_lab.checkpoints import safe_io
from fimoe_lab.checkpoints.conventions import CONVENTIONS, Convention
from fimoe_lab.checkpoints.convert import convert_layer, write_kernel_layout
from fimoe_lab.checkpoints.fileformat import read_kernel_metadata
from fimoe_lab.checkpoints.inspect import LayerReport, format_report, inspect_checkpoint
from fimoe_lab.checkpoints.moe_reference import layer_forward, moe_forward, random_routing
from fimoe_lab.checkpoints.reader import Checkpoint, CheckpointError, MoELayer, open_checkpoint
from fimoe_lab.checkpoints.restore import restore_layers
from fimoe_lab.checkpoints.writer import convert_checkpoint, not_byte_exact, restore_checkpoint
from fimoe_lab.choice import LayoutChoice
from fimoe_lab.resources import sample_names, sample_path

__all__ = [
    "CONVENTIONS",
    "Checkpoint",
    "CheckpointError",
    "Convention",
    "LayerReport",
    "LayoutChoice",
    "MoELayer",
    "convert_checkpoint",
    "convert_layer",
    "format_report",
    "inspect_checkpoint",
    "layer_forward",
    "moe_forward",
    "not_byte_exact",
    "open_checkpoint",
    "random_routing",
    "safe_io",
    "read_kernel_metadata",
    "restore_checkpoint",
    "restore_layers",
    "sample_names",
    "sample_path",
    "write_kernel_layout",
]
