"""What a convert was asked to do, recorded in its output, so that ``--resume`` continues only that request.

A request (:func:`convert_request`) holds the source by content and every choice that shapes the
output: backend, engine profile, TP size, EP size, the rank set (one rank or ``all``), the layers,
alignments, per-token activations, the MXFP4 activation dtype, one file or shards, the shard size.
The source is identified by what its files hold, never by paths or times: the canonical JSON of
``config.json`` and, per shard file of the checkpoint, its size and the sha256 of its safetensors
header bytes (``8 + n`` bytes: the length word and the JSON header, at most
:data:`~fimoe_lab.checkpoints.safe_io.MAX_JSON_BYTES`), so a copied or re-downloaded checkpoint is
the same source and an edited one is not.

Every file convert writes records its request under the metadata key :data:`REQUEST_KEY` (the
canonical JSON of :func:`convert_request`). :func:`check_resume` runs before anything is written:
each safetensors file already in OUT (OUT itself, its shards, those of its ``rank-<r>``
directories) must record the same request, else the run is refused naming what differs, so
``--resume`` never deletes or replaces what another request wrote.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any, Optional

from fimoe_lab import untrusted
from fimoe_lab.checkpoints import safe_io
from fimoe_lab.choice import LayoutChoice
from fimoe_lab.errors import CheckpointError

__all__ = ["REQUEST_KEY", "convert_request", "request_metadata", "check_resume", "differences"]

REQUEST_KEY = "fimoe_lab_request"
"""Metadata key of every file convert writes: the canonical JSON of its request."""


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def header_identity(path: Path) -> dict[str, Any]:
    """``{"bytes": file size, "header_sha256": sha256 of the length word and the JSON header}`` of a
    safetensors file (``{"missing": true}`` if there is none; one CheckpointError if it is not one)."""
    if not os.path.lexists(path):
        return {"missing": True}
    st = safe_io.regular_file(path, "checkpoint shard")
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        body = f.read(n) if 0 <= n <= safe_io.MAX_JSON_BYTES else b""
    if n < 0 or n > safe_io.MAX_JSON_BYTES or len(body) != n:
        raise CheckpointError(
            f"{path} is not a readable safetensors file (its header is truncated or too large)",
            fix="it is truncated or corrupt: copy or download it again",
        )
    return {"bytes": st.st_size, "header_sha256": hashlib.sha256(head + body).hexdigest()}


def source_identity(root: Path, config: dict, files: list[str]) -> dict[str, Any]:
    """The source by content: the sha256 of ``config.json``'s canonical JSON and :func:`header_identity`
    of each shard file (by its name relative to the checkpoint directory)."""
    return {
        "config_sha256": hashlib.sha256(_canonical(config).encode()).hexdigest(),
        "files": {f: header_identity(root / f) for f in sorted(set(files))},
    }


def convert_request(
    root: Path,
    config: dict,
    files: list[str],
    choice: LayoutChoice,
    *,
    tp_size: int,
    ep_size: int,
    tp_rank: int | str,
    layers: list[int],
    single: bool,
    shard_size: Optional[int],
) -> dict[str, Any]:
    """The request of one convert (module docstring); equal requests write equal outputs. ``choice``: the
    layout choice, its fields recorded (``per_token_activation`` as ``per_token``), the engine resolved
    to its profile name (None: the default profile) and ``values``: ``engine`` where one was named (its value
    rules apply), ``lossless`` for the default."""
    from fimoe_lab import engines

    return {
        "backend": choice.backend,
        "intermediate_alignment": choice.intermediate_alignment,
        "hidden_alignment": choice.hidden_alignment,
        "engine": engines.get_engine(choice.engine or engines.DEFAULT_ENGINE).name,
        "values": choice.value_form,  # recipes.plan_layer's values: a named engine's rules
        "per_token": bool(choice.per_token_activation),
        "activation_dtype": choice.activation_dtype,
        "source": source_identity(root, config, files),
        "tp_size": tp_size,
        "ep_size": ep_size,
        "tp_rank": tp_rank,
        "layers": sorted(layers),
        "single_file": single,
        "shard_size": None if single else shard_size,
    }


def request_metadata(metadata: dict[str, str], request: Optional[dict]) -> dict[str, str]:
    """``metadata`` with the request under :data:`REQUEST_KEY` (unchanged without one)."""
    return metadata if request is None else {**metadata, REQUEST_KEY: _canonical(request)}


_NAMES = {
    "tp_size": "--tp",
    "ep_size": "--ep",
    "tp_rank": "--rank",
    "layers": "--layer",
    "intermediate_alignment": "--intermediate-alignment",
    "hidden_alignment": "--hidden-alignment",
    "per_token": "--per-token",
    "activation_dtype": "--mxfp4-activation",
    "single_file": "--single-file",
    "shard_size": "--shard-size",
    "backend": "--backend",
    "engine": "--engine",
    "values": "--engine (named: the engine's value rules; left out: lossless)",
}
"""The command-line option behind each field of a request (what an error names)."""


def differences(recorded: dict, asked: dict) -> list[str]:
    """What differs between two requests, one phrase per field (source files by name)."""
    out = []
    old_src, new_src = recorded.get("source") or {}, asked.get("source") or {}
    if old_src.get("config_sha256") != new_src.get("config_sha256"):
        out.append("the source's config.json")
    old_files, new_files = old_src.get("files") or {}, new_src.get("files") or {}
    changed = sorted(f for f in set(old_files) | set(new_files) if old_files.get(f) != new_files.get(f))
    if changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        out.append(f"the source files {', '.join(map(str, changed[:3]))}{more}")
    for key in sorted(set(recorded) | set(asked)):
        if key != "source" and recorded.get(key) != asked.get(key):
            out.append(f"{_NAMES.get(key, key)} ({recorded.get(key)!r} recorded, {asked.get(key)!r} asked)")
    return out


def _written_files(out: Path) -> list[Path]:
    """The safetensors files convert may have written at ``out``: itself, its shards, its ranks' shards."""
    if not os.path.lexists(out):
        return []
    if not os.path.isdir(out) or os.path.islink(out):
        return [out]
    found = []
    for name in sorted(os.listdir(out)):
        p = out / name
        if safe_io.SHARD_RE.match(name) and os.path.isfile(p):
            found.append(p)
        elif safe_io.RANK_RE.match(name) and os.path.isdir(p) and not os.path.islink(p):
            found += [p / n for n in sorted(os.listdir(p)) if safe_io.SHARD_RE.match(n) and os.path.isfile(p / n)]
    return found


def check_resume(out: Path, request: dict) -> None:
    """Refuse to resume ``out`` unless every file convert wrote there records ``request`` (the module
    docstring); an output without such files (new, empty, or only temporaries) is resumed as new."""
    for path in _written_files(out):
        raw = (safe_io.safetensors_metadata(path) or {}).get(REQUEST_KEY)
        try:
            recorded = untrusted.parse_json(raw, str(path), "") if isinstance(raw, str) else None
        except ValueError:  # FimoeError is one
            recorded = None
        if not isinstance(recorded, dict):
            raise CheckpointError(
                f"{out}: {path.name} records no convert request, so --resume cannot tell that it belongs to this one",
                fix="pass --force instead of --resume to rewrite it, or write to another output",
            )
        diff = differences(recorded, request)
        if diff:
            raise CheckpointError(
                f"{out} holds another convert (in {path.relative_to(out) if path != out else path.name}): "
                f"it differs in {'; '.join(diff)}",
                fix="repeat the original command to resume it, pass --force to replace it, or write to another output",
            )
