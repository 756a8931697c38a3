"""The KV the outlier tests put outliers into: Gaussian with mild channel structure (a
random per-channel scale on K, so not ``tests.helpers.kv.make_kv``), of one shape."""
from __future__ import annotations

import torch

SHAPE = (3, 256, 2, 64)      # L, T, H, D


def normal_kv(dtype=torch.bfloat16, seed=0):
    """Gaussian KV with mild channel structure (max/median of a head ~6-10, like real KV)."""
    g = torch.Generator().manual_seed(seed)
    scale = 0.5 + torch.rand(1, 1, 1, SHAPE[3], generator=g) * 2
    k = torch.randn(SHAPE, generator=g) * scale
    v = torch.randn(SHAPE, generator=g) * 0.7
    return k.to(dtype), v.to(dtype)
