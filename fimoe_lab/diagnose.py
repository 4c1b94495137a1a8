"""Which preparation produced these kernel tensors? ("why is my MoE output garbage")

Given one MoE layer of a checkpoint and the tensors an engine handed to the kernel
(dumped to safetensors or ``.npy``; never a pickle), :func:`diagnose` searches plan variants and
reports, per tensor and per expert, which one explains the dumped bytes:

- the plan of every backend (``specs.BACKENDS``) and engine profile (``engines.ENGINES``),
  as :func:`fimoe_lab.recipes.plan_layer` builds it;
- each of those with one step left out (no W13->W31 swap, no gated interleave, no
  epilogue shuffle, no 128x4 scale swizzle, no block-major-K tiles, ...);
- each with the epilogue shuffle of another ``epilogue_tile_m`` (:data:`EPILOGUE_TILES`);
- each with another intermediate padding (:data:`INTER_ALIGNS`).

A variant explains a dumped tensor ``D`` ``(E, ...)`` when its output has ``D``'s bytes
per expert and, applied to the checkpoint tensor ``C`` ``(E, ...)``, reproduces them:
``match(e) = mean over real (non-fill) output bytes b of [map(C[e])[b] == D[e][b]]``.
Fill bytes are not compared (engines pad with their own values). Dumped names are read
by :func:`tensor_role` (``w13``/``gemm1``/``w31`` weight and scale, ``w2``/``gemm2`` ...).
Variants that build the same map are one candidate under every name, and the report names every variant
that explains the bytes equally, a profile's own plan first (an SGLang-prepared dump is
``sglang-0.5.23/...``, with ``vllm-0.34/... without swap_w13_to_w31_rows`` named after it).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from fimoe_lab.engines import DEFAULT_ENGINE, ENGINES
from fimoe_lab.errors import FimoeError, LayoutError
from fimoe_lab.layout import IndexMap, compose
from fimoe_lab.recipes import plan_layer
from fimoe_lab.specs import BACKENDS
from fimoe_lab.steps import shuffle_rows_for_epilogue

__all__ = [
    "EPILOGUE_TILES",
    "INTER_ALIGNS",
    "Variant",
    "TensorDiagnosis",
    "Diagnosis",
    "tensor_role",
    "load_dump",
    "variants",
    "diagnose",
]

EPILOGUE_TILES = (64, 128)
"""``epilogue_tile_m`` values tried in place of the planned one."""
INTER_ALIGNS = (1, 16, 32, 64, 128, 256)
"""Intermediate alignments tried in place of the planned one."""
DEFAULT_EXPERTS = 8
"""Experts compared by default (the first ones): a real layer has hundreds."""


@dataclass(frozen=True)
class Variant:
    """One candidate preparation of a tensor: ``m`` and how it differs from a plan (``name``); ``also``: the other
    variants that build the same map (the same bytes), in :func:`variants`' naming order."""

    name: str
    m: IndexMap
    also: tuple[str, ...] = ()


EQUALLY_SHOWN = 6
"""Variants named on a summary line beside the best one (the JSON lists them all)."""


@dataclass
class TensorDiagnosis:
    """Per dumped tensor: every variant that fits its shape, with its per-expert match, best first.

    ``ranked``: ``[(variant name, [match per expert])]``; ``planned``: the name of the plan
    ``fimoe-lab convert`` applies (default engine profile, first backend that fits); ``also``: per variant name
    the other names of the same map (:attr:`Variant.also`).
    """

    role: str
    dumped_name: str
    experts: list[int]
    ranked: list[tuple[str, list[float]]]
    planned: Optional[str]
    maps: dict[str, IndexMap] = field(repr=False, default_factory=dict)
    also: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def best(self) -> Optional[tuple[str, list[float]]]:
        return self.ranked[0] if self.ranked else None

    def equally(self) -> list[str]:
        """Every variant but the best that explains the bytes as well as it does (the same match on every
        expert): the same map under other names, then other maps, each in naming order."""
        if not self.ranked:
            return []
        name, match = self.ranked[0]
        same = [n for n, m in self.ranked[1:] if m == match]
        return [*self.also.get(name, ()), *(x for n in same for x in (n, *self.also.get(n, ())))]

    def explained(self) -> bool:
        """True when the best variant reproduces every compared expert exactly."""
        return bool(self.best and min(self.best[1]) == 1.0)

    def summary(self) -> str:
        if not self.ranked:
            return f"{self.role} ({self.dumped_name}): no variant has its shape"
        name, match = self.ranked[0]
        worst = [e for e, v in zip(self.experts, match) if v < 1.0]
        verdict = (
            "explains" if not worst else f"best fit ({100 * min(match):.1f}% worst expert; experts {worst} differ)"
        )
        line = f"{self.role} ({self.dumped_name}): {name} {verdict}, {100 * sum(match) / len(match):.1f}% of bytes"
        equal = self.equally()
        if equal:
            more = len(equal) - EQUALLY_SHOWN
            line += f"; equally: {', '.join(equal[:EQUALLY_SHOWN])}" + (f" and {more} more" if more > 0 else "")
        if self.planned and self.planned != name:
            planned = dict(self.ranked).get(self.planned)
            if planned is not None:
                line += f"; the planned '{self.planned}' matches {100 * sum(planned) / len(planned):.1f}%"
        return line


@dataclass
class Diagnosis:
    """The result of :func:`diagnose`: one :class:`TensorDiagnosis` per dumped tensor it recognized."""

    source: str
    tensors: dict[str, TensorDiagnosis]
    ignored: list[str]

    def summary(self) -> str:
        lines = [self.source] + [t.summary() for t in self.tensors.values()]
        if self.ignored:
            lines.append(f"not compared (name not recognized or shape fits no variant): {', '.join(self.ignored)}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "tensors": {
                role: {
                    "dumped_name": t.dumped_name,
                    "experts": t.experts,
                    "explained": t.explained(),
                    "best": t.best[0] if t.best else None,
                    "equally": t.equally(),
                    "planned": t.planned,
                    "ranked": [{"variant": n, "match": m} for n, m in t.ranked[:10]],
                }
                for role, t in self.tensors.items()
            },
            "ignored": self.ignored,
        }


def tensor_role(name: str) -> Optional[str]:
    """``w13``, ``w2``, ``w13_scale`` or ``w2_scale`` for a dumped tensor name, or None.

    W13: a name with ``w13``, ``w31``, ``w1_w3``, ``w3_w1`` or ``gemm1``; W2: ``w2``,
    ``gemm2`` or ``down``; a scale: ``scale`` but not a global/second/input scale.
    """
    n = name.lower().replace(".", "_")
    if any(k in n for k in ("scale_2", "global", "input", "alpha", "bias")):
        return None
    if any(k in n for k in ("w13", "w31", "w1_w3", "w3_w1", "gemm1")):
        base = "w13"
    elif any(k in n for k in ("w2", "gemm2", "down")):
        base = "w2"
    else:
        return None
    return f"{base}_scale" if "scale" in n else base


DUMP_SUFFIXES = (".safetensors", ".npy")
"""What :func:`load_dump` reads: no pickle (a ``.pt``/``.pth`` file is one and is refused)."""
NPY_KINDS = "biuf"
"""The numpy dtype kinds a ``.npy`` dump may hold (bool, signed, unsigned, float): no objects, no records."""


def load_dump(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Tensors dumped from an engine: a ``.safetensors`` file (names from the file), or one ``.npy`` array
    (named by the file's stem: ``gemm1_weights.npy``), read with ``allow_pickle=False``, no object or
    record dtype, its header's shape and dtype checked against the file's size before anything is
    allocated; a dump is loaded whole, so one above ``$FIMOE_LAB_MAX_MEMORY`` is refused. Nothing is ever
    unpickled: a ``.pt`` is refused with how to convert it."""
    p = Path(path)
    if not p.is_file():
        raise FimoeError(
            f"kernel tensors {p} do not exist or are not a regular file",
            fix="pass a .safetensors or .npy file of dumped tensors",
        )
    if p.suffix in (".pt", ".pth"):
        raise FimoeError(
            f"{p} is a pickle (torch.save); fimoe-lab never unpickles a file (it can run code)",
            fix="save the tensors with safetensors.torch.save_file(tensors, 'dump.safetensors') where you dumped them",
        )
    _within_memory_limit(p, p.stat().st_size)
    if p.suffix == ".safetensors":
        from fimoe_lab.checkpoints.safe_io import open_safetensors

        with open_safetensors(p, "dump of kernel tensors") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    if p.suffix == ".npy":
        return {p.stem: _load_npy(p)}
    raise FimoeError(
        f"kernel tensors {p} are not .safetensors or .npy", fix="dump them with safetensors.torch.save_file"
    )


def _within_memory_limit(p: Path, nbytes: int) -> None:
    """A dump is loaded whole: refuse one above :func:`fimoe_lab.checkpoints.consistency.memory_limit`."""
    from fimoe_lab.checkpoints.consistency import memory_limit

    limit = memory_limit()
    if nbytes > limit:
        raise FimoeError(
            f"{p} holds {nbytes / (1 << 30):.1f} GiB of tensors, over the memory limit of {limit / (1 << 30):.1f} GiB",
            fix="dump fewer experts, or set FIMOE_LAB_MAX_MEMORY if this host has the memory",
        )


def _load_npy(p: Path) -> torch.Tensor:
    """One ``.npy`` array (:func:`load_dump`), or one FimoeError."""
    import numpy as np

    def bad(why: str) -> FimoeError:
        return FimoeError(f"{p} is not a usable .npy dump: {why}", fix="save it with numpy.save(path, array)")

    try:
        with open(p, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(f, max_header_size=1 << 16)
            start = f.tell()
    except (ValueError, OSError, EOFError, SyntaxError) as exc:
        raise bad(f"its header is unreadable ({exc})") from None
    if dtype.kind not in NPY_KINDS or dtype.fields is not None or dtype.hasobject:
        raise bad(f"dtype {dtype} is not plain numbers (objects and records are refused)")
    need = dtype.itemsize * math.prod(shape)
    if p.stat().st_size - start != need:
        raise bad(f"shape {shape} of {dtype} needs {need} bytes of data, the file holds {p.stat().st_size - start}")
    try:
        array = np.load(p, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise bad(str(exc)) from None
    return torch.from_numpy(np.ascontiguousarray(array))


def _fingerprint(m: IndexMap) -> tuple[Any, ...]:
    src = m.src
    return (m.in_shape, m.out_shape, m.cell_bytes, int(src.sum()), int((src * torch.arange(src.numel())).sum()))


def _composed(*maps: IndexMap) -> Optional[IndexMap]:
    """``compose(*maps)``, or None when their shapes do not chain (a step that cannot be left out)."""
    try:
        return compose(*maps)
    except LayoutError:
        return None


def _variants_of(base: str, m: IndexMap) -> Iterable[Variant]:
    yield Variant(base, m)
    for k, step in enumerate(m.steps):
        if step.kind == "pad_projections":
            continue
        rest = m.steps[:k] + m.steps[k + 1 :]
        dropped = _composed(*rest) if rest else None
        if dropped is not None:
            yield Variant(f"{base} without {step.kind}", dropped)
        if step.kind == "shuffle_rows_for_epilogue":
            for etm in EPILOGUE_TILES:
                if etm == step.params["epilogue_tile_m"]:
                    continue
                rows, cols = step.in_shape[0], step.in_shape[1]
                other = _composed(*m.steps[:k], shuffle_rows_for_epilogue(rows, cols, etm), *m.steps[k + 1 :])
                if other is not None:
                    yield Variant(f"{base} with epilogue_tile_m={etm}", other)


def variants(moe: Any, role: str) -> tuple[list[Variant], Optional[str]]:
    """Every candidate map of tensor ``role`` for the checkpoint layer ``moe`` (a
    :class:`~fimoe_lab.checkpoints.MoELayer`), one per distinct map, named by the first of its names in this
    order (the others in :attr:`Variant.also`): an engine profile's plan as it is, then with another intermediate
    alignment, then with a step left out or another epilogue tile; profiles in ``engines.ENGINES`` order, the
    default first. Also the planned variant's name (the default profile, the first backend with a plan)."""
    found: list[tuple[tuple[int, ...], Variant]] = []
    planned = None
    profiles = [DEFAULT_ENGINE, *(e for e in ENGINES if e != DEFAULT_ENGINE)]
    for ei, engine in enumerate(profiles):
        for bi, backend in enumerate(BACKENDS):
            for ai, align in enumerate((None,) + INTER_ALIGNS):
                try:
                    plan = plan_layer(
                        moe.fmt,
                        backend,
                        moe.intermediate,
                        moe.hidden,
                        moe.is_act_and_mul,
                        moe.is_gated,
                        align,
                        None,
                        engine,
                    )
                except (FimoeError, ValueError):
                    continue
                m = plan.maps().get(role)
                if m is None:
                    continue
                base = f"{engine}/{backend}" + (f" (intermediate aligned to {align})" if align else "")
                if engine == DEFAULT_ENGINE and align is None and planned is None:
                    planned = base
                for k, v in enumerate(_variants_of(base, m) if align is None else [Variant(base, m)]):
                    kind = 0 if k == 0 and align is None else 1 if k == 0 else 2
                    found.append(((kind, ei, bi, ai, k), v))
    groups: dict[tuple[Any, ...], list[Variant]] = {}
    for _, v in sorted(found, key=lambda f: f[0]):
        groups.setdefault(_fingerprint(v.m), []).append(v)
    return [Variant(vs[0].name, vs[0].m, tuple(v.name for v in vs[1:])) for vs in groups.values()], planned


def _match(m: IndexMap, checkpoint: torch.Tensor, dumped: torch.Tensor) -> list[float]:
    """Per expert, the fraction of ``m``'s real output bytes of ``checkpoint`` equal to ``dumped``'s."""
    got = m.apply(checkpoint).contiguous().view(torch.uint8).reshape(checkpoint.shape[0], -1)
    want = dumped.contiguous().view(torch.uint8).reshape(dumped.shape[0], -1)
    real = (m.refined(1).src >= 0)[None, :]
    same = ((got == want) & real).sum(dim=1).double() / max(int(real.sum()), 1)
    return [float(v) for v in same]


def diagnose(
    moe: Any,
    dumped: dict[str, torch.Tensor],
    experts: Optional[Sequence[int]] = None,
    source: str = "",
) -> Diagnosis:
    """Rank the plan variants (:func:`variants`) by how well they reproduce each dumped tensor.

    ``moe``: the checkpoint layer (``w13 (E, P*I, H)``, ...); ``dumped``: ``{name: tensor}``
    with ``E`` experts first (names read by :func:`tensor_role`); ``experts``: which experts
    to compare (default: the first :data:`DEFAULT_EXPERTS`).
    """
    if experts is None:
        experts = list(range(min(DEFAULT_EXPERTS, int(moe.num_experts))))
    bad = [e for e in experts if not 0 <= e < moe.num_experts]
    if bad:
        raise FimoeError(
            f"experts {bad} are outside 0..{moe.num_experts - 1} of this layer",
            fix=f"pick experts in 0..{moe.num_experts - 1}",
        )
    index = torch.tensor(list(experts), dtype=torch.int64)
    tensors = moe.tensors()
    found: dict[str, TensorDiagnosis] = {}
    ignored = []
    for name, d in dumped.items():
        role = tensor_role(name)
        if role is None or role in found or tensors.get(role) is None or d.ndim < 2 or d.shape[0] != moe.num_experts:
            ignored.append(name)
            continue
        ckpt, dump = tensors[role][index], d[index]
        per_expert = dump[0].numel() * dump.element_size()
        cands, planned = variants(moe, role)
        fits = [
            v for v in cands if v.m.out_bytes == per_expert and v.m.in_bytes == ckpt[0].numel() * ckpt.element_size()
        ]
        if not fits:
            ignored.append(name)
            continue
        ranked = sorted(((v.name, _match(v.m, ckpt, dump)) for v in fits), key=lambda r: -sum(r[1]))
        maps, also = {v.name: v.m for v in fits}, {v.name: v.also for v in fits}
        found[role] = TensorDiagnosis(role, name, list(experts), ranked, planned, maps, also)
    if not found:
        raise FimoeError(
            f"none of the dumped tensors ({', '.join(dumped) or 'none'}) is a w13/w2 weight or scale of this layer",
            fix="dump the layer's kernel tensors with their expert dimension first (names with w13/gemm1, w2/gemm2)",
        )
    return Diagnosis(source, found, ignored)


def figure(diag: TensorDiagnosis, moe: Any, dumped: torch.Tensor, expert: Optional[int] = None) -> Any:
    """The comparison figure: the dumped tensor taken back through the planned map and through the best one.

    Panels are :func:`fimoe_lab.viz.figures.compare_figure` of the worst-matching expert
    (or ``expert``): a scale tensor's decoded scales (E4M3 / UE8M0 codes decoded, float scales as
    stored), a weight's stored bytes (codes 0-255, labelled so: packed values are not decoded), so
    a misplaced row or scale shows as a broken pattern.
    """
    from fimoe_lab.viz import figures

    best = diag.best
    if best is None:
        raise LayoutError(f"{diag.role}: no variant to draw", fix="diagnose a tensor with a matching shape")
    name, match = best
    k = match.index(min(match)) if expert is None else diag.experts.index(expert)
    e = diag.experts[k]
    m = diag.maps[diag.planned] if diag.planned in diag.maps else diag.maps[name]
    stored = moe.tensors()[diag.role][e].contiguous()
    in_bytes = stored.view(torch.uint8).reshape(m.in_shape)
    out_bytes = dumped[e].contiguous().view(torch.uint8).reshape(m.out_shape)
    if diag.role.endswith("_scale"):  # decoded, each scale from its own bytes
        from fimoe_lab.formats import QuantizedTensor
        from fimoe_lab.formats.health import decoded_scales

        size = stored.element_size()

        def decode(raw: torch.Tensor) -> Any:
            codes = raw.reshape(*raw.shape[:-1], raw.shape[-1] // size, size).contiguous().view(stored.dtype)[..., 0]
            return decoded_scales(QuantizedTensor(codes, codes, None, moe.fmt, 0)).double().numpy()  # scales only

        ckpt, kernel, unit, what = decode(in_bytes), decode(out_bytes), "scale (decoded)", "scales"
    else:
        ckpt, kernel = in_bytes.double().numpy(), out_bytes.double().numpy()
        size, unit, what = 1, "stored byte (code)", "bytes"
    title = f"{diag.role} expert {e}: dumped {what} un-done by '{diag.planned or name}' (best fit: '{name}')"
    return figures.compare_figure(m, ckpt, kernel, size, title, unit)
