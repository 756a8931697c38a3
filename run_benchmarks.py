"""The main job: TTFT and quality of every KV-reuse mode over a real shaped link.

For each context (offline prompts of the default task), the KV cache is extracted once,
encoded by every mode's codec into independently decodable chunks and stored in the KV
store server, which sits behind a real rate-limited link (veth + tc tbf in network
namespaces as root, else a userspace token-bucket proxy on loopback). Each request then
loads its prefix KV through the link (decode pipelined with transfer), injects it into the
engine and prefills only the rest. Default modes: text, raw, quant8, kivi2, cachegen
(each level), cachegen-adaptive (CacheGen section 5: per-chunk level from measured
throughput and an SLO, text fallback), kvtc (transform coding, level 4; its default
calibration is fitted on first use and cached); kivi4 and fp8 on request.
Results: benchmarks/results.json (docs/results-schema.md).

Run:
    python run_benchmarks.py                                   # defaults (configs/benchmark.yaml)
    python run_benchmarks.py --bandwidth-mbps 100 500 1000 --engine hf --quick
"""
from __future__ import annotations

import argparse
import sys

from cachegen_common import flags
from kv_extraction_hf.dataflags import DATA_FLAG_DESTS, add_data_flags, data_map_from_args
from kv_extraction_hf.errors import ExtractionError


def build_parser() -> argparse.ArgumentParser:
    """CLI flags; each maps one-to-one onto a field of harness.config.RunConfig."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  python run_benchmarks.py --quick --engine hf\n"
               "  python run_benchmarks.py --bandwidth-mbps 100 1000 --modes text cachegen "
               "--context-tokens 2048\n  python visualize_results.py   # figures from the results")
    flags.add_config(p, help="defaults file, YAML (default: configs/benchmark.yaml)")
    flags.add_bandwidth(p, nargs="+", help="link rates, Mbit/s (default: configs/benchmark.yaml's)")
    p.add_argument("--modes", nargs="+",
                   help="of: text raw quant8 kivi2 kivi4 fp8 cachegen cachegen-adaptive kvtc "
                        "(default: configs/benchmark.yaml's)")
    p.add_argument("--levels", type=int, nargs="+",
                   help="cachegen levels (default: configs/benchmark.yaml's, 0 1 3 5; null there = all)")
    p.add_argument("--kvtc-levels", type=int, nargs="+",
                   help="kvtc levels (default: configs/benchmark.yaml's, 4; --quick: at most "
                        "two of them)")
    p.add_argument("--target", help="a quality target instead of levels: near-lossless (KL <= 0.01 "
                   "nats/token, top-1 >= 0.95), lmcache (KL no worse than LMCache's schedule) or kl:X; "
                   "cachegen and kvtc run at the model's operating point (fitted on first use on the "
                   "calibration text, then cached; excludes --levels / --kvtc-levels; docs/usage.md)")
    p.add_argument("--engine", choices=["vllm", "hf"], help="serving engine (default vllm)")
    p.add_argument("--vllm-hybrid-kv", dest="vllm_hybrid_kv", action="store_const", const=True,
                   help="vLLM: keep its hybrid KV cache manager on (sliding-window layers keep only "
                        "their window; CacheGenHMAConnector, asynchronous loads; default off: "
                        "every layer keeps every token)")
    p.add_argument("--window-storage", choices=["auto", "off"],
                   help="store entries of a sliding-window model keep each sliding layer's last window + one "
                        "KV block only (auto, the default) or every token (off); "
                        "docs/models.md")
    flags.add_model(p)
    p.add_argument("--tasks", nargs="+",
                   help="context tasks (needle, topic_retrieval, longchat_lines; your data: longchat, "
                        "longbench, jsonl with --data-path; docs/tasks.md)")
    flags.add_context_tokens(p, help="tokens per context (default 4096; --quick at most 1024)")
    p.add_argument("--num-contexts", type=int, help="distinct contexts per task")
    flags.add_repeats(p, help="repeats per (mode, bandwidth, context), count (default 2; "
                      "--quick 1)")
    p.add_argument("--slo-s", type=float, help="SLO of the whole KV load, seconds (adaptive mode)")
    p.add_argument("--policy-preset", help="the cachegen-adaptive row's policy parameters: a "
                   "streaming.adapt.params.PolicyParams preset (default tuned: the one benchmarks/README.md's "
                   "adaptation table reports; default = AdaptivePolicy's own defaults; tuned-dip)")
    p.add_argument("--chunk-tokens", type=int, help="tokens per streamed chunk")
    p.add_argument("--block-tokens", type=int,
                   help="engine KV block size (128 on vLLM CPU)")
    p.add_argument("--whole-blocks", dest="whole_blocks", action="store_const", const=True,
                   help="load only whole KV blocks of the context (the engine prefills the partial "
                        "last block; default: the whole context, the connector loads a partial block)")
    p.add_argument("--store", help="KV store backend: a folder (default: temporary), redis (a redis-server "
                   "the run starts behind the link) or redis://HOST:PORT/DB")
    flags.add_link_method(p, default=None, help="link shaping: auto (netns as root, else "
                          "userspace), netns (veth + tc tbf; root), userspace (token-bucket "
                          "proxy on loopback) (default auto)")
    p.add_argument("--no-quality", dest="quality", action="store_const", const=False,
                   help="skip perplexity/KL with the HF engine")
    p.add_argument("--ppl-contexts", type=int, help="natural-text contexts of the perplexity/KL pass")
    p.add_argument("--ppl-context-tokens", type=int, help="tokens per perplexity/KL context")
    p.add_argument("--traces", nargs="*", help="adaptation traces: constant step artifact (none: skip)")
    flags.add_seed(p, default=None, help="seed of the prompt generators (default 0)")
    flags.add_out(p, help="results file (default benchmarks/results.json; with --quick "
                  "benchmarks/results-quick.json, so a smoke run never replaces the committed file)")
    add_data_flags(p)
    flags.add_quick(p, default=None, help="smoke run of a few minutes")
    flags.add_verbose(p, help="keep vLLM's own logs on the console (default: <results>.engine.log)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse flags, run the benchmark, print the summary table; exit 2 on bad input."""
    args = build_parser().parse_args(argv)
    from harness.config import ConfigError, resolve

    overrides = {k: v for k, v in vars(args).items()
                 if k not in ("config", "verbose", *DATA_FLAG_DESTS)}
    try:
        overrides["data_map"] = data_map_from_args(args)
        cfg = resolve(args.config, overrides)
    except (ConfigError, ExtractionError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from harness.contexts import BenchmarkError
    from harness.lifecycle import Terminated, install_signal_handlers
    from harness.run import run

    install_signal_handlers()
    try:
        run(cfg, argv=sys.argv if argv is None else ["run_benchmarks.py", *argv],
            verbose=args.verbose)
    except BenchmarkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Terminated) as exc:
        print(interrupted_message(exc), file=sys.stderr)
        return exc.code if isinstance(exc, Terminated) else 130
    return 0


def interrupted_message(exc: BaseException) -> str:
    """One line saying what an interrupted run left: the results file (marked incomplete)
    with its finished runs, or that no results file was written."""
    what = str(exc) if str(exc) else "interrupted"
    path = getattr(exc, "results_path", None)
    if path is None:
        return f"{what}: no run had finished; no results file was written"
    return (f"{what}: {getattr(exc, 'n_runs', 0)} finished run(s) are in {path} "
            "(marked \"complete\": false)")


if __name__ == "__main__":
    raise SystemExit(main())
