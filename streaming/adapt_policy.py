"""The per-load policies: AdaptivePolicy (MPC planning, deadlines, early abandon, probes) and
FixedPolicy. Split out of streaming.adapt (issue 27), which re-exports every name; the design
is described there.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Sequence

from cachegen_common.units import bytes_per_s_to_mbps, mbps_to_bytes_per_s
from streaming.adapt_params import DEFAULT_PRESET, PolicyParams, preset, split_policy_args
from streaming.adapt_estimate import BURST_SAMPLE_FACTOR, DecodeTable, TEXT, ThroughputEstimator
from streaming.adapt_model import ClockModel, Decision
from streaming.adapt_plan import overrun_allowance_s, plan_mpc


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
