"""What every ``fimoe-lab`` command shares: exit codes, the one-line error report,
JSON output, the progress rule, argument types and checkpoint paths.

Imports nothing heavy (no torch, numpy or pandas): parsers are built from it before any
handler runs. Every command exits with one of :data:`EXIT_MEANINGS` (also printed at the
end of ``fimoe-lab --help``).
"""

from __future__ import annotations

import argparse
import copy
import errno
import json
import re
import sys
import textwrap
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NoReturn, TextIO

from fimoe_lab import engines, specs
from fimoe_lab.choice import LayoutChoice
from fimoe_lab.errors import CheckpointError, FimoeError
from fimoe_lab.presets import PRESETS
from fimoe_lab.resources import sample_names, sample_path
from fimoe_lab.untrusted import printable

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_NO_ANSWER = 3
EXIT_INTERRUPTED = 130
EXIT_PIPE_CLOSED = 141  # 128 + SIGPIPE, what a command killed by the signal reports
EXIT_TERMINATED = 143  # 128 + SIGTERM

EXIT_MEANINGS = {
    EXIT_OK: "done, every check passed",
    EXIT_FAILED: "a check failed (a round trip or golden case differs), or an internal error",
    EXIT_BAD_INPUT: "bad input: the one 'error:' line says what is wrong and how to fix it",
    EXIT_NO_ANSWER: "no answer: the source does not know (e.g. an installed FlashInfer whose kernel set is not shipped)",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C); an interrupted write leaves nothing behind",
    EXIT_PIPE_CLOSED: "the reader of stdout closed it (e.g. '| head'): the output stops there, silently",
    EXIT_TERMINATED: "terminated (SIGTERM); an interrupted write leaves nothing behind",
}
EXIT_STATUS_HELP = "exit status:\n" + "\n".join(f"{code}: {text}" for code, text in EXIT_MEANINGS.items())

# files named on the command line that are missing or unreadable: bad input, not a bug
BAD_PATH_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, FileExistsError)
PATH_FIXES = {
    FileNotFoundError: "check the path",
    IsADirectoryError: "pass a file, not a directory",
    NotADirectoryError: "pass a directory",
    PermissionError: "check the permissions of the path (or write elsewhere)",
    FileExistsError: "choose another output",
}
# a full disk, a file-size limit or a read-only file system: the environment, not a bug (nothing partial is left behind)
FULL_ERRNOS = {
    errno.ENOSPC: "free space on the output's file system",
    errno.EFBIG: "raise the file-size limit",
    errno.EROFS: "the file system is read-only: remount it read-write",
}
if hasattr(errno, "EDQUOT"):
    FULL_ERRNOS[errno.EDQUOT] = "free space within your disk quota"


HIDDEN_ALIASES = "fimoe_hidden_aliases"
"""The attribute of an argparse action holding the old spellings it still takes but ``--help`` does not show."""


def add_option(parser: argparse.ArgumentParser, name: str, *aliases: str, **kwargs: Any) -> argparse.Action:
    """``parser.add_argument(name, *aliases, dest=name's, **kwargs)`` with ``aliases`` (old spellings, kept
    working) left out of ``--help``: one name per concept is shown."""
    kwargs.setdefault("dest", name.lstrip("-").replace("-", "_"))
    action = parser.add_argument(name, *aliases, **kwargs)
    setattr(action, HIDDEN_ALIASES, frozenset(aliases))
    return action


class HelpFormatter(argparse.HelpFormatter):
    """argparse's wrapping, per line (each line of a description or epilog is a paragraph), never at hyphens;
    an option's hidden aliases (:func:`add_option`) are left out of its help."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        hidden = getattr(action, HIDDEN_ALIASES, ())
        shown = [s for s in action.option_strings if s not in hidden]
        if shown and shown != action.option_strings:
            action = copy.copy(action)
            action.option_strings = shown
        return super()._format_action_invocation(action)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(
            textwrap.fill(
                " ".join(line.split()), width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False
            )
            for line in text.splitlines()
        )

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help is wrapped by :class:`HelpFormatter`; its subparsers are Parsers too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """A usage error: one line ``error: <prog>: <message> (fix: ...)`` on stderr, exit 2."""
        line = printable(
            one_line(f"error: {self.prog.removeprefix('fimoe-lab ')}: {message} (fix: see '{self.prog} --help')")
        )
        print(line, file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def one_line(text: str) -> str:
    """``text`` with its line breaks (and the blanks around them) folded into single spaces."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def _os_message(exc: OSError) -> str:
    return f"{exc.strerror}: {exc.filename}" if exc.filename is not None and exc.strerror else str(exc)


def report_error(
    exc: BaseException, command: str | None = None, debug: bool = False, stream: TextIO | None = None
) -> int:
    """Print exactly one line about ``exc`` (after its traceback when ``debug``) and return the exit status.

    :class:`FimoeError` -> ``error: <command>: <message> (fix: ...)``, 2 (``command`` is its
    context unless it has one); a missing or unreadable file, a full disk or file-size limit
    -> ``error: ... (fix: ...)``, 2;
    ``KeyboardInterrupt`` -> ``interrupted``, 130; anything else is a bug ->
    ``internal error: <type>: <message>``, 1.
    """
    stream = stream or sys.stderr
    if debug:
        traceback.print_exception(exc, file=stream)
    if isinstance(exc, KeyboardInterrupt):
        signum = getattr(exc, "signum", None)  # SIGTERM while writing (fimoe_lab.checkpoints.safe_io.Terminated)
        line, code = (
            ("interrupted", EXIT_INTERRUPTED) if signum is None else (f"terminated by signal {signum}", 128 + signum)
        )
    elif isinstance(exc, FimoeError):
        line, code = f"error: {exc.within(command) if command else exc}", EXIT_BAD_INPUT
    elif isinstance(exc, BAD_PATH_ERRORS):
        fix = next(f for t, f in PATH_FIXES.items() if isinstance(exc, t))
        line, code = f"error: {command + ': ' if command else ''}{_os_message(exc)} (fix: {fix})", EXIT_BAD_INPUT
    elif isinstance(exc, OSError) and exc.errno in FULL_ERRNOS:
        fix = f"{FULL_ERRNOS[exc.errno]}, or write elsewhere; nothing partial was left"
        line, code = f"error: {command + ': ' if command else ''}{_os_message(exc)} (fix: {fix})", EXIT_BAD_INPUT
    else:
        hint = "" if debug else " (run with --debug for the traceback)"
        line, code = f"internal error: {type(exc).__name__}: {exc}{hint}", EXIT_FAILED
    print(printable(one_line(line)), file=stream)  # names and paths from files: no terminal escapes
    return code


def print_json(obj: Any) -> None:
    """The one JSON form on stdout (``--json``): indent 1, keys in insertion order."""
    print(json.dumps(obj, indent=1))


def add_json_option(parser: argparse.ArgumentParser, schema: str, document: str = "object") -> None:
    """``--json``: the command prints one JSON document (an ``object`` or a ``list``) on stdout
    (:func:`print_json`) and nothing else there; ``schema`` (its fields) goes into the ``--help`` text. Errors
    stay one line on stderr, progress goes to stderr."""
    parser.add_argument(
        "--json",
        action="store_true",
        help=f"print the result as one JSON {document} on stdout, nothing else: {schema}",
    )


def add_tp_option(parser: argparse.ArgumentParser, note: str = "", default: int = 1) -> None:
    """``--tp N`` (hidden alias ``--tp-size``): one tensor-parallel size >= 1 (``note``: what it does in this
    command)."""
    add_option(
        parser,
        "--tp",
        "--tp-size",
        type=positive_int("--tp"),
        default=default,
        metavar="N",
        help=f"tensor-parallel size (default {default}){': ' + note if note else ''}",
    )


def add_rank_option(parser: argparse.ArgumentParser, note: str, parse: Callable[[str], Any] = int) -> None:
    """``--rank R`` (hidden alias ``--tp-rank``): the tensor-parallel rank, default 0 (``note``: what it does;
    ``parse``: the argparse type, e.g. one that also takes ``all``)."""
    add_option(parser, "--rank", "--tp-rank", type=parse, default=0, metavar="R", help=f"tensor-parallel rank {note}")


def add_size_options(
    parser: argparse.ArgumentParser,
    intermediate: str,
    hidden: str = "hidden size (K of GEMM1)",
    required: bool = False,
    defaults: tuple[int | None, int | None] = (None, None),
) -> None:
    """``--intermediate I`` (hidden alias ``--inter``) and ``--hidden H``: the MoE sizes, integers >= 1
    (``intermediate`` and ``hidden``: what each means in this command; ``defaults``: theirs)."""
    add_option(
        parser,
        "--intermediate",
        "--inter",
        type=positive_int("--intermediate"),
        required=required,
        default=defaults[0],
        metavar="I",
        help=intermediate,
    )
    parser.add_argument(
        "--hidden", type=positive_int("--hidden"), required=required, default=defaults[1], metavar="H", help=hidden
    )


def add_format_option(
    parser: argparse.ArgumentParser,
    help: str,
    formats: Iterable[str] | None = None,
    every: bool = False,
    repeat: bool = False,
    **kwargs: Any,
) -> argparse.Action:
    """``--format FMT``, the same word on every command: one of ``formats`` (default: the weight formats of
    :data:`fimoe_lab.specs.FORMATS`), any case; ``every`` adds ``all``; ``repeat`` collects a list in
    ``formats``."""
    names = tuple(formats if formats is not None else specs.weight_formats()) + (("all",) if every else ())
    if repeat:
        kwargs.update(action="append", dest="formats")
    return parser.add_argument("--format", type=lower_choice(names), metavar="FMT", help=help, **kwargs)


def add_backend_option(
    parser: argparse.ArgumentParser, help: str, every: bool = False, repeat: bool = False, **kwargs: Any
) -> argparse.Action:
    """``--backend B``, the same word on every command: one of :data:`fimoe_lab.specs.BACKENDS`, any case;
    ``every`` adds ``all``; ``repeat`` collects a list in ``backends``."""
    names = specs.BACKENDS + (("all",) if every else ())
    if repeat:
        kwargs.update(action="append", dest="backends")
    metavar = "|".join(names)
    return parser.add_argument("--backend", type=lower_choice(names), metavar=metavar, help=help, **kwargs)


def add_per_token_option(parser: argparse.ArgumentParser, effect: str) -> None:
    """``--per-token``: NVFP4 activations quantised per token; ``effect``: what changes in this command."""
    parser.add_argument(
        "--per-token", action="store_true", help=f"NVFP4 activations quantised per token (NVFP4 only): {effect}"
    )


PROGRESS_LINE = re.compile(
    r"^(?P<desc>[^\r\n]*): (?P<percent>\d{1,3})% \((?P<done>\d+(?:\.\d\d)?) of (?P<total>\d+(?:\.\d\d)?) "
    r"(?P<unit>MB|[a-z]+), (?P<rate>\d+\.\d) (?P=unit)/s, ETA (?P<eta>\d+:\d\d:\d\d|-)\)$"
)
"""One line of :class:`PlainProgress` (what a test or a log parser matches)."""

PROGRESS_HELP = (
    "by default progress goes to stderr (never stdout): a live bar when stderr is a terminal, else plain lines "
    "(percent, done of the total, rate, ETA; no carriage return), one per tenth done or every 30 s"
)


def add_progress_option(parser: argparse.ArgumentParser) -> None:
    """``--no-progress`` (silences the bar and the plain lines) and ``--progress`` (accepted, a no-op: progress is
    on by default): the one definition every long-running command uses (:func:`progress_for` reads them)."""
    parser.add_argument("--no-progress", action="store_true", help=f"print no progress; {PROGRESS_HELP}")
    parser.add_argument(
        "--progress", action="store_true", help="accepted for old scripts and ignored: progress is on by default"
    )


def show_progress(disabled: bool = False) -> bool:
    """Whether a live bar (tqdm, carriage returns) may be drawn: on stderr, and only when it is a terminal."""
    return not disabled and sys.stderr.isatty()


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class PlainProgress:
    """Progress for logs and pipes: tqdm's ``update``/``close`` (what the writers call), printing plain lines on
    stderr, no carriage return. A line is printed by an update that completes another tenth of ``total`` (at most
    ``steps`` such lines, the last at 100%), or by the first update ``interval`` seconds after the previous line;
    nothing before the first update (a refusal before any work stays one line), nothing on ``close``.

    Each line (:data:`PROGRESS_LINE`): ``DESC: P% (D of T MB, R MB/s, ETA H:MM:SS)`` with ``P = floor(100 *
    done / total)``, ``R = done / elapsed``, ``ETA = (total - done) / R`` (``-`` before any rate is known); bytes
    (``unit`` ``B``, tqdm's) in MB, anything else counted as is (``3 of 12 cases, 0.5 cases/s``)."""

    def __init__(
        self,
        total: int,
        desc: str = "",
        stream: TextIO | None = None,
        steps: int = 10,
        interval: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        unit: str = "B",
        **_: Any,
    ) -> None:
        self.unit, self.scale = ("MB", 1e6) if unit == "B" else (unit, 1.0)
        self.total, self.desc, self.steps, self.interval = max(int(total), 0), printable(desc), steps, interval
        self.done, self.shown = 0, 0
        self.stream = stream or sys.stderr
        self.clock = clock
        self.start = self.last = clock()

    def update(self, n: int = 1) -> None:
        self.done += n
        now = self.clock()
        reached = self.steps if self.total == 0 else min(self.done * self.steps // self.total, self.steps)
        if reached > self.shown or (now - self.last >= self.interval and self.shown < self.steps):
            self.shown, self.last = max(reached, self.shown), now  # a big chunk may cross several tenths: one line
            print(self.line(now), file=self.stream, flush=True)

    def line(self, now: float) -> str:
        """The line for ``done`` at time ``now``."""
        done = min(self.done, self.total)
        percent = 100 if self.total == 0 else 100 * done // self.total
        rate = self.done / max(now - self.start, 1e-9)
        eta = _clock((self.total - done) / rate) if rate > 0 else "-"
        amount = f"{done} of {self.total}" if self.scale == 1 else f"{done / 1e6:.2f} of {self.total / 1e6:.2f}"
        return f"{self.desc}: {percent}% ({amount} {self.unit}, {rate / self.scale:.1f} {self.unit}/s, ETA {eta})"

    def close(self) -> None:
        """Nothing to clear: every line printed stays as it is (and a failure's error line stays the last)."""


def progress_for(disabled: bool = False, plain: bool = False) -> bool | type[PlainProgress]:
    """What a command that streams bytes shows on stderr (stdout, and so ``--json``, never holds progress): a live
    bar (True) on a terminal, else :class:`PlainProgress` lines (logs, pipes, nohup, CI); nothing when ``disabled``
    (``--no-progress``). No carriage return ever reaches a file or a pipe. ``plain`` (the old ``--progress``) is
    ignored: plain lines are the default off a terminal."""
    if disabled:
        return False
    return True if sys.stderr.isatty() else PlainProgress


def progress_bar(disabled: bool, total: int, desc: str, unit: str) -> Any:
    """A bar over ``total`` ``unit`` (e.g. ``cases``) for a command's own loop, by :func:`progress_for`'s rule:
    tqdm on a terminal, :class:`PlainProgress` lines off one, None with ``--no-progress``. Call it once the
    inputs are checked (a refusal before any work stays one line); ``update(n)`` and ``close()`` it."""
    how = progress_for(disabled)
    if how is False:
        return None
    if how is True:
        from tqdm import tqdm

        return tqdm(total=total, desc=printable(desc), unit=unit.rstrip("s"), file=sys.stderr)
    return PlainProgress(total=total, desc=desc, unit=unit)


def lower_choice(valid: Iterable[str]) -> Callable[[str], str]:
    """argparse ``type``: one of ``valid``, case-insensitive; the error lists them."""
    valid = tuple(valid)

    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in valid:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of: {', '.join(valid)}")
        return value

    return parse


def positive_int(flag: str) -> Callable[[str], int]:
    """argparse ``type``: an integer >= 1 (sizes, alignments, counts)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} takes a positive integer, got {text!r}")
        return value

    return parse


def int_list(flag: str, example: str, minimum: int = 1) -> Callable[[str], tuple[int, ...]]:
    """argparse ``type``: comma-separated integers ``>= minimum`` (e.g. ``--tp 1,2,4,8``)."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(",") if v.strip())
        except ValueError:
            values = ()
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(
                f"{flag} takes comma-separated integers >= {minimum} like {example}, got {text!r}"
            )
        return values

    return parse


def checkpoint_path(value: str) -> Path:
    """A checkpoint directory (or its config.json), or the name of a shipped sample; a path that is not there is a
    FileNotFoundError saying it does not exist (and listing the samples), another file one CheckpointError."""
    path = Path(value)
    if path.is_dir():
        return path
    if value in sample_names():
        return sample_path(value)
    if path.is_file() and path.name == "config.json":
        return path.parent
    if path.exists():
        raise CheckpointError(
            f"{value} is not a checkpoint directory", fix="pass the checkpoint's directory or its config.json"
        )
    if value.strip().lower() in PRESETS:
        raise CheckpointError(
            f"{value} is a model preset (sizes only): this command reads weights",
            fix=f"pass a checkpoint directory, its config.json or a sample ({', '.join(sample_names()) or 'none'})",
        )
    raise FileNotFoundError(
        f"{value} does not exist (not a checkpoint directory, its config.json or a sample; samples: "
        f"{', '.join(sample_names()) or 'none'})"
    )


def model_source(text: str, presets: Iterable[str]) -> tuple[str, str | Path]:
    """What a model argument names: ``("preset", name)`` (one of ``presets``, any case), ``("checkpoint",
    directory)`` (a shipped sample, a checkpoint directory, or a file in a directory holding ``*.safetensors``:
    its config.json, a shard) or ``("config", file)`` (a config.json elsewhere); a path that is not there is a
    FileNotFoundError saying it does not exist."""
    if text.strip().lower() in presets:
        return "preset", text.strip().lower()
    if text in sample_names():
        return "checkpoint", sample_path(text)
    path = Path(text)
    if path.is_dir():
        return "checkpoint", path
    if path.is_file():
        return ("checkpoint", path.parent) if any(path.parent.glob("*.safetensors")) else ("config", path)
    raise FileNotFoundError(
        f"{text} does not exist (not a preset, a sample, a checkpoint directory or a config.json; presets: "
        f"{', '.join(sorted(presets))}; samples: {', '.join(sample_names()) or 'none'})"
    )


def newest_profiles() -> dict[str, str]:
    """``{engine: its newest profile}`` over :data:`fimoe_lab.engines.ENGINE_CHOICES` (``vllm`` ->
    ``vllm-0.34``): what ``--engine vllm|sglang|flashinfer`` means. Versions compare as integers."""

    def version(name: str) -> tuple[int, ...]:
        return tuple(int(p) if p.isdigit() else -1 for p in engines.ENGINES[name].version.split("."))

    newest: dict[str, str] = {}
    for name in engines.ENGINE_CHOICES:
        family = engines.ENGINES[name].engine
        if family not in newest or version(name) > version(newest[family]):
            newest[family] = name
    return newest


def engine_choice(text: str) -> str:
    """argparse ``type`` of ``--engine``: a profile name, or an engine name for its newest profile
    (:func:`newest_profiles`)."""
    key = text.strip().lower()
    key = newest_profiles().get(key, key)
    if key not in engines.ENGINE_CHOICES:
        names = ", ".join([*engines.ENGINE_CHOICES, *newest_profiles()])
        raise argparse.ArgumentTypeError(f"unknown engine {text!r}: choose one of {names}")
    return key


def add_engine_option(parser: argparse.ArgumentParser, values: bool = False) -> None:
    """``--engine``: the engine profile whose defaults and layouts apply (choices from the profile table; an
    engine's name is its newest profile). ``values``: the command writes values, so its help says what naming an
    engine does to them (its value rules apply)."""
    newest = ", ".join(f"{e} = {p}" for e, p in newest_profiles().items())
    default = f"default {engines.DEFAULT_ENGINE}"
    if values:
        default += (
            "'s layout with the checkpoint's values wherever the kernel takes them; an engine named also applies its "
            "value rules, e.g. FP8 per-tensor W13 requantized to one scale: its bytes (the file keeps the checkpoint's "
            "too, so restore is exact)"
        )
    parser.add_argument(
        "--engine",
        type=engine_choice,
        default=None,
        metavar="ENGINE",
        help=f"engine profile whose default paddings, pad bytes and scale layouts apply: "
        f"{', '.join(engines.ENGINE_CHOICES)}, or an engine's newest ({newest}) ({default})",
    )


def layout_choice(args: argparse.Namespace, backend: str | None = None) -> LayoutChoice:
    """The one :class:`~fimoe_lab.choice.LayoutChoice` of a planning command's parsed options, passed whole to what
    it plans with: ``--backend`` (or ``backend``, for a command that asks several), ``--intermediate-alignment``,
    ``--hidden-alignment``, ``--engine``, ``--per-token``, ``--mxfp4-activation`` (an option the command does not
    take: its default)."""
    return LayoutChoice(
        backend or args.backend,
        getattr(args, "intermediate_alignment", None),
        getattr(args, "hidden_alignment", None),
        getattr(args, "engine", None),
        getattr(args, "per_token", False),
        getattr(args, "mxfp4_activation", None),
    )
