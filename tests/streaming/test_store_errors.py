"""Store failures are classified and timeouts mean "no progress".

Every store client - the store server's client, Redis (RedisBackend, RedisStoreClient) and
the local folder - raises one class of streaming.errors per cause, with a message naming the
cause and the fix: unreachable, too large (the limit and the setting named), out of memory,
read-only, auth, timeout without progress. A 3 MiB write over a slow shaped link with a 1 s
timeout succeeds (bytes keep moving); a server that accepts and never reads fails with
"timeout without progress". Real redis-server processes (skipped when not installed).
Run: python -m pytest tests/streaming/test_store_errors.py -q
"""

from __future__ import annotations

import errno
import os
import socket
import threading

import pytest

from streaming import errors  # the classes under test: errors.Store*Error
from streaming.store.folder import LocalFolderBackend
from streaming.store.redis_server import RedisServer, find_redis_server, free_port
from streaming.store import KVStoreServer, StoreClient

needs_redis = pytest.mark.skipif(find_redis_server() is None, reason="redis-server not installed "
                                 "(apt-get install redis-server, or bash scripts/setup.sh)")
IDS = list(range(100))
MIB = 1 << 20


def _put_one(client, size: int) -> str:
    """A one-chunk context whose chunk has `size` bytes."""
    return client.put_context("m", "w", "raw", IDS, {0: [os.urandom(size)]}, [(0, len(IDS))])


@pytest.fixture
def stalled_server():
    """A TCP server that accepts connections and never reads nor answers."""
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(8)
    held, stop = [], threading.Event()

    def accept():
        ls.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(ls.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield ls.getsockname()
    stop.set()
    t.join(2)
    for s in held:
        s.close()
    ls.close()


@pytest.fixture
def store_server(tmp_path):
    srv = KVStoreServer(LocalFolderBackend(tmp_path / "store"), max_body=MIB)
    srv.start_thread()
    yield srv
    srv.shutdown()
    srv.server_close()


# --------------------------------------------------------------------------- store server client
def test_store_client_unreachable():
    port = free_port()
    with pytest.raises(errors.StoreUnavailableError, match="unreachable.*streaming.store serve"):
        StoreClient("127.0.0.1", port, timeout=2).ping()


def test_store_client_refuses_a_chunk_above_the_server_limit(store_server):
    with StoreClient(*store_server.address, timeout=5) as cl:
        with pytest.raises(errors.StoreTooLargeError, match="--max-body-mb 2") as ei:
            _put_one(cl, 2 * MIB)
        assert ei.value.limit == MIB and ei.value.size == 2 * MIB
        assert cl.list_contexts() == [] and cl.ping()  # nothing written, connection fine
        _put_one(cl, MIB // 2)


def test_store_server_too_large_frame_is_classified(store_server):
    """A client that does not ask for the limit first still gets the classified error."""
    with StoreClient(*store_server.address, timeout=5) as cl:
        cl._server_max_body = 64 * MIB  # pretend not to know the server's limit
        with pytest.raises((errors.StoreTooLargeError, errors.StoreUnavailableError)):
            _put_one(cl, 2 * MIB)


@pytest.mark.parametrize("code,cls,words", [(errno.ENOSPC, errors.StoreFullError, "disk full"),
                                            (errno.EROFS, errors.StoreReadOnlyError, "not writable")])
def test_local_folder_full_or_read_only(tmp_path, monkeypatch, store_server, code, cls, words):
    """The local folder classifies disk full / read-only, directly and through the server."""
    b = LocalFolderBackend(tmp_path / "direct")

    def fail(*a, **k):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(cls, match=words):
        b.put("k", b"x")
    with StoreClient(*store_server.address, timeout=5) as cl, pytest.raises(cls, match=words):
        _put_one(cl, 1000)


def test_store_client_stalled_server_is_timeout_without_progress(stalled_server):
    cl = StoreClient(*stalled_server, timeout=0.5)
    cl._server_max_body = 1 << 30  # skip the PING: exercise the send path
    with pytest.raises(errors.StoreTimeoutError, match="no progress for 0.5 s while sending PUT_CHUNK"):
        cl.put_chunk("a" * 64, 0, 0, os.urandom(64 * MIB), gen="b" * 32)  # larger than the
        # socket buffers: the send stalls
    with pytest.raises(errors.StoreTimeoutError, match="timeout without progress"):
        StoreClient(*stalled_server, timeout=0.5).ping()  # waiting for a reply that never comes


# --------------------------------------------------------------------------- Redis
@needs_redis
def test_redis_value_above_proto_max_bulk_len():
    from streaming.store.redis_backend import RedisBackend
    from streaming.store.redis_client import RedisStoreClient

    with RedisServer(extra_config=["proto-max-bulk-len 1mb"]) as srv, RedisBackend(srv.url) as b:
        with pytest.raises(errors.StoreTooLargeError, match="proto-max-bulk-len.*1048576") as ei:
            b.put("big", os.urandom(2 * MIB))
        assert ei.value.limit == MIB and not isinstance(ei.value, errors.StoreUnavailableError)
        b.ping()  # the server is fine, and the message did not say otherwise
        b.put("small", os.urandom(MIB // 2))
        with RedisStoreClient(srv.url) as cl, pytest.raises(errors.StoreTooLargeError):
            _put_one(cl, 2 * MIB)
        assert b.get("big") is None and list(b.keys("ctx/")) == []


@needs_redis
def test_redis_value_above_the_default_limit():
    """513 MiB at Redis's default 512mb limit: refused up front (no 513 MiB sent)."""
    from streaming.store.redis_backend import RedisBackend

    with RedisServer() as srv, RedisBackend(srv.url) as b:
        with pytest.raises(errors.StoreTooLargeError, match="536870912"):
            b.put("huge", bytes(513 * MIB))
        b.ping()


@needs_redis
def test_redis_out_of_memory():
    from streaming.store.redis_backend import RedisBackend

    with RedisServer(maxmemory="1mb", policy="noeviction") as srv, RedisBackend(srv.url) as b:
        with pytest.raises(errors.StoreFullError, match="maxmemory"):
            for i in range(8):
                b.put(f"k{i}", os.urandom(MIB // 2))


@needs_redis
def test_redis_auth_required():
    from streaming.store.redis_backend import RedisBackend

    with RedisServer(password="s3cret") as srv:
        bare = srv.url.replace(":s3cret@", "")
        with pytest.raises(errors.StoreAuthError, match=r"redis://:PASSWORD@"):
            RedisBackend(bare)
        with pytest.raises(errors.StoreAuthError):
            RedisBackend(srv.url.replace("s3cret", "wrong"))
        with RedisBackend(srv.url) as b:
            b.put("k", b"v")
            assert b.get("k") == b"v"


@needs_redis
def test_redis_read_only_replica():
    from streaming.store.redis_backend import RedisBackend

    with RedisServer() as primary, \
            RedisServer(extra_config=[f"replicaof 127.0.0.1 {primary.port}"]) as replica, \
            RedisBackend(replica.url) as b:
        with pytest.raises(errors.StoreReadOnlyError, match="read-only replica.*primary"):
            b.put("k", b"v")


@needs_redis
def test_redis_unreachable():
    from streaming.store.redis_backend import RedisBackend, RedisUnavailableError

    with pytest.raises(RedisUnavailableError, match="python -m streaming.store.redis_server"):
        RedisBackend(f"redis://127.0.0.1:{free_port()}/0", connect_timeout_s=1)


@needs_redis
def test_redis_stalled_server_is_timeout_without_progress(stalled_server):
    from streaming.store.redis_backend import RedisBackend
    from streaming.store.redis_conn import RedisTimeoutError

    h, p = stalled_server
    b = RedisBackend(f"redis://{h}:{p}/0", socket_timeout_s=0.5, check=False)
    b._bulk_limit = 1 << 30  # skip CONFIG GET: exercise the write path
    with pytest.raises(RedisTimeoutError, match="timeout without progress") as ei:
        b.put("k", bytes(64 * MIB))
    assert isinstance(ei.value, errors.StoreTimeoutError)


# --------------------------------------------------------------------------- slow link
@needs_redis
def test_large_writes_over_a_slow_link_do_not_time_out(tmp_path):
    """3 MiB over a 20 Mbit/s shaped link takes ~1.3 s; with 0.5 s timeouts the writes
    succeed because the timeouts apply to lack of progress, not to the value's size."""
    from streaming.link import ShapedLink
    from streaming.store.redis_client import RedisStoreClient
    from streaming.store import start_store_server

    chunk = os.urandom(3 * MIB)
    with ShapedLink(20) as link, RedisServer(link=link) as srv:
        with RedisStoreClient(srv.url, socket_timeout_s=0.5) as cl:
            key = cl.put_context("m", "w", "raw", IDS, {0: [chunk]}, [(0, len(IDS))])
            assert cl.get_chunk(key, 0, 0) == chunk
        with start_store_server(tmp_path / "store", link=link) as h, h.client(timeout=0.5) as cl:
            key = cl.put_context("m", "w", "raw", IDS, {0: [chunk]}, [(0, len(IDS))])
            assert cl.get_chunk(key, 0, 0) == chunk


def test_error_kinds_round_trip():
    for cls in (errors.StoreError, errors.StoreUnavailableError, errors.StoreTimeoutError,
                errors.StoreTooLargeError, errors.StoreFullError, errors.StoreReadOnlyError,
                errors.StoreAuthError):
        e = errors.store_error(cls.kind, "m")
        assert type(e) is cls and errors.error_kind(e) == cls.kind
    assert type(errors.store_error("nonsense", "m")) is errors.StoreError
