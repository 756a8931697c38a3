"""Outlier detection of the cachegen codec: which values and which channels stand out.

Separate from ``codec.quant.reference`` (the quantizers themselves) because it only decides
WHAT is taken out before quantization; the caller (``codec.codecs.cachegen``) stores outlier
values in a sparse side list and divides outlier channels by a power of two
(``codec.quant.reference.scale_channels``).

Values (cachegen's "chunk_head" groups): ``outlier_thresholds`` gives per
group ``OUTLIER_RATIO * median(|x|)`` (the median over every channel of every step-th
token, about ``OUTLIER_SAMPLE`` elements, so that it is cheap and identical on every
backend); values
with ``|x| > threshold`` are stored exactly in a sparse side list and the group's scale is
the max |x| of the rest (docs/bitstream.md section 4.4). The rule follows the outlier
handling of LLM.int8() (Dettmers et al., NeurIPS 2022, section 3.2: "mixed-precision
decomposition", outliers kept in 16 bit) and SpQR (Dettmers et al., ICLR 2024, section
4.1: sparse exact outliers beside a dense low-bit matrix), with a median-based threshold
as in robust statistics (median absolute value, Hampel's rule).
"""
from __future__ import annotations

import math

import numpy as np
import torch

# |x| > OUTLIER_RATIO * median(|x|) of its group is an outlier. Measured on the default
# model's KV (needle 1022 tokens + 3 pydoc contexts of 2048 tokens: 7 chunks of <= 1024,
# 90 (layer, KV head) groups per tensor): max/median is 7.2-36.0, so 64 (1.8x the largest
# seen) extracts nothing from normal KV, while a value 100x the typical magnitude is
# always taken out.
OUTLIER_RATIO = 64.0
OUTLIER_SAMPLE = 4096      # about this many elements per group enter the median
# Outlier CHANNELS: per (layer, KV head) group, the channel maxima over the
# chunk's tokens sorted descending c(1) >= c(2) >= ...; the top j channels (j <= CHANNEL_MAX)
# are outlier channels when c(j) > CHANNEL_GAP * c(j + 1) for the largest such j (and their
# medians stand CHANNEL_MEDIAN_GAP above the rest's: see outlier_channels). Measured
# on the default model's KV (README.md, 1020 tokens after the sinks, chunks of 16..1024
# tokens): the largest gap is 2.80 at 1024-token chunks and 3.97 at 16-token chunks (keys;
# values 1.85 / 3.70), so 4 leaves its bytes unchanged, while a channel x20 over all tokens
# stands 5-50x above the rest.
CHANNEL_GAP = 4.0
CHANNEL_MEDIAN_GAP = 2.0   # and their median |x| > 2x the others' (wide, not spikes)
CHANNEL_MAX = 8            # at most this many outlier channels per (layer, KV head)
CHANNEL_MAX_EXP = 64       # exponents 1..64 (a channel is divided by 2^e before quantization)


def sample_step(x: torch.Tensor, dims: tuple) -> int:
    """Step along the first reduced dim (tokens) so that at most ~OUTLIER_SAMPLE elements
    of each group enter the median: every channel of every step-th token."""
    per = math.prod(x.shape[d] for d in dims[1:])      # elements per token of a group
    rows = max(1, OUTLIER_SAMPLE // per)               # tokens wanted in the sample
    return max(1, -(-x.shape[dims[0]] // rows))


def outlier_thresholds(x: torch.Tensor, dims: tuple, med: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """Per-group outlier thresholds ``OUTLIER_RATIO * median(|x|)`` (float32, keepdim over
    ``dims``, e.g. x [L, T, H, D] with dims (1, 3) -> [L, 1, H, 1]). ``med``: the sample
    medians already computed (float32, one per group, e.g. [L, H]; the caller's fused
    pass ``codec.quant.fused.sample_median_abs_fast`` over ``sample_step(x, dims)``), else
    computed here by torch.

    The median is torch's lower median over a sample of each group: every ``step``-th
    index of the first reduced dim (tokens: 0, step, 2*step, ...) with ALL indices of the
    other reduced dims (channels), ``step`` = ceil(T / (OUTLIER_SAMPLE // D)) - so an
    outlier channel is 1/D of the sample and an outlier token at most one sampled row.
    Exact selection in the KV dtype, so the same on CPU and CUDA; only the sample is
    copied. A group whose median is 0 gets threshold 0 (every non-zero value is an
    outlier)."""
    dims = tuple(sorted(d % x.dim() for d in dims))
    keep = [d for d in range(x.dim()) if d not in dims]
    out_shape = [1 if d in dims else x.shape[d] for d in range(x.dim())]
    if med is not None:
        return (med.to(torch.float32) * OUTLIER_RATIO).reshape(out_shape)
    step = sample_step(x, dims)
    sl = [slice(None)] * x.dim()
    sl[dims[0]] = slice(None, None, step)
    sample = x[tuple(sl)].permute(*keep, *dims)
    groups = math.prod(x.shape[d] for d in keep)
    sample = sample.reshape(groups, -1).abs()                  # [groups, n_sample]
    # abs and the median are exact in the KV dtype (a selection): convert only the result
    med = sample.median(dim=1).values.to(torch.float32)
    thr = med * OUTLIER_RATIO
    return thr.reshape(out_shape)


def outlier_channels(x: torch.Tensor, x_orig: torch.Tensor | None = None,
                     c: torch.Tensor | None = None):
    """Outlier channels of x [L, T, H, D] (one chunk's tokens, after the outlier side list
    took its values out; groups = (layer, KV head)); ``x_orig``: the same tokens before
    the side list (default x), whose medians confirm the candidates.

    Per group the channel maxima ``c = max_t |x|`` (float32, exact) sorted descending; the
    largest ``j <= min(CHANNEL_MAX, D - 1)`` with ``c(j) > CHANNEL_GAP * c(j + 1)`` (and
    ``c(j + 1) > 0``) makes the channels with ``c > r = c(j + 1)`` candidates; they are
    outlier channels when the smallest candidate ``median_t |x_orig|`` (torch's lower
    median: a selection, exact) exceeds CHANNEL_MEDIAN_GAP times the largest median of the other
    channels (so a channel is wide, not a few spikes). Exponent ``e = smallest integer
    >= 1 with c / 2^e <= r`` (from the exact binary exponents), capped at CHANNEL_MAX_EXP.
    Depends only on values (not on sort tie order), so every backend finds the same.
    ``c``: the channel maxima ``x.abs().amax(dim=1)`` as float32 [L, H, D] when the caller
    has them (``codec.quant.fused.channel_absmax_fast``: one pass, no abs copy).
    Returns ``(flat indices int64 [n] into [L, H, D], C order, increasing; exponents uint8
    [n] in 1..CHANNEL_MAX_EXP)`` as numpy arrays, or None when no group has one."""
    L, T, H, D = x.shape
    kmax = min(CHANNEL_MAX, D - 1)
    if kmax < 1 or T == 0:
        return None
    if c is None:
        c = x.abs().amax(dim=1).to(torch.float32)                # [L, H, D]
    top = c.sort(dim=2, descending=True).values[..., :kmax + 1]  # [L, H, kmax + 1]
    hi, lo = top[..., :kmax], top[..., 1:]
    ok = (lo > 0) & (hi > CHANNEL_GAP * lo)
    if not bool(ok.any()):
        return None
    j = (ok.to(torch.int64) * torch.arange(1, kmax + 1, device=c.device)).amax(dim=2)
    rest = top.gather(2, j.clamp(min=1).unsqueeze(2))            # c(j + 1): [L, H, 1]
    cand = (c > rest) & (j > 0).unsqueeze(2)
    xo = x if x_orig is None else x_orig
    med = xo.abs().median(dim=1).values.to(torch.float32)        # [L, H, D]
    inf = torch.full_like(med, float("inf"))
    cand_min = torch.where(cand, med, inf).amin(dim=2, keepdim=True)
    rest_max = torch.where(cand, torch.zeros_like(med), med).amax(dim=2, keepdim=True)
    mask = cand & (cand_min > CHANNEL_MEDIAN_GAP * rest_max)
    if not bool(mask.any()):
        return None
    mc, ec = torch.frexp(c)
    mr, er = torch.frexp(rest.expand_as(c))
    e = (ec - er + (mc > mr).to(ec.dtype)).clamp(1, CHANNEL_MAX_EXP)
    flat = torch.nonzero(mask.reshape(-1)).reshape(-1)
    return (flat.cpu().numpy().astype(np.int64),
            e.reshape(-1)[flat].cpu().numpy().astype(np.uint8))

