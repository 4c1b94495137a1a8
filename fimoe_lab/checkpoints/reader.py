"""Lazy reader: one MoE layer's experts from a safetensors checkpoint, stacked, TP-sliced.

Tensors are read one at a time through ``safetensors.safe_open`` slices (memory-mapped):
only the rows/columns of the requested tensor-parallel rank are read, never a whole file.
Every tensor is checked against the shape ``config.json`` implies and the dtype its
convention prescribes before it is read.

Stacked layout (what :class:`MoELayer` holds, the "checkpoint layout" of
:class:`~fimoe_lab.plan.LayerPlan`), with ``I`` the per-rank intermediate size and
``v`` = 2 values per byte for FP4 formats, else 1:

- ``w13`` ``(E, 2I, H/v)`` rows ``[gate; up]``; ``w2`` ``(E, H, I/v)``;
- ``fp8-block``: ``w13_scale`` float32 ``(E, 2*ceil(I/128), ceil(H/128))`` (gate's block
  rows then up's), ``w2_scale`` ``(E, ceil(H/128), ceil(I/128))``;
- ``nvfp4``: ``w13_scale`` float8_e4m3fn ``(E, 2I, H/16)``, ``w2_scale`` ``(E, H, I/16)``;
  extras ``w13_weight_scale_2``/``w13_input_scale`` ``(E, 2)`` (gate, up) and
  ``w2_weight_scale_2``/``w2_input_scale`` ``(E,)``;
- ``mxfp4``: ``w13_scale`` uint8 UE8M0 ``(E, 2I, H/32)``, ``w2_scale`` ``(E, H, I/32)``;
  extras ``w13_bias`` bf16 ``(E, 2I)``, ``w2_bias`` ``(E, H)`` (zeros on ranks > 0, as in vLLM,
  so that the ranks' partial outputs sum to the full layer's).

Tensor parallelism follows the serving engines (see :meth:`Checkpoint.shard_bounds`): rank
``r`` takes the same intermediate rows of gate and of up and the same columns of down;
equal shards that must not cut a scale block, except gpt-oss, whose loader hands out whole
32-value MXFP4 blocks (last ranks smaller).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import torch

from fimoe_lab import formats
from fimoe_lab.checkpoints import conventions, safe_io
from fimoe_lab.checkpoints.conventions import Convention, dtype_name
from fimoe_lab.errors import CheckpointError
from fimoe_lab.formats import QuantizedTensor
from fimoe_lab.specs import get_format

__all__ = ["CheckpointError", "MoELayer", "Checkpoint", "open_checkpoint"]

MAX_CONFIG_INT = 1 << 24
"""Largest size or count config.json may give (real models: hidden < 32768, experts < 1024)."""

_LAYER_RE = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.)(?P<layer>\d+)\.(?P<block>mlp|block_sparse_moe)\.experts\.")


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
        gate and up) or a global scale per projection (``w13_weight_scale_2`` ``(E, 2)``,
        nvfp4); else ``w13``, ``w2``. Empty for formats without a quantizer (``bf16``).
        """
        spec, i = get_format(self.fmt), self.intermediate
        if spec.codec is None:
            return []
        f, block, ws2 = self.fmt, spec.scale_block, self.extras.get("w13_weight_scale_2")
        if spec.scale_block_rows == 1 and ws2 is None:
            return [
                ("w13", QuantizedTensor(self.w13, self.w13_scale, None, f, block)),
                ("w2", QuantizedTensor(self.w2, self.w2_scale, None, f, block)),
            ]
        g_gate = g_up = g_down = None
        if ws2 is not None:  # stored as weight_scale_2 = 1 / global scale
            g_gate, g_up, g_down = 1.0 / ws2[:, 0], 1.0 / ws2[:, 1], 1.0 / self.extras["w2_weight_scale_2"]
        half = self.w13_scale.shape[1] // 2
        return [
            ("gate", QuantizedTensor(self.w13[:, :i], self.w13_scale[:, :half], g_gate, f, block)),
            ("up", QuantizedTensor(self.w13[:, i:], self.w13_scale[:, half:], g_up, f, block)),
            ("down", QuantizedTensor(self.w2, self.w2_scale, g_down, f, block)),
        ]

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``w13`` ``(E, 2I, H)`` and ``w2`` ``(E, H, I)``, dequantized with :mod:`fimoe_lab.formats`."""
        parts = {name: formats.dequantize(q) for name, q in self.quantized()}
        if not parts:
            return self.w13.float(), self.w2.float()
        if "w13" in parts:
            return parts["w13"], parts["w2"]
        return torch.cat([parts["gate"], parts["up"]], dim=1), parts["down"]


# ============================================================================ the checkpoint
class Checkpoint:
    """A safetensors checkpoint directory (``config.json`` + shards, index optional), read lazily.

    ``convention`` is detected from tensor names and dtypes; sizes come from ``config.json``.
    Use as a context manager (or call :meth:`close`) to release the memory-mapped files.
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
        self.weight_map = self._weight_map()
        self._handles: dict[str, object] = {}
        self._layers = self._find_moe_layers()
        first = next(iter(self._layers), None)
        if first is None:
            sample = [n for n in self.weight_map if "expert" in n][:5] or list(self.weight_map)[:5]
            raise CheckpointError(
                f"{self.path}: no MoE expert tensors follow a known naming convention "
                f"('<prefix>layers.<L>.mlp.experts.' or '.block_sparse_moe.experts.'); known conventions: "
                + "; ".join(f"{c.name}: {c.pattern()}" for c in conventions.CONVENTIONS)
                + f". Tensor names seen: {sample}",
                fix="add an entry to fimoe_lab/checkpoints/conventions.py",
            )
        self.prefix = self._layers[first]
        self.convention: Convention = self._detect(first)

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
            return dict(wm)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.path}: no model.safetensors.index.json and no *.safetensors files")
        mapping = {}
        for f in files:
            safe_io.inside(self.path, f.name, "shard")
            with safe_io.open_safetensors(f, "checkpoint shard") as handle:
                mapping.update({k: f.name for k in handle.keys()})
        return mapping

    def data_bytes(self) -> int:
        """Total size of the shard files (what any tensor read from them is bounded by)."""
        return sum(os.stat(self.path / f).st_size for f in set(self.weight_map.values()) if (self.path / f).exists())

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
    def _find_moe_layers(self) -> dict[int, str]:
        layers: dict[int, str] = {}
        for name in self.weight_map:
            m = _LAYER_RE.match(name)
            if m:
                layers.setdefault(int(m["layer"]), m["prefix"])
        return dict(sorted(layers.items()))

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the layers that hold routed experts."""
        return list(self._layers)

    def _detect(self, layer: int) -> Convention:
        prefix = self._layers[layer]
        for conv in conventions.CONVENTIONS:
            ok = True
            for name, dtype in conv.signature(prefix, layer).items():
                present = name in self.weight_map
                if dtype is None:
                    ok &= not present
                else:
                    ok &= present and self.header(name)[0] == dtype
                if not ok:
                    break
            if ok:
                return conv
        found = sorted(n for n in self.weight_map if n.startswith(f"{prefix}{layer}.") and ".experts." in n)[:6]
        found_s = ", ".join(f"{n} ({dtype_name(self.header(n)[0])})" for n in found)
        raise CheckpointError(
            f"{self.path}: layer {layer}'s expert tensors follow no known naming convention. Expected one of: "
            + "; ".join(f"{c.name}: {c.pattern()}" for c in conventions.CONVENTIONS)
            + f". Found: {found_s}",
            fix="add an entry to fimoe_lab/checkpoints/conventions.py",
        )

    def config_int(self, keys: Sequence[str], what: str) -> int:
        """The first of ``keys`` present in config.json (also under ``text_config``), as int."""
        text = self.config.get("text_config")
        for cfg in (self.config, text if isinstance(text, dict) else {}):
            for k in keys:
                if k in cfg and cfg[k] is not None:
                    v = cfg[k]
                    if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_CONFIG_INT:
                        raise CheckpointError(
                            f"{self.path / 'config.json'}: {k} is {v!r}, not an integer in [1, {MAX_CONFIG_INT}]",
                            fix="restore the value from the model's original config.json",
                        )
                    return v
        raise CheckpointError(
            f"{self.path / 'config.json'}: no {what} ({' or '.join(keys)}); the {self.convention.name} convention "
            f"reads it from there",
            fix="add the key from the model's original config.json",
        )

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
        return self.config_int(("hidden_size",), "hidden size")

    @property
    def intermediate(self) -> int:
        """The full (unsharded) MoE intermediate size from config.json."""
        return self.config_int(self.convention.intermediate_keys, "MoE intermediate size")

    @property
    def num_experts(self) -> int:
        return self.config_int(self.convention.expert_keys, "routed expert count")

    @property
    def top_k(self) -> int:
        return self.config_int(self.convention.top_k_keys, "experts per token")

    @property
    def fmt(self) -> str:
        return self.convention.fmt

    # ------------------------------------------------------------------ reading
    def _check(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], role: str) -> None:
        if name not in self.weight_map:
            raise CheckpointError(
                f"missing tensor {name} ({role}): expected {dtype_name(dtype)} {list(shape)} for the "
                f"{self.convention.name} convention in {self.path}; the index/shards do not contain it",
                fix="re-download the shard that holds it or check num experts/intermediate in config.json",
            )
        got_dtype, got_shape = self.header(name)
        scalar_ok = shape == () and math.prod(got_shape) == 1
        if got_dtype != dtype or (got_shape != shape and not scalar_ok):
            raise CheckpointError(
                f"{name} ({role}) in {self.weight_map[name]}: expected {dtype_name(dtype)} {list(shape)}, found "
                f"{dtype_name(got_dtype)} {list(got_shape)} (config.json: hidden {self.hidden}, intermediate "
                f"{self.intermediate}, {self.num_experts} experts)",
                fix=f"check that config.json belongs to these weights and that the convention is {self.convention.name}",
            )

    def _read(self, name: str, index: Optional[tuple] = ()) -> torch.Tensor:
        """Read ``name`` (only ``index`` of it); ``index=None`` reads a one-element tensor as a scalar."""
        if index is None:
            return self._handle(name).get_tensor(name).reshape(())
        s = self._handle(name).get_slice(name)
        return s[index] if index else s[:]

    def shard_bounds(self, tp_size: int, tp_rank: int) -> tuple[int, int]:
        """Intermediate rows ``[start, end)`` of rank ``tp_rank`` of ``tp_size``, as serving engines shard.

        Per-expert conventions (vLLM's FusedMoE loader): ``I % tp == 0``, equal shards, and a
        shard must not cut a scale block (vLLM refuses that for FP8 block scales). gpt-oss
        (vLLM's MXFP4 loader): whole 32-value blocks, ``ceil(blocks / tp)`` per rank, the
        last ranks smaller, so any tp works until a rank would get nothing.
        """
        conv, fmt, full_i = self.convention, self.fmt, self.intermediate
        if not (isinstance(tp_size, int) and tp_size >= 1 and isinstance(tp_rank, int) and 0 <= tp_rank < tp_size):
            raise CheckpointError(
                f"tensor-parallel rank {tp_rank} of {tp_size} is not valid", fix="choose tp >= 1 and 0 <= rank < tp"
            )
        spec = get_format(fmt)
        block = spec.scale_block or 1
        if conv.fused:
            if full_i % block:
                raise CheckpointError(
                    f"{self.path / 'config.json'}: intermediate size {full_i} is not a multiple of the {block}-value "
                    f"{fmt.upper()} block, so the packed expert tensors cannot have the shape the convention needs",
                    fix="check that config.json belongs to these weights",
                )
            per_rank = -(-(full_i // block) // tp_size) * block
            r0, r1 = tp_rank * per_rank, min((tp_rank + 1) * per_rank, full_i)
            if r1 <= r0:
                raise CheckpointError(
                    f"tp={tp_size}: rank {tp_rank} gets no intermediate rows ({full_i} values = {full_i // block} "
                    f"{fmt.upper()} blocks, {per_rank // block} per rank, so ranks from {-(-full_i // per_rank)} on "
                    f"are empty)",
                    fix=f"tp <= {full_i // block}",
                )
            return r0, r1
        if full_i % tp_size:
            raise CheckpointError(
                f"tp={tp_size} does not divide the intermediate size {full_i} (config.json "
                f"{'/'.join(conv.intermediate_keys)}): rank shards would differ in size",
                fix=f"pick tp from {[t for t in range(1, 9) if full_i % t == 0]}",
            )
        il = full_i // tp_size
        if tp_size > 1 and il % block:
            shape = f"{spec.scale_block_rows}x{block}" if spec.scale_block_rows > 1 else f"{block}-value"
            raise CheckpointError(
                f"tp={tp_size} gives intermediate {il} per rank, not a multiple of the {block} values of one {shape} "
                f"{fmt.upper()} scale block, so rank {tp_rank}'s slice [{tp_rank * il}, {(tp_rank + 1) * il}) of the "
                f"down projection's scales would cut a block (vLLM refuses this too)",
                fix=f"tp in {[t for t in range(1, 9) if full_i % t == 0 and (full_i // t) % block == 0]}, or pad the "
                f"intermediate size before sharding",
            )
        return tp_rank * il, (tp_rank + 1) * il

    def read_layer(
        self, layer: int, tp_size: int = 1, tp_rank: int = 0, load: str = "all", progress: bool = False
    ) -> MoELayer:
        """Stack layer ``layer``'s experts for rank ``tp_rank`` of ``tp_size``.

        ``load``: ``all`` reads everything; ``scales`` leaves weights as ``meta`` tensors
        (shapes only; for health checks); ``none`` reads nothing (shapes and checks only).
        Every tensor is checked (present, dtype, shape) before any is read.
        """
        if layer not in self._layers:
            raise CheckpointError(
                f"{self.path}: layer {layer} has no routed experts",
                fix=f"choose one of the MoE layers {self.moe_layers}",
            )
        if load not in ("all", "scales", "none"):
            raise CheckpointError(f"load={load!r} is not a read mode", fix="pass load='all', 'scales' or 'none'")
        conv = self.convention
        r0, r1 = self.shard_bounds(tp_size, tp_rank)
        reader = _FusedReader if conv.fused else _PerExpertReader
        moe = reader(self, layer, tp_size, tp_rank, r0, r1, load, progress).run()
        if conv.activation == "swiglu_oai":
            moe.activation_params = {
                "alpha": self.config_float("swiglu_alpha", 1.702),
                "limit": self.config_float("swiglu_limit", 7.0),
            }
        return moe


class _LayerReader:
    """Shared state of one read: sizes, slices and the output buffers."""

    def __init__(
        self, ckpt: Checkpoint, layer: int, tp_size: int, tp_rank: int, r0: int, r1: int, load: str, progress: bool
    ):
        self.ck, self.layer, self.tp_size, self.tp_rank = ckpt, layer, tp_size, tp_rank
        self.r0, self.r1, self.il = r0, r1, r1 - r0
        self.load, self.progress = load, progress
        self.conv, self.fmt = ckpt.convention, ckpt.fmt
        self.prefix = ckpt._layers[layer]
        self.E, self.H, self.I = ckpt.num_experts, ckpt.hidden, ckpt.intermediate
        self.spec = get_format(self.fmt)
        self.v = self.spec.values_per_byte
        for size, name in ((self.H, "hidden"), (self.I, "intermediate")):
            if self.spec.packed and size % self.spec.scale_block:
                raise CheckpointError(
                    f"{ckpt.path / 'config.json'}: {name} size {size} is not a multiple of the {self.spec.scale_block}-"
                    f"value {self.fmt} scale block, so its packed tensors cannot have the shape the convention needs",
                    fix="check that config.json belongs to these weights",
                )
        need = self.E * 3 * self.I * self.H * self.conv.weight_dtype.itemsize // self.v
        have = ckpt.data_bytes()
        if need > have:
            raise CheckpointError(
                f"{ckpt.path / 'config.json'}: {self.E} experts x hidden {self.H} x intermediate {self.I} need "
                f"{need} bytes of {self.fmt} weights per layer, but the shards hold {have} bytes in all",
                fix="check that config.json belongs to these weights (expert count, hidden and intermediate sizes)",
            )

    def buffer(self, shape: tuple[int, ...], dtype: torch.dtype, is_scale: bool) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="cpu" if self.wants(is_scale) else "meta")

    def wants(self, is_scale: bool) -> bool:
        return self.load == "all" or (self.load == "scales" and is_scale)

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
        )


class _PerExpertReader(_LayerReader):
    """DeepSeek/Kimi FP8, Qwen3/Mixtral BF16, ModelOpt NVFP4: one tensor per expert and projection."""

    def scale_spec(self, proj: int) -> tuple[tuple[int, int], tuple[slice, slice]]:
        """Full scale shape of projection ``proj`` and this rank's slice of it.

        One scale covers ``scale_block_rows x scale_block`` values of its weight ``(rows,
        cols)`` (``specs.FORMATS``), so the scales are ``(ceil(rows/br), ceil(cols/bc))``;
        gate and up are sliced along their rows, down along its columns.
        """
        br, bc = self.spec.scale_block_rows, self.spec.scale_block
        rows, cols = (self.I, self.H) if proj < 2 else (self.H, self.I)
        full = (-(-rows // br), -(-cols // bc))
        along = br if proj < 2 else bc
        lo, hi = self.r0 // along, -(-self.r1 // along)
        sl = (slice(lo, hi), slice(None)) if proj < 2 else (slice(None), slice(lo, hi))
        return full, sl

    def run(self) -> MoELayer:
        c, E, H, I, il, v = self.conv, self.E, self.H, self.I, self.il, self.v
        plan = []  # (name, dtype, full shape, slice, destination, role)
        w13 = self.buffer((E, 2 * il, H // v), c.weight_dtype, False)
        w2 = self.buffer((E, H, il // v), c.weight_dtype, False)
        s13 = s2 = None
        extras: dict[str, torch.Tensor] = {}
        if c.scale_suffix:
            (g_rows, g_cols), gsl = self.scale_spec(0)
            nr = len(range(*gsl[0].indices(g_rows)))
            s13 = self.buffer((E, 2 * nr, g_cols), c.scale_dtype, True)
            (d_rows, d_cols), dsl = self.scale_spec(2)
            s2 = self.buffer((E, d_rows, len(range(*dsl[1].indices(d_cols)))), c.scale_dtype, True)
        for stack, shape in (("w13", (E, 2)), ("w2", (E,))):
            for extra in c.scalar_extras:
                extras[f"{stack}_{extra}"] = self.buffer(shape, torch.float32, True)
        for e in range(E):
            for proj in range(3):
                if proj < 2:
                    shape, sl, dest = (
                        (I, H // v),
                        (slice(self.r0, self.r1), slice(None)),
                        (w13, e, slice(proj * il, (proj + 1) * il)),
                    )
                else:
                    shape, sl, dest = (
                        (H, I // v),
                        (slice(None), slice(self.r0 // v, self.r1 // v)),
                        (w2, e, slice(None)),
                    )
                plan.append(
                    (c.expert_key(self.prefix, self.layer, e, proj), c.weight_dtype, shape, sl, dest, False, "weight")
                )
                if s13 is not None:
                    full, ssl = self.scale_spec(proj)
                    nr = s13.shape[1] // 2
                    sdest = (s13, e, slice(proj * nr, (proj + 1) * nr)) if proj < 2 else (s2, e, slice(None))
                    plan.append(
                        (
                            c.expert_key(self.prefix, self.layer, e, proj, c.scale_suffix),
                            c.scale_dtype,
                            full,
                            ssl,
                            sdest,
                            True,
                            "block scale",
                        )
                    )
                for extra in c.scalar_extras:
                    buf = extras[f"{'w13' if proj < 2 else 'w2'}_{extra}"]
                    plan.append(
                        (
                            c.expert_key(self.prefix, self.layer, e, proj, extra),
                            torch.float32,
                            (),
                            None,
                            (buf, e, proj) if proj < 2 else (buf, e),
                            True,
                            extra,
                        )
                    )
        for name, dtype, shape, _, _, _, role in plan:
            self.ck._check(name, dtype, shape, role)
        items = [p for p in plan if self.wants(p[5])]
        if self.progress and items:
            from tqdm.auto import tqdm

            items = tqdm(items, desc=f"layer {self.layer}", unit="tensor", leave=False)
        for name, _, _, sl, dest, _, _ in items:
            dest[0][dest[1:]] = self.ck._read(name, sl)
        return self.finish(w13, w2, s13, s2, extras)


class _FusedReader(_LayerReader):
    """gpt-oss: all experts in one tensor per projection, gate/up rows interleaved."""

    def run(self) -> MoELayer:
        """Blocks ``(E, rows, cols/b, b/v)`` and scales ``(E, rows, cols/b)`` per projection (``b`` the
        format's scale block, ``v`` values per byte: MXFP4 32 and 2); this rank's rows of gate_up
        (``2 * r0 : 2 * r1``, interleaved) and columns of down (whole blocks)."""
        c, E, H, I, il, b = self.conv, self.E, self.H, self.I, self.il, self.spec.scale_block
        bb = b // self.v  # bytes per block
        wd, sd = c.weight_dtype, c.scale_dtype
        key = lambda n: c.fused_key(self.prefix, self.layer, n)  # noqa: E731
        up_rows, down_cols = (
            (slice(None), slice(2 * self.r0, 2 * self.r1)),
            (slice(None), slice(None), slice(self.r0 // b, self.r1 // b)),
        )
        specs = [
            ("gate_up_proj_blocks", wd, (E, 2 * I, H // b, bb), up_rows, False),
            ("gate_up_proj_scales", sd, (E, 2 * I, H // b), up_rows, True),
            ("down_proj_blocks", wd, (E, H, I // b, bb), down_cols, False),
            ("down_proj_scales", sd, (E, H, I // b), down_cols, True),
        ]
        has_bias = key("gate_up_proj_bias") in self.ck.weight_map
        if has_bias:
            specs += [
                ("gate_up_proj_bias", torch.bfloat16, (E, 2 * I), (slice(None), slice(2 * self.r0, 2 * self.r1)), True),
                ("down_proj_bias", torch.bfloat16, (E, H), (), True),
            ]
        for name, dtype, shape, _, _ in specs:
            self.ck._check(key(name), dtype, shape, f"{self.fmt.upper()} {name.replace('_', ' ')}")
        out_shapes = {
            "gate_up_proj_blocks": (E, 2 * il, H // self.v),
            "gate_up_proj_scales": (E, 2 * il, H // b),
            "down_proj_blocks": (E, H, il // self.v),
            "down_proj_scales": (E, H, il // b),
            "gate_up_proj_bias": (E, 2 * il),
            "down_proj_bias": (E, H),
        }
        got = {}
        for name, dtype, _, sl, is_scale in specs:
            if not self.wants(is_scale):
                got[name] = torch.empty(out_shapes[name], dtype=dtype, device="meta")
                continue
            t = self.ck._read(key(name), sl).reshape(out_shapes[name])
            if name.startswith("gate_up"):  # rows g0, u0, g1, u1, ... -> [gate; up]
                t = torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)
            got[name] = t.contiguous()
        if has_bias and self.tp_rank > 0 and self.wants(True):  # vLLM: only rank 0 adds the down bias
            got["down_proj_bias"] = torch.zeros_like(got["down_proj_bias"])
        extras = {"w13_bias": got["gate_up_proj_bias"], "w2_bias": got["down_proj_bias"]} if has_bias else {}
        return self.finish(
            got["gate_up_proj_blocks"],
            got["down_proj_blocks"],
            got["gate_up_proj_scales"],
            got["down_proj_scales"],
            extras,
        )


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Open a checkpoint directory (detects its naming convention and format)."""
    return Checkpoint(path)
