"""Exact anchor tokens (codec.anchors): the first ``sink`` and last ``recent`` tokens of a
context kept bit for bit, the rest coded as before; off = today's bytes; the option is in
the config hash; short contexts are exact whole; bad values are one-line ValueErrors;
chunked entries carry the sinks in the first chunk and the recent tokens in the last."""
from __future__ import annotations

import pytest
import torch

import codec
from codec import anchors, bitstream
from codec.errors import CodecError
from tests.helpers.kv import make_kv


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("name", ["cachegen", "quant8", "kivi2"])
def test_round_trip_anchors_exact_middle_as_plain(name):
    k, v = make_kv(3, 200, 2, 16, dtype=torch.float16, v_scale=0.5)
    data, stats = anchors.encode_with_stats(k, v, name, sink=4, recent=32)
    k2, v2 = anchors.decode(data)
    assert k2.shape == k.shape and k2.dtype == k.dtype
    for a, b in ((k, k2), (v, v2)):
        assert _bits_equal(a[:, :4], b[:, :4]) and _bits_equal(a[:, -32:], b[:, -32:])
    # the middle is the ordinary codec's container of those tokens at their positions
    mid = codec.api.encode_one(k[:, 4:168], v[:, 4:168], name, codec.api.check_level(codec.get_codec(name), None),
                               None, 4, 200, 0, 1, chunk_tokens=200)[0]
    mk, mv = codec.decode_kv(mid)
    assert torch.equal(k2[:, 4:168], mk) and torch.equal(v2[:, 4:168], mv)
    assert stats["anchor_tokens"] == 36 and stats["bytes"] == len(data)
    assert stats["anchor_bytes"] == 2 * 3 * 36 * 2 * 16 * 2        # fp16 bits, K and V
    assert stats["bytes"] > stats["anchor_bytes"] + len(mid)         # sizes count the exact bits
    assert anchors.exact_tokens(data) == stats["exact_tokens"] == 36  # cachegen's own sinks: positions < 4
    assert anchors.peek_anchor_header(data)["n_head"] == 4


def test_off_is_todays_bytes():
    k, v = make_kv(3, 100, 2, 16, dtype=torch.bfloat16, v_scale=0.5)
    for name in ("cachegen", "quant8", "raw"):
        data, stats = anchors.encode_with_stats(k, v, name)
        assert data == codec.encode_kv(k, v, name)
        assert anchors.encode_chunks(k, v, name, chunk_tokens=32) == codec.encode_chunks(k, v, name, chunk_tokens=32)
        assert not anchors.is_anchored(data) and stats["anchor_tokens"] == 0
    assert stats["exact_tokens"] == 0                                       # raw keeps no sinks of its own
    assert anchors.exact_tokens(codec.encode_kv(k, v, "cachegen")) == 4     # cachegen's default sinks


def test_config_hash():
    base = codec.config_hash("cachegen", 1, num_layers=30)
    assert anchors.config_hash("cachegen", 1, num_layers=30) == base
    h = anchors.config_hash("cachegen", 1, num_layers=30, sink=4, recent=128)
    assert h != base and len(h) == 16
    assert h != anchors.config_hash("cachegen", 1, num_layers=30, sink=4, recent=64)
    assert h != anchors.config_hash("cachegen", 2, num_layers=30, sink=4, recent=128)
    assert h == anchors.config_hash("cachegen", None, num_layers=30, sink=4, recent=128)


def test_anchored_container_is_not_a_plain_one():
    k, v = make_kv(2, 64, 2, 8, v_scale=0.5)
    data = anchors.encode(k, v, "cachegen", sink=4, recent=16)
    with pytest.raises(CodecError, match="not a KV codec container"):
        codec.decode_kv(data)


@pytest.mark.parametrize("T,sink,recent", [(10, 4, 128), (132, 4, 128), (3, 4, 0), (5, 0, 5)])
def test_short_context_is_exact_whole(T, sink, recent):
    k, v = make_kv(2, T, 2, 8, dtype=torch.float32, v_scale=0.5)
    data, stats = anchors.encode_with_stats(k, v, "cachegen", sink=sink, recent=recent)
    k2, v2 = anchors.decode(data)
    assert torch.equal(k2.view(torch.int32), k.view(torch.int32)) and torch.equal(v2.view(torch.int32), v.view(torch.int32))
    assert stats["exact_tokens"] == T and bitstream.unpack(data)[2] == b""


@pytest.mark.parametrize("bad", [-1, 1.5, "4", True, None, 1 << 30])
def test_bad_values(bad):
    k, v = make_kv(2, 32, 2, 8, v_scale=0.5)
    for kw in ({"sink": bad}, {"recent": bad}):
        with pytest.raises(ValueError) as e:
            anchors.encode(k, v, "cachegen", **kw)
        assert "\n" not in str(e.value) and "anchor" in str(e.value)
        with pytest.raises(ValueError):
            anchors.config_hash("cachegen", **kw)


def test_parse_anchors():
    assert anchors.parse_anchors("4,128") == (4, 128) and anchors.parse_anchors("off") == (0, 0)
    for bad in ("4", "4,-1", "a,b", "4,128,1"):
        with pytest.raises(ValueError, match="SINK,RECENT"):
            anchors.parse_anchors(bad)


def test_chunked_entries():
    k, v = make_kv(3, 150, 2, 16, dtype=torch.float16, v_scale=0.5)
    chunks = anchors.encode_chunks(k, v, "cachegen", chunk_tokens=32, sink=4, recent=40)
    hs = [anchors.peek_anchor_header(c) for c in chunks]
    assert [h["T"] for h in hs] == [32, 32, 32, 32, 22]
    assert [(h["n_head"], h["n_tail"]) for h in hs] == [(4, 0), (0, 0), (0, 0), (0, 18), (0, 22)]
    k2, v2 = anchors.decode_chunks(chunks)
    assert _bits_equal(k2[:, :4], k[:, :4]) and _bits_equal(v2[:, -40:], v[:, -40:])
    # each chunk decodes on its own, at its own positions
    kc, _ = anchors.decode(chunks[3])
    assert _bits_equal(kc[:, 14:], k[:, 110:128])
    # a middle chunk is exactly the ordinary chunk of those tokens (nothing anchored in it)
    plain = codec.encode_chunks(k, v, "cachegen", chunk_tokens=32)
    assert torch.equal(anchors.decode(chunks[1])[0], codec.decode_kv(plain[1])[0])
    with pytest.raises(CodecError):
        anchors.decode_chunks(chunks[:2] + chunks[3:])
    with pytest.raises(CodecError):
        anchors.decode_chunks(chunks[::-1])


def test_token_offset_positions():
    # a continuation encoded at offset 100 of a 164-token context: no sink falls in it
    k, v = make_kv(2, 64, 2, 8, dtype=torch.float16, v_scale=0.5)
    data = anchors.encode(k, v, "cachegen", sink=4, recent=16, token_offset=100)
    h = anchors.peek_anchor_header(data)
    assert (h["n_head"], h["n_tail"], h["total_tokens"]) == (0, 16, 164)


def test_corrupt_header_is_codec_error():
    k, v = make_kv(2, 64, 2, 8, v_scale=0.5)
    data = anchors.encode(k, v, "quant8", sink=4, recent=16)
    h, arrays, payload = bitstream.unpack(data)
    for key, bad in (("n_head", 5), ("sink", 3), ("middle_bytes", 1), ("anchor_version", 9)):
        forged = bitstream.pack(dict(h, **{key: bad}), arrays, payload)
        with pytest.raises(CodecError):
            anchors.decode(forged)
    with pytest.raises(CodecError):
        anchors.decode(bitstream.pack(h, {n: a for n, a in arrays.items() if n != "tail_v"}, payload))


def test_kvtc_with_anchors():
    from codec import kvtc

    k, v = make_kv(2, 160, 2, 8, dtype=torch.float32, v_scale=0.5)
    cal = kvtc.fit_calibration(k, v)
    cfg = kvtc.KvtcConfig(calibration=cal)
    data, stats = anchors.encode_with_stats(k, v, "kvtc", config=cfg, sink=4, recent=32)
    k2, v2 = anchors.decode(data)
    assert torch.equal(k2[:, :4], k[:, :4]) and torch.equal(v2[:, -32:], v[:, -32:])
    assert stats["exact_tokens"] >= 36
    plain, pstats = anchors.encode_with_stats(k, v, "kvtc", config=cfg)
    assert plain == codec.encode_kv(k, v, "kvtc", config=cfg) and pstats["exact_tokens"] == 4   # kvtc's own sinks


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_anchor_bits_in_every_dtype(dtype):
    k, v = make_kv(2, 80, 2, 8, dtype=dtype, v_scale=0.5)
    k2, v2 = anchors.decode(anchors.encode(k, v, "raw", sink=3, recent=20))
    ints = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert k2.dtype == dtype and torch.equal(k2.view(ints), k.view(ints)) and torch.equal(v2.view(ints), v.view(ints))
