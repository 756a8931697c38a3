"""Tests of KVTC's centroid reconstruction, dead-zone quantizer and vectorised rate
(codec/kvtc/). Small random calibrations made here (fast).
Run: .venv/bin/python -m pytest tests/codec/test_kvtc_centroid.py -q
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import codec
from codec import kvtc
from codec.errors import CodecError
from tests.helpers.kv import correlated_kv


def _correlated(L, T, H, D, seed, decay=-2.0):
    # heavy tails, as KV coefficients have (the centroid of a bin lies below its middle)
    return correlated_kv(L, T, H, D, seed, decay, tail_power=3)


def _fit(**kw):
    L, H, D, N = 2, 2, 8, 512
    k, v = _correlated(L, N, H, D, 1), _correlated(L, N, H, D, 2)
    return kvtc.fit_calibration(k, v, level_targets={0: 0.6, 1: 1.2, 2: 2.0},
                                default_level=1, **kw)


@pytest.fixture(scope="module")
def cals():
    return _fit(centroid=True), _fit(centroid=False), _fit(centroid=True, rounding=0.3)


def test_shrink_shape_range_and_same_steps(cals):
    c, n, _ = cals
    assert n.shrink is None and c.shrink.shape == c.step.shape
    assert (c.shrink >= 0).all() and (c.shrink <= 0.5).all()
    assert (c.shrink[c.step == 0] == 0).all()
    assert (c.shrink[c.step > 0] > 0.01).mean() > 0.5      # heavy tails: below the middle
    np.testing.assert_array_equal(c.step, n.step)         # same quantizer, same allocation
    assert c.hash != n.hash


def test_centroid_lowers_reconstruction_error(cals):
    c, n, _ = cals
    k, v = _correlated(2, 300, 2, 8, 7), _correlated(2, 300, 2, 8, 8)   # held-out tokens
    for lv in c.levels:
        errs = []
        for cal in (c, n):
            k2, v2 = codec.decode_kv(codec.encode_kv(
                k, v, codec="kvtc", level=lv, config=kvtc.KvtcConfig(calibration=cal)))
            errs.append(float(((k2 - k) ** 2).mean() + ((v2 - v) ** 2).mean()))
        assert errs[0] < errs[1], (lv, errs)


def test_dead_zone_meets_rate_with_finer_steps(cals):
    c, _, d = cals
    assert d.rounding == 0.3 and "rounding" in d._header_meta()
    assert "rounding" not in c._header_meta()
    kept = (c.step > 0) & (d.step > 0)
    assert (d.step[kept] <= c.step[kept] + 1e-9).all() and (d.step[kept] < c.step[kept]).any()
    k, v = _correlated(2, 64, 2, 8, 9), _correlated(2, 64, 2, 8, 10)
    k2, v2 = codec.decode_kv(codec.encode_kv(k, v, codec="kvtc", level=1,
                                             config=kvtc.KvtcConfig(calibration=d)))
    assert k2.shape == k.shape and torch.isfinite(k2).all() and torch.isfinite(v2).all()


def test_save_load_keeps_shrink_rounding_and_hash(cals, tmp_path):
    for cal in cals:
        got = kvtc.load_calibration(cal.save(tmp_path / f"{cal.hash}.safetensors"))
        assert got.hash == cal.hash and got.rounding == cal.rounding
        if cal.shrink is None:
            assert got.shrink is None and "shrink" not in got.tensors()
        else:
            np.testing.assert_array_equal(got.shrink, cal.shrink)


def test_bad_shrink_or_rounding_rejected(cals, tmp_path):
    c = cals[0]
    with pytest.raises(ValueError, match="rounding"):
        _fit(rounding=0.7)
    bad = kvtc.KvtcCalibration(c.num_layers, c.num_heads, c.head_dim, c.mean, c.basis,
                               c.var, c.step, c.levels, c.targets, c.default_level,
                               c.key_space, c.rope_theta, c.per_head, c.sink_tokens,
                               c.recent_tokens, dict(c.meta), shrink=c.shrink + 0.6)
    bad.hash = bad.content_hash()
    with pytest.raises(CodecError, match="centroid"):
        kvtc.load_calibration(bad.save(tmp_path / "bad.safetensors"))


def test_vectorised_rate_equals_per_layer_sum():
    rng = np.random.default_rng(0)
    coefs = rng.laplace(size=(2, 3, 200, 6)).astype(np.float32)
    step = rng.uniform(0.2, 1.5, size=(2, 3, 6))
    step[..., 4:] = 0.0
    for rounding in (0.5, 0.3):
        total = kvtc.rate._rate_bits(coefs, step, rounding)
        parts = sum(kvtc.rate._rate_bits(coefs[a, b], step[a, b], rounding)
                    for a in range(2) for b in range(3))
        assert total == pytest.approx(parts, rel=1e-12)
        # direct definition on one component
        q = kvtc.rate._quantize(coefs[0, 0, :, 0] / step[0, 0, 0], rounding)
        _, cnt = np.unique(q, return_counts=True)
        p = cnt / cnt.sum()
        one = kvtc.rate._rate_bits(coefs[0, 0, :, :1], step[0, 0, :1], rounding)
        assert one == pytest.approx(-(cnt * np.log2(p)).sum())


@pytest.mark.parametrize("threads", [1, 2])
def test_inverse_with_centroid_matches_float64_reference(cals, threads, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    cal = cals[0]
    lv = cal.levels[-1]
    P = cal.torch_params(lv)
    L, H, D, n, T = cal.num_layers, cal.num_heads, cal.head_dim, P["n"], 6
    assert P["shrink"] is not None and (P["shrink"] > 0).any()
    sym = np.random.default_rng(1).integers(0, 9, size=(L, T, n)).astype(np.uint8)
    offs = [4] * (L - 1) + [3]
    for kv in (0, 1):
        qc = torch.from_numpy(sym).double() - torch.tensor(offs).double()[:, None, None]
        r = qc - torch.sign(qc) * P["shrink"][kv].double()
        ref = (r * P["step"][kv].double()) @ P["basis_t"][kv].double() + P["mean"][kv].double()
        got = kvtc.inverse.inverse_layers(sym, offs, P, kv, (L, T, H, D), None, 0.0)
        assert torch.allclose(got.double(), ref.reshape(L, T, H, D), atol=1e-4, rtol=1e-5)
