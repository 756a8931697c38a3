"""Metrics for the CacheGen harness: task accuracy, LongBench F1, ROUGE-L, BLEU, perplexity, KL, greedy match.

Pure functions (strings, numbers or torch tensors in; Python numbers out) looked up by
name from :data:`evaluation.metrics.METRICS`. No model, engine or network. See
``evaluation/metrics/`` for sources (LongEval, LongBench, CacheGen section 7.1).

Run the tests: ``python -m pytest tests/evaluation/test_evaluation_metrics.py -q``
"""

from evaluation.metrics import (
    METRICS,
    Metric,
    UnknownMetricError,
    aggregate,
    bleu,
    get_metric,
    greedy_match,
    kl_divergence,
    list_metrics,
    result_metrics,
    mean_stderr,
    median,
    normalize_answer,
    perplexity,
    ppl_increase_pct,
    qa_f1,
    quantile,
    register_metric,
    retrieval_accuracy,
    scored_answer,
    rouge_l,
)

__all__ = [
    "METRICS",
    "Metric",
    "UnknownMetricError",
    "aggregate",
    "bleu",
    "get_metric",
    "greedy_match",
    "kl_divergence",
    "list_metrics",
    "result_metrics",
    "mean_stderr",
    "median",
    "normalize_answer",
    "perplexity",
    "ppl_increase_pct",
    "qa_f1",
    "quantile",
    "register_metric",
    "retrieval_accuracy",
    "scored_answer",
    "rouge_l",
]
