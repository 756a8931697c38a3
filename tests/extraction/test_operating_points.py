"""Operating points (codec.operating_points, kv_extraction_hf.calibrate.operating_points):
the target spellings, the chooser on synthetic KL tables (the smallest size that meets the
target with its CI margin), the one-line error of an unmeetable target, the table's round
trip by hash, and a fit on a tiny random Llama built here (no download) that is
deterministic and independent of torch's thread count.

Run: .venv/bin/python -m pytest tests/extraction/test_operating_points.py -q
"""
from __future__ import annotations

import json
import types

import pytest
import torch

from codec import operating_points as op
from codec.errors import CodecError
from kv_extraction_hf.calibrate import operating_points as fit


def _row(codec, level, kl, ratio, top1=0.97, half=0.001, n=16):
    return {"codec": codec, "level": level, "kl": kl, "kl_ci": [kl - half, kl + half], "top1": top1,
            "top1_ci": [top1 - 0.01, top1 + 0.01], "ratio": ratio, "n": n}


TABLE = [_row("cachegen", 0, 0.07, 10.5), _row("cachegen", 1, 0.04, 8.4), _row("cachegen", 3, 0.025, 6.9),
         _row("cachegen", 5, 0.003, 3.7, top1=0.97), _row("cachegen-ref", 0, 0.04, 6.2),
         _row("kvtc", 4, 0.046, 19.6, top1=0.90), _row("kvtc", 5, 0.0085, 10.1, top1=0.948)]


def test_parse_target_spellings():
    assert op.parse_target("near-lossless") == op.Target("near-lossless", 0.01, 0.95)
    assert op.parse_target("LMCache").kl is None
    assert op.parse_target("kl:0.02").kl == 0.02 and op.parse_target("0.02").name == "kl:0.02"
    for bad in ("nope", "kl:-1", "kl:nan", "kl:"):
        with pytest.raises(ValueError):
            op.parse_target(bad)


def test_chooser_picks_the_smallest_meeting_level():
    # kl:0.05: cachegen 1 (0.041 upper) and 3 meet, 0 does not: 1 is the smallest size
    assert op.choose_level(TABLE, "cachegen", op.parse_target("kl:0.05"))["level"] == 1
    # the margin is the CI upper bound: 0.041 > 0.0405 rules level 1 out
    assert op.choose_level(TABLE, "cachegen", op.parse_target("kl:0.0405"))["level"] == 3
    # lmcache: KL <= LMCache's mean calibration KL (0.04): level 1's upper bound 0.041 is above
    assert op.choose_level(TABLE, "cachegen", op.parse_target("lmcache"))["level"] == 3
    assert op.choose_level(TABLE, "kvtc", op.parse_target("kl:0.05"))["level"] == 4
    # near-lossless needs top-1 too: kvtc 5 has KL 0.0095 upper but a mean top-1 of 0.948
    assert op.choose_level(TABLE, "cachegen", op.parse_target("near-lossless"))["level"] == 5


def test_unmeetable_target_names_the_closest_point():
    with pytest.raises(op.TargetUnmet) as e:
        op.choose_level(TABLE, "kvtc", op.parse_target("near-lossless"))
    msg = str(e.value)
    assert "\n" not in msg and "kvtc 5" in msg and "KL 0.0085" in msg
    with pytest.raises(op.TargetUnmet, match="cachegen 5"):
        op.choose_level(TABLE, "cachegen", op.parse_target("kl:0.001"))
    with pytest.raises(ValueError, match="cachegen-ref"):
        op.choose_level([r for r in TABLE if r["codec"] != "cachegen-ref"], "cachegen", op.parse_target("lmcache"))


def test_table_round_trip_by_hash(tmp_path):
    table = {"model": {"id": "m", "weights_hash": "0" * 64}, "text": {"source": "s", "sha256": "1" * 64},
             "settings": {}, "rows": TABLE}
    h = op.save_table(table, tmp_path)
    assert op.save_table(dict(table, hash="x"), tmp_path) == h and (tmp_path / f"{h}.json").is_file()
    got = op.load_table(h, tmp_path)
    assert got["hash"] == h and op.table_bytes(got)[1] == h
    point = op.operating_point(got, "cachegen", op.parse_target("kl:0.05"))
    assert point.table == h and point.level == 1 and point.record()["hash"] == point.hash
    assert point.hash == op.operating_point(op.load_table(h, tmp_path), "cachegen", op.parse_target("kl:0.05")).hash
    json.dumps(point.record())
    (tmp_path / f"{h}.json").write_bytes((tmp_path / f"{h}.json").read_bytes().replace(b"cachegen", b"cachegeN"))
    with pytest.raises(CodecError, match="hash"):
        op.load_table(h, tmp_path)
    with pytest.raises(CodecError, match="not in"):
        op.load_table("a" * 64, tmp_path)
    with pytest.raises(CodecError):
        op.load_table("../x", tmp_path)


@pytest.fixture(scope="module")
def tiny():
    from tests.helpers.tiny_llama import tiny_llama_bundle

    return tiny_llama_bundle()


def _measure(bundle, ids, pairs, n, ctx, cont, seed, configs):
    from bench.quality.text import run_text_quality

    return run_text_quality(bundle, ids, pairs, n, ctx, cont, seed, log=lambda m: None, batch=4,
                            codec_workers=1, configs=configs)[0]


SETTINGS = {"windows": 4, "context_tokens": 48, "continuation_tokens": 8, "skip_tokens": 64}


def test_fit_is_deterministic_and_thread_count_independent(tiny, tmp_path):
    text = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 12
    threads = torch.get_num_threads()
    hashes = []
    try:
        for i, nt in enumerate((1, 2, 1)):
            torch.set_num_threads(nt)
            t = fit.fit_table(tiny, _measure, ("cachegen", "cachegen-ref"), SETTINGS, text=text,
                              folder=tmp_path / str(i), log=lambda m: None)
            hashes.append(t["hash"])
    finally:
        torch.set_num_threads(threads)
    assert len(set(hashes)) == 1
    assert {(r["codec"], r["level"]) for r in t["rows"]} == {("cachegen", lv) for lv in range(6)} | \
        {("cachegen-ref", lv) for lv in range(4)}
    # a second call with the same key loads the stored table (no measurement)
    again = fit.fit_table(tiny, lambda *a: pytest.fail("measured again"), ("cachegen", "cachegen-ref"), SETTINGS,
                          text=text, folder=tmp_path / "0", log=lambda m: None)
    assert again["hash"] == hashes[0]
    pts = fit.fit_operating_points(again, ["lmcache", "kl:1e-9"], ("cachegen",))
    assert "point" in pts[0] and pts[0]["point"]["table"] == hashes[0]
    assert "error" in pts[1] and "closest" in pts[1]["error"]
    with pytest.raises(ValueError, match="no levels"):
        fit.fit_table(tiny, _measure, ("raw",), SETTINGS, text=text, folder=tmp_path, log=lambda m: None)


TEXT = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 12


def test_a_target_resolves_to_the_tables_choice_and_the_same_hash_in_a_fresh_folder(tiny, tmp_path):
    table, points = fit.resolve_points(tiny, "kl:0.5", ("cachegen",), _measure, settings=SETTINGS, text=TEXT,
                                       folder=tmp_path / "a", log=lambda m: None)
    want = op.choose_level(table["rows"], "cachegen", op.parse_target("kl:0.5"))
    p = points["cachegen"]
    assert (p.level, p.table, p.kl) == (want["level"], table["hash"], want["kl"])
    # the table holds cachegen and LMCache's schedule only (cachegen-ref 0, the lmcache reference)
    assert {r["codec"] for r in table["rows"]} == {"cachegen", "cachegen-ref"}
    assert [r["level"] for r in table["rows"] if r["codec"] == "cachegen-ref"] == [0]
    # a fresh cache folder fits again and gets the same bytes, so the same hash and point
    again, pts2 = fit.resolve_points(tiny, "kl:0.5", ("cachegen",), _measure, settings=SETTINGS, text=TEXT,
                                     folder=tmp_path / "b", log=lambda m: None)
    assert again["hash"] == table["hash"] and pts2["cachegen"].hash == p.hash
    assert fit.point_summary(p) == {"target": "kl:0.5", "codec": "cachegen", "level": p.level, "hash": p.hash,
                                    "table": table["hash"]}
    # later uses load the table by its key: no measurement
    fit.resolve_points(tiny, "lmcache", ("cachegen",), lambda *a: pytest.fail("measured again"),
                       settings=SETTINGS, text=TEXT, folder=tmp_path / "a", log=lambda m: None)
    # found without fitting by the model's weights hash; none for another model or folder
    assert fit.find_table("0" * 64, "cachegen", tmp_path / "a")["hash"] == table["hash"]
    assert fit.find_table("1" * 64, "cachegen", tmp_path / "a") is None
    assert fit.find_table("0" * 64, "kvtc", tmp_path / "a") is None
    assert fit.find_table("0" * 64, "cachegen", tmp_path / "empty") is None
    with pytest.raises(op.TargetUnmet, match="closest: cachegen"):
        fit.resolve_points(tiny, "kl:1e-9", ("cachegen",), _measure, settings=SETTINGS, text=TEXT,
                           folder=tmp_path / "a", log=lambda m: None)
    with pytest.raises(ValueError, match="no levels"):
        fit.resolve_points(tiny, "lmcache", ("raw",), _measure, settings=SETTINGS, text=TEXT,
                           folder=tmp_path / "a", log=lambda m: None)
