"""Lazy reader: one MoE layer's experts from a safetensors checkpoint, stacked, TP-sliced.

Tensors are read one at a time through ``safetensors.safe_open`` slices (memory-mapped):
only the rows/columns of the requested tensor-parallel rank are read, never a whole file.
Every tensor is checked against the shape ``config.json`` implies (sizes through the one
alias table :data:`~fimoe_lab.checkpoints.conventions.CONFIG_KEYS`, per-layer lists by
layer) and the dtype its convention prescribes before it is read.

Stacked layout (what :class:`MoELayer` holds, the "checkpoint layout" of
:class:`~fimoe_lab.plan.LayerPlan`), with ``I`` the per-rank intermediate size, ``P`` 2
projections in ``w13`` for gated activations (1 for ReLU^2: ``up`` only) and ``v`` = 2
values per byte for packed 4-bit formats, else 1:

- ``w13`` ``(E, P*I, H/v)`` rows ``[gate; up]``; ``w2`` ``(E, H, I/v)``; fused, transposed
  (Llama-4, Qwen3-VL), flattened (DBRX) and interleaved (gpt-oss) files are read into it;
- ``fp8-block``: ``w13_scale`` float32 ``(E, 2*ceil(I/128), ceil(H/128))`` (gate's block
  rows then up's), ``w2_scale`` ``(E, ceil(H/128), ceil(I/128))`` (BF16 files widen exactly);
- ``fp8`` (ModelOpt per-tensor): ``w13_scale`` ``(E, 2)`` (gate, up), ``w2_scale`` ``(E,)``;
  extras ``w13_input_scale`` ``(E, 2)``, ``w2_input_scale`` ``(E,)``;
- ``fp8-channel``: ``w13_scale`` float32 ``(E, 2I, 1)``, ``w2_scale`` ``(E, H, 1)``;
- ``nvfp4``: ``w13_scale`` float8_e4m3fn ``(E, 2I, H/16)``, ``w2_scale`` ``(E, H, I/16)``;
  extras ``w13_weight_scale_2``/``w13_input_scale`` (ModelOpt) or ``w13_weight_global_scale``
  /``w13_input_global_scale`` (compressed-tensors) ``(E, 2)`` (gate, up), ``w2_*`` ``(E,)``;
- ``int4-group``: the int32 words' bytes, ``w13`` uint8 ``(E, 2I, H/2)``; ``w13_scale``
  bfloat16 ``(E, 2I, H/32)``, ``w2_scale`` ``(E, H, I/32)``;
- ``mxfp4``: ``w13_scale`` uint8 UE8M0 ``(E, 2I, H/32)``, ``w2_scale`` ``(E, H, I/32)``;
  extras ``w13_bias`` bf16 ``(E, 2I)``, ``w2_bias`` ``(E, H)`` (zeros on ranks > 0, as in vLLM,
  so that the ranks' partial outputs sum to the full layer's).

Layers are numbered by their index; MTP (next-token-prediction) layers under another prefix
(Qwen3-Next ``mtp.layers.k``) after the model's (``num_hidden_layers + k``), each with its
own path (:attr:`Checkpoint.layer_names`): never merged with a model layer.

Tensor parallelism follows the serving engines (see :meth:`Checkpoint.shard_bounds`): rank
``r`` takes the same intermediate rows of gate and of up and the same columns of down;
equal shards that must not cut a scale block, except gpt-oss, whose loader hands out whole
32-value MXFP4 blocks (last ranks smaller).

Over 800 lines on purpose: :class:`Checkpoint` and its three layer readers (per-expert files, fused
tensors, fused blocks) are one job, reading a layer, and share the checkpoint's private read and
check methods; split, those would become public names of another module.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import torch

from fimoe_lab import formats, shapes
from fimoe_lab.checkpoints import consistency, conventions, safe_io
from fimoe_lab.checkpoints.conventions import CONFIG_KEYS, Convention, config_value, dtype_name, stored_format
from fimoe_lab.errors import CheckpointError, LayoutError
from fimoe_lab.formats import QuantizedTensor

__all__ = ["CheckpointError", "MoELayer", "Checkpoint", "open_checkpoint"]

MAX_CONFIG_INT = 1 << 24
"""Largest size or count config.json may give (real models: hidden < 32768, experts < 1024)."""


@functools.lru_cache(maxsize=4)
def _expert_pattern(table: tuple[conventions.Convention, ...]) -> re.Pattern[str]:
    """Names of expert tensors of any convention of ``table`` (:data:`conventions.CONVENTIONS`, read at each
    call so that an entry added at run time is found): ``<prefix>(layers|blocks|block).<L>.<module>.<e>.`` or
    ``...<module>.<fused name>``; groups ``prefix`` and ``layer``."""
    alts = set()
    for c in table:
        if c.fused_layout is None:
            alts.add(re.escape(c.module) + r"\.\d+\.")
        else:
            f = c.fused_layout
            names = (*f.w13, f.w2, *(f.scales or ()), *(f.biases or ()))
            alts.update(re.escape(f"{c.module}.{n}") + "$" for n in names)
    return re.compile(
        r"^(?P<prefix>(?:.*\.)?(?:layers|blocks|block)\.)(?P<layer>\d+)\.(?:" + "|".join(sorted(alts)) + ")"
    )


# ============================================================================ the stacked layer
@dataclass
class MoELayer:
    """One MoE layer's experts in the stacked checkpoint layout (see the module docstring).

    ``intermediate`` is per TP rank; ``fmt`` a :data:`fimoe_lab.specs.FORMATS` name.
    ``activation``: a :data:`fimoe_lab.specs.ACTIVATIONS` name or alias, as the checkpoint's
    convention calls it: ``silu`` (SwiGLU) or ``swiglu_oai`` (gpt-oss: clamped, ``(up + 1)``),
    with ``activation_params`` (``alpha``, ``limit``).
    """

    fmt: str
    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: Optional[torch.Tensor]
    w2_scale: Optional[torch.Tensor]
    intermediate: int
    hidden: int
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    layer: Optional[int] = None
    convention: Optional[str] = None
    tp_size: int = 1
    tp_rank: int = 0
    activation: str = "silu"
    activation_params: dict = field(default_factory=dict)
    is_act_and_mul: bool = True
    is_gated: bool = True

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    def tensors(self) -> dict[str, Optional[torch.Tensor]]:
        """``w13``, ``w2``, ``w13_scale``, ``w2_scale`` by name (the four a LayerPlan maps)."""
        return {"w13": self.w13, "w2": self.w2, "w13_scale": self.w13_scale, "w2_scale": self.w2_scale}

    def with_tensors(self, **tensors: Optional[torch.Tensor]) -> MoELayer:
        """A copy with some of the four tensors replaced."""
        return replace(self, **tensors)

    def quantized(self) -> list[tuple[str, QuantizedTensor]]:
        """The layer as :class:`~fimoe_lab.formats.QuantizedTensor` parts: ``[(name, q), ...]``.

        Parts are ``gate``, ``up``, ``down`` where the scales differ per projection: block
        scales spanning rows (``scale_block_rows > 1``, fp8-block: a block row never mixes
        gate and up), a global scale per projection (``w13_weight_scale_2`` or
        ``w13_weight_global_scale`` ``(E, 2)``, nvfp4) or one scale per projection
        (``w13_scale`` ``(E, 2)``, ModelOpt fp8); else ``w13``, ``w2``. A non-gated layer (W13 of ``I`` rows, one
        projection) with per-projection scales gives ``w13``, ``down``. Empty for formats
        without a quantizer (``bf16``, and the read-only :data:`~fimoe_lab.checkpoints.conventions.CHECKPOINT_FORMATS`).
        """
        spec, i = stored_format(self.fmt), self.intermediate
        if spec.codec is None or self.w13_scale is None:
            return []
        f, block = self.fmt, spec.scale_block
        ws2, gs = self.extras.get("w13_weight_scale_2"), self.extras.get("w13_weight_global_scale")
        per_proj = self.w13_scale.dim() == 2  # one scale per projection (ModelOpt FP8): (E, 2)
        if spec.scale_block_rows == 1 and ws2 is None and gs is None and not per_proj:
            return [
                ("w13", QuantizedTensor(self.w13, self.w13_scale, None, f, block)),
                ("w2", QuantizedTensor(self.w2, self.w2_scale, None, f, block)),
            ]
        g13 = g_down = None  # global scales: (E, P) for W13's P projections, (E,) for W2
        if ws2 is not None:  # ModelOpt: weight_scale_2 = 1 / global scale
            g13, g_down = 1.0 / ws2, 1.0 / self.extras["w2_weight_scale_2"]
        if gs is not None:  # compressed-tensors: the global scale itself
            g13, g_down = gs, self.extras["w2_weight_global_scale"]
        down = ("down", QuantizedTensor(self.w2, self.w2_scale, g_down, f, block))
        s13 = self.w13_scale
        if self.w13.shape[1] != 2 * i:  # one projection (non-gated, ReLU^2): W13 has I rows
            one = s13[:, 0] if per_proj else s13
            return [("w13", QuantizedTensor(self.w13, one, None if g13 is None else g13[:, 0], f, block)), down]
        g_gate, g_up = (None, None) if g13 is None else (g13[:, 0], g13[:, 1])
        if per_proj:
            return [
                ("gate", QuantizedTensor(self.w13[:, :i], s13[:, 0], None, f, block)),
                ("up", QuantizedTensor(self.w13[:, i:], s13[:, 1], None, f, block)),
                down,
            ]
        half = s13.shape[1] // 2
        return [
            ("gate", QuantizedTensor(self.w13[:, :i], s13[:, :half], g_gate, f, block)),
            ("up", QuantizedTensor(self.w13[:, i:], s13[:, half:], g_up, f, block)),
            down,
        ]

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``w13`` ``(E, 2I, H)`` and ``w2`` ``(E, H, I)``, dequantized with :mod:`fimoe_lab.formats`."""
        parts = {name: formats.dequantize(q) for name, q in self.quantized()}
        if not parts:
            if stored_format(self.fmt).codec is not None or self.w13_scale is not None:
                raise CheckpointError(
                    f"format {self.fmt!r} has no dequantizer in fimoe_lab.formats",
                    fix="inspect and restore work; compare its bytes instead of values",
                )
            return self.w13.float(), self.w2.float()
        w13 = parts["w13"] if "w13" in parts else torch.cat([parts["gate"], parts["up"]], dim=1)
        return w13, parts["down"] if "down" in parts else parts["w2"]


# ============================================================================ the checkpoint
class Checkpoint:
    """A safetensors checkpoint directory (``config.json`` + shards, index optional), read lazily.

    ``convention`` is detected from tensor names and dtypes (every MoE layer must follow
    the same one); sizes come from ``config.json`` through :data:`conventions.CONFIG_KEYS`.
    MoE layers are numbered by their index; a layer under another prefix than the model's
    (MTP / next-token-prediction layers: Qwen3-Next ``mtp.layers.0``) is numbered after the
    model's layers (``num_hidden_layers + k``, as DeepSeek-V3 numbers its ``model.layers.61``)
    and keeps its own name (:attr:`layer_names`). Use as a context manager (or call
    :meth:`close`) to release the memory-mapped files.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if self.path.is_file():
            self.path = self.path.parent
        config_path = self.path / "config.json"
        if not os.path.lexists(config_path):
            raise FileNotFoundError(
                f"{self.path}: no config.json; a checkpoint directory needs the model's config.json "
                f"(hidden_size, intermediate and expert counts are read from it)"
            )
        self.config: dict = safe_io.read_json(config_path, "config.json")
        if not isinstance(self.config, dict):
            raise CheckpointError(f"{config_path} is not a JSON object", fix="restore the model's original config.json")
        self.shard_headers: dict[str, dict[str, int]] = {}
        """Per shard file, its tensors and the bytes its header declares for each (:mod:`.consistency`)."""
        self.weight_map = self._weight_map()
        self._handles: dict[str, object] = {}
        self.prefix, self._layers = self._find_moe_layers()
        if not self._layers:
            sample = [n for n in self.weight_map if "expert" in n][:6] or list(self.weight_map)[:6]
            raise CheckpointError(
                f"{self.path}: no MoE expert tensors follow a known naming convention "
                f"('<prefix>layers.<L>.<module>.<e>.<proj>...' or a fused '<module>.<name>'); known conventions: "
                + "; ".join(f"{c.name}: {c.pattern()}" for c in conventions.CONVENTIONS)
                + f". Tensor names seen: {sample}; closest known convention: {self._closest(sample)}",
                fix="add an entry to fimoe_lab/checkpoints/conventions.py",
            )
        self.convention: Convention = self._detect(next(iter(self._layers)))
        for idx in list(self._layers)[1:]:
            other = self._detect(idx)
            if other != self.convention:
                raise CheckpointError(
                    f"{self.path}: layer {idx} ({self._layers[idx]}) follows {other.name}, layer "
                    f"{next(iter(self._layers))} follows {self.convention.name}: one checkpoint, one convention",
                    fix="convert the layers of each convention separately (--layers)",
                )
        consistency.check_layers(self)

    # ------------------------------------------------------------------ files
    def _weight_map(self) -> dict[str, str]:
        """Tensor name -> shard file name, from the index (every shard path kept inside the directory,
        :func:`~fimoe_lab.checkpoints.safe_io.inside`) or from the headers of ``*.safetensors``."""
        index = self.path / "model.safetensors.index.json"
        if os.path.lexists(index):
            data = safe_io.read_json(index, "safetensors index")
            wm = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
                raise CheckpointError(
                    f"{index} has no 'weight_map' of tensor names to shard files",
                    fix="restore model.safetensors.index.json from the model's original files",
                )
            for file in set(wm.values()):
                safe_io.inside(self.path, file, "the index's shard")
            self.shard_headers = consistency.check_index(self.path, wm)
            return dict(wm)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.path}: no model.safetensors.index.json and no *.safetensors files")
        for f in files:
            safe_io.inside(self.path, f.name, "shard")
        mapping, self.shard_headers = consistency.weight_map_of_shards(self.path, files)
        return mapping

    def _handle(self, name: str):
        file = self.weight_map[name]
        if file not in self._handles:
            full = self.path / file
            if not os.path.lexists(full):
                raise FileNotFoundError(
                    2, f"{name} is mapped to {file} by the index, but the shard is missing (re-download it)", str(full)
                )
            self._handles[file] = safe_io.open_safetensors(full, "checkpoint shard")
        return self._handles[file]

    def close(self) -> None:
        """Release the open shard files."""
        self._handles.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def header(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """``(dtype, shape)`` of a tensor from the file header, without reading it."""
        if name not in self.weight_map:
            raise CheckpointError(f"{self.path}: no tensor named {name!r} in the index or shards")
        s = self._handle(name).get_slice(name)
        dt = s.get_dtype()
        return conventions.SAFETENSORS_DTYPES.get(dt, dt), tuple(s.get_shape())

    # ------------------------------------------------------------------ structure
    def _find_moe_layers(self) -> tuple[str, dict[int, str]]:
        """The model's layer prefix and ``{layer index: layer path}`` of every MoE layer (module docstring)."""
        found: dict[tuple[str, int], None] = {}
        pattern = _expert_pattern(conventions.CONVENTIONS)
        for name in self.weight_map:
            m = pattern.match(name)
            if m:
                found.setdefault((m["prefix"], int(m["layer"])))
        if not found:
            return "", {}
        counts: dict[str, int] = {}
        for prefix, _ in found:
            counts[prefix] = counts.get(prefix, 0) + 1
        main = max(counts, key=lambda p: (counts[p], -len(p)))
        layers = {idx: f"{prefix}{idx}" for prefix, idx in found if prefix == main}
        _, n_layers = config_value(self.config, "layers")
        first_extra = n_layers if isinstance(n_layers, int) and not isinstance(n_layers, bool) else max(layers) + 1
        for prefix, idx in sorted(p for p in found if p[0] != main):
            number = first_extra + idx
            if number in layers:
                raise CheckpointError(
                    f"{self.path}: MTP layer {prefix}{idx} would be numbered {number}, which {layers[number]} has",
                    fix="check num_hidden_layers in config.json",
                )
            layers[number] = f"{prefix}{idx}"
        return main, dict(sorted(layers.items()))

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the layers that hold routed experts (MTP layers included, numbered after the model's)."""
        return list(self._layers)

    @property
    def layer_names(self) -> dict[int, str]:
        """``{layer index: its path in the checkpoint}`` (``model.layers.3``, ``mtp.layers.0``)."""
        return dict(self._layers)

    @property
    def mtp_layers(self) -> list[int]:
        """The MoE layers past ``num_hidden_layers`` (MTP / next-token-prediction layers), by index."""
        _, n = config_value(self.config, "layers")
        return [i for i in self._layers if isinstance(n, int) and i >= n]

    def _closest(self, names: Sequence[str]) -> str:
        """The convention whose tensor names share the most dotted parts with ``names`` (its weight dtype
        among theirs breaking ties), as ``name (pattern)``."""
        seen = {part for n in names for part in n.split(".")}
        dtypes = {self.header(n)[0] for n in names}

        def score(c: Convention) -> tuple[int, bool]:
            f = c.fused_layout
            own = [*c.module.split("."), c.weight_suffix, *(p for p in c.projections or () if p)]
            if f is not None:
                own += [part for n in (*f.w13, f.w2) for part in n.split(".")]
            return len(seen & set(own)), c.file_weight_dtype in dtypes

        best = max(conventions.CONVENTIONS, key=score)
        return f"{best.name} ({best.pattern()})"

    def _scale_kind_ok(self, conv: Convention, base: str) -> bool:
        """Tell FP8 conventions with the same names apart by their scale's shape (block, row, tensor)."""
        if conv.fused_layout is not None or conv.scale_suffix is None:
            return True
        proj = 0 if conv.gated else 1
        _, wshape = self.header(conv.expert_key("", 0, 0, proj, base=base))
        _, sshape = self.header(conv.expert_key("", 0, 0, proj, conv.scale_suffix, base))
        if conv.scales == "tensor":  # ModelOpt () or compressed-tensors (1,)
            return sshape == conv.scalar_shape
        if conv.scales == "row":
            return len(sshape) == 2 and sshape[1] == 1 and sshape[0] == wshape[0]
        return len(sshape) == 2 and not (sshape[1] == 1 and sshape[0] == wshape[0] > 1)

    def _detect(self, layer: int) -> Convention:
        base = self._layers[layer]
        for conv in (variant for c in conventions.CONVENTIONS for variant in c.variants()):
            ok = True
            for name, dtype in conv.signature(base).items():
                present = name in self.weight_map
                if dtype is None:
                    ok &= not present
                else:
                    ok &= present and self.header(name)[0] == dtype
                if not ok:
                    break
            if ok and self._scale_kind_ok(conv, base):
                return conv
        self._refuse_dtype(layer, base)
        found = sorted(n for n in self.weight_map if n.startswith(f"{base}."))[:8]
        found_s = ", ".join(f"{n} ({dtype_name(self.header(n)[0])})" for n in found)
        raise CheckpointError(
            f"{self.path}: layer {layer}'s expert tensors follow no known naming convention. Expected one of: "
            + "; ".join(f"{c.name}: {c.pattern()}" for c in conventions.CONVENTIONS)
            + f". Found: {found_s}; closest known convention: {self._closest(found)}",
            fix="add an entry to fimoe_lab/checkpoints/conventions.py",
        )

    def _refuse_dtype(self, layer: int, base: str) -> None:
        """One line for a layer whose tensors carry a convention's names (and scale shapes) with a dtype none of
        its writers stores (compressed-tensors INT4 with F16 scales: its MxInt4 layout takes BF16 scales, and
        rounding F16 ones to BF16 would not restore)."""
        for conv in conventions.CONVENTIONS:
            stored: dict[str, set[str]] = {}
            for variant in conv.variants():
                for name, dtype in variant.signature(base).items():
                    stored.setdefault(name, set()).add("absent" if dtype is None else dtype_name(dtype))
            if any(("absent" in d) != (name not in self.weight_map) for name, d in stored.items()):
                continue
            if not self._scale_kind_ok(conv, base):
                continue
            for name, dtypes in stored.items():
                got = dtype_name(self.header(name)[0]) if name in self.weight_map else "absent"
                if got not in dtypes:
                    known = "/".join(sorted(dtypes - {"absent"}))
                    raise CheckpointError(
                        f"{self.path}: layer {layer}'s expert tensors are named as {conv.name} ({conv.models}), but "
                        f"{name} is {got}: {conv.name} is read with {known} there only",
                        fix=f"export it with {known} {name.rsplit('.', 1)[-1]} (the dtype this convention's writers "
                        f"store and its kernel layout takes), or add the dtype to {conv.name}'s writer_dtypes in "
                        f"fimoe_lab/checkpoints/conventions.py if a writer stores it and it restores byte for byte",
                    )

    def _config_entry(self, what: str, layer: Optional[int]) -> tuple[str, object]:
        key, v = config_value(self.config, what)
        if key is None:
            raise CheckpointError(
                f"{self.path / 'config.json'}: no {what} size ({' or '.join(CONFIG_KEYS[what])}); the "
                f"{self.convention.name} convention reads it from there",
                fix="add the key from the model's original config.json",
            )
        if isinstance(v, list):  # per layer (Hunyuan-A13B)
            idx = self.moe_layers[0] if layer is None else layer
            if not 0 <= idx < len(v):
                raise CheckpointError(
                    f"{self.path / 'config.json'}: {key} is a per-layer list of {len(v)} entries, layer {idx} has none",
                    fix="restore the list from the model's original config.json",
                )
            key, v = f"{key}[{idx}]", v[idx]
        return key, v

    def config_size(self, what: str, layer: Optional[int] = None) -> int:
        """A :data:`conventions.CONFIG_KEYS` size (``hidden``, ``intermediate``, ``experts``, ``top_k``) of
        ``layer`` (default the first MoE layer) from config.json, as an int in ``[1, MAX_CONFIG_INT]``."""
        key, v = self._config_entry(what, layer)
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_CONFIG_INT:
            raise CheckpointError(
                f"{self.path / 'config.json'}: {key} is {v!r}, not an integer in [1, {MAX_CONFIG_INT}]",
                fix="restore the value from the model's original config.json",
            )
        return v

    def _size_keys(self, layer: Optional[int]) -> dict[str, str]:
        """The config.json key each size of ``layer`` comes from (for messages)."""
        return {w: self._config_entry(w, layer)[0] for w in ("hidden", "intermediate", "experts")}

    def config_float(self, key: str, default: float) -> float:
        """A finite number from config.json (``default`` when absent)."""
        v = self.config.get(key, default)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise CheckpointError(
                f"{self.path / 'config.json'}: {key} is {v!r}, not a finite number",
                fix="restore the value from the model's original config.json",
            )
        return float(v)

    @property
    def hidden(self) -> int:
        return self.config_size("hidden")

    @property
    def intermediate(self) -> int:
        """The full (unsharded) MoE intermediate size of the first MoE layer (:meth:`config_size` per layer)."""
        return self.config_size("intermediate")

    @property
    def num_experts(self) -> int:
        return self.config_size("experts")

    @property
    def top_k(self) -> int:
        return self.config_size("top_k")

    @property
    def fmt(self) -> str:
        return self.convention.fmt

    # ------------------------------------------------------------------ reading
    def _check(
        self, name: str, dtype: torch.dtype, shape: tuple[int, ...], role: str, layer: Optional[int] = None
    ) -> None:
        if name not in self.weight_map:
            raise CheckpointError(
                f"missing tensor {name} ({role}): expected {dtype_name(dtype)} {list(shape)} for the "
                f"{self.convention.name} convention in {self.path}; the index/shards do not contain it",
                fix="re-download the shard that holds it or check num experts/intermediate in config.json",
            )
        got_dtype, got_shape = self.header(name)
        scalar_ok = len(shape) <= 1 and math.prod(shape) == 1 and math.prod(got_shape) == 1 and len(got_shape) <= 1
        if got_dtype != dtype or (got_shape != shape and not scalar_ok):
            raise CheckpointError(
                f"{name} ({role}) in {self.weight_map[name]}: expected {dtype_name(dtype)} {list(shape)}, found "
                f"{dtype_name(got_dtype)} {list(got_shape)} (config.json: "
                + ", ".join(f"{k} {self.config_size(w, layer)}" for w, k in self._size_keys(layer).items())
                + ")",
                fix=f"check that config.json belongs to these weights and that the convention is {self.convention.name}",
            )

    def _read(self, name: str, index: Optional[tuple] = ()) -> torch.Tensor:
        """Read ``name`` (only ``index`` of it); ``index=None`` reads a one-element tensor as a scalar."""
        if index is None:
            return self._handle(name).get_tensor(name).reshape(())
        s = self._handle(name).get_slice(name)
        return s[index] if index else s[:]

    def shard_bounds(self, tp_size: int, tp_rank: int, layer: Optional[int] = None) -> tuple[int, int]:
        """Intermediate rows ``[start, end)`` of rank ``tp_rank`` of ``tp_size`` for ``layer`` (default the
        first MoE layer; sizes may differ per layer), as serving engines shard.

        Per-expert and plain fused conventions (vLLM's FusedMoE loader): ``I % tp == 0``, equal
        shards, and a shard must not cut a scale block (vLLM refuses that for FP8 block scales).
        gpt-oss (vLLM's MXFP4 loader): whole 32-value blocks, ``ceil(blocks / tp)`` per rank,
        the last ranks smaller, so any tp works until a rank would get nothing.
        """
        conv = self.convention
        if not (isinstance(tp_size, int) and tp_size >= 1 and isinstance(tp_rank, int) and 0 <= tp_rank < tp_size):
            raise CheckpointError(
                f"tensor-parallel rank {tp_rank} of {tp_size} is not valid", fix="choose tp >= 1 and 0 <= rank < tp"
            )
        full_i = self.config_size("intermediate", layer)
        spec = conv.spec
        # a packed int32 holds 8 values: a shard of the down projection must start on one
        per_element = spec.values_per_byte * conv.file_weight_dtype.itemsize // conv.weight_dtype.itemsize
        whole_blocks = conv.fused_layout is not None and bool(conv.fused_layout.blocks)
        try:
            sizes = shapes.rank_intermediates(
                full_i, tp_size, spec, whole_blocks, block=max(spec.scale_block or 1, per_element)
            )
        except LayoutError as exc:
            key = self._config_entry("intermediate", layer)[0]
            raise CheckpointError(
                f"{exc.message} ({self.path / 'config.json'}: {key} = {full_i})", fix=exc.fix
            ) from None
        r0 = sum(sizes[:tp_rank])
        return r0, r0 + sizes[tp_rank]

    def read_layer(
        self,
        layer: int,
        tp_size: int = 1,
        tp_rank: int = 0,
        load: str = "all",
        progress: bool = False,
        experts: Optional[tuple[int, int]] = None,
        pin: bool = False,
    ) -> MoELayer:
        """Stack layer ``layer``'s experts for rank ``tp_rank`` of ``tp_size``.

        ``load``: ``all`` reads everything; ``scales`` leaves weights as ``meta`` tensors
        (shapes only; for health checks); ``none`` reads nothing (shapes and checks only).
        ``experts``: ``(e0, e1)`` with ``0 <= e0 < e1 <= E`` reads experts ``e0 .. e1-1`` only
        (every stacked tensor and extra ``(e1 - e0, ...)``, byte-identical to ``[e0:e1]`` of the
        whole layer's; the tensors of those experts checked); None: all ``E``. Every tensor is
        checked (present, dtype, shape) before any is read. ``pin``: the buffers the tensors are stacked
        into are page-locked (for a copy to a GPU; needs a CUDA build of torch).
        """
        if layer not in self._layers:
            raise CheckpointError(
                f"{self.path}: layer {layer} has no routed experts",
                fix=f"choose one of the MoE layers {self.moe_layers}",
            )
        if load not in ("all", "scales", "none"):
            raise CheckpointError(f"load={load!r} is not a read mode", fix="pass load='all', 'scales' or 'none'")
        conv = self.convention
        r0, r1 = self.shard_bounds(tp_size, tp_rank, layer)
        e_count = self.config_size("experts", layer)
        e0, e1 = (0, e_count) if experts is None else experts
        if not all(isinstance(e, int) and not isinstance(e, bool) for e in (e0, e1)) or not 0 <= e0 < e1 <= e_count:
            raise CheckpointError(
                f"experts {experts!r} is not a range (e0, e1) with 0 <= e0 < e1 <= {e_count} (layer {layer}'s experts)",
                fix=f"pass experts=(e0, e1) within [0, {e_count}], or None for all",
            )
        f = conv.fused_layout
        reader = _PerExpertReader if f is None else _BlocksReader if f.blocks else _FusedReader
        moe = reader(self, layer, tp_size, tp_rank, r0, r1, load, progress, (e0, e1), pin).run()
        if conv.activation == "swiglu_oai":
            moe.activation_params = {
                "alpha": self.config_float("swiglu_alpha", 1.702),
                "limit": self.config_float("swiglu_limit", 7.0),
            }
        return moe


class _LayerReader:
    """Shared state of one read: sizes, slices and the output buffers (``n = e1 - e0`` experts of ``E``)."""

    def __init__(
        self,
        ckpt: Checkpoint,
        layer: int,
        tp_size: int,
        tp_rank: int,
        r0: int,
        r1: int,
        load: str,
        progress: bool,
        experts: tuple[int, int],
        pin: bool = False,
    ):
        self.ck, self.layer, self.tp_size, self.tp_rank, self.pin = ckpt, layer, tp_size, tp_rank, pin
        self.r0, self.r1, self.il = r0, r1, r1 - r0
        self.e0, self.e1 = experts
        self.n = self.e1 - self.e0
        self.load, self.progress = load, progress
        self.conv, self.fmt = ckpt.convention, ckpt.fmt
        self.base = ckpt._layers[layer]
        self.E, self.H = ckpt.config_size("experts", layer), ckpt.hidden
        self.I = ckpt.config_size("intermediate", layer)
        self.P = 2 if self.conv.gated else 1
        self.spec = self.conv.spec
        self.v = self.spec.values_per_byte
        for size, name in ((self.H, "hidden"), (self.I, "intermediate")):
            if self.spec.packed and size % self.spec.scale_block:
                raise CheckpointError(
                    f"{ckpt.path / 'config.json'}: {name} size {size} is not a multiple of the {self.spec.scale_block}-"
                    f"value {self.fmt} scale block, so its packed tensors cannot have the shape the convention needs",
                    fix="check that config.json belongs to these weights",
                )
        need = self.E * (self.P + 1) * self.I * self.H * self.conv.weight_dtype.itemsize // self.v
        read = self.n * (self.P + 1) * self.il * self.H * self.conv.weight_dtype.itemsize // self.v
        consistency.check_layer_read(ckpt, layer, self.E, need, read if load == "all" else 0)

    def key(self, name: str) -> str:
        return self.conv.fused_key("", 0, name, self.base)

    def buffer(self, shape: tuple[int, ...], dtype: torch.dtype, is_scale: bool) -> torch.Tensor:
        if not self.wants(is_scale):
            return torch.empty(shape, dtype=dtype, device="meta")
        return torch.empty(shape, dtype=dtype, pin_memory=self.pin)

    def wants(self, is_scale: bool) -> bool:
        return self.load == "all" or (self.load == "scales" and is_scale)

    def check(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], role: str) -> None:
        self.ck._check(name, dtype, shape, role, self.layer)

    def finish(self, w13, w2, s13, s2, extras) -> MoELayer:
        return MoELayer(
            self.fmt,
            w13,
            w2,
            s13,
            s2,
            self.il,
            self.H,
            extras,
            self.layer,
            self.conv.name,
            self.tp_size,
            self.tp_rank,
            self.conv.activation,
            is_act_and_mul=self.conv.gated,
            is_gated=self.conv.gated,
        )


class _PerExpertReader(_LayerReader):
    """One tensor per expert and projection (DeepSeek/Kimi/Qwen3/MiniMax FP8, compressed-tensors,
    ModelOpt, BF16 gate_proj/up_proj/down_proj or w1/w3/w2, Nemotron's up_proj/down_proj)."""

    def scale_spec(self, proj: int) -> tuple[tuple[int, ...], tuple, int]:
        """Full stored scale shape of projection ``proj``, this rank's slice of it and the stacked rows it gives.

        Block scales: one covers ``scale_block_rows x scale_block`` values of its weight
        ``(rows, cols)`` (``specs.FORMATS``), so they are ``(ceil(rows/br), ceil(cols/bc))``,
        gate and up sliced along their rows, down along its columns; row scales ``(rows, 1)``
        (down's whole); tensor scales one value (read as a scalar).
        """
        rows, cols = (self.I, self.H) if proj < 2 else (self.H, self.I)
        kind = self.conv.scales
        if kind == "tensor":
            return (), None, 1
        if kind == "row":
            return (
                (rows, 1),
                ((slice(self.r0, self.r1), slice(None)) if proj < 2 else ()),
                (self.il if proj < 2 else rows),
            )
        br, bc = self.spec.scale_block_rows, self.spec.scale_block
        full = (-(-rows // br), -(-cols // bc))
        along = br if proj < 2 else bc
        lo, hi = self.r0 // along, -(-self.r1 // along)
        sl = (slice(lo, hi), slice(None)) if proj < 2 else (slice(None), slice(lo, hi))
        return full, sl, (hi - lo if proj < 2 else full[0])

    def run(self) -> MoELayer:
        c, n, H, I, il, v, P = self.conv, self.n, self.H, self.I, self.il, self.v, self.P
        per = c.file_weight_dtype.itemsize // c.weight_dtype.itemsize  # an int32 of packed int4 holds 4 bytes
        plan = []  # (name, file dtype, full shape, slice, destination, is scale, role)
        w13 = self.buffer((n, P * il, H // v), c.weight_dtype, False)
        w2 = self.buffer((n, H, il // v), c.weight_dtype, False)
        s13 = s2 = None
        extras: dict[str, torch.Tensor] = {}
        if c.scale_suffix:
            _, _, n13 = self.scale_spec(0)
            full2, _, _ = self.scale_spec(2)
            if c.scales == "tensor":
                s13, s2 = self.buffer((n, P), c.scale_dtype, True), self.buffer((n,), c.scale_dtype, True)
            else:
                _, sl2, _ = self.scale_spec(2)
                cols2 = full2[1] if c.scales == "row" else len(range(*sl2[1].indices(full2[1])))
                g_cols = self.scale_spec(0)[0][1]
                s13 = self.buffer((n, P * n13, g_cols), c.scale_dtype, True)
                s2 = self.buffer((n, full2[0], cols2), c.scale_dtype, True)
        for stack, shape in (("w13", (n, P)), ("w2", (n,))):
            for extra in c.scalar_extras:
                extras[f"{stack}_{extra}"] = self.buffer(shape, torch.float32, True)
        for e in range(self.e0, self.e1):
            d = e - self.e0  # its place in the buffers
            for proj in range(2 - P, 3):
                k = proj - (2 - P)  # position in w13 (0 gate or up, 1 up)
                if proj < 2:
                    shape = (I, H // v // per)
                    sl = (slice(self.r0, self.r1), slice(None))
                    dest = (w13, d, slice(k * il, (k + 1) * il))
                else:
                    shape = (H, I // v // per)
                    sl = (slice(None), slice(self.r0 // v // per, self.r1 // v // per))
                    dest = (w2, d, slice(None))
                plan.append(
                    (
                        c.expert_key("", 0, e, proj, base=self.base),
                        c.file_weight_dtype,
                        shape,
                        sl,
                        dest,
                        False,
                        "weight",
                    )
                )
                if c.shape_suffix:  # compressed-tensors' record of the unpacked (rows, cols)
                    key = c.expert_key("", 0, e, proj, c.shape_suffix, self.base)
                    want = [shape[0], shape[1] * v * per]
                    plan.append((key, c.file_shape_dtype, (2,), want, None, True, "weight shape"))
                if s13 is not None:
                    full, ssl, rows = self.scale_spec(proj)
                    if c.scales == "tensor":
                        sdest = (s13, d, k) if proj < 2 else (s2, d)
                    else:
                        sdest = (s13, d, slice(k * rows, (k + 1) * rows)) if proj < 2 else (s2, d, slice(None))
                    plan.append(
                        (
                            c.expert_key("", 0, e, proj, c.scale_suffix, self.base),
                            c.file_scale_dtype,
                            full,
                            ssl,
                            sdest,
                            True,
                            f"{c.scales} scale",
                        )
                    )
                for extra in c.scalar_extras:
                    buf = extras[f"{'w13' if proj < 2 else 'w2'}_{extra}"]
                    plan.append(
                        (
                            c.expert_key("", 0, e, proj, extra, self.base),
                            c.file_scalar_dtype,
                            c.scalar_shape,
                            None,
                            (buf, d, k) if proj < 2 else (buf, d),
                            True,
                            extra,
                        )
                    )
        for name, dtype, shape, _, _, _, role in plan:
            self.check(name, dtype, shape, role)
        for name, _, _, want, dest, _, _ in plan:
            if dest is None and self.load != "none":  # weight_shape must give the weight's (rows, cols)
                got = self.ck._read(name).tolist()
                if got != want:
                    raise CheckpointError(
                        f"{name} is {got}, the weight it describes is {want} by config.json",
                        fix="check that config.json belongs to these weights",
                    )
        items = [p for p in plan if p[4] is not None and self.wants(p[5])]
        if self.progress is True and items:  # a terminal's live bar; plain progress (a bar class) counts bytes only
            from tqdm.auto import tqdm

            items = tqdm(items, desc=f"layer {self.layer}", unit="tensor", leave=False)
        for name, _, _, sl, dest, _, _ in items:
            t = self.ck._read(name, sl)
            if t.dtype != dest[0].dtype and t.dtype == torch.int32:  # packed int4: its bytes
                t = t.view(torch.uint8)
            dest[0][dest[1:]] = t  # BF16 / F16 stored scales and scalars widen to float32 exactly
        return self.finish(w13, w2, s13, s2, extras)


class _FusedReader(_LayerReader):
    """All experts in one tensor per projection, BF16: Granite ``input_linear`` ``(E, 2I, H)``,
    Llama-4 / Qwen3-VL ``gate_up_proj`` ``(E, H, 2I)`` (transposed), DBRX ``w1``/``v1``/``w2`` ``(E*I, H)``."""

    def run(self) -> MoELayer:
        c, f, E, H, I, r0, r1 = self.conv, self.conv.fused_layout, self.E, self.H, self.I, self.r0, self.r1
        assert f is not None
        wd, ex = c.file_weight_dtype, slice(self.e0, self.e1)
        if f.flat:
            shapes = {n: (E * I, H) for n in (*f.w13, f.w2)}
        elif f.transposed:
            shapes = {f.w13[0]: (E, H, 2 * I), f.w2: (E, I, H)}
        else:
            shapes = {f.w13[0]: (E, 2 * I, H), f.w2: (E, H, I)}
        for n, shape in shapes.items():
            self.check(self.key(n), wd, shape, n)
        if not self.wants(False):
            return self.finish(
                torch.empty((self.n, 2 * self.il, H), dtype=wd, device="meta"),
                torch.empty((self.n, H, self.il), dtype=wd, device="meta"),
                None,
                None,
                {},
            )
        read = lambda n, sl: self.ck._read(self.key(n), sl)  # noqa: E731
        if f.flat:  # expert e's rows are e*I .. (e+1)*I of each tensor
            rows = lambda n: torch.stack(  # noqa: E731
                [read(n, (slice(e * I + r0, e * I + r1),)) for e in range(self.e0, self.e1)]
            )
            w13 = torch.cat([rows(f.w13[0]), rows(f.w13[1])], dim=1)
            w2 = rows(f.w2).transpose(1, 2)
        elif f.transposed:
            gu = f.w13[0]
            gate = read(gu, (ex, slice(None), slice(r0, r1)))
            up = read(gu, (ex, slice(None), slice(I + r0, I + r1)))
            w13 = torch.cat([gate, up], dim=2).transpose(1, 2)
            w2 = read(f.w2, (ex, slice(r0, r1))).transpose(1, 2)
        else:
            gu = f.w13[0]
            w13 = torch.cat([read(gu, (ex, slice(r0, r1))), read(gu, (ex, slice(I + r0, I + r1)))], 1)
            w2 = read(f.w2, (ex, slice(None), slice(r0, r1)))
        return self.finish(w13.contiguous(), w2.contiguous(), None, None, {})


class _BlocksReader(_LayerReader):
    """gpt-oss (HF names and ``original/``): MXFP4 blocks of all experts per projection, gate/up rows interleaved."""

    def run(self) -> MoELayer:
        """Blocks ``(E, rows, cols/b, b/v)`` and scales ``(E, rows, cols/b)`` per projection (``b`` the
        format's scale block, ``v`` values per byte: MXFP4 32 and 2); this rank's rows of gate_up
        (``2 * r0 : 2 * r1``, interleaved) and columns of down (whole blocks)."""
        c, f, E, H, I, il, b = self.conv, self.conv.fused_layout, self.E, self.H, self.I, self.il, self.spec.scale_block
        assert f is not None and f.scales is not None
        bb, n, ex = b // self.v, self.n, slice(self.e0, self.e1)  # bytes per block, experts read
        wd, sd = c.file_weight_dtype, c.file_scale_dtype
        up_rows, down_cols = (
            (ex, slice(2 * self.r0, 2 * self.r1)),
            (ex, slice(None), slice(self.r0 // b, self.r1 // b)),
        )
        g13, g2 = f.w13[0], f.w2
        specs = [  # (role, name, dtype, full shape, slice, is scale, rank shape)
            ("w13", g13, wd, (E, 2 * I, H // b, bb), up_rows, False, (n, 2 * il, H // self.v)),
            ("s13", f.scales[0], sd, (E, 2 * I, H // b), up_rows, True, (n, 2 * il, H // b)),
            ("w2", g2, wd, (E, H, I // b, bb), down_cols, False, (n, H, il // self.v)),
            ("s2", f.scales[1], sd, (E, H, I // b), down_cols, True, (n, H, il // b)),
        ]
        has_bias = f.biases is not None and self.key(f.biases[0]) in self.ck.weight_map
        if has_bias:
            assert f.biases is not None
            specs += [
                (
                    "b13",
                    f.biases[0],
                    torch.bfloat16,
                    (E, 2 * I),
                    (ex, slice(2 * self.r0, 2 * self.r1)),
                    True,
                    (n, 2 * il),
                ),
                ("b2", f.biases[1], torch.bfloat16, (E, H), (ex,), True, (n, H)),
            ]
        for _, name, dtype, shape, _, _, _ in specs:
            self.check(self.key(name), dtype, shape, f"{self.fmt.upper()} {name.replace('_', ' ')}")
        got = {}
        for role, name, dtype, _, sl, is_scale, out_shape in specs:
            if not self.wants(is_scale):
                got[role] = torch.empty(out_shape, dtype=dtype, device="meta")
                continue
            t = self.ck._read(self.key(name), sl).reshape(out_shape)
            if role in ("w13", "s13", "b13"):  # rows g0, u0, g1, u1, ... -> [gate; up]
                t = torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)
            got[role] = t.contiguous()
        if has_bias and self.tp_rank > 0 and self.wants(True):  # vLLM: only rank 0 adds the down bias
            got["b2"] = torch.zeros_like(got["b2"])
        extras = {"w13_bias": got["b13"], "w2_bias": got["b2"]} if has_bias else {}
        return self.finish(got["w13"], got["w2"], got["s13"], got["s2"], extras)


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Open a checkpoint directory (detects its naming convention and format)."""
    return Checkpoint(path)
