"""The one protocol every storage backend of the KV store implements (StoreBackend: atomic
byte values under string keys) and the URL factory that opens one (open_backend).

Paper: CacheGen section 5 (encoded chunks are stored remotely and fetched on reuse). The
default backend is embedded (a local folder, nothing to install); `redis://` URLs load
streaming.store.redis_backend.RedisBackend lazily. Not runnable by itself.
"""

from __future__ import annotations

import os
from typing import Iterator, Protocol, runtime_checkable
from urllib.parse import urlparse

from streaming.errors import StoreError
from streaming.store.folder import LocalFolderBackend


@runtime_checkable
class StoreBackend(Protocol):
    """Byte store keyed by str. `put` must be atomic: a reader sees the old value, the new
    value or nothing, never a partial one."""

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, data: bytes) -> None: ...

    def exists(self, key: str) -> bool: ...

    def delete(self, key: str) -> None: ...

    def keys(self, prefix: str = "") -> Iterator[str]: ...

    # optional: compare_and_put(key, expected: bytes | None, data: bytes | None) -> bool
    # (atomically: if the stored value equals `expected` (None = absent), store `data`
    # (None = delete) and return True; else change nothing and return False). Backends
    # without it get an in-process lock in streaming.store.KVStore (one process only).


def open_backend(url: str | os.PathLike, fallback_dir: str | os.PathLike | None = None) -> StoreBackend:
    """Open a backend from a URL: `file:///path` or a plain path -> LocalFolderBackend;
    `redis://host:port/db` -> streaming.store.redis_backend.RedisBackend (imported lazily);
    `redis+cluster://host:port[,host:port...]` -> streaming.store.redis_cluster.RedisClusterBackend; with
    `fallback_dir`, a Redis that is down at start gives a LocalFolderBackend there (warned).

    Raises ValueError for an unknown scheme, StoreError if the Redis backend is unavailable.
    """
    s = os.fspath(url)
    parsed = urlparse(s)
    if parsed.scheme in ("", "file"):
        path = parsed.path if parsed.scheme == "file" else s
        if not path:
            raise ValueError(f"empty backend path in {s!r}")
        return LocalFolderBackend(path)
    if parsed.scheme in ("redis", "rediss", "unix"):
        try:
            from streaming.store.redis_backend import open_redis_backend
        except ImportError as e:
            raise StoreError(f"redis backend unavailable: {e}") from None
        return open_redis_backend(s, fallback_dir=fallback_dir)
    if parsed.scheme == "redis+cluster":  # a Redis Cluster (seed nodes); redis:// is one node
        from streaming.store.redis_cluster import open_cluster_backend

        return open_cluster_backend(s, fallback_dir=fallback_dir)
    raise ValueError(f"unknown store backend scheme {parsed.scheme!r} in {s!r}: use a path, file:///path, redis://host:port/db or "
                     "redis+cluster://host:port[,host:port...]")
