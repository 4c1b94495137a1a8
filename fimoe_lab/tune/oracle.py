"""Tactic oracle: which TRTLLM-Gen MoE tactics ``[tile_N, config]`` exist for a shape.

The truth is FlashInfer's own C++ op ``trtllm_get_valid_moe_configs`` (DESIGN §5); its
answer is the tactic space the autotuner picks from, and an empty answer is the
"No valid config found" failure.  :class:`TacticOracle` asks it

* natively, on a Blackwell (SM10x) GPU, through FlashInfer's JIT module;
* elsewhere through the module built by ``python -m fimoe_lab.tune.build`` and an
  LD_PRELOAD shim that presents the CUDA runtime as an SM100 device;
* or, with neither, from :mod:`fimoe_lab.tune.validity`, a re-implementation of the op's
  decision on the kernel set's metadata shipped as package data
  (``fimoe_lab/data/tactics/kernels-fi<version>-<kernel set>.json.gz``), exact for any shape
  (checked against the live module in ``tests/test_tune_validity.py``).  Only where the
  installed FlashInfer's kernel set is not shipped is an answer *unknown*, never guessed.

Live queries always run in a worker subprocess (one JSON request per line), so an
``exit()`` inside FlashInfer kills the worker, is reported as such, and the worker is
restarted for the next query.

Each tuner format reaches FlashInfer's (dtype_act, dtype_weights, fp8_quantization_type,
use_per_token_scaling) and default weight layout through its row of
:data:`fimoe_lab.specs.FORMATS` (``spec.tactics``: enum *member names*, the way the MoE
entry points in ``flashinfer/fused_moe/core.py`` build their runners); the activation
through :func:`fimoe_lab.specs.get_activation` (``.flashinfer``). Enum *values* are read
from ``flashinfer.tllm_enums`` in the worker, never written here. All entry points pass
``use_shuffled_weight=True``.
"""

from __future__ import annotations

import atexit
import collections
import importlib.metadata as md
import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fimoe_lab.errors import FimoeError, OracleError
from fimoe_lab.specs import ACTIVATIONS, FORMATS, LAYOUTS, TacticEnums, get_activation, tuner_formats

from . import validity

__all__ = [
    "OracleError",
    "TacticQuery",
    "TacticAnswer",
    "TacticOracle",
    "WorkerDied",
    "tactic_format",
    "kernel_activation",
    "MAX_GEMM_DIM",
    "model_answer",
]


# Largest hidden/intermediate size the op handles without 32-bit overflow: it forms
# (bits per element * padding * K) in int32, at most 16 * K for the tuner's formats.
MAX_GEMM_DIM = 2**26 - 1


def tactic_format(name: str) -> TacticEnums:
    """The tactic-query enums of tuner format ``name`` (:func:`fimoe_lab.specs.tuner_formats`)."""
    fmt = str(name).strip().lower()
    if fmt not in tuner_formats():
        raise OracleError(f"unknown format {name!r}", fix=f"choose one of {', '.join(tuner_formats())}")
    return FORMATS[fmt].tactics  # type: ignore[return-value]


def kernel_activation(name: str) -> str:
    """The activation a query is keyed by: the first of :data:`fimoe_lab.specs.ACTIVATIONS`
    that runs the same FlashInfer ``ActivationType`` as ``name`` (aliases included).

    swiglu, silu and swiglu_oai -> ``swiglu`` (one Swiglu kernel); geglu, gelu -> ``geglu``;
    relu2 -> ``relu2``: the names query keys use.
    """
    try:
        act = get_activation(name)
    except FimoeError as exc:
        raise OracleError(exc.message, fix=exc.fix) from None
    return next(a.name for a in ACTIVATIONS.values() if a.flashinfer == act.flashinfer)


@dataclass(frozen=True)
class TacticQuery:
    """One shape, as the kernel sees it (already padded, per rank).

    format: a tuner format (:func:`fimoe_lab.specs.tuner_formats`).  activation: any name
    or alias in :data:`fimoe_lab.specs.ACTIVATIONS` (keyed by :func:`kernel_activation`).
    hidden: K of GEMM1 (elements).  intermediate: one projection's rows per expert
    (gate and up each; the kernel's ``intermediate_size``).  experts: local experts.
    layout: a key of :data:`fimoe_lab.specs.LAYOUTS`, default the format's.
    """

    format: str
    activation: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    tokens: int
    per_token: bool = False
    layout: Optional[str] = None

    def normalized(self) -> TacticQuery:
        """The query in canonical names (format, kernel activation, layout), checked.

        :class:`OracleError` for an unknown format, activation or layout, per-token
        scaling where the format has none, a size below 1, ``top_k > experts``, or sizes the
        op's 32-bit arithmetic overflows (hidden or intermediate > :data:`MAX_GEMM_DIM`,
        ``tokens * top_k >= 2**31``).
        """
        tactics = tactic_format(self.format)
        layout = (self.layout or tactics.default_layout).strip().lower()
        if layout not in LAYOUTS:
            raise OracleError(f"unknown weight layout {self.layout!r}", fix=f"choose one of {', '.join(LAYOUTS)}")
        if self.per_token and not tactics.per_token_ok:
            per_token = [f for f in tuner_formats() if FORMATS[f].tactics.per_token_ok]  # type: ignore[union-attr]
            raise OracleError(
                f"per-token activation scaling exists only for {', '.join(per_token)}, not {self.format!r}",
                fix="drop per_token (--per-token)",
            )
        shape = (
            f"hidden={self.hidden} intermediate={self.intermediate} experts={self.experts} "
            f"top_k={self.top_k} tokens={self.tokens}"
        )
        for name in ("hidden", "intermediate", "experts", "top_k", "tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise OracleError(
                    f"{name} must be a positive integer, got {v!r} (shape {shape})", fix=f"pass {name} >= 1"
                )
        if self.top_k > self.experts:
            raise OracleError(
                f"top_k={self.top_k} exceeds experts={self.experts}", fix="top_k is at most the number of local experts"
            )
        # The op sizes its problems in 32-bit integers (K * bits per element, tokens * top_k).
        big = [(n, getattr(self, n)) for n in ("hidden", "intermediate") if getattr(self, n) > MAX_GEMM_DIM]
        if big or self.tokens * self.top_k >= 2**31:
            what = ", ".join(f"{n}={v}" for n, v in big) or f"tokens * top_k = {self.tokens * self.top_k}"
            raise OracleError(
                f"{what} overflows the 32-bit size arithmetic of FlashInfer's op (shape {shape})",
                fix=f"hidden and intermediate at most {MAX_GEMM_DIM}, tokens * top_k below 2**31",
            )
        return TacticQuery(
            self.format.strip().lower(),
            kernel_activation(self.activation),
            self.hidden,
            self.intermediate,
            self.experts,
            self.top_k,
            self.tokens,
            bool(self.per_token),
            layout,
        )

    def key(self) -> str:
        """Canonical query key (call on a normalized query)."""
        return "|".join(
            str(x)
            for x in (
                self.format,
                self.activation,
                int(self.per_token),
                self.layout,
                self.hidden,
                self.intermediate,
                self.experts,
                self.top_k,
                self.tokens,
            )
        )

    @staticmethod
    def from_key(key: str) -> TacticQuery:
        f, a, pt, lay, h, i, e, k, t = key.split("|")
        return TacticQuery(f, a, int(h), int(i), int(e), int(k), int(t), bool(int(pt)), lay)

    def request(self) -> dict:
        """The worker's request: FlashInfer enum member names and sizes (call on a normalized query)."""
        tactics = tactic_format(self.format)
        return {
            "dtype_act": tactics.dtype_act,
            "dtype_weights": tactics.dtype_weights,
            "fp8_quantization_type": tactics.fp8_quantization_type,
            "activation": get_activation(self.activation).flashinfer,
            "weight_layout": LAYOUTS[self.layout],
            "use_shuffled_weight": True,
            "use_per_token_scaling": self.per_token,
            "top_k": self.top_k,
            "hidden": self.hidden,
            "intermediate": self.intermediate,
            "experts": self.experts,
            "tokens": self.tokens,
        }


@dataclass(frozen=True)
class TacticAnswer:
    """The oracle's answer for one query.

    count: number of valid tactics, or None when unknown (the installed FlashInfer's
    kernel set is not shipped for the model, or the live query failed without an answer).
    per_tile: {tile_N: number of configs}.  configs: the full ((tile_N, config), ...) list in
    the op's order (() for a rejection; None when unknown).  reason: why count is
    0 or None.  source: where the answer came from (live/model, FlashInfer version,
    kernel set).
    """

    query: TacticQuery
    count: Optional[int]
    per_tile: dict
    source: dict
    reason: Optional[str] = None
    configs: Optional[tuple] = None

    @property
    def known(self) -> bool:
        return self.count is not None

    def to_json(self) -> dict:
        d = {
            "tokens": self.query.tokens,
            "count": self.count,
            "per_tile": {str(k): v for k, v in sorted(self.per_tile.items())},
            "source": self.source,
        }
        if self.reason:
            d["reason"] = self.reason
        return d


# --------------------------------------------------------------------------- model
def _installed(dist: str) -> Optional[str]:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _shipped_names() -> str:
    names = [
        f"FlashInfer {t.flashinfer} ({t.kernel_set})"
        for t in (validity.KernelTable(p) for p in validity.shipped_tables())
    ]
    return "; ".join(names) or "none"


def model_answer(
    table: validity.KernelTable, q: TacticQuery, sm: int = 100, request: Optional[dict] = None
) -> validity.ModelAnswer:
    """:func:`fimoe_lab.tune.validity.answer` for ``q`` on ``table`` (``request``: ``q.request()``, when
    the caller already has it)."""
    r = request or q.request()
    return validity.answer(
        table,
        r["dtype_act"],
        r["dtype_weights"],
        r["fp8_quantization_type"],
        r["activation"],
        r["weight_layout"],
        r["use_per_token_scaling"],
        q.hidden,
        q.intermediate,
        q.experts,
        q.top_k,
        q.tokens,
        sm=sm,
    )


class _Model:
    """Answers from :mod:`fimoe_lab.tune.validity` for one shipped kernel table.

    ``table`` None: the installed FlashInfer's kernel set is not shipped; every answer is
    unknown, with ``unknown`` saying which kernel sets are.
    """

    def __init__(self, table: Optional[validity.KernelTable], unknown: str = "", sm: int = 100):
        self.table, self.unknown, self.sm = table, unknown, sm
        fi = _installed("flashinfer-python")
        if table is None:
            self._source = {"kind": "model", "flashinfer": fi, "kernel_set": None}
        else:
            self._source = table.source()
            if fi is None:
                self._source["note"] = f"FlashInfer is not installed; answers are for FlashInfer {table.flashinfer}"

    @classmethod
    def load(cls, path: Optional[os.PathLike] = None, sm: int = 100) -> _Model:
        if path:
            return cls(validity.KernelTable(Path(path)), sm=sm)
        if not validity.shipped_tables():
            raise OracleError(
                f"no TRTLLM-Gen kernel table found in {validity.kernels_dir()} and no live FlashInfer module",
                fix="build the module with `python -m fimoe_lab.tune.build`",
            )
        fi = _installed("flashinfer-python")
        table = validity.find_table(fi) if fi else validity.find_table()
        if table is None:
            return cls(
                None,
                f"the installed FlashInfer {fi}'s kernel set is not shipped (shipped: {_shipped_names()}); "
                "build the module with `python -m fimoe_lab.tune.build` for live answers",
                sm,
            )
        return cls(table, sm=sm)

    def source(self) -> dict:
        return dict(self._source)

    def answer(self, q: TacticQuery) -> TacticAnswer:
        src = self.source()
        if self.table is None:
            return TacticAnswer(q, None, {}, src, reason=self.unknown)
        m = model_answer(self.table, q, sm=self.sm)
        if m.error:
            return TacticAnswer(q, 0, {}, src, reason=f"FlashInfer rejects the query: {m.error}", configs=())
        reason = None if m.configs else "no valid config (FlashInfer returns an empty list)"
        return TacticAnswer(q, m.count, dict(m.per_tile), src, reason=reason, configs=m.configs)


# --------------------------------------------------------------------------- worker
class WorkerDied(RuntimeError):
    pass


class _Worker:
    """A long-lived subprocess around FlashInfer's op; restarted when it dies.

    Every answer must come within ``timeout`` seconds and carry the id of its request; a
    worker that hangs or answers out of turn is killed (and restarted for the next query).
    """

    def __init__(self, argv: list, env: dict, timeout: float = 120.0):
        self.argv, self.env, self.timeout = argv, env, timeout
        self.proc: Optional[subprocess.Popen] = None
        self.hello: dict = {}
        self._stderr = collections.deque(maxlen=60)
        self._lines: queue.Queue = queue.Queue()
        self._n = 0
        self.restarts = -1

    def _drain(self, stream):
        for line in stream:
            self._stderr.append(line.rstrip())

    @staticmethod
    def _pump(stream, lines: queue.Queue) -> None:
        for line in stream:
            lines.put(line)
        lines.put("")  # end of output: the worker is gone

    def _next_line(self, when: str) -> str:
        """The worker's next line of output, or "" when it ended; killed after ``timeout`` seconds."""
        try:
            return self._lines.get(timeout=self.timeout)
        except queue.Empty:
            self._kill()
            raise WorkerDied(
                f"the tactic worker gave no answer within {self.timeout:.0f} s {when}; it was stopped"
            ) from None

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def start(self):
        self.restarts += 1
        self._stderr.clear()
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        threading.Thread(target=self._drain, args=(self.proc.stderr,), daemon=True).start()
        self._lines = queue.Queue()
        threading.Thread(target=self._pump, args=(self.proc.stdout, self._lines), daemon=True).start()
        line = self._next_line("while starting")
        if not line:
            raise WorkerDied(self._death_note("while starting"))
        self.hello = json.loads(line)
        if not self.hello.get("ready"):
            self.proc.wait()
            raise WorkerDied(f"the tactic worker could not load FlashInfer's module: {self.hello.get('error')}")

    def _death_note(self, when: str) -> str:
        rc = self.proc.wait() if self.proc else None
        tail = " | ".join(list(self._stderr)[-6:])
        what = f"FlashInfer exited with status {rc}" if rc and rc > 0 else f"the worker died (status {rc})"
        return f"{what} {when}" + (f"; its last output: {tail}" if tail else "")

    def ask(self, req: dict) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        self._n += 1
        req = dict(req, id=self._n)
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            line = self._next_line("to this query")
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            note = self._death_note("during this query")
            self.proc = None
            raise WorkerDied(note)
        try:
            answer = json.loads(line)
        except ValueError:
            answer = None
        if not isinstance(answer, dict) or answer.get("id") != req["id"]:
            self._kill()
            raise WorkerDied(f"the tactic worker answered out of turn (expected id {req['id']}): {line.strip()[:200]}")
        return answer

    def close(self):
        if self.proc and self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=5)
            except Exception:
                self.proc.kill()
        self.proc = None


def _blackwell_gpu() -> bool:
    """A Blackwell (SM10x) CUDA device 0; without an NVIDIA device node torch is not imported."""
    if "torch" not in sys.modules and not any(Path("/dev").glob("nvidia[0-9]*")):
        return False
    return _device_sm() // 10 == 10


def _device_sm() -> int:
    """SM version of CUDA device 0 (e.g. 100, 103), 0 without one."""
    try:
        import torch

        if not torch.cuda.is_available():
            return 0
        major, minor = torch.cuda.get_device_capability(0)
        return 10 * major + minor
    except Exception:
        return 0


class TacticOracle:
    """Answers which TRTLLM-Gen MoE tactics are valid for a shape.

    mode: "auto" (native on a Blackwell GPU, else the model when the installed FlashInfer's
    kernel set is shipped, else the built module + shim, else the model),
    "native", "live" (the built module + shim), or "model" (:mod:`fimoe_lab.tune.validity`
    on the shipped kernel table of the installed FlashInfer; "snapshot" is the same, the
    name of the offline source before the model).  kernels: path of a kernel table for the
    model (default: the shipped one matching the installed FlashInfer, or the newest shipped
    when FlashInfer is not installed).  sm: the Blackwell device answered for, 100
    (B200/GB200, the default) or 103 (B300/GB300: the SM103 builds of the patched-F2FP MxFP4
    kernels); the shim presents that SM, and "native" requires the GPU to be it.

    >>> o = TacticOracle(mode="model")
    >>> a = o.query("nvfp4", "swiglu", hidden=3072, intermediate=1920, experts=128, top_k=6, tokens=8,
    ...             per_token=True)
    >>> a.count, a.source["kind"]       # doctest: +SKIP
    """

    MODES = ("auto", "native", "live", "model", "snapshot")

    SMS = (100, 103)

    def __init__(self, mode: str = "auto", kernels: Optional[os.PathLike] = None, sm: Optional[int] = None):
        if mode not in self.MODES:
            raise OracleError(f"unknown oracle mode {mode!r}", fix=f"choose one of {', '.join(self.MODES)}")
        if sm is not None and sm not in self.SMS:
            raise OracleError(f"unknown Blackwell SM version {sm!r}", fix="choose 100 (B200/GB200) or 103 (B300/GB300)")
        self._kernels_path = kernels
        self._sm = sm
        self._model: Optional[_Model] = None
        self._worker: Optional[_Worker] = None
        self._cache: dict = {}
        self.mode = self._resolve(mode)
        if self.mode in ("native", "live"):
            atexit.register(self.close)

    # -- setup ----------------------------------------------------------------
    def _resolve(self, mode: str) -> str:
        if mode in ("model", "snapshot"):
            self._model = _Model.load(self._kernels_path, self._sm or 100)
            return "model"
        if mode in ("auto", "native") and _blackwell_gpu():
            if self._sm is not None and self._sm != _device_sm():
                raise OracleError(
                    f"sm={self._sm} asked, but the GPU is SM{_device_sm()}",
                    fix="drop sm (the GPU answers for itself), or use mode='model' for another SM",
                )
            self._worker = _Worker([sys.executable, "-m", "fimoe_lab.tune._worker", "native"], self._env())
            return "native"
        if mode == "native":
            raise OracleError(
                "mode='native' needs a Blackwell (SM10x) GPU; none is visible",
                fix="use mode='auto' (built module or model) or mode='model'",
            )
        if mode == "auto" and self._kernels_path is None and self._sm is None:
            # The model is exact for a shipped kernel set (equal to the live module on every
            # shape tested, tests/test_tune_validity.py) and answers in ~0.1 ms: ask it first.
            model = _Model.load(None, 100) if validity.shipped_tables() else None
            if model is not None and model.table is not None and _installed("flashinfer-python") is not None:
                self._model = model
                return "model"
        from . import build

        man = build.find_module()
        if man is not None:
            env = self._env()
            env["LD_PRELOAD"] = (man.shim_path + " " + env.get("LD_PRELOAD", "")).strip()
            libs = [str(Path(man.cuda_home) / "lib64")] if man.cuda_home else []
            env["LD_LIBRARY_PATH"] = ":".join(libs + [env.get("LD_LIBRARY_PATH", "")]).strip(":")
            if self._sm is not None:
                env["FIMOE_SHIM_SM"] = str(self._sm)  # the device the shim presents
            self._worker = _Worker([sys.executable, "-m", "fimoe_lab.tune._worker", "shim", man.so_path], env)
            self.manifest = man
            return "live"
        if mode == "live":
            pre = build.check_prereqs()
            probs = pre.problems()
            hint = (" (also missing: " + "; ".join(probs) + ")") if probs else ""
            raise OracleError(
                f"no built TRTLLM-Gen MoE module for the installed FlashInfer ({pre.flashinfer_version})",
                fix=f"run `python -m fimoe_lab.tune.build`{hint}, or use mode='model'",
            )
        self._model = _Model.load(self._kernels_path, self._sm or 100)
        return "model"

    @staticmethod
    def _env() -> dict:
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        return env

    @property
    def kernel_table(self) -> Optional[validity.KernelTable]:
        """The model's kernel table (mode "model"; None where the kernel set is not shipped)."""
        return self._model.table if self._model else None

    def source(self) -> dict:
        """Where answers come from now."""
        if self._model is not None:
            return self._model.source()
        w = self._worker
        if w is not None and not w.hello:
            try:
                w.start()
            except WorkerDied as e:
                return {"kind": "live", "mode": self.mode, "error": str(e)}
        return {
            "kind": "live",
            "mode": "shim" if self.mode == "live" else "native",
            "flashinfer": w.hello.get("flashinfer"),
            "kernel_set": w.hello.get("kernel_set"),
        }

    def close(self):
        if self._worker:
            self._worker.close()

    # -- queries --------------------------------------------------------------
    def query(
        self,
        format: str,
        activation: str,
        hidden: int,
        intermediate: int,
        experts: int,
        top_k: int,
        tokens: int,
        per_token: bool = False,
        layout: Optional[str] = None,
    ) -> TacticAnswer:
        """Valid tactics for one shape (per rank, already padded). See :class:`TacticQuery`."""
        return self.ask(
            TacticQuery(format, activation, hidden, intermediate, experts, top_k, tokens, per_token, layout)
        )

    def ask(self, q: TacticQuery) -> TacticAnswer:
        q = q.normalized()
        k = q.key()
        if k in self._cache:
            return self._cache[k]
        if self._model is not None:
            ans = self._model.answer(q)
        else:
            ans = self._live(q)
        if ans.known:
            self._cache[k] = ans
        return ans

    def ask_many(self, queries: Sequence[TacticQuery], progress: bool = False) -> list:
        it = queries
        if progress:
            from tqdm import tqdm

            it = tqdm(queries, desc="tactic queries", unit="q")
        return [self.ask(q) for q in it]

    def _live(self, q: TacticQuery) -> TacticAnswer:
        w = self._worker
        assert w is not None
        try:
            r = w.ask(q.request())
        except WorkerDied as e:
            return TacticAnswer(q, None, {}, {"kind": "live", "mode": self.mode}, reason=str(e))
        src = {
            "kind": "live",
            "mode": "shim" if self.mode == "live" else "native",
            "flashinfer": w.hello.get("flashinfer"),
            "kernel_set": w.hello.get("kernel_set"),
        }
        if not r.get("ok"):
            return TacticAnswer(q, 0, {}, src, reason=f"FlashInfer rejected the query: {r.get('error')}", configs=())
        configs = tuple((int(a), int(b)) for a, b in r["configs"])
        per_tile = dict(collections.Counter(t for t, _ in configs))
        reason = None if configs else "no valid config (FlashInfer returned an empty list)"
        return TacticAnswer(q, len(configs), per_tile, src, reason=reason, configs=configs)
