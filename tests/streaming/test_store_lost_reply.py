"""A save whose reply is lost or late: the fault matrix of the store's write path.

A loopback TCP proxy (a real socket relay, ReplyFaultProxy) sits between a writer and its
store and, for one request of a save at a time (every request in turn; then two requests
in a row, so the writer's own question after a lost reply is lost too), either drops the
reply (the connection is closed the moment the reply arrives: the server has committed)
or withholds it until the writer's timeout gives up. Three stores: the store server
(StoreClient -> proxy -> KVStoreServer over a folder), Redis read directly
(RedisStoreClient -> proxy -> redis-server: redis-py re-sends a script after a broken
connection), and the store server over Redis (StoreClient -> KVStoreServer -> proxy ->
redis-server). Each with no previous entry, one, and two (an overwrite that also deletes
the entry two saves back).

Asserted in every case: 0 wrong KV (every loaded chunk holds its own tokens of one save),
0 lost published entries (a save reported done loads; a save reported failed left the
previous entry loading, and after a reported overwrite the replaced entry still loads for
a reader that planned from it), the writer's outcome matches what is stored, no outcome
is left unknown, and no chunks of an unpublished save are left behind. Redis cases start
their own redis-server and are skipped only when it is not installed.
Run: .venv/bin/python -m pytest tests/streaming/test_store_lost_reply.py -q -s (prints counts)
"""

from __future__ import annotations

import itertools
import json
import selectors
import socket
import threading
from collections import Counter

import pytest

import codec
from streaming.store.folder import LocalFolderBackend
from streaming.errors import StoreError, StoreOutcomeUnknownError
from streaming.store.redis_server import RedisServer, find_redis_server
from streaming.store import KVStoreServer, StoreClient
from tests.helpers.store_faults import IDENTITY, classify, entry, ids_of, kv

needs_redis = pytest.mark.skipif(find_redis_server() is None, reason="redis-server not installed")
TIMEOUT_S = 0.5  # the writer's timeout without progress: a withheld reply fails after this
COUNTS: Counter = Counter()


class ReplyFaultProxy:
    """Loopback TCP relay to `target` (host, port) that loses chosen replies.

    Requests are numbered across all connections from arm(): a request starts when a client
    sends bytes after its server last sent (or first sends on a connection); the bytes the
    server sends back until the client's next request are its reply. For a request whose
    number is in `faults`, mode "drop" closes both sockets when the reply's first bytes
    arrive (the server has carried the request out), mode "late" never forwards the reply
    and closes the server side once the client gives up. `count` is the number of
    requests seen, `fired` the numbers whose reply was lost."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.address = self.lsock.getsockname()[:2]
        self._lock = threading.Lock()
        self.arm()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, mode: str | None = None, faults=()) -> None:
        with self._lock:
            self.mode, self.faults, self.count, self.fired = mode, set(faults), 0, []

    def close(self) -> None:
        self._closed = True
        self.lsock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(c,), daemon=True).start()

    def _relay(self, c: socket.socket) -> None:
        try:
            s = socket.create_connection(self.target)
        except OSError:
            c.close()
            return
        sel = selectors.DefaultSelector()
        sel.register(c, selectors.EVENT_READ, "client")
        sel.register(s, selectors.EVENT_READ, "server")
        in_request, number, lose = False, -1, False
        try:
            while True:
                for k, _ in sel.select():
                    data = k.fileobj.recv(1 << 16)
                    if not data:
                        return  # either side closed: close both
                    if k.data == "client":
                        if not in_request:
                            with self._lock:
                                number, self.count = self.count, self.count + 1
                                lose = number in self.faults and self.mode is not None
                            in_request = True
                        s.sendall(data)
                        continue
                    in_request = False
                    if lose:
                        with self._lock:
                            if number not in self.fired:
                                self.fired.append(number)
                        if self.mode == "drop":
                            return
                        continue  # "late": withheld until the client gives up
                    c.sendall(data)
        except OSError:
            return
        finally:
            sel.close()
            c.close()
            s.close()


# --------------------------------------------------------------------------- stores
class _ServerStore:
    """StoreClient -> proxy -> KVStoreServer over a local folder."""

    name = "server"

    def __init__(self, tmp):
        self.srv = KVStoreServer(LocalFolderBackend(tmp / "store"))
        self.srv.start_thread()
        self.proxy = ReplyFaultProxy(self.srv.address)
        self.backend = self.srv.store.backend

    def writer(self, timeout: float = TIMEOUT_S):
        return StoreClient(*self.proxy.address, timeout=timeout)

    def reader(self):
        return StoreClient(*self.srv.address, timeout=10)

    def close(self):
        self.proxy.close()
        self.srv.shutdown()
        self.srv.server_close()


class _RedisStore:
    """RedisStoreClient -> proxy -> redis-server."""

    name = "redis"

    def __init__(self, tmp):
        from streaming.store.redis_client import RedisStoreClient

        self.rs = RedisServer(policy="noeviction").__enter__()
        host, port = self.rs.url.split("//")[1].split("/")[0].split(":")
        self.proxy = ReplyFaultProxy((host, int(port)))
        self._cls = RedisStoreClient
        self.backend = RedisStoreClient(self.rs.url).backend

    def _url(self):
        return "redis://%s:%d/0" % self.proxy.address

    def writer(self, timeout: float = TIMEOUT_S):
        return self._cls(self._url(), socket_timeout_s=timeout)

    def reader(self):
        return self._cls(self.rs.url)

    def close(self):
        self.proxy.close()
        self.backend.close()
        self.rs.__exit__(None, None, None)


class _ServerOverRedisStore(_RedisStore):
    """StoreClient -> KVStoreServer -> proxy -> redis-server: the server's own Redis
    replies are lost (its compare-and-swap script re-sent, its requests timing out)."""

    name = "server-redis"

    def __init__(self, tmp):
        from streaming.store.redis_backend import RedisBackend

        super().__init__(tmp)
        self.srv = KVStoreServer(RedisBackend(self._url(), socket_timeout_s=TIMEOUT_S))
        self.srv.start_thread()

    def writer(self, timeout: float = TIMEOUT_S):
        return StoreClient(*self.srv.address, timeout=10)  # the server's Redis replies are lost

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()
        super().close()


STORES = {"server": _ServerStore, "redis": _RedisStore, "server-redis": _ServerOverRedisStore}


@pytest.fixture(params=["server", pytest.param("redis", marks=needs_redis),
                        pytest.param("server-redis", marks=needs_redis)])
def store(request, tmp_path):
    s = STORES[request.param](tmp_path)
    yield s
    s.close()


def save(client, ids, ct: int, version: int) -> str:
    """put_context of raw chunks whose K is (token, version) (tests.helpers.store_faults)."""
    k, v = kv(len(ids), version)
    chunks = codec.encode_chunks(k, v, codec="raw", chunk_tokens=ct)
    return client.put_context("m", "w", "raw", ids, {None: chunks}, codec.chunk_bounds(len(ids), ct),
                              meta={"version": version}, identity=IDENTITY)


def stored_gens(backend, key: str) -> set[str]:
    """Write generations with anything stored under ctx/<key>/g/ (abort markers aside)."""
    return {k.split("/")[3] for k in backend.keys(f"ctx/{key}/g/") if not k.endswith("/aborted")}


def run_case(store, ids, prior: int, mode: str | None, faults) -> tuple[str, int]:
    """`prior` clean saves (versions 1..prior, 128-token chunks), then save version 10 (96-
    token chunks: 4 chunks) through the proxy with `faults`; checks what is stored against
    the writer's outcome. Returns (outcome, requests the save made)."""
    reader = store.reader()
    key = entry(ids, 128, 0)[0]  # the key depends on the tokens only, not on chunking or version
    try:
        for v in range(1, prior + 1):
            assert save(reader, ids, 128, v) == key
        old_gen = reader.get_manifest(key).gen if prior else None
        before = stored_gens(store.backend, key)
        w = store.writer(TIMEOUT_S if mode else 10.0)  # a clean run never times out
        store.proxy.arm(mode, faults)
        try:
            assert save(w, ids, 96, 10) == key
            outcome = "saved"
        except StoreOutcomeUnknownError:
            outcome = "unknown"
        except StoreError as e:
            outcome = type(e).__name__
        finally:
            n_requests, fired = store.proxy.count, list(store.proxy.fired)
            store.proxy.arm()
            w.close()
        if mode is not None:
            assert fired == sorted(f for f in faults if f < n_requests), (fired, faults, n_requests)
        COUNTS[f"{store.name}:{mode}:{outcome}"] += 1
        assert outcome != "unknown", "one lost reply (or two) must not leave the outcome unknown"
        kind, version = classify(reader, key)  # asserts no wrong KV
        if outcome == "saved":
            assert (kind, version) == ("load", 10), "a save reported done must load"
            if prior:  # the replaced entry stays loadable for a reader that planned from it
                assert classify(reader, key, plan_gen=old_gen) == ("load", prior)
        elif prior:
            assert (kind, version) == ("load", prior), "a failed save must not cost the previous entry"
        else:
            assert kind == "miss"
        cur = reader.get_manifest(key)
        keep = {cur.gen, (cur.to_dict().get("prev") or {}).get("gen")} if cur is not None else set()
        # (the entry two saves back may stay when its deletion's replies are lost: logged)
        assert stored_gens(store.backend, key) - before <= keep, "an unpublished save left chunks behind"
        COUNTS["cases"] += 1
        return outcome, n_requests
    finally:
        reader.close()


_CASE = itertools.count()


def _case_ids() -> list[int]:
    """Token ids of a context no other case of this module saves (its own key)."""
    return ids_of(7_000_000 + next(_CASE), 384)


@pytest.mark.parametrize("prior", [0, 1, 2])
def test_lost_reply_at_every_request(store, prior):
    """Every request of a save in turn, its reply dropped or late; then every two requests
    in a row (the writer's question after a lost reply is lost too)."""
    outcome, n = run_case(store, _case_ids(), prior, None, ())
    assert outcome == "saved" and n >= 2
    for mode in ("drop", "late"):
        for at in range(n):
            for faults in ((at,), (at, at + 1)):
                run_case(store, _case_ids(), prior, mode, faults)


@pytest.mark.parametrize("name", ["server", pytest.param("redis", marks=needs_redis)])
def test_store_that_stops_answering_after_the_publish(tmp_path, name):
    """Every reply from the publish on is lost (the publish, every question the writer
    asks after it): the writer reports StoreOutcomeUnknownError and deletes nothing - the
    entry it published loads, the one it replaced still loads for a reader that planned
    from it."""
    s = STORES[name](tmp_path)
    try:
        reader = s.reader()
        ids = _case_ids()
        save(reader, ids, 128, 1)
        w = s.writer(10.0)
        s.proxy.arm()
        key = save(w, ids, 96, 2)  # clean: the publish is the save's last request
        n = s.proxy.count
        w.close()
        old_gen = reader.get_manifest(key).gen
        w = s.writer()
        s.proxy.arm("drop", range(n - 1, n + 100))
        with pytest.raises(StoreOutcomeUnknownError, match="nothing of it was deleted"):
            save(w, ids, 96, 3)  # the same chunking: the same requests
        assert s.proxy.fired[0] == n - 1 and len(s.proxy.fired) > 3  # the questions were lost too
        s.proxy.arm()
        assert classify(reader, key) == ("load", 3)
        assert classify(reader, key, plan_gen=old_gen) == ("load", 2)
        w.close()
        reader.close()
    finally:
        s.close()


@needs_redis
def test_redis_resent_publish_is_its_own_write(tmp_path):
    """The reply to the publish script is dropped after Redis ran it; redis-py sends the
    script again on a new connection: the writer is told it saved (not that it lost a race),
    and the stored entry is its own."""
    s = _RedisStore(tmp_path)
    try:
        ids = _case_ids()
        reader = s.reader()
        save(reader, ids, 128, 1)
        w = s.writer()
        s.proxy.arm()
        save(w, ids, 96, 10)  # clean: a save reads the key's state, then runs the publish script
        n = s.proxy.count
        assert n >= 2
        ids = _case_ids()
        save(reader, ids, 128, 1)
        evals0 = s.backend.info("commandstats").get("cmdstat_eval", {}).get("calls")
        s.proxy.arm("drop", [n - 1])
        key = save(w, ids, 96, 10)
        evals = s.backend.info("commandstats").get("cmdstat_eval", {}).get("calls")
        assert s.proxy.fired == [n - 1] and s.proxy.count > n  # sent again on a new connection
        assert evals - evals0 == 2  # the script ran twice: the second run found its own manifest
        assert classify(reader, key) == ("load", 10)
        reader.close()
        w.close()
    finally:
        s.close()


def test_zz_print_counts():
    """Prints the matrix's outcome counts (run with -s); asserts no outcome was unknown."""
    print("\nlost-reply matrix:", json.dumps(dict(sorted(COUNTS.items()))))
    assert not [k for k in COUNTS if k.endswith(":unknown")]
