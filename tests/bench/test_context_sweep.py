"""bench.context_sweep: its arithmetic on made-up runs, its flags' one-line
errors, and the figure drawn from its file (no model: the sweep itself runs run_benchmarks.py,
which tests/harness covers)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench import context_sweep as cs

REPO = Path(__file__).resolve().parents[2]


def _run(mode, level, bw, tokens, ttft, **parts):
    r = {"mode": mode, "level": level, "bandwidth_mbps": bw, "context_tokens": tokens,
         "ttft_s": ttft, "bytes": parts.pop("bytes", 0), "load_error": None,
         "quality": {"correct": True}}
    r.update({p: parts.get(p, 0.0) for p in cs.PARTS})
    return r


def test_loglog_fit_recovers_a_power_law():
    xs = [2048, 4096, 8192, 16384]
    f = cs.loglog_fit(xs, [3e-4 * x ** 1.5 for x in xs])
    assert f["slope"] == pytest.approx(1.5) and f["r2"] == pytest.approx(1.0) and f["n"] == 4
    assert f["intercept"] == pytest.approx(math.log(3e-4))
    g = cs.loglog_fit(xs, [1.0, 2.5, 3.0, 9.0])  # noisy: r2 below 1
    assert 0 < g["r2"] < 1
    assert cs.loglog_fit([1024], [1.0]) is None and cs.loglog_fit([1, 2], [0.0, -1.0]) is None
    assert cs.loglog_fit([5, 5], [1.0, 2.0]) is None  # no spread in x


def test_rows_take_medians_and_shares_per_mode_and_rate():
    runs = [_run("text", None, 100.0, 2046, t, prefill_s=t) for t in (1.0, 2.0, 3.0)]
    runs += [_run("cachegen", 1, 100.0, 2046, 0.5, transfer_s=0.3, decode_s=0.1, prefill_s=0.1,
                  bytes=1000),
             _run("cachegen", 1, 100.0, 2046, 1.0, transfer_s=0.4, decode_s=0.2, prefill_s=0.2,
                  bytes=1000),
             dict(_run("cachegen", 1, 100.0, 2046, 9.0), load_error="gone")]  # failed: left out
    rows = cs.rows_from_runs(runs, 2048)
    assert [(r["mode"], r["n"]) for r in rows] == [("text", 3), ("cachegen", 2)]
    text, cg = rows
    assert text["ttft_s_median"] == 2.0 and text["prefill_s_share"] == 1.0
    assert text["context_tokens"] == 2046 and text["context_tokens_target"] == 2048
    assert cg["ttft_s_median"] == pytest.approx(0.75) and cg["bytes_median"] == 1000
    assert cg["transfer_s_share"] == pytest.approx((0.6 + 0.4) / 2)
    assert cg["ttft_s_p25"] <= cg["ttft_s_median"] <= cg["ttft_s_p75"]


def test_fits_report_the_text_over_cachegen_ratio_and_whether_it_grows():
    rows = []
    for n, (t, c) in {2048: (1.0, 0.5), 4096: (2.4, 0.6), 8192: (6.0, 0.75)}.items():
        runs = [_run("text", None, 1000.0, n, t), _run("cachegen", 1, 1000.0, n, c)]
        rows += cs.rows_from_runs(runs, n)
    f = cs.fits(rows)
    (tc,) = f["text_over_cachegen"]
    assert [p["ratio"] for p in tc["points"]] == pytest.approx([2.0, 4.0, 8.0])
    assert tc["grows"] and tc["fit"]["slope"] == pytest.approx(1.0)
    text_fit = next(x for x in f["ttft"] if x["mode"] == "text")["fit"]
    assert text_fit["slope"] > 1.0
    # a ratio that falls at one length does not "grow"
    rows[-2]["ttft_s_median"] = 0.1  # text at 8K
    assert not cs.fits(rows)["text_over_cachegen"][0]["grows"]


@pytest.mark.parametrize("argv, says", [
    (["--context-tokens", "100"], ">= 256"),
    (["--modes", "cachegen"], "must include text"),
    (["--repeats", "0"], ">= 1"),
])
def test_bad_flags_are_one_line_errors(argv, says):
    p = subprocess.run([sys.executable, "-m", "bench.context_sweep", *argv], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_figure_from_a_sweep_file(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from visualize.sweep_figures import render_context_sweep

    rows = []
    for n, (t, c) in {2048: (1.0, 0.5), 4096: (2.4, 0.6)}.items():
        rows += cs.rows_from_runs([_run("text", None, 100.0, n, t), _run("cachegen", 1, 100.0, n, c)], n)
    f = tmp_path / "context-sweep-m.json"
    f.write_text(json.dumps({"rows": rows, "fits": cs.fits(rows), "model": {"model_id": "m"},
                             "config": {"engine": "hf", "repeats": 1, "num_contexts": 1}}))
    (out,) = render_context_sweep(f, tmp_path, ["png"])
    assert out.name == "ttft_vs_context-m.png" and out.stat().st_size > 1000
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"rows": []}))
    from visualize.loading import SkipFigure

    with pytest.raises(SkipFigure):
        render_context_sweep(bad, tmp_path, ["png"])
    p = subprocess.run([sys.executable, "visualize_results.py", "--context-sweep", str(tmp_path / "nope.json"),
                        "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.startswith("error: ")


def test_a_small_sweep_end_to_end_on_the_default_model(tmp_path):
    """Two short lengths on the default model through run_benchmarks.py (HF engine, the
    userspace link at one rate): a file with a row per (length, mode), fits, and the
    lengths' records; everything it claims comes from the runs it made."""
    out = tmp_path / "context-sweep-default.json"
    p = subprocess.run([sys.executable, "-m", "bench.context_sweep", "--model", "default",
                        "--context-tokens", "256", "512", "--modes", "text", "cachegen",
                        "--bandwidth-mbps", "1000", "--repeats", "1", "--link-method", "userspace",
                        "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["schema"] == cs.SCHEMA and doc["config"]["lengths"] == [256, 512]
    got = {(r["context_tokens_target"], r["mode"]) for r in doc["rows"]}
    assert got == {(256, "text"), (256, "cachegen"), (512, "text"), (512, "cachegen")}
    for r in doc["rows"]:
        assert r["n"] == 1 and r["ttft_s_median"] > 0 and 200 <= r["context_tokens"] <= 512
        assert (r["bytes_median"] > 0) == (r["mode"] == "cachegen")
    assert [rec["returncode"] for rec in doc["lengths"]] == [0, 0] and not doc["failures"]
    (tc,) = doc["fits"]["text_over_cachegen"]
    assert len(tc["points"]) == 2 and tc["fit"]["n"] == 2
    assert doc["environment"]["engine"]["warmup_s"]  # the HF engine's untimed warm-up ran
    assert "text/cachegen at 1000 Mbit/s" in p.stdout


def test_readme_block_is_rendered_from_the_file():
    sys.path.insert(0, str(REPO / "scripts"))
    from readme_sweep_table import render_sweep

    assert render_sweep(None, "benchmarks/context-sweep-x.json").startswith("Not yet measured")
    rows = []
    for n, (t, c, ok) in {2048: (1.0, 0.5, True), 4096: (2.4, 0.6, False)}.items():
        runs = [_run("text", None, 100.0, n - 2, t), _run("cachegen", 1, 100.0, n - 2, c, bytes=2_000_000)]
        runs[1]["quality"]["correct"] = ok
        rows += cs.rows_from_runs(runs, n)
    doc = {"rows": rows, "fits": cs.fits(rows), "command": ["python", "-m", "bench.context_sweep"],
           "config": {"engine": "hf", "repeats": 1, "num_contexts": 1},
           "lengths": [{"loadavg_start": 0.5, "loadavg_end": 1.5}]}
    text = render_sweep(doc, "benchmarks/context-sweep-x.json")
    assert "| mode | 2K | 4K |" in text and "| cachegen 1 | 0.5 (2.0 MB) | 0.6 (2.0 MB) |" in text
    assert "TTFT text / cachegen: 2K 2.00x, 4K 4.00x; log-log slope 1.00" in text
    assert "| cachegen 1 | 1/1 | 0/1 |" in text and "load average 0.5-1.5" in text
