"""Protocol round trips and fuzzed frames (streaming.store.protocol); server survives bad frames."""

import socket
import struct
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streaming.store.folder import LocalFolderBackend
from streaming.errors import ProtocolError
from streaming.store.protocol import (
    HEADER, HEADER_SIZE, MAGIC, ConnectionClosed, FrameType, decode_frame, encode_frame,
    recv_frame, send_frame,
)
from streaming.store import KVStoreServer, StoreClient


@pytest.mark.parametrize("ftype", list(FrameType))
def test_round_trip_every_type(ftype):
    meta = {"key": "ab" * 32, "level": 2, "index": 7, "nested": {"x": [1, 2]}}
    body = bytes(range(256)) * 3
    buf = encode_frame(ftype, meta, body)
    f, used = decode_frame(buf + b"trailing")
    assert used == len(buf)
    assert f.type == ftype and f.meta == meta and f.body == body


def test_round_trip_over_socket_large_body():
    a, b = socket.socketpair()
    body = bytes(3_000_000)
    with a, b:
        import threading
        t = threading.Thread(target=send_frame, args=(a, FrameType.OK, {"bytes": len(body)}, body))
        t.start()
        f = recv_frame(b)
        t.join()
    assert f.type == FrameType.OK and len(f.body) == len(body) and f.meta == {"bytes": len(body)}


def test_oversized_lengths_rejected_before_allocation():
    hdr = HEADER.pack(MAGIC, FrameType.GET_CHUNK, 10, 1 << 60)
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_frame(hdr)
    hdr = HEADER.pack(MAGIC, FrameType.GET_CHUNK, 1 << 31, 0)
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_frame(hdr)
    a, b = socket.socketpair()
    with a, b:  # only the header is sent: a parser that allocated first would block or OOM
        a.sendall(HEADER.pack(MAGIC, FrameType.OK, 0, 1 << 40))
        with pytest.raises(ProtocolError, match="exceeds"):
            recv_frame(b, max_body=1 << 20)


@pytest.mark.parametrize("bad", [
    b"XXXX" + bytes(13),  # magic
    HEADER.pack(MAGIC, 0x55, 0, 0),  # unknown type
    HEADER.pack(MAGIC, 1, 3, 0) + b"[1]",  # meta not an object
    HEADER.pack(MAGIC, 1, 2, 0) + b"\xff\xfe",  # not UTF-8
    HEADER.pack(MAGIC, 1, 5, 0) + b"{bad}",  # not JSON
    HEADER.pack(MAGIC, 1, 0, 10) + b"short",  # truncated body
    b"CGKV\x01",  # truncated header
])
def test_malformed_frames(bad):
    with pytest.raises(ProtocolError):
        decode_frame(bad)


def test_truncated_stream_is_connection_closed():
    a, b = socket.socketpair()
    with b:
        a.sendall(encode_frame(FrameType.OK, {"a": 1}, b"x" * 100)[:-10])
        a.close()
        with pytest.raises(ConnectionClosed, match="mid-frame"):
            recv_frame(b)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_fuzz_random_bytes(data):
    try:
        f, used = decode_frame(data, max_body=1 << 16)
    except ProtocolError:
        return
    assert HEADER_SIZE <= used <= len(data) and isinstance(f.meta, dict)


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 200), st.integers(0, 255), st.data())
def test_fuzz_mutated_valid_frames(pos, val, data):
    buf = bytearray(encode_frame(FrameType.GET_CHUNK, {"key": "k", "level": 1, "index": 2}, b"payload"))
    pos %= len(buf)
    buf[pos] = val
    cut = data.draw(st.integers(0, len(buf)))
    try:
        f, _ = decode_frame(bytes(buf[:cut]), max_body=1 << 16)
    except ProtocolError:
        return
    assert isinstance(f.type, FrameType) and isinstance(f.meta, dict)


def test_server_answers_garbage_with_err_and_keeps_serving():
    with tempfile.TemporaryDirectory() as d:
        srv = KVStoreServer(LocalFolderBackend(d))
        srv.start_thread()
        try:
            s = socket.create_connection(srv.address, timeout=5)
            s.sendall(b"GARBAGE-GARBAGE-GARBAGE")
            f = recv_frame(s)
            assert f.type == FrameType.ERR and "protocol error" in f.meta["error"]
            s.close()
            s = socket.create_connection(srv.address, timeout=5)  # huge length: refused, no alloc
            s.sendall(struct.pack("<4sBIQ", MAGIC, FrameType.PUT_CHUNK, 0, 1 << 62))
            assert recv_frame(s).type == FrameType.ERR
            s.close()
            with StoreClient(*srv.address, timeout=5) as c:
                assert c.ping()
                assert c.get_manifest("0" * 64) is None and c.last_miss_reason == "unknown key"
        finally:
            srv.shutdown()
            srv.server_close()
