"""TTFT percentiles, throughput and goodput of one load run (one mode at one request rate).

Goodput as in DistServe (Zhong et al., OSDI 2024) and vLLM's benchmark client
(``vllm.benchmarks.serve``, ``--goodput``): completed requests per second of the run that
met the service-level objective, here a TTFT SLO. Percentiles are linear interpolation
between order statistics (``numpy.percentile``'s default, the one vLLM's client reports).

Run: part of ``python -m bench.serve_load``.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

PERCENTILES = (50, 90, 99)


def percentiles(xs: Sequence[float], ps: Sequence[float] = PERCENTILES) -> dict[str, float | None]:
    """``{"p50": .., "p90": .., "p99": ..}`` of ``xs`` (same unit as xs; None when empty).
    Raises ValueError for a NaN / infinite value or a percentile outside [0, 100]."""
    if any(not 0 <= p <= 100 for p in ps):
        raise ValueError(f"percentiles must be in [0, 100], got {list(ps)}")
    if any(not math.isfinite(x) for x in xs):
        raise ValueError("TTFTs must be finite numbers")
    if not xs:
        return {f"p{p:g}": None for p in ps}
    q = np.percentile(np.asarray(xs, dtype=np.float64), list(ps))
    return {f"p{p:g}": float(v) for p, v in zip(ps, q)}


def summarize(ttfts_s: Sequence[float | None], ok: Sequence[bool], duration_s: float,
              slo_s: float) -> dict[str, Any]:
    """One run's figures.

    ttfts_s: per request, time to first token in seconds (None when it failed);
    ok: per request, whether it completed; duration_s: the run's wall time (first
    arrival to last completion, as vLLM's client measures it); slo_s: the TTFT SLO.
    Returns n (requests sent), completed, failed, ttft_s {p50, p90, p99} of the completed
    requests, throughput_rps (completed / duration), goodput_rps (completed with
    TTFT <= slo_s, / duration), slo_attainment (that count / n), slo_s.
    Raises ValueError: lists of different lengths, duration or SLO not positive."""
    if len(ttfts_s) != len(ok):
        raise ValueError(f"{len(ttfts_s)} TTFTs but {len(ok)} completion flags")
    if not duration_s > 0 or not slo_s > 0:
        raise ValueError(f"duration and SLO must be positive, got {duration_s} s and {slo_s} s")
    done = [t for t, o in zip(ttfts_s, ok) if o and t is not None]
    good = sum(1 for t in done if t <= slo_s)
    n = len(ok)
    return {"n": n, "completed": len(done), "failed": n - len(done),
            "ttft_s": percentiles(done), "throughput_rps": len(done) / duration_s,
            "goodput_rps": good / duration_s, "slo_attainment": (good / n) if n else None,
            "slo_s": slo_s}


SATURATION_FRACTION = 0.9   # goodput below this share of the offered rate = saturated
TAIL_RATIO_MAX = 2.0        # the check: p99 TTFT <= 2 x p50 at half the saturation rate


def saturation_rate(rows: Sequence[dict], fraction: float = SATURATION_FRACTION,
                    basis: str = "goodput_rps") -> float | None:
    """The saturation rate of one mode: the lowest offered rate (req/s) whose goodput
    (requests/s meeting the TTFT SLO) falls below ``fraction`` of that offered rate.

    rows: that mode's runs, each with ``rate_rps`` and ``basis`` (req/s): ``goodput_rps``
    (the definition above) or ``throughput_rps`` (completed requests/s: the engine's
    capacity, whatever the SLO). Returns None when no measured rate falls below (the
    saturation lies above every rate measured). Raises ValueError for an empty list or a
    fraction outside (0, 1]."""
    if not rows:
        raise ValueError("no runs to find a saturation rate in")
    if not 0 < fraction <= 1:
        raise ValueError(f"the saturation fraction must be in (0, 1], got {fraction}")
    low = [float(r["rate_rps"]) for r in rows if float(r[basis]) < fraction * float(r["rate_rps"])]
    return min(low) if low else None


def tail_check(rows: Sequence[dict], fraction: float = SATURATION_FRACTION,
               max_ratio: float = TAIL_RATIO_MAX, basis: str = "goodput_rps",
               kind: str | None = None) -> dict[str, Any]:
    """The tail-latency check of one mode: p99 TTFT <= ``max_ratio`` x p50 TTFT at half the
    mode's saturation rate.

    rows: that mode's runs (``rate_rps``, ``goodput_rps``, ``ttft_s`` {p50, p99} in s).
    Saturation: :func:`saturation_rate` (the lowest rate whose goodput, or with ``basis``
    "throughput_rps" throughput, is below ``fraction`` of the offered rate). With a 2 s SLO
    that new contexts cannot meet on a slow engine, goodput stays below 90% of any offered
    rate, so the goodput saturation is the lowest rate measured; the throughput basis
    then says where the engine itself saturates. The target is half of it; when no rate saturates, half the
    highest rate measured (``saturated`` False: the true target is higher). The check uses
    the measured rate nearest the target (the lower one on a tie). Returns {saturation_rps
    (None: not reached), saturated, target_rps, rate_rps, p50_s, p99_s, ratio (p99 / p50;
    None without TTFTs), max_ratio, passed (ratio <= max_ratio; None without a ratio), kind}.
    ``kind`` "reused" or "new" takes p50 and p99 of that kind of request only (the row's
    ``reused`` / ``new`` summary; the saturation stays the mode's): on a mix of reused contexts
    (a KV load, well under a second) and new ones (a prefill of seconds) the p99 of all
    requests is a new context's and the p50 a reused one's whenever more than 1% are new, so
    the check of all requests measures the mix; the check of one kind measures queueing.
    Raises ValueError for an empty list or an unknown kind."""
    if kind not in (None, "reused", "new"):
        raise ValueError(f"kind must be None, 'reused' or 'new', not {kind!r}")
    sat = saturation_rate(rows, fraction, basis)
    rates = sorted({float(r["rate_rps"]) for r in rows})
    target = (sat if sat is not None else rates[-1]) / 2
    rate = min(rates, key=lambda x: (round(abs(x - target), 9), x))   # a tie (to 1e-9 req/s): the lower
    row = next(r for r in rows if float(r["rate_rps"]) == rate)
    ttft = row["ttft_s"] if kind is None else (row.get(kind) or {}).get("ttft_s", {})
    p50, p99 = ttft.get("p50"), ttft.get("p99")
    ratio = p99 / p50 if p50 and p99 is not None else None
    return {"basis": basis, "saturation_rps": sat, "saturated": sat is not None, "target_rps": target, "rate_rps": rate,
            "p50_s": p50, "p99_s": p99, "ratio": ratio, "max_ratio": max_ratio,
            "passed": None if ratio is None else ratio <= max_ratio, "kind": kind or "all"}
