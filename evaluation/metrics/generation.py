"""Fidelity of a generation against the lossless generation, as text: ROUGE-L
(``rouge-score``) and sentence BLEU (``sacrebleu``), both imported lazily.

Part of evaluation.metrics (whose face exports every name); kept apart from the task
metrics (evaluation.metrics.answer) because these need no task skill and depend on
optional packages. Registered by name on import (evaluation.metrics.registry).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from evaluation.metrics.answer import check_str
from evaluation.metrics.registry import register_metric


def _compare_texts(prediction: str, reference: str, identical: float,
                   score: Callable[[str, str], float]) -> float:
    """``score(prediction, reference)`` of two checked strings, or ``identical`` when they
    are equal (the score of a generation identical to the lossless one, whatever the
    package would say for it). Raises ValueError for non-str arguments."""
    prediction = check_str(prediction, "prediction")
    reference = check_str(reference, "reference")
    if prediction == reference:
        return identical
    return score(prediction, reference)


@lru_cache(maxsize=1)
def _rouge_l_scorer():
    from rouge_score import rouge_scorer  # lazy: only rouge_l needs it

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


@register_metric("rouge_l", higher_is_better=True, unit="fraction 0-1", column="rouge_l",
                 inputs=("prediction", "reference"))
def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure of ``prediction`` against ``reference`` (the ``rouge-score`` package).

    Longest-common-subsequence F-measure over the package's default tokenisation
    (lowercase, non-alphanumeric ASCII characters dropped), no stemming. Used here for a
    generation against the lossless generation. Two identical strings score 1.0 (also
    when they hold no scorable token; ``rouge-score`` alone would give 0.0).
    Source: Lin 2004; ``rouge_score.rouge_scorer.RougeScorer(["rougeL"])``.

    Returns:
        float in [0, 1].

    Raises:
        ValueError: non-str arguments.
    """
    return _compare_texts(prediction, reference, 1.0,
                          lambda p, r: float(_rouge_l_scorer().score(r, p)["rougeL"].fmeasure))


@register_metric("bleu", higher_is_better=True, unit="BLEU 0-100", column="bleu",
                 inputs=("prediction", "reference"))
def bleu(prediction: str, reference: str) -> float:
    """Sentence BLEU of ``prediction`` against one ``reference`` (``sacrebleu``, 0-100).

    ``sacrebleu.sentence_bleu(prediction, [reference])`` with its defaults (13a
    tokenisation, exponential smoothing). Two identical strings score 100.0 (also when
    empty); the result is clipped to [0, 100] to hide float rounding (100.00000000000004).
    Source: Papineni et al. 2002; Post 2018 (sacreBLEU).

    Returns:
        float in [0, 100].

    Raises:
        ValueError: non-str arguments.
    """
    def score(p: str, r: str) -> float:
        import sacrebleu  # lazy: only bleu needs it

        return min(100.0, max(0.0, float(sacrebleu.sentence_bleu(p, [r]).score)))

    return _compare_texts(prediction, reference, 100.0, score)
