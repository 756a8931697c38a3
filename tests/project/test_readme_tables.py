"""The results tables are generated from benchmarks/results.json, quality.json and
adaptation.json (scripts/readme_tables.py): the TTFT, quality and adaptation blocks into
benchmarks/README.md (``--tables``), the headline block into the front README.md (``--readme``).

The committed README.md and benchmarks/README.md must match what the committed results files
give (the same check .ci/run makes before the tests); the generator's output is checked on a
small results document built here, and --check fails with a diff on a stale file.

Run: .venv/bin/python -m pytest tests/project/test_readme_tables.py -q
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "readme_tables.py"
sys.path.insert(0, str(ROOT / "scripts"))
import readme_table_cells  # noqa: E402
import readme_tables as rt  # noqa: E402


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, timeout=60)


def _committed_results_root(dest: Path) -> Path | None:
    """A copy of the last commit's benchmarks/**/*.json under dest/benchmarks, or None
    when the checkout is not a git work tree or its READMEs were edited since that
    commit (then the working tree's results are the ones they were generated from)."""
    if _git("rev-parse", "--verify", "-q", "HEAD").returncode != 0:
        return None
    if _git("diff", "--quiet", "HEAD", "--", "README.md", "benchmarks/README.md").returncode != 0:
        return None
    names = _git("ls-tree", "-r", "--name-only", "HEAD", "--", "benchmarks").stdout.decode().split()
    for name in names:
        if name.endswith(".json"):
            out = dest / name
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(_git("show", f"HEAD:{name}").stdout)
    return dest


def test_committed_readme_matches_committed_results(tmp_path):
    """README.md and benchmarks/README.md match the results files they were generated from:
    the last commit's (a user's own `bash scripts/setup.sh run` rewrites
    benchmarks/results.json in the working tree and must not fail the suite), or, when the
    READMEs were regenerated since that commit, the working tree's."""
    root = _committed_results_root(tmp_path)
    if root is None:
        cp = _run("--check")
    else:
        cp = _run("--check", "--root", str(root), "--readme", str(ROOT / "README.md"),
                  "--tables", str(ROOT / "benchmarks" / "README.md"))
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr


def test_a_users_own_run_leaves_the_committed_check_green(tmp_path):
    """The check against a copy of the committed files passes whatever the working tree's
    results hold, and fails when those committed results disagree with the READMEs."""
    root = _committed_results_root(tmp_path / "committed")
    if root is None:
        pytest.skip("not a git checkout, or its READMEs were edited since the last commit")
    args = ("--check", "--root", str(root), "--readme", str(ROOT / "README.md"),
            "--tables", str(ROOT / "benchmarks" / "README.md"))
    assert _run(*args).returncode == 0
    res = root / "benchmarks" / "results.json"
    doc = json.loads(res.read_text())
    doc["runs"] = [dict(r, ttft_s=(r.get("ttft_s") or 0) * 7 + 1) for r in doc.get("runs", [])]
    doc.pop("summaries", None)
    res.write_text(json.dumps(doc))   # what a user's run leaves: other figures than the READMEs show
    cp = _run(*args)
    assert cp.returncode == 1 and "differs from" in cp.stderr


def _run_record(mode, level, bw, ctx, correct, ttft, nbytes, ratio, ppl=None, kl=None, slo=None):
    return {"mode": mode, "level": level, "bandwidth_mbps": bw, "context_id": ctx, "engine": "hf",
            "ttft_s": ttft, "lookup_s": 0.0, "transfer_s": 0.1, "decode_s": 0.2, "inject_s": 0.01,
            "prefill_s": 0.3, "first_token_s": None, "e2e_s": ttft + 1, "output_tokens_per_s": 10.0,
            "bytes": nbytes, "ratio_vs_dtype": ratio, "slo_violated": slo,
            "quality": {"correct": correct, "ppl_increase_pct": ppl, "kl": kl}}


def _doc():
    runs = []
    for bw in (100.0, 1000.0):
        for ctx in ("needle-0", "needle-1"):
            runs.append(_run_record("text", None, bw, ctx, True, 10.0, 0, None))
            runs.append(_run_record("quant8", None, bw, ctx, True, 4.0 if bw == 100 else 1.5, 4_000_000, 2.0,
                                    0.5, 0.002))
            runs.append(_run_record("cachegen", 1, bw, ctx, ctx == "needle-0", 2.0 if bw == 100 else 1.0,
                                    1_000_000, 8.0, 1.0, 0.04))
            runs.append(_run_record("cachegen-adaptive", None, bw, ctx, True, 1.2, 2_000_000 if bw == 100
                                    else 4_000_000, 4.0, slo=bw == 100))
    return {"schema_version": 1, "command": "run_benchmarks.py --quick", "created_utc": "2026-01-02T03:04:05Z",
            "git_commit": "abcdef1234", "environment": {"num_cpus": 4, "cpu": "TestCPU", "gpu": None,
                                                        "link_method": "userspace-tokenbucket",
                                                        "packages": {"vllm": "0.33.0"}},
            "model": {"model_id": "tiny", "dtype": "bfloat16"},
            "config": {"engine": "hf", "tasks": ["needle"], "num_contexts": 2, "context_tokens": 1024,
                       "chunk_tokens": 256, "repeats": 1, "slo_s": 1.5, "ppl_contexts": 2,
                       "ppl_context_tokens": 512},
            "runs": runs, "wall_s": 120.0}


def test_render_values_from_the_runs():
    """No summaries in the file: they come from the runs via evaluation.summary.summarize
    (medians per (mode, level, rate); accuracy = share of correct answers)."""
    out = rt.render(_doc(), source="x.json")
    lines = out.splitlines()
    assert lines[0].startswith("Generated by `python scripts/readme_tables.py` from `x.json`")
    assert "engine hf, tiny bfloat16, 2 needle contexts of 1024 tokens (256-token chunks)" in lines[0]
    assert "4-core TestCPU, no GPU; 16 requests, 2 min wall." in lines[0]
    rows = {ln.split(" | ")[0].lstrip("| "): ln for ln in lines if ln.startswith("| ") and "---" not in ln}
    assert rows["text (prefill)"] == "| text (prefill) | 10.00 | 10.00 | 0 | - | - | - | 2/2, 2/2 | 4/4 [0.51, 1.00] |"
    assert rows["quant8"] == "| quant8 | 4.00 | 1.50 | 4.0 MB | 2.00x | +0.50% | 0.002 | 2/2, 2/2 | 4/4 [0.51, 1.00] |"
    assert rows["cachegen level 1 (default)"] == ("| cachegen level 1 (default) | 2.00 | 1.00 | 1.0 MB | 8.00x | "
                                                  "+1.00% | 0.04 | 1/2, 1/2 | 2/4 [0.15, 0.85] |")
    assert rows["cachegen-adaptive (SLO 1.5 s)"].startswith(
        "| cachegen-adaptive (SLO 1.5 s) | 1.20 | 1.20 | 2.0 MB - 4.0 MB | 4.00x | - | - | 2/2, 2/2 |")
    assert "- TTFT(quant8) / TTFT(cachegen level 1) at 100 Mbit/s = 2.00 (paper: 1.67-1.81x)." in lines
    assert "- TTFT(text) / TTFT(cachegen level 1) at 1000 Mbit/s = 10.00 (paper: 3.1-4.7x)." in lines
    assert "- cachegen-adaptive: SLO (1.5 s) missed in 2/2 at 100, 0/2 at 1000 Mbit/s." in lines
    assert "- Wrong answers per context (all rates and repeats): needle-1: cachegen-l1 2/2." in lines
    # the row order: text, quant8, cachegen levels, adaptive
    labels = list(rows)
    assert labels == ["median TTFT (s)", "text (prefill)", "quant8", "cachegen level 1 (default)",
                      "cachegen-adaptive (SLO 1.5 s)"]


def test_stored_summaries_win_and_incomplete_is_marked():
    doc = _doc()
    doc["summaries"] = [{"mode": "text", "level": None, "bandwidth_mbps": 100.0, "n": 3, "ttft_s_median": 9.0,
                         "bytes_median": 0, "ratio_vs_dtype": None, "accuracy": 2 / 3}]
    doc["complete"] = False
    out = rt.render(doc)
    assert out.startswith("**INCOMPLETE run")
    assert "| text (prefill) | 9.00 | 0 | - | - | - | 2/3 | 2/3 [0.21, 0.94] |" in out


def test_replace_block_and_marker_errors():
    text = f"intro\n{rt.START}\nold\n{rt.END}\noutro\n"
    assert rt.replace_block(text, "new\n") == f"intro\n{rt.START}\nnew\n{rt.END}\noutro\n"
    for bad in ("no markers", f"{rt.END}\n{rt.START}\n", f"{rt.START}{rt.START}{rt.END}"):
        with pytest.raises(rt.ReadmeTableError):
            rt.replace_block(bad, "x\n")


def test_check_fails_with_a_diff_then_rewrite_fixes_it(tmp_path):
    res = tmp_path / "results.json"
    res.write_text(json.dumps(_doc()))
    readme = tmp_path / "README.md"
    readme.write_text(f"# t\n{rt.START}\n| typed by hand | 4/6 |\n{rt.END}\nrest\n{_other_markers()}")
    cp = _run("--check", "--results", str(res), "--tables", str(readme), *_front(tmp_path))
    assert cp.returncode == 1
    assert "-| typed by hand | 4/6 |" in cp.stdout and "+| quant8 | 4.00 |" in cp.stdout
    assert "differs" in cp.stderr
    assert _run("--results", str(res), "--tables", str(readme), *_front(tmp_path)).returncode == 0
    assert _run("--check", "--results", str(res), "--tables", str(readme), *_front(tmp_path)).returncode == 0
    text = readme.read_text()
    assert f"{rt.END}\nrest\n" in text
    # absent quality.json / adaptation.json beside the results: the one-line blocks
    assert f"{rt.QUALITY_START}\n{readme_table_cells.QUALITY_ABSENT}{rt.QUALITY_END}" in text
    assert f"{rt.ADAPT_START}\n{readme_table_cells.ADAPT_ABSENT}{rt.ADAPT_END}" in text


def test_bad_inputs_exit_2_with_one_line(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("no markers\n")
    res = tmp_path / "r.json"
    res.write_text(json.dumps(_doc()))
    for args in (("--results", str(tmp_path / "missing.json")),
                 ("--results", str(res), "--tables", str(readme), *_front(tmp_path))):
        cp = _run("--check", *args)
        assert cp.returncode == 2 and cp.stderr.count("\n") == 1 and cp.stderr.startswith("error:")


def _front(tmp_path) -> tuple[str, str]:
    """A front README with the headline markers (created once per test), as CLI arguments."""
    front = tmp_path / "FRONT.md"
    if not front.exists():
        front.write_text(f"# front\n{rt.HEADLINE_START}\n{rt.HEADLINE_END}\nlinks\n")
    return "--readme", str(front)


def _other_markers() -> str:
    return f"{rt.QUALITY_START}\n{rt.QUALITY_END}\n{rt.ADAPT_START}\n{rt.ADAPT_END}\n"


def _qrow(codec, level, bits, kl, kl_ci, top1, top1_ci, ppl, ppl_ci, default=False, n=32):
    return {"codec": codec, "level": level, "default": default, "ratio_vs_dtype": 16.0 / bits,
            "bits_per_element": bits, "n_windows": n, "kl": kl, "kl_ci": kl_ci, "top1_agreement": top1,
            "top1_agreement_ci": top1_ci, "ppl_change_pct": ppl, "ppl_change_pct_ci": ppl_ci}


def _quality_doc():
    """A small quality.json (docs/results-schema.md, "benchmarks/quality.json"), rows in a
    scrambled order so the sort is exercised."""
    rows = [_qrow("cachegen", 1, 1.91, 0.0429, [0.0397, 0.0465], 0.896, [0.889, 0.903], -7.04, [-9.5, -4.25],
                  default=True),
            _qrow("quant8", None, 8.08, 0.0014, [0.0012, 0.0016], 0.978, [0.975, 0.981], 0.3, [-0.1, 0.7]),
            _qrow("cachegen", 0, 1.56, 0.075, [0.069, 0.081], 0.861, [0.85, 0.87], -16.0, [-19.0, -13.0]),
            _qrow("raw", None, 16.0, 0.0, [0.0, 0.0], 1.0, [1.0, 1.0], 0.0, [0.0, 0.0]),
            _qrow("kivi2", None, 3.42, 0.163, [0.15, 0.177], 0.796, [0.78, 0.81], -28.0, [-31.0, -25.0])]
    tasks = [{"codec": "cachegen", "level": 1, "task": "all", "n": 60, "accuracy": 0.8,
              "accuracy_ci": [0.6856, 0.8817], "agreement": 0.95, "agreement_ci": [0.8625, 0.9829], "default": True,
              "token_agreement": 0.5, "token_agreement_ci": [0.3773, 0.6227]},
             {"codec": "lossless", "level": None, "task": "needle", "n": 30, "accuracy": 0.9,
              "accuracy_ci": [0.7438, 0.9654], "agreement": 1.0, "agreement_ci": [1.0, 1.0]}]
    return {"kind": "quality", "command": "python -m bench.quality --tasks", "created_utc": "2026-11-30T16:00:00+00:00",
            "wall_s": 1200.0, "model": {"id": "tiny", "dtype": "bfloat16"}, "environment": {"cpu_count": 2},
            "data": {"split": "test", "source": "data-path", "location": "/somewhere/wikitext-2/test.txt",
                     "sha256": "d790b833ef8cf03a90db7bf1271b7520b83c45ce", "corpus": "WikiText-2"},
            "config": {"n_windows": 32, "context_tokens": 2048, "continuation_tokens": 256, "seed": 0,
                       "quick": False},
            "tasks_config": {"n_requests": 60, "lengths": [1024, 2048, 3072, 4096], "topic_lengths": [512]},
            "text_info": {"lossless_check": {"max_kl": 0.0, "min_top1": 1.0, "passed": True},
                          "skipped": {"kvtc": "no calibration"}},
            "rows": rows, "tasks": tasks}


def _table_rows(out: str) -> dict[str, str]:
    return {ln.split(" | ")[0].lstrip("| "): ln for ln in out.splitlines() if ln.startswith("| ") and "---" not in ln}


def test_quality_block_cells_order_and_source():
    out = rt.render_quality(_quality_doc(), source="q.json")
    lines = out.splitlines()
    assert lines[0].startswith("Generated by `python scripts/readme_tables.py` from `q.json`")
    # the data source (split, sha256 prefix, never the local path) and the config
    assert "WikiText-2, test split (source data-path, sha256 d790b833ef8c...)" in lines[0]
    assert "32 windows x (2048 context + 256 continuation) tokens, seed 0" in lines[0]
    assert "/somewhere" not in out
    assert any(ln.endswith("exactly): passed; skipped (see the file): `kvtc`.") for ln in lines)
    header = next(ln for ln in lines if ln.startswith("| codec / level | ratio"))
    assert "ppl change [95% CI] (not monotone in distortion)" in header and header.endswith("| n windows |")
    rows = _table_rows(out.split("Task answers")[0])
    assert rows["cachegen level 1 (default)"] == (
        "| cachegen level 1 (default) | 8.38x | 1.910 | 0.0429 [0.0397, 0.0465] | 0.896 [0.889, 0.903] | "
        "-7.0% [-9.5%, -4.2%] | 32 |")
    assert rows["raw"] == "| raw | 1.00x | 16.000 | 0 [0, 0] | 1.000 [1.000, 1.000] | +0.0% [+0.0%, +0.0%] | 32 |"
    assert rows["cachegen level 0"].startswith("| cachegen level 0 | 10.26x | 1.560 | 0.075 [0.069, 0.081] |")
    # families in the README's mode order, then by bits per element (cachegen 0 before 1)
    assert list(rows)[1:] == ["raw", "quant8", "kivi2", "cachegen level 0", "cachegen level 1 (default)"]
    # tasks: lossless first; accuracy always with k/n and its Wilson CI
    lossless = "| lossless | needle | 30 | 27/30 = 0.90 [0.74, 0.97] | 30/30 = 1.00 [1.00, 1.00] | - |"
    default = ("| cachegen level 1 (default) | all | 60 | 48/60 = 0.80 [0.69, 0.88] | 57/60 = 0.95 [0.86, 0.98] "
               "| 30/60 = 0.50 [0.38, 0.62] |")
    assert lossless in lines and default in lines
    assert lines.index(lossless) < lines.index(default)


def test_quality_block_absent_and_without_tasks():
    assert rt.render_quality(None) == readme_table_cells.QUALITY_ABSENT
    assert readme_table_cells.QUALITY_ABSENT.count("\n") == 1 and "python -m bench.quality" in readme_table_cells.QUALITY_ABSENT
    doc = _quality_doc()
    del doc["tasks"]
    doc["rows"][0]["kl_ci"] = None
    out = rt.render_quality(doc)
    assert "Task answers: not yet measured (run `python -m bench.quality`)." in out
    assert "| cachegen level 1 (default) | 8.38x | 1.910 | 0.0429 [no CI] |" in out


def test_ttft_table_uses_quality_json_kl_when_present():
    out = rt.render(_doc(), source="x.json", quality=_quality_doc(), quality_source="q.json")
    assert "from `q.json` (WikiText-2 test windows, 95% bootstrap CI, n windows" in out
    assert "the task accuracy over 60 requests per codec/level is in the quality table." in out
    header = next(ln for ln in out.splitlines() if ln.startswith("| median TTFT"))
    assert "| KL (nats) from quality.json [95% CI] (n windows) |" in header and "ppl change" not in header
    rows = _table_rows(out)
    assert rows["quant8"] == ("| quant8 | 4.00 | 1.50 | 4.0 MB | 2.00x | 0.0014 [0.0012, 0.0016] (n=32) | 2/2, 2/2 | "
                              "4/4 [0.51, 1.00] |")
    assert rows["cachegen level 1 (default)"] == ("| cachegen level 1 (default) | 2.00 | 1.00 | 1.0 MB | 8.00x | "
                                                  "0.0429 [0.0397, 0.0465] (n=32) | 1/2, 1/2 | 2/4 [0.15, 0.85] |")
    # no matching row (text, adaptive): "-"; the separator has one column per header cell
    assert rows["text (prefill)"] == "| text (prefill) | 10.00 | 10.00 | 0 | - | - | 2/2, 2/2 | 4/4 [0.51, 1.00] |"
    sep = next(ln for ln in out.splitlines() if ln.startswith("|---"))
    assert sep.count("|---") == header.count(" | ") + 1
    assert "- KL: mean over 32 WikiText-2 test windows of 2048 + 256 tokens (quality.json)" in out
    # without quality.json: today's columns, labelled with their number of contexts
    plain = rt.render(_doc())
    assert "| ppl change (n=2 contexts) | KL (nats, n=2 contexts) |" in plain
    assert "- ppl change and KL: median over 2 held-out" in plain


def _adapt_doc():
    def row(policy, ts, slo, link, n, v, om, op, kl, regret):
        return {"policy": policy, "trace_set": ts, "slo_s": slo, "link": link, "n": n, "violation_rate": v,
                "overshoot_s_mean": om, "overshoot_s_p95": op, "quality_kl": kl, "regret_vs_oracle": regret}
    return {"schema": "adaptation/1", "command": "python -m bench.adapt", "created_utc": "2026-11-30T14:52:10Z",
            "wall_s": 300.0, "environment": {"num_cpus": 2, "git_commit": "bf9c73b861"},
            "link": {"real": {"method": "netns-tbf", "burst_rule": "10 MTU frames"}, "simulated": {}},
            "config": {"trace_scale": 0.1},
            "sim_vs_real": [{"trace_set": "artifact", "slo_s": 2.0, "policy": "adaptive",
                             "violation_rate_real": 0.3, "violation_rate_sim": 0.2}],
            "rows": [row("fixed-l1", "artifact", 1.0, "simulated", 10, 0.1, 0.03, 0.29, 0.043, 0.01),
                     row("adaptive", "constant", 1.0, "simulated", 3, 0.0, 0.0, 0.0, 0.02, 0.0),
                     row("adaptive", "artifact", 1.0, "simulated", 10, 0.4, 0.114, 0.482, 0.05, 0.0123),
                     row("oracle", "artifact", 1.0, "simulated", 10, 0.1, 0.01, 0.12, 0.04, 0.0),
                     row("adaptive", "artifact", 1.0, "real", 10, 0.3, 0.15, 0.78, None, None)]}


def test_adaptation_block_rows_and_absent_line():
    assert rt.render_adaptation(None) == readme_table_cells.ADAPT_ABSENT
    assert readme_table_cells.ADAPT_ABSENT.count("\n") == 1 and "python -m bench.adapt" in readme_table_cells.ADAPT_ABSENT
    out = rt.render_adaptation(_adapt_doc(), source="a.json")
    lines = out.splitlines()
    assert lines[0].startswith("Generated by `python scripts/readme_tables.py` from `a.json`: `python -m bench.adapt`")
    assert "(`netns-tbf`, burst 10 MTU frames)" in lines[0] and "(KL points)." in lines[0]
    assert "artifact adaptive SLO 2.0 s: violations real 30%, simulated 20%" in out
    art = lines[lines.index("Trace set `artifact` (loads per row: 10 simulated, 10 real):"):lines.index("<details>")]
    body = [ln for ln in art if ln.startswith("| 1 |")]
    assert body == ["| 1 | real | adaptive | 3/10 | 0.15 | 0.78 | - | - |",
                    "| 1 | simulated | oracle | 1/10 | 0.01 | 0.12 | 0.04 | 0.000 |",
                    "| 1 | simulated | adaptive | 4/10 | 0.11 | 0.48 | 0.05 | 0.012 |",
                    "| 1 | simulated | fixed-l1 | 1/10 | 0.03 | 0.29 | 0.043 | 0.010 |"]
    # the other trace sets are folded; artifact comes first
    assert "<summary>Trace set `constant` (loads per row: 3 simulated)</summary>" in out
    assert "Goals (simulated link" not in out          # no goals in the file: no goals table
    assert out.index("Trace set `artifact`") < out.index("Trace set `constant`")
    doc = _adapt_doc()
    for r in doc["rows"]:
        r["quality_kl"] = None
    out = rt.render_adaptation(doc)
    assert "regret is in ordinal level units" in out and "quality KL |" not in out
    assert "| 1 | simulated | oracle | 1/10 | 0.01 | 0.12 | 0.000 |" in out


def test_adaptation_goals_table_with_intervals():
    # the two adaptation goals as bench.adapt wrote them: artifact first, then the held-out set, per
    # SLO; point verdict with the interval's; sets other than those two and the real link left out
    doc = _adapt_doc()
    g = {"link": "simulated", "slo_s": 0.5, "n": 100, "g1_slo": True, "g1_ci": "met", "best_fixed": "fixed-l2",
         "violation_diff_vs_oracle": 0.0, "violation_diff_vs_oracle_ci95": [0.0, 0.0],
         "kl_met_diff_vs_best_fixed": 0.0348, "kl_met_diff_vs_best_fixed_ci95": [0.0332, 0.0535],
         "g2_quality": False, "g2_ci": "missed"}
    doc["goals"] = [dict(g, trace_set="artifact-generator", n_traces=100, best_fixed="fixed-l0", g2_quality=True,
                         g2_ci="met", kl_met_diff_vs_best_fixed=-0.0045,
                         kl_met_diff_vs_best_fixed_ci95=[-0.0057, -0.0035]),
                    dict(g, trace_set="artifact", n_traces=10),
                    dict(g, trace_set="synthetic", n_traces=40),
                    {"trace_set": "artifact", "link": "real", "slo_s": 2.0, "n": 20, "n_traces": 10}]
    rows = [ln for ln in rt.render_adaptation(doc).splitlines() if ln.startswith("| 0.5 | artifact")]
    assert rows == ["| 0.5 | artifact | 100 (10) | +0 [+0, +0] | met (interval: met) | fixed-l2 | "
                    "+0.0348 [+0.0332, +0.0535] | **missed** (interval: missed) |",
                    "| 0.5 | artifact-generator | 100 (100) | +0 [+0, +0] | met (interval: met) | fixed-l0 | "
                    "-0.0045 [-0.0057, -0.0035] | met (interval: met) |"]


def test_check_covers_every_block(tmp_path):
    """A drift in the quality or adaptation block alone fails --check; a rewrite fixes it;
    a README without the new markers is a one-line error."""
    res = tmp_path / "results.json"
    res.write_text(json.dumps(_doc()))
    (tmp_path / "quality.json").write_text(json.dumps(_quality_doc()))
    (tmp_path / "adaptation.json").write_text(json.dumps(_adapt_doc()))
    readme = tmp_path / "README.md"
    readme.write_text(f"# t\n{rt.START}\n{rt.END}\n{_other_markers()}")
    args = ("--results", str(res), "--tables", str(readme), *_front(tmp_path))
    assert _run(*args).returncode == 0
    good = readme.read_text()
    assert "0.0429 [0.0397, 0.0465] (n=32)" in good  # the TTFT table reads quality.json beside results.json
    assert "| cachegen level 1 (default) | 8.38x |" in good and "| 1 | real | adaptive | 3/10 |" in good
    assert _run("--check", *args).returncode == 0
    for old, new in (("| 8.38x |", "| 8.40x |"), ("| 1 | real | adaptive | 3/10 |", "| 1 | real | adaptive | 2/10 |")):
        assert good.count(old) == 1
        readme.write_text(good.replace(old, new))
        cp = _run("--check", *args)
        assert cp.returncode == 1
        minus = [ln for ln in cp.stdout.splitlines() if ln.startswith("-|")]
        plus = [ln for ln in cp.stdout.splitlines() if ln.startswith("+|")]
        assert len(minus) == len(plus) == 1 and new in minus[0] and old in plus[0]
    # the quality file disappears: --check reports the stale block
    (tmp_path / "quality.json").unlink()
    readme.write_text(good)
    cp = _run("--check", *args)
    assert cp.returncode == 1 and f"+{readme_table_cells.QUALITY_ABSENT.strip()}" in cp.stdout
    # an explicit --quality path wins over the file beside --results
    q2 = tmp_path / "q2.json"
    q2.write_text(json.dumps(_quality_doc()))
    assert _run("--quality", str(q2), *args).returncode == 0
    assert "| cachegen level 1 (default) | 8.38x |" in readme.read_text()
    assert _run("--check", "--quality", str(q2), *args).returncode == 0
    readme.write_text(f"# t\n{rt.START}\n{rt.END}\n")
    cp = _run("--check", *args)
    assert cp.returncode == 2 and cp.stderr.count("\n") == 1 and "quality-table:start" in cp.stderr


def test_bad_quality_file_exit_2(tmp_path):
    res = tmp_path / "results.json"
    res.write_text(json.dumps(_doc()))
    (tmp_path / "quality.json").write_text("{not json")
    readme = tmp_path / "README.md"
    readme.write_text(f"{rt.START}\n{rt.END}\n{_other_markers()}")
    cp = _run("--check", "--results", str(res), "--tables", str(readme), *_front(tmp_path))
    assert cp.returncode == 2 and cp.stderr.count("\n") == 1 and "quality.json" in cp.stderr


def test_summaries_tables_and_figures_show_failures(tmp_path):
    # failures recorded in results.json reach the summary rows, the console
    # table, the README table generator and the figures
    from evaluation.summary import summarize
    from harness.results import summary_table

    runs = [dict(mode=m, level=lv, bandwidth_mbps=100.0, ttft_s=t, bytes=b, quality={},
                 load_error=err)
            for m, lv, t, b, err in (("text", None, 1.0, 0, None), ("raw", None, 0.5, 1000, None),
                                     ("kvtc", 4, 0.4, 100, "chunk 0: CodecError: bad"))]
    failures = [{"stage": "perplexity", "mode": "kvtc", "level": 4, "label": "kvtc-l4",
                 "reason": "CodecError: kvtc: decoded KV contains NaN/inf"},
                {"stage": "encode", "mode": "kvtc", "level": 5, "label": "kvtc-l5",
                 "reason": "ValueError: no calibration"}]
    rows = {(s["mode"], s["level"]): s for s in summarize(runs, failures, [100.0])}
    assert rows[("kvtc", 4)]["failed"] == "perplexity: CodecError: kvtc: decoded KV contains NaN/inf"
    assert rows[("kvtc", 4)]["load_errors"] == 1 and rows[("raw", None)]["load_errors"] == 0
    assert rows[("kvtc", 5)]["n"] == 0 and rows[("kvtc", 5)]["failed"].startswith("encode: ")
    assert "failed" not in rows[("raw", None)]
    doc = {"runs": runs, "failures": failures, "summaries": list(rows.values()),
           "config": {"bandwidth_mbps": [100.0]}, "model": {}, "environment": {}}
    table = summary_table(doc)
    assert "failed: perplexity: CodecError" in table and "failed: encode: ValueError" in table
    md = rt.render(doc)
    assert "kvtc-l5: failed: encode: ValueError: no calibration" in md
    assert "kvtc-l4: failed: perplexity" in md
    import visualize_results as vr

    data = vr.prepare(doc)
    assert data.failed == ["kvtc-l4: perplexity: CodecError: kvtc: decoded KV contains NaN/inf",
                           "kvtc-l5: encode: ValueError: no calibration"]
    written, skipped = vr.render_all(data, tmp_path, ["png"])
    assert written       # the figures draw from a file with failures (a red FAILED note)


def test_committed_readme_is_a_front_door():
    # <= 150 lines, one generated headline block, the big blocks in benchmarks/README.md
    readme = (ROOT / "README.md").read_text()
    tables = (ROOT / "benchmarks" / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert readme.count(rt.HEADLINE_START) == 1 and tables.count(rt.HEADLINE_START) == 0
    for marker in (rt.START, rt.QUALITY_START, rt.ADAPT_START):
        assert readme.count(marker) == 0 and tables.count(marker) == 1
    assert "bash scripts/setup.sh run" in readme and "bash scripts/setup.sh test" in readme


def test_headline_rows_and_cells():
    doc = _doc()
    doc["environment"]["numerics"] = {"matmul": "whatever a newer file records"}  # ignored
    out = rt.render_headline(doc, _quality_doc(), tables="benchmarks/README.md", source="x.json",
                             quality_source="q.json")
    assert out.startswith("Generated by `python scripts/readme_tables.py` from `x.json` (2026-01-02, git abcdef1)"
                          " and `q.json`; tiny bfloat16, CPU run;")
    assert "[benchmarks/README.md](benchmarks/README.md)" in out
    rows = _table_rows(out)
    assert list(rows) == ["mode", "text (prefill)", "quant8", "cachegen level 1 (default)"]  # no kvtc in the grid
    assert rows["mode"] == ("| mode | median TTFT at 100 Mbit/s (s) | median TTFT at 1000 Mbit/s (s) | "
                            "ratio vs bfloat16 | KL (nats/token) [95% CI] (n windows) |")
    assert rows["text (prefill)"] == "| text (prefill) | 10.00 | 10.00 | - | - |"
    assert rows["quant8"] == "| quant8 | 4.00 | 1.50 | 2.00x | 0.0014 [0.0012, 0.0016] (n=32) |"
    assert rows["cachegen level 1 (default)"] == \
        "| cachegen level 1 (default) | 2.00 | 1.00 | 8.00x | 0.0429 [0.0397, 0.0465] (n=32) |"
    bare = rt.render_headline(doc, None)
    assert "no quality.json" in bare and "| quant8 | 4.00 | 1.50 | 2.00x | - |" in bare


def test_headline_default_level_is_the_runs_default_operating_point():
    """A run that recorded its default operating point (results.json operating_points, role
    "default") marks that level "(default)" and names the point; other roles do not."""
    doc = _doc()
    doc["runs"] += [dict(r, level=3, label="cachegen-l3") for r in doc["runs"] if r["mode"] == "cachegen"]
    point = {"codec": "cachegen", "level": 3, "target": "lmcache", "hash": "c" * 64, "table": "d" * 64}
    doc["operating_points"] = {"target": "lmcache", "role": "default", "table": "d" * 64, "points": [point]}
    out = rt.render_headline(doc)
    assert "cachegen level 3 (default)" in _table_rows(out) and "cachegen level 1 (default)" not in out
    assert "Default level: cachegen 3, the model's `lmcache` operating point (point cccccccccccc, " \
           "table dddddddddddd)." in out
    assert readme_table_cells.mode_default_level("cachegen", doc) == 3
    doc["operating_points"]["role"] = "target"
    assert readme_table_cells.mode_default_level("cachegen", doc) == 1 and "Default level" not in rt.render_headline(doc)


def test_headline_failed_row_and_check(tmp_path):
    # a kvtc that failed to encode (results.json `failures`) shows "failed"; --check covers the front README
    doc = _doc()
    doc["failures"] = [{"stage": "encode", "mode": "kvtc", "level": 4, "label": "kvtc-l4",
                        "reason": "ValueError: no calibration"}]
    doc["config"]["bandwidth_mbps"] = [100.0, 1000.0]
    assert "| kvtc level 4 (default) | failed | failed | - | - |" in rt.render_headline(doc)
    res = tmp_path / "results.json"
    res.write_text(json.dumps(doc))
    tables = tmp_path / "T.md"
    tables.write_text(f"{rt.START}\n{rt.END}\n{_other_markers()}")
    args = ("--results", str(res), "--tables", str(tables), *_front(tmp_path))
    assert _run(*args).returncode == 0 and _run("--check", *args).returncode == 0
    front = tmp_path / "FRONT.md"
    good = front.read_text()
    assert "| quant8 | 4.00 | 1.50 | 2.00x | - |" in good and good.endswith(f"{rt.HEADLINE_END}\nlinks\n")
    front.write_text(good.replace("| 4.00 | 1.50 |", "| 4.00 | 1.40 |"))
    cp = _run("--check", *args)
    assert cp.returncode == 1 and "+| quant8 | 4.00 | 1.50 |" in cp.stdout and "FRONT.md" in cp.stderr
    front.write_text("# no markers\n")
    cp = _run("--check", *args)
    assert cp.returncode == 2 and cp.stderr.count("\n") == 1 and "headline-table:start" in cp.stderr


def test_the_repositorys_readmes_hold_the_per_model_blocks():
    """README.md shows every model's quality (models-table) and benchmarks/README.md each
    other model's full quality table; their markers are there exactly once."""
    import readme_models_table as M

    front = (ROOT / "README.md").read_text()
    tables = (ROOT / "benchmarks" / "README.md").read_text()
    assert front.count(M.MODELS_START) == 1 and front.count(M.MODELS_END) == 1
    for name in M.OTHER_MODELS:
        assert tables.count(f"<!-- quality-{name}-table:start -->") == 1
        assert tables.count(f"<!-- quality-{name}-table:end -->") == 1
    import readme_suite_table as S
    for name in S.SUITE_MODELS:
        assert all(tables.count(m) == 1 for m in S.suite_markers(name))


def test_models_block_rows_and_a_missing_file():
    import readme_models_table as M

    doc = {"model": {"id": "m", "num_layers": 2, "dtype": "bfloat16"},
           "rows": [{"codec": "cachegen", "level": 1, "ratio_vs_dtype": 8.0, "kl": 0.04, "kl_ci": [0.03, 0.05],
                     "top1_agreement": 0.9, "top1_agreement_ci": [0.88, 0.92], "n_windows": 32}]}
    text = M.render_models([("a.json", doc), ("b.json", None)])
    assert "| m (2 layers, bfloat16) | cachegen 1 | 8.00x | 0.04 [0.03, 0.05] | 90.0% [88.0%, 92.0%] | 32 |" in text
    assert "| `b.json` | not yet measured |" in text


def test_other_models_run_fills_its_headline_and_results_blocks(tmp_path):
    """An other model's TTFT run (benchmarks/results-<name>.json) fills the blocks whose markers
    are in the READMEs: its headline in the front README, its full table in the tables file;
    without the file both say "not yet measured"."""
    import readme_models_table as M

    name = M.OTHER_MODELS[-1]
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    (bench / "results.json").write_text(json.dumps(_doc()))
    h_start, h_end = M.model_markers("headline", name)
    r_start, r_end = M.model_markers("results", name)
    front = tmp_path / "FRONT.md"
    front.write_text(f"# front\n{rt.HEADLINE_START}\n{rt.HEADLINE_END}\n{h_start}\n{h_end}\n")
    tables = tmp_path / "T.md"
    tables.write_text(f"{rt.START}\n{rt.END}\n{_other_markers()}{r_start}\n{r_end}\n")
    args = ("--root", str(tmp_path), "--results", str(bench / "results.json"), "--tables", str(tables),
            "--readme", str(front))
    assert _run(*args).returncode == 0
    assert f"`benchmarks/results-{name}.json`: not yet measured." in front.read_text()
    assert f"`benchmarks/results-{name}.json`: not yet measured." in tables.read_text()
    other = _doc()
    other["runs"] = [dict(r, ttft_s=r["ttft_s"] * 2) for r in other["runs"]]
    (bench / f"results-{name}.json").write_text(json.dumps(other))
    assert _run("--check", *args).returncode == 1          # the blocks are stale now
    assert _run(*args).returncode == 0 and _run("--check", *args).returncode == 0
    mine = front.read_text().split(h_start)[1]
    assert f"from `benchmarks/results-{name}.json`" in mine and "| text (prefill) | 20.00 | 20.00 | - | - |" in mine
    assert "| text (prefill) | 10.00 | 10.00 | - | - |" in front.read_text().split(h_start)[0]
    assert "| text (prefill) | 20.00 | 20.00 |" in tables.read_text().split(r_start)[1]


def test_answer_suite_block():
    """The suite block: rows of bench.answer_suite.suite_rows rendered with k/n, Wilson CIs and
    McNemar; per-length groups only with several lengths; a missing file is one line."""
    import readme_suite_table as S
    from bench.answer_suite import suite_rows

    def rec(kind, length, ref, got, agrees):
        return {"kind": kind, "length": length, "lossless": {"correct": ref},
                "codecs": {"cachegen 1": {"correct": got, "agrees": agrees, "token_agrees": agrees}}}
    recs = [rec("single", 1024, True, True, True)] * 8 + [rec("single", 1024, True, False, False)] * 2 \
        + [rec("multikey", 1024, False, True, False)]
    doc = {"command": "python -m bench.answer_suite --x", "model": {"id": "m", "dtype": "bfloat16",
           "answer_dtype": "torch.float32"}, "config": {"kinds": ["single", "multikey"], "lengths": [1024],
           "contexts": 5, "haystack": "offline"}, "environment": {"cpu_count": 2}, "wall_s": 600,
           "rows": suite_rows(recs, ["cachegen 1"])}
    out = S.render_suite(doc, "benchmarks/answer-suite-m.json")
    assert "(answers in float32)" in out and "10 min wall" in out and "length=" not in out
    rows = [line for line in out.splitlines() if line.startswith("| all |")]
    assert rows[0].startswith("| all | lossless | 11 | 10/11 = 0.909 [")
    assert rows[1].startswith("| all | cachegen 1 | 11 | 9/11 = 0.818 [") and "| 8/11 = 0.727 [" in rows[1]
    assert rows[1].endswith("| 2 / 1, p = 1 |")
    doc["config"]["lengths"] = [1024, 2048]
    assert "| length=1024 | cachegen 1 | 11 |" in S.render_suite(doc, "x.json")
    assert S.render_suite(None, "x.json").count("\n") == 1 and "Not yet measured" in S.render_suite(None, "x.json")
    doc["partial"] = {"contexts_measured": 3, "contexts": 10}
    assert S.render_suite(doc, "x.json").startswith("**PARTIAL**: 3 of 10 contexts measured")
    assert "min wall" not in S.render_suite(doc, "x.json")
    assert "LongChat" not in S.render_suite(doc, "x.json")
    doc["config"]["longchat"] = {"path": "longchat.jsonl", "rows": 50, "truncated": 0}
    assert "Plus 50 LongChat rows of the CacheGen artifact at full length" in S.render_suite(doc, "x.json")
    assert "--rescore" not in S.render_suite(doc, "x.json")
    doc["rescored"] = {"utc": "2026-12-07T18:00:00Z", "changed": 23}
    assert "scored again by `--rescore` (2026-12-07T18:00:00Z, 23 verdicts changed" in S.render_suite(doc, "x.json")
