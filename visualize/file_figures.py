"""The figures of the other result files: ``quality_divergence`` from a quality.json
(``python -m bench.quality``) and the adaptation figures from an adaptation.json
(``python -m bench.adapt``; the figures themselves are in visualize.adapt_figures).
Each reads only its file; ``visualize_results.py`` draws them."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from visualize.adapt_figures import ADAPT_FIGURES
from visualize.data import SkipFigure, label_colors, log_helps, new_figure, save_figure, save_formats
from visualize.loading import read_json_doc
from visualize.results_figures import pareto_front

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
    colors = label_colors(families)
    fig = new_figure(11.5, 4.6)
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
        front = pareto_front(points, hib)
        if len(front) >= 2:
            fx, fy = zip(*front, strict=True)
            h = ax.step(fx, fy, where="post", color="0.45", linewidth=3, alpha=0.35, zorder=1,
                        label="Pareto front")[0]
            handles.setdefault("Pareto front", h)
        if key == "kl" and log_helps([p[1] for p in points if p[1] > 0]):
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
    return save_formats(fig_quality_divergence(read_json_doc(path, "quality")), out_dir,
                        "quality_divergence", formats, dpi)


def render_adaptation(path: Path, out_dir: Path, formats: Sequence[str], dpi: int = 150) -> list[Path]:
    """Draw the adaptation figures from an adaptation.json into ``out_dir``. Raises
    ResultsError for an unreadable file; figures without data are skipped (stderr)."""
    doc = read_json_doc(path, "adaptation", "rows")
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

