"""Quality and fidelity metrics for the KV-cache benchmarks (numbers in, numbers out).

Purpose: score what a request produced when its context came back through a lossy KV
codec, against the task's answer (task skill) or against the lossless run (fidelity).
Implements the quality side of CacheGen's evaluation (Liu et al., SIGCOMM 2024, the
evaluation's quality metrics): LongChat line retrieval accuracy as LongEval scores it, token-level F1 as
LongBench scores TriviaQA/NarrativeQA, perplexity as on WikiText, plus the fidelity
metrics that need no task skill (KL divergence of next-token distributions, share of
greedy tokens identical to the lossless run, ROUGE-L and BLEU against the lossless
generation). Source: CacheGen (Liu et al., SIGCOMM 2024) section 7.1 (quality metrics).

This module knows no model, engine or network. Metrics are plain functions registered
by name with ``higher_is_better`` (as lm-evaluation-harness does); look them up with
:func:`get_metric`. Aggregations (median, quartiles, mean with standard error) are in
:func:`aggregate`.

Run its tests:  ``python -m pytest tests/evaluation/test_evaluation_metrics.py -q``
Example:        ``python -c "from evaluation import qa_f1; print(qa_f1('The Eiffel Tower', ['eiffel tower']))"``

The metrics live by kind, each registered on import: evaluation.metrics.answer (task
answers: retrieval_accuracy, qa_f1), evaluation.metrics.generation (rouge_l, bleu),
evaluation.metrics.logits (perplexity, ppl_increase_pct, kl_divergence, greedy_match),
evaluation.metrics.aggregate (median, quantile, mean_stderr, aggregate); the registry is
evaluation.metrics.registry. This package face exports all of them (importing it registers
every metric, in this order).
"""

from __future__ import annotations

from evaluation.metrics.aggregate import aggregate, mean_stderr, median, quantile
from evaluation.metrics.answer import (
    all_values_match,
    normalize_answer,
    qa_f1,
    retrieval_accuracy,
    scored_answer,
    stated_topics,
    stated_values,
)
from evaluation.metrics.generation import bleu, rouge_l
from evaluation.metrics.logits import (
    greedy_match,
    kl_divergence,
    perplexity,
    ppl_increase_pct,
)
from evaluation.metrics.registry import (
    AGGREGATIONS, Metric, METRICS, UnknownMetricError, register_metric, result_metrics,
    list_metrics, get_metric,
)

__all__ = [
    "Metric",
    "METRICS",
    "UnknownMetricError",
    "register_metric",
    "get_metric",
    "list_metrics",
    "result_metrics",
    "AGGREGATIONS",
    "normalize_answer",
    "retrieval_accuracy",
    "all_values_match",
    "stated_values",
    "stated_topics",
    "qa_f1",
    "rouge_l",
    "bleu",
    "perplexity",
    "ppl_increase_pct",
    "kl_divergence",
    "greedy_match",
    "median",
    "quantile",
    "mean_stderr",
    "aggregate",
]
