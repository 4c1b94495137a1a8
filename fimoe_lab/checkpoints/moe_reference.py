"""Reference MoE forward in plain torch (routing given): the yardstick for "the math is preserved".

Slow and simple on purpose: a loop over the experts that received tokens, float32
matmuls, deterministic on CPU, so the same weights give bit-identical outputs.
"""

from __future__ import annotations

from typing import Optional

import torch

from fimoe_lab.checkpoints.reader import MoELayer
from fimoe_lab.errors import LayoutError
from fimoe_lab.specs import get_activation

__all__ = ["moe_forward", "layer_forward", "random_routing"]


def moe_forward(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    activation: str = "silu",
    activation_params: Optional[dict] = None,
    w13_bias: Optional[torch.Tensor] = None,
    w2_bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``out[t] = sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])`` in float32.

    ``expert_e(x) = act(x @ w13[e].T + b13[e]) @ w2[e].T + b2[e]``, ``act`` the
    :data:`fimoe_lab.specs.ACTIVATIONS` entry called ``activation`` (a name or alias:
    ``silu`` = ``swiglu``, ``swiglu_oai``, ``geglu``, ``relu2``), applied to ``(gate, up)``
    halves when gated, to the whole row otherwise.

    Shapes: ``x`` ``(T, H)``; ``w13`` ``(E, 2I, H)`` rows ``[gate; up]`` for gated
    activations or ``(E, I, H)`` for non-gated ones; ``w2`` ``(E, H, I)``; ``topk_ids``
    int ``(T, k)``; ``topk_weights`` ``(T, k)``; biases ``(E, 2I)`` / ``(E, H)``. Returns
    ``(T, H)`` float32.
    """
    act = get_activation(activation)
    if x.ndim != 2 or w13.ndim != 3 or w2.ndim != 3 or w13.shape[2] != x.shape[1] or w2.shape[1] != x.shape[1]:
        raise LayoutError(
            f"moe_forward: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} do not "
            f"fit (T, H), (E, 2I or I, H), (E, H, I)"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise LayoutError(
            f"moe_forward: topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
            f"must both be (T={x.shape[0]}, k)"
        )
    inter, params = w2.shape[2], activation_params or {}
    xf = x.float()
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32)
    for e in torch.unique(topk_ids).tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        h = xf[tok] @ w13[e].float().T
        if w13_bias is not None:
            h = h + w13_bias[e].float()
        a = act.reference(h[:, :inter], h[:, inter:], params) if act.gated else act.reference(h, None, params)
        y = a @ w2[e].float().T
        if w2_bias is not None:
            y = y + w2_bias[e].float()
        out.index_add_(0, tok, y * topk_weights[tok, slot, None].float())
    return out


def layer_forward(layer: MoELayer, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """:func:`moe_forward` on a checkpoint layer, dequantized with :mod:`fimoe_lab.formats` (biases included)."""
    w13, w2 = layer.dequantized()
    return moe_forward(
        x,
        w13,
        w2,
        topk_ids,
        topk_weights,
        layer.activation,
        layer.activation_params,
        layer.extras.get("w13_bias"),
        layer.extras.get("w2_bias"),
    )


def random_routing(num_tokens: int, num_experts: int, top_k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded routing: ``topk_ids`` int64 ``(T, k)`` (distinct per token), ``topk_weights`` float32 ``(T, k)`` summing to 1."""
    if not 1 <= top_k <= num_experts:
        raise LayoutError(f"top_k {top_k} must be in 1..num_experts ({num_experts})")
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(num_tokens, num_experts, generator=g).argsort(dim=1)[:, :top_k]
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=g), dim=1)
    return ids, weights
