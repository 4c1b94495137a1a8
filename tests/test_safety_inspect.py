"""``inspect`` flags every kind of bad scale: negative, NaN, Inf, zero and subnormal; reasons are whole.

Scales are planted into copies of the shipped samples by writing bytes at the offsets the shard's
own header gives (no fimoe_lab code writes them), then the CLI's report is read.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from fimoe_lab.checkpoints import Checkpoint, LayoutChoice, inspect_checkpoint
from fimoe_lab.checkpoints.inspect import backend_needs
from fimoe_lab.cli import main
from fimoe_lab.resources import sample_path


def plant(ck: Path, name: str, values: bytes) -> None:
    """Overwrite the first bytes of tensor ``name`` in whichever shard holds it."""
    for shard in ck.glob("*.safetensors"):
        raw = bytearray(shard.read_bytes())
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        if name in header:
            lo, hi = header[name]["data_offsets"]
            assert len(values) <= hi - lo
            raw[8 + n + lo : 8 + n + lo + len(values)] = values
            shard.write_bytes(bytes(raw))
            return
    raise AssertionError(name)


def report(ck: Path, capsys) -> str:
    capsys.readouterr()
    assert main(["inspect", str(ck), "--tp", "1"]) == 0
    return capsys.readouterr().out


def test_fp32_block_scales_negative_nan_inf_zero_subnormal(tmp_path, capsys):
    ck = tmp_path / "ck"
    shutil.copytree(sample_path("deepseek-v3-fp8"), ck)
    scales = np.array([-0.5, np.nan, np.inf, 0.0], dtype=np.float32).tobytes()
    plant(ck, "model.layers.1.mlp.experts.1.gate_proj.weight_scale_inv", scales)
    plant(ck, "model.layers.1.mlp.experts.2.up_proj.weight_scale_inv", np.array([1e-40], dtype=np.float32).tobytes())
    out = report(ck, capsys)
    assert "block scales: 1 negative, in experts [1]" in out
    assert "2 block scales are NaN/Inf, in experts [1]" in out
    assert "block scales are 0" in out
    assert "block scales: 1 subnormal" in out and "experts [2]" in out


def test_e4m3_block_scales_and_global_scales(tmp_path, capsys):
    ck = tmp_path / "ck"
    shutil.copytree(sample_path("deepseek-r1-nvfp4"), ck)
    with Checkpoint(ck) as c:
        prefix = c.prefix
    e = f"{prefix}0.mlp.experts."
    name = next(
        n
        for n in json.loads((ck / "model.safetensors.index.json").read_text())["weight_map"]
        if n.startswith(e + "3.") and n.endswith("down_proj.weight_scale")
    )
    plant(ck, name, bytes([0xB8, 0x01, 0x7F]))  # E4M3: -1.0, 2**-9 (subnormal), NaN
    plant(ck, f"{e}4.down_proj.weight_scale_2", np.array([-2.0], dtype=np.float32).tobytes())
    plant(ck, f"{e}5.down_proj.input_scale", np.array([1e-42], dtype=np.float32).tobytes())
    plant(ck, f"{e}6.down_proj.weight_scale_2", np.array([0.0], dtype=np.float32).tobytes())
    out = report(ck, capsys)
    assert "block scales: 1 negative, in experts [3]" in out
    assert "block scales: 1 subnormal (|s| < 0.0156" in out
    assert "NaN/Inf, in experts [3]" in out
    assert "w2_weight_scale_2: 1 negative, in experts [4]" in out
    assert "w2_input_scale: 1 subnormal" in out and "in experts [5]" in out
    assert "w2_weight_scale_2: zero in experts [6]" in out


def test_reasons_are_never_cut(tmp_path):
    with Checkpoint(sample_path("mixtral-bf16")) as c:
        layer = c.read_layer(c.moe_layers[0], 1, 0, load="none")
    for backend in ("trtllm", "cutlass"):
        text = backend_needs(layer, LayoutChoice(backend))
        assert "..." not in text
    reports = inspect_checkpoint(sample_path("mixtral-bf16"), None, (1, 3, 5, 7))
    for r in reports:
        for row in r.tp.values():
            for cell in row.values():
                assert not cell.endswith("..."), cell


@pytest.mark.parametrize("sample", ["qwen3-moe-bf16", "gpt-oss-mxfp4"])
def test_clean_samples_report_ok(sample, capsys):
    out = report(sample_path(sample), capsys)
    assert "negative" not in out and "subnormal" not in out
