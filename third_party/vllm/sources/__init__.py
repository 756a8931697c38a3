"""Where the CacheGen connector gets a context's KV from: KV sources (no vLLM import here).

Purpose: decouple the vLLM glue (cachegen_connector.py) from HOW encoded KV chunks are
obtained. A source answers two questions:
  * scheduler side, `lookup(params, prompt_token_ids)`: how many leading tokens of this
    prompt does the source hold KV for? (no side effects: reads a manifest, nothing else);
  * worker side, `load(params, lookup, num_tokens, on_chunk)`: fetch + decode the chunks that
    cover tokens [0, num_tokens), calling `on_chunk(start, k, v)` for each decoded chunk in
    order (k, v: [L, T, H, D] in the model dtype), and return timing stats.
Paper: CacheGen (Liu et al., SIGCOMM 2024) section 5: the context is split into chunks,
each independently decodable; decoding is pipelined with transfer.

Sources:
  * LocalDirSource ("local"): a folder `<root>/<name>/` (the context key itself, or a hash
    for a long or partitioned key: streaming.store.context_keys.key_file_name) with `manifest.json` (the
    published entry) and `g-<gen>/chunk_<i>.bin` files of each save's generation (encoded
    by `codec.encode_chunks`; see save_local_context for the guarantees). For tests and
    the demo; disk reads are pipelined with decoding by a reader thread.
  * StoreSource ("store"): our KV store server through `streaming.store.StoreClient`, chunks
    fetched and decoded by `streaming.load.stream_load` (pipelined, adaptive, with text
    fallback). Imported lazily.

Not runnable by itself; see `python -m bench.vllm_demo --help`.

Modules (this package's face forwards their public names and holds make_source): base
(Lookup, LoadStats, KVSource, identity helpers), local (LocalDirSource,
save_local_context), store (StoreSource).
"""

from __future__ import annotations

from typing import Any

from streaming.identity import EntryIdentity
from third_party.vllm.sources.base import (  # noqa: F401  (re-exported)
    ChunkSink,
    DecodeFn,
    KVSource,
    LoadStats,
    Lookup,
    SourceError,
    SourceMiss,
    default_decode_fn,
    encode_for_save,
    engine_identity,
    expected_identity,
    load_callable,
    prefix_namespace,
    request_partition,
)
from third_party.vllm.sources.local import (  # noqa: F401  (re-exported)
    CAL_DIR,
    LOCAL_FORMAT,
    MANIFEST,
    LocalDirSource,
    calibration_of,
    local_save_steps,
    save_local_context,
)
from third_party.vllm.sources.store import (  # noqa: F401  (re-exported)
    StoreSource,
    default_stored_level,
)


def make_source(kind: str, extra: dict[str, Any], identity: EntryIdentity | None = None) -> KVSource:
    """Source registry: "local" (LocalDirSource) or "store" (StoreSource); `identity` is the
    reader's own model identity (engine_identity) every entry is checked against. Raises
    ValueError."""
    decode_fn = load_callable(extra["decode_fn"]) if extra.get("decode_fn") else None
    if kind == "local":
        from third_party.vllm.trust import max_key_chars

        return LocalDirSource(extra.get("source_dir"), decode_fn, identity, max_key_chars(extra))
    if kind == "store":
        return StoreSource(decode_fn, identity=identity)
    raise ValueError(f"unknown KV source {kind!r}; available: local, store")

