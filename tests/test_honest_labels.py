"""Labels that say what is there: inspect counts every padded byte (the scales' 128x4 atoms included) in text,
JSON and HTML, draws padding pictures only where something is padded, and shows the checkpoint as typed."""

from __future__ import annotations

import json

import pytest

from fimoe_lab.cli import main
from fimoe_lab.resources import sample_path


def ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


def cutlass_fp4_scale_pad(inter: int, hidden: int, block: int) -> int:
    """Bytes the CUTLASS FP4 128x4 scale layout adds per expert (1-byte scales): w13 scales (2I, H/block) and w2
    scales (H, I/block), each padded to 128 rows and 4 columns."""
    shapes = [(2 * inter, hidden // block), (hidden, inter // block)]
    return sum(ceil_to(r, 128) * ceil_to(c, 4) - r * c for r, c in shapes)


def inspect_json(capsys, *argv: str) -> dict:
    assert main(["inspect", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_scale_atom_padding_is_counted_and_named(capsys, tp):
    """DeepSeek-R1 NVFP4 on CUTLASS: the sizes need no padding, its 128x4 scale atoms may; the line says how many
    bytes, the same number as the JSON and as the atoms' own arithmetic, and "no padding" only for zero."""
    doc = inspect_json(capsys, "deepseek-r1-nvfp4", "--tp", str(tp))
    (row,) = [r for r in doc["layers"][0]["tp"] if r["tp"] == tp]
    need = row["backends"]["cutlass"]
    inter, hidden = need["intermediate"], need["hidden"]
    assert (need["padded_intermediate"], need["padded_hidden"]) == (inter, hidden)  # no size is padded
    want = cutlass_fp4_scale_pad(inter, hidden, 16)
    assert need["pad_bytes"] == want == sum(t["pad_bytes"] for t in need["tensors"])
    if want:
        assert "no padding" not in need["text"] and f"+{want:,} B/expert" in need["text"]
        assert "w13_scale" in need["text"] or "w2_scale" in need["text"]
    else:
        assert need["text"].startswith("no padding")
    assert main(["inspect", "deepseek-r1-nvfp4", "--tp", str(tp)]) == 0
    assert need["text"] in capsys.readouterr().out


def test_the_html_draws_padding_only_where_bytes_are_padded_and_names_the_checkpoint_as_typed(tmp_path, capsys):
    out = tmp_path / "r.html"
    assert main(["inspect", "mixtral-bf16", "--tp", "1", "--html", str(out)]) == 0
    capsys.readouterr()
    page = out.read_text()
    doc = inspect_json(capsys, "mixtral-bf16", "--tp", "1")
    (row,) = doc["layers"][0]["tp"]
    padded = {b: n["pad_bytes"] for b, n in row["backends"].items()}
    assert sorted(padded) == ["cutlass", "trtllm"] and any(padded.values()) and not all(padded.values())
    for backend, pad in padded.items():
        drawn = f"padding of every tensor, {backend}, TP 1" in page
        assert drawn == (pad > 0), (backend, pad)
        if not pad:
            assert f"nothing padded in {backend}, TP 1" in page
    assert str(sample_path("mixtral-bf16")) not in page and "<code>mixtral-bf16</code>" in page
    assert main(["inspect", "mixtral-bf16", "--tp", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "mixtral-bf16"


def test_paths_are_shown_as_typed_in_reasons_too(tmp_path, capsys):
    """A reason that names the checkpoint's config.json (a TP size that cuts a scale block) names it from what the
    user typed, in the text and the HTML report; a directory typed as a path stays that path."""
    where = str(sample_path("deepseek-v3-fp8"))
    assert main(["inspect", "deepseek-v3-fp8", "--tp", "1,4", "--html", str(tmp_path / "r.html")]) == 0
    out = capsys.readouterr().out
    assert "deepseek-v3-fp8/config.json: moe_intermediate_size" in out and where not in out
    page = (tmp_path / "r.html").read_text()
    assert "deepseek-v3-fp8/config.json: moe_intermediate_size" in page and where not in page
    assert main(["inspect", where, "--tp", "4"]) == 0
    assert f"{where}/config.json: moe_intermediate_size" in capsys.readouterr().out
