"""gpt-oss MXFP4 TRT-LLM layout vs vLLM's recipe run with FlashInfer's own CPU index functions."""

from __future__ import annotations

import pytest
import torch
from conftest import HAS_FLASHINFER
from safetensors import safe_open

from fimoe_lab import steps
from fimoe_lab.checkpoints import convert_checkpoint, sample_path

pytestmark = pytest.mark.flashinfer

if HAS_FLASHINFER:
    from flashinfer.fused_moe.core import get_w2_permute_indices_with_cache


def vllm_trtllm_mxfp4(path, tp: int, rank: int, pad_i: int = 128, pad_h: int = 256) -> dict[str, torch.Tensor]:
    """vLLM's SM100 FlashInfer TRT-LLM MXFP4 preparation of gpt-oss layer 0, from the raw checkpoint tensors.

    Load: whole-block shards (ceil), rows kept interleaved, copied into zero buffers padded to
    I a multiple of 128 and H of 256 (vLLM 0.34; gpt-oss 2880 x 2880 -> 2944 x 3072, as vLLM's own
    code gives in tests/test_engine_parity_vllm.py). Prepare: swap every two rows of w13, its scales and its bias, then per
    expert FlashInfer's row permutation (epilogue tile 128; the biases take their weight's) and
    the 128x4 scale interleave. (vLLM also casts the biases to fp32; that is a dtype, not a layout.)
    """
    with safe_open(str(path / "model-00001-of-00001.safetensors"), framework="pt") as f:
        t = {k.rsplit(".", 1)[-1]: f.get_tensor(k) for k in f.keys() if ".experts." in k}
    e, two_i, hb, _ = t["gate_up_proj_blocks"].shape
    i, h = two_i // 2, hb * 32
    per = -(-(i // 32) // tp) * 32
    r0, r1 = rank * per, min((rank + 1) * per, i)
    ip, hp = -(-per // pad_i) * pad_i, -(-h // pad_h) * pad_h

    def padded(x, shape):
        out = torch.zeros(shape, dtype=x.dtype)
        out[tuple(slice(0, n) for n in x.shape)] = x
        return out

    w13 = padded(t["gate_up_proj_blocks"][:, 2 * r0 : 2 * r1].reshape(e, 2 * (r1 - r0), h // 2), (e, 2 * ip, hp // 2))
    s13 = padded(t["gate_up_proj_scales"][:, 2 * r0 : 2 * r1], (e, 2 * ip, hp // 32))
    w2 = padded(t["down_proj_blocks"][:, :, r0 // 32 : r1 // 32].reshape(e, h, (r1 - r0) // 2), (e, hp, ip // 2))
    s2 = padded(t["down_proj_scales"][:, :, r0 // 32 : r1 // 32], (e, hp, ip // 32))

    def swap_every_two_rows(x):
        return x.reshape(x.shape[0], -1, 2, x.shape[-1]).flip(2).reshape(x.shape)

    b13 = padded(t["gate_up_proj_bias"][:, 2 * r0 : 2 * r1], (e, 2 * ip))[..., None]  # rows of one value
    b2 = t["down_proj_bias"] if rank == 0 else torch.zeros_like(t["down_proj_bias"])
    b2 = padded(b2, (e, hp))[..., None]
    w13, s13, b13 = swap_every_two_rows(w13), swap_every_two_rows(s13), swap_every_two_rows(b13)
    cache: dict = {}
    out = {
        "w13_weight": [],
        "w13_weight_scale": [],
        "w2_weight": [],
        "w2_weight_scale": [],
        "w13_bias": [],
        "w2_bias": [],
    }
    for k in range(e):
        for name, x, sf in (
            ("w13_weight", w13[k], None),
            ("w13_weight_scale", s13[k], 16),
            ("w2_weight", w2[k], None),
            ("w2_weight_scale", s2[k], 16),
            ("w13_bias", b13[k], None),
            ("w2_bias", b2[k], None),
        ):
            rows = x[get_w2_permute_indices_with_cache(cache, x, 128, sf)]
            if sf is not None:  # FlashInfer's block_scale_interleave is GPU-only; steps.swizzle_scales_128x4 is
                rows = steps.swizzle_scales_128x4(*rows.shape).apply(rows[None])[0]  # checked bit-exact against it
            out[name].append(rows)
    stacked = {n: torch.stack(v) for n, v in out.items()}
    stacked["w13_bias"], stacked["w2_bias"] = stacked["w13_bias"][..., 0], stacked["w2_bias"][..., 0]
    return stacked


@pytest.mark.parametrize("tp,rank", [(1, 0), (2, 1), (4, 0), (4, 3)])
def test_gpt_oss_trtllm_matches_vllm_recipe(tmp_path, tp, rank):
    src = sample_path("gpt-oss-mxfp4")
    out = convert_checkpoint(src, tmp_path / "k.safetensors", "trtllm", tp, rank)
    want = vllm_trtllm_mxfp4(src, tp, rank)
    with safe_open(str(out), framework="pt") as f:
        for name, ref in want.items():
            got = f.get_tensor(f"model.layers.0.mlp.experts.{name}")
            assert got.shape == ref.shape and torch.equal(got, ref), name
