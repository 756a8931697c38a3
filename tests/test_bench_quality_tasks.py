"""Task answers by teacher forcing (``kv_extraction_hf.inject.answer_from_kv``) give exactly
the ids of plain greedy generation (``generate_from_kv``), on a tiny random Llama built
here (float32, no download): lossless KV, lossy KV, wrong references, an EOS that stops
early, and the low-margin fallback. Plus ``bench.quality.run_tasks`` bookkeeping on it.

Run: .venv/bin/python -m pytest tests/test_bench_quality_tasks.py -q
"""
from __future__ import annotations

import types

import pytest
import torch

from kv_extraction_hf.errors import ExtractionError
from kv_extraction_hf.inject import answer_from_kv, generate_from_kv, teacher_forcing_margin
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
    rows, info = Q.run_tasks(tiny, [("raw", None), ("kivi2", None)], 4, lengths=(40,), topic_lengths=(40,),
                             max_new_tokens=BUDGET, verify=True, log=lambda m: None)
    by = {(r["codec"], r["task"]): r for r in rows}
    assert by[("raw", "all")]["n"] == 4 and by[("raw", "all")]["agreement"] == 1.0
    assert by[("raw", "all")]["accuracy"] == by[("lossless", "all")]["accuracy"]
    s = info["answer_paths"]
    assert s["raw"]["teacher-forced"] == 4
    assert sum(s["kivi2"].values()) == 4
    assert info["verify"] == {"checked": 8, "mismatches": 0}
    for rec in info["requests"]:
        assert set(rec["seconds"]) >= {"prefill", "lossless_answer"}
        for c in rec["codecs"].values():
            assert c["path"] in ("teacher-forced", "continued", "fallback") and c["answer_s"] >= 0
