"""The offline oracle (exact label-setting DP, brute force) and the simulator that drives any
policy with ClockModel on a per-chunk rate trace. Split out of streaming.adapt (issue 27),
which re-exports every name; the design is described there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from common.units import bytes_per_s_to_mbps, mbps_to_bytes_per_s
from streaming.adapt_model import ClockModel, Decision
from streaming.adapt_estimate import TEXT


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
