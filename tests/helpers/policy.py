"""The adaptive policy's test fixtures: one AdaptivePolicy from flat keyword arguments (tests
vary a few fields) and a synthetic manifest of equal chunks."""

from __future__ import annotations

import dataclasses

from streaming.adapt.params import PolicyInputs, PolicyParams
from streaming.adapt.policy import AdaptivePolicy

_INPUT_FIELDS = frozenset(f.name for f in dataclasses.fields(PolicyInputs))


def make_policy(slo_s: float, prefill_tokens_per_s: float, initial_throughput_mbps: float | None,
                **kw) -> AdaptivePolicy:
    """AdaptivePolicy(PolicyInputs(...), PolicyParams()): each keyword goes to the object that
    has a field of its name (PolicyInputs first); an unknown one raises ValueError."""
    inputs = {k: v for k, v in kw.items() if k in _INPUT_FIELDS}
    params = {k: v for k, v in kw.items() if k not in _INPUT_FIELDS}
    return AdaptivePolicy(PolicyInputs(slo_s, prefill_tokens_per_s, initial_throughput_mbps, **inputs),
                          PolicyParams().with_(**params))


MBPS = 1e6 / 8  # bytes/s per Mbit/s


class Man:
    """A manifest stand-in: n chunks of `tokens` tokens, each level's chunk
    bytes_per_token[level] x tokens bytes."""

    def __init__(self, n: int, tokens: int, bytes_per_token: dict[int, int]):
        self.levels = tuple(sorted(bytes_per_token))
        self.sizes = {lv: tuple([b * tokens] * n) for lv, b in bytes_per_token.items()}
        self.token_ranges = tuple((i * tokens, (i + 1) * tokens) for i in range(n))
        self.chunk_count = n
