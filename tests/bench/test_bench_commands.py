"""The measurement package `bench/`: every command answers --help, bad usage exits 2, and the
small coder / schedule commands print their figures (values checked, not timings).

Run: .venv/bin/python -m pytest tests/bench/test_bench_commands.py -q
"""
from __future__ import annotations

import importlib

import pytest

COMMANDS = ("codec", "triton", "coder", "schedules", "linkcheck", "streaming", "redis", "redis_cluster", "vllm_demo", "vllm_kv_memory",
            "taskcheck", "lmcache", "store_load", "serve_load", "operating_points")


@pytest.mark.parametrize("name", COMMANDS)
def test_help_exits_0(name, capsys):
    mod = importlib.import_module(f"bench.{name}")
    try:
        rc = mod.main(["--help"])
    except SystemExit as exc:  # argparse
        rc = exc.code
    assert rc == 0
    assert f"bench.{name}" in capsys.readouterr().out


def test_coder_usage_errors(capsys):
    from bench import coder

    assert coder.main([]) == 2
    assert coder.main(["nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(e.startswith("error: usage: python -m bench.coder") for e in err)


def test_coder_rans_small_chunk(capsys):
    from bench import coder

    assert coder.main(["rans", "--layers", "2", "--tokens", "64", "--channels", "16", "--reps", "1",
                       "--no-constriction"]) == 0
    out = capsys.readouterr().out
    assert "chunk: 2 layers x 64 tokens x 16 channels x K/V = 4096 symbols" in out
    assert out.count("Msym/s wall") == 4  # encode + decode, 1 thread and parallel


def test_schedules_prints_every_level(capsys):
    from bench import schedules
    from codec.schedules import HARNESS_LEVELS, LEVELS

    assert schedules.main(["30"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(LEVELS) + len(HARNESS_LEVELS)
    # LMCache's default schedule for 30 layers: keys 32 bins on [0, 10), values on [0, 2)
    assert lines[0].startswith("level=0 variant=reference K=32@0/16@10 V=32@0/16@2")
    assert schedules.main(["0"]) == 2


def test_bench_codec_reads_the_model_fields_of_a_kv_dump(tmp_path):
    """bench.codec --kv DUMP --no-model: the dump's model fields (kv_extraction_hf writes
    them as model_*) name its weights hash, so the kvtc rows find the model's cached
    default calibration without the model."""
    from types import SimpleNamespace

    import torch

    from bench.codec.contexts import load_contexts
    from kv_extraction_hf.dump import save_kv

    k = torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16)
    save_kv(tmp_path / "d.safetensors", k, k.clone(),
            {"model_id": "m", "model_weights_hash": "ab" * 32, "model_dtype": "bfloat16"})
    args = SimpleNamespace(quick=False, kv=[str(tmp_path / "d.safetensors")], no_model=True)
    _, bundle, info = load_contexts(args, log=lambda m: None)
    assert bundle is None and info["weights_hash"] == "ab" * 32 and info["dtype"] == "bfloat16"
