"""Summaries and labels of results.json: computed once, used by every reader.

One path: ``run_benchmarks.py`` writes ``summaries`` with :func:`summarize`; the figures
(``visualize_results.py``) and the notebook recompute them with the same function when a
file has runs but no summaries, and label rows with :func:`plot_label`. Quality columns
are aggregated by the rule their metric declares in :data:`evaluation.metrics.METRICS`
(``share`` for ``correct`` -> ``accuracy``, ``median`` for the rest, as
docs/results-schema.md says); speed columns are medians with p25/p75 for TTFT.

This module imports only the standard library and :mod:`evaluation.metrics` (numpy, no
torch), so the figures can use it while reading nothing but the results file.
Run its tests: ``python -m pytest tests/harness/test_harness_units.py -q -k summar``.
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Iterable

from evaluation.metrics import Metric, result_metrics

TIMING_PARTS = ("lookup_s", "transfer_s", "decode_s", "inject_s", "prefill_s", "first_token_s",
                "e2e_s", "output_tokens_per_s")
"""Run fields summarised as ``<field>_median`` (seconds; tokens/s for the last)."""

GROUP_KEYS = ("mode", "level", "bandwidth_mbps")
"""A summary row per distinct (mode, level, bandwidth_mbps)."""

SPEED_DIRECTIONS = {"ttft_s": False, "bytes": False, "ratio_vs_dtype": True,
                    "output_tokens_per_s": True, "slo_violation_rate": False}


def plot_label(mode: Any, level: Any) -> str:
    """Label of a (mode, level) row: ``mode`` if level is None/NaN else ``f"{mode}-l{level}"``."""
    if level is None or (isinstance(level, float) and math.isnan(level)):
        return str(mode)
    return f"{mode}-l{int(level)}"


def _values(values: Iterable[Any]) -> list[float]:
    out = []
    for v in values:
        if v is None or isinstance(v, str):
            continue
        f = float(v)
        if not math.isnan(f):
            out.append(f)
    return out


def median(values: Iterable[Any]) -> float | None:
    """Median of the numeric, non-None, non-NaN values (bools as 0/1); None when none."""
    vals = _values(values)
    return statistics.median(vals) if vals else None


def quantile(values: Iterable[Any], q: float) -> float | None:
    """q-quantile (linear interpolation, numpy's default) of the values; None when none."""
    vals = sorted(_values(values))
    if not vals:
        return None
    pos = q * (len(vals) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def mean(values: Iterable[Any]) -> float | None:
    """Mean of the values (bools as 0/1, so a mean of flags is a share); None when none."""
    vals = _values(values)
    return sum(vals) / len(vals) if vals else None


AGGREGATORS = {"median": median, "share": mean, "mean": mean}


def aggregate_metric(metric: Metric, values: Iterable[Any]) -> float | None:
    """The metric's values over requests combined by its declared aggregation."""
    vals = [None if v is None else float(bool(v)) if metric.aggregation == "share" else v
            for v in values]
    return AGGREGATORS[metric.aggregation](vals)


def higher_is_better() -> dict[str, bool]:
    """Direction of every quality and speed column of results.json (lm-eval-harness habit):
    summary key -> True when larger is better."""
    out = {m.summary_key: m.higher_is_better for m in result_metrics()}
    out.update({m.column: m.higher_is_better for m in result_metrics()})
    out.update(SPEED_DIRECTIONS)
    return out


def failure_text(failures: Iterable[dict[str, Any]], mode: Any, level: Any) -> str | None:
    """``"<stage>: <reason>"`` of the first of ``failures`` (results.json ``failures``) for
    (mode, level) (a failure with level None counts for every level of its mode), with
    ``" (+N more)"`` when there are several; None when none."""
    hits = [f for f in failures or () if isinstance(f, dict) and f.get("mode") == mode
            and (f.get("level") is None or f.get("level") == level)]
    if not hits:
        return None
    first = hits[0]
    more = f" (+{len(hits) - 1} more)" if len(hits) > 1 else ""
    return f"{first.get('stage', 'failed')}: {first.get('reason', '')}{more}"


def summarize(runs: list[dict[str, Any]], failures: list[dict[str, Any]] | None = None,
              bandwidths: Iterable[Any] | None = None) -> list[dict[str, Any]]:
    """Per (mode, level, bandwidth_mbps): medians over contexts and repeats.

    Timing and size columns: medians (``ttft_s`` also p25/p75); quality columns by their
    metric's rule (``accuracy`` = share of correct answers, the others medians);
    ``slo_violation_rate`` = share of adaptive runs over the SLO; ``load_errors`` = runs
    whose load stopped early (``load_error`` set). Units as in the runs (s, bytes,
    Mbit/s). Rows sorted by bandwidth, mode, level.
    ``failures`` (results.json ``failures``: a codec's calibration, encode, perplexity
    pass or request that failed): a row of a (mode, level) with failures gets ``failed``
    = ``failure_text``; a failed (mode, level) without any run gets a row per bandwidth
    of ``bandwidths`` (the configured ones) with ``n`` 0, empty columns and ``failed``.
    """
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault(tuple(run.get(k) for k in GROUP_KEYS), []).append(run)
    seen = {(m, lv) for m, lv, _ in groups}
    for f in failures or ():
        key = (f.get("mode"), f.get("level")) if isinstance(f, dict) else None
        if key is None or key in seen or (key[1] is None and any(m == key[0] for m, _ in seen)):
            continue
        seen.add(key)
        for bw in bandwidths or ():
            if isinstance(bw, (int, float)) and not isinstance(bw, bool):
                groups.setdefault((key[0], key[1], bw), [])

    def order(key: tuple) -> tuple:
        mode, level, bw = key
        return (bw if bw is not None else -1.0, str(mode), -1 if level is None else level)

    out = []
    for key in sorted(groups, key=order):
        rows = groups[key]
        mode, level, bw = key

        def col(name: str) -> list[Any]:
            return [r.get(name) for r in rows]

        ttft = col("ttft_s")
        slo = [r.get("slo_violated") for r in rows if r.get("slo_violated") is not None]
        row = {"mode": mode, "level": level, "bandwidth_mbps": bw, "n": len(rows),
               "ttft_s_median": median(ttft), "ttft_s_p25": quantile(ttft, 0.25),
               "ttft_s_p75": quantile(ttft, 0.75),
               **{f"{p}_median": median(col(p)) for p in TIMING_PARTS},
               "bytes_median": median(col("bytes")),
               "ratio_vs_dtype": median(col("ratio_vs_dtype"))}
        for m in result_metrics():
            row[m.summary_key] = aggregate_metric(m, [(r.get("quality") or {}).get(m.column)
                                                      for r in rows])
        row["slo_violation_rate"] = mean(float(bool(s)) for s in slo) if slo else None
        row["load_errors"] = sum(1 for r in rows if r.get("load_error"))
        failed = failure_text(failures, mode, level)
        if failed:
            row["failed"] = failed
        out.append(row)
    return out
