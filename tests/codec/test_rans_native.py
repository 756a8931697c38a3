"""The native (C) rANS decoder (codec.entropy.rans_native) against the numba kernel it replaces.

Same decoded values for every layout, element size, codec, level and dtype (bit identity);
the same outcome on hostile bytes (only CodecError, never a crash); results independent of
the worker count; the build (cache folder, atomic rename) and the one-line fallback when it
is switched off or the compiler fails.
"""
from __future__ import annotations

import random
from types import SimpleNamespace
import warnings

import numpy as np
import pytest
import torch

import codec
from codec import bitstream, threads
from codec.entropy import rans_cpu, rans_native
from codec.entropy import models as prob
from tests.helpers.kv import make_kv

if rans_native.load() is None:  # pragma: no cover - a machine without a C compiler
    pytest.skip("native rANS decoder not built on this machine", allow_module_level=True)


@pytest.fixture(autouse=True)
def _native_on(monkeypatch):
    """CACHEGEN_NATIVE=1: the native decoder for every test here (even without AVX2)."""
    monkeypatch.setenv("CACHEGEN_NATIVE", "1")


def _both(fn, monkeypatch):
    """fn() with the native decoder, then with the numba kernel (the outcome of each:
    a value or the CodecError's type)."""
    def run():
        try:
            return fn()
        except codec.CodecError:
            return "CodecError"
    nat = run()
    with rans_native.disabled():
        ref = run()
    return nat, ref


def _models(rng, L, T, C, nk=6, nv=4):
    sk = rng.integers(0, nk, (L, T, C)).astype(np.uint8)
    sv = rng.integers(0, nv, (L, T, C)).astype(np.uint8)
    sk[:, :, 0] = 0                       # a skewed channel: long runs of one symbol
    ms = prob.build_models(prob.histograms(sk), prob.histograms(sv), [nk] * L, [nv] * L)
    return sk, sv, ms


@pytest.mark.parametrize("L,T,C,G,B", [
    (3, 40, 24, 2, 16),      # quads merged to 8 lanes, short blocks
    (2, 33, 20, 4, 33),      # 5 groups: one quad + a single lane
    (1, 7, 3, 16, 5),        # one partial group (single lane), two blocks
    (2, 64, 192, 16, 64),    # the default model's channels (3 heads x 64): 8 + 4 lanes
    (2, 50, 40, 1, 7),       # one channel per stream: many 8-lane items
    (3, 37, 192, 16, 16),    # 16-channel groups in token blocks of 16 and a last one of 5
])
@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32])
@pytest.mark.parametrize("tile", ["1", "0"])
def test_native_equals_numba_into_tables(L, T, C, G, B, dtype, tile, monkeypatch):
    """Fused decode + table lookup: every element size, per-token and per-chunk tables,
    a token offset, K and V tables of different sizes: identical outputs, untouched rest;
    2-byte outputs through the per-worker tile (16 x 16 transposes when 16 channels per
    stream, a scalar copy otherwise) and without it (CACHEGEN_NATIVE_TILE=0)."""
    monkeypatch.setenv("CACHEGEN_NATIVE_TILE", tile)
    rng = np.random.default_rng(L * 1000 + C)
    sk, sv, ms = _models(rng, L, T, C)
    pay, lens = rans_cpu.encode_streams(sk, sv, ms.cum, ms.model_index, G, B)
    hd = max(1, C // 3)
    for t_stride in (0, 1 + (C - 1) // hd):
        R = (T - 1) * t_stride + (C - 1) // hd + 1
        info = np.iinfo(dtype)
        dk = rng.integers(0, info.max, (L, R, 7), dtype=dtype)
        dv = rng.integers(0, info.max, (L, R + 2, 5), dtype=dtype)

        def run():
            ok = np.full((L, T + 5, C), 7, dtype=dtype)
            ov = np.full((L, T + 5, C), 9, dtype=dtype)
            rans_cpu.decode_streams_into(pay.tobytes(), lens, ms.cum, ms.model_index, L, T, C, G, B,
                                         ok, ov, dk, dv, t_stride, hd, t_off=3)
            return ok, ov
        (nk, nv), (rk, rv) = _both(run, monkeypatch)
        assert np.array_equal(nk, rk) and np.array_equal(nv, rv)
        assert (nk[:, :3] == 7).all() and (nv[:, T + 3:] == 9).all()


@pytest.mark.parametrize("workers", [1, 2, 3, 8])
def test_thread_count_independence(workers, monkeypatch):
    """Any number of worker threads decodes every item once, to the same symbols."""
    rng = np.random.default_rng(3)
    L, T, C, G, B = 4, 96, 64, 4, 32
    sk, sv, ms = _models(rng, L, T, C)
    pay, lens = rans_cpu.encode_streams(sk, sv, ms.cum, ms.model_index, G, B)
    monkeypatch.setattr(threads, "num_workers", lambda: workers)
    dk, dv = rans_cpu.decode_streams(pay.tobytes(), lens, ms.cum, ms.model_index, L, T, C, G, B,
                                     parallel=True)
    assert np.array_equal(dk, sk) and np.array_equal(dv, sv)


def test_corrupt_streams_same_error_as_numba(monkeypatch):
    """Flipped payload bits and truncated streams (lengths kept consistent): the native
    decoder reports an error exactly where the numba kernel does, with the same message."""
    rng = np.random.default_rng(9)
    L, T, C, G, B = 2, 64, 32, 4, 64
    sk, sv, ms = _models(rng, L, T, C)
    pay, lens = rans_cpu.encode_streams(sk, sv, ms.cum, ms.model_index, G, B)
    r = random.Random(4)
    n_err = 0
    for trial in range(60):
        b = bytearray(pay.tobytes())
        ln = np.array(lens)
        if trial % 3 == 0:                                  # cut 2 bytes off one stream
            i = r.randrange(ln.size)
            start = int(ln[:i].sum())
            del b[start + int(ln[i]) - 2: start + int(ln[i])]
            ln[i] -= 2
        else:                                               # flip bits anywhere
            for _ in range(r.randint(1, 3)):
                b[r.randrange(len(b))] ^= 1 << r.randrange(8)

        def run():
            try:
                return rans_cpu.decode_streams(bytes(b), ln, ms.cum, ms.model_index, L, T, C, G, B)
            except codec.CodecError as e:
                return str(e)
        nat, ref = _both(run, monkeypatch)
        if isinstance(ref, str):
            n_err += 1
            assert nat == ref
        else:
            assert np.array_equal(nat[0], ref[0]) and np.array_equal(nat[1], ref[1])
    assert n_err > 20


def _three_ways(run, monkeypatch):
    """run() with the native vector lanes, the native scalar loop and the numba kernel."""
    monkeypatch.setenv("CACHEGEN_NATIVE_SIMD", "1")
    vec = run()
    monkeypatch.setenv("CACHEGEN_NATIVE_SIMD", "0")
    scal = run()
    monkeypatch.setenv("CACHEGEN_NATIVE_SIMD", "1")
    with rans_native.disabled():
        ref = run()
    return vec, scal, ref


def _decode_or_message(pay, ln, ms, L, T, C, G, B):
    try:
        return rans_cpu.decode_streams(bytes(pay), ln, ms.cum, ms.model_index, L, T, C, G, B)
    except codec.CodecError as e:
        return str(e)


def _same(a, b):
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


@pytest.mark.parametrize("L,T,C,G,B", [
    (1, 9, 8, 2, 9),         # one quad per kv: an item with 1 quad (lanes repeat quad 0)
    (1, 5, 12, 1, 5),        # 3 quads per kv: an item of 3 quads
    (3, 1, 4, 1, 1),         # streams of 1 symbol
    (2, 3, 5, 1, 1),         # 1-symbol streams, a quad plus a single lane per row
    (2, 17, 16, 1, 4),       # blocks of 4 and a last block of 1: items grouped by length
    (5, 8, 8, 1, 8),         # 10 quads per kv: a full item plus a 2-quad item
    (2, 40, 192, 16, 16),    # the default model's channels, 3 blocks
])
def test_vector_lane_edge_cases(L, T, C, G, B, monkeypatch):
    """Items with fewer quads than the kernel's lanes, 1-symbol streams, short last
    blocks: the vector lanes, the scalar loop and numba give the same symbols."""
    rng = np.random.default_rng(L * 100 + T + C)
    sk, sv, ms = _models(rng, L, T, C)
    pay, lens = rans_cpu.encode_streams(sk, sv, ms.cum, ms.model_index, G, B)
    vec, scal, ref = _three_ways(lambda: _decode_or_message(pay.tobytes(), lens, ms, L, T, C, G, B),
                                 monkeypatch)
    assert not isinstance(ref, str) and np.array_equal(ref[0], sk) and np.array_equal(ref[1], sv)
    assert _same(vec, ref) and _same(scal, ref)


def test_many_models_coarse_lut(monkeypatch):
    """More models than the kernel builds its fine (32-slot) LUT for (4096): the vector
    lanes use the caller's 256-slot LUT and still match the scalar loop and numba."""
    rng = np.random.default_rng(11)
    L, T, C, G, B = 12, 32, 192, 16, 32                  # 4,608 models
    sk = rng.integers(0, 40, (L, T, C)).astype(np.uint8)
    sv = rng.integers(0, 40, (L, T, C)).astype(np.uint8)
    n_models = 2 * L * C                                 # one random model per (kv, layer, channel)
    freq = rng.integers(1, 3000, (n_models, 40)).astype(np.float64)
    freq = np.maximum(1, np.floor(freq / freq.sum(1, keepdims=True) * (65536 - 40))).astype(np.int64)
    freq[:, 0] += 65536 - freq.sum(1)
    cum = np.full((n_models, 257), 65536, dtype=np.uint32)
    cum[:, :41] = np.concatenate([np.zeros((n_models, 1), np.int64), np.cumsum(freq, 1)], 1)
    rans_cpu.validate_cum_table(cum, np.full(n_models, 40))
    ms = SimpleNamespace(cum=cum, model_index=np.arange(n_models, dtype=np.uint16).reshape(2, L, C))
    pay, lens = rans_cpu.encode_streams(sk, sv, ms.cum, ms.model_index, G, B)
    vec, scal, ref = _three_ways(lambda: _decode_or_message(pay.tobytes(), lens, ms, L, T, C, G, B),
                                 monkeypatch)
    assert np.array_equal(ref[0], sk) and _same(vec, ref) and _same(scal, ref)


@pytest.mark.parametrize("lane", [0, 5, 15])
def test_one_lane_truncated_or_bad_state(lane, monkeypatch):
    """A stream cut short, or with a bad initial state, in one lane of a full vector item
    (every other lane valid): the same CodecError message (stream index and kind) from
    the vector lanes, the scalar loop and numba."""
    rng = np.random.default_rng(lane)
    L, T, C, G, B = 4, 24, 16, 1, 24                     # 4 quads per layer and kv
    sk = rng.integers(0, 6, (L, T, C)).astype(np.uint8)  # no skewed channel: no 4-byte stream
    sv = rng.integers(0, 4, (L, T, C)).astype(np.uint8)
    ms = prob.build_models(prob.histograms(sk), prob.histograms(sv), [6] * L, [4] * L)
    pay, lens = rans_cpu.encode_streams(sk, sv, ms.cum, ms.model_index, G, B)
    n_blocks = 1
    quad0 = [0, 4, 8, 12]                                # first streams of layer 0's quads
    s = quad0[lane // 4] + (lane % 4) * n_blocks
    start = int(lens[:s].sum())
    cut = bytearray(pay.tobytes())
    ln = np.array(lens)
    assert ln[s] > 4
    del cut[start + int(ln[s]) - 2: start + int(ln[s])]
    ln[s] -= 2
    bad = bytearray(pay.tobytes())
    bad[start: start + 4] = b"\x00\x00\x00\x00"          # initial state 0 < 2^16
    for payload, lengths in ((cut, ln), (bad, lens)):
        vec, scal, ref = _three_ways(lambda: _decode_or_message(payload, lengths, ms, L, T, C, G, B),
                                     monkeypatch)
        assert isinstance(ref, str) and f"stream {s} " in ref
        assert vec == ref and scal == ref


def _real_shaped_kv(dtype, T=48, seed=0):
    """KV of the default model's shape (30 layers, 3 KV heads, head_dim 64): per-channel
    scales and a few large outlier channels, as a real K has."""
    return make_kv(30, T, 3, 64, dtype=dtype, seed=seed, channel_scales=(0.1, 2.0),
                   scales_per_head=True, outlier_channels=(4, 20.0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("name", ["cachegen", "cachegen-ref"])
def test_codecs_decode_bit_identical(name, dtype, monkeypatch):
    """Every level of the rANS codecs, on real-shaped KV, in chunks: the native decoder
    gives the numba kernel's bits."""
    k, v = _real_shaped_kv(dtype)
    for level in codec.levels(name):
        for data in codec.encode_chunks(k, v, codec=name, level=level, chunk_tokens=32):
            (nk, nv), (rk, rv) = _both(lambda: codec.decode_kv(data), monkeypatch)
            assert nk.dtype == dtype
            assert torch.equal(nk.view(torch.uint8), rk.view(torch.uint8))
            assert torch.equal(nv.view(torch.uint8), rv.view(torch.uint8))


def _resealed_mutants(data: bytes, rng: random.Random, n: int):
    """Structured damage behind a valid checksum: stream lengths made huge, odd, shifted
    between streams; the payload truncated or bit-flipped."""
    c = bitstream.unpack_container(data)
    bf16 = [nm for nm, t in c.dtypes.items() if t == "bf16"]
    for _ in range(n):
        arrays = {k: a.copy() for k, a in c.arrays.items()}
        payload = bytearray(c.payload)
        lens_name = next(nm for nm in arrays if nm.endswith("stream_lengths"))
        ln = arrays[lens_name]
        op = rng.randrange(5)
        i = rng.randrange(ln.size)
        if op == 0:
            top = int(np.iinfo(ln.dtype).max)
            ln[i] = top if rng.random() < 0.5 else min(top, int(ln[i]) * 2 + 2)
        elif op == 1:
            ln[i] = ln[i] ^ 1
        elif op == 2:
            j = rng.randrange(ln.size)
            if ln[j] >= 2 and int(ln[i]) + 2 <= int(np.iinfo(ln.dtype).max):
                ln[i] += 2
                ln[j] -= 2
        elif op == 3:
            payload = payload[: rng.randrange(len(payload))]
        else:
            for _ in range(rng.randint(1, 4)):
                payload[rng.randrange(len(payload))] ^= 1 << rng.randrange(8)
        try:
            yield bitstream.pack(c.header, arrays, bytes(payload), bf16=[nm for nm in bf16 if nm in arrays])
        except ValueError:
            continue


@pytest.mark.parametrize("level", [0, 5])
def test_hostile_bytes_only_codec_error(level, monkeypatch):
    """Damaged containers re-sealed with a valid checksum reach the parser and the native
    kernel: only CodecError, and the same outcome as the numba kernel."""
    k, v = _real_shaped_kv(torch.bfloat16, T=40, seed=2)
    data = codec.encode_kv(k, v, codec="cachegen", level=level)
    rng = random.Random(level)
    n = 0
    for bad in _resealed_mutants(data, rng, 40):
        nat, ref = _both(lambda: codec.decode_kv(bad), monkeypatch)
        if isinstance(ref, str):
            assert nat == ref
        else:
            assert torch.equal(nat[0].view(torch.uint8), ref[0].view(torch.uint8))
        n += 1
    assert n > 20


def test_build_cache_atomic_and_fallback(tmp_path, monkeypatch):
    """A fresh cache folder builds the library under native/<hash>/ (no temporary file
    left); CACHEGEN_NATIVE=0 and a failing compiler each give one warning and None."""
    monkeypatch.setenv("CACHEGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(rans_native, "_STATE", {})
    path = rans_native.library_path()
    assert path.parent.parent == tmp_path / "native"
    assert rans_native.load() is not None and path.exists()
    assert [p.name for p in path.parent.iterdir()] == ["rans_decode.so"]

    monkeypatch.setenv("CACHEGEN_NATIVE", "0")
    assert rans_native.load() is not None and not rans_native.enabled()
    monkeypatch.setenv("CACHEGEN_NATIVE", "1")
    for env, cc in (({}, "/bin/false"),):
        monkeypatch.setattr(rans_native, "_STATE", {})
        monkeypatch.setenv("CACHEGEN_CACHE", str(tmp_path / f"other{len(env)}"))
        for key, val in env.items():
            monkeypatch.setenv(key, val)
        if cc:
            monkeypatch.setenv("CC", cc)
            monkeypatch.setattr(rans_native.shutil, "which", lambda x: x if x.startswith("/") else None)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            assert rans_native.load() is None
            assert rans_native.load() is None
        assert len(w) == 1 and "numba" in str(w[0].message)
        monkeypatch.delenv("CACHEGEN_NATIVE", raising=False)
        # the fallback decodes too
        rng = np.random.default_rng(1)
        sk, sv, ms = _models(rng, 1, 20, 8)
        pay, lens = rans_cpu.encode_streams(sk, sv, ms.cum, ms.model_index, 4, 20)
        dk, _ = rans_cpu.decode_streams(pay.tobytes(), lens, ms.cum, ms.model_index, 1, 20, 8, 4, 20)
        assert np.array_equal(dk, sk)


def test_default_selection(monkeypatch):
    """Unset CACHEGEN_NATIVE: the native decoder where it has its AVX2 lanes; 0: numba;
    1: native even without them; `disabled()` wins over all."""
    monkeypatch.delenv("CACHEGEN_NATIVE", raising=False)
    assert rans_native.enabled() == rans_native.simd()
    monkeypatch.setenv("CACHEGEN_NATIVE", "0")
    assert not rans_native.enabled()
    monkeypatch.setenv("CACHEGEN_NATIVE", "1")
    assert rans_native.enabled()
    with rans_native.disabled():
        assert not rans_native.enabled()
