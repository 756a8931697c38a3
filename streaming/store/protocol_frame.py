"""The frame format of the KV store protocol: the 17-byte header, the frame types, and
encoding / decoding of whole frames from bytes (no socket).

The layout and its limits are described in streaming.store.protocol, which also holds the socket
side (send and receive with a per-call timeout) and re-exports every name here. Kept
apart so the format can be read, tested and fuzzed without a connection. Not runnable.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from enum import IntEnum

from cachegen_common.bounded_json import parse as parse_bounded_json
from streaming.errors import ProtocolError

MAGIC = b"CGKV"
HEADER = struct.Struct("<4sBIQ")
HEADER_SIZE = HEADER.size  # 17 bytes
DEFAULT_MAX_META = 4 << 20  # 4 MiB: a manifest of a 100K-token context with its token ids fits
# Frame metadata is a flat request (key, levels, counts) or a manifest, four levels deep at
# most; deeper nesting is refused before parsing.
MAX_META_DEPTH = 32
DEFAULT_MAX_BODY = 1 << 30  # 1 GiB: far above one encoded chunk (tens of MB raw at 1.5K tokens)


class FrameType(IntEnum):
    """Request (< 0x80) and response (>= 0x80) frame types."""

    PING = 1
    GET_MANIFEST = 2  # meta {key, expect?: {model_id, weights_hash, codec_tag}}
    GET_CHUNK = 3  # meta {key, level, index} -> body = chunk bytes
    PUT_CHUNK = 4  # meta {key, level, index}, body = chunk bytes
    PUT_MANIFEST = 5  # meta {key, manifest}: commits a context (checked against its chunks)
    LIST = 6  # meta {prefix?, limit?} -> meta {keys}
    HAS = 7  # meta {key} -> meta {exists}
    DELETE = 8  # meta {key}: removes a context (manifest first, then chunks)
    RESOLVE = 9  # meta {key, gen, levels, chunk_count} -> meta {published}: settles a save
    # whose reply was lost (published: nothing touched; not: its chunks deleted)
    OK = 0x80
    MISS = 0x81  # clean miss: meta {reason}
    ERR = 0x82  # refused / failed request: meta {error}


_VALID_TYPES = frozenset(int(t) for t in FrameType)


class FrameTooLarge(ProtocolError):
    """A frame's metadata or body length exceeds the receiver's limit (`limit`, `size`, bytes)."""

    def __init__(self, message: str, limit: int, size: int):
        super().__init__(message)
        self.limit, self.size = limit, size


@dataclass
class Frame:
    """One decoded frame: type, JSON metadata (dict) and raw body (bytes or bytearray)."""

    type: FrameType
    meta: dict = field(default_factory=dict)
    body: bytes | bytearray = b""


def encode_header(ftype: int, meta_bytes_len: int, body_len: int) -> bytes:
    """Pack a 17-byte frame header. Raises ProtocolError for an unknown type."""
    if int(ftype) not in _VALID_TYPES:
        raise ProtocolError(f"unknown frame type {ftype}")
    return HEADER.pack(MAGIC, int(ftype), meta_bytes_len, body_len)


def encode_frame(ftype: int, meta: dict | None = None, body: bytes = b"") -> bytes:
    """Serialise a frame to bytes (header + JSON meta + body)."""
    mb = json.dumps(meta or {}, separators=(",", ":")).encode("utf-8")
    return encode_header(ftype, len(mb), len(body)) + mb + bytes(body)


def parse_header(
    hdr: bytes, max_meta: int = DEFAULT_MAX_META, max_body: int = DEFAULT_MAX_BODY
) -> tuple[FrameType, int, int]:
    """Validate a 17-byte header -> (type, meta_len, body_len). Raises ProtocolError."""
    if len(hdr) != HEADER_SIZE:
        raise ProtocolError(f"frame header must be {HEADER_SIZE} bytes, got {len(hdr)}")
    magic, ftype, meta_len, body_len = HEADER.unpack(hdr)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {magic!r} (expected {MAGIC!r})")
    if ftype not in _VALID_TYPES:
        raise ProtocolError(f"unknown frame type {ftype}")
    if meta_len > max_meta:
        raise FrameTooLarge(f"frame metadata of {meta_len} bytes exceeds the limit of {max_meta}",
                            max_meta, meta_len)
    if body_len > max_body:
        raise FrameTooLarge(f"frame body of {body_len} bytes exceeds the limit of {max_body}",
                            max_body, body_len)
    return FrameType(ftype), meta_len, body_len


def parse_meta(mb: bytes | bytearray, max_meta: int | None = None) -> dict:
    """Decode the JSON metadata of a frame; it must be a JSON object of at most
    ``max_meta`` bytes (default DEFAULT_MAX_META) nested at most MAX_META_DEPTH deep.
    Raises ProtocolError (one line) for anything else: over a bound, not UTF-8, not JSON,
    another top-level type."""
    if not mb:
        return {}
    return parse_bounded_json(mb, what="frame metadata", max_bytes=DEFAULT_MAX_META if max_meta is None else max_meta,
                              max_depth=MAX_META_DEPTH, expect=dict, error=ProtocolError)


def decode_frame(
    buf: bytes, max_meta: int = DEFAULT_MAX_META, max_body: int = DEFAULT_MAX_BODY
) -> tuple[Frame, int]:
    """Decode the first frame of an in-memory buffer -> (frame, bytes consumed).

    Raises ProtocolError if the buffer is malformed or holds less than one whole frame.
    """
    ftype, ml, bl = parse_header(bytes(buf[:HEADER_SIZE]), max_meta, max_body)
    end = HEADER_SIZE + ml + bl
    if len(buf) < end:
        raise ProtocolError(f"truncated frame: {len(buf)} of {end} bytes")
    meta = parse_meta(buf[HEADER_SIZE : HEADER_SIZE + ml], max_meta)
    return Frame(ftype, meta, bytes(buf[HEADER_SIZE + ml : end])), end
