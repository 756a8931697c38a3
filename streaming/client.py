"""Streaming client: fetch a context's chunks in order, decoding chunk k while chunk k+1
is still arriving; per-chunk levels from a policy (fixed or adaptive); text fallback.

Paper: CacheGen section 5 (streaming with pipelined decoding, per-chunk adaptation, text
fallback). A receiver thread requests chunk k+1 as soon as chunk k has arrived, puts the
bytes in a bounded queue, and the calling thread decodes; the total load time approaches
max(transfer, decode) instead of their sum.

Faults handled here: a chunk whose bytes fail the manifest CRC (or whose decode raises
ValueError, e.g. codec.CodecError) is refetched once, then falls back to text; a missing
chunk falls back to text; a dropped connection is reconnected once, after which the
remaining chunks fall back to text (LoadResult.error says why); an unknown key or an entry
of another model/config is a clean miss (LoadResult.hit False, .reason). A policy with a
transfer_deadline_s(k) (streaming.adapt.AdaptivePolicy) gets its overrunning transfers cut:
the connection is shut, nothing of the chunk is kept, the client reconnects and the policy
re-plans that chunk (LoadResult.abandoned lists the cut attempts). A policy with a
should_abandon(k, bytes received, s since the request[, wire_bytes=, wire_s=]) is asked every
PROGRESS_BYTES of a chunk's response (the early abandon of issue 15: a transfer whose
projected finish at the observed rate overruns its deadline is cut then, not at the
deadline), with the same clean cut; the rate is the wire clock's (kernel receive timestamps,
first to last byte) where the policy takes it; observe_abandon gets the bytes received by
the cut.

Not runnable by itself; see `python -m bench.streaming`.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import queue
import socket
import struct
import threading
import time
import zlib
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


def stream_load(
    client,
    key: str,
    levels_or_policy,
    decode_fn: DecodeFn | None = None,
    *,
    model_id: str | None = None,
    weights_hash: str | None = None,
    codec_tag: str | None = None,
    identity=None,
    before_chunk: Callable[[int], None] | None = None,
    on_decoded: Callable[[int, Any], None] | None = None,
    keep_decoded: bool = True,
    queue_depth: int = 2,
    clock: Callable[[], float] = time.perf_counter,
    plan: Sequence[tuple[int, int]] | None = None,
    plan_gen: str | None = None,
) -> LoadResult:
    """Load one stored context through `client` (a streaming.store.StoreClient).

    Args:
        key: context key (streaming.store.context_key).
        levels_or_policy: an int level, a per-chunk list of levels (None = text), or a policy
            object (streaming.adapt.AdaptivePolicy / FixedPolicy).
        decode_fn: bytes -> decoded chunk (default codec.decode_kv, CPU, returning (k, v)
            [L, T, H, D] tensors). ValueError (incl. codec.CodecError) counts as corruption.
        identity: a streaming.identity.EntryIdentity (or its dict) the entry must match
            (streaming.identity.check_entry); a mismatch is a clean miss with the reason.
        model_id, weights_hash, codec_tag: the expectation; a stored entry that differs is a
            clean miss, never served.
        before_chunk: hook(k) called by the receiver just before requesting chunk k (e.g.
            streaming.traces.apply_trace to change the link's rate).
        on_decoded: callback(k, decoded) in the calling thread as each chunk is decoded.
        keep_decoded: keep decoded chunks in LoadResult.decoded (False to save memory).
        queue_depth: chunks buffered between receiver and decoder (memory bound).
        plan: the token ranges (start, end) the caller planned from (a lookup's
            manifest) and will place decoded chunks at; a manifest whose first ranges
            differ (the entry was re-stored with another chunking since) is a clean miss
            with the reason, never KV at other positions.
        plan_gen: the write generation the caller planned from (Manifest.gen of its
            lookup): that generation's own manifest is read (and its chunks fetched), so a
            load racing an overwrite still gets the complete entry it planned from; a
            generation deleted since is a clean miss.
    Every chunk is checked against the manifest the load planned from (size, CRC-32,
    sha256, fetched from that manifest's write generation); a chunk missing or failing
    the check after one refetch is recomputed from text (ChunkStat.note says why) and the
    entry is dropped from the store if it is still that generation (no entry fails every
    later load). Calibrations the manifest names are fetched first (ensure_calibrations);
    one that cannot be had is a clean miss.
    Returns LoadResult (seconds, bytes). Raises only for programming errors (bad
    arguments, a decode_fn raising something other than ValueError, a hook failing).
    """
    policy = _as_policy(levels_or_policy)
    if decode_fn is None:
        decode_fn = default_decode_fn()
    t0 = clock()
    try:
        exp = {"identity": identity} if identity is not None else {}
        if plan_gen:
            exp["gen"] = plan_gen
        manifest = client.get_manifest(key, model_id=model_id, weights_hash=weights_hash, codec_tag=codec_tag,
                                       **exp)
    except (OSError, StreamingError) as e:
        return LoadResult(False, key, reason=f"store unreachable: {e}", total_s=clock() - t0, error=str(e))
    t_man = clock() - t0
    if manifest is None:
        return LoadResult(False, key, reason=client.last_miss_reason, total_s=t_man, manifest_s=t_man)
    if plan is not None:
        want = [(int(a), int(b)) for a, b in plan]
        have = [tuple(r) for r in manifest.token_ranges[:len(want)]]
        if have != want:
            why = (f"entry changed since lookup: re-stored with other chunks (planned "
                   f"{len(want)} chunks {want[:2]}..., stored {have[:2]}...): not loaded")
            logger.warning("stream: miss for %s: %s", key[:16], why)
            return LoadResult(False, key, reason=why, manifest=manifest, total_s=clock() - t0,
                              manifest_s=t_man)
    gen = getattr(manifest, "gen", "") or None
    why = ensure_calibrations(client, getattr(manifest, "calibrations", ()))
    if why:
        logger.warning("stream: miss for %s: %s", key[:16], why)
        return LoadResult(False, key, reason=why, manifest=manifest, total_s=clock() - t0, manifest_s=t_man)
    policy.start(manifest)
    n = manifest.chunk_count
    q: queue.Queue = queue.Queue(maxsize=max(1, queue_depth))
    stop = threading.Event()

    def put(item) -> None:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def fetch_verified(cl, k: int, lv: int, on_progress=None) -> tuple[bytes | None, float, bool, bool, str]:
        """-> (data or None, transfer_s, crc_ok, refetched, note). Refetches once on CRC failure."""
        want_crc, want_len = manifest.crc32[lv][k], manifest.sizes[lv][k]
        shas = getattr(manifest, "sha256", None) or {}
        want_sha = shas[lv][k] if lv in shas else None
        total_dt, refetched = 0.0, False
        for attempt in range(2):
            t = clock()
            data, wire, wire_bytes = _timed_get_chunk(cl, key, lv, k, on_progress if attempt == 0 else None,
                                                      gen)
            total_dt += clock() - t
            wire_of[k] = (wire, wire_bytes)
            if data is None:
                note = f"chunk missing: {cl.last_miss_reason}"
                logger.warning("stream: %s chunk %d level %d: %s; entry dropped", key[:16], k, lv, note)
                _invalidate(cl, key, gen, note)
                return None, total_dt, False, refetched, note
            if len(data) == want_len and zlib.crc32(data) == want_crc and \
                    (want_sha is None or hashlib.sha256(data).hexdigest() == want_sha):
                return data, total_dt, True, refetched, ""
            refetched = attempt == 0
        note = "CRC/sha256 mismatch after refetch"
        logger.warning("stream: %s chunk %d level %d: %s; entry dropped", key[:16], k, lv, note)
        _invalidate(cl, key, gen, note)
        return None, total_dt, False, True, note

    deadline_of = getattr(policy, "transfer_deadline_s", None)
    early_of = getattr(policy, "should_abandon", None)
    try:
        early_takes_wire = "wire_s" in inspect.signature(early_of).parameters
    except (TypeError, ValueError):
        early_takes_wire = False
    try:
        abandon_takes_bytes = len(inspect.signature(policy.observe_abandon).parameters) >= 4
    except (TypeError, ValueError, AttributeError):
        abandon_takes_bytes = False
    wire_of: dict[int, tuple[float | None, int]] = {}  # chunk -> (wire seconds, bytes timed)
    try:
        takes_end = len(inspect.signature(policy.observe_transfer).parameters) >= 5
    except (TypeError, ValueError):
        takes_end = False
    abandoned: list[dict] = []

    def receiver() -> None:
        reconnected = False
        k = 0
        tries = 0  # abandoned attempts of chunk k
        try:
            while k < n and not stop.is_set():
                if before_chunk is not None:
                    before_chunk(k)
                start = clock() - t0
                lv = policy.choose(k, start)
                if lv is None:
                    if hasattr(policy, "observe_text"):
                        policy.observe_text(k)
                    put(_Item(k, None, None, 0.0, True, False, start, start, "text chosen by policy"))
                    k, tries = k + 1, 0
                    continue
                # abandon on overrun (CacheGen section 5.2 re-plans per chunk): a timer cuts the
                # connection when the transfer runs past the policy's deadline for it
                dl = deadline_of(k) if (deadline_of is not None and tries < MAX_ABANDONS_PER_CHUNK) else None
                fired = threading.Event()
                timer = None
                if dl is not None:
                    timer = threading.Timer(max(0.0, dl), _abort_connection, args=(client, fired))
                    timer.daemon = True
                    timer.start()
                t_req = clock()
                got = [0, None]  # bytes received at the last progress check; s of an early cut
                on_progress = None
                if early_of is not None and dl is not None:
                    def on_progress(nbytes, wire_bytes=None, wire_s=None, k=k, t_req=t_req, fired=fired, got=got):
                        got[0] = nbytes
                        el = clock() - t_req
                        if fired.is_set():
                            return
                        if early_takes_wire and wire_bytes is not None:
                            cut = early_of(k, nbytes, el, wire_bytes=wire_bytes, wire_s=wire_s)
                        else:
                            cut = early_of(k, nbytes, el)
                        if cut:
                            got[1] = el
                            _abort_connection(client, fired)
                try:
                    data, dt, ok, ref, note = fetch_verified(client, k, lv, on_progress)
                except (OSError, StreamingError) as e:
                    if timer is not None:
                        timer.cancel()
                    if fired.is_set():  # abandoned by us: reconnect and re-plan chunk k
                        wire = got[1] if got[1] is not None else clock() - t_req
                        abandoned.append({"chunk": k, "level": lv, "deadline_s": dl, "wire_s": wire,
                                          "start_s": start, "early": got[1] is not None,
                                          "received_bytes": got[0]})
                        try:
                            client.reconnect()
                        except (OSError, StreamingError) as e2:
                            for j in range(k, n):
                                put(_Item(j, None, None, 0.0, False, False, start, clock() - t0,
                                          f"connection lost: {e2!r}"))
                            return
                        if abandon_takes_bytes:
                            policy.observe_abandon(k, lv, wire, got[0] or None)
                        else:
                            policy.observe_abandon(k, lv, wire)
                        tries += 1
                        continue
                    err = e
                    data = None
                    if not reconnected:  # retry chunk k once on a fresh connection
                        reconnected = True
                        try:
                            client.reconnect()
                            data, dt, ok, ref, note = fetch_verified(client, k, lv)
                            err = None
                        except (OSError, StreamingError) as e2:
                            err = e2
                    if err is not None:
                        for j in range(k, n):
                            put(_Item(j, None, None, 0.0, False, False, start, clock() - t0,
                                      f"connection lost: {err!r}"))
                        return
                if timer is not None:
                    timer.cancel()
                    if fired.is_set():  # the timer fired as the last byte arrived: fresh socket
                        try:
                            client.reconnect()
                        except (OSError, StreamingError):
                            pass  # the next request connects again
                if data is not None:
                    # goodput sample: bytes after the first read / first-to-last byte on the wire
                    # (kernel timestamps); the request-to-last-byte time when not available
                    wire, wbytes = wire_of.get(k, (None, 0))
                    s_bytes, s_dt = (wbytes, wire) if wire else (len(data), dt)
                    if takes_end:
                        policy.observe_transfer(k, lv, s_bytes, s_dt, clock() - t0)
                    else:  # a policy wrapper with the older 4-argument signature
                        policy.observe_transfer(k, lv, s_bytes, s_dt)
                put(_Item(k, lv, data, dt, ok, ref, start, clock() - t0,
                          note or (f"after {tries} abandoned attempt(s)" if tries else "")))
                k, tries = k + 1, 0
        except BaseException as e:  # noqa: BLE001 - handed to the calling thread
            put(_Item(k, None, None, 0.0, False, False, 0.0, 0.0, "receiver failed", exc=e))
        finally:
            put(_DONE)

    rx = threading.Thread(target=receiver, name="cgh-stream-rx", daemon=True)
    rx.start()
    res = LoadResult(True, key, manifest=manifest, manifest_s=t_man)
    res.decoded = [None] * n
    side = None  # second connection for refetches after a decode failure
    try:
        while True:
            it = q.get()
            if it is _DONE:
                break
            if it.exc is not None:
                raise it.exc
            a, b = manifest.token_ranges[it.index]
            st = ChunkStat(it.index, it.level, True, 0, it.transfer_s, 0.0, it.crc_ok, it.refetched,
                           a, b, it.fetch_start_s, it.fetch_end_s, 0.0, it.note)
            if it.note.startswith("connection lost") and res.error is None:
                res.error = it.note
            if it.data is not None:
                st.bytes = len(it.data)
                td = clock()
                try:
                    out = decode_fn(it.data)
                    ok = True
                except ValueError as e:
                    ok, st.note = False, f"decode failed: {e}"
                if not ok:  # refetch once over a side connection, then text
                    st.refetched = True
                    try:
                        side = side or client.clone()
                        data2, dt2, crc2, _, note2 = fetch_verified(side, it.index, it.level)
                        st.transfer_s += dt2
                        if data2 is not None:
                            out = decode_fn(data2)
                            ok, st.note = True, "decode failed once, refetch decoded"
                    except ValueError as e:
                        st.note = f"decode failed after refetch: {e}"
                    except (OSError, StreamingError) as e:
                        st.note = f"refetch failed: {e!r}"
                st.decode_s = clock() - td
                if ok:
                    st.text_fallback = False
                    policy.observe_decode(it.index, st.decode_s)
                    if keep_decoded:
                        res.decoded[it.index] = out
                    if on_decoded is not None:
                        on_decoded(it.index, out)
                else:
                    st.level = None
            else:
                st.level = None
            st.decode_end_s = clock() - t0
            res.chunks.append(st)
    finally:
        stop.set()
        rx.join(timeout=5)
        if side is not None:
            side.close()
    res.total_s = clock() - t0
    res.transfer_s = sum(c.transfer_s for c in res.chunks)
    res.decode_s = sum(c.decode_s for c in res.chunks)
    res.decisions = list(getattr(policy, "decisions", []))
    res.abandoned = abandoned
    return res
