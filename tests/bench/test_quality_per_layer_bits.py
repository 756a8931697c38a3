"""bench.quality --per-layer-bits (bench.quality.per_layer_bits): the verdict rules on
hand-made summaries, the paired differences, the flag errors, and a whole run on a tiny
random Llama built here (no download; its cache in a temporary folder): every target's
uniform point and both allocations are measured on the same held-out windows.

Run: .venv/bin/python -m pytest tests/bench/test_quality_per_layer_bits.py -q
"""
from __future__ import annotations

import pytest
import torch

from bench.quality import per_layer_bits as plb
from bench.quality.config import QualityError

VOCAB = 97


def _s(ratio, kl=0.05):
    return {"ratio": ratio, "kl": kl, "kl_ci": [kl - 0.01, kl + 0.01], "top1": 0.9, "top1_ci": [0.88, 0.92], "n": 16}


def test_verdicts():
    below, above, across = {"kl_ci": [-0.02, -0.001]}, {"kl_ci": [0.001, 0.02]}, {"kl_ci": [-0.01, 0.01]}
    assert plb.verdict("matched-bytes", _s(8.0), _s(8.0), below)["winner"] == "per-layer"
    assert plb.verdict("matched-bytes", _s(8.0), _s(8.0), above)["winner"] == "uniform"
    assert plb.verdict("matched-bytes", _s(8.0), _s(8.0), across)["winner"] == "tie"
    # more than 1% larger: not matched, uniform keeps it even with a lower KL
    assert plb.verdict("matched-bytes", _s(7.8), _s(8.0), below)["winner"] == "uniform"
    assert plb.verdict("matched-kl", _s(8.4), _s(8.0), across)["winner"] == "per-layer"
    assert plb.verdict("matched-kl", _s(8.4), _s(8.0), above)["winner"] == "uniform"
    assert plb.verdict("matched-kl", _s(7.9), _s(8.0), below)["winner"] == "uniform"


def test_paired_differences():
    a = {"per_window": {"kl": [0.1, 0.2, 0.3], "top1": [1.0, 0.9, 0.8]}}
    b = {"per_window": {"kl": [0.2, 0.2, 0.4], "top1": [1.0, 1.0, 0.8]}}
    d = plb.paired(a, b)
    assert d["n"] == 3 and d["kl"] == pytest.approx(-0.2 / 3) and d["top1"] == pytest.approx(-0.1 / 3)
    assert d["kl_ci"][0] <= d["kl"] <= d["kl_ci"][1]
    with pytest.raises(QualityError, match="windows"):
        plb.paired(a, {"per_window": {"kl": [0.1], "top1": [1.0]}})


@pytest.mark.parametrize("argv, msg", [
    (["--per-layer-bits"], "need --targets"),
    (["--targets", "lmcache", "--sensitivity-data", "/nonexistent"], "read by --per-layer-bits only"),
    (["--targets", "lmcache", "--per-layer-bits", "--sensitivity-data", "/nonexistent"], "not a file"),
])
def test_flag_errors_exit_2_with_one_line(argv, msg, capsys):
    from bench.quality.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and "\n" not in err and "Traceback" not in err


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


def test_whole_run_on_a_tiny_model(tiny, tmp_path, monkeypatch):
    from bench.quality.text import run_text_quality
    from codec import operating_points as op
    from codec.config import CodecConfig

    monkeypatch.setenv("CACHEGEN_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "valid.txt"
    text.write_text("Sphinx of black quartz, judge my vow; how vexingly quick daft zebras jump. " * 40)

    def measure(b, ids, pairs, n, ctx, cont, seed, cfgs):
        return run_text_quality(b, ids, pairs, n, ctx, cont, seed, log=lambda m: None, batch=4,
                                codec_workers=1, configs=cfgs)[0]

    held_ids = [ord(c) % VOCAB for c in "The five boxing wizards jump quickly over the lazy dog. " * 30]
    part = plb.run_per_layer_bits(tiny, held_ids, [op.parse_target("kl:100")], (4, 48, 8, 0), 3, measure,
                                  sensitivity_text=text,
                                  sensitivity_settings={"windows": 2, "context_tokens": 48,
                                                        "continuation_tokens": 8, "skip_tokens": 32},
                                  log=lambda m: None)
    (row,) = part["rows"]
    assert row["target"] == "kl:100" and row["uniform"]["heldout"]["n"] == 4
    assert set(row["comparisons"]) == {"matched-bytes", "matched-kl"}
    for kind, c in row["comparisons"].items():
        assert c["heldout"]["n"] == 4 and c["paired_vs_uniform"]["n"] == 4
        assert c["verdict"]["winner"] in ("per-layer", "uniform", "tie")
        cfg = CodecConfig.from_dict(c["config"])
        assert cfg.key_bins == c["allocation"]["key_bins"] and cfg.level is None
    mb = row["comparisons"]["matched-bytes"]["allocation"]
    assert mb["bytes_estimate"] <= row["uniform"]["bytes_estimate"] + 1e-6
    mk = row["comparisons"]["matched-kl"]["allocation"]
    assert mk["kl_estimate"] <= row["uniform"]["kl_estimate"] + 1e-9
    assert part["sensitivity"]["text"]["source"] == "valid.txt" and part["sensitivity"]["n"] == 2
    assert part["reference"]["heldout"]["n"] == 4
