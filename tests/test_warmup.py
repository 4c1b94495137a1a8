"""``fimoe_lab.warmup`` and ``fimoe-lab warmup``: every map of the asked plans runs once, through the
executor the full layer picks, and the kernels it needs are then compiled in this process."""

from __future__ import annotations

import argparse
import importlib.util
import io

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fimoe_lab.cli import _common
from fimoe_lab.cli import warmup as cli_warmup
from fimoe_lab.errors import FimoeError, FormatError
from fimoe_lab.kernels import pick_backend
from fimoe_lab.recipes import plan_layer
from fimoe_lab.warmup import warm_experts, warmup

HAS_NUMBA = importlib.util.find_spec("numba") is not None


@given(st.integers(min_value=1, max_value=1 << 20))
def test_warm_experts_keeps_what_triton_specialises_on(experts):
    n = warm_experts(experts, torch.device("cuda"))
    assert 1 <= n <= 17
    assert (n == 1) == (experts == 1)
    assert (n % 16 == 0) == (experts % 16 == 0)
    assert warm_experts(experts, torch.device("cpu")) == 1


def test_warmup_runs_every_map_through_the_executor_the_layer_picks():
    hidden, inter, experts = 512, 256, 8
    runs = warmup(formats=["fp8", "mxfp8"], hidden=hidden, intermediate=inter, experts=experts)
    for fmt in ("fp8", "mxfp8"):
        plan = plan_layer(fmt, "trtllm", inter, hidden)
        for tensor, m in plan.maps().items():
            mine = [r for r in runs if r.fmt == fmt and r.tensor == tensor]
            assert [r.in_place for r in mine] == ([False, True] if m.is_permutation else [False])
            assert mine[0].executor == pick_backend("cpu", experts * m.out_bytes)
            assert all(r.device == "cpu" and r.backend == "trtllm" and r.seconds >= 0 for r in mine)


@pytest.mark.skipif(not HAS_NUMBA, reason="numba is not installed")
def test_warmup_leaves_the_numba_kernels_compiled():
    from fimoe_lab.kernels import numba_gather

    warmup(formats=["mxfp8"], hidden=1024, intermediate=256, experts=256)  # rows of 1 KB: the cycle plan
    assert numba_gather._gather_memcpy.signatures and numba_gather._swizzle.signatures
    assert numba_gather._cycle_tiles.signatures


def test_warmup_from_a_preset_uses_its_sizes_and_formats():
    from fimoe_lab.presets import get_preset

    runs = warmup(model="qwen3-30b-a3b", tp=2, in_place=False)
    assert {r.fmt for r in runs} == set(get_preset("qwen3-30b-a3b").checkpoint_formats)
    assert not any(r.in_place for r in runs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(hidden=512),
        dict(model="deepseek-v3", tp=0),
        dict(hidden=512, intermediate=256, formats=["nope"]),
        dict(hidden=512, intermediate=256, formats=["fp8"], backends=["nope"]),
        dict(hidden=512, intermediate=256),
        dict(model="nope"),
    ],
)
def test_bad_requests_are_one_fimoe_error(kwargs):
    with pytest.raises(FimoeError):
        warmup(**kwargs)


def _cli(argv):
    parser = argparse.ArgumentParser(prog="fimoe-lab")
    cli_warmup.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.handler(args)


def test_cli_warmup_prints_the_runs(capsys):
    assert _cli(["warmup", "--hidden", "512", "--inter", "256", "--format", "fp8", "--no-in-place"]) == 0
    out = capsys.readouterr().out
    # plan_layer's W13 (swap, interleave, shuffle) and W2, then the drop-ins' own W13 maps (the
    # engines swap, then rotate); the rotate's W2 is plan_layer's W2 (one object, run once)
    assert "fp8/trtllm/w13 on cpu" in out and "fp8/trtllm/rotate/w13 on cpu" in out and "warmed 4 runs" in out


def test_cli_warmup_json(capsys):
    assert _cli(["warmup", "--hidden", "512", "--inter", "256", "--format", "fp8", "--json"]) == 0
    import json

    doc = json.loads(capsys.readouterr().out)
    tensors = {r["tensor"] for r in doc["runs"]}
    assert tensors == {"w13", "w2", "swap_w13_to_w31/w13", "rotate/w13"} and doc["seconds"] >= 0


def test_cli_warmup_error_is_one_line():
    err = io.StringIO()
    with pytest.raises(FormatError) as info:
        _cli(["warmup", "--hidden", "512"])
    assert _common.report_error(info.value, "warmup", stream=err) == _common.EXIT_BAD_INPUT
    line = err.getvalue()
    assert line.count("\n") == 1 and line.startswith("error: warmup:") and "(fix:" in line
