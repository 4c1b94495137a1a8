"""The one error family of fimoe_lab: bad input, said once, with the fix.

Every refusal is a :class:`FimoeError` (a ``ValueError``, so ``except ValueError`` keeps
working): its message says what is wrong, its ``fix`` how to put it right. Helpers raise
without knowing who called them; the public boundary (a drop-in, a CLI handler) adds
*where* once with :meth:`FimoeError.within`. The CLI prints
``error: <context>: <message> (fix: <fix>)`` and exits 2. Nothing parses a message back
into data: what a caller needs is an attribute.

This module imports nothing heavy, so the CLI can use it before torch loads.
"""

from __future__ import annotations

__all__ = ["FimoeError", "LayoutError", "FormatError", "CheckpointError", "OracleError"]


class FimoeError(ValueError):
    """Bad input to fimoe_lab.

    Attributes:
        message: what is wrong (names the constraint and the values involved).
        fix: how to fix it, or ``None`` when the message already says.
        context: where it happened (a drop-in, a file, a command), added at the boundary.
    """

    def __init__(self, message: str, fix: str | None = None, context: str | None = None) -> None:
        self.message = message
        self.fix = fix
        self.context = context
        super().__init__(message)

    def within(self, context: str) -> FimoeError:
        """Return this error with ``context`` prepended (once: an outer boundary does not repeat it)."""
        if self.context is None:
            self.context = context
        return self

    def __str__(self) -> str:
        text = f"{self.context}: {self.message}" if self.context else self.message
        return f"{text} (fix: {self.fix})" if self.fix else text


class LayoutError(FimoeError):
    """A tensor or shape does not meet a kernel layout constraint."""


class FormatError(FimoeError):
    """Unknown or unsupported format, backend, activation or engine setting."""


class CheckpointError(FimoeError):
    """A checkpoint or converted file cannot be read, converted or restored as asked."""


class OracleError(FimoeError):
    """Bad input to the tactic oracle (unknown format, impossible shape, no source available)."""
