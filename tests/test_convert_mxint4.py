"""MxInt4 as a convert format: an int4 pack-quantized checkpoint (Kimi-K2-Thinking's compressed-tensors
``weight_packed`` int32, ``q + 8`` per 4-bit value, bf16 scale per 32) converted for TRT-LLM.

Oracle: vLLM 0.34.0's own ``prepare_static_weights_for_trtllm_mxint4_moe``, run in ``.venv-vllm``
(``tests/engine_oracles/vllm_034_mxint4.py``) on the checkpoint's int32 words, stacked ``[gate; up]`` here
from the generator's own tensors by name (``scripts/make_family_samples.py``; not the reader), so that
vLLM itself turns ``uint4b8`` into signed int4. ``convert --backend trtllm`` must write the same bytes, at
TP 1 and 2 (every rank), on the generator's sample (random bytes with coordinates in byte 0 of every row)
and on a structured copy (every int32 word and bf16 scale encodes its coordinates); ``restore`` must give
the checkpoint bytes back; CUTLASS stays refused, naming the missing piece.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import all_tensors, rewrite_metadata, same_tensor
from safetensors.torch import load_file, save_file

from fimoe_lab.checkpoints import (
    CheckpointError,
    LayoutChoice,
    conventions,
    convert_checkpoint,
    inspect_checkpoint,
    read_kernel_metadata,
    restore_checkpoint,
)
from fimoe_lab.cli import main
from scripts import make_family_samples as gen

ROOT = Path(__file__).resolve().parents[1]
VLLM = ROOT / ".venv-vllm" / "bin" / "python"
RUNNER = ROOT / "tests" / "engine_oracles" / "vllm_034_mxint4.py"
FAMILY = "kimi-k2-thinking-int4"
FAM = gen.FAMILIES[FAMILY]
RANKS = ((1, 0), (2, 0), (2, 1))
KERNEL = {"w13": "w13_weight", "w2": "w2_weight", "s13": "w13_weight_scale", "s2": "w2_weight_scale"}


def _structured(src: Path, dst: Path) -> Path:
    """A copy of the sample whose every int32 weight word is ``((layer * 8 + e * 3 + p) << 20) + row * cols + col
    + 1`` and every bf16 scale's bits ``row * cols + col + 1`` (p 0 gate, 1 up, 2 down): a moved word or scale
    shows where it came from."""
    tensors = all_tensors(src)
    for name, t in tensors.items():
        parts = name.split(".")
        if ".experts." not in name or parts[-1] not in ("weight_packed", "weight_scale"):
            continue
        layer, e, p = int(parts[2]), int(parts[5]), FAM.names.index(parts[6])
        rows, cols = t.shape
        code = torch.arange(rows * cols, dtype=torch.int32).reshape(rows, cols) + 1
        if parts[-1] == "weight_packed":
            tensors[name] = code + ((layer * 8 + e * 3 + p) << 20)
        else:
            tensors[name] = code.to(torch.int16).view(torch.bfloat16)
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


@pytest.fixture(scope="module")
def samples(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("mxint4")
    gen.make(FAMILY, out)
    return {"random": out / FAMILY, "structured": _structured(out / FAMILY, out / "structured")}


def _cut(t: torch.Tensor, suffix: str, down: bool, r0: int, r1: int) -> torch.Tensor:
    """A rank's part of one projection's tensor: rows ``[r0, r1)`` (gate, up) or the columns holding them (down:
    8 values per int32 word, 32 per scale)."""
    per = 8 if suffix == "weight_packed" else 32
    return t[:, r0 // per : r1 // per] if down else t[r0:r1]


def vllm_inputs(path: Path, tp: int, rank: int) -> dict[str, dict[str, torch.Tensor]]:
    """Per layer path: what vLLM's loader hands the preparation function for rank ``rank`` of ``tp``, stacked by
    name from the checkpoint's own tensors: ``w13 [E, 2I, H/8]`` int32 ``[gate; up]``, ``w2``, bf16 scales."""
    files = all_tensors(path)
    gate, up, down = FAM.names
    out = {}
    for base in FAM.layers:
        m = f"{base}.{FAM.module}"
        r0, r1 = gen.rank_bounds(FAMILY, base, tp, rank)
        t = {}
        for key, suffix in (("w", "weight_packed"), ("s", "weight_scale")):
            t[f"{key}13"] = torch.stack(
                [
                    torch.cat([_cut(files[f"{m}.{e}.{p}.{suffix}"], suffix, False, r0, r1) for p in (gate, up)])
                    for e in range(gen.E)
                ]
            )
            t[f"{key}2"] = torch.stack(
                [_cut(files[f"{m}.{e}.{down}.{suffix}"], suffix, True, r0, r1) for e in range(gen.E)]
            )
        out[base] = {k: v.contiguous() for k, v in t.items()}
    return out


CASES = [(kind, tp, rank) for kind in ("random", "structured") for tp, rank in RANKS]


@pytest.fixture(scope="module")
def vllm(samples: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not VLLM.exists():
        pytest.skip("no vLLM 0.34 environment (.venv-vllm, made by .ci/run)")
    d = tmp_path_factory.mktemp("vllm-mxint4")
    inputs, names = {}, []
    for kind, tp, rank in CASES:
        for base, t in vllm_inputs(samples[kind], tp, rank).items():
            name = f"{kind}-{tp}-{rank}-{base}"
            names.append(name)
            inputs.update({f"{name}.{k}": v for k, v in t.items()})
    (d / "cases.json").write_text(json.dumps(names))
    save_file(inputs, str(d / "inputs.safetensors"))
    run = subprocess.run([str(VLLM), str(RUNNER), str(d)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return {"out": load_file(str(d / "outputs.safetensors")), "meta": json.loads((d / "outputs.json").read_text())}


@pytest.mark.parametrize("kind,tp,rank", CASES)
def test_convert_trtllm_writes_vllms_bytes_and_restores_the_checkpoint(samples, vllm, tmp_path, kind, tp, rank):
    kernel = convert_checkpoint(samples[kind], tmp_path / "k.safetensors", "trtllm", tp, rank)
    meta, got = read_kernel_metadata(kernel), load_file(kernel)
    for idx, base in meta["layer_names"].items():
        rec = meta["layers"][idx]
        assert rec["plan"]["recipe"] == "mxint4/trtllm" and rec["checkpoint_format"] == "int4-group"
        name = f"{kind}-{tp}-{rank}-{base}"
        assert "error" not in vllm["meta"][name], vllm["meta"][name]
        for k, kname in KERNEL.items():
            mine = got[f"{meta['prefix']}{idx}.mlp.experts.{kname}"].contiguous().view(torch.uint8).reshape(-1)
            want = vllm["out"][f"{name}.{k}"]
            assert mine.numel() == want.numel(), (name, k)
            bad = (mine != want).nonzero()
            assert bad.numel() == 0, f"{name} {k}: {bad.numel()} of {want.numel()} bytes differ, first at {bad[0]}"
    restored = all_tensors(restore_checkpoint(kernel, tmp_path / "back"))
    want = restored_tensors(samples[kind], tp, rank)
    assert sorted(restored) == sorted(want)
    for name, t in want.items():
        assert same_tensor(restored[name], t), name


def restored_tensors(path: Path, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """What restore of rank ``rank`` of ``tp`` gives: its expert tensors (:func:`rank_tensors`) and, on rank 0,
    every other tensor of the checkpoint unchanged."""
    kept = {n: t for n, t in all_tensors(path).items() if ".experts." not in n} if rank == 0 else {}
    return {**rank_tensors(path, tp, rank), **kept}


def rank_tensors(path: Path, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """The expert tensors of rank ``rank`` of ``tp``, cut from the checkpoint's files by name: gate/up rows,
    down columns (8 values per int32 word, 32 per scale), ``weight_shape`` the rank's ``[rows, values]``."""
    out = {}
    for name, t in all_tensors(path).items():
        if ".experts." not in name:
            continue
        base = name.split(f".{FAM.module}.")[0]
        r0, r1 = gen.rank_bounds(FAMILY, base, tp, rank)
        proj, suffix = name.split(".")[-2:]
        down = proj == FAM.names[2]
        if suffix == "weight_shape":
            rows, values = t.tolist()
            t = torch.tensor([rows, r1 - r0] if down else [r1 - r0, values], dtype=t.dtype)
        else:
            t = _cut(t, suffix, down, r0, r1)
        out[name] = t.contiguous()
    return out


def test_the_weights_are_the_checkpoint_bytes_xor_0x88():
    """The representation step on its own: q + 8 stored per nibble, two's complement q in the kernel."""
    q = torch.arange(-8, 8)
    stored = (q + 8).to(torch.uint8)  # uint4b8
    pairs = stored[:, None] | (stored[None, :] << 4)  # every byte: low nibble, high nibble
    twos = (q & 0xF).to(torch.uint8)
    assert torch.equal(pairs ^ conventions.WEIGHT_XOR["int4-group"], twos[:, None] | (twos[None, :] << 4))


def test_cutlass_is_refused_naming_the_missing_piece(samples, tmp_path, capsys):
    out = tmp_path / "c.safetensors"
    missing = conventions.MISSING_LAYOUT["int4-group"]["cutlass"]
    assert "trtllm" not in conventions.MISSING_LAYOUT["int4-group"]
    with pytest.raises(CheckpointError, match="int4-group has no cutlass layout"):
        convert_checkpoint(samples["random"], out, "cutlass")
    assert main(["convert", str(samples["random"]), str(out), "--backend", "cutlass"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and missing in err and "(fix:" in err
    assert not out.exists()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_scales_of_another_dtype_are_refused_naming_it(samples, tmp_path, capsys, dtype):
    """compressed-tensors writes INT4 scales in the model's dtype; the MxInt4 layout takes BF16 scales, and F16 or
    F32 ones rounded to BF16 would not restore: refused in one line naming the tensor, its dtype and BF16."""
    tensors = all_tensors(samples["random"])
    tensors = {n: t.to(dtype) if n.endswith("weight_scale") else t for n, t in tensors.items()}
    src = tmp_path / "src"
    src.mkdir()
    save_file(tensors, str(src / "model.safetensors"))
    (src / "config.json").write_text((samples["random"] / "config.json").read_text())
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    want = "F16" if dtype == torch.float16 else "F32"
    out = tmp_path / "k.safetensors"
    assert main(["convert", str(src), str(out), "--backend", "trtllm"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"weight_scale is {want}: ct-int4 is read with BF16 there only" in err
    assert "(fix: export it with BF16 weight_scale" in err and "no known naming convention" not in err
    assert not out.exists() and {p.name: p.read_bytes() for p in src.iterdir()} == before


def test_inspect_shows_the_mxint4_layout(samples):
    (rep,) = inspect_checkpoint(samples["random"], layers=[1], tps=(1, 2))
    assert rep.fmt == "int4-group"
    for tp in (1, 2):
        assert "cannot" not in rep.tp[tp]["trtllm"] and "no-layout" not in rep.tp[tp]["trtllm"], rep.tp[tp]
        assert conventions.MISSING_LAYOUT["int4-group"]["cutlass"] in rep.tp[tp]["cutlass"]


@pytest.mark.parametrize("value", ["nvfp4", 7, None])
def test_restore_refuses_an_edited_checkpoint_format(samples, tmp_path, value):
    kernel = convert_checkpoint(samples["random"], tmp_path / "k.safetensors", "trtllm")
    bad = rewrite_metadata(
        kernel, tmp_path / "bad.safetensors", lambda m: m["layers"]["1"].update(checkpoint_format=value)
    )
    with pytest.raises(CheckpointError, match="is not laid out as 'mxint4'"):
        restore_checkpoint(bad, tmp_path / "back")
    assert not (tmp_path / "back").exists()


def test_the_mxint4_row_reaches_the_shipped_mxint4_kernels():
    """The FORMATS row's TRTLLM-Gen enums (as ``tune/validity.py`` names them) select MxInt4 kernels of the
    shipped FlashInfer kernel table at Kimi-K2-Thinking's TP8 shape; the tuner takes it."""
    from fimoe_lab.specs import FORMATS, LAYOUTS, tuner_formats
    from fimoe_lab.tune import validity

    row = FORMATS["mxint4"]
    assert (row.storage, row.values_per_byte, row.scale_dtype, row.scale_block, row.backends) == (
        "uint8",
        2,
        "bfloat16",
        32,
        ("trtllm",),
    )
    assert conventions.stored_format("int4-group").plan_format == "mxint4" and "mxint4" in tuner_formats()
    e, table = row.tactics, validity.find_table()
    assert e is not None and table is not None
    shape = (7168, 256, 384, 8, 64)  # hidden, per-rank intermediate, experts, top-k, tokens
    layout = LAYOUTS[e.default_layout]
    got = validity.answer(table, e.dtype_act, e.dtype_weights, e.fp8_quantization_type, "Swiglu", layout, False, *shape)
    assert got.error is None and len(got.configs) > 0
    bf16 = validity.answer(table, e.dtype_act, "Bfloat16", e.fp8_quantization_type, "Swiglu", layout, False, *shape)
    assert set(got.configs) != set(bf16.configs)  # the MxInt4 kernels, not the BF16 ones


def test_expert_parallel_ranks_restore_the_int4_checkpoint(samples, tmp_path):
    out = convert_checkpoint(samples["structured"], tmp_path / "ep", "trtllm", 2, "all", ep_size=2)
    back = all_tensors(restore_checkpoint(out, tmp_path / "back"))
    want = restored_tensors(samples["structured"], 1, 0)
    assert sorted(back) == sorted(want) == sorted(all_tensors(samples["structured"]))
    assert all(same_tensor(back[n], t) for n, t in want.items())


# ----------------------------------------------------------------------------- SwiGLU only
def _int4_layer(samples: dict[str, Path], activation: str):
    """Layer 1 of the generated int4 sample (structured bytes) as a layer of ``activation`` (a GeGLU int4
    checkpoint has the same tensors; only its activation differs)."""
    from dataclasses import replace

    from fimoe_lab.checkpoints import open_checkpoint

    with open_checkpoint(samples["structured"]) as ck:
        layer = ck.read_layer(1)
    return replace(layer, activation=activation)


@pytest.mark.parametrize("activation", ["geglu", "gelu"])
def test_a_geglu_int4_layer_is_refused_naming_swiglu(samples, activation):
    """The TRTLLM-Gen MxInt4 runner always runs SwiGLU: a GeGLU int4 layer is refused before any byte moves."""
    from fimoe_lab.checkpoints import convert, plan_choice

    layer = _int4_layer(samples, activation)
    before = {n: t.clone() for n, t in layer.tensors().items() if t is not None}
    for call in (
        lambda: plan_choice.plan_args(layer, LayoutChoice("trtllm")),
        lambda: convert.convert_layer(layer, LayoutChoice("trtllm")),
    ):
        with pytest.raises(CheckpointError) as info:
            call()
        msg = info.value.message
        assert "mxint4 on trtllm: the kernel always runs swiglu or swiglu_oai, not geglu" in msg and "\n" not in msg
        assert "geglu" in info.value.fix
    assert all(torch.equal(layer.tensors()[n], t) for n, t in before.items())


@pytest.mark.parametrize("activation", ["silu", "swiglu", "swiglu_oai"])
def test_swiglu_int4_layers_still_convert(samples, activation):
    from fimoe_lab.checkpoints import convert

    layer = _int4_layer(samples, activation)
    kernel, plan, spec = convert.convert_layer(layer, LayoutChoice("trtllm"))
    assert spec["args"]["fmt"] == "mxint4" and sum(t.numel() for t in kernel.values()) > 0


def test_the_kernel_activation_rule_is_one_table_read_by_the_tuner_and_the_writer():
    """``specs.FormatSpec.kernel_activations`` is the one fact: ``shapes.padded_shape`` (the tuner's rule) and
    the tuner's convert check refuse GeGLU MxInt4 with the writer's line; other formats take GeGLU."""
    from dataclasses import replace

    from fimoe_lab import shapes
    from fimoe_lab.errors import LayoutError
    from fimoe_lab.presets import get_preset
    from fimoe_lab.specs import FORMATS
    from fimoe_lab.tune import sweep

    assert FORMATS["mxint4"].kernel_activations == ("Swiglu",)
    assert all(not f.kernel_activations for n, f in FORMATS.items() if n != "mxint4")
    assert shapes.padded_shape("mxint4", "trtllm", 512, 256, activation="swiglu") == (512, 256)
    with pytest.raises(LayoutError, match="always runs swiglu or swiglu_oai, not geglu"):
        shapes.padded_shape("mxint4", "trtllm", 512, 256, activation="geglu")
    assert shapes.padded_shape("mxint4", "trtllm", 512, 256) == (512, 256)  # activation unknown: not checked
    assert shapes.padded_shape("bf16", "trtllm", 512, 256, activation="geglu") == (512, 256)
    kimi = get_preset("kimi-k2")
    assert sweep.convert_check(kimi, "mxint4", 8, 256, 256) is None
    why = sweep.convert_check(replace(kimi, activation="geglu"), "mxint4", 8, 256, 256)
    assert why is not None and "not geglu" in why
