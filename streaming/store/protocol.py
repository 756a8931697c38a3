"""Length-prefixed frames of the KV store protocol (no pickle; JSON metadata + raw body).

Paper: CacheGen section 5 (the KV store the streamer fetches chunks from); the wire format
is this harness's own. Not runnable by itself; used by streaming.store.

Frame layout (all integers little-endian), 17-byte header then payload:

    offset size field
    0      4    magic b"CGKV"
    4      1    type (u8, see FrameType)
    5      4    meta_len (u32): length of the UTF-8 JSON object that follows
    9      8    body_len (u64): length of the raw body after the JSON
    17     meta_len  JSON object (request / response fields)
    ...    body_len  raw bytes (an encoded KV chunk, or empty)

Limits are checked on the header, BEFORE anything is allocated: meta_len <= max_meta
(default 4 MiB), body_len <= max_body (default 1 GiB). A bad magic, unknown type, oversized
length, invalid UTF-8/JSON or a JSON value that is not an object raises ProtocolError.

Two halves: the frame format (header, types, encode / decode of whole frames from bytes,
no socket: readable, testable and fuzzable without a connection), then the socket side
(send and receive frames with the timeout applied to each call: lack of progress).
"""

from __future__ import annotations

import json
import socket
import struct
from dataclasses import dataclass, field
from enum import IntEnum

from cachegen_common.bounded_json import parse as parse_bounded_json
from streaming.errors import ProtocolError, StreamingError


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
    GET_CHUNK = 3  # meta {key, level, index} -> body = chunk bytes (level: int, or null = no level)
    PUT_CHUNK = 4  # meta {key, level, index}, body = chunk bytes (level as in GET_CHUNK)
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


RECV_QUANTUM = 1 << 18  # 256 KiB per recv_into call
SEND_QUANTUM = 1 << 20  # at most 1 MiB offered per send call (each call has the full timeout)


class ConnectionClosed(StreamingError):
    """The peer closed the connection (cleanly between frames or in the middle of one)."""


def send_progress(sock: socket.socket, data) -> None:
    """Send all of `data` (bytes-like) with the socket's timeout applied to each send call,
    i.e. to lack of progress: a large value over a slow link never times out while bytes
    keep moving (socket.sendall's timeout covers the whole value since Python 3.5).
    Raises socket.timeout when no byte could be sent for the timeout, OSError on failure."""
    view = memoryview(data).cast("B")
    off, n = 0, len(view)
    while off < n:
        sent = sock.send(view[off:off + SEND_QUANTUM])
        if sent <= 0:  # pragma: no cover - a blocking send returns >0 or raises
            raise ConnectionError("socket send made no progress")
        off += sent


def send_frame(sock: socket.socket, ftype: int, meta: dict | None = None, body: bytes = b"") -> int:
    """Send one frame on a connected socket; returns bytes sent. The socket timeout bounds
    each send call (no progress), not the frame. Raises OSError / socket.timeout."""
    mb = json.dumps(meta or {}, separators=(",", ":")).encode("utf-8")
    head = encode_header(ftype, len(mb), len(body)) + mb
    if len(body) <= 65536:
        send_progress(sock, head + bytes(body))
    else:  # avoid copying a large chunk body
        send_progress(sock, head)
        send_progress(sock, body)
    return len(head) + len(body)


def recv_exact(sock: socket.socket, n: int, *, at_frame_start: bool = False) -> bytearray:
    """Receive exactly n bytes; the socket timeout bounds each recv call (no progress), not
    the n bytes. Raises ConnectionClosed on EOF (truncated unless at_frame_start and
    nothing arrived); socket.timeout / OSError propagate."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        r = sock.recv_into(view[got:], min(n - got, RECV_QUANTUM))
        if r == 0:
            if at_frame_start and got == 0:
                raise ConnectionClosed("peer closed the connection")
            raise ConnectionClosed(f"connection closed mid-frame after {got} of {n} bytes")
        got += r
    return buf


def recv_frame(
    sock: socket.socket, max_meta: int = DEFAULT_MAX_META, max_body: int = DEFAULT_MAX_BODY
) -> Frame:
    """Receive one whole frame. Raises ProtocolError (malformed/oversized, checked before the
    body is allocated), ConnectionClosed (EOF), socket.timeout or OSError."""
    hdr = recv_exact(sock, HEADER_SIZE, at_frame_start=True)
    ftype, ml, bl = parse_header(bytes(hdr), max_meta, max_body)
    meta = parse_meta(recv_exact(sock, ml), max_meta) if ml else {}
    body = recv_exact(sock, bl) if bl else b""
    return Frame(ftype, meta, body)
