"""A tiny random Llama as a ModelBundle (no download): 2 layers, 2 KV heads of 16, a
97-token vocabulary and a character tokenizer (``ord(ch) % 97``), float32, weights hash
all zeros. For tests that run a model end to end (operating-point fits, quality rows)."""
from __future__ import annotations

VOCAB = 97


def tiny_llama_bundle(seed: int = 0):
    """The bundle (``kv_extraction_hf.model.ModelBundle``); the same weights for a seed."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kv_extraction_hf.model import ModelBundle, ModelInfo

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.2)
    model = LlamaForCausalLM(cfg).eval().to(torch.float32)
    tok = lambda text, **kw: {"input_ids": [ord(ch) % VOCAB for ch in text]}  # noqa: E731
    info = ModelInfo(model_id="tiny-llama", weights_hash="0" * 64, dtype="float32", num_layers=2,
                     num_kv_heads=2, head_dim=16, max_context=512, path="")
    return ModelBundle(model=model, tokenizer=tok, info=info)
