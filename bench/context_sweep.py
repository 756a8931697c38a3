"""Cost as the context grows: TTFT of text, quant8, the cachegen default
and the kvtc default level at each context length and link rate, with the bytes moved and
each TTFT part's share, from one ``run_benchmarks.py`` run per context length.

Paper: CacheGen (Liu et al., SIGCOMM 2024) section 7.2 (TTFT as the context grows: prefill
is superlinear in the context while the KV bitstream grows linearly, so the gain of
loading KV over recomputing it grows with the context). Each length is a separate
``run_benchmarks.py`` process (the same harness, engine and shaped link as the main job;
``--no-quality --traces`` with nothing: TTFT only), so a length's runs are side by side.

Run:
    python -m bench.context_sweep --model gemma3-270m                # 2K 4K 8K 16K
    python -m bench.context_sweep --model gemma3-270m --with-32k     # and 32K (slow on a CPU)
    python visualize_results.py --context-sweep benchmarks/context-sweep-gemma3-270m.json

Output (JSON, atomic; docs/results-schema.md "context-sweep"): ``rows``, one per (context
length, mode, level, Mbit/s): n, TTFT median / p25 / p75 (s), bytes moved (median), and
each part's median seconds and median share of TTFT (lookup, transfer, decode, inject,
prefill, first_token; transfer and decode overlap in the pipelined load, so the shares
can sum above 1); ``fits``: least-squares slopes on log-log axes of TTFT against context
tokens per (mode, Mbit/s), and of the TTFT ratio text / cachegen at each rate; ``lengths``:
each length's run (its command, wall seconds, the kvtc calibration hash, load average).
Exit status 2 with one line for bad flags; a length whose run fails is recorded in
``failures`` and the sweep goes on.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from codec.level_table import default_level  # standard library only
from cachegen_common import flags
from cachegen_common.cli import exit_status
from cachegen_common.files import atomic_write_json

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = "gemma3-270m"
DEFAULT_LENGTHS = (2048, 4096, 8192, 16384)
LONG_LENGTH = 32768  # --with-32k
MODES = ("text", "quant8", "cachegen", "kvtc")
PARTS = ("lookup_s", "transfer_s", "decode_s", "inject_s", "prefill_s", "first_token_s")
SCHEMA = "context-sweep/1"


class SweepError(ValueError):
    """Bad flags or an unusable sweep (one line, exit 2)."""


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _quantile(xs: list[float], q: float) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=4, method="inclusive")[0 if q < 0.5 else 2]


def loglog_fit(xs: list[float], ys: list[float]) -> dict[str, Any] | None:
    """Least squares of log(y) = a + b log(x) -> {"slope": b, "intercept": a, "r2", "n"}
    (None with fewer than 2 positive points). A slope of 1 is linear growth in x."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x and y and x > 0 and y > 0]
    if len(pts) < 2:
        return None
    mx = statistics.fmean(p[0] for p in pts)
    my = statistics.fmean(p[1] for p in pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    if sxx == 0:
        return None
    b = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx
    a = my - b * mx
    ss_tot = sum((p[1] - my) ** 2 for p in pts)
    ss_res = sum((p[1] - (a + b * p[0])) ** 2 for p in pts)
    return {"slope": b, "intercept": a, "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0,
            "n": len(pts)}


def rows_from_runs(runs: list[dict], length: int) -> list[dict]:
    """One row per (mode, level, Mbit/s) of one length's results ``runs`` (run_benchmarks
    records): medians of TTFT, bytes and each part, and each part's median share of TTFT."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        if r.get("ttft_s") is None or r.get("load_error"):
            continue
        groups.setdefault((r["mode"], r.get("level"), float(r["bandwidth_mbps"])), []).append(r)
    rows = []
    for (mode, level, bw), rs in sorted(groups.items(), key=lambda kv: (MODES.index(kv[0][0])
                                                                         if kv[0][0] in MODES else 99,
                                                                         kv[0][2])):
        ttft = [r["ttft_s"] for r in rs]
        row: dict[str, Any] = {
            "context_tokens_target": length,
            "context_tokens": int(statistics.median(r["context_tokens"] for r in rs)),
            "mode": mode, "level": level, "bandwidth_mbps": bw, "n": len(rs),
            "ttft_s_median": _median(ttft), "ttft_s_p25": _quantile(ttft, 0.25),
            "ttft_s_p75": _quantile(ttft, 0.75),
            "bytes_median": _median([r.get("bytes") for r in rs]),
            "ratio_vs_dtype": _median([r.get("ratio_vs_dtype") for r in rs]),
            "correct": sum(bool((r.get("quality") or {}).get("correct")) for r in rs),
        }
        for p in PARTS:
            row[f"{p}_median"] = _median([r.get(p) for r in rs])
            row[f"{p}_share"] = _median([(r.get(p) or 0.0) / r["ttft_s"] for r in rs if r["ttft_s"] > 0])
        rows.append(row)
    return rows


def fits(rows: list[dict]) -> dict[str, Any]:
    """Log-log fits of TTFT vs context tokens per (mode, Mbit/s) and of text / cachegen."""
    out: dict[str, Any] = {"ttft": [], "text_over_cachegen": []}
    keys = sorted({(r["mode"], r["level"], r["bandwidth_mbps"]) for r in rows}, key=str)
    for mode, level, bw in keys:
        rs = sorted((r for r in rows if (r["mode"], r["level"], r["bandwidth_mbps"]) == (mode, level, bw)),
                    key=lambda r: r["context_tokens"])
        f = loglog_fit([r["context_tokens"] for r in rs], [r["ttft_s_median"] for r in rs])
        out["ttft"].append({"mode": mode, "level": level, "bandwidth_mbps": bw, "fit": f})
    for bw in sorted({r["bandwidth_mbps"] for r in rows}):
        pts = []
        for length in sorted({r["context_tokens_target"] for r in rows}):
            t = [r for r in rows if r["mode"] == "text" and r["bandwidth_mbps"] == bw
                 and r["context_tokens_target"] == length]
            c = [r for r in rows if r["mode"] == "cachegen" and r["bandwidth_mbps"] == bw
                 and r["context_tokens_target"] == length]
            if t and c and c[0]["ttft_s_median"]:
                pts.append({"context_tokens": t[0]["context_tokens"], "context_tokens_target": length,
                            "ratio": t[0]["ttft_s_median"] / c[0]["ttft_s_median"]})
        out["text_over_cachegen"].append({
            "bandwidth_mbps": bw, "points": pts,
            "fit": loglog_fit([p["context_tokens"] for p in pts], [p["ratio"] for p in pts]),
            "grows": len(pts) >= 2 and all(b["ratio"] > a["ratio"] for a, b in zip(pts, pts[1:]))})
    return out


def _run_length(args, length: int, out: Path) -> tuple[list[dict], dict]:
    """One run_benchmarks.py process for one context length -> (its runs, its record)."""
    cmd = [sys.executable, str(REPO / "run_benchmarks.py"), "--engine", args.engine,
           "--model", args.model, "--modes", *args.modes,
           "--levels", str(default_level("cachegen")), "--kvtc-levels", str(default_level("kvtc")),
           "--bandwidth-mbps", *[f"{b:g}" for b in args.bandwidth_mbps],
           "--context-tokens", str(length), "--num-contexts", str(args.num_contexts),
           "--repeats", str(args.repeats), "--no-quality", "--traces",
           "--link-method", args.link_method, "--seed", str(args.seed),
           "--window-storage", args.window_storage, "--out", str(out)]
    rec: dict[str, Any] = {"context_tokens": length, "command": cmd[1:],
                           "loadavg_start": os.getloadavg()[0]}
    t0 = time.monotonic()
    # the run's console (progress, errors) passes through; its last line is kept for the record
    last = "no output"
    with subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, errors="replace") as proc:
        for line in proc.stderr:
            sys.stderr.write(line)
            if line.strip():
                last = line.strip().split("\r")[-1]
    rec["wall_s"] = round(time.monotonic() - t0, 1)
    rec["loadavg_end"] = os.getloadavg()[0]
    rec["returncode"] = proc.returncode
    if proc.returncode != 0 or not out.is_file():
        rec["error"] = last[:300]
        return [], rec
    doc = json.loads(out.read_text())
    rec["kvtc_calibration"] = (doc.get("kvtc_calibration") or {}).get("hash")
    rec["failures"] = doc.get("failures") or []
    rec["environment"] = doc.get("environment")
    rec["model"] = doc.get("model")
    rec["store_layout"] = doc.get("store_layout")
    return doc.get("runs") or [], rec


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.context_sweep",
                                description="TTFT vs context length: one run_benchmarks.py run per length.")
    flags.add_model(p, default=DEFAULT_MODEL, help="model (default %(default)s)")
    flags.add_context_tokens(p, nargs="+", default=list(DEFAULT_LENGTHS),
                             help="context lengths, tokens (default 2048 4096 8192 16384)")
    p.add_argument("--with-32k", action="store_true", help=f"also {LONG_LENGTH} tokens (minutes of CPU prefill)")
    flags.add_bandwidth(p, default=[100.0, 1000.0], nargs="+", help="link rates, Mbit/s (default 100 1000)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                   help="modes (default: all four; cachegen and kvtc at their default levels)")
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="serving engine (default hf)")
    p.add_argument("--window-storage", choices=("auto", "off"), default="auto",
                   help="store layout (run_benchmarks.py --window-storage): auto = sliding layers keep their "
                        "last window + one block (default), off = every token")
    p.add_argument("--num-contexts", type=int, default=1, help="contexts per length (default 1)")
    flags.add_repeats(p, default=2)
    flags.add_link_method(p)
    flags.add_seed(p)
    flags.add_out(p, type=Path, default=None,
                  help="sweep file (default benchmarks/context-sweep-<model>.json)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> None:
        lengths = sorted(set(args.context_tokens) | ({LONG_LENGTH} if args.with_32k else set()))
        if any(n < 256 for n in lengths):
            raise SweepError(f"--context-tokens must each be >= 256, got {lengths}")
        if args.repeats < 1 or args.num_contexts < 1:
            raise SweepError("--repeats and --num-contexts must be >= 1")
        if "text" not in args.modes:
            raise SweepError("--modes must include text (the ratios are against it)")
        name = Path(str(args.model)).name.removesuffix(".gguf")
        out = args.out or REPO / "benchmarks" / f"context-sweep-{name}.json"
        t0 = time.monotonic()
        rows, records = [], []
        with tempfile.TemporaryDirectory(prefix="cgh-sweep-") as tmp:
            for length in lengths:
                print(f"[sweep] {length} tokens ...", file=sys.stderr, flush=True)
                runs, rec = _run_length(args, length, Path(tmp) / f"{length}.json")
                records.append(rec)
                got = rows_from_runs(runs, length)
                rows.extend(got)
                print(f"[sweep] {length} tokens: {len(got)} rows in {rec['wall_s']} s"
                      + (f"; FAILED: {rec['error']}" if "error" in rec else ""), file=sys.stderr, flush=True)
        if not rows:
            raise SweepError("no length produced a result: " + "; ".join(r.get("error", "") for r in records))
        first = next(r for r in records if "environment" in r)
        doc = {"schema": SCHEMA, "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "command": ["python", "-m", "bench.context_sweep", *(argv if argv is not None else sys.argv[1:])],
               "environment": first["environment"], "model": first["model"],
               "config": {"lengths": lengths, "bandwidth_mbps": args.bandwidth_mbps, "modes": args.modes,
                          "levels": {"cachegen": default_level("cachegen"), "kvtc": default_level("kvtc")},
                          "engine": args.engine, "num_contexts": args.num_contexts,
                          "repeats": args.repeats, "link_method": args.link_method, "seed": args.seed,
                          "window_storage": args.window_storage,
                          "store_layout": first.get("store_layout")},
               "lengths": [{k: v for k, v in r.items() if k not in ("environment", "model")} for r in records],
               "rows": rows, "fits": fits(rows),
               "failures": [r for r in records if "error" in r],
               "wall_s": round(time.monotonic() - t0, 1)}
        atomic_write_json(out, doc)
        print(f"wrote {out}")
        for f in doc["fits"]["text_over_cachegen"]:
            fit = f["fit"]
            print(f"text/cachegen at {f['bandwidth_mbps']:g} Mbit/s: "
                  + ", ".join(f"{p['context_tokens']}: {p['ratio']:.2f}x" for p in f["points"])
                  + (f"; log-log slope {fit['slope']:.2f} (r2 {fit['r2']:.2f})" if fit else ""))

    return exit_status(body, (SweepError, OSError))


if __name__ == "__main__":
    sys.exit(main())
