"""TRTLLM-Gen MoE tactic validity, decided in Python from the kernel set's metadata.

A re-implementation of what FlashInfer's op ``trtllm_get_valid_moe_configs`` decides (the
list of ``[tile_N, config]`` tactics the autotuner picks from), written from the facts of
FlashInfer 0.6.13's launcher/runner sources and the trtllm-gen export headers of its
batched-GEMM kernel set.  No FlashInfer, torch or GPU is needed: the kernel table comes from
package data written by ``scripts/extract_trtllm_kernels.py``
(``fimoe_lab/data/tactics/kernels-fi<version>-<kernel-set hash>.json.gz``).

The decision, for a query (dtypes, activation, weight layout, per-token scaling, hidden H,
intermediate I, local experts E, top_k, tokens T):

1. **Tile candidates.**  The launcher of the dtype combination has a ladder of tile_N
   (tokens per CTA tile).  With ``avg = float32(T * top_k) / float32(E)``, the centre tile is
   the next power of two >= ``ceil(avg)`` clamped into the ladder; the candidates are the
   centre, the next two above it and the one below it.
2. **Kernels per GEMM.**  For each tile_N, GEMM1 (``[T*top_k, H] x [H, g*I]``, g = 2 for a
   gated activation) and GEMM2 (``[T*top_k, I] x [I, H]``) each keep the kernels of the table
   whose dtypes, routing, fused/element-wise activation, tile, shuffling, layout, bias,
   per-token scaling, epilogue tile and cluster match the runner's options, in table order
   (an empty list for either GEMM: FlashInfer raises "No kernel found" for the whole query).
3. **Kernel validity.**  Each kept kernel is checked with the problem
   ``M = rows of the weight (g*I or H), N = T, K = H or I`` (transposed MMA output, batch
   over N): the options check of the batched GEMM, the gated-activation check and the GEMM
   check, without updating the options (any check or warning that fires rejects it).
4. **Combination.**  The MoE config index runs over the pairs (GEMM1 kernel i, GEMM2 kernel j)
   of the two kept lists, ``index = i * len(gemm2) + j``; a pair is valid when both kernels
   are.  The answer lists, per tile_N ascending, the valid indices ascending.

Shapes enter only through M and K (and N, in the split-K store check), so a query costs a
few dictionary look-ups and modular checks (see ``benchmarks/validity_speed.py``).

Scope: ``use_shuffled_weight=True`` and no LoRA delta (what every FlashInfer MoE entry point
passes), an SM100 device by default or SM103 (``sm=103``; the two differ only in which
builds of the patched-F2FP MxFP4 kernels the runner keeps), sizes within the op's 32-bit
arithmetic (:data:`fimoe_lab.tune.oracle.MAX_GEMM_DIM`).  Agreement with the live module:
``tests/test_tune_validity.py`` (no shape is known to differ).

Why one module of this size: it restates one decision of FlashInfer's (the runner's option checks, the
batched GEMM's validity checks and the pairing of GEMM1 with GEMM2 kernels), and those checks read each
other's intermediate values (the runner options feed every kernel check, the tile ladder feeds both
GEMMs). Split by check, each part would have to import the others' private records; kept together, the
decision reads top to bottom in the order FlashInfer takes it, and ``tests/test_tune_validity.py``
checks it as one function against the live module.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from fimoe_lab import env, resources
from fimoe_lab.errors import OracleError

__all__ = [
    "KERNEL_FIELDS",
    "KernelTable",
    "ModelAnswer",
    "kernels_dir",
    "shipped_tables",
    "find_table",
]

# The options of a kernel that the runner's filter and the options check read (names as in
# trtllm-gen's BatchedGemmOptions), plus the kernel's name and target SM.
KERNEL_FIELDS = (
    "name",
    "sm",
    "mAllReduceAlgo",
    "mBiasDtype",
    "mBiasType",
    "mBlockK",
    "mClusterDimX",
    "mClusterDimY",
    "mClusterDimZ",
    "mDtypeAcc",
    "mDtypeA",
    "mDtypeB",
    "mDtypeC",
    "mDtypeMmaA",
    "mDtypeMmaB",
    "mEltwiseActType",
    "mEnablesEarlyExit",
    "mEnablesDelayedEarlyExit",
    "mEpilogueLdtmDps",
    "mEpilogueLdtmBits",
    "mEpilogueTileM",
    "mEpilogueTileN",
    "mFallbackClusterDimX",
    "mFallbackClusterDimY",
    "mFusedBiasShuffleMode",
    "mFuseUtccpWithUtcmma",
    "mGridTriggerSecondaryA",
    "mGridTriggerSecondaryB",
    "mGridWaitForPrimaryA",
    "mGridWaitForPrimaryB",
    "mLayoutA",
    "mLayoutB",
    "mMmaK",
    "mMmaKind",
    "mMmaM",
    "mMmaN",
    "mMmaTileK",
    "mNumEpilogueWarps",
    "mNumSlicesForSplitK",
    "mNumSlicesForSliceK",
    "mNumStagesA",
    "mNumStagesB",
    "mNumStagesMma",
    "mNumStagesMmaWithinWorkTile",
    "mNumStagesMmaAcrossWorkTile",
    "mNumStagesSmemSfA",
    "mNumStagesSmemSfB",
    "mNumStagesTmemSfA",
    "mNumStagesTmemSfB",
    "mPatchF2fp",
    "mPerTokenSfDtype",
    "mSchedHostTask",
    "mSfBlockSizeA",
    "mSfBlockSizeB",
    "mSfBlockSizeC",
    "mSfLayoutA",
    "mSfLayoutB",
    "mSfLayoutC",
    "mSliceK",
    "mSparsityA",
    "mSplitK",
    "mTileK",
    "mTileM",
    "mTileN",
    "mTileScheduler",
    "mTransposeMmaOutput",
    "mUseCustomizedMma3xNvFp4",
    "mUseCustomMmaSchedule",
    "mUseDeepSeekFp8",
    "mUseFlexibleClusterDims",
    "mUseMaxTmemOverlap",
    "mUsePerTokenSfA",
    "mUsePerTokenSfB",
    "mUseShuffledMatrix",
    "mUseTmaStore",
    "mUseTwoTmaLoadWarps",
    "mUseUnrollLoop2xForMma",
    "mActType",
    "mBatchStrideInTokens",
    "mFusedAct",
    "mIsStaticBatch",
    "mIsUniformNumTokensPerBatch",
    "mRouteImpl",
    "mRouteSfsImpl",
    "mUseTmaOobOpt",
    "mPrefetchB",
)

# trtllm-gen dtypes: bits per element and block-scaled or not (DtypeDecl.h).
_BITS = {
    "Bfloat16": 16,
    "Bool": 1,
    "E2m1": 4,
    "E2m3": 6,
    "E3m2": 6,
    "E4m3": 8,
    "E5m2": 8,
    "Fp16": 16,
    "Fp32": 32,
    "Int8": 8,
    "Int32": 32,
    "Int64": 64,
    "MxE2m1": 4,
    "MxE4m3": 8,
    "MxInt4": 4,
    "UE8m0": 8,
    "UInt8": 8,
    "UInt16": 16,
    "UInt32": 32,
    "UInt64": 64,
    "UInt128": 128,
    "Void": 0,
}
_BLOCK = {"E2m1", "E2m3", "E3m2", "MxE2m1", "MxE4m3", "MxInt4"}


# --------------------------------------------------------------------------- the table
def kernels_dir() -> Path:
    """``$FIMOE_LAB_TACTICS_DIR`` or the package's tactics data folder."""
    return env.value("FIMOE_LAB_TACTICS_DIR", None) or resources.tactics_dir()


def shipped_tables() -> list[Path]:
    """Kernel tables shipped (``kernels-fi<version>-<hash>.json.gz``), sorted by name."""
    d = kernels_dir()
    return sorted(d.glob("kernels-fi*.json.gz")) if d.is_dir() else []


class _Kernel:
    """One kernel of the table (attributes named as the trtllm-gen options)."""

    def __init__(self, index: int, row: dict[str, Any]):
        self.index = index
        self.__dict__.update(row)

    def __getattr__(self, name: str) -> Any:  # the fields of KERNEL_FIELDS, set in __init__
        raise AttributeError(name)


class KernelTable:
    """The batched-GEMM kernel table of one kernel set (see the module docstring)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        with gzip.open(self.path, "rt") as f:
            raw = json.load(f)
        self.meta: dict[str, Any] = raw["meta"]
        cols: dict[str, list[Any]] = raw["columns"]
        missing = [k for k in KERNEL_FIELDS if k not in cols]
        if missing:
            raise OracleError(
                f"kernel table {self.path.name} lacks fields {', '.join(missing)}",
                fix="re-extract it with scripts/extract_trtllm_kernels.py",
            )
        self._cols = cols
        self.size = len(cols["name"])
        # Kernels, and their checks, are built when a query first reaches them.
        self._kernels: dict[int, _Kernel] = {}
        self._checks: dict[int, tuple[Optional[str], _ShapeRule]] = {}
        self._passing: dict[_RunnerOptions, tuple[int, ...]] = {}
        # Kernels by what the runner's options must equal (see _filter): a query reads one bucket.
        self._buckets: dict[tuple[Any, ...], list[int]] = {}
        for i in range(self.size):
            self._buckets.setdefault(self._bucket_key(i), []).append(i)

    def _bucket_key(self, i: int) -> tuple[Any, ...]:
        c = self._cols
        fused = bool(c["mFusedAct"][i])
        return (
            c["mDtypeA"][i],
            c["mDtypeB"][i],
            c["mDtypeC"][i],
            c["mTileN"][i],
            bool(c["mUseDeepSeekFp8"][i]),
            c["mRouteImpl"][i] != "NoRoute",
            fused,
            c["mActType"][i] if fused else None,
            c["mEltwiseActType"][i],
            bool(c["mUseShuffledMatrix"][i]),
            c["mLayoutA"][i],
            c["mEpilogueTileM"][i],
        )

    def kernel(self, index: int) -> _Kernel:
        """Kernel ``index`` of the table (its options as attributes)."""
        k = self._kernels.get(index)
        if k is None:
            k = self._kernels[index] = _Kernel(index, {f: self._cols[f][index] for f in KERNEL_FIELDS})
        return k

    def _check(self, index: int) -> tuple[Optional[str], _ShapeRule]:
        c = self._checks.get(index)
        if c is None:
            k = self.kernel(index)
            c = self._checks[index] = (_static_check(k), _ShapeRule.of(k))
        return c

    @property
    def flashinfer(self) -> str:
        return str(self.meta.get("flashinfer"))

    @property
    def kernel_set(self) -> str:
        return str(self.meta.get("kernel_set"))

    def source(self) -> dict[str, Any]:
        return {
            "kind": "model",
            "file": self.path.name,
            "flashinfer": self.flashinfer,
            "kernel_set": self.kernel_set,
        }

    # -- step 2: the runner's filter ------------------------------------------
    def passing(self, opts: _RunnerOptions) -> tuple[int, ...]:
        """Indices (table order) of the kernels the runner keeps for ``opts``; () for none."""
        hit = self._passing.get(opts)
        if hit is None:
            hit = self._passing[opts] = self._filter(opts)
        return hit

    def _filter(self, opts: _RunnerOptions) -> tuple[int, ...]:
        # The runner keeps a kernel whose dtypes, deepSeekFp8, routing (route or not), fused
        # activation (and its type when fused), element-wise activation, shuffling, weight
        # layout (A) and epilogue tileM equal its options, whose tile equals the asked tile
        # (tileN: the MoE runner always transposes the MMA output, batch over tokens = N),
        # with dynamic batching, and passes the checks below.
        key = (
            opts.dtype_a,
            opts.dtype_b,
            opts.dtype_c,
            opts.tile,
            opts.deepseek,
            opts.route_act,
            opts.fused_act,
            opts.act_type if opts.fused_act else None,
            opts.eltwise,
            opts.shuffled,
            opts.layout,
            opts.epilogue_tile_m,
        )
        out = []
        for i in self._buckets.get(key, []):
            k = self.kernel(i)
            if not k.mTransposeMmaOutput or k.mIsStaticBatch:
                continue
            if k.mBiasType == "Mn":  # the MoE path asks for no bias: Mn-bias kernels are skipped
                continue
            if opts.per_token and not k.mUsePerTokenSfB:  # per-token scales on the tokens (B)
                continue
            # patched-F2FP cubins only for the device's own SM family.
            if k.mPatchF2fp and opts.sm == 103 and k.sm != "Sm103a":
                continue
            if k.mPatchF2fp and opts.sm == 100 and k.sm not in ("Sm100a", "Sm100f"):
                continue
            # clusterZ > 1 is skipped for a correctness issue (flashinfer-ai/flashinfer#3197).
            if k.mClusterDimZ <= 1:
                out.append(k.index)
        return tuple(out)

    # -- step 3: one kernel, one problem ---------------------------------------
    def valid(self, index: int, m: int, n: int, k: int) -> bool:
        """Whether kernel ``index`` runs the problem (M, N, K) (batch over N, transposed)."""
        reason, rule = self._check(index)
        return reason is None and rule.ok(m, n, k)

    def static_reason(self, index: int) -> Optional[str]:
        """Why kernel ``index`` is rejected whatever the shape, or None."""
        return self._check(index)[0]


@functools.lru_cache(maxsize=8)
def _load(path: str) -> KernelTable:
    return KernelTable(Path(path))


def find_table(flashinfer: Optional[str] = None, kernel_set: Optional[str] = None) -> Optional[KernelTable]:
    """The shipped table for ``flashinfer`` (and ``kernel_set`` when given), else None.

    Without ``flashinfer``: the table of the installed FlashInfer, else the newest shipped.
    """
    files = shipped_tables()
    if flashinfer is None:
        try:
            import importlib.metadata as md

            flashinfer = md.version("flashinfer-python")
        except Exception:
            flashinfer = None
        match = [f for f in files if flashinfer and f.name.startswith(f"kernels-fi{flashinfer}-")]
        files = match or files
        return _load(str(files[-1])) if files else None
    for f in files:
        if not f.name.startswith(f"kernels-fi{flashinfer}-"):
            continue
        t = _load(str(f))
        if kernel_set is None or t.kernel_set == kernel_set:
            return t
    return None


# --------------------------------------------------------------------------- step 1
def _f32(x: float) -> float:
    return float(struct.unpack("f", struct.pack("f", x))[0])


def _next_pow2(value: float) -> int:
    n = math.ceil(value)
    if n <= 1:
        return 1
    return 1 << (n - 1).bit_length()


def tile_candidates(ladder: tuple[int, ...], tokens: int, top_k: int, experts: int) -> tuple[int, ...]:
    """The tile_N the launcher tries: centre = next power of two of the mean tokens per expert
    (float32, clamped into ``ladder``), plus the two above and the one below it, ascending."""
    avg = _f32(_f32(float(tokens * top_k)) / _f32(float(experts)))
    centre = min(max(_next_pow2(avg), ladder[0]), ladder[-1])
    i = ladder.index(centre)
    return tuple(sorted(set(ladder[max(0, i - 1) : i + 3])))


# --------------------------------------------------------------------------- step 2 options
@dataclass(frozen=True)
class _RunnerOptions:
    """What one GEMM of the MoE runner asks of a kernel (TrtllmGenBatchedGemmRunnerOptions).

    Fixed by the MoE runner for both GEMMs and so not fields: transposed MMA output, dynamic
    (not static) batch, no bias, no per-channel scaling.
    """

    dtype_a: str
    dtype_b: str
    dtype_c: str
    act_type: str
    eltwise: str
    deepseek: bool
    fused_act: bool
    route_act: bool
    tile: int
    epilogue_tile_m: int
    shuffled: bool
    layout: str
    per_token: bool
    sm: int


_GATED = {"Swiglu": "SwiGlu", "Geglu": "GeGlu"}
_ELTWISE = {"Relu2": "Relu2", "Identity": "None"}


@dataclass(frozen=True)
class _Launch:
    """A launcher's runner: the tile ladder and both GEMMs' options builder."""

    ladder: tuple[int, ...]
    dtype_act: str
    dtype_weights: str
    deepseek: bool
    activation: str
    shuffled: bool
    layout: str
    per_token_gemm1: bool
    per_token_gemm2: bool
    sm: int = 100

    def gemm1(self, tile: int) -> _RunnerOptions:
        gated = self.activation in _GATED
        return _RunnerOptions(
            dtype_a=self.dtype_weights,
            dtype_b=self.dtype_act,
            dtype_c="Bfloat16" if self.per_token_gemm2 else self.dtype_act,
            act_type=_GATED.get(self.activation, "SwiGlu"),
            eltwise="None" if gated else _ELTWISE[self.activation],
            deepseek=self.deepseek,
            fused_act=gated and not self.deepseek,
            route_act=True,
            tile=tile,
            epilogue_tile_m=64 if (gated and self.deepseek) else 128,
            shuffled=self.shuffled,
            layout=self.layout,
            per_token=self.per_token_gemm1,
            sm=self.sm,
        )

    def gemm2(self, tile: int) -> _RunnerOptions:
        return _RunnerOptions(
            dtype_a=self.dtype_weights,
            dtype_b=self.dtype_act,
            dtype_c="Bfloat16",
            act_type="SwiGlu",
            eltwise="None",
            deepseek=self.deepseek,
            fused_act=False,
            route_act=False,
            tile=tile,
            epilogue_tile_m=64 if self.deepseek else 128,
            shuffled=self.shuffled,
            layout=self.layout,
            per_token=self.per_token_gemm2,
            sm=self.sm,
        )


class Rejected(Exception):
    """FlashInfer raises for this query (the live op answers with an error)."""


def launch(
    dtype_act: str, dtype_weights: str, fp8_quant: str, activation: str, layout: str, shuffled: bool, per_token: bool
) -> _Launch:
    """The launcher FlashInfer 0.6.13's ``trtllm_get_valid_moe_configs`` dispatches to.

    Arguments are FlashInfer enum member names (``DtypeTrtllmGen``, ``Fp8QuantizationType``,
    ``ActivationType``, ``WeightLayout``).  :class:`Rejected` where the op raises.
    """
    gated = activation in _GATED
    if activation not in _GATED and activation not in _ELTWISE:
        raise Rejected(f"unsupported activation {activation} for the TRTLLM-Gen MoE runner")
    base = (8, 16, 32, 64, 128)
    if dtype_act == "Bfloat16" and dtype_weights == "MxInt4":
        return _Launch(base, dtype_act, dtype_weights, False, "Swiglu", True, "BlockMajorK", False, False)
    if dtype_act == "Bfloat16" and dtype_weights == "Bfloat16":
        return _Launch(base, dtype_act, dtype_weights, False, activation, shuffled, layout, False, False)
    if fp8_quant == "DeepSeekFp8" and dtype_act == "E4m3" and dtype_weights == "E4m3":
        if activation != "Swiglu":
            raise Rejected(f"DeepSeekFp8 only supports ActivationType::Swiglu, got {activation}")
        return _Launch(base, dtype_act, dtype_weights, True, "Swiglu", shuffled, layout, False, False)
    if fp8_quant == "MxFp8" and dtype_act == "MxE4m3" and dtype_weights == "MxE4m3":
        return _Launch(base + (256,), dtype_act, dtype_weights, False, activation, shuffled, layout, False, False)
    if fp8_quant in ("PerTensorFp8", "NoneFp8") and dtype_weights == "E4m3":
        if not gated:
            raise Rejected(f"FP8 per-tensor currently supports gated activations only, got {activation}")
        # GEMM1 always asks for per-token scaling here (Llama4-style routing scales).
        return _Launch(base, dtype_act, dtype_weights, False, activation, shuffled, layout, True, False)
    if dtype_weights in ("E2m1", "MxE2m1"):
        ladder = (8, 16, 32, 64) if dtype_act == "Bfloat16" else (8, 16, 32, 64, 128, 256)
        # FP4: always shuffled, always MajorK, per-token scaling on both GEMMs or neither.
        return _Launch(ladder, dtype_act, dtype_weights, False, activation, True, "MajorK", per_token, per_token)
    raise Rejected(f"unsupported data type combination dtype_act={dtype_act}, dtype_weights={dtype_weights}")


# --------------------------------------------------------------------------- step 3
def _shuffle_block(epilogue_tile_m: int) -> int:
    return 32 if epilogue_tile_m % 128 == 0 else 16


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _static_check(k: _Kernel) -> Optional[str]:
    """The shape-independent part of the options check (updateOptions = false), or the first
    reason it fails.  Order and conditions follow checkAndUpdateBatchedGemmOptions ->
    checkAndUpdateGemmGatedActOptions / checkAndUpdateGemmOptions; every check there that
    reads only the kernel's own options is here, the M/N/K ones are :class:`_ShapeRule`.
    trtllm-gen's hybrid slice-K is off for every exported kernel (the table has no field for
    it), so its checks are not repeated.
    """
    blackwell = k.sm != "Sm90a"
    if k.mUseTmaOobOpt and not k.mUseTwoTmaLoadWarps:
        return "TMA OOB optimisation needs two TMA load warps"
    if not k.mFusedAct and k.mFusedBiasShuffleMode == "ReorderAndShuffle":
        return "fused bias reorder needs a fused activation"
    # --- GemmOptions
    if "Void" in (k.mDtypeB, k.mDtypeC, k.mDtypeMmaA, k.mDtypeMmaB):
        return "a dtype is unset"
    a, b, ma, mb = k.mDtypeA, k.mDtypeB, k.mDtypeMmaA, k.mDtypeMmaB
    if not (a == ma or (a in ("MxE2m1", "E2m1", "MxInt4") and ma == "Bfloat16") or (a == "E2m1" and ma == "E4m3")):
        return "unsupported cast for A"
    if not (b == mb or (b == "E4m3" and mb == "MxE4m3")):
        return "unsupported cast for B"
    if a != ma and k.mTileM != 128:
        return "casting A needs tileM 128"
    if k.mPatchF2fp and not (a == "MxE2m1" and ma == "Bfloat16"):
        return "patchF2fp only for MxFp4 -> Bf16"
    if not blackwell and ma != mb:
        return "mixed MMA dtypes need Blackwell"
    if ma in ("E4m3", "E2m1") and mb not in ("E4m3", "E2m1"):
        return "f8f6f4 dtype mix"
    if ma in ("MxE4m3", "MxE2m1") and mb not in ("MxE4m3", "MxE2m1"):
        return "mxf8f6f4 dtype mix"
    if mb in ("MxE4m3", "MxE2m1") and ma not in ("MxE4m3", "MxE2m1"):
        return "mxf8f6f4 dtype mix"
    if ma in ("Fp16", "Bfloat16") and mb != ma:
        return "f16 dtype mix"
    if (ma != a or mb != b) and not k.mUseTwoTmaLoadWarps:
        return "casting needs two TMA load warps"
    if a != b and not k.mUseTwoTmaLoadWarps:
        return "different A/B dtypes need two TMA load warps"
    stages = (k.mNumStagesA, k.mNumStagesB, k.mNumStagesSmemSfA, k.mNumStagesSmemSfB)
    if 0 in stages + (k.mNumStagesTmemSfA, k.mNumStagesTmemSfB):
        return "a number of stages is unset"
    if k.mFuseUtccpWithUtcmma:
        if k.mSfLayoutA == "R128c4" and k.mNumStagesTmemSfA != 1:
            return "fused UTCCP needs numStagesTmemSfA 1"
        if k.mSfLayoutB == "R128c4" and k.mNumStagesTmemSfB != 1:
            return "fused UTCCP needs numStagesTmemSfB 1"
    if not k.mUseTwoTmaLoadWarps and k.mNumStagesA != k.mNumStagesB:
        return "numStagesA != numStagesB with one load warp"
    both_utccp = k.mSfLayoutA == "R128c4" and k.mSfLayoutB == "R128c4"
    if both_utccp and (k.mNumStagesSmemSfA != k.mNumStagesSmemSfB or k.mNumStagesTmemSfA != k.mNumStagesTmemSfB):
        return "SF stage counts differ"
    kind = k.mMmaKind
    if kind == "Auto":
        return "MMA kind unset"
    sparse = k.mSparsityA != "Dense"
    if k.mSparsityA == "Any_1_2":
        return "1:2 sparsity"
    if k.mSparsityA == "Any_2_4" and kind not in ("Fp8Fp6Fp4", "MxFp8Fp6Fp4"):
        return "2:4 sparsity for this MMA kind"
    if k.mSparsityA == "Pairwise_4_8" and kind != "MxFp4NvFp4":
        return "4:8 sparsity for this MMA kind"
    if sparse:
        return "sparse kernels are not modelled"
    if kind == "Fp8Fp6Fp4" and k.mMmaK != 32:
        return "mmaK for f8f6f4"
    if blackwell:
        ldtm = (k.mEpilogueLdtmDps, k.mEpilogueLdtmBits)
        if ldtm not in ((16, 256), (32, 32)):
            return "LDTM shape"
        if k.mEpilogueTileM == 64 and k.mEpilogueLdtmDps != 16:
            return "LDTM for epilogueTileM 64"
        if k.mTransposeMmaOutput and ldtm != (16, 256):
            return "LDTM for transposed output"
    elif (k.mEpilogueLdtmDps, k.mEpilogueLdtmBits) != (16, 256):
        return "LDTM on Hopper"
    if (kind in ("MxFp4NvFp4", "MxFp8Fp6Fp4") or k.mDtypeC == "MxE4m3") and k.mMmaM != 128:
        if k.mClusterDimX == 1:
            return "mmaM must be 128 for block scaling"
        if not (k.mMmaM == 256 and k.mTileM == 128):
            return "2-CTA MMA shape"
    mma_tile_k = k.mMmaTileK if k.mMmaTileK != 0 else k.mTileK
    if mma_tile_k != k.mTileK and not k.mUseCustomizedMma3xNvFp4:
        return "mmaTileK != tileK"
    if kind in ("MxFp4NvFp4", "MxFp8Fp6Fp4"):
        if not blackwell:
            return "block scaling needs Blackwell"
        mma_k = 32
        if kind == "MxFp4NvFp4":
            mma_k = 96 if k.mMmaK == 96 else 64
        if k.mMmaK != mma_k:
            return "mmaK for block scaling"
        if not (k.mMmaN >= 64 or k.mMmaN == k.mTileN):
            return "mmaN < 64 and != tileN"
    mma3x_ok = kind == "MxFp4NvFp4" and mma_tile_k == 192 and k.mMmaK == 96 and k.mTileK == 256
    if k.mUseCustomizedMma3xNvFp4 and not (mma3x_ok and k.mUseMaxTmemOverlap):
        return "customized 3x NvFp4 MMA"
    sfa, sfb, sfc = k.mSfBlockSizeA, k.mSfBlockSizeB, k.mSfBlockSizeC
    if a == "E2m1" and b == "E4m3":
        if sfa not in (16, 32):
            return "sfBlockSizeA"
    elif a == "E2m1":
        if sfa != 16:
            return "sfBlockSizeA"
    elif a in ("MxE2m1", "MxE4m3", "MxInt4"):
        if sfa != 32:
            return "sfBlockSizeA"
    elif sfa > 0:
        return "sfBlockSizeA without block scales"
    if b == "E2m1":
        if sfb != 16:
            return "sfBlockSizeB"
    elif b in ("MxE2m1", "MxE4m3") or (b == "E4m3" and mb == "MxE4m3"):
        if sfb != 32:
            return "sfBlockSizeB"
    elif sfb > 0:
        return "sfBlockSizeB without block scales"
    c = k.mDtypeC
    if c == "E2m1":
        if sfc not in (16, 32):
            return "sfBlockSizeC"
    elif c in ("MxE2m1", "MxE4m3"):
        if sfc not in (32, 64):
            return "sfBlockSizeC"
    elif sfc > 0:
        return "sfBlockSizeC without block scales"
    if a in _BLOCK and k.mTileK % (4 * sfa) != 0:
        return "tileK vs SF block of A"
    if b in _BLOCK:
        if k.mSfLayoutB not in ("R128c4", "R8c4", "Linear"):
            return "SF layout of B"
        if k.mTileN % (128 if k.mSfLayoutB == "R128c4" else 8) != 0:
            return "tileN vs SF layout of B"
        if k.mTileK % (4 * sfb) != 0:
            return "tileK vs SF block of B"
    if c in _BLOCK:
        if not blackwell:
            return "block-scaled output needs Blackwell"
        if k.mSfLayoutC not in ("R128c4", "R8c4"):
            return "SF layout of C"
        if not k.mTransposeMmaOutput and k.mEpilogueTileN % sfc != 0:
            return "epilogueTileN vs SF block of C"
        token_tile = k.mTileN if k.mTransposeMmaOutput else k.mTileM
        if token_tile % (128 if k.mSfLayoutC == "R128c4" else 8) != 0:
            return "token tile vs SF layout of C"
        if k.mTransposeMmaOutput and not k.mUseShuffledMatrix:
            return "transposed block-scaled output needs shuffling"
    if k.mTileM % k.mEpilogueTileM != 0 or k.mTileN % k.mEpilogueTileN != 0:
        return "tile not divisible by epilogue tile"
    if not blackwell and (k.mEpilogueTileM != k.mTileM or k.mEpilogueTileN != k.mTileN):
        return "Hopper epilogue tile"
    if k.mMmaM == 128 and k.mEpilogueTileM != k.mTileM:
        return "mmaM 128 needs epilogueTileM == tileM"
    if k.mNumSlicesForSplitK <= 0:
        return "split-K slices"
    if not k.mSliceK:
        if k.mMmaM // (2 if k.mClusterDimX > 1 else 1) > k.mEpilogueTileM:
            return "epilogueTileM < mmaM"
    elif k.mTileN & (k.mTileN - 1):
        return "slice-K needs a power-of-two tileN"
    if k.mClusterDimX >= 2 and (k.mMmaM != 256 or k.mMmaN % 16):
        return "2-CTA MMA shape"
    if k.mClusterDimX not in (1, 2, 4) or k.mClusterDimY not in (1, 2, 4):
        return "cluster size"
    if not (k.mClusterDimZ == 1 or k.mNumSlicesForSplitK > 1):
        return "cluster Z without split-K"
    if k.mTileM > 128:
        return "tileM > 128"
    if k.mClusterDimY > 1 and k.mClusterDimX < 2:
        return "cluster Y without X"
    if (k.mClusterDimX > 2 or k.mClusterDimY > 1) and (not k.mUseTwoTmaLoadWarps or k.mClusterDimZ != 1):
        return "wide cluster"
    if k.mUseFlexibleClusterDims:
        fx, fy = k.mFallbackClusterDimX, k.mFallbackClusterDimY
        if not (k.mClusterDimX >= 2 and fx >= 2 and fy > 0):
            return "flexible cluster dims"
        if k.mClusterDimX % fx or k.mClusterDimY % fy:
            return "flexible cluster dims"
    if k.mAllReduceAlgo == "OneShot" and c not in ("UInt32", "Int32", "UInt64", "Fp32", "Fp16", "Bfloat16"):
        return "one-shot all-reduce dtype"
    if k.mAllReduceAlgo == "TwoShot" and c != k.mDtypeAcc:
        return "two-shot all-reduce dtype"
    if k.mAllReduceAlgo != "None" and not k.mUseTmaStore:
        return "all-reduce without TMA store"
    epilogue_is_tile = k.mEpilogueTileM == k.mTileM and k.mEpilogueTileN == k.mTileN
    if k.mNumSlicesForSplitK > 1 and not k.mUseDeepSeekFp8 and not epilogue_is_tile:
        return "split-K epilogue tile"
    if k.mSplitK == "Dsmem" and k.mClusterDimZ != k.mNumSlicesForSplitK:
        return "DSMEM split-K cluster"
    if k.mUseShuffledMatrix and not k.mTransposeMmaOutput:
        if k.mUseDeepSeekFp8 or k.mEpilogueLdtmBits != 32 or k.mEpilogueLdtmDps != 32:
            return "shuffled non-transposed output"
        if not k.mUseTmaStore or k.mSliceK or k.mEpilogueTileN < _shuffle_block(k.mEpilogueTileM):
            return "shuffled non-transposed output"
    within, across, mma_stages = k.mNumStagesMmaWithinWorkTile, k.mNumStagesMmaAcrossWorkTile, k.mNumStagesMma
    if within == -1 or across == -1:
        return "MMA stages unset"
    if within * across != mma_stages or across > 2:
        return "MMA stages"
    if not blackwell and mma_stages != 1:
        return "MMA stages on Hopper"
    persistent = k.mTileScheduler in ("Persistent", "StaticPersistent", "PersistentSm90")
    if not k.mUseDeepSeekFp8:
        if within != 1:
            return "MMA stages within a work tile"
        if mma_stages > 1 and not persistent:
            return "MMA stages need a persistent scheduler"
    else:
        if k.mClusterDimX != 1:
            return "2-CTA DeepSeek FP8"
        if not (a == "E4m3" and b == "E4m3") or not blackwell or k.mAllReduceAlgo != "None":
            return "DeepSeek FP8 dtypes"
        if k.mTileK != 128:
            return "DeepSeek FP8 tileK"
        if within <= 1:
            return "DeepSeek FP8 wants numStagesMmaWithinWorkTile 2"
        out_tile = k.mTileM if k.mTransposeMmaOutput else k.mTileN
        epi_tile = k.mEpilogueTileM if k.mTransposeMmaOutput else k.mEpilogueTileN
        mma_hidden = k.mMmaM if k.mTransposeMmaOutput else k.mMmaN
        if (out_tile // 2) % epi_tile or (out_tile // 2) % mma_hidden:
            return "DeepSeek FP8 output tile"
    if k.mNumEpilogueWarps not in (4, 8):
        return "epilogue warps"
    if k.mSliceK:
        if not blackwell or k.mUseDeepSeekFp8 or not k.mUseTwoTmaLoadWarps or not k.mTransposeMmaOutput:
            return "slice-K"
        if not k.mUseShuffledMatrix or k.mTileK % 128 or k.mMmaM != 128 or k.mTileN != k.mEpilogueTileN:
            return "slice-K"
        return "slice-K overwrites the tile (warning)"
    if k.mSchedHostTask != "Self" and not persistent:
        return "scheduler host task"
    if not blackwell and k.mTileScheduler == "Persistent":
        return "persistent scheduler on Hopper"
    if blackwell and not k.mUseCustomMmaSchedule and not k.mUseDeepSeekFp8 and persistent:
        return "persistent scheduler without custom MMA schedule"
    if k.mEnablesDelayedEarlyExit and k.mEnablesEarlyExit:
        return "both early exits"
    if (k.mGridTriggerSecondaryA and not k.mGridWaitForPrimaryA) or (
        k.mGridTriggerSecondaryB and not k.mGridWaitForPrimaryB
    ):
        return "PDL trigger without wait"
    pt_dtype = k.mPerTokenSfDtype
    if pt_dtype == "Void":
        pt_dtype = "Fp32" if (k.mUsePerTokenSfA and k.mUsePerTokenSfB) else "Bfloat16"
    if k.mUsePerTokenSfA or k.mUsePerTokenSfB:
        if k.mUseDeepSeekFp8 or not blackwell:
            return "per-token scaling"
        if k.mUsePerTokenSfA and k.mUsePerTokenSfB:
            if not (a == "E4m3" and b == "E4m3") or c not in ("Fp32", "Bfloat16", "Fp16"):
                return "Meta FP8"
        elif not ((k.mUsePerTokenSfA and not k.mTransposeMmaOutput) or (k.mUsePerTokenSfB and k.mTransposeMmaOutput)):
            return "per-token scales on the weights"
        if pt_dtype not in ("Fp32", "Bfloat16", "Fp16"):
            return "per-token SF dtype"
    la, lb = k.mLayoutA, k.mLayoutB
    if la != "MajorK" and lb != "MajorK":
        return "no K-major operand"
    if (la != "MajorK" or lb != "MajorK") and (not blackwell or k.mSplitK != "None"):
        return "non K-major layout"
    if la == "MajorMn" and _BITS[a] < 8:
        return "sub-byte M-major A"
    if lb == "MajorMn" and _BITS[b] < 8:
        return "sub-byte N-major B"
    if la == "BlockMajorK" or lb == "BlockMajorK":
        block_a = la == "BlockMajorK"
        pad = 2 if (kind == "MxFp8Fp6Fp4" and (a if block_a else b) == "MxE2m1") else 1
        elems_128b = 128 * 8 // _BITS[a if block_a else b]
        slices = pad * k.mTileK // elems_128b
        if slices > 2:
            if k.mBlockK != elems_128b // pad:
                return "blockK"
        elif k.mBlockK not in (elems_128b, elems_128b // pad):
            return "blockK"
        if k.mBlockK > k.mTileK and k.mBlockK % k.mTileK:
            return "blockK vs tileK"
        if k.mBlockK < k.mTileK and k.mTileK % k.mBlockK:
            return "tileK vs blockK"
    if k.mFusedBiasShuffleMode != "None" and (not k.mUseShuffledMatrix or k.mBiasType != "Mn"):
        return "fused bias shuffle"
    if k.mBiasType != "None" and (k.mUseDeepSeekFp8 or (k.mUsePerTokenSfA and k.mUsePerTokenSfB)):
        return "bias"
    if k.mBiasDtype not in ("Fp32", "Bfloat16", "Fp16"):
        return "bias dtype"
    if k.mUseMaxTmemOverlap and (
        not k.mUseTmaStore or k.mNumSlicesForSplitK != 1 or k.mNumSlicesForSliceK != 1 or k.mUseDeepSeekFp8
    ):
        return "max TMEM overlap"
    if k.mNumEpilogueWarps > 4:
        if not k.mUseTmaStore or k.mNumSlicesForSplitK != 1 or k.mNumSlicesForSliceK != 1 or k.mUseDeepSeekFp8:
            return "8 epilogue warps"
        if k.mTileN % (k.mEpilogueTileN * (k.mNumEpilogueWarps // 4)):
            return "8 epilogue warps"
    # --- GemmGatedActOptions (shape-free part)
    if k.mFusedAct:
        if k.mActType == "None":
            return "gated activation None"
        if k.mTransposeMmaOutput and not k.mUseShuffledMatrix:
            return "transposed gated output needs shuffling"
        epi_hidden = k.mEpilogueTileM if k.mTransposeMmaOutput else k.mEpilogueTileN
        if k.mUseTmaStore and (epi_hidden * _BITS[c] // 8) % 32:
            return "gated output tile bytes"
        if k.mNumSlicesForSplitK > 1 and k.mSplitK != "Dsmem":
            return "GMEM split-K with a gated activation"
    # --- BatchedGemmOptions (shape-free part); the kernels run batch-N (transposed).
    if k.mPrefetchB:
        return "prefetchB needs batch M"
    if not k.mTransposeMmaOutput:
        return "batch N needs a transposed MMA output"
    if k.mRouteSfsImpl is None:
        return "RouteSfsImpl unset"
    rs, ri = k.mRouteSfsImpl, k.mRouteImpl
    if rs != ri and not (rs in ("Ldgsts", "LdgPlusSts") and ri == "Tma"):
        return "RouteSfsImpl vs RouteImpl"
    if ri == "LdgPlusSts":
        return "LdgPlusSts cannot route tokens"
    if rs == "LdgPlusSts" and not (128 <= k.mTileK <= 512):
        return "LdgPlusSts tileK"
    if b == "MxE2m1" and kind == "MxFp8Fp6Fp4" and ri != "NoRoute":
        return "routing MxE2m1 activations"
    if k.mSchedHostTask in ("LoadB", "LoadSfB") and ri != "NoRoute":
        return "scheduler fused with a routing task"
    if not k.mUseTmaStore:
        return "TMA store only"
    if lb != "MajorK":
        return "activations must be K-major"
    if kind in ("MxFp8Fp6Fp4", "MxFp4NvFp4") and not k.mUseDeepSeekFp8:
        if ri != "NoRoute" and not (k.mSfLayoutB == "Linear" or b not in _BLOCK):
            return "routed tokens need linear SFs"
        if rs == "Tma" and k.mTileK % (sfb * 16):
            return "tileK vs routed SF block"
        if k.mSfLayoutA != "R128c4":
            return "SF layout of A"
    if k.mBiasType not in ("None", "Mn", "M"):
        return "bias type for batch N"
    if k.mIsUniformNumTokensPerBatch:
        return "uniform tokens per batch needs batched sizes"
    if k.mBatchStrideInTokens >= 0:
        return "batch stride without uniform tokens (warning)"
    return None


@dataclass(frozen=True)
class _ShapeRule:
    """The M/N/K-dependent checks of one kernel (batch N, transposed MMA output)."""

    tile_m: int
    tile_k: int
    m_mod: int  # M must be a multiple of this (tile, shuffle, gated, block-scaled output, DeepSeek)
    gated_sf_c: int  # for gated E2m1/MxE4m3 output: (M / 2) must be a multiple of this (0: none)
    k_sf_a: int  # ceil(K / sfBlockA) must be a multiple of 4 (0: none)
    k_sf_b: int  # floor(K / sfBlockB) must be a multiple of 4 (0: none)
    k_bits_a: int  # (bits * pad * K / 8) must be a multiple of 16 bytes
    k_bits_b: int
    k_mod: int  # K must be a multiple of this (DeepSeek, Ldg routing)
    split_k: int
    split_k_gmem: bool
    unroll2x: bool

    @staticmethod
    def of(k: _Kernel) -> _ShapeRule:
        mods = [k.mTileM]
        gated_sf_c = 0
        c, sfc = k.mDtypeC, k.mSfBlockSizeC
        if c in _BLOCK:
            mods += [4 * sfc, sfc]
        if k.mUseShuffledMatrix:
            mods.append(_shuffle_block(k.mEpilogueTileM))
        if k.mFusedAct:
            mods.append(2)
            if c in ("E2m1", "MxE4m3"):
                gated_sf_c = 4 * sfc
            if k.mUseDeepSeekFp8:
                mods.append(256)
            if k.mUseShuffledMatrix:
                mods.append(2 * _shuffle_block(k.mEpilogueTileM))
        if k.mUseDeepSeekFp8:
            mods.append(128)
        m_mod = 1
        for x in mods:
            m_mod = m_mod * x // _gcd(m_mod, x)
        pad_a = 2 if (k.mMmaKind == "MxFp8Fp6Fp4" and k.mDtypeA == "MxE2m1") else 1
        pad_b = 2 if (k.mMmaKind == "MxFp8Fp6Fp4" and k.mDtypeB == "MxE2m1") else 1
        kmods = [1]
        if k.mUseDeepSeekFp8:
            kmods += [k.mNumSlicesForSplitK * k.mTileK, k.mTileK, 128]
        rs = k.mRouteSfsImpl
        if k.mRouteImpl == "Ldgsts" and rs == "LdgPlusSts":
            kmods.append(k.mTileK)
        if rs in ("Ldgsts", "LdgPlusSts"):
            kmods.append(k.mTileK)
        k_mod = 1
        for x in kmods:
            k_mod = k_mod * x // _gcd(k_mod, x)
        return _ShapeRule(
            tile_m=k.mTileM,
            tile_k=k.mTileK,
            m_mod=m_mod,
            gated_sf_c=gated_sf_c,
            k_sf_a=k.mSfBlockSizeA if k.mDtypeA in _BLOCK else 0,
            k_sf_b=k.mSfBlockSizeB if k.mDtypeB in _BLOCK else 0,
            k_bits_a=pad_a * _BITS[k.mDtypeA],
            k_bits_b=pad_b * _BITS[k.mDtypeB],
            k_mod=k_mod,
            split_k=k.mNumSlicesForSplitK,
            split_k_gmem=k.mSplitK == "Gmem",
            unroll2x=bool(k.mUseUnrollLoop2xForMma),
        )

    def ok(self, m: int, n: int, k: int) -> bool:
        if m < self.tile_m or m % self.m_mod or k % self.k_mod:
            return False
        if self.gated_sf_c and (m // 2) % self.gated_sf_c:
            return False
        if self.k_sf_a and _div_up(k, self.k_sf_a) % 4:
            return False
        if self.k_sf_b and (k // self.k_sf_b) % 4:
            return False
        if (self.k_bits_a * k // 8) % 16 or (self.k_bits_b * k // 8) % 16:
            return False
        if self.split_k_gmem and (m * n) % 4:
            return False
        tk, s = self.tile_k, self.split_k
        padded_k = _div_up(k, tk * s) * tk * s
        per_cta_k = padded_k // s
        if self.unroll2x:
            clamped = _div_up(per_cta_k - (padded_k - k), tk) * tk
            if per_cta_k % (2 * tk) or clamped % (2 * tk):
                return False
        return s == 1 or per_cta_k * (s - 1) < k


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


# --------------------------------------------------------------------------- step 4
@dataclass(frozen=True)
class ModelAnswer:
    """The model's answer: configs ((tile_N, config index), ...) in the op's order, or an error."""

    configs: tuple[tuple[int, int], ...]
    per_tile: dict[int, int]
    error: Optional[str] = None

    @property
    def count(self) -> int:
        return len(self.configs)


@functools.lru_cache(maxsize=65536)
def _tile_answer(table: KernelTable, lau: _Launch, tile: int, hidden: int, inter: int, tokens: int) -> tuple[int, ...]:
    p1 = table.passing(lau.gemm1(tile))
    p2 = table.passing(lau.gemm2(tile))
    if not p1 or not p2:
        opts = lau.gemm1(tile) if not p1 else lau.gemm2(tile)
        raise Rejected(
            "no kernel in this kernel set for these options "
            f"(mDtypeA={opts.dtype_a}, mDtypeB={opts.dtype_b}, mDtypeC={opts.dtype_c}, "
            f"mUseDeepSeekFp8={int(opts.deepseek)}, mActType={opts.act_type}, mEltwiseActType={opts.eltwise}, "
            f"mFusedAct={int(opts.fused_act)}, tile={tile})"
        )
    g = 2 if lau.activation in _GATED else 1
    ok1 = [i for i, idx in enumerate(p1) if table.valid(idx, g * inter, tokens, hidden)]
    ok2 = [j for j, idx in enumerate(p2) if table.valid(idx, hidden, tokens, inter)]
    n2 = len(p2)
    return tuple(i * n2 + j for i in ok1 for j in ok2)


def answer(
    table: KernelTable,
    dtype_act: str,
    dtype_weights: str,
    fp8_quant: str,
    activation: str,
    layout: str,
    per_token: bool,
    hidden: int,
    intermediate: int,
    experts: int,
    top_k: int,
    tokens: int,
    sm: int = 100,
) -> ModelAnswer:
    """The op's answer for one query (FlashInfer enum member names; sizes >= 1).

    Equals ``trtllm_get_valid_moe_configs(...)`` with ``use_shuffled_weight=True`` and no
    LoRA delta, on a device of SM version ``sm`` (100: B200/GB200, what the module runs as
    through the shim; 103: B300/GB300, which takes the SM103 builds of the patched-F2FP
    MxFP4 kernels): ``configs`` is the list of (tile_N, config index); ``error`` is set (and
    ``configs`` empty) where the op raises instead.
    """
    try:
        lau = dataclasses.replace(
            launch(dtype_act, dtype_weights, fp8_quant, activation, layout, True, per_token), sm=sm
        )
        configs: list[tuple[int, int]] = []
        per_tile: dict[int, int] = {}
        for tile in tile_candidates(lau.ladder, tokens, top_k, experts):
            idx = _tile_answer(table, lau, tile, hidden, intermediate, tokens)
            configs.extend((tile, i) for i in idx)
            if idx:
                per_tile[tile] = len(idx)
        return ModelAnswer(tuple(configs), per_tile)
    except Rejected as e:
        return ModelAnswer((), {}, error=str(e))
