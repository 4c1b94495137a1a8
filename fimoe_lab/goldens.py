"""Replay reference cases recorded from FlashInfer on a real GPU against our functions.

A golden set is two files, no pickle: ``NAME.json``, a list of cases, and
``NAME.safetensors``, their tensors (every tensor in the JSON is ``{"tensor": KEY}``
naming an entry of it; tuples are lists). A case has ``name``, ``fn`` (the reference
function; ``prep`` = ``prepare_fp8_moe_layer_for_fi`` on a layer built from
``lay_args = (is_act_and_mul, intermediate, hidden, weight_block_size, is_gated)``),
``inputs`` (tensors as ``{"dtype", "u8"}`` byte views or ``{"dtype", "t"}``), ``outputs``
and ``error`` (the reference's exception, when it raised). Outputs are compared byte for
byte. A case the reference crashed on must succeed here. Pickled ``.pt`` golden files are
refused: unpickling runs code from the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import torch

from fimoe_lab import env, prepare, resources, untrusted
from fimoe_lab.errors import FimoeError

__all__ = ["GoldenResult", "default_golden_paths", "load_cases", "run_case"]


def default_golden_paths() -> list[Path]:
    """Golden sets (their ``.json``): ``$FIMOE_GOLDENS`` (file or folder), else ``shared/goldens`` beside a
    source checkout when there is one, plus the sets shipped with the package (``data/goldens``: recorded
    with FlashInfer's kernels on an H200, present in the wheel too).

    In a folder, every ``*.json`` with a ``.safetensors`` of the same name beside it.
    """
    chosen = env.value("FIMOE_GOLDENS", None)
    if chosen is not None:
        return _golden_files(chosen)
    checkout = resources.package_root().parent
    shared = _golden_files(checkout.parent / "shared" / "goldens") or _golden_files(checkout / "shared" / "goldens")
    return shared + _golden_files(resources.goldens_dir())


def _golden_files(root: Path) -> list[Path]:
    """``root`` itself (a file), or its ``*.json`` that have a ``.safetensors`` beside them (a folder)."""
    if root.is_file():
        return [root]
    if root.is_dir():
        return [p for p in sorted(root.glob("*.json")) if p.with_suffix(".safetensors").is_file()]
    return []


def _resolve(value: Any, tensors: Any) -> Any:
    """``value`` with every ``{"tensor": KEY}`` replaced by that safetensors entry."""
    if isinstance(value, dict):
        if set(value) == {"tensor"}:
            return tensors.get_tensor(value["tensor"])
        return {k: _resolve(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, tensors) for v in value]
    return value


def load_cases(path: Path | str) -> list[dict]:
    """The cases of one golden set, given its ``.json`` (or its ``.safetensors``), tensors loaded."""
    path = Path(path)
    if path.suffix not in (".json", ".safetensors"):
        raise FimoeError(
            f"{path}: golden files are read as JSON + safetensors, not {path.suffix or 'this file'} "
            f"(a pickle would run code from the file)",
            fix=f"pass {path.with_suffix('.json')} with {path.with_suffix('.safetensors').name} beside it",
        )
    data, blobs = path.with_suffix(".json"), path.with_suffix(".safetensors")
    for p in (data, blobs):
        if not p.is_file():
            raise FimoeError(
                f"{p} does not exist; a golden set is NAME.json + NAME.safetensors",
                fix="put both files of the set in one folder",
            )
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(blobs), framework="pt") as tensors:
            cases = untrusted.parse_json(data.read_bytes(), str(data), "copy the golden set again")
            _check_cases(data, cases)
            return _resolve(cases, tensors)
    except (SafetensorError, ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        if isinstance(exc, FimoeError):
            raise
        raise FimoeError(
            f"{path}: not a readable golden set ({type(exc).__name__}: {' '.join(str(exc).split())[:300]})",
            fix="copy the golden set again (NAME.json + NAME.safetensors, recorded from FlashInfer on a GPU)",
        ) from None


def _is_case(case: Any) -> bool:
    """A golden case: an object with a string ``name`` and ``fn``, an object of ``inputs``, and a list of
    ``outputs`` (or the reference's ``error``)."""
    return (
        isinstance(case, dict)
        and isinstance(case.get("name"), str)
        and isinstance(case.get("fn"), str)
        and isinstance(case.get("inputs"), dict)
        and (isinstance(case.get("outputs"), list) or isinstance(case.get("error"), str))
    )


def _check_cases(data: Path, cases: Any) -> None:
    """Refuse a golden set's JSON that is not a list of cases (:func:`_is_case`), naming the first bad one."""
    bad = "it is not a list" if not isinstance(cases, list) else None
    if bad is None:
        first = next((i for i, c in enumerate(cases) if not _is_case(c)), None)
        bad = None if first is None else f"case {first} is not an object with name, fn, inputs and outputs"
    if bad is not None:
        raise FimoeError(
            f"{data}: not a golden set ({bad})",
            fix="copy the golden set again (NAME.json + NAME.safetensors, recorded from FlashInfer on a GPU)",
        )


def decode(value: Any) -> Any:
    """A stored value as a live object (tensors rebuilt with their dtype)."""
    if isinstance(value, dict) and "dtype" in value and ("u8" in value or "t" in value):
        dtype = getattr(torch, value["dtype"].replace("torch.", ""))
        if "u8" in value:
            return value["u8"].clone().view(dtype)
        t = value["t"]
        return t.clone() if isinstance(t, torch.Tensor) else t
    return value


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).reshape(-1)


def _layer(lay_args) -> SimpleNamespace:
    is_act_and_mul, intermediate, hidden, block, is_gated = lay_args
    config = SimpleNamespace(
        is_act_and_mul=is_act_and_mul, intermediate_size_per_partition=intermediate, hidden_dim=hidden
    )
    return SimpleNamespace(moe_config=config, weight_block_size=block, activation=SimpleNamespace(is_gated=is_gated))


def call(case: dict, device: str = "cpu") -> tuple:
    """Run our implementation of ``case['fn']`` on the case's inputs (moved to ``device``); return its outputs."""
    args = {k: decode(v) for k, v in case["inputs"].items()}
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    fn = case["fn"]
    if fn == "prep":
        layer = _layer(args.pop("lay_args"))
        args.setdefault("w13_input_scale", None)
        args.setdefault("w2_input_scale", None)
        out = prepare.prepare_fp8_moe_layer_for_fi(layer, **args)
        sizes = torch.tensor([layer.moe_config.intermediate_size_per_partition, layer.moe_config.hidden_dim])
        return tuple(out) + (sizes,)
    if fn == "convert_moe_weights_to_flashinfer_trtllm_block_layout":
        return tuple(prepare.convert_moe_weights_to_flashinfer_trtllm_block_layout({}, **args))
    if fn == "rotate_weights_for_fi_trtllm_fp8_per_tensor_moe":
        prepare.rotate_weights_for_fi_trtllm_fp8_per_tensor_moe(**args)
        return args["gemm1_weights"], args["gemm2_weights"]
    out = getattr(prepare, fn)(**args)
    return tuple(out) if isinstance(out, tuple) else (out,)


@dataclass
class GoldenResult:
    name: str
    ok: bool
    detail: str


def _same(ours: Any, ref: Any) -> Optional[str]:
    ref = decode(ref)
    if isinstance(ref, torch.Tensor):
        if not isinstance(ours, torch.Tensor):
            return f"expected a tensor, got {type(ours).__name__}"
        if ours.dtype != ref.dtype or tuple(ours.shape) != tuple(ref.shape):
            return f"expected {ref.dtype}{tuple(ref.shape)}, got {ours.dtype}{tuple(ours.shape)}"
        a, b = _as_bytes(ours.cpu()), _as_bytes(ref)
        bad = int((a != b).sum())
        return f"{bad} of {b.numel()} bytes differ" if bad else None
    return None if ours == ref else f"expected {ref!r}, got {ours!r}"


def run_case(case: dict, device: str = "cpu") -> GoldenResult:
    """Our outputs vs the recorded ones; for a case the reference crashed on, ours must run."""
    name = case["name"]
    try:
        ours = call(case, device)
    except Exception as exc:  # reported, not raised: the caller prints a table of cases
        return GoldenResult(name, False, f"raised {type(exc).__name__}: {exc}")
    if case.get("error"):
        return GoldenResult(name, True, f"reference raised ({case['error'][:60]}...); ours ran")
    refs = case["outputs"]
    if len(ours) != len(refs):
        return GoldenResult(name, False, f"{len(ours)} outputs, reference has {len(refs)}")
    for i, (o, r) in enumerate(zip(ours, refs)):
        problem = _same(o, r)
        if problem:
            return GoldenResult(name, False, f"output {i}: {problem}")
    return GoldenResult(name, True, "byte-exact")
