"""DESIGN §5's tactic facts, reproduced offline by the validity model (FlashInfer 0.6.13 kernels).

The model equals FlashInfer's recorded answers on every snapshot shape (test_tune_validity);
here: the facts DESIGN §5 states, asked the way the tuner asks (``TacticOracle(mode="model")``).
"""

import pytest
from tactic_snapshot import load_snapshot, snapshot_files

from fimoe_lab.tune.oracle import TacticOracle, TacticQuery

T = (1, 8, 64, 512, 4096, 16384)


@pytest.fixture(scope="module")
def o():
    return TacticOracle(mode="model")


def counts(o, *args, **kw):
    return [o.query(*args, tokens=t, **kw).count for t in T]


@pytest.mark.flashinfer  # the installed FlashInfer's version decides the answer
def test_model_source_names_flashinfer_and_kernel_set(o):
    t = o.kernel_table
    assert t is not None and t.flashinfer == "0.6.13"
    assert t.kernel_set.startswith("batched_gemm-91e0ba0-896b90b@")
    a = o.query("bf16", "swiglu", 2048, 768, 128, 8, 1)
    assert a.source == {"kind": "model", "file": t.path.name, "flashinfer": "0.6.13", "kernel_set": t.kernel_set}


@pytest.mark.parametrize("hidden, n", [(3072, 528), (2560, 352), (2816, 264), (2688, 176)])
def test_nvfp4_swiglu_per_token_hidden(o, hidden, n):
    # top_k 6, 128 experts, I=1920: the full space needs hidden % 1024
    assert counts(o, "nvfp4", "swiglu", hidden, 1920, 128, 6, per_token=True)[:3] == [n] * 3


def test_nvfp4_gated_needs_inter_multiple_of_64(o):
    assert counts(o, "nvfp4", "swiglu", 3072, 1872, 128, 6, per_token=True) == [0] * 6  # 16-aligned
    assert counts(o, "nvfp4", "swiglu", 3072, 1872, 128, 6) == [0] * 6
    assert min(counts(o, "nvfp4", "swiglu", 3072, 1856, 128, 6, per_token=True)) > 0  # 1856 = 29*64


def test_relu2_and_mxfp8_need_inter_multiple_of_128(o):
    assert counts(o, "nvfp4", "relu2", 3072, 1856, 128, 6) == [0] * 6
    assert min(counts(o, "nvfp4", "relu2", 3072, 1920, 128, 6)) > 0
    for act in ("swiglu", "relu2"):
        assert counts(o, "mxfp8", act, 3072, 1856, 128, 6) == [0] * 6
        assert min(counts(o, "mxfp8", act, 3072, 1920, 128, 6)) > 0


def test_no_per_token_nvfp4_for_non_gated(o):
    for i in (1792, 1920, 2048):
        a = o.query("nvfp4", "relu2", 3072, i, 128, 6, 8, per_token=True)
        assert a.count == 0 and "no kernel" in a.reason


def test_counts_fall_with_tokens_and_tiles_move(o):
    c = counts(o, "nvfp4", "swiglu", 3072, 1920, 128, 6, per_token=True)
    assert c == sorted(c, reverse=True) and c[0] > 50 * c[-1]
    assert set(o.query("nvfp4", "swiglu", 3072, 1920, 128, 6, 1, per_token=True).per_tile) == {8, 16, 32}
    assert set(o.query("nvfp4", "swiglu", 3072, 1920, 128, 6, 16384, per_token=True).per_tile) == {128, 256}


def test_bf16_384_has_half_of_512(o):
    a, b = o.query("bf16", "swiglu", 2048, 384, 128, 8, 8), o.query("bf16", "swiglu", 2048, 512, 128, 8, 8)
    assert 2 * a.count == b.count


def test_kernel_rejections_come_with_reason(o):
    a = o.query("fp8", "relu2", 1024, 1344, 512, 22, 8)
    assert a.count == 0 and "gated activations only" in a.reason
    a = o.query("fp8-block", "relu2", 2688, 1920, 128, 6, 8)
    assert a.count == 0 and "DeepSeekFp8 only supports" in a.reason


def test_geglu_only_in_nvfp4_without_per_token(o):
    # Gemma-4 (GeGLU): no bf16/fp8 kernels in the 0.6.13 set; NVFP4 (no per-token) has them
    assert o.query("bf16", "geglu", 2816, 768, 128, 8, 8).count == 0
    assert o.query("fp8", "geglu", 2816, 768, 128, 8, 8).count == 0
    assert o.query("nvfp4", "geglu", 2816, 768, 128, 8, 8).count > 0


def test_snapshot_fixture_keys_roundtrip():
    meta, entries = load_snapshot(snapshot_files()[-1])
    assert meta["flashinfer"] == "0.6.13" and meta["unknown"] == 0 and len(entries) > 5000
    for k in list(entries)[:200]:
        assert TacticQuery.from_key(k).normalized().key() == k
