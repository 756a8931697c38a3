"""Confidence intervals for quality figures: paired bootstrap over windows, Wilson for proportions.

Purpose: every quality figure of the harness is reported with its n and a 95% CI
(docs/results-schema.md). Pure functions, numbers in, numbers out; no model, engine or
network.

- :func:`bootstrap_ci`: percentile bootstrap CI of a mean (Efron & Tibshirani 1993,
  "An Introduction to the Bootstrap", ch. 13). For a paired comparison (decoded vs
  lossless on the same windows, or codec A vs codec B) pass the per-window values or
  per-window differences: resampling whole windows keeps the pairing. Seeded resampling,
  or exact enumeration of all n^n resamples for tiny n.
- :func:`wilson_ci`: Wilson score interval of a binomial proportion (Wilson 1927; Brown,
  Cai & DasGupta 2001, "Interval Estimation for a Binomial Proportion").
- :func:`mean_ci`: mean + bootstrap CI as a dict ready for a results row.
- :func:`mcnemar_exact`: McNemar's paired test of two classifiers on the same items, in its
  exact (binomial) form (McNemar 1947; Edwards 1948; Fagerland, Lydersen & Laake 2013, "The
  McNemar test for binary matched-pairs data").

Run the tests: ``python -m pytest tests/evaluation/test_evaluation_stats.py -q``
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from statistics import NormalDist

import numpy as np

__all__ = ["bootstrap_ci", "wilson_ci", "mean_ci", "mcnemar_exact", "z_value"]

EXACT_MAX_N = 7  # exact enumeration of n^n resamples up to n = 7 (823,543 resamples)


def z_value(confidence: float = 0.95) -> float:
    """Two-sided standard-normal quantile: 1.959964 for 0.95. ValueError outside (0, 1)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    return NormalDist().inv_cdf(0.5 + confidence / 2.0)


def _values(values: Sequence[float] | np.ndarray) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    if arr.size == 0:
        raise ValueError("need at least one value")
    if not np.all(np.isfinite(arr)):
        raise ValueError("values must be finite")
    return arr


def bootstrap_ci(values: Sequence[float] | np.ndarray, confidence: float = 0.95,
                 n_resamples: int = 10000, seed: int = 0, exact: bool | None = None
                 ) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of the mean of ``values``.

    Each resample draws ``n = len(values)`` values with replacement and takes their mean;
    the interval is the ``(1-c)/2`` and ``(1+c)/2`` quantiles of the resampled means
    (numpy's default linear interpolation between order statistics).

    Args:
        values: per-unit values (e.g. per-window KL, or per-window paired differences),
            1-D, finite, n >= 1.
        confidence: coverage in (0, 1), default 0.95.
        n_resamples: number of random resamples (ignored when exact).
        seed: ``numpy.random.default_rng(seed)`` seed: the same inputs give the same CI.
        exact: enumerate all n^n equally likely resamples instead of drawing; None = exact
            when n <= EXACT_MAX_N.

    Returns:
        (lo, hi) floats, lo <= mean <= hi up to resampling noise; (x, x) for n = 1.

    Raises:
        ValueError: empty or non-finite values, confidence outside (0, 1),
            n_resamples < 1, exact=True with n > EXACT_MAX_N.
    """
    arr = _values(values)
    z_value(confidence)  # validates confidence
    n = arr.size
    if exact is None:
        exact = n <= EXACT_MAX_N
    if exact:
        if n > EXACT_MAX_N:
            raise ValueError(f"exact bootstrap enumerates n^n resamples: n must be <= {EXACT_MAX_N}, got {n}")
        idx = np.array(list(itertools.product(range(n), repeat=n)), dtype=np.int64)
    else:
        if isinstance(n_resamples, bool) or not isinstance(n_resamples, int) or n_resamples < 1:
            raise ValueError(f"n_resamples must be a positive int, got {n_resamples!r}")
        idx = np.random.default_rng(seed).integers(0, n, size=(n_resamples, n))
    means = arr[idx].mean(axis=1)
    alpha = 1.0 - confidence
    lo, hi = np.quantile(means, [alpha / 2.0, 1.0 - alpha / 2.0])
    return float(lo), float(hi)


def wilson_ci(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a proportion ``successes / n``.

    ``center = (p + z^2/2n) / (1 + z^2/n)``, ``half = z sqrt(p(1-p)/n + z^2/4n^2) / (1 + z^2/n)``
    with ``z`` the two-sided normal quantile (1.96 for 95%). Stays inside [0, 1] and is not
    degenerate at 0/n or n/n (unlike the Wald interval).

    Returns:
        (lo, hi) in [0, 1].

    Raises:
        ValueError: n < 1, successes outside [0, n], non-integers, bad confidence.
    """
    for name, val in (("successes", successes), ("n", n)):
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)):
            raise ValueError(f"{name} must be an int, got {val!r}")
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"need n >= 1 and 0 <= successes <= n, got successes={successes}, n={n}")
    z = z_value(confidence)
    p = successes / n
    denom = 1.0 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1.0 - p) / n + z * z / (4.0 * n * n)) / denom
    lo, hi = max(0.0, center - half), min(1.0, center + half)
    if successes == 0:
        lo = 0.0
    if successes == n:
        hi = 1.0
    return lo, hi


def mean_ci(values: Sequence[float] | np.ndarray, confidence: float = 0.95, n_resamples: int = 10000,
            seed: int = 0) -> dict:
    """``{"mean", "ci": [lo, hi], "sd", "n"}`` of per-unit ``values`` (bootstrap CI of the
    mean, :func:`bootstrap_ci`; ``sd`` the sample standard deviation, 0 for n = 1).
    Raises ValueError as :func:`bootstrap_ci`."""
    arr = _values(values)
    lo, hi = bootstrap_ci(arr, confidence, n_resamples, seed)
    sd = float(arr.std(ddof=1)) if arr.size > 1 else 0.0
    return {"mean": float(arr.mean()), "ci": [lo, hi], "sd": sd, "n": int(arr.size)}


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value of paired binary outcomes.

    ``b``: items the first method got right and the second wrong; ``c``: the reverse (the
    discordant pairs; concordant pairs carry no information). Under the null hypothesis of
    equal accuracy each discordant pair falls either way with probability 1/2, so
    ``p = min(1, 2 * P[Binomial(b + c, 1/2) <= min(b, c)])``; 1.0 when ``b + c == 0``.

    Raises:
        ValueError: negative or non-integer counts.
    """
    for name, val in (("b", b), ("c", c)):
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 0:
            raise ValueError(f"{name} must be a non-negative int, got {val!r}")
    n = int(b) + int(c)
    if n == 0:
        return 1.0
    k = min(int(b), int(c))
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0 ** n
    return min(1.0, 2.0 * tail)
