"""Text that is not valid Unicode in every data path is one ExtractionError line, exit 2
(kind of ai-microcore #74): a lone surrogate (a valid JSON escape such as
"\\ud800") or a NUL in a --tasks jsonl / longchat / longbench context, question or answer;
invalid UTF-8 bytes in a data file; the same in WikiText and calibration text files.
kv_extraction_hf.textcheck.check_text is the one check.

Run: .venv/bin/python -m pytest tests/extraction/test_text_validity.py -q
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kv_extraction_hf import datasets_loaders as D
from kv_extraction_hf.errors import ExtractionError
from kv_extraction_hf.textcheck import check_text

ROOT = Path(__file__).resolve().parents[2]
BAD = {"high": "\ud800", "low": "\udfff", "nul": "\x00"}
GOOD_CTX = "Paris is the capital of France. " * 3


@pytest.mark.parametrize("kind", sorted(BAD))
def test_check_text_names_the_character_and_where(kind):
    with pytest.raises(ExtractionError) as ei:
        check_text("ab" + BAD[kind] + "cd", "f.jsonl row 2 field 'q'")
    msg = str(ei.value)
    assert "f.jsonl row 2 field 'q'" in msg and "character 2" in msg and "\n" not in msg
    assert ("U+0000" if kind == "nul" else f"U+{ord(BAD[kind]):04X}") in msg


def test_check_text_passes_real_text():
    s = "naïve café 日本語 \U0001F600 tab\tnewline\n"  # a surrogate PAIR is fine
    assert check_text(s, "x") is s
    assert check_text(json.loads('"\\ud83d\\ude00"'), "x") == "\U0001F600"


def _jsonl(path: Path, rows) -> str:
    # json.dumps escapes lone surrogates as \\udXXX: exactly what a user's file holds
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="ascii")
    return str(path)


@pytest.mark.parametrize("kind", sorted(BAD))
@pytest.mark.parametrize("field", ["context", "question", "answers", "answer_list"])
def test_jsonl_rows_with_bad_text_are_refused(tmp_path, kind, field):
    row = {"doc": GOOD_CTX, "q": "What is the capital?", "a": "Paris"}
    if field == "context":
        row["doc"] += BAD[kind]
    elif field == "question":
        row["q"] = BAD[kind] + row["q"]
    elif field == "answers":
        row["a"] = "Par" + BAD[kind] + "is"
    else:
        row["a"] = ["Paris", "x" + BAD[kind]]
    path = _jsonl(tmp_path / "bad.jsonl", [{"doc": GOOD_CTX, "q": "ok?", "a": "ok"}, row])
    with pytest.raises(ExtractionError, match="row 2 field") as ei:
        D.load_user_data("jsonl", path, {"context": "doc", "question": "q", "answers": "a"})
    assert "\n" not in str(ei.value)


@pytest.mark.parametrize("kind", ["high", "nul"])
def test_longchat_and_longbench_rows_with_bad_text(tmp_path, kind):
    lc = _jsonl(tmp_path / "lc.jsonl", [{"test_id": 0, "label": ["jazz"], "prompt":
                "Now the record start. USER: jazz" + BAD[kind] + " Now the record ends. "
                "What is the first topic we discussed?"}])
    with pytest.raises(ExtractionError, match="field 'prompt'"):
        D.load_user_data("longchat", lc)
    lb = _jsonl(tmp_path / "lb.jsonl", [{"context": GOOD_CTX, "input": "q" + BAD[kind],
                                         "answers": ["Paris"]}])
    with pytest.raises(ExtractionError, match="field 'input'"):
        D.load_user_data("longbench", lb)


def test_invalid_utf8_bytes_in_a_data_file(tmp_path):
    p = tmp_path / "bytes.jsonl"
    p.write_bytes(b'{"doc": "caf\xe9", "q": "x", "a": "y"}\n')  # latin-1, not UTF-8
    with pytest.raises(ExtractionError, match="cannot read"):
        D.load_user_data("jsonl", str(p), {"context": "doc", "question": "q", "answers": "a"})


@pytest.mark.parametrize("raw", [b"= Title =\nsome text \xff\xfe more\n",
                                 b"= Title =\nsome text \xed\xa0\x80 (CESU surrogate)\n",
                                 b"= Title =\nsome\x00text\n"])
def test_wikitext_and_calibration_text_files(tmp_path, raw):
    from kv_extraction_hf.wikitext import load_wikitext2_split

    p = tmp_path / "wiki.test.raw"
    p.write_bytes(raw)
    with pytest.raises(ExtractionError) as ei:
        load_wikitext2_split("test", data_path=str(p))
    assert "\n" not in str(ei.value)
    D.load_wikitext2.cache_clear()
    with pytest.raises(ExtractionError):  # the calibration --data path reads it this way
        D.load_wikitext2(str(p), split="validation")


def test_prompt_builder_backstop(default_tokenizer):
    """Any text reaching the tokenizer through the prompt builder is checked (the
    tokenizer's own failure is a TypeError traceback)."""
    from kv_extraction_hf.prompts.base import encode

    with pytest.raises(ExtractionError, match="U\\+D800"):
        encode(default_tokenizer, "abc\ud800")
    assert encode(default_tokenizer, "abc")


def _cli(argv, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize("entry", ["extract", "run_benchmarks", "quality"])
def test_entry_points_give_one_line_and_exit_2(tmp_path, entry):
    path = _jsonl(tmp_path / "bad.jsonl", [{"doc": GOOD_CTX + "\ud800", "q": "q?", "a": "a"}])
    fields = ["--data-path", path, "--data-map", "context=doc,question=q,answers=a"]
    argv = {
        "extract": ["-m", "kv_extraction_hf", "--task", "jsonl", *fields, "--out",
                    str(tmp_path / "o")],
        "run_benchmarks": ["run_benchmarks.py", "--quick", "--tasks", "jsonl", *fields,
                           "--out", str(tmp_path / "o")],
        # bench.quality's --data-path is a WikiText-2 folder: a NUL in its test file
        "quality": ["-m", "bench.quality", "--quick", "--data-path", str(tmp_path / "wiki"),
                    "--out", str(tmp_path / "q.json")],
    }[entry]
    (tmp_path / "wiki").mkdir()
    (tmp_path / "wiki" / "wiki.test.raw").write_bytes(b"= T =\nsome\x00text\n" * 50)
    proc = _cli(argv, tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    if entry == "quality":
        assert "NUL character (U+0000)" in last and "wiki.test.raw" in last
    else:
        assert "U+D800" in last and "row 1 field 'doc'" in last
    assert not (tmp_path / "o").exists() and not (tmp_path / "q.json").exists()
