"""The prebuilt CUDA executor: gathers and in-place cycle plans with kernels built ahead of time.

Nothing is compiled in the process (the kernels ship as fatbins, loaded by :mod:`.cuda_driver`):

- gather (``kernels/cuda/gather.cu``): a block writes ``BM`` output cells x ``BW`` words of each, every
  word loaded from its source cell (or its fill) and stored once;
- strided (``kernels/cuda/strided.cu``): a map of the strided form (:class:`~fimoe_lab.kernels.compiled.Strided`),
  a block moving consecutive output words, each word's source found from its digits (:func:`strided_form_table`),
  not read from an index: one launch per map, fill included;
- swizzled rows (``kernels/cuda/swizzle.cu``): a map of the ``swizzled_rows`` form (rows of 1-byte scales
  padded on the right, then the 128x4 swizzle): a block stages :data:`TILE_WORDS` words of each of
  :data:`BAND_ROWS` rows in shared memory (``KW`` words of ``TILE_WORDS / KW`` bands' rows where rows are
  shorter: :func:`swizzle_tile`), loading the aligned 16-byte chunks that hold each row's bytes (rows at any
  alignment: :func:`swizzle_chunk_shift`), then stores whole 16-byte words of the swizzle; where a tile holds whole
  rows whose sources are a few runs of consecutive input rows (:func:`swizzle_spans`), each run's chunks are loaded
  once instead (the ``spans`` kernel), so no byte is read twice;
- in place (``kernels/cuda/cycles.cu``): a block moves one tile of a
  :class:`~fimoe_lab.kernels.cycles.CyclePlan`, ``BM`` slots x ``BW`` words of their cells, every source
  loaded into registers before any store, so each moved byte crosses memory once, as Triton's cycle
  kernel does; cells under :data:`MIN_CYCLE_CELL` bytes are copied aside and gathered back instead;
- in place by clusters (``kernels/cuda/cluster.cu``, sm_90 and newer, the ``clusters`` strategy, which ``auto`` takes
  for the maps :func:`clusters_in_place` names): a cluster of blocks holds a whole expert on chip (shared memory, or
  registers too for the largest experts: :func:`cluster_geometry`), meets at its barrier, then stores it; one
  launch, each byte crossing memory once.

Tile shape (the gather and cycle kernels): ``THREADS * ITEMS`` words a block (the constants of the ``.cu`` files); the
word is 16 bytes where the cell and the buffers allow it, else 4, else 1; ``BW`` is the largest power of
two dividing the cell's words up to :data:`MAX_BW`, ``BM = THREADS * ITEMS / BW`` cells (a power of two,
at least 32); an expert of fewer cells takes tiles of as many slots as hold them all and wider ``BW``
(:func:`cycle_tile`).
"""

from __future__ import annotations

import ctypes
import math
import queue
import sys
import threading
import weakref
from typing import NamedTuple, Optional

import numpy as np
import torch

from fimoe_lab import env
from fimoe_lab.errors import LayoutError
from fimoe_lab.kernels import cuda_driver
from fimoe_lab.kernels.compiled import ExecMap, aligned_word, row_form_fault, through_stages
from fimoe_lab.kernels.cycles import cycle_plan, cycle_plan_built
from fimoe_lab.kernels.device_tables import DeviceTables
from fimoe_lab.kernels.tiles import cdiv, pow2_divisor

__all__ = [
    "SOURCE",
    "GATHER_SOURCE",
    "SWIZZLE_SOURCE",
    "STRIDED_SOURCE",
    "MAX_DIGITS",
    "BAND_ROWS",
    "TILE_WORDS",
    "MIN_KW",
    "MAX_GRID_Y",
    "MIN_CYCLE_CELL",
    "THREADS",
    "ITEMS",
    "MAX_BW",
    "available",
    "cycle_tile",
    "gather",
    "inplace_cycles",
    "inplace_clusters",
    "cluster_geometry",
    "clusters_fit",
    "cluster_launch",
    "CLUSTER_SOURCE",
    "CLUSTER_THREADS",
    "CLUSTER_REGISTER_WORDS",
    "SCATTER_THREADS",
    "ClusterGeometry",
    "cluster_table",
    "clusters_in_place",
    "CLUSTERS_ENV",
    "CLUSTER_MIN_CELL",
    "CLUSTER_SIZES",
    "CLUSTER_SHARED_MAX",
    "planned",
    "build_plan",
    "PLANNER_THREAD",
    "loads_for",
    "may_run",
    "sources_for",
    "swizzle_chunk_shift",
    "swizzle_spans",
    "swizzle_ready",
    "swizzle_tile",
    "swizzles",
    "strided_form_table",
    "FormTable",
    "FORM_WORDS",
    "runs_cycles",
    "runs_strided",
    "strided_now",
    "division_by_multiplying",
    "plan_in_background",
    "wait_for_plans",
]

SOURCE = "cycles"
"""The fatbin of ``kernels/cuda/cycles.cu`` (in place)."""
GATHER_SOURCE = "gather"
"""The fatbin of ``kernels/cuda/gather.cu``."""
SWIZZLE_SOURCE = "swizzle"
"""The fatbin of ``kernels/cuda/swizzle.cu``."""
STRIDED_SOURCE = "strided"
"""The fatbin of ``kernels/cuda/strided.cu``."""
CLUSTER_SOURCE = "cluster"
"""The fatbin of ``kernels/cuda/cluster.cu`` (in place by clusters)."""
CLUSTER_THREADS = 512
CLUSTER_REGISTER_WORDS = 16
SCATTER_THREADS = 1024
"""Threads a block of the gathering cluster kernel and 16-byte words each holds in registers, threads a block of the
scattering one (``CLUSTER_THREADS``, ``CLUSTER_REGISTER_WORDS`` and ``SCATTER_THREADS`` of ``cluster.cu``)."""
CLUSTER_SIZES = (2, 4, 8, 16)
"""Blocks a cluster may have, fewest first (16 is past CUDA's portable 8: :func:`.cuda_driver.allow_clusters`). No
cluster of one block: on an H100 (driver 580) the occupancy query answers that none runs (measured), so an expert one
block holds takes two."""
CLUSTERS_ENV = "FIMOE_INPLACE_CLUSTERS"
"""True: ``auto`` gives the cluster kernels every in-place map a cluster holds; false: none; unset: the maps
:func:`clusters_in_place` names. A call they cannot take there (a GPU before sm_90, a buffer off 16 bytes) runs as
without them."""
CLUSTER_MIN_CELL = 256
"""Cells (bytes) from which ``auto`` takes the scattering cluster kernel in place even where one of its blocks fills a
multiprocessor's shared memory. On an H100, against the cycle kernel (kernel time over a copy's): with two blocks a
multiprocessor 0.88-0.96 against 0.82-0.89 (TP8 maps of 128- and 3,584-byte cells); with one, 0.89 against 0.87 for
7,168-byte cells (an FP8 rotate's W13) but 0.74-0.76 against 0.80-0.81 for 128-byte cells (BF16 and FP8 block
layouts' W13; benchmarks/RESULTS.md)."""
CLUSTER_SHARED_MAX = 232448
"""The most dynamic shared memory a block has on any GPU with clusters (227 KiB on sm_90 and sm_100): whether a map's
experts fit a cluster at all (:func:`clusters_fit`); a device's own limit decides the launch."""
MAX_DIGITS = 8
"""Most digits the strided kernel divides a word's index into (``MAX_DIGITS`` of ``strided.cu``): the word within
its cell and the form's."""
FORM_WORDS = 3 + 5 * MAX_DIGITS
"""int64 entries of the strided kernel's form table (``FORM_WORDS`` of ``strided.cu``: a head of 3, 5 a digit)."""
BAND_ROWS = 128
TILE_WORDS = 32
MIN_KW = 4
CHUNK = 16
MAX_SPANS = 8
STAGE_CHUNKS = BAND_ROWS * TILE_WORDS * 4 // CHUNK + 2 * MAX_SPANS
"""The swizzle kernel's band (128 rows), its tile (``TILE_WORDS`` 4-byte words of each of a band's rows), the
fewest words of a row a tile holds, the bytes of an aligned load, the runs of input rows a tile of the ``spans``
kernel reads and the chunks it stages (``BAND_ROWS``, ``TILE_WORDS``, ``MIN_KW``, ``CHUNK``, ``MAX_SPANS`` and
``STAGE_CHUNKS`` of ``swizzle.cu``)."""
THREADS = 256
ITEMS = 8
"""Threads a block and words a thread holds (``THREADS`` and ``ITEMS`` of ``cycles.cu`` and ``gather.cu``)."""
MAX_BW = 64
"""Most words of a cell one block moves (so a tile holds at least 32 slots: few cycles cut at its edges), where an
expert has 32 cells or more (:func:`cycle_tile`)."""
_FUNCTIONS = {16: "fimoe_cycles_w16", 4: "fimoe_cycles_w4", 1: "fimoe_cycles_w1"}
_GATHERS = {16: "fimoe_gather_w16", 4: "fimoe_gather_w4", 1: "fimoe_gather_w1"}
_SWIZZLES = {"rows": "fimoe_swizzle", "spans": "fimoe_swizzle_spans"}
_STRIDEDS = {16: "fimoe_strided_w16", 4: "fimoe_strided_w4", 1: "fimoe_strided_w1"}
_CLUSTERS = {"gather": "fimoe_cluster_w16", "scatter": "fimoe_cluster_scatter_w16"}
_KERNELS = {
    SOURCE: _FUNCTIONS,
    GATHER_SOURCE: _GATHERS,
    SWIZZLE_SOURCE: _SWIZZLES,
    STRIDED_SOURCE: _STRIDEDS,
    CLUSTER_SOURCE: _CLUSTERS,
}
"""Each fatbin's kernels, by the word (bytes) they move (the swizzle kernels, 16-byte loads and stores: by how they
load a tile's rows, a row at a time or a run of rows at a time)."""
ON_REQUEST = (CLUSTER_SOURCE,)
"""Fatbins only a strategy asked for launches: loaded by its first call, not by :func:`available`."""
MAX_GRID_Y = 65535
"""Most experts one launch covers (CUDA's grid y limit)."""
MIN_CYCLE_CELL = 32
"""In place, cells of at least a memory sector (32 bytes) move along the map's cycle plan; smaller ones (the
4-byte words of swizzled scales) run as copy-then-gather, each chunk of experts copied aside and gathered back by
the out-of-place kernels: along the cycles each 4-byte cell costs a whole sector both ways (NVFP4 W13 scales on an
H100: 0.10 of a copy, benchmarks/RESULTS.md)."""


def available(device: torch.device | str) -> bool:
    """Whether the kernels load on ``device`` (a CUDA device whose driver takes the fatbins): loads every fatbin
    not loaded yet, in the calling thread, but those of :data:`ON_REQUEST`."""
    return all(cuda_driver.available(source, device) for source in _KERNELS if source not in ON_REQUEST)


def sources_for(em: ExecMap, in_place: bool) -> tuple[str, ...]:
    """The fatbins a run of ``em`` may launch: in place the cycle kernel's; out of place the strided kernel's for a
    map of the strided form (:func:`runs_strided`), else the gather kernel's, and the swizzle kernel's too for a map
    that ends in the 128x4 swizzle (an output off 16 bytes goes to the other)."""
    if in_place and runs_cycles(em):
        return (SOURCE,)
    first = STRIDED_SOURCE if runs_strided(em) else GATHER_SOURCE
    return (first, SWIZZLE_SOURCE) if em.ends_swizzled else (first,)


def runs_cycles(em: ExecMap) -> bool:
    """Whether ``em`` runs in place along its cycle plan: cells of at least :data:`MIN_CYCLE_CELL` bytes (else in
    place is copy-then-gather on the out-of-place kernels, which :func:`planned` and :func:`build_plan` then ask
    for)."""
    return em.cell_bytes >= MIN_CYCLE_CELL


def runs_strided(em: ExecMap) -> bool:
    """Whether the strided kernel runs ``em`` out of place: a map of the strided form of fewer than
    :data:`MAX_DIGITS` digits (the word within a cell is one more) and fewer than ``2**31`` output bytes an expert
    (the kernel's 32-bit digit division), or a map run as two such stages (``em.stages``: one launch each, through
    an intermediate, :func:`gather`)."""
    if em.strided is None:
        return em.stages is not None and all(_one_strided(stage) for stage in em.stages)
    return _one_strided(em)


def _one_strided(em: ExecMap) -> bool:
    st = em.strided
    return st is not None and len(st.shape) < MAX_DIGITS and em.out_bytes < 1 << 31


def _needs_no_plan(em: ExecMap) -> bool:
    """A gather of ``em`` needs nothing built ahead: the strided kernel runs it from its form, and it does not end in
    the swizzle or its row forms are known (the swizzle kernel reads its ``swizzled_rows`` form, not its sources)."""
    return runs_strided(em) and (not em.ends_swizzled or em.row_forms_found())


def strided_now(em: ExecMap, in_place: bool, device: torch.device | str) -> bool:
    """Whether the strided kernel runs ``em`` on ``device`` now, before any plan (:func:`runs_strided`; in place: each
    chunk copied aside and gathered back on it until the cycle plan is built): its fatbin is loaded there, by this
    call where no call loaded it before (once a process and device: on an H100 all four fatbins and a first 0.9 GB
    map took 3.9 ms, benchmarks/RESULTS.md)."""
    return runs_strided(em) and cuda_driver.available(STRIDED_SOURCE, device)


def may_run(em: ExecMap, in_place: bool, device: torch.device | str) -> bool:
    """Whether ``device`` is a CUDA device on which no fatbin ``em`` needs (:func:`sources_for`) is known not to
    load: loads nothing."""
    return all(cuda_driver.tried(source, device) is not False for source in sources_for(em, in_place))


def loads_for(em: ExecMap, in_place: bool, device: torch.device | str) -> bool:
    """Whether every fatbin ``em`` needs loads on ``device``: loads those not loaded yet, in the calling thread,
    and gets their kernels (with CUDA's lazy loading, the default, a kernel is loaded when it is got)."""
    dev = _normal(device)
    sources = sources_for(em, in_place)
    if not all(cuda_driver.available(source, dev) for source in sources):
        return False
    for source in sources:
        for name in _KERNELS[source].values():
            cuda_driver.kernel(source, name, dev)
    return True


def cycle_tile(cell_bytes: int, word: int, cells: int) -> tuple[int, int, int]:
    """``(BM, BW, NC)`` for an expert of ``cells`` cells of ``cell_bytes`` moved as ``word``-byte words: slots a
    tile, words of a cell a block, blocks a tile (``BM * BW = THREADS * ITEMS``, ``NC * BW`` = the cell's words).
    A tile holds at least ``THREADS * ITEMS / MAX_BW`` (32) slots, so few cycles are cut at its edges, or, where the
    expert has fewer cells, the power of two that holds them all, its block's other words going to the cells'
    words: a swap of two halves of an expert takes tiles of 2 slots x 1,024 words, where 32 slots x 64 words left
    30 slots of every block idle."""
    words = cell_bytes // word
    slots = min(THREADS * ITEMS // MAX_BW, 1 << (max(cells, 1) - 1).bit_length())
    bw = pow2_divisor(words, THREADS * ITEMS // slots)
    return THREADS * ITEMS // bw, bw, words // bw


def _word(em: ExecMap, *buffers: torch.Tensor) -> int:
    """The word ``em``'s cells move as in ``buffers`` (none: buffers the allocator aligned, 16 bytes or more)."""
    widest = aligned_word(16, *buffers) if buffers else 16
    return next(w for w in (16, 4, 1) if w <= widest and em.cell_bytes % w == 0)


def _tile_slots(em: ExecMap) -> int:
    return cycle_tile(em.cell_bytes, _word(em), em.n_out)[0]


def planned(em: ExecMap, in_place: bool, device: torch.device | str | None = None) -> bool:
    """Whether ``em`` is ready to launch at once: in place, its cycle plan (for an aligned buffer) is built; a
    gather, its cells' sources are known (a map run as strided copies finds them only when first read; a map
    that ends in the 128x4 swizzle finds them, and its ``swizzled_rows`` form, when that form is first read);
    and, given a ``device``, the fatbins it needs are loaded there and the cycle plan or, for a gather of the strided
    form that the swizzle kernel takes, its row table (:func:`swizzle_ready`) are on it."""
    if device is not None and not all(cuda_driver.tried(source, device) for source in sources_for(em, in_place)):
        return False
    if in_place and device is not None and clusters_in_place(em, device):
        return cuda_driver.tried(CLUSTER_SOURCE, device) is True and _cluster_table_on(em, _normal(device))
    if in_place and runs_cycles(em):
        slots = _tile_slots(em)
        return cycle_plan_built(em, slots) and (device is None or cycle_plan(em, slots).is_on(_normal(device)))
    if not (_needs_no_plan(em) or (em.sources_found() and (em.row_forms_found() or not em.ends_swizzled))):
        return False
    # a gather of the strided form that the swizzle kernel takes: its row table on the device too
    swizzled = not in_place and runs_strided(em) and em.row_forms_found() and swizzles(em)
    return device is None or not swizzled or swizzle_ready(em, _normal(device))


def build_plan(em: ExecMap, in_place: bool, device: torch.device | None = None) -> None:
    """Build what :func:`planned` asks of ``em`` beyond the fatbins, kept on the map: in place its cycle plan (for
    an aligned buffer); a gather its sources, and its ``swizzled_rows`` form where it ends in the 128x4 swizzle.
    Given a ``device``, the cycle plan is copied there, and a gather of the strided form that has that form gets its
    row table there (:func:`swizzle_ready`: its calls there go to the swizzle kernel from then on), each copy complete
    before this returns (the planner's thread: the caller's stream never waits on it). A map the cluster kernels
    permute in place there (:func:`clusters_in_place`) gets their fatbin loaded and their table on the device instead
    (the cycle plan where the fatbin does not load). A device that names no index (``"cuda"``) is the current one's:
    the tables are kept under the index the calls' tensors carry."""
    device = None if device is None else _normal(device)
    if (
        in_place
        and device is not None
        and clusters_in_place(em, device)
        and cuda_driver.available(CLUSTER_SOURCE, device)
    ):
        geometry = cluster_geometry(em, cluster_shared_limit(device.index))
        if geometry is not None:
            cluster_table(em, device, geometry.scatter, wait=True)
            return
    if in_place and runs_cycles(em):
        plan = cycle_plan(em, _tile_slots(em))
        if device is not None:
            plan.on(device, wait=True)
        return
    if not _needs_no_plan(em):
        if em.ends_swizzled:
            em.swizzled_rows  # noqa: B018 - found (with the sources it is checked against) and kept
        em.src  # noqa: B018 - read once: found and kept on the map
    if device is not None and not in_place and runs_strided(em) and swizzles(em):
        swizzle_rows_table(em, device, wait=True)


PLANNER_SWITCH_INTERVAL_S = 2e-4
"""Python's thread switch interval while the planner has work (the default is 5 ms): the caller's thread, which
gives up the GIL on every torch call and launch, gets it back within this time instead of waiting up to 5 ms
behind the planner on each (on an H100 host, with the interval set for the whole process: a BF16 drop-in's first
layer 32 -> 12 ms, benchmarks/RESULTS.md)."""


class _Planner:
    """One daemon thread getting maps ready for :func:`planned` (fatbins loaded, sources, cycle plans), in the
    order asked. While it has work, Python's switch interval is at most :data:`PLANNER_SWITCH_INTERVAL_S`; the
    previous interval comes back when its queue is empty (unless someone else changed it meanwhile)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.jobs: queue.Queue[tuple[ExecMap, bool, Optional[torch.device]]] = queue.Queue()
        self.asked: dict[tuple[bool, Optional[torch.device]], weakref.WeakSet[ExecMap]] = {}
        self.thread: Optional[threading.Thread] = None

    def submit(self, em: ExecMap, in_place: bool, device: Optional[torch.device]) -> None:
        with self.lock:
            asked = self.asked.setdefault((in_place, device), weakref.WeakSet())
            if em in asked:
                return
            asked.add(em)  # queued or done (what it builds lives on the map and in cuda_driver)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name=PLANNER_THREAD, daemon=True)
                self.thread.start()
        self.jobs.put((em, in_place, device))

    def _run(self) -> None:
        while True:
            em, in_place, device = self.jobs.get()
            previous = sys.getswitchinterval()
            sys.setswitchinterval(min(previous, PLANNER_SWITCH_INTERVAL_S))
            ours = sys.getswitchinterval()  # as Python holds it (in microseconds)
            try:
                while True:
                    self._build(em, in_place, device)
                    try:
                        em, in_place, device = self.jobs.get_nowait()
                    except queue.Empty:
                        break
            finally:
                if sys.getswitchinterval() == ours:
                    sys.setswitchinterval(previous)

    def _build(self, em: ExecMap, in_place: bool, device: Optional[torch.device]) -> None:
        try:
            if device is not None and not loads_for(em, in_place, device):
                return  # the kernels do not load there: may_run now says so
            build_plan(em, in_place, device)
        except Exception:  # a map the kernel cannot run: its own call raises it, in the caller's thread
            pass
        finally:
            self.jobs.task_done()


PLANNER_THREAD = "fimoe-lab-prebuilt-plans"
"""The name of the background planner's thread."""
_PLANNER = _Planner()


def plan_in_background(em: ExecMap, in_place: bool, device: torch.device | str | None = None) -> None:
    """Get ``em`` ready (:func:`planned`) on a background thread, once per map, mode and device: the fatbins it
    needs loaded on ``device`` (if given), then its plan. The calls that come before run elsewhere
    (:func:`~fimoe_lab.kernels.registry.get_executor`), the ones after launch at once."""
    _PLANNER.submit(em, in_place, None if device is None else _normal(device))


def _normal(device: torch.device | str) -> torch.device:
    """``device`` with its index (CUDA's current device where it names none: :func:`.cuda_driver.cuda_index`), one
    key for one device."""
    index = cuda_driver.cuda_index(device)
    return torch.device(device) if index is None else torch.device("cuda", index)


def wait_for_plans() -> None:
    """Wait until every map asked of :func:`plan_in_background` is ready."""
    _PLANNER.jobs.join()


_KEPT_LAUNCHES = "prebuilt launches"
"""``ExecMap._dev`` key, with the device index, the experts and both buffers' addresses modulo 16: the launches
:func:`gather` made for such a call (:class:`.cuda_driver.Bound`, run again at each call's addresses) and the device
table they read (:class:`~.device_tables.DeviceTables`, or None), kept once the kernel they launch is the one the
map keeps."""


def gather(em: ExecMap, x: torch.Tensor, out: torch.Tensor) -> None:
    """``out[e, i] = x[e, src[i]]`` for every expert (fill cells: their fill byte), ``x`` and ``out`` contiguous
    CUDA tensors of ``(E, in_bytes)`` and ``(E, out_bytes)`` bytes; one launch per :data:`MAX_GRID_Y` experts.
    A map of the ``swizzled_rows`` form runs on the swizzle kernel (where ``out`` is 16-byte aligned; a map of the
    strided form, or of two strided stages, only once the planner has readied it for that kernel on the device:
    :func:`swizzle_ready`), a map of the strided form on the strided kernel (:func:`runs_strided`; one of two strided
    stages: a launch per stage through an intermediate of at most :data:`STAGE_BYTES`), any other on the gather
    kernel. A call like an earlier one (device, experts, addresses modulo 16) runs that call's launches at its own
    addresses once its kernel is the one the map keeps: no form is looked up again."""
    if kept_gather(em, x, out):
        return
    launches, final, tables = _launches(em, x, out)
    if launches is None:
        through_stages(em, x, out, gather, STAGE_BYTES)
        return
    if final:
        em._dev[_kept_key(x, out)] = (launches, tables)
    _run(launches, x, out)


def _kept_key(x: torch.Tensor, out: torch.Tensor) -> tuple:
    return (_KEPT_LAUNCHES, x.get_device(), x.shape[0], x.data_ptr() & 15, out.data_ptr() & 15)


def kept_gather(em: ExecMap, x: torch.Tensor, out: torch.Tensor) -> bool:
    """Run :func:`gather`'s kept launches of a call like this one (device, experts, addresses modulo 16) at this
    call's addresses, where it kept them; False (nothing run) where it has not. Same contract as :func:`gather`:
    ``x`` and ``out`` contiguous CUDA tensors of ``(E, in_bytes)`` and ``(E, out_bytes)`` bytes."""
    kept = em._dev.get(_kept_key(x, out))
    if kept is None:
        return False
    launches, tables = kept
    if tables is not None:
        tables.ready()  # a table copied without waiting, read on this stream after it lands
    _run(launches, x, out)
    return True


def _run(launches: list, x: torch.Tensor, out: torch.Tensor) -> None:
    x_at, out_at = x.data_ptr(), out.data_ptr()
    for bound, out_offset, in_offset in launches:
        cuda_driver.run(bound, out_at + out_offset, x_at + in_offset)


def _launches(em: ExecMap, x: torch.Tensor, out: torch.Tensor) -> tuple[list | None, bool, DeviceTables | None]:
    """:func:`gather`'s launches of ``em`` from ``x`` into ``out`` (None: a map of two strided stages), whether
    they are final (the kernel the map keeps for such buffers) and the device table they read where it was copied
    without waiting (the swizzle kernel's rows: each later run of the launches makes its stream wait for it). A map of the strided form (or stages) that ends in the
    swizzle takes the swizzle kernel once the planner has readied it on the device (:func:`swizzle_ready`: the
    caller neither finds row forms, nor loads that fatbin, nor copies a table), the strided kernel before. The kernels
    read addresses only: no views of ``x`` and ``out`` are made."""
    strided_form, aligned = runs_strided(em), out.data_ptr() % 16 == 0
    if (not strided_form or swizzle_ready(em, x.device)) and swizzles(em) and aligned:
        tables = swizzle_rows_table(em, x.device)
        return _swizzle(em, x, *tables.ready()), True, tables
    if strided_form:
        # final unless the swizzle kernel may take these buffers later (row forms not found, or not readied yet)
        final = not em.ends_swizzled or not aligned or (em.row_forms_found() and em.swizzled_rows is None)
        return (None if em.strided is None else _strided(em, x, out)), final, None
    word = _word(em, x, out)
    bm, bw, nc = cycle_tile(em.cell_bytes, word, em.n_out)
    src, fills = em.src_on(x.device), em.fills_on(x.device, word)
    c_int, c_ll, ptr = ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p
    gathers = _per_experts(
        GATHER_SOURCE,
        _GATHERS[word],
        em,
        x,
        cdiv(em.n_out, bm) * nc,
        [
            (ptr, src.data_ptr()),
            (ptr, fills.data_ptr()),
            (c_int, em.n_out),
            (c_int, bm),
            (c_int, bw),
            (c_int, nc),
            (c_ll, em.cell_bytes // word),
            (c_ll, em.in_bytes // word),
            (c_ll, em.out_bytes // word),
        ],
    )
    return gathers, True, None


def _per_experts(source: str, name: str, em: ExecMap, x: torch.Tensor, blocks: int, args: list) -> list:
    """Launches of kernel ``name`` of ``source`` over every expert of ``x``, :data:`MAX_GRID_Y` experts at most a
    launch (grid: ``blocks`` x the launch's experts), as ``(bound, output offset, input offset)``: its arguments the
    launch's first output and input addresses, then ``args``."""
    ptr, index = ctypes.c_void_p, x.get_device()
    launches = []
    for e0 in range(0, x.shape[0], MAX_GRID_Y):
        cnt = min(MAX_GRID_Y, x.shape[0] - e0)
        bound = cuda_driver.Bound(source, name, index, (blocks, cnt, 1), (THREADS, 1, 1), [(ptr, 0), (ptr, 0)] + args)
        launches.append((bound, e0 * em.out_bytes, e0 * em.in_bytes))
    return launches


def division_by_multiplying(radix: int) -> tuple[int, int]:
    """``(magic, shift)`` with ``c // radix == (umulhi(c, magic) + c) >> shift`` for every ``0 <= c < 2**31``
    (``umulhi``: the high 32 bits of the 64-bit product; ``1 <= radix < 2**31``): ``shift = ceil(log2 radix)``,
    ``magic = ceil(2**(32 + shift) / radix) - 2**32``, a 32-bit value, and the sum stays below ``2**32``."""
    shift = (radix - 1).bit_length()
    return -(-(1 << (32 + shift)) // radix) - (1 << 32), shift


class FormTable(ctypes.Structure):
    """The strided kernel's form table as its by-value parameter (``Form`` of ``strided.cu``): :data:`FORM_WORDS`
    int64, set from :func:`strided_form_table`'s entries (the rest zero) through ``value``, as a launch sets every
    argument."""

    _fields_ = [("words", ctypes.c_longlong * FORM_WORDS)]

    @property
    def value(self) -> tuple[int, ...]:
        return tuple(self.words)

    @value.setter
    def value(self, table: tuple[int, ...]) -> None:
        self.words[:] = tuple(table) + (0,) * (FORM_WORDS - len(table))


def strided_form_table(em: ExecMap, word: int) -> tuple[int, ...]:
    """``em``'s strided form over ``word``-byte words as the strided kernel reads it (cached on ``em``): int64
    ``[digits, offset, fill byte or -1]``, then per digit, innermost first, ``[radix, live, stride, magic, shift]``
    (:func:`division_by_multiplying`): the word within its cell (where a cell holds more than one), then the form's
    digits, strides and offset in words. At most :data:`FORM_WORDS` entries: it goes with the launch (no device
    copy)."""
    key = ("strided form", word)
    if key not in em._dev:
        st = em.strided
        assert st is not None and runs_strided(em)
        cell_words = em.cell_bytes // word
        table = [0, st.offset * cell_words, -1 if st.fill is None else em.fill_byte(st.fill)]
        digits = [(cell_words, cell_words, 1)] if cell_words > 1 else []
        digits += [(radix, live, stride * cell_words) for radix, live, stride in zip(st.shape, st.live, st.strides)][
            ::-1
        ]
        for radix, live, stride in digits:
            table += [radix, live, stride, *division_by_multiplying(radix)]
        table[0] = len(digits)
        assert len(table) <= FORM_WORDS
        em._dev[key] = tuple(table)
    return em._dev[key]


STAGE_BYTES = 1 << 28
"""Most bytes of the intermediate of a map run as two strided stages (:func:`gather`): whole experts, at least one
(gpt-oss's MXFP4 scales, 72 MB for 128 experts, in one)."""


def _strided(em: ExecMap, x: torch.Tensor, out: torch.Tensor) -> list:
    """:func:`gather`'s launches of a map of the strided form (:func:`runs_strided`) on the strided kernel: each
    output word's source from its digits (:func:`strided_form_table`), the box's complement filled in the same
    launch."""
    word = _word(em, x, out)
    n_words = em.out_bytes // word
    return _per_experts(
        STRIDED_SOURCE,
        _STRIDEDS[word],
        em,
        x,
        cdiv(n_words, THREADS * ITEMS),
        [
            (FormTable, strided_form_table(em, word)),
            (ctypes.c_int, n_words),
            (ctypes.c_longlong, em.in_bytes // word),
            (ctypes.c_longlong, n_words),
        ],
    )


def swizzles(em: ExecMap) -> bool:
    """Whether the swizzle kernel runs ``em``: it ends in the 128x4 swizzle and has the ``swizzled_rows`` form
    (found on this first read for such a map only)."""
    return em.ends_swizzled and em.swizzled_rows is not None


def swizzle_ready(em: ExecMap, device: torch.device) -> bool:
    """Whether ``em``'s swizzle row table is on ``device`` (:func:`swizzle_rows_table`; the planner puts it there for
    a map of the strided form, :func:`build_plan`): the swizzle kernel then takes the map's calls there."""
    return ("swizzle rows", str(device)) in em._dev


def swizzle_rows_table(em: ExecMap, device: torch.device, wait: bool = False) -> DeviceTables:
    """The ``swizzled_rows`` form's row table as the swizzle kernel reads it, on ``device`` (cached on ``em``;
    ``.ready()``): int32, a source row, or ``-1 - b`` for a row of fill byte ``b``; then the tiles' runs of rows
    where the ``spans`` kernel takes the map (:func:`swizzle_spans`). The form is checked first
    (:func:`.compiled.row_form_fault`: every source row lies in the input, every fill code is one of the map's; a row
    past the input would be read outside the expert's bytes).

    The copy does not wait for the stream (:class:`~fimoe_lab.kernels.device_tables.DeviceTables`: each use through
    ``ready`` makes its stream wait until it lands), or, with ``wait`` (the planner's thread, whose stream is not the
    caller's), is complete when this returns."""
    key = ("swizzle rows", str(device))
    if key not in em._dev:
        form = em.swizzled_rows
        fault = row_form_fault("swizzled_rows", form, len(em.fills), em.in_bytes, em.out_bytes)
        if fault is not None:
            raise LayoutError(f"{em.name}: {fault}")
        rows, fills = form[0], np.array(em.fill_bytes, dtype=np.int64)
        table = np.where(rows >= 0, rows, -1 - fills[np.maximum(-1 - rows, 0)]).astype(np.int32)
        spans = swizzle_spans(rows, form[1], form[2])
        em._dev[key] = DeviceTables((table,) if spans is None else (table, spans), device, wait)
    return em._dev[key]


def swizzle_spans(rows: np.ndarray, c_in: int, cw: int) -> np.ndarray | None:
    """The runs of input rows each tile of the ``spans`` swizzle kernel reads, or None where it does not take the
    map: int32 ``(tiles, MAX_SPANS, 2)``, per tile the sorted runs of consecutive input rows its rows read as
    ``(first row, rows)``, ``(0, 0)`` past the last; the row table ``rows`` (a source row, or a fill code < 0 that
    reads nothing) of rows of ``c_in`` input bytes and ``cw`` 4-byte output words.

    The kernel takes the map where rows are not whole 16-byte chunks (``c_in % 16 != 0``: a row at a time reads
    the chunks rows share twice; gpt-oss's 90-byte rows 6.5 chunks a row for 5.6 chunks of bytes), a tile holds
    whole rows (``NK == 1``: :func:`swizzle_tile`) and every tile's sources form at most :data:`MAX_SPANS` runs
    (rows in any order, repeats allowed): it then stages each run's aligned chunks once, at most ``ceil((15 + rows
    * c_in) / 16)`` a run, :data:`STAGE_CHUNKS` in all."""
    _, nb, nk = swizzle_tile(cw)
    if nk != 1 or c_in % CHUNK == 0:
        return None
    tile_rows = nb * BAND_ROWS
    tiles = cdiv(rows.size, tile_rows)
    by_tile = np.full(tiles * tile_rows, -1, dtype=np.int64)
    by_tile[: rows.size] = rows
    by_tile = np.sort(by_tile.reshape(tiles, tile_rows), axis=1)
    before = np.concatenate([np.full((tiles, 1), -2, dtype=np.int64), by_tile[:, :-1]], axis=1)
    starts = (by_tile >= 0) & ((before < 0) | ((by_tile != before) & (by_tile != before + 1)))
    if (starts.sum(axis=1) > MAX_SPANS).any():
        return None
    ends = (by_tile >= 0) & np.concatenate([by_tile[:, 1:] > by_tile[:, :-1] + 1, np.ones((tiles, 1), bool)], axis=1)
    spans = np.zeros((tiles, MAX_SPANS, 2), dtype=np.int32)
    tile_of, at = np.nonzero(starts)
    slot = np.arange(tile_of.size) - np.searchsorted(tile_of, tile_of)  # the run's place in its tile
    spans[tile_of, slot, 0] = by_tile[tile_of, at]
    spans[tile_of, slot, 1] = by_tile[ends] - by_tile[tile_of, at] + 1
    staged = (CHUNK - 1 + spans[:, :, 1].astype(np.int64) * c_in + CHUNK - 1) // CHUNK
    if (np.where(spans[:, :, 1] > 0, staged, 0).sum(axis=1) > STAGE_CHUNKS).any():
        return None
    return spans


def swizzle_tile(cw: int) -> tuple[int, int, int]:
    """``(kw_shift, NB, NK)`` of the swizzle kernel for rows of ``cw`` 4-byte words: a tile holds ``KW =
    2**kw_shift`` words (the row's, rounded up to a power of two from :data:`MIN_KW` to :data:`TILE_WORDS`) of
    each row of ``NB = TILE_WORDS / KW`` bands; ``NK`` tiles cover a row."""
    kw_shift = min(TILE_WORDS.bit_length() - 1, max(MIN_KW.bit_length() - 1, (cw - 1).bit_length()))
    return kw_shift, TILE_WORDS >> kw_shift, cdiv(cw, 1 << kw_shift)


def swizzle_chunk_shift(c_in: int, cw: int, in_bytes: int, x_at: int) -> int:
    """``log2 CH``: the 16-byte chunks the swizzle kernel loads for each row of a tile (``CH`` threads of a warp a
    row, each one aligned chunk), for rows of ``c_in`` input bytes in experts of ``in_bytes`` from address ``x_at``.

    A row's tile bytes (at most ``4 min(KW, cw)``) start at most ``o_max = 16 - gcd(16, c_in, in_bytes, x_at %
    16)`` bytes into a chunk, so ``CH = ceil((o_max + 4 min(KW, cw)) / 16)`` chunks hold them, rounded up to a power
    of two (at most 16: 15 + 128 bytes). The same for every launch of one call (experts step by ``in_bytes``), and
    the kept launches' key holds ``x_at % 16``."""
    kw_shift = swizzle_tile(cw)[0]
    o_max = CHUNK - math.gcd(CHUNK, c_in, in_bytes, x_at % CHUNK)
    chunks = (o_max + 4 * min(1 << kw_shift, cw) - 1) // CHUNK + 1
    return (chunks - 1).bit_length()


def _swizzle(em: ExecMap, x: torch.Tensor, table: torch.Tensor, spans: torch.Tensor | None = None) -> list:
    """:func:`gather`'s launches of a ``swizzled_rows`` map reading its row ``table`` on ``x``'s device (tiles:
    :func:`swizzle_tile`; chunks a row: :func:`swizzle_chunk_shift`), or, given its tiles' runs of rows
    (:func:`swizzle_spans`), the ``spans`` kernel's."""
    _, c_in, cw, rows_n, column = em.swizzled_rows
    column_fill = em.fill_byte(column)
    kw_shift, nb, nk = swizzle_tile(cw)
    n_bands = rows_n // BAND_ROWS
    c_int, c_ll, ptr = ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p
    if spans is None:  # a row at a time: NK column tiles a row, CH chunks a row
        chunk_shift = swizzle_chunk_shift(c_in, cw, em.in_bytes, x.data_ptr())
        kernel, tables, tiling = (
            "rows",
            [(ptr, table.data_ptr())],
            [(c_int, nk), (c_int, kw_shift), (c_int, chunk_shift)],
        )
    else:  # runs of rows: whole rows a tile (NK == 1)
        kernel, tables, tiling = "spans", [(ptr, table.data_ptr()), (ptr, spans.data_ptr())], [(c_int, kw_shift)]
    shape = [(c_int, c_in), (c_int, cw), (c_int, n_bands)]
    tail = [(c_int, column_fill), (c_ll, em.in_bytes), (c_ll, em.out_bytes // 16)]
    return _per_experts(
        SWIZZLE_SOURCE, _SWIZZLES[kernel], em, x, cdiv(n_bands, nb) * nk, tables + shape + tiling + tail
    )


_KEPT_CYCLES = "prebuilt cycle launches"
"""``ExecMap._dev`` key, with the device index, the experts, the bytes an expert, the buffer's address modulo 16 and the
scratch experts: what :func:`inplace_cycles` launches for such a call (:class:`CycleLaunches`), kept from its first
call: the later ones run the same launches at their own addresses."""


class CycleLaunches(NamedTuple):
    """The cycle kernel's launches over a buffer of ``(E, bytes)``: ``chunks`` holds, per chunk of experts, its
    launches (:class:`.cuda_driver.Bound`: the saves where the plan saves cells, then the tiles; their first two
    arguments the chunk's address and the scratch's), the chunk's offset in the buffer and the experts done after it;
    ``scratch_bytes`` the scratch they share, ``tables`` the plan's device tables they read."""

    chunks: tuple[tuple[tuple[cuda_driver.Bound, ...], int, int], ...]
    scratch_bytes: int
    tables: DeviceTables | None


def inplace_cycles(em: ExecMap, flat: torch.Tensor, scratch_experts: int):
    """Permute every expert of ``flat`` ``(E, bytes)`` (CUDA) in place along the map's cycle plan: per chunk of
    experts one launch copies the cells the tiles cut into the scratch, one runs every tile. The scratch holds
    the saved cells of as many experts as fit in ``scratch_experts`` experts' bytes. A call like an earlier one
    (device, experts, bytes, address modulo 16, scratch) runs that call's launches at its own addresses.

    Yields the number of leading experts whose tiles have been launched (the stream orders the launches)."""
    experts, nbytes = flat.shape
    at = flat.data_ptr()
    key = (_KEPT_CYCLES, flat.get_device(), experts, nbytes, at & 15, scratch_experts)
    kept = em._dev.get(key)
    if kept is None:
        kept = em._dev[key] = _cycle_launches(em, flat, scratch_experts)
    if not kept.chunks:
        yield experts, None
        return
    if kept.tables is not None:
        kept.tables.ready()  # copied without waiting: this stream's launches read them after they land
    scratch = torch.empty((kept.scratch_bytes,), dtype=torch.uint8, device=flat.device)
    scratch_at = scratch.data_ptr()
    for launches, offset, done in kept.chunks:
        for bound in launches:
            cuda_driver.run(bound, at + offset, scratch_at)
        yield done, scratch


def _cycle_launches(em: ExecMap, flat: torch.Tensor, scratch_experts: int) -> CycleLaunches:
    """:func:`inplace_cycles`' launches for ``flat``: chunks of as many experts as the scratch serves (at most
    :data:`MAX_GRID_Y`), a chunk's saves over ``ceil(saved / BM) * NC`` blocks, its tiles over ``tiles * NC``, per
    expert of the chunk; every full chunk shares one pair of launches."""
    experts, nbytes = flat.shape
    word = _word(em, flat)
    bm, bw, nc = cycle_tile(em.cell_bytes, word, em.n_out)
    plan = cycle_plan(em, bm)
    if plan.moved == 0:
        return CycleLaunches((), 0, None)
    tables = plan.tables_on(flat.device)
    dst, src, saved = tables.ready()
    n_saved, cell_words = int(plan.saved.size), em.cell_bytes // word
    per = min(plan.experts_per_chunk(em.cell_bytes, scratch_experts * nbytes, experts), MAX_GRID_Y)
    ptr, c_int, c_ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    shape = [(c_int, bm), (c_int, bw), (c_int, nc), (c_ll, cell_words), (c_ll, nbytes // word)]
    shape.append((c_ll, n_saved * cell_words))
    index, name = flat.get_device(), _FUNCTIONS[word]

    def pass_(cnt: int, table: torch.Tensor, sources: torch.Tensor, slots: int, blocks: int, save: int):
        args = [(ptr, 0), (ptr, 0), (ptr, table.data_ptr()), (ptr, sources.data_ptr()), (c_int, slots)]
        return cuda_driver.Bound(SOURCE, name, index, (blocks, cnt, 1), (THREADS, 1, 1), [*args, *shape, (c_int, save)])

    made: dict[int, tuple[cuda_driver.Bound, ...]] = {}
    chunks = []
    for s0 in range(0, experts, per):
        cnt = min(per, experts - s0)
        if cnt not in made:
            tiles = pass_(cnt, dst, src, plan.moved, plan.n_tiles * nc, 0)
            made[cnt] = (pass_(cnt, saved, saved, n_saved, cdiv(n_saved, bm) * nc, 1), tiles) if n_saved else (tiles,)
        chunks.append((made[cnt], s0 * nbytes, s0 + cnt))
    return CycleLaunches(tuple(chunks), max(per * n_saved * em.cell_bytes, word), tables)


class ClusterGeometry(NamedTuple):
    """How the cluster kernels hold one expert: ``C`` blocks, block ``r`` owning cells ``[r S, (r + 1) S)``, each
    staging ``staged`` bytes of shared memory; ``scatter``: the scattering kernel (its own run loaded, cells stored
    by the inverse map), else the gathering one (16-byte words of registers a thread as well)."""

    scatter: bool
    c: int
    s: int
    staged: int

    @property
    def kernel(self) -> tuple[str, int]:
        """The kernel's name and threads a block."""
        return (_CLUSTERS["scatter"], SCATTER_THREADS) if self.scatter else (_CLUSTERS["gather"], CLUSTER_THREADS)


def cluster_geometry(em: ExecMap, shared_limit: int) -> ClusterGeometry | None:
    """The cluster kernel and blocks that hold one expert of ``em`` on chip, blocks of at most ``shared_limit`` bytes
    of shared memory, ``S = ceil(cells / C)`` cells a block (``S * cell_bytes / 16`` words), first of these that
    holds it:

    1. the scattering kernel (shared memory only), the fewest ``C`` of :data:`CLUSTER_SIZES` whose blocks take at
       most ``(shared_limit - 1024) / 2`` bytes: two blocks a multiprocessor, so one loads while another stores (each
       block also takes the 1 KiB the system reserves);
    2. the scattering kernel, the fewest ``C`` whose blocks take at most ``shared_limit``;
    3. the gathering kernel, ``CLUSTER_REGISTER_WORDS * CLUSTER_THREADS`` words in registers and the rest (at least
       one) staged, the fewest ``C`` whose staging fits.

    On an H100 the scattering kernel ran DeepSeek TP8 maps at 0.90-0.96 of a copy where two blocks fit a
    multiprocessor, 0.74-0.89 where one does; the gathering one 0.69-0.86 (benchmarks/RESULTS.md). None for a map
    that is no permutation of whole 16-byte words, or whose expert no cluster holds. Kept on ``em`` per limit: the
    in-place calls ask on every call (whether ``auto`` prefers the clusters, and how they launch)."""
    key = ("cluster geometry", shared_limit)
    if key not in em._dev:
        em._dev[key] = _cluster_geometry(em, shared_limit)
    return em._dev[key]


def _cluster_geometry(em: ExecMap, shared_limit: int) -> ClusterGeometry | None:
    if em.cell_bytes % 16 or not em.is_permutation:
        return None
    cw, held = em.cell_bytes // 16, CLUSTER_REGISTER_WORDS * CLUSTER_THREADS
    slices = [(c, cdiv(em.n_out, c)) for c in CLUSTER_SIZES]
    for limit in (_two_a_multiprocessor(shared_limit), shared_limit):
        for c, s in slices:
            if s * cw * 16 <= limit:
                return ClusterGeometry(True, c, s, s * cw * 16)
    for c, s in slices:
        staged = max(s * cw - held, 1) * 16
        if staged <= shared_limit:
            return ClusterGeometry(False, c, s, staged)
    return None


def _two_a_multiprocessor(shared_limit: int) -> int:
    """Shared memory a block may take so that two share a multiprocessor (each also takes the 1 KiB the system
    reserves)."""
    return (shared_limit - 1024) // 2


_TWO_A_MULTIPROCESSOR = _two_a_multiprocessor(CLUSTER_SHARED_MAX)


def clusters_fit(em: ExecMap) -> bool:
    """Whether a cluster holds an expert of ``em`` on some GPU (:func:`cluster_geometry` at
    :data:`CLUSTER_SHARED_MAX`)."""
    return cluster_geometry(em, CLUSTER_SHARED_MAX) is not None


def clusters_in_place(em: ExecMap, device: torch.device | str | None = None) -> bool:
    """Whether ``auto`` permutes ``em`` in place with the cluster kernels (:data:`CLUSTERS_ENV`; unset: where the
    scattering kernel holds an expert with two blocks a multiprocessor, or with one and cells of at least
    :data:`CLUSTER_MIN_CELL` bytes), on ``device`` where given: a CUDA device with clusters (sm_90 and newer) whose
    cluster fatbin has not failed to load. Elsewhere the planner builds the map's cycle plan, as for any other map."""
    asked = env.value(CLUSTERS_ENV, None)
    geometry = cluster_geometry(em, CLUSTER_SHARED_MAX)
    if asked is None:
        asked = geometry is not None and geometry.scatter
        asked = asked and (geometry.staged <= _TWO_A_MULTIPROCESSOR or em.cell_bytes >= CLUSTER_MIN_CELL)
    if not asked:
        return False
    if geometry is None or device is None:
        return geometry is not None
    dev = _normal(device)
    return (
        dev.type == "cuda"
        and cluster_shared_limit(dev.index) > 0
        and cuda_driver.tried(CLUSTER_SOURCE, dev) is not False
    )


def cluster_table(em: ExecMap, device: torch.device, scatter: bool, wait: bool = False) -> torch.Tensor:
    """The table a cluster kernel reads for ``em`` on ``device`` (int32, cached on ``em``): ``scatter``, the inverse
    permutation ``dst`` (``dst[src[k]] = k``), else ``em.src``; copied as :class:`DeviceTables` does (``wait``: from
    the planner's thread)."""
    key = ("cluster table", str(device), scatter)
    if key not in em._dev:
        src = np.asarray(em.src, dtype=np.int32)
        table = src
        if scatter:
            table = np.empty_like(src)
            table[src] = np.arange(src.size, dtype=np.int32)
        em._dev[key] = DeviceTables((table,), device, wait)
    return em._dev[key].ready()[0]


def _cluster_table_on(em: ExecMap, device: torch.device) -> bool:
    geometry = cluster_geometry(em, cluster_shared_limit(device.index))
    return geometry is not None and ("cluster table", str(device), geometry.scatter) in em._dev


_CLUSTER_LIMITS: dict[int, int] = {}
_ACTIVE_CLUSTERS: dict[tuple[int, ClusterGeometry], int] = {}


def cluster_shared_limit(index: int) -> int:
    """Dynamic shared memory a block of the cluster kernel may have on CUDA device ``index`` (0 before sm_90: no
    clusters)."""
    if index not in _CLUSTER_LIMITS:
        props = torch.cuda.get_device_properties(index)
        limit = getattr(props, "shared_memory_per_block_optin", props.shared_memory_per_block)
        _CLUSTER_LIMITS[index] = limit if props.major >= 9 else 0
    return _CLUSTER_LIMITS[index]


def cluster_launch(em: ExecMap, flat: torch.Tensor) -> ClusterGeometry | str:
    """How the cluster kernels permute ``flat`` ``(E, bytes)`` (CUDA) in place under ``em``
    (:func:`cluster_geometry` for the device's shared memory), or why they cannot: their fatbin does not load there,
    no cluster of the device holds an expert, the buffer is not 16-byte aligned, or the device runs no cluster of that
    geometry."""
    if not cuda_driver.available(CLUSTER_SOURCE, flat.device):
        return f"the cluster kernel does not load on {flat.device}"
    index = flat.get_device()
    geometry = cluster_geometry(em, cluster_shared_limit(index))
    if geometry is None or _word(em, flat) != 16:
        return (
            f"no cluster of {flat.device} holds an expert of {em.in_bytes} bytes in cells of {em.cell_bytes} bytes "
            "at a 16-byte aligned address"
        )
    key = (index, geometry)
    if key not in _ACTIVE_CLUSTERS:
        # the device's whole limit, once: a later map's smaller staging must not lower what an earlier one launches
        name, threads = geometry.kernel
        cuda_driver.allow_clusters(CLUSTER_SOURCE, name, flat.device, cluster_shared_limit(index))
        _ACTIVE_CLUSTERS[key] = cuda_driver.max_active_clusters(
            CLUSTER_SOURCE, name, flat.device, (threads, 1, 1), geometry.staged, geometry.c
        )
    if _ACTIVE_CLUSTERS[key] < 1:
        return (
            f"clusters of {geometry.c} blocks with {geometry.staged} bytes of shared memory each do not run on "
            f"{flat.device}"
        )
    return geometry


def inplace_clusters(
    em: ExecMap, flat: torch.Tensor, scratch_experts: int, launch: ClusterGeometry | str | None = None
):
    """Permute every expert of ``flat`` ``(E, bytes)`` (CUDA, 16-byte aligned) in place by clusters that each hold a
    whole expert on chip, as :func:`cluster_launch` says (``launch``: its answer where the caller has it): one launch,
    a cluster an expert; no scratch. Refused (nothing moved) where it says why not.

    Yields the number of experts launched (all of them)."""
    if launch is None:
        launch = cluster_launch(em, flat)
    if isinstance(launch, str):
        raise LayoutError(f"{em.name}: {launch}", fix="use the in-place strategy 'cycles' (the default)")
    experts, (name, threads) = flat.shape[0], launch.kernel
    table = cluster_table(em, flat.device, launch.scatter)
    ptr, c_int, c_ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    cuda_driver.launch(
        CLUSTER_SOURCE,
        name,
        flat.device,
        (experts * launch.c, 1, 1),
        (threads, 1, 1),
        [
            (ptr, flat.data_ptr()),
            (ptr, table.data_ptr()),
            (c_int, em.n_out),
            (c_int, em.cell_bytes // 16),
            (c_ll, em.in_bytes // 16),
            (c_int, launch.s),
            (c_int, experts),
        ],
        cluster=launch.c,
        shared_bytes=launch.staged,
    )
    yield experts, None
