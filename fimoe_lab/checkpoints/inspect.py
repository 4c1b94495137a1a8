"""Per-layer summary of a checkpoint: format, shapes, what FlashInfer needs at TP 1..8, scale health.

Reads only headers and scales (never the weights), so it is quick on real checkpoints.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch

from fimoe_lab.checkpoints.conventions import MISSING_LAYOUT, dtype_name, stored_format
from fimoe_lab.checkpoints.reader import Checkpoint, CheckpointError, MoELayer
from fimoe_lab.checkpoints.writer import build_plan, plan_args, suggest_alignment
from fimoe_lab.errors import FimoeError
from fimoe_lab.formats.health import TINY_SCALE, decoded_scales
from fimoe_lab.recipes import FI_MOE_INTERMEDIATE_MULTIPLE
from fimoe_lab.specs import BACKENDS, FORMATS

__all__ = ["LayerReport", "inspect_checkpoint", "format_report", "backend_needs", "scale_health"]


@dataclass
class LayerReport:
    """What ``fimoe-lab inspect`` prints for one MoE layer."""

    layer: int
    convention: str
    models: str
    fmt: str
    num_experts: int
    top_k: Optional[int]
    hidden: int
    intermediate: int
    gate_up_order: str
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    tp: dict[int, dict[str, str]] = field(default_factory=dict)
    health: list[str] = field(default_factory=list)
    name: str = ""
    mtp: bool = False


def _short(exc: Exception) -> str:
    """The error's whole message (without its fix) on one line: reasons are never cut."""
    return " ".join((exc.message if isinstance(exc, FimoeError) else str(exc)).split())


def _describe(layer: MoELayer, backend: str, alignment: Optional[int] = None, engine: Optional[str] = None) -> str:
    plan = build_plan(plan_args(layer, backend, alignment, engine=engine))
    maps = plan.maps()
    src = sum(m.in_bytes for m in maps.values())
    dst = sum(m.out_bytes for m in maps.values())
    pads = []
    if plan.padded_intermediate != plan.intermediate:
        pads.append(f"I {plan.intermediate}->{plan.padded_intermediate}")
    if plan.padded_hidden != plan.hidden:
        pads.append(f"H {plan.hidden}->{plan.padded_hidden}")
    text = ("pad " + ", ".join(pads) + f" (+{100 * (dst - src) / max(src, 1):.0f}% bytes)") if pads else "no padding"
    need = FORMATS[layer.fmt].tactic_intermediate_multiple
    if backend == "trtllm" and need and plan.padded_intermediate % need:
        text += f"; I%{need}!=0: few/no TRT-LLM tactics"
    cutlass_need = FI_MOE_INTERMEDIATE_MULTIPLE
    if backend == "cutlass" and plan.padded_intermediate % cutlass_need:
        text += f"; I%{cutlass_need}!=0: FlashInfer MoE needs it (align_moe_weights_for_fi)"
    return text


def backend_needs(layer: MoELayer, backend: str, engine: Optional[str] = None) -> str:
    """One line: what ``backend`` needs for this (per-rank) layer under ``engine``'s profile
    (default: the newest vLLM's): padding, or why it fails and the fix (for a format with
    no layout, :data:`~fimoe_lab.checkpoints.conventions.MISSING_LAYOUT`)."""
    missing = MISSING_LAYOUT.get(layer.fmt, {}).get(backend)
    if missing is not None:
        return f"cannot convert {layer.fmt}: {missing}"
    try:
        return _describe(layer, backend, engine=engine)
    except ValueError as exc:
        a = suggest_alignment(layer, backend, engine)
        if a is None:
            return f"cannot lay out: {_short(exc)}"
        return f"default fails ({_short(exc)}); --intermediate-alignment {a}: {_describe(layer, backend, a, engine)}"


def scale_health(layer: MoELayer) -> list[str]:
    """Warnings about the layer's scales: NaN/Inf, all-zero experts, tiny (dead) block scales, NVFP4 globals."""
    out: list[str] = []
    parts = layer.quantized()
    if not parts and layer.w13_scale is None:
        return ["unquantized (bf16): no scales"]
    if parts:
        scales = [decoded_scales(q) for _, q in parts]
    else:  # a format without a codec (CHECKPOINT_FORMATS) stores plain float scales
        scales = [t.float() for t in (layer.w13_scale, layer.w2_scale) if t is not None]
    s = torch.cat([t.reshape(layer.num_experts, -1) for t in scales], dim=1)
    bad = ~torch.isfinite(s)
    if bad.any():
        ex = bad.any(1).nonzero().flatten().tolist()
        out.append(f"{int(bad.sum())} block scales are NaN/Inf, in experts {ex}: the kernel's output will be NaN there")
    zero_experts = (s == 0).all(1).nonzero().flatten().tolist()
    if zero_experts:
        out.append(
            f"experts {zero_experts}: every block scale is 0 (the expert outputs 0; a broken export, or "
            f"FlashInfer nvfp4_quantize run on a pre-Blackwell GPU)"
        )
    tiny = (s.abs() > 0) & (s.abs() < TINY_SCALE)
    for e in tiny.any(1).nonzero().flatten().tolist():
        n, total = int(tiny[e].sum()), s.shape[1]
        low = s[e].abs()[tiny[e]].min().item()
        out.append(
            f"expert {e}: {n}/{total} block scales below {TINY_SCALE:g} (min {low:.2g}): dead expert; FlashInfer's "
            f"Hopper CUTLASS FP8 MoE emitted NaN on these; prepare_fp8_moe_layer_for_fi clamps to {TINY_SCALE:g}"
        )
    zeros = int((s == 0).sum()) - sum(s.shape[1] for _ in zero_experts)
    if zeros > 0:
        out.append(f"{zeros} block scales are 0 (all-zero blocks; harmless unless unexpected)")
    out.extend(_sign_and_subnormal(s, stored_format(layer.fmt).scale_dtype, "block scales"))
    for key in (
        "w13_weight_scale_2",
        "w2_weight_scale_2",
        "w13_input_scale",
        "w2_input_scale",
        "w13_weight_global_scale",
        "w2_weight_global_scale",
        "w13_input_global_scale",
        "w2_input_global_scale",
    ):
        t = layer.extras.get(key)
        if t is None:
            continue
        t = t.float().reshape(t.shape[0] if t.dim() else 1, -1)
        for what, mask in (("NaN/Inf", ~torch.isfinite(t)), ("zero", t == 0)):
            if mask.any():
                out.append(f"{key}: {what} in experts {mask.any(1).nonzero().flatten().tolist()}")
        out.extend(_sign_and_subnormal(t, "float32", key))
    for key in ("w13_weight_scale_2", "w13_weight_global_scale"):
        g = layer.extras.get(key)
        if g is not None and not torch.equal(g[:, 0], g[:, 1]):
            ex = (g[:, 0] != g[:, 1]).nonzero().flatten().tolist()
            out.append(
                f"experts {ex}: gate and up have different {key[4:]}; the kernel takes one per w13 (vLLM uses "
                f"gate's), so up is off by their ratio"
            )
    if layer.w13_scale is not None and layer.w13_scale.dim() == 2 and not torch.equal(*layer.w13_scale.unbind(1)):
        out.append(
            "gate and up have different per-tensor scales (w13_scale (E, 2)): the kernel takes one per w13, so "
            "engines requantize both to the larger (vLLM's ModelOpt FP8 path)"
        )
    return out or ["ok: all scales finite, positive and normal, none zero or below 1e-10"]


SUBNORMAL_BELOW = {"float8_e4m3fn": 2.0**-6, "float32": torch.finfo(torch.float32).tiny}
"""Smallest normal value of each scale dtype (UE8M0 has no subnormals)."""


def _sign_and_subnormal(s: torch.Tensor, scale_dtype: str, what: str) -> list[str]:
    """Warnings for negative and for subnormal values of ``s`` ``(E, n)`` (decoded scales), by expert."""
    out = []
    neg = torch.isfinite(s) & (s < 0)
    if neg.any():
        ex = neg.any(1).nonzero().flatten().tolist()
        out.append(f"{what}: {int(neg.sum())} negative, in experts {ex}: a scale is never negative (sign flips)")
    low = SUBNORMAL_BELOW.get(scale_dtype)
    sub = (s.abs() > 0) & (s.abs() < low) if low is not None else None
    if sub is not None and sub.any():
        ex = sub.any(1).nonzero().flatten().tolist()
        out.append(
            f"{what}: {int(sub.sum())} subnormal (|s| < {low:.3g}, the smallest normal {scale_dtype}), in experts "
            f"{ex}: reduced precision"
        )
    return out


def inspect_checkpoint(
    path: str | os.PathLike,
    layers: Optional[Sequence[int]] = None,
    tps: Sequence[int] = (1, 2, 4, 8),
    engine: Optional[str] = None,
) -> list[LayerReport]:
    """A :class:`LayerReport` per MoE layer (all, or ``layers``) of the checkpoint at ``path``;
    paddings as ``engine``'s profile applies them (default: the newest vLLM's)."""
    reports = []
    with Checkpoint(path) as ck:
        conv = ck.convention
        wanted = ck.moe_layers if layers is None else list(layers)
        mtp = set(ck.mtp_layers)
        for idx in wanted:
            try:
                top_k: Optional[int] = ck.config_size("top_k", idx)
            except CheckpointError:
                top_k = None
            full = ck.read_layer(idx, load="scales")
            tensors = {
                n: (dtype_name(t.dtype), tuple(t.shape))
                for n, t in {**full.tensors(), **full.extras}.items()
                if t is not None
            }
            rep = LayerReport(
                idx,
                conv.name,
                conv.models,
                ck.fmt,
                full.num_experts,
                top_k,
                ck.hidden,
                ck.config_size("intermediate", idx),
                conv.gate_up_order,
                tensors,
                health=scale_health(full),
                name=ck.layer_names[idx],
                mtp=idx in mtp,
            )
            for tp in tps:
                row: dict[str, str] = {}
                try:
                    sizes = [end - start for start, end in (ck.shard_bounds(tp, r, idx) for r in range(tp))]
                except CheckpointError as exc:
                    row["shard"] = f"cannot shard: {_short(exc)}"
                    rep.tp[tp] = row
                    continue
                row["shard"] = f"I/tp = {sizes[0]}" + (f" (last {sizes[-1]})" if sizes[-1] != sizes[0] else "")
                shard = ck.read_layer(idx, tp, 0, load="none")
                for backend in BACKENDS:
                    row[backend] = backend_needs(shard, backend, engine)
                rep.tp[tp] = row
            reports.append(rep)
    return reports


def format_report(reports: Sequence[LayerReport]) -> str:
    """The text ``fimoe-lab inspect`` prints."""
    lines = []
    for r in reports:
        where = f" ({r.name}{', MTP' if r.mtp else ''})" if r.name else ""
        lines.append(f"layer {r.layer}{where}: {r.convention} [{r.models}]  format {r.fmt}")
        lines.append(
            f"  experts {r.num_experts}"
            + (f", top-{r.top_k}" if r.top_k else "")
            + f", hidden {r.hidden}, intermediate {r.intermediate}; gate/up order: {r.gate_up_order} "
            f"(FlashInfer wants [up; gate]: convert swaps)"
        )
        for n, (dt, shape) in r.tensors.items():
            lines.append(f"  {n:<20} {dt:<8} {list(shape)}")
        lines.append(f"  {'tp':>3}  {'shard':<20} {'trtllm':<58} cutlass   (rank 0)")
        for tp, row in r.tp.items():
            if "trtllm" not in row:
                lines.append(f"  {tp:>3}  {row['shard']}")
            else:
                lines.append(f"  {tp:>3}  {row['shard']:<20} {row['trtllm']:<58} {row['cutlass']}")
        lines.append("  scale health:")
        lines.extend(f"    - {h}" for h in r.health)
        lines.append("")
    return "\n".join(lines)
