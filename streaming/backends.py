"""Storage backends of the KV store: the StoreBackend protocol and a local-folder backend.

Paper: CacheGen section 5 (encoded chunks are stored remotely and fetched on reuse). The
default backend is embedded (a local folder, nothing to install); `redis://` URLs load
streaming.redis_backend.RedisBackend lazily. Not runnable by itself.
"""

from __future__ import annotations

import os
from urllib.parse import urlparse

from streaming.errors import StoreError
from streaming.folder_backend import (  # noqa: F401  (re-exported: the old import path)
    _OBJ_HEAD,
    _OBJ_MAGIC,
    MAX_KEY_BYTES,
    LocalFolderBackend,
    StoreBackend,
    _check_key,
    classify_os_error,
)


def open_backend(url: str | os.PathLike, fallback_dir: str | os.PathLike | None = None) -> StoreBackend:
    """Open a backend from a URL: `file:///path` or a plain path -> LocalFolderBackend;
    `redis://host:port/db` -> streaming.redis_backend.RedisBackend (imported lazily);
    `redis+cluster://host:port[,host:port...]` -> streaming.redis_cluster.RedisClusterBackend; with
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
            from streaming.redis_backend import open_redis_backend
        except ImportError as e:
            raise StoreError(f"redis backend unavailable: {e}") from None
        return open_redis_backend(s, fallback_dir=fallback_dir)
    if parsed.scheme == "redis+cluster":  # a Redis Cluster (seed nodes); redis:// is one node
        from streaming.redis_cluster import open_cluster_backend

        return open_cluster_backend(s, fallback_dir=fallback_dir)
    raise ValueError(f"unknown store backend scheme {parsed.scheme!r} in {s!r}: use a path, file:///path, redis://host:port/db or "
                     "redis+cluster://host:port[,host:port...]")
