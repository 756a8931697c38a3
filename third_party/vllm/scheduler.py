"""Scheduler side of the CacheGen vLLM connector (vLLM's EngineCore process).

CacheGenConnector (third_party.vllm.cachegen_connector) builds a CacheGenScheduler when vLLM
creates it with role SCHEDULER and forwards vLLM's scheduler-side calls to it. It decides
what a request loads: the trust check of its kv_transfer_params (third_party.vllm.trust),
the lookup of the stored prefix (a manifest read, no side effects), the number of tokens
offered to vLLM (up to the prompt's last token, or whole blocks only), the LoadRequest /
SaveRequest sent to the worker in the step's metadata, and the one stats record of every
request whose outcome is not a load (rejected, miss, local_hit). The worker side is
third_party.vllm.worker.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from third_party.vllm.connector_settings import ConnectorSettings
from third_party.vllm.engine_load import EngineLoad
from third_party.vllm.metadata import CacheGenConnectorMetadata, LoadRequest, SaveRequest, SaveTrack
from third_party.vllm.sources import Lookup, SourceError, load_callable, request_partition
from third_party.vllm.trust import RequestRejected, validate_request

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

# the connector's logger: under "vllm." so that vLLM's own log handler (INFO, on the
# server's stderr) prints it
logger = logging.getLogger("vllm.cachegen_connector")


def is_aborted(request: Any) -> bool:
    """Whether vLLM finished the request as aborted (RequestStatus.FINISHED_ABORTED)."""
    st = getattr(request, "status", None)
    return st is not None and getattr(st, "name", str(st)) == "FINISHED_ABORTED"


def lossless(lk: Lookup) -> bool:
    """Whether the stored entry is lossless (codec "raw"); unknown counts as lossy."""
    tag = lk.info.get("codec_tag") or lk.info.get("codec") or ""
    return str(tag).split("#", 1)[0] == "raw"

def engine_skip_reason(request: "Request") -> str:
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


def no_load_reason(raw: Any, prompt: list[int], extra: dict[str, Any]) -> str | None:
    """Why a request whose kv_transfer_params passed the trust check loads nothing
    (the scheduler found no load parameters), or None when no record is due: no parameters, or a
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
            f"prefix_match={extra.get('prefix_match', 'off')!r}, source "
            f"{raw.get('source', extra.get('source', 'store'))!r})")


class CacheGenScheduler:
    """The connector's scheduler side: one per engine, built from the connector's settings.

    Its public methods are vLLM's scheduler-side KVConnectorBase_V1 methods of the same
    names (the connector forwards them), plus ``source(kind)``, ``alloc_group_ids`` (the
    hybrid-manager connector's hook) and ``request_finished``."""

    def __init__(self, settings: ConnectorSettings):
        self.settings = settings
        self._sources: dict[str, Any] = {}
        if settings.prefix_caching:
            logger.warning(
                "CacheGenConnector: vLLM prefix caching is ON: loaded KV enters the local "
                "prefix cache and is reused by later requests sharing the prefix; lossy "
                "loads are %s (extra config allow_lossy_prefix_cache)",
                "ALLOWED" if settings.allow_lossy_cache else "refused (lossless 'raw' only)")
        self._lookups: dict[str, Lookup] = {}
        self._checked: dict[str, dict[str, Any] | None] = {}  # validated kv_transfer_params
        self._local_hits: dict[str, int] = {}
        self._pending: dict[str, tuple["Request", int, int]] = {}
        self._saves: dict[str, SaveTrack] = {}
        # per request: what its one stats record is: "recorded" (a scheduler record was
        # written), "hit" (an external hit was offered, not yet allocated), "load" (a
        # LoadRequest went to the worker, which writes the load record)
        self._outcome: dict[str, str] = {}
        # async mode: loads built at allocation (the request is not scheduled while it
        # waits), requests whose load the worker has not reported yet, cancels to send,
        # and request.num_preemptions at each load (a re-query without a preemption since
        # is vLLM retrying after a load that placed nothing: then 0 is offered)
        self._async_ready: list[LoadRequest] = []
        self._async_inflight: set[str] = set()
        self._cancels: list[str] = []
        self._async_gen: dict[str, int] = {}
        self.engine_load = EngineLoad(settings.engine_load)  # the adaptive policy's input

    def on_new_request(self, request: "Request") -> None:
        """vLLM added ``request``: tracked until request_finished (third_party.vllm.engine_load)."""
        self.engine_load.add(request)

    def alloc_group_ids(self, blocks) -> list[list[int]] | None:
        """Per-group block ids of an allocation for LoadRequest.group_block_ids: None here
        (one group: block_ids); the hybrid-manager scheduler returns every group's."""
        return None

    def source(self, kind: str):
        """The KV source of ``kind`` ("store" / "local"), made once per scheduler."""
        src = self._sources.get(kind)
        if src is None:
            src = self._sources[kind] = self.settings.make_source(kind)
        return src

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
                out = validate_request(p, self.settings.extra)
            except RequestRejected as e:
                logger.error("CacheGenConnector: request %s: kv_transfer_params rejected, "
                             "running a plain prefill: %s", rid, e)
                self.settings.stats.write({"kind": "rejected", "req_id": rid,
                                   "stats_tag": str(p.get("stats_tag"))[:200]
                                   if isinstance(p, dict) and p.get("stats_tag") else None,
                                   "reason": str(e), "time": time.time()})
                self._outcome[rid] = "recorded"
        self._checked[rid] = out
        return out

    def _params(self, request: "Request") -> dict[str, Any] | None:
        p = self._checked_params(request)
        raw = getattr(request, "kv_transfer_params", None)
        if p is None and raw:
            return None  # rejected: plain prefill
        if p is None:
            if self.settings.prefix_mode() != "all":
                return None
            try:  # no kv_transfer_params: the operator's default store, by prefix
                p = validate_request({}, self.settings.extra)
            except RequestRejected:
                return None
        if str(p.get("mode", "")).lower() == "text":
            return None
        params = {k: self.settings.extra[k] for k in ("model_id", "weights_hash") if k in self.settings.extra}
        params.update(p, **request_partition(request))  # cache_salt / LoRA: its own partition
        if self.settings.operating_points and params.get("level") is None:  # extra config "target"
            params["operating_levels"] = {c: pt["level"] for c, pt in self.settings.operating_points.items()}
        if not p.get("context_key") and not p.get("context_tokens"):
            if p.get("save") and raw and set(raw) <= {"save", "stats_tag"}:
                return None  # a save-only request
            if self.settings.prefix_mode() == "off" or params.get("source") != "store":
                return None
            params["prefix_match"] = True  # find the entry by the prefix index
        return params

    def _resolve_key(self, params: dict[str, Any], prompt: list[int]) -> None:
        """Fill params["context_key"] from the prompt's first context_tokens tokens via key_fn
        (streaming.store.context_key by default) when the request gave only a length."""
        if params.get("context_key") or not params.get("context_tokens"):
            return
        fn = self.settings.key_fn or load_callable("streaming.store:context_key")
        n = int(params["context_tokens"])
        params["context_key"] = fn(params.get("model_id", ""), params.get("weights_hash", ""),
                                   params.get("codec_tag", params.get("mode", "")), prompt[:n])

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens to load beyond num_computed_tokens (vLLM's local prefix-cache hits): the
        stored prefix of the prompt, cut to at most len(prompt) - 1 (vLLM's forward needs
        the last prompt token for the first logits) and, with extra config
        "load_partial_block": false, down to a multiple of the block size. Side-effect free
        on the source (a manifest read; the answer is memoised per request id). Writes one
        scheduler-side stats record per request whose outcome is not a load: "rejected"
        (trust check), "miss" (nothing stored to load), "local_hit" (vLLM's own prefix
        cache already holds what is stored, or a plain request hit it) - so a local hit
        never reads as a miss."""
        rid = request.request_id
        first = rid not in self._local_hits
        if self.settings.async_load and not first and rid in self._async_gen and \
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
                reason = no_load_reason(raw, prompt, self.settings.extra)
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
                lk = self.source(params["source"]).lookup(params, prompt)
            except (SourceError, ValueError, OSError) as e:
                logger.warning("KV lookup failed for %s: %s", rid, e)
                lk = Lookup(0, info={"miss": f"lookup error: {e}"})
            if lk.num_tokens and self.settings.prefix_caching and not self.settings.allow_lossy_cache \
                    and not lossless(lk):
                lk = Lookup(0, lookup_s=lk.lookup_s, info={
                    **lk.info, "miss": "lossy KV refused: vLLM prefix caching is on and the "
                    "server's extra config does not set allow_lossy_prefix_cache"})
            self._lookups[rid] = lk
        n = min(lk.num_tokens, len(prompt) - 1)
        if params.get("load_tokens") is not None:
            n = min(n, int(params["load_tokens"]))
        if not self.settings.partial_block:
            n = n // self.settings.block_size * self.settings.block_size
        if 0 < n < int(lk.info.get("min_load_tokens") or 0):   # a windowed entry: too short
            lk.info["miss"], n = f"window: {n} loadable tokens < the entry's min_load_tokens", 0
        if first and n <= num_computed_tokens:
            # a KV mode that loads nothing runs as a plain prefill (or from vLLM's own prefix
            # cache): say which, a benchmark must not report it as a KV load
            if n > 0 or (num_computed_tokens > 0 and lk.num_tokens > 0):
                kind, reason = "local_hit", ("vLLM's local prefix cache already holds the "
                                             "stored prefix")
            else:
                kind = "miss"
                reason = lk.info.get("miss", (
                    "no stored token before the prompt's last one" if self.settings.partial_block
                    else f"fewer than one block ({self.settings.block_size} tokens) stored "
                    "for this prompt"))
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
            return n - num_computed_tokens, self.settings.async_load
        return 0, False

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
        self.settings.stats.write(rec)

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ):
        if num_external_tokens > 0:
            self.engine_load.mark(request)  # the prefill queued ahead of this load, now
            # request.num_computed_tokens is not yet updated here: use the local hits seen
            # by get_num_new_matched_tokens (0 with prefix caching off).
            start = self._local_hits.get(request.request_id, 0)
            if self.settings.async_load:
                # the request now waits (WAITING_FOR_REMOTE_KVS) and is not scheduled, so
                # its blocks come from the allocation; the load goes out in this step's meta
                self._async_ready.append(self._load_request(
                    request, start, start + num_external_tokens, list(blocks.get_block_ids()[0]),
                    self.alloc_group_ids(blocks)))
                self._async_inflight.add(request.request_id)
                self._async_gen[request.request_id] = getattr(request, "num_preemptions", 0)
            else:
                self._pending[request.request_id] = (request, start, start + num_external_tokens)
        elif self._outcome.get(request.request_id) == "hit":
            # the connector offered a hit and vLLM allocated none of it (e.g. a request with
            # prompt_logprobs skips external hits): a plain prefill, so its record says so now
            self._record_dropped_hit(request, engine_skip_reason(request))
        p = self._checked_params(request) or {}  # "save" only when the operator allows it
        if p.get("save") and request.request_id not in self._saves:
            save = dict(p["save"])
            prompt = list(request.prompt_token_ids or [])
            n = min(int(save.get("num_tokens") or len(prompt)), len(prompt))
            if n > 0:
                for key in ("model_id", "weights_hash"):
                    if key not in save and key in self.settings.extra:
                        save[key] = self.settings.extra[key]
                save.setdefault("stats_tag", p.get("stats_tag"))
                point = self.settings.operating_points.get(save.get("codec", "raw"))
                if point is not None and save.get("level") is None:  # extra config "target"
                    save["level"], save["operating_point"] = point["level"], point
                save.update(request_partition(request))  # saved into the request's partition
                self._saves[request.request_id] = SaveTrack(prompt[:n], save)

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
        if "policy" in params:  # the adaptive policy's engine-load input (not the request's)
            params["policy"] = self.engine_load.policy(params["policy"], rid)
        lr = LoadRequest(rid, start, end, block_ids, self.settings.block_size, params, lk,
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
                                              self.settings.block_size, tr.params))
                del self._saves[rid]

    def _record_dropped_hit(self, request: "Request", reason: str) -> None:
        """The one record of a request whose offered external hit was never loaded: a
        "miss" with the reason (a "local_hit" when vLLM's own prefix cache served it)."""
        rid = request.request_id
        params = self._checked.get(rid) or {}
        lk = self._lookups.get(rid) or Lookup(0)
        prompt_n = len(getattr(request, "prompt_token_ids", None) or [])
        local = self._local_hits.get(rid, 0)
        aborted = is_aborted(request)
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
        aborted = is_aborted(request)
        raw = getattr(request, "kv_transfer_params", None)
        if outcome == "hit" or (outcome is None and rid not in self._checked and raw
                                and no_load_reason(raw, [0, 0], self.settings.extra) is not None):
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
                        "the async load had finished" if self.settings.async_load else
                        "the synchronous load ran to its end: vLLM applies aborts after "
                        "the step")
        self._lookups.pop(request.request_id, None)
        self._local_hits.pop(request.request_id, None)
        self._checked.pop(request.request_id, None)
        self._saves.pop(request.request_id, None)
        self._pending.pop(request.request_id, None)
        self._async_gen.pop(request.request_id, None)
        self.engine_load.forget(request.request_id)
        return False, None

