"""Random K/V caches for tests: the one place a test gets a synthetic KV from.

Every maker returns our layout, [layers, tokens, kv_heads, head_dim] (``lmcache_planes``
turns a pair into LMCache's [2, layers, tokens, kv_heads * head_dim]), and draws from
seeded generators only, in a documented order, so the same arguments give the same bytes.

- ``make_kv``: independent Gaussian K then V, with optional per-channel scales, outlier
  channels, per-token V scales, a large first (attention-sink) token and a zeroed token.
- ``mixed_kv``: K and V whose ``kv_heads * head_dim`` channels share one mixing matrix
  (correlated channels), optionally with a decaying spectrum.
- ``correlated_kv``: one tensor (K or V) with a per-layer channel mixing and a decaying
  spectrum, shifted by 0.5: what the kvtc calibrations are fitted on.
- ``low_rank_kv``: K and V that are per-layer linear maps of one low-rank hidden signal
  per token (correlated across layers) plus a little noise.
- ``integer_kv``: small integers times powers of two from numpy's PCG64, exact in float16
  and bfloat16 on every CPU (the codec digests' input).
"""
from __future__ import annotations

import numpy as np
import torch


def make_kv(layers: int = 3, tokens: int = 40, kv_heads: int = 2, head_dim: int = 16, *,
            dtype: torch.dtype = torch.bfloat16, seed: int = 0, k_scale: float = 1.0,
            k_shift: float = 0.0, v_scale: float = 1.0,
            channel_scales: tuple[float, float] | torch.Tensor | None = None,
            scales_per_head: bool = False, outlier_channels: tuple[int, float] | None = None,
            v_token_scales: tuple[float, float] | None = None, sink_gain: float | None = None,
            zero_token: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of shape [layers, tokens, kv_heads, head_dim] in ``dtype``, computed in float32
    and then cast. From ``torch.Generator().manual_seed(seed)``, in this order:

    1. ``channel_scales=(low, span)``: K's channel scales ``low + span * U[0, 1)`` of shape
       [1, 1, 1, head_dim], or [layers, 1, kv_heads, head_dim] with ``scales_per_head``.
       A tensor is used as given (broadcast against K; nothing drawn). Default: none.
    2. K = N(0, 1) * channel scales * k_scale + k_shift; ``outlier_channels=(n, gain)``
       multiplies the scales of K's first ``n`` channels by ``gain`` (ones if no scales).
    3. V = N(0, 1) * v_scale; ``v_token_scales=(low, span)`` then multiplies V by a
       per-(layer, token) scale ``low + span * U[0, 1)`` of shape [layers, tokens, 1, 1].
    4. ``sink_gain`` multiplies K's first token; ``zero_token`` sets that token of K and V
       to 0.

    Multiplications by 1 and additions of 0 are skipped (the bytes of the plain call are
    those of earlier versions). Raises nothing of its own (torch's errors for bad shapes).
    """
    g = torch.Generator().manual_seed(seed)
    shape = (layers, tokens, kv_heads, head_dim)
    scale = None
    if isinstance(channel_scales, torch.Tensor):
        scale = channel_scales.clone()
    elif channel_scales is not None:
        low, span = channel_scales
        sshape = (layers, 1, kv_heads, head_dim) if scales_per_head else (1, 1, 1, head_dim)
        scale = torch.rand(sshape, generator=g) * span + low
    if outlier_channels is not None:
        n, gain = outlier_channels
        scale = torch.ones(head_dim) if scale is None else scale
        scale[..., :n] *= gain
    k = torch.randn(shape, generator=g)
    if scale is not None:
        k = k * scale
    if k_scale != 1.0:
        k = k * k_scale
    if k_shift != 0.0:
        k = k + k_shift
    v = torch.randn(shape, generator=g)
    if v_scale != 1.0:
        v = v * v_scale
    if v_token_scales is not None:
        low, span = v_token_scales
        v = v * (low + torch.rand(layers, tokens, 1, 1, generator=g) * span)
    if sink_gain is not None:
        k[:, 0] *= sink_gain
    if zero_token is not None:
        k[:, zero_token] = 0
        v[:, zero_token] = 0
    return k.to(dtype), v.to(dtype)


def mixed_kv(layers: int, tokens: int, kv_heads: int, head_dim: int, *, seed: int = 0,
             mix: torch.Tensor | None = None, k_decay: float = 0.0, v_decay: float = 0.0,
             return_mix: bool = False):
    """float32 K, V [layers, tokens, kv_heads, head_dim] with correlated channels: from
    ``torch.Generator().manual_seed(seed)``, the mixing ``mix`` [C, C] (C = kv_heads *
    head_dim; drawn N(0, 1) first unless given), then K = (N(0, 1) [layers, tokens, C] *
    logspace(0, k_decay, C)) @ mix, then V likewise with ``v_decay`` (a decay of 0 skips
    the spectrum). Returns (k, v), or (k, v, mix) with ``return_mix``."""
    g = torch.Generator().manual_seed(seed)
    c = kv_heads * head_dim
    if mix is None:
        mix = torch.randn(c, c, generator=g)
    out = []
    for decay in (k_decay, v_decay):
        z = torch.randn(layers, tokens, c, generator=g)
        if decay != 0.0:
            z = z * torch.logspace(0, decay, c)
        out.append((z @ mix).reshape(layers, tokens, kv_heads, head_dim))
    return (*out, mix) if return_mix else tuple(out)


def correlated_kv(layers: int, tokens: int, kv_heads: int, head_dim: int, seed: int,
                  decay: float = -2.0, *, mix_seed: int | None = 1000,
                  tail_power: int = 1) -> torch.Tensor:
    """One float32 tensor [layers, tokens, kv_heads, head_dim] whose C = kv_heads * head_dim
    channels are correlated: bmm(z, mix) + 0.5 with a per-layer mixing ``mix`` [layers, C, C]
    ~ N(0, 1) from ``manual_seed(mix_seed)`` (the same for every ``seed``; None: drawn
    first from the ``seed`` generator) and z = N(0, 1) [layers, tokens, C] from
    ``manual_seed(seed)``, raised to ``tail_power`` (3: heavy tails) and times
    logspace(0, decay, C)."""
    c = kv_heads * head_dim
    g = torch.Generator().manual_seed(seed)
    gm = g if mix_seed is None else torch.Generator().manual_seed(mix_seed)
    mix = torch.randn(layers, c, c, generator=gm)
    z = torch.randn(layers, tokens, c, generator=g)
    if tail_power != 1:
        z = z ** tail_power
    z = z * torch.logspace(0, decay, c)
    return (torch.bmm(z, mix) + 0.5).reshape(layers, tokens, kv_heads, head_dim)


def low_rank_kv(layers: int, tokens: int, kv_heads: int, head_dim: int, seed: int, *,
                rank: int = 6, map_seed: int = 500) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 K, V [layers, tokens, kv_heads, head_dim], linear maps of one hidden signal
    h [tokens, rank] shared by all layers: the maps wk, wv [layers, rank, C] ~ N(0, 1) from
    ``manual_seed(map_seed)``; from ``manual_seed(seed)`` h = N(0, 1) * logspace(0, -1,
    rank), then K's and V's own noise 0.05 * N(0, 1); K = h wk + noise + 0.3, V = h wv +
    noise."""
    c = kv_heads * head_dim
    g = torch.Generator().manual_seed(map_seed)
    wk = torch.randn(layers, rank, c, generator=g)
    wv = torch.randn(layers, rank, c, generator=g)
    g2 = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, rank, generator=g2) * torch.logspace(0, -1, rank)
    k = torch.einsum("tr,lrc->ltc", h, wk) + 0.05 * torch.randn(layers, tokens, c, generator=g2) + 0.3
    v = torch.einsum("tr,lrc->ltc", h, wv) + 0.05 * torch.randn(layers, tokens, c, generator=g2)
    return k.reshape(layers, tokens, kv_heads, head_dim), v.reshape(layers, tokens, kv_heads, head_dim)


def integer_kv(layers: int, tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype, *,
               seed: int = 20261202) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [layers, tokens, kv_heads, head_dim] of ``dtype`` (float16 or bfloat16), drawn
    as numpy arrays from ``np.random.default_rng(seed)`` (integers only, no float
    generator): integers in [-127, 127] times 2^e per channel (e in -6..0, every 29th
    channel 2^2: outliers) plus a slow per-channel drift, rounded to 8 significant bits.
    Raises AssertionError if a value is not exact in ``dtype``."""
    rng = np.random.default_rng(seed)
    shape = (layers, 2, tokens, kv_heads, head_dim)
    q = rng.integers(-127, 128, size=shape).astype(np.float32)
    e = rng.integers(-6, 1, size=(layers, 2, 1, kv_heads, head_dim)).astype(np.float32)
    e[:, :, :, :, ::29] = 2.0
    drift = np.cumsum(rng.integers(-1, 2, size=shape), axis=2).astype(np.float32)
    x = np.clip(q + 4 * drift, -255, 255) * np.exp2(e - 7)     # |x| <= 255 * 2^-5 ... 2^-5
    x = np.round(x * 2**12) / 2**12                             # keep 8 significant bits
    t = torch.from_numpy(np.ascontiguousarray(x))
    assert torch.equal(t.to(dtype).to(torch.float32), t), "integer KV is not exact"
    return t[:, 0].to(dtype).contiguous(), t[:, 1].to(dtype).contiguous()


def lmcache_planes(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """LMCache's layout [2, layers, tokens, kv_heads * head_dim] of our [layers, tokens,
    kv_heads, head_dim] K and V (same dtype)."""
    return torch.stack([k.reshape(*k.shape[:2], -1), v.reshape(*v.shape[:2], -1)])


NORMAL_KV_SHAPE = (3, 256, 2, 64)      # L, T, H, D


def normal_kv(dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The KV the outlier tests put outliers into, of shape ``NORMAL_KV_SHAPE``: Gaussian
    with mild channel structure (K's channel scales 0.5 + 2 U[0, 1), V * 0.7; max/median of
    a head ~6-10, like real KV): ``make_kv`` with those options."""
    return make_kv(*NORMAL_KV_SHAPE, dtype=dtype, seed=seed, channel_scales=(0.5, 2.0), v_scale=0.7)
