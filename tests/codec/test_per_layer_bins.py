"""A cachegen config with arbitrary per-layer K/V bins (as codec.bit_allocation emits)
round-trips through the container with no side data (each layer decodes exactly as a
uniform config of that layer's bins decodes it), through encode_chunks, and through the
store: the entry is served to a reader of the same config, and a reader of a different
per-layer config (or of the preset level) gets a clean miss with the reason.

Run: .venv/bin/python -m pytest tests/codec/test_per_layer_bins.py -q
"""
from __future__ import annotations

import pytest
import torch

import codec
from codec.bit_allocation import config_from_bins
from codec.config import CodecConfig

L, T, H, D = 5, 160, 2, 32
KEY_BINS = [64, 48, 48, 12, 8]
VALUE_BINS = [8, 10, 24, 24, 128]


def _kv(seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(L, T, H, D, generator=g).to(torch.bfloat16)
    v = torch.randn(L, T, H, D, generator=g).to(torch.bfloat16)
    return k, v


def _cfg(key_bins=KEY_BINS, value_bins=VALUE_BINS):
    return config_from_bins(CodecConfig.for_model(L), key_bins, value_bins)


def test_per_layer_config_decodes_with_no_side_data():
    k, v = _kv()
    cfg = _cfg()
    data = codec.encode_kv(k, v, codec="cachegen", config=cfg)
    hdr = codec.peek_header(data)
    assert hdr["codec"] == "cachegen"
    k2, v2 = codec.decode_kv(data)                # nothing but the bytes
    assert k2.shape == k.shape and k2.dtype == k.dtype
    # each layer is what a uniform config of that layer's bins gives (per-layer quantization)
    for layer in range(L):
        u = CodecConfig.uniform(L, KEY_BINS[layer], VALUE_BINS[layer], scale_group=cfg.scale_group,
                                scale_format=cfg.scale_format, sink_tokens=cfg.sink_tokens)
        ku, vu = codec.decode_kv(codec.encode_kv(k, v, codec="cachegen", config=u))
        assert torch.equal(k2[layer], ku[layer]) and torch.equal(v2[layer], vu[layer])
    # coarser layers lose more
    err = [float((k2[i].float() - k[i].float()).pow(2).mean()) for i in range(L)]
    assert err[4] > err[3] > err[0]
    # the same config gives the same bytes; chunked containers decode alone too
    assert codec.encode_kv(k, v, codec="cachegen", config=cfg) == data
    chunks = codec.encode_chunks(k, v, codec="cachegen", config=cfg, chunk_tokens=64)
    parts = [codec.decode_kv(c) for c in chunks]
    first = codec.decode_kv(codec.encode_kv(k[:, :64], v[:, :64], codec="cachegen", config=cfg))
    assert torch.equal(parts[0][0], first[0]) and torch.equal(parts[0][1], first[1])
    assert sum(p[0].shape[1] for p in parts) == T


def test_config_hash_names_the_per_layer_schedule():
    a, b = _cfg(), _cfg(value_bins=[8, 10, 24, 24, 96])
    ha = codec.config_hash("cachegen", None, a, num_layers=L)
    assert ha == codec.config_hash("cachegen", None, _cfg(), num_layers=L)
    assert ha != codec.config_hash("cachegen", None, b, num_layers=L)
    for lv in codec.levels("cachegen"):
        assert ha != codec.config_hash("cachegen", lv, num_layers=L)


def test_store_serves_the_same_config_and_misses_another(tmp_path):
    from streaming.identity import EntryIdentity, codec_identity
    from streaming.load import stream_load
    from streaming.store import LocalStoreClient

    k, v = _kv(1)
    cfg = _cfg()
    model = EntryIdentity(model_id="m", weights_hash="a" * 64, tokenizer_hash="t" * 64, dtype="bfloat16",
                          num_layers=L, num_kv_heads=H, head_dim=D)
    ident = codec_identity(model, "cachegen", [None], config=cfg)
    (slot,) = ident.levels
    ids = list(range(T))
    ranges = [(0, 64), (64, 128), (128, T)]
    chunks = [codec.encode_kv(k[:, a:b], v[:, a:b], codec="cachegen", config=cfg, token_offset=a)
              for a, b in ranges]
    client = LocalStoreClient(tmp_path / "store")
    key = client.put_entry(ident, ids, {slot: chunks}, ranges)
    res = stream_load(client, key, slot, identity=ident)
    assert res.hit
    got_k = torch.cat([d[0] for d in res.decoded], 1)
    ref_k = torch.cat([codec.decode_kv(c)[0] for c in chunks], 1)
    assert torch.equal(got_k, ref_k)
    # another per-layer schedule, or the preset level in the same slot: a clean miss
    for other in (codec_identity(model, "cachegen", [None], config=_cfg(key_bins=[64, 48, 48, 12, 12])),
                  codec_identity(model, "cachegen", [None])):
        miss = stream_load(client, key, slot, identity=other)
        assert not miss.hit and miss.decoded == [] and "config mismatch" in miss.reason
