"""The tables every consumer reads: formats, activations, backends, weight layouts.

One row per fact. ``plan``, ``convert``, ``inspect``, the tuner and the lab take their
choices, dtypes, scale blocks and FlashInfer enum names from here; nothing else spells
them. This module imports no torch or numpy (the CLI builds its ``--help`` from it);
dtypes are named as strings and resolved with :func:`torch_dtype` when torch is loaded.

Adding a format: one :class:`FormatSpec` row here, its quantizer module under
``fimoe_lab/formats/`` (named by ``codec``), its layout recipe in
``fimoe_lab/recipes.py`` and, if checkpoints store it in a new way, a convention in
``fimoe_lab/checkpoints/conventions.py`` (docs/design.md walks through it).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Optional

from fimoe_lab.errors import FormatError

__all__ = [
    "BACKENDS",
    "LAYOUTS",
    "FORMATS",
    "ACTIVATIONS",
    "Activation",
    "FormatSpec",
    "TacticEnums",
    "get_format",
    "get_activation",
    "check_backend",
    "weight_formats",
    "tuner_formats",
    "torch_dtype",
]

BACKENDS: tuple[str, ...] = ("trtllm", "cutlass")
"""FlashInfer fused-MoE backends: TRTLLM-Gen (Blackwell) and CUTLASS (Hopper and Blackwell)."""

LAYOUTS: dict[str, str] = {"major-k": "MajorK", "block-major-k": "BlockMajorK"}
"""Weight layouts of the TRTLLM-Gen kernels: fimoe_lab name -> FlashInfer ``WeightLayout`` member."""


@dataclass(frozen=True)
class TacticEnums:
    """How a format reaches TRTLLM-Gen's tactic query (FlashInfer enum member *names*).

    ``(dtype_act, dtype_weights, fp8_quantization_type)`` as FlashInfer's MoE entry points
    build their runners; ``default_layout`` is the weight layout its entry point uses;
    ``per_token_ok``: per-token activation scaling exists (NVFP4 only).
    """

    dtype_act: str
    dtype_weights: str
    fp8_quantization_type: str
    default_layout: str
    per_token_ok: bool = False


@dataclass(frozen=True)
class FormatSpec:
    """One format: what its stored tensors are and which consumers take it.

    Attributes:
        name: the name used everywhere (CLI, files, tuner).
        description: one line for ``--help`` and tables.
        storage: torch dtype name of stored weights (``uint8`` for packed FP4).
        values_per_byte: 2 for packed FP4 (E2M1 pairs), else 1.
        scale_dtype: torch dtype name of block scales, ``None`` for none/per-tensor only.
        scale_block: values along the last dim that share one scale (0: per tensor or none).
        scale_block_rows: rows that share one scale (128 for DeepSeek 128x128 blocks, else 1).
        vector_scaled: one scale per ``scale_block`` values of each row, so the scales
            follow their weight's rows (MXFP8, NVFP4, MXFP4).
        bits_per_weight: stored bits per weight value, block scales included.
        backends: FlashInfer backends that take it.
        layout_format: the weight format whose layout recipe applies (``mxfp4`` for
            MXFP4 weights with MXFP8 activations).
        codec: module under ``fimoe_lab.formats`` with ``quantize``/``dequantize``, or None.
        scale_fill: byte written into padded scales (127 = UE8M0 1.0 for MXFP8 TRT-LLM).
        tactics: enums of the TRTLLM-Gen tactic query, None when the tuner does not take it.
        weights: a checkpoint weight format (``plan``/``convert`` take it); activation-only
            quantizers (NVFP4 per-token) are not.
        tactic_intermediate_multiple: the per-rank intermediate multiple at which the
            TRTLLM-Gen kernel set offers its full tactic space (gated; measured with
            FlashInfer 0.6.13's kernels): fewer or zero tactics below it. 0: not measured.
        kernel_activations: FlashInfer ``ActivationType`` members (:attr:`Activation.flashinfer`) that the
            format's MoE kernels run on every backend of ``backends``; empty: every activation the backend
            takes. MxInt4: ``("Swiglu",)`` (the TRTLLM-Gen MxInt4 runner always runs SwiGLU; alpha, beta and
            the clamp limit of gpt-oss's variant are its arguments). Read by ``shapes.check_kernel_activation``.
    """

    name: str
    description: str
    storage: str
    values_per_byte: int = 1
    scale_dtype: Optional[str] = None
    scale_block: int = 0
    scale_block_rows: int = 1
    vector_scaled: bool = False
    bits_per_weight: float = 8.0
    backends: tuple[str, ...] = BACKENDS
    layout_format: str = ""
    codec: Optional[str] = None
    scale_fill: int = 0
    tactics: Optional[TacticEnums] = None
    weights: bool = True
    tactic_intermediate_multiple: int = 0
    kernel_activations: tuple[str, ...] = ()

    @property
    def plan_format(self) -> str:
        """The format whose layout recipe applies (itself unless an alias)."""
        return self.layout_format or self.name

    @property
    def packed(self) -> bool:
        return self.values_per_byte == 2

    @property
    def block_size(self) -> int:
        """Values per scale along the last dim (0: one per tensor)."""
        return self.scale_block

    @property
    def itemsize(self) -> int:
        """Bytes per stored weight element."""
        return _ITEMSIZE[self.storage]

    @property
    def scale_itemsize(self) -> int:
        """Bytes per stored scale element (0 without block scales)."""
        return _ITEMSIZE[self.scale_dtype] if self.scale_dtype else 0

    def _codec(self) -> Any:
        if self.codec is None:
            raise FormatError(
                f"format {self.name!r} has no quantizer", fix=f"quantize to one of {', '.join(codec_names())}"
            )
        return importlib.import_module(f"fimoe_lab.formats.{self.codec}")

    @property
    def quantize(self) -> Callable[..., Any]:
        """``quantize(x) -> QuantizedTensor`` (imports torch)."""
        return self._codec().quantize  # type: ignore[no-any-return]

    @property
    def dequantize(self) -> Callable[..., Any]:
        """``dequantize(q, dtype=torch.float32) -> Tensor`` (imports torch)."""
        return self._codec().dequantize  # type: ignore[no-any-return]

    @property
    def max_abs_per_byte(self) -> Callable[..., Any]:
        """Packed formats: ``max_abs_per_byte(q) -> Tensor``, per byte the larger ``|value|`` of its two
        (``dequantize(q).abs()`` max-reduced over pairs, without unpacking; imports torch)."""
        return self._codec().max_abs_per_byte  # type: ignore[no-any-return]


_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "uint8": 1, "int32": 4}

_NVFP4 = FormatSpec(
    "nvfp4",
    "NVFP4: E2M1 pairs with an E4M3 scale per 16 values, NVFP4 activations",
    "uint8",
    values_per_byte=2,
    scale_dtype="float8_e4m3fn",
    scale_block=16,
    vector_scaled=True,
    bits_per_weight=4.0 + 8 / 16,
    codec="nvfp4",
    tactic_intermediate_multiple=64,
    tactics=TacticEnums("E2m1", "E2m1", "NoneFp8", "major-k", per_token_ok=True),
)

_MXFP4 = FormatSpec(
    "mxfp4",
    "MXFP4 weights (E2M1, UE8M0 per 32) with BF16 activations (gpt-oss)",
    "uint8",
    values_per_byte=2,
    scale_dtype="uint8",
    scale_block=32,
    vector_scaled=True,
    bits_per_weight=4.0 + 8 / 32,
    codec="mxfp4",
    tactic_intermediate_multiple=128,
    tactics=TacticEnums("Bfloat16", "MxE2m1", "NoneFp8", "major-k"),
)

FORMATS: dict[str, FormatSpec] = {
    f.name: f
    for f in (
        FormatSpec(
            "bf16",
            "BF16 weights and activations (trtllm_bf16_moe)",
            "bfloat16",
            bits_per_weight=16.0,
            tactic_intermediate_multiple=64,
            tactics=TacticEnums("Bfloat16", "Bfloat16", "NoneFp8", "block-major-k"),
        ),
        FormatSpec(
            "fp8",
            "FP8 E4M3 with per-tensor scales; gated activations only on TRT-LLM",
            "float8_e4m3fn",
            scale_dtype="float32",
            codec="fp8",
            tactic_intermediate_multiple=64,
            tactics=TacticEnums("E4m3", "E4m3", "NoneFp8", "major-k"),
        ),
        FormatSpec(
            "fp8-block",
            "FP8 E4M3 with 128x128 float32 block scales (DeepSeek); SwiGLU only",
            "float8_e4m3fn",
            scale_dtype="float32",
            scale_block=128,
            scale_block_rows=128,
            bits_per_weight=8.0 + 32 / (128 * 128),
            codec="fp8_block",
            tactic_intermediate_multiple=128,
            tactics=TacticEnums("E4m3", "E4m3", "DeepSeekFp8", "block-major-k"),
        ),
        FormatSpec(
            "mxfp8",
            "MXFP8: E4M3 with a UE8M0 scale per 32 values",
            "float8_e4m3fn",
            scale_dtype="uint8",
            scale_block=32,
            vector_scaled=True,
            bits_per_weight=8.0 + 8 / 32,
            codec="mxfp8",
            scale_fill=127,
            tactic_intermediate_multiple=128,
            tactics=TacticEnums("MxE4m3", "MxE4m3", "MxFp8", "major-k"),
        ),
        _NVFP4,
        _MXFP4,
        replace(
            _MXFP4,
            name="mxfp4-mxfp8",
            description="MXFP4 weights with MXFP8 activations",
            layout_format="mxfp4",
            codec=None,
            weights=False,
            tactic_intermediate_multiple=0,
            tactics=TacticEnums("MxE4m3", "MxE2m1", "NoneFp8", "major-k"),
        ),
        FormatSpec(
            "mxint4",
            "MxInt4: signed int4 pairs (two's complement) with a BF16 scale per 32 values, BF16 activations "
            "(TRT-LLM only; checkpoints store it as int4-group, q + 8)",
            "uint8",
            values_per_byte=2,
            scale_dtype="bfloat16",
            scale_block=32,
            vector_scaled=True,
            bits_per_weight=4.0 + 16 / 32,
            backends=("trtllm",),
            weights=False,  # laid out from int4-group checkpoints only (shapes.padded_shape has its own rule)
            tactics=TacticEnums("Bfloat16", "MxInt4", "NoneFp8", "block-major-k"),
            kernel_activations=("Swiglu",),
        ),
        replace(
            _NVFP4,
            name="nvfp4-per-token",
            description="NVFP4 activations with a per-token global scale (quantizer only)",
            codec="nvfp4_per_token",
            weights=False,
            backends=(),
            tactic_intermediate_multiple=0,
            tactics=None,
        ),
    )
}


def _unknown(what: str, value: object, known: Any) -> FormatError:
    return FormatError(f"unknown {what} {value!r}", fix=f"choose one of {', '.join(known)}")


def get_format(name: str) -> FormatSpec:
    """The :class:`FormatSpec` called ``name``; :class:`FormatError` listing the known names otherwise."""
    spec = FORMATS.get(str(name).strip().lower())
    if spec is None:
        raise _unknown("format", name, FORMATS)
    return spec


def weight_formats() -> tuple[str, ...]:
    """Checkpoint weight formats that ``plan`` and ``convert`` lay out."""
    return tuple(n for n, f in FORMATS.items() if f.weights)


def tuner_formats() -> tuple[str, ...]:
    """Formats the TRTLLM-Gen tactic oracle answers for."""
    return tuple(n for n, f in FORMATS.items() if f.tactics is not None)


def codec_names() -> tuple[str, ...]:
    """Formats with a quantizer (``fimoe_lab.formats.get(name).quantize``)."""
    return tuple(n for n, f in FORMATS.items() if f.codec)


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise _unknown("backend", backend, BACKENDS)
    return backend


def torch_dtype(name: str) -> Any:
    """The torch dtype called ``name`` (imports torch)."""
    import torch

    return getattr(torch, name)


# ----------------------------------------------------------------------------- activations
def _silu_and_mul(gate: Any, up: Any, params: dict[str, Any]) -> Any:
    import torch.nn.functional as F

    return F.silu(gate) * up


def _swiglu_oai(gate: Any, up: Any, params: dict[str, Any]) -> Any:
    """gpt-oss: gate clamped above at ``limit``, up to [-limit, limit], ``gate*sigmoid(alpha*gate)*(up+1)``."""
    import torch

    alpha, limit = params.get("alpha", 1.702), params.get("limit", 7.0)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1)


def _gelu_and_mul(gate: Any, up: Any, params: dict[str, Any]) -> Any:
    import torch.nn.functional as F

    return F.gelu(gate) * up


def _relu2(h: Any, _unused: Any, params: dict[str, Any]) -> Any:
    import torch.nn.functional as F

    return F.relu(h).square()


@dataclass(frozen=True)
class Activation:
    """One expert activation.

    Attributes:
        name: canonical name (CLI, files, tuner).
        gated: ``act(gate) * up``: W13 stacks two projections (``2I`` rows, act-and-mul),
            the TRT-LLM gated GEMM interleaves them; non-gated (ReLU^2) has one (``I`` rows).
        flashinfer: FlashInfer ``ActivationType`` member name.
        reference: ``f(gate, up, params)`` in float32 torch (``f(h, None, params)`` when not gated).
        aliases: other names checkpoints and engines use.
    """

    name: str
    gated: bool
    flashinfer: str
    reference: Callable[[Any, Any, dict[str, Any]], Any]
    aliases: tuple[str, ...] = ()

    @property
    def is_act_and_mul(self) -> bool:
        return self.gated

    @property
    def projections(self) -> int:
        """Stacked projections in W13: 2 (gate and up) or 1."""
        return 2 if self.gated else 1


ACTIVATIONS: dict[str, Activation] = {
    a.name: a
    for a in (
        Activation("swiglu", True, "Swiglu", _silu_and_mul, ("silu",)),
        Activation("swiglu_oai", True, "Swiglu", _swiglu_oai),
        Activation("geglu", True, "Geglu", _gelu_and_mul, ("gelu",)),
        Activation("relu2", False, "Relu2", _relu2),
    )
}


def get_activation(name: str) -> Activation:
    """The :class:`Activation` called ``name`` or one of its aliases."""
    key = str(name).strip().lower()
    for act in ACTIVATIONS.values():
        if key == act.name or key in act.aliases:
            return act
    raise _unknown("activation", name, ACTIVATIONS)
