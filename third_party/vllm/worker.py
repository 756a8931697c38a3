"""Worker side of the CacheGen vLLM connector: load into the paged KV cache, save.

CacheGenConnector (third_party.vllm.cachegen_connector) builds a CacheGenWorker when vLLM
creates it with role WORKER and forwards vLLM's worker-side calls to it, with the step's
metadata as an argument. A load streams and decodes a stored entry chunk by chunk and
writes each chunk's K/V into every layer's paged cache through the attention backend's
own cache-write op (``impl.do_kv_cache_update``) with a slot mapping; in async mode a
background thread runs the loads and an abort stops one at its next chunk. A save reads
the KV back (third_party.vllm.readback), encodes and stores it. Every load / save writes
one stats record. The scheduler side is third_party.vllm.scheduler.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from third_party.vllm.connector_settings import ConnectorSettings
from third_party.vllm.decode_cpus import DecodeAffinity, thread_probe
from third_party.vllm.kv_groups import describe_kv_cache, layer_groups, summary_line
from third_party.vllm.metadata import CacheGenConnectorMetadata, LoadRequest
from third_party.vllm.readback import probe_gather_maps, read_kv
from third_party.vllm.sources import SourceError

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext

# the connector's logger (under "vllm.", as in third_party.vllm.scheduler)
logger = logging.getLogger("vllm.cachegen_connector")


class LoadCancelled(Exception):
    """Raised inside a background load's chunk sink when its request was finished."""


@dataclass
class AsyncJob:
    """One background load (worker side): its request and its cancel flag."""

    lr: LoadRequest
    cancel: threading.Event = field(default_factory=threading.Event)


def layer_index(name: str) -> int:
    """Decoder-layer index from a vLLM layer name ("model.layers.12.self_attn.attn" -> 12)."""
    nums = [int(p) for p in name.split(".") if p.isdigit()]
    if len(nums) != 1:
        raise ValueError(f"cannot find one layer index in layer name {name!r}")
    return nums[0]


def policy_preset(policy: Any) -> str | None:
    """The PolicyParams preset a request's policy object runs (its "preset", else the
    default one), or None without a policy."""
    if not isinstance(policy, dict):
        return None
    from streaming.adapt.params import DEFAULT_PRESET

    return str(policy.get("preset") or DEFAULT_PRESET)


def load_miss_reason(err: str | None, stats) -> str:
    """Why a load placed nothing (the record says miss with the reason, never
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


def chunk_failure(stats) -> str | None:
    """The first chunk failure note of a load (a chunk whose decode or refetch failed and
    whose tokens the engine therefore recomputes), or None: a chunk sent as text by the
    adaptation policy is a choice, not an error (the record says why)."""
    for c in (getattr(stats, "chunks", None) or []):
        note = c.get("note", "") if isinstance(c, dict) else getattr(c, "note", "")
        if note and "failed" in note and not note.startswith("decode failed once, refetch decoded"):
            return f"chunk {c.get('index') if isinstance(c, dict) else getattr(c, 'index', '?')}: {note}"
    return None


class CacheGenWorker:
    """The connector's worker side: one per worker process, built from the connector's
    settings, vLLM's config (its forward context's attention layers) and the KV cache
    config (its groups). Its public methods are vLLM's worker-side KVConnectorBase_V1
    methods of the same names (those that read the step's metadata take it as their first
    argument), plus ``load_one``, ``read_kv``, ``source`` and the hybrid-manager hooks
    ``publish_failed`` / ``fail_whole_request``."""

    # a failed load's record counts only the tokens after the gap as recomputed; the
    # hybrid-manager worker reports the whole request failed (vLLM recomputes it all)
    fail_whole_request = False

    def __init__(self, settings: ConnectorSettings, vllm_config: Any = None,
                 kv_cache_config: Any = None):
        self.settings = settings
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._sources: dict[str, Any] = {}
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layers: list[tuple[int, str]] = []  # (layer index, name) sorted by index
        self._layer_group: dict[str, int] = {}    # layer name -> KV cache group (0: one group)
        self._layer_objs: dict[str, Any] = {}
        self._failed_blocks: set[int] = set()
        self._gather_maps: tuple[torch.Tensor, torch.Tensor] | None = None
        # async mode: jobs by request id (queued or running), ids whose load stopped (to
        # report in get_finished) and one background thread that runs jobs in order
        self._jobs: dict[str, AsyncJob] = {}
        self._done_recving: set[str] = set()
        self._async_lock = threading.Lock()
        self._job_queue: "queue.Queue[AsyncJob | None]" = queue.Queue()
        self._loader: threading.Thread | None = None

    def source(self, kind: str):
        """The KV source of ``kind`` ("store" / "local"), made once per worker."""
        src = self._sources.get(kind)
        if src is None:
            src = self._sources[kind] = self.settings.make_source(kind)
        return src

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        """kv_caches: layer name -> [num_blocks, num_kv_heads, block_size, 2 * head_size]
        (the CPU backend's tensors, the same objects attention reads)."""
        self._kv_caches = dict(kv_caches)
        self._layers = sorted((layer_index(n), n) for n in kv_caches)
        idx = [i for i, _ in self._layers]
        if idx != list(range(len(idx))):
            raise ValueError(f"attention layers are not numbered 0..L-1: {idx}")
        # the engine's KV memory (without the hybrid manager a sliding-window model runs
        # with one group of full-length blocks): one log line and one "kv_cache" stats record
        self._layer_group = layer_groups(self._kv_cache_config)
        fctx = getattr(getattr(self._vllm_config, "compilation_config", None),
                       "static_forward_context", None) or {}
        desc = describe_kv_cache(self._kv_cache_config, {
            n: getattr(fctx.get(n), "sliding_window", None) for n in kv_caches},
            tensors=kv_caches.values())
        logger.info("CacheGenConnector: %s", summary_line(desc))
        self.settings.stats.write({"kind": "kv_cache", **desc, "time": time.time()})
        if self.settings.extra.get("warmup", True):
            # numba's thread pool starts at the first parallel kernel (here): its threads
            # inherit this thread's affinity, so start it with the decode's CPUs
            with DecodeAffinity(self.settings.decode_cpus):
                self._warm_up(next(iter(kv_caches.values())).dtype if kv_caches else None)

    def _warm_up(self, dtype) -> None:
        """Compile / load every codec's JIT kernels now (worker process, engine start), so
        the first request's decode is as fast as the tenth (third_party.vllm.warmup).
        Extra config "warmup": false skips it; "warmup_codecs": list of codec names."""
        from third_party.vllm.warmup import warm_up_codecs

        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            dtype = torch.bfloat16
        info = warm_up_codecs(self.settings.extra.get("warmup_codecs"), dtype=dtype)
        logger.info("CacheGenConnector: codec warm-up took %.2f s (%s)", info["total_s"],
                    ", ".join(f"{k} {v}" for k, v in info["codecs"].items()))
        self.settings.stats.write({"kind": "warmup", **info, "time": time.time()})

    def _inject(self, lr: LoadRequest, slots: list[torch.Tensor], start: int,
                k: torch.Tensor, v: torch.Tensor, timer: list[float]) -> int:
        """Write the part of one decoded chunk (tokens [start, start+T)) that lies inside
        [lr.start, lr.end) into every layer's paged cache; returns tokens written.
        k, v: [L, T, H, D]. slots: per KV cache group, int64 [lr.end - lr.start] (-1: not
        kept, skipped). Uses the backend's cache-write op via the layer's impl."""
        L, T, H, D = k.shape
        lo, hi = max(start, lr.start), min(start + T, lr.end)
        if hi <= lo:
            return 0
        if L != len(self._layers) or v.shape != k.shape:
            raise SourceError(f"decoded KV has {L} layers {tuple(k.shape)} / {tuple(v.shape)}; "
                              f"the engine has {len(self._layers)} attention layers")
        t0 = time.perf_counter()
        fctx = self._layer_objs
        groups = self._layer_group
        for li, name in self._layers:
            layer = fctx[name]
            cache = self._kv_caches[name]
            if cache.shape[1] != H or cache.shape[3] != 2 * D:
                raise SourceError(f"decoded KV heads/head_dim {H}/{D} do not match layer "
                                  f"{name} cache {tuple(cache.shape)}")
            s = slots[groups.get(name, 0)][lo - lr.start: hi - lr.start]
            kk = k[li, lo - start: hi - start]
            vv = v[li, lo - start: hi - start]
            keep = s >= 0
            if not bool(keep.all()):      # a sliding group's null blocks: not written
                if not bool(keep.any()):
                    continue
                s, kk, vv = s[keep], kk[keep], vv[keep]
            if kk.dtype != cache.dtype and cache.dtype in (torch.bfloat16, torch.float16,
                                                           torch.float32):
                kk, vv = kk.to(cache.dtype), vv.to(cache.dtype)
            layer.impl.do_kv_cache_update(layer, kk.contiguous(), vv.contiguous(), cache, s)
        timer[0] += time.perf_counter() - t0
        return hi - lo

    def start_load_kv(self, meta: Any, forward_context: "ForwardContext") -> None:
        """Start this step's loads (meta: the step's CacheGenConnectorMetadata; anything
        else is ignored) and pass its cancels to running loads: synchronous loads are
        placed before this returns, async ones queue for the background loader."""
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
        if self.settings.async_load:
            for lr in meta.loads:
                job = AsyncJob(lr)
                with self._async_lock:
                    self._jobs[lr.req_id] = job
                self._ensure_loader()
                self._job_queue.put(job)
            return
        with DecodeAffinity(self.settings.decode_cpus):   # the load gets every core, not the worker's one
            for lr in meta.loads:
                self._failed_blocks.update(self.load_one(lr))

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
        with DecodeAffinity(self.settings.decode_cpus):
            while True:
                job = self._job_queue.get()
                if job is None:
                    return
                try:
                    failed = self.load_one(job.lr, job.cancel)
                except Exception as e:  # never leave a request waiting forever
                    logger.error("KV async load of %s crashed: %s", job.lr.req_id, e)
                    failed = set(job.lr.block_ids[job.lr.start // job.lr.block_size:
                                                  -(-job.lr.end // job.lr.block_size)])
                with self._async_lock:
                    self.publish_failed(job.lr, failed)
                    self._done_recving.add(job.lr.req_id)
                    self._jobs.pop(job.lr.req_id, None)

    def publish_failed(self, lr: LoadRequest, failed: set[int]) -> None:
        """Record an async load's failed blocks for get_block_ids_with_load_errors (under
        self._async_lock); the hybrid-manager connector reports the request instead."""
        self._failed_blocks.update(failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Worker side: (None, ids whose async load stopped since the last call). A
        request in finished_req_ids (vLLM finished or aborted it) whose load still runs is
        cancelled here too (the route vLLM itself uses; the metadata's cancels come first)."""
        if not self.settings.async_load:
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

    def load_one(self, lr: LoadRequest, cancel: threading.Event | None = None) -> set[int]:
        """Load one request's KV (writes its one load / miss record); returns the block
        ids vLLM must recompute (none for a cancelled load: its request is finished).
        cancel: set when vLLM finished the request; checked before each chunk."""
        t_wall = time.perf_counter()
        t_cpu = time.process_time()   # CPU-s / wall-s = cores the load got
        slots = lr.group_slot_mappings()
        inject_s = [0.0]
        written = [lr.start]  # next token not yet written (contiguous prefix)

        def on_chunk(start: int, k: torch.Tensor, v: torch.Tensor) -> None:
            if self.settings.chunk_hook is not None:
                self.settings.chunk_hook(lr.params, start, cancel.is_set if cancel else lambda: False)
            if cancel is not None and cancel.is_set():
                raise LoadCancelled(f"request finished (aborted) before the chunk at "
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
                raise LoadCancelled("request finished (aborted) before its load started")
            stats = self.source(lr.params.get("source", "store")).load(
                lr.params, lr.lookup, lr.end, on_chunk)
        except Exception as e:  # any failure: recompute what was not written
            if isinstance(e, LoadCancelled) or isinstance(e.__cause__, LoadCancelled) \
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
            "decode_threads": thread_probe(),
            "bytes": stats.bytes if stats else None,
            "fallback": bool(stats.fallback) if stats else None,
            "error": err or (stats.error if stats else None) or chunk_failure(stats),
            "chunks": stats.chunks if stats else [],
            "lookup_info": lr.lookup.info,
            "after_preemption": lr.after_preemption,
            # vLLM finished (aborted) the request while its async load ran: the load stopped
            # at the next chunk; loaded_tokens = tokens placed before it stopped
            "aborted": aborted,
            "async_load": cancel is not None,
            # the adaptive policy's preset (streaming.adapt.params) and inputs; None for a level
            "policy_preset": policy_preset(lr.params.get("policy")),
            "policy": lr.params.get("policy"),
            "time": time.time(),
        }
        if stats and stats.extra:
            rec.update({k: v for k, v in stats.extra.items() if k not in rec})
        if failed and self.fail_whole_request:
            # hybrid-manager connector: the failure is reported per request (failed_recving)
            # and vLLM recomputes every token of the load, not only those after the gap
            rec["recomputed_tokens"] = lr.end - lr.start
        if aborted:
            rec["recomputed_tokens"] = 0  # the request is finished: nothing is recomputed
            rec["reason"] = (f"request aborted during its KV load: stopped after "
                             f"{loaded - lr.start} of {lr.end - lr.start} tokens")
        if loaded == lr.start and lr.end > lr.start:  # nothing placed: a miss, with its reason
            rec["kind"] = "miss"
            if not aborted:
                rec["reason"] = load_miss_reason(err, stats)
        logger.info("KV load %s [%s]: loaded %d of %d tokens (local hits %d, prefill %s) "
                    "from %s %s in %.3f s, %s bytes%s", lr.req_id, rec["stats_tag"] or "-",
                    rec["loaded_tokens"], rec["requested_tokens"], lr.start,
                    rec["prefill_tokens"], rec["source"], str(rec["context_key"])[:16],
                    rec["load_s"], rec["bytes"], f", error: {rec['error']}" if rec["error"] else "")
        self.settings.stats.write(rec)
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._async_lock:
            out, self._failed_blocks = self._failed_blocks, set()
        return out

    def wait_for_save(self, meta: Any) -> None:
        """Save requested KV (meta.saves) after the forward wrote it: read back from the
        paged cache with gather maps probed through the cache-write op, encode, store."""
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
                info = self.source(sr.params["source"]).save(sr.params, sr.token_ids, k, v)
                rec.update(info)
            except Exception as e:  # a failed save must not fail the request
                rec["error"] = f"{type(e).__name__}: {e}"
                logger.warning("KV save of %s failed: %s", sr.req_id, rec["error"])
            rec["save_s"] = time.perf_counter() - t0
            self.settings.stats.write(rec)

    def read_kv(self, block_ids: list[int], block_size: int, num_tokens: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of tokens [0, num_tokens) of a request from the paged cache: [L, T, H, D]
        in the cache dtype. block_ids: the request's blocks in order. The block layout is
        probed once (third_party.vllm.readback; RuntimeError where it can not be)."""
        if self._gather_maps is None:
            name = self._layers[0][1]
            layer = self._layer_objs.get(name) or \
                self._vllm_config.compilation_config.static_forward_context[name]
            self._gather_maps = probe_gather_maps(layer, self._kv_caches[name])
        return read_kv([self._kv_caches[n] for _, n in self._layers], self._gather_maps,
                       block_ids, block_size, num_tokens)
