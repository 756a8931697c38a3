"""Compact model tables of the entropy stage (docs/bitstream.md 4.3, format version 3;
issue 14.7): Rice-coded square-root table codes, bit-packed model index, the version-2
codebook still read, crafted tables -> CodecError only.

Run: .venv/bin/python -m pytest -q tests/test_codec_tables.py
"""
import numpy as np
import pytest

from codec import probability as prob
from codec.entropy import decode_symbols, encode_symbols
from codec.errors import CodecError


def _laplace_syms(rng, L, T, C, nb, spread=(0.4, 3.0)):
    scale = rng.uniform(*spread, size=(L, 1, C))
    shift = rng.integers(-2, 3, size=(L, 1, C))
    x = np.round(rng.laplace(0, scale, (L, T, C)) + nb // 2 + shift)
    return np.clip(x, 0, nb - 1).astype(np.uint8)


def _spec_read_tables(buf: bytes, groups):
    """docs/bitstream.md 4.3, literally: MSB-first bits, Rice(k) of zigzag deltas,
    q[-1] = 0 per table, f = normalize(q * q). Returns {nbins: [[f...], ...]}."""
    bits = "".join(f"{b:08b}" for b in buf)
    pos = 0
    out = {}
    for nb, K, k, _ in groups:
        tabs = []
        for _ in range(K):
            prev, q = 0, []
            for _ in range(nb):
                u = 0
                while bits[pos] == "1":
                    u += 1
                    pos += 1
                pos += 1
                r = int(bits[pos:pos + k], 2) if k else 0
                pos += k
                zz = (u << k) | r
                d = zz // 2 if zz % 2 == 0 else -(zz + 1) // 2
                prev += d
                q.append(prev)
            tabs.append(_normalize_spec([v * v for v in q]))
        out[nb] = tabs
    assert set(bits[pos:]) <= {"0"} and len(bits) - pos < 8
    return out


def _spec_read_index(buf: bytes, groups, nbk, nbv, C):
    """docs/bitstream.md 4.3: Rice(index_k) codes, C per (kv, layer) of a group with K > 1,
    MSB first. Returns ({(kv, layer): [local indices]}, bits read)."""
    bits = "".join(f"{b:08b}" for b in buf)
    kmap = {nb: (K, ik) for nb, K, _, ik in groups}
    pos, out = 0, {}
    for kv, nbs in enumerate((nbk, nbv)):
        for layer, nb in enumerate(nbs):
            K, k = kmap[nb]
            if K == 1:
                continue
            vals = []
            for _ in range(C):
                u = 0
                while bits[pos] == "1":
                    u += 1
                    pos += 1
                pos += 1
                vals.append((u << k) | (int(bits[pos:pos + k], 2) if k else 0))
                pos += k
            out[(kv, layer)] = vals
    assert set(bits[pos:]) <= {"0"} and len(bits) - pos < 8
    return out, pos


def _normalize_spec(c):
    nb = len(c)
    if sum(c) == 0:
        c = [1] * nb
    N = sum(c)
    spare = 65536 - nb
    f = [1 + (v * spare) // N for v in c]
    rem = [(v * spare) % N for v in c]
    for s in sorted(range(nb), key=lambda s: (-rem[s], s))[:65536 - sum(f)]:
        f[s] += 1
    return f


@pytest.fixture(scope="module")
def big():
    """A chunk whose K group gets more than 256 tables (needs > 256 distinct channels)."""
    rng = np.random.default_rng(3)
    L, T, C = 2, 1024, 640
    # keys: every channel its own random distribution (no two alike: a large codebook pays)
    p = rng.dirichlet(np.full(31, 0.3), size=(L, C))
    u = rng.random((L, T, C))
    cdf = np.cumsum(p, axis=-1)
    sk = np.minimum((u[..., None] > cdf[:, None, :, :]).sum(-1), 30).astype(np.uint8)
    sv = _laplace_syms(rng, L, T, C, 9)
    nbk, nbv = [31, 31], [9, 9]
    return (L, T, C, nbk, nbv), sk, sv, encode_symbols(sk, sv, nbk, nbv)


def test_round_trip_and_documented_layout(big):
    (L, T, C, nbk, nbv), sk, sv, enc = big
    groups = enc.header["model_groups"]
    assert [g[0] for g in groups] == [9, 31] and all(len(g) == 4 for g in groups)
    assert any(g[1] > 256 for g in groups)          # beyond the old uint8 index
    dk, dv = decode_symbols(enc.header, enc.arrays, enc.payload, L, T, C, nbk, nbv)
    assert np.array_equal(dk, sk) and np.array_equal(dv, sv)
    # the tables the decoder rebuilds are exactly the documented formula's
    cum, mi = prob.deserialize_models(enc.header, enc.arrays, nbk, nbv, L, C)
    spec = _spec_read_tables(enc.arrays["ent_tables"].tobytes(), groups)
    f = np.diff(cum.astype(np.int64), axis=1)
    row = 0
    for nb, K, _, _ in groups:
        assert f[row:row + K, :nb].tolist() == spec[nb]
        row += K
    # the index: Rice codes of the local indices; tables numbered by decreasing use
    kmap = {nb: K for nb, K, _, _ in groups}
    idx, _ = _spec_read_index(enc.arrays["ent_model_index"].tobytes(), groups, nbk, nbv, C)
    offs = {9: 0, 31: kmap[9]}
    for kv, nbs in enumerate((nbk, nbv)):
        for layer in range(L):
            if kmap[nbs[layer]] > 1:
                assert (mi[kv, layer].astype(int) - offs[nbs[layer]]).tolist() == idx[(kv, layer)]
    for nb in (9, 31):
        if kmap[nb] > 1:
            local = np.concatenate([np.array(v) for (kv, layer), v in idx.items()
                                    if (nbk, nbv)[kv][layer] == nb])
            use = np.bincount(local, minlength=kmap[nb])
            assert np.all(np.diff(use) <= 0)


def test_tables_are_compact_and_near_lossless(big):
    (L, T, C, nbk, nbv), sk, sv, enc = big
    n_entries = sum(nb * K for nb, K, _, _ in enc.header["model_groups"])
    assert enc.arrays["ent_tables"].nbytes * 8 < 8 * n_entries    # < 8 bits per entry (was 16)
    # square-root-domain codes cost < 0.05% against exact 16-bit tables of the same clusters
    hk = prob.histograms(sk)
    H = np.concatenate([hk[layer, :, :31] for layer in range(L)])
    codes, freqs, assign, bits, _ = prob._cluster_group(H, [64])
    assert codes.shape[0] == 64
    cent = np.zeros((64, 31), np.int64)
    np.add.at(cent, assign, H)
    coded = prob.freqs_from_codes(prob.table_codes(cent))
    exact = prob.normalize_freqs(cent)

    def xent(f):
        return float((H * (16 - np.log2(f[assign]))).sum())

    assert xent(exact) <= xent(coded) <= xent(exact) * 1.0005
    assert bits == pytest.approx(xent(freqs), rel=1e-12)   # coded_bits: the tables as sent
    assert np.array_equal(freqs, prob.freqs_from_codes(codes))


def test_version2_codebook_still_decodes(big):
    (L, T, C, nbk, nbv), sk, sv, _ = big
    sk, sv = sk[:, :, :100], sv[:, :, :100]      # K <= 256 as version 2 required
    C = 100
    enc = encode_symbols(sk, sv, nbk, nbv)
    cum, mi = prob.deserialize_models(enc.header, enc.arrays, nbk, nbv, L, C)
    assert all(K <= 256 for _, K, _, _ in enc.header["model_groups"])
    f = np.diff(cum.astype(np.int64), axis=1)
    groups = [[nb, K] for nb, K, _, _ in enc.header["model_groups"]]
    rows, off, base = [], 0, {}
    for nb, K in groups:
        rows.append(f[off:off + K, :nb].reshape(-1))
        base[nb] = off
        off += K
    local = mi.astype(np.int64).copy()
    for kv, nbs in enumerate((nbk, nbv)):
        for layer in range(L):
            local[kv, layer] -= base[nbs[layer]]
    v2 = {"ent_freqs": np.concatenate(rows).astype(np.uint16),
          "ent_model_index": local.astype(np.uint8),
          "ent_stream_lengths": enc.arrays["ent_stream_lengths"]}
    hdr = {**enc.header, "model_groups": groups}
    dk, dv = decode_symbols(hdr, v2, enc.payload, L, T, C, nbk, nbv)
    assert np.array_equal(dk, sk) and np.array_equal(dv, sv)
    with pytest.raises(CodecError):       # the two codebook formats never mix
        decode_symbols(hdr, {**v2, "ent_tables": enc.arrays["ent_tables"]}, enc.payload,
                       L, T, C, nbk, nbv)


def test_crafted_tables_raise_codec_error(big):
    (L, T, C, nbk, nbv), sk, sv, enc = big
    t, ix = enc.arrays["ent_tables"], enc.arrays["ent_model_index"]
    g = enc.header["model_groups"]
    bad = [
        ({}, {"ent_tables": t[:-1]}),                                  # truncated
        ({}, {"ent_tables": np.concatenate([t, np.zeros(1, np.uint8)])}),  # byte left over
        ({}, {"ent_tables": np.full(t.size, 0xFF, np.uint8)}),         # endless quotient
        ({}, {"ent_tables": np.zeros(0, np.uint8)}),
        ({}, {"ent_tables": t.astype(np.uint16)}),
        ({}, {"ent_model_index": ix[:-1]}),
        ({"model_groups": [[9, g[0][1], 16, g[0][3]], g[1]]}, {}),     # rice k out of range
        ({"model_groups": [[9, g[0][1], g[0][2], -1], g[1]]}, {}),
        ({"model_groups": [[9, 5000, g[0][2], g[0][3]], g[1]]}, {}),  # K over MAX_K
        ({"model_groups": [[9, g[0][1], g[0][2]], g[1]]}, {}),         # version-2 style
        ({"model_groups": [[9, g[0][1], True, g[0][3]], g[1]]}, {}),
        ({}, {"ent_model_index": np.concatenate([ix, np.zeros(1, np.uint8)])}),
        ({}, {"ent_model_index": np.full(ix.size, 0xFF, np.uint8)}),   # indices >= K
    ]
    for h, a in bad:
        with pytest.raises(CodecError):
            decode_symbols({**enc.header, **h}, {**enc.arrays, **a}, enc.payload, L, T, C, nbk, nbv)
    # non-zero padding bits of the index
    _, nbits = _spec_read_index(ix.tobytes(), g, nbk, nbv, C)
    if nbits % 8:
        ix2 = ix.copy()
        ix2[-1] |= 1
        with pytest.raises(CodecError, match="padding"):
            decode_symbols(enc.header, {**enc.arrays, "ent_model_index": ix2}, enc.payload,
                           L, T, C, nbk, nbv)
    # random byte flips: CodecError or a (CRC-detected elsewhere) wrong decode, never another error
    rng = np.random.default_rng(0)
    raised = 0
    for i in range(200):
        name = ("ent_tables", "ent_model_index")[i % 2]   # both start at bit 0: a flip early
        #                                                   in a code shifts all that follow
        a = enc.arrays[name].copy()
        a[rng.integers(0, a.size)] ^= rng.integers(1, 256)
        try:
            decode_symbols(enc.header, {**enc.arrays, name: a}, enc.payload, L, T, C, nbk, nbv)
        except CodecError:
            raised += 1
    assert raised >= 150


def test_rice_cost_is_the_serialised_size():
    rng = np.random.default_rng(1)
    for nb in (2, 7, 31, 127, 255):
        q = rng.integers(0, prob.TABLE_QMAX + 1, size=(5, nb))
        bits, k = prob.rice_cost(q)
        buf = np.zeros((bits + 7) // 8, np.uint8)
        end = prob._rice_write(prob._zigzag_deltas(q), k, buf, 0)
        assert end == bits
        out = np.empty(q.size, np.int64)
        assert prob._rice_read(buf, 0, q.size, nb, k, prob.TABLE_QMAX, out) == bits
        assert np.array_equal(out.reshape(q.shape), q)
