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
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any

import numpy as np

# torch is imported inside the logit metrics only: the registry (directions, aggregation
# rules) is read by the figures and the notebook, which must not need torch.

from evaluation.metrics_registry import (  # noqa: F401 - re-exported (issue 27 split)
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




_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = frozenset(string.punctuation)
_DIGITS = re.compile(r"\d+")


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


def _check_str(value: Any, what: str) -> str:
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
    prediction = _check_str(prediction, "prediction")
    answer = _check_str(answer, "answer").strip()
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
    for the same reason; used for answer agreement with a lossless answer (issue 13).

    Raises:
        ValueError: non-str arguments, or an answer that is empty after normalisation.
    """
    answer = _check_str(answer, "answer").strip()
    if _DIGITS.fullmatch(answer):
        return _last_number(_check_str(prediction, "prediction"))
    return retrieval_accuracy(prediction, answer)


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
    prediction = _check_str(prediction, "prediction")
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
        truth_tokens = normalize_answer(_check_str(answer, "each answer")).split()
        best = max(best, _token_f1(pred_tokens, truth_tokens))
    return best


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
    prediction = _check_str(prediction, "prediction")
    reference = _check_str(reference, "reference")
    if prediction == reference:
        return 1.0
    return float(_rouge_l_scorer().score(reference, prediction)["rougeL"].fmeasure)


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
    import sacrebleu  # lazy: only bleu needs it

    prediction = _check_str(prediction, "prediction")
    reference = _check_str(reference, "reference")
    if prediction == reference:
        return 100.0
    score = float(sacrebleu.sentence_bleu(prediction, [reference]).score)
    return min(100.0, max(0.0, score))


# --------------------------------------------------------------------------- logit metrics


def _as_tensor(x: Any, what: str) -> torch.Tensor:
    import torch

    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    try:
        return torch.as_tensor(np.asarray(x))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} must be a tensor or array: {exc}") from None


def _check_logits(logits: torch.Tensor, what: str) -> None:
    import torch

    if logits.dim() != 2:
        raise ValueError(f"{what} must have shape [n, vocab], got {tuple(logits.shape)}")
    if logits.shape[0] == 0 or logits.shape[1] == 0:
        raise ValueError(f"{what} is empty: shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"{what} must be floating point, got {logits.dtype}")
    if torch.isnan(logits).any():
        raise ValueError(f"{what} contains NaN")


@register_metric("perplexity", higher_is_better=False, unit="perplexity (>= 1)")
def perplexity(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Perplexity of ``targets`` under ``logits``: exp(mean negative log-likelihood).

    Row ``i`` of ``logits`` is the model's prediction FOR ``targets[i]`` (the caller has
    already shifted by one: logits of positions t-1 predict token t). Computed in float64
    from ``log_softmax``. As CacheGen reports it on WikiText (Liu et al., SIGCOMM 2024, section 7.1).

    Args:
        logits: ``[n, vocab]`` float (fp16/bf16/fp32/fp64), any device.
        targets: ``[n]`` integer token ids in ``[0, vocab)``.

    Returns:
        float >= 1 (inf if a target has probability 0).

    Raises:
        ValueError: wrong ranks, mismatched n, empty input, NaN, ids out of range.
    """
    import torch

    logits = _as_tensor(logits, "logits")
    targets = _as_tensor(targets, "targets")
    _check_logits(logits, "logits")
    if targets.dim() != 1 or targets.shape[0] != logits.shape[0]:
        raise ValueError(
            f"targets must have shape [{logits.shape[0]}] to match logits {tuple(logits.shape)}, "
            f"got {tuple(targets.shape)}"
        )
    if targets.is_floating_point() or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer token ids, got {targets.dtype}")
    vocab = logits.shape[1]
    if targets.min().item() < 0 or targets.max().item() >= vocab:
        raise ValueError(f"targets must lie in [0, {vocab}), got [{targets.min().item()}, {targets.max().item()}]")
    log_probs = torch.log_softmax(logits.to(torch.float64), dim=-1)  # [n, vocab] float64
    nll = -log_probs.gather(1, targets.long().unsqueeze(1)).squeeze(1)  # [n]
    return float(torch.exp(nll.mean()).item())


@register_metric("ppl_increase_pct", higher_is_better=False, unit="% vs lossless",
                 column="ppl_increase_pct")
def ppl_increase_pct(ppl: float, ppl_ref: float) -> float:
    """Relative perplexity change in percent: ``100 * (ppl - ppl_ref) / ppl_ref``.

    ``ppl_ref`` is the perplexity with the original (lossless) KV, ``ppl`` with the
    decoded KV. Negative values happen (noise): about +-0.5% over 256 tokens of one context
    with the default model (docs/codec.md).

    Raises:
        ValueError: ``ppl_ref`` not a positive finite number, or ``ppl`` NaN/negative.
    """
    ppl, ppl_ref = float(ppl), float(ppl_ref)
    if not (math.isfinite(ppl_ref) and ppl_ref > 0):
        raise ValueError(f"ppl_ref must be a positive finite number, got {ppl_ref}")
    if math.isnan(ppl) or ppl < 0:
        raise ValueError(f"ppl must be a non-negative number, got {ppl}")
    return 100.0 * (ppl - ppl_ref) / ppl_ref


@register_metric("kl_divergence", higher_is_better=False, unit="nats", column="kl")
def kl_divergence(logits_ref: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over positions of KL(P_ref || P) between next-token distributions, in nats.

    ``KL = sum_v p_ref(v) * (log p_ref(v) - log p(v))`` per row, computed in float64
    from ``log_softmax`` of each side; terms with ``p_ref(v) = 0`` count 0. ``logits_ref``
    comes from the lossless KV, ``logits`` from the decoded KV (a fidelity metric that needs
    no task skill of the model).

    Args:
        logits_ref: ``[n, vocab]`` float, reference (lossless) logits.
        logits: ``[n, vocab]`` float, same shape.

    Returns:
        float >= 0 in nats (inf when P gives 0 probability where P_ref does not).

    Raises:
        ValueError: shapes differ or are not ``[n, vocab]``, empty, NaN.
    """
    import torch

    logits_ref = _as_tensor(logits_ref, "logits_ref")
    logits = _as_tensor(logits, "logits")
    _check_logits(logits_ref, "logits_ref")
    _check_logits(logits, "logits")
    if logits_ref.shape != logits.shape:
        raise ValueError(f"logits_ref {tuple(logits_ref.shape)} and logits {tuple(logits.shape)} differ in shape")
    lp_ref = torch.log_softmax(logits_ref.to(torch.float64), dim=-1)  # [n, vocab]
    lp = torch.log_softmax(logits.to(torch.float64), dim=-1)  # [n, vocab]
    p_ref = lp_ref.exp()
    terms = torch.where(p_ref > 0, p_ref * (lp_ref - lp), torch.zeros_like(p_ref))  # [n, vocab]
    kl = terms.sum(dim=-1).mean().item()
    return max(0.0, float(kl))  # float rounding can give -1e-17 for identical inputs


def _as_token_list(tokens: Any, what: str) -> list[int]:
    if type(tokens).__module__ == "torch" and hasattr(tokens, "dim"):  # a torch.Tensor
        if tokens.dim() != 1:
            raise ValueError(f"{what} must be 1-D, got shape {tuple(tokens.shape)}")
        return [int(t) for t in tokens.tolist()]
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise ValueError(f"{what} must be 1-D, got shape {tokens.shape}")
        return [int(t) for t in tokens.tolist()]
    if isinstance(tokens, (str, bytes)):
        raise ValueError(f"{what} must be a sequence of token ids, not {type(tokens).__name__}")
    try:
        return [int(t) for t in tokens]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} must be a sequence of integer token ids: {exc}") from None


@register_metric("greedy_match", higher_is_better=True, unit="fraction 0-1", column="greedy_match",
                 inputs=("tokens", "tokens_ref"))
def greedy_match(tokens: Sequence[int] | torch.Tensor, tokens_ref: Sequence[int] | torch.Tensor) -> float:
    """Share of reference positions where the greedy tokens equal the lossless run's.

    ``sum(tokens[i] == tokens_ref[i] for i < len(tokens_ref)) / len(tokens_ref)``.
    A shorter ``tokens`` counts its missing positions as mismatches; tokens beyond the
    reference length are ignored. An empty reference scores 1.0 when ``tokens`` is also
    empty, else 0.0. Positional (no alignment): one inserted token shifts the rest.

    Args:
        tokens: generated token ids with the decoded KV, list/1-D tensor/array of ints.
        tokens_ref: generated token ids with the original KV.

    Returns:
        float in [0, 1].

    Raises:
        ValueError: not a 1-D sequence of integers.
    """
    pred = _as_token_list(tokens, "tokens")
    ref = _as_token_list(tokens_ref, "tokens_ref")
    if not ref:
        return 1.0 if not pred else 0.0
    same = sum(1 for a, b in zip(pred, ref, strict=False) if a == b)
    return same / len(ref)


# --------------------------------------------------------------------------- aggregation


def _clean(values: Iterable[Any]) -> np.ndarray:
    """Values as float64, dropping None (metric not applicable). NaN/inf are rejected."""
    out = []
    for v in values:
        if v is None:
            continue
        if isinstance(v, (bool, np.bool_)):
            v = float(v)
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"cannot aggregate non-numeric value {v!r}") from None
        if math.isnan(f):
            raise ValueError("cannot aggregate NaN; use None for a value that does not apply")
        out.append(f)
    return np.asarray(out, dtype=np.float64)


def median(values: Iterable[Any]) -> float:
    """Median of the non-None values (bools count as 0/1).

    Raises:
        ValueError: no values left, NaN, or non-numeric values.
    """
    arr = _clean(values)
    if arr.size == 0:
        raise ValueError("median of no values")
    return float(np.median(arr))


def quantile(values: Iterable[Any], q: float) -> float:
    """q-quantile (0 <= q <= 1) of the non-None values, linear interpolation (numpy default).

    Raises:
        ValueError: q outside [0, 1], no values, NaN, or non-numeric values.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must lie in [0, 1], got {q}")
    arr = _clean(values)
    if arr.size == 0:
        raise ValueError("quantile of no values")
    return float(np.quantile(arr, q))


def mean_stderr(values: Iterable[Any]) -> tuple[float, float | None]:
    """Mean and standard error of the mean (sample std, ddof=1, / sqrt(n)).

    The standard error is None for a single value (it is undefined), as lm-evaluation-harness
    reports N/A. Bools count as 0/1, so the mean of ``correct`` flags is the accuracy.

    Raises:
        ValueError: no values, NaN, or non-numeric values.
    """
    arr = _clean(values)
    if arr.size == 0:
        raise ValueError("mean of no values")
    mean = float(arr.mean())
    if arr.size < 2:
        return mean, None
    return mean, float(arr.std(ddof=1) / math.sqrt(arr.size))


def aggregate(values: Iterable[Any]) -> dict[str, float | int | None]:
    """Summary of a metric over requests: ``n``, ``median``, ``p25``, ``p75``, ``mean``, ``stderr``.

    None entries (metric not applicable to that request) are dropped; with no values left
    every statistic is None and ``n`` is 0, so the dict can be written to results.json as is.

    Raises:
        ValueError: NaN or non-numeric values.
    """
    arr = _clean(values)
    if arr.size == 0:
        return {"n": 0, "median": None, "p25": None, "p75": None, "mean": None, "stderr": None}
    mean, stderr = mean_stderr(arr.tolist())
    return {
        "n": int(arr.size),
        "median": float(np.median(arr)),
        "p25": float(np.quantile(arr, 0.25)),
        "p75": float(np.quantile(arr, 0.75)),
        "mean": mean,
        "stderr": stderr,
    }
