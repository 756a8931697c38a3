"""bench.adapt's pure parts (aggregation, quality table, trace sets, simulation of every
policy on a tiny level table), its bad-input exit, and the adaptation figures."""

import json

import pytest

from bench import adapt as B
from bench.adapt import cli as adapt_cli, stats as adapt_stats

TABLE = {"tokens": [100, 100, 100], "sizes": {"0": [200_000] * 3, "1": [400_000] * 3},
         "decode_s_per_token": {"0": 1e-4, "1": 2e-4}, "prefill_tps_hf": 1000.0}


def test_aggregate_by_hand():
    reqs = [{"link": "simulated", "policy": "adaptive", "trace_set": "a", "slo_s": 1.0, "overshoot_s": o,
             "violated": o > 0, "quality_kl": q, "regret_vs_oracle": g, "abandons": 1}
            for o, q, g in [(0.0, 0.01, 0.0), (0.5, 0.03, 0.02), (0.0, 0.02, 0.01), (1.0, None, None)]]
    (row,) = B.aggregate(reqs)
    assert row["n"] == 4 and row["violation_rate"] == 0.5
    assert row["overshoot_s_mean"] == pytest.approx(0.375) and row["overshoot_s_p95"] == 1.0
    assert row["quality_kl"] == pytest.approx(0.02) and row["regret_vs_oracle"] == pytest.approx(0.01)
    assert row["abandons"] == 4


def test_quality_table(tmp_path):
    kl, note = B.load_quality(tmp_path / "missing.json")
    assert kl is None and "unavailable" in note
    p = tmp_path / "q.json"
    p.write_text(json.dumps({"rows": [{"codec": "cachegen", "level": 1, "kl": 0.04},
                                      {"codec": "quant8", "level": None, "kl": 0.001},
                                      {"codec": "cachegen", "level": 5, "kl": 0.003}]}))
    kl, _ = B.load_quality(p)
    assert kl == {1: 0.04, 5: 0.003}


def test_trace_sets_and_simulation_of_every_policy():
    sets = B.trace_sets(3, 0.1, quick=False)
    assert len(sets["artifact"]) == 10 and len(sets["constant"]) == 3 and len(sets["step"]) == 2
    small = {"constant": [t for t in sets["constant"]]}
    reqs, tls = B.simulate_all(TABLE, small, (0.5, 2.0), 1000.0, 0.0, 0.001, 0.0, {0: 0.05, 1: 0.01},
                               log=lambda *a: None)
    pols = {r["policy"] for r in reqs}
    assert pols == {"adaptive", "oracle", "text", "fixed-l0", "fixed-l1"}
    assert len(reqs) == 5 * 3 * 2
    # text-only: 300 tokens / 1000 tokens/s = 0.3 s, exact (KL 0): the oracle takes it at SLO 0.5
    o = [r for r in reqs if r["policy"] == "oracle" and r["trace"] == "constant-1000" and r["slo_s"] == 0.5][0]
    assert o["levels"] == [None, None, None] and o["quality_kl"] == 0.0 and not o["violated"]
    for r in reqs:  # nobody beats the oracle's utility without violating
        if not r["violated"]:
            assert r["regret_vs_oracle"] >= -1e-9


def test_bad_input_exits_2(capsys, monkeypatch):
    assert B.main(["--no-real", "--chunk-tokens", "100"]) == 2
    assert "multiple of 16" in capsys.readouterr().err
    # counts are checked before the level table is measured (that takes a minute)
    monkeypatch.setattr(adapt_cli, "measure_level_table", lambda *a, **k: (_ for _ in ()).throw(AssertionError("measured")))
    for flag, bad, lo in (("--generator-traces", "-1", 0), ("--bootstrap-reps", "0", 1), ("--offsets", "0", 1),
                          ("--real-offsets", "0", 1)):
        assert B.main(["--no-real", flag, bad]) == 2
        err = capsys.readouterr().err
        assert f"{flag} must be >= {lo}, got {bad}" in err and "Traceback" not in err


def test_goal_2_unknown_without_fixed_rows_and_vacuous_without_a_qualifying_one():
    def row(policy, v, kl):
        return {"policy": policy, "trace_set": "t", "link": "simulated", "slo_s": 1.0, "n": 10,
                "violation_rate": v, "quality_kl_met": kl, "quality_kl": kl}
    only = adapt_stats._goal([row("adaptive", 0.1, 0.02), row("oracle", 0.0, 0.01)], "t", "simulated", 1.0)
    assert only["g2_quality"] is None and only["best_fixed"] is None        # no fixed level measured
    worse = adapt_stats._goal([row("adaptive", 0.1, 0.02), row("fixed-l5", 0.5, 0.001)], "t", "simulated", 1.0)
    assert worse["g2_quality"] is True and worse["best_fixed"] is None      # none at no more violations
    beat = adapt_stats._goal([row("adaptive", 0.1, 0.02), row("fixed-l2", 0.1, 0.01)], "t", "simulated", 1.0)
    assert beat["g2_quality"] is False and beat["best_fixed"] == "fixed-l2"


def test_adaptation_figures(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import visualize_results as V

    sets = {"artifact": B.trace_sets(3, 0.1, quick=True)["artifact"][:2]}
    reqs, tls = B.simulate_all(TABLE, sets, (0.5, 1.0), 1000.0, 0.0, 0.001, 0.0, None, log=lambda *a: None)
    doc = {"rows": B.aggregate(reqs), "timelines": tls}
    p = tmp_path / "adaptation.json"
    p.write_text(json.dumps(doc))
    out = V.render_adaptation(p, tmp_path / "figs", ["png"])
    assert sorted(x.name for x in out) == ["adaptation_chunk_timeline.png", "adaptation_quality_vs_violation.png",
                                           "adaptation_violation_vs_slo.png"]
    assert V.main(["--adaptation", str(tmp_path / "nope.json"), "--out", str(tmp_path / "f2")]) == 2


def test_sim_only_main_states_tuning_split_and_partial_quality(tmp_path):
    # a level table given as a file, quality.json missing level 0: quality is null, said so
    lt = tmp_path / "lt.json"
    lt.write_text(json.dumps({"config": {"level_table": TABLE}}))
    q = tmp_path / "q.json"
    q.write_text(json.dumps({"rows": [{"codec": "cachegen", "level": 1, "kl": 0.04}]}))
    out = tmp_path / "a.json"
    rc = B.main(["--no-real", "--level-table", str(lt), "--quality", str(q), "--out", str(out), "--slo-s", "1",
                 "--synthetic", "2", "--quick", "--prefill-tps", "1000", "--inject-s-per-token", "0",
                 "--results", str(tmp_path / "none.json")])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["quality_kl_per_level"] is None and "lacks levels [0]" in doc["config"]["quality"]
    t = doc["config"]["tuning"]
    assert t["evaluation_trace_set"] == "artifact" and "artifact" not in t["tuning_trace_sets"]
    assert doc["config"]["policy"]["slo_reserve_s"] == B.SLO_RESERVE_S
    assert len(doc["config"]["trace_sets"]["synthetic"]) == 2
    assert {r["trace_set"] for r in doc["rows"]} >= {"artifact", "synthetic", "generated"}


def test_aggregate_met_quality_and_intervals():
    reqs = [{"link": "simulated", "policy": "p", "trace_set": "a", "slo_s": 1.0, "overshoot_s": o,
             "violated": o > 0, "quality_kl": q, "regret_vs_oracle": None}
            for o, q in [(0.0, 0.01), (0.5, 0.07), (0.0, 0.03), (0.2, 0.07)]]
    (row,) = B.aggregate(reqs)
    assert row["n_met"] == 2 and row["quality_kl_met"] == pytest.approx(0.02)
    assert row["quality_kl"] == pytest.approx(0.045)
    # 1.96 * stdev([0.01, 0.03]) / sqrt(2) = 1.96 * 0.014142 / 1.4142 = 0.0196
    assert row["quality_kl_met_ci95"] == pytest.approx(0.0196, abs=1e-6)
    lo, hi = row["violation_rate_ci95"]  # Wilson 95% of 2/4: 0.150 .. 0.850
    assert lo == pytest.approx(0.1500, abs=1e-3) and hi == pytest.approx(0.8500, abs=1e-3)
    assert adapt_stats._wilson95(0, 10) == [0.0, pytest.approx(0.2775, abs=1e-4)]


def _row(policy, viol, kl_met, kl_all=None, slo=1.0):
    return {"link": "simulated", "trace_set": "artifact", "slo_s": slo, "policy": policy, "n": 10,
            "violation_rate": viol, "quality_kl_met": kl_met, "quality_kl": kl_all if kl_all is not None else kl_met}


def test_goals_compare_with_fixed_levels_at_no_more_violations():
    rows = [_row("adaptive", 0.1, 0.02, 0.03), _row("oracle", 0.0, 0.005),
            _row("fixed-l0", 0.0, 0.07), _row("fixed-l3", 0.1, 0.025), _row("fixed-l5", 0.4, 0.003),
            _row("text", 1.0, None, 0.0)]
    (g,) = B.goals(rows)
    assert g["g1_slo"] is False  # 10% > 0% + 5 points
    # fixed-l5 is better but misses more often: the comparison is fixed-l3 (10%, 0.025)
    assert g["best_fixed"] == "fixed-l3" and g["g2_quality"] is True
    assert g["best_fixed_all"] == "fixed-l3" and g["g2_quality_all_requests"] is False
    rows[2] = _row("fixed-l0", 0.0, 0.01)  # a fixed level better at fewer violations
    (g,) = B.goals(rows)
    assert g["best_fixed"] == "fixed-l0" and g["g2_quality"] is False
