"""The transforms of a KVTC calibration fit: PCA bases (per (K/V, layer), optionally
block-diagonal per head) and the square root of a per-head distortion metric (whitening).

Separate from codec.kvtc.rate (how finely the components are quantized) and
codec.kvtc.fit (the entry point): pure linear algebra on float64 numpy arrays.
"""
from __future__ import annotations

import numpy as np


def pca_basis(x: np.ndarray, per_head: bool, H: int, D: int) -> tuple[np.ndarray, np.ndarray,
                                                                  np.ndarray]:
    """x float [N, C] -> (mean [C], basis [C, C] orthonormal columns, var [C]) with
    components sorted by variance, descending. per_head: block-diagonal basis."""
    x = x.astype(np.float64)
    mu = x.mean(0)
    xc = x - mu
    C = x.shape[1]
    if per_head:
        basis = np.zeros((C, C))
        var = np.zeros(C)
        for h in range(H):
            s = slice(h * D, (h + 1) * D)
            cov = xc[:, s].T @ xc[:, s] / max(1, len(x))
            w, u = np.linalg.eigh(cov)
            basis[s, s] = u
            var[s] = w
    else:
        cov = xc.T @ xc / max(1, len(x))
        var, basis = np.linalg.eigh(cov)
    order = np.argsort(-var, kind="stable")
    var = np.clip(var[order], 0.0, None)
    basis = basis[:, order]
    # deterministic sign: the largest-magnitude entry of each column is positive
    sign = np.sign(basis[np.abs(basis).argmax(0), np.arange(C)])
    sign[sign == 0] = 1
    return mu, basis * sign, var


def metric_gain(basis: np.ndarray, metric: np.ndarray, H: int, D: int) -> np.ndarray:
    """Gain of each component under a per-head distortion metric, normalised to mean 1.

    basis [C, C] (columns = components, C = H * D); metric [H, D, D] symmetric PSD (the
    error e of head h's features costs e^T metric[h] e). Returns float64 [C]:
    m_i = sum_h u_ih^T metric[h] u_ih / (trace(metric) / C), so isotropic (white) error
    has the same cost as without a metric. With independent zero-mean quantization errors
    per component, E[e^T M e] = sum_i E[e_i^2] m_i exactly (the cross terms vanish)."""
    C = H * D
    u = basis.reshape(H, D, C)
    m = np.einsum("hdc,hde,hec->c", u, metric, u)
    tr = float(np.trace(metric, axis1=1, axis2=2).sum()) / C
    return np.maximum(m / max(tr, 1e-30), 0.0)


def metric_sqrt(metric: np.ndarray, power: float, H: int, D: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(S, S^-1), float64 [C, C] block-diagonal: S_h = (M_h / mean diag M)^(power / 2)
    (symmetric; eigenvalues floored at 1e-3 of the mean so S^-1 stays bounded).
    metric [H, D, D] symmetric PSD."""
    m = np.asarray(metric, np.float64)
    scale = max(float(np.trace(m, axis1=1, axis2=2).sum()) / (H * D), 1e-30)
    C = H * D
    s, si = np.zeros((C, C)), np.zeros((C, C))
    for h in range(H):
        lam, q = np.linalg.eigh(0.5 * (m[h] + m[h].T) / scale)
        lam = np.maximum(lam, 1e-3) ** (power / 2)
        b = slice(h * D, (h + 1) * D)
        s[b, b] = (q * lam) @ q.T
        si[b, b] = (q / lam) @ q.T
    return s, si
