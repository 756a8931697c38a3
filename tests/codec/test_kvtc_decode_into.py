"""kvtc decodes straight into caller tensors (``codec.decode_kv_into``; the LMCache serde's
destination buffer): the same values as ``decode_kv``, written into the given tensors
(no copy), for chunks with and without exact sink tokens, grouped and per-layer bases."""
from __future__ import annotations

import pytest
import torch

import codec
from codec import kvtc
from tests.helpers.kv import correlated_kv


@pytest.fixture(scope="module", params=[0, 2])
def cal(request):
    L, H, D, N = 4, 2, 16, 512
    k, v = correlated_kv(L, N, H, D, 1), correlated_kv(L, N, H, D, 2)
    c = kvtc.fit_calibration(k, v, positions=torch.arange(N), rope_theta=10000.0, group_layers=request.param)
    kvtc.register_calibration(c)
    return c


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offset,total", [(0, 96), (256, 512)])
def test_decode_into_equals_decode_and_writes_the_given_tensors(cal, dtype, offset, total):
    k = correlated_kv(4, 96, 2, 16, 7).to(dtype)
    v = correlated_kv(4, 96, 2, 16, 8).to(dtype)
    cfg = kvtc.KvtcConfig(calibration=cal.hash)
    chunks = codec.encode_chunks(torch.cat([k] * (total // 96 + 1), 1)[:, :total],
                                 torch.cat([v] * (total // 96 + 1), 1)[:, :total],
                                 codec="kvtc", config=cfg, chunk_tokens=256 if total > 256 else 96)
    data = chunks[-1] if offset else chunks[0]
    h = codec.peek_header(data)
    assert h["token_offset"] == offset
    ref_k, ref_v = codec.decode_kv(data)
    ko = torch.full(ref_k.shape, float("nan"), dtype=dtype)   # every position must be written
    vo = torch.full(ref_v.shape, float("nan"), dtype=dtype)
    gk, gv = codec.decode_kv_into(data, ko, vo)
    assert gk is ko and gv is vo
    assert torch.equal(ko, ref_k) and torch.equal(vo, ref_v)


def test_a_corrupt_chunk_decoded_into_tensors_is_a_codec_error(cal):
    k = correlated_kv(4, 96, 2, 16, 7).to(torch.bfloat16)
    data = bytearray(codec.encode_kv(k, k.clone(), codec="kvtc", config=kvtc.KvtcConfig(calibration=cal.hash)))
    data[len(data) // 2] ^= 0xFF
    ko, vo = torch.empty(4, 96, 2, 16, dtype=torch.bfloat16), torch.empty(4, 96, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(codec.CodecError):
        codec.decode_kv_into(bytes(data), ko, vo)
