"""Request and metadata types of the CacheGen vLLM connector, and its helper functions.

Part of third_party.vllm.cachegen_connector (which re-exports every name here; vLLM loads
the connector from there): LoadRequest / SaveRequest (scheduler -> worker, pickled),
CacheGenConnectorMetadata, the async-load job, decode CPU affinity (decode_cpus,
DecodeAffinity) and the miss-reason helpers. Not runnable by itself.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from third_party.vllm.sources import Lookup


@dataclass
class LoadRequest:
    """One request's load, sent scheduler -> worker (pickled: kept small).

    start, end: token range [start, end) to write (start = tokens vLLM already holds,
        end = multiple of block_size, < prompt length).
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


class LoadCancelled(Exception):
    """Raised inside a background load's chunk sink when its request was finished."""


@dataclass
class AsyncJob:
    """One background load (worker side): its request and its cancel flag."""

    lr: LoadRequest
    cancel: threading.Event = field(default_factory=threading.Event)


def layer_index(name: str) -> int:
    """Decoder-layer index from a vLLM layer name ("model.layers.12.self_attn.attn" -> 12)."""
    nums = [int(p) for p in name.split(".") if p.isdigit()]
    if len(nums) != 1:
        raise ValueError(f"cannot find one layer index in layer name {name!r}")
    return nums[0]



def policy_preset(policy: Any) -> str | None:
    """The PolicyParams preset a request's policy object runs (its "preset", else the
    default one), or None without a policy."""
    if not isinstance(policy, dict):
        return None
    from streaming.adapt.params import DEFAULT_PRESET

    return str(policy.get("preset") or DEFAULT_PRESET)


def bool_option(extra: dict[str, Any], key: str, default: bool) -> bool:
    """A boolean extra-config option; raises ValueError on anything but true/false."""
    v = extra.get(key, default)
    if not isinstance(v, bool):
        raise ValueError(f"extra config {key} must be true or false, got {v!r}")
    return v


def is_aborted(request: Any) -> bool:
    """Whether vLLM finished the request as aborted (RequestStatus.FINISHED_ABORTED)."""
    st = getattr(request, "status", None)
    return st is not None and getattr(st, "name", str(st)) == "FINISHED_ABORTED"


def decode_cpus(setting: Any = "all") -> set[int] | None:
    """CPUs the connector's load (receive + decode) may run on, from the extra-config key
    ``decode_cpus``: "all" (default: every CPU of the machine, as the kernel's cpuset
    allows), "inherit" (keep the worker's binding: None), or a list of CPU ids.

    Why (measured): vLLM's CPU worker binds itself to the cores left after the
    scheduler's reserved one (ENGINE_ENV reserves 1 of this machine's 2, so the worker runs
    on {0}), and every thread it starts inherits that, so the decode got ONE core inside
    the engine although the engine does nothing else while it waits for the load (the
    scheduler process waits on the worker's step, in a sched_yield spin loop: the second
    core is shared with it). Raises ValueError on a bad setting."""
    if setting in (None, "all"):
        n = os.cpu_count() or 1
        return set(range(n))
    if setting == "inherit":
        return None
    if (isinstance(setting, (list, tuple)) and setting
            and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in setting)):
        return set(setting)
    raise ValueError(f'decode_cpus must be "all", "inherit" or a list of CPU ids, got {setting!r}')


def load_miss_reason(err: str | None, stats) -> str:
    """Why a load placed nothing (the record says miss with the reason, never
    kind=load loaded_tokens=0): the load's error, else the first chunk's note (a chunk
    evicted or failing its checksum after the lookup)."""
    if err:
        return f"at load: {err}"
    if stats is not None and stats.error:
        return f"at load: {stats.error}"
    chunks = getattr(stats, "chunks", None) or []
    for c in chunks:
        note = c.get("note", "") if isinstance(c, dict) else getattr(c, "note", "")
        if note:
            return f"at load: chunk {c.get('index') if isinstance(c, dict) else '?'}: {note}"
    first = chunks[0] if chunks else None
    if isinstance(first, dict) and first.get("text_fallback"):
        return "at load: the policy sent chunk 0 as text (recomputed by the engine)"
    return "at load: no chunk could be loaded"


def chunk_failure(stats) -> str | None:
    """The first chunk failure note of a load (a chunk whose decode or refetch failed and
    whose tokens the engine therefore recomputes), or None: a chunk sent as text by the
    adaptation policy is a choice, not an error (the record says why)."""
    for c in (getattr(stats, "chunks", None) or []):
        note = c.get("note", "") if isinstance(c, dict) else getattr(c, "note", "")
        if note and "failed" in note and not note.startswith("decode failed once, refetch decoded"):
            return f"chunk {c.get('index') if isinstance(c, dict) else getattr(c, 'index', '?')}: {note}"
    return None


class DecodeAffinity:
    """Context manager: widen the CALLING thread's CPU affinity to ``cpus`` (Linux
    sched_setaffinity on pid 0 = this thread) and restore it on exit. Threads started
    inside (the stream receiver, numba's pool when it is launched here) inherit the wide
    set; the forward pass later runs on the worker's own binding again. A no-op where
    affinity is not supported or ``cpus`` is None / already allowed."""

    def __init__(self, cpus: set[int] | None):
        self._cpus = cpus
        self._old: set[int] | None = None

    def __enter__(self):
        if not self._cpus or not hasattr(os, "sched_setaffinity"):
            return self
        try:
            old = os.sched_getaffinity(0)
            if not self._cpus <= old:
                os.sched_setaffinity(0, self._cpus | old)
                self._old = old
        except (OSError, ValueError):   # e.g. CPU ids outside the machine / cpuset
            self._old = None
        return self

    def __exit__(self, *exc):
        if self._old is not None:
            try:
                os.sched_setaffinity(0, self._old)
            except OSError:
                pass
            self._old = None
        return False


def thread_probe() -> dict[str, Any]:
    """Cores and threads the decode gets in this (worker) process: the CPU
    affinity the worker's threads inherit, torch's and numba's thread counts."""
    import sys

    out: dict[str, Any] = {"torch_threads": torch.get_num_threads()}
    try:
        out["affinity"] = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        out["affinity"] = None
    try:   # every thread of the process by its allowed CPUs (numba's pool included)
        census: dict[str, int] = {}
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/status", encoding="ascii", errors="replace") as f:
                for line in f:
                    if line.startswith("Cpus_allowed_list:"):
                        key = line.split(":", 1)[1].strip()
                        census[key] = census.get(key, 0) + 1
                        break
        out["threads_by_cpus"] = census
    except OSError:
        out["threads_by_cpus"] = None
    nb = sys.modules.get("numba")
    if nb is not None:
        out["numba_threads"] = nb.get_num_threads()
        try:
            out["numba_layer"] = nb.threading_layer()
        except ValueError:   # no parallel kernel has run yet in this process
            out["numba_layer"] = None
    return out

