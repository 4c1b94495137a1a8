"""Where the lab's real tensors and tactic counts come from: small adapters.

- :func:`sample_layer`: seeded, *structured* expert weights (gate rows ramp down the
  rows, up rows ramp across the columns, W2 has diagonal bands), quantized with
  :mod:`fimoe_lab.formats`, so a wrong permutation shows as a broken pattern.
- :func:`load_layer`: one MoE layer of a checkpoint (a shipped sample name or a path),
  through :mod:`fimoe_lab.checkpoints`.
- :func:`tactic_sweep`: the tuner's table for (preset, format, TP), through
  :mod:`fimoe_lab.tune`.
The explorers only see :class:`ExpertTensors` and the tuner's DataFrame.
"""

from __future__ import annotations

import importlib
import itertools
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from fimoe_lab.errors import FormatError, LayoutError
from fimoe_lab.plan import LayerPlan
from fimoe_lab.specs import get_format, tuner_formats, weight_formats
from fimoe_lab.viz.data import BoundedCache, lru_get, nbytes

__all__ = [
    "ExpertTensors",
    "LabUnavailable",
    "PLAN_FORMATS",
    "TUNER_FORMATS",
    "sample_layer",
    "load_layer",
    "sample_names",
    "preset_names",
    "tactic_sweep",
    "tuner_choices",
]

PLAN_FORMATS = weight_formats()
"""Formats the layout views draw (and :func:`sample_layer` makes): ``specs.weight_formats()``."""
TUNER_FORMATS = tuner_formats()
"""Formats the tuner view sweeps: ``specs.tuner_formats()``."""


class LabUnavailable(RuntimeError):
    """A part of the toolkit the lab needs is not installed in this build."""


def _require(module: str, what: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and module.startswith(exc.name):
            raise LabUnavailable(
                f"{what} needs {module}, which is not in this build of fimoe_lab; "
                f"install the full toolkit (pip install 'fimoe_lab[all]')"
            ) from None
        raise


EXPERT_BYTES_KEPT = 160 << 20
"""Bytes of raw expert tensors (one expert of one layer, read from disk) kept, every layer together: an R1
NVFP4 expert is ~25 MB, a DeepSeek-V3 FP8-block expert ~44 MB."""
VALUE_BYTES_KEPT = 320 << 20
"""Bytes of decoded arrays (a tensor of one expert: magnitudes or dead-scale masks) kept, every layer together,
the least recently used dropped: one R1 NVFP4 w13 expert's magnitudes are ~60 MB."""
_EXPERTS = BoundedCache(EXPERT_BYTES_KEPT)
_VALUES = BoundedCache(VALUE_BYTES_KEPT)


def free_room() -> tuple[int, int]:
    """Bytes the shared caches hold below their bounds: ``(raw experts, decoded values)``."""
    return _EXPERTS.limit - _EXPERTS.bytes, _VALUES.limit - _VALUES.bytes


_OWN = itertools.count()


class ExpertTensors:
    """One MoE layer's experts in the checkpoint layout, and the plans the lab draws on them.

    ``layout``: the stacked layer (:class:`fimoe_lab.checkpoints.MoELayer`): ``w13``
    ``(E, P*I, H)`` (``H/2`` bytes for packed fp4), ``w2`` ``(E, H, I)``, block scales in
    their linear layout; ``intermediate`` is per TP rank. ``source`` says where it came from.

    A checkpoint's layer is lazy (:func:`load_layer`): ``layout`` holds its shapes only (meta tensors)
    and ``read(experts)`` reads experts ``(e0, e1)`` (None: all) from the memory-mapped shards. The views
    read one expert at a time (:meth:`expert`); decoded and raw arrays are kept in caches bounded in bytes
    and shared by every layer (:data:`EXPERT_BYTES_KEPT`, :data:`VALUE_BYTES_KEPT`), under ``key`` (one per
    checkpoint file, layer and TP slice: two spellings of its path share them).
    """

    def __init__(
        self,
        layout: Any,
        source: str,
        read: Optional[Callable[[Optional[tuple[int, int]]], Any]] = None,
        key: Optional[tuple] = None,
    ):
        self.layout = layout
        self.source = source
        self.read = read
        self.key = key if key is not None else ("own", next(_OWN))
        self._plans: dict = {}
        self._whole: Any = None
        self.last_read: Optional[tuple[int, int, float]] = None
        """The last expert read from disk: ``(expert, bytes, seconds)`` (a lazy layer's progress)."""

    def __repr__(self) -> str:
        return f"ExpertTensors({self.source!r})"

    @property
    def moe(self) -> Any:
        """The whole layer's tensors (:class:`~fimoe_lab.checkpoints.MoELayer`). A lazy layer reads every
        expert on the first use (kept): the explorers never ask for it, scripts may."""
        if self.read is None:
            return self.layout
        if self._whole is None:
            self._whole = self.read(None)
        return self._whole

    @property
    def lazy(self) -> bool:
        """True when experts are read on demand (a checkpoint's layer)."""
        return self.read is not None

    @property
    def fmt(self) -> str:
        return self.layout.fmt  # type: ignore[no-any-return]

    @property
    def intermediate(self) -> int:
        return self.layout.intermediate  # type: ignore[no-any-return]

    @property
    def hidden(self) -> int:
        return self.layout.hidden  # type: ignore[no-any-return]

    @property
    def gated(self) -> bool:
        return self.layout.is_act_and_mul  # type: ignore[no-any-return]

    @property
    def experts(self) -> int:
        return int(self.layout.num_experts)

    @property
    def tensors(self) -> dict:
        """``w13``, ``w2`` and the block scales present, by name (shapes only for a lazy layer)."""
        return {n: t for n, t in self.layout.tensors().items() if t is not None}

    def plan(self, backend: str, activation_dtype: Optional[str] = None, per_token: bool = False) -> LayerPlan:
        """The layer plan for ``backend``: the one ``fimoe-lab convert`` applies to this layer
        (``--mxfp4-activation`` ``activation_dtype``: ``recipes.ACTIVATION_DTYPES``; ``--per-token``
        ``per_token``: NVFP4 activations quantised per token). Kept per argument set."""
        key = (backend, activation_dtype, per_token)
        if key not in self._plans:
            from fimoe_lab.checkpoints import plan_choice
            from fimoe_lab.choice import LayoutChoice

            choice = LayoutChoice(backend, per_token_activation=per_token, activation_dtype=activation_dtype)
            args = plan_choice.plan_args(self.layout, choice)
            self._plans[key] = plan_choice.build_plan(args)
        return self._plans[key]  # type: ignore[no-any-return]

    def _check_expert(self, expert: int) -> None:
        if not 0 <= expert < self.experts:
            raise LayoutError(
                f"expert {expert} is outside 0..{self.experts - 1} of this layer",
                fix=f"pick an expert in 0..{self.experts - 1}",
            )

    def expert(self, expert: int) -> Any:
        """Expert ``expert`` alone, as a one-expert :class:`~fimoe_lab.checkpoints.MoELayer` (its tensors
        ``(1, ...)``, byte-identical to ``[expert : expert + 1]`` of the whole layer's): a lazy layer reads
        only that expert (kept in the shared cache), an in-memory one is sliced (no copy)."""
        self._check_expert(expert)
        if self.read is not None and self._whole is None:
            return _EXPERTS.get((self.key, expert), lambda: self._timed_read(expert, expert + 1))
        return self._sliced(expert, expert + 1)

    def head(self, count: int) -> Any:
        """Experts ``0 .. count-1`` (at most all) as one :class:`~fimoe_lab.checkpoints.MoELayer`, byte-identical
        to ``[:count]`` of the whole layer's tensors: a lazy layer reads only those (not kept: the caller keeps
        what it needs), an in-memory one is sliced (no copy)."""
        count = max(1, min(count, self.experts))
        if self.read is not None and self._whole is None:
            return self._timed_read(0, count)
        return self._sliced(0, count)

    def sizes(self, name: str) -> tuple[int, int]:
        """``(expert bytes, value bytes)`` one expert takes in the shared caches (:data:`EXPERT_BYTES_KEPT`,
        :data:`VALUE_BYTES_KEPT`) when ``name`` is shown: its stored tensors (``sum over tensors of
        prod(shape[1:]) * itemsize``; 0 for a layer in memory) and, for ``name`` of stored shape ``(R, C)`` per
        expert, ``5 * R * C`` (float32 magnitudes and at most a one-byte dead mask) plus ``4 * Rs * Cs`` for its
        block scales ``(Rs, Cs)`` (decoded to find the dead ones)."""
        tensors = self.tensors
        raw = 0
        if self.read is not None and self._whole is None:
            raw = sum(int(np.prod(t.shape[1:])) * t.element_size() for t in tensors.values())
        scales = tensors.get(f"{name}_scale") if not name.endswith("_scale") else None
        return raw, 5 * int(np.prod(tensors[name].shape[1:])) + (
            0 if scales is None else 4 * int(np.prod(scales.shape[1:]))
        )

    def added_bytes(self, name: str, expert: int) -> tuple[int, int]:
        """:meth:`sizes` of ``expert``, 0 for what the shared caches keep already."""
        self._check_expert(expert)
        raw, values = self.sizes(name)
        kept = (self.key, "magnitude", name, expert) in _VALUES.entries
        return (0 if (self.key, expert) in _EXPERTS.entries else raw), (0 if kept else values)

    def _timed_read(self, e0: int, e1: int) -> Any:
        """Experts ``[e0, e1)`` read from disk, the time it took on :attr:`last_read`."""
        assert self.read is not None
        started = time.perf_counter()
        some = self.read((e0, e1))
        self.last_read = (e0, nbytes(some), time.perf_counter() - started)
        return some

    def _sliced(self, e0: int, e1: int) -> Any:
        moe = self.moe
        return replace(
            moe,
            w13=moe.w13[e0:e1],
            w2=moe.w2[e0:e1],
            w13_scale=None if moe.w13_scale is None else moe.w13_scale[e0:e1],
            w2_scale=None if moe.w2_scale is None else moe.w2_scale[e0:e1],
            extras={k: v[e0:e1] if v.ndim and v.shape[0] == self.experts else v for k, v in moe.extras.items()},
        )

    def magnitude(self, name: str, expert: int = 0) -> np.ndarray:
        """float32 ``(rows, elements)`` of one expert: |dequantized weight| per stored element
        (per byte for packed fp4: the larger of its two values), or the decoded scales.

        Kept per ``(name, expert)`` (a real-size expert dequantizes in about a second), read-only."""
        return self._kept(("magnitude", name, expert), lambda: self._magnitude(name, expert))

    def dead(self, name: str, expert: int = 0) -> np.ndarray:
        """bool, shaped like :meth:`magnitude`: True where the element's decoded block scale is
        below :data:`fimoe_lab.formats.health.TINY_SCALE` (a dead scale; for a scale tensor,
        the scale itself). All False for an unscaled format, or when no scale is dead (then a
        broadcast view: no memory per element).

        A scale of shape ``(rs, cs)`` (per tensor: ``(1, 1)``) covers ``ceil(R/rs) x ceil(C/cs)`` of the ``(R, C)``
        stored elements.
        """
        return self._kept(("dead", name, expert), lambda: self._dead(name, expert))

    def tp_shard(self, name: str, expert: int, tp_size: int, tp_rank: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """``(magnitude, dead)`` (:meth:`magnitude`, :meth:`dead`) of what TP rank ``tp_rank`` of ``tp_size``
        holds of one expert's ``name``: the intermediate ``[r*I/tp, (r+1)*I/tp)`` of every projection, equal
        shards as a plan at TP ``tp`` assumes (:meth:`Checkpoint.shard_bounds`). w13 and its scales
        ``(P*I*a, C)`` -> those rows of each of the P projections ``(P*I*a/tp, C)``; w2 and its scales
        ``(R, I*b)`` -> those columns ``(R, I*b/tp)`` (``a``, ``b``: stored elements per intermediate value,
        e.g. ``b = 1/2`` for packed FP4 bytes, ``1/block`` for block scales). A bound that falls inside a
        stored element or a scale block is a :class:`LayoutError`. Kept like :meth:`magnitude`."""
        full, dead = self.magnitude(name, expert), self.dead(name, expert)
        axis, pieces, shape = self._tp_pieces(name, full.shape, tp_size, tp_rank)

        def cut(a: np.ndarray) -> np.ndarray:
            if a.strides == (0, 0):  # a broadcast "nothing dead": the shard's shape, still no memory
                return np.broadcast_to(np.False_, shape)
            out = torch.empty(shape, dtype=_TORCH_DTYPES[a.dtype]).numpy()  # torch's allocator: see _magnitude
            at = 0
            for p in pieces:
                width = p.stop - p.start
                out[(slice(at, at + width),) if axis == 0 else (slice(None), slice(at, at + width))] = a[
                    (p,) if axis == 0 else (slice(None), p)
                ]
                at += width
            return out

        key = ("tp", name, expert, tp_size, tp_rank)
        return self._kept(key + ("magnitude",), lambda: cut(full)), self._kept(key + ("dead",), lambda: cut(dead))

    def tp_shard_shape(self, name: str, shape: tuple[int, ...], tp_size: int) -> tuple[int, int]:
        """The shape of :meth:`tp_shard` of ``name`` whose :meth:`magnitude` has ``shape``: the sharded axis
        (rows of w13, columns of w2) divided by ``tp_size`` (the same :class:`LayoutError` where it cuts)."""
        return self._tp_pieces(name, shape, tp_size, 0)[2]

    def _tp_pieces(
        self, name: str, shape: tuple[int, ...], tp_size: int, tp_rank: int
    ) -> tuple[int, list[slice], tuple[int, int]]:
        """``(axis, the slices of it rank tp_rank holds, one per projection, the shard's shape)`` of
        :meth:`tp_shard`."""
        inter = self.intermediate
        if not (tp_size >= 1 and 0 <= tp_rank < tp_size and inter % tp_size == 0):
            raise LayoutError(
                f"intermediate {inter} has no equal rank {tp_rank} of {tp_size}", fix="pick a TP size that divides it"
            )
        projections = 2 if name.startswith("w13") and self.gated else 1
        axis = 0 if name.startswith("w13") else 1
        per = shape[axis] / (projections * inter)  # stored elements along the sharded axis per value
        lo, hi = tp_rank * inter // tp_size * per, (tp_rank + 1) * inter // tp_size * per
        if lo != int(lo) or hi != int(hi):
            raise LayoutError(
                f"a TP {tp_size} shard of {name} ({inter // tp_size} values of each projection) cuts its stored "
                f"elements or scale blocks",
                fix="pick a TP size whose shards are whole blocks",
            )
        width = shape[axis] // projections
        out = [shape[0], shape[1]]
        out[axis] = projections * (int(hi) - int(lo))
        return axis, [slice(p * width + int(lo), p * width + int(hi)) for p in range(projections)], (out[0], out[1])

    def _kept(self, key: tuple, make: Callable[[], np.ndarray]) -> np.ndarray:
        """``make()`` kept read-only under ``key`` in the shared cache bounded in bytes (:data:`VALUE_BYTES_KEPT`;
        made again when asked after it was dropped)."""

        def read_only() -> np.ndarray:
            a = make()
            a.flags.writeable = False
            return a

        return _VALUES.get((self.key,) + key, read_only)

    def _dead(self, name: str, expert: int) -> np.ndarray:
        from fimoe_lab.formats.health import TINY_SCALE

        shape = self.magnitude(name, expert).shape
        scale_name = name if name.endswith("_scale") else f"{name}_scale"
        if scale_name not in self.tensors:
            return np.broadcast_to(np.False_, shape)
        tiny = self.magnitude(scale_name, expert) < TINY_SCALE
        if not tiny.any():  # the usual case: no full-size mask (one R1 expert: 15 MB of fresh memory)
            return np.broadcast_to(np.False_, shape)
        tiny = tiny.reshape(-1, 1) if tiny.ndim < 2 else tiny  # per tensor (or per projection)
        fr, fc = -(-shape[0] // tiny.shape[0]), -(-shape[1] // tiny.shape[1])
        return np.ascontiguousarray(np.repeat(np.repeat(tiny, fr, axis=0), fc, axis=1)[: shape[0], : shape[1]])

    def _magnitude(self, name: str, expert: int) -> np.ndarray:
        from fimoe_lab.formats import QuantizedTensor
        from fimoe_lab.formats.health import decoded_scales

        one = self.expert(expert)
        if name.endswith("_scale"):
            scales = one.tensors()[name][0]
            return decoded_scales(QuantizedTensor(None, scales, None, self.fmt, 0)).float().numpy()
        parts = [q for part, q in one.quantized() if part in _PARTS[name]]  # only the tensor shown
        if parts:  # each part straight into its rows (no concatenated copy), a band of rows at a time
            rows = sum(q.values.shape[-2] for q in parts)
            # torch's allocator, not numpy's: numpy advises huge pages for large arrays, and their first
            # touch was 5-10x slower on the lab's 2-core VM (benchmarks/bench_lab.py, RESULTS.md)
            out = torch.empty((rows, parts[0].values.shape[-1]), dtype=torch.float32).numpy()
            at = 0
            for q in parts:
                for band in _row_bands(q):
                    piece = _stored_magnitude(band)[0].float().numpy()
                    out[at : at + piece.shape[0]] = piece
                    at += piece.shape[0]
            return out
        values = dict(zip(("w13", "w2"), one.dequantized()))[name][0].abs()
        if get_format(self.fmt).packed:
            values = values.reshape(values.shape[0], -1, 2).amax(dim=-1)
        return values.float().numpy()


_TORCH_DTYPES = {np.dtype(np.float32): torch.float32, np.dtype(np.bool_): torch.bool}
"""The dtypes of decoded arrays (magnitudes, dead masks) in torch, which allocates them (:meth:`ExpertTensors._magnitude`)."""

BAND_BYTES = 1 << 20
"""Stored bytes per band of :func:`_row_bands`: each band's float32 temporaries stay a few MB (an R1
expert's whole-tensor temporaries are 30 MB each, and fresh memory costs page faults)."""


def _row_bands(q: Any) -> list[Any]:
    """One expert's QuantizedTensor ``q`` (``(1, rows, cols)``) as bands of whole rows of about
    :data:`BAND_BYTES` stored bytes, each with its rows of scales (checkpoint layout: a scale row per
    ``scale_block_rows`` value rows, 128 for fp8-block, else 1; a band is a whole number of them); ``[q]`` when
    its scales are not per row or row block (per tensor)."""
    rows, cols = q.values.shape[-2:]
    scales = q.scales
    per = get_format(q.fmt).scale_block_rows
    if scales is None or scales.ndim < 2 or scales.shape[-2] != -(-rows // per):
        return [q]
    step = max(1, BAND_BYTES // max(1, cols * q.values.element_size()))
    step = -(-step // per) * per
    return [
        replace(q, values=q.values[..., a : a + step, :], scales=scales[..., a // per : (a + step) // per, :])
        for a in range(0, rows, step)
    ]


def _stored_magnitude(q: Any) -> torch.Tensor:
    """``|dequantized value|`` per stored element of the QuantizedTensor ``q``: per byte of a packed format
    the larger of its two (from the bytes, no unpacking: a real-size expert in well under a second)."""
    spec = get_format(q.fmt)
    if spec.packed:
        return spec.max_abs_per_byte(q)  # type: ignore[no-any-return]
    from fimoe_lab import formats

    return formats.dequantize(q).abs()


_PARTS = {"w13": ("w13", "gate", "up"), "w2": ("w2", "down")}
"""The parts of :meth:`MoELayer.quantized` each weight is made of (w13: ``[gate; up]`` rows, in that order)."""


def _structured(
    experts: int, intermediate: int, hidden: int, gated: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 W13 ``(E, P*I, H)`` and W2 ``(E, H, I)`` with patterns a permutation breaks visibly."""
    g = torch.Generator().manual_seed(seed)
    e = torch.arange(1, experts + 1, dtype=torch.float32)[:, None, None]

    def noisy(amp: torch.Tensor) -> torch.Tensor:
        sign = torch.randint(0, 2, amp.shape, generator=g) * 2 - 1
        return amp * (1 + 0.1 * torch.rand(amp.shape, generator=g)) * sign

    r = torch.arange(intermediate, dtype=torch.float32)[:, None] / intermediate
    c = torch.arange(hidden, dtype=torch.float32)[None, :] / hidden
    gate = (0.1 + r + 0 * c) * e
    up = (0.1 + 0 * r + 0.5 * c) * e
    w13 = noisy(torch.cat([gate, up], dim=1) if gated else gate)
    rh = torch.arange(hidden)[:, None] // 16
    ci = torch.arange(intermediate)[None, :] // 16
    w2 = noisy((0.2 + ((rh + ci) % 4).float() / 3) * e)
    return w13, w2


def sample_layer(
    fmt: str = "mxfp8", experts: int = 4, intermediate: int = 128, hidden: int = 256, gated: bool = True, seed: int = 0
) -> ExpertTensors:
    """A seeded layer of structured expert weights, quantized to ``fmt`` (a ``plan_layer`` format).

    W13 ``(E, 2I, H)``: gate rows grow down the rows, up rows grow across the columns, and
    expert ``e`` is ``e + 1`` times larger; W2 ``(E, H, I)`` has diagonal bands. Gate and up
    are quantized separately (own block scales / global scales, as real checkpoints). Sizes
    must meet the format's blocks (multiples of 32; of 128 for fp8-block).
    """
    from fimoe_lab.checkpoints import MoELayer

    if fmt not in PLAN_FORMATS:
        raise FormatError(f"no sample layer for format {fmt!r}", fix=f"choose one of {', '.join(PLAN_FORMATS)}")
    w13, w2 = _structured(experts, intermediate, hidden, gated, seed)
    source = f"sample_layer({fmt!r}, experts={experts}, intermediate={intermediate}, hidden={hidden}, seed={seed})"
    kw = dict(intermediate=intermediate, hidden=hidden, is_act_and_mul=gated, is_gated=gated, convention="seeded")
    spec = get_format(fmt)
    if spec.codec is None:  # unquantized
        return ExpertTensors(MoELayer(fmt, w13.bfloat16(), w2.bfloat16(), None, None, **kw), source)
    per_tensor = spec.scale_block == 0  # one scale for the whole W13
    parts = [spec.quantize(p) for p in (w13.split(intermediate, dim=1) if gated and not per_tensor else (w13,))]
    q2 = spec.quantize(w2)
    values = torch.cat([q.values for q in parts], dim=1)
    scales = parts[0].scales if per_tensor else torch.cat([q.scales for q in parts], dim=1)
    extras = {}
    if q2.global_scale is not None:  # NVFP4: the checkpoint stores the decode scale 1/global
        extras = {
            "w13_weight_scale_2": torch.stack([1 / q.global_scale for q in parts], dim=1),
            "w2_weight_scale_2": 1 / q2.global_scale,
        }
    return ExpertTensors(MoELayer(fmt, values, q2.values, scales, q2.scales, extras=extras, **kw), source)


def sample_names() -> list[str]:
    """The shipped sample checkpoints (``fimoe_lab/data/samples/<name>``), for :func:`load_layer`."""
    return _require("fimoe_lab.checkpoints", "sample checkpoints").sample_names()


LAYERS_KEPT = 16
"""Opened layers :func:`load_layer` keeps (each its shapes and plans: a few kB; their data is in the shared caches)."""
_LOADED: OrderedDict = OrderedDict()


def load_layer(source: str, layer: Optional[int] = None, tp_size: int = 1, tp_rank: int = 0) -> ExpertTensors:
    """MoE ``layer`` (default: the first) of a checkpoint, for TP rank ``tp_rank`` of ``tp_size``.

    ``source`` is a shipped sample name (:func:`sample_names`) or a checkpoint directory
    (``config.json`` + safetensors shards); read through :mod:`fimoe_lab.checkpoints`.
    Lazy: every tensor's presence, dtype and shape is checked from the file headers, and nothing
    else is read until a view asks for one expert (:meth:`ExpertTensors.expert`). The same
    checkpoint (any spelling of its path), layer and TP slice gives the same object.
    """
    checkpoints = _require("fimoe_lab.checkpoints", "reading a checkpoint")
    path = checkpoints.sample_path(source) if source in checkpoints.sample_names() else Path(source)
    real = Path(os.path.realpath(path))
    if real.is_file():
        real = real.parent
    try:
        stamp = tuple(os.stat(real / f).st_mtime_ns for f in ("config.json",) if (real / f).exists())
    except OSError:
        stamp = ()
    return lru_get(
        _LOADED,
        (str(real), stamp, layer, tp_size, tp_rank),
        lambda: _open_layer(checkpoints, source, real, stamp, layer, tp_size, tp_rank),
        LAYERS_KEPT,
    )


def _open_layer(
    checkpoints: Any, source: str, path: Path, stamp: tuple, layer: Optional[int], tp_size: int, tp_rank: int
) -> ExpertTensors:
    """:func:`load_layer`'s lazy layer: shapes checked now, experts read on demand, each read closing the
    memory-mapped shards after it (the pages it touched are not kept mapped)."""
    ckpt = checkpoints.open_checkpoint(path)
    index = ckpt.moe_layers[0] if layer is None else layer
    shapes = ckpt.read_layer(index, tp_size, tp_rank, load="none")
    ckpt.close()

    def read(experts: Optional[tuple[int, int]]) -> Any:
        try:
            return ckpt.read_layer(index, tp_size, tp_rank, experts=experts)
        finally:
            ckpt.close()

    where = f"{source} layer {index}" + (f", TP rank {tp_rank} of {tp_size}" if tp_size > 1 else "")
    return ExpertTensors(
        shapes,
        f"{where} ({shapes.convention}, {shapes.fmt}, {shapes.num_experts} experts)",
        read,
        key=(str(path), stamp, index, tp_size, tp_rank),
    )


def diagnosis_inputs(layer: ExpertTensors, dump: str | os.PathLike[str], count: int) -> tuple[Any, dict]:
    """What :func:`fimoe_lab.diagnose.diagnose` compares, read per expert: ``(moe, dumped)`` with experts
    ``0 .. count-1`` of ``layer`` (:meth:`ExpertTensors.head`; a checkpoint reads only those) and of each
    tensor ``(E, ...)`` of the kernel ``dump`` with the layer's ``E`` experts (a ``.safetensors`` dump reads
    only those; a ``.npy`` one is read whole by :func:`~fimoe_lab.diagnose.load_dump`, with its checks); a
    dumped tensor with another expert count keeps none (``(0, ...)``), so the diagnosis ignores it, as it
    ignores such a tensor of the whole layer. ``diagnose(*diagnosis_inputs(layer, path, n))`` equals
    ``diagnose(layer.moe, load_dump(path))`` for ``n >= diagnose.DEFAULT_EXPERTS`` (it compares the first
    of those experts)."""
    from fimoe_lab import diagnose

    p = Path(dump).expanduser()
    moe = layer.head(count)
    kept = int(moe.num_experts)
    if p.suffix != ".safetensors" or not p.is_file():  # load_dump says what is wrong with anything else
        return moe, {
            n: t[:kept] if t.ndim and t.shape[0] == layer.experts else t[:0] for n, t in diagnose.load_dump(p).items()
        }
    from fimoe_lab.checkpoints.safe_io import open_safetensors

    dumped = {}
    with open_safetensors(p, "dump of kernel tensors") as f:
        for name in f.keys():
            part = f.get_slice(name)
            shape = part.get_shape()
            if not shape:
                dumped[name] = f.get_tensor(name)
            else:
                dumped[name] = part[:kept] if shape[0] == layer.experts else part[:1][:0]
    return moe, dumped


def preset_names() -> list[str]:
    """Model preset names known to :mod:`fimoe_lab.presets` (empty when it is not installed)."""
    try:
        presets = _require("fimoe_lab.presets", "model presets")
    except LabUnavailable:
        return []
    return sorted(presets.PRESETS)


def tuner_choices() -> tuple[list[str], list[str]]:
    """``(GPU names, engine profile names)`` the tuner knows (empty when it is not installed)."""
    try:
        cost = _require("fimoe_lab.tune.cost", "the tuner view")
    except LabUnavailable:
        return [], []
    from fimoe_lab.engines import ENGINES

    return sorted(cost.GPUS), sorted(ENGINES)


def tactic_sweep(preset: str, fmt: str, tp: int, mode: str = "snapshot", **kwargs: Any):
    """The tuner's table for ``preset`` in ``fmt`` at tensor-parallel size ``tp``.

    A pandas DataFrame, one row per (``inter_align``, ``hidden_align``), with tactic counts
    ``t<T>`` per token count, ``min_tactics``, ``extra_bytes_pct``, ``reference``,
    ``recommended``; see :func:`fimoe_lab.tune.sweep.sweep`. ``mode``: the tactic oracle's
    (``snapshot``: the recorded FlashInfer 0.6.13 answers, fast and offline; ``auto``: live
    where possible). ``kwargs`` go to ``sweep`` (``tokens``, ``per_token``, ``gpu``, ``engine``).
    """
    sweep = _require("fimoe_lab.tune.sweep", "the tuner view")
    oracle = _require("fimoe_lab.tune.oracle", "the tuner view")
    return sweep.sweep(preset, fmt, tp, oracle=oracle.TacticOracle(mode), **kwargs)
