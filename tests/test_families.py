"""Every MoE checkpoint family: read, inspect, convert (both backends, TP 1 and 2, every rank), restore byte-exact.

The oracle is ``scripts/make_family_samples.py``, which names and lays out every tensor
itself (it does not use the reader's convention table): the reader's stacked layer must
hold the generator's gate rows first and up rows second, and ``restore`` of each rank's
conversion must write back exactly the generator's tensors for that rank (names and
bytes). A backend with no kernel layout for a format (INT4 pack-quantized on CUTLASS, FP8 per
channel on both) is refused by ``convert`` naming the missing piece, and the family still reads,
inspects and writes back byte-exact; INT4 pack-quantized converts for TRT-LLM (MxInt4).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import all_tensors, plus_unchanged, same_bytes, same_tensor
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from fimoe_lab.checkpoints import (
    CheckpointError,
    convert_checkpoint,
    format_report,
    inspect_checkpoint,
    not_byte_exact,
    open_checkpoint,
    read_kernel_metadata,
    restore_checkpoint,
)
from fimoe_lab.checkpoints import conventions as conv_table
from scripts import make_family_samples as gen

FAMILIES = list(gen.FAMILIES)


def _missing(family: str) -> dict[str, str]:
    return conv_table.get(gen.FAMILIES[family].convention).missing_layout


READ_ONLY = [f for f in FAMILIES if _missing(f)]
CONVERTIBLE = [(f, b) for f in FAMILIES for b in ("trtllm", "cutlass") if b not in _missing(f)]
REFUSED = [(f, b) for f in FAMILIES for b in ("trtllm", "cutlass") if b in _missing(f)]
RANKS = ((1, 0), (2, 0), (2, 1))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("families")
    for family in FAMILIES:
        gen.make(family, out)
    return out


HALVES = (torch.bfloat16, torch.float16)


def detected_name(fam: gen.Family) -> str:
    """The convention the reader detects: the family's, with the dtypes its writer chose (``base:role=DTYPE``)."""
    chosen = ",".join(f"{role}={conv_table.dtype_name(d)}" for role, d in fam.file_dtypes.items())
    return fam.convention + (f":{chosen}" if chosen else "")


def expected_stack(family: str, base: str, tp: int, rank: int) -> dict[str, torch.Tensor | None]:
    """The stacked layer (reader layout) built from the generator's own per-projection tensors."""
    fam = gen.FAMILIES[family]
    t = gen._slice(family, base, gen.truth(family, base), tp, rank)
    gated = "gate" in t
    out: dict[str, torch.Tensor | None] = {
        "w13": torch.cat([t["gate"], t["up"]], 1) if gated else t["up"],
        "w2": t["down"],
        "w13_scale": None,
        "w2_scale": None,
    }
    if "up_s" in t:
        join = torch.stack if fam.kind == "fp8-tensor" else torch.cat
        s13 = join([t["gate_s"], t["up_s"]], 1) if gated else t["up_s"]
        widen = fam.kind != "int4"  # BF16 / F16 scales of FP8 weights are stacked as float32
        out["w13_scale"], out["w2_scale"] = (
            s13.float() if s13.dtype in HALVES and widen else s13,
            (t["down_s"].float() if t["down_s"].dtype in HALVES and widen else t["down_s"]),
        )
    for key in [k for k in t if k.startswith("gate.")]:  # per-projection scalars, stacked as float32
        suffix = key.split(".", 1)[1]
        out[f"w13_{suffix}"] = torch.stack([t[f"gate.{suffix}"], t[f"up.{suffix}"]], 1).float()
        out[f"w2_{suffix}"] = t[f"down.{suffix}"].float()
    if "b13" in t:
        out["w13_bias"], out["w2_bias"] = t["b13"], t["b2"]
    return {k: None if v is None else v.contiguous() for k, v in out.items()}


# ---------------------------------------------------------------------------- reading
@pytest.mark.parametrize("family", FAMILIES)
def test_reader_stacks_the_generators_tensors(root, family):
    fam = gen.FAMILIES[family]
    with open_checkpoint(root / family) as ck:
        assert ck.convention.name == detected_name(fam)
        assert [ck.layer_names[i] for i in ck.moe_layers] == list(fam.layers)
        assert [ck.layer_names[i] for i in ck.mtp_layers] == ([gen.MTP[family]] if family in gen.MTP else [])
        for idx, base in zip(ck.moe_layers, fam.layers):
            for tp, rank in RANKS:
                got = ck.read_layer(idx, tp, rank)
                want = expected_stack(family, base, tp, rank)
                assert (
                    got.intermediate
                    == gen.rank_bounds(family, base, tp, rank)[1] - gen.rank_bounds(family, base, tp, rank)[0]
                )
                for name in ("w13", "w2", "w13_scale", "w2_scale"):
                    assert same_bytes(getattr(got, name), want[name]), (family, base, tp, rank, name)
                extras = {k: v for k, v in want.items() if k not in ("w13", "w2", "w13_scale", "w2_scale")}
                assert set(got.extras) == set(extras)
                for name, t in extras.items():
                    assert same_tensor(got.extras[name], t.contiguous()), (family, name)


@pytest.mark.parametrize("family", FAMILIES)
def test_inspect_reports_every_layer_with_its_own_sizes(root, family):
    fam = gen.FAMILIES[family]
    reports = inspect_checkpoint(root / family, tps=(1, 2))
    assert [r.name for r in reports] == list(fam.layers)
    assert [r.intermediate for r in reports] == [gen.intermediate(fam, b) for b in fam.layers]
    assert [r.mtp for r in reports] == [b == gen.MTP.get(family) for b in fam.layers]
    text = format_report(reports)
    assert (", MTP)" in text) == (family in gen.MTP)
    for r in reports:
        assert r.convention == detected_name(fam) and r.num_experts == gen.E and r.hidden == fam.hidden
        missing = conv_table.get(fam.convention).missing_layout
        for backend in ("trtllm", "cutlass"):
            line = r.tp[1][backend]
            assert (missing[backend] in line) if backend in missing else ("cannot" not in line), line


# ---------------------------------------------------------------------------- convert and restore
def _leaf_changes(a: object, b: object, path: tuple = ()) -> dict[tuple, tuple[object, object]]:
    """``{path: (a's value, b's value)}`` of every JSON leaf (or key present on one side only) that differs."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: dict[tuple, tuple[object, object]] = {}
        for k in {*a, *b}:
            out.update(_leaf_changes(a.get(k, "<absent>"), b.get(k, "<absent>"), (*path, k)))
        return out
    return {} if a == b else {path: (a, b)}


def check_restored_config(family: str, back: Path, tp: int, rank: int) -> None:
    """Restored config.json: the source's, with only the intermediate size changed where the source holds it
    (nested keys stay nested; a per-layer list keeps its length, each model layer's entry its rank size)."""
    fam = gen.FAMILIES[family]
    got = json.loads((back / "config.json").read_text())
    changes = _leaf_changes(fam.config, got)
    if tp == 1:
        assert changes == {}, changes
        return
    assert len(changes) == 1, changes
    (path, (before, after)) = next(iter(changes.items()))
    size = {b: (lambda r: r[1] - r[0])(gen.rank_bounds(family, b, tp, rank)) for b in fam.layers}
    if isinstance(before, list):
        assert isinstance(after, list) and len(after) == len(before), (path, before, after)
        model = {int(b.rsplit(".", 1)[1]): b for b in fam.layers if b != gen.MTP.get(family)}
        assert after == [size[model[i]] if i in model else v for i, v in enumerate(before)], (path, after)
    else:
        assert before == gen.intermediate(fam, fam.layers[0]) and after == size[fam.layers[0]], (path, before, after)


def test_int4_converts_for_trtllm_only():
    assert ("kimi-k2-thinking-int4", "trtllm") in CONVERTIBLE and ("kimi-k2-thinking-int4", "cutlass") in REFUSED


@pytest.mark.parametrize("family,backend", CONVERTIBLE)
def test_convert_and_restore_every_rank_byte_exact(root, tmp_path, family, backend):
    n_layers = len(gen.FAMILIES[family].layers)
    for tp, rank in RANKS:
        kernel = tmp_path / f"{backend}-{tp}-{rank}.safetensors"
        convert_checkpoint(root / family, kernel, backend, tp, rank)
        meta = read_kernel_metadata(kernel)
        assert list(meta["layer_names"].values()) == list(gen.FAMILIES[family].layers)
        w13 = [n for n in load_file(kernel) if n.endswith(".w13_weight")]
        assert len(w13) == n_layers, w13  # MTP layers are layers of their own, never merged
        back = tmp_path / f"{backend}-{tp}-{rank}"
        restore_checkpoint(kernel, back)
        got = all_tensors(back)
        # the rank's expert slices, and on rank 0 every other tensor of the source, unchanged
        want = plus_unchanged(root / family, gen.file_tensors(family), gen.file_tensors(family, tp, rank), rank)
        assert sorted(got) == sorted(want), (backend, tp, rank)  # MTP layers under their own path
        check_restored_config(family, back, tp, rank)
        check_requantized(family, kernel)
        for name, t in want.items():
            assert same_tensor(got[name], t.contiguous()), (family, backend, tp, rank, name)


def check_requantized(family: str, kernel: Path) -> None:
    """FP8 per-tensor families: the kernel takes one W13 scale per expert, so the default profile requantizes the
    experts whose gate and up scales differ (fimoe_lab.value_rules, checked against the engines' arithmetic in
    tests/test_value_rules.py) and the file keeps every such layer's checkpoint W13 and scales beside it; restore
    reads those, so nothing is named as not byte-exact."""
    assert not_byte_exact(kernel) == []
    if gen.FAMILIES[family].kind != "fp8-tensor":
        return
    names = load_file(kernel)
    w13 = [n for n in names if n.endswith(".w13_weight")]
    assert w13 and all(f"{n}_checkpoint" in names and f"{n}_scale_checkpoint" in names for n in w13), w13


@pytest.mark.parametrize("family,backend", REFUSED)
def test_backend_without_layout_is_refused_naming_the_missing_piece(root, tmp_path, family, backend):
    conv = conv_table.get(gen.FAMILIES[family].convention)
    with pytest.raises(CheckpointError) as info:
        convert_checkpoint(root / family, tmp_path / f"{backend}.safetensors", backend)
    msg = str(info.value)
    assert f"{conv.fmt} has no {backend} layout: {conv_table.MISSING_LAYOUT[conv.fmt][backend]}" in msg, msg
    assert not (tmp_path / f"{backend}.safetensors").exists()


@pytest.mark.parametrize("family", READ_ONLY)
def test_format_without_a_layout_writes_back_byte_exact(root, family):
    with open_checkpoint(root / family) as ck:
        conv = conv_table.get(ck.convention.name)  # by name, as restore finds it (the file's dtypes in it)
        for tp, rank in RANKS:
            back: dict[str, torch.Tensor] = {}
            for idx in ck.moe_layers:
                back.update(conv.to_tensors(ck.prefix, idx, ck.read_layer(idx, tp, rank), ck.layer_names[idx]))
            want = gen.file_tensors(family, tp, rank)
            assert sorted(back) == sorted(want)
            for name, t in want.items():
                assert same_tensor(back[name], t.contiguous()), (family, tp, rank, name)


# ---------------------------------------------------------------------------- refusals and config keys
def _rewrite(src: Path, dst: Path, rename) -> Path:
    dst.mkdir()
    tensors = {rename(k): v for k, v in all_tensors(src).items()}
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def test_unknown_projection_names_list_what_was_seen_and_the_closest_convention(root, tmp_path):
    path = _rewrite(root / "olmoe", tmp_path / "c", lambda k: k.replace(".gate_proj.", ".gate_projection."))
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(path)
    msg = str(info.value)
    assert "follow no known naming convention" in msg and "experts.0.gate_projection.weight (BF16)" in msg
    assert "closest known convention: qwen3-moe-bf16" in msg


def test_unknown_fused_layout_lists_names_seen_and_the_closest_convention(root, tmp_path):
    path = _rewrite(root / "granite-moe", tmp_path / "c", lambda k: k.replace("input_linear", "in_linear"))
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(path)
    msg = str(info.value)
    assert "follow no known naming convention" in msg and "block_sparse_moe.in_linear.weight (BF16)" in msg
    assert "closest known convention: granite-bf16" in msg


def test_per_layer_list_too_short_names_the_key(root, tmp_path):
    path = _rewrite(root / "hunyuan-a13b", tmp_path / "c", lambda k: k)
    cfg = gen.FAMILIES["hunyuan-a13b"].config
    (path / "config.json").write_text(json.dumps({**cfg, "moe_intermediate_size": [48]}))
    too_short = r"moe_intermediate_size is a per-layer list of 1 entries, layer 1"
    with pytest.raises(CheckpointError, match=too_short), open_checkpoint(path) as ck:
        ck.read_layer(1)


_ALIASES = [(what, k) for what, keys in conv_table.CONFIG_KEYS.items() for k in keys]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sampled_from(_ALIASES), unique=True, max_size=6),
    st.integers(1, 4096),
    st.booleans(),
    st.sampled_from(list(conv_table.CONFIG_KEYS)),
)
def test_config_value_takes_the_first_alias_present(present, value, nested, what):
    """Property: whatever subset of aliases a config has (top level or under text_config), the first of
    the size's aliases present wins, a per-layer list is returned as is, and absent means (None, None)."""
    cfg: dict = {}
    for i, (_, key) in enumerate(present):
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = [value + i, value] if i % 2 else value + i
    config = {"text_config": cfg} if nested else cfg
    keys = [k for w, k in present if w == what]
    first = next((k for k in conv_table.CONFIG_KEYS[what] if k in keys), None)
    key, got = conv_table.config_value(config, what)
    assert key == first
    if first is not None:
        i = [k for _, k in present].index(first)
        assert got == ([value + i, value] if i % 2 else value + i)
    else:
        assert got is None
