"""Bring your own model: a :class:`~fimoe_lab.presets.ModelPreset` from a checkpoint, a config.json or sizes.

The tuner takes any MoE shape; presets are shortcuts. A Hugging Face ``config.json`` is
read with the checkpoint reader's key handling: the one alias table
:data:`fimoe_lab.checkpoints.conventions.CONFIG_KEYS` (:func:`~fimoe_lab.checkpoints.conventions.config_value`:
top level, nested ``a.b`` keys, ``text_config``; a per-layer list must hold one size).
A checkpoint directory is opened with :func:`fimoe_lab.checkpoints.open_checkpoint`, so
its convention decides the keys and the activation.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Optional

from ..errors import CheckpointError, FimoeError
from ..presets import ModelPreset
from ..specs import get_activation
from ..untrusted import parse_json

__all__ = ["model_from_config", "model_from_checkpoint", "model_from_sizes", "whole_block_shards"]

ACT_KEYS = ("hidden_act", "mlp_hidden_act", "hidden_activation")
WHOLE_BLOCK_SHARD_FORMATS = ("mxfp4",)
"""Checkpoint formats whose conventions store fused expert tensors as scale blocks
(``Convention.fused_layout.blocks``: gpt-oss's MXFP4, every MXFP4 convention), which the
reader shards by whole blocks (``tests/test_tune_shapes.py`` checks this against
``checkpoints.conventions.CONVENTIONS``)."""


def whole_block_shards(model: ModelPreset, fmt: str) -> bool:
    """True when ``model``'s checkpoint in weight format ``fmt`` is sharded by whole blocks.

    That is, ``fmt`` is one of the model's ``checkpoint_formats`` and its conventions store
    fused blocks (:data:`WHOLE_BLOCK_SHARD_FORMATS`), as for gpt-oss MXFP4 at any
    TP; other checkpoints shard equally (:func:`fimoe_lab.shapes.rank_intermediates`).
    """
    return fmt in model.checkpoint_formats and fmt in WHOLE_BLOCK_SHARD_FORMATS


def model_from_sizes(
    hidden: int,
    intermediate: int,
    experts: int,
    top_k: int,
    activation: str = "swiglu",
    name: str = "custom",
    checkpoint_formats: tuple[str, ...] = (),
) -> ModelPreset:
    """A model from explicit sizes: ``hidden`` (K of GEMM1), ``intermediate`` (per expert, TP 1), experts, top-k.

    ``checkpoint_formats``: the weight formats its checkpoints hold (they decide how TP shards it).
    """
    for what, v in (("hidden", hidden), ("intermediate", intermediate), ("experts", experts), ("top_k", top_k)):
        if not isinstance(v, int) or v < 1:
            raise FimoeError(
                f"{what} must be a positive integer, got {v!r}", fix=f"pass --{what.replace('_', '-')} >= 1"
            )
    if top_k > experts:
        raise FimoeError(f"top_k {top_k} exceeds experts {experts}", fix="top-k is at most the number of experts")
    return ModelPreset(
        name, hidden, intermediate, experts, top_k, get_activation(activation).name, checkpoint_formats, ()
    )


def _lookup(cfg: Mapping, keys: tuple[str, ...]) -> Optional[object]:
    for level in (cfg, cfg.get("text_config") or {}):
        for k in keys:
            if level.get(k) is not None:
                return level[k]
    return None


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
            raw = Path(config).read_bytes()
        except OSError as exc:
            raise CheckpointError(f"{where}: cannot read a JSON config ({exc})", fix="pass a config.json") from None
        cfg = parse_json(raw, where, "pass a config.json", CheckpointError)
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{where} is not a JSON object", fix="pass a model's config.json")
    from ..checkpoints.conventions import CONFIG_KEYS, config_quant_method, config_value

    sizes = {}
    for what in ("hidden", "intermediate", "experts", "top_k"):
        key, v = (
            ("moe_latent_size", cfg["moe_latent_size"])
            if what == "hidden" and cfg.get("moe_latent_size")
            else config_value(cfg, what)
        )
        flag = f"--{what.replace('_', '-')}"
        if v is None:
            raise CheckpointError(f"{where}: no {what} ({' or '.join(CONFIG_KEYS[what])})", fix=f"pass {flag}")
        if isinstance(v, list):  # per layer (Hunyuan-A13B): one shape to tune, or the user picks
            if len(set(v)) != 1:
                raise CheckpointError(
                    f"{where}: {key} differs per layer ({sorted(set(v))})", fix=f"pass {flag} with the layer's size"
                )
            v = v[0]
        sizes[what] = int(v)
    act = activation or _activation(_lookup(cfg, ACT_KEYS) or "silu", where)
    name = str(cfg.get("model_type") or Path(where).parent.name or "custom")
    quant = config_quant_method(cfg)
    held = (quant,) if quant in WHOLE_BLOCK_SHARD_FORMATS else ()
    model = model_from_sizes(sizes["hidden"], sizes["intermediate"], sizes["experts"], sizes["top_k"], act, name, held)
    return replace(model, quant_method=quant)


def model_from_checkpoint(path: str | os.PathLike, activation: Optional[str] = None) -> ModelPreset:
    """A model from a checkpoint directory: its reader's sizes and its convention's activation."""
    from ..checkpoints import open_checkpoint

    ck = open_checkpoint(path)
    try:
        act = activation or ck.convention.activation
        model = model_from_sizes(ck.hidden, ck.intermediate, ck.num_experts, ck.top_k, act, Path(path).name, (ck.fmt,))
        return replace(model, quant_method=ck.convention.quant_method)
    finally:
        ck.close()
