"""Which fimoe_lab a benchmark measures: the tree named by ``PYTHONPATH`` first, then this checkout.

``PYTHONPATH=TREE python3 benchmarks/X.py`` measures the package in TREE (an A/B against an earlier release
unpacked there: ``git archive REV fimoe_lab | tar -x -C TREE``), in the benchmark's process and in every child
it starts (:func:`child_env`); a plain run measures this checkout, ahead of any installed fimoe_lab.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _given() -> list[str]:
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def on_path() -> None:
    """Put this checkout on ``sys.path`` right after the last ``PYTHONPATH`` entry there (after the script's
    folder where none is given), before the installed packages."""
    where = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
    if ROOT in where:
        return
    given = {os.path.abspath(p) for p in _given()}
    sys.path.insert(1 + max((i for i, p in enumerate(where) if p in given), default=0), ROOT)


def child_env() -> dict[str, str]:
    """A child process's environment: the ``PYTHONPATH`` given, then this checkout."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([*_given(), ROOT]))
