"""A checkpoint's files must agree with each other and with config.json before anything is planned or
allocated from them.

- :func:`shard_headers`: every shard's safetensors header (bounded: :data:`MAX_HEADERS_BYTES` in all),
  each tensor with its dtype, shape and the bytes its header declares (``data_offsets``), never
  the file's length (a sparse file is long and holds nothing).
- :func:`weight_map_of_shards` (no index): a tensor name in two shards is refused (the last one
  silently won before). :func:`check_index`: every tensor the index names must be in its shard's
  header, and no shard may hold a tensor the index puts in another shard.
- :func:`check_layers`: no MoE layer numbered past what config.json declares
  (``num_hidden_layers`` plus its next-token-prediction layers).
- :func:`check_layer_read`: before a layer's read plan or buffers are built, its expert count
  from config.json must be the experts present (per-expert conventions: exactly ``0 .. E-1``, none
  beyond), the weights config.json implies must fit in the bytes the headers declare for that
  layer (:data:`SIZE_SLACK`), and the memory the read allocates must stay under :func:`memory_limit`
  (``$FIMOE_LAB_MAX_MEMORY``; default the smaller of 64 GiB and 3/4 of the host's memory).
"""

from __future__ import annotations

import itertools
import os
import re
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fimoe_lab import env
from fimoe_lab.checkpoints import safe_io
from fimoe_lab.errors import CheckpointError

if TYPE_CHECKING:
    from fimoe_lab.checkpoints.reader import Checkpoint

__all__ = [
    "MAX_HEADERS_BYTES",
    "shard_headers",
    "weight_map_of_shards",
    "check_index",
    "check_layers",
    "check_layer_read",
    "layer_tensors",
    "memory_limit",
]

MAX_HEADERS_BYTES = 4 * safe_io.MAX_JSON_BYTES
"""The headers of all shards together above this are refused (a 700 GB checkpoint's are < 20 MB)."""
DEFAULT_MEMORY_LIMIT = 64 << 30
"""The largest default :func:`memory_limit` (the biggest real MoE layer, BF16, is ~34 GB)."""

Header = dict[str, int]
"""A shard's tensors: name -> bytes its header declares."""


def _tensor_bytes(path: Path, name: str, entry: Any) -> int:
    try:
        lo, hi = entry["data_offsets"]
        if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi):
            raise TypeError
    except (TypeError, KeyError, ValueError):
        raise CheckpointError(
            f"{path}: the header entry of {name!r} has no valid data_offsets",
            fix="the shard is corrupt: copy or download it again",
        ) from None
    return hi - lo


def shard_headers(root: Path, files: list[str]) -> dict[str, Header]:
    """The header of each existing shard in ``files`` (module docstring); a missing one is skipped (it is
    an error only when a tensor in it is read)."""
    got, total = {}, 0
    for file in sorted(set(files)):
        path = root / file
        if not os.path.lexists(path):
            continue
        size = safe_io.regular_file(path, "checkpoint shard").st_size
        parsed = safe_io.safetensors_header(path)
        if parsed is None:
            raise CheckpointError(
                f"{path} is not a readable safetensors file (its header is truncated, too large or not JSON)",
                fix="it is truncated or corrupt: copy or download it again",
            )
        header, start = parsed
        total += start
        if total > MAX_HEADERS_BYTES:
            raise CheckpointError(
                f"{root}: the shards' headers exceed {MAX_HEADERS_BYTES >> 20} MB together",
                fix="check that it is a model checkpoint directory",
            )
        tensors = {n: _tensor_bytes(path, n, e) for n, e in header.items() if n != "__metadata__"}
        if start + sum(tensors.values()) > size:
            raise CheckpointError(
                f"{path}: its header declares {sum(tensors.values())} bytes of tensors, the file holds {size - start}",
                fix="it is truncated: copy or download it again",
            )
        got[file] = tensors
    return got


def weight_map_of_shards(root: Path, files: list[Path]) -> tuple[dict[str, str], dict[str, Header]]:
    """Tensor name -> shard, from the headers of ``files`` (no index; a name in two shards is refused), and
    the headers."""
    headers = shard_headers(root, [f.name for f in files])
    mapping: dict[str, str] = {}
    for file in sorted(headers):
        for name in headers[file]:
            if name in mapping:
                raise CheckpointError(
                    f"{root}: tensor {name!r} is in both {mapping[name]} and {file} (and there is no index to "
                    f"say which one is meant)",
                    fix="remove the stray shard, or restore model.safetensors.index.json from the model's files",
                )
            mapping[name] = file
    return mapping, headers


def check_index(root: Path, weight_map: dict[str, str]) -> dict[str, Header]:
    """Refuse an index that disagrees with the shard headers (module docstring); returns the headers."""
    headers = shard_headers(root, list(weight_map.values()))
    for name, file in weight_map.items():
        if file in headers and name not in headers[file]:
            raise CheckpointError(
                f"{root}: the index puts tensor {name!r} in {file}, whose header has no such tensor",
                fix=f"re-download {file}, or restore model.safetensors.index.json from the model's original files",
            )
    for file, tensors in headers.items():
        for name in tensors:
            other = weight_map.get(name)
            if other is not None and other != file:
                raise CheckpointError(
                    f"{root}: tensor {name!r} is in both {file} and {other} (the index names {other})",
                    fix=f"remove the stray copy: re-download {file} and {other} from the model's original files",
                )
    return headers


def check_layers(ck: Checkpoint) -> None:
    """No MoE layer of the model's prefix numbered past ``num_hidden_layers`` plus its next-token-prediction
    layers (``num_nextn_predict_layers``, at least one allowed: DeepSeek-V3's ``model.layers.61``)."""
    n = ck.config.get("num_hidden_layers")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return
    extra = ck.config.get("num_nextn_predict_layers")
    extra = extra if isinstance(extra, int) and not isinstance(extra, bool) and extra >= 1 else 1
    beyond = [i for i, name in ck.layer_names.items() if name.startswith(ck.prefix) and i >= n + extra]
    if beyond:
        raise CheckpointError(
            f"{ck.path}: MoE layers {beyond[:5]}{' ...' if len(beyond) > 5 else ''} are past the "
            f"{n} layers (+{extra} next-token-prediction) config.json declares",
            fix="check that config.json belongs to these weights (num_hidden_layers)",
        )


SIZE_SLACK, SIZE_SLACK_BYTES = 2, 64 << 20
"""A layer's weights by config.json must fit in ``2 x`` the bytes its headers declare plus 64 MiB: sizes off
by orders of magnitude (a hostile config) are refused here, a tensor of a slightly wrong shape is named by
the per-tensor check that follows."""


def memory_limit() -> int:
    """Bytes one read may allocate: ``$FIMOE_LAB_MAX_MEMORY`` (bytes, K/M/G/T allowed), else the smaller of
    :data:`DEFAULT_MEMORY_LIMIT` and 3/4 of the host's physical memory."""
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        physical = DEFAULT_MEMORY_LIMIT
    return int(env.value("FIMOE_LAB_MAX_MEMORY", min(DEFAULT_MEMORY_LIMIT, physical * 3 // 4)))


_LAYERS: weakref.WeakKeyDictionary[Any, dict[str, tuple[set[int], int]]] = weakref.WeakKeyDictionary()
"""Per checkpoint, :func:`layer_tensors` (one pass over its tensor names, not one per read)."""


def layer_tensors(ck: Checkpoint) -> dict[str, tuple[set[int], int]]:
    """``{layer path: (expert indices named in its tensors, bytes its tensors' headers declare)}`` for every
    layer with tensors under the convention's expert module, from one pass over the tensor names."""
    got = _LAYERS.get(ck)
    if got is None:
        pattern = re.compile(r"^(.*)\." + re.escape(ck.convention.module) + r"\.(?:(\d+)\.)?")
        got = {}
        for name, file in ck.weight_map.items():
            m = pattern.match(name)
            if m is None:
                continue
            experts, nbytes = got.get(m[1], (set(), 0))
            if m[2] is not None:
                experts.add(int(m[2]))
            got[m[1]] = (experts, nbytes + ck.shard_headers.get(file, {}).get(name, 0))
        _LAYERS[ck] = got
    return got


def check_layer_read(ck: Checkpoint, layer: int, experts: int, need: int, allocate: int) -> None:
    """Before layer ``layer``'s plan is built: the ``experts`` config.json gives must be the experts present
    (per-expert conventions), its weights' ``need`` bytes must fit in the bytes the headers declare for
    the layer, and ``allocate`` (what the read allocates) must stay under :func:`memory_limit`."""
    conv, base = ck.convention, ck.layer_names[layer]
    present, have = layer_tensors(ck).get(base, (set(), 0))
    if conv.fused_layout is None:
        beyond = sorted(e for e in present if e >= experts)
        if beyond:
            raise CheckpointError(
                f"{ck.path}: layer {layer} has tensors of experts {beyond[:5]}{' ...' if len(beyond) > 5 else ''}, "
                f"past the {experts} experts config.json declares",
                fix="check that config.json belongs to these weights (its expert count)",
            )
        if len(present) < experts:
            missing = list(itertools.islice((e for e in range(experts) if e not in present), 5))
            first = conv.expert_key("", 0, missing[0], 0 if conv.gated else 1, base=base)
            raise CheckpointError(
                f"{ck.path}: missing tensor {first}: config.json declares {experts} experts, layer {layer} has "
                f"tensors for {len(present)} (experts {missing}{' ...' if len(missing) == 5 else ''} have none)",
                fix="check that config.json belongs to these weights, or re-download the missing shards",
            )
    if need > SIZE_SLACK * have + SIZE_SLACK_BYTES:
        raise CheckpointError(
            f"{ck.path}: layer {layer}'s weights need {need} bytes by config.json, its tensors' headers declare {have}",
            fix="check that config.json belongs to these weights (expert count, hidden and intermediate sizes)",
        )
    limit = memory_limit()
    if allocate > limit:
        raise CheckpointError(
            f"reading layer {layer} needs about {allocate / (1 << 30):.1f} GiB of memory, over the limit of "
            f"{limit / (1 << 30):.1f} GiB",
            fix="set FIMOE_LAB_MAX_MEMORY (e.g. FIMOE_LAB_MAX_MEMORY=200G) if this host has the memory",
        )
