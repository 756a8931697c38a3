"""Streaming client: fetch a context's chunks in order, decoding chunk k while chunk k+1
is still arriving; per-chunk levels from a policy (fixed or adaptive); text fallback.

Paper: CacheGen section 5 (streaming with pipelined decoding, per-chunk adaptation, text
fallback). A receiver thread requests chunk k+1 as soon as chunk k has arrived, puts the
bytes in a bounded queue, and the calling thread decodes; the total load time approaches
max(transfer, decode) instead of their sum.

One load, step by step (stream_load):
1. ``open_entry``: read the manifest the load plans from (identity, planned chunking and
   write generation checked; the codec calibrations it names made available) - or a miss.
2. ``_Receiver`` (a thread): per chunk, the policy's choice (a level, or text); the
   transfer, watched by a ``_Cut`` (the policy's deadline and early abandon); the bytes
   verified against the manifest (one refetch); the goodput sample back to the policy.
3. ``_Decoder`` (the calling thread): decode each chunk as it arrives (one refetch over a
   side connection when the bytes do not decode), hand it to the caller, time it.

Faults handled here: a chunk whose bytes fail the manifest's size and sha256 (CRC-32 for
manifests without sha256), or whose decode raises ValueError (e.g. codec.CodecError), is
refetched once, then falls back to text; a missing chunk falls back to text; a dropped
connection is reconnected once, after which the remaining chunks fall back to text
(LoadResult.error says why); an unknown key or an entry of another model/config is a clean
miss (LoadResult.hit False, .reason). A transfer that runs past the policy's
transfer_deadline_s(k) is cut: the connection is shut, nothing of the chunk is kept, the
client reconnects and the policy re-plans that chunk (LoadResult.abandoned lists the cut
attempts). Earlier than that, every PROGRESS_BYTES of a chunk's response the policy's
should_abandon(k, bytes received, s since the request, wire_bytes=, wire_s=) may cut a
transfer whose projected finish at the observed rate overruns its deadline, with the same
clean cut; the rate is the wire clock's (kernel receive timestamps, first to last byte);
observe_abandon gets the bytes received by the cut.

Not runnable by itself; see `python -m bench.streaming`. The result types are in
streaming.load_result, the wire clock and timed chunk get in streaming.wire_clock.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import socket
import threading
import time
import zlib
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from streaming.adapt.policy import FixedPolicy, Policy
from streaming.calibrations import ensure_calibrations
from streaming.identity import NO_LEVEL_KEY
from streaming.load_result import ChunkStat, DecodeFn, LoadResult, default_decode_fn
from streaming.wire_clock import timed_get_chunk
from streaming.errors import StreamingError
from streaming.shutdown import put_until_stopped

logger = logging.getLogger("cachegen.stream")

MAX_ABANDONS_PER_CHUNK = 5  # after this many cut attempts a chunk's transfer runs to the end


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
        levels_or_policy: an int level, NO_LEVEL_KEY ("none": the one slot of an entry of
            a codec without levels), a per-chunk list of these (None = text), or a
            :class:`streaming.adapt.policy.Policy` (AdaptivePolicy, FixedPolicy). A policy
            sees such an entry's slot as the option "none" (policy_manifest): its None
            stays text.
        decode_fn: bytes -> decoded chunk (default codec.decode_kv, CPU, returning (k, v)
            [L, T, H, D] tensors). ValueError (incl. codec.CodecError) counts as corruption.
        identity: a streaming.identity.EntryIdentity (or its dict) the entry must match
            (streaming.identity.check_entry); a mismatch is a clean miss with the reason.
        model_id, weights_hash, codec_tag: the expectation; a stored entry that differs is a
            clean miss, never served.
        before_chunk: hook(k) called by the receiver just before requesting chunk k (e.g.
            streaming.adapt.traces.apply_trace to change the link's rate).
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
    Every chunk is checked against the manifest the load planned from (size and sha256;
    CRC-32 where an older manifest has no sha256; fetched from that manifest's write
    generation); a chunk missing or failing the check after one refetch is recomputed from
    text (ChunkStat.note says why) and the entry is dropped from the store if it is still
    that generation (no entry fails every later load). Calibrations the manifest names are
    fetched first (ensure_calibrations); one that cannot be had is a clean miss.
    Returns LoadResult (seconds, bytes). Raises only for programming errors (bad
    arguments, a decode_fn raising something other than ValueError, a hook failing).
    """
    policy = as_policy(levels_or_policy)
    t0 = clock()
    opened = open_entry(client, key, clock, t0, identity=identity, model_id=model_id,
                        weights_hash=weights_hash, codec_tag=codec_tag, plan=plan, plan_gen=plan_gen)
    if isinstance(opened, LoadResult):
        return opened
    manifest, t_man = opened
    view = policy_manifest(manifest)
    policy.start(view)
    rx = _Receiver(client, key, view, policy, clock, t0, before_chunk, queue_depth)
    dec = _Decoder(rx, decode_fn or default_decode_fn())
    res = LoadResult(True, key, manifest=manifest, manifest_s=t_man)
    res.decoded = [None] * manifest.chunk_count
    rx.start()
    try:
        while True:
            it = rx.q.get()
            if it is _DONE:
                break
            if it.exc is not None:
                raise it.exc
            if it.note.startswith("connection lost") and res.error is None:
                res.error = it.note
            st, ok, out = dec.chunk(it)
            if ok:
                policy.observe_decode(it.index, st.decode_s)
                if keep_decoded:
                    res.decoded[it.index] = out
                if on_decoded is not None:
                    on_decoded(it.index, out)
            st.decode_end_s = clock() - t0
            res.chunks.append(st)
    finally:
        rx.close()
        dec.close()
    res.total_s = clock() - t0
    res.transfer_s = sum(c.transfer_s for c in res.chunks)
    res.decode_s = sum(c.decode_s for c in res.chunks)
    res.decisions = list(policy.decisions)
    res.abandoned = rx.abandoned
    return res


def as_policy(levels_or_policy) -> Policy:
    """A Policy as it is, an int level, NO_LEVEL_KEY or a per-chunk list of these (None =
    text) as a FixedPolicy. Raises TypeError otherwise."""
    p = levels_or_policy
    if isinstance(p, Policy):
        return p
    if isinstance(p, int) or p == NO_LEVEL_KEY or (isinstance(p, Sequence) and not isinstance(p, (str, bytes))):
        return FixedPolicy(p)
    raise TypeError('levels_or_policy must be an int level, "none" (no level), a per-chunk list of '
                    'levels, or a policy')


def policy_manifest(manifest):
    """The manifest as a policy sees it: the same, except that an entry of a codec without
    levels (stored level None, which a policy's choice would read as text) names its slot
    NO_LEVEL_KEY ("none") in levels, sizes, crc32 and sha256. store_level maps a choice
    back."""
    if tuple(manifest.levels) != (None,):
        return manifest
    return replace(manifest, levels=(NO_LEVEL_KEY,),
                   sizes={NO_LEVEL_KEY: manifest.sizes[None]}, crc32={NO_LEVEL_KEY: manifest.crc32[None]},
                   sha256={NO_LEVEL_KEY: manifest.sha256[None]} if None in manifest.sha256 else {})


def store_level(option):
    """The stored level of a policy's option (policy_manifest): NO_LEVEL_KEY -> None (a
    codec without levels), a level -> itself."""
    return None if option == NO_LEVEL_KEY else option


def open_entry(client, key: str, clock: Callable[[], float], t0: float, *, identity=None,
               model_id: str | None = None, weights_hash: str | None = None, codec_tag: str | None = None,
               plan: Sequence[tuple[int, int]] | None = None, plan_gen: str | None = None):
    """The first step of a load: the manifest it plans from -> (manifest, seconds it took),
    or a miss as a LoadResult (hit False, with the reason): the store unreachable, no entry
    (or one of another identity or generation), an entry re-stored with other chunks than
    ``plan``, a codec calibration it names that cannot be had. Raises nothing for store
    faults."""
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
    why = None
    if plan is not None:
        want = [(int(a), int(b)) for a, b in plan]
        have = [tuple(r) for r in manifest.token_ranges[:len(want)]]
        if have != want:
            why = (f"entry changed since lookup: re-stored with other chunks (planned "
                   f"{len(want)} chunks {want[:2]}..., stored {have[:2]}...): not loaded")
    why = why or ensure_calibrations(client, getattr(manifest, "calibrations", ()))
    if why:
        logger.warning("stream: miss for %s: %s", key[:16], why)
        return LoadResult(False, key, reason=why, manifest=manifest, total_s=clock() - t0, manifest_s=t_man)
    return manifest, t_man


@dataclass
class _Item:
    """One chunk handed from the receiver to the decoder (data None: text)."""

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


_DONE = object()  # the receiver's last item


def _abort_connection(client, fired: threading.Event) -> None:
    """Cut the client's connection so a blocked get_chunk returns at once
    (ConnectionClosed/OSError); sets `fired` first. The client's own abort() is used when it
    has one."""
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


def _invalidate(client, key: str, gen: str | None, why: str) -> None:
    """Drop an entry whose stored chunk is missing or corrupt (if it is still that
    generation), so later lookups miss instead of failing forever. Best effort."""
    f = getattr(client, "invalidate", None)
    if f is None or not gen:
        return
    try:
        f(key, gen, why)
    except (OSError, StreamingError, ValueError) as e:
        logger.warning("stream: could not drop entry %s: %s", key[:16], e)


class _Cut:
    """The abandon of one transfer: a timer that cuts the connection at the policy's
    deadline (wire seconds; None: no timer), and what an early cut saw (bytes received,
    seconds since the request at the cut, the wire clock's bytes and seconds)."""

    def __init__(self, client, deadline_s: float | None):
        self.client = client
        self.fired = threading.Event()
        self.received = 0
        self.early_s: float | None = None
        self.wire_bytes: int | None = None
        self.wire_s: float | None = None
        self.timer = None
        if deadline_s is not None:
            self.timer = threading.Timer(max(0.0, deadline_s), _abort_connection, args=(client, self.fired))
            self.timer.daemon = True
            self.timer.start()

    def now(self) -> None:
        _abort_connection(self.client, self.fired)

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()

    def finish(self) -> None:
        """After a transfer that completed: stop the timer; if it fired as the last byte
        arrived, the socket was cut: take a fresh one (best effort: the next request
        connects again)."""
        if self.timer is None:
            return
        self.timer.cancel()
        if self.fired.is_set():
            try:
                self.client.reconnect()
            except (OSError, StreamingError):
                pass


class _Receiver:
    """The receiver thread of one load: chooses each chunk's option, fetches and verifies
    its bytes (cut on overrun, one reconnect), and queues them for the decoder (bounded:
    queue_depth chunks). ``abandoned`` lists the cut attempts."""

    def __init__(self, client, key: str, manifest, policy: Policy, clock: Callable[[], float], t0: float,
                 before_chunk: Callable[[int], None] | None, queue_depth: int):
        self.client, self.key, self.manifest, self.policy = client, key, manifest, policy
        self.clock, self.t0, self.before_chunk = clock, t0, before_chunk
        self.gen = getattr(manifest, "gen", "") or None
        self.q: queue.Queue = queue.Queue(maxsize=max(1, queue_depth))
        self.stop = threading.Event()
        self.wire_of: dict[int, tuple[float | None, int]] = {}  # chunk -> (wire seconds, bytes timed)
        self.abandoned: list[dict] = []
        self.reconnected = False
        self.thread = threading.Thread(target=self.run, name="cgh-stream-rx", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)

    def now(self) -> float:
        return self.clock() - self.t0

    def put(self, item) -> None:
        put_until_stopped(self.q, item, self.stop)

    def run(self) -> None:
        k, tries = 0, 0  # tries: abandoned attempts of chunk k
        n = self.manifest.chunk_count
        try:
            while k < n and not self.stop.is_set():
                if self.before_chunk is not None:
                    self.before_chunk(k)
                start = self.now()
                lv = self.policy.choose(k, start)
                if lv is None:
                    self.policy.observe_text(k)
                    self.put(_Item(k, None, None, 0.0, True, False, start, start, "text chosen by policy"))
                    k, tries = k + 1, 0
                    continue
                outcome = self.transfer(k, lv, start, tries)
                if outcome == "lost":
                    return
                if outcome == "abandoned":
                    tries += 1
                    continue
                k, tries = k + 1, 0
        except BaseException as e:  # noqa: BLE001 - handed to the calling thread
            self.put(_Item(k, None, None, 0.0, False, False, 0.0, 0.0, "receiver failed", exc=e))
        finally:
            self.put(_DONE)

    def transfer(self, k: int, lv: int, start: float, tries: int) -> str:
        """Fetch chunk k at level lv and queue it -> "done", "abandoned" (cut: the policy
        re-plans chunk k) or "lost" (the connection could not be had again: every chunk
        left is queued as text)."""
        # abandon on overrun (CacheGen section 5.2 re-plans per chunk)
        dl = self.policy.transfer_deadline_s(k) if tries < MAX_ABANDONS_PER_CHUNK else None
        cut = _Cut(self.client, dl)
        t_req = self.clock()
        on_progress = None if dl is None else self.progress_check(k, cut, t_req)
        try:
            data, dt, ok, ref, note = self.fetch_verified(self.client, k, lv, on_progress)
        except (OSError, StreamingError) as e:
            cut.cancel()
            if cut.fired.is_set():
                return self.after_cut(k, lv, dl, start, cut, t_req)
            got = self.retry_once(k, lv, start, e)
            if got is None:
                return "lost"
            data, dt, ok, ref, note = got
        cut.finish()
        if data is not None:
            # goodput sample: bytes after the first read / first-to-last byte on the wire
            # (kernel timestamps); the request-to-last-byte time when not available
            wire, wbytes = self.wire_of.get(k, (None, 0))
            s_bytes, s_dt = (wbytes, wire) if wire else (len(data), dt)
            self.policy.observe_transfer(k, lv, s_bytes, s_dt, self.now())
        self.put(_Item(k, lv, data, dt, ok, ref, start, self.now(),
                       note or (f"after {tries} abandoned attempt(s)" if tries else "")))
        return "done"

    def progress_check(self, k: int, cut: _Cut, t_req: float):
        """The callback the wire clock calls every PROGRESS_BYTES: asks the policy's
        should_abandon and cuts at once when it says so."""
        def on_progress(nbytes, wire_bytes=None, wire_s=None):
            cut.received, cut.wire_bytes, cut.wire_s = nbytes, wire_bytes, wire_s
            el = self.clock() - t_req
            if cut.fired.is_set():
                return
            if self.policy.should_abandon(k, nbytes, el, wire_bytes=wire_bytes, wire_s=wire_s):
                cut.early_s = el
                cut.now()
        return on_progress

    def after_cut(self, k: int, lv: int, dl: float | None, start: float, cut: _Cut, t_req: float) -> str:
        """Chunk k's transfer was cut by us: record it, reconnect, tell the policy."""
        wire = cut.early_s if cut.early_s is not None else self.clock() - t_req
        early = cut.early_s is not None
        self.abandoned.append({"chunk": k, "level": store_level(lv), "deadline_s": dl, "wire_s": wire, "start_s": start,
                               "early": early, "rule": "projection" if early else "deadline",
                               "received_bytes": cut.received, "wire_clock_bytes": cut.wire_bytes,
                               "wire_clock_s": cut.wire_s})
        try:
            self.client.reconnect()
        except (OSError, StreamingError) as e2:
            self.fail_rest(k, start, f"connection lost: {e2!r}")
            return "lost"
        self.policy.observe_abandon(k, lv, wire, cut.received or None)
        return "abandoned"

    def retry_once(self, k: int, lv: int, start: float, err: BaseException):
        """The connection failed under chunk k: once per load, retry it on a fresh
        connection -> fetch_verified's tuple, or None after queueing the rest as text."""
        if not self.reconnected:
            self.reconnected = True
            try:
                self.client.reconnect()
                return self.fetch_verified(self.client, k, lv)
            except (OSError, StreamingError) as e2:
                err = e2
        self.fail_rest(k, start, f"connection lost: {err!r}")
        return None

    def fail_rest(self, k: int, start: float, note: str) -> None:
        for j in range(k, self.manifest.chunk_count):
            self.put(_Item(j, None, None, 0.0, False, False, start, self.now(), note))

    def fetch_verified(self, cl, k: int, lv: int, on_progress=None) -> tuple[bytes | None, float, bool, bool, str]:
        """-> (data or None, transfer_s, crc_ok, refetched, note). Refetches once when the
        bytes fail the manifest's size or sha256 (_content_ok); a chunk missing or failing twice
        drops the entry (if still this generation)."""
        m = self.manifest
        want_crc, want_len = m.crc32[lv][k], m.sizes[lv][k]
        shas = getattr(m, "sha256", None) or {}
        want_sha = shas[lv][k] if lv in shas else None
        total_dt, refetched = 0.0, False
        for attempt in range(2):
            t = self.clock()
            data, wire, wire_bytes = timed_get_chunk(cl, self.key, store_level(lv), k, on_progress if attempt == 0 else None,
                                                     self.gen)
            total_dt += self.clock() - t
            self.wire_of[k] = (wire, wire_bytes)
            if data is None:
                note = f"chunk missing: {cl.last_miss_reason}"
                logger.warning("stream: %s chunk %d level %s: %s; entry dropped", self.key[:16], k, lv, note)
                _invalidate(cl, self.key, self.gen, note)
                return None, total_dt, False, refetched, note
            if len(data) == want_len and _content_ok(data, want_crc, want_sha):
                return data, total_dt, True, refetched, ""
            refetched = attempt == 0
        note = "CRC/sha256 mismatch after refetch"
        logger.warning("stream: %s chunk %d level %s: %s; entry dropped", self.key[:16], k, lv, note)
        _invalidate(cl, self.key, self.gen, note)
        return None, total_dt, False, True, note


def _content_ok(data: bytes, want_crc: int, want_sha: str | None) -> bool:
    """Whether a chunk's bytes are the ones the manifest names: by sha256 when the manifest
    has it (it proves the entry; a CRC-32 beside it would only add a second pass over the
    bytes on the decode path), else by CRC-32 (manifests written before sha256)."""
    if want_sha is not None:
        return hashlib.sha256(data).hexdigest() == want_sha
    return zlib.crc32(data) == want_crc


class _Decoder:
    """The decoding side of one load (the calling thread): decodes each queued chunk, with
    one refetch over a side connection when its bytes do not decode."""

    def __init__(self, rx: _Receiver, decode_fn: DecodeFn):
        self.rx, self.decode_fn = rx, decode_fn
        self.side = None  # second connection for refetches after a decode failure

    def close(self) -> None:
        if self.side is not None:
            self.side.close()

    def chunk(self, it: _Item) -> tuple[ChunkStat, bool, Any]:
        """-> (its ChunkStat, decoded?, the decoded chunk or None)."""
        a, b = self.rx.manifest.token_ranges[it.index]
        st = ChunkStat(it.index, store_level(it.level), True, 0, it.transfer_s, 0.0, it.crc_ok, it.refetched,
                       a, b, it.fetch_start_s, it.fetch_end_s, 0.0, it.note)
        if it.data is None:
            st.level = None
            return st, False, None
        st.bytes = len(it.data)
        td = self.rx.clock()
        out, ok = None, True
        try:
            out = self.decode_fn(it.data)
        except ValueError as e:
            ok, st.note = False, f"decode failed: {e}"
        if not ok:
            ok, out = self.refetch(it, st)
        st.decode_s = self.rx.clock() - td
        if ok:
            st.text_fallback = False
        else:
            st.level = None
        return st, ok, out

    def refetch(self, it: _Item, st: ChunkStat) -> tuple[bool, Any]:
        """The bytes did not decode: fetch them once more over a side connection and decode."""
        st.refetched = True
        try:
            self.side = self.side or self.rx.client.clone()
            data2, dt2, _, _, _ = self.rx.fetch_verified(self.side, it.index, it.level)
            st.transfer_s += dt2
            if data2 is not None:
                out = self.decode_fn(data2)
                st.note = "decode failed once, refetch decoded"
                return True, out
        except ValueError as e:
            st.note = f"decode failed after refetch: {e}"
        except (OSError, StreamingError) as e:
            st.note = f"refetch failed: {e!r}"
        return False, None
