#!/usr/bin/env python
"""Build the CUDA kernels that ship prebuilt (``fimoe_lab/kernels/cuda/*.cu`` -> ``*.fatbin``).

Each source becomes one compressed fatbin holding SASS for every architecture of :data:`ARCHS` and
PTX for :data:`PTX_ARCH` (the driver compiles that once for a newer GPU). ``BUILD.json`` beside them
records, per source, its SHA-256 (and each shared ``.cuh`` header's), the nvcc release and the flags,
so a test can check that the shipped binary is this source's build (nvcc's output is byte-for-byte the
same for the same release, source and flags). Run after changing a ``.cu`` file::

    python scripts/build_cuda_kernels.py            # writes fimoe_lab/kernels/cuda/*.fatbin and BUILD.json
    python scripts/build_cuda_kernels.py --out DIR  # elsewhere (the test's rebuild)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1] / "fimoe_lab" / "kernels" / "cuda"
ARCHS = (80, 90, 100, 120)
"""SASS targets: A100, H100/H200, B200/GB200, RTX Blackwell."""
PTX_ARCH = 90
FLAGS = ["-fatbin", "-O3", "--compress-mode=size", "-std=c++17"]


def nvcc_release(nvcc: str = "nvcc") -> str:
    """``13.0`` from ``nvcc --version``."""
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    found = re.search(r"release (\d+\.\d+)", out)
    if not found:
        raise RuntimeError(f"cannot read the release from nvcc --version: {out!r}")
    return found.group(1)


def flags() -> list[str]:
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS]
    return FLAGS + gencode + [f"-gencode=arch=compute_{PTX_ARCH},code=compute_{PTX_ARCH}"]


def build(out: Path, nvcc: str = "nvcc") -> dict:
    """Build every ``.cu`` of :data:`KERNELS` into ``out``; returns the build record."""
    out.mkdir(parents=True, exist_ok=True)
    record: dict = {"nvcc": nvcc_release(nvcc), "flags": flags(), "sources": {}}
    record["headers"] = {h.name: hashlib.sha256(h.read_bytes()).hexdigest() for h in sorted(KERNELS.glob("*.cuh"))}
    for cu in sorted(KERNELS.glob("*.cu")):
        target = out / f"{cu.stem}.fatbin"
        subprocess.run([nvcc, *flags(), "-o", str(target), str(cu)], check=True)
        record["sources"][cu.name] = {
            "sha256": hashlib.sha256(cu.read_bytes()).hexdigest(),
            "fatbin": target.name,
            "fatbin_sha256": hashlib.sha256(target.read_bytes()).hexdigest(),
        }
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=KERNELS, help="where the fatbins go (default: beside the sources)")
    ap.add_argument("--nvcc", default="nvcc")
    args = ap.parse_args(argv)
    record = build(args.out, args.nvcc)
    (args.out / "BUILD.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
