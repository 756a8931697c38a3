"""The clock model of a load (ClockModel) and the per-chunk Decision (the planning arithmetic
over them: streaming.adapt.plan). The design is described in streaming.adapt (the package's
face names these too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from streaming.adapt.estimate import TEXT


# --------------------------------------------------------------------------- clock model
@dataclass
class ClockModel:
    """What one context load costs: the same arithmetic the policy plans with, the simulator
    runs and the oracle optimizes.

    sizes[level][k]: bytes of chunk k at level; tokens[k]: tokens of chunk k;
    decode_s_per_token[level]; prefill_tps: engine prefill tokens/s for text chunks;
    inject_s_per_token: injection of loaded KV; request_overhead_s: per-request latency on
    top of bytes/rate (calibrated from real runs); start_s: manifest lookup before chunk 0.
    utility[level] per token (higher is better; TEXT's utility is `text_utility`).
    queue_s: the engine's prefill queued ahead of this load (s): a plan that leaves any
    tokens to prefill finishes queue_s later (its text waits behind that queue); 0.0 = an
    idle engine, the finish of a model without it.
    """

    sizes: dict[int, Sequence[int]]
    tokens: Sequence[int]
    decode_s_per_token: dict[int, float]
    prefill_tps: float
    inject_s_per_token: float = 0.0
    request_overhead_s: float = 0.0
    start_s: float = 0.0
    utility: dict[int, float] | None = None
    text_utility: float | None = None
    queue_s: float = 0.0

    def __post_init__(self):
        if self.prefill_tps <= 0:
            raise ValueError("prefill_tps must be > 0")
        if not self.queue_s >= 0:
            raise ValueError("queue_s must be >= 0")
        self.levels = sorted(int(x) for x in self.sizes)
        self.n = len(self.tokens)
        if self.utility is None:  # ordinal proxy: higher level better, text (exact) best
            self.utility = {lv: float(i + 1) for i, lv in enumerate(self.levels)}
        if self.text_utility is None:
            self.text_utility = max(self.utility.values()) + 1.0

    @property
    def options(self) -> list[int | None]:
        return [TEXT] + list(self.levels)

    def util(self, k: int, opt: int | None) -> float:
        return self.tokens[k] * (self.text_utility if opt is TEXT else self.utility[opt])

    def transfer_s(self, k: int, level: int, rate_bytes_s: float) -> float:
        return self.sizes[level][k] / rate_bytes_s + self.request_overhead_s

    def decode_s(self, k: int, level: int) -> float:
        return self.decode_s_per_token[level] * self.tokens[k]

    def recompute_s(self, k: int) -> float:
        return self.tokens[k] / self.prefill_tps

    def step(self, state: tuple[float, float, float], k: int, opt: int | None,
             rate_bytes_s: float) -> tuple[float, float, float]:
        """(recv_clock, decode_clock, recompute_s) after chunk k with option opt."""
        r, d, rc = state
        if opt is TEXT:
            return r, d, rc + self.recompute_s(k)
        r = r + self.transfer_s(k, opt, rate_bytes_s)
        d = max(d, r) + self.decode_s(k, opt)
        return r, d, rc

    def finish(self, state: tuple[float, float, float], kv_tokens: int) -> float:
        """Predicted finish (s): the later clock, injection of kv_tokens, the recompute rc
        and, when rc > 0 (some tokens are left to prefill), the engine queue queue_s."""
        r, d, rc = state
        wait = self.queue_s if rc > 0 else 0.0
        return max(r, d) + kv_tokens * self.inject_s_per_token + rc + wait

    def finish_s(self, options: Sequence[int | None], rates_bytes_s: Sequence[float],
                 start: tuple[float, float, float] | None = None, first: int = 0,
                 kv_tokens_before: int = 0) -> float:
        """Predicted load finish (s from the load's start) of chunks first.. with options."""
        st = start if start is not None else (self.start_s, self.start_s, 0.0)
        kv = kv_tokens_before
        for i, opt in enumerate(options):
            k = first + i
            st = self.step(st, k, opt, rates_bytes_s[i])
            if opt is not TEXT:
                kv += self.tokens[k]
        return self.finish(st, kv)


# --------------------------------------------------------------------------- decisions
@dataclass(frozen=True)
class Decision:
    """One per-chunk choice. level None means text fallback. Units: s, Mbit/s."""

    chunk: int
    level: int | None
    reason: str  # "fits", "cheapest-overshoot", "probe", "replan-after-abandon", "fixed"
    budget_s: float | None  # planned time this chunk may take (wire deadline for KV)
    est_cost_s: float | None  # planned wire time (KV) or recompute time (text)
    throughput_mbps_est: float | None
    elapsed_s: float
    predicted_finish_s: float | None = None
    # the estimator's harmonic mean (Mbit/s) before the RobustMPC discount; throughput_mbps_est
    # is the rate the plan used (discounted, or the chunk's abandon bound, or the probe rate)
    estimate_mbps: float | None = None

    @property
    def text_fallback(self) -> bool:
        return self.level is None
