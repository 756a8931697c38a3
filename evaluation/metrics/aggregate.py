"""Aggregation of per-request metric values: median, quantiles, mean with standard error
and the summary dict of all of them (aggregate); None values (metric not applicable) are
dropped, NaN is refused.

Part of evaluation.metrics (whose face exports every name). Numbers in, numbers out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np


def _clean(values: Iterable[Any]) -> np.ndarray:
    """Values as float64, dropping None (metric not applicable). NaN/inf are rejected."""
    out = []
    for v in values:
        if v is None:
            continue
        if isinstance(v, (bool, np.bool_)):
            v = float(v)
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"cannot aggregate non-numeric value {v!r}") from None
        if math.isnan(f):
            raise ValueError("cannot aggregate NaN; use None for a value that does not apply")
        out.append(f)
    return np.asarray(out, dtype=np.float64)


def median(values: Iterable[Any]) -> float:
    """Median of the non-None values (bools count as 0/1).

    Raises:
        ValueError: no values left, NaN, or non-numeric values.
    """
    arr = _clean(values)
    if arr.size == 0:
        raise ValueError("median of no values")
    return float(np.median(arr))


def quantile(values: Iterable[Any], q: float) -> float:
    """q-quantile (0 <= q <= 1) of the non-None values, linear interpolation (numpy default).

    Raises:
        ValueError: q outside [0, 1], no values, NaN, or non-numeric values.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must lie in [0, 1], got {q}")
    arr = _clean(values)
    if arr.size == 0:
        raise ValueError("quantile of no values")
    return float(np.quantile(arr, q))


def mean_stderr(values: Iterable[Any]) -> tuple[float, float | None]:
    """Mean and standard error of the mean (sample std, ddof=1, / sqrt(n)).

    The standard error is None for a single value (it is undefined), as lm-evaluation-harness
    reports N/A. Bools count as 0/1, so the mean of ``correct`` flags is the accuracy.

    Raises:
        ValueError: no values, NaN, or non-numeric values.
    """
    arr = _clean(values)
    if arr.size == 0:
        raise ValueError("mean of no values")
    mean = float(arr.mean())
    if arr.size < 2:
        return mean, None
    return mean, float(arr.std(ddof=1) / math.sqrt(arr.size))


def aggregate(values: Iterable[Any]) -> dict[str, float | int | None]:
    """Summary of a metric over requests: ``n``, ``median``, ``p25``, ``p75``, ``mean``, ``stderr``.

    None entries (metric not applicable to that request) are dropped; with no values left
    every statistic is None and ``n`` is 0, so the dict can be written to results.json as is.

    Raises:
        ValueError: NaN or non-numeric values.
    """
    arr = _clean(values)
    if arr.size == 0:
        return {"n": 0, "median": None, "p25": None, "p75": None, "mean": None, "stderr": None}
    mean, stderr = mean_stderr(arr.tolist())
    return {
        "n": int(arr.size),
        "median": float(np.median(arr)),
        "p25": float(np.quantile(arr, 0.25)),
        "p75": float(np.quantile(arr, 0.75)),
        "mean": mean,
        "stderr": stderr,
    }
