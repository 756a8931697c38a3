"""Timing a chunk's response on the wire: the socket wrapper `_WireClock` (kernel receive
timestamps) and `timed_get_chunk`, a store get with the clock around the
client's socket and a progress callback every PROGRESS_BYTES.

Separate from the load loop (streaming.load): this is the one place that reads the
socket's timestamps. Not runnable.
"""

from __future__ import annotations

import socket
import struct
import time

PROGRESS_BYTES = 64 * 1024  # the policy's should_abandon is asked after every this many bytes


class _WireClock:
    """Socket wrapper timing a response on the wire: kernel receive timestamps
    (SO_TIMESTAMPNS, Linux) of the first and the last read that returned bytes, so the
    goodput sample excludes the request latency, the server's read of the chunk and the
    receiver thread's own scheduling delays (CacheGen section 5.2 needs the network's
    throughput, not the receiver's back-pressure). Falls back to perf_counter at each read
    where the kernel gives no timestamp. Everything else is delegated to the socket.

    Wake-ups: every read sets the socket's receive low-water mark
    (SO_RCVLOWAT, Linux socket(7)) to the bytes it asks for, capped at LOWAT_MAX, so the
    receiver thread wakes once per ~128 KiB instead of once per arriving segment burst.
    On a shaped link the per-segment wake-ups (a Python loop taking the GIL each time) ran
    beside the decode on the same 2 cores and made the decode of the chunk being received
    alongside 4-6x slower at 500 Mbit/s (docs/vllm-connector.md, "Overlap"). Readers ask
    for exactly the bytes they still need (streaming.store.protocol.recv_exact), so a read never
    waits for bytes that are not coming; `restore()` puts the mark back to 1."""

    LOWAT_MAX = 1 << 17  # bytes

    def __init__(self, sock: socket.socket):
        self._s = sock
        self.first: float | None = None
        self.last: float | None = None
        self.first_bytes = 0
        self.nbytes = 0
        self.kernel = False
        self.reads = 0
        self._lowat = 1
        # callable(bytes received so far, bytes after the first read, wire_s() or None),
        # called every PROGRESS_BYTES
        self.on_progress = None
        self._checked = 0
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_TIMESTAMPNS, 1)
            self._ts = True
        except (OSError, AttributeError):
            self._ts = False

    def _set_lowat(self, n: int) -> None:
        n = max(1, min(int(n), self.LOWAT_MAX))
        if n == self._lowat or self._lowat is None:
            return
        try:
            self._s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, n)
            self._lowat = n
        except (OSError, AttributeError):
            self._lowat = None  # not supported here: plain reads

    def restore(self) -> None:
        """Low-water mark back to 1 byte (the socket outlives this wrapper)."""
        self._set_lowat(1)

    def recv_into(self, buf, nbytes: int = 0, flags: int = 0, _wait_all: bool = True) -> int:
        view = memoryview(buf)
        if nbytes:
            view = view[:nbytes]
        self._set_lowat(len(view) if _wait_all else 1)
        self.reads += 1
        if not self._ts:
            n = self._s.recv_into(view, 0, flags)
            t = time.perf_counter()
        else:
            n, anc, _, _ = self._s.recvmsg_into([view], 64, flags)
            t = None
            for level, typ, data in anc:
                if level == socket.SOL_SOCKET and typ == getattr(socket, "SCM_TIMESTAMPNS", -1) and len(data) >= 16:
                    sec, nsec = struct.unpack("qq", data[:16])
                    t = sec + nsec * 1e-9
                    self.kernel = True
            if t is None:
                t = time.time()
        if n:
            if self.first is None:
                self.first, self.first_bytes = t, n
            self.last = t
            self.nbytes += n
            if self.on_progress is not None and self.nbytes - self._checked >= PROGRESS_BYTES:
                self._checked = self.nbytes
                # may cut the connection: the next read fails
                self.on_progress(self.nbytes, self.nbytes - self.first_bytes, self.wire_s())
        return n

    def recv(self, n: int, flags: int = 0) -> bytes:
        buf = bytearray(n)
        got = self.recv_into(buf, n, flags, _wait_all=False)  # "up to n": no low-water mark
        return bytes(buf[:got])

    def wire_s(self) -> float | None:
        """Seconds from the first to the last byte of the response (None if < 2 reads)."""
        if self.first is None or self.last is None or self.last <= self.first:
            return None
        return self.last - self.first

    def __getattr__(self, name):
        return getattr(self._s, name)


def _get(cl, key: str, lv: int, k: int, gen: str | None):
    return cl.get_chunk(key, lv, k, gen=gen) if gen else cl.get_chunk(key, lv, k)


def timed_get_chunk(cl, key: str, lv: int, k: int, on_progress=None, gen: str | None = None):
    """cl.get_chunk (of write generation `gen`, the manifest's) with the wire clock around
    its socket -> (data, wire_s or None, bytes after the first read). Uses the
    StoreClient's socket when it exposes one. on_progress(bytes received so far) is called
    every PROGRESS_BYTES of the response."""
    if not hasattr(cl, "_sock") or not hasattr(cl, "connect"):
        return _get(cl, key, lv, k, gen), None, 0
    cl.connect()
    raw = cl._sock
    if not isinstance(raw, socket.socket):
        return _get(cl, key, lv, k, gen), None, 0
    w = _WireClock(raw)
    w.on_progress = on_progress
    cl._sock = w
    try:
        data = _get(cl, key, lv, k, gen)
    finally:
        if cl._sock is w:  # the client closes (sets None) on errors; keep that
            cl._sock = raw
            try:
                w.restore()
            except OSError:
                pass
    return data, w.wire_s(), w.nbytes - w.first_bytes
