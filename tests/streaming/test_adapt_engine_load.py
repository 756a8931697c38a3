"""The adaptive policy's engine-load input (PolicyInputs.engine_queue_tokens: prompt tokens
queued ahead of a load on the engine): idle behaviour unchanged at 0, the clock model's
finish with a queue, a loaded engine's plans (fewer tokens left to prefill, a coarser first
level on a slow link), and the input's bounds. Pure arithmetic on synthetic manifests.

Run: .venv/bin/python -m pytest tests/streaming/test_adapt_engine_load.py -q
"""

from __future__ import annotations

import math

import pytest

from streaming.adapt import AdaptivePolicy, ClockModel, PolicyInputs, simulate
from tests.helpers.policy import Man, make_policy

# 6 chunks of 256 tokens (the serve-load benchmark's 1,536-token contexts), cachegen-like
# bytes per token of levels 0..5; the engine prefills 536 tokens/s (vLLM CPU, SmolLM2, measured)
BPT = {0: 300, 1: 450, 2: 600, 3: 900, 4: 1400, 5: 2600}
MAN = Man(6, 256, BPT)
TPS = 536.0
TUNED = dict(slo_reserve_s=0.3, robust=False, min_plan_frac=0.3)  # the "tuned" preset's values


def run(mbps: float, queue: int | None, slo_s: float = 2.0) -> list:
    """Per-chunk levels (None = text) of one simulated load at a constant rate."""
    kw = {} if queue is None else {"engine_queue_tokens": queue}
    pol = make_policy(slo_s, TPS, mbps, decode_s_per_token={lv: 1e-4 for lv in BPT},
                      request_overhead_s=0.001, **TUNED, **kw)
    return list(simulate(pol, MAN, [mbps]).levels)


def text_tokens(levels: list) -> int:
    return 256 * sum(lv is None for lv in levels)


def test_idle_engine_plans_are_unchanged_and_repeatable():
    for mbps in (10.0, 15.0, 100.0, 1000.0):
        base = run(mbps, None)
        assert run(mbps, 0) == base == run(mbps, None)
    # the idle plan: half the context at level 5, the rest prefilled
    assert run(1000.0, 0) == [5, 5, 5, None, None, None]


def test_loaded_engine_prefills_fewer_tokens():
    got = {q: run(1000.0, q) for q in (0, 500, 1536, 100_000)}
    assert {q: text_tokens(x) for q, x in got.items()} == {0: 768, 500: 256, 1536: 0, 100_000: 0}
    assert got[500] == [5, 5, 5, 5, 5, None] and got[1536] == [5] * 6
    assert run(1000.0, 1536) == got[1536]  # same inputs, same plan


def test_loaded_engine_on_a_slow_link_starts_coarser():
    idle, loaded = run(10.0, 0), run(10.0, 1536)
    assert idle == [4, 3, 3, 3, None, None]
    assert loaded == [2, 4, 4, 4, 4, 4]  # no text: chunk 0 coarser to keep the SLO
    assert loaded[0] < idle[0] and text_tokens(loaded) == 0


def test_first_choice_with_and_without_queue():
    def first(q):
        pol = make_policy(2.0, TPS, 1000.0, decode_s_per_token={lv: 1e-4 for lv in BPT}, engine_queue_tokens=q)
        pol.start(MAN)
        return pol.choose(0, 0.0), pol.decisions[-1].predicted_finish_s, pol.model.queue_s

    lv0, fin0, q0 = first(0)
    lv1, fin1, q1 = first(1072)
    assert q0 == 0.0 and q1 == pytest.approx(2.0)  # 1,072 tokens at 536 tokens/s
    assert lv0 == lv1 == 5 and fin1 <= 2.0


def test_clock_model_charges_the_queue_only_to_plans_with_text():
    m = ClockModel({1: [1_000_000] * 2}, [100, 100], {1: 0.0}, prefill_tps=100, queue_s=3.0)
    # KV at 1 MB/s: 1 s each; text: 1 s of prefill + the 3 s queue
    assert m.finish_s([1, 1], [1e6, 1e6]) == pytest.approx(2.0)
    assert m.finish_s([1, None], [1e6, 1e6]) == pytest.approx(1.0 + 1.0 + 3.0)
    assert m.finish_s([None, None], [1e6, 1e6]) == pytest.approx(2.0 + 3.0)
    idle = ClockModel({1: [1_000_000] * 2}, [100, 100], {1: 0.0}, prefill_tps=100)
    assert idle.queue_s == 0.0 and idle.finish_s([1, None], [1e6, 1e6]) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        ClockModel({1: [1]}, [1], {1: 0.0}, prefill_tps=100, queue_s=-1.0)


@pytest.mark.parametrize("bad", [-1, 1.5, math.nan, math.inf, True, "3"])
def test_engine_queue_tokens_bounds(bad):
    with pytest.raises(ValueError, match="engine_queue_tokens"):
        PolicyInputs(2.0, TPS, 1000.0, engine_queue_tokens=bad).checked()


def test_engine_queue_from_a_request_policy_object():
    pol = AdaptivePolicy.from_request({"slo_s": 2.0, "prefill_tokens_per_s": 500.0,
                                       "initial_throughput_mbps": 1000.0, "engine_queue_tokens": 1000.0})
    assert pol.inputs.engine_queue_tokens == 1000.0 and pol.inputs.engine_queue_s == pytest.approx(2.0)
    assert pol.preset == "tuned"
    with pytest.raises(ValueError, match="engine_queue_tokens"):
        AdaptivePolicy.from_request({"slo_s": 2.0, "prefill_tokens_per_s": 500.0,
                                     "initial_throughput_mbps": 1000.0, "engine_queue_tokens": -5})
