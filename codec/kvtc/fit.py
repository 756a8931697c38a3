"""Fitting a KVTC calibration (pure: numpy/torch in, ``KvtcCalibration`` out, no I/O):
PCA per (K/V, layer) or per layer group, optional metric whitening, reverse
water-filling (Cover & Thomas thm 10.3.3) and the per-level rate solve on the
calibration tokens. Entry point: ``fit_calibration`` (k, v samples [L, N, H, D]); the
transforms are codec/kvtc/pca.py's, the rate solve codec/kvtc/rate.py's, the grouped fit
(``group_layers`` > 0: one PCA per group of layers over the whitened K and V features
side by side, one water level for all components) is ``_fit_grouped`` here.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from .rope import undo_rope
from .calibration import (DEFAULT_LEVEL, DEFAULT_LEVEL_TARGETS, DEFAULT_RECENT_TOKENS,
                          DEFAULT_SINK_TOKENS, KvtcCalibration, MAX_Q, check_calibration)
from .pca import metric_gain, metric_sqrt, pca_basis
from .rate import RATE_SAMPLE_TOKENS, centroid_shrink, solve_levels


def fit_calibration(k_samples: torch.Tensor, v_samples: torch.Tensor, *,
                    positions: Optional[torch.Tensor] = None,
                    rope_theta: Optional[float] = None, per_head: bool = False,
                    level_targets: Optional[dict] = None, default_level: int = DEFAULT_LEVEL,
                    weighting: str = "relative", sink_tokens: int = DEFAULT_SINK_TOKENS,
                    recent_tokens: int = DEFAULT_RECENT_TOKENS, meta: Optional[dict] = None,
                    centroid: bool = False, rounding: float = 0.5,
                    metric: Optional[tuple] = None, metric_power: float = 1.0,
                    whiten: bool = False, key_water: Optional[dict] = None,
                    group_layers: int = 0, progress=None) -> KvtcCalibration:
    """Fit a KVTC calibration on sample KV (pure function: no model, no I/O).

    Args:
      k_samples, v_samples: [L, N, H, D] float tensors (N calibration tokens, e.g. several
        prefills concatenated along tokens), keys as the model caches them (after RoPE).
        Attention-sink tokens should be left out (they are stored exactly).
      positions: int64 [N], each sample token's position in its context; needed with
        ``rope_theta``.
      rope_theta: if given (> 0), keys are decorrelated before RoPE (undone here with the
        rotate-half convention at ``positions``; the codec redoes it at decode).
      per_head: block-diagonal bases (one D x D PCA per KV head) instead of one
        (H*D) x (H*D) basis per layer.
      level_targets: level -> target bits per element (default ``DEFAULT_LEVEL_TARGETS``).
      weighting: how the water level is shared across (K/V, layer): "relative" (theta
        proportional to the mean component variance of that (K/V, layer): same relative
        distortion everywhere), "absolute" (one theta for all: least total MSE), or a
        positive float array [2, L] of per-(K/V, layer) water-level weights (e.g. the
        inverse of a measured sensitivity).
      sink_tokens, recent_tokens: tokens kept exact (first / last of a context).
      meta: provenance (JSON-able dict) recorded in the artifact.
      centroid: store centroid reconstruction offsets (``KvtcCalibration.shrink``) so a
        non-zero coefficient decodes at its bin's conditional mean on the calibration data
        instead of the bin middle (False, the default: bin middles, no ``shrink``
        tensor; the centroid lowers the MSE but raised the KL, docs/codec.md 8.3).
      rounding: the encoder's quantizer offset in (0, 0.5]: q = sign(u) floor(|u| +
        rounding); below 0.5 widens the zero bin (a dead zone), the level's rate target is
        met with a finer step.
      metric: optional (metric_k, metric_v), each float [L, H, D, D] symmetric PSD: how
        much an error of each head's K (in the decorrelated key space) or V features
        costs the model, e^T M e (e.g. keys: the query energy per channel, values: the
        output projection's Gram matrix W_o^T W_o over the head's query group; computed
        by ``kv_extraction_hf.calibrate``). Each component's water level is divided by
        its gain u^T M u (normalised to mean 1 per (K/V, layer), ``metric_gain``), i.e.
        reverse water-filling of the weighted distortion sum_i m_i D_i (Cover & Thomas
        thm 10.3.3 with weighted components). None = plain MSE per (K/V, layer).
      metric_power: the gain is raised to this power (1 = the weighted distortion
        exactly; 0 = no metric).
      whiten: with ``metric``, decorrelate in the metric's space instead: PCA of x S
        with S = blockdiag_h (M_h / mean diag M)^(p/2) (p = ``metric_power``), so the
        quantization MSE there is the weighted distortion e^T M^p e; the stored ``basis``
        is then the synthesis matrix S^-1 U (not orthonormal) and ``analysis`` = S U the
        encoder's (basis^T analysis = I).
      key_water: optional level -> factor (> 0) on the keys' water levels at that level
        (2 = keys coarser, values finer at the same rate; levels not named: 1). The values
        carry ~3/4 of the KL the model sees (docs/codec.md 8.6); recorded in ``meta``.
      group_layers: G > 0 = one joint basis for the K and V of G consecutive layers
        (kvtc format 4, docs/codec.md 8.8): each (K/V, layer) block is whitened by its
        metric (identity without one) and scaled by 1 / sqrt(its water-level weight), the
        blocks of a group are concatenated and one PCA + one water level serve all groups
        (reverse water-filling of the same weighted distortion, but the components may mix
        K and V and neighbouring layers, which share the residual stream). Not with
        ``per_head``, ``centroid``, ``key_water`` or a ``metric`` without ``whiten``.
      progress: optional callable(str) for progress lines.
    Returns: KvtcCalibration (hash set). Source: PCA + reverse water-filling (module doc).
    Raises: ValueError on bad shapes, too few samples or bad options.
    """
    say = progress or (lambda s: None)
    targets, kwater = _check_options(k_samples, v_samples, weighting, rounding, metric,
                                     metric_power, level_targets, key_water, default_level,
                                     group_layers, per_head, centroid, whiten)
    L, N, H, D = k_samples.shape
    k, v, key_space, theta_rope = _keys_space(k_samples, v_samples, positions, rope_theta)
    meta = dict(meta or {}, calibration_tokens=N,
                weighting=weighting if isinstance(weighting, str)
                else [[float(x) for x in r] for r in weighting])
    if group_layers:
        return _fit_grouped(
            k, v, group_layers, targets, default_level, weighting, metric, metric_power,
            rounding, key_space, theta_rope, int(sink_tokens), int(recent_tokens), meta, say)
    # statistics and bases: one PCA per (K/V, layer)
    st = _layer_bases(k, v, per_head, metric if whiten else None, metric_power, say)
    # bit allocation: water-level weights (and the metric's component order), then the
    # per-level rate solve on the sampled coefficients
    w = _water_weights(st, weighting, None if whiten else metric, metric_power, H, D)
    levels = sorted(targets)
    n_elem = 2 * L * st["coefs"].shape[2] * H * D
    steps = solve_levels(w, st["var"], st["cap"], st["coefs"], n_elem, targets, kwater,
                         rounding, say)
    shrink = None
    if centroid:
        shrink = np.zeros((len(levels), 2, L, H * D), np.float64)
        for i in range(len(levels)):
            shrink[i] = centroid_shrink(st["coefs"], steps[i], rounding)
    # tables: the artifact
    if kwater:
        meta["key_water"] = {str(k): float(f) for k, f in sorted(kwater.items())}
    analysis = st["analysis"]
    return _finish(KvtcCalibration(
        L, H, D, st["mean"].astype(np.float32), st["basis"].astype(np.float32),
        st["var"].astype(np.float32), steps.astype(np.float32), tuple(levels),
        tuple(float(targets[x]) for x in levels), int(default_level), key_space, theta_rope,
        bool(per_head), int(sink_tokens), int(recent_tokens), meta,
        shrink=None if shrink is None else shrink.astype(np.float32),
        rounding=float(rounding),
        analysis=None if analysis is None else analysis.astype(np.float32)))


def _finish(cal: KvtcCalibration) -> KvtcCalibration:
    """``cal`` checked (``check_calibration``; its hash is set at construction)."""
    check_calibration(cal, "fit_calibration")
    return cal


def _check_options(k_samples, v_samples, weighting, rounding, metric, metric_power,
                   level_targets, key_water, default_level, group_layers, per_head,
                   centroid, whiten) -> tuple[dict, dict]:
    """(level targets, key water factors) of ``fit_calibration``'s arguments, checked.
    Raises ValueError naming the bad argument."""
    for name, t in (("k_samples", k_samples), ("v_samples", v_samples)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a tensor [L, N, H, D]")
    if k_samples.shape != v_samples.shape:
        raise ValueError(f"k/v sample shapes differ: {tuple(k_samples.shape)} vs "
                         f"{tuple(v_samples.shape)}")
    L, N, H, D = k_samples.shape
    if N < 2:
        raise ValueError(f"need at least 2 calibration tokens, got {N}")
    if not (isinstance(weighting, str) and weighting in ("relative", "absolute")) and \
            not (isinstance(weighting, np.ndarray) and weighting.shape == (2, L)
                 and (weighting > 0).all()):
        raise ValueError(f"weighting must be 'relative', 'absolute' or a positive array "
                         f"[2, L], got {weighting!r}")
    if not (isinstance(rounding, (int, float)) and 0.0 < rounding <= 0.5):
        raise ValueError(f"rounding must be in (0, 0.5], got {rounding!r}")
    if metric is not None:
        if not (isinstance(metric, (tuple, list)) and len(metric) == 2 and all(
                isinstance(m, np.ndarray) and m.shape == (L, H, D, D) and
                np.isfinite(m).all() for m in metric)):
            raise ValueError(f"metric must be a pair of finite arrays [L, H, D, D] = "
                             f"{(L, H, D, D)}")
        if not (isinstance(metric_power, (int, float)) and 0.0 <= metric_power <= 2.0):
            raise ValueError(f"metric_power must be in [0, 2], got {metric_power!r}")
    targets = dict(DEFAULT_LEVEL_TARGETS if level_targets is None else level_targets)
    kwater = dict(key_water or {})
    if any(isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f < 1e6
           or lv not in targets for lv, f in kwater.items()):
        raise ValueError(f"key_water must map levels of the targets to factors > 0, got "
                         f"{key_water!r}")
    if len(targets) < 1 or default_level not in targets or \
            any(not (isinstance(t, (int, float)) and t > 0) for t in targets.values()):
        raise ValueError(f"bad level_targets {targets!r} / default_level {default_level}")
    if isinstance(group_layers, bool) or not isinstance(group_layers, int) or \
            not 0 <= group_layers <= L:
        raise ValueError(f"group_layers must be an int in [0, {L}], got {group_layers!r}")
    if group_layers and (per_head or centroid or kwater or
                         (metric is not None and not whiten)):
        raise ValueError("group_layers does not combine with per_head, centroid, "
                         "key_water or a metric without whiten")
    return targets, kwater


def _keys_space(k_samples, v_samples, positions, rope_theta) -> tuple:
    """(k, v float32 CPU [L, N, H, D], key_space, rope_theta): keys with RoPE undone at
    ``positions`` when ``rope_theta`` is given ("pre_rope"), else as cached. Raises
    ValueError without positions [N] or with an odd head_dim."""
    L, N, H, D = k_samples.shape
    k = k_samples.detach().to("cpu", torch.float32)
    v = v_samples.detach().to("cpu", torch.float32)
    if not rope_theta:
        return k, v, "post_rope", 0.0
    if positions is None or tuple(positions.shape) != (N,):
        raise ValueError("rope_theta needs positions, an int tensor [N]")
    if D % 2:
        raise ValueError("pre-RoPE decorrelation needs an even head_dim")
    k = undo_rope(k, positions.to(torch.int64), float(rope_theta))
    return k, v, "pre_rope", float(rope_theta)


def _layer_bases(k: torch.Tensor, v: torch.Tensor, per_head: bool,
                 metric: Optional[tuple], metric_power: float, say) -> dict:
    """The per-(K/V, layer) statistics and bases (C = H * D): mean [2, L, C], basis [2, L,
    C, C], var [2, L, C] (float64), analysis [2, L, C, C] (with a whitening ``metric``:
    PCA of x S, basis = S^-1 U, analysis = S U) or None, cap [2, L, C] (the finest step
    at which no calibration coefficient clips at |q| = MAX_Q) and coefs float32 [2, L,
    n, C] (the coefficients of ``RATE_SAMPLE_TOKENS`` sampled tokens, for the rate
    solve)."""
    L, N, H, D = k.shape
    C = H * D
    mean = np.zeros((2, L, C), np.float64)
    basis = np.zeros((2, L, C, C), np.float64)
    var = np.zeros((2, L, C), np.float64)
    rng = np.random.default_rng(0)
    sub = np.sort(rng.choice(N, size=min(N, RATE_SAMPLE_TOKENS), replace=False))
    coefs = np.zeros((2, L, len(sub), C), np.float32)
    cap = np.zeros((2, L, C), np.float64)
    analysis = np.zeros((2, L, C, C), np.float64) if metric is not None else None
    for kv, x in enumerate((k, v)):
        for layer in range(L):
            xl = x[layer].reshape(N, C).numpy()
            if analysis is not None:
                sq, isq = metric_sqrt(metric[kv][layer], float(metric_power), H, D)
                mean[kv, layer] = xl.astype(np.float64).mean(0)
                _, u, var[kv, layer] = pca_basis(xl.astype(np.float64) @ sq, False, H, D)
                analysis[kv, layer] = sq @ u
                basis[kv, layer] = isq @ u
                cl = (xl.astype(np.float64) - mean[kv, layer]) @ analysis[kv, layer]
            else:
                mean[kv, layer], basis[kv, layer], var[kv, layer] = pca_basis(xl, per_head,
                                                                              H, D)
                cl = (xl.astype(np.float64) - mean[kv, layer]) @ basis[kv, layer]
            # steps never so fine that calibration coefficients clip at |q| = MAX_Q
            cap[kv, layer] = np.abs(cl).max(0) * 1.05 / MAX_Q
            coefs[kv, layer] = cl[sub]
        say(f"PCA {'KV'[kv]}: {L} layers done")
    return {"mean": mean, "basis": basis, "var": var, "analysis": analysis, "cap": cap,
            "coefs": coefs}


def _water_weights(st: dict, weighting, metric: Optional[tuple], metric_power: float,
                   H: int, D: int) -> np.ndarray:
    """The water-level weights w ([2, L], or [2, L, C] with a non-whitening ``metric``)
    of the reverse water-filling: ``weighting``'s, each component's divided by its metric
    gain u^T M u ^ ``metric_power``. With such a metric the components of ``st`` (basis,
    var, cap, coefs; reordered in place) are sorted by var / w, descending, so the kept
    ones are a prefix at every level (the codec codes the first n columns)."""
    var = st["var"]
    L = var.shape[1]
    if isinstance(weighting, np.ndarray):
        w = weighting.astype(np.float64)
    else:
        w = var.mean(-1) if weighting == "relative" else np.ones((2, L))
    w = np.maximum(w, 1e-30)
    if metric is None or not metric_power:
        return w
    gain = np.stack([np.stack([metric_gain(st["basis"][kv, layer], metric[kv][layer]
                                           .astype(np.float64), H, D)
                               for layer in range(L)]) for kv in range(2)])
    # a component the metric ignores gets a water level 1e6 x the layer's: dropped
    w = w[..., None] / np.maximum(gain, 1e-6) ** float(metric_power)     # [2, L, C]
    order = np.argsort(-(var / w), axis=-1, kind="stable")               # [2, L, C]
    st["basis"] = np.take_along_axis(st["basis"], order[:, :, None, :], axis=-1)
    st["var"] = np.take_along_axis(var, order, axis=-1)
    st["cap"] = np.take_along_axis(st["cap"], order, axis=-1)
    st["coefs"] = np.take_along_axis(st["coefs"], order[:, :, None, :], axis=-1)
    return np.take_along_axis(w, order, axis=-1)


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
    sub = np.sort(rng.choice(N, size=min(N, RATE_SAMPLE_TOKENS), replace=False))
    coefs = np.zeros((NG, len(sub), Cg), np.float32)
    # per-block whitening matrices and centred, whitened features
    sq = np.zeros((2, L, C, C))
    isq = np.zeros((2, L, C, C))
    blk_mean = np.zeros((2, L, C))
    zvar = np.zeros((2, L))
    for kv, x in enumerate((k, v)):
        for layer in range(L):
            if metric is not None:
                sq[kv, layer], isq[kv, layer] = metric_sqrt(metric[kv][layer],
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
    steps = solve_levels(np.ones(NG), var, cap, coefs, 2 * L * len(sub) * C, targets, {},
                          rounding, say)
    levels = sorted(targets)
    cal = KvtcCalibration(
        L, H, D, mean.astype(np.float32), basis.astype(np.float32), var.astype(np.float32),
        steps.astype(np.float32), tuple(levels), tuple(float(targets[x]) for x in levels),
        int(default_level), key_space, theta_rope, False, sink_tokens, recent_tokens,
        dict(meta, group_layers=G), shrink=None, rounding=float(rounding),
        analysis=analysis.astype(np.float32), group_layers=G)
    return _finish(cal)
