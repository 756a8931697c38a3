"""The simulator: drives any policy with the ClockModel on a per-chunk rate trace, with
the real client's rules (deadline cuts, progress checks, pipelined decode, text chunks
recomputed after the load). Pure arithmetic, no clock.

Apart from the oracle (streaming.adapt.oracle): the oracle knows the whole trace and
optimizes, the simulator only replays a policy's choices. Re-exported by streaming.adapt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from cachegen_common.units import bytes_per_s_to_mbps, mbps_to_bytes_per_s
from streaming.adapt.estimate import TEXT
from streaming.adapt.clock import ClockModel, Decision


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
    progress_bytes of the response, as streaming.load checks, the bytes arriving at the
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
