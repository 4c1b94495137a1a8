"""The executors, as a table: who runs where, who is preferred, and how each runs in place.

An :class:`Executor` gathers an executable map over all experts (``gather(em, x, out)``)
and lists its in-place strategies (:class:`InPlace`), preferred first. The registry
:data:`EXECUTORS` is ordered fastest first; the default executor for a device and
output size is the first one that is available there and wants that size:

- ``triton``: CUDA tensors, when Triton imports;
- ``numba``: CPU tensors of at least :data:`NUMBA_MIN_BYTES` output, when numba imports
  (below that, compiling costs more than it saves);
- ``torch``: any device (strided copies for maps of the strided form, else wide-word
  ``index_select``);
- ``prebuilt``: CUDA devices whose driver loads the kernels built ahead of time
  (:mod:`.prebuilt`: a gather kernel, a scale swizzle kernel and the cycle kernel). Never the default
  executor; it stands in for Triton while Triton is not loaded, in place and for gathers of maps that are
  not one strided view or end in the 128x4 scale swizzle (:data:`PREBUILT_ENV`).

In-place strategies: ``bands`` (Triton, the 128x4 scale maps only: one cooperative
launch, no scratch), ``cycles`` (along the map's cycles, :mod:`.cycles`; numba prefers
it for cells of at least :data:`CYCLES_MIN_CELL` bytes; ``prebuilt`` runs it with nothing compiled), ``strided`` (torch, maps of the
strided form: a chunk copied aside, then strided-copied back), ``clusters`` (``prebuilt`` on sm_90 and newer: clusters of blocks that each
hold a whole expert on chip, :func:`.prebuilt.inplace_clusters`; ``auto`` prefers it for the maps
:func:`.prebuilt.clusters_in_place` names),
``copy-then-gather`` (every executor: :mod:`.copy_then_gather`). ``auto`` takes the first strategy that fits the
map and prefers it. Implementations load on first call (numba and Triton import only
when used) and are looked up on every call.

Cold start: an executor with a ``load`` step and a ``stand_in`` (numba: importing numba and
loading its kernels from the on-disk cache costs about a second; Triton: importing it and its
compiler cache key, ~0.5 s on the H200 host) is loaded on a background
thread when a default call first picks it; until the load is done, default calls run on the
stand-in (torch), which gives the same bytes (every executor is bit-exact), so the first
transform of a fresh process does not wait for the import. :func:`load_executor` loads one
now (``fimoe_lab.warmup`` and the benchmarks call it); ``FIMOE_BACKGROUND_LOAD=0`` loads in
the calling thread instead. On CUDA, the prebuilt kernels stand in for Triton where they beat torch
(in place, maps that are not one strided view, and scale maps that end in the 128x4 swizzle), once a
background thread has planned the map (its first call runs on torch: :func:`_loaded_or_stand_in`); for those
maps Triton is not loaded at all.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Optional

import torch

from fimoe_lab import env
from fimoe_lab.errors import FormatError, LayoutError
from fimoe_lab.kernels.compiled import ExecMap

__all__ = [
    "Executor",
    "InPlace",
    "EXECUTORS",
    "NUMBA_MIN_BYTES",
    "CYCLES_MIN_CELL",
    "get_executor",
    "pick_backend",
    "available_backends",
    "load_executor",
    "executor_ready",
    "kernel_gathers",
    "keep_in_place",
    "kept_in_place",
    "prebuilt_stands_in",
    "execute_kept",
    "plans_after_the_call",
]

NUMBA_MIN_BYTES = 1 << 20
"""CPU outputs smaller than this run on torch (numba's first compile costs seconds)."""
CYCLES_MIN_CELL = 1024
"""On the CPU, in place, cells of at least this many bytes (rows) run the cycle plan; smaller
ones (128-byte blocks, 4-byte scale words) scatter too much on a CPU and take the
copy-then-gather path (measured on the 2-core machine, benchmarks/RESULTS.md)."""

Gather = Callable[[ExecMap, torch.Tensor, torch.Tensor], None]
Runner = Callable[[ExecMap, torch.Tensor, int, Optional[dict]], Iterator[tuple[int, object]]]


def _always(em: ExecMap) -> bool:
    return True


@dataclass(frozen=True)
class InPlace:
    """One in-place strategy: ``run(em, flat, scratch_experts, config)`` permutes ``flat``
    ``(E, bytes)`` in place, yielding the leading experts done after each chunk.

    ``fits(em)``: the maps it can run (``requirement`` says which, for the refusal);
    ``prefers(em)``: the maps ``auto`` gives it.
    """

    name: str
    run: Runner
    fits: Callable[[ExecMap], bool] = _always
    prefers: Callable[[ExecMap], bool] = _always
    requirement: str = ""


@dataclass(frozen=True)
class Executor:
    """One executor: where it runs (``devices``: device types, None = any; ``needs``: a
    package that must import), the smallest output it is preferred for, its gather and
    its in-place strategies (preferred first); ``load``: what loading it ahead of its first
    gather takes (imports, cached kernels), run in the background while default calls go to
    the executor named ``stand_in`` (module docstring); ``at_bandwidth(em, device type, in_place)``:
    whether it runs ``em`` near a copy's speed, so a default call need not load another;
    ``loads_on(device)``: whether what it ships loads there (``loads_needs`` says what that takes)."""

    name: str
    devices: Optional[tuple[str, ...]]
    needs: Optional[str]
    min_bytes: int
    gather: Gather
    in_place: tuple[InPlace, ...]
    load: Optional[Callable[[], None]] = None
    stand_in: Optional[str] = None
    at_bandwidth: Callable[[ExecMap, str, bool], bool] = lambda em, kind, in_place: False
    loads_on: Optional[Callable[[torch.device], bool]] = None
    loads_needs: str = ""

    def available(self, device: torch.device | str) -> bool:
        """Whether this executor can run on ``device`` here (``loads_on``: what it ships loads there)."""
        device = torch.device(device)
        return (
            (self.devices is None or device.type in self.devices)
            and (self.needs is None or _importable(self.needs))
            and (self.loads_on is None or self.loads_on(device))
        )

    def preferred(self, device: torch.device | str, out_bytes: int) -> bool:
        """Whether this executor wants an output of ``out_bytes`` on ``device``."""
        return out_bytes >= self.min_bytes and self.available(device)

    def strategy(self, em: ExecMap, name: str = "auto", without: str = "") -> InPlace:
        """The in-place strategy ``name`` for ``em`` (``auto``: the first that fits and prefers it, other than the
        one named ``without``)."""
        if name == "auto":
            return next(s for s in self.in_place if s.name != without and s.fits(em) and s.prefers(em))
        chosen = next((s for s in self.in_place if s.name == name), None)
        if chosen is None:
            raise FormatError(
                f"unknown in-place strategy {name!r} for the {self.name} executor",
                fix=f"choose auto, {', '.join(s.name for s in self.in_place)}",
            )
        if not chosen.fits(em):
            raise LayoutError(
                f"in-place strategy {name!r} needs {chosen.requirement}; {em.name} is not one",
                fix=f"use auto or {', '.join(s.name for s in self.in_place if s.fits(em))}",
            )
        return chosen


@functools.cache
def _importable(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


@functools.cache  # on every call of an executor: the import system's lookup costs more than the call
def _module(name: str):
    return importlib.import_module(f"fimoe_lab.kernels.{name}")


def _strided_form(em: ExecMap) -> bool:
    return em.strided is not None


def _strided_on_cuda(em: ExecMap, kind: str, in_place: bool = False) -> bool:
    """torch's strided copies run at 0.94-0.97 of a copy on the H200 (Triton's gathers: 0.95-0.97);
    on a CPU about half of one (numba's streaming stores: all of it), so numba is still loaded there."""
    return kind == "cuda" and (em.strided is not None or em.stages is not None)


def kernel_gathers(em: ExecMap) -> bool:
    """Whether the prebuilt kernels may run ``em`` out of place: a map that ends in the 128x4 scale swizzle (the
    swizzle kernel, when the map has the ``swizzled_rows`` form), a map of the strided form the strided kernel
    takes (one launch where torch makes a copy per piece and per fill slab), or any other map (the gather kernel).
    Decided without finding a form."""
    return em.strided is None or em.ends_swizzled or _module("prebuilt").runs_strided(em)


def _gather_prebuilt(em, x, out):
    pre = _module("prebuilt")
    if em.strided is None or pre.runs_strided(em) or pre.swizzles(em):  # runs_strided first: swizzles finds forms
        pre.gather(em, x, out)
    else:
        _gather_torch(em, x, out)


def _cycles_prebuilt(em, flat, scratch_experts, config):
    return _module("prebuilt").inplace_cycles(em, flat, scratch_experts)


def _clusters_prebuilt(em, flat, scratch_experts, config):
    pre = _module("prebuilt")
    launch = pre.cluster_launch(em, flat)
    if isinstance(launch, str) and (config or {}).get("inplace") != "clusters":  # auto: as without the clusters
        return EXECUTORS["prebuilt"].strategy(em, without="clusters").run(em, flat, scratch_experts, config)
    return pre.inplace_clusters(em, flat, scratch_experts, launch)


def _clusters_fit(em: ExecMap) -> bool:
    return _module("prebuilt").clusters_fit(em)


def _clusters_in_place(em: ExecMap) -> bool:
    return _module("prebuilt").clusters_in_place(em)


def _cycles_now(em: ExecMap) -> bool:
    """``auto`` runs a map's cycle plan once it is built; a map of the strided form copies each chunk aside and
    gathers it back on the strided kernel until then (its first calls, while the planner builds the plan). Cells
    under a sector (:data:`.prebuilt.MIN_CYCLE_CELL`) always copy aside and gather back."""
    pre = _module("prebuilt")
    return pre.runs_cycles(em) and (not pre.runs_strided(em) or pre.planned(em, True))


def _prebuilt_loads(device: torch.device) -> bool:
    return _module("prebuilt").available(device)


def _inplace_strided_torch(em, flat, scratch_experts, config):
    return _module("torch_gather").inplace_strided(em, flat, scratch_experts)


def _copy_then_gather(gather: Gather) -> InPlace:
    def run(em, flat, scratch_experts, config):
        return _module("copy_then_gather").copy_then_gather(gather, em, flat, scratch_experts)

    return InPlace("copy-then-gather", run)


_ctg_prebuilt = _copy_then_gather(_gather_prebuilt)


def _gather_torch(em, x, out):
    _module("torch_gather").gather_torch(em, x, out)


def _gather_numba(em, x, out):
    _module("numba_gather").gather_numba(em, x, out)


def _gather_triton(em, x, out):
    _module("triton_gather").gather_triton(em, x, out)


def _load_numba() -> None:
    _module("numba_gather").preload()


def _load_triton() -> None:
    _module("triton_gather").preload()


def _cycles_numba(em, flat, scratch_experts, config):
    return _module("numba_gather").inplace_cycles_numba(em, flat, scratch_experts)


def _cycles_triton(em, flat, scratch_experts, config):
    return _module("triton_gather").inplace_cycles(em, flat, scratch_experts, config=config)


def _bands_triton(em, flat, scratch_experts, config):
    return _module("triton_gather").inplace_swizzled_bands(em, flat, scratch_experts, config=config)


EXECUTORS: dict[str, Executor] = {
    e.name: e
    for e in (
        Executor(
            "triton",
            ("cuda",),
            "triton",
            0,
            _gather_triton,
            (
                InPlace(
                    "bands",
                    _bands_triton,
                    fits=lambda em: em.swizzle is not None,
                    requirement="a map of a row permutation then the 128x4 scale swizzle (1-byte scales)",
                ),
                InPlace("cycles", _cycles_triton),
                _copy_then_gather(_gather_triton),
            ),
            load=_load_triton,
            stand_in="torch",
        ),
        Executor(
            "numba",
            ("cpu",),
            "numba",
            NUMBA_MIN_BYTES,
            _gather_numba,
            (
                InPlace("cycles", _cycles_numba, prefers=lambda em: em.cell_bytes >= CYCLES_MIN_CELL),
                _copy_then_gather(_gather_numba),
            ),
            load=_load_numba,
            stand_in="torch",
        ),
        Executor(
            "torch",
            None,
            None,
            0,
            _gather_torch,
            (
                InPlace("strided", _inplace_strided_torch, fits=_strided_form, requirement="a map of the strided form"),
                _copy_then_gather(_gather_torch),
            ),
            at_bandwidth=_strided_on_cuda,
        ),
        Executor(
            "prebuilt",
            ("cuda",),
            None,
            0,
            _gather_prebuilt,
            (
                InPlace(
                    "clusters",
                    _clusters_prebuilt,
                    fits=_clusters_fit,
                    prefers=_clusters_in_place,
                    requirement="a permutation of 16-byte words whose expert a cluster of blocks holds on chip",
                ),
                InPlace("cycles", _cycles_prebuilt, prefers=_cycles_now),
                _ctg_prebuilt,
            ),
            loads_on=_prebuilt_loads,
            loads_needs="a driver that loads its fatbin (CUDA 13: driver 580 or newer)",
        ),
    )
}
"""Every executor, fastest first."""


def available_backends(device: torch.device | str) -> list[str]:
    """Executors that can run on ``device`` here, fastest first."""
    return [e.name for e in EXECUTORS.values() if e.available(device)]


def pick_backend(device: torch.device | str, out_bytes: int) -> str:
    """The default executor for an output of ``out_bytes`` on ``device``."""
    return _pick(device.type if isinstance(device, torch.device) else torch.device(device).type, out_bytes)


@functools.lru_cache(maxsize=4096)  # called on every gather: the answer depends on the device type and size only
def _pick(kind: str, out_bytes: int) -> str:
    return next(e.name for e in EXECUTORS.values() if e.preferred(kind, out_bytes))


def get_executor(
    name: Optional[str],
    device: torch.device | str,
    out_bytes: int,
    wait: bool = False,
    em: Optional[ExecMap] = None,
    in_place: bool = False,
) -> Executor:
    """Executor ``name`` (None: :func:`pick_backend`, or its stand-in while it loads or, for a map ``em``
    the stand-in runs at bandwidth (``in_place``: permuted in place), until it is loaded; with ``wait``,
    loaded now: a call that tunes the executor's own strategies), checked to run on ``device``."""
    if name is None:
        ex = EXECUTORS[pick_backend(device, out_bytes)]
        if wait:
            load_executor(ex.name)
            return ex
        return _loaded_or_stand_in(ex, em, torch.device(device), in_place)
    if name not in EXECUTORS:
        raise FormatError(f"unknown executor backend {name!r}", fix=f"choose one of {', '.join(EXECUTORS)}")
    ex = EXECUTORS[name]
    if not ex.available(device):
        why = " and ".join(
            ([f"a {' or '.join(ex.devices)} device"] if ex.devices else [])
            + ([f"{ex.needs} importable"] if ex.needs else [])
            + ([ex.loads_needs] if ex.loads_on else [])
        )
        raise FormatError(
            f"executor backend {name!r} cannot run on {torch.device(device)} here (it needs {why})",
            fix=f"choose one of {', '.join(available_backends(device))}",
        )
    return ex


# ============================================================================ loading in the background
BACKGROUND_ENV = "FIMOE_BACKGROUND_LOAD"
"""Set to a false value (``0 false no off``: :func:`fimoe_lab.env.env_bool`) to load executors in the calling
thread (no stand-in runs)."""
PREBUILT_ENV = "FIMOE_PREBUILT_KERNELS"
"""Set to a false value to keep torch as the stand-in of an executor that stands in with torch. By default
``prebuilt`` stands in on the devices it loads on (:func:`_prebuilt_stands_in`): in place its cycle kernel
moves each byte once where torch moves it twice (a DeepSeek-V3 FP8 rotate's median layer in a whole model:
1.25-1.28 ms against 2.20-2.33 ms on an H100, benchmarks/RESULTS.md), its strided kernel runs a map of the
strided form in one launch (0.88-1.10 of a copy on an H100 where torch's copies, one per piece and fill slab,
reach 0.87-1.10; a map of two strided stages with two, through an intermediate), it gathers the maps torch runs
as an ``index_select``, and its swizzle kernel runs scale maps that end in the 128x4 swizzle (DeepSeek-R1 NVFP4's
W13 scales at 0.93-0.95 of a copy against torch's 0.49, gpt-oss's at 0.86-0.90 against 0.13)."""


class _Loads:
    """Executors loaded (``ready``), loading (``threads``) or whose background load failed."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.threads: dict[str, threading.Thread] = {}
        self.ready: set[str] = set()
        self.failed: set[str] = set()


_LOADS = _Loads()


def executor_ready(name: str) -> bool:
    """Whether executor ``name`` is loaded (or needs no loading): default calls then run on it."""
    return EXECUTORS[name].load is None or name in _LOADS.ready


def load_executor(name: str) -> None:
    """Load executor ``name`` now (imports, kernels from the on-disk cache), waiting for a background
    load under way; default calls use it from then on. An error of the load is raised here."""
    if executor_ready(name):
        return
    with _LOADS.lock:
        thread = _LOADS.threads.get(name)
    if thread is not None:
        thread.join()
        if name in _LOADS.ready:
            return
    load = EXECUTORS[name].load
    if load is not None:
        load()
    _LOADS.ready.add(name)


def _background_load(ex: Executor) -> None:
    try:
        if ex.load is not None:
            ex.load()
    except BaseException:  # the executor's own call raises it again, in the caller's thread
        _LOADS.failed.add(ex.name)
    else:
        _LOADS.ready.add(ex.name)


def _prebuilt_stands_in(ex: Executor, device: torch.device, em: Optional[ExecMap], in_place: bool) -> bool:
    """Whether ``prebuilt`` stands in for ``ex`` (whose stand-in is torch) for the map ``em`` on ``device``:
    where :data:`PREBUILT_ENV` allows and the fatbins the map needs are not known not to load (loading them is
    the planner's, :func:`.prebuilt.may_run`), in place, and out of place for a map its gather kernel runs
    (:func:`kernel_gathers`)."""
    return (
        ex.stand_in == "torch"
        and em is not None
        and (in_place or kernel_gathers(em))
        and env.value(PREBUILT_ENV, True)
        and _module("prebuilt").may_run(em, in_place, device)
    )


_CALL = threading.local()
"""This thread's :data:`plans_after_the_call` depth and the plans its calls asked for meanwhile."""


class _PlansAfterTheCall:
    """``with plans_after_the_call:`` asks the background planner (:func:`.prebuilt.plan_in_background`) for the
    maps this thread's calls inside the block need planned only when the outermost such block ends, after those
    calls queued their launches (one instance serves every thread and nesting: the state is the thread's).

    The planner is Python on another thread: started mid-call, it takes the GIL from the caller at each torch call
    and launch the caller makes, and a model's first layer (the calls that compile each map and ask for its plan)
    ran 1.5-5 ms longer on an H100 host than with no planner (benchmarks/RESULTS.md). Started after the call, it
    plans while the device runs the layer and the caller loads the next one. The public calls that run a layer
    (the drop-ins, ``LayerPlan.apply``, :func:`~fimoe_lab.kernels.execute` and ``execute_in_place``) hold it."""

    def __enter__(self) -> None:
        _CALL.depth = getattr(_CALL, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _CALL.depth -= 1
        if not _CALL.depth and getattr(_CALL, "asked", None):  # emptied here: outside every block it is empty
            asked, _CALL.asked = _CALL.asked, []
            for em, in_place, device in asked:
                _module("prebuilt").plan_in_background(em, in_place, device)


plans_after_the_call = _PlansAfterTheCall()


def _plan_after_the_call(em: ExecMap, in_place: bool, device: torch.device) -> None:
    """``em``'s plan from the background planner: now, or when this thread's outermost
    :data:`plans_after_the_call` block ends."""
    if getattr(_CALL, "depth", 0):
        _CALL.__dict__.setdefault("asked", []).append((em, in_place, device))
    else:
        _module("prebuilt").plan_in_background(em, in_place, device)


_READY = "prebuilt ready"
"""``ExecMap._dev`` key: the ``(in_place, device)`` on which the prebuilt kernels were found ready to run the map
(fatbins loaded, plan built: both stay), so its later calls there skip the checks."""


def _prebuilt_was_ready(ex: Executor, em: Optional[ExecMap], device: object, in_place: bool) -> bool:
    """Whether ``prebuilt`` stands in for ``ex`` (not loaded) on a map found ready for it on ``device`` before."""
    ready = em is not None and ex.stand_in == "torch" and (in_place, device) in em._dev.get(_READY, ())
    return ready and env.value(PREBUILT_ENV, True)


_KEPT_IN_PLACE = "prebuilt in place"
"""``ExecMap._dev`` key: per device, the in-place strategy of ``prebuilt`` that ``auto`` chose for the map once it was
ready there (fatbins loaded, plan built: the choice no longer moves), so a default call skips the executor's and the
strategy's choice (:func:`kept_in_place`)."""


def keep_in_place(em: ExecMap, device: torch.device, ex: Executor, strategy: InPlace) -> None:
    """Remember ``strategy`` as the in-place one of default calls of ``em`` on ``device`` where ``ex`` is
    ``prebuilt`` and the map was ready for it there (:func:`kept_in_place`)."""
    if ex.name == "prebuilt" and (True, device) in em._dev.get(_READY, ()):
        em._dev.setdefault(_KEPT_IN_PLACE, {})[device] = strategy


def kept_in_place(em: ExecMap, device: torch.device, out_bytes: int) -> Optional[InPlace]:
    """The strategy :func:`keep_in_place` kept for default in-place calls of ``em`` on ``device``, while the default
    executor for ``out_bytes`` there still leaves them to ``prebuilt`` (not loaded itself, :data:`PREBUILT_ENV` on);
    else None (the caller asks :func:`get_executor` and the strategy). A steady layer's call then goes straight to
    its launches (on an H100 host the choice cost about 40 us a map, before the first launch). The strategy stays as
    chosen then: a later change of :data:`.prebuilt.CLUSTERS_ENV` does not move it."""
    kept = em._dev.get(_KEPT_IN_PLACE)
    strategy = kept.get(device) if kept is not None else None
    return strategy if strategy is not None and prebuilt_stands_in(em, device, out_bytes, True) else None


def prebuilt_stands_in(em: ExecMap, device: torch.device, out_bytes: int, in_place: bool) -> bool:
    """Whether a default call of ``em`` on ``device`` (an output of ``out_bytes``; ``in_place``: permuted in place)
    goes to ``prebuilt`` as :func:`get_executor` would answer it, without asking it: the default executor for that
    output loads (not loaded yet, nor failed) and the map was found ready for ``prebuilt`` there before
    (:data:`_READY`, :data:`PREBUILT_ENV` on)."""
    ex = EXECUTORS[pick_backend(device, out_bytes)]
    return _loads_pending(ex) and _prebuilt_was_ready(ex, em, device, in_place)


def _loads_pending(ex: Executor) -> bool:
    """Whether ``ex`` loads and has neither loaded nor failed to yet: while it is, another executor stands in."""
    return ex.load is not None and ex.name not in _LOADS.ready and ex.name not in _LOADS.failed


def execute_kept(em: ExecMap, x: torch.Tensor, out: torch.Tensor) -> bool:
    """A default :func:`execute` of ``em`` from ``x`` into ``out`` that the ``prebuilt`` executor would serve from
    the launches it kept for such a call (:func:`.prebuilt.kept_gather`), run without the executor's choice and the
    gather's checks; False where it would not (nothing run: call :func:`execute`). For a caller that made ``out``
    itself, ``(E, out_bytes)`` contiguous on ``x``'s device, and checked ``x`` (contiguous ``(E, in_bytes)``): a
    layer plan's kept map call (:class:`~fimoe_lab.plan.MapCall`)."""
    if not x.is_cuda or not prebuilt_stands_in(em, x.device, out.nbytes, False):
        return False
    return _module("prebuilt").kept_gather(em, x, out)


def _loaded_or_stand_in(
    ex: Executor, em: Optional[ExecMap] = None, device: torch.device | str | None = None, in_place: bool = False
) -> Executor:
    """``ex`` once loaded; before that, its stand-in with no load started when the stand-in runs ``em``
    at bandwidth (``in_place``: in place), else start its load in the background and return its stand-in
    (in the calling thread instead when :data:`BACKGROUND_ENV` is ``0`` or ``ex`` has no stand-in).

    Where ``prebuilt`` stands in (:func:`_prebuilt_stands_in`) no other load is started, and ``prebuilt`` runs
    once the map is ready for it (its fatbins loaded on the device; in place its cycle plan, a gather its
    sources: :func:`.prebuilt.planned`): the first call of a map asks for that on a background thread and runs
    on torch, so a model's first layer waits neither for the fatbins nor for the plans; but a map of the strided
    form (or of two strided stages) runs on the strided kernel from its first call (in place: each chunk copied
    aside and gathered back on it until the cycle plan is built), whose fatbin the first such call loads
    (:func:`.prebuilt.strided_now`), unless it runs in place along a cycle plan built already. With
    :data:`BACKGROUND_ENV` off the call loads the fatbins itself (and builds the plan when it runs); where they
    do not load, the default path below goes on."""
    if not _loads_pending(ex):
        return ex
    if _prebuilt_was_ready(ex, em, device, in_place):  # ready on this device before: the checks below answered it
        return EXECUTORS["prebuilt"]
    device = torch.device(device if device is not None else "cpu")
    if _prebuilt_stands_in(ex, device, em, in_place):
        assert em is not None
        pre = _module("prebuilt")
        if not env.value(BACKGROUND_ENV, True):
            if pre.loads_for(em, in_place, device):
                return EXECUTORS["prebuilt"]
        else:
            # in place along a cycle plan already built (read back with its layer plan), the cycle kernel runs the
            # call (its fatbin loaded by it): the strided kernel, which would stand in until then, is not loaded
            cycles = in_place and pre.planned(em, True)
            strided = cycles or pre.strided_now(em, in_place, device)  # loads the strided kernel here, once
            if pre.planned(em, in_place, device):
                if device.index is not None:  # "cuda" alone names whichever device is current
                    em._dev.setdefault(_READY, set()).add((in_place, device))
                return EXECUTORS["prebuilt"]
            _plan_after_the_call(em, in_place, device)  # its plan: cycles, sources, a swizzled map's row forms
            return EXECUTORS["prebuilt" if strided else "torch"]
    stand = EXECUTORS[ex.stand_in] if ex.stand_in is not None else None
    if stand is not None and em is not None and stand.at_bandwidth(em, device.type, in_place):
        return stand
    if stand is None or not env.value(BACKGROUND_ENV, True):
        load_executor(ex.name)
        return ex
    with _LOADS.lock:
        if ex.name not in _LOADS.threads:
            thread = threading.Thread(
                target=_background_load, args=(ex,), name=f"fimoe-lab-load-{ex.name}", daemon=True
            )
            _LOADS.threads[ex.name] = thread
            thread.start()
    return ex if ex.name in _LOADS.ready else stand
