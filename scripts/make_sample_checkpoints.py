"""Generate the small sample checkpoints in ``fimoe_lab/data/samples/`` (seeded, deterministic).

Each sample is a real-format checkpoint of one naming convention (see
``fimoe_lab/checkpoints/conventions.py``): ``config.json`` with the model's real keys
(sizes reduced), ``model.safetensors.index.json`` and shards, expert tensors quantized
with :mod:`fimoe_lab.formats`, plus the router (and for DeepSeek a dense layer and a
shared expert) so that readers must pick the experts out. Interesting cases on purpose:

- ``deepseek-v3-fp8``: expert 3 is dead (weights ~1e-20, block scales ~1e-23), the case
  that made the Hopper CUTLASS kernel emit NaN; intermediate 256 cannot shard at TP 4/8
  (128-row FP8 scale blocks).
- ``mixtral-bf16``: intermediate 464 (= Nemotron's 1856 / 4): 16-aligned at TP 1, not at
  TP 4/8; TRT-LLM pads it.
- ``deepseek-r1-nvfp4``: intermediate 320 = 64 * 5: full TRT-LLM alignment at TP 1, 80 at
  TP 4 (not % 64), 40 at TP 8 (cuts a 16-value scale block).
- ``gpt-oss-mxfp4``: interleaved gate/up, biases; TP 4/8 cut a 32-value scale block.

Run: ``python scripts/make_sample_checkpoints.py [OUT_DIR]`` (default: the package's samples,
``fimoe_lab/data/samples``).
"""

from __future__ import annotations

import json
import shutil
import sys
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from fimoe_lab import formats, resources  # noqa: E402
from fimoe_lab.checkpoints import conventions  # noqa: E402
from fimoe_lab.checkpoints.reader import MoELayer  # noqa: E402

DEFAULT_OUT = resources.samples_dir()
DEAD_SCALE = 5e-20

_DEEPSEEK = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_act": "silu",
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "moe_layer_freq": 1,
    "torch_dtype": "bfloat16",
    "vocab_size": 1024,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-6,
}

SAMPLES: dict[str, dict] = {
    "deepseek-v3-fp8": dict(
        convention="deepseek-fp8",
        hidden=256,
        intermediate=256,
        experts=6,
        moe_layers=(1,),
        shards=2,
        dead_expert=3,
        config={
            **_DEEPSEEK,
            "hidden_size": 256,
            "intermediate_size": 384,
            "moe_intermediate_size": 256,
            "n_routed_experts": 6,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 2,
            "first_k_dense_replace": 1,
            "quantization_config": {
                "activation_scheme": "dynamic",
                "fmt": "e4m3",
                "quant_method": "fp8",
                "weight_block_size": [128, 128],
            },
        },
    ),
    "qwen3-moe-bf16": dict(
        convention="qwen3-moe-bf16",
        hidden=128,
        intermediate=192,
        experts=6,
        moe_layers=(0, 1),
        shards=2,
        config={
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "hidden_act": "silu",
            "hidden_size": 128,
            "intermediate_size": 384,
            "moe_intermediate_size": 192,
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "vocab_size": 1024,
            "torch_dtype": "bfloat16",
        },
    ),
    "mixtral-bf16": dict(
        convention="mixtral-bf16",
        hidden=64,
        intermediate=464,
        experts=4,
        moe_layers=(0,),
        shards=1,
        config={
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "hidden_act": "silu",
            "hidden_size": 64,
            "intermediate_size": 464,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 1024,
            "torch_dtype": "bfloat16",
        },
    ),
    "deepseek-r1-nvfp4": dict(
        convention="modelopt-nvfp4",
        hidden=256,
        intermediate=320,
        experts=8,
        moe_layers=(0,),
        shards=1,
        config={
            **_DEEPSEEK,
            "hidden_size": 256,
            "intermediate_size": 512,
            "moe_intermediate_size": 320,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 1,
            "first_k_dense_replace": 0,
        },
        hf_quant_config={
            "producer": {"name": "modelopt"},
            "quantization": {
                "quant_algo": "NVFP4",
                "kv_cache_quant_algo": None,
                "group_size": 16,
                "exclude_modules": ["lm_head"],
            },
        },
    ),
    "gpt-oss-mxfp4": dict(
        convention="gpt-oss-mxfp4",
        hidden=256,
        intermediate=320,
        experts=8,
        moe_layers=(0,),
        shards=1,
        config={
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "hidden_act": "silu",
            "hidden_size": 256,
            "intermediate_size": 320,
            "num_local_experts": 8,
            "experts_per_token": 4,
            "num_experts_per_tok": 4,
            "num_hidden_layers": 1,
            "swiglu_limit": 7.0,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "vocab_size": 1024,
            "torch_dtype": "bfloat16",
            "quantization_config": {
                "quant_method": "mxfp4",
                "modules_to_not_convert": [
                    "model.layers.*.self_attn",
                    "model.layers.*.mlp.router",
                    "model.embed_tokens",
                    "lm_head",
                ],
            },
        },
    ),
}


def _generator(sample: str, layer: int, what: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"{sample}/{layer}/{what}".encode()))


def original_weights(sample: str, layer: int) -> dict[str, torch.Tensor]:
    """The float32 weights a sample was quantized from: ``gate``/``up`` ``(E, I, H)``, ``down`` ``(E, H, I)``.

    Gaussian, with a different spread per expert and projection (so a swapped gate/up or
    a wrong expert order changes values), and the sample's dead expert scaled by ``DEAD_SCALE``.
    """
    spec = SAMPLES[sample]
    e, i, h = spec["experts"], spec["intermediate"], spec["hidden"]
    g = _generator(sample, layer, "weights")
    spread = 0.02 * (1 + 0.25 * torch.arange(e, dtype=torch.float32))[:, None, None]
    out = {
        "gate": torch.randn(e, i, h, generator=g) * spread,
        "up": torch.randn(e, i, h, generator=g) * spread * 1.5,
        "down": torch.randn(e, h, i, generator=g) * spread * 0.75,
    }
    if "dead_expert" in spec:
        for t in out.values():
            t[spec["dead_expert"]] *= DEAD_SCALE
    return out


def sample_layer(sample: str, layer: int) -> MoELayer:
    """The stacked layer a sample stores, quantized from :func:`original_weights` (full size, TP 1)."""
    spec = SAMPLES[sample]
    conv = conventions.get(spec["convention"])
    w = original_weights(sample, layer)
    i, h = spec["intermediate"], spec["hidden"]
    extras: dict[str, torch.Tensor] = {}
    fmt = conv.fmt
    if fmt == "bf16":
        w13, w2 = torch.cat([w["gate"], w["up"]], 1).to(torch.bfloat16), w["down"].to(torch.bfloat16)
        s13 = s2 = None
    elif fmt == "fp8-block":
        q = {k: formats.get(fmt).quantize(v) for k, v in w.items()}
        w13, s13 = torch.cat([q["gate"].values, q["up"].values], 1), torch.cat([q["gate"].scales, q["up"].scales], 1)
        w2, s2 = q["down"].values, q["down"].scales
    elif fmt == "nvfp4":  # ModelOpt shares one global scale between gate and up (they are fused)
        nv = formats.get(fmt)
        amax13 = torch.maximum(w["gate"].abs().amax((1, 2)), w["up"].abs().amax((1, 2)))
        gs13 = (448.0 * 6.0) / amax13
        qg, qu, qd = nv.quantize(w["gate"], gs13), nv.quantize(w["up"], gs13), nv.quantize(w["down"])
        w13, s13 = torch.cat([qg.values, qu.values], 1), torch.cat([qg.scales, qu.scales], 1)
        w2, s2 = qd.values, qd.scales
        g = _generator(sample, layer, "input_scale")
        in13 = torch.rand(w13.shape[0], generator=g) * 0.01 + 0.002
        extras = {
            "w13_weight_scale_2": (1.0 / gs13)[:, None].expand(-1, 2).contiguous(),
            "w13_input_scale": in13[:, None].expand(-1, 2).contiguous(),
            "w2_weight_scale_2": 1.0 / qd.global_scale,
            "w2_input_scale": torch.rand(w13.shape[0], generator=g) * 0.01 + 0.002,
        }
    elif fmt == "mxfp4":
        mx = formats.get(fmt)
        q13, q2 = mx.quantize(torch.cat([w["gate"], w["up"]], 1)), mx.quantize(w["down"])
        w13, s13, w2, s2 = q13.values, q13.scales, q2.values, q2.scales
        g = _generator(sample, layer, "bias")
        extras = {
            "w13_bias": (torch.randn(w13.shape[0], 2 * i, generator=g) * 0.05).to(torch.bfloat16),
            "w2_bias": (torch.randn(w13.shape[0], h, generator=g) * 0.05).to(torch.bfloat16),
        }
    else:
        raise ValueError(fmt)
    return MoELayer(
        fmt, w13.contiguous(), w2.contiguous(), s13, s2, i, h, extras, layer, conv.name, activation=conv.activation
    )


def _other_tensors(sample: str, layer: int, conv: conventions.Convention) -> dict[str, torch.Tensor]:
    """Router (and DeepSeek's shared expert) of a MoE layer: real names, so readers skip them."""
    spec = SAMPLES[sample]
    e, h = spec["experts"], spec["hidden"]
    g = _generator(sample, layer, "router")
    base = f"model.layers.{layer}.{conv.block}."
    out = {base + conv.router[0]: (torch.randn(e, h, generator=g) * 0.05).to(torch.bfloat16)}
    if len(conv.router) > 1:
        out[base + conv.router[1]] = (torch.randn(e, generator=g) * 0.01).to(
            torch.float32 if conv.name != "gpt-oss-mxfp4" else torch.bfloat16
        )
    if conv.name == "deepseek-fp8":  # shared expert and the dense layers before the first MoE layer
        fp8 = formats.get("fp8-block")
        i = spec["intermediate"]
        for p, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            q = fp8.quantize(torch.randn(*shape, generator=g) * 0.02)
            out[f"{base}shared_experts.{p}.weight"], out[f"{base}shared_experts.{p}.weight_scale_inv"] = (
                q.values,
                q.scales,
            )
    return out


def _dense_layer(sample: str, layer: int) -> dict[str, torch.Tensor]:
    spec = SAMPLES[sample]
    i, h = spec["config"]["intermediate_size"], spec["hidden"]
    g = _generator(sample, layer, "dense")
    fp8 = formats.get("fp8-block")
    out = {}
    for p, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
        q = fp8.quantize(torch.randn(*shape, generator=g) * 0.02)
        out[f"model.layers.{layer}.mlp.{p}.weight"], out[f"model.layers.{layer}.mlp.{p}.weight_scale_inv"] = (
            q.values,
            q.scales,
        )
    return out


def make(sample: str, out_root: Path) -> Path:
    """Write one sample checkpoint to ``out_root / sample`` (replacing it); returns the directory."""
    spec = SAMPLES[sample]
    conv = conventions.get(spec["convention"])
    groups: list[dict[str, torch.Tensor]] = []
    for layer in range(spec["config"]["num_hidden_layers"]):
        if layer in spec["moe_layers"]:
            t = conv.to_tensors("model.layers.", layer, sample_layer(sample, layer))
            t.update(_other_tensors(sample, layer, conv))
        else:
            t = _dense_layer(sample, layer)
        groups.append(t)
    shards = spec["shards"]
    out = out_root / sample
    tmp = out_root / f".{sample}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map, total = {}, 0
    for k in range(shards):
        name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {n: v.contiguous() for gi, grp in enumerate(groups) if gi % shards == k for n, v in grp.items()}
        save_file(tensors, str(tmp / name), metadata={"format": "pt"})
        weight_map.update({n: name for n in tensors})
        total += sum(v.numel() * v.element_size() for v in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (tmp / "config.json").write_text(json.dumps(spec["config"], indent=2) + "\n")
    if "hf_quant_config" in spec:
        (tmp / "hf_quant_config.json").write_text(json.dumps(spec["hf_quant_config"], indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def main(argv: list[str]) -> int:
    out_root = Path(argv[0]) if argv else DEFAULT_OUT
    out_root.mkdir(parents=True, exist_ok=True)
    total = 0
    for sample in SAMPLES:
        d = make(sample, out_root)
        size = sum(f.stat().st_size for f in d.iterdir())
        total += size
        print(f"{sample:<20} {size / 1e6:6.2f} MB  {d}")
    print(f"{'total':<20} {total / 1e6:6.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
