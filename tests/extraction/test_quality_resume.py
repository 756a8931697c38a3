"""A stopped text-fidelity run resumes at its next window (``bench.quality.checkpoint``):
the rows of a run stopped after a window and resumed equal those of one uninterrupted run;
a state of other settings is refused, never mixed in; a damaged state is a one-line error.

Run: .venv/bin/python -m pytest tests/extraction/test_quality_resume.py -q
"""
import json

import pytest
import torch

from bench.quality import run_text_quality
from bench.quality.checkpoint import CheckpointMismatch, load_state, partial_path, run_key, save_state

PAIRS = [("cachegen", 1), ("quant8", None), ("raw", None)]


class _Stop(Exception):
    pass


def _ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(100, 20000, (1600,), generator=g).tolist()


def _values(rows):
    return sorted((r["codec"], r["level"], r["per_window"]["kl"], r["per_window"]["top1"], r["ratio_vs_dtype"], r["kl_ci"])
                  for r in rows)


def test_resume_equals_one_run(default_bundle, tmp_path):
    ids, state = _ids(), tmp_path / "q.json.partial"
    whole, _ = run_text_quality(default_bundle, ids, PAIRS, 3, 120, 16, seed=0, log=lambda m: None)

    def stop_after_second(msg):
        if "window 2/3" in msg:
            raise _Stop
    with pytest.raises(_Stop):
        run_text_quality(default_bundle, ids, PAIRS, 3, 120, 16, seed=0, log=stop_after_second,
                         checkpoint=(state, {"run": "a"}, {"cpu": "x"}))
    saved = json.loads(state.read_text())
    assert saved["windows_done"] == 2 and len(saved["ref_ppl"]) == 2
    logs = []
    rows, info = run_text_quality(default_bundle, ids, PAIRS, 3, 120, 16, seed=0, log=logs.append,
                                  checkpoint=(state, {"run": "a"}, {"cpu": "y"}))
    assert any("resuming" in m and "2/3" in m for m in logs)
    assert sum(m.strip().startswith("window ") for m in logs) == 1     # only window 3 ran again
    assert info["resumed_windows"] == 2
    assert [s["from_window"] for s in info["segments"]] == [0, 2]
    assert [s["environment"]["cpu"] for s in info["segments"]] == ["x", "y"]
    assert _values(rows) == _values(whole)
    assert all(r["n_windows"] == 3 for r in rows)


def test_state_of_other_settings_is_refused(default_bundle, tmp_path):
    ids, state = _ids(), tmp_path / "q.json.partial"
    run_text_quality(default_bundle, ids, PAIRS[:1], 1, 120, 16, seed=0, log=lambda m: None,
                     checkpoint=(state, {"run": "a"}, {}))
    assert state.is_file()
    for kw in ({"seed": 1}, {"identity": {"run": "b"}}, {"pairs": PAIRS[1:2]}):
        with pytest.raises(CheckpointMismatch, match="other settings"):
            run_text_quality(default_bundle, ids, kw.get("pairs", PAIRS[:1]), 1, 120, 16,
                             seed=kw.get("seed", 0), log=lambda m: None,
                             checkpoint=(state, kw.get("identity", {"run": "a"}), {}))


def test_state_file_round_trip_and_damage(tmp_path):
    acc = {("cachegen", 1, (0, 0)): {"kl": [0.1], "serde": {"levels": {2: 3}, "objects": 3}},
           ("raw", None, (4, 128)): {"kl": [0.0]}}
    p = tmp_path / "s.partial"
    key = run_key({"a": 1})
    save_state(p, key, 1, acc, {"skipped": {}})
    got = load_state(p, key)
    assert got["acc"] == acc and got["windows_done"] == 1           # int serde level keys kept
    assert load_state(tmp_path / "none.partial", key) is None
    assert [f.name for f in tmp_path.iterdir()] == ["s.partial"]     # no temporary left behind
    with pytest.raises(CheckpointMismatch, match="other settings"):
        load_state(p, run_key({"a": 2}))
    for bad in (b"", b"{not json", b"[]", b'{"format": 1, "key": "k"}', b'{"format": 9, "acc": []}'):
        p.write_bytes(bad)
        with pytest.raises(CheckpointMismatch):
            load_state(p, "k")
    p.write_text(json.dumps({"format": 1, "key": "k", "acc": [[1, 2]]}))
    with pytest.raises(CheckpointMismatch, match="not a run state"):
        load_state(p, "k")


def test_partial_path_beside_out(tmp_path):
    assert partial_path(tmp_path / "quality.json") == tmp_path / "quality.json.partial"


def test_max_new_windows_summarizes_the_saved_windows(default_bundle, tmp_path):
    ids, state = _ids(), tmp_path / "q.json.partial"
    first, info1 = run_text_quality(default_bundle, ids, PAIRS[:1], 3, 120, 16, seed=0, log=lambda m: None,
                                    checkpoint=(state, {"run": "a"}, {}), max_new_windows=1)
    assert info1["windows_measured"] == 1 and all(r["n_windows"] == 1 for r in first)
    logs = []
    again, info2 = run_text_quality(default_bundle, ids, PAIRS[:1], 3, 120, 16, seed=0, log=logs.append,
                                    checkpoint=(state, {"run": "a"}, {}), max_new_windows=0)
    assert not any(m.strip().startswith("window ") for m in logs)     # nothing measured
    assert info2["windows_measured"] == 1 and _values(again) == _values(first)


def test_cli_report_partial_checks_before_the_model(tmp_path, capsys):
    from bench.quality import main

    for extra in (["--no-resume"], [], ["--targets", "lmcache"], None):
        args = ["--report-partial", "--out", str(tmp_path / "q.json")] + (extra or [])
        if extra != []:
            args.append("--no-tasks")                  # None: all fine but no saved windows
        assert main(args) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: --report-partial") and "\n" not in err
