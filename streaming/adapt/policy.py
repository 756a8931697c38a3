"""The per-load policies behind one :class:`Policy` protocol: AdaptivePolicy (MPC planning,
deadlines, early abandon, probes; CacheGen section 5.2, rules in docs/streaming.md section 4)
and FixedPolicy (one level, or one per chunk). streaming.load.stream_load drives either.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Protocol, Sequence, runtime_checkable

from cachegen_common.units import bytes_per_s_to_mbps, check_bandwidth_mbps, mbps_to_bytes_per_s
from streaming.adapt.params import PolicyInputs, PolicyParams, preset, split_policy_args
from streaming.adapt.estimate import BURST_SAMPLE_FACTOR, DecodeTable, TEXT, ThroughputEstimator
from streaming.adapt.clock import ClockModel, Decision
from streaming.adapt.plan import overrun_allowance_s, plan_mpc


@runtime_checkable
class Policy(Protocol):
    """What streaming.load.stream_load asks of a per-load policy. Call start(manifest)
    first; choose(k, elapsed_s) before chunk k (a level, or None = text);
    transfer_deadline_s(k) for the chunk just chosen (wire seconds, None = no deadline);
    should_abandon(...) while it transfers; observe_transfer / observe_abandon /
    observe_text / observe_decode after. ``decisions`` holds the last Decision per chunk and
    ``recompute_s`` the recompute seconds chosen so far."""

    decisions: list[Decision]
    recompute_s: float

    def start(self, manifest) -> None: ...

    def choose(self, k: int, elapsed_s: float) -> int | None: ...

    def transfer_deadline_s(self, k: int) -> float | None: ...

    def should_abandon(self, k: int, received_bytes: int, elapsed_s: float,
                       wire_bytes: int | None = None, wire_s: float | None = None) -> bool: ...

    def observe_transfer(self, k: int, level: int | None, nbytes: int, transfer_s: float,
                         elapsed_end_s: float | None = None) -> None: ...

    def observe_abandon(self, k: int, level: int, elapsed_wire_s: float,
                        received_bytes: int | None = None) -> None: ...

    def observe_text(self, k: int) -> None: ...

    def observe_decode(self, k: int, decode_s: float) -> None: ...


class AdaptivePolicy:
    """Stateful per-load policy (a :class:`Policy`) used by streaming.load.stream_load and
    streaming.adapt.simulate.simulate.

    Args:
        inputs: this load's measurements and link facts (:class:`PolicyInputs`: SLO in s,
            prefill tokens/s, initial throughput in Mbit/s, decode table, ...).
        params: the tuned parameters (:class:`PolicyParams`, or a preset's name: "default",
            "tuned", "tuned-dip"); their meanings are in PolicyParams' field comments and
            docs/streaming.md section 4. ``.preset`` records the preset's name (None for an
            unnamed PolicyParams).
    The rules in brief: plans must finish by max(slo_s x (1 - slo_margin) - reserve,
    slo_s x min_plan_frac), the reserve min(slo_reserve_s, slo_reserve_frac x slo_s) or the
    dip reserve (dip_reserve_s); a plan that sends every remaining chunk as text is held to
    slo_s x (1 - slo_margin) only (it transfers nothing). A KV transfer is cut at planned wire
    time x (1 + abandon_margin) + abandon_slack_s (extended by the plan's slack, and for the
    smallest level to the chunk's recompute time), or earlier when should_abandon projects an
    overrun from the bytes already received.
    The engine's load (inputs.engine_queue_tokens, prompt tokens queued ahead of this load):
    a plan that leaves tokens to prefill pays their queue at the prefill speed
    (ClockModel.queue_s), so a loaded engine gets plans that load more chunks (at coarser
    levels when the SLO requires) instead of counting on an idle engine's prefill.
    Thread-safe. Raises ValueError on non-positive SLO or speeds, a link rate
    (initial_throughput_mbps, probe_rate_mbps; Mbit/s) outside check_bandwidth_mbps's bound,
    or a bad parameter.
    """

    def __init__(self, inputs: PolicyInputs, params: PolicyParams | str = "default"):
        self.inputs = inputs.checked()
        for name in ("initial_throughput_mbps", "probe_rate_mbps"):  # link rates, Mbit/s
            if getattr(inputs, name) is not None:
                try:
                    check_bandwidth_mbps(getattr(inputs, name))
                except ValueError as e:
                    raise ValueError(f"{name}: {e}") from None
        self.params = preset(params) if isinstance(params, str) else params.checked()
        self.preset: str | None = params if isinstance(params, str) else None
        i, p = self.inputs, self.params
        self.slo_s = float(i.slo_s)
        self.prefill_tokens_per_s = float(i.prefill_tokens_per_s)
        init = None if i.initial_throughput_mbps is None else mbps_to_bytes_per_s(i.initial_throughput_mbps)
        self.est = ThroughputEstimator(init, window=p.window, burst_bytes=i.burst_bytes,
                                       min_sample_bytes=i.min_sample_bytes, burst_s=i.burst_s,
                                       prior_error=p.prior_error, prior_until=p.prior_until,
                                       max_discount=p.max_discount)
        self.early_min_bytes = int(p.early_min_bytes if p.early_min_bytes is not None else self.est.min_bytes)
        probe_mbps = i.probe_rate_mbps or max(i.initial_throughput_mbps or 0.0, 1000.0)
        self.probe_rate_bytes_s = mbps_to_bytes_per_s(float(probe_mbps))
        self.text_slo_s = self.slo_s * (1.0 - p.slo_margin)  # an all-text plan needs no dip reserve
        self._reserve_cap = p.slo_reserve_s if p.slo_reserve_frac is None else min(
            p.slo_reserve_s, p.slo_reserve_frac * self.slo_s)
        self.plan_slo_s = max(self.text_slo_s - self._reserve_cap, p.min_plan_frac * self.slo_s)
        self.decisions: list[Decision] = []
        self.recompute_s = 0.0
        self.abandons = 0
        self._lock = threading.Lock()
        self.manifest = None

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
        pol = cls(PolicyInputs(**inputs), p)
        pol.preset = name if p == preset(name) else f"{name}+overrides"
        return pol

    @property
    def throughput_bytes_s(self) -> float | None:
        """The estimator's harmonic-mean rate (bytes/s), None before any sample."""
        return self.est.estimate()

    def start(self, manifest) -> None:
        self.manifest = manifest
        only = self.inputs.levels
        lv = list(manifest.levels) if only is None else [x for x in only if x in manifest.levels]
        if not lv:
            raise ValueError(f"none of the levels {only} is stored (stored: {list(manifest.levels)})")
        self.levels = sorted(lv)
        tokens = [b - a for a, b in manifest.token_ranges]
        if self.inputs.decode_s_per_token is not None:
            table = dict(self.inputs.decode_s_per_token)
        else:
            per_tok = self.inputs.initial_decode_s / max(1, max(tokens))
            table = {x: per_tok for x in self.levels}
        for x in self.levels:  # a level missing from the table: the slowest known
            table.setdefault(x, max(table.values()))
        self.decode = DecodeTable(table)
        util = None if self.inputs.utility is None else {x: float(self.inputs.utility[x]) for x in self.levels}
        self.model = ClockModel({x: manifest.sizes[x] for x in self.levels}, tokens, self.decode.table,
                                self.prefill_tokens_per_s, self.inputs.inject_s_per_token,
                                self.inputs.request_overhead_s,
                                0.0, util, None if util is None else self.inputs.text_utility,
                                queue_s=self.inputs.engine_queue_s)
        self.decisions = []
        self.history = []
        self.recompute_s = 0.0
        self._dec_free = 0.0  # predicted time the decoder has finished every received chunk
        self._kv_tokens = 0
        self._since_sample = 0
        self._probe_wait = self.params.probe_after  # doubles after each failed probe, reset by a sample
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
        if self.params.dip_chunks is None or self.manifest is None:
            return cap
        xs = list(self.est.samples)
        if len(xs) < max(1, self.params.dip_min_samples):
            return cap
        m = self.model
        smallest = [min(m.sizes[x][j] for x in self.levels) for j in range(k, m.n)]
        if not smallest:
            return 0.0
        return min(cap, self.params.dip_chunks * max(smallest) / min(xs))

    def plan_limit_s(self, k: int) -> float:
        """The finish time (s) plans for chunk k must meet: max(SLO x (1 - slo_margin) -
        dip_reserve_s(k), SLO x min_plan_frac)."""
        return max(self.text_slo_s - self.dip_reserve_s(k), self.params.min_plan_frac * self.slo_s)

    def _state(self, elapsed_s: float) -> tuple[float, float, float]:
        return elapsed_s, max(self._dec_free, elapsed_s), self.recompute_s

    def choose(self, k: int, elapsed_s: float) -> int | None:
        """Option for chunk k (a level, or None = text) given the seconds since the load
        started. Records a Decision (the last one per chunk stays in .decisions)."""
        with self._lock:
            m = self.model
            st = self._state(elapsed_s)
            plan_slo = self.plan_limit_s(k)
            n_ab = self._abandoned.get(k, 0)
            rate = self._planning_rate(m.n - k)
            opt, fin, fits, plan, plan_rate, first_rate = self._best_plan(k, st, rate, plan_slo, n_ab)
            reason = "fits" if fits else "cheapest-overshoot"
            if n_ab:
                reason = "replan-after-abandon" if fits else "cheapest-overshoot"
            opt, reason, deadline_cap = self._maybe_probe(k, st, opt, fin, fits, reason, rate, plan_slo, n_ab)
            if opt is TEXT:
                self.recompute_s += m.recompute_s(k)
                budget = cost = m.recompute_s(k)
            else:
                cost = m.transfer_s(k, opt, first_rate or plan_rate)
                budget = self._transfer_budget_s(k, st, opt, cost, plan, fits, reason, first_rate or plan_rate,
                                                 plan_rate, plan_slo, n_ab, deadline_cap)
            self._record(k, opt, reason, budget, cost, first_rate or plan_rate, elapsed_s, fin)
        return opt

    def _planning_rate(self, chunks_left: int) -> float | None:
        """The rate (bytes/s) plans use: a chance-constrained quantile (risk_z), the RobustMPC
        discount (robust) or the plain harmonic mean; None before any sample."""
        p = self.params
        if p.risk_z is not None:
            return self.est.quantile_rate(p.risk_z, chunks_left, p.prior_cv)
        return self.est.robust_estimate() if p.robust else self.est.estimate()

    def _best_plan(self, k: int, st: tuple[float, float, float], rate: float | None, plan_slo: float,
                   n_ab: int) -> tuple[int | None, float, bool, list, float, float | None]:
        """plan_mpc for chunk k -> (option, predicted finish s, fits, plan, plan rate,
        chunk k's own rate or None). Unmeasured link: the probe rate. After a cut, chunk k
        takes its smallest level or text at its learned bound (the dip's depth is unknown,
        only rate < bound, and an intermediate level risks a second wasted transfer). When no
        plan fits at the conservative rate, nofit_estimate "mean" / "last" re-plans at the
        unbiased estimate: the smallest EXPECTED overshoot is its question."""
        m, p = self.model, self.params
        plan_rate = rate if rate is not None else self.probe_rate_bytes_s
        bound = self._bound.get(k)
        first_lv = None
        if n_ab and p.after_abandon == "smallest":
            first_lv = [min(self.levels, key=lambda x: m.sizes[x][k])]

        def plan_at(r: float):
            first = min(r, bound) if bound else None
            opt, fin, fits, plan = plan_mpc(m, k, st, self._kv_tokens, r, plan_slo, self.levels,
                                            return_plan=True, first_rate_bytes_s=first,
                                            text_only_slo_s=self.text_slo_s, first_levels=first_lv,
                                            defer_text=p.defer_text)
            return opt, fin, fits, plan, r, first

        best = plan_at(plan_rate)
        if not best[2] and rate is not None and p.nofit_estimate != "robust":
            alt = self.est.estimate() if p.nofit_estimate == "mean" else (
                self.est.samples[-1] if self.est.samples else None)
            if alt is not None and alt > plan_rate:
                opt, fin, _, plan, r, first = plan_at(alt)
                best = (opt, fin, False, plan, r, first)  # no fit at the conservative rate: no extra allowance
        return best

    def _maybe_probe(self, k: int, st: tuple[float, float, float], opt: int | None, fin: float, fits: bool,
                     reason: str, rate: float | None, plan_slo: float,
                     n_ab: int) -> tuple[int | None, str, float | None]:
        """(option, reason, deadline cap s or None) after the probe rule: the link is
        unmeasured (no sample yet, or probe_after text chunks since the last) and the plan
        says text - would a good link change this choice? Then probe, cut at
        probe_deadline_frac of one chunk's recompute time, if the plan can absorb it; the
        probe fetches the chunk's smallest level ("smallest": cheapest to lose) or the option
        a good link would get ("plan")."""
        m, p = self.model, self.params
        stale = rate is None or self._since_sample >= self._probe_wait
        if stale and opt is TEXT and n_ab == 0:
            o2, _, _ = plan_mpc(m, k, st, self._kv_tokens, self.probe_rate_bytes_s, plan_slo, self.levels)
            cap = p.probe_deadline_frac * m.recompute_s(k)
            if o2 is not TEXT and (fin + cap <= plan_slo or not fits):
                if p.probe_level == "smallest":
                    o2 = min(self.levels, key=lambda x: m.sizes[x][k])
                return o2, "probe", cap
        elif stale and opt is not TEXT:
            return opt, "probe", None
        return opt, reason, None

    def _transfer_budget_s(self, k: int, st: tuple[float, float, float], opt: int, cost: float, plan: list,
                           fits: bool, reason: str, rate: float, plan_rate: float, plan_slo: float, n_ab: int,
                           deadline_cap: float | None) -> float | None:
        """Wire seconds chunk k's transfer at `opt` may take before it is cut (None: no
        deadline, after max_abandons cuts): planned time x (1 + abandon_margin) +
        abandon_slack_s, extended by overrun_share of the plan's slack (text kept for the end
        counts as slack with text_slack), at least the chunk's recompute time when nothing fits
        or this is already its smallest level (the ski-rental rule, 2-competitive: after a cut
        only text is cheaper), at most the probe's cap."""
        m, p = self.model, self.params
        if n_ab >= p.max_abandons:
            return deadline_cap
        budget = cost * (1 + p.abandon_margin) + p.abandon_slack_s
        if fits and reason != "probe":
            slack_plan = plan
            if p.defer_text and p.text_slack:
                # text kept for quality at the end is slack too: an overrun now costs a text
                # chunk there (KV at the plan's level instead), not a cut
                u = next((x for x in plan[1:] if x is not TEXT), opt)
                slack_plan = [plan[0]] + [u if (x is TEXT and m.transfer_s(k + 1 + i, u, plan_rate)
                                                < m.recompute_s(k + 1 + i)) else x
                                          for i, x in enumerate(plan[1:])]
            budget = max(budget, cost + p.overrun_share * overrun_allowance_s(
                m, k, st, self._kv_tokens, slack_plan, rate, plan_slo))
        smallest = min(self.levels, key=lambda x: m.sizes[x][k])
        if not fits or (p.smallest_no_restart and opt == smallest):
            budget = max(budget, m.recompute_s(k))
        return budget if deadline_cap is None else min(budget, deadline_cap)

    def _record(self, k: int, opt: int | None, reason: str, budget: float | None, cost: float,
                rate: float, elapsed_s: float, fin: float) -> None:
        self._last_choice[k] = (opt, budget)
        self._last_reason[k] = reason
        if self.decisions and self.decisions[-1].chunk == k:  # re-plan: keep the final one
            self.decisions.pop()
        hm = self.est.estimate()
        d = Decision(k, opt, reason, budget, cost, bytes_per_s_to_mbps(rate), elapsed_s, fin,
                     None if hm is None else bytes_per_s_to_mbps(hm))
        self.decisions.append(d)
        self.history.append(d)

    def transfer_deadline_s(self, k: int) -> float | None:
        """Wire seconds after which the transfer of chunk k (as last chosen) is abandoned."""
        with self._lock:
            opt, budget = self._last_choice.get(k, (TEXT, None))
            return None if opt is TEXT else budget

    def should_abandon(self, k: int, received_bytes: int, elapsed_s: float,
                       wire_bytes: int | None = None, wire_s: float | None = None) -> bool:
        """Early abandon: True when chunk k's running transfer should be cut now.

        received_bytes: bytes of the response received so far; elapsed_s: seconds since the
        request was sent (the clock of transfer_deadline_s). wire_bytes, wire_s: the
        receiver's wire clock, when it has one (streaming.load: the bytes after the first
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
        if not self.params.early_abandon or self.manifest is None:
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
                nb, wire = received_bytes, elapsed_s - self.inputs.request_overhead_s
            if wire < max(self.params.early_min_s, 1e-9) or nb <= 0:
                return False
            rate = self.est.rate_from(nb, wire)
            left = max(0, self.manifest.sizes[opt][k] - received_bytes)
            return elapsed_s + left / rate > budget * (1.0 + self.params.early_margin)

    def observe_transfer(self, k: int, level: int | None, nbytes: int, transfer_s: float,
                         elapsed_end_s: float | None = None) -> None:
        with self._lock:
            if self.est.observe(nbytes, transfer_s):
                self._since_sample = 0
                self._probe_wait = self.params.probe_after
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
            wire = elapsed_wire_s - self.inputs.request_overhead_s
            e = self.est
            if (self.params.partial_sample and received_bytes is not None and wire > 0
                    and received_bytes >= e.min_bytes and wire >= BURST_SAMPLE_FACTOR * e.burst_s):
                # a measured rate, but of a short transfer: it enters the estimator as a
                # provisional sample (like an abandon's bound) that the next complete transfer
                # replaces, so that a link that recovers is seen at once
                measured = e.rate_from(int(received_bytes), wire)
                self._bound[k] = min(self._bound.get(k, math.inf), measured)
                e.add_bound(measured)
                self._since_sample = 0
                if self._last_reason.get(k) == "probe":
                    self._probe_wait *= self.params.probe_backoff
                self.history.append(Decision(k, level, "abandoned", self._last_choice.get(k, (None, None))[1],
                                             elapsed_wire_s, bytes_per_s_to_mbps(measured), -1.0))
                return
            nbytes = self.manifest.sizes[level][k]
            ub = self.est.rate_from(nbytes, max(elapsed_wire_s, 1e-6))
            # chunk k's rate is below ub: re-plan it with ub * backoff; later chunks see ub as
            # one more (optimistic) sample, the harmonic mean weighs it heavily
            prev = self._bound.get(k, math.inf)
            self._bound[k] = min(prev, ub * self.params.abandon_backoff)
            # an upper bound never raises the estimate (after a failed probe from a low prior,
            # bytes/deadline is far above the rate that made the probe fail)
            cur = self.est.estimate()
            ub_eff = ub if cur is None else min(ub, cur)
            if self.params.bound_provisional:
                self.est.add_bound(ub_eff)
            else:
                self.est._append(ub_eff, False)
            self._since_sample = 0
            if self._last_reason.get(k) == "probe":  # a failed probe: wait longer (back-off)
                self._probe_wait *= self.params.probe_backoff
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
    """Always the same level (or a per-chunk list of levels; None entries = text; "none":
    the slot of a codec without levels, streaming.load.policy_manifest)."""

    def __init__(self, level: int | Sequence[int | None] | None):
        self.level = level
        self.decisions: list[Decision] = []
        self.recompute_s = 0.0

    def start(self, manifest) -> None:
        self.manifest = manifest
        if isinstance(self.level, (int, str)) and self.level not in manifest.levels:
            raise ValueError(f"level {self.level} is not stored (stored: {list(manifest.levels)})")
        self.decisions = []

    def choose(self, k: int, elapsed_s: float) -> int | None:
        lv = self.level if (self.level is None or isinstance(self.level, (int, str))) else self.level[k]
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
