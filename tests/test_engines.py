"""Engine profiles and the CUTLASS FP4 block-scale layout, against oracles written here.

The CUTLASS oracle is an independent formulation of what vLLM and SGLang do before
FlashInfer's CUTLASS MoE kernel: pad gate and up each to the padded intermediate (zeros),
swap them to [up; gate], then vLLM's ``swizzle_blockscale``: pad rows to 128 and columns to
4 with zeros, view as ``(E, M/128, 4, 32, K/4, 4)``, permute ``(0, 1, 4, 3, 2, 5)`` and
flatten back to ``(E, M, K)``.
"""

from __future__ import annotations

import pytest
import torch
from helpers import random_bytes
from hypothesis import given, settings
from hypothesis import strategies as st

from fimoe_lab import builders, engine_check, engines, recipes
from fimoe_lab.choice import LayoutChoice
from fimoe_lab.errors import FimoeError, LayoutError
from fimoe_lab.specs import FORMATS


def ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


def vllm_swizzle_blockscale(scale: torch.Tensor) -> torch.Tensor:
    """``(E, M, K)`` bytes -> ``(E, ceil128(M), ceil4(K))``, the engines' 128x4 reshape/permute."""
    e, m, k = scale.shape
    mp, kp = ceil_to(m, 128), ceil_to(k, 4)
    padded = torch.zeros((e, mp, kp), dtype=scale.dtype)
    padded[:, :m, :k] = scale
    tiles = padded.reshape(e, mp // 128, 4, 32, kp // 4, 4).permute(0, 1, 4, 3, 2, 5)
    return tiles.contiguous().reshape(e, mp, kp)


def pad_each(x: torch.Tensor, parts: int, rows: int, cols: int, fill: int = 0) -> torch.Tensor:
    """Pad each of ``parts`` stacked row blocks of ``x`` (E, parts*r, c) to ``rows`` rows and ``cols`` cols."""
    out = []
    for block in x.chunk(parts, dim=1):
        b = torch.full((x.shape[0], rows, cols), fill, dtype=x.dtype)
        b[:, : block.shape[1], : block.shape[2]] = block
        out.append(b)
    return torch.cat(out, dim=1)


def cutlass_fp4_reference(fmt: str, w13s: torch.Tensor, w2s: torch.Tensor, inter: int, hidden: int, gated: bool):
    """What vLLM/SGLang hand to the CUTLASS kernel as block scales: pad, swap, swizzle (per the loop above)."""
    block = FORMATS[fmt].scale_block
    ia, ha = recipes.default_alignments(fmt, "cutlass", gated, gated)
    ip, hp = ceil_to(inter, ia), ceil_to(hidden, ha)
    p = 2 if gated else 1
    a = pad_each(w13s, p, ip, hp // block)
    if gated:
        a = torch.cat([a[:, ip:], a[:, :ip]], dim=1)
    b = pad_each(w2s, 1, hp, ip // block)
    return vllm_swizzle_blockscale(a), vllm_swizzle_blockscale(b)


def planes(e: int, rows: int, cols: int) -> list[torch.Tensor]:
    """Structured scale bytes: four planes (row low, row high, column, expert; each + 1) that
    together name every element, so a misplaced byte shows in one of them."""
    r = torch.arange(rows)[None, :, None].expand(e, rows, cols)
    c = torch.arange(cols)[None, None, :].expand(e, rows, cols)
    x = torch.arange(e)[:, None, None].expand(e, rows, cols)
    return [((v % 255) + 1).to(torch.uint8) for v in (r, r // 255, c, x)]


SHAPES = [  # (format, per-rank intermediate, hidden, gated): TP shards and odd sizes
    ("nvfp4", 256, 512, True),
    ("nvfp4", 80, 7168, True),  # DeepSeek-R1-like shard (I 2048 / TP 8 would be 256; 80: a 4-way sample shard)
    ("nvfp4", 48, 96, True),  # fewer than 128 rows: the swizzle pads rows
    ("nvfp4", 1856 // 2, 2688, False),  # Nemotron-like, non-gated, TP 2
    ("nvfp4", 16, 16, True),  # one block each way
    ("mxfp4", 2880 // 8 // 32 * 32 + 32, 2880, True),  # gpt-oss shard, 32-aligned
    ("mxfp4", 64, 2880, True),
    ("mxfp4", 96, 160, False),
    ("mxfp4", 32, 32, True),
]


def _run(fmt: str, inter: int, hidden: int, gated: bool, w13s: torch.Tensor, w2s: torch.Tensor, engine=None):
    plan = recipes.plan_layer(fmt, "cutlass", inter, hidden, gated, gated, engine=engine)
    e, p = w13s.shape[0], 2 if gated else 1
    w13 = torch.zeros((e, p * inter, hidden // 2), dtype=torch.uint8)
    w2 = torch.zeros((e, hidden, inter // 2), dtype=torch.uint8)
    return plan, plan.apply(w13, w2, w13s, w2s)


FI074 = "flashinfer-0.7.4"  # its helpers pad nothing and refuse SHAPES[2] and SHAPES[7]: other sizes
ENGINE_SHAPES = (
    [(e, *SHAPES[i]) for e in engines.ENGINE_CHOICES if e != FI074 for i in (2, 7)]
    + [(FI074, *s) for s in (SHAPES[0], ("mxfp4", 128, 384, False))]
    + [(engines.DEFAULT_ENGINE, *s) for i, s in enumerate(SHAPES) if i not in (2, 7)]
)


@pytest.mark.parametrize("i,helper", [(2, "prepare_cutlass_nvfp4_weights"), (7, "prepare_cutlass_mxfp8_mxfp4_weights")])
def test_flashinfer_074_refuses_the_cutlass_fp4_sizes_its_helpers_refuse(i, helper):
    fmt, inter, hidden, gated = SHAPES[i]
    with pytest.raises(LayoutError, match=f"flashinfer-0.7.4: {fmt} on cutlass: .*{helper} refuses"):
        recipes.plan_layer(fmt, "cutlass", inter, hidden, gated, gated, engine=FI074)


@pytest.mark.parametrize("engine,fmt,inter,hidden,gated", ENGINE_SHAPES)
def test_cutlass_fp4_scales_are_128x4_swizzled_like_vllm(engine, fmt, inter, hidden, gated):
    """Every profile swizzles (two small shapes each); all shapes under the default profile."""
    block, p, e = FORMATS[fmt].scale_block, 2 if gated else 1, 2
    inputs = list(zip(planes(e, p * inter, hidden // block), planes(e, hidden, inter // block)))
    inputs.append(
        (
            random_bytes((e, p * inter, hidden // block), torch.uint8, seed=inter),
            random_bytes((e, hidden, inter // block), torch.uint8, seed=hidden),
        )
    )
    for w13s, w2s in inputs:
        plan, out = _run(fmt, inter, hidden, gated, w13s, w2s, engine)
        want13, want2 = cutlass_fp4_reference(fmt, w13s, w2s, inter, hidden, gated)
        assert torch.equal(out[2].reshape(want13.shape), want13)
        assert torch.equal(out[3].reshape(want2.shape), want2)
        back = plan.inverse().apply(*out)
        assert torch.equal(back[2], w13s) and torch.equal(back[3], w2s)


@settings(max_examples=20, deadline=None)
@given(
    fmt=st.sampled_from(["nvfp4", "mxfp4"]),
    inter_blocks=st.integers(1, 12),
    hidden_blocks=st.integers(1, 12),
    gated=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_cutlass_fp4_scales_random_shapes(fmt, inter_blocks, hidden_blocks, gated, seed):
    block, p = FORMATS[fmt].scale_block, 2 if gated else 1
    inter, hidden = inter_blocks * block, hidden_blocks * block
    w13s = random_bytes((2, p * inter, hidden // block), torch.uint8, seed=seed)
    w2s = random_bytes((2, hidden, inter // block), torch.uint8, seed=seed + 1)
    plan, out = _run(fmt, inter, hidden, gated, w13s, w2s)
    want13, want2 = cutlass_fp4_reference(fmt, w13s, w2s, inter, hidden, gated)
    assert torch.equal(out[2].reshape(want13.shape), want13)
    assert torch.equal(out[3].reshape(want2.shape), want2)
    back = plan.inverse().apply(*out)
    assert torch.equal(back[2], w13s) and torch.equal(back[3], w2s)


def test_legacy_profile_keeps_linear_cutlass_scales():
    """Files written before the fix recorded no engine; they rebuild with linear scales (swap only)."""
    plan = recipes.plan_layer("nvfp4", "cutlass", 256, 512, engine=engines.LEGACY_ENGINE)
    assert [s["kind"] for s in plan.w13_scale.spec()] == ["swap_w13_to_w31_rows"]
    assert plan.w2_scale is None
    new = recipes.plan_layer("nvfp4", "cutlass", 256, 512, engine="flashinfer-0.6.13")
    assert [s["kind"] for s in new.w13_scale.spec()] == ["swap_w13_to_w31_rows", "swizzle_scales_128x4"]


# ---------------------------------------------------------------------------- profiles
def test_profiles_table():
    assert engines.DEFAULT_ENGINE == "vllm-0.34" == engines.ENGINE_CHOICES[0]
    assert set(engines.ENGINE_CHOICES) == {"vllm-0.34", "sglang-0.5.23", "flashinfer-0.7.4", "flashinfer-0.6.13"}
    assert engines.LEGACY_ENGINE not in engines.ENGINE_CHOICES
    assert {n: p.flashinfer for n, p in engines.ENGINES.items() if p.choice} == {
        "vllm-0.34": "0.7.3",
        "sglang-0.5.23": "0.7.2",
        "flashinfer-0.7.4": "0.7.4",
        "flashinfer-0.6.13": "0.6.13",
    }
    with pytest.raises(FimoeError, match="unknown engine 'vllm-9'.*fix: choose one of vllm-0.34"):
        engines.get_engine("vllm-9")


@pytest.mark.parametrize(
    "engine,fmt,backend,gated,per_token,want",
    [
        ("flashinfer-0.6.13", "bf16", "trtllm", True, False, (64, 64)),
        ("vllm-0.34", "bf16", "trtllm", True, False, (128, 64)),
        ("flashinfer-0.6.13", "nvfp4", "trtllm", True, False, (64, 1)),
        ("vllm-0.34", "nvfp4", "trtllm", True, False, (64, 256)),
        ("vllm-0.34", "nvfp4", "trtllm", False, True, (128, 512)),
        ("vllm-0.34", "nvfp4", "trtllm", False, False, (128, 256)),
        ("sglang-0.5.23", "nvfp4", "trtllm", False, True, (128, 512)),
        ("sglang-0.5.23", "nvfp4", "trtllm", True, True, (64, 1)),
        ("sglang-0.5.23", "fp8", "cutlass", True, False, (128, 1)),
        ("vllm-0.34", "mxfp4", "trtllm", True, False, (128, 256)),
        ("sglang-0.5.23", "mxfp4", "trtllm", True, False, (128, 256)),
        ("vllm-0.34", "mxfp4", "cutlass", True, False, (128, 128)),
        ("vllm-0.34", "nvfp4", "cutlass", False, False, (128, 1)),
        ("vllm-0.34", "nvfp4", "cutlass", True, False, (16, 1)),
        ("flashinfer-0.7.4", "mxfp8", "trtllm", True, False, (1, 1)),
        ("flashinfer-0.7.4", "fp8", "trtllm", False, False, (1, 1)),
        ("flashinfer-0.7.4", "nvfp4", "trtllm", True, False, (1, 1)),
    ],
)
def test_default_alignments_per_engine(engine, fmt, backend, gated, per_token, want):
    assert recipes.default_alignments(fmt, backend, gated, gated, engine, per_token) == want


def test_vllm_pads_gpt_oss_to_2944_by_3072():
    """vLLM 0.34's ``mxfp4_round_up_hidden_size_and_intermediate_size`` for TRT-LLM: I to 128, H to 256."""
    plan = recipes.plan_layer("mxfp4", "trtllm", 2880, 2880, engine="vllm-0.34")
    assert (plan.padded_intermediate, plan.padded_hidden) == (2944, 3072)
    assert (
        recipes.plan_layer(
            "nvfp4", "trtllm", 640, 2688, False, False, engine="vllm-0.34", per_token_activation=True
        ).padded_hidden
        == 3072
    )
    assert recipes.plan_layer("bf16", "trtllm", 1856 // 2, 2688, engine="vllm-0.34").padded_intermediate == 1024


@pytest.mark.parametrize(
    "engine,fmt,fill",
    [("flashinfer-0.7.4", "nvfp4", 0x38), ("flashinfer-0.7.4", "mxfp4", 127), ("vllm-0.34", "nvfp4", 0)],
)
def test_padded_fp4_scale_bytes_per_engine(engine, fmt, fill):
    """Padded TRT-LLM FP4 scales carry the profile's byte: FlashInfer 0.7.x's neutral 1.0, vLLM's 0 (padding asked
    for: FlashInfer 0.7.4's own helpers pad nothing)."""
    block, inter, hidden = FORMATS[fmt].scale_block, 96, 512
    plan = recipes.plan_layer(fmt, "trtllm", inter, hidden, intermediate_alignment=128, engine=engine)
    ip = plan.padded_intermediate
    assert ip > inter
    w13s = random_bytes((1, 2 * inter, hidden // block), torch.uint8, seed=3) | 1  # no zero bytes
    w2s = random_bytes((1, hidden, inter // block), torch.uint8, seed=4) | 1
    w13 = torch.ones((1, 2 * inter, hidden // 2), dtype=torch.uint8)
    w2 = torch.ones((1, hidden, inter // 2), dtype=torch.uint8)
    out = plan.apply(w13, w2, w13s, w2s)
    # the padding adds (ip - inter) scale columns to each of w2's rows: count the fill bytes among them
    padded_w2_bytes = hidden * (ip - inter) // block
    assert int((out[3] == fill).sum()) >= padded_w2_bytes
    assert torch.equal(plan.inverse().apply(*out)[3], w2s)


def test_sglang_mxfp8_pad_scales_are_zero():
    plan = recipes.plan_layer("mxfp8", "trtllm", 96, 256, engine="sglang-0.5.23")
    fills = {s["params"].get("fill") for s in plan.w2_scale.spec() if s["kind"] == "pad_projections"}
    assert fills == {0}
    vllm = recipes.plan_layer("mxfp8", "trtllm", 96, 256, engine="vllm-0.34")
    assert {s["params"].get("fill") for s in vllm.w2_scale.spec() if s["kind"] == "pad_projections"} == {127}


def test_plan_records_rebuild_with_their_engine():
    from fimoe_lab.checkpoints.plan_choice import build_plan, plan_args
    from fimoe_lab.checkpoints.reader import MoELayer

    w13, w2 = torch.zeros(1, 2 * 928, 2688, dtype=torch.bfloat16), torch.zeros(1, 2688, 928, dtype=torch.bfloat16)
    layer = MoELayer("bf16", w13, w2, None, None, 928, 2688)
    for engine in engines.ENGINE_CHOICES:  # I 928 padded to 64 (FlashInfer 0.7.4's helper pads nothing)
        rec = plan_args(layer, LayoutChoice("trtllm", 64, engine=engine))
        assert rec["args"]["engine"] == engine
        assert build_plan(rec) == recipes.plan_layer(
            "bf16", "trtllm", 928, 2688, intermediate_alignment=64, engine=engine
        )
    old = plan_args(layer, LayoutChoice("trtllm", engine="vllm-0.34"))
    del old["args"]["engine"]
    assert build_plan(old) == recipes.plan_layer("bf16", "trtllm", 928, 2688, engine=engines.LEGACY_ENGINE)
    bad = plan_args(layer, LayoutChoice("trtllm", engine="vllm-0.34"))
    bad["args"]["engine"] = "vllm-9"
    with pytest.raises(FimoeError, match="unknown engine profile 'vllm-9'"):
        build_plan(bad)


# ---------------------------------------------------------------------------- 0.7.x drop-ins
def pad_loop(t: torch.Tensor, parts: int, rows: int, cols: int, fill: int) -> torch.Tensor:
    """Expert by expert, block by block: each of ``parts`` row blocks padded to ``rows`` x ``cols``."""
    e, r, c = t.shape
    out = torch.full((e, parts * rows, cols), fill, dtype=torch.uint8)
    per = r // parts
    for x in range(e):
        for b in range(parts):
            out[x, b * rows : b * rows + per, :c] = t[x, b * per : (b + 1) * per]
    return out


PAD_CASES = [  # (intermediate, hidden, gated, epb, sf, hidden_alignment, intermediate_alignment)
    (1856 // 2, 2688, True, 2, 16, 512, 128),  # Nemotron Nano TP2, NVFP4
    (1856, 2688, False, 2, 16, 512, 128),
    (2880 // 2, 2880, True, 2, 32, 512, 128),  # gpt-oss TP2, MXFP4
    (96, 160, True, 1, 32, 256, 256),  # MXFP8 (one byte per value)
    (128, 512, True, 2, 16, 512, 128),  # aligned: nothing to pad
]


@pytest.mark.parametrize("inter,hidden,gated,epb,sf,ha,ia", PAD_CASES)
def test_pad_trtllm_moe_weights_against_a_loop(inter, hidden, gated, epb, sf, ha, ia):
    from fimoe_lab.prepare import pad_trtllm_moe_weights

    p, e = 2 if gated else 1, 2
    g1 = random_bytes((e, p * inter, hidden // epb), torch.uint8, seed=1)
    s1 = random_bytes((e, p * inter, hidden // sf), torch.uint8, seed=2)
    g2 = random_bytes((e, hidden, inter // epb), torch.uint8, seed=3)
    s2 = random_bytes((e, hidden, inter // sf), torch.uint8, seed=4)
    got = pad_trtllm_moe_weights(
        g1, s1, g2, s2, hidden, inter, is_gated_act=gated, hidden_alignment=ha, intermediate_alignment=ia
    )
    ip, hp, h2, fill = ceil_to(inter, ia), ceil_to(hidden, ha), ceil_to(hidden, 128), 127 if sf == 32 else 0x38
    assert (got.hidden_size, got.intermediate_size, got.valid_hidden_size, got.valid_intermediate_size) == (
        hp,
        ip,
        hidden,
        inter,
    )
    assert torch.equal(got.gemm1_weights.view(torch.uint8), pad_loop(g1, p, ip, hp // epb, 0))
    assert torch.equal(got.gemm1_weights_scale.view(torch.uint8), pad_loop(s1, p, ip, hp // sf, fill))
    assert torch.equal(got.gemm2_weights.view(torch.uint8), pad_loop(g2, 1, h2, ip // epb, 0))
    assert torch.equal(got.gemm2_weights_scale.view(torch.uint8), pad_loop(s2, 1, h2, ip // sf, fill))


def test_pad_trtllm_moe_weights_refuses_bad_alignment():
    from fimoe_lab.prepare import pad_trtllm_moe_weights

    g1, s1 = torch.ones(1, 256, 256, dtype=torch.uint8), torch.ones(1, 256, 32, dtype=torch.uint8)
    g2, s2 = torch.ones(1, 512, 64, dtype=torch.uint8), torch.ones(1, 512, 8, dtype=torch.uint8)
    with pytest.raises(FimoeError, match="pad_trtllm_moe_weights: .*multiples of 128"):
        pad_trtllm_moe_weights(g1, s1, g2, s2, 512, 128, hidden_alignment=64)


@pytest.mark.parametrize(
    "inter,hidden,gated,align", [(256, 2688, True, 256), (928, 2688, False, 512), (64, 512, True, 256)]
)
def test_align_fp4_moe_hidden_dim_for_fi_against_a_loop(inter, hidden, gated, align):
    from fimoe_lab.prepare import align_fp4_moe_hidden_dim_for_fi

    p, e = 2 if gated else 1, 3
    w13 = random_bytes((e, p * inter, hidden // 2), torch.uint8, seed=5)
    w13s = random_bytes((e, p * inter, hidden // 16), torch.uint8, seed=6)
    w2 = random_bytes((e, hidden, inter // 2), torch.uint8, seed=7)
    w2s = random_bytes((e, hidden, inter // 16), torch.uint8, seed=8)
    o13, o13s, o2, o2s, hp = align_fp4_moe_hidden_dim_for_fi(w13, w13s, w2, w2s, align)
    assert hp == ceil_to(hidden, align)
    assert torch.equal(o13, pad_loop(w13, 1, p * inter, hp // 2, 0))
    assert torch.equal(o13s, pad_loop(w13s, 1, p * inter, hp // 16, 0))
    assert torch.equal(o2, pad_loop(w2, 1, hp, inter // 2, 0))
    assert torch.equal(o2s, pad_loop(w2s, 1, hp, inter // 16, 0))


# ---------------------------------------------------------------------------- CuTe-DSL gated FC1 interleave
def group_interleave_loop(x: torch.Tensor, group: int) -> torch.Tensor:
    """Row by row: output row (2j + h) * group + r is row (h * G + j) * group + r of its half."""
    rows = x.shape[1]
    g = rows // (2 * group)
    out = torch.empty_like(x)
    for j in range(g):
        for h in range(2):
            for r in range(group):
                out[:, (2 * j + h) * group + r] = x[:, (h * g + j) * group + r]
    return out


@settings(max_examples=25, deadline=None)
@given(groups=st.integers(1, 6), group=st.sampled_from([1, 2, 16, 64]), cols=st.integers(1, 40))
def test_interleave_row_groups_against_a_loop(groups, group, cols):
    from fimoe_lab import steps
    from fimoe_lab.kernels import EXECUTORS, available_backends, execute

    rows = 2 * group * groups
    m = steps.interleave_row_groups(rows, cols, group)
    for x in (
        random_bytes((3, rows, cols), torch.uint8, seed=rows + cols),
        (torch.arange(rows)[None, :, None] % 251 + 1).expand(3, rows, cols).to(torch.uint8).contiguous(),
    ):
        want = group_interleave_loop(x, group)
        assert torch.equal(m.apply(x), want)
        assert torch.equal(m.inverse().apply(want), x)
        for backend in available_backends("cpu"):
            assert EXECUTORS[backend].available(torch.device("cpu"))
            out = torch.empty_like(x)
            execute(m.compiled(), x, out, backend=backend)
            assert torch.equal(out, want), backend
    assert steps.build(m.kind, m.params) == m
    if group == 1:
        assert m == steps.interleave_rows_for_gated_act(rows, cols)


def test_cute_dsl_drop_ins():
    from fimoe_lab.prepare import deinterleave_gated_rows, interleave_cute_dsl_moe_weights

    w = random_bytes((2, 256, 48), torch.uint8, seed=11)
    s = random_bytes((2, 256, 6), torch.uint8, seed=12)
    for swap_ab, group in ((False, 64), (True, 16)):
        ow, os_ = interleave_cute_dsl_moe_weights(w, s, swap_ab)
        assert torch.equal(ow, group_interleave_loop(w, group))
        assert torch.equal(os_, group_interleave_loop(s, group))
        assert torch.equal(deinterleave_gated_rows(ow[1], group), w[1])
    with pytest.raises(FimoeError, match="interleave_cute_dsl_moe_weights: .*not a multiple of 2 x 64"):
        interleave_cute_dsl_moe_weights(w[:, :192], s[:, :192])


# ---------------------------------------------------------------------------- 8x4 scale layout
def swizzle_8x4_reference(scale: torch.Tensor) -> torch.Tensor:
    """``(E, R, C)`` -> ``(E, ceil8(R), ceil4(C))``: pad with zeros, view ``(E, R/8, 8, C/4, 4)``,
    permute ``(0, 1, 3, 2, 4)`` (8x4 atoms row-major, K tiles fastest)."""
    e, r, c = scale.shape
    rp, cp = ceil_to(r, 8), ceil_to(c, 4)
    padded = torch.zeros((e, rp, cp), dtype=scale.dtype)
    padded[:, :r, :c] = scale
    return padded.reshape(e, rp // 8, 8, cp // 4, 4).permute(0, 1, 3, 2, 4).contiguous().reshape(e, rp, cp)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 70), cols=st.integers(1, 30))
def test_swizzle_scales_8x4_against_the_atom_permute(rows, cols):
    from fimoe_lab import steps
    from fimoe_lab.kernels import available_backends, execute

    m = steps.swizzle_scales_8x4(rows, cols)
    for x in [*planes(2, rows, cols)[:3], random_bytes((2, rows, cols), torch.uint8, seed=rows * cols)]:
        want = swizzle_8x4_reference(x)
        assert torch.equal(m.apply(x), want)
        assert torch.equal(m.inverse().apply(want), x)
        for backend in available_backends("cpu"):
            out = torch.empty_like(want)
            execute(m.compiled(), x, out, backend=backend)
            assert torch.equal(out, want), backend
    assert steps.build(m.kind, m.params) == m


# ---------------------------------------------------------------------------- SM90 mixed-input scale folding
def fold_reference(scales: torch.Tensor, group: int) -> torch.Tensor:
    """Scale by scale: ``(a*64 + s*F + f, k*S + g) -> [a, k, f, s*S + g]`` (loops, no reshape)."""
    e, rows, cols = scales.shape
    per16, per_k = 16 // scales.element_size(), 128 // group
    slices = per16 // per_k
    folded = 64 // slices
    out = torch.empty((e, rows // 64, cols // per_k, folded, per16), dtype=scales.dtype)
    for r in range(rows):
        a, s, f = r // 64, (r % 64) // folded, r % folded
        for c in range(cols):
            out[:, a, c // per_k, f, s * per_k + c % per_k] = scales[:, r, c]
    return out


@pytest.mark.parametrize(
    "rows,cols,dtype,group", [(64, 4, torch.uint8, 32), (192, 12, torch.uint8, 32), (128, 3, torch.bfloat16, 128)]
)
def test_sm90_mixed_scale_folding_against_a_loop(rows, cols, dtype, group):
    from fimoe_lab.prepare import interleave_moe_scales_for_sm90_mixed_gemm

    x = random_bytes((2, rows, cols), dtype, seed=rows + cols)
    got = interleave_moe_scales_for_sm90_mixed_gemm(x, group)
    want = fold_reference(x, group)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    from fimoe_lab import steps

    m = steps.fold_scales_sm90_mixed(rows, cols, x.element_size(), group)
    assert torch.equal(m.inverse().apply(m.apply(x.view(torch.uint8))), x.view(torch.uint8))
    with pytest.raises(FimoeError, match="rows % 64 == 0"):
        interleave_moe_scales_for_sm90_mixed_gemm(x[:, :32], group)


# ----------------------------------------------------------------------------- the engine-layout check
@settings(max_examples=25, deadline=None)
@given(
    engine=st.sampled_from(sorted(engines.ENGINES)),
    fmt=st.sampled_from(["nvfp4", "mxfp4", "mxfp8"]),
    inter_blocks=st.integers(1, 10),
    hidden_blocks=st.integers(1, 10),
    gated=st.booleans(),
)
def test_engine_check_accepts_every_profiles_cutlass_scales(engine, fmt, inter_blocks, hidden_blocks, gated):
    block = FORMATS[fmt].scale_block
    try:
        plan = recipes.plan_layer(
            fmt, "cutlass", inter_blocks * block, hidden_blocks * block, gated, gated, engine=engine
        )
    except LayoutError as exc:  # FlashInfer 0.7.4's CUTLASS helpers refuse sizes that are not multiples of 64 / 128
        assert engine == FI074 and "refuses" in exc.message
        return
    assert engine_check.check_plan_scales(fmt, plan, gated, 2, engine)


@pytest.mark.parametrize(
    ("fmt", "written_with"), [("nvfp4", "fimoe-legacy"), ("mxfp4", "fimoe-legacy"), ("mxfp8", "flashinfer-0.6.13")]
)
def test_engine_check_catches_linear_scales(fmt, written_with):
    """The check sees what the round trip cannot: scales left linear are not the 0.7.x engines' layout."""
    plan = recipes.plan_layer(fmt, "cutlass", 128, 256, engine=written_with)
    assert engine_check.check_plan_scales(fmt, plan, True, 2, written_with)
    assert not engine_check.check_plan_scales(fmt, plan, True, 2, "vllm-0.34")


def test_engine_layout_formula_places_each_scale_by_the_documented_offset():
    """(r, c) -> (r//128)*(K/4)*512 + (c//4)*512 + (r%32)*16 + ((r%128)//32)*4 + c%4, checked element by element."""
    rows, cols = 200, 6
    codes = torch.arange(rows * cols, dtype=torch.int64).reshape(1, rows, cols)
    lo = (codes % 251 + 1).to(torch.uint8)  # bytes that name (r, c) together with hi
    hi = (codes // 251 + 1).to(torch.uint8)
    m, k = 256, 8
    for plane, ref in ((lo, codes % 251 + 1), (hi, codes // 251 + 1)):
        out = engine_check.cutlass_scale_layout(plane, 1, rows, cols, 0, True).reshape(-1)
        for r in range(rows):
            for c in range(cols):
                at = (r // 128) * (k // 4) * 512 + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
                assert out[at] == ref[0, r, c]
        assert out.numel() == m * k


@pytest.mark.parametrize(
    ("engine", "swizzled", "padded"), [("vllm-0.34", True, (128, 256)), ("flashinfer-0.6.13", False, (96, 160))]
)
def test_mxfp8_cutlass_scales_per_profile(engine, swizzled, padded):
    """FlashInfer 0.7.x's CUTLASS MXFP8 MoE reads 128x4-swizzled scales of H, I padded to 128."""
    plan = recipes.plan_layer("mxfp8", "cutlass", 96, 160, engine=engine)
    assert (plan.padded_intermediate, plan.padded_hidden) == padded
    kinds = [s.kind for s in plan.w13_scale.steps]
    assert ("swizzle_scales_128x4" in kinds) is swizzled
    assert engine_check.check_plan_scales("mxfp8", plan, True, 2, engine)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp8"])
def test_sglang_keeps_gate_and_up_in_checkpoint_order_on_trtllm(fmt):
    """SGLang 0.5.23 interleaves [gate; up] as loaded (no W31 swap) for BF16, FP8 and MXFP8 on TRT-LLM."""
    for engine, swapped in (("sglang-0.5.23", False), ("vllm-0.34", True)):
        plan = recipes.plan_layer(fmt, "trtllm", 128, 256, engine=engine)
        kinds = [s.kind for s in plan.w13.steps]
        assert ("swap_w13_to_w31_rows" in kinds) is swapped, (engine, kinds)
        assert "interleave_rows_for_gated_act" in kinds


def test_vllm_mxfp8_cutlass_drop_in_pads_nothing_and_keeps_scales_linear():
    """vLLM's ``prepare_fp8_moe_layer_for_fi`` (MXFP8, not TRT-LLM) only swaps; the 0.7.x recipe differs."""
    plan = builders.plan_mxfp8(96, 160, True, True, False, 5, 3)
    assert (plan.padded_intermediate, plan.padded_hidden) == (96, 160)
    assert [s.kind for s in plan.w13_scale.steps] == ["swap_w13_to_w31_rows"] and plan.w2_scale is None


def test_sglang_hands_deepseek_fp8_to_trtllm_unshuffled():
    """SGLang 0.5.23's runner calls trtllm_fp8_block_scale_moe with use_shuffled_weight=False for DeepSeek FP8."""
    plan = recipes.plan_layer("fp8-block", "trtllm", 256, 512, engine="sglang-0.5.23")
    assert plan.maps() == {} and (plan.padded_intermediate, plan.padded_hidden) == (256, 512)
    assert "block_major_k" in [s.kind for s in recipes.plan_layer("fp8-block", "trtllm", 256, 512).w13.steps]


@pytest.mark.parametrize("engine", engines.ENGINE_CHOICES)
@pytest.mark.parametrize("fmt,backend", [tuple(r.split("/")) for r in recipes.RECIPES if not r.startswith("mxint4")])
def test_an_alignment_of_1_pads_nothing_or_refuses_naming_the_kernels_need(engine, fmt, backend):
    """``intermediate_alignment=1, hidden_alignment=1``: the plan keeps (I, H), or one LayoutError that says
    which multiple the kernel layout needs (FP8 per-tensor non-gated used to pad to 128 regardless)."""
    block = FORMATS[fmt].scale_block or 1
    for inter, hidden, gated in ((5 * block, 7 * block, False), (160, 256, False), (96, 384, True), (256, 512, True)):
        try:
            plan = recipes.plan_layer(fmt, backend, inter, hidden, gated, gated, 1, 1, engine=engine)
        except LayoutError as exc:
            assert "multiple of" in exc.message, exc.message
            continue
        assert (plan.padded_intermediate, plan.padded_hidden) == (inter, hidden)


def test_fp8_non_gated_alignment_1_pads_nothing_or_is_refused_naming_the_128():
    """An FP8 per-tensor alignment given is no longer raised to 16 / 128 behind the caller's back: FlashInfer
    0.7.4's helpers take I 160 non-gated as it is, the engines that pad to 128 refuse it naming the need."""
    for backend in ("trtllm", "cutlass"):
        plan = recipes.plan_layer("fp8", backend, 160, 256, False, False, 1, engine=FI074)
        assert plan.padded_intermediate == 160
        for engine in ("vllm-0.34", "sglang-0.5.23", "flashinfer-0.6.13"):
            with pytest.raises(LayoutError, match=r"intermediate 160 is not a multiple of 128: FlashInfer's FP8"):
                recipes.plan_layer("fp8", backend, 160, 256, False, False, 1, engine=engine)
            assert (
                recipes.plan_layer("fp8", backend, 160, 256, False, False, 128, engine=engine).padded_intermediate
                == 256
            )
        assert recipes.plan_layer("fp8", backend, 160, 256, False, False).padded_intermediate == 256


def test_convert_records_the_checkpoints_quantization_method_and_rebuilds_with_it():
    """SGLang 0.5.23 hands its TRT-LLM kernel ModelOpt FP8 layers' W13 as [up; gate] and plain FP8 layers' as
    [gate; up]: the plan record carries the convention's method, so convert and restore agree with it."""
    from fimoe_lab.checkpoints.plan_choice import build_plan, plan_args
    from fimoe_lab.checkpoints.reader import MoELayer

    w13, w2 = torch.zeros(1, 2 * 256, 128, dtype=torch.uint8), torch.zeros(1, 128, 256, dtype=torch.uint8)
    layer = MoELayer("fp8", w13, w2, None, None, 256, 128, convention="modelopt-fp8")
    rec = plan_args(layer, LayoutChoice("trtllm", engine="sglang-0.5.23"))
    assert rec["args"]["quant_method"] == "modelopt"
    modelopt = build_plan(rec)
    assert modelopt == recipes.plan_layer("fp8", "trtllm", 256, 128, engine="sglang-0.5.23", quant_method="modelopt")
    assert [s["kind"] for s in modelopt.w13.spec()][0] == "swap_w13_to_w31_rows"
    del rec["args"]["quant_method"]  # a record without it: the format's rule (SGLang's Fp8MoEMethod keeps [gate; up])
    assert "swap_w13_to_w31_rows" not in [s["kind"] for s in build_plan(rec).w13.spec()]
    variant = MoELayer("fp8-block", w13, w2, None, None, 256, 128, convention="ct-fp8-block:scale=BF16")
    assert plan_args(variant, LayoutChoice("trtllm"))["args"]["quant_method"] == "compressed-tensors"
    assert (
        "quant_method" not in plan_args(MoELayer("bf16", w13, w2, None, None, 256, 128), LayoutChoice("trtllm"))["args"]
    )
    for bad, error in ((5, "is not a method name"), ("gptq", "unknown quantization method 'gptq'")):
        with pytest.raises(FimoeError, match=error):
            build_plan({**rec, "args": {**rec["args"], "quant_method": bad}})


def test_sglang_refuses_compressed_tensors_fp8_per_tensor_in_one_line():
    with pytest.raises(FimoeError, match="sglang-0.5.23 prepares no FlashInfer trtllm layout for compressed-tensors"):
        recipes.plan_layer("fp8", "trtllm", 256, 128, engine="sglang-0.5.23", quant_method="compressed-tensors")
    recipes.plan_layer("fp8", "trtllm", 256, 128, engine="vllm-0.34", quant_method="compressed-tensors")
