"""bench.quality and kv_extraction_hf.wikitext: scores on hand-made logits, the WikiText-2
loader on tiny corpora made here, the default-level rule, and a 2-window run of the real
model through the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bench import quality as Q
from kv_extraction_hf.errors import ExtractionError
from kv_extraction_hf.wikitext import load_wikitext2_split, token_windows


# ----------------------------------------------------------------------------- scores
def test_window_scores_on_hand_made_logits():
    # row 0: P_ref = (1/2, 1/2), P = (3/4, 1/4): KL = 0.5 ln(2/3) + 0.5 ln 2 = 0.143841
    # row 1: identical rows: KL 0.
    ref = torch.tensor([[0.0, 0.0], [2.0, 0.0]], dtype=torch.float64)
    dec = torch.tensor([[math.log(3.0), 0.0], [2.0, 0.0]], dtype=torch.float64)
    s = Q.window_scores(ref, dec, [1, 0])
    assert s["kl"] == pytest.approx((0.5 * math.log(2 / 3) + 0.5 * math.log(2)) / 2, abs=1e-12)
    # argmax: ref row 0 is a tie -> index 0 (torch picks the first); dec row 0 -> 0; row 1 -> 0 both
    assert s["top1"] == 1.0
    # nll: row 0 target 1 under P: -ln(1/4); row 1 target 0 under softmax(2, 0): -ln(e^2/(e^2+1))
    want = (math.log(4.0) + math.log1p(math.exp(-2.0))) / 2
    assert s["nll"] == pytest.approx(want, abs=1e-12)
    assert s["ref_nll"] == pytest.approx((math.log(2.0) + math.log1p(math.exp(-2.0))) / 2, abs=1e-12)


def test_window_scores_top1_disagreement_and_shapes():
    ref = torch.tensor([[3.0, 0.0, 0.0], [0.0, 3.0, 0.0], [0.0, 0.0, 3.0], [1.0, 0.0, 0.0]])
    dec = torch.tensor([[3.0, 0.0, 0.0], [3.0, 0.0, 0.0], [0.0, 0.0, 3.0], [0.0, 1.0, 0.0]])
    s = Q.window_scores(ref, dec, [0, 1, 2, 0])
    assert s["top1"] == 0.5
    assert s["kl"] > 0
    assert Q.window_scores(ref, ref, [0, 1, 2, 0])["kl"] == 0.0
    with pytest.raises(ValueError):
        Q.window_scores(ref, dec[:3], [0, 1, 2])
    with pytest.raises(ValueError):
        Q.window_scores(ref, dec, [0, 1])


# ----------------------------------------------------------------------------- loader
def test_loader_data_path_folder_file_and_fallback(tmp_path):
    corpus = " = Title = \n \n Some text about a thing . \n"
    d = tmp_path / "wt"
    d.mkdir()
    (d / "test.txt").write_text(corpus)
    (d / "wiki.valid.raw").write_text("valid " + corpus)
    got = load_wikitext2_split("test", d)
    assert got.text == corpus and got.source == "data-path" and got.location.endswith("test.txt")
    import hashlib

    assert got.sha256 == hashlib.sha256(corpus.encode()).hexdigest()
    assert load_wikitext2_split("validation", d).text.startswith("valid ")
    assert load_wikitext2_split("test", d / "test.txt").text == corpus
    fb = load_wikitext2_split("test", None, use_hub=False, fallback_dir=d)
    assert fb.source == "shared-fallback" and fb.text == corpus
    assert set(fb.record()) == {"split", "source", "location", "sha256", "chars"}


def test_loader_clear_error_when_no_source(tmp_path):
    with pytest.raises(ExtractionError) as err:
        load_wikitext2_split("test", None, use_hub=False, fallback_dir=tmp_path / "none")
    msg = str(err.value)
    assert "\n" not in msg
    assert "--data-path" in msg and "hub" in msg and str(tmp_path / "none") in msg
    with pytest.raises(ExtractionError, match="does not exist"):
        load_wikitext2_split("test", tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExtractionError, match="holds none of"):
        load_wikitext2_split("test", tmp_path / "empty")
    with pytest.raises(ExtractionError, match="unknown WikiText-2 split"):
        load_wikitext2_split("train", tmp_path)


def test_token_windows_seeded_and_disjoint():
    a = token_windows(10_000, 300, 12, seed=3)
    assert a == token_windows(10_000, 300, 12, seed=3)
    assert a != token_windows(10_000, 300, 12, seed=4)
    assert a == sorted(a) and len(a) == 12
    assert all(y - x >= 300 for x, y in zip(a, a[1:]))
    assert a[-1] + 300 <= 10_000
    with pytest.raises(ExtractionError):
        token_windows(1000, 300, 4)


# ----------------------------------------------------------------------------- codecs + rule
def test_codec_spec():
    pairs = Q.parse_codec_spec("all")
    assert pairs[-1] == ("raw", None)
    assert [lv for n, lv in pairs if n == "cachegen"] == [0, 1, 2, 3, 4, 5]
    assert ("cachegen-ref", 0) in pairs and ("quant8", None) in pairs and ("kivi2", None) in pairs
    assert Q.parse_codec_spec("cachegen:1,3;quant8") == [("cachegen", 1), ("cachegen", 3), ("quant8", None)]
    with pytest.raises(Q.QualityError):
        Q.parse_codec_spec("nope")
    with pytest.raises(Q.QualityError):
        Q.parse_codec_spec("cachegen:9")


def _row(codec, level, ratio, kl, top1):
    return {"codec": codec, "level": level, "ratio_vs_dtype": ratio, "kl": sum(kl) / len(kl),
            "top1_agreement": sum(top1) / len(top1), "per_window": {"kl": kl, "top1": top1}}


def test_choose_default_level_rule():
    ref = _row("cachegen-ref", 0, 6.0, [0.040, 0.042, 0.038, 0.041], [0.89, 0.88, 0.89, 0.90])
    small_worse = _row("cachegen", 0, 10.0, [0.070, 0.075, 0.072, 0.080], [0.86, 0.85, 0.86, 0.87])
    mid_same = _row("cachegen", 1, 8.0, [0.041, 0.043, 0.037, 0.042], [0.90, 0.88, 0.89, 0.90])
    big_better = _row("cachegen", 5, 3.7, [0.003, 0.003, 0.003, 0.003], [0.97, 0.97, 0.96, 0.97])
    doc = {"rows": [ref, small_worse, mid_same, big_better]}
    got = Q.choose_default_level(doc)
    assert got["level"] == 1
    flags = {c["level"]: c["qualifies"] for c in got["candidates"]}
    assert flags == {0: False, 1: True, 5: True}
    with pytest.raises(Q.QualityError):
        Q.choose_default_level({"rows": [small_worse]})


def test_cli_no_tasks_and_tasks_only_exclude(tmp_path, capsys):
    assert Q.main(["--no-tasks", "--tasks-only", "--out", str(tmp_path / "q.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "exclude" in err and "\n" not in err


def test_cli_bad_counts_fail_before_the_model(tmp_path, capsys, monkeypatch):
    # --codec-workers / --batch are checked before the data and the model are loaded
    import kv_extraction_hf.model as M

    monkeypatch.setattr(M, "load_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError("model loaded")))
    for flag in ("--codec-workers", "--batch"):
        assert Q.main([flag, "0", "--data-path", str(tmp_path / "missing"), "--out", str(tmp_path / "q.json")]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"error: {flag} must be a positive integer, got 0"


def test_cli_bad_data_path_one_line(tmp_path, capsys):
    rc = Q.main(["--quick", "--data-path", str(tmp_path / "missing"), "--out", str(tmp_path / "q.json")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error:") and "\n" not in err
    assert not (tmp_path / "q.json").exists()


# ----------------------------------------------------------------------------- real model
@pytest.mark.slow
def test_two_window_quick_run_real_model(tmp_path, capsys):
    from kv_extraction_hf.prompts import natural_paragraphs

    d = tmp_path / "wt"
    d.mkdir()
    (d / "test.txt").write_text("\n".join(natural_paragraphs()[:400]))
    out = tmp_path / "quality.json"
    rc = Q.main(["--windows", "2", "--context", "256", "--continuation", "32",
                 "--codecs", "raw;cachegen:1;kivi2;cachegen-ref:0", "--data-path", str(d), "--out", str(out),
                 "--no-tasks"])
    assert rc == 0
    doc = json.loads(out.read_text())
    rows = {(r["codec"], r["level"]): r for r in doc["rows"]}
    assert set(rows) == {("raw", None), ("cachegen", 1), ("kivi2", None), ("cachegen-ref", 0)}
    raw = rows[("raw", None)]
    assert raw["kl"] == 0.0 and raw["top1_agreement"] == 1.0 and raw["ppl_change_pct"] == 0.0
    assert doc["text_info"]["lossless_check"]["passed"] is True
    for key in (("cachegen", 1), ("kivi2", None), ("cachegen-ref", 0)):
        r = rows[key]
        assert r["n_windows"] == 2 and len(r["per_window"]["kl"]) == 2
        assert r["kl"] > 0 and r["kl_ci"][0] <= r["kl"] <= r["kl_ci"][1]
        assert 0 < r["top1_agreement"] <= 1
        assert r["bits_per_element"] == pytest.approx(16 / r["ratio_vs_dtype"])
    assert rows[("cachegen", 1)]["default"] is True and raw["default"] is False
    assert rows[("cachegen", 1)]["ratio_vs_dtype"] > 4 and raw["ratio_vs_dtype"] < 1.0
    assert doc["data"]["source"] == "data-path" and len(doc["data"]["sha256"]) == 64
    assert doc["config"]["n_windows"] == 2 and len(doc["config"]["window_offsets"]) == 2
    assert "chosen default level" in capsys.readouterr().out


def test_reference_scores_reused_equals_direct():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(5, 7, generator=g)
    dec = ref + 0.3 * torch.randn(5, 7, generator=g)
    tg = [1, 2, 3, 4, 5]
    assert Q.window_scores(Q.reference_scores(ref, tg), dec) == Q.window_scores(ref, dec, tg)


def test_quality_figure_from_rows(tmp_path):
    import visualize_results as V

    rows = [dict(_row("cachegen", lv, r, [k, k], [t, t]), bits_per_element=16 / r, kl_ci=[k * 0.9, k * 1.1],
                 top1_agreement_ci=[t - 0.01, t + 0.01], default=lv == 1)
            for lv, r, k, t in [(0, 10.0, 0.07, 0.86), (1, 8.0, 0.04, 0.90), (5, 3.7, 0.003, 0.97)]]
    rows.append(dict(_row("kivi2", None, 4.2, [0.16, 0.17], [0.80, 0.79]), bits_per_element=16 / 4.2,
                     kl_ci=[0.15, 0.18], top1_agreement_ci=[0.78, 0.81]))
    path = tmp_path / "quality.json"
    path.write_text(json.dumps({"rows": rows, "config": {"n_windows": 2}}))
    assert V.main(["--quality", str(path), "--out", str(tmp_path / "figs"), "--formats", "png"]) == 0
    assert (tmp_path / "figs" / "quality_divergence.png").stat().st_size > 1000
    path.write_text(json.dumps({"rows": []}))
    assert V.main(["--quality", str(path), "--out", str(tmp_path / "figs"), "--formats", "png"]) == 1


def test_task_requests_mix():
    reqs = Q.task_requests(60)
    assert len(reqs) == 60
    needle = [(length, i) for t, length, i in reqs if t == "needle"]
    topic = [length for t, length, _ in reqs if t == "topic_retrieval"]
    assert len(needle) == 30 and set(topic) == set(Q.TOPIC_LENGTHS)
    assert {length for length, _ in needle} == set(Q.TASK_LENGTHS)
    # needle depth = NEEDLE_DEPTHS[index % 5]: every depth appears
    assert {i % 5 for _, i in needle} == {0, 1, 2, 3, 4}


@pytest.mark.slow
def test_run_tasks_real_model(default_bundle):
    rows, info = Q.run_tasks(default_bundle, [("raw", None), ("cachegen", 1)], 2, lengths=(256,),
                             topic_lengths=(256,), max_new_tokens=12, log=lambda m: None)
    by = {(r["codec"], r["task"]): r for r in rows}
    assert by[("raw", "all")]["n"] == 2 and by[("raw", "all")]["agreement"] == 1.0
    assert by[("raw", "all")]["accuracy"] == by[("lossless", "all")]["accuracy"]
    lo, hi = by[("cachegen", "all")]["agreement_ci"]
    assert 0.0 <= lo <= by[("cachegen", "all")]["agreement"] <= hi <= 1.0
    assert [r["task"] for r in info["requests"]] == ["needle", "topic_retrieval"]


@pytest.mark.parametrize("context,windows,want", [
    (512, [512, 512, None], 1024),        # Gemma 3 270M: --quick's 512 would drop nothing
    (512, [None, None], 512),             # full attention only: unchanged
    (512, [128, None, 256], 512),         # windows already shorter than half the context
    (512, [300, None], 600),
    (2048, [4096, None], 8192),
])
def test_quick_context_exercises_window_storage(context, windows, want):
    got = Q.quick_hybrid_context(context, windows)
    assert got == want
    sliding = [w for w in windows if w is not None]
    assert not sliding or got > max(sliding)     # something is dropped on every sliding layer


def test_cli_bad_target_one_line_before_the_model(tmp_path, capsys):
    from bench.quality.cli import main

    for argv in (["--targets", "lossy-ish"], ["--target-kl", "-1"], ["--targets", "lmcache", "--fit-windows", "0"]):
        assert main(argv + ["--out", str(tmp_path / "q.json"), "--data-path", str(tmp_path / "none")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and "\n" not in err, err
    assert not (tmp_path / "q.json").exists()


def test_run_targets_rows_on_a_fake_measurement(tmp_path, monkeypatch):
    """bench.quality.targets.run_targets with a measurement made up here: the fitted point of
    each codec, its hash, the held-out check (CI upper <= 1.25x target) and the unmet row."""
    import types

    from bench.quality.targets import parse_targets, run_targets

    monkeypatch.setenv("CACHEGEN_CACHE", str(tmp_path))
    kl = {("cachegen", 0): 0.08, ("cachegen", 1): 0.04, ("cachegen", 5): 0.003, ("cachegen-ref", 0): 0.05}
    calls = []

    def measure(bundle, ids, pairs, n, ctx, cont, seed, configs):
        calls.append(len(pairs))
        scale = 1.0 if len(calls) == 1 else 1.3      # held-out text: 1.3x the calibration KL
        return [{"codec": c, "level": lv, "kl": kl[c, lv] * scale, "kl_ci": [kl[c, lv] * scale * 0.9, kl[c, lv] * scale * 1.1],
                 "top1_agreement": 0.97, "top1_agreement_ci": [0.96, 0.98], "ratio_vs_dtype": 10.0 / (1 + lv),
                 "n_windows": n} for c, lv in pairs]

    bundle = types.SimpleNamespace(
        tokenizer=lambda text, **kw: {"input_ids": [ord(ch) % 97 for ch in text]},
        info=types.SimpleNamespace(model_id="fake", weights_hash="0" * 64))
    import kv_extraction_hf.calibrate.operating_points as fit
    import codec.level_table as LT

    monkeypatch.setattr(LT, "CODEC_LEVELS", dict(LT.CODEC_LEVELS, cachegen=(0, 1, 5), **{"cachegen-ref": (0,)}))
    part = run_targets(bundle, list(range(5000)), parse_targets(["lmcache"], 0.001), ["cachegen"], (4, 48, 8, 0),
                       4, measure, {}, None, log=lambda m: None)
    assert calls[0] == 4 and fit.FIT_SETTINGS["windows"] == 16
    (lm, unmet) = part["rows"]
    assert (lm["target"], lm["codec"], lm["level"]) == ("lmcache", "cachegen", 1)   # 0.044 <= 0.05 < 0.088
    assert len(lm["operating_point"]) == 64 and lm["table"] == part["table"]["hash"]
    assert lm["heldout"]["kl"] == pytest.approx(0.052) and lm["heldout_met"] is True     # 0.0572 <= 0.0625
    assert lm["vs_lmcache"]["kl_within_or_below_ci"] is True
    assert "error" in unmet and "cachegen 5" in unmet["error"]
