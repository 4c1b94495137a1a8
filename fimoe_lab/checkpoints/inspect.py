"""Per-layer summary of a checkpoint: format, shapes, what FlashInfer needs at TP 1..8, scale health.

Reads only headers and scales (never the weights), so it is quick on real checkpoints.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Optional

import torch

from fimoe_lab import recipes
from fimoe_lab.checkpoints.conventions import MISSING_LAYOUT, dtype_name, stored_format
from fimoe_lab.checkpoints.plan_choice import build_plan, given_choice, layout_format, plan_args, suggest_alignment
from fimoe_lab.checkpoints.reader import Checkpoint, CheckpointError, MoELayer
from fimoe_lab.choice import LayoutChoice
from fimoe_lab.engines import get_engine
from fimoe_lab.errors import FimoeError
from fimoe_lab.formats.health import TINY_SCALE, decoded_scales
from fimoe_lab.recipes import FI_MOE_INTERMEDIATE_MULTIPLE
from fimoe_lab.specs import BACKENDS

__all__ = [
    "LayerReport",
    "BackendNeed",
    "inspect_checkpoint",
    "format_report",
    "backend_need",
    "backend_needs",
    "scale_health",
]


@dataclass
class LayerReport:
    """What ``fimoe-lab inspect`` prints for one MoE layer.

    ``tp[t]``: the printed row at TP ``t`` (``shard`` and one line per backend); ``shards[t]``:
    ``{"sizes": [intermediate of each rank] or None, "cannot": None or why it does not shard}``;
    ``plans[t][backend]``: the :class:`BackendNeed` of rank 0 behind the printed line.
    """

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
    activation: str = "silu"
    shards: dict[int, dict] = field(default_factory=dict)
    plans: dict[int, dict[str, BackendNeed]] = field(default_factory=dict)

    def to_json(self) -> dict:
        """The record ``inspect --json`` prints for this layer (see ``fimoe-lab inspect --help``)."""
        return dict(
            layer=self.layer,
            name=self.name,
            mtp=self.mtp,
            convention=self.convention,
            models=self.models,
            format=self.fmt,
            experts=self.num_experts,
            top_k=self.top_k,
            hidden=self.hidden,
            intermediate=self.intermediate,
            gate_up_order=self.gate_up_order,
            activation=self.activation,
            tensors=[dict(name=n, dtype=dt, shape=list(shape)) for n, (dt, shape) in self.tensors.items()],
            tp=[
                dict(
                    tp=t,
                    **self.shards.get(t, {}),
                    backends={b: need.to_json() for b, need in self.plans.get(t, {}).items()},
                )
                for t in self.tp
            ],
            health=list(self.health),
        )


def _short(exc: Exception) -> str:
    """The error's whole message (without its fix) on one line: reasons are never cut."""
    return " ".join((exc.message if isinstance(exc, FimoeError) else str(exc)).split())


@dataclass
class BackendNeed:
    """What one FlashInfer backend needs for one TP rank's slice of a layer under one engine profile.

    ``status``: ``ok`` (the profile's default paddings lay it out), ``aligned`` (the default fails
    for ``reason``; ``--intermediate-alignment alignment`` works and the plan facts are that
    plan's), ``cannot`` (no alignment tried works: ``reason``) or ``no-layout`` (the format has
    no layout for this backend, :data:`~fimoe_lab.checkpoints.conventions.MISSING_LAYOUT`).
    Bytes are per expert over w13, w2 and their scales: ``pad_bytes = kernel_bytes -
    checkpoint_bytes``; ``tensors``: per tensor ``{"name", "in_shape", "out_shape"`` (bytes per
    expert), ``"pad_bytes", "steps"`` (step kinds, checkpoint to kernel)``}``; ``plan``: the
    :func:`~fimoe_lab.checkpoints.plan_choice.plan_args` record that rebuilds the plan (what convert records);
    ``tactics``: ``{tokens: valid TRTLLM-Gen tactics of the padded shape}`` where a caller that may ask the
    tuner filled it (the CLI; None: not asked), a count None where the tactic source does not know.
    """

    backend: str
    fmt: str
    status: str
    intermediate: int
    hidden: int
    engine: str
    reason: Optional[str] = None
    alignment: Optional[int] = None
    padded_intermediate: Optional[int] = None
    padded_hidden: Optional[int] = None
    checkpoint_bytes: int = 0
    kernel_bytes: int = 0
    tensors: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    plan: Optional[dict] = None
    tactics: Optional[dict[str, Optional[int]]] = None

    @property
    def pad_bytes(self) -> int:
        return self.kernel_bytes - self.checkpoint_bytes

    def plan_text(self) -> str:
        """The plan's paddings and tactic warnings on one line: the padded sizes and every padded byte per expert
        (scales included: a scale tensor padded to whole 128x4 atoms pads bytes at unpadded sizes); ``no padding``
        only when not one byte is added."""
        pads = []
        if self.padded_intermediate != self.intermediate:
            pads.append(f"I {self.intermediate}->{self.padded_intermediate}")
        if self.padded_hidden != self.hidden:
            pads.append(f"H {self.hidden}->{self.padded_hidden}")
        if not pads and self.pad_bytes:
            scales = [t["name"] for t in self.tensors if t["pad_bytes"]]
            pads.append(f"{', '.join(scales) or 'tensors'} to whole layout tiles")
        pct = 100 * self.pad_bytes / max(self.checkpoint_bytes, 1)
        text = f"pad {', '.join(pads)} (+{self.pad_bytes:,} B/expert, +{pct:.1f}%)" if pads else "no padding"
        return "; ".join([text, *self.warnings])

    def text(self) -> str:
        """The one line ``inspect`` prints for this backend."""
        if self.status == "no-layout":
            return f"cannot convert {self.fmt}: {self.reason}"
        if self.status == "cannot":
            return f"cannot lay out: {self.reason}"
        if self.status == "aligned":
            return f"default fails ({self.reason}); --intermediate-alignment {self.alignment}: {self.plan_text()}"
        return self.plan_text()

    def to_json(self) -> dict:
        """The record ``inspect --json`` prints (every field, ``pad_bytes`` and the ``text`` line)."""
        doc = {k: v for k, v in asdict(self).items() if k != "fmt"}  # the layer's "format"
        return {**doc, "pad_bytes": self.pad_bytes, "text": self.text()}


def _plan_facts(layer: MoELayer, choice: LayoutChoice) -> dict:
    """Padded sizes, bytes per expert, per-tensor step chains (word bit steps included) and tactic warnings of the
    plan ``convert`` builds."""
    backend = choice.backend
    record = plan_args(layer, choice)
    plan = build_plan(record)
    maps = plan.maps()
    tensors = []
    for name, t in layer.tensors().items():  # shapes only (meta tensors); a tensor no step moves is unchanged
        if t is None:
            continue
        rows = t.shape[1] if t.dim() > 2 else 1
        shape = [rows, t[0].numel() * t.element_size() // rows]
        m = maps.get(name)
        tensors.append(
            dict(
                name=name,
                in_shape=list(m.in_shape) if m else shape,
                out_shape=list(m.out_shape) if m else shape,
                pad_bytes=m.out_bytes - m.in_bytes if m else 0,
                steps=[s["kind"] for s in plan.tensor_steps(name)],
            )
        )
    warnings = []
    need = stored_format(layer.fmt).tactic_intermediate_multiple
    if backend == "trtllm" and need and plan.padded_intermediate % need:
        warnings.append(f"I%{need}!=0: few/no TRT-LLM tactics")
    if backend == "cutlass" and plan.padded_intermediate % FI_MOE_INTERMEDIATE_MULTIPLE:
        warnings.append(f"I%{FI_MOE_INTERMEDIATE_MULTIPLE}!=0: FlashInfer MoE needs it (align_moe_weights_for_fi)")
    return dict(
        padded_intermediate=plan.padded_intermediate,
        padded_hidden=plan.padded_hidden,
        checkpoint_bytes=sum(math.prod(t["in_shape"]) for t in tensors),
        kernel_bytes=sum(math.prod(t["out_shape"]) for t in tensors),
        tensors=tensors,
        warnings=warnings,
        plan=record,
    )


def backend_need(layer: MoELayer, choice: LayoutChoice) -> BackendNeed:
    """What ``choice.backend`` needs for this (per-rank) layer under ``choice.engine``'s profile (default: the
    newest vLLM's): the paddings of the plan ``choice`` asks for (no alignments: the profile's defaults), or why
    it fails and the intermediate alignment that fixes it; with ``choice``'s per-token NVFP4 activations
    (``convert --per-token``'s paddings) and activation dtype (``convert --mxfp4-activation``)."""
    backend, name = choice.backend, get_engine(choice.engine).name
    need = BackendNeed(backend, layer.fmt, "ok", layer.intermediate, layer.hidden, name)
    choice = replace(choice, engine=name)
    missing = MISSING_LAYOUT.get(layer.fmt, {}).get(backend)
    if missing is not None:
        need.status, need.reason = "no-layout", missing
        return need
    try:
        facts = _plan_facts(layer, choice)
    except ValueError as exc:
        need.reason, need.alignment = _short(exc), suggest_alignment(layer, choice)
        if need.alignment is None:
            need.status = "cannot"
            return need
        need.status, facts = "aligned", _plan_facts(layer, replace(choice, intermediate_alignment=need.alignment))
    for key, value in facts.items():
        setattr(need, key, value)
    return need


def backend_needs(layer: MoELayer, choice: LayoutChoice) -> str:
    """One line: what ``choice.backend`` needs for this (per-rank) layer (:func:`backend_need`'s text)."""
    return backend_need(layer, choice).text()


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
        ex = (layer.w13_scale[:, 0] != layer.w13_scale[:, 1]).nonzero().flatten().tolist()
        out.append(
            f"experts {ex}: gate and up have different per-tensor scales (w13_scale (E, 2)): the kernel takes one per "
            f"w13, so vLLM and SGLang requantize both halves to the larger, and so does convert (it keeps the "
            f"checkpoint's W13 bytes beside them, so restore gives them back exactly)"
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
    per_token: bool = False,
    activation_dtype: Optional[str] = None,
    choice: Optional[LayoutChoice] = None,
) -> list[LayerReport]:
    """A :class:`LayerReport` per MoE layer (all, or ``layers``) of the checkpoint at ``path``;
    paddings as ``engine``'s profile applies them (default: the newest vLLM's), with ``per_token``
    NVFP4 activations where given (``convert --per-token``); ``activation_dtype`` (``convert
    --mxfp4-activation``) for the backends whose recipe has a layout per activation dtype, refused
    for a checkpoint format with none. ``choice``: those options as one value
    (:func:`~fimoe_lab.checkpoints.plan_choice.given_choice`: not both), alignments included; every backend is
    asked with it, its ``backend`` replaced by each in turn (and its activation dtype dropped where the backend's
    recipe has none)."""
    backend = choice.backend if choice is not None else BACKENDS[0]  # each backend in turn below
    choice = given_choice(choice, backend, None, None, engine, per_token, activation_dtype)
    reports = []
    with Checkpoint(path) as ck:
        conv = ck.convention
        acts = _activation_dtypes(ck.fmt, choice.activation_dtype)
        asked = {b: replace(choice, backend=b, activation_dtype=acts[b]) for b in BACKENDS}
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
                activation=full.activation,
            )
            for tp in tps:
                row: dict[str, str] = {}
                try:
                    sizes = [end - start for start, end in (ck.shard_bounds(tp, r, idx) for r in range(tp))]
                except CheckpointError as exc:
                    row["shard"] = f"cannot shard: {_short(exc)}"
                    rep.tp[tp], rep.shards[tp] = row, {"sizes": None, "cannot": _short(exc)}
                    continue
                row["shard"] = f"I/tp = {sizes[0]}" + (f" (last {sizes[-1]})" if sizes[-1] != sizes[0] else "")
                rep.shards[tp] = {"sizes": sizes, "cannot": None}
                shard = ck.read_layer(idx, tp, 0, load="none")
                rep.plans[tp] = {b: backend_need(shard, asked[b]) for b in BACKENDS}
                row.update({backend: need.text() for backend, need in rep.plans[tp].items()})
                rep.tp[tp] = row
            reports.append(rep)
    return reports


def _activation_dtypes(fmt: str, activation_dtype: Optional[str]) -> dict[str, Optional[str]]:
    """``activation_dtype`` for each backend whose recipe for ``fmt`` lays out by activation dtype, else None;
    a dtype that no backend's recipe for ``fmt`` offers is one CheckpointError."""
    offers = {b: recipes.ACTIVATION_DTYPES.get(recipes.recipe_id(layout_format(fmt), b), ()) for b in BACKENDS}
    if activation_dtype is not None and not any(activation_dtype in c for c in offers.values()):
        raise CheckpointError(
            f"--mxfp4-activation {activation_dtype} does not apply to {fmt} weights: only "
            f"{', '.join(recipes.ACTIVATION_DTYPES)} has a kernel layout per activation dtype",
            fix="drop --mxfp4-activation, or inspect an MXFP4 checkpoint",
        )
    return {b: activation_dtype if activation_dtype in offers[b] else None for b in BACKENDS}


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
