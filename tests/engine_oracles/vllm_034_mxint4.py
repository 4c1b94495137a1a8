"""Run vLLM 0.34.0's ``prepare_static_weights_for_trtllm_mxint4_moe`` on checkpoint int4 tensors, in .venv-vllm.

Usage: ``python vllm_034_mxint4.py DIR`` with ``DIR/inputs.safetensors`` holding, per case ``<name>.``:
``w13`` int32 ``[E, 2I, H/8]`` and ``w2`` int32 ``[E, H, I/8]`` (the compressed-tensors ``weight_packed``
words, ``uint4b8``: each 4-bit value stored as ``q + 8``, stacked ``[gate; up]`` as vLLM's loader does),
``s13`` / ``s2`` bf16 scales; and ``DIR/cases.json`` the case names. Writes ``DIR/outputs.safetensors`` (per
case the four results as flat bytes) and ``DIR/outputs.json`` (shapes, or the case's error).

This is vLLM's path from a checkpoint: int32 weights, so that vLLM itself converts ``uint4b8`` to signed
int4 (``convert_packed_uint4b8_to_signed_int4_inplace``) before the layout. CPU substitutions, each for a
CUDA-only call: those of ``vllm_034.py`` (FlashInfer's ``block_scale_interleave`` served by the same
128x4 reshape/permute on 2-byte elements; ``Tensor.cuda`` the identity), and the int32 weights are handed
in as a tensor subclass whose ``is_cuda`` is True, because the conversion asserts ``t.is_cuda`` and runs
only plain torch bit operations (so vLLM's own code runs, on the CPU).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_034 as base  # noqa: E402  (isolates vLLM's modules and installs the CPU substitutions)


class _ReportsCuda(torch.Tensor):
    """A CPU tensor whose ``is_cuda`` is True (the uint4b8 conversion's only CUDA requirement is that assert)."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def run(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    w13, w2 = t["w13"].clone().as_subclass(_ReportsCuda), t["w2"].clone().as_subclass(_ReportsCuda)
    r = base.mxint4.prepare_static_weights_for_trtllm_mxint4_moe(w13, t["s13"].clone(), w2, t["s2"].clone())
    out = {"w13": r["gemm1_weights"], "w2": r["gemm2_weights"], "s13": r["gemm1_scales"], "s2": r["gemm2_scales"]}
    return {k: v.as_subclass(torch.Tensor) for k, v in out.items()}


def main(d: Path) -> None:
    names = json.loads((d / "cases.json").read_text())
    tensors = load_file(str(d / "inputs.safetensors"))
    outputs, meta = {}, {}
    for name in names:
        prefix = name + "."
        mine = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        try:
            out = run(mine)
        except Exception as exc:  # one case's failure is that case's answer, not the run's
            meta[name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        for k, v in out.items():
            outputs[prefix + k] = v.contiguous().view(torch.uint8).reshape(-1).clone()
        meta[name] = {"shapes": {k: list(v.shape) for k, v in out.items()}}
    save_file(outputs, str(d / "outputs.safetensors"))
    (d / "outputs.json").write_text(json.dumps(meta))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
