"""The goals' statistics in bench.adapt: the paired cluster bootstrap of
(adaptive - reference) differences, goals() per trace set with its intervals, and the
held-out artifact-generator traces (streaming.adapt.traces.artifact_generator)."""

import numpy as np
import pytest

from bench import adapt as B
from bench.adapt import stats as adapt_stats
from streaming.adapt.traces import GENERATOR_SEED, artifact_generator, synthetic_uniform


def _q(trace, violated, kl=None, policy="adaptive", slo=1.0, ts="artifact"):
    return {"trace": trace, "violated": violated, "quality_kl": kl, "policy": policy, "slo_s": slo,
            "trace_set": ts, "link": "simulated", "overshoot_s": 0.1 if violated else 0.0, "regret_vs_oracle": None}


def test_cluster_of_strips_the_start_offset():
    assert B.cluster_of("bw_traces_gbps-5@3") == "bw_traces_gbps-5"
    assert B.cluster_of("synthetic-uniform-1-7") == "synthetic-uniform-1-7"


def test_bootstrap_weights_draw_n_clusters_per_replicate_reproducibly():
    w = B.bootstrap_weights(4, reps=50, seed=3)
    assert w.shape == (50, 4) and (w.sum(axis=1) == 4).all() and (w >= 0).all()
    assert (w == B.bootstrap_weights(4, reps=50, seed=3)).all()
    assert not (w == B.bootstrap_weights(4, reps=50, seed=4)).all()
    with pytest.raises(ValueError):
        B.bootstrap_weights(0)


def test_two_clusters_hand_computed():
    # cluster A: one request, adaptive violated, oracle met -> A's diff 1
    # cluster B: three requests, adaptive violated 1 of 3, oracle 0 of 3 -> B's diff 1/3
    a = [_q("A@0", True), _q("B@0", True), _q("B@1", False), _q("B@2", False)]
    o = [_q(r["trace"], False, policy="oracle") for r in a]
    res = B.cluster_bootstrap_diff(a, o, "violated", reps=2000, seed=0)
    # full sample: 2/4 - 0/4 = 0.5; the replicates can only be {A,A}: 1, {B,B}: 1/3, {A,B}: 2/4
    assert res["diff"] == pytest.approx(0.5)
    assert res["n"] == 4 and res["n_traces"] == 2 and res["reps"] == 2000 and res["reps_defined"] == 2000
    # each extreme has probability 1/4 > 2.5%: the percentile interval is [1/3, 1]
    assert res["ci95"] == [pytest.approx(0.3333, abs=1e-4), pytest.approx(1.0)]


def test_clusters_are_kept_together():
    # 2 clusters of 5 requests; adaptive violates all of A and none of B. Resampling requests
    # one by one would give rates like 0.3 or 0.7; resampling clusters gives only 0, 0.5, 1.
    a = [_q(f"A@{i}", True) for i in range(5)] + [_q(f"B@{i}", False) for i in range(5)]
    o = [_q(r["trace"], False, policy="oracle") for r in a]
    w = B.bootstrap_weights(2, reps=500, seed=1)
    res = B.cluster_bootstrap_diff(a, o, "violated", reps=500, seed=1)
    # the replicate values, recomputed from the same draws, are all cluster mixtures
    vals = {round(float(x), 6) for x in (w[:, 0] * 5) / (w.sum(axis=1) * 5)}
    assert vals <= {0.0, 0.5, 1.0}
    assert res["ci95"] == [0.0, 1.0]
    assert res["n_traces"] == 2


def test_paired_differences_of_equal_policies_have_a_zero_interval():
    # the same outcomes for both policies on every request: paired, every replicate's difference
    # is 0 (an unpaired bootstrap would draw the two sides independently and spread around 0)
    rng = np.random.default_rng(0)
    a = [_q(f"T{t}@{o}", bool(rng.random() < 0.4), float(rng.random())) for t in range(8) for o in range(3)]
    b = [dict(r, policy="oracle") for r in a]
    v = B.cluster_bootstrap_diff(a, b, "violated")
    assert v["diff"] == 0.0 and v["ci95"] == [0.0, 0.0] and v["n_traces"] == 8
    k = B.cluster_bootstrap_diff(a, b, "quality_kl", met_only=True)
    assert k["diff"] == 0.0 and k["ci95"] == [0.0, 0.0]


def test_met_only_kl_and_unknown_quality():
    # met-only means pool the met requests of each side per replicate
    a = [_q("A@0", False, 0.02), _q("A@1", True, 0.9), _q("B@0", False, 0.04)]
    b = [_q("A@0", False, 0.01, "fixed-l2"), _q("A@1", False, 0.01, "fixed-l2"), _q("B@0", True, 0.01, "fixed-l2")]
    res = B.cluster_bootstrap_diff(a, b, "quality_kl", met_only=True, reps=2000, seed=0)
    assert res["diff"] == pytest.approx(0.03 - 0.01)  # mean(0.02, 0.04) - mean(0.01, 0.01)
    # {A,A}: 0.02 - 0.01; {B,B}: fixed has no met load -> undefined; {A,B}: 0.03 - 0.01
    assert res["reps_defined"] < 2000
    assert res["ci95"] == [pytest.approx(0.01), pytest.approx(0.02)]
    assert B.cluster_bootstrap_diff([_q("A@0", False)], [_q("A@0", False)], "quality_kl") is None
    with pytest.raises(ValueError):
        B.cluster_bootstrap_diff([_q("A@0", False)], [_q("A@1", False)])


def test_goal2_interval_chooses_the_comparator_again_in_each_replicate():
    # clusters A and B, one request each. adaptive: A met (KL 0.05), B violated.
    # fixed-l0: both met (KL 0.07); fixed-l5: A violated, B met (KL 0.01).
    # full sample: every policy but l0 misses 1 of 2 -> l5 qualifies (0.5 <= 0.5): 0.05 - 0.01 = 0.04
    # {A,A}: adaptive 0% -> only l0 qualifies: 0.05 - 0.07 = -0.02; {A,B}: 0.04; {B,B}: adaptive
    # has no met load -> undefined
    by = {"adaptive": [_q("A", False, 0.05), _q("B", True, 0.05)],
          "fixed-l0": [_q("A", False, 0.07, "fixed-l0"), _q("B", False, 0.07, "fixed-l0")],
          "fixed-l5": [_q("A", True, 0.01, "fixed-l5"), _q("B", False, 0.01, "fixed-l5")],
          "oracle": [_q("A", False, 0.0, "oracle"), _q("B", False, 0.0, "oracle")]}
    g = B.cluster_bootstrap_goal2(by, met_only=True, reps=2000, seed=0)
    assert g["ci95"] == [pytest.approx(-0.02), pytest.approx(0.04)]
    assert g["n_traces"] == 2 and 1300 < g["reps_defined"] < 1700  # {B,B} is 1/4 of the draws
    assert set(g["comparators"]) == {"fixed-l0", "fixed-l5"}  # the oracle is never a comparator
    assert 0.25 < g["comparators"]["fixed-l0"] < 0.42 and g["comparators"]["fixed-l5"] > 0.58
    by["fixed-l5"] = by["fixed-l5"][:1]
    with pytest.raises(ValueError):
        B.cluster_bootstrap_goal2(by)
    assert B.cluster_bootstrap_goal2({"adaptive": by["adaptive"]}) is None


def test_goals_per_trace_set_with_intervals():
    reqs = []
    for ts, ntr in (("artifact", 5), ("step", 2)):
        for t in range(ntr):
            for o in range(2 if ts == "artifact" else 1):
                name = f"{ts}-{t}@{o}" if ts == "artifact" else f"{ts}-{t}"
                miss = t == 0
                reqs += [_q(name, miss, 0.07, "adaptive", ts=ts), _q(name, False, 0.03, "oracle", ts=ts),
                         _q(name, False, 0.07, "fixed-l0", ts=ts), _q(name, True, 0.003, "fixed-l5", ts=ts)]
    rows = B.aggregate(reqs)
    gl = B.goals(rows, reqs=reqs, reps=2000)
    assert [(g["trace_set"], g["slo_s"]) for g in gl] == [("artifact", 1.0), ("step", 1.0)]
    art, st = gl
    assert art["n"] == 10 and art["n_traces"] == 5 and st["n"] == 2 and st["n_traces"] == 2
    # artifact: adaptive misses on trace 0's 2 requests: 20% vs oracle 0% -> G1 missed. A
    # replicate's rate is k/5 with k ~ Binomial(5, 1/5) draws of trace 0: P(k=0) = 0.33,
    # P(k>=3) = 0.058, P(k>=4) = 0.007 -> percentile interval [0, 0.6]: inconclusive
    assert art["g1_slo"] is False and art["violation_diff_vs_oracle"] == 0.2
    assert art["violation_diff_vs_oracle_ci95"] == [0.0, 0.6] and art["g1_ci"] == "inconclusive"
    # quality: the best fixed level at no more violations is fixed-l0 in every replicate
    # (fixed-l5 misses always); adaptive's met loads have the same KL -> difference 0
    assert art["best_fixed"] == "fixed-l0" and art["kl_met_diff_vs_best_fixed"] == 0.0
    assert art["kl_met_diff_vs_best_fixed_ci95"] == [0.0, 0.0] and art["g2_ci"] == "met"
    assert art["g2_ci_comparators"] == {"fixed-l0": 1.0}
    # 2 traces: an interval is given, no verdict
    assert st["violation_diff_vs_oracle"] == 0.5 and st["g1_ci"] == "too few traces"
    # rows carry the number of distinct traces too
    assert {r["n_traces"] for r in rows if r["trace_set"] == "artifact"} == {5}
    # without reqs the old fields only (the schema's readers)
    (g,) = B.goals(rows, trace_set="artifact")
    assert "n_traces" not in g and g["g1_slo"] is False
    assert adapt_stats._ci_verdict([0.0, 0.04], 0.05) == "met" and adapt_stats._ci_verdict([0.06, 0.1], 0.05) == "missed"
    assert adapt_stats._ci_verdict([0.06, 0.1], 0.05, n_traces=3) == "too few traces"


def test_artifact_generator_is_the_artifacts_range_scaled_and_seeded():
    tr = artifact_generator(10, 100, scale=0.1)
    assert len(tr) == 100 and all(len(t.mbps) == 10 for t in tr)
    vals = [v for t in tr for v in t.mbps]
    assert 10.0 <= min(vals) and max(vals) <= 1000.0  # 0.1-10 Gbit/s x 1000 x 0.1
    assert 450 < sum(vals) / len(vals) < 560  # uniform: mean 505 Mbit/s (sd of the mean ~9)
    assert tr[0].name == f"artifact-generator-{GENERATOR_SEED}-0" and tr[0].scale == 0.1
    assert artifact_generator(10, 3)[2].mbps == tr[2].mbps  # reproducible
    # a held-out draw: not the synthetic tuning set's values (seed 1)
    assert tr[0].mbps != synthetic_uniform(10, 1, seed=1)[0].mbps
    assert GENERATOR_SEED not in (1, 2, 3)  # the tuning sets' seeds (bench.adapt, scripts/adapt_tune.py)
    assert max(artifact_generator(4, 2, scale=1.0)[0].mbps) > 1000.0  # scale applies
    with pytest.raises(ValueError):
        artifact_generator(0, 1)
    sets = B.trace_sets(10, 0.1, quick=False)
    assert len(sets["artifact-generator"]) == 100
    assert len(B.trace_sets(10, 0.1, quick=True)["artifact-generator"]) == 10
    assert "artifact-generator" not in B.trace_sets(10, 0.1, quick=False, generator=0)
