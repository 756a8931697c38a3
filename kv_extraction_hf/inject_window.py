"""Injection of a windowed KV (``codec.window.WindowedKV``: sliding-window layers hold only
their last W tokens) into a transformers model's own cache, and the
continuation logits on top of it.

Separate from ``kv_extraction_hf.inject`` (the full-layout injection paths, which it
reuses) because it is the one place that knows how a sliding-window cache layer is filled
with fewer than T tokens while counting all T positions.

Run the tests: .venv/bin/python -m pytest tests/extraction/test_window_storage.py -q
"""

from __future__ import annotations

import torch

from kv_extraction_hf.errors import ExtractionError
from kv_extraction_hf.inject import check_fit, continuation_rows, new_cache

__all__ = ["make_cache_windowed", "continuation_logits_windowed", "model_windows"]


def make_cache_windowed(wkv, config, capacity: int = 0):
    """A transformers ``DynamicCache`` (batch 1) of the model's own layer kinds from a
    windowed KV (``codec.window.WindowedKV``: T context positions; a full layer holds all
    T tokens, a sliding layer the last ``min(T, W)``), WITHOUT building the full layout.

    Every layer is given only the tokens it holds (a sliding-window layer of window W keeps
    the last ``W - 1`` of them, as after the model's own prefill) and counts all T
    positions (``cumulative_length = T``: RoPE positions of the next tokens and the
    masks are those of the full cache; the logits equal :func:`make_cache`'s of the full
    KV bit for bit, tests/extraction/test_window_storage.py). ``capacity``: as
    :func:`make_cache` (used only when every layer is full attention).
    Raises ExtractionError when a layer holds fewer tokens than the model's layer needs:
    all T for a full-attention layer, ``min(T, W - 1)`` for a sliding one."""
    cache = new_cache(config, capacity)
    T = wkv.total_tokens
    layers = getattr(cache, "layers", None)
    for i in range(wkv.num_layers):
        k, v, start = wkv.layer(i)
        x = layers[i] if layers is not None and i < len(layers) else None
        sliding = bool(getattr(x, "is_sliding", False))
        need = min(T, int(x.sliding_window) - 1) if sliding else T
        if k.shape[0] < need or start + k.shape[0] != T:
            raise ExtractionError(f"layer {i} holds positions {start}..{start + k.shape[0] - 1} of {T}: the model's "
                                  f"{'sliding-window' if sliding else 'full-attention'} layer needs the last {need}")
        cache.update(k.transpose(0, 1).unsqueeze(0).contiguous(), v.transpose(0, 1).unsqueeze(0).contiguous(), i)
        if sliding:
            x.cumulative_length = T
    return cache


@torch.inference_mode()
def continuation_logits_windowed(bundle, wkv, context_ids, continuation_ids) -> torch.Tensor:
    """:func:`continuation_logits` from a windowed KV (``codec.window.WindowedKV`` of
    ``context_ids``), its caches built by :func:`make_cache_windowed` (row 0 from the
    windowed KV of the first T - 1 tokens: a sliding layer of window W then needs W of the
    context's last tokens, which is what ``codec.window`` keeps). Returns float32
    ``[n, vocab]``, equal bit for bit to :func:`continuation_logits` of the full KV when the
    windowed KV holds the same values. Raises ExtractionError (KV does not fit the model,
    holds too few tokens, or the total exceeds the model's context)."""
    check_fit(bundle.info, tuple(wkv.shape), wkv.dtype, context_ids)
    cont = list(continuation_ids)
    if not cont:
        raise ExtractionError("continuation_logits needs at least one continuation token")
    T = wkv.total_tokens
    if T + len(cont) > bundle.info.max_context:
        raise ExtractionError(f"context + continuation = {T + len(cont)} tokens exceeds the model's context of "
                              f"{bundle.info.max_context} tokens")
    return continuation_rows(bundle, lambda n: make_cache_windowed(wkv.prefix(n), bundle.model.config),
                              T, context_ids, cont)


def model_windows(bundle) -> list:
    """Each layer's window for ``codec.window`` (``None`` = full attention, else the
    model's sliding window in tokens) from ``bundle.info`` (``layer_kinds``, ``sliding_window``)."""
    info = bundle.info
    return [info.sliding_window if info.kind(i) == "sliding" else None for i in range(info.num_layers)]
