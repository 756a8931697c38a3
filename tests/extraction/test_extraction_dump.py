"""kv_extraction_hf.dump.save_kv with K and V that share storage (kind of
safetensors #202: "Some tensors share memory"): the same tensor twice, views of one
buffer, overlapping slices; each round-trips exactly through load_kv.

Run: .venv/bin/python -m pytest tests/extraction/test_extraction_dump.py -q
"""

from __future__ import annotations

import pytest
import torch

from kv_extraction_hf.dump import load_kv, save_kv
from kv_extraction_hf.errors import ExtractionError

L, T, H, D = 2, 6, 3, 4
N = L * T * H * D


def _same():
    x = torch.arange(N, dtype=torch.float32).view(L, T, H, D).bfloat16()
    return x, x


def _views_of_one_buffer():
    buf = torch.arange(2 * N, dtype=torch.float32).view(2, L, T, H, D).half()
    return buf[0], buf[1]


def _overlapping_contiguous_slices():
    flat = torch.arange(N + N // 2, dtype=torch.float32)
    return flat[:N].view(L, T, H, D), flat[N // 2:N // 2 + N].view(L, T, H, D)


def _overlapping_token_slices():
    big = torch.arange(L * 10 * H * D, dtype=torch.float32).view(L, 10, H, D)
    return big[:, 0:T], big[:, 3:3 + T]


def _v_is_a_view_of_k():
    x = torch.arange(N, dtype=torch.float32).view(L, T, H, D)
    return x, x.view(L, T, H, D)


def _expanded():  # stride-0 view: one element seen many times
    x = torch.arange(H * D, dtype=torch.float32).view(1, 1, H, D).expand(L, T, H, D)
    return x, x


@pytest.mark.parametrize("make", [_same, _views_of_one_buffer, _overlapping_contiguous_slices,
                                  _overlapping_token_slices, _v_is_a_view_of_k, _expanded])
def test_shared_storage_kv_round_trips(tmp_path, make):
    k, v = make()
    k0, v0 = k.clone(), v.clone()
    path = save_kv(tmp_path / "kv.safetensors", k, v, {"token_ids": list(range(T))})
    k2, v2, meta = load_kv(path)
    assert torch.equal(k2, k0) and torch.equal(v2, v0)
    assert k2.dtype == k0.dtype and meta["num_tokens"] == str(T)
    assert torch.equal(k, k0) and torch.equal(v, v0)  # the caller's tensors are untouched
    assert [p.name for p in tmp_path.iterdir()] == ["kv.safetensors"]  # no temp file left


def test_unserialisable_metadata_is_an_extraction_error(tmp_path):
    k, v = _same()
    with pytest.raises(ExtractionError, match="JSON"):
        save_kv(tmp_path / "kv.safetensors", k, v, {"bad": object()})
    assert list(tmp_path.iterdir()) == []
