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

Limits of the dtype: ``x_hat`` is clamped to the output dtype's finite range
before the cast (``to_dtype_clamped``: float32 rounding of ``M * (s / M)`` can exceed
float32's max when s is near it); scales below ``TINY_SCALE`` = 2^-100 are flushed to 0 by
the codecs (``flush_tiny_scales``) so that ``M / s`` cannot overflow float32 (bf16/fp32
subnormal groups decode as zeros: absolute error < 2^-100).

Outlier detection lives in ``codec.quant.outliers``, the KIVI and FP8 quantizers of the baselines
in ``codec.quant.lowbit``.

Scales: ``row_scales`` = max |x| over the grouped channels, computed in float32 (exact:
the max of dtype values is a dtype value). ``log8`` scales replace it by the smallest
representable value >= s of the grid ``ldexp(LOG8_MANTISSA[(c-1) % 8], e0 + (c-1) // 8)``
for uint8 codes ``c`` in 1..255 (code 0 = scale 0), ``e0`` = floor(log2(min positive s))
of the tensor; rounding UP means no element is clipped.

Run the tests: .venv/bin/python -m pytest tests/codec/test_codec_quant*.py -q
"""
from __future__ import annotations

import numpy as np
import torch

from .. import scratch

__all__ = ["LOG8_MANTISSA", "max_levels", "row_scales", "quantize", "dequantize", "encode_log8",
           "decode_log8", "anchor_delta_quantize", "empirical_entropy_bits", "TINY_SCALE",
           "to_dtype_clamped", "flush_tiny_scales", "scale_channels"]

TINY_SCALE = 2.0 ** -100   # smaller group scales are flushed to 0 (M / s would overflow)


def to_dtype_clamped(x32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32/float64 -> ``dtype``, clamping to the dtype's finite range first (so float
    rounding at the dtype's max gives max, never inf)."""
    big = torch.finfo(dtype).max
    return x32.clamp(-big, big).to(dtype)


def flush_tiny_scales(s: torch.Tensor) -> torch.Tensor:
    """Scales (float32, >= 0) below ``TINY_SCALE`` -> 0 (the group decodes to zeros)."""
    return torch.where(s < TINY_SCALE, torch.zeros_like(s), s)



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
    The reference (torch only); ``codec.quant.fused.row_absmax_fast`` is its bit-identical numba
    twin, chosen by the caller (``codec.codecs.cachegen``), never from here."""
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
    The reference (torch only); ``codec.quant.fused.quantize_fast`` is its bit-identical numba
    twin, chosen by the caller (``codec.codecs.cachegen``), never from here.
    """
    if x.shape[0] != max_level.shape[0]:
        raise ValueError(f"x has {x.shape[0]} layers but max_level has {max_level.shape[0]}")
    return quantize_bcast(x, scale, _bcast_levels(max_level, x.dim()))


def quantize_bcast(x: torch.Tensor, scale: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``quantize`` with M already broadcast against x (float32, e.g. [L, 1, 1, 1]): the
    arithmetic itself, also the tests' reference for ``codec.quant.fused.quantize_fast``."""
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
