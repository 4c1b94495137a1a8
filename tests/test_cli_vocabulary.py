"""One vocabulary across the subcommands: one name per concept shown in --help, the old spellings kept as hidden
aliases, engine names for their newest profile, a model given as a preset, a sample, a checkpoint or a config.json
everywhere, the format read from a checkpoint, and "does not exist" for a missing path."""

from __future__ import annotations

import argparse
import json
import re
import shutil

import pytest

from fimoe_lab import engines
from fimoe_lab.cli import build_parser, main
from fimoe_lab.resources import sample_path


def subparsers() -> dict[str, argparse.ArgumentParser]:
    root = build_parser()
    (sub,) = [a for a in root._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


OLD_SPELLINGS = ("--inter", "--tp-size", "--tp-rank")


@pytest.mark.parametrize("command", sorted(subparsers()))
def test_help_shows_one_name_per_concept_and_documents_every_option(command):
    parser = subparsers()[command]
    text = parser.format_help()
    for old in OLD_SPELLINGS:
        assert not re.search(rf"{old}(?![\w-])", text), (command, old)
    for action in parser._actions:
        assert action.help and action.help != argparse.SUPPRESS, (command, action.option_strings or action.dest)


SIZE_COMMANDS = {
    "plan": ["plan"],
    "tune": ["tune", "--model", "deepseek-v3"],
    "tactics": ["tactics", "--format", "bf16", "--top-k", "2", "--local-experts", "8"],
    "warmup": ["warmup"],
}


@pytest.mark.parametrize("command", sorted(SIZE_COMMANDS))
def test_intermediate_and_hidden_are_the_same_words_everywhere(command):
    base = SIZE_COMMANDS[command]
    new = parse([*base, "--intermediate", "768", "--hidden", "2048"])
    old = parse([*base, "--inter", "768", "--hidden", "2048"])
    assert new.intermediate == old.intermediate == 768 and new.hidden == 2048
    assert "--intermediate I" in subparsers()[command].format_help()


def test_tp_and_rank_are_the_same_words_everywhere():
    dump = "dump.safetensors"
    for argv in (["--tp", "2", "--rank", "1"], ["--tp-size", "2", "--tp-rank", "1"], ["--tp", "2", "--tp-rank", "1"]):
        got = parse(["diagnose", "mixtral-bf16", dump, *argv])
        assert (got.tp, got.rank) == (2, 1), argv
        got = parse(["convert", "mixtral-bf16", "out", "--backend", "trtllm", *argv])
        assert (got.tp, got.rank) == (2, 1), argv
    assert parse(["convert", "s", "o", "--backend", "cutlass", "--tp", "4", "--rank", "all"]).rank == "all"
    for command in (["tune", "--model", "deepseek-v3"], ["warmup"], ["demo"]):
        assert parse([*command, "--tp-size", "4"]).tp == parse([*command, "--tp", "4"]).tp == 4
    assert parse(["inspect", "s", "--tp-size", "1,2"]).tp == parse(["inspect", "s", "--tp", "1,2"]).tp == (1, 2)


def test_expert_counts_have_distinct_names_for_distinct_meanings():
    """Routed experts in a layer (--experts), experts on one rank (tactics --local-experts), experts to compare
    by index (diagnose --expert-ids); the old spelling --experts still reaches each."""
    assert parse(["tune", "--model", "deepseek-v3", "--experts", "64"]).experts == 64
    assert parse(["plan", "--experts", "3"]).experts == 3
    tactics = ["tactics", "--format", "bf16", "--intermediate", "8", "--hidden", "8", "--top-k", "2"]
    assert parse([*tactics, "--local-experts", "5"]).local_experts == parse([*tactics, "--experts", "5"]).local_experts
    got = parse(["diagnose", "mixtral-bf16", "d.pt", "--experts", "0,2"])
    assert got.expert_ids == parse(["diagnose", "mixtral-bf16", "d.pt", "--expert-ids", "0,2"]).expert_ids == (0, 2)
    assert "--local-experts E" in subparsers()["tactics"].format_help()
    assert "--expert-ids" in subparsers()["diagnose"].format_help()


def newest_by_table() -> dict[str, str]:
    """Each engine's profile of the highest version among the choices, from the profile table."""
    out: dict[str, str] = {}
    for name in engines.ENGINE_CHOICES:
        p = engines.ENGINES[name]
        v = tuple(int(x) for x in p.version.split("."))
        if p.engine not in out or v > tuple(int(x) for x in engines.ENGINES[out[p.engine]].version.split(".")):
            out[p.engine] = name
    return out


def test_engine_names_mean_their_newest_profile():
    newest = newest_by_table()
    assert set(newest) == {"vllm", "sglang", "flashinfer"}
    for engine, profile in newest.items():
        for argv in (
            ["plan"],
            ["inspect", "s"],
            ["tune", "--model", "deepseek-v3"],
            ["convert", "s", "o", "--backend", "trtllm"],
        ):
            assert parse([*argv, "--engine", engine]).engine == profile, (argv, engine)
            assert parse([*argv, "--engine", engine.upper()]).engine == profile
            assert parse([*argv, "--engine", profile]).engine == profile
    assert parse(["plan", "--engine", "flashinfer-0.6.13"]).engine == "flashinfer-0.6.13"  # an older one by name


def test_an_unknown_engine_is_one_line(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--engine", "tensorrt"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown engine 'tensorrt'" in err[0] and "vllm" in err[0]


def tune_json(capsys, argv: list[str]) -> tuple[int, dict | None, str]:
    code = main(["tune", *argv, "--source", "model", "--tokens", "8", "--json"])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else None), err


@pytest.mark.parametrize("how", ["sample", "directory", "config-in-directory", "--model sample"])
def test_tune_takes_a_sample_or_checkpoint_and_reads_its_format(capsys, how):
    where = sample_path("deepseek-v3-fp8")
    argv = {
        "sample": ["deepseek-v3-fp8"],
        "directory": [str(where)],
        "config-in-directory": [str(where / "config.json")],
        "--model sample": ["--model", "deepseek-v3-fp8"],
    }[how]
    code, doc, err = tune_json(capsys, argv)
    assert code == 0, err
    assert doc["attrs"]["format"] == "fp8-block"
    with open(where / "config.json") as f:
        config = json.load(f)
    assert {r["hidden"] for r in doc["rows"]} >= {config["hidden_size"]}


def test_tune_a_config_alone_asks_for_the_format(capsys, tmp_path):
    shutil.copy(sample_path("qwen3-moe-bf16") / "config.json", tmp_path / "config.json")
    code, _, err = tune_json(capsys, [str(tmp_path / "config.json")])
    assert code == 2 and "no --format" in err and "pass --format" in err and len(err.strip().splitlines()) == 1
    code, doc, err = tune_json(capsys, [str(tmp_path / "config.json"), "--format", "bf16"])
    assert code == 0 and doc["attrs"]["format"] == "bf16", err


@pytest.mark.parametrize(
    "argv",
    [
        ["tune", "{missing}"],
        ["tune", "--model", "{missing}"],
        ["inspect", "{missing}"],
        ["convert", "{missing}", "{out}", "--backend", "trtllm"],
        ["diagnose", "{missing}", "{out}"],
        ["demo", "{missing}", "--out", "{out}"],
        ["warmup", "--model", "{missing}"],
    ],
)
def test_a_missing_model_path_does_not_exist(capsys, tmp_path, argv):
    missing, out = tmp_path / "no" / "such-model", tmp_path / "out"
    code = main([a.format(missing=missing, out=out) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and f"{missing} does not exist" in err[0], err
    assert not out.exists()


@pytest.mark.parametrize(
    "model,fmt", [("deepseek-v3-fp8", "fp8-block"), ("gpt-oss-mxfp4", "mxfp4"), ("mixtral-bf16", "bf16")]
)
def test_warmup_takes_a_sample_and_reads_its_format(capsys, model, fmt):
    assert main(["warmup", "--model", model, "--no-in-place", "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert runs and {r["fmt"] for r in runs} == {fmt}
    assert main(["warmup", "--model", str(sample_path(model)), "--no-in-place", "--json"]) == 0
    assert {r["fmt"] for r in json.loads(capsys.readouterr().out)["runs"]} == {fmt}


@pytest.mark.parametrize("fmt,inter,tp", [("bf16", 512, 4), ("fp8-block", 512, 2), ("nvfp4", 640, 2)])
def test_plan_takes_tp_like_convert(capsys, fmt, inter, tp):
    """plan --tp N plans rank 0's equal slice of --intermediate: the same tensors as planning I / N at TP 1."""
    base = ["plan", "--format", fmt, "--backend", "trtllm", "--hidden", "256", "--json"]
    assert main([*base, "--intermediate", str(inter), "--tp", str(tp)]) == 0
    split = json.loads(capsys.readouterr().out)
    assert main([*base, "--intermediate", str(inter // tp)]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert split["layer"]["tp"] == tp and split["plans"][0]["intermediate"] == inter // tp
    strip = lambda doc: [{k: v for k, v in t.items() if k != "ms"} for t in doc["plans"][0]["tensors"]]  # noqa: E731
    assert strip(split) == strip(whole) and strip(split)


def test_plan_tp_that_cuts_a_scale_block_cannot_run(capsys):
    code = main(["plan", "--format", "fp8-block", "--backend", "trtllm", "--intermediate", "256", "--tp", "4"])
    out, err = capsys.readouterr()
    assert code == 2 and "cannot run: tp=4 gives intermediate 64 per rank" in out and len(err.splitlines()) == 1


@pytest.mark.parametrize("command", [["inspect"], ["convert", "{out}", "--backend", "trtllm"], ["diagnose", "{out}"]])
def test_a_preset_where_weights_are_read_says_so(capsys, tmp_path, command):
    argv = [command[0], "deepseek-v3", *(a.format(out=tmp_path / "o") for a in command[1:])]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "deepseek-v3 is a model preset (sizes only)" in err[0] and "deepseek-v3-fp8" in err[0]
    assert not (tmp_path / "o").exists()


def test_format_and_backend_are_one_word_in_any_case_on_every_command():
    """Every command that takes --format or --backend takes the same names, any case, and names them the same
    way in --help."""
    seen = {"--format": 0, "--backend": 0}
    for command, parser in subparsers().items():
        for action in parser._actions:
            for flag in set(action.option_strings) & set(seen):
                seen[flag] += 1
                name = "fp8" if flag == "--format" else "trtllm"
                assert action.type(name.upper()) == name, (command, flag)
                with pytest.raises(argparse.ArgumentTypeError):
                    action.type("no-such-" + name)
                assert action.metavar == (
                    "FMT" if flag == "--format" else "trtllm|cutlass" + ("|all" if action.default == "all" else "")
                ), (command, action.metavar)
    assert seen["--format"] >= 4 and seen["--backend"] >= 4, seen
