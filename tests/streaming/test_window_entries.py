"""Sliding-window store entries: the layout rules (codec.window.layout), the
extra tokens a store entry keeps, chunk-by-chunk dense decode, the identity's kv_layout
and the load rule a source applies (a load too short for what the entry kept is a miss,
never KV with a hole in a sliding layer's window)."""
from __future__ import annotations

import pytest
import torch

import codec
from codec import window
from codec.errors import CodecError
from streaming.identity import check_entry
from streaming.identity import EntryIdentity, codec_identity
from third_party.vllm.sources.base import window_checked, window_floor
from third_party.vllm.sources.local import LocalDirSource, save_local_context
from tests.helpers.kv import make_kv

WS = [16, None, 16, 40]           # layers 0, 2: window 16; 3: window 40; 1: full


@pytest.mark.parametrize("T,extra", [(300, 0), (300, 128), (100, 128), (40, 0), (17, 0), (1000, 64)])
def test_min_load_tokens_is_the_shortest_prefix_whose_windows_are_kept(T, extra):
    n = window.layout.min_load_tokens(WS, T, extra)
    for w in (16, 40):
        start = T - window.kept_tokens(T, w, extra)
        if start > 0:
            assert n >= start + w            # position n - w must be kept
    # and it is the shortest: one token less leaves a window's first position dropped
    if n > 1:
        assert any(T - window.kept_tokens(T, w, extra) > n - 1 - w for w in (16, 40)
                   if T - window.kept_tokens(T, w, extra) > 0)
    if extra and T > 40 + extra:
        assert n == T - extra


def test_layout_tag_round_trip_and_distinct():
    tag = window.layout.layout_tag(WS, 128)
    assert window.layout.parse_layout_tag(tag) == (WS, 128)
    assert tag != window.layout.layout_tag(WS, 0) and tag != window.layout.layout_tag([16, None, 16, 41], 128)
    for bad in ("", "window/1:{", "window/9:{}", 'window/1:{"windows":[0],"extra_tokens":0}',
                'window/1:{"windows":[4],"extra_tokens":-1}', 'window/1:{"windows":[4]}'):
        with pytest.raises(ValueError):
            window.layout.parse_layout_tag(bad)


@pytest.mark.parametrize("extra,ct", [(0, 128), (128, 128), (64, 96), (128, 1024)])
def test_extra_tokens_chunks_decode_dense_per_chunk(extra, ct):
    k, v = make_kv(4, 300, 1, 8)
    chunks = window.encode_windowed_chunks(k, v, WS, codec="raw", chunk_tokens=ct, extra_tokens=extra)
    wkv = window.decode_windowed_chunks(chunks)
    kd, vd = wkv.dense()
    parts = [window.decode_chunk_dense(c) for c in chunks]
    assert torch.equal(torch.cat([p[0] for p in parts], 1), kd)
    assert torch.equal(torch.cat([p[1] for p in parts], 1), vd)
    T = k.shape[1]
    for i, w in enumerate(WS):
        keep = window.kept_tokens(T, w, extra)
        assert torch.equal(kd[i, T - keep:], k[i, T - keep:])          # raw: exact where kept
        assert not kd[i, :T - keep].any()                               # zeros before
    # the header says what it keeps; a header edited to claim other extra tokens fails
    h = window.peek_window_header(chunks[-1])
    assert h["extra_tokens"] == extra


def test_a_header_that_lies_about_extra_tokens_is_a_codec_error():
    import json

    from codec import bitstream

    k, v = make_kv(4, 300, 1, 8)
    data = window.encode_windowed(k, v, WS, codec="raw", extra_tokens=32)
    header, arrays, payload = bitstream.unpack(data)
    for lie in (0, 31, 33, 10 ** 9, -1, "32", True):
        bad = bitstream.pack(dict(header, extra_tokens=lie), arrays, payload)
        with pytest.raises(CodecError):
            window.decode_windowed(bad)
    with pytest.raises(ValueError, match="extra_tokens"):
        window.encode_windowed(k, v, WS, codec="raw", extra_tokens=-3)


def _ident(layout=""):
    base = EntryIdentity(model_id="m", weights_hash="a" * 64, dtype="bfloat16", num_layers=4,
                         num_kv_heads=1, head_dim=8)
    return codec_identity(base, "raw", [None]).replace(kv_layout=layout)


def test_identity_kv_layout_keys_and_checks():
    full, win = _ident(), _ident(window.layout.layout_tag(WS, 128))
    assert "kv_layout" not in full.to_dict()              # full-layout identities unchanged
    assert EntryIdentity.from_dict(win.to_dict()) == win
    assert full.codec_tag() != win.codec_tag()             # another store key
    # a reader that names its levels but no layout wants the full one
    assert "sliding-window layout" in check_entry(full, win.to_dict())
    assert check_entry(win, win.to_dict()) is None
    assert "kv_layout mismatch" in check_entry(win, full.to_dict()) or \
        "no kv_layout" in check_entry(win, full.to_dict())
    other = _ident(window.layout.layout_tag(WS, 0))
    assert check_entry(other, win.to_dict()) is not None
    # a model-only reader (what an engine knows by itself) may get it: the load rule guards
    assert check_entry(full.model_part(), win.to_dict()) is None
    # several calibrations: joined by "+"
    two = full.replace(calibration_hash="b" * 64 + "+" + "c" * 64)
    assert two.calibration_hashes() == ("b" * 64, "c" * 64)


def test_window_checked_refuses_short_loads():
    ident = _ident(window.layout.layout_tag(WS, 128)).to_dict()
    floor = window_floor(ident, 300)
    assert floor == 300 - 128
    assert window_checked(ident, 300, 300, {}) == (300, {"min_load_tokens": floor})
    n, info = window_checked(ident, floor - 1, 300, {})
    assert n == 0 and info["miss"].startswith("window:")
    assert window_floor(_ident().to_dict(), 300) == 0
    n, info = window_checked(dict(ident, kv_layout="window/1:{bad"), 300, 300, {})
    assert n == 0 and "identity" in info["miss"]


def test_local_source_serves_a_windowed_entry_whole_and_misses_a_short_prefix(tmp_path):
    k, v = make_kv(4, 300, 1, 8)
    T = k.shape[1]
    chunks = window.encode_windowed_chunks(k, v, WS, codec="raw", chunk_tokens=128, extra_tokens=128)
    ids = list(range(1000, 1000 + T))
    ident = _ident(window.layout.layout_tag(WS, 128))
    save_local_context(tmp_path, "A", ids, chunks, [b - a for a, b in codec.chunk_bounds(T, 128)],
                       identity=ident)
    src = LocalDirSource(tmp_path, identity=ident.model_part())
    lk = src.lookup({"context_key": "A"}, ids + [7, 8])
    assert lk.num_tokens == T and lk.info["min_load_tokens"] == T - 128
    got = []
    src.load({"context_key": "A"}, lk, T, lambda s, kk, vv: got.append((kk, vv)))
    kd = torch.cat([g[0] for g in got], 1)
    assert torch.equal(kd, window.decode_windowed_chunks(chunks).dense()[0])
    # a prompt that parts from the stored ids early: the common prefix is too short
    lk = src.lookup({"context_key": "A", "prefix_match": True}, ids[:100] + [1, 2, 3])
    assert lk.num_tokens == 0 and lk.info["miss"].startswith("window:")
    # the same entry in the full layout serves that prefix
    full = _ident()
    save_local_context(tmp_path, "B", ids, codec.encode_chunks(k, v, codec="raw", chunk_tokens=128),
                       [b - a for a, b in codec.chunk_bounds(T, 128)], identity=full)
    lk = LocalDirSource(tmp_path, identity=full.model_part()).lookup(
        {"context_key": "B", "prefix_match": True}, ids[:100] + [1, 2, 3])
    assert lk.num_tokens == 100
