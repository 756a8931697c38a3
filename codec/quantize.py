"""Reference quantizers of the codec, as pure torch functions with exact arithmetic.

Implements CacheGen's layer-wise symmetric quantization (Liu et al., SIGCOMM 2024,
section 5.2; as LMCache's cachegen serde implements it, lmcache/storage_backend/serde/
cachegen_encoder.py and cachegen_basics.py) and the variants
measured in docs/codec.md section 4 (scales per (layer, token), per (layer, token, KV
head) or per (layer, KV head) over a chunk are all just a choice of the ``scale`` tensor
below; log-quantized 8-bit scales; anchor/delta token groups, measured and not used by
the codec), plus the KIVI (Liu et al., ICML 2024) asymmetric group quantizer and an FP8
(e4m3) cast used by the baselines.

The arithmetic is specified so another backend (the Triton kernels) can reproduce the
symbols bit for bit. For a tensor ``x`` (any float dtype), a float32 scale ``s`` that
broadcasts against it and ``M = bins // 2 - 1`` (per layer, float32):

    x32  = x.to(float32)
    inv  = M / s          if s > 0 else 0          # one float32 division (IEEE, RNE)
    q    = round(x32 * inv)                        # one float32 multiply, then round half
                                                   # to even (torch.round / rint)
    q    = clamp(q, -M, M)
    sym  = uint8(q + M)                            # symbols in [0, 2M]

    step = s / M                                   # one float32 division
    x_hat = (float32(sym) - M) * step              # float32, then cast to the output dtype

so |x32 - x_hat| <= s / (2M) (plus float32 rounding, <= 2 ulp of |x|) for every element
with |x| <= s. An all-zero row has s = 0 -> inv = 0 -> every symbol M -> x_hat = 0 (no NaN).

Limits of the dtype (issue 12.2): ``x_hat`` is clamped to the output dtype's finite range
before the cast (``to_dtype_clamped``: float32 rounding of ``M * (s / M)`` can exceed
float32's max when s is near it); scales below ``TINY_SCALE`` = 2^-100 are flushed to 0 by
the codecs (``flush_tiny_scales``) so that ``M / s`` cannot overflow float32 (bf16/fp32
subnormal groups decode as zeros: absolute error < 2^-100). KIVI computes its range and
step in float64 (``max - min`` of two finite values can overflow float32).

Outliers (issue 12.3, cachegen's "chunk_head" groups): ``outlier_thresholds`` gives per
group ``OUTLIER_RATIO * median(|x|)`` (the median over every channel of every step-th
token, about ``OUTLIER_SAMPLE`` elements, so that it is cheap and identical on every
backend); values
with ``|x| > threshold`` are stored exactly in a sparse side list and the group's scale is
the max |x| of the rest (docs/bitstream.md section 4.4). The rule follows the outlier
handling of LLM.int8() (Dettmers et al., NeurIPS 2022, section 3.2: "mixed-precision
decomposition", outliers kept in 16 bit) and SpQR (Dettmers et al., ICLR 2024, section
4.1: sparse exact outliers beside a dense low-bit matrix), with a median-based threshold
as in robust statistics (median absolute value, Hampel's rule).

Scales: ``row_scales`` = max |x| over the grouped channels, computed in float32 (exact:
the max of dtype values is a dtype value). ``log8`` scales replace it by the smallest
representable value >= s of the grid ``ldexp(LOG8_MANTISSA[(c-1) % 8], e0 + (c-1) // 8)``
for uint8 codes ``c`` in 1..255 (code 0 = scale 0), ``e0`` = floor(log2(min positive s))
of the tensor; rounding UP means no element is clipped.

Run the tests: .venv/bin/python -m pytest tests/codec/test_codec_quant*.py -q
"""
from __future__ import annotations

import math

import numpy as np
import torch

from . import scratch

__all__ = [
    "LOG8_MANTISSA",
    "max_levels",
    "row_scales",
    "quantize",
    "dequantize",
    "encode_log8",
    "decode_log8",
    "anchor_delta_quantize",
    "kivi_quantize",
    "kivi_dequantize",
    "fp8_quantize",
    "fp8_dequantize",
    "empirical_entropy_bits",
    "TINY_SCALE",
    "OUTLIER_RATIO",
    "OUTLIER_SAMPLE",
    "to_dtype_clamped",
    "flush_tiny_scales",
    "outlier_thresholds",
    "CHANNEL_GAP",
    "CHANNEL_MAX",
    "CHANNEL_MEDIAN_GAP",
    "CHANNEL_MAX_EXP",
    "outlier_channels",
    "scale_channels",
]

TINY_SCALE = 2.0 ** -100   # smaller group scales are flushed to 0 (M / s would overflow)
# |x| > OUTLIER_RATIO * median(|x|) of its group is an outlier. Measured on the default
# model's KV (needle 1022 tokens + 3 pydoc contexts of 2048 tokens: 7 chunks of <= 1024,
# 90 (layer, KV head) groups per tensor): max/median is 7.2-36.0, so 64 (1.8x the largest
# seen) extracts nothing from normal KV, while a value 100x the typical magnitude is
# always taken out.
OUTLIER_RATIO = 64.0
OUTLIER_SAMPLE = 4096      # about this many elements per group enter the median
# Outlier CHANNELS (issue 28.7): per (layer, KV head) group, the channel maxima over the
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


def to_dtype_clamped(x32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32/float64 -> ``dtype``, clamping to the dtype's finite range first (so float
    rounding at the dtype's max gives max, never inf)."""
    big = torch.finfo(dtype).max
    return x32.clamp(-big, big).to(dtype)


def flush_tiny_scales(s: torch.Tensor) -> torch.Tensor:
    """Scales (float32, >= 0) below ``TINY_SCALE`` -> 0 (the group decodes to zeros)."""
    return torch.where(s < TINY_SCALE, torch.zeros_like(s), s)


def _sample_step(x: torch.Tensor, dims: tuple) -> int:
    """Step along the first reduced dim (tokens) so that at most ~OUTLIER_SAMPLE elements
    of each group enter the median: every channel of every step-th token."""
    per = math.prod(x.shape[d] for d in dims[1:])      # elements per token of a group
    rows = max(1, OUTLIER_SAMPLE // per)               # tokens wanted in the sample
    return max(1, -(-x.shape[dims[0]] // rows))


def outlier_thresholds(x: torch.Tensor, dims: tuple) -> torch.Tensor:
    """Per-group outlier thresholds ``OUTLIER_RATIO * median(|x|)`` (float32, keepdim over
    ``dims``, e.g. x [L, T, H, D] with dims (1, 3) -> [L, 1, H, 1]).

    The median is torch's lower median over a sample of each group: every ``step``-th
    index of the first reduced dim (tokens: 0, step, 2*step, ...) with ALL indices of the
    other reduced dims (channels), ``step`` = ceil(T / (OUTLIER_SAMPLE // D)) - so an
    outlier channel is 1/D of the sample and an outlier token at most one sampled row.
    Exact selection in the KV dtype, so the same on CPU and CUDA; only the sample is
    copied. A group whose median is 0 gets threshold 0 (every non-zero value is an
    outlier)."""
    dims = tuple(sorted(d % x.dim() for d in dims))
    keep = [d for d in range(x.dim()) if d not in dims]
    step = _sample_step(x, dims)
    sl = [slice(None)] * x.dim()
    sl[dims[0]] = slice(None, None, step)
    sample = x[tuple(sl)].permute(*keep, *dims)
    groups = math.prod(x.shape[d] for d in keep)
    sample = sample.reshape(groups, -1).abs()                  # [groups, n_sample]
    # abs and the median are exact in the KV dtype (a selection): convert only the result
    med = sample.median(dim=1).values.to(torch.float32)
    thr = med * OUTLIER_RATIO
    out_shape = [1 if d in dims else x.shape[d] for d in range(x.dim())]
    return thr.reshape(out_shape)


def outlier_channels(x: torch.Tensor, x_orig: torch.Tensor | None = None):
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
    Returns ``(flat indices int64 [n] into [L, H, D], C order, increasing; exponents uint8
    [n] in 1..CHANNEL_MAX_EXP)`` as numpy arrays, or None when no group has one."""
    L, T, H, D = x.shape
    kmax = min(CHANNEL_MAX, D - 1)
    if kmax < 1 or T == 0:
        return None
    ax = x.abs()
    c = ax.amax(dim=1).to(torch.float32)                         # [L, H, D]
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


def scale_channels(x: torch.Tensor, idx: np.ndarray, exps: np.ndarray, sign: int
                   ) -> torch.Tensor:
    """x [L, T, H, D] with channel ``idx`` (flat into [L, H, D]) multiplied by
    ``2^(sign * exp)`` (sign -1: the encoder's pre-scaling, +1: the decoder's inverse), in
    float32 then rounded to x's dtype clamped to its finite range (exact for a power of
    two unless the result leaves the dtype's normal range). In place on x (which may be a
    view); returns x."""
    L, T, H, D = x.shape
    i = torch.from_numpy(np.asarray(idx, dtype=np.int64)).to(x.device)
    f = torch.ldexp(torch.ones(len(idx), dtype=torch.float32, device=x.device),
                    torch.from_numpy(np.asarray(exps, dtype=np.int64) * sign).to(x.device))
    li, hi, di = i // (H * D), (i // D) % H, i % D
    vals = x[li, :, hi, di].to(torch.float32) * f.unsqueeze(1)     # [n, T]
    x[li, :, hi, di] = to_dtype_clamped(vals, x.dtype)
    return x


# float32 constants 2^(j/8) rounded UP to float32 (j = 0..7), written exactly in hex.
LOG8_MANTISSA = torch.tensor([float.fromhex(h) for h in (
    "0x1.000000p+0", "0x1.172b84p+0", "0x1.306fe2p+0", "0x1.4bfdaep+0",
    "0x1.6a09e8p+0", "0x1.8ace56p+0", "0x1.ae89fap+0", "0x1.d5818ep+0")],
    dtype=torch.float32)
LOG8_STEPS = 8          # codes per octave: worst-case scale overshoot 2^(1/8) = +9.1%
LOG8_MAX_CODE = 255
LOG8_E0_RANGE = (-160, 140)   # float32 subnormals .. largest finite, with margin


def max_levels(bins_per_layer, device=None) -> torch.Tensor:
    """M = bins // 2 - 1 per layer as a float32 tensor [L] (symbols lie in [0, 2M])."""
    return torch.tensor([b // 2 - 1 for b in bins_per_layer], dtype=torch.float32,
                        device=device)


def row_scales(x: torch.Tensor, dim=-1) -> torch.Tensor:
    """max |x| over ``dim`` (keepdim), float32. E.g. x [L, T, G, D] -> [L, T, G, 1].
    The reference (torch only); ``codec.fused.row_absmax_fast`` is its bit-identical numba
    twin, chosen by the caller (``codec.cachegen``), never from here."""
    return x.to(torch.float32).abs().amax(dim=dim, keepdim=True)


def _bcast_levels(max_level: torch.Tensor, ndim: int) -> torch.Tensor:
    """[L] -> [L, 1, ..., 1] with ``ndim`` dims in total."""
    return max_level.to(torch.float32).reshape((-1,) + (1,) * (ndim - 1))


def quantize(x: torch.Tensor, scale: torch.Tensor, max_level: torch.Tensor) -> torch.Tensor:
    """Symmetric quantization (CacheGen / LMCache), exact arithmetic in the module docstring.

    Args:
      x: [L, ...] float16/bfloat16/float32 (layer first).
      scale: float32, broadcastable to x (e.g. [L, T, G, 1] for x [L, T, G, D]); the
        effective scale, i.e. after any log8 rounding; must be >= max |x| of its group.
      max_level: float32 [L], M = bins/2 - 1 per layer (1..127).
    Returns: uint8 symbols, shape of x, in [0, 2M].
    The reference (torch only); ``codec.fused.quantize_fast`` is its bit-identical numba
    twin, chosen by the caller (``codec.cachegen``), never from here.
    """
    if x.shape[0] != max_level.shape[0]:
        raise ValueError(f"x has {x.shape[0]} layers but max_level has {max_level.shape[0]}")
    m = _bcast_levels(max_level, x.dim())
    scale = scale.to(torch.float32)
    inv = torch.where(scale > 0, m / torch.where(scale > 0, scale, torch.ones_like(scale)),
                      torch.zeros_like(scale))
    q = torch.round(x.to(torch.float32) * inv)
    q = torch.minimum(torch.maximum(q, -m), m)
    return (q + m).to(torch.uint8)


def dequantize(sym: torch.Tensor, scale: torch.Tensor, max_level: torch.Tensor
               ) -> torch.Tensor:
    """Inverse of ``quantize``: float32 ``(sym - M) * (scale / M)``, shape of ``sym``."""
    m = _bcast_levels(max_level, sym.dim()).to(sym.device)
    step = scale.to(torch.float32) / m
    # float32 rounding of M * (s / M) may exceed float32's max for s near it: clamp
    return to_dtype_clamped((sym.to(torch.float32) - m) * step, torch.float32)


# ---------------------------------------------------------------------------- log8 scales
def log8_values(e0: int, device=None) -> torch.Tensor:
    """The 256 float32 scale values of the log8 grid for base exponent ``e0`` (code 0 = 0)."""
    c = torch.arange(1, LOG8_MAX_CODE + 1, dtype=torch.int64)
    mant = LOG8_MANTISSA[(c - 1) % LOG8_STEPS]
    exp = (e0 + (c - 1) // LOG8_STEPS).to(torch.int32)
    vals = torch.ldexp(mant, exp.to(torch.float32)).to(torch.float32)
    return torch.cat([torch.zeros(1, dtype=torch.float32), vals]).to(device)


def encode_log8(scale: torch.Tensor):
    """Log-quantize non-negative float32 scales to uint8 codes, rounding UP.

    Returns ``(codes uint8 (shape of scale), e0 int, effective float32 scales)`` or
    ``None`` when the scales span more than the grid's ~31.9 octaves (the caller then
    stores scales in the model dtype). Effective scale >= scale elementwise, with equality
    for zeros; relative overshoot < 2^(1/8) - 1 = 9.1%.
    """
    s = scale.to(torch.float32)
    if not bool(torch.isfinite(s).all()) or bool((s < 0).any()):
        raise ValueError("scales must be finite and >= 0")
    pos = s > 0
    if not bool(pos.any()):
        return torch.zeros(s.shape, dtype=torch.uint8), 0, torch.zeros_like(s)
    smin = s[pos].min()
    _, e = torch.frexp(smin)          # smin = m * 2^e, m in [0.5, 1) -> floor(log2) = e - 1
    e0 = int(e) - 1
    grid = log8_values(e0, device=s.device)               # [256], ascending from index 1
    if bool(s.max() > grid[-1]):
        return None
    # smallest code c >= 1 with grid[c] >= s: searchsorted over the ascending grid[1:]
    codes = torch.searchsorted(grid[1:].contiguous(), s.reshape(-1), right=False) + 1
    codes = torch.where(pos.reshape(-1), codes, torch.zeros_like(codes)).reshape(s.shape)
    codes = codes.to(torch.uint8)
    eff = grid[codes.long()]
    if not bool(torch.isfinite(eff).all()):
        return None      # a rounded-up scale overflows float32: keep dtype scales
    assert bool((eff >= s).all())
    return codes, e0, eff


def decode_log8(codes: torch.Tensor, e0: int) -> torch.Tensor:
    """Effective float32 scales of uint8 ``codes`` with base exponent ``e0``."""
    return log8_values(e0, device=codes.device)[codes.long()]


# ------------------------------------------------------------------ anchor / delta groups
def anchor_delta_quantize(x: torch.Tensor, max_level: torch.Tensor, group: int,
                          delta_max_level: torch.Tensor | None = None):
    """Paper section 5.2 change-based encoding, closed loop, for measurement.

    x: [L, T, G, D]. Tokens ``t % group == 0`` are anchors, quantized as usual (scale per
    (layer, token, group)); the others are quantized as ``x_t - x_hat_anchor`` with their
    own row scales (``delta_max_level`` bins, default the same).
    Returns ``(sym_anchor [L, Ta, G, D], sym_delta [L, T - Ta, G, D], x_hat float32
    [L, T, G, D], scales [L, T, G, 1])``.
    """
    L, T, G, D = x.shape
    dml = max_level if delta_max_level is None else delta_max_level
    x32 = x.to(torch.float32)
    is_anchor = (torch.arange(T) % group) == 0
    xa = x32[:, is_anchor]                                   # [L, Ta, G, D]
    sa = row_scales(xa)
    syma = quantize(xa, sa, max_level)
    xa_hat = dequantize(syma, sa, max_level)
    anchor_of = (torch.arange(T) // group)                   # index into anchors
    ref = xa_hat[:, anchor_of[~is_anchor]]                   # [L, Td, G, D]
    d = x32[:, ~is_anchor] - ref
    sd = row_scales(d)
    symd = quantize(d, sd, dml)
    xd_hat = ref + dequantize(symd, sd, dml)
    x_hat = scratch.empty(x32.shape, dtype=x32.dtype)
    x_hat[:, is_anchor] = xa_hat
    x_hat[:, ~is_anchor] = xd_hat
    scales = scratch.empty((L, T, G, 1), dtype=torch.float32)
    scales[:, is_anchor] = sa
    scales[:, ~is_anchor] = sd
    return syma, symd, x_hat, scales


# ------------------------------------------------------------------------------ KIVI
def _round_up_to(x32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32/float64 -> dtype, rounded UP (so a stored step never shrinks the range)."""
    y = x32.to(dtype)
    low = y.to(x32.dtype) < x32
    if bool(low.any()):
        y = torch.where(low, torch.nextafter(y, torch.full_like(y, float("inf"))), y)
    return y


def kivi_quantize(x: torch.Tensor, bits: int, dim: int, group: int):
    """KIVI asymmetric quantization of ``x`` in groups of ``group`` along ``dim``
    (keys: dim = token axis, "per-channel"; values: dim = channel axis, "per-token").

    x: [..., N, ...] float; N (the size along ``dim``) must be a multiple of ``group``.
    Per group: ``lo = min``, ``step = (max - lo) / (2^bits - 1)`` computed in float64 (the
    range of two finite values can overflow float32) and rounded UP to x.dtype,
    ``q = clamp(round((x64 - lo) / step), 0, 2^bits - 1)`` (step 0 -> q = 0).
    Returns ``(q uint8 shape of x, lo x.dtype, step x.dtype)`` where lo/step have ``dim``
    replaced by N // group. Dequant (``kivi_dequantize``): ``q * step + lo`` in float64,
    clamped to [lo, the dtype's max]: |x - x_hat| <= step / 2 (+ the dtype's rounding).
    """
    dim = dim % x.dim()
    n = x.shape[dim]
    if n % group:
        raise ValueError(f"size {n} along dim {dim} is not a multiple of group {group}")
    xg = x.to(torch.float64).unflatten(dim, (n // group, group))   # [..., n/g, g, ...]
    lo64 = xg.amin(dim=dim + 1, keepdim=True)
    hi64 = xg.amax(dim=dim + 1, keepdim=True)
    qmax = float((1 << bits) - 1)
    step = _round_up_to((hi64 - lo64) / qmax, x.dtype)   # <= 2/3 of the dtype's max: finite
    lo = lo64.to(x.dtype)                     # exact: the min of dtype values
    step64 = step.to(torch.float64)
    safe = torch.where(step64 > 0, step64, torch.ones_like(step64))
    q = torch.round((xg - lo64) / safe)
    q = torch.where(step64 > 0, q, torch.zeros_like(q)).clamp(0, qmax)
    return (q.to(torch.uint8).flatten(dim, dim + 1), lo.squeeze(dim + 1),
            step.squeeze(dim + 1))


def kivi_dequantize(q: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, dim: int,
                    group: int) -> torch.Tensor:
    """Inverse of ``kivi_quantize``: ``q * step + lo`` in float64, clamped to the finite
    range of ``lo``'s dtype, returned as float32 (the caller casts to the dtype: no inf)."""
    dim = dim % q.dim()
    n = q.shape[dim]
    qg = q.to(torch.float64).unflatten(dim, (n // group, group))
    out = qg * step.to(torch.float64).unsqueeze(dim + 1) + lo.to(torch.float64).unsqueeze(dim + 1)
    big = torch.finfo(lo.dtype).max
    return out.clamp(-big, big).flatten(dim, dim + 1).to(torch.float32)


# ------------------------------------------------------------------------------- FP8
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def fp8_quantize(x: torch.Tensor) -> torch.Tensor:
    """Cast to float8 e4m3 (round to nearest even), saturating at +-448; returned as the
    uint8 bit pattern."""
    y = x.to(torch.float32).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return y.view(torch.uint8)


def fp8_dequantize(bits: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3 bit patterns -> float32."""
    return bits.view(torch.float8_e4m3fn).to(torch.float32)


# --------------------------------------------------------------- ideal entropy estimate
def empirical_entropy_bits(sym: torch.Tensor, nbins: int) -> float:
    """Sum over channels of n * H(channel) in bits, for ``sym`` [N, C] (N samples per
    channel, one distribution per channel; CacheGen's per-(layer, channel) model)."""
    if sym.numel() == 0:
        return 0.0
    n, c = sym.shape
    idx = sym.to(torch.int64) + torch.arange(c).unsqueeze(0) * nbins
    counts = torch.bincount(idx.reshape(-1), minlength=c * nbins).to(torch.float64)
    nz = counts[counts > 0]
    # sum_c sum_s -n_cs log2(n_cs / n)
    return float(-(nz * torch.log2(nz / n)).sum())
