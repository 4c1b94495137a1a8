"""Fault injection on the shipped samples: every bad input gets one clear line, the right exit code,
no partial output, and leaves the input's bytes as they were.

Each case runs the CLI in-process (``fimoe_lab.cli.main``) on a copy of a shipped sample (or of a
file converted from one) with one fault injected: truncation at random offsets, tampered
safetensors headers and ``fimoe_lab`` metadata, flipped data bytes (checksums), edited configs
and indexes, shards that are missing, FIFOs or links out of the checkpoint, misused paths and
flags. Signals and file-size limits need a real process: :class:`Forker` (one interpreter that
has imported the CLI but run no kernel) forks a child per case and delivers them.

The checks of every case (:func:`expect_error`): exit code 2, exactly one stderr line
``error: ... (fix: ...)``, no traceback, OUT absent with no temporary or lock beside it, and
the SHA-256 of every input file unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import struct
from pathlib import Path

import pytest
import torch
from helpers import json_paths
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fimoe_lab.cli import main
from fimoe_lab.cli._common import PROGRESS_LINE
from fimoe_lab.resources import sample_names, sample_path

SAMPLES = sample_names()
BACKEND = "trtllm"


# ============================================================================ helpers
def tree_hash(path: Path) -> str:
    """SHA-256 over the names and bytes of every file under ``path`` (or of the file)."""
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() and not p.is_symlink())
    for f in files:
        h.update(str(f.relative_to(path.parent)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def leftovers(out: Path) -> list[str]:
    """Anything at or beside ``out`` that a write of ``out`` could have left."""
    return sorted(p.name for p in out.parent.iterdir() if p.name == out.name or p.name.startswith(f".{out.name}."))


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as exc:  # a usage error (argparse)
        rc = int(exc.code or 0)
    got = capsys.readouterr()
    return rc, got.out, got.err


def error_after_progress(err: str, during: bool = True) -> list[str]:
    """stderr of a failure: the one ``error: ... (fix: ...)`` line last, and before it nothing (a refusal before any
    work, ``during`` False) or only plain progress lines (a failure found while writing, ``during`` True)."""
    lines = err.strip().splitlines()
    assert lines and lines[-1].startswith("error: ") and "(fix: " in lines[-1], err
    assert (during or len(lines) == 1) and all(PROGRESS_LINE.fullmatch(line) for line in lines[:-1]), err
    return lines[-1:]


def expect_error(argv, capsys, out: Path, inputs: list[Path], match=None, code: int = 2, during: bool = False) -> str:
    """Run ``argv`` and check every promise of a refusal (``during``: found while writing, after progress lines
    maybe); returns the error line."""
    before = {p: tree_hash(p) for p in inputs}
    rc, _, err = run(argv, capsys)
    assert rc == code, (rc, err)
    lines = error_after_progress(err, during)
    assert "Traceback" not in err
    assert match is None or any(m in lines[0] for m in ([match] if isinstance(match, str) else match)), lines[0]
    assert leftovers(out) == [], leftovers(out)
    assert {p: tree_hash(p) for p in inputs} == before
    return lines[0]


def read_header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_header(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def edit_meta(path: Path, edit) -> None:
    """Rewrite the ``fimoe_lab`` metadata of a kernel file with ``edit(meta)`` (a valid safetensors file)."""
    header, data = read_header(path)
    meta = json.loads(header["__metadata__"]["fimoe_lab"])
    edit(meta)
    header["__metadata__"]["fimoe_lab"] = json.dumps(meta)
    write_header(path, header, data)


@pytest.fixture(scope="module")
def kernels(tmp_path_factory) -> dict[str, Path]:
    """Each sample converted once for trtllm (read-only masters; cases work on copies)."""
    d = tmp_path_factory.mktemp("kernels")
    out = {}
    for s in SAMPLES:
        out[s] = d / f"{s}.safetensors"
        assert main(["convert", s, str(out[s]), "--backend", BACKEND, "--no-progress"]) == 0
    return out


@pytest.fixture(scope="module")
def restored(kernels, tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    """What a clean restore of each kernel file gives (the oracle for fuzzed files that still restore)."""
    from safetensors.torch import load_file

    d = tmp_path_factory.mktemp("restored")
    got = {}
    for s, k in kernels.items():
        assert main(["restore", str(k), str(d / s)]) == 0
        got[s] = load_file(str(d / s / "model-00001-of-00001.safetensors"))
    return got


def copy_kernel(kernels, sample: str, tmp_path: Path) -> Path:
    k = tmp_path / "in.safetensors"
    shutil.copyfile(kernels[sample], k)
    return k


def copy_sample(sample: str, tmp_path: Path) -> Path:
    ck = tmp_path / "ck"
    shutil.copytree(sample_path(sample), ck)
    return ck


def largest_shard(ck: Path) -> Path:
    """The largest shard (the samples keep their experts there)."""
    return max(ck.glob("*.safetensors"), key=lambda p: p.stat().st_size)


# ============================================================================ truncation
OFFSETS = 8


@pytest.mark.parametrize("sample", SAMPLES)
@pytest.mark.parametrize("i", range(OFFSETS))
def test_restore_refuses_a_truncated_kernel_file(kernels, sample, i, tmp_path, capsys):
    k = copy_kernel(kernels, sample, tmp_path)
    size = k.stat().st_size
    cut = [0, 7, 8, 100][i] if i < 4 else random.Random(f"{sample}{i}").randrange(101, size)
    k.write_bytes(k.read_bytes()[:cut])
    expect_error(["restore", k, tmp_path / "out"], capsys, tmp_path / "out", [k])


@pytest.mark.parametrize("sample", SAMPLES)
@pytest.mark.parametrize("i", range(6))
def test_convert_refuses_a_truncated_shard(sample, i, tmp_path, capsys):
    ck = copy_sample(sample, tmp_path)
    shard = largest_shard(ck)
    size = shard.stat().st_size
    cut = [0, 5, 64][i] if i < 3 else random.Random(f"{sample}{i}").randrange(65, size)
    shard.write_bytes(shard.read_bytes()[:cut])
    out = tmp_path / "k.safetensors"
    expect_error(["convert", ck, out, "--backend", BACKEND], capsys, out, [ck])


# ============================================================================ tampered metadata
def _layer(meta):
    return next(iter(meta["layers"].values()))


META_EDITS = {
    "version": (lambda m: m.update(version=99), "metadata version 99"),
    "no-layers": (lambda m: m.update(layers=[]), "no table of layers"),
    "recipe": (lambda m: _layer(m)["plan"].update(recipe="nvfp4/nowhere"), "unknown layout recipe"),
    "recipe-mismatch": (lambda m: _layer(m)["plan"]["args"].update(backend="cutlass"), "does not match"),
    "huge-intermediate": (lambda m: _layer(m)["plan"]["args"].update(intermediate=10**9), "not an integer in"),
    "huge-both": (lambda m: _layer(m)["plan"]["args"].update(intermediate=1 << 20, hidden=1 << 20), "do not fit"),
    "negative-hidden": (lambda m: _layer(m)["plan"]["args"].update(hidden=-256), "not an integer in"),
    "float-hidden": (lambda m: _layer(m)["plan"]["args"].update(hidden=256.5), "not an integer in"),
    "steps": (lambda m: _layer(m)["tensors"]["w13"].update(steps=[]), "does not build"),
    "kernel-shape": (lambda m: _layer(m)["tensors"]["w2"]["kernel"].update(shape=[1, 2, 3]), "metadata says"),
    "tensor-name": (lambda m: _layer(m)["tensors"]["w2"].update(name="nope"), "not in the file"),
    "no-tensors": (lambda m: _layer(m).pop("tensors"), "form convert writes"),
    "plan-not-dict": (lambda m: _layer(m).update(plan=7), "form convert writes"),
    "prefix": (lambda m: m.update(prefix="other."), "not in the file"),
    "layer-index": (lambda m: m.update(layers={"x": _layer(m)}), "form convert writes"),
    "checksum-altered": (
        lambda m: m["checksums"].update({k: "f" * 64 for k in list(m["checksums"])[:1]}),
        "checksum mismatch",
    ),
    "huge-checkpoint-shape": (
        lambda m: _layer(m)["tensors"]["w13"]["checkpoint"].update(shape=[1, 1 << 20, 1 << 20]),
        "not one the file's tensors can hold",
    ),
    "tp-size-none": (lambda m: m.update(tp_size=None), "metadata field 'tp_size'"),
    "tp-rank-negative": (lambda m: m.update(tp_rank=-1), "metadata field 'tp_rank'"),
    "config-not-object": (lambda m: m.update(config=2**40), "metadata field 'config'"),
    "prefix-missing": (lambda m: m.pop("prefix"), "no 'prefix'"),
    "convention-unknown": (lambda m: m.update(convention="nobody"), "unknown checkpoint convention"),
    "checksum-missing": (lambda m: m["checksums"].pop(sorted(m["checksums"])[0]), "no checksum recorded"),
}


FOUND_WHILE_WRITING = {"checksum-altered", "checksum-missing"}
"""Edits restore finds only once it has read (and queued for writing) the tensor: after progress lines."""


@pytest.mark.parametrize("sample", SAMPLES)
@pytest.mark.parametrize("edit", sorted(META_EDITS))
def test_restore_refuses_tampered_metadata(kernels, sample, edit, tmp_path, capsys):
    k = copy_kernel(kernels, sample, tmp_path)
    fn, match = META_EDITS[edit]
    edit_meta(k, fn)
    out = tmp_path / "out"
    expect_error(["restore", k, out], capsys, out, [k], match, during=edit in FOUND_WHILE_WRITING)


def test_restore_refuses_metadata_that_is_not_json(kernels, tmp_path, capsys):
    k = copy_kernel(kernels, SAMPLES[0], tmp_path)
    header, data = read_header(k)
    header["__metadata__"]["fimoe_lab"] = "{not json"
    write_header(k, header, data)
    expect_error(["restore", k, tmp_path / "out"], capsys, tmp_path / "out", [k], "not valid JSON")


def _tensor_names(path: Path) -> list[str]:
    header, _ = read_header(path)
    return sorted(n for n in header if n != "__metadata__")


@pytest.mark.parametrize("sample", SAMPLES)
@pytest.mark.parametrize("j", range(6))
def test_restore_refuses_a_flipped_byte_naming_the_tensor(kernels, sample, j, tmp_path, capsys):
    k = copy_kernel(kernels, sample, tmp_path)
    names = _tensor_names(k)
    name = names[j % len(names)]
    header, data = read_header(k)
    lo, hi = header[name]["data_offsets"]
    if hi == lo:
        pytest.skip("empty tensor")
    pos = lo + random.Random(f"{sample}{j}").randrange(hi - lo)
    data = data[:pos] + bytes([data[pos] ^ 0x5A]) + data[pos + 1 :]
    write_header(k, header, data)
    out = tmp_path / "out"  # a checksum is checked once its tensor is read: after progress lines maybe
    expect_error(["restore", k, out], capsys, out, [k], f"{name}: checksum mismatch", during=True)


# ============================================================================ header fuzzing
def _json_values():
    return st.recursive(
        st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.floats() | st.text(max_size=8),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
        max_leaves=6,
    )


def _fuzz_case(kernels, restored, tmp_path, capsys, mutate) -> None:
    k = tmp_path / f"in-{os.urandom(4).hex()}.safetensors"
    out = tmp_path / f"out-{os.urandom(4).hex()}"
    shutil.copyfile(kernels[SAMPLES[-1]], k)
    mutate(k)
    before = tree_hash(k)
    rc, _, err = run(["restore", k, out], capsys)
    assert tree_hash(k) == before and "Traceback" not in err
    if rc == 0:  # the edit was harmless: the result must be the clean restore
        from safetensors.torch import load_file

        got = load_file(str(out / "model-00001-of-00001.safetensors"))
        want = restored[SAMPLES[-1]]
        assert sorted(got) == sorted(want) and all(
            torch.equal(got[n].view(-1).view(torch.uint8), want[n].view(-1).view(torch.uint8)) for n in got
        )
        shutil.rmtree(out)
    else:
        assert rc == 2, err
        error_after_progress(err)  # an edit may be found before or while writing
        assert leftovers(out) == []


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data())
def test_fuzzed_metadata_is_refused_or_restores_exactly(kernels, restored, tmp_path_factory, capsys, data):
    tmp = tmp_path_factory.mktemp("fuzz")

    def mutate(k: Path) -> None:
        def edit(meta):
            paths = [p for p, _ in json_paths(meta) if p]
            path = data.draw(st.sampled_from(paths))
            node = meta
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = data.draw(_json_values())

        edit_meta(k, edit)

    _fuzz_case(kernels, restored, tmp, capsys, mutate)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(pos=st.integers(0, 4095), junk=st.binary(min_size=1, max_size=16))
def test_fuzzed_header_bytes_are_refused_or_restore_exactly(kernels, restored, tmp_path_factory, capsys, pos, junk):
    tmp = tmp_path_factory.mktemp("fuzzb")

    def mutate(k: Path) -> None:
        raw = bytearray(k.read_bytes())
        (n,) = struct.unpack("<Q", raw[:8])
        at = pos % (8 + n)
        raw[at : at + len(junk)] = junk
        k.write_bytes(bytes(raw))

    _fuzz_case(kernels, restored, tmp, capsys, mutate)


# ============================================================================ tampered checkpoints
EXPERT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts")
INTERMEDIATE_KEYS = ("moe_intermediate_size", "intermediate_size")


def _config_edit(keys: tuple[str, ...], value):
    """config.json with every one of ``keys`` that it has set to ``value``."""

    def edit(ck: Path) -> None:
        cfg = json.loads((ck / "config.json").read_text())
        present = [k for k in keys if k in cfg]
        assert present, keys
        cfg.update({k: value for k in present})
        (ck / "config.json").write_text(json.dumps(cfg))

    return edit


def _set_config(ck: Path, **kv) -> None:
    cfg = json.loads((ck / "config.json").read_text())
    cfg.update(kv)
    (ck / "config.json").write_text(json.dumps(cfg))


def _index_edit(fn):
    def edit(ck: Path) -> None:
        index = ck / "model.safetensors.index.json"
        if not index.exists():
            pytest.skip("no index")
        data = json.loads(index.read_text())
        fn(data)
        index.write_text(json.dumps(data))

    return edit


def _first(wm):
    return next(n for n in sorted(wm) if ".experts." in n)


def _rename_tensor(ck: Path) -> None:
    shard = largest_shard(ck)
    header, data = read_header(shard)
    name = next(n for n in sorted(header) if ".experts." in n)
    header[name.replace(".experts.", ".expertz.")] = header.pop(name)
    write_header(shard, header, data)
    index = ck / "model.safetensors.index.json"
    if index.exists():
        idx = json.loads(index.read_text())
        idx["weight_map"][name.replace(".experts.", ".expertz.")] = idx["weight_map"].pop(name)
        index.write_text(json.dumps(idx))


def _retype_tensor(ck: Path) -> None:
    """An expert weight whose dtype is changed to one of the same size (U8 <-> I8, BF16 <-> F16, F8 -> U8)."""
    shard = largest_shard(ck)
    header, data = read_header(shard)
    swap = {"U8": "I8", "I8": "U8", "BF16": "F16", "F16": "BF16", "F8_E4M3": "U8", "F32": "I32"}
    name = next(n for n in sorted(header) if ".experts." in n and header[n]["dtype"] in swap)
    header[name]["dtype"] = swap[header[name]["dtype"]]
    write_header(shard, header, data)


def _reshape_tensor(ck: Path) -> None:
    """An expert weight transposed (same bytes); a square one reshaped to twice the rows."""
    shard = largest_shard(ck)
    header, data = read_header(shard)
    name = next(n for n in sorted(header) if ".experts." in n and len(header[n]["shape"]) >= 2)
    shape = header[name]["shape"]
    header[name]["shape"] = shape[::-1] if shape != shape[::-1] else [shape[0] * 2, shape[1] // 2, *shape[2:]]
    write_header(shard, header, data)


def _fifo_shard(ck: Path) -> None:
    shard = largest_shard(ck)
    shard.unlink()
    os.mkfifo(shard)


def _fifo_config(ck: Path) -> None:
    (ck / "config.json").unlink()
    os.mkfifo(ck / "config.json")


def _escaping_link(ck: Path) -> None:
    shard = largest_shard(ck)
    outside = ck.parent / "elsewhere.safetensors"
    shutil.move(shard, outside)
    shard.symlink_to(outside)


CHECKPOINT_EDITS = {
    "experts-2e7": (_config_edit(EXPERT_KEYS, 20_000_000), "not an integer in"),
    "experts-2e5": (_config_edit(EXPERT_KEYS, 200_000), ["config.json declares 200000 experts", "headers declare"]),
    "experts-zero": (_config_edit(EXPERT_KEYS, 0), "not an integer in"),
    "hidden-zero": (_config_edit(("hidden_size",), 0), "not an integer in"),
    "hidden-text": (_config_edit(("hidden_size",), "4096"), "not an integer in"),
    "hidden-huge": (_config_edit(("hidden_size",), 1 << 40), "not an integer in"),
    "hidden-float": (_config_edit(("hidden_size",), 256.0), "not an integer in"),
    "intermediate-negative": (_config_edit(INTERMEDIATE_KEYS, -8), "not an integer in"),
    "intermediate-one": (_config_edit(INTERMEDIATE_KEYS, 1), None),
    "intermediate-huge": (_config_edit(INTERMEDIATE_KEYS, 1 << 20), "headers declare"),
    "config-not-json": (lambda ck: (ck / "config.json").write_text("{"), "not valid JSON"),
    "config-list": (lambda ck: (ck / "config.json").write_text("[]"), "not a JSON object"),
    "config-fifo": (_fifo_config, "FIFO"),
    "config-missing": (lambda ck: (ck / "config.json").unlink(), "no config.json"),
    "index-dotdot": (
        _index_edit(lambda d: d["weight_map"].update({_first(d["weight_map"]): "../x.safetensors"})),
        "not a plain relative path",
    ),
    "index-absolute": (
        _index_edit(lambda d: d["weight_map"].update({_first(d["weight_map"]): "/etc/hostname"})),
        "not a plain relative path",
    ),
    "index-not-dict": (_index_edit(lambda d: d.update(weight_map=[1, 2])), "no 'weight_map'"),
    "index-not-json": (lambda ck: (ck / "model.safetensors.index.json").write_text("]"), "not valid JSON"),
    "shard-missing": (lambda ck: largest_shard(ck).unlink(), "missing"),
    "shard-fifo": (_fifo_shard, "FIFO"),
    "shard-link-escapes": (_escaping_link, "outside the checkpoint directory"),
    "tensor-renamed": (_rename_tensor, ("missing tensor", "follow no known naming convention")),
    "tensor-retyped": (_retype_tensor, ("expected", "follow no known naming convention", "is read with")),
    "tensor-transposed": (_reshape_tensor, "expected"),
}


@pytest.mark.parametrize("command", ["convert", "inspect"])
@pytest.mark.parametrize("sample", SAMPLES)
@pytest.mark.parametrize("edit", sorted(CHECKPOINT_EDITS))
def test_convert_and_inspect_refuse_a_tampered_checkpoint(command, sample, edit, tmp_path, capsys):
    ck = copy_sample(sample, tmp_path)
    fn, match = CHECKPOINT_EDITS[edit]
    if edit == "shard-missing" and not (ck / "model.safetensors.index.json").exists():
        match = None
    fn(ck)
    out = tmp_path / "k.safetensors"
    argv = ["convert", ck, out, "--backend", BACKEND] if command == "convert" else ["inspect", ck, "--tp", "1"]
    expect_error(argv, capsys, out, [ck], match)


@pytest.mark.parametrize("command", ["convert", "inspect"])
@pytest.mark.parametrize("value", [{"a": 1}, "7", "nan", True, [7.0]], ids=["object", "string", "nan", "bool", "list"])
def test_gpt_oss_activation_parameters_must_be_numbers(command, value, tmp_path, capsys):
    ck = copy_sample("gpt-oss-mxfp4", tmp_path)
    _set_config(ck, swiglu_limit=float(value) if value == "nan" else value)
    out = tmp_path / "k.safetensors"
    argv = ["convert", ck, out, "--backend", BACKEND] if command == "convert" else ["inspect", ck, "--tp", "1"]
    expect_error(argv, capsys, out, [ck], "swiglu_limit is")


# ============================================================================ misused paths and flags
def _converted(kernels, tmp_path: Path) -> Path:
    return copy_kernel(kernels, SAMPLES[0], tmp_path)


def _restored_dir(kernels, tmp_path: Path) -> Path:
    (tmp_path / "r").mkdir()
    k = copy_kernel(kernels, SAMPLES[0], tmp_path / "r")
    assert main(["restore", str(k), str(tmp_path / "restored")]) == 0
    return tmp_path / "restored"


PATH_CASES = {
    # name: (setup(tmp, kernels) -> (argv, out, inputs), expected text)
    "convert-out-is-input": (
        lambda t, k: (["convert", cs(t), cs(t), "--backend", BACKEND], t / "x", [t / "ck"]),
        "is the input",
    ),
    "convert-out-inside-input": (
        lambda t, k: (
            ["convert", cs(t), t / "ck" / "k.safetensors", "--backend", BACKEND],
            t / "ck" / "k.safetensors",
            [t / "ck"],
        ),
        "inside the input",
    ),
    "convert-out-parent-of-input": (
        lambda t, k: (["convert", cs(t), t, "--backend", BACKEND, "--force"], t / "x", [t / "ck"]),
        "parent of the input",
    ),
    "convert-out-dot": (
        lambda t, k: (["convert", cs(t), ".", "--backend", BACKEND], t / "x", [t / "ck"]),
        "directory name",
    ),
    "convert-out-dotdot": (
        lambda t, k: (["convert", cs(t), "..", "--backend", BACKEND], t / "x", [t / "ck"]),
        "directory name",
    ),
    "convert-out-exists": (
        lambda t, k: (["convert", cs(t), own(t, b"mine"), "--backend", BACKEND], t / "x", [t / "ck", t / "own"]),
        "exists",
    ),
    "convert-force-foreign-file": (
        lambda t, k: (
            ["convert", cs(t), own(t, b"mine"), "--backend", BACKEND, "--force"],
            t / "x",
            [t / "ck", t / "own"],
        ),
        "not written by 'fimoe-lab convert'",
    ),
    "convert-force-foreign-safetensors": (
        lambda t, k: (
            ["convert", cs(t), shard_copy(t), "--backend", BACKEND, "--force"],
            t / "x",
            [t / "ck", t / "own.safetensors"],
        ),
        "not written by 'fimoe-lab convert'",
    ),
    "convert-force-symlink": (
        lambda t, k: (
            ["convert", cs(t), link_to(t, _converted(k, t)), "--backend", BACKEND, "--force"],
            t / "x",
            [t / "ck", t / "in.safetensors"],
        ),
        "symbolic link",
    ),
    "convert-force-directory": (
        lambda t, k: (["convert", cs(t), mkd(t), "--backend", BACKEND, "--force"], t / "x", [t / "ck", t / "d"]),
        "not written by",
    ),
    "restore-out-is-input": (
        lambda t, k: (["restore", _converted(k, t), t / "in.safetensors"], t / "x", [t / "in.safetensors"]),
        "is the input",
    ),
    "restore-out-dot": (
        lambda t, k: (["restore", _converted(k, t), ".", "--force"], t / "x", [t / "in.safetensors"]),
        "directory name",
    ),
    "restore-out-dotdot": (
        lambda t, k: (["restore", _converted(k, t), "..", "--force"], t / "x", [t / "in.safetensors"]),
        "directory name",
    ),
    "restore-out-parent": (
        lambda t, k: (["restore", _converted(k, t), t, "--force"], t / "x", [t / "in.safetensors"]),
        "parent of the input",
    ),
    "restore-force-foreign-dir": (
        lambda t, k: (["restore", _converted(k, t), mkd(t), "--force"], t / "x", [t / "in.safetensors", t / "d"]),
        "not a directory written by 'fimoe-lab restore'",
    ),
    "restore-force-restored-plus-extra": (
        lambda t, k: (
            ["restore", _converted(k, t), extra(_restored_dir(k, t)), "--force"],
            t / "x",
            [t / "in.safetensors", t / "restored"],
        ),
        "not a directory written by 'fimoe-lab restore'",
    ),
    "restore-force-over-a-file": (
        lambda t, k: (
            ["restore", _converted(k, t), own(t, b"x"), "--force"],
            t / "x",
            [t / "in.safetensors", t / "own"],
        ),
        "not a directory written by",
    ),
    "restore-input-missing": (
        lambda t, k: (["restore", t / "none.safetensors", t / "x"], t / "x", []),
        "no such kernel-layout file",
    ),
    "restore-input-dir": (lambda t, k: (["restore", mkd(t), t / "x"], t / "x", [t / "d"]), "is a directory"),
    "restore-input-fifo": (lambda t, k: (["restore", fifo(t), t / "x"], t / "x", []), "FIFO"),
    "restore-input-devnull": (lambda t, k: (["restore", "/dev/null", t / "x"], t / "x", []), "FIFO, device"),
    "restore-input-random-bytes": (
        lambda t, k: (["restore", own(t, os.urandom(4096)), t / "x"], t / "x", [t / "own"]),
        "not a readable safetensors",
    ),
    "restore-input-empty": (
        lambda t, k: (["restore", own(t, b""), t / "x"], t / "x", [t / "own"]),
        "not a readable safetensors",
    ),
    "restore-input-plain-checkpoint": (
        lambda t, k: (["restore", shard_copy(t), t / "x"], t / "x", [t / "own.safetensors"]),
        "no 'fimoe_lab' metadata",
    ),
    "convert-input-missing": (
        lambda t, k: (["convert", t / "nope", t / "x", "--backend", BACKEND], t / "x", []),
        "nope does not exist",
    ),
    "convert-input-file": (
        lambda t, k: (["convert", own(t, b"{}"), t / "x", "--backend", BACKEND], t / "x", [t / "own"]),
        "own is not a checkpoint directory",
    ),
    "convert-tp-zero": (
        lambda t, k: (["convert", cs(t), t / "x", "--backend", BACKEND, "--tp", "0"], t / "x", [t / "ck"]),
        "positive integer",
    ),
    "convert-tp-negative": (
        lambda t, k: (["convert", cs(t), t / "x", "--backend", BACKEND, "--tp", "-2"], t / "x", [t / "ck"]),
        "positive integer",
    ),
    "convert-rank-too-big": (
        lambda t, k: (
            ["convert", cs(t), t / "x", "--backend", BACKEND, "--tp", "2", "--rank", "2"],
            t / "x",
            [t / "ck"],
        ),
        "not valid",
    ),
    "convert-layer-absent": (
        lambda t, k: (["convert", cs(t), t / "x", "--backend", BACKEND, "--layer", "99"], t / "x", [t / "ck"]),
        "no routed experts",
    ),
    "convert-alignment-zero": (
        lambda t, k: (
            ["convert", cs(t), t / "x", "--backend", BACKEND, "--intermediate-alignment", "0"],
            t / "x",
            [t / "ck"],
        ),
        None,
    ),
    "convert-alignment-negative": (
        lambda t, k: (
            ["convert", cs(t), t / "x", "--backend", BACKEND, "--intermediate-alignment", "-64"],
            t / "x",
            [t / "ck"],
        ),
        None,
    ),
    "convert-alignment-odd": (
        lambda t, k: (
            ["convert", cs(t), t / "x", "--backend", BACKEND, "--hidden-alignment", "7"],
            t / "x",
            [t / "ck"],
        ),
        None,
    ),
    "convert-out-dir-missing": (
        lambda t, k: (["convert", cs(t), t / "no" / "k.safetensors", "--backend", BACKEND], t / "x", [t / "ck"]),
        "does not exist",
    ),
    "restore-out-dir-missing": (
        lambda t, k: (["restore", _converted(k, t), t / "no" / "back"], t / "x", [t / "in.safetensors"]),
        "does not exist",
    ),
    "inspect-layer-absent": (
        lambda t, k: (["inspect", cs(t), "--layer", "-1"], t / "x", [t / "ck"]),
        "no routed experts",
    ),
}


def cs(t: Path) -> Path:
    """A copy of the first sample at ``t / "ck"`` (made once per case)."""
    if not (t / "ck").exists():
        copy_sample(SAMPLES[0], t)
    return t / "ck"


def own(t: Path, data: bytes) -> Path:
    (t / "own").write_bytes(data)
    return t / "own"


def shard_copy(t: Path) -> Path:
    shutil.copyfile(largest_shard(sample_path(SAMPLES[0])), t / "own.safetensors")
    return t / "own.safetensors"


def link_to(t: Path, target: Path) -> Path:
    (t / "link.safetensors").symlink_to(target)
    return t / "link.safetensors"


def mkd(t: Path) -> Path:
    (t / "d").mkdir(exist_ok=True)
    (t / "d" / "notes.txt").write_text("keep me")
    return t / "d"


def fifo(t: Path) -> Path:
    os.mkfifo(t / "fifo")
    return t / "fifo"


def extra(d: Path) -> Path:
    (d / "notes.txt").write_text("keep me")
    return d


@pytest.mark.parametrize("case", sorted(PATH_CASES))
def test_misused_paths_and_flags_are_refused(kernels, case, tmp_path, capsys):
    setup, match = PATH_CASES[case]
    argv, out, inputs = setup(tmp_path, kernels)
    expect_error(argv, capsys, out, inputs, match)


# ============================================================================ locks
def test_a_lock_held_by_a_live_writer_refuses_and_a_stale_one_is_taken_over(tmp_path, capsys):
    import subprocess

    ck = copy_sample(SAMPLES[0], tmp_path)
    out = tmp_path / "k.safetensors"
    lock = tmp_path / ".k.safetensors.lock"
    holder = subprocess.Popen(["sleep", "30"])
    try:
        lock.write_text(str(holder.pid))
        rc, _, err = run(["convert", ck, out, "--backend", BACKEND], capsys)
        assert rc == 2 and f"another fimoe-lab (pid {holder.pid}) is writing" in err and "(fix: " in err
        assert not out.exists() and lock.read_text() == str(holder.pid)  # the live writer's lock is kept
    finally:
        holder.kill()
        holder.wait()
    rc, _, err = run(["convert", ck, out, "--backend", BACKEND], capsys)  # its process is gone: stale
    assert rc == 0, err
    assert leftovers(out) == ["k.safetensors"]


# ============================================================================ signals and file-size limits
FORKER = r"""
import json, os, resource, signal, sys, time
from fimoe_lab.cli import main
from fimoe_lab.checkpoints import convert
real = convert.convert_layer
for line in sys.stdin:
    case = json.loads(line)
    pids = []
    for argv in case["runs"]:
        pid = os.fork()
        if pid == 0:
            err = os.open(case["err"] + str(len(pids)), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(err, 2)
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            if case.get("fsize"):
                resource.setrlimit(resource.RLIMIT_FSIZE, (case["fsize"], case["fsize"]))
            if case.get("address_space"):
                resource.setrlimit(resource.RLIMIT_AS, (case["address_space"], case["address_space"]))
            slow = case.get("slow", 0)
            def convert_layer(*a, **k):
                time.sleep(slow)  # a slow disk: the real conversion, stretched so that a signal lands inside it
                return real(*a, **k)
            convert.convert_layer = convert_layer
            try:
                rc = main(argv)
            except SystemExit as exc:
                rc = int(exc.code or 0)
            sys.stderr.flush()
            os._exit(rc)
        pids.append(pid)
    if case.get("signal"):
        time.sleep(case["delay"])
        os.kill(pids[0], case["signal"])
    got = []
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        got.append([os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
                    os.WTERMSIG(status) if os.WIFSIGNALED(status) else None])
    print(json.dumps(got), flush=True)
"""


class Forker:
    """One interpreter that imported the CLI (and ran no kernel, so forking it is safe) and forks a
    child per run: each child is a real process running ``main(argv)``, which signals and rlimits reach."""

    def __init__(self) -> None:
        import subprocess
        import sys

        self.proc = subprocess.Popen(
            [sys.executable, "-c", FORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )

    def run(self, runs: list[list], err: Path, **case) -> list[tuple]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"runs": [[str(a) for a in r] for r in runs], "err": str(err), **case}) + "\n")
        line = self.proc.stdout.readline()
        assert line, "the forker died"
        return [tuple(x) for x in json.loads(line)]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def forker():
    f = Forker()
    yield f
    f.close()


def _restores(k: Path, tmp: Path) -> bool:
    return main(["restore", str(k), str(tmp / f"check-{os.urandom(3).hex()}")]) == 0


@pytest.mark.parametrize(
    "sig,seed", [(15, 0), (15, 1), (15, 2), (15, 3), (9, 0), (9, 1), (9, 2), (2, 0)], ids=lambda v: str(v)
)
def test_a_signal_at_a_random_point_of_convert_leaves_no_partial_output(forker, sig, seed, tmp_path, capsys):
    ck = copy_sample("qwen3-moe-bf16", tmp_path)
    before = tree_hash(ck)
    out = tmp_path / "k.safetensors"
    delay = random.Random(f"{sig}-{seed}").uniform(0.05, 1.0)
    [(rc, killed)] = forker.run(
        [["convert", ck, out, "--backend", BACKEND]], tmp_path / "err", slow=0.2, signal=sig, delay=delay
    )
    err = (tmp_path / "err0").read_text()
    print(
        f"signal {sig} after {delay:.2f} s: exit {rc}, killed by {killed}, output {out.exists()}: {err.strip()[-60:]!r}"
    )
    assert "Traceback" not in err
    assert tree_hash(ck) == before
    if out.exists():  # the rename came first: the output is whole, whatever the exit (a signal may follow it)
        assert _restores(out, tmp_path)
    if sig == 9:
        assert killed == 9
        rc2, _, err2 = run(["convert", ck, out, "--backend", BACKEND, "--force"], capsys)  # the next writer cleans up
        assert rc2 == 0, err2
        assert leftovers(out) == ["k.safetensors"] and _restores(out, tmp_path)
        return
    assert leftovers(out) == (["k.safetensors"] if out.exists() else []), (rc, killed, err)  # no temporary
    if rc == 0:
        assert out.exists()
        return
    if killed is None:  # the handler ran (removing the temporary, if any) and said so on one line
        assert rc == 128 + sig and err.strip().splitlines()[-1] in ("interrupted", f"terminated by signal {sig}"), err
        assert all(PROGRESS_LINE.fullmatch(line) for line in err.strip().splitlines()[:-1]), err  # progress before
    else:
        assert killed == sig  # the default action: before the handler was installed, or after it was restored


@pytest.mark.parametrize(
    "command,limit",
    [
        ("convert", 4096),
        ("convert", 200_000),
        ("convert", 900_000),
        ("convert --no-progress", 900_000),
        ("restore", 50_000),
        ("restore", 600_000),
    ],
)
def test_a_full_disk_leaves_no_partial_output(forker, kernels, command, limit, tmp_path):
    if command.startswith("convert"):
        src = copy_sample(SAMPLES[0], tmp_path)
        out = tmp_path / "k.safetensors"
        argv = ["convert", src, out, "--backend", BACKEND, *command.split()[1:]]
    else:
        src = copy_kernel(kernels, SAMPLES[0], tmp_path)
        out = tmp_path / "back"
        argv = ["restore", src, out]
    before = tree_hash(src)
    [(rc, killed)] = forker.run([argv], tmp_path / "err", fsize=limit)
    err = (tmp_path / "err0").read_text()
    assert (rc, killed) == (2, None)
    (line,) = error_after_progress(err, "--no-progress" not in argv)  # the error last, progress lines before it
    assert "File too large" in line
    if "--no-progress" in argv or limit >= 600_000:  # silenced: the one line; failing late: progress came first
        assert (err == line + "\n") == ("--no-progress" in argv), err
    assert leftovers(out) == [] and tree_hash(src) == before


def test_two_writers_of_one_output_one_wins(forker, tmp_path):
    ck = copy_sample("qwen3-moe-bf16", tmp_path)
    out = tmp_path / "k.safetensors"
    argv = ["convert", ck, out, "--backend", BACKEND]
    got = forker.run([argv, argv], tmp_path / "err", slow=0.3)
    errs = [(tmp_path / f"err{i}").read_text() for i in range(2)]
    assert sorted(rc for rc, _ in got) == [0, 2], (got, errs)
    loser = errs[[rc for rc, _ in got].index(2)].strip().splitlines()
    assert len(loser) == 1 and "another fimoe-lab (pid" in loser[0] and "(fix: " in loser[0]
    assert leftovers(out) == ["k.safetensors"] and _restores(out, tmp_path)


AS_EDITS = ["huge-both", "huge-intermediate", "huge-checkpoint-shape"]


@pytest.mark.parametrize("edit", AS_EDITS + ["none"])
def test_restore_under_a_6gb_address_space_refuses_before_allocating(forker, kernels, edit, tmp_path):
    """A 1 MB file claiming a huge layer is refused from its header, under RLIMIT_AS = 6 GB (a clean one restores)."""
    k = copy_kernel(kernels, "deepseek-r1-nvfp4", tmp_path)
    if edit != "none":
        edit_meta(k, META_EDITS[edit][0])
    out = tmp_path / "back"
    [(rc, killed)] = forker.run([["restore", k, out]], tmp_path / "err", address_space=6 << 30)
    err = (tmp_path / "err0").read_text()
    assert killed is None and "Traceback" not in err and "MemoryError" not in err, err
    if edit == "none":
        assert rc == 0 and (out / "model-00001-of-00001.safetensors").exists()
    else:
        assert rc == 2 and err.startswith("error: ") and leftovers(out) == []


@pytest.mark.parametrize("experts", [20_000_000, 200_000])
def test_convert_under_a_6gb_address_space_refuses_a_config_of_2e7_experts(forker, experts, tmp_path):
    ck = copy_sample("deepseek-v3-fp8", tmp_path)
    _config_edit(EXPERT_KEYS, experts)(ck)
    out = tmp_path / "k.safetensors"
    [(rc, killed)] = forker.run([["convert", ck, out, "--backend", BACKEND]], tmp_path / "err", address_space=6 << 30)
    err = (tmp_path / "err0").read_text()
    assert (rc, killed) == (2, None) and err.startswith("error: ") and "(fix: " in err, err
    assert leftovers(out) == []
