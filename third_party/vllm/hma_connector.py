"""CacheGenHMAConnector: the CacheGen connector with vLLM's hybrid KV cache manager ON.

For a model with sliding-window layers (Gemma 2/3) vLLM 0.32's hybrid KV cache manager
("HMA") keeps a sliding layer's blocks only inside its window: the layers are split into
KV cache groups sharing one block pool, and a sliding group's block table holds vLLM's null
block for every block that fell out of the window (``SlidingWindowManager``: for a request
with n computed tokens, the first ``n - window + 1`` tokens' whole blocks are null; they are
never read). vLLM keeps the manager on with a connector only when the connector class
subclasses ``SupportsHMA`` (vllm/config/vllm.py, ``KVConnectorFactory.supports_hma_config``);
this class does, and:

* carries every group's block ids to the worker (``LoadRequest.group_block_ids``; null
  blocks as -1: kv_groups.group_block_ids), and the worker writes each layer through its own
  group's slot mapping, skipping the null blocks' tokens (third_party.vllm.worker). The
  stored KV keeps its full layout ``[L, T, H, D]``; only the kept tokens are written.
* loads asynchronously (extra config ``async_load`` is forced on): vLLM cannot map a
  failed block id back to a request with several groups (its scheduler raises on
  ``invalid_block_ids`` then), so a load that fails is reported as ``failed_recving``
  (``get_transfer_results``) and vLLM, with ``kv_load_failure_policy="recompute"``,
  recomputes that request's whole prompt.
* implements ``request_finished_all_groups`` (the finish hook vLLM calls for an HMA
  connector) by the single-group one: the connector never holds blocks.
* does not save (extra config ``allow_client_save: true`` is refused at start in one line):
  the read-back reads one block table.

Shape: as CacheGenConnector, a thin class building its side by role; its sides are
HMAScheduler / HMAWorker, subclasses of CacheGenScheduler / CacheGenWorker through their
public hooks (``alloc_group_ids``, ``publish_failed``, ``fail_whole_request``).

Select it with ``kv_connector="CacheGenHMAConnector"``,
``kv_connector_module_path="third_party.vllm.hma_connector"`` (third_party.vllm.engine.
make_llm(..., hybrid_kv=True); run_benchmarks.py --vllm-hybrid-kv). Facts of this vLLM
build: docs/vllm-connector.md, "Hybrid models".
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorTransferResults,
    SupportsHMA,
)

from third_party.vllm.cachegen_connector import CacheGenConnector
from third_party.vllm.connector_settings import ConnectorSettings
from third_party.vllm.kv_groups import group_block_ids
from third_party.vllm.scheduler import CacheGenScheduler
from third_party.vllm.worker import CacheGenWorker

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.cachegen_connector")

# spec classes whose groups the connector writes (per-token K and V of every token, or of
# the tokens inside a window); compared by class name (vllm.v1.kv_cache_interface)
PLACEABLE_SPECS = ("FullAttentionSpec", "SlidingWindowSpec")


def check_hma_groups(kv_cache_config: Any) -> None:
    """Raise ValueError (one line) unless every KV cache group is full or sliding-window
    attention with one block size (what the per-group slot mapping handles)."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    bad = sorted({type(g.kv_cache_spec).__name__ for g in groups
                  if type(g.kv_cache_spec).__name__ not in PLACEABLE_SPECS})
    if bad:
        raise ValueError(f"CacheGenHMAConnector places full and sliding-window attention "
                         f"groups only, got {', '.join(bad)}")
    sizes = sorted({int(g.kv_cache_spec.block_size) for g in groups})
    if len(sizes) > 1:
        raise ValueError(f"CacheGenHMAConnector needs one block size in every KV cache "
                         f"group, got {sizes}")


def hma_settings(settings: ConnectorSettings) -> ConnectorSettings:
    """The hybrid-manager connector's settings: loads forced asynchronous (a failed load is
    reported per request) and stopped at whole blocks (a load ending inside a block is
    checked with one KV cache group only). Raises ValueError (one line) when the operator
    allows saves."""
    if not settings.async_load:
        logger.info("CacheGenHMAConnector: loads are asynchronous (a failed load is "
                    "reported per request, vLLM then recomputes it)")
    if settings.extra.get("allow_client_save"):
        raise ValueError("CacheGenHMAConnector does not save KV (the read-back reads one "
                         "block table); set allow_client_save false or use CacheGenConnector")
    return dataclasses.replace(settings, async_load=True, partial_block=False)


class HMAScheduler(CacheGenScheduler):
    """Scheduler side: a load carries every KV cache group's block ids."""

    def alloc_group_ids(self, blocks) -> list[list[int]] | None:
        """Every group's block ids of the allocation (-1: a null block)."""
        return group_block_ids(blocks.blocks)

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]):
        """vLLM's finish hook for an HMA connector: as request_finished (group 0's ids);
        returns (False, None): no blocks are held."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])


class HMAWorker(CacheGenWorker):
    """Worker side: a failed load is reported per request (failed_recving), not by block."""

    fail_whole_request = True  # the load record's recomputed_tokens: the whole load

    def __init__(self, settings: ConnectorSettings, vllm_config: Any = None,
                 kv_cache_config: Any = None):
        super().__init__(settings, vllm_config, kv_cache_config)
        self._failed_recving: set[str] = set()

    def publish_failed(self, lr, failed: set[int]) -> None:
        if failed:      # block ids are per group: the request is reported instead
            self._failed_recving.add(lr.req_id)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished async loads, with the failed ones also in failed_recving (vLLM's
        contract: a failed receive is reported in both sets)."""
        _, done = self.get_finished(finished_req_ids)
        with self._async_lock:
            failed, self._failed_recving = self._failed_recving, set()
        done = set(done or ())
        return KVConnectorTransferResults(finished_recving=done | failed,
                                          failed_recving=failed)


class CacheGenHMAConnector(CacheGenConnector, SupportsHMA):
    """CacheGenConnector for vLLM's hybrid KV cache manager (see the module docstring)."""

    scheduler_class = HMAScheduler
    worker_class = HMAWorker

    @staticmethod
    def check_kv_groups(kv_cache_config: Any) -> None:
        check_hma_groups(kv_cache_config)

    @classmethod
    def build_settings(cls, vllm_config) -> ConnectorSettings:
        return hma_settings(super().build_settings(vllm_config))

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        worker = self.worker
        assert isinstance(worker, HMAWorker)
        return worker.get_transfer_results(finished_req_ids)

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]):
        scheduler = self.scheduler
        assert isinstance(scheduler, HMAScheduler)
        return scheduler.request_finished_all_groups(request, block_ids)
