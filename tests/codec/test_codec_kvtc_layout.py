"""Tests of the kvtc column layouts (docs/bitstream.md 4.5): the "kept" layout
(format 2: only each (K/V, layer)'s kept columns are entropy-coded) written now, and the
older "padded" layout (format 1) still decoded bit-exactly from a fixture container.

Run: .venv/bin/python -m pytest tests/codec/test_codec_kvtc_layout.py -q
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import codec
from codec import CodecError, bitstream, kvtc
from tests.helpers.kvtc_padded import FIX, PADDED_FIXTURES, bits_digest



@pytest.mark.parametrize("level", sorted(PADDED_FIXTURES))
def test_padded_containers_decode_bit_exactly_and_match_the_kept_layout(exact, level):
    mod, cal = exact
    data = (FIX / f"kvtc_l{level}.kvcg").read_bytes()
    ch = bitstream.unpack(data)[0]["codec_header"]
    assert "layout" not in ch and ch["n_components"] == cal.torch_params(level)["n"]
    k, v = codec.decode_kv(data)
    assert bits_digest(k, v) == PADDED_FIXTURES[level]
    # the current writer codes the same KV in the kept layout: fewer symbols, the very
    # same decoded bits (the arithmetic is exact for this calibration, any BLAS)
    k0, v0 = mod.exact_kv()
    new = codec.encode_kv(k0, v0, codec="kvtc", level=level,
                          config=kvtc.KvtcConfig(calibration=cal))
    ch2 = bitstream.unpack(new)[0]["codec_header"]
    assert ch2["layout"] == "kept" and "n_components" not in ch2
    keep = cal.n_keep(level)
    assert ch2["n_kept"] == int(keep.sum()) < 2 * cal.num_layers * int(keep.max())
    assert ch2["offset_k"] == ch["offset_k"] and ch2["offset_v"] == ch["offset_v"]
    k2, v2 = codec.decode_kv(new)
    assert bits_digest(k2, v2) == PADDED_FIXTURES[level]
    assert len(new) < len(data)


def test_kept_symbols_straddle_and_pad(exact):
    # level 0 keeps K (10, 6, 16) + V (3, 12, 8) = 55 columns: odd (one pad column) and
    # K layer 2 straddles the two halves (columns 16..31 of 2 x 28)
    _, cal = exact
    P = cal.torch_params(0)
    keep = P["keep"]
    assert kvtc.kept.n_kept(keep) == 55
    rng = np.random.default_rng(3)
    L, T, n = cal.num_layers, 9, P["n"]
    offs = [[int(x) for x in rng.integers(1, 6, L)] for _ in range(2)]
    syms = []
    for kv in (0, 1):
        s = np.empty((L, T, n), np.uint8)
        for layer in range(L):
            o = offs[kv][layer]
            s[layer] = o                                     # dropped columns: q = 0
            nl = keep[kv][layer]
            s[layer, :, :nl] = rng.integers(0, 2 * o + 1, (T, nl))
        syms.append(s)
    a, b, nba, nbb = kvtc.kept.kept_halves(syms, keep, offs, T)
    assert a.shape == b.shape == (1, T, 28) and (b[0, :, -1] == 0).all()
    assert nba >= 2 * max(offs[0]) + 1 and nbb >= 2 * max(offs[1]) + 1
    assert a.max() < nba and b.max() < nbb
    ks = [kvtc.kept.KeptSymbols(a[0], b[0], keep, kv) for kv in (0, 1)]
    assert [len(ks[0].pieces(layer)) for layer in range(L)] == [1, 1, 2]
    assert [len(ks[1].pieces(layer)) for layer in range(L)] == [1, 1, 1]
    for kv in (0, 1):
        assert np.array_equal(ks[kv].padded(offs[kv], n), syms[kv])
        got = kvtc.inverse.inverse_layers(ks[kv], offs[kv], P, kv, (L, T, 2, 8), None, 0.0)
        ref = kvtc.inverse.inverse_layers(syms[kv], offs[kv], P, kv, (L, T, 2, 8), None, 0.0)
        assert torch.equal(got, ref)


def test_layout_header_errors_are_codec_errors(exact):
    mod, cal = exact
    k0, v0 = mod.exact_kv()
    data = codec.encode_kv(k0, v0, codec="kvtc", level=1,
                           config=kvtc.KvtcConfig(calibration=cal))
    h, arrays, payload = bitstream.unpack(data)
    ch = h["codec_header"]
    bad = [{**ch, "layout": "columns"}, {**ch, "layout": 2},
           {**ch, "n_kept": ch["n_kept"] + 1}, {**ch, "n_kept": -1},
           {k: x for k, x in ch.items() if k != "layout"},      # read as padded: no n
           {k: x for k, x in ch.items() if k != "n_kept"}]
    for c2 in bad:
        with pytest.raises(CodecError):
            codec.decode_kv(bitstream.pack({**h, "codec_header": c2}, arrays, payload))


def test_store_identity_carries_the_kvtc_format(exact, monkeypatch):
    _, cal = exact
    a = codec.config_hash("kvtc", 1, num_layers=cal.num_layers)
    assert kvtc.KvtcCodec().identity() == {"kvtc_format": kvtc.KVTC_FORMAT_VERSION}
    monkeypatch.setattr(kvtc.layout, "KVTC_FORMAT_VERSION", 1)
    assert codec.config_hash("kvtc", 1, num_layers=cal.num_layers) != a
    # cachegen's identity does not depend on it
    c1 = codec.config_hash("cachegen", 1)
    monkeypatch.setattr(kvtc.layout, "KVTC_FORMAT_VERSION", 2)
    assert codec.config_hash("cachegen", 1) == c1
