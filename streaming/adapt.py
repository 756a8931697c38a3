"""Per-chunk quality adaptation to the measured bandwidth and an SLO (CacheGen section 5.2),
with an offline oracle and a clock model to judge it.

The policy (AdaptivePolicy) decides, before each chunk is requested, the chunk's level or
text fallback, keeping two clocks apart:

* link goodput: bytes / wire seconds of each KV chunk (request to last byte; the time the
  receiver waits on a full decode queue is never counted), corrected for the shaper's burst
  when the link states it (ThroughputEstimator). The estimate is the harmonic mean of the
  last few samples, the robust estimator of video ABR (FESTIVE, Jiang et al. CoNEXT 2012;
  MPC, Yin et al. SIGCOMM 2015); transfers too short to be above the burst are ignored.
  When the link has not been measured for a while (after text fallbacks) a cheap probe
  fetches the chunk at the lowest level with a deadline of half its text recompute.
* decode cost: seconds per token per level (DecodeTable), measured once at start on this
  machine and refined per chunk by an EWMA.

Planning is model-predictive (MPC, Yin et al. 2015): for chunk k the policy evaluates the
plans "chunk k at option o, then m chunks at level u, the rest as text" under the current
estimate with ClockModel.finish_s (transfer, pipelined decode, the last chunk's decode not
overlapped, injection, then recompute of text chunks at the measured prefill speed) and
takes the first step of the best plan that fits the SLO less a reserve (slo_margin,
slo_reserve_s; with dip_chunks, a reserve that shrinks while the window's lowest rate stays
high: dip_reserve_s) for a bandwidth dip; if none fits, of the plan with the smallest predicted
finish (smallest expected overshoot); text chosen for quality rather than speed is kept for
the end of the load (defer_text). Each KV transfer carries a
deadline (planned wire time * (1 + abandon_margin) + abandon_slack_s); the client cancels a
chunk that runs past it (streaming.client) and the policy re-plans that chunk at its
smallest level or text, with the upper bound it learned (rate < bytes / deadline). Earlier
than that, every 64 KiB of a running transfer the receiver asks should_abandon: a transfer
whose projected finish at its observed rate overruns the deadline is cut at once, and the
bytes it delivered are a (provisional) throughput sample the chunk is re-planned with.

oracle() knows the whole trace: an exact label-setting DP over chunks (Pareto labels of
receive clock, decode clock, recompute time, quality) picks per-chunk options maximizing
quality subject to the SLO, else minimizing the finish time. simulate() drives any policy
with ClockModel on a per-chunk rate trace, with the same abandon rules (deadline and early
progress checks) as the real client.

Run: `python -m bench.adapt` (real shaped link and simulated sweep); pure functions here are
unit-tested in tests/streaming/test_adapt_policy.py.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

from common.units import bytes_per_s_to_mbps, mbps_to_bytes_per_s
from streaming.adapt_params import (  # noqa: F401 - re-exported: one policy object (issue 27.3)
    DEFAULT_PRESET,
    POLICY_INPUTS,
    POLICY_PRESETS,
    POLICY_REQUEST_KEYS,
    PolicyParams,
    preset,
    split_policy_args,
)

MIN_BYTES_FOR_ESTIMATE = 64 * 1024  # below this a transfer is latency-bound: not a sample
BURST_SAMPLE_FACTOR = 4  # a sample must be >= this many shaper bursts (correction error bounded)
TEXT = None  # the option "send the chunk's text, recompute it"


# --------------------------------------------------------------------------- estimators
class ThroughputEstimator:
    """Harmonic mean of the last `window` goodput samples (bytes/s) - FESTIVE/MPC style.

    Args:
        initial_bytes_s: estimate before any sample (bytes/s), or None (unknown -> probe).
        window: samples kept (default 5).
        burst_bytes: the shaper's token-bucket burst, when the link states it (0 = unknown).
            A transfer of N bytes started with a full bucket takes (N - burst)/rate on the
            wire, so the sample is (N - burst) / wire_s (exact for a full bucket, low for a
            partly drained one, i.e. conservative).
        burst_s: when the burst follows the rate, burst = max(burst_bytes, rate * burst_s)
            (streaming.link's rule); the sample solves wire_s = (N - burst(rate)) / rate.
        prior_error, prior_until: a relative prediction error assumed until `prior_until`
            errors are measured (robust_estimate discounts by it from the start; None: off).
        min_sample_bytes: smaller transfers are ignored (default max(64 KiB, 4 * burst)).
    observe(nbytes, wire_s) -> bool (sample accepted); observe_upper_bound(rate) after an
    abandoned transfer (the true rate is below it); estimate() -> bytes/s or None.
    """

    def __init__(self, initial_bytes_s: float | None = None, window: int = 5, burst_bytes: int = 0,
                 min_sample_bytes: int | None = None, max_discount: float = 2.0, burst_s: float = 0.0,
                 prior_error: float | None = None, prior_until: int = 1):
        if window < 1 or max_discount < 1:
            raise ValueError("window must be >= 1 and max_discount >= 1")
        if (prior_error is not None and prior_error < 0) or prior_until < 1:
            raise ValueError("prior_error must be >= 0 and prior_until >= 1")
        self.max_discount = float(max_discount)
        self.prior_error = None if prior_error is None else float(prior_error)
        self.prior_until = int(prior_until)
        self.n_errors = 0  # prediction errors measured so far
        self.initial = initial_bytes_s
        self.burst = max(0, int(burst_bytes))
        self.burst_s = max(0.0, float(burst_s))
        self.min_bytes = int(min_sample_bytes if min_sample_bytes is not None
                             else max(MIN_BYTES_FOR_ESTIMATE, BURST_SAMPLE_FACTOR * self.burst))
        self.samples: deque[float] = deque(maxlen=window)
        self._is_bound: deque[bool] = deque(maxlen=window)  # sample i is an abandon's bound
        self.provisional = 0
        self.errors: deque[float] = deque(maxlen=window)  # |predicted - actual| / actual
        self.ignored = 0

    def observe(self, nbytes: int, wire_s: float) -> bool:
        if nbytes < self.min_bytes or wire_s <= 0 or wire_s < BURST_SAMPLE_FACTOR * self.burst_s:
            self.ignored += 1
            return False
        x = self.rate_from(nbytes, wire_s)
        if self.provisional:  # a measured transfer supersedes the bounds of abandoned ones
            kept = [s for s, p in zip(self.samples, self._is_bound) if not p]
            self.samples.clear()
            self.samples.extend(kept)
            self._is_bound.clear()
            self._is_bound.extend([False] * len(kept))
            self.provisional = 0
        pred = self.estimate()
        if pred is not None:
            self.errors.append(abs(pred - x) / x)
            self.n_errors += 1
        self._append(x, False)
        return True

    def _append(self, x: float, bound: bool) -> None:
        if len(self.samples) == self.samples.maxlen and self._is_bound and self._is_bound[0]:
            self.provisional -= 1
        self.samples.append(x)
        self._is_bound.append(bound)
        self.provisional += bound

    def add_bound(self, rate_bytes_s: float) -> None:
        """An abandoned transfer's upper bound (bytes/s) as a provisional sample: it weighs in
        the harmonic mean until the next measured transfer replaces it (a bound is not a
        measurement: kept, the link's recovery would be seen only `window` chunks later)."""
        self._append(max(1.0, float(rate_bytes_s)), True)

    def rate_from(self, nbytes: int, wire_s: float) -> float:
        """Rate (bytes/s) that moves nbytes in wire_s after a full bucket of
        max(burst_bytes, rate * burst_s)."""
        r_time = nbytes / (wire_s + self.burst_s) if self.burst_s > 0 else 0.0
        if r_time * self.burst_s >= self.burst and r_time > 0:
            return r_time
        return max(1.0, nbytes - self.burst) / wire_s

    def robust_estimate(self) -> float | None:
        """RobustMPC's discounted estimate (Yin et al. 2015): estimate / (1 + the largest
        relative prediction error over the window), the error capped at `max_discount` - 1
        (an outlier chunk must not collapse the plan: at most a 2x discount by default)."""
        e = self.estimate()
        errs = list(self.errors)
        if self.prior_error is not None and self.n_errors < self.prior_until:
            errs.append(self.prior_error)  # not yet `prior_until` measured errors: the prior stands
        if e is None or not errs:
            return e
        return e / min(self.max_discount, 1.0 + max(errs))

    def quantile_rate(self, z: float, horizon: int, prior_cv: float = 1.0, prior_n: int = 2) -> float | None:
        """Chance-constrained planning rate (bytes/s) for the next `horizon` transfers: with
        mu and sd the mean and standard deviation of 1/rate over the window (the harmonic mean
        is 1/mu), the time per byte of `horizon` transfers with independent rates is mu on
        average with sd / sqrt(horizon); this returns 1 / (mu + z * sd / sqrt(horizon)), the
        rate whose time is the z-quantile (normal approximation; z = 1.645: 95%). Until
        `prior_n` samples exist, sd is at least prior_cv * mu (an unmeasured link's rates
        spread). A constant link (sd = 0) gets its harmonic mean. The chance constraint of
        stochastic MPC (e.g. Mesbah, IEEE Control Systems 2016) applied to ABR's rate
        prediction (Yin et al., SIGCOMM 2015). None if nothing is known."""
        xs = list(self.samples) or ([self.initial] if self.initial else [])
        if not xs:
            return None
        inv = [1.0 / x for x in xs]
        mu = sum(inv) / len(inv)
        sd = (sum((v - mu) ** 2 for v in inv) / (len(inv) - 1)) ** 0.5 if len(inv) >= 2 else 0.0
        if len(inv) < prior_n:
            sd = max(sd, prior_cv * mu)
        return 1.0 / (mu + z * sd / math.sqrt(max(1, horizon)))

    def observe_upper_bound(self, rate_bytes_s: float) -> None:
        """An abandoned transfer: the link delivered fewer than rate_bytes_s. Enter it as a
        sample and drop older samples above it (they describe a link that is gone)."""
        r = max(1.0, float(rate_bytes_s))
        kept = [s for s in self.samples if s <= r]
        self.samples.clear()
        self.samples.extend(kept)
        self._is_bound.clear()
        self._is_bound.extend([False] * len(kept))
        self.provisional = 0
        self._append(r, False)

    def estimate(self) -> float | None:
        if not self.samples:
            return self.initial
        return len(self.samples) / sum(1.0 / s for s in self.samples)


class DecodeTable:
    """Decode seconds per token per level, EWMA-refined per chunk.

    Args: s_per_token {level: s/token} measured at start (e.g. bench.adapt measures the real
    codec on a real KV), alpha: EWMA weight of a new observation (0..1].
    """

    def __init__(self, s_per_token: dict[int, float], alpha: float = 0.3):
        if not s_per_token or any(v < 0 for v in s_per_token.values()):
            raise ValueError("decode table needs >= 0 s/token for at least one level")
        self.table = {int(k): float(v) for k, v in s_per_token.items()}
        self.alpha = float(alpha)

    def seconds(self, level: int, tokens: int) -> float:
        if level in self.table:
            return self.table[level] * tokens
        return max(self.table.values()) * tokens

    def observe(self, level: int, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds < 0:
            return
        x = seconds / tokens
        old = self.table.get(level)
        self.table[level] = x if old is None else (1 - self.alpha) * old + self.alpha * x


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

    def __post_init__(self):
        if self.prefill_tps <= 0:
            raise ValueError("prefill_tps must be > 0")
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
        r, d, rc = state
        return max(r, d) + kv_tokens * self.inject_s_per_token + rc

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


def choose_level(
    sizes: dict[int, int],
    levels: Sequence[int],
    n_tokens: int,
    budget_s: float,
    throughput_bytes_s: float,
    decode_s_est: float,
    prefill_tokens_per_s: float,
) -> tuple[int | None, str, float]:
    """Single-chunk rule: the highest level whose max(transfer, decode) fits budget_s, else
    text if it fits, else the option with the smallest cost -> (level or None, reason, cost s).
    Raises ValueError on non-positive throughput or prefill speed."""
    if throughput_bytes_s <= 0 or prefill_tokens_per_s <= 0:
        raise ValueError("throughput and prefill speed must be > 0")
    costs = {lv: max(sizes[lv] / throughput_bytes_s, decode_s_est) for lv in levels}
    for lv in sorted(levels, reverse=True):
        if costs[lv] <= budget_s:
            return lv, "fits", costs[lv]
    text_cost = n_tokens / prefill_tokens_per_s
    if text_cost <= budget_s:
        return None, "text-fits", text_cost
    lowest = min(levels)
    if costs[lowest] <= text_cost:
        return lowest, "cheapest-overshoot", costs[lowest]
    return None, "cheapest-overshoot", text_cost


def plan_mpc(model: ClockModel, k: int, state: tuple[float, float, float], kv_tokens: int,
             rate_bytes_s: float, slo_s: float, levels: Sequence[int] | None = None,
             allow_kv: bool = True, return_plan: bool = False, first_rate_bytes_s: float | None = None,
             text_only_slo_s: float | None = None, first_levels: Sequence[int] | None = None,
             defer_text: bool = False):
    """Best first step for chunks k..n-1 under a constant predicted rate.

    Candidate plans: chunk k at option o, then m chunks at level u, then text (all o, u, m).
    first_rate_bytes_s: a different predicted rate for chunk k alone (e.g. the bound learned
    from its abandoned transfer). text_only_slo_s: the limit for the plan "every remaining
    chunk as text" (default slo_s): it transfers nothing, so it needs no reserve for a
    bandwidth dip. first_levels: the levels chunk k itself may take (default: levels), e.g.
    only the smallest after its transfer was abandoned. defer_text: when the best plan
    starts with text but a plan starting with KV fits too, with at least as many text chunks
    later and chunk k at no lower a level than the text-first plan's KV chunks, and that KV
    transfer is faster than
    recomputing chunk k, the best such KV-first plan is taken: text chosen for quality (not
    for time) is kept for the end of the load, when the remaining budget is known (a text
    chunk's cost is certain; spent early, it leaves no slack for a later slow chunk).
    Returns (option for chunk k, predicted finish s, fits SLO), plus the plan's options for
    chunks k..n-1 when return_plan. Highest utility among the
    plans that fit (ties: a KV option now, keeping text for later as insurance, then the
    earlier finish); if none fits, the smallest predicted finish (ties: higher utility).
    """
    lvls = list(levels) if levels is not None else model.levels
    n = model.n
    rest = n - k - 1
    firsts = [TEXT] + ((list(first_levels) if first_levels is not None else lvls) if allow_kv else [])
    best_fit = None  # (utility, -finish, opt)
    best_any = None  # (-finish, utility, opt)
    best_kv: dict[int, tuple] = {}  # text chunks -> best fitting plan starting with KV (defer_text)
    tail_rc = [model.recompute_s(j) for j in range(k + 1, n)]
    tail_ut = [model.util(j, TEXT) for j in range(k + 1, n)]
    suffix_rc = [0.0] * (rest + 1)
    suffix_ut = [0.0] * (rest + 1)
    for i in range(rest - 1, -1, -1):
        suffix_rc[i] = suffix_rc[i + 1] + tail_rc[i]
        suffix_ut[i] = suffix_ut[i + 1] + tail_ut[i]
    for o in firsts:
        st0 = model.step(state, k, o, first_rate_bytes_s or rate_bytes_s)
        kv0 = kv_tokens + (0 if o is TEXT else model.tokens[k])
        u0 = model.util(k, o)
        for u in lvls:
            st, kv, ut = st0, kv0, u0
            for m in range(rest + 1):  # m chunks at level u, then text
                if m > 0:
                    j = k + m
                    st = model.step(st, j, u, rate_bytes_s)
                    kv += model.tokens[j]
                    ut += model.util(j, u)
                fin = model.finish((st[0], st[1], st[2] + suffix_rc[m]), kv)
                tot_u = ut + suffix_ut[m]
                kvfirst = o is not TEXT
                lim = slo_s if (kvfirst or m > 0 or text_only_slo_s is None) else text_only_slo_s
                if fin <= lim and (best_fit is None or (round(tot_u, 9), kvfirst, -fin) > best_fit[:3]):
                    best_fit = (round(tot_u, 9), kvfirst, -fin, o, (u, m))
                if kvfirst and fin <= lim:
                    c = rest - m
                    if c not in best_kv or (round(tot_u, 9), -fin) > best_kv[c][:2]:
                        best_kv[c] = (round(tot_u, 9), -fin, o, (u, m))
                if best_any is None or (-fin, tot_u) > best_any[:2]:
                    best_any = (-fin, tot_u, o, (u, m))
    if defer_text and best_fit is not None and best_fit[3] is TEXT:
        # the same number of text chunks, the first of them moved to the end of the load
        n_text = 1 + rest - best_fit[4][1]
        alt = [v for c, v in best_kv.items() if c >= n_text]
        # a pure reordering: chunk k gets the level the text-first plan gives its KV chunks (the
        # top level if it has none), never a lower one to make room for text later
        u0, m0 = best_fit[4]
        need = model.utility[u0] if m0 > 0 else max(model.utility[x] for x in lvls)
        alt = [v for v in alt if model.utility[v[2]] >= need - 1e-12]
        if alt:
            kv = max(alt)
            if model.transfer_s(k, kv[2], first_rate_bytes_s or rate_bytes_s) < model.recompute_s(k):
                best_fit = (kv[0], True, kv[1], kv[2], kv[3])
    if best_fit is not None:
        o, fin, fits, (u, m) = best_fit[3], -best_fit[2], True, best_fit[4]
    else:
        o, fin, fits, (u, m) = best_any[2], -best_any[0], False, best_any[3]
    if not return_plan:
        return o, fin, fits
    return o, fin, fits, [o] + [u] * m + [TEXT] * (rest - m)


def overrun_allowance_s(model: ClockModel, k: int, state: tuple[float, float, float], kv_tokens: int,
                        plan: Sequence[int | None], rate_bytes_s: float, slo_s: float) -> float:
    """Largest extra wire time (s) chunk k (plan[0], a level) may take with the rest of the
    plan still finishing within slo_s (0 if it already does not). Bisection; the finish is
    monotone in chunk k's wire time. Decode running behind the link gives slack here."""
    lv = plan[0]
    cost = model.transfer_s(k, lv, rate_bytes_s)
    rates = [rate_bytes_s] * (len(plan) - 1)

    def finish(x: float) -> float:
        r, d, rc = state
        r = r + cost + x
        d = max(d, r) + model.decode_s(k, lv)
        return model.finish_s(plan[1:], rates, (r, d, rc), k + 1, kv_tokens + model.tokens[k])

    if finish(0.0) > slo_s:
        return 0.0
    lo, hi = 0.0, max(slo_s, 1e-3)
    if finish(hi) <= slo_s:
        return hi
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if finish(mid) <= slo_s else (lo, mid)
    return lo


class AdaptivePolicy:
    """Stateful per-load policy used by streaming.client.stream_load and simulate().

    Args:
        slo_s: time budget (s) for loading the whole context (transfer + decode + injection
            + recompute of text chunks), measured from the load's start.
        prefill_tokens_per_s: the engine's measured prefill speed (tokens/s) for text chunks.
        initial_throughput_mbps: first estimate (Mbit/s), or None: probe first.
        initial_decode_s: decode seconds per chunk before any is measured (used when no
            decode_s_per_token table is given; spread over the chunk's tokens).
        levels: restrict to these levels (default: all levels of the manifest).
        decode_s_per_token: {level: s/token} measured at start (DecodeTable).
        inject_s_per_token: injection cost per loaded token (s).
        burst_bytes, burst_s: the link's stated shaper burst rule, max(burst_bytes, rate *
            burst_s) (ThroughputEstimator; streaming.link.ShapedLink.describe()).
        window: estimator window. abandon_margin / abandon_slack_s: a KV transfer is cut
            at planned wire time * (1 + margin) + slack. probe_after: chunks without a
            sample after which the link counts as unmeasured. utility: {level: utility per
            token} for planning (e.g. -KL); default ordinal.
        request_overhead_s: per-request latency added to bytes/rate in planning.
        probe_rate_mbps: the optimistic rate a probe tests (default: max(initial, 1000 Mbit/s),
            the top of this project's link range; pass the link's nominal rate).
        max_abandons: abandons per chunk after which its transfer runs without a deadline.
        slo_margin, slo_reserve_s: what planning holds back from the SLO, a fraction and
            seconds: plans must finish by max(slo_s * (1 - slo_margin) - slo_reserve_s,
            slo_s / 2), a reserve for transfers slower than estimated (a dip on a later chunk,
            the time an abandoned transfer wastes).
        overrun_share: the fraction of the plan's slack (overrun_allowance_s) one chunk's
            transfer may use before it is cut.
        robust: plan with ThroughputEstimator.robust_estimate (RobustMPC discount) instead of
            the plain harmonic mean. max_discount: that discount's cap (the plan's rate is at
            least estimate / max_discount; default 2).
        abandon_backoff: chunk k is re-planned, after its transfer was abandoned, at this
            fraction of the upper bound bytes/elapsed (multiplicative decrease, as in TCP).
        bound_provisional: the abandon's upper bound is a provisional estimator sample that
            the next measured transfer replaces (ThroughputEstimator.add_bound); False keeps
            it for the whole window.
        nofit_estimate: the rate a chunk is planned with when no plan fits at the discounted
            rate: "robust" (keep it), "mean" (the harmonic mean) or "last" (the last sample).
        smallest_no_restart: a transfer at the chunk's smallest level is not cut before the
            chunk's recompute time (after a cut only text is cheaper; ski-rental rule).
        after_abandon: "smallest" (default): after a cut the chunk takes its smallest level or
            text; "bound": re-planned at abandon_backoff x the learned bound (the old rule).
        slo_reserve_frac: caps slo_reserve_s at this fraction of the SLO (None: no cap).
        probe_level: "smallest" (default: the probe fetches the chunk's smallest level) or
            "plan" (the level a good link would get). probe_deadline_frac: the probe is cut
            after this fraction of the chunk's recompute time (default 0.5).
            probe_backoff: the wait before the next probe is multiplied by this after a
            failed probe (default 1: every probe_after text chunks).
        defer_text: text chosen for quality is deferred to the end of the load (plan_mpc).
        text_slack: text kept for the end counts as slack an overrunning transfer may use
            before it is cut (overrun_allowance_s on the plan with that text as KV).
        min_plan_frac: the planning limit's floor, slo_s * min_plan_frac (default 0.5): plans
            must finish by max(slo_s * (1 - slo_margin) - reserve, slo_s * min_plan_frac).
        prior_error, prior_until: RobustMPC's discount from the start: until `prior_until`
            prediction errors are measured, `prior_error` counts as one (None: off;
            ThroughputEstimator).
        risk_z, prior_cv: plan with ThroughputEstimator.quantile_rate(risk_z, chunks left,
            prior_cv), a chance-constrained rate, instead of the (robust) harmonic mean
            (None: off).
        early_abandon: decide early from the bytes already received (should_abandon): once
            early_min_bytes (default: the estimator's min_sample_bytes, max(64 KiB, 4 bursts))
            and early_min_s of wire time are in, a transfer whose projected finish at the
            observed rate exceeds its deadline x (1 + early_margin) is cut then, not at the
            deadline.
        partial_sample: a cut transfer's received bytes / wire time (when the receiver reports
            them and they pass the estimator's sample rules) is a throughput sample, provisional
            until the next complete transfer (ThroughputEstimator.add_bound), and the chunk is
            re-planned at that rate (instead of the upper bound bytes/deadline x backoff).
        dip_chunks, dip_min_samples: the reserve follows the link (dip_reserve_s): from
            dip_min_samples goodput samples on, min(fixed reserve, dip_chunks x the largest
            smallest-level chunk left / the lowest rate in the estimator's window); None: the
            fixed reserve min(slo_reserve_s, slo_reserve_frac x slo_s) throughout.
        A plan that sends every remaining chunk as text is held to slo_s * (1 - slo_margin)
        only (no slo_reserve_s: it transfers nothing). Rules: docs/streaming.md section 4.
    Call start(manifest) first; choose(k, elapsed_s) before chunk k; transfer_deadline_s(k)
    for the chunk just chosen; should_abandon(k, received_bytes, elapsed_s) while it transfers;
    observe_transfer / observe_abandon / observe_decode after.
    Thread-safe. Raises ValueError on non-positive SLO or speeds.
    """

    def __init__(self, slo_s: float, prefill_tokens_per_s: float, initial_throughput_mbps: float | None,
                 initial_decode_s: float = 0.0, levels: Sequence[int] | None = None, *,
                 decode_s_per_token: dict[int, float] | None = None, inject_s_per_token: float = 0.0,
                 burst_bytes: int = 0, window: int = 5, abandon_margin: float = 0.5,
                 abandon_slack_s: float = 0.01, probe_after: int = 2,
                 utility: dict[int, float] | None = None, text_utility: float = 0.0,
                 request_overhead_s: float = 0.001, min_sample_bytes: int | None = None,
                 probe_rate_mbps: float | None = None, max_abandons: int = 3, abandon_backoff: float = 0.5,
                 robust: bool = True, burst_s: float = 0.0, overrun_share: float = 0.5,
                 slo_margin: float = 0.05, bound_provisional: bool = True, slo_reserve_s: float = 0.0,
                 nofit_estimate: str = "robust", smallest_no_restart: bool = True,
                 after_abandon: str = "smallest", slo_reserve_frac: float | None = None,
                 probe_level: str = "smallest", probe_deadline_frac: float = 0.5, probe_backoff: float = 1.0,
                 defer_text: bool = True, text_slack: bool = True, prior_error: float | None = None,
                 prior_until: int = 1, risk_z: float | None = None, prior_cv: float = 1.0,
                 min_plan_frac: float = 0.5, early_abandon: bool = True,
                 early_min_bytes: int | None = None, early_min_s: float = 0.02, early_margin: float = 0.0,
                 partial_sample: bool = True, max_discount: float = 2.0, dip_chunks: float | None = None,
                 dip_min_samples: int = 2):
        bad_init = initial_throughput_mbps is not None and initial_throughput_mbps <= 0
        if slo_s <= 0 or prefill_tokens_per_s <= 0 or bad_init:
            raise ValueError("slo_s, prefill_tokens_per_s and initial_throughput_mbps must be > 0")
        self.slo_s = float(slo_s)
        self.prefill_tokens_per_s = float(prefill_tokens_per_s)
        init = None if initial_throughput_mbps is None else mbps_to_bytes_per_s(initial_throughput_mbps)
        self.est = ThroughputEstimator(init, window=window, burst_bytes=burst_bytes,
                                       min_sample_bytes=min_sample_bytes, burst_s=burst_s,
                                       prior_error=prior_error, prior_until=prior_until,
                                       max_discount=max_discount)
        if (risk_z is not None and risk_z < 0) or prior_cv < 0:
            raise ValueError("risk_z and prior_cv must be >= 0")
        self.risk_z = None if risk_z is None else float(risk_z)
        if not 0.0 < min_plan_frac <= 1.0:
            raise ValueError("min_plan_frac must be in (0, 1]")
        self.min_plan_frac = float(min_plan_frac)
        if early_min_s < 0 or early_margin < 0 or (early_min_bytes is not None and early_min_bytes < 1):
            raise ValueError("early_min_s and early_margin must be >= 0, early_min_bytes >= 1")
        self.early_abandon = bool(early_abandon)
        self.early_min_bytes = int(early_min_bytes if early_min_bytes is not None else self.est.min_bytes)
        self.early_min_s = float(early_min_s)
        self.early_margin = float(early_margin)
        self.partial_sample = bool(partial_sample)
        self.prior_cv = float(prior_cv)
        self.initial_decode_s = float(initial_decode_s)
        self._decode_table_arg = decode_s_per_token
        self.inject_s_per_token = float(inject_s_per_token)
        self.abandon_margin = float(abandon_margin)
        self.abandon_slack_s = float(abandon_slack_s)
        self.probe_after = int(probe_after)
        self._utility = utility
        self.text_utility = float(text_utility)
        pr = probe_rate_mbps or max(initial_throughput_mbps or 0.0, 1000.0)
        self.probe_rate_bytes_s = mbps_to_bytes_per_s(float(pr))
        self.max_abandons = int(max_abandons)
        self.robust = bool(robust)
        self.overrun_share = float(overrun_share)
        if not 0.0 <= slo_margin < 1.0:
            raise ValueError("slo_margin must be in [0, 1)")
        if slo_reserve_s < 0:
            raise ValueError("slo_reserve_s must be >= 0")
        self.slo_reserve_s = float(slo_reserve_s)
        self.text_slo_s = self.slo_s * (1.0 - float(slo_margin))  # an all-text plan needs no dip reserve
        if slo_reserve_frac is not None and not 0.0 <= slo_reserve_frac < 1.0:
            raise ValueError("slo_reserve_frac must be in [0, 1)")
        self.slo_reserve_frac = None if slo_reserve_frac is None else float(slo_reserve_frac)
        reserve = self.slo_reserve_s if self.slo_reserve_frac is None else min(
            self.slo_reserve_s, self.slo_reserve_frac * self.slo_s)
        self.plan_slo_s = max(self.text_slo_s - reserve, self.min_plan_frac * self.slo_s)
        self._reserve_cap = reserve
        if (dip_chunks is not None and dip_chunks < 0) or dip_min_samples < 0:
            raise ValueError("dip_chunks and dip_min_samples must be >= 0")
        self.dip_chunks = None if dip_chunks is None else float(dip_chunks)
        self.dip_min_samples = int(dip_min_samples)
        if probe_level not in ("smallest", "plan") or not 0.0 < probe_deadline_frac <= 1.0:
            raise ValueError("probe_level must be 'smallest' or 'plan', probe_deadline_frac in (0, 1]")
        self.probe_level = probe_level
        self.probe_deadline_frac = float(probe_deadline_frac)
        if probe_backoff < 1.0:
            raise ValueError("probe_backoff must be >= 1")
        self.probe_backoff = float(probe_backoff)
        self.defer_text = bool(defer_text)
        self.text_slack = bool(text_slack)
        self.abandon_backoff = float(abandon_backoff)
        self.bound_provisional = bool(bound_provisional)
        if nofit_estimate not in ("robust", "mean", "last"):
            raise ValueError("nofit_estimate must be 'robust', 'mean' or 'last'")
        self.nofit_estimate = nofit_estimate
        self.smallest_no_restart = bool(smallest_no_restart)
        if after_abandon not in ("smallest", "bound"):
            raise ValueError("after_abandon must be 'smallest' or 'bound'")
        self.after_abandon = after_abandon
        self.request_overhead_s = float(request_overhead_s)
        self._only = list(levels) if levels is not None else None
        self.decisions: list[Decision] = []
        self.recompute_s = 0.0
        self.abandons = 0
        self._lock = threading.Lock()
        self.manifest = None
        self.preset: str | None = None  # the PolicyParams preset it was built from, if any

    @classmethod
    def from_params(cls, slo_s: float, prefill_tokens_per_s: float,
                    initial_throughput_mbps: float | None,
                    params: "PolicyParams | str" = DEFAULT_PRESET, **inputs: Any) -> "AdaptivePolicy":
        """The policy of a :class:`streaming.adapt_params.PolicyParams` (or a preset's
        name: "default", "tuned", "tuned-dip") with this request's measurements: slo_s (s),
        prefill_tokens_per_s, initial_throughput_mbps (Mbit/s or None) and ``inputs`` (the
        non-tuned arguments: decode_s_per_token, utility, burst_bytes, probe_rate_mbps,
        ...). ``.preset`` records the preset's name (None for an unnamed PolicyParams).
        Raises ValueError (unknown preset, bad values)."""
        name = params if isinstance(params, str) else None
        p = preset(params) if isinstance(params, str) else params.checked()
        bad = sorted(set(inputs) & set(PolicyParams.field_names()))
        if bad:
            raise ValueError(f"{', '.join(bad)}: tuned parameters go in PolicyParams, not inputs")
        pol = cls(slo_s, prefill_tokens_per_s, initial_throughput_mbps, **inputs, **p.as_dict())
        pol.preset = name
        return pol

    @classmethod
    def from_request(cls, policy: dict[str, Any]) -> "AdaptivePolicy":
        """The policy of a request's ``kv_transfer_params["policy"]`` object: ``preset``
        (default DEFAULT_PRESET, "tuned"), the measurements of POLICY_INPUTS (slo_s,
        prefill_tokens_per_s, initial_throughput_mbps required) and optional PolicyParams
        field overrides (then ``.preset`` is "NAME+overrides"). Raises ValueError."""
        name, p, inputs = split_policy_args(policy)
        missing = [k for k in ("slo_s", "prefill_tokens_per_s", "initial_throughput_mbps")
                   if k not in inputs]
        if missing:
            raise ValueError(f"policy needs {', '.join(missing)}")
        pol = cls.from_params(inputs.pop("slo_s"), inputs.pop("prefill_tokens_per_s"),
                              inputs.pop("initial_throughput_mbps"), p, **inputs)
        pol.preset = name if p == preset(name) else f"{name}+overrides"
        return pol

    # -- compatibility with the previous policy's attributes
    @property
    def throughput_bytes_s(self) -> float | None:
        return self.est.estimate()

    def start(self, manifest) -> None:
        self.manifest = manifest
        lv = list(manifest.levels) if self._only is None else [x for x in self._only if x in manifest.levels]
        if not lv:
            raise ValueError(f"none of the levels {self._only} is stored (stored: {list(manifest.levels)})")
        self.levels = sorted(lv)
        tokens = [b - a for a, b in manifest.token_ranges]
        if self._decode_table_arg is not None:
            table = dict(self._decode_table_arg)
        else:
            per_tok = self.initial_decode_s / max(1, max(tokens))
            table = {x: per_tok for x in self.levels}
        for x in self.levels:  # a level missing from the table: the slowest known
            table.setdefault(x, max(table.values()))
        self.decode = DecodeTable(table)
        util = None if self._utility is None else {x: float(self._utility[x]) for x in self.levels}
        self.model = ClockModel({x: manifest.sizes[x] for x in self.levels}, tokens, self.decode.table,
                                self.prefill_tokens_per_s, self.inject_s_per_token, self.request_overhead_s,
                                0.0, util, None if util is None else self.text_utility)
        self.decisions = []
        self.history = []
        self.recompute_s = 0.0
        self._dec_free = 0.0  # predicted time the decoder has finished every received chunk
        self._kv_tokens = 0
        self._since_sample = 0
        self._probe_wait = self.probe_after  # doubles after each failed probe, reset by a sample
        self._last_reason: dict[int, str] = {}
        self._last_choice: dict[int, tuple[int | None, float]] = {}
        self._abandoned: dict[int, int] = {}
        self._bound: dict[int, float] = {}

    def dip_reserve_s(self, k: int) -> float:
        """The reserve (s) held back from the SLO when planning chunk k. Without dip_chunks (or
        before dip_min_samples goodput samples), the fixed reserve: min(slo_reserve_s,
        slo_reserve_frac x SLO). With dip_chunks: the time dip_chunks chunks at their smallest
        level would take at the lowest rate in the estimator's window (measured samples and
        abandons' provisional bounds), capped by that fixed reserve:
            min(reserve, dip_chunks x max_{j >= k} bytes_smallest[j] / min(window rates)).
        A link that has dipped deep keeps the whole reserve, one whose samples never went low
        keeps little: the reserve follows the dip the load has seen (the worst prediction error
        of the window, as RobustMPC's discount follows it - Yin et al., SIGCOMM 2015), in
        seconds of the one transfer the policy falls back to (after an abandon: the smallest
        level). Pure arithmetic."""
        cap = self._reserve_cap
        if self.dip_chunks is None or self.manifest is None:
            return cap
        xs = list(self.est.samples)
        if len(xs) < max(1, self.dip_min_samples):
            return cap
        m = self.model
        smallest = [min(m.sizes[x][j] for x in self.levels) for j in range(k, m.n)]
        if not smallest:
            return 0.0
        return min(cap, self.dip_chunks * max(smallest) / min(xs))

    def plan_limit_s(self, k: int) -> float:
        """The finish time (s) plans for chunk k must meet: max(SLO x (1 - slo_margin) -
        dip_reserve_s(k), SLO x min_plan_frac)."""
        return max(self.text_slo_s - self.dip_reserve_s(k), self.min_plan_frac * self.slo_s)

    def _state(self, elapsed_s: float) -> tuple[float, float, float]:
        return elapsed_s, max(self._dec_free, elapsed_s), self.recompute_s

    def choose(self, k: int, elapsed_s: float) -> int | None:
        """Option for chunk k (a level, or None = text) given the seconds since the load
        started. Records a Decision (the last one per chunk stays in .decisions)."""
        with self._lock:
            m = self.model
            if self.risk_z is not None:  # chance-constrained rate over the chunks left
                rate = self.est.quantile_rate(self.risk_z, m.n - k, self.prior_cv)
            else:
                rate = self.est.robust_estimate() if self.robust else self.est.estimate()
            st = self._state(elapsed_s)
            text_s = m.recompute_s(k)
            plan_slo = self.plan_limit_s(k)
            n_ab = self._abandoned.get(k, 0)
            stale = rate is None or self._since_sample >= self._probe_wait
            plan_rate = rate if rate is not None else self.probe_rate_bytes_s
            bound = self._bound.get(k)  # chunk k's own rate bound after an abandoned transfer
            first_rate = min(plan_rate, bound) if bound else None
            # after a cut, chunk k takes its smallest level or text: the dip's depth is unknown
            # (only rate < bound), and an intermediate level risks a second wasted transfer
            first_lv = None
            if n_ab and self.after_abandon == "smallest":
                first_lv = [min(self.levels, key=lambda x: m.sizes[x][k])]
            opt, fin, fits, plan = plan_mpc(m, k, st, self._kv_tokens, plan_rate, plan_slo, self.levels,
                                            return_plan=True, first_rate_bytes_s=first_rate,
                                            text_only_slo_s=self.text_slo_s, first_levels=first_lv,
                                            defer_text=self.defer_text)
            if not fits and rate is not None and self.nofit_estimate != "robust":
                # no plan fits at the conservative rate: the smallest EXPECTED overshoot is a
                # question for the unbiased estimate, not for the discounted lower one
                alt = self.est.estimate() if self.nofit_estimate == "mean" else self.est.samples[-1] \
                    if self.est.samples else None
                if alt is not None and alt > plan_rate:
                    plan_rate = alt
                    first_rate = min(plan_rate, bound) if bound else None
                    opt, fin, fits, plan = plan_mpc(m, k, st, self._kv_tokens, plan_rate, plan_slo,
                                                    self.levels, return_plan=True, first_rate_bytes_s=first_rate,
                                                    text_only_slo_s=self.text_slo_s, first_levels=first_lv,
                                            defer_text=self.defer_text)
                    fits = False  # it did not fit at the conservative rate: no extra allowance
            reason = "fits" if fits else "cheapest-overshoot"
            deadline_cap = None
            if n_ab:
                reason = "replan-after-abandon" if fits else "cheapest-overshoot"
            if stale and opt is TEXT and n_ab == 0:
                # the link is unmeasured: would a good link change this choice? then probe, cut
                # at probe_deadline_frac of one chunk's recompute time, if the plan can absorb it;
                # the probe is the chunk's smallest level ("smallest": cheapest to lose) or the
                # option a good link would get ("plan")
                o2, _, _ = plan_mpc(m, k, st, self._kv_tokens, self.probe_rate_bytes_s, plan_slo,
                                        self.levels)
                cap = self.probe_deadline_frac * text_s
                if o2 is not TEXT and (fin + cap <= plan_slo or not fits):
                    if self.probe_level == "smallest":
                        o2 = min(self.levels, key=lambda x: m.sizes[x][k])
                    opt, reason, deadline_cap = o2, "probe", cap
            elif stale and opt is not TEXT:
                reason = "probe"
            no_deadline = n_ab >= self.max_abandons
            if opt is TEXT:
                self.recompute_s += text_s
                budget, cost = text_s, text_s
            else:
                cost = m.transfer_s(k, opt, first_rate or plan_rate)
                budget = None if no_deadline else cost * (1 + self.abandon_margin) + self.abandon_slack_s
                if budget is not None and fits and reason != "probe":
                    # the plan's own slack (e.g. a decoder behind the link) may absorb an overrun
                    slack_plan = plan
                    if self.defer_text and self.text_slack:
                        # text kept for quality at the end is slack too: an overrun now costs a
                        # text chunk there (KV at the plan's level instead), not a cut
                        u = next((x for x in plan[1:] if x is not TEXT), opt)
                        slack_plan = [plan[0]] + [u if (x is TEXT and m.transfer_s(k + 1 + i, u, plan_rate)
                                                        < m.recompute_s(k + 1 + i)) else x
                                                  for i, x in enumerate(plan[1:])]
                    budget = max(budget, cost + self.overrun_share * overrun_allowance_s(
                        m, k, st, self._kv_tokens, slack_plan, first_rate or plan_rate, plan_slo))
                smallest = min(self.levels, key=lambda x: m.sizes[x][k])
                if budget is not None and (not fits or (self.smallest_no_restart and opt == smallest)):
                    # nothing fits, or this is already the smallest level (after a cut the only
                    # cheaper option is text; restarting the same bytes at a rate known to be
                    # lower never pays): cut only once the transfer has cost as much as
                    # recomputing (the ski-rental rule, 2-competitive)
                    budget = max(budget, text_s)
                if deadline_cap is not None:
                    budget = min(budget, deadline_cap) if budget is not None else deadline_cap
            self._last_choice[k] = (opt, budget)
            self._last_reason[k] = reason
            if self.decisions and self.decisions[-1].chunk == k:  # re-plan: keep the final one
                self.decisions.pop()
            hm = self.est.estimate()
            d = Decision(k, opt, reason, budget, cost, bytes_per_s_to_mbps(first_rate or plan_rate), elapsed_s, fin,
                         None if hm is None else bytes_per_s_to_mbps(hm))
            self.decisions.append(d)
            self.history.append(d)
        return opt

    def transfer_deadline_s(self, k: int) -> float | None:
        """Wire seconds after which the transfer of chunk k (as last chosen) is abandoned."""
        with self._lock:
            opt, budget = self._last_choice.get(k, (TEXT, None))
            return None if opt is TEXT else budget

    def should_abandon(self, k: int, received_bytes: int, elapsed_s: float,
                       wire_bytes: int | None = None, wire_s: float | None = None) -> bool:
        """Early abandon (issue 15): True when chunk k's running transfer should be cut now.

        received_bytes: bytes of the response received so far; elapsed_s: seconds since the
        request was sent (the clock of transfer_deadline_s). wire_bytes, wire_s: the
        receiver's wire clock, when it has one (streaming.client: the bytes after the first
        read and the seconds from the first to the last byte, by the kernel's receive
        timestamps; wire_s None before a second read), the clock of the completed transfers'
        goodput samples. The observed rate is wire_bytes / wire_s when wire_bytes is given,
        else received_bytes / (elapsed_s - request_overhead_s); burst-corrected as a goodput
        sample (ThroughputEstimator.rate_from: a shaper's burst makes a short transfer look
        faster, so the projection errs towards continuing). The wire clock keeps a late first
        byte (a server's or disk's stall before the response) and a receiver thread that was
        not scheduled out of the rate: neither is the link's (CI, 2026-12-01: a first chunk
        cut at an apparent 18.6 Mbit/s on a 100 Mbit/s link under load). It is trusted only from early_min_bytes
        and early_min_s of wire time on; the projected finish elapsed_s + bytes left / rate
        is compared with the chunk's deadline x (1 + early_margin). The rule of buffer-based
        ABR's abandonment of a segment download (dash.js AbandonRequestsRule; Spiteri et al.,
        BOLA, INFOCOM 2016), applied to CacheGen's per-chunk adaptation (section 5.2).
        Pure arithmetic; False for text, for a transfer without a deadline, or when off."""
        if not self.early_abandon or self.manifest is None:
            return False
        with self._lock:
            opt, budget = self._last_choice.get(k, (TEXT, None))
            if opt is TEXT or budget is None or received_bytes < self.early_min_bytes:
                return False
            if wire_bytes is not None:  # the receiver has a wire clock: only its rate counts
                if wire_s is None:  # not two reads yet: no wire time to trust
                    return False
                nb, wire = int(wire_bytes), float(wire_s)
            else:
                nb, wire = received_bytes, elapsed_s - self.request_overhead_s
            if wire < max(self.early_min_s, 1e-9) or nb <= 0:
                return False
            rate = self.est.rate_from(nb, wire)
            left = max(0, self.manifest.sizes[opt][k] - received_bytes)
            return elapsed_s + left / rate > budget * (1.0 + self.early_margin)

    def observe_transfer(self, k: int, level: int | None, nbytes: int, transfer_s: float,
                         elapsed_end_s: float | None = None) -> None:
        with self._lock:
            if self.est.observe(nbytes, transfer_s):
                self._since_sample = 0
                self._probe_wait = self.probe_after
            if level is not None and self.manifest is not None:
                tok = self.model.tokens[k]
                end = elapsed_end_s
                if end is None:  # request start + wire time
                    end = (self.decisions[-1].elapsed_s if self.decisions else 0.0) + transfer_s
                self._dec_free = max(self._dec_free, end) + self.decode.seconds(level, tok)
                self._kv_tokens += tok

    def observe_abandon(self, k: int, level: int, elapsed_wire_s: float,
                        received_bytes: int | None = None) -> None:
        """Chunk k's transfer at `level` was cut after elapsed_wire_s (s since its request):
        the rate is below bytes / elapsed_wire_s. received_bytes: what had arrived by then,
        when the receiver knows; with partial_sample it is a provisional goodput sample (if it
        passes the estimator's rules) and chunk k is re-planned at that rate. The next
        choose(k, ...) re-plans the chunk."""
        with self._lock:
            self.abandons += 1
            self._abandoned[k] = self._abandoned.get(k, 0) + 1
            wire = elapsed_wire_s - self.request_overhead_s
            e = self.est
            if (self.partial_sample and received_bytes is not None and wire > 0
                    and received_bytes >= e.min_bytes and wire >= BURST_SAMPLE_FACTOR * e.burst_s):
                # a measured rate, but of a short transfer: it enters the estimator as a
                # provisional sample (like an abandon's bound) that the next complete transfer
                # replaces, so that a link that recovers is seen at once
                measured = e.rate_from(int(received_bytes), wire)
                self._bound[k] = min(self._bound.get(k, math.inf), measured)
                e.add_bound(measured)
                self._since_sample = 0
                if self._last_reason.get(k) == "probe":
                    self._probe_wait *= self.probe_backoff
                self.history.append(Decision(k, level, "abandoned", self._last_choice.get(k, (None, None))[1],
                                             elapsed_wire_s, bytes_per_s_to_mbps(measured), -1.0))
                return
            nbytes = self.manifest.sizes[level][k]
            ub = self.est.rate_from(nbytes, max(elapsed_wire_s, 1e-6))
            # chunk k's rate is below ub: re-plan it with ub * backoff; later chunks see ub as
            # one more (optimistic) sample, the harmonic mean weighs it heavily
            prev = self._bound.get(k, math.inf)
            self._bound[k] = min(prev, ub * self.abandon_backoff)
            # an upper bound never raises the estimate (after a failed probe from a low prior,
            # bytes/deadline is far above the rate that made the probe fail)
            cur = self.est.estimate()
            ub_eff = ub if cur is None else min(ub, cur)
            if self.bound_provisional:
                self.est.add_bound(ub_eff)
            else:
                self.est._append(ub_eff, False)
            self._since_sample = 0
            if self._last_reason.get(k) == "probe":  # a failed probe: wait longer (back-off)
                self._probe_wait *= self.probe_backoff
            self.history.append(Decision(k, level, "abandoned", self._last_choice.get(k, (None, None))[1],
                                         elapsed_wire_s, bytes_per_s_to_mbps(self.est.estimate()), -1.0))

    def observe_text(self, k: int) -> None:
        with self._lock:
            self._since_sample += 1

    def observe_decode(self, k: int, decode_s: float) -> None:
        with self._lock:
            opt = self._last_choice.get(k, (TEXT, None))[0]
            if opt is not TEXT and self.manifest is not None:
                self.decode.observe(opt, self.model.tokens[k], decode_s)


class FixedPolicy:
    """Always the same level (or a per-chunk list of levels; None entries = text)."""

    def __init__(self, level: int | Sequence[int | None] | None):
        self.level = level
        self.decisions: list[Decision] = []
        self.recompute_s = 0.0

    def start(self, manifest) -> None:
        self.manifest = manifest
        if isinstance(self.level, int) and self.level not in manifest.levels:
            raise ValueError(f"level {self.level} is not stored (stored: {list(manifest.levels)})")
        self.decisions = []

    def choose(self, k: int, elapsed_s: float) -> int | None:
        lv = self.level if (self.level is None or isinstance(self.level, int)) else self.level[k]
        self.decisions.append(Decision(k, lv, "fixed", None, None, None, elapsed_s))
        return lv

    def transfer_deadline_s(self, k: int) -> float | None:
        return None

    def observe_transfer(self, k, level, nbytes, transfer_s, elapsed_end_s=None) -> None:
        pass

    def should_abandon(self, k, received_bytes, elapsed_s, wire_bytes=None, wire_s=None) -> bool:
        return False

    def observe_abandon(self, k, level, elapsed_wire_s, received_bytes=None) -> None:
        pass

    def observe_text(self, k) -> None:
        pass

    def observe_decode(self, k, decode_s) -> None:
        pass


# --------------------------------------------------------------------------- oracle
@dataclass
class OracleResult:
    options: list[int | None]
    finish_s: float
    utility: float
    fits: bool


def oracle_labels(model: ClockModel, rates_bytes_s: Sequence[float], max_labels: int = 20000) -> list:
    """The non-dominated (state, kv tokens, utility, options) labels after the last chunk:
    every SLO's optimum is among them (see oracle). Raises ValueError past max_labels."""
    labels = [((model.start_s, model.start_s, 0.0), 0, 0.0, ())]
    for k in range(model.n):
        new = []
        for st, kv, ut, path in labels:
            for o in model.options:
                st2 = model.step(st, k, o, rates_bytes_s[k])
                kv2 = kv + (0 if o is TEXT else model.tokens[k])
                new.append((st2, kv2, ut + model.util(k, o), path + (o,)))
        labels = _pareto(new, model.inject_s_per_token)
        if len(labels) > max_labels:
            raise ValueError(f"oracle: {len(labels)} labels exceed max_labels={max_labels}")
    return labels


def oracle(model: ClockModel, rates_bytes_s: Sequence[float], slo_s: float,
           max_labels: int = 20000, labels: list | None = None) -> OracleResult:
    """Offline optimum with the whole trace known: per-chunk options maximizing total
    utility subject to finish <= slo_s; if nothing fits, the options with the smallest
    finish. Exact label-setting DP: a label (recv clock, decode clock, recompute s,
    kv tokens, utility) is dropped only when another is no worse in all of them.
    `labels`: oracle_labels() of the same model and rates, to reuse across SLOs.
    Raises ValueError if the label set exceeds max_labels (use fewer chunks/levels)."""
    if labels is None:
        labels = oracle_labels(model, rates_bytes_s, max_labels)
    best_fit, best_any = None, None
    for st, kv, ut, path in labels:
        fin = model.finish(st, kv)
        if fin <= slo_s and (best_fit is None or (ut, -fin) > (best_fit[1], -best_fit[0])):
            best_fit = (fin, ut, path)
        if best_any is None or (-fin, ut) > (-best_any[0], best_any[1]):
            best_any = (fin, ut, path)
    fin, ut, path = best_fit or best_any
    return OracleResult(list(path), fin, ut, best_fit is not None)


def _pareto(labels, inject_s_per_token: float):
    """Non-dominated labels. Minimize recv, decode, recompute, (kv tokens when injection
    costs time); maximize utility. Exact (no rounding)."""
    import numpy as np

    if len(labels) <= 1:
        return labels
    inj = inject_s_per_token > 0
    a = np.array([[st[0], st[1], st[2], kv if inj else 0, -ut] for st, kv, ut, _ in labels])
    order = np.lexsort(a.T[::-1])
    a = a[order]
    kept = np.empty_like(a)
    nk = 0
    keep = []
    eps = 1e-12
    for i in range(len(a)):
        row = a[i]
        # sorted lexicographically: only an earlier row can dominate this one
        if nk and np.any(np.all(kept[:nk] <= row + eps, axis=1)):
            continue
        kept[nk] = row
        nk += 1
        keep.append(order[i])
    return [labels[i] for i in keep]


def brute_force(model: ClockModel, rates_bytes_s: Sequence[float], slo_s: float) -> OracleResult:
    """Exhaustive search over all option sequences (small n only; used to test oracle())."""
    import itertools

    best_fit, best_any = None, None
    for path in itertools.product(model.options, repeat=model.n):
        fin = model.finish_s(path, rates_bytes_s)
        ut = sum(model.util(k, o) for k, o in enumerate(path))
        if fin <= slo_s and (best_fit is None or (ut, -fin) > (best_fit[1], -best_fit[0])):
            best_fit = (fin, ut, path)
        if best_any is None or (-fin, ut) > (-best_any[0], best_any[1]):
            best_any = (fin, ut, path)
    fin, ut, path = best_fit or best_any
    return OracleResult(list(path), fin, ut, best_fit is not None)


# --------------------------------------------------------------------------- simulation
@dataclass
class SimResult:
    levels: list[int | None]
    total_s: float
    slo_violated: bool
    decisions: list[Decision] = field(default_factory=list)
    abandons: int = 0
    timeline: list[dict] = field(default_factory=list)


def simulate(policy, manifest, bandwidth_mbps: Sequence[float], decode_s: float | None = None,
             model: ClockModel | None = None, max_abandons_per_chunk: int = 10,
             progress_bytes: int = 64 * 1024) -> SimResult:
    """Drive `policy` with the clock model on a per-chunk rate trace (Mbit/s, chunk k's
    transfer runs at bandwidth_mbps[k]; the last value repeats). The same rules as the real
    client: wire time = bytes/rate + request overhead; a transfer past the policy's
    transfer_deadline_s is cut at the deadline, or earlier where the policy's
    should_abandon(k, bytes received, s since request) says so at a progress check (every
    progress_bytes of the response, as streaming.client checks, the bytes arriving at the
    chunk's rate after the request overhead); the cut attempt's bytes and time go to
    observe_abandon and the chunk is re-chosen; decode is pipelined
    (decode clock) at model.decode_s_per_token (or `decode_s` per chunk when no model is
    given); text chunks are recomputed after the load at the prefill speed.
    Pure arithmetic (no clock, no sleeps)."""
    if model is None:
        tokens = [b - a for a, b in manifest.token_ranges]
        per_tok = (decode_s or 0.0) / max(1, max(tokens))
        model = ClockModel({lv: manifest.sizes[lv] for lv in manifest.levels}, tokens,
                           {lv: per_tok for lv in manifest.levels}, policy.prefill_tokens_per_s
                           if hasattr(policy, "prefill_tokens_per_s") else 1e9)
    policy.start(manifest)
    n = manifest.chunk_count
    r, d, rc, kv = model.start_s, model.start_s, 0.0, 0
    levels, timeline = [], []
    ab_total = 0
    for k in range(n):
        rate = mbps_to_bytes_per_s(bandwidth_mbps[min(k, len(bandwidth_mbps) - 1)])
        tries = 0
        while True:
            lv = policy.choose(k, r)
            dec = policy.decisions[-1] if policy.decisions else None
            if lv is TEXT:
                rc += model.recompute_s(k)
                if hasattr(policy, "observe_text"):
                    policy.observe_text(k)
                timeline.append({"chunk": k, "level": None, "start_s": r, "wire_s": 0.0, "abandoned": False,
                                 "bandwidth_mbps": bytes_per_s_to_mbps(rate), "budget_s": dec.budget_s if dec else None,
                                 "est_mbps": dec.throughput_mbps_est if dec else None})
                break
            wire = model.transfer_s(k, lv, rate)
            dl = policy.transfer_deadline_s(k) if hasattr(policy, "transfer_deadline_s") else None
            cut = None  # (seconds since the request, bytes received) of a cut transfer
            if tries < max_abandons_per_chunk:
                early = getattr(policy, "should_abandon", None)
                size = manifest.sizes[lv][k]
                if early is not None:  # the receiver's progress checks, every progress_bytes
                    b = progress_bytes
                    while b < size:
                        t = model.request_overhead_s + b / rate
                        if dl is not None and t >= dl:
                            break
                        if early(k, b, t):
                            cut = (t, b)
                            break
                        b += progress_bytes
                if cut is None and dl is not None and wire > dl:
                    cut = (dl, int(max(0.0, dl - model.request_overhead_s) * rate))
            if cut is not None:
                timeline.append({"chunk": k, "level": lv, "start_s": r, "wire_s": cut[0], "abandoned": True,
                                 "bandwidth_mbps": bytes_per_s_to_mbps(rate), "budget_s": dl,
                                 "est_mbps": dec.throughput_mbps_est if dec else None})
                r += cut[0]
                try:
                    policy.observe_abandon(k, lv, cut[0], cut[1])
                except TypeError:  # a policy with the older 3-argument signature
                    policy.observe_abandon(k, lv, cut[0])
                tries += 1
                ab_total += 1
                continue
            timeline.append({"chunk": k, "level": lv, "start_s": r, "wire_s": wire, "abandoned": False,
                             "bandwidth_mbps": bytes_per_s_to_mbps(rate), "budget_s": dl,
                             "est_mbps": dec.throughput_mbps_est if dec else None})
            r += wire
            policy.observe_transfer(k, lv, manifest.sizes[lv][k], wire - model.request_overhead_s, r)
            ds = model.decode_s(k, lv)
            d = max(d, r) + ds
            policy.observe_decode(k, ds)
            kv += model.tokens[k]
            break
        levels.append(lv)
    total = max(r, d) + kv * model.inject_s_per_token + rc
    return SimResult(levels, total, total > getattr(policy, "slo_s", math.inf), list(policy.decisions),
                     ab_total, timeline)
