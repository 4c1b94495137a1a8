"""Record FlashInfer's SM90 mixed-input weight interleave on a GPU as a golden set (JSON + safetensors).

``flashinfer.fused_moe.interleave_moe_weights_for_sm90_mixed_gemm`` runs on CUDA only, so fimoe_lab's
``steps.sm90_mixed_weight_map`` (and the drop-in ``prepare.interleave_moe_weights_for_sm90_mixed_gemm``) is
checked on the CPU against a loop transcribed from its kernel source; this script records what the kernel
itself writes, for ``tests/test_sm90_mixed.py::test_against_flashinfer_cuda_golden`` and the generic replay
(``fimoe-lab goldens``, ``tests/test_goldens.py``) to compare byte for byte.

    python scripts/golden_sm90_mixed.py                  # on a GPU machine with FlashInfer >= 0.6.16
    python scripts/golden_sm90_mixed.py --out DIR        # elsewhere than shared/goldens beside the checkout

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


def inputs(quant_type: str, small: bool = False) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(2026)
    named = []
    for e, n, kb in SHAPES[:3] if small else SHAPES:
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT.parent / "shared" / "goldens", help="folder of the golden set")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: fimoe_lab's own outputs, to check the format")
    ap.add_argument("--small", action="store_true", help="only the three smallest shapes")
    args = ap.parse_args(argv)
    if args.dry_run and args.out == ap.get_default("out"):
        sys.exit("error: --dry-run writes fimoe_lab's own bytes, not a golden (fix: pass --out to a scratch folder)")
    weights_op, scales_op, meta, device = reference(args.dry_run)
    w = Writer()
    for quant_type in ("fp4", "fp4_fp8", "int4"):
        try:
            weights_op(torch.zeros(1, 16, 32, dtype=torch.uint8, device=device), quant_type)
        except ValueError as exc:  # an older 0.6.x has no fp4_fp8
            print(f"skipping quant_type {quant_type}: {exc}")
            continue
        for name, x in inputs(quant_type, args.small):
            y = weights_op(x.to(device), quant_type)
            w.add(
                name, "interleave_moe_weights_for_sm90_mixed_gemm", {"weight": x, "quant_type": quant_type}, [y], meta
            )
    g = torch.Generator().manual_seed(7)
    for rows, cols in ((64, 4), (1536, 92)):
        s = torch.randint(0, 256, (2, rows, cols), generator=g, dtype=torch.uint8)
        y = scales_op(s.to(device), 32)
        name = f"sm90_mixed_scales_R{rows}_C{cols}"
        w.add(name, "interleave_moe_scales_for_sm90_mixed_gemm", {"scales": s, "group_size": 32}, [y], meta)
    w.write(args.out)
    print(f"wrote {len(w.cases)} cases to {args.out / 'sm90_mixed.json'} (+ .safetensors); {json.dumps(meta)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
