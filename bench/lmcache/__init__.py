"""Our LMCache serdes against LMCache's own: ``python -m bench.lmcache``.

The command's modules:
- ``bench.lmcache.cli``: the command: sizes, estimates, timings, JSON;
- ``bench.lmcache.peers``: LMCache's own serdes as peers (memory objects, encode with stats);
- ``bench.lmcache.rows``: our LMCache serdes as rows of bench.quality.

This package's face: the names below are importable from ``bench.lmcache``.
"""
from bench.lmcache.cli import main

__all__ = [
    "main",
]
