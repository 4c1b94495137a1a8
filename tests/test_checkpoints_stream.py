"""Streaming convert/restore: chunks of experts, shards in the Hugging Face layout, resume, memory bound.

Oracles: ``safetensors`` reading the files directly (:func:`helpers.all_tensors`), ``hashlib``
over the file bytes, :func:`convert_layer` on whole layers (the chunked pipeline must give its
bytes), and ``/proc/<pid>/status`` of a child process for memory.
"""

from __future__ import annotations

import hashlib
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
from helpers import all_tensors, same_tensor

from fimoe_lab.checkpoints import (
    CheckpointError,
    LayoutChoice,
    MoELayer,
    convert,
    convert_checkpoint,
    convert_layer,
    open_checkpoint,
    read_kernel_metadata,
    restore_checkpoint,
    safe_io,
    sample_path,
    stream,
)
from fimoe_lab.cli import main
from fimoe_lab.errors import FimoeError
from fimoe_lab.resources import sample_names

ROOT = Path(__file__).resolve().parent.parent
SHARD = 40_000
"""A shard size that cuts every sample into several shards."""


def cli(argv: list) -> int:
    return main([str(a) for a in argv])


def shards(d: Path) -> list[Path]:
    return sorted(d.glob("model-*.safetensors"))


def fimoe_meta(path: Path) -> dict:
    return json.loads(safe_io.safetensors_metadata(path)["fimoe_lab"])


# ---------------------------------------------------------------------------- chunks of experts
@pytest.mark.parametrize("sample", sample_names())
@pytest.mark.parametrize("backend", ["trtllm", "cutlass"])
def test_chunked_conversion_gives_the_whole_layer_bytes(sample, backend, monkeypatch):
    """One expert per chunk (the smallest chunk) against convert_layer on the whole layer."""
    monkeypatch.setattr(stream, "CHUNK_MIN", 1)
    monkeypatch.setattr(stream, "CHUNK_MAX", 1)
    with open_checkpoint(sample_path(sample)) as ck:
        layer = ck.read_layer(ck.moe_layers[-1])
    align = 64 if sample == "deepseek-r1-nvfp4" and backend == "trtllm" else None
    whole, _, _ = convert_layer(layer, LayoutChoice(backend, align))
    chunks = list(convert.converted_chunks(layer, LayoutChoice(backend, align), torch.device("cpu")))
    assert len(chunks) == layer.num_experts > 1
    for name, t in whole.items():
        assert same_tensor(torch.cat([c[name] for c in chunks]), t), name


# ---------------------------------------------------------------------------- sharded output
@pytest.mark.parametrize("sample", ["deepseek-v3-fp8", "gpt-oss-mxfp4", "deepseek-r1-nvfp4"])
def test_single_file_and_shards_hold_the_same_bytes_and_restore_exactly(sample, tmp_path):
    src = sample_path(sample)
    single = convert_checkpoint(src, tmp_path / "k.safetensors", "cutlass")
    sharded = convert_checkpoint(src, tmp_path / "k", "cutlass", shard_size=SHARD)
    files = shards(sharded)
    n = len(files)
    assert n > 1 and [f.name for f in files] == [safe_io.shard_name(k, n) for k in range(1, n + 1)]
    one, many = all_tensors(single), all_tensors(sharded)
    assert sorted(one) == sorted(many) and all(same_tensor(one[k], many[k]) for k in one)
    index = json.loads((sharded / safe_io.INDEX).read_text())
    assert sorted(index["weight_map"]) == sorted(one)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in one.values())
    for f in files:  # every shard: its tensors, their sha256 over the file's own bytes, the same metadata
        meta = fimoe_meta(f)
        held = all_tensors(f)
        assert sorted(meta.pop("checksums")) == sorted(held) and all(index["weight_map"][k] == f.name for k in held)
        for k, t in held.items():
            assert fimoe_meta(f)["checksums"][k] == hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy()).hexdigest()
        whole = fimoe_meta(single)
        whole.pop("checksums")
        assert meta == whole
    assert read_kernel_metadata(sharded)["checksums"] == read_kernel_metadata(single)["checksums"]
    a = restore_checkpoint(single, tmp_path / "from-one")
    b = restore_checkpoint(sharded, tmp_path / "from-shards", shard_size=SHARD)
    assert len(shards(b)) > 1
    ra, rb, original = all_tensors(a), all_tensors(b), all_tensors(src)
    assert sorted(ra) == sorted(rb) and all(same_tensor(ra[k], rb[k]) and same_tensor(original[k], rb[k]) for k in ra)
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())


def test_rank_all_writes_every_rank_like_one_rank_at_a_time(tmp_path, capsys):
    src = "qwen3-moe-bf16"
    out = tmp_path / "all"
    assert cli(["convert", src, out, "--backend", "trtllm", "--tp", "2", "--rank", "all", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "tp rank 0 of 2" in printed and "tp rank 1 of 2" in printed
    assert sorted(p.name for p in out.iterdir()) == ["rank-0", "rank-1"]
    for r in (0, 1):
        one = convert_checkpoint(sample_path(src), tmp_path / f"r{r}.safetensors", "trtllm", 2, r)
        a, b = all_tensors(one), all_tensors(out / f"rank-{r}")
        assert sorted(a) == sorted(b) and all(same_tensor(a[k], b[k]) for k in a)
        assert read_kernel_metadata(out / f"rank-{r}")["tp_rank"] == r
    whole, original = all_tensors(restore_checkpoint(out, tmp_path / "whole")), all_tensors(sample_path(src))
    assert whole and all(same_tensor(whole[k], original[k]) for k in whole)  # every rank: TP slices joined
    assert cli(["restore", out / "rank-1", tmp_path / "back"]) == 0
    with open_checkpoint(tmp_path / "back") as ck, open_checkpoint(sample_path(src)) as full:
        layer = ck.moe_layers[0]
        assert same_tensor(ck.read_layer(layer).w2, full.read_layer(layer, 2, 1).w2)


# ---------------------------------------------------------------------------- resume
CRASH = textwrap.dedent(
    """
    import os, signal, sys
    from fimoe_lab.checkpoints import convert_checkpoint, stream
    real = stream.ShardFile.finish
    def finish_then_die(self):
        real(self)  # the first shard is committed (renamed onto its final name) ...
        os.kill(os.getpid(), signal.SIGKILL)  # ... and the process dies before any other work
    stream.ShardFile.finish = finish_then_die
    convert_checkpoint(sys.argv[1], sys.argv[2], "cutlass", shard_size=int(sys.argv[3]))
    """
)


def _killed_mid_write(src: Path, out: Path) -> list[Path]:
    """Run convert in a child that is SIGKILLed right after its first shard is committed (no race with
    the parent's clock: the kill comes from inside, at that point); the shards it left."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.run([sys.executable, "-c", CRASH, str(src), str(out), str(SHARD)], env=env, timeout=120)
    assert child.returncode == -signal.SIGKILL, "the child finished before it was killed"
    return shards(out)


def test_resume_after_a_kill_keeps_verified_shards_and_redoes_the_rest(tmp_path, capsys):
    src = sample_path("deepseek-v3-fp8")
    fresh = convert_checkpoint(src, tmp_path / "fresh", "cutlass", shard_size=SHARD)
    out = tmp_path / "k"
    left = _killed_mid_write(src, out)
    n = len(shards(fresh))
    assert len(left) == 1 and n > 1 and not (out / safe_io.INDEX).exists()  # no index claims missing shards
    with pytest.raises(CheckpointError, match="exists"):
        convert_checkpoint(src, out, "cutlass", shard_size=SHARD)  # neither --resume nor --force
    kept = {p.name: p.stat().st_mtime_ns for p in left}
    damaged = left[0]
    raw = bytearray(damaged.read_bytes())
    raw[-1] ^= 0x5A  # its bytes no longer match the sha256 it records: written again
    damaged.write_bytes(bytes(raw))
    damaged_mtime = damaged.stat().st_mtime_ns
    time.sleep(0.01)
    rc = cli(["convert", src, out, "--backend", "cutlass", "--shard-size", str(SHARD), "--resume", "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    for p in shards(out):  # kept shards were not rewritten; the damaged one and the missing ones were
        if p.name in kept and p != damaged:
            assert p.stat().st_mtime_ns == kept[p.name]
    assert damaged.stat().st_mtime_ns != damaged_mtime
    assert [p.name for p in shards(out)] == [p.name for p in shards(fresh)]
    for a, b in zip(shards(out), shards(fresh)):
        assert a.read_bytes() == b.read_bytes()
    assert (out / safe_io.INDEX).read_bytes() == (fresh / safe_io.INDEX).read_bytes()
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in fresh.iterdir())  # no temporaries, no locks


def test_resume_never_trusts_a_partial_or_foreign_file(tmp_path):
    src = sample_path("deepseek-v3-fp8")
    out = convert_checkpoint(src, tmp_path / "k", "cutlass", shard_size=SHARD)
    want = {p.name: p.read_bytes() for p in shards(out)}
    first = shards(out)[0]
    first.write_bytes(want[first.name][: len(want[first.name]) // 2])  # a partial file under the final name
    (out / safe_io.INDEX).unlink()
    convert_checkpoint(src, out, "cutlass", shard_size=SHARD, resume=True)
    assert {p.name: p.read_bytes() for p in shards(out)} == want
    other = convert_checkpoint(src, tmp_path / "other", "trtllm", shard_size=SHARD)
    theirs = {p.name: p.read_bytes() for p in shards(other)}
    with pytest.raises(CheckpointError, match=r"another convert .* --backend \('trtllm' recorded, 'cutlass' asked\)"):
        convert_checkpoint(src, other, "cutlass", shard_size=SHARD, resume=True)  # another request: never replaced
    assert {p.name: p.read_bytes() for p in shards(other)} == theirs
    convert_checkpoint(src, other, "cutlass", shard_size=SHARD, force=True)  # asked to replace it: every shard redone
    assert {p.name: p.read_bytes() for p in shards(other)} == want
    (out / "notes.txt").write_text("keep me")
    for flag in ("resume", "force"):
        with pytest.raises(CheckpointError, match="notes.txt, not written by 'fimoe-lab convert'"):
            convert_checkpoint(src, out, "cutlass", **{flag: True})
    assert (out / "notes.txt").read_text() == "keep me"


def test_force_rewrites_a_sharded_output_and_drops_its_stale_shards(tmp_path):
    src = sample_path("deepseek-v3-fp8")
    out = convert_checkpoint(src, tmp_path / "k", "cutlass", shard_size=SHARD)
    assert len(shards(out)) > 1
    convert_checkpoint(src, out, "cutlass", force=True)  # 5 GB shards: one
    assert [p.name for p in shards(out)] == [safe_io.shard_name(1, 1)]
    assert sorted(p.name for p in out.iterdir()) == sorted([safe_io.shard_name(1, 1), safe_io.INDEX])


# ---------------------------------------------------------------------------- memory
def _write_layers(out: Path, layers: int, experts: int, inter: int, hidden: int) -> int:
    """A DeepSeek-convention FP8-block checkpoint whose weight bytes encode (layer, expert, row, col); one layer's
    bytes."""
    from safetensors.torch import save_file

    with open_checkpoint(sample_path("deepseek-v3-fp8")) as sample:
        conv, config = sample.convention, dict(sample.config)
    config.update(
        hidden_size=hidden,
        moe_intermediate_size=inter,
        n_routed_experts=experts,
        num_hidden_layers=layers,
        first_k_dense_replace=0,
    )
    out.mkdir()
    weight_map, size = {}, 0
    for layer in range(layers):

        def code(rows: int, cols: int, layer: int = layer) -> torch.Tensor:
            e = torch.arange(experts)[:, None] * 131 + torch.arange(rows)[None, :] * 7 + layer * 17
            c = torch.arange(cols) * 3
            return ((e % 256).to(torch.uint8)[..., None] + (c % 256).to(torch.uint8)).view(torch.float8_e4m3fn)

        s13 = torch.rand(experts, 2 * inter // 128, hidden // 128) + 0.5
        s2 = torch.rand(experts, hidden // 128, inter // 128) + 0.5
        moe = MoELayer("fp8-block", code(2 * inter, hidden), code(hidden, inter), s13, s2, inter, hidden)
        tensors = conv.to_tensors("model.layers.", layer, moe)
        name = f"model-{layer + 1:05d}-of-{layers:05d}.safetensors"
        save_file(tensors, str(out / name))
        weight_map.update(dict.fromkeys(tensors, name))
        size = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / safe_io.INDEX).write_text(json.dumps({"weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config))
    return size


MEASURE = textwrap.dedent(
    """
    import json, sys, tempfile, threading
    from fimoe_lab.checkpoints import convert_checkpoint, restore_checkpoint
    def anon():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon:"))
    src, kernel, back, warm = sys.argv[1:]
    with tempfile.TemporaryDirectory() as d:  # imports, kernels compiled for these sizes: before the baseline
        restore_checkpoint(convert_checkpoint(warm, d + "/k", "trtllm"), d + "/b")
    peaks = {}
    for step, run in (("convert", lambda: convert_checkpoint(src, kernel, "trtllm")),
                      ("restore", lambda: restore_checkpoint(kernel, back))):
        base, peak, stop = anon(), [0], threading.Event()
        def sample():
            while not stop.wait(0.001):
                peak[0] = max(peak[0], anon())
        t = threading.Thread(target=sample, daemon=True)
        t.start()
        run()
        stop.set()
        t.join()
        peaks[step] = max(peak[0], anon()) - base
    print(json.dumps(peaks))
    """
)
"""A child that converts and restores and prints each one's peak ``RssAnon`` above its baseline (sampled every
1 ms)."""


def test_convert_and_restore_hold_about_one_layer(tmp_path):
    """Peak anonymous memory above the child's baseline stays near one layer while the model is 5 layers.

    The baseline is taken after a warm-up convert and restore of a 4-expert checkpoint of the same sizes
    (imports and the kernels numba compiles for them, ~40 MB once per process, are not per layer).
    The layers are small (12.6 MB) to keep the test fast; glibc keeps freed blocks below its mmap threshold
    (which grows to 32 MB) for reuse, so the child sets a fixed 64 KB threshold and the figure is what the
    process holds, as it is for real layers (GBs, chunks of 64 MB) without it.
    """
    layers = 5
    layer_bytes = _write_layers(tmp_path / "ck", layers, experts=16, inter=512, hidden=512)
    _write_layers(tmp_path / "warm", 1, experts=4, inter=512, hidden=512)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": str(1 << 16)}
    args = [tmp_path / "ck", tmp_path / "k", tmp_path / "back", tmp_path / "warm"]
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, *map(str, args)], env=env, capture_output=True, text=True, check=True
    )
    peaks = json.loads(done.stdout.strip().splitlines()[-1])
    print({k: round(v / layer_bytes, 2) for k, v in peaks.items()}, "layers of", layer_bytes)
    for step, peak in peaks.items():
        assert peak < 1.5 * layer_bytes + (8 << 20), (step, peak / layer_bytes)  # the whole model: 5 layers
    original, back = all_tensors(tmp_path / "ck"), all_tensors(tmp_path / "back")
    assert sorted(original) == sorted(back) and all(same_tensor(original[k], back[k]) for k in original)


# ---------------------------------------------------------------------------- options
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_device_cuda_without_a_gpu_is_one_clear_error(tmp_path, capsys):
    out = tmp_path / "k"
    rc = cli(["convert", "qwen3-moe-bf16", out, "--backend", "cutlass", "--device", "cuda"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "no CUDA GPU" in err[0] and "(fix: " in err[0]
    assert not out.exists()
    assert cli(["convert", "qwen3-moe-bf16", out, "--backend", "cutlass", "--device", "tpu"]) == 2
    assert "not 'cpu' or 'cuda" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--shard-size", "5XB"], "--shard-size takes a size like 5GB"),
        (["--shard-size", "0"], "--shard-size takes a size like 5GB"),
        (["--rank", "-1"], "--rank takes a rank >= 0 or 'all'"),
    ],
)
def test_bad_options_are_refused_before_anything_is_written(argv, match, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        cli(["convert", "qwen3-moe-bf16", str(tmp_path / "k"), "--backend", "cutlass", *argv])
    assert info.value.code == 2 and match in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_rank_all_needs_a_directory(tmp_path, capsys):
    out = tmp_path / "k.safetensors"
    assert cli(["convert", "qwen3-moe-bf16", out, "--backend", "cutlass", "--tp", "2", "--rank", "all"]) == 2
    assert "--rank all writes one sharded directory per rank" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("text,size", [("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("2GiB", 2 << 30), ("1234", 1234)])
def test_shard_sizes_read_like_hugging_face(text, size):
    from fimoe_lab.cli.checkpoints import byte_size

    assert byte_size(text) == size


# ---------------------------------------------------------------------------- writer lanes
@pytest.mark.parametrize("lanes", ["1", "3"])
def test_several_writer_lanes_write_the_same_bytes(lanes, tmp_path, monkeypatch):
    """Chunks dealt to 1 or 3 pwrite threads (one expert per chunk: many chunks per lane) give
    files byte-identical to the one-lane convert, checksums included."""
    monkeypatch.setattr(stream, "CHUNK_MIN", 1)
    monkeypatch.setattr(stream, "CHUNK_MAX", 1)
    src = sample_path("deepseek-v3-fp8")
    monkeypatch.setenv(stream.LANES_ENV, "1")
    one = convert_checkpoint(src, tmp_path / "one", "trtllm", shard_size=SHARD)
    monkeypatch.setenv(stream.LANES_ENV, lanes)
    assert stream.write_lanes() == int(lanes)
    probe = stream.Workers(hashing=False)
    probe.close(abort=False)
    assert probe.lanes == int(lanes)
    many = convert_checkpoint(src, tmp_path / "many", "trtllm", shard_size=SHARD)
    names = sorted(p.name for p in one.iterdir())
    assert len(names) > 2 and names == sorted(p.name for p in many.iterdir())
    for n in names:
        assert (one / n).read_bytes() == (many / n).read_bytes(), n


@pytest.mark.parametrize("raw", ["0", "-2", "two", ""])
def test_a_bad_writer_lane_count_is_one_clear_error(raw, monkeypatch):
    monkeypatch.setenv(stream.LANES_ENV, raw)
    with pytest.raises(FimoeError, match=stream.LANES_ENV) as info:  # the environment's error (fimoe_lab.env)
        stream.write_lanes()
    assert info.value.fix


def test_a_failing_write_is_raised_and_the_jobs_queued_behind_it_skipped():
    """Six jobs dealt to three lanes: job 0 fails on lane 0; drain raises it, and job 3 (lane 0,
    queued behind it) never runs."""
    workers = stream.Workers(hashing=False, lanes=3)
    ran: list[int] = []
    gate = threading.Event()

    def job(k: int):
        def run() -> None:
            if k == 0:
                raise OSError("disk full (injected)")
            gate.wait(5)
            ran.append(k)

        return run

    try:
        for k in range(6):
            workers.submit(job(k))
        gate.set()
        with pytest.raises(OSError, match="injected"):
            workers.drain()
    finally:
        workers.close(abort=True)
    assert 0 not in ran and 3 not in ran


def test_a_commit_waits_for_every_job_before_it_and_the_caller_goes_on():
    """``after``: returns while earlier writes and digests are still held, runs its job only once all of them
    (on every lane) have run, and ``drain`` waits for it."""
    workers = stream.Workers(hashing=True, lanes=3)
    gate, ran, seen = threading.Event(), [], []

    def job(k: int):
        def run() -> None:
            gate.wait(5)
            ran.append(k)

        return run

    try:
        for k in range(7):
            workers.submit(job(k), job(100 + k), lane=k)
        workers.after(lambda: seen.append(sorted(ran)))
        workers.submit(job(7))
        assert seen == []  # the caller is back while every earlier job is held
        gate.set()
        workers.drain()
    finally:
        workers.close(abort=False)
    assert len(seen) == 1 and set(range(7)) | set(range(100, 107)) <= set(seen[0])


def test_a_commit_behind_a_failed_job_never_runs():
    workers = stream.Workers(hashing=False, lanes=2)
    seen: list[int] = []

    def fail() -> None:
        raise OSError("disk full (injected)")

    try:
        workers.submit(fail)
        workers.after(lambda: seen.append(1))
        with pytest.raises(OSError, match="injected"):
            workers.drain()
    finally:
        workers.close(abort=True)
    assert seen == []


def test_a_full_shard_is_committed_while_the_next_one_is_written(tmp_path):
    """Two tensors in two shards: putting the first's last chunk returns while a writer lane is held, and the
    shard appears at its name (hashed, fsynced, renamed on the commit thread) once the lane is free, while the
    second is still open; the finished output verifies."""
    g = torch.Generator().manual_seed(3)
    a = torch.randint(0, 256, (8, 4096), dtype=torch.uint8, generator=g)
    b = (torch.arange(8 * 4096, dtype=torch.int64).reshape(8, 4096) % 251).to(torch.uint8)
    specs = {"a": (torch.uint8, (8, 4096)), "b": (torch.uint8, (8, 4096))}
    out = tmp_path / "k"
    out.mkdir()
    target = stream.ShardedOutput(
        out, specs, {"fimoe_lab": {"probe": 1}}, single=False, shard_bytes=8 * 4096, checksum_key="fimoe_lab"
    )
    first, second = target.paths
    gate = threading.Event()
    with stream.workers_for(target, hashing=True) as workers:
        for e in range(0, 6, 2):
            target.put(workers, "a", a[e : e + 2])
        workers.submit(lambda: gate.wait(10))  # holds a writer lane
        target.put(workers, "a", a[6:])  # the first shard's last chunk: put returns, its commit waits
        target.put(workers, "b", b[:2])
        assert not first.exists() and not second.exists()
        gate.set()
        deadline = time.monotonic() + 10
        while not first.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert first.exists() and not second.exists()
        for e in range(2, 8, 2):
            target.put(workers, "b", b[e : e + 2])
        target.finish(workers)
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(first))["a"], a) and torch.equal(load_file(str(second))["b"], b)
    for k, path in enumerate(target.paths):
        assert stream.verify_shard(path, target._entries(k), {"fimoe_lab": {"probe": 1}}, "fimoe_lab")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_writes_start_their_own_writeback_on_linux(tmp_path):
    """The writers' early writeback is libc's ``sync_file_range`` here (not silently absent), and starting it
    on written bytes leaves them as written."""
    assert stream._SYNC_FILE_RANGE is not None
    data = bytes(range(256)) * 4096
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        stream._pwrite_all(fd, memoryview(data), 0)
        stream.start_writeback(fd, 0, len(data))
        os.fsync(fd)
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == data


def test_the_next_layer_is_read_while_this_layer_is_converted(tmp_path, monkeypatch):
    """The reader thread reads the next layer's first block while the main thread converts this layer's
    last one: the conversion of each layer's last block waits (5 s at most) for that read to begin."""
    layers = 3
    _write_layers(tmp_path / "ck", layers, experts=4, inter=256, hidden=256)
    monkeypatch.setattr(stream, "CHUNK_MIN", 1)
    monkeypatch.setattr(stream, "CHUNK_MAX", 1)  # one expert per block
    from fimoe_lab.checkpoints import rank_layout

    started = {k: threading.Event() for k in range(layers)}
    read, conv = rank_layout.LayerLoader.__call__, convert.convert_layer
    overlapped: list[bool] = []

    def reading(self, experts=None, pin=False):
        if experts is not None and experts[0] == 0:
            started[self.layer].set()
        return read(self, experts, pin)

    def converting(layer, choice):
        if not started[0].is_set():  # the output's specs, from one-expert stand-ins, before any read
            return conv(layer, choice)
        done = count[layer.layer] = count.get(layer.layer, 0) + 1
        if done == 4 and layer.layer + 1 < layers:  # this layer's fourth and last one-expert block
            overlapped.append(started[layer.layer + 1].wait(5))
        return conv(layer, choice)

    count: dict[int, int] = {}
    monkeypatch.setattr(rank_layout.LayerLoader, "__call__", reading)
    monkeypatch.setattr(convert, "convert_layer", converting)
    convert_checkpoint(tmp_path / "ck", tmp_path / "k", "trtllm", shard_size=SHARD)
    assert overlapped == [True] * (layers - 1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_READ is Linux's")
def test_populate_reads_a_mapped_slice_in_and_leaves_its_bytes(tmp_path):
    """``stream.populate`` of a memory-mapped slice (unaligned start) returns it, bytes unchanged, with its pages in
    the page cache again after they were dropped (``mincore`` through ``numba_gather.pages_mapped``)."""
    import mmap

    import numpy as np

    from fimoe_lab.kernels.numba_gather import pages_mapped

    data = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    path = tmp_path / "blob"
    path.write_bytes(data.numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c"))
        part = t[mmap.PAGESIZE // 2 + 7 :]
        if pages_mapped(part):
            pytest.skip("the file's pages stayed in the page cache after POSIX_FADV_DONTNEED")
        assert stream.populate(part) is part
        assert pages_mapped(part)
        assert torch.equal(part, data[mmap.PAGESIZE // 2 + 7 :])
        assert stream.populate(part[:0]) is not None  # empty: nothing to do
    finally:
        os.close(fd)


def test_restore_hands_a_layers_buffers_to_the_next_and_gives_the_same_bytes(tmp_path):
    """Each layer restored into the buffers the layer before it released (the same memory, mapped already) holds
    the bytes a restore into new tensors gives; the layers' bytes differ (each encodes its layer), so a byte the
    map left unwritten would show the layer before it."""
    from fimoe_lab.checkpoints.fileformat import KernelFiles
    from fimoe_lab.checkpoints.restore import LayerBuffers, restore_layer

    _write_layers(tmp_path / "ck", 3, experts=4, inter=256, hidden=512)
    convert_checkpoint(tmp_path / "ck", tmp_path / "k", "trtllm")
    buffers, where, previous = LayerBuffers(), [], None
    with KernelFiles(tmp_path / "k") as kf:
        for idx, rec in kf.meta["layers"].items():
            got = restore_layer(kf, kf.meta, int(idx), rec, buffers=buffers)
            want = restore_layer(kf, kf.meta, int(idx), rec)
            names = [n for n, t in want.tensors().items() if t is not None]
            assert names and all(same_tensor(got.tensors()[n], want.tensors()[n]) for n in names)
            if previous is not None:
                assert not torch.equal(previous.view(torch.uint8), want.w13.view(torch.uint8))
            where.append({n: got.tensors()[n].data_ptr() for n in names})
            previous = want.w13
            del got
            buffers.release()
    assert where[0] == where[1] == where[2]
    one, two = buffers.empty([64], torch.uint8), buffers.empty([64], torch.uint8)  # never one buffer twice
    assert one.data_ptr() != two.data_ptr()
    buffers.release()
    assert {buffers.empty([64], torch.uint8).data_ptr() for _ in range(2)} == {one.data_ptr(), two.data_ptr()}
    buffers.release()
    kept = buffers.empty([64], torch.uint8)  # one of the two, the other still free
    assert kept.data_ptr() in {one.data_ptr(), two.data_ptr()}
    del one, two
    buffers.empty([32], torch.uint8)  # a shape it has none of: the layer differs, the free one is dropped
    assert not any(buffers._free.values())


def test_restore_reads_each_chunk_in_on_its_reader_thread(tmp_path, monkeypatch):
    """Every chunk restore maps is read in (``stream.populate``) on the reader thread, before the thread that maps
    it touches it: the file's tensors are memory-mapped, so without it nothing is read ahead. The restore still
    gives the source's bytes."""
    _write_layers(tmp_path / "ck", 2, experts=4, inter=256, hidden=512)
    kernel = convert_checkpoint(tmp_path / "ck", tmp_path / "k", "trtllm")
    seen: list[tuple[str, int]] = []
    real = stream.populate

    def spy(t):
        seen.append((threading.current_thread().name, t.nbytes))
        return real(t)

    monkeypatch.setattr(stream, "populate", spy)
    restore_checkpoint(kernel, tmp_path / "back")
    assert seen and all(name.startswith("fimoe-lab-reader") for name, _ in seen)
    weights = sum(n for _, n in seen)
    assert weights >= sum(f.stat().st_size for f in (tmp_path / "k").glob("*.safetensors")) * 0.9
    original, back = all_tensors(tmp_path / "ck"), all_tensors(tmp_path / "back")
    assert sorted(original) == sorted(back) and all(same_tensor(original[k], back[k]) for k in original)
