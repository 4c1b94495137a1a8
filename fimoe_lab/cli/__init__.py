"""The ``fimoe-lab`` command (also ``python -m fimoe_lab``).

One module per group of commands (:mod:`.core`: demo, plan, goldens;
:mod:`.checkpoints`: inspect, convert, restore; :mod:`.tune`: tune, tactics;
:mod:`.lab`: lab; :mod:`.warmup`: warmup; :mod:`.diagnose`: diagnose), each with ``register(subparsers)``; what they share is in
:mod:`._common`. Parsers are built from torch-free tables only, so ``--help`` never
imports torch, numpy or pandas; handlers import what they need when they run.

Errors: bad input prints one line ``error: ...`` and exits 2; anything else is an
internal error (one line, exit 1, ``--debug`` for the traceback); see
:mod:`._common` for every exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from collections.abc import Callable, Iterator
from typing import Optional, TextIO

from fimoe_lab import __version__, env
from fimoe_lab.cli import checkpoints, core, diagnose, lab, tune, warmup
from fimoe_lab.cli._common import EXIT_BAD_INPUT, EXIT_PIPE_CLOSED, EXIT_STATUS_HELP, Parser, report_error
from fimoe_lab.untrusted import printable

__all__ = ["build_parser", "main"]

COMMAND_GROUPS = (core, checkpoints, tune, lab, warmup, diagnose)

_DEBUG_HELP = "on an error, print the traceback too"


def build_parser() -> argparse.ArgumentParser:
    """The ``fimoe-lab`` parser with every command; ``--debug`` goes before or after the command."""
    parser = Parser(
        prog="fimoe-lab",
        description=(
            "See, check, speed up and tune the weight layouts of FlashInfer's fused-MoE kernels. "
            "Every transform is an index map you can apply, invert, compose and draw."
        ),
        epilog="Run 'fimoe-lab COMMAND --help' for the options of a command.\n" + EXIT_STATUS_HELP + "\n" + env.HELP,
    )
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    parser.add_argument("--version", action="version", version=f"fimoe-lab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for group in COMMAND_GROUPS:
        group.register(sub)
    for command in sub.choices.values():
        # SUPPRESS: when absent after the command, the value before it stands
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """Run one command; returns its exit status (argparse usage errors and --help raise SystemExit)."""
    try:
        try:
            with _escaped_stdout():
                code = _run(argv)
        finally:
            sys.stdout.flush()  # a closed pipe shows here, not as a message at interpreter exit
        return code
    except BrokenPipeError:
        _stdout_to_devnull()
        return EXIT_PIPE_CLOSED


def _run(argv: Optional[list[str]]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Optional[Callable[[argparse.Namespace], int]] = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return EXIT_BAD_INPUT
    try:
        env.check_all()  # a bad FIMOE_* value: one error line before any work
        return int(handler(args) or 0)
    except BrokenPipeError:
        raise
    except (Exception, KeyboardInterrupt) as exc:
        return report_error(exc, args.command, args.debug)


class _Escaped(io.TextIOBase):
    """A text stream that writes to ``inner`` with control characters escaped
    (:func:`fimoe_lab.untrusted.printable`; newlines and tabs kept)."""

    def __init__(self, inner: TextIO) -> None:
        self.inner = inner

    def write(self, s: str) -> int:
        self.inner.write(printable(s, keep="\n\t"))
        return len(s)

    def flush(self) -> None:
        self.inner.flush()

    def fileno(self) -> int:
        return self.inner.fileno()

    def isatty(self) -> bool:
        return self.inner.isatty()


@contextlib.contextmanager
def _escaped_stdout() -> Iterator[None]:
    """While a command runs, what it prints on stdout (reports, tables: names and paths read from files)
    cannot move the cursor, retitle the terminal or clear it."""
    inner = sys.stdout
    sys.stdout = _Escaped(inner)  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout = inner


def _stdout_to_devnull() -> None:
    """After the reader of stdout went away (``| head``): point fd 1 at /dev/null, so that the flush
    at interpreter exit does not fail again and print a traceback."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a file descriptor (captured): nothing to redirect
        pass
    finally:
        os.close(devnull)
