"""``fimoe-lab inspect CKPT --html REPORT``: one self-contained page (inline CSS and SVG, nothing fetched),
holding every layer, the plans' numbers as ``inspect --json`` gives them and the lab's pictures; written
atomically, never over a file it did not write, and bad paths are one line with the files left as they were."""

from __future__ import annotations

import hashlib
import html
import json
import os
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from fimoe_lab.cli import main
from fimoe_lab.cli._common import EXIT_BAD_INPUT
from fimoe_lab.resources import sample_names, sample_path
from fimoe_lab.viz.report import REPORT_MARKER

ROOT = Path(__file__).resolve().parent.parent
URL_ATTRS = {"href", "src", "xlink:href", "action", "srcset", "poster", "data"}


class Page(HTMLParser):
    """What a browser would load or run from the page: tags, attributes that point somewhere, text, styles."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.links: list[str] = []
        self.xmlns: list[str] = []
        self.text: list[str] = []
        self.styles: list[str] = []
        self.open: list[str] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.tags.append(tag)
        self.open.append(tag)
        for name, value in attrs:
            if name in URL_ATTRS:
                self.links.append(value or "")
            elif name.startswith("xmlns"):
                self.xmlns.append(value or "")
            elif name == "style":
                self.styles.append(value or "")

    def handle_endtag(self, tag: str) -> None:
        if tag in self.open:
            while self.open.pop() != tag:
                pass

    def handle_data(self, data: str) -> None:
        if self.open and self.open[-1] == "style":
            self.styles.append(data)
        self.text.append(data)


def parse(path: Path) -> tuple[Page, str]:
    source = path.read_text(encoding="utf-8")
    page = Page()
    page.feed(source)
    page.close()
    return page, source


def run(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def check_self_contained(page: Page, source: str) -> None:
    """Nothing is fetched or run: no script, no external link, image or stylesheet; every reference is in-page
    (``#id``) or inline data."""
    assert not {"script", "link", "iframe", "img", "object", "embed", "base"} & set(page.tags)
    inline = [v for v in page.links if not v.startswith(("#", "data:image/png;base64,"))]
    assert not inline, inline[:3]  # in-page references and the SVG's own raster heatmaps only
    assert all(v.startswith("http://www.w3.org/") for v in page.xmlns)  # namespace names, never fetched
    styles = " ".join(page.styles).lower()
    assert "@import" not in styles and "url(" not in styles.replace("url(#", "")
    rest = source
    for v in page.xmlns:
        rest = rest.replace(f'"{v}"', '""')
    assert "http:" not in rest and "https:" not in rest and "ftp:" not in rest and "file:" not in rest


def check_numbers(doc: dict, text: str) -> None:
    """The page (its text, whitespace folded) holds every layer and the numbers of ``inspect --json``'s ``doc``."""
    for layer in doc["layers"]:
        assert f"{layer['layer']} {layer['name']}" in text  # the layers table row
        for t in layer["tensors"]:
            assert f"{t['name']} {t['dtype']} {t['shape']}" in text
        for tp in layer["tp"]:
            for need in tp["backends"].values():
                assert " ".join(need["text"].split()) in text
                if need["padded_intermediate"] is not None:  # the padding's cost, per expert and per layer
                    assert f"{need['pad_bytes'] * layer['experts']:,}" in text
                    for t in need["tensors"]:
                        assert " >> ".join(t["steps"]) in text
        for h in layer["health"]:
            if not h.startswith(("ok", "unquantized")):
                assert " ".join(h.split()) in text  # scale warnings are listed


def text_of(page: Page) -> str:
    return " ".join(" ".join(page.text).split())


@pytest.mark.parametrize("sample", sample_names())
def test_report_of_each_sample_has_every_layer_and_the_json_numbers(sample, tmp_path, capsys):
    from fimoe_lab.checkpoints import inspect_checkpoint
    from fimoe_lab.cli.checkpoints import add_tactics
    from fimoe_lab.viz.report import report_html

    code, printed, err = run(capsys, ["inspect", sample, "--tp", "1,2,3", "--json"])
    assert code == 0 and err == ""
    doc = json.loads(printed)
    out = tmp_path / "r.html"
    reports = inspect_checkpoint(sample_path(sample), tps=(1, 2, 3))
    add_tactics(reports)  # what the CLI adds: the TRT-LLM tactic counts
    out.write_text(report_html(sample_path(sample), reports, doc["engine"], (1, 2, 3), pictures=False))
    page, source = parse(out)
    check_self_contained(page, source)
    text = text_of(page)
    check_numbers(doc, text)
    warnings = text[text.index("Warnings") : text.index("Layers ")]
    for layer in doc["layers"]:
        for tp in layer["tp"]:
            if tp["cannot"]:  # a TP split that cuts a scale block or does not divide
                assert f"TP {tp['tp']} cannot shard: {' '.join(tp['cannot'].split())}" in warnings
            for backend, need in tp["backends"].items():
                for w in need["warnings"]:  # e.g. an intermediate size FlashInfer's MoE or its tactics do not take
                    assert f"TP {tp['tp']} {backend}: " in warnings and w in warnings
                if need["tactics"]:  # the counts per token count, in the plans table
                    assert " / ".join(str(c) for c in need["tactics"].values()) in text


def test_the_cli_report_has_the_lab_pictures_inline_and_works_in_light_and_dark(tmp_path, capsys):
    out = tmp_path / "report.html"
    argv = ["inspect", "deepseek-r1-nvfp4", "--tp", "1,2,8", "--html", str(out), "--json"]
    code, printed, err = run(capsys, argv)
    assert code == 0 and err == ""
    doc = json.loads(printed)
    assert doc["html"] == str(out)
    page, source = parse(out)
    check_self_contained(page, source)
    assert REPORT_MARKER in source[:4096] and "prefers-color-scheme: dark" in source
    assert page.tags.count("svg") >= 4 and "currentColor" in source  # theme-aware: text takes the page colour
    text = text_of(page)
    check_numbers(doc, text)
    for backend in ("trtllm", "cutlass"):  # each backend's padding masks and w13 row permutation
        assert f"padding of every tensor, {backend}, TP 2 (rank 0)" in text
        assert f"w13 rows: checkpoint row to kernel row, {backend}, TP 2 (rank 0)" in text
    ids = [part.split('"')[0] for part in source.split(' id="')[1:]]
    assert len(ids) == len(set(ids))  # several SVGs in one page: no id clash


def test_without_matplotlib_the_report_says_so_and_has_no_pictures(tmp_path):
    out = tmp_path / "r.html"
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"  # as in a build without the lab extra
        "from fimoe_lab.cli import main\n"
        f"raise SystemExit(main(['inspect', 'mixtral-bf16', '--tp', '1', '--html', {str(out)!r}]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    page, source = parse(out)
    check_self_contained(page, source)
    assert "svg" not in page.tags and "No pictures: drawing them needs matplotlib" in source
    assert "model.layers.0" in source  # the rest of the report is there


def digest(d: Path) -> dict[str, str]:
    """Every entry of ``d`` (hidden ones too) with its bytes' hash: what must not change."""
    return {
        p.name: (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() and not p.is_symlink() else "other")
        for p in sorted(d.iterdir())
    }


def _unwritable_dir(tmp_path: Path) -> Path | None:
    """A directory this process cannot create files in: a mode-0500 one, or (as root, who ignores modes) /sys."""
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    for cand in (d, Path("/sys/kernel")):
        try:
            fd = os.open(cand / ".probe", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            return cand
        os.close(fd)
        os.unlink(cand / ".probe")
    return None


def test_bad_report_paths_are_one_line_and_leave_every_file_as_it_was(tmp_path, capsys):
    mine = tmp_path / "mine.html"
    assert run(capsys, ["inspect", "deepseek-v3-fp8", "--tp", "4", "--html", str(mine)])[0] == 0  # no pictures: fast
    foreign = tmp_path / "notes.html"
    foreign.write_text("<html>the user's page</html>")
    (tmp_path / "link.html").symlink_to(mine)
    (tmp_path / "dir.html").mkdir()
    ro = _unwritable_dir(tmp_path)
    before = digest(tmp_path)
    cases = [
        ([str(mine)], "exists (fix: pass --force"),
        ([str(foreign), "--force"], "was not written by 'fimoe-lab inspect --html'"),
        ([str(tmp_path / "link.html"), "--force"], "is not a regular file"),
        ([str(tmp_path / "dir.html")], "is a directory"),
        ([str(tmp_path / "no" / "r.html")], "its directory"),
        ([str(sample_path("mixtral-bf16") / "r.html")], "is inside the input"),
    ]
    if ro is not None:
        cases.append(([str(ro / "r.html")], "Permission denied"))
    for extra, why in cases:
        code, out, err = run(capsys, ["inspect", "mixtral-bf16", "--html", *extra])
        assert code == EXIT_BAD_INPUT and out == "" and len(err.splitlines()) == 1, (extra, err)
        assert err.startswith("error: inspect: ") and why in err, err
        assert digest(tmp_path) == before
    # an unknown checkpoint: nothing is written
    code, out, err = run(capsys, ["inspect", str(tmp_path / "nope"), "--html", str(tmp_path / "new.html")])
    assert code == EXIT_BAD_INPUT and out == "" and len(err.splitlines()) == 1 and digest(tmp_path) == before
    assert "mixtral-bf16" not in {p.name for p in sample_path("mixtral-bf16").iterdir() if p.suffix == ".html"}
    if ro is not None and ro.parent == tmp_path:
        ro.chmod(0o700)


def test_force_replaces_a_report_it_wrote_and_nothing_else_is_left(tmp_path, capsys):
    out = tmp_path / "r.html"
    assert run(capsys, ["inspect", "deepseek-v3-fp8", "--tp", "4", "--html", str(out)])[0] == 0  # TP 4 cuts a block
    first = out.read_text()
    code, printed, err = run(capsys, ["inspect", "deepseek-v3-fp8", "--tp", "4,8", "--html", str(out), "--force"])
    assert code == 0 and err == "" and printed.rstrip().endswith(f"wrote {out}")
    second = out.read_text()
    assert second != first and "TP sizes checked</th><td>4, 8</td>" in second
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html"]  # no temporary, lock or probe left
    # the checkpoint as typed (a sample by its name), not where the package is installed
    assert "<code>deepseek-v3-fp8</code>" in second and html.escape(str(sample_path("deepseek-v3-fp8"))) not in second
