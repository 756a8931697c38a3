"""The transformers engine (``--engine hf``): prefill, KV injection and greedy decoding in
this process, its KV prefix loaded by :func:`hf_load` through the same
``third_party.vllm.sources.StoreSource`` the vLLM connector uses. Separate from
harness.engines.vllm: it needs no vLLM, and its timings are measured here, not read from a
connector record.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from harness.contexts import BenchmarkError
from harness.engines.api import Engine, LoadOutcome, RequestTiming, merge_decisions
from harness.engines.numerics import numerics_env
from kv_extraction_hf.inject import make_cache
from third_party.vllm.sources import SourceError, StoreSource


def hf_load(params: dict, prompt_ids: list[int], load_tokens: int, before_chunk=None) -> LoadOutcome:
    """Fetch + decode a context's KV prefix from the store (third_party.vllm.sources.StoreSource,
    the code path the vLLM connector uses), concatenated for the HF engine.

    Raises:
        BenchmarkError: the store cannot be reached or the entry is malformed.
    """
    src = StoreSource()
    t0 = time.perf_counter()
    try:
        lk = src.lookup(params, prompt_ids)
    except SourceError as exc:
        raise BenchmarkError(str(exc)) from None
    n = min(lk.num_tokens, load_tokens)
    if n < int(lk.info.get("min_load_tokens") or 0):   # a windowed entry, too short a load
        n = 0
    ks, vs = [], []
    if n == 0:
        return LoadOutcome(None, None, 0, lookup_s=lk.lookup_s)
    stats = src.load(params, lk, n, lambda start, k, v: (ks.append(k), vs.append(v)),
                     before_chunk=before_chunk)
    load_s = time.perf_counter() - t0
    merge_decisions(stats.chunks, stats.extra.get("decisions", []))
    got = stats.loaded_tokens
    k = torch.cat(ks, dim=1)[:, :got] if got else None
    v = torch.cat(vs, dim=1)[:, :got] if got else None
    return LoadOutcome(k, v, got, lookup_s=lk.lookup_s, load_s=load_s, stats=stats, requested_tokens=n)


# ----------------------------------------------------------------------------- engine
class HFEngine(Engine):
    """transformers engine: prefill / KV injection / greedy decoding in this process.

    Args:
        bundle: ``kv_extraction_hf.model.ModelBundle`` (model in eval mode, tokenizer, info).
    """

    name = "hf"

    def __init__(self, bundle: Any):
        self.bundle = bundle
        self.model = bundle.model
        eos = getattr(bundle.tokenizer, "eos_token_id", None)
        self.eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
        self.settings = {"engine": "hf", "torch_threads": torch.get_num_threads(),
                         "dtype": str(getattr(self.model, "dtype", "")).removeprefix("torch."),
                         "env": numerics_env()}

    def serve(self, ctx, var, params, max_new_tokens):
        loader = None
        if params is not None:
            loader = lambda: hf_load(params, ctx.prompt.input_ids, ctx.load_tokens)  # noqa: E731
        return self.run(ctx.prompt.input_ids, max_new_tokens, loader)

    @torch.inference_mode()
    def run(self, prompt_ids: list[int], max_new_tokens: int,
            loader: Callable[[], LoadOutcome] | None = None) -> RequestTiming:
        """Serve one request: optionally load a KV prefix, prefill the rest, decode greedily.

        Args:
            prompt_ids: the full prompt (context + question) token ids.
            max_new_tokens: generated tokens (>= 1).
            loader: called after arrival to fetch + decode the prefix KV (None = text mode).
        Returns:
            RequestTiming with all parts in seconds.
        """
        t_arrival = time.perf_counter()
        outcome = loader() if loader is not None else LoadOutcome(None, None, 0)
        t_loaded = time.perf_counter()
        cache = None
        n = outcome.loaded_tokens if outcome.k is not None else 0
        if n:
            cache = make_cache(outcome.k, outcome.v)
        t_injected = time.perf_counter()
        ids = torch.tensor([prompt_ids[n:]], dtype=torch.long)
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True,
                         logits_to_keep=1)
        t_prefilled = time.perf_counter()
        next_id = int(out.logits[0, -1].argmax())
        t_first = time.perf_counter()
        generated = [next_id]
        cache = out.past_key_values
        while len(generated) < max_new_tokens and next_id not in self.eos_ids:
            out = self.model(input_ids=torch.tensor([[next_id]]), past_key_values=cache,
                             use_cache=True)
            cache = out.past_key_values
            next_id = int(out.logits[0, -1].argmax())
            generated.append(next_id)
        t_end = time.perf_counter()
        return RequestTiming(
            ttft_s=t_first - t_arrival, lookup_s=outcome.lookup_s,
            transfer_s=outcome.stats.transfer_s, decode_s=outcome.stats.decode_s, load_s=t_loaded - t_arrival,
            inject_s=t_injected - t_loaded, prefill_s=t_prefilled - t_injected,
            first_token_s=t_first - t_prefilled, e2e_s=t_end - t_arrival, output_ids=generated,
            loaded_tokens=n, bytes=outcome.stats.bytes, chunks=outcome.stats.chunks,
            recomputed_tokens=max(0, outcome.requested_tokens - n), load_error=outcome.stats.error)
