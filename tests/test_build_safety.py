"""The TRTLLM-Gen module cache loads only what it built: inside the cache, owned, hash-checked;
archive members never land outside their target."""

import os
from pathlib import Path

import pytest

from fimoe_lab.tune import build


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    monkeypatch.setenv("FIMOE_LAB_CACHE", str(root))
    so, shim = root / "mod.so", root / "shim.so"
    so.write_bytes(os.urandom(4096))
    shim.write_bytes(os.urandom(1024))
    man = build.Manifest(
        str(so),
        str(shim),
        "0.6.13",
        "0.6.13",
        "ks",
        1.0,
        4096,
        None,
        so_sha256=build._sha256(so),
        shim_sha256=build._sha256(shim),
    )
    return root, man


def test_intact_module_in_owned_cache_loads(cache):
    assert build.module_problem(cache[1]) is None


def test_tampered_module_is_refused(cache):
    root, man = cache
    data = bytearray(Path(man.so_path).read_bytes())
    data[100] ^= 1
    Path(man.so_path).write_bytes(bytes(data))
    assert "hash" in build.module_problem(man)


def test_manifest_without_hashes_is_refused(cache):
    root, man = cache
    man.so_sha256 = ""
    assert "hash" in build.module_problem(man)


def test_library_outside_the_cache_is_refused(cache, tmp_path):
    root, man = cache
    outside = tmp_path / "evil.so"
    outside.write_bytes(Path(man.so_path).read_bytes())
    man.so_path = str(outside)
    assert "inside" in build.module_problem(man)
    man.so_path = str(root / ".." / "evil.so")  # a path that only looks inside
    assert "inside" in build.module_problem(man)


def test_cache_writable_by_others_is_refused(cache):
    root, man = cache
    root.chmod(0o777)
    try:
        assert "writable" in build.module_problem(man)
    finally:
        root.chmod(0o700)


@pytest.mark.parametrize("member", ["../escape.h", "a/../../escape.h", "/etc/escape.h"])
def test_archive_member_outside_target_is_refused(tmp_path, member):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(build.BuildError, match="outside"):
        build._inside(out, member, "test wheel member")
    assert not (tmp_path / "escape.h").exists()


def test_archive_member_inside_target_is_kept(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    assert build._inside(out, "sub/ok.h", "member") == (out / "sub" / "ok.h").resolve()
