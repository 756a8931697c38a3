"""Sliding-window storage end to end (codec/window/ -> kv_extraction_hf/inject.py): a
windowed KV injected into the model's own cache gives the full layout's logits bit for
bit; one token fewer per sliding layer does not.

CI part: a tiny random Gemma 3 (window 8, contexts shorter and longer than it). Opt-in
part: the real Gemma 3 270M when cached (bf16, the engine's dtype), at 2K tokens (stored
elements 0.375 of the full layout) and, with ``CACHEGEN_WINDOW_8K=1`` (about 2 min on 2
cores), 8K tokens (0.21875 <= 0.22).

Run: .venv/bin/python -m pytest tests/extraction/test_window_storage.py -q
"""
from __future__ import annotations

import os

import pytest
import torch

from codec import window
from kv_extraction_hf.errors import ExtractionError
from kv_extraction_hf.extract import prefill_kv
from kv_extraction_hf.inject import continuation_logits, generate_from_kv, greedy_decode
from kv_extraction_hf.inject_window import continuation_logits_windowed, make_cache_windowed, model_windows


def _windowed(k, v, windows, name="raw"):
    return window.decode_windowed(window.encode_windowed(k, v, windows, codec=name))


def _random_ids(n, seed, vocab=96):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@pytest.mark.parametrize("T", [3, 7, 8, 9, 30])
def test_windowed_logits_equal_the_full_layout(tiny_gemma3, T):
    b = tiny_gemma3
    ws = model_windows(b)
    assert ws == [8] * 5 + [None]
    ctx, cont = _random_ids(T, T), _random_ids(6, 100 + T)
    k, v = prefill_kv(b, ctx)
    ref = continuation_logits(b, k, v, ctx, cont)
    wkv = _windowed(k, v, ws)
    assert wkv.stored_elements == 2 * (T + 5 * min(T, 8)) * 32
    assert torch.equal(continuation_logits_windowed(b, wkv, ctx, cont), ref)
    kd, vd = wkv.dense()
    assert torch.equal(continuation_logits(b, kd, vd, ctx, cont), ref)
    cache = make_cache_windowed(wkv, b.model.config)
    assert cache.get_seq_length() == T
    assert [x.keys.shape[-2] for x in cache.layers] == [min(T, 7)] * 5 + [T]
    assert greedy_decode(b, cache, cont[:2], 8) == generate_from_kv(b, k, v, ctx, cont[:2], 8)


def test_lossy_windowed_paths_agree(tiny_gemma3):
    """For any decoded values the direct windowed cache and the zero-filled dense KV give
    the same logits (the sliding layers drop the zeros before any attention)."""
    b = tiny_gemma3
    ctx, cont = _random_ids(40, 1), _random_ids(5, 2)
    k, v = prefill_kv(b, ctx)
    wkv = _windowed(k, v, model_windows(b), "cachegen")
    kd, vd = wkv.dense()
    assert torch.equal(continuation_logits_windowed(b, wkv, ctx, cont), continuation_logits(b, kd, vd, ctx, cont))


def test_one_token_too_short_is_caught(tiny_gemma3):
    """Keeping W - 1 tokens per sliding layer (enough for the next token alone) loses the
    position that the re-run of the last context token needs: the dense path's first row
    changes, the windowed path refuses."""
    b = tiny_gemma3
    ctx, cont = _random_ids(30, 5), _random_ids(6, 6)
    k, v = prefill_kv(b, ctx)
    ref = continuation_logits(b, k, v, ctx, cont)
    short = [None if w is None else w - 1 for w in model_windows(b)]
    wkv = _windowed(k, v, short)
    kd, vd = wkv.dense()
    got = continuation_logits(b, kd, vd, ctx, cont)
    assert not torch.equal(got[0], ref[0]) and torch.equal(got[1:], ref[1:])
    with pytest.raises(ExtractionError, match="needs the last 7"):
        continuation_logits_windowed(b, wkv, ctx, cont)
    with pytest.raises(ExtractionError, match="full-attention"):     # a full layer given a window
        make_cache_windowed(_windowed(k, v, [8] * 6), b.model.config)


def _real_check(b, T: int, fraction: float):
    """Lossless (raw) windowed KV of a T-token context of Gemma 3: stored fraction, and
    continuation logits equal to the full layout's bit for bit (both paths)."""
    from transformers import DynamicCache

    from kv_extraction_hf.extract import cache_layers

    text = " ".join(["The harness stores the key and value cache of a context, streams it and injects it "
                     "back into the model; sliding-window layers keep only their last tokens."] * 400)
    ids = b.tokenizer(text)["input_ids"][:T + 6]
    assert len(ids) == T + 6
    ctx, cont = ids[:T], ids[T:]
    with torch.inference_mode():    # prefill_kv's, keeping only the last logits row (8K x 262K otherwise)
        out = b.model(input_ids=torch.tensor([ctx]), past_key_values=DynamicCache(), use_cache=True,
                      logits_to_keep=1)
    layers = cache_layers(out.past_key_values)
    del out
    k = torch.stack([x[0].transpose(0, 1) for x, _ in layers]).contiguous()
    v = torch.stack([y[0].transpose(0, 1) for _, y in layers]).contiguous()
    del layers
    ref = continuation_logits(b, k, v, ctx, cont)
    data, stats = window.encode_windowed_with_stats(k, v, model_windows(b), codec="raw")
    assert stats["stored_elements"] / stats["elements"] == fraction
    wkv = window.decode_windowed(data)
    assert torch.equal(continuation_logits_windowed(b, wkv, ctx, cont), ref)
    kd, vd = wkv.dense()
    assert torch.equal(continuation_logits(b, kd, vd, ctx, cont), ref)


@pytest.mark.slow
def test_real_gemma3_2k(real_gemma3):
    assert model_windows(real_gemma3) == ([512] * 5 + [None]) * 3
    _real_check(real_gemma3, 2048, (3 + 15 * 512 / 2048) / 18)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("CACHEGEN_WINDOW_8K") != "1", reason="8K prefill on CPU: opt-in "
                    "(CACHEGEN_WINDOW_8K=1, about 2 min on 2 cores)")
def test_real_gemma3_8k(real_gemma3):
    _real_check(real_gemma3, 8192, 0.21875)
