"""Layer plans kept on disk (`fimoe_lab.plan_store`): a plan read back moves every byte as the plan built in the
process does, its compiled forms are the built plan's, its index is built again only when read, and a record that
does not fit (another fingerprint, key or format, a broken file) is never used."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import coords, json_paths, random_bytes, same_bytes
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from fimoe_lab import plan_store
from fimoe_lab.caches import clear_caches
from fimoe_lab.errors import LayoutError
from fimoe_lab.recipes import RECIPES, plan_layer

ROOT = Path(__file__).resolve().parent.parent

# (format, backend, I, H, gated): the recipes' layouts at model-like and unaligned sizes (90-byte scale rows,
# paddings in both dimensions, non-gated layers)
CASES = [
    ("nvfp4", "trtllm", 256, 1024, True),
    ("nvfp4", "trtllm", 208, 640, True),
    ("mxfp4", "trtllm", 1440, 1440, True),
    ("mxfp4", "trtllm", 2880, 736, True),
    ("mxfp4", "cutlass", 416, 736, True),
    ("nvfp4", "cutlass", 256, 512, False),
    ("fp8", "trtllm", 256, 1024, True),
    ("fp8", "cutlass", 192, 512, True),
    ("fp8-block", "trtllm", 256, 1024, True),
    ("mxfp8", "trtllm", 256, 512, True),
    ("mxfp8", "cutlass", 128, 384, False),
    ("bf16", "trtllm", 192, 512, True),
    ("bf16", "cutlass", 96, 256, True),
]


@pytest.fixture
def store(tmp_path, monkeypatch):
    """The plan store on, in a folder of this test's; every in-memory plan forgotten before and after."""
    monkeypatch.setenv("FIMOE_LAB_CACHE", str(tmp_path))
    monkeypatch.setenv("FIMOE_LAB_PLAN_STORE", "1")
    clear_caches()
    yield tmp_path / "plans"
    clear_caches()


def _inputs(plan, experts: int = 3) -> dict[str, torch.Tensor]:
    """Each map's input bytes: coordinates where a row holds whole int32 words, else random bytes."""
    out = {}
    for k, (name, m) in enumerate(plan.maps().items()):
        if len(m.in_shape) == 2 and m.in_shape[1] % 4 == 0:
            out[name] = coords(experts, m.in_shape[0], m.in_shape[1] // 4).view(torch.uint8)
        else:
            out[name] = random_bytes((experts, *m.in_shape), torch.uint8, seed=k)
    return out


def _apply(plan, given: dict[str, torch.Tensor]) -> tuple:
    """The plan on ``given``; a weight the plan leaves as it is gets a few bytes of its own (passed through)."""
    experts = next(iter(given.values())).shape[0]
    kept = {n: random_bytes((experts, 4), torch.uint8, seed=9) for n in ("w13", "w2") if n not in given}
    given = {**kept, **given}
    return plan.apply(given["w13"], given["w2"], given.get("w13_scale"), given.get("w2_scale"))


def _row_forms(em) -> tuple:
    return em.swizzle, em.padrows, em.swizzled_rows


@pytest.mark.parametrize("fmt, backend, inter, hidden, gated", CASES)
def test_a_stored_plan_moves_every_byte_as_the_plan_built_here(store, fmt, backend, inter, hidden, gated):
    built = plan_layer(fmt, backend, inter, hidden, is_act_and_mul=gated)
    given = _inputs(built)
    want = _apply(built, given)
    records = list(store.glob("*.plan"))
    forms = {n: m.compiled() for n, m in built.maps().items()}
    if not all(f.strided is not None or f.stages is not None for f in forms.values()):
        assert records == []  # a map whose first call reads its index is not stored
        return
    assert len(records) == 1
    clear_caches()

    stored = plan_layer(fmt, backend, inter, hidden, is_act_and_mul=gated)
    assert stored is not built and stored.maps().keys() == built.maps().keys()
    assert (stored.padded_intermediate, stored.padded_hidden, stored.description) == (
        built.padded_intermediate,
        built.padded_hidden,
        built.description,
    )
    for name, m in stored.maps().items():
        b = built.maps()[name]
        assert (m.name, m.in_shape, m.out_shape, m.cell_bytes, m.fills) == (
            b.name,
            b.in_shape,
            b.out_shape,
            b.cell_bytes,
            b.fills,
        )
        assert m.spec() == b.spec()
    got = _apply(stored, given)  # (which executor runs it, and whether it reads the index, is the process's
    # choice: numba on a CPU once loaded; a fresh process's first layer: the next test)
    assert all(same_bytes(g, w) for g, w in zip(got, want))
    for name, m in stored.maps().items():  # the compiled forms are the built ones
        em, ref = m.compiled(), forms[name]
        assert em.strided == ref.strided
        assert (em.stages is None) == (ref.stages is None)
        if ref.stages is not None:
            assert [s.strided for s in em.stages] == [s.strided for s in ref.stages]
        assert (em.cell_bytes, em.word, em.n_in, em.n_out, em.has_fill) == (
            ref.cell_bytes,
            ref.word,
            ref.n_in,
            ref.n_out,
            ref.has_fill,
        )
        assert np.array_equal(em.src, ref.src)  # found from the map built again
        assert em.is_permutation == ref.is_permutation and em.ends_swizzled == ref.ends_swizzled
        for got_form, want_form in zip(_row_forms(em), _row_forms(ref)):
            assert (got_form is None) == (want_form is None)
            if want_form is not None:
                assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got_form, want_form))
        assert torch.equal(m.src, built.maps()[name].src)
    back = stored.inverse().apply(*got)
    for name, x in zip(("w13", "w2", "w13_scale", "w2_scale"), back):
        if name in given:
            assert same_bytes(x, given[name])


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    recipe=st.sampled_from(sorted(r for r in RECIPES if not r.startswith("mxint4"))),
    inter=st.integers(1, 24).map(lambda k: 32 * k),
    hidden=st.integers(2, 24).map(lambda k: 32 * k),
    gated=st.booleans(),
)
def test_any_stored_shape_reads_back_as_the_plan_built_here(tmp_path_factory, recipe, inter, hidden, gated):
    fmt, backend = recipe.split("/")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FIMOE_LAB_CACHE", str(tmp_path_factory.mktemp("cache")))
        mp.setenv("FIMOE_LAB_PLAN_STORE", "1")
        clear_caches()
        try:
            built = plan_layer(fmt, backend, inter, hidden, is_act_and_mul=gated)
        except LayoutError:
            assume(False)  # a shape the recipe refuses (its own tests hold the refusals)
        assume(built.maps())  # a layout that moves nothing (BF16 on CUTLASS) has nothing to store
        given_ = _inputs(built, 2)
        want = _apply(built, given_)
        clear_caches()
        stored = plan_layer(fmt, backend, inter, hidden, is_act_and_mul=gated)
        if any(m.known_compiled() is None for m in stored.maps().values()):  # not stored: a map reads its index
            assert all(m.known_compiled() is None for m in stored.maps().values())
        assert all(same_bytes(g, w) for g, w in zip(_apply(stored, given_), want))
        clear_caches()


@pytest.mark.parametrize("fmt, inter, hidden", [("nvfp4", 256, 1024), ("mxfp4", 1440, 736), ("mxfp8", 256, 512)])
def test_row_forms_found_after_the_first_apply_are_kept_and_read_back(store, fmt, inter, hidden):
    """A scale map's row forms, found after the plan's first apply (by the background planner on a GPU; read here),
    go into the record at the next apply, and a later plan has them without building its index: the swizzle kernel
    needs nothing built before its first call. A record whose row forms do not read is not used."""
    from fimoe_lab.kernels import prebuilt

    built = plan_layer(fmt, "trtllm", inter, hidden)
    given = _inputs(built)
    want = _apply(built, given)
    swizzled = {n: m.compiled() for n, m in built.maps().items() if m.compiled().ends_swizzled}
    assert swizzled
    before = {n: _row_forms(em) if em.row_forms_found() else None for n, em in swizzled.items()}
    first = plan_store.loads(_record(store).read_bytes())
    found = {n: _row_forms(em) for n, em in swizzled.items()}
    for n, forms in before.items():
        assert (first["maps"][n]["exec"]["row_forms"] is None) == (forms is None)
    _apply(built, given)
    second = plan_store.loads(_record(store).read_bytes())
    assert all(second["maps"][n]["exec"]["row_forms"] is not None for n in found)
    clear_caches()

    stored = plan_layer(fmt, "trtllm", inter, hidden)
    for n, want_forms in found.items():
        m = stored.maps()[n]
        em = m.known_compiled()
        assert em is not None and em.row_forms_found() and "src" not in vars(m) and not em.sources_found()
        assert prebuilt.planned(em, False)
        for got_form, want_form in zip(_row_forms(em), want_forms):
            assert (got_form is None) == (want_form is None)
            if want_form is not None:
                assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got_form, want_form))
    assert all(same_bytes(g, w) for g, w in zip(_apply(stored, given), want))
    clear_caches()

    name = next(iter(found))
    swizzled_rows = second["maps"][name]["exec"]["row_forms"][2]
    short = swizzled_rows[0][:-1]  # one row short: a kernel reads past
    for spoil in ([[0, 1]], [["a row"], None, None], [None, None, [short, *swizzled_rows[1:]]]):
        record = plan_store.loads(plan_store.dumps(second))
        record["maps"][name]["exec"]["row_forms"] = spoil
        _record(store).write_bytes(plan_store.dumps(record))
        again = plan_layer(fmt, "trtllm", inter, hidden)
        assert all(m.known_compiled() is None for m in again.maps().values()), spoil
        clear_caches()


LATER_PROCESS = """
import hashlib, json, sys, torch
from fimoe_lab.recipes import plan_layer
fmt, inter, hidden, device = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
plan = plan_layer(fmt, "trtllm", inter, hidden)
restored = [n for n, m in plan.maps().items() if m.known_compiled() is not None]
rows = [n for n, m in plan.maps().items() if m.known_compiled() is not None and m.known_compiled().row_forms_found()]
g = torch.Generator().manual_seed(1)
shapes = [(3, *m.in_shape) for m in plan.maps().values()]
given = [torch.randint(0, 256, s, dtype=torch.uint8, generator=g).to(device) for s in shapes]
out = plan.apply(*given)
if device == "cuda":  # the planner finds the scale maps' row forms after the call; the next apply keeps them
    from fimoe_lab.kernels import prebuilt
    prebuilt.wait_for_plans()
    plan.apply(*given)
built = [n for n, m in plan.maps().items() if "src" in vars(m)]
digest = [hashlib.sha256(o.cpu().numpy().tobytes()).hexdigest() for o in out]
print(json.dumps({"restored": restored, "rows": rows, "built": built, "out": digest}))
"""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("fmt, inter, hidden", [("nvfp4", 256, 1024), ("mxfp4", 1440, 736)])
def test_a_later_process_reads_the_plan_and_builds_no_index_on_its_first_layer(tmp_path, device, fmt, inter, hidden):
    """Two fresh processes (as an engine restarted): the first builds, applies and writes; the second reads the plan,
    applies it without building any map's index (its first layer runs from the stored forms: torch's strided copies
    on a CPU, the prebuilt strided and swizzle kernels on a GPU, the scale maps' row forms found by the first
    process's planner kept), and gives the same bytes."""
    env = dict(os.environ, FIMOE_LAB_CACHE=str(tmp_path), FIMOE_LAB_PLAN_STORE="1", PYTHONPATH=str(ROOT))

    def run() -> dict:
        cmd = [sys.executable, "-c", LATER_PROCESS, fmt, str(inter), str(hidden), device]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        assert p.returncode == 0, p.stderr[-2000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert first["restored"] == []
    assert second["restored"] == ["w13", "w2", "w13_scale", "w2_scale"] and second["built"] == []
    assert first["rows"] == [] and second["rows"] == (["w13_scale", "w2_scale"] if device == "cuda" else [])
    assert second["out"] == first["out"]


def _record(store_dir: Path) -> Path:
    (path,) = store_dir.glob("*" + plan_store.SUFFIX)
    return path


def _written():
    plan = plan_layer("mxfp4", "trtllm", 1440, 736)  # weights strided, scales in two strided stages
    given = _inputs(plan, 2)
    want = _apply(plan, given)
    clear_caches()
    return given, want


@pytest.mark.parametrize(
    "spoil",
    [
        "fingerprint",
        "format",
        "key",
        "not json",
        "truncated",
        "a map's name",
        "a stage split",
        "a step kind",
        "an array for a number",
        "nested past the parser",
        "a table past the file",
        "a byte changed in a table",
        "cells of no bytes",
        "cells of half a byte",
        "cells moved as a word they are not",
        "a strided box past its shape",
        "a strided view past the input",
        "a fill code the map has not",
    ],
)
def test_a_record_that_does_not_fit_is_not_used(store, spoil):
    given, want = _written()
    path = _record(store)
    record = plan_store.loads(path.read_bytes())
    data = None
    if spoil == "fingerprint":
        record["fingerprint"] = "0" * 64
    elif spoil == "format":
        record["format"] = plan_store.FORMAT + 1
    elif spoil == "key":
        record["key"]["plan_for"]["layer"]["hidden"] = 1024  # the file of another plan, under this one's name
    elif spoil == "not json":
        data = b"\x80\x04 not a record"
    elif spoil == "truncated":
        data = path.read_bytes()[: len(path.read_bytes()) // 2]
    elif spoil == "a map's name":
        record["maps"]["w13"]["exec"]["name"] = "swap_w13_to_w31_rows(rows=1)"
    elif spoil == "a stage split":
        record["maps"]["w13_scale"]["exec"]["split"] = 99
    elif spoil == "a step kind":
        record["maps"]["w2"]["parts"][0]["kind"] = "os.system"
    elif spoil == "an array for a number":
        record["maps"]["w2"]["cell_bytes"] = [1, 2]
    elif spoil == "nested past the parser":
        data = _checked(b"[" * 100_000 + b"\n")
    elif spoil == "a table past the file":
        _, header, tables = path.read_bytes().split(b"\n", 2)
        data = _checked(header + b"\n" + tables[: len(tables) // 8 * 4])  # whole words, fewer than the header names
    elif spoil == "cells of no bytes":
        record["maps"]["w2"]["cell_bytes"] = 0
    elif spoil == "cells of half a byte":
        record["maps"]["w2"]["cell_bytes"] = 0.5
    elif spoil == "cells moved as a word they are not":
        record["maps"]["w2"]["exec"]["cells"]["word"] = 3
    elif spoil == "a strided box past its shape":
        strided = record["maps"]["w2"]["exec"]["strided"]
        strided["live"][0] = strided["shape"][0] + 1
    elif spoil == "a strided view past the input":
        record["maps"]["w2"]["exec"]["strided"]["offset"] = 1 << 40
    elif spoil == "a fill code the map has not":
        record["maps"]["w2"]["exec"]["strided"]["fill"] = 5
    elif spoil == "a byte changed in a table":
        whole = bytearray(path.read_bytes())
        assert whole.count(b"\n") >= 2 and len(whole) > whole.index(b"\n", 9) + 1  # a record with tables
        whole[-1] ^= 0x40
        data = bytes(whole)
    path.write_bytes(data if data is not None else plan_store.dumps(record))
    plan = plan_layer("mxfp4", "trtllm", 1440, 736)
    assert all(m.known_compiled() is None for m in plan.maps().values()), "a record that does not fit was read"
    assert all(same_bytes(g, w) for g, w in zip(_apply(plan, given), want))


@pytest.mark.parametrize("how", ["group-writable file", "world-writable folder", "a link to a record"])
def test_a_record_anyone_else_could_have_written_is_not_read(store, how):
    given, want = _written()
    path = _record(store)
    if how == "group-writable file":
        path.chmod(0o664)
    elif how == "world-writable folder":
        store.chmod(0o777)
    else:
        elsewhere = store.parent / "elsewhere.plan"
        path.rename(elsewhere)
        path.symlink_to(elsewhere)
    plan = plan_layer("mxfp4", "trtllm", 1440, 736)
    assert all(m.known_compiled() is None for m in plan.maps().values())
    assert all(same_bytes(g, w) for g, w in zip(_apply(plan, given), want))
    store.chmod(0o700)


def test_off_neither_reads_nor_writes(store, monkeypatch):
    _written()
    path = _record(store)
    monkeypatch.setenv("FIMOE_LAB_PLAN_STORE", "0")
    plan = plan_layer("mxfp4", "trtllm", 1440, 736)
    assert all(m.known_compiled() is None for m in plan.maps().values())
    path.unlink()
    _apply(plan, _inputs(plan, 2))
    assert list(store.glob("*")) == []


def test_a_folder_that_cannot_be_written_is_left_alone(tmp_path, monkeypatch):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder would be")
    monkeypatch.setenv("FIMOE_LAB_CACHE", str(blocker))
    monkeypatch.setenv("FIMOE_LAB_PLAN_STORE", "1")
    clear_caches()
    plan = plan_layer("nvfp4", "trtllm", 256, 512)
    given = _inputs(plan, 2)
    out = _apply(plan, given)
    assert blocker.read_text() == "a file where the cache folder would be"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]
    assert all(o is not None for o in out)
    clear_caches()


def test_a_plan_is_written_once_after_its_first_apply_and_not_before(store):
    plan = plan_layer("mxfp4", "trtllm", 1440, 736)
    assert list(store.glob("*.plan")) == []  # built, not yet applied: nothing compiled to keep
    given = _inputs(plan, 2)
    _apply(plan, given)
    path = _record(store)
    stamp = path.stat().st_mtime_ns
    _apply(plan, given)
    assert path.stat().st_mtime_ns == stamp and [p.name for p in store.iterdir()] == [path.name]


DROP_INS = [  # (drop-in, its builder, w13 shape, w2 shape, dtype, the drop-in's arguments after the weights)
    ("rotate", "plan_rotate_fp8_per_tensor", (3, 128, 64), (3, 64, 32), torch.float8_e4m3fn, (True,)),
    ("rotate", "plan_rotate_fp8_per_tensor", (3, 64, 64), (3, 64, 64), torch.float8_e4m3fn, (False,)),
    ("bf16 block", "plan_trtllm_bf16_block_layout", (2, 256, 128), (2, 128, 128), torch.bfloat16, (True,)),
    ("deepseek", "plan_shuffle_deepseek_fp8", (2, 256, 256), (2, 256, 128), torch.float8_e4m3fn, ()),
]


def _drop_in(kind: str, w13: torch.Tensor, w2: torch.Tensor, extra: tuple) -> tuple[torch.Tensor, ...]:
    """The drop-in on copies of ``w13``/``w2``: its outputs (in place: the copies), and the BF16 one's index dict."""
    from fimoe_lab import prepare

    a, b = w13.clone(), w2.clone()
    if kind == "rotate":
        prepare.rotate_weights_for_fi_trtllm_fp8_per_tensor_moe(a, b, *extra)
        return a, b
    if kind == "bf16 block":
        cache: dict = {}
        o13, o2 = prepare.convert_moe_weights_to_flashinfer_trtllm_block_layout(cache, a, b, *extra)
        return (o13, o2, *(cache[k] for k in sorted(cache, key=str)))
    return prepare.shuffle_deepseek_fp8_moe_weights(a, b)


@pytest.mark.parametrize("kind, builder, s13, s2, dtype, extra", DROP_INS)
def test_a_drop_ins_plan_is_kept_and_read_back_without_its_index(store, kind, builder, s13, s2, dtype, extra):
    """A drop-in's plan (the in-place FP8 rotate and BF16 block layout, the DeepSeek FP8 shuffle) is written after its
    first call; a later process's first call reads it and moves the same bytes (the reference loop's), reading no
    map's index for the call itself (its permutation flag from the record)."""
    import reference_loops as ref

    from fimoe_lab import builders

    w13 = random_bytes(s13, dtype, seed=1)
    w2 = coords(s2[0], s2[1], s2[2] * dtype.itemsize // 4).view(dtype)  # bytes that encode their coordinates
    first = _drop_in(kind, w13, w2, extra)
    loop = {
        "rotate": lambda: ref.rotate_fp8(w13.clone(), w2.clone(), *extra),
        "bf16 block": lambda: ref.bf16_block_layout(w13.clone(), w2.clone(), *extra),
        "deepseek": lambda: ref.deepseek_shuffle(w13.clone(), w2.clone()),
    }[kind]()
    assert all(same_bytes(a, b) for a, b in zip(first, loop))
    assert len(list(store.glob("*.plan"))) == 1
    clear_caches()

    plan = getattr(builders, builder)(s13[1], s13[2], s2[2], *extra)
    assert all(m.known_compiled() is not None for m in plan.maps().values()), "the record was not read"
    again = _drop_in(kind, w13, w2, extra)
    assert all(same_bytes(a, b) for a, b in zip(again, first))
    if kind != "bf16 block":  # (its FlashInfer index dict reads the rows of its steps)
        assert not any("src" in vars(m) for m in plan.maps().values()), "a map's index was built for the call"


@pytest.mark.parametrize(
    "fmt, inter, hidden", [("bf16", 128, 128), ("bf16", 96, 128), ("fp8", 64, 64), ("fp8", 48, 64)]
)
def test_a_layer_plan_built_on_a_drop_ins_plan_read_back_moves_the_same_bytes(store, fmt, inter, hidden):
    """``plan_layer`` composes the drop-ins' builders (BF16 block layout, FP8 rotate) after its padding: where a
    drop-in's plan was read from disk, the layer plan built on it (padded or not) moves the bytes of one built here."""
    from fimoe_lab import prepare

    clear_caches()
    built = plan_layer(fmt, "trtllm", inter, hidden)
    given = _inputs(built, 2)
    want = _apply(built, given)
    for path in store.glob("*.plan"):
        path.unlink()
    clear_caches()
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float8_e4m3fn
    rows, padded_inter = 2 * built.padded_intermediate, built.padded_intermediate
    w13 = random_bytes((2, rows, hidden), dtype, seed=3)
    w2 = random_bytes((2, hidden, padded_inter), dtype, seed=4)
    if fmt == "bf16":
        prepare.convert_moe_weights_to_flashinfer_trtllm_block_layout({}, w13, w2, True)
    else:
        prepare.rotate_weights_for_fi_trtllm_fp8_per_tensor_moe(w13, w2, True)
    assert len(list(store.glob("*.plan"))) == 1  # the drop-in's plan
    clear_caches()
    from fimoe_lab import builders

    make = builders.plan_trtllm_bf16_block_layout if fmt == "bf16" else builders.plan_rotate_fp8_per_tensor
    inner = make(rows, hidden, padded_inter, True)  # what plan_layer composes: read back
    assert all(m.known_compiled() is not None for m in inner.maps().values())
    on_read = plan_layer(fmt, "trtllm", inter, hidden)
    assert all(same_bytes(g, w) for g, w in zip(_apply(on_read, given), want))


@pytest.mark.parametrize("kind, builder, s13, s2, dtype, extra", [d for d in DROP_INS if d[0] != "deepseek"])
def test_an_in_place_maps_cycle_plan_is_kept_and_read_back(store, kind, builder, s13, s2, dtype, extra):
    """An in-place drop-in's cycle plans, built after its first call (by the background planner; here as it does),
    go into the record at its next call; a later process has them without building any index, and an in-place run
    along them (the CPU cycle executor, which checks its map's sources first) moves the bytes of the first call. A
    plan that reads outside the map's cells is not used."""
    numba_gather = pytest.importorskip("fimoe_lab.kernels.numba_gather")
    from fimoe_lab import builders
    from fimoe_lab.kernels import cycles

    def slots(em) -> int:  # the CPU cycle executor's tile
        return max(1, numba_gather.CYCLES_TILE_BYTES // em.cell_bytes)

    w13 = random_bytes(s13, dtype, seed=5)
    w2 = coords(s2[0], s2[1], s2[2] * dtype.itemsize // 4).view(dtype)
    first = _drop_in(kind, w13, w2, extra)
    plan = getattr(builders, builder)(s13[1], s13[2], s2[2], *extra)
    built = {n: cycles.cycle_plan(m.compiled(), slots(m.compiled())) for n, m in plan.maps().items()}  # as the
    # planner does
    _drop_in(kind, w13, w2, extra)
    record = plan_store.loads(_record(store).read_bytes())
    for name, want in built.items():
        assert [c["tile_slots"] for c in record["maps"][name]["exec"]["cycles"]] == [want.tile_slots]
    clear_caches()

    again = getattr(builders, builder)(s13[1], s13[2], s2[2], *extra)
    for k, (name, m) in enumerate(again.maps().items()):
        em = m.known_compiled()
        assert em is not None and cycles.cycle_plan_built(em, slots(em)) and "src" not in vars(m)
        got, want = cycles.cycle_plan(em, slots(em)), built[name]
        assert all(np.array_equal(getattr(got, a), getattr(want, a)) for a in ("dst", "src", "saved"))
        x = (w13, w2)[k]
        flat = x.clone().view(x.shape[0], -1).view(torch.uint8)
        for _ in numba_gather.inplace_cycles_numba(em, flat, 1):
            pass
        assert same_bytes(flat, first[k].reshape(x.shape[0], -1).view(torch.uint8))
        assert cycles.cycle_plan(em, slots(em)) is got  # the run went along the plan read back
    clear_caches()

    spoiled = plan_store.loads(plan_store.dumps(record))
    entry = spoiled["maps"]["w2"]["exec"]["cycles"][0]
    entry["dst"] = np.full(4, 1 << 30, dtype=np.int32)  # far past the expert
    entry["src"] = np.zeros(4, dtype=np.int32)
    _record(store).write_bytes(plan_store.dumps(spoiled))
    spoilt = getattr(builders, builder)(s13[1], s13[2], s2[2], *extra)
    assert all(m.known_compiled() is None for m in spoilt.maps().values())


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=0, max_size=6),
    seed=st.integers(0, 2**31 - 1),
    nested=st.booleans(),
)
def test_a_record_with_tables_reads_back_as_written(sizes, seed, nested):
    """:func:`plan_store.dumps` / :func:`plan_store.loads`: JSON values and int32 tables of any sizes (random values,
    negatives and the extremes included) read back equal, the tables as writable int32 arrays of their own values;
    the file holds the tables' raw bytes (4 a value) after one line of JSON."""
    rng = np.random.default_rng(seed)
    tables = [rng.integers(-(2**31), 2**31, size=n, dtype=np.int64).astype(np.int32) for n in sizes]
    record = {"format": 3, "name": "a >> b", "fills": [0, 255], "none": None, "flag": True}
    if nested:
        record["maps"] = {f"m{k}": {"exec": {"cycles": [{"dst": t, "tile_slots": k}]}} for k, t in enumerate(tables)}
    else:
        record["row_forms"] = [[t, k, 7] for k, t in enumerate(tables)]
    data = plan_store.dumps(record)
    checksum, header, body = data.split(b"\n", 2)
    assert len(body) == 4 * sum(sizes) and b"\n" not in header and json.loads(header)["name"] == "a >> b"
    assert int(checksum, 16) == zlib.crc32(data[len(checksum) + 1 :]) and (len(data) - len(body)) % 8 == 0
    back = plan_store.loads(data)
    got = (
        [back["maps"][f"m{k}"]["exec"]["cycles"][0]["dst"] for k in range(len(tables))]
        if nested
        else [entry[0] for entry in back["row_forms"]]
    )
    for t, g in zip(tables, got):
        assert g.dtype == np.int32 and g.ndim == 1 and g.flags.writeable and np.array_equal(g, t)
    assert {k: v for k, v in back.items() if k not in ("maps", "row_forms")} == {
        k: v for k, v in record.items() if k not in ("maps", "row_forms")
    }


def _checked(body: bytes) -> bytes:
    """``body`` after the checksum line :func:`plan_store.dumps` writes."""
    return b"%08x\n" % zlib.crc32(body) + body


@pytest.mark.parametrize(
    "data",
    [
        _checked(b'{"t":{"int32":[0,3]}}\n' + np.arange(2, dtype="<i4").tobytes()),  # a table past the bytes after
        _checked(b'{"t":{"int32":[0,1]}}\n\x00\x00\x00'),  # not whole words
        _checked(b'{"t":{"int32":[-1,1]}}\n' + np.arange(2, dtype="<i4").tobytes()),  # a negative offset
        _checked(b'{"t":{"int32":["0",1]}}\n' + np.arange(2, dtype="<i4").tobytes()),  # not numbers
        _checked(b'{"t":1}'),  # no line of JSON before the tables
        _checked(b"[1, 2]\n"),  # not an object
        _checked(b"{not json}\n"),
        b'{"t":1}\n',  # no checksum
        b"00000000\n" + b'{"t":1}\n',  # a checksum of other bytes
        b"0000",  # shorter than a checksum line
    ],
)
def test_bytes_that_are_not_a_record_do_not_read(data):
    with pytest.raises(ValueError):
        plan_store.loads(data)


@settings(max_examples=80, deadline=None)
@given(where=st.floats(0, 1, exclude_max=True), flip=st.integers(1, 255))
@example(where=0.0, flip=0x20)  # a checksum digit's case changed: the same number, not the same line
def test_a_record_with_any_byte_changed_does_not_read(where, flip):
    """Any one byte of a record changed (its checksum line, its JSON or its tables) and :func:`plan_store.loads`
    refuses it: a damaged file is never used (a change inside a table would still parse)."""
    record = {"name": "m", "row_forms": [[np.arange(-50, 50, dtype=np.int32), 3, 4]], "fills": [7]}
    data = bytearray(plan_store.dumps(record))
    at = int(where * len(data))
    data[at] ^= flip
    with pytest.raises(ValueError):
        plan_store.loads(bytes(data))


@pytest.mark.parametrize("table", [np.arange(4, dtype=np.int64), np.zeros((2, 2), dtype=np.int32), [1, 2]])
def test_a_record_of_a_table_other_than_1d_int32_is_not_written(table):
    if isinstance(table, list):  # a list is a JSON value: written as one
        assert plan_store.loads(plan_store.dumps({"t": table})) == {"t": table}
        return
    with pytest.raises(TypeError):
        plan_store.dumps({"t": table})


def test_a_record_with_any_field_edited_is_built_again_or_runs(store):
    """Fields of a map's stored record set to other values, one at a time (80 seeded draws of a field and a value:
    zero, negatives, huge numbers, a string, null, a fraction, a boolean, a list, an object; its checksum written
    again, as an edit would): each time the plan is read or built again, and applying it raises nothing. (An edit
    that keeps within the checked bounds may still change the bytes it moves: the checksum is what catches damage.)"""
    import random

    given_, _ = _written()
    path = _record(store)
    original = path.read_bytes()
    maps = plan_store.loads(original)["maps"]
    spots = [p for p, v in json_paths(maps, ("maps",)) if v is None or isinstance(v, (int, float, str))]
    values = [0, -1, 1, 2, 3, 7, 1 << 40, -(1 << 40), "x", None, 0.5, True, [], {}]
    rng = random.Random(0)
    for _ in range(80):
        record = plan_store.loads(original)
        spot, value = rng.choice(spots), rng.choice(values)
        node = record
        for key in spot[:-1]:
            node = node[key]
        node[spot[-1]] = value
        path.write_bytes(plan_store.dumps(record))
        clear_caches()
        _apply(plan_layer("mxfp4", "trtllm", 1440, 736), given_)
