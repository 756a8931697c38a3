"""KVTC's distortion metric: per-component water levels from the model's use of
K and V, and the metric-whitened basis (codec/kvtc/ ``fit_calibration(metric=,
whiten=)``, kv_extraction_hf/calibrate/__init__.py ``metric_from_stats``).
Run: .venv/bin/python -m pytest tests/codec/test_kvtc_metric.py -q
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import codec
from codec import kvtc
from tests.helpers.kv import mixed_kv

L, N, H, D = 2, 600, 2, 8
C = H * D


def _data(seed=0):
    k, v, mix = mixed_kv(L, N, H, D, seed=seed, return_mix=True)
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((2, L, H, D, D))
    met = a @ np.swapaxes(a, -1, -2)
    return k, v, (met[0], met[1]), mix


def _weighted(e: np.ndarray, m: np.ndarray) -> float:
    """mean over tokens of e^T M e, e [L, T, H, D], m [L, H, D, D]."""
    return float(np.einsum("ltha,lhab,lthb->", e, m, e) / e.shape[1])


def test_whitened_basis_inverts_and_lowers_the_weighted_distortion():
    k, v, met, mix = _data()
    targets = {0: 1.0, 1: 3.0}
    plain = kvtc.fit_calibration(k, v, level_targets=targets, default_level=1, sink_tokens=0)
    white = kvtc.fit_calibration(k, v, metric=met, whiten=True, level_targets=targets,
                                 default_level=1, sink_tokens=0)
    assert plain.analysis is None and white.analysis is not None
    # analysis^T synthesis = I per (K/V, layer): the decoder inverts the encoder
    eye = np.einsum("klci,klcj->klij", white.basis.astype(np.float64),
                    white.analysis.astype(np.float64))
    np.testing.assert_allclose(eye, np.broadcast_to(np.eye(C), eye.shape), atol=1e-4)
    x = mixed_kv(L, 200, H, D, seed=5, mix=mix)[0].to(torch.bfloat16)
    out = {}
    for name, cal in (("plain", plain), ("white", white)):
        data = codec.encode_kv(x, x, codec="kvtc", level=1,
                               config=kvtc.KvtcConfig(calibration=cal))
        k2, v2 = codec.decode_kv(data)
        ek = (k2.float() - x.float()).numpy()
        ev = (v2.float() - x.float()).numpy()
        out[name] = (len(data), _weighted(ek, met[0]) + _weighted(ev, met[1]))
    # about the same size, clearly less distortion in the metric it was fitted for
    assert out["white"][0] < 1.15 * out["plain"][0]
    assert out["white"][1] < 0.7 * out["plain"][1]


def test_metric_weights_keep_a_prefix_and_artifact_round_trips(tmp_path):
    k, v, met, _ = _data(1)
    for whiten in (False, True):
        cal = kvtc.fit_calibration(k, v, metric=met, whiten=whiten,
                                   level_targets={0: 0.7, 1: 2.0}, default_level=1,
                                   sink_tokens=0)
        for i in range(len(cal.levels)):
            kept = cal.step[i] > 0                                     # [2, L, C]
            n = kept.sum(-1, keepdims=True)
            assert (kept == (np.arange(C) < n)).all()                 # a prefix
        p = cal.save(tmp_path)
        back = kvtc.load_calibration(p)
        assert back.hash == cal.hash
        assert (back.analysis is None) == (not whiten)
        if whiten:
            assert np.array_equal(back.analysis, cal.analysis)
    with pytest.raises(ValueError, match="metric"):
        kvtc.fit_calibration(k, v, metric=(met[0],), sink_tokens=0)
    with pytest.raises(ValueError, match="metric_power"):
        kvtc.fit_calibration(k, v, metric=met, metric_power=-1.0, sink_tokens=0)


def test_metric_from_stats_groups_queries_and_averages_rope_pairs():
    from kv_extraction_hf.calibrate import metric_from_stats

    Hq, Hk, Dh, Lm = 4, 2, 4, 1
    bundle = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(
        num_attention_heads=Hq, num_key_value_heads=Hk)))
    qe = np.arange(Lm * Hq * Dh, dtype=np.float64).reshape(Lm, Hq * Dh) + 1.0
    wo = np.stack([np.eye(Dh) * (g + 1) for g in range(Hq)])[None]     # [1, Hq, D, D]
    mk, mv = metric_from_stats(qe, wo, bundle, pre_rope=True)
    assert mk.shape == mv.shape == (Lm, Hk, Dh, Dh)
    e = qe.reshape(Lm, Hq, Dh)
    # KV head 0 serves query heads 0 and 1 (HF repeat_kv order); pair (0, 2) averaged
    want0 = 0.5 * (e[0, 0, 0] + e[0, 0, 2]) + 0.5 * (e[0, 1, 0] + e[0, 1, 2])
    assert mk[0, 0, 0, 0] == pytest.approx(want0) == mk[0, 0, 2, 2]
    assert mk[0, 0, 0, 1] == 0.0
    np.testing.assert_allclose(mv[0, 1], np.eye(Dh) * (3 + 4))
    mk2, _ = metric_from_stats(qe, wo, bundle, pre_rope=False)
    assert mk2[0, 0, 0, 0] == pytest.approx(e[0, 0, 0] + e[0, 1, 0])


@pytest.mark.slow
def test_calibrate_with_the_whitened_metric(default_bundle, fixtures_dir):
    from kv_extraction_hf.calibrate import calibrate, query_energy

    text = (fixtures_dir / "wikitext2" / "wiki.test.raw").read_text()
    mods = [ly.self_attn.q_proj for ly in default_bundle.model.model.layers]
    with query_energy(default_bundle) as qe:
        default_bundle.model(input_ids=torch.arange(5, 45).reshape(1, -1))
    e = qe.result()
    assert e.shape == (len(mods), mods[0].out_features) and (e > 0).all()
    assert all(not m._forward_hooks for m in mods)                  # hooks removed
    cal = calibrate(default_bundle, text, windows=1, window_tokens=96, weighting="relative",
                    metric="whitened", level_targets={0: 1.0, 1: 2.0}, default_level=1,
                    group_layers=0, log=lambda s: None)
    assert cal.analysis is not None and cal.meta["metric"] == "whitened"
    eye = np.einsum("klci,klcj->klij", cal.basis.astype(np.float64),
                    cal.analysis.astype(np.float64))
    np.testing.assert_allclose(eye, np.broadcast_to(np.eye(cal.C), eye.shape), atol=1e-3)
    plain = calibrate(default_bundle, text, windows=1, window_tokens=96, weighting="relative",
                      metric="none", level_targets={0: 1.0, 1: 2.0}, default_level=1,
                      group_layers=0, log=lambda s: None)
    assert plain.analysis is None and "metric" not in plain.meta
