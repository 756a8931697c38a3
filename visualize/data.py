"""A results.json as the figures see it: :func:`prepare` (tidy DataFrames in
:class:`ResultsData`; reading the file is visualize.loading.s), the
shared plot helpers (labels, colours, ticks, captions) and :func:`save_figure` (atomic
write). Drawn by ``visualize_results.py``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from cachegen_common.files import atomic_write  # stdlib only
from evaluation import summary as summary_rules  # stdlib + metric registry: no engine, no torch
from visualize.loading import SkipFigure

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


def require_columns(df: pd.DataFrame, what: str, columns: Sequence[str]) -> None:
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


def label_colors(labels: Sequence[str]) -> dict[str, Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if len(labels) <= 10 else "tab20"]
    return {lab: cmap(i % cmap.N) for i, lab in enumerate(labels)}


def mode_marker(df: pd.DataFrame, label: str) -> str:
    mode = df.loc[df["label"] == label, "mode"].iloc[0]
    return MODE_MARKERS.get(mode, "o")


def new_figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def add_caption(fig, data: ResultsData, note: str = "") -> None:
    text = data.caption + (f"\n{note}" if note else "")
    fig.text(0.0, 0.0, text, ha="left", va="top", fontsize=7, color="0.3", wrap=False)


def log_helps(values: Sequence[float]) -> bool:
    vals = [v for v in values if v is not None and np.isfinite(v) and v > 0]
    return len(vals) >= 2 and max(vals) / min(vals) >= 10


def plain_log_ticks(axis) -> None:
    """Log axis with plain numbers (0.2, 0.5, 1, 2, 5, ...) instead of 2x10^-1."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_minor_locator(NullLocator())
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))


def bandwidth_ticks(ax, bandwidths: Sequence[float]) -> None:
    from matplotlib.ticker import FixedLocator, NullLocator

    bws = sorted(set(float(b) for b in bandwidths))
    ax.xaxis.set_major_locator(FixedLocator(bws))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([f"{b:g}" for b in bws])



# ----------------------------------------------------------------------------- output


def save_formats(fig, out_dir: Path, name: str, formats: Sequence[str], dpi: int = 150) -> list[Path]:
    """``save_figure`` of ``fig`` as ``out_dir/<name>.<fmt>`` for each format -> the paths."""
    written = []
    for fmt in formats:
        path = Path(out_dir) / f"{name}.{fmt}"
        save_figure(fig, path, fmt, dpi=dpi)
        written.append(path)
    return written


def save_figure(fig, path: Path, fmt: str, dpi: int = 150) -> None:
    """Write ``fig`` to ``path`` atomically (``cachegen_common.files.atomic_write``: temp file in
    the same folder, then rename)."""
    atomic_write(path, lambda fh: fig.savefig(fh, format=fmt, dpi=dpi, bbox_inches="tight",
                                              pad_inches=0.15,
                                              metadata={"Date": None} if fmt == "svg" else None),
                 binary=True)

