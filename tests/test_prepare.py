"""Drop-in functions vs a per-expert reference loop, on random and structured inputs."""

from types import SimpleNamespace

import pytest
import reference_loops as ref
import torch
from conftest import DEVICES
from helpers import coords, decode, random_bytes, same_bytes, spy_calls
from hypothesis import given, settings
from hypothesis import strategies as st

from fimoe_lab import prepare
from fimoe_lab.caches import clear_caches
from fimoe_lab.errors import FimoeError
from fimoe_lab.layout import LayoutError
from fimoe_lab.prepare import MoELayerSpec

FP8 = torch.float8_e4m3fn


def vllm_layer(intermediate, hidden, act_and_mul=True, gated=True, block=None):
    cfg = SimpleNamespace(is_act_and_mul=act_and_mul, intermediate_size_per_partition=intermediate, hidden_dim=hidden)
    return SimpleNamespace(moe_config=cfg, activation=SimpleNamespace(is_gated=gated), weight_block_size=block)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gated", [True, False])
def test_rotate_fp8_per_tensor_in_place_matches_loop(device, gated):
    w13 = random_bytes((3, 128, 64), FP8, seed=1, device=device)
    w2 = random_bytes((3, 64, 64), FP8, seed=2, device=device)
    exp13, exp2 = ref.rotate_fp8(w13.cpu(), w2.cpu(), gated)
    ptr, alias = w13.data_ptr(), w13.view(torch.uint8)
    assert prepare.rotate_weights_for_fi_trtllm_fp8_per_tensor_moe(w13, w2, gated) is None
    assert w13.data_ptr() == ptr and same_bytes(alias, w13)  # in its storage: CUDA graphs keep the address
    assert same_bytes(w13.cpu(), exp13) and same_bytes(w2.cpu(), exp2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gated", [True, False])
def test_bf16_block_layout_in_place_matches_loop_and_inverts(device, gated):
    w13 = coords(2, 128, 64, device).view(torch.bfloat16)  # (2, 128, 128) bf16
    w2 = random_bytes((2, 128, 64), torch.bfloat16, seed=4, device=device)
    exp13, exp2 = ref.bf16_block_layout(w13.cpu().clone(), w2.cpu().clone(), gated)
    before13 = w13.clone()
    o13, o2 = prepare.convert_moe_weights_to_flashinfer_trtllm_block_layout({}, w13, w2, gated, scratch_experts=1)
    assert o13.shape == (2, 2, 128, 64) and o2.shape == (2, 1, 128, 64)
    assert o13.data_ptr() == w13.data_ptr()
    assert same_bytes(o13.cpu(), exp13) and same_bytes(o2.cpu(), exp2)
    plan = prepare.plan_trtllm_bf16_block_layout(128, 128, 64, gated)
    assert same_bytes(plan.inverse().apply(o13, o2)[0], before13)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_block_layout_fills_each_layers_permute_dict_from_one_device_copy(device):
    """Every layer's dict gets FlashInfer's row indices (W13 without the swap: interleave then shuffle, or the
    shuffle alone when not gated; W2: the shuffle), the same device tensor for every layer of one shape."""
    dicts = {gated: [{}, {}] for gated in (True, False)}
    for gated, pair in dicts.items():
        for seed, cache in enumerate(pair):
            w13 = random_bytes((2, 128, 64), torch.bfloat16, seed=seed, device=device)
            w2 = random_bytes((2, 64, 64), torch.bfloat16, seed=seed + 7, device=device)
            prepare.convert_moe_weights_to_flashinfer_trtllm_block_layout(cache, w13, w2, gated)
    shuffle13, shuffle2, inter = ref.shuffle_idx(128, 128), ref.shuffle_idx(64, 128), ref.interleave_idx(128)
    for gated, (first, second) in dicts.items():
        (k13, i13), (k2, i2) = first.items()
        assert k13[0] == "w3_w1" and k2[0] == "w2" and i13.device.type == torch.device(device).type
        want13 = [inter[r] for r in shuffle13] if gated else shuffle13
        assert i13.cpu().tolist() == want13 and i2.cpu().tolist() == shuffle2
        assert second[k13] is i13 and second[k2] is i2
    (g13, _), (n13, _) = (list(dicts[g][0].values()) for g in (True, False))
    assert g13 is not n13 and not torch.equal(g13, n13)  # same shapes, other maps: not mixed up


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_block_layout_refuses_an_unknown_engine_before_moving_a_byte(device):
    """The dict's keys follow ``engine``'s FlashInfer: an unknown one is refused before either weight is permuted
    (the dict is filled after the permutation) and the dict stays empty."""
    w13 = coords(2, 128, 64, device).view(torch.bfloat16)
    w2 = random_bytes((2, 128, 64), torch.bfloat16, seed=5, device=device)
    before13, before2, cache = w13.clone(), w2.clone(), {}
    with pytest.raises(FimoeError, match="unknown engine 'vllm-9'"):
        prepare.convert_moe_weights_to_flashinfer_trtllm_block_layout(cache, w13, w2, engine="vllm-9")
    assert same_bytes(w13, before13) and same_bytes(w2, before2) and cache == {}


def test_bf16_block_layout_structured_rows():
    """Decoding a coordinate tensor shows swap + interleave + shuffle + K blocks."""
    w13 = coords(1, 128, 64).view(torch.bfloat16)  # (1, 128, 128) bf16: I = 64, H = 128
    w2 = coords(1, 128, 32).view(torch.bfloat16)  # (1, 128, 64) bf16
    o13, _ = prepare.convert_moe_weights_to_flashinfer_trtllm_block_layout({}, w13, w2, True)
    got = decode(o13.contiguous(), 128, 64)  # (1, 2 K-blocks, 128 rows, 32 words, 3)
    shuffled = ref.shuffle_idx(128, 128)
    inter = ref.interleave_idx(128)
    for out_row in range(128):
        want = (inter[shuffled[out_row]] + 64) % 128
        assert (got[0, :, out_row, :, 1] == want).all()
    assert (got[0, 1, :, 0, 2] == 32).all()  # second 128-byte block starts at word 32


@pytest.mark.parametrize("gated", [True, False])
def test_mxfp8_shuffle_matches_loop_flat_and_3d(gated):
    rows13 = 256 if gated else 128
    w13 = random_bytes((2, rows13, 256), FP8, seed=5)
    w2 = random_bytes((2, 256, 128), FP8, seed=6)
    s13 = random_bytes((2, rows13, 8), torch.uint8, seed=7)
    s2 = random_bytes((2, 256, 4), torch.uint8, seed=8)
    expected = ref.mxfp8_shuffle(w13, w2, s13, s2, gated)
    got = prepare.shuffle_mxfp8_moe_weights(w13, w2, s13, s2, gated)
    assert all(same_bytes(a, b) for a, b in zip(got, expected))
    flat = prepare.shuffle_mxfp8_moe_weights(w13, w2, s13.reshape(2, -1), s2.reshape(2, -1), gated)
    assert flat[2].shape == (2, rows13 * 8)
    assert torch.equal(flat[2], expected[2].reshape(2, -1)) and torch.equal(flat[3], expected[3].reshape(2, -1))


def test_deepseek_shuffle_matches_loop():
    w13 = random_bytes((2, 256, 256), FP8, seed=9)
    w2 = random_bytes((2, 256, 128), FP8, seed=10)
    e13, e2 = ref.deepseek_shuffle(w13, w2)
    o13, o2 = prepare.shuffle_deepseek_fp8_moe_weights(w13, w2)
    assert o13.dtype == FP8 and same_bytes(o13, e13) and same_bytes(o2, e2)


def test_nvfp4_plan_matches_loop():
    i, h = 128, 256
    w13 = random_bytes((2, 2 * i, h // 2), torch.uint8, seed=11)
    w2 = random_bytes((2, h, i // 2), torch.uint8, seed=12)
    s13 = random_bytes((2, 2 * i, h // 16), FP8, seed=13)
    s2 = random_bytes((2, h, i // 16), FP8, seed=14)
    expected = ref.nvfp4_trtllm(w13, w2, s13, s2, True)
    got = prepare.plan_fp4_trtllm_weights(i, h).apply(w13, w2, s13, s2)
    assert all(same_bytes(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("device", DEVICES)
def test_a_plan_checks_each_kind_of_input_once_and_every_new_kind_again(device, monkeypatch):
    """A layer plan keeps its checked calls per shape, dtype, device and contiguity of its inputs: a second layer like
    the first is not checked again and matches the loop; another expert count, dtype spelling (flattened scales) or a
    non-contiguous tensor of the same shape is a new kind, checked (and refused) before anything runs."""
    i, h = 128, 256
    clear_caches()  # a plan of its own: none of its calls kept by an earlier test
    plan = prepare.plan_fp4_trtllm_weights(i, h)
    seen = spy_calls(monkeypatch, [(type(plan), "check")])

    def layer(experts, seed, flat=False):
        s13 = random_bytes((experts, 2 * i, h // 16), FP8, seed=seed + 2)
        s2 = random_bytes((experts, h, i // 16), FP8, seed=seed + 3)
        if flat:
            s13, s2 = s13.reshape(experts, -1), s2.reshape(experts, -1)
        return (
            random_bytes((experts, 2 * i, h // 2), torch.uint8, seed=seed),
            coords(experts, h, i // 8, "cpu").view(torch.uint8),  # bytes that encode their own coordinates
            s13,
            s2,
        )

    for n, (experts, seed, flat) in enumerate([(2, 1, False), (2, 5, False), (3, 9, False), (3, 13, True)]):
        given_ = layer(experts, seed, flat)
        expected = ref.nvfp4_trtllm(*(t.reshape(experts, *r) for t, r in zip(given_, _nvfp4_rows(i, h))), True)
        got = plan.apply(*(t.to(device) for t in given_))
        if flat:
            expected = [e.reshape(experts, -1) if k >= 2 else e for k, e in enumerate(expected)]
        assert all(same_bytes(a.cpu(), b) for a, b in zip(got, expected))
        assert len(seen) == [1, 1, 2, 3][n]
    w13, w2, s13, s2 = (t.to(device) for t in layer(3, 17))
    bad = w13.transpose(1, 2).contiguous().transpose(1, 2)  # the same shape and dtype, not contiguous
    with pytest.raises(LayoutError, match="not contiguous"):
        plan.apply(bad, w2, s13, s2)
    with pytest.raises(LayoutError, match="expert counts differ"):
        plan.apply(w13, w2[:2], s13, s2)
    assert len(seen) == 5


def _nvfp4_rows(i: int, h: int) -> list[tuple[int, ...]]:
    """The per-expert shapes of an NVFP4 layer's weights and scales (bytes of packed FP4, FP8 scales)."""
    return [(2 * i, h // 2), (h, i // 2), (2 * i, h // 16), (h, i // 16)]


@settings(max_examples=25, deadline=None)
@given(
    intermediate=st.integers(1, 40).map(lambda k: 8 * k),
    hidden=st.sampled_from([64, 128, 160, 256, 384]),
    act_and_mul=st.booleans(),
    trtllm=st.booleans(),
)
def test_fp8_per_tensor_prepare_matches_loop_and_inverts(intermediate, hidden, act_and_mul, trtllm):
    gated = act_and_mul
    p = 2 if act_and_mul else 1
    if trtllm and hidden % 32:
        return
    w13 = random_bytes((2, p * intermediate, hidden), FP8, seed=intermediate)
    w2 = random_bytes((2, hidden, intermediate), FP8, seed=hidden)
    scale = torch.rand(2) + 0.5
    layer = vllm_layer(intermediate, hidden, act_and_mul, gated)
    o13, o2, s13, s2 = prepare.prepare_fp8_moe_layer_for_fi(layer, w13, w2, scale, scale[:1], scale, scale[:1], trtllm)
    align = 16 if gated else 128
    ip = -(-intermediate // align) * align
    e13 = ref.pad(w13, p, ip, hidden)
    e13 = ref.swap(e13) if act_and_mul else e13
    e2 = ref.pad(w2, 1, hidden, ip)
    if trtllm:
        e13, e2 = ref.rotate_fp8(e13, e2, gated)
    assert same_bytes(o13, e13) and same_bytes(o2, e2)
    assert s13 is scale and layer.moe_config.intermediate_size_per_partition == ip
    plan = prepare.plan_fp8_moe_layer(
        MoELayerSpec(intermediate, hidden, act_and_mul, gated), w13, w2, scale, scale, trtllm
    )
    back13, back2, _, _ = plan.inverse().apply(o13, o2)
    assert same_bytes(back13, w13) and same_bytes(back2, w2)


@settings(max_examples=15, deadline=None)
@given(
    intermediate=st.sampled_from([32, 64, 96, 128, 160, 256]),
    hidden=st.sampled_from([64, 160, 256, 320]),
    act_and_mul=st.booleans(),
    flat=st.booleans(),
)
def test_mxfp8_trtllm_prepare_matches_loop_and_inverts(intermediate, hidden, act_and_mul, flat):
    p = 2 if act_and_mul else 1
    w13 = random_bytes((2, p * intermediate, hidden), FP8, seed=1)
    w2 = random_bytes((2, hidden, intermediate), FP8, seed=2)
    s13 = random_bytes((2, p * intermediate, hidden // 32), torch.uint8, seed=3)
    s2 = random_bytes((2, hidden, intermediate // 32), torch.uint8, seed=4)
    layer = vllm_layer(intermediate, hidden, act_and_mul, act_and_mul, [1, 32])
    args = (s13.reshape(2, -1), s2.reshape(2, -1)) if flat else (s13, s2)
    o13, o2, os13, os2 = prepare.prepare_fp8_moe_layer_for_fi(layer, w13, w2, args[0], None, args[1], None, True)
    ip, hp = -(-intermediate // 128) * 128, -(-hidden // 256) * 256
    assert (layer.moe_config.intermediate_size_per_partition, layer.moe_config.hidden_dim) == (ip, hp)
    e13, e2 = ref.pad(w13, p, ip, hp), ref.pad(w2, 1, hp, ip)
    es13, es2 = ref.pad(s13, p, ip, hp // 32, 127), ref.pad(s2, 1, hp, ip // 32, 127)
    if act_and_mul:
        e13, es13 = ref.swap(e13), ref.swap(es13)
    expected = ref.mxfp8_shuffle(e13, e2, es13, es2, act_and_mul)
    got = (o13, o2, os13.reshape(expected[2].shape), os2.reshape(expected[3].shape))
    assert all(same_bytes(a, b) for a, b in zip(got, expected))
    assert (os13.ndim == 2) == flat
    spec = MoELayerSpec(intermediate, hidden, act_and_mul, act_and_mul, [1, 32])
    plan = prepare.plan_fp8_moe_layer(spec, w13, w2, s13, s2, True)
    back = plan.inverse().apply(o13, o2, os13.reshape(expected[2].shape), os2.reshape(expected[3].shape))
    assert all(same_bytes(a, b) for a, b in zip(back, (w13, w2, s13, s2)))


@pytest.mark.parametrize("trtllm", [True, False])
def test_deepseek_prepare_swaps_scales_and_clamps_dead_experts(trtllm):
    w13 = random_bytes((2, 256, 256), FP8, seed=1)
    w2 = random_bytes((2, 256, 128), FP8, seed=2)
    s13 = torch.rand(2, 2, 2) + 0.1
    s13[1] = 1e-23  # a dead expert
    s2 = torch.rand(2, 2, 1) + 0.1
    s2_before = s2.clone()
    layer = vllm_layer(128, 256, block=[128, 128])
    o13, o2, os13, os2 = prepare.prepare_fp8_moe_layer_for_fi(layer, w13, w2, s13, None, s2, None, trtllm)
    expected_s13 = ref.swap(s13).clamp(min=1e-10)
    assert torch.equal(os13, expected_s13) and (os13[1] == 1e-10).all()
    assert torch.equal(s2, s2_before), "inputs are not modified"
    e13 = ref.swap(w13)
    if trtllm:
        e13, e2 = ref.deepseek_shuffle(e13, w2)
        assert same_bytes(o2, e2)
    assert same_bytes(o13, e13)


def test_structured_swap_is_visible():
    """A [gate; up] coordinate tensor shows up rows first after the swap: the check a random test cannot make."""
    x = coords(2, 16, 4)
    got = decode(prepare.swap_w13_to_w31(x), 16, 4)
    assert (got[:, :8, :, 1] >= 8).all() and (got[:, 8:, :, 1] < 8).all()
    assert same_bytes(prepare.swap_w13_to_w31(prepare.swap_w13_to_w31(x)), x)


def test_align_gated_pads_gate_and_up_separately():
    x = coords(1, 2 * 17, 16)  # int32 elements: I = 17, H = 16
    w2 = coords(1, 16, 17)
    o13, o2, ip = prepare.align_moe_weights_for_fi(x, w2, True, 16)
    assert ip == 32 and o13.shape == (1, 64, 16) and o2.shape == (1, 16, 32)
    got = decode(o13, 34, 16)
    assert (got[0, :17, :, 1] == torch.arange(17)[:, None]).all()
    assert (got[0, 17:32] == -1).all(), "gate padding"
    assert (got[0, 32:49, :, 1] == torch.arange(17, 34)[:, None]).all(), "up starts at the padded half"
    assert (got[0, 49:] == -1).all()


# ------------------------------------------------------------------ bad input
def test_bad_inputs_raise_errors_that_name_the_constraint():
    w13 = random_bytes((2, 128, 64), FP8)
    w2 = random_bytes((2, 64, 64), FP8)
    with pytest.raises(LayoutError, match="bfloat16"):
        prepare.convert_moe_weights_to_flashinfer_trtllm_block_layout({}, w13, w2)
    with pytest.raises(LayoutError, match="implies"):
        prepare.align_moe_weights_for_fi(w13[:, :100], w2, True)
    with pytest.raises(LayoutError, match="not a multiple of 32"):
        prepare.rotate_weights_for_fi_trtllm_fp8_per_tensor_moe(random_bytes((2, 80, 64), FP8), w2, True)
    with pytest.raises(LayoutError, match="1-byte|FP8"):
        prepare.rotate_weights_for_fi_trtllm_fp8_per_tensor_moe(w13.view(torch.uint8).to(torch.bfloat16), w2, True)
    with pytest.raises(LayoutError, match="not contiguous"):
        prepare.align_moe_weights_for_fi(w13.transpose(1, 2).contiguous().transpose(1, 2)[:, :, :], w2, True, 128)
    with pytest.raises(LayoutError, match="rows"):
        prepare.shuffle_mxfp8_moe_weights(
            random_bytes((2, 256, 256), FP8),
            random_bytes((2, 256, 128), FP8),
            random_bytes((2, 250, 8), torch.uint8),
            random_bytes((2, 256, 4), torch.uint8),
            True,
        )
    with pytest.raises(LayoutError, match="UE8M0"):
        prepare.align_mxfp8_moe_weights_for_fi_trtllm(
            random_bytes((2, 192, 160), FP8),
            random_bytes((2, 160, 96), FP8),
            torch.ones(2, 192, 5),
            torch.ones(2, 160, 3),
            True,
            128,
            256,
        )
    with pytest.raises(LayoutError, match="one scale per 16"):
        prepare.align_fp4_moe_weights_for_fi(
            random_bytes((2, 352, 64), torch.uint8),
            random_bytes((2, 352, 9), FP8),
            random_bytes((2, 128, 88), torch.uint8),
            random_bytes((2, 128, 11), FP8),
            True,
            64,
        )
    with pytest.raises(LayoutError, match="moe_config"):
        prepare.prepare_fp8_moe_layer_for_fi(object(), w13, w2, torch.ones(2), None, torch.ones(2), None)
    with pytest.raises(LayoutError, match="input_scale"):
        prepare.prepare_fp8_moe_layer_for_fi(
            vllm_layer(64, 64), w13, w2, torch.ones(2), None, torch.ones(2), None, True
        )


@pytest.mark.gpu
def test_mixed_devices_are_refused():
    w13 = random_bytes((2, 128, 64), FP8, device="cuda")
    w2 = random_bytes((2, 64, 64), FP8)
    with pytest.raises(LayoutError, match="different devices"):
        prepare.align_moe_weights_for_fi(w13, w2, True, 128)


def test_failed_in_place_call_leaves_inputs_intact():
    w13 = random_bytes((3, 128, 128), torch.bfloat16, seed=1)
    bad_w2 = random_bytes((3, 128, 48), torch.bfloat16, seed=2)  # 96 bytes: not a multiple of the 128-byte K block
    before13, before2 = w13.clone(), bad_w2.clone()
    with pytest.raises(LayoutError, match="128-byte block"):
        prepare.convert_moe_weights_to_flashinfer_trtllm_block_layout({}, w13, bad_w2)
    assert same_bytes(w13, before13) and same_bytes(bad_w2, before2)
    g1 = random_bytes((2, 128, 64), FP8, seed=3)
    g2 = random_bytes((2, 64, 48), FP8, seed=4).transpose(1, 2)  # non-contiguous
    b1 = g1.clone()
    with pytest.raises(LayoutError):
        prepare.rotate_weights_for_fi_trtllm_fp8_per_tensor_moe(g1, g2, True)
    assert same_bytes(g1, b1)


@pytest.mark.parametrize("flat", [False, True])
def test_mxfp8_cutlass_path_swaps_weights_and_scales(flat):
    """The reference clamps UE8M0 (uint8) scales with a float minimum and raises; ours swaps and keeps the bytes."""
    w13 = random_bytes((2, 256, 256), FP8, seed=1)
    w2 = random_bytes((2, 256, 128), FP8, seed=2)
    s13 = random_bytes((2, 256, 8), torch.uint8, seed=3)
    s2 = random_bytes((2, 256, 4), torch.uint8, seed=4)
    args = (s13.reshape(2, -1), s2.reshape(2, -1)) if flat else (s13, s2)
    o13, o2, os13, os2 = prepare.prepare_fp8_moe_layer_for_fi(
        vllm_layer(128, 256, block=[1, 32]), w13, w2, args[0], None, args[1], None, False
    )
    assert same_bytes(o13, ref.swap(w13)) and same_bytes(o2, w2)
    assert torch.equal(os13.reshape(2, 256, 8), ref.swap(s13)) and torch.equal(os2.reshape(2, 256, 4), s2)
    assert (os13.ndim == 2) == flat


def test_plan_layer_refuses_sizes_that_split_a_scale_block():
    with pytest.raises(LayoutError, match="intermediate 100 is not a multiple of 16"):
        prepare.plan_layer("nvfp4", "trtllm", 100, 256)
    with pytest.raises(LayoutError, match="hidden 2880 is not a multiple of 32|hidden 2890 is not a multiple of 32"):
        prepare.plan_layer("mxfp4", "cutlass", 2880, 2890)
    with pytest.raises(LayoutError, match="unknown format 'int4'"):
        prepare.plan_layer("int4", "trtllm", 128, 256)


@pytest.mark.parametrize("gated", [True, False])
def test_in_place_drop_in_is_all_or_nothing_when_the_second_tensor_fails(monkeypatch, gated):
    """gemm1 is already shuffled when gemm2's transform fails midway: both come back as they were."""
    from fimoe_lab.kernels import torch_gather

    real = torch_gather._strided_copy  # both maps are strided: the torch in-place strategy copies back through it
    w13, w2 = random_bytes((4, 128, 64), FP8, seed=3), random_bytes((4, 64, 128), FP8, seed=4)
    before = (w13.clone(), w2.clone())
    state = {"w2_calls": 0}

    def flaky(out, src):
        if out.untyped_storage().data_ptr() == w2.untyped_storage().data_ptr():  # writing into w2
            state["w2_calls"] += 1
            if state["w2_calls"] == 2:
                out.fill_(0)  # a half-written chunk
                raise MemoryError("injected")
        return real(out, src)

    monkeypatch.setattr(torch_gather, "_strided_copy", flaky)
    with pytest.raises(Exception) as info:
        prepare.rotate_weights_for_fi_trtllm_fp8_per_tensor_moe(w13, w2, gated, scratch_experts=1)
    assert "injected" in repr(info.value.__cause__) or "injected" in str(info.value)
    assert state["w2_calls"] >= 2 and same_bytes(w13, before[0]) and same_bytes(w2, before[1])


def test_in_place_drop_in_refuses_tensors_that_share_memory():
    w = random_bytes((4, 128, 64), FP8, seed=5)
    with pytest.raises(LayoutError, match="share memory"):
        prepare.rotate_weights_for_fi_trtllm_fp8_per_tensor_moe(w, w.view(4, 64, 128), False)


def _hot_path_calls():
    """Named functions a drop-in's warm call must not reach: each builds or scans a map (ms to
    hundreds of ms on a full expert, paid before the first kernel launches)."""
    from fimoe_lab import compile as compile_mod
    from fimoe_lab.kernels import cycles
    from fimoe_lab.layout import IndexMap

    return [
        (IndexMap, "_find_row_sources"),
        (IndexMap, "_leading_row_steps"),
        (IndexMap, "refined"),
        (IndexMap, "then"),
        (compile_mod, "compile_map"),
        (cycles, "plan_permutation"),
        (cycles, "cycle_order"),
    ]


WARM_DROP_INS = {
    "rotate": lambda: prepare.rotate_weights_for_fi_trtllm_fp8_per_tensor_moe(
        random_bytes((2, 128, 64), FP8, seed=1), random_bytes((2, 64, 64), FP8, seed=2), True
    ),
    "deepseek": lambda: prepare.shuffle_deepseek_fp8_moe_weights(
        random_bytes((2, 256, 128), FP8, seed=3), random_bytes((2, 128, 128), FP8, seed=4)
    ),
    "mxfp8": lambda: prepare.shuffle_mxfp8_moe_weights(
        random_bytes((2, 512, 256), FP8, seed=5),
        random_bytes((2, 256, 256), FP8, seed=6),
        random_bytes((2, 512, 8), torch.uint8, seed=7),
        random_bytes((2, 256, 8), torch.uint8, seed=8),
        True,
    ),
    "bf16_block": lambda: prepare.convert_moe_weights_to_flashinfer_trtllm_block_layout(
        {},
        random_bytes((2, 256, 128), torch.uint8, seed=9).view(torch.bfloat16),
        random_bytes((2, 64, 256), torch.uint8, seed=10).view(torch.bfloat16),
    ),
}


@pytest.mark.parametrize("name", sorted(WARM_DROP_INS))
def test_warm_drop_in_call_builds_and_scans_no_map(name, monkeypatch):
    """The second call of a drop-in on a shape finds every map, plan and cycle plan in the caches;
    the first call does build them (so the spies see the functions the drop-in uses)."""
    seen = spy_calls(monkeypatch, _hot_path_calls())
    from fimoe_lab.caches import clear_caches

    clear_caches()
    WARM_DROP_INS[name]()
    assert seen, "the first call built nothing: the spies miss the drop-in's path"
    seen.clear()
    WARM_DROP_INS[name]()
    assert seen == [], f"a warm {name} call reached {sorted(set(seen))}"


@settings(max_examples=40, deadline=None)
@given(
    experts=st.integers(1, 4),
    half=st.integers(1, 40),
    cols=st.integers(1, 9),
    dtype=st.sampled_from([torch.int32, torch.bfloat16, torch.uint8, torch.float32]),
    structured=st.booleans(),
)
def test_permute_in_place_swaps_halves_of_any_dtype(experts, half, cols, dtype, structured):
    """``permute_in_place`` with the W13/W31 swap on tensors of any element size (vLLM's MXINT4 reorder passes int32
    weights and bfloat16 scales): each expert's two halves of rows swapped, against ``torch.cat`` of the halves,
    the tensor itself changed (same storage, dtype and shape)."""
    from fimoe_lab import steps

    item = torch.empty((), dtype=dtype).element_size()
    # each row 4 * cols * item bytes: the structured rows' int32 codes name their expert, row and column
    shape = (experts, 2 * half, 4 * cols)
    if structured:
        t = coords(experts, 2 * half, cols * item).view(dtype).reshape(shape)
    else:
        t = random_bytes(shape, dtype, seed=half)
    want = torch.cat([t[:, half:], t[:, :half]], dim=1).clone()
    ptr = t.data_ptr()
    prepare.permute_in_place([(steps.swap_w13_to_w31_rows(2 * half, 4 * cols * item), t, "t")])
    assert t.data_ptr() == ptr and t.dtype == dtype and t.shape == shape
    assert same_bytes(t, want)
