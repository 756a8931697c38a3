"""The figures of the other result files: ``quality_divergence`` from a quality.json
(``python -m bench.quality``) and the adaptation figures from an adaptation.json
(``python -m bench.adapt``). Each reads only its file. Moved from ``visualize_results.py``,
which re-exports these names."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from visualize.data import ResultsError, SkipFigure, _colors, _log_helps, _new_figure, save_figure
from visualize.results_figures import _pareto

# ----------------------------------------------------------------------------- quality.json (bench.quality)
DEFAULT_QUALITY = Path("benchmarks/quality.json")


def fig_quality_divergence(doc: dict):
    """KL(lossless || decoded) and top-1 agreement vs bits per element, from a quality.json
    written by ``python -m bench.quality``: one line per codec family (levels joined), 95%
    bootstrap CI bars over windows, the Pareto front (no other row both smaller and better)
    drawn as a grey step line. Raises SkipFigure when the file has no lossy rows."""
    rows = [r for r in (doc.get("rows") or []) if isinstance(r, dict) and r.get("codec") != "raw"
            and all(k in r for k in ("bits_per_element", "kl", "kl_ci", "top1_agreement", "top1_agreement_ci"))]
    if not rows:
        raise SkipFigure("quality.json has no lossy rows with bits_per_element, kl and top1_agreement")
    families = list(dict.fromkeys(r["codec"] for r in rows))
    colors = _colors(families)
    fig = _new_figure(11.5, 4.6)
    axes = fig.subplots(1, 2, squeeze=False)[0]
    handles = {}
    panels = [("kl", "kl_ci", "KL(lossless || decoded), nats/token", False),
              ("top1_agreement", "top1_agreement_ci", "top-1 agreement with lossless", True)]
    for ax, (key, ci_key, ylabel, hib) in zip(axes, panels, strict=True):
        points = []
        for fam in families:
            fr = sorted((r for r in rows if r["codec"] == fam), key=lambda r: r["bits_per_element"])
            x = np.array([r["bits_per_element"] for r in fr], dtype=float)
            y = np.array([r[key] for r in fr], dtype=float)
            lo = np.array([r[ci_key][0] for r in fr], dtype=float)
            hi = np.array([r[ci_key][1] for r in fr], dtype=float)
            yerr = np.vstack([np.maximum(y - lo, 0), np.maximum(hi - y, 0)])
            h = ax.errorbar(x, y, yerr=yerr, color=colors[fam],
                            marker="o", markersize=4, capsize=3, linewidth=1.2, label=fam)
            handles.setdefault(fam, h)
            for r, xi, yi in zip(fr, x, y, strict=True):
                if r.get("level") is not None:
                    ax.annotate(str(r["level"]), (xi, yi), fontsize=6, xytext=(3, 3), textcoords="offset points")
                if r.get("default"):
                    ax.scatter([xi], [yi], s=120, facecolor="none", edgecolor="black", zorder=4)
            points.extend(zip(x.tolist(), y.tolist()))
        front = _pareto(points, hib)
        if len(front) >= 2:
            fx, fy = zip(*front, strict=True)
            h = ax.step(fx, fy, where="post", color="0.45", linewidth=3, alpha=0.35, zorder=1,
                        label="Pareto front")[0]
            handles.setdefault("Pareto front", h)
        if key == "kl" and _log_helps([p[1] for p in points if p[1] > 0]):
            ax.set_yscale("log")
        ax.set_xlabel("bits per element (KV dtype = 16)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{ylabel.split(',')[0]} ({'higher' if hib else 'lower'} is better)", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    cfg = doc.get("config") or {}
    data = doc.get("data") or {}
    fig.suptitle("Decoded KV vs lossless KV on the same windows (95% bootstrap CIs)\n"
                 f"{cfg.get('n_windows', '?')} windows x ({cfg.get('context_tokens', '?')} + "
                 f"{cfg.get('continuation_tokens', '?')}) tokens of WikiText-2 {data.get('split', '')}; "
                 f"model {(doc.get('model') or {}).get('id', '?')}; circled: default codec/level; "
                 "numbers: levels", fontsize=10)
    fig.legend(list(handles.values()), list(handles.keys()), loc="outside right center", fontsize=8)
    return fig


def render_quality(path: Path, out_dir: Path, formats: Sequence[str], dpi: int = 150) -> list[Path]:
    """Draw ``quality_divergence.<fmt>`` from a quality.json into ``out_dir``. Raises
    ResultsError for an unreadable file, SkipFigure when it holds no lossy rows."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ResultsError(f"cannot read quality results {path}: {exc}") from None
    if not isinstance(doc, dict):
        raise ResultsError(f"{path} is not a quality.json object")
    fig = fig_quality_divergence(doc)
    written = []
    for fmt in formats:
        out = Path(out_dir) / f"quality_divergence.{fmt}"
        save_figure(fig, out, fmt, dpi=dpi)
        written.append(out)
    return written


# ----------------------------------------------------------------------------- adaptation.json
# Figures of `python -m bench.adapt` (benchmarks/adaptation.json, docs/results-schema.md
# "adaptation.json"): self-contained, they read only that file.
DEFAULT_ADAPTATION = Path("benchmarks/adaptation.json")
_ADAPT_ORDER = ["oracle", "adaptive", "text"] + [f"fixed-l{i}" for i in range(10)]


def _adapt_rows(doc: dict, link: str | None = None) -> list[dict]:
    rows = [r for r in doc.get("rows", []) if isinstance(r, dict)]
    if link:
        rows = [r for r in rows if r.get("link") == link]
    if not rows:
        raise SkipFigure(f"adaptation.json has no rows{' for link ' + link if link else ''}")
    return rows


def _adapt_policies(rows: list[dict]) -> list[str]:
    pols = {r["policy"] for r in rows}
    return [p for p in _ADAPT_ORDER if p in pols] + sorted(pols - set(_ADAPT_ORDER))


def fig_adapt_violation_vs_slo(doc: dict, trace_set: str = "artifact"):
    """SLO violation rate (%) vs SLO (s) per policy on one trace set (simulated clock model),
    with the real-link points of the same set as hollow markers."""
    import matplotlib.pyplot as plt

    rows = [r for r in _adapt_rows(doc) if r.get("trace_set") == trace_set]
    if not rows:
        raise SkipFigure(f"no rows for trace set {trace_set!r}")
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for pol in _adapt_policies(rows):
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

    rows = [r for r in _adapt_rows(doc, "simulated") if r.get("trace_set") == trace_set]
    if not rows:
        raise SkipFigure(f"no simulated rows for trace set {trace_set!r}")
    use_kl = all(r.get("quality_kl") is not None for r in rows)
    key, ylab = ("quality_kl", "mean KL per token (lower is better)") if use_kl else \
        ("regret_vs_oracle", "regret vs oracle (ordinal utility per token; KL unavailable)")
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for pol in _adapt_policies(rows):
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


def render_adaptation(path: Path, out_dir: Path, formats: Sequence[str], dpi: int = 150) -> list[Path]:
    """Draw the adaptation figures from an adaptation.json into ``out_dir``. Raises
    ResultsError for an unreadable file; figures without data are skipped (stderr)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ResultsError(f"cannot read adaptation results {path}: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
        raise ResultsError(f"{path} is not an adaptation.json object (no 'rows' list)")
    written = []
    for name, draw in ADAPT_FIGURES.items():
        try:
            fig = draw(doc)
        except SkipFigure as exc:
            print(f"skipped {name}: {exc}", file=sys.stderr)
            continue
        for fmt in formats:
            out = Path(out_dir) / f"{name}.{fmt}"
            save_figure(fig, out, fmt, dpi=dpi)
            written.append(out)
    if not written:
        raise SkipFigure(f"no adaptation figure could be drawn from {path}")
    return written

