"""Per-layer K/V sensitivity (kv_extraction_hf.calibrate.sensitivity) on a tiny random Llama
built here (no download): the table's shape and units, coarser bins cost fewer bytes and
lose more, a measured table is deterministic and independent of torch's thread count, it is
cached by key, and the allocator reads it into a per-layer config that round-trips.

Run: .venv/bin/python -m pytest tests/extraction/test_sensitivity.py -q
"""
from __future__ import annotations

import pytest
import torch

from codec import bit_allocation as ba
from codec.config import CodecConfig
from kv_extraction_hf.calibrate import sensitivity as sens

VOCAB = 97
SETTINGS = {"windows": 2, "context_tokens": 48, "continuation_tokens": 8, "skip_tokens": 32}
BINS = (8, 16, 64)
TEXT = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 12


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM
    from kv_extraction_hf.model import ModelBundle, ModelInfo

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.2)
    model = LlamaForCausalLM(cfg).eval().to(torch.float32)
    tok = lambda text, **kw: {"input_ids": [ord(ch) % VOCAB for ch in text]}  # noqa: E731
    info = ModelInfo(model_id="tiny-llama", weights_hash="0" * 64, dtype="float32", num_layers=2,
                     num_kv_heads=2, head_dim=16, max_context=512, path="")
    return ModelBundle(model=model, tokenizer=tok, info=info)


def test_table_shape_units_and_monotone_cost(tiny, tmp_path):
    t = sens.fit_sensitivity(tiny, bins=BINS, settings=SETTINGS, text=TEXT, folder=tmp_path, log=lambda m: None)
    assert t["bins"] == list(BINS) and t["n"] == 2 and len(t["kl"]) == 2
    for layer in range(2):
        for kind in range(2):
            kl, nb = t["kl"][layer][kind], t["bytes"][layer][kind]
            assert len(kl) == len(BINS) and all(x >= 0 for x in kl)
            assert nb[0] < nb[1] < nb[2]                  # more bins, more bytes
            assert kl[0] > kl[2]                          # and less KL
            lo, hi = t["kl_ci"][layer][kind][0]
            assert lo <= kl[0] <= hi
    assert t["dtype_bytes"] == 2 * 2 * 48 * 2 * 16 * 4   # K + V, 2 layers, 48 tokens, fp32
    assert t["model"]["weights_hash"] == "0" * 64 and len(t["hash"]) == 64
    # the allocator reads it: a KL target between the extremes gives a valid per-layer config
    lo = ba.estimate(t, [64, 64], [64, 64])[0]
    hi = ba.estimate(t, [8, 8], [8, 8])[0]
    a = ba.allocate_bins(t, kl_target=(lo + hi) / 2)
    assert a.kl <= (lo + hi) / 2 and set(a.key_bins + a.value_bins) <= set(BINS)
    cfg = ba.config_from_bins(CodecConfig.for_model(2), a.key_bins, a.value_bins)
    assert cfg.key_bins == list(a.key_bins) and cfg.value_bins == list(a.value_bins)


def test_deterministic_and_thread_count_independent(tiny, tmp_path):
    threads = torch.get_num_threads()
    hashes = []
    try:
        for i, nt in enumerate((1, 2, 1)):
            torch.set_num_threads(nt)
            t = sens.fit_sensitivity(tiny, bins=BINS, settings=SETTINGS, text=TEXT, folder=tmp_path / str(i),
                                     log=lambda m: None)
            hashes.append(t["hash"])
    finally:
        torch.set_num_threads(threads)
    assert len(set(hashes)) == 1
    # cached: a second call with the same key measures nothing
    again = sens.fit_sensitivity(tiny, bins=BINS, settings=SETTINGS, text=TEXT, folder=tmp_path / "0",
                                 log=lambda m: pytest.fail("measured again"))
    assert again["hash"] == hashes[0]
    # another base config is another key: measured again
    other = CodecConfig.for_model(2, sink_tokens=0)
    assert sens.sensitivity_key("0" * 64, "x", SETTINGS, BINS, other) != \
        sens.sensitivity_key("0" * 64, "x", SETTINGS, BINS, CodecConfig.for_model(2))


def test_too_short_text_is_an_extraction_error(tiny, tmp_path):
    from kv_extraction_hf.errors import ExtractionError

    with pytest.raises(ExtractionError):
        sens.fit_sensitivity(tiny, bins=BINS, settings=dict(SETTINGS, windows=50), text=TEXT, folder=tmp_path,
                             log=lambda m: None)
