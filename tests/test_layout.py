"""The IndexMap algebra: apply, compose, inverse, coarsen, provenance, equality."""

import pytest
import torch
from conftest import DEVICES
from helpers import coords, decode, random_bytes, same_bytes, spy_calls
from hypothesis import given, settings
from hypothesis import strategies as st

from fimoe_lab import steps
from fimoe_lab.layout import IndexMap, LayoutError, compose


def per_expert_gather(m: IndexMap, x: torch.Tensor) -> torch.Tensor:
    """Reference: loop over experts and output bytes through the byte-level source table."""
    src = m.source_bytes().reshape(-1)
    xb = x.contiguous().view(torch.uint8).reshape(x.shape[0], -1)
    fill = m.refined(1)
    fill_values = torch.tensor(list(m.fills) or [0], dtype=torch.uint8)[(-1 - fill.src).clamp(min=0)]
    outs = []
    for e in range(x.shape[0]):
        row = torch.where(src >= 0, xb[e][src.clamp(min=0)], fill_values)
        outs.append(row)
    return torch.stack(outs)


def gated_chain(rows, cols, etm):
    return compose(
        steps.pad_projections(2, rows // 2, rows // 2, cols, cols),
        steps.swap_w13_to_w31_rows(rows, cols),
        steps.interleave_rows_for_gated_act(rows, cols),
        steps.shuffle_rows_for_epilogue(rows, cols, etm),
    )


@pytest.mark.parametrize("device", DEVICES)
def test_apply_matches_per_expert_loop_on_random_and_structured(device):
    m = compose(
        steps.pad_projections(2, 40, 48, 96, 128, fill=7),
        steps.swap_w13_to_w31_rows(96, 128),
        steps.shuffle_rows_for_epilogue(96, 128, 64),
        steps.block_major_k(96, 128, 64),
    )
    for x in (
        random_bytes((3, 80, 96), torch.uint8, seed=1, device=device),
        coords(3, 80, 24, device).view(torch.uint8),
    ):
        out = m.apply(x)
        assert out.shape == (3, 2, 96, 64)
        assert torch.equal(out.view(3, -1).cpu(), per_expert_gather(m, x.cpu()))


def test_structured_w13_chain_lands_every_row_where_the_formula_says():
    rows, cols = 64, 8  # int32 coordinates -> 32 bytes per row
    m = gated_chain(rows, cols * 4, 128)
    x = coords(2, rows, cols)
    got = decode(m.apply(x), rows, cols)
    half = rows // 2
    for i in range(rows):
        b, p = divmod(i, 32)
        shuffled = b * 32 + (p % 8) * 4 + p // 8
        interleaved = shuffled // 2 + (half if shuffled % 2 else 0)
        swapped = (interleaved + half) % rows
        assert (got[:, i, :, 1] == swapped).all(), (i, got[0, i, 0])
    assert torch.equal(got[:, :, :, 0], torch.arange(2)[:, None, None].expand(2, rows, cols))
    assert torch.equal(got[:, :, :, 2], torch.arange(cols).expand(2, rows, cols))


@settings(max_examples=40, deadline=None)
@given(
    half=st.integers(1, 6).map(lambda k: 16 * k),
    extra=st.integers(0, 3),
    cols=st.sampled_from([4, 12, 64, 128, 256]),
    etm=st.sampled_from([64, 128]),
    experts=st.integers(1, 3),
)
def test_inverse_recovers_input_exactly(half, extra, cols, etm, experts):
    rows_in = half - extra
    rows = 2 * half
    if rows % steps.shuffle_block_size(etm):
        return
    m = compose(
        steps.pad_projections(2, rows_in, half, cols, cols + 4 * extra),
        steps.swap_w13_to_w31_rows(rows, cols + 4 * extra),
        steps.interleave_rows_for_gated_act(rows, cols + 4 * extra),
        steps.shuffle_rows_for_epilogue(rows, cols + 4 * extra, etm),
    )
    x = random_bytes((experts, 2 * rows_in, cols), torch.uint8, seed=rows + cols)
    y = m.apply(x)
    assert same_bytes(m.inverse().apply(y), x)
    assert m.inverse().inverse() == m


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 300), cols=st.integers(1, 20), itemsize=st.sampled_from([1, 2]))
def test_swizzle_offsets_match_the_formula(rows, cols, itemsize):
    m = steps.swizzle_scales_128x4(rows, cols, itemsize)
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    src = m.src
    for r, c in [(0, 0), (rows - 1, cols - 1), (rows // 2, cols // 2), (min(rows - 1, 33), min(cols - 1, 5))]:
        off = (r // 128) * (cp // 4) * 512 + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
        assert src[off] == r * cols + c
    assert int((src < 0).sum()) == rp * cp - rows * cols
    assert m.out_shape == (rp, cp * itemsize)


def test_compose_is_associative_and_coarsening_keeps_the_map():
    a = steps.pad_projections(2, 30, 32, 256, 256)
    b = steps.swap_w13_to_w31_rows(64, 256)
    c = steps.shuffle_rows_for_epilogue(64, 256, 128)
    d = steps.block_major_k(64, 256, 128)
    left, right = (a >> b) >> (c >> d), a >> (b >> (c >> d))
    assert left == right
    assert left.coarsened() == left
    assert left.coarsened().cell_bytes == 128
    assert left.refined(1) == left
    assert not (left == (a >> c >> d))  # noqa: SIM201 - tests __eq__ itself


def test_coarsening_widens_row_permutations_to_whole_rows():
    m = steps.swap_w13_to_w31_rows(64, 7168) >> steps.shuffle_rows_for_epilogue(64, 7168, 64)
    assert m.coarsened().cell_bytes == 7168
    assert steps.block_major_k(64, 512, 128).coarsened().cell_bytes == 128


def test_provenance_agrees_with_the_byte_table():
    m = gated_chain(64, 32, 64) >> steps.block_major_k(64, 32, 16)
    table = m.source_bytes().reshape(-1)
    for offset in [0, 1, 17, 511, 1000, m.out_bytes - 1]:
        prov = m.provenance(offset)
        src = prov.source
        assert int(torch.tensor(src[0] * 32 + src[1])) == int(table[offset])
        assert len(prov.stages) == len(m.steps) + 1
    padded = steps.pad_projections(1, 3, 4, 8, 8, fill=127)
    prov = padded.provenance((3, 0))
    assert prov.is_fill and prov.stages[-1].fill == 127
    assert "fill byte 0x7f" in str(prov)
    assert prov.in_elements(2).stages[0].coords == (3, 0)


def test_fill_values_survive_composition():
    m = steps.pad_projections(1, 100, 128, 3, 4, fill=127) >> steps.swizzle_scales_128x4(128, 4)
    x = random_bytes((2, 100, 3), torch.uint8, seed=3)
    out = m.apply(x).reshape(2, -1)
    fill = m.refined(1).src < 0
    assert (out[:, fill] == 127).all()
    assert set(m.fills) == {127, 0}


def test_not_invertible_and_bad_shapes_raise_clear_errors():
    dup = IndexMap(torch.tensor([0, 0, 1]), 4, (2, 4), (3, 4), (), "duplicate_row")
    with pytest.raises(LayoutError, match="not invertible"):
        dup.inverse()
    m = steps.swap_w13_to_w31_rows(8, 16)
    with pytest.raises(LayoutError, match=r"expects \(experts, 8, 16\) bytes"):
        m.apply(torch.ones(2, 8, 4, dtype=torch.bfloat16))
    with pytest.raises(LayoutError, match="not contiguous"):
        m.apply(torch.ones(2, 16, 8, dtype=torch.uint8).transpose(1, 2))
    with pytest.raises(LayoutError, match="cannot compose"):
        m >> steps.swap_w13_to_w31_rows(4, 16)
    with pytest.raises(LayoutError, match="not a multiple of 32"):
        steps.shuffle_rows_for_epilogue(48, 16, 128)
    with pytest.raises(LayoutError, match="odd"):
        steps.swap_w13_to_w31_rows(7, 16)
    with pytest.raises(LayoutError, match="128-byte block"):
        steps.block_major_k(32, 100, 128)
    with pytest.raises(LayoutError, match="cannot run in place"):
        steps.pad_projections(1, 3, 4, 8, 8).apply_(torch.ones(2, 3, 8, dtype=torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
def test_in_place_permutation_with_small_scratch(device):
    m = steps.interleave_rows_for_gated_act(64, 64) >> steps.shuffle_rows_for_epilogue(64, 64, 128)
    x = random_bytes((7, 64, 64), torch.uint8, seed=5, device=device)
    expected = m.apply(x)
    view = m.apply_(x, scratch_experts=2)
    assert view.data_ptr() == x.data_ptr()
    assert torch.equal(view, expected)


def test_row_sources_and_bias_maps_follow_the_weight_rows():
    """A per-row bias must move with its weight's rows through pad, swap, interleave, shuffle (and
    ignore the K re-tiling): check against the weight map on a coordinate tensor."""
    m = compose(
        steps.pad_projections(2, 40, 64, 256, 256),
        steps.swap_w13_to_w31_rows(128, 256),
        steps.interleave_rows_for_gated_act(128, 256),
        steps.shuffle_rows_for_epilogue(128, 256, 128),
        steps.block_major_k(128, 256, 128),
    )
    rows = m.row_steps().row_sources()
    weight = decode(m.row_steps().apply(coords(1, 80, 64)), 80, 64)[0]
    assert torch.equal(rows, torch.where(weight[:, 0, 0] >= 0, weight[:, 0, 1], -1))
    bias = torch.arange(1, 81, dtype=torch.int16).view(1, 80, 1)  # (E, rows, one 2-byte value)
    moved = m.for_row_vectors(2).apply(bias)
    assert torch.equal(moved.view(-1), torch.where(rows >= 0, rows + 1, 0).to(torch.int16))
    with pytest.raises(LayoutError, match="not a row map"):
        steps.swizzle_scales_128x4(128, 8).row_sources()


def test_row_steps_are_found_without_a_torch_cpu_operation():
    """A drop-in's first call finds a map's row steps (for FlashInfer's index dict): numpy only, no torch CPU
    operation (a process's first one starts torch's CPU threads: 23 ms of a BF16 drop-in's first layer on an H100
    host, benchmarks/RESULTS.md). Every aten call is recorded while the steps are found on new maps: only wrapping
    numpy arrays as tensors (``lift_fresh``, ``detach``: no data touched) may run."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func) not in ("aten.lift_fresh.default", "aten.detach.default"):
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    for rows, cols in ((4096, 512), (384, 8192), (144, 256)):
        m = compose(
            steps.swap_w13_to_w31_rows(rows, cols),
            steps.interleave_rows_for_gated_act(rows, cols),
            steps.shuffle_rows_for_epilogue(rows, cols, 8),
            steps.block_major_k(rows, cols, 128),
        )
        with Record() as record:
            found = m.row_steps()
        assert record.ops == [] and found.out_shape == (rows, cols), (rows, cols, record.ops)
        assert [s.kind for s in found.steps] == [s.kind for s in m.steps[:3]]


def test_row_sources_are_found_once_per_map_and_handed_out_as_copies(monkeypatch):
    """A drop-in asks a map for its rows on every call; the pass over the byte index (ms for a
    full expert) runs once per map, a caller writing into the answer changes no later answer,
    and a map that is not a row map keeps refusing."""
    found = spy_calls(monkeypatch, [(IndexMap, "_find_row_sources")])
    m = compose(steps.interleave_rows_for_gated_act(128, 64), steps.shuffle_rows_for_epilogue(128, 64, 64))
    first = m.row_sources()
    want = first.clone()
    first[:] = -7
    assert torch.equal(m.row_sources(), want) and len(found) == 1
    assert m.row_steps() is m.row_steps()
    swz = steps.swizzle_scales_128x4(128, 8)
    for _ in range(2):
        with pytest.raises(LayoutError, match="not a row map"):
            swz.row_sources()


def test_block_layout_drop_in_finds_rows_only_for_a_new_shape(monkeypatch):
    """The BF16 block-layout drop-in fills FlashInfer's permute cache once per shape; a warm call
    does no pass over a map (it used to take 1-10 ms of host time a call on the H200's host)."""
    from fimoe_lab import prepare
    from fimoe_lab.caches import clear_caches

    clear_caches()  # this test's maps are built here, whatever ran before
    found = spy_calls(monkeypatch, [(IndexMap, "_find_row_sources")])
    cache: dict = {}
    w13 = random_bytes((2, 256, 128), torch.uint8, seed=3).view(torch.bfloat16)
    w2 = random_bytes((2, 64, 256), torch.uint8, seed=4).view(torch.bfloat16)
    prepare.convert_moe_weights_to_flashinfer_trtllm_block_layout(cache, w13.clone(), w2.clone())
    n_first, entries = len(found), {k: v.clone() for k, v in cache.items()}
    prepare.convert_moe_weights_to_flashinfer_trtllm_block_layout(cache, w13.clone(), w2.clone())
    assert n_first >= 2 and len(found) == n_first
    assert cache.keys() == entries.keys() and all(torch.equal(cache[k], v) for k, v in entries.items())


def test_fill_bytes_above_127_survive_every_cpu_backend():
    from fimoe_lab.kernels import available_backends, execute

    m = steps.pad_projections(1, 3, 5, 3, 5, fill=200)  # 1-byte cells: gcd(3, 5) = 1
    x = random_bytes((2, 3, 3), torch.uint8, seed=9)
    for backend in available_backends("cpu"):
        out = torch.empty((2, 5, 5), dtype=torch.uint8)
        execute(m.compiled(), x, out, backend)
        assert torch.equal(out[:, :3, :3], x), backend
        assert (out[:, 3:, :] == 200).all() and (out[:, :, 3:] == 200).all(), backend


def _random_map(rng, n_in: int, n_out: int, cell: int, fills: tuple[int, ...]) -> IndexMap:
    """Random gather over ``cell``-byte cells: sources anywhere, about a quarter fill codes."""
    src = torch.randint(0, n_in, (n_out,), generator=rng)
    if fills:
        fill = torch.rand(n_out, generator=rng) < 0.25
        src[fill] = -1 - torch.randint(0, len(fills), (int(fill.sum()),), generator=rng)
    return IndexMap(src, cell, (n_in * cell,), (n_out * cell,), fills)


def _byte_table(m: IndexMap) -> list[int]:
    """Oracle, pure Python: source byte of every output byte, fill byte ``v`` as ``-1 - v``."""
    c = m.cell_bytes
    return [s * c + k if s >= 0 else -1 - m.fills[-1 - s] for s in m.src.tolist() for k in range(c)]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    cells=st.tuples(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8])),
    n=st.integers(1, 24),
    fills=st.tuples(st.sampled_from([(), (0,), (127, 0), (7, 7)]), st.sampled_from([(), (255,), (0, 9)])),
)
def test_then_refined_coarsened_match_a_byte_table(seed, cells, n, fills):
    """Composition (numpy gathers, fill codes shifted and deduplicated), refining and
    coarsening agree with composing the two byte tables in Python."""
    rng = torch.Generator().manual_seed(seed)
    width = 8 * n
    a = _random_map(rng, width // cells[0], width // cells[0], cells[0], fills[0])
    b = _random_map(rng, width // cells[1], width // cells[1], cells[1], fills[1])
    ta, tb = _byte_table(a), _byte_table(b)
    want = [ta[s] if s >= 0 else s for s in tb]
    ab = a >> b
    assert _byte_table(ab.refined(1)) == want
    assert _byte_table(ab.coarsened().refined(1)) == want
    assert len(set(ab.fills)) == len(ab.fills)
    assert ab == ab.refined(1) and ab.coarsened() == ab


def test_equality_compares_every_byte_beyond_the_cheap_probe():
    """``==`` first compares a sample of output bytes (cache lookups compare maps of equal
    shapes), then every byte: a change anywhere, or a different fill byte, makes maps differ."""
    n = 4096
    base = IndexMap(torch.arange(n), 4, (4 * n,), (4 * n,), ())
    assert base == base.refined(1) == base.refined(2).coarsened()
    for i in (1, 2, n // 2 + 1, n - 2):  # 257 probes over 16 KB: none of these cells is probed whole
        moved = base.src.clone()
        moved[i], moved[i + 1] = moved[i + 1].clone(), moved[i].clone()
        assert base != IndexMap(moved, 4, base.in_shape, base.out_shape, ())
    holes = base.src.clone()
    holes[5] = -1
    zero = IndexMap(holes, 4, base.in_shape, base.out_shape, (0,))
    assert zero != IndexMap(holes, 4, base.in_shape, base.out_shape, (1,))
    assert zero == IndexMap(torch.where(holes >= 0, holes, -2), 4, base.in_shape, base.out_shape, (9, 0))


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 300), cols=st.integers(1, 13), itemsize=st.sampled_from([1, 2, 4]))
def test_scale_swizzles_match_the_formula_at_every_scale(rows, cols, itemsize):
    """Every output element of both atom swizzles against the scatter formula (loops)."""
    for fn, atom, within in (
        (steps.swizzle_scales_128x4, 128, lambda r, c: (r % 32) * 16 + (r // 32) * 4 + c),
        (steps.swizzle_scales_8x4, 8, lambda r, c: r * 4 + c),
    ):
        m = fn(rows, cols, itemsize)
        rp, cp = -(-rows // atom) * atom, -(-cols // 4) * 4
        want = [-1] * (rp * cp)
        for r in range(rows):
            for c in range(cols):
                want[(r // atom) * (cp // 4) * 4 * atom + (c // 4) * 4 * atom + within(r % atom, c % 4)] = r * cols + c
        assert m.src.tolist() == want and m.cell_bytes == itemsize


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 12),
    m_out=st.integers(1, 12),
    cell=st.sampled_from([1, 2, 4]),
    fill=st.integers(1, 255),
    seed=st.integers(0, 2**16),
)
def test_a_map_that_lists_no_fill_bytes_fills_zeros_also_composed(n, m_out, cell, fill, seed):
    """A map with fill cells and no ``fills`` fills them with zeros (its ``fills`` become ``(0,)``), also composed
    before and after a map whose fill byte is not zero: ``(a >> b)(x) == b(a(x))`` and ``(b2 >> a2)(x) ==
    a2(b2(x))``, against the byte-loop reference on random bytes."""
    from reference_loops import byte_gather

    g = torch.Generator().manual_seed(seed)
    a_src = torch.randint(-1, n, (n,), generator=g)
    a_src[0] = -1  # at least one fill cell
    a = IndexMap(a_src, cell, (n * cell,), (n * cell,))
    b = IndexMap(torch.randint(-1, n, (m_out,), generator=g), cell, (n * cell,), (m_out * cell,), fills=(fill,))
    assert a.fills == (0,)
    x = torch.randint(0, 256, (2, n * cell), dtype=torch.uint8, generator=g)
    assert torch.equal(byte_gather(a >> b, x), byte_gather(b, byte_gather(a, x).reshape(2, -1)))
    b2 = IndexMap(torch.randint(-1, n, (n,), generator=g), cell, (n * cell,), (n * cell,), fills=(fill,))
    assert torch.equal(byte_gather(b2 >> a, x), byte_gather(a, byte_gather(b2, x).reshape(2, -1)))
