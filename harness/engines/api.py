"""What every engine of the benchmark shares: the result of a KV load (:class:`LoadOutcome`),
the timings of one request (:class:`RequestTiming`, seconds, the TTFT split of
harness.engines' docstring), the merge of the adaptive policy's decisions into the chunk
records (:func:`merge_decisions`, the same for both engines) and the :class:`Engine` face.
Separate from the engines themselves (harness.engines.hf, harness.engines.vllm) so that each
imports these types without importing the other engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from harness.contexts import Context, Variant
from third_party.vllm.sources.base import LoadStats


@dataclass
class LoadOutcome:
    """What a KV load produced for one request.

    Attributes:
        k, v: ``[num_layers, loaded_tokens, num_kv_heads, head_dim]`` in the model dtype
            (None when nothing was loaded: a miss or text fallback of the first chunk).
        loaded_tokens: tokens of the prompt prefix whose KV was loaded.
        lookup_s, load_s: seconds of the store lookup and wall seconds of the pipelined
            fetch + decode (<= stats.transfer_s + stats.decode_s).
        stats: the source's ``third_party.vllm.sources.base.LoadStats`` (bytes that crossed
            the link, summed transfer_s / decode_s seconds, per-chunk records with the
            adaptive policy's throughput_mbps_est, decision, budget_s merged in, and
            ``error``: why the load stopped early, None if it did not); empty for no load.
        requested_tokens: tokens the load was asked for (the stored prefix, capped).
    """

    k: torch.Tensor | None
    v: torch.Tensor | None
    loaded_tokens: int
    lookup_s: float = 0.0
    load_s: float = 0.0
    stats: LoadStats = field(default_factory=LoadStats)
    requested_tokens: int = 0


@dataclass
class RequestTiming:
    """Timings of one request, seconds, measured at the engine (see module docstring).

    ``first_token_s`` is None under vLLM (its request metrics give TTFT, not the split
    between the last prefill step and sampling).
    """

    ttft_s: float
    lookup_s: float
    transfer_s: float
    decode_s: float
    load_s: float
    inject_s: float
    prefill_s: float
    first_token_s: float | None
    e2e_s: float
    output_ids: list[int]
    loaded_tokens: int
    bytes: int
    chunks: list[dict[str, Any]]
    # tokens of the requested KV load that the engine recomputed instead of loading (a
    # chunk that failed, a text fallback); load_error: why a load stopped early (None: it
    # did not). A recompute changes the output, so every run record says whether one happened.
    recomputed_tokens: int = 0
    load_error: str | None = None
    # why a KV request loaded nothing because the store served nothing for it (the
    # connector's miss reason, e.g. an identity mismatch); None for loads, text mode and
    # misses with a stored prefix (a policy's text decision). The harness records such a
    # request in "failures" (stage "load"): a KV mode that loaded nothing is never a result.
    miss_reason: str | None = None
    # process CPU seconds of the worker during the load (load_cpu_s / load_s =
    # cores the load got) and the threads/affinity the decode ran with (vLLM connector)
    load_cpu_s: float | None = None
    decode_threads: dict[str, Any] | None = None

    @property
    def output_tokens_per_s(self) -> float | None:
        """Generated tokens after the first per second of decoding (None for one token)."""
        decode_time = self.e2e_s - self.ttft_s
        n = len(self.output_ids) - 1
        return n / decode_time if n > 0 and decode_time > 0 else None


def merge_decisions(chunks: list[dict[str, Any]], decisions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copy the adaptive policy's per-chunk decision (``throughput_mbps_est``, ``decision``
    = its reason, ``budget_s``) into the matching chunk records (by ``index`` == ``chunk``).

    The same merge runs for both engines, so the run record carries the decisions under
    ``--engine hf`` and ``--engine vllm`` alike. Returns ``chunks`` (modified in place).
    """
    by_chunk = {d.get("chunk"): d for d in decisions or []}
    for ch in chunks:
        d = by_chunk.get(ch.get("index"))
        if d:
            ch.update(throughput_mbps_est=d.get("throughput_mbps_est"), decision=d.get("reason"),
                      budget_s=d.get("budget_s"))
    return chunks


# ----------------------------------------------------------------------------- engines
class Engine:
    """Common face of the engines: ``serve`` one request, ``close`` at the end."""

    name = "?"
    # what sets this engine's numerics (threads, binding, dtype, seed, relevant environment):
    # recorded in results.json ``environment.engine`` (docs/results-schema.md, "Reproducibility")
    settings: dict[str, Any] = {}

    def serve(self, ctx: Context, var: Variant, params: dict | None, max_new_tokens: int) -> RequestTiming:
        """Serve ``ctx``'s prompt loading its KV prefix as ``params`` says (None = text)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the engine (idempotent)."""
