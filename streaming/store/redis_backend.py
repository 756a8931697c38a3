"""Redis as the shared KV store backend: opaque bytes under string keys, pipelined reads.

Paper: CacheGen section 5 (encoded KV chunks live in a remote store and are streamed to the
engine on reuse; decoding chunk k overlaps the transfer of chunk k+1); see
docs/redis.md. Chosen by URL through streaming.store.backend.open_backend("redis://HOST:PORT/DB")
(`--store redis://...`). Benchmark (load through the shaped link: local-folder store vs
Redis behind the store server vs Redis read directly), in the measurement package:

    python -m bench.redis --bandwidth-mbps 100 1000 --repeats 3

This module stores bytes only. Context keys, the per-context manifest (written last, with a
CRC32 per chunk) and partial-miss logic live in streaming.store; this backend gives it:
- `get / put / exists / delete / keys` of the StoreBackend protocol (`put` is one SET:
  atomic, a reader sees the old value, the new one or nothing);
- `put_if_absent` (SET NX, for manifests written by concurrent identical writers);
- `put_many` (all values in one MULTI/EXEC transaction, e.g. chunks then manifest);
- `get_many_iter(keys, depth)`: a prefetching iterator - a reader thread requests value
  k+1 (and up to `depth` ahead) while the caller decodes value k.
- `RedisStoreClient(url)` (in streaming.store.redis_client, above this module and streaming.store):
  the streaming.store.StoreClient interface straight over Redis
  (stream_load works on it; put_context writes chunks under a fresh generation, then
  publishes the manifest with a compare-and-swap Lua script);
- `compare_and_put` (the CAS script) and `count_existing` (one EXISTS for many keys);
- `open_redis_backend(url, fallback_dir)`: the local store when Redis is down and asked.
Every socket operation has a timeout that applies to lack of progress (each send and recv
call, never a whole value: a large value over a slow link does not time out while bytes
move); a broken connection is retried once without back-off, a timed-out one not at all,
so a dead or hung Redis turns into a RedisTimeoutError / RedisUnavailableError within about
`socket_timeout_s`, never a hang. Failures are classified (streaming.errors: too large,
full, read-only, auth, unavailable, timeout). Values are never unpickled. The connection
layer (progress-timed sends, URL parsing, the classification) is streaming.store.redis_conn.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from typing import Iterable, Iterator, NamedTuple, Sequence
from urllib.parse import urlparse

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from streaming.errors import StoreError, StoreTooLargeError
from streaming.store.folder import MAX_KEY_BYTES, LocalFolderBackend
from streaming.shutdown import Closing, put_until_stopped
from streaming.store.redis_conn import (
    CONNECTION_CLASSES,
    RedisUnavailableError,
    classify_redis_error,
    parse_redis_url,
)

DEFAULT_SOCKET_TIMEOUT_S = 10.0  # per socket operation (one send or recv call), not per
# value: a slow link still moves bytes well within it; a dead/frozen peer is detected in this time
REDIS_DEFAULT_BULK_LIMIT = 512 << 20  # Redis's default proto-max-bulk-len (512mb): the
# largest value a client may send, assumed when CONFIG GET is not allowed
DEFAULT_CONNECT_TIMEOUT_S = 3.0
DEFAULT_PREFETCH_DEPTH = 2  # values fetched ahead of the consumer (memory: depth+1 values)
SOCKET_READ_SIZE = 1 << 20  # 1 MiB per recv (redis-py default 32 KiB: slow for MB chunks)
_SCAN_COUNT = 1000


class FetchedValue(NamedTuple):
    """One value from RedisBackend.get_many_iter(..., with_timing=True).

    key: the requested key; data: its bytes or None when absent (evicted / never stored);
    fetch_s: seconds from sending GET to the last byte read (transfer over the link);
    wait_s: seconds the consumer blocked waiting for it (0 when the prefetch was ahead).
    """

    key: str
    data: bytes | None
    fetch_s: float
    wait_s: float


def _check_key(key: str) -> str:
    if not isinstance(key, str) or not key:
        raise ValueError("store key must be a non-empty str")
    if len(key.encode("utf-8")) > MAX_KEY_BYTES:
        raise ValueError(f"store key exceeds {MAX_KEY_BYTES} bytes")
    return key


def _glob_escape(s: str) -> str:
    """Escape Redis glob metacharacters (SCAN MATCH) so a prefix matches literally."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


class RedisBackend(Closing):
    """StoreBackend over a Redis server (redis-py client, connection pool, thread-safe).

    Args:
        url: redis://HOST:PORT/DB (rediss:// for TLS; unix:///path.sock?db=N).
        key_prefix: prepended to every key in Redis (default "cg:"), so the harness's keys
            are recognisable in a shared Redis; `keys()` returns keys without it.
        socket_timeout_s: seconds without progress on a socket (each send and each recv
            call), default 10 - never a limit on a whole value's transfer time.
        connect_timeout_s: limit on connecting, seconds (default 3).
        prefetch_depth: default depth of get_many_iter.
        check: PING at construction (default True) so a down Redis fails here, clearly.

    Raises (classified, streaming.errors; message = cause and fix):
        ValueError: malformed URL.
        RedisUnavailableError (a StoreUnavailableError): Redis not reachable at
            construction, or the connection broke during a request.
        RedisTimeoutError (a RedisUnavailableError and StoreTimeoutError): no progress for
            socket_timeout_s.
        StoreTooLargeError: a value above Redis's proto-max-bulk-len (refused before sending).
        StoreFullError: out of memory under policy noeviction.
        StoreReadOnlyError: a read-only replica, NOREPLICAS or MISCONF.
        StoreAuthError: password missing or wrong.
        StoreError: any other refusal.
    """

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "cg:",
        socket_timeout_s: float = DEFAULT_SOCKET_TIMEOUT_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        prefetch_depth: int = DEFAULT_PREFETCH_DEPTH,
        check: bool = True,
    ):
        if not isinstance(url, str):
            raise ValueError(f"Redis URL must be a str, got {type(url).__name__}")
        if url.startswith("unix://"):
            self.address = url
        else:
            host, port, db = parse_redis_url(url)
            self.address = f"{host}:{port}/{db}"
        if prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be >= 1, got {prefetch_depth}")
        self.url = url
        self.key_prefix = key_prefix
        self.prefetch_depth = int(prefetch_depth)
        self.socket_timeout_s = float(socket_timeout_s)
        self._bulk_limit: int | None = None  # proto-max-bulk-len, read at the first write
        self._client = redis.Redis.from_url(
            url,
            connection_class=CONNECTION_CLASSES[urlparse(url).scheme or "redis"],
            socket_timeout=self.socket_timeout_s,
            socket_connect_timeout=float(connect_timeout_s),
            socket_read_size=SOCKET_READ_SIZE,
            # one immediate reconnect on a broken connection (e.g. a pooled socket from
            # before a server restart); a timeout is not retried: fail over instead
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
            retry_on_timeout=False,
            health_check_interval=0,
            decode_responses=False,
        )
        if check:
            self.ping()

    def __repr__(self) -> str:
        return f"RedisBackend({self.url!r})"

    # ------------------------------------------------------------------ errors
    def _classify(self, e: Exception, what: str) -> StoreError:
        return classify_redis_error(e, what, self.address, self.socket_timeout_s)

    def _unavailable(self, e: Exception, what: str) -> StoreError:
        return self._classify(e, what)

    def _call(self, what: str, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except (redis.exceptions.RedisError, OSError) as e:
            raise self._classify(e, what) from None

    def bulk_limit(self) -> int:
        """The largest value Redis accepts from a client, bytes: its proto-max-bulk-len
        (CONFIG GET, read once), or Redis's default 512 MiB when CONFIG is not allowed."""
        if self._bulk_limit is None:
            try:
                got = self._client.config_get("proto-max-bulk-len")
                self._bulk_limit = int(got.get("proto-max-bulk-len") or got.get(b"proto-max-bulk-len"))
            except (redis.exceptions.ResponseError, TypeError, ValueError):
                self._bulk_limit = REDIS_DEFAULT_BULK_LIMIT  # CONFIG disabled / renamed / no permission
            except (redis.exceptions.RedisError, OSError) as e:
                raise self._classify(e, "CONFIG GET proto-max-bulk-len") from None
        return self._bulk_limit

    def _check_sizes(self, sizes: Iterable[int]) -> None:
        """Refuse values above proto-max-bulk-len before anything is sent: Redis would close
        the connection mid-value ("invalid bulk length"), which reads like a dead server."""
        big = max(sizes, default=0)
        if big <= 1 << 20:  # Redis's smallest possible limit is 1 MiB
            return
        limit = self.bulk_limit()
        if big > limit:
            raise StoreTooLargeError(
                f"a value of {big} bytes exceeds the proto-max-bulk-len of Redis at {self.address} "
                f"({limit} bytes, the largest value Redis accepts): raise it with CONFIG SET "
                f"proto-max-bulk-len {big} (or --proto-max-bulk-len in redis.conf), or store "
                "smaller chunks (--chunk-tokens)", limit, big)

    def _write(self, what: str, sizes: list[int], fn, *args, **kw):
        self._check_sizes(sizes)
        try:
            return self._call(what, fn, *args, **kw)
        except RedisUnavailableError:
            if max(sizes, default=0) > 1 << 20:  # the limit may have been lowered since we read it
                self._bulk_limit = None
                try:
                    self._check_sizes(sizes)  # raises StoreTooLargeError if that was the cause
                except RedisUnavailableError:
                    pass
            raise

    def _k(self, key: str) -> bytes:
        return (self.key_prefix + _check_key(key)).encode("utf-8")

    # ------------------------------------------------------------------ StoreBackend
    def ping(self) -> None:
        """Check the server answers; raises RedisUnavailableError."""
        self._call("PING", self._client.ping)

    def get(self, key: str) -> bytes | None:
        """Stored bytes of key, or None if absent (never stored, deleted or evicted)."""
        return self._call("GET", self._client.get, self._k(key))

    def put(self, key: str, data: bytes) -> None:
        """Store bytes under key (one SET: atomic; overwrites). Raises StoreTooLargeError
        (above proto-max-bulk-len, before sending), StoreFullError, StoreReadOnlyError,
        StoreAuthError, RedisTimeoutError (no progress), RedisUnavailableError."""
        self._write(f"SET of {len(data)} bytes", [len(data)], self._client.set, self._k(key), bytes(data))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """SET NX: store only if key is absent. True if this call wrote it (errors as put)."""
        return bool(self._write(f"SET NX of {len(data)} bytes", [len(data)], self._client.set,
                                self._k(key), bytes(data), nx=True))

    def put_many(self, items: Iterable[tuple[str, bytes]]) -> None:
        """Store all (key, bytes) pairs in one MULTI/EXEC transaction, in order: other
        clients see all of them or none (e.g. a context's chunks followed by its manifest).
        Errors as put."""
        pipe = self._client.pipeline(transaction=True)
        sizes = []
        for key, data in items:
            pipe.set(self._k(key), bytes(data))
            sizes.append(len(data))
        self._write(f"MULTI/EXEC of {len(sizes)} values, {sum(sizes)} bytes", sizes, pipe.execute)

    # A script whose reply was lost is sent again by redis-py (one retry on a broken
    # connection): a value already equal to the one to write is that first run's write
    # (the store's manifests carry a random generation per save), so it answers 1 again.
    _CAS_LUA = """
local cur = redis.call('GET', KEYS[1])
if ARGV[3] == '1' and cur == ARGV[4] then return 1 end
if ARGV[1] == '0' then
  if cur then return 0 end
elseif cur ~= ARGV[2] then
  return 0
end
if ARGV[3] == '1' then redis.call('SET', KEYS[1], ARGV[4]) else redis.call('DEL', KEYS[1]) end
return 1
"""

    def compare_and_put(self, key: str, expected: bytes | None, data: bytes | None) -> bool:
        """Atomic compare-and-swap (one Lua script, run by Redis without interleaving): if
        the stored value equals `expected` (None = absent) store `data` (None = delete) and
        return True; else change nothing and return False. A stored value already equal to
        `data` also returns True (a re-sent script whose first run's reply was lost).
        Errors as put."""
        args = ["0" if expected is None else "1", b"" if expected is None else bytes(expected),
                "0" if data is None else "1", b"" if data is None else bytes(data)]
        return bool(self._write(f"compare-and-set of {len(data or b'')} bytes", [len(data or b"")],
                                self._client.eval, self._CAS_LUA, 1, self._k(key), *args))

    # KEYS: manifest, this generation's abort marker, the items; ARGV: has-expected,
    # expected, manifest, the items' bytes. A re-sent script finds its own manifest: 1.
    _PUBLISH_LUA = """
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[3] then return 1 end
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
if ARGV[1] == '0' then
  if cur then return 0 end
elseif cur and cur ~= ARGV[2] then
  return 0
end
for i = 3, #KEYS do redis.call('SET', KEYS[i], ARGV[i + 1]) end
redis.call('SET', KEYS[1], ARGV[3])
return 1
"""

    # KEYS: manifest, abort marker; ARGV: generation, marker lifetime (ms). 1: published
    # (the manifest's generation or the one it replaced); 0: not, and now never will be.
    _SETTLE_LUA = """
local cur = redis.call('GET', KEYS[1])
if cur then
  local ok, m = pcall(cjson.decode, cur)
  if ok and type(m) == 'table' then
    if m['gen'] == ARGV[1] then return 1 end
    if type(m['prev']) == 'table' and m['prev']['gen'] == ARGV[1] then return 1 end
  end
end
redis.call('SET', KEYS[2], '1', 'PX', ARGV[2])
return 0
"""
    ABORT_MARKER_MS = 3_600_000  # an abort marker outlives any publish still in flight (a
    # request is abandoned after socket_timeout_s, seconds); then it expires on its own

    def publish_many(self, manifest_key: str, expected: bytes | None, manifest: bytes,
                     items: Sequence[tuple[str, bytes]], abort_key: str) -> bool:
        """One Lua script, atomic in Redis: if `manifest_key` still holds `expected` (None =
        absent) or holds nothing any more (evicted / dropped: no entry to keep), and
        `abort_key` (this write's abort marker, see settle_publish) is not set, SET every
        (key, bytes) of `items` and then the manifest, and return True; else write nothing
        and return False. A manifest already equal to `manifest` returns True (the script
        re-sent after its reply was lost: this write is the stored one). A client that dies
        while sending the script leaves nothing (Redis runs only complete commands).
        Errors as put."""
        keys = [self._k(manifest_key), self._k(abort_key)] + [self._k(k) for k, _ in items]
        args = ["0" if expected is None else "1", b"" if expected is None else bytes(expected),
                bytes(manifest)] + [bytes(d) for _, d in items]
        sizes = [len(manifest)] + [len(d) for _, d in items]
        return bool(self._write(f"publish of {len(items)} values, {sum(sizes)} bytes", sizes,
                                self._client.eval, self._PUBLISH_LUA, len(keys), *keys, *args))

    def settle_publish(self, manifest_key: str, abort_key: str, gen: str) -> bool:
        """One Lua script, for a writer that lost the reply to its publish_many: True when
        `manifest_key` holds a manifest of generation `gen` or one that replaced it (its
        "prev" is `gen`); else set `abort_key` (expiring after ABORT_MARKER_MS) so that a
        publish of `gen` still in flight is refused, and return False. Errors as put."""
        return bool(self._write("settle of a publish", [0], self._client.eval, self._SETTLE_LUA, 2,
                                self._k(manifest_key), self._k(abort_key), gen, self.ABORT_MARKER_MS))

    def eviction_note(self) -> str:
        """One sentence ("Redis at ... evicts keys (maxmemory-policy ...): ...") naming
        this Redis's eviction when it evicts keys (a maxmemory-policy
        allkeys-*, maxmemory set, evicted_keys > 0: it may drop a save's chunks before the
        manifest that names them is published), with the fix; "" otherwise, or when INFO
        cannot be read."""
        try:
            mem, stats = self.info("memory"), self.info("stats")
        except StoreError:
            return ""
        policy, evicted = str(mem.get("maxmemory_policy", "")), int(stats.get("evicted_keys", 0) or 0)
        if not policy.startswith("allkeys-") or evicted <= 0:
            return ""
        return (f"Redis at {self.address} evicts keys (maxmemory-policy {policy}, maxmemory "
                f"{mem.get('maxmemory')} bytes, {evicted} keys evicted so far): a KV store on Redis "
                "needs maxmemory-policy noeviction (or volatile-* with the store's keys persistent, "
                "as they are): CONFIG SET maxmemory-policy noeviction, or raise maxmemory")

    def count_existing(self, keys: Sequence[str]) -> int:
        """How many of `keys` are stored (one EXISTS with every key)."""
        ks = [self._k(k) for k in keys]
        return int(self._call("EXISTS", self._client.exists, *ks)) if ks else 0

    def exists(self, key: str) -> bool:
        """True if key is stored (EXISTS)."""
        return bool(self._call("EXISTS", self._client.exists, self._k(key)))

    def delete(self, key: str) -> None:
        """Remove key (no error if absent)."""
        self._call("DEL", self._client.delete, self._k(key))

    def keys(self, prefix: str = "") -> Iterator[str]:
        """Yield stored keys starting with prefix (SCAN, non-blocking for the server;
        order unspecified)."""
        pat = _glob_escape(self.key_prefix + prefix) + "*"
        n = len(self.key_prefix.encode("utf-8"))
        cursor = 0
        while True:
            cursor, batch = self._call("SCAN", self._client.scan, cursor, match=pat, count=_SCAN_COUNT)
            for k in batch:
                yield k[n:].decode("utf-8")
            if int(cursor) == 0:
                break

    # ------------------------------------------------------------------ reads in bulk
    def get_many(self, keys: Iterable[str]) -> list[bytes | None]:
        """Values of keys in one round trip (MGET); None for absent keys."""
        ks = [self._k(k) for k in keys]
        if not ks:
            return []
        return self._call("MGET", self._client.mget, ks)

    def get_many_iter(
        self, keys: Iterable[str], depth: int | None = None, *, with_timing: bool = False
    ) -> Iterator[tuple[str, bytes | None]] | Iterator[FetchedValue]:
        """Yield (key, bytes or None) in the order of keys, prefetching ahead.

        A reader thread sends GET for value k+1 as soon as value k has arrived and keeps up
        to `depth` values (default self.prefetch_depth) ready, so the caller's decode of
        value k overlaps the transfer of k+1 (CacheGen section 5.3, pipelined loading).
        Memory held: at most depth + 1 values. With with_timing=True yields FetchedValue
        (key, data, fetch_s, wait_s).

        Raises RedisUnavailableError in the caller (at the value that failed) if Redis
        dies or stops answering; values before it were yielded normally. Closing the
        iterator early (break) stops the reader thread.
        """
        depth = self.prefetch_depth if depth is None else int(depth)
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        key_list = [_check_key(k) for k in keys]
        if not key_list:
            return
        ready: queue.Queue = queue.Queue(maxsize=depth)
        stop = threading.Event()

        def reader() -> None:
            for key in key_list:
                if stop.is_set():
                    return
                t0 = time.perf_counter()
                try:
                    item = (key, self.get(key), time.perf_counter() - t0)
                except BaseException as e:  # passed to the consumer, raised there
                    item = e
                put_until_stopped(ready, item, stop)
                if isinstance(item, BaseException):
                    return

        th = threading.Thread(target=reader, name="redis-prefetch", daemon=True)
        th.start()
        try:
            for _ in key_list:
                t0 = time.perf_counter()
                item = ready.get()
                wait_s = time.perf_counter() - t0
                if isinstance(item, BaseException):
                    raise item
                key, data, fetch_s = item
                yield FetchedValue(key, data, fetch_s, wait_s) if with_timing else (key, data)
        finally:
            stop.set()  # the reader exits after its current GET (bounded by the socket timeout)
            th.join(timeout=0.5)

    # ------------------------------------------------------------------ admin
    def info(self, section: str = "memory") -> dict:
        """Redis INFO section as a dict (memory: used_memory, maxmemory; stats: evicted_keys)."""
        return self._call("INFO", self._client.info, section)

    def close(self) -> None:
        """Close the client's connections (the server keeps running)."""
        self._client.close()


# --------------------------------------------------------------------------- opening
def open_redis_backend(url: str, fallback_dir: str | os.PathLike | None = None, **kw):
    """RedisBackend(url, **kw); if Redis is unreachable and fallback_dir is given, a
    LocalFolderBackend(fallback_dir) instead, with a one-line warning on stderr.

    Meant for streaming.store.backend.open_backend(url, fallback_dir=...). Raises
    RedisUnavailableError (a StoreError) when unreachable and no fallback_dir is given;
    ValueError for a malformed URL (never falls back on a typo).
    """
    return with_folder_fallback(lambda: RedisBackend(url, **kw), fallback_dir, "streaming.store.redis_backend")


def with_folder_fallback(open_backend, fallback_dir: str | os.PathLike | None, who: str):
    """``open_backend()``; when it raises RedisUnavailableError and ``fallback_dir`` is given,
    a LocalFolderBackend(fallback_dir) instead, with one warning line on stderr naming
    ``who`` and the reason. Without ``fallback_dir`` the error propagates; other errors
    (ValueError for a malformed URL) always do."""
    try:
        return open_backend()
    except RedisUnavailableError as e:
        if fallback_dir is None:
            raise
        print(f"{who}: {e}; falling back to the local store {os.fspath(fallback_dir)}", file=sys.stderr)
        return LocalFolderBackend(fallback_dir)


# --------------------------------------------------------------------------- direct client

