"""Making the codec calibrations an entry names available before its chunks are decoded: an
entry encoded with calibration H decodes on a machine that never fitted H, because the
store serves H's artifact beside the entry (content-addressed, verified by its hash).

Used by streaming.load.stream_load and the vLLM connector's local source. Not runnable.
"""

from __future__ import annotations

import logging
from typing import Sequence

from streaming.errors import StreamingError

logger = logging.getLogger("cachegen.stream")


def ensure_calibrations(client, hashes: Sequence[str]) -> str | None:
    """Make every codec calibration in ``hashes`` available to the decoder. For each hash:
    nothing to do when this process or the cache folder has it
    (``codec.artifacts.has_artifact``); else the artifact is fetched once through
    ``client.get_calibration(hash)`` (cal/<hash> in the store) and given to the codec
    (``codec.artifacts.load_artifact``: verified by its content hash, never unpickled,
    made available to the decoder). Returns None when all are available, else the reason (one line): the
    caller treats it as a clean miss. Raises nothing for store or artifact faults."""
    for h in hashes or ():
        try:
            from codec import artifacts
        except ImportError as e:
            return f"calibration {h[:16]} needed: codec unavailable ({e})"
        if artifacts.has_artifact(h):
            continue
        getter = getattr(client, "get_calibration", None)
        if getter is None:
            return f"calibration {h[:16]} not on this machine and the store cannot serve it"
        try:
            data = getter(h)
        except (OSError, StreamingError) as e:
            return f"calibration {h[:16]} not on this machine; fetching it failed: {e}"
        if data is None:
            return (f"calibration {h[:16]} not on this machine and not in the store "
                    f"({getattr(client, 'last_miss_reason', '') or 'absent'})")
        try:
            artifacts.load_artifact(data, h)
        except ValueError as e:  # codec.CodecError
            return f"calibration {h[:16]} from the store does not verify: {e}"
        logger.info("stream: calibration %s fetched from the store (%d bytes)", h[:16], len(data))
    return None
