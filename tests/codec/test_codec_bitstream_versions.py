"""Containers of the older formats decode unchanged, and the current writer's content is
the older writer's, byte for byte (codec/bitstream.py, docs/bitstream.md 4.1 "Versions").

Format version 6 changed only the container's trailer (an xxh3-64 in place of the
CRC32). Two checks that this is all that changed:
- tests/fixtures/codec_v4: containers written by the version-4 writer (every codec kind,
  one version-5 KIVI chunk), each decoded by the current decoder to the values the
  version-4 decoder gave (``decoded.json``), and the current writer's container of the
  same KV equals it after ``bitstream.reseal`` to that version;
- tests/data/codec_digests_v4.json: the digests of tests/codec/test_codec_digests.py (its
  fixed KV and calibrations: tests/helpers/codec_digests.py) as the version-4 writer made
  them, for every codec, level and dtype; the current writer's chunks, resealed to
  version 4 (5 for a chunk with a version-5 feature), hash to them.

Run: .venv/bin/python -m pytest tests/codec/test_codec_bitstream_versions.py -q
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch

import codec
from codec import bitstream, kvtc
from tests.helpers import codec_digests as digests

FIXTURES = Path(__file__).parents[1] / "fixtures" / "codec_v4"
V4_DIGESTS = Path(__file__).parents[1] / "data" / "codec_digests_v4.json"


def _maker():
    spec = importlib.util.spec_from_file_location("codec_v4_make", FIXTURES / "make_fixtures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MAKER = _maker()
DECODED = json.loads((FIXTURES / "decoded.json").read_text())


def test_every_fixture_is_listed():
    assert {p.stem for p in FIXTURES.glob("*.kvcg")} == set(DECODED) == {c[0] for c in MAKER.CASES}


@pytest.mark.parametrize("case", MAKER.CASES, ids=[c[0] for c in MAKER.CASES])
def test_version4_fixture_decodes_to_its_values_and_is_rewritten_exactly(case):
    stem, name, level, dt, shape = case
    data = (FIXTURES / f"{stem}.kvcg").read_bytes()
    assert data[4] == DECODED[stem]["version"] in (4, 5)
    assert codec.peek_header(data)["codec_version"] == 4
    k, v = codec.decode_kv(data)
    assert MAKER.bits_sha(k, v) == DECODED[stem]["sha256"]
    out = (torch.empty_like(k), torch.empty_like(v))
    codec.decode_kv_into(data, *out)
    assert MAKER.bits_sha(*out) == DECODED[stem]["sha256"]
    # the current writer: version 6, the same content
    i = [c[0] for c in MAKER.CASES].index(stem)
    k0, v0 = MAKER.fixed_kv(shape, getattr(torch, dt), 100 + i)
    new = codec.encode_kv(k0, v0, codec=name, level=level)
    assert new[4] == bitstream.FORMAT_VERSION == 6
    assert codec.peek_header(new)["codec_version"] == codec.CODEC_VERSION == 5
    old = json.loads(json.dumps(codec.peek_header(data)))
    assert bitstream.reseal(new, data[4])[:12] == data[:12]
    # content identical but for the codec_version field of the header (4 -> 5)
    h_new, a_new, p_new = bitstream.unpack(new)
    h_old, a_old, p_old = bitstream.unpack(data)
    assert h_new["codec_version"] == 5 and h_old["codec_version"] == 4
    assert {**h_new, "codec_version": 4} == h_old and p_new == p_old and old["T"] == shape[1]
    assert set(a_new) == set(a_old)
    assert all(a_new[n].tobytes() == a_old[n].tobytes() for n in a_new)
    assert MAKER.bits_sha(*codec.decode_kv(new)) == DECODED[stem]["sha256"]


def _legacy(blob: bytes) -> bytes:
    """A current chunk as the version-4 writer made it: version 5 when it uses a
    version-5 feature (a KIVI short last key group, cachegen outlier channels), else 4;
    the header's codec_version back to 4; CRC32 trailer."""
    c = bitstream.unpack_container(blob)
    h = dict(c.header)
    ch = h["codec_header"]
    v5 = "nt" in ch or "n_chx_k" in ch or "n_chx_v" in ch
    h["codec_version"] = 4
    bf16 = [n for n, t in c.dtypes.items() if t == "bf16"]
    return bitstream.pack(h, dict(c.arrays), c.payload, bf16=bf16, version=5 if v5 else 4)


_CAL: dict = {}


@pytest.mark.parametrize("case,name,level,dt", digests.cases(), ids=[c[0] for c in digests.cases()])
def test_current_chunks_are_the_version4_writers_bytes(case, name, level, dt):
    k, v = digests.fixed_kv(digests.DTYPES[dt])
    if name.startswith("kvtc"):
        if name not in _CAL:
            _CAL[name] = digests.fixed_calibration(**digests.KVTC_CALIBRATIONS[name])
        blobs = codec.encode_chunks(k, v, codec="kvtc", level=level, chunk_tokens=digests.CHUNK,
                                    config=kvtc.KvtcConfig(calibration=_CAL[name]))
    else:
        blobs = codec.encode_chunks(k, v, codec=name, level=level, chunk_tokens=digests.CHUNK)
    h = hashlib.sha256()
    for b in blobs:
        assert b[4] == 6
        old = _legacy(b)
        h.update(len(old).to_bytes(8, "little"))
        h.update(old)
    assert h.hexdigest() == json.loads(V4_DIGESTS.read_text())["digests"][case]
