"""Nothing is unpickled anywhere: the package has no ``torch.load``, no pickle import and no ``np.load``
that allows pickles; ``diagnose`` reads dumps as safetensors or ``.npy`` (plain number dtypes, sizes
checked before allocating) and refuses a ``.pt``, each with one clear line.
"""

from __future__ import annotations

import ast
import io
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from fimoe_lab.cli import main
from fimoe_lab.diagnose import load_dump
from fimoe_lab.errors import FimoeError

PACKAGE = Path(__file__).resolve().parent.parent / "fimoe_lab"
PICKLERS = {"pickle", "cPickle", "_pickle", "dill", "joblib", "cloudpickle", "shelve", "marshal"}


def _unpickling_calls(tree: ast.AST) -> list[str]:
    """What in one module could unpickle: imports of pickling modules, ``torch.load``/``load`` from torch,
    ``np.load`` without ``allow_pickle=False``, any ``allow_pickle=True``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in PICKLERS]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if mod.split(".")[0] in PICKLERS or (mod == "torch" and any(a.name == "load" for a in node.names)):
                found.append(f"from {mod} import ...")
        elif isinstance(node, ast.Call):
            f = node.func
            name = ast.unparse(f)
            kws = {k.arg: k.value for k in node.keywords}
            if name in ("torch.load", "torch.serialization.load") or name.endswith("unpickle"):
                found.append(name)
            if name in ("np.load", "numpy.load"):
                allow = kws.get("allow_pickle")
                if not (isinstance(allow, ast.Constant) and allow.value is False):
                    found.append(f"{name} without allow_pickle=False")
            allow = kws.get("allow_pickle")
            if isinstance(allow, ast.Constant) and allow.value is True:
                found.append(f"{name}(allow_pickle=True)")
    return found


def test_the_package_has_no_unpickling_call():
    bad = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        hits = _unpickling_calls(ast.parse(path.read_text(), str(path)))
        if hits:
            bad[str(path.relative_to(PACKAGE))] = hits
    assert bad == {}


@pytest.mark.parametrize(
    "source",
    [
        "import pickle",
        "from torch import load",
        "torch.load(p)",
        "torch.load(p, weights_only=True)",
        "np.load(p)",
        "np.load(p, allow_pickle=True)",
        "numpy.load(p, allow_pickle=flag)",
    ],
)
def test_the_scan_finds_every_way_to_unpickle(source):
    assert _unpickling_calls(ast.parse(source)), source  # the scan above can fail


def _error_line(argv, capsys) -> str:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: ") and "(fix: " in err, (rc, err)
    assert "Traceback" not in err and "internal error" not in err
    return err


def test_a_pt_file_is_refused_without_being_opened(tmp_path, capsys):
    pt = tmp_path / "dump.pt"
    torch.save({"w13_weight": torch.arange(12, dtype=torch.uint8).reshape(1, 3, 4)}, pt)
    before = pt.read_bytes()
    err = _error_line(["diagnose", "deepseek-r1-nvfp4", pt], capsys)
    assert "never unpickles" in err and "save_file" in err
    assert pt.read_bytes() == before


def _npy(array: np.ndarray, allow_pickle: bool = False) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=allow_pickle)
    return buf.getvalue()


def test_npy_dumps_round_trip_their_bytes(tmp_path):
    rng = np.random.default_rng(0)
    for dtype in (np.uint8, np.int32, np.float32, np.float16, np.bool_):
        a = rng.integers(0, 200, size=(3, 5, 7)).astype(dtype)
        p = tmp_path / "gemm1_weights.npy"
        p.write_bytes(_npy(a))
        got = load_dump(p)
        assert list(got) == ["gemm1_weights"] and np.array_equal(got["gemm1_weights"].numpy(), a)
    f = np.asfortranarray(rng.integers(0, 255, size=(4, 6)).astype(np.uint8))
    p.write_bytes(_npy(f))
    assert np.array_equal(load_dump(p)["gemm1_weights"].numpy(), f)


def _hostile_npy(tmp: Path) -> dict[str, bytes]:
    """Every way a .npy can be hostile or damaged (each must be refused before any allocation)."""
    good = _npy(np.arange(60, dtype=np.uint8).reshape(3, 4, 5))
    header_end = good.index(b"\n") + 1
    cases = {
        "object-array": _npy(np.array([{"a": 1}, None], dtype=object), allow_pickle=True),
        "record-dtype": _npy(np.zeros(3, dtype=[("a", "u1"), ("b", "f4")])),
        "complex-dtype": _npy(np.zeros(3, dtype=np.complex64)),
        "huge-shape": good[:10]
        + good[10:header_end].replace(b"(3, 4, 5)", b"(1099511627776, 4, 5)")
        + good[header_end:],
        "not-npy": b"0",
        "empty": b"",
    }
    rng = random.Random(1)
    for k in range(6):
        cut = rng.randrange(1, len(good))
        cases[f"truncated-{k}"] = good[:cut]
    return cases


def test_hostile_or_damaged_npy_dumps_are_one_clear_error(tmp_path, capsys):
    for name, data in _hostile_npy(tmp_path).items():
        p = tmp_path / "w13.npy"
        p.write_bytes(data)
        with pytest.raises(FimoeError):
            load_dump(p)
        err = _error_line(["diagnose", "deepseek-r1-nvfp4", p], capsys)
        assert str(p) in err, (name, err)
        assert p.read_bytes() == data


def test_truncated_safetensors_dumps_are_one_clear_error(tmp_path, capsys):
    whole = tmp_path / "whole.safetensors"
    save_file({"w13_weight": torch.arange(4096, dtype=torch.int32).reshape(2, 32, 64)}, str(whole))
    raw = whole.read_bytes()
    rng = random.Random(2)
    for cut in sorted({rng.randrange(0, len(raw)) for _ in range(8)} | {0, 7, 8, len(raw) - 1}):
        p = tmp_path / "cut.safetensors"
        p.write_bytes(raw[:cut])
        err = _error_line(["diagnose", "deepseek-r1-nvfp4", p], capsys)
        assert "truncated or corrupt" in err, (cut, err)


def test_a_dump_over_the_memory_limit_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FIMOE_LAB_MAX_MEMORY", "4K")
    for name, write in (
        ("d.safetensors", lambda p: save_file({"w13_weight": torch.arange(2048, dtype=torch.int32)}, str(p))),
        ("w13.npy", lambda p: p.write_bytes(_npy(np.arange(2048, dtype=np.int32)))),
    ):
        p = tmp_path / name
        write(p)
        err = _error_line(["diagnose", "deepseek-r1-nvfp4", p], capsys)
        assert "over the memory limit" in err and "FIMOE_LAB_MAX_MEMORY" in err, err
