"""Tests of kvtc's tail tiers (kvtc format 3, docs/bitstream.md 4.5, docs/codec.md 8.7):
the rows of a chunk among the last R1 (R1 + R2, ...) tokens of the context are coded at
finer levels B1 (B2, ...) in the same container, as spans named in the header.

The bit-exact checks use the hand-made calibration of tests/fixtures/kvtc_padded (every
float32 operation exact, so the decoded bits depend only on the format); the error
checks a calibration fitted on correlated random KV with pre-RoPE keys.
Run: .venv/bin/python -m pytest tests/codec/test_kvtc_tiers.py -q
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import codec
from codec import CodecError, bitstream, kvtc
from tests.helpers.kv import correlated_kv
# the decoded-bit digests of the level 0/1 containers of tests/fixtures/kvtc_padded (the
# fixture ``exact`` registers its calibration); the format-2 kvtc_kept containers decode
# to the same bits
from tests.helpers.kvtc_padded import PADDED_FIXTURES as FIXTURE_DIGESTS, bits_digest

FIX = Path(__file__).parents[1] / "fixtures"


@pytest.fixture(scope="module")
def fitted():
    """A pre-RoPE calibration of L=4, H=3, D=16 (the default model's KV heads) with levels
    0 (coarse), 1, 2 (fine)."""
    L, H, D, N = 4, 3, 16, 512
    c = kvtc.fit_calibration(correlated_kv(L, N, H, D, 1), correlated_kv(L, N, H, D, 2),
                             positions=torch.arange(N), rope_theta=10000.0,
                             level_targets={0: 0.6, 1: 1.0, 2: 2.5}, default_level=1)
    kvtc.register_calibration(c)
    yield c
    with kvtc.registry._LOCK:
        kvtc.registry._CALIBRATIONS.pop(c.hash, None)


def _spans(data):
    return [(s["start"], s["count"], s["level"])
            for s in bitstream.unpack(data)[0]["codec_header"].get("tiers", [])]


# ------------------------------------------------------------------- format 1 and 2
@pytest.mark.parametrize("folder", ["kvtc_padded", "kvtc_kept"])
@pytest.mark.parametrize("level", [0, 1])
def test_format_1_and_2_fixtures_decode_bit_for_bit(exact, folder, level):
    data = (FIX / folder / f"kvtc_l{level}.kvcg").read_bytes()
    ch = bitstream.unpack(data)[0]["codec_header"]
    assert "tiers" not in ch and ("layout" in ch) == (folder == "kvtc_kept")
    k, v = codec.decode_kv(data)
    assert bits_digest(k, v) == FIXTURE_DIGESTS[level]


def test_untiered_level_writes_format_2_fields(exact):
    mod, cal = exact
    k, v = mod.exact_kv()
    old = bitstream.unpack((FIX / "kvtc_kept" / "kvtc_l1.kvcg").read_bytes())[0]
    for tiers in (None, ()):
        new = codec.encode_kv(k, v, codec="kvtc", level=1,
                              config=kvtc.KvtcConfig(calibration=cal, tiers=tiers))
        h = bitstream.unpack(new)[0]
        # the same codec header (a coded size may move with the probability model's
        # clustering, the fields describing the symbols do not)
        strip = lambda ch: {a: b for a, b in ch.items() if a != "entropy"}  # noqa: E731
        assert strip(h["codec_header"]) == strip(old["codec_header"])
        assert bits_digest(*codec.decode_kv(new)) == FIXTURE_DIGESTS[1]


# ------------------------------------------------------------------------ round trips
def test_tail_rows_decode_at_their_level_bit_exactly(exact):
    mod, cal = exact
    T = 40
    k, v = mod.exact_kv(T)
    full = {lv: codec.decode_kv(codec.encode_kv(
        k, v, codec="kvtc", level=lv, config=kvtc.KvtcConfig(calibration=cal, tiers=())))
        for lv in (0, 1)}
    # level 1 base, the last 5 tokens at 0, the 7 before them at 0 too, as two spans
    data = codec.encode_kv(k, v, codec="kvtc", level=1,
                           config=kvtc.KvtcConfig(calibration=cal, tiers=((5, 0), (7, 0))))
    assert _spans(data) == [(28, 7, 0), (35, 5, 0)]
    assert bitstream.unpack(data)[0]["codec_header"]["config"]["tiers"] == [[5, 0], [7, 0]]
    k2, v2 = codec.decode_kv(data)
    for got, kv in ((k2, 0), (v2, 1)):
        assert torch.equal(got[:, :28], full[1][kv][:, :28])      # sinks + base rows
        assert torch.equal(got[:, 28:], full[0][kv][:, 28:])      # tail rows at level 0


@pytest.mark.parametrize("chunk", [16, 32])
def test_chunks_with_a_boundary_inside_the_tail(exact, chunk):
    mod, cal = exact
    k, v = mod.exact_kv(40)
    cfg = kvtc.KvtcConfig(calibration=cal, level=1, tiers=((5, 0), (9, 0)))
    one = codec.decode_kv(codec.encode_kv(k, v, codec="kvtc", config=cfg))
    chunks = codec.encode_chunks(k, v, codec="kvtc", config=cfg, chunk_tokens=chunk)
    spans = [_spans(c) for c in chunks]
    if chunk == 16:    # chunks [0,16) [16,32) [32,40): the tail [26, 40) straddles 32
        assert spans == [[], [(26, 6, 0)], [(32, 3, 0), (35, 5, 0)]]
    k2, v2 = codec.decode_chunks(chunks)
    assert torch.equal(k2, one[0]) and torch.equal(v2, one[1])


def test_context_shorter_than_the_tail(exact):
    mod, cal = exact
    k, v = mod.exact_kv(10)                   # 2 sinks, then 8 rows: all in the tail
    cfg = kvtc.KvtcConfig(calibration=cal, level=1, tiers=((6, 0), (64, 0)))
    data = codec.encode_kv(k, v, codec="kvtc", config=cfg)
    assert _spans(data) == [(2, 2, 0), (4, 6, 0)]
    ref = codec.decode_kv(codec.encode_kv(k, v, codec="kvtc", level=0,
                                          config=kvtc.KvtcConfig(calibration=cal)))
    k2, v2 = codec.decode_kv(data)
    assert torch.equal(k2, ref[0]) and torch.equal(v2, ref[1])
    for T in (1, 2, 3):                       # T = 1, only sinks, one coded row
        kk, vv = mod.exact_kv(T)
        d = codec.encode_kv(kk, vv, codec="kvtc", config=cfg)
        k3, v3 = codec.decode_kv(d)
        assert k3.shape == kk.shape and torch.equal(k3[:, :min(T, 2)], kk[:, :min(T, 2)])
    # exact recent tokens win over the tail: the spans stop before them
    d = codec.encode_kv(k, v, codec="kvtc",
                        config=kvtc.KvtcConfig(calibration=cal, level=1, recent_tokens=3,
                                               tiers=((6, 0),)))
    assert _spans(d) == [(4, 3, 0)]
    k4, _ = codec.decode_kv(d)
    assert torch.equal(k4[:, 7:], k[:, 7:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_fitted_tail_error_smaller(fitted, dtype):
    L, H, D = fitted.num_layers, fitted.num_heads, fitted.head_dim
    T, R = 300, 64
    k = correlated_kv(L, T, H, D, 11).to(dtype)
    v = correlated_kv(L, T, H, D, 12).to(dtype)
    cfg = kvtc.KvtcConfig(calibration=fitted, level=0, tiers=((R, 2),))
    data = codec.encode_kv(k, v, codec="kvtc", config=cfg)
    assert _spans(data) == [(T - R, R, 2)]
    k2, v2 = codec.decode_kv(data)
    assert k2.dtype == dtype and k2.shape == k.shape
    plain = codec.encode_kv(k, v, codec="kvtc", level=0,
                            config=kvtc.KvtcConfig(calibration=fitted, tiers=()))
    fine = codec.encode_kv(k, v, codec="kvtc", level=2,
                           config=kvtc.KvtcConfig(calibration=fitted, tiers=()))
    assert len(plain) < len(data) < len(fine)
    kp, _ = codec.decode_kv(plain)
    kf, _ = codec.decode_kv(fine)
    for got, x in ((k2, k), (v2, v)):
        err = ((got.float() - x.float()) ** 2).mean(dim=(0, 2, 3))       # per token
        base, tail = err[4:T - R].mean(), err[T - R:].mean()
        assert tail < 0.5 * base
    # the tail rows match a level-2 encode, the base rows a level-0 one (RoPE at the
    # rows' true positions); float32 rounding of the per-span offsets only
    assert torch.allclose(k2[:, T - R:].float(), kf[:, T - R:].float(), rtol=0, atol=0.05)
    assert torch.allclose(k2[:, :T - R].float(), kp[:, :T - R].float(), rtol=0, atol=0.05)


def test_stats_count_every_span(fitted):
    L, H, D = fitted.num_layers, fitted.num_heads, fitted.head_dim
    k = correlated_kv(L, 100, H, D, 21).bfloat16()
    v = correlated_kv(L, 100, H, D, 22).bfloat16()
    data, st = codec.encode_with_stats(
        k, v, codec="kvtc", config=kvtc.KvtcConfig(calibration=fitted, level=0,
                                                   tiers=((16, 2), (16, 1))))
    assert st["tail_tokens"] == 32 and st["bytes"] == len(data)
    keep = [int(fitted.n_keep(lv).sum()) for lv in (0, 1, 2)]
    # kept columns (rounded up to even) x rows, per span
    assert st["symbols"] == sum(((s + 1) // 2 * 2) * n
                                for s, n in ((keep[0], 100 - 4 - 32), (keep[1], 16),
                                             (keep[2], 16)))


# ------------------------------------------------------------------ bad input / errors
def test_bad_tiers_are_value_errors(exact):
    mod, cal = exact
    k, v = mod.exact_kv(20)
    for bad in (((0, 0),), ((5, 9),), ((5,),), "x", ((5.0, 0),), ((True, 0),),
                tuple((1, 0) for _ in range(kvtc.MAX_TIERS + 1))):
        with pytest.raises(ValueError):
            codec.encode_kv(k, v, codec="kvtc", level=1,
                            config=kvtc.KvtcConfig(calibration=cal, tiers=bad))


def _span_mutations(data):
    h, arrays, payload = bitstream.unpack(data)
    ch = h["codec_header"]
    sp = ch["tiers"]

    def with_spans(s2):
        return bitstream.pack({**h, "codec_header": {**ch, "tiers": s2}}, arrays, payload)

    for key, vals in (("start", [-1, 0, sp[0]["start"] + 1, 10 ** 9, "3", None, True]),
                      ("count", [0, -2, sp[0]["count"] + 1, 10 ** 9, 1.5]),
                      ("level", [7, -1, True, None, "0"]),
                      ("payload_bytes", [-1, len(payload) + 1, 10 ** 12, None]),
                      ("n_kept", [0, -1, 10 ** 6]), ("offset_k", [[0], "x", [999] * 3]),
                      ("entropy", [None, {}, {"coder": "x"}]), ("layout", [None, "x"])):
        for val in vals:
            s2 = [dict(s) for s in sp]
            s2[0][key] = val
            yield with_spans(s2)
            s3 = [dict(s) for s in sp]
            s3[0].pop(key)
            yield with_spans(s3)
    yield with_spans(sp[::-1])                                     # out of order
    yield with_spans(sp[:1])                                       # one dropped
    yield with_spans(sp[1:])
    yield with_spans([])
    yield with_spans(sp + [dict(sp[-1])])
    yield with_spans("x")
    yield with_spans([1, 2])
    yield with_spans([dict(sp[0])] * (kvtc.MAX_TIERS + 1))
    ch2 = {a: b for a, b in ch.items() if a != "tiers"}            # read as format 2
    yield bitstream.pack({**h, "codec_header": ch2}, arrays, payload)
    yield bitstream.pack(h, {n: a for n, a in arrays.items() if not n.startswith("ent_t1_")},
                         payload)
    a2 = dict(arrays)
    a2["ent_t0_codebook"], a2["ent_t1_codebook"] = arrays["ent_t1_codebook"], \
        arrays["ent_t0_codebook"]
    yield bitstream.pack(h, a2, payload)
    yield bitstream.pack(h, arrays, payload[:-3])
    yield bitstream.pack(h, arrays, payload + b"\0\0\0")
    rng = np.random.default_rng(16)
    for _ in range(100):                                           # byte flips
        b = bytearray(data)
        for i in rng.integers(0, len(b), size=rng.integers(1, 4)):
            b[i] ^= int(rng.integers(1, 256))
        yield bytes(b)


def test_fuzzed_span_fields_give_codec_error_only(fitted):
    L, H, D = fitted.num_layers, fitted.num_heads, fitted.head_dim
    k = correlated_kv(L, 80, H, D, 31).bfloat16()
    v = correlated_kv(L, 80, H, D, 32).bfloat16()
    data = codec.encode_kv(k, v, codec="kvtc", config=kvtc.KvtcConfig(
        calibration=fitted, level=0, tiers=((10, 2), (20, 1))))
    assert len(_spans(data)) == 2
    ok = 0
    for bad in _span_mutations(data):
        try:
            k2, v2 = codec.decode_kv(bad)
        except CodecError:
            continue
        assert k2.shape == k.shape and bool(torch.isfinite(k2.float()).all())
        ok += 1
    assert ok < 10


# ----------------------------------------------------------------------- store identity
def test_identity_and_config_hash_follow_the_tier_table(monkeypatch):
    c = kvtc.KvtcCodec()
    monkeypatch.setattr(kvtc.calibration, "DEFAULT_LEVEL_TIERS", {})
    monkeypatch.setattr(kvtc.calibration, "DEFAULT_LEVEL_SINKS", {})
    plain = {lv: codec.config_hash("kvtc", lv) for lv in c.levels}
    assert all(c.identity(level=lv) == {"kvtc_format": kvtc.KVTC_FORMAT_VERSION}
               for lv in c.levels)
    monkeypatch.setattr(kvtc.calibration, "DEFAULT_LEVEL_TIERS", {2: ((128, 5), (384, 4))})
    assert c.identity(level=2) == {"kvtc_format": 3, "tiers": [[128, 5], [384, 4]]}
    assert codec.config_hash("kvtc", 2) != plain[2]
    assert all(codec.config_hash("kvtc", lv) == plain[lv] for lv in c.levels if lv != 2)
    monkeypatch.setattr(kvtc.calibration, "DEFAULT_LEVEL_TIERS", {2: ((128, 5), (384, 3))})
    assert codec.config_hash("kvtc", 2) not in (plain[2],)
    # an explicit config: tiers=() is the untiered level, other tiers another hash
    h0 = codec.config_hash("kvtc", 2, kvtc.KvtcConfig(level=2, tiers=()))
    h1 = codec.config_hash("kvtc", 2, kvtc.KvtcConfig(level=2, tiers=((64, 5),)))
    h2 = codec.config_hash("kvtc", 2, kvtc.KvtcConfig(level=2))
    assert len({h0, h1, h2}) == 3
    # configs without tiers hash as before the field existed
    assert "tiers" not in kvtc.KvtcConfig(level=2).to_dict()
    # a level's own sink count is part of its identity too
    monkeypatch.setattr(kvtc.calibration, "DEFAULT_LEVEL_SINKS", {2: 1})
    assert c.identity(level=2)["sink_tokens"] == 1
    assert codec.config_hash("kvtc", 2) not in (plain[2],)


def test_level_sinks_apply_unless_the_config_says(exact, monkeypatch):
    mod, cal = exact                    # calibration sink_tokens = 2
    k, v = mod.exact_kv(20)
    monkeypatch.setattr(kvtc.calibration, "DEFAULT_LEVEL_SINKS", {1: 1})
    for lv, cfg_sinks, want in ((1, None, 1), (1, 3, 3), (0, None, 2)):
        d = codec.encode_kv(k, v, codec="kvtc", level=lv, config=kvtc.KvtcConfig(
            calibration=cal, sink_tokens=cfg_sinks, tiers=()))
        ch = bitstream.unpack(d)[0]["codec_header"]
        assert ch["n_sink"] == want and ch["config"]["sink_tokens"] == want
        k2, _ = codec.decode_kv(d)
        assert torch.equal(k2[:, :want], k[:, :want])


def test_key_water_changes_only_the_named_levels():
    L, H, D, N = 3, 2, 8, 384
    k, v = correlated_kv(L, N, H, D, 1), correlated_kv(L, N, H, D, 2)
    tg = {0: 0.8, 1: 0.8, 2: 2.0}
    a = kvtc.fit_calibration(k, v, level_targets=tg, default_level=1)
    b = kvtc.fit_calibration(k, v, level_targets=tg, default_level=1, key_water={1: 2.0})
    assert np.array_equal(a.step[0], b.step[0]) and np.array_equal(a.step[2], b.step[2])
    assert np.array_equal(a.step[0], a.step[1]) and not np.array_equal(b.step[1], a.step[1])
    # same rate: keys coarser (fewer kept, larger steps), values finer
    assert b.n_keep(1)[0].sum() <= a.n_keep(1)[0].sum()
    assert b.n_keep(1)[1].sum() >= a.n_keep(1)[1].sum()
    assert b.meta["key_water"] == {"1": 2.0} and "key_water" not in a.meta
    with pytest.raises(ValueError):
        kvtc.fit_calibration(k, v, level_targets=tg, default_level=1, key_water={7: 2.0})
    with pytest.raises(ValueError):
        kvtc.fit_calibration(k, v, level_targets=tg, default_level=1, key_water={1: 0})


def test_shipped_tier_table_is_valid():
    c = kvtc.KvtcCodec()
    for lv, tiers in kvtc.DEFAULT_LEVEL_TIERS.items():
        assert lv in c.levels and kvtc.check_tiers(tiers) == tuple(tiers)
        assert all(b in c.levels and b > lv for _, b in tiers)
        assert c.identity(level=lv)["kvtc_format"] == kvtc.KVTC_TIERED_FORMAT
    for lv in c.levels:
        if lv not in kvtc.DEFAULT_LEVEL_TIERS and lv not in kvtc.DEFAULT_LEVEL_SINKS:
            assert c.identity(level=lv) == {"kvtc_format": kvtc.KVTC_FORMAT_VERSION}
    assert set(kvtc.DEFAULT_KEY_WATER) <= set(kvtc.DEFAULT_LEVEL_TARGETS)
    # the default (level 4) and the near-lossless level 5 stay format 2
    assert c.identity(level=4) == c.identity(level=5) == {"kvtc_format": 2}
