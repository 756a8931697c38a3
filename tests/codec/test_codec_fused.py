"""The fused CPU decoder (codec.quant.fused) is bit-identical to the reference
decode path (decode symbols -> dequantize in float32 -> cast), for every cachegen level,
cachegen-ref level and quant8, in bf16 / fp16 / fp32, on irregular shapes, with sink
tokens, outliers and caller-provided destinations."""
import numpy as np
import pytest
import torch

import codec
from codec import api, base as CC, threads
from codec.entropy import rans_cpu, rans_ref
from codec.api import _read
from codec.errors import CodecError
from tests.helpers.kv import make_kv

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _kv(shape, dtype, seed=0, outlier=False):
    k, v = make_kv(*shape, dtype=torch.float32, seed=seed,
                   channel_scales=torch.linspace(0.2, 3.0, shape[-1]), v_scale=0.5)
    if outlier:   # a value far above its (layer, head) group's typical magnitude
        k[1, shape[1] - 3, 0, 1] = 900.0
        v[0, shape[1] // 2, shape[2] - 1, 0] = -700.0
    return k.to(dtype), v.to(dtype)


def _both_paths(data):
    h, arrays, payload, c = _read(data)
    shape = (h["L"], h["T"], h["H"], h["D"])
    ref = c.decode(h["codec_header"], arrays, payload, shape, h["dtype"], fused=False)
    fus = c.decode(h["codec_header"], arrays, payload, shape, h["dtype"], fused=True)
    return ref, fus


def _bits_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(CC.to_bits(a),
                                                                       CC.to_bits(b))


CASES = ([("cachegen", lv) for lv in codec.levels("cachegen")]
         + [("cachegen-ref", lv) for lv in codec.levels("cachegen-ref")] + [("quant8", None)])


@pytest.mark.parametrize("name,level", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_equals_reference(name, level, dtype):
    k, v = _kv((3, 45, 3, 10), dtype, seed=hash((name, level)) % 1000)
    for data in codec.encode_chunks(k, v, codec=name, level=level, chunk_tokens=32):
        (rk, rv), (fk, fv) = _both_paths(data)
        assert _bits_equal(rk, fk) and _bits_equal(rv, fv)
        # and the public API (fused by default) agrees
        dk, dv = codec.decode_kv(data)
        assert _bits_equal(dk, rk) and _bits_equal(dv, rv)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_with_outliers_and_sinks(dtype):
    k, v = _kv((2, 40, 2, 8), dtype, seed=3, outlier=True)
    data = codec.encode_kv(k, v, codec="cachegen")
    h = codec.peek_header(data)
    _, arrays, _, _ = _read(data)
    assert any(n.startswith("out_") for n in arrays), "test needs outliers"
    assert h["codec_header"].get("n_sink", 0) > 0 if "codec_header" in h else True
    (rk, rv), (fk, fv) = _both_paths(data)
    assert _bits_equal(rk, fk) and _bits_equal(rv, fv)
    assert float(fk.float()[1, 37, 0, 1]) == 900.0


def test_decode_kv_into_caller_tensors():
    k, v = _kv((2, 33, 3, 4), torch.bfloat16, seed=5)
    for name in ("cachegen", "quant8", "kivi2", "raw", "fp8"):
        data = codec.encode_kv(k, v, codec=name)
        ko = torch.full(k.shape, 7.0, dtype=k.dtype)
        vo = torch.full(k.shape, 7.0, dtype=k.dtype)
        rk, rv = codec.decode_kv(data)
        out = codec.decode_kv_into(data, ko, vo)
        assert out[0] is ko and out[1] is vo
        assert _bits_equal(ko, rk) and _bits_equal(vo, rv)


def test_decode_kv_into_rejects_bad_destination():
    k, v = _kv((2, 8, 2, 4), torch.float16)
    data = codec.encode_kv(k, v, codec="cachegen")
    good = torch.empty(k.shape, dtype=k.dtype)
    with pytest.raises(ValueError, match="k_out"):
        codec.decode_kv_into(data, torch.empty(k.shape, dtype=torch.float32), good)
    with pytest.raises(ValueError, match="v_out"):
        codec.decode_kv_into(data, good, torch.empty((2, 9, 2, 4), dtype=k.dtype))
    with pytest.raises(ValueError, match="share"):
        codec.decode_kv_into(data, good, good)
    with pytest.raises(ValueError, match="contiguous"):
        codec.decode_kv_into(data, good, torch.empty((2, 2, 8, 4), dtype=k.dtype).transpose(1, 2))


def test_fused_detects_corruption():
    k, v = _kv((2, 40, 2, 8), torch.bfloat16, seed=1)
    data = codec.encode_kv(k, v, codec="cachegen")
    h, arrays, payload, c = _read(data)
    shape = (h["L"], h["T"], h["H"], h["D"])
    bad = bytearray(payload)
    bad[len(bad) // 2] ^= 0x5A
    with pytest.raises(CodecError):
        c.decode(h["codec_header"], arrays, bytes(bad), shape, h["dtype"], fused=True)
    with pytest.raises(CodecError):
        c.decode(h["codec_header"], arrays, payload[:-2], shape, h["dtype"], fused=True)


def test_only_sink_tokens():
    k, v = _kv((2, 3, 2, 4), torch.float16, seed=2)   # T <= sink tokens: no symbols at all
    data = codec.encode_kv(k, v, codec="cachegen")
    (rk, rv), (fk, fv) = _both_paths(data)
    assert _bits_equal(rk, fk) and _bits_equal(rv, fv)
    assert _bits_equal(fk, k)


def test_decode_streams_into_table_and_offsets():
    """The kernel writes deq[layer, t * t_stride + c // hd, s] at token t_off + t and
    leaves the rest of the destination untouched."""
    rng = np.random.default_rng(0)
    L, T, C, G = 2, 9, 7, 2
    sk = rng.integers(0, 5, (L, T, C)).astype(np.uint8)
    sv = rng.integers(0, 3, (L, T, C)).astype(np.uint8)
    from codec.entropy import models as prob

    ms = prob.build_models(prob.histograms(sk), prob.histograms(sv), [5] * L, [3] * L)
    pay, lens = rans_cpu.encode_streams(sk, sv, ms.cum, ms.model_index, G, T)
    hd, t_stride = 3, 3            # 3 rows per token (c // 3 in 0..2)
    R = (T - 1) * t_stride + (C - 1) // hd + 1
    deq_k = rng.integers(0, 60000, (L, R, 5)).astype(np.uint16)
    deq_v = rng.integers(0, 60000, (L, R, 3)).astype(np.uint16)
    ok = np.full((L, T + 4, C), 11, np.uint16)
    ov = np.full((L, T + 4, C), 11, np.uint16)
    for par in (False, True):
        rans_cpu.decode_streams_into(pay.tobytes(), lens, ms.cum, ms.model_index, L, T, C, G, T,
                                     ok, ov, deq_k, deq_v, t_stride, hd, t_off=3, parallel=par)
        t = np.arange(T)[None, :, None]
        c = np.arange(C)[None, None, :]
        lay = np.arange(L)[:, None, None]
        assert np.array_equal(ok[:, 3:3 + T], deq_k[lay, t * t_stride + c // hd, sk])
        assert np.array_equal(ov[:, 3:3 + T], deq_v[lay, t * t_stride + c // hd, sv])
        assert (ok[:, :3] == 11).all() and (ok[:, 3 + T:] == 11).all()
    with pytest.raises(CodecError, match="decodes symbol"):   # table narrower than alphabet
        rans_cpu.decode_streams_into(pay.tobytes(), lens, ms.cum, ms.model_index, L, T, C, G, T,
                                     ok, ov, deq_k[:, :, :3].copy(), deq_v, t_stride, hd)
    with pytest.raises(ValueError, match="rows"):
        rans_cpu.decode_streams_into(pay.tobytes(), lens, ms.cum, ms.model_index, L, T, C, G, T,
                                     ok, ov, deq_k[:, :5].copy(), deq_v, t_stride, hd)


@pytest.mark.parametrize("name", ["raw", "fp8", "kivi2", "kivi4"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_baselines_equal_reference(name, dtype):
    for shape in ((2, 300, 3, 64), (3, 200, 2, 40)):   # head_dim 64 (groups of 32) and 40
        k, v = _kv(shape, dtype, seed=7)
        for data in codec.encode_chunks(k, v, codec=name, chunk_tokens=128):
            (rk, rv), (fk, fv) = _both_paths(data)
            assert _bits_equal(rk, fk) and _bits_equal(rv, fv)


def test_fused_fp8_rejects_nan_codes():
    k, v = _kv((2, 8, 2, 4), torch.bfloat16)
    data = codec.encode_kv(k, v, codec="fp8")
    h, arrays, payload, c = _read(data)
    arrays = dict(arrays)
    arrays["v"] = arrays["v"].copy()
    arrays["v"][1, 3, 0, 2] = 0x7F
    with pytest.raises(CodecError, match="NaN"):
        c.decode(h["codec_header"], arrays, payload, (2, 8, 2, 4), h["dtype"], fused=True)


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_raw_decode_checks_finite_in_its_copy(dtype, parallel, monkeypatch):
    """raw's fused decode (copy + finite check in one pass): every inf/NaN pattern of the
    dtype at the start, the end and inside a later 64K block is refused with CodecError,
    through decode_kv and decode_kv_into, serial and parallel builds; finite extremes
    decode bit for bit."""
    from codec import bitstream
    from codec.quant.tables import copy_finite_into, count_nonfinite

    if parallel:
        monkeypatch.setattr(threads, "PARALLEL_MIN_SYMBOLS", 0)
    k, v = _kv((2, 300, 2, 64), dtype, seed=2)                     # 76800 > 65536 per tensor
    fi = torch.finfo(dtype)
    k[0, 0, 0, :4] = torch.tensor([fi.max, -fi.max, fi.tiny, -0.0]).to(dtype)
    data = codec.encode_kv(k, v, codec="raw")
    dk, dv = codec.decode_kv(data)
    assert _bits_equal(dk, k) and _bits_equal(dv, v)
    iv = torch.int32 if dtype == torch.float32 else torch.int16
    h = bitstream.unpack_container(data)
    name = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]
    for bad in (float("nan"), float("inf"), float("-inf")):
        for tag, where in (("k", (0, 0, 0, 0)), ("v", (1, 299, 1, 63)), ("v", (1, 100, 0, 5))):
            arrays = {n: np.array(a) for n, a in h.arrays.items()}
            t = torch.from_numpy(arrays[tag]).view(iv).view(dtype)
            t[where] = bad
            blob = bitstream.pack(h.header, arrays, h.payload,
                                  bf16=[n for n, d in h.dtypes.items() if d == "bf16"])
            with pytest.raises(CodecError, match="NaN/inf"):
                codec.decode_kv(blob)
            with pytest.raises(CodecError, match="NaN/inf"):
                codec.decode_kv_into(blob, torch.empty_like(k), torch.empty_like(v))
            src = arrays[tag].reshape(-1)
            out = np.empty_like(src)
            n = copy_finite_into(src, out, name, parallel=parallel)
            assert n == count_nonfinite(src, name) == 1 and np.array_equal(out, src)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_finite_matches_torch(dtype):
    from codec.quant.fused import all_finite

    x = torch.randn(3, 70000, dtype=torch.float32).to(dtype)   # > one 64K block
    assert all_finite(x)
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[2, 69999] = bad
        assert not all_finite(y)
        y = x.clone()
        y[0, 0] = bad
        assert not all_finite(y[:, :10])     # a non-contiguous view
    big = torch.tensor([torch.finfo(dtype).max, -torch.finfo(dtype).max,
                        torch.finfo(dtype).tiny, 0.0], dtype=dtype)
    assert all_finite(big)
    assert all_finite(torch.empty(0, dtype=dtype))


@pytest.mark.parametrize("name", ["cachegen", "cachegen-ref", "quant8", "fp8", "kivi2", "raw"])
def test_parallel_kernels_equal_reference(name, monkeypatch):
    """The parallel (prange) builds of the fused kernels give the reference's bits too."""
    monkeypatch.setattr(threads, "PARALLEL_MIN_SYMBOLS", 0)
    from codec.quant.fused import all_finite

    for dtype in (torch.bfloat16, torch.float16):
        k, v = _kv((3, 200, 2, 64), dtype, seed=11)
        for data in codec.encode_chunks(k, v, codec=name, chunk_tokens=64):
            (rk, rv), (fk, fv) = _both_paths(data)
            assert _bits_equal(rk, fk) and _bits_equal(rv, fv)
        y = k.clone()
        y[2, 199, 1, 63] = float("nan")
        assert all_finite(k) and not all_finite(y)


@pytest.mark.parametrize("workers", [1, 2, 3, 7])
def test_dynamic_scheduling_any_worker_count(workers, monkeypatch):
    """The decode kernel's workers take items from an atomic counter: any
    number of workers (fewer, as many as or more than numba's threads) decodes every item
    exactly once, to the same symbols as the reference decoder, and a corrupt stream is
    still reported."""
    monkeypatch.setattr(threads, "num_workers", lambda: workers)
    rng = np.random.default_rng(5)
    L, T, C, G, B = 3, 40, 24, 2, 16          # quads, single-lane items and short blocks
    sk = rng.integers(0, 6, (L, T, C)).astype(np.uint8)
    sv = rng.integers(0, 4, (L, T, C)).astype(np.uint8)
    from codec.entropy import models as prob

    ms = prob.build_models(prob.histograms(sk), prob.histograms(sv), [6] * L, [4] * L)
    pay, lens = rans_cpu.encode_streams(sk, sv, ms.cum, ms.model_index, G, B)
    ref_k, ref_v = rans_ref.decode_streams_ref(pay.tobytes(), lens, ms.cum, ms.model_index,
                                               L, T, C, G, B)
    for par in (True, False):
        dk, dv = rans_cpu.decode_streams(pay.tobytes(), lens, ms.cum, ms.model_index,
                                         L, T, C, G, B, parallel=par)
        assert np.array_equal(dk, np.asarray(ref_k).reshape(L, T, C))
        assert np.array_equal(dv, np.asarray(ref_v).reshape(L, T, C))
        bad = bytearray(pay.tobytes())
        bad[int(np.asarray(lens)[:5].sum()) + 1] ^= 0xFF      # a state word of stream 5
        with pytest.raises(CodecError):
            rans_cpu.decode_streams(bytes(bad), lens, ms.cum, ms.model_index, L, T, C, G, B,
                                    parallel=par)
