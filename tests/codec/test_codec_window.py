"""Sliding-window storage (codec/window/): random KV round trips of every codec with
per-layer windows, whole and chunked; the stored fraction at Gemma 3's 8K layout; a
header that does not parse or does not agree is a CodecError; kvtc's per-group rule.

Run: .venv/bin/python -m pytest tests/codec/test_codec_window.py -q
"""
from __future__ import annotations

import random

import pytest
import torch

import codec
from codec import bitstream, window
from codec.errors import CodecError
from tests.helpers.kv import make_kv

CODECS = ["raw", "fp8", "quant8", "kivi2", "kivi4", "cachegen", "cachegen-ref"]
# relative RMS error bound of a lossy round trip on this data (a wrong layout is ~1)
REL_ERR = {"raw": 0.0, "fp8": 0.1, "quant8": 0.05, "kivi2": 0.6, "kivi4": 0.2, "cachegen": 0.3,
           "cachegen-ref": 0.3}
WINDOWS = [24, 24, None, 24, 40, None]          # two windows, full layers 2 and 5


def kept_mask(windows, T):
    """[L, T] bool: the positions each layer keeps."""
    m = torch.zeros(len(windows), T, dtype=torch.bool)
    for i, w in enumerate(windows):
        m[i, T - window.kept_tokens(T, w):] = True
    return m


def _check(wkv, k, v, windows, name):
    T = k.shape[1]
    assert wkv.total_tokens == T and wkv.shape == tuple(k.shape) and wkv.windows == list(windows)
    kd, vd = wkv.dense()
    m = kept_mask(windows, T)
    assert kd.dtype == k.dtype and (kd[~m] == 0).all() and (vd[~m] == 0).all()
    for x, y in ((kd, k), (vd, v)):
        err = ((x[m].float() - y[m].float()).norm() / y[m].float().norm()).item()
        assert err <= REL_ERR[name], (name, err)
    for i, w in enumerate(windows):
        ki, vi, start = wkv.layer(i)
        assert start == T - window.kept_tokens(T, w) and ki.shape[0] == T - start
    assert wkv.stored_elements == 2 * int(m.sum()) * k.shape[2] * k.shape[3]


@pytest.mark.parametrize("name", CODECS)
def test_round_trip_whole_and_chunked(name):
    k, v = make_kv(6, 100, v_scale=0.5)
    data, stats = window.encode_windowed_with_stats(k, v, WINDOWS, codec=name)
    assert window.is_windowed(data) and not window.is_windowed(codec.encode_kv(k, v, codec="raw"))
    assert stats["bytes"] == len(data) and stats["elements"] == 2 * k.numel()
    assert stats["dtype_bytes"] == 2 * k.numel() * 2             # full layout, bf16
    assert stats["stored_elements"] == 2 * int(kept_mask(WINDOWS, 100).sum()) * 2 * 16
    _check(window.decode_windowed(data), k, v, WINDOWS, name)
    chunks = window.encode_windowed_chunks(k, v, WINDOWS, codec=name, chunk_tokens=32)
    heads = [window.peek_window_header(c) for c in chunks]
    # groups: full (2, 5), window 24 (0, 1, 3: positions 76..99), window 40 (4: 60..99)
    assert [g["layers"] for g in heads[0]["groups"]] == [[2, 5], [0, 1, 3], [4]]
    assert [[g["T"] for g in h["groups"]] for h in heads] == [[32, 0, 0], [32, 0, 4], [32, 20, 32], [4, 4, 4]]
    wkv = window.decode_windowed_chunks(chunks)
    _check(wkv, k, v, WINDOWS, name)
    if name == "raw":
        assert all(torch.equal(a, b) for a, b in zip(wkv.dense(), window.decode_windowed(data).dense()))


def test_short_context_and_all_full_layers():
    k, v = make_kv(6, 20, v_scale=0.5)      # every window covers the whole context
    wkv = window.decode_windowed(window.encode_windowed(k, v, WINDOWS, codec="raw"))
    assert all(torch.equal(a, b) for a, b in zip(wkv.dense(), (k, v)))
    # no window at all: the ordinary container, the same bytes
    full = [None] * 6
    assert window.encode_with_stats(k, v, full, codec="cachegen")[0] == codec.encode_kv(k, v, codec="cachegen")
    assert window.encode_with_stats(k, v, None, codec="raw")[0] == codec.encode_kv(k, v, codec="raw")
    got = window.decode_dense(codec.encode_kv(k, v, codec="raw"))
    assert torch.equal(got[0], k) and torch.equal(got[1], v)


def test_prefix_keeps_positions():
    k, v = make_kv(6, 50, v_scale=0.5)
    wkv = window.decode_windowed(window.encode_windowed(k, v, WINDOWS, codec="raw"))
    p = wkv.prefix(49)
    assert p.total_tokens == 49
    for i, w in enumerate(WINDOWS):
        ki, _, start = p.layer(i)
        assert start == 50 - window.kept_tokens(50, w) and start + ki.shape[0] == 49
        assert torch.equal(ki, k[i, start:49])
    with pytest.raises(ValueError):
        wkv.prefix(0)


def test_gemma3_layout_fraction_at_8k():
    """Gemma 3 270M: 18 layers, 5 sliding (window 512) : 1 full. At T = 8192 the windowed
    layout stores (3 + 15 x 512 / 8192) / 18 = 0.21875 of the full layout's elements
    (<= 0.22); measured from the encode (H, D shrunk: the fraction does not
    depend on them)."""
    ws = ([512] * 5 + [None]) * 3
    assert window.layout.stored_fraction(ws, 8192) == (3 + 15 * 512 / 8192) / 18 == 0.21875
    assert window.layout.stored_fraction(ws, 2048) == 0.375
    k, v = make_kv(18, 8192, 1, 2, v_scale=0.5)
    _, stats = window.encode_windowed_with_stats(k, v, ws, codec="raw")
    assert stats["stored_elements"] / stats["elements"] == 0.21875


def test_schedule_restricted_to_the_group():
    """cachegen-ref level 1 has layer-dependent bins: each group keeps its layers' own."""
    k, v = make_kv(12, 40, v_scale=0.5)
    ws = [8] * 11 + [None]
    full = codec.CodecConfig.for_model(12, 1, variant="reference")
    data = window.encode_windowed(k, v, ws, codec="cachegen-ref", level=1)
    h = window.peek_window_header(data)
    _, payload = bitstream.unpack(data)[::2]
    sub = payload[h["groups"][0]["bytes"]:]
    cfg = codec.peek_header(sub)["config"]

    def bins(specs):
        return [b for a, e, b in specs for _ in range(a, e)]   # [start, end, bins] triples
    assert bins(cfg["key_specs"]) == full.key_bins[:11] and bins(cfg["value_specs"]) == full.value_bins[:11]
    assert len(set(full.key_bins[:11])) > 1            # the schedule does vary over these layers


def test_kvtc_needs_a_calibration_per_group():
    from codec import kvtc

    k, v = make_kv(4, 96, 2, 8, dtype=torch.float32, v_scale=0.5)
    ws = [16, 16, None, 16]
    cal = kvtc.fit_calibration(k, v)
    with pytest.raises(ValueError, match="layer group") as e:
        window.encode_windowed(k, v, ws, codec="kvtc", config=kvtc.KvtcConfig(calibration=cal))
    assert "\n" not in str(e.value)
    per = {(2,): kvtc.KvtcConfig(calibration=kvtc.fit_calibration(k[[2]], v[[2]])),
           (0, 1, 3): kvtc.KvtcConfig(calibration=kvtc.fit_calibration(k[[0, 1, 3]], v[[0, 1, 3]]))}
    wkv = window.decode_windowed(window.encode_windowed(k, v, ws, codec="kvtc", config=per))
    assert wkv.shape == (4, 96, 2, 8) and wkv.layer(0)[2] == 80


def test_bad_arguments():
    k, v = make_kv(6, 30, v_scale=0.5)
    for bad in ([None] * 5, [0] + [None] * 5, [True] + [None] * 5, ["8"] + [None] * 5):
        with pytest.raises(ValueError):
            window.encode_windowed(k, v, bad, codec="raw")
    with pytest.raises(ValueError, match="no entry"):
        window.encode_windowed(k, v, WINDOWS, codec="raw", config={(2, 5): None})


# ------------------------------------------------------------------------ header fuzz
def _repack(data: bytes, edit) -> bytes:
    h, arrays, payload = bitstream.unpack(data)
    edit(h)
    return bitstream.pack(h, arrays, payload)


def _set(path, value):
    def edit(h):
        d = h
        for key in path[:-1]:
            d = d[key]
        d[path[-1]] = value
    return edit


EDITS = [
    _set(["window_version"], 2), _set(["window_version"], True), _set(["kind"], "kvcodec"),
    _set(["codec"], "nope"), _set(["L"], 7), _set(["L"], 0), _set(["H"], 3), _set(["dtype"], "int8"),
    _set(["total_tokens"], 99), _set(["total_tokens"], 1 << 40), _set(["T"], 0), _set(["T"], True),
    _set(["token_offset"], 5), _set(["chunk_index"], 1), _set(["num_chunks"], 0), _set(["level"], "1"),
    _set(["groups"], []), _set(["groups"], {}), _set(["groups", 0], 7), _set(["groups", 0, "layers"], [2]),
    _set(["groups", 0, "layers"], [2, 5, 5]), _set(["groups", 1, "layers"], [0, 1, 3.0]),
    _set(["groups", 1, "window"], 25), _set(["groups", 1, "window"], 0), _set(["groups", 1, "start"], 75),
    _set(["groups", 1, "T"], 23), _set(["groups", 1, "token_offset"], 75), _set(["groups", 0, "bytes"], 5),
    _set(["groups", 2, "bytes"], -1), _set(["groups", 1, "layers"], [0, 1, 4]),
    _set(["groups", 2, "layers"], [3]),
    lambda h: h["groups"].reverse(), lambda h: h["groups"].pop(),
    lambda h: h.pop("groups"), lambda h: h["groups"][0].pop("window"),
    lambda h: h["groups"][1].update(layers=[2, 5], window=None, start=0),
]


@pytest.mark.parametrize("i", range(len(EDITS)))
def test_bad_header_is_a_codec_error(i):
    k, v = make_kv(6, 100, v_scale=0.5)
    data = window.encode_windowed(k, v, WINDOWS, codec="cachegen")
    bad = _repack(data, EDITS[i])
    with pytest.raises(CodecError):
        window.decode_windowed(bad)


def test_random_corruption_is_a_codec_error():
    k, v = make_kv(6, 64, v_scale=0.5)
    data = window.encode_windowed(k, v, WINDOWS, codec="cachegen")
    rng = random.Random(0)
    for _ in range(60):
        b = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        with pytest.raises(CodecError):
            window.decode_windowed(bytes(b))
    for n in (0, 5, 40, len(data) // 2, len(data) - 1):
        with pytest.raises(CodecError):
            window.decode_windowed(data[:n])
    with pytest.raises(CodecError):
        window.decode_windowed("not bytes")
    with pytest.raises(CodecError):           # an ordinary container is not a windowed one
        window.decode_windowed(codec.encode_kv(k, v, codec="raw"))


def test_sub_container_swapped_is_a_codec_error():
    """A valid outer header whose group bytes are another KV's container of other shape."""
    k, v = make_kv(6, 100, v_scale=0.5)
    data = window.encode_windowed(k, v, WINDOWS, codec="raw")
    h, arrays, payload = bitstream.unpack(data)
    n0 = h["groups"][0]["bytes"]
    other = codec.encode_kv(k[[2, 5], :99], v[[2, 5], :99], codec="raw")
    h["groups"][0]["bytes"] = len(other)
    with pytest.raises(CodecError):
        window.decode_windowed(bitstream.pack(h, arrays, other + payload[n0:]))


def test_chunks_missing_or_out_of_order():
    k, v = make_kv(6, 100, v_scale=0.5)
    chunks = window.encode_windowed_chunks(k, v, WINDOWS, codec="raw", chunk_tokens=32)
    for bad in (chunks[:-1], chunks[1:], [chunks[1], chunks[0]] + chunks[2:], []):
        with pytest.raises(CodecError):
            window.decode_windowed_chunks(bad)
    other = window.encode_windowed_chunks(k, v, [None] * 6, codec="raw", chunk_tokens=32)
    with pytest.raises(CodecError):
        window.decode_windowed_chunks(chunks[:3] + other[3:])
    with pytest.raises(CodecError):           # one chunk of several is not a whole KV
        window.decode_windowed(chunks[0])
