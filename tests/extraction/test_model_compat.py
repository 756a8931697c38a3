"""Model compatibility table (docs/models.md, between its GENERATED markers), made here.

For each architecture: a tiny random-weight model built from its transformers config class
(2 layers, hidden size 64, vocabulary 128, float32, no download; sliding-window layers get
a window of 8 tokens, shorter than the 24-token context, so the window matters) goes
through the harness's stages: ``attention_layers`` / ``kv_shape`` -> ``prefill_kv`` (KV
``[L, T, H_kv, D]``) -> every codec of ``codec.CODECS`` (``encode_kv`` -> ``decode_kv``;
kvtc with a calibration fitted here on the tiny model's own KV) -> ``continuation_logits``
(HF injection with the model's own cache class, sliding layers included).

Checks: the lossless codec (``raw``) reproduces the model's own next-token logits (one
forward over context + continuation) within ``LOSSLESS_BOUND`` (float32 logits, absolute:
only the order of the float32 sums differs between the batched and the incremental
attention; measured <= 1e-6 here) and the same argmax; every lossy codec decodes to the
KV's shape and dtype and its injected logits are finite. Architectures the harness refuses
are listed with kv_shape's one-line reason (config objects only).

``CGH_WRITE_MODELS_DOC=1 .venv/bin/python -m pytest tests/extraction/test_model_compat.py`` rewrites
the table; without it the test fails when docs/models.md differs from what it measured.

Run: .venv/bin/python -m pytest tests/extraction/test_model_compat.py -q
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import codec  # noqa: E402
from kv_extraction_hf.errors import ExtractionError  # noqa: E402
from kv_extraction_hf.model import ModelBundle, ModelInfo, attention_layers, kv_shape  # noqa: E402

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"
BEGIN, END = "<!-- BEGIN GENERATED: tests/extraction/test_model_compat.py -->", "<!-- END GENERATED -->"
VOCAB, CTX, CONT, WINDOW = 128, 24, 5, 8
LOSSLESS_BOUND = 1e-4       # max |logit difference|, float32 (see the module docstring)
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=2, eos_token_id=1, pad_token_id=0)

# (architecture, config class, causal-LM class, extra config fields)
SUPPORTED = [
    ("Llama", "LlamaConfig", "LlamaForCausalLM", {}),
    ("Mistral (sliding window)", "MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
    ("Qwen2", "Qwen2Config", "Qwen2ForCausalLM", {}),
    ("Qwen3", "Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    ("Phi3", "Phi3Config", "Phi3ForCausalLM", {}),
    ("Gemma2 (sliding + full)", "Gemma2Config", "Gemma2ForCausalLM",
     {"head_dim": 16, "sliding_window": WINDOW}),
    ("Gemma3 (sliding + full)", "Gemma3TextConfig", "Gemma3ForCausalLM",
     {"head_dim": 16, "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}),
    ("OLMo2", "Olmo2Config", "Olmo2ForCausalLM", {}),
    ("Granite", "GraniteConfig", "GraniteForCausalLM", {}),
    ("StableLM", "StableLmConfig", "StableLmForCausalLM", {}),
]
# (architecture, config class, fields): refused by kv_shape before any weights load
REFUSED = [
    ("Gemma4 (per-layer head dims)", "Gemma4TextConfig",
     dict(num_hidden_layers=4, head_dim=32, global_head_dim=64, sliding_window=64,
          layer_types=["sliding_attention"] * 3 + ["full_attention"])),
    ("DeepSeek-V3 (MLA)", "DeepseekV3Config", {}),
    ("Llama4 (chunked attention)", "Llama4TextConfig", dict(num_hidden_layers=4)),
    ("Qwen3-Next (linear attention)", "Qwen3NextConfig", dict(num_hidden_layers=4)),
    ("Mamba (no attention)", "MambaConfig", {}),
]


def _kvtc_config(k, v):
    from codec.kvtc import KvtcConfig, fit_calibration

    cal = fit_calibration(k.float(), v.float(), sink_tokens=1, recent_tokens=1)
    return KvtcConfig(calibration=cal)


def _kinds_text(kinds, window) -> str:
    if "sliding" not in kinds:
        return f"{len(kinds)} full"
    ns = kinds.count("sliding")
    nf = len(kinds) - ns
    return f"{ns} sliding (window {window}) + {nf} full" if nf else f"{ns} sliding (window {window})"


def _row(name, cfg_name, model_name, extra) -> tuple[str, str, str, str]:
    """(architecture, layers, KV shape, outcome) of one tiny model through every stage."""
    cfg = getattr(transformers, cfg_name)(**{**COMMON, **extra})
    try:
        L, H, D, _ = kv_shape(cfg)
        kinds, window = attention_layers(cfg)
    except ExtractionError as exc:
        return name, "-", "-", f"refused: {exc}"
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(cfg).eval().to(torch.float32)
    info = ModelInfo(model_id=name, weights_hash="0" * 64, dtype="float32", num_layers=L, num_kv_heads=H,
                     head_dim=D, max_context=256, path="", layer_kinds=kinds if "sliding" in kinds else (),
                     sliding_window=window)
    bundle = ModelBundle(model=model, tokenizer=None, info=info)
    from kv_extraction_hf.extract import prefill_kv
    from kv_extraction_hf.inject import continuation_logits

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, VOCAB, (CTX + CONT,), generator=g).tolist()
    ctx, cont = ids[:CTX], ids[CTX:]
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0, CTX - 1:CTX + CONT - 1].float()
    k, v = prefill_kv(bundle, ctx)
    assert k.shape == (L, CTX, H, D)
    failures = []
    for cname, c in codec.CODECS.items():
        try:
            config = _kvtc_config(k, v) if cname == "kvtc" else None
            k2, v2 = codec.decode_kv(codec.encode_kv(k, v, codec=cname, config=config))
            assert k2.shape == k.shape and k2.dtype == k.dtype
            got = continuation_logits(bundle, k2, v2, ctx, cont)
            assert torch.isfinite(got).all(), "non-finite logits"
            if c.lossless:
                err = (got - ref).abs().max().item()
                assert err <= LOSSLESS_BOUND, f"lossless logits differ by {err:.2e}"
                assert torch.equal(got.argmax(-1), ref.argmax(-1)), "lossless argmax differs"
        except Exception as exc:  # noqa: BLE001 - the table records the reason
            failures.append(f"{cname}: {type(exc).__name__}: {' '.join(str(exc).split())[:120]}")
    outcome = "works" if not failures else "fails: " + "; ".join(failures)
    return name, _kinds_text(kinds, window), f"{H} x {D}", outcome


def _refused_row(name, cfg_name, fields) -> tuple[str, str, str, str]:
    cfg = getattr(transformers, cfg_name)(**fields)
    try:
        kv_shape(cfg)
    except ExtractionError as exc:
        return name, "-", "-", f"refused: {exc}"
    return name, "-", "-", "accepted (expected a refusal)"


def _table(rows) -> str:
    codecs = ", ".join(codec.CODECS)
    lines = [BEGIN,
             f"Tiny random-weight models (2 layers, hidden 64, float32, {CTX}-token context, sliding window "
             f"{WINDOW}), transformers {transformers.__version__}; codecs: {codecs}; lossless (raw) logits "
             f"within {LOSSLESS_BOUND:g} of the model's own.",
             "",
             "| Architecture | Layers | KV heads x head dim | Outcome |",
             "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d.replace('|', '/')} |" for a, b, c, d in rows]
    lines.append(END)
    return "\n".join(lines)


def test_model_compat_table():
    rows = [_row(*r) for r in SUPPORTED] + [_refused_row(*r) for r in REFUSED]
    by = {r[0]: r for r in rows}
    for name, *_ in SUPPORTED:
        assert by[name][3] == "works", by[name]
    for name, *_ in REFUSED:
        assert by[name][3].startswith("refused: "), by[name]
    assert by["Gemma3 (sliding + full)"][1] == f"1 sliding (window {WINDOW}) + 1 full"
    table = _table(rows)
    text = DOC.read_text() if DOC.is_file() else ""
    if os.environ.get("CGH_WRITE_MODELS_DOC") == "1":
        if BEGIN in text and END in text:
            text = text[:text.index(BEGIN)] + table + text[text.index(END) + len(END):]
        else:
            text = text.rstrip("\n") + "\n\n" + table + "\n"
        DOC.write_text(text)
    assert BEGIN in text and END in text, "docs/models.md has no generated table (CGH_WRITE_MODELS_DOC=1)"
    assert text[text.index(BEGIN):text.index(END) + len(END)] == table, (
        "docs/models.md is stale: rerun with CGH_WRITE_MODELS_DOC=1")
