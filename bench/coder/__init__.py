"""Msym/s of the CPU rANS coder and of the entropy stage: ``python -m bench.coder rans|entropy``.

The command's modules:
- ``bench.coder.cli``: the command: its two sub-commands (entropy_bench here, main);
- ``bench.coder.rans``: the numba rANS coder encode/decode (rans_bench);
- ``bench.coder.constriction``: the same symbols through constriction, for comparison.

This package's face: the names below are importable from ``bench.coder``.
"""
from bench.coder.cli import entropy_bench, main
from bench.coder.rans import rans_bench

__all__ = [
    "entropy_bench", "main", "rans_bench",
]
