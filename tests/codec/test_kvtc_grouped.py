"""Tests of kvtc's joint transform over layer groups (kvtc format 4, layout "grouped";
codec/kvtc/ ``fit_calibration(group_layers=)``, docs/codec.md 8.8).

Calibrations are fitted on small random KV made here, whose K and V share a hidden
signal across layers (as the residual stream does). Run:
.venv/bin/python -m pytest tests/codec/test_kvtc_grouped.py -q
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import codec
from codec import bitstream, kvtc
from codec.errors import CodecError
from tests.helpers.kv import low_rank_kv
from tests.helpers.kvtc import relerr, round_trip_levels

TARGETS = {0: 0.55, 1: 0.7, 2: 0.85, 3: 0.95, 4: 1.1, 5: 1.85}


def _fit(L=4, H=2, D=8, N=512, G=2, rope=True, **kw):
    k, v = low_rank_kv(L, N, H, D, 1)
    if rope:
        kw.update(positions=torch.arange(N), rope_theta=10000.0)
        k = kvtc.apply_rope(k, torch.arange(N), 10000.0)
    kw.setdefault("level_targets", TARGETS)
    return kvtc.fit_calibration(k, v, group_layers=G, **kw)


@pytest.fixture(scope="module")
def gcal():
    c = _fit()
    kvtc.register_calibration(c)
    return c


def _kv(L, T, H, D, seed, rope=True, start=0):
    k, v = low_rank_kv(L, T, H, D, seed)
    if rope:
        k = kvtc.apply_rope(k, torch.arange(start, start + T), 10000.0)
    return k, v


def test_grouped_tensors_and_biorthogonal_bases(gcal):
    L, C, G = gcal.num_layers, gcal.C, gcal.group_layers
    assert gcal.num_groups == 2 and list(gcal.group_layer_ids(1)) == [2, 3]
    Cg = 2 * G * C
    assert gcal.basis.shape == (2, Cg, Cg) and gcal.analysis.shape == (2, Cg, Cg)
    assert gcal.mean.shape == (2, Cg) and gcal.step.shape == (len(gcal.levels), 2, Cg)
    for g in range(gcal.num_groups):
        # synthesis^T analysis = I: decode inverts encode on the kept components
        prod = gcal.basis[g].astype(np.float64).T @ gcal.analysis[g].astype(np.float64)
        assert np.allclose(prod, np.eye(Cg), atol=2e-3)
        assert np.all(np.diff(gcal.var[g]) <= 1e-6 * gcal.var[g, 0])
    # kept components: a prefix, more at higher levels
    prev = None
    for i, lv in enumerate(gcal.levels):
        keep = gcal.n_keep(lv)
        assert keep.shape == (gcal.num_groups,)
        for g, n in enumerate(keep):
            assert (gcal.step[i, g, :n] > 0).all() and (gcal.step[i, g, n:] == 0).all()
        if prev is not None:
            assert (keep >= prev).all()
        prev = keep


def test_grouped_beats_per_layer_bases_on_shared_signal():
    # same samples, same rate targets: the joint basis sees what K, V and layers share
    k, v = _kv(4, 160, 2, 8, 9)
    errs = {}
    for G in (0, 2):
        c = _fit(G=G) if G else _fit(G=0)
        cfg = kvtc.KvtcConfig(calibration=c, tiers=())
        data = codec.encode_kv(k.bfloat16(), v.bfloat16(), codec="kvtc", level=2, config=cfg)
        k2, v2 = codec.decode_kv(data)
        errs[G] = (len(data), relerr(k2[:, 4:], k[:, 4:]) + relerr(v2[:, 4:], v[:, 4:]))
    assert errs[2][1] < 0.5 * errs[0][1]
    assert errs[2][0] <= 1.1 * errs[0][0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_grouped_round_trip(gcal, dtype):
    k, v = _kv(4, 150, 2, 8, 11)
    k, v = k.to(dtype), v.to(dtype)
    datas, errs = round_trip_levels(gcal, k, v, kvtc.KvtcConfig(calibration=gcal, tiers=()))
    for data in datas:
        h = bitstream.peek_header(data)["codec_header"]
        assert h["layout"] == "grouped" and len(h["offsets"]) == 2
    assert errs[-1] < errs[0] and errs[-1] < 0.02


def test_grouped_decode_matches_float64_reference(gcal):
    # decode (bf16 or float32 products, RoPE kernels, split into K/V per layer) against a
    # textbook float64 inverse of the same symbols
    k, v = _kv(4, 40, 2, 8, 13)
    lv = gcal.levels[-1]
    cfg = kvtc.KvtcConfig(calibration=gcal, tiers=(), sink_tokens=0)
    data = codec.encode_kv(k, v, codec="kvtc", level=lv, config=cfg)
    k2, v2 = codec.decode_kv(data)
    hdr = bitstream.peek_header(data)["codec_header"]
    P = gcal.torch_params(lv)
    X = kvtc.layout._group_features(k, v, gcal, 0).double()
    coef = torch.bmm(X - P["mean"].double(), P["basis"].double()) / P["step"].double()
    q = torch.round(coef)
    assert [int(x) for x in q.abs().amax(dim=(1, 2))] == hdr["offsets"]
    xr = torch.bmm(q * P["step"].double(), P["basis_ts"].double() /
                   P["step"].double().transpose(1, 2)) + P["mean"].double()
    L, C = 4, 16
    for g in range(2):
        for j, layer in enumerate(gcal.group_layer_ids(g)):
            kr = xr[g, :, 2 * j * C:(2 * j + 1) * C].reshape(40, 2, 8)
            kr = kvtc.apply_rope(kr[None].float(), torch.arange(0, 40), 10000.0)[0]
            vr = xr[g, :, (2 * j + 1) * C:(2 * j + 2) * C].reshape(40, 2, 8)
            assert torch.allclose(k2[layer], kr, atol=1e-3, rtol=1e-4)
            assert torch.allclose(v2[layer].double(), vr, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_grouped_decode_independent_of_threads(gcal, workers, monkeypatch):
    k, v = _kv(4, 64, 2, 8, 17)
    data = codec.encode_kv(k.bfloat16(), v.bfloat16(), codec="kvtc", level=3,
                           config=kvtc.KvtcConfig(calibration=gcal, tiers=()))
    ref = codec.decode_kv(data)
    monkeypatch.setattr(kvtc.workers, "_decode_workers", lambda: workers)
    got = codec.decode_kv(data)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])


def test_grouped_float32_path_agrees_with_bf16_path(gcal, monkeypatch):
    k, v = _kv(4, 64, 2, 8, 19)
    data = codec.encode_kv(k.bfloat16(), v.bfloat16(), codec="kvtc", level=4,
                           config=kvtc.KvtcConfig(calibration=gcal, tiers=()))
    a = codec.decode_kv(data)
    monkeypatch.setattr(kvtc.workers, "_BF16_GEMM", not kvtc.workers.bf16_gemm())
    gcal._torch.clear()
    b = codec.decode_kv(data)
    for x, y in zip(a, b):
        scale = float(y.float().abs().max())
        assert float((x.float() - y.float()).abs().max()) <= 0.02 * scale


def test_grouped_28_layers_5_heads_head_dim_80_ragged_last_group():
    L, H, D = 28, 5, 80                       # 28 = 9 groups of 3 + one of 1
    c = _fit(L=L, H=H, D=D, N=300, G=3)
    assert c.num_groups == 10 and list(c.group_layer_ids(9)) == [27]
    # the padded features of the short group are never kept
    pad = slice(2 * 1 * H * D, 2 * 3 * H * D)
    assert np.all(c.basis[9, pad] == 0) and np.all(c.var[9, 2 * H * D:] == 0)
    k, v = _kv(L, 70, H, D, 23)
    for lv in (0, 5):
        data = codec.encode_kv(k.bfloat16(), v.bfloat16(), codec="kvtc", level=lv,
                               config=kvtc.KvtcConfig(calibration=c, tiers=()))
        k2, v2 = codec.decode_kv(data)
        assert k2.shape == (L, 70, H, D) and relerr(v2, v) < 0.5 and relerr(k2, k) < 0.5
        assert relerr(v2[27], v[27]) < 0.5


def test_grouped_T1_short_context_recent_and_chunks(gcal):
    for T in (1, 3, 5, 12):
        k, v = _kv(4, T, 2, 8, 30 + T)
        k, v = k.bfloat16(), v.bfloat16()
        cfg = kvtc.KvtcConfig(calibration=gcal, recent_tokens=64)
        k2, v2 = codec.decode_kv(codec.encode_kv(k, v, codec="kvtc", config=cfg))
        assert torch.equal(k2, k) and torch.equal(v2, v)
        cfg = kvtc.KvtcConfig(calibration=gcal, sink_tokens=0)
        k2, v2 = codec.decode_kv(codec.encode_kv(k, v, codec="kvtc", config=cfg))
        assert k2.shape == k.shape and relerr(k2, k) < 0.5
    k, v = _kv(4, 100, 2, 8, 21)
    k, v = k.bfloat16(), v.bfloat16()
    cfg = kvtc.KvtcConfig(calibration=gcal, recent_tokens=20)
    chunks = codec.encode_chunks(k, v, codec="kvtc", level=5, config=cfg, chunk_tokens=32)
    k2, v2 = codec.decode_chunks(chunks)
    assert torch.equal(k2[:, -20:], k[:, -20:]) and torch.equal(k2[:, :4], k[:, :4])
    assert relerr(k2[:, 4:80], k[:, 4:80]) < 0.02


def test_grouped_with_tail_tiers(gcal):
    k, v = _kv(4, 96, 2, 8, 41)
    k, v = k.bfloat16(), v.bfloat16()
    cfg = kvtc.KvtcConfig(calibration=gcal, tiers=((16, 5), (24, 3)))
    chunks = codec.encode_chunks(k, v, codec="kvtc", level=0, config=cfg, chunk_tokens=48)
    spans = [bitstream.peek_header(c)["codec_header"].get("tiers") for c in chunks]
    assert spans[0] is None and [(s["start"], s["count"], s["level"]) for s in spans[1]] \
        == [(56, 24, 3), (80, 16, 5)]
    assert all(s["layout"] == "grouped" for s in spans[1])
    k2, v2 = codec.decode_chunks(chunks)
    plain = codec.decode_kv(codec.encode_kv(k, v, codec="kvtc", level=0, config=kvtc.KvtcConfig(
        calibration=gcal, tiers=())))
    assert relerr(v2[:, 80:], v[:, 80:]) < relerr(plain[1][:, 80:], v[:, 80:])


def test_grouped_calibration_save_load_hash(gcal, tmp_path):
    p = gcal.save(tmp_path)
    c2 = kvtc.load_calibration(p)
    assert c2.hash == gcal.hash and c2.group_layers == 2
    assert np.array_equal(c2.basis, gcal.basis)
    # group_layers is part of the hashed identity
    c3 = kvtc.KvtcCalibration(**{f: getattr(gcal, f) for f in (
        "num_layers", "num_heads", "head_dim", "mean", "basis", "var", "step", "levels",
        "targets", "default_level", "key_space", "rope_theta", "per_head", "sink_tokens",
        "recent_tokens", "meta", "shrink", "rounding", "analysis")}, group_layers=4)
    assert c3.content_hash() != gcal.hash
    # shapes that do not match the grouping are refused
    with pytest.raises(CodecError, match="shape"):
        kvtc.calibration.check_calibration(c3, "test")


def _repack(data, **fields):
    h, arrays, payload = bitstream.unpack(data)
    ch = dict(h["codec_header"])
    for name, val in fields.items():
        if name == "calibration":
            ch["config"] = {**ch["config"], "calibration": val}
        elif val is None:
            ch.pop(name, None)
        else:
            ch[name] = val
    return bitstream.pack({**h, "codec_header": ch}, arrays, payload)


def test_grouped_layout_and_calibration_must_agree(gcal):
    k, v = _kv(4, 20, 2, 8, 51)
    flat = _fit(G=0)
    kvtc.register_calibration(flat)
    d_flat = codec.encode_kv(k, v, codec="kvtc", config=kvtc.KvtcConfig(calibration=flat))
    d_grp = codec.encode_kv(k, v, codec="kvtc", config=kvtc.KvtcConfig(calibration=gcal))
    # a grouped chunk naming a per-layer calibration (and the reverse) is refused
    for data, other in ((d_grp, flat), (d_flat, gcal)):
        with pytest.raises(CodecError):
            codec.decode_kv(_repack(data, calibration=other.hash))
    # a grouped calibration with a "kept" layout header, or none
    for layout in ("kept", None):
        with pytest.raises(CodecError, match="layout"):
            codec.decode_kv(_repack(d_grp, layout=layout))


def test_grouped_header_fuzz_gives_codec_error_only(gcal):
    k, v = _kv(4, 24, 2, 8, 61)
    data = codec.encode_kv(k.bfloat16(), v.bfloat16(), codec="kvtc", level=2,
                           config=kvtc.KvtcConfig(calibration=gcal, tiers=()))
    ch = bitstream.unpack(data)[0]["codec_header"]
    bad = [{"offsets": None}, {"offsets": [1]}, {"offsets": [1, 2, 3]},
           {"offsets": [-1, 2]}, {"offsets": [200, 2]}, {"offsets": [True, 2]},
           {"offsets": "x"}, {"n_kept": ch["n_kept"] + 1}, {"n_kept": -1},
           {"n_kept": None}, {"entropy": None}, {"entropy": 3}, {"layout": "padded"}]
    rng = random.Random(7)
    for _ in range(60):                # random values in random fields
        key = rng.choice(["offsets", "n_kept", "layout", "entropy", "n_sink", "token_offset"])
        bad.append({key: rng.choice([None, -5, 0, 1, 10 ** 9, "a", [0] * rng.randint(0, 4),
                                     {"x": 1}, 2.5])})
    for fields in bad:
        try:
            k2, v2 = codec.decode_kv(_repack(data, **fields))
        except CodecError:
            continue
        assert k2.shape == k.shape      # a harmless change (e.g. an offset still valid)
    # a truncated payload
    h, arrays, payload = bitstream.unpack(data)
    with pytest.raises(CodecError):
        codec.decode_kv(bitstream.pack(h, arrays, payload[:len(payload) // 2]))


def test_grouped_fit_option_checks():
    k, v = low_rank_kv(3, 64, 2, 8, 1)
    for kw in ({"group_layers": 4}, {"group_layers": -1}, {"group_layers": True},
               {"group_layers": 2, "per_head": True}, {"group_layers": 2, "centroid": True},
               {"group_layers": 2, "key_water": {4: 2.0}}):
        with pytest.raises(ValueError):
            kvtc.fit_calibration(k, v, **kw)


@pytest.mark.parametrize("argv", [["--group-layers", "-1"],
                                  ["--group-layers", "2", "--per-head"],
                                  ["--group-layers", "2", "--metric", "weights"],
                                  ["--group-layers", "2", "--centroid"]])
def test_calibrate_cli_refuses_bad_grouping_before_loading(argv, capsys, monkeypatch):
    from kv_extraction_hf import calibrate, model

    def no_load(*a, **k):
        raise AssertionError("the model must not be loaded for a bad flag")

    monkeypatch.setattr(model, "load_model", no_load)
    assert calibrate.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --")
    assert "--group-layers" in err[0]


def test_default_settings_are_grouped():
    from kv_extraction_hf.calibrate import DEFAULT_SETTINGS

    assert DEFAULT_SETTINGS["group_layers"] == 2 and DEFAULT_SETTINGS["metric"] == "whitened"
    assert kvtc.DEFAULT_LEVEL_TIERS == {} and kvtc.DEFAULT_KEY_WATER == {}
    t = kvtc.DEFAULT_LEVEL_TARGETS
    assert [t[lv] for lv in sorted(t)] == sorted(t.values())    # more bits at higher levels


def test_encode_names_its_calibration_and_decode_finds_it_by_hash(tmp_path, monkeypatch):
    # an encode is given its calibration (object, path or hash); nothing in the
    # registry or the cache folder (a default index, a newer artifact of the same shape) is
    # ever picked for it. A decode finds the calibration by the hash its chunk names:
    # registry first, then <cache>/kvtc/<hash>.safetensors.
    import os
    import time

    monkeypatch.setenv("CACHEGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(kvtc.registry, "_CALIBRATIONS", {})
    folder = tmp_path / "kvtc"
    dflt = _fit(G=2, meta={"which": "default"})
    mine = _fit(G=0, meta={"which": "mine"})
    folder.mkdir(parents=True)
    p_d = dflt.save(folder)
    (folder / "default-abc.json").write_text('{"hash": "%s"}' % dflt.hash)
    time.sleep(0.01)
    p_m = mine.save(folder)
    os.utime(p_m, (time.time() + 10, time.time() + 10))       # clearly the newest file
    k, v = _kv(4, 12, 2, 8, 71)
    with pytest.raises(ValueError, match="needs its calibration"):
        codec.encode_kv(k, v, codec="kvtc")
    kvtc.register_calibration(mine)                 # registered: still no implicit choice
    with pytest.raises(ValueError, match="needs its calibration"):
        codec.encode_kv(k, v, codec="kvtc")
    monkeypatch.setattr(kvtc.registry, "_CALIBRATIONS", {})
    # the same bytes whether the calibration is given as the object, its hash (found in
    # the cache folder) or its artifact path
    by_hash = codec.encode_kv(k, v, codec="kvtc", config=kvtc.KvtcConfig(calibration=dflt.hash))
    assert codec.peek_header(by_hash)["config"]["calibration"] == dflt.hash
    monkeypatch.setattr(kvtc.registry, "_CALIBRATIONS", {})
    by_obj = codec.encode_kv(k, v, codec="kvtc", config=kvtc.KvtcConfig(calibration=dflt))
    by_path = codec.encode_kv(k, v, codec="kvtc", config=kvtc.KvtcConfig(calibration=p_d))
    assert by_obj == by_hash == by_path
    other = codec.encode_kv(k, v, codec="kvtc", config=kvtc.KvtcConfig(calibration=mine))
    assert codec.peek_header(other)["config"]["calibration"] == mine.hash
    # decode: by the hash the chunk names, from the cache folder when not registered
    monkeypatch.setattr(kvtc.registry, "_CALIBRATIONS", {})
    for data, cal in ((by_hash, dflt), (other, mine)):
        k2, _ = codec.decode_kv(data)
        assert k2.shape == k.shape
        assert cal.hash in kvtc.registered_calibrations()
    monkeypatch.setattr(kvtc.registry, "_CALIBRATIONS", {})
    p_m.unlink()
    with pytest.raises(CodecError, match=mine.hash):
        codec.decode_kv(other)


@pytest.mark.parametrize("bad", ["missing.safetensors", "notacal.safetensors"])
def test_quality_bench_refuses_a_bad_kvtc_calibration_before_loading(bad, tmp_path, capsys,
                                                                    monkeypatch):
    from bench import quality
    from kv_extraction_hf import model

    monkeypatch.setattr(model, "load_model", lambda *a, **k: (_ for _ in ()).throw(
        AssertionError("model loaded")))
    p = tmp_path / bad
    if bad.startswith("notacal"):
        p.write_bytes(b"\x00" * 64)
    rc = quality.main(["--quick", "--no-tasks", "--kvtc-calibration", str(p),
                       "--out", str(tmp_path / "q.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--kvtc-calibration" in err[0]
    assert not (tmp_path / "q.json").exists()
