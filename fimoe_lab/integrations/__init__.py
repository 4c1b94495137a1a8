"""Run fimoe_lab's preparation inside a serving engine: one call, reversible, version-checked.

``fimoe_lab.integrations.vllm.install()`` (or ``.sglang.install()``) replaces, in the running
engine, the module attributes its FlashInfer MoE weight preparation calls with fimoe_lab's
equivalents under the engine's profile (:mod:`fimoe_lab.engines`). A replacement is set
where the engine *looks it up*: on the defining module and on every already imported module
of the engine that bound the same function with ``from x import f`` (a module imported
later binds the replacement from the defining module). ``uninstall()`` puts every original
object back (found by identity), ``installed()`` is the context-manager form; both are
idempotent. ``install`` first checks the engine's and FlashInfer's installed versions
(package metadata, without importing them) and refuses an untested pair with one
:class:`EngineVersionError`, changing nothing, unless ``force=True``.

A replacement that refuses its input (a :class:`~fimoe_lab.errors.FimoeError`, raised before
any byte moves) runs the engine's own function instead and counts it in
:data:`FALLBACKS` (the engine keeps working on shapes fimoe_lab does not take).

Importing this package imports neither the engines nor torch.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

from fimoe_lab import env
from fimoe_lab.engines import get_engine
from fimoe_lab.errors import FimoeError
from fimoe_lab.untrusted import printable

__all__ = [
    "ENV_VAR",
    "FALLBACKS",
    "EngineVersionError",
    "Integration",
    "Patch",
]

ENV_VAR = "FIMOE_LAB_INSTALL"
"""Read by the engine plugins (:func:`fimoe_lab.env.env_switch`): a true value (``1 true yes on``)
installs (an untested version is logged and left alone), ``force`` installs on any version, unset or
a false value (``0 false no off``) does nothing; any other value is logged and does nothing."""

FALLBACKS: Counter[str] = Counter()
"""``"module.name"`` -> how many calls fell back to the engine's own function (input refused)."""

_log = logging.getLogger("fimoe_lab.integrations")


class EngineVersionError(FimoeError):
    """The engine or FlashInfer installed is not a version the integration was tested with."""


@dataclass(frozen=True)
class Patch:
    """One engine attribute to replace.

    ``module``: the defining module (dotted); ``name``: the attribute, or ``Class.method`` for a
    method (set on that class); ``make``: given the engine's original, returns the replacement
    (same signature and results).
    """

    module: str
    name: str
    make: Callable[[Callable[..., Any]], Callable[..., Any]]


def guarded(ours: Callable[..., Any], original: Callable[..., Any], where: str) -> Callable[..., Any]:
    """``ours``, with the engine's ``original`` run instead when ours refuses the input.

    fimoe_lab's drop-ins check every input before a byte moves (and in-place ones undo a
    failure), so the original sees the caller's tensors untouched.
    """

    @functools.wraps(original)
    def replacement(*args: Any, **kwargs: Any) -> Any:
        try:
            return ours(*args, **kwargs)
        except FimoeError as exc:
            if not FALLBACKS[where]:
                _log.warning("fimoe_lab: %s runs the engine's own code for this input: %s", where, printable(exc))
            FALLBACKS[where] += 1
            return original(*args, **kwargs)

    replacement.__fimoe_original__ = original  # type: ignore[attr-defined]
    return replacement


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass
class Integration:
    """The patches of one engine version and what installing them changed.

    ``profile``: the :mod:`fimoe_lab.engines` profile (engine version and FlashInfer pin);
    ``distribution``: the engine's package name; ``package``: its import prefix;
    ``also_tested_flashinfer``: FlashInfer versions, besides the pin, whose bytes the tests
    compared (the CI environment's).
    """

    profile: str
    distribution: str
    package: str
    patches: tuple[Patch, ...]
    also_tested_flashinfer: tuple[str, ...] = ()
    _applied: list[tuple[Any, str, Any, Any]] = field(default_factory=list)

    # ------------------------------------------------------------------ versions
    def tested(self) -> tuple[str, tuple[str, ...]]:
        """``(engine version, FlashInfer versions)`` this integration accepts without ``force``."""
        p = get_engine(self.profile)
        return p.version, (p.flashinfer, *self.also_tested_flashinfer)

    def check_versions(self) -> None:
        """Raise :class:`EngineVersionError` unless the installed engine and FlashInfer were tested."""
        engine_version, fi_versions = self.tested()
        have_engine, have_fi = _version(self.distribution), _version("flashinfer-python")
        if have_engine != engine_version or have_fi not in fi_versions:
            raise EngineVersionError(
                f"fimoe_lab's {self.package} integration is tested with {self.distribution} {engine_version} and "
                f"flashinfer-python {' or '.join(fi_versions)}; installed: {self.distribution} "
                f"{have_engine or '(none)'}, flashinfer-python {have_fi or '(none)'}",
                fix=f"install a tested pair, or call install(force=True) (plugin: {ENV_VAR}=force) to patch anyway",
            )

    # ------------------------------------------------------------------ install
    @property
    def is_installed(self) -> bool:
        return bool(self._applied)

    def install(self, force: bool = False) -> None:
        """Replace the engine's preparation functions (see the module docstring); idempotent.

        Raises :class:`EngineVersionError` (untested versions, unless ``force``) or
        :class:`FimoeError` (a module or attribute missing) before changing anything.
        """
        if self._applied:
            return
        if not force:
            self.check_versions()
        plan: list[tuple[Any, str, Any, Any]] = []
        for patch in self.patches:
            try:
                module = importlib.import_module(patch.module)
            except ImportError as exc:
                raise FimoeError(
                    f"cannot import {patch.module} ({type(exc).__name__}: {exc})",
                    fix=f"install() needs a working {self.distribution}; call it inside the engine's environment",
                ) from None
            *owners, attr = patch.name.split(".")
            owner: Any = module
            for part in owners:
                owner = getattr(owner, part, None)
            original = owner.__dict__.get(attr) if owner is not None else None
            if not callable(original):
                raise FimoeError(
                    f"{patch.module} has no function {patch.name}; this {self.distribution} differs from the tested one",
                    fix="use a tested version (see Integration.tested())",
                )
            plan.append((owner, attr, original, patch.make(original)))
        replacements = {id(orig): repl for _, _, orig, repl in plan}
        for owner, name, original, replacement in plan:
            setattr(owner, name, replacement)
            self._applied.append((owner, name, original, replacement))
        for module, name, value in self._bound_elsewhere({id(o) for _, _, o, _ in plan}):
            replacement = replacements[id(value)]
            setattr(module, name, replacement)
            self._applied.append((module, name, value, replacement))

    def uninstall(self) -> None:
        """Put back every original the install replaced, also in modules imported since; idempotent."""
        originals = {id(repl): orig for _, _, orig, repl in self._applied}
        for owner, name, original, replacement in reversed(self._applied):
            if owner.__dict__.get(name) is replacement:
                setattr(owner, name, original)
        for module, name, value in self._bound_elsewhere(set(originals)):
            setattr(module, name, originals[id(value)])
        self._applied.clear()

    @contextmanager
    def installed(self, force: bool = False) -> Iterator[Integration]:
        """``with integration.installed(): ...`` installs, and uninstalls on exit (if it installed)."""
        was = self.is_installed
        self.install(force=force)
        try:
            yield self
        finally:
            if not was:
                self.uninstall()

    def _bound_elsewhere(self, ids: set[int]) -> list[tuple[Any, str, Any]]:
        """``(module, name, value)`` for every attribute of the engine's loaded modules whose value is in ``ids``."""
        prefix = self.package + "."
        found = []
        for mod_name, module in list(sys.modules.items()):
            if module is None or not (mod_name == self.package or mod_name.startswith(prefix)):
                continue
            for name, value in list(getattr(module, "__dict__", {}).items()):
                if id(value) in ids:
                    found.append((module, name, value))
        return found

    # ------------------------------------------------------------------ plugin
    def install_from_env(self) -> None:
        """What the engine plugin runs: install as :data:`ENV_VAR` says; never raise into the engine."""
        try:
            value = env.value(ENV_VAR, False)
        except FimoeError as exc:
            _log.warning("fimoe_lab: not installed into %s: %s", self.distribution, exc)
            return
        if not value:
            return
        try:
            self.install(force=value == "force")
        except FimoeError as exc:
            _log.warning("fimoe_lab: not installed into %s: %s", self.distribution, exc)
            return
        _log.info("fimoe_lab: installed into %s (%d attributes)", self.distribution, len(self._applied))
