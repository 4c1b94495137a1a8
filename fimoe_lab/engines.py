"""Engine profiles: what each inference engine's preparation code does by default, as data.

A profile names an engine and version and fixes every default in which the engines'
preparation of FlashInfer fused-MoE weights differs: the padding (alignments), the byte
written into padded block scales, the layout of CUTLASS FP4 block scales, the FlashInfer
version whose helpers it matches (signatures, permute-index cache keys). Recipes read the
profile (``recipes.default_alignments(..., engine=)``, ``recipes.plan_layer(..., engine=)``);
converted files record its name. Torch-free, like :mod:`fimoe_lab.specs` (the CLI builds its
``--engine`` choices from :data:`ENGINE_CHOICES`).

Sources (read from the published wheels and the engines' source; docs/design.md, "Engine
profiles"): vLLM 0.34.0 pins FlashInfer 0.7.3, SGLang 0.5.23 pins 0.7.2; FlashInfer 0.7.4
is the newest; 0.6.13 is the version the seed and the goldens come from. The vLLM and SGLang
profiles are checked byte for byte against those engines' own preparation code, run in their
environments (``tests/engine_oracles/``, ``tests/test_engine_parity_*.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Optional, TypeVar

from fimoe_lab.errors import FimoeError

_T = TypeVar("_T")

__all__ = [
    "Alignment",
    "KernelSizes",
    "ValueRule",
    "VALUES",
    "VLLM_MIN_BLOCK_SCALE",
    "VALUE_RULE_KINDS",
    "QUANT_METHODS",
    "EngineProfile",
    "ENGINES",
    "ENGINE_CHOICES",
    "DEFAULT_ENGINE",
    "LEGACY_ENGINE",
    "get_engine",
    "check_quant_method",
]


@dataclass(frozen=True)
class Alignment:
    """A profile's padding of one ``"format/backend"``, overriding the base table.

    ``intermediate``/``hidden``: the multiple to pad to (None: the base table's value);
    ``non_gated_intermediate``: the intermediate multiple of a non-gated layer (one projection)
    where it differs from ``intermediate`` (vLLM's CUTLASS NVFP4 pads a non-gated ``I`` to the
    128 rows of its swizzled scales);
    ``per_token_non_gated_hidden``: the hidden multiple when activations are NVFP4
    per-token quantised and the activation is not gated (vLLM's
    ``trtllm_nvfp4_hidden_alignment``: 512, because 256-aligned shapes left the default
    tactic without a config).
    """

    intermediate: Optional[int] = None
    hidden: Optional[int] = None
    non_gated_intermediate: Optional[int] = None
    per_token_non_gated_hidden: Optional[int] = None


@dataclass(frozen=True)
class KernelSizes:
    """Sizes a profile's preparation refuses instead of padding further.

    After the padding asked for (or the default), the intermediate size ``I`` must be a multiple of
    ``intermediate`` (``non_gated_intermediate`` for a non-gated activation, where given), the hidden size
    ``H`` of ``hidden`` and GEMM1's rows ``P * I`` (``P`` = 2 gated, 1 not) of ``gemm1_rows``; ``why`` says
    whose need it is (the helper that refuses, or the kernel an engine pads for), for the refusal's message.
    """

    intermediate: int = 1
    hidden: int = 1
    gemm1_rows: int = 1
    why: str = ""
    non_gated_intermediate: Optional[int] = None


VALUES = ("engine", "lossless")
"""What a plan does to values (``plan_layer(values=)``): ``engine``, every value rule of the profile, the engine's
bytes; ``lossless``, only the rules the kernel needs and only where it needs them (``EngineProfile.value_rule``)."""

VALUE_RULE_KINDS: dict[str, str] = {
    "fp8_requantize_max": "W13 requantized to one scale per expert, max(gate, up): each half dequantized with its own "
    "scale in float16, quantized again with the larger (vLLM 0.34, SGLang 0.5.23 FP8 per-tensor)",
    "clamp_block_scales": "every block scale below a floor raised to it (vLLM 0.34 DeepSeek FP8 block: 1e-10)",
}
"""What each value rule does (its arithmetic: :mod:`fimoe_lab.value_rules`)."""


@dataclass(frozen=True)
class ValueRule:
    """A rule of an engine that changes values, not only their places (the layout rules move bytes).

    ``kind``: a :data:`VALUE_RULE_KINDS` key. ``floor``: ``clamp_block_scales``' minimum. ``nan_to``:
    ``fp8_requantize_max``'s result for a NaN (the engines' clamps to +-448 differ there: vLLM's
    ``fminf(fmaxf(x, -448), 448)`` gives -448, SGLang's ``max(min(x, 448), -448)`` +448). ``tensors``: the
    layer tensors it changes (``w13``, ``w2``, ``w13_scale``, ``w2_scale``). ``source``: the engine's file:line.
    ``needed``: the kernel cannot take the checkpoint's values without it (FlashInfer's FP8 per-tensor MoE takes
    one W13 scale per expert), as opposed to an engine's workaround (the clamp, against NaN from FlashInfer's
    CUTLASS kernel on Hopper). ``where``: ``"all"`` (every expert, as the engine) or ``"differs"`` (only the experts
    whose gate and up scales differ: the others keep their bytes; :meth:`EngineProfile.value_rule`'s lossless
    form). ``kept``: tensors whose checkpoint bytes a converted file keeps beside the changed ones, so that
    ``restore`` gives them back exactly (clamped block scales: 4 bytes per 128x128 FP8 weights; a requantized
    W13 and its scales: the W13 bytes again, 2/3 of an FP8 layer, written for every layer the rule applies to,
    W13 scales given per projection ``(E, 2)``, even where every expert's two are equal). A
    file whose record keeps none of a changed tensor restores it as the engine's values and says so
    (:func:`fimoe_lab.checkpoints.not_byte_exact`).
    """

    kind: str
    tensors: tuple[str, ...]
    source: str
    floor: float = 0.0
    nan_to: float = 0.0
    needed: bool = False
    where: str = "all"
    kept: tuple[str, ...] = ()

    def record(self) -> dict[str, object]:
        """What a converted file records of the rule (JSON)."""
        return {
            "kind": self.kind,
            "tensors": list(self.tensors),
            "floor": self.floor,
            "nan_to": self.nan_to,
            "where": self.where,
            "kept": list(self.kept),
        }


QUANT_METHODS: dict[str, str] = {
    "fp8": "FP8 (Hugging Face quantization_config quant_method fp8: DeepSeek, Qwen3, MiniMax FP8 releases)",
    "modelopt": "NVIDIA ModelOpt exports (quant_method modelopt: FP8 per-tensor, NVFP4)",
    "compressed-tensors": "compressed-tensors / llm-compressor (FP8 tensor/channel/block, NVFP4, INT4 pack-quantized)",
    "mxfp4": "gpt-oss MXFP4 (quant_method mxfp4)",
}
"""The checkpoint quantization methods a profile may key a rule on (the ``quantization_config.quant_method`` the
checkpoint's writer records; :attr:`fimoe_lab.checkpoints.conventions.Convention.quant_method`). A rule keyed
``"format/backend@method"`` applies to layers of that method and overrides the ``"format/backend"`` one."""


@dataclass(frozen=True)
class EngineProfile:
    """One engine and version.

    Attributes:
        name: the ``--engine`` value (``vllm-0.34``).
        engine: ``vllm``, ``sglang``, ``flashinfer`` or ``fimoe_lab``.
        version: the engine's version.
        flashinfer: the FlashInfer version it runs (pins).
        alignments: ``{"format/backend": Alignment}``, overrides of the base table in
            :func:`fimoe_lab.recipes.default_alignments` (which is FlashInfer 0.6.13's era).
        scale_fill: ``{"format/backend": byte}``, the byte written into padded block scales
            where it differs from ``specs.FORMATS[fmt].scale_fill`` (FlashInfer 0.7.x's
            ``pad_trtllm_moe_weights``: 0x38 = E4M3 1.0 for NVFP4, 127 = UE8M0 1.0 for MXFP4).
        cutlass_fp4_scales: ``"128x4"`` (the block scales of NVFP4 / MXFP4 / MXFP4xMXFP8 are
            swizzled for the CUTLASS kernel, as vLLM, SGLang and FlashInfer's own
            ``prepare_cutlass_*`` do) or ``"linear"`` (only the legacy profile: what fimoe_lab
            wrote before the fix, kept so that those files restore).
        cutlass_mxfp8_scales: ``"128x4"`` (MXFP8 block scales swizzled for FlashInfer 0.7.x's
            CUTLASS MXFP8 MoE, as its ``prepare_cutlass_mxfp8_weights`` quantises them with
            ``is_sf_swizzled_layout=True``; neither vLLM 0.34 nor SGLang 0.5.23 has a FlashInfer
            CUTLASS MXFP8 path of its own) or ``"linear"`` (FlashInfer 0.6.13's era and the
            legacy profile: what fimoe_lab wrote before).
        nvfp4_quantizer: the FlashInfer NVFP4 quantizer kernels it runs
            (``nvfp4QuantAndPerTokenScaleKernel``, ``cvt_warp_fp16_to_fp4``), by the version whose
            source fixes them: ``"0.6.13"`` encodes an all-zero per-token row with
            ``rcp(0) = inf`` (its scale bytes 0x7F, ``inf * 0 = NaN``); ``"0.7.2"`` encodes it with
            0 (scale bytes 0x00, codes 0); ``"0.7.4"`` also gives a nonzero block whose E4M3 scale
            rounds to 0 the output scale 0 (codes 0, not +-6).
        permute_cache_key_parts: parts of FlashInfer's permute-index cache key: 2
            (``(name, shape)``, FlashInfer < 0.6.17) or 5 (``(name, shape, epilogue_tile_m,
            num_elts_per_sf, is_gated_act_gemm)``, >= 0.6.17).
        gate_up_kept: ``{"format/backend[@method]": True}`` for the recipes in which the engine hands the
            kernel W13 as ``[gate; up]`` (no W31 swap before the gated interleave), False where a
            method's rule (``@method``, :data:`QUANT_METHODS`) swaps again: SGLang 0.5.23's BF16
            (``UnquantizedFusedMoEMethod``; its loader loads up first only for CUTLASS), FP8
            per-tensor (``align_fp8_moe_weights_for_flashinfer_trtllm`` without
            ``swap_w13_halves``; its ModelOpt FP8 method passes ``swap_w13_halves=True``), MXFP8
            (``align_mxfp8_moe_weights_for_flashinfer_trtllm``) and DeepSeek FP8 TRT-LLM paths, where
            vLLM swaps first. docs/engine-rules.md lists each rule with its source line.
        trtllm_plain: ``"format/backend"`` recipes whose weights and scales the engine hands the
            TRT-LLM kernel unshuffled, MajorK (the W31 swap as ``gate_up_kept`` says): SGLang 0.5.23's
            DeepSeek FP8 (its runner sets ``use_shuffled_weight`` only for MXFP8; no swap) and
            FlashInfer 0.7.4's ``prepare_trtllm_fp8_block_weights`` (its DeepSeek FP8 view stays
            MajorK; its input is ``[up; gate]``, so a ``[gate; up]`` checkpoint is swapped).
        kernel_sizes: ``{"format/backend": KernelSizes}``, sizes the profile refuses instead of padding
            further (FlashInfer 0.7.4's ``prepare_*`` checks; the FP8 per-tensor 16 / 128 the others pad to
            by default): ``shapes.padded_shape`` refuses them naming whose need it is.
        no_flashinfer_path: ``{"format/backend@method": why}``: layers of that method the engine runs on
            no FlashInfer kernel (so prepares no layout), refused by :meth:`check_prepared`.
        value_rules: ``{"format/backend[@method]": ValueRule}``: the values the engine changes while it
            prepares the weights (vLLM 0.34 and SGLang 0.5.23 requantize FP8 per-tensor W13 to one scale;
            vLLM 0.34 clamps DeepSeek FP8 block scales to 1e-10). Lossy, so only profiles that reproduce an
            engine hold them: FlashInfer's own ``prepare_*`` helpers quantize from BF16 and change no stored value.

    ``alignments``, ``gate_up_kept``, ``no_flashinfer_path`` and ``value_rules`` take ``"format/backend@method"`` keys
    (:data:`QUANT_METHODS`), which override the ``"format/backend"`` entry for layers of that method.
        sm90_mixed_layout: the SM90 mixed-input (MXFP4 weights, BF16 activations) weight interleave of the
            FlashInfer it runs (``steps.SM90_MIXED_LAYOUTS``): ``"0.6.16"`` (bits permuted inside 32-bit
            words, FlashInfer >= 0.6.16, PR #3738) or ``"0.6.10"`` (nibbles swapped inside byte pairs,
            0.6.10 to 0.6.15.post1; its scales ``[K/128, rows * 4]``, not folded in 64-row blocks).
        transforms: the optional 0.7.x transforms the engine has (names of drop-ins).
        choice: listed as an ``--engine`` choice (the legacy profile is not).
        note: one line for tables and ``--help``.
    """

    name: str
    engine: str
    version: str
    flashinfer: str
    alignments: dict[str, Alignment] = field(default_factory=dict)
    scale_fill: dict[str, int] = field(default_factory=dict)
    cutlass_fp4_scales: str = "128x4"
    cutlass_mxfp8_scales: str = "128x4"
    nvfp4_quantizer: str = "0.7.2"
    permute_cache_key_parts: int = 5
    gate_up_kept: dict[str, bool] = field(default_factory=dict)
    trtllm_plain: tuple[str, ...] = ()
    kernel_sizes: dict[str, KernelSizes] = field(default_factory=dict)
    no_flashinfer_path: dict[str, str] = field(default_factory=dict)
    value_rules: dict[str, ValueRule] = field(default_factory=dict)
    sm90_mixed_layout: str = "0.6.16"
    transforms: tuple[str, ...] = ()
    choice: bool = True
    note: str = ""

    def alignment(self, fmt: str, backend: str, quant_method: Optional[str] = None) -> Alignment:
        """This profile's override for ``fmt``/``backend`` and layers of ``quant_method`` (empty when none)."""
        return _keyed(self.alignments, fmt, backend, quant_method, Alignment())

    def keeps_gate_up(self, fmt: str, backend: str, quant_method: Optional[str] = None) -> bool:
        """Whether the engine hands the kernel W13 as ``[gate; up]`` (no W31 swap) for layers of
        ``quant_method`` (a :data:`QUANT_METHODS` key; None: the format's rule)."""
        return _keyed(self.gate_up_kept, fmt, backend, quant_method, False)

    def value_rule(
        self, fmt: str, backend: str, quant_method: Optional[str] = None, lossless: bool = False
    ) -> Optional[ValueRule]:
        """The value rule the engine applies to ``fmt``/``backend`` layers of ``quant_method`` (None: none).
        ``lossless``: only a rule the kernel needs (``ValueRule.needed``), and only where it is needed
        (``where="differs"``): the checkpoint's values wherever the kernel takes them."""
        rule = _keyed(self.value_rules, fmt, backend, quant_method, None)
        if not lossless or rule is None:
            return rule
        return replace(rule, where="differs") if rule.needed else None

    def check_prepared(self, fmt: str, backend: str, quant_method: Optional[str] = None) -> None:
        """Refuse, in one line, a method whose layers the engine prepares no FlashInfer layout for
        (``no_flashinfer_path``)."""
        why = _keyed(self.no_flashinfer_path, fmt, backend, quant_method, "")
        if why:
            raise FimoeError(
                f"{self.name} prepares no FlashInfer {backend} layout for {quant_method} {fmt} layers: {why}",
                fix="convert with another --engine (vllm-0.34 or flashinfer-0.7.4)",
            )


def _keyed(table: Mapping[str, _T], fmt: str, backend: str, quant_method: Optional[str], default: _T) -> _T:
    """``table``'s entry for ``"fmt/backend@quant_method"``, else for ``"fmt/backend"``, else ``default``."""
    key = f"{fmt}/{backend}"
    if quant_method is not None and f"{key}@{quant_method}" in table:
        return table[f"{key}@{quant_method}"]
    return table.get(key, default)


_SM90_MIXED = ("interleave_moe_weights_for_sm90_mixed_gemm", "interleave_moe_scales_for_sm90_mixed_gemm")
"""FlashInfer's SM90 MXFP4 x BF16 CUTLASS MoE preparation (vLLM 0.34 ``FLASHINFER_CUTLASS_MXFP4_BF16``, SGLang
0.5.23 ``cutlass_sm90``): W31 swap, then the weight interleave of both weights and the scale folding."""
_TRANSFORMS_07 = ("pad_trtllm_moe_weights", "align_fp4_moe_hidden_dim_for_fi") + _SM90_MIXED
_MXFP8_CUTLASS_07 = Alignment(intermediate=128, hidden=128)
"""FlashInfer 0.7.x's CUTLASS MXFP8 MoE: H and I multiples of 128 (``prepare_cutlass_mxfp8_weights``)."""
_FP8_NEED = KernelSizes(
    16,
    why="FlashInfer's FP8 per-tensor MoE kernels need it (vLLM's align_moe_weights_for_fi pads to it by default)",
    non_gated_intermediate=128,
)
_FP8_KERNEL_SIZES = {"fp8/trtllm": _FP8_NEED, "fp8/cutlass": _FP8_NEED}
"""FP8 per-tensor's intermediate multiple, 16 gated / 128 non-gated, which every engine but FlashInfer 0.7.4's own
helpers (whose per-tensor ones name none) pads to: an alignment given that leaves another size is refused."""
_UNPADDED = Alignment(intermediate=1, hidden=1)
_REQUANT_SOURCE = {
    "vllm": "vllm/model_executor/layers/quantization/utils/fp8_utils.py:1537",
    "sglang": "sglang/srt/layers/quantization/fp8.py:2709, modelopt_quant.py:1209",
}
"""Where each engine requantizes (docs/engine-rules.md, "Value rules", has the arithmetic's lines)."""


def _requantize(engine: str, nan_to: float) -> dict[str, ValueRule]:
    """FP8 per-tensor W13 requantized to max(gate, up) on both backends (every method: the engine does it while
    loading, before it picks a kernel)."""
    rule = ValueRule(
        "fp8_requantize_max",
        ("w13", "w13_scale"),
        _REQUANT_SOURCE[engine],
        nan_to=nan_to,
        needed=True,
        kept=("w13", "w13_scale"),
    )
    return {"fp8/trtllm": rule, "fp8/cutlass": rule}


VLLM_MIN_BLOCK_SCALE = 1e-10
"""vLLM 0.34's floor for DeepSeek FP8 block scales (``_FI_CUTLASS_MIN_BLOCK_SCALE``): dead experts' ~1e-23 scales
made FlashInfer's Hopper CUTLASS FP8 MoE emit NaN. ``inspect`` warns below it."""

_VLLM_CLAMP = ValueRule(
    "clamp_block_scales",
    ("w13_scale", "w2_scale"),
    "vllm/model_executor/layers/quantization/utils/flashinfer_utils.py:663",
    floor=VLLM_MIN_BLOCK_SCALE,
    kept=("w13_scale", "w2_scale"),
)
_FI074_RECIPES = tuple(
    f"{fmt}/{backend}"
    for fmt in ("bf16", "fp8", "fp8-block", "mxfp8", "nvfp4", "mxfp4")
    for backend in ("trtllm", "cutlass")
)
_FI074 = "FlashInfer 0.7.4's {} refuses other sizes ({}; it pads nothing)"
_FI074_KERNEL_SIZES = {
    "fp8-block/trtllm": KernelSizes(128, 128, 128, _FI074.format("prepare_trtllm_fp8_block_weights", "128x128 blocks")),
    "fp8-block/cutlass": KernelSizes(128, 128, 1, _FI074.format("prepare_cutlass_fp8_block_weights", "128x128 blocks")),
    "mxfp8/trtllm": KernelSizes(
        128, 128, 1, _FI074.format("prepare_trtllm_fp8_block_weights", "its unpadded 128x4 scale layout")
    ),
    "mxfp8/cutlass": KernelSizes(128, 128, 1, _FI074.format("prepare_cutlass_mxfp8_weights", "the MXFP8 MoE binding")),
    "nvfp4/trtllm": KernelSizes(
        64, 128, 128, _FI074.format("prepare_trtllm_fp4_weights", "128-row scale shuffle, unpadded 128x4 scales")
    ),
    "nvfp4/cutlass": KernelSizes(16, 64, 1, _FI074.format("prepare_cutlass_nvfp4_weights", "its input scale stride")),
    "mxfp4/trtllm": KernelSizes(128, 128, 128, _FI074.format("prepare_trtllm_fp4_weights", "the MXFP4 kernel")),
    "mxfp4/cutlass": KernelSizes(
        128, 128, 1, _FI074.format("prepare_cutlass_mxfp8_mxfp4_weights", "the MXFP4 MoE binding")
    ),
}
"""FlashInfer 0.7.4's ``prepare_*`` size checks (``flashinfer/fused_moe/prepare.py``; docs/engine-rules.md has the
lines). BF16 and FP8 per-tensor helpers check nothing beyond their steps (shuffle rows, BlockMajorK), which
``shapes.padded_shape`` refuses on its own."""

ENGINES: dict[str, EngineProfile] = {
    p.name: p
    for p in (
        EngineProfile(
            "vllm-0.34",
            "vllm",
            "0.34.0",
            "0.7.3",
            alignments={
                "bf16/trtllm": Alignment(intermediate=128),
                "nvfp4/trtllm": Alignment(hidden=256, per_token_non_gated_hidden=512),
                "nvfp4/cutlass": Alignment(non_gated_intermediate=128),
                "mxfp4/trtllm": Alignment(intermediate=128, hidden=256),
                "mxfp4/cutlass": Alignment(intermediate=128, hidden=128),
                "mxfp8/cutlass": _MXFP8_CUTLASS_07,
            },
            kernel_sizes=_FP8_KERNEL_SIZES,
            value_rules={
                **_requantize("vllm", -448.0),
                "fp8-block/trtllm": _VLLM_CLAMP,
                "fp8-block/cutlass": _VLLM_CLAMP,
            },
            transforms=("align_fp4_moe_hidden_dim_for_fi",) + _SM90_MIXED,
            note="vLLM 0.34.0 (FlashInfer 0.7.3): BF16 TRT-LLM I 128, NVFP4 TRT-LLM H 256 (512 per-token non-gated), "
            "NVFP4 CUTLASS non-gated I 128, MXFP4 TRT-LLM I 128 H 256, MXFP4 CUTLASS I/H 128",
        ),
        EngineProfile(
            "sglang-0.5.23",
            "sglang",
            "0.5.23",
            "0.7.2",
            alignments={
                "bf16/trtllm": Alignment(intermediate=128),
                "fp8/trtllm": Alignment(intermediate=128),
                "fp8/cutlass": Alignment(intermediate=128),
                "mxfp8/trtllm": Alignment(intermediate=128, hidden=1),
                "mxfp8/cutlass": _MXFP8_CUTLASS_07,
                "nvfp4/trtllm": Alignment(hidden=1, per_token_non_gated_hidden=512),
                "nvfp4/trtllm@compressed-tensors": Alignment(intermediate=128, hidden=1),
                "mxfp4/trtllm": Alignment(intermediate=128, hidden=256),
            },
            scale_fill={"mxfp8/trtllm": 0},
            gate_up_kept={
                "bf16/trtllm": True,
                "fp8/trtllm": True,
                "fp8/trtllm@modelopt": False,
                "mxfp8/trtllm": True,
                "fp8-block/trtllm": True,
                "fp8-block/trtllm@compressed-tensors": False,
                "mxint4/trtllm": True,
            },
            trtllm_plain=("fp8-block/trtllm",),
            kernel_sizes=_FP8_KERNEL_SIZES,
            no_flashinfer_path={
                f"{fmt}/{backend}@compressed-tensors": "its CompressedTensorsW8A8Fp8MoE lays out only BLOCK-strategy "
                "layers for FlashInfer TRT-LLM and hands the rest Triton quant info"
                for fmt, backend in (("fp8", "trtllm"), ("fp8", "cutlass"), ("fp8-block", "cutlass"))
            },
            value_rules=_requantize("sglang", 448.0),
            transforms=_SM90_MIXED,
            note="SGLang 0.5.23 (FlashInfer 0.7.2): I 128 at weight creation (MXFP4 TRT-LLM H 256), MXFP8 TRT-LLM H "
            "unpadded and pad scales 0, BF16/FP8/MXFP8/MxInt4 TRT-LLM W13 kept [gate; up] (ModelOpt FP8 swapped), "
            "DeepSeek FP8 TRT-LLM unshuffled (compressed-tensors swapped)",
        ),
        EngineProfile(
            "flashinfer-0.7.4",
            "flashinfer",
            "0.7.4",
            "0.7.4",
            alignments={key: _UNPADDED for key in _FI074_RECIPES},
            scale_fill={"nvfp4/trtllm": 0x38, "mxfp4/trtllm": 127},
            nvfp4_quantizer="0.7.4",
            trtllm_plain=("fp8-block/trtllm",),
            kernel_sizes=_FI074_KERNEL_SIZES,
            transforms=_TRANSFORMS_07,
            note="FlashInfer 0.7.4's prepare_* helpers: nothing padded (sizes they refuse are refused), DeepSeek FP8 "
            "TRT-LLM MajorK unshuffled; pad scales neutral (0x38 NVFP4, 127 MXFP4) where asked to pad; five-part "
            "permute cache keys; NVFP4 quantizer zeroes underflowed blocks",
        ),
        EngineProfile(
            "flashinfer-0.6.13",
            "flashinfer",
            "0.6.13",
            "0.6.13",
            cutlass_mxfp8_scales="linear",
            nvfp4_quantizer="0.6.13",
            permute_cache_key_parts=2,
            sm90_mixed_layout="0.6.10",
            kernel_sizes=_FP8_KERNEL_SIZES,
            transforms=_SM90_MIXED,
            note="FlashInfer 0.6.13 and the vLLM of its era (the seed, the goldens)",
        ),
        EngineProfile(
            "fimoe-legacy",
            "fimoe_lab",
            "0.2",
            "0.6.13",
            cutlass_fp4_scales="linear",
            cutlass_mxfp8_scales="linear",
            nvfp4_quantizer="0.6.13",
            permute_cache_key_parts=2,
            sm90_mixed_layout="0.6.10",
            kernel_sizes=_FP8_KERNEL_SIZES,
            choice=False,
            note="files converted before engine profiles: flashinfer-0.6.13 with linear CUTLASS FP4 scales",
        ),
    )
}
"""Every profile by name."""

ENGINE_CHOICES: tuple[str, ...] = tuple(name for name, p in ENGINES.items() if p.choice)
"""The ``--engine`` choices (newest vLLM first)."""

DEFAULT_ENGINE = "vllm-0.34"
"""What ``plan_layer``, ``convert``, ``inspect``, ``tune`` and the lab use when no engine is named."""

LEGACY_ENGINE = "fimoe-legacy"
"""What a converted file that records no engine was written with (``restore`` rebuilds with it)."""


def get_engine(name: Optional[str]) -> EngineProfile:
    """The profile ``name`` (None: :data:`DEFAULT_ENGINE`); one clear error for an unknown name."""
    key = DEFAULT_ENGINE if name is None else name.strip().lower()
    if key not in ENGINES:
        raise FimoeError(f"unknown engine {name!r}", fix=f"choose one of {', '.join(ENGINE_CHOICES)}")
    return ENGINES[key]


def check_quant_method(name: Optional[str]) -> Optional[str]:
    """``name`` if it is a :data:`QUANT_METHODS` key or None; one clear error otherwise."""
    if name is not None and name not in QUANT_METHODS:
        raise FimoeError(f"unknown quantization method {name!r}", fix=f"choose one of {', '.join(QUANT_METHODS)}")
    return name
