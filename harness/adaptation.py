"""Adaptation experiment and SLO checks (stage 5 of ``run_benchmarks.py``).

CacheGen section 5 on a real link: bandwidth traces are applied to the shaped link chunk
by chunk while the adaptive policy picks, per chunk, a level or text fallback from its
throughput estimate and the SLO. One row per chunk (docs/results-schema.md, adaptation).
Paper: CacheGen (Liu et al., SIGCOMM 2024) section 5. Run: ``python run_benchmarks.py
--traces constant step artifact``.
"""
from __future__ import annotations

from typing import Any

from harness.config import RunConfig
from harness.contexts import BenchmarkError, Context, log
from harness.engines.api import RequestTiming
from harness.engines.hf import HFEngine, hf_load
from streaming.adapt import traces as T

TRACES = ("constant", "step", "artifact")



def slo_violated(t: RequestTiming, slo_s: float, prefill_tps: float) -> bool:
    """CacheGen section 5's SLO covers loading the context: fetch + decode (load_s), writing
    the KV into the engine (inject_s) and recomputing the text-fallback tokens (their
    count / the engine's measured prefill speed, tokens/s). The question's own prefill is
    not part of it. Returns True when that total exceeds ``slo_s`` seconds."""
    fallback_tokens = sum(int(c.get("token_end", 0)) - int(c.get("token_start", 0))
                          for c in t.chunks if c.get("text_fallback"))
    return t.load_s + t.inject_s + fallback_tokens / max(prefill_tps, 1e-9) > slo_s


def load_traces(names: tuple[str, ...], n_chunks: int, rates: tuple[float, ...]) -> list:
    """Bandwidth traces (streaming.adapt.traces.Trace, Mbit/s per chunk) of ``n_chunks`` chunks:
    ``constant`` at the highest rate, ``step`` high -> low -> high (thirds), and
    ``artifact``, the CacheGen artifact's first recorded trace (scaled, see
    streaming.adapt.traces; skipped with a warning when its file is unavailable).

    Raises:
        BenchmarkError: an unknown trace name.
    """
    hi, lo = max(rates), min(rates)
    out = []
    for name in names:
        if name == "constant":
            out.append(T.constant(hi, n_chunks))
        elif name == "step":
            out.append(T.step([hi, lo, hi], max(1, -(-n_chunks // 3)), n_chunks))
        elif name == "artifact":
            try:
                out.append(T.load_artifact_traces()[0])
            except (OSError, ValueError) as exc:
                log(f"warning: artifact trace unavailable ({exc}); skipped")
        else:
            raise BenchmarkError(f"unknown trace {name!r}; available: {', '.join(TRACES)}")
    return out


def adaptation_rows(trace, ctx: Context, t: RequestTiming, slo_s: float,
                    prefill_tps: float) -> list[dict[str, Any]]:
    """One adaptation row per chunk of a request served under ``trace`` (schema:
    docs/results-schema.md, adaptation); ``elapsed_s`` is the running maximum of the
    chunks' decode (else fetch) end times, seconds since the load began."""
    rows = []
    elapsed = 0.0
    violated = slo_violated(t, slo_s, prefill_tps)
    for ch in t.chunks:
        elapsed = max(elapsed, float(ch.get("decode_end_s") or ch.get("fetch_end_s") or 0.0))
        rows.append({"trace": trace.name, "trace_source": trace.source,
                     "trace_scale": trace.scale, "context_id": ctx.cid, "chunk": ch["index"],
                     "bandwidth_mbps": trace.at(ch["index"]),
                     "throughput_mbps_est": ch.get("throughput_mbps_est"),
                     "decision": ch.get("decision"),
                     "level": ch.get("level"), "text_fallback": bool(ch.get("text_fallback")),
                     "bytes": ch.get("bytes"), "transfer_s": ch.get("transfer_s"),
                     "elapsed_s": elapsed, "slo_s": slo_s,
                     "ttft_s": t.ttft_s, "load_s": t.load_s, "inject_s": t.inject_s,
                     "prefill_s": t.prefill_s, "loaded_tokens": t.loaded_tokens,
                     "slo_violated": violated})
    return rows


def adaptation_experiment(cfg: RunConfig, bundle, link, store_addr: str, info,
                          contexts: list[Context], prefill_tps: float) -> list[dict]:
    """CacheGen section 5 on a real link: per chunk, the shaper follows the trace and the
    adaptive policy picks a level or text; rows per chunk (see docs/results-schema.md).

    Uses the first context and the HF engine (one generated token: only the load matters).
    """
    n_chunks = max(1, -(-contexts[0].load_tokens // cfg.chunk_tokens))
    traces = load_traces(cfg.traces, n_chunks, cfg.bandwidth_mbps)
    engine = HFEngine(bundle)
    rows: list[dict] = []
    ctx = contexts[0]
    for trace in traces:
        before_chunk = T.apply_trace(link, trace)
        link.set_rate(trace.at(0))
        params = {"source": "store", "store": store_addr, "context_key": ctx.keys["cachegen"],
                  "model_id": info.model_id, "weights_hash": info.weights_hash,
                  "codec_tag": "cachegen", "identity": ctx.identities.get("cachegen"),
                  "policy": {"preset": cfg.policy_preset,
                             "slo_s": cfg.slo_s, "prefill_tokens_per_s": prefill_tps,
                             "initial_throughput_mbps": trace.at(0),
                             # the shaper's burst rule (the estimator corrects samples for it)
                             # and the rate a probe tests after text fallbacks
                             "burst_bytes": link.describe()["burst_min_bytes"] or link.burst_bytes,
                             "burst_s": link.describe()["burst_rate_s"],
                             "probe_rate_mbps": max(cfg.bandwidth_mbps)}}
        t = engine.run(ctx.prompt.input_ids, 1,
                       lambda: hf_load(params, ctx.prompt.input_ids, ctx.load_tokens, before_chunk))
        rows.extend(adaptation_rows(trace, ctx, t, cfg.slo_s, prefill_tps))
    link.set_rate(max(cfg.bandwidth_mbps))
    return rows
