"""The console report of ``python -m bench.adapt``: the per (link, trace set, SLO, policy)
table (:func:`print_summary`) and the goals with their paired cluster-bootstrap 95%
intervals (:func:`_print_goal_cis`). Separate from bench/adapt/cli.py because it only formats
rows that the run has already computed and written.
"""
from __future__ import annotations

import json


def print_summary(rows, agree, checks, gl=()) -> None:
    print(f"{'link':>9} {'trace_set':>18} {'SLO':>4} {'policy':>9} {'n':>3} {'viol%':>6} {'ovs_mean':>8} "
          f"{'ovs_p95':>8} {'KL':>8} {'regret':>8}")
    for r in rows:
        q = "-" if r["quality_kl"] is None else f"{r['quality_kl']:.4f}"
        g = "-" if r["regret_vs_oracle"] is None else f"{r['regret_vs_oracle']:.4f}"
        print(f"{r['link']:>9} {r['trace_set']:>18} {r['slo_s']:>4g} {r['policy']:>9} {r['n']:>3} "
              f"{100 * r['violation_rate']:>6.1f} {r['overshoot_s_mean']:>8.3f} {r['overshoot_s_p95']:>8.3f} "
              f"{q:>8} {g:>8}")
    for x in agree:
        print(f"sim vs real {x['trace_set']} SLO {x['slo_s']} (same {x['n']} requests): "
              f"{100 * x['violation_rate_real']:.0f}% real, {100 * x['violation_rate_sim']:.0f}% simulated "
              f"({x['diff_points']} points; {x['same_outcome']}/{x['n']} same outcome; total_s real - sim "
              f"{x['total_s_real_minus_sim_mean']:+.3f} s)")
    if gl:
        print("goals (point estimates; met / MISSED / - where a side was not measured or nothing qualifies): "
              "G1 adaptive violations <= oracle's + 5 points; G2 adaptive KL of met loads <= the best fixed "
              "level's (or text's) at no more violations")
    for x in gl:
        orc = "-" if x["oracle_violation_rate"] is None else f"{100 * x['oracle_violation_rate']:.0f}%"
        kl = x.get("adaptive_quality_kl_met")
        g2 = (f"G2 KL of met loads adaptive {_num(kl)} vs {x['best_fixed']} {_num(x.get('best_fixed_quality_kl_met'))} "
              f"-> {_verdict(x.get('g2_quality'))} (all loads: {_num(x.get('adaptive_quality_kl_all'))} vs "
              f"{x.get('best_fixed_all') or '-'} {_num(x.get('best_fixed_quality_kl_all'))})"
              if x.get("best_fixed") else f"G2 KL of met loads adaptive {_num(kl)}, no fixed level at no more "
              f"violations -> {_verdict(x.get('g2_quality'))}")
        print(f"goals {x['trace_set']} {x['link']} SLO {x['slo_s']:g} ({_requests(x)}): G1 violations adaptive "
              f"{100 * x['adaptive_violation_rate']:.0f}% vs oracle {orc} -> {_verdict(x['g1_slo'])}; {g2}")
    _print_goal_cis(gl)
    if checks:
        print("checks:", json.dumps(checks, default=str))


def _verdict(v) -> str:
    return "-" if v is None else ("met" if v else "MISSED")


def _num(v) -> str:
    return "-" if v is None else f"{v:.4f}"


def _requests(x: dict) -> str:
    nt = x.get("n_traces")
    return f"{x['n']} requests" + ("" if nt is None else f" from {nt} trace{'s' if nt != 1 else ''}")


def _fmt_ci(x: dict, name: str, scale: float, fmt: str) -> str:
    ci = x.get(name + "_ci95")
    if x.get(name) is None or ci is None:
        return "-"
    return f"{scale * x[name]:{fmt}} [{scale * ci[0]:{fmt}}, {scale * ci[1]:{fmt}}]"


def _print_goal_cis(gl, sets=("artifact", "artifact-generator")) -> None:
    """Per SLO, the goals on the recorded artifact traces and on the held-out generator set
    with their cluster-bootstrap 95% intervals (simulated link), so that a miss on 10 traces
    can be read against its uncertainty."""
    sel = [x for x in gl if x["trace_set"] in sets and x["link"] == "simulated" and "n_traces" in x]
    if not sel:
        return
    print("goals with paired cluster-bootstrap 95% intervals (resampling traces; simulated link). G1: adaptive - "
          "oracle violations (points), limit +5; G2: adaptive - best fixed KL of met loads, limit 0; "
          "verdict of the interval: met / missed / inconclusive")
    for slo in sorted({x["slo_s"] for x in sel}):
        for x in sorted((x for x in sel if x["slo_s"] == slo), key=lambda x: sets.index(x["trace_set"])):
            print(f"  SLO {slo:g} s {x['trace_set']:>18} ({_requests(x)}): "
                  f"G1 {_fmt_ci(x, 'violation_diff_vs_oracle', 100, '+.1f')} -> point {_verdict(x.get('g1_slo'))}, "
                  f"interval {x.get('g1_ci')}; G2 vs {x.get('best_fixed') or '-'} "
                  f"{_fmt_ci(x, 'kl_met_diff_vs_best_fixed', 1, '+.4f')} -> point {_verdict(x.get('g2_quality'))}, "
                  f"interval {x.get('g2_ci')} (comparators {x.get('g2_ci_comparators')}); all loads vs "
                  f"{x.get('best_fixed_all')} "
                  f"{_fmt_ci(x, 'kl_all_diff_vs_best_fixed_all', 1, '+.4f')} ({x.get('g2_all_ci')})")

