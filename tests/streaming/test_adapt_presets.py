"""One adaptive policy: the frozen parameter object
streaming.adapt.params.PolicyParams with named presets is what the TTFT run (harness),
bench.adapt and the vLLM connector build AdaptivePolicy from; the connector's trust layer
allows exactly its fields (plus "preset" and the per-request measurements); results say
which preset ran.

Run: .venv/bin/python -m pytest tests/streaming/test_adapt_presets.py -q
"""
from __future__ import annotations

import dataclasses
import inspect
from types import SimpleNamespace

import pytest

from streaming.adapt import AdaptivePolicy
from streaming.adapt.params import (
    DEFAULT_PRESET,
    POLICY_INPUTS,
    POLICY_PRESETS,
    POLICY_REQUEST_KEYS,
    PolicyInputs,
    PolicyParams,
    split_policy_args,
)
from third_party.vllm.trust import POLICY_KEYS, RequestRejected, validate_request

REQ = {"slo_s": 1.0, "prefill_tokens_per_s": 1000.0, "initial_throughput_mbps": 100.0}
EXTRA = {"stores": {"main": "127.0.0.1:1"}}  # an operator config with one store


def test_trust_allow_list_is_exactly_the_parameter_objects_fields():
    assert set(POLICY_KEYS) == {"preset"} | set(POLICY_INPUTS) | set(PolicyParams.field_names())
    assert len(POLICY_KEYS) == len(set(POLICY_KEYS)) and tuple(POLICY_KEYS) == POLICY_REQUEST_KEYS
    # the 12 tuned keys the old allow-list refused are allowed now
    for k in ("slo_reserve_s", "min_plan_frac", "after_abandon", "probe_level", "defer_text",
              "early_abandon", "partial_sample", "dip_chunks"):
        assert k in POLICY_KEYS


def test_policy_takes_one_inputs_object_and_one_params_object():
    """AdaptivePolicy(inputs, params): the per-request measurements are PolicyInputs (its
    scalar fields are exactly POLICY_INPUTS, plus the tables given in code), the tuned values
    PolicyParams, whose defaults are the "default" preset."""
    sig = inspect.signature(AdaptivePolicy.__init__).parameters
    assert list(sig) == ["self", "inputs", "params"] and sig["params"].default == "default"
    assert tuple(f.name for f in dataclasses.fields(PolicyInputs))[:len(POLICY_INPUTS)] == POLICY_INPUTS
    assert {f.name for f in dataclasses.fields(PolicyInputs)} == set(POLICY_INPUTS) | {
        "levels", "decode_s_per_token", "utility"}
    assert POLICY_PRESETS["default"] == PolicyParams()
    pol = AdaptivePolicy(PolicyInputs(1.0, 1000.0, 100.0))
    assert pol.params == PolicyParams() and pol.preset == "default"


@pytest.mark.parametrize("field, value, word", [
    ("min_plan_frac", 0.0, "min_plan_frac"), ("slo_margin", 1.0, "slo_margin"),
    ("slo_reserve_s", -0.1, "slo_reserve_s"), ("slo_reserve_frac", 1.0, "slo_reserve_frac"),
    ("probe_backoff", 0.5, "probe_backoff"), ("probe_deadline_frac", 0.0, "probe_deadline_frac"),
    ("dip_chunks", -1.0, "dip_chunks"), ("risk_z", -1.0, "risk_z"), ("early_min_bytes", 0, "early_min_bytes"),
    ("window", 0, "window"),
])
def test_params_out_of_range_are_refused_where_they_are_made(field, value, word):
    with pytest.raises(ValueError, match=word):
        PolicyParams().with_(**{field: value})
    with pytest.raises(ValueError, match=word):  # a request's override fails the same way
        split_policy_args(dict(REQ, **{field: value}))


def test_presets_are_frozen_and_tuned_is_what_readme_reports():
    t = POLICY_PRESETS["tuned"]
    assert (t.slo_reserve_s, t.robust, t.min_plan_frac) == (0.3, False, 0.3)
    d = POLICY_PRESETS["default"]
    assert (d.slo_reserve_s, d.robust, d.min_plan_frac) == (0.0, True, 0.5)
    assert POLICY_PRESETS["tuned-dip"] == t.with_(dip_chunks=5, dip_min_samples=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.slo_reserve_s = 0.0
    assert DEFAULT_PRESET == "tuned"
    from bench import adapt as B

    assert B.SLO_RESERVE_S == t.slo_reserve_s and not hasattr(B, "POLICY_PARAMS")


@pytest.mark.parametrize("policy", [
    dict(REQ, preset="tuned"),
    dict(REQ, preset="tuned", **POLICY_PRESETS["tuned"].as_dict()),  # every field spelled out
    dict(REQ, preset="default", slo_reserve_s=0.3, robust=False, min_plan_frac=0.3),
    dict(REQ),
])
def test_request_with_a_preset_is_accepted_and_runs_it(policy):
    p = validate_request({"context_key": "k", "policy": policy}, EXTRA)
    pol = AdaptivePolicy.from_request(p["policy"])
    assert (pol.params.slo_reserve_s, pol.params.robust, pol.params.min_plan_frac) == (0.3, False, 0.3)
    assert pol.preset in ("tuned", "default+overrides")


@pytest.mark.parametrize("policy, word", [
    (dict(REQ, preset="best"), "preset must be one of"),
    (dict(REQ, robust="no"), "true or false"),
    (dict(REQ, after_abandon="never"), "must be one of"),
    (dict(REQ, window=2.5), "integer"),
    (dict(REQ, slo_reserve_s=float("nan")), "finite number"),
    (dict(REQ, levels=[1]), "not allowed"),
    (dict(REQ, decode_s_per_token={"0": 1}), "not allowed"),
])
def test_bad_policy_is_rejected(policy, word):
    with pytest.raises(RequestRejected, match=word):
        validate_request({"context_key": "k", "policy": policy}, EXTRA)


def test_presets_by_name_and_split():
    pol = AdaptivePolicy(PolicyInputs(1.0, 1000.0, 100.0), "tuned")
    assert pol.preset == "tuned" and pol.params == POLICY_PRESETS["tuned"]
    assert AdaptivePolicy(PolicyInputs(1.0, 1000.0, 100.0), PolicyParams(window=8)).preset is None
    name, p, inputs = split_policy_args(dict(REQ, preset="tuned-dip", window=8))
    assert name == "tuned-dip" and p.window == 8 and p.dip_chunks == 5 and inputs == REQ
    with pytest.raises(ValueError, match="unknown policy preset"):
        AdaptivePolicy(PolicyInputs(1.0, 1000.0, 100.0), "best")
    with pytest.raises(ValueError, match="needs"):
        AdaptivePolicy.from_request({"preset": "tuned"})


def test_harness_passes_the_preset_through_to_the_policy_that_runs():
    """run_benchmarks' cachegen-adaptive row: RunConfig.policy_preset (default "tuned") ->
    kv_transfer_params["policy"]["preset"] -> the trust check -> the connector's source
    builds the tuned policy; results.json's config records the preset."""
    from harness.config import ConfigError, RunConfig
    from harness.contexts import Variant
    from harness.engines import request_params
    from third_party.vllm.sources import StoreSource

    ctx = SimpleNamespace(keys={"cachegen": "K"}, identities={}, load_tokens=256, cid="c0")
    info = SimpleNamespace(model_id="m", weights_hash="w")
    for name, want in (("tuned", (0.3, False, 0.3)), ("default", (0.0, True, 0.5))):
        cfg = RunConfig(slo_s=2.0, policy_preset=name)
        assert cfg.to_dict()["policy_preset"] == name
        params = request_params(Variant("cachegen-adaptive"), ctx, "h:1", info, cfg, 100.0, 50.0)
        checked = validate_request(dict(params, store="main"), EXTRA)
        pol = StoreSource._policy(None, checked, None)
        assert pol.preset == name and (pol.params.slo_reserve_s, pol.params.robust, pol.params.min_plan_frac) == want
    assert RunConfig().policy_preset == "tuned"
    with pytest.raises(ConfigError, match="policy_preset"):
        RunConfig(policy_preset="best")
