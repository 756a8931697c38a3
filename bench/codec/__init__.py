"""The codec benchmark: size, entropy overhead, speed, reconstruction error and perplexity
cost of every codec / level on real KV caches: ``python -m bench.codec``.

The command's modules:
- ``bench.codec.cli``: the command: flags, the rows in order, the table, codec_bench.json;
- ``bench.codec.contexts``: the KV measured (synthetic, dumps or prefilled prompts) and the
  kvtc calibration;
- ``bench.codec.rows``: one (codec, level) row measured on every context;
- ``bench.codec.peer_row``: LMCache's own serdes measured as rows;
- ``bench.codec.metrics``: median timings, the decode-time split, per-layer error and the
  perplexity / KL / top-1 cost.

This package's face: the names below are importable from ``bench.codec``.
"""
from bench.codec.contexts import QUICK_SHAPE, load_contexts, prepare_kvtc, synthetic_kv
from bench.codec.cli import DEFAULT_ROWS, main, parse_rows, print_table
from bench.codec.rows import run_row

__all__ = [
    "DEFAULT_ROWS", "QUICK_SHAPE", "load_contexts", "main", "parse_rows", "prepare_kvtc",
    "print_table", "run_row", "synthetic_kv",
]
