"""Quality of every run (stage 4 of ``run_benchmarks.py``).

Task score (retrieval accuracy or LongBench F1, as the prompt names it) and fidelity to
the lossless (text) output (ROUGE-L, BLEU, greedy match) of each request, driven by the
metric registry (:data:`evaluation.metrics.METRICS`: each metric declares its inputs,
direction and aggregation); perplexity increase and KL of a held-out continuation with
the decoded KV (HF engine, natural-text contexts).
Paper: CacheGen (Liu et al., SIGCOMM 2024) section 7.1 (quality metrics).
Run: ``python run_benchmarks.py`` (``--no-quality`` skips the perplexity pass).
"""
from __future__ import annotations

import sys
from typing import Any

import torch
from tqdm import tqdm

import codec as codec_pkg
from evaluation import metrics as M
from evaluation.summary import aggregate_metric, plot_label
from harness.config import RunConfig
from harness.contexts import KV_MODES, Variant, failure_record, log, one_line
from kv_extraction_hf.extract import prefill_kv
from kv_extraction_hf.inject import continuation_logits
from kv_extraction_hf.prompts import build_prompt

PPL_TASK = "pydoc_ppl"
"""Natural-text contexts (offline) whose held-out continuation gives perplexity and KL."""


def score_output(prompt, output_text: str, output_ids: list[int], ref_text: str | None,
                 ref_ids: list[int] | None) -> dict[str, Any]:
    """Task score of one output + its fidelity to the lossless output.

    Every registered metric with a results column is computed when all of its declared
    inputs exist (task metrics only when ``prompt.metric`` names them); the others are
    None. Returns the run record's ``quality`` object (docs/results-schema.md).
    """
    inputs = {"prediction": output_text, "answer": prompt.answer,
              "answers": list(prompt.answers or [prompt.answer]), "reference": ref_text,
              "tokens": output_ids, "tokens_ref": ref_ids}
    q: dict[str, Any] = {}
    for m in M.result_metrics():
        q[m.column] = None
        if not m.inputs or (m.task and m.name != prompt.metric):
            continue
        args = [inputs[name] for name in m.inputs]
        if any(a is None for a in args):
            continue
        value = m.fn(*args)
        q[m.column] = bool(value) if m.aggregation == "share" else float(value)
    return q


def rel_l2_rows(var: Variant, k, v, k2, v2) -> list[dict]:
    """codec_layers rows: relative L2 error per layer of K and V (``[L, T, H, D]`` tensors)."""
    rows = []
    for kv_name, a, b in (("k", k, k2), ("v", v, v2)):
        for layer in range(a.shape[0]):
            x, y = a[layer].float(), b[layer].float()
            rel = float((x - y).norm() / x.norm().clamp_min(1e-12))
            rows.append({"mode": var.mode, "level": var.level, "layer": layer,
                         "kv": kv_name, "rel_l2": rel})
    return rows


def perplexity_pass(cfg: RunConfig, bundle, vlist: list[Variant],
                    configs: dict[str, Any] | None = None,
                    failures: list[dict] | None = None,
                    layout: tuple[list | None, int] = (None, 0)) -> tuple[dict, list[dict]]:
    """Perplexity increase and KL of a held-out continuation per variant (HF engine).
    ``layout``: the store's (windows, extra_tokens) (harness.contexts.store_layout): with
    windows the KV is coded in the sliding-window layout the store serves.

    Returns ({label: {"ppl_increase_pct", "kl"}} aggregated over the natural-text contexts
    by the registry's rule (medians), codec_layers rows (relative L2 per layer of the
    first context)). ``configs``: codec name -> the config its encodes get (kvtc: its
    ``KvtcConfig`` naming the calibration). A variant whose encode or decode fails
    (ValueError, incl. codec.CodecError: e.g. a decoded KV with NaN) is left out of the
    pass from then on: its reason goes to ``failures`` (a ``failure_record``, stage
    "perplexity") and to a one-line log; without a ``failures`` list it is raised.
    """
    configs = configs or {}
    kv_variants = [v for v in vlist if v.mode in KV_MODES]
    per: dict[str, list[tuple[float, float]]] = {v.label: [] for v in kv_variants}
    failed: set[str] = set()
    layers: list[dict] = []
    for i in tqdm(range(cfg.ppl_contexts), desc="perplexity", unit="ctx", file=sys.stderr):
        p = build_prompt(PPL_TASK, bundle.tokenizer, cfg.ppl_context_tokens, seed=cfg.seed, index=i)
        k, v = prefill_kv(bundle, p.context_ids)
        cont = torch.tensor(p.continuation_ids, dtype=torch.long)
        ref_logits = continuation_logits(bundle, k, v, p.context_ids, p.continuation_ids)
        ppl_ref = M.perplexity(ref_logits, cont)  # row i predicts continuation_ids[i]
        for var in kv_variants:
            if var.label in failed:
                continue
            try:
                if layout[0] is not None:
                    from codec import window

                    chunks = window.encode_windowed_chunks(k, v, layout[0], codec=var.codec, level=var.level,
                                                           config=configs.get(var.codec),
                                                           chunk_tokens=cfg.chunk_tokens, extra_tokens=layout[1])
                    k2, v2 = window.decode_windowed_chunks(chunks).dense()
                else:
                    chunks = codec_pkg.encode_chunks(k, v, codec=var.codec, level=var.level,
                                                     config=configs.get(var.codec),
                                                     chunk_tokens=cfg.chunk_tokens)
                    k2, v2 = codec_pkg.decode_chunks(chunks)
            except ValueError as exc:
                if failures is None:
                    raise
                reason = one_line(exc)
                log(f"{var.label}: perplexity pass failed: {reason} (its ppl/KL are left "
                    f"empty, the run goes on)")
                failures.append(failure_record("perplexity", var.mode, var.level, reason,
                                               context_index=i))
                failed.add(var.label)
                per[var.label] = []
                continue
            logits = continuation_logits(bundle, k2, v2, p.context_ids, p.continuation_ids)
            ppl = M.perplexity(logits, cont)
            per[var.label].append((M.ppl_increase_pct(ppl, ppl_ref), M.kl_divergence(ref_logits, logits)))
            if i == 0:
                kr, vr = k, v
                if layout[0] is not None:    # per-layer error over the tokens the layout keeps
                    from codec.window import kept_tokens

                    kr, vr = k.clone(), v.clone()
                    T = k.shape[1]
                    for j, w in enumerate(layout[0]):
                        drop = T - kept_tokens(T, w, layout[1])
                        kr[j, :drop] = 0
                        vr[j, :drop] = 0
                layers.extend(rel_l2_rows(var, kr, vr, k2, v2))
    ppl_m, kl_m = M.get_metric("ppl_increase_pct"), M.get_metric("kl_divergence")
    out = {lab: {ppl_m.column: aggregate_metric(ppl_m, [a for a, _ in rows]),
                 kl_m.column: aggregate_metric(kl_m, [b for _, b in rows])}
           for lab, rows in per.items() if rows}
    return out, [r for r in layers if plot_label(r["mode"], r["level"]) not in failed]
