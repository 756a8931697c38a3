"""A user's own data through the one --data-path flag: LongChat (the CacheGen artifact's
format), LongBench rows, a generic JSONL mapping, over-long rows, wrong fields, flags a
task does not use (kv_extraction_hf.datasets_loaders / prompts / dataflags)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kv_extraction_hf import datasets_loaders as D
from kv_extraction_hf.dataflags import add_data_flags, data_map_from_args
from kv_extraction_hf.errors import ExtractionError
from kv_extraction_hf.prompts import build_prompt, check_data_flags

ROOT = Path(__file__).resolve().parents[2]

TOPICS = ["the history of jazz", "deep sea fishing", "medieval castles"]


def _longchat_prompt(topics, filler_sentences=3):
    turns = " ".join(f"USER: I would like to discuss the topic of {t}. ASSISTANT: Sure! "
                     + "It is an interesting subject with a long history. " * filler_sentences
                     for t in topics)
    return (f"Below is a record of our previous conversation on {len(topics)} different topics. "
            f"Now the record start. {turns} Now the record ends. What is the first topic we discussed? "
            "Only give me the topic name. Do not summarize yourself.")


def _write(path: Path, rows) -> str:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


@pytest.fixture()
def longchat_file(tmp_path):
    rows = [{"test_id": i, "prompt": _longchat_prompt(TOPICS[i:] + TOPICS[:i]), "label": TOPICS[i:] + TOPICS[:i]}
            for i in range(3)]
    return _write(tmp_path / "longchat.jsonl", rows)


def test_longchat_rows_split_into_conversation_and_question(default_tokenizer, longchat_file):
    recs = D.load_user_data("longchat", longchat_file)
    assert [r.row_id for r in recs] == ["0", "1", "2"] and recs[1].answers[0] == TOPICS[1]
    assert recs[0].context.endswith("Now the record ends.")
    assert recs[0].question.startswith("What is the first topic")
    p = build_prompt("longchat", default_tokenizer, 4096, index=1, data_path=longchat_file)
    assert p.answer == TOPICS[1] and p.metric == "retrieval_accuracy"
    assert p.meta == {"row_id": "1", "truncated_from_tokens": None}
    text = default_tokenizer.decode(p.context_ids + p.question_ids)
    assert "I would like to discuss the topic of deep sea fishing" in text
    assert default_tokenizer.decode(p.question_ids).lstrip().startswith("What is the first topic")


def test_longbench_rows_and_generic_mapping(default_tokenizer, tmp_path):
    lb = _write(tmp_path / "lb.jsonl", [{"context": "Paris is the capital of France. " * 5,
                                         "input": "What is the capital of France?",
                                         "answers": ["Paris"], "_id": "abc"}])
    p = build_prompt("longbench", default_tokenizer, 1024, data_path=lb)
    assert p.metric == "qa_f1" and p.answers == ["Paris"] and p.meta["row_id"] == "abc"
    gen = _write(tmp_path / "mine.jsonl", [{"doc": "The river Thames flows through London.", "q": "Which river?",
                                            "gold": "Thames"}])
    mapping = {"context": "doc", "question": "q", "answers": "gold"}
    g = build_prompt("jsonl", default_tokenizer, 1024, data_path=gen, data_map=mapping)
    assert g.answers == ["Thames"] and "Thames flows" in default_tokenizer.decode(g.context_ids)
    assert "Which river?" in default_tokenizer.decode(g.question_ids)


def test_over_long_row_truncated_in_the_middle_or_refused(default_tokenizer, tmp_path):
    long_ctx = "BEGINNING. " + "Filler words about nothing in particular. " * 400 + "THE END."
    f = _write(tmp_path / "long.jsonl", [{"context": long_ctx, "input": "How does it end?", "answers": ["end"]}])
    p = build_prompt("longbench", default_tokenizer, 512, data_path=f)
    assert len(p.context_ids) <= 512
    full = p.meta["truncated_from_tokens"]
    assert full is not None and full > 2000
    text = default_tokenizer.decode(p.context_ids)
    assert "BEGINNING." in text and "THE END." in text  # head and tail kept
    # the model's context (minus question and generation budget) also bounds it
    q = build_prompt("longbench", default_tokenizer, 100_000, data_path=f, max_prompt_tokens=700)
    assert len(q.context_ids) + len(q.question_ids) + q.max_new_tokens <= 700
    with pytest.raises(ExtractionError, match=r"more than the 512 tokens \(--context-tokens 512"):
        build_prompt("longbench", default_tokenizer, 512, data_path=f, truncate=False)
    with pytest.raises(ExtractionError, match="model's context 700"):
        build_prompt("longbench", default_tokenizer, 100_000, data_path=f, max_prompt_tokens=700, truncate=False)


def test_wrong_fields_and_bad_files_are_one_clear_error(tmp_path):
    gen = _write(tmp_path / "mine.jsonl", [{"doc": "x y z", "q": "?", "gold": ["a"]}])
    with pytest.raises(ExtractionError, match=r"row 1 has no field 'document' \(fields: doc, gold, q\)"):
        D.load_user_data("jsonl", gen, {"context": "document", "question": "q", "answers": "gold"})
    with pytest.raises(ExtractionError, match="needs the field of answers"):
        D.load_user_data("jsonl", gen, {"context": "doc", "question": "q"})
    lc = _write(tmp_path / "lc.jsonl", [{"test_id": 1, "prompt": "hi"}])
    with pytest.raises(ExtractionError, match="no field 'label'"):
        D.load_user_data("longchat", lc)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\nnot json\n')
    with pytest.raises(ExtractionError, match="line 2: not valid JSON"):
        D.read_jsonl(bad)
    # a hostile row: nested far past any dataset's shape, or not an object
    for row in ("[" * 200_000 + "]" * 200_000, '{"a":' * 100_000 + "1" + "}" * 100_000, "[1, 2]"):
        bad.write_text('{"a": 1}\n' + row + "\n")
        with pytest.raises(ExtractionError, match="line 2: (JSON nested more than 32|expected a JSON object)"):
            D.read_jsonl(bad)
    with pytest.raises(ExtractionError, match="not found"):
        D.read_jsonl(tmp_path / "missing.jsonl")
    with pytest.raises(ExtractionError, match="role 'ctx' is unknown"):
        D.parse_data_map("ctx=doc")


def test_flags_a_task_does_not_use_are_errors():
    with pytest.raises(ExtractionError, match="--data-path is not used by task"):
        check_data_flags("needle", "f.jsonl")
    with pytest.raises(ExtractionError, match="--data-map / --data-field-\\* are not used"):
        check_data_flags(["longchat"], "f.jsonl", {"context": "a"})
    with pytest.raises(ExtractionError, match="pass --data-path"):
        check_data_flags(["longchat"])
    check_data_flags(["longbench"], "f.jsonl", {"question": "q"})  # remapping one LongBench field


def test_data_map_and_field_flags_combine():
    p = argparse.ArgumentParser()
    add_data_flags(p)
    args = p.parse_args(["--data-map", "context=doc,question=q", "--data-field-answers", "gold"])
    assert data_map_from_args(args) == {"context": "doc", "question": "q", "answers": "gold"}
    args = p.parse_args(["--data-map", "context=doc", "--data-field-context", "other"])
    with pytest.raises(ExtractionError, match="given twice"):
        data_map_from_args(args)
    assert data_map_from_args(p.parse_args([])) is None


@pytest.mark.parametrize("argv", [
    ["-m", "kv_extraction_hf", "--task", "needle", "--data-path", "x.jsonl", "--out", "OUT"],
    ["run_benchmarks.py", "--tasks", "needle", "--data-path", "x.jsonl"],
    ["run_benchmarks.py", "--tasks", "longchat"],
    ["-m", "kv_extraction_hf", "--task", "jsonl", "--data-path", "x.jsonl", "--out", "OUT"],
])
def test_entry_points_refuse_unused_or_missing_data_flags(argv, tmp_path):
    argv = [a.replace("OUT", str(tmp_path / "o")) for a in argv]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "--data" in proc.stderr
