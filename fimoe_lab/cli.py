"""The ``fimoe-lab`` command (also ``python -m fimoe_lab``).

Subcommands register themselves from their own modules; heavy imports happen only
when a subcommand runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable, Optional

# module that defines ``register(subparsers)`` for each group of subcommands
SUBCOMMAND_MODULES = (
    "fimoe_lab.commands",
    "fimoe_lab.checkpoints_cli",
    "fimoe_lab.tune.cli",
    "fimoe_lab.viz.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fimoe-lab",
        description=(
            "See, check, speed up and tune the weight layouts of FlashInfer's fused-MoE kernels. "
            "Every transform is an index map you can apply, invert, compose and draw."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run 'fimoe-lab COMMAND --help' for the options of a command.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and name.startswith(exc.name):
                continue  # that part of the toolkit is not in this build
            raise
        module.register(sub)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Optional[Callable] = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        return int(handler(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, KeyError) as exc:  # our errors explain themselves
        print(f"fimoe-lab {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
