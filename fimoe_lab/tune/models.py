"""Bring your own model: a :class:`~fimoe_lab.presets.ModelPreset` from a checkpoint, a config.json or sizes.

The tuner takes any MoE shape; presets are shortcuts. A Hugging Face ``config.json`` is
read with the checkpoint reader's key handling: the size keys of every naming convention
(:data:`fimoe_lab.checkpoints.conventions.CONVENTIONS`: ``intermediate_keys``,
``expert_keys``, ``top_k_keys``), looked up at the top level and under ``text_config``.
A checkpoint directory is opened with :func:`fimoe_lab.checkpoints.open_checkpoint`, so
its convention decides the keys and the activation.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

from ..errors import CheckpointError, FimoeError
from ..presets import ModelPreset
from ..specs import get_activation

__all__ = ["model_from_config", "model_from_checkpoint", "model_from_sizes"]

ACT_KEYS = ("hidden_act", "mlp_hidden_act", "hidden_activation")


def model_from_sizes(
    hidden: int, intermediate: int, experts: int, top_k: int, activation: str = "swiglu", name: str = "custom"
) -> ModelPreset:
    """A model from explicit sizes: ``hidden`` (K of GEMM1), ``intermediate`` (per expert, TP 1), experts, top-k."""
    for what, v in (("hidden", hidden), ("intermediate", intermediate), ("experts", experts), ("top_k", top_k)):
        if not isinstance(v, int) or v < 1:
            raise FimoeError(
                f"{what} must be a positive integer, got {v!r}", fix=f"pass --{what.replace('_', '-')} >= 1"
            )
    if top_k > experts:
        raise FimoeError(f"top_k {top_k} exceeds experts {experts}", fix="top-k is at most the number of experts")
    return ModelPreset(name, hidden, intermediate, experts, top_k, get_activation(activation).name, (), ())


def _lookup(cfg: Mapping, keys: tuple[str, ...]) -> Optional[object]:
    for level in (cfg, cfg.get("text_config") or {}):
        for k in keys:
            if level.get(k) is not None:
                return level[k]
    return None


def _keys(field: str) -> tuple[str, ...]:
    from ..checkpoints.conventions import CONVENTIONS

    out: list[str] = []
    for conv in CONVENTIONS:
        out += [k for k in getattr(conv, field) if k not in out]
    return tuple(out)


def _activation(value: object, where: str) -> str:
    text = str(value).strip().lower()
    for name in (text, "geglu" if text.startswith("gelu") else text):
        try:
            return get_activation(name).name
        except FimoeError:
            continue
    raise FimoeError(f"{where}: activation {value!r} is not in the activation table", fix="pass --act")


def model_from_config(config: str | os.PathLike | Mapping, activation: Optional[str] = None) -> ModelPreset:
    """A model from a Hugging Face config (a path or a dict); ``activation`` overrides the config's.

    ``hidden``: ``moe_latent_size`` when present (LatentMoE experts run on the latent), else
    ``hidden_size``; the other sizes through the conventions' keys (see the module docstring).
    """
    where = str(config) if not isinstance(config, Mapping) else "config"
    if isinstance(config, Mapping):
        cfg = dict(config)
    else:
        try:
            cfg = json.loads(Path(config).read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{where}: cannot read a JSON config ({exc})", fix="pass a config.json") from None
    sizes = {}
    for what, keys in (
        ("hidden", ("moe_latent_size", "hidden_size")),
        ("intermediate", _keys("intermediate_keys")),
        ("experts", _keys("expert_keys")),
        ("top_k", _keys("top_k_keys")),
    ):
        v = _lookup(cfg, keys)
        if v is None:
            raise CheckpointError(f"{where}: no {what} ({' or '.join(keys)})", fix=f"pass --{what.replace('_', '-')}")
        sizes[what] = int(v)  # type: ignore[call-overload]
    act = activation or _activation(_lookup(cfg, ACT_KEYS) or "silu", where)
    name = str(cfg.get("model_type") or Path(where).parent.name or "custom")
    return model_from_sizes(sizes["hidden"], sizes["intermediate"], sizes["experts"], sizes["top_k"], act, name)


def model_from_checkpoint(path: str | os.PathLike, activation: Optional[str] = None) -> ModelPreset:
    """A model from a checkpoint directory: its reader's sizes and its convention's activation."""
    from ..checkpoints import open_checkpoint

    ck = open_checkpoint(path)
    try:
        act = activation or ck.convention.activation
        return model_from_sizes(ck.hidden, ck.intermediate, ck.num_experts, ck.top_k, act, Path(path).name)
    finally:
        ck.close()
