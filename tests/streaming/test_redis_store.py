"""Redis as the shared KV store, end to end: manifests, stream_load, eviction, faults.

A real redis-server is started by the tests (streaming.store.redis_server.RedisServer); chunks are
bench.standin_codec chunks (CRC-checked, real decode work) so no model is needed. Skipped
(with the reason) only when redis-server is not installed.
Run: python -m pytest tests/streaming/test_redis_store.py -q
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bench import standin_codec as standin
from streaming.store.folder import LocalFolderBackend
from streaming.load import stream_load
from streaming.store.redis_backend import (
    RedisUnavailableError,
    open_redis_backend,
)
from streaming.store.redis_client import RedisStoreClient
from streaming.store.redis_server import RedisServer, find_redis_server, free_port
from streaming.store import context_key, start_store_server

pytestmark = pytest.mark.skipif(
    find_redis_server() is None,
    reason="redis-server not installed (apt-get install redis-server, or bash scripts/setup.sh)",
)
REPO = Path(__file__).resolve().parents[2]
TAG = "standin"


def _context(n_chunks=4, tokens=64, size=200_000, levels=(1, 2), seed=0):
    """(ids, chunks {level: [bytes]}, token_ranges) of a synthetic context."""
    ids = [(seed * 7919 + i) % 50000 for i in range(n_chunks * tokens)]
    ranges = [(i * tokens, (i + 1) * tokens) for i in range(n_chunks)]
    chunks = {lv: [standin.make_chunk(size * lv + 13 * i, seed=seed * 1000 + lv * 100 + i)
                   for i in range(n_chunks)] for lv in levels}
    return ids, chunks, ranges


def _load(client, key, level=2, **kw):
    return stream_load(client, key, level, standin.decoder(), model_id="m", weights_hash="w",
                       codec_tag=TAG, **kw)


@pytest.fixture
def server():
    with RedisServer() as srv:
        yield srv


def test_round_trip_multi_chunk_context(server):
    ids, chunks, ranges = _context()
    with RedisStoreClient(server.url) as c:
        key = c.put_context("m", "w", TAG, ids, chunks, ranges)
        assert key == context_key("m", "w", TAG, ids)
        assert c.list_contexts() == [key] and c.has(key)
        res = _load(c, key, level=2)
        assert res.hit and res.error is None and res.recompute_tokens == 0
        assert res.decoded == [standin.decode(x) for x in chunks[2]]
        assert res.bytes == sum(len(x) for x in chunks[2])
        res1 = _load(c, key, level=[1, 2, 1, 2])  # per-chunk levels
        assert [s.level for s in res1.chunks] == [1, 2, 1, 2] and res1.recompute_tokens == 0
        # the prefetching iterator of the direct client
        got = [f.data for f in c.iter_chunks(key, [(1, i) for i in range(4)], depth=2)]
        assert got == chunks[1]
        # a foreign expectation is a clean miss, never served
        miss = stream_load(c, key, 2, standin.decoder(), model_id="other", weights_hash="w", codec_tag=TAG)
        assert not miss.hit and "model_id mismatch" in miss.reason
        c.delete_context(key)
        assert not c.has(key) and not list(c.backend.keys("ctx/"))


def test_put_context_is_one_transaction(server):
    """Nothing of a context is written when its manifest is refused (bad ranges)."""
    from streaming.errors import StoreError

    ids, chunks, ranges = _context(n_chunks=2)
    with RedisStoreClient(server.url) as c:
        with pytest.raises(ValueError):
            c.put_context("m", "w", TAG, ids, {1: chunks[1][:1]}, ranges)
        with pytest.raises(StoreError):
            c.put_context("m", "w", TAG, ids, chunks, [(0, 10), (11, 128)])
        assert list(c.backend.keys()) == []


def test_store_server_over_redis_backend(server):
    """`python -m streaming.store serve --backend redis://...`: the TCP store server keeps
    its chunks in Redis; StoreClient + stream_load work unchanged."""
    ids, chunks, ranges = _context(n_chunks=3, size=100_000)
    with start_store_server(server.url) as h, h.client(timeout=10) as c:
        key = c.put_context("m", "w", TAG, ids, chunks, ranges)
        res = _load(c, key)
        assert res.hit and res.recompute_tokens == 0
        assert res.decoded == [standin.decode(x) for x in chunks[2]]
    with RedisStoreClient(server.url) as direct:  # the same context, read straight from Redis
        assert direct.has(key) and _load(direct, key).recompute_tokens == 0


_ENGINE = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from tests.streaming.test_redis_store import _context, _load, TAG
    from bench import standin_codec as standin
    from streaming.store.redis_client import RedisStoreClient
    from streaming.store import context_key
    url, role = sys.argv[2], sys.argv[3]
    ids, chunks, ranges = _context(seed=5)
    c = RedisStoreClient(url)
    key = context_key("m", "w", TAG, ids)
    if role == "store":
        from streaming.errors import StoreRaceLostError
        try:
            c.put_context("m", "w", TAG, ids, chunks, ranges)
            print(json.dumps({"stored": key}))
        except StoreRaceLostError as e:  # another engine published first: its entry stays
            print(json.dumps({"lost": str(e)}))
    else:
        res = _load(c, key)
        ok = res.hit and res.decoded == [standin.decode(x) for x in chunks[2]]
        print(json.dumps({"hit": res.hit, "correct": ok, "recompute": res.recompute_tokens,
                          "reason": res.reason}))
    """
)


def _engine(url: str, role: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _ENGINE, str(REPO), url, role], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(p: subprocess.Popen) -> dict:
    import json

    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


def test_two_engines_share_one_redis(server):
    """Engine process 1 computes and stores the context; engine process 2 loads it."""
    before = _result(_engine(server.url, "load"))
    assert before["hit"] is False and before["reason"] == "unknown key"
    assert "stored" in _result(_engine(server.url, "store"))
    after = _result(_engine(server.url, "load"))
    assert after == {"hit": True, "correct": True, "recompute": 0, "reason": ""}


def test_concurrent_writers_of_one_context(server):
    """Three engines store the same context at once: each either publishes (one wins each
    race; a later writer overwrites) or is told it lost (StoreRaceLostError); the result
    loads intact, and a reader racing them sees nothing or the complete context."""
    ws = [_engine(server.url, "store") for _ in range(3)]
    r = _engine(server.url, "load")
    outs = [_result(w) for w in ws]
    assert all(("stored" in o) != ("lost" in o) for o in outs)
    assert any("stored" in o for o in outs)
    racing = _result(r)
    assert racing["correct"] or (not racing["hit"] and racing["reason"] == "unknown key")
    assert _result(_engine(server.url, "load"))["correct"]


def test_evicted_chunk_is_a_clean_partial_miss(server):
    """A chunk removed (as eviction does) -> that chunk's tokens are recomputed (text
    fallback), the other chunks load and are right."""
    ids, chunks, ranges = _context()
    with RedisStoreClient(server.url) as c:
        key = c.put_context("m", "w", TAG, ids, chunks, ranges)
        gen = c.get_manifest(key).gen
        c.backend.delete(f"ctx/{key}/g/{gen}/2/1")
        res = _load(c, key)  # the lookup sees the hole: the entry is dropped, a clean miss
        assert not res.hit and "1 of 8 chunks missing" in res.reason and not c.has(key)
        key = c.put_context("m", "w", TAG, ids, chunks, ranges)  # stored again: it loads
        assert _load(c, key).decoded == [standin.decode(x) for x in chunks[2]]
        # evicted after the lookup: that chunk is recomputed, the others load and are right
        m = c.get_manifest(key, model_id="m")

        class Late(RedisStoreClient):
            def get_manifest(self, *a, **kw):
                c.backend.delete(f"ctx/{key}/g/{m.gen}/2/1")
                return m

        late = Late(server.url)
        res = _load(late, key)
        assert res.hit and res.error is None
        assert res.text_token_ranges == [ranges[1]]
        assert "missing" in res.chunks[1].note
        for i in (0, 2, 3):
            assert res.decoded[i] == standin.decode(chunks[2][i])
        assert not c.has(key)  # and the entry is dropped: the next lookup misses


def test_eviction_under_small_maxmemory():
    """allkeys-lru at 4 MiB with 8 contexts of ~0.9 MB: Redis evicts; every load is either a
    clean miss, a clean partial miss (text fallback) or a full hit - never a wrong chunk."""
    with RedisServer(maxmemory="4mb", policy="allkeys-lru") as srv, RedisStoreClient(srv.url) as c:
        stored = []
        for s in range(8):
            ids, chunks, ranges = _context(n_chunks=3, size=150_000, seed=s)
            stored.append((c.put_context("m", "w", TAG, ids, chunks, ranges), chunks))
        assert c.backend.info("stats")["evicted_keys"] > 0
        kinds = []
        for key, chunks in stored:
            res = _load(c, key)
            if not res.hit:
                # manifest evicted, or chunks evicted (the lookup drops the entry): clean miss
                assert res.reason == "unknown key" or res.reason.startswith("entry incomplete")
                kinds.append("miss")
                continue
            for st in res.chunks:
                if st.text_fallback:
                    assert "missing" in st.note
                else:
                    assert res.decoded[st.index] == standin.decode(chunks[2][st.index])
            kinds.append("partial" if res.recompute_tokens else "hit")
        assert "hit" in kinds and ("miss" in kinds or "partial" in kinds), kinds


def _saves_behind(policy: str, n: int = 24, size: int = 150_000,
                  n_chunks: int = 4) -> tuple[list[Exception | None], str]:
    """n saves (`n_chunks` chunks of ~`size` bytes) through a store server over a 2 MB Redis with
    `policy`: the error of each (None when saved), and the Redis address as messages name it."""
    from streaming.errors import StoreError

    out = []
    with RedisServer(maxmemory="2mb", policy=policy) as srv, start_store_server(srv.url) as h, \
            h.client(timeout=10) as c:
        for s in range(n):
            ids, chunks, ranges = _context(n_chunks=n_chunks, size=size, levels=(1,), seed=100 + s)
            try:
                c.put_context("m", "w", TAG, ids, chunks, ranges)
                out.append(None)
            except StoreError as e:
                out.append(e)
        return out, srv.url.split("//", 1)[1]


@pytest.mark.parametrize("policy", ["allkeys-lfu", "allkeys-lru", "allkeys-random"])
def test_save_refused_because_redis_evicted_says_so(policy):
    """Behind an evicting Redis the store server refuses saves whose chunks Redis evicted
    before the manifest: the message names the eviction, the policy and the fix, and never
    blames the caller's order of steps."""
    # each save (8 chunks of 250 kB) is as large as the whole Redis, so writing its last chunks
    # must evict some of its own earlier ones before the manifest: every save is refused,
    # whichever keys the policy samples (smaller saves leave that to chance); each chunk alone
    # fits, so Redis evicts rather than refusing the write
    results, where = _saves_behind(policy, n=4, size=250_000, n_chunks=8)
    errors = [e for e in results if e is not None]
    assert len(errors) == 4, ("a save larger than a 2 MB evicting Redis was stored", results)
    for e in errors:
        msg = str(e)
        assert f"missing: evicted: Redis at {where} evicts keys (maxmemory-policy {policy}, " in msg, msg
        assert "keys evicted so far" in msg and "needs maxmemory-policy noeviction" in msg, msg
        assert "put chunks before" not in msg, msg


@pytest.mark.parametrize("policy", ["noeviction", "volatile-lru"])
def test_save_refused_by_a_full_redis_that_does_not_evict(policy):
    """Under noeviction, or volatile-* (the store's keys have no TTL), a full Redis refuses
    the write itself (StoreFullError), no eviction is claimed, and the first save, made
    before it filled up, succeeded."""
    from streaming.errors import StoreFullError

    results, _ = _saves_behind(policy, n=8)
    errors = [e for e in results if e is not None]
    assert errors and all(isinstance(e, StoreFullError) for e in errors), errors
    assert not [e for e in errors if "evicts keys" in str(e) or "missing" in str(e)]
    assert results[0] is None


def test_lookup_of_an_entry_that_lost_a_chunk_names_the_eviction():
    """A lookup that finds an entry's chunk gone, in a Redis that has been evicting under
    allkeys-lru, says the entry is incomplete and names the policy; in one that has not,
    only "evicted or deleted"."""
    with RedisServer(maxmemory="2mb", policy="allkeys-lru") as srv, RedisStoreClient(srv.url) as c:
        ids, chunks, ranges = _context(n_chunks=2, size=1000, levels=(1,))
        key = c.put_context("m", "w", TAG, ids, chunks, ranges)
        gen = c.get_manifest(key).gen
        c.backend.delete(f"ctx/{key}/g/{gen}/1/1")  # deleted: this Redis has evicted nothing yet
        assert c.get_manifest(key) is None
        assert c.last_miss_reason == "entry incomplete: 1 of 2 chunks missing (evicted or deleted); entry dropped"
        filler = b"x" * 100_000
        for i in range(60):  # past maxmemory: Redis evicts (the filler, the entry's keys)
            c.backend.put(f"filler/{i}", filler)
        assert c.backend.info("stats")["evicted_keys"] > 0
        for k in list(c.backend.keys("filler/")):  # room again; the eviction count stays
            c.backend.delete(k)
        key = c.put_context("m", "w", TAG, ids, chunks, ranges)
        gen = c.get_manifest(key).gen
        c.backend.delete(f"ctx/{key}/g/{gen}/1/0")
        assert c.get_manifest(key) is None
        why = c.last_miss_reason
        assert why.startswith("entry incomplete: 1 of 2 chunks missing (evicted or deleted; Redis at "), why
        assert "evicts keys (maxmemory-policy allkeys-lru, maxmemory 2097152 bytes, " in why, why


def test_put_manifest_before_its_chunks_blames_the_caller(server):
    """Without eviction, a manifest whose chunk was never put is refused with the order of
    steps named (the eviction wording only when Redis evicts)."""
    from streaming.errors import StoreError
    from streaming.store import build_manifest, new_generation

    ids, chunks, ranges = _context(n_chunks=2, size=1000)
    key, man = build_manifest("m", "w", TAG, ids, chunks, ranges)
    man = dict(man, gen=new_generation())
    with RedisStoreClient(server.url) as c:
        c.put_chunk(key, 1, 0, chunks[1][0], gen=man["gen"])
        with pytest.raises(StoreError, match="chunk 1 level 1 missing: put chunks before the manifest"):
            c.put_manifest(man)


def test_corrupt_value_fails_crc_and_is_reported(server):
    """A stored chunk whose bytes no longer match the manifest CRC32 is treated as a miss
    (refetched once, then recomputed from text) and reported in the chunk's note."""
    ids, chunks, ranges = _context()
    with RedisStoreClient(server.url) as c:
        key = c.put_context("m", "w", TAG, ids, chunks, ranges)
        k = f"ctx/{key}/g/{c.get_manifest(key).gen}/2/2"
        bad = bytearray(c.backend.get(k))
        bad[len(bad) // 2] ^= 0xFF  # same length, one byte flipped
        c.backend.put(k, bytes(bad))
        res = _load(c, key)
        st = res.chunks[2]
        assert st.text_fallback and not st.crc_ok and "CRC/sha256 mismatch" in st.note
        assert res.text_token_ranges == [ranges[2]]
        assert [res.decoded[i] for i in (0, 1, 3)] == [standin.decode(chunks[2][i]) for i in (0, 1, 3)]
        assert not c.has(key)  # the rotten entry is dropped: no entry that fails every load


def test_redis_down_at_start(tmp_path):
    url = f"redis://127.0.0.1:{free_port()}/0"
    t0 = time.monotonic()
    with pytest.raises(RedisUnavailableError, match="python -m streaming.store.redis_server"):
        RedisStoreClient(url)
    # asked to fall back: the local store is used instead
    b = open_redis_backend(url, fallback_dir=tmp_path / "local")
    assert isinstance(b, LocalFolderBackend)
    with pytest.raises(ValueError):  # a malformed URL never silently falls back
        open_redis_backend("redis://host:port/0", fallback_dir=tmp_path / "local")
    assert time.monotonic() - t0 < 15


def test_redis_gone_before_load_is_a_clean_miss():
    with RedisServer() as srv:
        ids, chunks, ranges = _context(n_chunks=2)
        c = RedisStoreClient(srv.url, socket_timeout_s=2)
        key = c.put_context("m", "w", TAG, ids, chunks, ranges)
        srv.kill()
        res = _load(c, key)
        assert not res.hit and "unreachable" in res.reason


def _load_killing_redis(srv, c, key, chunks, limit_s: float):
    """Load `key` through `c`, SIGKILLing `srv` once chunk 0 is decoded, and check the
    failover every such load shows: done within limit_s, a hit with an error, chunk 0 (read
    before the kill) decoded right, the tail recomputed. Returns the LoadResult."""

    def on_decoded(i, out):
        if i == 0:
            srv.kill()

    t0 = time.monotonic()
    res = _load(c, key, on_decoded=on_decoded, queue_depth=1)
    assert time.monotonic() - t0 < limit_s
    assert res.hit and res.error and res.recompute_tokens > 0
    assert res.decoded[0] == standin.decode(chunks[2][0]) and res.chunks[-1].text_fallback
    return res


def test_redis_killed_mid_load_fails_over_to_recompute():
    """SIGKILL after the first chunk is decoded: the chunks already received are used, the
    rest fall back to text (recompute), LoadResult.error says why, nothing hangs."""
    with RedisServer() as srv:
        ids, chunks, ranges = _context(n_chunks=8, size=300_000)
        c = RedisStoreClient(srv.url, socket_timeout_s=3)
        key = c.put_context("m", "w", TAG, ids, chunks, ranges)
        res = _load_killing_redis(srv, c, key, chunks, limit_s=20)
        assert "connection lost" in res.error and res.chunks[0].text_fallback is False
        for st in res.chunks:  # whatever was decoded is right
            if not st.text_fallback:
                assert res.decoded[st.index] == standin.decode(chunks[2][st.index])
        c.close()


def _netns_ok() -> tuple[bool, str]:
    from streaming.link import netns_available

    return netns_available()


@pytest.mark.skipif(not _netns_ok()[0], reason=f"network namespaces unavailable: {_netns_ok()[1]}")
def test_redis_behind_the_shaped_link():
    """Redis inside the link's server namespace: the engine's loads cross the tbf-shaped
    veth. Checks the data and that a load takes at least bytes*8/rate (it went through the
    shaper); speeds are reported by benchmarks, not asserted beyond that physical bound."""
    from streaming.link import ShapedLink

    ids, chunks, ranges = _context(n_chunks=4, size=250_000)
    with ShapedLink(50, method="netns") as link, RedisServer(link=link) as srv:
        with RedisStoreClient(srv.url) as c:
            key = c.put_context("m", "w", TAG, ids, chunks, ranges)
            res = _load(c, key)
            assert res.hit and res.recompute_tokens == 0
            assert res.decoded == [standin.decode(x) for x in chunks[2]]
            assert res.total_s >= 0.9 * res.bytes * 8 / 50e6


def test_store_server_with_redis_down_at_start_exits_cleanly():
    url = f"redis://127.0.0.1:{free_port()}/0"
    cp = subprocess.run([sys.executable, "-m", "streaming.store", "serve", "--backend", url],
                        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert cp.returncode == 2 and "unavailable" in cp.stderr and "Traceback" not in cp.stderr


def test_store_server_loses_redis_mid_load():
    """The store server's Redis dies during a load: the server answers errors (it keeps
    running), the client recomputes the rest, nothing hangs."""
    with RedisServer() as srv:
        ids, chunks, ranges = _context(n_chunks=6, size=200_000)
        with start_store_server(srv.url) as h, h.client(timeout=10) as c:
            key = c.put_context("m", "w", TAG, ids, chunks, ranges)
            _load_killing_redis(srv, c, key, chunks, limit_s=30)
            assert h.alive()
