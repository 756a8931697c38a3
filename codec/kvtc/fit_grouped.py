"""The grouped KVTC calibration fit (``group_layers`` = G > 0, kvtc format 4): one PCA per
group of G layers over the whitened K and V features side by side, and one water level for
all components. Called by ``codec.kvtc.fit.fit_calibration``.

Separate from codec.kvtc.fit because the grouped layout fits a different model (joint
bases over layers and K/V, an analysis matrix beside the basis) from the per-(K/V, layer)
one.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from .calibration import KvtcCalibration, MAX_Q, _check_calibration
from .pca import _metric_sqrt
from .rate import _RATE_SAMPLE_TOKENS, _solve_levels


def _fit_grouped(k: torch.Tensor, v: torch.Tensor, G: int, targets: dict,
                 default_level: int, weighting: Any, metric: Optional[tuple],
                 metric_power: float, rounding: float, key_space: str, theta_rope: float,
                 sink_tokens: int, recent_tokens: int, meta: dict, say) -> KvtcCalibration:
    """``fit_calibration`` with ``group_layers`` = G (k pre-RoPE already when asked).
    Block b = (K/V, layer): z_b = (x_b - mean_b) S_b / sqrt(w_b), S_b the metric's square
    root (identity without a metric), w_b the block's water-level weight; group g's
    features are its blocks' z side by side ([K_l, V_l] per layer), and one PCA per group
    and ONE water level for all components (the weighted distortion sum_b ||e_b S_b||^2
    / w_b is the plain squared error of z). analysis_g = blockdiag(S_b / sqrt(w_b)) U_g,
    basis_g = blockdiag(S_b^-1 sqrt(w_b)) U_g (basis^T analysis = I)."""
    L, N, H, D = k.shape
    C = H * D
    NG = -(-L // G)
    Cg = 2 * G * C
    mean = np.zeros((NG, Cg))
    var = np.zeros((NG, Cg))
    basis = np.zeros((NG, Cg, Cg))
    analysis = np.zeros((NG, Cg, Cg))
    cap = np.zeros((NG, Cg))
    rng = np.random.default_rng(0)
    sub = np.sort(rng.choice(N, size=min(N, _RATE_SAMPLE_TOKENS), replace=False))
    coefs = np.zeros((NG, len(sub), Cg), np.float32)
    # per-block whitening matrices and centred, whitened features
    sq = np.zeros((2, L, C, C))
    isq = np.zeros((2, L, C, C))
    blk_mean = np.zeros((2, L, C))
    zvar = np.zeros((2, L))
    for kv, x in enumerate((k, v)):
        for layer in range(L):
            if metric is not None:
                sq[kv, layer], isq[kv, layer] = _metric_sqrt(metric[kv][layer],
                                                             float(metric_power), H, D)
            else:
                sq[kv, layer] = isq[kv, layer] = np.eye(C)
            xl = x[layer].reshape(N, C).numpy().astype(np.float64)
            blk_mean[kv, layer] = xl.mean(0)
            zvar[kv, layer] = ((xl - blk_mean[kv, layer]) @ sq[kv, layer]).var(0).mean()
    if isinstance(weighting, np.ndarray):
        w = weighting.astype(np.float64)
    else:
        w = zvar if weighting == "relative" else np.ones((2, L))
    w = np.maximum(w, 1e-30)
    for g in range(NG):
        ls = range(g * G, min(L, (g + 1) * G))
        width = 2 * len(ls) * C
        a = np.zeros((Cg, Cg))          # blockdiag(S_b / sqrt(w_b)), padded
        ai = np.zeros((Cg, Cg))         # its inverse
        z = np.zeros((N, Cg))
        for j, layer in enumerate(ls):
            for kv, x in enumerate((k, v)):
                sl = slice((2 * j + kv) * C, (2 * j + kv + 1) * C)
                a[sl, sl] = sq[kv, layer] / np.sqrt(w[kv, layer])
                ai[sl, sl] = isq[kv, layer] * np.sqrt(w[kv, layer])
                mean[g, sl] = blk_mean[kv, layer]
                xl = x[layer].reshape(N, C).numpy().astype(np.float64)
                z[:, sl] = (xl - blk_mean[kv, layer]) @ a[sl, sl]
        cov = z[:, :width].T @ z[:, :width] / N
        lam, u = np.linalg.eigh(cov)
        order = np.argsort(-lam, kind="stable")
        lam, u = np.clip(lam[order], 0.0, None), u[:, order]
        sign = np.sign(u[np.abs(u).argmax(0), np.arange(width)])
        sign[sign == 0] = 1
        u = u * sign
        var[g, :width] = lam
        analysis[g, :, :width] = a[:, :width] @ u
        basis[g, :, :width] = ai[:, :width] @ u
        cl = z[:, :width] @ u
        cap[g, :width] = np.abs(cl).max(0) * 1.05 / MAX_Q
        coefs[g, :, :width] = cl[sub]
        say(f"PCA group {g + 1}/{NG} (layers {ls.start}-{ls.stop - 1}, {width} features)")
    steps = _solve_levels(np.ones(NG), var, cap, coefs, 2 * L * len(sub) * C, targets, {},
                          rounding, say)
    levels = sorted(targets)
    cal = KvtcCalibration(
        L, H, D, mean.astype(np.float32), basis.astype(np.float32), var.astype(np.float32),
        steps.astype(np.float32), tuple(levels), tuple(float(targets[x]) for x in levels),
        int(default_level), key_space, theta_rope, False, sink_tokens, recent_tokens,
        dict(meta, group_layers=G), shrink=None, rounding=float(rounding),
        analysis=analysis.astype(np.float32), group_layers=G)
    _check_calibration(cal, "fit_calibration")
    cal.hash = cal.content_hash()
    return cal
