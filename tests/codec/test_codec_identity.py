"""One meaning per parameter and device checks.

- ``level``: one scale per codec, ``None`` = the codec's default resolved in ONE function
  (``codec.resolve_level``), no 0/-1 sentinels;
- ``chunk_tokens``: one default (``codec.DEFAULT_CHUNK_TOKENS``), boundaries from
  ``codec.chunk_bounds``, each chunk header records its real length and the split size;
- ``codec.config_hash``: changes with everything that changes the bytes, nothing else;
- ``device``: validated before any work (ValueError, one line)."""
from __future__ import annotations

import pytest
import torch

import codec
from codec import api
from tests.helpers.kv import make_kv


# ------------------------------------------------------------------------------ level
def test_levels_and_defaults_per_codec():
    assert codec.levels("cachegen") == (0, 1, 2, 3, 4, 5)
    assert codec.default_level("cachegen") == 1
    assert codec.levels("cachegen-ref") == (0, 1, 2, 3)
    assert codec.default_level("cachegen-ref") == 0
    for name in ("raw", "fp8", "quant8", "kivi2", "kivi4"):
        assert codec.levels(name) == () and codec.default_level(name) is None
        assert codec.resolve_level(name, None) is None
        with pytest.raises(ValueError, match="no levels"):
            codec.resolve_level(name, 0)
    for name in codec.CODECS:               # every registered codec follows the rule
        lv = codec.levels(name)
        d = codec.default_level(name)
        assert (d is None) == (not lv) and (d is None or d in lv)
        assert codec.resolve_level(name) == d


def test_resolve_level_rejects_sentinels_and_unknown_levels():
    for bad in (-1, 6, 99):
        with pytest.raises(ValueError, match="unknown level"):
            codec.resolve_level("cachegen", bad)
    for bad in (True, 1.0, "1"):
        with pytest.raises(ValueError, match="int or None"):
            codec.resolve_level("cachegen", bad)
    with pytest.raises(ValueError, match="unknown codec"):
        codec.resolve_level("cachegen2", None)


def test_level_none_encodes_as_the_default_and_header_says_so():
    k, v = make_kv(2, 300)
    for name in ("cachegen", "cachegen-ref"):
        a = codec.encode_kv(k, v, codec=name)
        b = codec.encode_kv(k, v, codec=name, level=codec.default_level(name))
        assert a == b
        assert codec.peek_header(a)["level"] == codec.default_level(name)
    assert codec.peek_header(codec.encode_kv(k, v, codec="quant8"))["level"] is None


# ----------------------------------------------------------------------- chunk_tokens
def test_chunk_bounds():
    assert codec.DEFAULT_CHUNK_TOKENS == 1024
    assert codec.chunk_bounds(1) == [(0, 1)]
    assert codec.chunk_bounds(2048) == [(0, 1024), (1024, 2048)]
    assert codec.chunk_bounds(300, 128) == [(0, 128), (128, 256), (256, 300)]
    assert codec.chunk_bounds(2500) == codec.chunk_bounds(2500, codec.DEFAULT_CHUNK_TOKENS)
    for bad in (0, 100, -16, True, 16.0):
        with pytest.raises(ValueError, match="chunk_tokens"):
            codec.chunk_bounds(100, bad)
    with pytest.raises(ValueError, match="num_tokens"):
        codec.chunk_bounds(0, 16)


@pytest.mark.parametrize("name", ["raw", "kivi2", "cachegen", "cachegen-ref"])
def test_chunk_headers_record_real_length_and_split(name):
    k, v = make_kv(2, 300)
    chunks = codec.encode_chunks(k, v, codec=name, chunk_tokens=128)
    hs = [codec.peek_header(c) for c in chunks]
    assert [(h["token_offset"], h["token_offset"] + h["T"]) for h in hs] == \
        codec.chunk_bounds(300, 128)
    assert [h["T"] for h in hs] == [128, 128, 44]
    assert all(h["chunk_tokens"] == 128 for h in hs)
    for h in hs:   # the stored quantizer config no longer claims 1024-token chunks
        assert h["config"] is None or "chunk_tokens" not in h["config"]
    assert codec.peek_header(codec.encode_kv(k, v, codec=name))["chunk_tokens"] == 300


# ------------------------------------------------------------------------ config_hash
def test_config_hash_identity():
    h = codec.config_hash
    assert h("cachegen") == h("cachegen", None) == h("cachegen", 1)
    assert len(h("cachegen")) == 16 and int(h("cachegen"), 16) >= 0
    assert len({h("cachegen", lv) for lv in codec.levels("cachegen")}) == 6
    assert h("cachegen", 0) != h("cachegen-ref", 0)
    assert len({h(n) for n in ("raw", "fp8", "quant8", "kivi2", "kivi4")}) == 5
    # depth-specific identity; the preset hash differs from any single depth's
    assert h("cachegen", 1, num_layers=30) == h("cachegen", None, num_layers=30)
    assert h("cachegen", 1, num_layers=30) != h("cachegen", 1, num_layers=28)
    # an explicit config: same as the preset it equals at that depth
    cfg = codec.CodecConfig.for_model(30, 2)
    assert h("cachegen", config=cfg) == h("cachegen", 2, num_layers=30)
    # chunk_tokens only decides the split: not part of the identity
    assert h("cachegen", config=cfg.replace(chunk_tokens=128)) == h("cachegen", config=cfg)
    # anything that changes the bytes changes the hash
    assert h("cachegen", config=cfg.replace(sink_tokens=0)) != h("cachegen", config=cfg)
    assert h("cachegen", config=cfg.replace(channels_per_stream=4)) != h("cachegen", config=cfg)
    coarse = codec.CodecConfig.uniform(30, 4, 4, level=1, scale_group="chunk_head",
                                       sink_tokens=4, variant="harness")
    assert h("cachegen", config=coarse) != h("cachegen", 1, num_layers=30)
    with pytest.raises(ValueError):
        h("raw", 1)
    with pytest.raises(ValueError):
        h("cachegen", 9)
    with pytest.raises(ValueError, match="layers"):
        h("cachegen", config=cfg, num_layers=12)


def test_config_hash_follows_codec_and_format_versions(monkeypatch):
    before = codec.config_hash("cachegen")
    monkeypatch.setattr(api, "CODEC_VERSION", api.CODEC_VERSION + 1)
    assert codec.config_hash("cachegen") != before
    monkeypatch.undo()
    from codec import bitstream

    monkeypatch.setattr(bitstream, "FORMAT_VERSION", bitstream.FORMAT_VERSION + 1)
    assert codec.config_hash("cachegen") != before


def test_config_hash_changes_when_a_schedule_table_changes(monkeypatch):
    """A reused store after a schedule change must miss: editing the level table changes
    the preset hash even when the caller does not pass num_layers."""
    from codec import schedules as C

    before = codec.config_hash("cachegen", 1)
    monkeypatch.setitem(C.HARNESS_LEVELS, 1, (4, 4))
    assert codec.config_hash("cachegen", 1) != before


def test_codec_version_is_in_every_header():
    k, v = make_kv(2, 20)
    for name in ("raw", "cachegen"):
        assert codec.peek_header(codec.encode_kv(k, v, codec=name))["codec_version"] == \
            codec.CODEC_VERSION


# ----------------------------------------------------------------------------- device
def _no_work(*a, **kw):
    raise AssertionError("work started before the device was validated")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without usable CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda")])
def test_decode_validates_cuda_device_before_any_work(device, monkeypatch):
    k, v = make_kv(2, 20)
    data = codec.encode_kv(k, v)
    monkeypatch.setattr(api, "_read", _no_work)
    monkeypatch.setattr(api, "peek_header", _no_work)
    for fn, arg in ((codec.decode_kv, data), (codec.decode_chunk, data),
                    (codec.decode_chunks, [data])):
        with pytest.raises(ValueError, match="CUDA") as e:
            fn(arg, device=device)
        assert "\n" not in str(e.value) and not isinstance(e.value, codec.CodecError)


@pytest.mark.parametrize("device", ["gpu", "cuda:x", 3.5, "meta"])
def test_decode_rejects_bad_devices_with_one_line(device, monkeypatch):
    monkeypatch.setattr(api, "_read", _no_work)
    with pytest.raises(ValueError) as e:
        codec.decode_kv(b"whatever", device=device)
    assert "\n" not in str(e.value)


def test_cpu_device_forms_work():
    k, v = make_kv(2, 20)
    data = codec.encode_kv(k, v, codec="raw")
    for dev in ("cpu", torch.device("cpu"), "cpu:0"):
        k2, _ = codec.decode_kv(data, device=dev)
        assert torch.equal(k2, k)
