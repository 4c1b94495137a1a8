"""Load an engine's preparation modules from its installed package without importing the package.

Run inside the engine's environment (``.venv-vllm`` / ``.venv-sglang``), never by pytest.
``isolate(pkg, real)`` registers every parent package of the modules named in ``real`` as an
empty package (their ``__init__`` does not run: vLLM's and SGLang's pull in CUDA extensions,
transformers, ray ...), lets the modules in ``real`` load from their own files, and answers
every other ``pkg.*`` import with a permissive stub: any attribute, call, subscript or ``|`` of a
stub is a stub, a stub called with one function returns it (a decorator), and a stub is false
(import-time feature flags such as ``_is_hip`` or ``is_flashinfer_available()`` read off). Only names bound
at import time reach the stubs; a test fails loudly (a stub has no tensor methods) if the
preparation code executed one.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any


class _StubMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stub_class(name)

    def __or__(cls, other: Any) -> Any:
        return cls

    def __ror__(cls, other: Any) -> Any:
        return cls

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __iter__(cls) -> Any:
        return iter(())

    def __bool__(cls) -> bool:  # feature flags (``if _is_hip:``, ``if is_flashinfer_available():``) read off
        return False


def _stub_class(name: str) -> type:
    def new(cls: type, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return cls

    return _StubMeta(name, (), {"__new__": new})


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _stub_class(name)
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, pkg: str, real: set[str]) -> None:
        self.pkg, self.real = pkg, real

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if not fullname.startswith(self.pkg + ".") or fullname in self.real:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def isolate(pkg: str, real: list[str]) -> None:
    """Make ``import <one of real>`` load that file alone, stubbing every other ``pkg`` module."""
    spec = importlib.util.find_spec(pkg)
    if spec is None or spec.submodule_search_locations is None:
        raise SystemExit(f"{pkg} is not installed in {sys.executable}")
    root = Path(list(spec.submodule_search_locations)[0])
    for name in real:
        parts = name.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent not in sys.modules:
                module = types.ModuleType(parent)
                module.__path__ = [str(root.joinpath(*parts[1:i]))]
                sys.modules[parent] = module
                if i > 1:
                    setattr(sys.modules[".".join(parts[: i - 1])], parts[i - 1], module)
    sys.meta_path.insert(0, _Finder(pkg, set(real)))
