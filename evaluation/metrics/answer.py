"""Task metrics of an answer against the task's expected answer: LongChat line retrieval
accuracy as LongEval scores it (retrieval_accuracy, scored_answer) and token-level F1 as
LongBench scores TriviaQA / NarrativeQA (qa_f1), with LongBench's answer normalisation.

Part of evaluation.metrics (whose face exports every name and documents the sources); the
generation-similarity metrics are in evaluation.metrics.generation, the logit metrics in
evaluation.metrics.logits. Registered by name on import (evaluation.metrics.registry).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from typing import Any

from evaluation.metrics.registry import register_metric

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = frozenset(string.punctuation)
_DIGITS = re.compile(r"\d+")
# a list item's number at the start of a line: "1. ", "2) ", "(3) ", "- 4. " (then a blank or the end)
_LIST_MARKER = re.compile(r"^[ \t]*(?:[-*+][ \t]+)?\(?\d{1,3}[.)](?=[ \t]|$)", re.M)


def normalize_answer(text: str) -> str:
    """LongBench / SQuAD answer normalisation.

    Lowercase, remove ASCII punctuation, remove the articles a/an/the, collapse
    whitespace. Source: LongBench ``metrics.py::normalize_answer`` (same as SQuAD v1.1).

    >>> normalize_answer("The  Eiffel-Tower!")
    'eiffeltower'
    """
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def check_str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a str, got {type(value).__name__}")
    return value


@register_metric("retrieval_accuracy", higher_is_better=True, unit="bool (share correct when aggregated)",
                 aggregation="share", column="correct", summary="accuracy",
                 inputs=("prediction", "answer"), task=True)
def retrieval_accuracy(prediction: str, answer: str) -> bool:
    """Is a retrieval answer correct, as LongEval scores LongChat "lines"?

    When ``answer`` is a non-negative integer (e.g. ``"31337"``): correct when the LAST
    run of digits in ``prediction`` equals it as an integer (LongEval
    ``test_lines_one_sample``: ``re.findall(r"\\d+", output)[-1]``), so
    ``"line 7 holds <31337>"`` is correct and ``"31337 or 12"`` is not.
    Otherwise (topics, needle phrases): correct when the normalised answer
    (:func:`normalize_answer`) is a substring of the normalised prediction.

    Args:
        prediction: the model's generated text.
        answer: the expected answer.

    Returns:
        bool.

    Raises:
        ValueError: non-str arguments, or an answer that is empty after normalisation.
    """
    prediction = check_str(prediction, "prediction")
    answer = check_str(answer, "answer").strip()
    if _DIGITS.fullmatch(answer):
        return _last_number(prediction) == int(answer)
    norm_answer = normalize_answer(answer)
    if not norm_answer:
        raise ValueError(f"answer {answer!r} is empty after normalisation")
    return norm_answer in normalize_answer(prediction)


def scored_answer(prediction: str, answer: str):
    """What :func:`retrieval_accuracy` reads from ``prediction`` for this ``answer``: the
    last run of digits as an int (None when there is none) when ``answer`` is a
    non-negative integer, else whether the normalised answer occurs in the normalised
    prediction (bool). Two predictions with the same scored answer get the same verdict
    for the same reason; used for answer agreement with a lossless answer.

    Raises:
        ValueError: non-str arguments, or an answer that is empty after normalisation.
    """
    answer = check_str(answer, "answer").strip()
    if _DIGITS.fullmatch(answer):
        return _last_number(check_str(prediction, "prediction"))
    return retrieval_accuracy(prediction, answer)


@register_metric("all_values_match", higher_is_better=True, unit="bool (share correct when aggregated)",
                 aggregation="share", inputs=("prediction", "answers"))
def all_values_match(prediction: str, answers: Sequence[str]) -> bool:
    """Does ``prediction`` state every expected value? RULER's ``string_match_all`` (Hsieh et
    al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language Models?",
    ``eval/synthetic/constants.py``) as a verdict: true when each of ``answers`` occurs in the
    prediction. A numeric answer (e.g. ``"4920113"``) must occur as a whole run of digits, so
    ``"49201130"`` does not state ``"4920113"``; other answers as case-insensitive substrings.

    Raises:
        ValueError: non-str prediction, no answers, or an empty answer.
    """
    prediction = check_str(prediction, "prediction")
    if isinstance(answers, str) or not answers:
        raise ValueError("answers must be a non-empty sequence of str")
    numbers = set(_DIGITS.findall(prediction))
    low = prediction.lower()
    for a in answers:
        a = check_str(a, "answer").strip()
        if not a:
            raise ValueError("an answer is empty")
        if not (a in numbers if _DIGITS.fullmatch(a) else a.lower() in low):
            return False
    return True


def stated_values(prediction: str) -> tuple[int, ...]:
    """The numbers ``prediction`` states, as sorted distinct ints: what two answers of the
    answer suite must share to agree (``"5, 12 and 5"`` and ``"12, 5"`` agree; an answer
    that adds or drops a number does not). The number of a list item that opens a line
    (``"1. "``, ``"2) "``, ``"(3) "``, ``"- 4. "``) is formatting, not a stated value: a list
    written ``"1. 9868160"`` and ``"- 9868160"`` states the same values. Raises ValueError
    for a non-str prediction."""
    text = _LIST_MARKER.sub(" ", check_str(prediction, "prediction"))
    return tuple(sorted({int(x) for x in _DIGITS.findall(text)}))


def stated_topics(prediction: str, topics: Sequence[str]) -> tuple[str, ...]:
    """Which of ``topics`` ``prediction`` names, as sorted distinct normalised topics
    (:func:`normalize_answer`; a topic is named when its normalised form occurs in the
    normalised prediction): what two LongChat answers must share to agree, as
    :func:`stated_values` for numbers ("the first topic was Kyoto's temples" and "Kyoto's
    temples." agree). Raises ValueError for a non-str prediction or topic."""
    text = normalize_answer(check_str(prediction, "prediction"))
    norm = {normalize_answer(check_str(t, "topic")) for t in topics}
    return tuple(sorted(t for t in norm if t and t in text))


def _last_number(text: str) -> int | None:
    """The last run of digits in ``text`` as an int (LongEval's ``re.findall(r"\\d+",
    output)[-1]``), or None when there is none."""
    numbers = _DIGITS.findall(text)
    return int(numbers[-1]) if numbers else None


def _token_f1(prediction_tokens: list[str], truth_tokens: list[str]) -> float:
    # LongBench metrics.py::f1_score
    common = Counter(prediction_tokens) & Counter(truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction_tokens)
    recall = num_same / len(truth_tokens)
    return 2 * precision * recall / (precision + recall)


@register_metric("qa_f1", higher_is_better=True, unit="fraction 0-1", column="f1",
                 inputs=("prediction", "answers"), task=True)
def qa_f1(prediction: str, answers: Sequence[str] | str, *, first_line: bool = False) -> float:
    """Token-level F1 of a QA answer, max over the reference answers (LongBench).

    Both sides are normalised with :func:`normalize_answer` and split on whitespace;
    F1 = 2PR/(P+R) over the multiset of shared tokens. The score is the maximum over
    ``answers``. Source: LongBench ``metrics.py::qa_f1_score`` and ``eval.py``
    (``score = max(score, metric(prediction, ground_truth))``).

    Args:
        prediction: generated answer text.
        answers: the accepted answers (a single str is treated as one answer).
        first_line: keep only the first non-empty line of the prediction, as LongBench
            does for TriviaQA (``prediction.lstrip('\\n').split('\\n')[0]``).

    Returns:
        float in [0, 1].

    Raises:
        ValueError: no answers, or non-str values.
    """
    prediction = check_str(prediction, "prediction")
    if isinstance(answers, str):
        answers = [answers]
    answers = list(answers)
    if not answers:
        raise ValueError("answers must hold at least one reference answer")
    if first_line:
        prediction = prediction.lstrip("\n").split("\n")[0]
    pred_tokens = normalize_answer(prediction).split()
    best = 0.0
    for answer in answers:
        truth_tokens = normalize_answer(check_str(answer, "each answer")).split()
        best = max(best, _token_f1(pred_tokens, truth_tokens))
    return best
