"""``python -m bench.operating_points``: fits (then loads) a model's operating points and
prints them; a target no level meets is one ``error:`` line and exit 2. On a tiny random
Llama with tiny calibration windows (no download).

Run: .venv/bin/python -m pytest tests/bench/test_operating_points_cli.py -q
"""
from __future__ import annotations

import json

import pytest

from bench import operating_points as cli
from kv_extraction_hf.calibrate import operating_points as fit

SETTINGS = {"windows": 4, "context_tokens": 48, "continuation_tokens": 8, "seed": 0, "skip_tokens": 64}


@pytest.fixture
def tiny_env(monkeypatch, tmp_path):
    import kv_extraction_hf.model
    from tests.helpers.tiny_llama import tiny_llama_bundle

    bundle = tiny_llama_bundle()
    monkeypatch.setattr(kv_extraction_hf.model, "load_model", lambda *a, **k: bundle)
    monkeypatch.setattr(fit, "TARGET_FIT_SETTINGS", SETTINGS)
    monkeypatch.setenv("CACHEGEN_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_points_are_printed_and_written(tiny_env, capsys):
    out = tiny_env / "points.json"
    assert cli.main(["--target", "kl:0.5", "kl:2", "--codecs", "cachegen", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [p["target"] for p in doc["points"]] == ["kl:0.5", "kl:2"]
    assert all(p["table"] == doc["table"] and p["codec"] == "cachegen" for p in doc["points"])
    # a looser target never picks a larger size
    assert doc["points"][1]["ratio"] >= doc["points"][0]["ratio"]
    assert f"operating-point table {doc['table']}" in capsys.readouterr().out


def test_unmet_target_is_one_line_and_exit_2(tiny_env, capsys):
    assert cli.main(["--target", "kl:1e-9", "--codecs", "cachegen"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no level of cachegen meets kl:1e-09") and "\n" not in err
    assert cli.main(["--target", "best", "--codecs", "cachegen"]) == 2
    assert "unknown quality target" in capsys.readouterr().err
