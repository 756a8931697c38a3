"""Benchmark orchestration behind ``run_benchmarks.py``: run config, engines, results.json.

The entry script wires the stages (extract -> encode -> store + shaped link -> stream +
decode -> inject -> measure); this package holds that wiring so the CLI stays thin.
"""
