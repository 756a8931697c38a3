"""ShapedLink: bytes pass intact and shaped, rate changes, teardown on exit / error /
signal, stale leftovers removed. netns tests skip with a reason when not root."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from streaming import link as linkmod
from streaming.link import METHOD_NETNS, METHOD_USERSPACE, ShapedLink, TokenBucket, cleanup_stale, netns_available

NETNS_OK, NETNS_WHY = netns_available()
needs_root = pytest.mark.skipif(not NETNS_OK, reason=f"netns link needs root + iproute2: {NETNS_WHY}")
ROOT = Path(__file__).resolve().parents[2]


def _echo_upper_server(host):
    """Server bound on the server side: replies with N bytes pattern after reading a u32 N."""
    srv = socket.create_server((host, 0))

    def run():
        c, _ = srv.accept()
        with c:
            n = int.from_bytes(c.recv(4), "little")
            c.sendall(bytes(i % 251 for i in range(n)))
        srv.close()

    threading.Thread(target=run, daemon=True).start()
    return srv.getsockname()[1]


def _fetch(addr, n):
    with socket.create_connection(addr, timeout=20) as s:
        t = time.perf_counter()
        s.sendall(n.to_bytes(4, "little"))
        buf = bytearray()
        while len(buf) < n:
            d = s.recv(1 << 16)
            if not d:
                break
            buf += d
        return bytes(buf), time.perf_counter() - t


def test_userspace_bytes_intact_and_shaped():
    with ShapedLink(20, method="userspace") as link:
        assert link.method == METHOD_USERSPACE and link.describe()["method"] == METHOD_USERSPACE
        port = _echo_upper_server(link.bind_host)
        data, dt = _fetch(link.expose(port), 1_000_000)
    assert data == bytes(i % 251 for i in range(1_000_000))
    # 1 MB at 20 Mbit/s is 0.4 s on the wire; only the 32 KiB bucket burst (2 pacing quanta)
    # may pass early
    assert link.burst_bytes == 32768 and dt >= (1_000_000 - 40_000) * 8 / 20e6
    d = link.describe()
    assert d["burst_bytes"] == 32768 and d["burst_s"] == pytest.approx(32768 / 2.5e6, abs=1e-6) and "quanta" in d["burst_rule"]


def test_burst_sized_to_the_rate():
    from streaming.link import default_burst_bytes, userspace_burst_bytes

    # tbf: max(10 MTU frames, 1 ms at the rate)
    assert default_burst_bytes(10) == 15140 and default_burst_bytes(100) == 15140
    assert default_burst_bytes(1000) == 125_000
    # userspace bucket: max(2 pacing quanta, 5 ms at the rate)
    assert userspace_burst_bytes(20) == 32768 and userspace_burst_bytes(1000) == 625_000


def test_token_bucket_rate_change():
    b = TokenBucket(1e6, 16384)
    b.set_rate(5e6, 65536)
    assert b.rate == 5e6 and b.burst == 65536
    with pytest.raises(ValueError):
        ShapedLink(0)
    with pytest.raises(ValueError, match="unknown link method"):
        ShapedLink(10, method="carrier-pigeon")


def test_link_rate_is_bandwidth_mbps_with_the_one_bound(monkeypatch):
    """The link's rate is named bandwidth_mbps (Mbit/s) and bounded by check_bandwidth_mbps
    at construction and in set_rate; describe() keeps the result files' "rate_mbps" key."""
    from cachegen_common.units import MAX_BANDWIDTH_MBPS

    for bad in (0, -1, float("nan"), MAX_BANDWIDTH_MBPS * 2, "fast"):
        with pytest.raises(ValueError, match="bandwidth_mbps"):
            ShapedLink(bandwidth_mbps=bad)
    monkeypatch.setattr(linkmod, "netns_available", lambda: (False, "not running as root"))
    with ShapedLink(bandwidth_mbps=40) as link:
        assert link.bandwidth_mbps == 40.0 and link.describe()["rate_mbps"] == 40.0
        link.set_rate(bandwidth_mbps=80)
        assert link.bandwidth_mbps == 80.0
        with pytest.raises(ValueError, match="bandwidth_mbps"):
            link.set_rate(MAX_BANDWIDTH_MBPS * 2)
        assert link.bandwidth_mbps == 80.0


def test_auto_falls_back_to_userspace_without_root(monkeypatch):
    monkeypatch.setattr(linkmod, "netns_available", lambda: (False, "not running as root"))
    with ShapedLink(50) as link:
        assert link.method == METHOD_USERSPACE and "root" in link.fallback_reason


def _ns_exists(name):
    return name in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def _link_exists(name):
    return subprocess.run(["ip", "link", "show", name], capture_output=True).returncode == 0


@needs_root
def test_netns_bytes_intact_shaped_and_torn_down():
    with ShapedLink(20, method="netns") as link:
        ns, veth = link.server_ns, link.veth_host
        assert link.method == METHOD_NETNS and _ns_exists(ns) and _link_exists(veth)
        assert link.server_ip.startswith("10.") and link.bind_host == link.server_ip
        q = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", link.veth_srv],
                           capture_output=True, text=True).stdout
        assert "tbf" in q and "20Mbit" in q
        p = link.run_in_server_ns([sys.executable, "-c", (
            "import socket,sys;s=socket.create_server((sys.argv[1],0));print(s.getsockname()[1],flush=True);"
            "c,_=s.accept();n=int.from_bytes(c.recv(4),'little');c.sendall(bytes(i%251 for i in range(n)))"),
            link.bind_host], stdout=subprocess.PIPE, text=True)
        port = int(p.stdout.readline())
        data, dt = _fetch(link.expose(port), 1_000_000)
        assert data == bytes(i % 251 for i in range(1_000_000))
        assert dt >= (1_000_000 - 40_000) * 8 / 20e6
        link.set_rate(300)
        q = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", link.veth_srv],
                           capture_output=True, text=True).stdout
        assert "300Mbit" in q
    assert p.poll() is not None  # processes started through the link are stopped
    time.sleep(0.3)  # veth deletion after the namespace goes is asynchronous in the kernel
    assert not _ns_exists(ns) and not _link_exists(veth)


@needs_root
def test_netns_torn_down_on_error():
    with pytest.raises(RuntimeError, match="boom"):
        with ShapedLink(50, method="netns") as link:
            ns = link.server_ns
            raise RuntimeError("boom")
    assert not _ns_exists(ns)


@needs_root
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_netns_torn_down_on_signal(sig):
    code = ("import time\nfrom streaming.link import ShapedLink\n"
            "with ShapedLink(50, method='netns') as l:\n    print(l.server_ns, flush=True)\n    time.sleep(60)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    ns = p.stdout.readline().strip()
    assert ns.startswith("cgh-") and _ns_exists(ns)
    p.send_signal(sig)
    p.wait(timeout=20)
    assert not _ns_exists(ns)
    if sig != signal.SIGINT:  # SIGTERM/SIGHUP unwind as SystemExit(128 + signal number)
        assert p.returncode == 128 + sig


@needs_root
def test_cleanup_stale_removes_dead_owner_leftovers():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid is now free (a fresh pid reuse within this test is very unlikely)
    ns, veth = f"cgh-{dead.pid}-abc123-srv", f"cg{dead.pid}-abch"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    subprocess.run(["ip", "link", "add", veth, "type", "veth", "peer", "name", f"cg{dead.pid}-abcs"], check=True)
    try:
        removed = cleanup_stale()
        assert ns in removed and veth in removed
        time.sleep(0.2)
        assert not _ns_exists(ns) and not _link_exists(veth)
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", veth], capture_output=True)
