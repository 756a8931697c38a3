"""The figures of ``python -m bench.adapt`` (benchmarks/adaptation.json, docs/results-schema.md
"adaptation.json"): SLO violations vs SLO per policy, quality vs violations, and one
request's per-chunk timeline. Self-contained: they read only that file's ``rows`` and
``timelines`` (visualize.file_figures.render_adaptation reads the file and writes them).
Separate from file_figures.py because these three figures share their own row selection
and policy order, nothing of the quality figure."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from visualize.data import SkipFigure

DEFAULT_ADAPTATION = Path("benchmarks/adaptation.json")
ADAPT_ORDER = ["oracle", "adaptive", "text"] + [f"fixed-l{i}" for i in range(10)]


def adapt_rows(doc: dict, link: str | None = None) -> list[dict]:
    rows = [r for r in doc.get("rows", []) if isinstance(r, dict)]
    if link:
        rows = [r for r in rows if r.get("link") == link]
    if not rows:
        raise SkipFigure(f"adaptation.json has no rows{' for link ' + link if link else ''}")
    return rows


def adapt_policies(rows: list[dict]) -> list[str]:
    pols = {r["policy"] for r in rows}
    return [p for p in ADAPT_ORDER if p in pols] + sorted(pols - set(ADAPT_ORDER))


def fig_adapt_violation_vs_slo(doc: dict, trace_set: str = "artifact"):
    """SLO violation rate (%) vs SLO (s) per policy on one trace set (simulated clock model),
    with the real-link points of the same set as hollow markers."""
    import matplotlib.pyplot as plt

    rows = [r for r in adapt_rows(doc) if r.get("trace_set") == trace_set]
    if not rows:
        raise SkipFigure(f"no rows for trace set {trace_set!r}")
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for pol in adapt_policies(rows):
        pts = sorted((r["slo_s"], 100 * r["violation_rate"]) for r in rows
                     if r["policy"] == pol and r.get("link") == "simulated")
        if pts:
            style = dict(lw=2.5, color="black") if pol == "oracle" else dict(lw=2.0, color="tab:red") \
                if pol == "adaptive" else dict(lw=1.0, alpha=0.7)
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=pol, **style)
        real = [(r["slo_s"], 100 * r["violation_rate"], r["n"]) for r in rows
                if r["policy"] == pol and r.get("link") == "real"]
        for x, y, n in real:
            ax.plot([x], [y], marker="s", mfc="none", mec="tab:red", ms=11, ls="none",
                    label=f"{pol} (real link, n={n})")
    ax.set_xscale("log", base=2)
    slos = sorted({r["slo_s"] for r in rows})
    ax.set_xticks(slos, [f"{x:g}" for x in slos])
    ax.set_xlabel("SLO for loading the context (s)")
    ax.set_ylabel("SLO violation rate (%)")
    ns = sorted({r["n"] for r in rows if r.get("link") == "simulated"})
    ax.set_title(f"Violations vs SLO, trace set '{trace_set}' (simulated, n={ns} per point)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return fig


def fig_adapt_quality_vs_violation(doc: dict, trace_set: str = "artifact"):
    """Quality (mean KL, lower is better; or utility regret vs the oracle when KL is not
    available) vs violation rate, one point per policy and SLO; the oracle's points joined."""
    import matplotlib.pyplot as plt

    rows = [r for r in adapt_rows(doc, "simulated") if r.get("trace_set") == trace_set]
    if not rows:
        raise SkipFigure(f"no simulated rows for trace set {trace_set!r}")
    use_kl = all(r.get("quality_kl") is not None for r in rows)
    key, ylab = ("quality_kl", "mean KL per token (lower is better)") if use_kl else \
        ("regret_vs_oracle", "regret vs oracle (ordinal utility per token; KL unavailable)")
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for pol in adapt_policies(rows):
        pts = sorted((100 * r["violation_rate"], r[key], r["slo_s"]) for r in rows
                     if r["policy"] == pol and r.get(key) is not None)
        if not pts:
            continue
        if pol == "oracle":
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "k-o", lw=2, label="oracle (front)")
        else:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], label=pol, s=40 if pol == "adaptive" else 18,
                       color="tab:red" if pol == "adaptive" else None, zorder=3)
        if pol in ("oracle", "adaptive"):
            for x, y, slo in pts:
                ax.annotate(f"{slo:g}s", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("SLO violation rate (%)")
    ax.set_ylabel(ylab)
    ax.set_title(f"Quality vs violations, trace set '{trace_set}' (each point: a policy at one SLO)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return fig


def fig_adapt_timeline(doc: dict):
    """Per-chunk timeline of one load (the first real-link artifact trace, else the first
    timeline): bandwidth and estimate (Mbit/s), level chosen (or text), budget vs actual
    wire seconds, abandoned attempts."""
    import matplotlib.pyplot as plt

    tls = [t for t in doc.get("timelines", []) if isinstance(t, dict) and t.get("chunks")]
    if not tls:
        raise SkipFigure("adaptation.json has no timelines")
    pick = next((t for t in tls if t.get("link") == "real" and t.get("trace_set") == "artifact"), tls[0])
    ch = [c for c in pick["chunks"] if not c.get("abandoned")]
    k = [c["chunk"] for c in ch]
    fig, (a1, a2, a3) = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    a1.step(k, [c["bandwidth_mbps"] for c in ch], where="mid", label="shaped rate (trace)")
    a1.plot(k, [c.get("est_mbps") if c.get("est_mbps") is not None else np.nan for c in ch], "o--",
            label="policy's estimate")
    a1.set_ylabel("Mbit/s")
    a1.set_yscale("log")
    a1.legend(fontsize=7)
    a2.plot(k, [-1 if c["level"] is None else c["level"] for c in ch], "s", ms=8)
    a2.set_yticks(range(-1, 6), ["text"] + [str(i) for i in range(6)])
    a2.set_ylabel("level chosen")
    a3.bar([x - 0.2 for x in k], [c.get("budget_s") or 0 for c in ch], width=0.4, label="budget (deadline) s")
    a3.bar([x + 0.2 for x in k], [c.get("wire_s") or 0 for c in ch], width=0.4, label="actual wire s")
    ab = pick.get("abandoned") or [c for c in pick["chunks"] if c.get("abandoned")]
    for a in ab:
        a3.plot([a["chunk"]], [a.get("wire_s", 0)], "rx", ms=10)
    if ab:
        a3.plot([], [], "rx", label="abandoned attempt")
    a3.set_ylabel("seconds")
    a3.set_xlabel("chunk")
    a3.legend(fontsize=7)
    fig.suptitle(f"Adaptation timeline: {pick.get('trace')} ({pick.get('link')} link, SLO {pick.get('slo_s')} s)")
    return fig


ADAPT_FIGURES = {"adaptation_violation_vs_slo": fig_adapt_violation_vs_slo,
                 "adaptation_quality_vs_violation": fig_adapt_quality_vs_violation,
                 "adaptation_chunk_timeline": fig_adapt_timeline}
