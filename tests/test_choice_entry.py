"""The layout options as one value at the entry points: ``choice=`` of ``convert_checkpoint`` and
``inspect_checkpoint`` against their keyword form, refusals of both or neither, and the CLI's one
``layout_choice`` of parsed arguments against the convert it runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import all_tensors

from fimoe_lab.checkpoints import (
    LayoutChoice,
    convert_checkpoint,
    inspect_checkpoint,
    read_kernel_metadata,
    sample_path,
)
from fimoe_lab.cli import build_parser
from fimoe_lab.cli import main as cli_main
from fimoe_lab.cli._common import layout_choice
from fimoe_lab.errors import FimoeError


def _same_files(a, b) -> None:
    ta, tb = all_tensors(a), all_tensors(b)
    assert sorted(ta) == sorted(tb)
    for name, t in ta.items():
        assert torch.equal(t.view(torch.uint8), tb[name].view(torch.uint8)), name
    ma, mb = read_kernel_metadata(a), read_kernel_metadata(b)
    assert ma["layers"] == mb["layers"] and ma["backend"] == mb["backend"]


@pytest.mark.parametrize(
    "sample,choice",
    [
        ("qwen3-moe-bf16", LayoutChoice("trtllm", 128, None, "sglang-0.5.23")),
        ("gpt-oss-mxfp4", LayoutChoice("cutlass", None, None, None, False, "bf16")),
    ],
)
def test_convert_choice_writes_what_the_keyword_form_writes(tmp_path, sample, choice):
    """The value and its fields as keywords give the same bytes and the same recorded plans."""
    src = sample_path(sample)
    by_value = convert_checkpoint(src, tmp_path / "v.safetensors", choice=choice)
    fields = dataclasses.asdict(choice)
    by_keywords = convert_checkpoint(
        src,
        tmp_path / "k.safetensors",
        fields["backend"],
        intermediate_alignment=fields["intermediate_alignment"],
        hidden_alignment=fields["hidden_alignment"],
        engine=fields["engine"],
        per_token=fields["per_token_activation"],
        activation_dtype=fields["activation_dtype"],
    )
    _same_files(by_value, by_keywords)


def test_convert_refuses_the_options_twice_or_no_backend(tmp_path):
    src, out = sample_path("qwen3-moe-bf16"), tmp_path / "out.safetensors"
    choice = LayoutChoice("trtllm")
    with pytest.raises(FimoeError, match="given twice") as exc:
        convert_checkpoint(src, out, choice=choice, engine="vllm-0.34")
    assert exc.value.fix and not out.exists()
    with pytest.raises(FimoeError, match="given twice"):
        convert_checkpoint(src, out, "cutlass", choice=choice)
    with pytest.raises(FimoeError, match="no backend"):
        convert_checkpoint(src, out)
    assert not out.exists()
    convert_checkpoint(src, out, "trtllm", choice=choice)  # the backend repeated is the same ask
    assert read_kernel_metadata(out)["backend"] == "trtllm"


def test_inspect_choice_is_the_keyword_form_and_refuses_both():
    src = sample_path("qwen3-moe-bf16")
    by_keywords = inspect_checkpoint(src, tps=(1, 2), engine="sglang-0.5.23")
    by_value = inspect_checkpoint(src, tps=(1, 2), choice=LayoutChoice("cutlass", engine="sglang-0.5.23"))
    assert [r.to_json() for r in by_value] == [r.to_json() for r in by_keywords]
    aligned = inspect_checkpoint(src, tps=(1,), choice=LayoutChoice("trtllm", 96))  # alignments reach every backend
    assert aligned[0].to_json() != inspect_checkpoint(src, tps=(1,))[0].to_json()
    with pytest.raises(FimoeError, match="given twice"):
        inspect_checkpoint(src, choice=LayoutChoice("trtllm"), per_token=True)


def test_cli_builds_the_value_once_and_convert_records_it(tmp_path, capsys):
    """``layout_choice`` of convert's parsed options is the value the Python entry point takes: the CLI's
    output and ``convert_checkpoint(choice=...)`` of that value are the same bytes."""
    src = sample_path("qwen3-moe-bf16")
    argv = ["convert", str(src), str(tmp_path / "cli.safetensors"), "--backend", "trtllm"]
    argv += ["--intermediate-alignment", "128", "--hidden-alignment", "128", "--engine", "sglang"]
    args = build_parser().parse_args(argv)
    choice = layout_choice(args)
    assert (choice.backend, choice.intermediate_alignment, choice.hidden_alignment) == ("trtllm", 128, 128)
    assert choice.engine == args.engine and choice.engine.startswith("sglang")
    assert (choice.per_token_activation, choice.activation_dtype) == (False, None)
    assert cli_main(argv) == 0
    capsys.readouterr()
    by_value = convert_checkpoint(src, tmp_path / "py.safetensors", choice=choice)
    _same_files(tmp_path / "cli.safetensors", by_value)
    layer = next(iter(read_kernel_metadata(by_value)["layers"].values()))
    assert layer["padded_hidden"] % 128 == 0 and layer["plan"]["args"]["hidden_alignment"] == 128
