"""Every case FlashInfer produced on a real GPU, reproduced byte for byte (CPU)."""

import os

import pytest
import torch

from fimoe_lab import goldens, prepare

from conftest import DEVICES

PATHS = goldens.default_golden_paths()
CASES = [c for p in PATHS for c in goldens.load_cases(p)]


def test_goldens_are_present():
    if not PATHS and not os.environ.get("CI"):
        pytest.skip("no golden files found (set FIMOE_GOLDENS or place shared/goldens beside the checkout)")
    assert PATHS, "CI must see ../shared/goldens"
    assert len(CASES) >= 29


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_golden_case(case, device):
    result = goldens.run_case(case, device)
    assert result.ok, f"{case['name']}: {result.detail}"


def _case(name):
    matches = [c for c in CASES if c["name"] == name]
    if not matches:
        pytest.skip(f"golden {name} not present")
    return matches[0]


def test_reference_crash_case_equals_the_3d_path():
    """The reference crashes on flattened MXFP8 scales that need no padding; ours must give the
    3-D path's bytes, flattened back."""
    case = _case("prepare_mxfp8_E2_I128_H256_flat1")
    assert case["error"]
    flat = goldens.call(case)
    case3d = dict(case, inputs=dict(case["inputs"]))
    for key in ("w13_scale", "w2_scale"):
        t = goldens.decode(case["inputs"][key])
        rows = 256
        case3d["inputs"][key] = {"dtype": "torch.uint8", "t": t.reshape(t.shape[0], rows, -1)}
    full = goldens.call(case3d)
    for a, b in zip(flat[:2], full[:2]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for a, b in zip(flat[2:4], full[2:4]):
        assert a.ndim == 2 and torch.equal(a, b.reshape(b.shape[0], -1))
    assert flat[4].tolist() == full[4].tolist() == [128, 256]


def test_hidden_alignment_table():
    assert prepare.trtllm_nvfp4_hidden_alignment(True, False) == 512
    assert {prepare.trtllm_nvfp4_hidden_alignment(a, b) for a, b in [(False, False), (False, True), (True, True)]} == {256}
