"""Per-token NVFP4 through convert / inspect / restore.

``convert --per-token`` (``convert_checkpoint(..., per_token=True)``) lays NVFP4 checkpoints out with
``plan_layer(..., per_token_activation=True)`` (the engine profile's per-token paddings: vLLM 0.34 pads the
hidden size of a non-gated layer to 512 on TRT-LLM), records it in every layer's plan arguments, and
``restore`` rebuilds with it. Oracles: the generator's own tensors (``scripts/make_family_samples.py``,
stacked here by name, not by the reader) mapped expert by expert through the plan's index maps by a gather
written in this test (not the executors), and the generator's per-rank files for restore. Inputs: the NVFP4
families (ModelOpt and compressed-tensors: random bytes with coordinates in byte 0 of every row) at TP 1
and 2, and an in-memory non-gated layer of random or coordinate-coded bytes.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
from helpers import all_tensors, coords, plus_unchanged, random_bytes, rewrite_metadata, same_bytes, same_tensor
from safetensors.torch import load_file

from fimoe_lab import recipes
from fimoe_lab.checkpoints import (
    CheckpointError,
    LayoutChoice,
    MoELayer,
    convert_checkpoint,
    inspect_checkpoint,
    read_kernel_metadata,
    restore_checkpoint,
    restore_layers,
)
from fimoe_lab.checkpoints.convert import write_kernel_layout
from fimoe_lab.checkpoints.fileformat import KERNEL_NAMES
from fimoe_lab.checkpoints.inspect import backend_need
from fimoe_lab.cli import main
from fimoe_lab.layout import IndexMap
from scripts import make_family_samples as gen

NVFP4 = [f for f, fam in gen.FAMILIES.items() if fam.kind.startswith("nvfp4")]
RANKS = ((1, 0), (2, 0), (2, 1))


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("per-token")
    for family in (*NVFP4, "olmoe", "kimi-k2-thinking-int4"):
        gen.make(family, out)
    return out


def gather(m: IndexMap | None, x: torch.Tensor) -> torch.Tensor:
    """``out[i] = in[src[i]]`` (fill bytes for negative codes) on each expert's bytes in turn: the map's
    definition, applied without the executors. ``x``: ``(E, ...)``; returns ``(E, out bytes)`` uint8."""
    flat = x.contiguous().view(torch.uint8).reshape(x.shape[0], -1)
    if m is None:
        return flat
    ok = m.src >= 0
    experts = []
    for e in range(x.shape[0]):
        cells = flat[e].reshape(-1, m.cell_bytes)
        out = torch.empty((m.src.numel(), m.cell_bytes), dtype=torch.uint8)
        out[ok] = cells[m.src[ok]]
        for k, fill in enumerate(m.fills):
            out[m.src == -1 - k] = fill
        experts.append(out.reshape(-1))
    return torch.stack(experts)


def stacked(family: str, base: str, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """The rank's layer as the four plan inputs, from the generator's per-projection tensors: ``[gate; up]``."""
    t = gen._slice(family, base, gen.truth(family, base), tp, rank)
    return {
        "w13": torch.cat([t["gate"], t["up"]], 1),
        "w2": t["down"],
        "w13_scale": torch.cat([t["gate_s"], t["up_s"]], 1),
        "w2_scale": t["down_s"],
    }


def check_kernel(tensors: dict[str, torch.Tensor], prefix: str, source: dict[str, torch.Tensor], plan) -> None:
    for n, kname in KERNEL_NAMES.items():
        got = tensors[prefix + kname]
        want = gather(plan.maps().get(n), source[n])
        assert same_bytes(got.contiguous().view(torch.uint8).reshape(want.shape), want), kname


@pytest.mark.parametrize("family", NVFP4)
@pytest.mark.parametrize("backend", ["trtllm", "cutlass"])
def test_per_token_convert_is_the_per_token_plan_and_restores_byte_exact(root, tmp_path, family, backend):
    fam = gen.FAMILIES[family]
    for tp, rank in RANKS:
        out = convert_checkpoint(root / family, tmp_path / f"k{tp}{rank}", backend, tp, rank, per_token=True)
        meta, tensors = read_kernel_metadata(out), all_tensors(out)
        for idx, base in meta["layer_names"].items():
            args = meta["layers"][idx]["plan"]["args"]
            assert args["per_token_activation"] is True and args["fmt"] == "nvfp4"
            source = stacked(family, base, tp, rank)
            inter = source["w13"].shape[1] // 2
            plan = recipes.plan_layer("nvfp4", backend, inter, fam.hidden, per_token_activation=True)
            check_kernel(tensors, f"{meta['prefix']}{idx}.{meta['block']}.experts.", source, plan)
        back = all_tensors(restore_checkpoint(out, tmp_path / f"b{tp}{rank}"))
        want = plus_unchanged(root / family, gen.file_tensors(family), gen.file_tensors(family, tp, rank), rank)
        assert sorted(back) == sorted(want)
        for name, t in want.items():
            assert same_tensor(back[name], t.contiguous()), (family, backend, tp, rank, name)


def non_gated_layer(kind: str, experts: int = 3, inter: int = 128, hidden: int = 256) -> MoELayer:
    """An NVFP4 ReLU^2 layer (one projection in W13) of random or coordinate-coded bytes."""

    def make(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
        if kind == "structured":
            return coords(experts, rows, cols // 4).view(torch.uint8).reshape(experts, rows, cols).view(dtype)
        return random_bytes((experts, rows, cols), dtype, seed)

    return MoELayer(
        "nvfp4",
        make(inter, hidden // 2, torch.uint8, 1),
        make(hidden, inter // 2, torch.uint8, 2),
        make(inter, hidden // 16, torch.float8_e4m3fn, 3),
        make(hidden, inter // 16, torch.float8_e4m3fn, 4),
        inter,
        hidden,
        activation="relu2",
        is_act_and_mul=False,
        is_gated=False,
    )


@pytest.mark.parametrize("kind", ["random", "structured"])
def test_non_gated_trtllm_pads_hidden_to_512_per_token_and_restores(tmp_path, kind):
    layer = non_gated_layer(kind)
    out = write_kernel_layout(
        tmp_path / "k.safetensors", [(0, layer, lambda: layer)], LayoutChoice("trtllm", per_token_activation=True)
    )
    meta, back = restore_layers(out)
    rec = meta["layers"]["0"]
    assert rec["plan"]["args"]["per_token_activation"] is True and rec["padded_hidden"] == 512
    plan = recipes.plan_layer("nvfp4", "trtllm", 128, 256, False, False, per_token_activation=True)
    assert (
        plan.padded_hidden == 512 and recipes.plan_layer("nvfp4", "trtllm", 128, 256, False, False).padded_hidden == 256
    )
    check_kernel(load_file(out), "model.layers.0.mlp.experts.", layer.tensors(), plan)
    for n, t in layer.tensors().items():
        assert same_tensor(getattr(back[0], n), t), n


def test_a_file_without_the_field_reads_as_not_per_token(tmp_path):
    layer = non_gated_layer("random")
    plain = write_kernel_layout(tmp_path / "plain.safetensors", [(0, layer, lambda: layer)], LayoutChoice("trtllm"))
    assert read_kernel_metadata(plain)["layers"]["0"]["plan"]["args"]["per_token_activation"] is False
    drop = lambda m: m["layers"]["0"]["plan"]["args"].pop("per_token_activation")  # noqa: E731
    old = rewrite_metadata(plain, tmp_path / "old.safetensors", drop)  # as written before the field existed
    _, (back,) = restore_layers(old)
    assert same_tensor(back.w13, layer.w13) and same_tensor(back.w2_scale, layer.w2_scale)
    # a per-token file read as not per-token no longer matches its recorded steps: the field is read
    per_token = write_kernel_layout(
        tmp_path / "pt.safetensors", [(0, layer, lambda: layer)], LayoutChoice("trtllm", per_token_activation=True)
    )
    with pytest.raises(CheckpointError, match="does not build from the same arguments"):
        restore_layers(rewrite_metadata(per_token, tmp_path / "pt-old.safetensors", drop))
    flip = lambda m: m["layers"]["0"]["plan"]["args"].update(per_token_activation="yes")  # noqa: E731
    with pytest.raises(CheckpointError, match="per_token_activation 'yes' in the plan record is not true or false"):
        restore_layers(rewrite_metadata(per_token, tmp_path / "pt-bad.safetensors", flip))


@pytest.mark.parametrize("family,fmt", [("olmoe", "bf16"), ("kimi-k2-thinking-int4", "int4-group")])
def test_per_token_on_a_non_nvfp4_format_is_refused_in_one_line(root, tmp_path, capsys, family, fmt):
    out = tmp_path / "k.safetensors"
    with pytest.raises(CheckpointError, match=f"does not apply to {fmt} weights"):
        convert_checkpoint(root / family, out, "trtllm", per_token=True)
    assert main(["convert", str(root / family), str(out), "--backend", "trtllm", "--per-token"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"does not apply to {fmt} weights" in err and "(fix: drop --per-token" in err
    assert not out.exists()


def test_inspect_per_token_shows_the_per_token_paddings(root, capsys):
    layer = non_gated_layer("random")
    with_pt, without = (
        backend_need(layer, LayoutChoice("trtllm", per_token_activation=True)),
        backend_need(layer, LayoutChoice("trtllm")),
    )
    assert (with_pt.padded_hidden, without.padded_hidden) == (512, 256)
    assert "H 256->512" in with_pt.text() and "H 256" not in without.text()
    assert with_pt.plan["args"]["per_token_activation"] is True
    (rep,) = inspect_checkpoint(root / "ct-nvfp4", layers=[0], tps=(1,), per_token=True)
    assert rep.plans[1]["trtllm"].plan["args"]["per_token_activation"] is True
    assert main(["inspect", str(root / "ct-nvfp4"), "--tp", "1,2", "--per-token"]) == 0
    assert "does not apply" not in capsys.readouterr().out
    (bf16,) = inspect_checkpoint(root / "olmoe", layers=[0], tps=(1,), per_token=True)
    assert "does not apply to bf16 weights" in bf16.tp[1]["trtllm"]


def test_expert_parallel_per_token_restores_the_source(root, tmp_path):
    family = NVFP4[0]
    out = convert_checkpoint(root / family, tmp_path / "ep", "trtllm", 2, "all", ep_size=2, per_token=True)
    for r in (0, 1):
        meta = read_kernel_metadata(out / f"rank-{r}")
        assert all(rec["plan"]["args"]["per_token_activation"] for rec in meta["layers"].values())
    back = all_tensors(restore_checkpoint(out, tmp_path / "back"))
    want = plus_unchanged(root / family, gen.file_tensors(family), gen.file_tensors(family), 0)
    assert sorted(back) == sorted(want) == sorted(all_tensors(root / family))
    for name, t in want.items():
        assert same_tensor(back[name], t.contiguous()), name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_distributed_per_token_writes_the_one_process_bytes(root, tmp_path, monkeypatch):
    from fimoe_lab.checkpoints.distributed import convert_distributed

    family = NVFP4[-1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    convert_distributed(root / family, tmp_path / "dist", "trtllm", 2, 1, per_token=True)
    one = convert_checkpoint(root / family, tmp_path / "one", "trtllm", 2, 1, per_token=True)
    got, want = all_tensors(tmp_path / "dist"), all_tensors(one)
    assert sorted(got) == sorted(want) and all(same_tensor(got[n], want[n]) for n in want)
    meta = read_kernel_metadata(tmp_path / "dist")
    assert meta["layers"] == read_kernel_metadata(one)["layers"]
    assert all(rec["plan"]["args"]["per_token_activation"] for rec in meta["layers"].values())
