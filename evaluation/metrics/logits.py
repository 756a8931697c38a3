"""Metrics over the model's next-token distributions and greedy tokens: perplexity (as
CacheGen reports it on WikiText), the perplexity increase over the lossless run, the KL
divergence against the lossless logits, and the share of identical greedy tokens.

Part of evaluation.metrics (whose face exports every name). torch is imported inside the
functions only: the registry (directions, aggregation rules) is read by the figures and
the notebook, which must not need torch. Registered by name on import.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from evaluation.metrics.registry import register_metric

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
