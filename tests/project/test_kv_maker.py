"""The tests' KV maker (tests/helpers/kv.py): shapes, dtypes, the same bytes for the same
seed, and that each option does what its docstring says.

Run: .venv/bin/python -m pytest tests/project/test_kv_maker.py -q
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import kv

SHAPE = (2, 24, 3, 16)


def _same(a, b) -> bool:
    return all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_make_kv_shape_dtype_and_determinism(dtype):
    k, v = kv.make_kv(*SHAPE, dtype=dtype, seed=4)
    assert k.shape == v.shape == SHAPE and k.dtype == v.dtype == dtype
    assert _same((k, v), kv.make_kv(*SHAPE, dtype=dtype, seed=4))
    assert not torch.equal(k, kv.make_kv(*SHAPE, dtype=dtype, seed=5)[0])
    assert not torch.equal(k, v)


def test_make_kv_plain_draw_order():
    """K then V, standard normal from one seeded generator (the bytes other tests rely on)."""
    g = torch.Generator().manual_seed(7)
    k = torch.randn(SHAPE, generator=g) * 2.0 + 1.0
    v = torch.randn(SHAPE, generator=g) * 0.5
    assert _same((k, v), kv.make_kv(*SHAPE, dtype=torch.float32, seed=7, k_scale=2.0, k_shift=1.0,
                                     v_scale=0.5))


def test_channel_scales_and_outlier_channels():
    base_k, base_v = kv.make_kv(*SHAPE, dtype=torch.float32, seed=1)
    scale = torch.linspace(0.5, 4.0, SHAPE[-1])
    k, v = kv.make_kv(*SHAPE, dtype=torch.float32, seed=1, channel_scales=scale)
    assert torch.equal(k, base_k * scale) and torch.equal(v, base_v)
    k, _ = kv.make_kv(*SHAPE, dtype=torch.float32, seed=1, outlier_channels=(2, 8.0))
    assert torch.equal(k[..., :2], base_k[..., :2] * 8) and torch.equal(k[..., 2:], base_k[..., 2:])
    # random scales: in [low, low + span), one per channel (or per layer, head and channel)
    k, _ = kv.make_kv(200, 64, 1, 8, dtype=torch.float32, channel_scales=(0.5, 2.0))
    std = k.std(dim=(0, 1, 2))
    assert bool((std > 0.4).all() and (std < 2.7).all()) and float(std.max() / std.min()) > 1.5
    k, _ = kv.make_kv(2, 4000, 3, 8, dtype=torch.float32, channel_scales=(0.1, 2.0),
                      scales_per_head=True)
    per = k.std(dim=1)                                   # [L, H, D]
    assert float(per.max() / per.min()) > 3 and not torch.allclose(per[0], per[1], rtol=0.2)


def test_token_scales_sink_and_zero_token():
    _, base_v = kv.make_kv(*SHAPE, dtype=torch.float32, seed=2)
    k, v = kv.make_kv(*SHAPE, dtype=torch.float32, seed=2, v_token_scales=(0.5, 1.0))
    ratio = v / base_v                                   # one factor per (layer, token)
    assert bool(((ratio >= 0.5) & (ratio < 1.5)).all())
    assert torch.allclose(ratio, ratio[..., :1, :1].expand_as(ratio))
    k0, _ = kv.make_kv(*SHAPE, dtype=torch.float32, seed=2)
    k, v = kv.make_kv(*SHAPE, dtype=torch.float32, seed=2, sink_gain=4.0, zero_token=3)
    assert torch.equal(k[:, 0], k0[:, 0] * 4) and torch.equal(k[:, 1:3], k0[:, 1:3])
    assert not k[:, 3].any() and not v[:, 3].any()


def _corr(x: torch.Tensor) -> float:
    """Mean absolute off-diagonal correlation of x's channels (over layers and tokens)."""
    c = np.corrcoef(x.reshape(-1, x.shape[-2] * x.shape[-1]).T.numpy())
    return float(np.abs(c - np.diag(np.diag(c))).sum() / (c.size - len(c)))


def test_mixed_kv_channels_are_correlated_and_mix_is_reused():
    plain, _ = kv.make_kv(2, 400, 2, 8, dtype=torch.float32)
    k, v, mix = kv.mixed_kv(2, 400, 2, 8, seed=3, k_decay=-2.0, return_mix=True)
    assert k.shape == v.shape == (2, 400, 2, 8) and k.dtype == torch.float32 and mix.shape == (16, 16)
    assert _corr(k) > 2 * _corr(plain) and _corr(v) > 2 * _corr(plain)
    assert _same((k, v), kv.mixed_kv(2, 400, 2, 8, seed=3, k_decay=-2.0))
    k2, _ = kv.mixed_kv(2, 400, 2, 8, seed=9, mix=torch.eye(16))   # identity: no mixing
    assert _corr(k2) < 2 * _corr(plain)


def test_correlated_kv_one_tensor_fixed_mixing_and_tails():
    x = kv.correlated_kv(3, 300, 2, 8, 1)
    assert x.shape == (3, 300, 2, 8) and x.dtype == torch.float32
    assert torch.equal(x, kv.correlated_kv(3, 300, 2, 8, 1))
    assert abs(float(x.mean()) - 0.5) < 0.5 and _corr(x) > 0.1
    # the mixing is the same for every seed unless drawn from the seed's own generator
    a, b = kv.correlated_kv(3, 300, 2, 8, 2), kv.correlated_kv(3, 300, 2, 8, 2, mix_seed=None)
    assert not torch.equal(a, b)
    heavy = kv.correlated_kv(3, 300, 2, 8, 1, tail_power=3) - 0.5
    light = x - 0.5
    kurt = [float((t ** 4).mean() / (t ** 2).mean() ** 2) for t in (light, heavy)]
    assert kurt[1] > 2 * kurt[0]


def test_low_rank_kv_shares_a_hidden_signal_across_layers():
    k, v = kv.low_rank_kv(4, 256, 2, 8, 1, rank=3)
    assert k.shape == v.shape == (4, 256, 2, 8) and k.dtype == torch.float32
    # rank 3 signal + small noise: 3 singular values carry almost all energy of all layers
    s = torch.linalg.svdvals(k.permute(1, 0, 2, 3).reshape(256, -1) - 0.3)
    assert float((s[:3] ** 2).sum() / (s ** 2).sum()) > 0.95
    assert _same((k, v), kv.low_rank_kv(4, 256, 2, 8, 1, rank=3))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_integer_kv_is_exact_and_deterministic(dtype):
    k, v = kv.integer_kv(2, 40, 2, 64, dtype)
    assert k.shape == v.shape == (2, 40, 2, 64) and k.dtype == dtype and k.is_contiguous()
    assert _same((k, v), kv.integer_kv(2, 40, 2, 64, dtype))
    assert not torch.equal(k, kv.integer_kv(2, 40, 2, 64, dtype, seed=1)[0])
    assert float(k.float().abs().max()) <= 255 * 2 ** -5       # the documented bound


def test_lmcache_planes_layout():
    k, v = kv.make_kv(2, 5, 3, 4)
    p = kv.lmcache_planes(k, v)
    assert p.shape == (2, 2, 5, 12) and torch.equal(p[0, 1, 2], k[1, 2].reshape(-1))
    assert torch.equal(p[1].reshape(2, 5, 3, 4), v)


def test_normal_kv_is_make_kv_with_channel_scales():
    k, v = kv.normal_kv(torch.float16, 3)
    assert k.shape == kv.NORMAL_KV_SHAPE and k.dtype == torch.float16
    g = torch.Generator().manual_seed(3)
    scale = 0.5 + torch.rand(1, 1, 1, kv.NORMAL_KV_SHAPE[3], generator=g) * 2
    k0 = torch.randn(kv.NORMAL_KV_SHAPE, generator=g) * scale
    v0 = torch.randn(kv.NORMAL_KV_SHAPE, generator=g) * 0.7
    assert _same((k, v), (k0.half(), v0.half()))
