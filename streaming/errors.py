"""Error types of the streaming package (all subclasses of ValueError or RuntimeError).

Store failures are classified, whichever store client raised them (the store server's
client, Redis, the local folder), so that a message names the cause and the fix:

    StoreError                      the store refused or failed a request (base class)
      StoreUnavailableError         not reachable: refused, reset, closed, DNS
        StoreTimeoutError           no progress (no byte sent or received) for the timeout
        StoreOutcomeUnknownError    a save's publish was sent but neither its reply nor the
                                    store's answer to "is it published?" came back
      StoreTooLargeError            a value above a limit of the store (the limit is named,
                                    with the setting that raises it)
      StoreFullError                out of memory (Redis maxmemory, noeviction) / disk full
      StoreReadOnlyError            read-only replica / folder / file system, or writes
                                    refused until replicas or persistence recover
      StoreAuthError                authentication required or refused
      StoreRaceLostError            another writer published the same key first (the
                                    store keeps exactly one complete entry: the winner's)

Each class has a `kind` string ("unavailable", "timeout", "too_large", "full",
"read_only", "auth", "race_lost", "outcome_unknown", "error") that the store server sends
with an ERR reply so its client raises the same class (`store_error(kind, message)`).

Timeouts of every store client apply to lack of progress (no byte moved for that many
seconds), never to the size of a value: a 3 MiB write over a 2 Mbit/s link with a 3 s
timeout succeeds (docs/streaming.md).

No paper section; see docs/streaming.md. Not runnable.
"""

from __future__ import annotations


class StreamingError(RuntimeError):
    """Base class of runtime failures of the link, store or streaming client."""


class ProtocolError(StreamingError, ValueError):
    """Malformed, truncated or oversized frame on the KV store protocol."""


class LinkError(StreamingError):
    """The shaped link could not be set up, changed or torn down."""


class StoreError(StreamingError):
    """The KV store refused a request (bad manifest, missing chunk on put, server error)."""

    kind = "error"


class StoreUnavailableError(StoreError):
    """The store is not reachable (connection refused, reset or closed, unknown host)."""

    kind = "unavailable"


class StoreTimeoutError(StoreUnavailableError):
    """No byte was sent or received for the client's timeout (a stalled server or link).
    Not raised for a large value that keeps moving slowly."""

    kind = "timeout"


class StoreOutcomeUnknownError(StoreUnavailableError):
    """A save sent its publish request but lost the reply, and asking the store whether the
    entry is published failed too (the store stayed unreachable). The entry may or may not
    be published; nothing of this save was deleted (its chunks may be what a published
    manifest names). Look the key up, or save again, once the store answers."""

    kind = "outcome_unknown"


class StoreTooLargeError(StoreError):
    """A value exceeds a limit of the store; `limit` and `size` in bytes (None if unknown)."""

    kind = "too_large"

    def __init__(self, message: str, limit: int | None = None, size: int | None = None):
        super().__init__(message)
        self.limit, self.size = limit, size


class StoreFullError(StoreError):
    """The store is out of memory (Redis maxmemory with noeviction) or out of disk space."""

    kind = "full"


class StoreReadOnlyError(StoreError):
    """The store refuses writes: a read-only replica or folder, or writes paused (Redis
    min-replicas / failed persistence)."""

    kind = "read_only"


class StoreAuthError(StoreError):
    """The store needs credentials, or refused the ones given."""

    kind = "auth"


class StoreRaceLostError(StoreError):
    """Another writer published an entry under the same key after this writer read the
    key's state and before it published: the store kept the other (complete) entry and
    nothing of this write is visible. Retry the save to overwrite it, or keep the winner's."""

    kind = "race_lost"


_KINDS = {c.kind: c for c in (StoreError, StoreUnavailableError, StoreTimeoutError, StoreTooLargeError,
                              StoreFullError, StoreReadOnlyError, StoreAuthError, StoreRaceLostError,
                              StoreOutcomeUnknownError)}


def store_error(kind: str | None, message: str) -> StoreError:
    """The StoreError subclass named by `kind` (as sent in a store server's ERR reply)."""
    return _KINDS.get(str(kind or "error"), StoreError)(message)


def error_kind(e: BaseException) -> str:
    """The `kind` of a classified store error, "error" otherwise."""
    return getattr(e, "kind", "error") if isinstance(e, StoreError) else "error"
