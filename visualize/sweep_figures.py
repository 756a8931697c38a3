"""The context-length figure ``ttft_vs_context`` from a context-sweep file
(``python -m bench.context_sweep``, docs/results-schema.md "context-sweep"): TTFT against
context tokens on log-log axes, one panel per link rate, one line per mode (p25-p75 as a
band), the text / cachegen fit in each panel's title. Reads only that file."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from visualize.data import SkipFigure, label_colors, new_figure, plain_log_ticks, save_formats
from visualize.loading import read_json_doc

SWEEP_MODES = ("text", "quant8", "cachegen", "kvtc")


def _label(row: dict) -> str:
    return row["mode"] if row.get("level") is None else f"{row['mode']} {row['level']}"


def fig_ttft_vs_context(doc: dict):
    """TTFT (s) vs context tokens, log-log, a panel per Mbit/s. Raises SkipFigure when the
    file has no rows with ttft_s_median and context_tokens."""
    rows = [r for r in (doc.get("rows") or []) if isinstance(r, dict)
            and r.get("ttft_s_median") and r.get("context_tokens")]
    if not rows:
        raise SkipFigure("the sweep file has no rows with ttft_s_median and context_tokens")
    rates = sorted({float(r["bandwidth_mbps"]) for r in rows})
    labels = list(dict.fromkeys(_label(r) for r in sorted(
        rows, key=lambda r: SWEEP_MODES.index(r["mode"]) if r["mode"] in SWEEP_MODES else 99)))
    colors = label_colors(labels)
    fits = {f["bandwidth_mbps"]: f for f in (doc.get("fits") or {}).get("text_over_cachegen", [])}
    fig = new_figure(5.2 * len(rates), 4.4)
    axes = fig.subplots(1, len(rates), squeeze=False, sharey=True)[0]
    for ax, bw in zip(axes, rates, strict=True):
        for lab in labels:
            rs = sorted((r for r in rows if _label(r) == lab and float(r["bandwidth_mbps"]) == bw),
                        key=lambda r: r["context_tokens"])
            if not rs:
                continue
            x = np.array([r["context_tokens"] for r in rs], dtype=float)
            y = np.array([r["ttft_s_median"] for r in rs], dtype=float)
            ax.plot(x, y, marker="o", markersize=4, color=colors[lab], label=lab)
            lo = [r.get("ttft_s_p25") for r in rs]
            hi = [r.get("ttft_s_p75") for r in rs]
            if all(v is not None for v in lo + hi):
                ax.fill_between(x, lo, hi, color=colors[lab], alpha=0.15, linewidth=0)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        plain_log_ticks(ax.yaxis)
        ax.set_xticks(sorted({r["context_tokens_target"] for r in rows}))
        ax.set_xticklabels([f"{t / 1024:g}K" if t >= 1024 else str(t) for t in sorted({r["context_tokens_target"] for r in rows})])
        f = fits.get(bw)
        note = ""
        if f and f.get("fit"):
            note = f"\ntext/cachegen: log-log slope {f['fit']['slope']:.2f} (r2 {f['fit']['r2']:.2f})"
        ax.set_title(f"{bw:g} Mbit/s{note}", fontsize=10)
        ax.set_xlabel("context tokens")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("TTFT, s (median; band p25-p75)")
    cfg = doc.get("config") or {}
    model = (doc.get("model") or {}).get("model_id", "?")
    fig.suptitle(f"TTFT as the context grows: {model}, engine {cfg.get('engine', '?')}, "
                 f"{cfg.get('repeats', '?')} repeats x {cfg.get('num_contexts', '?')} context(s) per length",
                 fontsize=10)
    axes[-1].legend(fontsize=8, loc="upper left")
    return fig


def render_context_sweep(path: Path, out_dir: Path, formats: Sequence[str], dpi: int = 150) -> list[Path]:
    """Draw ``ttft_vs_context[-<suffix>].<fmt>`` from a context-sweep file into ``out_dir``
    (the suffix is what follows "context-sweep" in the file's name, e.g. "-gemma3-270m", or
    "-" + the file's stem for another name).
    Raises ResultsError for an unreadable file, SkipFigure when it has no usable rows."""
    doc = read_json_doc(path, "context-sweep", "rows")
    fig = fig_ttft_vs_context(doc)
    stem = Path(path).stem
    suffix = stem.removeprefix("context-sweep") if stem.startswith("context-sweep") else f"-{stem}"
    return save_formats(fig, out_dir, f"ttft_vs_context{suffix}", formats, dpi)
