"""Parts of the streaming client: load results, the receiver's wire clock, chunk gets.

Part of streaming.client (which re-exports every name here; see its docstring): ChunkStat
and LoadResult (what stream_load returns), _WireClock (kernel receive timestamps and the
low-water mark, issue 14), timed chunk fetches with progress callbacks, calibration fetch
(ensure_calibrations) and the cut of an overrunning transfer. Not runnable by itself.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from streaming.adapt import FixedPolicy
from streaming.errors import StreamingError

DecodeFn = Callable[[bytes], Any]
logger = logging.getLogger("cachegen.stream")


def default_decode_fn() -> DecodeFn:
    """codec.decode_kv on CPU (imported lazily: the link itself knows no codec)."""
    from codec import decode_kv

    return lambda data: decode_kv(data, device="cpu")


@dataclass
class ChunkStat:
    """Per-chunk record. Units: bytes, seconds. level None when text_fallback."""

    index: int
    level: int | None
    text_fallback: bool
    bytes: int
    transfer_s: float
    decode_s: float
    crc_ok: bool
    refetched: bool
    token_start: int = 0
    token_end: int = 0
    fetch_start_s: float = 0.0  # offsets from the start of the load
    fetch_end_s: float = 0.0
    decode_end_s: float = 0.0
    note: str = ""


@dataclass
class LoadResult:
    """Outcome of stream_load. decoded[i] is decode_fn's output for chunk i, or None for a
    text chunk (the caller recomputes token ranges text_token_ranges with the engine)."""

    hit: bool
    key: str
    reason: str = ""
    manifest: Any = None
    chunks: list[ChunkStat] = field(default_factory=list)
    decoded: list[Any] = field(default_factory=list)
    total_s: float = 0.0
    manifest_s: float = 0.0
    transfer_s: float = 0.0
    decode_s: float = 0.0
    error: str | None = None
    decisions: list = field(default_factory=list)
    abandoned: list = field(default_factory=list)  # transfers cut on overrun: chunk, level, deadline_s, wire_s

    @property
    def bytes(self) -> int:
        return sum(c.bytes for c in self.chunks)

    @property
    def text_token_ranges(self) -> list[tuple[int, int]]:
        return [(c.token_start, c.token_end) for c in self.chunks if c.text_fallback]

    @property
    def recompute_tokens(self) -> int:
        return sum(b - a for a, b in self.text_token_ranges)

    def to_dict(self) -> dict:
        """JSON-able summary (without the decoded tensors)."""
        return {
            "hit": self.hit, "key": self.key, "reason": self.reason, "error": self.error,
            "total_s": self.total_s, "manifest_s": self.manifest_s, "transfer_s": self.transfer_s,
            "decode_s": self.decode_s, "bytes": self.bytes, "recompute_tokens": self.recompute_tokens,
            "chunks": [asdict(c) for c in self.chunks],
            "decisions": [asdict(d) for d in self.decisions],
            "abandoned": list(self.abandoned),
        }


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
PROGRESS_BYTES = 64 * 1024  # the policy's should_abandon is asked after every this many bytes


class _WireClock:
    """Socket wrapper timing a response on the wire: kernel receive timestamps
    (SO_TIMESTAMPNS, Linux) of the first and the last read that returned bytes, so the
    goodput sample excludes the request latency, the server's read of the chunk and the
    receiver thread's own scheduling delays (CacheGen section 5.2 needs the network's
    throughput, not the receiver's back-pressure). Falls back to perf_counter at each read
    where the kernel gives no timestamp. Everything else is delegated to the socket.

    Wake-ups (issue 14): every read sets the socket's receive low-water mark
    (SO_RCVLOWAT, Linux socket(7)) to the bytes it asks for, capped at LOWAT_MAX, so the
    receiver thread wakes once per ~128 KiB instead of once per arriving segment burst.
    On a shaped link the per-segment wake-ups (a Python loop taking the GIL each time) ran
    beside the decode on the same 2 cores and made the decode of the chunk being received
    alongside 4-6x slower at 500 Mbit/s (docs/vllm-connector.md, "Overlap"). Readers ask
    for exactly the bytes they still need (streaming.protocol.recv_exact), so a read never
    waits for bytes that are not coming; `restore()` puts the mark back to 1."""

    LOWAT_MAX = 1 << 17  # bytes

    def __init__(self, sock: socket.socket):
        self._s = sock
        self.first: float | None = None
        self.last: float | None = None
        self.first_bytes = 0
        self.nbytes = 0
        self.kernel = False
        self.reads = 0
        self._lowat = 1
        # callable(bytes received so far, bytes after the first read, wire_s() or None),
        # called every PROGRESS_BYTES
        self.on_progress = None
        self._checked = 0
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_TIMESTAMPNS, 1)
            self._ts = True
        except (OSError, AttributeError):
            self._ts = False

    def _set_lowat(self, n: int) -> None:
        n = max(1, min(int(n), self.LOWAT_MAX))
        if n == self._lowat or self._lowat is None:
            return
        try:
            self._s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, n)
            self._lowat = n
        except (OSError, AttributeError):
            self._lowat = None  # not supported here: plain reads

    def restore(self) -> None:
        """Low-water mark back to 1 byte (the socket outlives this wrapper)."""
        self._set_lowat(1)

    def recv_into(self, buf, nbytes: int = 0, flags: int = 0, _wait_all: bool = True) -> int:
        view = memoryview(buf)
        if nbytes:
            view = view[:nbytes]
        self._set_lowat(len(view) if _wait_all else 1)
        self.reads += 1
        if not self._ts:
            n = self._s.recv_into(view, 0, flags)
            t = time.perf_counter()
        else:
            n, anc, _, _ = self._s.recvmsg_into([view], 64, flags)
            t = None
            for level, typ, data in anc:
                if level == socket.SOL_SOCKET and typ == getattr(socket, "SCM_TIMESTAMPNS", -1) and len(data) >= 16:
                    sec, nsec = struct.unpack("qq", data[:16])
                    t = sec + nsec * 1e-9
                    self.kernel = True
            if t is None:
                t = time.time()
        if n:
            if self.first is None:
                self.first, self.first_bytes = t, n
            self.last = t
            self.nbytes += n
            if self.on_progress is not None and self.nbytes - self._checked >= PROGRESS_BYTES:
                self._checked = self.nbytes
                # may cut the connection: the next read fails
                self.on_progress(self.nbytes, self.nbytes - self.first_bytes, self.wire_s())
        return n

    def recv(self, n: int, flags: int = 0) -> bytes:
        buf = bytearray(n)
        got = self.recv_into(buf, n, flags, _wait_all=False)  # "up to n": no low-water mark
        return bytes(buf[:got])

    def wire_s(self) -> float | None:
        """Seconds from the first to the last byte of the response (None if < 2 reads)."""
        if self.first is None or self.last is None or self.last <= self.first:
            return None
        return self.last - self.first

    def __getattr__(self, name):
        return getattr(self._s, name)


def _get(cl, key: str, lv: int, k: int, gen: str | None):
    return cl.get_chunk(key, lv, k, gen=gen) if gen else cl.get_chunk(key, lv, k)


def _timed_get_chunk(cl, key: str, lv: int, k: int, on_progress=None, gen: str | None = None):
    """cl.get_chunk (of write generation `gen`, the manifest's) with the wire clock around
    its socket -> (data, wire_s or None, bytes after the first read). Uses the
    StoreClient's socket when it exposes one. on_progress(bytes received so far) is called
    every PROGRESS_BYTES of the response."""
    if not hasattr(cl, "_sock") or not hasattr(cl, "connect"):
        return _get(cl, key, lv, k, gen), None, 0
    cl.connect()
    raw = cl._sock
    if not isinstance(raw, socket.socket):
        return _get(cl, key, lv, k, gen), None, 0
    w = _WireClock(raw)
    w.on_progress = on_progress
    cl._sock = w
    try:
        data = _get(cl, key, lv, k, gen)
    finally:
        if cl._sock is w:  # the client closes (sets None) on errors; keep that
            cl._sock = raw
            try:
                w.restore()
            except OSError:
                pass
    return data, w.wire_s(), w.nbytes - w.first_bytes


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
    if hasattr(p, "choose") and hasattr(p, "start"):
        return p
    if isinstance(p, int) or (isinstance(p, Sequence) and not isinstance(p, (str, bytes))):
        return FixedPolicy(p)
    raise TypeError("levels_or_policy must be an int level, a per-chunk list of levels, or a policy")

