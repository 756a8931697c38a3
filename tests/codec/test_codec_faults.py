"""Thousands of corrupted / truncated bitstreams of every codec: decoding must raise
``codec.CodecError`` and nothing else (or, when a mutation happens to stay a valid
bitstream, return finite tensors of the declared shape and dtype). Seeded, deterministic.

Three mutation families:
  1. random byte flips / truncations / extensions of the real bytes (the CRC32 rejects);
  2. the same with the CRC32 recomputed, so the damage reaches the parsers behind it;
  3. structured edits (header fields, arrays, payload) re-packed with a valid container.
"""
from __future__ import annotations

import copy
import random
import struct
import zlib

import numpy as np
import pytest
import torch
import xxhash

import codec
from codec import bitstream
from tests.helpers.kv import make_kv

N_RANDOM = 150      # per codec and family 1/2 (x 7 codecs x 2 families x 2 inputs)
N_STRUCT = 120      # per codec, family 3 (x 2 inputs)


def _inputs(name: str) -> list[bytes]:
    """A whole-KV encoding (bf16) and a later chunk (fp16, token_offset > 0); the fp16
    KV has two outliers (cachegen: an outlier side list, docs/bitstream.md 4.4, in both
    fp16 chunks). Codecs that need a calibration artifact for this shape are skipped."""
    k, v = make_kv(2, 40, 2, 8, seed=1, k_scale=3.0)
    k[:, 3] = 0
    try:
        whole = codec.encode_kv(k, v, codec=name)
    except ValueError as e:
        if "calibration" in str(e):
            pytest.skip(f"{name} needs a calibration artifact for this shape")
        raise
    k2, v2 = make_kv(2, 170, 2, 8, dtype=torch.float16, seed=2, k_scale=3.0)
    k2[:, 3] = 0
    k2[1, 50, 1, 3] = 3e4
    k2[0, 165, 0, 2] = -2e4
    chunk = codec.encode_chunks(k2, v2, codec=name, chunk_tokens=160)[1]
    big = codec.encode_chunks(k2, v2, codec=name, chunk_tokens=160)[0]
    return [whole, chunk, big]


def _check_decode(data: bytes) -> str:
    """Decode; return 'ok' or 'error'; any exception other than CodecError fails."""
    try:
        k, v = codec.decode_kv(data)
    except codec.CodecError:
        try:  # peek_header must agree that the input is bad or at least not crash
            codec.peek_header(data)
        except codec.CodecError:
            pass
        return "error"
    h = codec.peek_header(data)
    assert k.shape == (h["L"], h["T"], h["H"], h["D"]) == v.shape
    assert str(k.dtype) == "torch." + h["dtype"] and v.dtype == k.dtype
    assert bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all())
    return "ok"


def _fix_crc(body: bytes) -> bytes:
    """``body`` (a container without its trailer) with the checksum its version field
    asks for: xxh3-64 u64 from format version 6, CRC32 u32 before (docs/bitstream.md
    4.1), so the damage behind it reaches the parser."""
    if len(body) >= 6 and struct.unpack_from("<H", body, 4)[0] >= 6:
        return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
    return body + struct.pack("<I", zlib.crc32(body) & 0xFFFFFFFF)


def _mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    op = rng.randrange(5)
    if op == 0:                                          # flip 1..4 random bits
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif op == 1:                                        # overwrite a byte run
        i = rng.randrange(len(b))
        for j in range(i, min(len(b), i + rng.randint(1, 16))):
            b[j] = rng.randrange(256)
    elif op == 2:                                        # truncate
        b = b[: rng.randrange(len(b))]
    elif op == 3:                                        # append garbage
        b += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    else:                                                # delete a run in the middle
        i = rng.randrange(len(b))
        del b[i: i + rng.randint(1, 32)]
    return bytes(b)


@pytest.mark.parametrize("name", sorted(codec.CODECS))
def test_random_byte_mutations_raise_codec_error(name):
    rng = random.Random(f"bytes-{name}")
    outcomes = {"ok": 0, "error": 0}
    for j, data in enumerate(_inputs(name)[:2]):
        assert _check_decode(data) == "ok"
        for _ in range(N_RANDOM):
            bad = _mutate_bytes(rng, data)
            if bad == data:
                continue
            assert _check_decode(bad) == "error"        # the CRC catches every change
            outcomes["error"] += 1
        # family 2: same damage behind a valid checksum (truncations etc. of the body),
        # in the current container (xxh3-64 trailer) and the version-4 one (CRC32)
        body = data[:-8] if j == 0 else bitstream.reseal(data, 4)[:-4]
        for _ in range(N_RANDOM):
            bad_body = _mutate_bytes(rng, body)
            outcomes[_check_decode(_fix_crc(bad_body))] += 1
    assert outcomes["error"] > N_RANDOM * 2              # most damage is detected


def _rand_value(rng: random.Random):
    return rng.choice([-1, 0, 1, 2, 3, 7, 2**31, 2**40, -2**63, 1.5, "x", None, True, [],
                       {}, [1, 2], "bfloat16", "float64", "log8", "dtype", 10**30])


def _mutate_struct(rng: random.Random, header: dict, arrays: dict, payload: bytes):
    header = copy.deepcopy(header)
    arrays = {n: np.array(a) for n, a in arrays.items()}
    op = rng.randrange(10)
    if op in (0, 1):                                    # a top-level header field
        key = rng.choice(sorted(header))
        if rng.random() < 0.2:
            del header[key]
        else:
            header[key] = _rand_value(rng)
    elif op in (2, 3):                                  # a codec-specific header field
        ch = header["codec_header"]
        targets = [(ch, key) for key in ch]
        for sub in ("config", "entropy"):
            if isinstance(ch.get(sub), dict):
                targets += [(ch[sub], key) for key in ch[sub]]
        if targets:
            d, key = rng.choice(targets)
            if rng.random() < 0.2:
                del d[key]
            else:
                d[key] = _rand_value(rng)
    elif op in (4, 5) and arrays:                       # corrupt array contents
        n = rng.choice(sorted(arrays))
        a = arrays[n]
        if a.size:
            raw = bytearray(a.tobytes())
            for _ in range(rng.randint(1, 6)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            arrays[n] = np.frombuffer(bytes(raw), dtype=a.dtype).reshape(a.shape).copy()
    elif op == 6 and arrays:                            # wrong shape / dtype / missing
        n = rng.choice(sorted(arrays))
        a = arrays[n]
        choice = rng.randrange(3)
        if choice == 0:
            del arrays[n]
        elif choice == 1:
            arrays[n] = a.reshape(-1)[: max(0, a.size - rng.randint(1, 3))]
        else:
            arrays[n] = a.astype(rng.choice([np.uint8, np.uint32, np.int16, np.float32]))
    elif op == 7:                                       # payload damage
        p = bytearray(payload)
        if p and rng.random() < 0.6:
            for _ in range(rng.randint(1, 8)):
                p[rng.randrange(len(p))] = rng.randrange(256)
        elif p and rng.random() < 0.5:
            p = p[: rng.randrange(len(p))]
        else:
            p += bytes(rng.randrange(256) for _ in range(rng.randint(1, 20)))
        payload = bytes(p)
    elif op == 8:                                       # extra unknown array
        arrays["zz_extra"] = np.zeros(rng.randint(0, 9), np.uint8)
    else:                                               # swap codec name / dims
        header[rng.choice(["codec", "L", "T", "H", "D", "dtype"])] = rng.choice(
            sorted(codec.CODECS) + [1, 2, 3, 16, 41, "float16", "float32", "bfloat16"])
    return header, arrays, payload


@pytest.mark.parametrize("name", sorted(codec.CODECS))
def test_structured_mutations_raise_codec_error(name):
    rng = random.Random(f"struct-{name}")
    outcomes = {"ok": 0, "error": 0}
    for data in _inputs(name)[1:]:
        c = bitstream.unpack_container(data)
        bf16 = [n for n, t in c.dtypes.items() if t == "bf16"]
        for _ in range(N_STRUCT):
            h, a, p = _mutate_struct(rng, c.header, c.arrays, c.payload)
            try:
                bad = bitstream.pack(h, a, p, bf16=[n for n in bf16 if n in a and
                                                   a[n].dtype.itemsize == 2
                                                   and a[n].dtype.kind in "ui"])
            except ValueError:
                continue                                # not even packable
            outcomes[_check_decode(bad)] += 1
    assert outcomes["error"] > 0.25 * sum(outcomes.values())


def test_not_bytes_and_empty():
    for bad in (b"", b"KVCG", None, 123, "KVCG" * 10, bytearray(b"\0" * 64)):
        with pytest.raises(codec.CodecError):
            codec.decode_kv(bad)
