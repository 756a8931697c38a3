"""The baselines' low-bit quantizers: KIVI's asymmetric groups and the FP8 (e4m3) cast.

Separate from ``codec.quant.reference`` (cachegen's symmetric quantizer) because they serve other
codecs (``codec.codecs.baselines``, ``codec.quant.fused``) and share none of its arithmetic. KIVI
(Liu et al., ICML 2024) computes its range and step in float64 (``max - min`` of two
finite values can overflow float32).
"""
from __future__ import annotations

import torch


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


