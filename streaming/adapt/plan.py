"""The planning arithmetic over a ClockModel: the single-chunk rule (choose_level), the
receding-horizon plan of the adaptive policy (plan_mpc) and the overrun a chunk may take
before it is cut (overrun_allowance_s). The model planned over is streaming.adapt.clock's
(that module describes a load, this one decides within it). Re-exported by streaming.adapt.
"""

from __future__ import annotations

from typing import Sequence

from streaming.adapt.estimate import TEXT
from streaming.adapt.clock import ClockModel


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
