"""Tests of the kvtc decode path (decode time): ``kvtc.inverse.inverse_layers`` (per-layer
kept-width products split over worker threads, RoPE on the two halves cast straight into
the destination) against the textbook ``kvtc.inverse.inverse_ref``, and the independence of
the decoded bytes from the thread count.

Run: .venv/bin/python -m pytest tests/codec/test_kvtc_inverse.py -q
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import codec
from codec import kvtc
from tests.helpers.kv import correlated_kv, make_kv


@pytest.fixture(scope="module", params=["plain", "centroid"])
def cal(request):
    L, H, D, N = 5, 2, 16, 512
    k, v = correlated_kv(L, N, H, D, 1), correlated_kv(L, N, H, D, 2)
    kw = {"centroid": True, "rounding": 0.3} if request.param == "centroid" else {}
    c = kvtc.fit_calibration(k, v, positions=torch.arange(N), rope_theta=10000.0, **kw)
    assert (c.shrink is not None) == (request.param == "centroid")
    kvtc.register_calibration(c)
    return c


def _sym(P, L, T, seed):
    n = P["n"]
    return np.random.default_rng(seed).integers(0, 11, size=(L, T, n)).astype(np.uint8)


def _top_level_problem(cal, T, seed):
    """(L, H, D, T, params, random symbols, offsets 5) of the calibration's finest level."""
    L, H, D = cal.num_layers, cal.num_heads, cal.head_dim
    P = cal.torch_params(cal.levels[-1])
    return L, H, D, T, P, _sym(P, L, T, seed), [5] * L


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rope_from", [None, 0, 777])
def test_fast_inverse_matches_reference_within_float32_rounding(cal, threads, rope_from,
                                                                monkeypatch):
    monkeypatch.setattr(kvtc.workers, "_decode_workers", lambda: threads)
    L, H, D, T = cal.num_layers, cal.num_heads, cal.head_dim, 37
    for lv in (cal.levels[0], cal.levels[-1]):
        P = cal.torch_params(lv)
        sym = _sym(P, L, T, lv)
        offs = [5] * (L - 1) + [3]
        for kv in (0, 1):
            ref = kvtc.inverse.inverse_ref(sym, offs, P, kv, (L, T, H, D), rope_from,
                                              10000.0)
            got = kvtc.inverse.inverse_layers(sym, offs, P, kv, (L, T, H, D), rope_from, 10000.0)
            assert got.dtype == torch.float32 and got.shape == (L, T, H, D)
            scale = float(ref.abs().max())
            assert float((got - ref).abs().max()) <= 2e-6 * scale * cal.C ** 0.5
            assert not torch.equal(ref, torch.zeros_like(ref))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fast_inverse_into_model_dtype_is_the_rounded_float32_result(cal, dtype, monkeypatch):
    # float32 products (fp16 destinations; bf16 ones on a CPU without bf16 dot products):
    # the cast into ``out`` is the only extra rounding: identical to casting the float32
    # result of the same path, and within one unit of the dtype of the reference
    monkeypatch.setattr(kvtc.workers, "bf16_gemm", lambda: False)
    L, H, D, T, P, sym, offs = _top_level_problem(cal, 29, 3)
    for threads in (1, 2):
        monkeypatch.setattr(kvtc.workers, "_decode_workers", lambda: threads)
        f32 = kvtc.inverse.inverse_layers(sym, offs, P, 0, (L, T, H, D), 11, 10000.0)
        out = torch.full((L, T, H, D), float("nan"), dtype=dtype)
        r = kvtc.inverse.inverse_layers(sym, offs, P, 0, (L, T, H, D), 11, 10000.0, out=out)
        assert r is out
        assert torch.equal(out, f32.to(dtype))
    ref = kvtc.inverse.inverse_ref(sym, offs, P, 0, (L, T, H, D), 11, 10000.0).to(dtype)
    # one bf16/fp16 step, plus the float32 paths' own difference (the bound of the test
    # above): an element near zero may sit on the other side of a rounding boundary
    ref32 = kvtc.inverse.inverse_ref(sym, offs, P, 0, (L, T, H, D), 11, 10000.0)
    f32_tol = 2e-6 * float(ref32.abs().max()) * cal.C ** 0.5
    ulp = torch.finfo(dtype).eps * ref.float().abs().clamp_min(1e-3) + f32_tol
    assert bool(((out.float() - ref.float()).abs() <= ulp).all())


@pytest.mark.parametrize("rope_from", [None, 11])
def test_bf16_products_within_the_rounding_bound(cal, rope_from, monkeypatch):
    # bf16 destination with bf16 products (float32 accumulation): the basis, the mean and
    # (before RoPE) the product are each rounded to bf16 once, so the error against the
    # float32 reference is at most eps_bf16 * (|x| + |q| @ |B_s| + |mean|) per element
    # (twice the pair's bound after the rotation); centroid offsets keep float32 products
    monkeypatch.setattr(kvtc.workers, "bf16_gemm", lambda: True)
    L, H, D, T, P, sym, offs = _top_level_problem(cal, 31, 8)
    for kv in (0, 1):
        for threads in (1, 2):
            monkeypatch.setattr(kvtc.workers, "_decode_workers", lambda: threads)
            out = torch.full((L, T, H, D), float("nan"), dtype=torch.bfloat16)
            kvtc.inverse.inverse_layers(sym, offs, P, kv, (L, T, H, D), rope_from, 10000.0, out=out)
            if threads == 1:
                first = out.clone()
            else:       # the same bytes whichever worker runs a layer
                assert torch.equal(out.view(torch.int16), first.view(torch.int16))
        ref = kvtc.inverse.inverse_ref(sym, offs, P, kv, (L, T, H, D), rope_from, 10000.0)
        q = (torch.from_numpy(sym).float() - 5.0).abs()
        a = (q @ P["basis_ts"][kv].abs() + P["mean"][kv].abs()).reshape(L, T, H, D)
        if rope_from is not None:
            a = 2 * a.amax(-1, keepdim=True)
        tol = torch.finfo(torch.bfloat16).eps * (ref.abs() + a) + 1e-6
        err = (out.float() - ref).abs()
        assert bool((err <= tol).all()), float((err / tol).max())
        if P["shrink"] is None:         # the bf16 path ran: not the float32 result cast
            f32 = kvtc.inverse.inverse_layers(sym, offs, P, kv, (L, T, H, D), rope_from, 10000.0)
            assert not torch.equal(out, f32.to(torch.bfloat16))


def test_threads_do_not_change_the_decoded_bytes(cal, monkeypatch):
    # each layer is the same ops in the same order whichever worker runs it
    L, H, D = cal.num_layers, cal.num_heads, cal.head_dim
    k = correlated_kv(L, 300, H, D, 5).to(torch.bfloat16)
    v = correlated_kv(L, 300, H, D, 6).to(torch.bfloat16)
    data = codec.encode_kv(k, v, codec="kvtc", level=cal.levels[-1],
                           config=kvtc.KvtcConfig(calibration=cal))
    outs = []
    for threads in (1, 2, 4):
        monkeypatch.setattr(kvtc.workers, "_decode_workers", lambda: threads)
        outs.append(codec.decode_kv(data))
    for k2, v2 in outs[1:]:
        assert torch.equal(k2.view(torch.int16), outs[0][0].view(torch.int16))
        assert torch.equal(v2.view(torch.int16), outs[0][1].view(torch.int16))
    # and the decode is the reference's up to float32 rounding (then the cast)
    rel = float((outs[0][0].float() - k.float()).norm() / k.float().norm())
    assert rel < 0.5


def test_empty_and_single_token(cal, monkeypatch):
    monkeypatch.setattr(kvtc.workers, "_decode_workers", lambda: 2)
    L, H, D = cal.num_layers, cal.num_heads, cal.head_dim
    P = cal.torch_params(cal.levels[0])
    out = kvtc.inverse.inverse_layers(np.zeros((L, 0, P["n"]), np.uint8), [0] * L, P, 0,
                                  (L, 0, H, D), 0, 10000.0)
    assert out.shape == (L, 0, H, D)
    sym = _sym(P, L, 1, 9)
    got = kvtc.inverse.inverse_layers(sym, [5] * L, P, 0, (L, 1, H, D), 4, 10000.0)
    ref = kvtc.inverse.inverse_ref(sym, [5] * L, P, 0, (L, 1, H, D), 4, 10000.0)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-5)


def test_decode_workers_use_numbas_count_when_torch_has_one(monkeypatch):
    # inside the vLLM CPU worker torch runs on 1 thread, numba (the rANS decoder) on 2
    numba = pytest.importorskip("numba")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(numba, "get_num_threads", lambda: 2)
    assert kvtc.workers._decode_workers() == 2
    monkeypatch.setattr(numba, "get_num_threads", lambda: 1)
    assert kvtc.workers._decode_workers() == 1


def test_torch_rope_fallback_matches_the_kernel(cal, monkeypatch):
    # without numba the RoPE of the decode is the same arithmetic in torch ops
    L, H, D, T = cal.num_layers, cal.num_heads, cal.head_dim, 23
    P = cal.torch_params(cal.levels[-1])
    sym = _sym(P, L, T, 4)
    offs = [5] * L
    a = kvtc.inverse.inverse_layers(sym, offs, P, 0, (L, T, H, D), 100, 10000.0)
    monkeypatch.setattr(kvtc.rope, "rope_kernel", lambda: None)
    b = kvtc.inverse.inverse_layers(sym, offs, P, 0, (L, T, H, D), 100, 10000.0)
    ref = kvtc.inverse.inverse_ref(sym, offs, P, 0, (L, T, H, D), 100, 10000.0)
    scale = float(ref.abs().max())
    assert float((a - b).abs().max()) <= 1e-6 * scale
    assert float((b - ref).abs().max()) <= 2e-6 * scale * cal.C ** 0.5


def test_rope_kernel_is_apply_rope():
    if kvtc.rope.rope_kernel() is None:
        pytest.skip("no numba")
    T, H, D = 17, 3, 8
    x = make_kv(1, T, H, D, dtype=torch.float32, seed=2)[0][0]       # one layer's K
    pos = torch.arange(50, 50 + T)
    cos, sin = kvtc.rope._rope_cos_sin(pos, D, 10000.0)
    y = x.clone()
    kvtc.rope.rope_kernel()(y.numpy(), cos[:, 0, :D // 2].contiguous().numpy(),
                        sin[:, 0, :D // 2].contiguous().numpy())
    ref = kvtc.apply_rope(x[None], pos, 10000.0)[0]
    assert torch.allclose(y, ref, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(y, x)


def test_rope_bf16_kernel_is_widen_rotate_round(cal, monkeypatch):
    # the bf16-bits RoPE kernel gives the bits of: widen to float32, _rope_rows_py, cast
    if kvtc.rope.rope_bf16_kernel() is None:
        pytest.skip("no numba")
    T, H, D = 19, 3, 8
    x = make_kv(1, T, H, D, seed=5, k_scale=30.0)[0][0]              # one layer's K, bf16
    cos, sin = kvtc.rope._rope_cos_sin(torch.arange(900, 900 + T), D, 10000.0)
    c, s = cos[:, 0, :D // 2].contiguous().numpy(), sin[:, 0, :D // 2].contiguous().numpy()
    ref = x.float().contiguous()
    kvtc.rope.rope_kernel()(ref.numpy(), c, s)
    out = torch.empty_like(x)
    kvtc.rope.rope_bf16_kernel()(x.view(torch.int16).numpy().view(np.uint16),
                             out.view(torch.int16).numpy().view(np.uint16), c, s)
    assert torch.equal(out.view(torch.int16), ref.bfloat16().view(torch.int16))
    # and the decode's bf16 key path gives the same bits with or without it
    monkeypatch.setattr(kvtc.workers, "bf16_gemm", lambda: True)
    L, H, D, T = cal.num_layers, cal.num_heads, cal.head_dim, 27
    P = cal.torch_params(cal.levels[-1])
    sym = _sym(P, L, T, 6)
    a = torch.empty((L, T, H, D), dtype=torch.bfloat16)
    kvtc.inverse.inverse_layers(sym, [5] * L, P, 0, (L, T, H, D), 40, 10000.0, out=a)
    monkeypatch.setattr(kvtc.rope, "rope_bf16_kernel", lambda: None)
    b = torch.empty((L, T, H, D), dtype=torch.bfloat16)
    kvtc.inverse.inverse_layers(sym, [5] * L, P, 0, (L, T, H, D), 40, 10000.0, out=b)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))

