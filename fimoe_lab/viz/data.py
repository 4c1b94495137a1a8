"""What the explorers draw, read off index maps (numpy only: no plotting here).

Every function takes an :class:`~fimoe_lab.layout.IndexMap` (or a layer plan) and
returns plain arrays; the figures only draw them, so a test can check a figure's data
against the map it came from. Shapes are one expert's matrix; ``itemsize`` is the
bytes per stored element of the tensor the map moves, read off ``specs.FORMATS``
(:func:`itemsize_of`: 2 for bf16, 1 for fp8, UE8M0, E4M3 and packed fp4 bytes, 4 for
fp32 scales). Steps are told apart by ``kind``/``params``, never by display name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from fimoe_lab.errors import LayoutError
from fimoe_lab.layout import IndexMap, compose
from fimoe_lab.plan import TENSOR_NAMES, LayerPlan
from fimoe_lab.recipes import plan_layer
from fimoe_lab.specs import get_format
from fimoe_lab.steps import shuffle_block_size

__all__ = [
    "TENSOR_NAMES",
    "itemsize_of",
    "element_sources",
    "display_2d",
    "gather_values",
    "RowFlow",
    "row_flow",
    "observed_row_sources",
    "TileView",
    "tile_view",
    "SwizzleView",
    "swizzle_view",
    "TensorPadding",
    "PaddingReport",
    "padding_report",
    "provenance_rows",
]


def itemsize_of(fmt: str, tensor: str) -> int:
    """Bytes per stored element of ``tensor`` ("w13", "w2", "w13_scale", "w2_scale") in ``fmt``.

    Weights: ``spec.itemsize`` (packed fp4 is drawn per byte, two values each); scales:
    ``spec.scale_itemsize`` (4 for fp8-block's float32 block scales).
    """
    spec = get_format(fmt)
    return spec.scale_itemsize if tensor.endswith("_scale") else spec.itemsize


def _check_itemsize(m: IndexMap, itemsize: int) -> None:
    if m.in_shape[-1] % itemsize or m.out_shape[-1] % itemsize or m.cell_bytes % itemsize:
        raise LayoutError(
            f"{m.name} moves {m.cell_bytes}-byte cells of rows {m.in_shape[-1]} -> {m.out_shape[-1]} bytes, "
            f"which do not split into whole {itemsize}-byte elements",
            fix="pass the itemsize of the tensor it moves (itemsize_of(fmt, tensor))",
        )


def element_sources(m: IndexMap, itemsize: int = 1) -> np.ndarray:
    """int64 array of ``m.out_shape`` in elements: the flat input element of each output element.

    ``-1`` marks fill. The last dim of ``out_shape`` is divided by ``itemsize``.
    """
    _check_itemsize(m, itemsize)
    src = m.refined(itemsize).src.numpy()
    shape = m.out_shape[:-1] + (m.out_shape[-1] // itemsize,)
    return np.where(src >= 0, src, -1).reshape(shape)


def display_2d(a: np.ndarray) -> np.ndarray:
    """A 3-D kernel layout ``(K/bk, M, bk)`` shown as ``(K/bk * M, bk)``; 2-D unchanged."""
    return a.reshape(-1, a.shape[-1]) if a.ndim > 2 else a


def gather_values(m: IndexMap, values: np.ndarray | torch.Tensor, itemsize: int = 1) -> np.ndarray:
    """Move one expert's per-element ``values`` ``(rows, cols)`` through ``m``: float, NaN = fill.

    ``values`` has ``m.in_shape`` in elements (e.g. dequantized magnitudes of the stored
    elements); the result has ``m.out_shape`` in elements, drawn with :func:`display_2d`.
    """
    v = np.asarray(values, dtype=np.float64)
    in_shape = m.in_shape[:-1] + (m.in_shape[-1] // itemsize,)
    if v.size != math.prod(in_shape):
        raise LayoutError(
            f"values of shape {v.shape} do not match {m.name}'s input {in_shape} elements of {itemsize} B",
            fix="pass one expert's values in the map's input layout",
        )
    src = element_sources(m, itemsize)
    return np.where(src >= 0, v.reshape(-1)[np.maximum(src, 0)], np.nan)


# ----------------------------------------------------------------------------- rows
def _epilogue_tile_m(m: IndexMap) -> Optional[int]:
    """``epilogue_tile_m`` of the shuffle step in ``m``'s chain, or None."""
    return next((int(s.params["epilogue_tile_m"]) for s in m.steps if s.kind == "shuffle_rows_for_epilogue"), None)


@dataclass(frozen=True)
class RowFlow:
    """Which checkpoint row lands in each kernel row (``out[i] = in[src_rows[i]]``).

    ``src_rows`` int64 ``(out_rows,)``, ``-1`` = a padding row; ``projections`` 2 for a
    fused ``[gate; up]`` W13 of ``2 * intermediate`` input rows, 1 otherwise; ``steps``
    the ``kind`` of each row step, in order.
    ``shuffle_block``/``epilogue_tile`` come from the chain's epilogue shuffle step.
    """

    src_rows: np.ndarray
    in_rows: int
    projections: int
    steps: tuple[str, ...]
    shuffle_block: Optional[int]
    epilogue_tile: Optional[int]

    @property
    def out_rows(self) -> int:
        return int(self.src_rows.size)

    def colour_modes(self) -> tuple[str, ...]:
        """The colourings this flow supports, for a widget's dropdown."""
        modes = ["origin"]
        if self.shuffle_block:
            modes += ["shuffle block", "epilogue tile"]
        return tuple(modes)

    def groups(self, colour_by: str = "origin") -> tuple[np.ndarray, tuple[str, ...]]:
        """Per output row, a group code and the group labels; padding is always the last label.

        ``origin``: gate / up (or rows) / padding, by source row; ``shuffle block``: the
        output block of ``shuffle_block`` rows; ``epilogue tile``: the output tile of
        ``epilogue_tile`` rows.
        """
        pad = self.src_rows < 0
        if colour_by == "origin":
            half = self.in_rows // self.projections
            names = ("gate", "up") if self.projections == 2 else ("row",)
            code = np.minimum(np.maximum(self.src_rows, 0) // max(half, 1), len(names) - 1)
        elif colour_by in ("shuffle block", "epilogue tile") and self.shuffle_block:
            size = self.shuffle_block if colour_by == "shuffle block" else self.epilogue_tile
            code = np.arange(self.out_rows) // size
            names = tuple(f"{colour_by} {k}" for k in range(int(code.max()) + 1))
        else:
            raise LayoutError(
                f"cannot colour rows by {colour_by!r}", fix=f"this chain offers {', '.join(self.colour_modes())}"
            )
        return np.where(pad, len(names), code), names + ("padding",)


def row_flow(m: IndexMap, projections: int = 2) -> RowFlow:
    """The row permutation of ``m`` (its leading 2-D steps: pad, swap, interleave, shuffle).

    ``m`` acts on ``[P*I, K]`` bytes; every kernel row must come from one input row
    (true of every row step in :mod:`fimoe_lab.steps`). Later steps that re-tile or
    swizzle are left out: see :func:`tile_view` and :func:`swizzle_view`.
    """
    rows_map = m.row_steps()
    in_rows = rows_map.in_shape[0]
    first = rows_map.row_sources().numpy()
    etm = _epilogue_tile_m(rows_map)
    block = shuffle_block_size(etm) if etm else None
    return RowFlow(first.astype(np.int64), in_rows, projections, tuple(s.kind for s in rows_map.steps), block, etm)


def observed_row_sources(checkpoint: torch.Tensor, kernel: torch.Tensor) -> np.ndarray:
    """For each row of ``kernel`` ``(R', K)``, the row of ``checkpoint`` ``(R, K)`` with the same bytes.

    ``-1`` where no checkpoint row matches (padding rows are all zero; rows that were
    changed match nothing). Compare with :func:`row_flow` to see what a suspect
    preparation actually did. Columns past the checkpoint's width are ignored.
    """
    ck = checkpoint.contiguous().view(torch.uint8).reshape(checkpoint.shape[0], -1).numpy()
    kn = kernel.contiguous().view(torch.uint8).reshape(kernel.shape[0], -1).numpy()[:, : ck.shape[1]]
    index = {row.tobytes(): i for i, row in enumerate(ck)}
    return np.array([index.get(row.tobytes(), -1) for row in kn], dtype=np.int64)


# ----------------------------------------------------------------------------- tiles
@dataclass(frozen=True)
class TileView:
    """Block-major-K: ``[M, K] -> [K/bk, M, bk]``, element sources drawn as ``(K/bk * M, bk)``.

    ``src_row``/``src_col`` int64 ``(K/bk * M, bk)`` in the map's input elements (-1 fill);
    ``block_of_input`` int64 ``(in_rows, in_cols)``: the K block each input element lands in.
    """

    src_row: np.ndarray
    src_col: np.ndarray
    block_of_input: np.ndarray
    blocks: int
    rows: int
    block_cols: int
    name: str


def tile_view(m: IndexMap, itemsize: int = 1) -> TileView:
    """Where every element of a block-major-K output ``(K/bk, M, bk)`` comes from."""
    if len(m.out_shape) != 3:
        raise LayoutError(
            f"{m.name} has output {m.out_shape} bytes; a block-major-K tile view needs (K/bk, M, bk)",
            fix="pick a map that ends with block_major_k",
        )
    src = element_sources(m, itemsize)
    in_cols = m.in_shape[-1] // itemsize
    flat = display_2d(src)
    kb, rows, bk = src.shape
    block_of_input = np.full(m.in_shape[0] * in_cols, -1, dtype=np.int64)
    taken = src >= 0
    block_of_input[src[taken]] = np.broadcast_to(np.arange(kb)[:, None, None], src.shape)[taken]
    return TileView(
        np.where(flat >= 0, flat // in_cols, -1),
        np.where(flat >= 0, flat % in_cols, -1),
        block_of_input.reshape(m.in_shape[0], in_cols),
        kb,
        rows,
        bk,
        m.name,
    )


@dataclass(frozen=True)
class SwizzleView:
    """A 128x4-swizzled scale buffer, atom by atom.

    The buffer ``Rp*Cp`` is drawn as ``(atoms*32, 16)``: atom ``a`` (512 scales, one
    128-row x 4-column block of the linear matrix) is rows ``32a .. 32a+31``.
    ``src_row``/``src_col``: input coordinates of each buffer scale (-1 fill);
    ``dest_atom``/``dest_offset`` ``(in_rows, in_cols)``: where each linear scale lands.
    ``atom_origin`` ``(atoms, 2)``: the (row block, column block) of the swizzled
    ``[Rp, Cp]`` matrix each atom holds.
    """

    src_row: np.ndarray
    src_col: np.ndarray
    dest_atom: np.ndarray
    dest_offset: np.ndarray
    atom_origin: np.ndarray
    name: str

    @property
    def atoms(self) -> int:
        return self.src_row.shape[0] // 32


ATOM = 512


def swizzle_view(m: IndexMap, itemsize: int = 1) -> SwizzleView:
    """Where each scale of the linear ``[rows, cols]`` input lands in the swizzled buffer.

    ``m`` is a chain that ends with ``swizzle_scales_128x4`` (e.g. a plan's
    ``w13_scale``: pad, row permutation, swizzle); sources are the chain's input.
    """
    if m.steps[-1].kind != "swizzle_scales_128x4":
        raise LayoutError(
            f"{m.name} does not end with swizzle_scales_128x4; there is no swizzled buffer to draw",
            fix="pick a TRT-LLM scale map (w13_scale or w2_scale of mxfp8, nvfp4 or mxfp4)",
        )
    src = element_sources(m, itemsize).reshape(-1)
    if src.size % ATOM:
        raise LayoutError(
            f"{m.name}: buffer of {src.size} scales is not whole 512-scale atoms",
            fix="pad the scales to 128 rows and 4 columns first",
        )
    in_rows, in_cols = m.in_shape[0], m.in_shape[-1] // itemsize
    dest = np.full(in_rows * in_cols, -1, dtype=np.int64)
    taken = src >= 0
    dest[src[taken]] = np.flatnonzero(taken)
    dest = dest.reshape(in_rows, in_cols)
    cp_atoms = m.out_shape[-1] // itemsize // 4
    atoms = np.arange(src.size // ATOM)
    return SwizzleView(
        np.where(src >= 0, src // in_cols, -1).reshape(-1, 16),
        np.where(src >= 0, src % in_cols, -1).reshape(-1, 16),
        np.where(dest >= 0, dest // ATOM, -1),
        dest,
        np.stack([atoms // cp_atoms, atoms % cp_atoms], axis=1),
        m.name,
    )


# ----------------------------------------------------------------------------- padding
@dataclass(frozen=True)
class TensorPadding:
    """Padding of one tensor of a plan (``m``: its index map, ``itemsize``: bytes per element)."""

    name: str
    m: IndexMap
    itemsize: int

    @property
    def fill_bytes(self) -> int:
        """Padding bytes per expert."""
        return int((self.m.src < 0).sum()) * self.m.cell_bytes

    @property
    def out_bytes(self) -> int:
        return self.m.out_bytes

    @property
    def padded_mask(self) -> np.ndarray:
        """bool ``(rows, elements)`` over the padded matrix before any permutation (True = padding)."""
        return display_2d(element_sources(_padded_stage(self.m), self.itemsize) < 0)

    @property
    def kernel_mask(self) -> np.ndarray:
        """bool over the kernel layout as stored (:func:`display_2d`), True = padding."""
        return display_2d(element_sources(self.m, self.itemsize) < 0)


@dataclass(frozen=True)
class PaddingReport:
    """Padding of every tensor of one layer's plan, per TP shard, with the waste in bytes."""

    fmt: str
    backend: str
    tp: int
    intermediate: int
    local_intermediate: int
    hidden: int
    plan: LayerPlan
    experts: int
    tensors: dict

    @property
    def fill_bytes(self) -> int:
        """Padding bytes over all experts and tensors of one TP shard."""
        return self.experts * sum(t.fill_bytes for t in self.tensors.values())

    @property
    def out_bytes(self) -> int:
        return self.experts * sum(t.out_bytes for t in self.tensors.values())

    @property
    def waste_pct(self) -> float:
        return 100.0 * self.fill_bytes / self.out_bytes if self.out_bytes else 0.0

    def summary(self) -> str:
        p = self.plan
        return (
            f"{p.description}, TP {self.tp}: intermediate {self.intermediate} -> {self.local_intermediate} per shard "
            f"-> padded {p.padded_intermediate}; hidden {self.hidden} -> {p.padded_hidden}; "
            f"waste {self.fill_bytes:,} B of {self.out_bytes:,} B ({self.waste_pct:.2f}%) for {self.experts} experts"
        )


def _padded_stage(m: IndexMap) -> IndexMap:
    """The prefix of ``m``'s steps up to its last ``pad_projections`` step (or its first step)."""
    last = max((i for i, s in enumerate(m.steps) if s.kind == "pad_projections"), default=-1)
    return compose(*m.steps[: last + 1]) if last >= 0 else m.steps[0]


def padding_report(
    fmt: str,
    backend: str,
    intermediate: int,
    hidden: int,
    tp: int = 1,
    experts: int = 1,
    intermediate_alignment: Optional[int] = None,
    hidden_alignment: Optional[int] = None,
    is_act_and_mul: bool = True,
    is_gated: bool = True,
) -> PaddingReport:
    """Which rows/columns of w13, w2 and their scales are padding, for one TP shard.

    ``intermediate`` is the model's (global) size; each TP shard holds ``intermediate / tp``
    before padding. Alignments default to :func:`fimoe_lab.recipes.default_alignments`
    (what ``fimoe-lab convert`` pads to); the plan is :func:`fimoe_lab.recipes.plan_layer`.
    """
    if tp < 1 or intermediate % tp:
        raise LayoutError(
            f"intermediate {intermediate} does not split into {tp} tensor-parallel shards",
            fix=f"choose a TP size that divides it ({', '.join(str(t) for t in (1, 2, 4, 8) if intermediate % t == 0)})",
        )
    local = intermediate // tp
    plan = plan_layer(fmt, backend, local, hidden, is_act_and_mul, is_gated, intermediate_alignment, hidden_alignment)
    tensors = {name: TensorPadding(name, m, itemsize_of(fmt, name)) for name, m in plan.maps().items()}
    return PaddingReport(fmt, backend, tp, intermediate, local, hidden, plan, experts, tensors)


# ----------------------------------------------------------------------------- provenance
def provenance_rows(
    m: IndexMap, coords: tuple[int, ...], itemsize: int = 1
) -> list[tuple[str, tuple, Optional[tuple]]]:
    """The chain for output element ``coords`` (in elements): ``[(stage, shape, coords | None)]``.

    First row is the output, last the checkpoint position (None when the element is padding).
    """
    byte_coords = tuple(coords[:-1]) + (coords[-1] * itemsize,)
    chain = m.provenance(byte_coords).in_elements(itemsize)
    return [(s.step, s.shape, s.coords) for s in chain.stages]
