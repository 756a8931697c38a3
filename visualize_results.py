"""Draw the benchmark figures from a results.json (and nothing else).

Purpose: turn the records written by ``run_benchmarks.py`` (docs/results-schema.md) into
the figures of a CacheGen-style evaluation (Liu et al., SIGCOMM 2024, sections 5-7): TTFT vs link bandwidth per mode, KV size and compression
ratio, the quality/size trade-off with its Pareto front, the TTFT breakdown into
lookup/transfer/decode/inject/prefill, the per-layer reconstruction error of the codec
(the paper's layer-wise quantization, section 5.2) and the per-chunk adaptation
timeline (streaming adaptation: bandwidth, level chosen or text fallback, SLO).

It reads only the results file: it imports no codec, streaming, engine or model code
(only ``evaluation.summary``, the summary and label rules run_benchmarks.py writes with).
The figure code is in the ``visualize`` package (loading and helpers in ``visualize.data``,
results.json figures in ``visualize.results_figures``, quality.json and adaptation.json
figures in ``visualize.file_figures``); this script is the CLI (import the figure functions
from their modules).
A file an interrupted run left (``"complete": false``) is drawn with "INCOMPLETE" in
every figure's title. Figures
whose data is missing are skipped and named; a file that is not a JSON object is an error
(one line on stderr, exit status 2). Each figure is written as PNG and SVG, atomically.

Run:
    python visualize_results.py                                    # benchmarks/results.json -> benchmarks/
    python visualize_results.py --results runs/r.json --out figs/ --formats png
    python visualize_results.py --only ttft_vs_bandwidth kv_size
    python visualize_results.py --context-sweep benchmarks/context-sweep-gemma3-270m.json
    python visualize_results.py --serve-load        # benchmarks/serve_load*.json -> goodput_vs_rate

Exit status: 0 when at least one figure was written, 1 when none could be drawn,
2 for a missing, unreadable or malformed results file or bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from cachegen_common import flags  # stdlib only: the shared flag spellings

from visualize.data import DEFAULT_OUT, DEFAULT_RESULTS, ResultsData, prepare, save_figure
from visualize.results_figures import FIGURES
from visualize.adapt_figures import DEFAULT_ADAPTATION
from visualize.file_figures import DEFAULT_QUALITY, render_adaptation, render_quality
from visualize.sweep_figures import render_context_sweep
from visualize.serve_figures import DEFAULT_SERVE_LOAD_GLOB, render_serve_load
from visualize.loading import ResultsError, SkipFigure, load_results, schema_warnings

INCOMPLETE_MARK = "INCOMPLETE RUN"
# the command lines of --help's examples (after "python visualize_results.py")
EXAMPLE_ARGS = ("", " --results runs/r.json --out figs/ --formats png", " --only ttft_vs_bandwidth kv_size")


def mark_incomplete(fig, data: ResultsData) -> None:
    """Prefix the figure's title with "INCOMPLETE RUN (n runs)": the file was left by an
    interrupted run (``"complete": false``), so its figures lack the runs never made."""
    title = fig.get_suptitle()
    n = len(data.doc.get("runs") or []) if isinstance(data.doc.get("runs"), list) else 0
    mark = f"{INCOMPLETE_MARK} ({n} runs written)"
    fig.suptitle(f"{mark}: {title}" if title else mark, color="firebrick")


FAILED_MARK = "FAILED"


def mark_failed(fig, data: ResultsData) -> None:
    """A red footnote "FAILED: <label>: <stage>: <reason>; ..." on the figure: the file's
    ``failures`` (the run went on without those codecs/requests, so they are missing or
    partial in the figure)."""
    lines = data.failed
    if not lines:
        return
    shown = lines[:3] + ([f"+{len(lines) - 3} more"] if len(lines) > 3 else [])
    fig.text(0.01, 0.005, f"{FAILED_MARK}: " + "; ".join(shown), color="firebrick",
             fontsize=7, ha="left", va="bottom", wrap=True)


def render_all(data: ResultsData, out_dir: Path, formats: Sequence[str], only: Sequence[str] | None = None,
               dpi: int = 150) -> tuple[list[Path], list[tuple[str, str]]]:
    """Draw every figure (or those in ``only``) and write it in each format.

    Returns:
        (written paths, [(figure name, reason skipped)]).
    """
    written: list[Path] = []
    skipped: list[tuple[str, str]] = []
    for name, spec in FIGURES.items():
        if only and name not in only:
            continue
        try:
            fig = spec.draw(data)
        except SkipFigure as exc:
            skipped.append((name, str(exc)))
            continue
        except (KeyError, ValueError, TypeError, IndexError) as exc:  # odd values in an odd file
            skipped.append((name, f"could not draw from this file ({type(exc).__name__}: {exc})"))
            continue
        if data.incomplete:
            mark_incomplete(fig, data)
        mark_failed(fig, data)
        for fmt in formats:
            path = out_dir / f"{name}.{fmt}"
            save_figure(fig, path, fmt, dpi=dpi)
            written.append(path)
    return written, skipped


def build_parser() -> argparse.ArgumentParser:
    examples = "".join(f"  python visualize_results.py{args}\n" for args in EXAMPLE_ARGS)
    parser = argparse.ArgumentParser(description="Draw the benchmark figures (PNG and SVG) from a results.json.",
                                     epilog=f"examples:\n{examples}figures: {', '.join(FIGURES)}",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS,
                        help="results file written by run_benchmarks.py (default: %(default)s)")
    flags.add_out(parser, type=Path, default=DEFAULT_OUT,
                  help="folder for the figures, created if needed (default: %(default)s)")
    parser.add_argument("--formats", nargs="+", default=["png", "svg"], choices=["png", "svg", "pdf"],
                        help="image formats to write (default: png svg)")
    parser.add_argument("--only", nargs="+", choices=list(FIGURES), metavar="FIGURE",
                        help=f"draw only these figures ({', '.join(FIGURES)})")
    parser.add_argument("--dpi", type=int, default=150, help="PNG resolution (default: %(default)s)")
    parser.add_argument("--quality", type=Path, nargs="?", const=DEFAULT_QUALITY, default=None,
                        help="draw only quality_divergence from a quality.json of python -m bench.quality "
                             f"(default file: {DEFAULT_QUALITY})")
    parser.add_argument("--adaptation", type=Path, nargs="?", const=DEFAULT_ADAPTATION, default=None,
                        help="draw only the adaptation figures from an adaptation.json of python -m bench.adapt "
                             f"(default file: {DEFAULT_ADAPTATION})")
    parser.add_argument("--context-sweep", type=Path, default=None, metavar="FILE",
                        help="draw only ttft_vs_context from a context-sweep file of python -m bench.context_sweep")
    parser.add_argument("--serve-load", type=Path, nargs="*", default=None, metavar="FILE",
                        help="draw only goodput_vs_rate from serve-load files of python -m bench.serve_load "
                             f"(none named: {DEFAULT_OUT}/{DEFAULT_SERVE_LOAD_GLOB})")
    return parser


def _render_one_file(render, path, args) -> int:
    """Run one file's renderer (render_adaptation / render_quality) for the CLI: prints
    each written path; returns 0, 1 (nothing drawn) or 2 (bad input)."""
    try:
        for out in render(path, args.out, args.formats, args.dpi):
            print(f"wrote {out}")
    except ResultsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except SkipFigure as exc:
        print(f"nothing drawn: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 1 nothing drawn, 2 bad input)."""
    args = build_parser().parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")  # no display needed; set here, not at import time
    if args.adaptation is not None:
        return _render_one_file(render_adaptation, args.adaptation, args)
    if args.serve_load is not None:
        paths = args.serve_load or sorted(DEFAULT_OUT.glob(DEFAULT_SERVE_LOAD_GLOB))
        return _render_one_file(render_serve_load, paths, args)
    if args.context_sweep is not None:
        return _render_one_file(render_context_sweep, args.context_sweep, args)
    if args.quality is not None:
        if args.out.exists() and not args.out.is_dir():
            print(f"error: --out {args.out} exists and is not a folder", file=sys.stderr)
            return 2
        return _render_one_file(render_quality, args.quality, args)
    try:
        doc = load_results(args.results)
    except ResultsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.out.exists() and not args.out.is_dir():
        print(f"error: --out {args.out} exists and is not a folder", file=sys.stderr)
        return 2
    if args.dpi <= 0:
        print(f"error: --dpi must be positive, got {args.dpi}", file=sys.stderr)
        return 2
    for msg in schema_warnings(doc):
        print(f"warning: {msg}", file=sys.stderr)
    data = prepare(doc)
    qpath = Path(args.results).parent / "quality.json"  # bench.quality's file beside the results
    if qpath.is_file():
        try:
            qdoc = json.loads(qpath.read_text())
            data.quality = qdoc if isinstance(qdoc, dict) else None
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            print(f"warning: ignoring {qpath}: {exc}", file=sys.stderr)
        if data.quality is not None:
            print(f"quality_vs_size: KL with 95% CIs from {qpath}")
    for msg in data.notes:
        print(f"warning: {msg}", file=sys.stderr)
    try:
        written, skipped = render_all(data, args.out, args.formats, args.only, args.dpi)
    except OSError as exc:
        print(f"error: cannot write figures to {args.out}: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    for name, reason in skipped:
        print(f"skipped {name}: {reason}")
    if not written:
        print(f"error: no figure could be drawn from {args.results}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
