"""Tests of the entropy-coding core: 16-bit models, codebook, rANS (numba vs reference),
the encode_symbols/decode_symbols API and its error handling.

Run: .venv/bin/python -m pytest tests/codec/test_codec_entropy.py -q
"""
from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from codec import bitstream as bs
from codec.entropy import codebook as cb
from codec.entropy import codebook_codes as cc
from codec.entropy import models as prob
from codec.entropy import rans_cpu as rc
from codec.entropy import rans_ref as rref
from codec.entropy import decode_symbols, encode_symbols
from codec.errors import CodecError
from tests.helpers.entropy import normalize_spec

HYP = settings(derandomize=True, database=None, deadline=None, max_examples=60, suppress_health_check=list(HealthCheck))


# ---------------------------------------------------------------------------------------
# 16-bit normalisation
# ---------------------------------------------------------------------------------------
def test_normalize_invariants():
    rng = np.random.default_rng(0)
    cases = [np.zeros(2, np.int64), np.zeros(256, np.int64), np.array([1, 0]), np.array([10**9, 0, 0, 1]),
             np.array([0] * 255 + [7]), np.ones(256, np.int64) * 3]
    for nb in (2, 3, 5, 16, 17, 32, 100, 255, 256):
        cases.append(rng.integers(0, 1000, nb))
        cases.append(rng.integers(0, 3, nb) * rng.integers(0, 10**6, nb))
        cases.append(np.bincount(rng.geometric(0.5, 5000).clip(max=nb) - 1 + 0, minlength=nb)[:nb])
    for c in cases:
        f = cc.normalize_freqs(np.asarray(c))
        assert f.shape == np.shape(c)
        assert f.min() >= 1
        assert int(f.sum()) == 65536
        assert np.array_equal(f, cc.normalize_freqs(np.asarray(c)))  # deterministic
    # batch == row-by-row
    batch = rng.integers(0, 50, (20, 16))
    fb = cc.normalize_freqs(batch)
    for i in range(20):
        assert np.array_equal(fb[i], cc.normalize_freqs(batch[i]))
    # close to proportional
    c = np.array([6000, 3000, 1000, 0])
    f = cc.normalize_freqs(c)
    assert np.allclose(f / 65536, c / c.sum(), atol=1e-3)
    with pytest.raises(ValueError):
        cc.normalize_freqs(np.array([1]))
    with pytest.raises(ValueError):
        cc.normalize_freqs(np.array([1, -1]))


def test_models_are_valid_tables_and_codebook_beats_budget():
    rng = np.random.default_rng(1)
    L, T, C = 4, 512, 24
    scale = rng.uniform(0.5, 4.0, (2, L, C))
    sym = np.clip(np.round(rng.laplace(0, scale[:, :, None, :], (2, L, T, C)) + 8), 0, 15).astype(np.uint8)
    nbk = [32, 16, 16, 16]
    nbv = [16, 16, 8, 8]
    sym[1, 2:] = np.minimum(sym[1, 2:], 7)
    ms = prob.build_models(prob.histograms(sym[0]), prob.histograms(sym[1]), nbk, nbv)
    rc.validate_cum_table(ms.cum)
    assert [g[0] for g in ms.groups] == [8, 16, 32]
    assert ms.model_index.shape == (2, L, C) and ms.model_index.dtype == np.uint16
    assert int(ms.model_index.max()) < ms.cum.shape[0]
    # each (kv, layer) points into the rows of its own nbins group
    nb_of_row = (np.diff(ms.cum.astype(np.int64), axis=1) > 0).sum(axis=1)
    for kv, nbs in enumerate((nbk, nbv)):
        for layer in range(L):
            assert np.all(nb_of_row[ms.model_index[kv, layer]] == nbs[layer])
    # coded cross-entropy >= ideal, and not far above it
    assert ms.coded_bits >= ms.ideal_bits - 1e-6
    assert ms.coded_bits <= ms.ideal_bits * 1.05
    hdr, arrays = cb.serialize_models(ms)
    cum2, mi2 = cb.deserialize_models(hdr, arrays, nbk, nbv, L, C)
    assert np.array_equal(cum2, ms.cum) and np.array_equal(mi2, ms.model_index)


def _three_group_histograms():
    rng = np.random.default_rng(7)
    L, T, C = 6, 256, 48
    scale = rng.uniform(0.3, 6.0, (2, L, C))
    sym = np.clip(np.round(rng.laplace(0, scale[:, :, None, :], (2, L, T, C)) + 16), 0, 31).astype(np.uint8)
    nbk, nbv = [32] * L, [32, 32, 16, 16, 8, 8]
    sym[1, 2:4] = np.minimum(sym[1, 2:4], 15)
    sym[1, 4:] = np.minimum(sym[1, 4:], 7)
    return prob.histograms(sym[0]), prob.histograms(sym[1]), nbk, nbv


def _same_models(a, b):
    assert a.groups == b.groups and a.trials == b.trials
    assert np.array_equal(a.cum, b.cum) and np.array_equal(a.model_index, b.model_index)
    assert all(np.array_equal(x, y) for x, y in zip(a.codes, b.codes))
    assert a.coded_bits == b.coded_bits and a.ideal_bits == b.ideal_bits


def test_models_do_not_depend_on_fitting_the_groups_side_by_side(monkeypatch):
    """The nbins groups fitted in a thread pool give the codebook of the groups fitted in
    turn (each fit is deterministic), at any numba thread count."""
    import numba

    hk, hv, nbk, nbv = _three_group_histograms()
    monkeypatch.setattr(prob, "GROUP_THREADS", False)
    ref = prob.build_models(hk, hv, nbk, nbv)
    monkeypatch.setattr(prob, "GROUP_THREADS", True)
    before = numba.get_num_threads()
    try:
        for n in sorted({1, before}):
            numba.set_num_threads(n)
            _same_models(prob.build_models(hk, hv, nbk, nbv), ref)
    finally:
        numba.set_num_threads(before)
    assert len(ref.groups) == 3


def test_large_codebooks_are_tried_only_for_the_entropy_target(monkeypatch):
    """K above K_SIZE_MAX is tried only while no K tried meets XENT_TARGET: with a loose
    target the ladder stops at K_SIZE_MAX; with an unreachable one it goes past it."""
    hk, hv, nbk, nbv = _three_group_histograms()
    monkeypatch.setattr(prob, "K_SIZE_MAX", 4)
    monkeypatch.setattr(prob, "XENT_TARGET", 10.0)          # met by every K
    loose = prob.build_models(hk, hv, nbk, nbv)
    assert all(k <= 4 for _, tr in loose.trials for k, _ in tr)
    monkeypatch.setattr(prob, "XENT_TARGET", 0.0)           # met by none
    strict = prob.build_models(hk, hv, nbk, nbv)
    assert any(k > 4 for _, tr in strict.trials for k, _ in tr)


# ---------------------------------------------------------------------------------------
# rANS: reference vs numba, exact bytes
# ---------------------------------------------------------------------------------------
def _random_cum(rng, nb, alpha=0.5):
    f = 1 + rng.multinomial(65536 - nb, rng.dirichlet(np.ones(nb) * alpha))
    c = np.full(257, 65536, np.int64)
    c[0] = 0
    c[1 : nb + 1] = np.cumsum(f)
    return c


def test_ref_stream_examples():
    cum = _random_cum(np.random.default_rng(0), 4)
    assert rref.rans_encode_ref([], []) == bytes([0x00, 0x00, 0x01, 0x00])  # n = 0: x = L
    assert rref.rans_decode_ref(bytes([0, 0, 1, 0]), []) == []
    syms = [0, 1, 2, 3, 3, 2, 1, 0] * 10
    st_ = rref.rans_encode_ref(syms, [cum] * len(syms))
    assert rref.rans_decode_ref(st_, [cum] * len(syms)) == syms
    with pytest.raises(CodecError):
        rref.rans_decode_ref(st_[:-2], [cum] * len(syms))
    with pytest.raises(CodecError):
        rref.rans_decode_ref(st_ + b"\0\0", [cum] * len(syms))
    with pytest.raises(CodecError):
        rref.rans_decode_ref(b"\xff\xff\x00\x00", [cum])  # x < L


@pytest.mark.parametrize("cfg", [
    (1, 1, 1, 1, 1), (2, 37, 7, 3, 16), (3, 5, 9, 4, 5), (1, 64, 3, 8, 64), (2, 20, 6, 1, 7),
])
def test_numba_matches_reference_bytes(cfg):
    L, T, C, G, B = cfg
    rng = np.random.default_rng(sum(cfg))
    nbs = [2, 3, 16, 33, 256]
    cum = np.stack([_random_cum(rng, nb) for nb in nbs]).astype(np.uint32)
    mi = rng.integers(0, len(nbs), size=(2, L, C)).astype(np.uint16)
    nbm = np.array(nbs)[mi]
    sk = (rng.random((L, T, C)) * nbm[0][:, None, :]).astype(np.uint8)
    sv = (rng.random((L, T, C)) * nbm[1][:, None, :]).astype(np.uint8)
    p_ref, l_ref = rref.encode_streams_ref(sk, sv, cum, mi, G, B)
    p, lens = rc.encode_streams(sk, sv, cum, mi, G, B)
    assert p.tobytes() == p_ref
    assert np.array_equal(lens, l_ref)
    dk, dv = rc.decode_streams(p.tobytes(), lens, cum, mi, L, T, C, G, B)
    assert np.array_equal(dk, sk) and np.array_equal(dv, sv)
    rk, rv = rref.decode_streams_ref(p_ref, l_ref, cum, mi, L, T, C, G, B)
    assert np.array_equal(rk, sk) and np.array_equal(rv, sv)


def test_worst_case_stream_length_and_u32_lengths():
    """freq-1 symbols cost one renormalisation word each: the stream is exactly the worst
    case 4 + 2n bytes, and the scratch sizing must hold it."""
    nb = 256
    f = np.full(nb, 1, np.int64)
    f[0] = 65536 - (nb - 1)
    cum = np.full(257, 65536, np.int64)
    cum[0] = 0
    cum[1:] = np.cumsum(f)
    cum = cum[None].astype(np.uint32)
    L, T, C, G = 1, 9000, 4, 4
    rng = np.random.default_rng(3)
    sk = rng.integers(1, 256, (L, T, C)).astype(np.uint8)  # all rare
    sv = np.zeros((L, T, C), np.uint8)  # all frequent
    mi = np.zeros((2, L, C), np.uint16)
    p, lens = rc.encode_streams(sk, sv, cum, mi, G, T)
    n = T * C
    assert lens[0] <= 4 + 2 * n and lens[0] >= 2 * n  # at most one word per symbol + state
    assert lens[1] < 100
    dk, dv = rc.decode_streams(p, lens, cum, mi, L, T, C, G, T)
    assert np.array_equal(dk, sk) and np.array_equal(dv, sv)


def test_long_stream_through_api_uses_u32_lengths():
    L, T, C = 1, 70000, 5
    rng = np.random.default_rng(4)
    sk = np.zeros((L, T, C), np.uint8)
    sk[0, :, 2] = rng.integers(0, 256, T)  # one channel full of high-entropy symbols
    sv = np.zeros((L, T, C), np.uint8)
    enc = encode_symbols(sk, sv, [256], [2], channels_per_stream=4)
    assert enc.arrays["ent_stream_lengths"].dtype == np.uint32
    lens = enc.arrays["ent_stream_lengths"]
    assert lens[0] > 65536 and lens.max() > 10 * np.median(lens)
    dk, dv = decode_symbols(enc.header, enc.arrays, enc.payload, L, T, C, [256], [2])
    assert np.array_equal(dk, sk) and np.array_equal(dv, sv)


# ---------------------------------------------------------------------------------------
# encode_symbols / decode_symbols property tests
# ---------------------------------------------------------------------------------------
def _make_symbols(rng, L, T, C, nbk, nbv, kind):
    out = []
    for nbs in (nbk, nbv):
        s = np.zeros((L, T, C), np.uint8)
        for layer in range(L):
            nb = nbs[layer]
            if kind == "zeros":
                continue
            if kind == "uniform":
                s[layer] = rng.integers(0, nb, (T, C))
            elif kind == "const":
                s[layer] = nb - 1
            else:  # laplace-ish around the middle, per-channel scales, one rare channel
                sc = rng.uniform(0.3, 3.0, C)
                v = np.round(rng.laplace(0, sc, (T, C)) + nb // 2)
                s[layer] = np.clip(v, 0, nb - 1)
                s[layer, :, C // 2] = rng.choice([0, nb - 1], T)
        out.append(s)
    return out


@HYP
@given(
    L=st.integers(1, 3), T=st.integers(1, 40), C=st.integers(1, 9),
    nb_choices=st.lists(st.sampled_from([2, 3, 5, 8, 16, 17, 32, 64, 255, 256]), min_size=6, max_size=6),
    G=st.integers(1, 10), B=st.one_of(st.none(), st.integers(1, 45)),
    kind=st.sampled_from(["zeros", "uniform", "const", "laplace"]),
    seed=st.integers(0, 2**31),
    through_container=st.booleans(),
)
def test_property_round_trip(L, T, C, nb_choices, G, B, kind, seed, through_container):
    rng = np.random.default_rng(seed)
    nbk, nbv = nb_choices[:L], nb_choices[3 : 3 + L]
    sk, sv = _make_symbols(rng, L, T, C, nbk, nbv, kind)
    enc = encode_symbols(sk, sv, nbk, nbv, channels_per_stream=G, tokens_per_stream=B)
    assert enc.payload_bytes == len(enc.payload)
    assert enc.entropy_bits >= enc.ideal_bits - 1e-6
    header, arrays, payload = enc.header, enc.arrays, enc.payload
    if through_container:
        header, arrays, payload = bs.unpack(bs.pack(header, arrays, payload))
    dk, dv = decode_symbols(header, arrays, payload, L, T, C, nbk, nbv)
    assert dk.dtype == np.uint8 and dk.shape == (L, T, C)
    assert np.array_equal(dk, sk) and np.array_equal(dv, sv)


def test_zero_tokens_round_trip():
    s = np.zeros((3, 0, 5), np.uint8)
    enc = encode_symbols(s, s, [16] * 3, [8] * 3)
    assert enc.payload == b"" and enc.header["n_streams"] == 0
    h, a, p = bs.unpack(bs.pack(enc.header, enc.arrays, enc.payload))
    dk, dv = decode_symbols(h, a, p, 3, 0, 5, [16] * 3, [8] * 3)
    assert dk.shape == (3, 0, 5) and dv.shape == (3, 0, 5)
    with pytest.raises(CodecError):
        decode_symbols(h, a, b"\0\0\0\0", 3, 0, 5, [16] * 3, [8] * 3)
    with pytest.raises(CodecError):
        decode_symbols({**h, "n_streams": 1}, a, p, 3, 0, 5, [16] * 3, [8] * 3)


def test_encode_rejects_bad_input():
    s = np.zeros((2, 3, 4), np.uint8)
    with pytest.raises(ValueError, match="nbins"):
        encode_symbols(s, s + 16, [16, 16], [16, 16])
    with pytest.raises(ValueError):
        encode_symbols(s.astype(np.int16), s, [16, 16], [16, 16])
    with pytest.raises(ValueError):
        encode_symbols(s, s[:, :2], [16, 16], [16, 16])
    with pytest.raises(ValueError):
        encode_symbols(s, s, [16], [16, 16])
    with pytest.raises(ValueError):
        encode_symbols(s, s, [1, 16], [16, 16])
    with pytest.raises(ValueError):
        encode_symbols(s, s, [16, 16], [16, 16], channels_per_stream=0)


def test_overhead_at_realistic_size():
    """Payload + length table within 1% of the coded cross-entropy; models <= 2% of the
    total at 1K tokens (scaled-down realistic chunk: 6 layers x 1024 tokens x 192 ch)."""
    rng = np.random.default_rng(5)
    L, T, C = 6, 1024, 192
    nbk, nbv = [32, 32, 16, 16, 16, 16], [32, 16, 16, 16, 16, 16]
    sc = rng.lognormal(0.0, 0.5, (2, L, 1, C))
    centre = rng.integers(-2, 3, (2, L, 1, C))
    sym = np.empty((2, L, T, C), np.uint8)
    for kv, nbs in enumerate((nbk, nbv)):
        for layer in range(L):
            nb = nbs[layer]
            v = np.round(rng.laplace(0, sc[kv, layer], (T, C)) + centre[kv, layer] + nb // 2 - 1)
            sym[kv, layer] = np.clip(v, 0, nb - 1)
    enc = encode_symbols(sym[0], sym[1], nbk, nbv)
    bits_per_sym = enc.entropy_bits / sym.size
    assert 1.5 < bits_per_sym < 4
    coded = (enc.payload_bytes + enc.length_table_bytes) * 8
    assert coded <= enc.entropy_bits * 1.01
    assert enc.model_bytes <= 0.02 * enc.total_bytes
    assert enc.entropy_bits <= enc.ideal_bits * 1.01
    dk, dv = decode_symbols(enc.header, enc.arrays, enc.payload, L, T, C, nbk, nbv)
    assert np.array_equal(dk, sym[0]) and np.array_equal(dv, sym[1])


# ---------------------------------------------------------------------------------------
# Corruption: CodecError only
# ---------------------------------------------------------------------------------------
def _small_encoded():
    rng = np.random.default_rng(11)
    L, T, C = 2, 300, 12
    nbk, nbv = [32, 16], [16, 8]
    sk, sv = _make_symbols(rng, L, T, C, nbk, nbv, "laplace")
    enc = encode_symbols(sk, sv, nbk, nbv, channels_per_stream=2, tokens_per_stream=64)
    assert "ent_model_index" in enc.arrays  # a codebook with K > 1 (exercises the index)
    return (L, T, C, nbk, nbv), sk, sv, enc


def test_corrupted_payload_raises_codec_error_only():
    (L, T, C, nbk, nbv), sk, sv, enc = _small_encoded()
    rng = random.Random(99)
    raised = 0
    n_cases = 3000
    for i in range(n_cases):
        p = bytearray(enc.payload)
        op = i % 4
        if op == 0:
            for _ in range(rng.randint(1, 3)):
                p[rng.randrange(len(p))] ^= rng.randint(1, 255)
        elif op == 1:
            p = p[: rng.randrange(len(p))]
        elif op == 2:
            k = rng.randrange(len(p))
            p[k:k] = bytes([rng.randrange(256), rng.randrange(256)])
        else:
            k = rng.randrange(len(p) - 2)
            del p[k : k + 2]
        try:
            dk, dv = decode_symbols(enc.header, enc.arrays, bytes(p), L, T, C, nbk, nbv)
        except CodecError:
            raised += 1
            continue
        assert dk.shape == (L, T, C)  # undetectable corruption (no CRC at this layer)
    assert raised >= 0.97 * n_cases


def test_corrupted_lengths_models_header_raise_codec_error_only():
    (L, T, C, nbk, nbv), sk, sv, enc = _small_encoded()
    rng = np.random.default_rng(5)
    raised = 0
    n_cases = 1500
    for i in range(n_cases):
        header = dict(enc.header)
        arrays = {k: v.copy() for k, v in enc.arrays.items()}
        which = i % 5
        if which == 0:
            a = arrays["ent_stream_lengths"]
            j = rng.integers(0, a.size)
            a[j] = a[j] + rng.choice([-4, -2, 2, 4, 1, 1000])
        elif which == 1:
            a = arrays["ent_codebook"]
            j = rng.integers(0, a.size)
            a[j] = a[j] ^ rng.integers(1, 256)
        elif which == 2:
            a = arrays["ent_model_index"]
            a.reshape(-1)[rng.integers(0, a.size)] = rng.integers(0, 256)
        elif which == 3:
            key = rng.choice(sorted(header))
            header[key] = [None, -1, 0, 10**30, "x", 1.5, [[16, 1]], True][rng.integers(0, 8)]
        else:
            key = rng.choice(sorted(arrays))
            arrays[key] = [arrays[key][:-1], arrays[key].astype(np.int64), np.zeros((2, 2), np.uint8)][rng.integers(0, 3)]
        try:
            decode_symbols(header, arrays, enc.payload, L, T, C, nbk, nbv)
        except CodecError:
            raised += 1
    assert raised >= 0.7 * n_cases  # e.g. a model-index change within range can still decode


def test_decode_rejects_bad_call_arguments():
    (L, T, C, nbk, nbv), sk, sv, enc = _small_encoded()
    for args in [(L, T + 1, C), (L, T, C + 1), (L + 1, T, C), (0, T, C)]:
        with pytest.raises(CodecError):
            decode_symbols(enc.header, enc.arrays, enc.payload, *args, nbk, nbv)
    with pytest.raises(CodecError):
        decode_symbols(enc.header, enc.arrays, enc.payload, L, T, C, [16, 16], nbv)
    with pytest.raises(CodecError):
        decode_symbols(enc.header, enc.arrays, enc.payload, L, T, C, nbk, ["a", None])
    with pytest.raises(CodecError):
        decode_symbols({**enc.header, "extra": 1}, enc.arrays, enc.payload, L, T, C, nbk, nbv)
    with pytest.raises(CodecError):
        decode_symbols(enc.header, enc.arrays, "str", L, T, C, nbk, nbv)


def test_normalize_matches_documented_formula():
    rng = np.random.default_rng(21)
    for nb in (2, 3, 15, 31, 256):
        for _ in range(5):
            c = rng.integers(0, 50, nb) * (rng.random(nb) < 0.6)
            assert cc.normalize_freqs(c).tolist() == normalize_spec(c)
    assert cc.normalize_freqs(np.zeros(7, np.int64)).tolist() == normalize_spec([0] * 7)


def test_encoding_is_deterministic_and_stats_consistent():
    (L, T, C, nbk, nbv), sk, sv, enc = _small_encoded()
    enc2 = encode_symbols(sk, sv, nbk, nbv, channels_per_stream=2, tokens_per_stream=64)
    assert enc2.payload == enc.payload and enc2.header == enc.header
    for k in enc.arrays:
        assert np.array_equal(enc.arrays[k], enc2.arrays[k])
    assert enc.payload_bytes == len(enc.payload)
    assert enc.length_table_bytes == enc.arrays["ent_stream_lengths"].nbytes
    assert enc.model_bytes == enc.arrays["ent_codebook"].nbytes + enc.arrays["ent_model_index"].nbytes
    # entropy_bits is exactly the code length of the symbols under the transmitted models
    cum, mi = cb.deserialize_models(enc.header, enc.arrays, nbk, nbv, L, C)
    f = np.diff(cum.astype(np.int64), axis=1)
    bits = 0.0
    for kv, s in enumerate((sk, sv)):
        m = np.broadcast_to(mi[kv][:, None, :], s.shape)
        bits += float(-np.log2(f[m, s] / 65536).sum())
    assert abs(bits - enc.entropy_bits) < 1e-6 * bits


def test_validate_cum_table():
    rng = np.random.default_rng(2)
    cum = np.stack([_random_cum(rng, 5), _random_cum(rng, 256)]).astype(np.uint32)
    rc.validate_cum_table(cum, np.array([5, 256]))
    bad = cum.copy()
    bad[0, 3] = bad[0, 2]  # zero frequency inside the alphabet
    with pytest.raises(CodecError):
        rc.validate_cum_table(bad, np.array([5, 256]))
    with pytest.raises(CodecError):
        rc.validate_cum_table(cum, np.array([4, 256]))  # padding check
    bad = cum.copy()
    bad[1, 256] = 65535
    with pytest.raises(CodecError):
        rc.validate_cum_table(bad)
    with pytest.raises(CodecError):
        rc.validate_cum_table(cum[:, :256])


def test_entropy_stage_composes_any_backend():
    """codec.entropy composes models + streams once over a coder backend: a
    backend that records its calls (wrapping the numba one) gives the default's bytes and
    is the only thing that touched the symbols."""
    from codec import entropy
    from codec.entropy import rans_cpu, rans_spec

    calls = []

    class Recording:
        name = "recording"

        def check_symbols(self, a, b):
            calls.append("check")
            return rans_cpu.CPU_CODER.check_symbols(a, b)

        def histograms(self, s):
            calls.append("hist")
            return rans_cpu.CPU_CODER.histograms(s)

        def encode_streams(self, *a):
            calls.append("enc")
            return rans_cpu.CPU_CODER.encode_streams(*a)

        def decode_streams(self, *a, **kw):
            calls.append("dec")
            return rans_cpu.CPU_CODER.decode_streams(*a, **kw)

    rng = np.random.default_rng(3)
    sk = rng.integers(0, 7, (2, 33, 6)).astype(np.uint8)
    sv = rng.integers(0, 3, (2, 33, 6)).astype(np.uint8)
    ref = entropy.encode_symbols(sk, sv, [7, 7], [3, 3], channels_per_stream=2)
    got = entropy.encode_symbols(sk, sv, [7, 7], [3, 3], channels_per_stream=2,
                                 backend=Recording())
    assert got.payload == ref.payload and got.header == ref.header
    dk, dv = entropy.decode_symbols(got.header, got.arrays, got.payload, 2, 33, 6, [7, 7],
                                    [3, 3], backend=Recording())
    assert np.array_equal(dk, sk) and np.array_equal(dv, sv)
    assert calls == ["check", "hist", "hist", "enc", "dec"]
    assert ref.header["coder"] == rans_spec.CODER_NAME
    assert set(ref.header) <= set(rans_spec.HEADER_FIELDS)
    assert set(ref.arrays) <= set(rans_spec.ARRAY_NAMES)
    # one definition of the constants and layout, shared by both backends
    from codec.triton import kernels as tj
    from codec.triton import ops as tk

    assert tj.RANS_L == rans_spec.RANS_L
    assert rans_cpu.stream_layout is rans_spec.stream_layout
    assert tk._layout(2, 33, 6, 2, 33) == rans_spec.stream_layout(2, 33, 6, 2, 33)


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("channel", [1, 9])     # 4-lane item (channels 0-7) / 1-lane tail item
def test_encode_refuses_a_zero_frequency_symbol_in_either_lane_path(parallel, channel):
    """A symbol of frequency 0 in its model is a ValueError naming the stream, whether it
    falls in a 4-lane work item or the 1-lane tail; the other streams still encode."""
    L, T, C, G, B = 1, 8, 10, 2, 8                # 5 groups of 2 channels: one 4-lane item + 1 tail
    cum = np.full((1, 257), 65536, np.uint32)
    cum[0, 0] = 0
    cum[0, 1] = 30000                             # symbols 0 and 1 only
    mi = np.zeros((2, L, C), np.uint16)
    sk = np.zeros((L, T, C), np.uint8)
    sv = np.ones((L, T, C), np.uint8)
    pay, lens = rc.encode_streams(sk, sv, cum, mi, G, B, parallel=parallel)
    assert len(lens) == 2 * (C // G) and lens.sum() == pay.size
    sk[0, 3, channel] = 2
    with pytest.raises(ValueError, match="zero frequency"):
        rc.encode_streams(sk, sv, cum, mi, G, B, parallel=parallel)


@pytest.mark.parametrize("shape", [(3, 37, 11), (1, 1, 1), (2, 0, 5), (30, 64, 192)])
def test_histograms_equal_a_bincount(shape):
    """probability.histograms (per-layer counting, transposed in cache) counts every
    symbol 0..255 of every (layer, channel) exactly as a bincount does."""
    rng = np.random.default_rng(sum(shape))
    sym = rng.integers(0, 256, shape).astype(np.uint8)
    if sym.size:
        sym.reshape(-1)[0] = 255
    L, T, C = shape
    idx = (np.arange(L)[:, None, None] * C + np.arange(C)[None, None, :]) * 256 + sym
    ref = np.bincount(idx.reshape(-1), minlength=L * C * 256).reshape(L, C, 256)
    got = prob.histograms(sym)
    assert got.dtype == np.int64 and got.shape == (L, C, 256) and np.array_equal(got, ref)
