"""Unit tests of the connector's view of vLLM's KV cache groups (third_party/vllm/kv_groups.py)
and of the vLLM engine path's model check (harness.engines.vllm.vllm_model_check) for sliding-window models.
No engine: vLLM's KVCacheConfig is stood in for by plain objects with the same fields.

Run: .venv/bin/python -m pytest tests/vllm_connector/test_kv_groups.py -q
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from harness.contexts import BenchmarkError
from harness.engines.vllm import vllm_model_check
from third_party.vllm.kv_groups import check_one_group, describe_kv_cache, summary_line


class FullAttentionSpec(NS):
    """Stands in for vLLM's spec class (only its name and fields are read)."""


class SlidingWindowSpec(NS):
    pass


class UniformTypeKVCacheSpecs(NS):
    pass


def _gemma_like(num_blocks=100, bs=128):
    """One group as vLLM 0.32 makes it with the hybrid manager off: 18 layers, the sliding
    ones promoted to FullAttentionSpec(sliding_window=512), pattern 5:1."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(18)]
    specs = {n: FullAttentionSpec(block_size=bs, page_size_bytes=bs * 2 * 256 * 2,
                                  sliding_window=None if i % 6 == 5 else 512)
             for i, n in enumerate(names)}
    group = NS(layer_names=names, kv_cache_spec=UniformTypeKVCacheSpecs(kv_cache_specs=specs))
    tensors = [NS(size=num_blocks * bs * 2 * 256 * 2) for _ in names]
    return NS(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=[group])


def test_describe_one_group_with_promoted_sliding_layers():
    d = describe_kv_cache(_gemma_like(num_blocks=100, bs=128))
    assert d["num_groups"] == 1 and d["num_blocks"] == 100
    assert d["pool_tokens"] == 100 * 128
    assert d["tensor_bytes"] == 18 * 100 * 128 * 2 * 256 * 2
    (g,) = d["groups"]
    assert (g["layers"], g["sliding_layers"], g["sliding_window"]) == (18, 15, 512)
    assert g["spec"] == "UniformTypeKVCacheSpecs" and g["page_size_bytes"] == 128 * 1024
    line = summary_line(d)
    assert "1 group(s)" in line and "15 sliding, window 512" in line and "12800 token slots" in line


def test_describe_plain_model_and_none():
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    cfg = NS(num_blocks=7, kv_cache_tensors=[NS(size=10), NS(size=20)],
             kv_cache_groups=[NS(layer_names=names, kv_cache_spec=FullAttentionSpec(block_size=16))])
    d = describe_kv_cache(cfg)
    assert d["tensor_bytes"] == 30 and d["pool_tokens"] == 7 * 16
    assert d["groups"][0]["sliding_layers"] == 0 and d["groups"][0]["sliding_window"] is None
    assert describe_kv_cache(None) == {} and summary_line({}) == "KV cache: no config"


def test_one_group_passes_several_groups_are_refused_in_one_line():
    check_one_group(_gemma_like())
    check_one_group(None)
    hma = NS(num_blocks=10, kv_cache_tensors=[], kv_cache_groups=[
        NS(layer_names=["a", "b", "c"], kv_cache_spec=FullAttentionSpec(block_size=128)),
        NS(layer_names=["d", "e", "f"], kv_cache_spec=SlidingWindowSpec(block_size=128,
                                                                        sliding_window=512))])
    with pytest.raises(ValueError) as ei:
        check_one_group(hma)
    msg = str(ei.value)
    assert "\n" not in msg and "2" in msg and "FullAttentionSpec x3" in msg
    assert "SlidingWindowSpec x3" in msg and "disable_hybrid_kv_cache_manager=True" in msg


def _info(kinds, window=None, n=None):
    return NS(model_id="m", layer_kinds=tuple(kinds), sliding_window=window,
              num_layers=n if n is not None else len(kinds))


def test_vllm_model_check_accepts_full_and_sliding():
    assert "one KV cache group" in vllm_model_check(_info((), n=30))
    line = vllm_model_check(_info(["sliding"] * 5 + ["full"], window=512))
    assert "5 of 6 layers sliding-window (window 512)" in line
    assert "hybrid KV cache manager is off" in line


def test_vllm_model_check_refuses_other_layer_kinds_in_one_line():
    with pytest.raises(BenchmarkError) as ei:
        vllm_model_check(_info(["full", "chunked", "sliding"], window=8))
    msg = str(ei.value)
    assert "\n" not in msg and "chunked layers are not supported" in msg and "--engine hf" in msg
