"""kv_extraction_hf without model weights: dumps, prompts, dataset loaders, model-spec errors, CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_extraction_hf import datasets_loaders
from kv_extraction_hf import model as model_mod
from kv_extraction_hf.dump import kv_sha256, load_kv, save_kv, token_ids_sha256
from kv_extraction_hf.errors import ExtractionError
from kv_extraction_hf.prompts import build_prompt, natural_paragraphs
from kv_extraction_hf.prompts.base import SYNTHETIC_TASKS
from tests.helpers.kv import make_kv

ROOT = Path(__file__).resolve().parents[2]


def _bits(t):
    return t.contiguous().view(torch.uint8)


# ---------------------------------------------------------------------------- dumps


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dump_round_trip_is_exact(tmp_path, dtype):
    k, v = make_kv(3, 7, 2, 8, dtype=dtype)
    k[0, 0, 0, :3] = torch.tensor([float("inf"), -0.0, float("nan")]).to(dtype)
    meta = {"model_id": "m", "token_ids": [5, 6, 7, 8, 9, 10, 11], "prompt_name": "p"}
    path = save_kv(tmp_path / "a.safetensors", k, v, meta)
    k2, v2, meta2 = load_kv(path)
    assert k2.dtype == dtype and v2.dtype == dtype and k2.shape == k.shape
    assert torch.equal(_bits(k2), _bits(k)) and torch.equal(_bits(v2), _bits(v))
    assert meta2["model_id"] == "m" and json.loads(meta2["token_ids"]) == [5, 6, 7, 8, 9, 10, 11]
    assert meta2["token_ids_sha256"] == token_ids_sha256([5, 6, 7, 8, 9, 10, 11])
    assert meta2["dtype"] == str(dtype).replace("torch.", "") and meta2["num_tokens"] == "7"
    assert [p.name for p in tmp_path.iterdir()] == ["a.safetensors"]


@settings(max_examples=25, deadline=None)
@given(layers=st.integers(1, 4), tokens=st.integers(0, 9), heads=st.integers(1, 3), dim=st.integers(1, 9),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), seed=st.integers(0, 2**16))
def test_dump_round_trip_any_shape(tmp_path_factory, layers, tokens, heads, dim, dtype, seed):
    k, v = make_kv(layers, tokens, heads, dim, dtype=dtype, seed=seed)
    path = save_kv(tmp_path_factory.mktemp("d") / "x.safetensors", k, v)
    k2, v2, _ = load_kv(path)
    assert torch.equal(_bits(k2), _bits(k)) and torch.equal(_bits(v2), _bits(v))


def test_save_rejects_mismatched_tensors(tmp_path):
    k, v = make_kv(3, 7, 2, 8)
    with pytest.raises(ExtractionError):
        save_kv(tmp_path / "a.safetensors", k, v[:, :3])
    with pytest.raises(ExtractionError):
        save_kv(tmp_path / "a.safetensors", k, v.float())
    with pytest.raises(ExtractionError):
        save_kv(tmp_path / "a.safetensors", k[0], v[0])
    assert list(tmp_path.iterdir()) == []


def test_save_is_atomic_when_writing_fails(tmp_path, monkeypatch):
    import safetensors.torch

    k, v = make_kv(3, 7, 2, 8)
    target = save_kv(tmp_path / "a.safetensors", k, v, {"prompt_name": "old"})

    def broken(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    with pytest.raises(OSError):
        save_kv(target, k * 2, v, {"prompt_name": "new"})
    assert [p.name for p in tmp_path.iterdir()] == ["a.safetensors"]  # no temporary left behind
    assert load_kv(target)[2]["prompt_name"] == "old"  # the old dump is intact


def test_load_missing_dump(tmp_path):
    with pytest.raises(ExtractionError, match="not found"):
        load_kv(tmp_path / "nope.safetensors")


def test_load_corrupt_dumps(tmp_path):
    k, v = make_kv(3, 7, 2, 8)
    good = save_kv(tmp_path / "good.safetensors", k, v, {"token_ids": list(range(7))})
    data = good.read_bytes()
    cases = {
        "truncated": data[: len(data) - 10],
        "garbage": b"\x00\x01not a safetensors file at all",
        "empty": b"",
        "flipped": data[:-1] + bytes([data[-1] ^ 0x40]),  # last byte of v's data
    }
    for name, blob in cases.items():
        p = tmp_path / f"{name}.safetensors"
        p.write_bytes(blob)
        with pytest.raises(ExtractionError, match="corrupt|not a KV dump"):
            load_kv(p)
    # tampered token ids are detected through their recorded hash
    from safetensors.torch import save_file

    _, _, meta = load_kv(good)
    meta["token_ids"] = json.dumps(list(range(1, 8)))
    save_file({"k": k, "v": v}, str(tmp_path / "ids.safetensors"), metadata=meta)
    with pytest.raises(ExtractionError, match="token_ids"):
        load_kv(tmp_path / "ids.safetensors")
    # metadata disagreeing with the tensors
    meta = load_kv(good)[2]
    meta["num_layers"] = "4"
    save_file({"k": k, "v": v}, str(tmp_path / "meta.safetensors"), metadata=meta)
    with pytest.raises(ExtractionError, match="metadata"):
        load_kv(tmp_path / "meta.safetensors")
    # another safetensors file (not ours), and one with the wrong tensor names
    save_file({"weight": k}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ExtractionError, match="expected"):
        load_kv(tmp_path / "other.safetensors")
    save_file({"k": k, "v": v}, str(tmp_path / "foreign.safetensors"), metadata={"format": "x"})
    with pytest.raises(ExtractionError, match="not a KV dump"):
        load_kv(tmp_path / "foreign.safetensors")


def test_kv_sha256_covers_both_tensors():
    k, v = make_kv(3, 7, 2, 8)
    assert kv_sha256(k, v) != kv_sha256(v, k)
    assert kv_sha256(k, v) == kv_sha256(k.clone(), v.clone())


# ---------------------------------------------------------------------------- prompts


def test_natural_text_is_prose():
    paras = natural_paragraphs()
    assert len(paras) > 300
    assert sum(len(p) for p in paras) > 150_000
    assert not any("::=" in p or p.startswith(">>>") for p in paras)


@pytest.mark.parametrize("task", SYNTHETIC_TASKS)
@pytest.mark.parametrize("size", [256, 1024])
def test_generators_are_deterministic_and_sized(default_tokenizer, task, size):
    a = build_prompt(task, default_tokenizer, size, seed=3, index=1)
    b = build_prompt(task, default_tokenizer, size, seed=3, index=1)
    assert a == b
    other = build_prompt(task, default_tokenizer, size, seed=4, index=1)
    assert other.context_ids != a.context_ids
    assert build_prompt(task, default_tokenizer, size, seed=3, index=2).context_ids != a.context_ids
    assert size * 0.85 <= len(a.context_ids) <= size, len(a.context_ids)
    if task == "pydoc_ppl":
        assert len(a.context_ids) == size and len(a.continuation_ids) == 256 and a.question_ids == []
    else:
        assert a.question_ids and a.max_new_tokens == 40 and a.answer
        assert a.answer in a.context_text
        assert a.metric == "retrieval_accuracy"


@pytest.mark.parametrize("task", ["needle", "longchat_lines", "topic_retrieval"])
def test_context_and_question_split_the_chat_prompt(default_tokenizer, task):
    """context_ids + question_ids decode to the chat-templated single user message."""
    p = build_prompt(task, default_tokenizer, 300, seed=0, index=0)
    full = default_tokenizer.apply_chat_template(
        [{"role": "user", "content": p.context_text + p.question_text}], tokenize=False, add_generation_prompt=True)
    assert default_tokenizer.decode(p.context_ids + p.question_ids) == full
    assert default_tokenizer.decode(p.question_ids).endswith("<|im_start|>assistant\n")


def test_needle_depths_and_answers(default_tokenizer):
    depths, codes = set(), set()
    for i in range(5):
        p = build_prompt("needle", default_tokenizer, 512, seed=0, index=i)
        depths.add(p.meta["depth"])
        codes.add(p.answer)
        assert f"The secret passcode is {p.answer}." in p.context_text
    assert len(depths) == 5 and len(codes) == 5


def test_topic_retrieval_answer_is_first_topic(default_tokenizer):
    p = build_prompt("topic_retrieval", default_tokenizer, 1024, seed=0, index=0)
    assert p.meta["num_topics"] >= 3
    first = p.context_text.index("USER:")
    assert p.context_text[first:].startswith(f"USER: I would like to discuss the topic of {p.answer}.")


def test_unknown_task_and_bad_sizes(default_tokenizer):
    with pytest.raises(ExtractionError, match="unknown task"):
        build_prompt("squad", default_tokenizer, 512)
    with pytest.raises(ExtractionError, match="positive"):
        build_prompt("needle", default_tokenizer, 0)
    with pytest.raises(ExtractionError, match="too small"):
        build_prompt("needle", default_tokenizer, 20)


# ---------------------------------------------------------------------------- dataset loaders


def test_longbench_loader_parses_fixtures(fixtures_dir):
    rows = datasets_loaders.load_longbench("triviaqa", str(fixtures_dir / "longbench" / "triviaqa.jsonl"))
    assert len(rows) == 3 and rows[0]["answers"] == ["Thames", "River Thames"]
    assert set(datasets_loaders.LONGBENCH_FIELDS) <= set(rows[0])
    rows = datasets_loaders.load_longbench("narrativeqa", str(fixtures_dir / "longbench"))  # a folder
    assert len(rows) == 2 and rows[1]["input"] == "What did Tomas name his new boat?"


@pytest.mark.parametrize("task", ["triviaqa", "narrativeqa"])
def test_longbench_prompts(default_tokenizer, fixtures_dir, task):
    path = str(fixtures_dir / "longbench")
    a = build_prompt(task, default_tokenizer, 1024, seed=0, index=0, data_path=path)
    assert a == build_prompt(task, default_tokenizer, 1024, seed=0, index=0, data_path=path)
    assert a.metric == "qa_f1" and a.answers and a.answer == a.answers[0]
    assert a.max_new_tokens == {"triviaqa": 32, "narrativeqa": 128}[task]
    rows = datasets_loaders.load_longbench(task, path)
    row = next(r for r in rows if r["_id"] == a.meta["row_id"])
    assert row["context"] in a.context_text and row["input"] in a.question_text
    # a budget smaller than the story truncates it in the middle (LongBench's rule)
    if task == "narrativeqa":
        small = build_prompt(task, default_tokenizer, 200, seed=0, index=0, data_path=path)
        assert len(small.context_ids) <= 200 and small.meta["truncated"]
        assert small.context_text.count("Mara kept the lighthouse") == 1


@pytest.mark.parametrize("name", ["test-00000-of-00001.parquet", "wiki.test.raw"])
def test_wikitext_loader_parses_fixtures(default_tokenizer, fixtures_dir, name):
    path = str(fixtures_dir / "wikitext2" / name)
    text = datasets_loaders.load_wikitext2(path)
    assert text.startswith(" = Harbor Bridge of Eastwick = ") and "= = History = =" in text
    p = build_prompt("wikitext2", default_tokenizer, 128, seed=1, index=0, data_path=path)
    assert len(p.context_ids) == 128 and len(p.continuation_ids) == 256 and p.metric == "perplexity"
    with pytest.raises(ExtractionError, match="fewer than"):
        build_prompt("wikitext2", default_tokenizer, 4096, data_path=path)


def test_loader_errors(tmp_path, fixtures_dir, monkeypatch):
    with pytest.raises(ExtractionError, match="unknown LongBench dataset"):
        datasets_loaders.load_longbench("hotpotqa", str(fixtures_dir / "longbench"))
    with pytest.raises(ExtractionError, match="not found"):
        datasets_loaders.load_longbench("triviaqa", str(tmp_path / "missing.jsonl"))
    with pytest.raises(ExtractionError, match="not found"):
        datasets_loaders.load_wikitext2(str(tmp_path / "missing.parquet"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "text": "t"}) + "\n")
    with pytest.raises(ExtractionError, match="lacks LongBench field"):
        datasets_loaders.load_longbench("triviaqa", str(bad))
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(ExtractionError, match="could not read"):
        datasets_loaders.load_wikitext2(str(broken))
    # no local file and no hub: one clear line, no retries
    monkeypatch.setattr(model_mod, "hub_reachable", lambda timeout=3.0: False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    with pytest.raises(ExtractionError, match="hub is unreachable"):
        datasets_loaders.load_longbench.__wrapped__("triviaqa", None)
    with pytest.raises(ExtractionError, match="hub is unreachable"):
        datasets_loaders.load_wikitext2.__wrapped__(None)


# ---------------------------------------------------------------------------- model specs


def test_model_spec_errors(tmp_path, monkeypatch):
    with pytest.raises(ExtractionError, match="GGUF file not found"):
        model_mod.resolve_model(str(tmp_path / "missing.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExtractionError, match="no config.json"):
        model_mod.resolve_model(str(tmp_path / "empty"))
    (tmp_path / "file.bin").write_bytes(b"x")
    with pytest.raises(ExtractionError, match="neither"):
        model_mod.resolve_model(str(tmp_path / "file.bin"))
    with pytest.raises(ExtractionError, match="unknown model"):
        model_mod.resolve_model("not a model!")
    monkeypatch.setattr(model_mod, "hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(ExtractionError, match="not found locally and the hub is unreachable"):
        model_mod.resolve_model("no-such-org/no-such-model-xyz")
    bad_gguf = tmp_path / "bad.gguf"
    bad_gguf.write_bytes(b"GGUF but not really")
    monkeypatch.setenv("CACHEGEN_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ExtractionError, match="could not load GGUF"):
        model_mod.resolve_model(str(bad_gguf))
    assert not list((tmp_path / "cache" / "models").glob("*"))  # no half-converted folder


def test_hub_reachable_honours_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert model_mod.hub_reachable() is False


def test_default_model_is_a_plain_hf_folder():
    folder = model_mod.default_model_dir(log=lambda m: None)
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["num_hidden_layers"] == 30 and config["num_key_value_heads"] == 3
    assert config["dtype"] == "bfloat16"
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    h = model_mod.weights_hash(folder)
    assert len(h) == 64 and h == model_mod.weights_hash(folder)


def test_gguf_spec_resolves_to_the_converted_default():
    gguf = model_mod.cache_dir() / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    model_mod.default_model_dir(log=lambda m: None)
    model_id, folder = model_mod.resolve_model(str(gguf))
    assert model_id == model_mod.DEFAULT_MODEL_ID and folder == model_mod.default_model_dir()


# ---------------------------------------------------------------------------- CLI (no model load)


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "kv_extraction_hf", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


def test_cli_help():
    proc = _cli("--help")
    assert proc.returncode == 0
    for flag in ("--model", "--task", "--context-tokens", "--num-contexts", "--seed", "--out", "--generate"):
        assert flag in proc.stdout


def test_cli_error_exit_code_in_a_process(tmp_path):
    proc = _cli("--task", "nope", "--out", str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: unknown task 'nope' (available: needle, longchat_lines, "
                                                "topic_retrieval, pydoc_ppl, triviaqa, narrativeqa, wikitext2, longchat, "
                                                "longbench, jsonl)"]


def test_cli_errors_are_one_line(tmp_path, capsys):
    from kv_extraction_hf.__main__ import main

    (tmp_path / "corrupt.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    for args, pattern in [
        (("--task", "nope", "--out", str(tmp_path)), "unknown task 'nope'"),
        (("--task", "needle"), "--out DIR is required"),
        (("--generate", str(tmp_path / "missing.safetensors")), "KV dump not found"),
        (("--generate", str(tmp_path / "corrupt.safetensors")), "corrupt KV dump"),
        (("--model", str(tmp_path / "missing.gguf"), "--out", str(tmp_path)), "GGUF file not found"),
        (("--model", "not a model!", "--out", str(tmp_path)), "unknown model"),
        (("--task", "triviaqa", "--data-path", str(tmp_path / "no.jsonl"), "--out", str(tmp_path)), "not found"),
    ]:
        assert main(list(args)) == 2
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and pattern in lines[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corrupt.safetensors"]  # nothing written
