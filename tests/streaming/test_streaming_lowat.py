"""The receiver's low-water mark (streaming.wire_clock._WireClock): reads of a frame
wake once per ~128 KiB, never wait for bytes that are not coming, and leave the socket's
mark at 1 byte afterwards."""
import socket
import sys
import threading
import time

import pytest

from streaming.wire_clock import _WireClock
from streaming.store.protocol import recv_exact

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_RCVLOWAT: Linux")


def _pair():
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    cli = socket.create_connection(srv.getsockname())
    peer, _ = srv.accept()
    srv.close()
    cli.settimeout(10.0)   # Python's timeout path (poll + non-blocking recv), as the store client
    return cli, peer


def _send_pieces(sock, data: bytes, piece: int):
    for i in range(0, len(data), piece):
        sock.sendall(data[i:i + piece])


def test_reads_whole_frame_with_a_short_tail_and_restores_the_mark():
    cli, peer = _pair()
    try:
        n = 3 * _WireClock.LOWAT_MAX + 1234          # tail shorter than the mark
        data = bytes((i * 7) & 0xFF for i in range(n))
        th = threading.Thread(target=_send_pieces, args=(peer, data, 1500))
        th.start()
        w = _WireClock(cli)
        got = recv_exact(w, n)
        th.join()
        assert bytes(got) == data
        assert w.nbytes == n
        # a read asks for at most 256 KiB and gets >= the 128 KiB mark (or the tail)
        assert w.reads <= 4
        # the last read asked for the rest of the frame: the mark is that many bytes
        assert 1 < cli.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) <= _WireClock.LOWAT_MAX
        w.restore()
        assert cli.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
    finally:
        cli.close()
        peer.close()


def test_recv_up_to_n_does_not_wait_for_n():
    cli, peer = _pair()
    try:
        peer.sendall(b"abc")
        w = _WireClock(cli)
        assert w.recv(1 << 16) == b"abc"
        assert cli.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
    finally:
        cli.close()
        peer.close()


def test_progress_reports_the_wire_clock_which_excludes_a_late_first_byte():
    """on_progress(bytes, bytes after the first read, wire_s): the wire clock starts at the
    first byte, so a stall before the response (here the sender holds it 0.3 s) is not in
    wire_s, whatever the load; the early abandon's rate comes from it (streaming.adapt)."""
    cli, peer = _pair()
    stall = 0.3
    go = threading.Event()
    try:
        data = bytes(range(256)) * (8 * 1024)  # 2 MiB

        def sender():
            go.wait(stall)  # the server's stall before its first byte
            _send_pieces(peer, data, 1 << 16)

        seen = []
        w = _WireClock(cli)
        w.on_progress = lambda n, wb, ws: seen.append((n, wb, ws, time.time()))
        t0 = time.time()
        th = threading.Thread(target=sender)
        th.start()
        got = recv_exact(w, len(data))
        th.join()
        assert bytes(got) == data
        assert seen and all(s[0] - s[1] == w.first_bytes for s in seen)
        for n, wb, ws, t in seen:
            if ws is not None:
                assert 0 < ws <= (t - t0) - stall + 0.005, (ws, t - t0)
        assert w.wire_s() is not None and w.wire_s() <= (time.time() - t0) - stall + 0.005
    finally:
        go.set()
        cli.close()
        peer.close()
