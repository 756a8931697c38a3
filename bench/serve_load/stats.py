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
