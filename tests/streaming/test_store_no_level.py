"""A codec without levels (raw, quant8, kivi, ...) is stored under level None, its own slot
("none" in chunk keys and manifest object keys, null in manifest level lists and on the
store wire), never under level 0, which is a real level of the codecs with levels
(cachegen 0 = highest quality). Entries of the previous manifest format (which stored such
a codec under 0) are clean misses; a malformed level is a one-line StoreError.

Run: python -m pytest -q tests/streaming/test_store_no_level.py
"""

from __future__ import annotations

import json
import socket

import pytest

from streaming.errors import StoreError
from streaming.identity import (
    NO_LEVEL_KEY,
    EntryIdentity,
    check_entry,
    codec_identity,
    level_key,
    parse_level_key,
)
from streaming.load import stream_load
from streaming.store import KVStoreServer, LocalStoreClient, Manifest, StoreClient, entry_key
from streaming.store.folder import LocalFolderBackend
from streaming.store.format import chunk_key, manifest_key
from streaming.store.protocol import FrameType, recv_frame, send_frame
from streaming.store.redis_server import RedisServer, find_redis_server

IDS = list(range(2000, 2300))
RANGES = [(0, 128), (128, 256), (256, 300)]
MODEL = EntryIdentity(model_id="model-n", weights_hash="c" * 64, tokenizer_hash="t" * 64,
                      dtype="bfloat16", num_layers=30, num_kv_heads=3, head_dim=64)
KEY = "ab" * 32
GEN = "0123456789abcdef" * 2


def _raw_identity() -> EntryIdentity:
    pytest.importorskip("codec")
    return codec_identity(MODEL, "raw", [None])


def _chunks(tag: str) -> list[bytes]:
    return [f"{tag}|chunk{i}|".encode() * 16 for i in range(len(RANGES))]


# --------------------------------------------------------------------------- key forms
def test_no_level_and_level_zero_are_distinct_slots():
    """Level 0 of cachegen and the no-level slot of raw never share a chunk key."""
    assert chunk_key(KEY, None, 3) == f"ctx/{KEY}/chunk/none/3"
    assert chunk_key(KEY, 0, 3) == f"ctx/{KEY}/chunk/0/3"
    assert chunk_key(KEY, None, 3, GEN) == f"ctx/{KEY}/g/{GEN}/none/3"
    assert chunk_key(KEY, 0, 3, GEN) == f"ctx/{KEY}/g/{GEN}/0/3"
    for bad in (-1, "0", "none", 1.0, True):
        with pytest.raises(ValueError):
            chunk_key(KEY, bad, 0)
    assert level_key(None) == NO_LEVEL_KEY == "none" and level_key(0) == "0"
    assert parse_level_key("none") is None and parse_level_key("0") == 0 and parse_level_key("12") == 12
    for bad in ("None", "-1", "03", " 3", "", "zero", "٣"):
        with pytest.raises(ValueError):
            parse_level_key(bad)
    raw = _raw_identity()
    zero = codec_identity(MODEL, "cachegen", [0])
    assert raw.levels == (None,) and zero.levels == (0,)
    assert raw.to_dict()["level_configs"].keys() == {"none"}
    assert zero.to_dict()["level_configs"].keys() == {"0"}
    assert EntryIdentity.from_dict(raw.to_dict()) == raw
    with pytest.raises(ValueError, match="mixes"):
        EntryIdentity(codec="x", level_configs={None: "a", 0: "b"})
    # an identity written the old way (raw under "0") is not the no-level slot
    old = dict(raw.to_dict(), level_configs={"0": raw.to_dict()["level_configs"]["none"]})
    assert "level none not in the entry" in check_entry(raw, old)
    assert check_entry(raw, raw.to_dict(), levels=[None]) is None
    assert "level 0 not in the entry" in check_entry(raw, raw.to_dict(), levels=[0])


# --------------------------------------------------------------------------- manifests
def _manifest(ident: EntryIdentity) -> dict:
    from streaming.store import build_manifest

    _, man = build_manifest(ident.model_id, ident.weights_hash, ident.codec_tag(), IDS, {None: _chunks("m")},
                            RANGES, identity=ident)
    return man


def test_manifest_json_form_of_no_level():
    man = _manifest(_raw_identity())
    assert man["format"] == "cgh-manifest-v3"
    assert man["levels"] == [None]
    assert set(man["sizes"]) == set(man["crc32"]) == set(man["sha256"]) == {"none"}
    m = Manifest.from_dict(json.loads(json.dumps(man)))
    assert m.levels == (None,) and m.sizes[None] == tuple(len(c) for c in _chunks("m"))
    assert Manifest.from_dict(m.to_dict()) == m
    assert all("/none/" in k for k in m.chunk_keys())


@pytest.mark.parametrize("edit, match", [
    (lambda d: d["sizes"].update({"zero": d["sizes"].pop("none")}), "sizes: a stored level key"),
    (lambda d: d["crc32"].update({"-1": d["crc32"].pop("none")}), "crc32: a stored level key"),
    (lambda d: d.update(levels=["none"]), "levels: a stored level is"),
    (lambda d: d.update(levels=[None, 0]), "mixes the no-level slot"),
    (lambda d: d.update(levels=[None, None]), "lists a level twice"),
])
def test_malformed_level_is_a_one_line_store_error(edit, match):
    man = _manifest(_raw_identity())
    edit(man)
    with pytest.raises(StoreError, match=match) as ei:
        Manifest.from_dict(man)
    assert "\n" not in str(ei.value)


def _plant_old_format(backend, ident: EntryIdentity) -> str:
    """An entry as the previous format wrote raw: manifest cgh-manifest-v2, levels [0],
    per-level keys "0", chunks under level 0."""
    man = _manifest(ident)
    key = man["key"]
    man.update(format="cgh-manifest-v2", levels=[0], gen=GEN)
    for name in ("sizes", "crc32", "sha256"):
        man[name] = {"0": man[name]["none"]}
    man["identity"]["level_configs"] = {"0": man["identity"]["level_configs"]["none"]}
    for i, c in enumerate(_chunks("m")):
        backend.put(chunk_key(key, 0, i, GEN), c)
    backend.put(manifest_key(key, GEN), json.dumps(man).encode())
    backend.put(manifest_key(key), json.dumps(man).encode())
    return key


# --------------------------------------------------------------------------- the stores
def _round_trip(client, backend) -> None:
    """Store raw under the no-level slot, read it back, and miss an old-format entry."""
    ident = _raw_identity()
    key = client.put_entry(ident, IDS, {None: _chunks("raw")}, RANGES)
    assert key == entry_key(ident, IDS)
    m = client.get_manifest(key, identity=ident)
    assert m is not None and m.levels == (None,)
    assert client.get_chunk(key, None, 1, m.gen) == _chunks("raw")[1]
    assert client.get_chunk(key, 0, 1, m.gen) is None  # level 0 is another slot
    if backend is not None:
        assert any(f"/g/{m.gen}/none/" in k for k in backend.keys(f"ctx/{key}/"))
        assert not any(f"/g/{m.gen}/0/" in k for k in backend.keys(f"ctx/{key}/"))
    res = stream_load(client, key, NO_LEVEL_KEY, lambda b: b, identity=ident)
    assert res.hit and not res.recompute_tokens, res.reason
    assert res.decoded == _chunks("raw")
    assert [c.level for c in res.chunks] == [None] * len(RANGES)
    assert not any(c.text_fallback for c in res.chunks)
    with pytest.raises(ValueError, match="not stored"):  # level 0 is not this entry's slot
        stream_load(client, key, 0, lambda b: b, identity=ident)
    if backend is not None:
        old = _plant_old_format(backend, ident)
        assert client.get_manifest(old, identity=ident) is None
        assert "previous format" in client.last_miss_reason
        res = stream_load(client, old, NO_LEVEL_KEY, lambda b: b, identity=ident)
        assert not res.hit and "previous format" in res.reason


def test_folder_store_round_trip(tmp_path):
    backend = LocalFolderBackend(tmp_path / "store")
    _round_trip(LocalStoreClient(backend), backend)


@pytest.fixture
def store_server(tmp_path):
    srv = KVStoreServer(LocalFolderBackend(tmp_path / "store"))
    srv.start_thread()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


def test_store_server_round_trip(store_server):
    with StoreClient(*store_server.address) as cl:
        _round_trip(cl, store_server.store.backend)


def test_store_server_wire_level_is_typed(store_server):
    """On the wire a level is a typed JSON field: null = no level; absent or a string is
    refused (ERR), never read as a level."""
    with StoreClient(*store_server.address) as cl:
        cl.put_chunk(KEY, None, 0, b"no-level")
        cl.put_chunk(KEY, 0, 0, b"level-0")
        assert cl.get_chunk(KEY, None, 0) == b"no-level"
        assert cl.get_chunk(KEY, 0, 0) == b"level-0"
    with socket.create_connection(store_server.address, timeout=10) as s:
        for meta in ({"key": KEY, "index": 0}, {"key": KEY, "level": "none", "index": 0},
                     {"key": KEY, "level": "0", "index": 0}, {"key": KEY, "level": -1, "index": 0}):
            send_frame(s, FrameType.GET_CHUNK, meta)
            f = recv_frame(s)
            assert f.type == FrameType.ERR and "level" in f.meta["error"], (meta, f.meta)
        send_frame(s, FrameType.GET_CHUNK, {"key": KEY, "level": None, "index": 0})
        f = recv_frame(s)
        assert f.type == FrameType.OK and bytes(f.body) == b"no-level"


@pytest.mark.skipif(find_redis_server() is None, reason="redis-server not installed "
                    "(apt-get install redis-server, or bash scripts/setup.sh)")
def test_redis_round_trip():
    from streaming.store.redis_client import RedisStoreClient

    with RedisServer() as srv, RedisStoreClient(srv.url) as cl:
        _round_trip(cl, cl.backend)
