"""What the CacheGen vLLM connector's scheduler side sends its worker side each step:
LoadRequest / SaveRequest (pickled with the step's CacheGenConnectorMetadata: kept small)
and SaveTrack, the scheduler's record of a request to save. Not runnable by itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from third_party.vllm.sources import Lookup


@dataclass
class LoadRequest:
    """One request's load, sent scheduler -> worker (pickled: kept small).

    start, end: token range [start, end) to write (start = tokens vLLM already holds,
        end < prompt length; a multiple of block_size unless extra config
        "load_partial_block" lets the load end inside a block).
    block_ids: the request's block ids (first KV cache group) covering at least [0, end).
    block_size: tokens per block of the scheduler's block table.
    params: the request's kv_transfer_params plus engine defaults.
    lookup: the source's scheduler-side answer (chunk sizes, lookup time).
    """

    req_id: str
    start: int
    end: int
    block_ids: list[int]
    block_size: int
    params: dict[str, Any]
    lookup: Lookup
    prompt_tokens: int = 0
    after_preemption: bool = False  # a reload of a preempted request (its 2nd load record)
    # vLLM's hybrid KV cache manager on (hma_connector): every group's block ids, -1 for a
    # null block (outside a sliding window); None: one group, block_ids
    group_block_ids: list[list[int]] | None = None

    def slot_mapping(self) -> torch.Tensor:
        """Slots of tokens [start, end): block_ids[p // bs] * bs + p % bs, int64 [end-start]."""
        pos = torch.arange(self.start, self.end, dtype=torch.int64)
        blocks = torch.tensor(self.block_ids, dtype=torch.int64)
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def group_slot_mappings(self) -> list[torch.Tensor]:
        """One int64 [end-start] slot tensor per KV cache group (-1: a token whose block is
        a null block, not written); [slot_mapping()] with one group."""
        if self.group_block_ids is None:
            return [self.slot_mapping()]
        from third_party.vllm.kv_groups import slots_for

        return [slots_for(ids, self.start, self.end, self.block_size)
                for ids in self.group_block_ids]


@dataclass
class SaveRequest:
    """Save the KV of tokens [0, num_tokens) of one request after this step's forward.

    token_ids: those tokens (the stored manifest repeats them); block_ids: the request's
    blocks covering them; params: the request's "save" parameters (destination, codec).
    """

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    block_size: int
    params: dict[str, Any]


@dataclass
class SaveTrack:
    """Scheduler side: a request to save, its tokens and the blocks seen so far."""

    token_ids: list[int]
    params: dict[str, Any]
    block_ids: list[int] = field(default_factory=list)


@dataclass
class CacheGenConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadRequest] = field(default_factory=list)
    saves: list[SaveRequest] = field(default_factory=list)
    # async mode: requests vLLM finished (aborted) while their load runs: stop at the next
    # chunk (the worker also learns it from get_finished's finished_req_ids)
    cancels: list[str] = field(default_factory=list)
