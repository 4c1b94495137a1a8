"""Naming conventions of MoE expert tensors in real safetensors checkpoints, one entry each.

A convention says which tensor names hold one MoE layer's experts, their dtypes, which
``config.json`` keys give the sizes, and how gate and up are stored. The reader turns any
of them into the same stacked layout (``w13`` ``(E, 2I, H)`` rows ``[gate; up]``, ``w2``
``(E, H, I)``, scales alongside); :meth:`Convention.to_tensors` goes back (the sample
generator and ``restore`` use it).

Sources (checked with the search tool; the Hugging Face files themselves are not in its
corpus, so most facts come from quotes of them in public repositories and pages; facts only):

- ``deepseek-fp8``: deepseek-ai/DeepSeek-V3 ``README_WEIGHTS.md`` (FP8 e4m3 with 128x128
  blocks, a float32 ``weight_scale_inv`` per weight, ``quantization_config``
  ``{"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
  "weight_block_size": [128, 128]}``); expert names
  ``model.layers.{L}.mlp.experts.{e}.{gate,up,down}_proj.weight[_scale_inv]`` as quoted by
  loaders and checkpoint tools; DeepSeek-R1 ``config.json`` (``first_k_dense_replace`` 3,
  ``moe_intermediate_size`` 2048, ``n_routed_experts`` 256). Kimi-K2 uses the same
  architecture and names: ``config.json`` quotes with ``model_type`` kimi_k2,
  ``n_routed_experts`` 384, ``moe_intermediate_size`` 2048, ``first_k_dense_replace`` 1.
- ``qwen3-moe-bf16``: Qwen/Qwen3-30B-A3B ``config.json`` quotes (``qwen3_moe``,
  ``num_experts`` 128, ``num_experts_per_tok`` 8, ``moe_intermediate_size`` 768,
  ``hidden_size`` 2048, ``decoder_sparse_step`` 1, ``mlp_only_layers`` []); per-expert
  ``...mlp.experts.{e}.{gate,up,down}_proj.weight`` in BF16.
- ``mixtral-bf16``: ``model.layers.{L}.block_sparse_moe.experts.{e}.{w1,w2,w3}.weight``
  (index quotes; w1 = gate, w3 = up, w2 = down as in HF/MLX name maps), ``config.json``
  ``intermediate_size``, ``num_local_experts``, ``num_experts_per_tok``.
- ``modelopt-nvfp4``: nvidia/DeepSeek-R1-0528-FP4 tensor listing (``.weight`` U8
  ``[out, in/2]``, ``.weight_scale`` F8_E4M3 ``[out, in/16]``, ``.weight_scale_2`` F32
  ``[]``, ``.input_scale`` F32 ``[]``), the same four per expert in ModelOpt MoE exports
  (``...mlp.experts.{e}.gate_proj.weight_scale_2``); ``hf_quant_config.json``
  ``{"quantization": {"quant_algo": "NVFP4", "group_size": 16}}``.
- ``gpt-oss-mxfp4``: openai/gpt-oss ``model.safetensors.index.json`` quotes
  (``model.layers.{L}.mlp.experts.{gate_up_proj,down_proj}_{blocks,scales,bias}``,
  ``mlp.router.{weight,bias}``); gpt-oss-20b shapes ``gate_up_proj_blocks`` U8
  ``[32, 5760, 90, 16]``, ``gate_up_proj_scales`` U8 ``[32, 5760, 90]``; ``config.json``
  (``intermediate_size`` 2880, ``num_local_experts`` 32, ``experts_per_token`` 4,
  ``swiglu_limit`` 7.0); gate/up rows interleaved (HF ``GptOssExperts``:
  ``gate = gate_up[..., ::2]``, ``up = gate_up[..., 1::2]``, ``(up + 1) * gate *
  sigmoid(1.702 * gate)``); TP sharding by whole 32-value blocks (vLLM's gpt-oss loader).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from fimoe_lab.errors import CheckpointError
from fimoe_lab.specs import get_format, torch_dtype

__all__ = ["Convention", "CONVENTIONS", "get", "SAFETENSORS_DTYPES", "dtype_name"]

SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I32": torch.int32,
    "I64": torch.int64,
}
_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (``torch.float8_e4m3fn`` -> ``F8_E4M3``)."""
    return _NAMES.get(dtype, str(dtype))


@dataclass(frozen=True)
class Convention:
    """One naming convention for a MoE layer's expert tensors.

    Per-expert conventions (``projections`` = module names of gate, up, down) store each
    expert's projections as ``{prefix}{L}.{block}.experts.{e}.{proj}.{suffix}``; the fused
    one (``projections`` None, gpt-oss) stores all experts in ``{prefix}{L}.mlp.experts.{name}``.
    ``fmt`` is the :data:`fimoe_lab.specs.FORMATS` name; the weight and scale dtypes are
    that table's (``storage``, ``scale_dtype``). ``scalar_extras``: float32 scalars stored
    beside each projection (ModelOpt NVFP4: ``weight_scale_2``, ``input_scale``), stacked as
    extras ``w13_<name>`` ``(E, 2)`` (gate, up) and ``w2_<name>`` ``(E,)``. ``activation``:
    a :data:`fimoe_lab.specs.ACTIVATIONS` name or alias.
    """

    name: str
    models: str
    fmt: str
    block: str
    projections: Optional[tuple[str, str, str]]
    scale_suffix: Optional[str]
    intermediate_keys: tuple[str, ...]
    expert_keys: tuple[str, ...]
    top_k_keys: tuple[str, ...]
    gate_up_order: str
    activation: str = "silu"
    router: tuple[str, ...] = ("gate.weight",)
    scalar_extras: tuple[str, ...] = ()

    @property
    def fused(self) -> bool:
        return self.projections is None

    @property
    def weight_dtype(self) -> torch.dtype:
        """Stored weight dtype (``specs.FORMATS[fmt].storage``; packed FP4 is uint8)."""
        return torch_dtype(get_format(self.fmt).storage)

    @property
    def scale_dtype(self) -> Optional[torch.dtype]:
        """Stored block-scale dtype (``specs.FORMATS[fmt].scale_dtype``), None without scales."""
        name = get_format(self.fmt).scale_dtype
        return torch_dtype(name) if name else None

    # ------------------------------------------------------------------ names
    def expert_key(self, prefix: str, layer: int, expert: int, proj: int, suffix: str = "weight") -> str:
        """Name of projection ``proj`` (0 gate, 1 up, 2 down) of one expert, per-expert conventions."""
        return f"{prefix}{layer}.{self.block}.experts.{expert}.{self.projections[proj]}.{suffix}"

    def fused_key(self, prefix: str, layer: int, name: str) -> str:
        """Name of a fused all-experts tensor (gpt-oss), e.g. ``gate_up_proj_blocks``."""
        return f"{prefix}{layer}.{self.block}.experts.{name}"

    def signature(self, prefix: str, layer: int) -> dict[str, Optional[torch.dtype]]:
        """Tensors (name -> dtype, None = must be absent) whose presence identifies this convention."""
        if self.fused:
            return {
                self.fused_key(prefix, layer, "gate_up_proj_blocks"): self.weight_dtype,
                self.fused_key(prefix, layer, "gate_up_proj_scales"): self.scale_dtype,
            }
        sig: dict[str, Optional[torch.dtype]] = {self.expert_key(prefix, layer, 0, 0): self.weight_dtype}
        for suffix in ("weight_scale_inv", "weight_scale"):
            sig[self.expert_key(prefix, layer, 0, 0, suffix)] = (
                self.scale_dtype if suffix == self.scale_suffix else None
            )
        return sig

    def pattern(self) -> str:
        """The expert-0 gate tensor name with placeholders, for error messages."""
        if self.fused:
            return (
                f"{{prefix}}{{L}}.{self.block}.experts.gate_up_proj_blocks ({dtype_name(self.weight_dtype)}) + "
                f"gate_up_proj_scales ({dtype_name(self.scale_dtype)})"
            )
        scale = f" + .{self.scale_suffix} ({dtype_name(self.scale_dtype)})" if self.scale_suffix else ""
        return f"{{prefix}}{{L}}.{self.block}.experts.{{e}}.{self.projections[0]}.weight ({dtype_name(self.weight_dtype)}){scale}"

    # ------------------------------------------------------------------ writing
    def to_tensors(self, prefix: str, layer: int, moe) -> dict[str, torch.Tensor]:
        """The checkpoint tensors of one stacked layer (a :class:`~fimoe_lab.checkpoints.reader.MoELayer`).

        Inverse of the reader: splits ``w13`` rows into gate and up (or re-interleaves them
        for gpt-oss), one tensor per expert and projection, plus scales and extras.
        """
        e_count, i = moe.num_experts, moe.intermediate
        out: dict[str, torch.Tensor] = {}
        if self.fused:

            def interleave(x: torch.Tensor) -> torch.Tensor:  # [gate; up] rows -> g0, u0, g1, u1, ...
                return torch.stack([x[:, :i], x[:, i:]], dim=2).reshape(x.shape).contiguous()

            spec = get_format(self.fmt)
            b, bb = spec.scale_block, spec.scale_block // spec.values_per_byte  # values and bytes per block
            out[self.fused_key(prefix, layer, "gate_up_proj_blocks")] = interleave(moe.w13).reshape(
                e_count, 2 * i, moe.hidden // b, bb
            )
            out[self.fused_key(prefix, layer, "gate_up_proj_scales")] = interleave(moe.w13_scale)
            out[self.fused_key(prefix, layer, "down_proj_blocks")] = moe.w2.reshape(
                e_count, moe.hidden, i // b, bb
            ).contiguous()
            out[self.fused_key(prefix, layer, "down_proj_scales")] = moe.w2_scale.contiguous()
            if "w13_bias" in moe.extras:
                out[self.fused_key(prefix, layer, "gate_up_proj_bias")] = interleave(moe.extras["w13_bias"])
                out[self.fused_key(prefix, layer, "down_proj_bias")] = moe.extras["w2_bias"].contiguous()
            return out
        s_half = moe.w13_scale.shape[1] // 2 if moe.w13_scale is not None else 0
        for e in range(e_count):
            parts = (
                (moe.w13[e, :i], moe.w13_scale[e, :s_half] if s_half else None),
                (moe.w13[e, i:], moe.w13_scale[e, s_half:] if s_half else None),
                (moe.w2[e], moe.w2_scale[e] if moe.w2_scale is not None else None),
            )
            for proj, (w, s) in enumerate(parts):
                out[self.expert_key(prefix, layer, e, proj)] = w.contiguous()
                if s is not None:
                    out[self.expert_key(prefix, layer, e, proj, self.scale_suffix)] = s.contiguous()
                for extra in self.scalar_extras:
                    stacked = moe.extras.get(f"{'w13' if proj < 2 else 'w2'}_{extra}")
                    if stacked is not None:
                        out[self.expert_key(prefix, layer, e, proj, extra)] = (
                            stacked[e, proj] if proj < 2 else stacked[e]
                        ).clone()
        return out


CONVENTIONS: tuple[Convention, ...] = (
    Convention(
        "deepseek-fp8",
        "DeepSeek-V3/R1, Kimi-K2 (FP8 block-128)",
        "fp8-block",
        "mlp",
        ("gate_proj", "up_proj", "down_proj"),
        "weight_scale_inv",
        ("moe_intermediate_size",),
        ("n_routed_experts", "num_experts"),
        ("num_experts_per_tok",),
        "[gate_proj; up_proj]",
        router=("gate.weight", "gate.e_score_correction_bias"),
    ),
    Convention(
        "modelopt-nvfp4",
        "ModelOpt NVFP4 exports (nvidia/DeepSeek-R1-FP4, ...)",
        "nvfp4",
        "mlp",
        ("gate_proj", "up_proj", "down_proj"),
        "weight_scale",
        ("moe_intermediate_size", "intermediate_size"),
        ("n_routed_experts", "num_experts", "num_local_experts"),
        ("num_experts_per_tok",),
        "[gate_proj; up_proj]",
        router=("gate.weight", "gate.e_score_correction_bias"),
        scalar_extras=("weight_scale_2", "input_scale"),
    ),
    Convention(
        "qwen3-moe-bf16",
        "Qwen3-MoE (and other per-expert gate_proj/up_proj/down_proj BF16)",
        "bf16",
        "mlp",
        ("gate_proj", "up_proj", "down_proj"),
        None,
        ("moe_intermediate_size",),
        ("num_experts", "n_routed_experts"),
        ("num_experts_per_tok",),
        "[gate_proj; up_proj]",
    ),
    Convention(
        "mixtral-bf16",
        "Mixtral (block_sparse_moe w1/w3/w2, BF16)",
        "bf16",
        "block_sparse_moe",
        ("w1", "w3", "w2"),
        None,
        ("intermediate_size",),
        ("num_local_experts",),
        ("num_experts_per_tok",),
        "[w1 (gate); w3 (up)]",
    ),
    Convention(
        "gpt-oss-mxfp4",
        "gpt-oss (fused MXFP4 blocks/scales, interleaved gate/up)",
        "mxfp4",
        "mlp",
        None,
        None,
        ("intermediate_size",),
        ("num_local_experts",),
        ("experts_per_token", "num_experts_per_tok"),
        "interleaved rows g0,u0,g1,u1,... (de-interleaved to [gate; up] on read)",
        activation="swiglu_oai",
        router=("router.weight", "router.bias"),
    ),
)


def get(name: str) -> Convention:
    """The convention called ``name``; :class:`CheckpointError` listing the known ones otherwise."""
    for c in CONVENTIONS:
        if c.name == name:
            return c
    raise CheckpointError(
        f"unknown checkpoint convention {name!r}", fix=f"choose one of {', '.join(c.name for c in CONVENTIONS)}"
    )
