"""The default KVTC calibration text (kv_extraction_hf.calibration_text):
offline, deterministic, large enough for the default fit, and sharing no sentence with
the pydoc_data.topics text the main job evaluates on.

Run: .venv/bin/python -m pytest tests/extraction/test_calibration_text.py -q
"""
from __future__ import annotations

import hashlib
import re

from kv_extraction_hf import calibrate as kc
from kv_extraction_hf import calibration_text as ct
from kv_extraction_hf.natural_text import natural_paragraphs, natural_sentences


def test_no_sentence_of_the_evaluated_text_and_no_code():
    text, rec = ct.calibration_text()
    sentences = [s for para in text.split("\n\n")
                 for s in re.split(r"(?<=[.!?])\s+(?=[A-Z\"(])", para.strip()) if s]
    assert len(sentences) == rec["sentences"] > 1000
    assert not set(sentences) & set(natural_sentences())
    # nor a whole paragraph of the evaluated text (the needle filler / pydoc_ppl contexts)
    paras = set(natural_paragraphs())
    assert not any(p.strip() in paras for p in text.split("\n\n"))
    assert ">>>" not in text and "::" not in text
    assert len(set(sentences)) == len(sentences)          # no sentence twice


def test_record_is_the_exact_text_and_deterministic():
    text, rec = ct.calibration_text()
    assert rec["sha256"] == hashlib.sha256(text.encode("utf-8")).hexdigest()
    assert rec["chars"] == len(text) and rec["source"] == ct.SOURCE
    assert rec["python"] in rec["description"] and rec["modules"] == len(ct.STDLIB_MODULES)
    ct._build.cache_clear()
    assert ct.calibration_text() == (text, rec)
    assert kc._default_text() == (text, rec)


def test_enough_tokens_for_the_default_fit(default_tokenizer):
    text, _ = ct.calibration_text()
    need = kc.DEFAULT_SETTINGS["windows"] * kc.DEFAULT_SETTINGS["window_tokens"]
    n = len(default_tokenizer(text, add_special_tokens=False)["input_ids"])
    assert n >= 4 * need          # ~51k tokens for 4 x 1024 on Python 3.11


def test_default_key_names_the_text_and_records_it():
    from types import SimpleNamespace

    a = kc.settings_key("w" * 64, kc.DEFAULT_SETTINGS, "a" * 64)
    assert a != kc.settings_key("w" * 64, kc.DEFAULT_SETTINGS, "b" * 64)
    cal = SimpleNamespace(meta={"data": "x", "data_source": ct.SOURCE, "data_description": "d",
                                "data_sha256": "c" * 64}, hash="h" * 64, group_layers=2)
    assert kc.text_record(cal) == {"source": ct.SOURCE, "description": "d", "sha256": "c" * 64}
    assert kc.calibration_provenance(cal, "default") == {
        "hash": "h" * 64, "source": "default", "group_layers": 2,
        "text": {"source": ct.SOURCE, "description": "d", "sha256": "c" * 64}}
    # an older artifact: its free-form data name is the description
    old = SimpleNamespace(meta={"data": "wikitext-2 valid (valid.txt)"})
    assert kc.text_record(old) == {"source": "", "description": "wikitext-2 valid (valid.txt)",
                                   "sha256": ""}


def test_calibrate_data_file_records_its_text(tmp_path, fixtures_dir):
    """``python -m kv_extraction_hf.calibrate --data FILE`` (WikiText-2 validation or any
    text a user has): the artifact names the file and the sha256 of the text it used."""
    from codec import kvtc
    from kv_extraction_hf.datasets_loaders import load_wikitext2

    src = fixtures_dir / "wikitext2" / "wiki.test.raw"
    out = tmp_path / "cal.safetensors"
    assert kc.main(["--data", str(src), "--windows", "1", "--window-tokens", "256",
                    "--weighting", "relative", "--metric", "none", "--group-layers", "0",
                    "--out", str(out)]) == 0
    cal = kvtc.load_calibration(out)
    text = load_wikitext2(str(src), split="validation")
    assert kc.text_record(cal) == {"source": "file", "description": src.name,
                                   "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()}


def test_default_key_names_the_fitting_procedure(monkeypatch):
    """A default fitted by an older fitting procedure is another cache entry (never served
    after the procedure changed)."""
    a = kc.settings_key("w" * 64, kc.DEFAULT_SETTINGS, "a" * 64)
    monkeypatch.setattr(kc, "FIT_VERSION", kc.FIT_VERSION + 1)
    assert a != kc.settings_key("w" * 64, kc.DEFAULT_SETTINGS, "a" * 64)
