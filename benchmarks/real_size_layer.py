"""Write a one-MoE-layer checkpoint with real DeepSeek-R1 (NVFP4) or DeepSeek-V3 (FP8-block) sizes.

The shipped samples (``data/samples/deepseek-r1-nvfp4``, ``deepseek-v3-fp8``) give the tensor names,
dtypes and ``config.json``; the sizes are replaced by the real model's (hidden 7168, MoE intermediate
2048, 256 routed experts) and every weight and scale is random bytes (scales drawn from normal-range
E4M3 codes, FP8-block scales positive floats), streamed to one safetensors shard a tensor at a time
(never the whole layer in memory). The R1 layer is ~6.3 GB, the V3 one ~11.5 GB: write them outside
the repository and reuse them.

    python benchmarks/real_size_layer.py /tmp/r1-layer --format nvfp4
    python benchmarks/real_size_layer.py /tmp/v3-layer --format fp8-block --experts 64
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = {"nvfp4": "deepseek-r1-nvfp4", "fp8-block": "deepseek-v3-fp8"}
SIZES = dict(hidden_size=7168, moe_intermediate_size=2048, n_routed_experts=256)


def _tensors(fmt: str, experts: int, hidden: int, inter: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(name, safetensors dtype, shape)`` of layer 0's routed experts and router, in file order."""
    out = []
    for e in range(experts):
        for proj, (rows, cols) in (
            ("gate_proj", (inter, hidden)),
            ("up_proj", (inter, hidden)),
            ("down_proj", (hidden, inter)),
        ):
            base = f"model.layers.0.mlp.experts.{e}.{proj}"
            if fmt == "nvfp4":
                out += [
                    (f"{base}.weight", "U8", (rows, cols // 2)),
                    (f"{base}.weight_scale", "F8_E4M3", (rows, cols // 16)),
                    (f"{base}.weight_scale_2", "F32", ()),
                    (f"{base}.input_scale", "F32", ()),
                ]
            else:
                out += [
                    (f"{base}.weight", "F8_E4M3", (rows, cols)),
                    (f"{base}.weight_scale_inv", "F32", (-(-rows // 128), -(-cols // 128))),
                ]
    out += [("model.layers.0.mlp.gate.weight", "BF16", (experts, hidden))]
    out += [("model.layers.0.mlp.gate.e_score_correction_bias", "F32", (experts,))]
    return out


ITEMSIZE = {"U8": 1, "F8_E4M3": 1, "F32": 4, "BF16": 2}


def _bytes(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> bytes:
    n = int(np.prod(shape, dtype=np.int64))
    if dtype == "U8":
        return rng.bytes(n)
    if dtype == "F8_E4M3":  # normal-range codes, both signs for weights: no NaN code (0x7f / 0xff)
        codes = rng.integers(0x20, 0x48, n, dtype=np.uint8)
        return codes.tobytes()
    if dtype == "F32":
        return (rng.random(n, dtype=np.float32) * 1e-3 + 1e-4).tobytes()
    wide = (rng.standard_normal(n, dtype=np.float32) * 0.02).view(np.uint32)
    return (wide >> 16).astype(np.uint16).tobytes()  # BF16: the top half of each float32


def write_layer(
    out: Path, fmt: str = "nvfp4", experts: int = 256, hidden: int = 7168, inter: int = 2048, seed: int = 0
) -> Path:
    """Write the checkpoint directory ``out`` (config.json, index, one shard); returns ``out``."""
    out.mkdir(parents=True, exist_ok=False)
    src = ROOT / "data" / "samples" / SAMPLE[fmt]
    config = json.loads((src / "config.json").read_text())
    config.update(SIZES, hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=experts)
    config.update(num_hidden_layers=1, first_k_dense_replace=0)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    if (src / "hf_quant_config.json").exists():
        (out / "hf_quant_config.json").write_text((src / "hf_quant_config.json").read_text())
    tensors = _tensors(fmt, experts, hidden, inter)
    header: dict = {}
    at = 0
    for name, dtype, shape in tensors:
        n = int(np.prod(shape, dtype=np.int64)) * ITEMSIZE[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    shard = "model-00001-of-00001.safetensors"
    rng = np.random.default_rng(seed)
    with open(out / shard, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, dtype, shape in tensors:
            f.write(_bytes(rng, dtype, shape))
    index = {"metadata": {"total_size": at}, "weight_map": {name: shard for name, _, _ in tensors}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, help="new directory to write")
    ap.add_argument("--format", choices=sorted(SAMPLE), default="nvfp4")
    ap.add_argument("--experts", type=int, default=SIZES["n_routed_experts"])
    ap.add_argument("--hidden", type=int, default=SIZES["hidden_size"])
    ap.add_argument("--intermediate", type=int, default=SIZES["moe_intermediate_size"])
    args = ap.parse_args()
    if args.out.exists():
        print(f"error: {args.out} exists (fix: pick a new directory)", file=sys.stderr)
        return 2
    write_layer(args.out, args.format, args.experts, args.hidden, args.intermediate)
    print(f"{args.out}: {sum(os.path.getsize(p) for p in args.out.iterdir()) / 1e9:.2f} GB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
