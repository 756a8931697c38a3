"""Adaptation measured honestly: several requests per recorded trace (cyclic start offsets, paired across
policies), real-vs-simulated agreement on the same requests, and the estimator's prior and
chance-constrained rate (streaming.adapt.ThroughputEstimator)."""

import math

import pytest

from bench import adapt as B
from tests.helpers.policy import make_policy
from streaming.adapt import AdaptivePolicy, ThroughputEstimator
from streaming.adapt.traces import Trace, artifact_generated, artifact_recorded

MBPS = 1e6 / 8


def test_start_offsets_are_seeded_distinct_and_all_when_count_covers_the_trace():
    assert B.start_offsets(10, 10) == list(range(10))
    assert B.start_offsets(10, 25) == list(range(10))
    a = B.start_offsets(10, 3, seed=7)
    assert a == B.start_offsets(10, 3, seed=7) and len(set(a)) == 3 and all(0 <= x < 10 for x in a)
    assert a == sorted(a)
    with pytest.raises(ValueError):
        B.start_offsets(10, 0)


def test_rotate_wraps_around_and_names_the_offset():
    t = Trace("tr", (1.0, 2.0, 3.0, 4.0), "src", 0.1)
    r = B.rotate(t, 1)
    assert r.mbps == (2.0, 3.0, 4.0, 1.0) and r.name == "tr@1" and r.scale == 0.1 and r.source == "src"
    assert B.rotate(t, 5).mbps == r.mbps and B.rotate(t, 0).mbps == t.mbps


def test_trace_sets_offsets_give_paired_requests_per_trace():
    s = B.trace_sets(10, 0.1, quick=False, offsets=10)
    assert len(s["artifact"]) == 100 and len(s["generated"]) == 10 * len(artifact_generated(0.1))
    names = {t.name for t in s["artifact"]}
    assert "bw_traces_gbps-0@0" in names and "bw_traces_gbps-9@9" in names
    r5 = next(t for t in s["artifact"] if t.name == "bw_traces_gbps-3@5")
    base = artifact_recorded(0.1)[3]
    assert r5.mbps[0] == base.mbps[5] and r5.mbps[5] == base.mbps[0]
    assert len(s["constant"]) == 3 and len(s["step"]) == 2  # not rotated
    assert len(B.trace_sets(10, 0.1, quick=True, offsets=2)["artifact"]) == 4 * 2


def _r(trace, policy, violated, total, link):
    return {"trace": trace, "slo_s": 2.0, "policy": policy, "trace_set": "artifact", "violated": violated,
            "total_s": total, "link": link}


def test_sim_vs_real_compares_the_same_requests_only():
    sim = [_r("a@0", "adaptive", False, 1.0, "simulated"), _r("a@3", "adaptive", True, 2.5, "simulated"),
           _r("b@0", "adaptive", True, 2.2, "simulated"),  # not run on the real link: left out
           _r("a@0", "oracle", False, 0.9, "simulated")]
    real = [_r("a@0", "adaptive", True, 2.1, "real"), _r("a@3", "adaptive", True, 2.7, "real")]
    (x,) = B.sim_vs_real(sim, real)
    assert x["n"] == 2 and x["violation_rate_real"] == 1.0 and x["violation_rate_sim"] == 0.5
    assert x["diff_points"] == 50.0 and x["same_outcome"] == 1
    assert x["total_s_real_minus_sim_mean"] == pytest.approx((1.1 + 0.2) / 2)


def test_prior_error_discounts_until_enough_errors_are_measured():
    e = ThroughputEstimator(100 * MBPS, window=5, prior_error=1.0, prior_until=2)
    assert e.robust_estimate() == pytest.approx(50 * MBPS)  # prior: 2x discount before any error
    e.observe(10_000_000, 10_000_000 / (100 * MBPS))  # exact prediction: error 0, 1 of 2 measured
    assert e.robust_estimate() == pytest.approx(50 * MBPS)
    e.observe(10_000_000, 10_000_000 / (100 * MBPS))
    assert e.robust_estimate() == pytest.approx(100 * MBPS)  # the prior is gone
    with pytest.raises(ValueError):
        ThroughputEstimator(None, prior_error=-1.0)


def test_quantile_rate_by_hand():
    e = ThroughputEstimator(None, window=5)
    assert e.quantile_rate(1.645, 4) is None
    e = ThroughputEstimator(100 * MBPS)
    # one (prior) value: sd = prior_cv * mu; z=1, horizon 4: 1 / (mu (1 + 0.5))
    assert e.quantile_rate(1.0, 4, prior_cv=1.0) == pytest.approx(100 * MBPS / 1.5)
    for r in (100, 400):
        e.observe(20_000_000, 20_000_000 / (r * MBPS))
    inv = [1 / (100 * MBPS), 1 / (400 * MBPS)]
    mu = sum(inv) / 2
    sd = math.sqrt(sum((v - mu) ** 2 for v in inv))  # n - 1 = 1
    assert e.quantile_rate(2.0, 9) == pytest.approx(1 / (mu + 2.0 * sd / 3.0))
    c = ThroughputEstimator(None)
    for _ in range(3):
        c.observe(20_000_000, 20_000_000 / (500 * MBPS))
    assert c.quantile_rate(2.0, 5) == pytest.approx(500 * MBPS)  # a constant link: its rate


def test_min_plan_frac_sets_the_planning_limit():
    p = make_policy(1.0, 1000.0, 100.0, slo_margin=0.05, slo_reserve_s=0.8, min_plan_frac=0.3)
    assert p.plan_slo_s == pytest.approx(0.3)
    p = make_policy(1.0, 1000.0, 100.0, slo_margin=0.05, slo_reserve_s=0.8)
    assert p.plan_slo_s == pytest.approx(0.5)
    with pytest.raises(ValueError):
        make_policy(1.0, 1000.0, 100.0, min_plan_frac=0.0)
