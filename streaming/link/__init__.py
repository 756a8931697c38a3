"""A real rate-limited TCP link between the KV store server and the streaming client.

Paper: CacheGen section 5 streams KV chunks over a bandwidth-limited network; peers simulate
it with sleep(bytes*8/rate). Here the bytes cross a real TCP connection that is shaped:

* method "netns-tbf" (root + iproute2): the server runs in its own network namespace
  `cgh-<pid>-<rand>-srv`, joined to the root namespace by a veth pair `cg<pid>-<rnd>h` (root
  side) / `cg<pid>-<rnd>s` (server side) with a private /30 (10.x.y.z, chosen not to collide
  with any address or route on the host). A `tc qdisc tbf` on the server-side veth shapes
  server->client (the KV bytes), one on the root-side veth shapes client->server. The
  client (the engine process) stays in the root namespace and connects to the server
  namespace's address, so no engine process needs to enter a namespace.
* method "userspace-tokenbucket" (no privileges): the server listens on 127.0.0.1 and a
  loopback TCP proxy thread forwards its bytes to the client through a token bucket at the
  rate (real TCP on both sides; the bucket paces in quanta of 0.5 ms at the rate, 16-128 KiB).

No latency is added: `netem` is not available in this kernel (see docs/streaming.md).
Teardown on exit, on error, on SIGINT/SIGTERM/SIGHUP and at interpreter exit; a namespace
or veth left by a crashed run (owner pid dead) is removed by the next one (cleanup_stale).

Run: `python -m streaming.link --bandwidth-mbps 100` sets up a link, prints it, tears it down;
`python -m streaming.link --cleanup` removes stale namespaces/veths of dead runs.
The rate rules are in streaming.link.rules, the userspace shaper in streaming.link.proxy,
the leftover cleanup and the signal/exit teardown in streaming.link.cleanup.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import secrets
import subprocess
import sys
import threading

from cachegen_common import flags
from cachegen_common.units import check_bandwidth_mbps, mbps_to_bytes_per_s
from streaming.errors import LinkError
from streaming.link.cleanup import (  # noqa: F401 - re-exported
    LIVE_LINKS,
    install_handlers,
    kill_ns_pids,
    cleanup_stale,
    netns_available,
)
from streaming.link.proxy import TokenBucket, ShapingProxy  # noqa: F401 - re-exported
from streaming.link.rules import (  # noqa: F401 - the package's face
    METHOD_NETNS, METHOD_USERSPACE, METHOD_ALIASES, NS_PREFIX, NS_RE, VETH_RE, LOCK_PATH,
    PACING_QUANTUM, MAX_PACING_QUANTUM, pacing_quantum, TBF_LATENCY_MS, MTU_BYTES,
    TBF_BURST_MIN_BYTES, TBF_BURST_S, default_burst_bytes, USERSPACE_BURST_S,
    userspace_burst_bytes, run_cmd, pid_alive, used_networks, pick_subnet,
)


# --------------------------------------------------------------------------- the link
class ShapedLink:
    """A shaped TCP path from a server to this process, as a context manager.

    Args:
        bandwidth_mbps: the link's shaping rate in Mbit/s (10^6 bit/s), both directions,
            in (0, MAX_BANDWIDTH_MBPS] (cachegen_common.units.check_bandwidth_mbps).
        method: "auto" (netns-tbf when root with iproute2, else userspace-tokenbucket),
            "netns"/"netns-tbf" or "userspace"/"userspace-tokenbucket".
        burst_bytes: shaper burst in bytes (default: default_burst_bytes(bandwidth_mbps) for tbf,
            userspace_burst_bytes(bandwidth_mbps) for the token bucket).

    Attributes after __enter__: `method` (recorded in results), `bind_host` (address the
    server must listen on), `server_ns` (namespace name or None), `bandwidth_mbps` (Mbit/s).
    Use `expose(port)` to get the (host, port) a client connects to, `run_in_server_ns(argv)`
    to start the server, `set_rate(bandwidth_mbps)` to change the rate during a transfer.

    Raises LinkError if the requested method cannot be set up (auto falls back to
    userspace with a warning on stderr; the reason is kept in `fallback_reason`).
    """

    def __init__(self, bandwidth_mbps: float, method: str = "auto", burst_bytes: int | None = None):
        self.bandwidth_mbps = check_bandwidth_mbps(bandwidth_mbps)
        if method != "auto" and method not in METHOD_ALIASES:
            raise ValueError(f"unknown link method {method!r}: use auto, netns or userspace")
        self.requested_method = method
        self._fixed_burst = burst_bytes
        self.burst_bytes = burst_bytes or default_burst_bytes(self.bandwidth_mbps)
        self.method: str | None = None
        self.fallback_reason = ""
        self.server_ns: str | None = None
        self.veth_host: str | None = None
        self.veth_srv: str | None = None
        self.host_ip: str | None = None
        self.server_ip: str | None = None
        self.bind_host = "127.0.0.1"
        self._procs: list[subprocess.Popen] = []
        self._proxies: dict[int, ShapingProxy] = {}
        self._down: TokenBucket | None = None
        self._up: TokenBucket | None = None
        self._closed = False
        self._open = False
        self._lock = threading.Lock()
        self._owner_pid = os.getpid()  # a forked child must never tear down its parent's link

    # -- lifecycle
    def __enter__(self) -> "ShapedLink":
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> "ShapedLink":
        if self._open:
            return self
        want = self.requested_method
        if want == "auto":
            ok, reason = netns_available()
            want = METHOD_NETNS if ok else METHOD_USERSPACE
            if not ok:
                self.fallback_reason = reason
        else:
            want = METHOD_ALIASES[want]
        if want == METHOD_NETNS:
            ok, reason = netns_available()
            if not ok:
                raise LinkError(f"netns link unavailable: {reason}")
            try:
                self._open_netns()
            except LinkError as e:
                self._teardown_netns()
                if self.requested_method != "auto":
                    raise
                self.fallback_reason = str(e)
                print(f"streaming.link: netns setup failed ({e}); using userspace shaper", file=sys.stderr)
                want = METHOD_USERSPACE
        if want == METHOD_USERSPACE:
            self._open_userspace()
        self.method = want
        self._open = True
        return self

    def _open_userspace(self) -> None:
        rate_b = mbps_to_bytes_per_s(self.bandwidth_mbps)
        self.burst_bytes = self._fixed_burst or userspace_burst_bytes(self.bandwidth_mbps)
        self._down = TokenBucket(rate_b, self.burst_bytes)
        self._up = TokenBucket(rate_b, self.burst_bytes)
        self.bind_host = "127.0.0.1"
        install_handlers()
        LIVE_LINKS.add(self)

    def _open_netns(self) -> None:
        install_handlers()
        rng = secrets.SystemRandom()
        pid = os.getpid()
        with open(LOCK_PATH, "a+") as lockf:
            fcntl.flock(lockf, fcntl.LOCK_EX)
            try:
                cleanup_stale()
                tag = secrets.token_hex(2)[:3]
                self.server_ns = f"{NS_PREFIX}{pid}-{secrets.token_hex(3)}-srv"
                self.veth_host, self.veth_srv = f"cg{pid}-{tag}h", f"cg{pid}-{tag}s"
                LIVE_LINKS.add(self)  # from here on, teardown removes whatever was created
                net = pick_subnet(rng)
                hosts = list(net.hosts())
                self.host_ip, self.server_ip = str(hosts[0]), str(hosts[1])
                ns = self.server_ns
                run_cmd(["ip", "netns", "add", ns])
                run_cmd(["ip", "link", "add", self.veth_host, "type", "veth", "peer", "name", self.veth_srv, "netns", ns])
                run_cmd(["ip", "addr", "add", f"{self.host_ip}/30", "dev", self.veth_host])
                run_cmd(["ip", "link", "set", self.veth_host, "up"])
                run_cmd(["ip", "-n", ns, "addr", "add", f"{self.server_ip}/30", "dev", self.veth_srv])
                run_cmd(["ip", "-n", ns, "link", "set", self.veth_srv, "up"])
                run_cmd(["ip", "-n", ns, "link", "set", "lo", "up"])
            finally:
                fcntl.flock(lockf, fcntl.LOCK_UN)
        self._tc("add")
        self.bind_host = self.server_ip

    def _tbf_args(self) -> list[str]:
        return ["tbf", "rate", f"{self.bandwidth_mbps:.6g}mbit", "burst", str(self.burst_bytes),
                "latency", f"{TBF_LATENCY_MS}ms"]

    def _tc(self, verb: str) -> None:
        run_cmd(["ip", "netns", "exec", self.server_ns, "tc", "qdisc", verb, "dev", self.veth_srv, "root", *self._tbf_args()])
        run_cmd(["tc", "qdisc", verb, "dev", self.veth_host, "root", *self._tbf_args()])

    def _teardown_netns(self) -> None:
        if self.server_ns:
            kill_ns_pids(self.server_ns)
            run_cmd(["ip", "netns", "del", self.server_ns], check=False)
        if self.veth_host:
            run_cmd(["ip", "link", "del", self.veth_host], check=False)  # usually gone with the ns

    def close(self) -> None:
        """Stop processes started through the link, remove proxies, namespace and veth.
        Idempotent; safe from signal handlers and atexit."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if os.getpid() != self._owner_pid:
            return
        for p in self._procs:
            if p.poll() is None:
                p.terminate()
        for p in self._procs:
            try:
                p.wait(timeout=3)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=3)
        for px in self._proxies.values():
            px.close()
        self._proxies.clear()
        if self.method == METHOD_NETNS or self.server_ns:
            self._teardown_netns()
        LIVE_LINKS.discard(self)

    # -- use
    def _require_open(self) -> None:
        if not self._open or self._closed:
            raise LinkError("link is not open (use `with ShapedLink(...) as link:`)")

    def run_in_server_ns(self, argv: list[str], **popen_kw) -> subprocess.Popen:
        """Start a process on the server side of the link (inside the server namespace for
        netns; a plain child for userspace). It is terminated when the link closes."""
        self._require_open()
        full = ["ip", "netns", "exec", self.server_ns, *argv] if self.method == METHOD_NETNS else list(argv)
        p = subprocess.Popen(full, **popen_kw)
        self._procs.append(p)
        return p

    def expose(self, port: int) -> tuple[str, int]:
        """(host, port) through which this process reaches a server listening on
        (bind_host, port) behind the shaped link."""
        self._require_open()
        if self.method == METHOD_NETNS:
            return self.server_ip, int(port)
        with self._lock:
            px = self._proxies.get(int(port))
            if px is None:
                px = ShapingProxy(("127.0.0.1", int(port)), self._down, self._up)
                self._proxies[int(port)] = px
        return "127.0.0.1", px.port

    def set_rate(self, bandwidth_mbps: float) -> None:
        """Change the shaping rate to `bandwidth_mbps` Mbit/s now, e.g. during a transfer (tc
        qdisc change / token-bucket rate); checked by check_bandwidth_mbps (ValueError). Burst
        follows default_burst_bytes unless fixed at construction."""
        self._require_open()
        r = check_bandwidth_mbps(bandwidth_mbps)
        self.bandwidth_mbps = r
        if self.method == METHOD_NETNS:
            self.burst_bytes = self._fixed_burst or default_burst_bytes(r)
            self._tc("change")
        else:
            self.burst_bytes = self._fixed_burst or userspace_burst_bytes(r)
            for b in (self._down, self._up):
                b.set_rate(mbps_to_bytes_per_s(r), self.burst_bytes)

    def describe(self) -> dict:
        """JSON-able description recorded with every result. burst_bytes / burst_s: the
        shaper's token-bucket burst (a transfer after idle gets this many bytes at line
        speed); burst_rule: how it was sized."""
        rule = ("fixed by the caller" if self._fixed_burst else
                f"max({TBF_BURST_MIN_BYTES} B = 10 MTU frames, {TBF_BURST_S * 1e3:g} ms at the rate)"
                if self.method == METHOD_NETNS else
                f"max(2 pacing quanta, {USERSPACE_BURST_S * 1e3:g} ms at the rate)")
        return {
            "method": self.method,
            "rate_mbps": self.bandwidth_mbps,  # the committed result files' key (benchmarks/*.json)
            "burst_bytes": self.burst_bytes,
            "burst_s": round(self.burst_bytes / mbps_to_bytes_per_s(self.bandwidth_mbps), 6),
            "burst_rule": rule,
            "burst_min_bytes": None if self._fixed_burst else (
                TBF_BURST_MIN_BYTES if self.method == METHOD_NETNS
                else 2 * pacing_quantum(mbps_to_bytes_per_s(self.bandwidth_mbps))),
            "burst_rate_s": 0.0 if self._fixed_burst else (
                TBF_BURST_S if self.method == METHOD_NETNS else USERSPACE_BURST_S),
            "added_latency_ms": 0,
            "server_ns": self.server_ns,
            "server_ip": self.server_ip,
            "fallback_reason": self.fallback_reason or None,
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m streaming.link",
                                 description="Set up / inspect / clean the shaped link.")
    flags.add_bandwidth(ap, default=100.0)
    flags.add_link_method(ap)
    ap.add_argument("--cleanup", action="store_true", help="only remove stale namespaces/veths")
    a = ap.parse_args(argv)
    if a.cleanup:
        print(json.dumps({"removed": cleanup_stale()}))
        return 0
    try:
        with ShapedLink(a.bandwidth_mbps, a.link_method) as link:
            print(json.dumps(link.describe()))
    except (LinkError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0

