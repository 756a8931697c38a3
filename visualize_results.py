"""Draw the benchmark figures from a results.json (and nothing else).

Purpose: turn the records written by ``run_benchmarks.py`` (docs/results-schema.md) into
the figures of a CacheGen-style evaluation (Liu et al., SIGCOMM 2024, sections 5-7): TTFT vs link bandwidth per mode, KV size and compression
ratio, the quality/size trade-off with its Pareto front, the TTFT breakdown into
lookup/transfer/decode/inject/prefill, the per-layer reconstruction error of the codec
(the paper's layer-wise quantization, section 5.2) and the per-chunk adaptation
timeline (streaming adaptation: bandwidth, level chosen or text fallback, SLO).

It reads only the results file: it imports no codec, streaming, engine or model code
(only ``evaluation.summary``, the summary and label rules run_benchmarks.py writes with).
A file an interrupted run left (``"complete": false``) is drawn with "INCOMPLETE" in
every figure's title. Figures
whose data is missing are skipped and named; a file that is not a JSON object is an error
(one line on stderr, exit status 2). Each figure is written as PNG and SVG, atomically.

Run:
    python visualize_results.py                                    # benchmarks/results.json -> benchmarks/
    python visualize_results.py --results runs/r.json --out figs/ --formats png
    python visualize_results.py --only ttft_vs_bandwidth kv_size

Exit status: 0 when at least one figure was written, 1 when none could be drawn,
2 for a missing, unreadable or malformed results file or bad arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from common import flags  # stdlib only: the shared flag spellings
from common.header import atomic_write  # stdlib only
from evaluation import summary as summary_rules  # stdlib + metric registry: no engine, no torch

KNOWN_SCHEMA_VERSION = 1
DEFAULT_RESULTS = Path("benchmarks/results.json")
DEFAULT_OUT = Path("benchmarks")

# Canonical order of modes in legends and bar charts; unknown modes follow, sorted.
MODE_ORDER = ["text", "raw", "fp8", "quant8", "kivi4", "kivi2", "cachegen", "cachegen-adaptive", "kvtc"]
MODE_MARKERS = {"text": "s", "raw": "D", "fp8": "v", "quant8": "^", "kivi4": "<", "kivi2": ">",
                "cachegen": "o", "cachegen-adaptive": "*", "kvtc": "P"}
# Direction of each quality field when results.json does not carry "higher_is_better".
DEFAULT_HIGHER_IS_BETTER = summary_rules.higher_is_better()
# TTFT components in stacking order: (summary column, legend name).
BREAKDOWN_PARTS = [("lookup_s_median", "lookup"), ("transfer_s_median", "transfer"),
                   ("decode_s_median", "decode"), ("inject_s_median", "inject"),
                   ("prefill_s_median", "prefill")]
NUMERIC_SUMMARY_COLUMNS = [
    "level", "bandwidth_mbps", "n", "ttft_s_median", "ttft_s_p25", "ttft_s_p75", "lookup_s_median",
    "transfer_s_median", "decode_s_median", "inject_s_median", "prefill_s_median", "bytes_median",
    "ratio_vs_dtype", "accuracy", "f1", "rouge_l", "bleu", "greedy_match", "ppl_increase_pct", "kl",
    "slo_violation_rate",
]
MB = 1e6  # figures use MB = 10^6 bytes


class ResultsError(ValueError):
    """The results file is missing, unreadable, not JSON or not a JSON object."""


class SkipFigure(Exception):
    """A figure cannot be drawn from this results file; the message says why."""


# ----------------------------------------------------------------------------- loading


def load_results(path: str | os.PathLike) -> dict:
    """Read and parse a results.json.

    Returns:
        The top-level JSON object as a dict.

    Raises:
        ResultsError: the file is missing or unreadable, is not UTF-8 JSON, or its top
            level is not an object. The message is one line naming the file.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ResultsError(f"{path}: no such file (run run_benchmarks.py first, or pass --results)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ResultsError(f"{path}: cannot read: {exc}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ResultsError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise ResultsError(f"{path}: not valid JSON (nested too deeply)") from None
    if not isinstance(doc, dict):
        raise ResultsError(f"{path}: top level is a JSON {type(doc).__name__}, expected an object "
                           f"with 'schema_version', 'summaries', ... (docs/results-schema.md)")
    return doc


def schema_warnings(doc: dict) -> list[str]:
    """Warnings about the schema version (missing or not the version this script knows)."""
    version = doc.get("schema_version")
    if version is None:
        return [f"results file has no schema_version; assuming {KNOWN_SCHEMA_VERSION} and drawing what it can"]
    if version != KNOWN_SCHEMA_VERSION:
        return [f"results file has schema_version {version!r}, this script knows {KNOWN_SCHEMA_VERSION}; "
                f"drawing the figures it can"]
    return []


def plot_label(mode: Any, level: Any) -> str:
    """Label of a (mode, level) row: ``mode`` if level is null else ``f"{mode}-l{level}"``
    (:func:`evaluation.summary.plot_label`, the one rule shared with run_benchmarks.py)."""
    if isinstance(level, np.floating):
        level = float(level)
    if isinstance(level, float) and not math.isnan(level) and not level.is_integer():
        return f"{mode}-l{level}"
    return summary_rules.plot_label(mode, level)


def _records(doc: dict, key: str, notes: list[str]) -> list[dict]:
    value = doc.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        notes.append(f"'{key}' is a {type(value).__name__}, not a list; ignored")
        return []
    records = [r for r in value if isinstance(r, dict)]
    if len(records) != len(value):
        notes.append(f"'{key}': {len(value) - len(records)} entries are not objects; ignored")
    return records


def _coerce_numeric(df: pd.DataFrame, columns: Sequence[str]) -> pd.DataFrame:
    """Numeric columns as float: non-numbers (strings, lists, bools) and +-inf become NaN."""
    for col in columns:
        if col in df.columns:
            values = df[col].map(lambda v: v if isinstance(v, (int, float)) and not isinstance(v, bool) else None)
            df[col] = pd.to_numeric(values, errors="coerce").astype(float).replace([np.inf, -np.inf], np.nan)
    return df


def _keep_small_ints(df: pd.DataFrame, columns: Sequence[str], upper: float) -> pd.DataFrame:
    """Index-like columns (level, layer, chunk): keep integers in [0, upper], else NaN."""
    for col in columns:
        if col in df.columns:
            v = df[col]
            df[col] = v.where((v >= 0) & (v <= upper) & (v % 1 == 0))
    return df


def _coerce_str(df: pd.DataFrame, columns: Sequence[str]) -> pd.DataFrame:
    """Name columns keep only string values; anything else becomes None."""
    for col in columns:
        if col in df.columns:
            df[col] = df[col].map(lambda v: v if isinstance(v, str) else None).astype(object)
    return df


def _coerce_bool(df: pd.DataFrame, columns: Sequence[str]) -> pd.DataFrame:
    for col in columns:
        if col in df.columns:
            df[col] = df[col].map(lambda v: v if isinstance(v, bool) else None).astype(object)
    return df


def _add_labels(df: pd.DataFrame) -> pd.DataFrame:
    if "mode" not in df.columns:
        return df
    df = df[df["mode"].notna()].copy()
    df["mode"] = df["mode"].astype(str)
    if "level" not in df.columns:
        df["level"] = np.nan
    df["label"] = [plot_label(m, lv) for m, lv in zip(df["mode"], df["level"], strict=True)]
    return df


def summaries_from_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """Per (mode, level, bandwidth_mbps) summaries computed from RUN records with
    :func:`evaluation.summary.summarize`, the function run_benchmarks.py writes them with
    (medians; accuracy = share correct).

    Used when a results file has runs but no summaries. Column names follow SUMMARY in
    docs/results-schema.md. Returns an empty frame when runs lack ``mode``.
    """
    if runs.empty or "mode" not in runs.columns:
        return pd.DataFrame()

    def value(v: Any) -> Any:  # JSON numbers and bools only; NaN/inf/other types -> None
        if isinstance(v, bool):
            return v
        if isinstance(v, (int, float, np.integer, np.floating)) and np.isfinite(v):
            return float(v)
        return None

    records = []
    for row in runs.to_dict("records"):
        level = value(row.get("level"))
        rec = {"mode": row.get("mode"), "level": None if level is None else int(level),
               "bandwidth_mbps": value(row.get("bandwidth_mbps")),
               "quality": {k[len("quality."):]: value(v) for k, v in row.items()
                           if k.startswith("quality.")}}
        rec.update({k: value(v) for k, v in row.items()
                    if k not in rec and not k.startswith("quality.")})
        records.append(rec)
    return pd.DataFrame(summary_rules.summarize(records))


@dataclass
class ResultsData:
    """A results.json as tidy DataFrames, ready for the figure functions.

    Attributes:
        doc: the parsed JSON object.
        summaries: one row per (mode, level, bandwidth_mbps), numeric columns as float,
            plus ``label``; empty when the file has neither summaries nor runs.
        runs: ``pandas.json_normalize(doc["runs"])`` (``quality.f1`` etc.), plus ``label``.
        codec_layers: rows of ``codec_layers`` plus ``label``.
        adaptation: rows of ``adaptation``.
        notes: what was ignored or derived while reading (printed as warnings).
    """

    doc: dict
    summaries: pd.DataFrame
    runs: pd.DataFrame
    codec_layers: pd.DataFrame
    adaptation: pd.DataFrame
    notes: list[str] = field(default_factory=list)
    # quality.json of `python -m bench.quality` found beside the results file (main() sets
    # it); when present, fig_quality_vs_size draws its KL with CIs instead of the grid's ppl
    quality: dict | None = None

    @property
    def caption(self) -> str:
        """One line naming the run: model, dtype, link method, date, commit, command."""
        model = self.doc.get("model") if isinstance(self.doc.get("model"), dict) else {}
        env = self.doc.get("environment") if isinstance(self.doc.get("environment"), dict) else {}
        parts = [f"model: {model.get('model_id', '?')}"
                 + (f" ({model['dtype']})" if model.get("dtype") else "")]
        parts.append(f"link: {env.get('link_method', '?')}")
        parts.append(f"date: {self.doc.get('created_utc', '?')}")
        if self.doc.get("git_commit"):
            parts.append(f"git {str(self.doc['git_commit'])[:10]}")
        if env.get("gpu"):
            parts.append(f"gpu: {env['gpu']}")
        parts.append(f"schema v{self.doc.get('schema_version', '?')}")
        return "  |  ".join(parts)

    @property
    def kv_dtype(self) -> str:
        model = self.doc.get("model") if isinstance(self.doc.get("model"), dict) else {}
        return str(model.get("dtype") or "model dtype")

    @property
    def failed(self) -> list[str]:
        """``"<label>: <stage>: <reason>"`` per (mode, level) in the file's ``failures`` (a
        codec's calibration, encode, perplexity pass or a request that failed; the run
        went on without it), in file order, one per label."""
        out: dict[str, str] = {}
        fails = self.doc.get("failures")
        for f in fails if isinstance(fails, list) else []:
            if not isinstance(f, dict) or not isinstance(f.get("mode"), str):
                continue
            lab = summary_rules.plot_label(f["mode"], f.get("level"))
            out.setdefault(lab, f"{lab}: {f.get('stage', 'failed')}: {str(f.get('reason', ''))[:90]}")
        return list(out.values())

    @property
    def incomplete(self) -> bool:
        """True when the file says ``"complete": false`` (an interrupted run's records)."""
        return self.doc.get("complete") is False

    def higher_is_better(self, metric: str) -> bool:
        hib = self.doc.get("higher_is_better")
        if isinstance(hib, dict) and isinstance(hib.get(metric), bool):
            return hib[metric]
        return DEFAULT_HIGHER_IS_BETTER.get(metric, True)


def prepare(doc: dict) -> ResultsData:
    """Turn a parsed results.json into :class:`ResultsData` (never raises on odd content).

    Values of the wrong type become missing: numbers that are not JSON numbers, names that
    are not strings, levels that are not small non-negative integers.
    """
    notes: list[str] = []
    runs = pd.json_normalize(_records(doc, "runs", notes)) if doc.get("runs") else pd.DataFrame()
    runs = _keep_small_ints(_coerce_str(_coerce_numeric(runs, ["level", "bandwidth_mbps"]), ["mode"]),
                            ["level"], 64)
    summaries = pd.DataFrame(_records(doc, "summaries", notes))
    if summaries.empty and not runs.empty:
        summaries = summaries_from_runs(runs)
        if not summaries.empty:
            notes.append("no 'summaries' in the file; medians computed from 'runs'")
    summaries = _coerce_str(_coerce_numeric(summaries, NUMERIC_SUMMARY_COLUMNS), ["mode"])
    summaries = _add_labels(_keep_small_ints(summaries, ["level"], 64))
    runs = _add_labels(runs)
    layers = pd.DataFrame(_records(doc, "codec_layers", notes))
    layers = _coerce_str(_coerce_numeric(layers, ["level", "layer", "rel_l2"]), ["mode", "kv"])
    layers = _add_labels(_keep_small_ints(_keep_small_ints(layers, ["level"], 64), ["layer"], 100_000))
    adaptation = pd.DataFrame(_records(doc, "adaptation", notes))
    adaptation = _coerce_numeric(adaptation, ["chunk", "bandwidth_mbps", "throughput_mbps_est", "level",
                                              "elapsed_s", "slo_s", "bytes"])
    adaptation = _coerce_bool(_coerce_str(adaptation, ["trace", "context_id"]), ["text_fallback"])
    adaptation = _keep_small_ints(_keep_small_ints(adaptation, ["level"], 64), ["chunk"], 10_000_000)
    return ResultsData(doc=doc, summaries=summaries, runs=runs, codec_layers=layers,
                       adaptation=adaptation, notes=notes)


# ----------------------------------------------------------------------------- helpers


def _require(df: pd.DataFrame, what: str, columns: Sequence[str]) -> None:
    if df.empty:
        raise SkipFigure(f"no '{what}' records")
    missing = [c for c in columns if c not in df.columns or df[c].isna().all()]
    if missing:
        raise SkipFigure(f"'{what}' lack {', '.join(missing)}")


def label_order(labels: Sequence[str], df: pd.DataFrame) -> list[str]:
    """Labels sorted by MODE_ORDER, then level descending (higher level = more bits first)."""
    pairs = df[["label", "mode", "level"]].drop_duplicates("label").set_index("label")

    def key(lab: str) -> tuple:
        mode = pairs.loc[lab, "mode"]
        level = pairs.loc[lab, "level"]
        rank = MODE_ORDER.index(mode) if mode in MODE_ORDER else len(MODE_ORDER)
        return (rank, mode, -(level if pd.notna(level) else math.inf))

    return sorted(set(labels), key=key)


def _colors(labels: Sequence[str]) -> dict[str, Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if len(labels) <= 10 else "tab20"]
    return {lab: cmap(i % cmap.N) for i, lab in enumerate(labels)}


def _marker(df: pd.DataFrame, label: str) -> str:
    mode = df.loc[df["label"] == label, "mode"].iloc[0]
    return MODE_MARKERS.get(mode, "o")


def _new_figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _caption(fig, data: ResultsData, note: str = "") -> None:
    text = data.caption + (f"\n{note}" if note else "")
    fig.text(0.0, 0.0, text, ha="left", va="top", fontsize=7, color="0.3", wrap=False)


def _log_helps(values: Sequence[float]) -> bool:
    vals = [v for v in values if v is not None and np.isfinite(v) and v > 0]
    return len(vals) >= 2 and max(vals) / min(vals) >= 10


def _plain_log_ticks(axis) -> None:
    """Log axis with plain numbers (0.2, 0.5, 1, 2, 5, ...) instead of 2x10^-1."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_minor_locator(NullLocator())
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))


def _bandwidth_ticks(ax, bandwidths: Sequence[float]) -> None:
    from matplotlib.ticker import FixedLocator, NullLocator

    bws = sorted(set(float(b) for b in bandwidths))
    ax.xaxis.set_major_locator(FixedLocator(bws))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([f"{b:g}" for b in bws])


# ----------------------------------------------------------------------------- figures


def fig_ttft_vs_bandwidth(data: ResultsData):
    """TTFT (median, p25-p75 bars) vs link bandwidth, one line per mode/level. Reads summaries."""
    s = data.summaries
    _require(s, "summaries", ["mode", "bandwidth_mbps", "ttft_s_median"])
    s = s.dropna(subset=["bandwidth_mbps", "ttft_s_median"])
    s = s[s["bandwidth_mbps"] > 0]
    if s.empty:
        raise SkipFigure("no summary row has both bandwidth_mbps > 0 and ttft_s_median")
    labels = label_order(s["label"], s)
    colors = _colors(labels)
    fig = _new_figure(7.5, 4.8)
    ax = fig.add_subplot()
    for lab in labels:
        rows = s[s["label"] == lab].sort_values("bandwidth_mbps")
        x, y = rows["bandwidth_mbps"].to_numpy(), rows["ttft_s_median"].to_numpy()
        yerr = None
        if {"ttft_s_p25", "ttft_s_p75"} <= set(rows.columns):
            lo = np.clip(y - rows["ttft_s_p25"].to_numpy(), 0, None)
            hi = np.clip(rows["ttft_s_p75"].to_numpy() - y, 0, None)
            yerr = np.nan_to_num(np.vstack([lo, hi]))
        ax.errorbar(x, y, yerr=yerr, label=lab, color=colors[lab], marker=_marker(s, lab),
                    linestyle="--" if lab == "text" else "-", capsize=3, linewidth=1.5, markersize=6)
    ax.set_xscale("log")
    _bandwidth_ticks(ax, s["bandwidth_mbps"])
    if _log_helps(s["ttft_s_median"]):
        ax.set_yscale("log")
        _plain_log_ticks(ax.yaxis)
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
    _caption(fig, data, note + "; bars: p25-p75")
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
    fig = _new_figure(5.0 * len(panels) + 1.0, 4.6)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    all_labels = label_order(s["label"], s)
    colors = _colors(all_labels)
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
            if _log_helps(vals):
                ax.set_yscale("log")
                _plain_log_ticks(ax.yaxis)
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
    _caption(fig, data, note)
    return fig


QUALITY_PANELS = [("ppl_increase_pct", "perplexity increase vs lossless (%)"),
                  ("accuracy", "task accuracy (share correct)"),
                  ("rouge_l", "ROUGE-L F vs lossless generation")]


def _pareto(points: list[tuple[float, float]], higher_is_better: bool) -> list[tuple[float, float]]:
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
    _require(s, "summaries", ["mode", "bytes_median"])
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
    colors = _colors(label_order(s["label"], s))
    fig = _new_figure(4.4 * len(metrics) + 1.6, 4.4)
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
                h = ax.scatter(size / MB, q, color=colors[lab], marker=_marker(kv, lab), s=55,
                               edgecolor="black", linewidth=0.5, zorder=3, label=lab)
                handles.setdefault(lab, h)
                if bw is not None and np.isfinite(bw):
                    ax.annotate(f"{bw:g} Mbit/s", (size / MB, q), fontsize=6, xytext=(4, 3),
                                textcoords="offset points")
                points.append((size / MB, q))
        front = _pareto(points, hib)
        if len(front) >= 2:
            fx, fy = zip(*front, strict=True)
            h = ax.step(fx, fy, where="post", color="0.4", linewidth=1, linestyle="-", zorder=2,
                        label="Pareto front")[0]
            handles.setdefault("Pareto front", h)
        if not text_rows.empty and metric in text_rows and text_rows[metric].notna().any():
            h = ax.axhline(text_rows[metric].median(), color="0.2", linestyle="--", linewidth=1,
                           label="text (recompute)")
            handles.setdefault("text (recompute)", h)
        ax.set_xscale("log")
        _plain_log_ticks(ax.xaxis)
        ax.set_xlabel("KV bytes per context (MB, log scale)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{metric} ({'higher' if hib else 'lower'} is better)", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
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
    _caption(fig, data, "points: medians over requests; Pareto front: no other point is both smaller "
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
                        marker=_marker(kv, lab), markersize=7, markeredgecolor="black", markeredgewidth=0.5,
                        capsize=3, linewidth=1, zorder=3, label=lab)
        handles.setdefault(lab, h)
        points.append((size, kl))
    if not points:
        ax.text(0.5, 0.5, "no mode of this run has a KL row in quality.json", ha="center", va="center",
                transform=ax.transAxes, fontsize=8)
    front = _pareto(points, False)
    if len(front) >= 2:
        fx, fy = zip(*front, strict=True)
        h = ax.step(fx, fy, where="post", color="0.4", linewidth=1, linestyle="-", zorder=2,
                    label="Pareto front")[0]
        handles.setdefault("Pareto front", h)
    ax.set_xscale("log")
    _plain_log_ticks(ax.xaxis)
    ax.set_xlabel("KV bytes per context (MB, log scale)")
    ax.set_ylabel(QUALITY_JSON_KL_PANEL[1])
    ax.set_title("KL from quality.json, 95% CI (lower is better)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)


def fig_ttft_breakdown(data: ResultsData):
    """Stacked TTFT components per mode/level, one panel per bandwidth; black marks = measured TTFT."""
    s = data.summaries
    _require(s, "summaries", ["mode"])
    parts = [(c, n) for c, n in BREAKDOWN_PARTS if c in s.columns and s[c].notna().any()]
    if not parts:
        raise SkipFigure("'summaries' lack transfer_s_median, decode_s_median, inject_s_median and prefill_s_median")
    if "bandwidth_mbps" in s.columns and s["bandwidth_mbps"].notna().any():
        bws = sorted(s["bandwidth_mbps"].dropna().unique())
    else:
        bws = [None]
    fig = _new_figure(min(4.2 * len(bws), 16) + 1.2, 4.8)
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
    _caption(fig, data, "stacked: median of each component; when decoding overlaps transfer (pipelined), "
                        "the stack can exceed the measured TTFT")
    return fig


def fig_reconstruction_error(data: ResultsData):
    """Relative L2 error of the decoded KV per layer, keys and values, per mode/level. Reads codec_layers."""
    c = data.codec_layers
    _require(c, "codec_layers", ["mode", "layer", "rel_l2"])
    c = c.dropna(subset=["layer", "rel_l2"])
    kvs = sorted(c["kv"].dropna().astype(str).unique()) if "kv" in c.columns else []
    panels = kvs if kvs else [None]
    labels = label_order(c["label"], c)
    colors = _colors(labels)
    lossless = [lab for lab in labels if (c.loc[c["label"] == lab, "rel_l2"] == 0).all()]
    drawn = c[~c["label"].isin(lossless)]
    if drawn.empty:
        raise SkipFigure("every codec in 'codec_layers' has zero error (nothing to plot)")
    log = (drawn["rel_l2"] > 0).all() and _log_helps(drawn["rel_l2"])
    fig = _new_figure(5.0 * len(panels) + 1.6, 4.4)
    axes = fig.subplots(1, len(panels), squeeze=False, sharey=True)[0]
    names = {"k": "keys", "v": "values"}
    for ax, kv in zip(axes, panels, strict=True):
        rows = drawn if kv is None else drawn[drawn["kv"].astype(str) == kv]
        for lab in labels:
            r = rows[rows["label"] == lab].sort_values("layer")
            if r.empty:
                continue
            ax.plot(r["layer"], r["rel_l2"], label=lab, color=colors[lab], marker=_marker(c, lab),
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
    _caption(fig, data, note)
    return fig


def fig_adaptation_timeline(data: ResultsData):
    """Per chunk: link bandwidth and estimate, level chosen (text fallback), elapsed time vs SLO."""
    a = data.adaptation
    _require(a, "adaptation", ["chunk"])
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
    fig = _new_figure(4.8 * len(traces) + 1.8, 2.2 * len(rows_avail) + 1.2)
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
    _caption(fig, data, "one context per trace; level 'text' = the chunk was sent as text and recomputed")
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


# ----------------------------------------------------------------------------- output


def save_figure(fig, path: Path, fmt: str, dpi: int = 150) -> None:
    """Write ``fig`` to ``path`` atomically (``common.header.atomic_write``: temp file in
    the same folder, then rename)."""
    atomic_write(path, lambda fh: fig.savefig(fh, format=fmt, dpi=dpi, bbox_inches="tight",
                                              pad_inches=0.15,
                                              metadata={"Date": None} if fmt == "svg" else None),
                 binary=True)


INCOMPLETE_MARK = "INCOMPLETE RUN"


def mark_incomplete(fig, data: ResultsData) -> None:
    """Prefix the figure's title with "INCOMPLETE RUN (n runs)": the file was left by an
    interrupted run (``"complete": false``), so its figures lack the runs never made."""
    title = fig.get_suptitle()
    n = len(data.doc.get("runs") or []) if isinstance(data.doc.get("runs"), list) else 0
    mark = f"{INCOMPLETE_MARK} ({n} runs written)"
    fig.suptitle(f"{mark}: {title}" if title else mark, color="firebrick")


FAILED_MARK = "FAILED"


def mark_failed(fig, data: ResultsData) -> None:
    """A red footnote "FAILED: <label>: <stage>: <reason>; ..." on the figure: the file's
    ``failures`` (the run went on without those codecs/requests, so they are missing or
    partial in the figure)."""
    lines = data.failed
    if not lines:
        return
    shown = lines[:3] + ([f"+{len(lines) - 3} more"] if len(lines) > 3 else [])
    fig.text(0.01, 0.005, f"{FAILED_MARK}: " + "; ".join(shown), color="firebrick",
             fontsize=7, ha="left", va="bottom", wrap=True)


def render_all(data: ResultsData, out_dir: Path, formats: Sequence[str], only: Sequence[str] | None = None,
               dpi: int = 150) -> tuple[list[Path], list[tuple[str, str]]]:
    """Draw every figure (or those in ``only``) and write it in each format.

    Returns:
        (written paths, [(figure name, reason skipped)]).
    """
    written: list[Path] = []
    skipped: list[tuple[str, str]] = []
    for name, spec in FIGURES.items():
        if only and name not in only:
            continue
        try:
            fig = spec.draw(data)
        except SkipFigure as exc:
            skipped.append((name, str(exc)))
            continue
        except (KeyError, ValueError, TypeError, IndexError) as exc:  # odd values in an odd file
            skipped.append((name, f"could not draw from this file ({type(exc).__name__}: {exc})"))
            continue
        if data.incomplete:
            mark_incomplete(fig, data)
        mark_failed(fig, data)
        for fmt in formats:
            path = out_dir / f"{name}.{fmt}"
            save_figure(fig, path, fmt, dpi=dpi)
            written.append(path)
    return written, skipped


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Draw the benchmark figures (PNG and SVG) from a results.json.",
        epilog="examples:\n  python visualize_results.py\n"
               "  python visualize_results.py --results runs/r.json --out figs/ --formats png\n"
               "  python visualize_results.py --only ttft_vs_bandwidth kv_size\n"
               f"figures: {', '.join(FIGURES)}",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS,
                        help="results file written by run_benchmarks.py (default: %(default)s)")
    flags.add_out(parser, type=Path, default=DEFAULT_OUT,
                  help="folder for the figures, created if needed (default: %(default)s)")
    parser.add_argument("--formats", nargs="+", default=["png", "svg"], choices=["png", "svg", "pdf"],
                        help="image formats to write (default: png svg)")
    parser.add_argument("--only", nargs="+", choices=list(FIGURES), metavar="FIGURE",
                        help=f"draw only these figures ({', '.join(FIGURES)})")
    parser.add_argument("--dpi", type=int, default=150, help="PNG resolution (default: %(default)s)")
    parser.add_argument("--quality", type=Path, nargs="?", const=DEFAULT_QUALITY, default=None,
                        help="draw only quality_divergence from a quality.json of python -m bench.quality "
                             f"(default file: {DEFAULT_QUALITY})")
    parser.add_argument("--adaptation", type=Path, nargs="?", const=DEFAULT_ADAPTATION, default=None,
                        help="draw only the adaptation figures from an adaptation.json of python -m bench.adapt "
                             f"(default file: {DEFAULT_ADAPTATION})")
    return parser


def _render_one_file(render, path: Path, args) -> int:
    """Run one file's renderer (render_adaptation / render_quality) for the CLI: prints
    each written path; returns 0, 1 (nothing drawn) or 2 (bad input)."""
    try:
        for out in render(path, args.out, args.formats, args.dpi):
            print(f"wrote {out}")
    except ResultsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except SkipFigure as exc:
        print(f"nothing drawn: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 1 nothing drawn, 2 bad input)."""
    args = build_parser().parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")  # no display needed; set here, not at import time
    if args.adaptation is not None:
        return _render_one_file(render_adaptation, args.adaptation, args)
    if args.quality is not None:
        if args.out.exists() and not args.out.is_dir():
            print(f"error: --out {args.out} exists and is not a folder", file=sys.stderr)
            return 2
        return _render_one_file(render_quality, args.quality, args)
    try:
        doc = load_results(args.results)
    except ResultsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.out.exists() and not args.out.is_dir():
        print(f"error: --out {args.out} exists and is not a folder", file=sys.stderr)
        return 2
    if args.dpi <= 0:
        print(f"error: --dpi must be positive, got {args.dpi}", file=sys.stderr)
        return 2
    for msg in schema_warnings(doc):
        print(f"warning: {msg}", file=sys.stderr)
    data = prepare(doc)
    qpath = Path(args.results).parent / "quality.json"  # bench.quality's file beside the results
    if qpath.is_file():
        try:
            qdoc = json.loads(qpath.read_text())
            data.quality = qdoc if isinstance(qdoc, dict) else None
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            print(f"warning: ignoring {qpath}: {exc}", file=sys.stderr)
        if data.quality is not None:
            print(f"quality_vs_size: KL with 95% CIs from {qpath}")
    for msg in data.notes:
        print(f"warning: {msg}", file=sys.stderr)
    try:
        written, skipped = render_all(data, args.out, args.formats, args.only, args.dpi)
    except OSError as exc:
        print(f"error: cannot write figures to {args.out}: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    for name, reason in skipped:
        print(f"skipped {name}: {reason}")
    if not written:
        print(f"error: no figure could be drawn from {args.results}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
