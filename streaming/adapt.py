"""Per-chunk quality adaptation to the measured bandwidth and an SLO (CacheGen section 5.2).

For each chunk, in order, the policy picks the highest quality level whose estimated
transfer time fits the chunk's share of the remaining time budget, else sends the chunk's
text for the engine to recompute (its cost: tokens / the engine's measured prefill speed).
The throughput estimate is the goodput measured on the previous KV chunk (paper: "the
throughput of the previous chunk"); the first chunk uses `initial_throughput_mbps`
(e.g. the link's nominal rate).

Budget for chunk k of n, at elapsed time t since the load started:
    remaining = slo_s - t - recompute_s(text chunks chosen so far) - decode_tail_s
    budget_k  = remaining / (n - k)
where decode_tail_s is the decode time of one chunk (the last chunk's decode cannot overlap
a transfer; measured on earlier chunks, `initial_decode_s` before that). In the pipeline a
chunk costs max(transfer, decode), so a level fits when max(size/throughput, decode) <=
budget_k. If neither a level nor the text fits, the cheaper of (lowest level, text) is
taken (the paper's goal is the smallest SLO overshoot; this deviates from "always text").

Pure functions (choose_level, simulate) are unit-tested on synthetic bandwidth.
Not runnable by itself; `python -m streaming.bench adapt` runs it on a real link.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Sequence

MIN_BYTES_FOR_ESTIMATE = 64 * 1024  # smaller transfers are latency-bound: keep the old estimate


@dataclass(frozen=True)
class Decision:
    """One per-chunk choice. level None means text fallback."""

    chunk: int
    level: int | None
    reason: str  # "fits", "text-fits", "cheapest-overshoot", "fixed"
    budget_s: float | None  # None for a fixed policy
    est_cost_s: float | None
    throughput_mbps_est: float | None
    elapsed_s: float

    @property
    def text_fallback(self) -> bool:
        return self.level is None


def choose_level(
    sizes: dict[int, int],
    levels: Sequence[int],
    n_tokens: int,
    budget_s: float,
    throughput_bytes_s: float,
    decode_s_est: float,
    prefill_tokens_per_s: float,
) -> tuple[int | None, str, float]:
    """Pick a level (or None = text) for one chunk -> (level, reason, estimated cost in s).

    sizes[level] = bytes of this chunk at that level; levels ascending in quality.
    Raises ValueError on non-positive throughput or prefill speed.
    """
    if throughput_bytes_s <= 0 or prefill_tokens_per_s <= 0:
        raise ValueError("throughput and prefill speed must be > 0")
    costs = {lv: max(sizes[lv] / throughput_bytes_s, decode_s_est) for lv in levels}
    for lv in sorted(levels, reverse=True):  # highest quality first
        if costs[lv] <= budget_s:
            return lv, "fits", costs[lv]
    text_cost = n_tokens / prefill_tokens_per_s
    if text_cost <= budget_s:
        return None, "text-fits", text_cost
    lowest = min(levels)
    if costs[lowest] <= text_cost:
        return lowest, "cheapest-overshoot", costs[lowest]
    return None, "cheapest-overshoot", text_cost


class AdaptivePolicy:
    """Stateful per-load policy used by streaming.client.stream_load.

    Args:
        slo_s: time budget (s) for loading the whole context (fetch + decode + recompute).
        prefill_tokens_per_s: the engine's measured prefill speed (tokens/s) for text chunks.
        initial_throughput_mbps: throughput guess for the first chunk (Mbit/s).
        initial_decode_s: decode time guess per chunk before one is measured (s).
        levels: restrict to these levels (default: all levels of the manifest).
    Call start(manifest) before use; choose(k, elapsed_s) before fetching chunk k;
    observe_transfer / observe_decode after. Thread-safe.
    """

    def __init__(self, slo_s: float, prefill_tokens_per_s: float, initial_throughput_mbps: float,
                 initial_decode_s: float = 0.0, levels: Sequence[int] | None = None):
        if slo_s <= 0 or prefill_tokens_per_s <= 0 or initial_throughput_mbps <= 0:
            raise ValueError("slo_s, prefill_tokens_per_s and initial_throughput_mbps must be > 0")
        self.slo_s = float(slo_s)
        self.prefill_tokens_per_s = float(prefill_tokens_per_s)
        self.throughput_bytes_s = initial_throughput_mbps * 1e6 / 8
        self.decode_s_est = float(initial_decode_s)
        self._only = list(levels) if levels is not None else None
        self.decisions: list[Decision] = []
        self.recompute_s = 0.0
        self._lock = threading.Lock()
        self.manifest = None

    def start(self, manifest) -> None:
        self.manifest = manifest
        lv = list(manifest.levels) if self._only is None else [x for x in self._only if x in manifest.levels]
        if not lv:
            raise ValueError(f"none of the levels {self._only} is stored (stored: {list(manifest.levels)})")
        self.levels = sorted(lv)

    def choose(self, k: int, elapsed_s: float) -> int | None:
        m = self.manifest
        n = m.chunk_count
        with self._lock:
            remaining = self.slo_s - elapsed_s - self.recompute_s - self.decode_s_est
            budget = remaining / (n - k)
            a, b = m.token_ranges[k]
            lv, why, cost = choose_level({x: m.sizes[x][k] for x in self.levels}, self.levels, b - a,
                                         budget, self.throughput_bytes_s, self.decode_s_est,
                                         self.prefill_tokens_per_s)
            if lv is None:
                self.recompute_s += cost
            self.decisions.append(Decision(k, lv, why, budget, cost, self.throughput_bytes_s * 8 / 1e6, elapsed_s))
        return lv

    def observe_transfer(self, k: int, level: int | None, nbytes: int, transfer_s: float) -> None:
        if nbytes >= MIN_BYTES_FOR_ESTIMATE and transfer_s > 0:
            with self._lock:
                self.throughput_bytes_s = nbytes / transfer_s

    def observe_decode(self, k: int, decode_s: float) -> None:
        with self._lock:
            self.decode_s_est = float(decode_s)


class FixedPolicy:
    """Always the same level (or a per-chunk list of levels; None entries = text)."""

    def __init__(self, level: int | Sequence[int | None]):
        self.level = level
        self.decisions: list[Decision] = []
        self.recompute_s = 0.0

    def start(self, manifest) -> None:
        self.manifest = manifest
        if isinstance(self.level, int) and self.level not in manifest.levels:
            raise ValueError(f"level {self.level} is not stored (stored: {list(manifest.levels)})")

    def choose(self, k: int, elapsed_s: float) -> int | None:
        lv = self.level if isinstance(self.level, int) else self.level[k]
        self.decisions.append(Decision(k, lv, "fixed", None, None, None, elapsed_s))
        return lv

    def observe_transfer(self, k, level, nbytes, transfer_s) -> None:
        pass

    def observe_decode(self, k, decode_s) -> None:
        pass


@dataclass
class SimResult:
    levels: list[int | None]
    total_s: float
    slo_violated: bool
    decisions: list[Decision] = field(default_factory=list)


def simulate(policy: AdaptivePolicy, manifest, bandwidth_mbps: Sequence[float], decode_s: float) -> SimResult:
    """Run the policy against a synthetic link (chunk k transfers at bandwidth_mbps[k]) with
    a pipelined decoder of `decode_s` per chunk; text chunks cost tokens/prefill speed after
    the load. Pure arithmetic (no clock): used by unit tests and to sanity-check traces."""
    policy.start(manifest)
    t_recv = 0.0  # when the receiver finishes chunk k
    t_dec = 0.0  # when the decoder finishes chunk k
    levels = []
    for k in range(manifest.chunk_count):
        lv = policy.choose(k, t_recv)
        levels.append(lv)
        if lv is None:
            continue
        nbytes = manifest.sizes[lv][k]
        dt = nbytes / (bandwidth_mbps[k] * 1e6 / 8)
        t_recv += dt
        policy.observe_transfer(k, lv, nbytes, dt)
        t_dec = max(t_dec, t_recv) + decode_s
        policy.observe_decode(k, decode_s)
    recompute = sum((b - a) for (a, b), lv in zip(manifest.token_ranges, levels) if lv is None) / policy.prefill_tokens_per_s
    total = max(t_recv, t_dec) + recompute
    return SimResult(levels, total, total > policy.slo_s, list(policy.decisions))
