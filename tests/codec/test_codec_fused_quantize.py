"""The fused numba quantization (codec.quant.fused.quantize_fast / row_absmax_fast)
gives exactly the symbols and scales of the torch reference arithmetic, and the codec's
bitstream is unchanged by it (same bytes as with the torch path).

Run: .venv/bin/python -m pytest tests/codec/test_codec_fused_quantize.py -q
"""
import numpy as np
import pytest
import torch

import codec
from codec.quant import fused as F
from codec.quant import reference as Q


def _torch_absmax(x, dims):
    return x.to(torch.float32).abs().amax(dim=dims, keepdim=True)


def _kv(dtype, seed=0, shape=(4, 300, 3, 64)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[-1])
    x[0, 5] = 0.0                       # an all-zero row: scale 0 -> symbol M
    x[1, 7, 1, 3] = 1e4                 # an outlier-sized value
    x[2, :, 2] = 0.0                    # an all-zero group over the chunk
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["token", "head", "chunk_head"])
def test_fused_quantize_bit_exact_random(dtype, layout):
    x = _kv(dtype, seed=1)
    L, T, H, D = x.shape
    if layout == "token":
        xg, dims = x.reshape(L, T, 1, H * D), (3,)
    elif layout == "head":
        xg, dims = x, (3,)
    else:
        xg, dims = x, (1, 3)
    s_fast = F.row_absmax_fast(xg, dims)
    s_ref = _torch_absmax(xg, dims)
    assert s_fast is not None and s_fast.dtype == torch.float32
    assert torch.equal(s_fast, s_ref)
    m = Q._bcast_levels(torch.tensor([3.0, 7.0, 15.0, 127.0]), 4)
    for scale in (s_ref, Q.encode_log8(Q.flush_tiny_scales(s_ref))[2].reshape(s_ref.shape),
                  s_ref * 0.5):       # scales below max |x| exercise the clamp
        fast = F.quantize_fast(xg, scale, m)
        assert fast is not None
        assert torch.equal(fast, Q.quantize_bcast(xg, scale, m))
        assert torch.equal(Q.quantize(xg, scale, torch.tensor([3.0, 7.0, 15.0, 127.0])), fast)


def test_fused_quantize_ties_round_to_even():
    # x * inv exactly k + 0.5: torch.round and the kernel both round half to even
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 3.5, 0.0, 4.0], dtype=torch.float32).reshape(1, 1, 1, 8)
    scale = torch.full((1, 1, 1, 1), 4.0)
    m = torch.full((1, 1, 1, 1), 4.0)
    fast = F.quantize_fast(x, scale, m)
    assert fast.reshape(-1).tolist() == [4, 6, 6, 4, 2, 8, 4, 8]
    assert torch.equal(fast, Q.quantize_bcast(x, scale, m))


def test_fused_quantize_strided_and_fallbacks():
    x = _kv(torch.bfloat16, seed=2)
    xs = x[:, 4:]                                   # sink tokens sliced off: strided in T
    s = _torch_absmax(xs, (3,))
    assert torch.equal(F.row_absmax_fast(xs, (3,)), s)
    m = Q._bcast_levels(torch.full((4,), 15.0), 4)
    assert torch.equal(F.quantize_fast(xs, s, m), Q.quantize_bcast(xs, s, m))
    # not applicable -> None (the torch path is used): fp16, 3-D, other dims, non-finite
    assert F.quantize_fast(x.to(torch.float16), _torch_absmax(x, (3,)), m) is None
    assert F.row_absmax_fast(x, (2,)) is None
    bad = x.clone()
    bad[0, 0, 0, 0] = float("nan")
    assert F.quantize_fast(bad, _torch_absmax(x, (3,)), m) is None
    assert F.row_absmax_fast(bad, (3,)) is None


@pytest.mark.parametrize("name,level", [("cachegen", 1), ("cachegen", 5), ("cachegen-ref", 0), ("quant8", None)])
def test_bitstream_unchanged_by_fused_quantize(monkeypatch, name, level):
    """Same bytes with the fused kernels as with the torch reference arithmetic."""
    g = torch.Generator().manual_seed(3)
    k = (torch.randn(30, 512, 3, 64, generator=g) * 2).to(torch.bfloat16)
    v = torch.randn(30, 512, 3, 64, generator=g).to(torch.bfloat16)
    fast = codec.encode_kv(k, v, codec=name, level=level)
    monkeypatch.setattr(F, "quantize_fast", lambda *a, **kw: None)
    monkeypatch.setattr(F, "row_absmax_fast", lambda *a, **kw: None)
    ref = codec.encode_kv(k, v, codec=name, level=level)
    assert fast == ref
