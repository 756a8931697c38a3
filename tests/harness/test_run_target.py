"""run_benchmarks.py --target (harness.targets): the flag's checks before any work, a target
resolved on a tiny random model to the table's choice (levels replaced, the record), an
unmeetable target as one ``error:`` line and exit 2 from the CLI, and a store entry made at
an operating point that names it in its manifest and decodes in a fresh cache folder.

Run: .venv/bin/python -m pytest tests/harness/test_run_target.py -q
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

import run_benchmarks
from codec import operating_points as op
from harness.config import ConfigError, RunConfig, resolve
from kv_extraction_hf.calibrate import operating_points as fit

SETTINGS = {"windows": 4, "context_tokens": 48, "continuation_tokens": 8, "seed": 0, "skip_tokens": 64}


@pytest.fixture(scope="module")
def tiny():
    from tests.helpers.tiny_llama import tiny_llama_bundle

    return tiny_llama_bundle()


@pytest.fixture
def small_fit(monkeypatch, tmp_path):
    """Fits of this test: tiny windows, a fresh cache folder."""
    monkeypatch.setattr(fit, "TARGET_FIT_SETTINGS", SETTINGS)
    monkeypatch.setenv("CACHEGEN_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_target_flag_is_checked_before_any_work(capsys):
    assert resolve(None, {"target": "lmcache"}).target == "lmcache"
    with pytest.raises(ConfigError, match="unknown quality target"):
        resolve(None, {"target": "best"})
    with pytest.raises(ConfigError, match="leave out --levels"):
        resolve(None, {"target": "lmcache", "levels": (1,)})
    with pytest.raises(ConfigError, match="leave out --levels"):
        resolve(None, {"target": "kl:0.02", "kvtc_levels": (4,)})
    assert run_benchmarks.main(["--target", "kl:-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: target KL must be a positive") and "\n" not in err


def test_apply_target_sets_each_codec_to_its_operating_point(tiny, small_fit):
    from harness.targets import apply_target, point_summaries

    cfg = RunConfig(modes=("text", "cachegen", "kvtc"), engine="hf", target="kl:0.5")
    new, rec = apply_target(cfg, tiny, {})     # kvtc has no calibration here: cachegen only
    table = op.load_table(rec["table"])        # stored in the fresh cache folder
    want = op.choose_level(table["rows"], "cachegen", op.parse_target("kl:0.5"))["level"]
    assert new.levels == (want,) and new.kvtc_levels == cfg.kvtc_levels and new.target == "kl:0.5"
    (point,) = rec["points"]
    assert point["codec"] == "cachegen" and point["level"] == want and point["table"] == rec["table"]
    assert point_summaries(rec) == {"cachegen": {"target": "kl:0.5", "codec": "cachegen", "level": want,
                                                 "hash": point["hash"], "table": rec["table"]}}
    no_cachegen = RunConfig(modes=("text", "raw"), engine="hf")
    assert apply_target(no_cachegen, tiny, {}) == (no_cachegen, None)     # nothing to resolve


def test_without_a_target_the_default_level_is_the_lmcache_point(tiny, small_fit, monkeypatch):
    """level=None: cachegen's lmcache point is resolved and recorded; the levels run as configured."""
    from harness import targets

    cfg = RunConfig(modes=("text", "cachegen", "kvtc"), engine="hf")
    new, rec = targets.apply_target(cfg, tiny, {})
    assert new == cfg and rec["role"] == "default" and rec["target"] == "lmcache"
    table = op.load_table(rec["table"])
    want = op.choose_level(table["rows"], "cachegen", op.parse_target("lmcache"))["level"]
    assert [(p["codec"], p["level"]) for p in rec["points"]] == [("cachegen", want)]
    assert {r["codec"] for r in table["rows"]} == {"cachegen", "cachegen-ref"}     # kvtc not fitted
    # a fit that cannot meet the target never stops the run: one logged line, recorded

    def unmet(*a, **k):
        raise op.TargetUnmet("no level of cachegen meets lmcache; closest: cachegen 5")

    import bench.quality.targets as bqt

    monkeypatch.setattr(bqt, "resolve_target", unmet)
    new, rec = targets.apply_target(cfg, tiny, {})
    assert new == cfg and rec["points"] == [] and rec["error"].startswith("no level of cachegen")


def test_unmeetable_target_is_one_line_and_exit_2(tiny, small_fit, monkeypatch, capsys):
    import harness.lifecycle
    import harness.run

    monkeypatch.setattr(harness.run, "load_model", lambda *a, **k: tiny)
    monkeypatch.setattr(harness.run, "cleanup_leftovers", lambda: None)
    monkeypatch.setattr(harness.lifecycle, "install_signal_handlers", lambda: None)
    rc = run_benchmarks.main(["--target", "kl:1e-9", "--modes", "text", "cachegen", "--engine", "hf",
                              "--out", str(small_fit / "r.json")])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert rc == 2 and len(err) == 1
    assert "no level of cachegen meets kl:1e-09" in err[0] and "closest: cachegen" in err[0]
    assert not (small_fit / "r.json").exists()


def test_an_entry_at_an_operating_point_names_it_and_decodes_in_a_fresh_cache(tmp_path, monkeypatch):
    import torch

    import codec
    from harness.contexts import Context, populate_store
    from streaming.store.client import LocalStoreClient
    from tests.helpers.kv import mixed_kv

    k, v = (x[:, :128].to(torch.bfloat16).contiguous() for x in mixed_kv(2, 128, 2, 8, seed=0))
    prompt = SimpleNamespace(context_ids=list(range(130)), input_ids=list(range(140)), task="needle")
    ctx = Context("needle-0", prompt, k, v, 128, dtype_bytes=2 * k.numel() * 2)
    info = SimpleNamespace(model_id="m", weights_hash="w" * 64, tokenizer_hash="", dtype="bfloat16",
                           num_layers=2, num_kv_heads=2, head_dim=8)
    point = {"target": "lmcache", "codec": "cachegen", "level": 3, "hash": "a" * 64, "table": "b" * 64}
    client = LocalStoreClient(tmp_path / "store")
    populate_store(RunConfig(chunk_tokens=128, block_tokens=128), client, info, [ctx],
                   {"cachegen": [3], "raw": [None]}, points={"cachegen": point})
    # a reader whose cache folder never fitted a table: the chunk's own header suffices
    monkeypatch.setenv("CACHEGEN_CACHE", str(tmp_path / "fresh"))
    man = client.get_manifest(ctx.keys["cachegen"])
    assert man.meta["operating_point"] == point and tuple(man.levels) == (3,)
    data = client.get_chunk(ctx.keys["cachegen"], 3, 0, man.gen)
    k2, v2 = codec.decode_kv(data)
    assert k2.shape == k.shape and codec.peek_header(data)["level"] == 3
    assert "operating_point" not in client.get_manifest(ctx.keys["raw"]).meta


def test_a_kvtc_entry_at_an_operating_point_decodes_in_a_fresh_process_and_cache(tmp_path):
    """kvtc: the entry's calibration is fetched from the store by its hash
    (streaming.calibrations.ensure_calibrations) in a process whose cache folder never saw it."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import torch

    from codec import kvtc
    from harness.contexts import Context, populate_store
    from streaming.store.client import LocalStoreClient
    from tests.helpers.kv import mixed_kv

    k, v = mixed_kv(2, 256, 2, 8, seed=0)
    cal = kvtc.fit_calibration(k, v, sink_tokens=0, recent_tokens=0)
    k, v = (x[:, :128].to(torch.bfloat16).contiguous() for x in (k, v))
    prompt = SimpleNamespace(context_ids=list(range(130)), input_ids=list(range(140)), task="needle")
    ctx = Context("needle-0", prompt, k, v, 128, dtype_bytes=2 * k.numel() * 2)
    info = SimpleNamespace(model_id="m", weights_hash="w" * 64, tokenizer_hash="", dtype="bfloat16",
                           num_layers=2, num_kv_heads=2, head_dim=8)
    point = {"target": "kl:0.05", "codec": "kvtc", "level": 3, "hash": "a" * 64, "table": "b" * 64}
    populate_store(RunConfig(chunk_tokens=128, block_tokens=128), LocalStoreClient(tmp_path / "store"), info,
                   [ctx], {"kvtc": [3]}, configs={"kvtc": kvtc.KvtcConfig(calibration=cal)},
                   points={"kvtc": point})
    script = (
        "import json, sys, codec\n"
        "from codec import artifacts\n"
        "from streaming.calibrations import ensure_calibrations\n"
        "from streaming.store.client import LocalStoreClient\n"
        "cl = LocalStoreClient(sys.argv[1]); man = cl.get_manifest(sys.argv[2])\n"
        "before = [artifacts.has_artifact(h) for h in man.calibrations]\n"
        "miss = ensure_calibrations(cl, man.calibrations)\n"
        "k, v = codec.decode_kv(cl.get_chunk(sys.argv[2], 3, 0, man.gen))\n"
        "print(json.dumps({'before': before, 'miss': miss, 'shape': list(k.shape), 'point': man.meta['operating_point']}))\n")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, CACHEGEN_CACHE=str(tmp_path / "fresh"), PYTHONPATH=str(root))
    cp = subprocess.run([sys.executable, "-c", script, str(tmp_path / "store"), ctx.keys["kvtc"]], cwd=root,
                        env=env, capture_output=True, text=True, timeout=300)
    assert cp.returncode == 0, cp.stderr[-2000:]
    got = json.loads(cp.stdout.strip().splitlines()[-1])
    assert got == {"before": [False], "miss": None, "shape": [2, 128, 2, 8], "point": point}
