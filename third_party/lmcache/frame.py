"""The KVLM frame around our codec containers in an LMCache object: ``KVLM`` | u16 version |
u16 containers | u32 ident length | ident JSON | u64 length per container | u32 CRC32 of
all of it, then the containers, zero padding to the slot after them. Bytes only: what the
ident holds and how tensors map to containers is :mod:`.layout`'s.

A container is either one of our codec's (magic ``KVCG``, docs/bitstream.md) or a
verbatim one: ``KVRW`` | u64 length | u32 CRC32 of the bytes, then a kernel group's bytes
as they are (a layout the serde cannot code, or the ``raw`` step of the ladder).
"""
from __future__ import annotations

import struct
import zlib

FRAME_MAGIC = b"KVLM"
FRAME_VERSION = 1
_HEAD = struct.Struct("<4sHHI")     # magic, version, number of containers, ident length
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
MAX_CONTAINERS = 4096
MAX_IDENT = 1 << 16
RAW_MAGIC = b"KVRW"
_RAW = struct.Struct("<4sQI")       # magic, length, CRC32 of the bytes
RAW_HEAD = _RAW.size


def header_size(ident_len: int, n_containers: int) -> int:
    """Bytes of the frame before the containers, for an ident of ``ident_len`` bytes."""
    return _HEAD.size + ident_len + n_containers * _U64.size + _U32.size


def pack_frame(ident: bytes, blobs: list[bytes]) -> bytes:
    """The frame of ``blobs`` (codec containers) under ``ident`` (unpadded bytes)."""
    head = _HEAD.pack(FRAME_MAGIC, FRAME_VERSION, len(blobs), len(ident)) + ident + \
        b"".join(_U64.pack(len(x)) for x in blobs)
    return b"".join([head, _U32.pack(zlib.crc32(head)), *blobs])


def parse_frame(buf: memoryview) -> tuple[bytes, list[memoryview]]:
    """(ident JSON bytes, container views) of a frame. Raises ValueError on a bad or
    corrupt frame (magic, version, lengths, CRC)."""
    if len(buf) < _HEAD.size + _U32.size:
        raise ValueError("object too short for a KVLM frame")
    magic, ver, n, ilen = _HEAD.unpack_from(buf, 0)
    if magic != FRAME_MAGIC:
        raise ValueError(f"not a KVLM frame (magic {bytes(magic)!r})")
    if ver != FRAME_VERSION:
        raise ValueError(f"KVLM frame version {ver} (this reader: {FRAME_VERSION})")
    if not 1 <= n <= MAX_CONTAINERS or ilen > MAX_IDENT:
        raise ValueError("KVLM frame header out of range")
    pos = _HEAD.size + ilen + n * _U64.size
    if pos + _U32.size > len(buf):
        raise ValueError("KVLM frame truncated")
    if zlib.crc32(buf[:pos]) != _U32.unpack_from(buf, pos)[0]:
        raise ValueError("KVLM frame CRC mismatch (corrupt object)")
    ident = bytes(buf[_HEAD.size:_HEAD.size + ilen])
    lens = [_U64.unpack_from(buf, _HEAD.size + ilen + i * _U64.size)[0] for i in range(n)]
    pos += _U32.size
    if pos + sum(lens) > len(buf):
        raise ValueError("KVLM frame's containers run past the object")
    views = []
    for ln in lens:
        views.append(buf[pos:pos + ln])
        pos += ln
    if pos < len(buf) and any(buf[pos:].tobytes().rstrip(b"\0")):
        raise ValueError("KVLM frame padding is not zero (corrupt object)")
    return ident, views


def pack_raw(data: bytes) -> bytes:
    """A verbatim container holding ``data`` (``RAW_HEAD`` + len(data) bytes)."""
    return _RAW.pack(RAW_MAGIC, len(data), zlib.crc32(data)) + data


def is_raw(view: memoryview) -> bool:
    """Whether a container is a verbatim one (else: a codec container)."""
    return bytes(view[:4]) == RAW_MAGIC


def unpack_raw(view: memoryview, nbytes: int) -> memoryview:
    """The bytes of a verbatim container, checked: ValueError unless it holds exactly
    ``nbytes`` bytes whose CRC32 matches (a corrupt or foreign object)."""
    if len(view) < _RAW.size:
        raise ValueError("verbatim container truncated")
    magic, n, crc = _RAW.unpack_from(view, 0)
    if magic != RAW_MAGIC or n != nbytes or len(view) != _RAW.size + n:
        raise ValueError(f"verbatim container holds {n} bytes, the destination group "
                         f"{nbytes}")
    body = view[_RAW.size:]
    if zlib.crc32(body) != crc:
        raise ValueError("verbatim container CRC mismatch (corrupt object)")
    return body
