"""The clock model of a load (ClockModel), the per-chunk Decision, and the planning arithmetic
(choose_level, plan_mpc, overrun_allowance_s). Split out of streaming.adapt (issue 27), which
re-exports every name; the design is described there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from streaming.adapt_estimate import TEXT


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
