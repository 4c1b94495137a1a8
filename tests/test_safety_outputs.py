"""Outputs are never lost or half-written: checksums, permissions, --force, stale temporaries, links.

Oracles: ``hashlib.sha256`` over the bytes ``safetensors.torch.load_file`` returns (not our reader);
``os.stat`` modes against the umask; file hashes before and after.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from fimoe_lab.checkpoints import convert_checkpoint, read_kernel_metadata, restore, restore_checkpoint, safe_io
from fimoe_lab.cli import main
from fimoe_lab.cli._common import report_error
from fimoe_lab.errors import CheckpointError
from fimoe_lab.resources import sample_names, sample_path


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("sample", sample_names())
def test_convert_records_the_sha256_of_every_tensor(sample, tmp_path):
    out = convert_checkpoint(sample_path(sample), tmp_path / "k.safetensors", "cutlass")
    sums = read_kernel_metadata(out)["checksums"]
    raw = out.read_bytes()  # the oracle: the file's own bytes, cut at its header's offsets
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__")
    assert sorted(sums) == sorted(header) == sorted(load_file(str(out)))
    for name, entry in header.items():
        lo, hi = entry["data_offsets"]
        assert sums[name] == hashlib.sha256(raw[8 + n + lo : 8 + n + hi]).hexdigest(), name


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_outputs_get_normal_permissions_from_the_umask(umask, mode, tmp_path):
    old = os.umask(umask)
    try:
        k = convert_checkpoint(sample_path("mixtral-bf16"), tmp_path / "k.safetensors", "trtllm")
        back = restore_checkpoint(k, tmp_path / "back")
    finally:
        os.umask(old)
    assert os.stat(k).st_mode & 0o777 == mode
    assert os.stat(back).st_mode & 0o777 == mode | (0o111 & ~umask)
    for f in back.iterdir():
        assert os.stat(f).st_mode & 0o777 == mode, f


def test_force_replaces_what_this_tool_wrote_and_a_failure_keeps_it(tmp_path, capsys):
    k = tmp_path / "k.safetensors"
    assert main(["convert", "qwen3-moe-bf16", str(k), "--backend", "trtllm", "--no-progress"]) == 0
    assert main(["convert", "qwen3-moe-bf16", str(k), "--backend", "cutlass", "--force", "--no-progress"]) == 0
    assert read_kernel_metadata(k)["backend"] == "cutlass"
    back = tmp_path / "back"
    assert main(["restore", str(k), str(back)]) == 0
    assert main(["restore", str(k), str(back), "--force"]) == 0
    assert sorted(p.name for p in back.iterdir()) == sorted(safe_io.RESTORE_FILES | {safe_io.shard_name(1, 1)})
    before = {p.name: sha(p) for p in back.iterdir()}
    bad = tmp_path / "bad.safetensors"
    raw = bytearray(k.read_bytes())
    raw[-1] ^= 0xFF  # the last tensor's last byte
    bad.write_bytes(bytes(raw))
    capsys.readouterr()
    assert main(["restore", str(bad), str(back), "--force"]) == 2
    assert "checksum mismatch" in capsys.readouterr().err
    assert {p.name: sha(p) for p in back.iterdir()} == before  # the old output is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back", "bad.safetensors", "k.safetensors"]


def test_stale_temporaries_of_dead_writers_are_swept_and_live_ones_kept(tmp_path):
    out = tmp_path / "k.safetensors"
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "30"])
    try:
        stale = tmp_path / f".k.safetensors.tmp-{dead.pid}-abcd1234"
        stale.write_bytes(b"half")
        stale_dir = tmp_path / f".k.safetensors.tmp-{dead.pid}-dir00000"
        stale_dir.mkdir()
        (stale_dir / "x").write_bytes(b"half")
        busy = tmp_path / f".k.safetensors.tmp-{live.pid}-beef0000"
        busy.write_bytes(b"in progress")
        other = tmp_path / f".other.tmp-{dead.pid}-abcd1234"
        other.write_bytes(b"not ours")
        assert sorted(safe_io.sweep_stale(out)) == sorted([stale, stale_dir])
        assert busy.exists() and other.exists() and not stale.exists() and not stale_dir.exists()
    finally:
        live.kill()
        live.wait()


def test_a_directory_moved_aside_by_a_killed_restore_is_put_back(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    out = tmp_path / "back"
    aside = tmp_path / f".back.old-{dead.pid}-00000000"
    aside.mkdir()
    (aside / safe_io.MARKER).write_text("{}")
    safe_io.sweep_stale(out)
    assert (out / safe_io.MARKER).exists() and not aside.exists()


def test_signal_handlers_are_installed_only_while_writing(tmp_path):
    def mine(*_):
        return None

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        with safe_io.atomic_file(tmp_path / "f") as handle:
            assert signal.getsignal(signal.SIGTERM) is not mine
            handle.write(b"x")
        assert signal.getsignal(signal.SIGTERM) is mine
        with pytest.raises(safe_io.Terminated), safe_io.atomic_file(tmp_path / "g") as handle:
            handle.write(b"y")
            os.kill(os.getpid(), signal.SIGTERM)
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"] and (tmp_path / "f").read_bytes() == b"x"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_that_an_extension_turns_into_another_error_is_reported_as_the_signal(sig, tmp_path, capsys):
    import torch

    class SignalledWhileIndexed:  # torch reads it as a sequence; the handler raises inside its __getitem__
        def __len__(self) -> int:
            return 2

        def __getitem__(self, i: int) -> int:
            os.kill(os.getpid(), sig)
            for _ in range(10**6):  # the handler runs between bytecodes
                pass
            return i

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    with pytest.raises(ValueError, match="could not determine the shape"):  # what torch makes of it unguarded
        previous = signal.signal(sig, interrupt)
        try:
            torch.tensor(SignalledWhileIndexed())
        finally:
            signal.signal(sig, previous)
    with pytest.raises(KeyboardInterrupt) as caught, safe_io.atomic_file(tmp_path / "f") as handle:
        handle.write(b"x")
        torch.tensor(SignalledWhileIndexed())
    assert isinstance(caught.value.__cause__, ValueError) and list(tmp_path.iterdir()) == []
    assert report_error(caught.value) == 128 + sig
    assert capsys.readouterr().err.strip() == ("interrupted" if sig == signal.SIGINT else f"terminated by signal {sig}")


def test_temporaries_are_never_followed_through_a_planted_link(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    monkeypatch.setattr(safe_io.secrets, "token_hex", lambda n: "0" * (2 * n))
    (tmp_path / f".f.tmp-{os.getpid()}-00000000").symlink_to(victim)
    with pytest.raises(OSError), safe_io.atomic_file(tmp_path / "f") as handle:
        handle.write(b"evil")
    assert victim.read_bytes() == b"precious" and not (tmp_path / "f").exists()


def test_a_hugging_face_cache_snapshot_links_into_its_blobs(tmp_path):
    src = sample_path("deepseek-v3-fp8")
    repo = tmp_path / "models--x--y"
    snap = repo / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in src.iterdir():
        blob = repo / "blobs" / hashlib.sha256(f.name.encode()).hexdigest()
        shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(Path("../..") / "blobs" / blob.name)
    k = convert_checkpoint(snap, tmp_path / "k.safetensors", "trtllm")
    assert read_kernel_metadata(k)["layers"]
    outside = tmp_path / "outside.safetensors"
    shard = max(snap.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    shutil.copyfile(shard, outside)
    shard.unlink()
    shard.symlink_to(outside)
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        convert_checkpoint(snap, tmp_path / "k2.safetensors", "trtllm")


def test_restore_writes_a_marker_and_an_index_that_reads_back(tmp_path):
    k = convert_checkpoint(sample_path("gpt-oss-mxfp4"), tmp_path / "k.safetensors", "trtllm")
    back = restore_checkpoint(k, tmp_path / "back")
    index = json.loads((back / "model.safetensors.index.json").read_text())
    shard = load_file(str(back / "model-00001-of-00001.safetensors"))
    assert sorted(index["weight_map"]) == sorted(shard)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in shard.values())
    marker = (back / safe_io.MARKER).read_text()
    assert json.loads(marker) == restore.RESTORED_MARK and str(tmp_path) not in marker  # nothing of the machine


@pytest.mark.parametrize("damage", ["json", "safetensors", "pickle"])
def test_a_damaged_golden_set_is_one_clear_error(damage, tmp_path, capsys):
    data, blobs = tmp_path / "g.json", tmp_path / "g.safetensors"
    import torch
    from safetensors.torch import save_file

    save_file({"a": torch.arange(4, dtype=torch.int32)}, str(blobs))
    data.write_text(json.dumps([{"name": "x", "inputs": {"t": {"tensor": "a"}}}]))
    if damage == "json":
        data.write_text("[{")
    elif damage == "safetensors":
        blobs.write_bytes(blobs.read_bytes()[:20])
    else:
        (tmp_path / "g.pt").write_bytes(b"\x80\x04cos\nsystem\n")
    target = tmp_path / ("g.pt" if damage == "pickle" else "g.json")
    assert main(["goldens", str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: goldens: ") and "(fix: " in err[0]


def test_output_lock_is_reentrant_in_one_process_and_released_at_the_outermost_exit(tmp_path):
    from fimoe_lab.checkpoints.safe_io import OutputLock

    out = tmp_path / "k.safetensors"
    lock = tmp_path / ".k.safetensors.lock"
    with OutputLock(out):
        with OutputLock(out):  # convert takes it before reading and again where it writes
            assert json.loads(lock.read_text())["pid"] == os.getpid()
        assert lock.exists()  # still held by the outer writer
    assert not lock.exists()


def test_output_lock_taken_but_not_yet_written_is_not_stale(tmp_path):
    """A lock file is created empty and gets its pid a moment later. A second writer that finds it empty
    waits for the pid (here: a live process's, written 0.1 s later) and refuses; it does not remove
    the lock as stale and write the same output (what CI once saw: two concurrent converts both
    exiting 0)."""
    import subprocess
    import sys
    import threading

    from fimoe_lab.checkpoints.safe_io import OutputLock
    from fimoe_lab.errors import CheckpointError

    out = tmp_path / "k.safetensors"
    lock = tmp_path / ".k.safetensors.lock"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        lock.write_bytes(b"")
        threading.Timer(0.1, lambda: lock.write_text(str(other.pid))).start()
        with pytest.raises(CheckpointError, match=f"another fimoe-lab \\(pid {other.pid}\\)"), OutputLock(out):
            pass
        assert lock.read_text() == str(other.pid)  # still the other writer's
    finally:
        other.kill()
        other.wait()


def test_output_lock_left_empty_by_a_dead_writer_is_stale_after_the_settle_time(tmp_path, monkeypatch):
    from fimoe_lab.checkpoints import safe_io

    monkeypatch.setattr(safe_io, "LOCK_SETTLE_S", 0.2)
    out = tmp_path / "k.safetensors"
    lock = tmp_path / ".k.safetensors.lock"
    lock.write_bytes(b"")  # its writer was killed between creating it and writing its pid
    with safe_io.OutputLock(out):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert not lock.exists()
