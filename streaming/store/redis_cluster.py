"""A Redis Cluster as the shared KV store backend: hash-tagged keys, one slot per entry.

Paper: CacheGen section 5 (encoded KV chunks live in a remote store shared by engines); see
docs/redis.md ("Redis Cluster"). Chosen by URL through streaming.store.backend.open_backend:

    redis+cluster://HOST:PORT[,HOST:PORT...]     (seed nodes; any live one suffices)

`redis://` keeps meaning one node (streaming.store.redis_backend.RedisBackend). This backend is
that class over redis-py's RedisCluster client, with one change of key layout: every key of
a context entry (its manifest, each generation's chunks, manifest copy and abort marker)
carries the context key as a hash tag, `cg:ctx/{<key>}/...`, so all of them live in ONE
hash slot. The compare-and-swap publication therefore stays one Lua script, run atomically
by the slot's master, and a replica receives its effects as one transaction: after a
failover the promoted replica holds a whole entry or none of it. Entries (their context
keys) spread across shards; calibrations (`cal/<hash>`) hash on their own.

Faults (tests/streaming/test_redis_cluster.py, python -m bench.redis_cluster): a killed
master answers "connection refused" until its replica is promoted (cluster-node-timeout,
about a second or two on loopback); redis-py refreshes the slot map and retries with
back-off for at most `failover_wait_s`, then the operation raises RedisUnavailableError -
the load is a recorded miss (text prefill), never a hang. MOVED and ASK (slot migration)
are followed by the client. Redis replication is asynchronous: a save acknowledged by a
master just before it dies may be missing on the promoted replica; its later loads are then
clean misses (no manifest), never wrong KV.
Not runnable by itself.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from streaming.errors import StoreError
from streaming.store.redis_backend import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_PREFETCH_DEPTH,
    DEFAULT_SOCKET_TIMEOUT_S,
    REDIS_DEFAULT_BULK_LIMIT,
    SOCKET_READ_SIZE,
    RedisBackend,
    with_folder_fallback,
)
from streaming.store.redis_conn import (
    RedisUnavailableError,
    classify_redis_error,
    connection_class,
)

CLUSTER_SCHEMES = ("redis+cluster",)
DEFAULT_FAILOVER_WAIT_S = 4.0  # how long one operation retries while a slot has no master
# (a failover on cluster-node-timeout 1000 ms takes 1-3 s); then it fails: a recorded miss
_URL_FORM = "redis+cluster://HOST:PORT[,HOST:PORT...]"


def is_cluster_url(url) -> bool:
    """True for a redis+cluster:// URL."""
    return isinstance(url, str) and url.split("://", 1)[0] in CLUSTER_SCHEMES


def parse_cluster_url(url: str) -> tuple[list[tuple[str, int]], str | None, str | None]:
    """([(host, port), ...], username, password) of redis+cluster://[[USER]:PASS@]H:P[,H:P...][/0].

    Raises ValueError (one line, with the expected form) for another scheme, no node, a bad
    port or a database other than 0 (a cluster has only database 0)."""
    if not is_cluster_url(url):
        raise ValueError(f"not a Redis Cluster URL: {url!r} (expected {_URL_FORM})")
    rest = url.split("://", 1)[1]
    rest, _, db = rest.partition("/")
    if db.strip("/") not in ("", "0"):
        raise ValueError(f"a Redis Cluster has only database 0, got /{db} in {url!r}")
    user = password = None
    if "@" in rest:
        auth, rest = rest.rsplit("@", 1)
        user, _, password = auth.partition(":") if ":" in auth else ("", "", auth)
        user, password = user or None, password or None
    nodes = []
    for part in rest.split(","):
        host, sep, port = part.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"bad node {part!r} in Redis Cluster URL {url!r} (expected {_URL_FORM})")
        nodes.append((host.strip("[]"), int(port)))
    return nodes, user, password


def _glob_escape(s: str) -> str:
    """Escape Redis glob metacharacters (SCAN MATCH) so a prefix matches literally."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


def tag_key(key: str) -> str:
    """The Redis key (without prefix) of store key `key`: `ctx/<k>/rest` -> `ctx/{<k>}/rest`
    (the context key is the hash tag: one slot per entry); other keys unchanged."""
    if key.startswith("ctx/"):
        k, sep, rest = key[4:].partition("/")
        return f"ctx/{{{k}}}{sep}{rest}"
    return key


def untag_key(key: str) -> str:
    """Inverse of tag_key."""
    if key.startswith("ctx/{"):
        k, sep, rest = key[5:].partition("}")
        return f"ctx/{k}{rest}"
    return key


def classify_cluster_error(e: Exception, what: str, address: str, socket_timeout_s: float) -> StoreError:
    """A classified StoreError for a redis-py cluster error: a cluster without a master for
    a slot (CLUSTERDOWN, slot not covered, no reachable node) is RedisUnavailableError;
    the rest as streaming.store.redis_conn.classify_redis_error."""
    msg = str(e)
    if isinstance(e, (redis.exceptions.ClusterDownError, redis.exceptions.RedisClusterException,
                      redis.exceptions.ClusterError, redis.exceptions.TryAgainError)):
        return RedisUnavailableError(f"Redis Cluster at {address} unavailable during {what}: {msg} "
                                     "(a slot without a reachable master: a failover in progress, "
                                     "or nodes down)")
    return classify_redis_error(e, what, f"{address} (a Redis Cluster)", socket_timeout_s)


class RedisClusterBackend(RedisBackend):
    """StoreBackend over a Redis Cluster (redis-py RedisCluster; thread-safe), with the
    guarantees of RedisBackend (atomic one-script publication, whole entry or a miss).

    Args:
        url: redis+cluster://HOST:PORT[,HOST:PORT...] (seed nodes).
        key_prefix, socket_timeout_s, connect_timeout_s, prefetch_depth: as RedisBackend.
        failover_wait_s: how long one operation keeps retrying (slot map refreshed,
            exponential back-off) while its slot has no reachable master, seconds
            (default 4); then RedisUnavailableError.
        check: at construction, require every slot served and PING answered (default True).

    Raises:
        ValueError: malformed URL.
        RedisUnavailableError: no seed node reachable, a seed that is not in cluster mode (a
            plain Redis: use redis://), slots not covered, or (later) a slot without a master
            for longer than failover_wait_s; other errors as RedisBackend.
    """

    def __init__(self, url: str, *, key_prefix: str = "cg:",
                 socket_timeout_s: float = DEFAULT_SOCKET_TIMEOUT_S,
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                 prefetch_depth: int = DEFAULT_PREFETCH_DEPTH,
                 failover_wait_s: float = DEFAULT_FAILOVER_WAIT_S, check: bool = True):
        nodes, user, password = parse_cluster_url(url)
        if prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be >= 1, got {prefetch_depth}")
        self.url, self.address = url, ",".join(f"{h}:{p}" for h, p in nodes)
        self.key_prefix = key_prefix
        self.prefetch_depth = int(prefetch_depth)
        self.socket_timeout_s = float(socket_timeout_s)
        self.failover_wait_s = float(failover_wait_s)
        self._bulk_limit = None
        # back-off 0.05, 0.1, 0.2, 0.4, 0.5, 0.5 ... s: retries that fit in failover_wait_s
        tries, waited, step = 0, 0.0, 0.05
        while waited + min(step, 0.5) <= self.failover_wait_s:
            waited += min(step, 0.5)
            step *= 2
            tries += 1
        try:
            self._client = RedisCluster(
                startup_nodes=[ClusterNode(h, p) for h, p in nodes],
                username=user, password=password,
                retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), max(tries, 1)),
                require_full_coverage=True,
                connection_class=connection_class("redis"),
                socket_timeout=self.socket_timeout_s,
                socket_connect_timeout=float(connect_timeout_s),
                socket_read_size=SOCKET_READ_SIZE,
                decode_responses=False,
            )
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError) as e:
            raise self._cluster_open_error(e) from None
        if check:
            self.check_cluster()

    def _cluster_open_error(self, e: Exception) -> StoreError:
        msg = str(e)
        if "Cluster mode is not enabled" in msg:
            return RedisUnavailableError(
                f"Redis at {self.address} is a plain Redis, not a cluster node (cluster mode is not "
                f"enabled): use redis://HOST:PORT/DB for one node, {_URL_FORM} for a cluster")
        if "not covered" in msg.lower():
            return RedisUnavailableError(
                f"Redis Cluster at {self.address} does not serve every hash slot: add masters for the "
                "uncovered slots (redis-cli --cluster fix) or wait for its failover to finish")
        if "cannot be connected" in msg or isinstance(e, (redis.exceptions.ConnectionError, OSError)):
            return RedisUnavailableError(
                f"no Redis Cluster node reachable at {self.address}: check the addresses and that "
                "the nodes run (redis-server --cluster-enabled yes)")
        return classify_cluster_error(e, "connect", self.address, self.socket_timeout_s)

    def __repr__(self) -> str:
        return f"RedisClusterBackend({self.url!r})"

    def _classify(self, e: Exception, what: str) -> StoreError:
        return classify_cluster_error(e, what, self.address, self.socket_timeout_s)

    def _call(self, what: str, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError) as e:
            raise self._classify(e, what) from None

    def _k(self, key: str) -> bytes:
        return (self.key_prefix + tag_key(super()._k(key)[len(self.key_prefix.encode()):].decode())).encode()

    def slot_of(self, key: str) -> int:
        """The hash slot (0..16383) of store key `key` (every key of one entry: the same)."""
        return int(self._client.keyslot(self._k(key)))

    def check_cluster(self) -> None:
        """Raise RedisUnavailableError unless a reachable node answers CLUSTER INFO with
        cluster_state:ok (every slot served by a reachable master)."""
        last: Exception | None = None
        for node in self._client.get_nodes():
            try:
                info = self._client.cluster_info(target_nodes=node)
            except (redis.exceptions.RedisError, OSError) as e:
                last = e
                continue
            state = info.get("cluster_state", info.get(b"cluster_state"))
            if state not in ("ok", b"ok"):
                raise RedisUnavailableError(
                    f"Redis Cluster at {self.address} is not ok (cluster_state {state!r} at {node.name}): "
                    "some hash slots are not served by a reachable master; fix it (redis-cli --cluster "
                    "check / fix) or wait for its failover to finish")
            return
        raise self._cluster_open_error(last or OSError("no node"))

    def ping(self) -> None:
        """Check every master answers; raises RedisUnavailableError."""
        self._call("PING", self._client.ping, target_nodes=RedisCluster.PRIMARIES)

    def bulk_limit(self) -> int:
        """proto-max-bulk-len of a master (as RedisBackend.bulk_limit; all nodes of a
        cluster are assumed configured alike)."""
        if self._bulk_limit is None:
            try:
                got = self._client.config_get("proto-max-bulk-len", target_nodes=RedisCluster.RANDOM)
                self._bulk_limit = int(got.get("proto-max-bulk-len") or got.get(b"proto-max-bulk-len"))
            except (redis.exceptions.ResponseError, TypeError, ValueError):
                self._bulk_limit = REDIS_DEFAULT_BULK_LIMIT
            except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError) as e:
                raise self._classify(e, "CONFIG GET proto-max-bulk-len") from None
        return self._bulk_limit

    def put_many(self, items) -> None:
        """Store (key, bytes) pairs; the keys of one entry share a slot, and pairs are
        written slot by slot, each slot's in one Lua script (all or none of that slot's).
        Errors as put."""
        by_slot: dict[int, list[tuple[bytes, bytes]]] = {}
        for key, data in items:
            k = self._k(key)
            by_slot.setdefault(self._client.keyslot(k), []).append((k, bytes(data)))
        for pairs in by_slot.values():
            lua = "for i = 1, #KEYS do redis.call('SET', KEYS[i], ARGV[i]) end return 1"
            self._write(f"script of {len(pairs)} SETs", [len(d) for _, d in pairs], self._client.eval,
                        lua, len(pairs), *[k for k, _ in pairs], *[d for _, d in pairs])

    def count_existing(self, keys: Sequence[str]) -> int:
        """How many of `keys` are stored: one EXISTS per key, pipelined (one round trip per
        node). Not one multi-key EXISTS: while its slot is being migrated, some keys are on
        the importing node and Redis refuses a multi-key command (TRYAGAIN); single-key
        commands follow ASK."""
        ks = [self._k(k) for k in keys]
        if not ks:
            return 0
        pipe = self._client.pipeline()
        for k in ks:
            pipe.exists(k)
        return sum(int(x) for x in self._call("EXISTS", pipe.execute))

    def get_many(self, keys) -> list[bytes | None]:
        """Values of keys (MGET per slot, in the order of keys); None for absent keys."""
        ks = [self._k(k) for k in keys]
        return list(self._call("MGET", self._client.mget_nonatomic, ks)) if ks else []

    def keys(self, prefix: str = "") -> Iterator[str]:
        """Yield stored keys starting with prefix (SCAN on every master; order unspecified)."""
        n = len(self.key_prefix.encode("utf-8"))
        tagged = tag_key(prefix) if prefix.count("/") >= 2 else prefix  # ctx/<k>/...: its tag
        pat = _glob_escape(self.key_prefix + tagged) + "*"
        try:
            for k in self._client.scan_iter(match=pat.encode(), count=1000, target_nodes=RedisCluster.PRIMARIES):
                key = untag_key(k[n:].decode("utf-8"))
                if key.startswith(prefix):
                    yield key
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError) as e:
            raise self._classify(e, "SCAN") from None

    def info(self, section: str = "memory") -> dict:
        """INFO `section` of the masters merged: numeric fields summed (used_memory,
        evicted_keys, ...), the others taken from one master (maxmemory_policy)."""
        got = self._call("INFO", self._client.info, section, target_nodes=RedisCluster.PRIMARIES)
        per_node = list(got.values()) if got and all(isinstance(v, dict) for v in got.values()) else [got]
        out: dict = {}
        for d in per_node:
            for k, v in d.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k in out:
                    out[k] += v
                else:
                    out.setdefault(k, v)
        return out


def open_cluster_backend(url: str, fallback_dir=None, **kw):
    """RedisClusterBackend(url, **kw); if the cluster is unreachable and fallback_dir is
    given, a local-folder backend there instead, with a one-line warning on stderr (as
    streaming.store.redis_backend.open_redis_backend). Raises ValueError for a malformed URL,
    RedisUnavailableError when unreachable and no fallback_dir is given."""
    return with_folder_fallback(lambda: RedisClusterBackend(url, **kw), fallback_dir,
                                "streaming.store.redis_cluster")


def check_cluster_store(url: str) -> None:
    """Open the cluster at `url` and close it: returns when every slot is served, raises
    ValueError (malformed URL) or RedisUnavailableError (no node reachable, a plain Redis,
    uncovered slots) with one line saying what is wrong - for entry points that must
    refuse a bad --store before anything slow starts."""
    RedisClusterBackend(url).close()
