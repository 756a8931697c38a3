"""The rate side of a KVTC calibration fit: quantizing coefficients (``_quantize``), their
empirical entropy (``_rate_bits``), reverse water-filling steps (``_steps_for``; Cover &
Thomas thm 10.3.3), the per-level solve of the water scale for a target rate
(``solve_levels``) and the centroid offsets (``centroid_shrink``).

Separate from codec.kvtc.pca (the transforms) and codec.kvtc.fit (the entry point): every
function maps coefficients [..., N, C] and steps [..., C] (float64 numpy) to rates or steps.
"""
from __future__ import annotations

import functools

import numpy as np

from .calibration import MAX_Q

RATE_SAMPLE_TOKENS = 1024       # calibration tokens used to solve the per-level scale


def _quantize(u: np.ndarray, rounding: float) -> np.ndarray:
    """q = sign(u) floor(|u| + rounding), clipped to |q| <= MAX_Q (rounding 0.5 = round to
    nearest; smaller = a dead zone around 0). u: coefficients divided by their steps."""
    q = np.floor(np.abs(u) + rounding)
    np.minimum(q, MAX_Q, out=q)
    return np.copysign(q, u)


def _rate_bits(coef: np.ndarray, step: np.ndarray, rounding: float = 0.5) -> float:
    """Empirical entropy (bits) of the quantized coefficients, one histogram per component
    (step 0 = dropped, 0 bits). coef [..., N, C], step [..., C] (leading dims broadcast:
    all (K/V, layer) at once)."""
    keep = step > 0
    if not keep.any():
        return 0.0
    N = coef.shape[-2]
    cf = np.moveaxis(coef, -2, -1)[keep]                    # [n_kept, N]
    u = cf / step[keep][:, None]
    q = _quantize(u, rounding).astype(np.int32) + MAX_Q
    n = q.shape[0]
    q += (2 * MAX_Q + 1) * np.arange(n, dtype=np.int32)[:, None]
    hist = np.bincount(q.ravel(), minlength=n * (2 * MAX_Q + 1)).astype(np.float64)
    nz = hist[hist > 0]
    return float(-(nz * np.log2(nz / N)).sum())


def centroid_shrink(coef: np.ndarray, step: np.ndarray, rounding: float) -> np.ndarray:
    """Centroid reconstruction offsets: for each component, the delta in [0, 0.5] that
    minimises the squared error of reconstructing a non-zero q at (|q| - delta) sign(q)
    step, i.e. delta = mean(|q| - |u|) over the calibration coefficients with q != 0
    (u = coef / step; the conditional mean of a bin, shared by all non-zero bins as for a
    Laplacian source: Sullivan, "Efficient scalar quantization of exponential and
    Laplacian random variables", IEEE Trans. IT 42(5), 1996). coef [..., N, C], step
    [..., C]; returns [..., C] (0 where dropped or never non-zero)."""
    out = np.zeros(step.shape, np.float64)
    keep = step > 0
    if not keep.any():
        return out
    cf = np.moveaxis(coef, -2, -1)[keep]
    u = cf / step[keep][:, None]
    q = _quantize(u, rounding)
    nzm = q != 0
    cnt = nzm.sum(1)
    d = np.where(nzm, np.abs(q) - np.abs(u), 0.0).sum(1) / np.maximum(cnt, 1)
    out[keep] = np.clip(d, 0.0, 0.5)
    return out


def _steps_for(theta: np.ndarray, var: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """Reverse water-filling: step sqrt(12 theta) where var > theta, else 0 (dropped);
    never finer than cap (so |q| <= MAX_Q on the calibration data). theta: one water
    level per (K/V, layer) ([2, L]) or per component ([2, L, C], a weighted distortion)."""
    th = theta if theta.ndim == var.ndim else theta[..., None]
    st = np.sqrt(12.0 * th) * np.ones_like(var)
    st = np.maximum(st, cap)
    st[var <= th] = 0.0
    return st


def solve_levels(w: np.ndarray, var: np.ndarray, cap: np.ndarray, coefs: np.ndarray,
                  n_elem: int, targets: dict, kwater: dict, rounding: float, say
                  ) -> np.ndarray:
    """Per-level quantization steps [NL, *var.shape] (levels sorted): the water scale g of
    each level solved so that the empirical entropy of the quantized calibration
    coefficients ``coefs`` [..., N, C'] is the level's target bits per element
    (``n_elem`` coded elements). w: water-level weights (var's shape or one per block,
    var.shape[:-1]); kwater: level -> factor on the keys' weights (w[0]; ungrouped only).
    The rate falls as the water level grows: a coarse log grid brackets each target, then
    regula falsi (Illinois variant) on log g to within 0.2% of the target."""
    def rate(lg: float, kf: float = 1.0) -> tuple[float, np.ndarray]:
        # lg = log of the water scale; kf = the keys' factor (key_water)
        wl = w if kf == 1.0 else np.concatenate([w[:1] * kf, w[1:]])
        st = _steps_for(np.exp(lg) * wl, var, cap)
        return _rate_bits(coefs, st, rounding) / n_elem, st

    levels = sorted(targets)
    steps = np.zeros((len(levels),) + var.shape, np.float64)
    total = n_elem // max(1, coefs.shape[-2])
    grid = np.linspace(np.log(1e-9), np.log(1e2), 12)
    grid_rates: dict = {}
    for i, lv in enumerate(levels):
        tgt = float(targets[lv])
        kf = float(kwater.get(lv, 1.0))
        if kf not in grid_rates:
            grid_rates[kf] = [rate(float(g), kf)[0] for g in grid]
        grid_rate = grid_rates[kf]
        rate_l = functools.partial(rate, kf=kf)
        j = next((j for j, r in enumerate(grid_rate) if r <= tgt), len(grid) - 1)
        a, b = float(grid[max(0, j - 1)]), float(grid[j])
        ra, rb = grid_rate[max(0, j - 1)], grid_rate[j]
        side = 0
        for _ in range(12):
            if not ra > tgt >= rb or abs(rb - tgt) <= 2e-3 * tgt:
                break
            m = b - (rb - tgt) * (b - a) / (rb - ra)
            rm, _ = rate_l(m)
            if rm > tgt:
                a, ra = m, rm
                if side == -1:
                    rb = tgt + (rb - tgt) / 2
                side = -1
            else:
                b, rb = m, rm
                if side == 1:
                    ra = tgt + (ra - tgt) / 2
                side = 1
        r, st = rate_l(b)
        steps[i] = st
        say(f"level {lv}: target {tgt:.3f} bits/element -> {r:.3f} on the calibration "
            f"data, {int((st > 0).sum())} of {total} components kept")
    return steps
