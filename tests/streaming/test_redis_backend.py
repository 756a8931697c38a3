"""streaming.store.redis_backend against a real redis-server started by the tests.

Round trip of a multi-chunk context, prefetching reads, two processes sharing one Redis,
concurrent identical writers, eviction under a small maxmemory, and faults: Redis down at
start, killed mid-load, frozen (socket timeouts). Skipped (with the reason) only when
redis-server is not installed. Run: python -m pytest tests/streaming/test_redis_backend.py -q
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from streaming.store.backend import StoreBackend, open_backend
from streaming.errors import StoreError
from streaming.store.redis_backend import FetchedValue, RedisBackend, RedisUnavailableError, parse_redis_url
from streaming.store.redis_server import RedisServer, find_redis_server, free_port

pytestmark = pytest.mark.skipif(
    find_redis_server() is None,
    reason="redis-server not installed (apt-get install redis-server, or bash scripts/setup.sh)",
)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server():
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def backend(server):
    b = RedisBackend(server.url)
    b._client.flushdb()
    yield b
    b.close()


def _chunks(n: int, size: int, seed: int = 0) -> list[bytes]:
    """n pseudo-random values of about `size` bytes (sizes differ, as encoded chunks do)."""
    out = []
    for i in range(n):
        h = hashlib.sha256(f"{seed}-{i}".encode()).digest()
        out.append((h * (size // 32 + i + 1))[: size + 37 * i])
    return out


def test_bad_urls():
    assert parse_redis_url("redis://h:7000/3") == ("h", 7000, 3)
    assert parse_redis_url("redis://h") == ("h", 6379, 0)
    for bad in ("http://h:1/0", "redis://h:port/0", "redis://h:1/db", "redis://:1/0"):
        with pytest.raises(ValueError, match="redis://HOST:PORT/DB"):
            RedisBackend(bad, check=False)


def test_protocol_and_open_backend(server):
    b = open_backend(server.url)
    assert isinstance(b, RedisBackend) and isinstance(b, StoreBackend)
    b.close()


def test_round_trip_multi_chunk(backend):
    ctx = "m/abc/cachegen-L2/0123"
    chunks = _chunks(5, 300_000)
    for i, c in enumerate(chunks):
        backend.put(f"{ctx}/chunk/{i}", c)
    backend.put(f"{ctx}/manifest", b'{"n": 5}')
    assert backend.get(f"{ctx}/chunk/3") == chunks[3]
    assert backend.exists(f"{ctx}/manifest") and not backend.exists(f"{ctx}/nothing")
    assert backend.get("absent") is None
    keys = [f"{ctx}/chunk/{i}" for i in range(5)]
    got = list(backend.get_many_iter(keys))
    assert [k for k, _ in got] == keys and [d for _, d in got] == chunks
    assert backend.get_many(keys + ["absent"]) == chunks + [None]
    timed = list(backend.get_many_iter(keys + ["absent"], depth=1, with_timing=True))
    assert all(isinstance(t, FetchedValue) for t in timed)
    assert timed[-1].data is None and all(t.fetch_s >= 0 and t.wait_s >= 0 for t in timed)
    assert sorted(backend.keys(ctx)) == sorted(keys + [f"{ctx}/manifest"])
    backend.delete(f"{ctx}/chunk/0")
    backend.delete(f"{ctx}/chunk/0")  # absent: no error
    assert backend.get(f"{ctx}/chunk/0") is None


def test_keys_prefix_is_literal_and_namespaced(backend, server):
    backend.put("a*b", b"1")
    backend.put("a[1]", b"2")
    backend.put("ab", b"3")
    assert sorted(backend.keys("a*")) == ["a*b"]
    assert sorted(backend.keys("a[")) == ["a[1]"]
    assert sorted(backend.keys("a")) == ["a*b", "a[1]", "ab"]
    other = RedisBackend(server.url, key_prefix="other:")
    other.put("ab", b"x")
    assert backend.get("ab") == b"3" and sorted(other.keys()) == ["ab"]
    other.close()


def test_put_if_absent_and_transaction(backend):
    assert backend.put_if_absent("man", b"A") is True
    assert backend.put_if_absent("man", b"B") is False
    assert backend.get("man") == b"A"
    backend.put_many([("c/0", b"x"), ("c/1", b"y"), ("c/manifest", b"m")])
    assert backend.get_many(["c/0", "c/1", "c/manifest"]) == [b"x", b"y", b"m"]


def test_prefetch_iterator_closed_early(backend):
    chunks = _chunks(6, 100_000)
    keys = [f"e/{i}" for i in range(6)]
    backend.put_many(zip(keys, chunks))
    it = backend.get_many_iter(keys, depth=2)
    assert next(it) == (keys[0], chunks[0])
    it.close()  # stops the reader thread; the connection pool stays usable
    assert backend.get(keys[5]) == chunks[5]


_WRITER = textwrap.dedent(
    """
    import hashlib, sys
    from streaming.store.redis_backend import RedisBackend
    url, ctx, n, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    b = RedisBackend(url)
    chunks = []
    for i in range(n):
        h = hashlib.sha256(f"{ctx}-{i}".encode()).digest()
        chunks.append(h * (size // 32))
    for i, c in enumerate(chunks):   # chunks first ...
        b.put(f"{ctx}/chunk/{i}", c)
    manifest = ",".join(hashlib.sha256(c).hexdigest() for c in chunks).encode()
    wrote = b.put_if_absent(f"{ctx}/manifest", manifest)   # ... manifest last, SET NX
    print("wrote" if wrote else "existed")
    """
)
_READER = textwrap.dedent(
    """
    import hashlib, sys
    from streaming.store.redis_backend import RedisBackend
    url, ctx = sys.argv[1], sys.argv[2]
    b = RedisBackend(url)
    man = b.get(f"{ctx}/manifest")
    if man is None:
        print("miss"); sys.exit(0)
    want = man.decode().split(",")
    keys = [f"{ctx}/chunk/{i}" for i in range(len(want))]
    for (k, d), h in zip(b.get_many_iter(keys), want):
        assert d is not None and hashlib.sha256(d).hexdigest() == h, k
    print("hit", len(want))
    """
)


def _py(code: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _done(p: subprocess.Popen) -> str:
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    return out.strip()


def test_two_processes_share_one_redis(backend, server):
    """Engine 1 (a process) computes and stores a context; engine 2 (another) loads it."""
    ctx = "shared/ctx1"
    assert _done(_py(_READER, server.url, ctx)) == "miss"
    assert _done(_py(_WRITER, server.url, ctx, "4", "200000")) == "wrote"
    assert _done(_py(_READER, server.url, ctx)) == "hit 4"


def test_concurrent_identical_writers(backend, server):
    """Two processes store the same context at once: content-addressed chunks are identical
    bytes, the manifest is SET NX - exactly one writes it, the result is intact."""
    ctx = "shared/ctx2"
    ps = [_py(_WRITER, server.url, ctx, "6", "300000") for _ in range(2)]
    outs = sorted(_done(p) for p in ps)
    assert outs == ["existed", "wrote"]
    assert _done(_py(_READER, server.url, ctx)) == "hit 6"


def test_eviction_under_small_maxmemory():
    """allkeys-lru at 4 MiB: writing ~12 MiB evicts keys; every value still present is
    exactly the bytes written (an evicted key is a miss, never wrong bytes)."""
    with RedisServer(maxmemory="4mb", policy="allkeys-lru") as srv, RedisBackend(srv.url) as b:
        chunks = _chunks(24, 500_000, seed=7)
        keys = [f"ev/{i}" for i in range(24)]
        for k, c in zip(keys, chunks):
            b.put(k, c)
        stats = b.info("stats")
        assert stats["evicted_keys"] > 0
        assert b.info("memory")["used_memory"] <= 4 * 1024 * 1024 + 600_000
        got = dict(b.get_many_iter(keys))
        present = [k for k in keys if got[k] is not None]
        assert 0 < len(present) < len(keys)
        assert all(got[k] == c for k, c in zip(keys, chunks) if got[k] is not None)
        assert got[keys[-1]] == chunks[-1]  # the most recent write survives LRU


def test_noeviction_full_is_a_clear_store_error():
    with RedisServer(maxmemory="2mb", policy="noeviction") as srv, RedisBackend(srv.url) as b:
        with pytest.raises(StoreError, match="full"):
            for i in range(40):
                b.put(f"f/{i}", b"z" * 200_000)


def test_redis_down_at_start():
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(RedisUnavailableError, match="unavailable"):
        RedisBackend(url)
    with pytest.raises(StoreError, match="unavailable"):
        open_backend(url)
    assert time.monotonic() - t0 < 10  # refused at once, no long retry loop


def test_redis_killed_mid_load():
    """SIGKILL while a prefetching load is running: values already read are returned, then
    the load raises RedisUnavailableError promptly (the caller fails over to recompute)."""
    with RedisServer() as srv:
        b = RedisBackend(srv.url, socket_timeout_s=3)
        chunks = _chunks(8, 400_000, seed=3)
        keys = [f"k/{i}" for i in range(8)]
        b.put_many(zip(keys, chunks))
        got = []
        t0 = time.monotonic()
        with pytest.raises(RedisUnavailableError):
            for k, d in b.get_many_iter(keys, depth=1):
                got.append(d)
                if len(got) == 1:
                    srv.kill()
        assert 1 <= len(got) < len(keys)
        assert got == chunks[: len(got)]  # what was delivered is right
        assert time.monotonic() - t0 < 10  # no hang
        with pytest.raises(RedisUnavailableError):
            b.get(keys[0])
        b.close()


def test_frozen_redis_times_out():
    """A server that stops answering (SIGSTOP) makes a read fail after socket_timeout_s,
    never hang."""
    with RedisServer() as srv:
        b = RedisBackend(srv.url, socket_timeout_s=1.0)
        b.put("x", b"1")
        srv.pause()
        try:
            t0 = time.monotonic()
            with pytest.raises(RedisUnavailableError):
                b.get("x")
            assert time.monotonic() - t0 < 6
        finally:
            srv.resume()
        assert b.get("x") == b"1"  # reconnects once the server is back
        b.close()
