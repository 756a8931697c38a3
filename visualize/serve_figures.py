"""The figure ``goodput_vs_rate`` from serve-load files (``python -m bench.serve_load``:
benchmarks/serve_load*.json): goodput (requests/s meeting the TTFT SLO) against the offered
request rate, one line per mode, the measured throughput dotted in the same colour and the
offered rate as the dashed diagonal (every request served within the SLO). Reads only
those files.

Paper: CacheGen (Liu et al., SIGCOMM 2024) section 7 (TTFT of reused contexts), measured
under load; goodput as in DistServe (Zhong et al., OSDI 2024).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from visualize.data import SkipFigure, label_colors, new_figure, save_formats
from visualize.loading import ResultsError, read_json_doc

SERVE_MODES = ("text", "cachegen", "kvtc", "adaptive")
DEFAULT_SERVE_LOAD_GLOB = "serve_load*.json"   # in the benchmarks folder


def _rows(docs: Sequence[dict]) -> list[dict]:
    """Every row of every file with a mode, a positive offered rate and a goodput."""
    out = []
    for doc in docs:
        for r in doc.get("rows") or []:
            if isinstance(r, dict) and isinstance(r.get("mode"), str) and \
                    isinstance(r.get("rate_rps"), (int, float)) and r["rate_rps"] > 0 and \
                    isinstance(r.get("goodput_rps"), (int, float)):
                out.append(r)
    return out


def fig_goodput_vs_rate(docs: Sequence[dict]):
    """Goodput (req/s) vs offered rate (req/s) per mode, from serve-load result dicts
    (each with ``rows``: ``mode``, ``rate_rps``, ``goodput_rps``, optional
    ``throughput_rps``, ``n``, ``slo_s``, ``load_avg_before`` / ``load_avg_after``). A
    (mode, rate) measured in several files is drawn as each point, the line through their
    mean. Raises SkipFigure when no row has a mode, rate and goodput."""
    rows = _rows(docs)
    if not rows:
        raise SkipFigure("the serve-load files have no rows with mode, rate_rps and goodput_rps")
    modes = sorted({r["mode"] for r in rows}, key=lambda m: (SERVE_MODES.index(m) if m in SERVE_MODES else 99, m))
    colors = label_colors(modes)
    fig = new_figure(6.4, 4.6)
    ax = fig.subplots()
    rates = sorted({float(r["rate_rps"]) for r in rows})
    ax.plot(rates, rates, color="grey", linestyle="--", linewidth=1, label="offered (all within SLO)")
    for m in modes:
        mine = [r for r in rows if r["mode"] == m]
        xs = sorted({float(r["rate_rps"]) for r in mine})
        good = [np.mean([r["goodput_rps"] for r in mine if float(r["rate_rps"]) == x]) for x in xs]
        ax.scatter([r["rate_rps"] for r in mine], [r["goodput_rps"] for r in mine], color=colors[m], s=18)
        ax.plot(xs, good, color=colors[m], marker="o", markersize=4, label=f"{m} goodput")
        thr = [(x, np.mean(t)) for x in xs
               if (t := [r["throughput_rps"] for r in mine if float(r["rate_rps"]) == x
                         and isinstance(r.get("throughput_rps"), (int, float))])]
        if thr:
            ax.plot(*zip(*thr), color=colors[m], linestyle=":", linewidth=1, label=f"{m} throughput")
    ax.set_xscale("log")
    ax.set_xticks(rates)
    ax.set_xticks([], minor=True)
    ax.set_xticklabels([f"{x:g}" for x in rates])
    ax.set_xlabel("offered request rate, req/s (Poisson arrivals)")
    ax.set_ylabel("req/s")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    slos = sorted({float(r["slo_s"]) for r in rows if isinstance(r.get("slo_s"), (int, float))})
    ns = sorted({int(r["n"]) for r in rows if isinstance(r.get("n"), int)})
    loads = [x for r in rows for k in ("load_avg_before", "load_avg_after")
             if isinstance(r.get(k), list) and r[k] for x in r[k][:1]]
    cfg = (docs[0].get("config") or {}) if docs else {}
    model = (docs[0].get("model") or {}).get("model_id", "?") if docs else "?"
    slo = "/".join(f"{s:g}" for s in slos) or "?"
    bw = cfg.get("bandwidth_mbps")
    note = f"n = {'/'.join(map(str, ns)) or '?'} requests per point, one run each"
    if loads:
        note += f"; 1-min load average {min(loads):.1f}-{max(loads):.1f} during the runs (shared machine)"
    fig.suptitle(f"Goodput at a {slo} s TTFT SLO vs offered rate: {model}, "
                 f"{f'{bw:g}' if isinstance(bw, (int, float)) else '?'} Mbit/s link\n{note}", fontsize=9)
    return fig


def render_serve_load(paths: Sequence[Path], out_dir: Path, formats: Sequence[str], dpi: int = 150) -> list[Path]:
    """Draw ``goodput_vs_rate.<fmt>`` into ``out_dir`` from the serve-load files ``paths``
    (their rows together). Raises ResultsError for an unreadable file or none given,
    SkipFigure when they have no usable rows."""
    if not paths:
        raise ResultsError(f"no serve-load files ({DEFAULT_SERVE_LOAD_GLOB} in the benchmarks folder)")
    docs = [read_json_doc(p, "serve-load", "rows") for p in paths]
    return save_formats(fig_goodput_vs_rate(docs), out_dir, "goodput_vs_rate", formats, dpi)
