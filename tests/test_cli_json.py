"""``--json`` on ``plan``, ``demo``, ``goldens``, ``inspect``, ``convert`` and ``restore``: one JSON object on
stdout and nothing else, the fields the ``--help`` text names, the same facts as the table (and, for the
checkpoint commands, as the safetensors headers and the written files' sizes), and the same exit codes."""

from __future__ import annotations

import json
import math
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fimoe_lab.cli import build_parser, main
from fimoe_lab.cli._common import EXIT_BAD_INPUT
from fimoe_lab.cli.core import DEMO_JSON, GOLDENS_JSON, PLAN_JSON
from fimoe_lab.resources import sample_names, sample_path
from tests.test_viz import ref_w13_rows


def run_json(capsys, argv: list[str]) -> tuple[int, dict, str]:
    """``(exit status, the parsed stdout, stderr)`` of ``fimoe-lab ARGV --json``; stdout must be exactly one JSON."""
    code = main(argv + ["--json"])
    out = capsys.readouterr()
    return code, json.loads(out.out), out.err


def keys_of(schema: str) -> set[str]:
    """The quoted field names of a ``--help`` schema."""
    return set(re.findall(r'"(\w+)"', schema))


def test_help_of_each_command_gives_its_json_fields():
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    for command, schema in (("plan", PLAN_JSON), ("demo", DEMO_JSON), ("goldens", GOLDENS_JSON)):
        text = " ".join(sub[command].format_help().split())
        assert "--json" in text and " ".join(schema.split()) in text


def test_plan_json_has_the_table_facts_and_traces_a_byte(capsys):
    argv = ["plan", "--format", "mxfp8", "--backend", "trtllm", "--intermediate", "96", "--hidden", "160"]
    code, doc, err = run_json(capsys, argv + ["--where", "5,3"])
    assert code == 0 and err == ""
    assert set(doc) | set(doc["layer"]) | {k for p in doc["plans"] for k in p} <= keys_of(PLAN_JSON)
    want = dict(intermediate=96, tp=1, hidden=160, experts=4, gated=True, per_token=False, mxfp4_activation=None)
    assert doc["layer"] == want
    (plan,) = doc["plans"]
    assert plan["cannot"] is None and doc["failures"] == 0
    assert all(t["round_trip"] for t in plan["tensors"])
    w13 = plan["tensors"][0]
    assert w13["name"] == "w13" and w13["in_shape"] == [2 * 96, 160]  # one byte per MXFP8 element
    # the trace: kernel byte (5, 3) of w13 comes from checkpoint row ref_w13_rows(96, 128)[5], column 3
    padded = w13["out_shape"][0] // 2
    assert plan["where"][0]["coords"] == [5, 3]
    assert plan["where"][-1]["coords"] == [int(ref_w13_rows(96, padded)[5]), 3]
    # the table says the same
    assert main(argv) == 0
    table = capsys.readouterr().out
    for t in plan["tensors"]:
        row = (
            f"{t['name']:<10} {str(tuple(t['in_shape'])):<14} {str(tuple(t['out_shape'])):<18} {t['pad_percent']:6.1f}"
        )
        assert row in table and " >> ".join(t["steps"]) in table


def test_plan_json_that_cannot_run_still_prints_json_and_exits_2(capsys):
    argv = ["plan", "--format", "fp8-block", "--intermediate", "100", "--backend", "trtllm"]
    code, doc, err = run_json(capsys, argv)
    assert code == EXIT_BAD_INPUT
    (plan,) = doc["plans"]
    assert plan["tensors"] == [] and "not a multiple of the 128-row scale block" in plan["cannot"]
    (line,) = err.splitlines()
    assert line.startswith("error: plan: fp8-block trtllm cannot lay out intermediate 100") and "'cannot'" in line


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(inter=st.integers(1, 300), hidden=st.integers(1, 40).map(lambda h: 16 * h), experts=st.integers(1, 3))
def test_plan_json_shapes_for_any_size(capsys, inter, hidden, experts):
    argv = ["plan", "--format", "fp8", "--backend", "cutlass", "--intermediate", str(inter), "--hidden", str(hidden)]
    code, doc, _ = run_json(capsys, argv + ["--experts", str(experts)])
    (plan,) = doc["plans"]
    if plan["cannot"] is not None:
        assert code == EXIT_BAD_INPUT and plan["tensors"] == []
        return
    assert code == 0 and doc["failures"] == 0 and doc["layer"]["experts"] == experts
    shapes = {t["name"]: t for t in plan["tensors"]}
    # w2 is listed only when a step moves it (FP8 per-tensor on CUTLASS pads nothing and keeps w2 as it is)
    assert shapes["w13"]["in_shape"] == [2 * inter, hidden] and shapes.get("w2", {"in_shape": [hidden, inter]})[
        "in_shape"
    ] == [hidden, inter]
    for t in plan["tensors"]:
        want = 100.0 * (1 - math.prod(t["in_shape"]) / math.prod(t["out_shape"]))
        assert abs(t["pad_percent"] - want) < 1e-3 and t["round_trip"]


def test_demo_json_lists_every_layer_and_backend(tmp_path, capsys):
    code, doc, err = run_json(capsys, ["demo", "deepseek-v3-fp8", "--out", str(tmp_path)])
    assert code == 0 and doc["failures"] == 0 and doc["tp"] == 2 and doc["out"] == str(tmp_path)
    assert set(doc) | {k for r in doc["layers"] + doc["health"] for k in r} <= keys_of(DEMO_JSON)
    assert any("dead expert" in h["warning"] for h in doc["health"])  # the sample has one, planted
    backends = {(r["layer"], r["backend"]) for r in doc["layers"]}
    assert {b for _, b in backends} == {"trtllm", "cutlass"} and len(backends) == len(doc["layers"])
    for r in doc["layers"]:
        path = tmp_path / f"deepseek-v3-fp8-L{r['layer']}-{r['backend']}-tp2.safetensors"
        assert r["cannot"] is None and r["exact"] and r["bytes"] == path.stat().st_size
        assert r["padded_intermediate"] >= r["intermediate"]


def test_goldens_json(capsys, tmp_path, monkeypatch):
    from fimoe_lab import goldens

    paths = goldens.default_golden_paths()
    if paths:
        code, doc, _ = run_json(capsys, ["goldens"])
        assert code == 0 and doc["total"] == len(doc["cases"]) == doc["reproduced"] > 0
        assert all(c["ok"] and c["file"] in map(str, paths) for c in doc["cases"])
        assert set(doc) | {k for c in doc["cases"] for k in c} <= keys_of(GOLDENS_JSON)
    # nothing to replay: exit 2, one error line, nothing on stdout
    monkeypatch.setenv("FIMOE_GOLDENS", str(tmp_path))
    assert main(["goldens", "--json"]) == EXIT_BAD_INPUT
    out = capsys.readouterr()
    assert out.out == "" and len(out.err.splitlines()) == 1 and out.err.startswith("error: goldens: ")
    if not paths:
        pytest.skip("no golden files found (set FIMOE_GOLDENS or place shared/goldens beside the checkout)")


# ----------------------------------------------------------------------------- inspect, convert, restore
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "BF16": 2, "F16": 2, "I16": 2, "F32": 4, "I32": 4}
"""Bytes per element of each safetensors dtype (the format's own table, written out here)."""
KERNEL_SUFFIXES = (".w13_weight", ".w2_weight", ".w13_weight_scale", ".w2_weight_scale")


def header_entries(files) -> dict[str, dict]:
    """Every tensor's header entry (dtype, shape, data_offsets) of the safetensors ``files``, read by safe_io."""
    from fimoe_lab.checkpoints.safe_io import safetensors_header

    entries: dict[str, dict] = {}
    for f in files:
        header, _ = safetensors_header(f)
        entries.update({k: v for k, v in header.items() if k != "__metadata__"})
    return entries


def nbytes(entry: dict) -> int:
    start, end = entry["data_offsets"]
    assert end - start == math.prod(entry["shape"]) * ITEMSIZE[entry["dtype"]]
    return end - start


def plain_progress(err: str) -> bool:
    """stderr of a convert whose stderr is no terminal: plain progress lines only (no carriage return, no bar),
    per output rising percentages that end at 100%."""
    from fimoe_lab.cli._common import PROGRESS_LINE

    assert "\r" not in err and "\x1b" not in err
    seen: dict[str, list[int]] = {}
    for line in err.splitlines():
        m = PROGRESS_LINE.fullmatch(line)
        assert m, line
        seen.setdefault(m["desc"], []).append(int(m["percent"]))
    assert seen and all(p == sorted(set(p)) and p[-1] == 100 for p in seen.values()), seen
    return True


def _clock_text(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 3600}:{(s % 3600) // 60:02d}:{s % 60:02d}"


def test_plain_progress_prints_a_line_per_tenth_or_per_interval_with_rate_and_eta():
    import io
    import random
    from functools import partial

    from fimoe_lab.cli._common import PROGRESS_LINE, PlainProgress

    rng = random.Random(0)
    for total in (1, 7, 10, 999, 123_456, 50_000_000):
        stream, now = io.StringIO(), [1000.0]  # min(now): the fake clock's one reading
        bar = PlainProgress(total=total, desc="convert -> x", stream=stream, interval=30.0, clock=partial(min, now))
        done, want, last, shown = 0, [], 1000.0, 0
        while done < total:
            n = rng.randint(1, max(1, total // 3))
            now[0] += rng.choice((0.5, 7.0, 31.0))
            before, done = done, min(done + n, total)
            crossed = [k for k in range(1, 11) if before * 10 < k * total <= done * 10]  # tenths reached now
            if crossed or (now[0] - last >= 30.0 and shown < 10):
                shown, last = max(shown, *crossed, 0), now[0]
                rate = done / (now[0] - 1000.0)
                eta = _clock_text((total - done) / rate)
                pct = 100 * done // total
                want.append(
                    f"convert -> x: {pct}% ({done / 1e6:.2f} of {total / 1e6:.2f} MB, {rate / 1e6:.1f} MB/s, ETA {eta})"
                )
            bar.update(done - before)
        bar.close()
        got = stream.getvalue().splitlines()
        assert got == want and want[-1].startswith("convert -> x: 100%") and want[-1].endswith("ETA 0:00:00)")
        assert all(PROGRESS_LINE.fullmatch(line) for line in got)
    stream = io.StringIO()
    PlainProgress(total=10, desc="nothing yet", stream=stream).close()  # no update, no line
    assert stream.getvalue() == ""
    now = [0.0]  # counted items (not bytes): as is, with their unit
    bar = PlainProgress(total=4, desc="goldens", stream=stream, unit="cases", clock=partial(min, now))
    for t in (2.0, 4.0, 5.0, 8.0):
        now[0] = t
        bar.update(1)
    assert stream.getvalue().splitlines() == [
        "goldens: 25% (1 of 4 cases, 0.5 cases/s, ETA 0:00:06)",
        "goldens: 50% (2 of 4 cases, 0.5 cases/s, ETA 0:00:04)",
        "goldens: 75% (3 of 4 cases, 0.6 cases/s, ETA 0:00:02)",
        "goldens: 100% (4 of 4 cases, 0.5 cases/s, ETA 0:00:00)",
    ]


def test_help_of_the_checkpoint_commands_gives_their_json_fields():
    from fimoe_lab.cli.checkpoints import CONVERT_JSON, INSPECT_JSON, RESTORE_JSON

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    for command, schema in (("inspect", INSPECT_JSON), ("convert", CONVERT_JSON), ("restore", RESTORE_JSON)):
        text = " ".join(sub[command].format_help().split())
        assert "--json" in text and " ".join(schema.split()) in text


def _convert_as_inspect_says(capsys, tmp_path, sample: str, layer: dict, backend: str, need: dict) -> None:
    """Convert ``layer`` for ``backend`` at TP 1 with the alignment inspect recommends: the written kernel tensors
    hold ``kernel_bytes`` per expert, the sizes and step chains are the ones inspect predicted."""
    from fimoe_lab.checkpoints.fileformat import KERNEL_NAMES

    out = tmp_path / f"{sample}-{layer['layer']}-{backend}.safetensors"
    argv = ["convert", sample, str(out), "--backend", backend, "--layer", str(layer["layer"])]
    argv += ["--intermediate-alignment", str(need["alignment"])] if need["status"] == "aligned" else []
    code, doc, err = run_json(capsys, argv)
    assert code == 0 and plain_progress(err)  # progress lines on stderr (no terminal), the JSON alone on stdout
    assert doc["ranks"][0]["files"] == [{"name": out.name, "bytes": out.stat().st_size, "kept": False}]
    written = header_entries([out])
    kernel = sum(nbytes(e) for name, e in written.items() if name.endswith(KERNEL_SUFFIXES))
    assert kernel == need["kernel_bytes"] * layer["experts"]
    (rec,) = doc["layers"]
    assert (rec["padded_intermediate"], rec["padded_hidden"]) == (need["padded_intermediate"], need["padded_hidden"])
    chains = {t["name"]: t["steps"] for t in rec["tensors"]}
    assert {KERNEL_NAMES[t["name"]]: t["steps"] for t in need["tensors"]}.items() <= chains.items()
    for t in rec["tensors"]:  # every kernel tensor's header is what the JSON says
        entry = next(e for name, e in written.items() if name.endswith("." + t["name"]))
        assert entry["shape"] == t["kernel_shape"] and entry["dtype"] == t["dtype"]


def check_tactics(capsys, layer: dict, need: dict) -> None:
    """A TRT-LLM plan's tactic counts are what ``fimoe-lab tactics`` answers for its padded shape, and a shape
    without any tactic at some token count is a warning on the printed line."""
    from fimoe_lab.cli.checkpoints import TACTIC_TOKENS

    sizes = ["--hidden", need["padded_hidden"], "--inter", need["padded_intermediate"], "--experts", layer["experts"]]
    argv = ["tactics", "--format", layer["format"], "--act", layer["activation"], *sizes, "--top-k", layer["top_k"]]
    code, answers, _ = run_json(capsys, [*map(str, argv), "--tokens", ",".join(map(str, TACTIC_TOKENS))])
    assert code == 0 and need["tactics"] == {str(a["tokens"]): a["count"] for a in answers}
    none = [str(t) for t, c in need["tactics"].items() if c == 0]
    assert (f"no TRT-LLM tactic at {', '.join(none)} tokens" in need["text"]) == bool(none)


@pytest.mark.parametrize("sample", sample_names())
def test_inspect_json_agrees_with_the_headers_and_with_what_convert_writes(sample, tmp_path, capsys):
    from fimoe_lab.cli.checkpoints import INSPECT_JSON

    code, doc, err = run_json(capsys, ["inspect", sample, "--tp", "1,2,3"])
    assert code == 0 and err == "" and doc["tp"] == [1, 2, 3] and doc["html"] is None
    fields = keys_of(INSPECT_JSON)
    source = header_entries(sorted(sample_path(sample).glob("*.safetensors")))
    for layer in doc["layers"]:
        assert set(doc) | set(layer) | {k for t in layer["tp"] for k in t} <= fields
        # the tensors inspect lists are the layer's expert tensors in the shards' headers, byte for byte
        mine = {k: e for k, e in source.items() if k.startswith(layer["name"] + ".") and ".experts." in k}
        listed = sum(math.prod(t["shape"]) * ITEMSIZE[t["dtype"]] for t in layer["tensors"])
        assert sum(nbytes(e) for e in mine.values()) == listed > 0
        assert {e["dtype"] for e in mine.values()} == {t["dtype"] for t in layer["tensors"]}
        weights = {t["name"]: t for t in layer["tensors"] if t["name"] in ("w13", "w2", "w13_scale", "w2_scale")}
        per_expert = sum(math.prod(t["shape"][1:]) * ITEMSIZE[t["dtype"]] for t in weights.values())
        for tp in layer["tp"]:
            assert (tp["sizes"] is None) == (tp["cannot"] is not None)
            if tp["sizes"] is not None:
                assert sum(tp["sizes"]) == layer["intermediate"] and len(tp["sizes"]) == tp["tp"]
            for backend, need in tp["backends"].items():
                assert set(need) <= fields and need["backend"] == backend and need["engine"] == doc["engine"]
                if need["status"] in ("cannot", "no-layout"):
                    assert need["padded_intermediate"] is None and need["reason"]
                    continue
                assert need["intermediate"] == tp["sizes"][0] and need["padded_intermediate"] >= need["intermediate"]
                assert need["pad_bytes"] == need["kernel_bytes"] - need["checkpoint_bytes"]
                assert need["pad_bytes"] == sum(t["pad_bytes"] for t in need["tensors"])
                for t in need["tensors"]:
                    assert t["pad_bytes"] == math.prod(t["out_shape"]) - math.prod(t["in_shape"])
                if backend == "trtllm":
                    check_tactics(capsys, layer, need)
                if tp["tp"] == 1:
                    assert need["checkpoint_bytes"] == per_expert
                    _convert_as_inspect_says(capsys, tmp_path, sample, layer, backend, need)
    # the table prints the same lines
    assert main(["inspect", sample, "--tp", "1,2,3"]) == 0
    text = capsys.readouterr().out
    for layer in doc["layers"]:
        for tp in layer["tp"]:
            assert all(need["text"] in text for need in tp["backends"].values())


def _files_of(d) -> list[dict]:
    return [dict(name=f.name, bytes=f.stat().st_size, kept=False) for f in sorted(d.glob("*.safetensors"))]


def test_convert_json_lists_each_rank_and_what_resume_kept(tmp_path, capsys):
    from fimoe_lab.cli.checkpoints import CONVERT_JSON

    out = tmp_path / "out"
    argv = ["convert", "deepseek-v3-fp8", str(out), "--backend", "trtllm", "--tp", "2", "--rank", "all"]
    argv += ["--shard-size", "100KB", "--progress"]  # a no-op kept for old scripts: plain lines by default
    code, doc, err = run_json(capsys, argv)
    assert code == 0 and plain_progress(err)
    fields = keys_of(CONVERT_JSON)
    assert set(doc) | {k for r in doc["ranks"] for k in r} <= fields
    assert [r["rank"] for r in doc["ranks"]] == [0, 1] and doc["processes"] is None
    for r in doc["ranks"]:
        d = out / f"rank-{r['rank']}"
        assert r["out"] == str(d) and r["files"] == _files_of(d) and len(r["files"]) > 1
        assert r["bytes"] == sum(f.stat().st_size for f in d.glob("*.safetensors")) and r["written"] == len(r["files"])
        for f in d.glob("*.safetensors"):  # a file is its header and its tensors' bytes, nothing else
            from fimoe_lab.checkpoints.safe_io import safetensors_header

            _, offset = safetensors_header(f)
            assert f.stat().st_size == offset + sum(nbytes(e) for e in header_entries([f]).values())
    assert doc["bytes"] == doc["written_bytes"] == sum(r["bytes"] for r in doc["ranks"]) and doc["mb_per_s"] > 0
    # an interrupted run: one shard of rank 1 and its index missing; --resume writes only that shard
    victim = doc["ranks"][1]["files"][1]
    (out / "rank-1" / victim["name"]).unlink()
    (out / "rank-1" / "model.safetensors.index.json").unlink()
    code, again, err = run_json(capsys, argv + ["--resume"])
    assert code == 0 and plain_progress(err)
    assert [(r["written"], r["kept"]) for r in again["ranks"]] == [(0, len(doc["ranks"][0]["files"])), (1, 2)]
    assert [f["name"] for r in again["ranks"] for f in r["files"] if not f["kept"]] == [victim["name"]]
    assert again["written_bytes"] == victim["bytes"] and again["bytes"] == doc["bytes"]
    # the text says the same
    assert main(argv + ["--force"]) == 0
    text = capsys.readouterr().out
    for r in doc["ranks"]:
        kept = f", {r['unchanged']} other tensors unchanged" if r["unchanged"] else ""
        line = (
            f"wrote {r['out']} ({r['bytes'] / 1e6:.2f} MB, {len(r['files'])} shards, tp rank {r['rank']} of 2, "
            f"trtllm{kept})"
        )
        assert line in text


def test_restore_json_lists_the_files_it_wrote(tmp_path, capsys):
    from fimoe_lab.cli.checkpoints import RESTORE_JSON

    kernel = tmp_path / "k.safetensors"
    assert main(["convert", "qwen3-moe-bf16", str(kernel), "--backend", "trtllm"]) == 0
    capsys.readouterr()
    code, doc, err = run_json(capsys, ["restore", str(kernel), str(tmp_path / "back"), "--shard-size", "1MB"])
    assert code == 0 and plain_progress(err) and set(doc) <= keys_of(RESTORE_JSON)
    back = tmp_path / "back"
    assert doc["files"] == [dict(name=f.name, bytes=f.stat().st_size) for f in sorted(back.iterdir())]
    shards = sorted(back.glob("*.safetensors"))
    assert doc["shards"] == len(shards) > 1 and doc["bytes"] == sum(f.stat().st_size for f in back.iterdir())
    assert (
        doc["tensors"]
        == len(header_entries(shards))
        == len(json.loads((back / "model.safetensors.index.json").read_text())["weight_map"])
    )


def test_checkpoint_commands_with_json_fail_with_one_line_and_an_empty_stdout(tmp_path, capsys):
    taken = tmp_path / "taken.safetensors"
    taken.write_bytes(b"the user's bytes")
    for argv, where in (
        (["inspect", str(tmp_path / "nope")], "inspect"),
        (["convert", "mixtral-bf16", str(taken), "--backend", "trtllm"], "convert"),
        (["restore", str(taken), str(tmp_path / "back")], "restore"),
    ):
        assert main(argv + ["--json"]) == EXIT_BAD_INPUT
        out = capsys.readouterr()
        assert out.out == "" and len(out.err.splitlines()) == 1 and out.err.startswith(f"error: {where}: ")
    assert taken.read_bytes() == b"the user's bytes" and sorted(p.name for p in tmp_path.iterdir()) == [
        "taken.safetensors"
    ]


def test_convert_json_with_ep_gives_each_rank_its_experts(tmp_path, capsys):
    out = tmp_path / "ep"
    argv = ["convert", "deepseek-v3-fp8", str(out), "--backend", "cutlass", "--tp", "2", "--ep", "2", "--rank", "all"]
    code, doc, err = run_json(capsys, argv)
    assert code == 0 and plain_progress(err) and doc["ep"] == 2
    experts = 6  # the sample's n_routed_experts, split into two contiguous halves
    assert [r["experts"] for r in doc["ranks"]] == [[0, experts // 2], [experts // 2, experts]]
    for r in doc["ranks"]:
        entries = header_entries(sorted((out / f"rank-{r['rank']}").glob("*.safetensors")))
        w13 = next(e for name, e in entries.items() if name.endswith(".w13_weight"))
        assert w13["shape"][0] == r["experts"][1] - r["experts"][0]


def test_distributed_convert_json_is_one_document_from_process_0(tmp_path):
    """Two processes under torch.distributed: stdout holds process 0's JSON alone, with each process's shards."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "d"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "fimoe_lab"]
    cmd += ["convert", "deepseek-v3-fp8", str(out), "--backend", "trtllm", "--tp", "2", "--rank", "all"]
    cmd += ["--shard-size", "40000", "--distributed", "--json"]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180, start_new_session=True)
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads(done.stdout)  # exactly one JSON document
    procs = doc["processes"]
    assert [p["rank"] for p in procs] == [0, 1] and all(p["written"] > 0 and p["mb_per_s"] > 0 for p in procs)
    files = [f for r in doc["ranks"] for f in r["files"]]
    assert sum(p["written"] for p in procs) == len(files) and not any(f["kept"] for f in files)
    for r in doc["ranks"]:
        assert r["files"] == _files_of(out / f"rank-{r['rank']}")
