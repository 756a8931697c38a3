"""Quality benchmark: divergence of decoded KV from lossless KV on WikiText-2, with 95% CIs.

What it measures (CacheGen, Liu et al., SIGCOMM 2024, section 7: quality of a reused
context whose KV cache went through a lossy codec; metrics as ../docs/results-schema.md):

- **Text fidelity** (paired, per window of WikiText-2 test): each window's context is
  prefilled ONCE; its lossless KV gives the reference logits of the continuation. For
  every codec and level, the KV is encoded, decoded and injected, and only the continuation
  is run on top of it (``kv_extraction_hf.inject.continuation_logits_batch``: ``--batch``
  codecs per forward, each codec's logits bit for bit those of its own batch-1
  ``continuation_logits``). Per window: mean
  KL(lossless || decoded) per continuation token (nats), top-1 agreement (share of
  continuation positions whose argmax equals the lossless argmax) and perplexity change
  (%; reported but NOT monotone in distortion: noise can lower it). Mean over windows with
  a 95% percentile bootstrap CI over windows (``evaluation.stats``), plus bits per element
  and the size ratio vs the KV dtype. ``raw`` is the lossless check (KL exactly 0).
- **Task answers** (by default; ``--no-tasks`` skips them): needle-in-a-haystack (depths
  10-90%, 1K-4K tokens) and topic retrieval (512 tokens: at chance for the default model
  above 1K, docs/tasks.md) prompts (``kv_extraction_hf.prompts.build_prompt``), half each,
  every prompt prefilled once (bf16, the engine's KV). The greedy lossless answer comes
  from the lossless KV; each codec's answer from its decoded KV by
  ``kv_extraction_hf.inject.answer_from_kv``: one teacher-forced forward of question +
  lossless answer decides agreement exactly, greedy generation continues only where the
  argmax first differs, low-margin positions fall back to plain greedy generation. Answer
  forwards use float32 activations over the bf16 KV (``--task-dtype``; bf16 batched and
  token-by-token forwards differ by up to 0.75 logits here). Accuracy and agreement with
  the lossless answer of the same request, each with a Wilson 95% CI.
- **Default level rule** (``--choose-default``): the smallest cachegen level whose KL and
  top-1 agreement are no worse than LMCache's schedule (``cachegen-ref`` level 0) on the
  same windows: the 95% paired bootstrap CI of (level - LMCache) per-window KL reaches 0
  or below, and that of top-1 agreement reaches 0 or above.

Run:
    python -m bench.quality --quick               # smoke run: 4 windows x (512 + 128) + 4 task requests
    python -m bench.quality                       # 32 windows x (2048 + 256), all codecs, + 60 task requests
    python -m bench.quality --tasks-only          # task answers only (see --help for time)
    python -m bench.quality --tasks-only --task-verify --task-requests 10   # fast answer path vs plain greedy
    python -m bench.quality --choose-default      # the rule, from benchmarks/quality.json
Output: benchmarks/quality.json (schema: docs/results-schema.md, "quality.json"), a table
on stdout; ``python visualize_results.py --quality benchmarks/quality.json`` draws the figure.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "quality.json"
REFERENCE = ("cachegen-ref", 0)          # LMCache's default schedule
FAMILY_DEFAULT = "cachegen"
TASKS = ("needle", "topic_retrieval")
TASK_LENGTHS = (1024, 2048, 3072, 4096)      # needle context lengths (tokens)
# topic retrieval is at chance for the default 135M model at >= 1K tokens (docs/tasks.md):
# it runs at 512 tokens, where the model is above chance
TOPIC_LENGTHS = (512,)
TASK_MAX_NEW_TOKENS = 40
# the codecs/levels measured on tasks by default: the default cachegen level, LMCache's schedule, the
# kvtc levels either side of its size, quant8, KIVI-2 and raw (the check: agreement must be 1)
DEFAULT_TASK_CODECS = "cachegen:1;cachegen-ref:0;kvtc:4,5;quant8;kivi2;raw"
# codecs whose continuation runs in one batched forward (inject.continuation_logits_batch);
# 7 splits the 21 default rows into 3 forwards (~1.5 GB of KV, logits and activations)
DEFAULT_BATCH = 7
# --quick is a smoke run (every codec and level on 4 short windows, each task kind twice):
# 4 windows x (512 + 128) tokens and 4 task requests; too few samples to rank codecs
QUICK_CONTINUATION = 128
QUICK_TASK_REQUESTS = 4

__all__ = ["codec_levels", "parse_codec_spec", "reference_scores", "window_scores", "run_text_quality", "run_tasks",
           "choose_default_level", "summarize_rows", "main"]


class QualityError(ValueError):
    """Bad user input for the quality benchmark (one-line message)."""


# ----------------------------------------------------------------------------- codecs
def codec_levels(name: str) -> list[Optional[int]]:
    """The levels to measure for registered codec ``name``: a codec's own ``levels``
    attribute when it has one, the harness/reference level tables for cachegen /
    cachegen-ref, ``[None]`` for codecs without levels (raw, fp8, quant8, kivi)."""
    import codec
    from codec import config as C

    c = codec.get_codec(name)
    own = getattr(c, "levels", None)
    if own is not None:       # the registry's own scale; () = a codec without levels
        own = list(own() if callable(own) else own)
        return own if own else [None]
    if not getattr(c, "uses_level", False) or not getattr(c, "entropy", True):
        return [None]
    variant = getattr(c, "variant", None)
    if variant == "harness":
        return sorted(C.HARNESS_LEVELS)
    if variant == "reference":
        return list(C.LEVELS)
    return [None]


def default_level(name: str) -> Optional[int]:
    """The level a codec uses when none is given (the registry's ``default_level``; None
    for codecs without levels)."""
    import codec
    from codec import config as C

    c = codec.get_codec(name)
    if hasattr(c, "default_level"):
        return c.default_level
    if name == "cachegen":
        return C.HARNESS_DEFAULT_LEVEL
    if name == "cachegen-ref":
        return C.REFERENCE_DEFAULT_LEVEL
    return None


def parse_codec_spec(spec: Optional[str]) -> list[tuple[str, Optional[int]]]:
    """``"all"``/None -> every registered codec and level (:func:`codec_levels`), raw
    last; else ``"name[:l1,l2];name2;..."`` (``;``-separated; levels optional = all).
    Raises QualityError for an unknown codec or level."""
    import codec

    out: list[tuple[str, Optional[int]]] = []
    if spec is None or spec.strip() == "all":
        names = [n for n in codec.CODECS if n != "raw"] + (["raw"] if "raw" in codec.CODECS else [])
        for n in names:
            out.extend((n, lv) for lv in codec_levels(n))
        return out
    for part in [p.strip() for p in spec.split(";") if p.strip()]:
        name, _, levels = part.partition(":")
        name = name.strip()
        if name not in codec.CODECS:
            raise QualityError(f"unknown codec '{name}' (available: {', '.join(sorted(codec.CODECS))})")
        allowed = codec_levels(name)
        if not levels.strip():
            out.extend((name, lv) for lv in allowed)
            continue
        for tok in levels.split(","):
            try:
                lv = int(tok)
            except ValueError:
                raise QualityError(f"level '{tok}' of codec '{name}' is not an integer") from None
            if lv not in allowed:
                raise QualityError(f"codec '{name}' has no level {lv} (levels: {allowed})")
            out.append((name, lv))
    return out


def _label(name: str, level: Optional[int]) -> str:
    return name if level is None else f"{name} {level}"


# ----------------------------------------------------------------------------- scores
def _row_dot(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Row-wise dot product of two ``[n, vocab]`` float64 tensors (no ``[n, vocab]`` temporary)."""
    return torch.bmm(p.unsqueeze(1), x.unsqueeze(2)).reshape(-1)


def reference_scores(ref_logits: torch.Tensor, targets: Sequence[int]) -> dict:
    """What :func:`window_scores` needs from the lossless logits, computed once per window:
    float64 probabilities ``p`` ``[n, vocab]`` and their row sums ``s``, the per-row
    ``sum_v p * logits - s * logsumexp(logits)`` (``plp``), argmax ``[n]``, targets ``[n, 1]``
    and ``ref_nll`` (mean NLL, nats). Raises ValueError on bad shapes."""
    if ref_logits.dim() != 2:
        raise ValueError(f"logits must be [n, vocab], got {tuple(ref_logits.shape)}")
    tgt = torch.as_tensor(list(targets), dtype=torch.long).reshape(-1, 1)
    if tgt.shape[0] != ref_logits.shape[0]:
        raise ValueError(f"{tgt.shape[0]} targets for {ref_logits.shape[0]} logit rows")
    x = ref_logits.to(torch.float64)
    lse = torch.logsumexp(x, dim=-1)
    p = torch.exp(x - lse.unsqueeze(1))
    s = p.sum(-1)
    return {"p": p, "s": s, "plp": _row_dot(p, x) - s * lse, "argmax": x.argmax(-1), "tgt": tgt,
            "shape": tuple(ref_logits.shape), "ref_nll": float((lse - x.gather(1, tgt).reshape(-1)).mean())}


def window_scores(ref_logits, logits: torch.Tensor, targets: Sequence[int] = ()) -> dict:
    """Paired scores of one window: decoded-KV logits against lossless-KV logits.

    ``ref_logits``, ``logits``: ``[n, vocab]`` float (row i predicts ``targets[i]``);
    ``targets``: ``n`` token ids. ``ref_logits`` may instead be the dict of
    :func:`reference_scores` (then ``targets`` is taken from it). Returns ``{"kl": mean over rows of KL(P_ref || P) in
    nats, "top1": share of rows with argmax(logits) == argmax(ref_logits), "nll": mean
    negative log-likelihood of targets under logits (nats), "ref_nll": the same under
    ref_logits}``, computed in float64 as KL = sum_v P_ref (log P_ref - log P) with
    log P = logits - logsumexp(logits) (identical logits give exactly 0). Raises ValueError on shape mismatch.
    """
    ref = ref_logits if isinstance(ref_logits, dict) else reference_scores(ref_logits, targets)
    if logits.dim() != 2 or ref["shape"] != tuple(logits.shape):
        raise ValueError(f"logits shapes differ or are not [n, vocab]: {ref['shape']} vs {tuple(logits.shape)}")
    x = logits.to(torch.float64)
    lse = torch.logsumexp(x, dim=-1)
    kl = ref["plp"] - (_row_dot(ref["p"], x) - ref["s"] * lse)
    top1 = (x.argmax(-1) == ref["argmax"]).to(torch.float64)
    return {"kl": float(kl.mean()), "top1": float(top1.mean()),
            "nll": float((lse - x.gather(1, ref["tgt"]).reshape(-1)).mean()), "ref_nll": ref["ref_nll"]}


def summarize_rows(acc: dict, n_resamples: int = 10000, seed: int = 0) -> list[dict]:
    """Rows of quality.json from per-window accumulators ``{(codec, level): {"kl": [...],
    "top1": [...], "ppl_change_pct": [...], "bytes", "dtype_bytes", "elements", ...}}``:
    means with 95% bootstrap CIs over windows (``evaluation.stats.mean_ci``)."""
    from evaluation.stats import mean_ci

    rows = []
    for (name, level), a in acc.items():
        if not a["kl"]:
            continue
        kl = mean_ci(a["kl"], n_resamples=n_resamples, seed=seed)
        top1 = mean_ci(a["top1"], n_resamples=n_resamples, seed=seed)
        ppl = mean_ci(a["ppl_change_pct"], n_resamples=n_resamples, seed=seed)
        rows.append({
            "codec": name, "level": level,
            "default": name == FAMILY_DEFAULT and level == default_level(name),
            "ratio_vs_dtype": a["dtype_bytes"] / a["bytes"],
            "bits_per_element": 8.0 * a["bytes"] / a["elements"],
            "n_windows": kl["n"],
            "kl": kl["mean"], "kl_ci": kl["ci"], "kl_sd": kl["sd"],
            "top1_agreement": top1["mean"], "top1_agreement_ci": top1["ci"],
            "ppl_change_pct": ppl["mean"], "ppl_change_pct_ci": ppl["ci"], "ppl_change_pct_sd": ppl["sd"],
            "encode_s": a["encode_s"], "decode_s": a["decode_s"], "forward_s": a["forward_s"],
            "per_window": {"kl": a["kl"], "top1": a["top1"], "ppl_change_pct": a["ppl_change_pct"]},
        })
    return rows


# ----------------------------------------------------------------------------- text quality
def run_text_quality(bundle, token_ids: Sequence[int], pairs: list[tuple[str, Optional[int]]],
                     n_windows: int, context: int, continuation: int, seed: int = 0,
                     log: Callable[[str], None] = print, batch: int = DEFAULT_BATCH) -> tuple[list[dict], dict]:
    """Paired text-fidelity measurement on ``n_windows`` windows of ``token_ids``.

    ``token_ids``: the tokenized corpus; windows of ``context + continuation`` tokens at
    :func:`kv_extraction_hf.wikitext.token_windows` offsets (seeded, non-overlapping).
    ``pairs``: (codec, level) to measure. Each window is prefilled once; per codec/level
    the KV is encoded + decoded (``codec.encode_with_stats`` / ``codec.decode_kv``) and
    only the continuation is run: ``batch`` codecs' decoded KV at a time in one batched
    forward (``kv_extraction_hf.inject.continuation_logits_batch``: each entry's logits
    are those of its own batch-1 forward bit for bit; the lossless ``raw`` row checks it on
    every window; ``forward_s`` of a row is its share of the batch's time). Returns (rows as
    :func:`summarize_rows`, info dict with offsets, skipped codecs and their reasons, the
    lossless check, timings). A codec that raises on encode/decode is skipped (reason
    printed and recorded). Raises ValueError when ``batch`` < 1.
    """
    import codec
    from kv_extraction_hf.extract import prefill_kv
    from kv_extraction_hf.inject import continuation_logits, continuation_logits_batch
    from kv_extraction_hf.wikitext import token_windows

    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    offsets = token_windows(len(token_ids), context + continuation, n_windows, seed)
    acc: dict = {p: {"kl": [], "top1": [], "ppl_change_pct": [], "bytes": 0, "dtype_bytes": 0,
                     "elements": 0, "encode_s": 0.0, "decode_s": 0.0, "forward_s": 0.0} for p in pairs}
    skipped: dict[str, str] = {}
    ref_ppl: list[float] = []
    t_prefill = t_scores = 0.0
    t0 = time.perf_counter()
    for w, off in enumerate(offsets):
        ctx = list(token_ids[off:off + context])
        cont = list(token_ids[off + context:off + context + continuation])
        t = time.perf_counter()
        k, v = prefill_kv(bundle, ctx)
        ref_logits = continuation_logits(bundle, k, v, ctx, cont)
        t_prefill += time.perf_counter() - t
        t = time.perf_counter()
        ref = reference_scores(ref_logits, cont)
        del ref_logits
        t_scores += time.perf_counter() - t
        todo = [p for p in pairs if _label(*p) not in skipped]
        for i in range(0, len(todo), batch):
            group = []                       # (pair, k2, v2, stats) decoded from the real bitstream
            for pair in todo[i:i + batch]:
                label = _label(*pair)
                a = acc[pair]
                try:
                    t1 = time.perf_counter()
                    data, stats = codec.encode_with_stats(k, v, codec=pair[0], level=pair[1])
                    t2 = time.perf_counter()
                    k2, v2 = codec.decode_kv(data)
                    t3 = time.perf_counter()
                except Exception as exc:  # noqa: BLE001 - a codec that cannot run here is skipped
                    skipped[label] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
                    log(f"  skip {label}: {skipped[label]}")
                    continue
                del data
                a["encode_s"] += t2 - t1
                a["decode_s"] += t3 - t2
                group.append((pair, k2.to(k.dtype), v2.to(v.dtype), stats))
            if not group:
                continue
            t3 = time.perf_counter()
            all_logits = continuation_logits_batch(bundle, [(g[1], g[2]) for g in group], ctx, cont)
            t4 = time.perf_counter()
            for (pair, _, _, stats), logits in zip(group, all_logits):
                a = acc[pair]
                s = window_scores(ref, logits, cont)
                a["kl"].append(s["kl"])
                a["top1"].append(s["top1"])
                a["ppl_change_pct"].append(100.0 * (math.exp(s["nll"] - s["ref_nll"]) - 1.0))
                a["bytes"] += stats["bytes"]
                a["dtype_bytes"] += stats["dtype_bytes"]
                a["elements"] += stats["elements"]
                a["forward_s"] += (t4 - t3) / len(group)
            del group, all_logits
            t_scores += time.perf_counter() - t4
        ref_ppl.append(math.exp(ref["ref_nll"]))
        log(f"  window {w + 1}/{len(offsets)} (offset {off}) done, {time.perf_counter() - t0:.0f} s")
    for label in skipped:
        acc = {p: a for p, a in acc.items() if _label(*p) != label}
    rows = summarize_rows(acc)
    lossless = [r for r in rows if r["codec"] == "raw"]
    check = None
    if lossless:
        r = lossless[0]
        check = {"max_kl": max(r["per_window"]["kl"]), "min_top1": min(r["per_window"]["top1"]),
                 "passed": max(r["per_window"]["kl"]) == 0.0 and min(r["per_window"]["top1"]) == 1.0}
    info = {"offsets": offsets, "skipped": skipped, "lossless_check": check,
            "reference_ppl_mean": float(np.mean(ref_ppl)) if ref_ppl else None,
            "prefill_s": t_prefill, "scores_s": t_scores, "batch": batch, "total_s": time.perf_counter() - t0}
    return rows, info


# ----------------------------------------------------------------------------- tasks
def task_requests(n: int, seed: int = 0, lengths: Sequence[int] = TASK_LENGTHS,
                  tasks: Sequence[str] = TASKS, topic_lengths: Sequence[int] = TOPIC_LENGTHS
                  ) -> list[tuple[str, int, int]]:
    """``n`` (task, context_tokens, index) requests: tasks alternate; needle lengths cycle
    through ``lengths`` and its depths through 10-90% with the index (every length meets
    every depth); topic retrieval cycles through ``topic_lengths``."""
    out = []
    for i in range(n):
        task = tasks[i % len(tasks)]
        j = i // len(tasks)
        ls = topic_lengths if task == "topic_retrieval" else lengths
        out.append((task, ls[j % len(ls)], seed * 100000 + j))
    return out


def _answer_text(bundle, ids: list[int]) -> str:
    return bundle.tokenizer.decode(ids, skip_special_tokens=True)


def run_tasks(bundle, pairs: list[tuple[str, Optional[int]]], n_requests: int, seed: int = 0,
              lengths: Sequence[int] = TASK_LENGTHS, max_new_tokens: int = TASK_MAX_NEW_TOKENS,
              topic_lengths: Sequence[int] = TOPIC_LENGTHS, answer_bundle=None, verify: bool = False,
              log: Callable[[str], None] = print) -> tuple[list[dict], dict]:
    """Task answers from decoded KV vs lossless KV, ``n_requests`` per codec/level.

    Each request's context is prefilled once by ``bundle`` (the engine dtype, bf16 for the
    default model: the KV the codecs compress). Answers are greedy, at most
    ``max_new_tokens``, computed by ``answer_bundle`` (the same model with other activation
    dtype, e.g. float32; None = ``bundle``) on the KV cast exactly to its dtype: the
    lossless answer by ``kv_extraction_hf.inject.generate_from_kv``, each codec's by
    ``kv_extraction_hf.inject.answer_from_kv`` (one teacher-forced forward checks the
    lossless answer; greedy generation continues only from where it differs; positions
    with a top-2 logit margin below the dtype's threshold fall back to plain greedy
    generation). ``verify``: also run plain ``generate_from_kv`` for every codec and count
    answers that differ from the fast path (a proof run; doubles the cost).

    Accuracy: ``evaluation.retrieval_accuracy`` against the gold answer; agreement: the
    scored answer (``evaluation.scored_answer``: the number the scorer reads, or whether
    the gold phrase occurs) equals the lossless answer's; token_agreement: the generated
    token ids equal the lossless ones (strict: any difference in the first
    ``max_new_tokens`` tokens counts, so a rephrasing of the same answer disagrees). All with Wilson 95% CIs, per task and over all
    tasks (``task`` = "all"). Returns (rows, info with the per-request records and
    seconds, per codec the count of answers by path, the verify counts).
    """
    import codec
    from evaluation import retrieval_accuracy, scored_answer
    from evaluation.stats import wilson_ci
    from kv_extraction_hf.extract import prefill_kv
    from kv_extraction_hf.inject import answer_from_kv, generate_from_kv, teacher_forcing_margin
    from kv_extraction_hf.prompts import build_prompt

    ab = answer_bundle if answer_bundle is not None else bundle
    adt = next(ab.model.parameters()).dtype
    margin = teacher_forcing_margin(adt)
    records: list[dict] = []
    skipped: dict[str, str] = {}
    paths: dict[str, dict[str, int]] = {}
    checked = mismatches = 0
    t0 = time.perf_counter()
    for r, (task, length, index) in enumerate(task_requests(n_requests, seed, lengths,
                                                                      topic_lengths=topic_lengths)):
        p = build_prompt(task, bundle.tokenizer, length, seed=seed, index=index)
        t = time.perf_counter()
        k, v = prefill_kv(bundle, p.context_ids)
        t1 = time.perf_counter()
        budget = min(max_new_tokens, p.max_new_tokens)
        ref_ids = generate_from_kv(ab, k.to(adt), v.to(adt), p.context_ids, p.question_ids, budget)
        ref_text = _answer_text(bundle, ref_ids)
        rec = {"task": task, "context_tokens": len(p.context_ids), "index": index,
               "depth": p.meta.get("depth"), "answer": p.answer,
               "lossless": {"text": ref_text, "tokens": len(ref_ids),
                            "correct": bool(retrieval_accuracy(ref_text, p.answer))},
               "seconds": {"prefill": t1 - t, "lossless_answer": time.perf_counter() - t1},
               "codecs": {}}
        for pair in pairs:
            label = _label(*pair)
            if label in skipped:
                continue
            try:
                t2 = time.perf_counter()
                k2, v2 = codec.decode_kv(codec.encode_kv(k, v, codec=pair[0], level=pair[1]))
                k2, v2 = k2.to(k.dtype).to(adt), v2.to(v.dtype).to(adt)   # the engine's dtype, then exact upcast
            except Exception as exc:  # noqa: BLE001
                skipped[label] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
                log(f"  skip {label}: {skipped[label]}")
                continue
            t3 = time.perf_counter()
            got = answer_from_kv(ab, k2, v2, p.context_ids, p.question_ids, ref_ids, budget, min_margin=margin)
            t4 = time.perf_counter()
            ids = got["ids"]
            text = _answer_text(bundle, ids)
            c = {"codec": pair[0], "level": pair[1], "text": text,
                 "correct": bool(retrieval_accuracy(text, p.answer)),
                 "agrees": scored_answer(text, p.answer) == scored_answer(ref_text, p.answer),
                 "token_agrees": ids == ref_ids,
                 "path": got["path"], "diverged_at": got["diverged_at"],
                 "min_margin": got["min_margin"] if math.isfinite(got["min_margin"]) else None,
                 "codec_s": t3 - t2, "answer_s": t4 - t3}
            paths.setdefault(label, {"teacher-forced": 0, "continued": 0, "fallback": 0})[got["path"]] += 1
            if verify:
                plain = generate_from_kv(ab, k2, v2, p.context_ids, p.question_ids, budget)
                checked += 1
                mismatches += plain != ids
                c["verified"] = plain == ids
            rec["codecs"][label] = c
        records.append(rec)
        log(f"  request {r + 1}/{n_requests} ({task}, {len(p.context_ids)} tokens) done, "
            f"{time.perf_counter() - t0:.0f} s")
    rows = []
    groups = [("all", records)] + [(t, [x for x in records if x["task"] == t]) for t in TASKS]
    for task, recs in groups:
        if not recs:
            continue
        n = len(recs)
        ok = sum(x["lossless"]["correct"] for x in recs)
        rows.append({"codec": "lossless", "level": None, "task": task, "n": n, "accuracy": ok / n,
                     "accuracy_ci": list(wilson_ci(ok, n)), "agreement": 1.0, "agreement_ci": [1.0, 1.0],
                     "token_agreement": 1.0, "token_agreement_ci": [1.0, 1.0]})
        for pair in pairs:
            label = _label(*pair)
            if label in skipped:
                continue
            got = [x["codecs"][label] for x in recs if label in x["codecs"]]
            if not got:
                continue
            m = len(got)
            c = sum(g["correct"] for g in got)
            a = sum(g["agrees"] for g in got)
            ta = sum(g["token_agrees"] for g in got)
            rows.append({"codec": pair[0], "level": pair[1], "task": task, "n": m,
                         "accuracy": c / m, "accuracy_ci": list(wilson_ci(c, m)),
                         "agreement": a / m, "agreement_ci": list(wilson_ci(a, m)),
                         "token_agreement": ta / m, "token_agreement_ci": list(wilson_ci(ta, m)),
                         "default": pair[0] == FAMILY_DEFAULT and pair[1] == default_level(pair[0])})
    info = {"requests": records, "skipped": skipped, "total_s": time.perf_counter() - t0,
            "lengths": list(lengths), "topic_lengths": list(topic_lengths), "max_new_tokens": max_new_tokens,
            "answer_dtype": str(adt).replace("torch.", ""), "min_margin": margin, "answer_paths": paths,
            "fallbacks": sum(x["fallback"] for x in paths.values()),
            "verify": {"checked": checked, "mismatches": mismatches} if verify else None,
            "agreement_rule": ("agreement: the scored answer (evaluation.scored_answer: the last number for a "
                               "numeric answer, else whether the gold answer occurs) equals the lossless "
                               "answer's; token_agreement: generated token ids identical to the lossless "
                               "answer's")}
    return rows, info


# ----------------------------------------------------------------------------- default rule
def choose_default_level(doc: dict, family: str = FAMILY_DEFAULT, reference: tuple = REFERENCE,
                         n_resamples: int = 10000, seed: int = 0) -> dict:
    """The default-level rule on a quality.json document.

    Among ``family``'s rows measured on the same windows as ``reference`` (LMCache's
    schedule), a level qualifies when it is no worse than the reference within the 95%
    paired bootstrap CI: CI of per-window (KL_level - KL_ref) has lower end <= 0, and CI of
    per-window (top1_level - top1_ref) has upper end >= 0. The choice is the qualifying
    level with the largest ratio_vs_dtype (smallest size). Returns ``{"level", "ratio_vs_dtype",
    "candidates": [...], "rule"}`` (level None when none qualifies). Raises QualityError
    when the reference row or per-window values are missing or the windows differ.
    """
    from evaluation.stats import bootstrap_ci

    rows = doc.get("rows") or []
    ref = [r for r in rows if r.get("codec") == reference[0] and r.get("level") == reference[1]]
    if not ref or "per_window" not in ref[0]:
        raise QualityError(f"quality results lack the reference row {reference[0]} level {reference[1]} "
                           "with per-window values")
    ref = ref[0]
    cands = []
    for r in rows:
        if r.get("codec") != family or "per_window" not in r:
            continue
        if len(r["per_window"]["kl"]) != len(ref["per_window"]["kl"]):
            raise QualityError(f"{family} {r['level']} and the reference were measured on different windows")
        dkl = np.asarray(r["per_window"]["kl"]) - np.asarray(ref["per_window"]["kl"])
        dtop = np.asarray(r["per_window"]["top1"]) - np.asarray(ref["per_window"]["top1"])
        kl_ci = bootstrap_ci(dkl, n_resamples=n_resamples, seed=seed)
        top_ci = bootstrap_ci(dtop, n_resamples=n_resamples, seed=seed)
        ok = kl_ci[0] <= 0.0 and top_ci[1] >= 0.0
        cands.append({"level": r["level"], "ratio_vs_dtype": r["ratio_vs_dtype"], "kl": r["kl"],
                      "top1_agreement": r["top1_agreement"], "kl_diff_ci": list(kl_ci),
                      "top1_diff_ci": list(top_ci), "qualifies": ok})
    cands.sort(key=lambda c: -c["ratio_vs_dtype"])
    best = next((c for c in cands if c["qualifies"]), None)
    return {"level": best["level"] if best else None,
            "ratio_vs_dtype": best["ratio_vs_dtype"] if best else None,
            "reference": {"codec": reference[0], "level": reference[1], "ratio_vs_dtype": ref["ratio_vs_dtype"],
                          "kl": ref["kl"], "top1_agreement": ref["top1_agreement"]},
            "candidates": cands,
            "rule": "smallest size whose 95% paired bootstrap CI of (KL - KL_ref) reaches <= 0 and of "
                    "(top1 - top1_ref) reaches >= 0, on the same windows"}


# ----------------------------------------------------------------------------- output
def _fmt_ci(x: float, ci: Sequence[float], digits: int = 4) -> str:
    return f"{x:.{digits}f} [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def print_table(rows: list[dict], out=None) -> None:
    """The text-fidelity table (ppl change labelled as not monotone in distortion)."""
    print(f"{'codec / level':<18} {'ratio':>7} {'bits/el':>7}  {'n':>3}  {'KL nats/token [95% CI]':<28} "
          f"{'top-1 agreement [95% CI]':<26} {'ppl change % [95% CI] (not monotone)':<30}", file=out)
    for r in sorted(rows, key=lambda r: (r["codec"], -1 if r["level"] is None else r["level"])):
        label = _label(r["codec"], r["level"]) + (" *" if r.get("default") else "")
        print(f"{label:<18} {r['ratio_vs_dtype']:>6.2f}x {r['bits_per_element']:>7.3f}  {r['n_windows']:>3}  "
              f"{_fmt_ci(r['kl'], r['kl_ci']):<28} {_fmt_ci(r['top1_agreement'], r['top1_agreement_ci'], 3):<26} "
              f"{_fmt_ci(r['ppl_change_pct'], r['ppl_change_pct_ci'], 1):<30}", file=out)
    print("* = default codec/level. KL and top-1 agreement are against the lossless KV on the same windows; "
          "rank by them, not by ppl change.", file=out)


def print_task_table(rows: list[dict], out=None) -> None:
    print(f"{'codec / level':<18} {'task':<16} {'n':>4}  {'accuracy [Wilson 95%]':<24} "
          f"{'answer agreement [Wilson 95%]':<30} {'token agreement [Wilson 95%]':<30}", file=out)
    for r in rows:
        tok = (_fmt_ci(r["token_agreement"], r["token_agreement_ci"], 3)
               if r.get("token_agreement") is not None else "-")
        print(f"{_label(r['codec'], r['level']):<18} {r['task']:<16} {r['n']:>4}  "
              f"{_fmt_ci(r['accuracy'], r['accuracy_ci'], 3):<24} {_fmt_ci(r['agreement'], r['agreement_ci'], 3):<30} "
              f"{tok:<30}", file=out)
    print("answer agreement: the scored answer equals the lossless answer's; token agreement: identical "
          "token ids (a rephrasing disagrees).", file=out)


def print_task_paths(info: dict, out=None) -> None:
    """How the task answers were obtained (teacher-forced / continued / fallback per codec),
    the verify counts when present, and the mean seconds per request."""
    n = len(info["requests"])
    print(f"answers ({info['answer_dtype']} activations, fallback below a top-2 margin of {info['min_margin']:g}): "
          + "; ".join(f"{lab}: {d['teacher-forced']} verified, {d['continued']} continued, {d['fallback']} fallback"
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


def environment() -> dict:
    """Versions, CPU count and torch threads of this run."""
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "numpy": np.__version__,
            "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads()}


def prepare_kvtc(bundle, data_path: Optional[str], log: Callable[[str], None] = print) -> dict:
    """Make the KVTC codec usable: its default calibration for ``bundle``'s model, fitted on
    WikiText-2 VALIDATION (never on the test split evaluated here) by
    ``kv_extraction_hf.calibrate.default_calibration`` (cached after the first fit) and
    registered. Returns a record (path, sha256 of the artifact, calibration text source) or
    ``{"error": ...}``; a failure only means the kvtc rows are skipped."""
    try:
        from kv_extraction_hf.calibrate import default_calibration
        from kv_extraction_hf.model import sha256_file
        from kv_extraction_hf.wikitext import load_wikitext2_split

        valid = load_wikitext2_split("valid", None if data_path is None else data_path)
        path = default_calibration(bundle, text=valid.text, data_name=f"WikiText-2 valid ({valid.sha256[:12]})",
                                   log=lambda m: None)
        return {"path_name": Path(path).name, "sha256": sha256_file(path), "data": valid.record()}
    except Exception as exc:  # noqa: BLE001 - kvtc is optional here
        reason = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        log(f"kvtc calibration unavailable ({reason}): kvtc rows will be skipped")
        return {"error": reason}


def _write_json(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)   # never a half-written file


# ----------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.quality",
        description="Quality of decoded KV vs lossless KV on WikiText-2 test (KL, top-1 agreement, ppl "
                    "change, 95% bootstrap CIs) and task answers (accuracy and agreement with the lossless "
                    "answer, Wilson 95% CIs). Default: 32 windows x (2048 + 256) tokens for every registered "
                    "codec and level (continuations of --batch codecs per forward), then 60 task requests (30 "
                    "needle 1K-4K tokens, 30 topic retrieval 512 tokens) for " + DEFAULT_TASK_CODECS
                    + ". The committed default run took 21.0 min on 2 quiet cores before the fused quantizer "
                    "and the batched forwards; ~17-18 min estimated now (docs/codec.md section 5b). --quick: "
                    "a smoke run, 4 windows x (512 + 128) tokens + 4 requests of 512-1024 tokens.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 4 windows x (512 + 128) tokens and 4 task requests (needle 512/1024 tokens, "
                        "topic 512); too few samples to rank codecs")
    p.add_argument("--windows", type=int, default=None, help="number of windows (default 32; quick 4)")
    p.add_argument("--context", type=int, default=None, help="context tokens per window (default 2048; quick 512)")
    p.add_argument("--continuation", type=int, default=None,
                   help="continuation tokens per window (default 256; quick 128)")
    p.add_argument("--seed", type=int, default=0, help="seed of the window offsets / task prompts (default 0)")
    p.add_argument("--codecs", default="all",
                   help="'all' (every registered codec and level) or 'name[:l1,l2];name2' (default all)")
    p.add_argument("--data-path", default=None,
                   help="folder with WikiText-2 test.txt / wiki.test.raw (default: the hub if reachable, "
                        "else a shared/data/wikitext-2 folder beside the repository)")
    p.add_argument("--batch", type=int, default=DEFAULT_BATCH,
                   help="codecs whose continuation runs in one batched forward (default %(default)s; each "
                        "codec's logits are those of its own batch-1 forward, bit for bit; 1 = one forward "
                        "per codec, least memory)")
    p.add_argument("--model", default=None, help="model spec (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results file (default benchmarks/quality.json)")
    p.add_argument("--tasks", action="store_true", help=argparse.SUPPRESS)   # tasks are measured by default now
    p.add_argument("--no-tasks", action="store_true", help="skip the task answers (text fidelity only)")
    p.add_argument("--tasks-only", action="store_true",
                   help="only task answers; keep the text rows already in --out")
    p.add_argument("--task-requests", type=int, default=None,
                   help=f"requests per codec/level (default 60; quick {QUICK_TASK_REQUESTS})")
    p.add_argument("--task-codecs", default=DEFAULT_TASK_CODECS, help="codecs/levels for tasks (default %(default)s)")
    p.add_argument("--task-dtype", choices=("float32", "model"), default="float32",
                   help="activation dtype of the answer forwards: float32 (default; the bf16 KV is upcast "
                        "exactly; batched and token-by-token forwards agree to ~1e-4 logits, so teacher forcing "
                        "rarely falls back) or model (the engine's bf16: they differ by up to ~0.75 logits, "
                        "many answers fall back to plain greedy generation)")
    p.add_argument("--task-verify", action="store_true",
                   help="also generate every codec answer by plain greedy decoding and count mismatches with "
                        "the teacher-forced fast path (proof run; about doubles the task time)")
    p.add_argument("--task-lengths", default=None,
                   help="comma-separated needle context lengths (default 1024,2048,3072,4096; quick 512,1024)")
    p.add_argument("--topic-lengths", default=None,
                   help="comma-separated topic-retrieval context lengths (default 512: at chance above 1K)")
    p.add_argument("--choose-default", action="store_true",
                   help="print the default cachegen level chosen by the rule from --out and exit")
    return p


def _log(msg: str) -> None:
    print(msg, flush=True)   # progress lines show up at once when stdout is a file


def _positive(name: str, v: int) -> int:
    if v is None or v <= 0:
        raise QualityError(f"{name} must be a positive integer, got {v}")
    return v


def _print_choice(choice: dict) -> None:
    ref = choice["reference"]
    print(f"reference {ref['codec']} {ref['level']}: {ref['ratio_vs_dtype']:.2f}x, KL {ref['kl']:.4f}, "
          f"top-1 {ref['top1_agreement']:.3f}")
    for c in choice["candidates"]:
        print(f"  {FAMILY_DEFAULT} {c['level']}: {c['ratio_vs_dtype']:.2f}x  KL {c['kl']:.4f} "
              f"(diff CI [{c['kl_diff_ci'][0]:+.4f}, {c['kl_diff_ci'][1]:+.4f}])  top-1 {c['top1_agreement']:.3f} "
              f"(diff CI [{c['top1_diff_ci'][0]:+.3f}, {c['top1_diff_ci'][1]:+.3f}])  "
              f"{'qualifies' if c['qualifies'] else 'worse'}")
    print(f"rule: {choice['rule']}")
    if choice["level"] is None:
        print("chosen default level: none qualifies")
    else:
        print(f"chosen default level: {FAMILY_DEFAULT} {choice['level']} ({choice['ratio_vs_dtype']:.2f}x)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:]) if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        return _main(args, argv)
    except (QualityError, ValueError) as exc:   # ExtractionError is a ValueError
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


def _main(args, argv: list[str]) -> int:
    if args.choose_default:
        if not args.out.is_file():
            raise QualityError(f"no quality results at {args.out}: run python -m bench.quality first")
        try:
            doc = json.loads(args.out.read_text())
        except json.JSONDecodeError as exc:
            raise QualityError(f"{args.out} is not valid JSON: {exc}") from None
        _print_choice(choose_default_level(doc))
        return 0
    from kv_extraction_hf.model import load_model
    from kv_extraction_hf.wikitext import load_wikitext2_split

    windows = _positive("--windows", args.windows if args.windows is not None else (4 if args.quick else 32))
    context = _positive("--context", args.context if args.context is not None else (512 if args.quick else 2048))
    continuation = _positive("--continuation", args.continuation if args.continuation is not None
                             else (QUICK_CONTINUATION if args.quick else 256))
    pairs = parse_codec_spec(args.codecs)
    if args.no_tasks and args.tasks_only:
        raise QualityError("--no-tasks and --tasks-only exclude each other")
    do_tasks = not args.no_tasks
    task_pairs = parse_codec_spec(args.task_codecs) if do_tasks else []
    n_req = _positive("--task-requests", args.task_requests if args.task_requests is not None
                      else (QUICK_TASK_REQUESTS if args.quick else 60))
    try:
        lengths = tuple(int(x) for x in args.task_lengths.split(",")) if args.task_lengths else \
            ((512, 1024) if args.quick else TASK_LENGTHS)
        topic_lengths = tuple(int(x) for x in args.topic_lengths.split(",")) if args.topic_lengths \
            else TOPIC_LENGTHS
    except ValueError:
        raise QualityError("--task-lengths / --topic-lengths must be comma-separated integers") from None
    previous = None
    if args.tasks_only and args.out.is_file():
        try:
            previous = json.loads(args.out.read_text())
        except json.JSONDecodeError:
            previous = None
    wt = None if args.tasks_only else load_wikitext2_split("test", args.data_path)   # fails before the model
    t_start = time.perf_counter()
    bundle = load_model(args.model, log=lambda m: None)
    doc: dict[str, Any] = previous if previous else {"rows": [], "tasks": []}
    doc.update({
        "kind": "quality", "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        ("tasks_command" if args.tasks_only else "command"): " ".join(["python -m bench.quality"] + argv),
        "model": {"id": bundle.info.model_id, "weights_hash": bundle.info.weights_hash,
                  "dtype": bundle.info.dtype, "num_layers": bundle.info.num_layers},
        "environment": environment()})
    if any(name == "kvtc" for name, _ in pairs + task_pairs):
        doc["kvtc_calibration"] = prepare_kvtc(bundle, args.data_path)
    if wt is not None:
        print(f"data: WikiText-2 {wt.split} from {wt.source} ({wt.location}), sha256 {wt.sha256}")
        ids = bundle.tokenizer(wt.text)["input_ids"]
        print(f"{len(ids)} tokens; {windows} windows x ({context} + {continuation}); "
              f"{len(pairs)} codec/levels")
        rows, info = run_text_quality(bundle, ids, pairs, windows, context, continuation, args.seed,
                                       log=_log, batch=_positive("--batch", args.batch))
        doc["rows"] = rows
        doc["data"] = dict(wt.record(), tokens=len(ids), corpus="WikiText-2 (Merity et al. 2016), CC BY-SA 3.0")
        doc["config"] = {"n_windows": windows, "context_tokens": context, "continuation_tokens": continuation,
                         "seed": args.seed, "codecs": args.codecs, "quick": bool(args.quick),
                         "window_offsets": info["offsets"], "ci": "95% percentile bootstrap over windows, "
                         "10000 resamples, seed 0 (exact enumeration for n <= 7)"}
        doc["text_info"] = {k: info[k] for k in ("skipped", "lossless_check", "reference_ppl_mean",
                                                 "prefill_s", "scores_s", "batch", "total_s")}
        print()
        print_table(rows)
        chk = info["lossless_check"]
        if chk is not None:
            print(f"lossless check (raw): max KL {chk['max_kl']:.3g}, min top-1 {chk['min_top1']:.3f} -> "
                  f"{'passed' if chk['passed'] else 'FAILED'}")
        for label, why in info["skipped"].items():
            print(f"skipped {label}: {why}")
    if do_tasks:
        print(f"tasks: {n_req} requests per codec/level ({', '.join(TASKS)}; needle lengths {list(lengths)}, "
              f"topic lengths {list(topic_lengths)}); "
              f"{len(task_pairs)} codec/levels")
        answer_bundle = bundle
        if args.task_dtype == "float32" and bundle.info.dtype != "float32":
            answer_bundle = load_model(args.model, dtype="float32", log=lambda m: None)
        trows, tinfo = run_tasks(bundle, task_pairs, n_req, args.seed, lengths, topic_lengths=topic_lengths,
                                 answer_bundle=answer_bundle, verify=args.task_verify, log=_log)
        doc["tasks"] = trows
        doc["tasks_info"] = {k: v for k, v in tinfo.items()}
        doc["tasks_config"] = {"n_requests": n_req, "lengths": list(lengths), "topic_lengths": list(topic_lengths),
                               "codecs": args.task_codecs, "answer_dtype": tinfo["answer_dtype"],
                               "kv_dtype": bundle.info.dtype, "verify": bool(args.task_verify),
                               "seed": args.seed, "ci": "Wilson 95%"}
        print()
        print_task_table(trows)
        print_task_paths(tinfo)
    doc["wall_s"] = time.perf_counter() - t_start
    _write_json(args.out, doc)
    print(f"\nwrote {args.out} ({doc['wall_s']:.0f} s)")
    if doc.get("rows") and any(r["codec"] == REFERENCE[0] and r["level"] == REFERENCE[1] for r in doc["rows"]) \
            and any(r["codec"] == FAMILY_DEFAULT for r in doc["rows"]):
        print()
        _print_choice(choose_default_level(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
