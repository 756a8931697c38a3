"""Injection: put a KV cache (dumped, or decoded by the codec) back into a transformers
model and continue from it: greedy generation, or the logits of a known continuation.

This is the receiving side of CacheGen (Liu et al., SIGCOMM 2024, sections 3 and 5): the
engine skips prefill of the context and decodes on top of the loaded KV cache.

Run: ``python -m kv_extraction_hf --generate DUMP.safetensors``.
"""

from __future__ import annotations

import torch

from kv_extraction_hf.errors import ExtractionError


def validate_kv(bundle, k: torch.Tensor, v: torch.Tensor, context_ids=None) -> None:
    """Check that ``k``/``v`` (``[L, T, H_kv, D]``) fit ``bundle``'s model: layer count, KV
    heads, head dim, dtype, and T == len(context_ids) when given. Raises ExtractionError."""
    info = bundle.info
    if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
        raise ExtractionError("k and v must be torch tensors")
    if k.dim() != 4 or k.shape != v.shape:
        raise ExtractionError(f"KV shapes k {tuple(k.shape)} / v {tuple(v.shape)} are not one "
                              "[num_layers, num_tokens, num_kv_heads, head_dim] shape")
    want = (info.num_layers, info.num_kv_heads, info.head_dim)
    got = (k.shape[0], k.shape[2], k.shape[3])
    if got != want:
        raise ExtractionError(f"KV of shape {tuple(k.shape)} does not fit model {info.model_id}: expected "
                              f"[{info.num_layers}, T, {info.num_kv_heads}, {info.head_dim}]")
    dtype = str(k.dtype).replace("torch.", "")
    if dtype != info.dtype or v.dtype != k.dtype:
        raise ExtractionError(f"KV dtype {dtype}/{str(v.dtype).replace('torch.', '')} does not match the "
                              f"model's {info.dtype}")
    if context_ids is not None and len(context_ids) != k.shape[1]:
        raise ExtractionError(f"KV holds {k.shape[1]} tokens but the context has {len(context_ids)}")


def make_cache(k: torch.Tensor, v: torch.Tensor, config=None):
    """A transformers ``DynamicCache`` holding ``k``/``v`` (``[L, T, H_kv, D]``) for batch 1.

    The tensors are copied into the cache's layout ``[1, H_kv, T, D]``; generation appends to
    the cache without touching ``k``/``v``.
    """
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=config) if config is not None else DynamicCache()
    except TypeError:  # older transformers: no config argument
        cache = DynamicCache()
    for layer in range(k.shape[0]):
        cache.update(k[layer].transpose(0, 1).unsqueeze(0).contiguous(),
                     v[layer].transpose(0, 1).unsqueeze(0).contiguous(), layer)
    return cache


def _eos_ids(bundle) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(bundle.model, "generation_config", None), bundle.tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is None:
            continue
        ids.update([eos] if isinstance(eos, int) else list(eos))
    return ids


@torch.inference_mode()
def greedy_decode(bundle, cache, new_ids, max_new_tokens: int) -> list[int]:
    """Greedy decoding on top of ``cache`` (already holding the prefix), fed ``new_ids`` first.

    Returns the generated token ids, at most ``max_new_tokens``, stopping before an EOS
    token (which is not included).
    """
    eos = _eos_ids(bundle)
    ids = torch.as_tensor(list(new_ids), dtype=torch.long).reshape(1, -1)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = bundle.model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
        nxt = int(torch.argmax(logits))
        if nxt in eos:
            break
        out.append(nxt)
        ids = torch.tensor([[nxt]], dtype=torch.long)
    return out


def generate_from_kv(bundle, k: torch.Tensor, v: torch.Tensor, context_ids, new_ids,
                     max_new_tokens: int) -> list[int]:
    """Greedy generation from an injected context KV.

    ``k``/``v``: ``[L, T, H_kv, D]`` in the model's dtype, the KV of ``context_ids`` (T
    tokens); ``new_ids``: the tokens after the context (e.g. the question), at least one;
    returns up to ``max_new_tokens`` generated ids, EOS excluded. The same tokens as
    greedy ``model.generate(context_ids + new_ids)`` when the KV is lossless. Raises
    ExtractionError when the KV does not fit the model or the total exceeds its context.
    """
    validate_kv(bundle, k, v, context_ids)
    new_ids = list(new_ids)
    if not new_ids:
        raise ExtractionError("generate_from_kv needs at least one new token after the context")
    total = k.shape[1] + len(new_ids) + max_new_tokens
    if total > bundle.info.max_context:
        raise ExtractionError(f"context + new tokens + max_new_tokens = {total} exceeds the model's context of "
                              f"{bundle.info.max_context} tokens")
    cache = make_cache(k, v, bundle.model.config)
    return greedy_decode(bundle, cache, new_ids, max_new_tokens)


@torch.inference_mode()
def continuation_logits(bundle, k: torch.Tensor, v: torch.Tensor, context_ids, continuation_ids) -> torch.Tensor:
    """Logits of a known continuation given an injected context KV (for perplexity / KL).

    Returns float32 ``[n, vocab]`` for ``n = len(continuation_ids)``: row i is the model's
    next-token distribution (pre-softmax) for ``continuation_ids[i]`` given the context and
    ``continuation_ids[:i]``. Rows 1..n-1 come from feeding the continuation on top of the
    full injected KV. Row 0 is the output at the last context token, which the KV does not
    carry: it is computed by feeding ``context_ids[-1]`` on top of the KV of the first T-1
    tokens (that one token's own K/V is recomputed). Raises ExtractionError.
    """
    validate_kv(bundle, k, v, context_ids)
    cont = list(continuation_ids)
    if not cont:
        raise ExtractionError("continuation_logits needs at least one continuation token")
    total = k.shape[1] + len(cont)
    if total > bundle.info.max_context:
        raise ExtractionError(f"context + continuation = {total} tokens exceeds the model's context of "
                              f"{bundle.info.max_context} tokens")
    model = bundle.model
    last = torch.tensor([[int(context_ids[-1])]], dtype=torch.long)
    prefix_cache = make_cache(k[:, :-1], v[:, :-1], model.config) if k.shape[1] > 1 else None
    first = model(input_ids=last, past_key_values=prefix_cache, use_cache=True).logits[0, -1:]
    rows = [first.float()]
    if len(cont) > 1:
        cache = make_cache(k, v, model.config)
        ids = torch.as_tensor(cont[:-1], dtype=torch.long).reshape(1, -1)
        rows.append(model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0].float())
    return torch.cat(rows, dim=0)
