"""evaluation.stats: bootstrap CI against a hand computation, Wilson against known values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from evaluation.stats import bootstrap_ci, mean_ci, wilson_ci, z_value


def test_z_value():
    assert z_value(0.95) == pytest.approx(1.959964, abs=1e-6)
    with pytest.raises(ValueError):
        z_value(1.0)


def test_bootstrap_exact_enumeration_matches_hand_computation():
    # values 0, 1, 2: the 27 resamples have sums 0..6 with counts 1, 3, 6, 7, 6, 3, 1.
    # sorted means m[0] = 0, m[1] = 1/3, ..., m[25] = 5/3, m[26] = 2.
    # 2.5% quantile at position 0.025 * 26 = 0.65: 0 + 0.65 * (1/3)         = 0.216667
    # 97.5% quantile at position 0.975 * 26 = 25.35: 5/3 + 0.35 * (2 - 5/3) = 1.783333
    lo, hi = bootstrap_ci([0.0, 1.0, 2.0], exact=True)
    assert lo == pytest.approx(0.65 / 3, abs=1e-12)
    assert hi == pytest.approx(5 / 3 + 0.35 / 3, abs=1e-12)
    # the default for n <= 7 is exact enumeration
    assert bootstrap_ci([0.0, 1.0, 2.0]) == (lo, hi)


def test_bootstrap_resampling_is_seeded_and_close_to_exact():
    vals = [0.3, 1.1, 0.7, 2.0, 0.1, 0.9]
    exact = bootstrap_ci(vals, exact=True)
    a = bootstrap_ci(vals, exact=False, n_resamples=20000, seed=1)
    b = bootstrap_ci(vals, exact=False, n_resamples=20000, seed=1)
    assert a == b
    assert a[0] == pytest.approx(exact[0], abs=0.03)
    assert a[1] == pytest.approx(exact[1], abs=0.03)


def test_bootstrap_degenerate_and_errors():
    assert bootstrap_ci([1.5]) == (1.5, 1.5)
    assert bootstrap_ci([2.0] * 40) == (2.0, 2.0)
    with pytest.raises(ValueError):
        bootstrap_ci([])
    with pytest.raises(ValueError):
        bootstrap_ci([1.0, float("nan")])
    with pytest.raises(ValueError):
        bootstrap_ci(list(range(10)), exact=True)


def test_bootstrap_large_sample_close_to_normal_interval():
    rng = np.random.default_rng(0)
    vals = rng.normal(1.0, 2.0, size=400)
    lo, hi = bootstrap_ci(vals, n_resamples=4000, seed=0)
    se = vals.std(ddof=1) / math.sqrt(vals.size)
    assert lo == pytest.approx(vals.mean() - 1.96 * se, abs=0.25 * se)
    assert hi == pytest.approx(vals.mean() + 1.96 * se, abs=0.25 * se)


@pytest.mark.parametrize("k,n,lo,hi", [
    (5, 10, 0.236593, 0.763407),     # Brown, Cai & DasGupta (2001); the usual textbook value
    (0, 10, 0.0, 0.277533),          # z^2 / (n + z^2)
    (10, 10, 0.722467, 1.0),
    (54, 60, 0.798505, 0.953357),    # by hand: center 0.875931, half 0.077426
    (1, 2, 0.094531, 0.905469),
])
def test_wilson_known_values(k, n, lo, hi):
    got = wilson_ci(k, n)
    assert got[0] == pytest.approx(lo, abs=1e-5)
    assert got[1] == pytest.approx(hi, abs=1e-5)


def test_wilson_errors():
    for bad in [(3, 2), (-1, 2), (0, 0), (1.0, 2)]:
        with pytest.raises(ValueError):
            wilson_ci(*bad)


def test_mean_ci_fields():
    out = mean_ci([1.0, 2.0, 3.0, 4.0])
    assert out["mean"] == 2.5 and out["n"] == 4
    assert out["sd"] == pytest.approx(np.std([1, 2, 3, 4], ddof=1))
    assert out["ci"][0] < 2.5 < out["ci"][1]


# ----------------------------------------------------------------------------- McNemar


def test_mcnemar_exact_known_values():
    from evaluation.stats import mcnemar_exact

    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(3, 3) == 1.0                       # balanced discordance: no evidence
    assert mcnemar_exact(0, 5) == pytest.approx(2 / 32)     # 2 * 0.5^5
    assert mcnemar_exact(5, 0) == mcnemar_exact(0, 5)        # two-sided: symmetric
    # b=1, c=9: 2 * (1 + 10) / 1024 (hand-computed binomial tail)
    assert mcnemar_exact(1, 9) == pytest.approx(22 / 1024)
    # scipy.stats.binomtest(2, 12, 0.5).pvalue = 0.0385742...: 2 * (1 + 12 + 66) / 4096
    assert mcnemar_exact(2, 10) == pytest.approx(158 / 4096)
    assert 0.0 < mcnemar_exact(20, 40) < 0.05 < mcnemar_exact(20, 30)


def test_mcnemar_exact_bad_input():
    from evaluation.stats import mcnemar_exact

    for b, c in ((-1, 2), (1.5, 2), (True, 1), (1, None)):
        with pytest.raises(ValueError):
            mcnemar_exact(b, c)
