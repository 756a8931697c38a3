"""Adaptation decisions on synthetic bandwidth (streaming.adapt) and trace loading."""

import json

import pytest

from tests.helpers.policy import make_policy
from streaming.adapt import AdaptivePolicy, FixedPolicy, choose_level, simulate
from streaming.store import Manifest, context_key
from streaming.adapt.traces import constant, load_artifact_traces, step

MB = 1_000_000


def make_manifest(n=10, tokens=1500, sizes=None):
    """Levels 1..3 at 1, 2, 4 MB per chunk (like CacheGen levels of a ~1.5K-token chunk)."""
    sizes = sizes or {1: 1 * MB, 2: 2 * MB, 3: 4 * MB}
    ids = list(range(n * tokens))
    key = context_key("m", "w", "t", ids)
    return Manifest(key, "m", "w", "t", tuple(sorted(sizes)),
                    tuple((i * tokens, (i + 1) * tokens) for i in range(n)),
                    {lv: tuple([s] * n) for lv, s in sizes.items()},
                    {lv: tuple([0] * n) for lv in sizes},
                    tuple(tuple(ids[i * tokens:(i + 1) * tokens]) for i in range(n)))


def test_choose_level_pure():
    sizes = {1: 1 * MB, 2: 2 * MB, 3: 4 * MB}
    bps = 100e6 / 8  # 100 Mbit/s: 0.08 / 0.16 / 0.32 s
    assert choose_level(sizes, [1, 2, 3], 1500, 0.5, bps, 0.0, 5000)[:2] == (3, "fits")
    assert choose_level(sizes, [1, 2, 3], 1500, 0.2, bps, 0.0, 5000)[:2] == (2, "fits")
    assert choose_level(sizes, [1, 2, 3], 1500, 0.1, bps, 0.0, 5000)[:2] == (1, "fits")
    # nothing fits; text (1500/30000 = 0.05 s) fits
    assert choose_level(sizes, [1, 2, 3], 1500, 0.06, bps, 0.0, 30000)[:2] == (None, "text-fits")
    # nothing fits; lowest level (0.08 s) is cheaper than text (0.3 s)
    lv, why, cost = choose_level(sizes, [1, 2, 3], 1500, 0.01, bps, 0.0, 5000)
    assert (lv, why) == (1, "cheapest-overshoot") and cost == pytest.approx(0.08)
    # decode time bounds the pipelined cost from below
    assert choose_level(sizes, [1, 2, 3], 1500, 0.3, bps, 0.25, 5000)[0] == 2
    with pytest.raises(ValueError):
        choose_level(sizes, [1, 2, 3], 1500, 1.0, 0.0, 0.0, 5000)


def test_policy_link_rates_have_the_one_bound():
    """initial_throughput_mbps and probe_rate_mbps are link rates in Mbit/s: the same bound
    as every other (cachegen_common.units.check_bandwidth_mbps)."""
    from cachegen_common.units import MAX_BANDWIDTH_MBPS

    for kw in ({"initial_throughput_mbps": MAX_BANDWIDTH_MBPS * 2},
               {"initial_throughput_mbps": float("inf")},
               {"initial_throughput_mbps": 100, "probe_rate_mbps": MAX_BANDWIDTH_MBPS * 2},
               {"initial_throughput_mbps": 100, "probe_rate_mbps": -5.0}):
        with pytest.raises(ValueError, match="bandwidth_mbps"):
            make_policy(slo_s=2.0, prefill_tokens_per_s=500, **kw)
    make_policy(slo_s=2.0, prefill_tokens_per_s=500, initial_throughput_mbps=MAX_BANDWIDTH_MBPS)


def test_high_constant_bandwidth_takes_top_level_when_text_is_slow():
    m = make_manifest()
    # text: 1500 tokens at 500 tokens/s = 3 s a chunk (> SLO); level 3 at 1000 Mbit/s = 0.032 s
    pol = make_policy(slo_s=2.0, prefill_tokens_per_s=500, initial_throughput_mbps=1000)
    r = simulate(pol, m, constant(1000, 10).mbps, decode_s=0.02)
    assert r.levels == [3] * 10 and not r.slo_violated


def test_text_is_preferred_when_it_fits():
    """Text is recomputed exactly (best quality): with a fast prefill it wins when it fits."""
    m = make_manifest()
    pol = make_policy(slo_s=1.0, prefill_tokens_per_s=50000, initial_throughput_mbps=5)
    r = simulate(pol, m, constant(5, 10).mbps, decode_s=0.02)
    assert r.levels == [None] * 10 and not r.slo_violated


def test_low_bandwidth_uses_lower_levels_within_slo():
    m = make_manifest()
    # 100 Mbit/s: level 3 = 0.32 s/chunk (3.2 s total) > SLO 2 s; levels 1-2 fit; text 3 s/chunk
    pol = make_policy(slo_s=2.0, prefill_tokens_per_s=500, initial_throughput_mbps=100)
    r = simulate(pol, m, constant(100, 10).mbps, decode_s=0.02)
    assert None not in r.levels and r.levels.count(2) >= 5 and not r.slo_violated and r.total_s <= 2.0


def test_slo_violation_reported_with_smallest_overshoot():
    m = make_manifest()
    pol = make_policy(slo_s=0.5, prefill_tokens_per_s=1000, initial_throughput_mbps=10)
    r = simulate(pol, m, constant(10, 10).mbps, decode_s=0.0)
    # level 1 = 0.8 s a chunk on the wire, text 1.5 s: nothing fits, level 1 is the cheapest
    assert r.slo_violated and r.levels == [1] * 10
    assert all(d.reason == "cheapest-overshoot" for d in r.decisions)


def test_fixed_policy_and_level_restriction():
    m = make_manifest(n=3)
    fp = FixedPolicy([3, None, 1])
    fp.start(m)
    assert [fp.choose(k, 0.0) for k in range(3)] == [3, None, 1]
    with pytest.raises(ValueError):
        FixedPolicy(7).start(m)
    pol = make_policy(10.0, 100, 1000, levels=[1, 2])
    r = simulate(pol, m, [1000] * 3, 0.0)
    assert r.levels == [2, 2, 2]
    with pytest.raises(ValueError):
        make_policy(0, 1, 1)


def test_traces(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"bw": [0.5, 5.0, 0.001]}) + "\n\n" + json.dumps({"bw": [1.0]}) + "\n")
    trs = load_artifact_traces(p)  # default scale 1/10: Gbit/s -> Mbit/s / 10
    assert trs[0].mbps == (50.0, 500.0, 1.0) and trs[0].scale == 0.1 and trs[1].mbps == (100.0,)
    assert trs[0].at(10) == 1.0
    p.write_text('{"nobw": 1}\n')
    with pytest.raises(ValueError, match="t.jsonl:1"):
        load_artifact_traces(p)
    s = step([500, 50], 2, n=5)
    assert s.mbps == (500, 500, 50, 50, 50)


def test_artifact_traces_carried_in_the_repo():
    from streaming.adapt.traces import ARTIFACT_DIR, artifact_generated, artifact_recorded

    assert (ARTIFACT_DIR / "README.md").exists()  # source and license named
    rec = artifact_recorded()
    assert len(rec) == 10 and all(len(t.mbps) == 10 for t in rec)
    assert all(10.0 <= v <= 1000.0 for t in rec for v in t.mbps) and rec[0].scale == 0.1
    # first value of the first recorded trace: 0.5658 Gbit/s -> 56.58 Mbit/s at scale 1/10
    assert rec[0].mbps[0] == pytest.approx(56.58192386631183)
    gen = artifact_generated()
    assert len(gen) >= 2 and len(load_artifact_traces()) == len(rec) + len(gen)


def test_vllm_prefix_wrapper_forwards_abandon_and_timing():
    # third_party/vllm/sources/store.py wraps the policy: deadlines, abandons, text and the
    # receive clock must reach the AdaptivePolicy inside
    from streaming.adapt import AdaptivePolicy
    from third_party.vllm.sources.store import _PrefixPolicy

    class Man:
        levels = (0, 1)
        sizes = {0: (400_000,) * 3, 1: (800_000,) * 3}
        token_ranges = ((0, 100), (100, 200), (200, 300))
        chunk_count = 3

    inner = make_policy(5.0, 10.0, 100.0, decode_s_per_token={0: 1e-4, 1: 1e-4}, request_overhead_s=0.0)
    p = _PrefixPolicy(inner, needed_chunks=3)
    p.start(Man())
    lv = p.choose(0, 0.0)
    assert lv is not None and p.transfer_deadline_s(0) == inner.transfer_deadline_s(0) is not None
    p.observe_abandon(0, lv, 0.5)
    assert inner.abandons == 1 and inner.est.provisional == 1
    lv = p.choose(0, 0.5)
    p.observe_transfer(0, lv, Man.sizes[lv][0], 0.2, 0.7)
    assert inner.est.provisional == 0 and inner._dec_free == pytest.approx(0.7 + 100 * 1e-4)
    p.observe_text(1)
    assert inner._since_sample == 1
