"""A store entry is only ever served to the model and codec config that made it
(the identity of an entry is everything that shapes its KV).

Two models (different weights and KV shapes) and two codec configs share ONE store folder
(through the store server), ONE Redis and ONE local folder (the connector's local source);
each reader only ever gets its own entries, a request naming another model's key misses
with a reason, and a reused store after a codec schedule change misses (the key hashes the
full config). Tiny fake KV: chunk bytes name the writer, decode is the identity function.
Run: python -m pytest tests/streaming/test_store_identity.py -q
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from streaming.load import stream_load
from streaming.identity import (
    EntryIdentity,
    check_entry,
    codec_identity,
    folder_tokenizer_hash,
    folder_weights_hash,
    level_slot,
    merge_expected,
)
from streaming.store.folder import LocalFolderBackend
from streaming.errors import StoreError
from streaming.store import KVStoreServer, Manifest, StoreClient, entry_key
from streaming.store.redis_server import RedisServer, find_redis_server

IDS = list(range(1000, 1300))
RANGES = [(0, 128), (128, 256), (256, 300)]

MODEL_A = EntryIdentity(model_id="model-a", weights_hash="a" * 64, tokenizer_hash="t" * 64,
                        dtype="bfloat16", num_layers=30, num_kv_heads=3, head_dim=64)
MODEL_B = EntryIdentity(model_id="model-b", weights_hash="b" * 64, tokenizer_hash="t" * 64,
                        dtype="bfloat16", num_layers=4, num_kv_heads=2, head_dim=32)


def _ident(model: EntryIdentity, cfg: str) -> EntryIdentity:
    """cfg "s1" / "s2": two codec schedules of one fake codec (different config hashes)."""
    return model.replace(codec="fake", codec_version="1",
                         level_configs=((0, f"{cfg}-level0"), (1, f"{cfg}-level1")))


WRITERS = {(m, c): _ident(model, c) for m, model in (("A", MODEL_A), ("B", MODEL_B))
           for c in ("s1", "s2")}


def _chunks(tag: str) -> dict[int, list[bytes]]:
    return {lv: [f"{tag}|lv{lv}|chunk{i}".encode() * 8 for i in range(len(RANGES))] for lv in (0, 1)}


def _tag(ident: EntryIdentity) -> str:
    return f"{ident.model_id}/{ident.level_configs[0][1]}"


def _fill(client) -> dict[tuple[str, str], str]:
    return {w: client.put_entry(ident, IDS, _chunks(_tag(ident)), RANGES) for w, ident in WRITERS.items()}


def _check_isolation(client, keys: dict) -> None:
    """Every reader gets exactly its own bytes; any other writer's key is a miss."""
    assert len(set(keys.values())) == 4  # one key per (model, config)
    for reader, ident in WRITERS.items():
        for writer, key in keys.items():
            res = stream_load(client, key, 1, lambda b: b, identity=ident)
            if writer == reader:
                assert res.hit and not res.recompute_tokens
                assert all(d.startswith(_tag(ident).encode()) for d in res.decoded)
            else:
                assert not res.hit and res.decoded == []
                assert "mismatch" in res.reason
        # the reader's own key computed from its identity is the one stored
        assert entry_key(ident, IDS) == keys[reader]
        # only the model part known (a connector whose request gave just the key): the
        # other model's entries miss, its own model's entries of either config are served
        for writer, key in keys.items():
            m = client.get_manifest(key, identity=ident.model_part())
            assert (m is not None) == (writer[0] == reader[0]), client.last_miss_reason


def _changed_schedule_misses(client) -> None:
    old = _ident(MODEL_A, "s1")
    key = client.put_entry(old, IDS, _chunks("old"), RANGES)
    new = old.replace(level_configs=((0, "s1-level0"), (1, "s1-level1-CHANGED")))
    new_key = entry_key(new, IDS)
    assert new_key != key
    assert client.get_manifest(new_key, identity=new) is None  # the reused store: a miss
    # even asking for the old key with the new expectation: a miss, with the reason
    assert client.get_manifest(key, identity=new) is None
    assert "level 1 config mismatch" in client.last_miss_reason


# --------------------------------------------------------------------------- unit
def test_check_entry_fields_and_levels():
    a = _ident(MODEL_A, "s1")
    assert check_entry(a, a.to_dict()) is None
    assert check_entry(EntryIdentity(), None) is None  # nothing known, nothing checked
    assert "no identity" in check_entry(a, None)
    assert "model_id mismatch" in check_entry(MODEL_B.model_part(), a.to_dict())
    assert "weights_hash mismatch" in check_entry(MODEL_B.replace(model_id=""), a.to_dict())
    assert "head_dim" in check_entry(MODEL_A.replace(head_dim=128), a.to_dict())
    assert "level 0 config mismatch" in check_entry(_ident(MODEL_A, "s2"), a.to_dict())
    assert "level 3 not in the entry" in check_entry(a.replace(level_configs=((3, "x"),)), a.to_dict())
    assert "no tokenizer_hash" in check_entry(a, a.replace(tokenizer_hash="").to_dict())
    assert "malformed" in check_entry(a, {"num_layers": "many"})
    assert check_entry(MODEL_A.replace(model_id="").model_part(), a.to_dict()) is None
    with pytest.raises(ValueError, match="conflicting"):
        merge_expected(MODEL_A, {"weights_hash": "b" * 64})


def test_codec_tag_changes_with_every_field():
    a = _ident(MODEL_A, "s1")
    tags = {a.codec_tag()}
    for kw in ({"tokenizer_hash": "u"}, {"dtype": "float16"}, {"num_layers": 31},
               {"num_kv_heads": 4}, {"head_dim": 128}, {"codec": "fake2"}, {"codec_version": "2"},
               {"level_configs": ((0, "s1-level0"),)}, {"calibration_hash": "c" * 16}):
        tags.add(a.replace(**kw).codec_tag())
    assert len(tags) == 10
    assert entry_key(a, IDS) != entry_key(a.replace(weights_hash="c" * 64), IDS)
    with pytest.raises(ValueError, match="level_configs"):
        entry_key(MODEL_A.replace(codec="fake"), IDS)


def test_real_codec_schedule_change_changes_the_key():
    """codec.config_hash of a changed cachegen schedule (4 bins everywhere, the issue's
    coarse config) differs from the preset's level 1: the reused store misses."""
    codec = pytest.importorskip("codec")
    from codec.config import CodecConfig

    preset = codec_identity(MODEL_A, "cachegen", [1])
    coarse = codec_identity(MODEL_A, "cachegen", [1], config=CodecConfig.uniform(30, 4, 4, level=1))
    assert preset.level_configs != coarse.level_configs
    assert entry_key(preset, IDS) != entry_key(coarse, IDS)
    assert preset.codec_version == str(getattr(codec, "CODEC_VERSION", preset.codec_version))


def test_stored_level_numbers_resolve_once():
    """A codec without levels is stored under level None (its own slot, "none" in the
    identity's JSON), with its level None in the config hash; level 0 is cachegen's own
    level 0; None means the codec's default level (codec.resolve_level), stored under that
    level's own number."""
    codec = pytest.importorskip("codec")

    assert level_slot("raw", None) is None
    with pytest.raises(ValueError):
        level_slot("raw", 0)
    assert level_slot("cachegen", 0) == 0
    default = codec.resolve_level("cachegen", None)
    assert default is not None and level_slot("cachegen", None) == default
    raw = codec_identity(MODEL_A, "raw", [None])
    assert raw.levels == (None,)
    assert dict(raw.level_configs)[None] == codec.config_hash("raw", None, num_layers=MODEL_A.num_layers)
    assert list(raw.to_dict()["level_configs"]) == ["none"]
    assert EntryIdentity.from_dict(raw.to_dict()) == raw
    zero = codec_identity(MODEL_A, "cachegen", [0])
    assert zero.levels == (0,)
    assert codec_identity(MODEL_A, "cachegen", [None]).level_configs == \
        codec_identity(MODEL_A, "cachegen", [default]).level_configs
    assert dict(zero.level_configs)[0] != dict(codec_identity(MODEL_A, "cachegen", [default]).level_configs)[default]


def test_manifest_identity_must_match_its_key():
    a = _ident(MODEL_A, "s1")
    from streaming.store import build_manifest

    key, man = build_manifest(a.model_id, a.weights_hash, a.codec_tag(), IDS, _chunks("x"), RANGES,
                              identity=a)
    assert Manifest.from_dict(man).identity["weights_hash"] == "a" * 64
    forged = json.loads(json.dumps(man))
    forged["identity"]["weights_hash"] = "b" * 64  # claims another model under the same key
    with pytest.raises(StoreError, match="identity does not match"):
        Manifest.from_dict(forged)
    with pytest.raises(ValueError, match="level configs"):
        build_manifest(a.model_id, a.weights_hash, a.codec_tag(), IDS, {0: _chunks("x")[0]}, RANGES,
                       identity=a)


# --------------------------------------------------------------------------- the stores
@pytest.fixture
def store_server(tmp_path):
    """One store folder behind the TCP store server (in a thread)."""
    srv = KVStoreServer(LocalFolderBackend(tmp_path / "store"))
    srv.start_thread()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


def test_store_server_serves_each_only_its_own(store_server):
    with StoreClient(*store_server.address) as cl:
        _check_isolation(cl, _fill(cl))
        _changed_schedule_misses(cl)


def test_legacy_entry_without_identity_is_a_miss(store_server):
    with StoreClient(*store_server.address) as cl:
        key = cl.put_context("model-a", "a" * 64, "fake", IDS, _chunks("legacy"), RANGES)
        assert cl.get_manifest(key) is not None  # no expectation: served as before
        res = stream_load(cl, key, 1, lambda b: b, identity=MODEL_A)
        assert not res.hit and "no identity" in res.reason


@pytest.mark.skipif(find_redis_server() is None, reason="redis-server not installed "
                    "(apt-get install redis-server, or bash scripts/setup.sh)")
def test_redis_serves_each_only_its_own():
    from streaming.store.redis_client import RedisStoreClient

    with RedisServer() as srv, RedisStoreClient(srv.url) as cl:
        _check_isolation(cl, _fill(cl))
        _changed_schedule_misses(cl)


# --------------------------------------------------------------------------- connector side
def _model_folder(path, weights: bytes, vocab: str):
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(weights)
    (path / "tokenizer.json").write_text(vocab)
    return path


def _vllm_config(folder, layers, heads, dim):
    """A stand-in of vllm.config.VllmConfig with the attributes engine_identity reads."""
    mc = SimpleNamespace(model=str(folder), tokenizer=str(folder), dtype="torch.bfloat16",
                         get_total_num_kv_heads=lambda: heads, get_num_kv_heads=lambda pc: heads,
                         get_total_num_hidden_layers=lambda: layers,
                         get_num_layers=lambda pc: layers, get_head_size=lambda: dim)
    return SimpleNamespace(model_config=mc, parallel_config=None)


def test_folder_hash_equals_extraction_hash(tmp_path):
    folder = _model_folder(tmp_path / "m", b"\x01\x02" * 1000, '{"v": 1}')
    model = pytest.importorskip("kv_extraction_hf.model")
    assert folder_weights_hash(folder) == model.weights_hash(folder)
    assert folder_tokenizer_hash(folder) != folder_tokenizer_hash(tmp_path)  # "" without files


def test_connector_sources_check_their_own_model(tmp_path, store_server):
    """The connector's sources know their engine's model (sources.engine_identity from the
    vLLM config) and miss on another model's entry although the request gives only the
    context key - for the store source and the local-folder source alike."""
    from third_party.vllm.sources import (
        LocalDirSource,
        StoreSource,
        engine_identity,
        save_local_context,
    )

    fa = _model_folder(tmp_path / "a", b"weights of A" * 100, '{"vocab": "shared"}')
    fb = _model_folder(tmp_path / "b", b"weights of B" * 100, '{"vocab": "shared"}')
    own_a = engine_identity(_vllm_config(fa, 2, 1, 4), {})
    own_b = engine_identity(_vllm_config(fb, 2, 1, 4), {})  # same shape, other weights
    assert own_a.weights_hash == folder_weights_hash(fa) and own_a.dtype == "bfloat16"
    assert own_a.tokenizer_hash == own_b.tokenizer_hash != ""
    wa = own_a.replace(model_id="a", codec="fake", codec_version="1", level_configs=((0, "c"),))
    wb = own_b.replace(model_id="b", codec="fake", codec_version="1", level_configs=((0, "c"),))

    def decode(data: bytes):
        import torch

        n = 128 if data.endswith(b"-128") else 44
        t = torch.zeros(2, n, 1, 4)
        return t, t

    chunks = [b"x-128", b"y-128", b"z-44"]
    addr = "%s:%d" % store_server.address
    with StoreClient(*store_server.address) as cl:
        keys = {n: cl.put_entry(w, IDS, {0: chunks}, RANGES) for n, w in (("a", wa), ("b", wb))}
    for n, w in (("a", wa), ("b", wb)):
        save_local_context(tmp_path / "local", f"ctx-{n}", IDS, chunks, [128, 128, 44], identity=w)
    for own, mine, theirs in ((own_a, "a", "b"), (own_b, "b", "a")):
        store_src = StoreSource(decode, identity=own)
        local_src = LocalDirSource(tmp_path / "local", decode, identity=own)
        lk = store_src.lookup({"store": addr, "context_key": keys[mine]}, IDS + [7])
        assert lk.num_tokens == 300
        got = []
        st = store_src.load({"store": addr, "context_key": keys[mine]}, lk, 256,
                            lambda s, k, v: got.append(s))
        assert got == [0, 128] and st.loaded_tokens == 256
        lk = store_src.lookup({"store": addr, "context_key": keys[theirs]}, IDS + [7])
        assert lk.num_tokens == 0 and "weights_hash mismatch" in lk.info["miss"]
        assert local_src.lookup({"context_key": f"ctx-{mine}"}, IDS).num_tokens == 300
        lk = local_src.lookup({"context_key": f"ctx-{theirs}"}, IDS)
        assert lk.num_tokens == 0 and "weights_hash mismatch" in lk.info["miss"]
        # a request claiming another model than the engine's own: a miss, not a load
        lk = store_src.lookup({"store": addr, "context_key": keys[mine],
                               "weights_hash": "c" * 64}, IDS)
        assert lk.num_tokens == 0 and "conflicting" in lk.info["miss"]
    # an entry without identity (a local folder written before identities): a miss
    save_local_context(tmp_path / "local", "legacy", IDS, chunks, [128, 128, 44])
    lk = LocalDirSource(tmp_path / "local", decode, identity=own_a).lookup({"context_key": "legacy"}, IDS)
    assert lk.num_tokens == 0 and "no identity" in lk.info["miss"]
