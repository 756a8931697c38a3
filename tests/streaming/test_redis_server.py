"""streaming.store.redis_server: a real redis-server with a unique port and folder.

Skipped (with the reason) only when redis-server is not installed.
Run: python -m pytest tests/streaming/test_redis_server.py -q
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from streaming.store import redis_server as rs
from streaming.store.redis_server import RedisNotInstalledError, RedisServer, RedisServerError, parse_memory

needs_redis = pytest.mark.skipif(
    rs.find_redis_server() is None,
    reason="redis-server not installed (apt-get install redis-server, or bash scripts/setup.sh)",
)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); read its state
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_parse_memory():
    assert parse_memory(None) is None
    assert parse_memory(4096) == 4096
    assert parse_memory("4mb") == 4 * 1024 * 1024
    assert parse_memory("512kb") == 512 * 1024
    assert parse_memory("1g") == 10**9
    for bad in ("", "4 parsecs", "-1", "0", 0, True, "1.5mb"):
        with pytest.raises(ValueError):
            parse_memory(bad)


def test_bad_arguments():
    with pytest.raises(ValueError, match="eviction policy"):
        RedisServer(policy="most-recently-used")
    with pytest.raises(ValueError, match="port"):
        RedisServer(port=70000)
    with pytest.raises(ValueError, match="host"):
        RedisServer(netns_runner=["ip", "netns", "exec", "x"])


def test_not_installed_gives_install_hint(monkeypatch):
    monkeypatch.setattr(rs, "find_redis_server", lambda: None)
    with pytest.raises(RedisNotInstalledError, match="apt-get install redis-server"):
        RedisServer().start()


@needs_redis
def test_config_and_lifecycle():
    import redis

    with RedisServer(maxmemory="8mb") as a, RedisServer() as b:
        assert a.port != b.port and a.dir != b.dir  # unique per server
        conf = (a.dir / "redis.conf").read_text()
        assert "bind 127.0.0.1\n" in conf
        assert 'save ""' in conf and "appendonly no" in conf  # no persistence by default
        assert "protected-mode yes" in conf  # only off inside a namespace
        mem = a.info("memory")
        assert mem["maxmemory"] == 8 * 1024 * 1024 and mem["maxmemory_policy"] == "allkeys-lru"
        assert b.info("memory")["maxmemory"] == 0
        assert a.url == f"redis://127.0.0.1:{a.port}/0"
        c = redis.Redis.from_url(a.url)
        assert c.ping()
        c.close()
        pid, folder = a.pid, a.dir
    assert not pid_alive(pid), "redis-server still running after the context exit"
    assert not folder.exists(), "data folder left behind"


@needs_redis
def test_kill_and_stop():
    srv = RedisServer().start()
    pid, folder = srv.pid, srv.dir
    srv.kill()
    assert not srv.running() and not pid_alive(pid)
    assert folder.exists()  # kept for post-mortem until stop()
    srv.stop()
    assert not folder.exists()


@needs_redis
def test_port_in_use_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(RedisServerError, match="did not start"):
            RedisServer(port=port, startup_timeout_s=5).start()


@needs_redis
def test_cli_bad_size_exits_2():
    cp = subprocess.run([sys.executable, "-m", "streaming.store.redis_server", "--maxmemory", "lots"],
                        capture_output=True, text=True, timeout=60)
    assert cp.returncode == 2 and "error:" in cp.stderr and "Traceback" not in cp.stderr


@needs_redis
def test_behind_userspace_link():
    """link= with the userspace shaper: the URL is the shaper's port, not Redis's own."""
    from streaming.link import ShapedLink
    from streaming.store.redis_backend import RedisBackend

    with ShapedLink(1000, method="userspace") as link, RedisServer(link=link) as srv:
        assert srv.url != srv.direct_url
        with RedisBackend(srv.url) as b:
            b.put("k", b"x" * 100_000)
            assert b.get("k") == b"x" * 100_000


def _netns_ok() -> tuple[bool, str]:
    try:
        from streaming.link import netns_available
    except ImportError as e:
        return False, str(e)
    return netns_available()


@needs_redis
@pytest.mark.skipif(not _netns_ok()[0], reason=f"network namespaces unavailable: {_netns_ok()[1]}")
def test_inside_link_namespace_by_argv_prefix():
    """The server runs inside the link's server namespace (argv prefix `ip netns exec NS`),
    binds the namespace address with protected-mode off, and is reached through the veth."""
    from streaming.link import ShapedLink
    from streaming.store.redis_backend import RedisBackend

    with ShapedLink(1000, method="netns") as link:
        runner = ["ip", "netns", "exec", link.server_ns]
        with RedisServer(netns_runner=runner, host=link.server_ip) as srv:
            conf = (srv.dir / "redis.conf").read_text()
            assert f"bind {link.server_ip}\n" in conf and "protected-mode no" in conf
            assert srv.url == f"redis://{link.server_ip}:{srv.port}/0"
            ns_pids = subprocess.run(["ip", "netns", "pids", link.server_ns], capture_output=True,
                                     text=True).stdout.split()
            assert str(srv.pid) in ns_pids  # really inside the namespace
            with RedisBackend(srv.url) as b:
                b.put("k", b"v" * 1000)
                assert b.get("k") == b"v" * 1000
            pid = srv.pid
        assert not pid_alive(pid)
        # loopback of the root namespace does not reach it
        with RedisServer(link=link) as srv2:
            with pytest.raises(OSError):
                socket.create_connection(("127.0.0.1", srv2.port), timeout=1).close()


def test_stale_folder_of_a_dead_owner_is_removed(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # a pid that no longer exists
    stale = tmp_path / "cg-redis-stale"
    stale.mkdir()
    (stale / "owner.pid").write_text(f"{p.pid}\n")
    mine = tmp_path / "cg-redis-mine"
    mine.mkdir()
    (mine / "owner.pid").write_text(f"{os.getpid()}\n")
    foreign = tmp_path / "cg-redis-foreign"  # no owner file: not touched
    foreign.mkdir()
    assert rs.cleanup_stale_dirs(tmp_path) == [str(stale)]
    assert mine.exists() and foreign.exists() and not stale.exists()


@needs_redis
def test_server_does_not_outlive_a_killed_harness(tmp_path):
    """SIGKILL the process that started redis-server: PR_SET_PDEATHSIG stops the server."""
    code = ("import sys, time; from streaming.store.redis_server import RedisServer; "
            "s = RedisServer(tmp_root=sys.argv[1]).start(); print(s.pid, flush=True); time.sleep(60)")
    env = dict(os.environ, PYTHONPATH=str(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
    harness = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                               text=True, env=env)
    try:
        pid = int(harness.stdout.readline())
        assert pid_alive(pid)
    finally:
        harness.kill()
        harness.wait()
    import time

    deadline = time.monotonic() + 10
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = pid_alive(pid)
    if alive:
        os.kill(pid, 9)
    assert not alive, "redis-server outlived its harness"
    rs.cleanup_stale_dirs(tmp_path)
    assert not list(tmp_path.glob("cg-redis-*"))
