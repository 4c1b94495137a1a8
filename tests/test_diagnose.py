"""``fimoe-lab diagnose``: the variant that produced dumped kernel tensors is found, per expert.

The dumps are made here by applying known maps (the plan, the plan without its swap, a
wrong epilogue tile) to a shipped sample checkpoint; the expected answer is the map used.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from fimoe_lab import diagnose, steps
from fimoe_lab.cli import _common, build_parser
from fimoe_lab.cli import diagnose as diagnose_cli
from fimoe_lab.errors import FimoeError
from fimoe_lab.layout import compose

checkpoints = pytest.importorskip("fimoe_lab.checkpoints")
SAMPLE = "deepseek-r1-nvfp4"


@pytest.fixture(scope="module")
def layer():
    if SAMPLE not in checkpoints.sample_names():
        pytest.skip("sample checkpoints are not in this checkout")
    ck = checkpoints.open_checkpoint(checkpoints.sample_path(SAMPLE))
    return ck.read_layer(ck.moe_layers[0])


def main(argv: list[str]) -> int:
    """``fimoe-lab diagnose ...``: through the real CLI once its group is registered, else the same dispatch."""
    from fimoe_lab import cli

    if "diagnose" in build_parser()._subparsers._group_actions[0].choices:  # type: ignore[union-attr]
        return cli.main(argv)
    parser = _common.Parser(prog="fimoe-lab")
    diagnose_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except Exception as exc:
        return _common.report_error(exc, args.command, False)


def planned(moe):
    from fimoe_lab.recipes import plan_layer

    return plan_layer(moe.fmt, "trtllm", moe.intermediate, moe.hidden, moe.is_act_and_mul, moe.is_gated)


def test_tensor_roles_from_engine_names():
    roles = {
        "w13_weight": "w13",
        "experts.w13_weight_scale": "w13_scale",
        "gemm1_weights": "w13",
        "gemm1_scales": "w13_scale",
        "w2_weight": "w2",
        "gemm2_weights_scale": "w2_scale",
        "w13_weight_scale_2": None,
        "w2_input_scale": None,
        "router": None,
    }
    assert {n: diagnose.tensor_role(n) for n in roles} == roles


def test_the_planned_preparation_is_recognized(layer, tmp_path):
    plan = planned(layer)
    dump = {"w13_weight": plan.w13.apply(layer.w13), "w13_weight_scale": plan.w13_scale.apply(layer.w13_scale)}
    result = diagnose.diagnose(layer, dump)
    for role in ("w13", "w13_scale"):
        t = result.tensors[role]
        assert t.explained() and t.best[0] == t.planned, t.summary()
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in dump.items()}, str(tmp_path / "dump.safetensors"))
    assert main(["diagnose", SAMPLE, str(tmp_path / "dump.safetensors"), "--experts", "0,1"]) == 0


def test_a_missing_swap_and_a_wrong_epilogue_tile_are_found_per_expert(layer, tmp_path, capsys):
    plan = planned(layer)
    no_swap = compose(*[s for s in plan.w13.steps if s.kind != "swap_w13_to_w31_rows"])
    shuffle = next(s for s in plan.w13_scale.steps if s.kind == "shuffle_rows_for_epilogue")
    other = 64 if shuffle.params["epilogue_tile_m"] == 128 else 128
    wrong_tile = compose(
        *[steps.shuffle_rows_for_epilogue(*s.in_shape, other) if s is shuffle else s for s in plan.w13_scale.steps]
    )
    w13 = plan.w13.apply(layer.w13)
    w13[1] = no_swap.apply(layer.w13[1:2])[0]  # only expert 1 was loaded without the swap
    dump = {"gemm1_weights": w13, "gemm1_scales": wrong_tile.apply(layer.w13_scale)}
    result = diagnose.diagnose(layer, dump, experts=[0, 1])
    w = result.tensors["w13"]
    assert not w.explained() and w.best[0] == w.planned and w.best[1][0] == 1.0 and w.best[1][1] < 1.0
    by_name = dict(w.ranked)
    assert by_name[f"{w.planned} without swap_w13_to_w31_rows"] == [
        pytest.approx(by_name[f"{w.planned} without swap_w13_to_w31_rows"][0]),
        1.0,
    ]
    s = result.tensors["w13_scale"]
    assert s.explained() and s.best[0].endswith(f"with epilogue_tile_m={other}")
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in dump.items()}, str(tmp_path / "dump.safetensors"))
    code = main(
        [
            "diagnose",
            SAMPLE,
            str(tmp_path / "dump.safetensors"),
            "--experts",
            "0,1",
            "--json",
            "--figure",
            str(tmp_path / "diag.png"),
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and out["tensors"]["w13_scale"]["best"].endswith(f"epilogue_tile_m={other}")
    assert (tmp_path / "diag.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_inputs_are_one_line_errors(layer, tmp_path, capsys):
    (tmp_path / "x.npy").write_bytes(b"0")
    assert main(["diagnose", SAMPLE, str(tmp_path / "x.npy")]) == 2
    assert main(["diagnose", SAMPLE, str(tmp_path / "none.pt")]) == 2
    from safetensors.torch import save_file

    save_file({"router": torch.arange(4.0).reshape(2, 2)}, str(tmp_path / "r.safetensors"))
    assert main(["diagnose", SAMPLE, str(tmp_path / "r.safetensors")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(l.startswith("error: ") and "(fix: " in l for l in err)
    with pytest.raises(FimoeError, match="outside 0.."):
        diagnose.diagnose(layer, {"w13": layer.w13}, experts=[999])


def test_the_diagnose_explorer_finds_a_missing_swizzle(layer, tmp_path):
    widgets = pytest.importorskip("fimoe_lab.viz.widgets")
    plan = planned(layer)
    rows_only = compose(*plan.w13_scale.steps[:-1])
    assert plan.w13_scale.steps[-1].kind == "swizzle_scales_128x4"
    from safetensors.torch import save_file

    save_file({"w13_weight_scale": rows_only.apply(layer.w13_scale).contiguous()}, str(tmp_path / "d.safetensors"))
    w = widgets.DiagnoseExplorer()
    assert "fill both boxes" in w.message.value and w.figure is None
    w.checkpoint.value, w.dump.value = SAMPLE, str(tmp_path / "d.safetensors")
    t = w.state["diagnosis"].tensors["w13_scale"]
    assert t.explained() and t.best[0].endswith("without swizzle_scales_128x4") and w.figure is not None
    assert "without swizzle_scales_128x4 explains" in w.message.value


@pytest.fixture(scope="module")
def bf16_layer():
    ck = checkpoints.open_checkpoint(checkpoints.sample_path("mixtral-bf16"))
    return ck.read_layer(ck.moe_layers[0])


def test_an_sglang_prepared_dump_is_named_by_its_engine_profile_first(bf16_layer, tmp_path, capsys):
    """SGLang 0.5.23 keeps BF16 TRT-LLM W13 as [gate; up] (no W31 swap): the dump is explained by the
    sglang-0.5.23 profile's own plan, named first; the default profile without its swap is named as equal, after."""
    from fimoe_lab.engines import DEFAULT_ENGINE
    from fimoe_lab.recipes import plan_layer

    moe = bf16_layer
    plan = plan_layer(moe.fmt, "trtllm", moe.intermediate, moe.hidden, engine="sglang-0.5.23")
    dump = {"w13_weight": plan.w13.apply(moe.w13), "w2_weight": plan.w2.apply(moe.w2)}
    d = diagnose.diagnose(moe, dump)
    w13 = d.tensors["w13"]
    assert w13.explained() and w13.best[0] == "sglang-0.5.23/trtllm", w13.summary()
    assert f"{DEFAULT_ENGINE}/trtllm without swap_w13_to_w31_rows" in w13.equally()
    assert "default engine" not in d.summary()
    line = w13.summary()
    assert line.index("sglang-0.5.23/trtllm") < line.index("equally:") < line.index("without swap_w13_to_w31_rows")
    save_file({k: v.contiguous() for k, v in dump.items()}, str(tmp_path / "dump.safetensors"))
    assert main(["diagnose", "mixtral-bf16", str(tmp_path / "dump.safetensors"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)["tensors"]["w13"]
    assert doc["best"] == "sglang-0.5.23/trtllm" and doc["equally"] == w13.equally()


def test_equal_variants_are_every_name_of_the_same_bytes(bf16_layer):
    """``equally`` lists exactly the other variants whose maps give the best one's bytes (checked map by map)."""
    moe = bf16_layer
    cands, planned = diagnose.variants(moe, "w13")
    assert planned == "vllm-0.34/trtllm" and len({diagnose._fingerprint(v.m) for v in cands}) == len(cands)
    names = [n for v in cands for n in (v.name, *v.also)]
    assert len(names) == len(set(names)) and not any(n.startswith("None") for n in names)
    for v in cands:  # a variant's first name is an unmodified profile plan whenever one builds the same map
        if any("without" not in n and "with " not in n and "aligned" not in n for n in v.also):
            assert "without" not in v.name and "with " not in v.name and "aligned" not in v.name, (v.name, v.also)
