"""Tests of the generic container (codec/bitstream.py, docs/bitstream.md section 4.1).

Run: .venv/bin/python -m pytest tests/codec/test_codec_bitstream.py -q
"""
from __future__ import annotations

import json
import random
import struct
import zlib

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from codec import bitstream as bs
from codec.errors import CodecError

HYP = settings(derandomize=True, database=None, deadline=None, max_examples=150, suppress_health_check=list(HealthCheck))


def _sample_containers() -> list[bytes]:
    rng = np.random.default_rng(0)
    out = [
        bs.pack({}, {}, b""),
        bs.pack({"codec": "cachegen", "shape": [30, 1024, 192], "level": 2, "x": 1.5, "n": None},
                {"ent_freqs": rng.integers(1, 60000, 37).astype(np.uint16),
                 "idx": rng.integers(0, 255, (2, 3, 7)).astype(np.uint8),
                 "scales": rng.integers(0, 65535, (3, 5)).astype(np.uint16),
                 "f": rng.standard_normal((2, 2, 2)).astype(np.float32),
                 "empty": np.zeros((0, 4), np.int64)},
                bytes(rng.integers(0, 256, 301, dtype=np.uint8)), bf16=["scales"]),
        bs.pack({"a": "b" * 50}, {"one": np.arange(3, dtype=np.int32)}, b"\x00" * 17),
    ]
    return out


def test_round_trip_all_dtypes():
    rng = np.random.default_rng(1)
    arrays = {}
    for code, (name, dt) in bs.DTYPE_CODES.items():
        if name == "bf16":
            continue
        a = rng.integers(0, 100, (2, 3)).astype(dt)
        arrays[f"a_{name}"] = a
    arrays["big_endian"] = np.arange(6, dtype=">i4").reshape(3, 2)
    arrays["noncontig"] = np.arange(20, dtype=np.int16).reshape(4, 5)[:, ::2]
    arrays["scalar"] = np.array(3.5, dtype=np.float32)
    arrays["six_d"] = np.ones((1, 2, 1, 2, 1, 2), np.uint8)
    arrays["bf"] = np.array([0x3F80, 0x4000], dtype=np.uint16)
    hdr = {"k": [1, 2, {"z": "é"}], "t": True, "f": -0.25}
    data = bs.pack(hdr, arrays, b"payload", bf16=["bf"])
    c = bs.unpack_container(data)
    assert c.header == hdr
    assert c.payload == b"payload"
    assert c.dtypes["bf"] == "bf16" and c.dtypes["a_f32"] == "f32"
    for k, a in arrays.items():
        assert c.arrays[k].shape == a.shape
        assert np.array_equal(c.arrays[k], a), k
    # xxh3-64 over everything before it, at the end (version 6)
    assert struct.unpack("<Q", data[-8:])[0] == xxhash.xxh3_64_intdigest(data[:-8])
    assert data[:4] == b"KVCG" and struct.unpack("<H", data[4:6])[0] == bs.FORMAT_VERSION == 6
    assert bs.peek_header(data) == hdr
    # the version-4 writer's bytes: the same content with a CRC32 trailer
    old = bs.pack(hdr, arrays, b"payload", bf16=["bf"], version=4)
    assert old[:4] == b"KVCG" and old[4:6] == b"\x04\x00" and old[6:-4] == data[6:-8]
    assert struct.unpack("<I", old[-4:])[0] == zlib.crc32(old[:-4])
    assert bs.reseal(old, 6) == data and bs.reseal(data, 4) == old
    c4 = bs.unpack_container(old)
    assert c4.header == hdr and c4.payload == b"payload"
    assert all(np.array_equal(c4.arrays[k], a) for k, a in arrays.items())


def test_unpack_without_copy_gives_read_only_views():
    """copy=False: the payload is a read-only view of the input (no copy), the arrays
    read-only views too, even for a writable input; the values equal the copying parse."""
    data = _sample_containers()[1]
    ref = bs.unpack_container(data)
    for src in (data, bytearray(data), memoryview(bytearray(data))):
        c = bs.unpack_container(src, copy=False)
        assert isinstance(c.payload, memoryview) and c.payload.readonly
        assert bytes(c.payload) == ref.payload
        for name, a in c.arrays.items():
            assert not a.flags.writeable and np.array_equal(a, ref.arrays[name])
    # a view, not a copy: it sees the input's memory
    buf = bytearray(data)
    c = bs.unpack_container(buf, copy=False)
    assert np.shares_memory(np.frombuffer(c.payload, np.uint8), np.frombuffer(buf, np.uint8))


def test_reseal_rejects_what_it_cannot_rewrite():
    data = _sample_containers()[0]
    for bad, ver in ((b"", None), (b"XVCG" + data[4:], None), (data, 7), (data, 3), ("text", None)):
        with pytest.raises(CodecError):
            bs.reseal(bad, ver)  # type: ignore[arg-type]
    b = bytearray(bs.reseal(data, 4))
    b[4] = 2   # a version-2 container is not rewritten as version 6 (another layout)
    with pytest.raises(CodecError):
        bs.reseal(bytes(b), 6)


def test_layout_matches_spec():
    """Hand-build the bytes from docs/bitstream.md 4.1 and compare."""
    a = np.array([1, 2, 3], dtype=np.uint16)
    hdr = {"b": 1, "a": [2]}
    js = json.dumps(hdr, separators=(",", ":"), sort_keys=True).encode()
    head = b"KVCG" + struct.pack("<HHI", 4, 0, len(js)) + js + struct.pack("<H", 1)
    head += struct.pack("<B", 1) + b"x" + struct.pack("<BB", 3, 1) + struct.pack("<Q", 3)
    head += b"\0" * ((-len(head)) % 8)
    body = head + a.tobytes() + b"\0" * 2 + struct.pack("<Q", 2) + b"pl"
    expected = body + struct.pack("<I", zlib.crc32(body))
    assert bs.pack(hdr, {"x": a}, b"pl", version=4) == expected
    body6 = body[:4] + struct.pack("<H", 6) + body[6:]
    assert bs.pack(hdr, {"x": a}, b"pl") == body6 + struct.pack("<Q", xxhash.xxh3_64_intdigest(body6))


@pytest.mark.parametrize("bad", [
    ({1: 2}, "keys"), ({"x": float("nan")}, "finite"), ({"x": object()}, "JSON"),
])
def test_pack_rejects_bad_headers(bad):
    with pytest.raises(ValueError):
        bs.pack(bad[0], {})


def test_pack_rejects_bad_arrays():
    with pytest.raises(ValueError):
        bs.pack({}, {"x": np.zeros(3, np.complex64)})
    with pytest.raises(ValueError):
        bs.pack({}, {"bad name!": np.zeros(3, np.uint8)})
    with pytest.raises(ValueError):
        bs.pack({}, {"x": np.zeros((1,) * 7, np.uint8)})
    with pytest.raises(ValueError):
        bs.pack({}, {"x": [1, 2]})
    with pytest.raises(ValueError):
        bs.pack({}, {"x": np.zeros(3, np.float32)}, bf16=["x"])
    with pytest.raises(ValueError):
        bs.pack({"h": "x" * (bs.MAX_HEADER_BYTES + 1)}, {})
    with pytest.raises(ValueError):
        bs.pack({}, {}, "text payload")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        bs.pack({}, {"b": np.zeros(2, bool)})


def _refresh_crc(b: bytearray) -> bytes:
    """The bytes with their trailer recomputed as the spec says for the version field
    they carry (xxh3-64 u64 from version 6, CRC32 u32 before), written here from the
    spec rather than with ``bs.reseal``, so a crafted field reaches the parser."""
    ver = struct.unpack_from("<H", b, 4)[0] if len(b) >= 6 else 0
    if ver >= 6:
        body = bytes(b[:-8])
        return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
    body = bytes(b[:-4])
    return body + struct.pack("<I", zlib.crc32(body))


def test_specific_corruptions():
    data = _sample_containers()[1]
    cases = {
        "empty": b"",
        "short": data[:7],
        "magic": b"XVCG" + data[4:],
        "no crc": data[:-4],
        "no checksum": data[:-8],
        "crc": data[:-1] + bytes([data[-1] ^ 1]),
        "checksum low byte": data[:-8] + bytes([data[-8] ^ 1]) + data[-7:],
        "extra": data + b"\0",
        "as version 4 without resealing": data[:4] + b"\x04" + data[5:],
    }
    for name, d in cases.items():
        with pytest.raises(CodecError):
            bs.unpack(d)
    b = bytearray(data)
    b[4] = 7  # version 7 (checksum refreshed so the version check itself is exercised)
    with pytest.raises(CodecError, match="version"):
        bs.unpack(_refresh_crc(b))
    b = bytearray(bs.reseal(data, 4))   # versions 4 and 5: the CRC32 trailer
    assert bs.unpack(bytes(b))[0] == bs.unpack(data)[0]
    b[4] = 5
    assert bs.unpack(_refresh_crc(b))[0] == bs.unpack(data)[0]
    b[4] = 1  # format version 1 containers (before the outlier side list) still read
    assert bs.unpack(_refresh_crc(b))[0] == bs.unpack(data)[0]
    b[4] = 2  # and version 2 (16-bit model tables; the entropy stage reads both codebooks)
    assert bs.unpack(_refresh_crc(b))[0] == bs.unpack(data)[0]
    b[4] = 3  # and version 3 (Rice-coded tables without ranges; all three codebooks read)
    assert bs.unpack(_refresh_crc(b))[0] == bs.unpack(data)[0]
    b = bytearray(data)
    b[6] = 1  # flags
    with pytest.raises(CodecError, match="flags"):
        bs.unpack(_refresh_crc(b))
    b = bytearray(data)
    b[8:12] = struct.pack("<I", bs.MAX_HEADER_BYTES + 1)
    with pytest.raises(CodecError, match="header"):
        bs.unpack(_refresh_crc(b))
    with pytest.raises(CodecError, match="max_bytes"):
        bs.unpack(data, max_bytes=len(data) - 1)
    with pytest.raises(CodecError):
        bs.unpack("not bytes")  # type: ignore[arg-type]


def test_bad_json_headers_rejected():
    base = bytearray(bs.pack({"a": 1}, {}, b""))
    for js in (b'{"a":1,"a":2}', b'[1,2,3,4,5]', b'{"a":NaN}', b'{"a":Infinity}', b'{"a":1', b'\xff\xfe\x00\x01\x02',
               b'{"a":' + b"[" * 40 + b"]" * 40 + b"}", b"[" * 100000):
        d = bytearray(base[:8]) + struct.pack("<I", len(js)) + js + base[12 + 7:]
        with pytest.raises(CodecError):
            bs.unpack(_refresh_crc(d))
    d = bytearray(base[:8]) + struct.pack("<I", 7) + b'{"b":2}' + base[12 + 7:]
    assert bs.unpack(_refresh_crc(d))[0] == {"b": 2}


def test_absurd_shape_rejected_before_allocation():
    """A CRC-valid container declaring a 2^60-element array is refused, not allocated."""
    data = bytearray(bs.pack({}, {"x": np.zeros(4, np.uint8)}, b""))
    # locate the shape field: after fixed(12) + header "{}"(2) + n_arrays(2) + name_len(1) + "x" + code + ndim
    off = 12 + 2 + 2 + 1 + 1 + 2
    assert struct.unpack_from("<Q", data, off)[0] == 4
    for shape0 in (9, 2**60, 2**64 - 1):
        d = bytearray(data)
        struct.pack_into("<Q", d, off, shape0)
        with pytest.raises(CodecError):
            bs.unpack(_refresh_crc(d))
    d = bytearray(data)
    struct.pack_into("<Q", d, off, 0)  # empty array: then the data bytes become padding/garbage
    with pytest.raises(CodecError):
        bs.unpack(_refresh_crc(d))


def test_empty_arrays():
    arrays = {"a": np.zeros((0, 2, 4), np.uint64), "b": np.zeros((3, 0), np.float32), "c": np.zeros(0, np.uint8)}
    h, a, p = bs.unpack(bs.pack({}, arrays, b""))
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in arrays.items()}
    with pytest.raises(ValueError):
        bs.pack({}, {"x": np.zeros((0, 2**20, 2**20), np.uint8)})
    # a crafted empty array with an absurd extent is refused by the reader as well
    data = bytearray(bs.pack({}, {"x": np.zeros((0, 4), np.uint8)}, b""))
    off = 12 + 2 + 2 + 1 + 1 + 2 + 8
    assert struct.unpack_from("<Q", data, off)[0] == 4
    struct.pack_into("<Q", data, off, 2**40)
    with pytest.raises(CodecError, match="absurd"):
        bs.unpack(_refresh_crc(data))


def test_huge_length_fields_with_a_valid_checksum():
    """Each length field set to huge values behind a recomputed checksum (so the parser
    itself is reached), in both trailer formats: CodecError, nothing allocated."""
    for version in (6, 4):
        data = bytearray(bs.pack({"a": 1}, {"x": np.arange(5, dtype=np.uint16)}, b"pay",
                                 version=version))
        tail = bs.checksum_bytes(version)
        hlen = struct.unpack_from("<I", data, 8)[0]
        pos_n = 12 + hlen
        off_shape = pos_n + 2 + 1 + 1 + 2
        pos_plen = len(data) - tail - 3 - 8
        assert struct.unpack_from("<Q", data, pos_plen)[0] == 3
        for fmt, pos, values in (("<I", 8, (2**20, 2**32 - 1)), ("<H", pos_n, (2, 256, 2**16 - 1)),
                                 ("<Q", off_shape, (9, 2**40, 2**64 - 1)),
                                 ("<Q", pos_plen, (0, 4, 2**63, 2**64 - 1))):
            for val in values:
                d = bytearray(data)
                struct.pack_into(fmt, d, pos, val)
                with pytest.raises(CodecError):
                    bs.unpack(_refresh_crc(d))


def test_fuzz_random_corruptions_raise_codec_error_only():
    """Thousands of seeded random mutations: only CodecError, never another exception
    (containers of both trailer formats: version 6 and version 4)."""
    rng = random.Random(1234)
    samples = _sample_containers()
    samples += [bs.reseal(d, 4) for d in samples]
    n_raised = n_ok = 0
    for i in range(4000):
        data = bytearray(samples[i % len(samples)])
        op = rng.randrange(6)
        if op == 0:  # truncate
            data = data[: rng.randrange(len(data))]
        elif op == 1:  # flip 1-4 bytes
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] ^= rng.randint(1, 255)
        elif op == 2:  # insert garbage
            p = rng.randrange(len(data) + 1)
            data[p:p] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 3:  # delete a range
            p = rng.randrange(len(data))
            del data[p : p + rng.randint(1, 16)]
        elif op == 4:  # random garbage with a valid prefix
            k = rng.randrange(len(data))
            data = data[:k] + bytearray(rng.randrange(256) for _ in range(rng.randint(0, 64)))
        else:  # flip bytes in the structural prefix and REPAIR the CRC
            lim = min(len(data) - 8, 120)
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(lim)] ^= 1 << rng.randrange(8)
            data = bytearray(_refresh_crc(data))
        try:
            h, arrays, payload = bs.unpack(bytes(data))
        except CodecError:
            n_raised += 1
            continue
        # accepted: must be a self-consistent parse bounded by the input size
        n_ok += 1
        assert isinstance(h, dict)
        assert sum(a.nbytes for a in arrays.values()) + len(payload) <= len(data)
    assert n_raised > 3000  # nearly every mutation is detected (CRC or structure)


def test_fuzz_pure_garbage():
    rng = np.random.default_rng(7)
    for i in range(500):
        n = int(rng.integers(0, 200))
        d = bytes(rng.integers(0, 256, n, dtype=np.uint8))
        if i % 3 == 1:
            d = b"KVCG\x01\x00\x00\x00" + d
        elif i % 3 == 2:
            d = b"KVCG\x06\x00\x00\x00" + d
        with pytest.raises(CodecError):
            bs.unpack(d)


_dtypes = st.sampled_from([np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.uint64,
                           np.int64, np.float16, np.float32])
_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_0123456789.-", min_size=1, max_size=10)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-2**60, 2**60) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda ch: st.lists(ch, max_size=4) | st.dictionaries(st.text(max_size=8), ch, max_size=4),
    max_leaves=20,
)


@HYP
@given(
    header=st.dictionaries(st.text(max_size=10), _json, max_size=5),
    specs=st.dictionaries(_names, st.tuples(_dtypes, st.lists(st.integers(0, 5), max_size=4)), max_size=5),
    big_empty=st.booleans(),
    payload=st.binary(max_size=300),
    seed=st.integers(0, 2**31),
)
def test_property_round_trip(header, specs, payload, seed, big_empty):
    rng = np.random.default_rng(seed)
    arrays = {k: rng.integers(0, 100, tuple(shape)).astype(dt) for k, (dt, shape) in specs.items()}
    if big_empty:
        arrays["big_empty"] = np.zeros((1000, 0, 1000), np.uint64)
    data = bs.pack(header, arrays, payload)
    h, a, p = bs.unpack(data)
    assert h == header and p == payload
    assert set(a) == set(arrays)
    for k in arrays:
        assert a[k].dtype == np.dtype(arrays[k].dtype).newbyteorder("<")
        assert np.array_equal(a[k], arrays[k])
    # every strict prefix is rejected
    for cut in sorted({0, 1, len(data) // 2, len(data) - 5, len(data) - 1}):
        if 0 <= cut < len(data):
            with pytest.raises(CodecError):
                bs.unpack(data[:cut])
