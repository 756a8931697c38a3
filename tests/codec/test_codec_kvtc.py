"""Tests of the KVTC transform codec (codec/kvtc/) and its calibration artifact.

Calibrations are fitted on small random data made here (fast); one slow test fits on the
default model's real KV. Run: .venv/bin/python -m pytest tests/codec/test_codec_kvtc.py -q
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import codec
from codec import bitstream, kvtc
from codec.errors import CodecError
from tests.helpers.kv import correlated_kv, make_kv, mixed_kv
from tests.helpers.kvtc import relerr, round_trip_levels, undetected


# an earlier, finer level table: these tests check the mechanics on random data, whose error
# at a given rate has nothing to do with the default table (chosen on real KV)
TEST_TARGETS = {0: 0.55, 1: 0.7, 2: 0.85, 3: 0.95, 4: 1.1, 5: 1.85}


def _cal(L=3, H=2, D=8, N=384, rope=True, **kw):
    k = correlated_kv(L, N, H, D, 1)
    v = correlated_kv(L, N, H, D, 2)
    if rope:
        kw.update(positions=torch.arange(N), rope_theta=10000.0)
    kw.setdefault("level_targets", TEST_TARGETS)
    return kvtc.fit_calibration(k, v, **kw)


@pytest.fixture(scope="module")
def cal():
    c = _cal()
    kvtc.register_calibration(c)
    return c


# ------------------------------------------------------------------------------- bases
def test_bases_orthonormal_and_sorted(cal):
    for kv in range(2):
        for layer in range(cal.num_layers):
            u = cal.basis[kv, layer].astype(np.float64)
            assert np.allclose(u.T @ u, np.eye(cal.C), atol=1e-5)
            assert np.all(np.diff(cal.var[kv, layer]) <= 1e-6 * cal.var[kv, layer, 0])


def test_per_head_basis_is_block_diagonal_and_orthonormal():
    c = _cal(per_head=True, rope=False)
    D, H = c.head_dim, c.num_heads
    for kv in range(2):
        u = c.basis[kv, 0].astype(np.float64)
        assert np.allclose(u.T @ u, np.eye(c.C), atol=1e-5)
        for col in range(c.C):   # each component lives in one head
            heads = {i // D for i in np.flatnonzero(np.abs(u[:, col]) > 1e-7)}
            assert len(heads) == 1
    assert H * D == c.C


def test_allocation_drops_a_suffix_and_is_monotone_in_level(cal):
    prev = None
    for i, lv in enumerate(cal.levels):
        st = cal.step[i]
        keep = cal.n_keep(lv)
        for kv in range(2):
            for layer in range(cal.num_layers):
                n = keep[kv, layer]
                assert (st[kv, layer, :n] > 0).all() and (st[kv, layer, n:] == 0).all()
        if prev is not None:
            assert (keep >= prev).all()
        prev = keep


def test_rope_undo_redo_and_matches_transformers():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    x = make_kv(2, 7, 3, 8, dtype=torch.float32)[0]         # K of 2 layers, 7 tokens
    pos = torch.arange(5, 12)
    y = kvtc.apply_rope(x, pos, 10000.0)
    assert torch.allclose(kvtc.undo_rope(y, pos, 10000.0), x, atol=1e-5)
    cos, sin = kvtc.rope._rope_cos_sin(pos, 8, 10000.0)
    # transformers' layout: [batch, heads, T, D] with cos/sin [batch, T, D]
    xt = x.permute(0, 2, 1, 3)
    ref, _ = apply_rotary_pos_emb(xt, xt, cos[None, :, 0], sin[None, :, 0])
    assert torch.allclose(y, ref.permute(0, 2, 1, 3), atol=1e-6)
    assert not torch.allclose(y, x)


@pytest.mark.parametrize("threads", [1, 2])
def test_inverse_transform_matches_float64_reference(cal, threads, monkeypatch):
    # decode folds the steps into the basis and the symbol offset into a bias: same values
    # (one torch thread: per-layer products at the kept width; else one batched product)
    import numpy as np

    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)

    lv = cal.levels[-1]
    P = cal.torch_params(lv)
    L, H, D, n, T = cal.num_layers, cal.num_heads, cal.head_dim, P["n"], 5
    sym = np.random.default_rng(0).integers(0, 9, size=(L, T, n)).astype(np.uint8)
    offs = [4] * (L - 1) + [2]
    for kv in (0, 1):
        qc = torch.from_numpy(sym).double() - torch.tensor(offs).double()[:, None, None]
        if P["shrink"] is not None:     # centroid reconstruction: non-zero q moved toward 0
            assert (P["shrink"] > 0).any()
            qc = qc - torch.sign(qc) * P["shrink"][kv].double()
        q = qc * P["step"][kv].double()
        ref = (q @ P["basis_t"][kv].double() + P["mean"][kv].double()).reshape(L, T, H, D)
        got = kvtc.inverse.inverse_layers(sym, offs, P, kv, (L, T, H, D), None, 0.0)
        assert got.dtype == torch.float32 and got.shape == (L, T, H, D)
        assert torch.allclose(got.double(), ref, atol=1e-4, rtol=1e-5)
        roped = kvtc.inverse.inverse_layers(sym, offs, P, kv, (L, T, H, D), 3, 10000.0)
        assert torch.allclose(roped, kvtc.apply_rope(ref.float(), torch.arange(3, 3 + T), 10000.0),
                              atol=1e-4, rtol=1e-5)


# --------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_random(cal, dtype):
    k = correlated_kv(3, 200, 2, 8, 11).to(dtype)
    v = correlated_kv(3, 200, 2, 8, 12).to(dtype)
    # the plain levels (a tiered level's tail spans and own sink count: test_kvtc_tiers.py)
    plain = kvtc.KvtcConfig(calibration=cal, tiers=(), sink_tokens=4)
    datas, errs = round_trip_levels(cal, k, v, plain)
    for lv, data in zip(cal.levels, datas):
        h = codec.peek_header(data)
        assert h["codec"] == "kvtc" and h["level"] == lv and h["bytes"] == len(data)
        assert h["config"]["calibration"] == cal.hash
    assert errs[-1] < errs[0] and errs[-1] < 0.05
    assert errs == sorted(errs, reverse=True)


def test_chunks_round_trip_and_recent_window(cal):
    k = correlated_kv(3, 100, 2, 8, 21).bfloat16()
    v = correlated_kv(3, 100, 2, 8, 22).bfloat16()
    cfg = kvtc.KvtcConfig(calibration=cal, recent_tokens=20)
    chunks = codec.encode_chunks(k, v, codec="kvtc", level=cal.levels[-1], config=cfg,
                                 chunk_tokens=32)
    assert len(chunks) == 4
    k2, v2 = codec.decode_chunks(chunks)
    assert k2.shape == k.shape
    assert torch.equal(k2[:, -20:], k[:, -20:]) and torch.equal(v2[:, -20:], v[:, -20:])
    assert torch.equal(k2[:, :4], k[:, :4])
    assert relerr(k2[:, 4:80], k[:, 4:80]) < 0.05
    # the recent window spans the last two chunks: 16 tokens of chunk 2, all 4 of chunk 3
    assert [codec.peek_header(c)["T"] for c in chunks] == [32, 32, 32, 4]


def test_T1_and_context_shorter_than_recent_window(cal):
    for T in (1, 3, 5, 12):
        k = correlated_kv(3, T, 2, 8, 30 + T).bfloat16()
        v = correlated_kv(3, T, 2, 8, 40 + T).bfloat16()
        data = codec.encode_kv(k, v, codec="kvtc",
                               config=kvtc.KvtcConfig(calibration=cal, recent_tokens=64))
        k2, v2 = codec.decode_kv(data)
        assert torch.equal(k2, k) and torch.equal(v2, v)     # every token kept exact
        data = codec.encode_kv(k, v, codec="kvtc",
                               config=kvtc.KvtcConfig(calibration=cal, sink_tokens=0))
        k2, v2 = codec.decode_kv(data)
        assert k2.shape == k.shape and relerr(k2, k) < 0.5


def test_shape_28_layers_5_heads_head_dim_80():
    L, H, D = 28, 5, 80
    k, v = mixed_kv(L, 544, H, D, seed=3, k_decay=-2.0, v_decay=-1.0)
    c = kvtc.fit_calibration(k[:, :512], v[:, :512], positions=torch.arange(512),
                             rope_theta=10000.0, level_targets={0: 0.5, 1: 1.0, 2: 3.0},
                             default_level=1)
    assert c.basis.shape == (2, L, 400, 400)
    kt, vt = k[:, 512:].bfloat16(), v[:, 512:].bfloat16()
    data = codec.encode_kv(kt, vt, codec="kvtc", config=kvtc.KvtcConfig(calibration=c))
    h = codec.peek_header(data)
    assert (h["L"], h["H"], h["D"], h["level"]) == (L, H, D, 1)
    k2, v2 = codec.decode_kv(data)
    assert k2.shape == (L, 32, H, D) and relerr(k2, kt) < 0.3
    k2, v2 = codec.decode_kv(codec.encode_kv(kt, vt, codec="kvtc", level=2,
                                             config=kvtc.KvtcConfig(calibration=c)))
    assert relerr(k2, kt) < 0.05 and relerr(v2, vt) < 0.05


# --------------------------------------------------------------------- calibration file
def test_artifact_save_load_hash(tmp_path, cal):
    p = cal.save(tmp_path)
    assert p.name == f"{cal.hash}.safetensors"
    c2 = kvtc.load_calibration(p)
    assert c2.hash == cal.hash and np.array_equal(c2.basis, cal.basis)
    assert c2.levels == cal.levels and c2.key_space == "pre_rope" and c2.rope_theta == 10000.0
    # tampering with a tensor is caught by the hash
    from safetensors.numpy import load_file, save_file
    from safetensors import safe_open

    with safe_open(str(p), framework="numpy") as f:
        md = f.metadata()
    t = load_file(str(p))
    t["mean"] = t["mean"] + 1.0
    bad = tmp_path / "bad.safetensors"
    save_file(t, str(bad), metadata=md)
    with pytest.raises(CodecError, match="hash"):
        kvtc.load_calibration(bad)
    with pytest.raises(CodecError, match="not found"):
        kvtc.load_calibration(tmp_path / "missing.safetensors")


def test_calibration_mismatch_is_codec_error(tmp_path, monkeypatch, cal):
    monkeypatch.setenv("CACHEGEN_CACHE", str(tmp_path))
    other = _cal(N=300)
    assert other.hash != cal.hash
    k = correlated_kv(3, 40, 2, 8, 50).bfloat16()
    data = codec.encode_kv(k, k, codec="kvtc", config=kvtc.KvtcConfig(calibration=other))
    assert codec.peek_header(data)["config"]["calibration"] == other.hash
    codec.decode_kv(data)   # registered: fine
    # forget it: decode names the calibration it needs
    monkeypatch.setattr(kvtc.registry, "_CALIBRATIONS", {cal.hash: cal})
    with pytest.raises(CodecError, match=other.hash):
        codec.decode_kv(data)
    # found again in the cache folder by its hash
    (tmp_path / "kvtc").mkdir()
    other.save(tmp_path / "kvtc")
    k2, _ = codec.decode_kv(data)
    assert k2.shape == k.shape


def test_bad_hash_never_builds_a_path():
    with pytest.raises(CodecError, match="invalid"):
        kvtc.get_calibration("../../etc/passwd")


def test_encode_errors(cal):
    k = correlated_kv(3, 10, 2, 8, 60)
    with pytest.raises(ValueError, match="level"):
        codec.encode_kv(k, k, codec="kvtc", level=99, config=kvtc.KvtcConfig(calibration=cal))
    # an encode names its calibration: none given is refused, even with one registered of
    # this very shape (no "most recent of this shape" choice)
    assert cal.hash in kvtc.registered_calibrations()
    with pytest.raises(ValueError, match="needs its calibration"):
        codec.encode_kv(k, k, codec="kvtc")
    with pytest.raises(ValueError, match="is for L=3"):
        codec.encode_kv(torch.zeros(2, 4, 1, 6), torch.zeros(2, 4, 1, 6), codec="kvtc",
                        config=kvtc.KvtcConfig(calibration=cal))
    with pytest.raises(ValueError):
        codec.encode_kv(k, k, codec="kvtc", config=kvtc.KvtcConfig(calibration=123))
    with pytest.raises(ValueError):
        kvtc.fit_calibration(k[:, :1], k[:, :1])


# ---------------------------------------------------------------------------- fuzzing
def _mutations(data):
    rng = np.random.default_rng(7)
    for _ in range(150):   # random byte flips (mostly caught by the CRC)
        b = bytearray(data)
        for i in rng.integers(0, len(b), size=rng.integers(1, 4)):
            b[i] ^= int(rng.integers(1, 256))
        yield bytes(b)
    for n in (0, 5, len(data) // 2, len(data) - 1):
        yield data[:n]
    h, arrays, payload = bitstream.unpack(data)
    ch = h["codec_header"]
    edits = [("n_sink", 99), ("n_sink", -1), ("n_recent", 10 ** 6), ("n_components", 0),
             ("n_components", 10 ** 6), ("offset_k", [0]), ("offset_v", [500] * 3),
             ("offset_k", "x"), ("token_offset", -3), ("entropy", None), ("config", None),
             ("config", {"level": 1}), ("config", dict(ch["config"], level=77)),
             ("config", dict(ch["config"], level=True)), ("layout", "x"), ("layout", None),
             ("n_kept", 0), ("n_kept", 10 ** 6), ("n_kept", "7")]
    for key, val in edits:
        h2 = {**h, "codec_header": {**ch, key: val}}
        yield bitstream.pack(h2, arrays, payload)
    yield bitstream.pack(h, arrays, payload[: len(payload) // 2])
    yield bitstream.pack(h, {n: a for n, a in arrays.items() if n != "sink_k"}, payload)
    p2 = bytearray(payload)
    for i in range(0, len(p2), 7):
        p2[i] ^= 0x5A
    yield bitstream.pack(h, arrays, bytes(p2))


def test_fuzzed_bytes_raise_codec_error_only(cal):
    k = correlated_kv(3, 64, 2, 8, 70).bfloat16()
    v = correlated_kv(3, 64, 2, 8, 71).bfloat16()
    data = codec.encode_kv(k, v, codec="kvtc", level=cal.levels[2],
                           config=kvtc.KvtcConfig(calibration=cal))
    assert undetected(_mutations(data), k.shape) < 20   # nearly every mutation is detected


# ----------------------------------------------------------------------------- real KV
@pytest.mark.slow
def test_real_kv_pre_rope_round_trip(default_bundle, fixtures_dir):
    from kv_extraction_hf.calibrate import calibration_samples, rope_theta_of
    from kv_extraction_hf.extract import prefill_kv

    text = (fixtures_dir / "wikitext2" / "wiki.test.raw").read_text()
    k, v, pos = calibration_samples(default_bundle, text, 2, 192, 4, log=lambda s: None)
    theta = rope_theta_of(default_bundle)
    assert theta == 100000.0
    c = kvtc.fit_calibration(k, v, positions=pos, rope_theta=theta)
    ids = default_bundle.tokenizer(text[-4000:], add_special_tokens=False)["input_ids"][:150]
    kt, vt = prefill_kv(default_bundle, ids)
    errs = []
    for lv in c.levels:
        data = codec.encode_kv(kt, vt, codec="kvtc", level=lv,     # the plain levels
                               config=kvtc.KvtcConfig(calibration=c, tiers=(),
                                                      sink_tokens=4))
        assert len(data) < 2 * kt.numel() * 2 / 3
        k2, v2 = codec.decode_kv(data)
        assert k2.dtype == torch.bfloat16
        errs.append(relerr(k2, kt))
    assert errs[-1] < 0.05 and errs == sorted(errs, reverse=True)


def test_calibrate_cli_bad_input_one_line(capsys):
    from kv_extraction_hf import calibrate

    assert calibrate.main(["--windows", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")


@pytest.mark.slow
def test_sensitivity_is_positive_and_finite(default_bundle, fixtures_dir):
    from kv_extraction_hf.calibrate import measure_sensitivity
    from kv_extraction_hf.extract import prefill_kv

    text = (fixtures_dir / "wikitext2" / "wiki.test.raw").read_text()
    ids = default_bundle.tokenizer(text[:3000], add_special_tokens=False)["input_ids"][:96]
    k, v = prefill_kv(default_bundle, ids)
    s = measure_sensitivity(default_bundle, k, v, ids, continuation=8, log=lambda m: None)
    assert s.shape == (2, k.shape[0]) and np.isfinite(s).all() and (s > 0).all()


def test_bench_codec_quick_has_kvtc_rows(tmp_path, monkeypatch):
    """``python -m bench.codec --quick`` fits a synthetic calibration (another seed than the
    measured KV) and measures kvtc levels like cachegen's."""
    import json

    from bench import codec as bench
    from bench.codec import contexts as codec_contexts

    assert ("kvtc", 4) in bench.DEFAULT_ROWS
    monkeypatch.setattr(codec_contexts, "QUICK_SHAPE", (3, 512, 2, 32))  # where load_contexts reads it
    out = tmp_path / "b.json"
    assert bench.main(["--quick", "--contexts", "1", "--repeats", "1", "--rows", "kvtc:4",
                       "kvtc:1", "--out", str(out)]) == 0
    rows = {r["label"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"kvtc-l4", "kvtc-l1"}
    assert rows["kvtc-l1"]["ratio_vs_dtype"] > rows["kvtc-l4"]["ratio_vs_dtype"] > 1.0
