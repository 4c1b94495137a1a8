"""Naming conventions of MoE expert tensors in real safetensors checkpoints, one entry each.

A convention says which tensor names hold one MoE layer's experts, their dtypes and how
gate and up are stored; :data:`CONFIG_KEYS` says which ``config.json`` keys give the sizes
(one alias table for every family). The reader turns any convention into the same stacked
layout (``w13`` ``(E, 2I, H)`` rows ``[gate; up]`` (``(E, I, H)`` for a non-gated
activation), ``w2`` ``(E, H, I)``, scales alongside); :meth:`Convention.to_tensors` goes
back (the sample generators and ``restore`` use it), byte for byte.

Sources (checked with the search tool and the engines' model loaders: vLLM 0.34 and
SGLang 0.5.23 ``models/*.py``; facts only):

- ``deepseek-fp8``: DeepSeek-V3 ``README_WEIGHTS.md`` (FP8 e4m3, 128x128 blocks, float32
  ``weight_scale_inv``; ``quantization_config`` ``quant_method`` fp8, ``weight_block_size``
  [128, 128]); ``model.layers.{L}.mlp.experts.{e}.{gate,up,down}_proj.weight``; MTP layer
  ``model.layers.61`` (``num_hidden_layers`` 61, ``num_nextn_predict_layers`` 1); Kimi-K2
  and GLM-4.5 BF16/FP8-block exports use the same names (GLM: ``n_routed_experts``,
  ``moe_intermediate_size``, MTP ``model.layers.{num_hidden_layers}``).
- ``qwen3-fp8``: Qwen3 FP8 releases, the DeepSeek names and ``quantization_config``, with
  BF16 ``weight_scale_inv`` (engines' loaders accept bf16 block scales for these).
- ``ct-fp8-block`` / ``ct-fp8-channel`` / ``ct-fp8-tensor`` / ``ct-nvfp4`` / ``ct-int4``:
  compressed-tensors (``quant_method`` compressed-tensors): FP8 ``weight`` + ``weight_scale``
  (block ``(ceil(out/128), ceil(in/128))`` float32; per output channel ``(out, 1)``, the
  ``FP8-dynamic`` scheme, GLM-4.5 FP8 (``format`` float-quantized, strategy channel; not
  checked against the release's own files); per tensor ``(1,)`` with ``input_scale`` ``(1,)``
  (static)); their ``weight_scale`` (and a static ``input_scale``) in the dtype of the model they
  quantized, F32, BF16 or F16 (compressed-tensors ``initialize_qparams``: ``scale_dtype =
  observed_dtype``), read into float32 exactly and written back as read; NVFP4 ``weight_packed`` U8 ``(out,
  in/2)``, ``weight_scale`` F8_E4M3 ``(out, in/16)``, ``weight_global_scale`` and
  ``input_global_scale`` F32 ``(1,)`` (the reciprocal of ModelOpt's ``weight_scale_2``);
  int4 ``pack-quantized`` (Kimi-K2-Thinking): ``weight_packed`` I32 ``(out, in/8)`` (eight
  4-bit values per int32, value ``j`` in bits ``4j..4j+3``, stored as ``q + 8``),
  ``weight_scale`` BF16 ``(out, in/32)`` (symmetric, group 32), ``weight_shape`` ``(2,)``: I64 from
  ``PackedQuantizationCompressor.compress_weight`` (``torch.tensor(weight.shape)``), I32 as its
  ``compression_param_info`` declares it; both read, each written back as read.
- ``modelopt-nvfp4`` / ``modelopt-fp8``: NVIDIA ModelOpt exports (``hf_quant_config.json``
  ``quant_algo`` NVFP4 / FP8): NVFP4 ``weight`` U8 ``(out, in/2)``, ``weight_scale``
  F8_E4M3 ``(out, in/16)``, ``weight_scale_2`` and ``input_scale`` F32 scalars; FP8
  per-tensor ``weight`` F8_E4M3 with ``weight_scale`` and ``input_scale`` F32 scalars
  (vLLM's ModelOpt FP8 MoE stacks them as ``w13_weight_scale (E, 2)``).
- ``qwen3-moe-bf16``, OLMoE, ERNIE-4.5 (``moe_num_experts``, ``moe_k``), Hunyuan-A13B
  (``moe_intermediate_size``/``moe_topk`` per-layer lists, router ``mlp.gate.wg``),
  Qwen3-Next (MTP ``mtp.layers.{k}``): per-expert ``gate_proj/up_proj/down_proj`` in BF16.
- ``mixtral-bf16`` / ``minimax-fp8``: ``block_sparse_moe.experts.{e}.{w1,w3,w2}`` (w1 gate,
  w3 up, w2 down); MiniMax-M2 stores them FP8 with float32 ``weight_scale_inv`` blocks.
- ``nemotron-h-bf16``: Nemotron-3 (``nemotron_h``): ``backbone.layers.{L}.mixer.experts.{e}.
  {up_proj,down_proj}`` (ReLU^2, no gate; ``n_routed_experts``, ``moe_intermediate_size``).
- ``granite-bf16``: ``block_sparse_moe.input_linear.weight`` ``(E, 2I, H)`` rows ``[gate;
  up]``, ``output_linear.weight`` ``(E, H, I)`` (vLLM maps them to ``gate_up_proj``/``down_proj``).
- ``llama4-bf16`` / ``qwen3-vl-bf16``: ``feed_forward.experts.gate_up_proj`` (Llama-4,
  ``language_model.model.layers``) and ``mlp.experts.gate_up_proj`` (Qwen3-VL-MoE,
  ``model.language_model.layers``) ``(E, H, 2I)``, columns ``[gate | up]``, ``down_proj``
  ``(E, I, H)``: stored input-major (vLLM transposes the last two dims on load).
- ``dbrx-bf16``: ``transformer.blocks.{L}.ffn.experts.mlp.{w1,v1,w2}`` each ``(E*I, H)``: w1
  gate, v1 up, w2 the down projection transposed (vLLM: ``reshape(E, I, H).transpose(1, 2)``);
  sizes in ``d_model`` and ``ffn_config`` (``ffn_hidden_size``, ``moe_num_experts``, ``moe_top_k``).
- ``gpt-oss-mxfp4`` / ``gpt-oss-original``: gpt-oss ``mlp.experts.{gate_up_proj,down_proj}_
  {blocks,scales,bias}`` and the ``original/`` files' ``block.{L}.mlp.{mlp1,mlp2}_weight.
  {blocks,scales}`` + ``mlp{1,2}_bias`` (config ``num_experts``, ``experts_per_token``);
  blocks ``(E, rows, cols/32, 16)`` U8, UE8M0 scales ``(E, rows, cols/32)``; gate/up rows
  interleaved (``gate = x[..., ::2]``, ``up = x[..., 1::2]``); TP by whole 32-value blocks.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from fimoe_lab.engines import QUANT_METHODS
from fimoe_lab.errors import CheckpointError, FormatError
from fimoe_lab.specs import FORMATS, FormatSpec, get_format, torch_dtype

__all__ = [
    "Convention",
    "Fused",
    "CONVENTIONS",
    "CONFIG_KEYS",
    "CHECKPOINT_FORMATS",
    "MISSING_LAYOUT",
    "WEIGHT_XOR",
    "get",
    "quant_method",
    "stored_format",
    "config_value",
    "config_quant_method",
    "SAFETENSORS_DTYPES",
    "dtype_name",
]

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


CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "hidden": ("hidden_size", "d_model"),
    "intermediate": ("moe_intermediate_size", "intermediate_size", "ffn_config.ffn_hidden_size"),
    "experts": (
        "n_routed_experts",
        "num_experts",
        "num_local_experts",
        "moe_num_experts",
        "ffn_config.moe_num_experts",
    ),
    "top_k": ("num_experts_per_tok", "experts_per_token", "moe_k", "moe_topk", "ffn_config.moe_top_k"),
    "layers": ("num_hidden_layers", "n_layers", "num_layers"),
}
"""``config.json`` keys of each size, first present wins, at the top level or under
``text_config`` (``a.b``: key ``b`` of the object ``a``). A list value is per layer
(Hunyuan-A13B ``moe_intermediate_size``, ``moe_topk``): the reader takes the layer's entry.
``moe_intermediate_size`` precedes ``intermediate_size``: models with both (DeepSeek,
Qwen3-MoE, GLM, ERNIE, Hunyuan) keep the dense MLP's size in the latter."""


def config_value(config: Mapping[str, Any], what: str) -> tuple[Optional[str], Any]:
    """``(key, value)`` of the first :data:`CONFIG_KEYS` alias of ``what`` present in ``config``
    (top level, then ``text_config``), ``(None, None)`` when none is."""
    text = config.get("text_config")
    for level in (config, text if isinstance(text, Mapping) else {}):
        for key in CONFIG_KEYS[what]:
            node: Any = level
            for part in key.split("."):
                node = node.get(part) if isinstance(node, Mapping) else None
            if node is not None:
                return key, node
    return None, None


def config_quant_method(config: Mapping[str, Any]) -> Optional[str]:
    """The quantization method a ``config.json`` records (``quantization_config.quant_method``, top level or
    ``text_config``) when it is one the engine profiles key rules on (:data:`fimoe_lab.engines.QUANT_METHODS`, the
    :attr:`Convention.quant_method` of the conventions its writers write); None otherwise (unquantized, or a method
    no rule names)."""
    text = config.get("text_config")
    for level in (config, text if isinstance(text, Mapping) else {}):
        q = level.get("quantization_config")
        if isinstance(q, Mapping) and str(q.get("quant_method", "")).lower() in QUANT_METHODS:
            return str(q["quant_method"]).lower()
    return None


CHECKPOINT_FORMATS: dict[str, FormatSpec] = {
    f.name: f
    for f in (
        FormatSpec(
            "int4-group",
            "INT4 (q + 8 packed, two per byte) with a BF16 scale per 32 values (compressed-tensors pack-quantized)",
            "uint8",
            values_per_byte=2,
            scale_dtype="bfloat16",
            scale_block=32,
            vector_scaled=True,
            bits_per_weight=4.0 + 16 / 32,
            backends=("trtllm",),
            layout_format="mxint4",
            weights=False,
        ),
        FormatSpec(
            "fp8-channel",
            "FP8 E4M3 with one float32 scale per output channel (compressed-tensors strategy channel)",
            "float8_e4m3fn",
            scale_dtype="float32",
            bits_per_weight=8.0,
            backends=(),
            weights=False,
        ),
    )
}
"""Formats checkpoints store that :data:`fimoe_lab.specs.FORMATS` has no layout for: read,
inspected and restored byte-exact; ``convert`` lays one out only where ``layout_format`` names a format of
``specs.FORMATS`` (int4-group -> ``mxint4``, TRT-LLM; with :data:`WEIGHT_XOR`), and refuses the rest
(:data:`MISSING_LAYOUT` says what is missing)."""

WEIGHT_XOR: dict[str, int] = {"int4-group": 0x88}
"""Checkpoint formats whose weight bytes differ from their ``layout_format``'s by a constant XOR, applied to
every weight byte (not the scales) before the layout steps, and again after the inverse by ``restore`` (an
XOR is its own inverse). int4-group stores each 4-bit value as ``q + 8`` (compressed-tensors ``uint4b8``,
``q`` in [-8, 7]); MxInt4 kernels read ``q`` in two's complement, ``(q + 8) mod 16 XOR 8 = q mod 16``, so
each nibble XOR 8, each byte XOR 0x88 (vLLM 0.34 does the same nibble by nibble:
``convert_packed_uint4b8_to_signed_int4_inplace`` inside ``prepare_static_weights_for_trtllm_mxint4_moe``)."""

MISSING_LAYOUT: dict[str, dict[str, str]] = {
    "int4-group": {
        "cutlass": "no W4A16 (INT4, a BF16 scale per 32) MoE layout for CUTLASS in fimoe_lab: FlashInfer's CUTLASS "
        "INT4 MoE is W4A8 (use_w4_group_scaling, FP8 activations) and is not laid out here; --backend trtllm "
        "takes it as MxInt4",
    },
    "fp8-channel": {
        backend: f"no FlashInfer {backend} kernel takes per-output-channel FP8 MoE weights (vLLM 0.34's FlashInfer "
        "CUTLASS and TRT-LLM experts take per-tensor, 128x128-block and MXFP8 scales only; it runs such layers on "
        "Triton or its own CUTLASS)"
        for backend in ("trtllm", "cutlass")
    },
}
"""Per :data:`CHECKPOINT_FORMATS` entry and backend: the layout that is missing (what ``convert`` and
``inspect`` say)."""


def stored_format(name: str) -> FormatSpec:
    """The :class:`FormatSpec` of a checkpoint format: :data:`fimoe_lab.specs.FORMATS` or :data:`CHECKPOINT_FORMATS`."""
    if name in CHECKPOINT_FORMATS:
        return CHECKPOINT_FORMATS[name]
    try:
        return get_format(name)
    except FormatError:
        raise FormatError(
            f"unknown checkpoint format {name!r}", fix=f"choose one of {', '.join([*FORMATS, *CHECKPOINT_FORMATS])}"
        ) from None


@dataclass(frozen=True)
class Fused:
    """All experts of a layer in a few tensors (names relative to the convention's module).

    ``w13``: one name (gate and up in one tensor, ``gate_up`` ``stacked`` ``[gate; up]`` or
    ``interleaved`` ``g0, u0, g1, ...``) or two (gate, up). ``transposed``: stored input
    dimension first (``(E, H, 2I)`` / ``(E, I, H)``). ``flat``: experts flattened into the
    rows (``(E*I, H)`` each, DBRX; its down is stored transposed). ``scales``/``biases``:
    MXFP4 block scales and per-row biases (gpt-oss), names for w13 and w2; ``blocks``: the
    weights are ``(E, rows, cols/32, 16)`` MXFP4 blocks.
    """

    w13: tuple[str, ...]
    w2: str
    gate_up: str = "stacked"
    transposed: bool = False
    flat: bool = False
    blocks: bool = False
    scales: Optional[tuple[str, str]] = None
    biases: Optional[tuple[str, str]] = None


@dataclass(frozen=True)
class Convention:
    """One naming convention for a MoE layer's expert tensors.

    Names are ``{base}.{module}.{e}.{proj}.{suffix}`` per expert (``projections`` = module
    names of gate, up, down; gate None for a non-gated activation) or ``{base}.{module}.{name}``
    for a :class:`Fused` layout; ``base`` is the layer's own path (``model.layers.3``,
    ``mtp.layers.0``). ``fmt`` a format of :func:`stored_format`; ``weight_suffix`` /
    ``scale_suffix`` the per-projection tensor suffixes; ``scales``: ``block`` (the format's
    block scales), ``row`` (one per output row, ``(rows, 1)``) or ``tensor`` (one scalar per
    projection, stacked ``(E, 2)`` / ``(E,)``); ``stored_scale``/``stored_weight``: the
    safetensors dtype names when the file's differ from the format's (BF16 block scales,
    read as float32, exact; int4 as I32, read as its bytes). ``scalar_extras``: float32
    scalars beside each projection, stacked as extras ``w13_<name>`` ``(E, 2)`` and
    ``w2_<name>`` ``(E,)``; ``scalar_shape``: the stored shape of such scalars and of tensor
    scales (ModelOpt ``()``, compressed-tensors ``(1,)``). ``activation``: a
    :data:`fimoe_lab.specs.ACTIVATIONS` name or alias. ``quant_method``: the
    ``quantization_config.quant_method`` its writers record (a key of
    :data:`fimoe_lab.engines.QUANT_METHODS`; None: unquantized), which engine profiles key some rules on.

    ``writer_dtypes``: ``(role, (dtype, ...))`` for the roles whose safetensors dtype depends on the writer's
    run, the first being this entry's own (``scale``: ``stored_scale``; ``shape``: ``stored_shape``, the dtype of
    compressed-tensors' ``weight_shape``; ``scalars``: ``stored_scalar``, of the scalar extras). The reader
    accepts every combination (:meth:`variants`) and widens to the stacked dtype exactly; a variant's name
    records the file's dtypes (``ct-fp8-block:scale=BF16``), so ``restore`` writes back what it read.
    """

    name: str
    models: str
    fmt: str
    module: str
    projections: Optional[tuple[Optional[str], str, str]]
    scale_suffix: Optional[str] = None
    gate_up_order: str = "[gate_proj; up_proj]"
    activation: str = "silu"
    router: tuple[str, ...] = ("gate.weight",)
    scalar_extras: tuple[str, ...] = ()
    weight_suffix: str = "weight"
    scales: str = "block"
    stored_scale: Optional[str] = None
    stored_weight: Optional[str] = None
    shape_suffix: Optional[str] = None
    fused_layout: Optional[Fused] = None
    scalar_shape: tuple[int, ...] = ()
    quant_method: Optional[str] = None
    writer_dtypes: tuple[tuple[str, tuple[str, ...]], ...] = ()
    stored_shape: str = "I32"
    stored_scalar: str = "F32"

    @property
    def block(self) -> str:
        """The layer's MoE block module (``mlp``, ``block_sparse_moe``, ``ffn``, ...); routers are under it."""
        return self.module.split(".")[0]

    @property
    def fused(self) -> bool:
        return self.projections is None

    @property
    def gated(self) -> bool:
        return self.fused or self.projections[0] is not None  # type: ignore[index]

    @property
    def spec(self) -> FormatSpec:
        return stored_format(self.fmt)

    @property
    def missing_layout(self) -> dict[str, str]:
        """Per backend, the layout ``convert`` lacks for this format (empty when it has both)."""
        return MISSING_LAYOUT.get(self.fmt, {})

    @property
    def weight_dtype(self) -> torch.dtype:
        """Stacked weight dtype (the format's ``storage``; packed 4-bit is uint8)."""
        return torch_dtype(self.spec.storage)

    @property
    def file_weight_dtype(self) -> torch.dtype:
        """Weight dtype in the file (``stored_weight`` or the stacked one)."""
        return SAFETENSORS_DTYPES[self.stored_weight] if self.stored_weight else self.weight_dtype

    @property
    def file_shape_dtype(self) -> torch.dtype:
        """Dtype of the ``shape_suffix`` tensors in the file."""
        return SAFETENSORS_DTYPES[self.stored_shape]

    @property
    def file_scalar_dtype(self) -> torch.dtype:
        """Dtype of the scalar extras (and of tensor scales' companions) in the file; stacked as float32."""
        return SAFETENSORS_DTYPES[self.stored_scalar]

    def variants(self) -> list[Convention]:
        """This convention with each combination of its ``writer_dtypes`` (this entry first)."""
        roles = [role for role, _ in self.writer_dtypes]
        out = []
        for combo in itertools.product(*(options for _, options in self.writer_dtypes)):
            out.append(self.with_dtypes(dict(zip(roles, combo))))
        return out or [self]

    def with_dtypes(self, chosen: Mapping[str, str]) -> Convention:
        """The variant storing role ``r`` as ``chosen[r]`` (roles and dtypes from ``writer_dtypes``)."""
        options = dict(self.writer_dtypes)
        for role, dtype in chosen.items():
            if dtype not in options.get(role, ()):
                known = ", ".join(f"{r} " + "/".join(o) for r, o in self.writer_dtypes) or "none"
                raise CheckpointError(
                    f"convention {self.name}: no writer stores its {role} as {dtype}", fix=f"known: {known}"
                )
        differ = {r: d for r, d in chosen.items() if d != options[r][0]}
        if not differ:
            return self
        fields = {_ROLE_FIELDS[r]: d for r, d in chosen.items()}
        name = f"{self.name}:" + ",".join(f"{r}={d}" for r, d in differ.items())
        return replace(self, name=name, **fields)

    @property
    def scale_dtype(self) -> Optional[torch.dtype]:
        """Stacked scale dtype (the format's ``scale_dtype``), None without scales."""
        if self.scale_suffix is None and not (self.fused_layout and self.fused_layout.scales):
            return None
        name = self.spec.scale_dtype
        return torch_dtype(name) if name else None

    @property
    def file_scale_dtype(self) -> Optional[torch.dtype]:
        """Scale dtype in the file (``stored_scale`` or the stacked one)."""
        return SAFETENSORS_DTYPES[self.stored_scale] if self.stored_scale else self.scale_dtype

    @property
    def intermediate_keys(self) -> tuple[str, ...]:
        return CONFIG_KEYS["intermediate"]

    @property
    def expert_keys(self) -> tuple[str, ...]:
        return CONFIG_KEYS["experts"]

    @property
    def top_k_keys(self) -> tuple[str, ...]:
        return CONFIG_KEYS["top_k"]

    # ------------------------------------------------------------------ names
    def expert_key(
        self, prefix: str, layer: int, expert: int, proj: int, suffix: Optional[str] = None, base: Optional[str] = None
    ) -> str:
        """Name of projection ``proj`` (0 gate, 1 up, 2 down) of one expert (per-expert conventions);
        ``base`` (the layer's path) defaults to ``{prefix}{layer}``; ``suffix`` to ``weight_suffix``."""
        return (
            f"{base or f'{prefix}{layer}'}.{self.module}.{expert}.{self.projections[proj]}."  # type: ignore[index]
            f"{suffix or self.weight_suffix}"
        )

    def fused_key(self, prefix: str, layer: int, name: str, base: Optional[str] = None) -> str:
        """Name of a fused all-experts tensor, e.g. ``gate_up_proj_blocks``."""
        return f"{base or f'{prefix}{layer}'}.{self.module}.{name}"

    def signature(self, base: str) -> dict[str, Optional[torch.dtype]]:
        """Tensors (name -> file dtype, None = must be absent) whose presence identifies this convention
        (conventions with the same names and dtypes, FP8 block/row/tensor scales, are told apart by
        the scale's shape: ``Checkpoint._scale_kind_ok``)."""
        if self.fused_layout is not None:
            f = self.fused_layout
            sig: dict[str, Optional[torch.dtype]] = {
                self.fused_key("", 0, n, base): self.file_weight_dtype for n in (*f.w13, f.w2)
            }
            if f.scales:
                sig[self.fused_key("", 0, f.scales[0], base)] = self.file_scale_dtype
            return sig
        proj = 0 if self.gated else 1
        key = lambda suffix: self.expert_key("", 0, 0, proj, suffix, base)  # noqa: E731
        sig = {key(self.weight_suffix): self.file_weight_dtype}
        for suffix in ("weight", "weight_packed"):
            if suffix != self.weight_suffix:
                sig[key(suffix)] = None
        for suffix in ("weight_scale_inv", "weight_scale"):
            sig[key(suffix)] = self.file_scale_dtype if suffix == self.scale_suffix else None
        if self.shape_suffix:
            sig[key(self.shape_suffix)] = self.file_shape_dtype
        for extra in ("weight_scale_2", "weight_global_scale", "input_scale"):
            if key(extra) not in sig:
                sig[key(extra)] = self.file_scalar_dtype if extra in self.scalar_extras else None
        return sig

    def pattern(self) -> str:
        """The expert-0 gate (or up) tensor name with placeholders, for error messages."""
        if self.fused_layout is not None:
            names = ", ".join((*self.fused_layout.w13, self.fused_layout.w2))
            return f"{{base}}.{self.module}.{{{names}}} ({dtype_name(self.file_weight_dtype)})"
        proj = self.projections[0] or self.projections[1]  # type: ignore[index]
        scale = f" + .{self.scale_suffix} ({dtype_name(self.file_scale_dtype)})" if self.scale_suffix else ""
        return f"{{base}}.{self.module}.{{e}}.{proj}.{self.weight_suffix} ({dtype_name(self.file_weight_dtype)}){scale}"

    # ------------------------------------------------------------------ writing
    def to_tensors(self, prefix: str, layer: int, moe: Any, base: Optional[str] = None) -> dict[str, torch.Tensor]:
        """The checkpoint tensors of one stacked layer (a :class:`~fimoe_lab.checkpoints.reader.MoELayer`).

        Inverse of the reader, byte for byte: splits ``w13`` rows into gate and up (or
        re-interleaves / transposes / flattens them for a fused layout), one tensor per
        expert and projection, plus scales (back in their stored dtype) and extras.
        ``base``: the layer's path (default ``{prefix}{layer}``; MTP layers have their own).
        """
        base = base or f"{prefix}{layer}"
        if self.fused_layout is not None:
            return self._fused_tensors(base, moe)
        e_count, i, p = moe.num_experts, moe.intermediate, 2 if self.gated else 1
        out: dict[str, torch.Tensor] = {}
        s13, s2 = moe.w13_scale, moe.w2_scale
        s_rows = s13.shape[1] // p if s13 is not None and s13.dim() == 3 else 0
        for e in range(e_count):
            parts = []
            for proj in range(2 - p, 2):
                k = proj - (2 - p)
                scale = None
                if s13 is not None:
                    scale = s13[e, k] if s13.dim() == 2 else s13[e, k * s_rows : (k + 1) * s_rows]
                parts.append((proj, moe.w13[e, k * i : (k + 1) * i], scale))
            parts.append((2, moe.w2[e], s2[e] if s2 is not None else None))
            for proj, w, s in parts:
                out[self.expert_key(prefix, layer, e, proj, base=base)] = self._file_weight(w)
                if s is not None:
                    out[self.expert_key(prefix, layer, e, proj, self.scale_suffix, base)] = self._file_scale(s)
                if self.shape_suffix:
                    rows, cols = w.shape[0], w.shape[1] * self.spec.values_per_byte
                    out[self.expert_key(prefix, layer, e, proj, self.shape_suffix, base)] = torch.tensor(
                        [rows, cols], dtype=self.file_shape_dtype
                    )
                for extra in self.scalar_extras:
                    stacked = moe.extras.get(f"{'w13' if proj < 2 else 'w2'}_{extra}")
                    if stacked is not None:
                        val = stacked[e, proj - (2 - p)] if proj < 2 and stacked.dim() == 2 else stacked[e]
                        out[self.expert_key(prefix, layer, e, proj, extra, base)] = (
                            val.reshape(self.scalar_shape).to(self.file_scalar_dtype).clone()
                        )
        return out

    def _file_weight(self, w: torch.Tensor) -> torch.Tensor:
        w = w.contiguous()
        return w.view(self.file_weight_dtype) if self.stored_weight else w

    def _file_scale(self, s: torch.Tensor) -> torch.Tensor:
        s = s.contiguous()
        if self.scales == "tensor":
            s = s.reshape(self.scalar_shape)
        return s.to(self.file_scale_dtype) if self.stored_scale else s

    def _fused_tensors(self, base: str, moe: Any) -> dict[str, torch.Tensor]:
        f, e_count, i, h = self.fused_layout, moe.num_experts, moe.intermediate, moe.hidden
        assert f is not None
        key = lambda n: f"{base}.{self.module}.{n}"  # noqa: E731

        def interleave(x: torch.Tensor) -> torch.Tensor:  # [gate; up] rows -> g0, u0, g1, u1, ...
            out = x.new_empty(x.shape)  # (slice copies, not torch.stack: shape-only meta layers stay cheap)
            out[:, 0::2], out[:, 1::2] = x[:, :i], x[:, i:]
            return out

        out: dict[str, torch.Tensor] = {}
        if f.blocks:
            spec = self.spec
            b, bb = spec.scale_block, spec.scale_block // spec.values_per_byte  # values and bytes per block
            out[key(f.w13[0])] = interleave(moe.w13).reshape(e_count, 2 * i, h // b, bb)
            out[key(f.w2)] = moe.w2.reshape(e_count, h, i // b, bb).contiguous()
            assert f.scales is not None
            out[key(f.scales[0])] = interleave(moe.w13_scale)
            out[key(f.scales[1])] = moe.w2_scale.contiguous()
            if f.biases and "w13_bias" in moe.extras:
                out[key(f.biases[0])] = interleave(moe.extras["w13_bias"])
                out[key(f.biases[1])] = moe.extras["w2_bias"].contiguous()
            return out
        gate, up = moe.w13[:, :i], moe.w13[:, i:]
        if f.flat:  # (E*I, H) each; down stored as (E, I, H) = down transposed
            out[key(f.w13[0])] = gate.reshape(e_count * i, h).contiguous()
            out[key(f.w13[1])] = up.reshape(e_count * i, h).contiguous()
            out[key(f.w2)] = moe.w2.transpose(1, 2).reshape(e_count * i, h).contiguous()
        elif f.transposed:
            out[key(f.w13[0])] = moe.w13.transpose(1, 2).contiguous()
            out[key(f.w2)] = moe.w2.transpose(1, 2).contiguous()
        else:
            out[key(f.w13[0])] = moe.w13.contiguous()
            out[key(f.w2)] = moe.w2.contiguous()
        return out


_GUD = ("gate_proj", "up_proj", "down_proj")
_W132 = ("w1", "w3", "w2")
_DS_ROUTER = ("gate.weight", "gate.e_score_correction_bias")
_MIXTRAL = "[w1 (gate); w3 (up)]"
_ROLE_FIELDS = {"scale": "stored_scale", "shape": "stored_shape", "scalars": "stored_scalar"}
"""The :class:`Convention` field each ``writer_dtypes`` role sets."""

_FLOATS = ("F32", "BF16", "F16")
"""compressed-tensors' scale dtypes: the dtype of the weight it observed (the model's, float16 / bfloat16 /
float32; ``initialize_qparams``, ``scale_dtype = observed_dtype``), E4M3 for FP4 (fixed, not listed)."""


CONVENTIONS: tuple[Convention, ...] = (
    Convention(
        "deepseek-fp8",
        "DeepSeek-V3/R1, Kimi-K2, GLM-4.5 FP8-block (FP8 128x128 float32 weight_scale_inv)",
        "fp8-block",
        "mlp.experts",
        _GUD,
        "weight_scale_inv",
        router=_DS_ROUTER,
        quant_method="fp8",
    ),
    Convention(
        "qwen3-fp8",
        "Qwen3 FP8 releases (FP8 128x128 BF16 weight_scale_inv)",
        "fp8-block",
        "mlp.experts",
        _GUD,
        "weight_scale_inv",
        stored_scale="BF16",
        quant_method="fp8",
    ),
    Convention(
        "minimax-fp8",
        "MiniMax-M2 (block_sparse_moe w1/w3/w2, FP8 128x128 float32 weight_scale_inv)",
        "fp8-block",
        "block_sparse_moe.experts",
        _W132,
        "weight_scale_inv",
        _MIXTRAL,
        router=("gate.weight", "e_score_correction_bias"),
        quant_method="fp8",
    ),
    Convention(
        "ct-fp8-block",
        "compressed-tensors FP8 block (weight + weight_scale per 128x128, F32/BF16/F16 as the model)",
        "fp8-block",
        "mlp.experts",
        _GUD,
        "weight_scale",
        quant_method="compressed-tensors",
        writer_dtypes=(("scale", _FLOATS),),
    ),
    Convention(
        "ct-fp8-channel",
        "compressed-tensors FP8 per channel (GLM-4.5 FP8: weight + weight_scale (out, 1), F32/BF16/F16 as the model)",
        "fp8-channel",
        "mlp.experts",
        _GUD,
        "weight_scale",
        router=_DS_ROUTER,
        scales="row",
        quant_method="compressed-tensors",
        writer_dtypes=(("scale", _FLOATS),),
    ),
    Convention(
        "ct-nvfp4",
        "compressed-tensors NVFP4 (weight_packed, weight_scale, weight_global_scale, input_global_scale)",
        "nvfp4",
        "mlp.experts",
        _GUD,
        "weight_scale",
        scalar_extras=("weight_global_scale", "input_global_scale"),
        weight_suffix="weight_packed",
        scalar_shape=(1,),
        quant_method="compressed-tensors",
    ),
    Convention(
        "ct-fp8-tensor",
        "compressed-tensors FP8 per tensor, static (weight_scale and input_scale of shape (1,) per projection)",
        "fp8",
        "mlp.experts",
        _GUD,
        "weight_scale",
        scalar_extras=("input_scale",),
        scales="tensor",
        scalar_shape=(1,),
        quant_method="compressed-tensors",
        writer_dtypes=(("scale", _FLOATS), ("scalars", _FLOATS)),
    ),
    Convention(
        "ct-int4",
        "compressed-tensors INT4 pack-quantized, group 32 (Kimi-K2-Thinking: weight_packed I32, weight_scale, weight_shape I64/I32)",
        "int4-group",
        "mlp.experts",
        _GUD,
        "weight_scale",
        router=_DS_ROUTER,
        weight_suffix="weight_packed",
        stored_weight="I32",
        shape_suffix="weight_shape",
        quant_method="compressed-tensors",
        writer_dtypes=(("shape", ("I32", "I64")),),
    ),
    Convention(
        "modelopt-nvfp4",
        "ModelOpt NVFP4 exports (nvidia/DeepSeek-R1-FP4, Qwen3 FP4, ...)",
        "nvfp4",
        "mlp.experts",
        _GUD,
        "weight_scale",
        router=_DS_ROUTER,
        scalar_extras=("weight_scale_2", "input_scale"),
        quant_method="modelopt",
    ),
    Convention(
        "modelopt-fp8",
        "ModelOpt FP8 per-tensor (weight_scale and input_scale scalars per projection)",
        "fp8",
        "mlp.experts",
        _GUD,
        "weight_scale",
        scalar_extras=("input_scale",),
        scales="tensor",
        quant_method="modelopt",
    ),
    Convention(
        "qwen3-moe-bf16",
        "Qwen3-MoE, Qwen3-Next, OLMoE, ERNIE-4.5, Hunyuan-A13B, GLM-4.5 (per-expert gate_proj/up_proj/down_proj BF16)",
        "bf16",
        "mlp.experts",
        _GUD,
    ),
    Convention("mixtral-bf16", "Mixtral (block_sparse_moe w1/w3/w2, BF16)", "bf16", "block_sparse_moe.experts", _W132),
    Convention(
        "nemotron-h-bf16",
        "Nemotron-3 / Nemotron-H (mixer.experts up_proj/down_proj, ReLU^2, no gate)",
        "bf16",
        "mixer.experts",
        (None, "up_proj", "down_proj"),
        gate_up_order="up_proj only (non-gated)",
        activation="relu2",
        router=_DS_ROUTER,
    ),
    Convention(
        "granite-bf16",
        "Granite-MoE (fused input_linear [gate; up] / output_linear)",
        "bf16",
        "block_sparse_moe",
        None,
        gate_up_order="input_linear rows [gate; up]",
        router=("router.layer.weight",),
        fused_layout=Fused(("input_linear.weight",), "output_linear.weight"),
    ),
    Convention(
        "llama4-bf16",
        "Llama-4 (fused feed_forward.experts gate_up_proj (E, H, 2I), transposed)",
        "bf16",
        "feed_forward.experts",
        None,
        gate_up_order="gate_up_proj columns [gate | up], stored (E, H, 2I)",
        router=("router.weight",),
        fused_layout=Fused(("gate_up_proj",), "down_proj", transposed=True),
    ),
    Convention(
        "qwen3-vl-bf16",
        "Qwen3-VL-MoE (fused mlp.experts gate_up_proj (E, H, 2I) under model.language_model)",
        "bf16",
        "mlp.experts",
        None,
        gate_up_order="gate_up_proj columns [gate | up], stored (E, H, 2I)",
        fused_layout=Fused(("gate_up_proj",), "down_proj", transposed=True),
    ),
    Convention(
        "dbrx-bf16",
        "DBRX (ffn.experts.mlp w1/v1/w2, each (E*I, H), w2 transposed)",
        "bf16",
        "ffn.experts.mlp",
        None,
        gate_up_order="[w1 (gate); v1 (up)]",
        router=("router.layer.weight",),
        fused_layout=Fused(("w1", "v1"), "w2", flat=True),
    ),
    Convention(
        "gpt-oss-mxfp4",
        "gpt-oss (fused MXFP4 blocks/scales, interleaved gate/up)",
        "mxfp4",
        "mlp.experts",
        None,
        gate_up_order="interleaved rows g0,u0,g1,u1,... (de-interleaved to [gate; up] on read)",
        activation="swiglu_oai",
        router=("router.weight", "router.bias"),
        fused_layout=Fused(
            ("gate_up_proj_blocks",),
            "down_proj_blocks",
            "interleaved",
            blocks=True,
            scales=("gate_up_proj_scales", "down_proj_scales"),
            biases=("gate_up_proj_bias", "down_proj_bias"),
        ),
        quant_method="mxfp4",
    ),
    Convention(
        "gpt-oss-original",
        "gpt-oss original/ files (block.{L}.mlp.mlp1_weight/mlp2_weight blocks and scales, interleaved)",
        "mxfp4",
        "mlp",
        None,
        gate_up_order="interleaved rows g0,u0,g1,u1,... (de-interleaved to [gate; up] on read)",
        activation="swiglu_oai",
        router=("gate.weight", "gate.bias"),
        fused_layout=Fused(
            ("mlp1_weight.blocks",),
            "mlp2_weight.blocks",
            "interleaved",
            blocks=True,
            scales=("mlp1_weight.scales", "mlp2_weight.scales"),
            biases=("mlp1_bias", "mlp2_bias"),
        ),
        quant_method="mxfp4",
    ),
)


def quant_method(name: Optional[str]) -> Optional[str]:
    """The quantization method of the convention called ``name`` (a variant's name too); None for an unquantized
    convention or a name that is no convention (layers made in memory: the lab's ``seeded``)."""
    base = (name or "").partition(":")[0]
    return next((c.quant_method for c in CONVENTIONS if c.name == base), None)


def get(name: str) -> Convention:
    """The convention called ``name`` (a variant's name, ``base:role=DTYPE,...``, gives that variant);
    :class:`CheckpointError` listing the known ones otherwise."""
    base, _, chosen = name.partition(":")
    for c in CONVENTIONS:
        if c.name == base:
            if not chosen:
                return c
            pairs = [part.partition("=") for part in chosen.split(",")]
            return c.with_dtypes({role: dtype for role, _, dtype in pairs})
    raise CheckpointError(
        f"unknown checkpoint convention {name!r}", fix=f"choose one of {', '.join(c.name for c in CONVENTIONS)}"
    )
