"""Output locks cannot be planted or fooled, and environment faults leave nothing behind.

Generated variants: every kind of special file planted at the lock path (refused at once, never
opened, left as it was); every kind of holder record (another host, boot, pid namespace, an
unreadable record: alive and named with how to clear it; our own host with the pid gone or reused:
taken over); a full disk and a read-only file system at each write of convert (one line, no lock,
temporary or output left).
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_bad_inputs import BACKEND, copy_sample, error_after_progress, leftovers, run, tree_hash

from fimoe_lab.checkpoints import safe_io

SAMPLE = "mixtral-bf16"


def _fifo(p: Path) -> None:
    os.mkfifo(p)


def _socket(p: Path) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(p))
    s.close()


PLANTS = {
    "fifo": _fifo,
    "socket": _socket,
    "link-to-devnull": lambda p: p.symlink_to("/dev/null"),
    "link-to-fifo": lambda p: (_fifo(p.with_name("f")), p.symlink_to(p.with_name("f"))),
    "dangling-link": lambda p: p.symlink_to(p.with_name("nowhere")),
    "directory": lambda p: p.mkdir(),
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
@pytest.mark.parametrize("single", [True, False])
def test_a_special_file_at_the_lock_path_is_refused_without_blocking(plant, single, tmp_path, capsys):
    ck = copy_sample(SAMPLE, tmp_path)
    out = tmp_path / ("k.safetensors" if single else "k")
    lock = tmp_path / f".{out.name}.lock"
    PLANTS[plant](lock)
    kind = os.lstat(lock).st_mode
    before = tree_hash(ck)
    start = time.monotonic()
    rc, _, err = run(["convert", ck, out, "--backend", BACKEND, "--no-progress"], capsys)
    assert time.monotonic() - start < 30
    assert rc == 2, err
    (line,) = error_after_progress(err, during=False)
    assert "not a lock fimoe-lab made" in line and f"remove {lock}" in line, line
    assert os.lstat(lock).st_mode == kind and not os.path.lexists(out) and tree_hash(ck) == before


def _record(**changes) -> dict:
    record = safe_io.holder_record()
    record.update(changes)
    return record


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    time.sleep(0.05)
    yield proc
    proc.kill()
    proc.wait()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


ALIVE = {
    "other-host": (lambda live: _record(pid=live, host="gpu-node-17"), "on host gpu-node-17"),
    "other-host-dead-pid": (lambda live: _record(pid=_dead_pid(), host="gpu-node-17"), "on host gpu-node-17"),
    "other-boot": (lambda live: _record(pid=_dead_pid(), boot_id="0" * 36), "from another boot of"),
    "other-pid-namespace": (lambda live: _record(pid=_dead_pid(), pid_ns="pid:[1]"), "in pid namespace pid:[1]"),
    "not-json": (lambda live: "held by someone", "an unknown writer"),
    "pid-not-a-number": (lambda live: _record(pid="12"), "an unknown writer"),
    "live-same-start": (lambda live: safe_io.holder_record(live), "pid"),
    "legacy-live-pid": (lambda live: live, "pid"),
}
STALE = {
    "dead-pid": lambda live: _record(pid=_dead_pid()),
    "pid-reused": lambda live: _record(pid=live, start="1"),  # that pid now runs another process
    "legacy-dead-pid": lambda live: _dead_pid(),
}


def _write_lock(lock: Path, record) -> bytes:
    raw = (record if isinstance(record, str) else json.dumps(record)).encode()
    lock.write_bytes(raw)
    return raw


@pytest.mark.parametrize("holder", sorted(ALIVE))
def test_a_holder_that_cannot_be_proven_gone_counts_as_alive(holder, sleeper, tmp_path, capsys):
    ck = copy_sample(SAMPLE, tmp_path)
    out = tmp_path / "k.safetensors"
    lock = tmp_path / ".k.safetensors.lock"
    make, named = ALIVE[holder]
    raw = _write_lock(lock, make(sleeper.pid))
    rc, _, err = run(["convert", ck, out, "--backend", BACKEND, "--no-progress"], capsys)
    assert rc == 2, err
    (line,) = error_after_progress(err, during=False)
    assert "another fimoe-lab (" in line and named in line and f"remove {lock}" in line, line
    assert lock.read_bytes() == raw and not os.path.lexists(out)


@pytest.mark.parametrize("holder", sorted(STALE))
def test_a_holder_proven_gone_is_taken_over(holder, sleeper, tmp_path, capsys):
    ck = copy_sample(SAMPLE, tmp_path)
    out = tmp_path / "k.safetensors"
    _write_lock(tmp_path / ".k.safetensors.lock", STALE[holder](sleeper.pid))
    rc, _, err = run(["convert", ck, out, "--backend", BACKEND, "--no-progress"], capsys)
    assert rc == 0, err
    assert leftovers(out) == ["k.safetensors"]


def test_a_lock_records_host_boot_namespace_pid_and_start(tmp_path):
    out = tmp_path / "k.safetensors"
    with safe_io.OutputLock(out) as lock:
        record = json.loads(lock.path.read_text())
    assert record == safe_io.holder_record()
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    assert record["boot_id"] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert record["start"] is not None and record["pid_ns"].startswith("pid:[")


FAULTS = {"full-disk": errno.ENOSPC, "read-only": errno.EROFS, "quota": errno.EDQUOT}


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("nth", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("single", [True, False])
def test_a_full_or_read_only_file_system_leaves_nothing(fault, nth, single, tmp_path, capsys, monkeypatch):
    """The ``nth`` file created under ``tmp_path`` (the lock's temporary, a shard's, the index's...) fails
    with the fault: one line, and no lock, temporary or output left."""
    ck = copy_sample("qwen3-moe-bf16", tmp_path)
    out = tmp_path / ("k.safetensors" if single else "k")
    before = tree_hash(ck)
    real_open, count = os.open, [0]

    def failing_open(path, flags, *a, **k):
        if flags & os.O_CREAT and str(path).startswith(str(tmp_path)):
            count[0] += 1
            if count[0] >= nth:
                raise OSError(FAULTS[fault], os.strerror(FAULTS[fault]), str(path))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", failing_open)
    rc, _, err = run(["convert", ck, out, "--backend", BACKEND, "--no-progress", "--shard-size", "40000"], capsys)
    monkeypatch.undo()
    if count[0] < nth:  # the run created fewer files than that: it must have succeeded
        assert rc == 0, err
        return
    assert rc == 2, err
    (line,) = error_after_progress(err, during=False)
    assert os.strerror(FAULTS[fault]) in line and "nothing partial was left" in line, line
    assert leftovers(out) == [] or (not single and leftovers(out) == ["k"] and _only_whole_shards(out)), leftovers(out)
    assert tree_hash(ck) == before


def _only_whole_shards(out: Path) -> bool:
    """A sharded output may keep the shards finished before the fault (for --resume), never a lock,
    temporary or index."""
    names = sorted(p.name for p in out.iterdir())
    return all(safe_io.SHARD_RE.match(n) for n in names) and safe_io.INDEX not in names
