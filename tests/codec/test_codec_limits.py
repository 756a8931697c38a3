"""Values at the dtype's limit: every codec and level, fp16/bf16/fp32,
positive and negative, a single outlier and whole groups at the dtype's max.

Encode accepts the KV and decode returns finite values within the codec's error bound
(or, for a codec without a documented bound, at least finite values of the right dtype
and shape). A codec that needs a calibration artifact (kvtc) gets one fitted in the test
for the shape, on small Gaussian KV (a fraction of a second), registered so decode finds it."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import codec
from codec.quant import lowbit
from codec.quant import reference as Q

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
SHAPE = (2, 192, 2, 32)              # L, T, H, D: KIVI quantizes 64 tokens (192 - 128)
KIVI_GROUP, KIVI_RESIDUAL = 32, 128
EPS = {torch.float16: 2 ** -11, torch.bfloat16: 2 ** -8, torch.float32: 2 ** -24}
PATTERNS = ("single", "single_noise", "group", "group_mixed", "uniform", "row", "channel")


def all_cases() -> list[tuple[str, int | None]]:
    return [(n, lv) for n in sorted(codec.CODECS) for lv in (codec.levels(n) or (None,))]


def make(pattern: str, dtype: torch.dtype, sign: float, seed: int = 0, shape=SHAPE,
         frac: float = 1.0) -> torch.Tensor:
    """A tensor of ``shape`` with values at ``frac`` * the dtype's max in ``pattern``."""
    big = torch.finfo(dtype).max * frac
    g = torch.Generator().manual_seed(seed)
    L, T, H, D = shape
    if pattern == "single":             # zeros except one value at the limit
        x = torch.zeros(shape, dtype=torch.float64)
        x[0, 0, 0, 0] = sign * big
    elif pattern == "single_noise":     # random normal values, one at the limit mid-chunk
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        x[1, 37, 1, 5] = sign * big
    elif pattern == "group":            # every value at the limit
        x = torch.full(shape, sign * big, dtype=torch.float64)
    elif pattern == "group_mixed":      # +-max alternating
        x = torch.where(torch.rand(shape, generator=g) < 0.5, big, -big).to(torch.float64)
    elif pattern == "uniform":          # uniform over the whole finite range
        x = (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1) * big
    elif pattern == "row":              # one whole token at the limit
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        x[:, 10] = sign * big
    elif pattern == "channel":          # one whole channel at the limit
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        x[..., 3] = sign * big
    else:
        raise AssertionError(pattern)
    y = x.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype)
    assert bool(torch.isfinite(y).all())
    return y


def symmetric_bound(x: torch.Tensor, group: str, bins: list[int]) -> torch.Tensor:
    """|error| bound of the symmetric (cachegen / LMCache) quantizer: max |x| of the scale
    group (an upper bound of the stored scale; outliers taken out only lower it) / (2M),
    plus float32 and output-dtype rounding."""
    L, T, H, D = x.shape
    a = x.double().abs()
    if group == "chunk_head":
        s = a.amax(dim=(1, 3), keepdim=True)
    elif group == "head":
        s = a.amax(dim=3, keepdim=True)
    else:                               # token
        s = a.amax(dim=(2, 3), keepdim=True)
    m = torch.tensor([b // 2 - 1 for b in bins], dtype=torch.float64).reshape(L, 1, 1, 1)
    b = s / (2 * m)
    return b * (1 + 1e-5) + 2 * EPS[x.dtype] * (a + b)


def check_bound(name: str, x: torch.Tensor, y: torch.Tensor, header: dict, is_key: bool):
    """Assert ``y`` (decoded) is within ``name``'s documented error bound of ``x``."""
    err = (y.double() - x.double()).abs()
    xd = x.double()
    if name == "raw":
        assert torch.equal(y, x)
    elif name == "fp8":                 # saturating e4m3 cast: 3 mantissa bits
        c = xd.clamp(-lowbit.FP8_MAX, lowbit.FP8_MAX)
        assert bool(((y.double() - c).abs() <= c.abs() * 2 ** -4 + 2 ** -10
                     + EPS[x.dtype] * c.abs()).all())
    elif name.startswith("kivi"):
        bits = int(name[4:])
        qmax = (1 << bits) - 1
        L, T, H, D = x.shape
        nq = max(0, T - KIVI_RESIDUAL)
        nq -= nq % KIVI_GROUP
        assert torch.equal(y[:, nq:], x[:, nq:])
        if nq:
            xq = xd[:, :nq]
            if is_key:                  # groups of 32 tokens per channel
                g = xq.unflatten(1, (nq // KIVI_GROUP, KIVI_GROUP))
                rng = (g.amax(2, keepdim=True) - g.amin(2, keepdim=True)).expand_as(g)
                rng = rng.flatten(1, 2)
            else:                       # groups of 32 channels per token
                g = xq.unflatten(3, (D // KIVI_GROUP, KIVI_GROUP))
                rng = (g.amax(4, keepdim=True) - g.amin(4, keepdim=True)).expand_as(g)
                rng = rng.flatten(3, 4)
            step = rng / qmax
            bound = step / 2 * (1 + 2 * EPS[x.dtype]) + step * EPS[x.dtype] \
                + 2 * EPS[x.dtype] * xq.abs()
            assert bool((err[:, :nq] <= bound).all()), float((err[:, :nq] - bound).max())
    elif name in ("quant8", "cachegen", "cachegen-ref"):
        cfg = header["config"]
        specs = cfg["key_specs" if is_key else "value_specs"]
        bins = [0] * x.shape[0]
        for a, b, n in specs:
            for layer in range(a, b):
                bins[layer] = n
        ns = header["n_sink"]
        assert torch.equal(y[:, :ns], x[:, :ns])
        bound = symmetric_bound(x[:, ns:], cfg["scale_group"], bins)
        assert bool((err[:, ns:] <= bound).all()), float((err[:, ns:] - bound).max())
    # other codecs (kvtc, ...): no documented elementwise bound; finiteness is checked


_CALIBRATIONS: dict[tuple[int, int, int], object] = {}


def small_calibration(L: int, H: int, D: int):
    """A kvtc calibration for [L, *, H, D] KV, fitted once per shape on 256 tokens of
    Gaussian K and V (fp32) and registered (decode finds a calibration by the hash its
    chunk names)."""
    from codec import kvtc

    if (L, H, D) not in _CALIBRATIONS:
        g = torch.Generator().manual_seed(L * 1000 + H * 100 + D)
        k = torch.randn(L, 256, H, D, generator=g)
        v = torch.randn(L, 256, H, D, generator=g)
        cal = kvtc.fit_calibration(k, v, meta={"source": "tests/codec/test_codec_limits.py, Gaussian KV"})
        kvtc.register_calibration(cal)
        _CALIBRATIONS[(L, H, D)] = cal
    return _CALIBRATIONS[(L, H, D)]


def codec_config(name: str, k: torch.Tensor):
    """The config an encode of ``name`` needs beyond its level: kvtc its calibration for
    k's shape; None (the codec's default) for the others."""
    if name == "kvtc":
        from codec import kvtc

        L, _, H, D = k.shape
        return kvtc.KvtcConfig(calibration=small_calibration(L, H, D))
    return None


def roundtrip(name: str, level, k: torch.Tensor, v: torch.Tensor):
    """encode + decode; a ValueError from encode is accepted only for codecs outside the
    documented set and must be one line."""
    try:
        data = codec.encode_kv(k, v, codec=name, level=level, config=codec_config(name, k))
    except ValueError as e:
        assert name not in ("raw", "fp8", "quant8", "kivi2", "kivi4", "cachegen",
                            "cachegen-ref", "kvtc"), f"{name} refused limit values: {e}"
        assert "\n" not in str(e) and str(e)
        return None
    k2, v2 = codec.decode_kv(data)
    for a, b in ((k, k2), (v, v2)):
        assert b.dtype == a.dtype and b.shape == a.shape
        assert bool(torch.isfinite(b).all())
    from codec import bitstream

    return bitstream.unpack(data)[0]["codec_header"], k2, v2


# ------------------------------------------------------------------ the given input
@pytest.mark.parametrize("name", ["kivi2", "kivi4"])
def test_issue_input_fp16_65504_kivi(name):
    """fp16 K zeros except 65504 at [0, 0, 0, 0], shape [1, 160, 1, 32], V zeros: used to
    raise 'decoded KV contains NaN/inf' (step 21840 rounded up, 3 * 21840 = 65520)."""
    k = torch.zeros(1, 160, 1, 32, dtype=torch.float16)
    k[0, 0, 0, 0] = 65504
    v = torch.zeros_like(k)
    k2, v2 = codec.decode_kv(codec.encode_kv(k, v, codec=name))
    assert bool(torch.isfinite(k2).all()) and float(k2[0, 0, 0, 0]) == 65504.0
    assert torch.equal(v2, v)
    assert float((k2.float() - k.float()).abs().max()) == 0.0


def check_roundtrip(name, level, k, v):
    """Encode + decode (k, v); each within its codec's error bound (unless refused)."""
    out = roundtrip(name, level, k, v)
    if out is None:
        return
    header, k2, v2 = out
    check_bound(name, k, k2, header, True)
    check_bound(name, v, v2, header, False)


# -------------------------------------------------------------- every codec and level
@pytest.mark.parametrize("name,level", all_cases())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pattern", ["single", "group"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_every_codec_level_at_dtype_max(name, level, dtype, pattern, sign):
    k = make(pattern, dtype, sign)
    v = make(pattern, dtype, -sign, seed=1)
    check_roundtrip(name, level, k, v)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(case=st.sampled_from(all_cases()), dtype=st.sampled_from(DTYPES),
       pattern=st.sampled_from(PATTERNS), sign=st.sampled_from([1.0, -1.0]),
       frac=st.sampled_from([1.0, 0.999, 0.75, 0.5, 1e-3]), seed=st.integers(0, 10 ** 6))
def test_limit_property(case, dtype, pattern, sign, frac, seed):
    name, level = case
    k = make(pattern, dtype, sign, seed=seed, frac=frac)
    v = make(pattern, dtype, sign, seed=seed + 1, frac=frac)
    check_roundtrip(name, level, k, v)


# ------------------------------------------------------------ quantizer-level pieces
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_quantizer_range_at_limit(dtype, bits):
    """max - min of +-max overflows float32 for fp32/bf16: KIVI uses float64."""
    big = torch.finfo(dtype).max
    x = torch.tensor([[-big, big, 0.0, big / 3]] * 8, dtype=torch.float64).to(dtype)
    q, lo, step = lowbit.kivi_quantize(x, bits, dim=0, group=8)
    assert bool(torch.isfinite(step.float()).all())
    xh = lowbit.kivi_dequantize(q, lo, step, dim=0, group=8)
    assert bool(torch.isfinite(xh).all()) and bool(torch.isfinite(xh.to(dtype)).all())
    assert float(xh.to(dtype).double().max()) == big and float(xh.double().min()) == -big


def test_symmetric_dequantize_clamps_to_float32_max():
    big = torch.finfo(torch.float32).max
    m = Q.max_levels([32])
    x = torch.tensor([[big, -big, 0.0, big / 7]])
    s = Q.row_scales(x)
    y = Q.dequantize(Q.quantize(x, s, m), s, m)
    assert bool(torch.isfinite(y).all())
    assert float(y[0, 0]) == big and float(y[0, 1]) == -big


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tiny_scales_flush_to_zero(dtype):
    """A group whose max |x| is subnormal (M / s would overflow float32) decodes as zeros
    instead of NaN symbols."""
    tiny = torch.finfo(dtype).tiny / 64          # subnormal
    k = torch.zeros(1, 32, 1, 16, dtype=dtype)
    k[0, 10:, 0, :] = tiny
    v = k.clone()
    for name in ("cachegen", "cachegen-ref", "quant8"):
        k2, v2 = codec.decode_kv(codec.encode_kv(k, v, codec=name))
        assert bool(torch.isfinite(k2).all())
        assert float((k2.double() - k.double()).abs().max()) <= 2 ** -100


def test_log8_scales_never_overflow():
    big = torch.finfo(torch.float32).max
    s = torch.tensor([1e-30, big])
    enc = Q.encode_log8(s)
    assert enc is None or bool(torch.isfinite(enc[2]).all())
    cfg = codec.CodecConfig.uniform(1, 32, 32, scale_group="head", scale_format="log8")
    k = torch.zeros(1, 16, 1, 8)
    k[0, 3, 0, 1] = big
    k[0, 5, 0, 2] = 1e-30
    k2, _ = codec.decode_kv(codec.encode_kv(k, k.clone(), config=cfg))
    assert bool(torch.isfinite(k2).all()) and float(k2[0, 3, 0, 1]) == big
