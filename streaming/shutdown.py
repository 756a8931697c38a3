"""Clean shutdown, written once for the streaming clients and backends:

- `Closing`: a context-manager mixin (`with obj:` returns obj, `close()` on exit) for an
  object whose only setup is its constructor (RedisBackend, RedisStoreClient);
- `put_until_stopped(q, item, stop)`: a producer thread's hand-off to a bounded queue that
  gives up when the consumer has set `stop` (the stream_load receiver, the Redis
  prefetch reader), so a producer never blocks forever on a consumer that left.

No project import: anything in streaming may use it. Not runnable.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Self


class Closing:
    """Context manager: `__enter__` returns self, `__exit__` calls `self.close()` (which
    the class defines) and does not swallow the exception."""

    def close(self) -> None:  # pragma: no cover - every user defines its own
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def put_until_stopped(q: queue.Queue, item: Any, stop: threading.Event,
                      poll_s: float = 0.1) -> bool:
    """Put `item` into the bounded queue `q`, waiting while it is full, in steps of
    `poll_s` seconds so that `stop` is noticed. Returns True when the item was queued,
    False when `stop` was set first (the item is dropped). Raises nothing."""
    while not stop.is_set():
        try:
            q.put(item, timeout=poll_s)
            return True
        except queue.Full:
            continue
    return False
