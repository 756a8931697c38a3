"""The offline oracle: the exact label-setting DP over a whole known rate trace, and the brute
force that checks it (the simulator that drives a policy: streaming.adapt.simulate). The
design is described in streaming.adapt (the package's face names these too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from streaming.adapt.clock import ClockModel
from streaming.adapt.estimate import TEXT


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
        labels = pareto(new, model.inject_s_per_token)
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
    return _best(((model.finish(st, kv), ut, path) for st, kv, ut, path in labels), slo_s)


def _best(candidates, slo_s: float) -> OracleResult:
    """The best of (finish s, utility, path) candidates, in their order: the highest
    utility (then earliest finish) with finish <= slo_s, else the earliest finish (then
    highest utility). Ties keep the first seen."""
    best_fit, best_any = None, None
    for fin, ut, path in candidates:
        if fin <= slo_s and (best_fit is None or (ut, -fin) > (best_fit[1], -best_fit[0])):
            best_fit = (fin, ut, path)
        if best_any is None or (-fin, ut) > (-best_any[0], best_any[1]):
            best_any = (fin, ut, path)
    fin, ut, path = best_fit or best_any
    return OracleResult(list(path), fin, ut, best_fit is not None)


def pareto(labels, inject_s_per_token: float):
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

    paths = itertools.product(model.options, repeat=model.n)
    return _best(((model.finish_s(path, rates_bytes_s), sum(model.util(k, o) for k, o in enumerate(path)),
                   path) for path in paths), slo_s)
