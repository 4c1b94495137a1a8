"""The engines' own environments as test oracles, set up once for the engine parity and integration tests.

Each engine's code runs in its own virtual environment at the repository root (``.venv-vllm``,
``.venv-sglang``: torch 2.13 CPU, the engine's FlashInfer pin, the engine installed ``--no-deps``),
driven by a runner under ``tests/engine_oracles/`` that reads its inputs from files and prints or
writes its answers. :func:`oracle_marks` skips a module without the environment (slow: the runner
loads the engine), :func:`run_oracle` runs a runner and checks it exited cleanly, and
:func:`drawn` collects hypothesis-drawn cases for one runner call (new ones each run).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
RUNNERS = ROOT / "tests" / "engine_oracles"


@dataclass(frozen=True)
class EngineEnv:
    """One engine's oracle environment: its ``venv`` folder at the repository root, what it holds
    (``what``, for the skip reason) and how to make it (``make``)."""

    venv: str
    what: str
    make: str

    @property
    def python(self) -> Path:
        return ROOT / self.venv / "bin" / "python"


ENGINE_ENVS = {
    "vllm": EngineEnv(
        ".venv-vllm",
        "vLLM 0.34",
        "python3 -m venv .venv-vllm && .venv-vllm/bin/pip install torch==2.13.0 flashinfer-python==0.7.4 "
        "safetensors && .venv-vllm/bin/pip install --no-deps vllm==0.34.0",
    ),
    "sglang": EngineEnv(
        ".venv-sglang",
        "SGLang 0.5.23",
        "python3 -m venv .venv-sglang && .venv-sglang/bin/pip install torch==2.13.0 flashinfer-python==0.7.2 "
        "safetensors && .venv-sglang/bin/pip install --no-deps sglang==0.5.23",
    ),
}


def oracle_marks(engine: str) -> list[Any]:
    """A test module's ``pytestmark`` when it needs ``engine``'s environment: slow, skipped without it."""
    env = ENGINE_ENVS[engine]
    return [
        pytest.mark.slow,
        pytest.mark.skipif(not env.python.exists(), reason=f"no {env.what} environment: {env.make}"),
    ]


def run_oracle(engine: str, runner: str, *args: str | Path, with_fimoe_lab: bool = False) -> str:
    """Run ``tests/engine_oracles/<runner>`` in ``engine``'s environment with ``args``; its stdout (its
    stderr's tail in the failure when it exits non-zero). ``with_fimoe_lab``: this checkout on its
    ``PYTHONPATH`` (the integration runners import fimoe_lab into the engine)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT)) if with_fimoe_lab else None
    done = subprocess.run(
        [str(ENGINE_ENVS[engine].python), str(RUNNERS / runner), *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def drawn(strategy: st.SearchStrategy[dict], n: int) -> list[dict]:
    """``n`` cases drawn by hypothesis from ``strategy`` (new ones each run; the failing case is printed in full)."""
    out: list[dict] = []

    @settings(max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(case: dict) -> None:
        out.append(case)

    collect()
    return out[:n]
