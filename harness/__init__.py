"""Benchmark orchestration behind ``run_benchmarks.py``, one module per stage.

- ``harness.config``: run configuration (configs/benchmark.yaml + flags);
- ``harness.contexts``: prompts, context KV, store population;
- ``harness.engines``: the engines, one module each (package face):
  ``harness.engines.protocol``: the request protocol the engines share;
  ``harness.engines.api``: load outcome, request timings and the Engine face;
- ``harness.engines.hf`` / ``harness.engines.vllm``: the transformers and vLLM engines;
- ``harness.engines.numerics``: the vLLM worker's thread binding, dtype, seed, numerics env;
- ``harness.quality``: per-run scores (metric registry) and the perplexity/KL pass;
- ``harness.adaptation``: bandwidth traces, the SLO check, the adaptation experiment;
- ``harness.results``: run records, results.json writing, the console table;
- ``harness.lifecycle``: signals, the run registry, cleanup of killed runs;
- ``harness.run``: ``run()``, the stages wired in order.
Summaries and labels: ``evaluation.summary`` (shared with the figures and the notebook).
"""
