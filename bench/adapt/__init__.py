"""Bandwidth adaptation judged against an oracle and fixed baselines: ``python -m bench.adapt``.

The command's modules:
- ``bench.adapt.cli``: the command: flags, the run in order, adaptation.json (engine_calibration, main);
- ``bench.adapt.sim``: the level table, quality, trace sets, clock model, policy defaults and the simulated sweep;
- ``bench.adapt.stats``: per-row aggregation, the goals and their paired cluster-bootstrap intervals;
- ``bench.adapt.real``: the adaptive policy on the real shaped link, and the simulated-vs-real check;
- ``bench.adapt.report``: the console report.

This package's face: the names below are importable from ``bench.adapt``.
"""
from bench.adapt.sim import (
    SLO_RESERVE_S, TableManifest, clock_model, load_quality, make_adaptive, rotate,
    simulate_all, start_offsets, trace_sets,
)
from bench.adapt.stats import (
    aggregate, bootstrap_weights, cluster_bootstrap_diff, cluster_bootstrap_goal2, cluster_of,
    goals,
)
from bench.adapt.cli import build_parser, engine_calibration, main
from bench.adapt.real import run_real, sim_vs_real

__all__ = [
    "SLO_RESERVE_S", "TableManifest", "aggregate", "bootstrap_weights", "build_parser",
    "clock_model", "cluster_bootstrap_diff", "cluster_bootstrap_goal2", "cluster_of",
    "engine_calibration", "goals", "load_quality", "main", "make_adaptive", "rotate",
    "run_real", "sim_vs_real", "simulate_all", "start_offsets", "trace_sets",
]
