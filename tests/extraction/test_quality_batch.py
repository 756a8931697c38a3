"""The batched continuation forward of the quality benchmark
(``kv_extraction_hf.inject.continuation_logits_batch``) gives each entry exactly the logits
of its own batch-1 ``continuation_logits`` (bit for bit), so batching several codecs'
decoded KV per forward changes no KL / top-1 figure; and the benchmark's rows do not
depend on the batch size.

Run: .venv/bin/python -m pytest tests/extraction/test_quality_batch.py -q
"""
import pytest
import torch

import codec
from kv_extraction_hf.errors import ExtractionError
from kv_extraction_hf.extract import prefill_kv
from kv_extraction_hf.inject import continuation_logits, continuation_logits_batch
from kv_extraction_hf.prompts import build_prompt


def test_batched_continuation_equals_batch_one_bit_for_bit(default_bundle):
    p = build_prompt("pydoc_ppl", default_bundle.tokenizer, 200, seed=0, index=0)
    ctx, cont = p.context_ids, p.continuation_ids[:40]
    k, v = prefill_kv(default_bundle, ctx)
    kvs = [(k, v)]
    for name, level in (("cachegen", 1), ("quant8", None), ("kivi2", None), ("cachegen", 5),
                        ("fp8", None), ("cachegen-ref", 0)):
        k2, v2 = codec.decode_kv(codec.encode_kv(k, v, codec=name, level=level))
        kvs.append((k2.to(k.dtype), v2.to(v.dtype)))
    batched = continuation_logits_batch(default_bundle, kvs, ctx, cont)      # batch 7
    assert len(batched) == len(kvs)
    for (kk, vv), got in zip(kvs, batched):
        one = continuation_logits(default_bundle, kk, vv, ctx, cont)
        assert got.dtype == torch.float32 and got.shape == one.shape == (40, default_bundle.model.config.vocab_size)
        assert torch.equal(got, one)
    # the entries really differ (a lossy KV changes its own logits only)
    assert not torch.equal(batched[0], batched[2])
    # a single continuation token: row 0 only
    one_tok = continuation_logits_batch(default_bundle, kvs[:2], ctx, cont[:1])
    assert torch.equal(one_tok[1], continuation_logits(default_bundle, *kvs[1], ctx, cont[:1]))
    assert continuation_logits_batch(default_bundle, [], ctx, cont) == []


def test_batched_continuation_validates(default_bundle):
    p = build_prompt("pydoc_ppl", default_bundle.tokenizer, 64, seed=0, index=0)
    k, v = prefill_kv(default_bundle, p.context_ids)
    with pytest.raises(ExtractionError, match="dtype"):
        continuation_logits_batch(default_bundle, [(k, v), (k.float(), v.float())], p.context_ids, [1, 2])
    with pytest.raises(ExtractionError, match="at least one"):
        continuation_logits_batch(default_bundle, [(k, v)], p.context_ids, [])


def test_text_rows_do_not_depend_on_batch(default_bundle):
    from bench.quality import run_text_quality

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 20000, (2000,), generator=g).tolist()
    pairs = [("cachegen", 1), ("quant8", None), ("kivi2", None), ("raw", None)]
    res = [run_text_quality(default_bundle, ids, pairs, 2, 160, 24, seed=0, log=lambda m: None, batch=b)
           for b in (1, 3)]
    for r1, r3 in zip(*(sorted(r[0], key=lambda x: x["codec"]) for r in res)):
        assert r1["codec"] == r3["codec"]
        assert r1["per_window"] == r3["per_window"]
        assert r1["bits_per_element"] == r3["bits_per_element"]
    assert res[1][1]["lossless_check"]["passed"] and res[1][1]["batch"] == 3
    assert res[1][1]["batch_exact"] in (True, False) and res[0][1]["batch_exact"] is True   # batch 1: exact
    with pytest.raises(ValueError, match="batch"):
        run_text_quality(default_bundle, ids, pairs, 1, 160, 24, batch=0)


def test_text_rows_do_not_depend_on_codec_workers(default_bundle):
    # the codecs of a batch encoded + decoded by two threads: the same bytes, hence the same
    # figures as one at a time; a codec that raises is skipped with its reason either way
    from bench.quality import run_text_quality

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(100, 20000, (1500,), generator=g).tolist()
    pairs = [("cachegen", 0), ("cachegen", 5), ("kivi2", None), ("cachegen", 99), ("raw", None)]
    res = [run_text_quality(default_bundle, ids, pairs, 2, 128, 16, seed=1, log=lambda m: None, batch=4,
                            codec_workers=w) for w in (1, 2)]
    rows = [sorted(r[0], key=lambda x: (x["codec"], str(x["level"]))) for r in res]
    assert [(r["codec"], r["level"]) for r in rows[0]] == [("cachegen", 0), ("cachegen", 5), ("kivi2", None),
                                                            ("raw", None)]
    for a, b in zip(*rows):
        assert (a["codec"], a["level"]) == (b["codec"], b["level"])
        assert a["per_window"] == b["per_window"] and a["bits_per_element"] == b["bits_per_element"]
    assert res[0][1]["skipped"].keys() == res[1][1]["skipped"].keys() == {"cachegen 99"}
    assert res[1][1]["codec_workers"] == 2 and res[1][1]["lossless_check"]["passed"]


def test_batch_of_a_shape_is_checked_once_and_falls_back_to_batch_one(default_bundle, monkeypatch):
    # identity by construction on any CPU: the first call of a shape compares the
    # batched logits with batch 1; a shape whose kernels round differently (AMX) runs at batch 1
    from kv_extraction_hf import inject

    p = build_prompt("pydoc_ppl", default_bundle.tokenizer, 64, seed=0, index=0)
    ctx, cont = p.context_ids, p.continuation_ids[:6]
    k, v = prefill_kv(default_bundle, ctx)
    k2, v2 = codec.decode_kv(codec.encode_kv(k, v, codec="quant8"))
    kvs = [(k, v), (k2.to(k.dtype), v2.to(v.dtype))]
    monkeypatch.setattr(inject, "_EXACT_BATCH", {})
    assert inject.batch_is_exact(2, len(ctx), len(cont), k.dtype) is None
    ones = [continuation_logits(default_bundle, kk, vv, ctx, cont) for kk, vv in kvs]
    seen = []
    hook = default_bundle.model.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["input_ids"].shape[0]), with_kwargs=True)
    try:
        got = continuation_logits_batch(default_bundle, kvs, ctx, cont)
        assert all(torch.equal(a, b) for a, b in zip(got, ones))
        assert inject.batch_is_exact(2, len(ctx), len(cont), k.dtype) in (True, False)
        assert 2 in seen                       # the batched forward ran (and was compared)
        for exact in (False, True):
            inject._EXACT_BATCH[inject._batch_key(2, len(ctx), len(cont), k.dtype)] = exact
            seen.clear()
            got = continuation_logits_batch(default_bundle, kvs, ctx, cont)
            assert (2 in seen) == exact        # inexact: batch-1 forwards only
            if exact and not all(torch.equal(a, b) for a, b in zip(got, ones)):
                continue                       # (forced True on a machine where it is not)
            assert all(torch.equal(a, b) for a, b in zip(got, ones))
    finally:
        hook.remove()
