"""The adaptive policy's tunable parameters as ONE frozen object with named presets
: the TTFT run (harness, run_benchmarks.py's `cachegen-adaptive` row), the
adaptation benchmark (`python -m bench.adapt`) and the vLLM connector (a request's
`kv_transfer_params["policy"]`) all build `streaming.adapt.AdaptivePolicy` from a
:class:`PolicyParams`, and the connector's trust layer (third_party/vllm/trust.py) allows
exactly :data:`POLICY_REQUEST_KEYS`: ``preset``, the per-request measurements
(:data:`POLICY_INPUTS`) and the fields of :class:`PolicyParams`.

Paper: CacheGen (Liu et al., SIGCOMM 2024) section 5.2 (choosing a level or text per chunk
under an SLO); the rules these parameters tune are docs/streaming.md section 4.

Presets (:data:`POLICY_PRESETS`):
- ``"default"``: AdaptivePolicy's own argument defaults (no reserve, RobustMPC discount,
  plan floor SLO / 2).
- ``"tuned"``: the values chosen on the TUNING traces only
  (bench/adapt/cli.py TUNING: the artifact's *generated* traces with 10 cyclic start offsets,
  40 synthetic iid-uniform 10-1000 Mbit/s traces (streaming.adapt.traces.synthetic_uniform, seed 1)
  with 10 offsets, constant and step traces; simulated; SLO 0.5/1/2/4 s; 435 requests per
  SLO): ``slo_reserve_s=0.3``, ``robust=False``, ``min_plan_frac=0.3`` (the rest equals the
  defaults). The artifact's 10 recorded traces are the evaluation set and were not used.
  This is what benchmarks/README.md's adaptation table reports and what run_benchmarks.py's
  ``cachegen-adaptive`` row runs by default (``--policy-preset``).
- ``"tuned-dip"``: ``tuned`` plus the dip reserve (``dip_chunks=5``,
  ``dip_min_samples=3``), selected by scripts/adapt_tune.py on tuning traces, evaluated and
  NOT adopted (docs/streaming.md section 4); ``python -m bench.adapt --dip-reserve``.

A library module (no command); imports nothing but the standard library (so flags and the
trust check need not load torch).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

# per-request measurements / link facts a caller supplies (not tuned): AdaptivePolicy's
# scalar arguments that are not PolicyParams fields
POLICY_INPUTS = ("slo_s", "prefill_tokens_per_s", "initial_throughput_mbps", "initial_decode_s",
                 "inject_s_per_token", "burst_bytes", "burst_s", "text_utility",
                 "request_overhead_s", "min_sample_bytes", "probe_rate_mbps", "engine_queue_tokens")


def _p(default: Any, kind: str, *choices: str):
    """A PolicyParams field: kind is "float", "int", "bool", "optfloat" (None or a number),
    "optint" or "choice" (one of ``choices``)."""
    return field(default=default, metadata={"kind": kind, "choices": choices})


@dataclass(frozen=True)
class PolicyParams:
    """The tunable arguments of streaming.adapt.AdaptivePolicy (meanings, units and rules:
    its docstring and docs/streaming.md section 4); defaults = AdaptivePolicy's defaults.
    Frozen: a preset cannot be changed in place; ``dataclasses.replace`` / :meth:`with_`
    make a variant. Validate with :meth:`checked` (ValueError naming the field)."""

    window: int = _p(5, "int")
    abandon_margin: float = _p(0.5, "float")
    abandon_slack_s: float = _p(0.01, "float")
    probe_after: int = _p(2, "int")
    max_abandons: int = _p(3, "int")
    abandon_backoff: float = _p(0.5, "float")
    robust: bool = _p(True, "bool")
    overrun_share: float = _p(0.5, "float")
    slo_margin: float = _p(0.05, "float")
    bound_provisional: bool = _p(True, "bool")
    slo_reserve_s: float = _p(0.0, "float")
    nofit_estimate: str = _p("robust", "choice", "robust", "mean", "last")
    smallest_no_restart: bool = _p(True, "bool")
    after_abandon: str = _p("smallest", "choice", "smallest", "bound")
    slo_reserve_frac: float | None = _p(None, "optfloat")
    probe_level: str = _p("smallest", "choice", "smallest", "plan")
    probe_deadline_frac: float = _p(0.5, "float")
    probe_backoff: float = _p(1.0, "float")
    defer_text: bool = _p(True, "bool")
    text_slack: bool = _p(True, "bool")
    prior_error: float | None = _p(None, "optfloat")
    prior_until: int = _p(1, "int")
    risk_z: float | None = _p(None, "optfloat")
    prior_cv: float = _p(1.0, "float")
    min_plan_frac: float = _p(0.5, "float")
    early_abandon: bool = _p(True, "bool")
    early_min_bytes: int | None = _p(None, "optint")
    early_min_s: float = _p(0.02, "float")
    early_margin: float = _p(0.0, "float")
    partial_sample: bool = _p(True, "bool")
    max_discount: float = _p(2.0, "float")
    dip_chunks: float | None = _p(None, "optfloat")
    dip_min_samples: int = _p(2, "int")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def as_dict(self) -> dict[str, Any]:
        """{field: value}: AdaptivePolicy keyword arguments (JSON-able)."""
        return dataclasses.asdict(self)

    def with_(self, **overrides: Any) -> "PolicyParams":
        """A checked copy with some fields replaced (ValueError on an unknown field or a
        value of the wrong kind)."""
        unknown = sorted(set(overrides) - set(self.field_names()))
        if unknown:
            raise ValueError(f"unknown policy parameter(s): {', '.join(unknown)}")
        return dataclasses.replace(self, **overrides).checked()

    def checked(self) -> "PolicyParams":
        """self, after checking every field's kind (bools are bools, numbers finite, ints
        integral, choices among theirs) and range. Raises ValueError naming the field."""
        for f in dataclasses.fields(self):
            check_value(f.name, getattr(self, f.name))
        for ok, message in _range_rules(self):
            if not ok:
                raise ValueError(message)
        return self


def _range_rules(p: PolicyParams) -> tuple[tuple[bool, str], ...]:
    """(holds, message) for each rule between the fields' values (kinds checked before)."""
    return (
        ((p.risk_z is None or p.risk_z >= 0) and p.prior_cv >= 0, "risk_z and prior_cv must be >= 0"),
        (0.0 < p.min_plan_frac <= 1.0, "min_plan_frac must be in (0, 1]"),
        (p.early_min_s >= 0 and p.early_margin >= 0 and (p.early_min_bytes is None or p.early_min_bytes >= 1),
         "early_min_s and early_margin must be >= 0, early_min_bytes >= 1"),
        (0.0 <= p.slo_margin < 1.0, "slo_margin must be in [0, 1)"),
        (p.slo_reserve_s >= 0, "slo_reserve_s must be >= 0"),
        (p.slo_reserve_frac is None or 0.0 <= p.slo_reserve_frac < 1.0, "slo_reserve_frac must be in [0, 1)"),
        ((p.dip_chunks is None or p.dip_chunks >= 0) and p.dip_min_samples >= 0,
         "dip_chunks and dip_min_samples must be >= 0"),
        (0.0 < p.probe_deadline_frac <= 1.0, "probe_deadline_frac must be in (0, 1]"),
        (p.probe_backoff >= 1.0, "probe_backoff must be >= 1"),
        (p.window >= 1 and p.max_abandons >= 0, "window must be >= 1, max_abandons >= 0"),
    )


@dataclass(frozen=True)
class PolicyInputs:
    """One load's measurements and link facts (not tuned): what AdaptivePolicy needs besides
    its :class:`PolicyParams`.

    slo_s: time budget (s) for loading the whole context (transfer + decode + injection +
    recompute of text chunks), from the load's start. prefill_tokens_per_s: the engine's
    measured prefill speed for text chunks. initial_throughput_mbps: first estimate (Mbit/s),
    or None: probe first. initial_decode_s: decode seconds per chunk before any is measured
    (used when no decode_s_per_token table is given; spread over the chunk's tokens).
    inject_s_per_token: injection cost per loaded token (s). burst_bytes, burst_s: the
    link's stated shaper burst rule, max(burst_bytes, rate x burst_s)
    (streaming.link.ShapedLink.describe()). text_utility, utility: the utility per token of
    text and of each level ({level: utility}, e.g. -KL; default ordinal) for planning.
    request_overhead_s: per-request latency added to bytes / rate in planning.
    min_sample_bytes: the estimator's smallest sample (default max(64 KiB, 4 bursts)).
    probe_rate_mbps: the optimistic rate a probe tests (default max(initial, 1000 Mbit/s), the
    top of this project's link range; pass the link's nominal rate). levels: restrict to these
    levels (default: every level of the manifest). decode_s_per_token: {level: s/token}
    measured at start (DecodeTable). engine_queue_tokens: the engine's load at this load's
    start, prompt tokens that requests ahead of this one (arrived earlier, not finished)
    have yet to prefill (the vLLM connector's scheduler side observes it,
    third_party.vllm.engine_load.engine_queue_tokens); tokens the policy leaves to prefill
    wait behind them, so a plan with any text chunk pays engine_queue_tokens /
    prefill_tokens_per_s seconds more (:attr:`engine_queue_s`). 0 (the default): an idle
    engine, the plans of a policy without this input. Validate with :meth:`checked`
    (ValueError)."""

    slo_s: float
    prefill_tokens_per_s: float
    initial_throughput_mbps: float | None
    initial_decode_s: float = 0.0
    inject_s_per_token: float = 0.0
    burst_bytes: int = 0
    burst_s: float = 0.0
    text_utility: float = 0.0
    request_overhead_s: float = 0.001
    min_sample_bytes: int | None = None
    probe_rate_mbps: float | None = None
    engine_queue_tokens: int = 0
    levels: tuple[int, ...] | None = None
    decode_s_per_token: dict[int, float] | None = None
    utility: dict[int, float] | None = None

    @property
    def engine_queue_s(self) -> float:
        """Seconds the engine needs for the prefill queued ahead of this load
        (engine_queue_tokens / prefill_tokens_per_s); 0.0 on an idle engine."""
        return float(self.engine_queue_tokens) / float(self.prefill_tokens_per_s)

    def checked(self) -> "PolicyInputs":
        """self, after checking the speeds and the engine load: ValueError on a non-positive
        SLO, prefill speed or initial throughput, or an engine_queue_tokens that is not a
        whole number >= 0."""
        bad_init = self.initial_throughput_mbps is not None and self.initial_throughput_mbps <= 0
        if self.slo_s <= 0 or self.prefill_tokens_per_s <= 0 or bad_init:
            raise ValueError("slo_s, prefill_tokens_per_s and initial_throughput_mbps must be > 0")
        q = self.engine_queue_tokens
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not math.isfinite(q) \
                or q < 0 or not float(q).is_integer():
            raise ValueError(f"engine_queue_tokens must be a whole number >= 0, got {q!r}")
        return self


def check_value(name: str, value: Any) -> Any:
    """Check one PolicyParams field value by its kind; returns it. ValueError otherwise."""
    f = _FIELDS.get(name)
    if f is None:
        raise ValueError(f"unknown policy parameter {name!r}")
    kind, choices = f.metadata["kind"], f.metadata["choices"]
    if value is None and kind in ("optfloat", "optint"):
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"policy.{name} must be true or false")
    elif kind == "choice":
        if value not in choices:
            raise ValueError(f"policy.{name} must be one of {', '.join(choices)}")
    else:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"policy.{name} must be a finite number")
        if kind in ("int", "optint") and not float(value).is_integer():
            raise ValueError(f"policy.{name} must be an integer")
    return value


_FIELDS = {f.name: f for f in dataclasses.fields(PolicyParams)}

_TUNED = PolicyParams(slo_reserve_s=0.3, robust=False, min_plan_frac=0.3)
POLICY_PRESETS: dict[str, PolicyParams] = {
    "default": PolicyParams(),
    "tuned": _TUNED,
    "tuned-dip": dataclasses.replace(_TUNED, dip_chunks=5, dip_min_samples=3),
}
"""Named presets (module docstring: what each is and the traces "tuned" was tuned on).
Read-only by convention; the values are frozen objects."""

DEFAULT_PRESET = "tuned"
"""The preset of run_benchmarks.py's cachegen-adaptive row and of bench.adapt (benchmarks/README.md's
adaptation table reports it)."""

POLICY_REQUEST_KEYS = ("preset",) + POLICY_INPUTS + PolicyParams.field_names()
"""Every key a request's ``policy`` object may hold (the connector's trust allow-list)."""


def preset(name: str) -> PolicyParams:
    """The named preset; ValueError naming the known ones otherwise."""
    try:
        return POLICY_PRESETS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown policy preset {name!r} (known: {', '.join(POLICY_PRESETS)})") from None


def split_policy_args(policy: dict[str, Any]) -> tuple[str, PolicyParams, dict[str, Any]]:
    """A request-style policy dict -> (preset name, its PolicyParams with the dict's field
    overrides, the per-request inputs). ``preset`` omitted: :data:`DEFAULT_PRESET` ("tuned":
    "adaptive" means the same policy everywhere unless a preset is named). Raises ValueError
    on an unknown key or preset or a value of the wrong kind."""
    d = dict(policy)
    name = d.pop("preset", DEFAULT_PRESET)
    unknown = sorted(set(d) - set(POLICY_REQUEST_KEYS))
    if unknown:
        raise ValueError(f"policy keys not allowed: {', '.join(map(str, unknown))}")
    inputs = {k: d.pop(k) for k in list(d) if k in POLICY_INPUTS}
    return name, preset(name).with_(**d), inputs
