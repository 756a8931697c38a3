"""RedisStoreClient: the streaming.store.StoreClient interface straight over Redis.

Paper: CacheGen section 5 (the engine streams encoded KV chunks from a remote store); see
docs/redis.md. Moved out of streaming.store.redis_backend so that the Redis
backend, which streaming.store.backend.open_backend loads, does not import streaming.store (which
imports streaming.store.backend): this module sits above both. Not runnable by itself.
"""

from __future__ import annotations

from typing import Sequence

from streaming.shutdown import Closing
from streaming.store.redis_backend import RedisBackend
from streaming.store.redis_cluster import RedisClusterBackend, is_cluster_url
from streaming.identity import level_key


class RedisStoreClient(Closing):
    """The streaming.store.StoreClient interface straight over Redis, for stream_load.

    The engine process talks to Redis itself (through the shaped link when Redis runs in
    the link's server namespace): no store server in between. Keys, manifest format and
    checks are streaming.store's (KVStore); a miss sets `last_miss_reason`.

    Writes: `put_context` writes every chunk under a fresh write generation, then the
    manifest with a compare-and-swap (a Lua script), so a reader sees the old entry, the
    new one or nothing, and of two concurrent writers of one key exactly one wins (the
    other gets StoreRaceLostError). Reads: get_manifest checks that every chunk the
    manifest names is stored (one EXISTS): an entry that lost chunks to eviction is
    dropped and is a clean miss; a chunk evicted after that check, or failing its sha256
    / CRC32 / size, is recomputed from text (ChunkStat.note) and the entry is dropped.

    Args: url (redis://HOST:PORT/DB, or redis+cluster://HOST:PORT[,...] for a Redis
    Cluster: streaming.store.redis_cluster) and RedisBackend keyword arguments. Raises
    RedisUnavailableError if Redis is not reachable.
    """

    def __init__(self, url: str, **backend_kw):
        from streaming.store.kv import KVStore  # lazy, as the other store imports here

        self.url = url
        self._kw = backend_kw
        if is_cluster_url(url):  # redis+cluster://: the same store over a Redis Cluster
            self.backend = RedisClusterBackend(url, **backend_kw)
        else:
            self.backend = RedisBackend(url, **backend_kw)
        self.store = KVStore(self.backend)
        self.last_miss_reason = ""

    def __repr__(self) -> str:
        return f"RedisStoreClient({self.url!r})"

    # connection management, as StoreClient
    def clone(self) -> "RedisStoreClient":
        return RedisStoreClient(self.url, **self._kw)

    def connect(self) -> None:
        self.backend.ping()

    def reconnect(self) -> None:
        """Drop pooled connections and check the server answers (RedisUnavailableError)."""
        self.backend.close()
        self.backend.ping()

    def close(self) -> None:
        self.backend.close()

    def ping(self) -> bool:
        self.backend.ping()
        return True

    # reads
    def get_manifest(self, key: str, model_id=None, weights_hash=None, codec_tag=None, identity=None,
                     gen=None):
        """streaming.store.Manifest of a stored context (gen: of that write generation),
        or None (clean miss; reason in last_miss_reason: unknown key, evicted manifest or
        chunks - the entry is then dropped -, corrupt or foreign entry - another model or
        codec config, checked with streaming.identity.check_entry)."""
        m, why = self.store.get_manifest(key, model_id, weights_hash, codec_tag, identity, gen=gen)
        if m is None:
            self.last_miss_reason = why
        return m

    def get_chunk(self, key: str, level: int | None, index: int, gen: str | None = None) -> bytes | None:
        """Bytes of chunk `index` at `level` of write generation `gen` (None: the current
        entry's, or a raw slot), or None if absent (evicted or never stored)."""
        data = self.store.get_chunk(key, level, index, gen)
        if data is None:
            self.last_miss_reason = f"no chunk {int(index)} at level {level_key(level)} (evicted or never stored)"
        return data

    def iter_chunks(self, key: str, plan: Sequence[tuple[int, int]], depth: int | None = None,
                    gen: str | None = None):
        """Prefetching reads of chunks [(level, index), ...] of write generation `gen` (a
        manifest's .gen; None: the current entry's) in order: yields FetchedValue (key,
        data or None, fetch_s, wait_s); see RedisBackend.get_many_iter."""
        from streaming.store.format import chunk_key

        if gen is None:
            gen = self.store.current_gen(key) or None
        return self.backend.get_many_iter([chunk_key(key, lv, i, gen) for lv, i in plan], depth,
                                          with_timing=True)

    # write steps and entry maintenance (streaming.store.save_steps, KVStore)
    def current_gen(self, key: str):
        return self.store.current_gen(key)

    def manifest_raw(self, key: str) -> bytes | None:
        from streaming.store.format import manifest_key

        return self.backend.get(manifest_key(key))

    def publish_atomic(self, man: dict, chunks: dict, base_raw: bytes | None) -> None:
        """Chunks (under man["gen"]) and manifest in one Lua script, if the key still holds
        `base_raw`. A lost or late reply (redis-py re-sends the script once on a broken
        connection: the script recognises its own manifest) is settled by asking Redis
        (RedisBackend.settle_publish, up to SETTLE_TRIES times): published - success; not -
        it never will be. A refusal is checked the same way (this write may be the one that
        a later writer replaced). Raises StoreRaceLostError when another writer published
        first, StoreOutcomeUnknownError when Redis never answers the question; a script that
        wrote nothing raises the error that stopped it."""
        import json

        from streaming.errors import StoreRaceLostError
        from streaming.store.format import chunk_key, manifest_key, abort_marker_key
        from streaming.store.kv import OUTCOME_UNKNOWN

        key, gen = man["key"], man["gen"]
        blob = json.dumps(man).encode("utf-8")
        items = [(chunk_key(key, lv, i, gen), bytes(c)) for lv in man["levels"]
                 for i, c in enumerate(chunks[lv])] + [(manifest_key(key, gen), blob)]
        mk, abort = manifest_key(key), abort_marker_key(key, gen)
        try:
            if self.backend.publish_many(mk, base_raw, blob, items, abort_key=abort):
                return
        except OUTCOME_UNKNOWN as e:
            self._settle(key, gen, e)  # returns only if published
            return
        race = StoreRaceLostError(f"another writer published key {key[:16]} first: the store "
                                  "keeps the other complete entry")
        self._settle(key, gen, race)

    def _settle(self, key: str, gen: str, err: BaseException) -> None:
        """streaming.store.kv.settle over Redis: nothing to delete (an unpublished
        script wrote nothing), the question asked with RedisBackend.settle_publish."""
        from streaming.store.format import manifest_key, abort_marker_key
        from streaming.store.kv import settle

        mk, abort = manifest_key(key), abort_marker_key(key, gen)
        settle(lambda k, g, levels, n: self.backend.settle_publish(mk, abort, g), key, gen, [], 0, err)

    def put_chunk(self, key: str, level: int | None, index: int, data: bytes, gen: str | None = None) -> None:
        self.store.put_chunk(key, level, index, data, gen)

    def put_manifest(self, manifest: dict, **base_gen):
        """Publish (streaming.store.KVStore.put_manifest; base_gen as there)."""
        return self.store.put_manifest(manifest, **base_gen)

    def discard(self, key: str, gen: str, levels, chunk_count: int) -> None:
        self.store.discard(key, gen, levels, chunk_count)

    def invalidate(self, key: str, gen: str, reason: str) -> bool:
        return self.store.invalidate(key, gen, reason)

    def put_calibration(self, h: str, data: bytes) -> None:
        self.store.put_calibration(h, data)

    def has_calibration(self, h: str) -> bool:
        return self.store.has_calibration(h)

    def get_calibration(self, h: str) -> bytes | None:
        data = self.store.get_calibration(h)
        if data is None:
            self.last_miss_reason = f"no calibration {h[:16]} (evicted or never stored)"
        return data

    def list_contexts(self, limit: int = 10000) -> list[str]:
        return self.store.list_contexts(limit)

    def has(self, key: str) -> bool:
        return self.store.get_manifest(key)[0] is not None

    def delete_context(self, key: str) -> None:
        self.store.delete_context(key)

    # writes
    def put_context(self, model_id: str, weights_hash: str, codec_tag: str, token_ids: Sequence[int],
                    chunks: dict[int | None, Sequence[bytes]], token_ranges: Sequence[tuple[int, int]],
                    meta: dict | None = None, identity=None,
                    calibrations: dict[str, bytes] | None = None) -> str:
        """Store a context (same arguments as streaming.store.StoreClient.put_context):
        chunks[level][i] = encoded bytes of chunk i at that level, token_ranges[i] =
        (start, end) of chunk i in token_ids. Steps (streaming.store.save_steps): the
        calibration (cal/<hash>), then the chunks under a fresh write generation and the
        manifest in ONE Lua script that first checks the key still holds what this
        writer read (compare-and-swap): all of it lands or none. Returns the context key.
        Raises (before anything is written) ValueError when a level's chunk count differs
        from token_ranges, StoreError when the ranges do not tile token_ids (as StoreClient
        does); StoreRaceLostError when another writer published the key first; a
        streaming.errors.StoreError subclass when Redis refuses or fails (then no new
        entry is visible)."""
        from streaming.store.format import build_manifest
        from streaming.store.kv import run_steps, save_steps

        key, man = build_manifest(model_id, weights_hash, codec_tag, token_ids, chunks, token_ranges,
                                  meta, identity)
        run_steps(save_steps(self, man, chunks, calibrations))
        return key

    def put_entry(self, identity, token_ids: Sequence[int], chunks: dict[int | None, Sequence[bytes]],
                  token_ranges: Sequence[tuple[int, int]], meta: dict | None = None,
                  calibrations: dict[str, bytes] | None = None) -> str:
        """put_context keyed by a full streaming.identity.EntryIdentity (see
        streaming.store.StoreClient.put_entry)."""
        identity.require_complete()
        return self.put_context(identity.model_id, identity.weights_hash, identity.codec_tag(),
                                token_ids, chunks, token_ranges, meta, identity, calibrations)

