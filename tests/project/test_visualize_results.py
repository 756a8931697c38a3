"""Tests of visualize_results.py: figures from a small real-shaped results file, partial and
malformed inputs.

Run: python -m pytest tests/project/test_visualize_results.py -q
"""

import ast
import copy
import json
import struct
import subprocess
import sys
from pathlib import Path

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

import visualize_results as vr  # noqa: E402
from visualize import data as vdata, results_figures as vfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "results_small.json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LABELS = ["text", "raw", "quant8", "kivi2", "cachegen-l3", "cachegen-l2", "cachegen-l1", "cachegen-adaptive"]


@pytest.fixture(scope="module")
def doc():
    return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def data(doc):
    return vr.prepare(doc)


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def _write(tmp_path: Path, doc, name="results.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


# ----------------------------------------------------------------------------- full run


def test_all_figures_written_as_png_and_svg(tmp_path, capsys):
    out = tmp_path / "figs"
    rc = vr.main(["--results", str(FIXTURE), "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert captured.err == ""  # schema v1, nothing skipped, no warnings
    assert "skipped" not in captured.out
    expected = {f"{name}.{fmt}" for name in vr.FIGURES for fmt in ("png", "svg")}
    assert {p.name for p in out.iterdir()} == expected  # and no temp files left behind
    assert len(vr.FIGURES) == 6
    for name in vr.FIGURES:
        width, height = _png_size(out / f"{name}.png")
        assert width >= 600 and height >= 400, (name, width, height)
        assert (out / f"{name}.png").stat().st_size > 20_000
        svg = (out / f"{name}.svg").read_text()
        assert svg.startswith("<?xml") and "<svg" in svg and svg.rstrip().endswith("</svg>")
        assert f"wrote {out / name}.png" in captured.out


def test_formats_and_only(tmp_path, capsys):
    rc = vr.main(["--results", str(FIXTURE), "--out", str(tmp_path), "--formats", "png", "--dpi", "40",
                  "--only", "kv_size", "ttft_breakdown"])
    assert rc == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kv_size.png", "ttft_breakdown.png"]


# ----------------------------------------------------------------------------- figure content


def _legend_texts(fig_or_ax):
    legends = fig_or_ax.legends if hasattr(fig_or_ax, "legends") else [fig_or_ax.get_legend()]
    return [t.get_text() for leg in legends if leg for t in leg.get_texts()]


def test_ttft_vs_bandwidth_axes_and_values(data, doc):
    fig = vfig.fig_ttft_vs_bandwidth(data)
    assert len(fig.axes) == 1
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"  # 0.15 s .. 4 s spans > 10x
    assert "Mbit/s" in ax.get_xlabel() and "TTFT (s" in ax.get_ylabel()
    assert ax.get_title() == "Time to first token vs link bandwidth"
    assert _legend_texts(ax) == LABELS
    assert len(ax.containers) == 8  # one errorbar container per label
    # the plotted points are the summaries' medians
    line = next(c for c in ax.containers if c.get_label() == "cachegen-l2").lines[0]
    want = sorted((s["bandwidth_mbps"], s["ttft_s_median"]) for s in doc["summaries"]
                  if s["mode"] == "cachegen" and s["level"] == 2)
    np.testing.assert_allclose(line.get_xdata(), [w[0] for w in want])
    np.testing.assert_allclose(line.get_ydata(), [w[1] for w in want])
    # the caption names model, link and date
    texts = " ".join(t.get_text() for t in fig.texts)
    assert "SmolLM2-135M-Instruct" in texts and "netns-tbf" in texts and "2026-11-30" in texts


def test_kv_size_bars(data, doc):
    fig = vfig.fig_kv_size(data)
    size_ax, ratio_ax = fig.axes
    assert size_ax.get_yscale() == "log"  # text (8.6 kB) vs raw (47 MB)
    assert [t.get_text() for t in size_ax.get_xticklabels()] == LABELS
    assert [t.get_text() for t in ratio_ax.get_xticklabels()] == LABELS[1:]  # text has no ratio
    heights = {t.get_text(): p.get_height() for t, p in zip(size_ax.get_xticklabels(), size_ax.patches, strict=True)}
    raw = next(s["bytes_median"] for s in doc["summaries"] if s["mode"] == "raw")
    assert heights["raw"] == pytest.approx(raw / 1e6)
    assert heights["raw"] == pytest.approx(30 * 2 * 2048 * 3 * 64 * 2 / 1e6)  # bf16 KV of 2048 tokens
    ratios = {t.get_text(): p.get_height() for t, p in zip(ratio_ax.get_xticklabels(), ratio_ax.patches, strict=True)}
    assert ratios["raw"] == pytest.approx(1.0)
    assert ratios["cachegen-l1"] == pytest.approx(8.1)
    assert ratios["cachegen-adaptive"] == pytest.approx(6.35)  # median over 100/500/1000 Mbit/s
    assert "bfloat16" in ratio_ax.get_ylabel()


def test_quality_vs_size_pareto(data):
    fig = vfig.fig_quality_vs_size(data)
    assert [ax.get_ylabel() for ax in fig.axes] == [t for _, t in vfig.QUALITY_PANELS]
    for ax in fig.axes:
        assert ax.get_xscale() == "log"
        assert "MB" in ax.get_xlabel()
    legend = _legend_texts(fig)
    assert "text" not in legend and "text (recompute)" in legend and "Pareto front" in legend
    assert set(LABELS[1:]) <= set(legend)
    ppl_ax = fig.axes[0]
    assert "lower is better" in ppl_ax.get_title()
    # 6 fixed-size labels (1 point each) + adaptive (3 bandwidths -> 3 points) = 9 points
    points = np.concatenate([c.get_offsets() for c in ppl_ax.collections])
    assert len(points) == 9
    # kivi2 (+7.8%) is dominated: it is not on the front line
    front = next(line for line in ppl_ax.get_lines() if line.get_label() == "Pareto front")
    kivi_mb = 47185920 / 5.6 / 1e6
    assert not np.any(np.isclose(front.get_xdata(), kivi_mb, rtol=1e-3))


def test_pareto_helper():
    pts = [(1, 0.5), (2, 0.4), (3, 0.9), (4, 0.9), (5, 1.0)]
    assert vfig.pareto_front(pts, higher_is_better=True) == [(1, 0.5), (3, 0.9), (5, 1.0)]
    lower = [(1, 3.0), (2, 4.0), (3, 0.3), (4, 0.3), (5, 0.0)]
    assert vfig.pareto_front(lower, higher_is_better=False) == [(1, 3.0), (3, 0.3), (5, 0.0)]


def test_ttft_breakdown_stacks(data, doc):
    fig = vfig.fig_ttft_breakdown(data)
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == ["100 Mbit/s", "500 Mbit/s", "1000 Mbit/s"]
    names = _legend_texts(fig)
    assert names[-5:] == ["lookup", "transfer", "decode", "inject", "prefill"] or \
        names[:5] == ["lookup", "transfer", "decode", "inject", "prefill"]
    assert "measured TTFT (median)" in names
    ax = axes[0]
    assert len(ax.patches) == 8 * 5
    # the stack of raw at 100 Mbit/s sums its components
    s = next(r for r in doc["summaries"] if r["mode"] == "raw" and r["bandwidth_mbps"] == 100.0)
    raw_idx = LABELS.index("raw")
    stack = sum(ax.patches[part * 8 + raw_idx].get_height() for part in range(5))
    want = sum(s[c] for c, _ in vdata.BREAKDOWN_PARTS)
    assert stack == pytest.approx(want)


def test_reconstruction_error_per_layer(data):
    fig = vfig.fig_reconstruction_error(data)
    keys_ax, values_ax = fig.axes
    assert (keys_ax.get_title(), values_ax.get_title()) == ("keys", "values")
    assert keys_ax.get_yscale() == "log"
    labels = [line.get_label() for line in keys_ax.get_lines()]
    assert labels == ["quant8", "kivi2", "cachegen-l3", "cachegen-l2", "cachegen-l1"]  # raw is lossless
    for line in keys_ax.get_lines():
        np.testing.assert_array_equal(line.get_xdata(), np.arange(30))
    assert "lossless (error 0, not drawn): raw" in " ".join(t.get_text() for t in fig.texts)


def test_adaptation_timeline(data, doc):
    fig = vfig.fig_adaptation_timeline(data)
    bw_ax, level_ax, time_ax = fig.axes
    assert bw_ax.get_ylabel() == "Mbit/s" and level_ax.get_ylabel() == "level chosen"
    assert time_ax.get_xlabel() == "chunk index"
    steps = bw_ax.get_lines()[0]
    np.testing.assert_allclose(steps.get_ydata(), [a["bandwidth_mbps"] for a in doc["adaptation"]])
    level_line = level_ax.get_lines()[0]
    want = [0 if a["text_fallback"] else a["level"] for a in doc["adaptation"]]
    np.testing.assert_allclose(level_line.get_ydata(), want)
    assert [t.get_text() for t in level_ax.get_yticklabels()] == ["text", "1", "2", "3"]
    slo = [line for line in time_ax.get_lines() if line.get_label() == "SLO"]
    assert len(slo) == 1 and slo[0].get_ydata()[0] == pytest.approx(1.5)


def test_plot_label():
    assert vdata.plot_label("cachegen", 2.0) == "cachegen-l2"
    assert vdata.plot_label("cachegen", 2) == "cachegen-l2"
    assert vdata.plot_label("raw", None) == "raw"
    assert vdata.plot_label("raw", float("nan")) == "raw"


# ----------------------------------------------------------------------------- partial input


def test_summaries_computed_from_runs_when_missing(doc, tmp_path, capsys):
    no_summaries = {k: v for k, v in doc.items() if k != "summaries"}
    data = vr.prepare(no_summaries)
    assert data.notes == ["no 'summaries' in the file; medians computed from 'runs'"]
    got = data.summaries.set_index(["label", "bandwidth_mbps"])
    for s in doc["summaries"]:
        row = got.loc[(vdata.plot_label(s["mode"], s["level"]), s["bandwidth_mbps"])]
        assert row["n"] == s["n"]
        assert row["ttft_s_median"] == pytest.approx(s["ttft_s_median"])
        assert row["ttft_s_p25"] == pytest.approx(s["ttft_s_p25"])
        assert row["accuracy"] == pytest.approx(s["accuracy"])
        assert row["bytes_median"] == pytest.approx(s["bytes_median"])
    rc = vr.main(["--results", str(_write(tmp_path, no_summaries)), "--out", str(tmp_path / "o"),
                  "--formats", "png", "--dpi", "40", "--only", "ttft_vs_bandwidth"])
    assert rc == 0
    assert "medians computed from 'runs'" in capsys.readouterr().err


def test_missing_sections_are_named_as_skipped(doc, tmp_path, capsys):
    partial = copy.deepcopy(doc)
    del partial["adaptation"]
    del partial["codec_layers"]
    # only two modes and one bandwidth left
    partial["summaries"] = [s for s in partial["summaries"]
                            if s["mode"] in ("raw", "cachegen") and s["bandwidth_mbps"] == 100.0]
    del partial["runs"]
    out = tmp_path / "o"
    rc = vr.main(["--results", str(_write(tmp_path, partial)), "--out", str(out), "--formats", "png", "--dpi", "40"])
    captured = capsys.readouterr()
    assert rc == 0
    assert "skipped adaptation_timeline: no 'adaptation' records" in captured.out
    assert "skipped reconstruction_error: no 'codec_layers' records" in captured.out
    assert sorted(p.name for p in out.iterdir()) == [
        "kv_size.png", "quality_vs_size.png", "ttft_breakdown.png", "ttft_vs_bandwidth.png"]
    fig = vfig.fig_ttft_vs_bandwidth(vr.prepare(partial))
    assert _legend_texts(fig.axes[0]) == ["raw", "cachegen-l3", "cachegen-l2", "cachegen-l1"]


def test_missing_columns_are_named(doc, tmp_path, capsys):
    partial = copy.deepcopy(doc)
    for s in partial["summaries"]:
        del s["ttft_s_median"]
        for key in ("ppl_increase_pct", "accuracy", "rouge_l"):
            del s[key]
    del partial["runs"]
    rc = vr.main(["--results", str(_write(tmp_path, partial)), "--out", str(tmp_path / "o"), "--formats", "png", "--dpi", "40"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "skipped ttft_vs_bandwidth: 'summaries' lack ttft_s_median" in out
    assert "skipped quality_vs_size: 'summaries' lack ppl_increase_pct, accuracy and rouge_l" in out
    assert "wrote" in out and "ttft_breakdown.png" in out


def test_other_schema_version_warns_and_draws(doc, tmp_path, capsys):
    other = copy.deepcopy(doc)
    other["schema_version"] = 2
    other["new_section"] = {"anything": [1, 2, 3]}  # unknown keys are ignored
    for s in other["summaries"]:
        s["extra_field"] = "x"
    rc = vr.main(["--results", str(_write(tmp_path, other)), "--out", str(tmp_path / "o"), "--formats", "png", "--dpi", "40"])
    captured = capsys.readouterr()
    assert rc == 0
    assert "warning: results file has schema_version 2, this script knows 1" in captured.err
    assert len(list((tmp_path / "o").iterdir())) == 6


def test_wrong_section_types_are_ignored_with_a_note(doc, tmp_path, capsys):
    odd = {"schema_version": 1, "summaries": {"not": "a list"}, "adaptation": ["junk", 3],
           "codec_layers": doc["codec_layers"]}
    rc = vr.main(["--results", str(_write(tmp_path, odd)), "--out", str(tmp_path / "o"), "--formats", "png", "--dpi", "40"])
    captured = capsys.readouterr()
    assert rc == 0
    assert "warning: 'summaries' is a dict, not a list; ignored" in captured.err
    assert "warning: 'adaptation': 2 entries are not objects; ignored" in captured.err
    assert [p.name for p in (tmp_path / "o").iterdir()] == ["reconstruction_error.png"]


def test_nothing_drawable_exits_1(tmp_path, capsys):
    rc = vr.main(["--results", str(_write(tmp_path, {"schema_version": 1})), "--out", str(tmp_path / "o")])
    captured = capsys.readouterr()
    assert rc == 1
    assert captured.out.count("skipped") == 6
    assert "error: no figure could be drawn" in captured.err
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


# ----------------------------------------------------------------------------- malformed input


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    ("", "not valid JSON"),
    ("[1, 2, 3]", "top level is a JSON list, expected an object"),
    ('"a string"', "top level is a JSON str, expected an object"),
    ("null", "top level is a JSON NoneType, expected an object"),
])
def test_malformed_file_exit_2(tmp_path, capsys, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    rc = vr.main(["--results", str(path), "--out", str(tmp_path / "o")])
    captured = capsys.readouterr()
    assert rc == 2
    assert captured.err.startswith("error: ") and message in captured.err
    assert captured.err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_missing_and_binary_file_exit_2(tmp_path, capsys):
    assert vr.main(["--results", str(tmp_path / "nope.json"), "--out", str(tmp_path)]) == 2
    assert "no such file" in capsys.readouterr().err
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert vr.main(["--results", str(binary), "--out", str(tmp_path)]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_out_is_a_file_exit_2(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("x")
    assert vr.main(["--results", str(FIXTURE), "--out", str(target)]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_cli_malformed_no_traceback(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("this is not json")
    proc = subprocess.run([sys.executable, str(ROOT / "visualize_results.py"), "--results", str(bad),
                           "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0
    assert proc.stderr.startswith(f"error: {bad}: not valid JSON")


# ----------------------------------------------------------------------------- layering


def test_reads_results_only_and_sets_backend_in_main():
    tree = ast.parse((ROOT / "visualize_results.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"codec", "streaming", "kv_extraction_hf", "third_party", "torch", "run_benchmarks"}
    # matplotlib.use("Agg") is called inside main(), never at module level
    main_fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    calls_in_main = {ast.unparse(n.func) for n in ast.walk(main_fn) if isinstance(n, ast.Call)}
    assert "matplotlib.use" in calls_in_main
    module_level = [n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert all("matplotlib.use" not in ast.unparse(n) for n in module_level)


# ----------------------------------------------------------------------------- odd values


BAD_VALUES = [None, "n/a", -1, 0, 1e300, [], {}, True, "", 2.5]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # 1e300 on a log axis
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_odd_values_never_crash(doc, tmp_path, seed):
    """Seeded random corruption of field values: figures are drawn or named as skipped, never a crash."""
    import random

    rng = random.Random(seed)
    bad = copy.deepcopy(doc)
    for _ in range(150):
        records = bad[rng.choice(["summaries", "codec_layers", "adaptation", "runs"])]
        record = rng.choice(records)
        key = rng.choice(list(record))
        if rng.random() < 0.3:
            del record[key]
        else:
            record[key] = rng.choice(BAD_VALUES)
    if seed % 2:
        del bad["summaries"]  # exercise the medians computed from corrupted runs
    data = vr.prepare(json.loads(json.dumps(bad)))
    written, skipped = vr.render_all(data, tmp_path, ["png"], dpi=20)
    assert len(written) + len(skipped) == len(vr.FIGURES)
    assert len(written) >= 3
    for path in written:
        assert path.read_bytes()[:8] == PNG_MAGIC


def test_adaptation_several_traces_without_estimate(doc):
    """The shape run_benchmarks writes: traces constant/step/artifact, no throughput estimate."""
    rows = []
    for trace, bws in [("constant", [1000] * 4), ("step", [1000, 100, 100, 1000]), ("artifact", [430, 40, 990, 300])]:
        for i, bw in enumerate(bws):
            rows.append({"trace": trace, "context_id": "c0", "chunk": i, "bandwidth_mbps": bw,
                         "level": None if bw < 60 else (3 if bw > 500 else 1), "text_fallback": bw < 60,
                         "elapsed_s": 0.3 * (i + 1), "slo_s": 1.0, "trace_scale": 0.1})
    fig = vfig.fig_adaptation_timeline(vr.prepare({**doc, "adaptation": rows}))
    assert len(fig.axes) == 9  # 3 rows (bandwidth, level, elapsed) x 3 traces
    assert [ax.get_title() for ax in fig.axes[:3]] == [
        "trace: constant  (context c0)", "trace: step  (context c0)", "trace: artifact  (context c0)"]
    level_legend = _legend_texts(fig.axes[5])  # rightmost panel of the level row
    assert level_legend == ["level sent", "text fallback"]
    np.testing.assert_allclose(fig.axes[5].get_lines()[0].get_ydata(), [1, 0, 3, 1])


def test_incomplete_file_is_marked_in_every_title(doc, tmp_path, monkeypatch):
    titles = []
    real_save = vr.save_figure

    def spy(fig, path, fmt, dpi=150):
        titles.append(fig.get_suptitle())
        real_save(fig, path, fmt, dpi)

    monkeypatch.setattr(vr, "save_figure", spy)
    data = vr.prepare(dict(doc, complete=False))
    assert data.incomplete
    written, _ = vr.render_all(data, tmp_path, ["png"], dpi=30)
    assert written and len(titles) == len(written)
    n = len(doc["runs"])
    assert all(t.startswith(f"{vr.INCOMPLETE_MARK} ({n} runs written)") for t in titles)
    titles.clear()
    vr.render_all(vr.prepare(dict(doc, complete=True)), tmp_path, ["png"], dpi=30)
    assert titles and not any(vr.INCOMPLETE_MARK in t for t in titles)
    assert not vr.prepare({k: v for k, v in doc.items() if k != "complete"}).incomplete


# ----------------------------------------------------------------------------- quality.json beside the results


def _quality_doc():
    """A small quality.json (docs/results-schema.md) for the fixture's modes."""
    def row(codec, level, kl, ci):
        return {"codec": codec, "level": level, "default": level == 1, "ratio_vs_dtype": 8.0,
                "bits_per_element": 2.0, "n_windows": 32, "kl": kl, "kl_ci": ci, "top1_agreement": 0.9,
                "top1_agreement_ci": [0.88, 0.92], "ppl_change_pct": -7.0, "ppl_change_pct_ci": [-9.0, -5.0]}
    return {"kind": "quality", "config": {"n_windows": 32, "context_tokens": 2048, "continuation_tokens": 256},
            "rows": [row("raw", None, 0.0, [0.0, 0.0]), row("quant8", None, 0.0014, [0.0012, 0.0016]),
                     row("cachegen", 1, 0.0429, [0.0397, 0.0465]), row("cachegen", 2, 0.03, [0.027, 0.033]),
                     row("kivi2", None, "odd", [0.1, 0.2])]}


def _errorbar_segments(ax):
    """(x, y_lo, y_hi) of every vertical error bar in ``ax``."""
    out = []
    for coll in ax.collections:
        if type(coll).__name__ != "LineCollection":
            continue
        for seg in coll.get_segments():
            if len(seg) == 2 and np.isclose(seg[0][0], seg[1][0]):
                out.append((float(seg[0][0]), float(min(seg[0][1], seg[1][1])), float(max(seg[0][1], seg[1][1]))))
    return out


def test_quality_vs_size_uses_quality_json_kl_with_ci(doc):
    data = vr.prepare(doc)
    data.quality = _quality_doc()
    fig = vfig.fig_quality_vs_size(data)
    ylabels = [ax.get_ylabel() for ax in fig.axes]
    assert ylabels[0] == vfig.QUALITY_JSON_KL_PANEL[1]
    assert "perplexity increase vs lossless (%)" not in ylabels  # the 2-context ppl panel is replaced
    assert "KL from quality.json (32 WikiText-2 test windows, 95% bootstrap CI)" in fig.get_suptitle()
    kl_ax = fig.axes[0]
    bars = {round(x, 3): (lo, hi) for x, lo, hi in _errorbar_segments(kl_ax)}
    # x: this run's bytes of the mode; y: the quality.json CI of the same codec/level
    assert bars[round(5825422 / 1e6, 3)] == pytest.approx((0.0397, 0.0465))   # cachegen level 1
    assert bars[round(23952243 / 1e6, 3)] == pytest.approx((0.0012, 0.0016))  # quant8
    # kivi2 has a non-numeric KL, cachegen-l3 and adaptive no row: not drawn
    assert len(bars) == 4  # raw, quant8, cachegen 1, cachegen 2
    front = next(line for line in kl_ax.get_lines() if line.get_label() == "Pareto front")
    assert len(front.get_xdata()) >= 2


def test_quality_vs_size_accuracy_has_wilson_bars(data):
    fig = vfig.fig_quality_vs_size(data)
    acc_ax = next(ax for ax in fig.axes if ax.get_ylabel() == "task accuracy (share correct)")
    at = sorted((round(lo, 4), round(hi, 4)) for x, lo, hi in _errorbar_segments(acc_ax)
                if np.isclose(x, 5825422 / 1e6))
    # cachegen level 1: 0.5 at each of 3 rates, n = 2 each -> 3/6 pooled, Wilson [0.1876, 0.8124];
    # cachegen-adaptive at 100 Mbit/s (same size, one point per rate): 1/2, Wilson [0.0945, 0.9055]
    assert at == [(0.0945, 0.9055), (0.1876, 0.8124)]
    # the run's own ppl panel is kept without quality.json, and its title names the number of contexts
    assert fig.axes[0].get_ylabel() == "perplexity increase vs lossless (%)"
    assert "KL from quality.json" not in fig.get_suptitle()


def test_main_reads_quality_json_beside_the_results(doc, tmp_path, capsys, monkeypatch):
    seen = []
    spec = vr.FIGURES["quality_vs_size"]

    def draw(data):
        fig = spec.draw(data)
        seen.append(fig.get_suptitle())
        return fig
    monkeypatch.setitem(vr.FIGURES, "quality_vs_size", vfig.FigureSpec(spec.name, spec.reads, draw))
    res = _write(tmp_path, doc)
    args = ["--results", str(res), "--out", str(tmp_path / "figs"), "--only", "quality_vs_size", "--formats", "svg"]
    assert vr.main(args) == 0
    assert "KL with 95% CIs" not in capsys.readouterr().out
    assert "KL from quality.json" not in seen[-1]
    (tmp_path / "quality.json").write_text(json.dumps(_quality_doc()))
    assert vr.main(args) == 0
    assert f"quality_vs_size: KL with 95% CIs from {tmp_path / 'quality.json'}" in capsys.readouterr().out
    assert "KL from quality.json (32 WikiText-2 test windows" in seen[-1]
    # an unreadable quality.json is a warning, and the figure falls back to the run's own columns
    (tmp_path / "quality.json").write_text("{broken")
    assert vr.main(args) == 0
    assert "warning: ignoring" in capsys.readouterr().err
    assert "KL from quality.json" not in seen[-1] and len(seen) == 3
