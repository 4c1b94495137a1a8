"""The lab reads a checkpoint lazily: one expert at a time, bit-exact with the core's reader, caches bounded
in bytes and shared by every spelling of the same checkpoint."""

from __future__ import annotations

import re
import shutil
import time

import numpy as np
import pytest
import torch

from fimoe_lab import resources
from fimoe_lab.checkpoints import Checkpoint, open_checkpoint
from fimoe_lab.viz import data, sources
from tests.helpers import same_bytes, spy_calls

pytestmark = pytest.mark.skipif(not resources.sample_names(), reason="sample checkpoints are not in this checkout")

CASES = [("deepseek-r1-nvfp4", 1, 0), ("deepseek-v3-fp8", 1, 0), ("gpt-oss-mxfp4", 1, 0), ("deepseek-r1-nvfp4", 2, 1)]


@pytest.mark.parametrize(("name", "tp", "rank"), CASES)
def test_one_expert_is_byte_identical_to_the_core_reader(name, tp, rank):
    """Each expert the lab reads (its four tensors and extras) equals that expert of the core's whole-layer read,
    and its magnitudes equal those of the layer held in memory (the same decoding of the same bytes)."""
    path = resources.sample_path(name)
    layer = sources.load_layer(str(path), None, tp, rank)
    ckpt = open_checkpoint(path)
    whole = ckpt.read_layer(ckpt.moe_layers[0], tp, rank)
    eager = sources.ExpertTensors(whole, "in memory")
    assert layer.lazy and layer.experts == whole.num_experts and layer.intermediate == whole.intermediate
    for e in (0, whole.num_experts - 1):
        one = layer.expert(e)
        for key, t in whole.tensors().items():
            assert same_bytes(one.tensors()[key], None if t is None else t[e : e + 1])
        for key, t in whole.extras.items():
            assert same_bytes(one.extras[key], t[e : e + 1] if t.ndim and t.shape[0] == whole.num_experts else t)
        for tensor in layer.tensors:
            assert np.array_equal(layer.magnitude(tensor, e), eager.magnitude(tensor, e), equal_nan=True)
    assert layer.plan("cutlass").maps().keys() == eager.plan("cutlass").maps().keys()


def test_loading_reads_no_expert_and_every_spelling_shares_one_layer(tmp_path, monkeypatch):
    """Opening checks the headers and reads no tensor; another spelling of the path (trailing slash, a symlink,
    a shard file) gives the same object, whose expert reads land once in the shared cache."""
    src = resources.sample_path("deepseek-r1-nvfp4")
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    (tmp_path / "link").symlink_to(path)
    reads = spy_calls(monkeypatch, [(Checkpoint, "_read")])
    layer = sources.load_layer(str(path))
    assert reads == [] and layer._whole is None
    for spelling in (f"{path}/", str(tmp_path / "link"), str(path / "model-00001-of-00001.safetensors")):
        assert sources.load_layer(spelling) is layer
    assert sources.load_layer(str(path), None, 2, 0) is not layer  # another TP slice: other bytes
    cache = data.BoundedCache(1 << 30)
    monkeypatch.setattr(sources, "_EXPERTS", cache)
    layer.magnitude("w13", 3)
    sources.load_layer(f"{path}/").magnitude("w2", 3)  # the same expert, another tensor: no second read
    assert len(cache.entries) == 1 and layer._whole is None
    assert reads  # the expert was read, once


def test_cache_is_bounded_in_bytes_and_keeps_the_newest():
    """Past its limit the least recently used entries go; the newest stays even when alone over the limit."""
    cache = data.BoundedCache(3000)
    for k in range(4):
        cache.get(k, lambda: np.zeros(1000, np.uint8))
    assert list(cache.entries) == [1, 2, 3] and cache.bytes == 3000
    cache.get(1, lambda: pytest.fail("kept"))
    cache.get("big", lambda: torch.zeros(5000, dtype=torch.uint8))
    assert list(cache.entries) == ["big"] and cache.bytes == 5000
    assert data.nbytes(np.broadcast_to(np.False_, (100, 100))) == 0
    assert data.nbytes(torch.empty((10, 10), device="meta")) == 0


@pytest.mark.parametrize("bad", ["missing-dir", "notes.txt", "empty-dir"])
def test_a_wrong_path_fails_fast_with_one_line(tmp_path, bad):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    (tmp_path / "empty-dir").mkdir()
    t = time.perf_counter()
    with pytest.raises((OSError, ValueError)) as err:
        sources.load_layer(str(tmp_path / bad))
    assert time.perf_counter() - t < 0.5 and "\n" not in str(err.value) and "config.json" in str(err.value)


def test_the_path_box_opens_once_per_checkpoint_and_reports_its_reads(tmp_path):
    """Two spellings of one directory give one menu entry; the progress line says what was opened and, after a
    redraw that read an expert, its bytes and rate; the controls are enabled again after the load."""
    from fimoe_lab.viz import widgets

    path = tmp_path / "ckpt"
    shutil.copytree(resources.sample_path("deepseek-r1-nvfp4"), path)
    w = widgets.RowExplorer()
    before = len(w.source.options)
    w.load(str(path))
    assert "opened" in w.progress.value and "each view reads one expert" in w.progress.value
    w.load(f"{path}/./")
    assert len(w.source.options) == before + 1 and w.state["layer"].lazy
    w.expert.value = 5
    assert re.search(r"read expert 5 of .*: [\d.]+ MB in [\d.]+ s \(\d+ MB/s\)", w.progress.value)
    assert not any(c.disabled for c in (w.source, w.backend, w.tensor, w.expert)) and not w.path.disabled
    w.load(str(tmp_path / "missing"))
    assert "layer not changed" in w.message.value and w.state["layer"].lazy and not w.tensor.disabled


def test_the_diagnosis_reads_only_the_experts_it_compares(tmp_path):
    """The diagnose explorer's inputs: the first experts of the checkpoint and of the dump, byte-identical to those
    of the whole reads; the diagnosis of them equals the diagnosis of the whole layer and dump (the core's)."""
    from safetensors.torch import save_file

    from fimoe_lab import diagnose
    from fimoe_lab.viz import widgets

    path = str(tmp_path / "r1")  # a copy: no other test has read this layer whole
    shutil.copytree(resources.sample_path("deepseek-r1-nvfp4"), path)
    ckpt = open_checkpoint(path)
    whole = ckpt.read_layer(ckpt.moe_layers[0])
    plan = sources.ExpertTensors(whole, "in memory").plan("trtllm")
    wrong = plan.w2_scale.apply(whole.w2_scale)[:3]  # another expert count: ignored by both
    dump = {"w13_weight_scale": plan.w13_scale.apply(whole.w13_scale), "w2_weight_scale": wrong, "step": torch.ones(())}
    save_file({k: v.contiguous() for k, v in dump.items()}, str(tmp_path / "d.safetensors"))
    layer = sources.load_layer(path)
    for count in (2, diagnose.DEFAULT_EXPERTS):
        moe, dumped = sources.diagnosis_inputs(layer, tmp_path / "d.safetensors", count)
        assert layer._whole is None  # the whole layer was never read
        assert moe.num_experts == min(count, whole.num_experts) and layer.last_read[0] == 0
        for key, t in whole.tensors().items():
            assert same_bytes(moe.tensors()[key], t[:count])
        assert same_bytes(dumped["w13_weight_scale"], dump["w13_weight_scale"][:count])
        assert dumped["w2_weight_scale"].shape[0] == 0 and float(dumped["step"]) == 1.0
        mine = diagnose.diagnose(moe, dumped)
        core = diagnose.diagnose(whole, diagnose.load_dump(tmp_path / "d.safetensors"), experts=range(moe.num_experts))
        assert (
            mine.summary() == core.summary() and "w2_weight_scale" in core.ignored and "w2_weight_scale" in mine.ignored
        )
        assert mine.tensors["w13_scale"].ranked == core.tensors["w13_scale"].ranked
    w = widgets.DiagnoseExplorer(path, str(tmp_path / "d.safetensors"))
    assert w.figure is not None and "#d33" not in w.message.value
    core = diagnose.diagnose(whole, diagnose.load_dump(tmp_path / "d.safetensors"), source=path)
    assert w.state["diagnosis"].summary() == core.summary()
    scope: dict = {}
    exec(w.code(), scope)
    assert scope["result"].tensors["w13_scale"].ranked == core.tensors["w13_scale"].ranked
