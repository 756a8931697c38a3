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
chunk that runs past it (streaming.load) and the policy re-plans that chunk at its
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

from streaming.adapt.params import (  # noqa: F401 - re-exported: one policy object
    DEFAULT_PRESET,
    POLICY_INPUTS,
    POLICY_PRESETS,
    POLICY_REQUEST_KEYS,
    PolicyInputs,
    PolicyParams,
    preset,
    split_policy_args,
)
from streaming.adapt.estimate import (  # noqa: F401 - the package's face
    MIN_BYTES_FOR_ESTIMATE, BURST_SAMPLE_FACTOR, TEXT, ThroughputEstimator, DecodeTable,
)
from streaming.adapt.clock import ClockModel, Decision  # noqa: F401 - the package's face
from streaming.adapt.plan import (  # noqa: F401 - the package's face
    choose_level, plan_mpc, overrun_allowance_s,
)
from streaming.adapt.policy import (  # noqa: F401 - the package's face
    AdaptivePolicy, FixedPolicy, Policy,
)
from streaming.adapt.oracle import (  # noqa: F401 - the package's face
    OracleResult, oracle_labels, oracle, pareto, brute_force,
)
from streaming.adapt.simulate import SimResult, simulate  # noqa: F401 - the package's face
