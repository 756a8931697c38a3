"""Fitting a KVTC calibration (pure: numpy/torch in, ``KvtcCalibration`` out, no I/O):
PCA per (K/V, layer) or per layer group, optional metric whitening, reverse
water-filling (Cover & Thomas thm 10.3.3) and the per-level rate solve on the
calibration tokens. Entry point: ``fit_calibration`` (k, v samples [L, N, H, D]); the
transforms are codec/kvtc/pca.py's, the rate solve codec/kvtc/rate.py's, the grouped fit
codec/kvtc/fit_grouped.py's.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from .rope import undo_rope
from .calibration import (DEFAULT_LEVEL, DEFAULT_LEVEL_TARGETS, DEFAULT_RECENT_TOKENS,
                          DEFAULT_SINK_TOKENS, KvtcCalibration, MAX_Q, _check_calibration)
from .fit_grouped import _fit_grouped
from .pca import _metric_gain, _metric_sqrt, _pca
from .rate import _RATE_SAMPLE_TOKENS, _shrink, _solve_levels


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
        its gain u^T M u (normalised to mean 1 per (K/V, layer), ``_metric_gain``), i.e.
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
    C = H * D
    k = k_samples.detach().to("cpu", torch.float32)
    v = v_samples.detach().to("cpu", torch.float32)
    key_space = "post_rope"
    theta_rope = 0.0
    if rope_theta:
        if positions is None or tuple(positions.shape) != (N,):
            raise ValueError("rope_theta needs positions, an int tensor [N]")
        if D % 2:
            raise ValueError("pre-RoPE decorrelation needs an even head_dim")
        k = undo_rope(k, positions.to(torch.int64), float(rope_theta))
        key_space, theta_rope = "pre_rope", float(rope_theta)
    if group_layers:
        return _fit_grouped(
            k, v, group_layers, targets, default_level, weighting, metric, metric_power,
            rounding, key_space, theta_rope, int(sink_tokens), int(recent_tokens),
            dict(meta or {}, calibration_tokens=N,
                 weighting=weighting if isinstance(weighting, str)
                 else [[float(x) for x in r] for r in weighting]), say)
    mean = np.zeros((2, L, C), np.float64)
    basis = np.zeros((2, L, C, C), np.float64)
    var = np.zeros((2, L, C), np.float64)
    rng = np.random.default_rng(0)
    sub = np.sort(rng.choice(N, size=min(N, _RATE_SAMPLE_TOKENS), replace=False))
    coefs = np.zeros((2, L, len(sub), C), np.float32)
    cap = np.zeros((2, L, C), np.float64)
    analysis = np.zeros((2, L, C, C), np.float64) if (whiten and metric is not None) else None
    for kv, x in enumerate((k, v)):
        for layer in range(L):
            xl = x[layer].reshape(N, C).numpy()
            if analysis is not None:
                sq, isq = _metric_sqrt(metric[kv][layer], float(metric_power), H, D)
                mean[kv, layer] = xl.astype(np.float64).mean(0)
                _, u, var[kv, layer] = _pca(xl.astype(np.float64) @ sq, False, H, D)
                analysis[kv, layer] = sq @ u
                basis[kv, layer] = isq @ u
                cl = (xl.astype(np.float64) - mean[kv, layer]) @ analysis[kv, layer]
            else:
                mean[kv, layer], basis[kv, layer], var[kv, layer] = _pca(xl, per_head, H, D)
                cl = (xl.astype(np.float64) - mean[kv, layer]) @ basis[kv, layer]
            # steps never so fine that calibration coefficients clip at |q| = MAX_Q
            cap[kv, layer] = np.abs(cl).max(0) * 1.05 / MAX_Q
            coefs[kv, layer] = cl[sub]
        say(f"PCA {'KV'[kv]}: {L} layers done")
    if isinstance(weighting, np.ndarray):
        w = weighting.astype(np.float64)
    else:
        w = var.mean(-1) if weighting == "relative" else np.ones((2, L))
    w = np.maximum(w, 1e-30)
    if metric is not None and metric_power and analysis is None:
        gain = np.stack([np.stack([_metric_gain(basis[kv, layer], metric[kv][layer]
                                                .astype(np.float64), H, D)
                                   for layer in range(L)]) for kv in range(2)])
        # a component the metric ignores gets a water level 1e6 x the layer's: dropped
        w = w[..., None] / np.maximum(gain, 1e-6) ** float(metric_power)     # [2, L, C]
        # a component is kept while the water level is below var / w: order the
        # components by var / w, descending, so that the kept ones are a prefix at every
        # level (the codec codes the first n columns)
        order = np.argsort(-(var / w), axis=-1, kind="stable")               # [2, L, C]
        basis = np.take_along_axis(basis, order[:, :, None, :], axis=-1)
        var = np.take_along_axis(var, order, axis=-1)
        w = np.take_along_axis(w, order, axis=-1)
        cap = np.take_along_axis(cap, order, axis=-1)
        coefs = np.take_along_axis(coefs, order[:, :, None, :], axis=-1)
    n_elem = 2 * L * len(sub) * C
    levels = sorted(targets)
    steps = _solve_levels(w, var, cap, coefs, n_elem, targets, kwater, rounding, say)
    shrink = np.zeros((len(levels), 2, L, C), np.float64)
    if centroid:
        for i in range(len(levels)):
            shrink[i] = _shrink(coefs, steps[i], rounding)
    cal = KvtcCalibration(
        L, H, D, mean.astype(np.float32), basis.astype(np.float32), var.astype(np.float32),
        steps.astype(np.float32), tuple(levels), tuple(float(targets[x]) for x in levels),
        int(default_level), key_space, theta_rope, bool(per_head), int(sink_tokens),
        int(recent_tokens), dict(meta or {}, calibration_tokens=N,
                                 weighting=weighting if isinstance(weighting, str)
                                 else [[float(x) for x in r] for r in weighting],
                                 **({"key_water": {str(k): float(f) for k, f in
                                                   sorted(kwater.items())}}
                                    if kwater else {})),
        shrink=shrink.astype(np.float32) if centroid else None, rounding=float(rounding),
        analysis=None if analysis is None else analysis.astype(np.float32))
    _check_calibration(cal, "fit_calibration")
    cal.hash = cal.content_hash()
    return cal
