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
The result types live in streaming.client_result, the wire clock and timed chunk get in
streaming.client_wire, the other receiver helpers in streaming.client_parts (all
re-exported here).
"""

from __future__ import annotations

import hashlib
import inspect
import queue
import threading
import time
import zlib
from typing import Any, Callable, Sequence

from streaming.client_parts import (  # noqa: F401  (re-exported)
    _DONE,
    MAX_ABANDONS_PER_CHUNK,
    _abort_connection,
    _as_policy,
    _invalidate,
    _Item,
    ensure_calibrations,
    logger,
)
from streaming.client_result import ChunkStat, DecodeFn, LoadResult, default_decode_fn  # noqa: F401
from streaming.client_wire import PROGRESS_BYTES, _get, _timed_get_chunk, _WireClock  # noqa: F401
from streaming.errors import StreamingError
from streaming.plumbing import put_until_stopped


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
        put_until_stopped(q, item, stop)

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
                # bytes received at the last progress check; s of an early cut; the wire clock's
                # bytes and seconds at that check (None where the receiver has no wire clock)
                got = [0, None, None, None]
                on_progress = None
                if early_of is not None and dl is not None:
                    def on_progress(nbytes, wire_bytes=None, wire_s=None, k=k, t_req=t_req, fired=fired, got=got):
                        got[0], got[2], got[3] = nbytes, wire_bytes, wire_s
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
                                          "rule": "projection" if got[1] is not None else "deadline",
                                          "received_bytes": got[0], "wire_clock_bytes": got[2],
                                          "wire_clock_s": got[3]})
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

