"""The Hopper (SM90) MXFP4 x BF16 CUTLASS layout through ``plan_layer``, ``convert``, ``restore`` and the CLI
(``activation_dtype="bf16"`` / ``--mxfp4-activation bf16``): byte-exact round trips of the gpt-oss MXFP4 sample at
TP 1 and 2, the written tensors against the engines' steps (vLLM 0.34's own code on these files: one run with the
synthetic cases, ``test_sm90_mixed.test_vllm_034_own_code_with_the_kernel_loop``), refusals."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers import all_tensors, random_bytes, rewrite_metadata, same_tensor
from test_sm90_mixed import engine_reference, kernel_file_tensors

from fimoe_lab import recipes, special_plans, steps
from fimoe_lab.checkpoints import (
    convert_checkpoint,
    open_checkpoint,
    read_kernel_metadata,
    restore_checkpoint,
    restore_layers,
    sample_path,
)
from fimoe_lab.cli import main as cli_main
from fimoe_lab.errors import FimoeError, LayoutError

SAMPLE = "gpt-oss-mxfp4"
NAMES = ("w13", "w2", "w13_scale", "w2_scale")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The sample converted with the SM90 BF16-activation layout at TP 1 and TP 2 (last rank): ``{tp: path}``."""
    out = {}
    for tp in (1, 2):
        kernel = tmp_path_factory.mktemp(f"tp{tp}") / "k.safetensors"
        convert_checkpoint(sample_path(SAMPLE), kernel, "cutlass", tp, tp - 1, activation_dtype="bf16")
        out[tp] = kernel
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_convert_restore_is_byte_exact(converted, tmp_path, tp):
    kernel, src = converted[tp], sample_path(SAMPLE)
    meta = read_kernel_metadata(kernel)
    for rec in meta["layers"].values():
        assert rec["plan"]["args"]["activation_dtype"] == "bf16"
        for n in ("w13", "w2"):  # both steps recorded, the byte step first; each rebuilds from its record
            recorded = rec["tensors"][n]["steps"]
            assert [s["kind"] for s in recorded[-2:]] == ["interleave_sm90_mixed_weights", "sm90_mixed_word_bits"]
            assert recorded[-1]["params"] == {"quant_type": "fp4", "layout": "0.6.16"}  # vllm-0.34, the default
            assert [steps.build(s["kind"], s["params"]).spec()[0] for s in recorded] == recorded
        assert rec["tensors"]["w13_scale"]["steps"][-1]["kind"] == "fold_scales_sm90_mixed"
    restored = restore_checkpoint(kernel, tmp_path / "restored")
    with open_checkpoint(src) as a, open_checkpoint(restored) as b:
        assert b.moe_layers == a.moe_layers
        for layer in a.moe_layers:
            x, y = a.read_layer(layer, tp, tp - 1), b.read_layer(layer)
            for name in NAMES:
                assert same_tensor(getattr(x, name), getattr(y, name)), (layer, name)
            assert x.extras and all(same_tensor(x.extras[n], y.extras[n]) for n in x.extras)
    if tp == 1:  # the source's expert tensors, byte for byte, under their names
        original, back = all_tensors(src), all_tensors(restored)
        assert back and all(same_tensor(original[k], v) for k, v in back.items())


@pytest.mark.parametrize("tp", [1, 2])
def test_written_tensors_equal_the_engine_steps(converted, tp):
    """The file against :func:`test_sm90_mixed.engine_reference` (vLLM's steps written out, the kernel loop for
    FlashInfer's weight op, FlashInfer's scale folding) on the checkpoint's own bytes; and unlike the
    default (MXFP4 x MXFP8) CUTLASS layout."""
    meta = read_kernel_metadata(converted[tp])
    with open_checkpoint(sample_path(SAMPLE)) as ck:
        for idx in meta["layers"]:
            layer = ck.read_layer(int(idx), tp, tp - 1)
            ins = [getattr(layer, n).contiguous().view(torch.uint8) for n in NAMES]
            want = engine_reference(*ins, layer.intermediate, layer.hidden, "0.6.16")
            got = kernel_file_tensors(converted[tp], meta, idx)
            for n, w in zip(NAMES, want):
                assert torch.equal(got[n].view(torch.uint8).reshape(-1), w.reshape(-1).view(torch.uint8)), (idx, n)
            default = recipes.plan_layer("mxfp4", "cutlass", layer.intermediate, layer.hidden).apply(*ins)[0]
            assert default is not None and not torch.equal(default.reshape(-1), got["w13"].reshape(-1))


def test_plan_layer_selects_the_layout_by_activation_dtype():
    sm90 = recipes.plan_layer("mxfp4", "cutlass", 96, 160, activation_dtype="bf16")
    assert sm90 == special_plans.plan_cutlass_mxfp4_bf16(96, 160)
    assert (sm90.padded_intermediate, sm90.padded_hidden) == (128, 256)
    assert recipes.plan_layer("mxfp4", "cutlass", 96, 160, activation_dtype="mxfp8") == recipes.plan_layer(
        "mxfp4", "cutlass", 96, 160
    )
    x = [random_bytes((2, *s), torch.uint8, seed=i) for i, s in enumerate([(192, 80), (160, 48), (192, 5), (160, 3)])]
    out = sm90.apply(*x)
    assert all(torch.equal(b.reshape(a.shape), a) for a, b in zip(x, sm90.inverse().apply(*out)))
    wrong_order = dataclasses.replace(sm90.inverse(), word_bits_first=False)  # byte map undone before the bits
    assert not torch.equal(wrong_order.apply_tensor("w13", out[0]).reshape(x[0].shape), x[0])
    for fmt, backend in (("nvfp4", "cutlass"), ("mxfp4", "trtllm"), ("bf16", "cutlass")):
        with pytest.raises(LayoutError, match="activation dtype 'bf16'"):
            recipes.plan_layer(fmt, backend, 128, 256, activation_dtype="bf16")


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: ") and "(fix: " in err, err
    return err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["convert", "mixtral-bf16", "OUT", "--backend", "cutlass"], "does not apply to bf16 weights on cutlass"),
        (["convert", SAMPLE, "OUT", "--backend", "trtllm"], "does not apply to mxfp4 weights on trtllm"),
        (["convert", SAMPLE, "OUT", "--backend", "cutlass", "--single-file"], None),  # bf16 is valid: control
        (["inspect", "qwen3-moe-bf16", "--tp", "1"], "does not apply to bf16 weights"),
        (["plan", "--format", "nvfp4"], "does not apply to nvfp4 trtllm, nvfp4 cutlass"),
        (["plan", "--format", "mxfp4", "--backend", "trtllm"], "does not apply to mxfp4 trtllm"),
    ],
)
def test_cli_refuses_the_flag_where_no_layout_takes_it(tmp_path, capsys, argv, message):
    out = tmp_path / "out.safetensors"
    argv = [str(out) if a == "OUT" else a for a in argv] + ["--mxfp4-activation", "bf16"]
    code = cli_main(argv)
    if message is None:
        assert code == 0 and out.exists()
        return
    assert code == 2 and message in one_error_line(capsys)
    assert not out.exists()


def test_cli_plan_round_trips_the_bit_step(capsys):
    argv = ["plan", "--format", "mxfp4", "--backend", "cutlass", "--intermediate", "96", "--hidden", "160"]
    assert cli_main([*argv, "--mxfp4-activation", "bf16", "--json"]) == 0
    (plan,) = json.loads(capsys.readouterr().out)["plans"]
    rows = {t["name"]: t for t in plan["tensors"]}
    assert all(t["round_trip"] for t in rows.values()) and plan["engine_scales"] is plan["engine_weights"] is True
    assert rows["w2"]["steps"] == ["pad_projections", "interleave_sm90_mixed_weights", "sm90_mixed_word_bits"]
    assert rows["w13"]["out_shape"] == [256, 128]
    assert cli_main([*argv, "--mxfp4-activation", "fp16"]) == 2
    assert "has no layout chosen by activation dtype 'fp16'" in one_error_line(capsys)


def _drop_bits(meta):
    meta["layers"]["0"]["tensors"]["w13"]["steps"].pop()


def _default_layout(meta):
    del meta["layers"]["0"]["plan"]["args"]["activation_dtype"]


TAMPERED = [
    ("bit step dropped", _drop_bits, "w13 was written with steps"),
    ("recorded as the default layout", _default_layout, "was written with steps"),
    ("not a name", lambda m: m["layers"]["0"]["plan"]["args"].update(activation_dtype=5), "not a dtype name"),
    ("no such layout", lambda m: m["layers"]["0"]["plan"]["args"].update(activation_dtype="fp16"), "'fp16'"),
]


@pytest.mark.parametrize("edit,message", [t[1:] for t in TAMPERED], ids=[t[0] for t in TAMPERED])
def test_restore_refuses_a_tampered_record(converted, tmp_path, edit, message):
    bad = rewrite_metadata(converted[1], tmp_path / "bad.safetensors", edit)
    with pytest.raises(FimoeError, match=message) as info:
        restore_layers(bad)
    assert info.value.fix
