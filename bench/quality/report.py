"""The console tables of ``python -m bench.quality``: text fidelity per codec/level, task
answers, the agreement split by the lossless answer, and the answer paths taken.
Part of bench.quality (the command is bench.quality.cli)."""
from __future__ import annotations

from typing import Sequence

from bench.quality.text import level_label


def _fmt_ci(x: float, ci: Sequence[float], digits: int = 4) -> str:
    return f"{x:.{digits}f} [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def _print_rows(header: str, lines, note: str, out=None) -> None:
    """One printed table: ``header``, one line per item of ``lines``, then ``note``."""
    for line in (header, *lines, note):
        print(line, file=out)


def print_table(rows: list[dict], out=None) -> None:
    """The text-fidelity table (ppl change labelled as not monotone in distortion)."""
    rows = sorted(rows, key=lambda r: (r["codec"], -1 if r["level"] is None else r["level"], _anchors(r)))
    _print_rows(
        f"{'codec / level':<24} {'ratio':>7} {'bits/el':>7}  {'n':>3}  {'exact':>5}  {'KL nats/token [95% CI]':<28} "
        f"{'top-1 agreement [95% CI]':<26} {'ppl change % [95% CI] (not monotone)':<30}",
        (f"{level_label(r['codec'], r['level'], _anchors(r)) + (' *' if r.get('default') else ''):<24} "
         f"{r['ratio_vs_dtype']:>6.2f}x {r['bits_per_element']:>7.3f}  {r['n_windows']:>3}  {_exact(r):>5}  "
         f"{_fmt_ci(r['kl'], r['kl_ci']):<28} {_fmt_ci(r['top1_agreement'], r['top1_agreement_ci'], 3):<26} "
         f"{_fmt_ci(r['ppl_change_pct'], r['ppl_change_pct_ci'], 1):<30}" for r in rows),
        "* = default codec/level. +S/R = S sink and R recent tokens stored exactly (codec.anchors); exact = "
        "tokens per context stored exactly (anchors plus the codec's own sinks/recent; - = unknown). KL and "
        "top-1 agreement are against the lossless KV on the same windows; rank by them, not by ppl change.", out)


def _anchors(r: dict) -> tuple[int, int]:
    a = r.get("anchors") or {}
    return int(a.get("sink", 0)), int(a.get("recent", 0))


def _exact(r: dict) -> str:
    x = r.get("exact_tokens")
    return "-" if x is None else f"{x:g}"


def print_task_table(rows: list[dict], out=None) -> None:
    _print_rows(
        f"{'codec / level':<18} {'task':<16} {'n':>4}  {'accuracy [Wilson 95%]':<24} "
        f"{'answer agreement [Wilson 95%]':<30} {'token agreement [Wilson 95%]':<30}",
        (f"{level_label(r['codec'], r['level']):<18} {r['task']:<16} {r['n']:>4}  "
         f"{_fmt_ci(r['accuracy'], r['accuracy_ci'], 3):<24} {_fmt_ci(r['agreement'], r['agreement_ci'], 3):<30} "
         + (f"{_fmt_ci(r['token_agreement'], r['token_agreement_ci'], 3):<30}"
            if r.get("token_agreement") is not None else f"{'-':<30}") for r in rows),
        "answer agreement: the scored answer equals the lossless answer's; token agreement: identical "
        "token ids (a rephrasing disagrees).", out)


def print_task_splits(rows: list[dict], out=None) -> None:
    """Answer agreement (task ``all``) split by the lossless answer: correct / wrong, and
    its smallest top-2 logit margin above / below ``margin_split`` (n and Wilson 95% CI)."""
    rows = [r for r in rows if r["task"] == "all" and r.get("agreement_split")]
    if not rows:
        return
    th = rows[0]["agreement_split"]["margin_split"]

    def cell(d):
        return "-" if not d["n"] else f"{d['agreement']:.3f} [{d['agreement_ci'][0]:.2f}, {d['agreement_ci'][1]:.2f}] n={d['n']}"

    print(f"{'codec / level':<18} {'lossless correct':<28} {'lossless wrong':<28} "
          f"{f'lossless margin >= {th:g}':<28} {f'margin < {th:g}':<28}", file=out)
    for r in rows:
        sp = r["agreement_split"]
        print(f"{level_label(r['codec'], r['level']):<18} " + " ".join(
            f"{cell(sp[k]):<28}" for k in ("lossless_correct", "lossless_wrong", "margin_high", "margin_low")),
            file=out)
    print("answer agreement (all tasks) split by the lossless answer of each request (Wilson 95% CIs).", file=out)


def print_task_paths(info: dict, out=None) -> None:
    """How the task answers were obtained (teacher-forced / continued / fallback per codec),
    the verify counts when present, and the mean seconds per request."""
    n = len(info["requests"])
    print(f"answers ({info['answer_dtype']} activations, fallback below a top-2 margin of {info['min_margin']:g}): "
          + "; ".join(f"{lab}: " + ", ".join(f"{n} {path}" for path, n in d.items())
                      for lab, d in info["answer_paths"].items()), file=out)
    if info.get("verify"):
        print(f"verify: {info['verify']['mismatches']} of {info['verify']['checked']} fast-path answers differ "
              "from plain greedy generation", file=out)
    if n:
        sec = [x["seconds"] for x in info["requests"]]
        codec_s = sum(c["codec_s"] for x in info["requests"] for c in x["codecs"].values())
        ans_s = sum(c["answer_s"] for x in info["requests"] for c in x["codecs"].values())
        print(f"seconds per request: {info['total_s'] / n:.1f} (prefill {sum(x['prefill'] for x in sec) / n:.1f}, "
              f"lossless answer {sum(x['lossless_answer'] for x in sec) / n:.1f}, codecs encode+decode "
              f"{codec_s / n:.1f}, codec answers {ans_s / n:.1f})", file=out)
