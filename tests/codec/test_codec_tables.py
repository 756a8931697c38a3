"""Compact model tables of the entropy stage (docs/bitstream.md 4.3, format version 4,
within 1% of the entropy): square-root table codes, Rice-coded over each table's nonzero range, a
bit-packed model index, the version-3 and version-2 codebooks still read, crafted tables
-> CodecError only.

Run: .venv/bin/python -m pytest -q tests/codec/test_codec_tables.py
"""
import numpy as np
import torch
import pytest

from codec.entropy import codebook as cb
from codec.entropy import codebook_codes as cc
from codec.entropy import models as prob
from codec.entropy import decode_symbols, encode_symbols
from codec.errors import CodecError
from tests.helpers.entropy import normalize_spec  # docs/bitstream.md 4.3, literally


def _laplace_syms(rng, L, T, C, nb, spread=(0.4, 3.0)):
    scale = rng.uniform(*spread, size=(L, 1, C))
    shift = rng.integers(-2, 3, size=(L, 1, C))
    x = np.round(rng.laplace(0, scale, (L, T, C)) + nb // 2 + shift)
    return np.clip(x, 0, nb - 1).astype(np.uint8)


def _spec_read_tables(buf: bytes, groups, codes=False):
    """docs/bitstream.md 4.3 (version 4), literally: MSB-first bits; per table lo and span
    in bit_length(nbins - 1) bits, then Rice(k) of the zigzag deltas of q[lo..lo+span]
    (0 before q[lo]), q = 0 elsewhere; f = normalize(q * q). Returns {nbins: [[f...], ...]}
    (or the codes q with codes=True)."""
    bits = "".join(f"{b:08b}" for b in buf)
    pos = 0
    out = {}
    for nb, K, k, _ in groups:
        w = max(1, (nb - 1).bit_length())
        tabs = []
        for _ in range(K):
            lo, span = int(bits[pos:pos + w], 2), int(bits[pos + w:pos + 2 * w], 2)
            pos += 2 * w
            prev, q = 0, [0] * nb
            for s in range(lo, lo + span + 1):
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
                q[s] = prev
            tabs.append(q if codes else normalize_spec([v * v for v in q]))
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
    cum, mi = cb.deserialize_models(enc.header, enc.arrays, nbk, nbv, L, C)
    spec = _spec_read_tables(enc.arrays["ent_codebook"].tobytes(), groups)
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
    assert enc.arrays["ent_codebook"].nbytes * 8 < 6 * n_entries    # < 6 bits per entry (was 16)
    # the range fields cost at most 2 * bit_length(nbins - 1) bits a table over the
    # version-3 layout (every code Rice-coded) ...
    groups = enc.header["model_groups"]
    v3_bits = sum(cc.rice_cost(np.array(q))[0] for q in
                  _spec_read_tables(enc.arrays["ent_codebook"].tobytes(), groups, codes=True).values())
    assert enc.arrays["ent_codebook"].nbytes * 8 <= v3_bits + sum(
        2 * K * (nb - 1).bit_length() for nb, K, _, _ in groups) + 7
    # ... and save the zero tails of peaked tables (KV's: most of a 127-symbol alphabet)
    x = np.arange(127) - 63
    p = np.exp(-np.abs(x[None, :] - np.arange(-8, 8)[:, None]) / np.linspace(1, 4, 16)[:, None])
    q = cc.table_codes(np.rint(p * 1e6).astype(np.int64))
    assert cc.ranged_cost(q)[0] < 0.7 * cc.rice_cost(q)[0]
    # square-root-domain codes cost < 0.05% against exact 16-bit tables of the same clusters
    hk = prob.histograms(sk)
    H = np.concatenate([hk[layer, :, :31] for layer in range(L)])
    codes, freqs, assign, bits, _ = prob._cluster_group(H, [64])
    assert codes.shape[0] == 64
    cent = np.zeros((64, 31), np.int64)
    np.add.at(cent, assign, H)
    coded = cc.freqs_from_codes(cc.table_codes(cent))
    exact = cc.normalize_freqs(cent)

    def xent(f):
        return float((H * (16 - np.log2(f[assign]))).sum())

    assert xent(exact) <= xent(coded) <= xent(exact) * 1.0005
    assert bits == pytest.approx(xent(freqs), rel=1e-12)   # coded_bits: the tables as sent
    assert np.array_equal(freqs, cc.freqs_from_codes(codes))


def test_version2_codebook_still_decodes(big):
    (L, T, C, nbk, nbv), sk, sv, _ = big
    sk, sv = sk[:, :, :100], sv[:, :, :100]      # K <= 256 as version 2 required
    C = 100
    enc = encode_symbols(sk, sv, nbk, nbv)
    cum, mi = cb.deserialize_models(enc.header, enc.arrays, nbk, nbv, L, C)
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
    with pytest.raises(CodecError):       # the codebook formats never mix
        decode_symbols(hdr, {**v2, "ent_codebook": enc.arrays["ent_codebook"]}, enc.payload,
                       L, T, C, nbk, nbv)


def _to_version3(enc):
    """The version-3 codebook of the same tables: every code Rice-coded (`ent_tables`)."""
    groups = enc.header["model_groups"]
    codes = _spec_read_tables(enc.arrays["ent_codebook"].tobytes(), groups, codes=True)
    parts, g3, total = [], [], 0
    for nb, K, _, ik in groups:
        q = np.array(codes[nb], np.int64)
        bits, k = cc.rice_cost(q)
        parts.append((cc._zigzag_deltas(q), k))
        g3.append([nb, K, k, ik])
        total += bits
    buf = np.zeros((total + 7) // 8, np.uint8)
    pos = 0
    for zz, k in parts:
        pos = cc._rice_write(np.ascontiguousarray(zz), k, buf, pos)
    arrays = {n: a for n, a in enc.arrays.items() if n != "ent_codebook"}
    return {**enc.header, "model_groups": g3}, {**arrays, "ent_tables": buf}


def test_version3_codebook_still_decodes(big):
    (L, T, C, nbk, nbv), sk, sv, enc = big
    hdr, arrays = _to_version3(enc)
    dk, dv = decode_symbols(hdr, arrays, enc.payload, L, T, C, nbk, nbv)
    assert np.array_equal(dk, sk) and np.array_equal(dv, sv)
    cum3, mi3 = cb.deserialize_models(hdr, arrays, nbk, nbv, L, C)
    cum4, mi4 = cb.deserialize_models(enc.header, enc.arrays, nbk, nbv, L, C)
    assert np.array_equal(cum3, cum4) and np.array_equal(mi3, mi4)
    with pytest.raises(CodecError, match="two format versions"):
        decode_symbols(hdr, {**arrays, "ent_codebook": enc.arrays["ent_codebook"]}, enc.payload,
                       L, T, C, nbk, nbv)


def test_crafted_tables_raise_codec_error(big):
    (L, T, C, nbk, nbv), sk, sv, enc = big
    t, ix = enc.arrays["ent_codebook"], enc.arrays["ent_model_index"]
    g = enc.header["model_groups"]
    bad = [
        ({}, {"ent_codebook": t[:-1]}),                                  # truncated
        ({}, {"ent_codebook": np.concatenate([t, np.zeros(1, np.uint8)])}),  # byte left over
        ({}, {"ent_codebook": np.full(t.size, 0xFF, np.uint8)}),         # endless quotient
        ({}, {"ent_codebook": np.zeros(0, np.uint8)}),
        ({}, {"ent_codebook": t.astype(np.uint16)}),
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
        name = ("ent_codebook", "ent_model_index")[i % 2]   # both start at bit 0: a flip early
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
        q = rng.integers(0, cc.TABLE_QMAX + 1, size=(5, nb))
        bits, k = cc.rice_cost(q)
        buf = np.zeros((bits + 7) // 8, np.uint8)
        end = cc._rice_write(cc._zigzag_deltas(q), k, buf, 0)
        assert end == bits
        out = np.empty(q.size, np.int64)
        assert cc.rice_read(buf, 0, q.size, nb, k, cc.TABLE_QMAX, out) == bits
        assert np.array_equal(out.reshape(q.shape), q)


def test_ranged_cost_is_the_serialised_size():
    rng = np.random.default_rng(2)
    for nb in (2, 7, 31, 127, 255):
        q = rng.integers(0, cc.TABLE_QMAX + 1, size=(6, nb))
        q[0] = 0                                  # an all-zero table: lo = span = 0
        q[1, :nb // 2] = 0                        # a zero head
        q[2, nb // 3:] = 0                        # a zero tail
        q[2, 0] = max(q[2, 0], 1)
        bits, k = cc.ranged_cost(q)
        w = max(1, (nb - 1).bit_length())
        buf = np.zeros((bits + 7) // 8, np.uint8)
        lo, span, zz = cc.ranged_deltas(q)
        assert cc.ranged_write(lo, span, zz, w, k, buf, 0) == bits
        out = np.zeros(q.shape, np.int64)
        assert cc.ranged_read(buf, 0, q.shape[0], nb, w, k, cc.TABLE_QMAX, out) == bits
        assert np.array_equal(out, q)
        groups = [[nb, q.shape[0], k, 0]]
        assert _spec_read_tables(buf.tobytes(), groups, codes=True)[nb] == q.tolist()
        # lo + span past the alphabet is refused
        bad = np.zeros((2 * w + 8 + 7) // 8 + 1, np.uint8)
        pos = cc._fixed_write(nb - 1, w, bad, 0)
        cc._fixed_write(1, w, bad, pos)
        assert cc.ranged_read(bad, 0, 1, nb, w, 0, cc.TABLE_QMAX, np.zeros((1, nb), np.int64)) == -1


# Containers written by the version-3 writer (codec version 3, git 52df50c), KV of
# tests/fixtures/codec_v3: seeded randn [2, 96, 2, 16] bf16; sha256 of the decoded K and V
# bits as that writer's decoder gave them.
V3_FIXTURES = {
    1: "c1c9b4cd3d5ea05b1a8c1c81db02c2dab45c07edeb31b072296ccdef695d603a",
    5: "a6e7b95938d1437654135c9c0fc9a409f448cb379bd8c3121c5e0dd1c019a9d4",
}


@pytest.mark.parametrize("level", sorted(V3_FIXTURES))
def test_version3_containers_decode_unchanged(level):
    import hashlib
    from pathlib import Path

    import codec
    from codec import bitstream

    data = (Path(__file__).parents[1] / "fixtures" / "codec_v3" / f"cachegen_l{level}.kvcg").read_bytes()
    assert data[4] == 3 and codec.peek_header(data)["codec_version"] == 3
    assert "ent_tables" in bitstream.unpack(data)[1] and "ent_codebook" not in bitstream.unpack(data)[1]
    k, v = codec.decode_kv(data)
    h = hashlib.sha256(k.view(torch.uint16).numpy().tobytes() + v.view(torch.uint16).numpy().tobytes())
    assert h.hexdigest() == V3_FIXTURES[level]
    # the current writer makes a version-6 container (version-4 content) of the same KV,
    # never a version-3 one
    again = codec.encode_kv(k, v, codec="cachegen", level=level)
    assert again[4] == 6 and "ent_codebook" in bitstream.unpack(again)[1]


def _normalize_by_stable_sort(c):
    """docs/bitstream.md 4.3's normalisation with a stable sort of the remainders."""
    c = np.asarray(c, np.int64)
    out = np.empty_like(c)
    m, nb = c.shape
    spare = 65536 - nb
    for i in range(m):
        row = c[i] if c[i].sum() else np.ones(nb, np.int64)
        num = row * spare
        q = num // row.sum()
        out[i] = 1 + q
        rem = num - q * row.sum()
        out[i, np.argsort(-rem, kind="stable")[:65536 - out[i].sum()]] += 1
    return out


def test_normalize_freqs_matches_a_stable_sort_of_remainders():
    """The allocation-free remainder selection gives the stable-sort result exactly
    (ties to the lower symbol, zero counts last), so older codebooks decode unchanged."""
    rng = np.random.default_rng(5)
    for trial in range(200):
        nb = int(rng.choice([2, 3, 9, 15, 63, 127, 256]))
        c = [rng.integers(0, 5, size=(8, nb)),                                       # many ties
             rng.integers(0, 3, size=(8, nb)) * rng.integers(1, 1000, size=(8, 1)),
             rng.integers(0, 2, size=(8, nb)) * 7,                                   # zero runs
             rng.integers(0, 256, size=(8, nb)) ** 2][trial % 4]
        c[0] = 0                                                                     # all zero
        assert np.array_equal(cc.normalize_freqs(c), _normalize_by_stable_sort(c))


@pytest.mark.parametrize("density", [0.03, 0.1, 0.4, 0.9])
def test_sparse_and_dense_seeding_choose_the_same_codebook(density, monkeypatch):
    # _cluster_group seeds with the CSR kernel below SPARSE_SEED_DENSITY nonzeros, else the
    # dense one: both sum each model's nonzero symbols in ascending order, so the seeds, the
    # codebook, the assignment and the coded bits are identical whichever runs
    rng = np.random.default_rng(int(density * 100))
    n, nb = 700, 120
    H = rng.poisson(rng.gamma(0.5, 30.0, size=(n, nb))) * (rng.random((n, nb)) < density)
    H[rng.integers(0, n, 5)] = 0               # all-zero models too
    H = H.astype(np.int64)
    out = {}
    for mode, thr in (("dense", 0.0), ("sparse", 2.0)):
        monkeypatch.setattr(prob, "SPARSE_SEED_DENSITY", thr)
        out[mode] = prob._cluster_group(H, [1, 16, 64, 256])
    (cd, fd, ad, bd, td), (cs, fs, as_, bs, ts) = out["dense"], out["sparse"]
    assert np.array_equal(cd, cs) and np.array_equal(fd, fs) and np.array_equal(ad, as_)
    assert bd == bs and td == ts and fd.shape[0] > 1
