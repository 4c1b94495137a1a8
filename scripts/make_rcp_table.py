"""Measure ``rcp.approx.ftz.f32`` on a GPU and (re)write the package's correction table.

The table (``fimoe_lab/data/rcp_approx_delta.bin``, provenance in ``fimoe_lab/data/README.md``)
holds, for every float32 mantissa ``k`` in 0..2**23-1, i.e. every ``m = 1 + k * 2**-23`` in
[1, 2), the int8 correction ``delta[k] = bits(rcp.approx.ftz.f32(m)) - bits(RN(1/m))`` in
ulps, where RN is IEEE round-to-nearest-even; each is -1, 0 or +1. The packing is
:func:`fimoe_lab.formats.codes.pack_rcp_deltas` (2-bit codes, 4 per byte, zlib).

How the measurement is taken (``measure``, needs CUDA and Triton): one Triton kernel
builds each ``m`` from its bits (``k | 0x3F800000``), runs the PTX instruction
``rcp.approx.ftz.f32`` on it through inline assembly, and stores the result's bits:
a *measurement file* of 2**23 little-endian uint32, 32 MiB. Everything after that runs
on the CPU: ``from-measured`` subtracts the bits of the correctly rounded ``1/m``
(float64 division rounded once to float32, exact here: 1/m is never within 2**-49
relative of a float32 rounding midpoint), refuses any difference outside {-1, 0, +1}
and packs the table. ``from-b85`` re-encodes the table from its earlier form, the
base85 text of the same zlib bytes in the module ``fimoe_lab/formats/_rcp_approx_table.py``
(``git show 8b1a971:fimoe_lab/formats/_rcp_approx_table.py > old.py``).

    python scripts/make_rcp_table.py measure rcp.u32            # on the GPU to characterise
    python scripts/make_rcp_table.py from-measured rcp.u32      # anywhere: writes the table
    python scripts/make_rcp_table.py from-b85 old.py            # anywhere: writes the table

Each writing command prints the decoded table's SHA-256 and its +1/-1 counts (compare
with ``fimoe_lab/data/README.md``); ``--out`` writes elsewhere than the package.
"""

from __future__ import annotations

import argparse
import ast
import base64
import hashlib
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from fimoe_lab import resources  # noqa: E402
from fimoe_lab.errors import FormatError  # noqa: E402
from fimoe_lab.formats.codes import pack_rcp_deltas, unpack_rcp_deltas  # noqa: E402

MANTISSAS = 2**23
B85_NAME = "RCP_APPROX_DELTA_B85"


def mantissa_inputs() -> np.ndarray:
    """float32 ``(2**23,)``: every float32 in [1, 2), in mantissa order."""
    return (np.arange(MANTISSAS, dtype=np.uint32) | np.uint32(0x3F800000)).view(np.float32)


def correctly_rounded_rcp_bits() -> np.ndarray:
    """int64 ``(2**23,)``: bits of RN(1/m) for each m of :func:`mantissa_inputs`."""
    m = mantissa_inputs().astype(np.float64)
    return (1.0 / m).astype(np.float32).view(np.uint32).astype(np.int64)


def deltas_from_measured(hw_bits: np.ndarray) -> torch.Tensor:
    """uint32 ``(2**23,)`` hardware results -> int8 ``(2**23,)`` corrections in ulps."""
    if hw_bits.shape != (MANTISSAS,):
        raise FormatError(
            f"measurement holds {hw_bits.size} results; it needs one uint32 per mantissa, {MANTISSAS}",
            fix="write it with `make_rcp_table.py measure`",
        )
    delta = hw_bits.astype(np.int64) - correctly_rounded_rcp_bits()
    far = np.flatnonzero(np.abs(delta) > 1)
    if far.size:
        raise FormatError(
            f"{far.size} measured results are more than 1 ulp from 1/m (first at mantissa {far[0]}: "
            f"{int(delta[far[0]]):+d} ulps); the table stores -1, 0 or +1",
            fix="check that the file holds rcp.approx.ftz.f32 of 1 + k * 2**-23 for k in order",
        )
    return torch.from_numpy(delta.astype(np.int8))


def blob_from_b85_module(path: Path) -> bytes:
    """The zlib bytes stored as base85 text in ``RCP_APPROX_DELTA_B85`` of an old table module."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == B85_NAME for t in node.targets):
            return base64.b85decode(ast.literal_eval(node.value))
    raise FormatError(f"{path} assigns no {B85_NAME}", fix="pass the old fimoe_lab/formats/_rcp_approx_table.py")


def measure_on_gpu() -> np.ndarray:
    """uint32 ``(2**23,)``: ``rcp.approx.ftz.f32`` of every m in [1, 2), run on the current CUDA device."""
    import triton
    import triton.language as tl

    @triton.jit
    def rcp_kernel(out_ptr, BLOCK: tl.constexpr):
        k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = (k | 0x3F800000).to(tl.float32, bitcast=True)
        r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [m], dtype=tl.float32, is_pure=True, pack=1)
        tl.store(out_ptr + k, r.to(tl.int32, bitcast=True))

    out = torch.empty(MANTISSAS, dtype=torch.int32, device="cuda")
    rcp_kernel[(MANTISSAS // 1024,)](out, BLOCK=1024)
    return out.cpu().numpy().view(np.uint32)


def write_table(deltas: torch.Tensor, out: Path) -> None:
    """Pack ``deltas``, check the bytes decode back to them, write ``out``, print the summary."""
    blob = pack_rcp_deltas(deltas)
    if not torch.equal(unpack_rcp_deltas(blob), deltas):
        raise AssertionError("the packed table does not decode to the deltas it was packed from")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(blob)
    print(
        f"{out}: {len(blob):,} bytes; {deltas.numel():,} deltas, {int((deltas == 1).sum()):,} of +1, "
        f"{int((deltas == -1).sum()):,} of -1; sha256 {hashlib.sha256(deltas.numpy().tobytes()).hexdigest()}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    writes = argparse.ArgumentParser(add_help=False)
    writes.add_argument(
        "--out", type=Path, default=resources.rcp_table_path(), help="table file (default: the package's)"
    )
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("measure", help="run rcp.approx.ftz.f32 on the GPU; write the uint32 results").add_argument("file")
    sub.add_parser("from-measured", parents=[writes], help="table from a measurement file").add_argument("file")
    sub.add_parser("from-b85", parents=[writes], help="table from the old base85 module").add_argument("file")
    a = ap.parse_args(argv)
    if a.command == "measure":
        measure_on_gpu().tofile(a.file)
        print(f"{a.file}: {MANTISSAS:,} results on {torch.cuda.get_device_name()}")
    elif a.command == "from-measured":
        write_table(deltas_from_measured(np.fromfile(a.file, dtype="<u4")), a.out)
    else:
        write_table(unpack_rcp_deltas(blob_from_b85_module(Path(a.file))), a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
