"""Random K/V caches for tests: one maker instead of a copy per test module.

``make_kv`` draws K then V from one seeded generator (standard normal, then scaled and
shifted), so a test that needs a given KV gets the same bytes from the same arguments.
"""
from __future__ import annotations

import torch


def make_kv(layers: int = 3, tokens: int = 40, kv_heads: int = 2, head_dim: int = 16, *,
            dtype: torch.dtype = torch.bfloat16, seed: int = 0, k_scale: float = 1.0,
            k_shift: float = 0.0, v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of shape [layers, tokens, kv_heads, head_dim] in ``dtype``:
    K = N(0, 1) * k_scale + k_shift, V = N(0, 1) * v_scale, drawn in fp32 in that order from
    ``torch.Generator().manual_seed(seed)`` and then cast."""
    g = torch.Generator().manual_seed(seed)
    shape = (layers, tokens, kv_heads, head_dim)
    k = torch.randn(shape, generator=g)
    if k_scale != 1.0:
        k = k * k_scale
    if k_shift != 0.0:
        k = k + k_shift
    v = torch.randn(shape, generator=g)
    if v_scale != 1.0:
        v = v * v_scale
    return k.to(dtype), v.to(dtype)
