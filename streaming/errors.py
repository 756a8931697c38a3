"""Error types of the streaming package (all subclasses of ValueError or RuntimeError).

No paper section; see docs/streaming.md. Not runnable.
"""


class StreamingError(RuntimeError):
    """Base class of runtime failures of the link, store or streaming client."""


class ProtocolError(StreamingError, ValueError):
    """Malformed, truncated or oversized frame on the KV store protocol."""


class LinkError(StreamingError):
    """The shaped link could not be set up, changed or torn down."""


class StoreError(StreamingError):
    """The KV store refused a request (bad manifest, missing chunk on put, server error)."""
