"""Fault-injection matrix of the KV store: crashes at every write step, every
interleaving of two writers, readers racing overwrites, Redis eviction - for every store
(local folder in-process, the store server, Redis). Over all of it: 0 loads of wrong KV,
0 entries left that fail every later load, every outcome a load or a recorded miss.

Token-identifying KV: raw-codec float32 chunks whose K value at token t is (t, version)
(V = -K), so a decoded chunk proves both its token positions and which save it came from
(tests/helpers/store_faults.py).
The write steps come from streaming.store.save_steps (a generator: stopping it is a crash
at that point, with no clean-up). Fast (about a second per store without Redis); the
Redis cases start a real redis-server and are skipped only when it is not installed.
Run: .venv/bin/python -m pytest tests/streaming/test_store_faults.py -q -s (prints the counts)
"""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest

from streaming.store.folder import LocalFolderBackend
from streaming.errors import StoreRaceLostError
from streaming.store.redis_server import RedisServer, find_redis_server
from streaming.store import KVStoreServer, LocalStoreClient, StoreClient, save_steps
from tests.helpers import store_faults
from tests.helpers.store_faults import T, entry, ids_of

COUNTS: Counter = Counter()
needs_redis = pytest.mark.skipif(find_redis_server() is None, reason="redis-server not installed")


def classify(client, key: str, n: int = T, **kw) -> tuple[str, int | None]:
    """tests.helpers.store_faults.classify, counting the outcomes in this module's COUNTS."""
    return store_faults.classify(client, key, n, counts=COUNTS, **kw)


# --------------------------------------------------------------------------- stores
class _Folder:
    name = "folder"
    atomic_publish = False

    def __init__(self, tmp):
        self.root = tmp / "folder"

    def client(self):
        return LocalStoreClient(LocalFolderBackend(self.root))

    def close(self):
        pass


class _Server:
    name = "server"
    atomic_publish = False

    def __init__(self, tmp):
        self.srv = KVStoreServer(LocalFolderBackend(tmp / "server"))
        self.srv.start_thread()
        self._clients = []

    def client(self):
        c = StoreClient(*self.srv.address, timeout=10)
        self._clients.append(c)
        return c

    def close(self):
        for c in self._clients:
            c.close()
        self.srv.shutdown()
        self.srv.server_close()


class _Redis:
    name = "redis"
    atomic_publish = True  # chunks and manifest in one Lua script

    def __init__(self, tmp, **kw):
        from streaming.store.redis_client import RedisStoreClient

        self.rs = RedisServer(**kw).__enter__()
        self._cls, self._clients = RedisStoreClient, []

    def client(self):
        c = self._cls(self.rs.url)
        self._clients.append(c)
        return c

    def close(self):
        for c in self._clients:
            c.close()
        self.rs.__exit__(None, None, None)


STORES = ["folder", "server", pytest.param("redis", marks=needs_redis)]


@pytest.fixture(params=STORES)
def store(request, tmp_path):
    s = {"folder": _Folder, "server": _Server, "redis": _Redis}[request.param](tmp_path)
    yield s
    s.close()


def steps_of(client, man, chunks):
    return save_steps(client, man, chunks)


def run_full(client, ids, ct, version) -> str:
    key, man, chunks = entry(ids, ct, version)
    for _ in steps_of(client, man, chunks):
        pass
    return key


# --------------------------------------------------------------------------- crash matrix
CHUNKINGS = [(128, 256), (256, 64), (64, 128), (128, 128)]


@pytest.mark.parametrize("old_ct,new_ct", CHUNKINGS)
@pytest.mark.parametrize("prior", [True, False])
def test_writer_killed_at_every_step(store, old_ct, new_ct, prior):
    """A save (version 2, chunk_tokens new_ct) stopped after each of its write steps (0 =
    killed before writing anything): a reader sees the old complete entry (version 1), the
    new complete one, or (no prior entry) a miss - never a mix; a later save (version 3)
    then always loads: nothing is left that fails forever."""
    c = store.client()
    n_steps = len(list(steps_of(c, *entry(ids_of(999), new_ct, 0)[1:])))  # steps of one save
    for crash_after in range(n_steps):
        case = 1000 * old_ct + 10 * new_ct + crash_after + (500_000 if prior else 0)
        ids = ids_of(case)
        if prior:
            run_full(c, ids, old_ct, 1)
        key, man, chunks = entry(ids, new_ct, 2)
        g = steps_of(store.client() if not store.atomic_publish else c, man, chunks)
        done = [next(g) for _ in range(crash_after + 1)]
        g.close()  # killed: no clean-up runs
        published = done[-1][0] == "manifest"
        kind, version = classify(c, key)
        COUNTS["crash_cases"] += 1
        if published:
            assert (kind, version) == ("load", 2)
        elif prior:
            assert (kind, version) == ("load", 1)
        else:
            assert kind == "miss"
        run_full(c, ids, 128, 3)
        assert classify(c, key) == ("load", 3)


def test_server_writer_dies_mid_frame(tmp_path):
    """A writer whose connection dies inside its PUT_MANIFEST frame (chunks all sent, half
    the manifest frame's bytes on the wire) leaves the entry as it was; the server keeps
    serving; the same frame sent whole publishes (control)."""
    import socket

    from streaming.store.protocol import FrameType, encode_frame, recv_frame

    s = _Server(tmp_path)
    try:
        c = s.client()
        ids = ids_of(7)
        key = run_full(c, ids, 128, 1)
        base = c.current_gen(key)
        _, man, chunks = entry(ids, 64, 2)
        man = dict(man, gen="ab" * 16)
        for i, ch in enumerate(chunks[None]):
            c.put_chunk(key, None, i, ch, gen=man["gen"])
        frame = encode_frame(FrameType.PUT_MANIFEST, {"manifest": man, "base_gen": base, "has_base": True})
        raw = socket.create_connection(s.srv.address)
        raw.sendall(frame[: len(frame) // 2])
        raw.close()
        assert classify(c, key) == ("load", 1)
        raw = socket.create_connection(s.srv.address)
        raw.sendall(frame)
        assert recv_frame(raw).type == FrameType.OK
        raw.close()
        assert classify(c, key) == ("load", 2)
    finally:
        s.close()


@needs_redis
def test_redis_writer_dies_mid_command(tmp_path):
    """A writer that dies while sending its publish script (half the command's bytes on the
    wire) leaves the old entry as it was: Redis runs only complete commands."""
    import socket

    from streaming.store.redis_backend import RedisBackend
    from streaming.store.format import chunk_key, manifest_key, abort_marker_key

    s = _Redis(tmp_path)
    try:
        c = s.client()
        ids = ids_of(8)
        key = run_full(c, ids, 128, 1)
        _, man, chunks = entry(ids, 64, 2)
        man = dict(man, gen="cd" * 16)
        blob = json.dumps(man).encode()
        items = [(chunk_key(key, None, i, man["gen"]), ch) for i, ch in enumerate(chunks[None])]
        items.append((manifest_key(key, man["gen"]), blob))
        keys = [b"cg:" + manifest_key(key).encode(), b"cg:" + abort_marker_key(key, man["gen"]).encode()] + \
            [b"cg:" + k.encode() for k, _ in items]
        base = c.manifest_raw(key)
        args = [b"EVAL", RedisBackend._PUBLISH_LUA.encode(), str(len(keys)).encode(), *keys,
                b"1", base, blob, *[d for _, d in items]]
        cmd = b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)
        host, port = s.rs.url.split("//")[1].split("/")[0].split(":")
        raw = socket.create_connection((host, int(port)))
        raw.sendall(cmd[: len(cmd) // 2])
        raw.close()
        assert classify(c, key) == ("load", 1)
        raw = socket.create_connection((host, int(port)))  # control: the whole command publishes
        raw.sendall(cmd)
        assert raw.recv(16).startswith(b":1")
        raw.close()
        assert classify(c, key) == ("load", 2)
    finally:
        s.close()


# --------------------------------------------------------------------------- two writers
def _interleavings(n1: int, n2: int):
    for pos in itertools.combinations(range(n1 + n2), n1):
        order = [2] * (n1 + n2)
        for p in pos:
            order[p] = 1
        yield order


@pytest.mark.parametrize("cts,prior", [((128, 256), False), ((192, 128), True)])
def test_every_interleaving_of_two_writers(store, cts, prior):
    """Two writers of one key (2-3 chunks each, different chunkings and versions), every
    interleaving of their write steps: each either publishes or gets StoreRaceLostError;
    exactly one complete entry remains - the last publisher's - and it loads right."""
    c = store.client()
    w = [store.client(), store.client()]
    n = [len(list(steps_of(c, *entry(ids_of(998), ct, 0)[1:]))) for ct in cts]
    for case, order in enumerate(_interleavings(*n)):
        ids = ids_of(2_000_000 + 1000 * cts[0] + 10 * int(prior) + case * 7 + 1)
        if prior:
            run_full(c, ids, 64, 9)
        gens = {}
        for i in (1, 2):
            key, man, chunks = entry(ids, cts[i - 1], i)
            gens[i] = steps_of(w[i - 1], man, chunks)
        lost, published = set(), []
        for who in order:
            if who in lost:
                continue
            try:
                step = next(gens[who])
            except StoreRaceLostError:
                lost.add(who)
                continue
            if step[0] == "manifest":
                published.append(who)
        for g in gens.values():
            g.close()
        COUNTS["interleavings"] += 1
        COUNTS["race_lost"] += len(lost)
        assert len(lost) + len(published) == 2 and published
        assert classify(c, key) == ("load", published[-1])


# --------------------------------------------------------------------------- racing readers
@pytest.mark.parametrize("overwrites", [1, 2])
@pytest.mark.parametrize("planned", [True, False])
def test_reader_racing_overwrites(store, overwrites, planned):
    """A reader that planned from version 1 (3 chunks of 128) fetches its chunks while
    `overwrites` saves (other chunkings) land, the writers advancing one step before each
    chunk request from every starting offset. With one overwrite the reader still gets
    the complete entry it planned from; with two, the oldest chunks may be gone: those
    chunks are recomputed (recorded) - never another save's KV."""
    c = store.client()
    wc = store.client()
    per = len(list(steps_of(c, *entry(ids_of(997), 256, 0)[1:])))
    for offset in range(per * overwrites + 1):
        ids = ids_of(3_000_000 + 100 * offset + 10 * overwrites + int(planned))
        key = run_full(c, ids, 128, 1)
        gen1 = c.get_manifest(key).gen
        writers = [steps_of(wc, *entry(ids, ct, 2 + j)[1:]) for j, ct in
                   enumerate([256, 64][:overwrites])]
        flat = itertools.chain.from_iterable(writers)

        def advance(_k, it=flat):
            next(it, None)

        for _ in range(offset):
            advance(0)
        kind, version = classify(c, key, before_chunk=advance,
                                 **({"plan_gen": gen1} if planned else {}))
        for _ in flat:
            pass
        COUNTS["racing_reads"] += 1
        if planned and overwrites == 1:
            assert (kind, version) == ("load", 1)
        assert kind in ("load", "partial", "miss")
        assert classify(c, key)[0] == "load"  # the final entry loads: nothing fails forever


# --------------------------------------------------------------------------- Redis eviction
@needs_redis
@pytest.mark.parametrize("policy", ["allkeys-lru", "allkeys-lfu"])
def test_redis_eviction_is_a_clean_miss(tmp_path, policy):
    """20 contexts x 4 chunks in a Redis of 3 MB that evicts: every entry whose has() is
    true loads completely and right; every other one is a miss with a reason; after a
    re-save every one loads (no entry fails forever)."""
    s = _Redis(tmp_path, maxmemory="3mb", policy=policy)
    try:
        c = s.client()
        n = 4 * 1024
        keys = []
        for i in range(20):
            ids = ids_of(4_000_000 + i, n)
            key, man, chunks = entry(ids, 1024, 1)
            for _ in steps_of(c, man, chunks):
                pass
            keys.append((key, ids))
        assert c.backend.info("stats")["evicted_keys"] > 0
        out = Counter()
        for key, _ in keys:
            has = c.has(key)
            kind, _v = classify(c, key, n)
            assert kind == ("load" if has else "miss")
            out[kind] += 1
        COUNTS[f"evict_{policy}_load"] += out["load"]
        COUNTS[f"evict_{policy}_miss"] += out["miss"]
        assert out["miss"] > 0
        for key, ids in keys[-3:]:  # re-saved at full memory: loads, or (evicted as it
            k2, man, chunks = entry(ids, 1024, 2)  # was written) a clean miss
            for _ in steps_of(c, man, chunks):
                pass
            assert classify(c, k2, n) in (("load", 2), ("miss", None))
        c.backend._client.flushdb()  # room again: a re-save always loads
        for _ in steps_of(c, man, chunks):
            pass
        assert classify(c, k2, n) == ("load", 2)
    finally:
        s.close()


def test_zz_print_matrix_counts():
    """Prints the matrix's outcome counts (run with -s); asserts none was wrong."""
    print("\nstore fault matrix:", json.dumps(dict(sorted(COUNTS.items()))))
    assert COUNTS["wrong"] == 0
