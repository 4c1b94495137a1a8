"""Kernels built ahead of time, loaded and launched through the CUDA driver (``libcuda``) with ctypes.

Nothing is compiled when a process runs: the kernels of ``kernels/cuda/*.cu`` ship as one fatbin per
source (``scripts/build_cuda_kernels.py``: SASS for sm_80, sm_90, sm_100 and sm_120, and compute_90 PTX
that the driver compiles once for a newer GPU). A fatbin is loaded into the device's primary context,
the one torch uses, when first asked for (:func:`available`, in the asking thread: milliseconds the caller
waits; :func:`tried` tells, without loading, whether that happened); a launch goes on torch's current
stream. A driver that cannot load the fatbin (older than the CUDA 13 toolkit that built it, or a GPU none of
it runs on) makes the kernels unavailable (:func:`available`); callers then use another executor.

Arguments are passed as ``(ctypes type, value)`` pairs: ``ctypes.c_void_p`` for a device address,
``ctypes.c_int`` / ``ctypes.c_longlong`` for integers, in the kernel's parameter order.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from importlib import resources
from typing import Any

import torch

__all__ = [
    "Bound",
    "CudaDriverError",
    "allow_clusters",
    "available",
    "cuda_index",
    "kernel",
    "launch",
    "max_active_clusters",
    "run",
    "tried",
]

_SUCCESS = 0


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error."""


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    p, i = ctypes.c_void_p, ctypes.c_int
    signatures: dict[str, list[Any]] = {
        "cuGetErrorName": [i, ctypes.POINTER(ctypes.c_char_p)],
        "cuDeviceGet": [ctypes.POINTER(i), i],
        "cuDevicePrimaryCtxRetain": [ctypes.POINTER(p), i],
        "cuCtxGetCurrent": [ctypes.POINTER(p)],
        "cuCtxSetCurrent": [p],
        "cuModuleLoadData": [ctypes.POINTER(p), p],
        "cuModuleGetFunction": [ctypes.POINTER(p), p, ctypes.c_char_p],
        "cuLaunchKernelEx": [p, p, p, p],
        "cuFuncSetAttribute": [p, i, i],
        "cuOccupancyMaxActiveClusters": [ctypes.POINTER(i), p, p],
    }
    for name, args in signatures.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:  # a driver older than CUDA 12: it loads no fatbin of ours either
            raise CudaDriverError(f"libcuda has no {name}: the driver is older than CUDA 12") from None
        fn.argtypes, fn.restype = args, i
    return lib


def _check(result: int, call: str) -> None:
    if result != _SUCCESS:
        name = ctypes.c_char_p()
        _lib().cuGetErrorName(result, ctypes.byref(name))
        raise CudaDriverError(f"{call} failed: {(name.value or b'unknown error').decode()} ({result})")


class _Module:
    """One fatbin loaded into one device's primary context, and its functions."""

    def __init__(self, image: bytes, device: int):
        lib = _lib()
        dev, ctx, mod = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
        _check(lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        self.context = ctx.value
        self._image = ctypes.create_string_buffer(image, len(image))  # kept for the module's life
        with self.current():
            _check(lib.cuModuleLoadData(ctypes.byref(mod), self._image), "cuModuleLoadData")
        self.handle = mod.value
        self.functions: dict[str, int] = {}

    def current(self):
        """A context manager that makes this module's context current in the calling thread."""
        return _Current(self.context)

    def function(self, name: str) -> int:
        if name not in self.functions:
            fn = ctypes.c_void_p()
            _check(
                _lib().cuModuleGetFunction(ctypes.byref(fn), self.handle, name.encode()), f"cuModuleGetFunction({name})"
            )
            self.functions[name] = fn.value
        return self.functions[name]


class _Current:
    """Make a context current for a block, then put back the one that was."""

    def __init__(self, context: int):
        self.context, self.before = context, ctypes.c_void_p()

    def __enter__(self) -> None:
        lib = _lib()
        _check(lib.cuCtxGetCurrent(ctypes.byref(self.before)), "cuCtxGetCurrent")
        if self.before.value != self.context:
            _check(lib.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def __exit__(self, *exc: object) -> None:
        if self.before.value != self.context:
            _lib().cuCtxSetCurrent(self.before)


_MODULES: dict[tuple[str, int], _Module] = {}
_LOCK = threading.Lock()


def _module(source: str, device: int) -> _Module:
    key = (source, device)
    if key not in _MODULES:
        with _LOCK:
            if key not in _MODULES:
                torch.cuda.init()  # the primary context torch uses exists before we retain it
                image = resources.files("fimoe_lab.kernels").joinpath(f"cuda/{source}.fatbin").read_bytes()
                _MODULES[key] = _Module(image, device)
    return _MODULES[key]


_OUTCOMES: dict[tuple[str, int], bool] = {}
"""Whether each ``(source, device index)`` loaded, once it was tried."""


def cuda_index(device: torch.device | str) -> int | None:
    """The index of CUDA ``device`` (its current device where it names none); None for any other device or where
    torch has no CUDA."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    return dev.index if dev.index is not None else torch.cuda.current_device()


def available(source: str, device: torch.device | str) -> bool:
    """Whether the fatbin ``kernels/cuda/<source>.fatbin`` loads on CUDA ``device`` here: loaded by the first
    call (in its thread, a few milliseconds), remembered after."""
    index = cuda_index(device)
    if index is None:
        return False
    key = (source, index)
    if key not in _OUTCOMES:
        try:
            _module(source, index)
        except (OSError, CudaDriverError):  # no libcuda, or a driver / GPU the fatbin does not serve
            _OUTCOMES[key] = False
        else:
            _OUTCOMES[key] = True
    return _OUTCOMES[key]


def tried(source: str, device: torch.device | str) -> bool | None:
    """:func:`available`'s answer where it was asked for ``source`` on ``device`` (False on any device but a CUDA
    one), None where it was not: loads nothing."""
    index = cuda_index(device)
    return False if index is None else _OUTCOMES.get((source, index))


def kernel(source: str, name: str, device: torch.device) -> tuple[_Module, int]:
    """The module of ``source`` on ``device`` and its function ``name`` (loaded on first use)."""
    module = _module(source, device.index if device.index is not None else torch.cuda.current_device())
    return module, module.function(name)


class _LaunchConfig(ctypes.Structure):
    """The driver's ``CUlaunchConfig``: grid, block, dynamic shared memory, stream and launch attributes (none, or
    one :class:`_ClusterDims`)."""

    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.c_void_p),
        ("num_attrs", ctypes.c_uint),
    ]


class _ClusterDims(ctypes.Structure):
    """The driver's ``CUlaunchAttribute`` that groups a launch's blocks into clusters
    (``CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION``: id, padding to 8 bytes, then a 64-byte value whose first three
    words are the cluster's x, y, z)."""

    _fields_ = [
        ("id", ctypes.c_uint),
        ("pad", ctypes.c_uint),
        ("dims", ctypes.c_uint * 3),
        ("rest", ctypes.c_char * 52),
    ]


_CLUSTER_DIMENSION = 4
_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14


def _configure(config: _LaunchConfig, dims: _ClusterDims, cluster: int, shared_bytes: int) -> None:
    """Set ``config``'s dynamic shared memory and, for ``cluster`` > 1, point it at ``dims`` set to that cluster."""
    config.shared_bytes = shared_bytes
    if cluster > 1:
        dims.id, dims.dims[:] = _CLUSTER_DIMENSION, (cluster, 1, 1)
        config.attrs, config.num_attrs = ctypes.addressof(dims), 1
    else:
        config.attrs, config.num_attrs = None, 0


def allow_clusters(source: str, name: str, device: torch.device, shared_bytes: int) -> None:
    """Let function ``name`` of ``source`` on ``device`` take ``shared_bytes`` of dynamic shared memory a block and
    clusters of more than 8 blocks (the driver refuses both by default)."""
    module, fn = kernel(source, name, device)
    with module.current():
        lib = _lib()
        _check(lib.cuFuncSetAttribute(fn, _MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_bytes), "cuFuncSetAttribute")
        _check(lib.cuFuncSetAttribute(fn, _NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1), "cuFuncSetAttribute")


def max_active_clusters(
    source: str, name: str, device: torch.device, block: tuple[int, int, int], shared_bytes: int, cluster: int
) -> int:
    """How many clusters of ``cluster`` blocks (``block`` threads, ``shared_bytes`` of dynamic shared memory each) of
    function ``name`` run at once on ``device``: 0 where none can (:func:`allow_clusters` first)."""
    module, fn = kernel(source, name, device)
    config, dims = _LaunchConfig(), _ClusterDims()
    config.grid[:], config.block[:] = (cluster, 1, 1), block
    _configure(config, dims, cluster, shared_bytes)
    count = ctypes.c_int()
    with module.current():
        result = _lib().cuOccupancyMaxActiveClusters(ctypes.byref(count), fn, ctypes.byref(config))
    return count.value if result == _SUCCESS else 0


class _Launch:
    """One function's launches: its ctypes argument values, the pointer array the driver reads and a launch
    configuration, built once and refilled per launch under a lock (the driver copies them during the call).
    ``cuLaunchKernelEx`` reads grid, block and stream from that one struct: on an H100 host the driver call took
    4.2 us where ``cuLaunchKernel``, its eleven arguments converted per call, took 8.3 (benchmarks/RESULTS.md,
    "Steady calls")."""

    def __init__(self, module: _Module, fn: int, kinds: tuple[type, ...]):
        self.module, self.fn = module, fn
        self.values = [kind() for kind in kinds]
        pointers = [ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in self.values]
        self.params = (ctypes.c_void_p * len(kinds))(*pointers)
        self.config, self.dims = _LaunchConfig(), _ClusterDims()
        self.config_ref = ctypes.byref(self.config)
        self.lock = threading.Lock()

    def set(
        self,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: list[tuple[type, int]],
        cluster: int = 1,
        shared_bytes: int = 0,
    ) -> None:
        """Set the grid, the block, the cluster (blocks along x), the dynamic shared memory and every argument's
        value (``(ctypes type, value)`` pairs, in order)."""
        self.config.grid[:] = grid
        self.config.block[:] = block
        _configure(self.config, self.dims, cluster, shared_bytes)
        for value, (_, arg) in zip(self.values, args):
            value.value = arg

    def fire(self, index: int, name: str) -> None:
        """Launch with the values and grid as set, on torch's current stream of device ``index`` (caller holds
        :attr:`lock`), in the module's context (made current for the call where another one is)."""
        self.config.stream = _current_stream(index)
        with self.module.current():
            result = _lib().cuLaunchKernelEx(self.config_ref, self.fn, self.params, None)
        if result != _SUCCESS:
            _check(result, f"cuLaunchKernelEx({name})")


_LAUNCHES: dict[tuple, _Launch] = {}
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(index: int) -> int:
    """The handle of torch's current stream on CUDA device ``index``: read directly where torch offers it (a
    ``torch.cuda.Stream`` object built per launch costs more than the launch)."""
    if _RAW_STREAM is not None:
        return _RAW_STREAM(index)
    return torch.cuda.current_stream(index).cuda_stream


def launch(
    source: str,
    name: str,
    device: torch.device,
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    args: list[tuple[type, int]],
    cluster: int = 1,
    shared_bytes: int = 0,
) -> None:
    """Launch function ``name`` of ``source``'s fatbin on ``device``'s current torch stream (its blocks in clusters of
    ``cluster`` along x, each with ``shared_bytes`` of dynamic shared memory: :func:`allow_clusters` first)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (source, name, index)
    prepared = _LAUNCHES.get(key)
    if prepared is None:
        kinds = tuple(kind for kind, _ in args)  # a kernel's parameter types are its own: fixed per function
        prepared = _LAUNCHES.setdefault(key, _Launch(*kernel(source, name, torch.device("cuda", index)), kinds))
    with prepared.lock:
        prepared.set(grid, block, args, cluster, shared_bytes)
        prepared.fire(index, name)


class Bound:
    """A launch of function ``name`` of ``source``'s fatbin on CUDA device ``index`` with its grid, block and
    arguments fixed, but for the first ones: the device addresses each :func:`run` gives (``args``: ``(ctypes type,
    value)`` pairs, those first values placeholders). Its ctypes arguments are its own, built by its first run, so
    a run sets only the addresses: the steady calls of a map (a model's every layer) pay a few microseconds."""

    def __init__(
        self,
        source: str,
        name: str,
        index: int,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: list[tuple[type, int]],
    ):
        self.source, self.name, self.index, self.grid, self.block, self.args = source, name, index, grid, block, args
        self._launch: _Launch | None = None

    def _built(self) -> _Launch:
        if self._launch is None:
            module, fn = kernel(self.source, self.name, torch.device("cuda", self.index))
            built = _Launch(module, fn, tuple(kind for kind, _ in self.args))
            built.set(self.grid, self.block, self.args)
            self._launch = built
        return self._launch


def run(bound: Bound, *addresses: int) -> None:
    """Launch ``bound`` on its device's current torch stream, its first arguments set to ``addresses``."""
    built = bound._launch or bound._built()
    with built.lock:
        for value, address in zip(built.values, addresses):
            value.value = address
        built.fire(bound.index, bound.name)
