"""The answer suite: RULER-kind contexts (kv_extraction_hf.prompts.ruler), the scorer and
rows on known answers (bench.answer_suite.suite_rows: accuracy, agreement, Wilson CIs,
McNemar), the runner on a tiny random Qwen2 (lossless raw agrees token for token), and the
CLI's one-line errors.

Run: .venv/bin/python -m pytest tests/bench/test_answer_suite.py -q
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.answer_suite import run_suite, suite_cells, suite_rows
from evaluation.stats import mcnemar_exact, wilson_ci
from kv_extraction_hf.errors import ExtractionError
from kv_extraction_hf.prompts.ruler import DEPTHS, KINDS, haystack_sentences, suite_context, suite_contexts

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from kv_extraction_hf.model import default_model_dir

    try:
        return AutoTokenizer.from_pretrained(default_model_dir(log=lambda m: None))
    except ExtractionError as exc:
        pytest.skip(f"default model (its tokenizer) unavailable: {exc}")


# ----------------------------------------------------------------------------- contexts
@pytest.mark.parametrize("kind,n_questions", [("single", 1), ("multikey", 4), ("multivalue", 2)])
@pytest.mark.parametrize("length", [700, 1500])
def test_context_holds_each_needle_once_at_its_depth(tokenizer, kind, n_questions, length):
    for index in range(3):
        c = suite_context(tokenizer, kind, length, seed=0, index=index)
        assert len(c.context_ids) <= length and len(c.context_ids) > 0.9 * length
        assert len(c.questions) == n_questions and c.kind == kind
        text = tokenizer.decode(c.context_ids)
        body = text[text.index("afterwards.\n") + len("afterwards.\n"):]
        sentences = {f"One of the special magic numbers for {nd['key']} is: {nd['value']}." for nd in c.meta["needles"]}
        for nd in c.meta["needles"]:
            sentence = f"One of the special magic numbers for {nd['key']} is: {nd['value']}."
            assert text.count(sentence) == 1 and text.count(nd["value"]) == 1
            # its position in the haystack without the other needles: within 10 points of its depth
            # (the haystack is placed by whole sentences)
            hay = body
            for other in sentences - {sentence}:
                hay = hay.replace(other, "")
            assert abs(hay.index(sentence) / len(hay) - nd["depth"]) < 0.1, (nd, hay.index(sentence) / len(hay))
        for q in c.questions:
            assert sorted(q.answers) == sorted(nd["value"] for nd in c.meta["needles"] if nd["key"] == q.key)
            qtext = tokenizer.decode(q.question_ids)
            assert q.key in qtext and "mentioned in the provided text" in qtext
        assert c.questions[0].depth == DEPTHS[index % 5]
        if kind == "multikey":
            assert len({q.key for q in c.questions}) == 4 and {q.depth for q in c.questions} < set(DEPTHS)


def test_every_cell_has_its_own_haystack_and_needles(tokenizer):
    """No two contexts of a run share their first haystack tokens (no prefix cache can serve
    one from another; a colliding draw is redrawn), nor a needle value."""
    cells = suite_cells(KINDS, [800, 1200], 5)
    assert len(cells) == 30 and len(set(cells)) == 30
    seen, values = set(), []
    head = None
    ctxs = list(suite_contexts(tokenizer, cells, 0))
    assert [(c.kind, c.meta["redraw"] >= 0) for c in ctxs] == [(k, True) for k, _, _ in cells]
    assert any(c.meta["redraw"] > 0 for c in ctxs)       # 30 draws from ~1500 sentences do collide
    for c in ctxs:
        text = tokenizer.decode(c.context_ids)
        body = text[text.index("afterwards.") + len("afterwards."):][:200]
        assert body not in seen
        seen.add(body)
        values += [nd["value"] for nd in c.meta["needles"]]
        prefix = text[:text.index("afterwards.")]
        assert head in (None, prefix)
        head = prefix
    assert len(values) == len(set(values))
    # deterministic: the same cell gives the same ids
    assert suite_context(tokenizer, "multikey", 600, 0, 2).context_ids == \
        suite_context(tokenizer, "multikey", 600, 0, 2).context_ids
    assert suite_context(tokenizer, "multikey", 600, 1, 2).context_ids != \
        suite_context(tokenizer, "multikey", 600, 0, 2).context_ids


def test_wikitext_haystack_and_bad_inputs(tokenizer):
    # WikiText-2's raw layout (" = Heading = " lines, blank lines, " @-@ " joins); the real test
    # split is read from the data flag, the repository's fixture has too few sentences
    paras = [" ".join(f"Sentence {i + j} of the synthetic well @-@ known article names item {7 * (i + j)}."
                      for j in range(5)) for i in range(0, 300, 5)]
    text = "\n".join(f" = Section {i} = \n\n {p} \n" for i, p in enumerate(paras))
    sents = haystack_sentences(text)
    assert len(sents) == 300 and not any(s.startswith("=") or "@-@" in s for s in sents)
    assert sents[3] == "Sentence 3 of the synthetic well-known article names item 21."
    c = suite_context(tokenizer, "single", 800, 0, 0, sents, "wikitext")
    body = tokenizer.decode(c.context_ids)
    assert c.meta["haystack"] == "wikitext" and body.count("of the synthetic well-known article") >= 20
    with pytest.raises(ExtractionError, match="unknown answer-suite kind"):
        suite_context(tokenizer, "multiquery", 800)
    with pytest.raises(ExtractionError, match="too small|fewer than 5"):
        suite_context(tokenizer, "multivalue", 150)
    with pytest.raises(ExtractionError, match="sentences"):
        haystack_sentences("= Title =\n\nOne short line.\n")


# ----------------------------------------------------------------------------- rows on known answers
def _rec(kind, length, lossless_ok, codec_ok, agrees=None, token=None):
    agrees = (codec_ok == lossless_ok) if agrees is None else agrees
    return {"kind": kind, "length": length, "index": 0, "context_tokens": length, "prefill_s": 0.1,
            "lossless": {"correct": lossless_ok},
            "codecs": {"c:1": {"correct": codec_ok, "agrees": agrees,
                               "token_agrees": agrees if token is None else token}}}


def test_suite_rows_known_counts():
    # 20 questions: lossless right on 18; the codec loses 5 of those and gains 1 -> b=5, c=1
    recs = ([_rec("single", 1024, True, True)] * 13 + [_rec("multikey", 2048, True, False)] * 5
            + [_rec("multikey", 2048, False, True)] + [_rec("multivalue", 1024, False, False, agrees=True)])
    rows = {(r["group"], r["codec"]): r for r in suite_rows(recs, ["c:1"])}
    ll, c = rows[("all", "lossless")], rows[("all", "c:1")]
    assert ll["n"] == 20 and ll["accuracy"] == 18 / 20 and ll["accuracy_ci"] == list(wilson_ci(18, 20))
    assert c["n"] == 20 and c["accuracy"] == 14 / 20 and c["accuracy_ci"] == list(wilson_ci(14, 20))
    assert c["agreement"] == 14 / 20 and c["agreement_ci"] == list(wilson_ci(14, 20))
    assert c["mcnemar"] == {"b": 5, "c": 1, "p": mcnemar_exact(5, 1)}
    assert c["mcnemar"]["p"] == pytest.approx(2 * 7 / 64)
    mk = rows[("kind=multikey", "c:1")]
    assert mk["n"] == 6 and mk["mcnemar"]["b"] == 5 and mk["mcnemar"]["c"] == 1 and mk["accuracy"] == 1 / 6
    assert rows[("length=1024", "lossless")]["n"] == 14 and rows[("length=2048", "c:1")]["n"] == 6
    assert rows[("kind=single", "c:1")]["mcnemar"] == {"b": 0, "c": 0, "p": 1.0}
    assert set(g for g, _ in rows) == {"all", "kind=single", "kind=multikey", "kind=multivalue",
                                       "length=1024", "length=2048"}


# ----------------------------------------------------------------------------- runner on a tiny Qwen2
@pytest.fixture(scope="module")
def tiny_qwen2_dir(tmp_path_factory, tokenizer):
    """A tiny random Qwen2 (2 KV heads, rope 1e6) saved as an HF folder."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=49152, hidden_size=512, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      rope_theta=1e6, tie_word_embeddings=False, initializer_range=0.2)
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("suite") / "tiny-qwen2"
    Qwen2ForCausalLM(cfg).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def tiny_qwen2(tiny_qwen2_dir):
    from kv_extraction_hf import model as model_mod

    return model_mod.load_model(str(tiny_qwen2_dir), log=lambda m: None)


def test_run_suite_lossless_raw_agrees_token_for_token(tiny_qwen2):
    recs = run_suite(tiny_qwen2, [("raw", None), ("kivi2", None)], suite_cells(KINDS, [400], 1), log=lambda m: None)
    assert len(recs) == 1 + 4 + 2 and {r["kind"] for r in recs} == set(KINDS)
    for r in recs:
        raw = r["codecs"]["raw"]
        assert raw["token_agrees"] and raw["agrees"] and raw["ids"] == r["lossless"]["ids"]
        assert raw["correct"] == r["lossless"]["correct"] and r["context_tokens"] <= 400
        assert set(r["codecs"]) == {"raw", "kivi2"}
    rows = {(x["group"], x["codec"]): x for x in suite_rows(recs, ["raw", "kivi2"])}
    assert rows[("all", "raw")]["agreement"] == 1.0 and rows[("all", "raw")]["mcnemar"]["p"] == 1.0
    # a random model's greedy answers on 2-bit KV: some differ from lossless (the check can fail)
    assert rows[("all", "kivi2")]["token_agreement"] < 1.0


def test_run_suite_reuses_saved_contexts(tiny_qwen2):
    from bench.answer_suite import context_hash

    cells = suite_cells(["single", "multivalue"], [400], 1)
    saved, calls = {}, []

    def keep(h, recs):
        calls.append(h)
        saved[h] = recs
    whole = run_suite(tiny_qwen2, [("kivi2", None)], cells, log=lambda m: None, on_context=keep)
    assert len(calls) == 2 and sum(len(v) for v in saved.values()) == len(whole) == 1 + 2
    hashes = [context_hash(c) for c in suite_contexts(tiny_qwen2.tokenizer, cells)]
    assert calls == hashes and len(set(hashes)) == 2
    # one context saved: only the other is measured again, and the records are the same
    logs, again = [], []
    part = {hashes[0]: saved[hashes[0]]}
    got = run_suite(tiny_qwen2, [("kivi2", None)], cells, log=logs.append, done=part,
                    on_context=lambda h, r: again.append(h))
    assert again == [hashes[1]] and sum("from the saved state" in m for m in logs) == 1
    def answers(recs):                                   # all but the measured prefill seconds
        return [{k: v for k, v in r.items() if k != "prefill_s"} for r in recs]
    assert answers(got) == answers(whole) and got[0] is part[hashes[0]][0]
    # a saved context of another cell list is not reused for a context it does not match
    other = run_suite(tiny_qwen2, [("kivi2", None)], suite_cells(["multikey"], [400], 1), log=lambda m: None,
                      done=saved, on_context=lambda h, r: again.append(h))
    assert len(again) == 2 and again[1] not in hashes and {r["kind"] for r in other} == {"multikey"}


def test_cli_state_of_other_settings_is_one_line(tmp_path):
    from bench.quality.checkpoint import save_doc

    out = tmp_path / "suite.json"
    save_doc(tmp_path / "suite.json.partial", "not-this-run", {"contexts": {}})
    proc = subprocess.run([sys.executable, "-m", "bench.answer_suite", "--quick", "--lossless-only",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert "other settings" in lines[-1] and "--no-resume" in lines[-1] and "Traceback" not in proc.stderr
    assert not out.exists()


# ----------------------------------------------------------------------------- CLI
@pytest.mark.parametrize("args,match", [
    (["--kinds", "bogus"], "--kinds from single, multikey, multivalue"),
    (["--lengths", "1k"], "--lengths must be comma-separated integers"),
    (["--contexts", "0"], "--contexts >= 1"),
    (["--codecs", "nosuch:1"], "--codecs"),
])
def test_cli_bad_input_is_one_line_exit_2(args, match):
    proc = subprocess.run([sys.executable, "-m", "bench.answer_suite", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and match in lines[0] and "Traceback" not in proc.stderr


def test_context_hash_names_the_generation_budget(tokenizer):
    """A saved answer made under another generation budget is not reused: the budget is part of
    the context's identity, beside the token ids."""
    import dataclasses

    from bench.answer_suite import context_hash

    ctx = suite_context(tokenizer, "multivalue", 400, seed=0, index=0)
    shorter = dataclasses.replace(ctx, questions=[dataclasses.replace(q, max_new_tokens=q.max_new_tokens - 1)
                                                  for q in ctx.questions])
    assert context_hash(ctx) == context_hash(suite_context(tokenizer, "multivalue", 400, seed=0, index=0))
    assert context_hash(shorter) != context_hash(ctx)


@pytest.mark.parametrize("kind", KINDS)
def test_budget_holds_a_listed_answer_in_a_digit_split_tokenizer(kind):
    """Each kind's budget holds what a model that splits digits into single tokens (Qwen2,
    Gemma) states: a list of both keys' values in the multi-value kind (6 values, each 7 digits
    plus a list marker and a separator, with an opening line), one value otherwise."""
    from kv_extraction_hf.prompts.ruler import MAX_NEW_TOKENS

    values = 6 if kind == "multivalue" else 1
    opening, per_value = 3, 7 + 3            # ":\n\n"; 7 digits, "1. " / ", ", newline
    assert MAX_NEW_TOKENS[kind] >= opening + values * per_value + 1   # + the stop


def test_report_partial_writes_the_saved_contexts_and_keeps_the_state(tiny_qwen2_dir, tmp_path, monkeypatch, capsys):
    """A run stopped after its contexts were saved: --report-partial writes --out from the saved
    contexts only (marked partial, n = the questions measured), measures nothing and keeps the
    state; without --out, or without saved contexts of these settings, one line and exit 2."""
    import json

    import bench.answer_suite as AS

    out = tmp_path / "suite.json"
    base = ["--model", str(tiny_qwen2_dir), "--lengths", "400", "--contexts", "1", "--codecs", "kivi2",
            "--answer-dtype", "model", "--out", str(out)]

    def stop(*a, **k):
        raise RuntimeError("stopped after the contexts were saved")
    monkeypatch.setattr(AS, "print_rows", stop)
    with pytest.raises(RuntimeError):
        AS.main(base + ["--kinds", "single"])
    monkeypatch.undo()
    state = out.with_name(out.name + ".partial")
    assert state.exists() and not out.exists()

    def no_measuring(*a, **k):
        raise AssertionError("--report-partial measured a context")
    monkeypatch.setattr("kv_extraction_hf.extract.prefill_kv", no_measuring)
    assert AS.main(base + ["--kinds", "single,multikey", "--report-partial"]) == 0
    doc = json.loads(out.read_text())
    assert doc["partial"]["contexts_measured"] == 1 and doc["partial"]["contexts"] == 2
    assert state.exists() and len(doc["records"]) == 1 and {r["kind"] for r in doc["records"]} == {"single"}
    rows = {(r["group"], r["codec"]): r for r in doc["rows"]}
    assert rows[("all", "lossless")]["n"] == 1 and rows[("all", "kivi2")]["n"] == 1
    capsys.readouterr()
    assert AS.main(base[:-2] + ["--report-partial"]) == 2
    assert AS.main(base[:-1] + [str(tmp_path / "other.json"), "--report-partial"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "give --out" in err[0] and "no saved contexts" in err[-1] and "Traceback" not in "\n".join(err)


# ----------------------------------------------------------------------------- LongChat rows
_TOPICS = (["Kyoto temples", "jazz history", "tidal energy"], ["sourdough baking", "chess openings"])


def _longchat_file(tmp_path, words: int = 60) -> Path:
    """A LongChat-format file (the artifact's fields): two rows whose conversations name
    their topics in order, then LongEval's question."""
    import json

    rows = []
    for i, topics in enumerate(_TOPICS):
        talk = " ".join(f"USER: I would like to discuss the topic of {t}. ASSISTANT: Sure, " + "more " * words
                        for t in topics)
        rows.append({"test_id": f"t{i}", "label": topics,
                     "prompt": f"A chat between a user and an assistant. {talk} Now the record ends. "
                               "What is the first topic we discussed? Only give me the topic name."})
    path = tmp_path / "longchat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_stated_topics_names_the_labels_an_answer_states():
    from evaluation.metrics import stated_topics

    labels = _TOPICS[0]
    assert stated_topics("The first topic was Kyoto Temples.", labels) == ("kyoto temples",)
    assert stated_topics("kyoto temples, then the Jazz history", labels) == ("jazz history", "kyoto temples")
    assert stated_topics("cats", labels) == () and stated_topics("", labels) == ()
    with pytest.raises(ValueError):
        stated_topics(None, labels)


def test_longchat_rows_are_asked_after_the_cells(tiny_qwen2, tmp_path):
    from bench.answer_suite import longchat_contexts

    path = _longchat_file(tmp_path)
    ctxs = longchat_contexts(tiny_qwen2.tokenizer, str(path))
    assert [c.kind for c in ctxs] == ["longchat", "longchat"] and [c.meta["row_id"] for c in ctxs] == ["t0", "t1"]
    assert all(len(c.questions) == 1 and c.questions[0].answers == list(t) and c.questions[0].max_new_tokens == 32
               for c, t in zip(ctxs, _TOPICS))
    assert all(c.meta["truncated_from_tokens"] is None for c in ctxs)
    assert len(longchat_contexts(tiny_qwen2.tokenizer, str(path), rows=1)) == 1
    recs = run_suite(tiny_qwen2, [("raw", None), ("kivi2", None)], suite_cells(["single"], [400], 1),
                     log=lambda m: None, extra_contexts=ctxs)
    assert [r["kind"] for r in recs] == ["single", "longchat", "longchat"]
    lc = [r for r in recs if r["kind"] == "longchat"]
    assert [r["length"] for r in lc] == [None, None] and [r["index"] for r in lc] == [0, 1]
    for r in lc:   # lossless raw gives the lossless answer, which agrees with itself
        raw = r["codecs"]["raw"]
        assert raw["token_agrees"] and raw["agrees"] is True and raw["correct"] == r["lossless"]["correct"]
        assert isinstance(r["lossless"]["correct"], bool)
    rows = {(x["group"], x["codec"]): x for x in suite_rows(recs, ["raw", "kivi2"])}
    assert rows[("kind=longchat", "raw")]["n"] == 2 and rows[("all", "raw")]["n"] == 3
    assert rows[("length=400", "raw")]["n"] == 1 and not any(g.startswith("length=None") for g, _ in rows)


def test_longchat_row_longer_than_the_model_is_cut_in_the_middle(tiny_qwen2, tmp_path):
    from bench.answer_suite import longchat_contexts

    path = _longchat_file(tmp_path, words=400)
    whole = longchat_contexts(tiny_qwen2.tokenizer, str(path))
    cut = longchat_contexts(tiny_qwen2.tokenizer, str(path), max_prompt_tokens=400)
    for w, c in zip(whole, cut):
        assert c.meta["truncated_from_tokens"] == len(w.context_ids) > len(c.context_ids)
        assert len(c.context_ids) + len(c.questions[0].question_ids) + 32 <= 400


@pytest.mark.parametrize("args,match", [
    (["--longchat-rows", "2"], "--longchat-rows needs --longchat"),
    (["--longchat", "/nonexistent/longchat.jsonl"], "longchat"),
])
def test_cli_longchat_bad_input_is_one_line_exit_2(args, match):
    proc = subprocess.run([sys.executable, "-m", "bench.answer_suite", "--quick", "--lossless-only", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert match in lines[-1] and "Traceback" not in proc.stderr


def _suite_doc():
    """An answer-suite file whose stored verdicts came from an older scorer: the codec's
    list numbering ("1. ") was counted as stated values."""
    ref = ":\n\n- 9868160\n- 6971908"
    rec = {"kind": "multivalue", "length": 1024, "answers": ["6971908", "9868160"], "lossless":
           {"text": ref, "ids": [1], "correct": True},
           "codecs": {"quant8": {"text": ":\n\n1. 9868160\n2. 6971908", "ids": [2], "correct": True,
                                 "agrees": False, "token_agrees": False},
                      "cachegen 1": {"text": ": 9868160 only", "ids": [3], "correct": False,
                                     "agrees": False, "token_agrees": False}}}
    lc = {"kind": "longchat", "length": None, "answers": ["Kyoto temples", "jazz"], "lossless":
          {"text": "Kyoto Temples", "ids": [1], "correct": True},
          "codecs": {"quant8": {"text": "the kyoto temples.", "ids": [4], "correct": True, "agrees": True,
                                "token_agrees": False},
                     "cachegen 1": {"text": "jazz", "ids": [5], "correct": False, "agrees": False,
                                    "token_agrees": False}}}
    recs = [rec, lc]
    return {"kind": "answer_suite", "records": recs, "rows": suite_rows(recs, ["quant8", "cachegen 1"])}


def test_rescore_scores_the_stored_answers_again():
    from bench.answer_suite import rescore

    doc = _suite_doc()
    new = rescore(doc)
    assert new["rescored"]["changed"] == 1 and doc["records"][0]["codecs"]["quant8"]["agrees"] is False
    q = new["records"][0]["codecs"]["quant8"]
    assert q["agrees"] is True and q["correct"] is True and q["text"] == doc["records"][0]["codecs"]["quant8"]["text"]
    assert new["records"][0]["codecs"]["cachegen 1"]["agrees"] is False
    rows = {(r["group"], r["codec"]): r for r in new["rows"]}
    assert rows[("all", "quant8")]["agreement"] == 1.0 and rows[("all", "cachegen 1")]["agreement"] == 0.0
    assert [r["codec"] for r in new["rows"] if r["group"] == "all"] == ["lossless", "quant8", "cachegen 1"]
    assert rescore(new)["rescored"]["changed"] == 0          # scoring again changes nothing
    with pytest.raises(ValueError, match="no records"):
        rescore({"kind": "answer_suite", "records": []})


def test_cli_rescore_rewrites_the_file(tmp_path):
    import json

    path = tmp_path / "suite.json"
    path.write_text(json.dumps(_suite_doc()))
    proc = subprocess.run([sys.executable, "-m", "bench.answer_suite", "--rescore", "--out", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "1 verdicts changed" in proc.stdout and json.loads(path.read_text())["rescored"]["changed"] == 1
    for args, match in ((["--rescore"], "give --out"), (["--rescore", "--out", str(tmp_path / "no.json")], "cannot read")):
        bad = subprocess.run([sys.executable, "-m", "bench.answer_suite", *args], cwd=ROOT, capture_output=True,
                             text=True, timeout=300)
        assert bad.returncode == 2 and match in bad.stderr.strip().splitlines()[-1] and "Traceback" not in bad.stderr
    (tmp_path / "other.json").write_text(json.dumps({"kind": "quality"}))
    bad = subprocess.run([sys.executable, "-m", "bench.answer_suite", "--rescore", "--out", str(tmp_path / "other.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "not an answer-suite file" in bad.stderr
