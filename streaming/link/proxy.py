"""The userspace shaper: a thread-safe token bucket (TokenBucket) and the loopback TCP
proxy that passes every byte through it (ShapingProxy), used by streaming.link when the
netns + tbf path is not available (method "userspace-tokenbucket").

Apart from the rate rules and shell helpers (streaming.link.rules): this module moves
bytes, that one only computes and configures. Re-exported by streaming.link.
"""

from __future__ import annotations

import socket
import threading
import time

from streaming.link.rules import MAX_PACING_QUANTUM, pacing_quantum


class TokenBucket:
    """Thread-safe token bucket: `rate` bytes/s refill, `burst` bytes capacity.

    consume(n) blocks until n tokens are available (n <= burst; callers pass <= 16 KiB).
    """

    def __init__(self, rate_bytes_s: float, burst: int):
        self._lock = threading.Lock()
        self.rate = float(rate_bytes_s)
        self.burst = int(burst)
        self._tokens = float(burst)
        self._t = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._t) * self.rate)
        self._t = now

    def set_rate(self, rate_bytes_s: float, burst: int | None = None) -> None:
        with self._lock:
            self._refill()
            self.rate = float(rate_bytes_s)
            if burst is not None:
                self.burst = int(burst)
                self._tokens = min(self._tokens, self.burst)

    def consume(self, n: int, stop: threading.Event | None = None) -> None:
        n = min(int(n), self.burst)
        while True:
            with self._lock:
                self._refill()
                if self._tokens >= n:
                    self._tokens -= n
                    return
                wait = (n - self._tokens) / self.rate
            if stop is not None and stop.is_set():
                return
            # This sleep is the shaper's pacing: it waits for the bucket to hold enough
            # tokens for the next quantum. The bytes themselves cross a real TCP connection;
            # this is not a stand-in for a network.
            time.sleep(min(max(wait, 0.0), 0.05))


class ShapingProxy:
    """Loopback TCP proxy: client <-> 127.0.0.1:listen_port <-> upstream server.

    Server->client bytes pass the `down` bucket, client->server bytes the `up` bucket; all
    connections share the buckets, as they would share a real link.
    """

    def __init__(self, upstream: tuple[str, int], down: TokenBucket, up: TokenBucket):
        self.upstream = upstream
        self.down, self.up = down, up
        self._stop = threading.Event()
        self._lsock = socket.create_server(("127.0.0.1", 0))
        self._lsock.settimeout(0.2)
        self.port = self._lsock.getsockname()[1]
        self._socks: set[socket.socket] = set()
        self._slock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name="cgh-proxy", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                c, _ = self._lsock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            try:
                s = socket.create_connection(self.upstream, timeout=5)
                s.settimeout(None)
            except OSError:
                c.close()
                continue
            for sk in (c, s):
                sk.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._slock:
                self._socks.update((c, s))
            threading.Thread(target=self._pump, args=(s, c, self.down), daemon=True).start()
            threading.Thread(target=self._pump, args=(c, s, self.up), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, bucket: TokenBucket) -> None:
        buf = bytearray(MAX_PACING_QUANTUM)
        view = memoryview(buf)
        try:
            while not self._stop.is_set():
                n = src.recv_into(view, pacing_quantum(bucket.rate))
                if n == 0:
                    dst.shutdown(socket.SHUT_WR)
                    return
                bucket.consume(n, self._stop)
                dst.sendall(view[:n])
        except OSError:
            for sk in (src, dst):
                try:
                    sk.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        finally:
            # the other direction's pump closes its pair when it ends too
            pass

    def close(self) -> None:
        self._stop.set()
        try:
            self._lsock.close()
        except OSError:
            pass
        with self._slock:
            for sk in self._socks:
                try:
                    sk.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sk.close()
            self._socks.clear()
        self._thread.join(timeout=2)
