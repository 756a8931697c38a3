"""Config presets and reference quantizers (codec/config.py, codec/quant/reference.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from codec.quant import lowbit
from codec.quant import reference as Q
from codec.config import CodecConfig, QuantizationSpec, reference_schedule
from tests.helpers.kv import make_kv


# ------------------------------------------------------------------------------ config
def test_spec_validation():
    assert QuantizationSpec(0, 10, 32).max_level == 15
    for bad in [(0, 0, 32), (5, 3, 32), (-1, 3, 32), (0, 3, 7), (0, 3, 2), (0, 3, 258),
                (0, 3.0, 32), (0, True, 32)]:
        with pytest.raises(ValueError):
            QuantizationSpec(*bad)


def test_lmcache_default_schedule_30_layers():
    c = CodecConfig.lmcache(30)
    assert c.key_bins == [32] * 10 + [16] * 20
    assert c.value_bins == [32] * 2 + [16] * 28
    assert c.level == 0 and c.scale_group == "token" and c.scale_format == "dtype"


@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_lmcache_small_models_32_everywhere(n):
    c = CodecConfig.lmcache(n)
    assert c.key_bins == [32] * n and c.value_bins == [32] * n


def test_artifact_levels_7b_exact():
    """For the 32-layer 7B models the scaled boundaries are the artifact's own."""
    k1, v1 = reference_schedule(32, 1)
    assert [(s.start_layer, s.end_layer, s.bins) for s in k1] == [(0, 20, 16), (20, 32, 12)]
    assert [(s.start_layer, s.end_layer, s.bins) for s in v1] == [(0, 2, 16), (2, 32, 12)]
    k2, v2 = reference_schedule(32, 2)
    assert [(s.start_layer, s.end_layer, s.bins) for s in k2] == [(0, 10, 32), (10, 32, 16)]
    assert [(s.start_layer, s.end_layer, s.bins) for s in v2] == [(0, 2, 32), (2, 32, 16)]
    k3, v3 = reference_schedule(32, 3)
    assert k3 == v3 == (QuantizationSpec(0, 32, 32),)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 12, 28, 30, 32, 40, 80, 126])
@pytest.mark.parametrize("variant", ["reference", "harness"])
@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_presets_for_any_depth(n, variant, level):
    c = CodecConfig.for_model(n, level, variant=variant)
    assert len(c.key_bins) == n and len(c.value_bins) == n
    assert all(4 <= b <= 256 for b in c.key_bins + c.value_bins)
    # shallow layers never get fewer bins than deep ones (CacheGen's layer-wise rule)
    assert c.key_bins == sorted(c.key_bins, reverse=True)
    assert c.value_bins == sorted(c.value_bins, reverse=True)
    assert CodecConfig.from_dict(c.to_dict()) == c


def test_config_validation_messages():
    with pytest.raises(ValueError, match="cover layers"):
        CodecConfig(num_layers=4, key_specs=(QuantizationSpec(0, 3, 32),),
                    value_specs=(QuantizationSpec(0, 4, 32),))
    with pytest.raises(ValueError, match="contiguous"):
        CodecConfig(num_layers=4, key_specs=((0, 2, 32), (3, 4, 16)),
                    value_specs=((0, 4, 32),))
    with pytest.raises(ValueError, match="chunk_tokens"):
        CodecConfig.for_model(4, chunk_tokens=100)
    with pytest.raises(ValueError, match="scale_group"):
        CodecConfig.for_model(4, scale_group="layer")
    with pytest.raises(ValueError, match="unknown level"):
        CodecConfig.for_model(4, 9)
    with pytest.raises(ValueError, match="unknown codec config keys"):
        CodecConfig.from_dict({"num_layers": 2, "bogus": 1})
    # lists from YAML/JSON are accepted
    c = CodecConfig(num_layers=4, key_specs=[[0, 4, 16]], value_specs=[{"start_layer": 0,
                                                                        "end_layer": 4,
                                                                        "bins": 8}])
    assert c.key_bins == [16] * 4 and c.value_bins == [8] * 4


def test_yaml_configs_load(tmp_path):
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "configs"
    files = sorted(root.glob("codec*.yaml"))
    assert files, "configs/codec*.yaml missing"
    for f in files:
        c = CodecConfig.from_yaml(f, num_layers=28)
        assert c.num_layers == 28
    p = tmp_path / "c.yaml"
    p.write_text("key_bins: 16\nvalue_bins: 8\nchunk_tokens: 256\nscale_group: head\n")
    c = CodecConfig.from_yaml(p, num_layers=3)
    assert c.key_bins == [16] * 3 and c.chunk_tokens == 256
    p.write_text("variant: reference\nlevel: 0\n")
    assert CodecConfig.from_yaml(p, num_layers=30) == CodecConfig.lmcache(30)
    p.write_text("nonsense: 1\n")
    with pytest.raises(ValueError):
        CodecConfig.from_yaml(p, num_layers=3)


# -------------------------------------------------------------------------- quantizer
def _bound_check(x, bins, group_dims):
    """Quantize with per-group max scales; check |x - x_hat| <= s/(2M) elementwise."""
    L = x.shape[0]
    m = Q.max_levels(bins)
    s = x.float().abs().amax(dim=group_dims, keepdim=True)
    sym = Q.quantize(x, s, m)
    assert sym.dtype == torch.uint8
    mm = m.reshape((-1,) + (1,) * (x.dim() - 1))
    assert bool((sym.to(torch.float32) <= 2 * mm).all())
    xh = Q.dequantize(sym, s, m)
    assert bool(torch.isfinite(xh).all())
    err = (xh - x.float()).abs()
    tol = s / (2 * mm) * (1 + 1e-6) + 4 * torch.finfo(torch.float32).eps * x.float().abs()
    assert bool((err <= tol).all()), float((err - tol).max())
    return sym, xh


def test_reference_formula_matches_lmcache_definition():
    """symbol = round(x * (M / max)) + M (ties to even, symmetric around 0: LMCache's
    round(x * M / max + M) only differs on exact ties) and dequant (s - M) / M * max."""
    x = torch.tensor([[[-2.0, -1.0, 0.0, 0.5, 1.0, 2.0, 0.26, -0.74]]])  # [1, 1, 8]
    m = Q.max_levels([8])                                                  # M = 3
    s = x.abs().amax(-1, keepdim=True)
    sym = Q.quantize(x, s, m)
    expect = (torch.round(x * (3 / 2.0)) + 3).to(torch.uint8)
    assert torch.equal(sym, expect)
    # -1.5 -> -2 and 1.5 -> 2 (ties to even, symmetric); 0.75 -> 1; 0.39 -> 0
    assert sym.tolist() == [[[0, 1, 3, 4, 5, 6, 3, 2]]]
    assert torch.allclose(Q.dequantize(sym, s, m), (sym.float() - 3) / 3 * 2.0)


def test_all_zero_rows_no_nan():
    x = torch.zeros(2, 5, 3, 8, dtype=torch.bfloat16)
    x[1, 2] = 1.5
    sym, xh = _bound_check(x, [32, 16], (-1,))
    assert bool((xh[0] == 0).all())
    assert bool((sym[0] == 15).all())


@settings(max_examples=40, deadline=None, derandomize=True)
@given(L=st.integers(1, 4), T=st.integers(1, 20), H=st.integers(1, 4), D=st.integers(1, 33),
       bins=st.sampled_from([4, 6, 8, 12, 16, 32, 64, 256]),
       dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
       per_head=st.booleans(), seed=st.integers(0, 2**31 - 1), scale=st.floats(1e-3, 50.0))
def test_quantize_error_bound_property(L, T, H, D, bins, dtype, per_head, seed, scale):
    x = make_kv(L, T, H, D, dtype=torch.float32, seed=seed, k_scale=scale)[0].to(dtype)
    if seed % 3 == 0:
        x[:, 0] = 0  # a zero token
    dims = (-1,) if per_head else (-2, -1)
    _bound_check(x, [bins] * L, dims)


def test_per_layer_bins_respected():
    x = make_kv(3, 64, 2, 16, dtype=torch.float32)[0]
    bins = [32, 16, 8]
    sym, _ = _bound_check(x, bins, (-1,))
    for layer, b in enumerate(bins):
        assert int(sym[layer].max()) == b - 2 and int(sym[layer].min()) == 0


# ------------------------------------------------------------------------ log8 scales
@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1), spread=st.floats(0.0, 25.0), zeros=st.booleans())
def test_log8_rounds_up_and_roundtrips(seed, spread, zeros):
    g = torch.Generator().manual_seed(seed)
    s = (torch.rand(50, generator=g) * spread - spread / 2).exp2().to(torch.bfloat16).float()
    if zeros:
        s[3] = 0
    enc = Q.encode_log8(s)
    assert enc is not None
    codes, e0, eff = enc
    assert codes.dtype == torch.uint8
    assert bool((eff >= s).all())
    assert bool((eff <= s * 2 ** (1 / 8) * (1 + 1e-6)).all())
    assert torch.equal(Q.decode_log8(codes, e0), eff)
    if zeros:
        assert int(codes[3]) == 0 and float(eff[3]) == 0.0
    # the chosen code is the smallest one that does not clip
    grid = Q.log8_values(e0)
    lower = grid[(codes.long() - 1).clamp(min=0)]
    assert bool(((codes == 0) | (codes == 1) | (lower < s)).all())


def test_log8_out_of_range_returns_none():
    s = torch.tensor([1e-30, 1e30])
    assert Q.encode_log8(s) is None
    assert Q.encode_log8(torch.zeros(4))[0].tolist() == [0, 0, 0, 0]


def test_log8_mantissa_constants():
    for j in range(8):
        exact = 2 ** (j / 8)
        assert float(Q.LOG8_MANTISSA[j]) >= exact - 1e-15
        assert float(Q.LOG8_MANTISSA[j]) - exact < 2 ** -22


# ------------------------------------------------------------------------- KIVI / FP8
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_kivi_error_bound(bits, dtype):
    x = make_kv(2, 64, 3, 40, dtype=torch.float32, k_scale=3.0)[0].to(dtype)
    x[:, 5] = 0
    for dim, group in ((1, 32), (3, 8)):
        q, lo, step = lowbit.kivi_quantize(x, bits, dim=dim, group=group)
        assert int(q.max()) <= (1 << bits) - 1 and lo.dtype == dtype and step.dtype == dtype
        xh = lowbit.kivi_dequantize(q, lo, step, dim=dim, group=group)
        stepb = step.float().repeat_interleave(group, dim=dim)
        err = (xh - x.float()).abs()
        assert bool((err <= stepb / 2 * (1 + 1e-3) + 1e-6 * x.float().abs()).all())


def test_fp8_cast_saturates():
    x = torch.tensor([0.0, 1.0, -3.5, 1000.0, -1e6, 0.1])
    y = lowbit.fp8_dequantize(lowbit.fp8_quantize(x))
    assert y.tolist()[:3] == [0.0, 1.0, -3.5]
    assert y[3] == 448 and y[4] == -448
    assert abs(float(y[5]) - 0.1) <= 0.1 * 2 ** -3


def test_empirical_entropy():
    sym = torch.tensor([[0, 1], [1, 1], [0, 1], [1, 1]], dtype=torch.uint8)  # [N=4, C=2]
    # channel 0: two 0s two 1s -> 4 bits; channel 1: constant -> 0 bits
    assert math.isclose(Q.empirical_entropy_bits(sym, 2), 4.0)
