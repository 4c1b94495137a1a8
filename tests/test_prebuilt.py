"""The kernels that ship prebuilt: the fatbin is its source's build, the launch geometry fits the kernel, and
without a GPU the executor says so. The kernels themselves run in tests/test_kernels_gpu.py (on a device).
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from fimoe_lab import env
from fimoe_lab.errors import FimoeError, FormatError, LayoutError
from fimoe_lab.kernels import available_backends, execute_in_place, prebuilt, registry
from fimoe_lab.kernels.device_tables import DeviceTables
from fimoe_lab.prepare import plan_layer

REAL_LAUNCH, REAL_RUN = prebuilt.cuda_driver.launch, prebuilt.cuda_driver.run  # the driver's, kept before the
# emulation stands in for them
ROOT = Path(__file__).resolve().parents[1]
CUDA = ROOT / "fimoe_lab" / "kernels" / "cuda"
BUILD = json.loads((CUDA / "BUILD.json").read_text())


def _build_script():
    spec = importlib.util.spec_from_file_location("build_cuda_kernels", ROOT / "scripts" / "build_cuda_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_shipped_fatbin_is_recorded_with_its_source():
    sources = sorted(p.name for p in CUDA.glob("*.cu"))
    assert sources and sorted(BUILD["sources"]) == sources
    for name, rec in BUILD["sources"].items():
        assert hashlib.sha256((CUDA / name).read_bytes()).hexdigest() == rec["sha256"], f"{name} changed: rebuild"
        assert hashlib.sha256((CUDA / rec["fatbin"]).read_bytes()).hexdigest() == rec["fatbin_sha256"]
    headers = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in CUDA.glob("*.cuh")}
    assert headers and BUILD["headers"] == headers, "a shared header changed: rebuild"
    assert BUILD["flags"] == _build_script().flags()
    assert sorted(p.name for p in CUDA.glob("*.fatbin")) == sorted(r["fatbin"] for r in BUILD["sources"].values())


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_shipped_fatbin_is_rebuilt_byte_for_byte(tmp_path):
    """nvcc of the recorded release builds every source into the very bytes that ship."""
    script = _build_script()
    release = script.nvcc_release()
    if release != BUILD["nvcc"]:
        pytest.skip(f"nvcc {release} here; the fatbins were built with {BUILD['nvcc']}")
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build_cuda_kernels.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    for rec in BUILD["sources"].values():
        assert (tmp_path / rec["fatbin"]).read_bytes() == (CUDA / rec["fatbin"]).read_bytes()


def _defines(source: str) -> dict[str, int]:
    """The numeric ``#define``s of a source and of the headers it includes."""
    text = (CUDA / source).read_text()
    for header in re.findall(r'^#include "(\w+\.cuh)"$', text, flags=re.M):
        text += (CUDA / header).read_text()
    return {k: int(v) for k, v in re.findall(r"^#define (\w+) (\d+)$", text, flags=re.M)}


@pytest.mark.parametrize(
    "source,macro,functions",
    [
        ("cycles.cu", "CYCLE_KERNEL", prebuilt._FUNCTIONS),
        ("gather.cu", "GATHER_KERNEL", prebuilt._GATHERS),
        ("swizzle.cu", "SWIZZLE_KERNEL", prebuilt._SWIZZLES),
        ("strided.cu", "STRIDED_KERNEL", prebuilt._STRIDEDS),
    ],
)
def test_the_launcher_and_the_kernels_agree_on_their_constants(source, macro, functions):
    defines = _defines(source)
    assert (defines["THREADS"], defines["ITEMS"]) == (prebuilt.THREADS, prebuilt.ITEMS)
    if source == "swizzle.cu":
        got = (defines["BAND_ROWS"], defines["TILE_WORDS"], defines["MIN_KW"], defines["CHUNK"], defines["MAX_SPANS"])
        assert got == (prebuilt.BAND_ROWS, prebuilt.TILE_WORDS, prebuilt.MIN_KW, prebuilt.CHUNK, prebuilt.MAX_SPANS)
        stage = re.search(r"^#define STAGE_CHUNKS \((.*)\)$", (CUDA / source).read_text(), flags=re.M)
        assert stage and eval(stage.group(1), {}, defines) == prebuilt.STAGE_CHUNKS  # noqa: S307 - our own source
    if source == "strided.cu":
        assert defines["MAX_DIGITS"] == prebuilt.MAX_DIGITS
        got = [defines[k] for k in ("FORM_DIGITS", "FORM_OFFSET", "FORM_FILL", "FORM_HEAD", "FORM_PER_DIGIT")]
        assert got == [0, 1, 2, 3, 5]  # strided_form_table's layout
        assert defines["FORM_HEAD"] + defines["FORM_PER_DIGIT"] * defines["MAX_DIGITS"] == defines["FORM_WORDS"]
        assert (
            defines["FORM_WORDS"] == prebuilt.FORM_WORDS
            and ctypes.sizeof(prebuilt.FormTable) == 8 * prebuilt.FORM_WORDS
        )
    text = (CUDA / source).read_text()
    for key, name in functions.items():
        kernel_macro = "SWIZZLE_SPANS_KERNEL" if key == "spans" else macro
        assert re.search(rf"^{kernel_macro}\({name}[,)]", text, flags=re.M)


def test_the_launcher_and_the_cluster_kernel_agree_on_their_constants():
    """``cluster.cu``'s threads a block and words a thread holds in registers are the geometry's; its functions are
    the ones the launcher names, with the parameters it passes."""
    defines = _defines("cluster.cu")
    got = (defines["CLUSTER_THREADS"], defines["CLUSTER_REGISTER_WORDS"], defines["SCATTER_THREADS"])
    assert got == (prebuilt.CLUSTER_THREADS, prebuilt.CLUSTER_REGISTER_WORDS, prebuilt.SCATTER_THREADS)
    text = (CUDA / "cluster.cu").read_text()
    for mode, name in prebuilt._CLUSTERS.items():
        table = "dst" if mode == "scatter" else "src"
        params = (
            rf"word16\* x, const int\* __restrict__ {table}, int cells, int cw, long long expert_words,\s+int slice,"
        )
        assert re.search(rf"^\s+{name}\({params}\s+int experts\)", text, flags=re.M)


@settings(max_examples=300, deadline=None)
@given(cell_words=st.integers(1, 1 << 16), word=st.sampled_from([1, 4, 16]), cells=st.integers(1, 5000))
def test_a_tile_fills_the_block_and_covers_the_cell(cell_words, word, cells):
    """``BM * BW`` is exactly the block's words, ``BW`` divides the cell, ``NC * BW`` covers it, and a tile holds
    at least 32 slots (so the plan's tiles cut few cycles) or, for an expert of fewer cells, all of them; ``BW`` is
    the widest power of two that allows it."""
    bm, bw, nc = prebuilt.cycle_tile(cell_words * word, word, cells)
    block = prebuilt.THREADS * prebuilt.ITEMS
    assert bm * bw == block
    assert cell_words % bw == 0 and nc * bw == cell_words and bw & (bw - 1) == 0
    least = min(block // prebuilt.MAX_BW, cells)
    assert bm >= least and (bm // 2 < least or cell_words % (2 * bw))  # the widest BW that keeps bm >= least


def test_an_expert_of_two_cells_takes_two_slots_of_a_thousand_words():
    """A swap of an expert's halves (two 917,504-byte cells of 16-byte words, DeepSeek-R1's NVFP4 W13): tiles of 2
    slots x 1,024 words, 56 blocks a tile, where 32 slots x 64 words used 2 of every block's 32 slots."""
    assert prebuilt.cycle_tile(917_504, 16, 2) == (2, 1024, 56)
    assert prebuilt.cycle_tile(7168, 16, 512) == (32, 64, 7)  # an FP8 rotate's rows: as before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_without_a_gpu_the_prebuilt_executor_is_unavailable_and_says_what_it_needs():
    assert not prebuilt.available("cuda") and "prebuilt" not in available_backends("cuda")
    assert "prebuilt" not in available_backends("cpu")
    m = plan_layer("fp8", "trtllm", 256, 512).w13
    x = torch.randint(0, 256, (2, m.in_bytes), dtype=torch.uint8)
    with pytest.raises(FormatError, match="prebuilt.*needs a cuda device and a driver that loads its fatbin"):
        execute_in_place(m.compiled(), x.clone(), backend="prebuilt")


def test_the_prebuilt_stand_in_is_asked_for_by_a_checked_variable(monkeypatch):
    """``FIMOE_PREBUILT_KERNELS`` is read as a bool where the registry decides (a bad spelling is an error
    naming it), and the prebuilt executor only ever stands in on a device the kernels load on: on the CPU,
    numba's stand-in stays torch."""
    em = plan_layer("fp8", "trtllm", 256, 512).w13.compiled()
    numba, cpu = registry.EXECUTORS["numba"], torch.device("cpu")
    monkeypatch.setenv(registry.PREBUILT_ENV, "perhaps")
    with pytest.raises(FimoeError, match=registry.PREBUILT_ENV):
        registry._prebuilt_stands_in(numba, cpu, em, True)
    for value in ("1", "0"):
        monkeypatch.setenv(registry.PREBUILT_ENV, value)
        assert not registry._prebuilt_stands_in(numba, cpu, em, True)
        assert registry._loaded_or_stand_in(numba, em, "cpu", in_place=True).name in ("torch", "numba")
    monkeypatch.delenv(registry.PREBUILT_ENV)
    assert env.value(registry.PREBUILT_ENV, True) is True
    if not torch.cuda.is_available():
        assert not registry._prebuilt_stands_in(registry.EXECUTORS["triton"], torch.device("cuda"), em, True)


def test_the_planner_shortens_the_switch_interval_while_it_has_work_then_puts_it_back(monkeypatch):
    """While the planner thread has maps to plan, Python's switch interval is at most
    ``PLANNER_SWITCH_INTERVAL_S`` (the caller, giving up the GIL on every torch call, waits at most that for it);
    once its queue is empty the interval is the caller's again, unless the caller changed it meanwhile."""
    import sys
    import threading
    import time

    seen: list[float] = []
    release = threading.Event()

    def build(em, in_place, device=None):  # a plan that takes a while, like a real cycle plan of a full expert
        seen.append(sys.getswitchinterval())
        release.wait(5)

    def settled(what) -> None:  # the planner thread ends its job just after join() returns
        deadline = time.monotonic() + 5
        while not what() and time.monotonic() < deadline:
            time.sleep(0.005)

    monkeypatch.setattr(prebuilt, "build_plan", build)
    planner = prebuilt._Planner()
    maps = [plan_layer("bf16", "trtllm", inter, 1536).w2.compiled() for inter in (384, 512, 640)]
    before = sys.getswitchinterval()
    assert before > prebuilt.PLANNER_SWITCH_INTERVAL_S  # Python's default, 5 ms
    try:
        for em in maps[:2]:
            planner.submit(em, True, None)
        release.set()
        planner.jobs.join()
        settled(lambda: sys.getswitchinterval() == before)
        assert seen == [pytest.approx(prebuilt.PLANNER_SWITCH_INTERVAL_S)] * 2 and sys.getswitchinterval() == before

        release.clear()
        planner.submit(maps[2], True, None)
        settled(lambda: len(seen) == 3)
        sys.setswitchinterval(0.001)  # the caller's own choice while the planner works: kept
        release.set()
        planner.jobs.join()
        time.sleep(0.05)
        assert len(seen) == 3 and sys.getswitchinterval() == pytest.approx(0.001)
    finally:
        sys.setswitchinterval(before)


def test_the_fatbins_a_map_needs_load_on_the_planner_thread(monkeypatch):
    """A map's first default call loads no fatbin but the strided kernel's, which runs a map of the strided form at
    once: the planner thread loads the ones a map needs (in place the cycle kernel's, a gather of the strided form
    the strided kernel's, another the gather kernel's and, for a map that ends in the swizzle, the swizzle kernel's
    too)
    on the caller's device and gets their kernels, then the map is planned there (its cycle plan or row table
    copied there on the planner's thread). A fatbin that does not load is remembered, and the
    prebuilt kernels stop standing in for the maps that need it. The driver's load is played by a recorder here
    (no GPU); tests/test_kernels_gpu.py checks the same in a fresh process on a device."""
    import threading

    from fimoe_lab.kernels import cuda_driver, cycles

    loads: list[tuple[str, int, str]] = []
    got: set[tuple[str, str, int, str]] = set()  # (source, kernel, device, thread)

    class Module:  # the driver's module: its kernels got by name (loaded then, with CUDA's lazy loading)
        def __init__(self, source: str, index: int):
            self.source, self.index = source, index

        def function(self, name: str) -> int:
            got.add((self.source, name, self.index, threading.current_thread().name))
            return 1

    modules: dict[tuple[str, int], Module] = {}

    def load(source: str, index: int) -> Module:  # loaded once, as cuda_driver._module does
        if (source, index) not in modules:
            loads.append((source, index, threading.current_thread().name))
            if (source, index) == ("swizzle", 6):
                raise cuda_driver.CudaDriverError("cuModuleLoadData failed: CUDA_ERROR_NO_BINARY_FOR_GPU (209)")
            modules[source, index] = Module(source, index)
        return modules[source, index]

    tables: list[tuple[str, str, bool, str]] = []  # (map, device, waited, thread)

    def table(em, device, wait=False):  # the row table's copy to the device (none here): recorded, then kept
        tables.append((em.name, str(device), wait, threading.current_thread().name))
        em._dev[("swizzle rows", str(device))] = DeviceTables((np.zeros(1, np.int32),), torch.device("cpu"), True)
        return em._dev[("swizzle rows", str(device))]

    def cycles_on(plan, device, wait=False):  # the cycle plan's copy to the device: recorded, then kept
        tables.append(("cycle plan", str(device), wait, threading.current_thread().name))
        plan._dev[str(device)] = (torch.zeros(1, dtype=torch.int32),) * 3
        return plan._dev[str(device)]

    monkeypatch.setattr(cuda_driver, "_OUTCOMES", {})
    monkeypatch.setattr(cuda_driver, "_module", load)
    monkeypatch.setenv(prebuilt.CLUSTERS_ENV, "0")  # the cycle plan (the cluster kernels' own planning: below)
    monkeypatch.setattr(prebuilt, "swizzle_rows_table", table)
    monkeypatch.setattr(cycles.CyclePlan, "on", cycles_on)
    # Triton not loaded, as in a fresh process, whatever earlier tests on a GPU machine loaded
    monkeypatch.setattr(registry._LOADS, "ready", set())
    monkeypatch.setattr(registry._LOADS, "failed", set())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    swizzled = plan_layer("nvfp4", "trtllm", 384, 1536).w13_scale.compiled()  # shapes no other test plans
    rows = plan_layer("bf16", "trtllm", 384, 1536).w2.compiled()  # no swizzle
    permuted = plan_layer("fp8", "trtllm", 384, 1536).w13.compiled()
    assert swizzled.ends_swizzled and not rows.ends_swizzled and permuted.is_permutation
    triton = registry.EXECUTORS["triton"]
    planner = prebuilt.PLANNER_THREAD

    dev = torch.device("cuda")  # the current device, 5: the caller's, not the planner thread's
    caller = threading.current_thread().name
    assert registry._prebuilt_stands_in(triton, dev, swizzled, False) and not prebuilt.planned(swizzled, False, dev)
    assert prebuilt.runs_strided(swizzled)  # the 128x4 swizzle alone is a strided view
    # its first call loads the strided kernel (no plan needed) and runs on it; the planner asked for the rest
    assert registry._loaded_or_stand_in(triton, swizzled, dev).name == "prebuilt"
    assert loads[0] == ("strided", 5, caller)
    prebuilt.plan_in_background(permuted, True, dev)
    prebuilt.wait_for_plans()
    assert loads == [("strided", 5, caller), ("swizzle", 5, planner), ("cycles", 5, planner)]
    kernels = {"strided": prebuilt._STRIDEDS, "swizzle": prebuilt._SWIZZLES, "cycles": prebuilt._FUNCTIONS}
    assert got == {(src, name, 5, planner) for src, names in kernels.items() for name in names.values()}  # the
    # planner got them all
    # the row table and the cycle plan put there by the planner, each waited for
    assert tables == [(swizzled.name, "cuda:5", True, planner), ("cycle plan", "cuda:5", True, planner)]
    assert prebuilt.planned(swizzled, False, dev) and prebuilt.planned(permuted, True, dev)
    assert registry._loaded_or_stand_in(triton, swizzled, dev).name == "prebuilt"
    assert prebuilt.planned(swizzled, False) and not prebuilt.planned(swizzled, False, "cuda:6")  # not loaded there

    loads.clear()
    for em in (swizzled, rows):
        prebuilt.plan_in_background(em, False, "cuda:6")
    prebuilt.wait_for_plans()
    assert loads == [("strided", 6, planner), ("swizzle", 6, planner)]  # the strided kernel's loads once
    assert ("strided", "fimoe_strided_w16", 6, planner) in got
    assert cuda_driver.tried("swizzle", "cuda:6") is False and cuda_driver.tried("cycles", "cuda:6") is None
    assert not prebuilt.may_run(swizzled, False, "cuda:6") and not prebuilt.planned(swizzled, False, "cuda:6")
    assert not registry._prebuilt_stands_in(triton, torch.device("cuda:6"), swizzled, False)
    assert prebuilt.may_run(rows, False, "cuda:6") and prebuilt.may_run(permuted, True, "cuda:6")
    assert not prebuilt.may_run(rows, False, "cpu") and not prebuilt.available("cuda:6")


# ----------------------------------------------------------------------------- the kernel source, run on the host
@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """``kernels/cuda/cycles.cu`` compiled for the host (``tests/cuda_host``: threads and a barrier for a block),
    put where :func:`fimoe_lab.kernels.cuda_driver.launch` and :func:`~fimoe_lab.kernels.cuda_driver.run` would start
    the GPU kernel: the launcher's own geometry, plan and arguments drive the kernel's own source, on CPU memory.
    Yields the names launched."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    lib_path = tmp_path_factory.mktemp("emulated") / "prebuilt.so"
    host = ROOT / "tests" / "cuda_host"
    cmd = ["g++", "-O1", "-std=c++20", "-pthread", "-shared", "-fPIC", "-x", "c++", "-I", str(CUDA)]
    cmd += ["-include", str(host / "prelude.h"), str(host / "emulate.cpp"), "-o", str(lib_path)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    lib = ctypes.CDLL(str(lib_path))

    launched: list[str] = []

    def by_value(kind, value):  # a structure (the strided kernel's form table) set as the driver's launch sets it
        if not issubclass(kind, ctypes.Structure):
            return value
        made = kind()
        made.value = value
        return made

    def launch(source, name, device, grid, block, args, cluster=1, shared_bytes=0):
        assert source in prebuilt._KERNELS
        assert grid[2] == 1 and block[1:] == (1, 1)
        assert grid[0] % cluster == 0 and (cluster == 1 or source == prebuilt.CLUSTER_SOURCE)
        launched.append(name)
        fn = getattr(lib, f"emulate_{name}")
        fn.restype = None
        head = [grid[0], grid[1], block[0]] + ([cluster, shared_bytes] if source == prebuilt.CLUSTER_SOURCE else [])
        fn.argtypes = [ctypes.c_uint] * len(head) + [kind for kind, _ in args]
        fn(*head, *[by_value(kind, value) for kind, value in args])

    def run(bound, *addresses):  # a bound launch: its own arguments, the call's addresses first
        args = [(kind, a) for (kind, _), a in zip(bound.args, addresses)] + bound.args[len(addresses) :]
        launch(bound.source, bound.name, bound.index, bound.grid, bound.block, args)

    saved = prebuilt.cuda_driver.launch, prebuilt.cuda_driver.run
    prebuilt.cuda_driver.launch, prebuilt.cuda_driver.run = launch, run
    yield launched
    prebuilt.cuda_driver.launch, prebuilt.cuda_driver.run = saved


def run_emulated(m, x: torch.Tensor, scratch: int) -> None:
    flat = x.view(x.shape[0], -1).view(torch.uint8)
    for _ in prebuilt.inplace_cycles(m.compiled(), flat, scratch):
        pass


def shifted_copy(x: torch.Tensor, shift: int) -> torch.Tensor:
    """A copy of ``x`` starting ``shift`` bytes past a 16-byte aligned address."""
    raw = torch.empty(x.numel() + 16, dtype=torch.uint8)
    base = (-raw.data_ptr()) % 16
    y = raw[base + shift : base + shift + x.numel()].view(x.shape)
    y.copy_(x)
    return y


def host_inputs(m, experts: int):
    """Coordinate-coded bytes (each 4-byte word its own index + 1) and random bytes."""
    words = -(-m.in_bytes // 4)
    coded = torch.arange(1, experts * words + 1, dtype=torch.int32).view(torch.uint8).view(experts, -1)
    yield coded[:, : m.in_bytes].contiguous()
    yield torch.randint(0, 256, (experts, m.in_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))


def in_place_maps():
    from fimoe_lab.prepare import drop_in_maps

    for fmt, inter, hidden in (("fp8", 96, 256), ("bf16", 64, 256), ("fp8", 64, 128)):
        for name, (m, in_place) in drop_in_maps(fmt, inter, hidden).items():
            if in_place:
                yield pytest.param(m, id=f"drop-in-{fmt}-{inter}x{hidden}-{name}")
    for fmt, inter, hidden in (("fp8-block", 128, 256), ("mxfp8", 128, 256), ("nvfp4", 128, 256), ("bf16", 64, 128)):
        for name, m in plan_layer(fmt, "trtllm", inter, hidden).maps().items():
            if m.is_permutation:
                yield pytest.param(m, id=f"layer-{fmt}-{inter}x{hidden}-{name}")


@pytest.mark.parametrize(
    "fmt,inter,hidden,tensor",
    [("fp8", 160, 384, "w13"), ("bf16", 384, 640, "w2"), ("fp8-block", 384, 640, "w13")],
)
def test_cycle_plans_built_in_the_background_are_the_ones_a_launch_uses(
    emulated, monkeypatch, fmt, inter, hidden, tensor
):
    """After the background planner, the launcher builds no plan of its own and the kernel's source gives the
    gather's bytes; asking twice queues once; a map no cycle plan fits leaves nothing and no hang."""
    from fimoe_lab.kernels import cycles

    m = getattr(plan_layer(fmt, "trtllm", inter, hidden), tensor)  # permutations of shapes no other test plans
    em = m.compiled()
    assert not prebuilt.planned(em, True)
    prebuilt.plan_in_background(em, True)
    prebuilt.plan_in_background(em, True)
    prebuilt.wait_for_plans()
    assert prebuilt.planned(em, True)
    built = []
    real = cycles.plan_permutation
    monkeypatch.setattr(cycles, "plan_permutation", lambda *a: built.append(a) or real(*a))
    for x in host_inputs(m, 3):
        want = m.apply(x.view((3,) + m.in_shape), backend="torch").reshape(3, -1)
        run_emulated(m, x, 2)
        assert torch.equal(x, want)
    assert built == []
    padded_map = plan_layer("fp8", "trtllm", 200, 512).w13  # I padded to 208: not a permutation
    assert not padded_map.is_permutation
    padded = padded_map.compiled()
    prebuilt.plan_in_background(padded, True)
    prebuilt.wait_for_plans()
    assert not prebuilt.planned(padded, True)


def test_a_gather_of_two_strided_stages_gets_its_sources_in_the_background(emulated):
    """A map run as two strided stages knows no cell sources until read; the background planner reads them,
    after which the gather kernel's source (through the launcher) gives the byte-loop reference's bytes."""
    from reference_loops import byte_gather

    m = plan_layer("mxfp4", "trtllm", 1440, 2880).w13_scale  # a shape no other test plans
    em = m.compiled()
    assert em.stages is not None and not prebuilt.planned(em, False)
    prebuilt.plan_in_background(em, False)
    prebuilt.wait_for_plans()
    assert prebuilt.planned(em, False)
    for x in host_inputs(m, 2):
        out = torch.full((2, m.out_bytes), 0x5A, dtype=torch.uint8)
        prebuilt.gather(em, x, out)
        assert torch.equal(out, byte_gather(m, x).reshape(2, -1))


@pytest.mark.parametrize("shift", [0, 4, 1], ids=["w16", "w4", "w1"])
@pytest.mark.parametrize("m", list(in_place_maps()))
def test_the_kernel_source_permutes_every_engine_map_in_place(emulated, m, shift):
    """Every permutation the drop-ins and layer plans run in place, through the launcher and the kernel source:
    the byte-loop reference's bytes, for each word the buffer's alignment allows (``shift`` bytes off 16)."""
    from reference_loops import byte_gather

    for x in host_inputs(m, 3):
        y = shifted_copy(x, shift)
        run_emulated(m, y, 1)
        assert torch.equal(y, byte_gather(m, x))


@pytest.mark.parametrize("m", list(in_place_maps()))
def test_the_default_in_place_strategy_of_every_engine_map(emulated, clusters, monkeypatch, m):
    """Once planned (as the planner thread leaves a map), the prebuilt executor's ``auto`` strategy runs every
    engine permutation on the scattering cluster kernel where that kernel holds an expert with two blocks a
    multiprocessor (half the shared memory less 1 KiB each), or with one and cells of at least ``CLUSTER_MIN_CELL``
    bytes; else along its cycle plan when its cells span a sector, else as copy-then-gather: the byte-loop reference's
    bytes each way."""
    monkeypatch.delenv(prebuilt.CLUSTERS_ENV, raising=False)
    em = m.compiled()
    prebuilt.build_plan(em, True)
    geometry = prebuilt.cluster_geometry(em, prebuilt.CLUSTER_SHARED_MAX)
    two = geometry is not None and geometry.staged <= (prebuilt.CLUSTER_SHARED_MAX - 1024) // 2
    by_clusters = geometry is not None and geometry.scatter and (two or em.cell_bytes >= prebuilt.CLUSTER_MIN_CELL)
    cycles = em.cell_bytes >= prebuilt.MIN_CYCLE_CELL
    want = "clusters" if by_clusters else "cycles" if cycles else "copy-then-gather"
    assert registry.EXECUTORS["prebuilt"].strategy(em).name == want and prebuilt.clusters_in_place(em) == by_clusters
    launched, cycle_kernels = in_place_launches(emulated, m, em, 3), set(prebuilt._FUNCTIONS.values())
    if by_clusters:
        assert launched == {prebuilt._CLUSTERS["scatter"]}
    else:
        assert launched <= cycle_kernels if cycles else not launched & cycle_kernels


@pytest.mark.parametrize("m", [p for p in in_place_maps() if prebuilt.clusters_in_place(p.values[0].compiled())])
def test_auto_runs_without_the_clusters_where_the_device_runs_none(emulated, clusters, monkeypatch, m):
    """A map ``auto`` gives the cluster kernels, on a device that runs no cluster of its geometry (the occupancy
    query answers 0): ``auto`` permutes it as it would without the clusters (its cycle plan, built here, or
    copy-then-gather), the byte-loop reference's bytes; asked for by name, the clusters are refused with nothing
    moved."""
    from reference_loops import byte_gather

    monkeypatch.delenv(prebuilt.CLUSTERS_ENV, raising=False)
    clusters[1][0] = 0
    em = m.compiled()
    prebuilt.build_plan(em, True)
    executor = registry.EXECUTORS["prebuilt"]
    assert executor.strategy(em).name == "clusters"
    instead = executor.strategy(em, without="clusters").name
    assert instead == ("cycles" if em.cell_bytes >= prebuilt.MIN_CYCLE_CELL else "copy-then-gather")
    launched = in_place_launches(emulated, m, em, 3)
    assert prebuilt._CLUSTERS["scatter"] not in launched
    assert (launched <= set(prebuilt._FUNCTIONS.values())) == (instead == "cycles")
    x = next(host_inputs(m, 3))
    y = x.clone()
    with pytest.raises(LayoutError, match="do not run on"):
        for _ in executor.strategy(em, "clusters").run(em, y, 2, {"inplace": "clusters"}):
            pass
    assert torch.equal(y, x) and not torch.equal(x, byte_gather(m, x).reshape(3, -1))


def test_the_planner_readies_the_cluster_kernels_for_the_maps_they_take(clusters, monkeypatch):
    """A map the cluster kernels take in place by default (a DeepSeek-V3 TP8 FP8 rotate's W13, cells of 7,168 bytes):
    the planner loads their fatbin and puts their table on the device, the inverse permutation (int32), waited for,
    and builds no cycle plan; the map is planned then. With ``FIMOE_INPLACE_CLUSTERS=0``, or on a device without
    clusters, the cycle plan instead and no table."""
    from fimoe_lab.kernels import cuda_driver, cycles

    copies: list[tuple[str, bool]] = []

    class Tables:  # DeviceTables without a device: the copy recorded, the array kept
        def __init__(self, arrays, device, wait):
            copies.append((str(device), wait))
            self.arrays = arrays

        def ready(self):
            return tuple(torch.from_numpy(a) for a in self.arrays)

    monkeypatch.setattr(prebuilt, "DeviceTables", Tables)
    monkeypatch.setattr(cycles.CyclePlan, "on", lambda plan, device, wait=False: copies.append(("cycle plan", wait)))
    monkeypatch.setattr(cycles.CyclePlan, "is_on", lambda plan, device: True)
    monkeypatch.setattr(cuda_driver, "_OUTCOMES", {(prebuilt.SOURCE, 0): True})
    monkeypatch.setattr(
        cuda_driver, "available", lambda source, device: cuda_driver._OUTCOMES.setdefault((source, 0), True)
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # device 0 as a CUDA device, no memory touched
    dev = torch.device("cuda", 0)
    for value, limit in ((None, prebuilt.CLUSTER_SHARED_MAX), ("0", prebuilt.CLUSTER_SHARED_MAX), (None, 0)):
        if value is not None:
            monkeypatch.setenv(prebuilt.CLUSTERS_ENV, value)
        else:
            monkeypatch.delenv(prebuilt.CLUSTERS_ENV, raising=False)
        clusters[0][0] = limit  # 0: a device without clusters
        em = dataclasses.replace(plan_layer("fp8", "trtllm", 256, 7168).w13.compiled(), _dev={})  # nothing built
        by_clusters = value is None and limit > 0
        copies.clear()
        assert prebuilt.clusters_in_place(em, dev) == by_clusters and prebuilt.clusters_in_place(em) == (value is None)
        assert not prebuilt.planned(em, True, dev)
        prebuilt.build_plan(em, True, dev)
        if by_clusters:
            assert copies == [("cuda:0", True)] and prebuilt.planned(em, True, dev)
            dst = em._dev[("cluster table", "cuda:0", True)].arrays[0]
            assert dst.dtype == np.int32 and np.array_equal(dst[em.src], np.arange(em.n_out))
        else:
            assert copies == [("cycle plan", True)]


def all_engine_maps():
    from fimoe_lab.prepare import drop_in_maps

    for fmt, inter, hidden in (("fp8", 96, 256), ("bf16", 64, 256), ("mxfp4", 96, 256)):
        for name, (m, _) in drop_in_maps(fmt, inter, hidden).items():
            yield pytest.param(m, id=f"drop-in-{fmt}-{inter}x{hidden}-{name}")
    for fmt, inter, hidden in (("fp8", 100, 256), ("fp8-block", 128, 256), ("nvfp4", 112, 256), ("mxfp4", 96, 320)):
        for name, m in plan_layer(fmt, "trtllm", inter, hidden).maps().items():
            yield pytest.param(m, id=f"layer-{fmt}-{inter}x{hidden}-{name}")


@pytest.mark.parametrize("shift", [0, 4, 1], ids=["w16", "w4", "w1"])
@pytest.mark.parametrize("m", list(all_engine_maps()))
def test_the_gather_source_runs_every_engine_map(emulated, m, shift):
    """Every map of the drop-ins and layer plans (paddings and their fills included), out of place through
    the launcher and the gather kernel's source: the byte-loop reference's bytes, for each word the
    buffers' alignment allows (``shift`` bytes off 16)."""
    from reference_loops import byte_gather

    em = m.compiled()
    for x, find in zip(host_inputs(m, 3), (False, True)):
        if find:  # as the planner thread does (the row table "on the device": this host's memory)
            prebuilt.build_plan(em, False, x.device)
        ready = prebuilt.swizzle_ready(em, x.device)  # an earlier test of the same map may have readied it
        out = torch.full((3, m.out_bytes), 0x5A, dtype=torch.uint8)
        emulated.clear()
        prebuilt.gather(em, shifted_copy(x, shift), out)
        assert torch.equal(out, byte_gather(m, x).reshape(3, -1))
        # a strided map takes the swizzle kernel only once the planner readied it, any other at once
        swizzled = em.ends_swizzled and (ready or not prebuilt.runs_strided(em)) and em.swizzled_rows is not None
        assert all((name in prebuilt._SWIZZLES.values()) == swizzled for name in emulated)
        if not swizzled:  # one launch of the kernel its form takes (two stages: one each)
            kernels = prebuilt._STRIDEDS if prebuilt.runs_strided(em) else prebuilt._GATHERS
            assert len(emulated) == (2 if em.strided is None and em.stages else 1)
            assert all(name in kernels.values() for name in emulated)


def test_a_strided_map_that_ends_swizzled_runs_strided_until_the_planner_readies_it(emulated):
    """The default executor's call of a strided map ending in the 128x4 swizzle (DeepSeek-R1's scales) finds no row
    form, loads no fatbin and copies no table in the caller's thread (that is the planner thread's work): it launches
    the strided kernel, also once the forms are found (as a plan read from disk has them) until the row table is on
    the device, then the swizzle kernel; the bytes of the reference loop every time."""
    from reference_loops import byte_gather

    m = plan_layer("nvfp4", "trtllm", 192, 768).w13_scale  # shapes no other test plans: its forms not yet found
    em = m.compiled()
    assert prebuilt.runs_strided(em) and em.ends_swizzled and not em.row_forms_found()
    x = next(host_inputs(m, 2))
    for step in ("nothing", "row forms", "readied"):
        out = torch.full((2, m.out_bytes), 0x5A, dtype=torch.uint8)
        emulated.clear()
        registry.EXECUTORS["prebuilt"].gather(em, x, out)
        assert torch.equal(out, byte_gather(m, x).reshape(2, -1))
        assert em.row_forms_found() == (step != "nothing") and prebuilt.swizzle_ready(em, x.device) == (
            step == "readied"
        )
        assert emulated == [prebuilt._SWIZZLES["rows"] if step == "readied" else prebuilt._STRIDEDS[4]]
        if step == "nothing":
            em.swizzled_rows  # noqa: B018 - found, as a record read from disk gives them
        else:
            prebuilt.build_plan(em, False, x.device)  # as the planner thread does: the row table put on the device


@pytest.mark.parametrize("stage_bytes,inter", [(1 << 28, 1600), (1, 1728)], ids=["one-chunk", "expert-by-expert"])
def test_a_map_of_two_strided_stages_runs_strided_from_its_first_call(emulated, monkeypatch, stage_bytes, inter):
    """gpt-oss's MXFP4 scales (rows padded, row steps, then the 128x4 swizzle: two strided stages) run on the strided
    kernel from their first default call, one launch per stage and chunk of experts through an intermediate,
    without their cell sources found in the caller's thread; the swizzle kernel takes them once the planner has
    found their row forms and put their row table on the device. The reference loop's bytes every time."""
    from reference_loops import byte_gather

    monkeypatch.setattr(prebuilt, "STAGE_BYTES", stage_bytes)
    m = plan_layer("mxfp4", "trtllm", inter, 2880).w2_scale  # shapes no other test plans: nothing found yet
    em = m.compiled()
    assert em.strided is None and em.stages is not None and prebuilt.runs_strided(em) and not em.sources_found()
    assert prebuilt.sources_for(em, False) == (prebuilt.STRIDED_SOURCE, prebuilt.SWIZZLE_SOURCE)
    experts = 3
    for x in host_inputs(m, experts):
        out = torch.full((experts, m.out_bytes), 0x5A, dtype=torch.uint8)
        emulated.clear()
        registry.EXECUTORS["prebuilt"].gather(em, shifted_copy(x, 0), out)
        assert torch.equal(out, byte_gather(m, x).reshape(experts, -1))
        chunks = experts if stage_bytes == 1 else 1
        assert len(emulated) == 2 * chunks and set(emulated) <= set(prebuilt._STRIDEDS.values())
        assert not em.sources_found() and not em.row_forms_found()
    prebuilt.build_plan(em, False, torch.device("cpu"))  # as the planner thread does: row forms, the table placed
    x = next(host_inputs(m, experts))
    out = torch.full((experts, m.out_bytes), 0x5A, dtype=torch.uint8)
    emulated.clear()
    registry.EXECUTORS["prebuilt"].gather(em, x, out)
    assert torch.equal(out, byte_gather(m, x).reshape(experts, -1))
    assert len(emulated) == 1 and emulated[0] in prebuilt._SWIZZLES.values()


def test_an_in_place_strided_map_runs_on_the_strided_kernel_until_its_cycle_plan_is_built(emulated, monkeypatch):
    """In place, the prebuilt executor's default strategy for a map of the strided form copies each chunk of
    experts aside and gathers it back on the strided kernel while its cycle plan is not built (its first calls in
    a process, the planner building the plan), then runs the cycle plan: the reference loop's bytes both ways
    (the cluster kernels off: they would take these 640-byte cells)."""
    monkeypatch.setenv(prebuilt.CLUSTERS_ENV, "0")
    m = plan_layer("fp8", "trtllm", 224, 640).w13  # a permutation of shapes no other test plans
    em = m.compiled()
    assert em.is_permutation and prebuilt.runs_strided(em) and not prebuilt.planned(em, True)
    for built in (False, True):
        assert registry.EXECUTORS["prebuilt"].strategy(em).name == ("cycles" if built else "copy-then-gather")
        kernels = prebuilt._FUNCTIONS if built else prebuilt._STRIDEDS
        assert in_place_launches(emulated, m, em, 5) <= set(kernels.values())
        prebuilt.build_plan(em, True)  # as the planner thread does


def in_place_launches(emulated, m, em, experts: int) -> set[str]:
    """The prebuilt executor's default in-place strategy for ``em`` run on :func:`host_inputs` of ``experts``
    experts (chunks of 2), each result checked against the reference loop's bytes: the kernels it launched."""
    from reference_loops import byte_gather

    launched: set[str] = set()
    for x in host_inputs(m, experts):
        y = x.clone()
        emulated.clear()
        for _ in registry.EXECUTORS["prebuilt"].strategy(em).run(em, y, 2, None):
            pass
        assert torch.equal(y, byte_gather(m, x).reshape(experts, -1)) and emulated
        launched |= set(emulated)
    return launched


def strided_exec_map(shape, live, strides, offset, fill, cell_bytes, extra):
    """An :class:`ExecMap` of the strided form ``(shape, live, strides, offset, fill code)`` (fill code -1: byte 0xA7,
    None: no fill) whose sources are found here
    from the form's definition (every output cell's digits, row-major), over ``extra`` more input cells than
    the form reads."""
    from fimoe_lab.kernels.compiled import ExecMap, Strided

    digits = np.indices(shape).reshape(len(shape), -1)
    inside = np.all(digits < np.array(live)[:, None], axis=0)
    src = np.where(inside, offset + np.array(strides) @ digits, -1 if fill is not None else 0).astype(np.int32)
    n_in = max(int(src.max(initial=-1)) + 1, 1) + extra
    return ExecMap(
        name="random strided form",
        cell_bytes=cell_bytes,
        word=next(w for w in (8, 4, 2, 1) if cell_bytes % w == 0),
        n_in=n_in,
        n_out=src.size,
        src=src,
        fills=(0xA7,) if fill is not None else (),
        has_fill=bool((src < 0).any()),
        in_bytes=n_in * cell_bytes,
        out_bytes=src.size * cell_bytes,
        is_permutation=False,
        strided=Strided(tuple(shape), tuple(live), tuple(strides), offset, fill),
    )


@settings(max_examples=40, deadline=None)
@given(
    dims=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 6), st.integers(-9, 9)), min_size=1, max_size=7),
    cell_bytes=st.sampled_from([1, 2, 3, 4, 12, 16, 48, 128]),
    padded=st.booleans(),
    extra=st.integers(0, 3),
    experts=st.integers(1, 3),
    shift=st.sampled_from([0, 4, 1]),
)
@example(dims=[(4, 0, 1)] * 7, cell_bytes=32, padded=False, extra=0, experts=2, shift=0)  # MAX_DIGITS digits
@example(dims=[(3, 0, -5), (5, 2, 1)], cell_bytes=128, padded=True, extra=1, experts=3, shift=0)  # a negative stride
def test_the_strided_source_runs_any_strided_form(emulated, dims, cell_bytes, padded, extra, experts, shift):
    """Random strided forms (up to :data:`~fimoe_lab.kernels.prebuilt.MAX_DIGITS` digits with the word's within a
    cell, negative and zero strides, a box with fill or none) through the launcher, its form table and the strided
    kernel's source: each output cell the input cell its digits name, or the fill byte, as the numpy definition
    gives; words of 16, 4 and 1 bytes."""
    shape = [size for size, _, _ in dims]
    live = [max(0, size - cut) for size, cut, _ in dims] if padded else shape
    strides = [stride for _, _, stride in dims]
    low = sum(min(0, s * (n - 1)) for s, n in zip(strides, live) if n)
    em = strided_exec_map(shape, live, strides, -low, -1 if live != shape else None, cell_bytes, extra)
    assert prebuilt.runs_strided(em)
    x = torch.randint(0, 256, (experts, em.in_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    cells = x.view(experts, em.n_in, cell_bytes)
    want = cells[:, np.maximum(em.src, 0)].clone()
    want[:, em.src < 0] = 0xA7
    out = torch.full((experts, em.out_bytes), 0x5A, dtype=torch.uint8)
    emulated.clear()
    prebuilt.gather(em, shifted_copy(x, shift), out)
    assert torch.equal(out.view(experts, em.n_out, cell_bytes), want)
    word = next(w for w in (16, 4, 1) if cell_bytes % w == 0 and shift % w == 0)
    assert emulated == [prebuilt._STRIDEDS[word]]


def test_a_form_over_the_kernels_digits_runs_elsewhere():
    n = prebuilt.MAX_DIGITS
    em = strided_exec_map([2] * n, [2] * n, [1] * n, 0, None, 16, 0)
    assert not prebuilt.runs_strided(em) and prebuilt.sources_for(em, False) == (prebuilt.GATHER_SOURCE,)


@settings(max_examples=2000, deadline=None)
@given(radix=st.integers(1, (1 << 31) - 1), c=st.integers(0, (1 << 31) - 1))
@example(radix=(1 << 31) - 1, c=(1 << 31) - 1)
@example(radix=3, c=(1 << 31) - 1)
@example(radix=(1 << 30) + 1, c=(1 << 31) - 2)
def test_the_form_tables_division_by_multiplying_is_exact_below_two_to_the_31(radix, c):
    """The strided kernel's digit division: ``(umulhi(c, magic) + c) >> shift`` with the form table's magic and
    shift is ``c // radix`` for every cell index the kernel divides (``c < 2**31``)."""
    magic, shift = prebuilt.division_by_multiplying(radix)
    assert 0 <= magic < 1 << 32 and ((c * magic >> 32) + c) < 1 << 32
    assert ((c * magic >> 32) + c) >> shift == c // radix


def padded_rows_then_swizzled(rows: int, c_in: int, cols: int, fill: int, seed: int, window: int = 0):
    """``rows`` rows of ``c_in`` scales padded to ``R`` (128s) x ``cols`` with ``fill``, rows shuffled (within
    each ``window`` rows, all of them where 0), swizzled."""
    from fimoe_lab import steps

    padded_rows = -(-rows // 128) * 128
    gen = torch.Generator().manual_seed(seed)
    step = window or padded_rows
    perm = torch.cat(
        [a + torch.randperm(min(step, padded_rows - a), generator=gen) for a in range(0, padded_rows, step)]
    )
    pad = steps.pad_projections(1, rows, padded_rows, c_in, cols, fill)
    shuffle = steps.permute_rows(perm, cols, "shuffled rows", {"seed": seed})
    return pad.then(shuffle).then(steps.swizzle_scales_128x4(padded_rows, cols)), perm


@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(1, 300),
    c_in=st.integers(1, 150),
    extra=st.integers(0, 9),
    experts=st.integers(1, 3),
    shift=st.sampled_from([0, 1, 2, 4, 6, 13]),
    fill=st.integers(0, 255),
    seed=st.integers(0, 2**16),
    window=st.sampled_from([0, 32, 128, 256]),
)
@example(rows=2200, c_in=6, extra=2, experts=2, shift=0, fill=0x11, seed=1, window=0)  # 8 bands a tile, the last 2
@example(rows=2200, c_in=6, extra=2, experts=2, shift=6, fill=0x11, seed=1, window=128)  # runs: 8 bands a tile
@example(rows=1000, c_in=40, extra=0, experts=1, shift=2, fill=0xEE, seed=2, window=0)  # 2 bands a tile
@example(rows=300, c_in=90, extra=2, experts=3, shift=2, fill=0x3C, seed=5, window=32)  # gpt-oss's rows, runs
@example(rows=129, c_in=130, extra=3, experts=2, shift=1, fill=0x80, seed=3, window=0)  # a row over two tiles
def test_the_swizzle_source_runs_any_padded_rows_then_the_swizzle(
    emulated, rows, c_in, extra, experts, shift, fill, seed, window
):
    """Random scale matrices (rows and columns padded with a random byte, rows shuffled, within windows of rows or
    all of them, then the 128x4 swizzle; tiles of several bands where rows are short, several tiles a row where it
    has more than 128 bytes) through the launcher and the swizzle kernels' source, a row at a time or, where a tile's
    sources are a few runs of rows, a run at a time: the per-expert reference loops' bytes, for rows and inputs at
    any offset into a 16-byte chunk (an expert's first and last chunks read bytewise)."""
    from reference_loops import pad, swizzle

    cols = -(-(c_in + extra) // 4) * 4
    m, perm = padded_rows_then_swizzled(rows, c_in, cols, fill, seed, window)
    em = m.compiled()
    assert em.ends_swizzled and em.swizzled_rows is not None
    assume(not prebuilt.runs_strided(em))  # (one live row of one byte is a strided view: the strided kernel runs it)
    x = torch.randint(0, 256, (experts, rows, c_in), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    want = torch.stack([swizzle(p[perm]) for p in pad(x, 1, perm.numel(), cols, fill)])
    out = torch.full((experts, m.out_bytes), 0x5A, dtype=torch.uint8)
    emulated.clear()
    prebuilt.gather(em, shifted_copy(x.reshape(experts, -1), shift), out)
    form = em.swizzled_rows
    by_runs = prebuilt.swizzle_spans(form[0], form[1], form[2]) is not None
    assert emulated == [prebuilt._SWIZZLES["spans" if by_runs else "rows"]]  # one launch, at every alignment
    assert torch.equal(out, want)


def runs_of_rows(rows: np.ndarray, tile_rows: int) -> list[list[tuple[int, int]]]:
    """Per tile of ``tile_rows`` rows, the runs of consecutive source rows its rows read (fill codes < 0 read
    none), as ``(first, rows)``: a loop over each tile's sorted sources."""
    tiles = []
    for t in range(0, rows.size, tile_rows):
        runs: list[list[int]] = []
        for v in sorted({int(r) for r in rows[t : t + tile_rows] if r >= 0}):
            if runs and v == runs[-1][0] + runs[-1][1]:
                runs[-1][1] += 1
            else:
                runs.append([v, 1])
        tiles.append([(a, n) for a, n in runs])
    return tiles


@settings(max_examples=300, deadline=None)
@given(
    bands=st.integers(1, 40),
    c_in=st.integers(1, 160),
    extra=st.integers(0, 9),
    window=st.integers(1, 300),
    fill_share=st.sampled_from([0.0, 0.1, 0.9]),
    repeats=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_tiles_runs_of_rows_are_the_sorted_runs_of_its_sources(bands, c_in, extra, window, fill_share, repeats, seed):
    """``swizzle_spans``: for row tables of rows shuffled within windows, some rows fill, some sources repeated,
    each tile's runs are those a loop over its sorted sources finds, ``(0, 0)`` after them; None exactly where rows
    are whole 16-byte chunks, a tile spans more than one column tile (``NK > 1``) or reads more than ``MAX_SPANS``
    runs; the chunks staged at any alignment fit the kernel's stage."""
    rng = np.random.default_rng(seed)
    n, cw = bands * prebuilt.BAND_ROWS, -(-(c_in + extra) // 4)
    rows = np.concatenate([a + rng.permutation(min(window, n - a)) for a in range(0, n, window)]).astype(np.int32)
    if repeats:
        rows = np.maximum(rows - rng.integers(0, 3, n), 0).astype(np.int32)
    rows[rng.random(n) < fill_share] = -1 - rng.integers(0, 3)
    got = prebuilt.swizzle_spans(rows, c_in, cw)
    _, nb, nk = prebuilt.swizzle_tile(cw)
    want = runs_of_rows(rows, nb * prebuilt.BAND_ROWS)
    if nk != 1 or c_in % 16 == 0 or max(len(t) for t in want) > prebuilt.MAX_SPANS:
        assert got is None
        return
    assert got is not None and got.dtype == np.int32 and got.shape == (len(want), prebuilt.MAX_SPANS, 2)
    for tile, runs in zip(got, want):
        assert [tuple(r) for r in tile[: len(runs)]] == runs and not tile[len(runs) :].any()
        assert sum(-(-(15 + k * c_in) // 16) for _, k in runs) <= prebuilt.STAGE_CHUNKS


@pytest.mark.parametrize(
    "fmt,inter,hidden,name,kernel",
    [
        ("mxfp4", 384, 2880, "w13_scale", "spans"),  # gpt-oss's 90-byte rows: gate and up, two runs a band
        ("mxfp4", 384, 2880, "w2_scale", "spans"),
        ("nvfp4", 96, 1024, "w2_scale", "spans"),  # 6-byte rows, 8 bands a tile
        ("nvfp4", 256, 1024, "w2_scale", "rows"),  # 16-byte rows: whole chunks, none read twice a row at a time
        ("nvfp4", 256, 7168, "w13_scale", "rows"),  # 448-byte rows: four column tiles a row
    ],
)
def test_engine_scale_maps_take_the_swizzle_kernel_that_loads_each_byte_once(
    emulated, fmt, inter, hidden, name, kernel
):
    """The engines' scale maps that end in the swizzle: a tile of whole rows that are not whole 16-byte chunks
    reads its sources as runs of rows (the ``spans`` kernel), rows of whole chunks or longer than a tile a row at a
    time; the reference loop's bytes from inputs at 0 and 6 bytes off 16, coordinate-coded and random."""
    from reference_loops import byte_gather

    m = getattr(plan_layer(fmt, "trtllm", inter, hidden), name)
    em = m.compiled()
    prebuilt.build_plan(em, False, torch.device("cpu"))  # as the planner thread does
    for x in host_inputs(m, 3):
        for shift in (0, 6):
            out = torch.full((3, m.out_bytes), 0x5A, dtype=torch.uint8)
            emulated.clear()
            prebuilt.gather(em, shifted_copy(x, shift), out)
            assert emulated == [prebuilt._SWIZZLES[kernel]]
            assert torch.equal(out, byte_gather(m, x).reshape(3, -1))


@settings(max_examples=300, deadline=None)
@given(
    c_in=st.integers(1, 600),
    extra=st.integers(0, 40),
    rows=st.integers(1, 64),
    offset=st.integers(0, 15),
)
def test_a_rows_chunks_hold_its_tile_bytes_wherever_it_starts(c_in, extra, rows, offset):
    """The swizzle kernel's chunks a row (``CH = 2**swizzle_chunk_shift``, one warp at most) cover the bytes of a
    row's tile from wherever the row starts in a 16-byte chunk: every row of every expert, every column tile."""
    cw = -(-(c_in + extra) // 4)
    in_bytes = rows * c_in
    shift = prebuilt.swizzle_chunk_shift(c_in, cw, in_bytes, offset)
    kw = 1 << prebuilt.swizzle_tile(cw)[0]
    assert 0 <= shift <= 4
    for e in range(3):
        for s in range(min(rows, 20)):
            for kk0 in range(0, cw, kw):
                n = min(4 * min(kw, cw - kk0), c_in - 4 * kk0)
                if n > 0:
                    o = (offset + e * in_bytes + s * c_in + 4 * kk0) % prebuilt.CHUNK
                    assert o + n <= prebuilt.CHUNK << shift


def _gather_kernels():
    from fimoe_lab.layout import IndexMap

    perm = torch.randperm(300, generator=torch.Generator().manual_seed(3))
    yield pytest.param(lambda: IndexMap(perm, 12, (3600,), (3600,)), prebuilt._GATHERS, id="gather")
    yield pytest.param(lambda: plan_layer("fp8-block", "trtllm", 384, 256).w2, prebuilt._STRIDEDS, id="strided")
    yield pytest.param(lambda: plan_layer("nvfp4", "trtllm", 176, 256).w13_scale, prebuilt._SWIZZLES, id="swizzle")


@pytest.mark.parametrize("make,kernels", list(_gather_kernels()))
def test_a_later_call_runs_the_first_calls_launches_at_its_own_addresses(emulated, monkeypatch, make, kernels):
    """A map's gather keeps its launches once its kernel stays (gather, strided, and swizzle once the planner has
    readied it): a later call with other buffers of the same experts and alignment runs them at its own addresses and
    looks no form or table up (each lookup made to raise); other buffer alignments or expert counts get launches of
    their own. The reference loop's bytes every time, on coordinate-coded and random inputs."""
    from reference_loops import byte_gather

    m = make()
    em = m.compiled()
    prebuilt.build_plan(em, False, torch.device("cpu"))  # as the planner thread does
    experts = 3

    def call(x: torch.Tensor, shift: int = 0) -> None:
        out = torch.full((x.shape[0], m.out_bytes), 0x5A, dtype=torch.uint8)
        emulated.clear()
        prebuilt.gather(em, shifted_copy(x, shift), out)
        assert torch.equal(out, byte_gather(m, x).reshape(x.shape[0], -1))
        assert emulated and set(emulated) <= set(kernels.values())

    first, second = host_inputs(m, experts)
    call(first)
    kept = {k: v for k, v in em._dev.items() if k[0] == prebuilt._KEPT_LAUNCHES}
    assert len(kept) == 1
    with monkeypatch.context() as mp:
        for name in ("strided_form_table", "swizzle_rows_table", "_word", "runs_strided", "swizzles"):
            mp.setattr(prebuilt, name, lambda *a: pytest.fail("a form was looked up again"))
        call(second)
    assert {k: v for k, v in em._dev.items() if k[0] == prebuilt._KEPT_LAUNCHES} == kept
    call(second, 1)
    call(second[:2])
    assert len([k for k in em._dev if k[0] == prebuilt._KEPT_LAUNCHES]) == 3


def test_a_swizzled_map_into_a_buffer_off_16_bytes_takes_the_gather_kernel(emulated):
    from reference_loops import byte_gather

    m, _ = padded_rows_then_swizzled(200, 90, 96, 0x7F, 3)
    x = torch.randint(0, 256, (2, m.in_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    raw = torch.full((2 * m.out_bytes + 16,), 0x5A, dtype=torch.uint8)
    out = raw[(-raw.data_ptr()) % 16 + 4 :][: 2 * m.out_bytes].view(2, -1)
    emulated.clear()
    prebuilt.gather(m.compiled(), x, out)
    assert emulated and set(emulated) <= set(prebuilt._GATHERS.values())
    assert torch.equal(out, byte_gather(m, x).reshape(2, -1))


def test_a_swizzled_row_table_that_reads_past_the_input_is_refused_before_any_launch(emulated):
    """The row table is checked once, where it goes to the device: a row past the expert's input rows (or a
    fill code past the map's fills) raises, naming the map, and nothing is launched or written."""
    import dataclasses

    import numpy as np

    m, _ = padded_rows_then_swizzled(130, 20, 24, 0, 5)
    em = m.compiled()
    rows, c_in, cw, rows_n, column = em.swizzled_rows
    x = torch.randint(0, 256, (2, m.in_bytes), dtype=torch.uint8)
    for bad in (em.in_bytes // c_in, -2 - len(em.fills)):
        table = rows.copy()
        table[7] = bad
        forms = (em.swizzle, em.padrows, (table, c_in, cw, rows_n, column))
        broken = dataclasses.replace(em, row_forms=forms, ends_swizzled=True, _dev={})
        out = torch.full((2, m.out_bytes), 0x5A, dtype=torch.uint8)
        emulated.clear()
        with pytest.raises(FimoeError, match="swizzled row"):
            prebuilt.gather(broken, x, out)
        assert emulated == [] and bool((out == 0x5A).all()) and np.array_equal(em.swizzled_rows[0], rows)


@settings(max_examples=25, deadline=None)
@example(cells=2, cell_bytes=4096, experts=3, scratch=1, seed=1)  # two cells: a tile of 8 slots x 256 words
@example(cells=5, cell_bytes=4096, experts=2, scratch=2, seed=2)
@given(
    cells=st.integers(1, 700),
    cell_bytes=st.sampled_from([1, 3, 4, 16, 48, 1040, 4096]),
    experts=st.integers(1, 5),
    scratch=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_the_kernel_source_follows_any_cycles(emulated, cells, cell_bytes, experts, scratch, seed):
    """Random permutations (long cycles, cut at every tile edge, fixed points) of cells of many widths."""
    from reference_loops import byte_gather

    from fimoe_lab.layout import IndexMap

    g = torch.Generator().manual_seed(seed)
    m = IndexMap(torch.randperm(cells, generator=g), cell_bytes, (cells * cell_bytes,), (cells * cell_bytes,))
    x = torch.randint(0, 256, (experts, m.in_bytes), dtype=torch.uint8, generator=g)
    y = x.clone()
    run_emulated(m, y, scratch)
    assert torch.equal(y, byte_gather(m, x))


@settings(max_examples=25, deadline=None)
@example(cells=2, cell_bytes=4096, experts=3, seed=1, shift=0)  # two cells: tiles of 8 slots x 256 words
@given(
    cells=st.integers(1, 70),
    cell_bytes=st.sampled_from([4, 16, 48, 1040, 4096]),
    experts=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    shift=st.sampled_from([0, 4, 1]),
)
def test_the_gather_source_runs_any_map_of_few_cells(emulated, cells, cell_bytes, experts, seed, shift):
    """Random cell maps (repeats and fills included) of experts of few cells, where the gather kernel's tiles hold
    every cell of an expert and wider blocks of words: the byte-loop reference's bytes, for each word the buffers'
    alignment allows."""
    from reference_loops import byte_gather

    from fimoe_lab.layout import IndexMap

    g = torch.Generator().manual_seed(seed)
    src = torch.randint(-1, cells, (cells,), generator=g)  # -1: a cell of fill bytes
    m = IndexMap(src, cell_bytes, (cells * cell_bytes,), (cells * cell_bytes,))
    em = m.compiled()
    x = torch.randint(0, 256, (experts, m.in_bytes), dtype=torch.uint8, generator=g)
    out = torch.full((experts, m.out_bytes), 0x5A, dtype=torch.uint8)
    emulated.clear()
    prebuilt.gather(em, shifted_copy(x, shift), out)
    assert torch.equal(out, byte_gather(m, x).reshape(experts, -1))
    kernels = prebuilt._STRIDEDS if prebuilt.runs_strided(em) else prebuilt._GATHERS
    assert emulated and all(name in kernels.values() for name in emulated)


@pytest.fixture
def driver_seen(monkeypatch):
    """The driver's launch call faked: each launch's grid, block, stream and argument values as the driver reads them
    (the configuration struct and the pointer array), in order. Arguments: a pointer, an int, a long long."""
    import contextlib
    import types

    from fimoe_lab.kernels import cuda_driver

    seen: list[tuple] = []
    kinds = (ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong)

    def fake_launch(config, fn, params, extra):
        c = config._obj
        values = tuple(ctypes.cast(params[i], ctypes.POINTER(k)).contents.value for i, k in enumerate(kinds))
        seen.append((tuple(c.grid), tuple(c.block), c.stream, fn, values))
        return 0

    module = types.SimpleNamespace(current=contextlib.nullcontext)
    monkeypatch.setattr(cuda_driver, "kernel", lambda source, name, device: (module, 7))
    monkeypatch.setattr(cuda_driver, "_lib", lambda: types.SimpleNamespace(cuLaunchKernelEx=fake_launch))
    monkeypatch.setattr(cuda_driver, "_current_stream", lambda index: 1000 + index)
    monkeypatch.setattr(cuda_driver, "_LAUNCHES", {})
    return seen


def _args(k: int) -> list:
    return [(ctypes.c_void_p, 4096 * (k + 1)), (ctypes.c_int, -k), (ctypes.c_longlong, (1 << 40) + k)]


def test_a_launch_passes_each_call_its_own_arguments(driver_seen):
    """Launches of one function reuse its ctypes arguments (built once, refilled per call): what the driver reads
    through the pointer array and the configuration is each call's own values, in order, also from several threads
    at once."""
    import threading

    from fimoe_lab.kernels import cuda_driver

    device = torch.device("cuda", 0)

    def go(k: int) -> None:
        REAL_LAUNCH("src", "fn", device, (k + 1, 1, 1), (256, 1, 1), _args(k))

    for k in range(3):
        go(k)
    threads = [threading.Thread(target=lambda k=k: [go(k) for _ in range(50)]) for k in range(3, 7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(cuda_driver._LAUNCHES) == 1 and len(driver_seen) == 3 + 4 * 50
    for grid, block, stream, fn, (ptr, neg, big) in driver_seen:
        k = grid[0] - 1
        assert (ptr, neg, big) == (4096 * (k + 1), -k, (1 << 40) + k)
        assert (grid, block, stream, fn) == ((k + 1, 1, 1), (256, 1, 1), 1000, 7)


def test_a_bound_launch_keeps_its_arguments_and_takes_each_runs_addresses(driver_seen):
    """Bound launches of one function (a map's launches kept for its later calls) each keep their own grid, block and
    arguments, between one another's runs and plain launches of that function, also from several threads at once;
    a run sets only its leading addresses, on the bound device's current stream."""
    import threading

    from fimoe_lab.kernels import cuda_driver

    bounds = [cuda_driver.Bound("src", "fn", k % 2, (k + 1, 2, 1), (128, 1, 1), _args(k)) for k in range(4)]
    device = torch.device("cuda", 1)

    def go(k: int, address: int) -> None:
        if k == 4:
            REAL_LAUNCH("src", "fn", device, (9, 9, 1), (64, 1, 1), _args(8))
        else:
            REAL_RUN(bounds[k], address)

    go(0, 123)
    go(4, 0)
    go(0, 456)
    threads = [
        threading.Thread(target=lambda k=k: [go(k, 16 * (k + 1) * (i + 1)) for i in range(50)]) for k in range(5)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(driver_seen) == 3 + 5 * 50
    assert driver_seen[0][4][0] == 123 and driver_seen[2][4][0] == 456
    for grid, block, stream, _, (ptr, neg, big) in driver_seen:
        if grid == (9, 9, 1):  # the plain launch
            assert (block, stream, ptr, neg, big) == ((64, 1, 1), 1001, *[v for _, v in _args(8)])
            continue
        k = grid[0] - 1
        assert (grid, block, stream) == ((k + 1, 2, 1), (128, 1, 1), 1000 + k % 2)
        assert (neg, big) == (-k, (1 << 40) + k) and (ptr % (16 * (k + 1)) == 0 or (k == 0 and ptr in (123, 456)))


def test_in_place_cells_under_a_sector_plan_as_a_gather():
    """In place, cells of fewer than :data:`MIN_CYCLE_CELL` bytes (swizzled scales' 4-byte words) run as
    copy-then-gather on the out-of-place kernels, so their fatbins and their plan (sources, row forms) are what
    ``sources_for``, ``planned`` and ``build_plan`` ask for; wider cells keep the cycle kernel and the cycle plan."""
    for m, cycles in (  # shapes no other test plans: nothing planned yet
        (plan_layer("nvfp4", "trtllm", 384, 768).w13_scale, False),  # 4-byte cells of the 128x4 swizzle
        (plan_layer("fp8-block", "trtllm", 256, 640).w13, True),  # 128-byte blocks
    ):
        em = m.compiled()
        assert em.is_permutation and prebuilt.runs_cycles(em) is cycles
        assert (em.cell_bytes >= prebuilt.MIN_CYCLE_CELL) is cycles
        assert prebuilt.sources_for(em, True) == ((prebuilt.SOURCE,) if cycles else prebuilt.sources_for(em, False))
        assert not prebuilt.planned(em, True)
        prebuilt.build_plan(em, True)  # as the planner thread does
        assert prebuilt.planned(em, True)
        assert prebuilt.cycle_plan_built(em, prebuilt._tile_slots(em)) is cycles
        assert cycles or prebuilt.planned(em, False)  # the gather's plan: sources and row forms found


def test_the_planner_is_asked_when_the_outermost_call_ends(monkeypatch):
    """Inside ``plans_after_the_call`` (nested, per thread) the maps a call needs planned wait until the outermost
    block ends, even one left by an exception; outside any block they go to the planner at once. The public calls
    that run a layer hold the block while they pick each map's executor (where the planner is asked)."""
    import threading

    from fimoe_lab import kernels, prepare

    asked: list[tuple[str, object]] = []
    monkeypatch.setattr(prebuilt, "plan_in_background", lambda em, in_place, device: asked.append((em, in_place)))
    ems = [plan_layer("fp8", "trtllm", 256, 512).w13.compiled(), plan_layer("fp8", "trtllm", 256, 512).w2.compiled()]
    after = registry.plans_after_the_call
    registry._plan_after_the_call(ems[0], True, torch.device("cuda"))
    assert asked == [(ems[0], True)]
    asked.clear()
    other: list[int] = []
    with pytest.raises(KeyError), after:
        registry._plan_after_the_call(ems[0], False, torch.device("cuda"))
        with after:
            registry._plan_after_the_call(ems[1], True, torch.device("cuda"))
        assert asked == []  # the inner block ended: still waiting for the outer one
        worker = threading.Thread(target=lambda: other.append(getattr(registry._CALL, "depth", 0)))
        worker.start()
        worker.join()
        raise KeyError("midway")
    assert asked == [(ems[0], False), (ems[1], True)] and other == [0]  # another thread is in no block

    depths: list[int] = []
    real = kernels.get_executor
    monkeypatch.setattr(kernels, "get_executor", lambda *a, **k: depths.append(registry._CALL.depth) or real(*a, **k))
    plan = plan_layer("fp8", "trtllm", 256, 512)
    w13 = torch.randint(0, 256, (2,) + plan.w13.in_shape, dtype=torch.uint8).view(torch.float8_e4m3fn)
    w2 = torch.randint(0, 256, (2,) + plan.w2.in_shape, dtype=torch.uint8).view(torch.float8_e4m3fn)
    plan.apply(w13, w2)
    assert depths == [2, 2]  # LayerPlan.apply, then execute
    depths.clear()
    kernels.execute(plan.w2.compiled(), w2.view(torch.uint8), torch.empty_like(w2.view(torch.uint8)))
    assert depths == [1]
    depths.clear()
    prepare.rotate_weights_for_fi_trtllm_fp8_per_tensor_moe(w13.clone(), w2.clone(), True)
    assert depths == [2, 2]  # the drop-in, then execute_in_place
    assert registry._CALL.depth == 0


# ----------------------------------------------------------------------------- in place by clusters
@pytest.fixture
def clusters(emulated, monkeypatch):
    """The cluster kernel's source on the host (:func:`emulated`), as on a device whose blocks have ``limit[0]``
    bytes of shared memory (an H100's by default) and run ``active[0]`` clusters at once. Yields ``(limit,
    active, allowed)``: lists a test may change, and the shared memory each ``allow_clusters`` call allowed."""
    limit, active, allowed = [prebuilt.CLUSTER_SHARED_MAX], [2], []
    monkeypatch.setattr(prebuilt, "cluster_shared_limit", lambda index: limit[0])
    monkeypatch.setattr(prebuilt, "_ACTIVE_CLUSTERS", {})
    monkeypatch.setattr(prebuilt.cuda_driver, "allow_clusters", lambda source, name, dev, b: allowed.append(b))
    monkeypatch.setattr(prebuilt.cuda_driver, "max_active_clusters", lambda *a: active[0])
    monkeypatch.setattr(prebuilt.cuda_driver, "available", lambda source, device: source == prebuilt.CLUSTER_SOURCE)
    yield limit, active, allowed


def run_clusters(m, x: torch.Tensor) -> None:
    flat = x.view(x.shape[0], -1).view(torch.uint8)
    for _ in prebuilt.inplace_clusters(m.compiled(), flat, 0):
        pass


def cluster_maps():
    for param in in_place_maps():
        if param.values[0].compiled().cell_bytes % 16 == 0:
            yield param


@pytest.mark.parametrize("m", list(cluster_maps()))
def test_the_cluster_kernel_source_permutes_every_engine_map_in_place(clusters, emulated, m):
    """Every engine map of 16-byte words, in place by the cluster kernels' source (the scattering kernel, two blocks a
    cluster at these sizes, a cluster an expert): the bytes of the per-expert loop, on coordinate-coded and random
    inputs; a buffer off 16 bytes is refused with nothing moved."""
    from reference_loops import byte_gather

    em = m.compiled()
    for x in host_inputs(m, 3):
        want = byte_gather(m, x).reshape(3, -1)
        y = x.clone()
        emulated.clear()
        run_clusters(m, y)
        assert emulated == [prebuilt._CLUSTERS["scatter"]]
        assert torch.equal(y, want) and not torch.equal(x, want)
    y = shifted_copy(x, 4)
    with pytest.raises(LayoutError, match="16-byte aligned"):
        run_clusters(m, y)
    assert torch.equal(y, x) and prebuilt.cluster_geometry(em, prebuilt.CLUSTER_SHARED_MAX)[:2] == (True, 2)


@pytest.mark.parametrize(
    "tensor,limit,scatter,blocks",
    [
        ("w13", prebuilt.CLUSTER_SHARED_MAX, True, 8),
        ("w13", 64 << 10, True, 16),
        ("w13", 16, False, 8),
        ("w2", prebuilt.CLUSTER_SHARED_MAX, True, 4),
        ("w2", 64 << 10, True, 16),
        ("w2", 16, False, 4),
        ("w2", 15, False, 8),
    ],
)
@pytest.mark.parametrize("active", [1, 3])
def test_clusters_of_several_blocks_hold_an_expert(clusters, emulated, tensor, limit, scatter, blocks, active):
    """BF16 block layout maps of 768 KiB (W13) and 384 KiB (W2) experts: the scattering kernel where shared memory
    holds a slice (two blocks a multiprocessor where they fit: W13 eight blocks of 96 KiB at 227 KiB; one where
    only that fits: sixteen of 48 KiB at 64 KiB), else the gathering one with 8,192 words a block in registers (W13
    eight blocks, W2 four, with the 16 bytes a block stages at least; eight where not even those fit, and none
    fit in registers alone). One or three clusters running at once: a cluster an expert, the bytes of the
    per-expert loop."""
    from reference_loops import byte_gather

    from fimoe_lab.prepare import drop_in_maps

    clusters[0][0], clusters[1][0] = limit, active
    m = drop_in_maps("bf16", 192, 1024)[f"trtllm_block_layout/{tensor}"][0]
    em = m.compiled()
    got = prebuilt.cluster_geometry(em, limit)
    if limit == 15:
        assert got is None
        return
    assert got.scatter == scatter and got.c == blocks and got.c * got.s >= em.n_out and got.staged <= limit
    held = 0 if scatter else prebuilt.CLUSTER_REGISTER_WORDS * prebuilt.CLUSTER_THREADS
    assert got.s * em.cell_bytes // 16 <= held + got.staged // 16
    x = next(host_inputs(m, 4))
    y = x.clone()
    emulated.clear()
    run_clusters(m, y)
    assert emulated == [got.kernel[0]] and torch.equal(y, byte_gather(m, x).reshape(4, -1))
    assert clusters[2] == [limit]  # the device's whole limit, not this map's staging: a later map may need more


@settings(max_examples=200, deadline=None)
@given(
    fmt=st.sampled_from(["bf16", "fp8-block", "mxfp8", "nvfp4", "fp8"]),
    inter=st.sampled_from([128, 256, 512, 2048]),
    hidden=st.sampled_from([256, 1024, 2048, 7168]),
    limit=st.integers(0, prebuilt.CLUSTER_SHARED_MAX),
)
def test_cluster_geometry_is_the_first_kernel_and_fewest_blocks_that_hold_an_expert(fmt, inter, hidden, limit):
    """For every permutation of 16-byte words: the scattering kernel at the fewest blocks of :data:`CLUSTER_SIZES`
    whose slices fit half the limit less 1 KiB, else the whole limit; else the gathering kernel at the fewest whose
    slices, less the words held in registers, fit the limit (at least one word staged); None where none of these
    does. Every block count covers the expert's cells; every other map has none."""
    held = prebuilt.CLUSTER_REGISTER_WORDS * prebuilt.CLUSTER_THREADS
    for m in plan_layer(fmt, "trtllm", inter, hidden).maps().values():
        em = m.compiled()
        got = prebuilt.cluster_geometry(em, limit)
        if em.cell_bytes % 16 or not em.is_permutation:
            assert got is None
            continue
        words = {c: -(-em.n_out // c) * em.cell_bytes // 16 for c in prebuilt.CLUSTER_SIZES}
        wanted = [
            (True, c, 16 * w) for bound in ((limit - 1024) // 2, limit) for c, w in words.items() if 16 * w <= bound
        ]
        wanted += [(False, c, max(w - held, 1) * 16) for c, w in words.items() if max(w - held, 1) * 16 <= limit]
        if not wanted:
            assert got is None
            continue
        assert (got.scatter, got.c, got.staged) == wanted[0]
        assert got.c * got.s >= em.n_out > (got.c - 1) * got.s


@pytest.mark.parametrize("value", ["1", "0", None])
def test_the_clusters_variable_gives_auto_the_maps_a_cluster_holds(clusters, emulated, monkeypatch, value):
    """``FIMOE_INPLACE_CLUSTERS`` true: ``auto`` gives every map of 16-byte words that a cluster holds to the cluster
    kernels; false: none; unset: a small BF16 block map (two blocks a multiprocessor) but not Qwen3-235B's TP8 W13
    (128-byte cells, one block a multiprocessor). A call they cannot take (a buffer off 16 bytes) runs as ``auto``
    runs it otherwise. Every call: the bytes of the per-expert loop."""
    from reference_loops import byte_gather

    from fimoe_lab.prepare import drop_in_maps

    if value is None:
        monkeypatch.delenv(prebuilt.CLUSTERS_ENV, raising=False)
    else:
        monkeypatch.setenv(prebuilt.CLUSTERS_ENV, value)
    executor = registry.EXECUTORS["prebuilt"]
    m = drop_in_maps("bf16", 64, 256)["trtllm_block_layout/w13"][0]
    em = m.compiled()
    assert (executor.strategy(em, "auto").name == "clusters") == (value != "0")
    wide = drop_in_maps("bf16", 192, 4096)["trtllm_block_layout/w13"][0].compiled()
    assert (executor.strategy(wide, "auto").name == "clusters") == (value == "1") and prebuilt.clusters_fit(wide)
    x = next(host_inputs(m, 3))
    want = byte_gather(m, x).reshape(3, -1)
    for shift, kernel in ((0, prebuilt.cluster_geometry(em, prebuilt.CLUSTER_SHARED_MAX).kernel[0]), (4, None)):
        y = shifted_copy(x, shift)
        emulated.clear()
        for _ in executor.strategy(em, "auto").run(em, y, 1, None):
            pass
        assert torch.equal(y, want)
        if value != "0":
            assert (kernel in emulated) == (kernel is not None) and (kernel is not None or emulated)
    rows = plan_layer("nvfp4", "trtllm", 128, 256).w13_scale  # 4-byte cells: no cluster
    assert executor.strategy(rows.compiled(), "auto").name != "clusters"
