"""Unit tests of bench.vllm_kv_memory's parts that need no engine: reading vLLM's KV capacity
lines from an engine log, and the one-line refusals of bad flags (exit 2).

Run: .venv/bin/python -m pytest tests/bench/test_vllm_kv_memory.py -q
"""

from __future__ import annotations

import pytest

from bench.vllm_kv_memory import main, parse_engine_log

LOG = """INFO 2026-12-02 07:14:58,348 7141 vllm.v1.worker.cpu_worker: Explicitly set (1.0/13.71) GiB for KV cache on node 0.
INFO 2026-12-02 07:14:58,351 7019 vllm.v1.core.kv_cache_utils: CPU KV cache size: 57,491 tokens, Maximum concurrency for 8,192 tokens per request: 7.02x
"""


def test_parse_engine_log_reads_vllms_capacity_line():
    assert parse_engine_log(LOG) == {"kv_cache_tokens": 57491, "max_model_len": 8192,
                                     "max_concurrency": 7.02, "kv_cache_space_gib": 1.0}
    assert parse_engine_log("nothing here") == {}
    later = LOG + LOG.splitlines()[1].replace("57,491", "1,000") + "\n"
    assert parse_engine_log(later)["kv_cache_tokens"] == 1000      # the last line wins


@pytest.mark.parametrize("argv,msg", [
    (["--context-tokens", "100"], "--context-tokens must be >= 130"),
    (["--context-tokens", "8192"], "within --max-model-len"),
    (["--repeats", "0"], "--repeats and --max-tokens must be >= 1"),
    (["--max-num-batched-tokens", "64"], "--max-num-batched-tokens must be >= 128"),
])
def test_bad_flags_exit_2_with_one_line(argv, msg, capsys):
    with pytest.raises(SystemExit) as ei:
        main(argv)
    assert ei.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert msg in err
