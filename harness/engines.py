"""Engines the benchmark measures TTFT on: ``hf`` (transformers, in-process) and ``vllm``.

TTFT is measured from request arrival to the first generated token and split into its
parts: lookup (store manifest), transfer, decode (pipelined with transfer: the load time
is reported separately as ``load_s``), inject (writing the KV into the engine's cache),
prefill (the tokens not loaded: the tail of the context and the question) and the first
token. Paper: CacheGen section 6 (TTFT = network + decode + remaining prefill).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass
class LoadOutcome:
    """What a KV load produced for one request.

    Attributes:
        k, v: ``[num_layers, loaded_tokens, num_kv_heads, head_dim]`` in the model dtype
            (None when nothing was loaded: a miss or text fallback of the first chunk).
        loaded_tokens: tokens of the prompt prefix whose KV was loaded.
        lookup_s, transfer_s, decode_s, load_s: seconds (load_s = wall time of the
            pipelined fetch + decode, <= transfer_s + decode_s).
        bytes: bytes that crossed the link.
        chunks: per-chunk records (index, level, text_fallback, bytes, transfer_s, decode_s).
    """

    k: torch.Tensor | None
    v: torch.Tensor | None
    loaded_tokens: int
    lookup_s: float = 0.0
    transfer_s: float = 0.0
    decode_s: float = 0.0
    load_s: float = 0.0
    bytes: int = 0
    chunks: list[dict[str, Any]] = field(default_factory=list)
    slo_violated: bool | None = None


@dataclass
class RequestTiming:
    """Timings of one request, seconds, measured at the engine (see module docstring)."""

    ttft_s: float
    lookup_s: float
    transfer_s: float
    decode_s: float
    load_s: float
    inject_s: float
    prefill_s: float
    first_token_s: float
    e2e_s: float
    output_ids: list[int]
    loaded_tokens: int
    bytes: int
    chunks: list[dict[str, Any]]
    slo_violated: bool | None = None

    @property
    def output_tokens_per_s(self) -> float | None:
        decode_time = self.e2e_s - self.ttft_s
        n = len(self.output_ids) - 1
        return n / decode_time if n > 0 and decode_time > 0 else None


class HFEngine:
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
        from kv_extraction_hf.inject import make_cache

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
            transfer_s=outcome.transfer_s, decode_s=outcome.decode_s, load_s=t_loaded - t_arrival,
            inject_s=t_injected - t_loaded, prefill_s=t_prefilled - t_injected,
            first_token_s=t_first - t_prefilled, e2e_s=t_end - t_arrival, output_ids=generated,
            loaded_tokens=n, bytes=outcome.bytes, chunks=outcome.chunks,
            slo_violated=outcome.slo_violated)
