"""``fimoe-lab inspect --html REPORT.html``: one self-contained HTML page about a checkpoint.

Rendering only: :func:`fimoe_lab.checkpoints.inspect.inspect_checkpoint` produces the data
(:class:`~fimoe_lab.checkpoints.inspect.LayerReport` per layer, a
:class:`~fimoe_lab.checkpoints.inspect.BackendNeed` per TP size and backend); this module
lays it out. The page holds the checkpoint summary, a table of the layers, the plan's step
chain per backend with its paddings and their cost in bytes (for the engine profile asked
for), the warnings, and the layout pictures the lab draws (:func:`fimoe_lab.viz.figures.padding_figure`
and :func:`~fimoe_lab.viz.figures.row_permutation_figure`, as inline SVG through
:func:`~fimoe_lab.viz.figures.to_svg`). Inline CSS and SVG only: no script, no network, no
file beside it; light and dark through ``prefers-color-scheme``. Without matplotlib (the
``lab`` extra) the page says so and has no pictures.

Output rules (:mod:`fimoe_lab.owned_files`): :func:`check_report_output` runs before
the checkpoint is read; :func:`write_report` writes a temporary beside OUT and renames it; an
existing OUT is replaced only with ``force`` and only when it is a report this module wrote
(:data:`REPORT_MARKER` in its head).
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from fimoe_lab import owned_files

__all__ = ["REPORT_MARKER", "check_report_output", "write_report", "report_html", "layer_groups"]

REPORT_MARKER = owned_files.KINDS["html"].mark.decode()
"""In the head of every report: what lets ``--force`` replace one (and only one of these)."""
PADDING_PICTURE_MAX_BYTES = 1 << 22
"""The padding masks are drawn only for plans whose largest map outputs at most this per expert (a
DeepSeek-size layer's masks take 9-17 s and ~1 GB; the lab's PaddingExplorer draws them); the row
permutation, reduced at real size, is always drawn."""

CSS = """
:root { color-scheme: light dark; --bg: #ffffff; --fg: #1c1e21; --muted: #5b6068; --line: #d3d7dd;
  --head: #f0f2f5; --warn: #7a4f00; --warnbg: #fff3d1; --bad: #9b1020; --badbg: #fde7ea; --good: #17693a; }
@media (prefers-color-scheme: dark) {
  :root { --bg: #15171a; --fg: #e4e6e9; --muted: #a0a6ae; --line: #3a3f46; --head: #22262b;
    --warn: #ffd27a; --warnbg: #3a2e10; --bad: #ff9aa5; --badbg: #3d161b; --good: #7fd69c; }
}
body { background: var(--bg); color: var(--fg); font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif;
  max-width: 1280px; margin: 1.5em auto; padding: 0 1em; }
h1 { font-size: 1.45em; margin-bottom: 0.2em; } h2 { font-size: 1.2em; margin-top: 1.6em; }
h3 { font-size: 1.05em; margin-top: 1.2em; }
code, .mono { font-family: ui-monospace, "SFMono-Regular", Menlo, Consolas, monospace; font-size: 0.92em; }
table { border-collapse: collapse; margin: 0.5em 0 1em; }
th, td { border: 1px solid var(--line); padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: var(--head); }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.muted { color: var(--muted); } .good { color: var(--good); }
.warn { color: var(--warn); background: var(--warnbg); } .bad { color: var(--bad); background: var(--badbg); }
ul.warnings li { margin: 2px 0; padding: 2px 6px; border-radius: 3px; list-style: none; }
details { margin: 0.2em 0; } summary { cursor: pointer; }
figure { margin: 0.8em 0; overflow-x: auto; } figcaption { color: var(--muted); font-size: 0.92em; }
"""


# ----------------------------------------------------------------------------- the output
def check_report_output(out: Path, inputs: Sequence[Path], force: bool) -> None:
    """Refuse a report path that could destroy data, before anything is read
    (:func:`fimoe_lab.owned_files.check_file_output`)."""
    owned_files.check_file_output(out, "html", force, inputs)


def write_report(out: Path, text: str, force: bool) -> None:
    """Write ``text`` at ``out`` through a temporary that is renamed when complete (nothing partial is left;
    :func:`fimoe_lab.owned_files.write_file_output`)."""
    owned_files.write_file_output(out, text.encode(), "html", force)


# ----------------------------------------------------------------------------- grouping
def _ranges(numbers: Sequence[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"``."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and runs[-1][1] == n - 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def layer_groups(reports: Sequence[Any]) -> list[list[Any]]:
    """Layers whose plans are the same (format, sizes and every backend record at every TP) in one group, in order."""
    groups: dict[str, list[Any]] = {}
    for r in reports:
        doc = r.to_json()
        key = repr((doc["format"], doc["experts"], doc["hidden"], doc["intermediate"], doc["tp"]))
        groups.setdefault(key, []).append(r)
    return list(groups.values())


def _layers_label(group: Sequence[Any]) -> str:
    layers = [r.layer for r in group]
    return f"layer{'s' * (len(layers) > 1)} {_ranges(layers)}"


# ----------------------------------------------------------------------------- sections
def _e(value: object) -> str:
    return html.escape(str(value))


def _table(head: Sequence[str], rows: Sequence[Sequence[str]], nums: Sequence[int] = ()) -> str:
    """An HTML table; cells are HTML already (escape them); columns ``nums`` are right-aligned."""
    th = "".join(f"<th>{h}</th>" for h in head)
    body = "".join(
        "<tr>" + "".join(f"<td{' class=num' if k in nums else ''}>{c}</td>" for k, c in enumerate(row)) + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _summary(path: Path, reports: Sequence[Any], engine: str, tps: Sequence[int], per_token: bool) -> str:
    first = reports[0] if reports else None
    facts = [("checkpoint", f"<code>{_e(path)}</code>"), ("engine profile", _e(engine))]
    if per_token:
        facts.append(("activations", "NVFP4 quantised per token (the profile's per-token paddings)"))
    if first is not None:
        mtp = [r.layer for r in reports if r.mtp]
        facts += [
            ("naming convention", f"{_e(first.convention)} <span class=muted>({_e(first.models)})</span>"),
            ("format", _e(first.fmt)),
            ("MoE layers", f"{len(reports)} ({_ranges([r.layer for r in reports])})"),
            ("MTP layers", _ranges(mtp) if mtp else "none"),
            ("experts, top-k", f"{first.num_experts}, {first.top_k if first.top_k else '?'}"),
            ("hidden", str(first.hidden)),
            ("intermediate", ", ".join(sorted({str(r.intermediate) for r in reports}, key=int))),
            ("gate/up order", f"{_e(first.gate_up_order)} <span class=muted>(FlashInfer wants [up; gate])</span>"),
        ]
    facts.append(("TP sizes checked", ", ".join(map(str, tps))))
    rows = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in facts)
    return f"<h2>Checkpoint</h2><table>{rows}</table>"


def _layer_rows(reports: Sequence[Any]) -> str:
    rows = []
    for r in reports:
        tensors = "<br>".join(
            f"<code>{_e(n)} {_e(dt)} {_e(list(shape))}</code>" for n, (dt, shape) in r.tensors.items()
        )
        bad = [h for h in r.health if not h.startswith(("ok", "unquantized"))]
        health = (
            f"<span class=warn>{len(bad)} warning{'s' * (len(bad) > 1)}</span>"
            if bad
            else f"<span class=good>{_e(r.health[0])}</span>"
        )
        rows.append(
            [
                str(r.layer),
                _e(r.name) + (" <b>MTP</b>" if r.mtp else ""),
                _e(r.fmt),
                str(r.num_experts),
                str(r.top_k or "?"),
                str(r.hidden),
                str(r.intermediate),
                tensors,
                health,
            ]
        )
    head = ["layer", "name", "format", "experts", "top-k", "hidden", "intermediate", "tensors (dtype, shape)", "scales"]
    return "<h2>Layers</h2>" + _table(head, rows, nums=(0, 3, 4, 5, 6))


def _need_cells(tp: int, backend: str, need: Any, experts: int) -> list[str]:
    status = {"ok": "warn" if need.warnings else "good", "aligned": "warn"}.get(need.status, "bad")
    cells = [str(tp), _e(backend), f"<span class={status}>{_e(need.text())}</span>"]
    if need.padded_intermediate is None:
        return cells + [""] * 7
    tactics = "" if need.tactics is None else " / ".join("?" if c is None else str(c) for c in need.tactics.values())
    return cells + [
        f"{need.intermediate} &rarr; {need.padded_intermediate}",
        f"{need.hidden} &rarr; {need.padded_hidden}",
        f"{need.checkpoint_bytes:,}",
        f"{need.kernel_bytes:,}",
        f"{need.pad_bytes:,} ({100 * need.pad_bytes / max(need.checkpoint_bytes, 1):.2f}%)",
        f"{need.pad_bytes * experts:,}",
        f"<span class=bad>{tactics}</span>" if 0 in (need.tactics or {}).values() else tactics,
    ]


def _steps_table(need: Any) -> str:
    rows = [
        [
            _e(t["name"]),
            _e(t["in_shape"]),
            _e(t["out_shape"]),
            f"{t['pad_bytes']:,}",
            "<code>" + (" &gt;&gt; ".join(_e(s) for s in t["steps"]) or "unchanged") + "</code>",
        ]
        for t in need.tensors
    ]
    return _table(["tensor", "checkpoint (bytes)", "kernel (bytes)", "pad bytes", "steps"], rows, nums=(3,))


def _plans(reports: Sequence[Any], engine: str) -> str:
    out = [f"<h2>Plans ({_e(engine)})</h2>"]
    out.append(
        "<p class=muted>Per TP size, rank 0's slice: what each backend needs under the engine profile, the padded "
        "sizes, bytes per expert (w13, w2 and their scales) and the padding's cost for the layer's experts.</p>"
    )
    head = ["TP", "backend", "needs", "I", "H", "checkpoint B/expert", "kernel B/expert", "pad B/expert", "pad B/layer"]
    for group in layer_groups(reports):
        r = group[0]
        tokens = next((n.tactics for needs in r.plans.values() for n in needs.values() if n.tactics), None)
        head = head[:9] + ([f"TRT-LLM tactics at {' / '.join(tokens)} tokens"] if tokens else [""])
        out.append(f"<h3>{_e(_layers_label(group))}: {_e(r.fmt)}, intermediate {r.intermediate}</h3>")
        rows = []
        for tp, row in r.tp.items():
            if tp not in r.plans:
                rows.append([str(tp), "", f"<span class=bad>{_e(row['shard'])}</span>", *[""] * 7])
                continue
            rows += [_need_cells(tp, b, need, r.num_experts) for b, need in r.plans[tp].items()]
        out.append(_table(head, rows, nums=(0, 3, 4, 5, 6, 7, 8, 9)))
        for tp, needs in r.plans.items():
            for backend, need in needs.items():
                if need.tensors:
                    out.append(
                        f"<details><summary>TP {tp}, {_e(backend)}: step chains</summary>{_steps_table(need)}</details>"
                    )
    return "".join(out)


def _warnings(reports: Sequence[Any]) -> list[tuple[str, str]]:
    """``(css class, text)`` of every warning: scale health, shards that cannot be cut, backends that fail or
    need another alignment, tactic warnings."""
    found: list[tuple[str, str]] = []
    for group in layer_groups(reports):
        r, label = group[0], _layers_label(group)
        for tp, shard in r.shards.items():
            if shard.get("cannot"):
                found.append(("bad", f"{label}: TP {tp} cannot shard: {shard['cannot']}"))
        for tp, needs in r.plans.items():
            for backend, need in needs.items():
                if need.status != "ok":
                    found.append(
                        ("bad" if need.status != "aligned" else "warn", f"{label}: TP {tp} {backend}: {need.text()}")
                    )
                elif need.warnings:
                    found.append(("warn", f"{label}: TP {tp} {backend}: {'; '.join(need.warnings)}"))
    for r in reports:
        found += [("warn", f"layer {r.layer} scales: {h}") for h in r.health if not h.startswith(("ok", "unquantized"))]
    return found


def _warnings_section(reports: Sequence[Any]) -> str:
    found = _warnings(reports)
    if not found:
        return "<h2>Warnings</h2><p class=good>none: every layer shards and lays out at every TP size checked.</p>"
    items = "".join(f"<li class={cls}>{_e(text)}</li>" for cls, text in found)
    return f"<h2>Warnings ({len(found)})</h2><ul class=warnings>{items}</ul>"


# ----------------------------------------------------------------------------- pictures
def _inline_svg(svg: str, prefix: str) -> str:
    """``svg`` ready to sit beside others in one page: metadata dropped, every id prefixed (``prefix``) and
    unique (references keep pointing at the first element of a name, as a browser resolves them)."""
    svg = re.sub(r"<metadata>.*?</metadata>", "", svg, flags=re.S)
    seen: dict[str, int] = {}

    def unique(m: re.Match[str]) -> str:  # matplotlib names equal images alike: later copies get a suffix
        n = seen[m.group(1)] = seen.get(m.group(1), 0) + 1
        return f'id="{prefix}{m.group(1)}{"" if n == 1 else f"-{n}"}"'

    svg = re.sub(r'\bid="([^"]+)"', unique, svg)
    svg = re.sub(r'(href)="#([^"]+)"', lambda m: f'{m.group(1)}="#{prefix}{m.group(2)}"', svg)
    return re.sub(r"url\(#([^)]+)\)", lambda m: f"url(#{prefix}{m.group(1)})", svg)


def _layer_pictures(r: Any, backend: str, need: Any, tp: int, figures: Any, data: Any) -> list[tuple[str, Any]]:
    """``(caption, figure or None)`` of one plan: the padding masks (None: nothing padded, or too large to draw
    here; the caption says which) and, when w13's rows move, its row permutation."""
    from fimoe_lab.checkpoints.plan_choice import build_plan

    plan = build_plan(need.plan)
    maps = plan.maps()
    if not maps:
        return []
    label = f"{backend}, TP {tp} (rank 0)"
    largest = max(m.out_bytes for m in maps.values())
    out: list[tuple[str, Any]] = []
    if need.pad_bytes == 0:
        out.append((f"nothing padded in {label}: no padding masks to draw", None))
    elif largest > PADDING_PICTURE_MAX_BYTES:
        note = f"padding masks of {label} not drawn: {largest / 2**20:.1f} MiB per expert (the lab's PaddingExplorer)"
        out.append((note, None))
    else:
        tensors = {n: data.TensorPadding(n, m, data.itemsize_of(r.fmt, n)) for n, m in maps.items()}
        report = data.PaddingReport(
            r.fmt, backend, tp, r.intermediate, need.intermediate, r.hidden, plan, r.num_experts, tensors
        )
        out.append((f"padding of every tensor, {label}", figures.padding_figure(report)))
    if plan.w13 is not None and any(s.kind != "pad_projections" for s in plan.w13.steps):
        fig = figures.row_permutation_figure(plan.w13, itemsize=data.itemsize_of(r.fmt, "w13"))
        out.append((f"w13 rows: checkpoint row to kernel row, {label}", fig))
    return out


def _pictures(reports: Sequence[Any]) -> str:
    try:
        from fimoe_lab.viz import data, figures
    except ImportError as exc:
        return (
            "<h2>Layout pictures</h2><p class=warn>No pictures: drawing them needs matplotlib (the lab extra: pip "
            f"install 'fimoe_lab[lab]'), which is not installed ({_e(exc)}).</p>"
        )
    out, k = ["<h2>Layout pictures</h2>"], 0
    for group in layer_groups(reports):
        r = group[0]
        for backend in dict.fromkeys(b for needs in r.plans.values() for b in needs):
            drawn = [(tp, needs[backend]) for tp, needs in r.plans.items() if needs[backend].plan is not None]
            if not drawn:
                continue
            # the TP size whose plan pads the most (relative): the one with the most to show
            tp, need = max(drawn, key=lambda d: d[1].pad_bytes / max(d[1].checkpoint_bytes, 1))
            for caption, fig in _layer_pictures(r, backend, need, tp, figures, data):
                if fig is None:
                    out.append(f"<p class=muted>{_e(_layers_label(group))}: {_e(caption)}</p>")
                    continue
                k += 1
                svg = _inline_svg(figures.to_svg(fig), f"f{k}-")
                out.append(f"<figure>{svg}<figcaption>{_e(_layers_label(group))}: {_e(caption)}</figcaption></figure>")
    if k == 0:
        out.append("<p class=muted>No plan to draw (no backend lays these layers out, or they are too large).</p>")
    return "".join(out)


def report_html(
    path: Path,
    reports: Sequence[Any],
    engine: str,
    tps: Sequence[int],
    pictures: Optional[bool] = True,
    per_token: bool = False,
) -> str:
    """The whole report page for ``reports`` (:func:`~fimoe_lab.checkpoints.inspect.inspect_checkpoint` of
    ``path`` at TP sizes ``tps`` under profile ``engine``, ``per_token`` NVFP4 activations); ``pictures`` False
    leaves the pictures out. ``path`` is only shown: pass it as the user gave it (a sample by its name)."""
    body = [
        f"<h1>fimoe-lab inspect: {_e(Path(path).name)}</h1>",
        _summary(Path(path), reports, engine, tps, per_token),
        _warnings_section(reports),
        _layer_rows(reports),
        _plans(reports, engine),
        _pictures(reports) if pictures else "",
    ]
    return (
        f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n{REPORT_MARKER}\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        '<meta name="color-scheme" content="light dark">\n'
        f"<title>fimoe-lab inspect: {_e(Path(path).name)}</title>\n<style>{CSS}</style>\n</head>\n"
        f"<body>\n{''.join(body)}\n</body>\n</html>\n"
    )
