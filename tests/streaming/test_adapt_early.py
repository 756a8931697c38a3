"""Early abandon: a running transfer is cut as soon as its projected finish at the
observed rate (bytes received / wire time) overruns its deadline, not at the deadline; the
partial transfer is a (provisional) throughput sample and the chunk is re-planned at that rate.
Pure policy arithmetic (streaming.adapt.AdaptivePolicy.should_abandon and simulate)."""

import pytest

from tests.helpers.policy import MBPS, Man, make_policy
from streaming.adapt import AdaptivePolicy, ClockModel, simulate


KIB64 = 64 * 1024
BPT = {0: 2200, 1: 3000, 2: 6100}  # bytes per token; 410-token chunks: 0.9 / 1.2 / 2.5 MB
DEC = {0: 2e-4, 1: 2e-4, 2: 2e-4}


def model_for(man, tps, overhead=0.0):
    return ClockModel({lv: man.sizes[lv] for lv in man.levels}, [410] * man.chunk_count, dict(DEC), tps,
                      request_overhead_s=overhead)


def policy(slo, tps, init=1000.0, overhead=0.0, **kw):
    return make_policy(slo, tps, init, decode_s_per_token=dict(DEC), request_overhead_s=overhead, **kw)


def _first_cut(pol, k, size, progress):
    """Walk 64 KiB progress checks of a transfer whose bytes arrive per progress(t) -> bytes
    (inverse given as bytes -> t); returns (t, bytes) of the first True, or None."""
    b = KIB64
    while b < size:
        t = progress(b)
        if pol.should_abandon(k, b, t):
            return t, b
        b += KIB64
    return None


def test_rate_drop_mid_chunk_is_cut_at_the_projected_time_not_the_deadline():
    man = Man(6, 410, BPT)
    pol = policy(4.0, 300, init=1000)
    pol.start(man)
    lv = pol.choose(0, 0.0)
    assert lv == 2
    size, dl = man.sizes[2][0], pol.transfer_deadline_s(0)
    planned = size / (1000 * MBPS)
    assert dl >= 1.5 * planned
    # 1000 Mbit/s for the first 512 KiB, then 5 Mbit/s (finish ~3.2 s): bytes b arrive at t(b)
    b1, r1, r2 = 512 * 1024, 1000 * MBPS, 5 * MBPS

    def t_of(b):
        return b / r1 if b <= b1 else b1 / r1 + (b - b1) / r2

    cut = _first_cut(pol, 0, size, t_of)
    assert cut is not None
    t, b = cut
    # the projection b / t at that check overruns the deadline, the check before did not
    assert t + (size - b) / (b / t) > dl
    tp = t_of(b - KIB64)
    assert tp + (size - (b - KIB64)) / ((b - KIB64) / tp) <= dl or b - KIB64 < KIB64
    # earlier than the deadline (the observed mean rate lags the drop: the cut comes once the
    # slow bytes dominate it), and than the finish at the slow rate
    assert t_of(size) > dl and b > b1 and t < 0.6 * dl


def test_no_early_abandon_when_the_projection_fits():
    man = Man(6, 410, BPT)
    pol = policy(4.0, 300, init=1000)
    pol.start(man)
    assert pol.choose(0, 0.0) == 2
    size, dl = man.sizes[2][0], pol.transfer_deadline_s(0)
    # slower than planned, but the projected finish stays within the deadline
    r = size / (0.9 * dl)
    assert _first_cut(pol, 0, size, lambda b: b / r) is None
    # and no projection before early_min_bytes / early_min_s: a fast start of 32 KiB at a crawl
    assert not pol.should_abandon(0, 32 * 1024, 10.0)
    assert not pol.should_abandon(0, KIB64, 0.01)  # 10 ms < early_min_s
    off = policy(4.0, 300, init=1000, early_abandon=False)
    off.start(man)
    off.choose(0, 0.0)
    assert not off.should_abandon(0, KIB64, 50.0)


def test_simulated_drop_cut_at_first_check_and_replanned_at_the_measured_rate():
    man = Man(10, 410, BPT)
    m = model_for(man, tps=300, overhead=0.002)
    trace = [1000] * 5 + [10] * 5
    pol = policy(4.0, 300, init=1000, overhead=0.002)
    r = simulate(pol, man, trace, model=m)
    assert r.levels[:5] == [2] * 5
    cut = [t for t in r.timeline if t["abandoned"]]
    assert cut and cut[0]["chunk"] == 5 and cut[0]["level"] == 2
    # the first progress check (64 KiB at 10 Mbit/s after the request overhead) already projects
    # ~2 s against a deadline well below that: cut there
    assert cut[0]["wire_s"] == pytest.approx(0.002 + KIB64 / (10 * MBPS))
    assert cut[0]["wire_s"] < 0.2 * cut[0]["budget_s"]
    # the partial transfer is a sample: chunk 5 is re-planned at ~10 Mbit/s (smallest level or text)
    d5 = [d for d in pol.decisions if d.chunk == 5][-1]
    assert d5.throughput_mbps_est == pytest.approx(10, rel=0.01)
    assert r.levels[5] in (0, None)
    # against the deadline rule alone, the early cut saves the time of the doomed attempt
    late = simulate(policy(4.0, 300, init=1000, overhead=0.002, early_abandon=False, partial_sample=False),
                    man, trace, model=m)
    late_cut = [t for t in late.timeline if t["abandoned"]][0]
    assert late_cut["wire_s"] == pytest.approx(late_cut["budget_s"])
    assert late_cut["wire_s"] > 5 * cut[0]["wire_s"]
    assert r.total_s < late.total_s


def test_constant_link_never_abandons():
    man = Man(10, 410, BPT)
    m = model_for(man, tps=300)
    r = simulate(policy(2.0, 300, init=1000), man, [1000] * 10, model=m)
    assert r.abandons == 0 and not r.slo_violated


def test_bad_early_parameters_raise():
    for bad in ({"early_min_s": -1}, {"early_margin": -0.1}, {"early_min_bytes": 0}):
        with pytest.raises(ValueError):
            policy(1.0, 1000, **bad)


def test_a_late_first_byte_is_not_the_link_the_wire_clock_projects():
    """A first byte that comes late (the server or its disk stalled before the response; CI,
    2026-12-01: a first chunk cut at an apparent 18.6 Mbit/s on a 100 Mbit/s link) is in
    elapsed_s but not in the receiver's wire clock: with wire_bytes / wire_s the projection
    is the link's rate and the transfer is kept; without them the same stall cuts it."""
    man = Man(6, 410, BPT)
    pol = policy(4.0, 300, init=1000)
    pol.start(man)
    assert pol.choose(0, 0.0) == 2
    size, dl = man.sizes[2][0], pol.transfer_deadline_s(0)
    stall = 0.6 * dl  # the first byte at 60% of the deadline, then the planned 1000 Mbit/s
    r = 1000 * MBPS
    b = 4 * KIB64
    el = stall + b / r
    assert el + (size - b) / r < dl  # the link would finish in time
    assert pol.should_abandon(0, b, el)  # the elapsed clock counts the stall as link time
    assert not pol.should_abandon(0, b, el, wire_bytes=b - 1460, wire_s=(b - 1460) / r)
    # a wire clock that has not seen two reads yet is no evidence either way
    assert not pol.should_abandon(0, b, el, wire_bytes=b, wire_s=None)
    # and a truly slow link is still cut from the wire clock
    slow = 5 * MBPS
    assert pol.should_abandon(0, b, stall + b / slow, wire_bytes=b - 1460, wire_s=(b - 1460) / slow)
