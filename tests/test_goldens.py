"""Every case FlashInfer produced on a real GPU, reproduced byte for byte (CPU).

The golden set is read in fixtures (JSON + safetensors, never a pickle), not at import.
"""

import os

import pytest
import torch
from conftest import DEVICES

from fimoe_lab import goldens, prepare
from fimoe_lab.errors import FimoeError


@pytest.fixture(scope="module")
def golden_cases():
    paths = goldens.default_golden_paths()
    if not paths and not os.environ.get("CI"):
        pytest.skip("no golden files found (set FIMOE_GOLDENS or place shared/goldens beside the checkout)")
    assert paths, "CI must see ../shared/goldens"
    return [c for p in paths for c in goldens.load_cases(p)]


def test_goldens_are_present(golden_cases):
    assert len(golden_cases) >= 29
    assert len({c["name"] for c in golden_cases}) == len(golden_cases)


@pytest.mark.parametrize("device", DEVICES)
def test_golden_cases(golden_cases, device):
    results = [goldens.run_case(case, device) for case in golden_cases]
    failed = [f"{r.name}: {r.detail}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    exact = sum(r.detail == "byte-exact" for r in results)
    assert exact == sum(not c.get("error") for c in golden_cases) >= 28


def _case(cases, name):
    matches = [c for c in cases if c["name"] == name]
    if not matches:
        pytest.skip(f"golden {name} not present")
    return matches[0]


def test_reference_crash_case_equals_the_3d_path(golden_cases):
    """The reference crashes on flattened MXFP8 scales that need no padding; ours must give the
    3-D path's bytes, flattened back."""
    case = _case(golden_cases, "prepare_mxfp8_E2_I128_H256_flat1")
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


def test_a_changed_output_byte_is_caught(golden_cases):
    """The replay can fail: one flipped byte in a recorded output is reported with its count."""
    case = next(c for c in golden_cases if not c.get("error") and isinstance(c["outputs"][0], dict))
    ref = goldens.decode(case["outputs"][0])
    tampered = ref.clone()
    tampered.view(torch.uint8).reshape(-1)[ref.numel() * ref.element_size() // 2] ^= 0x5A
    bad = dict(case, outputs=[{"dtype": str(ref.dtype), "t": tampered}] + list(case["outputs"][1:]))
    result = goldens.run_case(bad)
    assert not result.ok and result.detail == f"output 0: 1 of {ref.numel() * ref.element_size()} bytes differ"


def test_pickled_golden_files_are_refused(tmp_path):
    pt = tmp_path / "goldens_public.pt"
    torch.save([{"name": "x"}], pt)
    with pytest.raises(FimoeError, match="not .pt") as info:
        goldens.load_cases(pt)
    assert "goldens_public.json" in info.value.fix and "goldens_public.safetensors" in info.value.fix


def test_hidden_alignment_table():
    assert prepare.trtllm_nvfp4_hidden_alignment(True, False) == 512
    assert {prepare.trtllm_nvfp4_hidden_alignment(a, b) for a, b in [(False, False), (False, True), (True, True)]} == {
        256
    }
