"""``restore`` of ``convert --tp T --ep N --rank all`` for every (T, N) convert accepts, ``T > N`` included.

Rank ``r = ep_rank * (T/N) + tp_rank`` holds experts ``[e0, e1)`` of EP rank ``ep_rank`` (contiguous) sliced
along the intermediate dim as moe-TP rank ``tp_rank`` of ``T/N`` (``N = 1``: plain TP, every expert).
Restore joins the slices of each EP rank and concatenates the experts: the result must be the source's expert
tensors byte for byte (the same names a TP-1 convert restores to, config.json the source's), on the shipped
samples (random bytes) and on structured copies whose every expert tensor's bytes encode (tensor, position).
Oracles: the source files themselves; for :func:`expert_parallel.join_tp` alone, the reader's own TP slicing
(``read_layer(l, T, r)`` joined equals ``read_layer(l)``). A missing or foreign rank is refused, naming it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import all_tensors, same_tensor
from safetensors.torch import save_file

from fimoe_lab.checkpoints import (
    CheckpointError,
    convert_checkpoint,
    expert_parallel,
    open_checkpoint,
    read_kernel_metadata,
    restore_checkpoint,
)
from fimoe_lab.cli import main
from fimoe_lab.resources import sample_path

GRID = ((2, 1), (4, 2), (2, 2), (4, 4))
"""(--tp, --ep): plain TP, EP with moe-TP slices (T > N), pure EP."""

CASES = [
    *[("deepseek-v3-fp8", "trtllm", tp, ep) for tp, ep in GRID],
    *[("qwen3-moe-bf16", "cutlass", tp, ep) for tp, ep in GRID],
    ("gpt-oss-mxfp4", "trtllm", 4, 2),  # interleaved gate/up, biases (down bias on rank 0 only)
    ("deepseek-r1-nvfp4", "cutlass", 4, 2),  # packed FP4, block scales and scalar extras
    ("mixtral-bf16", "trtllm", 2, 1),
]


def _structured(name: str, dst: Path) -> Path:
    """A copy of sample ``name`` whose every expert tensor's bytes are int32 words ``(k << 20) + i + 1`` (``k``
    the tensor's place in sorted order, ``i`` the word's index): a moved or mixed-up byte shows."""
    src = sample_path(name)
    tensors = all_tensors(src)
    for k, n in enumerate(sorted(tensors)):
        t = tensors[n]
        if ".experts." not in n or t.dtype == torch.float32:  # float32 scales/extras: kept (values are checked)
            continue
        words = -(-t.numel() * t.element_size() // 4)
        code = (torch.arange(words, dtype=torch.int32) + 1 + (k << 20)).view(torch.uint8)
        tensors[n] = code[: t.numel() * t.element_size()].view(t.dtype).reshape(t.shape).clone()
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for f in src.glob("*.json"):
        if f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    return dst


def _check_restores_the_source(src: Path, backend: str, tp: int, ep: int, tmp: Path) -> None:
    out = convert_checkpoint(src, tmp / "ranks", backend, tp, "all", ep_size=ep)
    assert sorted(p.name for p in out.iterdir()) == [f"rank-{r}" for r in range(tp)]
    meta = read_kernel_metadata(out / f"rank-{tp - 1}")
    assert (meta["tp_size"], meta["tp_rank"], meta.get("ep_size", 1)) == (tp // ep, (tp - 1) % (tp // ep), ep)
    back = restore_checkpoint(out, tmp / "back")
    got, source = all_tensors(back), all_tensors(src)
    whole = all_tensors(restore_checkpoint(convert_checkpoint(src, tmp / "tp1", backend), tmp / "back-tp1"))
    assert sorted(got) == sorted(whole) and got
    assert all(same_tensor(got[k], source[k]) for k in got), [k for k in got if not same_tensor(got[k], source[k])]
    assert json.loads((back / "config.json").read_text()) == json.loads((src / "config.json").read_text())


@pytest.mark.parametrize("name,backend,tp,ep", CASES)
def test_restore_of_every_rank_is_the_source(name, backend, tp, ep, tmp_path):
    _check_restores_the_source(sample_path(name), backend, tp, ep, tmp_path)


@pytest.mark.parametrize(
    "name,backend,tp,ep", [("qwen3-moe-bf16", "trtllm", 4, 2), ("deepseek-v3-fp8", "cutlass", 2, 1)]
)
def test_restore_of_every_rank_is_the_source_on_structured_bytes(name, backend, tp, ep, tmp_path):
    _check_restores_the_source(_structured(name, tmp_path / "src"), backend, tp, ep, tmp_path)


@pytest.mark.parametrize("name,tp", [("deepseek-v3-fp8", 2), ("gpt-oss-mxfp4", 4), ("deepseek-r1-nvfp4", 2)])
def test_join_tp_inverts_the_readers_tp_slicing(name, tp):
    """The reader's rank slices of a layer, joined, are the layer read whole (every tensor and extra)."""
    with open_checkpoint(sample_path(name)) as ck:
        layer = ck.moe_layers[0]
        whole = ck.read_layer(layer)
        joined = expert_parallel.join_tp([ck.read_layer(layer, tp, r) for r in range(tp)], ck.convention.scales)
    assert joined.intermediate == whole.intermediate and (joined.tp_size, joined.tp_rank) == (1, 0)
    for n, t in whole.tensors().items():
        assert same_tensor(joined.tensors()[n], t), n
    assert sorted(joined.extras) == sorted(whole.extras)
    assert all(same_tensor(joined.extras[n], t) for n, t in whole.extras.items())


def test_a_missing_rank_is_refused_naming_it(tmp_path, capsys):
    out = convert_checkpoint(sample_path("qwen3-moe-bf16"), tmp_path / "ranks", "cutlass", 4, "all", ep_size=2)
    shutil.rmtree(out / "rank-2")
    with pytest.raises(CheckpointError, match=r"rank-2 is missing \(--tp 4 --ep 2 writes rank-0 \.\. rank-3"):
        restore_checkpoint(out, tmp_path / "back")
    assert main(["restore", str(out), str(tmp_path / "back")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rank-2 is missing" in err and "--rank all --resume" in err
    assert not (tmp_path / "back").exists()


def test_a_rank_of_another_place_is_refused(tmp_path):
    out = convert_checkpoint(sample_path("deepseek-v3-fp8"), tmp_path / "ranks", "trtllm", 2, "all")
    shutil.rmtree(out / "rank-1")
    shutil.copytree(out / "rank-0", out / "rank-1")
    with pytest.raises(CheckpointError, match="rank-1: its metadata is rank 0 of --tp 2 --ep 1"):
        restore_checkpoint(out, tmp_path / "back")
    assert not (tmp_path / "back").exists()


@pytest.mark.parametrize("ep_size", [0, 3])
def test_a_grid_convert_refuses_is_refused_with_converts_message(tmp_path, ep_size):
    """Ranks whose records were edited to another EP size are refused: 0 (convert refuses it) with convert's
    own message; 3 (the records then describe --tp 6 --ep 3) naming the first rank that is not there."""
    from test_checkpoints_format import rewrite_metadata

    src = sample_path("qwen3-moe-bf16")
    out = convert_checkpoint(src, tmp_path / "ranks", "cutlass", 4, "all", ep_size=2)
    for f in out.glob("rank-*/*.safetensors"):
        rewrite_metadata(f, f, lambda m: m.update(ep_size=ep_size))
    with pytest.raises(CheckpointError) as info:
        restore_checkpoint(out, tmp_path / "back")
    if ep_size == 0:
        with pytest.raises(CheckpointError) as convert_said:
            convert_checkpoint(src, tmp_path / "bad", "cutlass", 4, "all", ep_size=0)
        assert info.value.message == convert_said.value.message
        assert "expert-parallel size 0 does not divide" in info.value.message
    else:
        assert "rank-4 is missing (--tp 6 --ep 3" in info.value.message
    assert not (tmp_path / "back").exists()
