"""StoreSource ("store"): a context's KV from our KV store server (streaming.store).

Part of third_party.vllm.sources (whose face forwards the public names here): chunks fetched and
decoded by streaming.load.stream_load through the (shaped) link, with the prefix policy.
No vLLM import. Not runnable by itself.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from streaming.identity import NO_LEVEL_KEY, EntryIdentity, codec_identity, parse_level
from third_party.vllm.sources.base import (
    ChunkSink,
    DecodeFn,
    LoadStats,
    Lookup,
    SourceError,
    SourceMiss,
    identity_miss_lookup,
    matched_tokens,
    window_checked,
    default_decode_fn,
    encode_for_save,
    expected_identity,
    lookup_subject,
    prefix_namespace,
)
from third_party.vllm.sources.local import header_range, calibration_of

logger = logging.getLogger("cachegen.sources")


# --------------------------------------------------------------------------- KV store
def _parse_addr(addr: Any) -> tuple[str, int]:
    if isinstance(addr, (list, tuple)) and len(addr) == 2:
        return str(addr[0]), int(addr[1])
    host, sep, port = str(addr).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise SourceError(f"store address must be 'host:port', got {addr!r}")
    return host, int(port)


class _PrefixPolicy:
    """Wraps a streaming.adapt policy so that nothing is fetched after the first chunk that
    cannot be used: vLLM can only take a KV PREFIX, so once chunk k falls back to text (by
    the policy's choice, a CRC failure or a lost connection) every later chunk is
    recomputed anyway. Also stops at the first chunk not needed for [0, num_tokens)."""

    def __init__(self, inner, needed_chunks: int):
        self.inner = inner
        self.needed = needed_chunks
        self.stopped = False
        self.recompute_s = 0.0

    @property
    def decisions(self):
        return getattr(self.inner, "decisions", [])

    def start(self, manifest) -> None:
        self.inner.start(manifest)

    def choose(self, k: int, elapsed_s: float):
        if self.stopped or k >= self.needed:
            return None
        lv = self.inner.choose(k, elapsed_s)
        if lv is None:
            self.stopped = True
        return lv

    def transfer_deadline_s(self, k: int):
        f = getattr(self.inner, "transfer_deadline_s", None)
        return f(k) if f is not None else None

    def observe_transfer(self, k, level, nbytes, transfer_s, elapsed_end_s=None) -> None:
        if elapsed_end_s is None:  # (an inner policy may take only the older 4 arguments)
            self.inner.observe_transfer(k, level, nbytes, transfer_s)
        else:
            self.inner.observe_transfer(k, level, nbytes, transfer_s, elapsed_end_s)

    def should_abandon(self, k, received_bytes, elapsed_s, wire_bytes=None, wire_s=None) -> bool:
        f = getattr(self.inner, "should_abandon", None)
        if f is None:
            return False
        if wire_bytes is None:  # (an inner policy may take only the older 3 arguments)
            return bool(f(k, received_bytes, elapsed_s))
        return bool(f(k, received_bytes, elapsed_s, wire_bytes=wire_bytes, wire_s=wire_s))

    def observe_abandon(self, k, level, wire_s, received_bytes=None) -> None:
        if hasattr(self.inner, "observe_abandon"):
            if received_bytes is None:
                self.inner.observe_abandon(k, level, wire_s)
            else:
                self.inner.observe_abandon(k, level, wire_s, received_bytes)

    def observe_text(self, k) -> None:
        if hasattr(self.inner, "observe_text") and not self.stopped and k < self.needed:
            self.inner.observe_text(k)

    def observe_decode(self, k, decode_s) -> None:
        self.inner.observe_decode(k, decode_s)


def default_stored_level(codec_name: str | None, levels, points: dict | None = None) -> int | None:
    """The stored level a request without "level" fetches: None for an entry of a codec
    without levels (levels [None], or none listed), else the connector's operating point
    of the codec (``points``: codec -> level, extra config "target") or, without one, the
    codec's own default (codec.default_level, the same default as codec and harness) when
    the entry stores it, else the highest stored level. Raises ValueError for a malformed
    level."""
    import codec

    levels = [parse_level(x) for x in levels or [None]]
    if None in levels:
        return None
    if codec_name in codec.CODECS:
        d = (points or {}).get(codec_name, codec.default_level(codec_name))
        if d is not None and d in levels:
            return d
    return max(levels)


class StoreSource:
    """KV chunks from our KV store server (streaming.store) through the (shaped) link.

    params (per request, from kv_transfer_params; engine defaults fill the gaps):
      store: "host:port"; context_key: 64-hex key (streaming.store.context_key);
      level: stored quality level to fetch (default: the codec's default level,
        codec.default_level, when stored, else the highest stored; an entry of a codec
        without levels: its one slot, "none"), or a per-chunk list of levels with
        None = text fallback (experiments, tests);
      policy: {"slo_s", "prefill_tokens_per_s", "initial_throughput_mbps", ...} -> an
        streaming.adapt.AdaptivePolicy (per-chunk level or text fallback) instead of `level`;
      model_id / weights_hash / codec_tag: optional expectation checked against the manifest;
      identity: optional streaming.identity.EntryIdentity dict (the HF engine path gives the
        full identity it stored with), merged with the source's own `identity` (the
        connector's model); any mismatch is a miss with the reason, never data.
    The scheduler-side lookup reads the manifest (one round trip over the link) and checks
    that the stored token ids equal the prompt's prefix. The worker-side load runs
    streaming.load.stream_load (receiver thread fetching chunk k+1 while chunk k is decoded
    and injected in the calling thread).
    """

    name = "store"

    def __init__(self, decode_fn: DecodeFn | None = None, timeout_s: float = 30.0,
                 identity: EntryIdentity | None = None):
        self._decode_fn = decode_fn
        self.timeout_s = timeout_s
        self._clients: dict[tuple[str, int], Any] = {}
        self.identity = identity

    def _client(self, params):
        from streaming.store import StoreClient

        addr = _parse_addr(params.get("store"))
        c = self._clients.get(addr)
        if c is None:
            c = StoreClient(addr[0], addr[1], timeout=self.timeout_s)
            self._clients[addr] = c
        return c

    def _expect(self, params) -> dict[str, Any]:
        """Keyword expectation for get_manifest / stream_load. Raises ValueError when the
        request's identity conflicts with the source's own."""
        exp = {k: params.get(k) or None for k in ("model_id", "weights_hash", "codec_tag")}
        # always sent: even a reader that knows no field is in a partition ("" = shared)
        exp["identity"] = expected_identity(self.identity, params).to_dict()
        return exp

    def lookup(self, params: dict[str, Any], prompt_token_ids: list[int]) -> Lookup:
        from streaming.errors import StreamingError

        t0 = time.perf_counter()
        key = params.get("context_key")
        if not key and not params.get("prefix_match"):
            raise SourceError("store source needs 'context_key' (or prefix matching)")
        client = self._client(params)
        try:
            expect = self._expect(params)
        except ValueError as e:
            return identity_miss_lookup("store", params, str(e), t0, prompt_token_ids)
        info: dict[str, Any] = {}
        try:
            if key:
                man = client.get_manifest(key, **expect)
                why = "" if man is not None else (client.last_miss_reason or "not in store")
            else:  # prefix matching: the index names the entries sharing the prefix
                key, man, why, info = self._prefix_lookup(client, params, prompt_token_ids, expect)
        except (OSError, StreamingError) as e:
            raise SourceError(f"store {params.get('store')} unreachable: {e}") from e
        dt = time.perf_counter() - t0
        if man is None:
            why = info.get("miss") or why
            if why != "unknown key":
                logger.warning("store source: miss for %s: %s", lookup_subject(params, prompt_token_ids, key), why)
            return Lookup(0, lookup_s=dt, info={"miss": why, **info})
        stored = man.token_ids
        n_match = matched_tokens(params, prompt_token_ids, stored, len(stored))
        if n_match <= 0:
            return Lookup(0, lookup_s=dt, info={"miss": "stored token ids differ from the prompt"})
        chunk_tokens = [b - a for a, b in man.token_ranges]
        n_match, info = window_checked(man.identity, n_match, len(stored), info)
        if n_match <= 0:
            return Lookup(0, lookup_s=dt, info=info)
        # the plan this request keeps for its lifetime: the load verifies against it
        return Lookup(n_match, chunk_tokens, dt,
                      {"key": key, "levels": list(man.levels), "codec_tag": man.codec_tag,
                       "codec": (man.identity or {}).get("codec") or None,
                       "stored_tokens": len(stored), "gen": getattr(man, "gen", ""), **info})

    def _prefix_lookup(self, client, params, prompt: list[int], expect: dict):
        """(key, manifest, miss reason, info) of the longest indexed prefix of the prompt
        whose entry really loads (third_party.vllm.prefix_chain.find_loadable: falls back to
        shorter chain levels, drops index records of deleted / evicted entries)."""
        from third_party.vllm.prefix_chain import find_loadable

        ns = prefix_namespace((self.identity.weights_hash if self.identity else "")
                              or params.get("weights_hash") or "", str(params.get("cache_partition") or ""))
        if not ns:
            return None, None, "", {"miss": "prefix matching needs the model's weights hash"}

        def usable(k):
            m = client.get_manifest(k, **expect)
            return m, ("" if m is not None else (client.last_miss_reason or "not in store"))

        matched, key, man, fi = find_loadable(client, ns, prompt, usable)
        info = {"prefix_index_tokens": matched, "prefix_index_trips": fi["trips"],
                "prefix_index_dropped": fi["dropped"]}
        if man is None:
            info["miss"] = fi.get("miss") or \
                "no stored chunk matches the prompt's first tokens (prefix index)"
        return key, man, "", info

    def _policy(self, params, lookup: Lookup):
        from streaming.adapt.policy import AdaptivePolicy, FixedPolicy

        pol = params.get("policy")
        if pol:
            if not isinstance(pol, dict):
                raise SourceError("'policy' must be a dict of streaming.adapt.AdaptivePolicy args")
            try:  # a preset of streaming.adapt.params.PolicyParams + this request's inputs
                return AdaptivePolicy.from_request(pol)
            except (TypeError, ValueError) as e:
                raise SourceError(f"bad policy: {e}") from None
        level = params.get("level")
        if isinstance(level, (list, tuple)):  # per-chunk levels, None = text (experiments)
            return FixedPolicy([x if x is None or x == NO_LEVEL_KEY else int(x) for x in level])
        if level is None or level == NO_LEVEL_KEY:
            level = default_stored_level(lookup.info.get("codec"), lookup.info.get("levels"),
                                         params.get("operating_levels"))
            # an entry of a codec without levels: its slot, as streaming.load's policies name it
            return FixedPolicy(NO_LEVEL_KEY if level is None else level)
        if list(lookup.info.get("levels") or []) == [None]:
            raise SourceError(f"level {level} requested, but the entry's codec has no levels "
                              "(leave 'level' out)")
        return FixedPolicy(int(level))

    def save(self, params: dict[str, Any], token_ids: list[int], k, v) -> dict[str, Any]:
        """Encode and put one context into the store (params: store, model_id,
        weights_hash, codec_tag (default: the codec name), codec, level (the codec level;
        default the codec's, codec.resolve_level; None for a codec without levels, stored
        in its own slot, streaming.identity.level_slot), chunk_tokens). Returns {"encode_s", "put_s", "bytes", "context_key"}."""
        chunks, sizes, enc_s = encode_for_save(params, k, v, self.identity)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        ranges = [(a, a + t) for a, t in zip(starts, sizes)]
        ident = codec_identity(expected_identity(self.identity, params), params.get("codec", "raw"),
                               [params.get("level")], calibration_hash=calibration_of(chunks))
        t0 = time.perf_counter()
        client = self._client(params)
        # the operating point a save of the connector's "target" was encoded at (not identity)
        meta = {"operating_point": params["operating_point"]} if params.get("operating_point") else None
        if ident.model_id and ident.weights_hash:  # full identity: the key commits to it
            key = client.put_entry(ident, token_ids, {ident.levels[0]: chunks}, ranges, meta=meta)
        else:
            tag = str(params.get("codec_tag") or params.get("codec", "raw"))
            if ident.partition:  # no identity recorded: the partition keys the entry apart
                tag = f"{tag}@{ident.partition}"
            key = client.put_context(
                str(params.get("model_id") or "unknown-model"),
                str(params.get("weights_hash") or "unknown-weights"), tag, token_ids,
                {ident.levels[0]: chunks}, ranges, meta)
        put_s = time.perf_counter() - t0
        indexed = 0
        if ident.weights_hash:  # findable by prefix (third_party.vllm.prefix_chain)
            from third_party.vllm.prefix_chain import index_entry

            indexed = index_entry(client, prefix_namespace(ident.weights_hash, ident.partition),
                                  token_ids, key, params.get("codec", "raw"))
        return {"encode_s": enc_s, "put_s": put_s, "index_s": time.perf_counter() - t0 - put_s,
                "index_records": indexed, "bytes": sum(len(c) for c in chunks),
                "context_key": key}

    def load(self, params, lookup: Lookup, num_tokens: int, on_chunk: ChunkSink,
             before_chunk=None) -> LoadStats:
        """See KVSource.load; before_chunk(k) (in-process callers only, e.g. a bandwidth
        trace driving the link) runs just before chunk k is requested."""
        from streaming.load import stream_load

        inner = self._decode_fn or default_decode_fn()

        def decode(data: bytes):  # (k, v, the header's (token_offset, T) or None)
            k, v = inner(data)
            return k, v, header_range(data)

        client = self._client(params)
        starts = [0]
        for t in lookup.chunk_tokens:
            starts.append(starts[-1] + t)
        needed = sum(1 for s in starts[:-1] if s < num_tokens)
        policy = _PrefixPolicy(self._policy(params, lookup), needed)
        st = LoadStats()
        delivered = [0]

        bad: list[str] = []

        def on_decoded(i: int, out) -> None:
            # (policy.stopped may already be set by the receiver, which runs ahead: chunks
            # before the first text chunk are still part of the prefix)
            if starts[i] != delivered[0] or bad:
                policy.stopped = True  # a gap before chunk i: it is useless to vLLM
                return
            k, v, hr = out
            want = starts[i + 1] - starts[i]
            if hr is not None and hr != (starts[i], want):
                bad.append(f"chunk {i}: its header says tokens {hr[0]}..{hr[0] + hr[1]}, the plan "
                           f"{starts[i]}..{starts[i + 1]}")
                policy.stopped = True
                logger.warning("store source: %s: %s", params.get("context_key"), bad[-1])
                return
            if getattr(k, "shape", None) is None or len(k.shape) < 2 or k.shape[1] != want:
                # never place KV of another token range: the plan says chunk i holds `want`
                bad.append(f"chunk {i} decoded to {getattr(k, 'shape', None)}, the plan says "
                           f"{want} tokens at {starts[i]}")
                policy.stopped = True
                logger.warning("store source: %s: %s", params.get("context_key"), bad[-1])
                return
            on_chunk(starts[i], k, v)
            delivered[0] = starts[i + 1]

        plan = [(starts[i], starts[i + 1]) for i in range(needed)]
        res = stream_load(client, params["context_key"], policy, decode,
                          on_decoded=on_decoded, keep_decoded=False, before_chunk=before_chunk,
                          plan=plan, plan_gen=lookup.info.get("gen") or None,
                          **self._expect(params))
        if not res.hit:
            raise SourceMiss(f"store miss at load time: {res.reason}")
        for c in res.chunks:
            rec = {k: getattr(c, k) for k in ("index", "level", "text_fallback", "bytes",
                                              "transfer_s", "decode_s", "crc_ok", "refetched",
                                              "token_start", "token_end", "fetch_start_s",
                                              "fetch_end_s", "decode_end_s", "note")}
            if c.index >= needed:
                rec["note"] = (rec["note"] + "; " if rec["note"] else "") + "not needed"
            st.chunks.append(rec)
        st.bytes = res.bytes
        st.transfer_s = res.transfer_s
        st.decode_s = res.decode_s
        st.loaded_tokens = min(num_tokens, delivered[0])
        st.fallback = st.loaded_tokens < num_tokens
        st.error = res.error or (bad[0] if bad else None)
        st.extra = {"manifest_s": res.manifest_s, "stream_total_s": res.total_s,
                    "decisions": [dict(d.__dict__) for d in res.decisions]}
        return st

