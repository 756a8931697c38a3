"""CacheGenConnector in vLLM's OpenAI server: start the server with the
connector on loopback (127.0.0.1, a free port), store a context, send a chat request and a
completion request sharing the stored prefix (no context key: prefix matching), check that
both load it and give the offline engine's output, that a client's escape attempt is
rejected, and that the server stops cleanly.

One subprocess (tests/helpers/vllm_server_check.py) does it all and writes a JSON report; the
server and the offline engine start one after the other (~2-3 minutes on 2 shared cores,
engine start-up dominates). Runs in the normal test command (marked slow, like
tests/vllm_connector/test_vllm_connector.py).

Run: .venv/bin/python -m pytest tests/vllm_connector/test_vllm_server.py -q
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow
# conftest's report; the server logs to its own file
VLLM_CHECK = ("vllm_server_check.py", [], ("VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_CONFIG_PATH"))


def _recs(recs, tag, kind="load"):
    return [r for r in recs if r.get("stats_tag") == tag and r.get("kind") == kind]


def test_context_is_stored_and_indexed(report):
    (save,) = _recs(report["stats"], "save", "save")
    assert save["error"] is None and save["index_records"] == save["tokens"] // 256 >= 4


@pytest.mark.parametrize("name", ["chat", "completion"])
def test_both_requests_load_the_stored_prefix(report, name):
    (rec,) = _recs(report["stats"], name)
    assert rec["error"] is None and rec["recomputed_tokens"] == 0
    # >= 90% of the context's tokens come from the store, the rest is prefilled
    assert rec["loaded_tokens"] >= 0.9 * report["context_tokens"]
    assert rec["prompt_tokens"] == report["prompt_ids"][name]  # same tokens as offline
    assert rec["prefill_tokens"] == rec["prompt_tokens"] - rec["loaded_tokens"] > 0
    assert any(f"[{name}]" in ln for ln in report["log_load_lines"])  # one log line per load


@pytest.mark.parametrize("name", ["chat", "completion"])
def test_server_output_matches_the_offline_engine(report, name):
    (off,) = _recs(report["offline_stats"], f"offline-{name}")
    (srv,) = _recs(report["stats"], name)
    assert off["loaded_tokens"] == srv["loaded_tokens"]  # the same load offline
    assert report["server"][name] == report["offline"][name] and report["server"][name]


def test_tenants_do_not_share_kv_through_the_server(report):
    """cache_salt partitions the store: tenant A's saved context loads for A only; tenant B
    (same prompt, other salt) loads nothing, neither A's entry nor the unsalted one."""
    (save,) = _recs(report["stats"], "tenant-a-save", "save")
    assert save["error"] is None and save["tokens"] > 0
    assert not _recs(report["stats"], "tenant-b")  # no load record for B
    (miss,) = _recs(report["stats"], "tenant-b", "miss")
    assert miss["loaded_tokens"] == 0 and miss["stored_tokens"] == 0
    (a,) = _recs(report["stats"], "tenant-a")
    assert a["error"] is None and a["loaded_tokens"] >= 0.9 * report["context_tokens"]
    assert all(report["server"][f"{t}_http_ok"] for t in ("tenant-a-save", "tenant-b", "tenant-a"))


def test_escape_is_rejected_and_the_server_stops_cleanly(report):
    (rej,) = _recs(report["stats"], "escape", "rejected")
    assert "source_dir" in rej["reason"] and report["server"]["escape_http_ok"]
    assert report["server_exit_code"] == 0
    # report["log_engine_dead"] is recorded, not asserted: vLLM's frontend can log
    # EngineDeadError at shutdown from a race of its own (seen without our connector too;
    # docs/vllm-connector.md, "Shutdown"), so under load it is not a property of this code.


def test_engine_dropped_hit_is_one_miss_record(report):
    """An engine-dropped hit on the OpenAI server path: a completion with prompt_logprobs (vLLM drops
    the external hit) leaves exactly one record, a miss with the reason, and one log line."""
    assert report["server"]["prompt_logprobs_http_ok"]
    recs = [r for r in report["stats"] if r.get("stats_tag") == "prompt_logprobs"]
    assert [r["kind"] for r in recs] == ["miss"]
    assert recs[0]["reason"] == "engine skipped the external hit (prompt_logprobs)"
    assert sum("[prompt_logprobs]" in ln for ln in report["log_miss_lines"]) == 1


def test_first_load_after_start_is_timed(report):
    """The codec warm-up ran at start and every timed request loaded the context (the
    first-vs-tenth TTFT figure is reported by the check, not asserted: no timed asserts)."""
    (warm,) = [r for r in report["stats"] if r.get("kind") == "warmup"]
    assert warm["codecs"]["cachegen"] and not str(warm["codecs"]["cachegen"]).startswith("error")
    loads = [_recs(report["stats"], f"ttft-{i}") for i in range(len(report["server"]["ttft_s"]))]
    assert loads and all(len(x) == 1 and x[0]["loaded_tokens"] > 0 for x in loads)
