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

The frame format itself (header, types, encode / decode from bytes) is in
streaming.store.protocol_frame (re-exported here); this module sends and receives frames on a
socket with the timeout applied to each call (lack of progress).
"""

from __future__ import annotations

import json
import socket

from streaming.errors import StreamingError
from streaming.store.protocol_frame import (  # noqa: F401  (re-exported: the frame format)
    DEFAULT_MAX_BODY,
    DEFAULT_MAX_META,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    _VALID_TYPES,
    Frame,
    FrameTooLarge,
    FrameType,
    decode_frame,
    encode_frame,
    encode_header,
    parse_header,
    parse_meta,
)

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
