"""In-place plans: a cell permutation cut into tiles that can each run on their own.

Applying a permutation in place with a scratch of whole experts moves every byte
twice (into the scratch, then back), so it cannot beat half the copy bandwidth. A
permutation is a set of cycles, though: lay the cells out cycle after cycle, cut that
list into tiles of ``tile_slots`` cells, and a tile reads only cells it will itself
overwrite, except where a cycle runs over a tile edge. Those few cells (at most two per
tile) are copied aside first (``saved``). Then every tile loads all its sources, and
only after that stores them: no tile reads a cell another tile writes, so all tiles run
at once and each cell crosses memory once. Fixed points are not touched at all.

Per expert the traffic is ``(1 + 1.5 * saved / moved)`` times a copy of the cells that
move; the scratch is ``len(saved)`` cells per expert in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from fimoe_lab.errors import LayoutError
from fimoe_lab.kernels.device_tables import DeviceTables

__all__ = [
    "CyclePlan",
    "cycle_plan",
    "cycle_plan_built",
    "cycle_plans_of",
    "preset_cycle_plan",
    "plan_permutation",
    "cycle_order",
]


@dataclass(eq=False)
class CyclePlan:
    """Cells moved tile by tile: ``x[dst[k]] = x[src[k]]`` (or saved ``-1 - src[k]``).

    ``dst`` lists the moved cells tile after tile (``tile_slots`` each, the last one
    shorter), sorted within a tile so stores run in address order. ``src[k] >= 0`` is a
    cell that some slot of the same tile writes; ``src[k] < 0`` is entry ``-1 - src[k]``
    of ``saved``, the cells to copy aside before any tile runs.
    """

    tile_slots: int
    dst: np.ndarray  # int32 (moved,)
    src: np.ndarray  # int32 (moved,)
    saved: np.ndarray  # int32 (n_saved,)
    _dev: dict = field(default_factory=dict, repr=False)

    def on(self, device: torch.device, wait: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dst, src, saved)`` on ``device`` (copied once, then cached on the plan), readable by the current
        stream's next launches (:class:`~fimoe_lab.kernels.device_tables.DeviceTables`). The copies do not wait for
        the stream, or, with ``wait`` (a thread other than the caller's: the background planner), are complete when
        this returns."""
        dst, src, saved = self.tables_on(device, wait).ready()
        return dst, src, saved

    def tables_on(self, device: torch.device, wait: bool = False) -> DeviceTables:
        """The :class:`~fimoe_lab.kernels.device_tables.DeviceTables` behind :meth:`on` (copied once, as it says)."""
        key = str(device)
        if key not in self._dev:
            self._dev[key] = DeviceTables((self.dst, self.src, self.saved), device, wait)
        return self._dev[key]

    def is_on(self, device: torch.device) -> bool:
        """Whether :meth:`on` has put the plan on ``device`` (a call returns it at once)."""
        return str(device) in self._dev

    def experts_per_chunk(self, cell_bytes: int, scratch_bytes: int, experts: int) -> int:
        """Experts whose saved cells (``cell_bytes`` each) fit in ``scratch_bytes`` at once
        (at least one; all of them when nothing is saved)."""
        if not self.saved.size:
            return experts
        return max(1, min(experts, scratch_bytes // (self.saved.size * cell_bytes)))

    @property
    def n_tiles(self) -> int:
        return -(-self.dst.size // self.tile_slots)

    @property
    def moved(self) -> int:
        return int(self.dst.size)


def cycle_order(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cells of the permutation ``p`` (cell ``i`` takes the value of ``p[i]``) listed
    cycle by cycle, each cycle from its smallest cell ``c`` on as ``c, p[c], p[p[c]], ...``
    so that every cell's source comes right after it (the last one's is the cycle's
    first). Returns ``(order, leader)``: the list and each cell's cycle minimum.

    Vectorized with pointer doubling (``log2(n)`` rounds of numpy indexing) so long
    cycles, like those of an in-place transpose, cost no Python loop.
    """
    n = p.size
    idx = np.arange(n, dtype=np.int64)
    leader, jump = idx.copy(), p.astype(np.int64)
    rounds = max(1, int(np.ceil(np.log2(max(n, 2)))) + 1)
    for _ in range(rounds):
        leader = np.minimum(leader, leader[jump])
        jump = jump[jump]
    # steps from each cell to its leader, following p (the leader itself: 0)
    is_leader = leader == idx
    dist = (~is_leader).astype(np.int64)
    succ = np.where(is_leader, idx, p)
    for _ in range(rounds):
        dist = dist + dist[succ]
        succ = succ[succ]
    # leader first, then p[leader] (farthest from the leader going forward), ...: one sort of a unique key
    # (cycle, then 0 for the leader and n + 1 - dist for the others), a tenth of a two-key lexsort's time
    order = np.argsort(leader * (n + 2) + np.where(is_leader, 0, n + 1 - dist))
    return order, leader


def cycle_plan(em, tile_slots: int) -> CyclePlan:
    """The :class:`CyclePlan` of the executable map ``em`` (a permutation of its cells),
    cached on it per ``tile_slots``."""
    key = _cache_key(tile_slots)
    if key not in em._dev:
        em._dev[key] = plan_permutation(em.src, em.n_in, em.has_fill, tile_slots)
    return em._dev[key]


def cycle_plan_built(em, tile_slots: int) -> bool:
    """Whether :func:`cycle_plan` of ``em`` for ``tile_slots`` is cached (a call returns it at once)."""
    return _cache_key(tile_slots) in em._dev


def cycle_plans_of(em) -> dict[int, CyclePlan]:
    """The cycle plans built for ``em`` so far, by their tile slots (reads nothing else)."""
    return {key[1]: plan for key, plan in list(em._dev.items()) if isinstance(key, tuple) and key[:1] == ("cycles",)}


def preset_cycle_plan(em, plan: CyclePlan, n_cells: int) -> None:
    """Give ``em`` a cycle plan built elsewhere (a stored plan) for its ``plan.tile_slots``, after checking that it
    has a source per slot and that every index lies in an expert of ``n_cells`` cells (a source in the saved cells
    too): a plan that does not is refused (:class:`LayoutError`), never launched."""
    moved, saved = plan.dst.size, plan.saved.size
    if plan.tile_slots < 1 or plan.src.size != moved or (moved and not 0 <= plan.dst.min() <= plan.dst.max() < n_cells):
        raise LayoutError(f"internal: a cycle plan of {moved} slots does not fit {n_cells} cells")
    if (moved and not -saved <= plan.src.min() <= plan.src.max() < n_cells) or (
        saved and not 0 <= plan.saved.min() <= plan.saved.max() < n_cells
    ):
        raise LayoutError(f"internal: a cycle plan reads outside {n_cells} cells or {saved} saved ones")
    em._dev[_cache_key(plan.tile_slots)] = plan


def _cache_key(tile_slots: int) -> tuple[str, int]:
    return ("cycles", tile_slots)


def plan_permutation(src: np.ndarray, n_in: int, has_fill: bool, tile_slots: int) -> CyclePlan:
    """Cut the cycles of ``out[i] = in[src[i]]`` into tiles of ``tile_slots`` cells."""
    if tile_slots < 1:
        raise LayoutError(f"tile_slots must be >= 1, got {tile_slots}")
    p = src.astype(np.int64)
    n = p.size
    if n_in != n or has_fill or (p < 0).any() or not np.array_equal(np.bincount(p, minlength=n), np.ones(n, np.int64)):
        raise LayoutError(
            f"{n} output cells from {n_in} input cells is not a permutation of cells; "
            "only a permutation can run in place through a cycle plan"
        )
    order, _ = cycle_order(p)
    order = order[p[order] != order]  # fixed points stay where they are
    moved = order.size
    tile = np.arange(moved, dtype=np.int64) // tile_slots
    slot_of = np.full(n, -1, dtype=np.int64)
    slot_of[order] = np.arange(moved)
    src = p[order]
    outside = tile[slot_of[src]] != tile
    saved = src[outside]
    src = np.where(outside, -np.cumsum(outside), src)  # k-th saved cell: -1 - k
    within = np.argsort(tile * n + order)  # address order inside each tile (a unique key)
    return CyclePlan(tile_slots, order[within].astype(np.int32), src[within].astype(np.int32), saved.astype(np.int32))
