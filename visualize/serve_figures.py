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

SERVE_MODES = ("text", "cachegen", "kvtc", "adaptive (idle prefill)", "adaptive (tail prefill)")
DEFAULT_SERVE_LOAD_GLOB = "serve_load*.json"   # in the benchmarks folder


def _rows(docs: Sequence[dict]) -> list[dict]:
    """Every row of every file with a mode, a positive offered rate and a goodput. An
    adaptive row's mode names the prefill speed its policy was given (the file's
    ``config.adaptive_prefill``; a file without it measured the idle, from-scratch speed), so
    runs of two policies never share a line; a run with asynchronous loads (``config.async_load``)
    names that in its KV modes' labels, so it never shares a line with synchronous loads."""
    out = []
    for doc in docs:
        cfg = doc.get("config") or {}
        prefill = cfg.get("adaptive_prefill") or "idle"
        for r in doc.get("rows") or []:
            if isinstance(r, dict) and isinstance(r.get("mode"), str) and \
                    isinstance(r.get("rate_rps"), (int, float)) and r["rate_rps"] > 0 and \
                    isinstance(r.get("goodput_rps"), (int, float)):
                mode = r["mode"] if r["mode"] != "adaptive" else f"adaptive ({prefill} prefill)"
                if cfg.get("async_load") is True and r["mode"] != "text":   # another connector set-up
                    mode += " (async load)"
                out.append(r if mode == r["mode"] else {**r, "mode": mode})
    return out


WORKLOAD_KEYS = ("context_tokens", "new_context_tokens", "reused_fraction", "contexts", "slo_s",
                 "bandwidth_mbps", "chunk_tokens")   # what makes two files' rows one experiment


def workload(doc: dict) -> tuple:
    """The workload of a serve-load file: its model and the ``WORKLOAD_KEYS`` of its
    config (rates, modes and request counts may differ between files of one workload)."""
    cfg = doc.get("config") or {}
    model = (doc.get("model") or {}).get("model_id", "?")
    return (model,) + tuple(repr(cfg.get(k)) for k in WORKLOAD_KEYS)


def _workload_label(doc: dict) -> str:
    cfg = doc.get("config") or {}
    new = cfg.get("new_context_tokens") or [cfg.get("context_tokens", "?")]
    reused = cfg.get("reused_fraction")
    share = f"{reused:.0%} " if isinstance(reused, (int, float)) else ""
    if isinstance(reused, (int, float)) and reused >= 1:   # no new contexts in the workload
        return f"all reused {cfg.get('context_tokens', '?')}-token contexts"
    return (f"{share}reused {cfg.get('context_tokens', '?')}-token contexts, new "
            f"{'/'.join(str(x) for x in new)} tokens")


def _panel(ax, rows: list[dict], modes: list[str], colors: dict) -> None:
    rates = sorted({float(r["rate_rps"]) for r in rows})
    ax.plot(rates, rates, color="grey", linestyle="--", linewidth=1, label="offered (all within SLO)")
    for m in [m for m in modes if any(r["mode"] == m for r in rows)]:
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


def fig_goodput_vs_rate(docs: Sequence[dict]):
    """Goodput (req/s) vs offered rate (req/s) per mode, from serve-load result dicts
    (each with ``rows``: ``mode``, ``rate_rps``, ``goodput_rps``, optional
    ``throughput_rps``, ``n``, ``slo_s``, ``load_avg_before`` / ``load_avg_after``; and
    ``config`` / ``model``, which name the workload). One panel per workload (``workload``:
    files of different context sizes or SLOs are different experiments and never share a
    line); inside a panel a (mode, rate) measured in several files is drawn as each point,
    the line through their mean. Raises SkipFigure when no row has a mode, rate and goodput."""
    groups: dict[tuple, list[dict]] = {}
    for doc in docs:
        if _rows([doc]):
            groups.setdefault(workload(doc), []).append(doc)
    if not groups:
        raise SkipFigure("the serve-load files have no rows with mode, rate_rps and goodput_rps")
    rows = _rows(docs)
    modes = sorted({r["mode"] for r in rows}, key=lambda m: (SERVE_MODES.index(m) if m in SERVE_MODES else 99, m))
    colors = label_colors(modes)
    fig = new_figure(6.4 * len(groups), 4.8)
    axes = fig.subplots(1, len(groups), squeeze=False)[0]
    for ax, group in zip(axes, groups.values()):
        mine = _rows(group)
        _panel(ax, mine, modes, colors)
        ns = sorted({int(r["n"]) for r in mine if isinstance(r.get("n"), int)})
        loads = [x for r in mine for k in ("load_avg_before", "load_avg_after")
                 if isinstance(r.get(k), list) and r[k] for x in r[k][:1]]
        note = f"n = {'/'.join(map(str, ns)) or '?'} requests per point, one run each"
        if loads:
            note += f"; load {min(loads):.1f}-{max(loads):.1f}"
        ax.set_title(f"{_workload_label(group[0])}\n{note}", fontsize=8)
    slos = sorted({float(r["slo_s"]) for r in rows if isinstance(r.get("slo_s"), (int, float))})
    models = sorted({(d.get("model") or {}).get("model_id", "?") for d in docs})
    slo = "/".join(f"{s:g}" for s in slos) or "?"
    bws = sorted({(d.get("config") or {}).get("bandwidth_mbps") for d in docs} - {None}, key=float)
    bw = "/".join(f"{b:g}" for b in bws) or "?"
    fig.suptitle(f"Goodput at a {slo} s TTFT SLO vs offered rate: {', '.join(models)}, {bw} Mbit/s link "
                 f"(1-min load average of the shared 2-core machine per panel)", fontsize=9)
    return fig


def render_serve_load(paths: Sequence[Path], out_dir: Path, formats: Sequence[str], dpi: int = 150) -> list[Path]:
    """Draw ``goodput_vs_rate.<fmt>`` into ``out_dir`` from the serve-load files ``paths``
    (their rows together). Raises ResultsError for an unreadable file or none given,
    SkipFigure when they have no usable rows."""
    if not paths:
        raise ResultsError(f"no serve-load files ({DEFAULT_SERVE_LOAD_GLOB} in the benchmarks folder)")
    docs = [read_json_doc(p, "serve-load", "rows") for p in paths]
    return save_formats(fig_goodput_vs_rate(docs), out_dir, "goodput_vs_rate", formats, dpi)
