"""Task answers by teacher forcing (``kv_extraction_hf.inject.answer_from_kv``) give exactly
the ids of plain greedy generation (``generate_from_kv``), on a tiny random Llama built
here (float32, no download): lossless KV, lossy KV, wrong references, an EOS that stops
early, and the low-margin fallback. Plus ``bench.quality.run_tasks`` bookkeeping on it.

Run: .venv/bin/python -m pytest tests/bench/test_bench_quality_tasks.py -q
"""
from __future__ import annotations

import types

import pytest
import torch

from kv_extraction_hf.errors import ExtractionError
from kv_extraction_hf.inject import (answer_from_kv, generate_from_kv, generate_from_kv_margin,
                                     greedy_from_kvs_batch, teacher_forcing_margin)
from kv_extraction_hf.model import ModelBundle, ModelInfo

VOCAB = 96
BUDGET = 12


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.2)
    model = LlamaForCausalLM(cfg).eval().to(torch.float32)
    model.generation_config.eos_token_id = None
    tok = types.SimpleNamespace(eos_token_id=None, decode=lambda ids, **kw: " ".join(map(str, ids)))
    info = ModelInfo(model_id="tiny-llama", weights_hash="0" * 64, dtype="float32", num_layers=2,
                     num_kv_heads=2, head_dim=12, max_context=512, path="")
    return ModelBundle(model=model, tokenizer=tok, info=info)


def _kv(bundle, ids):
    from kv_extraction_hf.extract import prefill_kv

    return prefill_kv(bundle, ids)


def _cases(n=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        ctx = torch.randint(0, VOCAB, (int(torch.randint(20, 60, (1,), generator=g)),), generator=g).tolist()
        q = torch.randint(0, VOCAB, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
        yield ctx, q, g


def test_fast_path_equals_greedy_lossless_and_lossy(tiny):
    paths = []
    for ctx, q, g in _cases():
        k, v = _kv(tiny, ctx)
        ref = generate_from_kv(tiny, k, v, ctx, q, BUDGET)
        got = answer_from_kv(tiny, k, v, ctx, q, ref, BUDGET)
        assert got["ids"] == ref and got["agrees"] and got["path"] == "teacher-forced"
        assert got["diverged_at"] is None and got["min_margin"] >= teacher_forcing_margin(torch.float32)
        for scale in (0.05, 0.3, 1.0):     # lossy KV: small to large distortion
            k2 = k + scale * k.std() * torch.randn(k.shape, generator=g)
            v2 = v + scale * v.std() * torch.randn(v.shape, generator=g)
            want = generate_from_kv(tiny, k2, v2, ctx, q, BUDGET)
            got = answer_from_kv(tiny, k2, v2, ctx, q, ref, BUDGET)
            assert got["ids"] == want, (scale, got)
            assert got["agrees"] == (want == ref)
            if want != ref:
                i = next((j for j, (a, b) in enumerate(zip(want, ref)) if a != b), min(len(want), len(ref)))
                assert got["diverged_at"] == i
            paths.append(got["path"])
    # both the verified and the continued path were exercised, without falling back
    assert "teacher-forced" in paths and "continued" in paths and "fallback" not in paths


def test_fast_path_with_wrong_references_and_eos(tiny):
    ctx, q, g = next(_cases(1, seed=5))
    k, v = _kv(tiny, ctx)
    free = generate_from_kv(tiny, k, v, ctx, q, BUDGET)
    assert len(free) == BUDGET
    for ref in ([], free[:3], free[:5] + [(free[5] + 1) % VOCAB], torch.randint(0, VOCAB, (BUDGET,)).tolist()):
        got = answer_from_kv(tiny, k, v, ctx, q, ref, BUDGET)
        assert got["ids"] == free and got["agrees"] == (ref == free)
    # an EOS token that the free answer meets at position 4: greedy stops there
    eos = free[4]
    stop = free.index(eos)
    tiny.model.generation_config.eos_token_id = eos
    try:
        want = generate_from_kv(tiny, k, v, ctx, q, BUDGET)
        assert want == free[:stop]
        got = answer_from_kv(tiny, k, v, ctx, q, free, BUDGET)          # reference ran past the stop
        assert got["ids"] == want and not got["agrees"] and got["diverged_at"] == stop
        got = answer_from_kv(tiny, k, v, ctx, q, want, BUDGET)          # reference stopped too
        assert got["ids"] == want and got["agrees"] and got["path"] == "teacher-forced"
    finally:
        tiny.model.generation_config.eos_token_id = None


def test_low_margin_falls_back_to_greedy(tiny):
    ctx, q, g = next(_cases(1, seed=7))
    k, v = _kv(tiny, ctx)
    ref = generate_from_kv(tiny, k, v, ctx, q, BUDGET)
    got = answer_from_kv(tiny, k, v, ctx, q, ref, BUDGET, min_margin=1e9)
    assert got["path"] == "fallback" and got["ids"] == ref and got["agrees"]
    with pytest.raises(ExtractionError):
        answer_from_kv(tiny, k, v, ctx, q, ref + [1] * BUDGET, BUDGET)
    with pytest.raises(ExtractionError):
        answer_from_kv(tiny, k, v, ctx, [], ref, BUDGET)


def test_run_tasks_on_tiny_model_records_paths(tiny, monkeypatch):
    from bench import quality as Q
    from kv_extraction_hf.prompts import Prompt

    def fake_prompt(task, tokenizer, length, seed=0, index=0):
        g = torch.Generator().manual_seed(1000 * index + length)
        ctx = torch.randint(0, VOCAB, (40,), generator=g).tolist()
        return Prompt(name=f"{task}-{index}", task=task, context_text="", question_text="", answer="1",
                      answers=["1"], context_ids=ctx, question_ids=[3, 4], max_new_tokens=BUDGET)

    monkeypatch.setattr("kv_extraction_hf.prompts.build_prompt", fake_prompt)
    runs = {}
    for mode in ("batched", "teacher"):
        rows, info = Q.run_tasks(tiny, [("raw", None), ("kivi2", None)], 4, lengths=(40,), topic_lengths=(40,),
                                 max_new_tokens=BUDGET, verify=True, log=lambda m: None, answer_mode=mode)
        by = {(r["codec"], r["task"]): r for r in rows}
        assert by[("raw", "all")]["n"] == 4 and by[("raw", "all")]["agreement"] == 1.0
        assert by[("raw", "all")]["accuracy"] == by[("lossless", "all")]["accuracy"]
        s = info["answer_paths"]
        assert s["raw"]["batched" if mode == "batched" else "teacher-forced"] == 4
        assert sum(s["kivi2"].values()) == 4
        assert info["verify"] == {"checked": 8, "mismatches": 0} and info["answer_mode"] == mode
        for rec in info["requests"]:
            assert set(rec["seconds"]) >= {"prefill", "lossless_answer"}
            assert rec["lossless"]["min_margin"] > 0
            for c in rec["codecs"].values():
                assert c["path"] in Q.ANSWER_PATHS[mode] and c["answer_s"] >= 0
        runs[mode] = (rows, [(x["lossless"]["ids"], {lab: (c["ids"], c["diverged_at"], c["agrees"])
                                                      for lab, c in x["codecs"].items()})
                             for x in info["requests"]])
    # the two answer paths give the same ids, divergence points and rows
    assert runs["batched"][1] == runs["teacher"][1]
    assert runs["batched"][0] == runs["teacher"][0]
    # a request's codecs encoded + decoded by one thread: the same answers and rows
    rows1, info1 = Q.run_tasks(tiny, [("raw", None), ("kivi2", None)], 4, lengths=(40,), topic_lengths=(40,),
                               max_new_tokens=BUDGET, log=lambda m: None, answer_mode="teacher", codec_workers=1)
    assert rows1 == runs["teacher"][0] and info1["codec_workers"] == 1 and info["codec_workers"] == 2
    assert [(x["lossless"]["ids"], {lab: (c["ids"], c["diverged_at"], c["agrees"]) for lab, c in x["codecs"].items()})
            for x in info1["requests"]] == runs["teacher"][1]
    with pytest.raises(ValueError):
        Q.run_tasks(tiny, [("raw", None)], 1, log=lambda m: None, answer_mode="nope")


def test_batched_greedy_equals_each_entrys_greedy(tiny):
    """greedy_from_kvs_batch: every entry's ids are its own batch-1 generate_from_kv ids
    (lossless and lossy KV of one context, entries leaving the batch at different steps)."""
    n_batched = 0
    for ctx, q, g in _cases(6, seed=3):
        k, v = _kv(tiny, ctx)
        kvs = [(k, v)]
        for scale in (0.05, 0.3, 1.0, 3.0):
            kvs.append((k + scale * k.std() * torch.randn(k.shape, generator=g),
                        v + scale * v.std() * torch.randn(v.shape, generator=g)))
        for budget in (1, BUDGET):
            got = greedy_from_kvs_batch(tiny, kvs, ctx, q, budget)
            assert len(got) == len(kvs)
            for (k2, v2), o in zip(kvs, got):
                want, low = generate_from_kv_margin(tiny, k2, v2, ctx, q, budget)
                assert o["ids"] == want and o["ids"] == generate_from_kv(tiny, k2, v2, ctx, q, budget)
                assert o["path"] in ("batched", "fallback")
                if o["path"] == "batched":
                    n_batched += 1
                    assert abs(o["min_margin"] - low) < 1e-3
    assert n_batched > 0
    assert greedy_from_kvs_batch(tiny, [], [1], [1], BUDGET) == []


def test_batched_greedy_eos_fallback_and_errors(tiny):
    ctx, q, g = next(_cases(1, seed=5))
    k, v = _kv(tiny, ctx)
    k2 = k + 0.5 * k.std() * torch.randn(k.shape, generator=g)
    free = generate_from_kv(tiny, k, v, ctx, q, BUDGET)
    # an EOS id that greedy meets after a few tokens: every entry stops where its own greedy does
    tiny.model.generation_config.eos_token_id = free[3]
    try:
        got = greedy_from_kvs_batch(tiny, [(k, v), (k2, v)], ctx, q, BUDGET)
        assert got[0]["ids"] == generate_from_kv(tiny, k, v, ctx, q, BUDGET) and len(got[0]["ids"]) <= 3
        assert got[1]["ids"] == generate_from_kv(tiny, k2, v, ctx, q, BUDGET)
    finally:
        tiny.model.generation_config.eos_token_id = None
    # a margin nobody reaches: every entry regenerated alone, same ids
    got = greedy_from_kvs_batch(tiny, [(k, v), (k2, v)], ctx, q, BUDGET, min_margin=1e9)
    assert [o["path"] for o in got] == ["fallback", "fallback"] and got[0]["ids"] == free
    with pytest.raises(ExtractionError):
        greedy_from_kvs_batch(tiny, [(k, v)], ctx, [], BUDGET)
    with pytest.raises(ExtractionError):
        greedy_from_kvs_batch(tiny, [(k, v), (k[:, :-1], v[:, :-1])], ctx, q, BUDGET)
    with pytest.raises(ExtractionError):
        greedy_from_kvs_batch(tiny, [(k, v)], ctx, q, 10_000)


def test_agreement_split_on_hand_made_records():
    """agreement_split / task_rows: counts and Wilson CIs of the split by the lossless answer."""
    from bench import quality as Q
    from evaluation.stats import wilson_ci

    def rec(task, correct, margin, agrees):
        return {"task": task, "lossless": {"correct": correct, "min_margin": margin},
                "codecs": {"cachegen 1": {"correct": correct and agrees, "agrees": agrees, "token_agrees": agrees}}}

    recs = [rec("needle", True, 0.5, True), rec("needle", True, 0.05, False), rec("needle", False, 0.3, False),
            rec("topic_retrieval", False, 0.01, True), rec("topic_retrieval", True, None, True)]
    got = [x["codecs"]["cachegen 1"] for x in recs]
    sp = Q.agreement_split(got, recs, margin_split=0.1)
    assert sp["margin_split"] == 0.1
    assert sp["lossless_correct"] == {"n": 3, "agreement": 2 / 3, "agreement_ci": list(wilson_ci(2, 3))}
    assert sp["lossless_wrong"] == {"n": 2, "agreement": 0.5, "agreement_ci": list(wilson_ci(1, 2))}
    assert sp["margin_high"]["n"] == 2 and sp["margin_high"]["agreement"] == 0.5   # 0.5 agrees, 0.3 not
    assert sp["margin_low"]["n"] == 2 and sp["margin_low"]["agreement"] == 0.5     # None left out
    empty = Q.agreement_split([], [], 0.1)
    assert empty["lossless_correct"] == {"n": 0, "agreement": None, "agreement_ci": None}
    rows = Q.task_rows(recs, [("cachegen", 1)], margin_split=0.1)
    by = {(r["codec"], r["task"]): r for r in rows}
    assert by[("cachegen", "all")]["n"] == 5 and by[("cachegen", "all")]["agreement"] == 3 / 5
    assert by[("cachegen", "all")]["agreement_split"] == sp
    assert by[("cachegen", "needle")]["agreement_split"]["lossless_wrong"]["n"] == 1
    assert by[("lossless", "all")]["accuracy"] == 3 / 5


def test_preallocated_cache_gives_the_stock_logits(tiny):
    """make_cache(capacity=...) appends in place; prefill, decode steps, a dropped tail and
    a batch selection give bit-identical logits to the stock concatenating cache."""
    from kv_extraction_hf.inject import _batch_cache, _drop_last, make_cache

    ctx, q, g = next(_cases(1, seed=9))
    k, v = _kv(tiny, ctx)
    feeds = [q, [5], [7, 8, 9], [11]]

    def run(cache, drop_after=2):
        out = []
        for i, f in enumerate(feeds):
            out.append(tiny.model(input_ids=torch.tensor([f]), past_key_values=cache, use_cache=True).logits)
            if i == drop_after:
                _drop_last(cache, 2)
        return out

    assert type(make_cache(k, v, tiny.model.config, 100).layers[0]).__name__ == "GrowLayer"
    with torch.inference_mode():
        stock, grown = run(make_cache(k, v, tiny.model.config)), run(make_cache(k, v, tiny.model.config, 100))
        assert all(torch.equal(a, b) for a, b in zip(stock, grown))
        k2 = k + 0.3 * torch.randn(k.shape, generator=g)
        outs = []
        for cap in (0, 100):
            c = _batch_cache([(k, v), (k2, v), (k, k2)], tiny.model.config, cap)
            a = tiny.model(input_ids=torch.tensor([q] * 3), past_key_values=c, use_cache=True).logits
            c.batch_select_indices(torch.tensor([0, 2]))
            b = tiny.model(input_ids=torch.tensor([[4], [6]]), past_key_values=c, use_cache=True).logits
            outs.append((a, b, c.get_seq_length()))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
        assert outs[0][2] == outs[1][2] == len(ctx) + len(q) + 1


def test_run_tasks_on_given_requests_reads_the_users_file(tiny, monkeypatch):
    """``requests`` (LongChat rows) replace the synthetic ones: each row is built from
    ``data_path`` at the model's context, and its truncation is recorded."""
    from bench import quality as Q
    from kv_extraction_hf.prompts import Prompt

    seen = []

    def fake_prompt(task, tokenizer, length, seed=0, index=0, data_path=None, max_prompt_tokens=None):
        seen.append((task, length, index, data_path, max_prompt_tokens))
        g = torch.Generator().manual_seed(index)
        ctx = torch.randint(0, VOCAB, (30,), generator=g).tolist()
        return Prompt(name=f"{task}-{index}", task=task, context_text="", question_text="", answer="7",
                      answers=["7"], context_ids=ctx, question_ids=[5], max_new_tokens=BUDGET,
                      meta={"truncated_from_tokens": 900 if index == 1 else None})

    monkeypatch.setattr("kv_extraction_hf.prompts.build_prompt", fake_prompt)
    reqs = [("longchat", 512, i) for i in range(3)]
    rows, info = Q.run_tasks(tiny, [("raw", None)], 99, max_new_tokens=BUDGET, log=lambda m: None,
                             requests=reqs, data_path="rows.jsonl")
    assert seen == [("longchat", 512, i, "rows.jsonl", 512) for i in range(3)]
    assert [r["truncated_from_tokens"] for r in info["requests"]] == [None, 900, None]
    by = {(r["codec"], r["task"]): r for r in rows}
    assert by[("raw", "longchat")]["n"] == 3 and by[("raw", "all")]["agreement"] == 1.0


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "longchat", "--tasks-only"], "--tasks longchat needs --task-data FILE"),
    (["--tasks-only", "--task-data", "x.jsonl"], "--task-data is read by --tasks longchat only"),
    (["--tasks", "longchat", "--tasks-only", "--task-data", "/nonexistent/longchat.jsonl"], "--task-data: "),
])
def test_longchat_flags_fail_in_one_line_before_the_model(argv, message, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "bench.quality", *argv, "--out", str(tmp_path / "q.json")],
                          cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last and not (tmp_path / "q.json").exists()
