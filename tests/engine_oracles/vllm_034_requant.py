"""vLLM 0.34's FP8 per-tensor W13 requantization (``process_fp8_weight_tensor_strategy_moe``,
``vllm/model_executor/layers/quantization/utils/fp8_utils.py:1537``) run on the CPU: its own loop, ``max`` and
``per_tensor_dequantize`` (``w8a8_utils.py:44``); only ``ops.scaled_fp8_quant`` is a CUDA kernel
(``static_scaled_fp8_quant``), here transcribed from its source: ``x * (1.0f / scale)``,
``fminf(fmaxf(x, -448), 448)``, round to nearest even. On the CPU PyTorch multiplies by the float32 scale where
CUDA reads it as float16, so the inputs' scales are float16 values (the two agree on them).

Usage: ``python vllm_034_requant.py DIR`` with ``DIR/inputs.safetensors`` (``w13`` float8_e4m3fn ``(E, 2I, H)``,
``scales`` float32 ``(E, 2)``); writes ``DIR/outputs.safetensors`` (``w13`` as bytes, ``scale``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _isolate import isolate  # noqa: E402

L = "vllm.model_executor.layers."
isolate(
    "vllm",
    [L + "quantization.utils.fp8_utils", L + "quantization.utils.w8a8_utils", L + "quantization.utils.quant_utils"],
)

from vllm.model_executor.layers.quantization.utils import fp8_utils  # noqa: E402


def static_scaled_fp8_quant(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The CUDA kernel's arithmetic (csrc/quantization/w8a8/fp8/common.cu, per-tensor static scale)."""
    y = x.to(torch.float32) * torch.reciprocal(scale.to(torch.float32))
    y = torch.where(y.isnan(), torch.full_like(y, -448.0), y.clamp(-448.0, 448.0))  # fminf(fmaxf(NaN, -448), 448)
    return y.to(torch.float8_e4m3fn), scale


def main(d: Path) -> None:
    t = load_file(str(d / "inputs.safetensors"))
    fp8_utils.ops = SimpleNamespace(scaled_fp8_quant=static_scaled_fp8_quant)
    w13 = t["w13"].clone()
    w, m = fp8_utils.process_fp8_weight_tensor_strategy_moe(w13, t["scales"], w13.shape[1] // 2, w13.shape[0])
    save_file({"w13": w.contiguous().view(torch.uint8), "scale": m.contiguous()}, str(d / "outputs.safetensors"))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
