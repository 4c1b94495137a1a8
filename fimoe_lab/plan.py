"""A layer plan: the index maps for the four tensors of one MoE layer, as one value.

``w13`` is ``(E, P*I, H)`` (P = 2 for a fused gate/up, 1 otherwise), ``w2`` is
``(E, H, I)``; their block scales follow the same rows. A plan knows the sizes it
produces, applies to real tensors (any dtype, CPU or CUDA, scales 3-D or flattened
``(E, rows*cols)``), and inverts: ``plan.inverse().apply(*plan.apply(...))`` returns the
checkpoint layout byte for byte (padding dropped).

Index maps move whole bytes. A tensor may also carry a **word bit step** (``word_bits``: a
``(32,) -> (32,)`` map on the bit view of one little-endian 32-bit word, e.g.
:func:`fimoe_lab.steps.sm90_mixed_word_bits`), run on every aligned word of the tensor by
:func:`fimoe_lab.steps.apply_word_bits` *after* its byte map; the inverse plan undoes the bits
*first* (``word_bits_first``), then the byte map.

A plan may also carry an engine's **value rule** (``value_rule``, :mod:`fimoe_lab.value_rules`: FP8 per-tensor W13
requantized to one scale, DeepSeek FP8 block scales clamped), applied in the checkpoint layout before the byte
maps. It changes values, so the inverse plan cannot undo it: :meth:`LayerPlan.inverse` drops it, and
``plan.inverse().apply(*plan.apply(...))`` returns the checkpoint's bytes only where the rule changed none.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch

from fimoe_lab import plan_store, value_rules
from fimoe_lab.engines import ValueRule
from fimoe_lab.errors import LayoutError
from fimoe_lab.kernels import ExecMap, execute, execute_kept, plans_after_the_call
from fimoe_lab.layout import IndexMap
from fimoe_lab.steps import apply_word_bits

__all__ = [
    "BIAS_ROWS",
    "LayerPlan",
    "MapCall",
    "apply_map",
    "check_same_device",
    "copy_bytes",
    "kept_on_disk",
    "kept_plan",
    "map_call",
]

TENSOR_NAMES = ("w13", "w2", "w13_scale", "w2_scale")
BIAS_ROWS = {"w13_bias": "w13", "w2_bias": "w2"}
"""Per-row biases and the weight whose rows each follows (gpt-oss carries them)."""
KEPT_CALLS = 64
"""The kinds of input (shapes, dtypes, devices) a plan keeps its checked map calls for (:meth:`LayerPlan.apply`)."""


def kept_plan(
    key: dict[str, Any], build: Callable[[], LayerPlan], finish: Callable[[LayerPlan], LayerPlan] = lambda p: p
) -> LayerPlan:
    """The plan of ``key`` (JSON values: what it was asked with) read from the plan store (:mod:`fimoe_lab.plan_store`)
    where a record fits, else ``build()``; ``finish`` applied to either (an engine's value rule). A plan built here
    with no word bit step or value rule is remembered, to be written after its first apply."""
    path = plan_store.place(key)
    stored = plan_store.read(key, path)
    if stored is not None:
        return finish(LayerPlan(**{n: stored["maps"].get(n) for n in TENSOR_NAMES}, **stored["fields"]))
    plan = build()
    final = finish(plan)
    if not plan.word_bits and plan.value_rule is None:
        plan_store.remember(final, key, plan.stored_fields(), path)
    return final


def kept_on_disk(build: Callable[..., LayerPlan]) -> Callable[..., LayerPlan]:
    """``build`` (a function of JSON scalars returning a plan, under :func:`~fimoe_lab.caches.cached`) through
    :func:`kept_plan`, keyed by its name and its arguments bound to its signature: a later process's first call
    reads the plan instead of building and compiling it (a call with other arguments builds it as before)."""
    signature = inspect.signature(build)

    @functools.wraps(build)
    def wrapper(*args: Any, **kwargs: Any) -> LayerPlan:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        if not all(type(v) in (bool, int, float, str) for v in bound.arguments.values()):
            return build(*args, **kwargs)
        return kept_plan({"builder": build.__qualname__, "args": dict(bound.arguments)}, lambda: build(*args, **kwargs))

    return wrapper


def check_same_device(**tensors: Optional[torch.Tensor]) -> None:
    """Raise :class:`LayoutError` when the given tensors live on different devices."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise LayoutError(f"tensors are on different devices ({listing}); move them to one device first")


def apply_map(
    m: IndexMap, x: torch.Tensor, what: str, keep_flat: bool = True, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Apply ``m`` to ``x`` whose per-expert bytes match ``m.in_shape``, in any per-expert shape.

    A 2-D ``x`` of shape ``(E, rows*cols)`` (flattened scales) is read as the map's
    matrix, and the result is flattened back to ``(E, -1)`` when ``keep_flat``. ``out``: as :meth:`MapCall.run`'s.
    """
    return map_call(m, x, what, keep_flat).run(x, out)


@dataclass(frozen=True)
class MapCall:
    """One map's call on inputs of one shape, dtype and device, checked once (:func:`map_call`): ``x`` read as
    ``as_shape`` (its bytes when ``as_bytes``; ``None``: as it is), the output ``(E, *out_elements)`` allocated, the
    map's executable form run into it, and the result reshaped to ``flat_shape`` (``None``: kept)."""

    em: ExecMap
    as_bytes: bool
    as_shape: Optional[tuple[int, ...]]
    out_shape: tuple[int, ...]
    flat_shape: Optional[tuple[int, ...]]

    def run(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The map on ``x``, of the shape, dtype and device this call was made for (a tensor of another size is
        refused, never read past). A contiguous ``x`` of the map's bytes whose launches the prebuilt kernels kept
        goes straight to them (:func:`~fimoe_lab.kernels.execute_kept`) into an output made here, any other to
        :func:`~fimoe_lab.kernels.execute`, which checks both. ``out``: a contiguous tensor of any dtype and shape
        holding exactly the result's bytes, on ``x``'s device, not overlapping ``x``, written and returned as the
        result (a view of it); None: a new one."""
        if self.as_bytes:
            x = x.view(torch.uint8)
        if self.as_shape is not None:
            x = x.reshape(self.as_shape)
        own = out is None  # a given out goes through execute's checks (it may overlap x)
        out = torch.empty(self.out_shape, dtype=x.dtype, device=x.device) if out is None else self._into(out, x)
        e = self.out_shape[0]
        checked = own and x.is_contiguous() and x.shape[0] == e and x.nbytes == e * self.em.in_bytes
        if not (checked and execute_kept(self.em, x, out)):
            execute(self.em, x, out)
        return out if self.flat_shape is None else out.reshape(self.flat_shape)

    def _into(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out`` (contiguous, the result's bytes, on ``x``'s device) as the result's dtype and shape."""
        nbytes = math.prod(self.out_shape) * x.element_size()
        flat = _out_bytes(out, nbytes, x.device, f"the map writes {nbytes} contiguous bytes on {x.device}")
        return flat.view(x.dtype).view(self.out_shape)


def map_call(m: IndexMap, x: torch.Tensor, what: str, keep_flat: bool = True) -> MapCall:
    """The :class:`MapCall` of ``m`` on tensors like ``x`` (:func:`apply_map`), after checking ``x``: contiguous
    ``(E, ...)`` with ``m.in_bytes`` per expert (read in elements of its dtype where they divide the map's rows,
    else as bytes)."""
    m.check_experts(x, what)
    size = x.element_size()
    as_bytes = bool(m.in_shape[-1] % size)
    given = tuple(x.shape)
    if as_bytes:
        given, size = given[:-1] + (given[-1] * size,), 1
    shape = given[:1] + m.in_shape[:-1] + (m.in_shape[-1] // size,)
    out_shape = given[:1] + m.out_elements(size)
    flat = (given[0], math.prod(out_shape[1:])) if x.ndim == 2 and keep_flat and len(m.out_shape) > 1 else None
    return MapCall(m.compiled(), as_bytes, None if given == shape else shape, out_shape, flat)


@dataclass(frozen=True)
class LayerPlan:
    """Index maps for ``w13``, ``w2`` and their scales (``None`` = left as is), and sizes.

    ``intermediate``/``hidden`` are the checkpoint sizes, ``padded_*`` what the kernel
    sees. ``description`` names the backend path (e.g. "MXFP8 TRT-LLM").

    ``word_bits``: per tensor name, a word bit step (module docstring) applied to every aligned
    32-bit word of that tensor after its byte map, or before the byte map when
    ``word_bits_first`` (what :meth:`inverse` gives): ``out = bits(map(x))``, ``x = map^-1(bits^-1(out))``.

    ``value_rule``: the engine profile's value rule for this recipe (module docstring; None: bytes only move),
    applied by :meth:`apply` to the checkpoint tensors before their maps.
    """

    w13: Optional[IndexMap]
    w2: Optional[IndexMap]
    w13_scale: Optional[IndexMap]
    w2_scale: Optional[IndexMap]
    intermediate: int
    hidden: int
    padded_intermediate: int
    padded_hidden: int
    description: str = ""
    word_bits: dict[str, IndexMap] = field(default_factory=dict, hash=False)
    word_bits_first: bool = False
    value_rule: Optional[ValueRule] = None

    def __post_init__(self) -> None:
        unknown = sorted(set(self.word_bits) - set(TENSOR_NAMES))
        if unknown:
            raise LayoutError(f"word bit steps for {unknown}, not tensors of a layer plan", fix=f"use {TENSOR_NAMES}")

    def maps(self) -> dict[str, IndexMap]:
        """The non-trivial byte maps by tensor name (word bit steps: :attr:`word_bits`)."""
        return {n: getattr(self, n) for n in TENSOR_NAMES if getattr(self, n) is not None}

    def moved(self) -> tuple[str, ...]:
        """The tensors whose bytes or bits move (a byte map, a word bit step or both), in tensor order."""
        return tuple(n for n in TENSOR_NAMES if getattr(self, n) is not None or n in self.word_bits)

    def tensor_steps(self, name: str) -> list[dict[str, Any]]:
        """The primitive steps of tensor ``name`` in the order they run (``[{"kind", "params"}, ...]``,
        what a converted file records; [] when it stays as it is)."""
        m, bits = getattr(self, name), self.word_bits.get(name)
        parts = [m.spec() if m is not None else [], bits.spec() if bits is not None else []]
        return [s for part in (parts[::-1] if self.word_bits_first else parts) for s in part]

    def apply_tensor(self, name: str, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Tensor ``name`` through its byte map and word bit step in plan order (``x`` itself when none).
        ``out``: a contiguous tensor of exactly the result's bytes (any dtype) that the last step writes (the
        result is then a view of it); None: a new tensor."""
        m, bits = getattr(self, name), self.word_bits.get(name)
        if bits is not None and self.word_bits_first:
            x = _word_bits(bits, x)
        if m is not None:
            x = apply_map(m, x, name, out=out if bits is None or self.word_bits_first else None)
            if bits is None or self.word_bits_first:
                return x
        if bits is not None and not self.word_bits_first:
            x = _word_bits(bits, x)
        return x if out is None else copy_bytes(out, x)

    def check(self, **tensors: Optional[torch.Tensor]) -> None:
        """Validate every given tensor against its map before any byte moves."""
        check_same_device(**tensors)
        for name, m in self.maps().items():
            x = tensors.get(name)
            if x is None:
                raise LayoutError(f"{self.description}: {name} is required (its map is {m.name})")
            if not m.fits_experts(x):
                m.check_experts(
                    x, f"{self.description} (intermediate={self.intermediate}, hidden={self.hidden}): {name}"
                )
        for name, bits in self.word_bits.items():
            x = tensors.get(name)
            if x is None:
                raise LayoutError(f"{self.description}: {name} is required (its word bit step is {bits.name})")
            if (x[:1].numel() * x.element_size()) % 4:
                raise LayoutError(
                    f"{self.description}: {name} {tuple(x.shape)} {x.dtype} does not hold whole 32-bit words per expert "
                    f"(its word bit step {bits.name} permutes the bits of every word)",
                    fix="pass the packed weights as the plan's shapes give them",
                )
        moved = self.moved()
        experts = {n: t.shape[0] for n, t in tensors.items() if t is not None and t.ndim >= 1 and n in moved}
        if len(set(experts.values())) > 1:
            raise LayoutError(f"{self.description}: expert counts differ: {experts}")

    def apply(
        self,
        w13: torch.Tensor,
        w2: torch.Tensor,
        w13_scale: Optional[torch.Tensor] = None,
        w2_scale: Optional[torch.Tensor] = None,
    ) -> tuple[Optional[torch.Tensor], ...]:
        """Return ``(w13, w2, w13_scale, w2_scale)`` in the kernel layout (new tensors): the value rule, if any,
        then each tensor's map (the background planner asked after all four: :data:`.kernels.plans_after_the_call`).

        The tensors are checked (:meth:`check`) and each map's call made (:func:`map_call`, from the tensors after the
        value rule) once per shape, dtype, device and contiguity of the four: a model's later layers of the same
        shapes go straight to their launches."""
        given: dict[str, Optional[torch.Tensor]] = dict(w13=w13, w2=w2, w13_scale=w13_scale, w2_scale=w2_scale)
        kind = tuple(None if x is None else (x.shape, x.dtype, x.device, x.is_contiguous()) for x in given.values())
        kept: dict[tuple[Any, ...], dict[str, MapCall]] = self.__dict__.setdefault("_calls", {})
        calls = kept.get(kind)
        if calls is None:
            self.check(**given)  # the checkpoint's tensors, before the value rule reads them
        given = value_rules.apply(self.value_rule, given)
        if calls is None:
            calls = self._map_calls(given)
            if len(kept) >= KEPT_CALLS:
                kept.clear()
            kept[kind] = calls
        with plans_after_the_call:
            out = tuple(
                x if x is None else calls[n].run(x) if n in calls else self.apply_tensor(n, x) for n, x in given.items()
            )
        plan_store.applied(self)
        return out

    def _map_calls(self, given: dict[str, Optional[torch.Tensor]]) -> dict[str, MapCall]:
        """The byte maps' calls (tensors without a word bit step) made for the tensors they run on (after the value
        rule, which keeps each tensor's kind for one kind of checkpoint tensors): :meth:`apply` keeps them by the
        checkpoint tensors' shapes, dtypes, devices and contiguity (at most :data:`KEPT_CALLS` such kinds)."""
        maps = self.maps().items()
        return {n: map_call(m, x, n) for n, m in maps if n not in self.word_bits and (x := given[n]) is not None}

    def stored_fields(self) -> dict[str, Any]:
        """What rebuilds this plan besides its byte maps (``LayerPlan(**maps, **fields)``), as JSON values: its sizes
        and description (:mod:`fimoe_lab.plan_store` keeps plans with no word bit step and no value rule)."""
        if self.word_bits or self.value_rule is not None:
            raise LayoutError(f"internal: {self.description} carries word bits or a value rule; it is not stored")
        names = ("intermediate", "hidden", "padded_intermediate", "padded_hidden", "description")
        return {n: getattr(self, n) for n in names}

    def bias_map(self, name: str, itemsize: int) -> Optional[IndexMap]:
        """The map of a per-row bias: ``w13_bias (E, P*I)`` follows w13's rows, ``w2_bias (E, H)`` w2's.

        ``None`` when that weight is left as is. (gpt-oss carries such biases; a bias
        not moved with its rows silently adds to the wrong outputs.)
        """
        if name not in BIAS_ROWS:
            raise LayoutError(f"no bias named {name!r}", fix=f"biases are {', '.join(BIAS_ROWS)}")
        weight = getattr(self, BIAS_ROWS[name])
        return weight.for_row_vectors(itemsize) if weight is not None else None

    def inverse(self) -> LayerPlan:
        """The plan that maps the kernel layout back to the checkpoint layout."""
        inv = {n: (m.inverse() if m is not None else None) for n, m in ((n, getattr(self, n)) for n in TENSOR_NAMES)}
        return replace(
            self,
            **inv,
            word_bits={n: bits.inverse() for n, bits in self.word_bits.items()},
            word_bits_first=not self.word_bits_first,
            intermediate=self.padded_intermediate,
            hidden=self.padded_hidden,
            padded_intermediate=self.intermediate,
            padded_hidden=self.hidden,
            description=f"inverse of {self.description}",
            value_rule=None,
        )


def copy_bytes(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The bytes of ``x`` copied into ``out`` (contiguous, as many bytes, any dtype and shape); returns ``out`` as
    ``x``'s dtype and shape."""
    flat = _out_bytes(out, x.nbytes, x.device, f"cannot hold {tuple(x.shape)} {x.dtype} on {x.device}")
    flat.copy_(x.contiguous().reshape(-1).view(torch.uint8))
    return flat.view(x.dtype).view(x.shape)


def _out_bytes(out: torch.Tensor, nbytes: int, device: torch.device, why: str) -> torch.Tensor:
    """``out`` as its ``nbytes`` bytes (uint8, 1-D), or one LayoutError saying ``why`` when it is not contiguous, of
    ``nbytes`` bytes, on ``device`` (an ``out`` argument of :meth:`MapCall.run` or :func:`copy_bytes`)."""
    if not out.is_contiguous() or out.nbytes != nbytes or out.device != device:
        raise LayoutError(
            f"out {tuple(out.shape)} {out.dtype} on {out.device}: {why}",
            fix="pass a contiguous tensor of exactly the result's bytes on the input's device, or no out",
        )
    return out.reshape(-1).view(torch.uint8)


def _word_bits(bits: IndexMap, x: torch.Tensor) -> torch.Tensor:
    """``bits`` on every aligned 32-bit word of ``x`` (any dtype, read as its bytes; same dtype and shape)."""
    raw = x.contiguous()
    return apply_word_bits(bits, raw.view(torch.uint8)).view(raw.dtype)
