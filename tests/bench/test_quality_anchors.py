"""bench.quality --anchors: the flag's one-line errors before the model loads, the rows'
``anchors`` / ``exact_tokens`` fields and table column, the default-level rule ignoring
anchored rows, and a one-window run of the real model with anchors on and off."""

from __future__ import annotations

import io
import json

import pytest

from bench import quality as Q
from bench.quality.report import print_table
from bench.quality.text import summarize_rows


@pytest.mark.parametrize("bad", ["4", "-1,2", "4,x", "1,2,3"])
def test_bad_anchors_fail_before_the_model(tmp_path, capsys, monkeypatch, bad):
    import kv_extraction_hf.model as M

    monkeypatch.setattr(M, "load_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError("model loaded")))
    assert Q.main([f"--anchors={bad}", "--no-tasks", "--out", str(tmp_path / "q.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --anchors:") and "\n" not in err


def _acc(kl, exact):
    return {"kl": kl, "top1": [1.0] * len(kl), "ppl_change_pct": [0.0] * len(kl), "bytes": 100,
            "dtype_bytes": 800, "elements": 400, "stored_elements": 400, "exact_tokens": exact,
            "encode_s": 0.0, "decode_s": 0.0, "forward_s": 0.0}


def test_rows_state_anchors_and_exact_tokens():
    rows = summarize_rows({("cachegen", 1, (0, 0)): _acc([0.04, 0.05], [4, 4]),
                           ("cachegen", 1, (4, 128)): _acc([0.02, 0.03], [132, 132]),
                           ("lmcache-fp8", None, (0, 0)): _acc([0.1, 0.1], [None, None])}, n_resamples=100)
    by = {(r["codec"], r["anchors"]["sink"], r["anchors"]["recent"]): r for r in rows}
    assert by[("cachegen", 0, 0)]["exact_tokens"] == 4 and by[("cachegen", 0, 0)]["default"] is True
    assert by[("cachegen", 4, 128)]["exact_tokens"] == 132 and by[("cachegen", 4, 128)]["default"] is False
    assert by[("lmcache-fp8", 0, 0)]["exact_tokens"] is None
    out = io.StringIO()
    print_table(rows, out=out)
    text = out.getvalue()
    assert "exact" in text.splitlines()[0] and "cachegen 1 +4/128" in text and " 132 " in text


def test_default_rule_ignores_anchored_rows():
    def row(level, kl, anchors=None):
        r = {"codec": "cachegen", "level": level, "ratio_vs_dtype": 10.0 - level, "kl": sum(kl) / len(kl),
             "top1_agreement": 0.9, "per_window": {"kl": kl, "top1": [0.9] * len(kl)}}
        if anchors:
            r["anchors"] = {"sink": anchors[0], "recent": anchors[1]}
        return r
    ref = dict(row(0, [0.04, 0.04, 0.04]), codec="cachegen-ref")
    doc = {"rows": [ref, row(1, [0.09, 0.09, 0.09]), row(1, [0.01, 0.01, 0.01], (4, 128)),
                    row(3, [0.02, 0.02, 0.02])]}
    got = Q.choose_default_level(doc)
    assert got["level"] == 3 and len(got["candidates"]) == 2


@pytest.mark.slow
def test_one_window_with_anchors_real_model(tmp_path):
    from kv_extraction_hf.prompts import natural_paragraphs

    d = tmp_path / "wt"
    d.mkdir()
    (d / "test.txt").write_text("\n".join(natural_paragraphs()[:400]))
    out = tmp_path / "quality.json"
    rc = Q.main(["--windows", "1", "--context", "256", "--continuation", "32", "--codecs", "raw;cachegen:1",
                 "--anchors", "4,32", "--data-path", str(d), "--out", str(out), "--no-tasks"])
    assert rc == 0
    doc = json.loads(out.read_text())
    rows = {(r["codec"], r["anchors"]["recent"]): r for r in doc["rows"]}
    assert set(rows) == {("raw", 0), ("raw", 32), ("cachegen", 0), ("cachegen", 32)}
    assert rows[("raw", 32)]["kl"] == 0.0 and rows[("raw", 32)]["exact_tokens"] == 36
    assert rows[("cachegen", 0)]["exact_tokens"] == 4 and rows[("cachegen", 32)]["exact_tokens"] == 36
    assert rows[("cachegen", 32)]["ratio_vs_dtype"] < rows[("cachegen", 0)]["ratio_vs_dtype"]
    assert doc["config"]["anchors"] == [[0, 0], [4, 32]]
