"""The shaped link's rate rules (methods, tbf and token-bucket burst sizes, pacing quanta), its
shell helpers and subnet choice, and the userspace shaper (TokenBucket, _ShapingProxy).
Split out of streaming.link (issue 27), which re-exports every name; the design is
described there.
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import socket
import subprocess
import threading
import time

from common.units import mbps_to_bytes_per_s
from streaming.errors import LinkError


METHOD_NETNS = "netns-tbf"
METHOD_USERSPACE = "userspace-tokenbucket"
_METHOD_ALIASES = {
    "netns": METHOD_NETNS,
    METHOD_NETNS: METHOD_NETNS,
    "userspace": METHOD_USERSPACE,
    METHOD_USERSPACE: METHOD_USERSPACE,
}
NS_PREFIX = "cgh-"
_NS_RE = re.compile(r"^cgh-(\d+)-([0-9a-f]+)-srv$")
_VETH_RE = re.compile(r"^cg(\d+)-([0-9a-f]{3})[hs]$")
_LOCK_PATH = "/tmp/cgh-link.lock"
PACING_QUANTUM = 16 * 1024  # userspace shaper releases bytes in quanta of at least 16 KiB
MAX_PACING_QUANTUM = 128 * 1024  # ... and at most 128 KiB (1 ms at 1 Gbit/s)


def pacing_quantum(rate_bytes_s: float) -> int:
    """Bytes released per token-bucket step: 0.5 ms at the rate, clamped to [16, 128] KiB
    (fewer Python steps at high rates keep the userspace shaper off the CPU limit)."""
    return int(min(MAX_PACING_QUANTUM, max(PACING_QUANTUM, rate_bytes_s * 0.0005)))
TBF_LATENCY_MS = 50  # tbf queue depth in time: deep enough for TCP at the rate, bounded


MTU_BYTES = 1514  # Ethernet frame on the veth (1500 + header)
TBF_BURST_MIN_BYTES = 10 * MTU_BYTES  # a few frames: tbf must hold whole frames
TBF_BURST_S = 0.001  # tbf burst = 1 ms at the rate (above the minimum)


def default_burst_bytes(rate_mbps: float) -> int:
    """tbf burst: max(10 MTU-sized frames, 1 ms at the rate), bytes.

    The burst lets a transfer that starts on a full bucket run faster than the rate: a
    transfer of N bytes after idle takes (N - burst)/rate. Sized to the rate (1 ms) it
    inflates a 96 KiB transfer by 1.18x at 100 Mbit/s and 1.15x at 1 Gbit/s (was 32 KiB or
    2 ms: 1.33-1.40x measured). The burst is recorded in ShapedLink.describe() so that a
    goodput estimator can correct for it (streaming.adapt.ThroughputEstimator).
    """
    return max(TBF_BURST_MIN_BYTES, int(mbps_to_bytes_per_s(rate_mbps) * TBF_BURST_S))


USERSPACE_BURST_S = 0.005  # userspace token bucket: 5 ms at the rate


def userspace_burst_bytes(rate_mbps: float) -> int:
    """Token-bucket burst for the userspace shaper: max(2 pacing quanta, 5 ms at the rate).

    Two quanta let the pacing thread release one quantum while the next accrues; 5 ms covers
    a late wake-up on a busy machine. (Was max(64 KiB, 10 ms): short transfers after idle
    measured 2.9-9x the rate.)
    """
    rate_b = mbps_to_bytes_per_s(rate_mbps)
    return max(2 * pacing_quantum(rate_b), int(rate_b * USERSPACE_BURST_S))


def _check_rate(rate_mbps: float) -> float:
    r = float(rate_mbps)
    if not (r > 0 and r < 1e6):
        raise ValueError(f"rate must be in (0, 1e6) Mbit/s, got {rate_mbps}")
    return r


# --------------------------------------------------------------------------- shell helpers
def _run(argv: list[str], check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    try:
        cp = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LinkError(f"{' '.join(argv)}: {e}") from None
    if check and cp.returncode != 0:
        raise LinkError(f"{' '.join(argv)} failed ({cp.returncode}): {cp.stderr.strip()}")
    return cp


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _used_networks() -> list[ipaddress.IPv4Network]:
    nets = []
    cp = _run(["ip", "-o", "-4", "addr", "show"], check=False)
    for m in re.finditer(r"inet (\d+\.\d+\.\d+\.\d+/\d+)", cp.stdout):
        nets.append(ipaddress.ip_interface(m.group(1)).network)
    cp = _run(["ip", "-4", "route", "show", "table", "all"], check=False)
    for line in cp.stdout.splitlines():
        tok = line.split()
        for t in tok[:2]:
            try:
                if "/" in t:
                    nets.append(ipaddress.ip_network(t, strict=False))
                    break
            except ValueError:
                continue
    return nets


def _pick_subnet(rng: secrets.SystemRandom) -> ipaddress.IPv4Network:
    used = _used_networks()
    for _ in range(200):
        net = ipaddress.ip_network(
            f"10.{rng.randint(200, 254)}.{rng.randint(0, 255)}.{rng.randint(0, 63) * 4}/30"
        )
        if not any(net.overlaps(u) for u in used):
            return net
    raise LinkError("could not find a free 10.x.y.z/30 for the veth pair")


# --------------------------------------------------------------------------- userspace shaper
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


class _ShapingProxy:
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
