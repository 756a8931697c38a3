"""Injection: put a KV cache (dumped, or decoded by the codec) back into a transformers
model and continue from it: greedy generation, or the logits of a known continuation.

This is the receiving side of CacheGen (Liu et al., SIGCOMM 2024, sections 3 and 5): the
engine skips prefill of the context and decodes on top of the loaded KV cache.

Run: ``python -m kv_extraction_hf --generate DUMP.safetensors``.
"""

from __future__ import annotations

import math

import torch

from kv_extraction_hf.errors import ExtractionError


def validate_kv(bundle, k: torch.Tensor, v: torch.Tensor, context_ids=None) -> None:
    """Check that ``k``/``v`` (``[L, T, H_kv, D]``) fit ``bundle``'s model: layer count, KV
    heads, head dim, dtype, and T == len(context_ids) when given. Raises ExtractionError."""
    if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
        raise ExtractionError("k and v must be torch tensors")
    if k.dim() != 4 or k.shape != v.shape:
        raise ExtractionError(f"KV shapes k {tuple(k.shape)} / v {tuple(v.shape)} are not one "
                              "[num_layers, num_tokens, num_kv_heads, head_dim] shape")
    if v.dtype != k.dtype:
        raise ExtractionError(f"KV dtype {str(k.dtype).replace('torch.', '')}/{str(v.dtype).replace('torch.', '')} "
                              f"does not match the model's {bundle.info.dtype}")
    check_fit(bundle.info, tuple(k.shape), k.dtype, context_ids)


def check_fit(info, shape: tuple, dtype, context_ids=None) -> None:
    """ExtractionError unless a KV of logical ``shape`` ``(L, T, H_kv, D)`` and ``dtype``
    fits the model of ``info`` (and T == len(context_ids) when given)."""
    want = (info.num_layers, info.num_kv_heads, info.head_dim)
    if (shape[0], shape[2], shape[3]) != want:
        raise ExtractionError(f"KV of shape {shape} does not fit model {info.model_id}: expected "
                              f"[{info.num_layers}, T, {info.num_kv_heads}, {info.head_dim}]")
    name = str(dtype).replace("torch.", "")
    if name != info.dtype:
        raise ExtractionError(f"KV dtype {name}/{name} does not match the model's {info.dtype}")
    if context_ids is not None and len(context_ids) != shape[1]:
        raise ExtractionError(f"KV holds {shape[1]} tokens but the context has {len(context_ids)}")


def make_cache(k: torch.Tensor, v: torch.Tensor, config=None, capacity: int = 0):
    """A transformers ``DynamicCache`` holding ``k``/``v`` (``[L, T, H_kv, D]``) for batch 1.

    With ``config``, the cache's layers are the model's own kinds: a sliding-window layer
    (Gemma 2/3, Mistral) is transformers' ``DynamicSlidingWindowLayer``, which keeps the
    last ``window - 1`` of the T tokens it is given and counts all T (positions and masks
    as after the model's own prefill; the logits are the model's own, tests/
    test_model_compat.py).

    The tensors are copied into the cache's layout ``[1, H_kv, T, D]``; generation appends to
    the cache without touching ``k``/``v``. ``capacity`` (tokens, > T): preallocate that
    many positions per layer so that decoding appends in place instead of copying the
    whole cache at every step (the stock layer concatenates); the attention reads the same
    values (identical logits, tests/bench/test_bench_quality_tasks.py). 0 = the stock cache.
    """
    cache = new_cache(config, capacity)
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


def _answer_cache(bundle, k: torch.Tensor, v: torch.Tensor, context_ids, new_ids,
                  max_new_tokens: int):
    """(cache, new_ids as a list): the checks of :func:`generate_from_kv` and a cache of
    ``k``/``v`` with room for the new and generated tokens. Raises ExtractionError."""
    validate_kv(bundle, k, v, context_ids)
    new_ids = list(new_ids)
    if not new_ids:
        raise ExtractionError("generate_from_kv needs at least one new token after the context")
    total = k.shape[1] + len(new_ids) + max_new_tokens
    if total > bundle.info.max_context:
        raise ExtractionError(f"context + new tokens + max_new_tokens = {total} exceeds the model's context of "
                              f"{bundle.info.max_context} tokens")
    cache = make_cache(k, v, bundle.model.config, capacity=total)
    return cache, new_ids


def generate_from_kv(bundle, k: torch.Tensor, v: torch.Tensor, context_ids, new_ids,
                     max_new_tokens: int) -> list[int]:
    """Greedy generation from an injected context KV.

    ``k``/``v``: ``[L, T, H_kv, D]`` in the model's dtype, the KV of ``context_ids`` (T
    tokens); ``new_ids``: the tokens after the context (e.g. the question), at least one;
    returns up to ``max_new_tokens`` generated ids, EOS excluded. The same tokens as
    greedy ``model.generate(context_ids + new_ids)`` when the KV is lossless. Raises
    ExtractionError when the KV does not fit the model or the total exceeds its context.
    """
    cache, new_ids = _answer_cache(bundle, k, v, context_ids, new_ids, max_new_tokens)
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
    return continuation_rows(bundle, lambda n: make_cache(k[:, :n], v[:, :n], bundle.model.config),
                              k.shape[1], context_ids, cont)


def continuation_rows(bundle, cache_of, T: int, context_ids, cont: list) -> torch.Tensor:
    """The rows of :func:`continuation_logits`; ``cache_of(n)`` builds a cache of the
    context's first ``n`` tokens (n = T - 1 for row 0, T for the others)."""
    model = bundle.model
    last = torch.tensor([[int(context_ids[-1])]], dtype=torch.long)
    prefix_cache = cache_of(T - 1) if T > 1 else None
    first = model(input_ids=last, past_key_values=prefix_cache, use_cache=True).logits[0, -1:]
    rows = [first.float()]
    if len(cont) > 1:
        cache = cache_of(T)
        ids = torch.as_tensor(cont[:-1], dtype=torch.long).reshape(1, -1)
        rows.append(model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0].float())
    return torch.cat(rows, dim=0)


# Smallest top-1 minus top-2 logit margin (logit units) at which an argmax decided by one
# forward pass is trusted to equal the argmax of another pass over the same tokens with
# other matmul shapes (batched vs token-by-token), per activation dtype. Measured on the
# default model (SmolLM2-135M, KV from a bf16 prefill, contexts 512-2048 tokens): the
# largest batched-vs-incremental logit difference was 6e-5 with float32 activations and
# 0.75 with bfloat16 ones; a margin must exceed twice that (both logits may move).
TEACHER_FORCING_MIN_MARGIN = {torch.float32: 2e-3, torch.float64: 2e-3, torch.bfloat16: 2.0,
                              torch.float16: 2.0}


def _grow_layer_class():
    """A transformers ``DynamicLayer`` that appends in place into a preallocated buffer
    (the stock one concatenates, copying the whole cache at every decoding step)."""
    from transformers.cache_utils import DynamicLayer

    class GrowLayer(DynamicLayer):
        def __init__(self, capacity: int):
            super().__init__()
            self.capacity = int(capacity)
            self._kb = self._vb = None

        def _mine(self) -> bool:
            return (self._kb is not None and self.keys.numel() > 0 and self.keys.data_ptr() == self._kb.data_ptr()
                    and self.keys.shape[:2] == self._kb.shape[:2] and self.keys.stride() == self._kb.stride()
                    and self.values.data_ptr() == self._vb.data_ptr() and self.values.stride() == self._vb.stride())

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n = key_states.shape[-2]
            cur = self.keys.shape[-2] if self.keys.numel() else 0
            if not self._mine() or cur + n > self._kb.shape[-2]:
                b, h, _, d = key_states.shape
                cap = max(self.capacity, cur + n)
                # zeros, not new_empty: the attention reads keys/values as a slice
                # [..., :cur + n, :] of this buffer, and no kernel's reads past a slice may
                # meet undefined memory (codec/scratch.py says why)
                kb, vb = key_states.new_zeros((b, h, cap, d)), value_states.new_zeros((b, h, cap, d))
                if cur:
                    kb[..., :cur, :] = self.keys
                    vb[..., :cur, :] = self.values
                self._kb, self._vb = kb, vb
            self._kb[..., cur:cur + n, :] = key_states
            self._vb[..., cur:cur + n, :] = value_states
            self.keys = self._kb[..., :cur + n, :]
            self.values = self._vb[..., :cur + n, :]
            return self.keys, self.values

        def batch_select_indices(self, indices) -> None:
            if self.get_seq_length() > 0:
                cur = self.keys.shape[-2]
                if self._mine():
                    self._kb, self._vb = self._kb[indices], self._vb[indices]
                    self.keys, self.values = self._kb[..., :cur, :], self._vb[..., :cur, :]
                else:
                    super().batch_select_indices(indices)

    return GrowLayer


def new_cache(config=None, capacity: int = 0):
    """An empty transformers ``DynamicCache``; with ``capacity`` > 0 (tokens) and a model
    whose layers are all full attention, its layers append in place into buffers of that
    many tokens (no copy of the whole cache per decoding step)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    try:
        cache = DynamicCache(config=config) if config is not None else DynamicCache()
    except TypeError:  # older transformers: no config argument
        return DynamicCache()
    layers = getattr(cache, "layers", None)
    if capacity > 0 and layers and all(type(x) is DynamicLayer for x in layers):
        grow = _grow_layer_class()
        cache.layers = [grow(capacity) for _ in layers]
    return cache


def _batch_cache(kvs, config=None, capacity: int = 0):
    """A ``DynamicCache`` of batch ``len(kvs)``: entry b holds ``kvs[b]`` (``[L, T, H_kv, D]``
    each, all one shape/dtype), laid out ``[B, H_kv, T, D]`` per layer (``capacity``: as
    :func:`make_cache`)."""
    cache = new_cache(config, capacity)
    for layer in range(kvs[0][0].shape[0]):
        kb = torch.stack([k[layer] for k, _ in kvs], 0).transpose(1, 2).contiguous()
        vb = torch.stack([v[layer] for _, v in kvs], 0).transpose(1, 2).contiguous()
        cache.update(kb, vb, layer)
    return cache


@torch.inference_mode()
def continuation_logits_batch(bundle, kvs, context_ids, continuation_ids) -> list[torch.Tensor]:
    """:func:`continuation_logits` for several KV caches of the SAME context at once (e.g.
    one context's KV decoded by several codecs), as one batched forward per step.

    ``kvs``: list of (k, v), each ``[L, T, H_kv, D]`` in the model's dtype, the KV of
    ``context_ids``; returns one float32 ``[n, vocab]`` tensor per entry, equal bit for bit
    to that entry's own :func:`continuation_logits`: row 0 from ``context_ids[-1]`` over the
    first T-1 tokens' KV (a batch-1 one-token forward per entry, as there), rows 1..n-1
    over the full KV in ONE forward of batch ``len(kvs)``.

    Identity by construction, on any CPU: every operation of the batched forward is per
    batch row, but a matmul kernel's reduction order may depend on the number of rows (on
    an AMX Xeon oneDNN's bf16 GEMMs of 7 x 40 rows and of 40 rows differ by an ulp, and the
    logits by ~1e-2; on AVX2 / AVX512-BF16 machines they were identical). The
    first call for a shape (entries, context, continuation, torch threads, dtype) also runs
    every entry at batch 1 and compares: identical -> that shape is batched from then on
    (kernels are chosen by shape, never by value); different -> the batch-1 logits are
    returned, and every later call of that shape runs at batch 1 (``batch_is_exact``
    tells which). The lossless ``raw`` row of every quality run checks it again (KL
    exactly 0 against the batch-1 reference; tests/extraction/test_quality_batch.py). Memory: about
    ``len(kvs)`` times the batch-1 forward's. Raises ExtractionError like
    :func:`continuation_logits` (any entry)."""
    kvs = list(kvs)
    if not kvs:
        return []
    for k, v in kvs:
        validate_kv(bundle, k, v, context_ids)
    if any(k.shape != kvs[0][0].shape for k, _ in kvs):
        raise ExtractionError("continuation_logits_batch needs KV caches of one shape")
    cont = list(continuation_ids)
    if not cont:
        raise ExtractionError("continuation_logits needs at least one continuation token")
    T = kvs[0][0].shape[1]
    total = T + len(cont)
    if total > bundle.info.max_context:
        raise ExtractionError(f"context + continuation = {total} tokens exceeds the model's context of "
                              f"{bundle.info.max_context} tokens")
    model = bundle.model
    B = len(kvs)
    # row 0 (one token per entry) stays a batch-1 forward per entry: with B one-token rows
    # the linear layers take another matmul kernel than the single row's (bf16 results
    # differ by an ulp), while B x (n-1) rows and (n-1) rows give identical rows (tests)
    last = torch.tensor([[int(context_ids[-1])]], dtype=torch.long)
    first = []
    for k, v in kvs:
        prefix = make_cache(k[:, :-1], v[:, :-1], model.config) if T > 1 else None
        first.append(model(input_ids=last, past_key_values=prefix, use_cache=True).logits[0, -1:].float())
        del prefix
    if len(cont) == 1:
        return first
    key = _batch_key(B, T, len(cont), kvs[0][0].dtype)
    exact = True if B == 1 else _EXACT_BATCH.get(key)
    if exact is False:      # this shape's batched forward rounds differently here
        return [continuation_logits(bundle, k, v, context_ids, cont) for k, v in kvs]
    cache = _batch_cache(kvs, model.config)
    ids = torch.as_tensor(cont[:-1], dtype=torch.long).reshape(1, -1).expand(B, -1)
    rest = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
    out = [torch.cat([first[b], rest[b].float()], dim=0) for b in range(B)]
    del cache, rest
    if exact is None:       # first call of this shape: compare with batch 1 once
        single = [continuation_logits(bundle, k, v, context_ids, cont) for k, v in kvs]
        _EXACT_BATCH[key] = all(torch.equal(a, b) for a, b in zip(out, single))
        if not _EXACT_BATCH[key]:
            return single
    return out


# (entries, context tokens, continuation tokens, torch threads, KV dtype) -> whether the
# batched continuation forward of that shape gave the batch-1 logits bit for bit here
_EXACT_BATCH: dict = {}


def _batch_key(B: int, T: int, n: int, dtype) -> tuple:
    return (int(B), int(T), int(n), torch.get_num_threads(), str(dtype))


def batch_is_exact(B: int, T: int, n: int, dtype) -> bool | None:
    """Whether :func:`continuation_logits_batch` of ``B`` entries, ``T`` context and ``n``
    continuation tokens (KV ``dtype``; at the current torch thread count) runs batched
    (True: checked bit-identical to batch 1 on this machine), at batch 1 (False: it was
    not), or is not checked yet (None)."""
    return True if B == 1 else _EXACT_BATCH.get(_batch_key(B, T, n, dtype))


def teacher_forcing_margin(dtype: torch.dtype) -> float:
    """The :data:`TEACHER_FORCING_MIN_MARGIN` for activations of ``dtype`` (2.0 when unknown)."""
    return TEACHER_FORCING_MIN_MARGIN.get(dtype, 2.0)


@torch.inference_mode()
def _greedy_decode_margins(bundle, cache, new_ids, max_new_tokens: int, eos: set[int]) -> tuple[list[int], float]:
    """:func:`greedy_decode` that also returns the smallest top-1 minus top-2 logit margin
    over the steps it took (``inf`` when it took none)."""
    ids = torch.as_tensor(list(new_ids), dtype=torch.long).reshape(1, -1)
    out: list[int] = []
    low = math.inf
    for _ in range(max_new_tokens):
        logits = bundle.model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
        top = torch.topk(logits.float(), 2).values
        low = min(low, float(top[0] - top[1]))
        nxt = int(torch.argmax(logits))
        if nxt in eos:
            break
        out.append(nxt)
        ids = torch.tensor([[nxt]], dtype=torch.long)
    return out, low


def generate_from_kv_margin(bundle, k: torch.Tensor, v: torch.Tensor, context_ids, new_ids,
                            max_new_tokens: int) -> tuple[list[int], float]:
    """:func:`generate_from_kv` (the same forwards, the same ids) that also returns the
    smallest top-1 minus top-2 logit margin (logit units, float32) over the steps that
    decided the answer, including the stop (``inf`` when none). Raises ExtractionError
    like :func:`generate_from_kv`."""
    cache, new_ids = _answer_cache(bundle, k, v, context_ids, new_ids, max_new_tokens)
    return _greedy_decode_margins(bundle, cache, new_ids, max_new_tokens, _eos_ids(bundle))


@torch.inference_mode()
def greedy_from_kvs_batch(bundle, kvs, context_ids, new_ids, max_new_tokens: int,
                          min_margin: float | None = None) -> list[dict]:
    """Greedy answers on several KV caches of the SAME context at once (e.g. one request's
    lossless KV and its KV decoded by several codecs), one batched forward per step.

    ``kvs``: list of (k, v), each ``[L, T, H_kv, D]`` in the model's dtype, the KV of
    ``context_ids``; ``new_ids``: the question, at least one token. Every entry is fed the
    question, then each its own greedy token, in ONE forward of batch = the entries still
    generating (all have the same cache length at every step, so no padding or mask; an
    entry that stops, at an EOS or after ``max_new_tokens`` ids, leaves the batch). The
    weights are read once per step for all entries: about the cost of one entry's
    generation instead of ``len(kvs)`` of them (the CPU forward is weight-bandwidth bound).

    A batch-B forward rounds differently from the batch-1 one of :func:`generate_from_kv`
    (other matmul kernels), so the answer is trusted only where the top-1 minus top-2
    logit margin of every step that decided it (each token and the stop) is at least
    ``min_margin`` (logit units; None = :func:`teacher_forcing_margin` of the model's
    dtype, the guard :func:`answer_from_kv` uses); an entry with a smaller margin leaves
    the batch and is answered by plain :func:`generate_from_kv` (``path`` "fallback").
    Either way each entry's ids are those of its own :func:`generate_from_kv`.

    Returns one dict per entry: ``{"ids": list[int] (EOS excluded), "path": "batched" |
    "fallback", "min_margin": smallest margin seen (float, logit units; inf when no
    step)}``. Memory: ``len(kvs)`` caches (float32 default model, 4K tokens: ~190 MB
    each). Raises ExtractionError like :func:`generate_from_kv` (any entry) or when the
    caches differ in shape. Method: batched greedy decoding (as in Hugging Face
    ``generate`` with batch > 1), guarded by the logit-margin check of
    :func:`answer_from_kv`.
    """
    kvs = list(kvs)
    if not kvs:
        return []
    for k, v in kvs:
        validate_kv(bundle, k, v, context_ids)
    if any(k.shape != kvs[0][0].shape or v.shape != kvs[0][0].shape for k, v in kvs):
        raise ExtractionError("greedy_from_kvs_batch needs KV caches of one shape")
    new_ids = list(new_ids)
    if not new_ids:
        raise ExtractionError("greedy_from_kvs_batch needs at least one new token after the context")
    total = kvs[0][0].shape[1] + len(new_ids) + max_new_tokens
    if total > bundle.info.max_context:
        raise ExtractionError(f"context + new tokens + max_new_tokens = {total} exceeds the model's context of "
                              f"{bundle.info.max_context} tokens")
    B = len(kvs)
    out: list[dict] = [{"ids": [], "path": "batched", "min_margin": math.inf} for _ in range(B)]
    if max_new_tokens <= 0:
        return out
    if min_margin is None:
        min_margin = teacher_forcing_margin(next(bundle.model.parameters()).dtype)
    eos = _eos_ids(bundle)
    cache = _batch_cache(kvs, bundle.model.config, capacity=total)
    active = list(range(B))                  # cache row r holds entry active[r]
    ids = torch.as_tensor(new_ids, dtype=torch.long).reshape(1, -1).expand(B, -1)
    low_rows: list[int] = []
    while active:
        # only the last position's logits are needed (the question's other rows are not)
        logits = bundle.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        top = torch.topk(logits.float(), 2, dim=-1).values
        margins = (top[:, 0] - top[:, 1]).tolist()
        nxt = torch.argmax(logits, dim=-1).tolist()
        keep = []
        for r, b in enumerate(active):
            o = out[b]
            o["min_margin"] = min(o["min_margin"], margins[r])
            if margins[r] < min_margin:
                low_rows.append(b)
                continue
            if nxt[r] in eos:
                continue
            o["ids"].append(nxt[r])
            if len(o["ids"]) < max_new_tokens:
                keep.append(r)
        if not keep:
            break
        if len(keep) < len(active):
            cache.batch_select_indices(torch.as_tensor(keep, dtype=torch.long))
        active = [active[r] for r in keep]
        ids = torch.as_tensor([[nxt[r]] for r in keep], dtype=torch.long)
    del cache
    for b in low_rows:
        k, v = kvs[b]
        out[b]["ids"] = generate_from_kv(bundle, k, v, context_ids, new_ids, max_new_tokens)
        out[b]["path"] = "fallback"
    return out


def _record_past(cache) -> None:
    """Make the sliding-window layers of ``cache`` keep the tokens they would drop until a
    :func:`_drop_last` (transformers' ``activate_past_recording``), so that it can remove
    tokens from them."""
    for x in getattr(cache, "layers", None) or ():
        if getattr(x, "is_sliding", False) and hasattr(x, "activate_past_recording"):
            x.activate_past_recording()


def _drop_last(cache, n: int) -> None:
    """Remove the last ``n`` tokens from every layer of a transformers cache, in place (a
    sliding-window layer through its own ``crop``: it needs :func:`_record_past` first)."""
    if n <= 0:
        return
    layers = getattr(cache, "layers", None)
    if layers is not None and all(hasattr(x, "keys") and hasattr(x, "values") for x in layers):
        for x in layers:
            if getattr(x, "is_sliding", False):
                x.crop(-n)
                continue
            x.keys = x.keys[..., :-n, :]
            x.values = x.values[..., :-n, :]
        return
    cache.crop(-n)   # older transformers: a negative length removes that many tokens


@torch.inference_mode()
def answer_from_kv(bundle, k: torch.Tensor, v: torch.Tensor, context_ids, new_ids, reference_ids,
                   max_new_tokens: int, min_margin: float | None = None) -> dict:
    """The greedy answer on an injected KV, checked against a known greedy answer by teacher forcing.

    Same result as :func:`generate_from_kv` (``k``/``v`` ``[L, T, H_kv, D]`` in the
    model's dtype, the KV of ``context_ids``; ``new_ids`` the question, at least one token;
    at most ``max_new_tokens`` ids, EOS excluded), computed cheaply when the answer is
    expected to equal ``reference_ids`` (e.g. the lossless answer of the same request,
    itself a ``generate_from_kv`` result with the same budget):

    1. One forward of ``new_ids + reference_ids`` on the KV (teacher forcing). Greedy
       generation reproduces ``reference_ids`` iff the argmax at the position before each
       reference token is that token and, when the reference stopped before the budget, the
       argmax after its last token is an EOS token.
    2. At the first position where the argmax differs, the common prefix is kept in the
       cache (the rest dropped) and greedy generation continues from the differing token.
    3. Batched and token-by-token forwards round differently (bf16): where the top-1 minus
       top-2 logit margin at any position that decided the answer is below ``min_margin``
       (logit units; None = :func:`teacher_forcing_margin` of the model's dtype), the
       answer is instead produced by plain :func:`generate_from_kv`.

    Returns ``{"ids": list[int], "agrees": ids == reference_ids, "path": "teacher-forced" |
    "continued" | "fallback", "diverged_at": index of the first differing answer token or
    None, "min_margin": smallest margin seen (float, logit units)}``. Raises
    ExtractionError when the KV does not fit the model or the total exceeds its context.
    Method: speculative-decoding style verification of a draft by one forward (Leviathan
    et al., "Fast Inference from Transformers via Speculative Decoding", ICML 2023), the
    draft being the reference answer.
    """
    validate_kv(bundle, k, v, context_ids)
    new_ids = list(new_ids)
    ref = [int(x) for x in reference_ids]
    if not new_ids:
        raise ExtractionError("answer_from_kv needs at least one new token after the context")
    if len(ref) > max_new_tokens:
        raise ExtractionError(f"reference answer of {len(ref)} tokens exceeds max_new_tokens={max_new_tokens}")
    total = k.shape[1] + len(new_ids) + max_new_tokens
    if total > bundle.info.max_context:
        raise ExtractionError(f"context + new tokens + max_new_tokens = {total} exceeds the model's context of "
                              f"{bundle.info.max_context} tokens")
    if max_new_tokens <= 0:
        return {"ids": [], "agrees": not ref, "path": "teacher-forced", "diverged_at": None, "min_margin": math.inf}
    if min_margin is None:
        min_margin = teacher_forcing_margin(next(bundle.model.parameters()).dtype)
    eos = _eos_ids(bundle)
    # rows that decide the answer: before each reference token, plus the stop after it
    # unless the reference used the whole budget
    n_rows = len(ref) + (1 if len(ref) < max_new_tokens else 0)
    feed = new_ids + ref[:n_rows - 1]
    m = len(new_ids)
    cache = make_cache(k, v, bundle.model.config, capacity=total)
    _record_past(cache)
    logits = bundle.model(input_ids=torch.as_tensor(feed, dtype=torch.long).reshape(1, -1),
                          past_key_values=cache, use_cache=True).logits[0, m - 1:m - 1 + n_rows]
    top = torch.topk(logits.float(), 2, dim=-1).values
    margins = (top[:, 0] - top[:, 1]).tolist()
    pred = torch.argmax(logits, dim=-1).tolist()

    def fallback(low: float) -> dict:
        ids = generate_from_kv(bundle, k, v, context_ids, new_ids, max_new_tokens)
        return {"ids": ids, "agrees": ids == ref, "path": "fallback",
                "diverged_at": next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b),
                                    None if ids == ref else min(len(ids), len(ref))),
                "min_margin": low}

    low = math.inf
    for i in range(n_rows):
        low = min(low, margins[i])
        if margins[i] < min_margin:
            return fallback(low)
        if pred[i] in eos:          # greedy stops here: the answer is ref[:i]
            if i == len(ref):
                return {"ids": ref, "agrees": True, "path": "teacher-forced", "diverged_at": None,
                        "min_margin": low}
            return {"ids": ref[:i], "agrees": False, "path": "continued", "diverged_at": i, "min_margin": low}
        if i < len(ref) and pred[i] == ref[i]:
            continue
        # diverged at answer position i: the answer is ref[:i] then pred[i]
        out = ref[:i] + [pred[i]]
        if len(out) < max_new_tokens:
            _drop_last(cache, len(feed) - (m + i))     # keep context + question + ref[:i]
            more, low2 = _greedy_decode_margins(bundle, cache, [pred[i]], max_new_tokens - len(out), eos)
            low = min(low, low2)
            if low2 < min_margin:
                return fallback(low)
            out += more
        return {"ids": out, "agrees": False, "path": "continued", "diverged_at": i, "min_margin": low}
    # the reference used the whole budget and every position reproduced it
    return {"ids": ref, "agrees": True, "path": "teacher-forced", "diverged_at": None, "min_margin": low}
