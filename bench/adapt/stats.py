"""bench.adapt's per-row aggregation (aggregate), goals and their paired
cluster-bootstrap 95% intervals. Part of bench.adapt, whose
command (bench.adapt.cli) describes what the benchmark runs.
"""

from __future__ import annotations

import math
import statistics



def _ci95(xs: list[float]) -> float | None:
    """Half-width of the normal-approximation 95% CI of the mean (1.96 sd / sqrt(n)); None below n=2."""
    return round(1.96 * statistics.stdev(xs) / math.sqrt(len(xs)), 6) if len(xs) >= 2 else None


def _wilson95(k: int, n: int) -> list[float]:
    """Wilson score 95% interval [lo, hi] of a proportion k/n (Wilson 1927)."""
    z = 1.96
    p = k / n
    c = (p + z * z / (2 * n)) / (1 + z * z / n)
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [round(max(0.0, c - h), 4), round(min(1.0, c + h), 4)]


def aggregate(reqs: list[dict]) -> list[dict]:
    """Rows per (link, policy, trace_set, slo): n, violation_rate (+ Wilson 95% interval),
    overshoot mean/p95 (s, over all requests, 0 when met), quality_kl (mean over all n
    requests), quality_kl_met (mean over the n_met requests that met the SLO: the quality
    delivered on time), each with a 95% CI half-width, regret_vs_oracle (mean per-token
    utility gap: KL points when quality is known), n_traces (distinct recorded traces behind
    the n requests: a trace replayed from several start offsets counts once)."""
    groups: dict[tuple, list[dict]] = {}
    for r in reqs:
        groups.setdefault((r["link"], r["policy"], r["trace_set"], r["slo_s"]), []).append(r)
    rows = []
    for (link, pol, ts, slo), g in sorted(groups.items(), key=lambda x: (x[0][0], x[0][2], x[0][3], x[0][1])):
        ov = sorted(x["overshoot_s"] for x in g)
        q = [x["quality_kl"] for x in g if x["quality_kl"] is not None]
        rg = [x["regret_vs_oracle"] for x in g if x["regret_vs_oracle"] is not None]
        qm = [x["quality_kl"] for x in g if x["quality_kl"] is not None and not x["violated"]]
        nv = sum(x["violated"] for x in g)
        rows.append({
            "policy": pol, "trace_set": ts, "slo_s": slo, "n": len(g), "link": link,
            "n_traces": len({cluster_of(x["trace"]) for x in g if x.get("trace")}) or None,
            "violation_rate": round(nv / len(g), 4), "violation_rate_ci95": _wilson95(nv, len(g)),
            "n_met": len(g) - nv,
            "overshoot_s_mean": round(statistics.fmean(ov), 5),
            "overshoot_s_p95": round(ov[min(len(ov) - 1, math.ceil(0.95 * len(ov)) - 1)], 5),
            "quality_kl": round(statistics.fmean(q), 6) if q else None,
            "quality_kl_ci95": _ci95(q) if q else None,
            "quality_kl_met": round(statistics.fmean(qm), 6) if qm else None,
            "quality_kl_met_ci95": _ci95(qm) if qm else None,
            "regret_vs_oracle": round(statistics.fmean(rg), 6) if rg else None,
            "abandons": sum(x.get("abandons", 0) for x in g),
        })
    return rows


GOAL_SET_ORDER = ("artifact", "artifact-generator", "generated", "synthetic", "constant", "step", "issue-drop")
G1_POINTS = 0.05  # goal 1: adaptive violation rate <= oracle's + 5 points
BOOT_REPS = 2000  # cluster bootstrap replicates of the goals' confidence intervals
BOOT_SEED = 0  # numpy default_rng seed of the cluster bootstrap (fixed: the same draws every run)


def cluster_of(trace: str) -> str:
    """The recorded trace a request replays: "<trace>@<offset>" -> "<trace>" (rotate()); a
    name without "@" is its own trace. The unit the goals' bootstrap resamples."""
    return trace.rsplit("@", 1)[0]


def bootstrap_weights(n_clusters: int, reps: int = BOOT_REPS, seed: int = BOOT_SEED):
    """(reps, n_clusters) int array: row b counts how often each cluster is drawn in bootstrap
    replicate b (n_clusters draws with replacement, numpy default_rng(seed)). Depends only on
    (n_clusters, reps, seed), so every statistic and policy of one trace set uses the same
    draws (paired). Raises ValueError when n_clusters < 1 or reps < 1."""
    import numpy as np

    if n_clusters < 1 or reps < 1:
        raise ValueError("the bootstrap needs at least one cluster and one replicate")
    idx = np.random.default_rng(seed).integers(0, n_clusters, size=(reps, n_clusters))
    w = np.zeros((reps, n_clusters), dtype=np.int64)
    np.add.at(w, (np.repeat(np.arange(reps), n_clusters), idx.ravel()), 1)
    return w


def cluster_bootstrap_diff(reqs_a: list[dict], reqs_b: list[dict], value: str = "violated", met_only: bool = False,
                           reps: int = BOOT_REPS, seed: int = BOOT_SEED) -> dict | None:
    """Paired cluster bootstrap (Efron & Tibshirani 1993, ch. 6; Davison & Hinkley 1997, sec.
    3.8: resample the independent units, keep what is correlated inside them together) of
    mean(value over a's requests) - mean(value over b's requests).

    reqs_a, reqs_b: request dicts (bench.adapt.sim.request_row: "trace", "violated", "quality_kl") of two
    policies on the SAME requests (the same multiset of trace names, else ValueError). A
    cluster is the recorded trace a request replays (cluster_of): its start offsets share
    every rate, so they are resampled together. `value`: "violated" (0/1, the statistic is
    then a violation-rate difference, 0-1) or "quality_kl" (token-weighted KL); `met_only`:
    average over the requests that met the SLO only (per policy, in each replicate).
    Each replicate draws the clusters with replacement (bootstrap_weights: the same draw for
    a and b - paired) and pools their requests (a ratio of sums, so clusters of unequal size
    weigh by their requests). Returns {"diff" (the full-sample difference), "ci95" [lo, hi]
    (percentile interval, 2.5 and 97.5 %), "n" (requests), "n_traces" (clusters), "reps",
    "reps_defined" (replicates where both means exist)}; None when a value is null (quality
    unknown) or either side has no request to average."""
    import numpy as np

    if sorted(r["trace"] for r in reqs_a) != sorted(r["trace"] for r in reqs_b):
        raise ValueError("cluster_bootstrap_diff: the two policies must cover the same requests")
    if not reqs_a:
        return None
    clusters = sorted({cluster_of(r["trace"]) for r in reqs_a})
    pos = {c: i for i, c in enumerate(clusters)}

    def sums(reqs):
        n, tot = np.zeros(len(clusters)), np.zeros(len(clusters))
        for r in reqs:
            if met_only and r["violated"]:
                continue
            v = r.get(value)
            if v is None:
                return None
            n[pos[cluster_of(r["trace"])]] += 1
            tot[pos[cluster_of(r["trace"])]] += float(v)
        return n, tot

    sa, sb = sums(reqs_a), sums(reqs_b)
    if sa is None or sb is None or not sa[0].sum() or not sb[0].sum():
        return None
    diff = sa[1].sum() / sa[0].sum() - sb[1].sum() / sb[0].sum()
    w = bootstrap_weights(len(clusters), reps, seed)
    with np.errstate(invalid="ignore", divide="ignore"):
        d = (w @ sa[1]) / (w @ sa[0]) - (w @ sb[1]) / (w @ sb[0])
    ok = d[np.isfinite(d)]
    nd = 4 if value == "violated" else 6
    lo, hi = (np.percentile(ok, [2.5, 97.5]) if ok.size else (float("nan"), float("nan")))
    return {"diff": round(float(diff), nd), "ci95": [round(float(lo), nd), round(float(hi), nd)],
            "n": len(reqs_a), "n_traces": len(clusters), "reps": reps, "reps_defined": int(ok.size)}


def cluster_bootstrap_goal2(by_policy: dict[str, list[dict]], met_only: bool = True, reps: int = BOOT_REPS,
                            seed: int = BOOT_SEED) -> dict | None:
    """Paired cluster bootstrap of goal 2's statistic as a whole: adaptive mean KL - the lowest
    mean KL among the fixed levels and text whose violation rate <= the adaptive's, the
    comparator chosen again in every replicate (so the interval includes the uncertainty of
    which fixed level qualifies).

    by_policy: policy -> request dicts ("trace", "violated", "quality_kl") on the SAME
    requests; "adaptive" required, candidates are "fixed-*" and "text" (others ignored; a
    candidate whose requests differ raises ValueError). `met_only`: KL averaged over the loads
    that met the SLO (goal 2's figure), else over all loads. Clusters and draws as
    cluster_bootstrap_diff (bootstrap_weights(n_traces, reps, seed)). Returns {"ci95" [lo, hi]
    (percentile, over the replicates where a comparator qualifies and both means exist),
    "n", "n_traces", "reps", "reps_defined", "comparators" {policy: share of the defined
    replicates where it was the best fixed}}; None when quality is unknown or no candidate."""
    import numpy as np

    ra = by_policy.get("adaptive") or []
    cands = sorted(p for p in by_policy if p.startswith("fixed-") or p == "text")
    if not ra or not cands:
        return None
    names = sorted(r["trace"] for r in ra)
    clusters = sorted({cluster_of(r["trace"]) for r in ra})
    pos = {c: i for i, c in enumerate(clusters)}
    w = bootstrap_weights(len(clusters), reps, seed)

    def stats(reqs):  # (violation rate, mean KL) per replicate; None when a KL is unknown
        n, v, m, kl = (np.zeros(len(clusters)) for _ in range(4))
        for r in reqs:
            i = pos[cluster_of(r["trace"])]
            n[i] += 1
            v[i] += bool(r["violated"])
            if met_only and r["violated"]:
                continue
            if r.get("quality_kl") is None:
                return None
            m[i] += 1
            kl[i] += float(r["quality_kl"])
        with np.errstate(invalid="ignore", divide="ignore"):
            return (w @ v) / (w @ n), (w @ kl) / (w @ m)

    sa = stats(ra)
    if sa is None:
        return None
    best = np.full(reps, np.inf)
    who = np.full(reps, -1)
    for j, p in enumerate(cands):
        if sorted(r["trace"] for r in by_policy[p]) != names:
            raise ValueError("cluster_bootstrap_goal2: every policy must cover the same requests")
        sp = stats(by_policy[p])
        if sp is None:
            continue
        ok = (sp[0] <= sa[0] + 1e-9) & np.isfinite(sp[1]) & (sp[1] < best)
        best[ok], who[ok] = sp[1][ok], j
    d = sa[1] - best
    ok = np.isfinite(d)
    if not ok.any():
        return {"ci95": None, "n": len(ra), "n_traces": len(clusters), "reps": reps, "reps_defined": 0,
                "comparators": {}}
    lo, hi = np.percentile(d[ok], [2.5, 97.5])
    share = {cands[j]: round(float(np.mean(who[ok] == j)), 4) for j in sorted(set(who[ok].tolist()))}
    return {"ci95": [round(float(lo), 6), round(float(hi), 6)], "n": len(ra), "n_traces": len(clusters),
            "reps": reps, "reps_defined": int(ok.sum()), "comparators": share}


BOOT_MIN_TRACES = 5  # below this many traces a bootstrap interval is printed but given no verdict


def _ci_verdict(ci: list[float] | None, limit: float, n_traces: int | None = None) -> str | None:
    """Where the goal's limit lies against the 95% interval of (adaptive - reference): "met"
    (the whole interval <= limit), "missed" (the whole interval > limit), else "inconclusive";
    "too few traces" below BOOT_MIN_TRACES (a percentile bootstrap of 2-3 clusters is no
    interval); None without an interval."""
    if ci is None or any(x != x for x in ci):
        return None
    if n_traces is not None and n_traces < BOOT_MIN_TRACES:
        return "too few traces"
    return "met" if ci[1] <= limit + 1e-9 else "missed" if ci[0] > limit + 1e-9 else "inconclusive"


def goals(rows: list[dict], trace_set: str | None = None, reqs: list[dict] | None = None,
          reps: int = BOOT_REPS, seed: int = BOOT_SEED) -> list[dict]:
    """The issue's two policy goals per (trace_set, link, SLO) (`trace_set` None: every set in
    rows, in GOAL_SET_ORDER):
    g1_slo: adaptive violation_rate <= oracle's + 5 points;
    g2_quality: adaptive quality_kl_met <= the lowest quality_kl_met among the fixed levels and
    text whose violation_rate <= the adaptive's ("the best fixed level that meets the SLO at
    the same violation rate"; quality of the loads that met the SLO - a load that misses it
    is counted in violation_rate and overshoot, and the issue asks the policy to minimize its
    overshoot, not its KL). The all-requests figure (quality_kl) is reported beside it.
    With `reqs` (the request dicts the rows aggregate) each entry also carries n_traces (the
    distinct recorded traces behind its n requests) and paired cluster-bootstrap 95% intervals
    (cluster_bootstrap_diff, `reps` replicates, `seed`) of adaptive - oracle violation rate
    (violation_diff_vs_oracle[_ci95], verdict g1_ci against +5 points) and of adaptive - best
    fixed KL (cluster_bootstrap_goal2: the best fixed level at no more violations chosen again
    in each replicate; kl_met_diff_vs_best_fixed[_ci95] -> g2_ci, with g2_ci_comparators the
    share of replicates each fixed level was the comparator; kl_all_diff_vs_best_fixed_all
    [_ci95] -> g2_all_ci; verdict against 0): "met" / "missed" when the whole interval is on
    one side, else "inconclusive" ("too few traces" below BOOT_MIN_TRACES).
    Returns one dict per (trace_set, link, slo_s); null when rows are missing or quality unknown."""
    out = []
    sets = [trace_set] if trace_set is not None else sorted(
        {r["trace_set"] for r in rows}, key=lambda t: (GOAL_SET_ORDER.index(t) if t in GOAL_SET_ORDER
                                                      else len(GOAL_SET_ORDER), t))
    by_key: dict[tuple, list[dict]] = {}
    for r in reqs or ():
        by_key.setdefault((r["trace_set"], r["link"], r["slo_s"], r["policy"]), []).append(r)
    for ts in sets:
        for link, slo in sorted({(r["link"], r["slo_s"]) for r in rows if r["trace_set"] == ts}):
            d = _goal(rows, ts, link, slo)
            if d is None:
                continue
            if reqs is not None:
                _goal_ci(d, by_key, reps, seed)
            out.append(d)
    return out


def _goal(rows: list[dict], trace_set: str, link: str, slo: float) -> dict | None:
    g = {r["policy"]: r for r in rows if r["trace_set"] == trace_set and r["link"] == link and r["slo_s"] == slo}
    a, o = g.get("adaptive"), g.get("oracle")
    if a is None:
        return None
    d = {"trace_set": trace_set, "link": link, "slo_s": slo, "n": a["n"],
         "adaptive_violation_rate": a["violation_rate"],
         "oracle_violation_rate": o["violation_rate"] if o else None,
         "g1_slo": (a["violation_rate"] <= o["violation_rate"] + G1_POINTS + 1e-9) if o else None}
    fx = [r for p, r in g.items() if (p.startswith("fixed-") or p == "text")
          and r["violation_rate"] <= a["violation_rate"] + 1e-9]
    fm = [r for r in fx if r["quality_kl_met"] is not None]
    if fm and a["quality_kl_met"] is not None:
        best = min(fm, key=lambda r: r["quality_kl_met"])
        d.update({"adaptive_quality_kl_met": a["quality_kl_met"], "best_fixed": best["policy"],
                  "best_fixed_violation_rate": best["violation_rate"],
                  "best_fixed_quality_kl_met": best["quality_kl_met"],
                  "g2_quality": a["quality_kl_met"] <= best["quality_kl_met"] + 1e-9})
    else:
        # no fixed level or text at no more violations: goal 2 holds (nothing to match) -
        # unless no fixed row was measured at all (e.g. the real link): then it is unknown
        measured = any(p.startswith("fixed-") or p == "text" for p in g)
        d.update({"adaptive_quality_kl_met": a["quality_kl_met"], "best_fixed": None,
                  "g2_quality": None if a["quality_kl_met"] is None or not measured else True})
    fa = [r for r in fx if r["quality_kl"] is not None]
    if fa and a["quality_kl"] is not None:
        ba = min(fa, key=lambda r: r["quality_kl"])
        d.update({"adaptive_quality_kl_all": a["quality_kl"], "best_fixed_all": ba["policy"],
                  "best_fixed_quality_kl_all": ba["quality_kl"],
                  "g2_quality_all_requests": a["quality_kl"] <= ba["quality_kl"] + 1e-9})
    return d


def _goal_ci(d: dict, by_key: dict, reps: int, seed: int) -> None:
    """Adds n_traces and the cluster-bootstrap intervals to one goals() entry (in place)."""
    key = (d["trace_set"], d["link"], d["slo_s"])
    ra = by_key.get(key + ("adaptive",), [])
    nt = len({cluster_of(r["trace"]) for r in ra}) or None
    d["n_traces"] = nt
    b = None
    if ra and by_key.get(key + ("oracle",)):
        try:
            b = cluster_bootstrap_diff(ra, by_key[key + ("oracle",)], "violated", False, reps, seed)
        except ValueError:  # not the same requests: no paired interval
            b = None
    d["violation_diff_vs_oracle"] = None if b is None else b["diff"]
    d["violation_diff_vs_oracle_ci95"] = None if b is None else b["ci95"]
    d["g1_ci"] = None if b is None else _ci_verdict(b["ci95"], G1_POINTS, nt)
    pols = {p: rs for (ts, ln, sl, p), rs in by_key.items() if (ts, ln, sl) == key}
    for name, best, best_kl, a_kl, met, verdict in (
            ("kl_met_diff_vs_best_fixed", "best_fixed", "best_fixed_quality_kl_met", "adaptive_quality_kl_met",
             True, "g2_ci"),
            ("kl_all_diff_vs_best_fixed_all", "best_fixed_all", "best_fixed_quality_kl_all",
             "adaptive_quality_kl_all", False, "g2_all_ci")):
        d[name] = (round(d[a_kl] - d[best_kl], 6) if d.get(best) and d.get(a_kl) is not None
                   and d.get(best_kl) is not None else None)
        try:
            g = cluster_bootstrap_goal2(pols, met, reps, seed) if d[name] is not None else None
        except ValueError:
            g = None
        d[name + "_ci95"] = None if g is None else g["ci95"]
        d[verdict] = None if g is None else _ci_verdict(g["ci95"], 0.0, nt)
        if met:
            d["g2_ci_comparators"] = None if g is None else g["comparators"]
