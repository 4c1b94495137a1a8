"""Every file fimoe-lab writes besides convert/restore goes through one writer
(:mod:`fimoe_lab.owned_files`): a temporary beside the target, fsynced and renamed; an existing target
refused without ``--force``; ``--force`` replaces only a file fimoe-lab wrote; a link at the target is
never followed or replaced.

Generated variants: every kind of file x every hazard at the target (a link to a file of the user's,
a dangling link, a file of the user's, a directory, a FIFO, a missing directory), through the API, and
through the commands that write them (``tune --csv/--json-out/--plot``, ``diagnose --figure``,
``inspect --html``).
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import pytest

from fimoe_lab.cli import main
from fimoe_lab.errors import FimoeError
from fimoe_lab.owned_files import KINDS, check_file_output, write_file_output


def _png() -> bytes:
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1, 1))
    ax.plot([0, 1], [1, 0])
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _data(kind: str) -> bytes:
    return {
        "html": b'<!doctype html><html><head><meta name="generator" content="fimoe-lab inspect --html"></head></html>',
        "png": _png(),
        "svg": b'<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg"></svg>',
        "csv": b"inter_align,hidden_align,x\r\n1,1,2\r\n",
        "json": b'{\n "generator": "fimoe-lab tune",\n "rows": []\n}',
    }[kind]


def digest(d: Path) -> dict[str, str]:
    """Every entry under ``d``: a file's sha256, a link's target, else its type."""
    got = {}
    for p in sorted(d.rglob("*")):
        key = str(p.relative_to(d))
        if p.is_symlink():
            got[key] = "-> " + os.readlink(p)
        elif p.is_file():
            got[key] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            got[key] = "dir" if p.is_dir() else "special"
    return got


def _link_to_users(t: Path, name: str) -> Path:
    (t / "users.txt").write_text("the user's")
    (t / name).symlink_to(t / "users.txt")
    return t / name


def _dangling(t: Path, name: str) -> Path:
    (t / name).symlink_to(t / "elsewhere")
    return t / name


def _users_file(t: Path, name: str) -> Path:
    (t / name).write_text("the user's")
    return t / name


def _directory(t: Path, name: str) -> Path:
    (t / name).mkdir()
    return t / name


def _fifo(t: Path, name: str) -> Path:
    os.mkfifo(t / name)
    return t / name


HAZARDS = {
    "link-to-users-file": (_link_to_users, True, "not a regular file"),
    "dangling-link": (_dangling, True, "not a regular file"),
    "users-file": (_users_file, False, "exists"),
    "users-file-force": (_users_file, True, "was not written by"),
    "directory": (_directory, True, "is a directory"),
    "fifo": (_fifo, True, "not a regular file"),
    "missing-directory": (lambda t, name: t / "no" / name, True, "does not exist"),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("hazard", sorted(HAZARDS))
def test_every_kind_refuses_every_hazard_and_changes_nothing(kind, hazard, tmp_path):
    make, force, why = HAZARDS[hazard]
    out = make(tmp_path, f"out.{kind}")
    before = digest(tmp_path)
    with pytest.raises(FimoeError, match=why):
        write_file_output(out, _data(kind), kind, force)
    assert digest(tmp_path) == before


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_force_replaces_only_what_fimoe_lab_wrote_and_leaves_nothing_beside(kind, tmp_path):
    out = tmp_path / f"out.{kind}"
    first = write_file_output(out, _data(kind), kind, False).read_bytes()
    assert KINDS[kind].mark in first[:4096]
    with pytest.raises(FimoeError, match="exists"):
        write_file_output(out, _data(kind) + b" ", kind, False)
    assert out.read_bytes() == first
    write_file_output(out, _data(kind) + b"\n", kind, True)  # its own: replaced
    assert out.read_bytes() != first and KINDS[kind].mark in out.read_bytes()[:4096]
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]  # no temporary or probe left
    assert (out.stat().st_mode & 0o777) == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    out = write_file_output(tmp_path / "t.csv", _data("csv"), "csv", False)
    before = out.read_bytes()

    def fail(*a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="No space"):
        write_file_output(out, _data("csv") + b"3,3,3\r\n", "csv", True)
    assert out.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["t.csv"]


TUNE = ["tune", "--hidden", "2048", "--intermediate", "768", "--experts", "128", "--top-k", "8"]
TUNE += ["--format", "bf16", "--tp", "8", "--gpu", "h200", "--source", "model"]


@pytest.mark.parametrize("flag,name", [("--csv", "t.csv"), ("--json-out", "t.json"), ("--plot", "p")])
def test_tune_outputs_refuse_links_and_foreign_files_before_any_work(flag, name, tmp_path, capsys):
    target = tmp_path / (name + "_heatmap.png" if flag == "--plot" else name)
    _link_to_users(tmp_path, target.name)
    before = digest(tmp_path)
    assert main([*TUNE, flag, str(tmp_path / name), "--force"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "not a regular file" in err, err
    assert digest(tmp_path) == before and (tmp_path / "users.txt").read_text() == "the user's"
    target.unlink()
    assert main([*TUNE, flag, str(tmp_path / name)]) == 0  # new: written
    capsys.readouterr()
    assert main([*TUNE, flag, str(tmp_path / name)]) == 2  # exists: refused without --force
    assert "exists (fix: pass --force" in capsys.readouterr().err
    assert main([*TUNE, flag, str(tmp_path / name), "--force"]) == 0  # its own: replaced


def test_diagnose_figure_never_follows_a_link(tmp_path, capsys):
    pytest.importorskip("torch")
    from safetensors.torch import save_file

    from fimoe_lab.checkpoints import open_checkpoint, sample_path
    from fimoe_lab.recipes import plan_layer

    ck = open_checkpoint(sample_path("deepseek-r1-nvfp4"))
    layer = ck.read_layer(ck.moe_layers[0])
    plan = plan_layer(layer.fmt, "trtllm", layer.intermediate, layer.hidden, layer.is_act_and_mul, layer.is_gated)
    dump = tmp_path / "dump.safetensors"
    save_file({"w13_weight_scale": plan.w13_scale.apply(layer.w13_scale).contiguous()}, str(dump))
    fig = _link_to_users(tmp_path, "diag.png")
    before = digest(tmp_path)
    argv = ["diagnose", "deepseek-r1-nvfp4", str(dump), "--experts", "0", "--figure", str(fig)]
    assert main([*argv, "--force"]) == 2
    assert "not a regular file" in capsys.readouterr().err
    assert digest(tmp_path) == before
    fig.unlink()
    assert main(argv) == 0 and fig.read_bytes()[:4] == b"\x89PNG"
    assert main([*argv, "--force"]) == 0  # its own figure: replaced


def test_check_file_output_refuses_a_target_inside_an_input(tmp_path):
    (tmp_path / "ck").mkdir()
    with pytest.raises(FimoeError, match="inside the input"):
        check_file_output(tmp_path / "ck" / "r.png", "png", False, [tmp_path / "ck"])
