"""One store entry holding every level of a context, made from the connector's single-level
saves: the adaptive mode of the serve-load benchmark picks a level (or text) per chunk, so
its entry must store several levels, while a save request through vLLM's connector
encodes and stores one level (its identity, hence its key, names that level).

The pre-fill therefore saves a reused context once per level (vLLM's own KV, encoded by
the connector at that level), and :func:`merge_levels` copies those entries' chunk bytes
unchanged into one entry whose identity lists every level (the identity the connector
would write for a multi-level save: same model, dtype, shape, partition, codec and
version), indexes it for prefix matching in the same namespace as the connector
(``third_party.vllm.prefix_chain.index_entry``) and deletes the single-level entries (the prefix
index drops their records at the first lookup that meets them).

Paper: CacheGen (Liu et al., SIGCOMM 2024) section 5.2: each chunk is encoded at several
quality levels, and the streamer picks one per chunk from the measured link.

Run: part of ``python -m bench.serve_load --modes adaptive``.
"""

from __future__ import annotations

from typing import Any, Sequence

from streaming.identity import EntryIdentity
from third_party.vllm.prefix_chain import index_entry
from third_party.vllm.sources.base import prefix_namespace


def merge_levels(client, keys: Sequence[str], codec: str) -> dict[str, Any]:
    """Merge single-level entries of one context into one multi-level entry.

    client: a streaming.store StoreClient (or LocalStoreClient); keys: the context keys of
    the single-level entries (each saved with a full identity: model id and weights hash),
    all of the same tokens, chunking, model and codec, each storing one distinct level;
    codec: the codec name recorded in the prefix index.
    Returns {"key": the merged entry's key, "levels": stored levels (ascending),
    "bytes": {level: bytes of its chunks}, "deleted": keys deleted}.
    Raises ValueError when an entry is missing, lacks a full identity, stores more than
    one level, or differs from the others in tokens, chunking or identity (other than its
    level), and what the client raises (streaming.errors.StoreError)."""
    if len(keys) < 2:
        raise ValueError(f"merging levels needs at least two single-level entries, got {len(keys)}")
    mans = []
    for k in keys:
        m = client.get_manifest(k)
        if m is None:
            raise ValueError(f"entry {k[:16]} is not in the store: {client.last_miss_reason}")
        if len(m.levels) != 1:
            raise ValueError(f"entry {k[:16]} stores {len(m.levels)} levels, not one")
        mans.append(m)
    idents = [EntryIdentity.from_dict(m.identity) for m in mans]
    base = idents[0]
    if not (base.model_id and base.weights_hash):
        raise ValueError(f"entry {keys[0][:16]} has no full identity (model id and weights hash)")
    for k, m, ident in zip(keys, mans, idents):
        if m.token_ids != mans[0].token_ids or tuple(m.token_ranges) != tuple(mans[0].token_ranges):
            raise ValueError(f"entry {k[:16]} holds other tokens or another chunking than {keys[0][:16]}")
        if ident.replace(level_configs=()) != base.replace(level_configs=()):
            raise ValueError(f"entry {k[:16]} was made by another model or codec than {keys[0][:16]}")
    levels = [m.levels[0] for m in mans]
    if len(set(levels)) != len(levels):
        raise ValueError(f"the entries store the same level twice: {levels}")
    chunks: dict[int, list[bytes]] = {}
    for k, m in zip(keys, mans):
        lv = m.levels[0]
        got = [client.get_chunk(k, lv, i, gen=m.gen) for i in range(len(m.token_ranges))]
        if any(c is None for c in got):
            raise ValueError(f"entry {k[:16]} lost a chunk at level {lv}: {client.last_miss_reason}")
        chunks[lv] = got
    merged = base.replace(level_configs=tuple(pair for ident in idents for pair in ident.level_configs))
    key = client.put_entry(merged, mans[0].token_ids, chunks, mans[0].token_ranges, meta=dict(mans[0].meta))
    index_entry(client, prefix_namespace(merged.weights_hash, merged.partition), mans[0].token_ids, key, codec)
    deleted = [k for k in keys if k != key]
    for k in deleted:
        client.delete_context(k)
    return {"key": key, "levels": sorted(chunks), "bytes": {lv: sum(map(len, c)) for lv, c in chunks.items()},
            "deleted": deleted}
