"""The request protocol the engines share, the prefill-speed measurement and the warm-up.

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

This module holds the request protocol (:func:`request_params`), the prefill-speed
measurement and the untimed per-variant warm-up (:func:`warm_up_variants`); the engines live
in harness.engines.hf and harness.engines.vllm, what they share in harness.engines.api and
their numerics settings in harness.engines.numerics.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

from cachegen_common.units import check_bandwidth_mbps
from harness.config import RunConfig
from harness.contexts import Context, Variant
from harness.engines.api import Engine


# ----------------------------------------------------------------------------- protocol
def request_params(var: Variant, ctx: Context, store_addr: str, info, cfg: RunConfig,
                   prefill_tps: float, bandwidth_mbps: float) -> dict | None:
    """The per-request KV transfer parameters (the vLLM connector's ``kv_transfer_params``,
    docs/vllm-connector.md) of ``var`` on ``ctx``; None for text mode (plain prefill).

    The adaptive mode gets a ``policy`` (``preset``: cfg.policy_preset, a
    streaming.adapt.params.PolicyParams preset; SLO in seconds, the engine's measured
    prefill speed in tokens/s, the link rate `bandwidth_mbps` in Mbit/s as the first
    throughput estimate, checked by check_bandwidth_mbps: ValueError outside its bound); the
    other modes a fixed ``level`` (the variant's; None for a codec without levels: the
    reader then fetches the entry's only stored level).
    """
    bandwidth_mbps = check_bandwidth_mbps(bandwidth_mbps)
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
                            "initial_throughput_mbps": bandwidth_mbps}
    else:
        params["level"] = var.level  # None: a codec without levels (never 0, a real level)
    return params


def measure_prefill_speed(engine: Engine, contexts: list[Context], max_new_tokens: int = 1) -> float:
    """Tokens/s of a full prefill on this engine (median over the contexts; warm-up excluded)."""
    engine.serve(contexts[0], Variant("text"), None, 1)  # warm-up, not timed
    speeds = []
    for ctx in contexts:
        t = engine.serve(ctx, Variant("text"), None, max_new_tokens)
        speeds.append(len(ctx.prompt.input_ids) / max(t.ttft_s, 1e-6))
    return statistics.median(speeds)


def warm_up_variants(engine: Engine, ctx: Context, variants: list[Variant],
                     params_of: Callable[[Variant], dict[str, Any] | None]) -> dict[str, Any]:
    """Serve one untimed request per KV variant on `ctx`, so that no timed request pays a
    codec's first-call JIT compile (numba kernels: measured 6.1 s for cachegen's first
    decode and 3.1 s for kvtc's on Gemma 3 at 2K tokens, then 0.05-0.07 s; the rule:
    the first load as fast as the tenth). The vLLM connector warms its codecs in its worker
    (third_party.vllm.warmup) except kvtc, which needs a calibration; the HF engine decodes
    in this process, so the harness warms it here with the run's own entries.

    params_of(variant) -> the request params (harness.engines.request_params) or None for
    text. Returns {variant label: seconds or "error: ..."}; raises nothing (a variant that
    fails here fails again, recorded, in the timed runs)."""
    out: dict[str, Any] = {}
    for var in variants:
        if var.codec is None or var.codec not in ctx.keys:
            continue
        t0 = time.perf_counter()
        try:
            engine.serve(ctx, var, params_of(var), 1)
            out[var.label] = round(time.perf_counter() - t0, 3)
        except Exception as exc:  # noqa: BLE001 - best effort, recorded by the timed run
            out[var.label] = f"error: {type(exc).__name__}: {exc}"[:200]
    return out
