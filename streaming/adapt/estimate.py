"""Link goodput and decode-cost estimators of the adaptation policy (ThroughputEstimator,
DecodeTable), and the option constant TEXT. The design is described in streaming.adapt (the
package's face names these too).
"""

from __future__ import annotations

import math
from collections import deque


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
