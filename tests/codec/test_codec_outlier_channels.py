"""Outlier CHANNELS: one key or value channel x20..x3000 over all tokens
(as Llama-family keys have), 2-3 such channels, in several layers/heads: the relative L2
error of the OTHER values of each affected (layer, KV head) stays within 2x of the error
without the outlier channel, at every cachegen level, fused and reference decoders agree,
and KV without such channels keeps its version-4 content (tests/codec/test_codec_digests.py,
tests/codec/test_codec_bitstream_versions.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import codec
from codec.quant import outliers
from codec.quant import reference as Q
from codec.api import decode_kv, encode_kv
from codec.errors import CodecError
from tests.helpers.kv import NORMAL_KV_SHAPE as SHAPE, normal_kv  # the same KV as the outlier tests

FACTORS = (20, 100, 1000, 3000)


def others_err(x, y, chans) -> float:
    """Relative L2 error over the affected (layer, head) slices, outlier channels and the
    sink tokens excluded."""
    ns = codec.CodecConfig.for_model(SHAPE[0]).sink_tokens
    keep = torch.zeros(x.shape, dtype=torch.bool)
    for l, h, _ in chans:
        keep[l, ns:, h, :] = True
    for l, h, c in chans:
        keep[l, :, h, c] = False
    a, b = x.double()[keep], y.double()[keep]
    return float((a - b).norm() / a.norm())


CASES = {
    "k1": ("k", [(1, 1, 5)]),
    "v1": ("v", [(1, 1, 5)]),
    "k3": ("k", [(1, 1, 5), (1, 1, 40), (2, 0, 9)]),      # 2 in one head + another layer
    "k2-layers": ("k", [(0, 0, 63), (2, 1, 0)]),
    "v2": ("v", [(0, 1, 17), (0, 1, 18)]),
}


def _run(case, factor, level, dtype=torch.bfloat16, seed=0, fused=True):
    which, chans = CASES[case]
    k, v = normal_kv(dtype, seed)
    x = k if which == "k" else v
    for l, h, c in chans:
        x[l, :, h, c] = (x[l, :, h, c].float() * factor).to(dtype)
    data = encode_kv(k, v, "cachegen", level=level)
    if fused:
        kh, vh = decode_kv(data)
    else:
        hdr, arrays, payload = _split(data)
        kh, vh = codec.get_codec("cachegen").decode(hdr["codec_header"], arrays, payload,
                                                    tuple(k.shape), hdr["dtype"], fused=False)
    return x, (kh if which == "k" else vh), chans, data


def _split(data):
    from codec import bitstream

    c = bitstream.unpack_container(data)
    return c.header, c.arrays, c.payload


@pytest.mark.parametrize("level", range(6))
@pytest.mark.parametrize("case", sorted(CASES))
def test_other_values_error_within_2x(case, level):
    x0, y0, chans, d0 = _run(case, 1, level)
    base = others_err(x0, y0, chans)
    # no outlier channel (content a version-4 reader reads; written as version 6)
    assert d0[4:6] == (6).to_bytes(2, "little")
    assert not {"n_chx_k", "n_chx_v"} & set(_split(d0)[0]["codec_header"])
    for f in FACTORS:
        x, y, _, data = _run(case, f, level)
        err = others_err(x, y, chans)
        assert err <= 2 * base + 1e-9, (case, level, f, err, base)
        # every container is version 6 (a pre-scaled channel, n_chx_*, is what made it
        # version 5 before; at x3000 the side list may hold it all)
        assert data[4:6] == (6).to_bytes(2, "little")
        # the outlier channels themselves: relative error like a normal channel's at
        # this level (their own step is at most 2x the others')
        for l, h, c in chans:
            a, b = x[l, 4:, h, c].double(), y[l, 4:, h, c].double()
            assert float((a - b).norm() / a.norm()) <= max(4 * base, 0.05) + 1e-9


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", ["k3", "v2"])
def test_fused_equals_reference(case, dtype):
    for f in (20, 3000):
        _, yf, _, _ = _run(case, f, 1, dtype=dtype, seed=2)
        _, yr, _, _ = _run(case, f, 1, dtype=dtype, seed=2, fused=False)
        assert torch.equal(yf, yr)


def test_seeds_and_chunks():
    """Other seeds and a chunked encode (channels found per chunk)."""
    for seed in (1, 5):
        for level in (0, 1, 5):
            x0, y0, chans, _ = _run("k1", 1, level, seed=seed)
            base = others_err(x0, y0, chans)
            x, y, _, _ = _run("k1", 50, level, seed=seed)
            assert others_err(x, y, chans) <= 2 * base
    k, v = normal_kv()
    k0 = k.clone()
    k[1, :, 1, 5] = (k[1, :, 1, 5].float() * 300).to(k.dtype)
    base = others_err(k0, codec.decode_chunks(codec.encode_chunks(k0, v, "cachegen",
                                                                  chunk_tokens=64))[0],
                      [(1, 1, 5)])
    got = others_err(k, codec.decode_chunks(codec.encode_chunks(k, v, "cachegen",
                                                                chunk_tokens=64))[0],
                     [(1, 1, 5)])
    assert got <= 2 * base


def test_detection_rule():
    k, _ = normal_kv()
    assert outliers.outlier_channels(k) is None                   # normal KV: nothing
    k[2, :, 0, 3] = (k[2, :, 0, 3].float() * 1000).to(k.dtype)
    idx, ex = outliers.outlier_channels(k)
    L, T, H, D = k.shape
    assert idx.tolist() == [2 * H * D + 0 * D + 3]
    c = k.float().abs().amax(1)
    rest = c[2, 0].sort(descending=True).values[1]
    e = int(ex[0])
    assert c[2, 0, 3] / 2 ** e <= rest < c[2, 0, 3] / 2 ** (e - 1)
    # an all-zero rest (only one live channel) is not an outlier channel (nothing to save)
    z = torch.zeros(1, 8, 1, 4, dtype=torch.bfloat16)
    z[0, :, 0, 1] = 5
    assert outliers.outlier_channels(z) is None


def _container_parts(case="k1", f=100):
    x, y, chans, data = _run(case, f, 1)
    hdr, arrays, payload = _split(data)
    return hdr, arrays, payload


@pytest.mark.parametrize("mutate", ["no_n", "no_arrays", "bad_exp0", "bad_exp_big",
                                    "idx_range", "idx_dtype", "n_mismatch"])
def test_corrupt_channel_list_is_refused(mutate):
    hdr, arrays, payload = _container_parts("k3", 100)
    ch = dict(hdr["codec_header"])
    arrays = dict(arrays)
    if mutate == "no_n":
        ch.pop("n_chx_k")
    elif mutate == "no_arrays":
        arrays.pop("chx_k_exp")
    elif mutate == "bad_exp0":
        arrays["chx_k_exp"] = np.zeros_like(arrays["chx_k_exp"])
    elif mutate == "bad_exp_big":
        arrays["chx_k_exp"] = np.full_like(arrays["chx_k_exp"], outliers.CHANNEL_MAX_EXP + 1)
    elif mutate == "idx_range":
        a = arrays["chx_k_idx"].copy()
        a[-1] = np.prod(SHAPE) // SHAPE[1]
        arrays["chx_k_idx"] = a
    elif mutate == "idx_dtype":
        arrays["chx_k_idx"] = arrays["chx_k_idx"].astype(np.int32)
    elif mutate == "n_mismatch":
        ch["n_chx_k"] = ch["n_chx_k"] + 1
    c = codec.get_codec("cachegen")
    for fused in (True, False):
        with pytest.raises(CodecError):
            c.decode(ch, arrays, payload, SHAPE, hdr["dtype"], fused=fused)
