"""Distributed convert (torch.distributed, gloo on CPU): the split, byte-identity with one process, a killed rank.

Oracles: :func:`convert_checkpoint` in this process (the files of the distributed run must be
the same bytes: ``filecmp`` over every file, index included), :func:`stream.verify_shard` and
``os.stat`` for what a killed run leaves, and a plain sum for the split. Every launch is
``python -m torch.distributed.run --standalone --nproc-per-node 2`` in a subprocess with a timeout.
"""

from __future__ import annotations

import contextlib
import filecmp
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import all_tensors, coords, kernel_and_unchanged, same_tensor
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from fimoe_lab.checkpoints import (
    CheckpointError,
    MoELayer,
    open_checkpoint,
    read_kernel_metadata,
    restore_checkpoint,
    safe_io,
    sample_names,
    sample_path,
)
from fimoe_lab.checkpoints.distributed import assign
from fimoe_lab.checkpoints.writer import convert_checkpoint
from fimoe_lab.cli import main

pytestmark = pytest.mark.slow  # CI (and FIMOE_FULL_TESTS=1) runs it; a plain pytest leaves it out

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
LAUNCH_TIMEOUT = 120
SHARD = 40_000
"""Cuts every sample into several shards, so both processes write some."""
GEN_LAYERS, GEN_EXPERTS, GEN_SIZE, GEN_SHARD = 16, 8, 256, 1_000_000
"""The generated checkpoint: 16 DeepSeek-convention FP8 layers of 1.5 MiB (w13 1 MiB: a shard of its own)."""
BACKEND_ALIGN = {"deepseek-r1-nvfp4": 64}
"""Samples whose default TRT-LLM layout needs an intermediate alignment at TP 2 (the README table)."""


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}


def launch(args: list, timeout: float = LAUNCH_TIMEOUT) -> subprocess.CompletedProcess:
    """Run the launcher in a session of its own: on a timeout the whole session (workers too) is killed."""
    proc = start([*LAUNCH, *map(str, args)])
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        stop(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def start(cmd: list) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), start_new_session=True
    )


def stop(proc: subprocess.Popen) -> None:
    """Kill what is left of a launch (its session), if anything."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def same_dirs(a: Path, b: Path) -> bool:
    """Every file under ``a`` and ``b`` (hidden ones too) the same name and the same bytes."""
    files = lambda d: sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())  # noqa: E731
    if files(a) != files(b):
        return False
    return all(filecmp.cmp(a / f, b / f, shallow=False) for f in files(a))


def generate(out: Path, layers: int = GEN_LAYERS) -> Path:
    """A DeepSeek-V3-convention FP8-block checkpoint whose weight bytes encode (expert, row, col) (:func:`coords`)."""
    with open_checkpoint(sample_path("deepseek-v3-fp8")) as sample:
        conv, config = sample.convention, dict(sample.config)
    e, n = GEN_EXPERTS, GEN_SIZE
    config.update(hidden_size=n, moe_intermediate_size=n, n_routed_experts=e, num_hidden_layers=layers)
    config.update(first_k_dense_replace=0)
    out.mkdir()
    g = torch.Generator().manual_seed(0)
    for layer in range(layers):
        w13 = (coords(e, 2 * n, n // 4) + layer).view(torch.float8_e4m3fn)
        w2 = (coords(e, n, n // 4) + layer).view(torch.float8_e4m3fn)
        s13 = torch.rand(e, 2 * n // 128, n // 128, generator=g) + 0.5
        s2 = torch.rand(e, n // 128, n // 128, generator=g) + 0.5
        tensors = conv.to_tensors("model.layers.", layer, MoELayer("fp8-block", w13, w2, s13, s2, n, n))
        save_file(tensors, str(out / f"layer-{layer}.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return out


DRIVER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch.distributed as dist
    from fimoe_lab.checkpoints.distributed import convert_distributed
    dist.init_process_group("gloo")  # one group for every job (convert_distributed uses it as it is)
    said = Path(sys.argv[2]) / f"refusals-{dist.get_rank()}.jsonl"  # a file each: no shared pipe to interleave
    for job in json.loads(sys.argv[1]):
        try:
            convert_distributed(**job)
        except ValueError as exc:  # an expected refusal: every process says what it raised, and goes on
            with said.open("a") as f:
                f.write(json.dumps({"rank": dist.get_rank(), "out": job["out"], "type": type(exc).__name__, "error": str(exc)}) + "\\n")
    dist.destroy_process_group()
    """
)


# ---------------------------------------------------------------------------- the split
@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=40), st.integers(1, 9))
def test_assign_gives_contiguous_runs_balanced_to_within_one_unit(sizes, world):
    owners = assign(sizes, world)
    assert len(owners) == len(sizes) and owners == sorted(owners) and all(0 <= p < world for p in owners)
    assert owners == assign(list(sizes), world)  # deterministic: every process computes the same
    total, biggest = sum(sizes), max(sizes)
    for p in range(world):
        mine = sum(s for s, o in zip(sizes, owners) if o == p)
        assert mine <= total / world + biggest


def test_assign_splits_equal_units_evenly():
    assert assign([5] * 8, 2) == [0] * 4 + [1] * 4
    assert assign([5] * 8, 4) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert assign([1, 1, 1], 5) == [0, 2, 4]  # more processes than units: some idle
    assert assign([0, 0, 0, 0], 2) == [0, 0, 1, 1]


# ---------------------------------------------------------------------------- two processes, gloo
def _pid_of_rank(lock: Path, rank: int) -> int | None:
    """The pid in a shard's lock file if that process is rank ``rank`` of the launch (its environment)."""
    try:
        pid = int(json.loads(lock.read_text() or "{}").get("pid", 0))
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    return pid if f"RANK={rank}".encode() in env else None


def _kill_rank_1_in_a_shard(proc: subprocess.Popen, out: Path, victim: list) -> None:
    """Poll ``out`` for a shard lock held by rank 1 of the launch and SIGKILL that process (its pid into ``victim``)."""
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    while proc.poll() is None and time.monotonic() < deadline:
        locks = list(out.glob(".model-*.lock")) if out.is_dir() else []
        pid = next((pid for lock in locks for pid in [_pid_of_rank(lock, 1)] if pid), None)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            victim.append(pid)
            return
        time.sleep(0.001)


@pytest.fixture(scope="module")
def first_launch(tmp_path_factory):
    """One launch of two processes: every sample at TP 2 (every rank), then the generated checkpoint, during
    which rank 1 is killed (SIGKILL) while it holds one of its shards open. Returns the paths and the result."""
    tmp = tmp_path_factory.mktemp("dist")
    gen = generate(tmp / "gen")
    jobs, expected = [], []
    for name in sample_names():
        kw = {"backend": "trtllm", "tp_size": 2, "shard_size": SHARD, "intermediate_alignment": BACKEND_ALIGN.get(name)}
        jobs.append({"src": str(sample_path(name)), "out": str(tmp / f"d-{name}"), "tp_rank": "all", **kw})
        expected.append((tmp / f"d-{name}", tmp / name, kw))
    taken = tmp / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("the user's")
    jobs.insert(0, {"src": str(sample_path("qwen3-moe-bf16")), "out": str(taken), "backend": "cutlass"})
    jobs.append({"src": str(sample_path("qwen3-moe-bf16")), "out": str(tmp / "d-one"), "backend": "cutlass"})
    ep = {"backend": "cutlass", "tp_size": 4, "tp_rank": "all", "ep_size": 4, "shard_size": SHARD}
    jobs.append({"src": str(sample_path("deepseek-v3-fp8")), "out": str(tmp / "d-ep"), **ep})
    killed = tmp / "d-gen"
    jobs.append({"src": str(gen), "out": str(killed), "backend": "cutlass", "shard_size": GEN_SHARD})
    driver = tmp / "driver.py"
    driver.write_text(DRIVER)
    said = tmp / "said"
    said.mkdir()
    proc = start([*LAUNCH, driver, json.dumps(jobs), said])
    victim: list[int] = []
    watcher = threading.Thread(target=_kill_rank_1_in_a_shard, args=(proc, killed, victim), daemon=True)
    watcher.start()
    for name in sample_names():  # the single-process oracles, meanwhile
        kw = next(k for d, o, k in expected if o.name == name)
        convert_checkpoint(sample_path(name), tmp / name, **kw, tp_rank="all")
    one = convert_checkpoint(sample_path("qwen3-moe-bf16"), tmp / "one", "cutlass")
    ep_out = convert_checkpoint(sample_path("deepseek-v3-fp8"), tmp / "ep", **ep)
    want = convert_checkpoint(gen, tmp / "gen-out", "cutlass", shard_size=GEN_SHARD)
    watcher.join(LAUNCH_TIMEOUT)
    try:
        _, err = proc.communicate(timeout=LAUNCH_TIMEOUT)
    finally:
        stop(proc)
    lines = [json.loads(line) for f in sorted(said.glob("*.jsonl")) for line in f.read_text().splitlines()]
    # the refusals of the OUT that holds a user's file (the killed launch may add a surviving rank's own error)
    refusals = sorted((r["rank"], r["type"], r["error"]) for r in lines if r["out"] == str(taken))
    return {
        "refusals": refusals,
        "taken": taken,
        "one": (tmp / "d-one", one),
        "ep": (tmp / "d-ep", ep_out),
        "expected": expected,
        "gen": gen,
        "killed": killed,
        "want": want,
        "rc": proc.returncode,
        "err": err,
        "victim": victim[0] if victim else None,
    }


def test_two_processes_write_the_single_process_bytes(first_launch):
    """Every sample at TP 2, both ranks, cut into shards that both processes write: the same files."""
    assert first_launch["victim"] is not None, first_launch["err"][-3000:]
    for got, want, _ in first_launch["expected"]:
        assert len(list(want.rglob("model-*.safetensors"))) > 2, want
        assert same_dirs(got, want), got


def test_more_processes_than_shards_leaves_one_idle_and_the_same_bytes(first_launch):
    got, want = first_launch["one"]
    assert [p.name for p in want.glob("model-*.safetensors")] == [safe_io.shard_name(1, 1)]
    assert same_dirs(got, want)


def test_two_processes_with_ep_write_the_single_process_bytes(first_launch):
    got, want = first_launch["ep"]
    assert sorted(p.name for p in want.iterdir()) == [f"rank-{r}" for r in range(4)]
    assert same_dirs(got, want)


def test_a_failed_rank_fails_every_rank_with_its_error(first_launch):
    """Process 0 refuses an OUT that holds a user's file: it raises its error, process 1 a DistributedError naming
    process 0 and that error; nothing is written."""
    (r0, t0, e0), (r1, t1, e1) = first_launch["refusals"]
    assert (r0, t0, r1, t1) == (0, "CheckpointError", 1, "DistributedError")
    assert "taken exists" in e0 and f"checking OUT: process 0 failed (CheckpointError: {e0})" in e1
    assert sorted(p.name for p in first_launch["taken"].iterdir()) == ["notes.txt"]


def test_a_killed_rank_leaves_no_index_and_resume_finishes_only_the_rest(first_launch, tmp_path):
    out, want = first_launch["killed"], first_launch["want"]
    assert first_launch["victim"] is not None and first_launch["rc"] != 0, first_launch["err"][-3000:]
    assert not os.path.lexists(out / safe_io.INDEX)
    finished = {p.name: (st.st_ino, st.st_mtime_ns) for p in out.glob("model-*.safetensors") for st in [p.stat()]}
    n = len(list(want.glob("model-*.safetensors")))
    assert 0 < len(finished) < n  # some shards were committed, not all
    done = launch(
        [
            "-m",
            "fimoe_lab",
            "convert",
            first_launch["gen"],
            out,
            "--distributed",
            "--resume",
            "--backend",
            "cutlass",
            "--shard-size",
            GEN_SHARD,
            "--no-progress",
        ]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"kept {len(finished)} of {n} shards" in done.stdout
    for name, (ino, mtime) in finished.items():  # verified and kept, not written again
        st = (out / name).stat()
        assert (st.st_ino, st.st_mtime_ns) == (ino, mtime), name
    assert same_dirs(out, want)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # the killed rank's temporary was swept


def test_distributed_without_a_launcher_or_into_one_file_is_one_error_line(tmp_path, capsys, monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    args = ["convert", "qwen3-moe-bf16", "--backend", "cutlass", "--distributed", "--no-progress"]
    assert main([*args[:2], str(tmp_path / "out"), *args[2:]]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--distributed needs a launcher: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT" in err
    assert main([*args[:2], str(tmp_path / "k.safetensors"), *args[2:]]) == 2
    assert "writes a sharded directory, not one file" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_peer_that_never_starts_fails_the_run_with_one_clear_line(rank, tmp_path):
    """One process of two is started (as rank 0, which hosts the rendezvous, or as rank 1): it fails after
    the peer timeout with one error line, not hours later, and writes nothing."""
    env = {**_env(), "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    env.update({"MASTER_PORT": str(_free_port()), "FIMOE_DIST_TIMEOUT": "3"})
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "fimoe_lab", "convert", "qwen3-moe-bf16", out, "--backend", "cutlass"]
    started = time.monotonic()
    done = subprocess.run(
        [*map(str, cmd), "--distributed", "--no-progress"], env=env, capture_output=True, text=True, timeout=90
    )
    assert time.monotonic() - started < 60
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "did not all join" in lines[0], done.stderr
    assert "FIMOE_DIST_TIMEOUT" in lines[0] and "Traceback" not in done.stderr
    assert not out.exists()


def test_a_bad_timeout_value_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FIMOE_DIST_TIMEOUT", "soon")
    assert main(["convert", "qwen3-moe-bf16", str(tmp_path / "out"), "--backend", "cutlass", "--distributed"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "FIMOE_DIST_TIMEOUT='soon'" in err
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------- expert parallelism
EP_RANGES = {
    (8, 3): [[0, 3], [3, 6], [6, 8]],
    (8, 4): [[0, 2], [2, 4], [4, 6], [6, 8]],
    (6, 3): [[0, 2], [2, 4], [4, 6]],
    (6, 4): [[0, 2], [2, 4], [4, 5], [5, 6]],
    (4, 3): [[0, 2], [2, 3], [3, 4]],
    (4, 4): [[0, 1], [1, 2], [2, 3], [3, 4]],
}
"""vLLM's linear placement written out (E // n each, one more for the first E % n ranks): (E, n) -> ranges."""


def _ep_samples():
    return [(n, ep) for n in sample_names() for ep in (3, 4)]  # even and uneven splits of 6 and 8 experts


@pytest.mark.parametrize("name,ep", _ep_samples())
def test_ep_ranks_hold_contiguous_experts_and_restore_reassembles_the_source(name, ep, tmp_path):
    """Each EP rank's kernel tensors are the TP-1 kernel tensors' experts [e0, e1) (every map works expert by
    expert); restore of OUT concatenates them back into the source's expert tensors, byte for byte."""
    align = BACKEND_ALIGN.get(name)
    tp1 = convert_checkpoint(sample_path(name), tmp_path / "tp1.safetensors", "trtllm", intermediate_alignment=align)
    whole = all_tensors(tp1)
    out = convert_checkpoint(
        sample_path(name), tmp_path / "ep", "trtllm", ep, "all", intermediate_alignment=align, ep_size=ep
    )
    metas = [read_kernel_metadata(out / f"rank-{r}") for r in range(ep)]
    assert [m["experts"] for m in metas] == EP_RANGES[(metas[0]["num_experts"], ep)]
    assert [m["ep_rank"] for m in metas] == list(range(ep))
    src = all_tensors(sample_path(name))
    moe, kept = kernel_and_unchanged(whole, src)
    for r, m in enumerate(metas):
        e0, e1 = m["experts"]
        held = all_tensors(out / f"rank-{r}")
        assert set(held) == moe | (kept if r == 0 else set())  # the unchanged tensors once, on rank 0
        assert all(same_tensor(held[k], whole[k][e0:e1]) for k in moe), r
        assert all(same_tensor(held[k], src[k]) for k in set(held) & kept), r
    back = restore_checkpoint(out, tmp_path / "back")
    got = all_tensors(back)
    assert sorted(got) == sorted(all_tensors(restore_checkpoint(tp1, tmp_path / "back-tp1"))) == sorted(src)
    assert all(same_tensor(src[k], got[k]) for k in got)
    with pytest.raises(CheckpointError, match="under local indices"):
        restore_checkpoint(out / "rank-1", tmp_path / "one-rank")


def test_ep_with_moe_tp_slices_experts_of_the_moe_tp_rank(tmp_path):
    """--tp 4 --ep 2: rank r = 2 * ep_rank + moe_tp_rank holds the TP-2 rank's experts of its EP rank; restore of
    OUT joins the intermediate slices and the experts back into the source; --ep not dividing --tp is one error."""
    src = sample_path("qwen3-moe-bf16")
    source = all_tensors(src)
    out = convert_checkpoint(src, tmp_path / "ep", "cutlass", 4, "all", ep_size=2)
    for r in range(4):
        ep_rank, tp_rank = divmod(r, 2)
        tp2 = all_tensors(convert_checkpoint(src, tmp_path / f"tp2-{r}.safetensors", "cutlass", 2, tp_rank))
        moe, kept = kernel_and_unchanged(tp2, source)
        e0, e1 = [[0, 3], [3, 6]][ep_rank]
        held = all_tensors(out / f"rank-{r}")
        assert set(held) == moe | (kept if r == 0 else set()) and all(same_tensor(held[k], tp2[k][e0:e1]) for k in moe)
        assert all(same_tensor(held[k], source[k]) for k in set(held) & kept)
    back = all_tensors(restore_checkpoint(out, tmp_path / "back"))
    assert sorted(back) == sorted(source) and all(same_tensor(back[k], source[k]) for k in back)
    with pytest.raises(CheckpointError, match="does not divide the tensor-parallel size 4"):
        convert_checkpoint(src, tmp_path / "bad", "cutlass", 4, "all", ep_size=3)
    with pytest.raises(CheckpointError, match="rank 4 is not valid for --tp 4"):
        convert_checkpoint(src, tmp_path / "bad", "cutlass", 4, 4, ep_size=2)
    assert not (tmp_path / "bad").exists()
