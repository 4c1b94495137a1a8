"""Write small synthetic checkpoints of every MoE checkpoint family the reader supports.

Each family reproduces a released model's expert tensor names, dtypes, layouts
(per-expert, fused, transposed, flattened, interleaved, int32-packed) and ``config.json``
keys (see ``fimoe_lab/checkpoints/conventions.py`` for the sources), at tiny sizes: 2 MoE
layers (plus an MTP layer where the model has one), 4 experts. Deterministic (seeded
per family, layer and tensor). Values are random with coordinates written into them, so
that a swapped gate/up, a wrong expert or a transposed matrix changes bytes: column 0 of
every gate row is ``1 + e``, of every up row ``-(1 + e)``, of every down row ``0.5 + e``
(BF16/FP8), or byte 0 of every row is ``16 e + 4 p`` (packed 4-bit, ``p`` 0 gate, 1 up, 2
down); column 1 carries the row index.

This file names every tensor itself (it does not use the reader's convention table), so
tests can check the reader and ``restore`` against it: :func:`truth` is the stacked layer
(``gate``, ``up``, ``down`` per expert, scales, extras) and :func:`file_tensors` what a
checkpoint (or one TP rank of it, as ``restore`` writes it) holds.

Run: ``python scripts/make_family_samples.py OUT_DIR [FAMILY ...]``.
"""

from __future__ import annotations

import json
import sys
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import save_file

E = 4
"""Experts per layer in every family."""


@dataclass(frozen=True)
class Family:
    """One released model family at tiny size.

    ``kind``: how a projection is stored (``bf16``, ``fp8-block``, ``fp8-block-bf16``,
    ``fp8-channel``, ``fp8-tensor``, ``nvfp4-modelopt``, ``nvfp4-ct``, ``int4``, ``mxfp4``);
    ``layout``: ``per-expert``, ``stacked`` (Granite), ``transposed`` (Llama-4, Qwen3-VL),
    ``flat`` (DBRX), ``gpt-oss``; ``module``: path from a layer to the experts; ``names``:
    gate, up, down names (gate None: non-gated); ``layers``: the MoE layers' paths;
    ``intermediate``: one size, or one per layer path; ``file_dtypes``: the dtypes a writer chose for this
    run where it has a choice (``scale``, ``scalars``: compressed-tensors stores FP8 scales and static input
    scales in the quantized model's dtype; ``shape``: its ``weight_shape``, int64 from
    ``torch.tensor(weight.shape)``), default float32 / int32.
    """

    convention: str
    kind: str
    layout: str
    module: str
    names: tuple[Optional[str], ...]
    layers: tuple[str, ...]
    hidden: int
    intermediate: Any
    config: dict
    extra_files: dict = field(default_factory=dict)
    file_dtypes: dict = field(default_factory=dict)


_QWEN3 = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_act": "silu",
    "decoder_sparse_step": 1,
}
_DS = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_act": "silu",
    "n_shared_experts": 1,
}
_GUD = ("gate_proj", "up_proj", "down_proj")
_ML = ("model.layers.0", "model.layers.1")


def _qwen3(h: int, i: int, **extra: Any) -> dict:
    return {
        **_QWEN3,
        "hidden_size": h,
        "intermediate_size": 3 * i,
        "moe_intermediate_size": i,
        "num_experts": E,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 2,
        **extra,
    }


def _ct(weights: dict) -> dict:
    return {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
            "ignore": ["lm_head", "re:.*mlp.gate$"],
        }
    }


FAMILIES: dict[str, Family] = {
    "ct-fp8-block": Family(
        "ct-fp8-block",
        "fp8-block",
        "per-expert",
        "mlp.experts",
        _GUD,
        _ML,
        128,
        256,
        {
            **_qwen3(128, 256),
            **_ct({"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}),
        },
    ),
    "ct-nvfp4": Family(
        "ct-nvfp4",
        "nvfp4-ct",
        "per-expert",
        "mlp.experts",
        _GUD,
        _ML,
        128,
        128,
        {**_qwen3(128, 128), **_ct({"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16})},
    ),
    "kimi-k2-thinking-int4": Family(
        "ct-int4",
        "int4",
        "per-expert",
        "mlp.experts",
        _GUD,
        ("model.layers.1", "model.layers.2"),
        256,  # TRT-LLM MxInt4 needs H and each rank's I multiples of 256 (vLLM pads nothing): TP 1 and 2
        512,
        {
            **_DS,
            "model_type": "kimi_k2",
            "hidden_size": 256,
            "intermediate_size": 1536,
            "moe_intermediate_size": 512,
            "n_routed_experts": E,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 3,
            "first_k_dense_replace": 1,
            **_ct({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}),
        },
    ),
    "ct-fp8-tensor": Family(
        "ct-fp8-tensor",
        "fp8-tensor",
        "per-expert",
        "mlp.experts",
        _GUD,
        _ML,
        32,
        64,
        {**_qwen3(32, 64), **_ct({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False})},
    ),
    "modelopt-fp8": Family(
        "modelopt-fp8",
        "fp8-tensor",
        "per-expert",
        "mlp.experts",
        _GUD,
        _ML,
        32,
        64,
        _qwen3(32, 64),
        {"hf_quant_config.json": {"quantization": {"quant_algo": "FP8"}}},
    ),
    "modelopt-nvfp4-deepseek": Family(
        "modelopt-nvfp4",
        "nvfp4-modelopt",
        "per-expert",
        "mlp.experts",
        _GUD,
        _ML,
        128,
        128,
        {
            **_DS,
            "hidden_size": 128,
            "intermediate_size": 256,
            "moe_intermediate_size": 128,
            "n_routed_experts": E,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 2,
            "first_k_dense_replace": 0,
        },
        {"hf_quant_config.json": {"quantization": {"quant_algo": "NVFP4", "group_size": 16}}},
    ),
    "modelopt-nvfp4-qwen3": Family(
        "modelopt-nvfp4",
        "nvfp4-modelopt",
        "per-expert",
        "mlp.experts",
        _GUD,
        _ML,
        64,
        128,
        _qwen3(64, 128),
        {"hf_quant_config.json": {"quantization": {"quant_algo": "NVFP4", "group_size": 16}}},
    ),
    "qwen3-fp8": Family(
        "qwen3-fp8",
        "fp8-block-bf16",
        "per-expert",
        "mlp.experts",
        _GUD,
        _ML,
        128,
        256,
        {
            **_qwen3(128, 256),
            "quantization_config": {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": [128, 128],
            },
        },
    ),
    "glm-4.5-fp8": Family(
        "ct-fp8-channel",
        "fp8-channel",
        "per-expert",
        "mlp.experts",
        _GUD,
        ("model.layers.1", "model.layers.2"),
        32,
        64,
        {
            "architectures": ["Glm4MoeForCausalLM"],
            "model_type": "glm4_moe",
            "hidden_size": 32,
            "intermediate_size": 96,
            "moe_intermediate_size": 64,
            "n_routed_experts": E,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 2,
            "first_k_dense_replace": 1,
            "num_nextn_predict_layers": 1,
            **_ct({"num_bits": 8, "type": "float", "strategy": "channel"}),
        },
    ),
    "minimax-m2": Family(
        "minimax-fp8",
        "fp8-block",
        "per-expert",
        "block_sparse_moe.experts",
        ("w1", "w3", "w2"),
        _ML,
        128,
        256,
        {
            "architectures": ["MiniMaxM2ForCausalLM"],
            "model_type": "minimax_m2",
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_local_experts": E,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 2,
            "quantization_config": {"quant_method": "fp8", "fmt": "float8_e4m3fn", "weight_block_size": [128, 128]},
        },
    ),
    "granite-moe": Family(
        "granite-bf16",
        "bf16",
        "stacked",
        "block_sparse_moe",
        ("input_linear", None, "output_linear"),
        _ML,
        32,
        48,
        {
            "architectures": ["GraniteMoeForCausalLM"],
            "model_type": "granitemoe",
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_local_experts": E,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 2,
        },
    ),
    "llama-4": Family(
        "llama4-bf16",
        "bf16",
        "transposed",
        "feed_forward.experts",
        ("gate_up_proj", None, "down_proj"),
        ("language_model.model.layers.0", "language_model.model.layers.1"),
        32,
        48,
        {
            "architectures": ["Llama4ForConditionalGeneration"],
            "model_type": "llama4",
            "text_config": {
                "model_type": "llama4_text",
                "hidden_size": 32,
                "intermediate_size": 48,
                "intermediate_size_mlp": 96,
                "num_local_experts": E,
                "num_experts_per_tok": 1,
                "num_hidden_layers": 2,
                "interleave_moe_layer_step": 1,
            },
        },
    ),
    "qwen3-vl-moe": Family(
        "qwen3-vl-bf16",
        "bf16",
        "transposed",
        "mlp.experts",
        ("gate_up_proj", None, "down_proj"),
        ("model.language_model.layers.0", "model.language_model.layers.1"),
        32,
        48,
        {
            "architectures": ["Qwen3VLMoeForConditionalGeneration"],
            "model_type": "qwen3_vl_moe",
            "text_config": {
                "model_type": "qwen3_vl_moe_text",
                "hidden_size": 32,
                "moe_intermediate_size": 48,
                "intermediate_size": 96,
                "num_experts": E,
                "num_experts_per_tok": 2,
                "num_hidden_layers": 2,
            },
        },
    ),
    "dbrx": Family(
        "dbrx-bf16",
        "bf16",
        "flat",
        "ffn.experts.mlp",
        ("w1", "v1", "w2"),
        ("transformer.blocks.0", "transformer.blocks.1"),
        32,
        48,
        {
            "architectures": ["DbrxForCausalLM"],
            "model_type": "dbrx",
            "d_model": 32,
            "n_layers": 2,
            "ffn_config": {"ffn_hidden_size": 48, "moe_num_experts": E, "moe_top_k": 2},
        },
    ),
    "nemotron-3": Family(
        "nemotron-h-bf16",
        "bf16",
        "per-expert",
        "mixer.experts",
        (None, "up_proj", "down_proj"),
        ("backbone.layers.1", "backbone.layers.3"),
        32,
        48,
        {
            "architectures": ["NemotronHForCausalLM"],
            "model_type": "nemotron_h",
            "hidden_size": 32,
            "intermediate_size": 96,
            "moe_intermediate_size": 48,
            "n_routed_experts": E,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 4,
            "hybrid_override_pattern": "MEME",
            "mlp_hidden_act": "relu2",
        },
    ),
    "ernie-4.5": Family(
        "qwen3-moe-bf16",
        "bf16",
        "per-expert",
        "mlp.experts",
        _GUD,
        ("model.layers.1", "model.layers.2"),
        32,
        48,
        {
            "architectures": ["Ernie4_5_MoeForCausalLM"],
            "model_type": "ernie4_5_moe",
            "hidden_size": 32,
            "intermediate_size": 96,
            "moe_intermediate_size": 48,
            "moe_num_experts": E,
            "moe_k": 2,
            "moe_layer_start_index": 1,
            "num_hidden_layers": 3,
        },
    ),
    "olmoe": Family(
        "qwen3-moe-bf16",
        "bf16",
        "per-expert",
        "mlp.experts",
        _GUD,
        _ML,
        32,
        48,
        {
            "architectures": ["OlmoeForCausalLM"],
            "model_type": "olmoe",
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_experts": E,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 2,
        },
    ),
    "hunyuan-a13b": Family(
        "qwen3-moe-bf16",
        "bf16",
        "per-expert",
        "mlp.experts",
        _GUD,
        _ML,
        32,
        (48, 64),
        {
            "architectures": ["HunYuanMoEV1ForCausalLM"],
            "model_type": "hunyuan_v1_moe",
            "hidden_size": 32,
            "intermediate_size": 96,
            "moe_intermediate_size": [48, 64],
            "num_experts": E,
            "moe_topk": [2, 2],
            "num_shared_expert": [1, 1],
            "num_hidden_layers": 2,
        },
    ),
    "gpt-oss-original": Family(
        "gpt-oss-original",
        "mxfp4",
        "gpt-oss",
        "mlp",
        ("mlp1_weight", None, "mlp2_weight"),
        ("block.0", "block.1"),
        64,
        128,
        {
            "num_hidden_layers": 2,
            "num_experts": E,
            "experts_per_token": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "swiglu_limit": 7.0,
            "vocab_size": 1024,
        },
    ),
    "qwen3-next-mtp": Family(
        "qwen3-moe-bf16",
        "bf16",
        "per-expert",
        "mlp.experts",
        _GUD,
        (*_ML, "mtp.layers.0"),
        32,
        48,
        {
            "architectures": ["Qwen3NextForCausalLM"],
            "model_type": "qwen3_next",
            "hidden_size": 32,
            "intermediate_size": 96,
            "moe_intermediate_size": 48,
            "num_experts": E,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 2,
            "mtp_num_hidden_layers": 1,
        },
    ),
    "deepseek-v3-mtp": Family(
        "deepseek-fp8",
        "fp8-block",
        "per-expert",
        "mlp.experts",
        _GUD,
        ("model.layers.1", "model.layers.2"),
        128,
        256,
        {
            **_DS,
            "hidden_size": 128,
            "intermediate_size": 384,
            "moe_intermediate_size": 256,
            "n_routed_experts": E,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 2,
            "first_k_dense_replace": 1,
            "num_nextn_predict_layers": 1,
            "quantization_config": {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": [128, 128],
            },
        },
    ),
}

MTP = {"glm-4.5-fp8": "model.layers.2", "qwen3-next-mtp": "mtp.layers.0", "deepseek-v3-mtp": "model.layers.2"}
"""Families whose last MoE layer is an MTP (next-token-prediction) layer: its path."""

PACKED = {"nvfp4-modelopt": 16, "nvfp4-ct": 16, "int4": 32, "mxfp4": 32}
"""Packed 4-bit kinds (two values per byte) and their values per scale."""


WRITER_DTYPES = {  # the same families as a writer run on a model of another dtype writes them
    "ct-fp8-block-bf16": ("ct-fp8-block", {"scale": torch.bfloat16}),
    "ct-fp8-block-f16": ("ct-fp8-block", {"scale": torch.float16}),
    "ct-fp8-tensor-bf16": ("ct-fp8-tensor", {"scale": torch.bfloat16, "scalars": torch.bfloat16}),
    "glm-4.5-fp8-bf16": ("glm-4.5-fp8", {"scale": torch.bfloat16}),
    "kimi-k2-thinking-int4-i64": ("kimi-k2-thinking-int4", {"shape": torch.int64}),
}
FAMILIES.update({name: replace(FAMILIES[base], file_dtypes=d) for name, (base, d) in WRITER_DTYPES.items()})
MTP.update({name: MTP[base] for name, (base, _) in WRITER_DTYPES.items() if base in MTP})


def scalar_shape(fam: Family) -> tuple[int, ...]:
    """Stored shape of per-projection scalars: compressed-tensors ``(1,)``, ModelOpt ``()``."""
    return (1,) if fam.config.get("quantization_config", {}).get("quant_method") == "compressed-tensors" else ()


def intermediate(fam: Family, base: str) -> int:
    if isinstance(fam.intermediate, int):
        return fam.intermediate
    return fam.intermediate[fam.layers.index(base)]


def _gen(family: str, base: str, what: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"{family}/{base}/{what}".encode()))


def _coded(g: torch.Generator, rows: int, cols: int, code: float, dtype: torch.dtype) -> torch.Tensor:
    """(E, rows, cols) random values; column 0 ``code (+ e)`` (sign and expert), column 1 the row index / 256."""
    x = torch.randn(E, rows, cols, generator=g) * 0.05
    x[:, :, 0] = torch.arange(E, dtype=torch.float32)[:, None] * (1 if code > 0 else -1) + code
    x[:, :, 1] = torch.arange(rows, dtype=torch.float32)[None, :] / 256
    return x.to(dtype)


def _coded_bytes(g: torch.Generator, rows: int, cols_bytes: int, proj: int) -> torch.Tensor:
    x = torch.randint(0, 256, (E, rows, cols_bytes), generator=g, dtype=torch.uint8)
    x[:, :, 0] = (16 * torch.arange(E)[:, None] + 4 * proj).to(torch.uint8)
    return x


def _positive(g: torch.Generator, shape: tuple[int, ...], lo: float, hi: float) -> torch.Tensor:
    return torch.rand(shape, generator=g) * (hi - lo) + lo


def truth(family: str, base: str) -> dict[str, torch.Tensor]:
    """The layer ``base`` of ``family`` as the generator made it, per projection, logical orientation:
    ``gate``/``up`` ``(E, I, H/v)``, ``down`` ``(E, H, I/v)`` (``v`` 2 for packed 4-bit, bytes), their
    scales ``gate_s``/``up_s``/``down_s`` in the file's dtype and shape per expert (stacked over E),
    and per-expert extras by file suffix (``<proj>.<suffix>``)."""
    fam = FAMILIES[family]
    h, i, kind = fam.hidden, intermediate(fam, base), fam.kind
    g = _gen(family, base, "weights")
    out: dict[str, torch.Tensor] = {}
    if kind in PACKED:
        for p, (name, rows, cols) in enumerate((("gate", i, h), ("up", i, h), ("down", h, i))):
            out[name] = _coded_bytes(g, rows, cols // 2, p)
    else:
        dtype = torch.bfloat16 if kind == "bf16" else torch.float8_e4m3fn
        out["gate"], out["up"], out["down"] = (
            _coded(g, i, h, 1.0, dtype),
            _coded(g, i, h, -1.0, dtype),
            _coded(g, h, i, 0.5, dtype),
        )
    s = _gen(family, base, "scales")
    sd = fam.file_dtypes.get("scale", torch.float32)
    for name, rows, cols in (("gate", i, h), ("up", i, h), ("down", h, i)):
        if kind.startswith("fp8-block"):
            t = _positive(s, (E, -(-rows // 128), -(-cols // 128)), 1e-3, 1e-2)
            out[f"{name}_s"] = t.to(torch.bfloat16) if kind == "fp8-block-bf16" else t.to(sd)
        elif kind == "fp8-channel":
            out[f"{name}_s"] = _positive(s, (E, rows, 1), 1e-3, 1e-2).to(sd)
        elif kind == "fp8-tensor":
            out[f"{name}_s"] = _positive(s, (E,), 1e-3, 1e-2).to(sd)
        elif kind in ("nvfp4-modelopt", "nvfp4-ct"):
            out[f"{name}_s"] = _positive(s, (E, rows, cols // 16), 0.05, 2.0).to(torch.float8_e4m3fn)
        elif kind == "int4":
            out[f"{name}_s"] = _positive(s, (E, rows, cols // 32), 1e-3, 1e-2).to(torch.bfloat16)
        elif kind == "mxfp4":
            out[f"{name}_s"] = torch.randint(118, 131, (E, rows, cols // 32), generator=s, dtype=torch.uint8)
    x = _gen(family, base, "extras")
    if kind == "nvfp4-modelopt":  # gate and up share weight_scale_2 (fused in the kernel)
        ws2 = _positive(x, (E,), 1e-4, 1e-3)
        out["gate.weight_scale_2"], out["up.weight_scale_2"] = ws2, ws2.clone()
        out["down.weight_scale_2"] = _positive(x, (E,), 1e-4, 1e-3)
        for p in ("gate", "up", "down"):
            out[f"{p}.input_scale"] = _positive(x, (E,), 1e-3, 1e-2)
    elif kind == "nvfp4-ct":
        gs = _positive(x, (E,), 1e3, 1e4)
        out["gate.weight_global_scale"], out["up.weight_global_scale"] = gs, gs.clone()
        out["down.weight_global_scale"] = _positive(x, (E,), 1e3, 1e4)
        for p in ("gate", "up", "down"):
            out[f"{p}.input_global_scale"] = _positive(x, (E,), 1e2, 1e3)
    elif kind == "fp8-tensor":
        for p in ("gate", "up", "down"):
            out[f"{p}.input_scale"] = _positive(x, (E,), 1e-3, 1e-2).to(fam.file_dtypes.get("scalars", torch.float32))
    elif kind == "mxfp4":
        out["b13"] = (torch.randn(E, 2 * i, generator=x) * 0.05).to(torch.bfloat16)
        out["b2"] = (torch.randn(E, h, generator=x) * 0.05).to(torch.bfloat16)
    if fam.names[0] is None:
        out.pop("gate")
        out.pop("gate_s", None)
    return out


def rank_bounds(family: str, base: str, tp: int, rank: int) -> tuple[int, int]:
    """Rows ``[r0, r1)`` of the intermediate size rank ``rank`` of ``tp`` holds (vLLM's sharding:
    equal shards; gpt-oss whole 32-value blocks, ``ceil(blocks / tp)`` per rank)."""
    fam = FAMILIES[family]
    i = intermediate(fam, base)
    if fam.kind == "mxfp4":
        per = -(-(i // 32) // tp) * 32
        return rank * per, min((rank + 1) * per, i)
    return rank * i // tp, (rank + 1) * i // tp


def _slice(family: str, base: str, t: dict[str, torch.Tensor], tp: int, rank: int) -> dict[str, torch.Tensor]:
    """The rank's part of :func:`truth`: gate/up rows, down columns (scales likewise; row scales of down whole)."""
    fam = FAMILIES[family]
    r0, r1 = rank_bounds(family, base, tp, rank)
    kind, out = fam.kind, dict(t)
    v = 2 if kind in PACKED else 1
    for p in ("gate", "up"):
        if p in t:
            out[p] = t[p][:, r0:r1]
    out["down"] = t["down"][:, :, r0 // v : r1 // v]
    for p in ("gate", "up", "down"):
        s = t.get(f"{p}_s")
        if s is None or kind == "fp8-tensor" or (kind == "fp8-channel" and p == "down"):
            continue
        if p != "down":  # rows: 128-row blocks (fp8-block) or one scale row per weight row
            blk = 128 if kind.startswith("fp8-block") else 1
            out[f"{p}_s"] = s[:, r0 // blk : -(-r1 // blk)]
        else:  # columns: one scale per block of values
            blk = 128 if kind.startswith("fp8-block") else PACKED[kind]
            out[f"{p}_s"] = s[:, :, r0 // blk : -(-r1 // blk)]
    if "b13" in t:
        i = intermediate(fam, base)
        out["b13"] = torch.cat([t["b13"][:, r0:r1], t["b13"][:, i + r0 : i + r1]], 1)
        if rank > 0:
            out["b2"] = torch.zeros_like(t["b2"])
    return out


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Rows g0, u0, g1, u1, ... (gpt-oss)."""
    return torch.stack([gate, up], dim=2).reshape(gate.shape[0], 2 * gate.shape[1], *gate.shape[2:])


def file_tensors(family: str, tp: int = 1, rank: int = 0) -> dict[str, torch.Tensor]:
    """Every expert tensor of ``family`` by its checkpoint name, as the file holds it (rank ``rank`` of ``tp``:
    what ``restore`` of that rank's conversion writes)."""
    fam = FAMILIES[family]
    out: dict[str, torch.Tensor] = {}
    suffix = {"nvfp4-ct": "weight_packed", "int4": "weight_packed"}.get(fam.kind, "weight")
    scale = {"fp8-block": "weight_scale_inv", "fp8-block-bf16": "weight_scale_inv"}.get(fam.kind, "weight_scale")
    if fam.convention == "ct-fp8-block":
        scale = "weight_scale"
    for base in fam.layers:
        t = _slice(family, base, truth(family, base), tp, rank)
        m = f"{base}.{fam.module}"
        if fam.layout == "per-expert":
            for e in range(E):
                for p, name in zip(("gate", "up", "down"), fam.names):
                    if name is None:
                        continue
                    w = t[p][e].contiguous()
                    if fam.kind == "int4":
                        out[f"{m}.{e}.{name}.weight_shape"] = torch.tensor(
                            [w.shape[0], 2 * w.shape[1]], dtype=fam.file_dtypes.get("shape", torch.int32)
                        )
                        w = w.view(torch.int32)
                    out[f"{m}.{e}.{name}.{suffix}"] = w
                    if f"{p}_s" in t:
                        s = t[f"{p}_s"][e]
                        tensor_scale = fam.kind == "fp8-tensor"
                        out[f"{m}.{e}.{name}.{scale}"] = (
                            s.reshape(scalar_shape(fam)) if tensor_scale else s.contiguous()
                        )
                    for key, val in t.items():
                        if key.startswith(f"{p}."):
                            out[f"{m}.{e}.{name}.{key.split('.', 1)[1]}"] = val[e].reshape(scalar_shape(fam)).clone()
        elif fam.layout == "stacked":
            out[f"{m}.{fam.names[0]}.weight"] = torch.cat([t["gate"], t["up"]], 1).contiguous()
            out[f"{m}.{fam.names[2]}.weight"] = t["down"].contiguous()
        elif fam.layout == "transposed":
            out[f"{m}.{fam.names[0]}"] = torch.cat([t["gate"], t["up"]], 1).transpose(1, 2).contiguous()
            out[f"{m}.{fam.names[2]}"] = t["down"].transpose(1, 2).contiguous()
        elif fam.layout == "flat":
            il = t["gate"].shape[1]
            out[f"{m}.{fam.names[0]}"] = t["gate"].reshape(E * il, -1).contiguous()
            out[f"{m}.{fam.names[1]}"] = t["up"].reshape(E * il, -1).contiguous()
            out[f"{m}.{fam.names[2]}"] = t["down"].transpose(1, 2).reshape(E * il, -1).contiguous()
        elif fam.layout == "gpt-oss":
            g13 = _interleave(t["gate"], t["up"])
            out[f"{m}.mlp1_weight.blocks"] = g13.reshape(E, g13.shape[1], -1, 16).contiguous()
            out[f"{m}.mlp1_weight.scales"] = _interleave(t["gate_s"], t["up_s"]).contiguous()
            out[f"{m}.mlp1_bias"] = _interleave(*t["b13"].reshape(E, 2, -1).unbind(1)).contiguous()
            out[f"{m}.mlp2_weight.blocks"] = t["down"].reshape(E, fam.hidden, -1, 16).contiguous()
            out[f"{m}.mlp2_weight.scales"] = t["down_s"].contiguous()
            out[f"{m}.mlp2_bias"] = t["b2"].contiguous()
    return out


def other_tensors(family: str) -> dict[str, torch.Tensor]:
    """Routers, a dense MLP and an attention weight per layer: real names the reader must skip."""
    fam = FAMILIES[family]
    g = _gen(family, "", "other")
    out = {}
    for base in fam.layers:
        block = fam.module.split(".")[0]
        out[f"{base}.{block}.gate.weight"] = (torch.randn(E, fam.hidden, generator=g) * 0.05).to(torch.bfloat16)
        out[f"{base}.self_attn.o_proj.weight"] = (torch.randn(fam.hidden, fam.hidden, generator=g)).to(torch.bfloat16)
    if fam.layers[0].endswith(".1"):  # a dense layer before the first MoE layer (DeepSeek first_k_dense_replace)
        dense = fam.layers[0][: -len("1")] + "0"
        for p in ("gate_proj", "up_proj", "down_proj"):
            out[f"{dense}.mlp.{p}.weight"] = (torch.randn(fam.hidden, fam.hidden, generator=g)).to(torch.bfloat16)
    return out


def make(family: str, out_root: Path) -> Path:
    """Write ``family`` to ``out_root / family`` (two shards and an index); returns the directory."""
    fam = FAMILIES[family]
    out = out_root / family
    out.mkdir(parents=True, exist_ok=True)
    tensors = {**file_tensors(family), **other_tensors(family)}
    names = sorted(tensors)
    shards = [names[0::2], names[1::2]]
    weight_map = {}
    for k, part in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(out / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(fam.config, indent=2) + "\n")
    for name, content in fam.extra_files.items():
        (out / name).write_text(json.dumps(content, indent=2) + "\n")
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    out_root = Path(argv[0])
    for family in argv[1:] or list(FAMILIES):
        d = make(family, out_root)
        print(f"{family:<26} {sum(f.stat().st_size for f in d.iterdir()) / 1e3:8.1f} kB  {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
