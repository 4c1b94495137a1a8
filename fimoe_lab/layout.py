"""The index map: one expert's layout transform as a value.

Every weight or scale preparation step that FlashInfer's fused-MoE kernels need is a
pure gather on one expert's byte matrix, ``out[i] = in[src[i]]``, where ``src[i] < 0``
means "fill" (padding). The map depends only on the per-expert shape and the step's
parameters, so one map serves every expert of every layer of that shape.

The map is stored over *cells*: runs of ``cell_bytes`` contiguous bytes that move
together (a whole row for a row permutation, 128 bytes for block-major-K, one scale
for the 128x4 swizzle). Two maps with different cell sizes are composed on the
greatest common cell of the widest forms known of them (a coarsened map, or the form
over 4 scales the swizzle of 1-byte scales is built from: the composition of a
plan's scale steps then holds half to a quarter of the cells it would over bytes);
:meth:`IndexMap.coarsened` finds the widest cell a map allows, which is what lets an
executor move 8- or 16-byte words instead of single bytes.

Fill codes: ``src[i] = -1 - k`` fills output cell ``i`` with byte ``fills[k]``
repeated (0 for padded weights, 127 = UE8M0 1.0 for padded MXFP8 scales).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from functools import reduce
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from fimoe_lab.errors import LayoutError

if TYPE_CHECKING:
    from fimoe_lab.kernels.compiled import ExecMap

__all__ = ["IndexMap", "LayoutError", "Provenance", "compose", "step_name"]


def step_name(kind: str, params: Mapping[str, Any]) -> str:
    """Display name of a step: ``kind(key=value, ...)``, or ``kind`` alone without parameters."""
    if not params:
        return kind
    if kind == "inverse":
        return f"{kind}({params['of']})"
    return f"{kind}({', '.join(f'{k}={v}' for k, v in params.items())})"


def _prod(shape: Iterable[int]) -> int:
    return int(math.prod(shape))


def _unravel(offset: int, shape: Sequence[int]) -> tuple[int, ...]:
    coords = []
    for dim in reversed(shape):
        coords.append(offset % dim)
        offset //= dim
    return tuple(reversed(coords))


_PROBES = 1024
"""Cell pairs :func:`_probed_cell_gcd` looks at before :meth:`IndexMap.coarsened` reads the whole index."""


def _probed_cell_gcd(src: np.ndarray, g: int) -> int:
    """``g`` reduced by the breaks among :data:`_PROBES` cell pairs ``(i - 1, i)`` spread over ``src``: the gcd
    with each such ``i`` where a run breaks and with the source starting a live run there (and with
    ``src[0]``). Every break found is one :meth:`IndexMap.coarsened` finds, so the widest cell divides the
    result; 1 means the map does not coarsen, found without a pass over ``src``."""
    n = src.size
    if g <= 1 or n < 2:
        return g
    i = np.linspace(1, n - 1, num=min(n - 1, _PROBES), dtype=np.int64)
    prev, cur = src[i - 1], src[i]
    brk = np.where(cur >= 0, (prev < 0) | (cur != prev + 1), cur != prev)
    for v in (i[brk], cur[brk & (cur >= 0)], src[:1][src[:1] >= 0]):
        if v.size:
            g = math.gcd(g, int(np.gcd.reduce(v)))
    return g


@dataclass(frozen=True)
class ProvenanceStage:
    """Where one output byte sits before one step (``coords`` in bytes)."""

    step: str
    shape: tuple[int, ...]
    coords: tuple[int, ...] | None
    fill: int | None = None


@dataclass(frozen=True)
class Provenance:
    """The chain of positions of one output byte, from the output back to the input.

    ``stages[0]`` is the position in the final output, ``stages[-1]`` the position in
    the input (or the step that produced it as fill). Coordinates are in bytes; see
    :meth:`in_elements` for element coordinates of a given dtype.
    """

    stages: tuple[ProvenanceStage, ...]

    @property
    def source(self) -> tuple[int, ...] | None:
        """Byte coordinates in the input, or None when the byte is padding."""
        return self.stages[-1].coords

    @property
    def is_fill(self) -> bool:
        return self.stages[-1].fill is not None

    def in_elements(self, itemsize: int) -> Provenance:
        """Same chain with the last coordinate divided by ``itemsize``."""

        def conv(s: ProvenanceStage) -> ProvenanceStage:
            if s.coords is None:
                return s
            shape = s.shape[:-1] + (s.shape[-1] // itemsize,)
            return ProvenanceStage(s.step, shape, s.coords[:-1] + (s.coords[-1] // itemsize,), s.fill)

        return Provenance(tuple(conv(s) for s in self.stages))

    def __str__(self) -> str:
        lines = []
        for s in self.stages:
            where = f"fill byte {s.fill:#04x}" if s.fill is not None else str(s.coords)
            lines.append(f"{s.step:<44} {str(s.shape):<22} {where}")
        return "\n".join(lines)


@dataclass(frozen=True, eq=False)
class IndexMap:
    """``out[i] = in[src[i]]`` over cells of ``cell_bytes`` bytes, for one expert.

    Attributes:
        src: int64 CPU tensor of shape ``(n_out_cells,)``; ``src[i] >= 0`` is an input
            cell, ``src[i] = -1 - k`` fills the cell with byte ``fills[k]``.
        fills: fill byte values referenced by negative codes; a map with fill cells given none
            fills with zeros (``fills`` becomes ``(0,)``).
        cell_bytes: bytes per cell.
        in_shape / out_shape: the per-expert matrix shapes in **bytes** (last dim in
            bytes). A tensor of dtype with itemsize ``s`` has last dim ``shape[-1] / s``.
        kind: what the step is (a constructor name in :mod:`fimoe_lab.steps` for a
            primitive step, ``"chain"`` for a composition, ``"inverse"`` for an inverse).
        params: the arguments that rebuild the step (``steps.build(kind, **params)``),
            JSON scalars only; ``name`` is derived from ``kind`` and ``params``.
        parts: the primitive steps in application order (empty for a primitive).

    Equality is by what the map does (:meth:`__eq__`); the hash is over the shapes, so
    it agrees with equality.
    """

    src: torch.Tensor
    cell_bytes: int
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    fills: tuple[int, ...] = ()
    kind: str = "map"
    params: Mapping[str, Any] = field(default_factory=dict)
    parts: tuple[IndexMap, ...] = ()
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def name(self) -> str:
        """For display: the step with its parameters, or the chain of steps joined by ``>>``."""
        if self.parts:
            return " >> ".join(p.name for p in self.parts)
        return step_name(self.kind, self.params)

    def spec(self) -> list[dict[str, Any]]:
        """The primitive steps as ``[{"kind": ..., "params": {...}}, ...]`` (what converted files record)."""
        return [{"kind": s.kind, "params": dict(s.params)} for s in self.steps]

    def _with(self, src: torch.Tensor, cell_bytes: int, fills: tuple[int, ...] | None = None) -> IndexMap:
        """The same step (kind, params, parts, shapes) over other cells."""
        return IndexMap(
            src,
            cell_bytes,
            self.in_shape,
            self.out_shape,
            self.fills if fills is None else fills,
            self.kind,
            self.params,
            self.parts,
        )

    def __post_init__(self) -> None:
        if self.src.dtype != torch.int64 or self.src.ndim != 1 or self.src.device.type != "cpu":
            raise TypeError(
                f"{self.name}: src must be a 1-D int64 CPU tensor, got {self.src.dtype} {tuple(self.src.shape)} on {self.src.device}"
            )
        if self.in_bytes % self.cell_bytes or self.out_bytes != self.src.numel() * self.cell_bytes:
            raise LayoutError(
                f"{self.name}: shapes {self.in_shape} -> {self.out_shape} bytes do not tile into "
                f"{self.src.numel()} cells of {self.cell_bytes} bytes"
            )
        if not self.fills and self._has_fill:  # fill cells and no fill bytes listed: zeros, named as such, so that
            object.__setattr__(self, "fills", (0,))  # a composition's renumbered codes keep meaning zero

    # ---------------------------------------------------------------- sizes
    @property
    def in_bytes(self) -> int:
        return _prod(self.in_shape)

    @property
    def out_bytes(self) -> int:
        return _prod(self.out_shape)

    @property
    def n_in_cells(self) -> int:
        return self.in_bytes // self.cell_bytes

    @property
    def n_out_cells(self) -> int:
        return self.out_bytes // self.cell_bytes  # src.numel(), without reading an index built when read

    @property
    def steps(self) -> tuple[IndexMap, ...]:
        """The primitive steps, in application order (itself for a primitive)."""
        return self.parts or (self,)

    @property
    def is_permutation(self) -> bool:
        """True when the map moves every byte exactly once (no fill, same size); where its compiled form already
        knows (found, or read with a stored plan: :meth:`built_on_read`), without reading the index."""
        if "is_permutation" not in self._cache:
            em = self._cache.get("exec")
            known = em.known_permutation() if em is not None else None
            self._cache["is_permutation"] = (
                known
                if known is not None
                else self.in_bytes == self.out_bytes
                and not self._has_fill
                and bool((np.bincount(self.src.numpy(), minlength=self.n_out_cells) == 1).all())
            )
        return cast(bool, self._cache["is_permutation"])

    def __repr__(self) -> str:
        chain = " >> ".join(p.name for p in self.steps)
        pad = int((self.src < 0).sum()) * self.cell_bytes
        return f"IndexMap({chain}: {self.in_shape} -> {self.out_shape} bytes, cell {self.cell_bytes} B, {pad} B fill)"

    # ------------------------------------------------------------ granularity
    def refined(self, cell_bytes: int) -> IndexMap:
        """The same map over smaller cells (``cell_bytes`` must divide the current size)."""
        if cell_bytes == self.cell_bytes:
            return self
        if self.cell_bytes % cell_bytes:
            raise LayoutError(f"{self.name}: cannot refine {self.cell_bytes}-byte cells to {cell_bytes}")
        f = self.cell_bytes // cell_bytes
        s = self.src.numpy()
        # numpy, single-threaded: plans are built from small index tensors many times
        src = np.empty((s.size, f), dtype=np.int64)
        np.add((s * f)[:, None], np.arange(f, dtype=np.int64), out=src)  # one write of the refined index
        if self._has_fill:
            fill = s < 0
            src[fill] = s[fill, None]
        out = self._with(torch.from_numpy(src.reshape(-1)), cell_bytes)
        out._cache["has_fill"] = self._has_fill
        return out

    @property
    def _has_fill(self) -> bool:
        """True when some output cell is fill (``src < 0``); cached."""
        if "has_fill" not in self._cache:
            self._cache["has_fill"] = bool(self.src.numel()) and int(self.src.numpy().min()) < 0
        return cast(bool, self._cache["has_fill"])

    def coarsened(self) -> IndexMap:
        """The same map over the widest cells it allows.

        Output cells are grouped ``f`` at a time when every group copies ``f``
        consecutive, ``f``-aligned input cells, or is all one fill: then the group moves
        as one wide cell. ``f`` is the gcd of the cell counts, of every position where a
        run of consecutive sources breaks, and of the source index at each break.
        """
        if "coarse" not in self._cache:
            self._cache["coarse"] = self._widest_known()._coarsen()
        return cast(IndexMap, self._cache["coarse"])

    @classmethod
    def refined_on_read(cls, wide: IndexMap, cell_bytes: int) -> IndexMap:
        """``wide.refined(cell_bytes)`` whose index is built when ``src`` is first read. For a constructor that
        builds its map over wider cells (the 128x4 and 8x4 swizzles of 1-byte scales): compositions and
        coarsening take the wider form (:meth:`_widest_known`), so a plan's first call never builds the finer
        index (four times the cells)."""
        if wide.cell_bytes % cell_bytes:
            raise LayoutError(f"{wide.name}: cannot refine {wide.cell_bytes}-byte cells to {cell_bytes}")
        m = cls.__new__(cls)
        for f in fields(cls):
            if f.name not in ("src", "cell_bytes", "_cache"):
                object.__setattr__(m, f.name, getattr(wide, f.name))
        object.__setattr__(m, "cell_bytes", cell_bytes)
        object.__setattr__(m, "_cache", {"wider": wide, "has_fill": wide._has_fill})
        return m

    if not TYPE_CHECKING:  # at run time only: type checkers keep every other attribute checked

        def __getattr__(self, name: str) -> Any:
            """``src`` of a map from :meth:`refined_on_read`, :meth:`composed_on_read`, :meth:`rows_on_read` or
            :meth:`built_on_read`, built on this first read."""
            cache = self.__dict__.get("_cache", {}) if name == "src" else {}
            if "build" in cache:
                src = self._built_index(cache["build"]())
                object.__setattr__(self, "src", src)
                return src
            if "rows" in cache:
                src = torch.from_numpy(self._rows_index())
                object.__setattr__(self, "src", src)
                return src
            if "operands" in cache:
                ops = cache["operands"]  # composed last to first: row steps over whole rows before a padding
                built = reduce(lambda later, a: a.then(later), reversed(ops[:-1]), ops[-1])  # wider if coarsened
                if built.cell_bytes % self.cell_bytes == 0 and built.fills == self.fills:
                    built = built.refined(self.cell_bytes)
                else:
                    raise LayoutError(
                        f"internal: {self.name} composed over {built.cell_bytes}-byte cells with fills {built.fills}, "
                        f"not the {self.cell_bytes} and {self.fills} it declared"
                    )
                src = built.src
                cache.setdefault("has_fill", built._has_fill)
                object.__setattr__(self, "src", src)
                return src
            wide = cache.get("wider")
            if wide is None:
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            src = wide.refined(self.cell_bytes).src
            object.__setattr__(self, "src", src)
            return src

    @classmethod
    def built_on_read(
        cls,
        build: Callable[[], IndexMap],
        cell_bytes: int,
        in_shape: tuple[int, ...],
        out_shape: tuple[int, ...],
        fills: tuple[int, ...],
        kind: str,
        params: Mapping[str, Any],
        parts: tuple[IndexMap, ...] = (),
        compiled: Callable[[IndexMap], ExecMap] | None = None,
    ) -> IndexMap:
        """A map declared by its fields, its index taken from ``build()`` (the same map, built again: e.g. from its
        steps' kinds and parameters) when ``src`` is first read, over the ``cell_bytes`` declared here. For a map
        whose compiled form is known without its index (``compiled(m)``, kept as :meth:`compiled`'s;
        :mod:`fimoe_lab.plan_store`): its executors read that form, and only what needs the index (a cycle plan, a
        row form, :meth:`inverse`) builds it."""
        m = cls.__new__(cls)
        declared = dict(
            cell_bytes=cell_bytes,
            in_shape=tuple(in_shape),
            out_shape=tuple(out_shape),
            fills=tuple(fills),
            kind=kind,
            params=params,
            parts=tuple(parts),
            _cache={"build": build},
        )
        for key, value in declared.items():
            object.__setattr__(m, key, value)
        if m.in_bytes % cell_bytes or m.out_bytes % cell_bytes:
            raise LayoutError(
                f"{m.name}: shapes {m.in_shape} -> {m.out_shape} do not tile into {cell_bytes}-byte cells"
            )
        if compiled is not None:
            m._cache["exec"] = compiled(m)
        return m

    def _built_index(self, built: IndexMap) -> torch.Tensor:
        """The index of a :meth:`built_on_read` map from the map ``built`` again: over the declared cells (refined
        from ``built``'s cells, or from its widest ones where the declared cell is wider)."""
        if built.in_shape != self.in_shape or built.out_shape != self.out_shape or built.fills != self.fills:
            raise LayoutError(
                f"internal: {self.name} was built again as {built.in_shape} -> {built.out_shape} bytes with fills "
                f"{built.fills}, not the {self.in_shape} -> {self.out_shape} and {self.fills} it declared"
            )
        if built.cell_bytes % self.cell_bytes:
            built = built.coarsened()
            if built.cell_bytes % self.cell_bytes:
                raise LayoutError(
                    f"internal: {self.name} was built again over {built.cell_bytes}-byte cells at widest, "
                    f"not the {self.cell_bytes} it declared"
                )
        return built.refined(self.cell_bytes).src

    @classmethod
    def rows_on_read(
        cls,
        rows: np.ndarray,
        in_rows: int,
        cols_bytes: int,
        padded_cols_bytes: int,
        fill: int,
        kind: str,
        params: Mapping[str, Any],
    ) -> IndexMap:
        """``[in_rows, cols_bytes] -> [len(rows), padded_cols_bytes]``: output row ``r`` is input row ``rows[r]``'s
        bytes then byte ``fill`` on the right, or (``rows[r] < 0``) all ``fill``; over cells of
        ``gcd(cols_bytes, padded_cols_bytes)`` bytes, the index built when ``src`` is first read. Until then
        :meth:`right_padded_rows` is the table itself and :meth:`sources_at` reads it, so a compiler that
        works from row tables never builds the index (a padding's: the finest cells of a plan's first call)."""
        rows = np.asarray(rows, dtype=np.int64)
        table = np.where(rows >= 0, rows, -1 - fill)
        padded = padded_cols_bytes > cols_bytes and bool((rows >= 0).any())  # some live row padded on the right
        has_fill = bool(padded_cols_bytes > cols_bytes or (rows < 0).any())
        m = cls.__new__(cls)
        declared = dict(
            cell_bytes=math.gcd(cols_bytes, padded_cols_bytes),
            in_shape=(in_rows, cols_bytes),
            out_shape=(rows.size, padded_cols_bytes),
            fills=(fill,),
            kind=kind,
            params=params,
            parts=(),
            _cache={"rows": table, "right padded rows": (table, fill if padded else None), "has_fill": has_fill},
        )
        for key, value in declared.items():
            object.__setattr__(m, key, value)
        return m

    def _rows_index(self) -> np.ndarray:
        """The index of a :meth:`rows_on_read` map, from its row table."""
        rows = self._cache["rows"]
        (_, c_in), (r_out, c_out) = self.in_shape, self.out_shape
        k_in, k_out = c_in // self.cell_bytes, c_out // self.cell_bytes
        src = np.full((r_out, k_out), -1, dtype=np.int64)
        live = rows >= 0
        src[live, :k_in] = rows[live, None] * k_in + np.arange(k_in, dtype=np.int64)
        return src.reshape(-1)

    @classmethod
    def composed_on_read(cls, maps: Sequence[IndexMap]) -> IndexMap:
        """``reduce(IndexMap.then, maps)`` whose index is built when ``src`` is first read.

        Everything but the index is known from the operands: the cell is the gcd of their widest known
        cells and the fills are theirs, each byte once, in order (what :meth:`then` gives, checked when
        the index is built). Until then :meth:`sources_at` traces single cells through the operands, so a
        compiler that runs a plan's scale maps as two strided stages never builds the whole composition
        over the finest cells (:func:`fimoe_lab.compile.compile_map`)."""
        for a, b in zip(maps, maps[1:]):
            if a.out_bytes != b.in_bytes:
                raise LayoutError(
                    f"cannot compose {a.name} (out {a.out_shape} bytes) with {b.name} "
                    f"(in {b.in_shape} bytes): byte counts {a.out_bytes} != {b.in_bytes}"
                )
            wide = b._widest_known()
            if "src" in vars(wide) and wide.src.numel() and int(wide.src.numpy().max()) >= wide.n_in_cells:
                raise LayoutError(
                    f"{b.name} reads past the {wide.n_in_cells} cells of {a.name}'s output",
                    fix="build each map with sources below its input's cell count",
                )
        m = cls.__new__(cls)
        declared = dict(
            cell_bytes=reduce(math.gcd, (op._widest_known().cell_bytes for op in maps)),
            in_shape=maps[0].in_shape,
            out_shape=maps[-1].out_shape,
            fills=tuple(dict.fromkeys(f for op in maps for f in op.fills)),
            kind="chain",
            params={},
            parts=tuple(p for op in maps for p in op.steps),
            _cache={"operands": tuple(maps)},
        )
        for key, value in declared.items():
            object.__setattr__(m, key, value)
        return m

    @property
    def index_pending(self) -> bool:
        """True for a map from :meth:`composed_on_read` or :meth:`rows_on_read` whose index is not built yet."""
        return "src" not in vars(self) and ("operands" in self._cache or "rows" in self._cache)

    def sources_at(self, cells: np.ndarray) -> np.ndarray:
        """int64 ``src[cells]``; a map whose index is pending traces each cell through its operands
        and builds nothing (a cell of the gcd width moves whole through every operand)."""
        if not self.index_pending:
            built: np.ndarray = self.src.numpy()[cells]
            return built
        at = self._probe_bytes(np.asarray(cells, dtype=np.int64) * self.cell_bytes)
        code = np.zeros(256, dtype=np.int64)
        code[list(self.fills)] = -1 - np.arange(len(self.fills), dtype=np.int64)
        return np.where(at >= 0, at // self.cell_bytes, code[np.maximum(-1 - at, 0)])

    def _widest_known(self) -> IndexMap:
        """This map over the widest cells known without a pass over its index: :meth:`coarsened` once
        found, else the wider form its constructor recorded (``_cache["wider"]``, e.g. the 128x4
        swizzle of 1-byte scales over 4-byte cells), else itself. Coarsening any of them gives the same
        map: a form ``k`` times wider has ``k`` times fewer breaks, sources and cells, so the same widest
        cell."""
        return cast(IndexMap, self._cache.get("coarse") or self._cache.get("wider") or self)

    def _coarsen(self) -> IndexMap:
        src = self.src.numpy()
        n = src.size
        if n == 0:
            return self
        g = _probed_cell_gcd(src, math.gcd(n, self.n_in_cells))
        if g <= 1:
            return self
        step = np.diff(src)
        brk = step != 1  # a break between cells i and i+1: not the next source ...
        if self._has_fill:  # ... except that a fill cell after the same fill continues its run, and a
            # live cell after fill breaks it (the only pairs with a fill cell: a few passes over those)
            fill = np.flatnonzero(src < 0)
            after = fill[fill > 0]
            brk[after - 1] = step[after - 1] != 0
            before = fill[fill < n - 1]
            brk[before[src[before + 1] >= 0]] = True
        breaks = np.flatnonzero(brk) + 1
        vals = src[np.concatenate([[0], breaks])]
        if breaks.size:
            g = math.gcd(g, int(np.gcd.reduce(breaks)))
        pos = vals[vals >= 0]
        if pos.size:
            g = math.gcd(g, int(np.gcd.reduce(pos)))
        if g <= 1:
            return self
        head = src.reshape(-1, g)[:, 0]
        src_c = np.where(head >= 0, head // g, head) if self._has_fill else head // g
        return self._with(torch.from_numpy(src_c), self.cell_bytes * g)

    # ------------------------------------------------------------ algebra
    def then(self, other: IndexMap) -> IndexMap:
        """The map that applies ``self`` and then ``other`` (one gather, not two), over the greatest
        common cell of the two maps' widest known forms (:meth:`_widest_known`)."""
        if self.out_bytes != other.in_bytes:
            raise LayoutError(
                f"cannot compose {self.name} (out {self.out_shape} bytes) with {other.name} "
                f"(in {other.in_shape} bytes): byte counts {self.out_bytes} != {other.in_bytes}"
            )
        left, right = self._widest_known(), other._widest_known()
        cell = math.gcd(left.cell_bytes, right.cell_bytes)
        a_src, bs, k = left.refined(cell).src.numpy(), right.src.numpy(), right.cell_bytes // cell
        fills = left.fills + right.fills
        unique = tuple(dict.fromkeys(fills))
        # ``other``'s fill code -1-j names fills[len(left.fills) + j]; renumbered here to ``unique`` when
        # that is one shift (a fill byte both maps use), else by the pass of ``_deduped_fills``
        shifts = {unique.index(v) - j for j, v in enumerate(right.fills)} if right._has_fill else set()
        one_shift = len(set(left.fills)) == len(left.fills) and len(shifts) <= 1
        shift = shifts.pop() if one_shift and shifts else len(left.fills)
        if bs.size and (int(bs.max()) + 1) * k > a_src.size:
            raise LayoutError(
                f"{other.name} reads past the {a_src.size} cells of {self.name}'s output",
                fix="build each map with sources below its input's cell count",
            )
        if a_src.size:
            # output cell (i, j) of ``other``'s cell i reads cell bs[i]*k + j of ``self``'s output: row bs[i] of
            # that output as rows of k cells, one row gather (``wrap``: no bounds buffer; a fill code's row is
            # overwritten below)
            cols = np.take(a_src.reshape(-1, k), bs, axis=0, mode="wrap")
            if right._has_fill:
                fill = bs < 0
                cols[fill] = (bs[fill] - shift)[:, None]
            src = cols.reshape(-1)
        else:  # every output cell is fill (a source would have read past the end)
            src = np.repeat(bs - shift, k)
        parts = self.steps + other.steps
        if one_shift:
            return IndexMap(torch.from_numpy(src), cell, self.in_shape, other.out_shape, unique, "chain", {}, parts)
        return IndexMap(
            torch.from_numpy(src), cell, self.in_shape, other.out_shape, fills, "chain", {}, parts
        )._deduped_fills()

    def __rshift__(self, other: IndexMap) -> IndexMap:
        return self.then(other)

    def _deduped_fills(self) -> IndexMap:
        if len(set(self.fills)) == len(self.fills):
            return self
        unique = tuple(dict.fromkeys(self.fills))
        remap = np.array([-1 - unique.index(v) for v in self.fills], dtype=np.int64)
        s = self.src.numpy()
        src = np.where(s >= 0, s, remap[np.maximum(-1 - s, 0)])
        return self._with(torch.from_numpy(src), self.cell_bytes, unique)

    def inverse(self) -> IndexMap:
        """The map from this map's output back to its input.

        Exact on the non-fill part: ``m.inverse().apply(m.apply(x))`` equals ``x`` when
        every input cell reaches the output once; padding is dropped. Input cells a map
        drops (a crop) come back as zero fill. Maps that copy a cell twice do not invert.
        """
        valid = self.src >= 0
        taken = self.src[valid]
        counts = torch.bincount(taken, minlength=self.n_in_cells)
        if bool((counts > 1).any()):
            raise LayoutError(
                f"{self.name} is not invertible: {int((counts > 1).sum())} input cells are copied more than "
                f"once, so the output does not say which copy to take back"
            )
        inv = torch.full((self.n_in_cells,), -1, dtype=torch.int64)
        inv[taken] = torch.nonzero(valid).flatten()
        fills = (0,) if bool((counts == 0).any()) else ()
        parts = tuple(p.inverse() for p in reversed(self.parts))
        if parts:
            return IndexMap(inv, self.cell_bytes, self.out_shape, self.in_shape, fills, "chain", {}, parts)
        return IndexMap(inv, self.cell_bytes, self.out_shape, self.in_shape, fills, "inverse", {"of": self.name})

    def __eq__(self, other: object) -> bool:
        """Two maps are equal when they move every byte to the same place (and fill alike)."""
        if not isinstance(other, IndexMap):
            return NotImplemented
        if self is other:
            return True
        if self.in_shape != other.in_shape or self.out_shape != other.out_shape:
            return False
        probe = np.linspace(0, self.out_bytes - 1, num=min(self.out_bytes, 257), dtype=np.int64)
        if not np.array_equal(self._probe_bytes(probe), other._probe_bytes(probe)):
            return False  # cheap reject: caches compare maps of equal shapes on lookup
        cell = math.gcd(self.cell_bytes, other.cell_bytes)
        a, b = self.refined(cell), other.refined(cell)
        if not torch.equal(a.src >= 0, b.src >= 0):
            return False
        if not torch.equal(torch.where(a.src >= 0, a.src, 0), torch.where(b.src >= 0, b.src, 0)):
            return False
        fa = torch.tensor(a.fills or (0,), dtype=torch.int64)[(-1 - a.src).clamp(min=0)]
        fb = torch.tensor(b.fills or (0,), dtype=torch.int64)[(-1 - b.src).clamp(min=0)]
        mask = a.src < 0
        return bool(torch.equal(fa[mask], fb[mask]))

    def _probe_bytes(self, at: np.ndarray) -> np.ndarray:
        """Source byte of each output byte offset ``at`` (fill byte ``v``: ``-1 - v``); traced through the
        operands while the index is pending."""
        if self.index_pending and "rows" in self._cache:
            (_, c_in), c_out = self.in_shape, self.out_shape[1]
            source = self._cache["rows"][at // c_out]
            col = at % c_out
            return np.where((source >= 0) & (col < c_in), source * c_in + col, -1 - self.fills[0])
        if self.index_pending:
            at = np.array(at, dtype=np.int64)
            for op in reversed(self._cache["operands"]):
                live = at >= 0
                at[live] = op._probe_bytes(at[live])
            return at
        if self._widest_known() is not self:  # the same bytes through the wider form (its index is built)
            return self._widest_known()._probe_bytes(at)
        s = self.src.numpy()[at // self.cell_bytes]
        fills = np.array(self.fills or (0,), dtype=np.int64)
        out: np.ndarray = np.where(
            s >= 0, s * self.cell_bytes + at % self.cell_bytes, -1 - fills[np.maximum(-1 - s, 0)]
        )
        return out

    def __hash__(self) -> int:
        return hash((self.in_shape, self.out_shape))

    # ------------------------------------------------------------ inspection
    def provenance(self, index: int | Sequence[int]) -> Provenance:
        """Where output byte ``index`` comes from, through every step.

        ``index`` is a flat byte offset into one expert's output or a coordinate tuple
        in ``out_shape`` (bytes). Returns the positions before each step, last = input.
        """
        if isinstance(index, int):
            pos = index
        else:
            if len(index) != len(self.out_shape) or any(not 0 <= c < d for c, d in zip(index, self.out_shape)):
                raise LayoutError(f"coordinate {tuple(index)} is outside the output shape {self.out_shape} (bytes)")
            pos = int(np.ravel_multi_index(tuple(index), self.out_shape))
        if not 0 <= pos < self.out_bytes:
            raise LayoutError(f"byte offset {pos} is outside the output of {self.out_bytes} bytes")
        steps = self.steps
        stages = [
            ProvenanceStage(f"output of {steps[-1].name}", steps[-1].out_shape, _unravel(pos, steps[-1].out_shape))
        ]
        for step in reversed(steps):
            s = int(step.src[pos // step.cell_bytes])
            if s < 0:
                stages.append(ProvenanceStage(f"fill of {step.name}", step.out_shape, None, step.fills[-1 - s]))
                break
            pos = s * step.cell_bytes + pos % step.cell_bytes
            stages.append(ProvenanceStage(f"input of {step.name}", step.in_shape, _unravel(pos, step.in_shape)))
        return Provenance(tuple(stages))

    def row_sources(self) -> torch.Tensor:
        """int64 ``(out_rows,)``: the input row each output row copies (``-1``: a padding row).

        Defined for a 2-D map in which every output row takes its bytes from a single
        input row (padding, swaps, interleaves and shuffles do; a swizzle or a re-tiling
        does not, and raises :class:`LayoutError`). Found once per map (a pass over its
        byte index: milliseconds for a full expert), then cached; each call returns a copy.
        """
        return self._row_sources_found().clone()

    def row_sources_on(self, device: torch.device | str) -> torch.Tensor:
        """:meth:`row_sources` copied to ``device`` once, then kept on the map: one read-only tensor that every
        caller shares (a drop-in hands it to each layer's permute-index dict; a copy from host memory per layer
        would make the host wait for it). Copied straight from the found rows: no CPU tensor operation (a process's
        first one starts torch's CPU thread pool, milliseconds on a drop-in's first call)."""
        key = ("row_sources", str(device))
        if key not in self._cache:
            self._cache[key] = self._row_sources_found().to(device, copy=True)
        return cast(torch.Tensor, self._cache[key])

    def _row_sources_found(self) -> torch.Tensor:
        """The cached :meth:`row_sources` (not a copy: callers copy it), found on the first call."""
        if "row_sources" not in self._cache:
            try:
                self._cache["row_sources"] = self._find_row_sources()
            except LayoutError as exc:
                self._cache["row_sources"] = str(exc)
        found = self._cache["row_sources"]
        if isinstance(found, str):
            raise LayoutError(found)
        return cast(torch.Tensor, found)

    def _find_row_sources(self) -> torch.Tensor:
        if len(self.in_shape) != 2 or len(self.out_shape) != 2:
            raise LayoutError(
                f"{self.name} maps {self.in_shape} -> {self.out_shape} bytes; rows are defined for 2-D maps only"
            )
        (_, in_cols), (out_rows, out_cols) = self.in_shape, self.out_shape
        cell = math.gcd(self.cell_bytes, in_cols, out_cols)
        # numpy: a process's first call (a drop-in's, filling FlashInfer's index dict) pays no torch CPU start-up
        src = self.refined(cell).src.numpy().reshape(out_rows, out_cols // cell)
        src_row = np.where(src >= 0, src * cell // in_cols, -1)
        first = src_row.max(axis=1)
        mixed = ((src_row >= 0) & (src_row != first[:, None])).any(axis=1)
        if mixed.any():
            bad = int(np.flatnonzero(mixed)[0])
            raise LayoutError(f"{self.name}: output row {bad} takes bytes from several input rows; it is not a row map")
        return torch.from_numpy(first)

    def right_padded_rows(self) -> tuple[np.ndarray, int | None] | None:
        """``(rows, column fill byte)`` when this map ``[R_in, C_in] -> [R_out, C_out]`` (``C_out >= C_in``) writes
        each output row as one input row's bytes in order, then one fill byte on the right (the same for every
        such row), or as one fill byte only: ``rows`` int64 ``(R_out,)`` is the source row or ``-1 - b`` for a row
        of fill byte ``b``; the column fill byte is None where no live row is padded. None for any other map.
        A composition whose index is pending composes its steps' tables where they say
        (:meth:`right_padded_rows_of_steps`); otherwise read off the widest known cells that divide a row. Found
        once, then cached (the answer is in rows and bytes, whatever the cells)."""
        if "right padded rows" not in self._cache:
            self._cache["right padded rows"] = self._find_right_padded_rows()
        found: tuple[np.ndarray, int | None] | None = self._cache["right padded rows"]
        return found

    def _find_right_padded_rows(self) -> tuple[np.ndarray, int | None] | None:
        if len(self.in_shape) != 2 or len(self.out_shape) != 2:
            return None
        (_, c_in), (r_out, c_out) = self.in_shape, self.out_shape
        if c_out < c_in:
            return None
        if self.index_pending and self.parts:
            composed = self.right_padded_rows_of_steps()
            if composed is not None:
                return composed
        wide = self._widest_known()
        c = math.gcd(wide.cell_bytes, c_in, c_out)  # cells that divide a row (a swap of halves: cells of many rows)
        wide = wide.refined(c)
        k_in, k_out = c_in // c, c_out // c
        grid = wide.src.numpy().reshape(r_out, k_out)
        probe = grid[np.linspace(0, r_out - 1, num=min(r_out, 64), dtype=np.int64)]  # a cheap refusal first
        if ((probe[:, 1:k_in] >= 0) & (probe[:, 1:k_in] != probe[:, :1] + np.arange(1, k_in))).any():
            return None
        head = grid[:, 0]
        live = head >= 0
        if ((head[live] % k_in) != 0).any():
            return None
        if not np.array_equal(grid[live, :k_in], head[live, None] + np.arange(k_in, dtype=np.int64)):
            return None
        tail, blank = grid[live, k_in:], grid[~live]
        column = int(tail.flat[0]) if tail.size else None
        if column is not None and (column >= 0 or (tail != column).any()):
            return None
        if (blank != blank[:, :1]).any():
            return None
        fills = np.array(wide.fills or (0,), dtype=np.int64)
        rows = np.where(live, head // k_in, -1 - fills[np.maximum(-1 - head, 0)])
        return rows, (wide.fills[-1 - column] if column is not None else None)

    def right_padded_rows_of_steps(self) -> tuple[np.ndarray, int | None] | None:
        """:meth:`right_padded_rows` composed from the steps' own (no index of this map is read or built), or None
        where they do not say: a step that has none, or steps whose paddings are not one byte."""
        return _composed_right_padded_rows(self.steps)

    def row_steps(self) -> IndexMap:
        """The composed leading steps that keep rows as rows (before any re-tiling or swizzle);
        built once per map, then cached."""
        if "row_steps" not in self._cache:
            self._cache["row_steps"] = self._leading_row_steps()
        return cast(IndexMap, self._cache["row_steps"])

    def _leading_row_steps(self) -> IndexMap:
        keep: list[IndexMap] = []
        for step in self.steps:
            try:
                step._row_sources_found()  # no copy: a process's first CPU tensor operation starts torch's threads
            except LayoutError as exc:
                if not keep:
                    raise LayoutError(f"{self.name} starts with a step that does not keep rows as rows: {exc}") from exc
                break
            keep.append(step)
        return compose(*keep)

    def for_row_vectors(self, cols_bytes: int) -> IndexMap:
        """The same row movement on matrices ``cols_bytes`` wide, e.g. a per-row bias.

        A bias ``(E, rows)`` must follow its weight's rows through padding, swaps,
        interleaves and shuffles (re-tiling of the columns does not concern it).
        """
        key = ("row_vectors", cols_bytes)
        if key not in self._cache:
            rows = self.row_steps()
            src = rows.row_sources()
            fills = (0,) if bool((src < 0).any()) else ()
            self._cache[key] = IndexMap(
                src,
                cols_bytes,
                (rows.in_shape[0], cols_bytes),
                (rows.out_shape[0], cols_bytes),
                fills,
                "row_vectors",
                {"cols_bytes": cols_bytes},
            )
        return cast(IndexMap, self._cache[key])

    def source_bytes(self) -> torch.Tensor:
        """int64 ``out_shape`` tensor: the input byte offset of every output byte (-1 = fill)."""
        m = self.refined(1)
        return torch.where(m.src >= 0, m.src, -1).view(self.out_shape)

    # ------------------------------------------------------------ execution
    def fits_experts(self, x: torch.Tensor) -> bool:
        """Whether :meth:`check_experts` passes ``x`` (the check alone, no message built)."""
        return (
            x.ndim >= 2 and x.shape[0] > 0 and _prod(x.shape[1:]) * x.element_size() == self.in_bytes
        ) and x.is_contiguous()

    def check_experts(self, x: torch.Tensor, what: str = "input") -> None:
        """Raise :class:`LayoutError` unless ``x`` is contiguous ``(E, ...)`` with :attr:`in_bytes`
        bytes per expert, in any per-expert shape (flattened ``(E, rows*cols)`` scales pass)."""
        if self.fits_experts(x):
            return
        per_expert = _prod(x.shape[1:]) * x.element_size() if x.ndim >= 2 and x.shape[0] else -1
        if per_expert != self.in_bytes:
            raise LayoutError(
                f"{what} has shape {tuple(x.shape)} ({x.dtype}) = {max(per_expert, 0)} bytes per expert, but "
                f"{self.name} expects (experts, ...) with {self.in_shape} = {self.in_bytes} bytes per expert"
            )
        if not x.is_contiguous():
            raise LayoutError(f"{what} of shape {tuple(x.shape)} is not contiguous", fix="call .contiguous() first")

    def check_input(self, x: torch.Tensor, what: str = "input") -> None:
        """Raise :class:`LayoutError` unless ``x`` is ``(E, *in_shape)`` in bytes and contiguous."""
        size = x.element_size()
        got = tuple(x.shape[1:-1]) + (x.shape[-1] * size,) if x.ndim > 1 else ()
        if got != self.in_shape:
            raise LayoutError(
                f"{what} has shape {tuple(x.shape)} ({x.dtype}, {size} B/element) = (experts, "
                f"{', '.join(map(str, got))}) bytes per expert, but {self.name} expects (experts, "
                f"{', '.join(map(str, self.in_shape))}) bytes per expert"
            )
        if not x.is_contiguous():
            raise LayoutError(f"{what} of shape {tuple(x.shape)} is not contiguous", fix="call .contiguous() first")

    def out_elements(self, itemsize: int) -> tuple[int, ...]:
        """Per-expert output shape in elements of ``itemsize`` bytes."""
        if self.out_shape[-1] % itemsize:
            raise LayoutError(
                f"{self.name}: output last dim of {self.out_shape[-1]} bytes is not a whole number of "
                f"{itemsize}-byte elements; apply it to a uint8 view"
            )
        return self.out_shape[:-1] + (self.out_shape[-1] // itemsize,)

    def compiled(self) -> ExecMap:
        """The executable form the kernels run (:class:`fimoe_lab.kernels.compiled.ExecMap`):
        this map over its widest cells, with its fast forms recognised (:mod:`fimoe_lab.compile`).
        Built on first use, then cached on the map."""
        if "exec" not in self._cache:
            from fimoe_lab.compile import compile_map

            self._cache["exec"] = compile_map(self)
        return cast("ExecMap", self._cache["exec"])

    def known_compiled(self) -> ExecMap | None:
        """The executable form if :meth:`compiled` has built (or been given) it, else None; builds nothing."""
        return cast("ExecMap | None", self._cache.get("exec"))

    def apply(self, x: torch.Tensor, out: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
        """Gather all experts at once: ``(E, *in_shape) -> (E, *out_shape)`` (same dtype).

        Works on any dtype (bytes move); CPU and CUDA. ``out`` may be given to write
        into an existing buffer of the output shape and dtype; it must not overlap ``x``
        (use :meth:`apply_` to transform in place). ``backend`` forces an executor
        (:func:`fimoe_lab.kernels.available_backends`); by default the registry picks.
        """
        from fimoe_lab.kernels import execute

        self.check_input(x)
        shape = (x.shape[0],) + self.out_elements(x.element_size())
        if out is None:
            out = torch.empty(shape, dtype=x.dtype, device=x.device)
        elif tuple(out.shape) != shape or out.dtype != x.dtype or not out.is_contiguous():
            raise LayoutError(
                f"out must be a contiguous {x.dtype} tensor of shape {shape}, got {tuple(out.shape)} {out.dtype}"
            )
        execute(self.compiled(), x, out, backend)
        return out

    def apply_(self, x: torch.Tensor, scratch_experts: int | None = None, backend: str | None = None) -> torch.Tensor:
        """Apply a size-preserving permutation in place with a scratch of a few experts.

        Returns a view of ``x``'s storage with the output shape. Only maps that move
        every byte exactly once (no padding) can run in place. The input is checked
        fully before any byte moves; see :func:`fimoe_lab.kernels.execute_in_place` for
        what is guaranteed if a chunk fails midway.
        """
        from fimoe_lab.kernels import execute_in_place

        self.check_input(x)
        if not self.is_permutation:
            raise LayoutError(
                f"{self.name} pads or drops bytes ({self.in_shape} -> {self.out_shape} bytes), so it "
                f"cannot run in place; use apply() to get a new tensor"
            )
        execute_in_place(self.compiled(), x, scratch_experts, backend)
        return x.view(x.shape[0], -1).view((x.shape[0],) + self.out_elements(x.element_size()))


def _composed_right_padded_rows(ops: Sequence[IndexMap]) -> tuple[np.ndarray, int | None] | None:
    """:meth:`IndexMap.right_padded_rows` of ``ops`` applied in turn, from theirs (no index of the composition is
    built), where each operand has one and they compose into one: an output row read from a padded row keeps its
    bytes and gets the padding of the operands after, so every padding a live row gets (from an operand whose rows
    grow) must be one byte, and a row read from a fill row must get that byte. None where the tables do not say
    (the last operand is asked first: it is the one most likely not to keep rows)."""
    tables = []
    for op in reversed(ops):
        found = op.right_padded_rows()
        if found is None:
            return None
        tables.append(found)
    tables.reverse()
    rows, column = tables[0]  # column: the pad byte of the live rows so far
    for prev, op, (table, byte) in zip(ops, ops[1:], tables[1:]):
        if op.in_shape != prev.out_shape:
            return None
        live = table >= 0
        read = rows[np.maximum(table, 0)]
        grows = op.out_shape[1] > op.in_shape[1]
        if grows and byte is not None:  # a live row of ``op`` gets ``byte`` after the row it reads (None: no live row)
            from_fill = live & (read < 0)
            if from_fill.any() and (read[from_fill] != -1 - byte).any():
                return None
            if column is not None and (live & (read >= 0)).any() and column != byte:
                return None
        rows = np.where(live, read, table)
        if column is None and grows:  # the first operand that pads its live rows sets their pad byte
            column = byte
        if not (rows >= 0).any():  # no live row left: no pad byte to speak of
            column = None
    return rows, column


COMPOSED_ON_READ_CELLS = 1 << 16
"""A composition of at least this many cells builds its index when first read (:meth:`IndexMap.composed_on_read`);
a smaller one costs less to build than to trace (row steps over whole rows: a few thousand cells)."""


def compose(*maps: IndexMap) -> IndexMap:
    """``compose(a, b, c)`` applies ``a`` then ``b`` then ``c`` as one map (a large one builds its index when
    first read: :data:`COMPOSED_ON_READ_CELLS`)."""
    if not maps:
        raise LayoutError("compose needs at least one map")
    if len(maps) == 1:
        return maps[0]
    cell = reduce(math.gcd, (m._widest_known().cell_bytes for m in maps))
    if maps[-1].out_bytes // cell < COMPOSED_ON_READ_CELLS:
        return reduce(IndexMap.then, maps)
    return IndexMap.composed_on_read(maps)
