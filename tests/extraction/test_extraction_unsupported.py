"""Models the harness cannot handle fail with one line naming the feature and exit 2.

Tiny random models are built here (transformers config objects with random weights, saved
to a tmp folder with the default model's tokenizer): a Gemma-4-style hybrid (3
sliding-window layers with head_dim 32, one global layer with head_dim 64), a
DeepSeek-V2-like multi-head latent attention model, a T5 encoder-decoder, and a plain
Llama as the control that must still extract. `kv_extraction_hf.model.kv_shape` is also
checked on config objects alone for the other refused kinds (chunked and linear attention
layers, no attention heads); sliding-window layers (Mistral, Gemma 3) are accepted.

Run: .venv/bin/python -m pytest tests/extraction/test_extraction_unsupported.py -q
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from kv_extraction_hf.errors import ExtractionError  # noqa: E402
from kv_extraction_hf.model import UnsupportedModelError, kv_shape  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "chat_template.jinja")


def _tokenizer_dir():
    from kv_extraction_hf.model import default_model_dir

    try:
        d = default_model_dir(log=lambda m: None)
    except ExtractionError as exc:
        pytest.skip(f"default model unavailable: {exc}")
    return d


def _save(tmp_path: Path, name: str, model_cls, config) -> Path:
    """Random weights of `config` saved as a HF folder with the default tokenizer."""
    torch.manual_seed(0)
    out = tmp_path / name
    model_cls(config).save_pretrained(out)
    src = _tokenizer_dir()
    for f in TOKENIZER_FILES:
        if (src / f).is_file():
            shutil.copy(src / f, out / f)
    return out


VOCAB = 49152  # the default tokenizer's vocabulary (token ids must fit the embedding)


def _gemma4_hybrid():
    from transformers import Gemma4TextConfig

    cfg = Gemma4TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, global_head_dim=64,
                           sliding_window=64, layer_types=["sliding_attention"] * 3 + ["full_attention"],
                           hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                           max_position_embeddings=2048)
    from transformers import Gemma4ForCausalLM

    return Gemma4ForCausalLM, cfg


def _deepseek_v2_mla():
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    cfg = DeepseekV2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                           kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
                           v_head_dim=16, n_routed_experts=2, num_experts_per_tok=1, n_shared_experts=1,
                           first_k_dense_replace=1, max_position_embeddings=2048)
    return DeepseekV2ForCausalLM, cfg


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
                   num_heads=2)
    return T5ForConditionalGeneration, cfg


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048)
    return LlamaForCausalLM, cfg


def _cli(model_dir: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kv_extraction_hf", "--model", str(model_dir), "--task", "needle",
                           "--context-tokens", "256", "--num-contexts", "1", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("build, feature", [
    (_gemma4_hybrid, "per-layer K/V shapes are not supported (model type gemma4_text: head_dim 32 on 3 layers, "
                     "64 on 1 layer)"),
    (_deepseek_v2_mla, "multi-head latent attention (MLA, kv_lora_rank=16"),
    (_t5, "encoder-decoder models are not supported (model type t5)"),
], ids=["gemma4-per-layer-head-dim", "deepseek-v2-mla", "t5-encoder-decoder"])
def test_unsupported_model_cli_one_line_exit_2(tmp_path, build, feature):
    cls, cfg = build()
    mdir = _save(tmp_path, "model", cls, cfg)
    out = tmp_path / "out"
    cp = _cli(mdir, out)
    assert cp.returncode == 2, cp.stderr[-2000:]
    lines = [ln for ln in cp.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in cp.stderr, cp.stderr[-2000:]
    assert feature in lines[0]
    assert not out.exists() or not any(out.iterdir())  # nothing half-written


@pytest.mark.slow
def test_supported_tiny_model_still_extracts(tmp_path):
    """The control: a tiny random Llama with the same tokenizer passes the guard and dumps
    K/V of its own shape (the guard does not refuse what the harness can handle)."""
    cls, cfg = _llama()
    mdir = _save(tmp_path, "llama", cls, cfg)
    cp = _cli(mdir, tmp_path / "out")
    assert cp.returncode == 0, cp.stderr[-2000:]
    from kv_extraction_hf.dump import load_kv

    dumps = sorted((tmp_path / "out").glob("*.safetensors"))
    assert len(dumps) == 1
    k, v, meta = load_kv(dumps[0])
    import json

    T = len(json.loads(meta["token_ids"]))
    assert 200 < T <= 256 and tuple(k.shape) == (2, T, 1, 16) and k.shape == v.shape
    assert meta["model_num_layers"] == "2" and meta["model_head_dim"] == "16"


@pytest.mark.slow
def test_model_info_cli_and_load_model_refuse_the_same(tmp_path):
    cls, cfg = _gemma4_hybrid()
    mdir = _save(tmp_path, "g4", cls, cfg)
    cp = subprocess.run([sys.executable, "-m", "kv_extraction_hf.model", "--info", str(mdir)], cwd=ROOT,
                        capture_output=True, text=True, timeout=600)
    assert cp.returncode == 2 and cp.stderr.count("\n") == 1 and "per-layer K/V shapes" in cp.stderr
    from kv_extraction_hf.model import load_model

    with pytest.raises(UnsupportedModelError, match="per-layer K/V shapes"):
        load_model(str(mdir), log=lambda m: None)


def _cfg(name, **kw):
    return getattr(transformers, name)(**kw)


@pytest.mark.parametrize("make, feature", [
    (lambda: _cfg("Llama4TextConfig", num_hidden_layers=4),
     "layers that are neither full nor sliding-window attention are not supported (chunked_attention on 3 of 4"),
    (lambda: _cfg("Qwen3NextConfig", num_hidden_layers=4),
     "layers that are neither full nor sliding-window attention are not supported (linear_attention on 3 of 4"),
    (lambda: _cfg("MambaConfig"), "has no attention heads"),
    (lambda: _cfg("DeepseekV3Config"), "multi-head latent attention (MLA"),
    (lambda: _cfg("BartConfig"), "encoder-decoder models are not supported"),
])
def test_kv_shape_names_the_feature(make, feature):
    try:
        cfg = make()
    except (AttributeError, TypeError) as exc:  # not in this transformers version
        pytest.skip(f"config unavailable: {exc}")
    with pytest.raises(UnsupportedModelError) as ei:
        kv_shape(cfg)
    msg = str(ei.value)
    assert feature in msg and "\n" not in msg
    assert isinstance(ei.value, ExtractionError)


def test_kv_shape_of_supported_configs():
    llama = _cfg("LlamaConfig", hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                 num_hidden_layers=30, max_position_embeddings=8192)
    assert kv_shape(llama) == (30, 3, 64, 8192)
    # Qwen2 carries a sliding_window value but does not use it: full attention everywhere
    qwen = _cfg("Qwen2Config", num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                use_sliding_window=False, sliding_window=32, max_position_embeddings=1024)
    assert kv_shape(qwen) == (4, 2, 16, 1024)
    # a window as long as the context is no limit
    mistral = _cfg("MistralConfig", num_hidden_layers=2, sliding_window=4096, max_position_embeddings=4096)
    assert kv_shape(mistral)[0] == 2
    # sliding-window layers are supported: every layer (Mistral-7B-v0.1) or 5 of 6 (Gemma 3)
    from kv_extraction_hf.model import attention_layers

    mistral = _cfg("MistralConfig", num_hidden_layers=2, sliding_window=4096, max_position_embeddings=32768)
    assert kv_shape(mistral)[0] == 2 and attention_layers(mistral) == (("sliding", "sliding"), 4096)
    gemma3 = _cfg("Gemma3TextConfig", num_hidden_layers=6, sliding_window=512)
    assert attention_layers(gemma3) == (("sliding",) * 5 + ("full",), 512)
