"""fimoe_lab.shapes (torch-free) against what convert really does: plan_layer's padding and the reader's shards."""

import collections
import itertools
import random
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fimoe_lab import recipes, shapes
from fimoe_lab.checkpoints import open_checkpoint
from fimoe_lab.checkpoints.conventions import CONVENTIONS
from fimoe_lab.engines import ENGINE_CHOICES
from fimoe_lab.errors import FimoeError
from fimoe_lab.resources import sample_names, sample_path
from fimoe_lab.specs import BACKENDS, weight_formats
from fimoe_lab.tune.models import WHOLE_BLOCK_SHARD_FORMATS

ACTS = ((True, True), (False, False))  # SwiGLU-like (gate and up), ReLU^2-like (one projection)
ALIGNS = (None, 1, 2, 8, 16, 32, 64, 128, 256, 512)


def plan_result(fmt, backend, i, h, act, ia, ha, engine, per_token=False):
    """``(I', H')`` of the real plan, or "refused"."""
    try:
        plan = recipes.plan_layer(fmt, backend, i, h, *act, ia, ha, engine, per_token)
    except FimoeError:
        return "refused"
    return plan.padded_intermediate, plan.padded_hidden


def shape_result(fmt, backend, i, h, act, ia, ha, engine, per_token=False):
    try:
        return shapes.padded_shape(
            fmt,
            backend,
            i,
            h,
            *act,
            intermediate_alignment=ia,
            hidden_alignment=ha,
            engine=engine,
            per_token_activation=per_token,
        )
    except FimoeError:
        return "refused"


@settings(max_examples=120, deadline=None)
@given(
    fmt=st.sampled_from(weight_formats()),
    backend=st.sampled_from(BACKENDS),
    i=st.integers(1, 520),
    h=st.integers(1, 520),
    act=st.sampled_from(ACTS),
    ia=st.sampled_from(ALIGNS),
    ha=st.sampled_from(ALIGNS),
    engine=st.sampled_from((None,) + ENGINE_CHOICES),
    per_token=st.booleans(),
)
def test_padded_shape_is_plan_layers_rule_on_random_shapes(fmt, backend, i, h, act, ia, ha, engine, per_token):
    args = (fmt, backend, i, h, act, ia, ha, engine, per_token)
    assert shape_result(*args) == plan_result(*args)


@pytest.mark.parametrize("fmt", weight_formats())
def test_padded_shape_is_plan_layers_rule_on_model_shards(fmt):
    """Structured: real per-rank sizes (TP shards of published models, odd and even) x every alignment pair."""
    sizes = (96, 192, 232, 256, 360, 464, 672, 720, 736)
    hiddens = (1024, 2688)
    rng = random.Random(zlib.crc32(fmt.encode()))
    cases = list(itertools.product(BACKENDS, sizes, hiddens, ACTS, ALIGNS, ALIGNS))
    for backend, i, h, act, ia, ha in rng.sample(cases, 24):
        assert shape_result(fmt, backend, i, h, act, ia, ha, None) == plan_result(fmt, backend, i, h, act, ia, ha, None)


# MxInt4 (laid out from int4-group checkpoints; its own rule): sizes around multiples of 256, so that
# both the accepted and the refused side of every condition are drawn
_MXINT4_SIZES = st.one_of(
    st.integers(1, 4096), st.integers(1, 32).map(lambda k: 256 * k), st.integers(1, 64).map(lambda k: 128 * k)
)


@settings(max_examples=150, deadline=None)
@given(
    backend=st.sampled_from(BACKENDS),
    i=_MXINT4_SIZES,
    h=_MXINT4_SIZES,
    act=st.sampled_from(ACTS),
    ia=st.sampled_from(ALIGNS),
    ha=st.sampled_from(ALIGNS),
    engine=st.sampled_from((None,) + ENGINE_CHOICES),
    per_token=st.booleans(),
)
def test_padded_shape_is_plan_layers_mxint4_rule_on_random_shapes(backend, i, h, act, ia, ha, engine, per_token):
    args = ("mxint4", backend, i, h, act, ia, ha, engine, per_token)
    assert shape_result(*args) == plan_result(*args)


def test_padded_shape_is_plan_layers_mxint4_rule_on_kimi_shards():
    """Structured: Kimi-K2-Thinking's per-rank sizes (I 2048 / TP 1..16, H 7168), the int4 family sample's
    (512, 256), off-by-one and off-by-32 neighbours, x every alignment pair, both activation kinds and
    backends. Every condition is met and missed at least once."""
    sizes = sorted({2048 // tp for tp in (1, 2, 4, 8, 16)} | {512, 256, 255, 257, 224, 288, 7168, 7136})
    results = collections.Counter()
    for backend, i, h, act, ia, ha in itertools.product(BACKENDS, sizes, (7168, 256, 7200), ACTS, ALIGNS, ALIGNS):
        got = shape_result("mxint4", backend, i, h, act, ia, ha, None)
        assert got == plan_result("mxint4", backend, i, h, act, ia, ha, None), (backend, i, h, act, ia, ha)
        results["refused" if got == "refused" else "laid out"] += 1
        if got != "refused":  # no padding, ever
            assert got == (i, h) and backend == "trtllm" and act == (True, True) and i % 256 == h % 256 == 0
    assert results["laid out"] > 100 and results["refused"] > 1000, results
    assert shapes.padded_shape("mxint4", "trtllm", 256, 7168) == (256, 7168)  # Kimi TP8
    for bad, match in [
        (dict(backend="cutlass"), "MxInt4 has no cutlass layout"),
        (dict(is_act_and_mul=False, is_gated=False), "SwiGLU \\(gated\\) layers only"),
        (dict(per_token_activation=True), "not per-token NVFP4"),
        (dict(hidden_alignment=2048), "hidden 7168 padded to 8192: vLLM pads nothing"),
        (dict(intermediate=128), "intermediate 128 is not a multiple of 256"),
    ]:
        kw = dict(backend="trtllm", intermediate=256, hidden=7168) | bad
        with pytest.raises(FimoeError, match=match):
            shapes.padded_shape("mxint4", **kw)


def test_default_alignments_is_the_recipes_function_on_every_input():
    for fmt, backend, act, engine, per_token in itertools.product(
        weight_formats(), BACKENDS, ACTS, (None,) + ENGINE_CHOICES, (False, True)
    ):
        args = (fmt, backend, *act, engine, per_token)
        assert shapes.default_alignments(*args) == recipes.default_alignments(*args)


def test_mxint4_default_alignments_pad_nothing_on_trtllm_and_refuse_cutlass():
    """What plan_mxint4 builds without alignments on every profile (vLLM pads nothing), and no CUTLASS row."""
    for act, engine in itertools.product(ACTS, (None,) + ENGINE_CHOICES):
        assert shapes.default_alignments("mxint4", "trtllm", *act, engine) == (1, 1)
        with pytest.raises(FimoeError, match="mxint4 has no cutlass layout .*fix: use --backend trtllm"):
            shapes.default_alignments("mxint4", "cutlass", *act, engine)
    plan = recipes.plan_layer("mxint4", "trtllm", 512, 256)  # the family sample's shape, no alignments given
    assert (plan.padded_intermediate, plan.padded_hidden) == (512, 256)


def _whole_blocks(conv) -> bool:
    """The reader's condition for whole-block shards: fused expert tensors stored as blocks (gpt-oss)."""
    return conv.fused_layout is not None and bool(conv.fused_layout.blocks)


@pytest.mark.parametrize("name", sample_names())
def test_rank_intermediates_are_the_readers_shards(name):
    """Every TP size 1..12 of each shipped sample: the same sizes, or both refuse."""
    ck = open_checkpoint(sample_path(name))
    try:
        for tp in range(1, 13):
            try:
                want = tuple(e - s for s, e in (ck.shard_bounds(tp, r) for r in range(tp)))
            except FimoeError:
                want = "refused"
            try:
                got = shapes.rank_intermediates(ck.intermediate, tp, ck.fmt, _whole_blocks(ck.convention))
            except FimoeError:
                got = "refused"
            assert got == want, (name, tp)
    finally:
        ck.close()


def test_gpt_oss_shards_are_whole_blocks_last_ranks_smaller():
    assert shapes.rank_intermediates(2880, 4, "mxfp4", True) == (736, 736, 736, 672)
    assert shapes.rank_intermediates(2880, 8, "mxfp4", True) == (384,) * 7 + (192,)
    with pytest.raises(FimoeError, match="not a multiple of the 32 values"):
        shapes.rank_intermediates(2880, 8, "mxfp4", False)  # equal shards of 360 would cut a block
    with pytest.raises(FimoeError, match="get no intermediate rows"):
        shapes.rank_intermediates(64, 3, "mxfp4", True)


def test_whole_block_shard_formats_are_the_block_fused_conventions():
    blocks = {c.fmt for c in CONVENTIONS if _whole_blocks(c)}
    assert blocks == set(WHOLE_BLOCK_SHARD_FORMATS)
    assert not [c.name for c in CONVENTIONS if not _whole_blocks(c) and c.fmt in blocks]
