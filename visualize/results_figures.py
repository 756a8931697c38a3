"""The figures drawn from a results.json (:data:`FIGURES`): TTFT vs bandwidth, KV size,
quality vs size, TTFT breakdown, per-layer reconstruction error, adaptation timeline.
Each ``fig_*`` takes a :class:`visualize.data.ResultsData` and returns a matplotlib Figure,
or raises :class:`visualize.data.SkipFigure`. ``visualize_results.py`` draws them."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from visualize.data import (BREAKDOWN_PARTS, MB, ResultsData, SkipFigure, bandwidth_ticks, add_caption, label_colors,
                            log_helps, mode_marker, new_figure, plain_log_ticks, require_columns, label_order)

# ----------------------------------------------------------------------------- figures


def fig_ttft_vs_bandwidth(data: ResultsData):
    """TTFT (median, p25-p75 bars) vs link bandwidth, one line per mode/level. Reads summaries."""
    s = data.summaries
    require_columns(s, "summaries", ["mode", "bandwidth_mbps", "ttft_s_median"])
    s = s.dropna(subset=["bandwidth_mbps", "ttft_s_median"])
    s = s[s["bandwidth_mbps"] > 0]
    if s.empty:
        raise SkipFigure("no summary row has both bandwidth_mbps > 0 and ttft_s_median")
    labels = label_order(s["label"], s)
    colors = label_colors(labels)
    fig = new_figure(7.5, 4.8)
    ax = fig.add_subplot()
    for lab in labels:
        rows = s[s["label"] == lab].sort_values("bandwidth_mbps")
        x, y = rows["bandwidth_mbps"].to_numpy(), rows["ttft_s_median"].to_numpy()
        yerr = None
        if {"ttft_s_p25", "ttft_s_p75"} <= set(rows.columns):
            lo = np.clip(y - rows["ttft_s_p25"].to_numpy(), 0, None)
            hi = np.clip(rows["ttft_s_p75"].to_numpy() - y, 0, None)
            yerr = np.nan_to_num(np.vstack([lo, hi]))
        ax.errorbar(x, y, yerr=yerr, label=lab, color=colors[lab], marker=mode_marker(s, lab),
                    linestyle="--" if lab == "text" else "-", capsize=3, linewidth=1.5, markersize=6)
    ax.set_xscale("log")
    bandwidth_ticks(ax, s["bandwidth_mbps"])
    if log_helps(s["ttft_s_median"]):
        ax.set_yscale("log")
        plain_log_ticks(ax.yaxis)
    ax.set_xlabel("link bandwidth (Mbit/s, log scale)")
    ax.set_ylabel("TTFT (s" + (", log scale)" if ax.get_yscale() == "log" else ")"))
    ax.set_title("Time to first token vs link bandwidth")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(title="mode", fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    n = s["n"].dropna() if "n" in s.columns else pd.Series(dtype=float)
    note = "points: median TTFT"
    if not n.empty:
        lo, hi = int(n.min()), int(n.max())
        note += f" over {lo} requests" if lo == hi else f" over {lo}-{hi} requests"
    add_caption(fig, data, note + "; bars: p25-p75")
    return fig


def _per_label(s: pd.DataFrame, col: str) -> pd.DataFrame:
    """Median of ``col`` per label over bandwidths, with the per-bandwidth values kept."""
    rows = s.dropna(subset=[col])
    agg = rows.groupby("label", sort=False)[col].agg(["median", "min", "max"])
    return agg


def fig_kv_size(data: ResultsData):
    """KV bytes sent (MB, log) and compression ratio vs the model's dtype, per mode/level."""
    s = data.summaries
    if s.empty:
        raise SkipFigure("no 'summaries' records")
    has_bytes = "bytes_median" in s.columns and s["bytes_median"].notna().any()
    has_ratio = "ratio_vs_dtype" in s.columns and s["ratio_vs_dtype"].notna().any()
    if "mode" not in s.columns or not (has_bytes or has_ratio):
        raise SkipFigure("'summaries' lack bytes_median and ratio_vs_dtype")
    panels = [(c, t) for c, t, ok in [("bytes_median", "bytes", has_bytes), ("ratio_vs_dtype", "ratio", has_ratio)] if ok]
    fig = new_figure(5.0 * len(panels) + 1.0, 4.6)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    all_labels = label_order(s["label"], s)
    colors = label_colors(all_labels)
    varying = []
    for ax, (col, kind) in zip(axes, panels, strict=True):
        agg = _per_label(s, col)
        labels = [lab for lab in all_labels if lab in agg.index]
        vals = agg.loc[labels, "median"].to_numpy(dtype=float)
        scale = MB if kind == "bytes" else 1.0
        x = np.arange(len(labels))
        bars = ax.bar(x, vals / scale, color=[colors[lab] for lab in labels])
        for i, lab in enumerate(labels):  # whiskers where the value depends on bandwidth (adaptive)
            lo, hi = agg.loc[lab, "min"], agg.loc[lab, "max"]
            if hi > lo * 1.001:
                ax.vlines(i, lo / scale, hi / scale, color="black", linewidth=1.2)
                if lab not in varying:
                    varying.append(lab)
        fmt = "{:.3g}" if kind == "bytes" else "{:.2f}x"
        ax.bar_label(bars, labels=[fmt.format(v / scale) for v in vals], fontsize=7, padding=2)
        ax.set_xticks(x, labels, rotation=40, ha="right", fontsize=8)
        if kind == "bytes":
            if log_helps(vals):
                ax.set_yscale("log")
                plain_log_ticks(ax.yaxis)
            ax.set_ylabel("KV bytes per context (MB = 10^6 B" + (", log)" if ax.get_yscale() == "log" else ")"))
            ax.set_title("Size sent per context")
        else:
            ax.axhline(1.0, color="0.5", linewidth=0.8, linestyle=":")
            ax.set_ylabel(f"compression ratio vs {data.kv_dtype} KV (x)")
            ax.set_title(f"Compression ratio vs {data.kv_dtype}")
        ax.grid(True, axis="y", alpha=0.3)
        ax.margins(y=0.12)
    fig.suptitle("KV cache size and compression ratio per mode")
    note = "bars: median over bandwidths and requests"
    if varying:
        note += f"; black whiskers: min-max over bandwidths ({', '.join(varying)})"
    if "text" in s["label"].values:
        note += "; text = prompt bytes (no KV sent)"
    add_caption(fig, data, note)
    return fig


QUALITY_PANELS = [("ppl_increase_pct", "perplexity increase vs lossless (%)"),
                  ("accuracy", "task accuracy (share correct)"),
                  ("rouge_l", "ROUGE-L F vs lossless generation")]


def pareto_front(points: list[tuple[float, float]], higher_is_better: bool) -> list[tuple[float, float]]:
    """Non-dominated points (smaller size, better quality), sorted by size."""
    front, best = [], -math.inf
    for size, q in sorted(points, key=lambda p: (p[0], -p[1] if higher_is_better else p[1])):
        score = q if higher_is_better else -q
        if score > best:
            front.append((size, q))
            best = score
    return front


QUALITY_JSON_KL_PANEL = ("quality_json_kl", "KL(lossless || decoded), nats/token (quality.json)")


def _quality_json_kl(data: ResultsData) -> dict[tuple, tuple[float, float, float, Any]]:
    """{(codec, level): (kl, ci_lo, ci_hi, n_windows)} of ``data.quality``'s rows that have a
    numeric KL and a 2-number CI; empty when no quality.json was given."""
    q = data.quality if isinstance(data.quality, dict) else {}
    out = {}
    for r in q.get("rows") or []:
        if not isinstance(r, dict):
            continue
        kl, ci = r.get("kl"), r.get("kl_ci")
        if (isinstance(kl, (int, float)) and not isinstance(kl, bool) and isinstance(ci, (list, tuple))
                and len(ci) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in ci)):
            level = r.get("level")
            out[(r.get("codec"), int(level) if isinstance(level, (int, float)) else None)] = (
                float(kl), float(ci[0]), float(ci[1]), r.get("n_windows"))
    return out


def _accuracy_ci(rows: pd.DataFrame) -> tuple[float, float] | None:
    """Wilson 95% CI of the pooled accuracy of ``rows`` (k = round(accuracy * n)); None
    without ``n``."""
    if "n" not in rows or "accuracy" not in rows:
        return None
    ns, accs = rows["n"].to_numpy(dtype=float), rows["accuracy"].to_numpy(dtype=float)
    if (not len(ns) or not np.all(np.isfinite(ns)) or np.any(ns < 1) or np.any(ns > 1e9)
            or np.any(ns != np.round(ns)) or not np.all((accs >= 0) & (accs <= 1))):
        return None  # odd values: no bar rather than a wrong one
    from evaluation.stats import wilson_ci  # numpy only

    n = int(ns.sum())
    k = int(sum(round(a * m) for a, m in zip(accs, ns, strict=True)))
    return wilson_ci(k, n)


def fig_quality_vs_size(data: ResultsData):
    """Quality (ppl increase, accuracy, ROUGE-L) vs KV size per mode/level, with the Pareto front.

    When ``data.quality`` (a quality.json of ``python -m bench.quality`` beside the results
    file) has KL rows, the perplexity panel is replaced by that file's KL(lossless ||
    decoded) of the same codec/level with its 95% bootstrap CI as error bars (n windows of
    WikiText-2 test), and the title says so; accuracy points carry Wilson 95% CI bars
    (k/n pooled over the point's requests)."""
    s = data.summaries
    require_columns(s, "summaries", ["mode", "bytes_median"])
    qkl = _quality_json_kl(data)
    panels = QUALITY_PANELS if not qkl else [QUALITY_JSON_KL_PANEL] + [
        (m, t) for m, t in QUALITY_PANELS if m not in ("ppl_increase_pct", "kl")]
    metrics = [(m, t) for m, t in panels if m == QUALITY_JSON_KL_PANEL[0] or (m in s.columns and s[m].notna().any())]
    if not metrics:
        raise SkipFigure("'summaries' lack ppl_increase_pct, accuracy and rouge_l")
    kv = s[(s["mode"] != "text") & s["bytes_median"].notna() & (s["bytes_median"] > 0)]
    if kv.empty:
        raise SkipFigure("no KV mode (other than text) has bytes_median")
    labels = label_order(kv["label"], kv)
    colors = label_colors(label_order(s["label"], s))
    fig = new_figure(4.4 * len(metrics) + 1.6, 4.4)
    axes = fig.subplots(1, len(metrics), squeeze=False)[0]
    text_rows = s[s["mode"] == "text"]
    handles = {}
    for ax, (metric, ylabel) in zip(axes, metrics, strict=True):
        if metric == QUALITY_JSON_KL_PANEL[0]:
            _quality_json_kl_panel(ax, kv, labels, colors, qkl, handles)
            continue
        hib = data.higher_is_better(metric)
        points = []
        for lab in labels:
            rows = kv[(kv["label"] == lab)].dropna(subset=[metric])
            if rows.empty:
                continue
            # one point per label when size and quality do not depend on bandwidth, else one per bandwidth
            if rows["bytes_median"].max() <= rows["bytes_median"].min() * 1.001 or "bandwidth_mbps" not in rows:
                pts = [(rows["bytes_median"].median(), rows[metric].median(), None)]
            else:
                pts = [(r.bytes_median, getattr(r, metric), r.bandwidth_mbps) for r in rows.itertuples()]
            for size, q, bw in pts:
                if metric == "accuracy":  # Wilson 95% CI of the point's requests (k/n)
                    ci = _accuracy_ci(rows if bw is None else rows[rows["bandwidth_mbps"] == bw])
                    if ci is not None and np.isfinite(size) and np.isfinite(q):
                        ax.errorbar([size / MB], [q], yerr=[[max(q - ci[0], 0)], [max(ci[1] - q, 0)]],
                                    color=colors[lab], capsize=3, linewidth=1, zorder=2)
                h = ax.scatter(size / MB, q, color=colors[lab], marker=mode_marker(kv, lab), s=55,
                               edgecolor="black", linewidth=0.5, zorder=3, label=lab)
                handles.setdefault(lab, h)
                if bw is not None and np.isfinite(bw):
                    ax.annotate(f"{bw:g} Mbit/s", (size / MB, q), fontsize=6, xytext=(4, 3),
                                textcoords="offset points")
                points.append((size / MB, q))
        _pareto_step(ax, points, hib, handles)
        if not text_rows.empty and metric in text_rows and text_rows[metric].notna().any():
            h = ax.axhline(text_rows[metric].median(), color="0.2", linestyle="--", linewidth=1,
                           label="text (recompute)")
            handles.setdefault("text (recompute)", h)
        _size_axes(ax, ylabel, f"{metric} ({'higher' if hib else 'lower'} is better)")
    if qkl:
        qcfg = data.quality.get("config") if isinstance(data.quality.get("config"), dict) else {}
        fig.suptitle("Quality vs size trade-off per mode and level; KL from quality.json "
                     f"({qcfg.get('n_windows', '?')} WikiText-2 test windows, 95% bootstrap CI), "
                     "accuracy from this run (Wilson 95% CI)")
    else:
        fig.suptitle("Quality vs size trade-off per mode and level"
                     + (f" (ppl change over n={data.doc['config']['ppl_contexts']} contexts)"
                        if isinstance(data.doc.get("config"), dict) and data.doc["config"].get("ppl_contexts")
                        else ""))
    fig.legend(list(handles.values()), list(handles.keys()), loc="outside right center", fontsize=8)
    add_caption(fig, data, "points: medians over requests; Pareto front: no other point is both smaller "
                        "and better" + ("; accuracy bars: Wilson 95% CI of k/n" if "n" in s.columns else "")
                + ("; KL bars: 95% bootstrap CI over quality.json's windows" if qkl else ""))
    return fig


def _quality_json_kl_panel(ax, kv: pd.DataFrame, labels, colors, qkl: dict, handles: dict) -> None:
    """The KL panel of fig_quality_vs_size: x = this run's KV bytes of a mode/level, y =
    quality.json's KL of the same codec/level with its CI bars; the Pareto front (lower KL)."""
    points = []
    for lab in labels:
        rows = kv[kv["label"] == lab]
        mode = rows["mode"].iloc[0]
        level = rows["level"].iloc[0] if "level" in rows else None
        key = (mode, None if level is None or pd.isna(level) else int(level))
        if key not in qkl:
            continue
        kl, lo, hi, _n = qkl[key]
        size = rows["bytes_median"].median() / MB
        h = ax.errorbar([size], [kl], yerr=[[max(kl - lo, 0)], [max(hi - kl, 0)]], color=colors[lab],
                        marker=mode_marker(kv, lab), markersize=7, markeredgecolor="black", markeredgewidth=0.5,
                        capsize=3, linewidth=1, zorder=3, label=lab)
        handles.setdefault(lab, h)
        points.append((size, kl))
    if not points:
        ax.text(0.5, 0.5, "no mode of this run has a KL row in quality.json", ha="center", va="center",
                transform=ax.transAxes, fontsize=8)
    _pareto_step(ax, points, False, handles)
    _size_axes(ax, QUALITY_JSON_KL_PANEL[1], "KL from quality.json, 95% CI (lower is better)")


def _pareto_step(ax, points: list[tuple[float, float]], higher_is_better: bool, handles: dict) -> None:
    """Draw the Pareto front of ``points`` ((MB, quality) pairs) as a step line on ``ax``
    when it has at least two points; its handle joins ``handles`` under "Pareto front"."""
    front = pareto_front(points, higher_is_better)
    if len(front) >= 2:
        fx, fy = zip(*front, strict=True)
        h = ax.step(fx, fy, where="post", color="0.4", linewidth=1, linestyle="-", zorder=2,
                    label="Pareto front")[0]
        handles.setdefault("Pareto front", h)


def _size_axes(ax, ylabel: str, title: str) -> None:
    """The axes of a quality-vs-size panel: log x in MB of KV per context, grid."""
    ax.set_xscale("log")
    plain_log_ticks(ax.xaxis)
    ax.set_xlabel("KV bytes per context (MB, log scale)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)


def fig_ttft_breakdown(data: ResultsData):
    """Stacked TTFT components per mode/level, one panel per bandwidth; black marks = measured TTFT."""
    s = data.summaries
    require_columns(s, "summaries", ["mode"])
    parts = [(c, n) for c, n in BREAKDOWN_PARTS if c in s.columns and s[c].notna().any()]
    if not parts:
        raise SkipFigure("'summaries' lack transfer_s_median, decode_s_median, inject_s_median and prefill_s_median")
    if "bandwidth_mbps" in s.columns and s["bandwidth_mbps"].notna().any():
        bws = sorted(s["bandwidth_mbps"].dropna().unique())
    else:
        bws = [None]
    fig = new_figure(min(4.2 * len(bws), 16) + 1.2, 4.8)
    axes = fig.subplots(1, len(bws), squeeze=False)[0]
    from matplotlib import colormaps

    part_colors = colormaps["Set2"]
    for ax, bw in zip(axes, bws, strict=True):
        rows = s if bw is None else s[s["bandwidth_mbps"] == bw]
        labels = label_order(rows["label"], rows)
        rows = rows.drop_duplicates("label").set_index("label").loc[labels]
        x = np.arange(len(labels))
        bottom = np.zeros(len(labels))
        for i, (col, name) in enumerate(parts):
            vals = np.nan_to_num(rows[col].to_numpy(dtype=float))
            ax.bar(x, vals, bottom=bottom, color=part_colors(i), label=name, width=0.7)
            bottom += vals
        if "ttft_s_median" in rows.columns:
            ax.scatter(x, rows["ttft_s_median"], marker="_", s=300, color="black", linewidth=2,
                       zorder=3, label="measured TTFT (median)")
        ax.set_xticks(x, labels, rotation=40, ha="right", fontsize=8)
        ax.set_ylabel("time (s)")
        ax.set_title("all rows" if bw is None else f"{bw:g} Mbit/s", fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside right center", fontsize=8)
    fig.suptitle("TTFT breakdown per mode (medians)")
    add_caption(fig, data, "stacked: median of each component; when decoding overlaps transfer (pipelined), "
                        "the stack can exceed the measured TTFT")
    return fig


def fig_reconstruction_error(data: ResultsData):
    """Relative L2 error of the decoded KV per layer, keys and values, per mode/level. Reads codec_layers."""
    c = data.codec_layers
    require_columns(c, "codec_layers", ["mode", "layer", "rel_l2"])
    c = c.dropna(subset=["layer", "rel_l2"])
    kvs = sorted(c["kv"].dropna().astype(str).unique()) if "kv" in c.columns else []
    panels = kvs if kvs else [None]
    labels = label_order(c["label"], c)
    colors = label_colors(labels)
    lossless = [lab for lab in labels if (c.loc[c["label"] == lab, "rel_l2"] == 0).all()]
    drawn = c[~c["label"].isin(lossless)]
    if drawn.empty:
        raise SkipFigure("every codec in 'codec_layers' has zero error (nothing to plot)")
    log = (drawn["rel_l2"] > 0).all() and log_helps(drawn["rel_l2"])
    fig = new_figure(5.0 * len(panels) + 1.6, 4.4)
    axes = fig.subplots(1, len(panels), squeeze=False, sharey=True)[0]
    names = {"k": "keys", "v": "values"}
    for ax, kv in zip(axes, panels, strict=True):
        rows = drawn if kv is None else drawn[drawn["kv"].astype(str) == kv]
        for lab in labels:
            r = rows[rows["label"] == lab].sort_values("layer")
            if r.empty:
                continue
            ax.plot(r["layer"], r["rel_l2"], label=lab, color=colors[lab], marker=mode_marker(c, lab),
                    markersize=3, linewidth=1.3)
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_title(names.get(kv, str(kv)) if kv is not None else "K and V", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("relative L2 error ||x' - x|| / ||x||" + (" (log)" if log else ""))
    handles, lnames = axes[0].get_legend_handles_labels()
    fig.legend(handles, lnames, loc="outside right center", fontsize=8)
    fig.suptitle("Reconstruction error per layer")
    note = "error of the decoded KV against the original, per layer"
    if lossless:
        note += f"; lossless (error 0, not drawn): {', '.join(lossless)}"
    add_caption(fig, data, note)
    return fig


def fig_adaptation_timeline(data: ResultsData):
    """Per chunk: link bandwidth and estimate, level chosen (text fallback), elapsed time vs SLO."""
    a = data.adaptation
    require_columns(a, "adaptation", ["chunk"])
    a = a.dropna(subset=["chunk"])
    rows_avail = [(col, ok) for col, ok in [
        ("bandwidth", any(c in a.columns and a[c].notna().any() for c in ("bandwidth_mbps", "throughput_mbps_est"))),
        ("level", ("level" in a.columns and a["level"].notna().any()) or "text_fallback" in a.columns),
        ("elapsed", "elapsed_s" in a.columns and a["elapsed_s"].notna().any()),
    ] if ok]
    if not rows_avail:
        raise SkipFigure("'adaptation' records lack bandwidth_mbps, level and elapsed_s")
    if "trace" not in a.columns:
        a = a.assign(trace="trace")
    a = a.assign(trace=a["trace"].fillna("trace").astype(str))
    traces = list(dict.fromkeys(a["trace"]))[:4]
    fig = new_figure(4.8 * len(traces) + 1.8, 2.2 * len(rows_avail) + 1.2)
    axes = fig.subplots(len(rows_avail), len(traces), squeeze=False, sharex="col")
    for j, trace in enumerate(traces):
        t = a[a["trace"] == trace]
        ctx = None
        if "context_id" in t.columns and t["context_id"].notna().any():
            ctx = t["context_id"].dropna().iloc[0]
            t = t[t["context_id"] == ctx]
        t = t.sort_values("chunk")
        x = t["chunk"].to_numpy()
        for i, (kind, _) in enumerate(rows_avail):
            ax = axes[i][j]
            if kind == "bandwidth":
                if "bandwidth_mbps" in t.columns:
                    ax.step(x, t["bandwidth_mbps"], where="mid", color="tab:blue", label="link bandwidth")
                if "throughput_mbps_est" in t.columns:
                    ax.plot(x, t["throughput_mbps_est"], "o--", color="tab:orange", markersize=4,
                            label="throughput estimate")
                ax.set_ylabel("Mbit/s")
                ax.set_ylim(bottom=0)
                ax.set_title(f"trace: {trace}" + (f"  (context {ctx})" if ctx else ""), fontsize=10)
            elif kind == "level":
                level = t["level"] if "level" in t.columns else pd.Series(np.nan, index=t.index)
                fallback = (t["text_fallback"].fillna(False).astype(bool) if "text_fallback" in t.columns
                            else level.isna())
                y = np.where(fallback, 0, level)
                ax.step(x, y, where="mid", color="tab:green", alpha=0.5)
                ax.scatter(x[~fallback.to_numpy()], y[~fallback.to_numpy()], color="tab:green", zorder=3,
                           label="level sent")
                if fallback.any():
                    ax.scatter(x[fallback.to_numpy()], y[fallback.to_numpy()], color="tab:red", marker="x",
                               s=50, zorder=3, label="text fallback")
                top = int(np.nanmax(np.append(level.to_numpy(dtype=float), 1)))
                ax.set_yticks(range(0, top + 1), ["text"] + [str(k) for k in range(1, top + 1)])
                ax.set_ylim(-0.5, top + 0.5)
                ax.set_ylabel("level chosen")
            else:
                ax.plot(x, t["elapsed_s"], "o-", color="tab:purple", markersize=4, label="elapsed (cumulative)")
                if "slo_s" in t.columns and t["slo_s"].notna().any():
                    ax.axhline(t["slo_s"].dropna().iloc[0], color="tab:red", linestyle="--", label="SLO")
                ax.set_ylabel("time (s)")
                ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
        axes[-1][j].set_xlabel("chunk index")
    for row in axes:  # one legend per row, with the entries of all its panels
        entries: dict[str, Any] = {}
        for ax in row:
            for handle, name in zip(*ax.get_legend_handles_labels(), strict=True):
                entries.setdefault(name, handle)
        if entries:
            row[-1].legend(list(entries.values()), list(entries.keys()), fontsize=7, loc="best")
    fig.suptitle("Adaptation timeline per chunk")
    add_caption(fig, data, "one context per trace; level 'text' = the chunk was sent as text and recomputed")
    return fig


@dataclass(frozen=True)
class FigureSpec:
    """A figure: its output file stem, the results.json fields it reads, and its drawer."""

    name: str
    reads: str
    draw: Callable[[ResultsData], Any]


FIGURES: dict[str, FigureSpec] = {spec.name: spec for spec in [
    FigureSpec("ttft_vs_bandwidth", "summaries: mode, level, bandwidth_mbps, ttft_s_median, ttft_s_p25, ttft_s_p75, n",
               fig_ttft_vs_bandwidth),
    FigureSpec("kv_size", "summaries: mode, level, bytes_median, ratio_vs_dtype; model.dtype", fig_kv_size),
    FigureSpec("quality_vs_size", "summaries: mode, level, bandwidth_mbps, bytes_median, ppl_increase_pct, "
               "accuracy, rouge_l; higher_is_better (optional)", fig_quality_vs_size),
    FigureSpec("ttft_breakdown", "summaries: mode, level, bandwidth_mbps, lookup_s_median, transfer_s_median, "
               "decode_s_median, inject_s_median, prefill_s_median, ttft_s_median", fig_ttft_breakdown),
    FigureSpec("reconstruction_error", "codec_layers: mode, level, layer, kv, rel_l2", fig_reconstruction_error),
    FigureSpec("adaptation_timeline", "adaptation: trace, context_id, chunk, bandwidth_mbps, throughput_mbps_est, "
               "level, text_fallback, elapsed_s, slo_s", fig_adaptation_timeline),
]}

