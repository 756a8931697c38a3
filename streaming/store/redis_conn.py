"""The Redis connection layer under RedisBackend: progress-timed sends (a socket timeout
per send call, never per value), the connection classes per URL scheme, URL parsing, and
the classification of every redis-py failure into one streaming.errors class with the
cause and the fix in its message.

Apart from streaming.store.redis_backend (the StoreBackend operations over a client) because
this is how one talks to Redis and how its failures read, not what is stored.
RedisUnavailableError, RedisTimeoutError and parse_redis_url are re-exported there.
Not runnable.
"""

from __future__ import annotations

import socket
from urllib.parse import urlparse

import redis
import redis.connection

from streaming.errors import (
    StoreAuthError,
    StoreError,
    StoreFullError,
    StoreReadOnlyError,
    StoreTimeoutError,
    StoreTooLargeError,
    StoreUnavailableError,
)
from streaming.store.protocol import send_progress


class RedisUnavailableError(StoreUnavailableError):
    """Redis is not reachable (refused, reset, closed) or died during a request."""


class RedisTimeoutError(RedisUnavailableError, StoreTimeoutError):
    """No byte moved to or from Redis for socket_timeout_s (a stalled server or link)."""

    kind = "timeout"


class _ProgressSendMixin:
    """redis-py connection whose writes apply the socket timeout to each send call (lack of
    progress) instead of socket.sendall's deadline for the whole value (Python >= 3.5), so a
    large SET over a slow link does not fail while bytes keep moving. Reads are already per
    recv call in redis-py."""

    def send_packed_command(self, command, check_health=True):
        if not self._sock:
            self.connect_check_health(check_health=False)
        if check_health:
            self.check_health()
        try:
            if isinstance(command, (str, bytes)):
                command = [command]
            for item in command:
                send_progress(self._sock, item.encode() if isinstance(item, str) else item)
        except socket.timeout:
            self.disconnect()
            raise redis.exceptions.TimeoutError(
                f"no progress writing to the socket for {self.socket_timeout} s") from None
        except OSError as e:
            self.disconnect()
            raise redis.exceptions.ConnectionError(f"error while writing to the socket: {e}") from None
        except BaseException:
            self.disconnect()  # the command may be half sent: never reuse this connection
            raise


CONNECTION_CLASSES = {
    scheme: type(f"Progress{base.__name__}", (_ProgressSendMixin, base), {})
    for scheme, base in (("redis", redis.connection.Connection),
                         ("rediss", redis.connection.SSLConnection),
                         ("unix", redis.connection.UnixDomainSocketConnection))
}


def connection_class(scheme: str) -> type:
    """The progress-timed redis-py connection class for a URL scheme ("redis", "rediss",
    "unix"); raises KeyError for another."""
    return CONNECTION_CLASSES[scheme]


def parse_redis_url(url: str) -> tuple[str, int, int]:
    """(host, port, db) of redis://HOST[:PORT][/DB]; raises ValueError with the expected form."""
    p = urlparse(url)
    if p.scheme not in ("redis", "rediss"):
        raise ValueError(f"not a Redis URL: {url!r} (expected redis://HOST:PORT/DB)")
    try:
        port = p.port or 6379
    except ValueError:
        raise ValueError(f"bad port in Redis URL {url!r} (expected redis://HOST:PORT/DB)") from None
    path = p.path.strip("/")
    if path and not path.isdigit():
        raise ValueError(f"bad database number {path!r} in Redis URL {url!r} (expected redis://HOST:PORT/DB)")
    if not p.hostname:
        raise ValueError(f"no host in Redis URL {url!r} (expected redis://HOST:PORT/DB)")
    return p.hostname, port, int(path or 0)


def classify_redis_error(e: Exception, what: str, address: str, socket_timeout_s: float) -> StoreError:
    """One classified StoreError (cause and fix in the message) for a redis-py error (or an
    OSError) raised during `what` (e.g. "SET") against the Redis at `address`: a
    RedisTimeoutError, StoreAuthError, RedisUnavailableError, StoreFullError,
    StoreReadOnlyError, StoreTooLargeError or plain StoreError. Returned, not raised."""
    at = f"Redis at {address}"
    msg = str(e)
    up = msg.upper()
    if isinstance(e, redis.exceptions.TimeoutError) or isinstance(e, socket.timeout):
        return RedisTimeoutError(
            f"{at}: timeout without progress during {what}: no byte moved for "
            f"{socket_timeout_s:g} s ({msg}); the server or the link stalled (a slow "
            "transfer that keeps moving does not time out): check the server, or raise "
            "socket_timeout_s")
    if isinstance(e, (redis.exceptions.AuthenticationError,
                      redis.exceptions.AuthenticationWrongNumberOfArgsError,
                      redis.exceptions.NoPermissionError)) \
            or any(t in up for t in ("NOAUTH", "WRONGPASS", "INVALID PASSWORD", "NOPERM",
                                      "INVALID USERNAME-PASSWORD")):
        return StoreAuthError(
            f"{at} refused {what}: authentication required or refused ({msg}); give the "
            "password in the URL: redis://:PASSWORD@HOST:PORT/DB (or redis://USER:PASSWORD@...)")
    if isinstance(e, (redis.exceptions.ConnectionError, OSError)):
        return RedisUnavailableError(
            f"{at} unavailable during {what}: {msg} (start one with "
            "`python -m streaming.store.redis_server`, or use a local store folder)")
    if isinstance(e, redis.exceptions.OutOfMemoryError) or up.startswith("OOM") or " OOM " in up:
        return StoreFullError(
            f"{at} is full (out of memory) and refused {what} ({msg}): raise maxmemory "
            "(CONFIG SET maxmemory / --maxmemory) or delete contexts no longer needed; an evicting "
            "policy (allkeys-*) makes room by dropping entries and can drop a save's chunks before "
            "its manifest is published (docs/redis.md)")
    if isinstance(e, redis.exceptions.ReadOnlyError) or "READONLY" in up:
        return StoreReadOnlyError(
            f"{at} is a read-only replica and refused {what} ({msg}): point the store URL "
            "at the primary, or set replica-read-only no")
    if "NOREPLICAS" in up:
        return StoreReadOnlyError(
            f"{at} refuses writes: not enough replicas ({msg}): start the replicas or lower "
            "min-replicas-to-write")
    if "MISCONF" in up:
        return StoreReadOnlyError(
            f"{at} refuses writes because it cannot persist ({msg}): fix its disk / dir, or "
            "set stop-writes-on-bgsave-error no")
    if "BULK LENGTH" in up or "EXCEEDS MAXIMUM ALLOWED SIZE" in up:
        return StoreTooLargeError(
            f"{at} refused {what}: value above its proto-max-bulk-len ({msg}): raise it with "
            "CONFIG SET proto-max-bulk-len BYTES (or --proto-max-bulk-len), or store smaller chunks")
    if isinstance(e, redis.exceptions.ResponseError):
        return StoreError(f"{at} refused {what}: {msg}")
    return StoreError(f"{at} failed {what}: {msg}")
