"""Longest stored prefix of a prompt, by chunk: a hash chain over fixed-size token chunks.

Purpose: a request that merely SHARES a prefix with a stored context -
a chat request (the chat template adds tokens before the context), a completion whose
prompt continues differently - must load every stored chunk it shares and prefill only
the rest, without naming the context.

Algorithm (as LMCache's token database, `lmcache/v1/token_database.py: ChunkedTokenDatabase`,
which keys chunk i by a hash of the previous chunk's key and chunk i's tokens):
    key_0 = H("cgh-prefix-chain-v1", namespace)       namespace = the model's weights hash
    key_i = H(key_{i-1}, tokens[(i-1)*C : i*C])          i = 1, 2, ...; C = CHAIN_TOKENS (256)
so key_i names the prefix of i*C tokens and nothing else. When a context is stored (entry
key E, N tokens), an index record is written under every key_i with i*C <= N, listing
E (and any other entry sharing that prefix). A reader computes key_1..key_m of the prompt
and finds the largest i with a record by binary search (the records of one entry are
downward closed, so is their union): O(log m) store round trips. The entry's manifest is
then read with the usual identity check (streaming.identity.check_entry) and its token ids
compared with the prompt: the longest common prefix is what can be loaded (KV of token t
depends only on tokens <= t, so the first tokens of a longer context are exact).

Records live in the KV store as chunks (no level, index 0: they are not KV) under key_i (64 hex, domain
separated from context keys): JSON {"format", "entries": [{"key", "tokens", "codec"}]}.
Stale records (a deleted or evicted entry) are dropped by `find_loadable`, which falls
back from the longest indexed prefix to shorter chain levels until an entry really loads
(two entries share 512 tokens, the longer is deleted: the shorter still gives
512). No vLLM import; unit-tested in tests/vllm_connector/test_connector_prefix.py. Not runnable.
"""

from __future__ import annotations

import array
import hashlib
import json
import sys
from typing import Any, Sequence

from cachegen_common.bounded_json import parse as parse_bounded_json

CHAIN_TOKENS = 256   # tokens per chain link (LMCache's default chunk size); multiple of 128
INDEX_FORMAT = "cgh-prefix-index-v2"
MAX_ENTRIES = 16     # entries listed per record (most recent kept)
# A record lists MAX_ENTRIES entries of ~150 bytes; a stored record over 64 KiB is not ours
# and is read as no record, like any malformed one.
MAX_RECORD_BYTES = 64 << 10
_DOMAIN = b"cgh-prefix-chain-v1\x00"


def _ids_bytes(ids: Sequence[int]) -> bytes:
    a = array.array("q", [int(t) for t in ids])
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def chain_keys(namespace: str, token_ids: Sequence[int], chunk: int = CHAIN_TOKENS) -> list[str]:
    """key_1..key_m (64-hex sha256) of the m = len(token_ids) // chunk full chunks.

    namespace: the model's weights hash (streaming.identity.folder_weights_hash): prefixes
    of another model never share keys. Raises ValueError on an empty namespace or chunk < 1.
    """
    if not namespace or not isinstance(namespace, str):
        raise ValueError("the prefix chain needs a namespace (the model's weights hash)")
    if chunk < 1:
        raise ValueError("chunk must be >= 1")
    prev = hashlib.sha256(_DOMAIN + namespace.encode("utf-8")).digest()
    out = []
    for i in range(len(token_ids) // chunk):
        prev = hashlib.sha256(prev + _ids_bytes(token_ids[i * chunk:(i + 1) * chunk])).digest()
        out.append(prev.hex())
    return out


def _read_record(client, key: str) -> list[dict[str, Any]]:
    data = client.get_chunk(key, None, 0)
    if not data:
        return []
    try:
        rec = parse_bounded_json(data, what="prefix index record", max_bytes=MAX_RECORD_BYTES, expect=dict)
        entries = rec.get("entries", [])
        if rec.get("format") != INDEX_FORMAT or not isinstance(entries, list):
            return []
        return [e for e in entries if isinstance(e, dict)
                and isinstance(e.get("key"), str) and isinstance(e.get("tokens"), int)]
    except ValueError:
        return []  # a malformed record is no record


def index_entry(client, namespace: str, token_ids: Sequence[int], entry_key: str,
                codec: str = "", chunk: int = CHAIN_TOKENS) -> int:
    """Register a stored entry (its context key and token ids) under every chain key of its
    full chunks. client: streaming.store.StoreClient. Returns the number of records written
    (0 for a context shorter than one chunk). Raises what the client raises."""
    n = 0
    for key in chain_keys(namespace, token_ids, chunk):
        entries = [e for e in _read_record(client, key) if e["key"] != entry_key]
        entries.append({"key": entry_key, "tokens": len(token_ids), "codec": codec})
        rec = {"format": INDEX_FORMAT, "entries": entries[-MAX_ENTRIES:]}
        client.put_chunk(key, None, 0, json.dumps(rec).encode())
        n += 1
    return n


def find_longest(client, namespace: str, token_ids: Sequence[int], max_tokens: int | None = None,
                 chunk: int = CHAIN_TOKENS) -> tuple[int, list[dict[str, Any]], int]:
    """Longest chain prefix of token_ids with an index record.

    max_tokens: only prefixes of at most this many tokens (e.g. len(prompt) - 1).
    Returns (matched tokens = i * chunk, the record's entries (longest first), round trips);
    (0, [], trips) when even the first chunk is unknown. Raises what the client raises.
    """
    limit = len(token_ids) if max_tokens is None else min(len(token_ids), max_tokens)
    keys = chain_keys(namespace, token_ids[:limit], chunk)
    lo, hi, best, trips = 0, len(keys), ([], 0), 0   # invariant: prefix lo*chunk is known
    while lo < hi:
        mid = (lo + hi + 1) // 2
        entries = _read_record(client, keys[mid - 1])
        trips += 1
        if entries:
            lo, best = mid, (entries, mid)
        else:
            hi = mid - 1
    entries, i = best
    entries = sorted(entries, key=lambda e: -e["tokens"])
    return i * chunk, entries, trips


def _drop_from_record(client, key: str, dead: set[str]) -> None:
    """Rewrite one index record without the entries in `dead` (best effort: a concurrent
    index_entry may re-add one; a record left empty is written empty = no record)."""
    entries = _read_record(client, key)
    keep = [e for e in entries if e["key"] not in dead]
    if len(keep) != len(entries):
        client.put_chunk(key, None, 0, json.dumps({"format": INDEX_FORMAT, "entries": keep}).encode()
                         if keep else b"")


def find_loadable(client, namespace: str, token_ids: Sequence[int], usable,
                  max_tokens: int | None = None, chunk: int = CHAIN_TOKENS
                  ) -> tuple[int, str | None, Any, dict[str, Any]]:
    """The longest indexed prefix of token_ids whose entry really loads.

    usable(entry key) -> (manifest or None, miss reason): the caller's full check (identity,
    chunks present). Starts at the longest chain level with a record (find_longest) and
    walks down level by level; an entry whose manifest is gone ("unknown key") or that the
    store dropped ("entry incomplete") is removed from every record visited. Returns
    (matched tokens = level * chunk, entry key or None, its manifest, info {trips,
    dropped, tried, miss}). Raises what the client raises."""
    limit = len(token_ids) if max_tokens is None else min(len(token_ids), max_tokens)
    keys = chain_keys(namespace, token_ids[:limit], chunk)
    n, entries, trips = find_longest(client, namespace, token_ids, max_tokens, chunk)
    level = n // chunk
    dead: set[str] = set()
    tried: dict[str, str] = {}
    info: dict[str, Any] = {"trips": trips, "dropped": 0, "tried": 0}
    while level >= 1:
        if level != n // chunk:
            entries = sorted(_read_record(client, keys[level - 1]), key=lambda e: -e["tokens"])
            info["trips"] += 1
        stale = False
        for e in entries:
            k = e["key"]
            if k in dead:
                stale = True
                continue
            if k in tried:
                continue
            m, why = usable(k)
            info["tried"] += 1
            if m is not None:
                if stale:
                    _drop_from_record(client, keys[level - 1], dead)
                info["dropped"] = len(dead)
                return level * chunk, k, m, info
            tried[k] = why or "miss"
            if why == "unknown key" or str(why).startswith("entry incomplete"):
                dead.add(k)
                stale = True
        if stale:
            _drop_from_record(client, keys[level - 1], dead)
        level -= 1
    info["dropped"] = len(dead)
    if tried:
        info["miss"] = "no indexed entry sharing the prompt's prefix loads: " + "; ".join(
            f"{k[:12]}: {w}" for k, w in list(tried.items())[:3])
    return 0, None, None, info


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token-id sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
