"""Re-planning after an abandon (smallest level or text), the cheap probe
with back-off after a failed one, and the reserve capped as a fraction of the SLO. Pure
policy arithmetic on synthetic traces (streaming.adapt.simulate)."""

import pytest

from tests.helpers.policy import MBPS, Man, make_policy
from streaming.adapt import AdaptivePolicy, ClockModel, simulate



BPT = {0: 2200, 1: 3000, 2: 4500, 3: 6100}
DEC = {lv: 2e-5 for lv in BPT}


def model_for(man, tps, tokens=410):
    return ClockModel({lv: man.sizes[lv] for lv in man.levels}, [tokens] * man.chunk_count, dict(DEC), tps)


def policy(slo, tps, init=1000.0, **kw):
    return make_policy(slo, tps, init, decode_s_per_token=dict(DEC), request_overhead_s=0.0, **kw)


@pytest.mark.parametrize("rule", ["smallest", "bound"])
def test_after_an_abandon_the_chunk_takes_its_smallest_level_or_text(rule):
    man = Man(6, 410, BPT)
    m = model_for(man, tps=300)  # text: 1.37 s a chunk
    trace = [1000, 1000, 1000, 40, 1000, 1000]  # a dip on chunk 3
    # defer_text off: no text kept for the end, so the plan has no slack to absorb the dip
    pol = policy(3.0, 300, init=1000, after_abandon=rule, defer_text=False)
    r = simulate(pol, man, trace, model=m)
    cut = [t for t in r.timeline if t["abandoned"]]
    assert cut and cut[0]["chunk"] == 3 and cut[0]["level"] == 3
    tries = [t["level"] for t in r.timeline if t["chunk"] == 3]
    if rule == "smallest":  # no intermediate level risks a second wasted transfer
        assert tries[1:] in ([0], [None]) and len(cut) == 1
    else:  # the old rule re-plans at half the bound: a larger level, at the risk of another cut
        assert tries[1] not in (0, None)
    assert not r.slo_violated


@pytest.mark.parametrize("backoff,expected", [(1.0, [2, 4, 6, 8, 10]), (2.0, [2, 6])])
def test_failed_probe_is_cheap_and_backs_off(backoff, expected):
    man = Man(12, 410, BPT)
    m = model_for(man, tps=300)
    pol = policy(10.0, 300, init=1, probe_rate_mbps=1000, probe_after=2, probe_deadline_frac=0.5,
                 probe_backoff=backoff)
    r = simulate(pol, man, [1] * 12, model=m)  # the link never recovers
    probes = [d for d in pol.history if d.reason == "probe"]
    assert probes and all(d.level == 0 for d in probes)  # the smallest level
    cuts = [t for t in r.timeline if t["abandoned"]]
    text_s = 410 / 300
    # cut early from the progress (the first 64 KiB at 1 Mbit/s project ~7 s), never past half
    # the chunk's recompute time (the probe's deadline)
    assert 64 * 1024 / (1e6 / 8) < 0.5 * text_s
    assert cuts and all(t["wire_s"] == pytest.approx(64 * 1024 / (1e6 / 8)) for t in cuts)
    # a probe after every 2 text chunks; with back-off 2: chunk 2, then after 4 text chunks (6),
    # then after 8 (past the 12 chunks)
    assert [d.chunk for d in probes] == expected
    assert r.levels == [None] * 12


def test_slo_reserve_fraction_caps_the_seconds_reserve():
    assert policy(1.0, 1000, slo_margin=0.05, slo_reserve_s=0.25).plan_slo_s == pytest.approx(0.70)
    p = policy(1.0, 1000, slo_margin=0.05, slo_reserve_s=0.25, slo_reserve_frac=0.1)
    assert p.plan_slo_s == pytest.approx(0.85)  # 0.95 - min(0.25, 0.1)
    p = policy(4.0, 1000, slo_margin=0.05, slo_reserve_s=0.25, slo_reserve_frac=0.1)
    assert p.plan_slo_s == pytest.approx(3.8 - 0.25)
    for bad in ({"slo_reserve_frac": 1.0}, {"after_abandon": "x"}, {"probe_level": "x"},
                {"probe_deadline_frac": 0.0}, {"probe_backoff": 0.5}):
        with pytest.raises(ValueError):
            policy(1.0, 1000, **bad)


def test_text_for_quality_is_deferred_to_the_end():
    """Ordinal utility, text exact: with room for one text chunk, it is the last one, not the
    first (a text chunk's cost is certain; spent early it leaves no slack for a slow chunk)."""
    man = Man(5, 410, BPT)
    toks = [410] * 4 + [300]  # a shorter last chunk, as a context's tail usually is: text there
    man.sizes = {lv: tuple(b * t for t in toks) for lv, b in BPT.items()}  # saves fewer tokens
    man.token_ranges = tuple((sum(toks[:i]), sum(toks[:i + 1])) for i in range(5))
    m = ClockModel({lv: man.sizes[lv] for lv in man.levels}, toks, dict(DEC), 1000)
    # text: 0.41 s a chunk; level 3 at 1000 Mbit/s: 20 ms. Without deferral the plan's utility
    # (token-weighted) prefers recomputing a 410-token chunk now to the 300-token one last
    for defer, first_text in ((True, 4), (False, 0)):
        pol = policy(0.8, 1000, init=1000, defer_text=defer)
        r = simulate(pol, man, [1000] * 5, model=m)
        assert not r.slo_violated and r.levels.count(None) == 1
        assert r.levels.index(None) == first_text
