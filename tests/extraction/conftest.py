"""Fixtures of the extraction tests: a tiny random Gemma 3 (hybrid attention, window 8,
shorter than the test contexts) and the real Gemma 3 270M when it is already cached."""
from __future__ import annotations

import pytest
import torch

from kv_extraction_hf import model as model_mod


@pytest.fixture(scope="module")
def tiny_gemma3():
    """A random 6-layer Gemma 3 (layers 0-4 sliding, window 8; layer 5 full), float32."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=6,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=8,
                           max_position_embeddings=256, initializer_range=0.2)
    model = Gemma3ForCausalLM(cfg).eval().to(torch.float32)
    model.generation_config.eos_token_id = None
    kinds, window = model_mod.attention_layers(cfg)
    info = model_mod.ModelInfo(model_id="tiny-gemma3", weights_hash="0" * 64, dtype="float32", num_layers=6,
                               num_kv_heads=1, head_dim=32, max_context=256, path="", layer_kinds=kinds,
                               sliding_window=window)
    import types

    tok = types.SimpleNamespace(eos_token_id=None)
    return model_mod.ModelBundle(model=model, tokenizer=tok, info=info)


@pytest.fixture(scope="module")
def real_gemma3():
    """Gemma 3 270M in its own dtype (bf16), loaded once per module; the test is skipped
    when the model is not in the cache (``python -m kv_extraction_hf.model --info
    gemma3-270m`` fetches it)."""
    m = model_mod.NAMED_MODELS["gemma3-270m"]
    if not (model_mod.cache_dir() / "models" / m.dir_name / model_mod.SOURCE_FILE).is_file():
        pytest.skip("gemma3-270m not in the cache (opt-in)")
    return model_mod.load_model("gemma3-270m", log=lambda s: None)
