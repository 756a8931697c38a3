"""Benchmark orchestration behind ``run_benchmarks.py``, one module per stage.

- ``harness.config``: run configuration (configs/benchmark.yaml + flags);
- ``harness.contexts``: prompts, context KV, store population;
- ``harness.engines``: the HF and vLLM engines and the request protocol they share;
- ``harness.quality``: per-run scores (metric registry) and the perplexity/KL pass;
- ``harness.adaptation``: bandwidth traces, the SLO check, the adaptation experiment;
- ``harness.results``: run records, results.json writing, the console table;
- ``harness.lifecycle``: signals, the run registry, cleanup of killed runs;
- ``harness.run``: ``run()``, the stages wired in order.
Summaries and labels: ``evaluation.summary`` (shared with the figures and the notebook).
"""
