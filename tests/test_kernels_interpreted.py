"""The Triton executor's own kernels, run by Triton's interpreter on the CPU (``TRITON_INTERPRET=1``),
are bit-exact with a per-expert loop over each map's byte sources, on every CI run.

The GPU runs them compiled (``tests/test_kernels_gpu.py``, on the lent H200); here the same kernels and
the same Python around them (tile choice, cached plans, the launch) run without a GPU: out of place
for every map of five formats (1-D, 2-D, padded-row, 128x4-swizzle and per-word tiles, each tile
table of the sweeps), and in place along cycle plans, the bands-local scale launch and the
cooperative scale kernel as one program, twice on the same synchronisation words (one or two items an
expert, so every item it waits for was loaded before: the interpreter runs one program at a time; many
programs waiting for each other run on the H200 in ``tests/test_kernels_gpu.py``). The interpreter
lives in its own environment (``.venv-triton``: Triton 3.6 on CPU torch, ``.ci/run``;
``FIMOE_TRITON_PYTHON`` names another); without it these tests skip.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest

pytestmark = pytest.mark.slow  # CI (and FIMOE_FULL_TESTS=1) runs it; a plain pytest leaves it out

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYTHON = os.environ.get("FIMOE_TRITON_PYTHON") or str(ROOT / ".venv-triton" / "bin" / "python")

# (format, intermediate, hidden, plan_layer keywords)
LAYERS = [
    ("fp8", 256, 512, {}),
    ("fp8", 232, 320, {"is_act_and_mul": False, "is_gated": False}),
    ("fp8-block", 256, 512, {}),
    ("mxfp8", 192, 320, {}),
    ("mxfp8", 768, 256, {}),  # W2 scale rows of 24 bytes: half-band tiles, rows in source pairs, a masked overhang
    ("nvfp4", 256, 512, {}),
    ("bf16", 96, 160, {}),
]
TILE_TABLES = {
    "default": {},
    "large tiles": {"tile_words": 4096, "tile_2d_words": 4096},
    "1-D only": {"tile_2d_max_cell": 0},
    "narrow chunks": {"wide_below": 0, "swizzle_wide_below": 0, "swizzle_kw": 32},
    "no fast forms": {"use_swizzle": False, "use_padrows": False},
    "full row tables": {"swizzle_band_step": False},
    "split bands": {"swizzle_split": 4},
    "split bands, full row tables": {"swizzle_split": 2, "swizzle_band_step": False},
}
IN_PLACE = [  # (format, tensor, strategy)
    ("fp8", "w13", "cycles"),
    ("fp8", "w2", "cycles"),
    ("fp8-block", "w13", "cycles"),
    ("bf16", "w2", "cycles"),
    ("mxfp8", "w2_scale", "bands"),
    ("nvfp4", "w2_scale", "bands"),
    ("nvfp4", "w2_scale", "bands, full row table"),
    ("nvfp4", "w13_scale", "one program, 1 item an expert"),
    ("nvfp4", "w13_scale", "one program, 2 items an expert"),
    ("mxfp8", "w13_scale", "one program, 2 items an expert"),
    ("mxfp8", "w13_scale", "one program, 2 items an expert, full row table"),
    ("nvfp4", "w13_scale", "one program, 1 item an expert, full row table"),
]

CHILD = r"""
import json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
from fimoe_lab.kernels import triton_gather as tg
from fimoe_lab.kernels.tiles import band_item_readers, next_pow2
from fimoe_lab.prepare import plan_layer
from reference_loops import byte_gather as reference

layers, tables, in_place = json.loads(sys.argv[1])


def inputs(m, experts, offset):
    codes = torch.arange(experts * (m.in_bytes // 4 + 1), dtype=torch.int32).add_(1).view(torch.uint8)
    coded = codes[: experts * m.in_bytes].view(experts, m.in_bytes)
    rand = torch.randint(0, 256, (experts, m.in_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    for x in (coded, rand):
        buf = torch.empty(experts * m.in_bytes + 16, dtype=torch.uint8)
        placed = buf[offset : offset + x.numel()].view(experts, m.in_bytes)
        placed.copy_(x)
        yield placed


results = {}
for fmt, inter, hidden, kw in layers:
    for name, m in plan_layer(fmt, "trtllm", inter, hidden, **kw).maps().items():
        em = m.compiled()
        for table, cfg in tables.items():
            for offset in (0, 2) if table == "default" else (0,):  # 2: the executor falls back to 2-byte words
                ok = True
                for x in inputs(m, 3, offset):
                    want = reference(m, x)
                    ob = torch.full((3 * m.out_bytes + 16,), 0xAB, dtype=torch.uint8)
                    out = ob[offset : offset + 3 * m.out_bytes].view(3, m.out_bytes)
                    tg.gather_triton(em, x, out, cfg)
                    ok &= bool(torch.equal(out, want))
                results[f"{fmt}-{inter}x{hidden}-{name}-{table}-offset{offset}"] = ok
for fmt, tensor, strategy in in_place:
    m = getattr(plan_layer(fmt, "trtllm", 256, 512), tensor)
    em = m.compiled()
    ok = True
    for x in inputs(m, 5, 0):
        want = reference(m, x)
        if strategy == "cycles":
            for _ in tg.inplace_cycles(em, x, 2):
                pass
        elif strategy.startswith("one program"):
            rows, cw, n_rows = em.swizzle
            assert em.band_step() == 64  # the gate/up interleave: band b reads the first band's rows + 64 b
            step = 0 if strategy.endswith("full row table") else 64
            n_bands, items = n_rows // 128, int(strategy.split(", ")[1][0])
            nb = next_pow2(n_bands) // items
            readers = torch.from_numpy(band_item_readers(rows, cw, next_pow2(cw), 1, nb))
            assert readers.shape[1] == (1 if items == 1 else 2)
            sync = torch.zeros(2 + 5 * items, dtype=torch.int64)
            for launch in (1, 2):  # the second permutes again, its flags counted by its own number
                if launch == 2:
                    want = reference(m, want)
                tg._swizzled_bands_in_place[(1,)](
                    x.view(torch.int32), torch.from_numpy(rows[:128] if step else rows), readers, sync, 5,
                    m.in_bytes // 4, n_bands, items,
                    CW=cw, KW=next_pow2(cw), NK=1, NB=nb, ND=readers.shape[1], EVICT=False, STCS=False, BS=step,
                )
                ok &= sync[0].item() == launch and sync[1].item() == 0 and bool((sync[2:] == launch).all())
                ok &= bool(torch.equal(x, want))
        else:
            assert em.bands_local() and em.band_step() == 128
            cfg = {"swizzle_band_step": not strategy.endswith("full row table")}
            for _ in tg.inplace_swizzled_bands(em, x, 1, cfg):
                pass
        ok &= bool(torch.equal(x, want))
    results[f"in-place-{fmt}-{tensor}-{strategy}"] = ok
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def interpreted():
    if not os.path.exists(PYTHON):
        pytest.skip(f"no Triton interpreter environment at {PYTHON} (.ci/run makes .venv-triton)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "TRITON_INTERPRET": "1"}
    spec = json.dumps([LAYERS, TILE_TABLES, IN_PLACE])
    done = subprocess.run([PYTHON, "-c", CHILD, spec], env=env, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_interpreted_gathers_are_exact_for_every_map_and_tile_table(interpreted):
    gathers = {k: v for k, v in interpreted.items() if not k.startswith("in-place")}
    assert len(gathers) >= len(LAYERS) * 2 * (len(TILE_TABLES) + 1)  # two maps a layer at least
    assert [k for k, ok in gathers.items() if not ok] == []


@pytest.mark.parametrize("fmt,tensor,strategy", IN_PLACE)
def test_interpreted_in_place_is_exact(interpreted, fmt, tensor, strategy):
    assert interpreted[f"in-place-{fmt}-{tensor}-{strategy}"] is True
