"""vLLM's KV cache groups as the CacheGen connector sees them (hybrid models).

vLLM 0.32 groups a model's attention layers into KV cache groups (``KVCacheConfig.
kv_cache_groups``, each a ``KVCacheGroupSpec(layer_names, kv_cache_spec)``) that share one
block pool. For a model with sliding-window and full-attention layers (Gemma 2/3) the
hybrid KV cache manager ("HMA") makes several groups; a sliding group's block table holds
vLLM's null block for blocks that fell out of the window. A connector that does not subclass
``SupportsHMA`` makes vLLM turn the manager off (vllm/config/vllm.py): then
``unify_hybrid_kv_cache_specs`` promotes every ``SlidingWindowSpec`` to a
``FullAttentionSpec`` that keeps its ``sliding_window`` (blocks for every token, the
attention still windowed) and all layers form ONE group. That one-group layout is what the
connector writes into: every layer gets all T loaded tokens, the full layout our codecs
store by default.

This module reads a ``KVCacheConfig`` duck-typed (no vLLM import, so it is unit-tested with
plain objects): :func:`describe_kv_cache` (the engine's KV memory, for the log and the stats
record), :func:`check_one_group` (the one-line refusal of the several-group layout by the
default connector), and for the hybrid-manager connector (third_party/vllm/hma_connector.py)
:func:`layer_groups`, :func:`group_block_ids` and :func:`slots_for` (per-group slot
mappings, -1 for a sliding group's null blocks).
"""

from __future__ import annotations

from typing import Any

import torch


def _layer_specs(spec: Any, layer_names: list[str]) -> dict[str, Any]:
    """Per-layer specs of one group: a ``UniformTypeKVCacheSpecs`` carries them in
    ``kv_cache_specs``; any other spec applies to every layer of the group."""
    per_layer = getattr(spec, "kv_cache_specs", None)
    if isinstance(per_layer, dict) and per_layer:
        return {n: per_layer.get(n, spec) for n in layer_names}
    return {n: spec for n in layer_names}


def storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (torch tensors): layers of different
    KV cache groups alias one allocation under the hybrid manager, so it is counted once."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
    return int(sum(seen.values()))


def describe_kv_cache(kv_cache_config: Any,
                      layer_windows: dict[str, int | None] | None = None,
                      tensors: Any = None) -> dict[str, Any]:
    """The engine's KV cache as plain JSON-able values.

    kv_cache_config: vLLM's ``KVCacheConfig`` (``num_blocks``, ``kv_cache_tensors`` with
        ``size`` in bytes, ``kv_cache_groups``), or None.
    layer_windows: layer name -> the window its attention computes with (tokens; None = full),
        e.g. from vLLM's Attention layers (``.sliding_window``); without it the windows are
        read from the group's per-layer specs, or its one spec (a worker's config may carry
        only the first layer's spec for a whole group).
    tensors: the layers' KV cache tensors (vLLM's ``register_kv_caches`` argument's values);
        when given, "tensor_bytes" is their distinct storages (:func:`storage_bytes`), else
        the sum of the config's ``kv_cache_tensors`` sizes (which overlap when groups alias).
    Returns {"num_groups", "num_blocks", "tensor_bytes" (bytes allocated for the KV cache,
    all layers), "groups": [{"spec" (class name), "layers" (count), "block_size" (tokens),
    "sliding_window" (tokens or None), "sliding_layers" (layers of the group computed with a
    window), "page_size_bytes" (one block of one layer, or None)}], "pool_tokens"
    (num_blocks x block_size of group 0: the block pool's token slots; with one group every
    layer holds that many tokens, with several the groups share them)}; {} when
    kv_cache_config is None.
    """
    if kv_cache_config is None:
        return {}
    groups = []
    for g in getattr(kv_cache_config, "kv_cache_groups", None) or []:
        names = list(getattr(g, "layer_names", []) or [])
        spec = getattr(g, "kv_cache_spec", None)
        per_layer = _layer_specs(spec, names)
        windows = [layer_windows.get(n) if layer_windows is not None
                   else getattr(s, "sliding_window", None) for n, s in per_layer.items()]
        sliding = [w for w in windows if w]
        first = next(iter(per_layer.values()), spec)
        page = getattr(first, "page_size_bytes", None)
        groups.append({
            "spec": type(spec).__name__,
            "layers": len(names),
            "block_size": getattr(first, "block_size", None),
            "sliding_window": max(sliding) if sliding else None,
            "sliding_layers": len(sliding),
            "page_size_bytes": int(page) if isinstance(page, int) else None,
        })
    layer_tensors = list(tensors) if tensors is not None else None
    cfg_tensors = getattr(kv_cache_config, "kv_cache_tensors", None) or []
    num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
    bs = groups[0]["block_size"] if groups else None
    return {
        "num_groups": len(groups),
        "num_blocks": num_blocks,
        "tensor_bytes": storage_bytes(layer_tensors) if layer_tensors is not None else
        int(sum(int(getattr(t, "size", 0) or 0) for t in cfg_tensors)),
        "pool_tokens": num_blocks * bs if isinstance(bs, int) else None,
        "groups": groups,
    }


def check_one_group(kv_cache_config: Any) -> None:
    """Raise ValueError (one line) unless the KV cache has at most one group.

    The connector places one block table per request (group 0) into every layer; several
    groups mean vLLM's hybrid KV cache manager is on (per-group block tables, null blocks
    outside a sliding window), which it does not handle. None (no config) passes."""
    if kv_cache_config is None:
        return
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) <= 1:
        return
    kinds = ", ".join(
        f"{type(getattr(g, 'kv_cache_spec', None)).__name__} x{len(getattr(g, 'layer_names', []) or [])}"
        for g in groups)
    raise ValueError(
        f"CacheGenConnector handles one KV cache group, got {len(groups)} ({kinds}): vLLM's "
        "hybrid KV cache manager is on; start the engine with "
        "disable_hybrid_kv_cache_manager=True (--disable-hybrid-kv-cache-manager)")


def summary_line(desc: dict[str, Any]) -> str:
    """One log line of :func:`describe_kv_cache`'s result (MiB = 2**20 bytes)."""
    if not desc:
        return "KV cache: no config"
    parts = []
    for g in desc["groups"]:
        s = f"{g['layers']} layers {g['spec']} block {g['block_size']}"
        if g["sliding_layers"]:
            s += f" ({g['sliding_layers']} sliding, window {g['sliding_window']})"
        parts.append(s)
    return (f"KV cache: {desc['num_groups']} group(s) [{'; '.join(parts)}], "
            f"{desc['num_blocks']} blocks ({desc['pool_tokens']} token slots), "
            f"{desc['tensor_bytes'] / 2**20:.1f} MiB")


def layer_groups(kv_cache_config: Any) -> dict[str, int]:
    """Layer name -> index of its KV cache group ({} without a config: every layer is in
    group 0)."""
    out: dict[str, int] = {}
    for gi, g in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or []):
        for name in getattr(g, "layer_names", []) or []:
            out[name] = gi
    return out


def group_block_ids(blocks_per_group: Any) -> list[list[int]]:
    """Per-group block ids of one request from vLLM's ``KVCacheBlocks.blocks`` (a tuple, one
    sequence of ``KVCacheBlock`` per group), with vLLM's null block (``is_null``: a sliding
    group's placeholder for a block outside the window, never written) as -1."""
    return [[-1 if getattr(b, "is_null", False) else int(b.block_id) for b in g]
            for g in blocks_per_group]


def slots_for(block_ids: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """Slot of every token of [start, end): ``block_ids[p // bs] * bs + p % bs``, -1 where the
    block id is -1 (a null block: the token is not kept). int64 tensor [end - start].
    Raises ValueError when block_ids do not cover [start, end)."""
    if end > start and -(-end // block_size) > len(block_ids):
        raise ValueError(f"{len(block_ids)} blocks of {block_size} tokens do not cover tokens "
                         f"[{start}, {end})")
    pos = torch.arange(start, end, dtype=torch.int64)
    blocks = torch.tensor(block_ids, dtype=torch.int64)[pos // block_size]
    return torch.where(blocks >= 0, blocks * block_size + pos % block_size,
                       torch.full_like(blocks, -1))
