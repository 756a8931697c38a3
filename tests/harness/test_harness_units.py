"""Unit tests of the harness stages with fakes: no model load, no link, no engine.

Covers harness.contexts (variants, store levels, prefix and chunk arithmetic),
harness.engines (request protocol, adaptive decisions merged for both engines),
harness.quality (registry-driven scoring), harness.adaptation (SLO, traces, rows),
harness.results (run records, complete flag, table), evaluation.summary (one
aggregation rule per metric) and run_benchmarks' interrupt message.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import run_benchmarks
from evaluation import metrics as M
from evaluation.summary import aggregate_metric, higher_is_better, plot_label, summarize
from harness.adaptation import adaptation_rows, load_traces, slo_violated
from harness.config import ConfigError, RunConfig
from harness.contexts import (BenchmarkError, Context, Variant, chunk_ranges, load_prefix,
                              store_levels, variants)
from harness.engines import RequestTiming, merge_decisions, request_params, timing_from_connector
from harness.lifecycle import Terminated
from harness.quality import score_output
from harness.results import ResultsWriter, run_record, summary_table, validate
from streaming.adapt.traces import Trace


def _timing(**kw) -> RequestTiming:
    base = dict(ttft_s=1.0, lookup_s=0.01, transfer_s=0.3, decode_s=0.2, load_s=0.4, inject_s=0.05,
                prefill_s=0.5, first_token_s=0.01, e2e_s=2.0, output_ids=[5, 6, 7], loaded_tokens=256,
                bytes=1000, chunks=[])
    base.update(kw)
    return RequestTiming(**base)


def _prompt(**kw):
    base = dict(task="needle", answer="blue lantern", answers=[], metric="retrieval_accuracy",
                context_ids=list(range(300)), question_ids=[1, 2, 3], input_ids=list(range(303)),
                max_new_tokens=8, meta={})
    base.update(kw)
    return SimpleNamespace(**base)


def _ctx(**kw) -> Context:
    c = Context("needle-0", _prompt(), None, None, 256, keys={"cachegen": "K1", "raw": "K2"},
                dtype_bytes=256 * 4000)
    c.sizes[("cachegen", 1)] = 900
    for k, v in kw.items():
        setattr(c, k, v)
    return c


# ----------------------------------------------------------------------------- contexts
def test_variants_text_first_and_levels_expanded():
    cfg = RunConfig(modes=("raw", "cachegen", "text", "cachegen-adaptive"), levels=(0, 3))
    got = variants(cfg, (0, 1, 2, 3, 4, 5))
    assert [v.label for v in got] == ["text", "raw", "cachegen-l0", "cachegen-l3", "cachegen-adaptive"]
    assert [v.codec for v in got] == [None, "raw", "cachegen", "cachegen", "cachegen"]
    all_levels = variants(RunConfig(modes=("cachegen",), levels=None), (0, 1, 2))
    assert [v.level for v in all_levels] == [0, 1, 2]


def test_store_levels_union_for_adaptive():
    cfg = RunConfig(modes=("text", "raw", "cachegen", "cachegen-adaptive"), levels=(1, 4))
    got = store_levels(variants(cfg, (0, 1, 2, 3, 4, 5)), cfg, (0, 1, 2, 3, 4, 5))
    assert got == {"raw": [None], "cachegen": [1, 4]}
    only_adaptive = RunConfig(modes=("cachegen-adaptive",), levels=None)
    assert store_levels(variants(only_adaptive, (0, 1)), only_adaptive, (0, 1)) == {"cachegen": [0, 1]}


def test_variants_and_store_levels_with_kvtc():
    cfg = RunConfig(modes=("text", "cachegen", "kvtc"), levels=(1,), kvtc_levels=(3, 5))
    got = variants(cfg, (0, 1, 2), (0, 1, 2, 3, 4, 5))
    assert [v.label for v in got] == ["text", "cachegen-l1", "kvtc-l3", "kvtc-l5"]
    assert [v.codec for v in got] == [None, "cachegen", "kvtc", "kvtc"]
    assert store_levels(got, cfg, (0, 1, 2)) == {"cachegen": [1], "kvtc": [3, 5]}
    every = variants(RunConfig(modes=("kvtc",), kvtc_levels=None), (0, 1), (2, 4))
    assert [v.level for v in every] == [2, 4]
    assert RunConfig(modes=("kvtc",), kvtc_levels=(3, 4, 5), quick=True).quick_variant().kvtc_levels == (3, 4)


def test_populate_store_identity_carries_kvtc_calibration_hash():
    import torch

    from codec import kvtc
    from harness.contexts import populate_store

    from tests.helpers.kv import mixed_kv

    L, N, H, D = 2, 256, 2, 8
    k, v = mixed_kv(L, N, H, D, seed=0)
    cal = kvtc.fit_calibration(k, v, sink_tokens=0, recent_tokens=0)
    puts = []
    client = SimpleNamespace(put_entry=lambda ident, ids, chunks, ranges, meta: puts.append(ident) or "key")
    info = SimpleNamespace(model_id="m", weights_hash="w" * 64, tokenizer_hash="", dtype="bfloat16",
                           num_layers=L, num_kv_heads=H, head_dim=D)
    ctx = _ctx(k=k[:, :128].to(torch.bfloat16).contiguous(), v=v[:, :128].to(torch.bfloat16).contiguous(),
               load_tokens=128, prompt=_prompt(context_ids=list(range(130))))
    # the calibration is an argument of the encode, never found by shape
    populate_store(RunConfig(chunk_tokens=128, block_tokens=128), client, info, [ctx],
                   {"kvtc": [3, 4], "raw": [None]},
                   configs={"kvtc": kvtc.KvtcConfig(calibration=cal)})
    by_codec = {i.codec: i for i in puts}
    assert by_codec["kvtc"].calibration_hash == cal.hash
    assert by_codec["raw"].calibration_hash == ""
    assert ctx.identities["kvtc"]["calibration_hash"] == cal.hash
    assert {("kvtc", 3), ("kvtc", 4), ("raw", None)} <= set(ctx.sizes)
    # another calibration gives another store key (a stale entry misses)
    assert by_codec["kvtc"].codec_tag() != by_codec["kvtc"].replace(calibration_hash="0" * 64).codec_tag()
    # without its calibration the kvtc encode fails: with a failures list it is recorded
    # and the other codecs are stored; without one it is a BenchmarkError
    from harness.contexts import BenchmarkError

    ctx2 = _ctx(k=ctx.k, v=ctx.v, load_tokens=128, prompt=_prompt(context_ids=list(range(130))))
    failures: list = []
    populate_store(RunConfig(chunk_tokens=128, block_tokens=128), client, info, [ctx2],
                   {"kvtc": [3, 4], "raw": [None]}, failures=failures)
    assert "kvtc" not in ctx2.keys and "raw" in ctx2.keys
    assert [(f["stage"], f["mode"], f["level"], f["label"]) for f in failures] == [
        ("encode", "kvtc", 3, "kvtc-l3"), ("encode", "kvtc", 4, "kvtc-l4")]
    assert "needs its calibration" in failures[0]["reason"] and "\n" not in failures[0]["reason"]
    with pytest.raises(BenchmarkError, match="kvtc encode failed"):
        populate_store(RunConfig(chunk_tokens=128, block_tokens=128), client, info, [ctx2],
                       {"kvtc": [3]})


@pytest.mark.parametrize("ctx_tokens,prompt_tokens,block,want", [
    (1000, 1010, 128, 896), (1024, 1025, 128, 1024), (1024, 1024, 128, 896), (100, 120, 128, 0)])
def test_load_prefix_whole_blocks_shorter_than_prompt(ctx_tokens, prompt_tokens, block, want):
    assert load_prefix(ctx_tokens, prompt_tokens, block) == want


@pytest.mark.parametrize("ctx_tokens,prompt_tokens,want", [
    (1000, 1010, 1000), (1024, 1025, 1024), (1024, 1024, 1023), (100, 120, 100), (4093, 4117, 4093)])
def test_load_prefix_partial_block_loads_the_context_but_one_prompt_token(ctx_tokens, prompt_tokens, want):
    assert load_prefix(ctx_tokens, prompt_tokens, 128, whole_blocks=False) == want


def test_whole_blocks_must_be_a_bool():
    with pytest.raises(ConfigError, match="whole_blocks"):
        RunConfig(whole_blocks="yes")


def test_chunk_ranges_cover_prefix():
    assert chunk_ranges(640, 256) == [(0, 256), (256, 512), (512, 640)]
    assert chunk_ranges(256, 256) == [(0, 256)]


# ----------------------------------------------------------------------------- engines
def test_request_params_protocol():
    info = SimpleNamespace(model_id="m", weights_hash="w")
    cfg = RunConfig(slo_s=2.0)
    ctx = _ctx()
    assert request_params(Variant("text"), ctx, "h:1", info, cfg, 100.0, 50.0) is None
    p = request_params(Variant("cachegen", 3), ctx, "h:1", info, cfg, 100.0, 50.0)
    assert p["context_key"] == "K1" and p["level"] == 3 and p["codec_tag"] == "cachegen"
    assert p["stats_tag"] == "cachegen-l3/needle-0" and "policy" not in p
    a = request_params(Variant("cachegen-adaptive"), ctx, "h:1", info, cfg, 100.0, 50.0)
    assert a["policy"] == {"preset": "tuned", "slo_s": 2.0, "prefill_tokens_per_s": 100.0,
                           "initial_throughput_mbps": 50.0}
    assert "level" not in a
    d = request_params(Variant("cachegen-adaptive"), ctx, "h:1", info,
                       RunConfig(slo_s=2.0, policy_preset="default"), 100.0, 50.0)
    assert d["policy"]["preset"] == "default"


def test_no_level_stays_none_and_level_zero_stays_zero():
    """A codec without levels is requested and recorded with level None (not 0: 0 is
    cachegen's highest-quality level), and level 0 stays 0 all the way."""
    info = SimpleNamespace(model_id="m", weights_hash="w")
    cfg, ctx = RunConfig(slo_s=2.0), _ctx()
    ctx.sizes[("cachegen", 0)] = 1200
    raw = request_params(Variant("raw"), ctx, "h:1", info, cfg, 100.0, 50.0)
    assert "level" in raw and raw["level"] is None
    assert request_params(Variant("cachegen", 0), ctx, "h:1", info, cfg, 100.0, 50.0)["level"] == 0
    t = _timing(bytes=256 * 1000, loaded_tokens=256)
    rec = run_record(Variant("raw"), 100.0, "hf", ctx, 0, t, {}, "x", None, None)
    assert rec["level"] is None and rec["label"] == "raw"
    zero = run_record(Variant("cachegen", 0), 100.0, "hf", ctx, 0, t, {}, "x", None, None)
    assert zero["level"] == 0 and zero["label"] == "cachegen-l0"
    assert json.loads(json.dumps(rec))["level"] is None  # null in the result file


def test_request_params_bandwidth_has_the_one_bound():
    info = SimpleNamespace(model_id="m", weights_hash="w")
    cfg, ctx = RunConfig(slo_s=2.0), _ctx()
    for bad in (0.0, -1.0, 1e6, float("nan")):
        with pytest.raises(ValueError, match="bandwidth_mbps"):
            request_params(Variant("cachegen-adaptive"), ctx, "h:1", info, cfg, 100.0, bad)
    p = request_params(Variant("cachegen-adaptive"), ctx, "h:1", info, cfg, 100.0, bandwidth_mbps=100)
    assert p["policy"]["initial_throughput_mbps"] == 100.0


def test_decisions_reach_chunks_under_both_engines():
    decisions = [{"chunk": 0, "reason": "fits", "throughput_mbps_est": 90.0, "budget_s": 0.5},
                 {"chunk": 1, "reason": "text", "throughput_mbps_est": 5.0, "budget_s": 0.1}]
    chunks = [{"index": 0, "level": 2}, {"index": 1, "text_fallback": True}, {"index": 2}]
    merge_decisions(chunks, decisions)  # the HF path (hf_load)
    assert chunks[0]["decision"] == "fits" and chunks[1]["throughput_mbps_est"] == 5.0
    assert "decision" not in chunks[2]
    # the vLLM path: the connector's load record carries the same "decisions" list
    rec = {"lookup_s": 0.01, "load_s": 0.3, "inject_s": 0.02, "loaded_tokens": 256, "bytes": 99,
           "chunks": [{"index": 0, "level": 2}, {"index": 1, "text_fallback": True}],
           "decisions": decisions}
    t = timing_from_connector(rec, 0.5, 0.9, [1, 2])
    assert [c.get("decision") for c in t.chunks] == ["fits", "text"]
    # the connector's load_s includes its cache writes: split as under HF, counted once
    assert t.load_s == pytest.approx(0.3 - 0.02) and t.inject_s == pytest.approx(0.02)
    assert t.prefill_s == pytest.approx(0.5 - 0.01 - 0.3) and t.first_token_s is None
    miss = timing_from_connector({}, float("nan"), 0.7, [1])  # text mode / miss; no TTFT metric
    assert miss.ttft_s == 0.7 and miss.loaded_tokens == 0 and miss.chunks == []


def test_a_store_miss_is_a_miss_reason_a_policy_text_decision_is_not():
    """The connector's scheduler-side miss (nothing servable stored, e.g. an entry
    of another dtype) becomes RequestTiming.miss_reason and a run record field; a load that
    placed nothing by the adaptive policy's choice, a load, and text mode leave it None."""
    from harness.results import run_record

    miss = {"kind": "miss", "stored_tokens": 0, "loaded_tokens": 0, "lookup_s": 0.04,
            "reason": "identity: conflicting expectations for dtype: 'bfloat16' vs 'float32'"}
    t = timing_from_connector(miss, 0.1, 0.2, [1])
    assert t.miss_reason == miss["reason"] and t.loaded_tokens == 0
    assert timing_from_connector(dict(miss, reason=None), 0.1, 0.2, [1]).miss_reason == "miss"
    policy = {"kind": "miss", "loaded_tokens": 0, "requested_tokens": 896,
              "reason": "at load: chunk 0: text chosen by policy"}     # worker-side record
    assert timing_from_connector(policy, 0.1, 0.2, [1]).miss_reason is None
    local = {"kind": "local_hit", "stored_tokens": 896, "loaded_tokens": 0, "reason": "x"}
    assert timing_from_connector(local, 0.1, 0.2, [1]).miss_reason is None
    assert timing_from_connector({"kind": "load", "loaded_tokens": 896}, 0.1, 0.2, [1]
                                 ).miss_reason is None
    assert timing_from_connector({}, 0.1, 0.2, [1]).miss_reason is None
    assert len(timing_from_connector(dict(miss, reason="r" * 999), 0.1, 0.2, [1]).miss_reason) == 300

    class _Var:
        mode, level, label, codec = "raw", None, "raw", "raw"

    class _Prompt:
        task, context_ids, input_ids, meta = "needle", [1] * 10, [1] * 12, {}

    class _Ctx:
        cid, prompt, sizes, dtype_bytes, load_tokens = "c0", _Prompt(), {}, 100, 10

    rec = run_record(_Var(), 100.0, "vllm", _Ctx(), 0, t, {}, "", None, None)
    assert rec["miss_reason"] == miss["reason"] and rec["loaded_tokens"] == 0


def test_engine_thread_binding_is_explicit():
    """The vLLM worker's OpenMP CPU list is chosen by the harness, not left to vLLM's auto
    mode: one CPU per physical core, the highest reserved for the engine-core process."""
    from harness.engines import engine_thread_binding

    no_smt = lambda c: [c]  # noqa: E731
    b = engine_thread_binding({0, 1}, env={}, siblings=no_smt)
    assert b == {"VLLM_CPU_OMP_THREADS_BIND": "0", "omp_threads": 1, "source": "harness",
                 "allowed_cpus": [0, 1]}
    assert engine_thread_binding([3], env={}, siblings=no_smt)["VLLM_CPU_OMP_THREADS_BIND"] == "3"
    four = engine_thread_binding({0, 1, 2, 3, 5}, env={}, siblings=no_smt)
    assert four["VLLM_CPU_OMP_THREADS_BIND"] == "0-3" and four["omp_threads"] == 4
    smt = engine_thread_binding(set(range(8)), env={}, siblings=lambda c: [c % 4, c % 4 + 4])
    assert smt["VLLM_CPU_OMP_THREADS_BIND"] == "0-2" and smt["omp_threads"] == 3
    # a user's value is kept and recorded as theirs
    user = engine_thread_binding({0, 1}, env={"VLLM_CPU_OMP_THREADS_BIND": "0-1"}, siblings=no_smt)
    assert user["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and user["omp_threads"] == 2
    assert user["source"] == "user"
    auto = engine_thread_binding({0, 1}, env={"VLLM_CPU_OMP_THREADS_BIND": "auto"})
    assert auto["omp_threads"] is None and auto["source"] == "user"


def test_vllm_engine_pins_binding_and_records_settings(monkeypatch, tmp_path):
    import os

    import harness.engines.numerics as N
    import harness.engines.vllm as E
    import third_party.vllm.engine as VE

    seen = {}

    def fake_make_llm(model_dir, extra, max_model_len=8192, **kw):
        seen.update(kw, bind=os.environ.get("VLLM_CPU_OMP_THREADS_BIND"), extra=extra)
        return object()

    monkeypatch.setattr(E, "check_vllm", lambda: None)
    monkeypatch.setattr(VE, "make_llm", fake_make_llm)
    monkeypatch.setattr(N.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(N, "sysfs_siblings", lambda c: [c])
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    eng = E.VLLMEngine(tmp_path, tmp_path / "stats.jsonl", 512, "127.0.0.1:1")
    # the engine process saw the explicit list; this process's environment is restored
    assert seen["bind"] == "0" and seen["seed"] == 0 and seen["dtype"] == "bfloat16"
    assert seen["extra"]["stores"] == {"harness": "127.0.0.1:1"}
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    st = eng.settings
    assert (st["engine"], st["omp_threads_bind"], st["omp_threads"], st["bind_source"]) == \
        ("vllm", "0", 1, "harness")
    assert st["allowed_cpus"] == [0, 1] and st["reserved_cpus"] == 1 and st["seed"] == 0
    assert st["prefix_caching"] is False and st["env"]["OMP_NUM_THREADS"] == "7"
    assert json.loads(json.dumps(st)) == st  # goes into results.json environment.engine
    # a user's binding is passed through unchanged and stays set
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")
    eng2 = E.VLLMEngine(tmp_path, tmp_path / "stats.jsonl", 512)
    assert seen["bind"] == "1" and os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert (eng2.settings["omp_threads_bind"], eng2.settings["bind_source"]) == ("1", "user")
    assert eng2.settings["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "1"


def test_hf_engine_records_settings():
    import torch

    from harness.engines import HFEngine

    bundle = SimpleNamespace(model=SimpleNamespace(dtype=torch.bfloat16),
                             tokenizer=SimpleNamespace(eos_token_id=2))
    st = HFEngine(bundle).settings
    assert st["engine"] == "hf" and st["dtype"] == "bfloat16"
    assert st["torch_threads"] == torch.get_num_threads()


# ----------------------------------------------------------------------------- quality
def test_score_output_driven_by_registry():
    ref_ids = [5, 6, 7, 8]
    q = score_output(_prompt(), "The answer is blue lantern.", [5, 6, 0, 8], "The answer is blue lantern.",
                     ref_ids)
    assert q["correct"] is True and q["f1"] is None  # only the prompt's own task metric
    assert q["rouge_l"] == pytest.approx(1.0) and q["greedy_match"] == 0.75
    assert set(q) == {m.column for m in M.result_metrics()}
    assert q["ppl_increase_pct"] is None and q["kl"] is None  # computed by the perplexity pass
    f1 = score_output(_prompt(metric="qa_f1", answer="paris", answers=["Paris", "the city of Paris"]),
                      "paris", [1], None, None)
    assert f1["f1"] == 1.0 and f1["correct"] is None and f1["rouge_l"] is None


def test_registry_declares_direction_and_aggregation():
    by_col = {m.column: m for m in M.result_metrics()}
    assert by_col["correct"].aggregation == "share" and by_col["correct"].summary_key == "accuracy"
    for col in ("f1", "rouge_l", "bleu", "greedy_match", "ppl_increase_pct", "kl"):
        assert by_col[col].aggregation == "median"
    assert by_col["kl"].higher_is_better is False and by_col["f1"].higher_is_better is True
    hib = higher_is_better()
    assert hib["accuracy"] is True and hib["ppl_increase_pct"] is False and hib["ttft_s"] is False
    with pytest.raises(ValueError, match="aggregation"):
        M.register_metric("x_bad", higher_is_better=True, unit="-", aggregation="max")


# ----------------------------------------------------------------------------- summaries
def _run(mode="raw", level=None, bw=100.0, ttft=1.0, **quality):
    return {"mode": mode, "level": level, "bandwidth_mbps": bw, "ttft_s": ttft, "bytes": 10,
            "quality": quality}


def test_summaries_medians_and_share_one_rule():
    runs = [_run(f1=0.0, correct=True), _run(f1=0.1, correct=False), _run(f1=1.0, correct=True)]
    (s,) = summarize(runs)
    assert s["f1"] == 0.1  # median, as docs/results-schema.md says (the mean would be 0.3667)
    assert s["accuracy"] == pytest.approx(2 / 3)  # share of correct answers
    assert s["n"] == 3 and s["ttft_s_median"] == 1.0


def test_summaries_grouping_order_and_nones():
    runs = [_run("cachegen", 2, 500.0, 2.0), _run("cachegen", 2, 100.0, 4.0), _run("text", None, 100.0, 3.0),
            _run("cachegen", 2, 100.0, 6.0, greedy_match=None)]
    out = summarize(runs)
    assert [(s["bandwidth_mbps"], s["mode"], s["level"]) for s in out] == [
        (100.0, "cachegen", 2), (100.0, "text", None), (500.0, "cachegen", 2)]
    assert out[0]["ttft_s_median"] == 5.0 and out[0]["greedy_match"] is None
    assert out[0]["slo_violation_rate"] is None


def test_aggregate_metric_and_plot_label():
    assert aggregate_metric(M.get_metric("retrieval_accuracy"), [True, None, False, True]) == pytest.approx(2 / 3)
    assert aggregate_metric(M.get_metric("bleu"), [None, None]) is None
    assert plot_label("cachegen", 2) == "cachegen-l2" and plot_label("raw", None) == "raw"
    assert plot_label("raw", float("nan")) == "raw"


# ----------------------------------------------------------------------------- adaptation
def test_slo_check_counts_load_inject_and_fallback_recompute():
    chunks = [{"index": 0, "token_start": 0, "token_end": 256},
              {"index": 1, "token_start": 256, "token_end": 512, "text_fallback": True}]
    t = _timing(load_s=0.4, inject_s=0.05, chunks=chunks, prefill_s=99.0)
    # 0.4 + 0.05 + 256 tokens / 1000 tokens/s = 0.706 s; the question's prefill is outside
    assert slo_violated(t, 0.8, 1000.0) is False
    assert slo_violated(t, 0.7, 1000.0) is True
    assert slo_violated(_timing(load_s=0.4, inject_s=0.05), 0.46, 1.0) is False


def test_load_traces_names_and_errors():
    got = load_traces(("constant", "step"), 6, (100.0, 1000.0))
    assert got[0].mbps == (1000.0,) * 6
    assert got[1].mbps == (1000.0, 1000.0, 100.0, 100.0, 1000.0, 1000.0)
    with pytest.raises(BenchmarkError, match="unknown trace 'wobble'"):
        load_traces(("wobble",), 4, (100.0,))


def test_adaptation_rows_per_chunk():
    trace = Trace("step", (500.0, 50.0))
    chunks = [{"index": 0, "level": 2, "bytes": 10, "fetch_end_s": 0.2, "decision": "fits"},
              {"index": 1, "text_fallback": True, "decode_end_s": 0.1, "token_start": 0, "token_end": 0}]
    rows = adaptation_rows(trace, _ctx(), _timing(chunks=chunks), 1.0, 1000.0)
    assert [r["bandwidth_mbps"] for r in rows] == [500.0, 50.0]
    assert [r["elapsed_s"] for r in rows] == [0.2, 0.2]  # running maximum
    assert rows[0]["decision"] == "fits" and rows[1]["text_fallback"] is True
    assert rows[0]["slo_violated"] is False


# ----------------------------------------------------------------------------- results
def test_run_record_fields_and_ratio():
    ctx = _ctx()
    t = _timing(bytes=256 * 1000, loaded_tokens=256)
    rec = run_record(Variant("cachegen", 1), 100.0, "hf", ctx, 0, t, {"correct": True}, "x", None, None)
    assert rec["ratio_vs_dtype"] == pytest.approx(4.0)  # 4000 B/token in the dtype / 1000 moved
    assert rec["stored_bytes"] == 900 and rec["label"] == "cachegen-l1"
    assert rec["truncated_from_tokens"] is None and rec["prompt_tokens"] == 303
    text = run_record(Variant("text"), 100.0, "hf", ctx, 0, _timing(bytes=0, loaded_tokens=0), {}, "x",
                      None, None)
    assert text["ratio_vs_dtype"] is None and text["stored_bytes"] is None


def test_writer_complete_flag(tmp_path):
    path = tmp_path / "r.json"
    w = ResultsWriter(path, {"command": "x", "environment": {}, "model": {}, "config": {}})
    assert not w.written and not path.exists()
    w.add_run(dict(_run(), lookup_s=0, transfer_s=0, decode_s=0, inject_s=0, prefill_s=0,
                   first_token_s=0))
    doc = json.loads(path.read_text())
    assert doc["complete"] is False and validate(doc) == []
    w.finish(wall_s=3.0)
    doc = json.loads(path.read_text())
    assert doc["complete"] is True and doc["wall_s"] == 3.0
    table = summary_table(doc).splitlines()
    assert len(table) == 2 and table[1].split()[0] == "raw"


def test_interrupted_message_says_what_exists(tmp_path):
    exc = KeyboardInterrupt()
    exc.results_path, exc.n_runs = None, 0
    msg = run_benchmarks.interrupted_message(exc)
    assert "no results file was written" in msg and "finished so far" not in msg
    term = Terminated(15)
    term.results_path, term.n_runs = tmp_path / "r.json", 4
    msg = run_benchmarks.interrupted_message(term)
    assert msg.startswith("terminated by SIGTERM: 4 finished run(s) are in") and "complete" in msg
    assert term.code == 143


# ----------------------------------------------------------------------------- config / console
def test_every_config_field_has_its_flag():
    import dataclasses

    dests = {a.dest for a in run_benchmarks.build_parser()._actions}
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    # data_map is built from --data-map and --data-field-* (kv_extraction_hf.dataflags)
    assert fields <= dests and "data_field_context" in dests
    import yaml
    from harness.config import DEFAULT_CONFIG

    assert set(yaml.safe_load(DEFAULT_CONFIG.read_text())) == fields - {"quick"}


def test_quick_levels_is_the_codec_default():
    from codec.config import HARNESS_DEFAULT_LEVEL
    from harness.config import QUICK_LEVELS

    assert QUICK_LEVELS == (HARNESS_DEFAULT_LEVEL,)


def test_level_lists_are_the_codecs():
    import codec
    from harness.config import CACHEGEN_LEVELS, KVTC_LEVELS

    assert CACHEGEN_LEVELS == tuple(codec.levels("cachegen"))
    assert KVTC_LEVELS == tuple(codec.levels("kvtc"))


@pytest.mark.parametrize("flag,value", [("levels", (9,)), ("levels", (1, -1)), ("kvtc_levels", (7,))])
def test_unknown_levels_are_refused_before_any_work(flag, value):
    """run_benchmarks --levels 9 / --kvtc-levels 7: a ConfigError (one line, exit 2) when the
    flags are parsed, not a traceback (or a recorded failure) after the model loaded."""
    from harness.config import ConfigError, resolve

    with pytest.raises(ConfigError, match=f"unknown {flag}"):
        resolve(None, {flag: value})


def test_quick_run_never_writes_the_committed_results():
    from harness.config import DEFAULT_OUT, QUICK_OUT, resolve

    assert resolve(None, {"quick": True}).out == QUICK_OUT != DEFAULT_OUT
    assert resolve(None, {}).out == DEFAULT_OUT
    assert resolve(None, {"quick": True, "out": "x.json"}).out == "x.json"


def test_engine_logs_routed_to_a_file(tmp_path, monkeypatch):
    import logging
    import logging.config

    from harness.run import engine_log_path, route_engine_logs

    # setenv first so that monkeypatch records the variables and removes what
    # route_engine_logs sets (a leaked VLLM_LOGGING_CONFIG_PATH sent a later test's vLLM
    # server logs into this test's file)
    for k in ("VLLM_LOGGING_CONFIG_PATH", "VLLM_CONFIGURE_LOGGING"):
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    path = engine_log_path(tmp_path / "results.json")
    assert path == tmp_path / "results.engine.log"
    route_engine_logs(path)
    import os

    conf = json.loads(open(os.environ["VLLM_LOGGING_CONFIG_PATH"]).read())
    logging.config.dictConfig(conf)
    try:
        logging.getLogger("vllm.engine").info("engine started with 2 workers")
    finally:
        for name in ("vllm", "cachegen"):  # undo the dictConfig for the later tests
            lg = logging.getLogger(name)
            for h in lg.handlers:
                h.close()
            lg.handlers.clear()
            lg.propagate = True
            lg.setLevel(logging.NOTSET)
    assert "engine started with 2 workers" in path.read_text()


def test_stderr_of_started_processes_goes_to_the_log(tmp_path, capfd):
    import subprocess
    import sys

    from harness.run import stderr_to

    log = tmp_path / "engine.log"
    with stderr_to(log):
        child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stderr.write('engine noise\\n')"])
    child.wait()
    sys.stderr.write("console line\n")
    assert log.read_text() == "engine noise\n"
    assert "console line" in capfd.readouterr().err


def test_run_restores_the_logging_environment(monkeypatch):
    """run() routes vLLM's logs through environment variables that child processes inherit;
    they are put back when the block ends, so a server started later by the same process
    logs to its own output (a leak hid the connector's load lines in a later test)."""
    import os

    from harness import run as run_mod

    monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH", raising=False)
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")
    saved = {k: os.environ.get(k) for k in run_mod.LOG_ENV_KEYS}
    with run_mod._restore_env(saved):
        os.environ["VLLM_CONFIGURE_LOGGING"] = "1"
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = "/nonexistent/x.json"
    assert os.environ["VLLM_CONFIGURE_LOGGING"] == "0"
    assert "VLLM_LOGGING_CONFIG_PATH" not in os.environ


def test_vllm_hybrid_kv_flag_and_its_validation(capsys):
    """--vllm-hybrid-kv (config vllm_hybrid_kv) parses to True, defaults to the
    config's false, and is refused in one line (exit 2) with --engine hf or a non-bool."""
    from harness.config import ConfigError, resolve

    args = run_benchmarks.build_parser().parse_args(["--vllm-hybrid-kv"])
    assert args.vllm_hybrid_kv is True
    assert run_benchmarks.build_parser().parse_args([]).vllm_hybrid_kv is None
    assert resolve(None, {}).vllm_hybrid_kv is False
    assert resolve(None, {"vllm_hybrid_kv": True}).vllm_hybrid_kv is True
    with pytest.raises(ConfigError, match="needs --engine vllm"):
        RunConfig(engine="hf", vllm_hybrid_kv=True)
    with pytest.raises(ConfigError, match="must be true or false"):
        RunConfig(vllm_hybrid_kv="yes")
    assert run_benchmarks.main(["--engine", "hf", "--vllm-hybrid-kv"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "needs --engine vllm" in err
