"""Types and helpers shared by the KV sources: Lookup, LoadStats, the KVSource protocol.

Part of third_party.vllm.sources (whose face forwards the public names here; see its docstring
for what a source is). Also: the reader's identity (engine_identity, expected_identity), the
prompt-prefix match and encode_for_save. No vLLM import. Not runnable by itself.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from streaming.identity import merge_expected
from streaming.identity import EntryIdentity
from cachegen_common.kv_config import config_json_of
from streaming.identity import folder_tokenizer_hash, folder_weights_hash

logger = logging.getLogger("cachegen.sources")

# on_chunk(start_token, k [L, T, H, D], v [L, T, H, D]) -> None; raises to abort the load.
ChunkSink = Callable[[int, Any, Any], None]
DecodeFn = Callable[[bytes], tuple[Any, Any]]


class SourceError(RuntimeError):
    """A KV source could not answer (bad parameters, unreadable manifest, lost store)."""


class SourceMiss(SourceError):
    """The entry the lookup planned from cannot be loaded any more (deleted, evicted,
    re-stored with another chunking, a calibration unavailable): a clean miss with the
    reason; nothing was placed."""


@dataclass
class Lookup:
    """Scheduler-side answer of a source for one request.

    num_tokens: tokens of the prompt's prefix whose KV the source holds (0 = miss).
    chunk_tokens: token count of each stored chunk, in order (sum >= num_tokens).
    lookup_s: seconds the lookup took (manifest request over the link included).
    info: small JSON-able facts for the stats record (codec, level, key, reason of a miss).
    """

    num_tokens: int
    chunk_tokens: list[int] = field(default_factory=list)
    lookup_s: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class LoadStats:
    """Worker-side result of one load (all times in seconds, sizes in bytes).

    loaded_tokens: leading tokens actually delivered to on_chunk (< requested when a chunk
        fell back to text or the load failed; the connector then reports the rest as failed
        blocks so vLLM recomputes them).
    transfer_s / decode_s: summed per-chunk fetch and decode times (they overlap in a
        pipelined load, so they may add up to more than the wall time).
    chunks: per-chunk records {index, tokens, bytes, transfer_s, decode_s, level, ...}.
    """

    loaded_tokens: int = 0
    bytes: int = 0
    transfer_s: float = 0.0
    decode_s: float = 0.0
    chunks: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    fallback: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


class KVSource(Protocol):
    def lookup(self, params: dict[str, Any], prompt_token_ids: list[int]) -> Lookup: ...

    def load(
        self, params: dict[str, Any], lookup: Lookup, num_tokens: int, on_chunk: ChunkSink
    ) -> LoadStats: ...


def default_decode_fn() -> DecodeFn:
    """`codec.decode_kv` on the CPU (imported lazily so this module imports without codec);
    a sliding-window container (codec.window) decodes to its chunk's dense [L, Tc, H, D]
    with zeros where a layer keeps nothing (positions its attention window never reads
    when the load obeys `window_floor`)."""
    import codec
    from codec import window

    def _decode(data: bytes):
        if window.is_windowed(data):
            return window.decode_chunk_dense(data, device="cpu")
        return codec.decode_kv(data, device="cpu")

    return _decode


def window_floor(identity: dict[str, Any] | None, n_stored: int) -> int:
    """The shortest prefix of an entry of ``n_stored`` tokens that may be loaded: 0 for
    the full layout; for a sliding-window entry (identity ``kv_layout``,
    codec.window.layout.layout_tag) codec.window.layout.min_load_tokens - a shorter load would leave a
    sliding layer's window partly in what the entry dropped. ValueError on a bad tag."""
    tag = (identity or {}).get("kv_layout") if isinstance(identity, dict) else None
    if not tag:
        return 0
    from codec.window.layout import min_load_tokens, parse_layout_tag

    ws, extra = parse_layout_tag(tag)
    return min_load_tokens(ws, int(n_stored), extra)


def window_checked(identity: dict[str, Any] | None, n_match: int, n_stored: int,
                   info: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """(tokens servable, info) of a lookup that matched ``n_match`` of ``n_stored`` tokens:
    a windowed entry records ``min_load_tokens`` in info (the connector applies it after
    its block alignment) and a match below it is a miss with its reason."""
    try:
        floor = window_floor(identity, n_stored)
    except ValueError as e:
        return 0, {**info, "miss": f"identity: {e}"}
    if not floor:
        return n_match, info
    if n_match < floor:
        return 0, {**info, "miss": f"window: the entry keeps its sliding layers' last tokens only; "
                   f"a load of {n_match} tokens needs at least {floor} of {n_stored} matched"}
    return n_match, {**info, "min_load_tokens": floor}


def load_callable(path: str) -> Callable:
    """Import `module:attr` (e.g. "streaming.store:context_key"). Raises ValueError."""
    mod, sep, attr = str(path).partition(":")
    if not sep or not mod or not attr:
        raise ValueError(f"expected 'module:function', got {path!r}")
    try:
        fn = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import {path!r}: {e}") from e
    if not callable(fn):
        raise ValueError(f"{path!r} is not callable")
    return fn


def expected_identity(own: EntryIdentity | None, params: dict[str, Any]) -> EntryIdentity:
    """What a stored entry must match for this request: the reader's own model identity
    (`own`, set by the connector from its model config) merged with the request's
    "identity" dict and "model_id" / "weights_hash", in the request's cache partition
    (params "cache_partition", set by the connector: `request_partition`; "" = shared).
    Raises ValueError when they conflict (the request names another model than the
    engine's)."""
    req = {k: params[k] for k in ("model_id", "weights_hash") if params.get(k)}
    ident = merge_expected(own, params.get("identity") or None, req)
    return ident.replace(partition=str(params.get("cache_partition") or ""))


def request_partition(request: Any) -> dict[str, str]:
    """{"cache_partition": digest} of what vLLM keeps apart in its own prefix cache for a
    request (vllm 0.32 v1/core/kv_cache_utils.py: the block hash's extra keys):
    `request.cache_salt` (a tenant's salt, OpenAI API field "cache_salt"), the LoRA
    adapter (`request.lora_request`: name and path; its K/V differ), the multimodal
    inputs (`request.mm_features`: identifier and placeholder position of each; their K/V
    are not a function of the placeholder token ids) and prompt embeddings (a sha256 of
    `request.prompt_embeds`); {} when the request has none of them (the shared partition). The digest (sha256, 32 hex) enters the entry
    identity (EntryIdentity.partition), hence the store key, the local folder name and the
    prefix-index namespace: a partition never loads or overwrites another's entry. The
    salt itself is never stored. Duck-typed (no vLLM import)."""
    parts: dict[str, Any] = {}
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts["cache_salt"] = str(salt)
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts["lora"] = [str(getattr(lora, "lora_name", "") or ""),
                         str(getattr(lora, "lora_path", "") or getattr(lora, "path", "") or "")]
    mm = [[str(getattr(f, "identifier", "") or getattr(f, "mm_hash", "") or ""),
           int(getattr(getattr(f, "mm_position", None), "offset", -1)),
           int(getattr(getattr(f, "mm_position", None), "length", -1))]
          for f in (getattr(request, "mm_features", None) or [])]
    if mm:
        parts["mm"] = mm
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is not None:
        parts["prompt_embeds"] = hashlib.sha256(embeds.detach().float().cpu().numpy().tobytes()).hexdigest()
    if not parts:
        return {}
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return {"cache_partition": hashlib.sha256(b"cgh-cache-partition\x00" + blob).hexdigest()[:32]}


def prefix_namespace(weights_hash: str, partition: str = "") -> str:
    """The prefix index's namespace (third_party.vllm.prefix_chain.chain_keys) of a model and a
    cache partition: the weights hash alone for the shared partition (existing indexes
    stay valid), else weights hash + "#" + partition: chains of two partitions never meet."""
    return f"{weights_hash}#{partition}" if partition and weights_hash else weights_hash


def lookup_subject(params: dict[str, Any], prompt_token_ids: Sequence[int] | None = None,
                   key: str | None = None) -> str:
    """What a lookup looked for, as log lines name it: "context <key>" (the request's
    `context_key`, or `key` - e.g. the entry the prefix index named), else "the prompt's
    prefix (N tokens, prefix matching)", else "a request without a context key"."""
    key = params.get("context_key") or key
    if key:
        return f"context {key}"
    if params.get("prefix_match"):
        n = "" if prompt_token_ids is None else f"{len(prompt_token_ids)} tokens, "
        return f"the prompt's prefix ({n}prefix matching)"
    return "a request without a context key"


def identity_miss_lookup(source: str, params: dict[str, Any], why: str, t0: float,
                         prompt_token_ids: Sequence[int] | None = None) -> "Lookup":
    """A miss for an entry whose identity does not match the reader's (``why``): logged
    (WARNING) with the request's subject, returned as a ``Lookup`` of 0 tokens whose
    ``info["miss"]`` names the reason; ``t0``: the lookup's start (``time.perf_counter``)."""
    logger.warning("%s source: miss for %s: %s", source, lookup_subject(params, prompt_token_ids), why)
    return Lookup(0, lookup_s=time.perf_counter() - t0, info={"miss": f"identity: {why}"})


def engine_identity(vllm_config: Any, extra: dict[str, Any] | None = None,
                    hash_weights: bool = True) -> EntryIdentity:
    """Model part of the identity of a vLLM engine (duck-typed, no vLLM import): model path
    or name, KV dtype, layers, total KV heads, head size from `vllm_config.model_config`;
    the K/V-shaping config fields from its `hf_config` (cachegen_common.kv_config: the same
    transformers config class and the same reading as the HF path's, so both compute the
    same identity for the same folder; vLLM's --hf-overrides are seen, as the engine runs
    with them);
    weights hash from extra config "weights_hash", else computed once from the model folder
    (streaming.identity.folder_weights_hash); tokenizer hash from the tokenizer folder;
    model_id only from extra config "model_id" (the name the store writer used);
    hash_weights=False skips hashing (the worker side, which re-checks what the scheduler
    already matched, does not pay for reading the weights again). Fields
    that cannot be read stay unknown ("" / 0) and are logged."""
    extra = extra or {}
    mc = getattr(vllm_config, "model_config", None)
    pc = getattr(vllm_config, "parallel_config", None)
    f: dict[str, Any] = {"model_id": str(extra.get("model_id") or "")}
    try:
        f["dtype"] = str(getattr(mc, "dtype", "") or "").replace("torch.", "")
        total = getattr(mc, "get_total_num_kv_heads", None)
        f["num_kv_heads"] = int(total() if total else mc.get_num_kv_heads(pc))
        layers = getattr(mc, "get_total_num_hidden_layers", None)
        f["num_layers"] = int(layers() if layers else mc.get_num_layers(pc))
        f["head_dim"] = int(mc.get_head_size())
    except Exception as e:  # noqa: BLE001 - an unknown field is checked no further
        logger.warning("connector: cannot read the model shape for identity checks: %s", e)
    f["kv_config"] = config_json_of(getattr(mc, "hf_config", None))
    if not f["kv_config"]:
        logger.warning("connector: cannot read the model config's K/V fields for identity checks")
    folder = Path(str(getattr(mc, "model", "") or ""))
    tok = Path(str(getattr(mc, "tokenizer", "") or folder))
    f["weights_hash"] = str(extra.get("weights_hash") or "")
    try:
        if not f["weights_hash"] and hash_weights and folder.is_dir():
            f["weights_hash"] = folder_weights_hash(folder)
        if tok.is_dir():
            f["tokenizer_hash"] = folder_tokenizer_hash(tok)
    except OSError as e:
        logger.warning("connector: cannot hash the model folder %s: %s", folder, e)
    return EntryIdentity(**f)


def _prefix_match(prompt: list[int], stored: list[int] | None, n: int) -> bool:
    return stored is not None and len(stored) >= n and list(prompt[:n]) == list(stored[:n])


def matched_tokens(params: dict[str, Any], prompt: list[int], stored: list[int] | None,
                   n_stored: int) -> int:
    """Tokens of the prompt whose stored KV can be used: the whole stored prefix when the
    prompt starts with all of it (or the prompt's length if shorter); with
    params["prefix_match"] also the longest common prefix when they part (the KV of token t
    depends only on tokens <= t); else 0 (a different prompt is a miss, never a wrong load)."""
    from third_party.vllm.prefix_chain import common_prefix

    n = min(n_stored, len(prompt))
    if _prefix_match(prompt, stored, n):
        return n
    if params.get("prefix_match") and stored is not None:
        return min(n, common_prefix(prompt, stored))
    return 0


def _save_config(name: str, identity) -> Any:
    """The codec config a save encodes with: None (the level's preset), or for kvtc a
    KvtcConfig naming the cached default calibration of the engine's model (fitted once by
    `python -m kv_extraction_hf.calibrate --default` or by the first run_benchmarks / bench
    run). SourceError when kvtc has no calibration for this model."""
    if name != "kvtc":
        return None
    from codec.kvtc import KvtcConfig
    from kv_extraction_hf.calibrate import cached_default_calibration

    weights_hash = getattr(identity, "weights_hash", None) if identity is not None else None
    path = cached_default_calibration(weights_hash)
    if path is None:
        raise SourceError("kvtc save needs the model's default calibration: run "
                          "`python -m kv_extraction_hf.calibrate --default` once")
    return KvtcConfig(calibration=str(path))


def encode_for_save(params: dict[str, Any], k, v, identity=None) -> tuple[list[bytes], list[int], float]:
    """Encode k, v [L, T, H, D] with codec.encode_chunks per the save params ("codec",
    default "raw"; "level", default the codec's (codec.resolve_level); "chunk_tokens", default
    codec.DEFAULT_CHUNK_TOKENS) -> (chunks, chunk token counts, encode seconds). kvtc encodes
    with the default calibration of ``identity``'s model (`_save_config`)."""
    import codec

    ct = int(params.get("chunk_tokens") or codec.DEFAULT_CHUNK_TOKENS)
    name = params.get("codec", "raw")
    config = _save_config(name, identity)
    t0 = time.perf_counter()
    chunks = codec.encode_chunks(k, v, codec=name, config=config,
                                 level=params.get("level"), chunk_tokens=ct)
    bounds = codec.chunk_bounds(int(k.shape[1]), ct)
    return chunks, [e - s for s, e in bounds], time.perf_counter() - t0

