"""A stand-in chunk codec for testing and benchmarking the streaming layer without a model.

Not CacheGen: a chunk is b"SIN1" + u32 CRC-32 of the payload + payload. decode() checks the
magic and CRC (raising ValueError like codec.CodecError does) and then does real CPU work:
`rounds` SHA-256 passes over the payload (hashlib releases the GIL on large buffers, as a
numba/torch decoder would), so decode time scales with chunk size like a real decoder.
Not runnable by itself.
"""

from __future__ import annotations

import hashlib
import random
import struct
import zlib

_MAGIC = b"SIN1"
_HEAD = struct.Struct("<4sI")


def make_chunk(nbytes: int, seed: int) -> bytes:
    """A chunk of exactly `nbytes` bytes (>= 8) with pseudo-random payload."""
    if nbytes < _HEAD.size:
        raise ValueError(f"a stand-in chunk needs at least {_HEAD.size} bytes")
    payload = random.Random(seed).randbytes(nbytes - _HEAD.size)
    return _HEAD.pack(_MAGIC, zlib.crc32(payload)) + payload


def decode(data: bytes, rounds: int = 1) -> tuple[int, str]:
    """-> (payload length, hex digest). Raises ValueError on bad magic or CRC."""
    if len(data) < _HEAD.size:
        raise ValueError("stand-in chunk too short")
    magic, crc = _HEAD.unpack_from(data)
    if magic != _MAGIC:
        raise ValueError("stand-in chunk: bad magic")
    payload = memoryview(data)[_HEAD.size:]
    if zlib.crc32(payload) != crc:
        raise ValueError("stand-in chunk: CRC mismatch")
    h = b""
    for _ in range(max(1, rounds)):
        h = hashlib.sha256(payload).digest()
    return len(payload), h.hex()


def decoder(rounds: int = 1):
    """decode_fn for stream_load doing `rounds` SHA-256 passes per chunk."""
    return lambda data: decode(data, rounds)
