"""The store load benchmark: many concurrent clients saving and loading contexts through
the store server and through Redis, every loaded KV checked: ``python -m bench.store_load``.

The command's modules:
- ``bench.store_load.cli``: the command: flags, the backends, the server's RSS and
  descriptors, store_load.json;
- ``bench.store_load.clients``: one client's saves and loads (token-identifying KV, each load
  checked against the manifest it planned from) and the per-process worker.

This package's face: ``main``.
"""
from bench.store_load.cli import main

__all__ = ["main"]
