"""Helpers of stream_load's receiver: the queue item, cutting an overrunning transfer,
fetching the codec calibrations an entry needs, dropping a corrupt entry, and turning a
level (list) into a policy.

Part of streaming.client (which re-exports these names; see its docstring). The result
types are in streaming.client_result, the wire clock in streaming.client_wire. Not
runnable by itself.
"""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass
from typing import Sequence

from streaming.adapt_policy import FixedPolicy, Policy
from streaming.errors import StreamingError

logger = logging.getLogger("cachegen.stream")


@dataclass
class _Item:
    index: int
    level: int | None
    data: bytes | None
    transfer_s: float
    crc_ok: bool
    refetched: bool
    fetch_start_s: float
    fetch_end_s: float
    note: str = ""
    exc: BaseException | None = None


_DONE = object()
MAX_ABANDONS_PER_CHUNK = 5  # after this many cut attempts a chunk's transfer runs to the end


def _abort_connection(client, fired: threading.Event) -> None:
    """Timer callback: cut the client's connection so a blocked get_chunk returns at once
    (ConnectionClosed/OSError). The client's own abort() is used when it has one."""
    fired.set()
    ab = getattr(client, "abort", None)
    if callable(ab):
        ab()
        return
    sock = getattr(client, "_sock", None)
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def ensure_calibrations(client, hashes: Sequence[str]) -> str | None:
    """Make every codec calibration an entry needs available before its chunks are decoded
    (issue 25.5: an entry encoded with calibration H decodes on a machine that never fitted
    H). For each hash: nothing to do when this process or the cache folder has it
    (codec.kvtc.has_calibration); else the artifact is fetched once from the store
    (client.get_calibration: cal/<hash>), verified by its content hash and registered
    (codec.kvtc.calibration_from_bytes: safetensors + JSON, never unpickled; kept in the
    cache folder). Returns None when all are available, else the reason (one line): the
    caller treats it as a clean miss."""
    for h in hashes or ():
        try:
            from codec import kvtc
        except ImportError as e:
            return f"calibration {h[:16]} needed: codec unavailable ({e})"
        if kvtc.has_calibration(h):
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
            kvtc.calibration_from_bytes(data, h)
        except ValueError as e:  # codec.CodecError
            return f"calibration {h[:16]} from the store does not verify: {e}"
        logger.info("stream: calibration %s fetched from the store (%d bytes)", h[:16], len(data))
    return None


def _invalidate(client, key: str, gen: str, why: str) -> None:
    """Drop an entry whose stored chunk is missing or corrupt (if it is still that
    generation), so later lookups miss instead of failing forever. Best effort."""
    f = getattr(client, "invalidate", None)
    if f is None or not gen:
        return
    try:
        f(key, gen, why)
    except (OSError, StreamingError, ValueError) as e:
        logger.warning("stream: could not drop entry %s: %s", key[:16], e)


def _as_policy(p):
    if isinstance(p, Policy):
        return p
    if isinstance(p, int) or (isinstance(p, Sequence) and not isinstance(p, (str, bytes))):
        return FixedPolicy(p)
    raise TypeError("levels_or_policy must be an int level, a per-chunk list of levels, or a policy")

