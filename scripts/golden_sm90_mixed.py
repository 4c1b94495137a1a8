"""Record FlashInfer's SM90 mixed-input weight interleave on a GPU as a golden set (JSON + safetensors).

``flashinfer.fused_moe.interleave_moe_weights_for_sm90_mixed_gemm`` runs on CUDA only, so fimoe_lab's
``steps.sm90_mixed_weight_map`` (and the drop-in ``prepare.interleave_moe_weights_for_sm90_mixed_gemm``) is
checked on the CPU against a loop transcribed from its kernel source; this script records what the kernel
itself writes, for ``tests/test_sm90_mixed.py::test_against_flashinfer_cuda_golden`` and the generic replay
(``fimoe-lab goldens``, ``tests/test_goldens.py``) to compare byte for byte.

    python scripts/golden_sm90_mixed.py                  # on a GPU machine with FlashInfer >= 0.6.16
    python scripts/golden_sm90_mixed.py --out DIR        # elsewhere than shared/goldens beside the checkout
    python scripts/golden_sm90_mixed.py --kernel-source DIR --out data/goldens   # FlashInfer's kernel file, built here

``--kernel-source DIR``: where FlashInfer itself cannot be imported or its JIT would build the whole SM90
CUTLASS fused-MoE module (many minutes), the op's own CUDA file is compiled instead. ``DIR`` holds
``moe_gemm_mixed_utils.cu`` and ``.h`` from the wheel (``flashinfer/data/csrc/nv_internal/tensorrt_llm/kernels/
cutlass_kernels/moe_gemm/``) and a ``VERSION`` file naming the wheel; ``nvcc -arch=sm_90`` builds them with a
small launcher that calls the file's host function once per expert on the default stream, as FlashInfer's
binding does (``[E, n, k/2]`` bytes, expert ``e`` at offset ``e * n * k/2``). Only the weights op is recorded
(the scales op is torch code, checked against the wheel on the CPU), over ``KERNEL_SHAPES`` (small enough to
commit: ``data/goldens/`` in the checkout).

Writes ``DIR/sm90_mixed.json`` + ``DIR/sm90_mixed.safetensors`` in the format of ``fimoe_lab/goldens.py``
(cases ``{"name", "fn", "inputs", "outputs", "error", "hidden", "meta"}``, tensors as ``{"dtype", "t"}``
naming safetensors entries). Cases, every ``quant_type`` the installed FlashInfer takes (``fp4``,
``fp4_fp8``, ``int4``): random bytes, nibbles that encode their coordinates, and, on one 16 x 64-value
block, inputs whose bits encode their own bit index (input ``k``: bit ``i`` is bit ``k`` of ``i``; the
outputs together give the op's whole bit permutation), over shapes from one block to a gpt-oss TP4
shard (W13 ``[1536, 1472]`` bytes after vLLM's padding); plus two ``interleave_moe_scales_for_sm90_mixed_gemm``
cases. ``meta`` records the FlashInfer and torch versions, the GPU and the layout (``"0.6.16"``).
FlashInfer < 0.6.16 has the earlier (0.6.10) layout and is refused: the generic replay would compare
its bytes with the 0.6.16 drop-in. ``--dry-run`` (no GPU) writes the same files from fimoe_lab itself,
marked ``"reference": "fimoe_lab dry run"``, only to check the format; never copy those into goldens.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
SHAPES = [(2, 16, 32), (3, 48, 96), (2, 128, 64), (2, 64, 1472), (2, 1536, 1472)]
"""(experts, n, k/2): one block, odd multiples, long rows, a gpt-oss W2 / W13 TP4 shard (2880/4 -> 768)."""
KERNEL_SHAPES = [(2, 16, 32), (3, 48, 96), (2, 128, 64), (2, 64, 1472), (1, 512, 1472)]
"""The committed set's shapes: the same kinds, the last cut to one expert and 512 rows and recorded for
``fp4`` random bytes only (``kernel_case_kept``): 61 cases, 4.2 MB."""


def kernel_case_kept(name: str) -> bool:
    """The committed set keeps the largest shape once (``fp4``, random bytes)."""
    return "_E1_N512_" not in name or name.startswith("sm90_mixed_weights_fp4_random_")


LAUNCHER = r"""
#include <cstdint>
#include <cuda_runtime.h>
#include "moe_gemm_mixed_utils.h"
namespace ck = tensorrt_llm::kernels::cutlass_kernels;
// One call per expert on the default stream; returns the CUDA error after a synchronize (0: none).
extern "C" int fimoe_golden_sm90_interleave(uint8_t* src, uint8_t* dst, long experts, long n, long k, int qt) {
  long per_expert = n * (k / 2);
  for (long e = 0; e < experts; ++e) {
    uint8_t* s = src + e * per_expert;
    uint8_t* d = dst + e * per_expert;
    if (qt == 1) ck::interleave_fp4_weights_for_sm90_mixed_gemm(s, d, (int)n, (int)k, 0);
    else if (qt == 2) ck::interleave_fp4_fp8_weights_for_sm90_mixed_gemm(s, d, (int)n, (int)k, 0);
    else ck::interleave_int4_weights_for_sm90_mixed_gemm(s, d, (int)n, (int)k, 0);
  }
  return (int)cudaDeviceSynchronize();
}
"""
QUANT_TYPES = {"int4": 0, "fp4": 1, "fp4_fp8": 2}
"""FlashInfer's ``quant_type`` argument -> the binding's integer (its ``qtype_map``)."""


def version_tuple(v: str) -> tuple[int, ...]:
    """``"0.6.16rc1"`` -> ``(0, 6, 16)``: the leading number of each dotted part, up to the first non-number."""
    parts = []
    for p in v.split("+")[0].split("."):
        m = re.match(r"\d+", p)
        if m is None:
            break
        parts.append(int(m.group()))
        if m.end() != len(p):
            break
    return tuple(parts)


def nibble_coordinates(e: int, n: int, kb: int) -> torch.Tensor:
    """Value at (expert, row, value v) = (3 e + 5 row + v) % 16, packed two per byte (low nibble first)."""
    ee = torch.arange(e)[:, None, None]
    r = torch.arange(n)[None, :, None]
    v = torch.arange(2 * kb)[None, None, :]
    nib = (3 * ee + 5 * r + v) % 16
    return (nib[..., 0::2] | (nib[..., 1::2] << 4)).to(torch.uint8)


def bit_coordinates(n: int, kb: int) -> list[torch.Tensor]:
    """Inputs ``(1, n, kb)`` whose bit ``i`` (8 * byte + bit) is bit ``k`` of ``i``, one per ``k``."""
    bits = n * kb * 8
    idx = torch.arange(bits)
    out = []
    for k in range(max(1, (bits - 1).bit_length())):
        b = ((idx >> k) & 1).reshape(-1, 8)
        out.append((b << torch.arange(8)).sum(1).to(torch.uint8).reshape(1, n, kb))
    return out


def inputs(quant_type: str, shapes: list[tuple[int, int, int]]) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(2026)
    named = []
    for e, n, kb in shapes:
        named.append((f"random_E{e}_N{n}_K{2 * kb}", torch.randint(0, 256, (e, n, kb), generator=g, dtype=torch.uint8)))
        named.append((f"coords_E{e}_N{n}_K{2 * kb}", nibble_coordinates(e, n, kb)))
    named += [(f"bitcoord{k}_N16_K64", x) for k, x in enumerate(bit_coordinates(16, 32))]
    return [(f"sm90_mixed_weights_{quant_type}_{name}", x) for name, x in named]


class Writer:
    """Collects cases and their tensors in the golden format."""

    def __init__(self) -> None:
        self.cases: list[dict[str, Any]] = []
        self.tensors: dict[str, torch.Tensor] = {}

    def tensor(self, key: str, t: torch.Tensor) -> dict[str, Any]:
        self.tensors[key] = t.detach().cpu().contiguous()
        return {"dtype": str(t.dtype), "t": {"tensor": key}}

    def add(self, name: str, fn: str, args: dict[str, Any], outputs: list[torch.Tensor], meta: dict) -> None:
        i = len(self.cases)
        enc = {k: self.tensor(f"{i}/inputs/{k}/t", v) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        outs = [self.tensor(f"{i}/outputs/{j}/t", o) for j, o in enumerate(outputs)]
        self.cases.append(
            {"name": name, "fn": fn, "inputs": enc, "outputs": outs, "error": None, "hidden": False, "meta": meta}
        )

    def write(self, out: Path, stem: str = "sm90_mixed") -> None:
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        save_file(self.tensors, str(out / f"{stem}.safetensors"))
        (out / f"{stem}.json").write_text(json.dumps(self.cases, indent=1))


def reference(dry_run: bool) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor], dict, str]:
    """FlashInfer's two ops (or fimoe_lab's with ``dry_run``), the meta record and the device."""
    if dry_run:
        from fimoe_lab import prepare

        meta = {"reference": "fimoe_lab dry run", "layout": "0.6.16", "torch": torch.__version__}
        return (
            prepare.interleave_moe_weights_for_sm90_mixed_gemm,
            prepare.interleave_moe_scales_for_sm90_mixed_gemm,
            meta,
            "cpu",
        )
    if not torch.cuda.is_available():
        sys.exit(
            "error: FlashInfer's interleave_moe_weights_for_sm90_mixed_gemm runs on CUDA only (fix: run on a GPU machine)"
        )
    import flashinfer
    from flashinfer.fused_moe import interleave_moe_scales_for_sm90_mixed_gemm as scales_op
    from flashinfer.fused_moe import interleave_moe_weights_for_sm90_mixed_gemm as weights_op

    if version_tuple(flashinfer.__version__) < (0, 6, 16):
        sys.exit(
            f"error: FlashInfer {flashinfer.__version__} has the 0.6.10 weight layout, the drop-in follows 0.6.16+ "
            "(fix: pip install 'flashinfer-python>=0.6.16', e.g. 0.7.4)"
        )
    meta = {
        "reference": "flashinfer",
        "flashinfer": flashinfer.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "layout": "0.6.16",
    }
    return weights_op, scales_op, meta, "cuda"


def kernel_reference(src: Path) -> tuple[Callable[..., torch.Tensor], dict]:
    """FlashInfer's ``moe_gemm_mixed_utils.cu`` (from ``src``) built with nvcc for sm_90 and loaded with ctypes."""
    import ctypes
    import shutil
    import subprocess
    import tempfile

    if not torch.cuda.is_available():
        sys.exit("error: the kernel runs on CUDA only (fix: run on a GPU machine)")
    missing = [f for f in ("moe_gemm_mixed_utils.cu", "moe_gemm_mixed_utils.h", "VERSION") if not (src / f).is_file()]
    if missing or shutil.which("nvcc") is None:
        sys.exit(f"error: --kernel-source needs nvcc and {', '.join(missing) or 'its files'} in {src} (see --help)")
    build = Path(tempfile.mkdtemp(prefix="golden_sm90_"))
    (build / "launcher.cu").write_text(LAUNCHER)
    lib = build / "libgolden_sm90.so"
    cmd = ["nvcc", "-O2", "-arch=sm_90", "-shared", "-Xcompiler", "-fPIC", f"-I{src}"]
    cmd += [str(src / "moe_gemm_mixed_utils.cu"), str(build / "launcher.cu"), "-o", str(lib)]
    subprocess.run(cmd, check=True)
    fn = ctypes.CDLL(str(lib)).fimoe_golden_sm90_interleave
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_int]

    def weights_op(weight: torch.Tensor, quant_type: str) -> torch.Tensor:
        x = weight.contiguous()
        e, n, kb = x.shape
        if n % 16 or (2 * kb) % 64:  # the binding's own checks
            raise ValueError(f"n={n} must divide by 16 and k={2 * kb} by 64")
        out = torch.empty_like(x)
        torch.cuda.synchronize()
        err = fn(x.data_ptr(), out.data_ptr(), e, n, 2 * kb, QUANT_TYPES[quant_type])
        if err:
            raise RuntimeError(f"CUDA error {err} in the interleave kernel")
        return out

    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    meta = {
        "reference": "flashinfer",
        "flashinfer": (src / "VERSION").read_text().strip(),
        "build": f"moe_gemm_mixed_utils.cu from the wheel, nvcc -arch=sm_90 ({nvcc}); one launch per expert",
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "layout": "0.6.16",
    }
    return weights_op, meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT.parent / "shared" / "goldens", help="folder of the golden set")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: fimoe_lab's own outputs, to check the format")
    ap.add_argument("--small", action="store_true", help="only the three smallest shapes")
    ap.add_argument("--kernel-source", type=Path, help="build FlashInfer's kernel file from this folder (see above)")
    args = ap.parse_args(argv)
    if args.dry_run and args.out == ap.get_default("out"):
        sys.exit("error: --dry-run writes fimoe_lab's own bytes, not a golden (fix: pass --out to a scratch folder)")
    shapes = SHAPES[:3] if args.small else SHAPES
    scales_op: Callable[..., torch.Tensor] | None
    if args.kernel_source is not None:
        (weights_op, meta), scales_op, device = kernel_reference(args.kernel_source), None, "cuda"
        shapes = KERNEL_SHAPES[:3] if args.small else KERNEL_SHAPES
    else:
        weights_op, scales_op, meta, device = reference(args.dry_run)
    w = Writer()
    for quant_type in ("fp4", "fp4_fp8", "int4"):
        try:
            weights_op(torch.zeros(1, 16, 32, dtype=torch.uint8, device=device), quant_type)
        except ValueError as exc:  # an older 0.6.x has no fp4_fp8
            print(f"skipping quant_type {quant_type}: {exc}")
            continue
        for name, x in inputs(quant_type, shapes):
            if args.kernel_source is not None and not kernel_case_kept(name):
                continue
            y = weights_op(x.to(device), quant_type)
            w.add(
                name, "interleave_moe_weights_for_sm90_mixed_gemm", {"weight": x, "quant_type": quant_type}, [y], meta
            )
    g = torch.Generator().manual_seed(7)
    for rows, cols in ((64, 4), (1536, 92)) if scales_op is not None else ():
        s = torch.randint(0, 256, (2, rows, cols), generator=g, dtype=torch.uint8)
        y = scales_op(s.to(device), 32)
        name = f"sm90_mixed_scales_R{rows}_C{cols}"
        w.add(name, "interleave_moe_scales_for_sm90_mixed_gemm", {"scales": s, "group_size": 32}, [y], meta)
    w.write(args.out)
    print(f"wrote {len(w.cases)} cases to {args.out / 'sm90_mixed.json'} (+ .safetensors); {json.dumps(meta)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
