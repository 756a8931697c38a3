"""Prefill: run a context through the model and take its KV cache out as two tensors.

This is the "KV cache" of CacheGen (Liu et al., SIGCOMM 2024, section 2): for every layer,
the attention keys and values of every context token. Layout used across the harness:
``[num_layers, num_tokens, num_kv_heads, head_dim]``, the model's own dtype, CPU.

Run: ``python -m kv_extraction_hf --task needle --context-tokens 1024 --out DIR``.
"""

from __future__ import annotations

import torch

from kv_extraction_hf.errors import ExtractionError


def cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (keys, values), each ``[batch, num_kv_heads, num_tokens, head_dim]``, from a
    transformers cache object of either API (``.layers[i].keys`` or ``.key_cache[i]``) or a
    legacy tuple of (k, v) pairs."""
    if hasattr(cache, "layers") and cache.layers and hasattr(cache.layers[0], "keys"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    if hasattr(cache, "key_cache"):
        return list(zip(cache.key_cache, cache.value_cache, strict=True))
    if isinstance(cache, (tuple, list)):
        return [(kv[0], kv[1]) for kv in cache]
    raise ExtractionError(f"unsupported KV cache object {type(cache).__name__}")


def check_length(bundle, num_tokens: int) -> None:
    """Raise ExtractionError if ``num_tokens`` exceeds the model's context (``info.max_context``)."""
    if num_tokens > bundle.info.max_context:
        raise ExtractionError(
            f"prompt of {num_tokens} tokens is longer than the model's context of {bundle.info.max_context} tokens")


@torch.inference_mode()
def prefill_kv(bundle, input_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill ``input_ids`` (list[int] or 1-D/``[1, T]`` tensor) and return its KV cache.

    Returns ``(k, v)``, each ``[num_layers, T, num_kv_heads, head_dim]`` in the model's dtype
    (e.g. bfloat16), contiguous, on the CPU. Every layer holds all T tokens, also a
    sliding-window layer (``bundle.info.layer_kinds``; its attention still applies the
    window: the prefill runs on a cache that keeps every token, and the model's masks come
    from its config), so one layout serves every model. Raises ExtractionError for an
    empty prompt or one longer than the model's context.
    """
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1)
    num_tokens = ids.shape[1]
    if num_tokens == 0:
        raise ExtractionError("cannot prefill an empty prompt")
    check_length(bundle, num_tokens)
    from transformers import DynamicCache

    # no config: full-length layers everywhere (a sliding layer of the config's cache would
    # keep only its last window - 1 tokens); the logits are the model's own either way
    out = bundle.model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True)
    layers = cache_layers(out.past_key_values)
    if len(layers) != bundle.info.num_layers:
        raise ExtractionError(f"model returned {len(layers)} cache layers, expected {bundle.info.num_layers}")
    k = torch.stack([key[0].transpose(0, 1) for key, _ in layers]).contiguous()
    v = torch.stack([val[0].transpose(0, 1) for _, val in layers]).contiguous()
    if k.shape[1] != num_tokens:
        raise ExtractionError(
            f"model cached {k.shape[1]} of {num_tokens} tokens (a cache layer that drops tokens)")
    return k, v
