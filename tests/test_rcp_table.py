"""The shipped rcp.approx.ftz.f32 table: its recorded checksum and counts, the packing, the script.

The decoded table is checked against the facts recorded when it was measured on an H200
(``fimoe_lab/data/README.md``); the packing against a bit-by-bit oracle written here; the
script's two re-encoding paths (a measurement file, the old base85 module) against the
shipped table, with measurements synthesised from an independent float64 reciprocal.
"""

from __future__ import annotations

import base64
import hashlib
import zlib

import numpy as np
import pytest
import torch

from fimoe_lab import resources
from fimoe_lab.errors import FormatError
from fimoe_lab.formats import codes
from scripts import make_rcp_table as script

TABLE_SHA256 = "862bea101da795bf5fd46df9dfe5142a79c29edd831e2da30aa84385d885e8fe"
PLUS, MINUS = 733_799, 374_723


@pytest.fixture(scope="module")
def shipped() -> torch.Tensor:
    """The decoded table as rcp_approx_ftz loads it."""
    return codes._rcp_delta(torch.device("cpu"))


def test_decoded_table_matches_the_recorded_measurement(shipped):
    assert shipped.dtype == torch.int8 and shipped.shape == (2**23,)
    assert set(shipped.unique().tolist()) == {-1, 0, 1}
    assert int((shipped == 1).sum()) == PLUS and int((shipped == -1).sum()) == MINUS
    assert hashlib.sha256(shipped.numpy().tobytes()).hexdigest() == TABLE_SHA256


def test_table_file_is_compact():
    assert resources.rcp_table_path().stat().st_size < 200_000


def oracle_pack(deltas: list[int]) -> bytes:
    """Packed bytes before zlib, one bit pair at a time: element 4j+k in bits 2k..2k+1."""
    code = {0: 0, 1: 1, -1: 2}
    return bytes(sum(code[deltas[4 * j + k]] << (2 * k) for k in range(4)) for j in range(len(deltas) // 4))


@pytest.mark.parametrize(
    "deltas",
    [
        [0, 1, -1, 0],  # one byte: 0b00_10_01_00
        [(i * 7 // 3) % 3 - 1 for i in range(4096)],  # structured: each value at every bit position
        torch.randint(-1, 2, (4096,), generator=torch.Generator().manual_seed(3)).tolist(),
    ],
)
def test_pack_matches_the_bit_oracle_and_unpacks_back(deltas):
    blob = codes.pack_rcp_deltas(torch.tensor(deltas, dtype=torch.int8))
    assert zlib.decompress(blob) == oracle_pack(deltas)
    assert codes.unpack_rcp_deltas(blob).tolist() == deltas


def test_first_byte_layout():
    assert zlib.decompress(codes.pack_rcp_deltas(torch.tensor([0, 1, -1, 0]))) == bytes([0b00100100])


@pytest.mark.parametrize("deltas, words", [([0, 2, 0, 0], "1 of them outside"), ([1, 0, -1], "multiple of 4")])
def test_pack_refuses_what_the_table_cannot_hold(deltas, words):
    with pytest.raises(FormatError, match=words):
        codes.pack_rcp_deltas(torch.tensor(deltas))


def test_unpack_refuses_the_unused_code():
    with pytest.raises(FormatError, match="code 3"):
        codes.unpack_rcp_deltas(zlib.compress(bytes([0b11000000])))


def rn_reciprocal_bits() -> np.ndarray:
    """Bits of the correctly rounded 1/m for every m in [1, 2), from torch's float32 division."""
    m = (torch.arange(2**23, dtype=torch.int32) | 0x3F800000).view(torch.float32)
    return (1.0 / m).view(torch.int32).numpy().astype(np.int64)


def test_script_rebuilds_the_table_from_a_measurement(shipped, tmp_path):
    hw = (rn_reciprocal_bits() + shipped.numpy()).astype("<u4")  # what the GPU wrote
    hw.tofile(tmp_path / "rcp.u32")
    assert script.main(["from-measured", str(tmp_path / "rcp.u32"), "--out", str(tmp_path / "t.bin")]) == 0
    assert torch.equal(codes.unpack_rcp_deltas((tmp_path / "t.bin").read_bytes()), shipped)


def test_script_refuses_a_result_two_ulps_off(shipped, tmp_path):
    hw = (rn_reciprocal_bits() + shipped.numpy()).astype("<u4")
    hw[12345] += 2
    with pytest.raises(FormatError, match="mantissa 12345"):
        script.deltas_from_measured(hw)
    with pytest.raises(FormatError, match="one uint32 per mantissa"):
        script.deltas_from_measured(hw[:-1])


def test_script_re_encodes_the_old_base85_module(shipped, tmp_path):
    text = base64.b85encode(resources.rcp_table_path().read_bytes()).decode()
    lines = "".join(f'    "{text[i : i + 100]}"\n' for i in range(0, len(text), 100))
    (tmp_path / "old.py").write_text(f'"""The old table module."""\n\nRCP_APPROX_DELTA_B85 = (\n{lines})\n')
    assert script.main(["from-b85", str(tmp_path / "old.py"), "--out", str(tmp_path / "t.bin")]) == 0
    assert torch.equal(codes.unpack_rcp_deltas((tmp_path / "t.bin").read_bytes()), shipped)
