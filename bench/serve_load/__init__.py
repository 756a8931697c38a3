"""Goodput under load through vLLM's own benchmark client: ``python -m bench.serve_load``.

The command's modules:
- ``bench.serve_load.cli``: the command: flags, the run (link, store, server, pre-fill,
  one client run per (mode, rate)), the table and serve_load.json;
- ``bench.serve_load.dataset``: the contexts (the project's prompt sources), which are
  reused (their KV pre-filled in the store) and which are new, the request plan and the
  custom-dataset JSONL file vLLM's client reads;
- ``bench.serve_load.server``: vLLM's OpenAI server with our KV connector (start, health,
  stop) and the pre-fill (save requests);
- ``bench.serve_load.client``: ``vllm.benchmarks.serve`` in a subprocess, its result file;
- ``bench.serve_load.level_merge``: the adaptive mode's store entries (the connector's
  single-level saves of a context joined into one entry of every level);
- ``bench.serve_load.stats``: TTFT percentiles, throughput and goodput of one run, and the
  tail check (p99 <= 2 x p50 TTFT at half the saturation rate).

This package's face: ``main``.
"""
from bench.serve_load.cli import main

__all__ = ["main"]
