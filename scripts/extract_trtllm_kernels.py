#!/usr/bin/env python
"""Extract the TRTLLM-Gen batched-GEMM kernel table that :mod:`fimoe_lab.tune.validity` reads.

FlashInfer's MoE op ``trtllm_get_valid_moe_configs`` chooses among the kernels listed in
the kernel set's ``flashinferMetaInfo.h`` (one ``BatchedGemmConfig`` per cubin: its
``BatchedGemmOptions`` and target SM).  This script parses that header and the enum
headers next to it (``Enums.h``, ``BatchedGemmEnums.h``, ``trtllm/gen/*Decl.h``,
``GemmGatedActOptions.h``) and writes the option fields the runner's filter and the
options check read, column-wise, with enum values turned into their names:

    fimoe_lab/data/tactics/kernels-fi<flashinfer version>-<kernel-set hash>.json.gz

The kernel list comes with the module build (``python -m fimoe_lab.tune.build`` fetches it
into ``~/.cache/fimoe_lab/trtllm_moe/flashinfer-<version>/kernel_list``)::

    python scripts/extract_trtllm_kernels.py                       # the cached kernel list
    python scripts/extract_trtllm_kernels.py --include DIR --flashinfer 0.6.13 \\
        --kernel-set batched_gemm-91e0ba0-896b90b@ffc4f52df6ff9010 --out x.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fimoe_lab.tune.validity import KERNEL_FIELDS, kernels_dir  # noqa: E402

# The headers whose ``enum class`` definitions name the option values of the table (the
# fields kept are validity.KERNEL_FIELDS; every other option of a kernel is left out).
_ENUM_HEADERS = (
    "Enums.h",
    "BatchedGemmEnums.h",
    "GemmGatedActOptions.h",
    "trtllm/gen/MmaDecl.h",
    "trtllm/gen/SfLayoutDecl.h",
    "trtllm/gen/SparsityDecl.h",
    "trtllm/gen/CudaArchDecl.h",
)


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def parse_enums(export_dir: Path) -> dict[str, dict[int, str]]:
    """{enum name: {value: member}} for every ``enum class`` in the export headers."""
    enums: dict[str, dict[int, str]] = {}
    for name in _ENUM_HEADERS:
        text = _strip_comments((export_dir / name).read_text())
        for m in re.finditer(r"enum\s+class\s+(\w+)\s*(?::\s*\w+)?\s*\{(.*?)\}", text, flags=re.S):
            members, nxt = {}, 0
            for item in m.group(2).split(","):
                item = item.strip()
                if not item:
                    continue
                if "=" in item:
                    key, val = (s.strip() for s in item.split("=", 1))
                    nxt = int(val, 0)
                else:
                    key = item
                members[nxt] = key
                nxt += 1
            enums[m.group(1)] = members
    dtypes: dict[int, str] = {}
    dtext = (export_dir / "trtllm/gen/DtypeDecl.h").read_text()
    pat = (
        r"(\w+)\s*=\s*TLLM_ENCODE_DTYPE\(/\*block\*/\s*(\d)u,\s*/\*signed\*/\s*(\d)u,\s*"
        r"/\*int\*/\s*(\d)u,\s*/\*bits\*/\s*(\d+)u,\s*/\*uid\*/\s*(\d+)u\)"
    )
    for m in re.finditer(pat, dtext):
        blk, sgn, integer, bits, uid = (int(x) for x in m.groups()[1:])
        dtypes[(blk << 24) | (sgn << 20) | (integer << 16) | (bits << 8) | uid] = m.group(1)
    if not dtypes:
        raise SystemExit(f"error: no Dtype encodings found in {export_dir / 'trtllm/gen/DtypeDecl.h'}")
    enums["Dtype"] = dtypes
    return enums


_VALUE = re.compile(r"^(?:[\w:]*::)?(\w+)\((-?\d+)\)$")


def _value(raw: str, enums: dict[str, dict[int, str]]):
    raw = raw.strip()
    if raw.startswith("{") and raw.endswith("}"):
        inner = raw[1:-1].strip()
        return None if not inner else _value(inner, enums)
    m = _VALUE.match(raw)
    if m:
        kind, val = m.group(1), int(m.group(2))
        if kind not in enums or val not in enums[kind]:
            raise SystemExit(f"error: unknown {kind} value {val} in the kernel table")
        return enums[kind][val]
    return int(raw)


def parse_configs(meta_info: Path, enums: dict[str, dict[int, str]]) -> list[dict]:
    """One dict per ``BatchedGemmConfig`` of the table, in table order (the config index)."""
    text = meta_info.read_text()
    start = text.index("tllmGenBatchedGemmList[] = {")
    body = text[start:]
    entries = re.split(r"\n\{nullptr, ", body)[1:]
    configs = []
    for e in entries:
        name = re.match(r'\s*\d+,\s*\d+,\s*"([^"]+)"', e)
        sm = re.search(r"\}\s*,\s*gemm::SmVersion::(\w+)\}", e)
        if not name or not sm:
            raise SystemExit(f"error: cannot parse a kernel entry of {meta_info}: {e[:120]!r}")
        fields = dict(re.findall(r"/\* (m\w+) \*/ ([^\n]*?)\s*(?=\n|$)", e))
        cfg = {"name": name.group(1), "sm": sm.group(1)}
        for key in KERNEL_FIELDS:
            if key in ("name", "sm"):
                continue
            if key not in fields:
                raise SystemExit(f"error: kernel {cfg['name']} has no field {key}")
            cfg[key] = _value(fields[key], enums)
        configs.append(cfg)
    n = re.search(r"tllmGenBatchedGemmListLen\s*=\s*(\d+)", text)
    if n and int(n.group(1)) != len(configs):
        raise SystemExit(f"error: parsed {len(configs)} kernels, the header declares {n.group(1)}")
    return configs


def default_include() -> Path:
    """The include/ folder of the kernel list cached by the module build."""
    from fimoe_lab.tune import build

    root = build._version_dir(build._dist_version("flashinfer-python") or "") / "kernel_list"
    hits = sorted(root.glob("*/batched_gemm-*/include"))
    if not hits:
        raise SystemExit(f"error: no kernel list under {root} (fix: run `python -m fimoe_lab.tune.build` first)")
    return hits[-1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--include", help="the kernel list's include/ folder (default: the cached one)")
    ap.add_argument("--flashinfer", help="FlashInfer version (default: the installed one)")
    ap.add_argument("--kernel-set", help="kernel-set id (default: the built module's manifest)")
    ap.add_argument("--out", help="output file (default: fimoe_lab/data/tactics/kernels-fi<ver>-<hash>.json.gz)")
    a = ap.parse_args(argv)
    from fimoe_lab.tune import build

    inc = Path(a.include) if a.include else default_include()
    fi = a.flashinfer or build._dist_version("flashinfer-python")
    kset = a.kernel_set
    if not kset:
        man = build.find_module()
        kset = man.kernel_set if man else build.kernel_set_id()
    export = inc / "trtllmGen_bmm_export"
    enums = parse_enums(export)
    configs = parse_configs(inc / "flashinferMetaInfo.h", enums)
    columns = {k: [c[k] for c in configs] for k in KERNEL_FIELDS}
    khash = kset.split("@")[-1][:12]
    out = Path(a.out) if a.out else kernels_dir() / f"kernels-fi{fi}-{khash}.json.gz"
    meta = {
        "flashinfer": fi,
        "kernel_set": kset,
        "kernels": len(configs),
        "source": "flashinferMetaInfo.h of the kernel set (scripts/extract_trtllm_kernels.py)",
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    # mtime 0: the same kernel set gives the same bytes.
    blob = json.dumps({"meta": meta, "columns": columns}, separators=(",", ":")).encode()
    with open(out, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", compresslevel=9, mtime=0) as f:
        f.write(blob)
    print(f"wrote {out} ({out.stat().st_size / 1e3:.0f} kB): {len(configs)} kernels of {kset}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
